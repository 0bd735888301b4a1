// The tied-embedding pass (internal): sums the gradients of a tied table's two copies.
#include "pass.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace piper::core::passes {

namespace {

// The pair all-reduce needs the device at position p of the embedding's set to hold the same
// replica as the one at position p of the head's. Where the two sets cannot be paired so, no plan can
// keep the copies equal: a one-line error naming the layout, rather than a plan without the sum
// (which would simulate, and which the runtime refuses).
void check_tied_layout(const GlobalDag& dag, int embed, DeviceSetId e, int head, DeviceSetId h, bool mirrored) {
  const std::string sides =
      fmt::format("the tied embedding (segment {}, on {}) and the head's copy (segment {}, on {})", embed,
                  set_str(dag.device_sets.at(e)), head, set_str(dag.device_sets.at(h)));
  const std::string what = ": the two copies cannot be paired for their gradient sum";
  if (mirrored) throw Error(fmt::format("directives: a segment of {} is placed on two device sets{}", sides, what));
  const std::vector<int>& de = dag.device_sets.at(e);
  const std::vector<int>& dh = dag.device_sets.at(h);
  if (de.size() != dh.size())
    throw Error(fmt::format("directives: {} run on different numbers of devices{} (place both on as many devices)",
                            sides, what));
  std::size_t shared = 0;
  for (std::size_t p = 0; p < dh.size(); ++p) {
    const auto q = static_cast<std::size_t>(std::find(de.begin(), de.end(), dh[p]) - de.begin());
    if (q == de.size()) continue;
    if (q != p)
      throw Error(fmt::format(
          "directives: {} are placed mirrored (device {} holds the embedding at position {} and the head at {}){} "
          "(untie the embeddings, or place the head's segment at the embedding's positions)",
          sides, dh[p], q, p, what));
    ++shared;
  }
  if (shared > 0 && shared < de.size())
    throw Error(fmt::format(
        "directives: {} share some devices but not all{} (place both on the same devices or on disjoint ones)", sides,
        what));
}

// Tied embeddings: when the head's segment keeps a copy of the table (Segment::tied_copy) on other
// devices than the embedding's, the two copies' gradients are summed by an ALL_REDUCE over pairs
// (family "tied-embedding": the device at position p of the embedding's set with the one at position
// p of the head's, same data-parallel and TP rank), after each side's last backward of the segment
// and before its data-parallel reduction and update (Megatron-LM's distributed optimizer sums the
// embedding group first, then reduce-scatters; a sum of local gradients commutes with the
// data-parallel sum). Its own stream, so that only the buckets holding the table wait for it.
// When both segments are on the same set (V placements) each device sums its two copies locally: no
// op. Any other layout is an error (check_tied_layout).
bool link_tied_embedding(PassContext& cx) {
  auto& dag = cx.dag;
  const auto tied =
      std::find_if(dag.segments.begin(), dag.segments.end(), [](const Segment& s) { return s.tied_copy > 0; });
  if (tied == dag.segments.end()) return false;
  const int head = tied->index, embed = tied->tied_to;
  // Each segment's device set; two sets for one segment: mirrored.
  DeviceSetId e = kNoDevices, h = kNoDevices;
  bool mirrored = false;
  auto note = [&](DeviceSetId& set, DeviceSetId d) { mirrored |= set != kNoDevices && set != d, set = d; };
  for (auto v : dag.live_nodes()) {
    const auto& n = cx.node(v);
    if (n.kind != NodeKind::Compute) continue;
    if (n.segment == embed) note(e, n.devices);
    if (n.segment == head) note(h, n.devices);
  }
  if (e == kNoDevices || h == kNoDevices) throw InternalError("the tied embedding's segments are not placed");
  check_tied_layout(dag, embed, e, head, h, mirrored);
  if (e == h) return false;  // one device set: each device sums its two copies locally
  const std::vector<int>& de = dag.device_sets.at(e);
  const std::vector<int>& dh = dag.device_sets.at(h);
  std::vector<int> pairs;
  for (std::size_t p = 0; p < de.size(); ++p) pairs.push_back(de[p]), pairs.push_back(dh[p]);
  DagNode sum;
  sum.kind = NodeKind::AllReduce;
  sum.family = dag.family_index({dag.device_sets.intern(pairs), 2, 1, FamilyPurpose::TiedEmbedding});
  sum.devices = dag.families[static_cast<std::size_t>(sum.family)].devices;
  sum.stream = "tied";
  sum.bytes = tied->copy_local_params() * gradient_bytes_per_element(dag.training);
  sum.segment = head;
  sum.buffer_segments = {embed, head};
  sum.label = "ALL_REDUCE tied embedding s" + std::to_string(embed) + "+s" + std::to_string(head);
  const Vertex vs = cx.add(sum);
  for (auto v : dag.live_nodes()) {
    if (v == vs) continue;
    const auto& n = cx.node(v);
    const int side = n.devices == e ? embed : n.devices == h ? head : -1;
    const bool mine = side >= 0 && n.segment == side;
    if (n.kind == NodeKind::Compute && mine && (n.pass == Pass::B || n.pass == Pass::BW))
      dag.add_edge(v, vs, {EdgeKind::Data, sum.bytes, "grad"});
    // Reductions and updates of the buffers holding the table (each on its own side's devices).
    const bool reduces = n.kind == NodeKind::Update || n.kind == NodeKind::ReduceScatter ||
                         (n.kind == NodeKind::AllReduce && n.family != sum.family);
    const auto& bs = n.buffer_segments;
    if (reduces &&
        (std::find(bs.begin(), bs.end(), embed) != bs.end() || std::find(bs.begin(), bs.end(), head) != bs.end()))
      dag.add_edge(vs, v, {EdgeKind::Data, sum.bytes, "grad"});
  }
  return true;
}

}  // namespace

bool run_tied_embedding(PassRun& run) { return link_tied_embedding(run.cx); }

}  // namespace piper::core::passes
