// The place pass (one place directive) and the finish-placement pass (internal: unplaced nodes, one UPD per device set,
// SEND/RECV between device sets).
#include "pass.hpp"

#include <algorithm>
#include <map>

namespace piper::core::passes {

namespace {

// A place directive's `holds`: the region holds exactly the model's end of that name (the layers
// before its first block, or those after its last block), so that schedules may treat it as a region
// of its own. One line naming the directive and the first layer that disagrees.
void check_holds(PassContext& cx, const PlaceDirective& d, int index, const std::vector<Vertex>& matched) {
  const auto& layers = cx.dag.layers;
  const bool head = d.holds == "head";
  int first_block = -1, last_block = -1;  // layer indices of the first and last block layers
  for (std::size_t l = 0; l < layers.size(); ++l)
    if (layers[l].block >= 0) {
      if (first_block < 0) first_block = static_cast<int>(l);
      last_block = static_cast<int>(l);
    }
  const int lo = head ? last_block + 1 : 0, hi = head ? static_cast<int>(layers.size()) : first_block;
  if (first_block < 0 || lo >= hi)
    fail(index, "holds",
         std::string("the model has no ") + (head ? "layers after its last block" : "layers before its first block"));
  const std::string region = "region PP " + std::to_string(d.filter.exact.at("PP"));
  std::vector<char> seen(layers.size(), 0);
  for (auto v : matched) {
    const auto& n = cx.node(v);
    for (int l = n.first_layer; l < n.last_layer; ++l) {
      if (l < lo || l >= hi)
        fail(index, "holds",
             region + " holds layer " + std::to_string(l) + " (" + to_string(layers[static_cast<std::size_t>(l)].kind) +
                 "), not only the " + (head ? "final norm and head" : "embedding"));
      seen[static_cast<std::size_t>(l)] = 1;
    }
  }
  for (int l = lo; l < hi; ++l)
    if (!seen[static_cast<std::size_t>(l)])
      fail(index, "holds",
           region + " lacks layer " + std::to_string(l) + " (" + to_string(layers[static_cast<std::size_t>(l)].kind) +
               ") of the " + d.holds);
}

void apply_place(PassContext& cx, const PlaceDirective& d, int index, std::vector<int>& placed_by) {
  if (d.filter.pass) fail(index, "filter", "place cannot select a single pass");
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  if (!d.holds.empty()) check_holds(cx, d, index, matched);
  DeviceSetId set = cx.dag.device_sets.intern(d.devices);
  if (placed_by.size() < cx.p2p_stream.size()) placed_by.resize(cx.p2p_stream.size(), -1);
  for (auto v : matched) {
    auto& n = cx.node(v);
    if (n.devices != kNoDevices && n.devices != set)
      fail(index, "filter",
           "'" + n.label + "' is already placed on " + set_str(cx.dag.device_sets.at(n.devices)) + " by directive " +
               std::to_string(placed_by[v]));
    n.devices = set;
    cx.p2p_stream[v] = d.stream;
    if (cx.p2p_blocking.size() < cx.p2p_stream.size()) cx.p2p_blocking.resize(cx.p2p_stream.size(), 0);
    cx.p2p_blocking[v] = d.blocking;
    placed_by[v] = index;
  }
}

// After all place directives: every compute node is placed, UPD nodes follow their segments and
// merge per device set, and every data edge between different device sets becomes SEND -> RECV.
void finish_placement(PassContext& cx, bool any_place) {
  auto& dag = cx.dag;
  Graph& g = cx.g();
  if (!any_place) {
    DeviceSetId zero = dag.device_sets.intern({0});
    for (auto v : dag.live_nodes())
      if (cx.node(v).kind == NodeKind::Compute) cx.node(v).devices = zero, cx.p2p_stream[v] = "pp";
  }
  for (auto v : dag.live_nodes()) {
    const auto& n = cx.node(v);
    if (n.kind == NodeKind::Compute && n.devices == kNoDevices)
      throw Error("directives: '" + n.label + "' is not placed by any place directive (tags " +
                  Filter{n.tags, {}, {}}.to_string() + ")");
    if (n.kind == NodeKind::Compute) dag.segments.at(static_cast<std::size_t>(n.segment)).placed = true;
  }
  // UPD: on the device set of the backward nodes that feed it; one UPD per device set.
  std::map<DeviceSetId, Vertex> upd_of_set;
  for (auto v : dag.live_nodes()) {
    auto& n = cx.node(v);
    if (n.kind != NodeKind::Update) continue;
    DeviceSetId set = kNoDevices;
    for (const auto& r : in_edges_of(g, v)) {
      DeviceSetId s = cx.node(r.u).devices;
      if (set != kNoDevices && s != set)
        throw Error("directives: the copies of segment " + std::to_string(n.segment) +
                    " are placed on different device sets (" + set_str(dag.device_sets.at(set)) + " and " +
                    set_str(dag.device_sets.at(s)) + "); one segment's parameters must live on one device set");
      set = s;
    }
    n.devices = set;
    auto [it, fresh] = upd_of_set.try_emplace(set, v);
    if (fresh) continue;
    Vertex keep = it->second;
    for (const auto& r : in_edges_of(g, v)) dag.add_edge(r.u, keep, r.e);
    auto& kn = cx.node(keep);
    kn.buffer_segments.insert(kn.buffer_segments.end(), n.buffer_segments.begin(), n.buffer_segments.end());
    cx.remove(v);
  }
  for (auto& [set, v] : upd_of_set) {
    auto& n = cx.node(v);
    std::sort(n.buffer_segments.begin(), n.buffer_segments.end());
    n.label = "UPD" + common_tags_label(dag, n.buffer_segments);
  }
  // Point-to-point transfers between device sets.
  std::vector<EdgeRec> cross;
  for (auto e : boost::make_iterator_range(boost::edges(g))) {
    Vertex u = boost::source(e, g), v = boost::target(e, g);
    if (g[u].kind == NodeKind::Compute && g[v].kind == NodeKind::Compute && g[u].devices != g[v].devices)
      cross.push_back({u, v, g[e]});
  }
  for (const auto& r : cross) {
    const auto& su = dag.device_sets.at(cx.node(r.u).devices);
    const auto& sv = dag.device_sets.at(cx.node(r.v).devices);
    if (su.size() != sv.size())
      throw Error("directives: '" + cx.node(r.u).label + "' on " + set_str(su) + " feeds '" + cx.node(r.v).label +
                  "' on " + set_str(sv) + ": device sets of different sizes cannot be paired for point-to-point");
    boost::remove_edge(r.u, r.v, g);
    DagNode send;
    send.kind = NodeKind::Send;
    send.pass = cx.node(r.u).pass;
    send.tags = cx.node(r.u).tags;
    send.segment = cx.node(r.u).segment;
    send.devices = cx.node(r.u).devices;
    send.peer_devices = cx.node(r.v).devices;
    // One stream per direction and peer set: a rendezvous SEND must never queue behind a RECV from
    // another peer (or a send to another peer), which would hold the pipeline beyond its schedule.
    // Send and receive streams never share a name (the sets differ), so an exchange between mirrored
    // sets ([0,1] -> [1,0]) sends and receives at once, as an NCCL send/recv group does.
    send.stream = cx.p2p_stream[r.u] + ">" + set_str(sv);
    send.bytes = r.e.bytes;
    send.blocking = r.u < cx.p2p_blocking.size() && cx.p2p_blocking[r.u];
    send.label = "SEND " + cx.node(r.u).label + " -> s" + std::to_string(cx.node(r.v).segment);
    DagNode recv = send;
    recv.kind = NodeKind::Recv;
    recv.pass = cx.node(r.v).pass;
    recv.tags = cx.node(r.v).tags;
    recv.segment = cx.node(r.v).segment;
    recv.devices = cx.node(r.v).devices;
    recv.peer_devices = cx.node(r.u).devices;
    recv.stream = cx.p2p_stream[r.v] + "<" + set_str(su);
    recv.blocking = r.v < cx.p2p_blocking.size() && cx.p2p_blocking[r.v];
    recv.label = "RECV " + cx.node(r.v).label + " <- s" + std::to_string(cx.node(r.u).segment);
    Vertex vs = cx.add(std::move(send));
    Vertex vr = cx.add(std::move(recv));
    dag.add_edge(r.u, vs, r.e);
    dag.add_edge(vs, vr, r.e);
    dag.add_edge(vr, r.v, r.e);
  }
}

}  // namespace

void run_place(PassRun& run, const PlaceDirective& d, int index) { apply_place(run.cx, d, index, run.placed_by); }

bool run_finish_placement(PassRun& run) {
  const auto& ds = run.program.directives;
  finish_placement(run.cx, std::any_of(ds.begin(), ds.end(),
                                       [](const Directive& d) { return std::holds_alternative<PlaceDirective>(d); }));
  return true;
}

}  // namespace piper::core::passes
