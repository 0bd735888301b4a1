// Sweeps: spec parsing, cartesian expansion, one simulation per combination, and a resumable
// append-only CSV (complete rows are kept; a partial last line from a killed run is cut off).
#include "piper/search/sweep.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <utility>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

#include "piper/core/limits.hpp"
#include "piper/core/model.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/settings.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/suggest.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/search/results_csv.hpp"
#include "piper/search/worker_pool.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/sim/stage_costs.hpp"

namespace piper::search {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// A value listed twice in one list is a typo (the sweep would count the combination twice and run it
// once): refused, naming the field and the value.
void check_no_repeats(const std::vector<json>& list, const std::string& where, const std::string& field) {
  for (std::size_t i = 0; i < list.size(); ++i)
    for (std::size_t k = 0; k < i; ++k)
      if (list[k] == list[i])
        throw SweepError(fmt::format("{}: field '{}': {} is listed twice (entries {} and {})", where, field,
                                     list[i].dump(), k + 1, i + 1));
}

// A knob is a value or a list of values; each value must have type T.
template <class T>
std::vector<T> knob(const json& j, const char* field, const std::string& where, const std::vector<T>& fallback) {
  if (!j.contains(field)) return fallback;
  const json& v = j.at(field);
  std::vector<T> out;
  auto one = [&](const json& x) {
    bool ok;
    if constexpr (std::is_same_v<T, std::string>)
      ok = x.is_string();
    else if constexpr (std::is_same_v<T, bool>)
      ok = x.is_boolean();
    else if constexpr (std::is_floating_point_v<T>)
      ok = x.is_number();
    else
      ok = x.is_number_integer();
    if (!ok)
      throw SweepError(fmt::format("{}: field '{}': expected {} or a list of them, got {}", where, field,
                                   std::is_same_v<T, std::string> ? "a string"
                                   : std::is_same_v<T, bool>      ? "true/false"
                                   : std::is_floating_point_v<T>  ? "a number"
                                                                  : "an integer",
                                   x.dump()));
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      // get<int> of 2^31 wraps to -2^31: refuse what the field's type cannot hold.
      const bool fits = x.is_number_unsigned()
                            ? x.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<T>::max())
                            : x.get<std::int64_t>() >= static_cast<std::int64_t>(std::numeric_limits<T>::min()) &&
                                  x.get<std::int64_t>() <= static_cast<std::int64_t>(std::numeric_limits<T>::max());
      if (!fits)
        throw SweepError(fmt::format("{}: field '{}': {} is out of range (at most {})", where, field, x.dump(),
                                     std::numeric_limits<T>::max()));
    }
    out.push_back(x.get<T>());
  };
  if (v.is_array()) {
    if (v.empty()) throw SweepError(fmt::format("{}: field '{}': empty list", where, field));
    for (const json& x : v) one(x);
    check_no_repeats(v.get<std::vector<json>>(), where, field);
  } else {
    one(v);
  }
  return out;
}

// A relative file path in the spec is relative to the spec; names (presets, zoo models) stay as given.
std::string resolve(const std::string& value, const std::string& base_dir) {
  if (value.empty() || base_dir.empty() || fs::path(value).is_absolute()) return value;
  const fs::path candidate = fs::path(base_dir) / value;
  std::error_code ec;
  return fs::is_regular_file(candidate, ec) ? candidate.string() : value;
}

bool is_simgrid(const SweepPoint& p) { return p.engine == "simgrid"; }

}  // namespace

SweepSpec::SweepSpec() {
  for (const auto& setting : core::strategy_settings()) settings.push_back({core::setting_default(setting)});
}

const std::vector<json>& SweepSpec::values(const std::string& name) const {
  const auto& table = core::strategy_settings();
  for (std::size_t i = 0; i < table.size(); ++i)
    if (table[i].name == name) return settings.at(i);
  throw core::InternalError("no strategy setting '" + name + "'");
}

std::vector<json>& SweepSpec::values(const std::string& name) {
  return const_cast<std::vector<json>&>(std::as_const(*this).values(name));
}

