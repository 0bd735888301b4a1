// Shared pieces of the piper command (see common.hpp).
#include "cli/common.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <limits>
#include <type_traits>
#include <variant>

#include <fmt/format.h>

#include "piper/core/limits.hpp"
#include "piper/core/program.hpp"
#include "piper/core/settings.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/verifier.hpp"

namespace piper::cli {

// Error messages must stay on one line: a newline inside one would break "one line per error". Line
// ends at the end are dropped; one inside is escaped as core::printable escapes every control byte
// (\x0a, \x0d), since it may be part of a name the message quotes: a space in its place showed a
// folder "no<newline>such" as 'no such', a name the user does not have.
std::string one_line(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\n' || s.back() == '\r')) s.pop_back();
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    if (c == '\n')
      out += "\\x0a";
    else if (c == '\r')
      out += "\\x0d";
    else
      out += c;
  }
  return out;
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

// Sized before reading (Limit::InputBytes): a 10 GB file is refused without reading a byte.
std::string read_text_file(const std::string& path) { return core::read_input_file(path); }

json read_json_file(const std::string& path) {
  std::string text = read_text_file(path);
  try {
    return core::parse_json(text, path);
  } catch (const json::exception& e) {  // also number overflow (out_of_range.406)
    throw CliError(path, "not valid JSON: " + json_message(e));
  }
}

core::Program read_verified_plan(const std::string& path) {
  json j = read_json_file(path);
  try {
    core::Program program = core::Program::from_json(j);
    core::verify_or_throw(program);
    return program;
  } catch (const core::Error& e) {
    throw CliError(path, e.what());
  }
}

std::string human_count(std::int64_t n) {
  if (n >= 1'000'000'000) return fmt::format("{:.2f} B", static_cast<double>(n) / 1e9);
  if (n >= 1'000'000) return fmt::format("{:.2f} M", static_cast<double>(n) / 1e6);
  if (n >= 1'000) return fmt::format("{:.2f} K", static_cast<double>(n) / 1e3);
  return std::to_string(n);
}

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// A number as a person writes one: decimal digits with an optional sign, point and exponent (an
// integer: digits and a sign). stod and CLI11 also took "0x10" (16), "0x1p-40" and " 2".
bool decimal_number(const std::string& v, bool integer) {
  std::size_t i = 0;
  auto digits = [&] {
    const std::size_t start = i;
    while (i < v.size() && std::isdigit(static_cast<unsigned char>(v[i]))) ++i;
    return i > start;
  };
  if (i < v.size() && (v[i] == '+' || v[i] == '-')) ++i;
  bool any = digits();
  if (integer) return any && i == v.size();
  if (i < v.size() && v[i] == '.') {
    ++i;
    any = digits() || any;
  }
  if (!any) return false;
  if (i < v.size() && (v[i] == 'e' || v[i] == 'E')) {
    ++i;
    if (i < v.size() && (v[i] == '+' || v[i] == '-')) ++i;
    if (!digits()) return false;
  }
  return i == v.size();
}

// CLI11's Range prints DBL_MAX for a non-number; these say what is expected in a few words.
// An int (the whole text, within int's range) of at least `min`; `what` names the rule in the message.
static CLI::Validator int_at_least(long long min, const std::string& what, const std::string& name) {
  return CLI::Validator(
      [min, what](std::string& value) -> std::string {
        try {
          std::size_t used = 0;
          long long v = std::stoll(value, &used);
          if (decimal_number(value, true) && used == value.size() && v >= min && v <= std::numeric_limits<int>::max())
            return {};
        } catch (const std::exception&) {
        }
        return "must be " + what + ", got '" + value + "'";
      },
      name);
}
const CLI::Validator kPositiveInt = int_at_least(1, "a positive integer", "POSITIVE");
const CLI::Validator kNonNegativeInt = int_at_least(0, "a non-negative integer", "NONNEGATIVE");
// A seed and other 64-bit unsigned values: digits only (stoull would take "-1" and wrap it to 2^64 - 1).
const CLI::Validator kNonNegativeInt64(
    [](std::string& value) -> std::string {
      try {
        std::size_t used = 0;
        if (!value.empty() && value.front() >= '0' && value.front() <= '9') {
          (void)std::stoull(value, &used);
          if (used == value.size()) return {};
        }
      } catch (const std::exception&) {
      }
      return "must be a non-negative integer below 2^64, got '" + value + "'";
    },
    "NONNEGATIVE");
const CLI::Validator kNonNegativeNumber(
    [](std::string& value) -> std::string {
      try {
        std::size_t used = 0;
        double v = std::stod(value, &used);
        if (decimal_number(value, false) && used == value.size() && v >= 0 && std::isfinite(v)) return {};
      } catch (const std::exception&) {
      }
      return "must be a non-negative number, got '" + value + "'";
    },
    "NONNEGATIVE");
const CLI::Validator kPositiveNumber(
    [](std::string& value) -> std::string {
      try {
        std::size_t used = 0;
        double v = std::stod(value, &used);
        if (decimal_number(value, false) && used == value.size() && v > 0 && std::isfinite(v)) return {};
      } catch (const std::exception&) {
      }
      return "must be a positive number, got '" + value + "'";
    },
    "POSITIVE");

const CLI::Validator kOutputPath(
    [](std::string& value) -> std::string {
      return value.empty() ? "must name a file, got an empty path" : std::string();
    },
    "FILE", kOutputPathName);
const CLI::Validator kMakesItsFolder([](std::string&) { return std::string(); }, "", kMakesItsFolderName);
const CLI::Validator kPngPath(
    [](std::string& value) -> std::string {
      namespace fs = std::filesystem;
      std::error_code ec;
      if (fs::exists(value, ec) && !fs::is_regular_file(value, ec) && !fs::is_directory(value, ec)) return {};
      std::string ext = fs::path(value).extension().string();
      std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return std::tolower(c); });
      if (ext.empty() || ext == ".png") return {};
      return "writes a PNG image: name a .png file, got '" + value + "'";
    },
    "");

namespace {

struct PathOption {
  std::string flag, path;
  bool makes_its_folder = false;  // an output whose missing folders the command creates
};

bool has_validator(CLI::Option* o, const char* name) {
  try {
    return o->get_validator(name) != nullptr;
  } catch (const CLI::OptionNotFound&) {
    return false;
  }
}

// The flag (or positional) name of `o` as a user wrote it: "--output", "plan".
std::string option_label(const CLI::Option* o) {
  const auto& longs = o->get_lnames();
  if (!longs.empty()) return "--" + longs.front();
  const auto& shorts = o->get_snames();
  if (!shorts.empty()) return "-" + shorts.front();
  return o->get_name();
}

void collect_path_options(CLI::App* app, std::vector<PathOption>& outputs, std::vector<PathOption>& inputs) {
  for (CLI::Option* o : app->get_options()) {
    // Text options only: a number (--pp 2) is never a file, even where a file of that name exists.
    if (o->count() == 0 || o->get_type_name().rfind("TEXT", 0) != 0) continue;
    const bool output = has_validator(o, kOutputPathName);
    const bool makes_folder = has_validator(o, kMakesItsFolderName);
    for (const std::string& value : o->results()) {
      // An empty value meant "the default" (`--cluster ""` simulated dgx-h200, `--calibration ""` was
      // ignored): no text option takes one.
      if (value.empty())
        throw CliError(
            "", fmt::format("{}: empty value (give one, or leave the option out for its default)", option_label(o)));
      (output ? outputs : inputs).push_back({option_label(o), value, makes_folder});
    }
  }
  for (CLI::App* sub : app->get_subcommands()) collect_path_options(sub, outputs, inputs);
}

// Why a new file cannot be made in `folder` (the reason), or "" when one can: tried, and removed.
std::string folder_refuses_files(const std::filesystem::path& folder) {
  std::string name = (folder / ".piper-write-check-XXXXXX").string();
  const int fd = ::mkstemp(name.data());
  if (fd < 0) return std::strerror(errno);
  ::close(fd);
  ::unlink(name.c_str());
  return {};
}

}  // namespace

void refuse_loose_numbers(CLI::App* command) {
  for (CLI::Option* o : command->get_options()) {
    if (o->count() == 0) continue;
    const std::string type = o->get_type_name();
    const bool integer = type.rfind("INT", 0) == 0 || type.rfind("UINT", 0) == 0;
    if (!integer && type.rfind("FLOAT", 0) != 0) continue;
    for (const std::string& value : o->results())
      if (!decimal_number(value, integer))
        throw CliError("", fmt::format("{} '{}': expected {} in decimal", option_label(o), core::printable(value, 80),
                                       integer ? "a whole number" : "a number"));
  }
  for (CLI::App* sub : command->get_subcommands()) refuse_loose_numbers(sub);
}

void refuse_outputs_over_inputs(CLI::App* command) {
  namespace fs = std::filesystem;
  std::vector<PathOption> outputs, inputs;
  collect_path_options(command, outputs, inputs);
  // A device or FIFO (/dev/null) may take several outputs; only regular files (or new paths) are compared.
  auto replaceable = [](const std::string& p) {
    std::error_code ec;
    return !fs::exists(p, ec) || fs::is_regular_file(p, ec);
  };
  auto same_existing_file = [](const std::string& in, const std::string& out) {
    std::error_code ec;
    return fs::is_regular_file(in, ec) && fs::exists(out, ec) && fs::equivalent(in, out, ec) && !ec;
  };
  // Outputs are compared by the file a write lands on: through a dangling link too, whose target
  // weakly_canonical leaves unresolved (`--report t.json --trace link-to-t.json` lost the report).
  std::vector<std::string> targets;
  for (const PathOption& out : outputs) {
    try {
      targets.push_back(core::output_target(out.path));
    } catch (const core::Error& e) {
      // "cannot write PATH: why" from output_target: a link loop, or another user's link in /tmp.
      const std::string what = e.what();
      const std::string lead = "cannot write " + out.path + ": ";
      throw CliError(out.path, out.flag + ": " + (what.rfind(lead, 0) == 0 ? what.substr(lead.size()) : what));
    }
  }
  auto same_path = [](const std::string& a, const std::string& b) {
    std::error_code ec_a, ec_b;
    const fs::path ca = fs::weakly_canonical(a, ec_a), cb = fs::weakly_canonical(b, ec_b);
    return !ec_a && !ec_b && ca == cb;
  };
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const PathOption& out = outputs[i];
    // The folder an output goes in must be there now, not after a search or a training run: writing
    // into a missing folder fails only at the end (`tune --emit-directives /no/such/dir/x.json`).
    if (!out.makes_its_folder) {
      const fs::path folder = fs::path(targets[i]).parent_path();
      std::error_code ec;
      if (!folder.empty() && !fs::is_directory(folder, ec))
        throw CliError(out.path,
                       fs::exists(folder, ec)
                           ? fmt::format("{}: '{}' is not a folder (choose another path)", out.flag, folder.string())
                           : fmt::format("{}: no such folder '{}' (create it first, or choose another path)", out.flag,
                                         folder.string()));
      // Nor may the output itself be a folder: `tune -o t.csv --emit-directives DIR` ran the whole
      // search and wrote t.csv before failing; `run --save ck --report DIR` trained and saved first.
      if (fs::is_directory(out.path, ec))
        throw CliError(out.path,
                       fmt::format("{}: is a folder, not a regular file: name a file (in it, or elsewhere)", out.flag));
      // And the folder must take a new file (outputs are written to a temporary file beside the
      // target, then renamed): `tune --emit-directives /proc/x.json` failed only after the search.
      if (replaceable(out.path))
        if (const std::string why = folder_refuses_files(folder.empty() ? fs::path(".") : folder); !why.empty())
          throw CliError(out.path, fmt::format("{}: cannot write in the folder '{}': {}", out.flag,
                                               folder.empty() ? std::string(".") : folder.string(), why));
    }
    if (!replaceable(out.path)) continue;
    for (const PathOption& in : inputs) {
      if (in.flag == "--resume" && out.flag == "--save") continue;  // a run continuing its own checkpoint
      if (same_existing_file(in.path, out.path))
        throw CliError(out.path, fmt::format("{} is also the input {}: writing it would destroy the input (choose "
                                             "another output file)",
                                             out.flag, in.flag));
    }
    for (std::size_t j = 0; j < i; ++j)
      if (same_path(targets[i], targets[j]))
        throw CliError(out.path, fmt::format("{} and {} name the same file: one output would replace the other "
                                             "(give each its own file)",
                                             outputs[j].flag, out.flag));
  }
}

