// Runtime end to end: compiled plans run over mpirun (one rank per device) and must match the
// single-process reference; checkpoints resume exactly; failures end every rank with one clear error.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "shell.hpp"
#include <nlohmann/json.hpp>

#include "piper/core/scenario.hpp"
#include "piper/runtime/host_model.hpp"
#include "piper/runtime/trainer.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
namespace core = piper::core;

namespace {

const std::string kModel = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json";
// Tensor parallelism runs on dense models (routed experts keep expert parallelism).
const std::string kDense = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-dense.json";
// GPT-style: LayerNorm, GELU, biases, learned positions; tied head (kGpt) or its own (kGptUntied).
const std::string kGpt = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-gpt.json";
const std::string kGptUntied = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-gpt-untied.json";

// Tolerances. Losses: fp32 sums in another order (per-microbatch, per-rank partial sums, MPI
// reductions) differ by ~1e-7 relative, so 1e-5 leaves two orders of margin. Parameters after 3
// AdamW steps: Adam divides each gradient by its own RMS, so with the usual eps = 1e-8 an element
// whose gradient is at rounding level (~1e-9) moves by a random fraction of lr per step (seen: 1.1e-4
// at lr 1e-3). With eps = 1e-6 a gradient rounding difference dg moves a parameter by at most
// steps * lr * dg / eps ~ 3 * 3e-3 * 1e-10 / 1e-6 ~ 1e-6 (seen: 2e-6 worst), while a wrong gradient
// still moves it by O(lr) per step, far above the 1e-4 bound.
constexpr double kLossRelTol = 1e-5;
constexpr double kParamAbsTol = 1e-4;
constexpr const char* kOptimizer = " --lr 3e-3 --adam-eps 1e-6";

using piper::test::mpirun;
using piper::test::Result;
using piper::test::sh;

fs::path temp_root() { return fs::temp_directory_path() / ("piper-runtime-test-" + std::to_string(getpid())); }

// Removes this process's scratch folder (plans, reports, dumps, checkpoints) after the last test.
struct ScratchCleanup : ::testing::Environment {
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(temp_root(), ec);
  }
};
[[maybe_unused]] ::testing::Environment* const kCleanup = ::testing::AddGlobalTestEnvironment(new ScratchCleanup);

fs::path temp_dir(const std::string& name) {
  fs::path d = temp_root() / name;
  fs::create_directories(d);
  return d;
}

// Compiles the tiny model with strategy knobs (or a published directive program) and writes the plan.
fs::path compile_plan(const fs::path& dir, const core::StrategyOptions& strategy,
                      const std::string& directives_file = "", const std::string& model = kModel,
                      const std::function<void(core::Scenario&)>& edit = {}) {
  core::Scenario s;
  s.model = model;
  s.strategy = strategy;
  if (edit) edit(s);
  if (!directives_file.empty()) {
    std::ifstream in(directives_file);
    s.directives = json::parse(in);
    s.directives_source = directives_file;
  }
  const auto compiled = core::compile_scenario(s);
  fs::path plan = dir / "plan.json";
  std::ofstream(plan) << compiled.result.program.to_json().dump();
  return plan;
}

// The JSON header line of a checkpoint file.
json checkpoint_header(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::string line;
  std::getline(in, line);
  return json::parse(line);
}

std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t count = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++count;
  return count;
}

std::vector<double> losses_of(const fs::path& report) {
  std::ifstream in(report);
  return json::parse(in).at("losses").get<std::vector<double>>();
}

