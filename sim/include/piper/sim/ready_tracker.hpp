// ReadyTracker: the readiness rules of a Program (see engine.hpp), shared by every engine. It tells
// which activities (a compute op, a SEND+RECV transfer, a collective instance) may start, and
// advances the per-stream cursors when they finish. Flat per-device arrays; no maps in the hot path.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "piper/core/error.hpp"
#include "piper/core/program.hpp"

namespace piper::sim {

// The program cannot make progress: some op waits forever. what() is one line naming the devices
// and ops that are stuck (first few), ready for the CLI.
class DeadlockError : public core::Error {
 public:
  using core::Error::Error;
};

class ReadyTracker {
 public:
  struct Activity {
    enum class Kind { Compute, Transfer, Collective } kind = Kind::Compute;
    // Compute: one member. Transfer: {sender, SEND op}, {receiver, RECV op}. Collective: one member
    // per rank of the group, in group order.
    std::vector<std::pair<int /*device*/, core::OpRef>> members;
  };

  explicit ReadyTracker(const core::Program& program);

  // Activities that became startable since the last call (each is returned exactly once).
  std::vector<Activity> take_ready();
  // Same, appending into `out` (lets a hot loop reuse its buffer).
  void take_ready(std::vector<Activity>& out);
  // The engine reports that an activity started / finished at `now` (seconds). started() is
  // informational (bookkeeping only); finished() releases dependents.
  void started(const Activity& a, double now);
  void finished(const Activity& a, double now);

  bool done() const;
  std::int64_t total_ops() const;      // op instances over all devices
  std::int64_t finished_ops() const;
  // One line describing what is stuck: for the first few devices with unfinished ops, the head op of
  // each stream and what it waits for (previous op, a wait, a transfer peer, collective members).
  std::string stuck_report() const;
  // Throws DeadlockError(stuck_report()) — engines call it when nothing runs and nothing is ready.
  [[noreturn]] void throw_stuck() const;

  // Flat index of (device, op) over all op instances: device_base(device) + the op's flat index in its
  // plan (streams in order). Engines key per-instance arrays (start/end times) by it.
  std::int64_t instance(int device, core::OpRef r) const;
  std::int64_t device_base(int device) const;

  // The members of the activity an op belongs to (itself included), resolved without the tracker's
  // run state: for reports (critical path) over any Timeline of the same Program. Linear in the plan
  // size; meant for a few hundred calls, not for every op.
  static std::vector<std::pair<int, core::OpRef>> partners(const core::Program& program, int device, core::OpRef r);

  ~ReadyTracker();
  ReadyTracker(const ReadyTracker&) = delete;
  ReadyTracker& operator=(const ReadyTracker&) = delete;

 private:
  struct State;  // flat per-plan and per-device tables (ready_tracker.cpp)
  std::unique_ptr<State> s_;
};

}  // namespace piper::sim
