// Runtime end to end: the runtime's layout, checkpoints that resume exactly across layouts, parameter
// dumps, and failures that end every rank with one clear error. Plans against the single-process
// reference in every strategy: test_runtime_equivalence.cpp; shared helpers: runtime_support.hpp.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "runtime_support.hpp"

using namespace runtime_test;

namespace {

// Removes this process's scratch folder (plans, reports, dumps, checkpoints) after the last test.
struct ScratchCleanup : ::testing::Environment {
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(temp_root(), ec);
  }
};
[[maybe_unused]] ::testing::Environment* const kCleanup = ::testing::AddGlobalTestEnvironment(new ScratchCleanup);

}  // namespace

// The runtime's parameter layout must hold exactly the parameters the compiler costs per layer.
TEST(Runtime, LayoutMatchesCompilerParameterCounts) {
  const core::Model model = core::build_model(core::load_model_config(kModel));
  piper::runtime::host::HostModel m(model, {}, 1);
  for (std::size_t l = 0; l < model.layers().size(); ++l)
    EXPECT_EQ(m.layer_param_count(static_cast<int>(l)), model.layer_cost(l).params) << model.layers()[l].name;
}

// The same for GPT layers: LayerNorm gain + bias, biased attention and GELU MLP, learned positions
// in the embedding, and a tied head that holds nothing of its own.
TEST(Runtime, LayoutMatchesCompilerParameterCountsGpt) {
  for (const std::string& spec : {kGpt, kGptUntied}) {
    const core::Model model = core::build_model(core::load_model_config(spec));
    piper::runtime::host::HostModel m(model, {}, 1);
    std::int64_t total = 0;
    for (std::size_t l = 0; l < model.layers().size(); ++l) {
      EXPECT_EQ(m.layer_param_count(static_cast<int>(l)), model.layer_cost(l).params)
          << spec << " " << model.layers()[l].name;
      total += m.layer_param_count(static_cast<int>(l));
    }
    // By hand (V 64, h 32, 4 blocks, ffn 128, 16 positions): embedding 64*32 + 16*32 = 2560; per block
    // 2 LayerNorms 2*64, attention 4*32*32 + 3*32 + 32 = 4224, MLP 2*32*128 + 128 + 32 = 8352;
    // final LayerNorm 64; head 64*32 = 2048 unless tied.
    const std::int64_t blocks = 4 * (2 * 64 + 4224 + 8352);
    EXPECT_EQ(total, 2560 + blocks + 64 + (spec == kGpt ? 0 : 2048)) << spec;
  }
}

// What the host backend cannot run exactly as the spec says is refused in one line naming the field:
// a sequence longer than the learned position table, dropout.
TEST(Runtime, GptSpecsItCannotRunAreRefused) {
  // The host model's refusal of a spec (or "(accepted)").
  auto refusal = [](const json& spec) -> std::string {
    try {
      piper::runtime::host::HostModel m(core::build_model(core::config_from_spec_json(spec, "spec")), {}, 1);
    } catch (const std::invalid_argument& e) {
      return e.what();
    } catch (const core::Error& e) {  // refused by the model validation, before the runtime
      return e.what();
    }
    return "(accepted)";
  };
  json spec = json::parse(std::ifstream(kGpt));
  spec["max_positions"] = 8;  // training.seq_len is 16
  EXPECT_EQ(refusal(spec),
            "spec: field 'training.seq_len': 16 exceeds max_positions 8 (the model's learned positions)");
  spec["max_positions"] = 16;
  spec["dropout"] = 0.1;
  EXPECT_EQ(refusal(spec),
            "runtime: model 'runtime-tiny-gpt': field 'dropout' is 0.1; the host backend trains without dropout (set "
            "it to 0)");
  spec.erase("dropout");
  spec["bias"] = false;
  spec["qkv_bias"] = true;  // Qwen2's q/k/v-only biases
  EXPECT_EQ(refusal(spec),
            "runtime: model 'runtime-tiny-gpt': field 'qkv_bias' is set; the host backend has biases on every linear "
            "layer or none");
  spec["bias"] = true;
  spec.erase("qkv_bias");
  spec["sliding_window"] = {{"window", 8}};  // shorter than seq_len 16
  EXPECT_EQ(refusal(spec),
            "runtime: model 'runtime-tiny-gpt': field 'sliding_window' is 8; the host backend runs full causal "
            "attention (use a seq_len <= the window)");
  spec["sliding_window"] = {{"window", 16}};  // covers the whole sequence: full attention
  EXPECT_EQ(refusal(spec), "(accepted)");
}

