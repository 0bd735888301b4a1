// Checkpointing policies between "selective" and "full" (issue 26): every K-th block (TorchTitan's
// ac_freq), the first N blocks of each stage (Megatron's block method), and --recompute auto, which
// picks the fastest policy whose simulated peak fits a memory budget. Costs are derived by hand for a
// 4-block GPT (Korthikanti et al. 2022's activation formula, Megatron's FLOP count).
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "piper/core/compiler.hpp"
#include "piper/core/model.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/sim/recompute_policy.hpp"

using namespace piper::core;
using nlohmann::json;

namespace {

// A small GPT in Korthikanti's setting (standard attention, dropout, GELU, ffn = 4h; no biases, so
// the forward FLOPs are the GEMMs' and the norms'): s = 64, b = 2, h = 64, a = 4 heads, vocab 256,
// untied head, 4 blocks.
ModelConfig small_gpt() {
  ModelConfig c;
  c.name = "rc-gpt";
  c.vocab = 256;
  c.hidden = 64;
  c.layers = 4;
  c.heads = 4;
  c.kv_heads = 4;
  c.head_dim = 16;
  c.ffn = 256;
  c.activation = MlpActivation::GELU;
  c.norm = NormKind::LayerNorm;
  c.bias = false;
  c.max_positions = 64;
  c.tie_embeddings = false;
  c.attention_kernel = AttentionKernel::Standard;
  c.dropout = true;
  c.dropout_probability = 0.1;
  c.training.seq_len = 64;
  c.training.micro_batch_size = 2;
  c.training.precision = Precision::BF16;
  return c;
}

constexpr double s = 64, b = 2, h = 64, a = 4;

std::string write_spec(const ModelConfig& c) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("piper-rc-" + std::to_string(getpid()) + ".json")).string();
  write_file_atomically(path, config_to_spec_json(c).dump());
  return path;
}

Scenario scenario(const StrategyOptions& o) {
  Scenario sc;
  sc.model = write_spec(small_gpt());
  sc.strategy = o;
  return sc;
}

StrategyOptions full_every(int k, int pp = 1, int microbatches = 1) {
  StrategyOptions o;
  o.pp = pp, o.microbatches = microbatches, o.recompute = "full", o.recompute_every = k;
  return o;
}

// Per transformer block of the program: recompute mode, the F op's activation buffer bytes and the
// recomputed FLOPs of its backward ops (all devices, one microbatch each when microbatches = 1).
struct BlockView {
  Recompute mode = Recompute::None;
  std::int64_t stash_bytes = 0;
  double recompute_flops = 0;
};
std::map<int, BlockView> blocks_of(const Program& p) {
  std::map<int, BlockView> out;
  for (const auto& seg : p.segments)
    if (auto it = seg.tags.find("BLK"); it != seg.tags.end()) out[it->second].mode = seg.recompute;
  for (const auto& plan : p.plans) {
    for (const auto& buffer : plan.buffers) {
      if (buffer.kind != BufferKind::Activations || buffer.persistent()) continue;
      const Op& alloc = plan.streams.at(static_cast<std::size_t>(buffer.alloc.stream))
                            .ops.at(static_cast<std::size_t>(buffer.alloc.index));
      if (alloc.kind != OpKind::Compute || alloc.pass != Pass::F) continue;
      const auto& tags = p.segments.at(static_cast<std::size_t>(alloc.segment)).tags;
      if (auto it = tags.find("BLK"); it != tags.end()) out[it->second].stash_bytes += buffer.bytes;
    }
    for (const auto& stream : plan.streams)
      for (const auto& op : stream.ops)
        if (op.segment >= 0 && op.recompute_flops > 0) {
          const auto& tags = p.segments.at(static_cast<std::size_t>(op.segment)).tags;
          EXPECT_TRUE(tags.contains("BLK")) << op.label << " recomputes outside a block";
          if (auto it = tags.find("BLK"); it != tags.end()) out[it->second].recompute_flops += op.recompute_flops;
        }
  }
  return out;
}

}  // namespace

