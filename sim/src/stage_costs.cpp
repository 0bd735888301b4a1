// measure_stage_costs(): the cost model's view of each PP region, for cost-aware schedules (zb-auto).
#include "piper/sim/stage_costs.hpp"

#include <algorithm>
#include <optional>
#include <vector>

namespace piper::sim {

namespace {

int region_of(const core::Program& program, int segment) {
  if (segment < 0 || static_cast<std::size_t>(segment) >= program.segments.size()) return -1;
  const auto& tags = program.segments[static_cast<std::size_t>(segment)].tags;
  auto it = tags.find("PP");
  return it == tags.end() ? 0 : it->second;
}

}  // namespace

core::Scenario with_stage_costs(const core::Scenario& scenario, const std::string& cluster,
                                const std::string& calibration_path, const OpOverride& override) {
  if (!needs_stage_costs(scenario)) return scenario;
  core::Scenario probe = scenario;
  probe.strategy.zb_memory_limit = "1p";
  const core::CompiledScenario first = core::compile_scenario(probe);
  std::optional<Calibration> calibration;
  if (!calibration_path.empty()) calibration = Calibration::load(calibration_path);
  CostModel cost(with_devices(load_cluster(cluster), first.result.program.num_devices), calibration);
  if (override) cost.set_override(override);
  core::Scenario out = scenario;
  out.strategy.stage_costs = measure_stage_costs(first.result.program, cost);
  return out;
}

bool needs_stage_costs(const core::Scenario& scenario) {
  if (scenario.directives && !scenario.append_schedule) return false;
  return core::schedule_family(scenario.strategy.schedule).cost_aware && scenario.strategy.stage_costs.forward.empty();
}

core::StageCosts measure_stage_costs(const core::Program& program, const CostModel& cost) {
  int regions = 1;
  for (std::size_t s = 0; s < program.segments.size(); ++s)
    regions = std::max(regions, region_of(program, static_cast<int>(s)) + 1);
  const auto n = static_cast<std::size_t>(regions);
  core::StageCosts out;
  out.forward.assign(n, 0);
  out.input_grad.assign(n, 0);
  out.weight_grad.assign(n, 0);
  out.activation_bytes.assign(n, 0);
  for (int d = 0; d < program.num_devices; ++d) {
    const int plan_index = program.plan_of_device.at(static_cast<std::size_t>(d));
    if (plan_index < 0) continue;
    const core::Plan& plan = program.plans.at(static_cast<std::size_t>(plan_index));
    std::vector<double> f(n, 0), bi(n, 0), bw(n, 0), act(n, 0);
    for (const auto& stream : plan.streams)
      for (const auto& op : stream.ops) {
        if (op.microbatch != 0) continue;
        if (op.kind == core::OpKind::Send) {
          out.transfer = std::max(out.transfer, cost.transfer_seconds(op, d, program.peer_of(op, d)));
          continue;
        }
        const int r = region_of(program, op.segment);
        if (op.kind != core::OpKind::Compute || r < 0) continue;
        const double t = cost.compute_seconds(program, d, op);
        const auto k = static_cast<std::size_t>(r);
        if (op.pass == core::Pass::F) f[k] += t;
        if (op.pass == core::Pass::BI || op.pass == core::Pass::B) bi[k] += t;
        if (op.pass == core::Pass::BW) bw[k] += t;
      }
    for (const auto& buffer : plan.buffers) {
      if (buffer.kind != core::BufferKind::Activations || buffer.persistent()) continue;
      const core::Op& op = plan.streams.at(static_cast<std::size_t>(buffer.alloc.stream))
                               .ops.at(static_cast<std::size_t>(buffer.alloc.index));
      const int r = region_of(program, op.segment);
      if (op.microbatch == 0 && op.kind == core::OpKind::Compute && op.pass == core::Pass::F && r >= 0)
        act[static_cast<std::size_t>(r)] += static_cast<double>(buffer.bytes);
    }
    for (std::size_t k = 0; k < n; ++k) {
      out.forward[k] = std::max(out.forward[k], f[k]);
      out.input_grad[k] = std::max(out.input_grad[k], bi[k]);
      out.weight_grad[k] = std::max(out.weight_grad[k], bw[k]);
      out.activation_bytes[k] = std::max(out.activation_bytes[k], act[k]);
    }
  }
  return out;
}

}  // namespace piper::sim
