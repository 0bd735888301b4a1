// Reliability, input side, the fifteenth probe (docs/reliability.md, "fifteenth probe"): training runs and scenario
// files: the scenario's "train" section from Python, --save-scenario of a run's data, a resumed run with no step left,
// numbers and names in a run's flags and fields. Each case runs the real `piper` binary (the HostileInput fixture).
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "hostile_input.hpp"

namespace fs = std::filesystem;
using piper::test::CliResult;
using piper::test::HostileInput;
using piper::test::kTiny;

namespace {

// `compile --scenario` and `run --scenario` took a scenario whose "engine" was misspelt or whose
// "cluster" did not exist (simulate and piper-studio refuse it): checked alike, though neither uses them.
TEST_F(HostileInput, CompileAndRunCheckTheScenariosClusterAndEngine) {
  input("engine.json", R"({"model": ")" + kTiny + R"(", "engine": "analytc"})");
  input("cluster.json", R"({"model": ")" + kTiny + R"(", "cluster": "nosuch-cluster"})");
  for (const std::string command : {"compile --scenario {} -o p.json", "run --scenario {} --reference --steps 1"}) {
    auto with = [&](const std::string& file) {
      return command.substr(0, command.find("{}")) + file + command.substr(command.find("{}") + 2);
    };
    expect_one_line(run(with("engine.json")), {"engine.json: field 'engine': unknown engine 'analytc'"});
    expect_one_line(run(with("cluster.json")), {"cluster.json: field 'cluster': 'nosuch-cluster': neither a preset"});
  }
  EXPECT_FALSE(fs::exists(dir_ / "p.json"));
}

// A bad value in a scenario's "train" section was named as the flag it stands for, which was never
// given ("--loss-scale must be a power of two"); now as the file's field. A flag given beside the
// file is still named as the flag.
TEST_F(HostileInput, TrainSectionValuesAreNamedAsTheFilesFields) {
  const std::string model = R"("model": ")" + kTiny + R"(", "strategy": {"clip_grad": 1})";
  input("scale.json", "{" + model + R"(, "train": {"loss_scale": 3}})");
  expect_one_line(run("run --scenario scale.json --reference"),
                  {"scale.json: field 'train.loss_scale': must be a power of two >= 1 (got 3)"});
  input("beta.json", "{" + model + R"(, "train": {"beta1": 1}})");
  expect_one_line(run("run --scenario beta.json --reference"),
                  {"beta.json: field 'train.beta1': must be in [0, 1) (got 1)"});
  input("dyn.json", "{" + model + R"(, "train": {"loss_scale": 16, "initial_loss_scale": 4}})");
  expect_one_line(run("run --scenario dyn.json --reference"),
                  {"dyn.json: field 'train.initial_loss_scale': applies only with 'train.loss_scale' dynamic"});
  expect_one_line(run("run --scenario beta.json --reference --beta1 0.9 --beta2 1"), {"--beta2 must be in [0, 1)"});
  // The trainer's checks too ("--steps 2 is below the step of the checkpoint"), in every launch.
  ASSERT_EQ(run("run --model " + kTiny + " --reference --steps 3 --save ck").exit_code, 0);
  input("below.json", R"({"model": ")" + kTiny + R"(", "train": {"steps": 2, "resume": "ck"}})");
  for (const std::string how : {"--reference", "--virtual-devices"})
    expect_one_line(
        run("run --scenario below.json " + how),
        {"below.json: field 'train.steps': 2 is below the step of the checkpoint", "give 'train.steps' 3 or more"});
}

// --loss-scale took "0x10", "0x1p4" and " 16" (stod), where every number flag takes decimal only.
TEST_F(HostileInput, LossScaleInDecimalOnly) {
  for (const std::string scale : {"0x10", "0x1p4", "' 16'"})
    expect_one_line(run("run --model " + kTiny + " --reference --steps 1 --clip-grad 1 --loss-scale " + scale),
                    {"--loss-scale '", "': expected \"dynamic\" or a static scale in decimal, such as 1024"});
  expect_one_line(run("run --model " + kTiny + " --reference --steps 1 --clip-grad 1 --loss-scale dinamic"),
                  {"--loss-scale must be \"dynamic\" or a static scale such as 1024 (got 'dinamic')"});
  EXPECT_EQ(run("run --model " + kTiny + " --reference --steps 1 --clip-grad 1 --loss-scale 16").exit_code, 0);
}

// `run --data F --on-nonfinite skip --save-scenario s.json` left both out of the scenario: replayed,
// it trained on the synthetic stream (other losses), exit 0. Now in its "train" section, the file
// relative to the scenario's folder, so it replays from any folder.
TEST_F(HostileInput, SavedRunScenarioKeepsItsDataAndNonfinitePolicy) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
  input("data.txt", text);
  fs::create_directories(dir_ / "saved");
  const CliResult ran = run("run --model " + kTiny +
                            " --reference --steps 2 --data data.txt --on-nonfinite skip --save-scenario saved/s.json "
                            "--report a.json");
  ASSERT_EQ(ran.exit_code, 0) << ran.err;
  const nlohmann::json train = nlohmann::json::parse(piper::test::read_file(dir_ / "saved" / "s.json")).at("train");
  EXPECT_EQ(train.value("data", ""), "../data.txt");
  EXPECT_EQ(train.value("on_nonfinite", ""), "skip");
  const CliResult again = piper::test::run_cli_in(dir_ / "saved", PIPER_CLI,
                                                  "run --scenario s.json --reference --report b.json", "timeout 60");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(nlohmann::json::parse(piper::test::read_file(dir_ / "a.json")).at("losses"),
            nlohmann::json::parse(piper::test::read_file(dir_ / "saved" / "b.json")).at("losses"));
  input("bad.json", R"({"model": "qwen3-9m", "train": {"on_nonfinite": "ignore"}})");
  expect_one_line(run("run --scenario bad.json --reference"),
                  {"bad.json: field 'train.on_nonfinite': must be \"stop\" or \"skip\""});
  input("gone.json", R"({"model": "qwen3-9m", "train": {"data": "gone.txt"}})");
  expect_one_line(run("run --scenario gone.json --reference"),
                  {"gone.json: field 'train.data': 'gone.txt': cannot open: no such file"});
}

