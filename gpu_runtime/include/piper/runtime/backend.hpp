// The interface between the backend-neutral executor and a backend (kernels + communication):
// the host backend (Eigen over MPI ranks) and the CUDA backend (cuBLASLt, NCCL or loopback) implement it.
#pragma once

#include <functional>
#include <utility>

#include "piper/core/program.hpp"

namespace piper::runtime {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual void begin_step(int step) = 0;
  // Starts the op at `at` of this device's plan. Returns true when it already completed (host
  // compute runs synchronously); false when the backend must be polled (communication in flight).
  virtual bool start(const core::OpRef& at, const core::Op& op) = 0;
  // Progresses an op started earlier; true once it has completed.
  virtual bool poll(const core::OpRef& at, const core::Op& op) = 0;
  // A transient buffer of the plan was freed (after its free op ended).
  virtual void buffer_freed(int buffer) { (void)buffer; }
  virtual void end_step() = 0;
  // Names the op a rank is stuck on for the watchdog's error (e.g. the peer it waits for).
  virtual std::string describe_wait(const core::Op& op) const { return op.label; }

  // The device's point-to-point transfers, kept moving while an op waits inside start(): a compute op
  // blocked on its tensor-parallel (CP, ETP) group calls progress() as it waits, and the executor
  // polls the other streams' sends and receives and starts their ready ones, as a GPU's streams run
  // beside a waiting kernel (collectives wait: they touch the model's gradients and parameters). Without it two TP
  // groups, each waiting inside a compute op, could each hold back a send (queued behind a synchronous one still
  // unmatched) that the other group waits for. Set by the executor for a step; a no-op outside one.
  void set_progress(std::function<void()> f) { progress_ = std::move(f); }
  void progress() const {
    if (progress_) progress_();
  }

 private:
  std::function<void()> progress_;
};

}  // namespace piper::runtime
