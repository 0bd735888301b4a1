// Symmetry reduction: classes of devices that provably behave identically in a contention-free
// simulation, so that an engine simulates one representative per class and copies its timeline.
//
// Rule (docs/simulator-scale.md). Devices are grouped by color refinement, starting from
// (plan, node type) and splitting until, for every class, every device of it sees:
//  * for each SEND/RECV (device set, peer set) pair of its plan: a peer in the same class, on the same
//    node or not alike, with the same node type;
//  * for each collective family of its plan: a group touching the same set of classes, whose node
//    layout (per node: node type and ranks there, as a multiset) is the same;
//  and when, on every plan, a RECV (SEND) is still identified by its pairing id and its peer's class.
// Under these conditions the readiness rules of core/readiness.hpp and every cost that depends on devices
// only through node types and co-location (CostModel) give every member of a class the same spans,
// by induction over the events; so the reduced simulation EQUALS the full one (tests check it).
// The analytic engine's contention (engine.hpp) depends only on the activities on each device's own
// links and SMs, which are the same for every member of a class, so it stays exact reduced. SimGrid's
// max-min sharing (and its fat-tree uplinks) couples flows of different classes: that engine is never
// reduced.
#pragma once

#include <string>
#include <vector>

#include "piper/core/program.hpp"
#include "piper/sim/cluster.hpp"

namespace piper::sim {

struct Symmetry {
  std::vector<int> class_of_device;  // device -> class
  std::vector<int> representative;   // class -> its lowest device
  std::string note;                  // one line: how the classes came about, or why none reduce
  int classes() const { return static_cast<int>(representative.size()); }
  int devices() const { return static_cast<int>(class_of_device.size()); }
  // Worth simulating reduced: fewer classes than devices, and no ambiguity was found.
  bool reduces() const { return usable && classes() < devices(); }
  bool usable = true;  // false: an ambiguity forces the full simulation (see note)
  bool is_representative(int device) const {
    return representative[static_cast<std::size_t>(class_of_device[static_cast<std::size_t>(device)])] == device;
  }
  int representative_of(int device) const {
    return representative[static_cast<std::size_t>(class_of_device[static_cast<std::size_t>(device)])];
  }
};

// The coarsest partition satisfying the rule above. O(devices x (peer pairs + families) x rounds).
Symmetry find_symmetry(const core::Program& program, const Cluster& cluster);

}  // namespace piper::sim
