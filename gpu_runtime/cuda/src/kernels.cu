// CUDA kernels of the transformer layers (correctness first; each mirrors a host kernel in
// gpu_runtime/src/kernels.cpp, which the GPU tests compare against). fp32 accumulation everywhere.
#include "piper/runtime/cuda/kernels.hpp"

#include "kernels_common.cuh"
#include "piper/runtime/cp_layout.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include <cuda_bf16.h>

namespace piper::runtime::cuda {
namespace {

using namespace kernel_detail;

// ---- embedding ----
template <typename T>
__global__ void embedding_forward_k(const T* table, const int* tokens, int n_tok, int hidden, T* x, int first,
                                    int rows) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(n_tok) * hidden) return;
  const std::int64_t t = i / hidden, c = i % hidden;
  const int r = tokens[t] - first;
  if (rows >= 0 && (r < 0 || r >= rows))
    store(x, i, 0.0f);
  else
    x[i] = table[static_cast<std::int64_t>(r) * hidden + c];
}
template <typename T>
__global__ void embedding_backward_weight_k(const int* tokens, const T* dx, int n_tok, int hidden, float* dtable,
                                            int first, int rows) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(n_tok) * hidden) return;
  const std::int64_t t = i / hidden, c = i % hidden;
  const int r = tokens[t] - first;
  if (rows >= 0 && (r < 0 || r >= rows)) return;
  atomicAdd(&dtable[static_cast<std::int64_t>(r) * hidden + c], load(dx, i));
}

// ---- RMSNorm: one block per row ----
template <typename T>
__global__ void rmsnorm_forward_k(const T* x, const T* g, int cols, float eps, T* y, float* rstd) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * cols;
  float ss = 0;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = load(x, row + c);
    ss += v * v;
  }
  const float r = rsqrtf(block_reduce<false>(ss) / static_cast<float>(cols) + eps);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) store(y, row + c, load(x, row + c) * r * load(g, c));
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}
// dx = r g*dy - r^3 x (sum_k g_k dy_k x_k) / H
template <typename T>
__global__ void rmsnorm_backward_input_k(const T* x, const float* rstd, const T* g, const T* dy, int cols, T* dx) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * cols;
  const float r = rstd[blockIdx.x];
  float dot = 0;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) dot += load(g, c) * load(dy, row + c) * load(x, row + c);
  const float coef = r * r * r * block_reduce<false>(dot) / static_cast<float>(cols);
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    store(dx, row + c, r * load(g, c) * load(dy, row + c) - load(x, row + c) * coef);
}
// dg += sum over rows of dy x rstd.
template <typename T>
__global__ void rmsnorm_backward_weight_k(const T* x, const float* rstd, const T* dy, int rows, int cols, float* dg) {
  column_sum_into(rows, cols, dg, [&](std::int64_t i, int r) { return load(dy, i) * load(x, i) * rstd[r]; });
}

// ---- Context parallelism (cp_layout.hpp: the host compiles the same arithmetic and tests it against
// the host backend's layout) ----
__device__ __forceinline__ int cp_position(int cp, int rank, int i, int L) {
  return cp_layout::position(cp, rank, i, L);
}
// The row of key j of sequence `seq` in the K/V buffer (d.tokens local rows a rank); seq·L + j without CP.
__device__ __forceinline__ std::int64_t key_row(const AttentionDims& d, int seq, int j) {
  return cp_layout::key_row(d.tokens, d.seq_len, seq, j);
}
// Whether key j (of cp·L) is visible to local query i: its global position is not after the query's.
__device__ __forceinline__ bool key_visible(const AttentionDims& d, int i, int j) {
  return cp_layout::key_visible(d.cp, d.cp_rank, d.seq_len, i, j);
}

// ---- RoPE, rotate-half: one thread per (token, head, pair) ----
template <typename T>
__global__ void rope_k(T* m, int n_tok, int heads, int head_dim, int seq_len, float theta, float sign, int cp,
                       int cp_rank) {
  const int half = head_dim / 2;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(n_tok) * heads * half) return;
  const int pair = static_cast<int>(i % half);
  const std::int64_t th = i / half;
  const int h = static_cast<int>(th % heads);
  const std::int64_t t = th / heads;
  const float pos = static_cast<float>(cp_position(cp, cp_rank, static_cast<int>(t % seq_len), seq_len));
  // Same expression as the host kernel (pow in fp32) so fp32 results agree to rounding.
  const float angle = pos * powf(theta, -2.0f * static_cast<float>(pair) / static_cast<float>(head_dim));
  const float cs = cosf(angle), sn = sign * sinf(angle);
  const std::int64_t base = t * static_cast<std::int64_t>(heads) * head_dim + static_cast<std::int64_t>(h) * head_dim;
  const float a = load(m, base + pair), b = load(m, base + pair + half);
  store(m, base + pair, a * cs - b * sn);
  store(m, base + pair + half, b * cs + a * sn);
}

