// The recost pass (internal): per-device costs of the tensor-parallel and recomputed segments.
#include "pass.hpp"

#include <algorithm>
#include <vector>

#include <fmt/format.h>

namespace piper::core::passes {

namespace {

// Rewrites the per-device costs of every TP or recomputed segment from its layers (core::layer_costs
// with a ParallelLayout): its compute nodes (F, B, BI, BW as the backward split shares them), its
// stash, and, between two sequence-parallel segments of the same degree, the activations and
// gradients they pass (sliced along the sequence).
void recost_segments(PassContext& cx, const std::vector<int>& tp_by) {
  auto& dag = cx.dag;
  std::vector<char> changed(dag.segments.size(), 0);
  std::vector<Costs> costs(dag.segments.size());
  for (auto& seg : dag.segments) {
    if (seg.tp_degree == 1 && seg.recompute == Recompute::None && seg.cp_degree == 1 && seg.token_split == 1) continue;
    const ParallelLayout layout{seg.tp_degree, seg.sequence_parallel, static_cast<int>(seg.recompute),
                                seg.cp_degree, seg.cp_all_gather,     seg.token_split};
    Costs c;
    for (int l = seg.first_layer; l < seg.last_layer; ++l)
      c += layer_costs(dag.layers.at(static_cast<std::size_t>(l)), dag.training, layout);
    seg.tp_local_params = c.params;
    seg.tp_local_gemm_weight_params = c.gemm_weight_params;
    costs[static_cast<std::size_t>(seg.index)] = c;
    changed[static_cast<std::size_t>(seg.index)] = 1;
  }
  Graph& g = cx.g();
  for (auto v : dag.live_nodes()) {
    auto& n = cx.node(v);
    if (n.kind != NodeKind::Compute || !changed[static_cast<std::size_t>(n.segment)]) continue;
    Costs c = costs[static_cast<std::size_t>(n.segment)];
    if (n.pass == Pass::BI) {  // as apply_backward_split divides a B
      c.backward_weight_flops = 0;
      c.backward_weight_gemm_kernels = 0;
      c.backward_memory_bytes /= 2;
    } else if (n.pass == Pass::BW) {
      c.backward_input_flops = 0;
      c.backward_input_gemm_kernels = 0;
      c.backward_memory_bytes -= c.backward_memory_bytes / 2;
      c.backward_elementwise_bytes = 0;
      c.backward_tp_bytes = 0;
      c.backward_tp_collectives = 0;
      c.backward_cp_bytes = 0;
      c.backward_cp_steps = 0;
      c.recompute_flops = 0;
    }
    n.costs = c;
  }
  auto sp_degree = [&](int segment) {
    const auto& sg = dag.segments.at(static_cast<std::size_t>(segment));
    return sg.sequence_parallel ? sg.tp_degree : 1;
  };
  auto cp_degree = [&](int segment) { return dag.segments.at(static_cast<std::size_t>(segment)).cp_degree; };
  // Routed experts on sequence-sliced tokens exchange the slice with their SP neighbours.
  auto slice_of = [&](int segment) {
    const auto& sg = dag.segments.at(static_cast<std::size_t>(segment));
    return sg.token_split > 1 ? sg.token_split : sp_degree(segment);
  };
  for (auto e : boost::make_iterator_range(boost::edges(g))) {
    Vertex u = boost::source(e, g), v = boost::target(e, g);
    if (g[u].kind != NodeKind::Compute || g[e].kind != EdgeKind::Data) continue;
    if (g[e].tensor == "stash" && changed[static_cast<std::size_t>(g[u].segment)]) {
      g[e].bytes = g[u].costs.activation_bytes;
    } else if ((g[e].tensor == "act" || g[e].tensor == "grad") && g[v].kind == NodeKind::Compute) {
      const int t = slice_of(g[u].segment);
      if (t > 1 && t == slice_of(g[v].segment)) {
        g[e].bytes /= t;
      } else if (dag.segments.at(static_cast<std::size_t>(g[u].segment)).token_split > 1 ||
                 dag.segments.at(static_cast<std::size_t>(g[v].segment)).token_split > 1) {
        const int s = g[dag.segments.at(static_cast<std::size_t>(g[u].segment)).token_split > 1 ? u : v].segment;
        const int other = s == g[u].segment ? g[v].segment : g[u].segment, o = slice_of(other);
        fail(tp_by.at(static_cast<std::size_t>(s)), "sequence_parallel",
             fmt::format("routed experts of segment {} receive a 1/{} sequence slice but "
                         "segment {} passes them {} (give both the same sequence-parallel degree)",
                         s, dag.segments.at(static_cast<std::size_t>(s)).token_split, other,
                         o > 1 ? fmt::format("1/{} slices", o) : "whole sequences"));
      }
      // Context parallelism: each device passes on its seq_len / cp local tokens.
      const int c = cp_degree(g[u].segment);
      if (c > 1 && c == cp_degree(g[v].segment)) g[e].bytes /= c;
    }
  }
}

}  // namespace

bool run_recost(PassRun& run) {
  const auto& ds = run.program.directives;
  if (std::none_of(ds.begin(), ds.end(), [](const Directive& d) {
        return std::holds_alternative<TensorParallelDirective>(d) || std::holds_alternative<RecomputeDirective>(d) ||
               std::holds_alternative<ContextParallelDirective>(d);
      }))
    return false;
  recost_segments(run.cx, run.tp_by);
  return true;
}

}  // namespace piper::core::passes