// A setting's value as the flag gives it: its type and range from the table.
static CLI::Validator setting_validator(const core::Setting& setting) {
  const core::Setting* s = &setting;  // the table is static
  return CLI::Validator(
      [s](std::string& value) -> std::string {
        if (s->type == core::SettingType::String) return core::setting_problem(*s, value);
        const bool integer = s->type == core::SettingType::Int;
        try {
          std::size_t used = 0;
          const json v = integer ? json(std::stoll(value, &used)) : json(std::stod(value, &used));
          if (used == value.size()) return core::setting_problem(*s, v);
        } catch (const std::exception&) {
        }
        return std::string("must be ") + (integer ? "an integer" : "a number") + ", got '" + value + "'";
      },
      "");
}

CLI::Option* StrategyFlags::option(const std::string& setting) const {
  for (const auto& [name, o] : flags)
    if (name == setting) return o;
  throw core::InternalError("no strategy flag for setting '" + setting + "'");
}

void StrategyFlags::add_to(CLI::App* app) {
  for (const core::Setting& s : core::strategy_settings()) {
    CLI::Option* o = std::visit(
        [&](auto m) -> CLI::Option* {
          auto& field = options.*m;
          if constexpr (std::is_same_v<std::decay_t<decltype(field)>, bool>)
            return app->add_flag(core::setting_flag(s), field, s.help);
          else
            return app->add_option(core::setting_flag(s), field, s.help);
        },
        s.member);
    if (s.type != core::SettingType::Bool) {
      const std::vector<std::string> choices = core::setting_choices(s);
      o->check(choices.empty() ? setting_validator(s) : CLI::IsMember(choices));
    }
    flags.emplace_back(s.name, o);
  }
  option("global_batch")->excludes(option("microbatches"));
}

