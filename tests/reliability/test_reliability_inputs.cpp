// Reliability, input side (issue #28): each hostile input the probe found crashing, spinning, eating
// memory or succeeding wrongly is now one clean line and a non-zero exit. Each case runs the real
// `piper` binary in a scratch folder; before the fixes each one crashed (exit 139), ended in
// `internal error: std::bad_alloc`, ran for minutes, printed `inf` with exit 0, or echoed raw bytes.
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
#include <nlohmann/json.hpp>

#include "piper/core/limits.hpp"
#include "hostile_input.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using piper::test::CliResult;
using piper::test::HostileInput;
using piper::test::kSource;
using piper::test::kTiny;
using piper::test::nested;
using piper::test::read_file;

namespace {

// ---- 1. JSON nesting depth -------------------------------------------------------------------

TEST_F(HostileInput, DeepDirectiveFilterRefusedNotStackOverflow) {
  input("deep.json", "[{\"op\":\"place\",\"filter\":{\"PP\":" + nested(100000) + "},\"devices\":[0]}]");
  expect_one_line(run("compile --model qwen3-9m --directives deep.json -o plan.json"),
                  {"deep.json", "limit 'json-depth'"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
}

TEST_F(HostileInput, DeepModelSpecInsideAPlanRefusedByVerifyAndSimulate) {
  json plan = tiny_plan();
  plan["model_spec"]["description"] = "@@DEEP@@";
  std::string text = plan.dump();
  text.replace(text.find("\"@@DEEP@@\""), 10, nested(200000));
  input("deep-plan.json", text);
  expect_one_line(run("verify deep-plan.json"), {"deep-plan.json", "limit 'json-depth'"});
  expect_one_line(run("simulate --plan deep-plan.json"), {"deep-plan.json", "limit 'json-depth'"});
}

TEST_F(HostileInput, DeepJsonRefusedInEveryInputKind) {
  const std::string deep = "{\"a\": " + nested(100000) + "}";
  input("deep.json", deep);
  input("deep-array.json", nested(100000));
  expect_one_line(run("compile --model deep.json -o plan.json"), {"deep.json", "json-depth"});
  expect_one_line(run("simulate --model qwen3-9m --cluster deep.json"), {"deep.json", "json-depth"});
  expect_one_line(run("simulate --model qwen3-9m --calibration deep.json"), {"deep.json", "json-depth"});
  expect_one_line(run("sweep deep.json -o out.csv"), {"deep.json", "json-depth"});
  expect_one_line(run("schedule export-csv --directives deep-array.json"), {"deep-array.json", "json-depth"});
  expect_one_line(run("run --reference --plan deep.json --steps 1"), {"deep.json", "json-depth"});
}

// Brackets inside strings are not nesting; a lowered limit moves the line both ways.
TEST_F(HostileInput, JsonDepthCountsStructureNotStringsAndIsOverridable) {
  json spec = json::parse(read_file(kTiny));
  spec["description"] = std::string(5000, '[') + "\\\"" + std::string(5000, '{');
  input("brackets.json", spec.dump());
  const CliResult ok = run("compile --model brackets.json -o plan.json");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  // The spec nests 2 deep (training); a limit of 1 refuses it, 2 takes it.
  expect_one_line(run("--limit json-depth=1 compile --model brackets.json -o plan2.json"),
                  {"brackets.json", "json-depth"});
  EXPECT_EQ(run("--limit json-depth=2 compile --model brackets.json -o plan3.json").exit_code, 0);
  const CliResult limits = run("limits");
  EXPECT_EQ(limits.exit_code, 0);
  for (const char* name : {"json-depth", "data-bytes", "checkpoint-bytes"})
    EXPECT_NE(limits.out.find(name), std::string::npos) << name;
}

// ---- 2. A plan's training shape is checked on load ---------------------------------------------

TEST_F(HostileInput, PlanTrainingShapeCheckedOnLoad) {
  const json plan = tiny_plan();
  struct Case {
    const char* name;
    const char* field;
    json value;
    const char* fragment;
  };
  const std::vector<Case> cases = {
      {"seq0.json", "seq_len", 0, "training.seq_len"},
      {"mbs-1.json", "micro_batch_size", -1, "training.micro_batch_size"},
      {"seq-huge.json", "seq_len", 100000000, "tokens-per-microbatch"},
      {"mb0.json", "microbatches", 0, "microbatches"},
  };
  for (const auto& c : cases) {
    json p = plan;
    if (std::string(c.field) == "microbatches")
      p["microbatches"] = c.value;
    else
      p["training"][c.field] = c.value;
    input(c.name, p.dump());
    SCOPED_TRACE(c.name);
    expect_one_line(run(std::string("verify ") + c.name), {c.fragment});
    expect_one_line(run(std::string("simulate --plan ") + c.name), {c.fragment});
    expect_one_line(run(std::string("run --reference --steps 1 --plan ") + c.name), {c.fragment});
  }
}

// seq_len 10^7 with 2 sequences per microbatch is past tokens-per-microbatch; with 1 it is within,
// but no machine holds its attention scores: one line each, not std::bad_alloc.
TEST_F(HostileInput, PlanWithHugeSequenceIsRefusedNotBadAlloc) {
  json plan = tiny_plan();
  plan["training"]["seq_len"] = 10000000;
  input("seq-1e7.json", plan.dump());
  expect_one_line(run("run --reference --steps 1 --plan seq-1e7.json"), {"seq-1e7.json", "tokens-per-microbatch"});
  plan["training"]["micro_batch_size"] = 1;
  // The plan's model_spec holds the same shape (a plan whose two disagree is refused on load).
  plan["model_spec"]["training"]["seq_len"] = 10000000;
  plan["model_spec"]["training"]["micro_batch_size"] = 1;
  input("seq-1e7-mbs1.json", plan.dump());
  expect_one_line(run("run --reference --steps 1 --plan seq-1e7-mbs1.json"),
                  {"10000000 tokens", "attention scores", "memory"});
}

TEST_F(HostileInput, CompileRefusesLearnedPositionsShorterThanTheSequence) {
  json spec = json::parse(read_file(kTiny));
  spec["max_positions"] = 8;  // seq_len is 16
  input("short-positions.json", spec.dump());
  expect_one_line(run("compile --model short-positions.json -o plan.json"), {"max_positions", "training.seq_len"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
  // A plan edited the same way is refused on load too.
  json plan = tiny_plan();
  plan["model_spec"]["max_positions"] = 8;
  input("plan-short.json", plan.dump());
  expect_one_line(run("verify plan-short.json"), {"max_positions"});
}

// ---- 3. Limits before work ------------------------------------------------------------------

TEST_F(HostileInput, TuneChecksTheDeviceLimitBeforeSearching) {
  // Used to enumerate for 307 s first; the timeout would turn that into exit 124.
  expect_one_line(run("tune --model qwen3-9m --devices 1000000 -o t.csv", 60), {"--devices", "limit 'devices'"});
  EXPECT_FALSE(fs::exists(dir_ / "t.csv"));
}

// ---- 8. Bounded reads -----------------------------------------------------------------------

TEST_F(HostileInput, DataFromDevZeroStopsAtTheLimit) {
  expect_one_line(run("--limit data-bytes=100000 run --reference --model '" + kTiny + "' --steps 1 --data /dev/zero"),
                  {"/dev/zero", "limit 'data-bytes'"});
}

TEST_F(HostileInput, SparseTenGigabyteDataAndCheckpointRefusedUnread) {
  const fs::path big = dir_ / "big.bin";
  std::ofstream(big).close();
  fs::resize_file(big, 10'000'000'000ULL);
  expect_one_line(run("run --reference --model '" + kTiny + "' --steps 1 --data big.bin"),
                  {"big.bin", "limit 'data-bytes'"});
  // A checkpoint of the tiny model holds about a megabyte: 10 GB is refused from its size.
  expect_one_line(run("run --reference --model '" + kTiny + "' --steps 1 --resume big.bin"), {"big.bin", "checkpoint"});
}

TEST_F(HostileInput, ResumeFromDevZeroStopsAtTheModelsCheckpointSize) {
  expect_one_line(run("run --reference --model '" + kTiny + "' --steps 1 --resume /dev/zero"),
                  {"/dev/zero", "checkpoint"});
}

// A checkpoint's header line is JSON too: 100,000 levels fit the tiny model's size bound.
TEST_F(HostileInput, DeepCheckpointHeaderRefused) {
  input("deep.ckpt", nested(100000) + "\n");
  expect_one_line(run("run --reference --model '" + kTiny + "' --steps 1 --resume deep.ckpt"),
                  {"deep.ckpt", "json-depth"});
}

TEST_F(HostileInput, ResultsFileOnDevZeroIsNotReadWhole) {
  // Either refused in one line or written through; never read whole into memory (bad_alloc).
  const CliResult r = run("sweep '" + kSource + "/examples/sweeps/qwen3-9m-quick.json' -o /dev/zero");
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
  EXPECT_TRUE(r.exit_code == 0 || r.exit_code == 2) << r.exit_code << " " << r.err;
  if (r.exit_code != 0) expect_one_line(r, {"/dev/zero"});
}

// ---- 9. Compile output estimated before compiling ------------------------------------------

TEST_F(HostileInput, CompileRefusesAPlanLargerThanPiperWouldReadBack) {
  // With the input limit at 1 MB, a 1024-microbatch plan of qwen3-9m (5.6 MB) is refused before the
  // compile, naming the limit and suggesting fewer microbatches; before, it was written (and then
  // unreadable by verify under the same limit).
  const std::string compile = "compile --model qwen3-9m --pp 2 --microbatches 1024 --schedule 1f1b";
  expect_one_line(run("--limit input-bytes=1000000 " + compile + " -o big.json"),
                  {"big.json", "limit 'input-bytes'", "fewer microbatches"});
  EXPECT_FALSE(fs::exists(dir_ / "big.json"));
  // Under the default limit it is written, and reads back; 64 microbatches fit the lowered limit.
  EXPECT_EQ(run(compile + " -o ok.json").exit_code, 0);
  EXPECT_EQ(run("verify ok.json").exit_code, 0);
  const CliResult small = run(
      "--limit input-bytes=1000000 compile --model qwen3-9m --pp 2 --microbatches 64 --schedule 1f1b -o small.json");
  EXPECT_EQ(small.exit_code, 0) << small.err;
  EXPECT_EQ(run("--limit input-bytes=1000000 verify small.json").exit_code, 0);
}

// ---- 11. Simulator inputs and results -------------------------------------------------------

TEST_F(HostileInput, TwoNodeClusterWithoutNicsRefused) {
  input("no-nics.json", R"({"preset": "dgx-h200", "nodes": 2, "node": {"nics": 0}})");
  expect_one_line(run("simulate --model qwen3-9m --pp 2 --dp 8 --cluster no-nics.json"), {"no-nics.json", "nics"});
}

// A cluster described from scratch without a NIC bandwidth: 3.5e9 s per step, exit 0.
TEST_F(HostileInput, MultiNodeClusterWithoutNicBandwidthRefused) {
  json c = json::parse(read_file(kSource + "/examples/clusters/custom-gpu.json"));
  c["node"].erase("nic_bandwidth_gbit_per_s");
  input("no-nic-bw.json", c.dump());
  expect_one_line(run("simulate --model qwen3-9m --pp 2 --dp 4 --cluster no-nic-bw.json"),
                  {"no-nic-bw.json", "nic_bandwidth_gbit_per_s"});
}

TEST_F(HostileInput, OutOfRangeClusterFieldRefused) {
  input("fast.json",
        R"({"preset": "dgx-h200", "node": {"gpu": {"preset": "h200-sxm", "half_efficiency_gflops": 1e308}}})");
  expect_one_line(run("simulate --model qwen3-9m --cluster fast.json"), {"fast.json", "half_efficiency_gflops"});
}

TEST_F(HostileInput, CalibrationEntryOfAnAgeRefused) {
  input(
      "cal.json",
      R"({"format": "piper-calibration", "gpu": "h200", "entries": [{"kind": "COMPUTE", "pass": "F", "seconds": 1e308}]})");
  expect_one_line(run("simulate --model qwen3-9m --calibration cal.json"), {"cal.json", "seconds"});
}

// ---- 12. Smaller ones -----------------------------------------------------------------------

TEST_F(HostileInput, SweepValueBeyondIntRefused) {
  input("sweep.json", R"({"model": "qwen3-9m", "cluster": "dgx-h200", "microbatches": [4, 2147483648]})");
  expect_one_line(run("sweep sweep.json -o out.csv"), {"sweep.json", "microbatches", "2147483648"});
  EXPECT_FALSE(fs::exists(dir_ / "out.csv"));
}

TEST_F(HostileInput, ImportCsvOfBinaryBytesIsOneShortPrintableLine) {
  std::string bytes;
  for (int i = 0; i < 355; ++i) bytes += static_cast<char>((i * 37 + 11) % 256 == '\n' ? 1 : (i * 37 + 11) % 256);
  input("junk.csv", bytes);
  const CliResult r = run("schedule import-csv junk.csv -o plan.json");
  expect_one_line(r, {"junk.csv"});
  EXPECT_LT(r.err.size(), 400u) << r.err;
  EXPECT_EQ(r.err.find("read as"), std::string::npos) << r.err;
}

TEST_F(HostileInput, StallTimeoutZeroRefusedAtParse) {
  expect_one_line(run("run --reference --model '" + kTiny + "' --steps 1 --stall-timeout 0"), {"--stall-timeout"});
}

TEST_F(HostileInput, ReferenceRunRefusesTheCudaBackend) {
  expect_one_line(run("run --reference --backend cuda --model '" + kTiny + "' --steps 1"),
                  {"--reference", "--backend cuda"});
}

// ---- 13. The adversarial-user probe --------------------------------------------------------
// Each case below was accepted (exit 0) or answered misleadingly before; now one line, exit 2.

// An output naming one of the command's inputs replaced it: the model spec, the directive program,
// the scenario, the CSV, each overwritten by the plan; two outputs on one path lost one of them.
TEST_F(HostileInput, OutputOverAnInputOrAnotherOutputIsRefused) {
  const std::string model = read_file(kTiny);
  input("model.json", model);
  expect_one_line(run("compile --model model.json -o model.json"),
                  {"model.json", "--output is also the input --model"});
  EXPECT_EQ(read_file(dir_ / "model.json"), model);
  // The same file by another spelling.
  expect_one_line(run("compile --model ./model.json -o '" + (dir_ / "model.json").string() + "'"),
                  {"--output is also the input --model"});
  const std::string program = read_file(kSource + "/tests/fixtures/piper-directives/dp2.json");
  input("dp2.json", program);
  expect_one_line(run("compile --model qwen3-9m --directives dp2.json -o dp2.json"), {"the input --directives"});
  EXPECT_EQ(read_file(dir_ / "dp2.json"), program);
  const std::string csv = "0F0,0B0\n";
  input("s.csv", csv);
  expect_one_line(run("schedule import-csv s.csv -o s.csv"), {"s.csv", "the input file"});
  EXPECT_EQ(read_file(dir_ / "s.csv"), csv);
  expect_one_line(run("compile --model qwen3-9m --save-scenario same.json -o same.json"),
                  {"same.json", "name the same file"});
  EXPECT_FALSE(fs::exists(dir_ / "same.json"));
  expect_one_line(run("tune --model qwen3-9m --devices 2 -o t.csv --emit-directives t.csv"), {"name the same file"});
  EXPECT_FALSE(fs::exists(dir_ / "t.csv"));
  // Devices take several outputs, and a run may save over the checkpoint it resumed from.
  const CliResult null = run("compile --model qwen3-9m --save-scenario /dev/null -o /dev/null");
  EXPECT_EQ(null.exit_code, 0) << null.err;
  const CliResult saved = run("run --reference --model '" + kTiny + "' --steps 1 --save ck");
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  const CliResult resumed = run("run --reference --model '" + kTiny + "' --steps 2 --resume ck --save ck");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
}

// --zb-memory-limit bounds zb-auto's scheduler; with any other schedule it was ignored.
TEST_F(HostileInput, ZbMemoryLimitWithAnotherScheduleRefused) {
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --pp 2 --schedule 1f1b --zb-memory-limit 2p"),
                  {"--zb-memory-limit", "zb-auto", "1f1b"});
  expect_one_line(run("schedule export-csv gpipe --ranks 2 --microbatches 2 --zb-memory-limit 3p"),
                  {"--zb-memory-limit"});
  const CliResult ok =
      run("simulate --model qwen3-9m --engine analytic --pp 2 --schedule zb-auto --zb-memory-limit 2p");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// A non-finite flag value was shown as JSON's "null".
TEST_F(HostileInput, NonFiniteFlagValueIsNamedNotNull) {
  const CliResult r = run("simulate --model qwen3-9m --engine analytic --clip-grad nan");
  expect_one_line(r, {"--clip-grad", "(got nan)"});
  EXPECT_EQ(r.err.find("null"), std::string::npos) << r.err;
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --bucket-mb inf"), {"--bucket-mb", "(got inf)"});
}

// CLI11's own range check printed DBL_MAX with 300 digits ("Value -1 not in range 0.000000 to 1797...").
TEST_F(HostileInput, NegativeCountsAreRefusedInAFewWords) {
  for (const std::string& args : {"run --reference --model '" + kTiny + "' --steps 1 --warmup-steps -1",
                                  std::string("compile --model qwen3-9m --pp 2 --pp-ranges 0,-1 -o plan.json"),
                                  std::string("tune --model qwen3-9m --devices 2 --top -1 -o t.csv")}) {
    SCOPED_TRACE(args);
    const CliResult r = run(args);
    expect_one_line(r, {"must be a non-negative integer"});
    EXPECT_LT(r.err.size(), 200u) << r.err;
  }
}

// A sweep spec's misspelt model or missing calibration made every row "invalid" or "error", exit 0.
TEST_F(HostileInput, SweepModelAndCalibrationCheckedUpFront) {
  input("typo.json", R"({"model": "qwen3-9", "engine": "analytic", "pp": [1, 2]})");
  expect_one_line(run("sweep typo.json -o out.csv"), {"typo.json", "field 'model'", "qwen3-9"});
  input("nocal.json", R"({"model": "qwen3-9m", "engine": "analytic", "calibration": "nope.json"})");
  expect_one_line(run("sweep nocal.json -o out.csv"), {"nocal.json", "field 'calibration'", "nope.json"});
  EXPECT_FALSE(fs::exists(dir_ / "out.csv"));
}

// Scenario integers past int wrapped: 4294967298 stages compiled as 2, a PP range 4294967297 as 1.
TEST_F(HostileInput, ScenarioIntegersBeyondIntRefused) {
  input("stages.json", R"({"model": "qwen3-9m", "stages": 4294967298, "strategy": {"pp": 2}})");
  expect_one_line(run("compile --scenario stages.json -o plan.json"), {"stages.json", "field 'stages'", "4294967298"});
  input("ranges.json", R"({"model": "qwen3-9m", "pp_ranges": [0, 4294967297], "strategy": {"pp": 2}})");
  expect_one_line(run("compile --scenario ranges.json -o plan.json"), {"ranges.json", "pp_ranges"});
  input("first.json", R"({"model": "qwen3-9m", "first_stage_layers": 4294967297, "strategy": {"pp": 2}})");
  expect_one_line(run("compile --scenario first.json -o plan.json"), {"first.json", "first_stage_layers"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
}

// An empty export-chakra prefix wrote hidden files (".0.et"); "../x" wrote beside the folder.
TEST_F(HostileInput, ChakraPrefixMustBeAPlainFileName) {
  ASSERT_EQ(run("compile --model qwen3-9m --pp 2 --microbatches 2 -o plan.json").exit_code, 0);
  for (const std::string prefix : {"''", "../escaped", "a/b", ".."}) {
    SCOPED_TRACE(prefix);
    // The empty one is refused as every empty flag value is (test_reliability_probes_14.cpp).
    expect_one_line(run("export-chakra plan.json -o traces --prefix " + prefix),
                    {"prefix", prefix == "''" ? "empty value" : "plain file name"});
    EXPECT_FALSE(fs::exists(dir_ / "traces"));
  }
  EXPECT_FALSE(fs::exists(dir_ / "escaped.0.et"));
}

// tune: a --tp that cannot apply, or a sequence past a limit, left nothing to search and ended with
// "no simulated plan fits 124.75 GiB", exit 1; --max-virtual 2147483647 never ended; --memory-cap 0
// silently meant the default cap.
TEST_F(HostileInput, TuneRefusesAnEmptySearchSpaceAndAbsurdKnobs) {
  expect_one_line(run("tune --model qwen3-9m --devices 2 --tp 16 -o t.csv", 60),
                  {"no tensor-parallel degree applies", "TP 16: does not divide the 2 devices"});
  expect_one_line(run("tune --model qwen3-9m --devices 2 --seq-len 100000000 -o t.csv", 60),
                  {"no tensor-parallel degree applies", "limit 'tokens-per-microbatch'"});
  expect_one_line(run("tune --model qwen3-9m --devices 2 --cp 3 -o t.csv", 60),
                  {"no context-parallel degree applies", "CP 3"});
  expect_one_line(run("tune --model qwen3-9m --devices 2 --memory-cap 0 -o t.csv"), {"--memory-cap"});
  EXPECT_FALSE(fs::exists(dir_ / "t.csv"));
  const CliResult r =
      run("tune --model qwen3-9m --devices 2 --max-virtual 2147483647 --schedules interleaved-1f1b "
          "--recompute none --zero 0 --top 0 -o v.csv",
          60);
  EXPECT_NE(r.exit_code, 124) << "still spinning through --max-virtual";
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

// A key given twice in one object kept its last value without a word ("pp": 2 then "pp": 4), in every
// JSON input; equal keys in different objects are fine.
TEST_F(HostileInput, DuplicateJsonKeysRefusedInEveryInputKind) {
  std::string spec = read_file(kTiny);
  spec.replace(spec.find('{'), 1, "{\"layers\": 64, ");
  input("model.json", spec);
  expect_one_line(run("compile --model model.json -o plan.json"), {"model.json", "duplicate key 'layers'"});
  input("scenario.json", R"({"model": "qwen3-9m", "strategy": {"pp": 2, "microbatches": 4, "pp": 4}})");
  expect_one_line(run("compile --scenario scenario.json -o plan.json"), {"scenario.json", "duplicate key 'pp'"});
  input("cluster.json", R"({"preset": "dgx-h200", "nodes": 1, "nodes": 2})");
  expect_one_line(run("simulate --model qwen3-9m --cluster cluster.json"), {"cluster.json", "duplicate key 'nodes'"});
  input("dp2.json", R"([{"op": "place", "filter": {"PP": 0}, "devices": [0, 1], "devices": [0]}])");
  expect_one_line(run("compile --model qwen3-9m --directives dp2.json -o plan.json"),
                  {"dp2.json", "duplicate key 'devices'"});
  input("sweep.json", R"({"model": "qwen3-9m", "pp": [1], "pp": [2]})");
  expect_one_line(run("sweep sweep.json -o out.csv"), {"sweep.json", "duplicate key 'pp'"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
  EXPECT_FALSE(fs::exists(dir_ / "out.csv"));
  // The same key in sibling and nested objects is not a duplicate.
  input("ok.json", R"([{"op": "place", "filter": {"PP": 0}, "devices": [0, 1]},
                       {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1]}])");
  const CliResult ok = run("compile --model qwen3-9m --directives ok.json -o plan.json");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// A calibration file's unknown keys were ignored: an entry with a misspelt match field ("flop")
// matched every COMPUTE F op, and "secs" left the entry without its time. Every level is checked.
TEST_F(HostileInput, CalibrationUnknownKeysRefusedAtEveryLevel) {
  input("flop.json", R"({"format": "piper-calibration", "gpu": "h200", "entries": [
      {"kind": "COMPUTE", "pass": "B", "seconds": 0.25},
      {"kind": "COMPUTE", "pass": "F", "flop": 1e12, "seconds": 0.5}]})");
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --calibration flop.json"),
                  {"flop.json", "field 'entries[1].flop'", "unknown field", "did you mean 'flops'"});
  tiny_plan();  // a.json; `piper calibrate` named the file twice ("flop.json: flop.json: field ...")
  const CliResult fit = run("calibrate --plan a.json --calibration flop.json -o table.json");
  expect_one_line(fit, {"did you mean 'flops'"});
  EXPECT_EQ(fit.err.rfind("piper: error: flop.json: field 'entries[1].flop'", 0), 0u) << fit.err;
  input("secs.json", R"({"format": "piper-calibration", "entries": [{"kind": "COMPUTE", "secs": 0.5}]})");
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --calibration secs.json"),
                  {"secs.json", "field 'entries[0].secs'", "expected one of: kind, pass, seconds, flops"});
  input("top.json", R"({"format": "piper-calibration", "entries": [], "gpus": "h200"})");
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --calibration top.json"),
                  {"top.json", "field 'gpus'", "did you mean 'gpu'"});
  // What `piper run --calibrate` writes ("version", "measured") and the shipped files still read.
  for (const std::string& shipped : {kSource + "/experiments/fidelity/data/h200-piper-cuda/cal-pp1.json",
                                     kSource + "/tests/fuzz/seeds/calibration/h200.json"}) {
    const CliResult ok = run("simulate --model qwen3-9m --engine analytic --calibration '" + shipped + "'");
    EXPECT_EQ(ok.exit_code, 0) << shipped << ": " << ok.err;
  }
}

// A hand-edited plan's unknown keys were ignored: "wait" for "waits" dropped the op's dependencies
// and verify said "ok". Each is refused with its path, by every command that reads a plan.
TEST_F(HostileInput, PlanUnknownKeysRefusedWithTheirPath) {
  const json plan = tiny_plan();
  input("a.json", plan.dump());
  EXPECT_EQ(run("verify a.json").exit_code, 0);  // what compile writes reads back
  json wait = plan;
  wait["plans"][1]["streams"][0]["ops"][3]["wait"] = json::array({json::array({0, 0})});
  input("wait.json", wait.dump());
  for (const char* cmd : {"verify wait.json", "simulate --plan wait.json", "run --reference --plan wait.json"})
    expect_one_line(run(cmd),
                    {"wait.json", "field 'plans[1].streams[0].ops[3].wait'", "unknown field", "did you mean 'waits'"});
  struct Case {
    std::vector<std::string> where;  // object path in the plan
    const char* key;
    const char* fragment;
  };
  const std::vector<Case> cases = {
      {{}, "stat", "field 'stat'"},
      {{"training"}, "seqlen", "field 'training.seqlen'"},
      {{"segments", "0"}, "tp_degre", "field 'segments[0].tp_degre'"},
      {{"families", "0"}, "strides", "field 'families[0].strides'"},
      {{"plans", "0"}, "buffer", "field 'plans[0].buffer'"},
      {{"plans", "0", "streams", "1"}, "op", "field 'plans[0].streams[1].op'"},
      {{"plans", "0", "buffers", "0"}, "frees", "field 'plans[0].buffers[0].frees'"},
      {{"stats"}, "dag_node", "field 'stats.dag_node'"},
  };
  for (const Case& c : cases) {
    json edited = plan;
    json* at = &edited;
    for (const std::string& step : c.where)
      at = at->is_array() ? &(*at)[static_cast<std::size_t>(std::stoi(step))] : &(*at)[step];
    ASSERT_TRUE(at->is_object()) << c.fragment;
    (*at)[c.key] = 1;
    input("edited.json", edited.dump());
    SCOPED_TRACE(c.fragment);
    expect_one_line(run("verify edited.json"), {"edited.json", c.fragment, "unknown field"});
  }
}

// `run --seed -1` wrapped to 2^64 - 1 and trained.
TEST_F(HostileInput, NegativeSeedRefused) {
  expect_one_line(run("run --reference --model '" + kTiny + "' --steps 1 --seed -1"), {"--seed", "got '-1'"});
  expect_one_line(run("run --reference --model '" + kTiny + "' --steps 1 --seed 18446744073709551616"), {"--seed"});
  EXPECT_EQ(run("run --reference --model '" + kTiny + "' --steps 1 --seed 18446744073709551615").exit_code, 0);
}

// `tune --emit-directives /no/such/dir/x.json` ran the whole search, wrote the results file and
// printed the table, then failed to write. Every output's folder is checked before the command runs;
// outputs that create their folder (run --save, export-chakra -o, compile --dump-dir) still do.
TEST_F(HostileInput, OutputFolderCheckedBeforeTheWork) {
  const CliResult tune = run("tune --model qwen3-9m --devices 2 --emit-directives missing/dir/x.json -o t.csv");
  expect_one_line(tune, {"missing/dir/x.json", "--emit-directives", "no such folder 'missing/dir'"});
  EXPECT_EQ(tune.out, "");
  EXPECT_FALSE(fs::exists(dir_ / "t.csv"));
  const CliResult train = run("run --reference --model '" + kTiny + "' --steps 1 --report missing/run.json");
  expect_one_line(train, {"--report", "no such folder 'missing'"});
  EXPECT_EQ(train.out, "");
  input("afile", "x");
  expect_one_line(run("compile --model qwen3-9m -o afile/plan.json"), {"--output", "'afile' is not a folder"});
  EXPECT_EQ(run("compile --model '" + kTiny + "' -o plan.json").exit_code, 0);
  const CliResult chakra = run("export-chakra plan.json -o new/traces");
  EXPECT_EQ(chakra.exit_code, 0) << chakra.err;
  EXPECT_TRUE(fs::exists(dir_ / "new/traces"));
  const CliResult save = run("run --reference --plan plan.json --steps 1 --save ck/dir/step.ckpt");
  EXPECT_EQ(save.exit_code, 0) << save.err;
  EXPECT_TRUE(fs::exists(dir_ / "ck/dir/step.ckpt"));
}

// A kernel table (cluster "kernel_table") whose "base" named itself recursed until SIGSEGV; a misspelt
// list ("gem") or a scale without a base was ignored; a shape of 0.5 became 0, and 1e18 x 1e18
// overflowed int64. Each is now one line naming the cluster, the table and the field.
TEST_F(HostileInput, KernelTableBaseShapesAndUnknownKeysChecked) {
  input("c.json", R"({"preset": "dgx-h200", "nodes": 1, "node": {"gpu": {"kernel_table": "t.json"}}})");
  const std::string sim = "simulate --model qwen3-9m --pp 2 --microbatches 2 --engine analytic --cluster c.json";
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {R"({"base": "t.json"})", {"field 'base'", "built-in table name", "h200-sxm"}},
      {R"({"base": "nope"})", {"field 'base'", "got \"nope\""}},
      {R"({"gem": []})", {"field 'gem'", "did you mean 'gemm'"}},
      {R"({"compute_scale": 0.001})", {"field 'compute_scale'", "give \"base\" too"}},
      {R"({"gemm": [{"dtype": "bf16", "m": 0.5, "n": 1024, "k": 1024, "tflops": 100}]})",
       {"field 'gemm[0].m'", "whole number"}},
      {R"({"attention": [{"b": 1e18, "s": 1024, "heads": 1e18, "head_dim": 64, "fwd_tflops": 1, "bwd_tflops": 1}]})",
       {"field 'attention[0].b'", "whole number"}},
      // A scale past 1000 either way gave finite, absurd times (a 300-digit step in ms).
      {R"({"base": "h200-sxm", "gemm_scale": 1e-300})", {"field 'gemm_scale'", "must be in [0.001, 1000]"}},
      {R"({"base": "h200-sxm", "memory_scale": 1e4})", {"field 'memory_scale'", "must be in [0.001, 1000]"}}};
  for (const auto& [table, fragments] : cases) {
    SCOPED_TRACE(table);
    input("t.json", table);
    std::vector<std::string> want = {"c.json", "t.json"};
    want.insert(want.end(), fragments.begin(), fragments.end());
    expect_one_line(run(sim, 30), want);
  }
  input("t.json", R"({"base": "h200-sxm", "compute_scale": 0.5, "comment": "slower"})");
  EXPECT_EQ(run(sim, 30).exit_code, 0);
}

// calibrate --trace: a non-string "cat" or "ph" escaped as json's "type must be string, but is number"
// (no file, no event); a kernel of 1e300 us made the fit's squares overflow and its multiplier land on
// the lower bound (0.5), written as a table with exit 0.
TEST_F(HostileInput, CalibrateTraceEventFieldsNamedAndDurationsBounded) {
  const std::string calibrate = "calibrate --model qwen3-9m --pp 1 --microbatches 2 --trace tr.json -o table.json";
  input("tr.json", R"({"traceEvents": [{"ph": "X", "cat": 5, "name": "x", "dur": 100}]})");
  expect_one_line(run(calibrate, 30), {"tr.json", "traceEvents[0].cat", "expected a string"});
  input("tr.json", R"({"traceEvents": [{"ph": 7, "cat": "kernel", "name": "x", "dur": 100}]})");
  expect_one_line(run(calibrate, 30), {"tr.json", "traceEvents[0].ph", "expected a string"});
  input("tr.json", R"({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "elementwise", "dur": 1e300}]})");
  expect_one_line(run(calibrate, 30), {"tr.json", "traceEvents[0].dur", "[0, 1e12]"});
  EXPECT_FALSE(fs::exists(dir_ / "table.json"));
  // A kernel within the bound but a million times the table's time fits a multiplier whose table
  // (scale 1 / multiplier) no table accepts: refused, nothing written.
  input("tr.json", R"({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "elementwise", "dur": 1e12}]})");
  expect_one_line(run(calibrate, 30), {"calibrate", "times slower than the table's", "1000"});
  EXPECT_FALSE(fs::exists(dir_ / "table.json"));
  input("tr.json", R"({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "elementwise", "dur": 100}]})");
  EXPECT_EQ(run(calibrate, 30).exit_code, 0);
}

// schedule show --costs 1000000000,2000000000,1 overflowed the int time units and drew a grid of
// billions of columns: it ran past any timeout. --ranks 100000 was refused naming llama3-8b's layers.
TEST_F(HostileInput, ScheduleShowBoundsCostsAndNamesTheFlag) {
  expect_one_line(run("schedule show 1f1b --ranks 2 --microbatches 2 --costs 1000000000,2000000000,1", 30),
                  {"--costs", "at most 100"});
  const CliResult ranks = run("schedule show 1f1b --ranks 100000 --microbatches 2", 30);
  expect_one_line(ranks, {"--pp x --virtual", "100000 PP regions", "limit 'layers'"});
  EXPECT_EQ(ranks.err.find("llama3-8b"), std::string::npos) << ranks.err;
  EXPECT_EQ(run("schedule show 1f1b --ranks 2 --microbatches 2 --costs 100,100,1", 30).exit_code, 0);
}

// A sweep's seq_len or micro_batch_size of -1 silently meant the model's (as 0 does).
TEST_F(HostileInput, SweepNegativeSequenceShapeRefused) {
  input("mbs.json", R"({"model": "qwen3-9m", "pp": 2, "micro_batch_size": [2, -1]})");
  expect_one_line(run("sweep mbs.json -o out.csv"), {"mbs.json", "field 'micro_batch_size'", ">= 0", "-1"});
  input("seq.json", R"({"model": "qwen3-9m", "pp": 2, "seq_len": -128})");
  expect_one_line(run("sweep seq.json -o out.csv"), {"seq.json", "field 'seq_len'", "-128"});
  EXPECT_FALSE(fs::exists(dir_ / "out.csv"));
}

// A value listed twice in a sweep list ("pp": [2, 2], a typo for [2, 4]) was counted as two
// combinations and run as one: "2 combinations: 0 already in out.csv, 1 run".
TEST_F(HostileInput, SweepValueListedTwiceRefused) {
  input("pp.json", R"({"model": "qwen3-9m", "pp": [2, 2], "microbatches": 4})");
  expect_one_line(run("sweep pp.json -o out.csv"), {"pp.json", "field 'pp'", "2 is listed twice", "entries 1 and 2"});
  input("eng.json", R"({"model": "qwen3-9m", "pp": 2, "engine": ["analytic", "simgrid", "analytic"]})");
  expect_one_line(run("sweep eng.json -o out.csv"), {"eng.json", "field 'engine'", "\"analytic\" is listed twice"});
  input("seq.json", R"({"model": "qwen3-9m", "pp": 2, "seq_len": [128, 128.0]})");
  EXPECT_EQ(run("sweep seq.json -o out.csv").exit_code, 2);  // 128.0 is not an integer, or a repeat: either way
  EXPECT_FALSE(fs::exists(dir_ / "out.csv"));
  input("ok.json", R"({"model": "qwen3-9m", "pp": [1, 2], "microbatches": 2})");
  EXPECT_EQ(run("sweep ok.json -o out.csv").exit_code, 0);
}

// A Hugging Face config whose num_key_value_heads, num_experts_per_tok or first_k_dense_replace broke a
// model rule was refused under the spec's names ('kv_heads', 'moe.top_k'), which the file does not
// hold; and the "fields not modelled" warning came three times from one compile.
TEST_F(HostileInput, HuggingFaceConfigErrorsNameTheFilesKeys) {
  const std::string llama = R"({"model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "intermediate_size": 128, )";
  input("kv.json", llama + R"("num_key_value_heads": 3})");
  expect_one_line(run("compile --model kv.json -o plan.json"),
                  {"kv.json: field 'num_key_value_heads': must divide num_attention_heads (4)"});
  input("moe.json", R"({"model_type": "mixtral", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "intermediate_size": 128, "num_local_experts": 4,
                        "num_experts_per_tok": 8})");
  expect_one_line(run("compile --model moe.json -o plan.json"),
                  {"moe.json: field 'num_experts_per_tok': must not exceed num_local_experts (4)"});
  input("ds.json", R"({"model_type": "deepseek_v3", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 3,
                       "num_attention_heads": 4, "intermediate_size": 128, "n_routed_experts": 4,
                       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "kv_lora_rank": 16,
                       "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16, "first_k_dense_replace": 9})");
  expect_one_line(run("compile --model ds.json -o plan.json"),
                  {"ds.json: field 'first_k_dense_replace': must not exceed num_hidden_layers (3)"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
  input("extra.json", llama + R"("zeta_mixer": 1})");
  const CliResult ok = run("compile --model extra.json -o plan.json");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_EQ(ok.err, "piper: warning: extra.json: fields not modelled: zeta_mixer\n");
}

// `--limit` is documented as repeatable, but a second one was refused by the flag parser ("At Most 1
// required but received 2"); the same limit twice now names the limit instead of keeping the last.
TEST_F(HostileInput, LimitFlagRepeatsButNotTheSameLimitTwice) {
  const CliResult two = run("--limit devices=5 limits --limit json-depth=7");
  EXPECT_EQ(two.exit_code, 0) << two.err;
  EXPECT_NE(two.out.find("json-depth                           7*"), std::string::npos) << two.out;
  EXPECT_NE(two.out.find("devices                              5*"), std::string::npos) << two.out;
  expect_one_line(run("--limit devices=5 --limit devices=9 limits"), {"--limit devices: given twice"});
}

// Pins that exclude each other (--pp 2 --dp 4 on 4 devices, a --dp-shard no DP degree takes, a global
// batch smaller than one microbatch) left nothing to search: "no simulated plan fits 124.75 GiB", exit 1.
TEST_F(HostileInput, TunePinsThatLeaveNothingToSearchRefused) {
  expect_one_line(run("tune --model qwen3-9m --devices 4 --pp 2 --dp 4 --top 0 -o t.csv", 60),
                  {"nothing to search", "4 devices", "--pp, --dp"});
  expect_one_line(run("tune --model qwen3-9m --devices 4 --dp-shard 3 --top 0 -o t.csv", 60),
                  {"nothing to search", "--dp-shard"});
  expect_one_line(run("tune --model qwen3-9m --devices 4 --global-batch 1 --micro-batch-size 2 --top 0 -o t.csv", 60),
                  {"nothing to search", "not a multiple of DP x micro batch size"});
  // An unknown family named the flag of simulate and compile, --schedule.
  expect_one_line(run("tune --model qwen3-9m --devices 4 --schedules 1f1b,foo -o t.csv"),
                  {"--schedules 'foo' is unknown"});
  EXPECT_FALSE(fs::exists(dir_ / "t.csv"));
}

// A directive program whose "PP" filters name more regions than the model has pipeline units was
// refused without the file: "cannot annotate 5 PP regions: qwen3-9m: ...".
TEST_F(HostileInput, DirectivePpFilterPastTheModelNamesTheFile) {
  input("pp.json", R"([{"op": "place", "filter": {"PP": 4}, "devices": [0]}])");
  expect_one_line(run("compile --model qwen3-9m --directives pp.json -o plan.json"),
                  {"pp.json: \"PP\" filters up to 4: cannot annotate 5 PP regions", "between 1 and 4"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
}

// ---- The helpers themselves ------------------------------------------------------------------

// Depth of {"a": "<s>", "b": [[1]]} as check_json_depth sees it: the smallest limit it accepts.
int depth_seen(const std::string& inside_string) {
  const std::string text = "{\"a\": \"" + inside_string + "\", \"b\": [[1]]}";
  for (int limit = 1; limit < 64; ++limit) {
    piper::core::set_limit("json-depth", limit);
    try {
      piper::core::check_json_depth(text, "t.json");
      piper::core::reset_limits_to_defaults();
      return limit;
    } catch (const piper::core::LimitError&) {
    }
  }
  piper::core::reset_limits_to_defaults();
  return -1;
}

TEST(JsonDepth, StringsWithEscapesAreSkipped) {
  EXPECT_EQ(depth_seen("plain"), 3);
  EXPECT_EQ(depth_seen("[[[[{{{{"), 3);        // brackets inside a string
  EXPECT_EQ(depth_seen("x\\\"[[[[\\\"]"), 3);  // \" does not end the string
  EXPECT_EQ(depth_seen("\\\\"), 3);            // an escaped backslash, then the closing quote
}

TEST(JsonDepth, RefusalNamesTheFileAndTheLimit) {
  try {
    piper::core::check_json_depth(nested(300), "deep.json");
    FAIL() << "accepted 300 levels";
  } catch (const piper::core::LimitError& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("deep.json: 257 levels", 0), 0u) << m;
    EXPECT_NE(m.find("limit 'json-depth'"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(piper::core::check_json_depth(nested(256), "ok.json"));
}

TEST(Printable, EscapesControlAndNonUtf8BytesKeepsUtf8AndCuts) {
  EXPECT_EQ(piper::core::printable("a\x01"
                                   "b\x7f"),
            "a\\x01b\\x7f");
  EXPECT_EQ(piper::core::printable("mod\xc3\xa8"
                                   "le.json"),
            "mod\xc3\xa8"
            "le.json");                                         // UTF-8 kept
  EXPECT_EQ(piper::core::printable("\xff\xc3"), "\\xff\\xc3");  // not UTF-8
  EXPECT_EQ(piper::core::printable(std::string(100, 'x'), 10), std::string(10, 'x') + "... (100 bytes in all)");
}

}  // namespace
