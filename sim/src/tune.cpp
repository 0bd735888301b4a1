// The strategy search: enumeration from the schedule registry (never from schedule names), a
// closed-form memory lower bound for pruning, cost-model-balanced PP placements, parallel analytic
// ranking, SimGrid re-simulation of the leaders, and a resumable CSV of every row.
#include "piper/sim/tune.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>

#include <fmt/format.h>

#include "piper/core/model.hpp"
#include "piper/core/strategy.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/results_csv.hpp"
#include "piper/sim/sweep.hpp"

namespace piper::sim {

using nlohmann::json;

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

std::string join(const std::vector<int>& v, char sep) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? std::string(1, sep) : "") + std::to_string(v[i]);
  return s;
}

// The strategy knobs of a candidate (what the generator and the schedule family read).
core::StrategyOptions strategy_of(const TuneCandidate& c) {
  core::StrategyOptions o;
  o.pp = c.pp;
  o.dp = c.dp;
  o.ep = c.ep;
  o.zero = c.zero;
  o.schedule = c.schedule;
  o.microbatches = c.microbatches;
  o.virtual_stages = c.virtual_stages;
  return o;
}

core::ModelConfig model_config(const TuneSpec& spec, std::int64_t micro_batch_size) {
  core::Scenario s;
  s.model = spec.model;
  s.seq_len = spec.seq_len;
  s.micro_batch_size = micro_batch_size;
  return core::scenario_model_config(s);
}

// Pipeline units as balance_pipeline counts them: one per transformer block (the embedding joins the
// first, the final norm and head the last).
int pipeline_units(const core::ModelConfig& cfg) { return static_cast<int>(cfg.layers); }

// The pipeline ranks that run region i: its rank, and for a mirrored family also the opposite rank.
std::vector<std::vector<int>> ranks_of_regions(const std::vector<int>& rank_of_region, int pp, bool mirrored) {
  std::vector<std::vector<int>> out;
  for (int r : rank_of_region) {
    std::vector<int> ranks{r};
    if (mirrored && pp - 1 - r != r) ranks.push_back(pp - 1 - r);
    out.push_back(ranks);
  }
  return out;
}

// Region of every layer and the first block of every region, from a model's PP tags.
std::vector<int> starts_of(const core::Model& model, int regions) {
  std::vector<int> starts(static_cast<std::size_t>(regions), -1);
  for (const auto& l : model.layers()) {
    if (l.block < 0) continue;
    const int r = l.tags.at("PP");
    if (starts[static_cast<std::size_t>(r)] < 0) starts[static_cast<std::size_t>(r)] = l.block;
  }
  return starts;
}

// The model of candidate c with its PP regions annotated exactly as compile_scenario annotates them.
// The placement only depends on (family, pp, regions) and the model on the micro batch size, so the
// program is generated with one data-parallel replica (cheap at any scale).
core::Model annotated_model(const TuneSpec& spec, const TuneCandidate& c) {
  core::Scenario s = tune_scenario(spec, c);
  s.strategy.dp = 1;
  s.strategy.ep = 1;
  s.strategy.zero = 0;
  const core::ModelConfig cfg = core::scenario_model_config(s);
  core::Model model = core::build_model(cfg);
  int regions = 0;
  const json program = core::scenario_program(s, &regions);
  core::annotate_regions(s, model, program, regions);
  return model;
}

struct RegionPlacement {
  int regions = 0;
  std::vector<int> rank_of_region;
  bool mirrored = false;
};