// At initialisation the tied GPT model predicts the uniform distribution: the logits are
// LN(x) . E^T with LN(x) of unit RMS (gain 1, bias 0) and E's entries of std 0.02, so each logit has
// std 0.02 * sqrt(32) ~ 0.11, independent of the target token. For iid logits of variance s^2 the
// expected cross-entropy is E[log sum_v e^l_v] - E[l_y] ~ ln V + s^2/2 = ln 64 + 0.006. The untied
// head (std 1/sqrt(fan_in)) gives logits of std ~1 and ln V + 1/2 instead.
TEST(Runtime, GptReferenceLossAtInitIsLnVocab) {
  piper::runtime::TrainOptions o;
  o.steps = 1;
  o.print = false;
  const auto tied = piper::runtime::train_reference(
      core::Program::from_json(
          json::parse(std::ifstream(compile_plan(temp_dir("gpt-init"), strategy(1, 1, 1, 0, 2, "1f1b"), "", kGpt)))),
      o);
  EXPECT_NEAR(tied.losses.front(), std::log(64.0), 0.05);
  const auto untied = piper::runtime::train_reference(
      core::Program::from_json(json::parse(
          std::ifstream(compile_plan(temp_dir("gpt-init-untied"), strategy(1, 1, 1, 0, 2, "1f1b"), "", kGptUntied)))),
      o);
  EXPECT_NEAR(untied.losses.front(), std::log(64.0) + 0.5, 0.3);
}

// From near-uniform logits (table std 0.02) the tied model needs larger steps than the RoPE models:
// lr 1e-2 over 30 steps (the first steps move the table, the loss falls after ~10).
TEST(Runtime, GptReferenceLearnsTheSyntheticStream) {
  piper::runtime::TrainOptions o;
  o.steps = 30;
  o.adamw.lr = 1e-2f;
  o.print = false;
  const auto r = piper::runtime::train_reference(
      core::Program::from_json(
          json::parse(std::ifstream(compile_plan(temp_dir("gpt-learns"), strategy(1, 1, 1, 0, 2, "1f1b"), "", kGpt)))),
      o);
  EXPECT_LT(r.losses.back(), r.losses.front() - 0.5);
}

TEST(Runtime, ReferenceLearnsTheSyntheticStream) {
  const fs::path dir = temp_dir("reference");
  const fs::path plan = compile_plan(dir, strategy(1, 1, 1, 0, 2, "1f1b"));
  piper::runtime::TrainOptions o;
  o.steps = 12;
  o.print = false;
  const auto r = piper::runtime::train_reference(core::Program::from_json(json::parse(std::ifstream(plan))), o);
  // At initialisation logits have std ~1 (unit-RMS features, weights 1/sqrt(fan_in)): loss ~ ln(64) + 1/2.
  EXPECT_NEAR(r.losses.front(), std::log(64.0) + 0.5, 0.5);
  EXPECT_LT(r.losses.back(), r.losses.front() - 0.5);  // arithmetic sequences are learnable
}

