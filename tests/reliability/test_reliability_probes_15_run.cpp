// Reliability, input side, the fifteenth probe (docs/reliability.md, "fifteenth probe"): training runs and scenario files: the scenario's "train" section from Python, --save-scenario of a run's data, a resumed run with no step left, numbers and names in a run's flags and fields. Each case runs the real `piper` binary (the HostileInput fixture).
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "hostile_input.hpp"

namespace fs = std::filesystem;
using piper::test::CliResult;
using piper::test::HostileInput;
using piper::test::kTiny;

namespace {

}  // namespace
