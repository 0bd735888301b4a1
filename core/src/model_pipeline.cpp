// Automatic pipeline-region balancing: PP tags over pipeline units of about equal FLOPs
// (balance_pipeline, rebalance_for_devices, annotate_pipeline_ranges).
#include "piper/core/model.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "piper/core/error.hpp"

namespace piper::core {

// ---------------------------------------------------------------------------------------------
// Pipeline regions
// ---------------------------------------------------------------------------------------------
namespace {

void clear_pp_tags(Model& model) {
  for (auto& l : model.mutable_layers()) l.tags.erase("PP");
}

// Pipeline units: maximal runs of layers with the same block index; the embedding travels with the
// first block and the final norm + head with the last block (as in Megatron), so every region holds
// at least one transformer block. Regions are contiguous runs of units.
struct PipelineUnit {
  std::size_t first, last;  // layer range [first, last)
  double flops;             // F + BI + BW at the model's training shape
};

std::vector<PipelineUnit> pipeline_units(const Model& model, PipelineEnds ends = {}) {
  const auto& layers = model.layers();
  std::vector<PipelineUnit> units;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const Costs c = model.layer_cost(i);
    const double f = c.forward_flops + c.backward_flops();
    if (units.empty() || layers[units.back().first].block != layers[i].block)
      units.push_back({i, i + 1, f});
    else {
      units.back().last = i + 1;
      units.back().flops += f;
    }
  }
  // An end unit asked for as a region of its own stays a unit of its own.
  const bool front_end = !units.empty() && layers[units.front().first].block < 0;
  const bool back_end = !units.empty() && layers[units.back().first].block < 0;
  if (ends.embedding && !front_end)
    throw ModelError(model.name() +
                     ": the embedding cannot be a PP region of its own: the model has no layers before "
                     "its first block");
  if (ends.head && !back_end)
    throw ModelError(model.name() +
                     ": the head cannot be a PP region of its own: the model has no layers after its "
                     "last block");
  if (!ends.embedding && units.size() >= 3 && front_end) {
    units[1].first = units[0].first;
    units[1].flops += units[0].flops;
    units.erase(units.begin());
  }
  if (!ends.head && units.size() >= 2 && back_end) {
    units[units.size() - 2].last = units.back().last;
    units[units.size() - 2].flops += units.back().flops;
    units.pop_back();
  }
  return units;
}

// Starts of K contiguous regions over `flops` (unit costs) that minimise the largest region cost and,
// among those, the sum of squared region costs.
std::vector<int> balanced_starts(const std::vector<double>& flops, int K) {
  const int n = static_cast<int>(flops.size());
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + flops[static_cast<std::size_t>(i)];
  auto cost = [&](int i, int j) { return prefix[j] - prefix[i]; };  // units [i, j)
  const double inf = std::numeric_limits<double>::infinity();

  // Pass 1 (exact DP, O(K n^2)): the smallest achievable maximum region cost.
  std::vector<std::vector<double>> best(K + 1, std::vector<double>(n + 1, inf));
  for (int j = 1; j <= n; ++j) best[1][j] = cost(0, j);
  for (int k = 2; k <= K; ++k)
    for (int j = k; j <= n; ++j)
      for (int i = k - 1; i < j; ++i) best[k][j] = std::min(best[k][j], std::max(best[k - 1][i], cost(i, j)));
  const double bound = best[K][n] * (1 + 1e-12) + 1e-9;

  // Pass 2: among partitions within that maximum, minimise the sum of squared region costs so the
  // non-bottleneck regions are balanced too (a plain min-max partition may leave them lopsided).
  std::vector<std::vector<double>> sq(K + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> from(K + 1, std::vector<int>(n + 1, -1));
  sq[0][0] = 0;
  for (int k = 1; k <= K; ++k)
    for (int j = k; j <= n; ++j)
      for (int i = k - 1; i < j; ++i) {
        const double c = cost(i, j);
        if (c > bound || sq[k - 1][i] == inf) continue;
        const double v = sq[k - 1][i] + c * c;
        if (v < sq[k][j]) {
          sq[k][j] = v;
          from[k][j] = i;
        }
      }
  std::vector<int> starts(static_cast<std::size_t>(K));
  int j = n;
  for (int k = K; k >= 1; --k) j = starts[static_cast<std::size_t>(k - 1)] = from[k][j];
  return starts;
}

}  // namespace

void balance_pipeline(Model& model, int stages, PipelineEnds ends) {
  auto& layers = model.mutable_layers();
  const std::vector<PipelineUnit> units = pipeline_units(model, ends);
  const int n = static_cast<int>(units.size());
  const int e = ends.embedding ? 1 : 0, h = ends.head ? 1 : 0;
  if (stages - e - h < 1 || stages > n)
    throw ModelError(model.name() + ": balance_pipeline: stages must be between " + std::to_string(1 + e + h) +
                     " and " + std::to_string(n) + " (the number of pipeline units), got " + std::to_string(stages));
  std::vector<double> middle;
  for (int u = e; u < n - h; ++u) middle.push_back(units[static_cast<std::size_t>(u)].flops);
  std::vector<int> starts = balanced_starts(middle, stages - e - h);
  for (auto& s : starts) s += e;
  if (e) starts.insert(starts.begin(), 0);
  if (h) starts.push_back(n - 1);
  starts.push_back(n);
  clear_pp_tags(model);
  for (int k = 0; k < stages; ++k)
    for (int u = starts[static_cast<std::size_t>(k)]; u < starts[static_cast<std::size_t>(k) + 1]; ++u)
      for (std::size_t l = units[static_cast<std::size_t>(u)].first; l < units[static_cast<std::size_t>(u)].last; ++l)
        layers[l].tags["PP"] = k;
}

void rebalance_for_devices(Model& model, const std::vector<std::vector<int>>& devices_of_region, PipelineEnds ends) {
  const std::vector<PipelineUnit> units = pipeline_units(model, ends);
  const int regions = static_cast<int>(devices_of_region.size());
  auto& layers = model.mutable_layers();
  // Current boundaries from the PP tags: start[r] = first unit of region r.
  std::vector<int> start(static_cast<std::size_t>(regions) + 1, static_cast<int>(units.size()));
  for (int u = static_cast<int>(units.size()) - 1; u >= 0; --u) {
    auto it = layers[units[static_cast<std::size_t>(u)].first].tags.find("PP");
    if (it == layers[units[static_cast<std::size_t>(u)].first].tags.end() || it->second >= regions) return;
    start[static_cast<std::size_t>(it->second)] = u;
  }
  int top_device = 0;
  for (const auto& ds : devices_of_region)
    for (int d : ds) top_device = std::max(top_device, d);
  // Objective: device loads sorted in decreasing order, compared lexicographically (the busiest
  // device first, then the next, ...).
  auto loads = [&](const std::vector<int>& st) {
    std::vector<double> load(static_cast<std::size_t>(top_device) + 1, 0.0);
    for (int r = 0; r < regions; ++r) {
      double c = 0;
      for (int u = st[static_cast<std::size_t>(r)]; u < st[static_cast<std::size_t>(r) + 1]; ++u)
        c += units[static_cast<std::size_t>(u)].flops;
      for (int d : devices_of_region[static_cast<std::size_t>(r)]) load[static_cast<std::size_t>(d)] += c;
    }
    std::sort(load.rbegin(), load.rend());
    return load;
  };
  // Hill climbing over single-unit boundary moves; each accepted move strictly improves the objective.
  auto best = loads(start);
  for (bool improved = true; improved;) {
    improved = false;
    std::vector<int> best_start = start;
    for (int r = 1; r < regions; ++r)
      for (int step : {-1, 1}) {
        // A region of its own (embedding, head) keeps its boundary.
        if ((ends.embedding && r == 1) || (ends.head && r == regions - 1)) continue;
        std::vector<int> trial = start;
        trial[static_cast<std::size_t>(r)] += step;
        if (trial[static_cast<std::size_t>(r)] <= trial[static_cast<std::size_t>(r) - 1] ||
            trial[static_cast<std::size_t>(r)] >= trial[static_cast<std::size_t>(r) + 1])
          continue;
        auto l = loads(trial);
        if (l < best) best = l, best_start = trial, improved = true;
      }
    start = best_start;
  }
  for (int r = 0; r < regions; ++r)
    for (int u = start[static_cast<std::size_t>(r)]; u < start[static_cast<std::size_t>(r) + 1]; ++u)
      for (std::size_t l = units[static_cast<std::size_t>(u)].first; l < units[static_cast<std::size_t>(u)].last; ++l)
        layers[l].tags["PP"] = r;
}

void annotate_pipeline_ranges(Model& model, const std::vector<int>& block_starts) {
  int blocks = 0;
  for (const auto& l : model.layers()) blocks = std::max(blocks, l.block + 1);
  const std::string where = model.name() + ": pipeline ranges";
  if (blocks == 0) throw ModelError(where + ": the model has no blocks");
  if (block_starts.empty()) throw ModelError(where + ": at least one region is required");
  if (block_starts[0] != 0) throw ModelError(where + ": the first region must start at block 0");
  for (std::size_t r = 0; r < block_starts.size(); ++r) {
    if (block_starts[r] >= blocks)
      throw ModelError(where + ": start " + std::to_string(block_starts[r]) + " of region " + std::to_string(r) +
                       " is past the last block (" + std::to_string(blocks - 1) + ")");
    if (r > 0 && block_starts[r] <= block_starts[r - 1])
      throw ModelError(where + ": starts must be strictly increasing (region " + std::to_string(r) + ")");
  }
  clear_pp_tags(model);
  int region = 0;  // layers outside blocks follow the previous layer: embedding -> 0, head -> last
  for (auto& l : model.mutable_layers()) {
    if (l.block >= 0)
      region =
          static_cast<int>(std::upper_bound(block_starts.begin(), block_starts.end(), l.block) - block_starts.begin()) -
          1;
    l.tags["PP"] = region;
  }
}

}  // namespace piper::core
