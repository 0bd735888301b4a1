// The sm_partition directive: parsing with one-line errors naming directive index and field, its
// place in the Program (and Program JSON), the strategy flag --comm-sms, the simulator's compute
// rates derived by hand, and the CLI's refusal of a partition that does not fit the cluster's GPU.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "piper/core/directives.hpp"
#include "piper/core/scenario.hpp"
#include "piper/sim/cost_model.hpp"
#include "shell.hpp"

using namespace piper;
using nlohmann::json;

namespace {

std::string error_of(const json& program) {
  try {
    core::parse_directives(program);
  } catch (const core::DirectiveError& e) {
    return e.what();
  }
  return "";
}

core::Program compile_with(int comm_sms) {
  core::Scenario s;
  s.model = "qwen3-1b";
  s.strategy.pp = 2;
  s.strategy.dp = 2;
  s.strategy.microbatches = 4;
  s.strategy.schedule = "dualpipev";
  s.strategy.comm_sms = comm_sms;
  return core::compile_scenario(s).result.program;
}

}  // namespace

TEST(SmPartition, ParsesTheDirective) {
  const auto p = core::parse_directives(json::parse(R"([{"op": "sm_partition", "stream": "comm", "sms": 24}])"));
  ASSERT_EQ(p.directives.size(), 1u);
  const auto& d = std::get<core::SmPartitionDirective>(p.directives[0]);
  EXPECT_EQ(d.partition.stream, "comm");
  EXPECT_EQ(d.partition.sms, 24);
  EXPECT_EQ(core::op_name(p.directives[0]), "sm_partition");
  // "stream" defaults to the communication streams.
  const auto q = core::parse_directives(json::parse(R"([{"op": "sm_partition", "sms": 16}])"));
  EXPECT_EQ(std::get<core::SmPartitionDirective>(q.directives[0]).partition.stream, "comm");
}