SweepSpec SweepSpec::from_json(const json& j, const std::string& where, const std::string& base_dir) {
  if (!j.is_object()) throw SweepError(where + ": expected a JSON object with model, cluster and knob lists");
  std::vector<std::string> known = {"model",   "cluster",          "calibration", "engine",
                                    "seq_len", "micro_batch_size", "comment"};
  for (const auto& name : core::setting_names()) known.push_back(name);
  for (const auto& [k, v] : j.items())
    if (std::find(known.begin(), known.end(), k) == known.end()) {
      const std::string near = core::nearest(k, known);
      if (!near.empty()) throw SweepError(fmt::format("{}: unknown field '{}' (did you mean '{}'?)", where, k, near));
      std::vector<std::string> sorted = known;
      std::sort(sorted.begin(), sorted.end());
      throw SweepError(fmt::format("{}: unknown field '{}' (expected one of: {})", where, k, fmt::join(sorted, ", ")));
    }
  SweepSpec s;
  auto text = [&](const char* field, std::string fallback) {
    if (!j.contains(field)) return fallback;
    if (!j.at(field).is_string() || j.at(field).get<std::string>().empty())
      throw SweepError(fmt::format("{}: field '{}': expected a non-empty string", where, field));
    return j.at(field).get<std::string>();
  };
  s.model = resolve(text("model", s.model), base_dir);
  s.cluster =
      core::map_cluster_file(text("cluster", s.cluster), [&](const std::string& f) { return resolve(f, base_dir); });
  s.calibration_path = resolve(text("calibration", ""), base_dir);
  s.engine = knob(j, "engine", where, s.engine);
  s.seq_len = knob(j, "seq_len", where, s.seq_len);
  s.micro_batch_size = knob(j, "micro_batch_size", where, s.micro_batch_size);
  // 0 keeps the model's; a negative value did too, silently.
  for (const auto& [field, list] :
       {std::pair{"seq_len", &s.seq_len}, std::pair{"micro_batch_size", &s.micro_batch_size}})
    for (const auto v : *list)
      if (v < 0)
        throw SweepError(fmt::format("{}: field '{}': must be >= 0 (0: the model's), got {}", where, field, v));
  // Every strategy setting: a value or a list of values, each of the setting's type and range.
  const auto& table = core::strategy_settings();
  for (std::size_t i = 0; i < table.size(); ++i) {
    const core::Setting& setting = table[i];
    if (!j.contains(setting.name)) continue;
    const json& v = j.at(setting.name);
    if (v.is_array() && v.empty()) throw SweepError(fmt::format("{}: field '{}': empty list", where, setting.name));
    std::vector<json> list = v.is_array() ? v.get<std::vector<json>>() : std::vector<json>{v};
    for (const json& x : list)
      if (const std::string why = core::setting_problem(setting, x); !why.empty())
        throw SweepError(fmt::format("{}: field '{}': {}", where, setting.name, why));
    check_no_repeats(list, where, setting.name);
    s.settings[i] = std::move(list);
  }
  // The combinations multiply: refuse an absurd sweep before expanding it (limits.hpp).
  double runs = 1;  // a double cannot overflow here: at most ~10^8 values per list in an input file
  std::vector<std::size_t> sizes = {s.engine.size(), s.seq_len.size(), s.micro_batch_size.size()};
  for (const auto& list : s.settings) sizes.push_back(list.size());
  for (std::size_t n : sizes) runs *= static_cast<double>(n);
  if (runs > static_cast<double>(core::limit_value(core::Limit::SweepRuns)))
    throw SweepError(fmt::format(
        "{}: {}", where,
        core::limit_message(core::Limit::SweepRuns, static_cast<std::int64_t>(std::min(runs, 9e18)), "combinations")));
  // Names that no combination could use are errors in the spec, not rows: say so once, up front.
  const auto engines = sim::engine_names();
  for (const auto& e : s.engine)
    if (std::find(engines.begin(), engines.end(), e) == engines.end())
      throw SweepError(fmt::format("{}: field 'engine': unknown engine '{}'", where, e));
  sim::Cluster cluster;
  try {
    // Named as the spec's field: the default "--cluster" named a flag the sweep does not take.
    cluster = sim::load_cluster(s.cluster, fmt::format("{}: field 'cluster':", where));
  } catch (const core::Error& e) {
    const std::string m = one_line(e.what());
    throw SweepError(m.rfind(where + ": ", 0) == 0 ? m : fmt::format("{}: field 'cluster': {}", where, m));
  }
  // So are a misspelt or broken model and an unreadable calibration: every row would fail alike.
  try {
    (void)core::load_model_config(s.model);
  } catch (const core::Error& e) {
    throw SweepError(fmt::format("{}: field 'model': {}", where, one_line(e.what())));
  }
  if (!s.calibration_path.empty()) {
    try {
      (void)sim::Calibration::load(s.calibration_path);
    } catch (const core::Error& e) {
      throw SweepError(fmt::format("{}: field 'calibration': {}", where, one_line(e.what())));
    }
  }
  // SM partitions: the simulator's rule (sim::compute_rates, the check `simulate --comm-sms` makes:
  // at least one SM left for compute) for every GPU of the cluster, once, rather than one invalid row
  // per combination. Like `simulate`, any count is accepted below that: green contexts' granularity
  // (Hopper: multiples of 8) is the CUDA backend's constraint, and DeepSeek-V3's 20 SMs are not one.
  for (const json& value : s.values("comm_sms")) {
    const int sms = value.get<int>();
    if (sms == 0) continue;
    for (const auto& node : cluster.nodes)
      if (const std::string why = sim::sm_partition_misfit(sms, node.gpu, s.cluster); !why.empty())
        throw SweepError(fmt::format("{}: field 'comm_sms': {}", where, why));
  }
  return s;
}

