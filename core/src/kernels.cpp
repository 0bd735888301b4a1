// The kernels each layer launches per pass (Megatron-LM / TorchTitan layout), with FLOPs in
// core::Costs' conventions; see kernels.hpp.
#include "piper/core/kernels.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"

namespace piper::core {

using nlohmann::json;

namespace {

constexpr const char* kKindNames[] = {"gemm",
                                      "attention_fwd",
                                      "attention_bwd",
                                      "norm",
                                      "norm_bwd",
                                      "norm_weight",
                                      "activation",
                                      "activation_bwd",
                                      "residual",
                                      "rope",
                                      "loss",
                                      "loss_bwd",
                                      "embedding",
                                      "embedding_bwd",
                                      "permute",
                                      "elementwise",
                                      "copy",
                                      "attention_std_fwd",
                                      "attention_std_bwd"};

struct KernelBuilder {
  const TrainingShape& shape;
  std::vector<Kernel> out;
  // GEMMs that Transformer Engine's fp8 recipe leaves in bf16 (the LM head, which Megatron-LM keeps in
  // bf16, the MoE router, the attention core's batched products): set while such a layer's kernels are
  // listed. Only fp8 training differs: its other GEMMs run in e4m3.
  bool high_precision = false;

  void gemm(std::int64_t m, std::int64_t n, std::int64_t k, double flops, double count = 1, std::int64_t batch = 1) {
    Kernel g;
    g.kind = KernelKind::Gemm;
    g.dtype = high_precision && shape.precision == Precision::FP8 ? Precision::BF16 : shape.precision;
    g.m = std::max<std::int64_t>(1, m);
    g.n = std::max<std::int64_t>(1, n);
    g.k = std::max<std::int64_t>(1, k);
    g.batch = batch;
    g.flops = flops;
    g.count = count;
    out.push_back(g);
  }
  // A dense GEMM of T tokens through a K x N weight, in pass p: F runs [T x K]·[K x N]; BI the input
  // gradient [T x N]·[N x K]; BW the weight gradient [K x T]·[T x N]. Each is 2·T·K·N FLOPs, counted
  // from the exact (possibly fractional, e.g. K / tp) sizes; the shape is rounded.
  void linear(int p, double T, double K, double N, double count = 1) {
    const double f = 2.0 * T * K * N;
    const auto r = [](double x) { return static_cast<std::int64_t>(std::llround(x)); };
    if (p == 0) gemm(r(T), r(N), r(K), f, count);
    if (p == 1) gemm(r(T), r(K), r(N), f, count);
    if (p == 2) gemm(r(K), r(N), r(T), f, count);
  }
  void elementwise(KernelKind kind, std::int64_t elems, double flops = 0, std::int64_t bytes = 0) {
    if (elems <= 0 && bytes <= 0) return;
    Kernel e;
    e.kind = kind;
    e.dtype = shape.precision;
    e.elems = elems;
    e.bytes = bytes;
    e.flops = flops;
    out.push_back(e);
  }
};

// Divides x by d, at least 1 (a KV head shared by several TP ranks stays one head on each).
std::int64_t split(std::int64_t x, int d) { return std::max<std::int64_t>(1, x / std::max(1, d)); }

// Standard attention's score elements on one device of t TP ranks: b·(heads / t)·s².
std::int64_t standard_scores(const LayerShape& sh, const TrainingShape& shape, int t) {
  return shape.micro_batch_size * split(sh.heads, t) * shape.seq_len * shape.seq_len;
}

void attention_core(KernelBuilder& kb, const LayerShape& sh, const TrainingShape& shape, int t, bool backward,
                    std::int64_t standard_elementwise) {
  const bool mla = sh.kv_lora_rank > 0;
  const std::int64_t qk = mla ? sh.head_dim + sh.qk_rope_head_dim : sh.head_dim;
  const std::int64_t v = mla ? sh.v_head_dim : sh.head_dim;
  const std::int64_t nh = split(sh.heads, t), nkv = mla ? nh : split(sh.kv_heads, t);
  const double b = static_cast<double>(shape.micro_batch_size), s = static_cast<double>(shape.seq_len);
  // Costs' convention: the full s x s matrix, forward 2·b·s²·heads·(qk + v), backward twice that;
  // a sliding-window flash kernel s·min(s, window) instead of s².
  const bool windowed = sh.window > 0 && sh.attention_kernel == AttentionKernel::Flash;
  const double keys = windowed ? std::min(s, static_cast<double>(sh.window)) : s;
  const double core = 2.0 * b * s * keys * static_cast<double>(sh.heads) * static_cast<double>(qk + v) / t;
  if (sh.attention_kernel == AttentionKernel::Standard) {
    // One kernel for the whole core, with its batched products' FLOPs (forward Q·K^T and P·V; backward
    // twice that: dP, dV, dQ, dK) and its score traffic; the rest of the layer's element-wise bytes
    // (bias-dropout-add, permutes, bias adds) stay an element-wise kernel.
    const std::int64_t S = shape.seq_len;
    Kernel a;
    a.kind = backward ? KernelKind::StandardAttentionBackward : KernelKind::StandardAttentionForward;
    a.dtype = shape.precision == Precision::FP8 ? Precision::BF16 : shape.precision;  // bf16 under fp8
    a.m = S;
    a.n = nh;
    a.batch = shape.micro_batch_size;
    a.head_dim = qk;
    a.v_dim = v;
    a.dropout = sh.dropout;
    a.flops = backward ? 2 * core : core;
    a.bytes = standard_score_bytes(sh, standard_scores(sh, shape, t), bytes_per_element(shape.precision), backward);
    kb.out.push_back(a);
    kb.elementwise(KernelKind::Elementwise, 0, 0, std::max<std::int64_t>(0, standard_elementwise - a.bytes));
    return;
  }
  Kernel a;
  a.kind = backward ? KernelKind::AttentionBackward : KernelKind::AttentionForward;
  a.dtype = fp32_storage(shape.precision) ? Precision::FP32 : Precision::BF16;  // fp8 attention: not modelled
  a.m = shape.seq_len;
  a.n = nh;
  a.k = nkv;
  a.batch = shape.micro_batch_size;
  a.head_dim = qk;
  a.v_dim = v;
  if (windowed && sh.window < shape.seq_len) a.window = sh.window;
  a.flops = backward ? 2 * core : core;
  kb.out.push_back(a);
}

// Op-level recomputation's rerun matmuls of a layer (model_costs.cpp, op_recompute_matmuls), forward shapes
// under TP: a layer's output projection (N = hidden) is row-parallel, the others column-parallel.
void recompute_matmuls(KernelBuilder& kb, const Layer& layer, std::int64_t T, int t) {
  for (const auto& [k, n] : op_recompute_matmuls(layer, false)) {
    const double K = static_cast<double>(k), N = static_cast<double>(n);
    if (n == layer.shape.hidden)
      kb.linear(0, static_cast<double>(T), K / t, N);
    else
      kb.linear(0, static_cast<double>(T), K, N / t);
  }
}

void attention_kernels(KernelBuilder& kb, const Layer& layer, const TrainingShape& shape, const ParallelLayout& L,
                       int p, const Costs& c) {
  const LayerShape& sh = layer.shape;
  const int t = std::max(1, L.tp), seq = L.sequence_parallel ? t : 1;
  const std::int64_t T = shape.tokens_per_microbatch(), h = sh.hidden;
  const bool mla = sh.kv_lora_rank > 0, standard = sh.attention_kernel == AttentionKernel::Standard;
  // Projections as (K, N) pairs; the last one is row-parallel (K split), the others column-parallel.
  std::vector<std::pair<std::int64_t, std::int64_t>> proj;
  std::int64_t rope_elems = 0;
  if (!mla) {
    proj = {{h, (sh.heads + 2 * sh.kv_heads) * sh.head_dim}, {sh.heads * sh.head_dim, h}};
    rope_elems = sh.bias ? 0 : T * (sh.heads + sh.kv_heads) * sh.head_dim;  // GPT-style: learned positions
  } else {
    const std::int64_t qk = sh.head_dim + sh.qk_rope_head_dim;
    if (sh.q_lora_rank > 0)
      proj = {{h, sh.q_lora_rank}, {sh.q_lora_rank, sh.heads * qk}};
    else
      proj = {{h, sh.heads * qk}};
    proj.push_back({h, sh.kv_lora_rank + sh.qk_rope_head_dim});
    proj.push_back({sh.kv_lora_rank, sh.heads * (sh.head_dim + sh.v_head_dim)});
    proj.push_back({sh.heads * sh.v_head_dim, h});
    rope_elems = T * (sh.heads + 1) * sh.qk_rope_head_dim;
  }
  auto project = [&](std::size_t i) {
    const double K = static_cast<double>(proj[i].first), N = static_cast<double>(proj[i].second);
    if (i + 1 == proj.size())
      kb.linear(p, static_cast<double>(T), K / t, N);
    else
      kb.linear(p, static_cast<double>(T), K, N / t);
  };
  // Standard-attention models count their element-wise traffic (softmax, dropout, bias-dropout-add)
  // as Costs::*_elementwise_bytes: the core carries the score part, the residual the rest.
  // (Full recomputation: its rerun forward kernels carry the forward part of the backward's bytes.)
  // (Selective recomputation: the rerun core's kernel carries its own score traffic.)
  const std::int64_t rerun_scores =
      standard && L.recompute == 1
          ? standard_score_bytes(sh, standard_scores(sh, shape, t), bytes_per_element(shape.precision), false)
          : 0;
  const std::int64_t ew =
      p == 0 ? c.forward_elementwise_bytes
             : c.backward_elementwise_bytes - (L.recompute == 2 ? c.forward_elementwise_bytes : 0) - rerun_scores;
  if (p == 0) {
    for (std::size_t i = 0; i + 1 < proj.size(); ++i) project(i);
    if (sh.qk_norm) kb.elementwise(KernelKind::Norm, T * (sh.heads + sh.kv_heads) * sh.head_dim / t);
    kb.elementwise(KernelKind::Rope, rope_elems / t);
    attention_core(kb, sh, shape, t, false, standard ? ew : 0);
    project(proj.size() - 1);
    if (!standard) kb.elementwise(KernelKind::Residual, T * h / seq);
  } else if (p == 1) {
    if (L.recompute == 2) {  // full recomputation reruns the block's forward first
      std::vector<Kernel> fwd = layer_kernels(layer, shape, L, 0, 1);
      kb.out.insert(kb.out.end(), fwd.begin(), fwd.end());
    } else if (L.recompute == 1) {  // selective: the attention core's forward
      attention_core(kb, sh, shape, t, false, 0);
    } else if (L.recompute == 3 && layer.block >= 0) {  // op: the matmuls it did not keep, and RoPE
      recompute_matmuls(kb, layer, T, t);
      kb.elementwise(KernelKind::Rope, rope_elems / t);
    }
    if (!standard) kb.elementwise(KernelKind::Residual, T * h / seq);
    project(proj.size() - 1);
    attention_core(kb, sh, shape, t, true, standard ? ew : 0);
    kb.elementwise(KernelKind::Rope, rope_elems / t);
    if (sh.qk_norm) kb.elementwise(KernelKind::NormBackward, T * (sh.heads + sh.kv_heads) * sh.head_dim / t);
    for (std::size_t i = proj.size() - 1; i-- > 0;) project(i);
  } else {
    for (std::size_t i = proj.size(); i-- > 0;) project(i);
  }
}

void mlp_kernels(KernelBuilder& kb, const Layer& layer, const TrainingShape& shape, const ParallelLayout& L, int p,
                 const Costs& c) {
  const LayerShape& sh = layer.shape;
  const int t = std::max(1, L.tp), seq = L.sequence_parallel ? t : 1;
  const std::int64_t T = shape.tokens_per_microbatch(), h = sh.hidden, f = sh.ffn;
  const bool swiglu = sh.activation == MlpActivation::SwiGLU,
             standard = sh.attention_kernel == AttentionKernel::Standard;
  const double Td = static_cast<double>(T), hd = static_cast<double>(h), fd = static_cast<double>(f) / t;
  const double fc1 = (swiglu ? 2 : 1) * fd;
  const bool full = L.recompute == 2 && layer.block >= 0;
  if (p == 0) {
    kb.linear(0, Td, hd, fc1);
    if (standard)
      kb.elementwise(KernelKind::Elementwise, 0, 0, c.forward_elementwise_bytes);
    else
      kb.elementwise(KernelKind::Activation, T * f / t);
    kb.linear(0, Td, fd, hd);
    if (!standard) kb.elementwise(KernelKind::Residual, T * h / seq);
  } else if (p == 1) {
    if (full) {
      std::vector<Kernel> fwd = layer_kernels(layer, shape, L, 0, 1);
      kb.out.insert(kb.out.end(), fwd.begin(), fwd.end());
    } else if (L.recompute == 3 && layer.block >= 0) {  // op: the matmuls it did not keep, the activation
      recompute_matmuls(kb, layer, T, t);
      if (!standard) kb.elementwise(KernelKind::Activation, T * f / t);
    }
    if (!standard) kb.elementwise(KernelKind::Residual, T * h / seq);
    kb.linear(1, Td, fd, hd);
    if (standard)
      kb.elementwise(KernelKind::Elementwise, 0, 0,
                     c.backward_elementwise_bytes - (full ? c.forward_elementwise_bytes : 0));
    else
      kb.elementwise(KernelKind::ActivationBackward, T * f / t);
    kb.linear(1, Td, hd, fc1);
  } else {
    kb.linear(2, Td, fd, hd);
    kb.linear(2, Td, hd, fc1);
  }
}

void expert_kernels(KernelBuilder& kb, const LayerShape& sh, const TrainingShape& shape, const ParallelLayout& L, int p,
                    int shard) {
  // Expert TP (L.tp = e) and the stage's SP slice (L.token_split = s): T/s tokens arrive per device,
  // the ETP group gathers e times as many rows, and each device's GEMMs are f/e wide. Below, T is the
  // gathered tokens and f the local width; the FLOPs are those of T·k/s rows through the whole FFN.
  const int e = std::max(1, L.tp), s = std::max(1, L.token_split);
  const std::int64_t T = shape.tokens_per_microbatch() / s * e, h = sh.hidden, f = sh.ffn / e;
  const std::int64_t E = std::max<std::int64_t>(1, sh.experts), k = std::max<std::int64_t>(1, sh.top_k);
  // Balanced routing: this device's E/shard local experts receive the T·k routed copies of every
  // device of the shard group, T·k in all; each expert runs T·k·shard/E of them through fc1 (gate and
  // up fused, 2f wide) and fc2. A grouped GEMM (Megatron-LM's, TorchTitan's) runs all local experts'
  // problems in one launch whose tiles fill the GPU as one GEMM of the T·k routed rows would: the
  // forward and input-gradient GEMMs are [T·k x K]·[K x N]; the weight gradients are one [K x N]
  // product per local expert over its T·k·shard/E rows (a batch of E/shard).
  const double local = static_cast<double>(E) / std::max(1, shard);
  const double routed = static_cast<double>(T * k);
  const std::int64_t rows = T * k;
  const std::int64_t m = std::max<std::int64_t>(1, std::llround(routed / local));
  const auto batch = std::max<std::int64_t>(1, std::llround(local));
  const double f1 = 2.0 * routed * static_cast<double>(h) * 2.0 * static_cast<double>(f);
  const double f2 = 2.0 * routed * static_cast<double>(f) * static_cast<double>(h);
  const std::int64_t copies = T * k * h;
  if (p == 0) {
    kb.elementwise(KernelKind::Permute, copies);
    kb.gemm(rows, 2 * f, h, f1);
    kb.elementwise(KernelKind::Activation, T * k * f);
    kb.gemm(rows, h, f, f2);
    kb.elementwise(KernelKind::Permute, copies);
  } else if (p == 1) {
    kb.elementwise(KernelKind::Permute, copies);
    kb.gemm(rows, f, h, f2);
    kb.elementwise(KernelKind::ActivationBackward, T * k * f);
    kb.gemm(rows, h, 2 * f, f1);
    kb.elementwise(KernelKind::Permute, copies);
  } else {
    kb.gemm(f, h, m, f2, 1, batch);
    kb.gemm(h, 2 * f, m, f1, 1, batch);
  }
}

}  // namespace

std::string to_string(KernelKind k) { return kKindNames[static_cast<int>(k)]; }

KernelKind kernel_kind_from_string(const std::string& s) {
  for (int i = 0; i <= static_cast<int>(KernelKind::StandardAttentionBackward); ++i)
    if (s == kKindNames[i]) return static_cast<KernelKind>(i);
  throw Error("unknown kernel kind '" + s + "'");
}

bool is_standard_attention(KernelKind k) {
  return k == KernelKind::StandardAttentionForward || k == KernelKind::StandardAttentionBackward;
}

bool is_elementwise(KernelKind k) {
  return k != KernelKind::Gemm && k != KernelKind::AttentionForward && k != KernelKind::AttentionBackward &&
         !is_standard_attention(k);
}

std::vector<Kernel> layer_kernels(const Layer& layer, const TrainingShape& shape, const ParallelLayout& L, int p,
                                  int shard_degree) {
  if (L.cp > 1) {
    // Context parallelism: the kernels of the seq_len / cp local tokens; the attention core runs once
    // per ring step (or over the gathered K/V), cp blocks of the local queries against s/cp keys each
    // (layer_costs' causal load balance: 1/cp of the sequence's core work).
    ParallelLayout inner = L;
    inner.cp = 1;
    inner.cp_all_gather = false;
    std::vector<Kernel> out = layer_kernels(layer, context_parallel_local_shape(shape, L.cp), inner, p, shard_degree);
    for (Kernel& k : out)
      if (k.kind == KernelKind::AttentionForward || k.kind == KernelKind::AttentionBackward) k.count *= L.cp;
    return out;
  }
  KernelBuilder kb{shape, {}, false};
  const LayerShape& sh = layer.shape;
  const int t = std::max(1, L.tp), seq = L.sequence_parallel ? t : 1;
  const std::int64_t T = shape.tokens_per_microbatch(), h = sh.hidden;
  // The layout's element-wise bytes (standard-attention models) and norm FLOPs, as layer_costs has them.
  const Costs c = layer_costs(layer, shape, L);
  const bool full = L.recompute == 2 && layer.block >= 0;
  // Norms rerun their forward in the backward under full and op-level recomputation alike.
  const bool rerun_norm = (L.recompute == 2 || L.recompute == 3) && layer.block >= 0;
  switch (layer.kind) {
    case LayerKind::Embedding:
      if (p == 0) kb.elementwise(KernelKind::Embedding, T * h / seq);
      if (p == 2) kb.elementwise(KernelKind::EmbeddingBackward, T * h / seq);
      break;
    case LayerKind::Norm: {
      const std::int64_t n = T * h / seq;
      if (sh.attention_kernel == AttentionKernel::Standard && p < 2) {
        // Standard-attention models count their norms' traffic as element-wise bytes (Costs): the
        // same kernel, given by those bytes (the input gradient's includes the gain's).
        if (p == 1 && rerun_norm)
          kb.elementwise(KernelKind::Elementwise, 0, c.forward_flops, c.forward_elementwise_bytes);
        const std::int64_t bytes = p == 0
                                       ? c.forward_elementwise_bytes
                                       : c.backward_elementwise_bytes - (rerun_norm ? c.forward_elementwise_bytes : 0);
        const double flops = p == 0 ? c.forward_flops : c.backward_input_flops - (rerun_norm ? c.forward_flops : 0);
        kb.elementwise(KernelKind::Elementwise, 0, flops, bytes);
        break;
      }
      if (p == 1 && rerun_norm) kb.elementwise(KernelKind::Norm, n, c.forward_flops);
      if (p == 0) kb.elementwise(KernelKind::Norm, n, c.forward_flops);
      if (p == 1)
        kb.elementwise(KernelKind::NormBackward, n, c.backward_input_flops - (rerun_norm ? c.forward_flops : 0));
      if (p == 2) kb.elementwise(KernelKind::NormWeight, n, c.backward_weight_flops);
      break;
    }
    case LayerKind::Attention:
      attention_kernels(kb, layer, shape, L, p, c);
      break;
    case LayerKind::Mlp:
      mlp_kernels(kb, layer, shape, L, p, c);
      break;
    case LayerKind::MoeRouter: {
      const double Ts = static_cast<double>(T) / seq, hd = static_cast<double>(h), E = static_cast<double>(sh.experts);
      kb.high_precision = true;
      if (p == 1 && full) kb.linear(0, Ts, hd, E);
      kb.linear(p, Ts, hd, E);
      break;
    }
    case LayerKind::MoeExperts:
      if (p == 1 && full) expert_kernels(kb, sh, shape, L, 0, shard_degree);
      expert_kernels(kb, sh, shape, L, p, shard_degree);
      break;
    case LayerKind::Head: {
      // Vocabulary-parallel: each rank's ceil(V / t) columns of the padded vocabulary (core::tp_padded_vocab).
      const std::int64_t columns = tp_padded_vocab(sh.vocab, t) / t;
      const double V = static_cast<double>(columns), Td = static_cast<double>(T), hd = static_cast<double>(h);
      const std::int64_t logits = T * columns;
      const double loss = 5.0 * Td * V;
      kb.high_precision = true;
      if (p == 0) {
        kb.linear(0, Td, hd, V);
        kb.elementwise(KernelKind::Loss, logits, loss);
      } else if (p == 1) {
        kb.elementwise(KernelKind::LossBackward, logits, loss);
        kb.linear(1, Td, hd, V);
      } else {
        kb.linear(2, Td, hd, V);
      }
      break;
    }
  }
  return kb.out;
}

PassKernels segment_kernels(const std::vector<Layer>& layers, int first, int last, const TrainingShape& shape,
                            const ParallelLayout& layout, int shard_degree) {
  PassKernels out;
  for (int p = 0; p < 3; ++p) {
    auto& list = out[static_cast<std::size_t>(p)];
    for (int l = first; l < last && l < static_cast<int>(layers.size()); ++l)
      for (Kernel k : layer_kernels(layers[static_cast<std::size_t>(l)], shape, layout, p, shard_degree)) {
        // Identical launches (the same block repeated) merge: the list stays as long as one block's.
        auto same = std::find_if(list.begin(), list.end(), [&](const Kernel& o) {
          Kernel a = o;
          a.count = k.count;
          return a == k;
        });
        if (same != list.end())
          same->count += k.count;
        else
          list.push_back(k);
      }
  }
  return out;
}

double kernel_flops(const std::vector<Kernel>& ks) {
  double f = 0;
  for (const auto& k : ks) f += k.flops * k.count;
  return f;
}

json kernels_to_json(const PassKernels& pk) {
  static const char* kPass[] = {"F", "BI", "BW"};
  json out = json::object();
  for (int p = 0; p < 3; ++p) {
    json list = json::array();
    for (const auto& k : pk[static_cast<std::size_t>(p)]) {
      json j{{"kind", to_string(k.kind)}, {"dtype", to_string(k.dtype)}, {"flops", k.flops}, {"count", k.count}};
      auto put = [&](const char* key, std::int64_t v, std::int64_t dflt) {
        if (v != dflt) j[key] = v;
      };
      put("m", k.m, 0);
      put("n", k.n, 0);
      put("k", k.k, 0);
      put("batch", k.batch, 1);
      put("head_dim", k.head_dim, 0);
      put("v_dim", k.v_dim, 0);
      put("window", k.window, 0);
      put("elems", k.elems, 0);
      put("bytes", k.bytes, 0);
      if (k.dropout) j["dropout"] = true;
      list.push_back(std::move(j));
    }
    out[kPass[p]] = std::move(list);
  }
  return out;
}

PassKernels kernels_from_json(const json& j, const std::string& where) {
  static const char* kPass[] = {"F", "BI", "BW"};
  auto fail = [&](const std::string& field, const std::string& m) {
    throw PlanError(fmt::format("plan: field '{}{}{}': {}", where, field.empty() ? "" : ".", field, m));
  };
  if (!j.is_object()) fail("", "expected an object with F, BI and BW kernel lists");
  // Unknown keys are refused, as everywhere in a plan (program_json.cpp).
  if (auto u = unknown_field(j, {"F", "BI", "BW"})) fail(u->key, u->message);
  PassKernels out;
  for (int p = 0; p < 3; ++p) {
    if (!j.contains(kPass[p])) continue;
    const json& list = j.at(kPass[p]);
    if (!list.is_array()) fail(kPass[p], "expected an array");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const json& e = list[i];
      const std::string at = fmt::format("{}[{}]", kPass[p], i);
      if (!e.is_object()) fail(at, "expected an object");
      if (auto u = unknown_field(e, {"kind", "dtype", "flops", "count", "m", "n", "k", "batch", "head_dim", "v_dim",
                                     "window", "elems", "bytes", "dropout"}))
        fail(at + "." + u->key, u->message);
      // Sizes are whole numbers: "m": 0.5 was read as 0 (a GEMM of no rows, costed as free).
      for (const char* key : {"m", "n", "k", "batch", "head_dim", "v_dim", "window", "elems", "bytes"})
        if (e.contains(key) && !e.at(key).is_number_integer())
          fail(at + "." + key, "must be a whole number, got " + printable(e.at(key).dump(), 40));
      Kernel k;
      try {
        k.kind = kernel_kind_from_string(e.at("kind").get<std::string>());
        const std::string dt = e.value("dtype", "bf16");
        bool known = false;
        for (Precision p : {Precision::BF16, Precision::FP16, Precision::FP32, Precision::TF32, Precision::FP8})
          if (dt == to_string(p)) k.dtype = p, known = true;
        if (!known) fail(at + ".dtype", "unknown dtype '" + dt + "'");
        k.flops = e.value("flops", 0.0);
        k.count = e.value("count", 1.0);
        k.m = e.value("m", std::int64_t{0});
        k.n = e.value("n", std::int64_t{0});
        k.k = e.value("k", std::int64_t{0});
        k.batch = e.value("batch", std::int64_t{1});
        k.head_dim = e.value("head_dim", std::int64_t{0});
        k.v_dim = e.value("v_dim", std::int64_t{0});
        k.window = e.value("window", std::int64_t{0});
        k.elems = e.value("elems", std::int64_t{0});
        k.bytes = e.value("bytes", std::int64_t{0});
        if (e.contains("dropout") && !e.at("dropout").is_boolean()) fail(at + ".dropout", "expected true or false");
        k.dropout = e.value("dropout", false);
      } catch (const PlanError&) {
        throw;
      } catch (const std::exception& ex) {
        fail(at, std::string("bad kernel: ") + ex.what());
      }
      if (!std::isfinite(k.flops) || k.flops < 0 || !std::isfinite(k.count) || k.count < 0 || k.m < 0 || k.n < 0 ||
          k.k < 0 || k.batch < 1 || k.elems < 0 || k.bytes < 0 || k.head_dim < 0 || k.v_dim < 0 || k.window < 0)
        fail(at, "sizes, flops and count must be finite and >= 0 (batch >= 1)");
      // Upper bounds: a count of 1e300 passed `piper verify` and simulated as 1e6 would (the model
      // saturates). 1e9 launches is past any layers x local experts x context-parallel steps (limits.hpp:
      // 4096 layers, 65536 experts); 1e24 FLOPs is an op's own bound (program_json.cpp, as_flops).
      if (k.count > 1e9) fail(at + ".count", fmt::format("must be <= {:g} launches, got {:g}", 1e9, k.count));
      if (k.flops > 1e24) fail(at + ".flops", fmt::format("must be <= {:g} FLOPs, got {:g}", 1e24, k.flops));
      // The kinds timed from their shape need one: a product of no rows, or an attention core of no
      // tokens, heads or head dimension, was costed as free (its FLOPs over a zero-sized shape).
      std::vector<std::pair<const char*, std::int64_t>> shape;
      if (k.kind == KernelKind::Gemm)
        shape = {{"m", k.m}, {"n", k.n}, {"k", k.k}};
      else if (k.kind == KernelKind::AttentionForward || k.kind == KernelKind::AttentionBackward ||
               is_standard_attention(k.kind))
        shape = {{"m", k.m}, {"n", k.n}, {"head_dim", k.head_dim}, {"v_dim", k.v_dim}};
      for (const auto& [key, v] : shape)
        if (v < 1)
          fail(at + "." + key, fmt::format("a kernel of kind '{}' needs {} >= 1, got {}", to_string(k.kind), key, v));
      out[static_cast<std::size_t>(p)].push_back(k);
    }
  }
  return out;
}

}  // namespace piper::core