// A nested split over part of the model leaves ops that stand for several microbatches at once
// (Op::microbatch -1): the plan simulates, and the runtime refuses it before any step, in one line.
TEST(RuntimeFailure, SplitNotCoveringTheModelIsRefusedInOneLine) {
  const fs::path dir = temp_dir("partial-split");
  core::Scenario s;
  s.model = kModel;
  s.strategy = strategy(2, 2, 2, 0, 4, "1f1b");
  json program = json::array();
  for (const auto& d : core::scenario_program(s).to_json()) {
    program.push_back(d);
    if (d.value("op", "") == "split")
      program.push_back({{"op", "split"}, {"filter", {{"PP", 0}}}, {"dim_name", "SUB"}, {"num_microbatches", 2}});
  }
  std::ofstream(dir / "program.json") << program.dump();
  const fs::path plan = compile_plan(dir, {}, (dir / "program.json").string());
  Result r = sh(std::string(PIPER_CLI) + " run --reference --plan " + plan.string() + " --steps 1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output,
            "piper: error: plan: op 'F mb0 PP1 s4' works on no single microbatch (a split that does not cover the "
            "whole model); "
            "the runtime runs every op of a pass on one microbatch\n");
}

// DualPipe runs the pipeline in both directions: device 0 holds the embedding for data-parallel rank
// 0 and the head for rank 1 (and device 1 the mirror), so each device would have to keep two tied
// pairs with two peers. The compiler refuses the layout (Scenario.TiedCopiesAreSummedByAPairAllReduce);
// a plan that has it anyway (here the untied model's plan, its spec marked tied and the head's segment
// without the head's weights, as a tied compile counts them, so that the plan still loads) is refused by
// the host backend before any step, in one line, exit code 2.
TEST(RuntimeFailure, GptTiedDualPipeIsRefusedInOneLine) {
  const fs::path dir = temp_dir("gpt-dualpipe");
  EXPECT_THROW(compile_plan(dir, strategy(2, 1, 1, 0, 4, "dualpipe"), "", kGpt), core::Error);
  json p = json::parse(std::ifstream(compile_plan(dir, strategy(2, 1, 1, 0, 4, "dualpipe"), "", kGptUntied)));
  p["model_spec"]["tie_embeddings"] = true;
  // The pair a tied compile would type (ProgramSegment::tied_to): the head's segment names the embedding's.
  int embed = -1, head = -1, last = -1;
  for (std::size_t s = 0; s < p["segments"].size(); ++s) {
    const auto& layers = p["segments"][s]["layers"];
    if (layers[0] == 0) embed = static_cast<int>(s);
    if (layers[1].get<int>() > last) last = layers[1].get<int>(), head = static_cast<int>(s);
  }
  ASSERT_TRUE(embed >= 0 && head >= 0 && embed != head);
  p["segments"][static_cast<std::size_t>(head)]["tied_to"] = embed;
  const auto head_weights =
      p["model_spec"]["vocab"].get<std::int64_t>() * p["model_spec"]["hidden"].get<std::int64_t>();
  auto& head_params = p["segments"][static_cast<std::size_t>(head)]["params"];
  head_params = head_params.get<std::int64_t>() - head_weights;
  const fs::path plan = dir / "tied.json";
  std::ofstream(plan) << p.dump();
  Result r = sh(mpirun(2) + PIPER_CLI + " run --plan " + plan.string() + " --steps 1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find("piper: error: plan: model 'runtime-tiny-gpt-untied' ties its head to the embedding, but "
                          "device 0 holds the embedding for "
                          "one data-parallel rank and the head for another (a mirrored, bidirectional placement)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(count_of(r.output, "piper: error"), 1u) << r.output;
  EXPECT_EQ(r.output.find("step "), std::string::npos) << r.output;
}

// Across devices the plan sums the tied copies (a "tied-embedding" ALL_REDUCE); a plan without it
// (from before the op existed, here one whose family was relabelled) is refused before any step.
TEST(RuntimeFailure, GptTiedPlanWithoutItsPairSumIsRefusedInOneLine) {
  const fs::path dir = temp_dir("gpt-no-tied-sum");
  const fs::path plan = compile_plan(dir, strategy(2, 2, 1, 0, 4, "1f1b"), "", kGpt);
  json p = json::parse(std::ifstream(plan));
  int relabelled = 0;
  for (auto& f : p["families"])
    if (f["purpose"] == "tied-embedding") f["purpose"] = "dp", ++relabelled;
  ASSERT_EQ(relabelled, 1);
  const fs::path old = dir / "old.json";
  std::ofstream(old) << p.dump();
  Result r = sh(mpirun(4) + PIPER_CLI + " run --plan " + old.string() + " --steps 1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(
      r.output.find(
          "piper: error: plan: model 'runtime-tiny-gpt' ties its head to the embedding, but device 0's plan holds 0 "
          "tied-embedding ALL_REDUCE ops, not 1 (a plan from an older piper: compile it again)"),
      std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("step "), std::string::npos) << r.output;
}

TEST(RuntimeCheckpoint, ResumeReproducesTheUninterruptedRun) {
  const fs::path dir = temp_dir("checkpoint");
  // ZeRO-2 reducing once per step: bit-identical runs need a fixed summation order, and per-microbatch
  // reductions sum each round's gradient as it arrives (what a round carries depends on when the next
  // backward ran; equal up to rounding, as the equivalence tests check).
  core::StrategyOptions o = strategy(2, 2, 2, 2, 4, "1f1b");
  o.reduce_every = "step";
  const fs::path plan = compile_plan(dir, o);
  const std::string run = mpirun(4) + PIPER_CLI + " run --plan " + plan.string() + " --seed 3";
  Result full =
      sh(run + " --steps 4 --report " + (dir / "full.json").string() + " --dump-params " + (dir / "full.bin").string());
  ASSERT_EQ(full.code, 0) << full.output;
  Result first = sh(run + " --steps 2 --save " + (dir / "ckpt").string());
  ASSERT_EQ(first.code, 0) << first.output;
  EXPECT_EQ(checkpoint_header(dir / "ckpt").at("step"), 2);
  Result rest = sh(run + " --steps 4 --resume " + (dir / "ckpt").string() + " --report " +
                   (dir / "rest.json").string() + " --dump-params " + (dir / "rest.bin").string());
  ASSERT_EQ(rest.code, 0) << rest.output;
  const auto a = losses_of(dir / "full.json"), b = losses_of(dir / "rest.json");
  ASSERT_EQ(a.size(), 4u);
  ASSERT_EQ(b.size(), 2u);
  // Same ranks, same plan, same data position: bit-identical arithmetic.
  EXPECT_EQ(b[0], a[2]);
  EXPECT_EQ(b[1], a[3]);
  EXPECT_EQ(piper::runtime::max_param_difference((dir / "full.bin").string(), (dir / "rest.bin").string()), 0.0);

  // A checkpoint of another model (wider hidden size) is refused before any step, with one line.
  json spec = json::parse(std::ifstream(kModel));
  spec["hidden"] = 48;
  std::ofstream(dir / "other.json") << spec.dump();
  core::Scenario other;
  other.model = (dir / "other.json").string();
  other.strategy = strategy(2, 2, 2, 2, 4, "1f1b");
  std::ofstream(dir / "other-plan.json") << core::compile_scenario(other).result.program.to_json().dump();
  Result bad = sh(mpirun(4) + PIPER_CLI + " run --plan " + (dir / "other-plan.json").string() + " --steps 3 --resume " +
                  (dir / "ckpt").string());
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("does not match the plan's model"), std::string::npos) << bad.output;
  EXPECT_EQ(bad.output.find("step "), std::string::npos) << bad.output;
  EXPECT_EQ(count_of(bad.output, "piper: error"), 1u) << bad.output;
}

