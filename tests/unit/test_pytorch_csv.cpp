// PyTorch compute-only CSV interop: PyTorch's own DualPipeV (4 ranks x 10 microbatches) is reproduced
// byte for byte, import -> directives -> export round-trips it, and invalid CSVs name row and column.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "piper/core/compiler.hpp"
#include "piper/core/pytorch_csv.hpp"
#include "piper/core/scenario.hpp"

namespace core = piper::core;

namespace {

std::string golden() {
  std::ifstream in(std::string(PIPER_FIXTURES) + "/pytorch-schedules/dualpipev_4rank_10mb.csv", std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string import_error(const std::string& csv) {
  try {
    core::schedule_from_pytorch_csv(csv, "x.csv");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(PytorchCsv, ExportReproducesPyTorchDualPipeVByteForByte) {
  const std::string expected = golden();
  ASSERT_FALSE(expected.empty());
  core::StrategyOptions o;
  o.schedule = "dualpipev";
  o.pp = 4;
  o.microbatches = 10;
  EXPECT_EQ(core::schedule_to_pytorch_csv(core::schedule_table(o)), expected);
}

TEST(PytorchCsv, ImportThenExportRoundTripsThroughDirectives) {
  const std::string csv = golden();
  const core::ScheduleTable t = core::schedule_from_pytorch_csv(csv, "golden.csv");
  EXPECT_EQ(t.stages, 8);
  EXPECT_EQ(t.microbatches, 10);
  EXPECT_EQ(core::stage_ranks(t), (std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0}));  // the V
  const nlohmann::json program = core::program_from_schedule_table(t, core::StrategyOptions{});
  EXPECT_EQ(core::schedule_to_pytorch_csv(core::schedule_table_from_program(program)), csv);
  // The imported program is Piper's own DualPipeV program.
  core::StrategyOptions o;
  o.schedule = "dualpipev", o.pp = 4, o.microbatches = 10;
  EXPECT_EQ(program, core::generate_program(o));
}

TEST(PytorchCsv, ImportedScheduleCompilesAndVerifies) {
  core::Scenario s;
  s.model = "qwen3-1b";  // 16 blocks for the 8 stages
  s.seq_len = 256;
  s.directives = core::program_from_schedule_table(core::schedule_from_pytorch_csv(golden(), "g.csv"), {});
  EXPECT_NO_THROW(core::compile_scenario(s));
}

TEST(PytorchCsv, InvalidCsvsNameRowAndColumn) {
  EXPECT_EQ(import_error("0F0,1F0\n1B0,0B0\n"),
            "x.csv: row 2 (rank 1), column 1: stage 1 is already on rank 0 (row 1, column 2); a stage lives on one rank");
  EXPECT_EQ(import_error("0F0,0W0,0I0\n"), "x.csv: row 1 (rank 0), column 2: 0W0 comes before its input gradient 0I0");
  EXPECT_EQ(import_error("0F0,0F1,0B0\n"),
            "x.csv: row 1 (rank 0), column 4: missing microbatch: stage 0 has no backward 0B1 (or 0I1)");
  EXPECT_EQ(import_error("0F0,1F0,0B0\n"),
            "x.csv: row 1 (rank 0), column 4: missing microbatch: stage 1 has no backward 1B0 (or 1I0)");
  EXPECT_EQ(import_error("0F0,0SEND_F0\n"),
            "x.csv: row 1 (rank 0), column 2: '0SEND_F0' is not a compute action like 2F0, 3B1, 3I1, 7W4 or "
            "(0F7;7B3)OVERLAP_F_B");
  EXPECT_EQ(import_error("0F0,0F0,0B0\n"), "x.csv: row 1 (rank 0), column 2: 0F0 is already at row 1, column 1");
}

TEST(PytorchCsv, IdleCellsAndWindowsLineEndsAreAccepted) {
  const auto t = core::schedule_from_pytorch_csv("0F0,,0B0\r\n,1F0,1B0\r\n", "x.csv");
  ASSERT_EQ(t.ranks.size(), 2u);
  EXPECT_EQ(t.ranks[0].size(), 2u);
  EXPECT_EQ(core::schedule_to_pytorch_csv(t), "0F0,0B0\n1F0,1B0\n");
}
