// Decomposition of NCCL-like collectives into rounds of point-to-point flows, so that the SimGrid
// engine can put every byte on real links (and shared links slow them down). Uncontended, each
// decomposition takes exactly the closed form of CostModel::collective_seconds (cost_model.hpp).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "piper/core/program.hpp"

namespace piper::sim::simgrid_detail {

// Participants exchange in rounds: in round j participant i sends `chunk_bytes` to target(j, i)
// (each round is a permutation). Participant i starts round j+1 once its own round-j send and its
// round-j receive are done (NCCL's per-rank data dependency); rounds are not global barriers.
struct RoundSchedule {
  enum class Pattern {
    Ring,          // target = i + 1 (mod n): ring reduce-scatter / all-gather / all-reduce
    Pairwise,      // target = i + j + 1 (mod n): pairwise-exchange all-to-all
    NodePairwise,  // all-to-all over k nodes x m ranks (devices sorted by node): m-1 intra-node
                   // rounds first, then (k-1)m inter-node rounds (matches the hierarchical formula)
  };
  Pattern pattern = Pattern::Ring;
  std::vector<int> devices;  // participants, in ring / rank order
  int rounds = 0;
  double chunk_bytes = 0;  // per participant per round
  int ranks_per_node = 1;  // NodePairwise: m

  int size() const { return static_cast<int>(devices.size()); }
  int target(int round, int i) const;  // participant index
};

// Schedules of a phase run concurrently; phases run one after the other (the instance moves to
// phase p+1 when every flow of phase p has finished).
struct Phase {
  std::vector<RoundSchedule> schedules;
};

// Flat forms for a group inside one node or with one rank per node; hierarchical (intra-node ring,
// inter-node rings of same-local-index ranks, intra-node ring) when the group spans k > 1 nodes with
// m > 1 ranks on a node:
//   all-reduce      RS_intra(m, S) ; AR_inter(k, S/m) ; AG_intra(m, S)
//   reduce-scatter  RS_intra(m, S) ; RS_inter(k, S/m)
//   all-gather      AG_inter(k, S/m) ; AG_intra(m, S)
//   all-to-all      one NodePairwise schedule (intra-node rounds, then inter-node rounds)
// S = bytes as in CostModel (all-reduce input, reduce-scatter input, all-gather output, all-to-all
// total sent per rank). `node_of` maps device -> node. Groups of one rank give no phases.
std::vector<Phase> decompose_collective(core::OpKind kind, const std::vector<int>& ranks, double bytes,
                                        const std::vector<int>& node_of);

// An all-to-all under node-limited routing (CostModel::routed_all_to_all: `nodes` runs of `per_node`
// consecutive ranks): same-node pairwise exchange, then one pairwise exchange per rail (the ranks of
// one local index across the nodes), then the same-node forwarding exchange.
std::vector<Phase> decompose_routed_all_to_all(const std::vector<int>& ranks, int nodes, int per_node,
                                               double direct_chunk, double ib_chunk, double forward_chunk);

// Every (src device, dst device) pair a decomposition uses (for building routes ahead of time).
void for_each_pair(const std::vector<Phase>& phases, const std::function<void(int, int)>& fn);

}  // namespace piper::sim::simgrid_detail
