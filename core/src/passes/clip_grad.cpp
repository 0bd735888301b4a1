// The clip-grad pass: gradient clipping by global norm (ClipGradDirective). One ALL_REDUCE over every
// device that updates parameters (family purpose grad-norm, its own stream "norm"): it waits for every
// gradient-finishing node that feeds an update (the gradient reductions, the tied-embedding sum, or
// the backward itself where nothing is reduced), and every update waits for it. Its payload is one
// fp32 value per device: the sum of squares of the gradients that device owns.
#include <set>

#include "pass.hpp"

namespace piper::core::passes {

void run_clip_grad(PassRun& run, const ClipGradDirective& d, int) {
  auto& cx = run.cx;
  auto& dag = cx.dag;
  dag.clip_grad = d.max_norm;
  std::vector<Vertex> updates;
  std::set<int> devices;
  for (auto v : dag.live_nodes()) {
    const auto& n = cx.node(v);
    if (n.kind != NodeKind::Update || n.devices == kNoDevices) continue;
    updates.push_back(v);
    for (int device : dag.device_sets.at(n.devices)) devices.insert(device);
  }
  if (updates.empty()) return;
  const std::vector<int> all(devices.begin(), devices.end());
  DagNode norm;
  norm.kind = NodeKind::AllReduce;
  norm.family =
      dag.family_index({dag.device_sets.intern(all), static_cast<int>(all.size()), 1, FamilyPurpose::GradNorm});
  norm.devices = dag.families[static_cast<std::size_t>(norm.family)].devices;
  norm.stream = "norm";
  norm.bytes = 4;  // one fp32 sum of squares per device
  norm.label = "ALL_REDUCE grad norm";
  // Every input of every update, once (a bucket's reduction feeds the updates of all its segments).
  std::set<Vertex> inputs;
  for (Vertex u : updates)
    for (auto [e, end] = boost::in_edges(u, dag.graph); e != end; ++e) inputs.insert(boost::source(*e, dag.graph));
  const Vertex vn = cx.add(norm);
  for (Vertex p : inputs) dag.add_edge(p, vn, {EdgeKind::Data, 0, "grad"});
  for (Vertex u : updates) dag.add_edge(vn, u, {EdgeKind::Data, 0, "grad-norm"});
}

}  // namespace piper::core::passes
