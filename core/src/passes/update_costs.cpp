// The update-costs pass (internal): the optimizer step's costs, once sharding is known.
#include "pass.hpp"

#include <vector>

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

}  // namespace

bool run_update_costs(PassRun& run) {
  cost_updates(run.cx);
  return true;
}

}  // namespace piper::core::passes
