// `piper simulate`: compile a scenario (or read a plan), simulate one training step on a cluster,
// print the report, and optionally write report JSON and a Chrome trace.
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "cli/common.hpp"
#include "cli/runtime_flags.hpp"
#include "piper/sim/recompute_policy.hpp"
#include "piper/sim/simulate.hpp"

namespace piper::cli {

namespace {

struct SimulateArgs {
  ScenarioFlags scenario;
  RuntimeFlags runtime;
  std::string plan_path;
  std::string cluster = piper::sim::kDefaultCluster;
  std::string engine = piper::sim::kDefaultEngine;
  std::string calibration_path;
  std::string report_path;
  std::string trace_path;
  double memory_budget_gib = 0;  // --recompute auto: the budget the chosen policy's peak fits
  int max_devices = 16;
  int kernels_device = -1;  // --kernels D: print device D's per-kernel breakdown
  bool no_symmetry = false;
  CLI::Option* plan = nullptr;
  CLI::Option* cluster_option = nullptr;
  CLI::Option* engine_option = nullptr;
  CLI::Option* memory_budget = nullptr;
};

int run_simulate(const SimulateArgs& a) {
  sim::SimulateOptions options;
  options.cluster = a.runtime.applied_to(a.cluster);
  options.engine = a.engine;
  options.calibration_path = a.calibration_path;
  options.symmetry = !a.no_symmetry;
  sim::SimulationResult result;
  if (!a.plan_path.empty()) {
    a.scenario.reject_beside_plan();
    if (a.memory_budget->count() > 0)
      throw CliError("", "--memory-budget cannot be used with --plan: the plan already fixes its recomputation");
    options.program_source = a.plan_path;
    result = sim::simulate_program(std::make_shared<const core::Program>(read_verified_plan(a.plan_path)), options);
  } else {
    if (a.scenario.model.empty() && a.scenario.scenario_path.empty())
      throw CliError("", "--model is required (or give --plan or --scenario)");
    core::Scenario scenario = a.scenario.scenario();
    // A scenario file's cluster and engine apply unless the flags name others.
    if (a.cluster_option->count() == 0 && !scenario.cluster.empty())
      options.cluster = a.runtime.given() ? a.runtime.applied_to(scenario.cluster) : std::string();
    if (a.engine_option->count() == 0 && !scenario.engine.empty()) options.engine.clear();
    const bool automatic = scenario.strategy.recompute == "auto";
    if (automatic != (a.memory_budget->count() > 0))
      throw CliError(
          "", automatic ? "--recompute auto needs --memory-budget GiB (the peak memory per device the policy must fit)"
                        : "--memory-budget applies only with --recompute auto");
    if (automatic) {
      if (scenario.strategy.recompute_every > 0 || scenario.strategy.recompute_first > 0)
        throw CliError("", "--recompute auto chooses the blocks itself: drop --recompute-every/--recompute-first");
      const sim::RecomputeChoice choice = sim::choose_recompute(scenario, a.memory_budget_gib, options);
      fmt::print("{}\n", choice.summary());
      scenario.strategy.recompute = choice.chosen.policy.recompute;
      scenario.strategy.recompute_every = choice.chosen.policy.every;
    }
    result = sim::simulate(scenario, options);
    if (!options.cluster.empty()) scenario.cluster = options.cluster;
    if (!options.engine.empty()) scenario.engine = options.engine;
    a.scenario.save_if_requested(scenario);
  }
  // --kernels before any file is written: a device outside the plan is refused with nothing written.
  std::string kernels;
  if (a.kernels_device >= 0) {
    std::optional<sim::Calibration> calibration;
    if (!a.calibration_path.empty()) calibration = sim::Calibration::load(a.calibration_path);
    kernels = sim::kernel_breakdown(*result.program, sim::CostModel(result.cluster, calibration), a.kernels_device);
  }
  // Files are written whole (temporary file, then rename) so an interrupted run leaves nothing half-written.
  if (!a.report_path.empty()) core::write_file_atomically(a.report_path, result.report.to_json().dump(1) + "\n");
  if (!a.trace_path.empty()) {
    std::ostringstream trace;
    core::write_chrome_trace(result.timeline, trace);
    core::write_file_atomically(a.trace_path, trace.str());
  }
  fmt::print("{}", result.report.to_text(a.max_devices));
  if (!kernels.empty()) fmt::print("\n{}", kernels);
  if (!a.report_path.empty()) fmt::print("report written to {}\n", a.report_path);
  if (!a.trace_path.empty()) fmt::print("trace written to {} (open in https://ui.perfetto.dev)\n", a.trace_path);
  return 0;
}

}  // namespace

Command add_simulate_command(CLI::App& app) {
  auto args = std::make_shared<SimulateArgs>();
  CLI::App* cmd =
      app.add_subcommand("simulate", "simulate one training step: step time, bubbles, memory, critical path");
  args->scenario.add_to(cmd);
  CLI::Option* scenario_file = args->scenario.add_file_option(
      cmd,
      "simulate a scenario file (piper-studio's, --save-scenario's): its model, strategy, cluster and engine "
      "(--cluster and --engine win over the last two)");
  args->plan =
      cmd->add_option("--plan", args->plan_path, "simulate this plan (from `piper compile -o`) instead of compiling");
  args->plan->excludes(cmd->get_option("--model"))->excludes(scenario_file);
  args->cluster_option = cmd->add_option("--cluster", args->cluster,
                                         "cluster preset (dgx-a100-80g, dgx-h100, dgx-h200, hgx-h800) or spec JSON; "
                                         "nodes are added to fit the program")
                             ->capture_default_str();
  args->runtime.add_to(cmd);
  args->engine_option =
      cmd->add_option("--engine", args->engine,
                      "simulation engine: simgrid (flow-level network) or analytic (fast, no contention)")
          ->capture_default_str();
  args->memory_budget =
      cmd->add_option("--memory-budget", args->memory_budget_gib,
                      "with --recompute auto: peak memory per device (GiB) the chosen policy must fit")
          ->check(kPositiveNumber);
  cmd->add_option("--calibration", args->calibration_path,
                  "measured op times (piper-calibration JSON) overriding the cost model");
  cmd->add_option("--report", args->report_path, "write the report as JSON here")->check(kOutputPath);
  cmd->add_option("--trace", args->trace_path, "write a Chrome trace (Perfetto) here")->check(kOutputPath);
  cmd->add_flag("--no-symmetry", args->no_symmetry,
                "simulate every device, even where symmetric devices could be simulated once (same result, slower)");
  cmd->add_option("--kernels", args->kernels_device,
                  "also print the kernels device D runs per microbatch: shapes, FLOPs, bytes, time and achieved "
                  "rate of each, as the cost model times them")
      ->check(kNonNegativeInt);
  // Negative counts printed "... (3 more devices)" under a 2-device table.
  cmd->add_option("--show-devices", args->max_devices, "devices listed in the printed table")
      ->check(kNonNegativeInt)
      ->capture_default_str();
  return {cmd, [args] { return run_simulate(*args); }};
}

}  // namespace piper::cli
