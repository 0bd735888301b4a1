// Reliability, input side, the fourth to tenth probes (docs/reliability.md): settings that had no
// effect where they were given, outputs and their paths, hand-edited plans' sizes, flags named by
// what the user gave. Each case runs the real `piper` binary (the HostileInput fixture).
#include <algorithm>
#include <filesystem>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "hostile_input.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using piper::test::CliResult;
using piper::test::HostileInput;
using piper::test::kSource;
using piper::test::read_file;
using piper::test::run_cli_in;

namespace {

// The results file `csv` with one cell of data row `row` (line row + 1) set, by column name. Lines are
// split at every comma and joined again, which leaves every other line as it was; the edited row
// must have no quoted field before the column.
std::string with_cell(const std::string& csv, int row, const std::string& column, const std::string& value) {
  std::vector<std::vector<std::string>> lines;
  std::istringstream in(csv);
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> fields;
    std::istringstream cells(line);
    for (std::string f; std::getline(cells, f, ',');) fields.push_back(f);
    if (!line.empty() && line.back() == ',') fields.emplace_back();
    lines.push_back(fields);
  }
  const auto at = std::find(lines[0].begin(), lines[0].end(), column) - lines[0].begin();
  lines.at(static_cast<std::size_t>(row)).at(static_cast<std::size_t>(at)) = value;
  std::string text;
  for (const auto& fields : lines) {
    for (std::size_t i = 0; i < fields.size(); ++i) text += (i ? "," : "") + fields[i];
    text += "\n";
  }
  return text;
}

// ---- Round 4: settings that had no effect where they were given ---------------------------------

// --etp on a dense model compiled the same plan as --etp 1 (--ep was already refused there); a MoE
// spec whose first_dense_layers covers every block kept its experts on paper only, so --ep 2 changed
// nothing; a shared_expert_ffn without shared experts was dropped.
TEST_F(HostileInput, ExpertSettingsWithoutExpertsRefused) {
  const std::string dense = kSource + "/examples/models/dense-1b.json";
  expect_one_line(run("compile --model '" + dense + "' --dp 2 --etp 2 -o plan.json"),
                  {"--etp 2", "model 'dense-1b' has no MoE experts", "use --etp 1"});
  const std::string base =
      R"({"name": "m", "vocab": 1000, "hidden": 256, "layers": 4, "heads": 4, "ffn": 512, "moe": {"experts": 4,
          "top_k": 2, "expert_ffn": 128, )";
  input("all-dense.json", base + R"("first_dense_layers": 4}})");
  expect_one_line(run("simulate --model all-dense.json --dp 2 --ep 2 --engine analytic"),
                  {"all-dense.json", "field 'moe.first_dense_layers'", "equals layers (4)", "no block would be a MoE"});
  input("shared.json", base + R"("shared_expert_ffn": 64}})");
  expect_one_line(run("compile --model shared.json -o plan.json"),
                  {"shared.json", "field 'moe.shared_expert_ffn'", "needs moe.shared_experts >= 1"});
  // The same with shared experts, and three dense blocks of four, still compile.
  input("ok.json", base + R"("shared_experts": 1, "shared_expert_ffn": 64, "first_dense_layers": 3}})");
  EXPECT_EQ(run("compile --model ok.json --dp 2 --ep 2 -o plan.json").exit_code, 0);
  fs::remove(dir_ / "plan.json");
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
}

