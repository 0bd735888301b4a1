// Settings the cost model answers to, checked by hand on small plans: ZeRO-2/3 gradient reduction
// per microbatch or per step (traffic and memory), TP communication overlap, and precision (fp8's
// weight copies of the fp8 GEMM weights and GEMM rates, fp32/tf32 on a GPU without a kernel table).
#include <algorithm>
#include <cmath>
#include <map>

#include <gtest/gtest.h>

#include "piper/core/kernels.hpp"
#include "piper/core/model.hpp"
#include "piper/core/scenario.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/simulate.hpp"
#include "spec_file.hpp"

using namespace piper;
using namespace piper::sim;

namespace {

core::CompiledScenario compile(core::StrategyOptions o, const std::string& model = "qwen3-9m") {
  core::Scenario sc;
  sc.model = model;
  sc.strategy = o;
  return core::compile_scenario(sc);
}

std::string spec_with(core::Precision pr) {
  core::ModelConfig cfg = *core::zoo_config("qwen3-9m");
  cfg.training.precision = pr;
  cfg.name = "qwen3-9m-" + core::to_string(pr);
  return piper::test::write_spec(cfg);
}

int count_ops(const core::Program& p, int device, core::OpKind kind) {
  int n = 0;
  for (const auto& s : p.plan_for(device).streams)
    for (const auto& op : s.ops) n += op.kind == kind;
  return n;
}

std::int64_t buffer_bytes(const core::Program& p, int device, core::BufferKind kind) {
  std::int64_t n = 0;
  for (const auto& b : p.plan_for(device).buffers) n += b.kind == kind ? b.bytes : 0;
  return n;
}

}  // namespace

// ZeRO-2 over 2 replicas, 4 microbatches, S segments holding parameters (no buckets: one reduction
// each): per microbatch 4·S reduce-scatters and gradient shards of P·2/2 bytes in all; per step S
// and the whole P·2 bytes.
TEST(CostSettings, ZeroGradientReductionPerMicrobatchOrPerStep) {
  core::StrategyOptions o;
  o.dp = 2;
  o.zero = 2;
  o.microbatches = 4;
  const auto per_mb = compile(o);
  o.reduce_every = "step";
  const auto per_step = compile(o);
  const std::int64_t P = per_mb.model.parameter_count();
  int S = 0;
  for (const auto& seg : per_mb.result.program.segments) S += seg.params > 0;
  ASSERT_GT(S, 0);
  EXPECT_EQ(count_ops(per_mb.result.program, 0, core::OpKind::ReduceScatter), 4 * S);
  EXPECT_EQ(count_ops(per_step.result.program, 0, core::OpKind::ReduceScatter), S);
  EXPECT_TRUE(per_mb.result.program.segments[0].reduce_every_microbatch);
  EXPECT_FALSE(per_step.result.program.segments[0].reduce_every_microbatch);
  EXPECT_EQ(buffer_bytes(per_mb.result.program, 0, core::BufferKind::Gradients), P * 2 / 2);
  EXPECT_EQ(buffer_bytes(per_step.result.program, 0, core::BufferKind::Gradients), P * 2);
  // Each round moves the whole bucket: four times the step's reduce-scatter traffic.
  std::int64_t bytes_mb = 0, bytes_step = 0;
  for (const auto& s : per_mb.result.program.plan_for(0).streams)
    for (const auto& op : s.ops) bytes_mb += op.kind == core::OpKind::ReduceScatter ? op.bytes : 0;
  for (const auto& s : per_step.result.program.plan_for(0).streams)
    for (const auto& op : s.ops) bytes_step += op.kind == core::OpKind::ReduceScatter ? op.bytes : 0;
  EXPECT_EQ(bytes_mb, 4 * bytes_step);
  // ZeRO-1 keeps one reduction per step; --reduce-every is refused below ZeRO-2.
  o.zero = 1;
  o.reduce_every = "";
  EXPECT_EQ(count_ops(compile(o).result.program, 0, core::OpKind::ReduceScatter), S);
  o.reduce_every = "microbatch";
  EXPECT_THROW(compile(o), std::exception);
}

