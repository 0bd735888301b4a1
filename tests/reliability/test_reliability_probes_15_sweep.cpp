// Reliability, input side, the fifteenth probe (docs/reliability.md, "fifteenth probe"): sweeps and clusters: inline
// and derived cluster specs beside a spec or a saved scenario, sweep keys, cluster names, a tune resume's refusal. Each
// case runs the real `piper` binary (the HostileInput fixture).
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "hostile_input.hpp"

namespace fs = std::filesystem;
using piper::test::CliResult;
using piper::test::HostileInput;
using piper::test::kTiny;

namespace {

// The "step time" line of `piper simulate`'s report.
std::string step_line(const std::string& out) {
  const std::size_t at = out.find("step time");
  return at == std::string::npos ? "" : out.substr(at, out.find('\n', at) - at);
}

// A derived spec written inline whose base is a file: a sweep spec checked it beside the spec but its
// rows read it from the current folder (every row invalid, exit 0), and a saved scenario kept the
// base as given, so it loaded only from the folder it was saved in. Both now resolve the base as a
// cluster file named directly: beside the spec or scenario, relocated when saved.
TEST_F(HostileInput, InlineDerivedClusterBaseResolvesBesideItsFile) {
  fs::create_directories(dir_ / "spec");
  input("spec/base.json", R"({"cluster": "dgx-h100", "runtime": "eager"})");
  input("spec/sw.json", R"({"model": "qwen3-9m", "engine": "analytic", "cluster": "{\"cluster\": \"base.json\"}"})");
  const CliResult sweep = run("sweep spec/sw.json -o out.csv");
  EXPECT_EQ(sweep.exit_code, 0) << sweep.err;
  EXPECT_NE(sweep.out.find("(1 ok, 0 invalid, 0 failed)"), std::string::npos) << sweep.out;

  fs::create_directories(dir_ / "a");
  fs::create_directories(dir_ / "b");
  input("a/d1.json", R"({"cluster": "dgx-h100", "runtime": "eager"})");
  const CliResult saved = piper::test::run_cli_in(dir_ / "a", PIPER_CLI,
                                                  "simulate --model qwen3-9m --engine analytic --cluster "
                                                  "'{\"cluster\": \"d1.json\", \"attention_kernel\": \"fa1\"}' "
                                                  "--save-scenario ../b/s.json",
                                                  "timeout 60");
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  ASSERT_FALSE(step_line(saved.out).empty()) << saved.out;
  for (const fs::path& folder : {dir_, dir_ / "a", dir_ / "b"}) {
    const std::string scenario = (dir_ / "b" / "s.json").string();
    const CliResult replay =
        piper::test::run_cli_in(folder, PIPER_CLI, "simulate --scenario '" + scenario + "'", "timeout 60");
    ASSERT_EQ(replay.exit_code, 0) << folder << ": " << replay.err;
    EXPECT_EQ(step_line(replay.out), step_line(saved.out)) << folder;
  }
}

// A cluster's or GPU's "name" with a newline, NUL or U+202E split or reordered the report's first line
// and the --kernels header; an empty one printed "()". Refused as a model's name is.
TEST_F(HostileInput, ClusterNamesArePlainText) {
  expect_one_line(
      run(R"(simulate --model qwen3-9m --engine analytic --cluster '{"cluster": "dgx-h100", "name": "a\nb"}')"),
      {"field 'name': 'a\\x0ab': control or bidirectional-override characters are not allowed"});
  expect_one_line(
      run(R"(simulate --model qwen3-9m --engine analytic --cluster '{"preset": "dgx-h100", "name": "x\u202ez"}')"),
      {"field 'name'", "\\u202e", "not allowed in a name"});
  expect_one_line(run(R"(simulate --model qwen3-9m --engine analytic --cluster '{"preset": "dgx-h100", "name": ""}')"),
                  {"field 'name': expected a non-empty string"});
  expect_one_line(
      run(R"(simulate --model qwen3-9m --engine analytic --cluster '{"preset": "dgx-h100", "node": {"gpu": {"preset": "h100-sxm", "name": "g\nh"}}}')"),
      {"field 'node.gpu.name'", "not allowed in a name"});
}

// Sweep keys wrote ';' for ',', so the clusters "c,1.json" and "c;1.json" shared a key: the second
// sweep into the same file skipped its row as already done and never simulated the other cluster.
TEST_F(HostileInput, SweepKeysOfDifferentClustersDiffer) {
  input("c,1.json", R"({"cluster": "dgx-h100"})");
  input("c;1.json", R"({"cluster": "dgx-a100-80g"})");
  input("a.json", R"({"model": "qwen3-9m", "engine": "analytic", "cluster": "c,1.json"})");
  input("b.json", R"({"model": "qwen3-9m", "engine": "analytic", "cluster": "c;1.json"})");
  ASSERT_EQ(run("sweep a.json -o r.csv").exit_code, 0);
  const CliResult second = run("sweep b.json -o r.csv");
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_NE(second.out.find("0 already in r.csv, 1 run (1 ok"), std::string::npos) << second.out;

  // A file an older piper wrote (',' as ';' in the key) still resumes, and its row under the shared
  // key "c;1.json" is taken only for the cluster its column names.
  std::string old = piper::test::read_file(dir_ / "r.csv");
  old.resize(old.find('\n', old.find('\n') + 1) + 1);  // the header and the row of "c,1.json"
  ASSERT_NE(old.find("qwen3-9m/c%2C1.json/"), std::string::npos) << old;
  old.replace(old.find("%2C"), 3, ";");
  input("old.csv", old);
  const CliResult other = run("sweep b.json -o old.csv");
  ASSERT_EQ(other.exit_code, 0) << other.err;
  EXPECT_NE(other.out.find("0 already in old.csv, 1 run (1 ok"), std::string::npos) << other.out;
  const CliResult same = run("sweep a.json -o old.csv");
  ASSERT_EQ(same.exit_code, 0) << same.err;
  EXPECT_NE(same.out.find("1 already in old.csv, 0 run"), std::string::npos) << same.out;
}

// A tune resuming into a file of another search said which search the file holds, which read exactly
// like the one asked for when only the runtime (a derived cluster) differed; now it names what differs.
TEST_F(HostileInput, TuneResumeRefusalNamesWhatDiffers) {
  ASSERT_EQ(run("tune --model qwen3-9m --devices 2 -o t.csv --cluster dgx-h100").exit_code, 0);
  expect_one_line(run("tune --model qwen3-9m --devices 2 -o t.csv --cluster dgx-h100 --runtime eager"),
                  {"t.csv: holds a tune of qwen3-9m on 2 x dgx-h100", R"(this search has cluster '{"cluster":)",
                   R"("runtime":"eager"}' (the file's: 'dgx-h100'); choose another -o)"});
  expect_one_line(run("tune --model qwen3-9m --devices 4 -o t.csv --cluster dgx-h100"),
                  {"this search has devices '4' (the file's: '2')"});
  // A seq_len of 0 is the model's own, which "seq_len 0" did not say.
  expect_one_line(run("tune --model qwen3-9m --devices 2 -o t.csv --cluster dgx-h100 --seq-len 128"),
                  {"(global batch 8, the model's seq_len); this search has seq_len '128' (the file's: 'the model's')"});
}

}  // namespace
