// Flash-attention-style causal GQA attention for bf16 storage: tensor-core tiles (nvcuda::wmma, bf16
// inputs, fp32 accumulation), online softmax, and only the log-sum-exp of each row kept for the
// backward (FlashAttention-2, Dao 2023). The explicit-probabilities kernels in kernels.cu stay the
// reference (and the fp32 path); tests/gpu/test_cuda_kernels.cpp compares both with a host reference.
//
// Layout (as kernels.hpp): q/o [T, heads*D], k/v [T, kv_heads*D], token t = seq * L + i. A block
// works on one (64-row tile, head, sequence); its 4 warps own 16 rows each of that tile, so a warp's
// scores, probabilities and outputs live in a warp-private shared scratch and need only __syncwarp();
// the K/V (or Q/dO) tiles are shared by the block and reloaded between two __syncthreads().
//
// Scores are kept in base-2 units: s2 = (q . k) * (log2 e / sqrt(D)), so that exp2f is the
// exponential; lse2 = log2(sum_j 2^s2_j) is what the forward stores, and P_ij = 2^(s2_ij - lse2_i).
//
// Masking: a key j is used by query i iff j <= i. Tiles have equal sizes (64 queries, 64 keys), so the
// query tile qb needs key tiles 0..qb, and every key tile kb <= qb holds at least one key j <= i for
// every row i of the query tile (kb < qb: all keys; kb == qb: the key j = i): the running maximum is
// finite after the first tile (it is guarded anyway). Rows at or past L are zero-filled in shared
// memory and never stored; keys at or past L are always masked for rows i < L (j >= L > i).
#include "piper/runtime/cuda/kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <fmt/format.h>
#include <mma.h>

namespace piper::runtime::cuda {
namespace {

using namespace nvcuda;
using bf16 = __nv_bfloat16;

constexpr int kTile = 64;  // query rows per block, keys per tile
constexpr int kWarps = 4;  // 4 warps x 16 rows = one tile
constexpr int kThreadsPerBlock = kWarps * 32;
constexpr int kFrag = 16;            // wmma m = n = k = 16 for bf16
constexpr int kScoreLd = kTile + 4;  // fp32 rows of 64 scores (wmma float ld: multiple of 4)
constexpr int kProbLd = kTile + 8;   // bf16 rows of 64 probabilities (wmma bf16 ld: multiple of 8)
constexpr float kLog2e = 1.4426950408889634f;

using FragA = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, bf16, wmma::row_major>;
using FragBRow = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, bf16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float>;

// Shared-memory plans. Every region (and every 16-row / 16-column fragment pointer inside one) is
// 32-byte aligned, as wmma::load/store_matrix_sync require: bf16 tile rows are (D + 8) * 2 bytes
// (144 or 272), so 16 rows are a multiple of 32 bytes and 16 columns are 32 bytes; fp32 rows are
// 68 * 4 or (D + 4) * 4 bytes, 16 of them again a multiple of 32 (checked below).
template <int D>
struct Plan {
  static constexpr int kLd = D + 8;     // bf16 tile row stride (padding spreads rows over banks)
  static constexpr int kOutLd = D + 4;  // fp32 [16, D] output block row stride
  static constexpr std::size_t kTileBytes = static_cast<std::size_t>(kTile) * kLd * 2;
  static constexpr std::size_t kProbBytes = static_cast<std::size_t>(kFrag) * kProbLd * 2;  // per warp

  // Forward: Q, K, V tiles; per warp an fp32 scratch holding first the 16 x 64 scores, then the
  // 16 x D block P V (the two are never live together); the bf16 probabilities; 16 row factors.
  static constexpr int kFwdScratchFloats = kFrag * (kScoreLd > kOutLd ? kScoreLd : kOutLd);
  static constexpr std::size_t kFwdQ = 0;
  static constexpr std::size_t kFwdK = kFwdQ + kTileBytes;
  static constexpr std::size_t kFwdV = kFwdK + kTileBytes;
  static constexpr std::size_t kFwdScratch = kFwdV + kTileBytes;
  static constexpr std::size_t kFwdProb = kFwdScratch + kWarps * kFwdScratchFloats * 4;
  static constexpr std::size_t kFwdRow = kFwdProb + kWarps * kProbBytes;
  static constexpr std::size_t kFwdBytes = kFwdRow + kWarps * kFrag * 4;

