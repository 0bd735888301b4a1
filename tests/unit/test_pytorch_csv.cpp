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
  const nlohmann::json program = core::program_from_schedule_table(t, core::StrategyOptions{}).to_json();
  EXPECT_EQ(core::schedule_to_pytorch_csv(core::schedule_table_from_program(core::parse_directives(program))), csv);
  // The imported program is Piper's own DualPipeV program.
  core::StrategyOptions o;
  o.schedule = "dualpipev", o.pp = 4, o.microbatches = 10;
  EXPECT_EQ(program, core::generate_program(o).to_json());
}

TEST(PytorchCsv, ImportedScheduleCompilesAndVerifies) {
  core::Scenario s;
  s.model = "qwen3-1b";  // 16 blocks for the 8 stages
  s.seq_len = 256;
  s.directives = core::program_from_schedule_table(core::schedule_from_pytorch_csv(golden(), "g.csv"), {}).to_json();
  EXPECT_NO_THROW(core::compile_scenario(s));
}

TEST(PytorchCsv, InvalidCsvsNameRowAndColumn) {
  EXPECT_EQ(
      import_error("0F0,1F0\n1B0,0B0\n"),
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

// PyTorch < 2.5 wrote the input gradient as B when the same stage and microbatch also has a W; newer
// releases write I. A hand-written ZB-style schedule in both spellings reads to the same table, and
// the importer says which spelling it assumed.
TEST(PytorchCsv, OldAndNewSpellingsOfTheSplitBackwardReadAlike) {
  const std::string modern = "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n";
  const std::string legacy = "0F0,0F1,0B0,0W0,0B1,0W1\n1F0,1B0,1F1,1B1,1W0,1W1\n";
  core::CsvSpelling a = core::CsvSpelling::Either, b = core::CsvSpelling::Either;
  const auto tm = core::schedule_from_pytorch_csv(modern, "new.csv", &a);
  const auto tl = core::schedule_from_pytorch_csv(legacy, "old.csv", &b);
  EXPECT_EQ(a, core::CsvSpelling::Modern);
  EXPECT_EQ(b, core::CsvSpelling::Legacy);
  ASSERT_EQ(tl.ranks.size(), 2u);
  EXPECT_EQ(tl.ranks[1][1], (core::ScheduleStep{{1, core::ActionKind::I, 0}}));  // "1B0" became an input gradient
  EXPECT_EQ(tl.ranks, tm.ranks);
  // Export always writes the new spelling.
  EXPECT_EQ(core::schedule_to_pytorch_csv(tl), modern);

  // In the old spelling a B without a W stays a full backward, beside split ones.
  core::CsvSpelling c = core::CsvSpelling::Either;
  const auto mixed_kinds = core::schedule_from_pytorch_csv("0F0,0F1,0B0,0B1,0W1\n", "old.csv", &c);
  EXPECT_EQ(c, core::CsvSpelling::Legacy);
  EXPECT_EQ(mixed_kinds.ranks[0][2], (core::ScheduleStep{{0, core::ActionKind::B, 0}}));
  EXPECT_EQ(mixed_kinds.ranks[0][3], (core::ScheduleStep{{0, core::ActionKind::I, 1}}));

  // No W anywhere: both spellings mean the same.
  core::CsvSpelling d = core::CsvSpelling::Modern;
  (void)core::schedule_from_pytorch_csv("0F0,0B0\n", "x.csv", &d);
  EXPECT_EQ(d, core::CsvSpelling::Either);
}

TEST(PytorchCsv, GoldenDualPipeVInTheOldSpellingReadsAsTheGolden) {
  // PyTorch's DualPipeV written the pre-2.5 way: every I becomes B (its W stays), overlapped full
  // backwards (7B3 in "(0F7;7B3)OVERLAP_F_B") have no W and stay full backwards.
  std::string old = golden();
  ASSERT_FALSE(old.empty());
  std::size_t replaced = 0;
  for (std::size_t i = 0; i < old.size(); ++i)
    if (old[i] == 'I') old[i] = 'B', ++replaced;
  ASSERT_GT(replaced, 0u);
  core::CsvSpelling s = core::CsvSpelling::Either;
  const auto t = core::schedule_from_pytorch_csv(old, "old.csv", &s);
  EXPECT_EQ(s, core::CsvSpelling::Legacy);
  EXPECT_EQ(core::schedule_to_pytorch_csv(t), golden());
  // Unchanged, the golden file is read in the new spelling.
  (void)core::schedule_from_pytorch_csv(golden(), "golden.csv", &s);
  EXPECT_EQ(s, core::CsvSpelling::Modern);
}

TEST(PytorchCsv, BothSpellingsInOneFileAreAnError) {
  // 0I0 is the new spelling; 0B1 with 0W1 is the old spelling of an input gradient.
  EXPECT_EQ(
      import_error("0F0,0F1,0I0,0W0,0B1,0W1\n"),
      "x.csv: row 1 (rank 0), column 5: mixed spellings: 0B1 has a weight gradient 0W1, so it is an input gradient in "
      "the "
      "PyTorch < 2.5 spelling, but row 1 column 3 writes input gradients as I (PyTorch >= 2.5); use one spelling");
  // Old-spelling errors show the actions as written.
  EXPECT_EQ(import_error("0F0,0W0,0B0\n"), "x.csv: row 1 (rank 0), column 2: 0W0 comes before its input gradient 0B0");
  EXPECT_EQ(import_error("0F0,0B0,0W0,0B0\n"), "x.csv: row 1 (rank 0), column 4: 0B0 is already at row 1, column 2");
}

// Orders that cannot run were imported with exit 0, and `piper compile` failed later with a cycle in
// generated JSON: a backward before its forward on a rank, the forward and backward of one microbatch
// overlapped in one step, or ranks waiting on each other.
TEST(PytorchCsv, OrdersThatCannotRunAreRefusedAtTheirCell) {
  EXPECT_EQ(import_error("0B0,0F0\n1B0,1F0\n"),
            "x.csv: row 1 (rank 0), column 1: 0B0 comes before its forward 0F0 (column 2)");
  // One rank holding stages 0 and 1: stage 1's forward needs stage 0's.
  EXPECT_EQ(import_error("1F0,0F0,1B0,0B0\n"),
            "x.csv: row 1 (rank 0), column 1: 1F0 comes before 0F0 (column 2), whose output it needs");
  EXPECT_EQ(import_error("(0F0;0B0)OVERLAP_F_B\n1F0,1B0\n"),
            "x.csv: row 1 (rank 0), column 1: '(0F0;0B0)OVERLAP_F_B': the backward 0B0 needs the forward 0F0 of "
            "the same microbatch, so they cannot overlap");
  // Another stage's backward of the same microbatch needs that forward too (ranks in a V: 0 and 3, 1 and 2).
  EXPECT_EQ(import_error("0F0,(3F0;0B0)OVERLAP_F_B,3B0\n1F0,2F0,2B0,1B0\n"),
            "x.csv: row 1 (rank 0), column 2: '(3F0;0B0)OVERLAP_F_B': the backward 0B0 needs the forward 3F0 of "
            "the same microbatch, so they cannot overlap");
  // Ranks that wait on each other: rank 0's 0B0 needs 1B0, after 1F1 on rank 1, which needs 0F1,
  // after 0B0 on rank 0.
  EXPECT_EQ(import_error("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n"),
            "x.csv: row 1 (rank 0), column 2: 0B0 waits for 1B0 (row 2, column 3), which can never run: the rows' "
            "orders wait on each other");
  // What runs: one microbatch's forward overlapped with another's backward.
  EXPECT_EQ(import_error("0F0,(0F1;0B0)OVERLAP_F_B,0B1\n1F0,1B0,1F1,1B1\n"), "no error");
}

// A blank row in the middle added a rank with nothing to run: an idle device in the compiled program.
TEST(PytorchCsv, RowsWithoutActionsAreRefused) {
  EXPECT_EQ(import_error("0F0,0B0\n\n1F0,1B0\n"),
            "x.csv: row 2 (rank 1): no actions (a blank row?): every rank runs at least one stage");
  EXPECT_EQ(import_error("0F0,0B0\n,,\n1F0,1B0\n"),
            "x.csv: row 2 (rank 1): no actions (a blank row?): every rank runs at least one stage");
  EXPECT_EQ(import_error("\n0F0,0B0\n"),
            "x.csv: row 1 (rank 0): no actions (a blank row?): every rank runs at least one stage");
  // Blank lines at the end are no rows.
  EXPECT_EQ(import_error("0F0,0B0\n1F0,1B0\n\n\r\n"), "no error");
}

// Every schedule family's export imports again (the order checks refuse no schedule that runs).
TEST(PytorchCsv, EveryFamilysExportImports) {
  int exported = 0;
  for (const auto& family : core::schedule_registry()) {
    if (family.mirrored) continue;  // one stage -> rank map only
    for (int v : {1, 2}) {
      core::StrategyOptions o;
      o.schedule = family.name, o.pp = 4, o.microbatches = 8, o.virtual_stages = v;
      std::string csv;
      try {
        csv = core::schedule_to_pytorch_csv(core::schedule_table(o));
      } catch (const std::invalid_argument&) {
        continue;  // no per-rank table for this shape
      }
      EXPECT_EQ(import_error(csv), "no error") << family.name << " --virtual " << v;
      ++exported;
    }
  }
  EXPECT_GT(exported, 8);
}
