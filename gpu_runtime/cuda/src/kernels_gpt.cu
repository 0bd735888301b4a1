// The CUDA kernels of GPT-style layers (LayerNorm, biases, GELU, learned positions), each mirroring its
// host kernel in gpu_runtime/src/kernels.cpp, which the GPU tests compare it against. fp32
// accumulation; weight gradients by the deterministic column sums of kernels_common.cuh.
#include <cstdint>
#include <type_traits>

#include "kernels_common.cuh"
#include "piper/runtime/cuda/kernels.hpp"

namespace piper::runtime::cuda {
namespace {

using namespace kernel_detail;

// ---- LayerNorm: one block per row; y = (x - mean) rstd g + b, mean and rstd kept (fp32) ----
template <typename T>
__global__ void layernorm_forward_k(const T* x, const T* g, const T* b, int cols, float eps, T* y, float* mean,
                                    float* rstd) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * cols;
  float s = 0;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) s += load(x, row + c);
  const float mu = block_reduce<false>(s) / static_cast<float>(cols);
  float ss = 0;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = load(x, row + c) - mu;
    ss += d * d;
  }
  const float r = rsqrtf(block_reduce<false>(ss) / static_cast<float>(cols) + eps);
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    store(y, row + c, (load(x, row + c) - mu) * r * load(g, c) + load(b, c));
  if (threadIdx.x == 0) mean[blockIdx.x] = mu, rstd[blockIdx.x] = r;
}
// With z = g dy and xhat = (x - mean) rstd: dx = rstd (z - mean(z) - xhat mean(z xhat)).
template <typename T>
__global__ void layernorm_backward_input_k(const T* x, const float* mean, const float* rstd, const T* g, const T* dy,
                                           int cols, T* dx) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * cols;
  const float mu = mean[blockIdx.x], r = rstd[blockIdx.x];
  float sz = 0, szx = 0;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float z = load(g, c) * load(dy, row + c);
    sz += z;
    szx += z * (load(x, row + c) - mu) * r;
  }
  const float mz = block_reduce<false>(sz) / static_cast<float>(cols);
  const float mzx = block_reduce<false>(szx) / static_cast<float>(cols);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (load(x, row + c) - mu) * r;
    store(dx, row + c, r * (load(g, c) * load(dy, row + c) - mz - xhat * mzx));
  }
}
// dg += sum over rows of dy xhat; db += sum over rows of dy.
template <typename T>
__global__ void layernorm_backward_weight_k(const T* x, const float* mean, const float* rstd, const T* dy, int rows,
                                            int cols, float* dg, float* db) {
  column_sum_into(rows, cols, dg,
                  [&](std::int64_t i, int r) { return load(dy, i) * (load(x, i) - mean[r]) * rstd[r]; });
  __syncthreads();  // the shared partials are reused
  column_sum_into(rows, cols, db, [&](std::int64_t i, int) { return load(dy, i); });
}

// ---- Biases, GELU (tanh form, as the host), learned positions ----
template <typename T>
__global__ void bias_add_k(T* x, const T* b, std::int64_t n, int cols) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) store(x, i, load(x, i) + load(b, i % cols));
}
template <typename T>
__global__ void bias_backward_weight_k(const T* dy, int rows, int cols, float* db) {
  column_sum_into(rows, cols, db, [&](std::int64_t i, int) { return load(dy, i); });
}
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;
template <typename T>
__global__ void gelu_forward_k(const T* a, std::int64_t n, T* h) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = load(a, i);
  store(h, i, 0.5f * x * (1.0f + tanhf(kGeluC * (x + kGeluA * x * x * x))));
}
template <typename T>
__global__ void gelu_backward_k(const T* a, const T* dy, std::int64_t n, T* da) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = load(a, i), t = tanhf(kGeluC * (x + kGeluA * x * x * x));
  const float d = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * kGeluA * x * x);
  store(da, i, d * load(dy, i));
}
template <typename T>
__global__ void positions_forward_k(T* x, const T* pos, int rows, int cols, int seq_len, int first_row) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(rows) * cols) return;
  const std::int64_t t = i / cols + first_row, c = i % cols;
  store(x, i, load(x, i) + load(pos, (t % seq_len) * cols + c));
}
// One thread per (position, column): the rows at that position, in sequence order (deterministic).
template <typename T>
__global__ void positions_backward_weight_k(const T* dx, int rows, int cols, int seq_len, float* dpos) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<std::int64_t>(seq_len) * cols) return;
  const std::int64_t p = i / cols, c = i % cols;
  float s = 0;
  for (std::int64_t t = p; t < rows; t += seq_len) s += load(dx, t * cols + c);
  dpos[i] += s;
}

}  // namespace

