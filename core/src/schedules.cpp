// Pipeline schedule families as directive generators (split + order); the only file that knows
// schedule names, so that the compiler, simulator and runtime never branch on them. Each family
// states its rule once, as a per-rank step order (a ScheduleTable, PyTorch's compute-only
// `pipeline_order`); directives, `schedule show` and the PyTorch CSV are all derived from it.
#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "piper/core/program_builder.hpp"
#include "piper/core/schedules_zb.hpp"
#include "schedule_ends.hpp"
#include "piper/core/strategy.hpp"

namespace piper::core {
namespace {

[[noreturn]] void fail(const std::string& family, const std::string& why) {
  throw std::invalid_argument(family + ": " + why);
}

int regions_pp_times_virtual(const StrategyOptions& o) { return o.pp * o.virtual_stages; }

// Contiguous blocks: region i -> rank i * pp / regions (identity when regions == pp).
std::vector<int> contiguous_placement(const StrategyOptions& o, int regions) {
  std::vector<int> rank_of_region(static_cast<size_t>(regions));
  for (int i = 0; i < regions; ++i)
    rank_of_region[static_cast<size_t>(i)] = static_cast<int>(static_cast<long long>(i) * o.pp / regions);
  return rank_of_region;
}

// Round robin (Megatron's virtual stages): region i -> rank i mod pp.
int looped_rank(int region, int ranks) { return region % ranks; }
std::vector<int> looped_placement(const StrategyOptions& o, int regions) {
  std::vector<int> r(static_cast<size_t>(regions));
  for (int i = 0; i < regions; ++i) r[static_cast<size_t>(i)] = looped_rank(i, o.pp);
  return r;
}

// V shape: rank r holds regions r and 2p-1-r, so the first and last stage share rank 0.
int v_rank(int region, int ranks) { return region < ranks ? region : 2 * ranks - 1 - region; }
std::vector<int> v_placement(const StrategyOptions& o, int regions) {
  std::vector<int> r(static_cast<size_t>(regions));
  for (int i = 0; i < regions; ++i) r[static_cast<size_t>(i)] = v_rank(i, o.pp);
  return r;
}

// The V with the embedding and/or the head as regions of their own (--v-embedding / --v-head): the
// V's 2p regions follow the embedding's region, the head's region follows them, each end on its rank.
// With --v-head alone the head's rank (the last) holds nothing else and the V spans the others.
std::vector<int> v_placement_with_ends(const StrategyOptions& o, int regions) {
  const int embedding = own_end_rank(o, false), head = own_end_rank(o, true);
  const int e = embedding >= 0 ? 1 : 0, h = head >= 0 ? 1 : 0, q = o.pp - (o.v_head == "alone" ? 1 : 0);
  if (regions != 2 * q + e + h) return v_placement(o, regions);  // the family's check names the mismatch
  std::vector<int> r(static_cast<size_t>(regions));
  for (int i = 0; i < 2 * q; ++i) r[static_cast<size_t>(i + e)] = v_rank(i, q);
  if (e) r.front() = embedding;
  if (h) r.back() = head;
  return r;
}

// Checks what every family needs of the context; `family` prefixes the one-line message.
void check_context(const std::string& family, const ScheduleContext& ctx) {
  if (ctx.microbatches < 1) fail(family, "--microbatches must be >= 1 (got " + std::to_string(ctx.microbatches) + ")");
  if (ctx.ranks < 1) fail(family, "--pp must be >= 1 (got " + std::to_string(ctx.ranks) + ")");
  if (static_cast<int>(ctx.rank_of_region.size()) != ctx.regions)
    fail(family, "placement covers " + std::to_string(ctx.rank_of_region.size()) + " regions, model has " +
                     std::to_string(ctx.regions));
  std::vector<bool> used(static_cast<size_t>(ctx.ranks), false);
  for (int i = 0; i < ctx.regions; ++i) {
    int r = ctx.rank_of_region[static_cast<size_t>(i)];
    if (r < 0 || r >= ctx.ranks)
      fail(family, "region PP " + std::to_string(i) + " is placed on rank " + std::to_string(r) + ", outside 0.." +
                       std::to_string(ctx.ranks - 1));
    used[static_cast<size_t>(r)] = true;
  }
  for (int r = 0; r < ctx.ranks; ++r)
    if (!used[static_cast<size_t>(r)]) fail(family, "pipeline rank " + std::to_string(r) + " holds no PP region");
}

// Families whose rule assumes a placement check it (a placement-only program may place otherwise).
template <class RankOf>
void expect_placement(const std::string& family, const ScheduleContext& ctx, int regions, const std::string& shape,
                      RankOf rank_of) {
  if (ctx.regions != regions)
    fail(family, "needs " + std::to_string(regions) + " PP regions for --pp " + std::to_string(ctx.ranks) + " (" +
                     shape + "), the model has " + std::to_string(ctx.regions));
  for (int i = 0; i < regions; ++i)
    if (ctx.rank_of_region[static_cast<size_t>(i)] != rank_of(i, ctx.ranks))
      fail(family, "needs region PP " + std::to_string(i) + " on rank " + std::to_string(rank_of(i, ctx.ranks)) + " (" +
                       shape + "), it is on rank " + std::to_string(ctx.rank_of_region[static_cast<size_t>(i)]));
}

Pass pass_of(ActionKind k);

// The order filter of one action: {PP: stage, MB: microbatch, PASS: its pass}.
Filter action_filter(const ScheduleAction& a) {
  return Filter{{{"PP", a.stage}, {"MB", a.microbatch}}, {}, pass_of(a.kind)};
}

// The split every schedule starts with (its dimension written out, as the published programs do).
ProgramBuilder split_program(int microbatches) {
  ProgramBuilder out;
  out.split(Filter{}, microbatches, std::string("MB"));
  return out;
}

// Builds split + one order per PP region from a per-region step sequence. Each region is ordered as
// a stage of a pipeline with `regions` stages; a rank that holds several regions (virtual stages
// appended to a placement-only program) interleaves them as data dependencies allow.
// Ordering each region on its own keeps any placement deadlock-free: the orders together are those
// of a plain `regions`-stage pipeline, which is acyclic.
template <class PerStage>
DirectiveProgram split_and_orders(const ScheduleContext& ctx, PerStage per_stage) {
  ProgramBuilder out = split_program(ctx.microbatches);
  for (int k = 0; k < ctx.regions; ++k) {
    std::vector<std::vector<Filter>> groups;
    for (const auto& a : per_stage(k)) groups.push_back({action_filter(a)});
    out.order(groups);
  }
  return out.take();
}

// Per-stage sequences of the single-stage families, as actions.
std::vector<ScheduleAction> gpipe_stage(int k, int m_count) {
  std::vector<ScheduleAction> out;
  for (int mb = 0; mb < m_count; ++mb) out.push_back({k, ActionKind::F, mb});
  for (int mb = 0; mb < m_count; ++mb) out.push_back({k, ActionKind::B, mb});
  return out;
}

// 1F1B (PipeDream-flush, as in Megatron-LM): stage k of n runs warmup = min(n-1-k, M) forwards, then
// M-warmup steady pairs F(warmup+i), B(i), then the remaining backwards. Stage k's warmup fills the
// pipeline exactly when its first backward can arrive, which bounds in-flight activations to n-k.
std::vector<ScheduleAction> one_f_one_b_stage(int k, int n, int m_count) {
  std::vector<ScheduleAction> out;
  const int warmup = std::min(n - 1 - k, m_count);
  for (int mb = 0; mb < warmup; ++mb) out.push_back({k, ActionKind::F, mb});
  for (int i = 0; i < m_count - warmup; ++i) {
    out.push_back({k, ActionKind::F, warmup + i});
    out.push_back({k, ActionKind::B, i});
  }
  for (int mb = m_count - warmup; mb < m_count; ++mb) out.push_back({k, ActionKind::B, mb});
  return out;
}

Pass pass_of(ActionKind k) {
  switch (k) {
    case ActionKind::F:
      return Pass::F;
    case ActionKind::B:
      return Pass::B;
    case ActionKind::I:
      return Pass::BI;
    case ActionKind::W:
      return Pass::BW;
  }
  return Pass::F;
}

DirectiveProgram gpipe_directives(const ScheduleContext& ctx) {
  check_context("gpipe", ctx);
  return split_and_orders(ctx, [&](int k) { return gpipe_stage(k, ctx.microbatches); });
}

DirectiveProgram one_f_one_b_directives(const ScheduleContext& ctx) {
  check_context("1f1b", ctx);
  return split_and_orders(ctx, [&](int k) { return one_f_one_b_stage(k, ctx.regions, ctx.microbatches); });
}

// Single-stage families have a per-rank order only when each rank holds exactly one region.
template <class PerStage>
ScheduleTable one_region_per_rank_table(const std::string& family, const ScheduleContext& ctx, PerStage per_stage) {
  check_context(family, ctx);
  ScheduleTable t{ctx.regions, ctx.microbatches,
                  std::vector<std::vector<ScheduleStep>>(static_cast<size_t>(ctx.ranks))};
  std::vector<int> region_of_rank(static_cast<size_t>(ctx.ranks), -1);
  for (int k = 0; k < ctx.regions; ++k) {
    int& slot = region_of_rank[static_cast<size_t>(ctx.rank_of_region[static_cast<size_t>(k)])];
    if (slot >= 0)
      fail(family,
           "rank " + std::to_string(ctx.rank_of_region[static_cast<size_t>(k)]) +
               " holds several regions; its steps are ordered per region, so there is no single per-rank order");
    slot = k;
  }
  for (int r = 0; r < ctx.ranks; ++r)
    for (const auto& a : per_stage(region_of_rank[static_cast<size_t>(r)]))
      t.ranks[static_cast<size_t>(r)].push_back({a});
  return t;
}

// Appends actions to one rank's order, numbering microbatches per (stage, kind) as they are issued.
class RankWriter {
 public:
  explicit RankWriter(std::vector<ScheduleStep>& out) : out_(out) {}
  ScheduleAction next(int stage, ActionKind kind) {
    // A full B consumes one input-gradient and one weight-gradient slot of its stage, as in PyTorch.
    const ActionKind counter = kind == ActionKind::B ? ActionKind::I : kind;
    int& n = count_[{stage, counter}];
    ScheduleAction a{stage, kind, n++};
    if (kind == ActionKind::B) ++count_[{stage, ActionKind::W}];
    if (kind == ActionKind::I) weights_.push_back({stage, ActionKind::W, a.microbatch});
    return a;
  }
  void add(int stage, ActionKind kind) { out_.push_back({next(stage, kind)}); }
  void overlap(int forward_stage, int backward_stage) {
    ScheduleAction f = next(forward_stage, ActionKind::F);
    ScheduleAction b = next(backward_stage, ActionKind::B);
    out_.push_back({f, b});
  }
  // The oldest deferred weight gradient, if any (DualPipe's WeightGradStore).
  void weight() {
    if (weights_.empty()) return;
    out_.push_back({weights_.front()});
    ++count_[{weights_.front().stage, ActionKind::W}];
    weights_.pop_front();
  }
  int issued(int stage, ActionKind kind) const {
    auto it = count_.find({stage, kind});
    return it == count_.end() ? 0 : it->second;
  }

