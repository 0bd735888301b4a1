// Collectives as rounds of point-to-point flows (see simgrid_collectives.hpp for the algorithms).
#include "simgrid_collectives.hpp"

#include <algorithm>
#include <map>
#include <stdexcept>

namespace piper::sim::simgrid_detail {

int RoundSchedule::target(int round, int i) const {
  const int n = size();
  switch (pattern) {
    case Pattern::Ring:
      return (i + 1) % n;
    case Pattern::Pairwise:
      return (i + round + 1) % n;
    case Pattern::NodePairwise: {
      const int m = ranks_per_node, k = n / m;
      const int a = i / m, l = i % m;
      if (round < m - 1) return a * m + (l + round + 1) % m;
      const int q = round - (m - 1);
      const int t = q / m + 1, u = q % m;
      return ((a + t) % k) * m + (l + u) % m;
    }
  }
  return i;
}

namespace {

// A ring over `devices` with factor * (n-1) rounds of bytes_total / n per rank.
RoundSchedule ring(std::vector<int> devices, int factor, double bytes_total) {
  RoundSchedule s;
  s.pattern = RoundSchedule::Pattern::Ring;
  const int n = static_cast<int>(devices.size());
  s.devices = std::move(devices);
  s.rounds = factor * (n - 1);
  s.chunk_bytes = bytes_total / n;
  return s;
}

// One ring per node over its ranks (intra-node), factor * (m-1) rounds each.
Phase intra_rings(const std::vector<std::vector<int>>& by_node, int factor, double bytes) {
  Phase p;
  for (const auto& ranks : by_node)
    if (ranks.size() > 1) p.schedules.push_back(ring(ranks, factor, bytes));
  return p;
}

// Rings over nodes: ring j links the j-th rank of every node that has one.
Phase inter_rings(const std::vector<std::vector<int>>& by_node, int factor, double bytes) {
  Phase p;
  std::size_t m = 0;
  for (const auto& ranks : by_node) m = std::max(m, ranks.size());
  for (std::size_t j = 0; j < m; ++j) {
    std::vector<int> members;
    for (const auto& ranks : by_node)
      if (j < ranks.size()) members.push_back(ranks[j]);
    if (members.size() > 1) p.schedules.push_back(ring(std::move(members), factor, bytes));
  }
  return p;
}

void push_if_any(std::vector<Phase>& phases, Phase p) {
  if (!p.schedules.empty()) phases.push_back(std::move(p));
}

}  // namespace

std::vector<Phase> decompose_collective(core::OpKind kind, const std::vector<int>& ranks, double bytes,
                                        const std::vector<int>& node_of) {
  std::vector<Phase> phases;
  const int n = static_cast<int>(ranks.size());
  if (n <= 1) return phases;

  // Ranks grouped by node, nodes in order of first appearance, ranks in group order.
  std::vector<std::vector<int>> by_node;
  std::map<int, std::size_t> slot;
  for (int d : ranks) {
    const int node = node_of.at(static_cast<std::size_t>(d));
    auto [it, fresh] = slot.emplace(node, by_node.size());
    if (fresh) by_node.emplace_back();
    by_node[it->second].push_back(d);
  }
  const int k = static_cast<int>(by_node.size());
  int m = 0;
  for (const auto& r : by_node) m = std::max(m, static_cast<int>(r.size()));
  const bool flat = k == 1 || m == 1;

  switch (kind) {
    case core::OpKind::AllReduce:
      if (flat) {
        phases.push_back(Phase{{ring(ranks, 2, bytes)}});
      } else {
        push_if_any(phases, intra_rings(by_node, 1, bytes));
        push_if_any(phases, inter_rings(by_node, 2, bytes / m));
        push_if_any(phases, intra_rings(by_node, 1, bytes));
      }
      break;
    case core::OpKind::ReduceScatter:
      if (flat) {
        phases.push_back(Phase{{ring(ranks, 1, bytes)}});
      } else {
        push_if_any(phases, intra_rings(by_node, 1, bytes));
        push_if_any(phases, inter_rings(by_node, 1, bytes / m));
      }
      break;
    case core::OpKind::AllGather:
      if (flat) {
        phases.push_back(Phase{{ring(ranks, 1, bytes)}});
      } else {
        push_if_any(phases, inter_rings(by_node, 1, bytes / m));
        push_if_any(phases, intra_rings(by_node, 1, bytes));
      }
      break;
    case core::OpKind::AllToAll: {
      RoundSchedule s;
      s.rounds = n - 1;
      s.chunk_bytes = bytes / n;
      bool balanced = true;
      for (const auto& r : by_node) balanced = balanced && static_cast<int>(r.size()) == m;
      if (flat || !balanced) {
        // Unbalanced multi-node groups fall back to the flat exchange over node-sorted ranks.
        s.pattern = RoundSchedule::Pattern::Pairwise;
        for (const auto& r : by_node) s.devices.insert(s.devices.end(), r.begin(), r.end());
        if (flat) s.devices = ranks;
      } else {
        s.pattern = RoundSchedule::Pattern::NodePairwise;
        s.ranks_per_node = m;
        for (const auto& r : by_node) s.devices.insert(s.devices.end(), r.begin(), r.end());
      }
      phases.push_back(Phase{{std::move(s)}});
      break;
    }
    default:
      throw std::invalid_argument("decompose_collective: not a collective: " + core::to_string(kind));
  }
  return phases;
}

std::vector<Phase> decompose_routed_all_to_all(const std::vector<int>& ranks, int nodes, int per_node,
                                               double direct_chunk, double ib_chunk, double forward_chunk) {
  const auto pairwise = [](std::vector<int> devices, double chunk) {
    RoundSchedule s;
    s.pattern = RoundSchedule::Pattern::Pairwise;
    s.rounds = static_cast<int>(devices.size()) - 1;
    s.devices = std::move(devices);
    s.chunk_bytes = chunk;
    return s;
  };
  const auto by_node = [&](double chunk) {
    Phase p;
    for (int a = 0; a < nodes; ++a)
      p.schedules.push_back(pairwise({ranks.begin() + a * per_node, ranks.begin() + (a + 1) * per_node}, chunk));
    return p;
  };
  std::vector<Phase> phases;
  if (per_node > 1) phases.push_back(by_node(direct_chunk));
  Phase rails;
  for (int l = 0; l < per_node; ++l) {
    std::vector<int> rail;
    for (int a = 0; a < nodes; ++a) rail.push_back(ranks[static_cast<std::size_t>(a * per_node + l)]);
    rails.schedules.push_back(pairwise(std::move(rail), ib_chunk));
  }
  phases.push_back(std::move(rails));
  if (per_node > 1) phases.push_back(by_node(forward_chunk));
  return phases;
}

void for_each_pair(const std::vector<Phase>& phases, const std::function<void(int, int)>& fn) {
  for (const auto& phase : phases)
    for (const auto& s : phase.schedules) {
      const int n = s.size();
      const int distinct_rounds = s.pattern == RoundSchedule::Pattern::Ring ? 1 : s.rounds;
      for (int j = 0; j < distinct_rounds; ++j)
        for (int i = 0; i < n; ++i)
          fn(s.devices[static_cast<std::size_t>(i)], s.devices[static_cast<std::size_t>(s.target(j, i))]);
    }
}

}  // namespace piper::sim::simgrid_detail
