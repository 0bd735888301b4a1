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

// One order group: filters that may interleave; groups of one rank run in sequence.
using Group = std::vector<json>;

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

// Regions held by each rank, in increasing region order.
std::vector<std::vector<int>> regions_of_ranks(const ScheduleContext& ctx) {
  std::vector<std::vector<int>> held(static_cast<size_t>(ctx.ranks));
  for (int i = 0; i < ctx.regions; ++i) held[static_cast<size_t>(ctx.rank_of_region[static_cast<size_t>(i)])].push_back(i);
  return held;
}

json step_filter(int region, int mb, const char* pass) {
  return json{{"PP", region}, {"MB", mb}, {"PASS", pass}};
}

// One step of microbatch `mb` on a rank: a filter per region the rank holds, in one group, so the
// rank's chunks of that microbatch may interleave as data dependencies allow. Forward-like passes
// list regions in increasing order, backward-like ones in decreasing order (the order data flows).
// With one region per rank this is the usual one-filter step (a total order).
Group step(const std::vector<int>& held, int mb, const char* pass, bool forward) {
  Group g;
  if (forward)
    for (int region : held) g.push_back(step_filter(region, mb, pass));
  else
    for (auto it = held.rbegin(); it != held.rend(); ++it) g.push_back(step_filter(*it, mb, pass));
  return g;
}

json split_directive(int microbatches) {
  return json{{"op", "split"}, {"filter", json::object()}, {"dim_name", "MB"}, {"num_microbatches", microbatches}};
}

json order_directive(const std::vector<Group>& groups) {
  json filters = json::array();
  for (const Group& g : groups) filters.push_back(json(g));
  return json{{"op", "order"}, {"filters", filters}};
}

// Builds split + one order per rank from a per-rank step sequence generator.
template <class PerRank>
json split_and_orders(const ScheduleContext& ctx, PerRank per_rank) {
  json out = json::array();
  out.push_back(split_directive(ctx.microbatches));
  auto held = regions_of_ranks(ctx);
  for (int r = 0; r < ctx.ranks; ++r) out.push_back(order_directive(per_rank(r, held[static_cast<size_t>(r)])));
  return out;
}

// GPipe: every rank runs all forwards (mb 0..M-1), then all backwards (mb 0..M-1).
json gpipe_directives(const ScheduleContext& ctx) {
  check_context("gpipe", ctx);
  const int m_count = ctx.microbatches;
  return split_and_orders(ctx, [&](int, const std::vector<int>& held) {
    std::vector<Group> groups;
    for (int mb = 0; mb < m_count; ++mb) groups.push_back(step(held, mb, "F", true));
    for (int mb = 0; mb < m_count; ++mb) groups.push_back(step(held, mb, "B", false));
    return groups;
  });
}

// 1F1B (PipeDream-flush, as in Megatron-LM): rank r of p runs warmup = min(p-1-r, M) forwards, then
// M-warmup steady pairs F(warmup+i), B(i), then the remaining backwards. Rank r's warmup fills the
// pipeline exactly when its first backward can arrive, which bounds in-flight activations to p-r.
// When a rank holds several regions (e.g. a V placement), each step covers all of them (see step()).
json one_f_one_b_directives(const ScheduleContext& ctx) {
  check_context("1f1b", ctx);
  const int m_count = ctx.microbatches;
  const int p = ctx.ranks;
  return split_and_orders(ctx, [&](int r, const std::vector<int>& held) {
    std::vector<Group> groups;
    const int warmup = std::min(p - 1 - r, m_count);
    for (int mb = 0; mb < warmup; ++mb) groups.push_back(step(held, mb, "F", true));
    for (int i = 0; i < m_count - warmup; ++i) {
      groups.push_back(step(held, warmup + i, "F", true));
      groups.push_back(step(held, i, "B", false));
    }
    for (int mb = m_count - warmup; mb < m_count; ++mb) groups.push_back(step(held, mb, "B", false));
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