  // Backward (both kernels): Q, dO, K, V tiles; the tile's 64 lse2 and delta values; per warp an
  // fp32 scratch of two 16 x 64 blocks (scores and dP), reused for the 16 x D output block at the
  // end; two bf16 16 x 64 blocks (P and dS, the dQ kernel uses only dS).
  static constexpr int kBwdScratchFloats = 2 * kFrag * kScoreLd > kFrag* kOutLd ? 2 * kFrag* kScoreLd : kFrag* kOutLd;
  static constexpr std::size_t kBwdQ = 0;
  static constexpr std::size_t kBwdDO = kBwdQ + kTileBytes;
  static constexpr std::size_t kBwdK = kBwdDO + kTileBytes;
  static constexpr std::size_t kBwdV = kBwdK + kTileBytes;
  static constexpr std::size_t kBwdLse = kBwdV + kTileBytes;
  static constexpr std::size_t kBwdDelta = kBwdLse + kTile * 4;
  static constexpr std::size_t kBwdScratch = kBwdDelta + kTile * 4;
  static constexpr std::size_t kBwdProb = kBwdScratch + kWarps * kBwdScratchFloats * 4;
  static constexpr std::size_t kBwdDs = kBwdProb + kWarps * kProbBytes;
  static constexpr std::size_t kBwdBytes = kBwdDs + kWarps * kProbBytes;

  static_assert(D % kFrag == 0 && D % 8 == 0, "head_dim must be a multiple of 16");
  static_assert(kTileBytes % 32 == 0 && (kFrag * kLd * 2) % 32 == 0, "bf16 tiles must keep 32-byte alignment");
  static_assert((kFwdScratchFloats * 4) % 32 == 0 && (kBwdScratchFloats * 4) % 32 == 0 && kProbBytes % 32 == 0,
                "per-warp regions must keep 32-byte alignment");
  static_assert((kFrag * kScoreLd * 4) % 32 == 0 && (kFrag * kOutLd * 4) % 32 == 0,
                "fp32 blocks must keep 32-byte alignment");
  static_assert(kFwdScratch % 32 == 0 && kFwdProb % 32 == 0 && kFwdRow % 32 == 0,
                "forward regions must be 32-byte aligned");
  static_assert(kBwdLse % 32 == 0 && kBwdScratch % 32 == 0 && kBwdProb % 32 == 0 && kBwdDs % 32 == 0,
                "backward regions must be 32-byte aligned");
  // Hopper's opt-in limit is 227 KiB per block; these are 53-120 KiB (above the 48 KiB default, so
  // the launchers raise cudaFuncAttributeMaxDynamicSharedMemorySize).
  static_assert(kFwdBytes <= 227 * 1024 && kBwdBytes <= 227 * 1024,
                "shared memory plan exceeds Hopper's per-block limit");
};

// Copies rows [row0, row0 + 64) of sequence `seq` (columns [col0, col0 + D) of a [T, stride] bf16
// matrix) into a shared tile with row stride D + 8; rows at or past L become zeros. 16-byte vectors:
// the launcher checks that base pointers are 16-byte aligned, and (t * stride + col0) * 2 bytes is a
// multiple of 16 because stride and col0 are multiples of D (itself a multiple of 8).
template <int D>
__device__ void load_tile(bf16* tile, const bf16* src, int seq, int L, int row0, std::int64_t stride, int col0) {
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < kTile * kChunks; c += blockDim.x) {
    const int r = c / kChunks, part = c % kChunks;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (row0 + r < L)
      v = *reinterpret_cast<const uint4*>(src + (static_cast<std::int64_t>(seq) * L + row0 + r) * stride + col0 +
                                          part * 8);
    *reinterpret_cast<uint4*>(tile + r * Plan<D>::kLd + part * 8) = v;
  }
}

// The 64 per-row statistics of a query tile; rows at or past L get `pad`.
__device__ void load_rows(float* dst, const float* src, int L, int row0, float pad) {
  for (int r = threadIdx.x; r < kTile; r += blockDim.x) dst[r] = row0 + r < L ? src[row0 + r] : pad;
}

// Writes a warp's 16 x D fp32 accumulator block, times `scale`, as bf16 rows [row0, row0 + 16) of
// sequence `seq` (rows at or past L skipped), through the warp's fp32 scratch (ld D + 4).
template <int D>
__device__ void store_block(FragC (&acc)[D / kFrag], float scale, float* scratch, bf16* dst, int seq, int L, int row0,
                            std::int64_t stride, int col0) {
  constexpr int kLd = Plan<D>::kOutLd;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < D / kFrag; ++n) {
    // Uniform scaling of every element does not depend on the fragment's (opaque) layout.
    for (int t = 0; t < acc[n].num_elements; ++t) acc[n].x[t] *= scale;
    wmma::store_matrix_sync(scratch + n * kFrag, acc[n], kLd, wmma::mem_row_major);
  }
  __syncwarp();
  for (int e = lane; e < kFrag * D; e += 32) {
    const int r = e / D, c = e % D;
    if (row0 + r < L)
      dst[(static_cast<std::int64_t>(seq) * L + row0 + r) * stride + col0 + c] = __float2bfloat16(scratch[r * kLd + c]);
  }
  __syncwarp();  // the scratch may be reused right after
}

