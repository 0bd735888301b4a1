// The cost formulas of every layer kind (FLOPs, bytes, kernel lists by pass; layer_costs), with
// activation recomputation and context parallelism; the model list itself is in model.cpp.
#include "piper/core/model.hpp"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace piper::core {

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

// Standard-attention (Megatron-LM GPT) layers: the element-wise bytes per token and hidden element
// after the row-parallel GEMM (output projection, fc2), replicated over TP ranks (SP slices them).
// Forward: the fused bias-dropout-add (read two tensors, write one, the dropout's 1-byte mask).
// Backward: its gradient (read the gradient and the mask, write); autograd's sum of the layer input's
// two gradients, through the norm and through the residual (read two, write one); and with biases the
// row-parallel bias's gradient, autograd's reduction of the broadcast bias over the tokens (read).
std::int64_t standard_hidden_forward_bytes(const LayerShape& sh, std::int64_t dt) {
  return 3 * dt + (sh.dropout ? 1 : 0);
}
std::int64_t standard_hidden_backward_bytes(const LayerShape& sh, std::int64_t dt) {
  return 2 * dt + (sh.dropout ? 1 : 0) + 3 * dt + (sh.bias ? dt : 0);
}
// Megatron-LM's CoreAttention ends by permuting the context [b, np, s, hn] to [s, b, np·hn]
// (.contiguous(): read and write); its backward copies the gradient back the same way.
std::int64_t standard_context_permute_bytes(std::int64_t tokens, std::int64_t heads, std::int64_t v_dim,
                                            std::int64_t dt) {
  return tokens * heads * v_dim * 2 * dt;
}

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
  c.gemm_weight_params = matmul_elems;  // TE's fp8 linears: QKV (MLA: its projections) and output
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
    // And, read from Megatron-LM's code (megatron/model/transformer.py, megatron/core/tensor_parallel/
    // layers.py): the context's permute both ways (standard_context_permute_bytes); with biases, the
    // QKV projection's bias added by a kernel of its own (ColumnParallelLinear without skip_bias_add:
    // `output = torch.matmul(input, weight.t())`, then `output = output + bias`: read and write the
    // QKV output) and, backward, its gradient (`grad_output.sum(dim=0)`: read the QKV output's
    // gradient). Backward also: torch.split's gradient, which concatenates the q, k and v gradients
    // into the QKV output's (read and write it), and baddbmm's, which scales the q and k gradients
    // by its alpha (1/sqrt(head_dim)) in kernels of their own (read and write each).
    const std::int64_t permute = standard_context_permute_bytes(d.tokens, nh, v_dim, d.dt);
    const std::int64_t qkv = !mla ? d.tokens * (nh + 2 * sh.kv_heads) * hd : 0;
    const std::int64_t qk_scale = !mla ? d.tokens * (nh + sh.kv_heads) * hd * 2 * d.dt : 0;
    const std::int64_t bias_add = sh.bias ? qkv * 2 * d.dt : 0, bias_grad = sh.bias ? qkv * d.dt : 0;
    c.forward_elementwise_bytes = standard_score_bytes(sh, scores, d.dt, false) +
                                  d.tokens * h * standard_hidden_forward_bytes(sh, d.dt) + permute + bias_add;
    c.backward_elementwise_bytes = standard_score_bytes(sh, scores, d.dt, true) +
                                   d.tokens * h * standard_hidden_backward_bytes(sh, d.dt) + permute + bias_grad +
                                   qkv * 2 * d.dt + qk_scale;
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
  c.gemm_weight_params = matmul_elems;  // fc1, fc2 (not their biases)
  // Two GEMM kernels: fc1 (SwiGLU's gate and up fused into one 2f-wide GEMM, as Megatron-LM runs
  // it) and fc2.
  matmul_costs(c, d, matmul_elems, h, h * d.dt, 2);
  // Stash: input, then SwiGLU gate and up outputs and their product / GELU input and output.
  c.activation_bytes = d.tokens * (h + (swiglu ? 3 : 2) * f) * d.dt;
  c.output_bytes = d.tokens * h * d.dt;
  if (sh.dropout) c.activation_bytes += d.tokens * h;  // 1-byte mask of the dropout after the MLP
  if (sh.attention_kernel == AttentionKernel::Standard) {
    // Element-wise kernels: bias + activation (GELU: read, write; SwiGLU: read two, write one) and the
    // fused bias-dropout-add; backward reads the stored input and the gradient and writes the gradient,
    // and with biases reduces fc1's bias gradient over the tokens (read the gradient; Megatron-LM's
    // bias_gelu returns the same tensor as the input's and the bias's gradient, and autograd sums
    // the broadcast) besides fc2's (standard_hidden_backward_bytes).
    c.forward_elementwise_bytes =
        d.tokens * f * (swiglu ? 3 : 2) * d.dt + d.tokens * h * standard_hidden_forward_bytes(sh, d.dt);
    c.backward_elementwise_bytes = d.tokens * f * ((swiglu ? 5 : 3) + (sh.bias ? 1 : 0)) * d.dt +
                                   d.tokens * h * standard_hidden_backward_bytes(sh, d.dt);
  }
  return c;
}

