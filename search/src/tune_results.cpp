// The tuner's results: evaluating one candidate, its CSV row and the row read back, the Pareto front
// and the directives of a candidate.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "piper/core/limits.hpp"
#include "piper/core/settings.hpp"
#include "piper/core/strategy.hpp"
#include "piper/search/results_csv.hpp"
#include "piper/search/sweep.hpp"
#include "piper/search/tune.hpp"
#include "tune_internal.hpp"

namespace piper::search {

using namespace detail;

TuneRow evaluate_candidate(const TuneSpec& spec, const TuneCandidate& c, const std::string& engine,
                           std::int64_t estimated_memory_bytes) {
  TuneRow row;
  row.candidate = c;
  core::Scenario scenario;
  try {
    scenario = tune_scenario(spec, c, engine);
  } catch (const std::exception& e) {
    row.engine = engine;
    row.status = "invalid";
    row.reason = e.what();
    row.estimated_memory_bytes = estimated_memory_bytes;
    return row;
  }
  const Outcome o = simulate_outcome(scenario, spec.cluster, engine, spec.calibration_path);
  row.engine = engine;
  row.estimated_memory_bytes = estimated_memory_bytes;
  copy_outcome(o, row);
  return row;
}

const std::vector<std::string>& tune_csv_columns() {
  static const std::vector<std::string> columns = [] {
    std::vector<std::string> c = {
        "key",          "model", "cluster",  "devices",           "global_batch", "seq_len",         "pp",
        "dp",           "ep",    "tp",       "sequence_parallel", "recompute",    "comm_sms",        "dp_shard",
        "reduce_every", "zero",  "schedule", "virtual",           "microbatches", "micro_batch_size"};
    for (const char* more : {"placement", "pp_ranges", "rank_order", "engine", "estimated_memory_bytes", "step_time_s",
                             "tokens_per_s", "mfu", "bubble_fraction", "peak_memory_bytes", "oom", "compile_time_s",
                             "simulate_time_s", "tp_comm_s", "status", "reason"})
      c.push_back(more);
    // After `reason`, so the column numbers of existing files and scripts stay put.
    for (const auto& s : core::strategy_settings())
      if (!named_by_hand(s.name)) c.push_back(s.name);
    return c;
  }();
  return columns;
}

std::string to_csv(const TuneSpec& spec, const TuneRow& r) {
  const TuneCandidate& c = r.candidate;
  // Figures exist only for simulated rows: pruned, bounded, invalid and failed rows leave them blank
  // (a 0 would read as a measured zero), and an unknown memory estimate is blank too.
  // {} prints doubles in their shortest round-trip form, so a row read back compares exactly.
  const bool ok = r.status == "ok";
  auto figure = [&](auto v) { return ok ? fmt::format("{}", v) : std::string(); };
  std::string row = fmt::format(
      "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
      csv_field(c.key()), csv_field(spec.model), csv_field(spec.cluster), spec.devices, spec.effective_global_batch(),
      spec.seq_len, c.pp, c.dp, c.ep, c.tp, c.sequence_parallel ? 1 : 0, csv_field(c.recompute), c.comm_sms, c.dp_shard,
      c.zero >= 2 ? (c.reduce_every == "step" ? "step" : "microbatch") : "", c.zero, csv_field(c.schedule),
      c.virtual_stages, c.microbatches, c.micro_batch_size, csv_field(c.placement), join(c.pp_ranges, ' '),
      join(c.rank_order, ' '), r.engine,
      r.estimated_memory_bytes > 0 ? fmt::format("{}", r.estimated_memory_bytes) : std::string(), figure(r.step_time_s),
      figure(r.tokens_per_s), figure(r.mfu), figure(r.bubble_fraction), figure(r.peak_memory_bytes),
      figure(r.oom ? 1 : 0), figure(r.compile_time_s), figure(r.simulate_time_s), figure(r.tp_comm_s), r.status,
      csv_field(one_line(r.reason)));
  for (const auto& s : core::strategy_settings())
    if (!named_by_hand(s.name)) row += "," + csv_field(core::setting_text(s, c));
  return row;
}

TuneRow tune_row_from_csv(const std::vector<std::string>& f, TuneSpec* spec, const std::string& where) {
  const auto& cols = tune_csv_columns();
  if (f.size() != cols.size()) throw TuneError(fmt::format("{}: {} fields, expected {}", where, f.size(), cols.size()));
  auto at = [&](const char* name) -> const std::string& {
    return f[static_cast<std::size_t>(std::find(cols.begin(), cols.end(), name) - cols.begin())];
  };
  auto number = [&](const char* name) -> double {
    const std::string& s = at(name);
    try {
      std::size_t used = 0;
      const double v = std::stod(s, &used);
      if (used != s.size()) throw std::invalid_argument(s);
      return v;
    } catch (const std::exception&) {
      throw TuneError(fmt::format("{}: column '{}': '{}' is not a number", where, name, s));
    }
  };
  auto integer = [&](const char* name) { return static_cast<std::int64_t>(std::llround(number(name))); };
  // A figure left blank (the row was not simulated, or its estimate is unknown) reads as 0; the status
  // says the row has no figures, and readers look at it first.
  auto figure = [&](const char* name) { return at(name).empty() ? 0.0 : number(name); };
  auto figure_integer = [&](const char* name) { return static_cast<std::int64_t>(std::llround(figure(name))); };
  TuneRow r;
  TuneCandidate& c = r.candidate;
  c.pp = static_cast<int>(integer("pp"));
  c.dp = static_cast<int>(integer("dp"));
  c.ep = static_cast<int>(integer("ep"));
  c.zero = static_cast<int>(integer("zero"));
  c.tp = static_cast<int>(integer("tp"));
  c.cp = static_cast<int>(integer("cp"));
  c.sequence_parallel = integer("sequence_parallel") != 0;
  c.recompute = at("recompute");
  c.comm_sms = static_cast<int>(integer("comm_sms"));
  c.dp_shard = static_cast<int>(integer("dp_shard"));
  c.etp = static_cast<int>(integer("etp"));
  if (at("reduce_every") != "" && at("reduce_every") != "step" && at("reduce_every") != "microbatch")
    throw TuneError(
        fmt::format("{}: column 'reduce_every': '{}' is not microbatch, step or blank", where, at("reduce_every")));
  c.reduce_every = at("reduce_every") == "step" ? "step" : "";
  c.schedule = at("schedule");
  c.virtual_stages = static_cast<int>(integer("virtual"));
  c.microbatches = static_cast<int>(integer("microbatches"));
  c.micro_batch_size = integer("micro_batch_size");
  for (const auto& s : core::strategy_settings())
    if (!named_by_hand(s.name)) try {
        core::set_setting(s, c, core::setting_from_text(s, at(s.name.c_str()), "v"), "v");
      } catch (const core::Error& e) {
        throw TuneError(fmt::format("{}: column '{}': {}", where, s.name, std::string(e.what()).substr(3)));
      }
  c.placement = at("placement");
  auto int_list = [&](const char* name, std::vector<int>& into) {
    std::size_t pos = 0;
    const std::string& text = at(name);
    while (pos < text.size()) {
      const std::size_t end = std::min(text.find(' ', pos), text.size());
      try {
        into.push_back(std::stoi(text.substr(pos, end - pos)));
      } catch (const std::exception&) {
        throw TuneError(fmt::format("{}: column '{}': '{}' is not a list of integers", where, name, text));
      }
      pos = end + 1;
    }
  };
  int_list("pp_ranges", c.pp_ranges);
  int_list("rank_order", c.rank_order);
  if (c.key() != at("key"))
    throw TuneError(fmt::format("{}: column 'key': '{}' does not match the row's knobs", where, at("key")));
  r.engine = at("engine");
  r.status = at("status");
  r.reason = at("reason");
  r.estimated_memory_bytes = figure_integer("estimated_memory_bytes");
  r.devices = static_cast<int>(integer("devices"));
  r.step_time_s = figure("step_time_s");
  r.tokens_per_s = figure("tokens_per_s");
  r.mfu = figure("mfu");
  r.bubble_fraction = figure("bubble_fraction");
  r.peak_memory_bytes = figure_integer("peak_memory_bytes");
  r.oom = figure_integer("oom") != 0;
  r.compile_time_s = figure("compile_time_s");
  r.simulate_time_s = figure("simulate_time_s");
  r.tp_comm_s = figure("tp_comm_s");
  if (spec) {
    spec->model = at("model");
    spec->cluster = at("cluster");
    spec->devices = r.devices;
    spec->global_batch = integer("global_batch");
    spec->seq_len = integer("seq_len");
  }
  return r;
}

std::vector<TuneRow> read_tune_results(const std::string& csv_path, TuneSpec* spec, Repair repair) {
  std::vector<std::vector<std::string>> rows;
  try {
    rows = read_results(csv_path, tune_csv_columns(), "tune", every_result_status(), repair);
  } catch (const ResultsFileError& e) {
    throw TuneError(e.what());
  }
  // Every row names its search (model, cluster, devices, global batch, sequence); a file holds one
  // search, so a row of another (pasted or appended by hand) would pass for one of this search's.
  std::vector<TuneRow> out;
  TuneSpec first;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    TuneSpec row_spec;
    const std::string where = fmt::format("{}: line {}", csv_path, i + 2);
    out.push_back(tune_row_from_csv(rows[i], &row_spec, where));
    if (i == 0) {
      first = row_spec;
    } else if (!same_search(row_spec, first)) {
      throw TuneError(
          fmt::format("{}: a row of another search ({} on {} x {}, global batch {}, seq_len {}) than "
                      "line 2's ({} on {} x {}, global batch {}, seq_len {}); a tune file holds one search",
                      where, core::printable(row_spec.model), row_spec.devices, core::printable(row_spec.cluster),
                      row_spec.global_batch, row_spec.seq_len, core::printable(first.model), first.devices,
                      core::printable(first.cluster), first.global_batch, first.seq_len));
    }
  }
  if (spec && !rows.empty()) {
    spec->model = first.model;
    spec->cluster = first.cluster;
    spec->devices = first.devices;
    spec->global_batch = first.global_batch;
    spec->seq_len = first.seq_len;
  }
  return out;
}

std::vector<TuneRow> pareto_front(std::vector<TuneRow> rows) {
  std::erase_if(rows, [](const TuneRow& r) { return r.status != "ok"; });
  std::sort(rows.begin(), rows.end(), [](const TuneRow& a, const TuneRow& b) {
    return a.peak_memory_bytes != b.peak_memory_bytes ? a.peak_memory_bytes < b.peak_memory_bytes
                                                      : a.tokens_per_s > b.tokens_per_s;
  });
  std::vector<TuneRow> front;
  for (auto& r : rows)
    if (front.empty() || r.tokens_per_s > front.back().tokens_per_s) front.push_back(std::move(r));
  return front;
}

nlohmann::json tune_directives(const TuneSpec& spec, const TuneCandidate& c) {
  try {
    return core::compile_scenario(tune_scenario(spec, c)).program.to_json();
  } catch (const core::Error& e) {
    throw TuneError(e.what());
  }
}

}  // namespace piper::search
