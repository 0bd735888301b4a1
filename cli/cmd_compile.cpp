// The compiler's subcommands: compile, directives, verify, models.
#include <algorithm>
#include <filesystem>
#include <utility>

#include <fmt/format.h>

#include "cli/common.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/core/dag.hpp"
#include "piper/core/limits.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/verifier.hpp"

namespace piper::cli {

namespace fs = std::filesystem;

namespace {

struct CompileArgs {
  ScenarioFlags scenario;
  std::string out_path;
  bool stats = false;
  std::vector<std::string> dump_after;
  std::string dump_dir = ".";
};

void print_stats_table(const core::Model& model, const core::Program& program, const std::string& out_path) {
  const core::ProgramStats& s = program.stats;
  std::vector<std::int64_t> ops_of_plan;
  for (const auto& plan : program.plans) ops_of_plan.push_back(plan.op_count());
  std::int64_t ops_min = 0, ops_max = 0;
  for (std::size_t d = 0; d < program.plan_of_device.size(); ++d) {
    std::int64_t n = ops_of_plan.at(static_cast<std::size_t>(program.plan_of_device[d]));
    ops_min = d == 0 ? n : std::min(ops_min, n);
    ops_max = d == 0 ? n : std::max(ops_max, n);
  }
  const core::TrainingShape& t = program.training;
  auto row = [](const std::string& key, const std::string& value) { fmt::print("{:<24}{}\n", key, value); };
  row("model",
      fmt::format("{} ({} params; seq {} x {} seqs/microbatch, {})", model.name(), human_count(model.parameter_count()),
                  t.seq_len, t.micro_batch_size, core::to_string(t.precision)));
  row("microbatches", std::to_string(program.microbatches));
  row("devices", std::to_string(program.num_devices));
  row("distinct plans", std::to_string(program.plans.size()));
  row("ops per device", fmt::format("min {}, max {}", ops_min, ops_max));
  row("ops total", std::to_string(program.total_ops()));
  row("DAG nodes", std::to_string(s.dag_nodes));
  for (const auto& [kind, count] : s.nodes_by_kind) row("  " + kind, std::to_string(count));
  row("compile time", fmt::format("{:.1f} ms", s.compile_seconds * 1e3));
  row("compiler peak memory", fmt::format("{:.1f} MiB", mib(s.compiler_peak_rss_bytes)));
  if (!out_path.empty()) row("plan written to", out_path);
}

// Bytes a plan takes per node of the estimate below: measured 216-332 over PP 1-16, DP, TP, ZeRO-3,
// 1F1B, ZB-H1, DualPipeV and interleaved schedules (qwen3-9m, qwen3-1b); the estimate takes less, so
// that it never refuses a plan that would read back.
constexpr double kPlanBytesPerNode = 200;

// A cheap estimate of the plan's size, before compiling: one microbatch's DAG (F and B per segment,
// and SEND + RECV both ways between consecutive segments of different PP regions) times the
// microbatches, at kPlanBytesPerNode. 0 when the scenario does not get that far: the compile then
// reports what is wrong with it.
std::int64_t estimated_plan_bytes(const core::Scenario& s, std::int64_t* microbatches) {
  try {
    core::Model model = core::build_model(core::scenario_model_config(s));
    int regions = 0;
    const core::DirectiveProgram program = core::scenario_program(s, &regions);
    core::annotate_regions(s, model, program, regions);
    std::int64_t m = 1;
    for (const auto& d : program.directives)
      if (const auto* split = std::get_if<core::SplitDirective>(&d)) {
        const double product = static_cast<double>(m) * static_cast<double>(std::max(1, split->count));
        if (product > static_cast<double>(core::limit_value(core::Limit::Microbatches)))
          return 0;  // the compile names that limit
        m = static_cast<std::int64_t>(product);
      }
    const std::vector<core::Segment> segments = core::segment_model(model);
    std::int64_t per_microbatch = 2 * static_cast<std::int64_t>(segments.size());
    for (std::size_t i = 1; i < segments.size(); ++i) {
      const auto a = segments[i - 1].tags.find("PP"), b = segments[i].tags.find("PP");
      if (a != segments[i - 1].tags.end() && b != segments[i].tags.end() && a->second != b->second) per_microbatch += 4;
    }
    *microbatches = m;
    return static_cast<std::int64_t>(static_cast<double>(per_microbatch) * static_cast<double>(m) * kPlanBytesPerNode);
  } catch (const std::exception&) {
    return 0;
  }
}

int run_compile(const CompileArgs& a) {
  const core::Scenario scenario = a.scenario.scenario();
  sim::check_scenario_cluster_and_engine(scenario);
  // A plan Piper could not read back (over the input-bytes limit) is refused before the compile,
  // which would take minutes and gigabytes to write it.
  if (!a.out_path.empty()) {
    std::int64_t microbatches = 0;
    const std::int64_t bytes = estimated_plan_bytes(scenario, &microbatches);
    if (bytes > core::limit_value(core::Limit::InputBytes))
      throw CliError(a.out_path,
                     fmt::format("a plan of {} microbatches would not read back (use fewer microbatches): about {}",
                                 microbatches, core::limit_message(core::Limit::InputBytes, bytes, "bytes")));
  }
  // Dumps are kept in memory and written only once the whole compile succeeded: nothing on error.
  const bool dump_all = std::find(a.dump_after.begin(), a.dump_after.end(), "all") != a.dump_after.end();
  std::vector<std::pair<fs::path, std::string>> dumps;
  core::AfterPassHook hook;
  if (!a.dump_after.empty()) {
    hook = [&](const std::string& op, int index, const core::GlobalDag& dag) {
      if (!dump_all && std::find(a.dump_after.begin(), a.dump_after.end(), op) == a.dump_after.end()) return;
      // Passes that no single directive owns (the backward split) come with index -1.
      fs::path base = fs::path(a.dump_dir) / (index >= 0 ? fmt::format("after-{}-{}", index, op) : "after-" + op);
      dumps.emplace_back(fs::path(base.string() + ".json"), dag.to_json().dump(1) + "\n");
      dumps.emplace_back(fs::path(base.string() + ".dot"), dag.to_dot());
    };
  }
  const core::CompiledScenario compiled = core::compile_scenario(scenario, hook);
  a.scenario.save_if_requested(scenario);
  const core::Program& plan = compiled.result.program;

  if (!dumps.empty()) {
    std::error_code ec;
    fs::create_directories(a.dump_dir, ec);
    if (ec) throw CliError(a.dump_dir, "cannot create dump folder: " + ec.message());
    for (const auto& [path, text] : dumps) core::write_file_atomically(path.string(), text);
  } else if (!a.dump_after.empty()) {
    fmt::print(stderr, "piper: note: --dump-after matched no pass\n");
  }
  if (!a.out_path.empty()) core::write_file_atomically(a.out_path, plan.to_json().dump() + "\n");

  if (a.stats) {
    print_stats_table(compiled.model, plan, a.out_path);
  } else {
    fmt::print("{}: {} devices, {} distinct plans, {} DAG nodes, {} ops, compiled in {:.1f} ms{}\n",
               compiled.model.name(), plan.num_devices, plan.plans.size(), plan.stats.dag_nodes, plan.total_ops(),
               plan.stats.compile_seconds * 1e3, a.out_path.empty() ? "" : " -> " + a.out_path);
  }
  return 0;
}

struct DirectivesArgs {
  std::string model;
  StrategyFlags strategy;
};

int run_directives(const DirectivesArgs& a) {
  const json program = core::strategy_directives(a.strategy.options, a.model).to_json();
  // Print "op" and the filter first, as the published programs are written (json objects sort keys).
  nlohmann::ordered_json printed = nlohmann::ordered_json::array();
  for (const json& d : program) {
    nlohmann::ordered_json o = nlohmann::ordered_json::object();
    for (const char* first : {"op", "filter", "filters"})
      if (d.contains(first)) o[first] = d[first];
    for (auto it = d.begin(); it != d.end(); ++it)
      if (!o.contains(it.key())) o[it.key()] = it.value();
    printed.push_back(std::move(o));
  }
  fmt::print("{}\n", printed.dump(2));
  return 0;
}

int run_verify(const std::string& path) {
  json j = read_json_file(path);
  core::Program program;
  try {
    program = core::Program::from_json(j);
  } catch (const core::Error& e) {
    throw CliError(path, e.what());
  }
  std::vector<core::VerifyIssue> issues = core::verify(program);
  if (issues.empty()) {
    fmt::print("ok: {} devices, {} plans, {} ops\n", program.num_devices, program.plans.size(), program.total_ops());
    return 0;
  }
  for (const auto& issue : issues) fmt::print("{}: {}: {}\n", path, issue.check, one_line(issue.message));
  fmt::print(stderr, "piper: verify: {}: {} issue{}\n", path, issues.size(), issues.size() == 1 ? "" : "s");
  return kExitVerifyFailed;
}

int run_models() {
  for (const std::string& name : core::zoo_names()) {
    core::ModelConfig cfg = *core::zoo_config(name);
    core::Model model = core::build_model(cfg);
    std::string moe = cfg.experts > 0 ? fmt::format(", MoE {} experts top-{}", cfg.experts, cfg.top_k) : "";
    fmt::print("{:<16}{:>10} params  ({} layers, hidden {}{})\n", name, human_count(model.parameter_count()),
               cfg.layers, cfg.hidden, moe);
  }
  return 0;
}

}  // namespace

Command add_compile_command(CLI::App& app) {
  auto args = std::make_shared<CompileArgs>();
  CLI::App* cmd = app.add_subcommand("compile", "compile a model and a directive program into per-device plans");
  args->scenario.add_to(cmd);
  args->scenario.add_file_option(cmd,
                                 "compile a scenario file (piper-studio's, --save-scenario's): its model and strategy");
  cmd->add_option("-o,--output", args->out_path, "write the Program (JSON) here")->check(kOutputPath);
  cmd->add_flag("--stats", args->stats, "print a statistics table");
  auto* dump_after =
      cmd->add_option("--dump-after", args->dump_after,
                      "after these passes write the DAG to DIR/after-<directive index>-<pass>.json and .dot")
          ->delimiter(',')
          ->check(CLI::IsMember([] {
            auto names = core::pass_names();  // the pass manager's table, internal passes included
            names.push_back("all");
            return names;
          }()));
  // Without --dump-after nothing is dumped: the folder was taken and never made, exit 0.
  cmd->add_option("--dump-dir", args->dump_dir, "folder for --dump-after files")
      ->capture_default_str()
      ->check(kOutputPath)
      ->check(kMakesItsFolder)
      ->needs(dump_after);
  return {cmd, [args] { return run_compile(*args); }};
}

Command add_directives_command(CLI::App& app) {
  auto args = std::make_shared<DirectivesArgs>();
  CLI::App* cmd = app.add_subcommand("directives", "print the directive program of a strategy as JSON");
  cmd->add_option("--model", args->model, "model the program is for (checks --ep against its experts)");
  args->strategy.add_to(cmd);
  return {cmd, [args] { return run_directives(*args); }};
}

Command add_verify_command(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  CLI::App* cmd =
      app.add_subcommand("verify", "check a plan file: send/recv pairs, collective order, deadlock, buffers");
  cmd->add_option("plan", *path, "plan JSON written by `piper compile -o`")->required();
  return {cmd, [path] { return run_verify(*path); }};
}

Command add_models_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("models", "list the built-in model zoo");
  return {cmd, [] { return run_models(); }};
}

}  // namespace piper::cli