 private:
  std::vector<ScheduleStep>& out_;
  std::map<std::pair<int, ActionKind>, int> count_;
  std::deque<ScheduleAction> weights_;
};

// The depth-first interleaved rule shared by Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM)
// and ZB-H1 / ZB1P (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): rank r holds stages
// r, r+p, ..., r+(v-1)p. Forwards walk the local stages in rounds of `per_round` microbatches;
// after `warmup` forwards every forward is paired with a backward walking the stages in reverse.
// With zero_bubble the backward is split: I on the critical path, W deferred by r steps so that
// rank r fills its cooldown bubble with weight gradients. With overlap (interleaved-1f1b-overlap) each
// steady-state forward and its backward form one overlapped step.
ScheduleTable depth_first_table(const ScheduleContext& ctx, bool zero_bubble, bool overlap = false) {
  const int p = ctx.ranks, v = ctx.regions / ctx.ranks, m = ctx.microbatches;
  const int rounds = std::max(1, m / p), per_round = m / rounds;
  ScheduleTable t{ctx.regions, m, std::vector<std::vector<ScheduleStep>>(static_cast<size_t>(p))};
  for (int r = 0; r < p; ++r) {
    const int total = m * v;
    // With overlapped F&B pairs one more forward runs ahead, so that no pair holds a forward and the
    // backward that depends on it (Megatron-LM's num_warmup_microbatches + 1 under
    // overlap_moe_expert_parallel_comm).
    const int warmup = std::min((v - 1) * per_round + (zero_bubble ? 1 : 2) * (p - 1 - r) + (overlap ? 1 : 0), total);
    auto fstage = [&](int k) { return ((k / per_round) % v) * p + r; };
    auto bstage = [&](int k) { return (v - 1 - ((k - warmup) / per_round) % v) * p + r; };
    RankWriter w(t.ranks[static_cast<size_t>(r)]);
    std::vector<int> backward_stages;
    int weights_done = 0;
    auto backward = [&](int op) {
      const int s = bstage(op);
      w.add(s, zero_bubble ? ActionKind::I : ActionKind::B);
      backward_stages.push_back(s);
      if (zero_bubble && op - warmup >= r) w.add(backward_stages[static_cast<size_t>(weights_done++)], ActionKind::W);
    };
    for (int op = 0; op < total + warmup; ++op) {
      if (overlap && op < total && op >= warmup) {
        w.overlap(fstage(op), bstage(op));
        continue;
      }
      if (op < total) w.add(fstage(op), ActionKind::F);
      if (op >= warmup) backward(op);
    }
    while (zero_bubble && weights_done < static_cast<int>(backward_stages.size()))
      w.add(backward_stages[static_cast<size_t>(weights_done++)], ActionKind::W);
  }
  return t;
}

// Uneven pipelines (regions not a multiple of p, e.g. 62 one-block chunks on 32 ranks): rank r holds
// v_r = ceil((regions - r) / p) stages r, r+p, ... The published rule's fixed warmup counts assume
// equal v and deadlock here, so the per-rank orders come from running the rule: a list schedule in
// unit time (F = 1, B = 2, or I = 1 and W = 1 with zero_bubble) where each rank takes its forwards and
// backwards in the depth-first order above, the next forward when it can start no later than the
// next backward and fewer than warmup + 1 forwards are in flight (warmup as published, counting the
// stages downstream of the rank's last local stage), else the next backward (I). When every rank is
// blocked by that cap, the earliest forward runs anyway. Orders taken from an execution cannot
// deadlock. Deferred W fill the time a rank would wait, and follow its last backward. On even
// pipelines the same rule gives the published rule's step time (Llama-style 1B, PP 4 x 2 chunks:
// 122.635 ms both; 64 one-block chunks on 32 ranks: 712.0 against 712.1 ms, analytic engine).
ScheduleTable depth_first_uneven_table(const ScheduleContext& ctx, bool zero_bubble) {
  const int p = ctx.ranks, m = ctx.microbatches, regions = ctx.regions;
  const int rounds = std::max(1, m / p), per_round = m / rounds;
  ScheduleTable t{regions, m, std::vector<std::vector<ScheduleStep>>(static_cast<size_t>(p))};
  struct Rank {
    std::vector<std::pair<int, int>> forwards, backwards;  // (stage, microbatch) in depth-first order
    std::size_t next_f = 0, next_b = 0;
    std::deque<std::pair<int, int>> weights;
    double free_at = 0;
    int cap = 0;
  };
  std::vector<Rank> ranks(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    Rank& k = ranks[static_cast<size_t>(r)];
    const int v = (regions - r + p - 1) / p;
    for (int i = 0; i < m * v; ++i) {
      const int chunk = (i / per_round) % v, mb = (i / (per_round * v)) * per_round + i % per_round;
      k.forwards.push_back({chunk * p + r, mb});
      k.backwards.push_back({(v - 1 - chunk) * p + r, mb});
    }
    const int downstream = regions - 1 - ((v - 1) * p + r);
    k.cap = std::min((v - 1) * per_round + (zero_bubble ? 1 : 2) * downstream, m * v) + 1;
  }
  // Completion times of F and of B (I) per (stage, microbatch); -1: not run yet.
  std::vector<std::vector<double>> f_done(static_cast<size_t>(regions),
                                          std::vector<double>(static_cast<size_t>(m), -1));
  auto b_done = f_done;
  const double f_time = 1, b_time = zero_bubble ? 1 : 2, w_time = 1;
  auto f_ready = [&](std::pair<int, int> a) {
    return a.first == 0 ? 0.0 : f_done[static_cast<size_t>(a.first - 1)][static_cast<size_t>(a.second)];
  };
  auto b_ready = [&](std::pair<int, int> a) {
    const double own = f_done[static_cast<size_t>(a.first)][static_cast<size_t>(a.second)];
    if (own < 0 || a.first == regions - 1) return own;
    const double next = b_done[static_cast<size_t>(a.first + 1)][static_cast<size_t>(a.second)];
    return next < 0 ? -1.0 : std::max(own, next);
  };
  std::size_t remaining = 0;
  for (const auto& k : ranks) remaining += k.forwards.size() + k.backwards.size();
  while (remaining > 0) {
    // Each rank's candidate: (start, kind 0 = B, 1 = F), the earliest start over ranks wins.
    int best = -1, best_kind = 0;
    double best_start = 0;
    bool capped = false;
    for (int pass = 0; pass < 2 && best < 0; ++pass) {
      for (int r = 0; r < p; ++r) {
        Rank& k = ranks[static_cast<size_t>(r)];
        double start = -1;
        int kind = 0;
        if (k.next_b < k.backwards.size()) {
          const double ready = b_ready(k.backwards[k.next_b]);
          if (ready >= 0) start = std::max(k.free_at, ready);
        }
        const int in_flight = static_cast<int>(k.next_f) - static_cast<int>(k.next_b);
        if (k.next_f < k.forwards.size() && (pass == 1 || in_flight < k.cap)) {
          const double ready = f_ready(k.forwards[k.next_f]);
          if (ready >= 0 && (start < 0 || std::max(k.free_at, ready) <= start))
            start = std::max(k.free_at, ready), kind = 1;
        } else if (k.next_f < k.forwards.size()) {
          capped = true;
        }
        if (start >= 0 && (best < 0 || start < best_start)) best = r, best_start = start, best_kind = kind;
      }
      if (best < 0 && !capped) throw std::logic_error("uneven depth-first schedule: no rank can proceed");
    }
    Rank& k = ranks[static_cast<size_t>(best)];
    // Deferred weight gradients fill the time this rank would otherwise wait.
    while (zero_bubble && !k.weights.empty() && k.free_at + w_time <= best_start) {
      t.ranks[static_cast<size_t>(best)].push_back(
          {{k.weights.front().first, ActionKind::W, k.weights.front().second}});
      k.weights.pop_front();
      k.free_at += w_time;
    }
    if (best_kind == 1) {
      const auto a = k.forwards[k.next_f++];
      t.ranks[static_cast<size_t>(best)].push_back({{a.first, ActionKind::F, a.second}});
      f_done[static_cast<size_t>(a.first)][static_cast<size_t>(a.second)] = best_start + f_time;
      k.free_at = best_start + f_time;
    } else {
      const auto a = k.backwards[k.next_b++];
      t.ranks[static_cast<size_t>(best)].push_back({{a.first, zero_bubble ? ActionKind::I : ActionKind::B, a.second}});
      b_done[static_cast<size_t>(a.first)][static_cast<size_t>(a.second)] = best_start + b_time;
      k.free_at = best_start + b_time;
      if (zero_bubble) k.weights.push_back(a);
    }
    --remaining;
  }
  for (int r = 0; r < p; ++r)
    for (const auto& a : ranks[static_cast<size_t>(r)].weights)
      t.ranks[static_cast<size_t>(r)].push_back({{a.first, ActionKind::W, a.second}});
  return t;
}

void check_virtual_rounds(const std::string& family, const ScheduleContext& ctx) {
  const int v = (ctx.regions + ctx.ranks - 1) / ctx.ranks;
  if (v > 1 && ctx.microbatches % ctx.ranks != 0)
    fail(family, "--microbatches " + std::to_string(ctx.microbatches) + " must be a multiple of --pp " +
                     std::to_string(ctx.ranks) + " with --virtual " + std::to_string(v) +
                     " (microbatches go through the virtual stages in groups of pp)");
}

ScheduleTable interleaved_table(const ScheduleContext& ctx) {
  const std::string family = "interleaved-1f1b";
  check_context(family, ctx);
  expect_placement(family, ctx, ctx.regions, "region k on rank k mod pp", looped_rank);
  check_virtual_rounds(family, ctx);
  return ctx.regions % ctx.ranks == 0 ? depth_first_table(ctx, false) : depth_first_uneven_table(ctx, false);
}

// Megatron-core's combined 1F1B (--overlap-moe-expert-parallel-comm; megatron/core/pipeline_parallel):
// the interleaved rule above with one more warmup forward, and each steady-state forward issued with the
// backward that follows it as one overlapped F&B step, so that one microbatch's expert all-to-alls run
// under the other's compute (DualPipe's pairing, without the V). Megatron requires virtual stages when
// pp > 1; with pp = 1 every forward after the first pairs with the previous microbatch's backward.
ScheduleTable interleaved_overlap_table(const ScheduleContext& ctx) {
  const std::string family = "interleaved-1f1b-overlap";
  check_context(family, ctx);
  expect_placement(family, ctx, ctx.regions, "region k on rank k mod pp", looped_rank);
  check_virtual_rounds(family, ctx);
  if (ctx.regions % ctx.ranks != 0)
    fail(family, std::to_string(ctx.regions) + " PP regions are not a multiple of --pp " + std::to_string(ctx.ranks) +
                     " (each rank needs the same number of chunks)");
  if (ctx.ranks > 1 && ctx.regions < 2 * ctx.ranks)
    fail(family, "needs --virtual 2 or more with --pp " + std::to_string(ctx.ranks) +
                     " (Megatron-core overlaps F and B only in the interleaved schedule)");
  return depth_first_table(ctx, false, true);
}

ScheduleTable zb_h1_table(const ScheduleContext& ctx) {
  const std::string family = "zb-h1";
  check_context(family, ctx);
  expect_placement(family, ctx, ctx.regions, "region k on rank k mod pp", looped_rank);
  check_virtual_rounds(family, ctx);
  return ctx.regions % ctx.ranks == 0 ? depth_first_table(ctx, true) : depth_first_uneven_table(ctx, true);
}

// Looped BFS (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism"): each rank runs all
// microbatches through its first local stage, then its next one, ...; backwards in reverse.
ScheduleTable looped_bfs_table(const ScheduleContext& ctx) {
  const std::string family = "looped-bfs";
  check_context(family, ctx);
  if (ctx.regions % ctx.ranks != 0) fail(family, "PP regions must be a multiple of --pp");
  expect_placement(family, ctx, ctx.regions, "region k on rank k mod pp", looped_rank);
  const int p = ctx.ranks, v = ctx.regions / p, m = ctx.microbatches;
  ScheduleTable t{ctx.regions, m, std::vector<std::vector<ScheduleStep>>(static_cast<size_t>(p))};
  for (int r = 0; r < p; ++r) {
    auto& out = t.ranks[static_cast<size_t>(r)];
    for (int l = 0; l < v; ++l)
      for (int mb = 0; mb < m; ++mb) out.push_back({{l * p + r, ActionKind::F, mb}});
    for (int l = v - 1; l >= 0; --l)
      for (int mb = m - 1; mb >= 0; --mb) out.push_back({{l * p + r, ActionKind::B, mb}});
  }
  return t;
}

// ZB-H2 (Qi et al. 2023): rank r runs 2(p-1-r)+1 warmup forwards, exactly those that fit before its
// first input gradient can arrive, then I, W, F in the steady state and I, W in the cooldown. Twice
// 1F1B's activation memory buys a pipeline that stays busy from its first forward on.
ScheduleTable zb_h2_table(const ScheduleContext& ctx) {
  const std::string family = "zb-h2";
  check_context(family, ctx);
  expect_placement(family, ctx, ctx.ranks, "one region per rank", [](int i, int) { return i; });
  const int p = ctx.ranks, m = ctx.microbatches;
  ScheduleTable t{ctx.regions, m, std::vector<std::vector<ScheduleStep>>(static_cast<size_t>(p))};
  for (int r = 0; r < p; ++r) {
    RankWriter w(t.ranks[static_cast<size_t>(r)]);
    const int warmup = std::min(2 * (p - 1 - r) + 1, m);
    for (int i = 0; i < warmup; ++i) w.add(r, ActionKind::F);
    for (int i = 0; i < m; ++i) {
      w.add(r, ActionKind::I);
      w.add(r, ActionKind::W);
      if (w.issued(r, ActionKind::F) < m) w.add(r, ActionKind::F);
    }
  }
  return t;
}

// ZB-V (Qi et al. 2023, section 6; as in PyTorch's ScheduleZBVZeroBubble): V placement, rank r
// holds chunk 0 = stage r and chunk 1 = stage 2p-1-r. Warmup 2(p-r)-1 chunk-0 forwards, r pairs
// F1 F0, p-r triples F1 I1 W1; steady F0 I0 W0 F1 I1 W1; cooldown I0 I1 pairs, I0 W0 pairs, then the
// remaining W1 and W0. It is computed for max(M, 2p-1) microbatches and the extra ones dropped.
ScheduleTable zb_v_table(const ScheduleContext& ctx) {
  const std::string family = "zb-v";
  check_context(family, ctx);
  expect_placement(family, ctx, 2 * ctx.ranks, "V: rank r holds regions r and 2pp-1-r", v_rank);
  const int p = ctx.ranks, m = ctx.microbatches, n = std::max(2 * p - 1, m);
  ScheduleTable t{ctx.regions, m, std::vector<std::vector<ScheduleStep>>(static_cast<size_t>(p))};
  for (int r = 0; r < p; ++r) {
    std::vector<ScheduleStep> all;
    const int s0 = r, s1 = 2 * p - 1 - r;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    auto add = [&](int s, ActionKind k, int mb) { all.push_back({{s, k, mb}}); };
    for (int i = 0; i < 2 * (p - r) - 1; ++i) add(s0, ActionKind::F, f0++);
    for (int i = 0; i < r; ++i) add(s1, ActionKind::F, f1++), add(s0, ActionKind::F, f0++);
    for (int i = 0; i < p - r; ++i)
      add(s1, ActionKind::F, f1++), add(s1, ActionKind::I, b1), add(s1, ActionKind::W, b1++);
    while (f1 < f0 || f0 < n) {
      if (f0 < n) add(s0, ActionKind::F, f0++);
      add(s0, ActionKind::I, b0), add(s0, ActionKind::W, b0++);
      add(s1, ActionKind::F, f1++), add(s1, ActionKind::I, b1), add(s1, ActionKind::W, b1++);
    }
    int w0 = b0, w1 = b1;
    for (int i = 0; i < r; ++i) add(s0, ActionKind::I, b0++), add(s1, ActionKind::I, b1++);
    for (int i = 0; i < p - r; ++i) add(s0, ActionKind::I, b0++), add(s0, ActionKind::W, w0++);
    while (w1 < b1) add(s1, ActionKind::W, w1++);
    while (w0 < b0) add(s0, ActionKind::W, w0++);
    for (auto& st : all)
      if (st.front().microbatch < m) t.ranks[static_cast<size_t>(r)].push_back(st);
  }
  return t;
}

// The eight phases of DualPipe (DeepSeek-V3 report, section 3.2; github.com/deepseek-ai/DualPipe) for
// one rank at depth `h` of a pipeline of `half` depths, with chunk 0 the stage at depth h and chunk 1
// the stage at depth 2*half-1-h, over `chunks` microbatches per direction. DualPipeV is the same
// rule on a V (one model, depth = rank); DualPipe runs it on both copies of a mirrored pair.
// `mirrored_middle` selects DualPipe's variant of phase 7 (always zero-bubble I).
void dualpipe_phases(RankWriter& w, int h, int half, int chunks, int c0, int c1, bool dualpipe) {
  // 1: F0 until the chunk-1 input can arrive.
  for (int i = 0; i < (half - h - 1) * 2; ++i) w.add(c0, ActionKind::F);
  // 2: F0 F1.
  for (int i = 0; i < h + 1; ++i) w.add(c0, ActionKind::F), w.add(c1, ActionKind::F);
  // 3: I1 W1 F1 (zero bubble).
  for (int i = 0; i < half - h - 1; ++i) w.add(c1, ActionKind::I), w.weight(), w.add(c1, ActionKind::F);
  // 4: the main phase, overlapped F0&B1 and F1&B0; the middle rank does not overlap its first pair.
  for (int i = 0; i < chunks - 2 * half + h + 1; ++i) {
    if (i == 0 && h == half - 1)
      w.add(c0, ActionKind::F), w.add(c1, ActionKind::B);
    else
      w.overlap(c0, c1);
    w.overlap(c1, c0);
  }
  // 5: B1, F1&B0.
  for (int i = 0; i < half - h - 1; ++i) w.add(c1, ActionKind::B), w.overlap(c1, c0);
  // 6: B1 B0; the second half of them zero-bubble (I now, W later).
  bool zb = false;
  for (int i = 0; i < h + 1; ++i) {
    if (i == (h + 1) / 2 && h % 2 == 1) zb = true;
    w.add(c1, zb ? ActionKind::I : ActionKind::B);
    if (i == (h + 1) / 2 && h % 2 == 0) zb = true;
    w.add(c0, zb ? ActionKind::I : ActionKind::B);
  }
  // 7: W, B0.
  for (int i = 0; i < half - h - 1; ++i) w.weight(), w.add(c0, (zb || dualpipe) ? ActionKind::I : ActionKind::B);
  // 8: the remaining W.
  for (int i = 0; i < h + 1; ++i) w.weight();
}

ScheduleTable dualpipev_table(const ScheduleContext& ctx) {
  const std::string family = "dualpipev";
  check_context(family, ctx);
  expect_placement(family, ctx, 2 * ctx.ranks, "V: rank r holds regions r and 2pp-1-r", v_rank);
  const int p = ctx.ranks, m = ctx.microbatches;
  if (m < 2 * p)
    fail(family, "--microbatches " + std::to_string(m) + " must be >= 2 x --pp = " + std::to_string(2 * p));
  ScheduleTable t{ctx.regions, m, std::vector<std::vector<ScheduleStep>>(static_cast<size_t>(p))};
  for (int r = 0; r < p; ++r) {
    RankWriter w(t.ranks[static_cast<size_t>(r)]);
    dualpipe_phases(w, r, p, m, r, 2 * p - 1 - r, false);
  }
  return t;
}

// DualPipe: two copies of a p-stage model; copy 0 runs stage k on rank k, copy 1 on rank p-1-k, and
// each takes half the microbatches. Rank r and rank p-1-r run the same steps (on mirrored copies), so
// the DAG holds one node per (stage, microbatch) on the pair of devices and orders it once.
ScheduleTable dualpipe_table(const ScheduleContext& ctx) {
  const std::string family = "dualpipe";
  check_context(family, ctx);
  expect_placement(family, ctx, ctx.ranks, "one region per rank, mirrored", [](int i, int) { return i; });
  const int p = ctx.ranks, m = ctx.microbatches;
  if (p % 2 != 0) fail(family, "--pp " + std::to_string(p) + " must be even (the two directions meet in the middle)");
  if (m % 2 != 0 || m < 2 * p)
    fail(family, "--microbatches " + std::to_string(m) + " must be even and >= 2 x --pp = " + std::to_string(2 * p));
  ScheduleTable t{ctx.regions, m / 2, std::vector<std::vector<ScheduleStep>>(static_cast<size_t>(p))};
  for (int r = 0; r < p; ++r) {
    const int h = std::min(r, p - 1 - r);
    RankWriter w(t.ranks[static_cast<size_t>(r)]);
    dualpipe_phases(w, h, p / 2, m / 2, h, p - 1 - h, true);
  }
  return t;
}

// The ends' regions are the first and last; the V's rule applies to the regions between, on the
// ranks that hold them (a rank holding only an end, as --v-head alone's last rank, is outside the V).
template <ScheduleTable (*Core)(const ScheduleContext&)>
ScheduleTable with_own_ends(const ScheduleContext& ctx) {
  if (!ctx.own_embedding && !ctx.own_head) return Core(ctx);
  const std::string family = "schedule";
  check_context(family, ctx);
  const int e = ctx.own_embedding ? 1 : 0, h = ctx.own_head ? 1 : 0;
  if (ctx.regions - e - h < 1) fail(family, "the embedding and head regions leave no PP region for the V");
  std::vector<int> core_of_rank(static_cast<size_t>(ctx.ranks), -1), rank_of_core;
  for (int k = e; k < ctx.regions - h; ++k) {
    int& c = core_of_rank[static_cast<size_t>(ctx.rank_of_region[static_cast<size_t>(k)])];
    if (c < 0)
      c = static_cast<int>(rank_of_core.size()), rank_of_core.push_back(ctx.rank_of_region[static_cast<size_t>(k)]);
  }
  ScheduleContext core = ctx;
  core.own_embedding = core.own_head = false;
  core.regions = ctx.regions - e - h;
  core.ranks = static_cast<int>(rank_of_core.size());
  core.rank_of_region.clear();
  for (int k = e; k < ctx.regions - h; ++k)
    core.rank_of_region.push_back(core_of_rank[static_cast<size_t>(ctx.rank_of_region[static_cast<size_t>(k)])]);
  return insert_own_ends(ctx, Core(core), rank_of_core);
}

template <ScheduleTable (*Table)(const ScheduleContext&)>
DirectiveProgram table_directives(const ScheduleContext& ctx) {
  ScheduleTable t = Table(ctx);
  return directives_from_table(t, ctx.rank_of_region, t.microbatches, ctx.mirrored);
}

// Regions beside the V's: the ends of their own, less the V's two on the rank --v-head alone takes.
int own_ends(const StrategyOptions& o) {
  return (o.v_embedding.empty() ? 0 : 1) + (o.v_head.empty() ? 0 : 1) - (o.v_head == "alone" ? 2 : 0);
}

int virtual_must_be(const std::string& family, const StrategyOptions& o, int allowed) {
  if (o.virtual_stages != 1 && o.virtual_stages != allowed)
    fail(family, "--virtual " + std::to_string(o.virtual_stages) + " is not supported (its shape fixes " +
                     std::to_string(allowed) + " region(s) per rank)");
  return allowed;
}

}  // namespace

char to_char(ActionKind k) {
  switch (k) {
    case ActionKind::F:
      return 'F';
    case ActionKind::B:
      return 'B';
    case ActionKind::I:
      return 'I';
    case ActionKind::W:
      return 'W';
  }
  return '?';
}

DirectiveProgram directives_from_table(const ScheduleTable& table, const std::vector<int>& rank_of_region,
                                       int split_count, bool mirrored) {
  ProgramBuilder out = split_program(split_count);
  const int ranks = static_cast<int>(table.ranks.size());
  for (int r = 0; r < ranks; ++r) {
    const auto& steps = table.ranks[static_cast<size_t>(r)];
    if (steps.empty()) continue;
    // Mirrored ranks repeat an earlier rank's steps on the same nodes: one order serves both.
    bool repeat = false;
    for (int q = 0; q < r && !repeat; ++q) repeat = table.ranks[static_cast<size_t>(q)] == steps;
    if (repeat) continue;
    std::vector<std::vector<Filter>> groups;
    for (const auto& st : steps) {
      std::vector<Filter> group;
      for (const auto& a : st) {
        if (a.stage < 0 || a.stage >= static_cast<int>(rank_of_region.size()))
          throw std::invalid_argument("rank " + std::to_string(r) + " names stage " + std::to_string(a.stage) +
                                      ", outside the " + std::to_string(rank_of_region.size()) + " PP regions");
        const int home = rank_of_region[static_cast<size_t>(a.stage)];
        if (home != r && !(mirrored && ranks - 1 - home == r))
          throw std::invalid_argument("rank " + std::to_string(r) + " names stage " + std::to_string(a.stage) +
                                      ", which is placed on rank " + std::to_string(home));
        group.push_back(action_filter(a));
      }
      groups.push_back(std::move(group));
    }
    out.order(groups);
  }
  return out.take();
}

const std::vector<ScheduleFamily>& schedule_registry() {
  static const std::vector<ScheduleFamily> registry = [] {
    std::vector<ScheduleFamily> r;
    r.push_back(
        {"gpipe", "any --pp, --microbatches >= 1; all forwards then all backwards (activations of M microbatches)",
         regions_pp_times_virtual, contiguous_placement, gpipe_directives, [](const ScheduleContext& ctx) {
           return one_region_per_rank_table("gpipe", ctx, [&](int k) { return gpipe_stage(k, ctx.microbatches); });
         }});
    r.push_back(
        {"1f1b", "any --pp, --microbatches >= 1 (>= pp to fill the pipeline); at most p-r microbatches in flight",
         regions_pp_times_virtual, contiguous_placement, one_f_one_b_directives, [](const ScheduleContext& ctx) {
           return one_region_per_rank_table("1f1b", ctx,
                                            [&](int k) { return one_f_one_b_stage(k, ctx.regions, ctx.microbatches); });
         }});
    r.push_back({"interleaved-1f1b",
                 "--virtual V chunks per rank (region k on rank k mod pp; --stages N not a multiple of pp: unequal "
                 "chunks); with V > 1, --microbatches a multiple of --pp",
                 regions_pp_times_virtual, looped_placement, table_directives<interleaved_table>, interleaved_table});
    r.push_back({"interleaved-1f1b-overlap",
                 "interleaved-1f1b (--virtual V >= 2 when --pp > 1) with each steady-state F and B overlapped "
                 "as one F&B step: Megatron-core's --overlap-moe-expert-parallel-comm",
                 regions_pp_times_virtual, looped_placement, table_directives<interleaved_overlap_table>,
                 interleaved_overlap_table, /*mirrored=*/false, /*cost_aware=*/false, /*own_ends=*/false,
                 /*expert_overlap=*/true});
    r.push_back({"looped-bfs", "--virtual V chunks per rank (region k on rank k mod pp); all microbatches per chunk",
                 regions_pp_times_virtual, looped_placement, table_directives<looped_bfs_table>, looped_bfs_table});
    r.push_back({"zb-h1",
                 "B split into BI/BW; any --microbatches (with --virtual V > 1 a multiple of --pp); 1F1B memory",
                 regions_pp_times_virtual, looped_placement, table_directives<zb_h1_table>, zb_h1_table});
    r.push_back({"zb-h2", "B split into BI/BW; one region per rank (no --virtual); about 2x 1F1B activation memory",
                 [](const StrategyOptions& o) { return virtual_must_be("zb-h2", o, 1) * o.pp; }, contiguous_placement,
                 table_directives<zb_h2_table>, zb_h2_table});
    r.push_back({"zb-auto",
                 "Qi et al.'s automatic zero-bubble scheduler under --zb-memory-limit (1p: ZB-1p, 2p: ZB-2p); one "
                 "region per rank; stage costs from the simulator's cost model, else unit costs",
                 [](const StrategyOptions& o) { return virtual_must_be("zb-auto", o, 1) * o.pp; }, contiguous_placement,
                 table_directives<zb_auto_table>, zb_auto_table, /*mirrored=*/false, /*cost_aware=*/true});
    r.push_back({"zb-v", "V placement (2 regions per rank: r and 2pp-1-r); B split into BI/BW; any --microbatches",
                 [](const StrategyOptions& o) { return virtual_must_be("zb-v", o, 2) * o.pp + own_ends(o); },
                 v_placement_with_ends, table_directives<with_own_ends<zb_v_table>>, with_own_ends<zb_v_table>,
                 /*mirrored=*/false, /*cost_aware=*/false, /*own_ends=*/true});
    r.push_back({"dualpipev", "V placement (2 regions per rank); --microbatches >= 2 x --pp; overlapped F&B pairs",
                 [](const StrategyOptions& o) { return virtual_must_be("dualpipev", o, 2) * o.pp + own_ends(o); },
                 v_placement_with_ends, table_directives<with_own_ends<dualpipev_table>>,
                 with_own_ends<dualpipev_table>, /*mirrored=*/false, /*cost_aware=*/false, /*own_ends=*/true});
    r.push_back({"dualpipe",
                 "even --pp; even --microbatches >= 2 x --pp; two mirrored model copies, half the microbatches each",
                 [](const StrategyOptions& o) { return virtual_must_be("dualpipe", o, 1) * o.pp; },
                 contiguous_placement, table_directives<dualpipe_table>, dualpipe_table, true});
    return r;
  }();
  return registry;
}

}  // namespace piper::core
