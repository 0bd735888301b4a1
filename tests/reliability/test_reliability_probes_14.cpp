// Reliability, input side, the fourteenth probe (docs/reliability.md, "fourteenth probe"): empty and
// non-decimal values given to flags, outputs whose folder takes no file, scenario and sweep fields that
// named nothing, and names that broke the one-line output. Each case runs the real `piper` binary (the
// HostileInput fixture).
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "hostile_input.hpp"

namespace fs = std::filesystem;
using piper::test::CliResult;
using piper::test::HostileInput;
using piper::test::kTiny;

namespace {

// An empty value meant the default: `simulate --cluster ""` simulated dgx-h200, `--engine ""` ran
// simgrid, `--calibration ""` and `--plan ""` were ignored (the latter then asked for --model).
TEST_F(HostileInput, EmptyFlagValuesRefused) {
  for (const std::string flag : {"--cluster", "--engine", "--calibration"})
    expect_one_line(run("simulate --model qwen3-9m " + flag + " ''"), {flag, "empty value"});
  expect_one_line(run("simulate --plan ''"), {"--plan", "empty value"});
  // A scenario file's empty cluster or engine, and its empty or unknown model, name the file's field.
  input("cluster.json", R"({"model": "qwen3-9m", "cluster": ""})");
  expect_one_line(run("simulate --scenario cluster.json"), {"cluster.json", "field 'cluster'", "non-empty"});
  input("engine.json", R"({"model": "qwen3-9m", "engine": ""})");
  expect_one_line(run("simulate --scenario engine.json"), {"engine.json", "field 'engine'", "non-empty"});
  input("model.json", R"({"model": ""})");
  expect_one_line(run("simulate --scenario model.json"), {"model.json", "field 'model'", "required"});
  input("nosuch.json", R"({"model": "nosuch"})");
  expect_one_line(run("simulate --scenario nosuch.json"),
                  {"nosuch.json", "field 'model'", "'nosuch': neither a zoo model", "nor a readable file"});
  // A sweep spec's empty cluster swept dgx-h200.
  input("sweep.json", R"({"model": "qwen3-9m", "cluster": "", "pp": [1, 2]})");
  expect_one_line(run("sweep sweep.json -o s.csv"), {"sweep.json", "field 'cluster'", "non-empty string"});
  EXPECT_FALSE(fs::exists(dir_ / "s.csv"));
}

// stod and CLI11 read "0x10" as 16, "0x1p-40" as 2^-40 and " 2" as 2; plot already refused such cells.
TEST_F(HostileInput, NumbersOnlyInDecimal) {
  expect_one_line(run("compile --model qwen3-9m --pp 0x2"), {"--pp", "'0x2'"});
  expect_one_line(run("compile --model qwen3-9m --pp ' 2'"), {"--pp", "' 2'"});
  expect_one_line(run("compile --model qwen3-9m --bucket-mb 0x10"), {"--bucket-mb", "'0x10'"});
  expect_one_line(run("tune --model qwen3-9m --devices 2 --memory-cap 0x10 -o t.csv"), {"--memory-cap", "'0x10'"});
  EXPECT_EQ(run("compile --model qwen3-9m --pp 2 --bucket-mb 2.5e1 --microbatches 4").exit_code, 0);
  // A cap past any device overflowed to "memory cap inf GiB" with exit 0.
  expect_one_line(run("tune --model qwen3-9m --devices 2 --memory-cap 1e308 -o t.csv"),
                  {"--memory-cap 1e+308", "more GiB than any device has"});
  expect_one_line(run("tune --model qwen3-9m --devices 2 --memory-reserve-gib 1e308 -o t.csv"),
                  {"--memory-reserve-gib 1e+308"});
  EXPECT_FALSE(fs::exists(dir_ / "t.csv"));
}

// An output whose folder takes no new file failed only at the end: `tune -o t.csv --emit-directives
// /proc/x.json` ran the whole search and left t.csv; `run --reference --dump-params /proc/x` trained first.
TEST_F(HostileInput, OutputFolderThatTakesNoFileRefusedUpFront) {
  if (!fs::is_directory("/proc/self")) GTEST_SKIP() << "no /proc";
  expect_one_line(run("tune --model qwen3-9m --devices 2 -j 1 --top 0 -o t.csv --emit-directives /proc/x.json"),
                  {"--emit-directives", "cannot write in the folder '/proc'"});
  EXPECT_FALSE(fs::exists(dir_ / "t.csv"));
  expect_one_line(run("run --reference --model '" + kTiny + "' --steps 2 --dump-params /proc/x"),
                  {"--dump-params", "cannot write in the folder '/proc'"});
  // A device that exists stays writable (/dev/null), and the probe file is not left behind.
  EXPECT_EQ(run("simulate --model qwen3-9m --engine analytic --report /dev/null").exit_code, 0);
  EXPECT_EQ(run("simulate --model qwen3-9m --engine analytic --report r.json").exit_code, 0);
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string().find(".piper-write-check"), std::string::npos) << e.path();
}

