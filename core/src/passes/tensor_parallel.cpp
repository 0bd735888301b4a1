// The tensor_parallel pass (marks segments, routed experts with their expert-TP degree; their costs are rewritten by
// recost.cpp) and the tp-groups pass (internal, after placement: the TP communicator families).
#include "pass.hpp"

#include <algorithm>
#include <vector>

#include <fmt/format.h>

namespace piper::core::passes {

namespace {

// tensor_parallel: marks the selected segments. Routed experts take the directive's expert_degree
// (ETP; 1 keeps them whole, with EP only) and, with sequence parallelism, receive the 1/degree
// sequence slice of the tokens. Costs are rewritten once all tensor_parallel and recompute
// directives have run (recost_segments); groups are made after place.
void apply_tensor_parallel(PassContext& cx, const TensorParallelDirective& d, int index, std::vector<int>& tp_by) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  for (int s : segments_of(cx, matched)) {
    auto& seg = cx.dag.segments.at(static_cast<std::size_t>(s));
    const Layer* experts = nullptr;
    for (int l = seg.first_layer; l < seg.last_layer; ++l)
      if (cx.dag.layers.at(static_cast<std::size_t>(l)).kind == LayerKind::MoeExperts)
        experts = &cx.dag.layers.at(static_cast<std::size_t>(l));
    if (experts && d.expert_degree == 1 && !d.sequence_parallel) continue;  // whole experts on whole tokens
    if (tp_by[static_cast<std::size_t>(s)] >= 0)
      fail(index, "filter",
           "segment " + std::to_string(s) + " is already tensor-parallel (directive " +
               std::to_string(tp_by[static_cast<std::size_t>(s)]) + ")");
    tp_by[static_cast<std::size_t>(s)] = index;
    if (experts) {
      if (experts->shape.ffn % d.expert_degree != 0)
        fail(index, "expert_degree",
             fmt::format("{} does not divide the {} ffn columns of layer '{}'", d.expert_degree, experts->shape.ffn,
                         experts->name));
      seg.tp_degree = d.expert_degree;
      seg.token_split = d.sequence_parallel ? d.degree : 1;
      if (d.sequence_parallel && cx.dag.training.seq_len % d.degree != 0)
        fail(index, "sequence_parallel",
             fmt::format("{} does not divide the sequence length {}", d.degree, cx.dag.training.seq_len));
      seg.tp_comm_overlap = d.comm_overlap && d.expert_degree > 1;
      continue;
    }
    for (int l = seg.first_layer; l < seg.last_layer; ++l) {
      const Layer& layer = cx.dag.layers.at(static_cast<std::size_t>(l));
      const auto& sh = layer.shape;
      auto indivisible = [&](const char* what, std::int64_t v) {
        if (v > 0 && v % d.degree != 0)
          fail(index, "degree",
               fmt::format("{} does not divide the {} {} of layer '{}'", d.degree, v, what, layer.name));
      };
      if (layer.kind == LayerKind::Attention) indivisible("heads", sh.heads);
      // The KV heads split too (Megatron-LM's num_query_groups; the runtime and tune ask the same): the
      // cost model divides the K/V projections, their weights and stash by the degree, which would
      // otherwise count a fraction of a KV head per rank, or none of the replication below one.
      if (layer.kind == LayerKind::Attention && sh.kv_lora_rank == 0) indivisible("KV heads", sh.kv_heads);
      if (layer.kind == LayerKind::Mlp) indivisible("ffn columns", sh.ffn);
      // The vocabulary is not checked: Megatron pads it to a multiple of the TP degree.
    }
    if (d.sequence_parallel && cx.dag.training.seq_len % d.degree != 0)
      fail(index, "sequence_parallel",
           fmt::format("{} does not divide the sequence length {}", d.degree, cx.dag.training.seq_len));
    seg.tp_degree = d.degree;
    seg.sequence_parallel = d.sequence_parallel;
    seg.tp_comm_overlap = d.comm_overlap;
  }
}

// After placement: each TP segment's set splits into consecutive groups of its degree (family "tp";
// for routed experts, the ETP groups).
void make_tp_groups(PassContext& cx, const DirectiveProgram& program, const std::vector<int>& tp_by) {
  auto& dag = cx.dag;
  std::vector<DeviceSetId> set_of(dag.segments.size(), kNoDevices);
  for (auto v : dag.live_nodes())
    if (cx.node(v).kind == NodeKind::Compute) set_of[static_cast<std::size_t>(cx.node(v).segment)] = cx.node(v).devices;
  for (auto& seg : dag.segments) {
    const int index = tp_by[static_cast<std::size_t>(seg.index)];
    if (index < 0 || seg.tp_degree == 1) continue;
    const auto& d = std::get<TensorParallelDirective>(program.directives[static_cast<std::size_t>(index)]);
    const DeviceSetId set = set_of[static_cast<std::size_t>(seg.index)];
    const auto& devices = dag.device_sets.at(set);
    if (!d.devices.empty() && d.devices != devices)
      fail(index, "devices",
           set_str(d.devices) + " differ from the placement " + set_str(devices) + " of segment " +
               std::to_string(seg.index));
    if (devices.size() % static_cast<std::size_t>(seg.tp_degree) != 0)
      fail(index, seg.tags.contains("EP") ? "expert_degree" : "degree",
           fmt::format("{} does not divide the {} devices segment {} is placed on", seg.tp_degree, devices.size(),
                       seg.index));
    seg.tp_family = dag.family_index({set, seg.tp_degree, 1, FamilyPurpose::Tp});
  }
}

}  // namespace

void run_tensor_parallel(PassRun& run, const TensorParallelDirective& d, int index) {
  apply_tensor_parallel(run.cx, d, index, run.tp_by);
}

bool run_tp_groups(PassRun& run) {
  if (std::none_of(run.tp_by.begin(), run.tp_by.end(), [](int i) { return i >= 0; })) return false;
  make_tp_groups(run.cx, run.program, run.tp_by);
  return true;
}

}  // namespace piper::core::passes
