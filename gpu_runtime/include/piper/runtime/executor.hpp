// The backend-neutral executor: runs one device's plan (streams in issue order, cross-stream waits,
// buffer alloc/free) over a Backend and records a measured timeline. It knows nothing about the
// schedule or strategy that produced the plan.
#pragma once

#include <cstdint>
#include <vector>

#include "piper/core/timeline.hpp"
#include "piper/runtime/backend.hpp"

namespace piper::runtime {

class RuntimeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ExecutorOptions {
  double stall_timeout_s = 20;  // no op progressed for this long: the step fails (a peer died or hangs)
};

// What one step measured on this device.
struct StepMeasurement {
  core::DeviceTimeline timeline;  // spans relative to the step start
  double step_seconds = 0;
  double backend_seconds = 0;   // inside Backend::start/poll of ops that progressed (kernels, comm issue/finish)
  double idle_seconds = 0;      // sweeps where nothing progressed (waiting on peers and communication)
  double overhead_seconds = 0;  // the rest: the executor's own bookkeeping
  std::int64_t ops = 0;
};

class Executor {
 public:
  Executor(const core::Plan& plan, Backend& backend, ExecutorOptions options = {});
  // Runs every op of the plan once. Throws RuntimeError if the plan stalls past the timeout.
  StepMeasurement run_step(int step);

 private:
  const core::Plan& plan_;
  Backend& backend_;
  ExecutorOptions options_;
  // Per op (flattened stream-major): transient buffers it allocates at start / frees at end.
  std::vector<std::size_t> stream_base_;
  std::vector<std::vector<int>> allocs_, frees_;
  std::int64_t persistent_bytes_ = 0;
};

}  // namespace piper::runtime