// ---- attention core: one block per (query token, head) ----
// Keys 0 .. Lk-1 of the query's sequence (Lk = cp·L; L without CP, where the visible keys are 0 .. i).
template <typename T>
__global__ void attention_forward_k(AttentionDims d, const T* q, const T* k, const T* v, float* probs, T* o) {
  const int t = blockIdx.x, h = blockIdx.y;
  const int L = d.seq_len, Lk = L * d.cp, hd = d.head_dim, g = h / (d.heads / d.kv_heads);
  const int seq = t / L, i = t % L;
  const int end = d.cp > 1 ? Lk : i + 1;  // past the last key that can be visible
  const float scale = rsqrtf(static_cast<float>(hd));
  const std::int64_t qs = static_cast<std::int64_t>(d.heads) * hd, ks = static_cast<std::int64_t>(d.kv_heads) * hd;
  float* p = probs + ((static_cast<std::int64_t>(seq) * d.heads + h) * L + i) * Lk;
  const T* qrow = q + t * qs + static_cast<std::int64_t>(h) * hd;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < Lk; j += blockDim.x) {
    if (!key_visible(d, i, j)) {
      p[j] = 0;
      continue;
    }
    const T* krow = k + key_row(d, seq, j) * ks + static_cast<std::int64_t>(g) * hd;
    float s = 0;
    for (int e = 0; e < hd; ++e) s += load(qrow, e) * load(krow, e);
    s *= scale;
    p[j] = s;
    mx = fmaxf(mx, s);
  }
  mx = block_reduce<true>(mx);
  float sum = 0;
  for (int j = threadIdx.x; j < end; j += blockDim.x) {
    if (!key_visible(d, i, j)) continue;
    const float e = expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  const float inv = 1.0f / block_reduce<false>(sum);
  for (int j = threadIdx.x; j < end; j += blockDim.x)
    if (key_visible(d, i, j)) p[j] *= inv;
  __syncthreads();
  for (int e = threadIdx.x; e < hd; e += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < end; ++j)  // masked keys have p = 0
      acc += p[j] * load(v, key_row(d, seq, j) * ks + static_cast<std::int64_t>(g) * hd + e);
    store(o, t * qs + static_cast<std::int64_t>(h) * hd + e, acc);
  }
}
// dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik) * scale with dP_ij = dO_i . v_j; dq_i = sum_j dS_ij k_j.
template <typename T>
__global__ void attention_backward_q_k(AttentionDims d, const T* k, const T* v, const float* probs, const T* d_o,
                                       float* ds, T* dq) {
  const int t = blockIdx.x, h = blockIdx.y;
  const int L = d.seq_len, Lk = L * d.cp, hd = d.head_dim, g = h / (d.heads / d.kv_heads);
  const int seq = t / L, i = t % L;
  const int end = d.cp > 1 ? Lk : i + 1;
  const float scale = rsqrtf(static_cast<float>(hd));
  const std::int64_t qs = static_cast<std::int64_t>(d.heads) * hd, ks = static_cast<std::int64_t>(d.kv_heads) * hd;
  const std::int64_t prow = ((static_cast<std::int64_t>(seq) * d.heads + h) * L + i) * Lk;
  const T* dorow = d_o + t * qs + static_cast<std::int64_t>(h) * hd;
  float rowdot = 0;
  for (int j = threadIdx.x; j < Lk; j += blockDim.x) {
    if (!key_visible(d, i, j)) {
      ds[prow + j] = 0;
      continue;
    }
    const T* vrow = v + key_row(d, seq, j) * ks + static_cast<std::int64_t>(g) * hd;
    float dp = 0;
    for (int e = 0; e < hd; ++e) dp += load(dorow, e) * load(vrow, e);
    ds[prow + j] = dp;
    rowdot += dp * probs[prow + j];
  }
  rowdot = block_reduce<false>(rowdot);
  for (int j = threadIdx.x; j < end; j += blockDim.x)
    if (key_visible(d, i, j)) ds[prow + j] = probs[prow + j] * (ds[prow + j] - rowdot) * scale;
  __syncthreads();
  for (int e = threadIdx.x; e < hd; e += blockDim.x) {
    float acc = 0;
    for (int j = 0; j < end; ++j)  // masked keys have dS = 0
      acc += ds[prow + j] * load(k, key_row(d, seq, j) * ks + static_cast<std::int64_t>(g) * hd + e);
    store(dq, t * qs + static_cast<std::int64_t>(h) * hd + e, acc);
  }
}
// One block per (key row of the K/V buffer, kv head): dk_j = sum_{h in group} sum_{i sees j} dS_ij q_i,
// dv_j = ... P_ij dO_i. Under CP the key rows are every rank's (cp·T of them), dk and dv alike.
template <typename T>
__global__ void attention_backward_kv_k(AttentionDims d, const T* q, const float* probs, const T* d_o, const float* ds,
                                        T* dk, T* dv) {
  const int t = blockIdx.x, g = blockIdx.y;
  const int L = d.seq_len, Lk = L * d.cp, hd = d.head_dim, group = d.heads / d.kv_heads;
  const int rank = t / d.tokens, local = t % d.tokens;
  const int seq = local / L, j = rank * L + local % L;  // key j of sequence seq
  const int first = d.cp > 1 ? 0 : j;                   // without CP, queries j .. L-1 see key j
  const std::int64_t qs = static_cast<std::int64_t>(d.heads) * hd, ks = static_cast<std::int64_t>(d.kv_heads) * hd;
  for (int e = threadIdx.x; e < hd; e += blockDim.x) {
    float acc_k = 0, acc_v = 0;
    for (int h = g * group; h < (g + 1) * group; ++h) {
      const std::int64_t pbase = (static_cast<std::int64_t>(seq) * d.heads + h) * L * Lk;
      for (int i = first; i < L; ++i) {  // masked pairs have P = dS = 0
        const std::int64_t row = (static_cast<std::int64_t>(seq) * L + i) * qs + static_cast<std::int64_t>(h) * hd + e;
        acc_k += ds[pbase + static_cast<std::int64_t>(i) * Lk + j] * load(q, row);
        acc_v += probs[pbase + static_cast<std::int64_t>(i) * Lk + j] * load(d_o, row);
      }
    }
    store(dk, t * ks + static_cast<std::int64_t>(g) * hd + e, acc_k);
    store(dv, t * ks + static_cast<std::int64_t>(g) * hd + e, acc_v);
  }
}

