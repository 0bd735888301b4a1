// The tuner's candidates: their keys and descriptions, the scenario each stands for, and the helpers
// and per-shape cache the other tune_*.cpp files share (tune_internal.hpp).
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "piper/core/model.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/settings.hpp"
#include "piper/core/strategy.hpp"
#include "piper/search/tune.hpp"
#include "piper/sim/cluster.hpp"
#include "tune_internal.hpp"

namespace piper::search {

using nlohmann::json;

namespace detail {

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

core::StrategyOptions strategy_of(const TuneCandidate& c) {
  core::StrategyOptions o = c;
  o.global_batch = 0;  // a candidate's microbatches are its own
  if (c.zero < 2) o.reduce_every.clear();
  return o;
}

bool named_by_hand(const std::string& setting) {
  static const std::set<std::string> names = {"pp",           "dp",          "ep",
                                              "zero",         "schedule",    "microbatches",
                                              "virtual",      "tp",          "sequence_parallel",
                                              "recompute",    "comm_sms",    "dp_shard",
                                              "reduce_every", "global_batch"};
  return names.count(setting) > 0;
}

int recompute_level(const std::string& mode) {
  return mode == "none" ? 0 : mode == "selective" ? 1 : mode == "full" ? 2 : mode == "op" ? 3 : -1;
}

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

int pipeline_units(const core::ModelConfig& cfg) { return static_cast<int>(cfg.layers); }

std::vector<std::vector<int>> ranks_of_regions(const std::vector<int>& rank_of_region, int pp, bool mirrored) {
  std::vector<std::vector<int>> out;
  for (int r : rank_of_region) {
    std::vector<int> ranks{r};
    if (mirrored && pp - 1 - r != r) ranks.push_back(pp - 1 - r);
    out.push_back(ranks);
  }
  return out;
}

std::vector<int> starts_of(const core::Model& model, int regions) {
  std::vector<int> starts(static_cast<std::size_t>(regions), -1);
  for (const auto& l : model.layers()) {
    if (l.block < 0) continue;
    const int r = l.tags.at("PP");
    if (starts[static_cast<std::size_t>(r)] < 0) starts[static_cast<std::size_t>(r)] = l.block;
  }
  return starts;
}

namespace {

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
  s.strategy.recompute_every = s.strategy.recompute_first = 0;  // (a block selection needs a mode)
  s.strategy.a2a_chunks = 1;                                    // (chunks need EP)
  s.strategy.comm_sms = 0;                                      // nor does an SM partition
  s.strategy.dp_shard = 0;                                      // (no data parallelism here)
  s.strategy.reduce_every.clear();
  s.strategy.tp_comm_overlap = false;
  const core::ModelConfig cfg = core::scenario_model_config(s);
  core::Model model = core::build_model(cfg);
  int regions = 0;
  const core::DirectiveProgram program = core::scenario_program(s, &regions);
  core::annotate_regions(s, model, program, regions);
  return model;
}

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

}  // namespace

RegionPlacement placement_of(const TuneCandidate& c) {
  const core::StrategyOptions o = strategy_of(c);
  const core::ScheduleFamily& family = core::schedule_family(c.schedule);
  RegionPlacement p;
  p.regions = family.regions(o);
  p.rank_of_region = family.placement(o, p.regions);
  p.mirrored = family.mirrored;
  return p;
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

std::shared_ptr<const sim::CostModel> cost_model_of(const TuneSpec& spec) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, int>, std::shared_ptr<const sim::CostModel>> cache;
  std::lock_guard lock(mutex);
  auto& slot = cache[{spec.cluster, spec.devices}];
  if (!slot)
    slot = std::make_shared<const sim::CostModel>(sim::with_devices(sim::load_cluster(spec.cluster), spec.devices));
  return slot;
}

}  // namespace detail

using namespace detail;

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
  const bool other_order = device_order != core::StrategyOptions().device_order;
  if (other_order) s += fmt::format(", devices {}", device_order);
  if (!pp_ranges.empty() || !rank_order.empty() || other_order) s += fmt::format(" ({})", placement);
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
    // generator's order with every device relabelled (the device of ranks k, c, r, d becomes that of
    // k, c, order[r], d, in c's --device-order), given to the compiler as an explicit program.
    TuneCandidate plain = c;
    plain.rank_order.clear();
    core::DirectiveProgram program = core::compile_scenario(tune_scenario(spec, plain)).program;
    program.relabel_devices([&](int x) {
      const core::DeviceRanks q = core::ranks_of_device(c, x);
      return core::device_of(c, q.k, q.c, c.rank_order.at(static_cast<std::size_t>(q.r)), q.d);
    });
    s.directives = program.to_json();  // the scenario's program, as its file would hold it
  }
  return s;
}

}  // namespace piper::search
