// Sweeps: spec parsing, cartesian expansion, one simulation per combination, and a resumable
// append-only CSV (complete rows are kept; a partial last line from a killed run is cut off).
#include "piper/sim/sweep.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>

#include "piper/core/limits.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/suggest.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/results_csv.hpp"
#include "piper/sim/simulate.hpp"

namespace piper::sim {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// A knob is a value or a list of values; each value must have type T.
template <class T>
std::vector<T> knob(const json& j, const char* field, const std::string& where, const std::vector<T>& fallback) {
  if (!j.contains(field)) return fallback;
  const json& v = j.at(field);
  std::vector<T> out;
  auto one = [&](const json& x) {
    bool ok;
    if constexpr (std::is_same_v<T, std::string>) ok = x.is_string();
    else if constexpr (std::is_same_v<T, bool>) ok = x.is_boolean();
    else if constexpr (std::is_floating_point_v<T>) ok = x.is_number();
    else ok = x.is_number_integer();
    if (!ok)
      throw SweepError(fmt::format("{}: field '{}': expected {} or a list of them, got {}", where, field,
                                   std::is_same_v<T, std::string> ? "a string" : std::is_same_v<T, bool> ? "true/false" : std::is_floating_point_v<T> ? "a number" : "an integer",
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

SweepSpec SweepSpec::from_json(const json& j, const std::string& where, const std::string& base_dir) {
  if (!j.is_object()) throw SweepError(where + ": expected a JSON object with model, cluster and knob lists");
  static const std::set<std::string> known = {"model", "cluster", "calibration", "pp", "dp", "ep", "zero", "schedule",
                                              "microbatches", "virtual", "bucket_mb", "engine", "seq_len",
                                              "micro_batch_size", "comment", "tp", "sequence_parallel",
                                              "recompute", "global_batch", "comm_sms", "dp_shard", "etp"};
  for (const auto& [k, v] : j.items())
    if (!known.count(k)) {
      const std::string near = core::nearest(k, std::vector<std::string>(known.begin(), known.end()));
      if (!near.empty()) throw SweepError(fmt::format("{}: unknown field '{}' (did you mean '{}'?)", where, k, near));
      std::string list;
      for (const auto& n : known) list += (list.empty() ? "" : ", ") + n;
      throw SweepError(fmt::format("{}: unknown field '{}' (expected one of: {})", where, k, list));
    }
  SweepSpec s;
  auto text = [&](const char* field, std::string fallback) {
    if (!j.contains(field)) return fallback;
    if (!j.at(field).is_string()) throw SweepError(fmt::format("{}: field '{}': expected a string", where, field));
    return j.at(field).get<std::string>();
  };
  s.model = resolve(text("model", s.model), base_dir);
  s.cluster = resolve(text("cluster", s.cluster), base_dir);
  s.calibration_path = resolve(text("calibration", ""), base_dir);
  s.pp = knob(j, "pp", where, s.pp);
  s.dp = knob(j, "dp", where, s.dp);
  s.ep = knob(j, "ep", where, s.ep);
  s.zero = knob(j, "zero", where, s.zero);
  s.schedule = knob(j, "schedule", where, s.schedule);
  s.microbatches = knob(j, "microbatches", where, s.microbatches);
  s.virtual_stages = knob(j, "virtual", where, s.virtual_stages);
  s.bucket_mb = knob(j, "bucket_mb", where, s.bucket_mb);
  s.engine = knob(j, "engine", where, s.engine);
  s.seq_len = knob(j, "seq_len", where, s.seq_len);
  s.micro_batch_size = knob(j, "micro_batch_size", where, s.micro_batch_size);
  s.tp = knob(j, "tp", where, s.tp);
  s.sequence_parallel = knob(j, "sequence_parallel", where, s.sequence_parallel);
  s.recompute = knob(j, "recompute", where, s.recompute);
  s.global_batch = knob(j, "global_batch", where, s.global_batch);
  s.comm_sms = knob(j, "comm_sms", where, s.comm_sms);
  s.dp_shard = knob(j, "dp_shard", where, s.dp_shard);
  s.etp = knob(j, "etp", where, s.etp);
  for (int k : s.dp_shard)
    if (k < 0) throw SweepError(fmt::format("{}: field 'dp_shard': {} is negative (0: plain ZeRO, N >= 2: HSDP over groups of N replicas)", where, k));
  for (const auto& r : s.recompute)
    if (r != "none" && r != "selective" && r != "full")
      throw SweepError(fmt::format("{}: field 'recompute': unknown mode '{}' (expected none, selective or full)", where, r));
  // The combinations multiply: refuse an absurd sweep before expanding it (limits.hpp).
  double runs = 1;  // a double cannot overflow here: at most ~10^8 values per list in an input file
  for (std::size_t n : {s.pp.size(), s.dp.size(), s.ep.size(), s.zero.size(), s.schedule.size(), s.microbatches.size(),
                        s.virtual_stages.size(), s.bucket_mb.size(), s.engine.size(), s.seq_len.size(),
                        s.micro_batch_size.size(), s.tp.size(), s.sequence_parallel.size(),
                        s.recompute.size(), s.global_batch.size(), s.comm_sms.size(), s.dp_shard.size(), s.etp.size()})
    runs *= static_cast<double>(n);
  if (runs > static_cast<double>(core::limit_value(core::Limit::SweepRuns)))
    throw SweepError(fmt::format("{}: {}", where,
                                 core::limit_message(core::Limit::SweepRuns, static_cast<std::int64_t>(std::min(runs, 9e18)),
                                                     "combinations")));
  // Names that no combination could use are errors in the spec, not rows: say so once, up front.
  const auto engines = engine_names();
  for (const auto& e : s.engine)
    if (std::find(engines.begin(), engines.end(), e) == engines.end())
      throw SweepError(fmt::format("{}: field 'engine': unknown engine '{}'", where, e));
  for (const auto& name : s.schedule) {
    try {
      core::schedule_family(name);
    } catch (const std::invalid_argument& e) {
      throw SweepError(fmt::format("{}: field 'schedule': {}", where, one_line(e.what())));
    }
  }
  Cluster cluster;
  try {
    cluster = load_cluster(s.cluster);
  } catch (const core::Error& e) {
    throw SweepError(fmt::format("{}: field 'cluster': {}", where, one_line(e.what())));
  }
  // SM partitions: the simulator's rule (sim::compute_rates, the check `simulate --comm-sms` makes:
  // at least one SM left for compute) for every GPU of the cluster, once, rather than one invalid row
  // per combination. Like `simulate`, any count is accepted below that: green contexts' granularity
  // (Hopper: multiples of 8) is the CUDA backend's constraint, and DeepSeek-V3's 20 SMs are not one.
  for (int sms : s.comm_sms) {
    if (sms < 0) throw SweepError(fmt::format("{}: field 'comm_sms': {} is negative (0: SMs shared, N >= 1: an sm_partition of N SMs)", where, sms));
    if (sms == 0) continue;
    for (const auto& node : cluster.nodes)
      if (const std::string why = sm_partition_misfit(sms, node.gpu); !why.empty())
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

std::string SweepPoint::key() const {
  // '/' separates fields (commas would need CSV quoting); bucket_mb uses the shortest exact form.
  std::string k = fmt::format("{}/{}/{}/pp{}/dp{}/ep{}/z{}/{}/mb{}/v{}/b{}", model, cluster, engine, pp, dp, ep, zero,
                              schedule, microbatches, virtual_stages, bucket_mb);
  if (seq_len > 0) k += fmt::format("/s{}", seq_len);
  if (micro_batch_size > 0) k += fmt::format("/m{}", micro_batch_size);
  // Written only when set, so keys of sweeps without them (and their resume files) are unchanged.
  if (tp != 1) k += fmt::format("/tp{}", tp);
  if (sequence_parallel) k += "/sp";
  if (recompute != "none") k += "/rc-" + recompute;
  if (global_batch > 0) k += fmt::format("/gb{}", global_batch);
  if (comm_sms > 0) k += fmt::format("/sms{}", comm_sms);
  if (dp_shard > 0) k += fmt::format("/hs{}", dp_shard);
  if (etp != 1) k += fmt::format("/etp{}", etp);
  std::replace(k.begin(), k.end(), ',', ';');
  return k;
}

std::vector<SweepPoint> expand(const SweepSpec& s) {
  std::vector<SweepPoint> out;
  for (const auto& engine : s.engine)
    for (int pp : s.pp)
      for (int dp : s.dp)
        for (int ep : s.ep)
          for (int zero : s.zero)
            for (const auto& schedule : s.schedule)
              for (int mb : s.microbatches)
                for (int v : s.virtual_stages)
                  for (double bucket : s.bucket_mb)
                    for (auto seq : s.seq_len)
                      for (auto mbs : s.micro_batch_size)
                        for (int tp : s.tp)
                          for (bool sp : s.sequence_parallel)
                            for (const auto& rc : s.recompute)
                              for (int gb : s.global_batch)
                                for (int sms : s.comm_sms)
                                  for (int hs : s.dp_shard)
                                    for (int etp : s.etp)
                                      out.push_back({s.model, s.cluster, engine, schedule, pp, dp, ep, zero, mb, v, bucket,
                                                     seq, mbs, tp, gb, sp, rc, sms, hs, etp});
  return out;
}

const std::vector<std::string>& sweep_csv_columns() {
  static const std::vector<std::string> columns = {
      "key", "model", "cluster", "engine", "pp", "dp", "ep", "zero", "schedule", "microbatches", "virtual",
      "bucket_mb", "seq_len", "micro_batch_size", "tp", "sequence_parallel", "recompute", "global_batch", "comm_sms", "dp_shard", "etp", "devices", "step_time_s", "tokens_per_s", "mfu",
      "bubble_fraction", "peak_memory_bytes", "oom", "compile_time_s", "simulate_time_s", "tp_comm_s", "status", "reason"};
  return columns;
}

std::string sweep_csv_header() { return csv_header(sweep_csv_columns()); }

std::string to_csv(const SweepRow& r) {
  const SweepPoint& p = r.point;
  // Figures exist only for simulated rows: an invalid or failed row leaves them blank (a 0 would read
  // as a measured zero: `piper plot` would draw it). {} prints doubles in their shortest round-trip
  // form, so rows compare exactly across runs.
  const bool ok = r.status == "ok";
  auto figure = [&](auto v) { return ok ? fmt::format("{}", v) : std::string(); };
  return fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}", csv_field(p.key()),
                     csv_field(p.model), csv_field(p.cluster), csv_field(p.engine), p.pp, p.dp, p.ep, p.zero,
                     csv_field(p.schedule), p.microbatches, p.virtual_stages, p.bucket_mb, p.seq_len,
                     p.micro_batch_size, p.tp, p.sequence_parallel ? 1 : 0, p.recompute, p.global_batch, p.comm_sms, p.dp_shard, p.etp,
                     r.devices > 0 ? fmt::format("{}", r.devices) : std::string(), figure(r.step_time_s),
                     figure(r.tokens_per_s), figure(r.mfu), figure(r.bubble_fraction), figure(r.peak_memory_bytes),
                     figure(r.oom ? 1 : 0), figure(r.compile_time_s), figure(r.simulate_time_s), figure(r.tp_comm_s),
                     r.status, csv_field(one_line(r.reason)));
}

nlohmann::json to_json(const SweepRow& r) {
  const SweepPoint& p = r.point;
  // As in the CSV, figures of a row that was not simulated are null, not 0.
  const bool ok = r.status == "ok";
  auto figure = [&](auto v) { return ok ? nlohmann::json(v) : nlohmann::json(nullptr); };
  return {{"key", p.key()},
          {"model", p.model},
          {"cluster", p.cluster},
          {"engine", p.engine},
          {"pp", p.pp},
          {"dp", p.dp},
          {"ep", p.ep},
          {"zero", p.zero},
          {"schedule", p.schedule},
          {"microbatches", p.microbatches},
          {"virtual", p.virtual_stages},
          {"bucket_mb", p.bucket_mb},
          {"seq_len", p.seq_len},
          {"micro_batch_size", p.micro_batch_size},
          {"tp", p.tp},
          {"sequence_parallel", p.sequence_parallel},
          {"recompute", p.recompute},
          {"global_batch", p.global_batch},
          {"comm_sms", p.comm_sms},
          {"dp_shard", p.dp_shard},
          {"etp", p.etp},
          {"devices", r.devices > 0 ? nlohmann::json(r.devices) : nlohmann::json(nullptr)},
          {"step_time_s", figure(r.step_time_s)},
          {"tokens_per_s", figure(r.tokens_per_s)},
          {"mfu", figure(r.mfu)},
          {"bubble_fraction", figure(r.bubble_fraction)},
          {"peak_memory_bytes", figure(r.peak_memory_bytes)},
          {"oom", figure(r.oom)},
          {"compile_time_s", figure(r.compile_time_s)},
          {"simulate_time_s", figure(r.simulate_time_s)},
          {"tp_comm_s", figure(r.tp_comm_s)},
          {"status", r.status},
          {"reason", one_line(r.reason)}};
}

Outcome simulate_outcome(const core::Scenario& scenario, const std::string& cluster, const std::string& engine,
                         const std::string& calibration_path) {
  Outcome out;
  // A combination the compiler (or the cluster) rejects is "invalid"; one that compiles but fails to
  // simulate (deadlock, engine failure) is "error": the second is worth a bug report, the first is not.
  std::shared_ptr<const core::Program> program;
  try {
    if (!scenario.directives) core::validate_strategy_options(scenario.strategy);
    core::CompiledScenario compiled = core::compile_scenario(scenario);
    program = std::make_shared<const core::Program>(std::move(compiled.result.program));
    with_devices(load_cluster(cluster), program->num_devices);
  } catch (const std::exception& e) {
    out.status = "invalid";
    out.reason = one_line(e.what());
    return out;
  }
  try {
    SimulateOptions options;
    options.cluster = cluster;
    options.engine = engine;
    options.calibration_path = calibration_path;
    const SimulationResult result = simulate_program(program, options);
    const Report& r = result.report;
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
  scenario.strategy.pp = p.pp;
  scenario.strategy.dp = p.dp;
  scenario.strategy.ep = p.ep;
  scenario.strategy.zero = p.zero;
  scenario.strategy.schedule = p.schedule;
  scenario.strategy.microbatches = p.microbatches;
  scenario.strategy.virtual_stages = p.virtual_stages;
  scenario.strategy.bucket_mb = p.bucket_mb;
  scenario.strategy.tp = p.tp;
  scenario.strategy.sequence_parallel = p.sequence_parallel;
  scenario.strategy.recompute = p.recompute;
  scenario.strategy.global_batch = p.global_batch;
  scenario.strategy.comm_sms = p.comm_sms;
  scenario.strategy.dp_shard = p.dp_shard;
  scenario.strategy.etp = p.etp;
  const Outcome o = simulate_outcome(scenario, p.cluster, p.engine, calibration_path);
  SweepRow row;
  row.point = p;
  copy_outcome(o, row);
  return row;
}

std::set<std::string> repair_results(const std::string& path) {
  std::set<std::string> keys;
  try {
    // The columns each later version added, oldest first (a new column is one more entry here).
    static const std::vector<std::vector<std::string>> added = {
        {"tp", "sequence_parallel", "recompute", "global_batch"}, {"comm_sms"}, {"dp_shard"}, {"tp_comm_s"}, {"etp"}};
    for (const auto& fields : read_results(path, sweep_csv_columns(), "sweep", added)) keys.insert(fields.front());
  } catch (const ResultsFileError& e) {
    throw SweepError(e.what());
  }
  return keys;
}

SweepSummary run_sweep(const SweepSpec& spec, const std::string& csv_path, const SweepOptions& options) {
  SweepSummary summary;
  const std::vector<SweepPoint> all = expand(spec);
  summary.combinations = all.size();
  const std::set<std::string> done = repair_results(csv_path);
  std::vector<SweepPoint> parallel, serial;
  std::set<std::string> queued;
  for (const auto& p : all) {
    const std::string k = p.key();
    if (done.count(k)) {
      summary.resumed += 1;
      continue;
    }
    if (!queued.insert(k).second) continue;  // a value listed twice in the spec
    (is_simgrid(p) ? serial : parallel).push_back(p);
  }
  const std::size_t total = summary.resumed + parallel.size() + serial.size();

  std::optional<ResultsAppender> out;
  try {
    out.emplace(csv_path, sweep_csv_columns());
  } catch (const ResultsFileError& e) {
    throw SweepError(e.what());
  }
  std::mutex mutex;
  std::size_t finished = summary.resumed;
  auto record = [&](const SweepRow& row) {
    try {
      out->append(to_csv(row));
    } catch (const ResultsFileError& e) {
      throw SweepError(e.what());
    }
    std::lock_guard lock(mutex);
    summary.ran += 1;
    (row.status == "ok" ? summary.ok : row.status == "invalid" ? summary.invalid : summary.failed) += 1;
    finished += 1;
    if (options.on_row) options.on_row(row, finished, total);
  };
  run_pool(parallel.size(), options.jobs, [&](std::size_t i) { record(run_point(parallel[i], spec.calibration_path)); });
  // The simgrid engine forks a child per run; forking while other threads may hold locks (allocator
  // arenas aside, e.g. stdio or a registry mutex) could deadlock the child, so these run alone.
  for (const auto& p : serial) record(run_point(p, spec.calibration_path));
  return summary;
}

}  // namespace piper::sim