// The checkpoint holds every layer's full parameters and AdamW moments, so a run saved under one
// layout continues under others: PP2 x DP2 x EP2 with ZeRO-2 (1F1B) -> PP2 DualPipeV (a V placement,
// no DP, no ZeRO) -> DP4 x EP2 with ZeRO-3 (no PP). Each layout takes 16 sequences per step
// (microbatches x DP x micro-batch size 2), so the token stream continues where it stopped; the
// losses and final parameters must match one uninterrupted single-process reference run.
TEST(RuntimeCheckpoint, ResumesUnderAnotherStrategy) {
  const Result a =
      expect_resume_chain("restrategy",
                          {Leg{strategy(2, 2, 2, 2, 4, "1f1b"), 4}, Leg{strategy(2, 1, 1, 0, 8, "dualpipev"), 2},
                           Leg{strategy(1, 4, 2, 3, 2, "1f1b"), 4}},
                          5, kModel, " --save-every 1");
  EXPECT_NE(a.output.find("checkpoint after step 1 -> "), std::string::npos) << a.output;
  EXPECT_EQ(checkpoint_header(temp_root() / "restrategy" / "state.ckpt").at("step"), 4);  // the second leg's
}

// The canonical checkpoint carries TP slices: TP2xDP2 (ZeRO-1) -> PP2 without TP -> TP2+SP x PP2.
TEST(RuntimeCheckpoint, ResumesAcrossTensorParallelLayouts) {
  expect_resume_chain(
      "restrategy-tp",
      {Leg{megatron(strategy(1, 2, 1, 1, 4, "1f1b"), 2, false, "none"), 4}, Leg{strategy(2, 1, 1, 0, 8, "1f1b"), 2},
       Leg{megatron(strategy(2, 1, 1, 0, 8, "1f1b"), 2, true, "full"), 4}},
      5, kDense);
}

