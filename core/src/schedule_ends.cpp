// The embedding and the LM head as PP regions of their own in V placements (--v-embedding,
// --v-head): their steps inserted into a V family's table by a unit-time replay, and
// schedule_makespan, the same replay with per-stage costs.
#include "schedule_ends.hpp"

#include <algorithm>
#include <array>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

namespace piper::core {
namespace {

// A V table with the embedding and/or the head as regions of their own (ctx.own_embedding /
// own_head): the family's rule orders the 2p regions between them, unchanged, and the ends' steps are
// inserted where they become ready in a unit-time execution of those orders (F = I = W = 1, B = 2; an
// overlapped pair takes the sum). The ends go first when ready: the head's F and I are on the loss
// turn, the embedding's F feeds every microbatch. The head's W is deferred to the time its rank
// would wait, or its end. Orders taken from an execution cannot deadlock.
class EndsInserter {
 public:
  // `rank_of_core[c]`: the pipeline rank of the core table's rank c.
  // `cost`: per stage the time of F, I and W (B = I + W); empty: unit time.
  EndsInserter(const ScheduleContext& ctx, const ScheduleTable& core, const std::vector<int>& rank_of_core,
               std::vector<std::array<double, 3>> cost = {})
      : n_(ctx.regions), m_(ctx.microbatches), cost_(std::move(cost)) {
    if (cost_.empty()) cost_.assign(static_cast<size_t>(n_), {1, 1, 1});
    const int p = ctx.ranks, e = ctx.own_embedding ? 1 : 0;
    out_ = ScheduleTable{n_, core.microbatches, std::vector<std::vector<ScheduleStep>>(static_cast<size_t>(p))};
    f_.assign(static_cast<size_t>(n_), std::vector<double>(static_cast<size_t>(m_), -1));
    i_ = f_;
    ranks_.resize(static_cast<size_t>(p));
    for (std::size_t c = 0; c < core.ranks.size(); ++c)
      for (auto st : core.ranks[c]) {
        for (auto& a : st) a.stage += e;
        ranks_[static_cast<size_t>(rank_of_core[c])].core.push_back(std::move(st));
      }
    auto queue = [&](int stage, ActionKind kind) {
      auto& q = ranks_[static_cast<size_t>(ctx.rank_of_region[static_cast<size_t>(stage)])].ends;
      q.push_back({});
      for (int mb = 0; mb < m_; ++mb) q.back().push_back({stage, kind, mb});
    };
    if (ctx.own_embedding) queue(0, ActionKind::F), queue(0, ActionKind::B);
    if (ctx.own_head) queue(n_ - 1, ActionKind::F), queue(n_ - 1, ActionKind::I);
  }

  ScheduleTable run() {
    for (;;) {
      int best = -1, best_queue = -1;
      double best_start = 0;
      for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
        Rank& k = ranks_[static_cast<size_t>(r)];
        // Ends first (-1 < any queue index of the core), then the next core step.
        for (int q = 0; q <= static_cast<int>(k.ends.size()); ++q) {
          const bool core = q == static_cast<int>(k.ends.size());
          if (core ? k.next >= k.core.size() : k.ends[static_cast<size_t>(q)].empty()) continue;
          const double ready = core ? ready_at(k.core[k.next]) : ready_at({k.ends[static_cast<size_t>(q)].front()});
          if (ready < 0) continue;
          const double start = std::max(k.free_at, ready);
          if (best < 0 || start < best_start) best = r, best_queue = core ? -1 : q, best_start = start;
        }
      }
      if (best < 0) break;
      Rank& k = ranks_[static_cast<size_t>(best)];
      while (!k.weights.empty() && k.free_at + 1 <= best_start) emit(best, {k.weights.front()}), k.weights.pop_front();
      if (best_queue < 0) {
        emit(best, k.core[k.next++]);
      } else {
        auto& q = k.ends[static_cast<size_t>(best_queue)];
        const ScheduleAction a = q.front();
        q.pop_front();
        emit(best, {a});
        if (a.kind == ActionKind::I) k.weights.push_back({a.stage, ActionKind::W, a.microbatch});
      }
    }
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      Rank& k = ranks_[static_cast<size_t>(r)];
      if (k.next < k.core.size() || std::any_of(k.ends.begin(), k.ends.end(), [](const auto& q) { return !q.empty(); }))
        throw std::logic_error("V schedule with regions of their own: rank " + std::to_string(r) + " cannot proceed");
      for (const auto& w : k.weights) emit(r, {w});
      makespan_ = std::max(makespan_, k.free_at);
    }
    return out_;
  }
  double makespan() const { return makespan_; }

