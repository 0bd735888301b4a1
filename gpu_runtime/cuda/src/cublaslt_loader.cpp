// cuBLASLt, opened when the first GEMM needs it instead of linked. Linking libcublasLt.so.13 costs
// every process that holds the CUDA backend, the `piper` CLI included, about 210 MB of resident
// memory and 0.1 s at start-up (the dynamic linker relocates the whole library), whether it ever
// multiplies a matrix or not: measured on this machine, an empty C program linked with -lcublasLt
// peaks at 211,420 KB against 948 KB. The 13 entry points the backend calls are defined here with
// cuBLASLt's own declarations (the header checks the signatures) and forward to the library, which
// dlopen loads on the first call; if it cannot be loaded, the call throws one line saying why.
#include <dlfcn.h>

#include <cublasLt.h>

#include <stdexcept>
#include <string>

namespace {

void* cublaslt_library() {
  static void* const handle = [] {
    void* h = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
#ifdef PIPER_CUBLASLT_PATH
    if (!h) h = dlopen(PIPER_CUBLASLT_PATH, RTLD_NOW | RTLD_LOCAL);  // the toolkit's, found at configure time
#endif
    if (!h) throw std::runtime_error(std::string("cannot load cuBLASLt (libcublasLt.so.13): ") + dlerror());
    return h;
  }();
  return handle;
}

template <class F>
F cublaslt_entry(const char* name) {
  void* f = dlsym(cublaslt_library(), name);
  if (!f) throw std::runtime_error(std::string("cuBLASLt has no entry point ") + name);
  return reinterpret_cast<F>(f);
}

}  // namespace

// Defines NAME(PARAMS) forwarding ARGS to the library's NAME, resolved once.
#define PIPER_CUBLASLT_FORWARD(ret, name, params, args)            \
  ret CUBLASWINAPI name params {                                   \
    static const auto real = cublaslt_entry<ret(*) params>(#name); \
    return real args;                                              \
  }

extern "C" {

PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtCreate, (cublasLtHandle_t * handle), (handle))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtDestroy, (cublasLtHandle_t handle), (handle))
PIPER_CUBLASLT_FORWARD(const char*, cublasLtGetStatusString, (cublasStatus_t status), (status))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtMatmul,
                       (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha, const void* A,
                        cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc, const void* beta,
                        const void* C, cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,
                        const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes, cudaStream_t stream),
                       (handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
                        workspace_bytes, stream))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtMatmulAlgoGetHeuristic,
                       (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t Adesc,
                        cublasLtMatrixLayout_t Bdesc, cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                        cublasLtMatmulPreference_t preference, int requested, cublasLtMatmulHeuristicResult_t results[],
                        int* returned),
                       (handle, desc, Adesc, Bdesc, Cdesc, Ddesc, preference, requested, results, returned))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtMatmulDescCreate,
                       (cublasLtMatmulDesc_t * desc, cublasComputeType_t compute, cudaDataType_t scale),
                       (desc, compute, scale))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t desc), (desc))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtMatmulDescSetAttribute,
                       (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf, size_t size),
                       (desc, attr, buf, size))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref), (pref))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref), (pref))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtMatmulPreferenceSetAttribute,
                       (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                        size_t size),
                       (pref, attr, buf, size))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtMatrixLayoutCreate,
                       (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld),
                       (layout, type, rows, cols, ld))
PIPER_CUBLASLT_FORWARD(cublasStatus_t, cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t layout), (layout))

}  // extern "C"
