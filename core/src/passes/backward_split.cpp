// The backward-split pass (internal): B becomes BI + BW where an order directive names either.
#include "pass.hpp"

#include <vector>

namespace piper::core::passes {

namespace {

// Splits B into BI (input gradient, on the critical path) and BW (weight gradient, deferrable) for
// every B node selected by an order filter that names BI or BW.
void apply_backward_split(PassContext& cx, const std::vector<Filter>& filters) {
  // The B nodes whose tags some filter matches (its PASS aside), ascending.
  std::vector<char> selected(boost::num_vertices(cx.g()), 0);
  for (const auto& f : filters)
    for (auto v : cx.tag_index().candidates(f))
      if (!selected[v] && cx.node(v).pass == Pass::B && f.matches_tags(cx.node(v).tags)) selected[v] = 1;
  std::vector<Vertex> targets;
  for (Vertex v = 0; v < selected.size(); ++v)
    if (selected[v]) targets.push_back(v);
  Graph& g = cx.g();
  for (auto b : targets) {
    DagNode bi = cx.node(b), bw = cx.node(b);
    bi.pass = Pass::BI;
    bi.costs.backward_weight_flops = 0;
    bi.costs.backward_weight_gemm_kernels = 0;
    bw.costs.backward_input_gemm_kernels = 0;
    bi.costs.backward_memory_bytes = cx.node(b).costs.backward_memory_bytes / 2;
    bw.pass = Pass::BW;
    bw.costs.backward_input_flops = 0;
    bw.costs.backward_memory_bytes -= bi.costs.backward_memory_bytes;
    // Element-wise kernels and TP collectives of the backward belong to the input-gradient half.
    bw.costs.backward_elementwise_bytes = 0;
    bw.costs.backward_tp_bytes = 0;
    bw.costs.backward_tp_collectives = 0;
    bw.costs.backward_cp_bytes = 0;
    bw.costs.backward_cp_steps = 0;
    bi.label.clear();
    bw.label.clear();
    auto ins = in_edges_of(g, b), outs = out_edges_of(g, b);
    Vertex vi = cx.add(std::move(bi)), vw = cx.add(std::move(bw));
    for (const auto& r : ins) {
      cx.dag.add_edge(r.u, vi, r.e);
      if (r.e.tensor == "stash") cx.dag.add_edge(r.u, vw, r.e);
    }
    for (const auto& r : outs) cx.dag.add_edge(cx.node(r.v).kind == NodeKind::Update ? vw : vi, r.v, r.e);
    // BW reads what BI computed (the gradient at the layer outputs): it runs after its BI.
    cx.dag.add_edge(vi, vw, {EdgeKind::Data, 0, "igrad"});
    cx.remove(b);
  }
}

}  // namespace

bool run_backward_split(PassRun& run) {
  std::vector<Filter> wants_split;
  for (const auto& directive : run.program.directives)
    if (const auto* d = std::get_if<OrderDirective>(&directive))
      for (const auto& grp : d->groups)
        for (const auto& f : grp)
          if (f.pass == Pass::BI || f.pass == Pass::BW) wants_split.push_back(f);
  if (wants_split.empty()) return false;
  apply_backward_split(run.cx, wants_split);
  return true;
}

}  // namespace piper::core::passes
