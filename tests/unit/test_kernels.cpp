// core::layer_kernels: the kernels a layer launches per pass. Their FLOPs must add up to the layer's
// Costs in every layout (the simulator scales kernel times by the op's FLOPs, so a mismatch would be
// a silent error), and their shapes are the Megatron layout's, derived here by hand.
#include <cmath>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/kernels.hpp"
#include "piper/core/model.hpp"

using namespace piper::core;

namespace {

double pass_flops(const Costs& c, int p) {
  return p == 0 ? c.forward_flops : p == 1 ? c.backward_input_flops : c.backward_weight_flops;
}

void expect_close(double a, double b, const std::string& what) {
  EXPECT_NEAR(a, b, 1e-9 * std::max(1.0, std::abs(b))) << what;
}

}  // namespace

TEST(Kernels, FlopsAddUpToCostsForEveryZooModelAndLayout) {
  int checked = 0;
  for (const auto& name : zoo_names()) {
    ModelConfig cfg = *zoo_config(name);
    cfg.training.seq_len = 512;
    cfg.training.micro_batch_size = 2;
    const Model m = build_model(cfg);
    for (const auto& layer : m.layers())
      for (int tp : {1, 2, 4})
        for (bool sp : {false, true})
          for (int rc : {0, 1, 2, 3})
            for (int shard : {1, 2}) {
              if (sp && tp == 1) continue;
              const ParallelLayout L{tp, sp, rc};
              const Costs c = layer_costs(layer, m.training(), L);
              for (int p = 0; p < 3; ++p) {
                const auto ks = layer_kernels(layer, m.training(), L, p, shard);
                expect_close(kernel_flops(ks), pass_flops(c, p),
                             name + " " + layer.name + " tp " + std::to_string(tp) + " sp " + std::to_string(sp) +
                                 " recompute " + std::to_string(rc) + " pass " + std::to_string(p));
                ++checked;
              }
            }
  }
  EXPECT_GT(checked, 1000);
}

TEST(Kernels, StandardAttentionModelsKeepTheirElementwiseBytes) {
  ModelConfig cfg = *zoo_config("gpt3-175b");
  cfg.training.seq_len = 256;
  const Model m = build_model(cfg);
  for (const auto& layer : m.layers()) {
    if (layer.kind != LayerKind::Attention && layer.kind != LayerKind::Mlp) continue;
    for (int rc : {0, 1, 2, 3}) {
      const ParallelLayout L{2, true, rc};
      const Costs c = layer_costs(layer, m.training(), L);
      std::int64_t fwd = 0, bwd = 0;
      for (const auto& k : layer_kernels(layer, m.training(), L, 0)) fwd += k.bytes;
      for (const auto& k : layer_kernels(layer, m.training(), L, 1)) bwd += k.bytes;
      EXPECT_EQ(fwd, c.forward_elementwise_bytes) << layer.name;
      EXPECT_EQ(bwd, c.backward_elementwise_bytes) << layer.name << " recompute " << rc;
    }
    break;
  }
}