SweepSpec SweepSpec::load(const std::string& path) {
  return parse(core::read_input_file(path), path, fs::path(path).parent_path().string());
}

SweepSpec SweepSpec::parse(const std::string& text, const std::string& where, const std::string& base_dir) {
  json j;
  try {
    j = core::parse_json(text, where);
  } catch (const json::exception& e) {
    throw SweepError(where + ": not valid JSON: " + one_line(e.what()));
  }
  return from_json(j, where, base_dir);
}

namespace {

// A point's key before any character is escaped: '/' separates fields; numbers use the shortest exact form.
std::string unescaped_key(const SweepPoint& p) {
  std::string k = fmt::format("{}/{}/{}", p.model, p.cluster, p.engine);
  for (const auto& s : core::strategy_settings())
    if (s.essential) k += core::setting_key_part(s, p);
  if (p.seq_len > 0) k += fmt::format("/s{}", p.seq_len);
  if (p.micro_batch_size > 0) k += fmt::format("/m{}", p.micro_batch_size);
  // The other settings only when set, so keys of sweeps without them (and their resume files) are unchanged.
  for (const auto& s : core::strategy_settings())
    if (!s.essential) k += core::setting_key_part(s, p);
  if (!p.calibration.empty()) k += "/calibration=" + p.calibration;
  return k;
}

// The key that piper sweep wrote for `p` before keys were escaped: ',' as ';'. Two settings could share
// it ("c,1.json" and "c;1.json"), so a row under it is taken only when its columns name p's files too.
std::string older_key(const SweepPoint& p) {
  std::string k = unescaped_key(p);
  std::replace(k.begin(), k.end(), ',', ';');
  return k;
}

}  // namespace

std::string SweepPoint::key() const {
  // A comma would need CSV quoting (and `cut -d,` would split the key): it, a line break and '%' are
  // percent-encoded, so that two settings never share a key (a ';' in place of ',' made "c,1.json"
  // and "c;1.json" one). Any other character is kept, so keys without these read as before.
  std::string escaped;
  for (const char c : unescaped_key(*this)) {
    if (c == ',' || c == '%' || c == '\n' || c == '\r')
      escaped += fmt::format("%{:02X}", static_cast<unsigned char>(c));
    else
      escaped += c;
  }
  return escaped;
}