TEST(SmPartition, BadDirectivesNameIndexAndField) {
  const std::string place = R"({"op": "place", "filter": {}, "devices": [0]})";
  auto expect = [](const std::string& error, const std::string& where) {
    EXPECT_NE(error.find(where), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  };
  expect(error_of(json::parse("[" + place + R"(, {"op": "sm_partition", "stream": "pp", "sms": 8}])")),
         "directive 1 field 'stream'");
  expect(error_of(json::parse(R"([{"op": "sm_partition", "sms": 0}])")), "directive 0 field 'sms'");
  expect(error_of(json::parse(R"([{"op": "sm_partition", "sms": 2.5}])")), "directive 0 field 'sms'");
  expect(error_of(json::parse(R"([{"op": "sm_partition", "sms": "20"}])")), "directive 0 field 'sms'");
  expect(error_of(json::parse(R"([{"op": "sm_partition"}])")), "directive 0 field 'sms'");
  expect(error_of(json::parse(R"([{"op": "sm_partition", "sms": 8, "share": 0.1}])")), "directive 0 field 'share'");
  expect(error_of(json::parse(R"([{"op": "sm_partition", "sms": 8}, {"op": "sm_partition", "sms": 16}])")),
         "directive 1 field 'op'");
}

TEST(SmPartition, ReachesTheProgramAndItsJson) {
  const core::Program none = compile_with(0);
  EXPECT_FALSE(none.sm_partition.has_value());
  EXPECT_FALSE(none.to_json().contains("sm_partition"));  // programs without it are unchanged

  const core::Program p = compile_with(24);
  ASSERT_TRUE(p.sm_partition.has_value());
  EXPECT_EQ(p.sm_partition->stream, "comm");
  EXPECT_EQ(p.sm_partition->sms, 24);
  const json j = p.to_json();
  EXPECT_EQ(j.at("sm_partition"), json::parse(R"({"stream": "comm", "sms": 24})"));
  EXPECT_TRUE(core::Program::from_json(j) == p);
  EXPECT_FALSE(core::Program::from_json(j) == none);

  json bad = j;
  bad["sm_partition"]["sms"] = 0;
  EXPECT_THROW(core::Program::from_json(bad), core::Error);
  bad["sm_partition"] = json::parse(R"({"stream": "dp", "sms": 8})");
  EXPECT_THROW(core::Program::from_json(bad), core::Error);
}

TEST(SmPartition, ScenarioJsonCarriesCommSms) {
  core::Scenario s;
  s.model = "qwen3-1b";
  s.strategy.comm_sms = 24;
  const core::Scenario back = core::Scenario::from_json(s.to_json(), "s.json");
  EXPECT_EQ(back.strategy.comm_sms, 24);
}

// Hand-derived rates (cost_model.hpp): shared SMs keep full speed until communication runs, then
// lose comm_sm_share; a partition of s of N SMs runs compute at (N - s) / N all the time.
TEST(SmPartition, ComputeRatesByHand) {
  sim::GpuSpec h100;
  h100.name = "H100";
  h100.sm_count = 132;
  h100.comm_sm_share = 20.0 / 132;
  const sim::ComputeRates shared = sim::compute_rates(std::nullopt, h100);
  EXPECT_DOUBLE_EQ(shared.idle, 1.0);
  EXPECT_DOUBLE_EQ(shared.with_comm, 112.0 / 132);
  const sim::ComputeRates part = sim::compute_rates(core::SmPartition{"comm", 33}, h100);
  EXPECT_DOUBLE_EQ(part.idle, 0.75);       // 99 of 132 SMs
  EXPECT_DOUBLE_EQ(part.with_comm, 0.75);  // the partition does not move when communication runs
  EXPECT_THROW(sim::compute_rates(core::SmPartition{"comm", 132}, h100), sim::ClusterError);
  sim::GpuSpec unknown = h100;
  unknown.sm_count = 0;
  EXPECT_THROW(sim::compute_rates(core::SmPartition{"comm", 8}, unknown), sim::ClusterError);
  EXPECT_NO_THROW(sim::compute_rates(std::nullopt, unknown));  // nothing to partition, nothing to check
}

TEST(SmPartition, SimulateRefusesAPartitionLargerThanTheGpu) {
  using piper::test::sh;
  const std::string common = std::string(PIPER_CLI) +
                             " simulate --model qwen3-1b --pp 2 --microbatches 2 --engine analytic --cluster dgx-h100";
  const auto bad = sh(common + " --comm-sms 132");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_NE(bad.output.find("piper: error: --comm-sms 132: 132 SMs"), std::string::npos) << bad.output;
  const auto good = sh(common + " --comm-sms 24");
  EXPECT_EQ(good.code, 0) << good.output;
}

// The knob where the strategy flags are searched: `piper tune --comm-sms` and a sweep spec's
// comm_sms refuse, in one line and with exit status 2, a count that leaves no SM for compute or is
// not a non-negative integer, before writing anything.
TEST(SmPartition, TuneAndSweepRefuseBadCommSmsInOneLine) {
  using piper::test::sh;
  const std::string out =
      (std::filesystem::temp_directory_path() / ("piper_test_sms_" + std::to_string(::getpid()))).string();
  const std::string tune =
      std::string(PIPER_CLI) + " tune --model qwen3-1b --devices 4 --cluster dgx-h100 -o " + out + ".csv";
  const auto too_many = sh(tune + " --comm-sms 24,132");
  EXPECT_EQ(too_many.code, 2) << too_many.output;
  EXPECT_EQ(
      too_many.output,
      "piper: error: --comm-sms 132: 132 SMs for communication leave none for compute on 'H100-SXM5-80GB' (132 SMs)\n");
  const auto negative = sh(tune + " --comm-sms -8");
  EXPECT_EQ(negative.code, 2) << negative.output;
  EXPECT_NE(negative.output.find("--comm-sms: must be a non-negative integer, got '-8'"), std::string::npos)
      << negative.output;
  EXPECT_FALSE(std::filesystem::exists(out + ".csv"));
  {
    std::ofstream spec(out + ".json");
    spec << R"({"cluster": "dgx-h100", "comm_sms": [0, 132]})";
  }
  const auto sweep = sh(std::string(PIPER_CLI) + " sweep " + out + ".json -o " + out + ".csv");
  EXPECT_EQ(sweep.code, 2) << sweep.output;
  EXPECT_NE(sweep.output.find("field 'comm_sms': 132 SMs for communication leave none for compute"), std::string::npos)
      << sweep.output;
  EXPECT_FALSE(std::filesystem::exists(out + ".csv"));
  std::filesystem::remove(out + ".json");
}
