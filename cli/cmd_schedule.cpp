// `piper schedule`: list the schedule families, show one as a unit-time rank x time grid computed
// from its compiled program, and exchange schedules with PyTorch as compute-only CSV.
#include <fmt/format.h>

#include <algorithm>

#include "cli/common.hpp"
#include "piper/core/pytorch_csv.hpp"
#include "piper/core/schedule_view.hpp"

namespace piper::cli {

namespace {

struct ScheduleArgs {
  std::string name;
  int ranks = 4, microbatches = 8, virtual_stages = 1;
  std::string zb_memory_limit = "1p";
  std::vector<int> costs;
  std::string directives_path, csv_path, out_path;
  int dp = 1;
};

core::StrategyOptions options_of(const ScheduleArgs& a) {
  core::StrategyOptions o;
  o.schedule = a.name;
  o.pp = a.ranks;
  o.microbatches = a.microbatches;
  o.virtual_stages = a.virtual_stages;
  o.zb_memory_limit = a.zb_memory_limit;
  return o;
}

void write_or_print(const std::string& path, const std::string& text) {
  if (path.empty() || path == "-")
    fmt::print("{}", text);
  else
    core::write_file_atomically(path, text);
}

void add_shape(CLI::App* app, ScheduleArgs& a) {
  app->add_option("--ranks", a.ranks, "pipeline ranks")->check(kPositiveInt);
  app->add_option("--microbatches", a.microbatches, "microbatches per step")->check(kPositiveInt);
  app->add_option("--virtual", a.virtual_stages, "model chunks per rank (interleaved, looped-bfs, zb-h1)")
      ->check(kPositiveInt);
  app->add_option("--zb-memory-limit", a.zb_memory_limit, "zb-auto: activation memory limit, 1p, 2p or <k>p");
}

std::vector<std::string> family_names() {
  std::vector<std::string> names;
  for (const auto& f : core::schedule_registry()) names.push_back(f.name);
  return names;
}

}  // namespace

Command add_schedule_command(CLI::App& app) {
  auto args = std::make_shared<ScheduleArgs>();
  CLI::App* cmd = app.add_subcommand("schedule", "pipeline schedule families: list, show, PyTorch CSV export/import");
  cmd->require_subcommand(1);
  CLI::App* list = cmd->add_subcommand("list", "list the schedule families and their constraints");
  CLI::App* show =
      cmd->add_subcommand("show", "rank x time grid of a schedule with unit costs, bubbles, peak activations");
  show->add_option("name", args->name, "schedule family")->required()->check(CLI::IsMember(family_names()));
  add_shape(show, *args);
  show->add_option("--costs", args->costs, "unit costs F,B,W (BI = B-W, BW = W); default 1,2,1")
      ->delimiter(',')
      ->expected(3)
      ->check(kPositiveInt);
  CLI::App* exp = cmd->add_subcommand("export-csv", "write a schedule as PyTorch compute-only CSV");
  exp->add_option("name", args->name, "schedule family")->check(CLI::IsMember(family_names()));
  add_shape(exp, *args);
  exp->add_option("--directives", args->directives_path, "read the schedule from a directive program instead");
  exp->add_option("-o,--out", args->out_path, "output file (default: stdout)")->check(kOutputPath);
  CLI::App* imp = cmd->add_subcommand("import-csv", "turn a PyTorch compute-only CSV into a directive program");
  imp->add_option("file", args->csv_path, "CSV file, one row per rank")->required();
  imp->add_option("--dp", args->dp, "data-parallel replicas of each pipeline rank")->check(kPositiveInt);
  imp->add_option("-o,--out", args->out_path, "output file (default: stdout)")->check(kOutputPath);

  auto run = [args, list, show, exp, imp]() -> int {
    const ScheduleArgs& a = *args;
    if (list->parsed()) {
      std::size_t width = 0;  // the longest name and two spaces
      for (const auto& f : core::schedule_registry()) width = std::max(width, f.name.size() + 2);
      for (const auto& f : core::schedule_registry()) fmt::print("{:<{}}{}\n", f.name, width, f.constraints);
      return 0;
    }
    if (show->parsed()) {
      core::UnitCosts costs;
      if (!a.costs.empty()) costs = {a.costs[0], a.costs[1], a.costs[2]};
      core::StrategyOptions o = options_of(a);
      if (core::schedule_family(a.name).cost_aware) {
        // A cost-aware family schedules for the costs the view shows: F, BI = B - W, BW = W per region.
        const auto regions = static_cast<std::size_t>(a.ranks);
        o.stage_costs.forward.assign(regions, costs.forward);
        o.stage_costs.input_grad.assign(regions, costs.backward - costs.weight);
        o.stage_costs.weight_grad.assign(regions, costs.weight);
      }
      fmt::print("{}", core::schedule_show_text(o, costs));
      return 0;
    }
    if (exp->parsed()) {
      core::ScheduleTable table;
      if (!a.directives_path.empty()) {
        if (!a.name.empty()) throw CliError("", "give a schedule name or --directives, not both");
        // The program's split and order are the schedule: a shape flag beside it was ignored, exit 0.
        for (const char* flag : {"--ranks", "--microbatches", "--virtual", "--zb-memory-limit"})
          if (exp->get_option(flag)->count() > 0)
            throw CliError("", fmt::format("{} applies to a schedule name: the directive program {} fixes the "
                                           "schedule (its ranks, microbatches and order)",
                                           flag, a.directives_path));
        try {
          table = core::schedule_table_from_program(core::load_directives_file(a.directives_path));
        } catch (const std::invalid_argument& e) {
          throw CliError(a.directives_path, e.what());
        }
      } else {
        if (a.name.empty()) throw CliError("", "export-csv needs a schedule name or --directives FILE");
        if (core::schedule_family(a.name).mirrored)
          throw CliError("", a.name + " runs two mirrored model copies; the PyTorch CSV has one stage -> rank map");
        table = core::schedule_table(options_of(a));
      }
      write_or_print(a.out_path, core::schedule_to_pytorch_csv(table));
      return 0;
    }
    if (imp->parsed()) {
      core::CsvSpelling spelling = core::CsvSpelling::Either;
      const core::ScheduleTable table =
          core::schedule_from_pytorch_csv(read_text_file(a.csv_path), a.csv_path, &spelling);
      core::StrategyOptions o;
      o.dp = a.dp;
      write_or_print(a.out_path, core::program_from_schedule_table(table, o).to_json().dump(1) + "\n");
      // Said on stderr so that the program on stdout stays pipeable; only once it succeeded (a note
      // before an error would make two lines of one failure).
      fmt::print(stderr, "{}: read as {}\n", a.csv_path, core::describe(spelling));
      return 0;
    }
    return 0;
  };
  return {cmd, run};
}

}  // namespace piper::cli