std::vector<SweepPoint> expand(const SweepSpec& s) {
  const auto& table = core::strategy_settings();
  // The dimensions, outermost first: engine, essential settings, seq_len, micro_batch_size, the rest.
  std::vector<std::size_t> essential, other;
  for (std::size_t i = 0; i < table.size(); ++i) (table[i].essential ? essential : other).push_back(i);
  struct Dim {
    std::size_t size;
    std::function<void(SweepPoint&, std::size_t)> set;
  };
  std::vector<Dim> dims;
  dims.push_back({s.engine.size(), [&](SweepPoint& p, std::size_t k) { p.engine = s.engine[k]; }});
  auto setting_dim = [&](std::size_t i) {
    return Dim{s.settings.at(i).size(), [&s, &table, i](SweepPoint& p, std::size_t k) {
                 core::set_setting(table[i], p, s.settings[i][k], table[i].name);
               }};
  };
  for (std::size_t i : essential) dims.push_back(setting_dim(i));
  dims.push_back({s.seq_len.size(), [&](SweepPoint& p, std::size_t k) { p.seq_len = s.seq_len[k]; }});
  dims.push_back(
      {s.micro_batch_size.size(), [&](SweepPoint& p, std::size_t k) { p.micro_batch_size = s.micro_batch_size[k]; }});
  for (std::size_t i : other) dims.push_back(setting_dim(i));
  std::vector<SweepPoint> out;
  for (const auto& d : dims)
    if (d.size == 0) return out;
  std::vector<std::size_t> at(dims.size(), 0);
  while (true) {
    SweepPoint p;
    p.model = s.model;
    p.cluster = s.cluster;
    p.calibration = s.calibration_path;
    for (std::size_t d = 0; d < dims.size(); ++d) dims[d].set(p, at[d]);
    out.push_back(std::move(p));
    // The last dimension varies fastest.
    std::size_t d = dims.size();
    while (d > 0 && ++at[d - 1] == dims[d - 1].size) at[--d] = 0;
    if (d == 0) return out;
  }
}

namespace {

// The settings whose columns sit before the figures, where they were before the settings table: a
// frozen list, so column numbers of existing files (and the `cut -f` of docs and scripts) stay put.
// Every later setting's column goes after `reason`, in table order.
bool column_before_figures(const core::Setting& s) {
  static const std::set<std::string> names = {
      "pp",           "dp",           "ep",        "zero",    "schedule",
      "microbatches", "virtual",      "bucket_mb", "tp",      "sequence_parallel",
      "recompute",    "global_batch", "comm_sms",  "dp_shard"};
  return names.count(s.name) > 0;
}

}  // namespace

const std::vector<std::string>& sweep_csv_columns() {
  static const std::vector<std::string> columns = [] {
    std::vector<std::string> c = {"key", "model", "cluster", "engine"};
    for (const auto& s : core::strategy_settings())
      if (s.essential && column_before_figures(s)) c.push_back(s.name);
    c.push_back("seq_len");
    c.push_back("micro_batch_size");
    for (const auto& s : core::strategy_settings())
      if (!s.essential && column_before_figures(s)) c.push_back(s.name);
    for (const char* figure : {"devices", "step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "peak_memory_bytes",
                               "oom", "compile_time_s", "simulate_time_s", "tp_comm_s", "status", "reason"})
      c.push_back(figure);
    for (const auto& s : core::strategy_settings())
      if (!column_before_figures(s)) c.push_back(s.name);
    return c;
  }();
  return columns;
}

std::string sweep_csv_header() { return csv_header(sweep_csv_columns()); }