// The two 16 x 64 tile products both backward kernels start from: out1 = A1 B1^T and out2 = A2 B2^T,
// where A1, A2 are the warp's 16 rows of a [64, D] shared tile (already offset to them) and B1, B2
// whole [64, D] shared tiles (B^T as a col_major matrix_b is B's row-major storage). The dK/dV kernel
// passes (K, Q, V, dO) for S^T and dP^T, the dQ kernel (Q, K, dO, V) for S and dP. Both outputs are
// fp32 with row stride kScoreLd; the trailing __syncwarp makes them visible to the whole warp.
template <int D>
__device__ void row_products(const bf16* a1, const bf16* b1, const bf16* a2, const bf16* b2, float* out1, float* out2) {
  constexpr int kLd = Plan<D>::kLd;
#pragma unroll
  for (int c = 0; c < kTile / kFrag; ++c) {
    FragC p1, p2;
    wmma::fill_fragment(p1, 0.0f);
    wmma::fill_fragment(p2, 0.0f);
#pragma unroll
    for (int dd = 0; dd < D / kFrag; ++dd) {
      FragA a;
      FragBCol b;
      wmma::load_matrix_sync(a, a1 + dd * kFrag, kLd);
      wmma::load_matrix_sync(b, b1 + c * kFrag * kLd + dd * kFrag, kLd);
      wmma::mma_sync(p1, a, b, p1);
      wmma::load_matrix_sync(a, a2 + dd * kFrag, kLd);
      wmma::load_matrix_sync(b, b2 + c * kFrag * kLd + dd * kFrag, kLd);
      wmma::mma_sync(p2, a, b, p2);
    }
    wmma::store_matrix_sync(out1 + c * kFrag, p1, kScoreLd, wmma::mem_row_major);
    wmma::store_matrix_sync(out2 + c * kFrag, p2, kScoreLd, wmma::mem_row_major);
  }
  __syncwarp();
}

// acc += A B for a warp: A is its 16 x 64 bf16 block (row stride kProbLd: P^T, dS^T or dS), B a whole
// [64, D] shared tile (dO, Q or K), acc the warp's 16 x D fp32 accumulator fragments.
template <int D>
__device__ void accumulate_product(const bf16* a_block, const bf16* b_tile, FragC (&acc)[D / kFrag]) {
  constexpr int kLd = Plan<D>::kLd;
#pragma unroll
  for (int n = 0; n < D / kFrag; ++n) {
#pragma unroll
    for (int kk = 0; kk < kTile / kFrag; ++kk) {
      FragA a;
      FragBRow b;
      wmma::load_matrix_sync(a, a_block + kk * kFrag, kProbLd);
      wmma::load_matrix_sync(b, b_tile + kk * kFrag * kLd + n * kFrag, kLd);
      wmma::mma_sync(acc[n], a, b, acc[n]);
    }
  }
}

// Where the backward kernels' shared regions lie (Plan<D>::kBwd*): the block's Q, dO, K, V tiles and
// 64 lse2/delta values, then the calling warp's own fp32 score and dP blocks (16 x 64, row stride
// kScoreLd; the end of the scratch also takes the 16 x D output block) and bf16 P and dS blocks.
struct BackwardShared {
  bf16 *q, *d_o, *k, *v;
  float *lse, *delta, *scores, *dp;
  bf16 *probs, *ds;
};

