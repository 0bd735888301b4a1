// The HostileInput fixture of the input-side reliability tests (issue #28): runs the real `piper`
// binary in a scratch folder and checks the one-line refusal contract. Shared by
// test_reliability_inputs.cpp (the first three probes) and test_reliability_probes.cpp (the later ones).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../unit/shell.hpp"

namespace piper::test {

namespace fs = std::filesystem;
using nlohmann::json;

inline std::string nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

inline const std::string kSource = PIPER_SOURCE_DIR;
inline const std::string kTiny = kSource + "/tests/data/runtime-tiny-dense.json";

class HostileInput : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("piper_hostile_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs piper in the scratch folder; `timeout` turns a hang into exit 124 instead of a stuck test.
  CliResult run(const std::string& args, int timeout_s = 120) const {
    return run_cli_in(dir_, PIPER_CLI, args, "timeout " + std::to_string(timeout_s));
  }

  fs::path input(const std::string& name, const std::string& text) {
    write_file(dir_ / name, text);
    return dir_ / name;
  }

  // The contract for a refused input: exit 2, one "piper: error: " line on stderr holding every
  // fragment, and only printable characters in it.
  static void expect_one_line(const CliResult& r, const std::vector<std::string>& fragments) {
    EXPECT_EQ(r.exit_code, 2) << r.err;
    ASSERT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.rfind("piper: error: ", 0), 0u) << r.err;
    EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
    for (const auto& f : fragments) EXPECT_NE(r.err.find(f), std::string::npos) << "missing '" << f << "' in " << r.err;
    for (char c : r.err) EXPECT_TRUE(c == '\n' || (c >= 0x20 && c < 0x7f)) << "unprintable byte in " << r.err;
  }

  // A plan compiled from the tiny runtime model, as JSON to edit.
  json tiny_plan() {
    const CliResult r = run("compile --model '" + kTiny + "' --pp 2 --dp 2 --microbatches 4 --schedule 1f1b -o a.json");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return json::parse(read_file(dir_ / "a.json"));
  }

  fs::path dir_;
};

}  // namespace piper::test