namespace {

// The knob columns of a sweep row before its figures (key ... dp_shard), in column order.
std::vector<std::pair<std::string, json>> knob_fields(const SweepPoint& p) {
  std::vector<std::pair<std::string, json>> out = {
      {"key", p.key()}, {"model", p.model}, {"cluster", p.cluster}, {"engine", p.engine}};
  for (const auto& s : core::strategy_settings())
    if (s.essential && column_before_figures(s)) out.emplace_back(s.name, core::setting_value(s, p));
  out.emplace_back("seq_len", p.seq_len);
  out.emplace_back("micro_batch_size", p.micro_batch_size);
  for (const auto& s : core::strategy_settings())
    if (!s.essential && column_before_figures(s)) out.emplace_back(s.name, core::setting_value(s, p));
  return out;
}

}  // namespace

std::string to_csv(const SweepRow& r) {
  const SweepPoint& p = r.point;
  // Figures exist only for simulated rows: an invalid or failed row leaves them blank (a 0 would read
  // as a measured zero: `piper plot` would draw it). {} prints doubles in their shortest round-trip
  // form, so rows compare exactly across runs.
  const bool ok = r.status == "ok";
  auto figure = [&](auto v) { return ok ? fmt::format("{}", v) : std::string(); };
  std::vector<std::string> fields;
  for (const auto& [name, value] : knob_fields(p)) {
    const core::Setting* s = core::find_setting(name);
    fields.push_back(csv_field(s                   ? core::setting_text(*s, p)
                               : value.is_string() ? value.get<std::string>()
                                                   : value.dump()));
  }
  for (std::string f : {r.devices > 0 ? fmt::format("{}", r.devices) : std::string(), figure(r.step_time_s),
                        figure(r.tokens_per_s), figure(r.mfu), figure(r.bubble_fraction), figure(r.peak_memory_bytes),
                        figure(r.oom ? 1 : 0), figure(r.compile_time_s), figure(r.simulate_time_s), figure(r.tp_comm_s),
                        r.status, csv_field(one_line(r.reason))})
    fields.push_back(std::move(f));
  for (const auto& s : core::strategy_settings())
    if (!column_before_figures(s)) fields.push_back(csv_field(core::setting_text(s, p)));
  return fmt::format("{}", fmt::join(fields, ","));
}

nlohmann::json to_json(const SweepRow& r) {
  // As in the CSV, figures of a row that was not simulated are null, not 0.
  const bool ok = r.status == "ok";
  auto figure = [&](auto v) { return ok ? nlohmann::json(v) : nlohmann::json(nullptr); };
  nlohmann::json j = nlohmann::json::object();
  for (auto& [name, value] : knob_fields(r.point)) j[name] = std::move(value);
  j["devices"] = r.devices > 0 ? nlohmann::json(r.devices) : nlohmann::json(nullptr);
  j["step_time_s"] = figure(r.step_time_s);
  j["tokens_per_s"] = figure(r.tokens_per_s);
  j["mfu"] = figure(r.mfu);
  j["bubble_fraction"] = figure(r.bubble_fraction);
  j["peak_memory_bytes"] = figure(r.peak_memory_bytes);
  j["oom"] = figure(r.oom);
  j["compile_time_s"] = figure(r.compile_time_s);
  j["simulate_time_s"] = figure(r.simulate_time_s);
  j["tp_comm_s"] = figure(r.tp_comm_s);
  j["status"] = r.status;
  j["reason"] = one_line(r.reason);
  for (const auto& s : core::strategy_settings())
    if (!column_before_figures(s)) j[s.name] = core::setting_value(s, r.point);
  return j;
}