// Runs the plan distributed and as the reference for `steps`, and checks losses and parameters.
void expect_equivalent(const std::string& name, int ranks, const core::StrategyOptions& strategy,
                       const std::string& directives = "", const std::string& model = kModel,
                       const std::function<void(core::Scenario&)>& edit = {}) {
  const fs::path dir = temp_dir(name);
  const fs::path plan = compile_plan(dir, strategy, directives, model, edit);
  const std::string common = " run --plan " + plan.string() + " --steps 3" + kOptimizer + " --seed 7";
  Result ref = sh(std::string(PIPER_CLI) + common + " --reference --report " + (dir / "ref.json").string() +
                  " --dump-params " + (dir / "ref.bin").string());
  ASSERT_EQ(ref.code, 0) << ref.output;
  // The same plan as MPI ranks and as virtual devices (threads of one process, loopback transport):
  // one training loop and dataflow, two rank groups and transports.
  for (const std::string launch : {"mpi", "virtual"}) {
    const std::string prefix = launch == "mpi" ? mpirun(ranks) + PIPER_CLI : std::string(PIPER_CLI);
    const std::string flags = launch == "mpi" ? "" : " --virtual-devices";
    Result run = sh(prefix + common + flags + " --report " + (dir / (launch + ".json")).string() + " --dump-params " +
                    (dir / (launch + ".bin")).string());
    ASSERT_EQ(run.code, 0) << launch << ": " << run.output;
    const auto a = losses_of(dir / "ref.json"), b = losses_of(dir / (launch + ".json"));
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(b.size(), 3u);
    for (std::size_t i = 0; i < a.size(); ++i)
      EXPECT_NEAR(b[i], a[i], kLossRelTol * std::abs(a[i])) << name << " (" << launch << ") step " << i + 1;
    EXPECT_LT(piper::runtime::max_param_difference((dir / "ref.bin").string(), (dir / (launch + ".bin")).string()),
              kParamAbsTol)
        << name << " (" << launch << ")";
    // Gradient clipping: the global norm each launch all-reduced is the reference model's norm.
    const json ra = json::parse(std::ifstream(dir / "ref.json"));
    const json rb = json::parse(std::ifstream(dir / (launch + ".json")));
    ASSERT_EQ(ra.contains("grad_norms"), rb.contains("grad_norms")) << name << " (" << launch << ")";
    if (!ra.contains("grad_norms")) continue;
    const auto na = ra["grad_norms"].get<std::vector<double>>(), nb = rb["grad_norms"].get<std::vector<double>>();
    ASSERT_EQ(na.size(), nb.size());
    for (std::size_t i = 0; i < na.size(); ++i)
      EXPECT_NEAR(nb[i], na[i], kLossRelTol * na[i]) << name << " (" << launch << ") grad norm of step " << i + 1;
  }
}

// Gradient clipping by global norm (clip_grad): a max norm of 0.05 clips every step of these runs
// (their norms are 0.4-1.8), so a wrong owned-gradient rule (a replica, TP rank, ZeRO shard group or
// tied copy counted twice or not at all) shows in the all-reduced norm, which expect_equivalent
// compares with the reference model's.
core::StrategyOptions clipped(core::StrategyOptions o) {
  o.clip_grad = 0.05;
  return o;
}

// Rewrites every tag filter of a directive program (objects with an "MB" key) with `filter`, and
// replaces its split directive by `splits`.
json rewrite_microbatches(const json& j, const std::function<void(json&)>& filter, const json& splits) {
  if (j.is_array()) {
    json out = json::array();
    for (const auto& e : j) {
      if (e.is_object() && e.value("op", "") == "split") {
        for (const auto& s : splits) out.push_back(s);
        continue;
      }
      out.push_back(rewrite_microbatches(e, filter, splits));
    }
    return out;
  }
  if (!j.is_object()) return j;
  json out = json::object();
  for (auto it = j.begin(); it != j.end(); ++it) out[it.key()] = rewrite_microbatches(it.value(), filter, splits);
  if (out.contains("MB")) filter(out);
  return out;
}

// The directive program the strategy generator emits for `o` on `model`, rewritten as above and
// written to dir/program.json (the file expect_equivalent compiles).
std::string rewritten_program(const std::string& name, const core::StrategyOptions& o,
                              const std::function<void(json&)>& filter, const json& splits,
                              const std::string& model = kModel) {
  core::Scenario s;
  s.model = model;
  s.strategy = o;
  const json program = rewrite_microbatches(core::scenario_program(s).to_json(), filter, splits);
  const fs::path file = temp_dir(name + "-program") / "program.json";
  std::ofstream(file) << program.dump(1);
  return file.string();
}

json split_directive(const std::string& dim, int count) {
  return {{"op", "split"}, {"filter", json::object()}, {"dim_name", dim}, {"num_microbatches", count}};
}

core::StrategyOptions strategy(int pp, int dp, int ep, int zero, int microbatches, const std::string& schedule,
                               int virtual_stages = 1, double bucket_mb = 0) {
  core::StrategyOptions o;
  o.pp = pp, o.dp = dp, o.ep = ep, o.zero = zero, o.microbatches = microbatches, o.schedule = schedule;
  o.virtual_stages = virtual_stages, o.bucket_mb = bucket_mb;
  return o;
}

