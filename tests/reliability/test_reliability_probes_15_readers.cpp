// Reliability, input side, the fifteenth probe (docs/reliability.md, "fifteenth probe"): CSV readers and input files:
// files that are not regular files, oversized and non-UTF-8 results files in Python, CSV quoting and byte-order marks,
// bounds messages, piper-studio's command line. Each case runs the real `piper` binary (the HostileInput fixture).
#include <sys/stat.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "hostile_input.hpp"

namespace fs = std::filesystem;
using piper::test::CliResult;
using piper::test::HostileInput;
using piper::test::kTiny;

namespace {

// A UTF-8 byte-order mark (a spreadsheet's "CSV UTF-8") became part of the first cell: schedule
// import-csv's "'<U+FEFF>0F0' is not a compute action". (plot's own CSV cases, quoting and the mark, are
// PlotCli tests in tests/unit/test_plot.cpp: this sanitize-built piper draws no plots.)
TEST_F(HostileInput, CsvByteOrderMarkIsNotPartOfTheFirstCell) {
  input("s.csv",
        "\xEF\xBB\xBF"
        "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
  const CliResult imported = run("schedule import-csv s.csv -o s.json");
  EXPECT_EQ(imported.exit_code, 0) << imported.err;
  EXPECT_TRUE(fs::exists(dir_ / "s.json"));
}

// The message named only the lower bound of a value above the upper one: "--clip-grad: must be a number
// >= 1e-12 (or 0.0: off) (got 1e13)", a sweep's "pp": [4611686018427387904] "must be an integer >= 1".
// It states the range, both bounds (an integer setting's upper one, the largest int, once it is passed).
TEST_F(HostileInput, ValuesAboveTheLargestNameTheUpperBound) {
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --clip-grad 1e13"),
                  {"--clip-grad: must be a number in 1e-12..1000000000000 (or 0.0: off) (got 10000000000000.0)"});
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --clip-grad -1"),
                  {"--clip-grad: must be a number in 1e-12..1000000000000 (or 0.0: off)"});
  expect_one_line(run("compile --model qwen3-9m --pp 4611686018427387904"),
                  {"--pp: must be an integer in 1..2147483647 (got 4611686018427387904)"});
  input("sw.json", R"({"model": "qwen3-9m", "engine": "analytic", "pp": [4611686018427387904]})");
  expect_one_line(run("sweep sw.json -o r.csv"), {"sw.json: field 'pp': must be an integer in 1..2147483647"});
  EXPECT_FALSE(fs::exists(dir_ / "r.csv"));
  input("s.json", R"({"model": "qwen3-9m", "seq_len": 1180591620717411303424})");
  expect_one_line(run("compile --scenario s.json"),
                  {"s.json: field 'seq_len': must be an integer in 1..9223372036854775807"});
  input("steps.json", R"({"model": ")" + kTiny + R"(", "train": {"steps": 2000000000}})");
  expect_one_line(run("run --scenario steps.json --reference", 20),
                  {"steps.json: field 'train.steps': must be an integer in [1, 1e9]"});
  // Below an integer setting with no maximum of its own the lower bound is named, as before.
  expect_one_line(run("compile --model qwen3-9m --pp 0"), {"--pp: must be an integer >= 1 (got 0)"});
}

// open(2) of a FIFO with no writer waits forever: `run --data fifo`, `--resume fifo`, `simulate --model
// fifo` hung, and so did an output FIFO with no reader (`--dump-params fifo`, after the training).
// A FIFO that a program writes to (or reads, for an output) is still taken, as a shell's pipe is.
TEST_F(HostileInput, FifoWithNoOtherEndIsRefusedNotWaitedOn) {
  const std::string fifo = (dir_ / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const std::string train = "run --model '" + kTiny + "' --reference --steps 1 ";
  expect_one_line(run(train + "--data fifo", 20), {"fifo", "not a regular file", "no program writes to"});
  expect_one_line(run(train + "--resume fifo", 20), {"fifo", "not a regular file", "no program writes to"});
  expect_one_line(run("simulate --model fifo", 20), {"fifo", "not a regular file", "no program writes to"});
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --report fifo", 20),
                  {"cannot write fifo", "no program reads"});
  expect_one_line(run(train + "--dump-params fifo", 20), {"cannot write fifo", "no program reads"});
  struct stat st {};
  ASSERT_EQ(::stat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  // With a writer, the FIFO is read: a data file written into it by a program started first.
  input("data.txt", std::string(4096, 'a'));
  const CliResult fed =
      piper::test::run_cli_in(dir_, PIPER_CLI, train + "--data fifo", "(timeout 20 cat data.txt > fifo &); timeout 20");
  EXPECT_EQ(fed.exit_code, 0) << fed.err;
}

}  // namespace