void ScenarioFlags::add_to(CLI::App* app) {
  app->add_option("--model", model, "zoo name, model spec JSON, or Hugging Face config.json")->required();
  compile_inputs = {
      app->add_option("--seq-len", seq_len, "tokens per sequence (overrides the model's)")->check(kPositiveInt),
      app->add_option("--micro-batch-size", micro_batch_size, "sequences per microbatch")->check(kPositiveInt),
      app->add_option("--stages", stages, "balance the model over N PP regions")->check(kPositiveInt),
      app->add_option("--pp-ranges", pp_ranges, "explicit PP regions: first block of each, e.g. 0,10,20")
          ->delimiter(',')
          ->check(kNonNegativeInt),
      app->add_option("--first-stage-layers", first_stage_layers,
                      "blocks of the first PP region; the regions between share the rest evenly (Megatron's "
                      "--decoder-first-pipeline-num-layers)")
          ->check(kPositiveInt),
      app->add_option("--last-stage-layers", last_stage_layers,
                      "blocks of the last PP region (Megatron's --decoder-last-pipeline-num-layers)")
          ->check(kPositiveInt)};
  directives = app->add_option("--directives", directives_path, "directive program (JSON)");
  compile_inputs.push_back(directives);
  compile_inputs.push_back(app->add_option("--save-scenario", save_scenario_path,
                                           "also write these inputs as a scenario JSON (the file piper-studio opens)")
                               ->check(kOutputPath));
  strategy.add_to(app);
  for (const core::Setting& setting : core::strategy_settings()) {
    CLI::Option* o = strategy.option(setting.name);
    compile_inputs.push_back(o);
    // A directive program fixes the placement, parallelism and sharding; only the schedule and its
    // microbatches can be appended to it.
    if (setting.generator_only) o->excludes(directives);
  }
}