template <int D>
__device__ BackwardShared backward_shared(unsigned char* smem, int warp) {
  using P = Plan<D>;
  float* scratch = reinterpret_cast<float*>(smem + P::kBwdScratch) + warp * P::kBwdScratchFloats;
  return {reinterpret_cast<bf16*>(smem + P::kBwdQ),
          reinterpret_cast<bf16*>(smem + P::kBwdDO),
          reinterpret_cast<bf16*>(smem + P::kBwdK),
          reinterpret_cast<bf16*>(smem + P::kBwdV),
          reinterpret_cast<float*>(smem + P::kBwdLse),
          reinterpret_cast<float*>(smem + P::kBwdDelta),
          scratch,
          scratch + kFrag * kScoreLd,
          reinterpret_cast<bf16*>(smem + P::kBwdProb) + warp * kFrag * kProbLd,
          reinterpret_cast<bf16*>(smem + P::kBwdDs) + warp * kFrag * kProbLd};
}

// ---- forward: grid (query tiles, heads, sequences) ----
template <int D>
__global__ void __launch_bounds__(kThreadsPerBlock)
    flash_forward_k(AttentionDims d, const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                    float* __restrict__ lse, bf16* __restrict__ o) {
  using P = Plan<D>;
  constexpr int kLd = P::kLd, kOutLd = P::kOutLd;
  constexpr int kPerLane = kFrag * D / 32;  // output elements of the warp's 16 x D block per lane
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  bf16* qs = reinterpret_cast<bf16*>(smem + P::kFwdQ);
  bf16* ks = reinterpret_cast<bf16*>(smem + P::kFwdK);
  bf16* vs = reinterpret_cast<bf16*>(smem + P::kFwdV);
  float* scratch = reinterpret_cast<float*>(smem + P::kFwdScratch) + warp * P::kFwdScratchFloats;
  bf16* probs = reinterpret_cast<bf16*>(smem + P::kFwdProb) + warp * kFrag * kProbLd;
  float* row_factor = reinterpret_cast<float*>(smem + P::kFwdRow) + warp * kFrag;

  const int L = d.seq_len, h = static_cast<int>(blockIdx.y), seq = static_cast<int>(blockIdx.z);
  const int g = h / (d.heads / d.kv_heads);
  const int tiles = (L + kTile - 1) / kTile;
  const int qb = tiles - 1 - static_cast<int>(blockIdx.x);  // the longest rows (most key tiles) start first
  const int q0 = qb * kTile;
  const std::int64_t qstride = static_cast<std::int64_t>(d.heads) * D,
                     kstride = static_cast<std::int64_t>(d.kv_heads) * D;
  const float scale2 = rsqrtf(static_cast<float>(D)) * kLog2e;

  load_tile<D>(qs, q, seq, L, q0, qstride, h * D);
  __syncthreads();
  FragA qf[D / kFrag];  // the warp's 16 query rows, kept in registers for every key tile
#pragma unroll
  for (int dd = 0; dd < D / kFrag; ++dd) wmma::load_matrix_sync(qf[dd], qs + warp * kFrag * kLd + dd * kFrag, kLd);

  // Softmax: lanes 2r and 2r + 1 share row r of the warp's 16 and take columns 2c + (lane & 1).
  const int my_row = lane / 2, half = lane % 2;
  const int qi = q0 + warp * kFrag + my_row;
  float m_run = -INFINITY, l_run = 0.0f;  // running max (base 2) and sum of the row, equal in both lanes
  float acc[kPerLane];                    // element e = lane + 32 j of the warp's 16 x D output block
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) acc[j] = 0.0f;

  for (int kb = 0; kb <= qb; ++kb) {
    const int k0 = kb * kTile;
    __syncthreads();  // every warp finished reading the previous K/V tile
    load_tile<D>(ks, k, seq, L, k0, kstride, g * D);
    load_tile<D>(vs, v, seq, L, k0, kstride, g * D);
    __syncthreads();

    // S = Q K^T, 16 x 64: K^T as a col_major matrix_b is K's row-major storage (B[d][j] = K[j][d]).
#pragma unroll
    for (int c = 0; c < kTile / kFrag; ++c) {
      FragC s;
      wmma::fill_fragment(s, 0.0f);
#pragma unroll
      for (int dd = 0; dd < D / kFrag; ++dd) {
        FragBCol b;
        wmma::load_matrix_sync(b, ks + c * kFrag * kLd + dd * kFrag, kLd);
        wmma::mma_sync(s, qf[dd], b, s);
      }
      wmma::store_matrix_sync(scratch + c * kFrag, s, kScoreLd, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax of this tile's scores for the lane pair's row.
    float sv[kTile / 2];
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < kTile / 2; ++c) {
      const int col = 2 * c + half;
      sv[c] = k0 + col <= qi ? scratch[my_row * kScoreLd + col] * scale2 : -INFINITY;
      mx = fmaxf(mx, sv[c]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m_run, mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // never -inf here (see the header); no NaN if it were
    const float alpha = exp2f(m_run - m_use);               // 0 on the first tile (m_run = -inf)
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < kTile / 2; ++c) {
      const float p = exp2f(sv[c] - m_use);  // masked: exp2(-inf) = 0
      sum += p;
      probs[my_row * kProbLd + 2 * c + half] = __float2bfloat16(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l_run = l_run * alpha + sum;
    m_run = m_new;
    if (half == 0) row_factor[my_row] = alpha;
    __syncwarp();  // probabilities and factors visible; the scores are dead, the scratch takes P V

    // P V, 16 x D, into the scratch (ld D + 4), then acc = acc * alpha + P V row by row.
#pragma unroll
    for (int n = 0; n < D / kFrag; ++n) {
      FragC pv;
      wmma::fill_fragment(pv, 0.0f);
#pragma unroll
      for (int kk = 0; kk < kTile / kFrag; ++kk) {
        FragA a;
        FragBRow b;
        wmma::load_matrix_sync(a, probs + kk * kFrag, kProbLd);
        wmma::load_matrix_sync(b, vs + kk * kFrag * kLd + n * kFrag, kLd);
        wmma::mma_sync(pv, a, b, pv);
      }
      wmma::store_matrix_sync(scratch + n * kFrag, pv, kOutLd, wmma::mem_row_major);
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j, r = e / D, col = e % D;
      acc[j] = acc[j] * row_factor[r] + scratch[r * kOutLd + col];
    }
    __syncwarp();  // row_factor and the scratch are rewritten next
  }

  if (half == 0) {
    row_factor[my_row] = l_run;
    if (qi < L) lse[(static_cast<std::int64_t>(seq) * d.heads + h) * L + qi] = m_run + log2f(l_run);
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j, r = e / D, col = e % D;
    const int row = q0 + warp * kFrag + r;
    if (row < L)
      o[(static_cast<std::int64_t>(seq) * L + row) * qstride + h * D + col] = __float2bfloat16(acc[j] / row_factor[r]);
  }
}

// ---- backward, step 1: delta_i = dO_i . O_i per (token, head), one warp each ----
// (= sum_j P_ij dP_ij, the row term of dS = P (dP - delta)).
__global__ void flash_delta_k(AttentionDims d, const bf16* __restrict__ o, const bf16* __restrict__ d_o,
                              float* __restrict__ delta) {
  const std::int64_t w = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  if (w >= static_cast<std::int64_t>(d.tokens) * d.heads) return;  // uniform per warp
  const std::int64_t t = w / d.heads;
  const int h = static_cast<int>(w % d.heads);
  const std::int64_t at = t * d.heads * d.head_dim + static_cast<std::int64_t>(h) * d.head_dim;
  float s = 0.0f;
  for (int e = lane; e < d.head_dim; e += 32) s += __bfloat162float(o[at + e]) * __bfloat162float(d_o[at + e]);
  for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
  if (lane == 0) {
    const std::int64_t seq = t / d.seq_len, i = t % d.seq_len;
    delta[(seq * d.heads + h) * d.seq_len + i] = s;
  }
}

// ---- backward, step 2: dK, dV. Grid (key tiles, kv heads, sequences). The block keeps its 64 keys'
// K and V and loops over the heads of the group and the query tiles qb >= kb; a warp owns 16 keys and
// accumulates their dK, dV (16 x D each) in wmma fragments (no rescaling: P is exact from lse2):
//   S^T = K Q^T, dP^T = V dO^T, P^T = 2^(s2 - lse2), dS^T = P^T (dP^T - delta),
//   dV += P^T dO, dK += dS^T Q, and dK *= 1/sqrt(D) at the end. ----
template <int D>
__global__ void __launch_bounds__(kThreadsPerBlock)
    flash_backward_kv_k(AttentionDims d, const bf16* __restrict__ q, const bf16* __restrict__ k,
                        const bf16* __restrict__ v, const bf16* __restrict__ d_o, const float* __restrict__ lse,
                        const float* __restrict__ delta, bf16* __restrict__ dk, bf16* __restrict__ dv) {
  using P = Plan<D>;
  constexpr int kLd = P::kLd;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  // S^T and dP^T (16 keys x 64 queries each), P^T and dS^T in bf16.
  const auto [qs, dos, ks, vs, lse_s, delta_s, st, dpt, pt, dst] = backward_shared<D>(smem, warp);

  const int L = d.seq_len, g = static_cast<int>(blockIdx.y), seq = static_cast<int>(blockIdx.z);
  const int group = d.heads / d.kv_heads;
  const int tiles = (L + kTile - 1) / kTile;
  const int kb = static_cast<int>(blockIdx.x);  // the first key tiles have the most query tiles: start first
  const int k0 = kb * kTile;
  const std::int64_t qstride = static_cast<std::int64_t>(d.heads) * D,
                     kstride = static_cast<std::int64_t>(d.kv_heads) * D;
  const float scale = rsqrtf(static_cast<float>(D)), scale2 = scale * kLog2e;

  load_tile<D>(ks, k, seq, L, k0, kstride, g * D);
  load_tile<D>(vs, v, seq, L, k0, kstride, g * D);
  FragC dk_acc[D / kFrag], dv_acc[D / kFrag];
#pragma unroll
  for (int n = 0; n < D / kFrag; ++n) wmma::fill_fragment(dk_acc[n], 0.0f), wmma::fill_fragment(dv_acc[n], 0.0f);

  for (int hh = 0; hh < group; ++hh) {
    const int h = g * group + hh;
    const std::int64_t stats = (static_cast<std::int64_t>(seq) * d.heads + h) * L;
    for (int qb = kb; qb < tiles; ++qb) {
      const int q0 = qb * kTile;
      __syncthreads();  // every warp finished with the previous Q/dO tile (and K/V are loaded on entry)
      load_tile<D>(qs, q, seq, L, q0, qstride, h * D);
      load_tile<D>(dos, d_o, seq, L, q0, qstride, h * D);
      // Rows past L: lse2 = +inf makes P = 2^(-inf) = 0 there, delta 0.
      load_rows(lse_s, lse + stats, L, q0, INFINITY);
      load_rows(delta_s, delta + stats, L, q0, 0.0f);
      __syncthreads();

      row_products<D>(ks + warp * kFrag * kLd, qs, vs + warp * kFrag * kLd, dos, st, dpt);
      for (int e = lane; e < kFrag * kTile; e += 32) {
        const int r = e / kTile, c = e % kTile;  // key k0 + 16 warp + r, query q0 + c
        float p = 0.0f, ds = 0.0f;
        if (k0 + warp * kFrag + r <= q0 + c) {
          p = exp2f(st[r * kScoreLd + c] * scale2 - lse_s[c]);
          ds = p * (dpt[r * kScoreLd + c] - delta_s[c]);
        }
        pt[r * kProbLd + c] = __float2bfloat16(p);
        dst[r * kProbLd + c] = __float2bfloat16(ds);
      }
      __syncwarp();
      accumulate_product<D>(pt, dos, dv_acc);
      accumulate_product<D>(dst, qs, dk_acc);
    }
  }
  // The warp's fp32 scratch (it starts at st) has its last readers, the elementwise pass, behind the
  // last __syncwarp above.
  store_block<D>(dk_acc, scale, st, dk, seq, L, k0 + warp * kFrag, kstride, g * D);
  store_block<D>(dv_acc, 1.0f, st, dv, seq, L, k0 + warp * kFrag, kstride, g * D);
}

// ---- backward, step 3: dQ. Grid (query tiles, heads, sequences); a warp owns 16 query rows:
//   S = Q K^T, dP = dO V^T, dS = P (dP - delta), dQ += dS K over key tiles kb <= qb, dQ *= 1/sqrt(D).
// (Recomputing S here instead of atomically adding dQ in the dK/dV kernel costs two more tile
// products but keeps dQ deterministic and free of an fp32 accumulation buffer.) ----
template <int D>
__global__ void __launch_bounds__(kThreadsPerBlock)
    flash_backward_q_k(AttentionDims d, const bf16* __restrict__ q, const bf16* __restrict__ k,
                       const bf16* __restrict__ v, const bf16* __restrict__ d_o, const float* __restrict__ lse,
                       const float* __restrict__ delta, bf16* __restrict__ dq) {
  using P = Plan<D>;
  constexpr int kLd = P::kLd;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  // S and dP (16 queries x 64 keys each), dS in bf16 (this kernel needs no bf16 P).
  const auto [qs, dos, ks, vs, lse_s, delta_s, ss, dps, unused_probs, dss] = backward_shared<D>(smem, warp);

  const int L = d.seq_len, h = static_cast<int>(blockIdx.y), seq = static_cast<int>(blockIdx.z);
  const int g = h / (d.heads / d.kv_heads);
  const int tiles = (L + kTile - 1) / kTile;
  const int qb = tiles - 1 - static_cast<int>(blockIdx.x);
  const int q0 = qb * kTile;
  const std::int64_t qstride = static_cast<std::int64_t>(d.heads) * D,
                     kstride = static_cast<std::int64_t>(d.kv_heads) * D;
  const float scale = rsqrtf(static_cast<float>(D)), scale2 = scale * kLog2e;
  const std::int64_t stats = (static_cast<std::int64_t>(seq) * d.heads + h) * L;

  load_tile<D>(qs, q, seq, L, q0, qstride, h * D);
  load_tile<D>(dos, d_o, seq, L, q0, qstride, h * D);
  load_rows(lse_s, lse + stats, L, q0, INFINITY);
  load_rows(delta_s, delta + stats, L, q0, 0.0f);
  FragC dq_acc[D / kFrag];
#pragma unroll
  for (int n = 0; n < D / kFrag; ++n) wmma::fill_fragment(dq_acc[n], 0.0f);

  for (int kb = 0; kb <= qb; ++kb) {
    const int k0 = kb * kTile;
    __syncthreads();  // the previous K/V tile is no longer read (first pass: Q, dO and the stats are written)
    load_tile<D>(ks, k, seq, L, k0, kstride, g * D);
    load_tile<D>(vs, v, seq, L, k0, kstride, g * D);
    __syncthreads();

    row_products<D>(qs + warp * kFrag * kLd, ks, dos + warp * kFrag * kLd, vs, ss, dps);
    for (int e = lane; e < kFrag * kTile; e += 32) {
      const int r = e / kTile, c = e % kTile;  // query q0 + 16 warp + r, key k0 + c
      float ds = 0.0f;
      if (k0 + c <= q0 + warp * kFrag + r) {
        const float p = exp2f(ss[r * kScoreLd + c] * scale2 - lse_s[warp * kFrag + r]);
        ds = p * (dps[r * kScoreLd + c] - delta_s[warp * kFrag + r]);
      }
      dss[r * kProbLd + c] = __float2bfloat16(ds);
    }
    __syncwarp();
    accumulate_product<D>(dss, ks, dq_acc);
  }
  store_block<D>(dq_acc, scale, ss, dq, seq, L, q0 + warp * kFrag, qstride, h * D);
}

// ---- host side ----

void check_aligned(const void* p, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0)
    throw CudaError(fmt::format("flash attention: operand {} is not 16-byte aligned", what));
}

void check_dims(const AttentionDims& d) {
  if (d.head_dim != 64 && d.head_dim != 128)
    throw CudaError(fmt::format("flash attention: head_dim {} is not 64 or 128", d.head_dim));
  if (d.seq_len < 1 || d.tokens % d.seq_len != 0 || d.kv_heads < 1 || d.heads % d.kv_heads != 0)
    throw CudaError("flash attention: tokens must be whole sequences and heads a multiple of kv_heads");
}

template <class Kernel>
void allow_smem(Kernel kernel, std::size_t bytes) {
  // Above the 48 KiB default: opt in (per kernel; cheap, and idempotent).
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
        "cudaFuncSetAttribute (flash attention shared memory)");
}

template <int D>
void forward_d(const AttentionDims& d, const void* q, const void* k, const void* v, float* lse, void* o,
               cudaStream_t stream) {
  const int tiles = (d.seq_len + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(d.heads),
                  static_cast<unsigned>(d.tokens / d.seq_len));
  allow_smem(flash_forward_k<D>, Plan<D>::kFwdBytes);
  flash_forward_k<D><<<grid, kThreadsPerBlock, Plan<D>::kFwdBytes, stream>>>(
      d, static_cast<const bf16*>(q), static_cast<const bf16*>(k), static_cast<const bf16*>(v), lse,
      static_cast<bf16*>(o));
  check(cudaGetLastError(), "flash_attention_forward");
}

template <int D>
void backward_d(const AttentionDims& d, const void* q, const void* k, const void* v, const void* o, const float* lse,
                const void* d_o, float* delta, void* dq, void* dk, void* dv, cudaStream_t stream) {
  const auto* qb = static_cast<const bf16*>(q);
  const auto* kb = static_cast<const bf16*>(k);
  const auto* vb = static_cast<const bf16*>(v);
  const auto* dob = static_cast<const bf16*>(d_o);
  const std::int64_t warps = static_cast<std::int64_t>(d.tokens) * d.heads;
  flash_delta_k<<<static_cast<unsigned>((warps * 32 + 255) / 256), 256, 0, stream>>>(d, static_cast<const bf16*>(o),
                                                                                     dob, delta);
  check(cudaGetLastError(), "flash_attention_backward (delta)");
  const int tiles = (d.seq_len + kTile - 1) / kTile;
  const unsigned seqs = static_cast<unsigned>(d.tokens / d.seq_len);
  allow_smem(flash_backward_kv_k<D>, Plan<D>::kBwdBytes);
  flash_backward_kv_k<D>
      <<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(d.kv_heads), seqs), kThreadsPerBlock,
         Plan<D>::kBwdBytes, stream>>>(d, qb, kb, vb, dob, lse, delta, static_cast<bf16*>(dk), static_cast<bf16*>(dv));
  check(cudaGetLastError(), "flash_attention_backward (dK, dV)");
  allow_smem(flash_backward_q_k<D>, Plan<D>::kBwdBytes);
  flash_backward_q_k<D><<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(d.heads), seqs), kThreadsPerBlock,
                          Plan<D>::kBwdBytes, stream>>>(d, qb, kb, vb, dob, lse, delta, static_cast<bf16*>(dq));
  check(cudaGetLastError(), "flash_attention_backward (dQ)");
}

}  // namespace

