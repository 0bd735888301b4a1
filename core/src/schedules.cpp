// Pipeline schedule families as directive generators (split + order); the only file that knows
// schedule names, so that the compiler, simulator and runtime never branch on them.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/strategy.hpp"

namespace piper::core {
namespace {

using nlohmann::json;

int regions_pp_times_virtual(const StrategyOptions& o) { return o.pp * o.virtual_stages; }

// Contiguous blocks: region i -> rank i * pp / regions (identity when regions == pp).
std::vector<int> contiguous_placement(const StrategyOptions& o, int regions) {
  std::vector<int> rank_of_region(static_cast<size_t>(regions));
  for (int i = 0; i < regions; ++i) rank_of_region[static_cast<size_t>(i)] = static_cast<int>(
      static_cast<long long>(i) * o.pp / regions);
  return rank_of_region;
}

// Checks what every family needs of the context; `family` prefixes the one-line message.
void check_context(const std::string& family, const ScheduleContext& ctx) {
  auto fail = [&](const std::string& why) { throw std::invalid_argument(family + ": " + why); };
  if (ctx.microbatches < 1) fail("--microbatches must be >= 1 (got " + std::to_string(ctx.microbatches) + ")");
  if (ctx.ranks < 1) fail("--pp must be >= 1 (got " + std::to_string(ctx.ranks) + ")");
  if (static_cast<int>(ctx.rank_of_region.size()) != ctx.regions)
    fail("placement covers " + std::to_string(ctx.rank_of_region.size()) + " regions, model has " +
         std::to_string(ctx.regions));
  std::vector<bool> used(static_cast<size_t>(ctx.ranks), false);
  for (int i = 0; i < ctx.regions; ++i) {
    int r = ctx.rank_of_region[static_cast<size_t>(i)];
    if (r < 0 || r >= ctx.ranks)
      fail("region PP " + std::to_string(i) + " is placed on rank " + std::to_string(r) + ", outside 0.." +
           std::to_string(ctx.ranks - 1));
    used[static_cast<size_t>(r)] = true;
  }
  for (int r = 0; r < ctx.ranks; ++r)
    if (!used[static_cast<size_t>(r)]) fail("pipeline rank " + std::to_string(r) + " holds no PP region");
}

json step(int region, int mb, const char* pass) {
  return json::array({json{{"PP", region}, {"MB", mb}, {"PASS", pass}}});
}

json split_directive(int microbatches) {
  return json{{"op", "split"}, {"filter", json::object()}, {"dim_name", "MB"}, {"num_microbatches", microbatches}};
}

// Builds split + one order per PP region from a per-region step sequence. Each region is ordered as
// a stage of a pipeline with `regions` stages; a rank that holds several regions (a V placement, or
// virtual stages appended to a placement-only program) interleaves them as data dependencies allow.
// Ordering each region on its own keeps any placement deadlock-free: the orders together are those
// of a plain `regions`-stage pipeline, which is acyclic.
template <class PerStage>
json split_and_orders(const ScheduleContext& ctx, PerStage per_stage) {
  json out = json::array();
  out.push_back(split_directive(ctx.microbatches));
  for (int k = 0; k < ctx.regions; ++k) out.push_back(json{{"op", "order"}, {"filters", per_stage(k)}});
  return out;
}

// GPipe: every stage runs all forwards (mb 0..M-1), then all backwards (mb 0..M-1).
json gpipe_directives(const ScheduleContext& ctx) {
  check_context("gpipe", ctx);
  const int m_count = ctx.microbatches;
  return split_and_orders(ctx, [&](int k) {
    json groups = json::array();
    for (int mb = 0; mb < m_count; ++mb) groups.push_back(step(k, mb, "F"));
    for (int mb = 0; mb < m_count; ++mb) groups.push_back(step(k, mb, "B"));
    return groups;
  });
}

// 1F1B (PipeDream-flush, as in Megatron-LM): stage k of n runs warmup = min(n-1-k, M) forwards, then
// M-warmup steady pairs F(warmup+i), B(i), then the remaining backwards. Stage k's warmup fills the
// pipeline exactly when its first backward can arrive, which bounds in-flight activations to n-k.
json one_f_one_b_directives(const ScheduleContext& ctx) {
  check_context("1f1b", ctx);
  const int m_count = ctx.microbatches;
  const int n = ctx.regions;
  return split_and_orders(ctx, [&](int k) {
    json groups = json::array();
    const int warmup = std::min(n - 1 - k, m_count);
    for (int mb = 0; mb < warmup; ++mb) groups.push_back(step(k, mb, "F"));
    for (int i = 0; i < m_count - warmup; ++i) {
      groups.push_back(step(k, warmup + i, "F"));
      groups.push_back(step(k, i, "B"));
    }
    for (int mb = m_count - warmup; mb < m_count; ++mb) groups.push_back(step(k, mb, "B"));
    return groups;
  });
}

}  // namespace

const std::vector<ScheduleFamily>& schedule_registry() {
  static const std::vector<ScheduleFamily> registry = {
      {"gpipe", "any --pp, --microbatches >= 1; all forwards then all backwards (activations of M microbatches)",
       regions_pp_times_virtual, contiguous_placement, gpipe_directives},
      {"1f1b", "any --pp, --microbatches >= 1 (>= pp to fill the pipeline); at most p-r microbatches in flight",
       regions_pp_times_virtual, contiguous_placement, one_f_one_b_directives},
  };
  return registry;
}

}  // namespace piper::core
