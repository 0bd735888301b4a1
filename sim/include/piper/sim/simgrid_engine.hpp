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
  // Exact: a collective's schedule (a ring phase, or a pairwise all-to-all) whose flows are alone
  // on their links (and alike within a round: same latency and rate) runs as one timer instead of
  // rounds of n flows, and is split back into its flows, at the instant, if another flow starts on
  // one of its links (simgrid_engine.cpp, Merge). The max-min model gives a lone flow exactly
  // latency + size / rate, so the times are the same as unmerged (up to floating-point rounding,
  // ~1e-14 relative). false: never merge (for tests and comparisons).
  bool merge_lone_collectives = true;
  // Who starts the network flows (the results are the same, op by op; only the speed differs):
  //  * Maestro: a flow is a host-to-host Comm started from SimGrid's callbacks. Least work per flow,
  //    but SimGrid 3.32 keeps every live host-to-host Comm in one list and scans it when one ends,
  //    so a completion costs O(live flows): quadratic in the cluster size.
  //  * Workers: a flow is a two-host parallel Exec (no flops), the same CM02 network action,
  //    created and waited for by a pool of worker actors. The cost of a completion does not grow
  //    with the number of live flows, but each flow costs several actor switches.
  //  * Pool: a flow is the same two-host Exec, started by the bookkeeping itself from a stock of
  //    Execs that 64 pool actors create in batches of 32. SimGrid lists an Exec with the actor that
  //    created it, so a completion scans about one batch, and a flow costs no actor switch (one
  //    wake-up per batch). The fastest measured at 1,024 and 8,192 GPUs (at 128 GPUs every
  //    starter takes a fraction of a second).
  //  * Auto: Pool.
  enum class FlowStarter { Auto, Maestro, Workers, Pool };
  FlowStarter flow_starter = FlowStarter::Auto;
};

// make_simgrid_engine() (engine.hpp) uses the default options.
std::unique_ptr<Engine> make_simgrid_engine(const SimgridOptions& options);

}  // namespace piper::sim