// ---- SwiGLU ----
__device__ __forceinline__ float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }
template <typename T>
__global__ void swiglu_forward_k(const T* a, const T* b, std::int64_t n, T* h) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = load(a, i);
  store(h, i, x * sigmoid(x) * load(b, i));
}
// silu'(a) = s(a) (1 + a (1 - s(a)))
template <typename T>
__global__ void swiglu_backward_k(const T* a, const T* b, const T* dh, std::int64_t n, T* da, T* db) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = load(a, i), s = sigmoid(x), g = load(dh, i);
  store(da, i, g * load(b, i) * s * (1.0f + x * (1.0f - s)));
  store(db, i, g * x * s);
}

// ---- cross-entropy: one block per token ----
template <typename T>
__global__ void cross_entropy_k(T* logits, const int* targets, int vocab, float loss_scale, float* loss) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * vocab;
  float mx = -INFINITY;
  for (int c = threadIdx.x; c < vocab; c += blockDim.x) mx = fmaxf(mx, load(logits, row + c));
  mx = block_reduce<true>(mx);
  float sum = 0;
  for (int c = threadIdx.x; c < vocab; c += blockDim.x) sum += expf(load(logits, row + c) - mx);
  sum = block_reduce<false>(sum);
  const int y = targets[blockIdx.x];
  // Every thread reads the target logit before any thread overwrites the row.
  const float target_logit = load(logits, row + y);
  __syncthreads();
  if (threadIdx.x == 0) loss[blockIdx.x] = logf(sum) - (target_logit - mx);
  for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float p = expf(load(logits, row + c) - mx) / sum;
    store(logits, row + c, (p - (c == y ? 1.0f : 0.0f)) * loss_scale);
  }
}