// Expert-TP slices are checkpointed in the canonical layout: TP2+SP x DP2 x EP2 x ETP2 (ZeRO-1) -> PP2
// -> DP2 x ETP2, against one uninterrupted reference run.
TEST(RuntimeCheckpoint, ResumesAcrossExpertTensorParallelLayouts) {
  expect_resume_chain("restrategy-etp",
                      {Leg{with_etp(megatron(strategy(1, 2, 2, 1, 4, "1f1b"), 2, true, "none"), 2), 4},
                       Leg{strategy(2, 1, 1, 0, 8, "1f1b"), 2}, Leg{with_etp(strategy(1, 2, 1, 0, 4, "1f1b"), 2), 2}},
                      5);
}

// HSDP checkpoints hold each shard once in canonical form: HSDP ZeRO-2 over groups of 2 -> plain
// ZeRO-3 over DP4 -> HSDP ZeRO-3 over groups of 2, against one uninterrupted reference run.
TEST(RuntimeCheckpoint, ResumesAcrossHybridShardingLayouts) {
  expect_resume_chain("restrategy-hsdp",
                      {Leg{hsdp(strategy(1, 4, 1, 2, 2, "1f1b"), 2), 4}, Leg{strategy(1, 4, 1, 3, 2, "1f1b"), 4},
                       Leg{hsdp(strategy(1, 4, 1, 3, 2, "1f1b"), 2), 4}},
                      11);
}

// A tied GPT model across layouts: PP2 x DP2 (embedding and head on different stages, ZeRO-1) ->
// TP2 x DP2 ZeRO-3 (one stage: the head uses the embedding itself) -> TP2+SP x PP2 (the copy again,
// loaded from the checkpoint's one embedding table), against one uninterrupted reference run.
TEST(RuntimeCheckpoint, GptTiedResumesAcrossLayouts) {
  expect_resume_chain(
      "restrategy-gpt",
      {Leg{strategy(2, 2, 1, 1, 4, "1f1b"), 4}, Leg{megatron(strategy(1, 2, 1, 3, 4, "1f1b"), 2, false, "none"), 4},
       Leg{megatron(strategy(2, 1, 1, 0, 8, "1f1b"), 2, true, "none"), 4}},
      13, kGpt);
}