bool flash_attention_supported(DType dt, const AttentionDims& d) {
  return dt == DType::BF16 && (d.head_dim == 64 || d.head_dim == 128) && d.seq_len >= 1 && d.tokens % d.seq_len == 0 &&
         d.kv_heads >= 1 && d.heads % d.kv_heads == 0 && d.cp <= 1;  // CP: the reference kernels
}

bool use_flash_attention(DType dt, const AttentionDims& d) {
  if (!flash_attention_supported(dt, d)) return false;
  // A GPU whose opt-in shared memory per block is smaller than the plan (not Hopper's 227 KiB; e.g.
  // consumer Ampere's 99 KiB for head_dim 128) takes the reference kernels instead of failing to launch.
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const std::size_t need = d.head_dim == 64 ? std::max(Plan<64>::kFwdBytes, Plan<64>::kBwdBytes)
                                            : std::max(Plan<128>::kFwdBytes, Plan<128>::kBwdBytes);
  return static_cast<std::size_t>(optin) >= need;
}

void flash_attention_forward(const AttentionDims& d, const void* q, const void* k, const void* v, float* lse, void* o,
                             cudaStream_t stream) {
  check_dims(d);
  if (d.tokens == 0) return;
  for (const auto& [p, name] : {std::pair{q, "q"}, {k, "k"}, {v, "v"}, {static_cast<const void*>(o), "o"}})
    check_aligned(p, name);
  if (d.head_dim == 64)
    forward_d<64>(d, q, k, v, lse, o, stream);
  else
    forward_d<128>(d, q, k, v, lse, o, stream);
}

void flash_attention_backward(const AttentionDims& d, const void* q, const void* k, const void* v, const void* o,
                              const float* lse, const void* d_o, float* delta, void* dq, void* dk, void* dv,
                              cudaStream_t stream) {
  check_dims(d);
  if (d.tokens == 0) return;
  for (const auto& [p, name] : {std::pair{q, "q"},
                                {k, "k"},
                                {v, "v"},
                                {d_o, "d_o"},
                                {static_cast<const void*>(dq), "dq"},
                                {static_cast<const void*>(dk), "dk"},
                                {static_cast<const void*>(dv), "dv"}})
    check_aligned(p, name);
  if (d.head_dim == 64)
    backward_d<64>(d, q, k, v, o, lse, d_o, delta, dq, dk, dv, stream);
  else
    backward_d<128>(d, q, k, v, o, lse, d_o, delta, dq, dk, dv, stream);
}

}  // namespace piper::runtime::cuda