// ---- Vocab-parallel cross-entropy: one block per row, in three passes (kernels.hpp) ----
template <typename T>
__global__ void vocab_parallel_row_max_k(const T* logits, int vocab, float* row_max) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * vocab;
  float mx = -INFINITY;
  for (int c = threadIdx.x; c < vocab; c += blockDim.x) mx = fmaxf(mx, load(logits, row + c));
  mx = block_reduce<true>(mx);
  if (threadIdx.x == 0) row_max[blockIdx.x] = mx;
}
__device__ __forceinline__ float max_over_ranks(const float* all_max, int ranks, int n_tok, int t) {
  float m = -INFINITY;
  for (int r = 0; r < ranks; ++r) m = fmaxf(m, all_max[static_cast<std::int64_t>(r) * n_tok + t]);
  return m;
}
template <typename T>
__global__ void vocab_parallel_sums_k(const T* logits, const int* targets, int n_tok, int vocab, int first,
                                      const float* all_max, int ranks, float* sums) {
  const int t = static_cast<int>(blockIdx.x);
  const std::int64_t row = static_cast<std::int64_t>(t) * vocab;
  const float m = max_over_ranks(all_max, ranks, n_tok, t);
  float s = 0;
  for (int c = threadIdx.x; c < vocab; c += blockDim.x) s += expf(load(logits, row + c) - m);
  s = block_reduce<false>(s);
  if (threadIdx.x == 0) {
    const int y = targets[t] - first;
    sums[t] = s;
    sums[n_tok + t] = y >= 0 && y < vocab ? load(logits, row + y) - m : 0.0f;
  }
}
template <typename T>
__global__ void vocab_parallel_finish_k(T* logits, const int* targets, int n_tok, int vocab, int first,
                                        const float* all_max, const float* all_sums, int ranks, float loss_scale,
                                        float* loss) {
  const int t = static_cast<int>(blockIdx.x);
  const std::int64_t row = static_cast<std::int64_t>(t) * vocab;
  const float m = max_over_ranks(all_max, ranks, n_tok, t);
  float s = 0, z = 0;
  for (int r = 0; r < ranks; ++r) {  // in rank order on every rank: the same sum everywhere
    s += all_sums[static_cast<std::int64_t>(r) * 2 * n_tok + t];
    z += all_sums[static_cast<std::int64_t>(r) * 2 * n_tok + n_tok + t];
  }
  if (threadIdx.x == 0) loss[t] = logf(s) - z;
  const int y = targets[t] - first;
  for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float p = expf(load(logits, row + c) - m) / s;
    store(logits, row + c, (p - (c == y ? 1.0f : 0.0f)) * loss_scale);
  }
}

// ---- AdamW ----
// One element's update; returns the new parameter.
__device__ __forceinline__ float adamw_element(const AdamW& cfg, float bc1, float bc2, float p, float g, float& m,
                                               float& v) {
  const float gr = g * cfg.grad_scale;
  m = cfg.beta1 * m + (1.0f - cfg.beta1) * gr;
  v = cfg.beta2 * v + (1.0f - cfg.beta2) * gr * gr;
  const float mhat = m / bc1, vhat = v / bc2;
  return p - cfg.lr * (mhat / (sqrtf(vhat) + cfg.eps) + cfg.weight_decay * p);
}

__global__ void adamw_k(AdamW cfg, float bc1, float bc2, float* params, const float* grads, float* m, float* v,
                        std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float mi = m[i], vi = v[i];
  params[i] = adamw_element(cfg, bc1, bc2, params[i], grads[i], mi, vi);
  m[i] = mi, v[i] = vi;
}

// adamw_k that also stores the new parameter in the storage type and zeroes the gradient it read: one
// pass over the optimizer's memory instead of three (the update, the cast, the gradient memset).
template <typename T>
__global__ void adamw_store_k(AdamW cfg, float bc1, float bc2, float* master, float* grads, float* m, float* v,
                              T* params, bool zero_grads, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float mi = m[i], vi = v[i];
  const float p = adamw_element(cfg, bc1, bc2, master[i], grads[i], mi, vi);
  master[i] = p, m[i] = mi, v[i] = vi;
  store(params, i, p);
  if (zero_grads) grads[i] = 0.0f;
}

// ---- data movement ----
template <typename T>
__global__ void gather_rows_k(const T* in, const int* index, int rows, int cols, T* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(rows) * cols) return;
  const std::int64_t r = i / cols, c = i % cols;
  out[i] = in[static_cast<std::int64_t>(index[r]) * cols + c];
}
template <typename T>
__global__ void scatter_add_rows_k(const T* in, const int* index, const float* weight, int rows, int cols, float* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(rows) * cols) return;
  const std::int64_t r = i / cols, c = i % cols;
  const float w = weight ? weight[r] : 1.0f;
  atomicAdd(&out[static_cast<std::int64_t>(index[r]) * cols + c], w * load(in, i));
}
template <typename T>
__global__ void accumulate_k(T* dst, const T* src, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) store(dst, i, load(dst, i) + load(src, i));
}
template <typename From, typename To>
__global__ void convert_k(const From* src, To* dst, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) store(dst, i, load(src, i));
}

