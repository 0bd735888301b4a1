// The shard pass: expert parallelism of the selected segments (all-to-all dispatch and combine).
#include "pass.hpp"

#include <vector>

#include <fmt/format.h>

namespace piper::core::passes {

namespace {

// Per-device costs of a segment sharded over `degree` devices that are data-parallel replicas (each
// holds its own microbatch; expert parallelism as generated and as in the published programs): each
// device keeps 1/degree of the parameters and of their weight traffic, but the all-to-all brings it
// every token routed to its experts from all `degree` devices, so with balanced routing it computes
// (and stashes activations for) exactly as many token-expert pairs as one unsharded device would.
// Dividing the FLOPs as well, as this pass once did, made expert parallelism look degree x cheaper
// than it is (experiments/pp-ep-moe/README.md).
void scale_costs(Costs& c, int degree) {
  c.params /= degree;
  c.param_bytes /= degree;
  c.forward_memory_bytes /= degree;
  c.backward_memory_bytes /= degree;
}

void apply_shard(PassContext& cx, const ShardDirective& d, int index) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  check_devices(cx, matched, d.devices, index);
  const int degree = d.degree > 0 ? d.degree : static_cast<int>(d.devices.size());
  // Routed experts split by expert TP (tp_degree e, consecutive ETP groups): a device's position i in
  // the set is ETP rank i mod e, EP rank (i / e) mod degree, expert-data-parallel rank i / (e degree),
  // as Megatron-core orders expert ranks (tp-ep-dp). The EP groups (same ETP rank, consecutive
  // EP ranks) are then strided by e inside blocks of e·degree devices.
  int etp = 0;
  for (int s : segments_of(cx, matched)) {
    auto& seg = cx.dag.segments.at(static_cast<std::size_t>(s));
    if (seg.shard_degree != 1) fail(index, "filter", "segment " + std::to_string(s) + " is already sharded");
    if (etp != 0 && seg.tp_degree != etp)
      fail(index, "filter",
           "selects segments of different expert tensor-parallel degrees (" + std::to_string(etp) + " and " +
               std::to_string(seg.tp_degree) + ")");
    etp = seg.tp_degree;
    seg.shard_degree = degree;
  }
  if (d.devices.size() % (static_cast<std::size_t>(etp) * static_cast<std::size_t>(degree)) != 0)
    fail(index, "degree",
         fmt::format("{} x expert_degree {} does not divide the {} devices", degree, etp, d.devices.size()));
  if (degree == 1) return;
  Graph& g = cx.g();
  std::vector<int> ep_order;  // the set listed EP group by EP group
  const auto block = static_cast<std::size_t>(etp) * static_cast<std::size_t>(degree);
  for (std::size_t b = 0; b < d.devices.size(); b += block)
    for (int r = 0; r < etp; ++r)
      for (int j = 0; j < degree; ++j) ep_order.push_back(d.devices[b + static_cast<std::size_t>(j * etp + r)]);
  DeviceSetId set = cx.dag.device_sets.intern(ep_order);
  int family = cx.dag.family_index({set, degree, 1, FamilyPurpose::Ep});
  std::vector<char> in(boost::num_vertices(g), 0);
  for (auto v : matched) in[v] = 1;
  std::vector<EdgeRec> crossing;
  for (auto v : matched) {
    auto& n = cx.node(v);
    scale_costs(n.costs, degree);
    for (auto& r : in_edges_of(g, v))
      if (!in[r.u] && r.e.kind == EdgeKind::Data && cx.node(r.u).kind != NodeKind::Update) crossing.push_back(r);
    for (auto& r : out_edges_of(g, v))
      if (!in[r.v] && r.e.kind == EdgeKind::Data && cx.node(r.v).kind != NodeKind::Update) crossing.push_back(r);
  }
  for (const auto& r : crossing) {
    const bool into = in[r.v];
    Vertex sharded = into ? r.v : r.u;
    const auto& sn = cx.node(sharded);
    DagNode a2a;
    a2a.kind = NodeKind::AllToAll;
    a2a.pass = sn.pass;
    a2a.tags = sn.tags;
    a2a.segment = sn.segment;
    a2a.devices = set;
    a2a.stream = d.stream;
    a2a.family = family;
    a2a.bytes = r.e.bytes * cx.dag.segments.at(static_cast<std::size_t>(sn.segment)).fanout;
    a2a.label = std::string("ALL_TO_ALL ") + (into ? "dispatch " : "combine ") + sn.label;
    boost::remove_edge(r.u, r.v, g);
    Vertex a = cx.add(std::move(a2a));
    DagEdge e = r.e;
    cx.dag.add_edge(r.u, a, e);
    e.bytes = cx.node(a).bytes;
    cx.dag.add_edge(a, r.v, e);
  }
}

}  // namespace

void run_shard(PassRun& run, const ShardDirective& d, int index) { apply_shard(run.cx, d, index); }

}  // namespace piper::core::passes
