// CUDA kernels of the transformer layers, one per host kernel in piper/runtime/kernels.hpp (the
// reference each is checked against). Activations and parameters are stored as `DType` (fp32 or
// bf16); every kernel accumulates in fp32; norm statistics, softmax probabilities, losses, weight
// gradients of norms/embeddings and optimizer state are fp32. Row-major throughout: a row is a token.
// All functions enqueue on `stream` and return immediately; pointers are device pointers.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <cuda_runtime_api.h>

#include "piper/runtime/cuda/device.hpp"

namespace piper::runtime::cuda {

// ---- Embedding: x[t] = table[token[t]]; dtable[token[t]] += dx[t] (fp32) ----
// Vocab-parallel (TP): the table holds rows [first_row, first_row + table_rows) of the vocabulary; a
// token outside them gives a zero row (the TP all-reduce adds the owner's) and no gradient here.
void embedding_forward(DType dt, const void* table, const int* tokens, int tokens_count, int hidden, void* x,
                       cudaStream_t stream, int first_row = 0, int table_rows = -1);
void embedding_backward_weight(DType dt, const int* tokens, const void* dx, int tokens_count, int hidden, float* dtable,
                               cudaStream_t stream, int first_row = 0, int table_rows = -1);

// ---- RMSNorm over each row of [rows, cols]: y = x * rstd * g, rstd = (mean(x^2) + eps)^-1/2 ----
// (Per-head q/k norm is the same kernel on [tokens * heads, head_dim].)
void rmsnorm_forward(DType dt, const void* x, const void* g, int rows, int cols, float eps, void* y, float* rstd,
                     cudaStream_t stream);
void rmsnorm_backward_input(DType dt, const void* x, const float* rstd, const void* g, const void* dy, int rows,
                            int cols, void* dx, cudaStream_t stream);
// dg += sum over rows of dy * x * rstd (accumulates).
void rmsnorm_backward_weight(DType dt, const void* x, const float* rstd, const void* dy, int rows, int cols, float* dg,
                             cudaStream_t stream);

// ---- LayerNorm over each row (GPT): y = (x - mean) * rstd * g + b, rstd = (var(x) + eps)^-1/2; mean
// and rstd (fp32, one per row) are kept for the backward ----
void layernorm_forward(DType dt, const void* x, const void* g, const void* b, int rows, int cols, float eps, void* y,
                       float* mean, float* rstd, cudaStream_t stream);
void layernorm_backward_input(DType dt, const void* x, const float* mean, const float* rstd, const void* g,
                              const void* dy, int rows, int cols, void* dx, cudaStream_t stream);
// dg += sum over rows of dy * xhat, db += sum over rows of dy (accumulate).
void layernorm_backward_weight(DType dt, const void* x, const float* mean, const float* rstd, const void* dy, int rows,
                               int cols, float* dg, float* db, cudaStream_t stream);

// ---- Biases, GELU (tanh form), learned absolute positions (GPT) ----
// x[r][c] += b[c], in place on [rows, cols].
void bias_add(DType dt, void* x, const void* b, int rows, int cols, cudaStream_t stream);
// db += column sums of dy (accumulates, deterministic).
void bias_backward_weight(DType dt, const void* dy, int rows, int cols, float* db, cudaStream_t stream);
void gelu_forward(DType dt, const void* a, std::int64_t n, void* h, cudaStream_t stream);
// da = dy * gelu'(a).
void gelu_backward(DType dt, const void* a, const void* dy, std::int64_t n, void* da, cudaStream_t stream);
// x[t] += pos[t mod seq_len], in place on [rows, cols]; dpos[p] += sum of dx[t] over t = p mod seq_len.
// first_row: the token row of x's row 0 (sequence parallelism: this rank's slice of the microbatch).
void positions_forward(DType dt, void* x, const void* pos, int rows, int cols, int seq_len, cudaStream_t stream,
                       int first_row = 0);
void positions_backward_weight(DType dt, const void* dx, int rows, int cols, int seq_len, float* dpos,
                               cudaStream_t stream);

// ---- RoPE, rotate-half layout (pairs i, i + head_dim/2), in place on [tokens, heads * head_dim];
// the position of token t is t mod seq_len, or under context parallelism (cp > 1) that local row's
// position in its sequence (host::AttentionCp::position of cp_rank); sign = -1 applies the inverse
// rotation (backward). ----
void rope(DType dt, void* m, int tokens, int heads, int head_dim, int seq_len, float theta, float sign,
          cudaStream_t stream, int cp = 1, int cp_rank = 0);

// ---- Causal attention core with grouped KV heads (the reference path: explicit probabilities; fp32 and
// shapes the fast path below does not take) ----
// q [T, heads*hd], k/v [T, kv_heads*hd], T = sequences * seq_len. probs [sequences*heads, L, L] (fp32,
// kept for the backward), o [T, heads*hd]. Scores are scaled by 1/sqrt(hd).
// Context parallelism (cp > 1; the reference path only): q holds this CP rank's L = seq_len local rows
// of each sequence, the load-balanced chunks cp_rank and 2·cp-1-cp_rank (host::AttentionCp); k and v
// (and dk, dv) hold every rank's rows, rank after rank ([cp·T, kv_heads*hd], an all-gather's order),
// so a sequence has cp·L keys; probs is [sequences*heads, L, cp·L], masked by global position.
struct AttentionDims {
  int tokens = 0, seq_len = 1, heads = 1, kv_heads = 1, head_dim = 1;
  int cp = 1, cp_rank = 0;
};
void attention_core_forward(DType dt, const AttentionDims& d, const void* q, const void* k, const void* v, float* probs,
                            void* o, cudaStream_t stream);
// From d_o, the saved probabilities and q/k/v: dq, dk, dv (overwritten). `ds` is fp32 scratch of the
// size of probs.
void attention_core_backward(DType dt, const AttentionDims& d, const void* q, const void* k, const void* v,
                             const float* probs, const void* d_o, float* ds, void* dq, void* dk, void* dv,
                             cudaStream_t stream);

// ---- Causal attention, fast path (flash_attention.cu): bf16 only, head_dim 64 or 128; tensor-core
// tiles with an online softmax, so no [L, L] probabilities exist. The forward writes o and lse
// [sequences*heads, L] (fp32, base-2 log-sum-exp of the scaled scores; read only by the backward).
// The backward needs o and lse from the forward and `delta` as fp32 scratch of lse's size; dq, dk, dv
// are overwritten. Operands must be 16-byte aligned (fresh tensors are). ----
// True when the fast path can run this shape in this storage type.
bool flash_attention_supported(DType dt, const AttentionDims& d);
// True when the fast path supports the shape and the current GPU offers the shared memory it needs per
// block (Hopper's 227 KiB does; consumer Ampere's 99 KiB does not for head_dim 128).
bool use_flash_attention(DType dt, const AttentionDims& d);
void flash_attention_forward(const AttentionDims& d, const void* q, const void* k, const void* v, float* lse, void* o,
                             cudaStream_t stream);
void flash_attention_backward(const AttentionDims& d, const void* q, const void* k, const void* v, const void* o,
                              const float* lse, const void* d_o, float* delta, void* dq, void* dk, void* dv,
                              cudaStream_t stream);

// ---- Causal attention through cuDNN's fused SDPA (cudnn_attention.cpp: cuDNN 9's graph API via the
// header-only cudnn-frontend; libcudnn opened on first use): bf16, grouped KV heads, the same q/k/v/o
// layouts as the paths above. The forward writes o and `stats` [sequences*heads, L] (fp32, natural-log
// log-sum-exp of the scaled scores, cuDNN's own; read only by this backward); the backward overwrites
// dq, dk, dv. Each call needs `workspace` of cudnn_attention_workspace bytes (may be 0). Graphs are
// built once per shape and thread. ----
// False when built without the cudnn-frontend headers.
bool cudnn_attention_compiled();
// Describes the forward and backward graphs of the shape and checks them against cuDNN's rules for a
// GPU of compute capability `sm_version` (90: Hopper) without one (libcudnn must load); "" when both
// are valid, else why not.
std::string cudnn_attention_validate(const AttentionDims& d, int sm_version);
// True when cuDNN can run the shape on the current GPU (builds both graphs; `why` says why not).
bool cudnn_attention_supported(DType dt, const AttentionDims& d, std::string* why = nullptr);
std::size_t cudnn_attention_workspace(const AttentionDims& d, bool backward);
void cudnn_attention_forward(const AttentionDims& d, const void* q, const void* k, const void* v, float* stats, void* o,
                             void* workspace, cudaStream_t stream);
void cudnn_attention_backward(const AttentionDims& d, const void* q, const void* k, const void* v, const void* o,
                              const float* stats, const void* d_o, void* dq, void* dk, void* dv, void* workspace,
                              cudaStream_t stream);

// ---- Which attention runs ----
// PIPER_ATTENTION in the environment (read once; unset or "auto": the default) names a path:
// "reference", "flash" or "cudnn"; any other value throws naming it. By default attention runs on
// cuDNN where it runs the shape, else on the flash kernels where they do, else on the reference
// kernels. A named path that cannot run the shape throws one line saying why (the reference always can).
enum class AttentionPath { Reference, Flash, Cudnn };
const char* attention_path_name(AttentionPath p);
// The path PIPER_ATTENTION names; std::nullopt when it is unset or "auto".
std::optional<AttentionPath> attention_path_forced();
bool attention_reference_forced();
AttentionPath choose_attention(DType dt, const AttentionDims& d);

// ---- SwiGLU gate: h = silu(a) * b, elementwise over n; backward gives da, db ----
void swiglu_forward(DType dt, const void* a, const void* b, std::int64_t n, void* h, cudaStream_t stream);
void swiglu_backward(DType dt, const void* a, const void* b, const void* dh, std::int64_t n, void* da, void* db,
                     cudaStream_t stream);

// ---- Cross-entropy on logits [T, V], in place: logits become (softmax - onehot(target)) * scale,
// loss[t] = logsumexp(l_t) - l_t[target_t] (fp32, unscaled). ----
void cross_entropy(DType dt, void* logits, const int* targets, int tokens_count, int vocab, float loss_scale,
                   float* loss, cudaStream_t stream);
// The vocab-parallel cross-entropy (TP: this rank's logits are vocabulary columns [first, first + vocab)
// of [T, V]), in three passes around two all-gathers over the TP group (the host's allreduce of the row
// max, then of the sums): (1) row_max[t] = this rank's max; (2) with M_t = max over the `ranks` gathered
// maxima [ranks, T]: sums[t] = sum of exp(l - M_t) over this rank's columns, sums[T + t] = l_target -
// M_t where this rank owns the target (else 0); (3) with the gathered [ranks, 2T] sums: loss[t] = log S_t
// - z_t, and the logits become (exp(l - M_t) / S_t - onehot) * scale in place.
void vocab_parallel_row_max(DType dt, const void* logits, int tokens_count, int vocab, float* row_max,
                            cudaStream_t stream);
void vocab_parallel_sums(DType dt, const void* logits, const int* targets, int tokens_count, int vocab, int first,
                         const float* all_max, int ranks, float* sums, cudaStream_t stream);
void vocab_parallel_finish(DType dt, void* logits, const int* targets, int tokens_count, int vocab, int first,
                           const float* all_max, const float* all_sums, int ranks, float loss_scale, float* loss,
                           cudaStream_t stream);

// ---- AdamW (decoupled weight decay, bias-corrected, step counts from 1) on fp32 master state ----
struct AdamW {
  float lr = 3e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.01f;
  float grad_scale = 1;  // multiplies every gradient first (gradient clipping)
};
void adamw(const AdamW& cfg, int step, float* params, const float* grads, float* m, float* v, std::int64_t n,
           cudaStream_t stream);
// adamw on fp32 masters that also writes each updated master to `params` in the storage type `dt` and,
// when `zero_grads`, zeroes each gradient it read: the update, the cast and the gradient reset in one
// pass (34 bytes a parameter instead of 38 and three launches).
void adamw_store(const AdamW& cfg, int step, float* master, float* grads, float* m, float* v, std::int64_t n, DType dt,
                 void* params, bool zero_grads, cudaStream_t stream);

// ---- Data movement and reductions (MoE permute/unpermute, loopback collectives, casts) ----
// out[i] = in[index[i]] for rows of `cols` elements.
void gather_rows(DType dt, const void* in, const int* index, int rows, int cols, void* out, cudaStream_t stream);
// out[index[i]] += weight[i] * in[i] (fp32 out; weight may be null for 1).
void scatter_add_rows(DType dt, const void* in, const int* index, const float* weight, int rows, int cols, float* out,
                      cudaStream_t stream);
// dst += src elementwise.
void accumulate(DType dt, void* dst, const void* src, std::int64_t n, cudaStream_t stream);
void convert(DType from, const void* src, DType to, void* dst, std::int64_t n, cudaStream_t stream);

// ---- MoE routing (mirrors host router_forward/backward and HostModel's route/combine) ----
// logits [T, E] -> topk [T, k] expert ids (best first, ties to the lower id) and gates [T, k] (fp32,
// softmax over the selected logits).
void router_topk(DType dt, const void* logits, int tokens_count, int experts, int top_k, int* topk, float* gates,
                 cudaStream_t stream);
// dlogits [T, E] (overwritten; zero outside the selection): dl_j = g_j (dg_j - sum_i g_i dg_i).
void router_backward(DType dt, const int* topk, const float* gates, const float* dgates, int tokens_count, int experts,
                     int top_k, void* dlogits, cudaStream_t stream);
// out[t] = x[t] + sum_j gates[t, j] * y[t * k + j] (fp32 sum in j order).
void moe_combine(DType dt, const void* x, const void* y, const float* gates, int tokens_count, int top_k, int hidden,
                 void* out, cudaStream_t stream);
// dgates[t, j] = dx[t] . y[t * k + j].
void moe_gate_grad(DType dt, const void* dx, const void* y, int tokens_count, int top_k, int hidden, float* dgates,
                   cudaStream_t stream);
// out[t] = du[t] + sum_j slots[t * k + j].
void moe_sum_slots(DType dt, const void* du, const void* slots, int tokens_count, int top_k, int hidden, void* out,
                   cudaStream_t stream);
// out[i] = weight[index[i]] * in[index[i] / div] (weight may be null for 1): the dispatch of slot
// `index[i]` (token index / k) with its gate.
void gather_slots(DType dt, const void* in, const int* index, int div, const float* weight, int rows, int cols,
                  void* out, cudaStream_t stream);
// out[index[i]] = in[i] (indices unique).
void scatter_rows(DType dt, const void* in, const int* index, int rows, int cols, void* out, cudaStream_t stream);
// dst (fp32) += src (storage type): weight gradients accumulate in fp32 whatever the storage.
void accumulate_f32(DType dt, float* dst, const void* src, std::int64_t n, cudaStream_t stream);
// out = a + b elementwise.
void add(DType dt, const void* a, const void* b, std::int64_t n, void* out, cudaStream_t stream);
// *acc += sum of v[0, n) (one block sums in a fixed order, then one atomic add).
void sum_into(const float* v, int n, float* acc, cudaStream_t stream);
// acc[0] += sum of (v[i] * scale)^2 (fp32 atomics: the order of the partial sums is not fixed); loss
// scaling unscales each gradient first (scale = 1 / the loss scale), so the squares cannot overflow.
void sum_squares(const float* v, std::int64_t n, float* acc, cudaStream_t stream, float scale = 1);

}  // namespace piper::runtime::cuda