// A crash between writing the new checkpoint and renaming it over the old one (the test hook exits
// there) leaves the previous checkpoint intact and loadable; resuming from it continues the run.
TEST(RuntimeCheckpoint, CrashBeforeRenameKeepsTheLastGoodCheckpoint) {
  const fs::path dir = temp_dir("crash");
  const fs::path plan = compile_plan(dir, strategy(2, 1, 1, 0, 4, "1f1b"));
  const std::string ckpt = (dir / "state.ckpt").string();
  const std::string flags = " run --plan " + plan.string() + std::string(kOptimizer) + " --seed 11";
  Result ref = sh(std::string(PIPER_CLI) + flags + " --reference --steps 4 --report " + (dir / "ref.json").string());
  ASSERT_EQ(ref.code, 0) << ref.output;
  Result crashed = sh("PIPER_TEST_CRASH_BEFORE_RENAME=3 " + mpirun(2) + PIPER_CLI + flags +
                      " --steps 4 --save-every 1 --save " + ckpt);
  EXPECT_NE(crashed.code, 0) << crashed.output;
  EXPECT_NE(crashed.output.find("test hook: exiting after writing"), std::string::npos) << crashed.output;
  EXPECT_EQ(crashed.output.find("step    4"), std::string::npos) << crashed.output;
  // The step-3 file was written and synced but never renamed: it lies beside the good one.
  bool temp_left = false;
  for (const auto& e : fs::directory_iterator(dir))
    temp_left |= e.path().filename().string().rfind("state.ckpt.tmp.", 0) == 0;
  EXPECT_TRUE(temp_left);
  EXPECT_EQ(checkpoint_header(ckpt).at("step"), 2);
  Result resumed = sh(mpirun(2) + PIPER_CLI + flags + " --steps 4 --resume " + ckpt + " --report " +
                      (dir / "resumed.json").string());
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  const auto want = losses_of(dir / "ref.json"), got = losses_of(dir / "resumed.json");
  ASSERT_EQ(want.size(), 4u);
  ASSERT_EQ(got.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i)
    EXPECT_NEAR(got[i], want[i + 2], kLossRelTol * std::abs(want[i + 2])) << "step " << i + 3;
}

// The single-process reference saves and resumes through the same canonical file: 1 + 2 steps give
// bit-identical losses to 3 uninterrupted steps (same arithmetic, same order).
TEST(RuntimeCheckpoint, ReferenceResumesBitIdentically) {
  const fs::path dir = temp_dir("reference-resume");
  const core::Program program =
      core::Program::from_json(json::parse(std::ifstream(compile_plan(dir, strategy(2, 2, 1, 1, 2, "1f1b")))));
  piper::runtime::TrainOptions o;
  o.steps = 3;
  o.print = false;
  const auto full = piper::runtime::train_reference(program, o);
  o.steps = 1;
  o.save_path = (dir / "state.ckpt").string();
  const auto first = piper::runtime::train_reference(program, o);
  o.steps = 3;
  o.save_path.clear();
  o.resume_path = (dir / "state.ckpt").string();
  const auto rest = piper::runtime::train_reference(program, o);
  ASSERT_EQ(full.losses.size(), 3u);
  ASSERT_EQ(first.losses.size(), 1u);
  ASSERT_EQ(rest.losses.size(), 2u);
  EXPECT_EQ(rest.first_step, 1);
  EXPECT_EQ(first.losses[0], full.losses[0]);
  EXPECT_EQ(rest.losses[0], full.losses[1]);
  EXPECT_EQ(rest.losses[1], full.losses[2]);
}