// Standard attention by hand: a GPT layer (4 heads of 16, dropout, fp16), 2 sequences of 16 tokens: 2·4·16²
// = 2048 scores. Its core is one kernel, the batched products' FLOPs and the score traffic; the rest of
// the layer's element-wise bytes stay an element-wise kernel.
TEST(Kernels, StandardAttentionCoreByHand) {
  TrainingShape t;
  t.seq_len = 16;
  t.micro_batch_size = 2;
  t.precision = Precision::FP16;
  Layer attn{"layers.0.attn", LayerKind::Attention, {}, {}, 0};
  attn.shape.hidden = 64;
  attn.shape.heads = attn.shape.kv_heads = 4;
  attn.shape.head_dim = 16;
  attn.shape.bias = true;
  attn.shape.dropout = true;
  attn.shape.attention_kernel = AttentionKernel::Standard;
  auto core_of = [](const std::vector<Kernel>& ks) {
    for (const auto& k : ks)
      if (is_standard_attention(k.kind)) return k;
    ADD_FAILURE() << "no standard attention kernel";
    return Kernel{};
  };
  const Kernel f = core_of(layer_kernels(attn, t, {}, 0));
  EXPECT_EQ(f.kind, KernelKind::StandardAttentionForward);
  EXPECT_EQ(f.batch, 2);
  EXPECT_EQ(f.m, 16);
  EXPECT_EQ(f.n, 4);
  EXPECT_EQ(f.head_dim, 16);
  EXPECT_TRUE(f.dropout);
  EXPECT_DOUBLE_EQ(f.flops, 2.0 * 2048 * (16 + 16));  // Q·K^T and P·V
  // Forward per score: softmax reads and writes (2 + 2), dropout reads, writes and masks (2 + 2 + 1), and
  // Q·K^T's epilogue writes (2): 11 bytes. Backward: softmax 2 + 2 + 2, dropout 5, dP's epilogue 2: 13.
  EXPECT_EQ(f.bytes, 2048 * 11);
  const Kernel b = core_of(layer_kernels(attn, t, {}, 1));
  EXPECT_EQ(b.kind, KernelKind::StandardAttentionBackward);
  EXPECT_DOUBLE_EQ(b.flops, 2 * f.flops);
  EXPECT_EQ(b.bytes, 2048 * 13);
  // TP 2: two heads a device, half the scores.
  const Kernel f2 = core_of(layer_kernels(attn, t, {2, false, 0}, 0));
  EXPECT_EQ(f2.n, 2);
  EXPECT_EQ(f2.bytes, 1024 * 11);
  // Without dropout: 6 bytes forward, 8 backward.
  attn.shape.dropout = false;
  EXPECT_EQ(core_of(layer_kernels(attn, t, {}, 0)).bytes, 2048 * 6);
  EXPECT_EQ(core_of(layer_kernels(attn, t, {}, 1)).bytes, 2048 * 8);
  // Selective recomputation reruns the forward core at the start of the backward, each with its own traffic.
  std::vector<Kernel> cores;
  for (const auto& k : layer_kernels(attn, t, {1, false, 1}, 1))
    if (is_standard_attention(k.kind)) cores.push_back(k);
  ASSERT_EQ(cores.size(), 2u);
  EXPECT_EQ(cores[0].kind, KernelKind::StandardAttentionForward);
  EXPECT_EQ(cores[0].bytes, 2048 * 6);
  EXPECT_EQ(cores[1].bytes, 2048 * 8);
}

