// Options of the SimGrid engine (flow-level network simulation of a Program; see engine.hpp for the
// execution semantics it implements and docs/simulator.md, "The SimGrid engine", for the platform
// it builds).
#pragma once

#include <memory>

#include "piper/sim/engine.hpp"

namespace piper::sim {

struct SimgridOptions {
  // A ring of n ranks runs R = (n-1) or 2(n-1) rounds of one flow per rank. With max_ring_steps = q > 0
  // and R > q, consecutive rounds are merged into q steps: a step of c rounds is one flow of c chunks
  // preceded by a (c-1) * route-latency delay on no link, so the uncontended time is unchanged while
  // SimGrid handles R/q times fewer flows (contention is then averaged over c rounds). 0: never merge.
  int max_ring_steps = 0;
};

// make_simgrid_engine() (engine.hpp) uses the default options.
std::unique_ptr<Engine> make_simgrid_engine(const SimgridOptions& options);

}  // namespace piper::sim