// Megatron-style knobs on top of a strategy.
core::StrategyOptions megatron(core::StrategyOptions o, int tp, bool sequence_parallel, const std::string& recompute) {
  o.tp = tp, o.sequence_parallel = sequence_parallel, o.recompute = recompute;
  return o;
}

// Context parallelism on top of a strategy (all-gather variant or the ring).
core::StrategyOptions context_parallel(core::StrategyOptions o, int cp, bool all_gather = false) {
  o.cp = cp, o.cp_all_gather = all_gather;
  return o;
}

// Expert tensor parallelism on top of a strategy.
core::StrategyOptions with_etp(core::StrategyOptions o, int etp) {
  o.etp = etp;
  return o;
}

// HSDP on top of a strategy: ZeRO shards over groups of k data-parallel replicas.
core::StrategyOptions hsdp(core::StrategyOptions o, int k) {
  o.dp_shard = k;
  return o;
}

// One layout of a resume chain: its strategy and its MPI rank count.
struct Leg {
  core::StrategyOptions strategy;
  int ranks = 1;
};

// Trains steps 1-2 under legs[0] (saving a checkpoint), 3-4 under legs[1] and 5-6 under legs[2], each
// resuming the last checkpoint, and checks the six losses and the final parameters against one
// uninterrupted single-process reference run. `first_flags` go to the first leg only; its result is
// returned for further checks.
Result expect_resume_chain(const std::string& name, const std::array<Leg, 3>& legs, int seed,
                           const std::string& model = kModel, const std::string& first_flags = "") {
  const fs::path dir = temp_dir(name);
  std::array<fs::path, 3> plans;
  for (std::size_t i = 0; i < legs.size(); ++i)
    plans[i] =
        compile_plan(temp_dir(name + "/" + std::string(1, static_cast<char>('a' + i))), legs[i].strategy, "", model);
  const std::string flags = std::string(kOptimizer) + " --seed " + std::to_string(seed);
  const std::string ckpt = (dir / "state.ckpt").string();
  Result ref =
      sh(std::string(PIPER_CLI) + " run --reference --plan " + plans[0].string() + flags + " --steps 6 --report " +
         (dir / "ref.json").string() + " --dump-params " + (dir / "ref.bin").string());
  EXPECT_EQ(ref.code, 0) << ref.output;
  Result first;
  std::vector<double> got;
  for (std::size_t i = 0; i < legs.size(); ++i) {
    const fs::path report = dir / (std::string(1, static_cast<char>('a' + i)) + ".json");
    std::string cmd = mpirun(legs[i].ranks) + PIPER_CLI + " run --plan " + plans[i].string() + flags + " --steps " +
                      std::to_string(2 * (i + 1)) + " --report " + report.string();
    if (i > 0) cmd += " --resume " + ckpt;
    if (i + 1 < legs.size())
      cmd += " --save " + ckpt;
    else
      cmd += " --dump-params " + (dir / "last.bin").string();
    if (i == 0) cmd += first_flags;
    Result r = sh(cmd);
    EXPECT_EQ(r.code, 0) << name << " leg " << i << ": " << r.output;
    if (r.code != 0) return r;
    if (i == 0) first = r;
    for (double l : losses_of(report)) got.push_back(l);
  }
  const auto want = losses_of(dir / "ref.json");
  EXPECT_EQ(want.size(), 6u);
  EXPECT_EQ(got.size(), 6u);
  for (std::size_t i = 0; i < std::min(want.size(), got.size()); ++i)
    EXPECT_NEAR(got[i], want[i], kLossRelTol * std::abs(want[i])) << name << " step " << i + 1;
  EXPECT_LT(piper::runtime::max_param_difference((dir / "ref.bin").string(), (dir / "last.bin").string()), kParamAbsTol)
      << name;
  return first;
}

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

