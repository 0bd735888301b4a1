// Dependencies of an op across devices (stream order, waits, SEND/RECV partner, collective group) and
// the critical path of a timeline, as the studio highlights them on click.
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "piper/core/readiness.hpp"
#include "piper/core/timeline.hpp"

namespace piper::gui {

struct OpKey {
  int device = -1, stream = -1, index = -1;
  bool valid() const { return device >= 0; }
  friend bool operator==(const OpKey&, const OpKey&) = default;
};

struct Dependencies {
  std::vector<OpKey> incoming;  // must end before the op starts: stream predecessor, waits, the SEND of a RECV
  std::vector<OpKey> outgoing;  // wait for the op: stream successor, waiters, the RECV of a SEND
  std::vector<OpKey> partners;  // run together with the op: the other side of a transfer, collective group members
};

// Lazily built lookup tables over one timeline's program (reverse waits per plan; partners through
// core::PairIndex, the pairing ids of core/readiness.hpp).
class DependencyIndex {
 public:
  explicit DependencyIndex(std::shared_ptr<const core::Timeline> timeline);
  Dependencies of(const OpKey& key) const;
  // The chain of ops that sets the step time, in time order: from the last-ending op back through, at
  // each step, the dependency (of the op or of any of its partners) that ended last.
  std::vector<OpKey> critical_path() const;
  const core::OpSpan& span(const OpKey& key) const;
  const core::Op& op(const OpKey& key) const;

 private:
  struct PlanIndex {
    std::vector<std::vector<std::vector<core::OpRef>>> waiters;  // [stream][index] -> ops waiting on it
    std::vector<std::size_t> span_base;                          // stream -> first span index
  };
  const PlanIndex& plan_index(int device) const;
  std::vector<OpKey> partners_of(const OpKey& key) const;
  std::vector<OpKey> predecessors(const OpKey& key) const;

  std::shared_ptr<const core::Timeline> timeline_;
  mutable std::vector<std::unique_ptr<PlanIndex>> plans_;
  mutable std::unique_ptr<core::PairIndex> pairs_;
};

}  // namespace piper::gui
