// Reliability, input side, the fifteenth probe (docs/reliability.md, "fifteenth probe"): CSV readers and input files:
// files that are not regular files, oversized and non-UTF-8 results files in Python, CSV quoting and byte-order marks,
// bounds messages, piper-studio's command line. Each case runs the real `piper` binary (the HostileInput fixture).
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "hostile_input.hpp"

namespace fs = std::filesystem;
using piper::test::CliResult;
using piper::test::HostileInput;
using piper::test::kTiny;

namespace {}  // namespace
