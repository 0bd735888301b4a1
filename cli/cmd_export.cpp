// `piper export-chakra`: write a compiled plan as Chakra execution traces (one .et file per device)
// that ASTRA-sim replays; the logic is piper::chakra::export_traces.
#include <optional>

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
  const core::Program program = read_verified_plan(a.plan_path);
  chakra::ExportOptions options;
  options.prefix = a.prefix;
  std::optional<sim::CostModel> cost;
  if (a.compute_times) {
    // The simulator's cost model (per-kernel, calibration, roofline: CostModel::compute_seconds) on
    // the cluster `piper simulate --cluster` would use, grown to the plan's devices.
    std::optional<sim::Calibration> calibration;
    if (!a.calibration_path.empty()) calibration = sim::Calibration::load(a.calibration_path);
    cost.emplace(sim::with_devices(sim::load_cluster(a.cluster), program.num_devices), calibration);
    options.compute_seconds = [&](int device, const core::Op& op) {
      return cost->compute_seconds(program, device, op);
    };
  }
  const std::vector<std::string> paths = chakra::export_traces(program, a.out_dir, options);
  fmt::print("{} Chakra traces ({} nodes) written to {}: {} .. {}, communicator groups in {}\n", paths.size(),
             program.total_ops(), a.out_dir, chakra::trace_file_name(a.prefix, 0),
             chakra::trace_file_name(a.prefix, program.num_devices - 1), chakra::comm_groups_file_name(a.prefix));
  if (a.compute_times) fmt::print("compute nodes carry duration_micros from the cost model on cluster {}\n", a.cluster);
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