RegionPlacement placement_of(const TuneCandidate& c) {
  const core::StrategyOptions o = strategy_of(c);
  const core::ScheduleFamily& family = core::schedule_family(c.schedule);
  RegionPlacement p;
  p.regions = family.regions(o);
  p.rank_of_region = family.placement(o, p.regions);
  p.mirrored = family.mirrored;
  return p;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Candidates
// ---------------------------------------------------------------------------------------------

std::string TuneCandidate::key() const {
  std::string k = fmt::format("pp{}/dp{}/ep{}/z{}/{}/v{}/mb{}/m{}/{}", pp, dp, ep, zero, schedule, virtual_stages,
                              microbatches, micro_batch_size, pp_ranges.empty() ? "default" : "r" + join(pp_ranges, '.'));
  std::replace(k.begin(), k.end(), ',', ';');
  return k;
}

std::string TuneCandidate::describe() const {
  std::string s = fmt::format("PP {} x DP {}", pp, dp);
  if (ep > 1) s += fmt::format(" (EP {})", ep);
  s += fmt::format(", {}", schedule);
  if (virtual_stages > 1) s += fmt::format(" ({} regions/rank)", virtual_stages);
  s += fmt::format(", {} microbatches of {}, ZeRO-{}", microbatches, micro_batch_size, zero);
  if (!pp_ranges.empty()) s += fmt::format(", PP starts {} ({})", join(pp_ranges, ','), placement);
  return s;
}

core::Scenario tune_scenario(const TuneSpec& spec, const TuneCandidate& c, const std::string& engine) {
  core::Scenario s;
  s.model = spec.model;
  s.seq_len = spec.seq_len;
  s.micro_batch_size = c.micro_batch_size;
  s.strategy = strategy_of(c);
  s.stage_starts = c.pp_ranges;
  s.cluster = spec.cluster;
  s.engine = engine;
  return s;
}

std::vector<TuneCandidate> enumerate_candidates(const TuneSpec& spec, EnumerationStats* stats_out) {
  EnumerationStats stats;
  std::vector<TuneCandidate> out;
  if (spec.devices < 1) throw TuneError(fmt::format("--devices must be >= 1 (got {})", spec.devices));
  const std::int64_t batch = spec.effective_global_batch();
  std::vector<const core::ScheduleFamily*> families;
  for (const auto& f : core::schedule_registry())
    if (spec.schedules.empty() || std::find(spec.schedules.begin(), spec.schedules.end(), f.name) != spec.schedules.end())
      families.push_back(&f);
  for (const auto& name : spec.schedules) {
    try {
      core::schedule_family(name);
    } catch (const std::invalid_argument& e) {
      throw TuneError(e.what());
    }
  }
  std::map<std::int64_t, core::ModelConfig> configs;
  for (auto mbs : spec.micro_batch_sizes) {
    if (mbs < 1) throw TuneError(fmt::format("--micro-batch-size must be >= 1 (got {})", mbs));
    try {
      configs[mbs] = model_config(spec, mbs);
    } catch (const core::Error& e) {
      throw TuneError(e.what());
    }
  }
  const core::ModelConfig& cfg = configs.begin()->second;
  const int units = pipeline_units(cfg);
  // Tensor parallelism would be one more loop here (pp x tp x dp = devices).
  for (int pp : divisors(spec.devices)) {
    if (pp > units) continue;
    const int dp = spec.devices / pp;
    for (int ep : divisors(dp)) {
      // Expert parallelism shards experts over consecutive groups of ep data-parallel replicas.
      if (ep > 1 && (cfg.experts <= 0 || cfg.experts % ep != 0)) continue;
      for (auto mbs : spec.micro_batch_sizes) {
        const std::int64_t per_replica = static_cast<std::int64_t>(dp) * mbs;
        for (const auto* family : families) {
          std::set<int> regions_seen;
          for (int v = 1; v <= std::max(1, spec.max_virtual); ++v) {
            stats.considered += 1;
            if (batch % per_replica != 0) {
              stats.batch_indivisible += 1;
              continue;
            }
            TuneCandidate c;
            c.pp = pp;
            c.dp = dp;
            c.ep = ep;
            c.schedule = family->name;
            c.micro_batch_size = mbs;
            c.microbatches = static_cast<int>(batch / per_replica);
            c.virtual_stages = v;
            // The family says what it accepts: its region count for v (families with a fixed shape
            // refuse other values or return the same count), then its schedule for these knobs.
            int regions = 0;
            try {
              regions = family->regions(strategy_of(c));
            } catch (const std::invalid_argument&) {
              stats.family_rejected += 1;
              continue;
            }
            if (regions_seen.count(regions)) continue;  // the same shape as a smaller v: not a new candidate
            regions_seen.insert(regions);
            if (regions > units || regions % pp != 0) {
              stats.family_rejected += 1;
              continue;
            }
            c.virtual_stages = regions / pp;
            try {
              const core::StrategyOptions o = strategy_of(c);
              if (family->regions(o) != regions) throw std::invalid_argument("region count changed");
              core::schedule_directives(o, family->placement(o, regions));
            } catch (const std::invalid_argument&) {
              stats.family_rejected += 1;
              continue;
            }
            // ZeRO levels differ only when a region has more than one replica.
            const int replicas = dp * (family->mirrored ? 2 : 1);
            for (int z : spec.zero_levels) {
              if (z < 0 || z > 3) throw TuneError(fmt::format("ZeRO level {} is not 0..3", z));
              if (replicas == 1 && z != spec.zero_levels.front()) continue;
              c.zero = replicas == 1 ? 0 : z;
              out.push_back(c);
            }
          }
        }
      }
    }
  }
  stats.legal = out.size();
  if (stats_out) *stats_out = stats;
  return out;
}

// ---------------------------------------------------------------------------------------------
// Memory lower bound
// ---------------------------------------------------------------------------------------------

namespace {

// Activations alive on a rank when its forwards start, from its step order. Steps run one after
// another (each order group waits for the previous one), so when the last segment of the forward in
// step i starts, every forward of an earlier step has allocated its activations, and a microbatch's
// activations are still held unless its first backward action (B, or I when split) ran in an earlier
// step. Actions sharing step i (an overlapped F&B pair) may run in either order, so their frees
// count as done. A free that really waits for a later W only makes the true peak larger.
std::int64_t in_flight_bound(const std::vector<core::ScheduleStep>& steps, const std::vector<std::int64_t>& activation_of_region) {
  std::map<std::pair<int, int>, std::size_t> first_backward;  // (stage, microbatch) -> step
  for (std::size_t i = 0; i < steps.size(); ++i)
    for (const auto& a : steps[i])
      if (a.kind == core::ActionKind::B || a.kind == core::ActionKind::I) first_backward.try_emplace({a.stage, a.microbatch}, i);
  auto act = [&](int stage) {
    return stage >= 0 && stage < static_cast<int>(activation_of_region.size()) ? activation_of_region[static_cast<std::size_t>(stage)] : 0;
  };
  std::int64_t best = 0;
  std::vector<std::pair<std::pair<int, int>, std::size_t>> started;  // forwards of earlier steps
  for (std::size_t i = 0; i < steps.size(); ++i) {
    std::int64_t held = 0;
    for (const auto& [id, step] : started) {
      auto it = first_backward.find(id);
      if (it == first_backward.end() || it->second > i) held += act(id.first);
    }
    for (const auto& a : steps[i])
      if (a.kind == core::ActionKind::F) best = std::max(best, held + act(a.stage));
    for (const auto& a : steps[i])
      if (a.kind == core::ActionKind::F) started.push_back({{a.stage, a.microbatch}, i});
    // Forwards whose backward already ran can never count again: drop them (keeps this linear-ish).
    std::erase_if(started, [&](const auto& e) {
      auto it = first_backward.find(e.first);
      return it != first_backward.end() && it->second <= i;
    });
  }
  return best;
}

}  // namespace

std::int64_t memory_lower_bound(const TuneSpec& spec, const TuneCandidate& c) {
  const core::Model model = annotated_model(spec, c);
  const RegionPlacement place = placement_of(c);
  const int dt = core::bytes_per_element(model.training().precision);
  const std::int64_t state_bytes = model.training().precision == core::Precision::FP32 ? 8 : 12;
  // Devices holding a region: dp per rank, twice that for a mirrored family (the two copies).
  const std::int64_t region_devices = static_cast<std::int64_t>(c.dp) * (place.mirrored ? 2 : 1);
  std::vector<std::int64_t> persistent_of_region(static_cast<std::size_t>(place.regions), 0);
  std::vector<std::int64_t> activation_of_region(static_cast<std::size_t>(place.regions), 0);
  for (std::size_t i = 0; i < model.layers().size(); ++i) {
    const core::Layer& layer = model.layers()[i];
    const int r = layer.tags.at("PP");
    const core::Costs costs = model.layer_cost(i);
    // Lowering sizes each segment's state as params/shard * bytes / (replicas if sharded by ZeRO),
    // with integer division; summing it per layer rounds down at least as much, so it stays a bound.
    const bool expert = layer.tags.contains("EP") && c.ep > 1;
    const std::int64_t shard = expert ? c.ep : 1;
    const std::int64_t replicas = std::max<std::int64_t>(1, region_devices / shard);
    const std::int64_t params = costs.params / shard;
    persistent_of_region[static_cast<std::size_t>(r)] += params * dt / (c.zero >= 3 ? replicas : 1) +
                                                         params * dt / (c.zero >= 2 ? replicas : 1) +
                                                         params * state_bytes / (c.zero >= 1 ? replicas : 1);
    activation_of_region[static_cast<std::size_t>(r)] += costs.activation_bytes / shard;
  }
  // The schedule's per-rank step order, when it has one: order directives run a rank's steps one
  // after another, so the activations in flight at each forward are known (see in_flight_bound).
  std::optional<core::ScheduleTable> table;
  try {
    const core::ScheduleFamily& family = core::schedule_family(c.schedule);
    core::ScheduleContext ctx;
    ctx.ranks = c.pp;
    ctx.regions = place.regions;
    ctx.microbatches = c.microbatches;
    ctx.virtual_stages = c.virtual_stages;
    ctx.rank_of_region = place.rank_of_region;
    ctx.mirrored = place.mirrored;
    table = family.table(ctx);
    if (static_cast<int>(table->ranks.size()) != c.pp) table.reset();
  } catch (const std::invalid_argument&) {
    table.reset();  // e.g. several regions per rank in a family ordered per region
  }
  std::int64_t peak = 0;
  for (int rank = 0; rank < c.pp; ++rank) {
    std::int64_t persistent = 0, chain[2] = {0, 0};
    for (int r = 0; r < place.regions; ++r) {
      const int home = place.rank_of_region[static_cast<std::size_t>(r)];
      const bool first = home == rank;
      const bool second = place.mirrored && c.pp - 1 - home == rank;
      if (!first && !second) continue;
      // A region on both copies of one rank (the middle rank of an odd mirrored pipeline) is still
      // one set of buffers per device.
      persistent += persistent_of_region[static_cast<std::size_t>(r)];
      chain[first ? 0 : 1] += activation_of_region[static_cast<std::size_t>(r)];
    }
    // Without a table: one microbatch's forward passes through every region of a model copy before
    // any of its backward passes start, so the activations it leaves on a device (one per region the
    // copy has there) are all alive together. The two copies of a mirrored family are separate
    // chains: count the larger.
    std::int64_t transient = std::max(chain[0], chain[1]);
    if (table) transient = std::max(transient, in_flight_bound(table->ranks[static_cast<std::size_t>(rank)], activation_of_region));
    peak = std::max(peak, persistent + transient);
  }
  return peak;
}

// ---------------------------------------------------------------------------------------------
// Placement search
// ---------------------------------------------------------------------------------------------

std::vector<int> effective_pp_ranges(const TuneSpec& spec, const TuneCandidate& c) {
  if (!c.pp_ranges.empty()) return c.pp_ranges;
  return starts_of(annotated_model(spec, c), placement_of(c).regions);
}

namespace {

// Compute seconds of each pipeline unit (block) under the cost model's roofline: F + B of every layer
// in the unit, experts divided by their shard degree. This is what FLOP balancing misses: the
// memory-bound embedding and loss, and the efficiency curve of small GEMMs.
std::vector<double> unit_seconds(const TuneSpec& spec, const TuneCandidate& c) {
  const core::ModelConfig cfg = model_config(spec, c.micro_batch_size);
  const core::Model model = core::build_model(cfg);
  const CostModel cost(with_devices(load_cluster(spec.cluster), spec.devices));
  std::vector<double> out(static_cast<std::size_t>(cfg.layers), 0.0);
  for (std::size_t i = 0; i < model.layers().size(); ++i) {
    const core::Layer& l = model.layers()[i];
    const std::size_t unit = l.block < 0 ? (i == 0 ? 0 : out.size() - 1) : static_cast<std::size_t>(l.block);
    core::Costs k = model.layer_cost(i);
    // As the shard pass costs experts: EP divides their weights (and weight traffic), not the
    // per-device FLOPs, since each device computes every token routed to its experts.
    const double shard = l.tags.contains("EP") ? c.ep : 1;
    out[unit] += cost.roofline_seconds(0, k.forward_flops, static_cast<std::int64_t>(k.forward_memory_bytes / shard),
                                       k.forward_gemm_kernels) +
                 cost.roofline_seconds(0, k.backward_flops(), static_cast<std::int64_t>(k.backward_memory_bytes / shard),
                                       k.backward_input_gemm_kernels + k.backward_weight_gemm_kernels);
  }
  return out;
}

// Device loads (sorted, busiest first) of region starts `st` over units with costs `w`.
std::vector<double> rank_loads(const std::vector<int>& st, const std::vector<double>& w,
                               const std::vector<std::vector<int>>& ranks_of_region, int pp) {
  std::vector<double> load(static_cast<std::size_t>(pp), 0.0);
  const int regions = static_cast<int>(st.size());
  for (int r = 0; r < regions; ++r) {
    const int end = r + 1 < regions ? st[static_cast<std::size_t>(r) + 1] : static_cast<int>(w.size());
    double sum = 0;
    for (int u = st[static_cast<std::size_t>(r)]; u < end; ++u) sum += w[static_cast<std::size_t>(u)];
    for (int rank : ranks_of_region[static_cast<std::size_t>(r)]) load[static_cast<std::size_t>(rank)] += sum;
  }
  std::sort(load.rbegin(), load.rend());
  return load;
}

// Contiguous regions minimising the largest region cost (exact DP), then single-block boundary moves
// that lower the sorted device loads (busiest first) when regions share devices.
std::vector<int> balance_by_time(const std::vector<double>& w, const std::vector<std::vector<int>>& ranks_of_region, int pp) {
  const int n = static_cast<int>(w.size());
  const int k = static_cast<int>(ranks_of_region.size());
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[static_cast<std::size_t>(i) + 1] = prefix[static_cast<std::size_t>(i)] + w[static_cast<std::size_t>(i)];
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<std::size_t>(k) + 1, std::vector<double>(static_cast<std::size_t>(n) + 1, inf));
  std::vector<std::vector<int>> from(static_cast<std::size_t>(k) + 1, std::vector<int>(static_cast<std::size_t>(n) + 1, -1));
  best[0][0] = 0;
  for (int a = 1; a <= k; ++a)
    for (int j = a; j <= n; ++j)
      for (int i = a - 1; i < j; ++i) {
        const double v = std::max(best[static_cast<std::size_t>(a) - 1][static_cast<std::size_t>(i)],
                                  prefix[static_cast<std::size_t>(j)] - prefix[static_cast<std::size_t>(i)]);
        if (v < best[static_cast<std::size_t>(a)][static_cast<std::size_t>(j)])
          best[static_cast<std::size_t>(a)][static_cast<std::size_t>(j)] = v, from[static_cast<std::size_t>(a)][static_cast<std::size_t>(j)] = i;
      }
  std::vector<int> st(static_cast<std::size_t>(k), 0);
  for (int a = k, j = n; a >= 1; --a) {
    const int i = from[static_cast<std::size_t>(a)][static_cast<std::size_t>(j)];
    st[static_cast<std::size_t>(a) - 1] = i;
    j = i;
  }
  auto current = rank_loads(st, w, ranks_of_region, pp);
  for (bool improved = true; improved;) {
    improved = false;
    std::vector<int> best_st = st;
    for (int r = 1; r < k; ++r)
      for (int step : {-1, 1}) {
        std::vector<int> trial = st;
        trial[static_cast<std::size_t>(r)] += step;
        const int next = r + 1 < k ? trial[static_cast<std::size_t>(r) + 1] : n;
        if (trial[static_cast<std::size_t>(r)] <= trial[static_cast<std::size_t>(r) - 1] || trial[static_cast<std::size_t>(r)] >= next) continue;
        auto l = rank_loads(trial, w, ranks_of_region, pp);
        if (l < current) current = l, best_st = trial, improved = true;
      }
    st = best_st;
  }
  return st;
}

}  // namespace

