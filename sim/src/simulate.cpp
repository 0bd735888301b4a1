// simulate(): scenario or Program + cluster + engine -> Timeline and Report, for the CLI, GUI and sweeps.
#include "piper/sim/simulate.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"
#include "piper/sim/stage_costs.hpp"

namespace piper::sim {

namespace {

// An SM partition the cluster's GPUs cannot take (no sm_count, or no SM left for compute), refused
// before anything is simulated, in one line naming what asked for it (`origin`: the flag, the
// directive or the plan) and the cluster (as given: the preset or file). compute_rates makes the same
// check, but knows neither.
void check_sm_partition(const core::Program& program, const Cluster& cluster, const std::string& cluster_given,
                        const std::string& origin) {
  if (!program.sm_partition) return;
  for (const auto& node : cluster.nodes)
    if (const std::string why = sm_partition_misfit(program.sm_partition->sms, node.gpu, cluster_given); !why.empty())
      throw ClusterError(fmt::format("{}: {}", origin, why));
}

SimulationResult run(SimulationResult out, const Cluster& cluster, const std::string& engine_name,
                     const SimulateOptions& options) {
  // Every device runs its plan's ops; refuse a simulation too large to finish before starting it.
  std::int64_t instances = 0;
  for (const int plan : out.program->plan_of_device)
    if (plan >= 0 && static_cast<std::size_t>(plan) < out.program->plans.size())
      instances += out.program->plans[static_cast<std::size_t>(plan)].op_count();
  core::check_limit(core::Limit::SimulatedOps, instances, "simulation", "op instances");
  out.cluster = with_devices(cluster, out.program->num_devices);
  std::optional<Calibration> calibration;
  if (!options.calibration_path.empty()) calibration = Calibration::load(options.calibration_path);
  CostModel cost(out.cluster, calibration);
  if (options.op_override) cost.set_override(options.op_override);
  std::unique_ptr<Engine> engine = make_engine(engine_name);
  const auto t0 = std::chrono::steady_clock::now();
  std::string mode;
  std::optional<Symmetry> symmetry;
  if (!options.symmetry) {
    mode = "full: symmetry off (--no-symmetry)";
  } else if (!engine->supports_symmetry()) {
    mode = fmt::format("full: the {} engine models link contention, which couples symmetric devices", engine_name);
  } else {
    symmetry = find_symmetry(*out.program, out.cluster);
    mode = (symmetry->reduces() ? "reduced: " : "full: ") + symmetry->note;
    if (!symmetry->reduces()) symmetry.reset();
  }
  out.timeline = symmetry ? engine->run_reduced(out.program, out.cluster, cost, *symmetry)
                          : engine->run(out.program, out.cluster, cost);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.report =
      make_report(out.timeline, out.cluster, compile_stats_of(*out.program), symmetry ? &*symmetry : nullptr, &cost);
  // A result is a number of seconds or nothing: inf (no NICs between nodes, a 1e308 calibration
  // entry) used to print and exit 0.
  if (!std::isfinite(out.report.step_time_s) || out.report.step_time_s < 0)
    throw core::Error(
        fmt::format("simulation: predicted step time is {} seconds, not a finite time; an input (cluster '{}'{}) "
                    "holds an out-of-range value",
                    out.report.step_time_s, out.cluster.name,
                    options.calibration_path.empty() ? "" : ", calibration " + options.calibration_path));
  out.report.simulate_time_s = seconds;
  out.report.simulation = mode;
  return out;
}

}  // namespace

// --v-head / --v-embedding auto (core::v_end_choices): every choice simulated on the analytic engine,
// the fastest kept (the earlier one on a tie: in the V first). A choice the model cannot take (too few
// blocks) is skipped.
core::Scenario choose_v_ends(const core::Scenario& scenario, const std::string& cluster) {
  if (scenario.directives || (scenario.strategy.v_head != "auto" && scenario.strategy.v_embedding != "auto"))
    return scenario;
  core::Scenario best = scenario;
  double best_step = -1;
  SimulateOptions quick;
  quick.cluster = cluster;
  quick.engine = "analytic";
  for (const auto& choice : core::v_end_choices(scenario.strategy)) {
    core::Scenario trial = scenario;
    trial.strategy = choice;
    double step = 0;
    try {
      step = simulate(trial, quick).report.step_time_s;
    } catch (const core::Error&) {
      continue;
    }
    if (best_step < 0 || step < best_step * (1 - 1e-9)) best = trial, best_step = step;
  }
  if (best_step < 0) return core::Scenario(scenario);  // let the compiler say why (core::resolve_v_ends)
  return best;
}

namespace {

// A scenario's "engine", named as its file's field (a misspelt one was reported as "--engine
// 'analytc'", a flag the user did not give).
void check_scenario_engine(const core::Scenario& s) {
  if (const auto names = engine_names();
      !s.engine.empty() && std::find(names.begin(), names.end(), s.engine) == names.end())
    throw core::Error(fmt::format("{}: field 'engine': unknown engine '{}' (expected one of: {})",
                                  s.source.empty() ? "scenario" : s.source, s.engine, fmt::join(names, ", ")));
}

}  // namespace

void check_scenario_cluster_and_engine(const core::Scenario& s) {
  if (!s.cluster.empty())
    (void)load_cluster(s.cluster, (s.source.empty() ? "scenario" : s.source) + ": field 'cluster':");
  check_scenario_engine(s);
}

SimulationResult simulate(const core::Scenario& requested, const SimulateOptions& options) {
  // The options' cluster (--cluster), else the scenario's, else the default; loaded first, so that a
  // bad name is reported as given, the flag or the scenario's field.
  const bool scenario_cluster = options.cluster.empty() && !requested.cluster.empty();
  const std::string cluster = !options.cluster.empty() ? options.cluster
                              : scenario_cluster       ? requested.cluster
                                                       : kDefaultCluster;
  const Cluster loaded = load_cluster(
      cluster, scenario_cluster ? (requested.source.empty() ? "scenario" : requested.source) + ": field 'cluster':"
                                : "--cluster");
  // The engine likewise, before compiling.
  if (options.engine.empty()) check_scenario_engine(requested);
  const core::Scenario scenario = choose_v_ends(requested, cluster);
  SimulationResult out;
  out.compiled =
      core::compile_scenario(with_stage_costs(scenario, cluster, options.calibration_path, options.op_override));
  out.program = std::make_shared<const core::Program>(std::move(out.compiled->result.program));
  if (out.program->sm_partition) {
    // What asked for the partition: a directive of the scenario's program, or --comm-sms (the
    // scenario file's strategy.comm_sms) that generated it.
    std::string origin;
    const auto& directives = out.compiled->program.directives;
    for (std::size_t i = 0; i < directives.size() && origin.empty(); ++i)
      if (std::holds_alternative<core::SmPartitionDirective>(directives[i]) && scenario.directives)
        origin =
            fmt::format("{}: directive {} field 'sms'",
                        scenario.directives_source.empty() ? std::string("directives") : scenario.directives_source, i);
    if (origin.empty())
      origin = scenario.source.empty() ? fmt::format("--comm-sms {}", scenario.strategy.comm_sms)
                                       : scenario.source + ": field 'strategy.comm_sms'";
    check_sm_partition(*out.program, with_devices(loaded, out.program->num_devices), cluster, origin);
  }
  const std::string engine = !options.engine.empty()    ? options.engine
                             : !scenario.engine.empty() ? scenario.engine
                                                        : kDefaultEngine;
  return run(std::move(out), loaded, engine, options);
}

SimulationResult simulate_program(std::shared_ptr<const core::Program> program, const SimulateOptions& options) {
  SimulationResult out;
  out.program = std::move(program);
  const std::string cluster = options.cluster.empty() ? kDefaultCluster : options.cluster;
  const Cluster loaded = load_cluster(cluster);
  check_sm_partition(
      *out.program, with_devices(loaded, out.program->num_devices), cluster,
      (options.program_source.empty() ? std::string("plan") : options.program_source) + ": field 'sm_partition.sms'");
  return run(std::move(out), loaded, options.engine.empty() ? kDefaultEngine : options.engine, options);
}

}  // namespace piper::sim