// A model's name with a NUL, a newline or a bidirectional override split the summary over 17 lines
// and reordered the terminal; a number as its description was accepted.
TEST_F(HostileInput, ModelNameControlCharactersRefused) {
  const std::string spec = R"("vocab": 1000, "hidden": 256, "layers": 4, "heads": 4, "ffn": 512, "max_positions": 256,)"
                           R"( "training": {"seq_len": 128, "micro_batch_size": 1}})";
  input("nl.json", R"({"name": "a\nb", )" + spec);
  expect_one_line(run("compile --model nl.json"), {"nl.json", "field 'name'", "'a\\x0ab'", "not allowed in a name"});
  input("bidi.json", "{\"name\": \"ab\\u202e\", " + spec);
  expect_one_line(run("compile --model bidi.json"), {"bidi.json", "field 'name'", "'ab\\u202e'", "bidirectional"});
  input("desc.json", R"({"name": "ok", "description": 5, )" + spec);
  expect_one_line(run("compile --model desc.json"), {"desc.json", "field 'description'", "must be a string"});
  input("fine.json", R"({"name": "tiny model – ünïcode", )" + spec);
  EXPECT_EQ(run("compile --model fine.json").exit_code, 0);
  // A calibrated table's name likewise (it was written with its newline into the table).
  expect_one_line(run(R"x(calibrate --model qwen3-9m --calibration none.json -o t.json --name "$(printf 'a\nb')")x"),
                  {"--name", R"('a\x0ab')", "not allowed"});
  EXPECT_FALSE(fs::exists(dir_ / "t.json"));
}

// `calibrate --cluster-output` of a derived spec ({"cluster": ..., "runtime": ...}) wrote "node" beside
// "cluster", a spec every reader refuses (exit 0); of a spec given inline it wrote the table, then
// failed to read the spec as a file. Both now write a cluster that loads, with the runtime kept.
TEST_F(HostileInput, CalibratedClusterOfADerivedOrInlineSpecLoads) {
  input("cal.json",
        R"({"format": "piper-calibration", "entries": [{"kind": "COMPUTE", "pass": "F", "seconds": 0.001},
            {"kind": "COMPUTE", "pass": "B", "seconds": 0.002}, {"kind": "UPD", "seconds": 0.001}]})");
  input("d.json", R"({"cluster": "dgx-h200", "runtime": "eager"})");
  const std::string flags = "calibrate --model qwen3-9m --pp 1 --microbatches 2 --calibration cal.json ";
  for (const std::string cluster : {"d.json", R"('{"preset": "dgx-h200", "runtime": "eager"}')"}) {
    SCOPED_TRACE(cluster);
    const CliResult made = run(flags + "--cluster " + cluster + " -o t.json --cluster-output c.json");
    ASSERT_EQ(made.exit_code, 0) << made.err;
    const CliResult r = run("simulate --model qwen3-9m --engine analytic --cluster c.json");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("(dgx-h200-calibrated; runtime eager)"), std::string::npos) << r.out;
  }
}

}  // namespace