// A plan edited to a GEMM of no rows (or an attention core of no tokens) simulated a step of 0 ms: refused
// on load, naming the field.
TEST(Kernels, AShapeOfZeroIsRefusedWhereTheTimeComesFromTheShape) {
  auto error_for = [](const std::string& kernel) {
    try {
      (void)kernels_from_json(nlohmann::json::parse(R"({"F": [)" + kernel + "]}"), "k");
    } catch (const PlanError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(error_for(R"({"kind": "gemm", "m": 0, "n": 8, "k": 8, "flops": 1e6})"),
            "plan: field 'k.F[0].m': a kernel of kind 'gemm' needs m >= 1, got 0");
  EXPECT_EQ(error_for(R"({"kind": "attention_fwd", "m": 64, "n": 0, "k": 1, "head_dim": 16, "v_dim": 16})"),
            "plan: field 'k.F[0].n': a kernel of kind 'attention_fwd' needs n >= 1, got 0");
  EXPECT_EQ(error_for(R"({"kind": "attention_std_bwd", "m": 64, "n": 2, "head_dim": 0, "v_dim": 16})"),
            "plan: field 'k.F[0].head_dim': a kernel of kind 'attention_std_bwd' needs head_dim >= 1, got 0");
  // Element-wise kinds carry their size in elements or bytes: 0 of either is a kernel that moves nothing.
  EXPECT_EQ(error_for(R"({"kind": "norm", "elems": 0})"), "(accepted)");
  EXPECT_EQ(error_for(R"({"kind": "gemm", "m": 1, "n": 1, "k": 1})"), "(accepted)");
}

TEST(Kernels, StandardAttentionKernelsRoundTripThroughJson) {
  PassKernels pk;
  Kernel k;
  k.kind = KernelKind::StandardAttentionBackward;
  k.m = 1024;
  k.n = 8;
  k.batch = 2;
  k.head_dim = k.v_dim = 64;
  k.bytes = 12345;
  k.dropout = true;
  k.flops = 1e9;
  pk[1].push_back(k);
  const nlohmann::json j = kernels_to_json(pk);
  EXPECT_EQ(j["BI"][0]["kind"], "attention_std_bwd");
  EXPECT_EQ(j["BI"][0]["dropout"], true);
  EXPECT_EQ(kernels_from_json(j, "k")[1].front(), k);
  nlohmann::json bad = j;
  bad["BI"][0]["dropout"] = "yes";
  try {
    kernels_from_json(bad, "k");
    ADD_FAILURE() << "a non-boolean dropout was accepted";
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("k.BI[0].dropout"), std::string::npos) << e.what();
  }
}

// A small GQA layer by hand: h = 64, 4 heads of 16, 2 KV heads, SwiGLU ffn 96, T = 2 x 16 tokens.
TEST(Kernels, ShapesOfADenseBlockByHand) {
  TrainingShape t;
  t.seq_len = 16;
  t.micro_batch_size = 2;
  Layer attn{"layers.0.attn", LayerKind::Attention, {}, {}, 0};
  attn.shape.hidden = 64;
  attn.shape.heads = 4;
  attn.shape.kv_heads = 2;
  attn.shape.head_dim = 16;
  const auto f = layer_kernels(attn, t, {}, 0);
  // QKV [32 x 64]·[64 x (4+2+2)·16], rope over q and k, flash core, O [32 x 64]·[64 x 64], residual.
  ASSERT_EQ(f.size(), 5u);
  EXPECT_EQ(f[0].kind, KernelKind::Gemm);
  EXPECT_EQ(f[0].m, 32);
  EXPECT_EQ(f[0].n, 128);
  EXPECT_EQ(f[0].k, 64);
  EXPECT_EQ(f[1].kind, KernelKind::Rope);
  EXPECT_EQ(f[1].elems, 32 * 6 * 16);
  EXPECT_EQ(f[2].kind, KernelKind::AttentionForward);
  EXPECT_EQ(f[2].batch, 2);
  EXPECT_EQ(f[2].m, 16);
  EXPECT_EQ(f[2].n, 4);
  EXPECT_EQ(f[2].k, 2);
  EXPECT_DOUBLE_EQ(f[2].flops, 2.0 * 2 * 16 * 16 * 4 * 32);
  EXPECT_EQ(f[3].m, 32);
  EXPECT_EQ(f[3].n, 64);
  EXPECT_EQ(f[3].k, 64);
  EXPECT_EQ(f[4].kind, KernelKind::Residual);
  EXPECT_EQ(f[4].elems, 32 * 64);
  // TP 2: QKV column-parallel (n halves), O row-parallel (k halves), heads and KV heads halve.
  const auto f2 = layer_kernels(attn, t, {2, false, 0}, 0);
  EXPECT_EQ(f2[0].n, 64);
  EXPECT_EQ(f2[2].n, 2);
  EXPECT_EQ(f2[2].k, 1);
  EXPECT_EQ(f2[3].k, 32);
  // Backward weight gradient of O: [64 x 32 tokens]·[32 x 64].
  const auto bw = layer_kernels(attn, t, {}, 2);
  ASSERT_EQ(bw.size(), 2u);
  EXPECT_EQ(bw[0].m, 64);
  EXPECT_EQ(bw[0].n, 64);
  EXPECT_EQ(bw[0].k, 32);

  Layer mlp{"layers.0.mlp", LayerKind::Mlp, {}, {}, 0};
  mlp.shape.hidden = 64;
  mlp.shape.ffn = 96;
  const auto m = layer_kernels(mlp, t, {}, 0);
  ASSERT_EQ(m.size(), 4u);
  EXPECT_EQ(m[0].n, 192);  // gate and up fused
  EXPECT_EQ(m[1].kind, KernelKind::Activation);
  EXPECT_EQ(m[1].elems, 32 * 96);
  EXPECT_EQ(m[2].k, 96);
}

TEST(Kernels, ExpertsRunAsAGroupedGemmOverTheLocalExperts) {
  TrainingShape t;
  t.seq_len = 64;
  Layer ex{"layers.0.experts", LayerKind::MoeExperts, {}, {}, 0};
  ex.shape.hidden = 32;
  ex.shape.ffn = 16;
  ex.shape.experts = 8;
  ex.shape.top_k = 2;
  // 64 tokens x top-2 = 128 routed rows; fc1 is one grouped launch over them: [128 x 32]·[32 x 2·16].
  const auto f = layer_kernels(ex, t, {}, 0, 4);
  std::vector<Kernel> gemms;
  for (const auto& k : f)
    if (k.kind == KernelKind::Gemm) gemms.push_back(k);
  ASSERT_EQ(gemms.size(), 2u);
  EXPECT_EQ(gemms[0].m, 128);
  EXPECT_EQ(gemms[0].n, 32);
  EXPECT_EQ(gemms[0].k, 32);
  EXPECT_DOUBLE_EQ(gemms[0].count, 1);
  // Weight gradients: one [32 x 32] product per local expert (EP 4: 2 experts) over its 128 / 2 = 64 rows.
  const auto w = layer_kernels(ex, t, {}, 2, 4);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[1].m, 32);
  EXPECT_EQ(w[1].n, 32);
  EXPECT_EQ(w[1].k, 64);
  EXPECT_EQ(w[1].batch, 2);
}

