// Resource limits through the `piper` command: each absurd input (10^6 microbatches, 10^12 layers,
// 10^6 devices, a 10 GB file, ...) is refused early with exit 2, one stderr line naming the limit and
// how to raise it, and nothing written; overrides (--limit, PIPER_LIMIT_*) move the line both ways.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "piper/core/limits.hpp"
#include "shell.hpp"

namespace fs = std::filesystem;
using piper::test::CliResult;
using piper::test::read_file;
using piper::test::run_cli_in;
using piper::test::write_file;

namespace {

class Limits : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("piper_limits_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs piper in the scratch folder (so relative outputs land there), with optional environment.
  CliResult run(const std::string& args, const std::string& env = "") const {
    return run_cli_in(dir_, PIPER_CLI, args, env);
  }

  // The limit contract: exit 2, no stdout, one stderr line naming the limit and both ways to raise
  // it, and no file written besides the inputs the test created.
  void expect_refused(const CliResult& r, const std::string& limit, const std::vector<std::string>& fragments = {}) {
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.out, "");
    ASSERT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.rfind("piper: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find("limit '" + limit + "'"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("--limit " + limit + "=N"), std::string::npos) << r.err;
    std::string env = "PIPER_LIMIT_" + limit;
    std::transform(env.begin(), env.end(), env.begin(),
                   [](char c) { return c == '-' ? '_' : static_cast<char>(std::toupper(c)); });
    EXPECT_NE(r.err.find(env + "=N"), std::string::npos) << r.err;
    for (const auto& f : fragments) EXPECT_NE(r.err.find(f), std::string::npos) << "missing '" << f << "' in " << r.err;
    for (const auto& entry : fs::directory_iterator(dir_))
      EXPECT_TRUE(inputs_.count(entry.path().filename().string())) << "written: " << entry.path();
  }

  fs::path input(const std::string& name, const std::string& text) {
    inputs_.insert(name);
    write_file(dir_ / name, text);
    return dir_ / name;
  }

  fs::path dir_;
  std::set<std::string> inputs_;
};

// A model spec with one field replaced (tiny otherwise).
std::string spec_with(const std::string& field, const std::string& value) {
  std::string fields[][2] = {{"vocab", "1000"}, {"hidden", "64"}, {"layers", "2"}, {"heads", "4"}, {"ffn", "128"}};
  std::string j = "{\"name\": \"absurd\"";
  for (auto& [k, v] : fields) j += ", \"" + k + "\": " + (k == field ? value : v);
  if (field == "experts") j += ", \"moe\": {\"experts\": " + value + ", \"top_k\": 1, \"expert_ffn\": 64}";
  if (field == "seq_len") j += ", \"training\": {\"seq_len\": " + value + "}";
  return j + "}";
}

TEST_F(Limits, TableListsEveryLimitOnceWithAPositiveDefault) {
  const auto& table = piper::core::limit_table();
  ASSERT_EQ(table.size(), 13u);
  std::set<std::string> names;
  for (std::size_t i = 0; i < table.size(); ++i) {
    EXPECT_EQ(static_cast<std::size_t>(table[i].limit), i);
    EXPECT_GT(table[i].default_value, 0);
    EXPECT_TRUE(names.insert(table[i].name).second) << table[i].name;
  }
  const CliResult r = run("limits");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  for (const auto& n : names) EXPECT_NE(r.out.find(n), std::string::npos) << n;
}

TEST_F(Limits, MillionMicrobatchesRefused) {
  expect_refused(run("compile --model qwen3-9m --pp 2 --microbatches 1000000 -o plan.json"), "microbatches",
                 {"--microbatches", "1000000 microbatches"});
}

TEST_F(Limits, MillionMicrobatchesInASplitDirectiveRefused) {
  input(
      "split.json",
      R"([{"op": "split", "filter": {}, "num_microbatches": 1000000}, {"op": "place", "filter": {}, "devices": [0]}])");
  expect_refused(run("compile --model qwen3-9m --directives split.json -o plan.json"), "microbatches",
                 {"split.json", "directive 0", "num_microbatches"});
}

TEST_F(Limits, TrillionLayersRefused) {
  input("model.json", spec_with("layers", "1000000000000"));
  expect_refused(run("compile --model model.json -o plan.json"), "layers", {"model.json", "field 'layers'"});
}

TEST_F(Limits, HugeHiddenSizeRefused) {
  input("model.json", spec_with("hidden", "1000000000"));
  expect_refused(run("compile --model model.json -o plan.json"), "model-width", {"model.json", "field 'hidden'"});
}

TEST_F(Limits, MillionExpertsRefused) {
  input("model.json", spec_with("experts", "1000000"));
  expect_refused(run("compile --model model.json -o plan.json"), "experts", {"field 'moe.experts'"});
}

TEST_F(Limits, HugeSequenceRefused) {
  expect_refused(run("compile --model qwen3-9m --seq-len 1000000000 -o plan.json"), "tokens-per-microbatch",
                 {"training.seq_len"});
}

TEST_F(Limits, MillionDevicesFromFlagsRefused) {
  expect_refused(run("compile --model qwen3-9m --pp 2 --dp 500000 -o plan.json"), "devices", {"--pp x --dp"});
}

TEST_F(Limits, DeviceIdPastTheLimitRefused) {
  input("place.json", R"([{"op": "place", "filter": {}, "devices": [999999]}])");
  expect_refused(run("compile --model qwen3-9m --directives place.json -o plan.json"), "devices",
                 {"place.json", "directive 0", "devices[0]"});
}

TEST_F(Limits, MillionNodeClusterRefused) {
  input("cluster.json", R"({"preset": "dgx-h200", "nodes": 1000000})");
  expect_refused(run("simulate --model qwen3-9m --engine analytic --cluster cluster.json --report r.json"), "devices",
                 {"cluster.json", "field 'nodes'"});
}

TEST_F(Limits, PlanWithMillionDevicesRefused) {
  input("plan.json", R"({"format": "piper-program", "version": 3, "model": "m",
    "training": {"seq_len": 8, "micro_batch_size": 1, "precision": "bf16"}, "microbatches": 1,
    "num_devices": 1000000, "device_sets": [], "families": [], "plans": [], "plan_of_device": []})");
  expect_refused(run("verify plan.json"), "devices", {"plan.json", "num_devices"});
}

