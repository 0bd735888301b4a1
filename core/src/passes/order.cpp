// The order pass: one order directive sequences its groups of steps on one device set.
#include "pass.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <set>

namespace piper::core::passes {

namespace {

// The nodes each group selects; every node on one device set (or sets holding the same devices) and
// in one group only. Returns the groups and the device set of the first node selected.
std::pair<std::vector<std::vector<Vertex>>, DeviceSetId> select_groups(PassContext& cx, const OrderDirective& d,
                                                                       int index) {
  auto& dag = cx.dag;
  std::vector<std::vector<Vertex>> groups;
  std::map<Vertex, std::size_t> group_of;
  DeviceSetId set = kNoDevices;
  std::string set_origin;
  std::vector<int> set_members;
  // Each set is sorted once (V placements select nodes on two mirrored sets many times over).
  std::map<DeviceSetId, std::vector<int>> sorted_sets;
  auto sorted_devices = [&](DeviceSetId id) -> const std::vector<int>& {
    auto [it, fresh] = sorted_sets.try_emplace(id);
    if (fresh) {
      it->second = dag.device_sets.at(id);
      std::sort(it->second.begin(), it->second.end());
    }
    return it->second;
  };
  for (std::size_t gi = 0; gi < d.groups.size(); ++gi) {
    std::vector<Vertex> members;
    for (std::size_t fi = 0; fi < d.groups[gi].size(); ++fi) {
      auto matched = cx.match(d.groups[gi][fi]);
      auto field = [&] { return "filters[" + std::to_string(gi) + "][" + std::to_string(fi) + "]"; };
      if (matched.empty()) fail(index, field(), "matches no node (" + d.groups[gi][fi].to_string() + ")");
      for (auto v : matched) {
        const auto& n = cx.node(v);
        if (set == kNoDevices) set = n.devices, set_origin = field(), set_members = sorted_devices(n.devices);
        // Sets holding the same devices in another order (mirrored data-parallel copies) share one
        // order: each device still sees one total order of its own nodes.
        if (n.devices != set && sorted_devices(n.devices) != set_members)
          fail(index, field(),
               "'" + n.label + "' runs on " + set_str(dag.device_sets.at(n.devices)) + " but " + set_origin +
                   " selects nodes on " + set_str(dag.device_sets.at(set)) + ": an order cannot cross device sets");
        auto [it, fresh] = group_of.try_emplace(v, gi);
        if (!fresh && it->second != gi)
          fail(index, field(), "'" + n.label + "' is already selected by group " + std::to_string(it->second));
        if (fresh) members.push_back(v);
      }
    }
    groups.push_back(std::move(members));
  }
  return {std::move(groups), set};
}

void apply_order(PassContext& cx, const OrderDirective& d, int index) {
  auto& dag = cx.dag;
  const auto selected = select_groups(cx, d, index);  // not a structured binding: clang 14 cannot capture one
  const std::vector<std::vector<Vertex>>& groups = selected.first;
  const DeviceSetId set = selected.second;
  // The members of one group form one step (e.g. an overlapped F&B pair): the step starts when the
  // inputs of all its members are ready, so each member also waits for the others' producers.
  std::vector<std::vector<std::pair<Vertex, Vertex>>> costart(groups.size());
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    if (groups[gi].size() < 2) continue;
    std::set<Vertex> members(groups[gi].begin(), groups[gi].end()), producers;
    // A producer is internal when it is a member or communication fed by a member (e.g. the
    // all-to-all between two segments of one matched chain); only external producers gate the step.
    std::map<Vertex, bool> memo;
    std::function<bool(Vertex)> internal = [&](Vertex p) -> bool {
      if (members.contains(p)) return true;
      if (!is_communication(dag.graph[p].kind)) return false;
      if (auto it = memo.find(p); it != memo.end()) return it->second;
      bool fed = false;
      for (auto e : boost::make_iterator_range(boost::in_edges(p, dag.graph)))
        if (dag.graph[e].kind == EdgeKind::Data && internal(boost::source(e, dag.graph))) fed = true;
      return memo[p] = fed;
    };
    // ZeRO-3's per-use parameter gathers do not gate the step: each member waits for its own
    // segment's parameters only, so a step's later segments gather while its first ones compute
    // (FSDP's prefetch; the replicate directive's `prefetch` bounds how far ahead).
    // An expert all-to-all that feeds a member is the step's own work even when what feeds it comes
    // from outside (a backward chunk that starts at the experts: the gradient arrives by a RECV, then
    // the chunk's first all-to-all moves it): the step waits for the all-to-all's inputs, not for the
    // all-to-all, so the other member's compute runs under it.
    std::function<void(Vertex)> collect = [&](Vertex u) {
      if (internal(u) || is_parameter_gather(dag.graph[u])) return;
      if (dag.graph[u].kind != NodeKind::AllToAll) {
        producers.insert(u);
        return;
      }
      for (auto e : boost::make_iterator_range(boost::in_edges(u, dag.graph)))
        if (dag.graph[e].kind == EdgeKind::Data) collect(boost::source(e, dag.graph));
    };
    for (auto w : groups[gi])
      for (auto e : boost::make_iterator_range(boost::in_edges(w, dag.graph)))
        if (dag.graph[e].kind == EdgeKind::Data) collect(boost::source(e, dag.graph));
    for (auto v : groups[gi])
      for (auto u : producers)
        if (!boost::edge(u, v, dag.graph).second) costart[gi].emplace_back(u, v);
  }
  auto add_costart = [&](std::size_t gi) {
    for (auto [u, v] : costart[gi]) dag.add_edge(u, v, {EdgeKind::Temporal, 0, "step"});
  };
  std::vector<Vertex> dummies;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) add_costart(gi);
  for (std::size_t gi = 0; gi + 1 < groups.size(); ++gi) {
    DagNode dummy;
    dummy.kind = NodeKind::OrderDummy;
    dummy.devices = set;
    dummy.label = "ORDER " + std::to_string(index) + "." + std::to_string(gi);
    Vertex v = cx.add(dummy);
    dummies.push_back(v);
    for (auto u : groups[gi]) dag.add_edge(u, v, {EdgeKind::Temporal, 0, ""});
    for (auto w : groups[gi + 1]) dag.add_edge(v, w, {EdgeKind::Temporal, 0, ""});
  }
  // Unchecked (not strict): order passes only add nodes and edges, so if the DAG is acyclic once every
  // order has run, it was after each of them; apply_directives checks it then.
  if (!cx.strict || !dag.has_cycle()) return;
  // Slow path, errors only: find the first group (or group boundary) that closes a cycle.
  for (auto v : dummies) boost::clear_vertex(v, dag.graph);
  for (const auto& edges : costart)
    for (auto [u, v] : edges) boost::remove_edge(u, v, dag.graph);
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    add_costart(gi);
    if (dag.has_cycle())
      fail(index, "filters[" + std::to_string(gi) + "]",
           "group " + std::to_string(gi) + " cannot run as one step: one of its nodes depends on another");
    if (gi == 0) continue;
    for (auto u : groups[gi - 1]) dag.add_edge(u, dummies[gi - 1], {EdgeKind::Temporal, 0, ""});
    for (auto w : groups[gi]) dag.add_edge(dummies[gi - 1], w, {EdgeKind::Temporal, 0, ""});
    if (dag.has_cycle())
      fail(index, "filters[" + std::to_string(gi) + "]",
           "order would create a cycle: group " + std::to_string(gi) + " must run after group " +
               std::to_string(gi - 1) + ", but a node of group " + std::to_string(gi - 1) + " depends on it");
  }
  fail(index, "filters", "order would create a cycle");
}

}  // namespace

void run_order(PassRun& run, const OrderDirective& d, int index) { apply_order(run.cx, d, index); }

}  // namespace piper::core::passes