Outcome simulate_outcome(const core::Scenario& scenario, const std::string& cluster, const std::string& engine,
                         const std::string& calibration_path) {
  Outcome out;
  // A combination the compiler (or the cluster) rejects is "invalid"; one that compiles but fails to
  // simulate (deadlock, engine failure) is "error": the second is worth a bug report, the first is not.
  std::shared_ptr<const core::Program> program;
  try {
    if (!scenario.directives) core::validate_strategy_options(scenario.strategy);
    core::CompiledScenario compiled =
        core::compile_scenario(sim::with_stage_costs(sim::choose_v_ends(scenario, cluster), cluster, calibration_path));
    program = std::make_shared<const core::Program>(std::move(compiled.result.program));
    sim::with_devices(sim::load_cluster(cluster), program->num_devices);
  } catch (const std::exception& e) {
    out.status = "invalid";
    out.reason = one_line(e.what());
    return out;
  }
  try {
    sim::SimulateOptions options;
    options.cluster = cluster;
    options.engine = engine;
    options.calibration_path = calibration_path;
    const sim::SimulationResult result = sim::simulate_program(program, options);
    const sim::Report& r = result.report;
    out.devices = r.devices;
    out.step_time_s = r.step_time_s;
    out.tokens_per_step = r.tokens_per_step;
    out.tokens_per_s = r.tokens_per_s;
    out.mfu = r.mfu;
    out.bubble_fraction = r.bubble_fraction;
    out.peak_memory_bytes = r.peak_memory_bytes;
    out.oom = r.oom;
    out.compile_time_s = r.compile_time_s;
    out.simulate_time_s = r.simulate_time_s;
    out.tp_comm_s = r.critical_path.tp_s;
    out.status = "ok";
  } catch (const std::exception& e) {
    out.status = "error";
    out.reason = one_line(e.what());
    out.devices = program->num_devices;
  }
  return out;
}

SweepRow run_point(const SweepPoint& p, const std::string& calibration_path) {
  core::Scenario scenario;
  scenario.model = p.model;
  scenario.seq_len = p.seq_len;
  scenario.micro_batch_size = p.micro_batch_size;
  scenario.strategy = p.strategy();
  SweepRow row;
  row.point = p;
  try {
    // Loaded here first so that a cluster that fails (the spec's was checked, but a file can change
    // while a sweep runs) is named as the spec's field: the loader's default names --cluster, a flag
    // sweep does not take.
    (void)sim::load_cluster(p.cluster, "field 'cluster':");
  } catch (const std::exception& e) {
    row.status = "invalid";
    row.reason = one_line(e.what());
    return row;
  }
  copy_outcome(simulate_outcome(scenario, p.cluster, p.engine, calibration_path), row);
  return row;
}

namespace {

// The complete rows of a results file (its header checked, a cut last row repaired), each as its fields.
std::vector<std::vector<std::string>> complete_rows(const std::string& path) {
  try {
    // A sweep writes no pruned or bounded rows (the tuner does). read_results refuses any line (an
    // empty one too) that is not a row a sweep could have written.
    return read_results(path, sweep_csv_columns(), "sweep", {"ok", "invalid", "error"}, Repair::CutPartialLine);
  } catch (const ResultsFileError& e) {
    throw SweepError(e.what());
  }
}

}  // namespace

std::set<std::string> repair_results(const std::string& path) {
  std::set<std::string> keys;
  for (const auto& row : complete_rows(path)) keys.insert(row.front());
  return keys;
}

SweepSpec load_sweep_spec(const std::string& path, WorkerPool& pool) {
  // The owner reads the file once (bounded by Limit::InputBytes) and checks it; its verdict and the
  // text go to every process (they need no shared filesystem), so all stop together on a bad spec.
  std::string error, text;
  SweepSpec spec;
  if (pool.owner()) {
    try {
      text = core::read_input_file(path);
      spec = SweepSpec::parse(text, path, fs::path(path).parent_path().string());
    } catch (const std::exception& e) {  // SweepError, or a limit/read error
      error = e.what();
    }
  }
  pool.share(error);
  if (!error.empty()) throw SweepError(error);
  pool.share(text);
  if (!pool.owner()) {
    try {
      spec = SweepSpec::parse(text, path, fs::path(path).parent_path().string());
    } catch (const std::exception& e) {
      pool.abort(e.what());  // the owner parsed the same text: this rank cannot go on alone
    }
  }
  return spec;
}

