// Row-major GEMMs on cuBLASLt with fp32 accumulation: C = alpha op(A) op(B) + beta C, optionally with a
// fused bias (+ GeLU) epilogue. One Gemm object per stream owns its handle and workspace.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include <cuda_runtime_api.h>

#include "piper/runtime/cuda/device.hpp"

struct cublasLtContext;

namespace piper::runtime::cuda {

enum class Epilogue { None, Bias, BiasGelu };

struct GemmShape {
  int m = 0, n = 0, k = 0;  // op(A) is [m, k], op(B) is [k, n], C is [m, n] (row-major)
  bool trans_a = false, trans_b = false;
  int lda = 0, ldb = 0, ldc = 0;  // row strides as stored; 0 = packed
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
  // A and B stored as `dt`, C in fp32 (fp32 accumulation, no rounding of the product to `dt`):
  // weight gradients accumulate into their fp32 buffers directly with beta = 1.
  void run_f32_out(DType dt, const GemmShape& s, const void* a, const void* b, float* c, float alpha = 1.0f,
                   float beta = 0.0f);

 private:
  struct Plan;
  // (input type, output type, m, n, k, trans_a, trans_b, lda, ldb, ldc, epilogue, operand alignments)
  using PlanKey = std::tuple<int, int, int, int, int, bool, bool, std::int64_t, std::int64_t, std::int64_t, int,
                             std::uint32_t, std::uint32_t, std::uint32_t>;
  void run_typed(DType in, DType out, const GemmShape& s, const void* a, const void* b, void* c, float alpha,
                 float beta, Epilogue epilogue, const void* bias);

  cudaStream_t stream_;
  int sm_count_target_;
  cublasLtContext* handle_ = nullptr;
  DeviceBuffer workspace_;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace piper::runtime::cuda
