// Row-major GEMMs on cuBLASLt with fp32 accumulation: C = alpha op(A) op(B) + beta C, optionally with a
// fused bias (+ GeLU) epilogue. One Gemm object per stream owns its handle and workspace.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "piper/runtime/cuda/device.hpp"

struct cublasLtContext;

namespace piper::runtime::cuda {

enum class Epilogue { None, Bias, BiasGelu };

struct GemmShape {
  int m = 0, n = 0, k = 0;          // op(A) is [m, k], op(B) is [k, n], C is [m, n] (row-major)
  bool trans_a = false, trans_b = false;
  int lda = 0, ldb = 0, ldc = 0;    // row strides as stored; 0 = packed
};

class Gemm {
 public:
  // `sm_count_target` > 0 asks cuBLASLt for kernels that use at most that many SMs (SM partitioning
  // between compute and communication); 0 = all SMs.
  explicit Gemm(cudaStream_t stream, int sm_count_target = 0);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // fp32 mode computes in strict fp32 (no TF32) so results match the host reference to rounding.
  void run(DType dt, const GemmShape& s, const void* a, const void* b, void* c, float alpha = 1.0f, float beta = 0.0f,
           Epilogue epilogue = Epilogue::None, const void* bias = nullptr);

 private:
  cudaStream_t stream_;
  int sm_count_target_;
  cublasLtContext* handle_ = nullptr;
  DeviceBuffer workspace_;
};

}  // namespace piper::runtime::cuda
