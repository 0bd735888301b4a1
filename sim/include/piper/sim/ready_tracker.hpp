// ReadyTracker: the readiness rules of a Program (core/readiness.hpp), run for every engine. It tells
// which activities (a compute op, a SEND+RECV transfer, a collective instance) may start, and
// advances the per-stream cursors when they finish. Flat per-device arrays; no maps in the hot path.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "piper/core/error.hpp"
#include "piper/core/program.hpp"
#include "piper/sim/symmetry.hpp"

namespace piper::sim {

// The program cannot make progress: some op waits forever. what() is one line naming the devices
// and ops that are stuck (first few), ready for the CLI.
class DeadlockError : public core::Error {
 public:
  using core::Error::Error;
};

// The (device, op) members of an activity. Most activities are a compute op or a transfer, so up to
// two members live inline: millions of activities then cost no heap allocation (a vector-like subset).
class ActivityMembers {
 public:
  using value_type = std::pair<int /*device*/, core::OpRef>;
  static constexpr std::size_t kInline = 2;
  ActivityMembers() = default;
  ActivityMembers(std::initializer_list<value_type> list) {
    reserve(list.size());
    for (const auto& v : list) push_back(v);
  }
  ActivityMembers(const ActivityMembers&) = default;
  ActivityMembers& operator=(const ActivityMembers&) = default;
  // A moved-from list is empty (the default would leave size_ counting elements it no longer has).
  ActivityMembers(ActivityMembers&& o) noexcept
      : inline_(o.inline_), heap_(std::move(o.heap_)), size_(o.size_), spilled_(o.spilled_) {
    o.size_ = 0;
    o.heap_.clear();
    o.spilled_ = false;
  }
  ActivityMembers& operator=(ActivityMembers&& o) noexcept {
    if (this != &o) {
      inline_ = o.inline_;
      heap_ = std::move(o.heap_);
      size_ = o.size_;
      spilled_ = o.spilled_;
      o.size_ = 0;
      o.heap_.clear();
      o.spilled_ = false;
    }
    return *this;
  }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  value_type* begin() { return spilled_ ? heap_.data() : inline_.data(); }
  value_type* end() { return begin() + size_; }
  const value_type* begin() const { return spilled_ ? heap_.data() : inline_.data(); }
  const value_type* end() const { return begin() + size_; }
  value_type& operator[](std::size_t i) { return begin()[i]; }
  const value_type& operator[](std::size_t i) const { return begin()[i]; }
  value_type& front() { return *begin(); }
  const value_type& front() const { return *begin(); }
  value_type& back() { return begin()[size_ - 1]; }
  const value_type& back() const { return begin()[size_ - 1]; }
  void reserve(std::size_t n) {
    if (n <= kInline) return;
    spill();
    heap_.reserve(n);
  }
  void push_back(const value_type& v) {
    if (!spilled_ && size_ == kInline) spill();
    if (spilled_)
      heap_.push_back(v);
    else
      inline_[size_] = v;
    size_ += 1;
  }
  template <class... Args>
  void emplace_back(Args&&... args) {
    push_back(value_type(std::forward<Args>(args)...));
  }
  void clear() {
    size_ = 0;
    heap_.clear();
    spilled_ = false;
  }

 private:
  void spill() {
    if (spilled_) return;
    heap_.assign(inline_.begin(), inline_.begin() + static_cast<std::ptrdiff_t>(size_));
    spilled_ = true;
  }
  std::array<value_type, kInline> inline_{};
  std::vector<value_type> heap_;
  std::size_t size_ = 0;
  bool spilled_ = false;
};

class ReadyTracker {
 public:
  struct Activity {
    enum class Kind { Compute, Transfer, Collective } kind = Kind::Compute;
    // Compute: one member. Transfer: {sender, SEND op}, {receiver, RECV op}. Collective: one member
    // per rank of the group, in group order.
    ActivityMembers members;
  };

  explicit ReadyTracker(const core::Program& program);
  // Reduced mode: only the representatives of `symmetry`'s classes run; a peer or group member is
  // replaced by its class's representative (`symmetry` must outlive the tracker and reduce()).
  ReadyTracker(const core::Program& program, const Symmetry* symmetry);

  // The devices whose costs an activity has in the full program: a transfer's real receiver, a
  // collective's real group (those of the first member). In full mode, the members themselves.
  int transfer_receiver(const Activity& a) const;
  const std::vector<int>& collective_ranks(const Activity& a);

  // Activities that became startable since the last call (each is returned exactly once).
  std::vector<Activity> take_ready();
  // Same, appending into `out` (lets a hot loop reuse its buffer).
  void take_ready(std::vector<Activity>& out);
  // The engine reports that an activity started / finished at `now` (seconds). started() is
  // informational (bookkeeping only); finished() releases dependents.
  void started(const Activity& a, double now);
  void finished(const Activity& a, double now);

  bool done() const;
  std::int64_t total_ops() const;  // op instances over all devices
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
  // size; for many calls over one Program, keep a PartnerFinder.
  static std::vector<std::pair<int, core::OpRef>> partners(const core::Program& program, int device, core::OpRef r);

  ~ReadyTracker();
  ReadyTracker(const ReadyTracker&) = delete;
  ReadyTracker& operator=(const ReadyTracker&) = delete;

 private:
  struct State;  // flat per-plan and per-device tables (ready_tracker.cpp)
  std::unique_ptr<State> s_;
};

// ReadyTracker::partners over one Program, through one core::PairIndex (core/readiness.hpp: the op of
// each pairing id on each plan) built once: the critical path of a 1,024-GPU program asks for the
// partners of thousands of ops. Same answers as partners(), in the same order: a transfer lists the
// op itself first, then its other side; a collective lists its group in group order.
class PartnerFinder {
 public:
  explicit PartnerFinder(const core::Program& program);
  ~PartnerFinder();
  std::vector<std::pair<int, core::OpRef>> operator()(int device, core::OpRef r);

 private:
  struct Index;
  const core::Program& program_;
  std::unique_ptr<Index> index_;
};

}  // namespace piper::sim
