// The tuner's driver (run_tune): the memory cap, resuming from the results file, then the phases:
// prune by the memory bound, analytic simulations in waves (branch and bound on the step time
// bound), placement and rank-order variants of the leaders, the top K on SimGrid, and the summary.
#include <algorithm>
#include <chrono>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "piper/core/limits.hpp"
#include "piper/search/results_csv.hpp"
#include "piper/search/tune.hpp"
#include "piper/search/worker_pool.hpp"
#include "piper/sim/cluster.hpp"
#include "tune_internal.hpp"

namespace piper::search {

using namespace detail;

namespace {

using Done = std::map<std::pair<std::string, std::string>, TuneRow>;  // (key, engine) -> row

// The plan each analytic row's candidate stands for: at PP 1 with one region per rank, schedule
// families that differ only in name order the same ops, so candidates equal but for the family whose
// analytic rows have the same step time and peak memory are one plan, named by the first of them
// (by key). Other candidates stand for themselves.
std::map<std::string, std::string> plans_of(const Done& done) {
  std::map<std::tuple<std::string, double, std::int64_t>, std::string> first;
  std::map<std::string, std::string> plan;
  for (const auto& [id, row] : done) {
    if (id.second != "analytic" || row.status != "ok" || row.candidate.pp != 1 || row.candidate.virtual_stages != 1)
      continue;
    TuneCandidate unnamed = row.candidate;
    unnamed.schedule.clear();
    plan[id.first] = first.try_emplace({unnamed.key(), row.step_time_s, row.peak_memory_bytes}, id.first).first->second;
  }
  return plan;
}

// `rows` (best first) less the rows whose plan an earlier row already stands for.
std::vector<TuneRow> distinct_plans(std::vector<TuneRow> rows, const std::map<std::string, std::string>& plan_of) {
  std::set<std::string> seen;
  std::vector<TuneRow> out;
  for (auto& row : rows) {
    const std::string key = row.candidate.key();
    const auto plan = plan_of.find(key);
    if (!seen.insert(plan == plan_of.end() ? key : plan->second).second) continue;
    out.push_back(std::move(row));
  }
  return out;
}

// Faster first; ties (equal step times) go to the smaller memory peak, then the key, so the order is
// stable across runs and thread counts.
bool better(const TuneRow& a, const TuneRow& b) {
  if (a.step_time_s != b.step_time_s) return a.step_time_s < b.step_time_s;
  if (a.peak_memory_bytes != b.peak_memory_bytes) return a.peak_memory_bytes < b.peak_memory_bytes;
  return a.candidate.key() < b.candidate.key();
}

// One search: its state shared by the phases, each phase one method (run_tune calls them in order).
class Search {
 public:
  Search(const TuneSpec& spec, const TuneOptions& options) : spec_(spec), options_(options) {}
  void set_memory_cap();
  void resume(const std::string& csv_path);
  std::vector<TuneCandidate> prune_by_memory(const std::vector<TuneCandidate>& candidates);
  void analytic_waves(const std::vector<TuneCandidate>& candidates, const std::vector<TuneCandidate>& survivors);
  void placement_phase();
  void simgrid_phase();
  TuneSummary finish();
  TuneSummary& summary() { return summary_; }

 private:
  double elapsed() const { return std::chrono::duration<double>(Clock::now() - started_).count(); }
  bool over_budget() const { return elapsed() >= deadline_; }
  void progress(const std::string& phase, std::size_t finished, std::size_t total) const {
    if (options_.on_progress) options_.on_progress({phase, finished, total, elapsed()});
  }
  double threshold() const;
  void note_time(const TuneRow& row);
  void record(const TuneRow& row);
  std::int64_t estimate_of(const TuneCandidate& c) const {
    const auto it = estimate_.find(c.key());
    return it != estimate_.end() ? it->second : 0;
  }
  std::vector<TuneCandidate> by_bound(std::vector<TuneCandidate> list);
  bool skip_bounded(const TuneCandidate& c);
  void simulate_all(const std::string& phase, const std::vector<TuneCandidate>& list);
  std::vector<TuneRow> fitting_analytic(bool distinct = true) const;
  std::vector<TuneCandidate> with_estimates(std::vector<TuneCandidate> list);

