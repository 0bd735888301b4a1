// The strategy search: enumeration from the schedule registry (never from schedule names), a
// closed-form memory lower bound for pruning, cost-model-balanced PP placements, parallel analytic
// ranking, SimGrid re-simulation of the leaders, and a resumable CSV of every row.
#include "piper/sim/tune.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <stdexcept>

#include <fmt/format.h>

#include "piper/core/dag.hpp"
#include "piper/core/kernels.hpp"
#include "piper/core/limits.hpp"
#include "piper/core/model.hpp"
#include "piper/core/program_builder.hpp"
#include "piper/core/settings.hpp"
#include "piper/core/strategy.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/results_csv.hpp"
#include "piper/sim/sweep.hpp"

namespace piper::sim {

using nlohmann::json;

namespace {

// A list option's values, sorted and without repeats; `fallback` alone when none was given.
template <typename T>
std::vector<T> distinct_or(std::vector<T> v, std::vector<T> fallback) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v.empty() ? fallback : v;
}

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
  core::StrategyOptions o = c;
  o.global_batch = 0;  // a candidate's microbatches are its own
  if (c.zero < 2) o.reduce_every.clear();
  return o;
}

// The settings the tune CSV and key name by hand (their columns and key parts predate the settings
// table); every other setting of the table gets a column after `reason` and a key part when not at
// its default. global_batch is the spec's (sequences per step), never a candidate's.
bool named_by_hand(const std::string& setting) {
  static const std::set<std::string> names = {"pp",           "dp",          "ep",
                                              "zero",         "schedule",    "microbatches",
                                              "virtual",      "tp",          "sequence_parallel",
                                              "recompute",    "comm_sms",    "dp_shard",
                                              "reduce_every", "global_batch"};
  return names.count(setting) > 0;
}

// Recompute modes by the work they add (none < selective < full); -1 for an unknown mode.
int recompute_level(const std::string& mode) {
  return mode == "none" ? 0 : mode == "selective" ? 1 : mode == "full" ? 2 : mode == "op" ? 3 : -1;
}

