// `piper export-chakra`: write a compiled plan as Chakra execution traces (one .et file per device)
// that ASTRA-sim replays; the logic is piper::chakra::export_traces.
#include <fmt/format.h>

#include "cli/common.hpp"
#include "piper/chakra/export.hpp"
#include "piper/core/program.hpp"
#include "piper/core/verifier.hpp"

namespace piper::cli {

namespace {

struct ExportArgs {
  std::string plan_path;
  std::string out_dir;
  std::string prefix = "piper";
};

int run_export_chakra(const ExportArgs& a) {
  json j = read_json_file(a.plan_path);
  core::Program program;
  try {
    program = core::Program::from_json(j);
    core::verify_or_throw(program);
  } catch (const core::Error& e) {
    throw CliError(a.plan_path, e.what());
  }
  const std::vector<std::string> paths = chakra::export_traces(program, a.out_dir, a.prefix);
  fmt::print("{} Chakra traces ({} nodes) written to {}: {} .. {}\n", paths.size(), program.total_ops(), a.out_dir,
             chakra::trace_file_name(a.prefix, 0), chakra::trace_file_name(a.prefix, program.num_devices - 1));
  return 0;
}

}  // namespace

Command add_export_chakra_command(CLI::App& app) {
  auto args = std::make_shared<ExportArgs>();
  CLI::App* cmd = app.add_subcommand("export-chakra", "write a plan as Chakra execution traces (one .et file per device) for ASTRA-sim");
  cmd->add_option("plan", args->plan_path, "plan JSON written by `piper compile -o`")->required();
  cmd->add_option("-o,--output", args->out_dir, "folder for <prefix>.<device>.et (created if missing)")->required()->check(kOutputPath);
  cmd->add_option("--prefix", args->prefix, "file name prefix")->capture_default_str();
  return {cmd, [args] { return run_export_chakra(*args); }};
}

}  // namespace piper::cli