// TP 2 with and without comm_overlap: an op's time is c + m without it, c its compute and m its n TP
// collectives. With it each collective (m1 = m / n) pairs with one projection GEMM of the pass's
// first kernel list (F, or BI for a backward), which runs as t = 2 chunks of half its token rows (each
// timed at its own shape, g_t for the two, never less than the whole GEMM's g): that GEMM and its collective take
// max(g_t, m1) + min(g_t, m1) / t instead of the GEMM's g; nothing else in the op hides a collective (a call beyond the
// GEMMs runs alone; in proportion where a pass has more GEMMs than calls).
TEST(CostSettings, TensorParallelCommunicationOverlap) {
  core::StrategyOptions o;
  o.tp = 2;
  o.sequence_parallel = true;  // the overlap splits SP's collectives
  o.pp = 4;                    // a quarter of a dense model's blocks on device 0
  const auto plain = compile(o, "llama3-8b");
  o.tp_comm_overlap = true;
  const auto overlap = compile(o, "llama3-8b");
  EXPECT_TRUE(overlap.result.program.segments[0].tp_comm_overlap);
  const CostModel cost(load_cluster("dgx-h200"));
  const KernelTiming timing = cost.timing(0);
  int checked = 0;
  const auto& ops_plain = plain.result.program.plan_for(0).streams[0].ops;
  const auto& ops_overlap = overlap.result.program.plan_for(0).streams[0].ops;
  ASSERT_EQ(ops_plain.size(), ops_overlap.size());
  for (std::size_t i = 0; i < ops_plain.size(); ++i) {
    const auto& op = ops_plain[i];
    if (op.kind != core::OpKind::Compute || op.tp_collectives == 0) continue;
    const double m = cost.tp_seconds(plain.result.program, 0, op);
    const double c = cost.compute_seconds(plain.result.program, 0, op) - m;
    ASSERT_GT(m, 0);
    const double m1 = m / op.tp_collectives;
    const auto& seg = plain.result.program.segments[static_cast<std::size_t>(op.segment)];
    double launches = 0, extra = 0;
    for (const auto& k : seg.kernels[op.pass == core::Pass::F ? 0 : 1]) {
      if (k.kind != core::KernelKind::Gemm || k.batch != 1) continue;
      core::Kernel half = k;
      half.m = (k.m + 1) / 2;
      half.flops = k.flops / 2;
      half.bytes = k.bytes / 2;
      const double g = timing.seconds(k), g_t = std::max(2 * timing.seconds(half), g);
      launches += k.count;
      extra += k.count * (std::max(g_t, m1) + std::min(g_t, m1) / 2 - g);
    }
    // The first stage's vocabulary-parallel embedding adds a collective with no projection GEMM: it
    // runs alone.
    ASSERT_GT(launches, 0);
    const double n = op.tp_collectives;
    const double expected = c + std::min(1.0, n / launches) * extra + std::max(0.0, n - launches) * m1;
    EXPECT_NEAR(cost.compute_seconds(overlap.result.program, 0, ops_overlap[i]), expected, 1e-12 * (c + m));
    EXPECT_NEAR(cost.tp_part_seconds(overlap.result.program, 0, ops_overlap[i]), expected - c, 1e-12 * (c + m));
    // Never faster than the longer of the compute and the collectives, never slower than running
    // them one after the other plus the chunked GEMMs' own cost.
    EXPECT_GE(expected, std::max(c, m) * (1 - 1e-12));
    EXPECT_LT(expected, c + m + extra);
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

// A projection GEMM beside a collective, by hand: the collective far longer than the GEMM leaves the
// collective plus one chunk of the GEMM, m1 + g_t / t; far shorter, the GEMM plus one chunk of the
// collective, g_t + m1 / t.
TEST(CostSettings, TensorParallelOverlapOfOneGemm) {
  const CostModel cost(load_cluster("dgx-h200"));
  const KernelTiming timing = cost.timing(0);
  core::Kernel k;
  k.m = 8192, k.n = 4096, k.k = 4096;
  k.flops = 2.0 * k.m * k.n * k.k;
  core::Kernel quarter = k;
  quarter.m = 2048;
  quarter.flops = k.flops / 4;
  const double g_t = std::max(4 * timing.seconds(quarter), timing.seconds(k));
  EXPECT_NEAR(CostModel::tp_overlap_seconds(timing, k, 4, 1.0), 1.0 + g_t / 4, 1e-12);
  EXPECT_NEAR(CostModel::tp_overlap_seconds(timing, k, 4, 1e-9), g_t + 1e-9 / 4, 1e-15);
  EXPECT_NEAR(CostModel::tp_overlap_seconds(timing, k, 1, 1e-9), timing.seconds(k) + 1e-9, 1e-15);
}

TEST(CostSettings, PrecisionSetsGemmDtypeMemoryAndRates) {
  core::StrategyOptions o;
  const auto bf16 = compile(o);
  // FP8 keeps a 1-byte copy of each fp8 GEMM weight beside the bf16 parameters: qwen3-9m's 4 blocks
  // of attention projections 256·256 + 2·256·128 + 256·256 = 196,608 and 8 experts of 3·256·128 =
  // 786,432, 3,932,160 in all (not the embedding, head, norms or router).
  const std::int64_t P = bf16.model.parameter_count();
  const std::int64_t gemm_weights = 4 * (196608 + 786432);
  const CostModel h200(load_cluster("dgx-h200"));
  const auto& op16 = bf16.result.program.plan_for(0).streams[0].ops[0];
  for (auto pr : {core::Precision::FP8, core::Precision::TF32}) {
    const auto c = compile(o, spec_with(pr));
    const core::Program& p = c.result.program;
    EXPECT_EQ(c.model.parameter_count(), P);
    EXPECT_EQ(buffer_bytes(p, 0, core::BufferKind::Parameters),
              pr == core::Precision::FP8 ? P * 2 + gemm_weights : P * 4);
    // Every GEMM runs in the training precision, but for those Transformer Engine's fp8 recipe leaves in
    // bf16: the LM head (Megatron-LM keeps the output layer in bf16) and the MoE router.
    int high = 0;
    for (const auto& layer : c.model.layers())
      for (int pass = 0; pass < 3; ++pass)
        for (const auto& k : core::layer_kernels(layer, c.model.training(), {}, pass)) {
          if (k.kind != core::KernelKind::Gemm) continue;
          const bool bf16_under_fp8 = layer.kind == core::LayerKind::Head || layer.kind == core::LayerKind::MoeRouter;
          high += bf16_under_fp8;
          EXPECT_EQ(k.dtype, pr == core::Precision::FP8 && bf16_under_fp8 ? core::Precision::BF16 : pr) << layer.name;
        }
    EXPECT_GT(high, 0);
    if (pr == core::Precision::FP8) {
      // Standard (non-flash) attention's batched products (Q·K^T, P·V and their gradients) stay bf16 too;
      // its projections run in fp8.
      core::ModelConfig standard = *core::zoo_config("qwen3-9m");
      standard.attention_kernel = core::AttentionKernel::Standard;
      standard.training.precision = core::Precision::FP8;
      const core::Model m = core::build_model(standard);
      int batched = 0, projections = 0;
      for (const auto& layer : m.layers())
        if (layer.kind == core::LayerKind::Attention)
          for (int pass = 0; pass < 3; ++pass)
            for (const auto& k : core::layer_kernels(layer, m.training(), {}, pass)) {
              if (core::is_standard_attention(k.kind)) {
                ++batched;
                EXPECT_EQ(k.dtype, core::Precision::BF16);
              }
              if (k.kind != core::KernelKind::Gemm) continue;
              ++projections;
              EXPECT_EQ(k.dtype, core::Precision::FP8);
            }
      EXPECT_GT(batched, 0);
      EXPECT_GT(projections, 0);
    }
    for (const auto& k : p.segments[0].kernels[0])
      if (k.kind == core::KernelKind::Gemm && pr != core::Precision::FP8) {
        EXPECT_EQ(k.dtype, pr);
      }
    // A forward in fp8 runs faster than in bf16 on the H200 (its fp8 GEMMs measure ~1.8x), in tf32
    // slower (~0.5x).
    const auto& op = p.plan_for(0).streams[0].ops[0];
    ASSERT_EQ(op.kind, core::OpKind::Compute);
    if (pr == core::Precision::FP8)
      EXPECT_LT(h200.compute_seconds(p, 0, op), h200.compute_seconds(bf16.result.program, 0, op16));
    else
      EXPECT_GT(h200.compute_seconds(p, 0, op), h200.compute_seconds(bf16.result.program, 0, op16));
  }
  // On the A100 without a kernel table ("kernel_table": "") an fp32 GEMM runs on the CUDA cores: the
  // curve on a 16th of the bf16 peak, 312/16 TFLOP/s x 0.75 x f / (f + 2 GFLOP), plus the 2 µs floor.
  const KernelTiming a100 =
      CostModel(cluster_from_text(R"({"preset": "dgx-a100-80g", "node": {"gpu": {"kernel_table": ""}}})", "c.json"))
          .timing(0);
  core::Kernel g;
  g.dtype = core::Precision::FP32;
  g.m = g.n = g.k = 2048;
  g.flops = 2.0 * 2048 * 2048 * 2048;
  const double expected = g.flops / (312e12 / 16 * 0.75 * g.flops / (g.flops + 2e9)) + 2e-6;
  EXPECT_NEAR(a100.seconds(g), expected, 1e-12 * expected);
  g.dtype = core::Precision::TF32;
  const double tf32 = g.flops / (312e12 / 2 * 0.75 * g.flops / (g.flops + 2e9)) + 2e-6;
  EXPECT_NEAR(a100.seconds(g), tf32, 1e-12 * tf32);
}

// Under fp8 training Transformer Engine keeps a 1-byte fp8 copy of the weights of the GEMMs it runs in
// fp8 only: the blocks' linear layers (attention QKV and output projections, MLP fc1/fc2, routed
// experts). The embedding, the LM head (Megatron-LM's output layer stays bf16), norms and the router
// have none. The copy is the difference between a device's parameter bytes under fp8 and under bf16
// (both store 2 bytes a parameter), divided by TP and EP and sharded by ZeRO-3 like the parameters.
// Before, every parameter had one (41,312 bytes for the tiny dense model on one device).
//
// runtime-tiny-dense (h 32, 4 heads of 8 over 2 KV heads, ffn 64, SwiGLU, V 64, 4 blocks, untied):
//   a block's GEMM weights: q 32·32 + k, v 2·32·16 + o 32·32 = 3,072; fc1 2·32·64 + fc2 64·32 = 6,144
//   one device: 4 · (3,072 + 6,144) = 36,864 (the other 4,448 of the 41,312 parameters: embedding and
//     head 64·32 each, qk-norms 2·8 and norms 2·32 a block, the final norm 32)
//   TP 2: 4 · (1,536 + 3,072) = 18,432;  TP 2 x DP 2, ZeRO-3: 18,432 / 2 = 9,216
// runtime-tiny-moe (the same attention; 4 experts of ffn 32 top-2, one shared expert of ffn 32):
//   a block's GEMM weights: attention 3,072; experts 4 · 3·32·32 = 12,288; shared expert 3·32·32 = 3,072
//   one device: 4 · (3,072 + 12,288 + 3,072) = 73,728 (not the router's 32·4 a block)
//   TP 2 x DP 2, EP 2, ZeRO-3: attention and shared expert split by TP, then halved by ZeRO-3 over the
//     2 replicas: (1,536 + 1,536) / 2 = 1,536 a block; experts 2 of 4 a device (EP 2, ETP 1) over
//     4 / 2 = 2 replicas: 12,288 / 2 / 2 = 3,072 a block; 4 · (1,536 + 3,072) = 18,432
TEST(CostSettings, Fp8WeightCopyHoldsOnlyTheFp8GemmWeights) {
  auto spec = [](const std::string& file, core::Precision pr) {
    core::ModelConfig cfg = core::load_model_config(std::string(PIPER_SOURCE_DIR) + "/tests/data/" + file + ".json");
    cfg.training.precision = pr;
    cfg.name = file + "-" + core::to_string(pr);
    return piper::test::write_spec(cfg);
  };
  struct Case {
    std::string model;
    int tp, dp, ep, zero;
    std::int64_t fp8_copy;  // bytes a device, by hand (above)
  };
  const std::vector<Case> cases = {{"runtime-tiny-dense", 1, 1, 1, 0, 36864},
                                   {"runtime-tiny-dense", 2, 1, 1, 0, 18432},
                                   {"runtime-tiny-dense", 2, 2, 1, 3, 9216},
                                   {"runtime-tiny-moe", 1, 1, 1, 0, 73728},
                                   {"runtime-tiny-moe", 2, 2, 2, 3, 18432}};
  for (const auto& c : cases) {
    core::StrategyOptions o;
    o.tp = c.tp;
    o.dp = c.dp;
    o.ep = c.ep;
    o.zero = c.zero;
    const core::Program fp8 = compile(o, spec(c.model, core::Precision::FP8)).result.program;
    const core::Program bf16 = compile(o, spec(c.model, core::Precision::BF16)).result.program;
    const int devices = c.tp * c.dp;
    ASSERT_EQ(fp8.num_devices, devices) << c.model;
    for (int d = 0; d < devices; ++d)
      EXPECT_EQ(
          buffer_bytes(fp8, d, core::BufferKind::Parameters) - buffer_bytes(bf16, d, core::BufferKind::Parameters),
          c.fp8_copy)
          << c.model << " TP " << c.tp << " DP " << c.dp << " EP " << c.ep << " ZeRO " << c.zero << " device " << d;
  }
}

// ZeRO-3 with fp8 training (bf16 storage, 2 bytes a parameter) over 2 replicas: each per-use parameter
// ALL_GATHER moves its bucket's parameters at 2 bytes each; with --fp8-all-gather at 1 byte each (half),
// and the gathered-parameter buffers halve with them. Refused without fp8 training or without ZeRO-3.
TEST(CostSettings, Fp8ParameterGathersMoveTheFp8GemmWeightsAtOneByte) {
  core::StrategyOptions o;
  o.dp = 2;
  o.zero = 3;
  o.microbatches = 2;
  const std::string fp8 = spec_with(core::Precision::FP8);
  const auto plain = compile(o, fp8);
  o.fp8_all_gather = true;
  const auto small = compile(o, fp8);
  auto gathers = [](const core::Program& p) {
    std::vector<std::int64_t> bytes;
    for (const auto& s : p.plan_for(0).streams)
      for (const auto& op : s.ops)
        if (op.kind == core::OpKind::AllGather) bytes.push_back(op.bytes);
    return bytes;
  };
  const auto a = gathers(plain.result.program), b = gathers(small.result.program);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GT(a.size(), 0u);
  // A gather moves the fp8 GEMMs' weights at one byte instead of two and the other parameters in bf16:
  // each saves its segment's fp8 GEMM weights in bytes. qwen3-9m's 10 segments (the embedding, 4 x
  // (attention, routed experts), the head), each gathered for F and for the backward of 2 microbatches:
  // 8 gathers of the embedding and head save nothing, 16 of an attention segment its projections'
  // 196,608, 16 of an experts segment its 8 x 3·256·128 = 786,432.
  std::map<std::int64_t, int> saved;
  for (std::size_t i = 0; i < a.size(); ++i) saved[a[i] - b[i]] += 1;
  EXPECT_EQ(saved, (std::map<std::int64_t, int>{{0, 8}, {196608, 16}, {786432, 16}}));
  EXPECT_EQ(buffer_bytes(plain.result.program, 0, core::BufferKind::GatheredParameters) -
                buffer_bytes(small.result.program, 0, core::BufferKind::GatheredParameters),
            16 * (196608 + 786432));
  // Without fp8 training, and without ZeRO-3: one line naming the setting.
  try {
    compile(o);
    FAIL() << "fp8 gathers of bf16 training were accepted";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8-all-gather"), std::string::npos) << e.what();
  }
  o.zero = 2;
  try {
    compile(o, fp8);
    FAIL() << "fp8 gathers without ZeRO-3 were accepted";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--fp8-all-gather applies only with --zero 3"), std::string::npos) << e.what();
  }
}

// fp32 main grads (Megatron-LM's bf16 default, FSDP2's fp32 reduce_dtype) make the gradients 4 bytes:
// every reduction moves twice the bytes of the bf16-gradient plan, while the parameters stay bf16, so
// every gather (ZeRO-1's after the update, ZeRO-3's before each use) and the gathered-parameter
// buffers are unchanged: Megatron's distributed optimizer, DeepSpeed and FSDP's param_dtype all
// gather the 2-byte parameters.
TEST(CostSettings, Fp32MainGradsDoubleTheReductionsNotTheParameterGathers) {
  core::ModelConfig cfg = *core::zoo_config("qwen3-9m");
  cfg.training.fp32_main_grads = true;
  cfg.name = "qwen3-9m-fp32-main-grads";
  const std::string main_grads = piper::test::write_spec(cfg);
  const std::string bf16 = spec_with(core::Precision::BF16);
  auto bytes_of = [](const core::Program& p, core::OpKind kind) {
    std::vector<std::int64_t> bytes;
    for (const auto& s : p.plan_for(0).streams)
      for (const auto& op : s.ops)
        if (op.kind == kind) bytes.push_back(op.bytes);
    return bytes;
  };
  for (int zero : {1, 3}) {
    core::StrategyOptions o;
    o.dp = 2;
    o.zero = zero;
    o.microbatches = 2;
    const core::Program a = compile(o, bf16).result.program, b = compile(o, main_grads).result.program;
    EXPECT_EQ(bytes_of(b, core::OpKind::AllGather), bytes_of(a, core::OpKind::AllGather)) << "zero " << zero;
    ASSERT_FALSE(bytes_of(a, core::OpKind::AllGather).empty());
    const auto ra = bytes_of(a, core::OpKind::ReduceScatter), rb = bytes_of(b, core::OpKind::ReduceScatter);
    ASSERT_EQ(ra.size(), rb.size());
    ASSERT_FALSE(ra.empty());
    for (std::size_t i = 0; i < ra.size(); ++i) EXPECT_EQ(rb[i], 2 * ra[i]) << "zero " << zero << " reduction " << i;
    EXPECT_EQ(buffer_bytes(b, 0, core::BufferKind::GatheredParameters),
              buffer_bytes(a, 0, core::BufferKind::GatheredParameters));
  }
}

// ZeRO shards hold whole elements, the last one padded (FSDP's and DeepSpeed's flat buffers), so that
// the shards of a segment hold all its parameters: the tiny model's segments over 3 replicas (counts 3
// does not divide) under ZeRO-3, each parameter, gradient and optimizer state buffer a whole number of
// elements and 3 of them at least the unsharded buffer, by less than one element each. Before, the
// bytes were divided (55,079 parameter bytes a device, not a whole fp32 element, 11 bytes short of
// the model's 165,248 over the three).
TEST(CostSettings, ZeroShardsHoldWholeElementsAndEveryParameter) {
  const std::string tiny = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-dense.json";
  core::StrategyOptions o;
  o.dp = 3;
  o.zero = 3;
  const core::Program p = compile(o, tiny).result.program;
  int uneven = 0, checked = 0;
  for (int d = 0; d < 3; ++d) {
    std::int64_t params = 0;
    for (const auto& b : p.plan_for(d).buffers) {
      const bool param = b.kind == core::BufferKind::Parameters;
      if (!param && b.kind != core::BufferKind::Gradients && b.kind != core::BufferKind::OptimizerStates) continue;
      const std::int64_t per = b.kind == core::BufferKind::OptimizerStates ? 8 : 4;  // fp32: two moments
      const auto s = static_cast<std::size_t>(std::stoi(b.name.substr(b.name.rfind(" s") + 2)));
      ASSERT_LT(s, p.segments.size()) << b.name;
      const std::int64_t elems = p.segments[s].params;
      EXPECT_EQ(b.bytes % per, 0) << b.name;
      EXPECT_GE(3 * (b.bytes / per), elems) << b.name;
      EXPECT_LT(3 * (b.bytes / per), elems + 3) << b.name;
      uneven += elems % 3 != 0;
      ++checked;
      if (param) params += b.bytes;
    }
    EXPECT_GE(3 * params, 165248) << "device " << d;  // the model's 41,312 fp32 parameters
  }
  EXPECT_GT(checked, 0);
  EXPECT_GT(uneven, 0);
}
