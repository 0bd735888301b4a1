// The piper command: thin subcommands (compile, directives, verify, models) over piper_core.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <limits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/error.hpp"
#include "piper/core/model.hpp"
#include "piper/core/program.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/verifier.hpp"

namespace core = piper::core;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int kExitBadInput = 2;     // every user error: bad file, bad directive, bad flag
constexpr int kExitVerifyFailed = 1; // `piper verify` found issues
constexpr int kExitInternal = 3;     // a bug in piper, not in the input

// A user-facing failure: printed as "piper: error: <file>: <message>" (file omitted when empty).
class CliError : public std::runtime_error {
 public:
  CliError(std::string file, const std::string& message) : std::runtime_error(message), file_(std::move(file)) {}
  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

// Error messages must stay on one line: a newline inside one would break "one line per error".
std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  std::replace(s.begin(), s.end(), '\r', ' ');
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

// nlohmann messages start with "[json.exception.parse_error.101] "; the id means nothing to a user.
std::string json_message(const json::exception& e) {
  std::string m = e.what();
  if (!m.empty() && m.front() == '[') {
    auto close = m.find("] ");
    if (close != std::string::npos) m = m.substr(close + 2);
  }
  return m;
}

// Runs `fn`, attributing any input error it throws to `file` (unless the message already names it),
// so that the user learns which file to fix.
template <class F>
auto blame(const std::string& file, F&& fn) -> decltype(fn()) {
  auto rethrow = [&](const std::string& message) -> CliError {
    bool named = !file.empty() && message.find(file) != std::string::npos;
    return CliError(named ? std::string() : file, message);
  };
  try {
    return fn();
  } catch (const CliError&) {
    throw;
  } catch (const core::Error& e) {
    throw rethrow(e.what());
  } catch (const std::invalid_argument& e) {
    throw rethrow(e.what());
  } catch (const json::exception& e) {
    throw rethrow(json_message(e));
  }
}

std::string read_text_file(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw CliError(path, "is a directory, expected a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw CliError(path, fmt::format("cannot open: {}", std::strerror(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw CliError(path, "read failed");
  return text.str();
}

json read_json_file(const std::string& path) {
  std::string text = read_text_file(path);
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    throw CliError(path, "not valid JSON: " + json_message(e));
  }
}

// PP regions a directive program refers to: 1 + the largest integer "PP" index in any filter.
// A program that never names PP places the whole model as one region.
int pp_regions_in_program(const json& program) {
  int max_index = -1;
  std::function<void(const json&)> walk = [&](const json& j) {
    if (j.is_object()) {
      for (auto it = j.begin(); it != j.end(); ++it) {
        if (it.key() == "PP" && it.value().is_number_integer() && it.value().get<long long>() >= 0)
          max_index = std::max(max_index, static_cast<int>(it.value().get<long long>()));
        walk(it.value());
      }
    } else if (j.is_array()) {
      for (const auto& e : j) walk(e);
    }
  };
  walk(program);
  return std::max(1, max_index + 1);
}

std::string human_count(std::int64_t n) {
  if (n >= 1'000'000'000) return fmt::format("{:.2f} B", static_cast<double>(n) / 1e9);
  if (n >= 1'000'000) return fmt::format("{:.2f} M", static_cast<double>(n) / 1e6);
  if (n >= 1'000) return fmt::format("{:.2f} K", static_cast<double>(n) / 1e3);
  return std::to_string(n);
}

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

std::vector<std::string> schedule_names() {
  std::vector<std::string> names;
  for (const auto& f : core::schedule_registry()) names.push_back(f.name);
  return names;
}

// A model file is blamed for model errors; a zoo name is not a file.
std::string model_file_of(const std::string& model_arg) {
  std::error_code ec;
  return fs::exists(model_arg, ec) ? model_arg : std::string();
}

// Expert parallelism needs experts to shard: reject --ep on a dense model before generating anything.
void check_ep_against_model(const core::ModelConfig& cfg, int ep) {
  if (ep <= 1) return;
  if (cfg.experts <= 0)
    throw CliError("", fmt::format("--ep {}: model '{}' has no MoE experts (use --ep 1)", ep, cfg.name));
  if (cfg.experts % ep != 0)
    throw CliError("", fmt::format("--ep {}: does not divide the {} experts of model '{}'", ep, cfg.experts, cfg.name));
}

// CLI11's Range prints DBL_MAX for a non-number; these say what is expected in a few words.
const CLI::Validator kPositiveInt(
    [](std::string& value) -> std::string {
      try {
        std::size_t used = 0;
        long long v = std::stoll(value, &used);
        if (used == value.size() && v > 0 && v <= std::numeric_limits<int>::max()) return {};
      } catch (const std::exception&) {
      }
      return "must be a positive integer, got '" + value + "'";
    },
    "POSITIVE");
const CLI::Validator kNonNegativeNumber(
    [](std::string& value) -> std::string {
      try {
        std::size_t used = 0;
        double v = std::stod(value, &used);
        if (used == value.size() && v >= 0 && std::isfinite(v)) return {};
      } catch (const std::exception&) {
      }
      return "must be a non-negative number, got '" + value + "'";
    },
    "NONNEGATIVE");

// Strategy flags shared by `compile` and `directives`.
struct StrategyFlags {
  core::StrategyOptions options;
  CLI::Option* pp = nullptr;
  CLI::Option* dp = nullptr;
  CLI::Option* ep = nullptr;
  CLI::Option* zero = nullptr;
  CLI::Option* schedule = nullptr;
  CLI::Option* microbatches = nullptr;
  CLI::Option* virtual_stages = nullptr;
  CLI::Option* bucket_mb = nullptr;

  void add_to(CLI::App* app) {
    pp = app->add_option("--pp", options.pp, "pipeline-parallel ranks")->check(kPositiveInt);
    dp = app->add_option("--dp", options.dp, "data-parallel replicas")->check(kPositiveInt);
    ep = app->add_option("--ep", options.ep, "expert-parallel degree (divides --dp)")->check(kPositiveInt);
    zero = app->add_option("--zero", options.zero, "ZeRO level: 0, 1 (optimizer), 2 (+grads), 3 (+params)")
               ->check(CLI::Range(0, 3));
    schedule = app->add_option("--schedule", options.schedule, "pipeline schedule family")
                   ->check(CLI::IsMember(schedule_names()));
    microbatches = app->add_option("--microbatches", options.microbatches, "microbatches per step")
                       ->check(kPositiveInt);
    virtual_stages = app->add_option("--virtual", options.virtual_stages, "model chunks per pipeline rank")
                         ->check(kPositiveInt);
    bucket_mb = app->add_option("--bucket-mb", options.bucket_mb, "gradient bucket size in MB (0: one per segment)")
                    ->check(kNonNegativeNumber);
  }
};

// ---------------------------------------------------------------------------------------------- compile

struct CompileArgs {
  std::string model;
  std::int64_t seq_len = 0, micro_batch_size = 0;  // 0: the model's default
  int stages = 0;                                   // 0: derived from the program or the schedule
  std::string directives_path;
  std::string out_path;
  bool stats = false;
  std::vector<std::string> dump_after;
  std::string dump_dir = ".";
  StrategyFlags strategy;
  CLI::Option* directives = nullptr;
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
  row("model", fmt::format("{} ({} params; seq {} x {} seqs/microbatch, {})", model.name(),
                           human_count(model.parameter_count()), t.seq_len, t.micro_batch_size,
                           core::to_string(t.precision)));
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

int run_compile(CompileArgs& a) {
  const std::string model_file = model_file_of(a.model);
  core::ModelConfig cfg = blame(model_file, [&] { return core::load_model_config(a.model); });
  if (a.seq_len > 0) cfg.training.seq_len = a.seq_len;
  if (a.micro_batch_size > 0) cfg.training.micro_batch_size = a.micro_batch_size;
  core::Model model = blame(model_file, [&] { return core::build_model(cfg); });

  core::StrategyOptions& opts = a.strategy.options;
  const bool from_file = !a.directives_path.empty();
  const std::string program_source = from_file ? a.directives_path : std::string("generated program");
  json program_json;
  int regions = a.stages;
  std::string regions_from = "--stages";

  if (from_file) {
    program_json = read_json_file(a.directives_path);
    if (regions == 0) {
      regions = pp_regions_in_program(program_json);
      regions_from = a.directives_path;
    }
  } else {
    check_ep_against_model(cfg, opts.ep);
    if (regions == 0) {
      regions = blame("", [&] { return core::schedule_family(opts.schedule).regions(opts); });
      regions_from = "--schedule " + opts.schedule;
    }
  }

  try {
    core::balance_pipeline(model, regions);
  } catch (const core::Error& e) {
    throw CliError(model_file, fmt::format("cannot balance {} PP regions (from {}): {}", regions, regions_from, e.what()));
  }

  if (from_file) {
    if (a.strategy.schedule->count() > 0) {
      // As in Piper's harness: a placement-only program plus the schedule's split/order.
      blame(a.directives_path, [&] {
        int pipeline_ranks = 0;
        std::vector<int> rank_of_region = core::rank_of_region_from_program(program_json, &pipeline_ranks);
        opts.pp = pipeline_ranks;
        json schedule = core::schedule_directives(opts, rank_of_region);
        for (auto& d : schedule) program_json.push_back(std::move(d));
        return 0;
      });
    }
  } else if (a.stages > 0) {
    // Explicit region count: place it with the family's own placement, then its schedule.
    program_json = blame("", [&] {
      const core::ScheduleFamily& family = core::schedule_family(opts.schedule);
      std::vector<int> rank_of_region = family.placement(opts, regions);
      json p = core::placement_directives(opts, rank_of_region);
      for (auto& d : core::schedule_directives(opts, rank_of_region)) p.push_back(std::move(d));
      return p;
    });
  } else {
    program_json = blame("", [&] { return core::generate_program(opts); });
  }

  core::DirectiveProgram program = blame(program_source, [&] { return core::parse_directives(program_json); });

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

  core::CompileResult result = blame(program_source, [&] { return core::compile(model, program, hook); });
  const core::Program& plan = result.program;

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
    print_stats_table(model, plan, a.out_path);
  } else {
    fmt::print("{}: {} devices, {} distinct plans, {} DAG nodes, {} ops, compiled in {:.1f} ms{}\n", model.name(),
               plan.num_devices, plan.plans.size(), plan.stats.dag_nodes, plan.total_ops(),
               plan.stats.compile_seconds * 1e3, a.out_path.empty() ? "" : " -> " + a.out_path);
  }
  return 0;
}

// ------------------------------------------------------------------------------------------- directives

struct DirectivesArgs {
  std::string model;
  StrategyFlags strategy;
};

int run_directives(DirectivesArgs& a) {
  if (!a.model.empty()) {
    const std::string model_file = model_file_of(a.model);
    core::ModelConfig cfg = blame(model_file, [&] { return core::load_model_config(a.model); });
    check_ep_against_model(cfg, a.strategy.options.ep);
  }
  json program = blame("", [&] { return core::generate_program(a.strategy.options); });
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

// ----------------------------------------------------------------------------------------------- verify

int run_verify(const std::string& path) {
  json j = read_json_file(path);
  core::Program program = blame(path, [&] { return core::Program::from_json(j); });
  std::vector<core::VerifyIssue> issues = core::verify(program);
  if (issues.empty()) {
    fmt::print("ok: {} devices, {} plans, {} ops\n", program.num_devices, program.plans.size(), program.total_ops());
    return 0;
  }
  for (const auto& issue : issues) fmt::print("{}: {}: {}\n", path, issue.check, one_line(issue.message));
  fmt::print(stderr, "piper: verify: {}: {} issue{}\n", path, issues.size(), issues.size() == 1 ? "" : "s");
  return kExitVerifyFailed;
}

// ----------------------------------------------------------------------------------------------- models

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

void print_error(const std::string& file, const std::string& message) {
  if (file.empty())
    fmt::print(stderr, "piper: error: {}\n", one_line(message));
  else
    fmt::print(stderr, "piper: error: {}: {}\n", file, one_line(message));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"piper: a programmable distributed-training compiler (model + directives -> per-device plans)", "piper"};
  app.require_subcommand(1);

  CompileArgs compile_args;
  CLI::App* compile = app.add_subcommand("compile", "compile a model and a directive program into per-device plans");
  compile->add_option("--model", compile_args.model, "zoo name, model spec JSON, or Hugging Face config.json")->required();
  compile->add_option("--seq-len", compile_args.seq_len, "tokens per sequence (overrides the model's)")
      ->check(kPositiveInt);
  compile->add_option("--micro-batch-size", compile_args.micro_batch_size, "sequences per microbatch")
      ->check(kPositiveInt);
  compile->add_option("--stages", compile_args.stages, "balance the model over N PP regions")->check(kPositiveInt);
  compile_args.directives =
      compile->add_option("--directives", compile_args.directives_path, "directive program (JSON)");
  compile_args.strategy.add_to(compile);
  for (CLI::Option* o : {compile_args.strategy.pp, compile_args.strategy.dp, compile_args.strategy.ep,
                         compile_args.strategy.zero, compile_args.strategy.bucket_mb})
    o->excludes(compile_args.directives);
  compile->add_option("-o,--output", compile_args.out_path, "write the Program (JSON) here");
  compile->add_flag("--stats", compile_args.stats, "print a statistics table");
  compile->add_option("--dump-after", compile_args.dump_after,
                      "after these passes write the DAG to DIR/after-<directive index>-<pass>.json and .dot")
      ->delimiter(',')
      ->check(CLI::IsMember(std::vector<std::string>{"split", "backward-split", "place", "shard", "replicate", "order", "all"}));
  compile->add_option("--dump-dir", compile_args.dump_dir, "folder for --dump-after files")->capture_default_str();

  DirectivesArgs directives_args;
  CLI::App* directives = app.add_subcommand("directives", "print the directive program of a strategy as JSON");
  directives->add_option("--model", directives_args.model, "model the program is for (checks --ep against its experts)");
  directives_args.strategy.add_to(directives);

  std::string verify_path;
  CLI::App* verify = app.add_subcommand("verify", "check a plan file: send/recv pairs, collective order, deadlock, buffers");
  verify->add_option("plan", verify_path, "plan JSON written by `piper compile -o`")->required();

  CLI::App* models = app.add_subcommand("models", "list the built-in model zoo");

  // CLI11 would only say "A subcommand is required" for a misspelt one; name it instead.
  const std::vector<std::string> commands = {"compile", "directives", "verify", "models"};
  if (argc > 1 && argv[1][0] != '-' && std::find(commands.begin(), commands.end(), argv[1]) == commands.end()) {
    print_error("", fmt::format("unknown command '{}' (expected compile, directives, verify or models)", argv[1]));
    return kExitBadInput;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::string help = argc > 1 && argv[1][0] != '-' ? fmt::format("piper {} --help", argv[1]) : "piper --help";
    print_error("", fmt::format("{} (see '{}')", e.what(), help));
    return kExitBadInput;
  }

  try {
    if (compile->parsed()) {
      if (compile_args.strategy.microbatches->count() > 0 && compile_args.directives->count() > 0 &&
          compile_args.strategy.schedule->count() == 0)
        throw CliError("", "--microbatches with --directives needs --schedule (the schedule to append)");
      return run_compile(compile_args);
    }
    if (directives->parsed()) return run_directives(directives_args);
    if (verify->parsed()) return run_verify(verify_path);
    if (models->parsed()) return run_models();
  } catch (const CliError& e) {
    print_error(e.file(), e.what());
    return kExitBadInput;
  } catch (const core::Error& e) {
    print_error("", e.what());
    return kExitBadInput;
  } catch (const std::invalid_argument& e) {
    print_error("", e.what());
    return kExitBadInput;
  } catch (const json::exception& e) {
    print_error("", json_message(e));
    return kExitBadInput;
  } catch (const std::runtime_error& e) {  // file system errors (write_file_atomically, ...)
    print_error("", e.what());
    return kExitBadInput;
  } catch (const std::exception& e) {
    fmt::print(stderr, "piper: internal error: {}\n", one_line(e.what()));
    return kExitInternal;
  }
  return 0;
}