// Every 2nd block of 4 (TorchTitan: blocks 1 and 3) keeps only its input, 2sbh bytes, instead of
// Korthikanti's sbh(34 + 5as/h); its backward reruns its forward: the GEMMs 24bsh^2 (QKV 6, output 2,
// MLP 16) + 4bs^2h (QK^T, PV) and two norms of 4 FLOPs per element, 8bsh. The other blocks keep
// everything and recompute nothing.
TEST(RecomputePolicy, EverySecondBlockKeepsInputsAndRerunsThoseBlocksOnly) {
  const Program p = compile_scenario(scenario(full_every(2))).result.program;
  const auto blocks = blocks_of(p);
  ASSERT_EQ(blocks.size(), 4u);
  const double sbh = s * b * h;
  const double kept_none = sbh * (34 + 5 * a * s / h), kept_full = 2 * sbh;
  const double block_forward = 24 * b * s * h * h + 4 * b * s * s * h + 8 * b * s * h;
  for (const auto& [block, v] : blocks) {
    SCOPED_TRACE("block " + std::to_string(block));
    const bool recomputed = block == 1 || block == 3;
    EXPECT_EQ(v.mode, recomputed ? Recompute::Full : Recompute::None);
    EXPECT_EQ(v.stash_bytes, static_cast<std::int64_t>(recomputed ? kept_full : kept_none));
    EXPECT_DOUBLE_EQ(v.recompute_flops, recomputed ? block_forward : 0);
  }
  // The step's recomputed FLOPs are those two blocks' forwards, and nothing else.
  double total = 0;
  for (const auto& [block, v] : blocks) total += v.recompute_flops;
  EXPECT_DOUBLE_EQ(total, 2 * block_forward);
}

// Megatron's block method: the first N blocks of each pipeline stage. With PP 2 over 4 blocks (two
// per stage), N = 1 recomputes blocks 0 and 2.
TEST(RecomputePolicy, FirstBlocksOfEachStage) {
  StrategyOptions o;
  o.pp = 2, o.microbatches = 2, o.recompute = "full", o.recompute_first = 1;
  const auto blocks = blocks_of(compile_scenario(scenario(o)).result.program);
  ASSERT_EQ(blocks.size(), 4u);
  for (const auto& [block, v] : blocks)
    EXPECT_EQ(v.mode, block % 2 == 0 ? Recompute::Full : Recompute::None) << "block " << block;
}

