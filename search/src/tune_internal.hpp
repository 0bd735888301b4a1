// What the tuner's files share (search/src/tune_*.cpp): small helpers, the candidate's placement
// and the per-shape cache that the bounds and the placement search read. Not installed: internal.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "piper/core/model.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/search/tune.hpp"
#include "piper/sim/cost_model.hpp"

namespace piper::search::detail {

// A list option's values, sorted and without repeats; `fallback` alone when none was given.
template <typename T>
std::vector<T> distinct_or(std::vector<T> v, std::vector<T> fallback) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v.empty() ? fallback : v;
}

std::vector<int> divisors(int n);
std::string join(const std::vector<int>& v, char sep);
// The strategy knobs of a candidate (what the generator and the schedule family read).
core::StrategyOptions strategy_of(const TuneCandidate& c);
// The settings the tune CSV and key name by hand (their columns and key parts predate the settings
// table); every other setting of the table gets a column after `reason` and a key part when not at
// its default. global_batch is the spec's (sequences per step), never a candidate's.
bool named_by_hand(const std::string& setting);
// Recompute modes by the work they add (none < selective < full); -1 for an unknown mode.
int recompute_level(const std::string& mode);
// The layout lowering gives a layer of candidate c: routed experts keep expert parallelism and take
// c's expert TP, on the 1/tp sequence slice with SP; everything else takes c's TP.
core::ParallelLayout layout_of(const TuneCandidate& c, const core::Layer& layer);
core::ModelConfig model_config(const TuneSpec& spec, std::int64_t micro_batch_size);
// Pipeline units as balance_pipeline counts them: one per transformer block (the embedding joins the
// first, the final norm and head the last).
int pipeline_units(const core::ModelConfig& cfg);
// The pipeline ranks that run region i: its rank, and for a mirrored family also the opposite rank.
std::vector<std::vector<int>> ranks_of_regions(const std::vector<int>& rank_of_region, int pp, bool mirrored);
// Region of every layer and the first block of every region, from a model's PP tags.
std::vector<int> starts_of(const core::Model& model, int regions);

struct RegionPlacement {
  int regions = 0;
  std::vector<int> rank_of_region;
  bool mirrored = false;
};
RegionPlacement placement_of(const TuneCandidate& c);

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

  // Per layer, what `make` computes under c's layout, EP degree and the spec's cluster (the step time
  // bound's kernel times: {F, B} seconds per microbatch), computed once per such key.
  using KernelTimes = std::vector<std::array<double, 2>>;
  template <class Make>
  std::shared_ptr<const KernelTimes> kernel_times(const TuneCandidate& c, const TuneSpec& spec,
                                                  const Make& make) const {
    const KernelTimesKey key{c.tp, c.sequence_parallel, c.recompute, c.cp, c.cp_all_gather, c.etp,
                             c.ep, spec.cluster,        spec.devices};
    {
      std::lock_guard lock(mutex);
      auto it = kernel_times_by_layout.find(key);
      if (it != kernel_times_by_layout.end()) return it->second;
    }
    auto times = std::make_shared<const KernelTimes>(make());
    std::lock_guard lock(mutex);
    return kernel_times_by_layout.emplace(key, std::move(times)).first->second;
  }

 private:
  mutable std::mutex mutex;
  mutable std::map<std::tuple<int, bool, std::string, int, bool, int>, std::shared_ptr<const std::vector<core::Costs>>>
      by_layout;
  using KernelTimesKey = std::tuple<int, bool, std::string, int, bool, int, int, std::string, int>;
  mutable std::map<KernelTimesKey, std::shared_ptr<const KernelTimes>> kernel_times_by_layout;
};

// The shape of candidate c, cached by (model, sequence, family, PP, regions, microbatches, micro
// batch size, boundaries).
std::shared_ptr<const Shape> shape_of(const TuneSpec& spec, const TuneCandidate& c);
// The cluster grown to the spec's devices and its cost model, built once per (cluster, devices).
std::shared_ptr<const sim::CostModel> cost_model_of(const TuneSpec& spec);
// Whether two specs name one search: model, cluster, devices, global batch and sequence, the fields a
// tune results row records (resume compares the file's with the search's, and each row with the first).
inline bool same_search(const TuneSpec& a, const TuneSpec& b) {
  return a.model == b.model && a.cluster == b.cluster && a.devices == b.devices && a.global_batch == b.global_batch &&
         a.seq_len == b.seq_len;
}

}  // namespace piper::search::detail
