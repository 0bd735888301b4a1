// The model layer list and its cost formulas, the zoo, spec JSON import (Hugging Face: hf_import.cpp), the RAII
// annotation builder, and automatic pipeline-region balancing.
#include "piper/core/model.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"
#include "piper/core/suggest.hpp"
#include "spec_fields.hpp"

namespace piper::core {

using nlohmann::json;
using spec::field_error;
using spec::FieldReader;
using spec::require_object;
using spec::validate_config;

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

int bytes_per_element(Precision p) {
  switch (p) {
    case Precision::BF16:
      return 2;
    case Precision::FP16:
      return 2;
    case Precision::FP32:
      return 4;
    case Precision::TF32:
      return 4;
    case Precision::FP8:
      return 2;
  }
  return 2;
}

bool fp32_storage(Precision p) { return p == Precision::FP32 || p == Precision::TF32; }

int gradient_bytes_per_element(const TrainingShape& t) {
  return t.fp32_main_grads ? 4 : bytes_per_element(t.precision);
}

std::string to_string(Precision p) {
  switch (p) {
    case Precision::BF16:
      return "bf16";
    case Precision::FP16:
      return "fp16";
    case Precision::FP32:
      return "fp32";
    case Precision::TF32:
      return "tf32";
    case Precision::FP8:
      return "fp8";
  }
  return "?";
}

std::string to_string(LayerKind k) {
  switch (k) {
    case LayerKind::Embedding:
      return "embedding";
    case LayerKind::Norm:
      return "norm";
    case LayerKind::Attention:
      return "attention";
    case LayerKind::Mlp:
      return "mlp";
    case LayerKind::MoeRouter:
      return "moe_router";
    case LayerKind::MoeExperts:
      return "moe_experts";
    case LayerKind::Head:
      return "head";
  }
  return "?";
}

Costs& Costs::operator+=(const Costs& o) {
  params += o.params;
  param_bytes += o.param_bytes;
  forward_flops += o.forward_flops;
  backward_input_flops += o.backward_input_flops;
  backward_weight_flops += o.backward_weight_flops;
  activation_bytes += o.activation_bytes;
  output_bytes += o.output_bytes;
  forward_memory_bytes += o.forward_memory_bytes;
  backward_memory_bytes += o.backward_memory_bytes;
  forward_elementwise_bytes += o.forward_elementwise_bytes;
  backward_elementwise_bytes += o.backward_elementwise_bytes;
  forward_tp_bytes += o.forward_tp_bytes;
  backward_tp_bytes += o.backward_tp_bytes;
  forward_tp_collectives += o.forward_tp_collectives;
  backward_tp_collectives += o.backward_tp_collectives;
  forward_cp_bytes += o.forward_cp_bytes;
  backward_cp_bytes += o.backward_cp_bytes;
  forward_cp_steps += o.forward_cp_steps;
  backward_cp_steps += o.backward_cp_steps;
  recompute_flops += o.recompute_flops;
  forward_gemm_kernels += o.forward_gemm_kernels;
  backward_input_gemm_kernels += o.backward_input_gemm_kernels;
  backward_weight_gemm_kernels += o.backward_weight_gemm_kernels;
  return *this;
}

// ---------------------------------------------------------------------------------------------
// Cost formulas. Conventions used by every layer below (per microbatch):
//   T = seq_len * micro_batch_size tokens, s = seq_len, b = micro_batch_size, dt = bytes/element.
//   Matmul FLOPs: T tokens times a KxN weight = 2*T*K*N forward; the input gradient and the weight
//   gradient cost the same again each, so B = 2F (the "6N" rule: Kaplan et al. 2020; Narayanan
//   et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters").
//   Activation bytes follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
//   Transformer Models", Table 2) with dropout removed and FlashAttention (no s^2 score matrix).
//   Memory traffic of matmul layers = weights + inputs + outputs bytes forward; backward reads the
//   weights, the stashed input and the output gradient and writes the input and weight gradients,
//   which we take as 2x the forward traffic.
// ---------------------------------------------------------------------------------------------
namespace {

struct Dims {
  double T, s, b;       // tokens, sequence length, sequences (floating: FLOP products overflow int)
  std::int64_t tokens;  // T as an integer, for byte counts
  std::int64_t dt;      // bytes per element
};

// Standard attention's score-producing batched GEMM (QK^T forward; dP in the backward) writes one
// element per score from its epilogue. Its inputs (q and k, or dO and v) are s x head_dim per head:
// their reads are negligible beside the s x s output once s >> head_dim, so only the write counts.
std::int64_t attention_score_epilogue_bytes(std::int64_t scores, std::int64_t dt) { return scores * dt; }

// Keys each query attends to in the attention core's FLOP count: s (the full s x s matrix, causal
// masking not credited), or min(s, window) for a sliding-window layer run by the flash kernel (a
// windowed flash kernel skips the key blocks outside the band). Standard attention materialises
// the whole s x s score matrix whatever the mask, so it is not credited.
double attention_keys(const LayerShape& sh, double s) {
  if (sh.window > 0 && sh.attention_kernel == AttentionKernel::Flash)
    return std::min(s, static_cast<double>(sh.window));
  return s;
}

// Fills the fields shared by all matmul layers from their weight-matrix element count.
// `gemms` is the number of GEMM kernels those weights run as (forward; the backward runs one
// input-gradient and one weight-gradient kernel per forward GEMM).
void matmul_costs(Costs& c, const Dims& d, std::int64_t matmul_weight_elems, std::int64_t in_elems_per_token,
                  std::int64_t out_bytes_per_token, int gemms) {
  c.forward_gemm_kernels = c.backward_input_gemm_kernels = c.backward_weight_gemm_kernels = gemms;
  c.forward_flops = 2.0 * d.T * static_cast<double>(matmul_weight_elems);
  c.backward_input_flops = c.forward_flops;
  c.backward_weight_flops = c.forward_flops;
  c.forward_memory_bytes =
      matmul_weight_elems * d.dt + d.tokens * in_elems_per_token * d.dt + d.tokens * out_bytes_per_token;
  c.backward_memory_bytes = 2 * c.forward_memory_bytes;
}

Costs embedding_costs(const LayerShape& sh, const Dims& d) {
  Costs c;
  // Token table V*h plus learned absolute positions (GPT-3); RoPE models have max_positions = 0.
  c.params = sh.vocab * sh.hidden + sh.max_positions * sh.hidden;
  // A gather: no FLOPs, one row written per token; the backward is the matching scatter-add.
  c.forward_memory_bytes = d.tokens * sh.hidden * d.dt;
  c.backward_memory_bytes = d.tokens * sh.hidden * d.dt;
  c.activation_bytes = d.tokens * 4;  // int32 token ids, needed to scatter the gradient
  c.output_bytes = d.tokens * sh.hidden * d.dt;
  return c;
}

Costs norm_costs(const LayerShape& sh, const Dims& d) {
  Costs c;
  c.params = sh.norm == NormKind::LayerNorm ? 2 * sh.hidden : sh.hidden;  // gain (+ bias for LayerNorm)
  // ~4 FLOPs per element forward (square/accumulate, scale, gain); backward ~8, of which the weight
  // gradient (product + column sum) is 2. Memory-bound: read x, write y forward; read x, dy, write dx.
  c.forward_flops = 4.0 * d.T * sh.hidden;
  c.backward_input_flops = 6.0 * d.T * sh.hidden;
  c.backward_weight_flops = 2.0 * d.T * sh.hidden;
  c.forward_memory_bytes = 2 * d.tokens * sh.hidden * d.dt;
  c.backward_memory_bytes = 3 * d.tokens * sh.hidden * d.dt;
  c.activation_bytes = d.tokens * sh.hidden * d.dt;  // the input x
  c.output_bytes = d.tokens * sh.hidden * d.dt;
  if (sh.attention_kernel == AttentionKernel::Standard) {
    // Unfused-kernel models: the same traffic, counted as element-wise time (not hidden by GEMMs).
    c.forward_elementwise_bytes = c.forward_memory_bytes;
    c.backward_elementwise_bytes = c.backward_memory_bytes;
    c.forward_memory_bytes = c.backward_memory_bytes = 0;
  }
  return c;
}

// Attention, MHA/GQA or MLA. Core attention (QK^T and AV) is counted over the full s x s matrix,
// as Megatron-LM does (Narayanan et al. 2021), i.e. causal masking is not credited:
//   core F = 2*b*s^2*nh*(qk_dim + v_dim)   (= 4*b*s^2*nh*hd for MHA/GQA)
// and its backward (dQ, dK, dV, dP) is counted entirely in BI as 2x the core forward.
Costs attention_costs(const LayerShape& sh, const Dims& d) {
  Costs c;
  const std::int64_t h = sh.hidden, nh = sh.heads, hd = sh.head_dim;
  const bool mla = sh.kv_lora_rank > 0;
  std::int64_t matmul_elems = 0, other_params = 0, qk_dim = hd, v_dim = hd, stash_elems = 0;
  if (!mla) {
    const std::int64_t nkv = sh.kv_heads;
    matmul_elems = h * (nh * hd) + 2 * h * (nkv * hd) + (nh * hd) * h;  // q, k, v, o
    if (sh.qk_norm) other_params += 2 * hd;                             // Qwen3 per-head q/k RMSNorm
    if (sh.bias)
      other_params += nh * hd + 2 * nkv * hd + h;  // GPT-3: qkv and output biases
    else if (sh.qkv_bias)
      other_params += nh * hd + 2 * nkv * hd;  // Qwen2: q, k, v biases only
    // Stash: input (for dW_qkv), q, k, v (FlashAttention backward), attention output (for dW_o).
    stash_elems = h + nh * hd + 2 * nkv * hd + nh * hd;
  } else {
    // DeepSeek-V3 multi-head latent attention in its training form: the latent projections are
    // applied explicitly (no absorbed-weight inference trick), so this is an approximation of what
    // an optimised kernel executes. head_dim holds qk_nope_head_dim.
    const std::int64_t rope = sh.qk_rope_head_dim, ql = sh.q_lora_rank, kvl = sh.kv_lora_rank;
    qk_dim = hd + rope;
    v_dim = sh.v_head_dim;
    if (ql > 0) {
      matmul_elems += h * ql + ql * nh * qk_dim;  // q_a, q_b
      other_params += ql;                         // q_a_layernorm
    } else {
      matmul_elems += h * nh * qk_dim;  // uncompressed q (DeepSeek-V2-Lite style)
    }
    matmul_elems += h * (kvl + rope) + kvl * nh * (hd + v_dim) + nh * v_dim * h;  // kv_a, kv_b, o
    other_params += kvl;                                                          // kv_a_layernorm
    // Stash: input, q latent, q, kv latent (+ rope key), k, v, attention output.
    stash_elems = h + ql + nh * qk_dim + (kvl + rope) + nh * qk_dim + nh * v_dim + nh * v_dim;
  }
  c.params = matmul_elems + other_params;
  // GEMM kernels: MHA/GQA runs Q, K and V as one fused column-parallel GEMM plus the output
  // projection (Megatron-LM's layout); MLA runs q_a, q_b (or one q), kv_a, kv_b and o.
  const int projections = !mla ? 2 : (sh.q_lora_rank > 0 ? 5 : 4);
  matmul_costs(c, d, matmul_elems, h, h * d.dt, projections);
  const double core_flops =
      2.0 * d.b * d.s * attention_keys(sh, d.s) * static_cast<double>(nh) * static_cast<double>(qk_dim + v_dim);
  c.forward_flops += core_flops;
  c.backward_input_flops += 2.0 * core_flops;
  // The attention core: standard attention is two batched GEMMs forward (QK^T, P·V) and four
  // backward (dP, dV, dS·K, dS^T·Q); FlashAttention is one fused kernel each way.
  const bool standard = sh.attention_kernel == AttentionKernel::Standard;
  c.forward_gemm_kernels += standard ? 2 : 1;
  c.backward_input_gemm_kernels += standard ? 4 : 1;
  c.output_bytes = d.tokens * h * d.dt;
  if (sh.attention_kernel == AttentionKernel::Flash) {
    // FlashAttention keeps fp32 softmax statistics (row max and row sum) per head per query.
    c.activation_bytes = d.tokens * stash_elems * d.dt + d.tokens * 2 * nh * 4;
  } else {
    // Standard attention (Korthikanti et al. 2022, sec. 4.1): the softmax output (2 bytes per score)
    // and, with dropout, its 1-byte mask and the dropout output are stored: 5·a·s²·b bytes in bf16.
    const std::int64_t scores =
        static_cast<std::int64_t>(d.b) * nh * static_cast<std::int64_t>(d.s) * static_cast<std::int64_t>(d.s);
    c.activation_bytes = d.tokens * stash_elems * d.dt + scores * (sh.dropout ? 2 * d.dt + 1 : d.dt);
    // Element-wise kernels: fused scale-mask-softmax (read scores, write probabilities), attention
    // dropout (read, write, mask), and the fused bias-dropout-add after the output projection (read
    // two tensors, write one, mask). Backward: softmax (read probabilities and gradient, write),
    // dropout (read gradient and mask, write), bias-dropout-add (read gradient and mask, write).
    // Plus the epilogue of the two batched GEMMs whose output is the s x s score matrix (QK^T
    // forward, dP = dO·V^T backward): with a head dimension of ~100 their main loop is a few
    // k-steps and each output tile's write to HBM follows it on the SM, so the writes add to the
    // GEMM time (attention_score_epilogue_bytes).
    c.forward_elementwise_bytes = scores * (2 * d.dt + (sh.dropout ? 2 * d.dt + 1 : 0)) +
                                  d.tokens * h * (3 * d.dt + (sh.dropout ? 1 : 0)) +
                                  attention_score_epilogue_bytes(scores, d.dt);
    c.backward_elementwise_bytes = scores * (3 * d.dt + (sh.dropout ? 2 * d.dt + 1 : 0)) +
                                   d.tokens * h * (2 * d.dt + (sh.dropout ? 1 : 0)) +
                                   attention_score_epilogue_bytes(scores, d.dt);
  }
  if (sh.dropout) c.activation_bytes += d.tokens * h;  // 1-byte mask of the dropout after the projection
  return c;
}

Costs mlp_costs(const LayerShape& sh, const Dims& d) {
  Costs c;
  const std::int64_t h = sh.hidden, f = sh.ffn;
  const bool swiglu = sh.activation == MlpActivation::SwiGLU;
  // SwiGLU: gate, up (h x f each) and down (f x h); GELU: up and down.
  const std::int64_t matmul_elems = (swiglu ? 3 : 2) * h * f;
  c.params = matmul_elems + (sh.bias ? f + h : 0);
  // Two GEMM kernels: fc1 (SwiGLU's gate and up fused into one 2f-wide GEMM, as Megatron-LM runs
  // it) and fc2.
  matmul_costs(c, d, matmul_elems, h, h * d.dt, 2);
  // Stash: input, then SwiGLU gate and up outputs and their product / GELU input and output.
  c.activation_bytes = d.tokens * (h + (swiglu ? 3 : 2) * f) * d.dt;
  c.output_bytes = d.tokens * h * d.dt;
  if (sh.dropout) c.activation_bytes += d.tokens * h;  // 1-byte mask of the dropout after the MLP
  if (sh.attention_kernel == AttentionKernel::Standard) {
    // Element-wise kernels: bias + activation (GELU: read, write; SwiGLU: read two, write one) and the
    // fused bias-dropout-add; backward reads the stored input and the gradient and writes the gradient.
    c.forward_elementwise_bytes =
        d.tokens * f * (swiglu ? 3 : 2) * d.dt + d.tokens * h * (3 * d.dt + (sh.dropout ? 1 : 0));
    c.backward_elementwise_bytes =
        d.tokens * f * (swiglu ? 5 : 3) * d.dt + d.tokens * h * (2 * d.dt + (sh.dropout ? 1 : 0));
  }
  return c;
}

Costs router_costs(const LayerShape& sh, const Dims& d) {
  Costs c;
  const std::int64_t h = sh.hidden, e = sh.experts;
  // A linear gate h x E (DeepSeek-V3's E-element score-correction bias is ignored: < 1e-4 of it).
  c.params = h * e;
  matmul_costs(c, d, h * e, h, e * 4, 1);                       // writes fp32 router probabilities
  c.activation_bytes = d.tokens * h * d.dt + d.tokens * e * 4;  // input + fp32 probabilities
  c.output_bytes = d.tokens * h * d.dt;
  return c;
}

Costs experts_costs(const LayerShape& sh, const Dims& d) {
  Costs c;
  const std::int64_t h = sh.hidden, f = sh.ffn, e = sh.experts, k = sh.top_k;
  const std::int64_t per_expert = 3 * h * f;  // SwiGLU experts
  c.params = e * per_expert;
  // Only the T*top_k routed token copies are computed (balanced routing assumed).
  c.forward_flops = 2.0 * d.T * static_cast<double>(k) * static_cast<double>(per_expert);
  c.backward_input_flops = c.forward_flops;
  c.backward_weight_flops = c.forward_flops;
  // Two grouped GEMMs over the local experts (fc1 with gate and up fused, fc2), as Megatron-LM's
  // grouped-GEMM MLP runs them.
  c.forward_gemm_kernels = c.backward_input_gemm_kernels = c.backward_weight_gemm_kernels = 2;
  // Weights of the experts that can receive a token at all, plus routed inputs and outputs.
  const std::int64_t touched = std::min(e, d.tokens * k);
  c.forward_memory_bytes = touched * per_expert * d.dt + 2 * d.tokens * k * h * d.dt;
  c.backward_memory_bytes = 2 * c.forward_memory_bytes;
  c.activation_bytes = d.tokens * k * (h + 3 * f) * d.dt;
  c.output_bytes = d.tokens * h * d.dt;
  return c;
}

Costs head_costs(const LayerShape& sh, const Dims& d) {
  Costs c;
  const std::int64_t h = sh.hidden, v = sh.vocab;
  // A tied head reuses the embedding matrix: no own parameters, same FLOPs (its weight gradient is
  // still computed here and added to the embedding's).
  c.params = sh.tied_with_embedding ? 0 : v * h;
  matmul_costs(c, d, v * h, h, v * 4, 1);  // logits written in fp32
  // Softmax cross-entropy: ~5 FLOPs per logit (max, subtract, exp, sum, log); its backward
  // (recompute softmax, subtract the one-hot) is taken as the same and counted in BI.
  const double loss_flops = 5.0 * d.T * static_cast<double>(v);
  c.forward_flops += loss_flops;
  c.backward_input_flops += loss_flops;
  c.activation_bytes = d.tokens * h * d.dt + d.tokens * v * 4;  // input + fp32 logits
  c.output_bytes = 4;                                           // the scalar loss
  return c;
}

}  // namespace

Costs layer_costs(const Layer& layer, const TrainingShape& shape) {
  const Dims d{static_cast<double>(shape.tokens_per_microbatch()), static_cast<double>(shape.seq_len),
               static_cast<double>(shape.micro_batch_size), shape.tokens_per_microbatch(),
               bytes_per_element(shape.precision)};
  Costs c;
  switch (layer.kind) {
    case LayerKind::Embedding:
      c = embedding_costs(layer.shape, d);
      break;
    case LayerKind::Norm:
      c = norm_costs(layer.shape, d);
      break;
    case LayerKind::Attention:
      c = attention_costs(layer.shape, d);
      break;
    case LayerKind::Mlp:
      c = mlp_costs(layer.shape, d);
      break;
    case LayerKind::MoeRouter:
      c = router_costs(layer.shape, d);
      break;
    case LayerKind::MoeExperts:
      c = experts_costs(layer.shape, d);
      break;
    case LayerKind::Head:
      c = head_costs(layer.shape, d);
      break;
  }
  c.param_bytes = c.params * d.dt;
  return c;
}

// Tensor / sequence parallelism and recomputation (Megatron layout; Korthikanti et al. 2022).
// A layer's stored activations split into three parts:
//   replicated: tensors every TP rank holds whole unless sequence parallelism slices them along the
//     sequence (norm inputs, the inputs of the column-parallel GEMMs, dropout masks on the hidden);
//   split: tensors on the TP-split dimension (q, k, v, the row-parallel inputs, the MLP's ffn-wide
//     intermediates, the vocabulary-parallel logits), divided by t;
//   core: the attention core (softmax statistics, or the scores/softmax/dropout of standard
//     attention), split by heads, and dropped by selective recomputation.
// Their sum at t = 1 is the layer's activation_bytes. For a standard-attention GPT layer with
// dropout this gives Korthikanti's Table 2: sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)) with TP,
// sbh(34 + 5as/h)/t with TP+SP, 34sbh/t with TP+SP+selective; full recomputation keeps only the
// block input 2sbh (2sbh/t with SP: the stored input is the sequence slice).
namespace {

struct ActivationParts {
  std::int64_t replicated = 0, split = 0, core = 0;
};

ActivationParts activation_parts(const Layer& layer, const Costs& base, const TrainingShape& shape) {
  const std::int64_t T = shape.tokens_per_microbatch(), dt = bytes_per_element(shape.precision);
  const std::int64_t h = layer.shape.hidden;
  const std::int64_t mask = layer.shape.dropout ? T * h : 0;
  ActivationParts p;
  switch (layer.kind) {
    case LayerKind::Attention: {
      const std::int64_t nh = layer.shape.heads;
      std::int64_t core = T * 2 * nh * 4;
      if (layer.shape.attention_kernel == AttentionKernel::Standard)
        core = shape.micro_batch_size * nh * shape.seq_len * shape.seq_len * (layer.shape.dropout ? 2 * dt + 1 : dt);
      p.replicated = T * h * dt + mask;
      p.core = core;
      p.split = base.activation_bytes - p.replicated - p.core;
      break;
    }
    case LayerKind::Mlp:
      p.replicated = T * h * dt + mask;
      p.split = base.activation_bytes - p.replicated;
      break;
    case LayerKind::Head:
      p.replicated = T * h * dt;
      p.split = base.activation_bytes - p.replicated;
      break;
    default:  // norms, embedding ids, router, experts: not split by TP
      p.replicated = base.activation_bytes;
  }
  return p;
}

// Forward work of the attention core (QK^T, softmax, dropout, ·V) that selective recomputation redoes.
void attention_core_forward(const Layer& layer, const TrainingShape& shape, double& flops, std::int64_t& elementwise) {
  const LayerShape& sh = layer.shape;
  const std::int64_t qk = sh.kv_lora_rank > 0 ? sh.head_dim + sh.qk_rope_head_dim : sh.head_dim;
  const std::int64_t v = sh.kv_lora_rank > 0 ? sh.v_head_dim : sh.head_dim;
  const double b = static_cast<double>(shape.micro_batch_size), s = static_cast<double>(shape.seq_len);
  flops = 2.0 * b * s * attention_keys(sh, s) * static_cast<double>(sh.heads) * static_cast<double>(qk + v);
  elementwise = 0;
  if (sh.attention_kernel == AttentionKernel::Standard) {
    const std::int64_t dt = bytes_per_element(shape.precision);
    const std::int64_t scores = shape.micro_batch_size * sh.heads * shape.seq_len * shape.seq_len;
    elementwise = scores * (2 * dt + (sh.dropout ? 2 * dt + 1 : 0)) + attention_score_epilogue_bytes(scores, dt);
  }
}

// TorchTitan's op-level selective checkpointing (Recompute::Op) of one layer of a block: the block
// keeps its input (the attention norm's) and the outputs of the attention core and of every other
// matmul, counted in the block's order (1st, 3rd, 5th, ...: for a Llama block with separate wq, wk,
// wv, wo, w1, w3, w2 that is wq, wv, w1 and w2 kept, wk, wo and w3 recomputed); the rest reruns at
// the start of the backward: those matmuls and every element-wise op. Routed experts and the router
// keep their activations (as with selective). t: TP degree, seq: the sequence-parallel divisor.
std::vector<std::pair<std::int64_t, std::int64_t>> op_matmuls(const Layer& layer, bool saved) {
  // (K, N) of the matmuls of the layer, in the block's order, whose output is `saved` (or not).
  const LayerShape& sh = layer.shape;
  std::vector<std::pair<std::int64_t, std::int64_t>> mms;
  int index = 0;  // 1-based position in the block: attention's 4 (MLA: its projections), then the MLP's
  if (layer.kind == LayerKind::Attention) {
    if (sh.kv_lora_rank == 0) {
      mms = {{sh.hidden, sh.heads * sh.head_dim},
             {sh.hidden, sh.kv_heads * sh.head_dim},
             {sh.hidden, sh.kv_heads * sh.head_dim},
             {sh.heads * sh.head_dim, sh.hidden}};
    } else {
      const std::int64_t qk = sh.head_dim + sh.qk_rope_head_dim;
      if (sh.q_lora_rank > 0)
        mms = {{sh.hidden, sh.q_lora_rank}, {sh.q_lora_rank, sh.heads * qk}};
      else
        mms = {{sh.hidden, sh.heads * qk}};
      mms.push_back({sh.hidden, sh.kv_lora_rank + sh.qk_rope_head_dim});
      mms.push_back({sh.kv_lora_rank, sh.heads * (sh.head_dim + sh.v_head_dim)});
      mms.push_back({sh.heads * sh.v_head_dim, sh.hidden});
    }
  } else if (layer.kind == LayerKind::Mlp) {
    index = 4;  // after a (non-MLA) attention's four
    if (sh.activation == MlpActivation::SwiGLU)
      mms = {{sh.hidden, sh.ffn}, {sh.hidden, sh.ffn}, {sh.ffn, sh.hidden}};
    else
      mms = {{sh.hidden, sh.ffn}, {sh.ffn, sh.hidden}};
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  for (const auto& mm : mms)
    if (((++index % 2) == 1) == saved) out.push_back(mm);
  return out;
}

void apply_op_recompute(const Layer& layer, const TrainingShape& shape, int t, int seq, Costs& c) {
  const std::int64_t T = shape.tokens_per_microbatch(), dt = bytes_per_element(shape.precision);
  const LayerShape& sh = layer.shape;
  switch (layer.kind) {
    case LayerKind::Norm:
      // The block's input is the checkpoint's; the norms rerun their forward (as with full).
      c.activation_bytes = layer.name.ends_with("attn_norm") ? T * sh.hidden * dt / seq : 0;
      c.backward_input_flops += c.forward_flops;
      c.recompute_flops += c.forward_flops;
      c.backward_elementwise_bytes += c.forward_elementwise_bytes;
      break;
    case LayerKind::Attention:
    case LayerKind::Mlp: {
      std::int64_t kept = 0;
      for (const auto& [k, n] : op_matmuls(layer, true))
        kept += T * (n == sh.hidden ? n / seq : n / t) * dt;  // a row-parallel output is whole (SP: sliced)
      if (layer.kind == LayerKind::Attention)                 // the core's output and its log-sum-exp (fp32 per head)
        kept += T * (sh.heads * (sh.kv_lora_rank > 0 ? sh.v_head_dim : sh.head_dim) * dt + sh.heads * 4) / t;
      c.activation_bytes = kept;
      double flops = 0;
      for (const auto& [k, n] : op_matmuls(layer, false)) flops += 2.0 * static_cast<double>(T) * k * n / t;
      c.backward_input_flops += flops;
      c.recompute_flops += flops;
      c.backward_input_gemm_kernels += static_cast<int>(op_matmuls(layer, false).size());
      break;
    }
    default:
      break;
  }
}

}  // namespace

std::vector<std::pair<std::int64_t, std::int64_t>> op_recompute_matmuls(const Layer& layer, bool kept) {
  return op_matmuls(layer, kept);
}

namespace {

// Context parallelism (Megatron-LM / TransformerEngine), cp > 1: the sequence is cut into 2·cp chunks
// and device i holds chunks i and 2·cp-1-i, so every per-token quantity is that of seq_len / cp local
// tokens (`local`, costed by the caller) and the causal attention work is the same on every device:
// a ring step pairs the local queries with one device's K/V block, and with this chunking each of the
// cp blocks is half of a (s/cp) x (s/cp) score block once the causal mask is applied (the diagonal
// block by its own mask; a block from an earlier device: every local query against its first chunk;
// from a later one: the second local chunk against both of its chunks). In Costs' full-matrix
// convention (model.cpp: 2·b·s²·heads·(qk + v)), a device's core work is therefore
// cp · 2·b·(s/cp)²·heads·(qk + v) = 1/cp of the sequence's: the local shape's core, cp times.
// Communication (B = one K/V block: b·(s/cp) tokens of K and V over the device's KV heads):
//   ring: F sends its block on cp-1 times (cp-1 steps); B passes K/V around again with the dK/dV
//     accumulators (cp-1 steps of 2B) and returns each accumulator to its owner (one step of B):
//     (2·cp-1)·B in cp steps;
//   all-gather: F all-gathers K/V (cp·B, all-gather units); B gathers them again and reduce-scatters
//     dK/dV (2·cp·B, two calls).
// Recomputation that reruns the attention core (selective, full) reruns its K/V exchange as well.
void context_parallel_costs(const Layer& layer, const TrainingShape& local, const ParallelLayout& L, Costs& c) {
  if (layer.kind != LayerKind::Attention) return;
  const LayerShape& sh = layer.shape;
  const int t = std::max(1, L.tp), cp = L.cp;
  const bool mla = sh.kv_lora_rank > 0;
  const std::int64_t qk = mla ? sh.head_dim + sh.qk_rope_head_dim : sh.head_dim;
  const std::int64_t v = mla ? sh.v_head_dim : sh.head_dim;
  const double b = static_cast<double>(local.micro_batch_size), s = static_cast<double>(local.seq_len);
  const double core = 2.0 * b * s * s * static_cast<double>(sh.heads) * static_cast<double>(qk + v) / t;
  const double extra = (cp - 1) * core;
  c.forward_flops += extra;
  c.backward_input_flops += 2 * extra;
  const bool reruns_core = L.recompute == 1 || (L.recompute == 2 && layer.block >= 0);
  if (reruns_core) {
    c.backward_input_flops += extra;
    c.recompute_flops += extra;
  }
  // K and V per token on this device: its share of the KV heads (MLA: every head's k and v).
  const std::int64_t kv_per_token =
      mla ? sh.heads * (qk + v) / t : 2 * std::max<std::int64_t>(1, sh.kv_heads / t) * sh.head_dim;
  const std::int64_t block = local.tokens_per_microbatch() * kv_per_token * bytes_per_element(local.precision);
  if (L.cp_all_gather) {
    c.forward_cp_bytes = cp * block;
    c.forward_cp_steps = 1;
    c.backward_cp_bytes = 2 * cp * block;
    c.backward_cp_steps = 2;
  } else {
    c.forward_cp_bytes = (cp - 1) * block;
    c.forward_cp_steps = cp - 1;
    c.backward_cp_bytes = (2 * cp - 1) * block;
    c.backward_cp_steps = cp;
  }
  if (reruns_core) {
    c.backward_cp_bytes += c.forward_cp_bytes;
    c.backward_cp_steps += c.forward_cp_steps;
  }
}

}  // namespace

TrainingShape context_parallel_local_shape(const TrainingShape& shape, int cp) {
  TrainingShape local = shape;
  local.seq_len = shape.seq_len / std::max(1, cp);
  return local;
}

// The cost formulas of every layer kind (FLOPs, bytes, kernel lists by pass), one case per kind; the
// cases share the layout's sharding factors computed at the top.
Costs layer_costs(const Layer& layer, const TrainingShape& shape,  // NOLINT(readability-function-size)
                  const ParallelLayout& L) {
  if (L.cp > 1) {
    ParallelLayout inner = L;
    inner.cp = 1;
    inner.cp_all_gather = false;
    const TrainingShape local = context_parallel_local_shape(shape, L.cp);
    Costs c = layer_costs(layer, local, inner);
    context_parallel_costs(layer, local, L, c);
    return c;
  }
  const Costs base = layer_costs(layer, shape);
  const int t = std::max(1, L.tp);
  if (t == 1 && L.recompute == 0 && L.token_split <= 1) return base;
  const std::int64_t T = shape.tokens_per_microbatch(), dt = bytes_per_element(shape.precision);
  const std::int64_t h = layer.shape.hidden;
  const std::int64_t N = T * h * dt;            // one full hidden-state tensor of the microbatch
  const int seq = L.sequence_parallel ? t : 1;  // divisor of sequence-sliced work
  const bool block = layer.block >= 0;
  Costs c = base;
  const ActivationParts parts = activation_parts(layer, base, shape);
  auto div_all = [&](Costs& x, int k) {
    x.forward_flops /= k;
    x.backward_input_flops /= k;
    x.backward_weight_flops /= k;
    x.forward_memory_bytes /= k;
    x.backward_memory_bytes /= k;
    x.forward_elementwise_bytes /= k;
    x.backward_elementwise_bytes /= k;
  };
  switch (layer.kind) {
    case LayerKind::Attention:
    case LayerKind::Mlp:
      // Column- then row-parallel GEMMs: weights, FLOPs and the ffn/head-wide traffic divide by t;
      // the bias-dropout-add on the hidden after the row-parallel GEMM is replicated (SP: sliced).
      div_all(c, t);
      c.params = base.params / t;
      if (layer.shape.attention_kernel == AttentionKernel::Standard) {
        const std::int64_t m = layer.shape.dropout ? 1 : 0;
        const std::int64_t hf = T * h * (3 * dt + m), hb = T * h * (2 * dt + m);
        c.forward_elementwise_bytes = (base.forward_elementwise_bytes - hf) / t + hf / seq;
        c.backward_elementwise_bytes = (base.backward_elementwise_bytes - hb) / t + hb / seq;
      }
      if (t > 1) {
        // F: all-reduce after the row-parallel GEMM (SP: all-gather before the column-parallel
        // GEMM + reduce-scatter after the row-parallel one); B (input gradient): the mirror.
        c.forward_tp_bytes = c.backward_tp_bytes = 2 * N;
        c.forward_tp_collectives = c.backward_tp_collectives = L.sequence_parallel ? 2 : 1;
      }
      break;
    case LayerKind::Head:
      div_all(c, t);
      c.params = base.params / t;
      if (t > 1) {
        // Vocabulary-parallel head: SP all-gathers its input; parallel cross-entropy all-reduces
        // the row max, the target logit and the exp-sum (fp32 per token); B all-reduces the input
        // gradient (SP: reduce-scatters it).
        c.forward_tp_bytes = (L.sequence_parallel ? N : 0) + 3 * 2 * T * 4;
        c.forward_tp_collectives = (L.sequence_parallel ? 1 : 0) + 3;
        c.backward_tp_bytes = L.sequence_parallel ? N : 2 * N;
        c.backward_tp_collectives = 1;
      }
      break;
    case LayerKind::Embedding:
      // Vocabulary-parallel rows (learned positions are replicated); the lookup's output is
      // all-reduced (SP: reduce-scattered); its dropout runs on the sequence slice with SP.
      c.params = layer.shape.vocab * h / t + layer.shape.max_positions * h;
      div_all(c, seq);
      if (t > 1) {
        c.forward_tp_bytes = L.sequence_parallel ? N : 2 * N;
        c.forward_tp_collectives = 1;
        c.backward_tp_bytes = L.sequence_parallel ? N : 0;  // SP: gather the output gradient
        c.backward_tp_collectives = L.sequence_parallel ? 1 : 0;
      }
      break;
    case LayerKind::MoeExperts: {
      // Expert tensor parallelism (ETP degree t) over tokens sliced s ways by the stage's SP: a device
      // receives T·k/s routed rows from its EP group, its ETP group all-gathers them (t·T·k/s rows),
      // and it runs 1/t of each local expert's FFN on them (fc1 column-, fc2 row-parallel, then a
      // reduce-scatter back to its own rows): the FLOPs of T·k/s rows, whatever t.
      const int s = std::max(1, L.token_split);
      div_all(c, s);
      const std::int64_t f = layer.shape.ffn, k = layer.shape.top_k, rows = T * k / s;
      const std::int64_t touched = std::min(layer.shape.experts, T * k);
      c.params = base.params / t;
      c.forward_memory_bytes = touched * 3 * h * f * dt / t + 2 * t * rows * h * dt;
      c.backward_memory_bytes = 2 * c.forward_memory_bytes;
      if (t > 1) {
        // F: all-gather of the routed rows before fc1, reduce-scatter after fc2; B: the mirror.
        c.forward_tp_bytes = c.backward_tp_bytes = 2 * t * rows * h * dt;
        c.forward_tp_collectives = c.backward_tp_collectives = 2;
      }
      break;
    }
    default:
      // Norms and the router: replicated weights; their work is sliced by SP only.
      div_all(c, seq);
  }
  c.param_bytes = c.params * dt;
  // Stored activations.
  const bool selective = L.recompute == 1, full = L.recompute == 2 && block, op = L.recompute == 3 && block;
  c.activation_bytes = parts.replicated / seq + parts.split / t + (selective ? 0 : parts.core / t);
  if (layer.kind == LayerKind::MoeExperts)  // the gathered routed rows and the local 1/t of the FFN's
    c.activation_bytes = T * layer.shape.top_k / std::max(1, L.token_split) * (t * h + 3 * layer.shape.ffn) * dt;
  if (full) c.activation_bytes = layer.name.ends_with("attn_norm") ? N / seq : 0;
  if (op) apply_op_recompute(layer, shape, t, seq, c);
  // Recomputed forward work runs at the start of the backward (input-gradient) pass.
  if (selective && layer.kind == LayerKind::Attention) {
    double flops = 0;
    std::int64_t elementwise = 0;
    attention_core_forward(layer, shape, flops, elementwise);
    c.backward_input_flops += flops / t;
    c.recompute_flops += flops / t;
    c.backward_elementwise_bytes += elementwise / t;
    c.backward_input_gemm_kernels += layer.shape.attention_kernel == AttentionKernel::Standard ? 2 : 1;
  }
  if (full) {
    c.backward_input_gemm_kernels += c.forward_gemm_kernels;
    c.backward_input_flops += c.forward_flops;
    c.recompute_flops += c.forward_flops;
    c.backward_memory_bytes += c.forward_memory_bytes;
    c.backward_elementwise_bytes += c.forward_elementwise_bytes;
    c.backward_tp_bytes += c.forward_tp_bytes;
    c.backward_tp_collectives += c.forward_tp_collectives;
  }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------------------------

Model::Model(std::string name, std::vector<Layer> layers, TrainingShape training)
    : name_(std::move(name)), layers_(std::move(layers)), training_(training) {}

std::int64_t Model::parameter_count() const {
  std::int64_t n = 0;
  for (const auto& l : layers_) n += layer_costs(l, training_).params;
  return n;
}

int Model::pp_regions() const {
  int regions = 0;
  for (const auto& l : layers_) {
    auto it = l.tags.find("PP");
    if (it != l.tags.end()) regions = std::max(regions, it->second + 1);
  }
  return regions;
}

// ---------------------------------------------------------------------------------------------
// Config validation and build_model
// ---------------------------------------------------------------------------------------------
namespace spec {

namespace {
// moe.routing_groups must split the experts evenly; the limit lies in [1, groups].
void validate_routing_groups(const ModelConfig& c, const std::string& where) {
  if (c.routing_groups == 0) {
    if (c.routing_group_limit != 0)
      field_error(where, "moe.routing_group_limit", "needs moe.routing_groups (the number of expert groups)");
    return;
  }
  if (c.routing_groups < 0 || c.experts % c.routing_groups != 0)
    field_error(where, "moe.routing_groups",
                "must be a positive integer that divides moe.experts (" + std::to_string(c.experts) + ")");
  if (c.routing_group_limit < 1 || c.routing_group_limit > c.routing_groups)
    field_error(where, "moe.routing_group_limit",
                "must lie between 1 and moe.routing_groups (" + std::to_string(c.routing_groups) + ")");
}
}  // namespace

void validate_config(const ModelConfig& c, const std::string& where) {
  auto positive = [&](std::int64_t v, const char* field) {
    if (v <= 0) field_error(where, field, "must be a positive integer");
  };
  auto non_negative = [&](std::int64_t v, const char* field) {
    if (v < 0) field_error(where, field, "must be a non-negative integer");
  };
  positive(c.vocab, "vocab");
  positive(c.hidden, "hidden");
  positive(c.layers, "layers");
  positive(c.heads, "heads");
  positive(c.kv_heads, "kv_heads");
  positive(c.head_dim, "head_dim");
  if (c.heads % c.kv_heads != 0) field_error(where, "kv_heads", "must divide heads (" + std::to_string(c.heads) + ")");
  non_negative(c.ffn, "ffn");
  non_negative(c.max_positions, "max_positions");
  non_negative(c.experts, "moe.experts");
  const bool has_dense_block = c.experts == 0 || c.first_dense_layers > 0;
  if (has_dense_block && c.ffn <= 0)
    field_error(where, "ffn", "must be a positive integer (the model has dense blocks)");
  if (c.experts > 0) {
    positive(c.top_k, "moe.top_k");
    if (c.top_k > c.experts)
      field_error(where, "moe.top_k", "must not exceed moe.experts (" + std::to_string(c.experts) + ")");
    positive(c.expert_ffn, "moe.expert_ffn");
    non_negative(c.shared_experts, "moe.shared_experts");
    if (c.shared_experts > 0) positive(c.shared_expert_ffn, "moe.shared_expert_ffn");
    non_negative(c.first_dense_layers, "moe.first_dense_layers");
    if (c.first_dense_layers > c.layers)
      field_error(where, "moe.first_dense_layers", "must not exceed layers (" + std::to_string(c.layers) + ")");
    validate_routing_groups(c, where);
  }
  non_negative(c.kv_lora_rank, "mla.kv_lora_rank");
  non_negative(c.q_lora_rank, "mla.q_lora_rank");
  if (c.kv_lora_rank > 0) {
    positive(c.qk_rope_head_dim, "mla.qk_rope_head_dim");
    positive(c.v_head_dim, "mla.v_head_dim");
  } else if (c.q_lora_rank > 0) {
    field_error(where, "mla.kv_lora_rank", "must be positive when mla.q_lora_rank is set");
  }
  non_negative(c.sliding_window, "sliding_window.window");
  non_negative(c.global_every, "sliding_window.global_every");
  if (c.global_every > 0 && c.sliding_window == 0)
    field_error(where, "sliding_window.global_every", "needs a positive sliding_window.window");
  positive(c.training.seq_len, "training.seq_len");
  positive(c.training.micro_batch_size, "training.micro_batch_size");
  // Resource limits (limits.hpp): past them the DAG would not fit in memory or the costs (int64
  // bytes) would overflow; checked here so every front end (spec, HF config, flags) is covered.
  auto within = [&](Limit l, std::int64_t v, const char* field, const char* unit) {
    check_limit(l, v, where + ": field '" + field + "'", unit);
  };
  within(Limit::Layers, c.layers, "layers", "layers");
  const std::pair<std::int64_t, const char*> widths[] = {{c.vocab, "vocab"},
                                                         {c.hidden, "hidden"},
                                                         {c.ffn, "ffn"},
                                                         {c.heads, "heads"},
                                                         {c.kv_heads, "kv_heads"},
                                                         {c.head_dim, "head_dim"},
                                                         {c.max_positions, "max_positions"},
                                                         {c.expert_ffn, "moe.expert_ffn"},
                                                         {c.shared_expert_ffn, "moe.shared_expert_ffn"},
                                                         {c.q_lora_rank, "mla.q_lora_rank"},
                                                         {c.kv_lora_rank, "mla.kv_lora_rank"},
                                                         {c.qk_rope_head_dim, "mla.qk_rope_head_dim"},
                                                         {c.v_head_dim, "mla.v_head_dim"}};
  for (const auto& [value, field] : widths) within(Limit::ModelWidth, value, field, "");
  within(Limit::Experts, c.experts, "moe.experts", "experts");
  within(Limit::Experts, c.shared_experts, "moe.shared_experts", "shared experts");
  within(Limit::TokensPerMicrobatch, c.training.seq_len, "training.seq_len", "tokens");
  within(Limit::TokensPerMicrobatch, c.training.micro_batch_size, "training.micro_batch_size", "sequences");
  within(Limit::TokensPerMicrobatch, c.training.seq_len * c.training.micro_batch_size, "training",
         "tokens per microbatch");
  // Learned absolute positions (GPT) have one row per position: a longer sequence has none to read.
  if (c.max_positions > 0 && c.training.seq_len > c.max_positions)
    field_error(where, "training.seq_len",
                std::to_string(c.training.seq_len) + " exceeds max_positions " + std::to_string(c.max_positions) +
                    " (the model's learned positions)");
}

}  // namespace spec

Model build_model(const ModelConfig& c) {
  validate_config(c, c.name.empty() ? "model" : c.name);
  std::vector<Layer> layers;
  auto add = [&](std::string name, LayerKind kind, LayerShape shape, int block, TagMap tags = {}) {
    layers.push_back(Layer{std::move(name), kind, shape, std::move(tags), block});
  };

  LayerShape norm;
  norm.hidden = c.hidden;
  norm.norm = c.norm;
  norm.attention_kernel = c.attention_kernel;

  LayerShape embed;
  embed.vocab = c.vocab;
  embed.hidden = c.hidden;
  embed.max_positions = c.max_positions;

  LayerShape attn;
  attn.hidden = c.hidden;
  attn.heads = c.heads;
  attn.kv_heads = c.kv_heads;
  attn.head_dim = c.head_dim;
  attn.q_lora_rank = c.q_lora_rank;
  attn.kv_lora_rank = c.kv_lora_rank;
  attn.qk_rope_head_dim = c.qk_rope_head_dim;
  attn.v_head_dim = c.v_head_dim;
  attn.qk_norm = c.qk_norm;
  attn.bias = c.bias;
  attn.qkv_bias = c.qkv_bias;
  attn.attention_kernel = c.attention_kernel;
  attn.dropout = c.dropout;

  auto mlp_shape = [&](std::int64_t ffn) {
    LayerShape m;
    m.hidden = c.hidden;
    m.ffn = ffn;
    m.activation = c.activation;
    m.bias = c.bias;
    m.attention_kernel = c.attention_kernel;
    m.dropout = c.dropout;
    return m;
  };
  LayerShape moe;
  moe.hidden = c.hidden;
  moe.experts = c.experts;
  moe.top_k = c.top_k;
  moe.routing_groups = c.routing_groups;
  moe.routing_group_limit = c.routing_group_limit;
  LayerShape experts = moe;
  experts.ffn = c.expert_ffn;

  add("embed", LayerKind::Embedding, embed, -1);
  int moe_block = 0;
  for (int i = 0; i < static_cast<int>(c.layers); ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    add(p + "attn_norm", LayerKind::Norm, norm, i);
    LayerShape block_attn = attn;
    block_attn.window = c.block_uses_window(i) ? c.sliding_window : 0;
    add(p + "attn", LayerKind::Attention, block_attn, i);
    add(p + "mlp_norm", LayerKind::Norm, norm, i);
    if (c.experts == 0 || i < c.first_dense_layers) {
      add(p + "mlp", LayerKind::Mlp, mlp_shape(c.ffn), i);
    } else {
      // Shared experts see every token, so they are one dense MLP of the summed width.
      if (c.shared_experts > 0)
        add(p + "shared_mlp", LayerKind::Mlp, mlp_shape(c.shared_experts * c.shared_expert_ffn), i);
      add(p + "router", LayerKind::MoeRouter, moe, i);
      add(p + "experts", LayerKind::MoeExperts, experts, i, TagMap{{"EP", moe_block++}});
    }
  }
  add("norm", LayerKind::Norm, norm, -1);
  LayerShape head;
  head.vocab = c.vocab;
  head.hidden = c.hidden;
  head.tied_with_embedding = c.tie_embeddings;
  add("head", LayerKind::Head, head, -1);
  Model model(c.name, std::move(layers), c.training);
  model.set_config(c);
  return model;
}

// ---------------------------------------------------------------------------------------------
// Zoo
// ---------------------------------------------------------------------------------------------
namespace {

ModelConfig qwen3_shape(std::string name, std::int64_t vocab, std::int64_t hidden, std::int64_t layers,
                        std::int64_t heads, std::int64_t kv, std::int64_t head_dim, std::int64_t experts,
                        std::int64_t top_k, std::int64_t expert_ffn) {
  ModelConfig c;
  c.name = std::move(name);
  c.vocab = vocab;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = heads;
  c.kv_heads = kv;
  c.head_dim = head_dim;
  c.qk_norm = true;
  c.experts = experts;
  c.top_k = top_k;
  c.expert_ffn = expert_ffn;
  return c;
}

ModelConfig llama3(std::string name, std::int64_t hidden, std::int64_t layers, std::int64_t heads, std::int64_t ffn) {
  ModelConfig c;
  c.name = std::move(name);
  c.vocab = 128256;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = heads;
  c.kv_heads = 8;
  c.head_dim = 128;
  c.ffn = ffn;
  return c;
}

}  // namespace

std::vector<std::string> zoo_names() {
  return {"qwen3-9m", "qwen3-1b", "qwen3-9b", "qwen3-30b-a3b", "llama3-8b", "llama3-70b", "gpt3-175b", "deepseek-v3"};
}

std::optional<ModelConfig> zoo_config(const std::string& name) {
  if (name == "qwen3-9m") {
    auto c = qwen3_shape(name, 2048, 256, 4, 8, 4, 32, 8, 2, 128);
    c.training.seq_len = 256;  // tiny: CPU tests run it for real
    return c;
  }
  if (name == "qwen3-1b") return qwen3_shape(name, 151936, 1024, 16, 16, 8, 64, 4, 2, 3584);
  if (name == "qwen3-9b") return qwen3_shape(name, 151936, 2048, 24, 32, 8, 64, 8, 2, 7168);
  if (name == "qwen3-30b-a3b") {
    auto c = qwen3_shape(name, 151936, 2048, 48, 32, 4, 128, 128, 8, 768);
    c.ffn = 6144;  // HF intermediate_size; unused since every block is MoE
    return c;
  }
  if (name == "llama3-8b") return llama3(name, 4096, 32, 32, 14336);
  if (name == "llama3-70b") return llama3(name, 8192, 80, 64, 28672);
  if (name == "gpt3-175b") {
    ModelConfig c;
    c.name = name;
    c.vocab = 50257;
    c.hidden = 12288;
    c.layers = 96;
    c.heads = 96;
    c.kv_heads = 96;
    c.head_dim = 128;
    c.ffn = 49152;
    c.activation = MlpActivation::GELU;
    c.norm = NormKind::LayerNorm;
    c.bias = true;
    c.tie_embeddings = true;
    c.max_positions = 2048;
    c.training.seq_len = 2048;
    return c;
  }
  if (name == "deepseek-v3") {
    ModelConfig c;
    c.name = name;
    c.vocab = 129280;
    c.hidden = 7168;
    c.layers = 61;
    c.heads = 128;
    c.kv_heads = 128;
    c.head_dim = 128;  // qk_nope_head_dim
    c.ffn = 18432;
    c.experts = 256;
    c.top_k = 8;
    c.expert_ffn = 2048;
    c.shared_experts = 1;
    c.shared_expert_ffn = 2048;
    c.first_dense_layers = 3;
    c.routing_groups = 8;  // config.json n_group / topk_group: each token reaches at most 4 nodes
    c.routing_group_limit = 4;
    c.q_lora_rank = 1536;
    c.kv_lora_rank = 512;
    c.qk_rope_head_dim = 64;
    c.v_head_dim = 128;
    return c;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// JSON: our spec format and Hugging Face config.json
// ---------------------------------------------------------------------------------------------
namespace {

MlpActivation parse_activation(const FieldReader& r, const std::string& s) {
  if (s == "swiglu") return MlpActivation::SwiGLU;
  if (s == "gelu") return MlpActivation::GELU;
  r.fail("activation", "unknown activation '" + s + "' (expected \"swiglu\" or \"gelu\")");
}
NormKind parse_norm(const FieldReader& r, const std::string& s) {
  if (s == "rmsnorm") return NormKind::RMSNorm;
  if (s == "layernorm") return NormKind::LayerNorm;
  r.fail("norm", "unknown norm '" + s + "' (expected \"rmsnorm\" or \"layernorm\")");
}
Precision parse_precision(const FieldReader& r, const std::string& s) {
  if (s == "bf16") return Precision::BF16;
  if (s == "fp16") return Precision::FP16;
  if (s == "fp32") return Precision::FP32;
  if (s == "tf32") return Precision::TF32;
  if (s == "fp8") return Precision::FP8;
  r.fail("precision", "unknown precision '" + s + "' (expected \"bf16\", \"fp16\", \"fp32\", \"tf32\" or \"fp8\")");
}

}  // namespace

ModelConfig config_from_spec_json(const json& j, const std::string& where) {
  require_object(j, where, "model spec");
  FieldReader r(j, where);
  r.reject_unknown({"name",      "description",    "vocab",         "hidden",        "layers", "heads",
                    "kv_heads",  "head_dim",       "ffn",           "activation",    "norm",   "qk_norm",
                    "bias",      "tie_embeddings", "max_positions", "moe",           "mla",    "training",
                    "attention", "dropout",        "qkv_bias",      "sliding_window"});
  ModelConfig c;
  auto name = r.opt_string("name");
  if (!name || name->empty()) r.fail("name", "missing required field (a non-empty string)");
  c.name = *name;
  c.vocab = r.req_positive("vocab");
  c.hidden = r.req_positive("hidden");
  c.layers = r.req_positive("layers");
  c.heads = r.req_positive("heads");
  c.kv_heads = r.positive_or("kv_heads", c.heads);
  if (!r.has("head_dim") && c.hidden % c.heads != 0)
    r.fail("head_dim", "missing, and hidden is not divisible by heads");
  c.head_dim = r.positive_or("head_dim", c.hidden / c.heads);
  c.ffn = r.non_negative_or("ffn", 0);
  c.activation = parse_activation(r, r.opt_string("activation").value_or("swiglu"));
  c.norm = parse_norm(r, r.opt_string("norm").value_or("rmsnorm"));
  c.qk_norm = r.bool_or("qk_norm", false);
  c.bias = r.bool_or("bias", false);
  c.qkv_bias = r.bool_or("qkv_bias", false);
  c.tie_embeddings = r.bool_or("tie_embeddings", false);
  c.max_positions = r.non_negative_or("max_positions", 0);
  {
    const std::string kernel = r.opt_string("attention").value_or("flash");
    if (kernel == "flash")
      c.attention_kernel = AttentionKernel::Flash;
    else if (kernel == "standard")
      c.attention_kernel = AttentionKernel::Standard;
    else
      r.fail("attention", "must be \"flash\" or \"standard\", got \"" + kernel + "\"");
  }
  if (r.has("dropout")) {
    const json& p = j.at("dropout");
    if (!p.is_number() || p.get<double>() < 0 || p.get<double>() >= 1)
      r.fail("dropout", "must be a probability in [0, 1)");
    c.dropout_probability = p.get<double>();
    c.dropout = c.dropout_probability > 0;
  }
  if (const json* moe = r.opt_object("moe")) {
    FieldReader m(*moe, where, "moe.");
    m.reject_unknown({"experts", "top_k", "expert_ffn", "shared_experts", "shared_expert_ffn", "first_dense_layers",
                      "routing_groups", "routing_group_limit"});
    c.experts = m.req_positive("experts");
    c.top_k = m.req_positive("top_k");
    c.expert_ffn = m.req_positive("expert_ffn");
    c.shared_experts = m.non_negative_or("shared_experts", 0);
    c.shared_expert_ffn = m.positive_or("shared_expert_ffn", c.shared_experts > 0 ? c.expert_ffn : 0);
    c.first_dense_layers = m.non_negative_or("first_dense_layers", 0);
    c.routing_groups = m.non_negative_or("routing_groups", 0);
    c.routing_group_limit = m.non_negative_or("routing_group_limit", c.routing_groups);
  }
  if (const json* sw = r.opt_object("sliding_window")) {
    FieldReader m(*sw, where, "sliding_window.");
    m.reject_unknown({"window", "global_every"});
    c.sliding_window = m.req_positive("window");
    c.global_every = m.non_negative_or("global_every", 0);
  }
  if (const json* mla = r.opt_object("mla")) {
    FieldReader m(*mla, where, "mla.");
    m.reject_unknown({"q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"});
    c.q_lora_rank = m.non_negative_or("q_lora_rank", 0);
    c.kv_lora_rank = m.req_positive("kv_lora_rank");
    c.qk_rope_head_dim = m.req_positive("qk_rope_head_dim");
    c.v_head_dim = m.req_positive("v_head_dim");
  }
  if (const json* tr = r.opt_object("training")) {
    FieldReader t(*tr, where, "training.");
    t.reject_unknown({"seq_len", "micro_batch_size", "precision", "fp32_main_grads"});
    c.training.seq_len = t.positive_or("seq_len", c.training.seq_len);
    c.training.micro_batch_size = t.positive_or("micro_batch_size", c.training.micro_batch_size);
    c.training.precision = parse_precision(t, t.opt_string("precision").value_or("bf16"));
    c.training.fp32_main_grads = t.bool_or("fp32_main_grads", false);
  }
  validate_config(c, where);
  return c;
}

json config_to_spec_json(const ModelConfig& c) {
  json j;
  j["name"] = c.name;
  j["vocab"] = c.vocab;
  j["hidden"] = c.hidden;
  j["layers"] = c.layers;
  j["heads"] = c.heads;
  j["kv_heads"] = c.kv_heads;
  j["head_dim"] = c.head_dim;
  j["ffn"] = c.ffn;
  j["activation"] = c.activation == MlpActivation::SwiGLU ? "swiglu" : "gelu";
  j["norm"] = c.norm == NormKind::RMSNorm ? "rmsnorm" : "layernorm";
  j["qk_norm"] = c.qk_norm;
  j["bias"] = c.bias;
  if (c.qkv_bias) j["qkv_bias"] = true;
  j["tie_embeddings"] = c.tie_embeddings;
  j["max_positions"] = c.max_positions;
  if (c.attention_kernel == AttentionKernel::Standard) j["attention"] = "standard";
  if (c.sliding_window > 0) {
    j["sliding_window"] = {{"window", c.sliding_window}};
    if (c.global_every > 0) j["sliding_window"]["global_every"] = c.global_every;
  }
  if (c.dropout) j["dropout"] = c.dropout_probability;
  if (c.experts > 0) {
    j["moe"] = {{"experts", c.experts},
                {"top_k", c.top_k},
                {"expert_ffn", c.expert_ffn},
                {"shared_experts", c.shared_experts},
                {"first_dense_layers", c.first_dense_layers}};
    if (c.shared_experts > 0) j["moe"]["shared_expert_ffn"] = c.shared_expert_ffn;
    if (c.routing_groups > 0) {
      j["moe"]["routing_groups"] = c.routing_groups;
      j["moe"]["routing_group_limit"] = c.routing_group_limit;
    }
  }
  if (c.kv_lora_rank > 0) {
    j["mla"] = {{"q_lora_rank", c.q_lora_rank},
                {"kv_lora_rank", c.kv_lora_rank},
                {"qk_rope_head_dim", c.qk_rope_head_dim},
                {"v_head_dim", c.v_head_dim}};
  }
  j["training"] = {{"seq_len", c.training.seq_len},
                   {"micro_batch_size", c.training.micro_batch_size},
                   {"precision", to_string(c.training.precision)}};
  if (c.training.fp32_main_grads) j["training"]["fp32_main_grads"] = true;
  return j;
}

ModelConfig load_model_config(const std::string& name_or_path) {
  if (auto z = zoo_config(name_or_path)) return *z;
  std::filesystem::path path(name_or_path);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) path /= "config.json";  // an HF checkpoint folder
  if (!std::filesystem::exists(path, ec) || !std::ifstream(path)) {
    std::string names;
    for (const auto& n : zoo_names()) names += (names.empty() ? "" : ", ") + n;
    throw ModelError(name_or_path + ": neither a zoo model (" + names + ") nor a readable file");
  }
  const std::string where = path.string();
  return config_from_text(read_input_file(where), where);
}

ModelConfig config_from_text(const std::string& text, const std::string& where) {
  json j;
  try {
    j = parse_json(text, where);
  } catch (const json::exception& e) {  // also number overflow (out_of_range.406)
    std::string reason = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix; the rest is one readable line.
    if (auto pos = reason.find("] "); pos != std::string::npos) reason = reason.substr(pos + 2);
    throw ModelError(where + ": not JSON: " + reason);
  }
  if (!j.is_object()) throw ModelError(where + ": expected a JSON object");
  if (j.contains("model_type") || j.contains("architectures")) return config_from_hf_json(j, where);
  return config_from_spec_json(j, where);
}

// ---------------------------------------------------------------------------------------------
// Pipeline regions
// ---------------------------------------------------------------------------------------------
namespace {

void clear_pp_tags(Model& model) {
  for (auto& l : model.mutable_layers()) l.tags.erase("PP");
}

// Pipeline units: maximal runs of layers with the same block index; the embedding travels with the
// first block and the final norm + head with the last block (as in Megatron), so every region holds
// at least one transformer block. Regions are contiguous runs of units.
struct PipelineUnit {
  std::size_t first, last;  // layer range [first, last)
  double flops;             // F + BI + BW at the model's training shape
};

std::vector<PipelineUnit> pipeline_units(const Model& model, PipelineEnds ends = {}) {
  const auto& layers = model.layers();
  std::vector<PipelineUnit> units;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const Costs c = model.layer_cost(i);
    const double f = c.forward_flops + c.backward_flops();
    if (units.empty() || layers[units.back().first].block != layers[i].block)
      units.push_back({i, i + 1, f});
    else {
      units.back().last = i + 1;
      units.back().flops += f;
    }
  }
  // An end unit asked for as a region of its own stays a unit of its own.
  const bool front_end = !units.empty() && layers[units.front().first].block < 0;
  const bool back_end = !units.empty() && layers[units.back().first].block < 0;
  if (ends.embedding && !front_end)
    throw ModelError(model.name() +
                     ": the embedding cannot be a PP region of its own: the model has no layers before "
                     "its first block");
  if (ends.head && !back_end)
    throw ModelError(model.name() +
                     ": the head cannot be a PP region of its own: the model has no layers after its "
                     "last block");
  if (!ends.embedding && units.size() >= 3 && front_end) {
    units[1].first = units[0].first;
    units[1].flops += units[0].flops;
    units.erase(units.begin());
  }
  if (!ends.head && units.size() >= 2 && back_end) {
    units[units.size() - 2].last = units.back().last;
    units[units.size() - 2].flops += units.back().flops;
    units.pop_back();
  }
  return units;
}

// Starts of K contiguous regions over `flops` (unit costs) that minimise the largest region cost and,
// among those, the sum of squared region costs.
std::vector<int> balanced_starts(const std::vector<double>& flops, int K) {
  const int n = static_cast<int>(flops.size());
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + flops[static_cast<std::size_t>(i)];
  auto cost = [&](int i, int j) { return prefix[j] - prefix[i]; };  // units [i, j)
  const double inf = std::numeric_limits<double>::infinity();

  // Pass 1 (exact DP, O(K n^2)): the smallest achievable maximum region cost.
  std::vector<std::vector<double>> best(K + 1, std::vector<double>(n + 1, inf));
  for (int j = 1; j <= n; ++j) best[1][j] = cost(0, j);
  for (int k = 2; k <= K; ++k)
    for (int j = k; j <= n; ++j)
      for (int i = k - 1; i < j; ++i) best[k][j] = std::min(best[k][j], std::max(best[k - 1][i], cost(i, j)));
  const double bound = best[K][n] * (1 + 1e-12) + 1e-9;

  // Pass 2: among partitions within that maximum, minimise the sum of squared region costs so the
  // non-bottleneck regions are balanced too (a plain min-max partition may leave them lopsided).
  std::vector<std::vector<double>> sq(K + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> from(K + 1, std::vector<int>(n + 1, -1));
  sq[0][0] = 0;
  for (int k = 1; k <= K; ++k)
    for (int j = k; j <= n; ++j)
      for (int i = k - 1; i < j; ++i) {
        const double c = cost(i, j);
        if (c > bound || sq[k - 1][i] == inf) continue;
        const double v = sq[k - 1][i] + c * c;
        if (v < sq[k][j]) {
          sq[k][j] = v;
          from[k][j] = i;
        }
      }
  std::vector<int> starts(static_cast<std::size_t>(K));
  int j = n;
  for (int k = K; k >= 1; --k) j = starts[static_cast<std::size_t>(k - 1)] = from[k][j];
  return starts;
}

}  // namespace

void balance_pipeline(Model& model, int stages, PipelineEnds ends) {
  auto& layers = model.mutable_layers();
  const std::vector<PipelineUnit> units = pipeline_units(model, ends);
  const int n = static_cast<int>(units.size());
  const int e = ends.embedding ? 1 : 0, h = ends.head ? 1 : 0;
  if (stages - e - h < 1 || stages > n)
    throw ModelError(model.name() + ": balance_pipeline: stages must be between " + std::to_string(1 + e + h) +
                     " and " + std::to_string(n) + " (the number of pipeline units), got " + std::to_string(stages));
  std::vector<double> middle;
  for (int u = e; u < n - h; ++u) middle.push_back(units[static_cast<std::size_t>(u)].flops);
  std::vector<int> starts = balanced_starts(middle, stages - e - h);
  for (auto& s : starts) s += e;
  if (e) starts.insert(starts.begin(), 0);
  if (h) starts.push_back(n - 1);
  starts.push_back(n);
  clear_pp_tags(model);
  for (int k = 0; k < stages; ++k)
    for (int u = starts[static_cast<std::size_t>(k)]; u < starts[static_cast<std::size_t>(k) + 1]; ++u)
      for (std::size_t l = units[static_cast<std::size_t>(u)].first; l < units[static_cast<std::size_t>(u)].last; ++l)
        layers[l].tags["PP"] = k;
}

void rebalance_for_devices(Model& model, const std::vector<std::vector<int>>& devices_of_region, PipelineEnds ends) {
  const std::vector<PipelineUnit> units = pipeline_units(model, ends);
  const int regions = static_cast<int>(devices_of_region.size());
  auto& layers = model.mutable_layers();
  // Current boundaries from the PP tags: start[r] = first unit of region r.
  std::vector<int> start(static_cast<std::size_t>(regions) + 1, static_cast<int>(units.size()));
  for (int u = static_cast<int>(units.size()) - 1; u >= 0; --u) {
    auto it = layers[units[static_cast<std::size_t>(u)].first].tags.find("PP");
    if (it == layers[units[static_cast<std::size_t>(u)].first].tags.end() || it->second >= regions) return;
    start[static_cast<std::size_t>(it->second)] = u;
  }
  int top_device = 0;
  for (const auto& ds : devices_of_region)
    for (int d : ds) top_device = std::max(top_device, d);
  // Objective: device loads sorted in decreasing order, compared lexicographically (the busiest
  // device first, then the next, ...).
  auto loads = [&](const std::vector<int>& st) {
    std::vector<double> load(static_cast<std::size_t>(top_device) + 1, 0.0);
    for (int r = 0; r < regions; ++r) {
      double c = 0;
      for (int u = st[static_cast<std::size_t>(r)]; u < st[static_cast<std::size_t>(r) + 1]; ++u)
        c += units[static_cast<std::size_t>(u)].flops;
      for (int d : devices_of_region[static_cast<std::size_t>(r)]) load[static_cast<std::size_t>(d)] += c;
    }
    std::sort(load.rbegin(), load.rend());
    return load;
  };
  // Hill climbing over single-unit boundary moves; each accepted move strictly improves the objective.
  auto best = loads(start);
  for (bool improved = true; improved;) {
    improved = false;
    std::vector<int> best_start = start;
    for (int r = 1; r < regions; ++r)
      for (int step : {-1, 1}) {
        // A region of its own (embedding, head) keeps its boundary.
        if ((ends.embedding && r == 1) || (ends.head && r == regions - 1)) continue;
        std::vector<int> trial = start;
        trial[static_cast<std::size_t>(r)] += step;
        if (trial[static_cast<std::size_t>(r)] <= trial[static_cast<std::size_t>(r) - 1] ||
            trial[static_cast<std::size_t>(r)] >= trial[static_cast<std::size_t>(r) + 1])
          continue;
        auto l = loads(trial);
        if (l < best) best = l, best_start = trial, improved = true;
      }
    start = best_start;
  }
  for (int r = 0; r < regions; ++r)
    for (int u = start[static_cast<std::size_t>(r)]; u < start[static_cast<std::size_t>(r) + 1]; ++u)
      for (std::size_t l = units[static_cast<std::size_t>(u)].first; l < units[static_cast<std::size_t>(u)].last; ++l)
        layers[l].tags["PP"] = r;
}

void annotate_pipeline_ranges(Model& model, const std::vector<int>& block_starts) {
  int blocks = 0;
  for (const auto& l : model.layers()) blocks = std::max(blocks, l.block + 1);
  const std::string where = model.name() + ": pipeline ranges";
  if (blocks == 0) throw ModelError(where + ": the model has no blocks");
  if (block_starts.empty()) throw ModelError(where + ": at least one region is required");
  if (block_starts[0] != 0) throw ModelError(where + ": the first region must start at block 0");
  for (std::size_t r = 0; r < block_starts.size(); ++r) {
    if (block_starts[r] >= blocks)
      throw ModelError(where + ": start " + std::to_string(block_starts[r]) + " of region " + std::to_string(r) +
                       " is past the last block (" + std::to_string(blocks - 1) + ")");
    if (r > 0 && block_starts[r] <= block_starts[r - 1])
      throw ModelError(where + ": starts must be strictly increasing (region " + std::to_string(r) + ")");
  }
  clear_pp_tags(model);
  int region = 0;  // layers outside blocks follow the previous layer: embedding -> 0, head -> last
  for (auto& l : model.mutable_layers()) {
    if (l.block >= 0)
      region =
          static_cast<int>(std::upper_bound(block_starts.begin(), block_starts.end(), l.block) - block_starts.begin()) -
          1;
    l.tags["PP"] = region;
  }
}

// ---------------------------------------------------------------------------------------------
// ModelBuilder
// ---------------------------------------------------------------------------------------------

ModelBuilder::Scope ModelBuilder::annotate(const std::string& tag) {
  // Same-tag nesting has no meaning (a layer holds one index per tag), so refuse it.
  if (open_.count(tag)) throw ModelError(name_ + ": annotate(\"" + tag + "\"): a scope with this tag is already open");
  open_[tag] = next_index_[tag]++;
  return Scope(this, tag);
}

ModelBuilder::Scope::~Scope() {
  if (builder_) builder_->open_.erase(tag_);
}

int ModelBuilder::Scope::index() const {
  if (!builder_) throw ModelError("annotate(\"" + tag_ + "\"): scope was moved from");
  return builder_->open_.at(tag_);
}

ModelBuilder& ModelBuilder::add(Layer layer) {
  for (const auto& [tag, index] : open_) layer.tags[tag] = index;
  layers_.push_back(std::move(layer));
  return *this;
}

Model ModelBuilder::build() const { return Model(name_, layers_, training_); }

}  // namespace piper::core