// ---- MoE routing: one thread per token (k and E are small) ----
template <typename T>
__global__ void router_topk_k(const T* logits, int n_tok, int experts, int top_k, int* topk, float* gates) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n_tok) return;
  const T* l = logits + static_cast<std::int64_t>(t) * experts;
  int* ids = topk + static_cast<std::int64_t>(t) * top_k;
  // Selection in rank order: the best unused logit each round, ties to the lower id (as the host).
  for (int j = 0; j < top_k; ++j) {
    int best = -1;
    float bv = 0;
    for (int e = 0; e < experts; ++e) {
      bool used = false;
      for (int i = 0; i < j; ++i) used |= ids[i] == e;
      if (used) continue;
      const float v = load(l, e);
      if (best < 0 || v > bv) best = e, bv = v;
    }
    ids[j] = best;
  }
  const float mx = load(l, ids[0]);
  float sum = 0;
  for (int j = 0; j < top_k; ++j) sum += expf(load(l, ids[j]) - mx);
  for (int j = 0; j < top_k; ++j) gates[static_cast<std::int64_t>(t) * top_k + j] = expf(load(l, ids[j]) - mx) / sum;
}
template <typename T>
__global__ void router_backward_k(const int* topk, const float* gates, const float* dgates, int n_tok, int experts,
                                  int top_k, T* dlogits) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n_tok) return;
  const std::int64_t r = static_cast<std::int64_t>(t) * top_k;
  T* dl = dlogits + static_cast<std::int64_t>(t) * experts;
  for (int e = 0; e < experts; ++e) store(dl, e, 0.0f);
  float dot = 0;
  for (int j = 0; j < top_k; ++j) dot += gates[r + j] * dgates[r + j];
  for (int j = 0; j < top_k; ++j) store(dl, topk[r + j], gates[r + j] * (dgates[r + j] - dot));
}
template <typename T>
__global__ void moe_combine_k(const T* x, const T* y, const float* gates, int n_tok, int top_k, int hidden, T* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(n_tok) * hidden) return;
  const std::int64_t t = i / hidden, c = i % hidden;
  float acc = load(x, i);
  for (int j = 0; j < top_k; ++j) acc += gates[t * top_k + j] * load(y, (t * top_k + j) * hidden + c);
  store(out, i, acc);
}
// One block per slot.
template <typename T>
__global__ void moe_gate_grad_k(const T* dx, const T* y, int top_k, int hidden, float* dgates) {
  const std::int64_t slot = blockIdx.x, t = slot / top_k;
  float acc = 0;
  for (int c = threadIdx.x; c < hidden; c += blockDim.x) acc += load(dx, t * hidden + c) * load(y, slot * hidden + c);
  acc = block_reduce<false>(acc);
  if (threadIdx.x == 0) dgates[slot] = acc;
}
template <typename T>
__global__ void moe_sum_slots_k(const T* du, const T* slots, int n_tok, int top_k, int hidden, T* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(n_tok) * hidden) return;
  const std::int64_t t = i / hidden, c = i % hidden;
  float acc = load(du, i);
  for (int j = 0; j < top_k; ++j) acc += load(slots, (t * top_k + j) * hidden + c);
  store(out, i, acc);
}
template <typename T>
__global__ void gather_slots_k(const T* in, const int* index, int div, const float* weight, int rows, int cols,
                               T* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(rows) * cols) return;
  const std::int64_t r = i / cols, c = i % cols;
  const int slot = index[r];
  const float w = weight ? weight[slot] : 1.0f;
  store(out, i, w * load(in, static_cast<std::int64_t>(slot / div) * cols + c));
}
template <typename T>
__global__ void scatter_rows_k(const T* in, const int* index, int rows, int cols, T* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(rows) * cols) return;
  const std::int64_t r = i / cols, c = i % cols;
  out[static_cast<std::int64_t>(index[r]) * cols + c] = in[i];
}
template <typename T>
__global__ void accumulate_f32_k(float* dst, const T* src, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] += load(src, i);
}
template <typename T>
__global__ void add_k(const T* a, const T* b, std::int64_t n, T* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) store(out, i, load(a, i) + load(b, i));
}
__global__ void sum_into_k(const float* v, int n, float* acc) {
  float s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += v[i];
  s = block_reduce<false>(s);
  // Atomic: heads of different streams (or virtual devices' ops) may add to one accumulator at once.
  if (threadIdx.x == 0) atomicAdd(acc, s);
}