TEST_F(Limits, CsvMicrobatchIndexPastTheLimitRefused) {
  input("s.csv", "0F0,0F999999,0B0\n");
  expect_refused(run("schedule import-csv s.csv -o p.json"), "microbatches", {"s.csv", "row 1", "column 2"});
}

// A 10 GB file (sparse: no disk used) is refused from its size, before any byte is read.
TEST_F(Limits, TenGigabyteFileRefusedUnread) {
  const fs::path big = input("big.json", "");
  fs::resize_file(big, 10'000'000'000ULL);
  expect_refused(run("compile --model qwen3-9m --directives big.json -o plan.json"), "input-bytes",
                 {"big.json", "10000000000 bytes"});
  expect_refused(run("compile --model big.json -o plan.json"), "input-bytes", {"big.json"});
  expect_refused(run("verify big.json"), "input-bytes", {"big.json"});
}

TEST_F(Limits, SweepWithTooManyCombinationsRefused) {
  std::string list = "[1";
  for (int i = 2; i <= 400; ++i) list.append(",").append(std::to_string(i));
  list += "]";
  input("sweep.json",
        R"({"model": "qwen3-9m", "engine": "analytic", "pp": )" + list + R"(, "microbatches": )" + list + "}");
  expect_refused(run("sweep sweep.json -o rows.csv"), "sweep-runs", {"sweep.json", "160000 combinations"});
}

TEST_F(Limits, DagNodesLimitStopsTheCompile) {
  expect_refused(run("--limit dag-nodes=100 compile --model qwen3-9m --pp 2 --microbatches 4 -o plan.json"),
                 "dag-nodes", {"DAG", "nodes exceeds the limit of 100"});
  // A split that would pass the limit is refused before copying, naming its directive.
  input("split.json",
        R"([{"op": "split", "filter": {}, "num_microbatches": 64}, {"op": "place", "filter": {}, "devices": [0]}])");
  expect_refused(run("--limit dag-nodes=1000 compile --model qwen3-9m --directives split.json -o plan.json"),
                 "dag-nodes", {"split.json", "directive 0", "num_microbatches"});
}

TEST_F(Limits, SimulatedOpsLimitStopsTheSimulation) {
  expect_refused(run("simulate --model qwen3-9m --engine analytic --limit simulated-ops=10 --report r.json"),
                 "simulated-ops", {"op instances"});
}

// The flag (before or after the subcommand) and the environment variable both move the limit, in
// both directions: 8 microbatches pass by default, fail under 4, and pass again when raised to 8.
TEST_F(Limits, OverridesByFlagAndEnvironment) {
  const std::string compile = "compile --model qwen3-9m --pp 2 --microbatches 8";
  EXPECT_EQ(run(compile).exit_code, 0);
  expect_refused(run("--limit microbatches=4 " + compile), "microbatches", {"8 microbatches", "limit of 4"});
  expect_refused(run(compile + " --limit microbatches=4"), "microbatches", {"limit of 4"});
  expect_refused(run(compile, "PIPER_LIMIT_MICROBATCHES=4"), "microbatches", {"limit of 4"});
  EXPECT_EQ(run("--limit microbatches=8 " + compile, "PIPER_LIMIT_MICROBATCHES=4").exit_code, 0);
  const CliResult listed = run("limits", "PIPER_LIMIT_MICROBATCHES=4");
  EXPECT_NE(listed.out.find("4*"), std::string::npos) << listed.out;
}

TEST_F(Limits, MalformedOverridesAreOneLineErrors) {
  for (const std::string& args : {std::string("--limit nonsense=3 models"), std::string("--limit microbatches models"),
                                  std::string("--limit microbatches=-1 models")}) {
    const CliResult r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("--limit"), std::string::npos) << r.err;
  }
  const CliResult env = run("models", "PIPER_LIMIT_DEVICES=lots");
  EXPECT_EQ(env.exit_code, 2) << env.err;
  EXPECT_NE(env.err.find("PIPER_LIMIT_DEVICES"), std::string::npos) << env.err;
}

}  // namespace
