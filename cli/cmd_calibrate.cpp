// `piper calibrate`: turns measured times of a run (a piper-calibration file from `piper run
// --calibrate`, or a Chrome trace of GPU kernels) into a calibrated kernel table for the cost model;
// the logic is piper::sim's table_calibration.hpp.
#include <algorithm>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/common.hpp"
#include "piper/core/limits.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/sim/table_calibration.hpp"

namespace piper::cli {

namespace {

struct CalibrateArgs {
  ScenarioFlags scenario;
  std::string plan_path;
  std::string cluster = piper::sim::kDefaultCluster;
  std::string calibration_path;
  std::string trace_path;
  int trace_steps = 1;
  int device = 0;
  std::string output;
  std::string cluster_output;
  std::string name;
  CLI::Option* model = nullptr;
};

std::shared_ptr<const core::Program> measured_program(const CalibrateArgs& a) {
  if (!a.plan_path.empty()) {
    a.scenario.reject_beside_plan();
    return std::make_shared<const core::Program>(read_verified_plan(a.plan_path));
  }
  if (a.model->count() == 0)
    throw CliError("", "--model is required (or give --plan): the plan the measurements come from");
  core::CompiledScenario compiled = core::compile_scenario(a.scenario.scenario());
  return std::make_shared<const core::Program>(std::move(compiled.result.program));
}

// The measured cluster's spec with the calibrated table on its GPUs: the preset, or the spec (a file's
// JSON, or given inline) with "kernel_table" set on the node and on every override that names a GPU.
// A derived spec ({"cluster": base, "runtime", ...}) becomes its base's, calibrated, with its runtime
// settings: a derived spec has no node to take a table (it was written with one, and refused).
json calibrated_cluster(const std::string& cluster, const std::string& table) {
  namespace fs = std::filesystem;
  const std::vector<std::string> presets = sim::cluster_presets();
  const bool preset = std::find(presets.begin(), presets.end(), cluster) != presets.end();
  const bool given_inline = sim::is_inline_cluster_spec(cluster);
  json spec = preset ? json{{"preset", cluster}} : given_inline ? json::parse(cluster) : read_json_file(cluster);
  if (spec.contains("cluster") && spec.at("cluster").is_string()) {
    json out = calibrated_cluster(
        sim::cluster_named_in(spec.at("cluster").get<std::string>(), given_inline ? std::string() : cluster), table);
    for (const char* key : {"runtime", "attention_kernel"})
      if (spec.contains(key)) out[key] = spec.at(key);
    if (spec.contains("name")) out["name"] = spec.at("name").get<std::string>() + "-calibrated";
    return out;
  }
  auto set_table = [&](json& node) {
    json& gpu = node["gpu"];
    if (gpu.is_string()) gpu = json{{"preset", gpu.get<std::string>()}};
    gpu["kernel_table"] = table;
  };
  spec["name"] = spec.value("name", given_inline ? spec.value("preset", std::string("cluster"))
                                                 : fs::path(cluster).stem().string()) +
                 "-calibrated";
  set_table(spec["node"]);
  if (spec.contains("overrides") && spec.at("overrides").is_array())
    for (json& o : spec.at("overrides"))
      if (o.is_object() && o.contains("gpu")) set_table(o);
  return spec;
}

int run_calibrate(const CalibrateArgs& a) {
  if (a.calibration_path.empty() == a.trace_path.empty())
    throw CliError(
        "", "give exactly one of --calibration (op times from `piper run --calibrate`) and --trace (a kernel trace)");
  const auto program = measured_program(a);
  const sim::Cluster cluster = sim::with_devices(sim::load_cluster(a.cluster), program->num_devices);
  const int device = a.device;
  if (device < 0 || device >= program->num_devices)
    throw CliError("", fmt::format("--device {}: the plan has devices 0..{}", device, program->num_devices - 1));
  const std::string base = cluster.gpu(device).kernel_table;
  if (base.empty())
    throw CliError(
        "",
        fmt::format(
            "--cluster '{}': GPU '{}' has no kernel table to calibrate (give one: \"gpu\": {{\"kernel_table\": …}})",
            a.cluster, cluster.gpu(device).name));
  // The written table is {"base": <this table>, scales}, and a table's base is a built-in table: a
  // file here (a calibrated cluster's own table, or kernels.py's) wrote a table no reader takes.
  if (const auto names = sim::kernel_table_names(); std::find(names.begin(), names.end(), base) == names.end())
    throw CliError("", fmt::format("--cluster '{}': GPU '{}' takes its kernel table from the file '{}', and a "
                                   "calibrated table derives from a built-in table ({}): calibrate against the "
                                   "cluster that names one (the uncalibrated cluster)",
                                   a.cluster, cluster.gpu(device).name, base, fmt::join(names, ", ")));
  sim::CostModel cost(cluster);
  sim::TableCalibration c;
  std::string source;
  if (!a.calibration_path.empty()) {
    const sim::Calibration measured = sim::Calibration::load(a.calibration_path);  // its errors name the file
    c = sim::calibrate_from_ops(*program, cost, measured, a.calibration_path);
    source = "op times " + a.calibration_path;
  } else {
    c = sim::calibrate_from_trace(*program, cost, read_json_file(a.trace_path), a.trace_steps, device, a.trace_path);
    source = fmt::format("kernel trace {} ({} steps)", a.trace_path, a.trace_steps);
  }
  c.base = base;
  const std::string name = a.name.empty() ? base + "-calibrated" : a.name;
  // The calibrated cluster is made before anything is written: a spec it cannot be made from leaves no table.
  std::string cluster_text;
  if (!a.cluster_output.empty()) {
    // The table as a path relative to the cluster file's folder (the spec's rule for table files), so the
    // cluster reads the same table from any working directory.
    namespace fs = std::filesystem;
    const std::string table = fs::absolute(a.output)
                                  .lexically_normal()
                                  .lexically_relative(fs::absolute(a.cluster_output).lexically_normal().parent_path())
                                  .string();
    cluster_text = calibrated_cluster(a.cluster, table).dump(1) + "\n";
  }
  core::write_file_atomically(a.output, c.table_json(name, source).dump(1) + "\n");
  fmt::print("calibrated {} against {} ({} observations)\n", base, source, c.observations.size());
  fmt::print("{:<10} {:>10}   (measured time / {} time)\n", "class", "multiplier", base);
  for (int k = 0; k < sim::kKernelClasses; ++k) {
    const auto i = static_cast<std::size_t>(k);
    fmt::print(
        "{:<10} {:>10}{}\n", sim::to_string(static_cast<sim::KernelClass>(k)),
        c.observed[i] ? fmt::format("{:.3f}", c.multiplier[i]) : std::string("(not seen)"),
        c.at_bound[i]
            ? "   at the lower bound: these times do not separate it from the other classes (a kernel trace does)"
            : "");
  }
  fmt::print("{:<44} {:>11} {:>11} {:>11}\n", "observation", "measured ms", "base ms", "fitted ms");
  for (const auto& o : c.observations) {
    double base_s = o.fixed_s, fitted = o.fixed_s;
    for (int k = 0; k < sim::kKernelClasses; ++k) {
      base_s += o.predicted[static_cast<std::size_t>(k)];
      fitted += o.predicted[static_cast<std::size_t>(k)] * c.multiplier[static_cast<std::size_t>(k)];
    }
    fmt::print("{:<44} {:>11.3f} {:>11.3f} {:>11.3f}\n", o.what.substr(0, 44), o.measured_s * 1e3, base_s * 1e3,
               fitted * 1e3);
  }
  fmt::print("table written to {}\n", a.output);
  if (!a.cluster_output.empty()) {
    core::write_file_atomically(a.cluster_output, cluster_text);
    fmt::print("cluster written to {}\n", a.cluster_output);
  }
  // --save-scenario: the measured plan's inputs on the measured cluster (the option was taken and
  // nothing was written). Beside --plan it is refused with the other compile inputs.
  if (!a.scenario.save_scenario_path.empty()) {
    core::Scenario s = a.scenario.scenario();
    s.cluster = a.cluster;
    a.scenario.save_if_requested(s);
  }
  return 0;
}

}  // namespace

Command add_calibrate_command(CLI::App& app) {
  auto args = std::make_shared<CalibrateArgs>();
  CLI::App* cmd =
      app.add_subcommand("calibrate", "fit a kernel efficiency table to measured times (op times or a kernel trace)");
  args->scenario.add_to(cmd);
  args->model = cmd->get_option("--model");
  args->model->required(false);
  cmd->add_option("--plan", args->plan_path,
                  "the plan that was measured (from `piper compile -o`) instead of compiling")
      ->excludes(args->model);
  cmd->add_option("--cluster", args->cluster,
                  "cluster preset or spec JSON of the measured GPU (its kernel table is the base)")
      ->capture_default_str();
  cmd->add_option("--calibration", args->calibration_path, "op times measured by `piper run --calibrate`");
  auto* trace =
      cmd->add_option("--trace", args->trace_path, "Chrome trace of GPU kernels (the PyTorch profiler's export)");
  // Op times are per step already: beside --calibration the count was ignored.
  cmd->add_option("--trace-steps", args->trace_steps, "training steps the trace covers")
      ->check(kPositiveInt)
      ->capture_default_str()
      ->needs(trace);
  cmd->add_option("--device", args->device, "the plan's device the trace or times were measured on")
      ->check(kNonNegativeInt)
      ->capture_default_str();
  cmd->add_option("-o,--output", args->output, "write the calibrated kernel table here")
      ->required()
      ->check(kOutputPath);
  cmd->add_option("--cluster-output", args->cluster_output, "also write a cluster spec that uses the table")
      ->check(kOutputPath);
  cmd->add_option("--name", args->name, "the table's name (default: <base>-calibrated)")
      ->check(CLI::Validator(
          [](std::string& value) -> std::string {
            // Printed in reports and --kernels headers: a newline split them.
            return core::plain_text(value) ? std::string()
                                           : "'" + core::printable_text(value, 80) +
                                                 "': control or bidirectional-override characters are not allowed";
          },
          "NAME"));
  return {cmd, [args] { return run_calibrate(*args); }};
}

}  // namespace piper::cli
