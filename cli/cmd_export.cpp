// `piper export-chakra`: write a compiled plan as Chakra execution traces (one .et file per device)
// that ASTRA-sim replays; the logic is piper::chakra::export_traces.
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>

#include "cli/common.hpp"
#include "piper/chakra/export.hpp"
#include "piper/core/program.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/simulate.hpp"

namespace piper::cli {

namespace {

struct ExportArgs {
  std::string plan_path;
  std::string out_dir;
  std::string prefix = "piper";
  bool compute_times = false;
  std::string cluster = sim::kDefaultCluster;
  std::string calibration_path;
};

int run_export_chakra(const ExportArgs& a) {
  const auto shared = std::make_shared<const core::Program>(read_verified_plan(a.plan_path));
  const core::Program& program = *shared;
  chakra::ExportOptions options;
  options.prefix = a.prefix;
  std::optional<sim::CostModel> cost;
  // Devices sharing a GPU: each compute node's duration as simulated, per device and op.
  std::vector<std::unordered_map<const core::Op*, double>> simulated;
  bool shares_gpus = false;
  if (a.compute_times) {
    // The simulator's cost model (per-kernel, calibration, roofline: CostModel::compute_seconds) on
    // the cluster `piper simulate --cluster` would use, grown to the plan's devices.
    const sim::Cluster cluster = sim::with_devices(sim::load_cluster(a.cluster), program.num_devices);
    shares_gpus = cluster.shares_gpus();
    if (shares_gpus) {
      // Devices of one GPU split its compute among those computing at the moment (processor sharing,
      // docs/simulator.md), which a fixed time per op cannot say by itself: a node carries the time the
      // simulator (analytic engine) predicts for that op under the simulated step, as `piper simulate
      // --engine analytic --trace` shows it. A whole GPU's time would make a replay of 8 devices on one
      // GPU up to 8 times too fast.
      sim::SimulateOptions so;
      so.cluster = a.cluster;
      so.engine = "analytic";
      so.calibration_path = a.calibration_path;
      so.program_source = a.plan_path;
      const sim::SimulationResult r = sim::simulate_program(shared, so);
      simulated.resize(static_cast<std::size_t>(program.num_devices));
      for (int d = 0; d < program.num_devices; ++d)
        for (const core::OpSpan& s : r.timeline.devices.at(static_cast<std::size_t>(d)).spans)
          simulated[static_cast<std::size_t>(d)][&program.plan_for(d)
                                                      .streams.at(static_cast<std::size_t>(s.stream))
                                                      .ops.at(static_cast<std::size_t>(s.index))] = s.end_s - s.start_s;
      options.compute_seconds = [&](int device, const core::Op& op) {
        const auto& times = simulated.at(static_cast<std::size_t>(device));
        const auto it = times.find(&op);
        if (it == times.end())
          throw core::InternalError(
              fmt::format("export-chakra: device {}: op '{}' has no simulated time", device, op.label));
        return it->second;
      };
    } else {
      // The simulation above reads the calibration itself (SimulateOptions::calibration_path).
      std::optional<sim::Calibration> calibration;
      if (!a.calibration_path.empty()) calibration = sim::Calibration::load(a.calibration_path);
      cost.emplace(cluster, calibration);
      options.compute_seconds = [&](int device, const core::Op& op) {
        return cost->compute_seconds(program, device, op);
      };
    }
  }
  const std::vector<std::string> paths = chakra::export_traces(program, a.out_dir, options);
  fmt::print("{} Chakra traces ({} nodes) written to {}: {} .. {}, communicator groups in {}\n", paths.size(),
             program.total_ops(), a.out_dir, chakra::trace_file_name(a.prefix, 0),
             chakra::trace_file_name(a.prefix, program.num_devices - 1), chakra::comm_groups_file_name(a.prefix));
  if (a.compute_times && shares_gpus)
    fmt::print(
        "compute nodes carry duration_micros as simulated on cluster {} (analytic engine): its devices share "
        "GPUs, so an op's time depends on what the other devices of its GPU run beside it\n",
        a.cluster);
  else if (a.compute_times)
    fmt::print("compute nodes carry duration_micros from the cost model on cluster {}\n", a.cluster);
  return 0;
}

}  // namespace

Command add_export_chakra_command(CLI::App& app) {
  auto args = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand("export-chakra",
                                     "write a plan as Chakra execution traces (one .et file per device) for ASTRA-sim");
  cmd->add_option("plan", args->plan_path, "plan JSON written by `piper compile -o`")->required();
  cmd->add_option("-o,--output", args->out_dir, "folder for <prefix>.<device>.et (created if missing)")
      ->required()
      ->check(kOutputPath)
      ->check(kMakesItsFolder);
  cmd->add_option("--prefix", args->prefix, "file name prefix")->capture_default_str();
  CLI::Option* times =
      cmd->add_flag("--compute-times", args->compute_times,
                    "put the cost model's time of each compute op on its node (duration_micros), for replays "
                    "that take compute times from the trace");
  cmd->add_option("--cluster", args->cluster,
                  "with --compute-times: the cluster preset or spec JSON to cost compute ops on")
      ->capture_default_str()
      ->needs(times);
  cmd->add_option("--calibration", args->calibration_path,
                  "with --compute-times: measured op times (piper-calibration JSON) overriding the cost model")
      ->needs(times);
  return {cmd, [args] { return run_export_chakra(*args); }};
}

}  // namespace piper::cli