TEST(Kernels, SegmentsMergeRepeatedBlocksAndRoundTripThroughJson) {
  ModelConfig cfg = *zoo_config("qwen3-9m");
  const Model m = build_model(cfg);
  const int n = static_cast<int>(m.layers().size());
  const PassKernels pk = segment_kernels(m.layers(), 0, n, m.training(), {}, 1);
  double total = 0;
  for (const auto& l : m.layers()) total += layer_costs(l, m.training()).forward_flops;
  expect_close(kernel_flops(pk[0]), total, "whole model forward");
  // Identical blocks merge: far fewer entries than layers x kernels.
  EXPECT_LT(pk[0].size(), 20u);
  const PassKernels back = kernels_from_json(kernels_to_json(pk), "t");
  EXPECT_EQ(back, pk);
  nlohmann::json bad = kernels_to_json(pk);
  bad["F"][0]["count"] = -1;
  EXPECT_THROW(kernels_from_json(bad, "t"), PlanError);
  bad = kernels_to_json(pk);
  bad["BI"][0]["kind"] = "warp_drive";
  EXPECT_THROW(kernels_from_json(bad, "t"), PlanError);
}

// A kernel's "count" (its launches in the pass) of 1e300 passed `piper verify` and simulated as count
// 1e6 would (the model saturates): refused past 1e9, naming the field; its "flops" past 1e24 too (the
// bound of an op's FLOPs).
TEST(Kernels, KernelCountAndFlopsHaveAnUpperBound) {
  ModelConfig cfg = *zoo_config("qwen3-9m");
  const Model m = build_model(cfg);
  const PassKernels pk = segment_kernels(m.layers(), 0, static_cast<int>(m.layers().size()), m.training(), {}, 1);
  auto error_of = [](const nlohmann::json& j) -> std::string {
    try {
      (void)kernels_from_json(j, "segments[0].kernels");
    } catch (const PlanError& e) {
      return e.what();
    }
    return "(no error)";
  };
  nlohmann::json j = kernels_to_json(pk);
  j["BI"][0]["count"] = 1e300;
  EXPECT_EQ(error_of(j), "plan: field 'segments[0].kernels.BI[0].count': must be <= 1e+09 launches, got 1e+300");
  j["BI"][0]["count"] = 1e9;
  EXPECT_EQ(error_of(j), "(no error)");
  j = kernels_to_json(pk);
  j["F"][0]["flops"] = 1e300;
  EXPECT_EQ(error_of(j), "plan: field 'segments[0].kernels.F[0].flops': must be <= 1e+24 FLOPs, got 1e+300");
}

// TorchTitan's op-level selective checkpointing (Recompute::Op), derived by hand for llama3-8b
// (h 4096, 32 heads of 128, 8 KV heads, ffn 14336, bf16), T = 2 x 512 tokens, no TP: of the block's
// matmuls wq, wk, wv, wo, w1, w3, w2 the 1st, 3rd, 5th and 7th outputs are kept (wq: h, wv: 1024,
// w1: ffn, w2: h), wk, wo and w3 are recomputed at the start of the backward; the block keeps its
// input (h) and the attention output (h) with its log-sum-exp (fp32 per head).
TEST(Kernels, OpLevelRecomputationKeepsEveryOtherMatmulByHand) {
  ModelConfig cfg = *zoo_config("llama3-8b");
  cfg.training.seq_len = 512;
  cfg.training.micro_batch_size = 2;
  const Model m = build_model(cfg);
  const double T = 1024, h = 4096, kv = 1024, f = 14336, dt = 2;
  const ParallelLayout op{1, false, 3}, none{1, false, 0};
  int seen = 0;
  for (const auto& layer : m.layers()) {
    if (layer.block != 0) continue;
    const Costs a = layer_costs(layer, m.training(), op), b = layer_costs(layer, m.training(), none);
    if (layer.kind == LayerKind::Attention) {
      EXPECT_EQ(a.activation_bytes, static_cast<std::int64_t>(T * (h + kv) * dt + T * (h * dt + 32 * 4)));
      EXPECT_DOUBLE_EQ(a.recompute_flops, 2 * T * h * kv + 2 * T * h * h);  // wk, wo
      ++seen;
    } else if (layer.kind == LayerKind::Mlp) {
      EXPECT_EQ(a.activation_bytes, static_cast<std::int64_t>(T * (f + h) * dt));
      EXPECT_DOUBLE_EQ(a.recompute_flops, 2 * T * h * f);  // w3
      ++seen;
    } else if (layer.kind == LayerKind::Norm) {
      EXPECT_EQ(a.activation_bytes, layer.name.ends_with("attn_norm") ? static_cast<std::int64_t>(T * h * dt) : 0)
          << layer.name;
      EXPECT_DOUBLE_EQ(a.recompute_flops, b.forward_flops) << layer.name;
      ++seen;
    }
    EXPECT_DOUBLE_EQ(a.backward_input_flops - a.recompute_flops, b.backward_input_flops) << layer.name;
  }
  EXPECT_EQ(seen, 4);
}
