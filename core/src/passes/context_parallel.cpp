// The context_parallel pass (marks every segment with the CP degree; their costs are rewritten by
// recost.cpp) and the cp-groups pass (internal, after placement: the CP communicator families).
#include "pass.hpp"

#include <vector>

#include <fmt/format.h>

namespace piper::core::passes {

namespace {

// context_parallel: the whole model. The sequence must cut into 2·degree equal chunks (the load-balanced
// causal layout: CP rank c holds chunks c and 2·degree-1-c), and every attention layer must be one the
// ring (or gathered) flash attention computes exactly: a fused causal kernel over the whole sequence.
void apply_context_parallel(PassContext& cx, const ContextParallelDirective& d, int index) {
  auto& dag = cx.dag;
  const std::int64_t seq = dag.training.seq_len;
  if (seq % (2 * static_cast<std::int64_t>(d.degree)) != 0)
    fail(index, "degree",
         fmt::format("the sequence length {} does not cut into 2 x {} = {} equal chunks (load-balanced causal CP)", seq,
                     d.degree, 2 * d.degree));
  for (const Layer& layer : dag.layers) {
    if (layer.kind != LayerKind::Attention || d.degree == 1) continue;
    if (layer.shape.attention_kernel != AttentionKernel::Flash)
      fail(index, "degree",
           "layer '" + layer.name + "' uses standard attention; context parallelism needs the flash kernel");
    if (layer.shape.window > 0 && layer.shape.window < seq)
      fail(index, "degree",
           "layer '" + layer.name + "' has a sliding window; context parallelism needs full causal attention");
  }
  for (auto& seg : dag.segments) {
    // Sequence parallelism slices each device's local tokens further over its TP group.
    if (seg.sequence_parallel && (seq / d.degree) % seg.tp_degree != 0)
      fail(
          index, "degree",
          fmt::format(
              "segment {}: the {} local tokens (sequence {} / {}) do not split over its sequence-parallel TP degree {}",
              seg.index, seq / d.degree, seq, d.degree, seg.tp_degree));
    seg.cp_degree = d.degree;
    seg.cp_all_gather = d.all_gather;
  }
}

// After placement: each segment's set cut into blocks of tp·cp devices; in a block, CP rank c and TP
// rank k is device c·tp + k (TP innermost, then CP). The family lists each CP group's devices
// consecutively, in CP-rank order (an interned reordering of the set), so group_of gives the ring.
void make_cp_groups(PassContext& cx, int index) {
  auto& dag = cx.dag;
  std::vector<DeviceSetId> set_of(dag.segments.size(), kNoDevices);
  for (auto v : dag.live_nodes())
    if (cx.node(v).kind == NodeKind::Compute) set_of[static_cast<std::size_t>(cx.node(v).segment)] = cx.node(v).devices;
  for (auto& seg : dag.segments) {
    if (seg.cp_degree <= 1) continue;
    const DeviceSetId set = set_of[static_cast<std::size_t>(seg.index)];
    const std::vector<int> devices = dag.device_sets.at(set);
    const std::size_t tp = static_cast<std::size_t>(std::max(1, seg.tp_degree)),
                      cp = static_cast<std::size_t>(seg.cp_degree);
    if (devices.size() % (tp * cp) != 0)
      fail(index, "degree",
           fmt::format("{} x TP {} does not divide the {} devices segment {} is placed on", cp, tp, devices.size(),
                       seg.index));
    std::vector<int> grouped;
    grouped.reserve(devices.size());
    for (std::size_t block = 0; block < devices.size(); block += tp * cp)
      for (std::size_t k = 0; k < tp; ++k)
        for (std::size_t c = 0; c < cp; ++c) grouped.push_back(devices[block + c * tp + k]);
    seg.cp_family = dag.family_index({dag.device_sets.intern(grouped), seg.cp_degree, 1, FamilyPurpose::Cp});
  }
}

int context_parallel_index(const DirectiveProgram& program) {
  for (std::size_t i = 0; i < program.directives.size(); ++i)
    if (std::holds_alternative<ContextParallelDirective>(program.directives[i])) return static_cast<int>(i);
  return -1;
}

}  // namespace

void run_context_parallel(PassRun& run, const ContextParallelDirective& d, int index) {
  apply_context_parallel(run.cx, d, index);
}

bool run_cp_groups(PassRun& run) {
  const int index = context_parallel_index(run.program);
  if (index < 0 ||
      std::get<ContextParallelDirective>(run.program.directives[static_cast<std::size_t>(index)]).degree <= 1)
    return false;
  make_cp_groups(run.cx, index);
  return true;
}

}  // namespace piper::core::passes