__global__ void sum_squares_k(const float* v, std::int64_t n, float* acc, float scale) {
  float s = 0;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float u = v[i] * scale;
    s += u * u;
  }
  s = block_reduce<false>(s);
  if (threadIdx.x == 0) atomicAdd(acc, s);
}

}  // namespace

void embedding_forward(DType dt, const void* table, const int* tokens, int n_tok, int hidden, void* x,
                       cudaStream_t stream, int first_row, int table_rows) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    embedding_forward_k<T><<<blocks_for(static_cast<std::int64_t>(n_tok) * hidden), kThreads, 0, stream>>>(
        static_cast<const T*>(table), tokens, n_tok, hidden, static_cast<T*>(x), first_row, table_rows);
  });
  launched("embedding_forward");
}

void embedding_backward_weight(DType dt, const int* tokens, const void* dx, int n_tok, int hidden, float* dtable,
                               cudaStream_t stream, int first_row, int table_rows) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    embedding_backward_weight_k<T><<<blocks_for(static_cast<std::int64_t>(n_tok) * hidden), kThreads, 0, stream>>>(
        tokens, static_cast<const T*>(dx), n_tok, hidden, dtable, first_row, table_rows);
  });
  launched("embedding_backward_weight");
}

void rmsnorm_forward(DType dt, const void* x, const void* g, int rows, int cols, float eps, void* y, float* rstd,
                     cudaStream_t stream) {
  if (rows == 0) return;
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rmsnorm_forward_k<T><<<rows, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(g), cols, eps,
                                                        static_cast<T*>(y), rstd);
  });
  launched("rmsnorm_forward");
}

void rmsnorm_backward_input(DType dt, const void* x, const float* rstd, const void* g, const void* dy, int rows,
                            int cols, void* dx, cudaStream_t stream) {
  if (rows == 0) return;
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rmsnorm_backward_input_k<T><<<rows, kThreads, 0, stream>>>(static_cast<const T*>(x), rstd, static_cast<const T*>(g),
                                                               static_cast<const T*>(dy), cols, static_cast<T*>(dx));
  });
  launched("rmsnorm_backward_input");
}

void rmsnorm_backward_weight(DType dt, const void* x, const float* rstd, const void* dy, int rows, int cols, float* dg,
                             cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rmsnorm_backward_weight_k<T><<<column_blocks(cols), kThreads, 0, stream>>>(
        static_cast<const T*>(x), rstd, static_cast<const T*>(dy), rows, cols, dg);
  });
  launched("rmsnorm_backward_weight");
}

void rope(DType dt, void* m, int n_tok, int heads, int head_dim, int seq_len, float theta, float sign,
          cudaStream_t stream, int cp, int cp_rank) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_k<T><<<blocks_for(static_cast<std::int64_t>(n_tok) * heads * (head_dim / 2)), kThreads, 0, stream>>>(
        static_cast<T*>(m), n_tok, heads, head_dim, seq_len, theta, sign, cp, cp_rank);
  });
  launched("rope");
}

void attention_core_forward(DType dt, const AttentionDims& d, const void* q, const void* k, const void* v, float* probs,
                            void* o, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(d.tokens), static_cast<unsigned>(d.heads));
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    attention_forward_k<T><<<grid, kThreads, 0, stream>>>(d, static_cast<const T*>(q), static_cast<const T*>(k),
                                                          static_cast<const T*>(v), probs, static_cast<T*>(o));
  });
  launched("attention_core_forward");
}

void attention_core_backward(DType dt, const AttentionDims& d, const void* q, const void* k, const void* v,
                             const float* probs, const void* d_o, float* ds, void* dq, void* dk, void* dv,
                             cudaStream_t stream) {
  const dim3 grid_q(static_cast<unsigned>(d.tokens), static_cast<unsigned>(d.heads));
  const dim3 grid_kv(static_cast<unsigned>(d.tokens) * static_cast<unsigned>(d.cp), static_cast<unsigned>(d.kv_heads));
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    attention_backward_q_k<T><<<grid_q, kThreads, 0, stream>>>(d, static_cast<const T*>(k), static_cast<const T*>(v),
                                                               probs, static_cast<const T*>(d_o), ds,
                                                               static_cast<T*>(dq));
    attention_backward_kv_k<T><<<grid_kv, kThreads, 0, stream>>>(
        d, static_cast<const T*>(q), probs, static_cast<const T*>(d_o), ds, static_cast<T*>(dk), static_cast<T*>(dv));
  });
  launched("attention_core_backward");
}

void swiglu_forward(DType dt, const void* a, const void* b, std::int64_t n, void* h, cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_forward_k<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b), n,
                                                                static_cast<T*>(h));
  });
  launched("swiglu_forward");
}

