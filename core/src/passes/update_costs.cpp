// The update-costs pass (internal): the optimizer step's costs, once sharding is known.
#include "pass.hpp"

#include <vector>

#include <fmt/format.h>

namespace piper::core::passes {

namespace {

// UPD costs once sharding is known: AdamW reads/writes parameters, gradients and the optimizer
// states of this device's shard (ZeRO: Rajbhandari et al. 2020, 2 + 2 + 12 bytes per parameter in
// mixed precision), at about 10 FLOPs per parameter. The step also reads every gradient once for
// the global gradient norm (clipping: Megatron-LM's default --clip-grad 1.0, GPT-3, Llama) and
// zeroes the gradient buffer for the next step: two more passes of dt bytes per parameter.
void cost_updates(PassContext& cx) {
  auto& dag = cx.dag;
  const int dt = bytes_per_element(dag.training.precision);
  const int state = fp32_storage(dag.training.precision) ? 8 : 12;
  for (auto v : dag.live_nodes()) {
    auto& n = cx.node(v);
    if (n.kind != NodeKind::Update) continue;
    std::int64_t params = 0;
    for (int s : n.buffer_segments) {
      const auto& seg = dag.segments.at(static_cast<std::size_t>(s));
      params += Segment::shard_elems(seg.state_params(), seg.zero_divisor(1));
    }
    n.costs = Costs{};
    n.costs.params = params;
    n.costs.forward_flops = 10.0 * static_cast<double>(params);
    if (dag.training.fp32_main_grads && !fp32_storage(dag.training.precision)) {
      // Megatron-LM's Float16OptimizerWithFloat16Params (megatron/optimizer/optimizer.py): the
      // gradient norm reads the fp32 main_grad (4), Adam reads it (4) and reads and writes the fp32
      // main parameter and both moments (2 x 12), _copy_main_params_to_model_params reads the main
      // parameter (4) and writes the model parameter (dt), and the main_grad buffer is zeroed (4).
      n.costs.forward_memory_bytes = params * (4 + 4 + 2 * state + 4 + dt + 4);
    } else {
      n.costs.forward_memory_bytes = params * (2 * dt + 2 * state + 2 * dt);
    }
  }
}

// A segment with parameters on more devices than its TP group x expert shard holds copies of them that
// only a replicate directive keeps in step (its gradient reduction); without one each copy would
// follow its own share of the batch. Checked once every replicate directive has run.
void check_copies_reduced(PassRun& run) {
  auto& dag = run.cx.dag;
  std::vector<char> seen(dag.segments.size(), 0);
  for (auto v : dag.live_nodes()) {
    const auto& n = run.cx.node(v);
    if (n.kind != NodeKind::Compute || n.segment < 0 || n.devices == kNoDevices) continue;
    const auto s = static_cast<std::size_t>(n.segment);
    if (seen.at(s) || run.cx.replicated.at(s)) continue;
    seen[s] = 1;
    const auto& seg = dag.segments.at(s);
    const auto& devices = dag.device_sets.at(n.devices);
    const auto copies = static_cast<int>(devices.size()) / (seg.tp_degree * seg.shard_degree);
    if (!seg.has_state() || copies <= 1) continue;
    const int by = v < run.placed_by.size() ? run.placed_by[v] : -1;
    fail(by, "devices",
         fmt::format("'{}' is placed on {} devices {}, {} copies of its parameters, but no replicate directive "
                     "selects it: the copies would train apart (their gradients never reduced); replicate it over "
                     "the same devices",
                     n.label, devices.size(), set_str(devices), copies));
  }
}

}  // namespace

bool run_update_costs(PassRun& run) {
  check_copies_reduced(run);
  cost_updates(run.cx);
  return true;
}

}  // namespace piper::core::passes