std::vector<TuneCandidate> placement_variants(const TuneSpec& spec, const TuneCandidate& c) {
  std::vector<TuneCandidate> out;
  const RegionPlacement place = placement_of(c);
  if (place.regions < 2) return out;
  const std::vector<double> w = unit_seconds(spec, c);
  const auto ranks = ranks_of_regions(place.rank_of_region, c.pp, place.mirrored);
  const std::vector<int> timed = balance_by_time(w, ranks, c.pp);
  TuneCandidate base = c;
  base.pp_ranges.clear();
  base.placement = "default";
  std::set<std::vector<int>> seen{effective_pp_ranges(spec, base)};
  auto add = [&](std::vector<int> starts, const std::string& label) {
    const int n = static_cast<int>(w.size());
    for (std::size_t r = 1; r < starts.size(); ++r)
      if (starts[r] <= starts[r - 1]) return;
    if (starts.back() >= n || !seen.insert(starts).second) return;
    TuneCandidate v = base;
    v.pp_ranges = std::move(starts);
    v.placement = label;
    out.push_back(std::move(v));
  };
  add(timed, "time-balanced");
  for (int step : {-1, 1}) {
    std::vector<int> moved = timed;
    moved.back() += step;
    add(moved, step < 0 ? "time-balanced, head region +1 block" : "time-balanced, head region -1 block");
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Rows and the CSV
// ---------------------------------------------------------------------------------------------

TuneRow evaluate_candidate(const TuneSpec& spec, const TuneCandidate& c, const std::string& engine,
                           std::int64_t estimated_memory_bytes) {
  const Outcome o = simulate_outcome(tune_scenario(spec, c, engine), spec.cluster, engine, spec.calibration_path);
  TuneRow row;
  row.candidate = c;
  row.engine = engine;
  row.estimated_memory_bytes = estimated_memory_bytes;
  copy_outcome(o, row);
  return row;
}

const std::vector<std::string>& tune_csv_columns() {
  static const std::vector<std::string> columns = {
      "key", "model", "cluster", "devices", "global_batch", "seq_len", "pp", "dp", "ep", "zero", "schedule", "virtual",
      "microbatches", "micro_batch_size", "placement", "pp_ranges", "engine", "estimated_memory_bytes", "step_time_s",
      "tokens_per_s", "mfu", "bubble_fraction", "peak_memory_bytes", "oom", "compile_time_s", "simulate_time_s",
      "status", "reason"};
  return columns;
}

std::string to_csv(const TuneSpec& spec, const TuneRow& r) {
  const TuneCandidate& c = r.candidate;
  // {} prints doubles in their shortest round-trip form, so a row read back compares exactly.
  return fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
                     csv_field(c.key()), csv_field(spec.model), csv_field(spec.cluster), spec.devices,
                     spec.effective_global_batch(), spec.seq_len, c.pp, c.dp, c.ep, c.zero, csv_field(c.schedule),
                     c.virtual_stages, c.microbatches, c.micro_batch_size, csv_field(c.placement), join(c.pp_ranges, ' '),
                     r.engine, r.estimated_memory_bytes, r.step_time_s, r.tokens_per_s, r.mfu, r.bubble_fraction,
                     r.peak_memory_bytes, r.oom ? 1 : 0, r.compile_time_s, r.simulate_time_s, r.status,
                     csv_field(one_line(r.reason)));
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
  TuneRow r;
  TuneCandidate& c = r.candidate;
  c.pp = static_cast<int>(integer("pp"));
  c.dp = static_cast<int>(integer("dp"));
  c.ep = static_cast<int>(integer("ep"));
  c.zero = static_cast<int>(integer("zero"));
  c.schedule = at("schedule");
  c.virtual_stages = static_cast<int>(integer("virtual"));
  c.microbatches = static_cast<int>(integer("microbatches"));
  c.micro_batch_size = integer("micro_batch_size");
  c.placement = at("placement");
  std::size_t pos = 0;
  const std::string& ranges = at("pp_ranges");
  while (pos < ranges.size()) {
    const std::size_t end = std::min(ranges.find(' ', pos), ranges.size());
    try {
      c.pp_ranges.push_back(std::stoi(ranges.substr(pos, end - pos)));
    } catch (const std::exception&) {
      throw TuneError(fmt::format("{}: column 'pp_ranges': '{}' is not a list of blocks", where, ranges));
    }
    pos = end + 1;
  }
  if (c.key() != at("key")) throw TuneError(fmt::format("{}: column 'key': '{}' does not match the row's knobs", where, at("key")));
  r.engine = at("engine");
  r.status = at("status");
  r.reason = at("reason");
  r.estimated_memory_bytes = integer("estimated_memory_bytes");
  r.devices = static_cast<int>(integer("devices"));
  r.step_time_s = number("step_time_s");
  r.tokens_per_s = number("tokens_per_s");
  r.mfu = number("mfu");
  r.bubble_fraction = number("bubble_fraction");
  r.peak_memory_bytes = integer("peak_memory_bytes");
  r.oom = integer("oom") != 0;
  r.compile_time_s = number("compile_time_s");
  r.simulate_time_s = number("simulate_time_s");
  if (spec) {
    spec->model = at("model");
    spec->cluster = at("cluster");
    spec->devices = r.devices;
    spec->global_batch = integer("global_batch");
    spec->seq_len = integer("seq_len");
  }
  return r;
}

std::vector<TuneRow> read_tune_results(const std::string& csv_path, TuneSpec* spec) {
  std::vector<std::vector<std::string>> rows;
  try {
    rows = read_results(csv_path, tune_csv_columns(), "tune");
  } catch (const ResultsFileError& e) {
    throw TuneError(e.what());
  }
  std::vector<TuneRow> out;
  for (std::size_t i = 0; i < rows.size(); ++i)
    out.push_back(tune_row_from_csv(rows[i], i == 0 ? spec : nullptr, fmt::format("{}: line {}", csv_path, i + 2)));
  return out;
}

// ---------------------------------------------------------------------------------------------
// The search
// ---------------------------------------------------------------------------------------------

namespace {

// Faster first; ties (equal step times) go to the smaller memory peak, then the key, so the order is
// stable across runs and thread counts.
bool better(const TuneRow& a, const TuneRow& b) {
  if (a.step_time_s != b.step_time_s) return a.step_time_s < b.step_time_s;
  if (a.peak_memory_bytes != b.peak_memory_bytes) return a.peak_memory_bytes < b.peak_memory_bytes;
  return a.candidate.key() < b.candidate.key();
}

}  // namespace

TuneSummary run_tune(const TuneSpec& spec, const std::string& csv_path, const TuneOptions& options) {
  using Clock = std::chrono::steady_clock;
  const auto started = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - started).count(); };
  TuneSummary summary;
  Cluster cluster;
  try {
    cluster = with_devices(load_cluster(spec.cluster), spec.devices);
  } catch (const core::Error& e) {
    throw TuneError(e.what());
  }
  summary.memory_cap_bytes = spec.memory_cap_bytes;
  if (summary.memory_cap_bytes <= 0) {
    summary.memory_cap_bytes = std::numeric_limits<double>::infinity();
    for (int d = 0; d < spec.devices; ++d)
      summary.memory_cap_bytes = std::min(summary.memory_cap_bytes, static_cast<double>(cluster.gpu(d).hbm_bytes));
  }
  const double cap = summary.memory_cap_bytes;
  const std::vector<TuneCandidate> candidates = enumerate_candidates(spec, &summary.enumeration);
  summary.candidates = candidates.size();

  // Resume: rows of this search already in the file, by key and engine.
  std::map<std::pair<std::string, std::string>, TuneRow> done;
  TuneSpec file_spec;
  for (auto& row : read_tune_results(csv_path, &file_spec)) {
    if (done.empty() && (file_spec.model != spec.model || file_spec.cluster != spec.cluster ||
                         file_spec.devices != spec.devices || file_spec.global_batch != spec.effective_global_batch() ||
                         file_spec.seq_len != spec.seq_len))
      throw TuneError(fmt::format("{}: holds a tune of {} on {} x {} (global batch {}, seq_len {}); choose another -o",
                                  csv_path, file_spec.model, file_spec.devices, file_spec.cluster,
                                  file_spec.global_batch, file_spec.seq_len));
    done[{row.candidate.key(), row.engine}] = row;
  }
  summary.resumed = done.size();
  std::optional<ResultsAppender> out;
  try {
    out.emplace(csv_path, tune_csv_columns());
  } catch (const ResultsFileError& e) {
    throw TuneError(e.what());
  }
  std::mutex mutex;
  const double deadline = options.budget_s > 0 ? options.budget_s : std::numeric_limits<double>::infinity();
  auto over_budget = [&] { return elapsed() >= deadline; };
  auto progress = [&](const std::string& phase, std::size_t finished, std::size_t total) {
    if (options.on_progress) options.on_progress({phase, finished, total, elapsed()});
  };
  auto record = [&](const TuneRow& row) {
    out->append(to_csv(spec, row));
    done[{row.candidate.key(), row.engine}] = row;
  };

  // Phase 1: the memory lower bound of every candidate; those above the cap are pruned (recorded so
  // the CSV lists every candidate, and a rerun need not estimate them again).
  std::vector<TuneCandidate> survivors;
  std::map<std::string, std::int64_t> estimate;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    const TuneCandidate& c = candidates[i];
    const std::string k = c.key();
    auto pruned_row = done.find({k, ""});
    std::int64_t bound = 0;
    if (pruned_row != done.end()) {
      bound = pruned_row->second.estimated_memory_bytes;
    } else {
      auto analytic = done.find({k, "analytic"});
      bound = analytic != done.end() ? analytic->second.estimated_memory_bytes : memory_lower_bound(spec, c);
    }
    estimate[k] = bound;
    if (static_cast<double>(bound) > cap) {
      summary.pruned += 1;
      if (pruned_row == done.end()) {
        TuneRow row;
        row.candidate = c;
        row.status = "pruned";
        row.reason = fmt::format("memory lower bound {:.2f} GiB > cap {:.2f} GiB", bound / 1073741824.0, cap / 1073741824.0);
        row.estimated_memory_bytes = bound;
        record(row);
      }
    } else {
      survivors.push_back(c);
    }
    if (i % 64 == 63 || i + 1 == candidates.size()) progress("estimate", i + 1, candidates.size());
  }

  // Phases 2 and 3 run analytic simulations in parallel; rows already in the file are skipped.
  auto simulate_all = [&](const std::string& phase, const std::vector<TuneCandidate>& list) {
    std::vector<std::size_t> todo;
    for (std::size_t i = 0; i < list.size(); ++i)
      if (!done.count({list[i].key(), "analytic"})) todo.push_back(i);
    std::size_t finished = list.size() - todo.size();
    progress(phase, finished, list.size());
    const std::size_t started_items = run_pool(
        todo.size(), options.jobs,
        [&](std::size_t j) {
          const TuneCandidate& c = list[todo[j]];
          const TuneRow row = evaluate_candidate(spec, c, "analytic", estimate.count(c.key()) ? estimate.at(c.key()) : 0);
          std::lock_guard lock(mutex);
          record(row);
          summary.ran += 1;
          progress(phase, ++finished, list.size());
        },
        over_budget);
    if (started_items < todo.size() && summary.stopped.empty()) {
      summary.budget_exhausted = true;
      summary.stopped = fmt::format("{}: {} of {} simulated", phase, list.size() - todo.size() + started_items, list.size());
    }
  };
  auto fitting_analytic = [&] {
    std::vector<TuneRow> rows;
    for (const auto& [id, row] : done)
      if (id.second == "analytic" && row.fits(cap)) rows.push_back(row);
    std::sort(rows.begin(), rows.end(), better);
    return rows;
  };

  simulate_all("analytic", survivors);

  // Phase 3: PP placement alternatives for the leading strategies (default placements only).
  std::vector<TuneCandidate> variants;
  if (spec.placement_search && !summary.budget_exhausted) {
    const int leaders = spec.placement_leaders > 0 ? spec.placement_leaders : std::max(spec.top_k, 4);
    int taken = 0;
    for (const auto& row : fitting_analytic()) {
      if (taken >= leaders) break;
      if (!row.candidate.pp_ranges.empty()) continue;
      taken += 1;
      try {
        for (auto& v : placement_variants(spec, row.candidate)) variants.push_back(std::move(v));
      } catch (const std::exception&) {
        // A candidate whose placement cannot be varied (one region) keeps its default.
      }
    }
    for (const auto& v : variants) estimate[v.key()] = memory_lower_bound(spec, v);
    simulate_all("placement", variants);
  }

  // Phase 4: the top K on the SimGrid engine, one at a time (it forks a child per run).
  std::vector<TuneCandidate> leaders;
  for (const auto& row : fitting_analytic())
    if (static_cast<int>(leaders.size()) < spec.top_k) leaders.push_back(row.candidate);
  if (!leaders.empty()) {
    std::size_t finished = 0;
    for (const auto& c : leaders) {
      if (done.count({c.key(), "simgrid"})) {
        progress("simgrid", ++finished, leaders.size());
        continue;
      }
      if (over_budget()) {
        summary.budget_exhausted = true;
        if (summary.stopped.empty()) summary.stopped = fmt::format("simgrid: {} of {} re-simulated", finished, leaders.size());
        break;
      }
      record(evaluate_candidate(spec, c, "simgrid", estimate.count(c.key()) ? estimate.at(c.key()) : 0));
      summary.ran += 1;
      progress("simgrid", ++finished, leaders.size());
    }
  }

  // Summary over everything in the file (this run and earlier ones).
  std::set<std::string> variant_keys;
  for (const auto& [id, row] : done) {
    if (id.second == "analytic") {
      summary.simulated += 1;
      if (!row.candidate.pp_ranges.empty()) summary.placement_variants += 1;
      if (row.fits(cap)) summary.fitting += 1;
    } else if (id.second == "simgrid") {
      summary.simgrid += 1;
    }
  }
  std::vector<TuneRow> simgrid_rows;
  std::set<std::string> resimulated;
  for (const auto& [id, row] : done)
    if (id.second == "simgrid") {
      resimulated.insert(id.first);
      if (row.fits(cap)) simgrid_rows.push_back(row);
    }
  std::sort(simgrid_rows.begin(), simgrid_rows.end(), better);
  summary.ranked = simgrid_rows;
  for (const auto& row : fitting_analytic())
    if (!resimulated.count(row.candidate.key())) summary.ranked.push_back(row);
  summary.elapsed_s = elapsed();
  return summary;
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
    return core::compile_scenario(tune_scenario(spec, c)).program_json;
  } catch (const core::Error& e) {
    throw TuneError(e.what());
  }
}

}  // namespace piper::sim