Costs router_costs(const LayerShape& sh, const Dims& d) {
  Costs c;
  const std::int64_t h = sh.hidden, e = sh.experts;
  // A linear gate h x E (DeepSeek-V3's E-element score-correction bias is ignored: < 1e-4 of it).
  // Not an fp8 GEMM weight (Megatron-LM's router is a plain fp32/bf16 parameter): no fp8 copy.
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
  c.gemm_weight_params = c.params;  // fp8 grouped GEMMs
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
  // still computed here and added to the embedding's). Megatron-LM keeps the output layer in bf16
  // under --fp8 (not a Transformer Engine linear): no fp8 copy of its weight (gemm_weight_params 0).
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

std::int64_t standard_score_bytes(const LayerShape& sh, std::int64_t scores, std::int64_t dt, bool backward) {
  // Softmax: forward reads the scores and writes the probabilities, backward reads the probabilities and
  // their gradient and writes the scores' gradient; dropout: read, write and its 1-byte mask each way.
  const std::int64_t softmax = (backward ? 3 : 2) * dt, dropout = sh.dropout ? 2 * dt + 1 : 0;
  return scores * (softmax + dropout) + attention_score_epilogue_bytes(scores, dt);
}

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
    elementwise = standard_score_bytes(sh, scores, dt, false) +
                  standard_context_permute_bytes(shape.tokens_per_microbatch(), sh.heads, v, dt);
  }
}

// TorchTitan's op-level selective checkpointing (Recompute::Op) of one layer of a block: the block
// keeps its input (the attention norm's) and the outputs of the attention core and of every other
// matmul, counted in the block's order (1st, 3rd, 5th, ...: for a Llama block with separate wq, wk,
// wv, wo, w1, w3, w2 that is wq, wv, w1 and w2 kept, wk, wo and w3 recomputed); the rest reruns at
// the start of the backward: those matmuls and every element-wise op. Routed experts and the router
// keep their activations (as with selective). t: TP degree, seq: the sequence-parallel divisor.
// Under TP the rerun includes the TP collectives the policy does not save: TorchTitan's save list
// holds reduce_scatter_tensor but no all-gather or all-reduce, and the non-reentrant checkpoint
// stops once the last tensor the backward needs (the input of w2) is rebuilt. So with SP the
// all-gathers before the attention's and the MLP's column-parallel GEMMs rerun (one of N bytes each;
// the reduce-scatters' outputs are saved); without SP the all-reduce after wo reruns (the MLP's,
// after w2, comes after the early stop).
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
      if (t > 1) {
        const std::int64_t N = T * sh.hidden * dt;
        const bool sp = seq > 1, attention = layer.kind == LayerKind::Attention;
        if (sp || attention) {
          c.backward_tp_bytes += sp ? N : 2 * N;
          c.backward_tp_collectives += 1;
        }
      }
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
// convention (attention_costs above: 2·b·s²·heads·(qk + v)), a device's core work is therefore
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
Costs layer_costs(const Layer& unpadded, const TrainingShape& shape,  // NOLINT(readability-function-size)
                  const ParallelLayout& L) {
  if (L.cp > 1) {
    ParallelLayout inner = L;
    inner.cp = 1;
    inner.cp_all_gather = false;
    const TrainingShape local = context_parallel_local_shape(shape, L.cp);
    Costs c = layer_costs(unpadded, local, inner);
    context_parallel_costs(unpadded, local, L, c);
    return c;
  }
  const int t = std::max(1, L.tp);
  // A vocabulary-parallel embedding or head whose vocabulary t does not divide holds the padded one.
  std::optional<Layer> padded;
  if ((unpadded.kind == LayerKind::Embedding || unpadded.kind == LayerKind::Head) &&
      tp_padded_vocab(unpadded.shape.vocab, t) != unpadded.shape.vocab) {
    padded = unpadded;
    padded->shape.vocab = tp_padded_vocab(unpadded.shape.vocab, t);
  }
  const Layer& layer = padded ? *padded : unpadded;
  const Costs base = layer_costs(layer, shape);
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
      c.gemm_weight_params = base.gemm_weight_params / t;
      if (layer.shape.attention_kernel == AttentionKernel::Standard) {
        const std::int64_t hf = T * h * standard_hidden_forward_bytes(layer.shape, dt),
                           hb = T * h * standard_hidden_backward_bytes(layer.shape, dt);
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
      c.gemm_weight_params = base.gemm_weight_params / t;
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

}  // namespace piper::core