namespace {

char status_letter(const SweepRow& row) { return row.status == "ok" ? 'o' : row.status == "invalid" ? 'i' : 'e'; }

// On the owner: the combinations of `all` not in the results file yet (by index; two combinations with
// one key run once), and how many were; the file's header checked and its cut last row repaired.
std::vector<std::size_t> pending_points(const std::vector<SweepPoint>& all, const std::string& csv_path,
                                        std::size_t& resumed) {
  const auto& columns = sweep_csv_columns();
  auto column = [&](const char* name) {
    return static_cast<std::size_t>(std::find(columns.begin(), columns.end(), name) - columns.begin());
  };
  const std::size_t model = column("model"), cluster = column("cluster");
  // key -> (model, cluster) of each row under it. A row is a point's when it is under the point's key,
  // or the older one, and its model and cluster columns are the point's: the older keys of two
  // clusters could be one, and an older key can be a newer one's ("c;1.json" was also "c,1.json"'s).
  std::multimap<std::string, std::pair<std::string, std::string>> done;
  for (auto& row : complete_rows(csv_path)) done.emplace(row.front(), std::make_pair(row[model], row[cluster]));
  auto is_done = [&](const SweepPoint& p, const std::string& k) {
    for (const std::string& key : {k, older_key(p)}) {
      const auto [first, last] = done.equal_range(key);
      if (std::any_of(first, last, [&](const auto& row) { return row.second == std::make_pair(p.model, p.cluster); }))
        return true;
    }
    return false;
  };
  std::set<std::string> queued;
  std::vector<std::size_t> pending;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const std::string k = all[i].key();
    if (is_done(all[i], k)) {
      resumed += 1;
      continue;
    }
    if (queued.insert(k).second) pending.push_back(i);
  }
  return pending;
}

}  // namespace

SweepSummary run_sweep(const SweepSpec& spec, const std::string& csv_path, WorkerPool& pool,
                       const SweepOptions& options) {
  SweepSummary summary;
  const std::vector<SweepPoint> all = expand(spec);
  summary.combinations = all.size();
  // The owner checks the results file and opens it for appending; a failure ends every process.
  std::vector<std::size_t> pending;
  std::optional<ResultsAppender> out;
  std::string error;
  if (pool.owner()) {
    try {
      pending = pending_points(all, csv_path, summary.resumed);
      out.emplace(csv_path, sweep_csv_columns());
    } catch (const ResultsFileError& e) {
      error = e.what();
    } catch (const SweepError& e) {
      error = e.what();
    }
  }
  pool.share(error);
  if (!error.empty()) throw SweepError(error);
  pool.share(pending);
  const std::size_t total = summary.resumed + pending.size();
  // Rows computed in this process, until the sink hands them to on_row (rows of other ranks arrive
  // as CSV lines only).
  std::mutex mutex;
  std::map<std::size_t, SweepRow> local;
  std::size_t finished = summary.resumed;
  auto work = [&](std::size_t i) {
    SweepRow row = run_point(all[i], spec.calibration_path);
    const std::string line = status_letter(row) + to_csv(row);
    if (options.on_row) {
      std::lock_guard lock(mutex);
      local.emplace(i, std::move(row));
    }
    return line;
  };
  auto sink = [&](std::size_t i, const std::string& line) {
    try {
      out->append(line.substr(1));
    } catch (const ResultsFileError& e) {
      throw SweepError(e.what());
    }
    summary.ran += 1;
    (line[0] == 'o' ? summary.ok : line[0] == 'i' ? summary.invalid : summary.failed) += 1;
    finished += 1;
    if (!options.on_row) return;
    std::unique_lock lock(mutex);
    auto row = local.extract(i);
    lock.unlock();
    if (!row.empty()) options.on_row(row.mapped(), finished, total);
  };
  pool.run(
      pending, [&](std::size_t i) { return is_simgrid(all[i]); }, work, sink);
  return summary;
}

SweepSummary run_sweep(const SweepSpec& spec, const std::string& csv_path, const SweepOptions& options) {
  ThreadPool pool(options.jobs);
  return run_sweep(spec, csv_path, pool, options);
}

}  // namespace piper::search
