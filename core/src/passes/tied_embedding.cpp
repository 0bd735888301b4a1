// The tied-embedding pass (internal): sums the gradients of a tied table's two copies.
#include "pass.hpp"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "piper/core/limits.hpp"

namespace piper::core::passes {

namespace {

// Tied embeddings: when the head's segment keeps a copy of the table (Segment::tied_copy) on other
// devices than the embedding's, the two copies' gradients are summed by an ALL_REDUCE over pairs
// (family "tied-embedding": the device at position p of the embedding's set with the one at position
// p of the head's, same data-parallel and TP rank), after each side's last backward of the segment
// and before its data-parallel reduction and update (Megatron-LM's distributed optimizer sums the
// embedding group first, then reduce-scatters; a sum of local gradients commutes with the
// data-parallel sum). Its own stream, so that only the buckets holding the table wait for it.
// Sets that share a device (V placements: a local sum; mirrored placements, which the runtime
// refuses) get no op.
bool link_tied_embedding(PassContext& cx) {
  auto& dag = cx.dag;
  const auto tied = std::find_if(dag.segments.begin(), dag.segments.end(), [](const Segment& s) { return s.tied_copy > 0; });
  if (tied == dag.segments.end()) return false;
  const int head = tied->index, embed = tied->tied_to;
  // Each segment's device set; two sets for one segment (a mirrored placement's two copies): no op.
  DeviceSetId e = kNoDevices, h = kNoDevices;
  bool mirrored = false;
  auto note = [&](DeviceSetId& set, DeviceSetId d) { mirrored |= set != kNoDevices && set != d, set = d; };
  for (auto v : dag.live_nodes()) {
    const auto& n = cx.node(v);
    if (n.kind != NodeKind::Compute) continue;
    if (n.segment == embed) note(e, n.devices);
    if (n.segment == head) note(h, n.devices);
  }
  if (mirrored || e == kNoDevices || h == kNoDevices) return false;
  const std::vector<int>& de = dag.device_sets.at(e);
  const std::vector<int>& dh = dag.device_sets.at(h);
  if (de.size() != dh.size()) return false;
  const std::set<int> in_e(de.begin(), de.end());
  if (std::any_of(dh.begin(), dh.end(), [&](int d) { return in_e.contains(d); })) return false;
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
    if (reduces && (std::find(bs.begin(), bs.end(), embed) != bs.end() || std::find(bs.begin(), bs.end(), head) != bs.end()))
      dag.add_edge(vs, v, {EdgeKind::Data, sum.bytes, "grad"});
  }
  return true;
}

}  // namespace

bool run_tied_embedding(PassRun& run) { return link_tied_embedding(run.cx); }

}  // namespace piper::core::passes
