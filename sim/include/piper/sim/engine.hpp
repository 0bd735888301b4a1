// Simulation engines: the execution semantics of a Program, shared by every engine and by the
// runtime, and the Engine interface ("analytic" | "simgrid") that turns a Program into a Timeline.
//
// Execution semantics (the contract; core/src/verifier.cpp checks deadlock-freedom under it):
//  * Device d runs plans[plan_of_device[d]]. Its streams run concurrently. A stream runs one op at a
//    time, in issue order: op i starts no earlier than op i-1 of the same stream ends (CUDA stream).
//  * An op also waits for every op in its `waits` (other streams of the same device) to end.
//  * Compute (COMPUTE, UPD) ops start as soon as they are ready.
//  Who meets whom, and the two rules above, are core/readiness.hpp's (keyed by Op::pair):
//  * A SEND on d (peer e = peer_of(op, d)) and the RECV on e with the same pairing id form ONE
//    transfer: it starts when both ops are ready and ends for both at the same time (rendezvous,
//    as NCCL send/recv). Alone on its links it lasts CostModel::transfer_seconds.
//  * A collective (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL) on d runs in group
//    group_of(op.family, d); the ops with one pairing id on its members are one instance (the
//    verifier checks every member issues a family's ids in one order). It starts when every member's
//    op is ready and ends for all members together. Alone on its links it lasts
//    CostModel::collective_op_seconds.
//  * Contention (docs/contention.md): concurrent communication shares links (each device's NVLink
//    out/in and NIC out/in; SimGrid: max-min over its flows, analytic: the bandwidth part of each op
//    runs at its bottleneck fair share 1/n) and, under an sm_partition, the partition's SMs
//    (ComputeRates::comm_capacity). Calibrated or overridden communication keeps its fixed time.
//  * Compute speed and communication: a compute op has work w = CostModel::compute_seconds. With k
//    communication ops (transfers or collectives) running on the same device, its remaining work
//    progresses at rate compute_rates(d).compute(k): 1 - min(k comm_sm_share, comm_sm_share_max)
//    with shared SMs, (N - s) / N under an sm_partition (cost_model.hpp). Only running comm ops
//    count: one waiting at a rendezvous takes no SMs.
//  * Devices sharing one GPU (NodeSpec::devices_per_gpu > 1): the GPU's compute is split evenly among
//    its devices that are computing (processor sharing, as time-sliced contexts or streams of one
//    process run): each running compute's rate above is divided by that count (GpuSharing).
//  * Memory: persistent buffers are allocated at t = 0; a transient buffer is allocated when its
//    alloc op starts and freed when its free op ends. At equal times frees apply before allocations.
//  * Step time: the end of the last op on any device (every device starts at t = 0).
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "piper/core/timeline.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/symmetry.hpp"

namespace piper::sim {

class Engine {
 public:
  virtual ~Engine();
  virtual std::string name() const = 0;
  // Simulates one step. Fills spans of every op of every device (sorted by stream, index), and leaves
  // memory to fill_memory() (engines may call it themselves). Throws DeadlockError if stuck.
  virtual core::Timeline run(std::shared_ptr<const core::Program> program, const Cluster& cluster,
                             const CostModel& cost) = 0;
  // Whether run_reduced() is exact for this engine: true when an activity's speed depends only on
  // what runs on its own devices' links and SMs, so symmetric devices stay symmetric (symmetry.hpp).
  virtual bool supports_symmetry() const { return false; }
  // Simulates the representatives of `symmetry`'s classes only and copies their spans and memory to
  // the other devices of their class: the same Timeline as run(). Default: run().
  virtual core::Timeline run_reduced(std::shared_ptr<const core::Program> program, const Cluster& cluster,
                                     const CostModel& cost, const Symmetry& symmetry);
};

using EngineFactory = std::function<std::unique_ptr<Engine>()>;
// Engines by name. "analytic" is always registered; "simgrid" when SimGrid was found at build time.
void register_engine(const std::string& name, EngineFactory factory);
std::vector<std::string> engine_names();
// Throws core::Error (one line) for an unknown or unavailable engine.
std::unique_ptr<Engine> make_engine(const std::string& name);
constexpr const char* kDefaultEngine = "simgrid";

std::unique_ptr<Engine> make_analytic_engine();
// Defined in sim/src/simgrid_engine.cpp when SimGrid is available, else by a stub that throws
// core::Error("engine 'simgrid' is not available: piper was built without SimGrid").
std::unique_ptr<Engine> make_simgrid_engine();

// Memory over time from the spans: persistent buffers at 0, transient ones from their alloc op's start
// to their free op's end (frees first at equal times). Sets memory, peak_memory_bytes, peak time.
void fill_memory(core::Timeline& timeline);

// fill_memory() for the listed devices only.
void fill_memory(core::Timeline& timeline, const std::vector<int>& devices);
// Copies each representative's DeviceTimeline (spans, memory) to the other devices of its class.
void expand_timeline(core::Timeline& timeline, const Symmetry& symmetry);

// An empty timeline with one span per op (stream, index set; times 0), the layout engines fill.
core::Timeline empty_timeline(std::shared_ptr<const core::Program> program, const std::string& source);
// The same with spans for the representatives of `symmetry` only (other devices left empty).
core::Timeline empty_timeline(std::shared_ptr<const core::Program> program, const std::string& source,
                              const Symmetry& symmetry);
// Index of an op's span in DeviceTimeline::spans (spans are sorted by stream, then index).
std::vector<std::int32_t> stream_span_base(const core::Plan& plan);

// Processor sharing among devices of one GPU (the contract above): how many devices of each GPU are
// computing. An engine calls busy() when a device's first running compute starts and idle() when its
// last ends; both return the devices whose compute speed just changed (those of the same GPU).
class GpuSharing {
 public:
  GpuSharing() = default;
  // Over the first `devices` devices (the program's; the cluster may hold more).
  GpuSharing(const std::vector<int>& gpu_of_devices, int devices);
  bool enabled() const { return enabled_; }
  // What divides device d's compute rate now.
  double divisor(int d) const {
    return enabled_ ? std::max(1, busy_[static_cast<std::size_t>(gpu_of_[static_cast<std::size_t>(d)])]) : 1.0;
  }
  const std::vector<int>& busy(int d) { return change(d, +1); }
  const std::vector<int>& idle(int d) { return change(d, -1); }

 private:
  const std::vector<int>& change(int d, int delta);
  bool enabled_ = false;
  std::vector<int> gpu_of_, busy_;
  std::vector<std::vector<int>> devices_;  // per GPU
};

}  // namespace piper::sim
