// Internal to piper_cuda's .cu files (kernels.cu, kernels_gpt.cu): the storage-type loads and stores,
// block reductions, launch sizing and error check, the deterministic column sums of weight gradients,
// and the storage-type dispatch every kernel launcher uses.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "piper/runtime/cuda/device.hpp"

namespace piper::runtime::cuda::kernel_detail {

constexpr int kThreads = 256;

__device__ __forceinline__ float load(const float* p, std::int64_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, std::int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, std::int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, std::int64_t i, float v) { p[i] = __float2bfloat16(v); }
__device__ __forceinline__ float load(const __half* p, std::int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ void store(__half* p, std::int64_t i, float v) { p[i] = __float2half(v); }

// Block-wide sum or max of one float per thread (blockDim.x == kThreads); every thread gets the result.
template <bool Max>
__device__ float block_reduce(float v) {
  __shared__ float shared[kThreads / 32];
  __shared__ float result;
  for (int offset = 16; offset > 0; offset /= 2) {
    const float o = __shfl_down_sync(0xffffffffu, v, offset);
    v = Max ? fmaxf(v, o) : v + o;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? shared[lane] : (Max ? -INFINITY : 0.0f);
    for (int offset = 16; offset > 0; offset /= 2) {
      const float o = __shfl_down_sync(0xffffffffu, v, offset);
      v = Max ? fmaxf(v, o) : v + o;
    }
    if (lane == 0) result = v;
  }
  __syncthreads();
  const float r = result;
  __syncthreads();  // `result` may be rewritten by the next reduction
  return r;
}

// At least one block: a zero-block grid is a launch error, and every elementwise kernel bounds-checks.
inline unsigned blocks_for(std::int64_t n) {
  return static_cast<unsigned>(std::max<std::int64_t>(1, (n + kThreads - 1) / kThreads));
}

inline void launched(const char* what) { check(cudaGetLastError(), what); }

// Column sums (weight gradients of norms and biases): a block of 32 columns x 8 row lanes (kThreads =
// 256): lane y sums rows y, y + 8, ... of its column (a warp reads 32 adjacent columns of one row:
// coalesced), then the 8 partial sums are added in lane order and added into out[c]. Deterministic,
// and cols / 32 blocks keep a GPU busy where one thread per column (cols / 256 blocks, each thread
// walking every row) left most SMs idle on a 2048-wide model. `term(i, r)` is the row-r value at
// element i = r * cols + c.
constexpr int kNormWeightCols = 32, kNormWeightLanes = kThreads / kNormWeightCols;
inline unsigned column_blocks(int cols) {
  return static_cast<unsigned>(std::max(1, (cols + kNormWeightCols - 1) / kNormWeightCols));
}
template <typename Term>
__device__ void column_sum_into(int rows, int cols, float* out, Term term) {
  __shared__ float partial[kNormWeightLanes][kNormWeightCols];
  const int cx = static_cast<int>(threadIdx.x) % kNormWeightCols,
            lane = static_cast<int>(threadIdx.x) / kNormWeightCols;
  const int c = static_cast<int>(blockIdx.x) * kNormWeightCols + cx;
  float acc = 0;
  if (c < cols)
    for (int r = lane; r < rows; r += kNormWeightLanes) acc += term(static_cast<std::int64_t>(r) * cols + c, r);
  partial[lane][cx] = acc;
  __syncthreads();
  if (lane == 0 && c < cols) {
    float sum = 0;
    for (int y = 0; y < kNormWeightLanes; ++y) sum += partial[y][cx];
    out[c] += sum;
  }
}

// Calls f with a typed null pointer selecting the storage type.
template <typename F>
void dispatch(DType dt, F&& f) {
  if (dt == DType::F32)
    f(static_cast<float*>(nullptr));
  else if (dt == DType::BF16)
    f(static_cast<__nv_bfloat16*>(nullptr));
  else
    f(static_cast<__half*>(nullptr));
}

}  // namespace piper::runtime::cuda::kernel_detail
