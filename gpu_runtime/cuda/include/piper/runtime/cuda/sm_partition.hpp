// SM partitioning in the CUDA backend (the sm_partition directive, core::SmPartition): the policy that
// decides how a partition is realised on one GPU (a pure function, tested without a GPU) and the
// object that realises it: green contexts when the driver has them, else NCCL's CTA limit for
// communication and cuBLASLt's SM-count target for compute.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <cuda_runtime_api.h>

#include "piper/core/program_types.hpp"
#include "piper/runtime/cuda/device.hpp"

namespace piper::runtime::cuda {

// Smallest green-context SM partition and the multiple it must be, per compute capability (cuda.h's
// guideline: 6.x/7.x 2 and 2, 8.x 4 and 2, 9.0+ 8 and 8). The driver's minSmPartitionSize raises it.
struct SmGranularity {
  int min_sms = 1;
  int multiple = 1;
};
SmGranularity green_context_granularity(int cc_major);

enum class SmMechanism {
  GreenContexts,  // comm streams in a green context of `comm_sms` SMs, compute streams in one of the rest
  CtaLimits,      // NCCL maxCTAs = comm_sms; cuBLASLt SM-count target = compute_sms (other kernels unbounded)
};

struct SmPlan {
  SmMechanism mechanism = SmMechanism::CtaLimits;
  int comm_sms = 0;
  int compute_sms = 0;
};

// How `partition` is realised on a GPU of `device_sms` SMs. With green contexts the partition is exact
// or refused: comm_sms must be >= g.min_sms and a multiple of g.multiple (Hopper: 8, 16, 24, ...). CTA
// limits take any count. Either way at least one SM must stay for compute. Throws CudaError, one line
// naming the directive's field and the nearest valid counts.
SmPlan plan_sm_partition(const core::SmPartition& partition, int device_sms, bool green_contexts, SmGranularity g);

// The realised partition of the current GPU, shared by every virtual device of the process (they share
// the GPU, so they share its SMs). Without a partition it makes plain streams and sets no limits.
class SmPartitioner {
 public:
  // Uses the current device (cudaSetDevice first). Throws CudaError when the partition cannot be realised.
  static std::shared_ptr<const SmPartitioner> create(const std::optional<core::SmPartition>& partition);
  ~SmPartitioner();
  SmPartitioner(const SmPartitioner&) = delete;
  SmPartitioner& operator=(const SmPartitioner&) = delete;

  // A non-blocking stream for a Program stream: in the communication or the compute partition.
  cudaStream_t create_stream(bool communication) const;
  int gemm_sm_target() const;    // cuBLASLt SM-count target of compute GEMMs (0: no target)
  int nccl_max_ctas() const;     // NCCL maxCTAs of every communicator (0: NCCL's default)
  std::string describe() const;  // one line for the run's log

 private:
  SmPartitioner() = default;
  struct Green;
  std::optional<SmPlan> plan_;
  std::unique_ptr<Green> green_;
};

}  // namespace piper::runtime::cuda