void swiglu_backward(DType dt, const void* a, const void* b, const void* dh, std::int64_t n, void* da, void* db,
                     cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_backward_k<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                                                 static_cast<const T*>(dh), n, static_cast<T*>(da),
                                                                 static_cast<T*>(db));
  });
  launched("swiglu_backward");
}

void cross_entropy(DType dt, void* logits, const int* targets, int n_tok, int vocab, float loss_scale, float* loss,
                   cudaStream_t stream) {
  if (n_tok == 0) return;
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cross_entropy_k<T><<<n_tok, kThreads, 0, stream>>>(static_cast<T*>(logits), targets, vocab, loss_scale, loss);
  });
  launched("cross_entropy");
}

void vocab_parallel_row_max(DType dt, const void* logits, int n_tok, int vocab, float* row_max, cudaStream_t stream) {
  if (n_tok == 0) return;
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    vocab_parallel_row_max_k<T><<<n_tok, kThreads, 0, stream>>>(static_cast<const T*>(logits), vocab, row_max);
  });
  launched("vocab_parallel_row_max");
}

void vocab_parallel_sums(DType dt, const void* logits, const int* targets, int n_tok, int vocab, int first,
                         const float* all_max, int ranks, float* sums, cudaStream_t stream) {
  if (n_tok == 0) return;
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    vocab_parallel_sums_k<T><<<n_tok, kThreads, 0, stream>>>(static_cast<const T*>(logits), targets, n_tok, vocab,
                                                             first, all_max, ranks, sums);
  });
  launched("vocab_parallel_sums");
}

void vocab_parallel_finish(DType dt, void* logits, const int* targets, int n_tok, int vocab, int first,
                           const float* all_max, const float* all_sums, int ranks, float loss_scale, float* loss,
                           cudaStream_t stream) {
  if (n_tok == 0) return;
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    vocab_parallel_finish_k<T><<<n_tok, kThreads, 0, stream>>>(static_cast<T*>(logits), targets, n_tok, vocab, first,
                                                               all_max, all_sums, ranks, loss_scale, loss);
  });
  launched("vocab_parallel_finish");
}

void adamw(const AdamW& cfg, int step, float* params, const float* grads, float* m, float* v, std::int64_t n,
           cudaStream_t stream) {
  // Bias corrections on the host in double, as the host kernel does, then rounded once to fp32.
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.beta1), step));
  const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.beta2), step));
  adamw_k<<<blocks_for(n), kThreads, 0, stream>>>(cfg, bc1, bc2, params, grads, m, v, n);
  launched("adamw");
}

void adamw_store(const AdamW& cfg, int step, float* master, float* grads, float* m, float* v, std::int64_t n, DType dt,
                 void* params, bool zero_grads, cudaStream_t stream) {
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.beta1), step));
  const float bc2 = static_cast<float>(1.0 - std::pow(static_cast<double>(cfg.beta2), step));
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    adamw_store_k<T><<<blocks_for(n), kThreads, 0, stream>>>(cfg, bc1, bc2, master, grads, m, v,
                                                             static_cast<T*>(params), zero_grads, n);
  });
  launched("adamw_store");
}

void gather_rows(DType dt, const void* in, const int* index, int rows, int cols, void* out, cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gather_rows_k<T><<<blocks_for(static_cast<std::int64_t>(rows) * cols), kThreads, 0, stream>>>(
        static_cast<const T*>(in), index, rows, cols, static_cast<T*>(out));
  });
  launched("gather_rows");
}

void scatter_add_rows(DType dt, const void* in, const int* index, const float* weight, int rows, int cols, float* out,
                      cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    scatter_add_rows_k<T><<<blocks_for(static_cast<std::int64_t>(rows) * cols), kThreads, 0, stream>>>(
        static_cast<const T*>(in), index, weight, rows, cols, out);
  });
  launched("scatter_add_rows");
}

void accumulate(DType dt, void* dst, const void* src, std::int64_t n, cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    accumulate_k<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<T*>(dst), static_cast<const T*>(src), n);
  });
  launched("accumulate");
}

void convert(DType from, const void* src, DType to, void* dst, std::int64_t n, cudaStream_t stream) {
  dispatch(from, [&](auto* from_tag) {
    using F = std::remove_pointer_t<decltype(from_tag)>;
    dispatch(to, [&](auto* to_tag) {
      using T = std::remove_pointer_t<decltype(to_tag)>;
      convert_k<F, T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const F*>(src), static_cast<T*>(dst), n);
    });
  });
  launched("convert");
}