  using Clock = std::chrono::steady_clock;
  const TuneSpec& spec_;
  const TuneOptions& options_;
  const Clock::time_point started_ = Clock::now();
  double deadline_ = std::numeric_limits<double>::infinity();
  TuneSummary summary_;
  double cap_ = 0;
  std::size_t exact_top_ = 1;
  Done done_;
  std::optional<ResultsAppender> out_;
  std::mutex mutex_;
  std::multiset<double> best_times_;              // step times of the fitting analytic rows
  std::map<std::string, std::int64_t> estimate_;  // memory lower bound by key
  std::map<std::string, double> time_bound_;      // step time lower bound by key
};

// The memory cap: given, or the smallest HBM less a reserve for what the simulator does not model.
void Search::set_memory_cap() {
  // Before any work: 10^6 devices spun 307 s in the per-device memory cap loop below.
  core::check_limit(core::Limit::Devices, spec_.devices, "--devices", "devices");
  sim::Cluster cluster;
  try {
    cluster = sim::with_devices(sim::load_cluster(spec_.cluster), spec_.devices);
  } catch (const core::Error& e) {
    throw TuneError(e.what());
  }
  summary_.hbm_bytes = std::numeric_limits<double>::infinity();
  for (int d = 0; d < spec_.devices; ++d)
    summary_.hbm_bytes = std::min(summary_.hbm_bytes, static_cast<double>(cluster.device_hbm_bytes(d, spec_.devices)));
  summary_.memory_cap_bytes = spec_.memory_cap_bytes;
  if (summary_.memory_cap_bytes <= 0) {
    // The default cap: the HBM less a reserve for what the simulator does not model (see tune.hpp).
    summary_.memory_reserve_bytes = spec_.memory_reserve_bytes >= 0
                                        ? spec_.memory_reserve_bytes
                                        : kDefaultMemoryReserveFraction * summary_.hbm_bytes;
    if (summary_.memory_reserve_bytes >= summary_.hbm_bytes)
      throw TuneError(fmt::format("--memory-reserve-gib {:.2f}: leaves nothing of the {:.2f} GiB of HBM",
                                  summary_.memory_reserve_bytes / 1073741824.0, summary_.hbm_bytes / 1073741824.0));
    summary_.memory_cap_bytes = summary_.hbm_bytes - summary_.memory_reserve_bytes;
  }
  cap_ = summary_.memory_cap_bytes;
  deadline_ = options_.budget_s > 0 ? options_.budget_s : std::numeric_limits<double>::infinity();
  // Branch and bound keeps the exact_top best step times: a candidate whose step time lower bound
  // exceeds the exact_top-th best cannot enter the best exact_top and is not simulated (without a
  // calibration, whose measured times the bound does not know).
  exact_top_ = static_cast<std::size_t>(std::max({spec_.exact_top, spec_.top_k, 1}));
}

// Rows of this search already in the file, by key and engine; the file then takes the new rows.
void Search::resume(const std::string& csv_path) {
  TuneSpec file_spec, searched = spec_;
  searched.global_batch = spec_.effective_global_batch();  // what the rows record
  // Every row names the same search as the first (read_tune_results checks it).
  const std::vector<TuneRow> rows = read_tune_results(csv_path, &file_spec, Repair::CutPartialLine);
  if (!rows.empty() && !same_search(file_spec, searched)) {
    // What differs, said: a cluster given inline, or with --runtime, read like the file's own search.
    std::vector<std::string> differs;
    auto compare = [&](const char* field, const std::string& file, const std::string& now) {
      if (file != now)
        differs.push_back(
            fmt::format("{} '{}' (the file's: '{}')", field, core::printable(now, 200), core::printable(file, 200)));
    };
    compare("model", file_spec.model, searched.model);
    compare("cluster", file_spec.cluster, searched.cluster);
    compare("devices", std::to_string(file_spec.devices), std::to_string(searched.devices));
    compare("global batch", std::to_string(file_spec.global_batch), std::to_string(searched.global_batch));
    // A seq_len of 0 is the model's own (no --seq-len), which "seq_len 0" did not say.
    auto seq_len = [](std::int64_t s) { return s > 0 ? std::to_string(s) : std::string("the model's"); };
    compare("seq_len", seq_len(file_spec.seq_len), seq_len(searched.seq_len));
    throw TuneError(fmt::format(
        "{}: holds a tune of {} on {} x {} (global batch {}, {}); this search has {}; choose another -o", csv_path,
        core::printable(file_spec.model, 200), file_spec.devices, core::printable(file_spec.cluster, 200),
        file_spec.global_batch, file_spec.seq_len > 0 ? "seq_len " + seq_len(file_spec.seq_len) : "the model's seq_len",
        fmt::join(differs, ", ")));
  }
  // The tune CSV records no calibration, so a row cannot say whether measured times made it; a
  // calibrated search (the library's TuneSpec; neither the CLI nor piper.tune takes one) would take
  // uncalibrated rows, or another calibration's, as its own. It starts a file of its own instead.
  if (!rows.empty() && !spec_.calibration_path.empty())
    throw TuneError(
        fmt::format("{}: a tune with a calibration ({}) cannot resume a results file: its rows do not "
                    "record which calibration, if any, made them; choose another -o",
                    csv_path, spec_.calibration_path));
  for (const auto& row : rows) done_[{row.candidate.key(), row.engine}] = row;
  summary_.resumed = done_.size();
  try {
    out_.emplace(csv_path, tune_csv_columns());
  } catch (const ResultsFileError& e) {
    throw TuneError(e.what());
  }
  for (const auto& [id, row] : done_) note_time(row);
}

double Search::threshold() const {
  if (best_times_.size() < exact_top_) return std::numeric_limits<double>::infinity();
  return *std::next(best_times_.begin(), static_cast<std::ptrdiff_t>(exact_top_) - 1);
}

void Search::note_time(const TuneRow& row) {
  if (row.engine != "analytic" || !row.fits(cap_)) return;
  best_times_.insert(row.step_time_s);
  if (best_times_.size() > exact_top_) best_times_.erase(std::prev(best_times_.end()));
}

void Search::record(const TuneRow& row) {
  out_->append(to_csv(spec_, row));
  done_[{row.candidate.key(), row.engine}] = row;
  note_time(row);
}

// Phase 1: the memory lower bound of every candidate; those above the cap are pruned (recorded so the
// CSV lists every candidate, and a rerun need not estimate them again). Returns the others.
std::vector<TuneCandidate> Search::prune_by_memory(const std::vector<TuneCandidate>& candidates) {
  std::vector<TuneCandidate> survivors;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const TuneCandidate& c = candidates[i];
    const std::string k = c.key();
    auto pruned_row = done_.find({k, ""});
    std::int64_t bound = 0;
    if (pruned_row != done_.end()) {
      bound = pruned_row->second.estimated_memory_bytes;
    } else {
      auto analytic = done_.find({k, "analytic"});
      bound = analytic != done_.end() ? analytic->second.estimated_memory_bytes : memory_lower_bound(spec_, c);
    }
    estimate_[k] = bound;
    if (static_cast<double>(bound) > cap_) {
      summary_.pruned += 1;
      if (pruned_row == done_.end()) {
        TuneRow row;
        row.candidate = c;
        row.status = "pruned";
        row.reason =
            fmt::format("memory lower bound {:.2f} GiB > cap {:.2f} GiB", bound / 1073741824.0, cap_ / 1073741824.0);
        row.estimated_memory_bytes = bound;
        record(row);
      }
    } else {
      survivors.push_back(c);
    }
    if (i % 64 == 63 || i + 1 == candidates.size()) progress("estimate", i + 1, candidates.size());
  }
  return survivors;
}

// `list` ordered by the step time lower bound (best first): the threshold falls fast, and once one
// candidate's bound exceeds it, so do all later ones'.
std::vector<TuneCandidate> Search::by_bound(std::vector<TuneCandidate> list) {
  std::vector<std::pair<double, std::size_t>> order;
  for (std::size_t i = 0; i < list.size(); ++i) {
    double lb = 0;
    try {
      lb = step_time_lower_bound(spec_, list[i]);
    } catch (const std::exception&) {
      // No bound: simulated first, and the simulation reports what is wrong with it.
    }
    time_bound_[list[i].key()] = lb;
    order.push_back({lb, i});
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<TuneCandidate> sorted;
  for (const auto& [lb, i] : order) sorted.push_back(std::move(list[i]));
  return sorted;
}

// Under the lock: whether c's step time bound exceeds the exact_top-th best (then c is recorded as
// bounded, once, and not simulated).
bool Search::skip_bounded(const TuneCandidate& c) {
  const auto lb = time_bound_.find(c.key());
  const double limit = threshold();
  if (lb == time_bound_.end() || lb->second <= limit) return false;
  summary_.bounded += 1;
  auto old = done_.find({c.key(), ""});
  if (old == done_.end() || old->second.status != "bounded") {
    TuneRow row;
    row.candidate = c;
    row.status = "bounded";
    row.reason = fmt::format("step time lower bound {:.3f} ms > the {} best {:.3f} ms", lb->second * 1e3,
                             ordinal(static_cast<long long>(exact_top_)), limit * 1e3);
    row.estimated_memory_bytes = estimate_of(c);
    record(row);
  }
  return true;
}

// Analytic simulations of `list` in parallel; rows already in the file are skipped. The budget stops
// the pool (the summary says where).
void Search::simulate_all(const std::string& phase, const std::vector<TuneCandidate>& list) {
  std::vector<std::size_t> todo;
  for (std::size_t i = 0; i < list.size(); ++i)
    if (!done_.count({list[i].key(), "analytic"})) todo.push_back(i);
  std::size_t finished = list.size() - todo.size();
  progress(phase, finished, list.size());
  const std::size_t started_items = run_pool(
      todo.size(), options_.jobs,
      [&](std::size_t j) {
        const TuneCandidate& c = list[todo[j]];
        {
          std::lock_guard lock(mutex_);
          if (skip_bounded(c)) {
            progress(phase, ++finished, list.size());
            return;
          }
        }
        const TuneRow row = evaluate_candidate(spec_, c, "analytic", estimate_of(c));
        std::lock_guard lock(mutex_);
        record(row);
        summary_.ran += 1;
        progress(phase, ++finished, list.size());
      },
      [this] { return over_budget(); });
  if (started_items < todo.size() && summary_.stopped.empty()) {
    summary_.budget_exhausted = true;
    summary_.stopped =
        fmt::format("{}: {} of {} simulated", phase, list.size() - todo.size() + started_items, list.size());
  }
}

// Best first, one row per distinct plan (so the leaders and the SimGrid top K are distinct plans).
std::vector<TuneRow> Search::fitting_analytic(bool distinct) const {
  std::vector<TuneRow> rows;
  for (const auto& [id, row] : done_)
    if (id.second == "analytic" && row.fits(cap_)) rows.push_back(row);
  std::sort(rows.begin(), rows.end(), better);
  return distinct ? distinct_plans(std::move(rows), plans_of(done_)) : rows;
}

// Phase 2 in waves by recompute mode, lightest first. Recomputation adds work (the same ops with a
// longer backward) to save memory, so a plan whose lighter twin (same strategy, the next lighter mode
// tried) fits the cap is normally slower than that twin: such plans are deferred to a last wave,
// which a budget cuts first. They are not skipped: the simulated step is not monotone in op durations
// everywhere (a longer backward can shift when a transfer starts; tiny models show heavier modes up
// to a few per cent faster, see test_sim_tune), so without a budget every survivor is simulated (or
// bounded) and the result equals a brute force. ZeRO levels are not treated so: ZeRO-1 shards the
// optimizer step and is often faster than ZeRO-0.
void Search::analytic_waves(const std::vector<TuneCandidate>& candidates, const std::vector<TuneCandidate>& survivors) {
  std::vector<std::string> modes;
  for (const auto& c : candidates)
    if (std::find(modes.begin(), modes.end(), c.recompute) == modes.end()) modes.push_back(c.recompute);
  // Lightest first: none, selective (the attention core), op (half the matmuls and the element-wise
  // work), full (the whole block).
  auto weight = [](const std::string& m) { return m == "op" ? 1.5 : static_cast<double>(recompute_level(m)); };
  std::sort(modes.begin(), modes.end(),
            [&](const std::string& a, const std::string& b) { return weight(a) < weight(b); });
  std::set<std::string> deferred_keys;
  std::vector<TuneCandidate> deferred;
  for (std::size_t mi = 0; mi < modes.size() && !summary_.budget_exhausted; ++mi) {
    std::vector<TuneCandidate> todo;
    for (const auto& c : survivors) {
      if (c.recompute != modes[mi]) continue;
      if (mi > 0) {
        TuneCandidate twin = c;
        twin.recompute = modes[mi - 1];
        const std::string tk = twin.key();
        auto row = done_.find({tk, "analytic"});
        if (deferred_keys.count(tk) || (row != done_.end() && row->second.fits(cap_))) {
          deferred_keys.insert(c.key());
          deferred.push_back(c);
          continue;
        }
      }
      todo.push_back(c);
    }
    if (!todo.empty()) simulate_all(modes.size() > 1 ? "analytic " + modes[mi] : "analytic", by_bound(std::move(todo)));
  }
  summary_.dominated = deferred.size();
  if (!summary_.budget_exhausted) simulate_all("analytic, dominated", by_bound(std::move(deferred)));
}

// The memory bounds of new variants, noted for their rows.
std::vector<TuneCandidate> Search::with_estimates(std::vector<TuneCandidate> list) {
  for (const auto& v : list) estimate_[v.key()] = memory_lower_bound(spec_, v);
  return list;
}

// Phase 3: PP placement alternatives for the leading strategies (default placements only), then the
// order of the pipeline ranks on the device groups, for the leaders with their best boundaries (only
// where groups differ: rank_order_variants returns none on uniform clusters), and Megatron's device
// order for leaders whose expert groups it puts on fewer nodes (device_order_variants).
void Search::placement_phase() {
  if (!spec_.placement_search || summary_.budget_exhausted) return;
  const int leaders = spec_.placement_leaders > 0 ? spec_.placement_leaders : std::max(spec_.top_k, 4);
  std::vector<TuneCandidate> variants;
  int taken = 0;
  for (const auto& row : fitting_analytic()) {
    if (taken >= leaders) break;
    if (!row.candidate.pp_ranges.empty()) continue;
    taken += 1;
    try {
      for (auto& v : placement_variants(spec_, row.candidate)) variants.push_back(std::move(v));
    } catch (const std::exception&) {
      // A candidate whose placement cannot be varied (one region) keeps its default.
    }
  }
  simulate_all("placement", by_bound(with_estimates(std::move(variants))));
  std::vector<TuneCandidate> orders;
  std::set<std::string> strategies;
  for (const auto& row : fitting_analytic()) {
    if (static_cast<int>(strategies.size()) >= leaders) break;
    TuneCandidate plain = row.candidate;
    plain.pp_ranges.clear();
    plain.rank_order.clear();
    if (!strategies.insert(plain.key()).second || !row.candidate.rank_order.empty()) continue;
    try {
      for (auto& v : rank_order_variants(spec_, row.candidate)) orders.push_back(std::move(v));
      for (auto& v : device_order_variants(spec_, row.candidate)) orders.push_back(std::move(v));
    } catch (const std::exception&) {
      // Keeps the generator's order.
    }
  }
  simulate_all("rank order", by_bound(with_estimates(std::move(orders))));
}

// Phase 4: the top K on the SimGrid engine, one at a time (it forks a child per run).
void Search::simgrid_phase() {
  std::vector<TuneCandidate> leaders;
  for (const auto& row : fitting_analytic())
    if (static_cast<int>(leaders.size()) < spec_.top_k) leaders.push_back(row.candidate);
  std::size_t finished = 0;
  for (const auto& c : leaders) {
    if (done_.count({c.key(), "simgrid"})) {
      progress("simgrid", ++finished, leaders.size());
      continue;
    }
    if (over_budget()) {
      summary_.budget_exhausted = true;
      if (summary_.stopped.empty())
        summary_.stopped = fmt::format("simgrid: {} of {} re-simulated", finished, leaders.size());
      break;
    }
    record(evaluate_candidate(spec_, c, "simgrid", estimate_of(c)));
    summary_.ran += 1;
    progress("simgrid", ++finished, leaders.size());
  }
}

// The summary over everything in the file (this run and earlier ones): counts, and the ranking
// (SimGrid rows first, then the analytic rows not re-simulated; one row per distinct plan).
TuneSummary Search::finish() {
  for (const auto& [id, row] : done_) {
    if (id.second == "analytic") {
      summary_.simulated += 1;
      if (!row.candidate.pp_ranges.empty() || !row.candidate.rank_order.empty() ||
          row.candidate.device_order != core::StrategyOptions().device_order)
        summary_.placement_variants += 1;
      if (row.fits(cap_)) summary_.fitting += 1;
    } else if (id.second == "simgrid") {
      summary_.simgrid += 1;
    }
  }
  std::vector<TuneRow> simgrid_rows;
  std::set<std::string> resimulated;
  for (const auto& [id, row] : done_)
    if (id.second == "simgrid") {
      resimulated.insert(id.first);
      if (row.fits(cap_)) simgrid_rows.push_back(row);
    }
  std::sort(simgrid_rows.begin(), simgrid_rows.end(), better);
  std::vector<TuneRow> ranked = simgrid_rows;
  for (const auto& row : fitting_analytic(false))
    if (!resimulated.count(row.candidate.key())) ranked.push_back(row);
  summary_.ranked = distinct_plans(ranked, plans_of(done_));
  summary_.coinciding = ranked.size() - summary_.ranked.size();
  summary_.elapsed_s = elapsed();
  return summary_;
}

}  // namespace

TuneSummary run_tune(const TuneSpec& spec, const std::string& csv_path, const TuneOptions& options) {
  Search search(spec, options);
  search.set_memory_cap();
  const std::vector<TuneCandidate> candidates = enumerate_candidates(spec, &search.summary().enumeration);
  // Pins that exclude each other (--pp 2 --dp 4 on 4 devices, a --dp-shard no DP degree takes) are bad
  // input, not a search that found no plan that fits: one line before anything is written.
  if (candidates.empty()) {
    const EnumerationStats& e = search.summary().enumeration;
    std::string why;
    if (e.batch_indivisible > 0)
      why += fmt::format("; {} left out: the global batch is not a multiple of DP x micro batch size",
                         e.batch_indivisible);
    throw TuneError(
        fmt::format("nothing to search: no plan on {} devices takes every given knob (--pp, --dp, --ep, "
                    "--dp-shard, --zero, --global-batch, --micro-batch-size, --schedules){}",
                    spec.devices, why));
  }
  // A knob given explicitly that no candidate can take would be dropped from every plan without a
  // word (`--sequence-parallel on` with only TP 1, `--reduce-every step` with only ZeRO-0/1).
  const auto any = [&](auto pred) { return std::any_of(candidates.begin(), candidates.end(), pred); };
  if (spec.sequence_parallel == std::vector<bool>{true} &&
      !any([](const TuneCandidate& c) { return c.sequence_parallel; }))
    throw TuneError(
        "--sequence-parallel on: no candidate has a TP degree of 2 or more, where sequence parallelism applies "
        "(give --tp 2 or more, or drop --sequence-parallel)");
  // (`microbatch` alone is not checked: callers pin it to leave the axis out, whatever the ZeRO levels.)
  if (std::find(spec.reduce_every.begin(), spec.reduce_every.end(), "step") != spec.reduce_every.end() &&
      !any([](const TuneCandidate& c) { return c.zero >= 2; }))
    throw TuneError(
        "--reduce-every step applies to ZeRO-2/3, and no candidate has ZeRO 2 or 3 (more than one data-parallel "
        "replica and --zero 2 or 3), so it would be ignored");
  search.summary().candidates = candidates.size();
  search.resume(csv_path);
  const std::vector<TuneCandidate> survivors = search.prune_by_memory(candidates);
  search.analytic_waves(candidates, survivors);
  search.placement_phase();
  search.simgrid_phase();
  return search.finish();
}

}  // namespace piper::search
