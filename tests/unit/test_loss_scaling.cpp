// Loss scaling (fp16 training), applied alike by every trainer: the dynamic scaler's schedule by hand,
// its checks, a static power-of-two scale that changes no bit of the trained parameters, overflowed
// steps skipped identically by the reference, virtual devices and MPI ranks (and leaving the
// parameters untouched), and a resumed run that continues the scaler where the checkpoint left it.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "piper/core/scenario.hpp"
#include "piper/runtime/kernels.hpp"
#include "piper/runtime/trainer.hpp"
#include "shell.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using piper::runtime::host::LossScaleMode;
using piper::runtime::host::LossScaleState;
using piper::runtime::host::LossScaling;
using piper::test::Result;
using piper::test::sh;

namespace {

// Overflow flags of eight steps against the scale each step runs with, by hand from the rule (halve
// on an overflow, never below min_scale, and restart the count; double after `window` good steps).
TEST(LossScaler, DynamicScheduleByHand) {
  LossScaling cfg;
  cfg.mode = LossScaleMode::Dynamic;
  cfg.initial = 8, cfg.window = 3, cfg.min_scale = 2;
  const std::vector<bool> overflow = {false, false, false, true, false, true, true, true, false};
  const std::vector<double> expected = {8, 8, 8, 16, 8, 8, 4, 2, 2};  // the scale each step runs with
  LossScaleState s = piper::runtime::host::initial_loss_scale(cfg);
  for (std::size_t i = 0; i < overflow.size(); ++i) {
    EXPECT_EQ(s.scale, expected[i]) << "step " << i + 1;
    s = piper::runtime::host::next_loss_scale(cfg, s, overflow[i]);
  }
  EXPECT_EQ(s.good_steps, 1);
  cfg.mode = LossScaleMode::Static;  // a static scale never moves
  EXPECT_EQ(piper::runtime::host::next_loss_scale(cfg, {8, 0}, true).scale, 8);
  cfg.mode = LossScaleMode::None;
  EXPECT_EQ(piper::runtime::host::initial_loss_scale(cfg).scale, 1);
  // The loss gradient carries the scale after 1 / tokens is rounded: exactly the scale times it.
  EXPECT_EQ(piper::runtime::host::scaled_loss_gradient(1024, 3), 1024.0f * (1.0f / 3.0f));
  EXPECT_TRUE(std::isinf(piper::runtime::host::scaled_loss_gradient(std::ldexp(1.0, 130), 3)));
}

TEST(LossScaler, SettingsAreCheckedNamingTheFlag) {
  auto refusal = [](LossScaling c) {
    try {
      piper::runtime::host::check_loss_scaling(c);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  LossScaling c;
  c.mode = LossScaleMode::Static, c.initial = 1000;
  EXPECT_EQ(refusal(c), "--loss-scale must be a power of two >= 1 (got 1000): scaling by it and back must be exact");
  c.initial = 1024;
  EXPECT_EQ(refusal(c), "accepted");
  c.mode = LossScaleMode::Dynamic, c.min_scale = 2048;
  EXPECT_EQ(refusal(c), "--min-loss-scale must be a power of two between 1 and --initial-loss-scale 1024 (got 2048)");
  c.min_scale = 1, c.window = 0;
  EXPECT_EQ(refusal(c), "--loss-scale-window must be >= 1 (got 0)");
  c.window = 10, c.initial = 0.5;
  EXPECT_EQ(refusal(c).rfind("--initial-loss-scale must be a power of two >= 1", 0), 0u) << refusal(c);
}

const std::string kModel = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-dense.json";
const std::string kCli = PIPER_CLI;
const std::string kRun = " run --model " + kModel + " --pp 2 --dp 2 --microbatches 2 --seed 7 ";

fs::path scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("piper-loss-scaling-" + std::to_string(::getpid())) / name;
  fs::create_directories(d);
  return d;
}

json read_json(const fs::path& p) { return json::parse(std::ifstream(p)); }
std::string bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// A static scale is a power of two: the scaled gradients are the unscaled ones times it, exactly, and
// the update divides it out, so the parameters match the unscaled run's bit for bit, with clipping
// that binds (0.05) or not (1e6). A run that forgot to unscale would differ.
TEST(LossScalingRuns, AStaticScaleChangesNoBitOfTheParameters) {
  const fs::path dir = scratch("static");
  for (const std::string launch : {"--reference", "--virtual-devices"})
    for (const std::string clip : {"1e6", "0.05"}) {
      const std::string base = kCli + kRun + "--steps 4 --clip-grad " + clip + " " + launch + " --dump-params ";
      Result r = sh(base + (dir / "plain.bin").string());
      ASSERT_EQ(r.code, 0) << r.output;
      r = sh(base + (dir / "scaled.bin").string() + " --loss-scale 4096 --report " + (dir / "run.json").string());
      ASSERT_EQ(r.code, 0) << r.output;
      EXPECT_EQ(bytes_of(dir / "plain.bin"), bytes_of(dir / "scaled.bin")) << launch << " clip " << clip;
      const json j = read_json(dir / "run.json");
      EXPECT_EQ(j["loss_scales"], json({4096, 4096, 4096, 4096}));
      EXPECT_EQ(j["optimizer"]["loss_scaling"], json({{"mode", "static"}, {"scale", 4096}}));
      EXPECT_FALSE(j.contains("skipped_steps"));
    }
  fs::remove_all(dir);
}

// A scale beyond float's range (2^130) makes the loss gradient infinite: the global gradient norm is
// not finite on every device, so every launch skips the same steps, halving the scale each time until
// the gradients fit. The skipped steps leave the parameters as they were (a --lr 0 step's), and the
// scaler doubles after --loss-scale-window good steps.
TEST(LossScalingRuns, OverflowedStepsAreSkippedAlikeByEveryLaunch) {
  const fs::path dir = scratch("overflow");
  const std::string dynamic = "--steps 12 --clip-grad 1 --loss-scale dynamic --initial-loss-scale " +
                              fmt::format("{}", std::ldexp(1.0, 130)) + " --loss-scale-window 3 ";
  auto report = [&](const std::string& mpirun, const std::string& flag, const std::string& name) {
    const Result r = sh(mpirun + kCli + kRun + dynamic + flag + " --report " + (dir / (name + ".json")).string() +
                        " --dump-params " + (dir / (name + ".bin")).string());
    EXPECT_EQ(r.code, 0) << r.output;
    return read_json(dir / (name + ".json"));
  };
  const json ref = report("", "--reference", "ref"), mpi = report(piper::test::mpirun(4), "", "mpi");
  const Result virt = sh(kCli + kRun + dynamic + "--virtual-devices --report " + (dir / "virt.json").string());
  ASSERT_EQ(virt.code, 0) << virt.output;
  EXPECT_NE(virt.output.find("step    1  loss"), std::string::npos);
  EXPECT_NE(virt.output.find("skipped: gradients overflowed at loss scale 1.361129467683754e+39"), std::string::npos)
      << virt.output;
  EXPECT_EQ(mpi["skipped_steps"], ref["skipped_steps"]);
  EXPECT_EQ(mpi["loss_scales"], ref["loss_scales"]);
  EXPECT_EQ(read_json(dir / "virt.json")["skipped_steps"], ref["skipped_steps"]);
  // 2^130, 2^129 and 2^128 exceed float: steps 1-3 overflow, whatever the gradients. From there on each
  // step's scale follows from the one before and whether that step overflowed (the rule above).
  const auto skipped = ref["skipped_steps"].get<std::vector<int>>();
  const auto scales = ref["loss_scales"].get<std::vector<double>>();
  ASSERT_EQ(scales.size(), 12u);
  ASSERT_GE(skipped.size(), 3u);
  ASSERT_LT(skipped.size(), 12u) << "the scale never settled";
  for (int i = 0; i < 3; ++i) EXPECT_EQ(skipped[static_cast<std::size_t>(i)], i + 1);
  LossScaling cfg;
  cfg.mode = LossScaleMode::Dynamic, cfg.initial = std::ldexp(1.0, 130), cfg.window = 3;
  LossScaleState state = piper::runtime::host::initial_loss_scale(cfg);
  for (int step = 1; step <= 12; ++step) {
    EXPECT_EQ(scales[static_cast<std::size_t>(step - 1)], state.scale) << "step " << step;
    const bool over = std::find(skipped.begin(), skipped.end(), step) != skipped.end();
    state = piper::runtime::host::next_loss_scale(cfg, state, over);
  }
  EXPECT_LT(piper::runtime::max_param_difference((dir / "ref.bin").string(), (dir / "mpi.bin").string()), 1e-4);

  // Two skipped steps change no parameter: the same as one step at learning rate 0.
  Result r = sh(kCli + kRun + dynamic.substr(dynamic.find("--clip-grad")) + "--steps 2 --reference --dump-params " +
                (dir / "skipped.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  r = sh(kCli + kRun + "--steps 1 --lr 0 --reference --dump-params " + (dir / "initial.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(bytes_of(dir / "skipped.bin"), bytes_of(dir / "initial.bin"));
  fs::remove_all(dir);
}

// Saved after 3 of 7 steps and resumed to 7, a dynamic run keeps its scale and good-step count (the
// checkpoint's "loss_scale"): the resumed steps run at the uninterrupted run's scales and train its
// parameters.
TEST(LossScalingRuns, AResumedRunContinuesTheScaler) {
  const fs::path dir = scratch("resume");
  const std::string run =
      kCli + kRun + "--clip-grad 1 --loss-scale dynamic --initial-loss-scale 4 --loss-scale-window 2 ";
  Result r = sh(run + "--virtual-devices --steps 7 --report " + (dir / "full.json").string() + " --dump-params " +
                (dir / "full.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(read_json(dir / "full.json")["loss_scales"], json({4, 4, 8, 8, 16, 16, 32}));
  r = sh(run + "--virtual-devices --steps 3 --save " + (dir / "ck").string());
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream in(dir / "ck", std::ios::binary);
  std::string header;
  std::getline(in, header);
  EXPECT_EQ(json::parse(header)["loss_scale"], json({{"scale", 8}, {"good_steps", 1}}));
  r = sh(run + "--reference --steps 7 --resume " + (dir / "ck").string() + " --report " + (dir / "rest.json").string() +
         " --dump-params " + (dir / "resumed.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(read_json(dir / "rest.json")["loss_scales"], json({8, 16, 16, 32}));
  EXPECT_LT(piper::runtime::max_param_difference((dir / "full.bin").string(), (dir / "resumed.bin").string()), 1e-4);
  fs::remove_all(dir);
}

// What cannot work is refused in one line before any step (exit 2), whatever launches it.
TEST(LossScalingRuns, SettingsThatCannotWorkAreOneLine) {
  for (const auto& [flags, message] : std::vector<std::pair<std::string, std::string>>{
           {"--steps 2 --loss-scale dynamic --reference",
            "piper: error: --loss-scale needs the plan's gradient-norm all-reduce, through which every device learns "
            "of an overflow before any update: add --clip-grad (Megatron-LM's default is 1.0)\n"},
           {"--steps 2 --loss-scale dynamic --virtual-devices",
            "piper: error: --loss-scale needs the plan's gradient-norm all-reduce, through which every device learns "
            "of an overflow before any update: add --clip-grad (Megatron-LM's default is 1.0)\n"},
           {"--steps 2 --clip-grad 1 --loss-scale dinamic --reference",
            "piper: error: --loss-scale must be \"dynamic\" or a static scale such as 1024 (got 'dinamic')\n"},
           {"--steps 2 --clip-grad 1 --loss-scale 1024 --loss-scale-window 5 --reference",
            "piper: error: --loss-scale-window applies only with --loss-scale dynamic\n"},
           {"--steps 2 --clip-grad 1 --precision fp16 --backend cuda --virtual-devices",
            "piper: error: --precision fp16 needs --loss-scale (dynamic, or a static power of two): fp16 gradients "
            "below 6e-8 flush to zero without it\n"},
       }) {
    const Result r = sh(kCli + kRun + flags);
    EXPECT_EQ(r.code, 2) << flags << "\n" << r.output;
    EXPECT_EQ(r.output, message) << flags;
  }
}

// A scenario's "train" section takes the same settings under the flags' names, checked on reading.
TEST(LossScalingRuns, ScenarioTrainSectionSetsLossScaling) {
  const fs::path dir = scratch("scenario");
  json scenario = {
      {"model", kModel},
      {"strategy", {{"pp", 2}, {"dp", 1}, {"microbatches", 2}, {"clip_grad", 1.0}}},
      {"train", {{"steps", 3}, {"loss_scale", "dynamic"}, {"initial_loss_scale", 2}, {"loss_scale_window", 1}}}};
  std::ofstream(dir / "s.json") << scenario.dump();
  const Result r =
      sh(kCli + " run --reference --scenario " + (dir / "s.json").string() + " --report " + (dir / "a.json").string());
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(read_json(dir / "a.json")["loss_scales"], json({2, 4, 8}));
  scenario["train"] = {{"loss_scale", "sometimes"}};
  try {
    piper::core::Scenario::from_json(scenario, "s.json");
    ADD_FAILURE() << "accepted";
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()),
              "s.json: field 'train.loss_scale': must be \"dynamic\" or a static scale >= 1 (a power of two)");
  }
  fs::remove_all(dir);
}

}  // namespace