TEST(RuntimeEquivalence, OneFOneB_PP2xDP2) { expect_equivalent("1f1b", 4, strategy(2, 2, 1, 0, 4, "1f1b")); }
TEST(RuntimeEquivalence, GPipe_PP4) { expect_equivalent("gpipe", 4, strategy(4, 1, 1, 0, 4, "gpipe")); }
// Synchronous pipeline transfers (place "blocking", DeepSpeed's engine) change when ops run, not what they compute.
TEST(RuntimeEquivalence, OneFOneB_PP2xDP2_BlockingTransfers) {
  core::StrategyOptions o = strategy(2, 2, 1, 0, 4, "1f1b");
  o.p2p_blocking = true;
  expect_equivalent("blocking", 4, o);
}
TEST(RuntimeEquivalence, OneFOneB_PP2xDP2xEP2_Zero2) { expect_equivalent("zero2", 4, strategy(2, 2, 2, 2, 4, "1f1b")); }
TEST(RuntimeEquivalence, OneFOneB_PP2xDP2xEP2_Zero3) { expect_equivalent("zero3", 4, strategy(2, 2, 2, 3, 4, "1f1b")); }
TEST(RuntimeEquivalence, BucketedDP2) { expect_equivalent("bucket", 2, strategy(1, 2, 1, 0, 2, "1f1b", 1, 0.05)); }
TEST(RuntimeEquivalence, Interleaved1F1B_PP2x2Chunks) {
  expect_equivalent("interleaved", 2, strategy(2, 1, 1, 0, 4, "interleaved-1f1b", 2));
}
TEST(RuntimeEquivalence, ZBH1_PP2) { expect_equivalent("zbh1", 2, strategy(2, 1, 1, 0, 4, "zb-h1")); }
// The automatic zero-bubble scheduler (ZB-1p, ZB-2p): orders that no hand-made family emits.
TEST(RuntimeEquivalence, ZBAuto1p_PP2) { expect_equivalent("zbauto1p", 2, strategy(2, 1, 1, 0, 4, "zb-auto")); }
TEST(RuntimeEquivalence, ZBAuto2p_PP4) {
  core::StrategyOptions o = strategy(4, 1, 1, 0, 8, "zb-auto");
  o.zb_memory_limit = "2p";
  expect_equivalent("zbauto2p", 4, o);
}
TEST(RuntimeEquivalence, DualPipeV_PP2xDP2xEP2) {
  expect_equivalent("dualpipev", 4, strategy(2, 2, 2, 0, 4, "dualpipev"));
}
TEST(RuntimeEquivalence, ZBV_PP2) { expect_equivalent("zbv", 2, strategy(2, 1, 1, 0, 4, "zb-v")); }
// The embedding and the head as regions of their own (--v-embedding, --v-head): the head's rank gets
// the last V block's output and sends back its gradient; the embedding's feeds the V's first block.
TEST(RuntimeEquivalence, ZBV_PP2_HeadAndEmbeddingRegionsOnRank1) {
  core::StrategyOptions o = strategy(2, 1, 1, 0, 4, "zb-v");
  o.v_head = "1";
  o.v_embedding = "1";
  expect_equivalent("zbv-ends", 2, o);
}
// The head alone on the last rank, the V over the other two (4 blocks in 4 regions).
TEST(RuntimeEquivalence, DualPipeV_PP3_HeadAlone) {
  core::StrategyOptions o = strategy(3, 1, 1, 0, 4, "dualpipev");
  o.v_head = "alone";
  expect_equivalent("dualpipev-alone", 3, o);
}
TEST(RuntimeEquivalence, DualPipeV_PP2xDP2xEP2_HeadRegionOnRank1) {
  core::StrategyOptions o = strategy(2, 2, 2, 0, 4, "dualpipev");
  o.v_head = "1";
  expect_equivalent("dualpipev-head", 4, o);
}
// Two mirrored model copies: each device runs different data-parallel ranks in different segments.
TEST(RuntimeEquivalence, DualPipe_PP2) { expect_equivalent("dualpipe", 2, strategy(2, 1, 1, 0, 4, "dualpipe")); }
TEST(RuntimeEquivalence, ClipGrad_DualPipe_PP2) {
  expect_equivalent("clip-dualpipe", 2, clipped(strategy(2, 1, 1, 0, 4, "dualpipe")));
}
TEST(RuntimeEquivalence, ClipGrad_PP2xDP2xEP2_Zero2) {
  expect_equivalent("clip-zero2-ep", 4, clipped(strategy(2, 2, 2, 2, 4, "1f1b")));
}
TEST(RuntimeEquivalence, PublishedFixtureV_PP4xDP2xEP2) {
  expect_equivalent("fixture-v", 4, {}, std::string(PIPER_FIXTURES) + "/piper-directives/pp4_dp2_ep2_v_placement.json");
}

// The microbatch of every op is Op::microbatch, whatever the split's dimension is called (issue 24:
// the runtime read the tag "MB" and ran every microbatch of another dimension on microbatch 0's data).
TEST(RuntimeEquivalence, CustomSplitDimension_1F1B_PP2xDP2xEP2) {
  const auto o = strategy(2, 2, 2, 0, 4, "1f1b");
  const std::string program = rewritten_program(
      "custom-dim", o,
      [](json& f) {
        f["SAMPLE"] = f["MB"];
        f.erase("MB");
      },
      json::array({split_directive("SAMPLE", 4)}));
  expect_equivalent("custom-dim", 4, {}, program);
}