void layernorm_forward(DType dt, const void* x, const void* g, const void* b, int rows, int cols, float eps, void* y,
                       float* mean, float* rstd, cudaStream_t stream) {
  if (rows == 0) return;
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    layernorm_forward_k<T><<<rows, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(g),
                                                          static_cast<const T*>(b), cols, eps, static_cast<T*>(y), mean,
                                                          rstd);
  });
  launched("layernorm_forward");
}

void layernorm_backward_input(DType dt, const void* x, const float* mean, const float* rstd, const void* g,
                              const void* dy, int rows, int cols, void* dx, cudaStream_t stream) {
  if (rows == 0) return;
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    layernorm_backward_input_k<T><<<rows, kThreads, 0, stream>>>(static_cast<const T*>(x), mean, rstd,
                                                                 static_cast<const T*>(g), static_cast<const T*>(dy),
                                                                 cols, static_cast<T*>(dx));
  });
  launched("layernorm_backward_input");
}

void layernorm_backward_weight(DType dt, const void* x, const float* mean, const float* rstd, const void* dy, int rows,
                               int cols, float* dg, float* db, cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    layernorm_backward_weight_k<T><<<column_blocks(cols), kThreads, 0, stream>>>(
        static_cast<const T*>(x), mean, rstd, static_cast<const T*>(dy), rows, cols, dg, db);
  });
  launched("layernorm_backward_weight");
}

void bias_add(DType dt, void* x, const void* b, int rows, int cols, cudaStream_t stream) {
  const std::int64_t n = static_cast<std::int64_t>(rows) * cols;
  if (n == 0) return;
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bias_add_k<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<T*>(x), static_cast<const T*>(b), n, cols);
  });
  launched("bias_add");
}

void bias_backward_weight(DType dt, const void* dy, int rows, int cols, float* db, cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bias_backward_weight_k<T><<<column_blocks(cols), kThreads, 0, stream>>>(static_cast<const T*>(dy), rows, cols, db);
  });
  launched("bias_backward_weight");
}

void gelu_forward(DType dt, const void* a, std::int64_t n, void* h, cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gelu_forward_k<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(a), n, static_cast<T*>(h));
  });
  launched("gelu_forward");
}

void gelu_backward(DType dt, const void* a, const void* dy, std::int64_t n, void* da, cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    gelu_backward_k<T><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const T*>(a), static_cast<const T*>(dy), n,
                                                               static_cast<T*>(da));
  });
  launched("gelu_backward");
}

void positions_forward(DType dt, void* x, const void* pos, int rows, int cols, int seq_len, cudaStream_t stream,
                       int first_row) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    positions_forward_k<T><<<blocks_for(static_cast<std::int64_t>(rows) * cols), kThreads, 0, stream>>>(
        static_cast<T*>(x), static_cast<const T*>(pos), rows, cols, seq_len, first_row);
  });
  launched("positions_forward");
}

void positions_backward_weight(DType dt, const void* dx, int rows, int cols, int seq_len, float* dpos,
                               cudaStream_t stream) {
  dispatch(dt, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    positions_backward_weight_k<T><<<blocks_for(static_cast<std::int64_t>(seq_len) * cols), kThreads, 0, stream>>>(
        static_cast<const T*>(dx), rows, cols, seq_len, dpos);
  });
  launched("positions_backward_weight");
}

}  // namespace piper::runtime::cuda