// The layout lowering gives a layer of candidate c: routed experts keep expert parallelism and take
// c's expert TP, on the 1/tp sequence slice with SP; everything else takes c's TP.
core::ParallelLayout layout_of(const TuneCandidate& c, const core::Layer& layer) {
  const bool experts = layer.kind == core::LayerKind::MoeExperts;
  return {experts ? c.etp : c.tp, experts ? false : c.sequence_parallel,    recompute_level(c.recompute), c.cp,
          c.cp_all_gather,        experts && c.sequence_parallel ? c.tp : 1};
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
  TuneCandidate plain = c;
  plain.rank_order.clear();  // which devices a rank uses does not move region boundaries
  core::Scenario s = tune_scenario(spec, plain);
  s.strategy.dp = 1;
  s.strategy.ep = 1;
  s.strategy.zero = 0;
  s.strategy.tp = 1;  // TP, SP and recomputation do not move region boundaries
  s.strategy.etp = 1;
  s.strategy.sequence_parallel = false;
  s.strategy.recompute = "none";
  s.strategy.comm_sms = 0;  // nor does an SM partition
  s.strategy.dp_shard = 0;  // (no data parallelism here)
  s.strategy.reduce_every.clear();
  s.strategy.tp_comm_overlap = false;
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

// What the memory bound and the step estimate read of a candidate besides its degrees: the model with
// its regions annotated, the placement and the per-rank step order. It depends only on the family,
// PP, regions per rank, microbatches, micro batch size and boundaries, which thousands of candidates
// share (TP, SP, recompute, DP, EP and ZeRO do not change it), so it is built once per shape.
struct Shape {
  core::Model model;
  RegionPlacement place;
  std::optional<core::ScheduleTable> table;
  // Per layer: its PP region, whether it carries an EP tag, whether it is a routed-experts layer.
  std::vector<int> region_of_layer;
  std::vector<char> ep_tagged, experts;
  // Per rank, with a table: the distinct sets of activations held when a forward starts, as
  // (region, count) lists (see held_patterns); the bound weighs them with each candidate's sizes.
  std::vector<std::vector<std::vector<std::pair<int, int>>>> held;

  // Per-device layer costs under a (tp, sp, recompute, cp, etp) layout, computed once per layout.
  std::shared_ptr<const std::vector<core::Costs>> costs(const TuneCandidate& c) const {
    const std::tuple<int, bool, std::string, int, bool, int> key{c.tp, c.sequence_parallel, c.recompute,
                                                                 c.cp, c.cp_all_gather,     c.etp};
    std::lock_guard lock(mutex);
    auto& slot = by_layout[key];
    if (!slot) {
      auto v = std::make_shared<std::vector<core::Costs>>();
      for (const auto& layer : model.layers())
        v->push_back(core::layer_costs(layer, model.training(), layout_of(c, layer)));
      slot = std::move(v);
    }
    return slot;
  }

 private:
  mutable std::mutex mutex;
  mutable std::map<std::tuple<int, bool, std::string, int, bool, int>, std::shared_ptr<const std::vector<core::Costs>>>
      by_layout;
};

// The activations a rank provably holds when each of its forwards starts, from its step order. Steps
// run one after another (each order group waits for the previous one), so when the forward in step i
// starts, every forward of an earlier step has allocated its activations, and a microbatch's
// activations are still held unless its first backward action (B, or I when split) ran in an earlier
// step. Actions sharing step i (an overlapped F&B pair) may run in either order, so their frees count
// as done. A free that really waits for a later W only makes the true peak larger. Returned as the
// distinct (region, count) multisets, the starting forward's region included.
std::vector<std::vector<std::pair<int, int>>> held_patterns(const std::vector<core::ScheduleStep>& steps) {
  std::map<std::pair<int, int>, std::size_t> first_backward;  // (stage, microbatch) -> step
  for (std::size_t i = 0; i < steps.size(); ++i)
    for (const auto& a : steps[i])
      if (a.kind == core::ActionKind::B || a.kind == core::ActionKind::I)
        first_backward.try_emplace({a.stage, a.microbatch}, i);
  std::set<std::vector<std::pair<int, int>>> patterns;
  std::vector<std::pair<std::pair<int, int>, std::size_t>> started;  // forwards of earlier steps
  for (std::size_t i = 0; i < steps.size(); ++i) {
    std::map<int, int> held;
    for (const auto& [id, step] : started) {
      auto it = first_backward.find(id);
      if (it == first_backward.end() || it->second > i) held[id.first] += 1;
    }
    for (const auto& a : steps[i])
      if (a.kind == core::ActionKind::F) {
        std::map<int, int> with = held;
        with[a.stage] += 1;
        patterns.insert(std::vector<std::pair<int, int>>(with.begin(), with.end()));
      }
    for (const auto& a : steps[i])
      if (a.kind == core::ActionKind::F) started.push_back({{a.stage, a.microbatch}, i});
    // Forwards whose backward already ran can never count again: drop them.
    std::erase_if(started, [&](const auto& e) {
      auto it = first_backward.find(e.first);
      return it != first_backward.end() && it->second <= i;
    });
  }
  return {patterns.begin(), patterns.end()};
}

std::shared_ptr<const Shape> shape_of(const TuneSpec& spec, const TuneCandidate& c) {
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<const Shape>> cache;
  const std::string key = fmt::format("{}|{}|{}|{}|{}|{}|{}|{}", spec.model, spec.seq_len, c.schedule, c.pp,
                                      c.virtual_stages, c.microbatches, c.micro_batch_size, join(c.pp_ranges, '.'));
  {
    std::lock_guard lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto shape = std::make_shared<Shape>();
  shape->model = annotated_model(spec, c);
  shape->place = placement_of(c);
  for (const auto& layer : shape->model.layers()) {
    shape->region_of_layer.push_back(layer.tags.at("PP"));
    shape->ep_tagged.push_back(layer.tags.contains("EP") ? 1 : 0);
    shape->experts.push_back(layer.kind == core::LayerKind::MoeExperts ? 1 : 0);
  }
  // The schedule's per-rank step order, when it has one: order directives run a rank's steps one
  // after another, so the activations in flight at each forward are known (see in_flight_bound).
  try {
    const core::ScheduleFamily& family = core::schedule_family(c.schedule);
    core::ScheduleContext ctx;
    ctx.ranks = c.pp;
    ctx.regions = shape->place.regions;
    ctx.microbatches = c.microbatches;
    ctx.virtual_stages = c.virtual_stages;
    ctx.rank_of_region = shape->place.rank_of_region;
    ctx.mirrored = shape->place.mirrored;
    shape->table = family.table(ctx);
    if (static_cast<int>(shape->table->ranks.size()) != c.pp) shape->table.reset();
    if (shape->table)
      for (const auto& steps : shape->table->ranks) shape->held.push_back(held_patterns(steps));
  } catch (const std::invalid_argument&) {
    shape->table.reset();  // e.g. several regions per rank in a family ordered per region
  }
  std::lock_guard lock(mutex);
  if (cache.size() > 4096) cache.clear();  // a long-lived process (the studio) does not grow without end
  return cache.emplace(key, std::move(shape)).first->second;
}

// The cluster grown to the spec's devices and its cost model, built once per (cluster, devices).
std::shared_ptr<const CostModel> cost_model_of(const TuneSpec& spec) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, int>, std::shared_ptr<const CostModel>> cache;
  std::lock_guard lock(mutex);
  auto& slot = cache[{spec.cluster, spec.devices}];
  if (!slot) slot = std::make_shared<const CostModel>(with_devices(load_cluster(spec.cluster), spec.devices));
  return slot;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Candidates
// ---------------------------------------------------------------------------------------------

std::string TuneCandidate::key() const {
  std::string k =
      fmt::format("pp{}/dp{}/ep{}/z{}/{}/v{}/mb{}/m{}/{}", pp, dp, ep, zero, schedule, virtual_stages, microbatches,
                  micro_batch_size, pp_ranges.empty() ? "default" : "r" + join(pp_ranges, '.'));
  // Knobs added later are appended only when not at their default, so the keys of rows written
  // before they existed still name the same plans.
  if (tp != 1) k += fmt::format("/tp{}", tp);
  if (sequence_parallel) k += "/sp";
  if (recompute != "none") k += "/rc-" + recompute;
  if (!rank_order.empty()) k += "/o" + join(rank_order, '.');
  if (comm_sms > 0) k += fmt::format("/sms{}", comm_sms);
  if (dp_shard > 0) k += fmt::format("/hs{}", dp_shard);
  if (reduce_every == "step") k += "/rs-step";
  for (const auto& s : core::strategy_settings())
    if (!named_by_hand(s.name) && !core::at_default(s, *this)) k += core::setting_key_part(s, *this);
  std::replace(k.begin(), k.end(), ',', ';');
  return k;
}

std::string ordinal(long long n) {
  const long long last_two = (n % 100 + 100) % 100, last = last_two % 10;
  const char* suffix = last_two >= 11 && last_two <= 13 ? "th"
                       : last == 1                      ? "st"
                       : last == 2                      ? "nd"
                       : last == 3                      ? "rd"
                                                        : "th";
  return fmt::format("{}{}", n, suffix);
}

std::string TuneCandidate::describe() const {
  std::string s = fmt::format("PP {}", pp);
  if (tp > 1) s += fmt::format(" x TP {}{}", tp, sequence_parallel ? " (SP)" : "");
  if (cp > 1) s += fmt::format(" x CP {}", cp);
  s += fmt::format(" x DP {}", dp);
  if (ep > 1 || etp > 1) s += etp > 1 ? fmt::format(" (EP {}, ETP {})", ep, etp) : fmt::format(" (EP {})", ep);
  s += fmt::format(", {}", schedule);
  if (virtual_stages > 1) s += fmt::format(" ({} regions/rank)", virtual_stages);
  s += fmt::format(", {} microbatches of {}, ZeRO-{}", microbatches, micro_batch_size, zero);
  if (dp_shard > 0) s += fmt::format(" (HSDP, groups of {})", dp_shard);
  if (zero >= 2)
    s += reduce_every == "step" ? ", gradients reduced once per step" : ", gradients reduced per microbatch";
  if (recompute != "none") s += fmt::format(", recompute {}", recompute);
  if (comm_sms > 0) s += fmt::format(", communication on {} SMs", comm_sms);
  if (!pp_ranges.empty()) s += fmt::format(", PP starts {}", join(pp_ranges, ','));
  if (!rank_order.empty()) s += fmt::format(", ranks on device groups {}", join(rank_order, ','));
  if (!pp_ranges.empty() || !rank_order.empty()) s += fmt::format(" ({})", placement);
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
  if (!c.rank_order.empty()) {
    // Another order of the pipeline ranks on the device groups: the compiled program of the
    // generator's order with every device relabelled (device k + t (r + d pp) becomes
    // k + t (order[r] + d pp)), given to the compiler as an explicit program.
    TuneCandidate plain = c;
    plain.rank_order.clear();
    core::ProgramBuilder program(core::compile_scenario(tune_scenario(spec, plain)).program_json);
    const int t = c.tp * c.cp, pp = c.pp;  // a block of tp x cp devices moves as one
    program.relabel_devices([&](int x) {
      const int q = x / t;
      return x % t + t * (c.rank_order.at(static_cast<std::size_t>(q % pp)) + (q / pp) * pp);
    });
    s.directives = program.take();
  }
  return s;
}

std::vector<TuneCandidate> enumerate_candidates(const TuneSpec& spec, EnumerationStats* stats_out) {
  EnumerationStats stats;
  std::vector<TuneCandidate> out;
  if (spec.devices < 1) throw TuneError(fmt::format("--devices must be >= 1 (got {})", spec.devices));
  // Before any work (also for callers other than run_tune).
  core::check_limit(core::Limit::Devices, spec.devices, "--devices", "devices");
  const std::int64_t batch = spec.effective_global_batch();
  std::vector<const core::ScheduleFamily*> families;
  for (const auto& f : core::schedule_registry())
    if (spec.schedules.empty() ||
        std::find(spec.schedules.begin(), spec.schedules.end(), f.name) != spec.schedules.end())
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
  std::vector<std::string> recompute_modes = spec.recompute_modes;
  for (const auto& m : recompute_modes)
    if (recompute_level(m) < 0)
      throw TuneError(fmt::format("--recompute: unknown mode '{}' (expected none, selective, full or op)", m));
  std::sort(recompute_modes.begin(), recompute_modes.end(),
            [](const std::string& a, const std::string& b) { return recompute_level(a) < recompute_level(b); });
  recompute_modes.erase(std::unique(recompute_modes.begin(), recompute_modes.end()), recompute_modes.end());
  if (recompute_modes.empty()) recompute_modes = {"none"};
  std::vector<bool> sp_modes = spec.sequence_parallel;
  std::sort(sp_modes.begin(), sp_modes.end());
  sp_modes.erase(std::unique(sp_modes.begin(), sp_modes.end()), sp_modes.end());
  if (sp_modes.empty()) sp_modes = {false};

  // TP degrees: TP groups are consecutive devices that must stay inside a node, so t divides the
  // GPU count of every node (and the devices). What the model needs of t (heads, ffn columns, the
  // sequence for SP) is asked of the compiler with a one-stage probe; KV heads are checked here
  // because the Megatron layout the runtime executes splits them too, while the cost model does not
  // need it.
  Cluster cluster;
  try {
    cluster = with_devices(load_cluster(spec.cluster), spec.devices);
  } catch (const core::Error& e) {
    throw TuneError(e.what());
  }
  int node_gpus = 0;
  for (int d = 0; d < spec.devices; ++d) node_gpus = std::gcd(node_gpus, cluster.node(d).gpus_per_node);
  // SM partitions: the simulator's rule (at least one SM left for compute on every GPU, as `simulate
  // --comm-sms` checks) up front, in one line, rather than one invalid row per candidate.
  const std::vector<int> comm_sms = distinct_or(spec.comm_sms, {0});
  for (int sms : comm_sms) {
    if (sms < 0)
      throw TuneError(fmt::format("--comm-sms: {} is negative (0: SMs shared, N >= 1: N SMs for communication)", sms));
    if (sms == 0) continue;
    for (int d = 0; d < spec.devices; ++d)
      if (const std::string why = sm_partition_misfit(sms, cluster.node(d).gpu); !why.empty())
        throw TuneError(fmt::format("--comm-sms {}: {}", sms, why));
  }
  const std::vector<int> dp_shards = distinct_or(spec.dp_shards, {0});
  const std::vector<int> etps = distinct_or(spec.etp_degrees, {1});
  for (int e : etps)
    if (e < 1) throw TuneError(fmt::format("--etp must be >= 1 (got {})", e));
  const std::vector<std::string> reduce_modes =
      distinct_or(spec.reduce_every, {std::string("microbatch"), std::string("step")});
  for (const auto& re : reduce_modes)
    if (re != "microbatch" && re != "step")
      throw TuneError(fmt::format("--reduce-every: '{}' is not microbatch or step", re));
  for (int k : dp_shards)
    if (k < 0 || k == 1)
      throw TuneError(
          fmt::format("--dp-shard: {} is not a group size (0: plain ZeRO, N >= 2: HSDP over groups of N replicas)", k));
  const std::vector<int> tps = distinct_or(spec.tp_degrees, divisors(std::gcd(node_gpus, spec.devices)));
  std::map<int, std::vector<bool>> sp_of_tp;  // accepted TP degree -> its sequence-parallel modes
  for (int t : tps) {
    if (t < 1) throw TuneError(fmt::format("--tp must be >= 1 (got {})", t));
    if (spec.devices % t != 0) {
      stats.tp_rejected.push_back(fmt::format("TP {}: does not divide the {} devices", t, spec.devices));
      continue;
    }
    if (node_gpus % t != 0) {
      stats.tp_rejected.push_back(
          fmt::format("TP {}: TP groups stay inside a node, and a node has {} GPUs", t, node_gpus));
      continue;
    }
    if (t > 1 && cfg.kv_heads > 0 && cfg.kv_heads % t != 0) {
      stats.tp_rejected.push_back(fmt::format("TP {}: does not divide the {} KV heads", t, cfg.kv_heads));
      continue;
    }
    for (bool sp : t == 1 ? std::vector<bool>{false} : sp_modes) {
      TuneCandidate probe;
      probe.tp = t;
      probe.sequence_parallel = sp;
      probe.schedule = core::schedule_registry().front().name;  // any family: one stage, one microbatch
      probe.micro_batch_size = configs.begin()->first;
      TuneSpec one = spec;
      one.devices = t;
      try {
        core::compile_scenario(tune_scenario(one, probe));
        sp_of_tp[t].push_back(sp);
      } catch (const core::Error& e) {
        stats.tp_rejected.push_back(fmt::format("TP {}{}: {}", t, sp ? " with SP" : "", one_line(e.what())));
      } catch (const std::invalid_argument& e) {
        stats.tp_rejected.push_back(fmt::format("TP {}{}: {}", t, sp ? " with SP" : "", one_line(e.what())));
      }
    }
    if (sp_of_tp.count(t)) stats.tp_degrees.push_back(t);
  }
  // Pins (--pp, --dp, --ep): a degree that can never apply is an error, not an empty search.
  auto pinned = [](const std::vector<int>& pins, int v) {
    return pins.empty() || std::find(pins.begin(), pins.end(), v) != pins.end();
  };
  for (const auto& [flag, pins] : {std::pair<const char*, const std::vector<int>*>{"--pp", &spec.pp_degrees},
                                   {"--dp", &spec.dp_degrees},
                                   {"--ep", &spec.ep_degrees}})
    for (int v : *pins) {
      if (v < 1) throw TuneError(fmt::format("{} must be >= 1 (got {})", flag, v));
      if (std::string(flag) != "--ep" && spec.devices % v != 0)
        throw TuneError(fmt::format("{} {}: does not divide the {} devices", flag, v, spec.devices));
      if (std::string(flag) == "--ep" && v > 1 && (cfg.experts <= 0 || cfg.experts % v != 0))
        throw TuneError(
            cfg.experts <= 0
                ? fmt::format("--ep {}: model '{}' has no MoE experts (use --ep 1)", v, cfg.name)
                : fmt::format("--ep {}: does not divide the {} experts of model '{}'", v, cfg.experts, cfg.name));
    }
  // Context parallelism: the sequence must cut into 2·cp chunks (load-balanced causal CP).
  std::vector<int> cps;
  for (int cp : distinct_or(spec.cp_degrees, {1})) {
    if (cp < 1) throw TuneError(fmt::format("--cp must be >= 1 (got {})", cp));
    if (spec.devices % cp != 0)
      stats.cp_rejected.push_back(fmt::format("CP {}: does not divide the {} devices", cp, spec.devices));
    else if (cp > 1 && cfg.training.seq_len % (2 * cp) != 0)
      stats.cp_rejected.push_back(fmt::format("CP {}: the sequence length {} does not cut into {} equal chunks", cp,
                                              cfg.training.seq_len, 2 * cp));
    else
      cps.push_back(cp), stats.cp_degrees.push_back(cp);
  }
  for (const auto& [tp, sps] : sp_of_tp)
    for (int cp : cps)
      for (int pp : spec.devices % (tp * cp) == 0 ? divisors(spec.devices / tp / cp) : std::vector<int>{}) {
        if (pp > units || !pinned(spec.pp_degrees, pp)) continue;
        const int dp = spec.devices / tp / cp / pp;
        if (!pinned(spec.dp_degrees, dp)) continue;
        for (int ep : divisors(dp))
          for (int etp : etps) {
            if (!pinned(spec.ep_degrees, ep)) continue;
            // Expert parallelism shards experts over consecutive groups of ep data-parallel replicas.
            if (ep > 1 && (cfg.experts <= 0 || cfg.experts % ep != 0)) continue;
            // Expert TP inside the TP groups, on a split of the experts' FFN.
            if (etp > 1 && (cfg.experts <= 0 || tp % etp != 0 || cfg.expert_ffn % etp != 0)) continue;
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
                  static_cast<core::StrategyOptions&>(c) = spec.fixed;
                  c.tp = tp;
                  c.cp = cp;
                  c.pp = pp;
                  c.dp = dp;
                  c.ep = ep;
                  c.etp = etp;
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
                  // ZeRO levels differ only when a region has more than one data-parallel replica (CP ranks
                  // are replicas of the parameters too).
                  const int replicas = dp * cp * (family->mirrored ? 2 : 1);
                  for (bool sp : sps)
                    for (const auto& rc : recompute_modes)
                      for (int z : spec.zero_levels) {
                        if (z < 0 || z > 3) throw TuneError(fmt::format("ZeRO level {} is not 0..3", z));
                        if (replicas == 1 && z != spec.zero_levels.front()) continue;
                        c.sequence_parallel = sp;
                        c.recompute = rc;
                        c.zero = replicas == 1 ? 0 : z;
                        for (int k : dp_shards) {
                          // HSDP groups the ZeRO shards of dp replicas (strategy.cpp): a group must divide dp
                          // and be smaller than the region's replicas (else it is plain ZeRO).
                          if (k > 0 && (c.zero == 0 || dp % k != 0 || k >= replicas)) continue;
                          c.dp_shard = k;
                          for (const auto& re : reduce_modes) {
                            // The gradient reduction is a choice of ZeRO-2/3 only.
                            if (c.zero < 2 && re != reduce_modes.front()) continue;
                            c.reduce_every = c.zero >= 2 && re == "step" ? "step" : "";
                            for (int sms : comm_sms) {
                              c.comm_sms = sms;
                              out.push_back(c);
                            }
                          }
                        }
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

namespace {}  // namespace

std::int64_t memory_lower_bound(const TuneSpec& spec, const TuneCandidate& c) {
  const std::shared_ptr<const Shape> shape = shape_of(spec, c);
  const core::Model& model = shape->model;
  const RegionPlacement& place = shape->place;
  const int dt = core::bytes_per_element(model.training().precision);
  const std::int64_t state_bytes = core::fp32_storage(model.training().precision) ? 8 : 12;
  const int grad_bytes = core::gradient_bytes_per_element(model.training());  // fp32 main grads: 4
  // Data-parallel replicas of a region: dp per rank, twice that for a mirrored family (the two
  // copies). A TP segment's replicas are the devices with the same TP rank; routed experts (no TP)
  // are sharded over all the region's devices, tp of them per replica.
  const std::int64_t region_replicas = static_cast<std::int64_t>(c.dp) * c.cp * (place.mirrored ? 2 : 1);
  std::vector<std::int64_t> persistent_of_region(static_cast<std::size_t>(place.regions), 0);
  std::vector<std::int64_t> activation_of_region(static_cast<std::size_t>(place.regions), 0);
  // The per-device costs lowering uses (the compiler's own layer_costs under the TP layout and
  // recompute mode): parameters of split tensors divided by t, activations as Korthikanti et al.
  // (divided by t with SP, the attention core dropped by selective, block inputs only with full).
  const std::shared_ptr<const std::vector<core::Costs>> layer_costs = shape->costs(c);
  for (std::size_t i = 0; i < model.layers().size(); ++i) {
    const int r = shape->region_of_layer[i];
    const core::Costs& costs = (*layer_costs)[i];
    // Lowering sizes each segment's state as params/shard * bytes / (replicas if sharded by ZeRO),
    // with integer division; summing it per layer rounds down at least as much, so it stays a bound.
    // Routed experts: E / ep experts per device (their costs are already those of a 1/etp slice); the
    // region's dp x tp devices hold ep x etp distinct slices.
    const std::int64_t shard = shape->ep_tagged[i] ? c.ep : 1;
    const std::int64_t devices = region_replicas * (shape->experts[i] ? c.tp : 1);
    const std::int64_t replicas = std::max<std::int64_t>(1, devices / (shard * (shape->experts[i] ? c.etp : 1)));
    const std::int64_t shards = core::zero_shards_of(static_cast<int>(replicas), c.dp_shard);  // HSDP: the group's
    const std::int64_t params = costs.params / shard;
    persistent_of_region[static_cast<std::size_t>(r)] +=
        params * dt / (c.zero >= 3 ? shards : 1) +
        params * grad_bytes / (c.zero >= 2 && c.reduce_every != "step" ? shards : 1) +
        params * state_bytes / (c.zero >= 1 ? shards : 1);
    activation_of_region[static_cast<std::size_t>(r)] += costs.activation_bytes / shard;
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
    if (!shape->held.empty())
      for (const auto& pattern : shape->held[static_cast<std::size_t>(rank)]) {
        std::int64_t held = 0;
        for (const auto& [region, count] : pattern)
          if (region >= 0 && region < place.regions)
            held += count * activation_of_region[static_cast<std::size_t>(region)];
        transient = std::max(transient, held);
      }
    peak = std::max(peak, persistent + transient);
  }
  return peak;
}

// ---------------------------------------------------------------------------------------------
// Step time lower bound
// ---------------------------------------------------------------------------------------------

double step_time_lower_bound(const TuneSpec& spec, const TuneCandidate& c) {
  if (!spec.calibration_path.empty()) return 0;  // measured op times replace the cost model's
  const std::shared_ptr<const Shape> shape = shape_of(spec, c);
  const core::Model& model = shape->model;
  const RegionPlacement& place = shape->place;
  const std::shared_ptr<const CostModel> costs = cost_model_of(spec);
  const Cluster& cluster = costs->cluster();
  // The fastest GPU and link of the cluster, so that the bound holds on every device.
  double flops_rate = 0, hbm = 0, link = 0;
  double launch = std::numeric_limits<double>::infinity();
  const core::Precision pr = model.training().precision;
  for (const auto& node : cluster.nodes) {
    // Without a table: the curve's asymptote (fp8 at twice the bf16 peak); with one, its fastest
    // GEMM measurement in the training dtype (fp32 may run as tf32).
    flops_rate =
        std::max(flops_rate, node.gpu.peak_flops * node.gpu.max_efficiency * std::max(1.0, dtype_peak_ratio(pr)));
    launch = std::min(launch, node.gpu.launch_overhead_s);
    hbm = std::max(hbm, node.gpu.hbm_bandwidth_bytes_per_s);
    link = std::max({link, node.nvlink_bandwidth_bytes_per_s, node.nic_bandwidth_per_gpu_bytes_per_s()});
    if (!node.gpu.kernel_table.empty()) {
      const auto t = load_kernel_table(node.gpu.kernel_table);
      launch = std::min(launch, t->launch_floor_s);
      const std::string dt = pr == core::Precision::FP16 ? "bf16" : core::to_string(pr);
      for (const auto& g : t->gemm)
        if (g.dtype == dt || (dt == "fp32" && g.dtype == "tf32")) flops_rate = std::max(flops_rate, g.flops_per_s);
    }
  }
  if (flops_rate <= 0 || hbm <= 0) return 0;
  launch = std::max(0.0, launch);
  // Per region and microbatch: a lower bound of its F and of its B (BI + BW when split) per device
  // under c's layout, from the kernels its layers launch (core::layer_kernels, what lowering lists):
  // each kernel takes at least the launch floor plus its FLOPs at the fastest rate above (GEMMs), its
  // causal FLOPs at the fastest measured attention rate, or its fewest bytes (the fused profile's)
  // at the HBM peak; plus the TP collectives (an all-gather moves (t-1)/t of its bytes through each
  // device's link). Ops of one pass of a region run one after another, so their kernels add up.
  double att_fwd = 0, att_bwd = 0;
  for (const auto& node : cluster.nodes)
    if (!node.gpu.kernel_table.empty())
      for (const auto& a : load_kernel_table(node.gpu.kernel_table)->attention)
        att_fwd = std::max(att_fwd, a.fwd_flops_per_s), att_bwd = std::max(att_bwd, a.bwd_flops_per_s);
  const double floor = std::min(launch, KernelTable::kDefaultLaunchFloor);
  auto kernel_bound = [&](const core::Kernel& k) {
    double t = floor;
    const double dt = core::bytes_per_element(k.dtype);
    if (k.kind == core::KernelKind::Gemm) {
      t += k.flops / flops_rate;  // the exact FLOPs (a rounded shape's time is scaled to them)
    } else if (k.kind == core::KernelKind::AttentionForward || k.kind == core::KernelKind::AttentionBackward) {
      const double rate = k.kind == core::KernelKind::AttentionBackward ? att_bwd : att_fwd;
      // Without a table attention runs at most at the GEMM rate on Piper's (full-matrix) FLOPs.
      t += rate > 0 ? causal_attention_flops(k) / rate : k.flops / flops_rate;
    } else {
      const double bytes = k.kind == core::KernelKind::Elementwise ? static_cast<double>(k.bytes)
                           : k.kind == core::KernelKind::Loss || k.kind == core::KernelKind::LossBackward
                               ? static_cast<double>(k.elems) * 4
                               : static_cast<double>(k.elems) * dt * 2;
      t += bytes / hbm;
    }
    return t * k.count;
  };
  struct PassBound {
    double seconds = 0, tp = 0, etp = 0;  // etp: the routed experts' collectives over their ETP groups
    int e = 1;
    double total(int t, double link_bw) const {
      return seconds + (t > 1 && link_bw > 0 ? tp * (t - 1.0) / t / link_bw : 0.0) +
             (e > 1 && link_bw > 0 ? etp * (e - 1.0) / e / link_bw : 0.0);
    }
  };
  std::vector<PassBound> f(static_cast<std::size_t>(place.regions)), b = f;
  const std::shared_ptr<const std::vector<core::Costs>> layer_costs = shape->costs(c);
  for (std::size_t i = 0; i < model.layers().size(); ++i) {
    const auto r = static_cast<std::size_t>(shape->region_of_layer[i]);
    const core::Layer& layer = model.layers()[i];
    const core::Costs& k = (*layer_costs)[i];
    const int shard = shape->ep_tagged[i] ? c.ep : 1;
    const core::ParallelLayout L = layout_of(c, layer);
    for (int p = 0; p < 3; ++p)
      for (const auto& kern : core::layer_kernels(layer, model.training(), L, p, shard))
        (p == 0 ? f[r] : b[r]).seconds += kernel_bound(kern);
    const bool experts = layer.kind == core::LayerKind::MoeExperts;
    (experts ? f[r].etp : f[r].tp) += static_cast<double>(k.forward_tp_bytes);
    (experts ? b[r].etp : b[r].tp) += static_cast<double>(k.backward_tp_bytes);
    f[r].e = b[r].e = c.etp;
  }
  // A device's compute ops run one at a time on its compute stream. Rank r runs every microbatch's F
  // and B of each region it holds, and cannot start before the first microbatch has gone through
  // every region before its earliest one (the regions form a chain).
  const double per_copy = place.mirrored ? c.microbatches / 2.0 : c.microbatches;
  double worst = 0;
  for (int rank = 0; rank < c.pp; ++rank) {
    double busy = 0, fill = std::numeric_limits<double>::infinity();
    for (int r = 0; r < place.regions; ++r) {
      const int home = place.rank_of_region[static_cast<std::size_t>(r)];
      const int copies = (home == rank ? 1 : 0) + (place.mirrored && c.pp - 1 - home == rank ? 1 : 0);
      if (copies == 0) continue;
      busy += copies * per_copy *
              (f[static_cast<std::size_t>(r)].total(c.tp, link) + b[static_cast<std::size_t>(r)].total(c.tp, link));
      double before = 0;
      for (int s = 0; s < r; ++s) before += f[static_cast<std::size_t>(s)].total(c.tp, link);
      fill = std::min(fill, before);
    }
    if (std::isfinite(fill)) worst = std::max(worst, fill + busy);
  }
  return worst;
}

// ---------------------------------------------------------------------------------------------
// Placement search
// ---------------------------------------------------------------------------------------------

std::vector<int> effective_pp_ranges(const TuneSpec& spec, const TuneCandidate& c) {
  if (!c.pp_ranges.empty()) return c.pp_ranges;
  const std::shared_ptr<const Shape> shape = shape_of(spec, c);
  return starts_of(shape->model, shape->place.regions);
}

namespace {

// Compute seconds of each pipeline unit (block), timed as the simulator times them: every kernel its
// layers launch (core::layer_kernels) under c's TP layout and recompute mode, against device 0's
// kernel table and runtime profile (its efficiency curve without a table), experts sharded over EP.
// This is what FLOP balancing misses: the memory-bound embedding and loss, attention's own rates and
// the efficiency of small GEMMs.
std::vector<double> unit_seconds(const TuneSpec& spec, const TuneCandidate& c) {
  const core::ModelConfig cfg = model_config(spec, c.micro_batch_size);
  const core::Model model = core::build_model(cfg);
  const std::shared_ptr<const CostModel> costs = cost_model_of(spec);
  const KernelTiming timing = costs->timing(0);
  std::vector<double> out(static_cast<std::size_t>(cfg.layers), 0.0);
  for (std::size_t i = 0; i < model.layers().size(); ++i) {
    const core::Layer& l = model.layers()[i];
    const std::size_t unit = l.block < 0 ? (i == 0 ? 0 : out.size() - 1) : static_cast<std::size_t>(l.block);
    // As the shard pass does: EP divides the experts (each device runs E / ep of them on the tokens
    // routed there).
    const int shard = l.tags.contains("EP") ? c.ep : 1;
    const core::ParallelLayout layout = layout_of(c, l);
    for (int pass = 0; pass < 3; ++pass)
      for (const auto& k : core::layer_kernels(l, model.training(), layout, pass, shard))
        out[unit] += k.count * timing.seconds(k);
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
std::vector<int> balance_by_time(const std::vector<double>& w, const std::vector<std::vector<int>>& ranks_of_region,
                                 int pp) {
  const int n = static_cast<int>(w.size());
  const int k = static_cast<int>(ranks_of_region.size());
  std::vector<double> prefix(static_cast<std::size_t>(n) + 1, 0.0);
  for (int i = 0; i < n; ++i)
    prefix[static_cast<std::size_t>(i) + 1] = prefix[static_cast<std::size_t>(i)] + w[static_cast<std::size_t>(i)];
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<std::size_t>(k) + 1,
                                        std::vector<double>(static_cast<std::size_t>(n) + 1, inf));
  std::vector<std::vector<int>> from(static_cast<std::size_t>(k) + 1,
                                     std::vector<int>(static_cast<std::size_t>(n) + 1, -1));
  best[0][0] = 0;
  for (int a = 1; a <= k; ++a)
    for (int j = a; j <= n; ++j)
      for (int i = a - 1; i < j; ++i) {
        const double v = std::max(best[static_cast<std::size_t>(a) - 1][static_cast<std::size_t>(i)],
                                  prefix[static_cast<std::size_t>(j)] - prefix[static_cast<std::size_t>(i)]);
        if (v < best[static_cast<std::size_t>(a)][static_cast<std::size_t>(j)])
          best[static_cast<std::size_t>(a)][static_cast<std::size_t>(j)] = v,
          from[static_cast<std::size_t>(a)][static_cast<std::size_t>(j)] = i;
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
        if (trial[static_cast<std::size_t>(r)] <= trial[static_cast<std::size_t>(r) - 1] ||
            trial[static_cast<std::size_t>(r)] >= next)
          continue;
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

std::vector<TuneCandidate> rank_order_variants(const TuneSpec& spec, const TuneCandidate& c) {
  std::vector<TuneCandidate> out;
  if (c.pp < 2 || !c.rank_order.empty()) return out;
  const Cluster& cluster = cost_model_of(spec)->cluster();
  // A group is as fast as its slowest device (its TP group and data-parallel replicas wait for it).
  std::vector<double> speed(static_cast<std::size_t>(c.pp), std::numeric_limits<double>::infinity());
  for (int g = 0; g < c.pp; ++g)
    for (int d = 0; d < c.dp; ++d)
      for (int k = 0; k < c.tp * c.cp; ++k) {  // a block of tp x cp devices (TP innermost, then CP)
        const GpuSpec& gpu = cluster.gpu(k + c.tp * c.cp * (g + d * c.pp));
        speed[static_cast<std::size_t>(g)] =
            std::min(speed[static_cast<std::size_t>(g)], gpu.peak_flops * gpu.max_efficiency);
      }
  if (std::all_of(speed.begin(), speed.end(), [&](double v) { return v == speed.front(); })) return out;
  // Per-rank compute time of the regions each holds, with c's boundaries.
  const RegionPlacement place = placement_of(c);
  const std::vector<double> w = unit_seconds(spec, c);
  const std::vector<int> starts = effective_pp_ranges(spec, c);
  std::vector<double> load(static_cast<std::size_t>(c.pp), 0.0);
  const auto ranks = ranks_of_regions(place.rank_of_region, c.pp, place.mirrored);
  for (std::size_t r = 0; r < starts.size(); ++r) {
    const int end = r + 1 < starts.size() ? starts[r + 1] : static_cast<int>(w.size());
    double sum = 0;
    for (int u = starts[r]; u < end; ++u) sum += w[static_cast<std::size_t>(u)];
    for (int rank : ranks[r]) load[static_cast<std::size_t>(rank)] += sum;
  }
  std::vector<int> by_load(static_cast<std::size_t>(c.pp)), by_speed(static_cast<std::size_t>(c.pp));
  std::iota(by_load.begin(), by_load.end(), 0);
  std::iota(by_speed.begin(), by_speed.end(), 0);
  std::stable_sort(by_load.begin(), by_load.end(),
                   [&](int a, int b) { return load[static_cast<std::size_t>(a)] > load[static_cast<std::size_t>(b)]; });
  std::stable_sort(by_speed.begin(), by_speed.end(), [&](int a, int b) {
    return speed[static_cast<std::size_t>(a)] > speed[static_cast<std::size_t>(b)];
  });
  std::vector<int> busiest_fastest(static_cast<std::size_t>(c.pp));
  for (std::size_t i = 0; i < by_load.size(); ++i) busiest_fastest[static_cast<std::size_t>(by_load[i])] = by_speed[i];
  std::vector<int> reversed(static_cast<std::size_t>(c.pp)), identity(static_cast<std::size_t>(c.pp));
  std::iota(identity.begin(), identity.end(), 0);
  for (int r = 0; r < c.pp; ++r) reversed[static_cast<std::size_t>(r)] = c.pp - 1 - r;
  std::set<std::vector<int>> seen{identity};
  const std::string base = c.pp_ranges.empty() ? std::string() : c.placement + "; ";
  for (const auto& [order, label] :
       {std::pair{busiest_fastest, "busiest ranks on the fastest GPUs"}, std::pair{reversed, "ranks reversed"}}) {
    if (!seen.insert(order).second) continue;
    TuneCandidate v = c;
    v.rank_order = order;
    v.placement = base + label;
    out.push_back(std::move(v));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Rows and the CSV
// ---------------------------------------------------------------------------------------------

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

// The plan each analytic row's candidate stands for: at PP 1 with one region per rank, schedule
// families that differ only in name order the same ops, so candidates equal but for the family whose
// analytic rows have the same step time and peak memory are one plan, named by the first of them
// (by key). Other candidates stand for themselves.
template <class Rows>
std::map<std::string, std::string> plans_of(const Rows& done) {
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

}  // namespace

TuneSummary run_tune(const TuneSpec& spec, const std::string& csv_path, const TuneOptions& options) {
  using Clock = std::chrono::steady_clock;
  const auto started = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - started).count(); };
  TuneSummary summary;
  // Before any work: 10^6 devices spun 307 s in the per-device memory cap loop below.
  core::check_limit(core::Limit::Devices, spec.devices, "--devices", "devices");
  Cluster cluster;
  try {
    cluster = with_devices(load_cluster(spec.cluster), spec.devices);
  } catch (const core::Error& e) {
    throw TuneError(e.what());
  }
  summary.hbm_bytes = std::numeric_limits<double>::infinity();
  for (int d = 0; d < spec.devices; ++d)
    summary.hbm_bytes = std::min(summary.hbm_bytes, static_cast<double>(cluster.device_hbm_bytes(d, spec.devices)));
  summary.memory_cap_bytes = spec.memory_cap_bytes;
  if (summary.memory_cap_bytes <= 0) {
    // The default cap: the HBM less a reserve for what the simulator does not model (see tune.hpp).
    summary.memory_reserve_bytes =
        spec.memory_reserve_bytes >= 0 ? spec.memory_reserve_bytes : kDefaultMemoryReserveFraction * summary.hbm_bytes;
    if (summary.memory_reserve_bytes >= summary.hbm_bytes)
      throw TuneError(fmt::format("--memory-reserve-gib {:.2f}: leaves nothing of the {:.2f} GiB of HBM",
                                  summary.memory_reserve_bytes / 1073741824.0, summary.hbm_bytes / 1073741824.0));
    summary.memory_cap_bytes = summary.hbm_bytes - summary.memory_reserve_bytes;
  }
  const double cap = summary.memory_cap_bytes;
  const std::vector<TuneCandidate> candidates = enumerate_candidates(spec, &summary.enumeration);
  summary.candidates = candidates.size();

  // Resume: rows of this search already in the file, by key and engine.
  std::map<std::pair<std::string, std::string>, TuneRow> done;
  TuneSpec file_spec;
  for (auto& row : read_tune_results(csv_path, &file_spec)) {
    if (done.empty() &&
        (file_spec.model != spec.model || file_spec.cluster != spec.cluster || file_spec.devices != spec.devices ||
         file_spec.global_batch != spec.effective_global_batch() || file_spec.seq_len != spec.seq_len))
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
  // Branch and bound: the step times of the fitting analytic rows, so that a candidate whose step
  // time lower bound exceeds the exact_top-th best cannot enter the best exact_top and is not
  // simulated (without a calibration, whose measured times the bound does not know).
  const std::size_t exact_top = static_cast<std::size_t>(std::max({spec.exact_top, spec.top_k, 1}));
  std::multiset<double> best_times;
  auto threshold = [&] {
    if (best_times.size() < exact_top) return std::numeric_limits<double>::infinity();
    return *std::next(best_times.begin(), static_cast<std::ptrdiff_t>(exact_top) - 1);
  };
  auto note_time = [&](const TuneRow& row) {
    if (row.engine != "analytic" || !row.fits(cap)) return;
    best_times.insert(row.step_time_s);
    if (best_times.size() > exact_top) best_times.erase(std::prev(best_times.end()));
  };
  for (const auto& [id, row] : done) note_time(row);
  auto record = [&](const TuneRow& row) {
    out->append(to_csv(spec, row));
    done[{row.candidate.key(), row.engine}] = row;
    note_time(row);
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
        row.reason =
            fmt::format("memory lower bound {:.2f} GiB > cap {:.2f} GiB", bound / 1073741824.0, cap / 1073741824.0);
        row.estimated_memory_bytes = bound;
        record(row);
      }
    } else {
      survivors.push_back(c);
    }
    if (i % 64 == 63 || i + 1 == candidates.size()) progress("estimate", i + 1, candidates.size());
  }

  // Phases 2 and 3 run analytic simulations in parallel; rows already in the file are skipped.
  // Candidates ordered by their step time lower bound (best first): the threshold falls fast, and
  // once one candidate's bound exceeds it, so do all later ones'.
  std::map<std::string, double> time_bound;
  auto by_bound = [&](std::vector<TuneCandidate> list) {
    std::vector<std::pair<double, std::size_t>> order;
    for (std::size_t i = 0; i < list.size(); ++i) {
      double lb = 0;
      try {
        lb = step_time_lower_bound(spec, list[i]);
      } catch (const std::exception&) {
        // No bound: simulated first, and the simulation reports what is wrong with it.
      }
      time_bound[list[i].key()] = lb;
      order.push_back({lb, i});
    }
    std::stable_sort(order.begin(), order.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    std::vector<TuneCandidate> sorted;
    for (const auto& [lb, i] : order) sorted.push_back(std::move(list[i]));
    return sorted;
  };
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
          {
            std::lock_guard lock(mutex);
            const auto lb = time_bound.find(c.key());
            const double limit = threshold();
            if (lb != time_bound.end() && lb->second > limit) {
              summary.bounded += 1;
              auto old = done.find({c.key(), ""});
              if (old == done.end() || old->second.status != "bounded") {
                TuneRow row;
                row.candidate = c;
                row.status = "bounded";
                row.reason = fmt::format("step time lower bound {:.3f} ms > the {} best {:.3f} ms", lb->second * 1e3,
                                         ordinal(exact_top), limit * 1e3);
                row.estimated_memory_bytes = estimate.count(c.key()) ? estimate.at(c.key()) : 0;
                record(row);
              }
              progress(phase, ++finished, list.size());
              return;
            }
          }
          const TuneRow row =
              evaluate_candidate(spec, c, "analytic", estimate.count(c.key()) ? estimate.at(c.key()) : 0);
          std::lock_guard lock(mutex);
          record(row);
          summary.ran += 1;
          progress(phase, ++finished, list.size());
        },
        over_budget);
    if (started_items < todo.size() && summary.stopped.empty()) {
      summary.budget_exhausted = true;
      summary.stopped =
          fmt::format("{}: {} of {} simulated", phase, list.size() - todo.size() + started_items, list.size());
    }
  };
  // Best first, one row per distinct plan (so the leaders and the SimGrid top K are distinct plans).
  auto fitting_analytic = [&](bool distinct = true) {
    std::vector<TuneRow> rows;
    for (const auto& [id, row] : done)
      if (id.second == "analytic" && row.fits(cap)) rows.push_back(row);
    std::sort(rows.begin(), rows.end(), better);
    return distinct ? distinct_plans(std::move(rows), plans_of(done)) : rows;
  };

  // Phase 2 in waves by recompute mode, lightest first. Recomputation adds work (the same ops with
  // a longer backward) to save memory, so a plan whose lighter twin (same strategy, the next lighter
  // mode tried) fits the cap is normally slower than that twin: such plans are deferred to a last
  // wave, which a budget cuts first. They are not skipped: the simulated step is not monotone in op
  // durations everywhere (a longer backward can shift when a transfer starts; tiny models show
  // heavier modes up to a few per cent faster, see test_sim_tune), so without a budget every
  // survivor is simulated (or bounded) and the result equals a brute force. ZeRO levels are not
  // treated so: ZeRO-1 shards the optimizer step and is often faster than ZeRO-0.
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
  for (std::size_t mi = 0; mi < modes.size() && !summary.budget_exhausted; ++mi) {
    std::vector<TuneCandidate> todo;
    for (const auto& c : survivors) {
      if (c.recompute != modes[mi]) continue;
      if (mi > 0) {
        TuneCandidate twin = c;
        twin.recompute = modes[mi - 1];
        const std::string tk = twin.key();
        auto row = done.find({tk, "analytic"});
        if (deferred_keys.count(tk) || (row != done.end() && row->second.fits(cap))) {
          deferred_keys.insert(c.key());
          deferred.push_back(c);
          continue;
        }
      }
      todo.push_back(c);
    }
    if (!todo.empty()) simulate_all(modes.size() > 1 ? "analytic " + modes[mi] : "analytic", by_bound(std::move(todo)));
  }
  summary.dominated = deferred.size();
  if (!summary.budget_exhausted) simulate_all("analytic, dominated", by_bound(std::move(deferred)));

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
    simulate_all("placement", by_bound(std::move(variants)));
    // Then the order of the pipeline ranks on the device groups, for the leaders with their best
    // boundaries (only where groups differ: rank_order_variants returns none on uniform clusters).
    std::vector<TuneCandidate> orders;
    std::set<std::string> strategies;
    for (const auto& row : fitting_analytic()) {
      if (static_cast<int>(strategies.size()) >= leaders) break;
      TuneCandidate plain = row.candidate;
      plain.pp_ranges.clear();
      plain.rank_order.clear();
      if (!strategies.insert(plain.key()).second || !row.candidate.rank_order.empty()) continue;
      try {
        for (auto& v : rank_order_variants(spec, row.candidate)) orders.push_back(std::move(v));
      } catch (const std::exception&) {
        // Keeps the generator's order.
      }
    }
    for (const auto& v : orders) estimate[v.key()] = memory_lower_bound(spec, v);
    simulate_all("rank order", by_bound(std::move(orders)));
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
        if (summary.stopped.empty())
          summary.stopped = fmt::format("simgrid: {} of {} re-simulated", finished, leaders.size());
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
      if (!row.candidate.pp_ranges.empty() || !row.candidate.rank_order.empty()) summary.placement_variants += 1;
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
  std::vector<TuneRow> ranked = simgrid_rows;
  for (const auto& row : fitting_analytic(false))
    if (!resimulated.count(row.candidate.key())) ranked.push_back(row);
  summary.ranked = distinct_plans(ranked, plans_of(done));
  summary.coinciding = ranked.size() - summary.ranked.size();
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