void ScenarioFlags::reject_beside_plan() const {
  for (const CLI::Option* o : compile_inputs)
    if (o->count() > 0)
      throw CliError("", fmt::format("{} cannot be used with --plan: the plan already fixes the model and strategy "
                                     "(compile a new plan, or drop --plan)",
                                     o->get_name()));
}

std::string scenario_file_text(core::Scenario s, const std::string& path) {
  namespace fs = std::filesystem;
  auto relocate = [&](std::string& file) {
    std::error_code ec;
    if (file.empty() || fs::path(file).is_absolute() || !fs::is_regular_file(file, ec)) return;  // a zoo or preset name
    const fs::path folder = fs::absolute(fs::path(path), ec).parent_path();
    const fs::path target = fs::absolute(fs::path(file), ec);
    if (ec) return;
    const fs::path rel = target.lexically_normal().lexically_relative(folder.lexically_normal());
    file = rel.empty() ? target.lexically_normal().string() : rel.string();
  };
  relocate(s.model);
  for (const char* key : {"data", "resume"}) {  // the run's input files, in its "train" section
    if (!s.train.contains(key) || !s.train[key].is_string()) continue;
    std::string file = s.train[key].get<std::string>();
    relocate(file);
    s.train[key] = file;
  }
  s.cluster = core::map_cluster_file(s.cluster, [&](std::string file) {
    relocate(file);
    return file;
  });
  return s.to_json().dump(2) + "\n";
}

