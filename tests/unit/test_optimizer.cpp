// The optimizer settings every trainer applies alike: the learning-rate schedule (warmup, cosine or
// linear decay), AdamW's betas and weight decay, their checks, and how a run reports and checkpoints
// them; the same schedule gives the reference, MPI ranks and virtual devices the same parameters,
// and a resumed run continues the schedule where it stopped.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "piper/core/scenario.hpp"
#include "piper/runtime/kernels.hpp"
#include "piper/runtime/trainer.hpp"
#include "shell.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using piper::runtime::host::AdamWConfig;
using piper::runtime::host::LrDecay;
using piper::test::Result;
using piper::test::sh;

namespace {

AdamWConfig schedule(LrDecay decay) {
  AdamWConfig c;
  c.lr = 1.0f, c.min_lr = 0.1f, c.warmup_steps = 4, c.decay = decay, c.decay_steps = 10;
  return c;
}

// Values worked by hand from the definitions (warmup: lr * s / 4; then over steps 4..10 the ratio
// r = (s - 4) / 6 takes lr from 1.0 to 0.1: cosine 0.1 + 0.9 * (cos(pi r) + 1) / 2, linear 0.1 + 0.9 (1 - r)).
TEST(LrSchedule, WarmupThenDecayByHand) {
  const AdamWConfig cos = schedule(LrDecay::Cosine), lin = schedule(LrDecay::Linear);
  for (const AdamWConfig& c : {cos, lin}) {
    EXPECT_FLOAT_EQ(c.lr_at(1), 0.25f);
    EXPECT_FLOAT_EQ(c.lr_at(2), 0.5f);
    EXPECT_FLOAT_EQ(c.lr_at(4), 1.0f);
    EXPECT_FLOAT_EQ(c.lr_at(7), 0.55f);  // r = 1/2: both decays are halfway
    EXPECT_FLOAT_EQ(c.lr_at(10), 0.1f);
    EXPECT_FLOAT_EQ(c.lr_at(25), 0.1f);
  }
  EXPECT_NEAR(cos.lr_at(5), 0.1 + 0.45 * (std::cos(M_PI / 6) + 1), 1e-6);  // 0.93971
  EXPECT_NEAR(lin.lr_at(5), 0.1 + 0.9 * 5.0 / 6.0, 1e-6);                  // 0.85
  AdamWConfig constant;
  constant.lr = 2e-4f;
  for (int s : {1, 50, 100000}) EXPECT_EQ(constant.lr_at(s), 2e-4f);
  constant.warmup_steps = 10;
  EXPECT_FLOAT_EQ(constant.lr_at(5), 1e-4f);
  EXPECT_EQ(constant.lr_at(11), 2e-4f);
  EXPECT_EQ(constant.at(5).lr, constant.lr_at(5));
  EXPECT_EQ(constant.at(5).beta2, constant.beta2);
}

TEST(LrSchedule, SettingsNoScheduleCanFollowAreRefusedNamingTheFlag) {
  auto refusal = [](AdamWConfig c) {
    try {
      piper::runtime::host::check_adamw(c);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  AdamWConfig c = schedule(LrDecay::Cosine);
  EXPECT_EQ(refusal(c), "accepted");
  c.decay_steps = 4;
  EXPECT_EQ(refusal(c),
            "--lr-decay cosine: --lr-decay-steps 4 must exceed --warmup-steps 4 (the decay runs between them)");
  c = schedule(LrDecay::Linear), c.min_lr = 2.0f;
  EXPECT_EQ(refusal(c), "--min-lr must be between 0 and --lr 1 (got 2)");
  c = schedule(LrDecay::Constant), c.beta1 = 1.0f;
  EXPECT_EQ(refusal(c), "--beta1 must be in [0, 1) (got 1)");
  c = schedule(LrDecay::Constant), c.beta2 = -0.5f;
  EXPECT_EQ(refusal(c), "--beta2 must be in [0, 1) (got -0.5)");
  c = schedule(LrDecay::Constant), c.lr = std::nanf("");
  EXPECT_EQ(refusal(c).rfind("--lr must be >= 0", 0), 0u) << refusal(c);
  EXPECT_THROW(piper::runtime::host::parse_lr_decay("exponential"), std::invalid_argument);
}

const std::string kModel = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json";
const std::string kCli = PIPER_CLI;

fs::path scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("piper-optimizer-" + std::to_string(::getpid())) / name;
  fs::create_directories(d);
  return d;
}

json read_json(const fs::path& p) { return json::parse(std::ifstream(p)); }

// The same schedule and AdamW settings in every launch: equal losses and parameters.
TEST(OptimizerRuns, EveryLaunchAppliesTheScheduleAlike) {
  const fs::path dir = scratch("launches");
  const std::string run = " run --model " + kModel +
                          " --pp 2 --dp 2 --microbatches 4 --steps 5 --seed 3 --adam-eps 1e-6 --lr 4e-3 "
                          "--warmup-steps 2 --lr-decay cosine --min-lr 4e-4 --weight-decay 0.1 --beta1 0.8 --beta2 0.9";
  Result r = sh(kCli + run + " --reference --report " + (dir / "ref.json").string() + " --dump-params " +
                (dir / "ref.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  r = sh(kCli + run + " --virtual-devices --report " + (dir / "virtual.json").string() + " --dump-params " +
         (dir / "virtual.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  r = sh(piper::test::mpirun(4) + kCli + run + " --dump-params " + (dir / "mpi.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  // Without the schedule the parameters differ by far more than the equivalence bound (the check can fail).
  r = sh(kCli + " run --model " + kModel +
         " --pp 2 --dp 2 --microbatches 4 --steps 5 --seed 3 --adam-eps 1e-6 --lr 4e-3 --weight-decay 0.1 --beta1 0.8 "
         "--beta2 0.9 --reference --dump-params " +
         (dir / "flat.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string ref = (dir / "ref.bin").string();
  EXPECT_LT(piper::runtime::max_param_difference(ref, (dir / "virtual.bin").string()), 1e-4);
  EXPECT_LT(piper::runtime::max_param_difference(ref, (dir / "mpi.bin").string()), 1e-4);
  EXPECT_GT(piper::runtime::max_param_difference(ref, (dir / "flat.bin").string()), 1e-3);

  const json a = read_json(dir / "ref.json"), b = read_json(dir / "virtual.json");
  EXPECT_EQ(a["lrs"], b["lrs"]);
  ASSERT_EQ(a["lrs"].size(), 5u);
  EXPECT_DOUBLE_EQ(a["lrs"][0].get<double>(), 2e-3);  // warmup step 1 of 2
  EXPECT_DOUBLE_EQ(a["lrs"][1].get<double>(), 4e-3);
  EXPECT_DOUBLE_EQ(a["lrs"][4].get<double>(), 4e-4);  // --lr-decay-steps defaults to --steps
  EXPECT_EQ(a["optimizer"]["lr_decay"], "cosine");
  EXPECT_EQ(a["optimizer"]["lr_decay_steps"], 5);
  EXPECT_DOUBLE_EQ(a["optimizer"]["weight_decay"].get<double>(), 0.1);
  fs::remove_all(dir.parent_path() / "launches");
}

// A run saved after 2 of 6 steps and resumed to 6 follows the schedule of the uninterrupted run (the
// learning rate is a function of the optimizer step the checkpoint carries), and the checkpoint
// records the settings.
TEST(OptimizerRuns, AResumedRunContinuesTheSchedule) {
  const fs::path dir = scratch("resume");
  const std::string run = " run --model " + kModel +
                          " --pp 2 --microbatches 2 --seed 5 --adam-eps 1e-6 --warmup-steps 3 --lr-decay linear "
                          "--lr-decay-steps 6 --min-lr 1e-4";
  ASSERT_EQ(sh(kCli + run + " --virtual-devices --steps 6 --dump-params " + (dir / "full.bin").string()).code, 0);
  Result r = sh(kCli + run + " --virtual-devices --steps 2 --save " + (dir / "ck").string());
  ASSERT_EQ(r.code, 0) << r.output;
  r = sh(kCli + run + " --reference --steps 6 --resume " + (dir / "ck").string() + " --report " +
         (dir / "rest.json").string() + " --dump-params " + (dir / "resumed.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(piper::runtime::max_param_difference((dir / "full.bin").string(), (dir / "resumed.bin").string()), 1e-4);
  const json rest = read_json(dir / "rest.json");
  ASSERT_EQ(rest["lrs"].size(), 4u);  // steps 3..6: the last warmup step, then the linear decay
  EXPECT_DOUBLE_EQ(rest["lrs"][0].get<double>(), 3e-3);
  EXPECT_DOUBLE_EQ(rest["lrs"][3].get<double>(), 1e-4);
  std::ifstream in(dir / "ck", std::ios::binary);
  std::string header;
  std::getline(in, header);
  const json h = json::parse(header);
  EXPECT_EQ(h["optimizer"]["lr_decay"], "linear");
  EXPECT_EQ(h["optimizer"]["warmup_steps"], 3);
  fs::remove_all(dir);
}

// Standard settings on real text (byte-level tokens of the GPL-3 text Debian's base-files installs, as
// scripts/gpu-check.sh uses: a text that does not change with this repository's docs): warmup, cosine
// decay, weight decay and clipping at 1.0 over 100 steps of the tiny dense model on four virtual
// devices. Its 64-token vocabulary starts near ln 64 = 4.16; the mean loss of the last ten steps must
// end at least a third below the first ten's (measured: 4.52 -> 2.57 on this text), and every
// step's norm is reported and finite.
TEST(OptimizerRuns, RealTextLossFallsOver100Steps) {
  const std::string kText = "/usr/share/common-licenses/GPL-3";
  if (!fs::exists(kText)) GTEST_SKIP() << kText << " is missing (Debian's base-files installs it)";
  const fs::path dir = scratch("real-text");
  const Result r = sh(kCli + " run --virtual-devices --model " + std::string(PIPER_SOURCE_DIR) +
                      "/tests/data/runtime-tiny-dense.json --pp 2 --dp 2 --microbatches 4 --steps 100 --data " + kText +
                      " --lr 3e-3 --warmup-steps 10 --lr-decay cosine --min-lr 3e-4 "
                      "--weight-decay 0.1 --clip-grad 1.0 --report " +
                      (dir / "run.json").string());
  ASSERT_EQ(r.code, 0) << r.output;
  const json j = read_json(dir / "run.json");
  const auto losses = j["losses"].get<std::vector<double>>();
  const auto norms = j["grad_norms"].get<std::vector<double>>();
  ASSERT_EQ(losses.size(), 100u);
  ASSERT_EQ(norms.size(), 100u);
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i)
    first += losses[static_cast<std::size_t>(i)] / 10, last += losses[static_cast<std::size_t>(90 + i)] / 10;
  EXPECT_LT(last, first * 2 / 3) << "first ten " << first << ", last ten " << last;
  for (double n : norms) EXPECT_TRUE(std::isfinite(n) && n > 0) << n;
  fs::remove_all(dir);
}

// A scenario file's "train" section sets the run's training settings (piper run --scenario); a flag
// of the same name wins; its keys and types are checked where any front end reads the file.
TEST(OptimizerRuns, ScenarioTrainSectionSetsTheRunAndFlagsWin) {
  const fs::path dir = scratch("scenario");
  const json scenario = {{"model", kModel},
                         {"strategy", {{"pp", 2}, {"dp", 1}, {"microbatches", 2}}},
                         {"train",
                          {{"steps", 4},
                           {"lr", 2e-3},
                           {"warmup_steps", 2},
                           {"lr_decay", "linear"},
                           {"min_lr", 2e-4},
                           {"weight_decay", 0.05}}}};
  std::ofstream(dir / "s.json") << scenario.dump();
  const std::string file = (dir / "s.json").string();
  Result r = sh(kCli + " run --reference --scenario " + file + " --report " + (dir / "a.json").string());
  ASSERT_EQ(r.code, 0) << r.output;
  const json a = read_json(dir / "a.json");
  EXPECT_EQ(a["lrs"], json({1e-3, 2e-3, 1.1e-3, 2e-4}));  // warmup 2 steps, then linear to min_lr at step 4
  EXPECT_DOUBLE_EQ(a["optimizer"]["weight_decay"].get<double>(), 0.05);
  r = sh(kCli + " run --reference --scenario " + file + " --steps 3 --lr 1e-3 --report " + (dir / "b.json").string());
  ASSERT_EQ(r.code, 0) << r.output;
  // The flags' steps and lr; the file's warmup, decay and min_lr (the decay ends at --steps 3).
  EXPECT_EQ(read_json(dir / "b.json")["lrs"], json({5e-4, 1e-3, 2e-4}));
  // The same scenario as MPI ranks trains the same parameters as the reference.
  r = sh(kCli + " run --reference --scenario " + file + " --dump-params " + (dir / "ref.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  r = sh(piper::test::mpirun(2) + kCli + " run --scenario " + file + " --dump-params " + (dir / "mpi.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_LT(piper::runtime::max_param_difference((dir / "ref.bin").string(), (dir / "mpi.bin").string()), 1e-4);

  const piper::core::Scenario s = piper::core::Scenario::from_json(scenario, "s.json");
  EXPECT_EQ(s.to_json()["train"], scenario["train"]);
  for (const auto& [bad, message] : std::vector<std::pair<json, std::string>>{
           {{{"lr", -1}}, "s.json: field 'train.lr': must be a number >= 0"},
           {{{"lr_decay", "exponential"}},
            "s.json: field 'train.lr_decay': must be \"constant\", \"cosine\" or \"linear\""},
           {{{"steps", 0}}, "s.json: field 'train.steps': must be an integer in [1, 1e9]"},
           {{{"steps", 2'000'000'000}}, "s.json: field 'train.steps': must be an integer in [1, 1e9]"},
           {{{"warmup_step", 3}}, "s.json: field 'train.warmup_step': unknown field (did you mean 'warmup_steps'?)"}}) {
    json j = scenario;
    j["train"] = bad;
    try {
      piper::core::Scenario::from_json(j, "s.json");
      ADD_FAILURE() << bad.dump() << " was accepted";
    } catch (const std::exception& e) {
      EXPECT_EQ(std::string(e.what()), message);
    }
  }
  r = sh(kCli + " run --reference --scenario " + file + " --pp 4");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output.rfind("piper: error: --pp cannot be used with --scenario", 0), 0u) << r.output;
  fs::remove_all(dir);
}

TEST(OptimizerRuns, BadSettingsAreOneLineAndExitTwo) {
  const Result r = sh(kCli + " run --reference --model " + kModel + " --steps 3 --lr-decay cosine --warmup-steps 5");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output,
            "piper: error: --lr-decay cosine: --lr-decay-steps 3 must exceed --warmup-steps 5 (the decay runs between "
            "them)\n");
}

}  // namespace
