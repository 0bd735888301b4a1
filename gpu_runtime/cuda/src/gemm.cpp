// Row-major GEMMs on cuBLASLt. cuBLASLt is column-major, so C = op(A) op(B) (row-major) is computed
// as C^T = op(B)^T op(A)^T: B's storage is passed as the first operand and A's as the second.
// Descriptors and the heuristic's algorithm are cached per shape (a training step issues the same few
// dozen shapes thousands of times; asking the heuristic each time costs tens of microseconds of host
// time per GEMM, which a 1B model's step cannot afford).
#include "piper/runtime/cuda/gemm.hpp"

#include <cstdint>
#include <map>
#include <tuple>

#include <cublasLt.h>
#include <fmt/format.h>

namespace piper::runtime::cuda {
namespace {

constexpr std::size_t kWorkspaceBytes = 32u << 20;  // cuBLASLt's recommendation for Hopper

void check_lt(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw CudaError(
        fmt::format("{}: cuBLASLt status {} ({})", what, static_cast<int>(status), cublasLtGetStatusString(status)));
}

// The largest power of two (at most 256, cuBLASLt's default assumption) dividing the address. The
// heuristic is told each operand's real alignment: with the default it may pick a kernel that needs
// 256-byte aligned operands, and weights inside a parameter vector (after a norm's few hundred bytes)
// or activations at an offset in a message are not.
std::uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

}  // namespace

// One cached GEMM configuration: its descriptors and the chosen algorithm.
struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    if (first) cublasLtMatrixLayoutDestroy(first);
    if (second) cublasLtMatrixLayoutDestroy(second);
    if (out) cublasLtMatrixLayoutDestroy(out);
  }
};

Gemm::Gemm(cudaStream_t stream, int sm_count_target)
    : stream_(stream), sm_count_target_(sm_count_target), workspace_(kWorkspaceBytes) {
  cublasLtHandle_t h = nullptr;
  check_lt(cublasLtCreate(&h), "cublasLtCreate");
  handle_ = h;
}

Gemm::~Gemm() {
  plans_.clear();  // descriptors before the handle
  if (handle_) cublasLtDestroy(handle_);
}

void Gemm::run(DType dt, const GemmShape& s, const void* a, const void* b, void* c, float alpha, float beta,
               Epilogue epilogue, const void* bias) {
  run_typed(dt, dt, s, a, b, c, alpha, beta, epilogue, bias);
}

void Gemm::run_f32_out(DType dt, const GemmShape& s, const void* a, const void* b, float* c, float alpha, float beta) {
  run_typed(dt, DType::F32, s, a, b, c, alpha, beta, Epilogue::None, nullptr);
}

void Gemm::run_typed(DType in, DType out_type, const GemmShape& s, const void* a, const void* b, void* c, float alpha,
                     float beta, Epilogue epilogue, const void* bias) {
  auto cuda_type = [](DType t) { return t == DType::F32 ? CUDA_R_32F : t == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F; };
  const cudaDataType_t type = cuda_type(in);
  const cudaDataType_t out_dt = cuda_type(out_type);
  // Stored row-major shapes: A is [m,k] (or [k,m] when transposed), B is [k,n] (or [n,k]).
  const std::int64_t a_cols = s.trans_a ? s.m : s.k, a_rows = s.trans_a ? s.k : s.m;
  const std::int64_t b_cols = s.trans_b ? s.k : s.n, b_rows = s.trans_b ? s.n : s.k;
  const std::int64_t lda = s.lda ? s.lda : a_cols, ldb = s.ldb ? s.ldb : b_cols, ldc = s.ldc ? s.ldc : s.n;
  // cuBLASLt's A is our B, its B our A, C = D ours.
  const std::uint32_t align_first = alignment_of(b), align_second = alignment_of(a), align_out = alignment_of(c);
  const PlanKey key{static_cast<int>(in),
                    static_cast<int>(out_type),
                    s.m,
                    s.n,
                    s.k,
                    s.trans_a,
                    s.trans_b,
                    lda,
                    ldb,
                    ldc,
                    static_cast<int>(epilogue),
                    align_first,
                    align_second,
                    align_out};

  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    // CUBLAS_COMPUTE_32F is strict fp32 for fp32 data (no TF32) and fp32 accumulation for bf16.
    check_lt(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    // First operand is B's storage seen column-major ([b_cols, b_rows]); transposing it gives op(B)^T.
    const cublasOperation_t op_first = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_second = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    check_lt(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)),
             "TRANSA");
    check_lt(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)),
             "TRANSB");
    if (epilogue != Epilogue::None) {
      // The bias runs along C^T's rows, i.e. one value per output column of the row-major C.
      const cublasLtEpilogue_t e = epilogue == Epilogue::Bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_GELU_BIAS;
      check_lt(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)), "EPILOGUE");
      check_lt(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &out_dt, sizeof(out_dt)),
               "BIAS_DATA_TYPE");
      // The heuristic needs a bias pointer set; the real one is set before every call below.
      check_lt(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
               "BIAS_POINTER");
    }
    if (sm_count_target_ > 0)
      check_lt(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sm_count_target_,
                                              sizeof(sm_count_target_)),
               "SM_COUNT_TARGET");
    check_lt(cublasLtMatrixLayoutCreate(&plan->first, type, static_cast<std::uint64_t>(b_cols),
                                        static_cast<std::uint64_t>(b_rows), ldb),
             "layout B");
    check_lt(cublasLtMatrixLayoutCreate(&plan->second, type, static_cast<std::uint64_t>(a_cols),
                                        static_cast<std::uint64_t>(a_rows), lda),
             "layout A");
    check_lt(cublasLtMatrixLayoutCreate(&plan->out, out_dt, static_cast<std::uint64_t>(s.n),
                                        static_cast<std::uint64_t>(s.m), ldc),
             "layout C");

    cublasLtMatmulPreference_t pref = nullptr;
    check_lt(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    const std::uint64_t ws = workspace_.bytes();
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_first,
                                                sizeof(align_first));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_second,
                                                sizeof(align_second));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_out,
                                                sizeof(align_out));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_out,
                                                sizeof(align_out));
    cublasLtMatmulHeuristicResult_t heuristic{};
    int found = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->first, plan->second, plan->out, plan->out, pref, 1,
                                          &heuristic, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    check_lt(st, "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0)
      throw CudaError(fmt::format("cuBLASLt has no algorithm for a {}x{}x{} GEMM (operand alignments {}, {}, {} bytes)",
                                  s.m, s.n, s.k, align_second, align_first, align_out));
    plan->algo = heuristic.algo;
    it = plans_.emplace(key, std::move(plan)).first;
  }
  Plan& plan = *it->second;
  if (epilogue != Epilogue::None)
    check_lt(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
             "BIAS_POINTER");
  check_lt(cublasLtMatmul(handle_, plan.desc, &alpha, b, plan.first, a, plan.second, &beta, c, plan.out, c, plan.out,
                          &plan.algo, workspace_.get(), workspace_.bytes(), stream_),
           "cublasLtMatmul");
}

}  // namespace piper::runtime::cuda