void ScenarioFlags::save_if_requested(const core::Scenario& s) const {
  if (save_scenario_path.empty()) return;
  core::write_file_atomically(save_scenario_path, scenario_file_text(s, save_scenario_path));
}

CLI::Option* ScenarioFlags::add_file_option(CLI::App* app, const std::string& help) {
  CLI::Option* model_option = app->get_option("--model");
  model_option->required(false);
  return app->add_option("--scenario", scenario_path, help)->excludes(model_option);
}

core::Scenario ScenarioFlags::scenario() const {
  if (!scenario_path.empty()) {
    for (const CLI::Option* o : compile_inputs)
      if (o->count() > 0)
        throw CliError("", fmt::format("{} cannot be used with --scenario: the scenario file fixes the model and "
                                       "strategy (edit the file, or give the compile inputs without --scenario)",
                                       o->get_name()));
    // Relative model, cluster and directive files in it resolve against its folder.
    return core::Scenario::from_json(read_json_file(scenario_path), scenario_path,
                                     std::filesystem::path(scenario_path).parent_path().string());
  }
  if (model.empty()) throw CliError("", "--model is required (or give --scenario FILE)");
  // Beside --directives the schedule's settings (--microbatches, --virtual, --global-batch, ...) apply
  // only to a schedule appended with --schedule; else the program's own split and order win.
  if (directives->count() > 0 && strategy.option("schedule")->count() == 0)
    for (const core::Setting& setting : core::strategy_settings())
      if (!setting.generator_only && setting.name != "schedule" && strategy.option(setting.name)->count() > 0)
        throw CliError("", fmt::format("{} with --directives needs --schedule (the schedule to append)",
                                       core::setting_flag(setting)));
  core::Scenario s;
  s.model = model;
  s.seq_len = seq_len;
  s.micro_batch_size = micro_batch_size;
  s.stages = stages;
  s.stage_starts = pp_ranges;
  s.first_stage_layers = first_stage_layers;
  s.last_stage_layers = last_stage_layers;
  s.strategy = strategy.options;
  if (!directives_path.empty()) {
    s.directives = read_json_file(directives_path);
    s.directives_source = directives_path;
    s.append_schedule = strategy.option("schedule")->count() > 0;
  }
  return s;
}

void print_error(const std::string& file, const std::string& message) {
  if (file.empty())
    fmt::print(stderr, "piper: error: {}\n", core::printable(one_line(message)));
  else
    fmt::print(stderr, "piper: error: {}: {}\n", core::printable(file), core::printable(one_line(message)));
}

void print_internal_error(const std::string& message) {
  fmt::print(stderr, "piper: internal error: {} (please report this: it is a bug in piper, not in the input)\n",
             one_line(message));
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  if (s < 60) return fmt::format("{:.0f}s", s);
  if (s < 3600) return fmt::format("{}m{:02.0f}s", static_cast<int>(s / 60), std::fmod(s, 60));
  return fmt::format("{}h{:02d}m", static_cast<int>(s / 3600), static_cast<int>(std::fmod(s, 3600) / 60));
}

std::string ProgressLog::report(const std::string& phase, std::size_t done, std::size_t total, double elapsed_s) {
  const bool end = done == total && phase != ended_;
  if (elapsed_s < every_s_ || (!end && (done == total || elapsed_s - last_line_s_ < every_s_))) return "";
  last_line_s_ = elapsed_s;
  if (end) ended_ = phase;
  return fmt::format("{}: {}: {} of {}{}, elapsed {}\n", command_, phase, done, total, end ? " done" : "",
                     format_duration(elapsed_s));
}

}  // namespace piper::cli