// Resuming needs the same model and the same sequences per step; anything else is one line.
TEST(RuntimeCheckpoint, IncompatibleCheckpointsAreRefusedWithOneLine) {
  const fs::path dir = temp_dir("incompatible");
  const core::Program program = core::Program::from_json(
      json::parse(std::ifstream(compile_plan(temp_dir("incompatible/a"), strategy(1, 1, 1, 0, 2, "1f1b")))));
  piper::runtime::TrainOptions o;
  o.steps = 1;
  o.print = false;
  o.save_path = (dir / "state.ckpt").string();
  piper::runtime::train_reference(program, o);
  const core::Program more = core::Program::from_json(
      json::parse(std::ifstream(compile_plan(temp_dir("incompatible/b"), strategy(1, 1, 1, 0, 3, "1f1b")))));
  piper::runtime::TrainOptions r;
  r.steps = 2;
  r.print = false;
  r.resume_path = o.save_path;
  try {
    piper::runtime::train_reference(more, r);
    FAIL() << "resumed with another global batch";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint took 4 sequences per step, the plan takes 6"), std::string::npos)
        << e.what();
  }
  // A truncated file (as a crash without the atomic rename would leave) is named as damaged.
  const std::string bytes = [&] {
    std::ifstream in(o.save_path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  std::ofstream(dir / "cut.ckpt", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  r.resume_path = (dir / "cut.ckpt").string();
  try {
    piper::runtime::train_reference(program, r);
    FAIL() << "resumed from a truncated checkpoint";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cut.ckpt: damaged checkpoint"), std::string::npos) << e.what();
  }
}

// read_param_dump reads any file it is given: hostile fields are refused in one line naming the
// file, record and byte, never written before or past the layer's vector (issue 24).
TEST(RuntimeDump, HostileParameterDumpsAreRefused) {
  const fs::path dir = temp_dir("hostile-dump");
  auto record = [](std::int32_t layer, std::int64_t offset, std::int64_t count, int floats) {
    std::string r(reinterpret_cast<const char*>(&layer), 4);
    r.append(reinterpret_cast<const char*>(&offset), 8);
    r.append(reinterpret_cast<const char*>(&count), 8);
    r.append(static_cast<std::size_t>(floats) * 4, '\0');
    return r;
  };
  auto dump = [&](const std::string& name, const std::string& records) {
    const fs::path p = dir / name;
    std::ofstream(p, std::ios::binary) << std::string("PIPERPRM") + records;
    return p.string();
  };
  auto refusal = [](const std::string& path) {
    try {
      (void)piper::runtime::read_param_dump(path);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(read)");
  };
  // A good file reads back.
  const std::string good = dump("good.bin", record(0, 0, 2, 2) + record(0, 2, 1, 1) + record(3, 0, 1, 1));
  const auto read = piper::runtime::read_param_dump(good);
  ASSERT_EQ(read.size(), 2u);
  EXPECT_EQ(read.at(0).size(), 3u);
  const std::string neg = dump("neg.bin", record(0, 0, 2, 2) + record(0, -4, 1, 1));
  EXPECT_EQ(refusal(neg), neg + ": damaged parameter dump: record 1 (byte 36): negative offset -4");
  const std::string far = dump("far.bin", record(0, 1LL << 40, 1, 1));
  EXPECT_EQ(refusal(far), far +
                              ": damaged parameter dump: record 0 (byte 8): offset 1099511627776 + count 1 runs past "
                              "the 6 floats the file holds");
  const std::string count = dump("count.bin", record(0, 0, -1, 0));
  EXPECT_EQ(refusal(count), count + ": damaged parameter dump: record 0 (byte 8): negative count -1");
  const std::string huge = dump("huge.bin", record(0, 0, 1LL << 61, 1));
  EXPECT_EQ(refusal(huge),
            huge + ": damaged parameter dump: record 0 (byte 8): 2305843009213693952 floats announced, 4 bytes left");
  const std::string layer = dump("layer.bin", record(-1, 0, 1, 1));
  EXPECT_EQ(refusal(layer), layer + ": damaged parameter dump: record 0 (byte 8): negative layer -1");
  const std::string cut = dump("cut.bin", record(0, 0, 1, 1).substr(0, 10));
  EXPECT_EQ(refusal(cut), cut + ": damaged parameter dump: record 0 (byte 8): truncated header");
  const std::string magic = (dir / "magic.bin").string();
  std::ofstream(magic, std::ios::binary) << "NOTADUMP";
  EXPECT_EQ(refusal(magic), magic + ": not a parameter dump");
}

// A rank that fails mid-step (here: its RECV waits for a transfer its peer never sends, so both
// stall past --stall-timeout) ends every rank with exit code 4, a runtime peer failure (issue 24).
TEST(RuntimeFailure, PeerStallMidStepExitsFour) {
  const fs::path dir = temp_dir("stall");
  const fs::path plan = compile_plan(dir, strategy(2, 1, 1, 0, 2, "1f1b"));
  json p = json::parse(std::ifstream(plan));
  int changed = 0;
  for (auto& stream : p["plans"][p["plan_of_device"][1].get<int>()]["streams"])
    for (auto& op : stream["ops"])
      if (op["kind"] == "RECV" && changed == 0) op["pair"] = 99999, ++changed;  // an id its peer never sends
  ASSERT_EQ(changed, 1);
  const fs::path bad = dir / "mismatched.json";
  std::ofstream(bad) << p.dump();
  Result r = sh(mpirun(2) + PIPER_CLI + " run --plan " + bad.string() + " --steps 1 --stall-timeout 2");
  EXPECT_EQ(r.code, 4) << r.output;
  EXPECT_NE(r.output.find("piper: error: rank "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
}

TEST(RuntimeFailure, WrongRankCountIsOneLineBeforeAnything) {
  const fs::path dir = temp_dir("ranks");
  const fs::path plan = compile_plan(dir, strategy(2, 2, 1, 0, 2, "1f1b"));
  Result r = sh(mpirun(3) + PIPER_CLI + " run --plan " + plan.string() + " --steps 2");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("piper: error: the plan has 4 devices but 3 MPI ranks were started"), std::string::npos)
      << r.output;
  std::size_t count = 0;
  for (std::size_t at = r.output.find("piper: error"); at != std::string::npos;
       at = r.output.find("piper: error", at + 1))
    ++count;
  EXPECT_EQ(count, 1u) << r.output;
}

TEST(RuntimeFailure, KilledRankEndsEveryRankWithin30s) {
  const fs::path dir = temp_dir("kill");
  const fs::path plan = compile_plan(dir, strategy(2, 2, 1, 0, 4, "1f1b"));
  const fs::path log = dir / "log.txt";
  const std::string cmd =
      mpirun(4) + PIPER_CLI + " run --plan " + plan.string() + " --steps 1000000 > " + log.string() + " 2>&1";
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    setpgid(0, 0);
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait until training runs, then SIGKILL one rank: a `piper` process descending from our launcher.
  auto parent_of = [](pid_t pid, std::string* comm) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos) return pid_t{0};
    if (comm) *comm = line.substr(line.find('(') + 1, close - line.find('(') - 1);
    return static_cast<pid_t>(std::atoi(line.c_str() + close + 4));  // ") S <ppid>"
  };
  auto ranks = [&] {
    std::vector<pid_t> out;
    for (const auto& e : fs::directory_iterator("/proc")) {
      const std::string name = e.path().filename();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::string comm;
      pid_t p = parent_of(std::stoi(name), &comm);
      if (comm != "piper") continue;
      for (int depth = 0; p > 1 && depth < 8; ++depth, p = parent_of(p, nullptr))
        if (p == launcher) {
          out.push_back(std::stoi(name));
          break;
        }
    }
    return out;
  };
  const auto t0 = std::chrono::steady_clock::now();
  auto since = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  std::string text;
  while (since() < 60 && text.find("step    2") == std::string::npos) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::ifstream in(log);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto alive = ranks();
  ASSERT_EQ(alive.size(), 4u) << text;
  kill(*std::max_element(alive.begin(), alive.end()), SIGKILL);
  const auto killed_at = since();
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(launcher, &status, WNOHANG)) == 0 && since() - killed_at < 30)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  if (done == 0) kill(-launcher, SIGKILL), waitpid(launcher, &status, 0);
  EXPECT_NE(done, 0) << "mpirun still running 30 s after a rank was killed";
  EXPECT_TRUE(ranks().empty());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0);
  std::ifstream in(log);
  text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("signal 9"), std::string::npos) << text;  // mpirun names the dead rank and its signal
}
