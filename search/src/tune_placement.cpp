// The tuner's placement search: PP region boundaries balanced with the cost model's kernel times,
// and orders of the pipeline ranks on device groups of different speeds.
#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "piper/core/kernels.hpp"
#include "piper/core/model.hpp"
#include "piper/core/strategy.hpp"
#include "piper/search/tune.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "tune_internal.hpp"

namespace piper::search {

using namespace detail;

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
  const std::shared_ptr<const sim::CostModel> costs = cost_model_of(spec);
  const sim::KernelTiming timing = costs->timing(0);
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
  const sim::Cluster& cluster = cost_model_of(spec)->cluster();
  // A group is as fast as its slowest device (its TP group and data-parallel replicas wait for it).
  std::vector<double> speed(static_cast<std::size_t>(c.pp), std::numeric_limits<double>::infinity());
  for (int g = 0; g < c.pp; ++g)
    for (int device : core::devices_of_rank(c, g)) {  // in c's --device-order
      const sim::GpuSpec& gpu = cluster.gpu(device);
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

namespace {

// Nodes spanned by the first expert group (ep x etp consecutive entries of rank 0's device list).
int expert_group_nodes(const sim::Cluster& cluster, const TuneCandidate& c) {
  const std::vector<int> devices = core::devices_of_rank(c, 0);
  std::set<int> nodes;
  for (std::size_t i = 0; i < devices.size() && i < static_cast<std::size_t>(c.ep * c.etp); ++i)
    nodes.insert(cluster.node_of(devices[i]));
  return static_cast<int>(nodes.size());
}

}  // namespace

std::vector<TuneCandidate> device_order_variants(const TuneSpec& spec, const TuneCandidate& c) {
  std::vector<TuneCandidate> out;
  const core::StrategyOptions defaults;
  if (c.pp < 2 || c.ep < 2 || c.device_order != defaults.device_order || !c.rank_order.empty()) return out;
  TuneCandidate v = c;
  v.device_order = "tp-cp-dp-pp";
  const sim::Cluster& cluster = cost_model_of(spec)->cluster();
  if (expert_group_nodes(cluster, v) >= expert_group_nodes(cluster, c)) return out;
  v.placement = (c.pp_ranges.empty() ? std::string() : c.placement + "; ") + "Megatron's device order";
  out.push_back(std::move(v));
  return out;
}

}  // namespace piper::search