// The other run flags that change what is trained were left out too: a resumed run replayed from
// step 0, a --precision (GPU) run in fp32. Now "resume" (relative to the scenario's folder, as "data")
// and "precision"; what only says how or where it runs (--reference, --backend, outputs) is not saved.
TEST_F(HostileInput, SavedRunScenarioKeepsItsCheckpointAndPrecision) {
  ASSERT_EQ(run("run --model " + kTiny + " --reference --steps 2 --save ck").exit_code, 0);
  fs::create_directories(dir_ / "saved");
  const CliResult ran =
      run("run --model " + kTiny + " --reference --steps 4 --resume ck --save-scenario saved/s.json --report a.json");
  ASSERT_EQ(ran.exit_code, 0) << ran.err;
  const nlohmann::json train = nlohmann::json::parse(piper::test::read_file(dir_ / "saved" / "s.json")).at("train");
  EXPECT_EQ(train.value("resume", ""), "../ck");
  EXPECT_FALSE(train.contains("report"));
  const CliResult again = piper::test::run_cli_in(dir_ / "saved", PIPER_CLI,
                                                  "run --scenario s.json --reference --report b.json", "timeout 60");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(nlohmann::json::parse(piper::test::read_file(dir_ / "a.json")).at("losses"),
            nlohmann::json::parse(piper::test::read_file(dir_ / "saved" / "b.json")).at("losses"));
  input("gone.json", R"({"model": "qwen3-9m", "train": {"resume": "gone.ckpt"}})");
  expect_one_line(run("run --scenario gone.json --reference"),
                  {"gone.json: field 'train.resume': 'gone.ckpt': cannot open: no such file"});
  input("bf16.json", R"({"model": ")" + kTiny + R"(", "train": {"precision": "bf16"}})");
  expect_one_line(run("run --scenario bf16.json --reference"),
                  {"bf16.json: field 'train.precision': needs --backend cuda"});
  input("fp8.json", R"({"model": ")" + kTiny + R"(", "train": {"precision": "fp8"}})");
  expect_one_line(run("run --scenario fp8.json --reference"),
                  {"fp8.json: field 'train.precision': must be \"fp32\", \"bf16\" or \"fp16\""});
}

// Resumed with --steps at the checkpoint's step, no step runs: --report wrote "losses": [] with a step
// time and tokens/s of 0, exit 0, as if measured. Refused as --calibrate and --trace already were.
TEST_F(HostileInput, ResumedRunWithNoStepLeftWritesNoReport) {
  ASSERT_EQ(run("run --model " + kTiny + " --reference --steps 3 --save ck").exit_code, 0);
  expect_one_line(run("run --model " + kTiny + " --reference --steps 3 --resume ck --report r.json"),
                  {"--report: --steps 3 is the step of the checkpoint ck: no step would run", "--steps 4 or more"});
  EXPECT_FALSE(fs::exists(dir_ / "r.json"));
  const CliResult more = run("run --model " + kTiny + " --reference --steps 4 --resume ck --report r.json");
  ASSERT_EQ(more.exit_code, 0) << more.err;
  EXPECT_TRUE(fs::exists(dir_ / "r.json"));
  // Without an output that measures steps it is done already, as Megatron's run resumed at its
  // train_iters: exit 0, and said (it printed nothing).
  const CliResult done = run("run --model " + kTiny + " --reference --steps 3 --resume ck");
  ASSERT_EQ(done.exit_code, 0) << done.err;
  EXPECT_NE(done.out.find("no step to run: the checkpoint ck is at step 3 already"), std::string::npos) << done.out;
}

}  // namespace