// A scenario holding a directive program used the program and ignored the strategy's parallelism
// ("pp": 4, "zero": 3 compiled the program's PP 2 without ZeRO, exit 0), its schedule settings unless
// "append_schedule" was set, and "append_schedule" without a program. The CLI's --global-batch and
// --virtual beside --directives without --schedule were ignored too (--microbatches was refused).
TEST_F(HostileInput, ScenarioSettingsADirectiveProgramWouldIgnoreRefused) {
  const CliResult program = run("directives --model qwen3-9m --pp 2 --microbatches 2");
  ASSERT_EQ(program.exit_code, 0) << program.err;
  input("d.json", program.out);
  input("pp.json", R"({"model": "qwen3-9m", "directives": "d.json", "strategy": {"pp": 4, "zero": 3}})");
  expect_one_line(run("compile --scenario pp.json -o plan.json"),
                  {"pp.json", "field 'strategy.pp'", "directive program fixes the placement", "would be ignored"});
  input("mb.json", R"({"model": "qwen3-9m", "directives": "d.json", "strategy": {"microbatches": 8}})");
  expect_one_line(run("simulate --scenario mb.json"),
                  {"mb.json", "field 'strategy.microbatches'", "applies only with \"append_schedule\": true"});
  input("append.json", R"({"model": "qwen3-9m", "append_schedule": true, "strategy": {"pp": 2}})");
  expect_one_line(run("compile --scenario append.json -o plan.json"),
                  {"append.json", "field 'append_schedule'", "applies only with \"directives\""});
  expect_one_line(run("compile --model qwen3-9m --directives d.json --global-batch 8 -o plan.json"),
                  {"--global-batch with --directives needs --schedule"});
  expect_one_line(run("compile --model qwen3-9m --directives d.json --virtual 2 -o plan.json"),
                  {"--virtual with --directives needs --schedule"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
  // What --save-scenario writes beside a program reads back (the settings at their defaults are left
  // out), with an appended schedule its settings kept.
  ASSERT_EQ(run("compile --model qwen3-9m --directives d.json --save-scenario s.json -o a.json").exit_code, 0);
  EXPECT_EQ(json::parse(read_file(dir_ / "s.json"))["strategy"], json::object());
  EXPECT_EQ(run("compile --scenario s.json -o b.json").exit_code, 0);
  // A key given twice in the directive file a scenario names (read by the scenario, not by --directives).
  input("dup.json", R"([{"op": "split", "filter": {}, "filter": {}, "dim_name": "MB", "num_microbatches": 2}])");
  input("dup-scenario.json", R"({"model": "qwen3-9m", "directives": "dup.json"})");
  expect_one_line(run("compile --scenario dup-scenario.json -o plan.json"),
                  {"dup-scenario.json", "field 'directives'", "duplicate key 'filter'"});
  // A train section's warmup_steps past int wrapped (4294967297 warmed up for 1 step).
  input("warm.json", R"({"model": "qwen3-9m", "train": {"warmup_steps": 4294967297}})");
  expect_one_line(run("run --reference --scenario warm.json"), {"warm.json", "field 'train.warmup_steps'", "1e9"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
}

// A misspelt PIPER_LIMIT_ variable left its limit at the default, silently; " 5" was read as 5 while
// "5 " was refused.
TEST_F(HostileInput, UnknownOrPaddedLimitVariablesRefused) {
  const CliResult misspelt =
      run_cli_in(dir_, PIPER_CLI, "compile --model qwen3-9m --dp 2 -o plan.json", "PIPER_LIMIT_DEVICE=1 timeout 60");
  expect_one_line(misspelt, {"PIPER_LIMIT_DEVICE: not a piper limit", "did you mean 'PIPER_LIMIT_DEVICES'"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
  expect_one_line(run_cli_in(dir_, PIPER_CLI, "limits", "PIPER_LIMIT_DEVICES=' 5' timeout 60"),
                  {"PIPER_LIMIT_DEVICES: expected a positive integer, got ' 5'"});
  const CliResult ok = run_cli_in(dir_, PIPER_CLI, "limits", "PIPER_LIMIT_DEVICES=5 timeout 60");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// tune's knob lists: an explicit value no candidate can take was dropped from every plan, exit 0
// (`--sequence-parallel on` with only TP 1 ranked plans without SP; `--reduce-every step` with ZeRO-0).
TEST_F(HostileInput, TuneKnobsNoCandidateCanTakeRefused) {
  const std::string narrow =
      "tune --model qwen3-9m --devices 2 --pp 1 --micro-batch-size 1 --recompute none "
      "--schedules 1f1b --max-virtual 1 --top 0 -o t.csv ";
  expect_one_line(run(narrow + "--tp 1 --sequence-parallel on", 60),
                  {"--sequence-parallel on", "no candidate has a TP degree of 2 or more"});
  expect_one_line(run(narrow + "--tp 1 --zero 0,1 --reduce-every step", 60),
                  {"--reduce-every step applies to ZeRO-2/3", "no candidate has ZeRO 2 or 3"});
  EXPECT_FALSE(fs::exists(dir_ / "t.csv"));
  // Where some candidate takes it, the search runs.
  const CliResult ok = run(narrow + "--tp 1 --zero 0,2 --reduce-every step", 120);
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

// ---- Fifth probe: outputs, plots, runs -----------------------------------------------------------

// An SM partition on a cluster whose GPU has no sm_count: the line named the directive
// ("sm_partition: the cluster's GPU 'custom' has no sm_count"), neither the flag, the directive file,
// the plan nor the cluster file. Now what asked for the partition and the cluster, in every front end.
TEST_F(HostileInput, CommSmsOnAGpuWithoutSmCountNamesTheFlagAndTheCluster) {
  json cluster = json::parse(read_file(kSource + "/examples/clusters/custom-gpu.json"));
  cluster["node"]["gpu"].erase("sm_count");
  input("nosm.json", cluster.dump());
  const std::string why = "cluster 'nosm.json': its GPU 'custom' has no sm_count to partition";
  const std::string sim = "simulate --model qwen3-9m --engine analytic --cluster nosm.json ";
  expect_one_line(run(sim + "--pp 2 --microbatches 2 --comm-sms 8 --report r.json"), {"--comm-sms 8: " + why});
  input("d.json", R"([{"op": "place", "filter": {"PP": 0}, "devices": [0]}, {"op": "sm_partition", "sms": 8}])");
  expect_one_line(run(sim + "--directives d.json --trace t.json"), {"d.json: directive 1 field 'sms': " + why});
  ASSERT_EQ(
      run("compile --model qwen3-9m --pp 2 --microbatches 2 --comm-sms 8 -o p.json --save-scenario s.json").exit_code,
      0);
  expect_one_line(run("simulate --plan p.json --cluster nosm.json"), {"p.json: field 'sm_partition.sms': " + why});
  expect_one_line(run("simulate --scenario s.json --cluster nosm.json"), {"s.json: field 'strategy.comm_sms': " + why});
  expect_one_line(run("tune --model qwen3-9m --devices 2 --cluster nosm.json --comm-sms 8 -o t.csv"),
                  {"--comm-sms 8: " + why});
  input("sw.json", R"({"cluster": "nosm.json", "comm_sms": [0, 8]})");
  expect_one_line(run("sweep sw.json -o sw.csv"), {"sw.json: field 'comm_sms': " + why});
  for (const char* out : {"r.json", "t.json", "t.csv", "sw.csv"}) EXPECT_FALSE(fs::exists(dir_ / out)) << out;
}

// An output naming an existing folder: refused before the work, as a missing folder is. It failed
// only when written: `tune -o t.csv --emit-directives DIR` searched and wrote t.csv, `run --save ck
// --report DIR` trained and saved ck, then exit 2.
TEST_F(HostileInput, OutputThatIsAFolderRefusedBeforeTheWork) {
  fs::create_directories(dir_ / "dir");
  expect_one_line(run("tune --model qwen3-9m --devices 2 -o t.csv --emit-directives dir"),
                  {"dir", "--emit-directives: is a folder"});
  EXPECT_FALSE(fs::exists(dir_ / "t.csv"));
  ASSERT_EQ(run("compile --model qwen3-9m --pp 2 --microbatches 2 -o p.json").exit_code, 0);
  const CliResult trained = run("run --reference --plan p.json --steps 1 --save ck --report dir");
  expect_one_line(trained, {"--report: is a folder"});
  EXPECT_EQ(trained.out.find("step"), std::string::npos) << trained.out;
  EXPECT_FALSE(fs::exists(dir_ / "ck"));
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --trace dir"), {"--trace: is a folder"});
  expect_one_line(run("compile --model qwen3-9m -o plan.json --save-scenario dir"), {"--save-scenario: is a folder"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
  // Outputs that are folders (export-chakra -o) still take an existing one.
  EXPECT_EQ(run("export-chakra p.json -o dir").exit_code, 0);
  EXPECT_TRUE(fs::exists(dir_ / "dir" / "piper.0.et"));
}

// `plot -o chart.svg` (or .jpg, .pdf) wrote PNG bytes under that name, exit 0; `tune --plot x.svg`
// the same after the whole search. Refused when the flags are read.
TEST_F(HostileInput, PngOutputUnderAnotherImageExtensionRefused) {
  input("r.csv", "x,y\n1,2\n2,3\n");
  for (const char* name : {"chart.svg", "chart.JPG", "chart.pdf"}) {
    expect_one_line(run(std::string("plot r.csv --x x --y y -o ") + name), {"--output", "name a .png file", name});
    EXPECT_FALSE(fs::exists(dir_ / name)) << name;
  }
  expect_one_line(run("tune --model qwen3-9m --devices 2 -o t.csv --plot pareto.svg"), {"--plot", "name a .png file"});
  EXPECT_FALSE(fs::exists(dir_ / "t.csv"));
}

// A sweep spec with a calibration resuming the results file of the same sweep without one: every
// combination was "already in" the file, so its uncalibrated rows stood for the calibrated sweep
// (nothing in a row says which), exit 0. The calibration file is part of the key now.
TEST_F(HostileInput, SweepResumedUnderAnotherCalibrationRunsItsOwnRows) {
  input("cal.json",
        R"({"format": "piper-calibration", "entries": [{"kind": "COMPUTE", "pass": "F", "seconds": 0.01}]})");
  input("plain.json", R"({"model": "qwen3-9m", "engine": "analytic", "pp": [1, 2], "microbatches": [4]})");
  input("cal-sweep.json",
        R"({"model": "qwen3-9m", "engine": "analytic", "pp": [1, 2], "microbatches": [4], "calibration": "cal.json"})");
  const CliResult plain = run("sweep plain.json -j 1 -o r.csv");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const CliResult calibrated = run("sweep cal-sweep.json -j 1 -o r.csv");
  ASSERT_EQ(calibrated.exit_code, 0) << calibrated.err;
  EXPECT_NE(calibrated.out.find("0 already in r.csv, 2 run (2 ok"), std::string::npos) << calibrated.out;
  const std::string text = read_file(dir_ / "r.csv");
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 5) << text;
  EXPECT_NE(text.find("/calibration=cal.json,"), std::string::npos) << text;
  // Resuming the calibrated sweep itself still skips its rows.
  const CliResult again = run("sweep cal-sweep.json -j 1 -o r.csv");
  EXPECT_NE(again.out.find("2 already in r.csv, 0 run"), std::string::npos) << again.out;
  // A resumed sweep's "best" lines rank the combinations run now only, and say so (they read as the
  // best of the whole sweep, whose fastest plan may be a resumed row).
  input("wider.json", R"({"model": "qwen3-9m", "engine": "analytic", "pp": [1, 2, 4], "microbatches": [4]})");
  const CliResult wider = run("sweep wider.json -j 1 -o r.csv");
  EXPECT_NE(wider.out.find("2 already in r.csv, 1 run (1 ok"), std::string::npos) << wider.out;
  EXPECT_NE(wider.out.find("best of the 1 run now (2 resumed rows are in r.csv, not ranked here):\nbest 1: "),
            std::string::npos)
      << wider.out;
}

// Probe 7: a resumed sweep took its rows by key alone, so a hand-edited row (status "bogus", a step
// time "nan") stood for its combination: "2 already in r.csv, 0 run", exit 0. A resumed row must be
// one piper could have written; otherwise the file is refused naming the line, untouched.
TEST_F(HostileInput, SweepResumedRowThatPiperCouldNotHaveWrittenRefused) {
  input("s.json", R"({"model": "qwen3-9m", "engine": "analytic", "pp": [1, 2], "microbatches": [4]})");
  ASSERT_EQ(run("sweep s.json -j 1 -o r.csv").exit_code, 0);
  const std::string good = read_file(dir_ / "r.csv");
  auto edited = [&](int row, const std::string& column, const std::string& value) {
    return with_cell(good, row, column, value);
  };
  const struct {
    int row;
    std::string column, value, expected;
  } cases[] = {
      {1, "status", "bogus", "r.csv: line 2: column 'status': not ok, invalid or error, got 'bogus'"},
      {2, "step_time_s", "nan", "r.csv: line 3: column 'step_time_s': expected a finite number >= 0 in an ok row"},
      {1, "mfu", "-0.5", "line 2: column 'mfu': expected a finite number"},
      {2, "oom", "7", "line 3: column 'oom': expected 0 or 1"},
      {1, "step_time_s", "", "line 2: column 'step_time_s'"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.column + "=" + c.value);
    const std::string text = edited(c.row, c.column, c.value);
    ASSERT_NE(text, good);
    input("r.csv", text);
    expect_one_line(run("sweep s.json -j 1 -o r.csv"), {c.expected});
    EXPECT_EQ(read_file(dir_ / "r.csv"), text);
  }
  input("r.csv", good);  // the rows piper wrote still resume
  const CliResult again = run("sweep s.json -j 1 -o r.csv");
  EXPECT_NE(again.out.find("2 already in r.csv, 0 run"), std::string::npos) << again.out << again.err;
}

// `export-chakra` of a 2-device plan into the folder of a 4-device export: piper.0.et and piper.1.et
// were replaced, piper.2.et and piper.3.et of the other plan stayed, exit 0; a replay of the folder on
// 4 NPUs mixed the two plans. Refused now, nothing written; the same plan again still replaces its own.
TEST_F(HostileInput, ChakraExportOverALargerExportsTracesRefused) {
  ASSERT_EQ(run("compile --model qwen3-9m --pp 2 --dp 2 --microbatches 4 -o p4.json").exit_code, 0);
  ASSERT_EQ(run("compile --model qwen3-9m --pp 2 --microbatches 4 -o p2.json").exit_code, 0);
  ASSERT_EQ(run("export-chakra p4.json -o ch").exit_code, 0);
  const std::string first = read_file(dir_ / "ch" / "piper.0.et");
  expect_one_line(run("export-chakra p2.json -o ch"),
                  {"ch: holds piper.2.et .. piper.3.et (2 files) of another export", "devices past this plan's 2"});
  EXPECT_EQ(read_file(dir_ / "ch" / "piper.0.et"), first);
  EXPECT_EQ(run("export-chakra p4.json -o ch").exit_code, 0);
  EXPECT_EQ(run("export-chakra p2.json -o ch --prefix two").exit_code, 0);  // another prefix: its own files
  EXPECT_TRUE(fs::exists(dir_ / "ch" / "two.1.et"));
}

// ---- Probe 6 ---------------------------------------------------------------------------------

// A hand-edited plan's negative or absurd sizes verified "ok": a buffer of -100 bytes or an op of
// -1e9 FLOPs simulated (exit 0) with memory and time taken off, 1e300 FLOPs gave a 300-digit step
// time, and a collective of -1 bytes killed the SimGrid process (signal 6). Refused on load, with
// the plan, stream and op in the field path.
TEST_F(HostileInput, PlanNegativeOrAbsurdSizesRefusedOnLoad) {
  const json plan = tiny_plan();
  struct Case {
    std::string field;  // a JSON pointer into the plan
    json value;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {"/plans/0/buffers/0/bytes", -100, {"field 'plans[0].buffers[0].bytes'", "byte count in [0, 2^53]", "-100"}},
      {"/plans/0/streams/0/ops/0/flops", -1e9, {"field 'plans[0].streams[0].ops[0].flops'", "FLOPs in [0, 1e24]"}},
      {"/plans/0/streams/0/ops/0/flops", 1e300, {"ops[0].flops'", "got 1e+300"}},
      {"/plans/0/streams/0/ops/0/memory_bytes", -5, {"ops[0].memory_bytes'", "got -5"}},
      {"/plans/0/streams/0/ops/0/tp_collectives", -1, {"ops[0].tp_collectives'", "must be >= 0"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    json edited = plan;
    edited[json::json_pointer(c.field)] = c.value;
    input("edited.json", edited.dump());
    std::vector<std::string> fragments = c.fragments;
    fragments.push_back("edited.json");
    expect_one_line(run("verify edited.json"), fragments);
    expect_one_line(run("simulate --plan edited.json --engine analytic --report r.json"), fragments);
    EXPECT_FALSE(fs::exists(dir_ / "r.json"));
  }
  // A collective's bytes: the one that reached SimGrid.
  json edited = plan;
  bool found = false;
  for (auto& stream : edited["plans"][0]["streams"])
    for (auto& op : stream["ops"])
      if (!found && op["kind"] == "ALL_REDUCE") {
        op["bytes"] = -1;
        found = true;
      }
  ASSERT_TRUE(found);
  input("edited.json", edited.dump());
  expect_one_line(run("simulate --plan edited.json --engine simgrid"), {"edited.json", ".bytes'", "got -1"});
  EXPECT_EQ(run("verify a.json").exit_code, 0);  // the plan as compiled still loads
}

// --pp-ranges (or --stages) with fewer regions than pipeline ranks failed as "1f1b: pipeline rank 1
// holds no PP region", naming neither flag.
TEST_F(HostileInput, PpRangesOrStagesFewerThanThePipelineRanksNamesTheFlag) {
  expect_one_line(run("compile --model qwen3-9m --pp 4 --pp-ranges 0,1 --microbatches 4 -o plan.json"),
                  {"--pp-ranges 0,1: 2 PP regions for the 4 pipeline ranks of --pp 4"});
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --pp 4 --stages 3 --microbatches 4"),
                  {"--stages 3: 3 PP regions", "--pp 4"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
  // As many regions as ranks, or more (chunks per rank, uneven interleaving), still compile.
  for (const std::string& args : {std::string("--pp 2 --pp-ranges 0,1"), std::string("--pp 2 --stages 3"),
                                  std::string("--pp 2 --pp-ranges 0,1,2,3")}) {
    SCOPED_TRACE(args);
    const CliResult ok = run("simulate --model qwen3-9m --engine analytic --microbatches 4 " + args);
    EXPECT_EQ(ok.exit_code, 0) << ok.err;
  }
}

// Probe 7: --pp-ranges the model's region check refuses (past the last block, not increasing, not
// starting at 0) named "--pp 2", a flag the user did not give, rather than --pp-ranges.
TEST_F(HostileInput, PpRangesRefusedByTheModelNamesPpRanges) {
  expect_one_line(run("compile --model qwen3-9m --pp 2 --pp-ranges 0,5,3 -o plan.json"),
                  {"--pp-ranges 0,5,3: cannot annotate 3 PP regions", "past the last block"});
  expect_one_line(run("compile --model qwen3-9m --pp 2 --pp-ranges 1,2 -o plan.json"),
                  {"--pp-ranges 1,2: cannot annotate 2 PP regions", "must start at block 0"});
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --pp 2 --pp-ranges 0,0,1"),
                  {"--pp-ranges 0,0,1: ", "strictly increasing"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
}

// Probe 7: `piper directives --global-batch` was ignored: `--model qwen3-9m --global-batch 16 --dp 2`
// printed a program of 1 microbatch (a compile of the same flags has 8), exit 0; without --model,
// where the micro-batch size is unknown, the flag was dropped as silently.
TEST_F(HostileInput, DirectivesGlobalBatchSetsTheMicrobatchesOrIsRefused) {
  const CliResult with_model = run("directives --model qwen3-9m --global-batch 16 --dp 2");
  ASSERT_EQ(with_model.exit_code, 0) << with_model.err;
  const json program = json::parse(with_model.out);
  int microbatches = 0;
  for (const json& d : program)
    if (d.value("op", "") == "split") microbatches = d.at("num_microbatches").get<int>();
  EXPECT_EQ(microbatches, 8) << with_model.out;
  expect_one_line(run("directives --model qwen3-9m --global-batch 5 --dp 2"), {"--global-batch 5 is not divisible"});
  expect_one_line(run("directives --global-batch 16 --dp 2"), {"--global-batch 16: needs --model"});
}

// ---- Probe 8 ---------------------------------------------------------------------------------

// A resumed tune's results file with a hand-edited row: status "bogus" was kept as done (the
// candidate never simulated), a step time "nan" or "-1" was ranked (-1 ms first), oom 7 read as out
// of memory, a figure in a bounded row or a negative memory estimate taken as written; exit 0. The
// sweep's resume already refused these (probe 7); the check is now read_results', which both use.
TEST_F(HostileInput, TuneResumedRowThatPiperCouldNotHaveWrittenRefused) {
  const std::string tune =
      "tune --model qwen3-9m --devices 2 --pp 1 --micro-batch-size 1 --recompute none --zero 0,1 "
      "--schedules 1f1b --top 0 --no-placement-search -j 1 -o t.csv";
  ASSERT_EQ(run(tune).exit_code, 0);
  const std::string good = read_file(dir_ / "t.csv");
  int bounded = 0;  // the first bounded row: the search left its figures blank
  std::istringstream lines(good);
  int row = 0;
  for (std::string line; std::getline(lines, line); ++row)
    if (bounded == 0 && line.find(",bounded,") != std::string::npos) bounded = row;
  ASSERT_GT(bounded, 2) << good;
  const struct {
    int row;
    std::string column, value, expected;
  } cases[] = {
      {1, "status", "bogus", "t.csv: line 2: column 'status': not ok, invalid, error, pruned or bounded, got 'bogus'"},
      {1, "step_time_s", "nan", "line 2: column 'step_time_s': expected a finite number >= 0 in an ok row"},
      {2, "step_time_s", "-1", "line 3: column 'step_time_s': expected a finite number >= 0"},
      {1, "oom", "7", "line 2: column 'oom': expected 0 or 1"},
      {bounded, "mfu", "0.5", "column 'mfu': a figure of a row that was not simulated (status bounded) is blank"},
      {1, "estimated_memory_bytes", "-5", "column 'estimated_memory_bytes': expected a number of bytes >= 0"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.column + "=" + c.value);
    const std::string text = with_cell(good, c.row, c.column, c.value);
    ASSERT_NE(text, good);
    input("t.csv", text);
    expect_one_line(run(tune), {c.expected, "remove the row to rerun it"});
    EXPECT_EQ(read_file(dir_ / "t.csv"), text);
  }
  // A later row of another search (a row pasted from another file) was taken as this search's: only
  // the first row's model, cluster, devices, batch and sequence were compared with the search's.
  for (const auto& [column, value] : std::vector<std::pair<std::string, std::string>>{
           {"model", "qwen3-30b-a3b"}, {"devices", "4"}, {"seq_len", "64"}}) {
    SCOPED_TRACE(column + "=" + value);
    const std::string text = with_cell(good, 2, column, value);
    ASSERT_NE(text, good);
    input("t.csv", text);
    expect_one_line(run(tune), {"t.csv: line 3: a row of another search (", "than line 2's (qwen3-9m on 2 x ",
                                "a tune file holds one search"});
    EXPECT_EQ(read_file(dir_ / "t.csv"), text);
  }
  input("t.csv", good);  // the rows piper wrote still resume
  const CliResult again = run(tune);
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.out.find("rows resumed from t.csv"), std::string::npos) << again.out;
}

// Model sizes each within its own limit (model-width 2^20, experts 65,536) that multiply past the
// cost model's int64 byte counts: 65,536 experts of width 2^20 at hidden 2^20 simulated with a
// negative peak memory and "out of memory: no", exit 0. Refused in validate_config (every front end:
// specs, Hugging Face configs, --seq-len), naming the file's own key.
TEST_F(HostileInput, ModelSizesThatMultiplyPastTheByteCountsRefused) {
  json moe = json::parse(read_file(kSource + "/examples/models/tiny-moe.json"));
  moe["hidden"] = 1048576;
  moe["moe"]["experts"] = 65536;
  moe["moe"]["expert_ffn"] = 1048576;
  input("moe.json", moe.dump());
  expect_one_line(run("simulate --model moe.json --engine analytic --report r.json"),
                  {"moe.json: field 'moe.experts': a MoE layer's training state (moe.experts 65536 x moe.expert_ffn "
                   "1048576 x hidden 1048576 x 16 bytes) come to 3.46e+18 bytes, more than the 2^53 bytes"});
  input("mixtral.json", R"({"model_type": "mixtral", "vocab_size": 1000, "hidden_size": 1048576,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 1048576,
                            "num_local_experts": 65536, "num_experts_per_tok": 2})");
  expect_one_line(run("compile --model mixtral.json -o p.json"),
                  {"mixtral.json: field 'num_local_experts': a MoE layer's training state (num_local_experts 65536",
                   "hidden_size 1048576"});
  json wide = json::parse(read_file(kSource + "/examples/models/dense-1b.json"));
  wide["heads"] = wide["kv_heads"] = wide["head_dim"] = 1048576;
  input("wide.json", wide.dump());
  expect_one_line(run("compile --model wide.json -o p.json"), {"field 'heads': an attention layer's training state"});
  json gpt = json::parse(read_file(kSource + "/examples/models/gpt-22b-korthikanti.json"));
  gpt.erase("max_positions");
  input("gpt.json", gpt.dump());
  expect_one_line(run("compile --model gpt.json --seq-len 8388608 --micro-batch-size 2 -o p.json"),
                  {"field 'training.seq_len': standard attention's scores"});
  EXPECT_FALSE(fs::exists(dir_ / "p.json"));
  EXPECT_FALSE(fs::exists(dir_ / "r.json"));
  EXPECT_EQ(run("compile --model gpt.json --seq-len 4096 -o p.json").exit_code, 0);  // its own shape still compiles
}

// Outputs through symbolic links: `--report t.json --trace l.json` with l.json a dangling link to
// t.json wrote the report, then the trace through the link over it (the report lost, exit 0); a
// dangling link was replaced by a regular file (a link to a file keeps its link), one into a missing
// folder passed the folder check and one in a loop was replaced too; a valid 255-byte name failed
// after the work ("File name too long": the temporary's suffix). core::output_target follows links
// for the writer and for the output checks of every command.
TEST_F(HostileInput, OutputsThroughSymbolicLinksLandOnTheirTargets) {
  const std::string compile = "compile --model qwen3-9m --pp 2 --microbatches 2 -o ";
  fs::create_symlink("t.json", dir_ / "l.json");
  expect_one_line(run("simulate --model qwen3-9m --pp 2 --microbatches 2 --engine analytic --report t.json "
                      "--trace l.json"),
                  {"l.json: --report and --trace name the same file"});
  EXPECT_FALSE(fs::exists(dir_ / "t.json"));
  ASSERT_EQ(run(compile + "l.json").exit_code, 0);
  EXPECT_TRUE(fs::is_symlink(dir_ / "l.json"));
  EXPECT_TRUE(fs::is_regular_file(fs::symlink_status(dir_ / "t.json")));
  fs::create_symlink("/no/such/dir/p.json", dir_ / "far.json");
  expect_one_line(run(compile + "far.json"), {"far.json: --output: no such folder '/no/such/dir'"});
  fs::create_symlink("loop2", dir_ / "loop1");
  fs::create_symlink("loop1", dir_ / "loop2");
  expect_one_line(run(compile + "loop1"), {"loop1: --output: too many levels of symbolic links"});
  EXPECT_TRUE(fs::is_symlink(dir_ / "loop1"));
  const std::string longest = std::string(250, 'a') + ".json";  // NAME_MAX bytes
  EXPECT_EQ(run(compile + longest).exit_code, 0);
  EXPECT_TRUE(fs::is_regular_file(dir_ / longest));
}

// `plot -o c.png` and `tune --plot p.png` with the PNG a symbolic link: write_png saved the image to
// its own temporary and renamed it over the link (a regular file in its place, a dangling link's
// folder left empty), without an fsync before the rename. The PNG is now encoded in memory and
// written by core::write_file_atomically: through the link, which stays a link, whole.
TEST_F(HostileInput, PngOutputsThroughSymbolicLinksLandOnTheirTargets) {
  input("r.csv", "x,y\n1,2\n2,3\n");
  fs::create_directories(dir_ / "charts");
  fs::create_symlink("charts/c.png", dir_ / "c.png");  // dangling: the write creates its target
  input("charts/p.png", "an older chart");
  fs::create_symlink("charts/p.png", dir_ / "p.png");
  const CliResult plotted = run("plot r.csv --x x --y y -o c.png");
  if (plotted.err.find("built without Qt 6 Gui") != std::string::npos)
    GTEST_SKIP() << "this piper draws no plots (the sanitize build has no Qt): " << plotted.err;
  ASSERT_EQ(plotted.exit_code, 0) << plotted.err;
  const CliResult tuned = run("tune --model qwen3-9m --devices 2 -o t.csv --plot p.png");
  ASSERT_EQ(tuned.exit_code, 0) << tuned.err;
  const std::string signature = "\x89PNG\r\n\x1a\n", end = std::string("IEND\xae\x42\x60\x82", 8);
  for (const char* name : {"c.png", "p.png"}) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(fs::is_symlink(dir_ / name));
    const std::string png = read_file(dir_ / "charts" / name);  // whole: the signature to the IEND chunk
    ASSERT_GT(png.size(), signature.size() + end.size());
    EXPECT_EQ(png.substr(0, signature.size()), signature);
    EXPECT_EQ(png.substr(png.size() - end.size()), end);
  }
  for (const auto& entry : fs::directory_iterator(dir_ / "charts"))  // no temporary left beside them
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
}

// An output in a missing folder whose name holds a newline: the line named the path escaped (by
// core::printable) but the folder with a space in its place (`no\x0asuch/x.json: --output: no such
// folder 'no such'`: one_line flattened the message before printable saw it), a name the user does not
// have. one_line escapes a line end inside a message as printable does.
TEST_F(HostileInput, NewlineInAFolderNameIsEscapedInTheErrorLine) {
  expect_one_line(run("compile --model qwen3-9m -o 'no\nsuch/x.json'"),
                  {"no\\x0asuch/x.json: --output: no such folder 'no\\x0asuch'"});
  // A carriage return, and a name quoted inside the message rather than as its file prefix.
  expect_one_line(run("simulate --model qwen3-9m --cluster 'dgx\rh200' --report r.json"),
                  {"--cluster 'dgx\\x0dh200': neither a preset"});
  EXPECT_FALSE(fs::exists(dir_ / "r.json"));
}

// A kill inside an atomic write's window (after the temporary, before the rename) left `p.json.tmp.PID`
// beside the intact previous p.json, and every later write left it too. The next write of p.json
// removes the temporaries of processes that are gone (core::write_file_atomically); a live one's stays.
TEST_F(HostileInput, TemporaryOfAKilledWriteRemovedByTheNextWrite) {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // reaped: its pid names no process
  input("p.json.tmp." + std::to_string(child), "half a plan");
  input("p.json.tmp." + std::to_string(::getpid()), "a write in progress");  // this test is alive
  const CliResult r = run("compile --model qwen3-9m --pp 2 --microbatches 2 -o p.json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / ("p.json.tmp." + std::to_string(child))));
  EXPECT_TRUE(fs::exists(dir_ / ("p.json.tmp." + std::to_string(::getpid()))));
  EXPECT_TRUE(fs::is_regular_file(dir_ / "p.json"));
}

// The ninth probe (valid but unusual configurations that succeed wrongly). KV heads that the TP degree
// does not divide (6 KV heads over TP 4: 1.5 a rank; qwen3-30b-a3b's 4 over TP 8: replicated) were
// compiled and simulated as fractions of a head, their K/V projections, weights and stash divided by
// the degree: wrong FLOPs and memory per device, exit 0. The runtime refused them, and tune left such
// degrees out; the compiler now refuses them too, naming the flag and the layer, as it does heads.
TEST_F(HostileInput, KvHeadsTheTpDegreeDoesNotDivideRefused) {
  json m = json::parse(read_file(piper::test::kTiny));
  m["heads"] = 12;
  m["kv_heads"] = 6;
  m["hidden"] = 48;
  m["head_dim"] = 4;
  m["ffn"] = 96;
  input("kv6.json", m.dump());
  expect_one_line(run("simulate --model kv6.json --tp 4 --engine analytic --report r.json"),
                  {"--tp 4", "does not divide the 6 KV heads of layer 'layers.0.attn'"});
  EXPECT_FALSE(fs::exists(dir_ / "r.json"));
  expect_one_line(run("compile --model qwen3-30b-a3b --tp 8 --sequence-parallel -o p.json"),
                  {"--tp 8", "does not divide the 4 KV heads"});
  EXPECT_FALSE(fs::exists(dir_ / "p.json"));
  // What divides still compiles: 6 KV heads over TP 2 and TP 3 (heads 12).
  EXPECT_EQ(run("compile --model kv6.json --tp 2 -o p.json").exit_code, 0);
  EXPECT_EQ(run("compile --model kv6.json --tp 3 -o p.json").exit_code, 0);
}

// The tenth probe. `piper calibrate --cluster` of a cluster whose GPU's kernel table is a file (the
// calibrated cluster `--cluster-output` writes, to calibrate again) wrote a table with "base": that
// file, which every reader refuses (a table's base is a built-in table): exit 0, an unusable table.
TEST_F(HostileInput, CalibrateAgainstAClusterWithATableFileRefused) {
  input("cal.json",
        R"({"format": "piper-calibration", "entries": [{"kind": "COMPUTE", "pass": "F", "seconds": 0.001},
            {"kind": "COMPUTE", "pass": "B", "seconds": 0.002}, {"kind": "UPD", "seconds": 0.001}]})");
  input("h200.json", R"({"preset": "dgx-h200", "nodes": 1})");
  const std::string flags = "calibrate --model qwen3-9m --pp 1 --microbatches 2 --calibration cal.json ";
  const CliResult first = run(flags + "--cluster h200.json -o t.json --cluster-output c.json");
  ASSERT_EQ(first.exit_code, 0) << first.err;
  expect_one_line(
      run(flags + "--cluster c.json -o t2.json"),
      {"--cluster 'c.json'", "kernel table from the file 't.json'", "derives from a built-in table", "h200-sxm"});
  EXPECT_FALSE(fs::exists(dir_ / "t2.json"));
  // The calibrated cluster itself is usable.
  EXPECT_EQ(run("simulate --model qwen3-9m --cluster c.json --engine analytic").exit_code, 0);
}

// `calibrate --cluster-output` wrote the table's path as given on the command line (relative to the
// working directory), where a cluster spec's table files are relative to the cluster file: from another
// folder the calibrated cluster named a table it could not find. It now writes the path relative to
// the cluster file.
TEST_F(HostileInput, CalibratedClusterFindsItsTableFromAnyFolder) {
  input("cal.json",
        R"({"format": "piper-calibration", "entries": [{"kind": "COMPUTE", "pass": "F", "seconds": 0.001},
            {"kind": "COMPUTE", "pass": "B", "seconds": 0.002}, {"kind": "UPD", "seconds": 0.001}]})");
  fs::create_directories(dir_ / "tables");
  fs::create_directories(dir_ / "clusters");
  const CliResult made =
      run("calibrate --model qwen3-9m --pp 1 --microbatches 2 --calibration cal.json --cluster "
          "dgx-h200 -o tables/t.json --cluster-output clusters/c.json");
  ASSERT_EQ(made.exit_code, 0) << made.err;
  EXPECT_EQ(json::parse(read_file(dir_ / "clusters/c.json")).at("node").at("gpu").at("kernel_table"),
            "../tables/t.json");
  for (const fs::path& folder : {dir_, dir_ / "clusters", dir_ / "tables"}) {
    const fs::path cluster = fs::relative(dir_ / "clusters/c.json", folder);
    const CliResult r = run_cli_in(
        folder, PIPER_CLI, "simulate --model qwen3-9m --engine analytic --cluster " + cluster.string(), "timeout 120");
    EXPECT_EQ(r.exit_code, 0) << folder << ": " << r.err;
  }
}

// A resumed run followed its own learning-rate schedule, not the one its checkpoint records: a run of
// 2 steps decaying (cosine, --lr-decay-steps defaulting to --steps) to --min-lr at step 2, resumed
// to 6, went back up to 5.5e-4 at step 3; resumed without --lr-decay it ran at --lr. Exit 0 both.
// Megatron-LM refuses a checkpoint whose scheduler settings differ from the run's; so does piper.
TEST_F(HostileInput, ResumeUnderAnotherLearningRateScheduleRefused) {
  const std::string run_flags =
      "run --model '" + piper::test::kTiny + "' --pp 2 --microbatches 2 --virtual-devices --seed 5 ";
  const std::string cosine = "--lr 1e-3 --lr-decay cosine --min-lr 1e-4 ";
  const CliResult saved = run(run_flags + cosine + "--steps 2 --save ck");
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  expect_one_line(run(run_flags + cosine + "--steps 6 --resume ck --report r.json"),
                  {"--resume ck", "--lr-decay cosine --min-lr 0.0001 --lr-decay-steps 2",
                   "this run's --lr 0.001 --warmup-steps 0 --lr-decay cosine --min-lr 0.0001 --lr-decay-steps 6"});
  expect_one_line(run(run_flags + "--lr 1e-3 --steps 6 --resume ck --report r.json"),
                  {"--resume ck", "this run's --lr 0.001 --warmup-steps 0 --lr-decay constant"});
  expect_one_line(run(run_flags + cosine + "--warmup-steps 1 --lr-decay-steps 2 --steps 6 --resume ck"),
                  {"--resume ck", "--warmup-steps 1"});
  EXPECT_FALSE(fs::exists(dir_ / "r.json"));
  // The checkpoint's schedule continues: past --lr-decay-steps, --min-lr (by hand).
  const CliResult resumed = run(run_flags + cosine + "--lr-decay-steps 2 --steps 4 --resume ck --report r.json");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(json::parse(read_file((dir_ / "r.json").string())).at("lrs"), json::parse("[0.0001, 0.0001]"));
  // A constant rate: --min-lr and --lr-decay-steps play no part and may differ.
  ASSERT_EQ(run(run_flags + "--steps 2 --save c0").exit_code, 0);
  EXPECT_EQ(run(run_flags + "--steps 5 --min-lr 1e-5 --resume c0").exit_code, 0);
}

}  // namespace