// A block selection in a directive program: BLK filters, "every", "first", and their errors.
TEST(RecomputePolicy, DirectiveFieldsAndErrors) {
  auto program = [](const json& recompute) {
    return json::array({{{"op", "place"}, {"filter", {{"PP", 0}}}, {"devices", {0}}}, recompute});
  };
  auto compile_with = [&](const json& recompute) {
    Scenario sc = scenario({});
    sc.directives = program(recompute);
    return compile_scenario(sc).result.program;
  };
  // An explicit block: only block 2, as selective.
  const auto one = blocks_of(compile_with({{"op", "recompute"}, {"filter", {{"BLK", 2}}}, {"mode", "selective"}}));
  for (const auto& [block, v] : one)
    EXPECT_EQ(v.mode, block == 2 ? Recompute::Selective : Recompute::None) << "block " << block;
  // Every 3rd: block 2 only (blocks 2, 5, ... of 0..3).
  const auto third =
      blocks_of(compile_with({{"op", "recompute"}, {"filter", {{"PP", 0}}}, {"mode", "full"}, {"every", 3}}));
  for (const auto& [block, v] : third)
    EXPECT_EQ(v.mode, block == 2 ? Recompute::Full : Recompute::None) << "block " << block;
  auto error_of = [&](const json& recompute) -> std::string {
    try {
      compile_with(recompute);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(error_of({{"op", "recompute"}, {"filter", {{"PP", 0}}}, {"mode", "full"}, {"every", 0}}),
            "directive 1 field 'every': must be a positive integer number of blocks, got 0");
  EXPECT_EQ(error_of({{"op", "recompute"}, {"filter", {{"PP", 0}}}, {"mode", "full"}, {"every", 2}, {"first", 1}}),
            "directive 1 field 'first': cannot be combined with \"every\" (choose one block selection)");
  EXPECT_EQ(error_of({{"op", "recompute"}, {"filter", {{"PP", 0}}}, {"mode", "full"}, {"first", 5}}),
            "directive 1 field 'first': asks for 5 blocks but the filter {\"PP\":0} selects only 4 blocks");
}

TEST(RecomputePolicy, StrategyFlagErrors) {
  auto error_of = [](StrategyOptions o) -> std::string {
    try {
      validate_strategy_options(o);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "no error";
  };
  StrategyOptions o;
  o.recompute_every = 2;
  EXPECT_EQ(error_of(o), "--recompute-every needs --recompute selective, full or op (the mode of the chosen blocks)");
  o.recompute = "full", o.recompute_first = 1;
  EXPECT_EQ(error_of(o), "--recompute-every and --recompute-first cannot be combined (choose one block selection)");
  o.recompute_every = 0, o.recompute_first = 0, o.recompute = "auto";
  EXPECT_EQ(
      error_of(o),
      "--recompute auto is chosen by the simulator's memory model: use it with piper simulate and --memory-budget GiB");
}

// --recompute auto: with the budget at a candidate's own simulated peak, the choice fits it and is
// at least as fast as every candidate that fits; no recomputation when everything fits; the budget
// named when nothing does.
TEST(RecomputePolicy, AutoPicksTheFastestPolicyThatFits) {
  StrategyOptions o;
  o.pp = 2, o.microbatches = 4;
  const Scenario sc = scenario(o);
  piper::sim::SimulateOptions sim;
  sim.engine = "analytic";
  const auto everything = piper::sim::choose_recompute(sc, 1000, sim);
  ASSERT_EQ(everything.trials.size(), 3u + 3u + 1u);  // none, selective, op; full every 4, 3, 2; full
  EXPECT_EQ(everything.chosen.policy.name(), "none");
  const auto& trials = everything.trials;
  const auto full = trials.back();
  EXPECT_EQ(full.policy.name(), "full");
  // Recomputation only adds work and never keeps more; full keeps least. (Every 4th and every 3rd
  // block choose blocks 3 and 2, both on stage 1, while the peak is stage 0's: the same peak as none.)
  for (const auto& t : trials) {
    EXPECT_GE(t.step_time_s, trials.front().step_time_s) << t.policy.name();
    EXPECT_LE(full.peak_memory_bytes, t.peak_memory_bytes) << t.policy.name();
    EXPECT_LE(t.peak_memory_bytes, trials.front().peak_memory_bytes) << t.policy.name();
  }
  EXPECT_LT(trials[5].peak_memory_bytes, trials.front().peak_memory_bytes)
      << trials[5].policy.name();  // every 2nd: block 1 on stage 0
  const double gib = 1024.0 * 1024.0 * 1024.0;
  for (const auto& budget_trial : trials) {
    const auto c = piper::sim::choose_recompute(sc, static_cast<double>(budget_trial.peak_memory_bytes) / gib, sim);
    SCOPED_TRACE("budget " + budget_trial.policy.name());
    EXPECT_LE(c.chosen.peak_memory_bytes, budget_trial.peak_memory_bytes);
    EXPECT_LE(c.chosen.step_time_s, budget_trial.step_time_s);
  }
  const auto at_full = piper::sim::choose_recompute(sc, static_cast<double>(full.peak_memory_bytes) / gib, sim);
  EXPECT_EQ(at_full.chosen.policy.name(), "full");  // the only one that fits
  try {
    piper::sim::choose_recompute(sc, static_cast<double>(full.peak_memory_bytes - 1024) / gib, sim);
    ADD_FAILURE() << "no error below the least peak";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no recompute policy fits; the least memory is full with"), std::string::npos)
        << e.what();
  }
}

// TorchTitan's op-level checkpointing under TP reruns the collectives its save list does not keep
// (it keeps reduce_scatter_tensor's output, no all-gather or all-reduce; the non-reentrant
// checkpoint stops after rebuilding w2's input): with SP the all-gather before the attention's and
// before the MLP's column-parallel GEMMs, N bytes each; without SP the all-reduce after wo (2N, one
// collective) and nothing for the MLP, whose all-reduce follows w2. N = s·b·h·2 bytes.
TEST(TensorParallel, OpRecomputeRerunsTheUnsavedCollectives) {
  const Model m = build_model(small_gpt());  // N does not depend on its biases or head
  const std::int64_t N = 64 * 2 * 64 * 2;
  for (bool sp : {false, true}) {
    for (const auto& layer : m.layers()) {
      if (layer.block < 0) continue;
      SCOPED_TRACE(layer.name + (sp ? " SP" : " TP"));
      const Costs none = layer_costs(layer, m.training(), {2, sp, 0});
      const Costs op = layer_costs(layer, m.training(), {2, sp, 3});
      std::int64_t bytes = 0;
      int collectives = 0;
      if (layer.kind == LayerKind::Attention) bytes = sp ? N : 2 * N, collectives = 1;
      if (layer.kind == LayerKind::Mlp && sp) bytes = N, collectives = 1;
      EXPECT_EQ(op.backward_tp_bytes - none.backward_tp_bytes, bytes);
      EXPECT_EQ(op.backward_tp_collectives - none.backward_tp_collectives, collectives);
      EXPECT_EQ(op.forward_tp_bytes, none.forward_tp_bytes);
    }
  }
  // Without TP nothing is gathered.
  for (const auto& layer : m.layers())
    EXPECT_EQ(layer_costs(layer, m.training(), {1, false, 3}).backward_tp_bytes, 0) << layer.name;
}