#define PIPER_TYPED(dt, body)                       \
  dispatch(dt, [&](auto* tag) {                     \
    using T = std::remove_pointer_t<decltype(tag)>; \
    body;                                           \
  })

void router_topk(DType dt, const void* logits, int n_tok, int experts, int top_k, int* topk, float* gates,
                 cudaStream_t stream) {
  PIPER_TYPED(dt, (router_topk_k<T><<<blocks_for(n_tok), kThreads, 0, stream>>>(static_cast<const T*>(logits), n_tok,
                                                                                experts, top_k, topk, gates)));
  launched("router_topk");
}

void router_backward(DType dt, const int* topk, const float* gates, const float* dgates, int n_tok, int experts,
                     int top_k, void* dlogits, cudaStream_t stream) {
  PIPER_TYPED(dt, (router_backward_k<T><<<blocks_for(n_tok), kThreads, 0, stream>>>(topk, gates, dgates, n_tok, experts,
                                                                                    top_k, static_cast<T*>(dlogits))));
  launched("router_backward");
}

void moe_combine(DType dt, const void* x, const void* y, const float* gates, int n_tok, int top_k, int hidden,
                 void* out, cudaStream_t stream) {
  PIPER_TYPED(
      dt, (moe_combine_k<T><<<blocks_for(static_cast<std::int64_t>(n_tok) * hidden), kThreads, 0, stream>>>(
              static_cast<const T*>(x), static_cast<const T*>(y), gates, n_tok, top_k, hidden, static_cast<T*>(out))));
  launched("moe_combine");
}

void moe_gate_grad(DType dt, const void* dx, const void* y, int n_tok, int top_k, int hidden, float* dgates,
                   cudaStream_t stream) {
  if (n_tok * top_k == 0) return;
  PIPER_TYPED(dt, (moe_gate_grad_k<T><<<static_cast<unsigned>(n_tok * top_k), kThreads, 0, stream>>>(
                      static_cast<const T*>(dx), static_cast<const T*>(y), top_k, hidden, dgates)));
  launched("moe_gate_grad");
}

void moe_sum_slots(DType dt, const void* du, const void* slots, int n_tok, int top_k, int hidden, void* out,
                   cudaStream_t stream) {
  PIPER_TYPED(
      dt, (moe_sum_slots_k<T><<<blocks_for(static_cast<std::int64_t>(n_tok) * hidden), kThreads, 0, stream>>>(
              static_cast<const T*>(du), static_cast<const T*>(slots), n_tok, top_k, hidden, static_cast<T*>(out))));
  launched("moe_sum_slots");
}

void gather_slots(DType dt, const void* in, const int* index, int div, const float* weight, int rows, int cols,
                  void* out, cudaStream_t stream) {
  if (rows == 0) return;
  PIPER_TYPED(dt, (gather_slots_k<T><<<blocks_for(static_cast<std::int64_t>(rows) * cols), kThreads, 0, stream>>>(
                      static_cast<const T*>(in), index, div, weight, rows, cols, static_cast<T*>(out))));
  launched("gather_slots");
}

void scatter_rows(DType dt, const void* in, const int* index, int rows, int cols, void* out, cudaStream_t stream) {
  if (rows == 0) return;
  PIPER_TYPED(dt, (scatter_rows_k<T><<<blocks_for(static_cast<std::int64_t>(rows) * cols), kThreads, 0, stream>>>(
                      static_cast<const T*>(in), index, rows, cols, static_cast<T*>(out))));
  launched("scatter_rows");
}

void accumulate_f32(DType dt, float* dst, const void* src, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  PIPER_TYPED(dt, (accumulate_f32_k<T><<<blocks_for(n), kThreads, 0, stream>>>(dst, static_cast<const T*>(src), n)));
  launched("accumulate_f32");
}

void add(DType dt, const void* a, const void* b, std::int64_t n, void* out, cudaStream_t stream) {
  if (n == 0) return;
  PIPER_TYPED(dt, (add_k<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                                                    n, static_cast<T*>(out))));
  launched("add");
}

void sum_squares(const float* v, std::int64_t n, float* acc, cudaStream_t stream, float scale) {
  if (n <= 0) return;
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>(blocks_for(n), 1024));
  sum_squares_k<<<blocks, kThreads, 0, stream>>>(v, n, acc, scale);
  launched("sum_squares");
}

void sum_into(const float* v, int n, float* acc, cudaStream_t stream) {
  sum_into_k<<<1, kThreads, 0, stream>>>(v, n, acc);
  launched("sum_into");
}

#undef PIPER_TYPED

}  // namespace piper::runtime::cuda
