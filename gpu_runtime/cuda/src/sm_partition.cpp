// SM partitioning: the realisation policy, and green contexts through driver entry points looked up at
// run time (cudaGetDriverEntryPointByVersion), so that piper never links libcuda and still starts on
// machines without a GPU driver.
#include "piper/runtime/cuda/sm_partition.hpp"

#include <algorithm>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <fmt/format.h>

#include "piper/runtime/cuda/device.hpp"

namespace piper::runtime::cuda {

SmGranularity green_context_granularity(int cc_major) {
  if (cc_major >= 9) return {8, 8};
  if (cc_major == 8) return {4, 2};
  return {2, 2};
}

SmPlan plan_sm_partition(const core::SmPartition& partition, int device_sms, bool green_contexts, SmGranularity g) {
  const int sms = partition.sms;
  if (sms < 1 || sms >= device_sms)
    throw CudaError(fmt::format(
        "sm_partition: field 'sms': {} SMs for communication must leave compute at least one of this GPU's {} SMs", sms,
        device_sms));
  if (!green_contexts) return {SmMechanism::CtaLimits, sms, device_sms - sms};
  if (sms < g.min_sms || sms % g.multiple != 0) {
    // The valid counts around the request, so that the message says what to write instead.
    const int below = std::max(g.min_sms, sms / g.multiple * g.multiple);
    const int above = std::max(g.min_sms, (sms + g.multiple - 1) / g.multiple * g.multiple);
    const std::string choice =
        below == above || below >= device_sms ? fmt::format("{}", above) : fmt::format("{} or {}", below, above);
    throw CudaError(
        fmt::format("sm_partition: field 'sms': {} SMs is not a green-context partition of this GPU (at least {}, a "
                    "multiple of {}): use {}",
                    sms, g.min_sms, g.multiple, choice));
  }
  return {SmMechanism::GreenContexts, sms, device_sms - sms};
}

// ---- green contexts ----

struct SmPartitioner::Green {
  PFN_cuGreenCtxDestroy_v12040 destroy = nullptr;
  PFN_cuGreenCtxStreamCreate_v12050 stream_create = nullptr;
  CUgreenCtx comm = nullptr, compute = nullptr;
  ~Green() {
    if (comm) destroy(comm);
    if (compute) destroy(compute);
  }
};

namespace {

// A driver entry point of at least CUDA 12.5's ABI, or nullptr when the driver lacks it.
template <class Fn>
Fn entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12050, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

void check_cu(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) throw CudaError(fmt::format("{}: CUDA driver error {}", what, static_cast<int>(r)));
}

}  // namespace

std::shared_ptr<const SmPartitioner> SmPartitioner::create(const std::optional<core::SmPartition>& partition) {
  std::shared_ptr<SmPartitioner> out(new SmPartitioner());
  if (!partition) return out;
  int device = 0, sms = 0, cc_major = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  check(cudaFree(nullptr), "cudaFree (primary context)");  // green contexts retain the primary context: make it first

  const auto device_get = entry<PFN_cuDeviceGet_v2000>("cuDeviceGet");
  const auto get_resource = entry<PFN_cuDeviceGetDevResource_v12040>("cuDeviceGetDevResource");
  const auto split = entry<PFN_cuDevSmResourceSplitByCount_v12040>("cuDevSmResourceSplitByCount");
  const auto generate = entry<PFN_cuDevResourceGenerateDesc_v12040>("cuDevResourceGenerateDesc");
  const auto create_ctx = entry<PFN_cuGreenCtxCreate_v12040>("cuGreenCtxCreate");
  const auto destroy = entry<PFN_cuGreenCtxDestroy_v12040>("cuGreenCtxDestroy");
  const auto stream_create = entry<PFN_cuGreenCtxStreamCreate_v12050>("cuGreenCtxStreamCreate");
  const bool green = device_get && get_resource && split && generate && create_ctx && destroy && stream_create;

  CUdevice dev = 0;
  CUdevResource all{};
  SmGranularity g = green_context_granularity(cc_major);
  if (green) {
    check_cu(device_get(&dev, device), "cuDeviceGet");
    check_cu(get_resource(dev, &all, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource");
    g.min_sms = std::max(g.min_sms, static_cast<int>(all.sm.minSmPartitionSize));
  }
  out->plan_ = plan_sm_partition(*partition, sms, green, g);
  if (!green) return out;

  out->green_ = std::make_unique<Green>();
  out->green_->destroy = destroy;
  out->green_->stream_create = stream_create;
  CUdevResource comm{}, rest{};
  unsigned int groups = 1;
  check_cu(split(&comm, &groups, &all, &rest, 0, static_cast<unsigned int>(partition->sms)),
           "cuDevSmResourceSplitByCount");
  if (groups != 1 || static_cast<int>(comm.sm.smCount) != partition->sms)
    throw CudaError(fmt::format("sm_partition: field 'sms': the driver made {} group(s) of {} SMs for a request of {}",
                                groups, comm.sm.smCount, partition->sms));
  out->plan_->compute_sms = static_cast<int>(rest.sm.smCount);
  CUdevResourceDesc comm_desc = nullptr, rest_desc = nullptr;
  check_cu(generate(&comm_desc, &comm, 1), "cuDevResourceGenerateDesc");
  check_cu(generate(&rest_desc, &rest, 1), "cuDevResourceGenerateDesc");
  check_cu(create_ctx(&out->green_->comm, comm_desc, dev, CU_GREEN_CTX_DEFAULT_STREAM),
           "cuGreenCtxCreate (communication)");
  check_cu(create_ctx(&out->green_->compute, rest_desc, dev, CU_GREEN_CTX_DEFAULT_STREAM),
           "cuGreenCtxCreate (compute)");
  return out;
}

SmPartitioner::~SmPartitioner() = default;

cudaStream_t SmPartitioner::create_stream(bool communication) const {
  cudaStream_t s = nullptr;
  if (green_) {
    CUstream cs = nullptr;
    check_cu(green_->stream_create(&cs, communication ? green_->comm : green_->compute, CU_STREAM_NON_BLOCKING, 0),
             "cuGreenCtxStreamCreate");
    return static_cast<cudaStream_t>(cs);
  }
  // Non-blocking: no implicit synchronisation with the legacy default stream (NCCL kernels of one
  // stream must never wait for another stream's work behind the host's back).
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  return s;
}

int SmPartitioner::gemm_sm_target() const {
  return plan_ && plan_->mechanism == SmMechanism::CtaLimits ? plan_->compute_sms : 0;
}

int SmPartitioner::nccl_max_ctas() const { return plan_ ? plan_->comm_sms : 0; }

std::string SmPartitioner::describe() const {
  if (!plan_) return "SMs shared by communication and compute";
  if (plan_->mechanism == SmMechanism::GreenContexts)
    return fmt::format("green contexts: communication on {} SMs, compute on {}", plan_->comm_sms, plan_->compute_sms);
  return fmt::format("no green contexts in this driver: NCCL on at most {} CTAs, GEMMs targeting {} SMs",
                     plan_->comm_sms, plan_->compute_sms);
}

}  // namespace piper::runtime::cuda
