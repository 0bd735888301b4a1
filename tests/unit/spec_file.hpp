// A model spec written to a file of the test process's own, for tests that compile a ModelConfig
// through a Scenario (which names its model by path).
#pragma once

#include <unistd.h>

#include <gtest/gtest.h>

#include <string>

#include "piper/core/model.hpp"
#include "piper/core/program.hpp"

namespace piper::test {

// Writes the spec to TempDir()/<name>-<pid>.json and returns the path. One file per process: CTest
// runs a program's tests in parallel processes.
inline std::string write_spec(const core::ModelConfig& c) {
  const std::string path = ::testing::TempDir() + "/" + c.name + "-" + std::to_string(::getpid()) + ".json";
  core::write_file_atomically(path, core::config_to_spec_json(c).dump());
  return path;
}

}  // namespace piper::test