// Nested splits (2 x 2 microbatches): filter {MB: k} becomes {outer: k / 2, inner: k % 2}, and
// the flat index outer * 2 + inner must run on microbatch k's data. Zero-bubble orders also split B
// into BI and BW per microbatch.
namespace {
std::function<void(json&)> nest(const std::string& outer, const std::string& inner) {
  return [=](json& f) {
    const json mb = f["MB"];
    f.erase("MB");
    if (mb.is_number_integer()) {
      f[outer] = mb.get<int>() / 2;
      f[inner] = mb.get<int>() % 2;
    } else {
      f[outer] = mb, f[inner] = mb;
    }
  };
}
}  // namespace
TEST(RuntimeEquivalence, NestedSplits_ZBH1_PP2) {
  const std::string program =
      rewritten_program("nested", strategy(2, 1, 1, 0, 4, "zb-h1"), nest("OUTER", "INNER"),
                        json::array({split_directive("OUTER", 2), split_directive("INNER", 2)}));
  expect_equivalent("nested", 2, {}, program);
}
TEST(RuntimeEquivalence, NestedSplits_1F1B_PP2xDP2) {
  const std::string program = rewritten_program("nested-dp", strategy(2, 2, 1, 0, 4, "1f1b"), nest("DATA", "ACC"),
                                                json::array({split_directive("DATA", 2), split_directive("ACC", 2)}));
  expect_equivalent("nested-dp", 4, {}, program);
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

// Tensor and sequence parallelism, recomputation (issue 10): TP collectives run inside the compute ops
// over MPI; every composition must still match the single-process reference.
TEST(RuntimeEquivalence, TP2xPP2xDP2_1F1B) {
  expect_equivalent("tp2pp2dp2", 8, megatron(strategy(2, 2, 1, 0, 4, "1f1b"), 2, false, "none"), "", kDense);
}
TEST(RuntimeEquivalence, TP2_SP_PP2_1F1B) {
  expect_equivalent("tp2sp-1f1b", 4, megatron(strategy(2, 1, 1, 0, 4, "1f1b"), 2, true, "none"), "", kDense);
}
TEST(RuntimeEquivalence, TP2_SP_PP2_Interleaved_FullRecompute) {
  expect_equivalent("tp2sp-interleaved", 4, megatron(strategy(2, 1, 1, 0, 4, "interleaved-1f1b", 2), 2, true, "full"),
                    "", kDense);
}
TEST(RuntimeEquivalence, TP2xDP2_Zero3) {
  expect_equivalent("tp2-zero3", 4, megatron(strategy(1, 2, 1, 3, 2, "1f1b"), 2, false, "none"), "", kDense);
}
// BI/BW split: the recomputation runs at the start of BI, BW uses what it rebuilt.
TEST(RuntimeEquivalence, TP2_PP2_ZBH1_SelectiveRecompute) {
  expect_equivalent("tp2-zbh1-selective", 4, megatron(strategy(2, 1, 1, 0, 4, "zb-h1"), 2, false, "selective"), "",
                    kDense);
}
// Context parallelism (issue 26): each CP rank holds two load-balanced causal chunks of every sequence,
// attention gathers K/V over the CP group with the causal mask by global position and returns dK/dV
// to their owners, and the gradients are reduced over DP x CP; the loss and parameters must match the
// single-process reference. (The ring and the all-gather variant compute the same sums.)
TEST(RuntimeEquivalence, CP2_Ring) {
  expect_equivalent("cp2", 2, context_parallel(strategy(1, 1, 1, 0, 2, "1f1b"), 2), "", kDense);
}
TEST(RuntimeEquivalence, CP4_AllGather_SelectiveRecompute) {
  expect_equivalent("cp4-ag", 4,
                    megatron(context_parallel(strategy(1, 1, 1, 0, 2, "1f1b"), 4, true), 1, false, "selective"), "",
                    kDense);
}
TEST(RuntimeEquivalence, CP2xPP2_1F1B) {
  expect_equivalent("cp2pp2", 4, context_parallel(strategy(2, 1, 1, 0, 4, "1f1b"), 2), "", kDense);
}
TEST(RuntimeEquivalence, CP2xDP2_Zero1) {
  expect_equivalent("cp2dp2-zero1", 4, context_parallel(strategy(1, 2, 1, 1, 2, "1f1b"), 2), "", kDense);
}
TEST(RuntimeEquivalence, ClipGrad_CP2xDP2_Zero1) {
  expect_equivalent("clip-cp2dp2", 4, clipped(context_parallel(strategy(1, 2, 1, 1, 2, "1f1b"), 2)), "", kDense);
}
// EP groups across DP x CP (Megatron-core's layout, issue 26): each CP rank routes its own load-balanced
// chunks of the sequence to the experts of its EP group (CP 2 x EP 2: the CP pair is the EP group; with
// DP 2 x CP 2 x EP 2 the experts' gradients are reduced over the two replicas holding the same experts).
TEST(RuntimeEquivalence, CP2xEP2_MoE) {
  expect_equivalent("cp2-ep2", 2, context_parallel(strategy(1, 1, 2, 0, 2, "1f1b"), 2));
}
TEST(RuntimeEquivalence, DP2xCP2xEP2_MoE) {
  expect_equivalent("dp2cp2-ep2", 4, context_parallel(strategy(1, 2, 2, 0, 2, "1f1b"), 2));
}
TEST(RuntimeEquivalence, TP2xCP2_SP) {
  expect_equivalent("tp2cp2", 4, megatron(context_parallel(strategy(1, 1, 1, 0, 2, "1f1b"), 2), 2, true, "none"), "",
                    kDense);
}

// MoE: routed experts keep EP beside the TP segments. Without SP both TP ranks route the same tokens
// (the experts' gradients are divided by the copies); with SP each routes its sequence slice.
TEST(RuntimeEquivalence, TP2xDP2xEP2_MoE) {
  expect_equivalent("tp2-ep2", 4, megatron(strategy(1, 2, 2, 0, 2, "1f1b"), 2, false, "none"));
}
TEST(RuntimeEquivalence, TP2_SP_DP2xEP2_MoE) {
  expect_equivalent("tp2sp-ep2", 4, megatron(strategy(1, 2, 2, 0, 2, "1f1b"), 2, true, "none"));
}
// EP groups formed over DP x TP (Megatron-core's rule, issue 26): EP 2 over the two TP ranks of one
// replica, and whole experts on both TP ranks, their gradients reduced over the pair (with SP the
// ranks route different tokens; without it the same ones, divided by the copies).
TEST(RuntimeEquivalence, TP2_SP_EP2_MoE_EpOverTheTpGroup) {
  expect_equivalent("tp2sp-ep2-dp1", 2, megatron(strategy(1, 1, 2, 0, 2, "1f1b"), 2, true, "none"));
}
TEST(RuntimeEquivalence, TP2_SP_MoE_ExpertsOnBothTpRanks) {
  expect_equivalent("tp2sp-ep1", 2, megatron(strategy(1, 1, 1, 0, 2, "1f1b"), 2, true, "none"));
}
TEST(RuntimeEquivalence, TP2_MoE_ExpertsOnBothTpRanks) {
  expect_equivalent("tp2-ep1", 2, megatron(strategy(1, 1, 1, 0, 2, "1f1b"), 2, false, "none"));
}
// Expert tensor parallelism (issue 26): each expert's FFN split over the ETP group (fc1 columns, fc2
// rows), the routed rows all-gathered before fc1 and the partial sums reduce-scattered after fc2; EP
// groups take one device of each ETP group, expert gradients reduced over the expert-DP group.
TEST(RuntimeEquivalence, TP2_SP_ETP2_MoE) {
  core::StrategyOptions o = megatron(strategy(1, 1, 1, 0, 2, "1f1b"), 2, true, "none");
  o.etp = 2;
  expect_equivalent("tp2sp-etp2", 2, o);
}
TEST(RuntimeEquivalence, ClipGrad_TP2_SP_PP2) {
  expect_equivalent("clip-tp2sp", 4, clipped(megatron(strategy(2, 1, 1, 0, 4, "1f1b"), 2, true, "none")), "", kDense);
}
TEST(RuntimeEquivalence, ClipGrad_TP2_SP_ETP2_MoE) {
  core::StrategyOptions o = clipped(megatron(strategy(1, 1, 1, 0, 2, "1f1b"), 2, true, "none"));
  o.etp = 2;
  expect_equivalent("clip-tp2sp-etp2", 2, o);
}
TEST(RuntimeEquivalence, TP2_ETP2_MoE_WithoutSp) {
  core::StrategyOptions o = megatron(strategy(1, 1, 1, 0, 2, "1f1b"), 2, false, "none");
  o.etp = 2;
  expect_equivalent("tp2-etp2", 2, o);
}
TEST(RuntimeEquivalence, TP2_SP_DP2xEP2xETP2_MoE) {
  core::StrategyOptions o = megatron(strategy(1, 2, 2, 0, 2, "1f1b"), 2, true, "none");
  o.etp = 2;
  expect_equivalent("tp2sp-ep2-etp2", 4, o);
}
// ETP across data-parallel replicas (no dense TP): the pair gathers each other's tokens.
TEST(RuntimeEquivalence, DP2xETP2_MoE_Zero1) {
  core::StrategyOptions o = strategy(1, 2, 1, 1, 2, "1f1b");
  o.etp = 2;
  expect_equivalent("dp2-etp2", 2, o);
}
TEST(RuntimeEquivalence, FullRecompute_ZBH1_PP2) {
  expect_equivalent("full-zbh1", 2, megatron(strategy(2, 1, 1, 0, 4, "zb-h1"), 1, false, "full"));
}
// Every 2nd block (TorchTitan's ac_freq 2): the plan recomputes blocks 1 and 3 and nothing else, and
// the host backend runs exactly those segments with full recomputation (one segment per block).
TEST(RuntimeEquivalence, FullRecomputeEverySecondBlock_1F1B_PP2) {
  core::StrategyOptions o = megatron(strategy(2, 1, 1, 0, 4, "1f1b"), 1, false, "full");
  o.recompute_every = 2;
  const fs::path plan = compile_plan(temp_dir("every2-plan"), o, "", kDense);
  std::ifstream in(plan);
  const core::Program p = core::Program::from_json(json::parse(in));
  std::set<int> recomputed;
  for (const auto& seg : p.segments)
    if (seg.recompute == core::Recompute::Full) recomputed.insert(seg.tags.at("BLK"));
  EXPECT_EQ(recomputed, (std::set<int>{1, 3}));
  expect_equivalent("every2-1f1b", 2, o, "", kDense);
}
// Uneven pipelines: 4 blocks in 3 interleaved chunks on 2 ranks (rank 0 holds chunks 0 and 2, rank
// 1 chunk 1), and 1F1B with a one-block first stage (Megatron's --decoder-first-pipeline-num-layers).
TEST(RuntimeEquivalence, Uneven_Interleaved_3ChunksOn2Ranks) {
  expect_equivalent("uneven-interleaved", 2, strategy(2, 1, 1, 0, 4, "interleaved-1f1b"), "", kDense,
                    [](core::Scenario& s) { s.stages = 3; });
}
TEST(RuntimeEquivalence, Uneven_1F1B_FirstStageOneBlock_PP2xDP2) {
  expect_equivalent("uneven-first", 4, strategy(2, 2, 1, 0, 4, "1f1b"), "", kDense,
                    [](core::Scenario& s) { s.first_stage_layers = 1; });
}
TEST(RuntimeEquivalence, SelectiveRecompute_PP2xDP2xEP2) {
  expect_equivalent("selective-ep", 4, megatron(strategy(2, 2, 2, 0, 4, "1f1b"), 1, false, "selective"));
}

// HSDP: the gradient is reduce-scattered inside each shard group, each shard all-reduced across the
// groups, and (ZeRO-1/2) the updated shards gathered inside the group, or (ZeRO-3) gathered there
// before each use. With EP2 over DP4 the experts' 2 replicas are one group (plain ZeRO).
TEST(RuntimeEquivalence, HSDP_DP4_Zero1) {
  expect_equivalent("hsdp-zero1", 4, hsdp(strategy(1, 4, 1, 1, 2, "1f1b"), 2));
}
TEST(RuntimeEquivalence, ClipGrad_HSDP_DP4_Zero3) {
  expect_equivalent("clip-hsdp-zero3", 4, clipped(hsdp(strategy(1, 4, 1, 3, 2, "1f1b"), 2)), "", kDense);
}
TEST(RuntimeEquivalence, HSDP_PP2xDP4xEP2_Zero2) {
  expect_equivalent("hsdp-zero2-ep", 8, hsdp(strategy(2, 4, 2, 2, 4, "1f1b"), 2));
}
TEST(RuntimeEquivalence, HSDP_TP2xDP4_Zero3) {
  expect_equivalent("hsdp-tp2-zero3", 8, hsdp(megatron(strategy(1, 4, 1, 3, 2, "1f1b"), 2, false, "none"), 2), "",
                    kDense);
}

// GPT-style models. Tied: the embedding (first stage) and the head's copy (last stage) sum their
// gradients before the data-parallel reduction and the update; every layout must still match the
// single-process reference, where the head uses the embedding's table itself.
TEST(RuntimeEquivalence, Gpt_Tied_1F1B_PP2xDP2) {
  expect_equivalent("gpt-1f1b", 4, strategy(2, 2, 1, 0, 4, "1f1b"), "", kGpt);
}
TEST(RuntimeEquivalence, ClipGrad_Gpt_Tied_PP2xDP2) {  // the head's copy of the table is not counted again
  expect_equivalent("clip-gpt", 4, clipped(strategy(2, 2, 1, 0, 4, "1f1b")), "", kGpt);
}
TEST(RuntimeEquivalence, Gpt_Untied_1F1B_PP2xDP2) {
  expect_equivalent("gpt-untied-1f1b", 4, strategy(2, 2, 1, 0, 4, "1f1b"), "", kGptUntied);
}
TEST(RuntimeEquivalence, Gpt_Tied_TP2_SP_PP2) {
  expect_equivalent("gpt-tp2sp-pp2", 4, megatron(strategy(2, 1, 1, 0, 4, "1f1b"), 2, true, "none"), "", kGpt);
}
TEST(RuntimeEquivalence, Gpt_Tied_TP2xDP2_Zero3) {
  expect_equivalent("gpt-tp2-zero3", 4, megatron(strategy(1, 2, 1, 3, 2, "1f1b"), 2, false, "none"), "", kGpt);
}
// ZeRO-3 across stages: the tied sum runs on the local gradients before the reduce-scatter.
TEST(RuntimeEquivalence, Gpt_Tied_PP2xDP2_Zero3) {
  expect_equivalent("gpt-pp2-zero3", 4, strategy(2, 2, 1, 3, 4, "1f1b"), "", kGpt);
}
TEST(RuntimeEquivalence, Gpt_Tied_ZBH1_PP2_SelectiveRecompute) {
  expect_equivalent("gpt-zbh1-selective", 2, megatron(strategy(2, 1, 1, 0, 4, "zb-h1"), 1, false, "selective"), "",
                    kGpt);
}
// V placement: device 0 holds both the embedding and the head (two segments): the sum is local.
TEST(RuntimeEquivalence, Gpt_Tied_ZBV_PP2) {
  expect_equivalent("gpt-zbv", 2, strategy(2, 1, 1, 0, 4, "zb-v"), "", kGpt);
}
// The tied head as a region of its own on rank 1: the table's two copies sum across ranks again.
TEST(RuntimeEquivalence, Gpt_Tied_ZBV_PP2_HeadRegionOnRank1) {
  core::StrategyOptions o = strategy(2, 1, 1, 0, 4, "zb-v");
  o.v_head = "1";
  expect_equivalent("gpt-zbv-head", 2, o, "", kGpt);
}
TEST(RuntimeEquivalence, Gpt_Tied_DualPipeV_PP2xDP2) {
  expect_equivalent("gpt-dualpipev", 4, strategy(2, 2, 1, 0, 4, "dualpipev"), "", kGpt);
}
// Untied, the bidirectional placement that the tied model refuses runs as any other.
TEST(RuntimeEquivalence, Gpt_Untied_DualPipe_PP2) {
  expect_equivalent("gpt-untied-dualpipe", 2, strategy(2, 1, 1, 0, 4, "dualpipe"), "", kGptUntied);
}
TEST(RuntimeEquivalence, Gpt_Tied_Interleaved_PP2x2Chunks) {
  expect_equivalent("gpt-interleaved", 2, strategy(2, 1, 1, 0, 4, "interleaved-1f1b", 2), "", kGpt);
}

// DualPipe runs the pipeline in both directions: device 0 holds the embedding for data-parallel rank
// 0 and the head for rank 1 (and device 1 the mirror), so each device would have to keep two tied
// pairs with two peers. The compiler refuses the layout (Scenario.TiedCopiesAreSummedByAPairAllReduce);
// a plan that has it anyway (here the untied model's plan, its spec marked tied) is refused by the
// host backend before any step, in one line, exit code 2.
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