 private:
  struct Rank {
    std::vector<ScheduleStep> core;
    std::size_t next = 0;
    std::vector<std::deque<ScheduleAction>> ends;
    std::deque<ScheduleAction> weights;
    double free_at = 0;
  };
  double& f(int s, int mb) { return f_[static_cast<size_t>(s)][static_cast<size_t>(mb)]; }
  double& i(int s, int mb) { return i_[static_cast<size_t>(s)][static_cast<size_t>(mb)]; }
  // When every action of the step has its inputs; -1: not yet.
  double ready_at(const ScheduleStep& st) {
    double t = 0;
    for (const auto& a : st) {
      double need = 0;
      if (a.kind == ActionKind::F) {
        need = a.stage == 0 ? 0 : f(a.stage - 1, a.microbatch);
      } else if (a.kind == ActionKind::W) {
        need = i(a.stage, a.microbatch);
      } else {
        need = f(a.stage, a.microbatch);
        if (need >= 0 && a.stage + 1 < n_)
          need = i(a.stage + 1, a.microbatch) < 0 ? -1 : std::max(need, i(a.stage + 1, a.microbatch));
      }
      if (need < 0) return -1;
      t = std::max(t, need);
    }
    return t;
  }
  void emit(int r, const ScheduleStep& st) {
    Rank& k = ranks_[static_cast<size_t>(r)];
    const double start = std::max(k.free_at, ready_at(st));
    double end = start;
    for (const auto& a : st) {
      const auto& c = cost_[static_cast<size_t>(a.stage)];
      end += a.kind == ActionKind::F   ? c[0]
             : a.kind == ActionKind::I ? c[1]
             : a.kind == ActionKind::W ? c[2]
                                       : c[1] + c[2];
    }
    for (const auto& a : st) {
      if (a.kind == ActionKind::F) f(a.stage, a.microbatch) = end;
      if (a.kind == ActionKind::B || a.kind == ActionKind::I) i(a.stage, a.microbatch) = end;
    }
    k.free_at = end;
    out_.ranks[static_cast<size_t>(r)].push_back(st);
  }

  int n_, m_;
  std::vector<std::array<double, 3>> cost_;
  double makespan_ = 0;
  ScheduleTable out_;
  std::vector<std::vector<double>> f_, i_;  // completion of F and of B/I per (stage, microbatch); -1: not yet
  std::vector<Rank> ranks_;
};

}  // namespace

ScheduleTable insert_own_ends(const ScheduleContext& ctx, const ScheduleTable& core,
                              const std::vector<int>& rank_of_core) {
  return EndsInserter(ctx, core, rank_of_core).run();
}

double schedule_makespan(const ScheduleTable& table, const std::vector<std::array<double, 3>>& stage_cost) {
  ScheduleContext ctx;
  ctx.ranks = static_cast<int>(table.ranks.size());
  ctx.regions = table.stages;
  ctx.microbatches = table.microbatches;
  if (static_cast<int>(stage_cost.size()) != table.stages)
    throw std::invalid_argument("schedule_makespan: " + std::to_string(stage_cost.size()) + " stage costs for " +
                                std::to_string(table.stages) + " stages");
  std::vector<int> identity(table.ranks.size());
  for (std::size_t r = 0; r < identity.size(); ++r) identity[r] = static_cast<int>(r);
  EndsInserter replay(ctx, table, identity, stage_cost);
  replay.run();
  return replay.makespan();
}

}  // namespace piper::core
