// Row-major GEMMs on cuBLASLt. cuBLASLt is column-major, so C = op(A) op(B) (row-major) is computed
// as C^T = op(B)^T op(A)^T: B's storage is passed as the first operand and A's as the second.
#include "piper/runtime/cuda/gemm.hpp"

#include <cublasLt.h>
#include <fmt/format.h>

namespace piper::runtime::cuda {
namespace {

constexpr std::size_t kWorkspaceBytes = 32u << 20;  // cuBLASLt's recommendation for Hopper

void check_lt(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) throw CudaError(fmt::format("{}: cuBLASLt status {}", what, static_cast<int>(status)));
}

// RAII wrappers for the descriptor handles.
struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  ~MatmulDesc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  ~Layout() { if (l) cublasLtMatrixLayoutDestroy(l); }
};
struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  ~Preference() { if (p) cublasLtMatmulPreferenceDestroy(p); }
};

}  // namespace

Gemm::Gemm(cudaStream_t stream, int sm_count_target)
    : stream_(stream), sm_count_target_(sm_count_target), workspace_(kWorkspaceBytes) {
  cublasLtHandle_t h = nullptr;
  check_lt(cublasLtCreate(&h), "cublasLtCreate");
  handle_ = h;
}

Gemm::~Gemm() {
  if (handle_) cublasLtDestroy(handle_);
}

void Gemm::run(DType dt, const GemmShape& s, const void* a, const void* b, void* c, float alpha, float beta,
               Epilogue epilogue, const void* bias) {
  const cudaDataType_t type = dt == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
  // CUBLAS_COMPUTE_32F is strict fp32 for fp32 data (no TF32) and fp32 accumulation for bf16.
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  // Stored row-major shapes: A is [m,k] (or [k,m] when transposed), B is [k,n] (or [n,k]).
  const std::int64_t a_cols = s.trans_a ? s.m : s.k, a_rows = s.trans_a ? s.k : s.m;
  const std::int64_t b_cols = s.trans_b ? s.k : s.n, b_rows = s.trans_b ? s.n : s.k;
  const std::int64_t lda = s.lda ? s.lda : a_cols, ldb = s.ldb ? s.ldb : b_cols, ldc = s.ldc ? s.ldc : s.n;

  MatmulDesc desc;
  check_lt(cublasLtMatmulDescCreate(&desc.d, compute, CUDA_R_32F), "cublasLtMatmulDescCreate");
  // First operand is B's storage seen column-major ([b_cols, b_rows]); transposing it gives op(B)^T.
  const cublasOperation_t op_first = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)), "TRANSA");
  check_lt(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)), "TRANSB");
  if (epilogue != Epilogue::None) {
    // The bias runs along C^T's rows, i.e. one value per output column of the row-major C.
    const cublasLtEpilogue_t e = epilogue == Epilogue::Bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS;
    check_lt(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)), "EPILOGUE");
    check_lt(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)), "BIAS_POINTER");
    check_lt(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type, sizeof(type)),
             "BIAS_DATA_TYPE");
  }
  if (sm_count_target_ > 0)
    check_lt(cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sm_count_target_,
                                            sizeof(sm_count_target_)),
             "SM_COUNT_TARGET");

  Layout first, second, out;
  check_lt(cublasLtMatrixLayoutCreate(&first.l, type, static_cast<std::uint64_t>(b_cols), static_cast<std::uint64_t>(b_rows), ldb),
           "layout B");
  check_lt(cublasLtMatrixLayoutCreate(&second.l, type, static_cast<std::uint64_t>(a_cols), static_cast<std::uint64_t>(a_rows), lda),
           "layout A");
  check_lt(cublasLtMatrixLayoutCreate(&out.l, type, static_cast<std::uint64_t>(s.n), static_cast<std::uint64_t>(s.m), ldc),
           "layout C");

  Preference pref;
  check_lt(cublasLtMatmulPreferenceCreate(&pref.p), "cublasLtMatmulPreferenceCreate");
  const std::uint64_t ws = workspace_.bytes();
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
           "MAX_WORKSPACE_BYTES");
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  check_lt(cublasLtMatmulAlgoGetHeuristic(handle_, desc.d, first.l, second.l, out.l, out.l, pref.p, 1, &heuristic, &found),
           "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0)
    throw CudaError(fmt::format("cuBLASLt has no algorithm for a {}x{}x{} GEMM", s.m, s.n, s.k));
  check_lt(cublasLtMatmul(handle_, desc.d, &alpha, b, first.l, a, second.l, &beta, c, out.l, c, out.l, &heuristic.algo,
                          workspace_.get(), workspace_.bytes(), stream_),
           "cublasLtMatmul");
}

}  // namespace piper::runtime::cuda
