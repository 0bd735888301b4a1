// The automatic zero-bubble scheduler (ZB-1p / ZB-2p): Qi et al.'s heuristic, as their reference
// implementation runs it (zerobubble/scheduler/zb.py, Graph.manual_order and initial_solution), written
// anew. See schedules_zb.hpp.
#include "piper/core/schedules_zb.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace piper::core {
namespace {

[[noreturn]] void fail(const std::string& why) { throw std::invalid_argument("zb-auto: " + why); }

enum Kind { kF = 0, kB = 1, kW = 2 };

struct InputMissing {};

struct Variant {
  bool allow_bubble_before_first_b, prioritize_b, no_bubble_greedy;
};

// One run of the greedy heuristic: per-stage clocks, counters and memory, and the order it issues.
class Greedy {
 public:
  Greedy(const ZbProblem& p, Variant v)
      : p_(p),
        v_(v),
        s_(static_cast<std::size_t>(p.stages)),
        done_(3, std::vector<std::vector<double>>(s_, std::vector<double>(static_cast<std::size_t>(p.microbatches)))),
        count_(3, std::vector<int>(s_, 0)),
        end_(s_, 0),
        mem_(s_, 0),
        peak_(s_, 0),
        bubble_(s_, 0),
        order_(s_) {}

  // Returns false when the memory limit cannot be met (the reference's "Cannot fit memory").
  bool run();
  ZbSolution solution() const;

 private:
  double cost(Kind k, std::size_t j) const { return (k == kF ? p_.f : k == kB ? p_.b : p_.w)[j]; }
  double mem(Kind k, std::size_t j) const { return (k == kF ? p_.mem_f : k == kB ? p_.mem_b : p_.mem_w)[j]; }
  int& n(Kind k, std::size_t j) { return count_[k][j]; }
  double t(Kind k, std::size_t j, int mb) const { return done_[k][j][static_cast<std::size_t>(mb)]; }
  double max_bubble() const { return *std::max_element(bubble_.begin(), bubble_.end()); }
  void put(std::size_t j, Kind k);
  bool first_round();
  bool later_round(int i);
  bool wants_forward(std::size_t j);
  // Issues W on stage j while the next op of `k` (memory `need`) would not fit; false when none is left.
  bool make_room(std::size_t j, double need) {
    while (mem_[j] + need > p_.max_mem[j]) {
      if (n(kW, j) >= n(kB, j)) return false;
      put(j, kW);
    }
    return true;
  }
  void fill_with_w(std::size_t j, double arrival);

  const ZbProblem& p_;
  Variant v_;
  std::size_t s_;
  std::vector<std::vector<std::vector<double>>> done_;  // [kind][stage][mb]: completion time
  std::vector<std::vector<int>> count_;                 // [kind][stage]: issued so far
  std::vector<double> end_, mem_, peak_, bubble_;
  std::vector<std::vector<ScheduleAction>> order_;
};

// Issues the next op of kind k on stage j: it starts when the stage is free and, for F (B), when the
// previous (next) stage's F (B) of the same microbatch has arrived.
void Greedy::put(std::size_t j, Kind k) {
  const int mb = n(k, j);
  // A variant that would issue an op before its input exists is dropped (never seen; kept as a guard).
  if ((k == kF && j > 0 && n(kF, j - 1) <= mb) || (k == kB && j + 1 < s_ && n(kB, j + 1) <= mb) ||
      (k == kB && n(kF, j) <= mb) || (k == kW && n(kB, j) <= mb) || mb >= p_.microbatches)
    throw InputMissing{};
  const double free_end = end_[j] + cost(k, j);
  double finish = free_end;
  if (k == kF && j > 0) finish = std::max(finish, t(kF, j - 1, mb) + p_.comm + cost(k, j));
  if (k == kB && j + 1 < s_) finish = std::max(finish, t(kB, j + 1, mb) + p_.comm + cost(k, j));
  if (n(kF, j) > 0) bubble_[j] += finish - free_end;
  end_[j] = finish;
  done_[k][j][static_cast<std::size_t>(mb)] = finish;
  mem_[j] += mem(k, j);
  peak_[j] = std::max(peak_[j], mem_[j]);
  order_[j].push_back({static_cast<int>(j), k == kF ? ActionKind::F : k == kB ? ActionKind::I : ActionKind::W, mb});
  ++n(k, j);
}

// Before an F (B) whose input arrives at `arrival`, W that end by then run; one more that would end
// later runs too when the wait it fills is within the largest bubble so far (or never, without
// no_bubble_greedy), else always.
void Greedy::fill_with_w(std::size_t j, double arrival) {
  while (n(kW, j) < n(kB, j) && end_[j] + cost(kW, j) <= arrival) put(j, kW);
  if (n(kW, j) < n(kB, j) && end_[j] < arrival) {
    if (arrival - end_[j] <= max_bubble() - bubble_[j]) {
      if (v_.no_bubble_greedy) put(j, kW);
    } else {
      put(j, kW);
    }
  }
}

// Microbatch 0: one F on every stage, then on each stage the extra forwards that fit (memory) before
// its first B can arrive (walked from the last stage back), never more than its upstream stage, then
// the first B from the last stage back.
bool Greedy::first_round() {
  const int m = p_.microbatches;
  for (std::size_t j = 0; j < s_; ++j) put(j, kF);
  std::vector<int> extra(s_, 0);
  double last_t = 0;
  for (std::size_t jj = s_; jj-- > 0;) {
    if (jj + 1 == s_) {
      last_t = t(kF, jj, 0) + cost(kB, jj);
      continue;
    }
    double held = mem_[jj], clock = end_[jj];
    while (n(kF, jj) + extra[jj] < m && held + mem(kF, jj) <= p_.max_mem[jj]) {
      if (v_.allow_bubble_before_first_b ? clock + cost(kF, jj) > last_t + p_.comm : clock >= last_t + p_.comm) break;
      held += mem(kF, jj);
      clock += cost(kF, jj);
      ++extra[jj];
    }
    last_t = std::max(clock, last_t + p_.comm) + cost(kB, jj);
  }
  for (std::size_t j = 1; j < s_; ++j)
    while (extra[j] > 0 && extra[j] >= extra[j - 1] && n(kF, j) + extra[j] < m) --extra[j];
  for (std::size_t j = 0; j < s_; ++j)
    for (int k = 0; k < extra[j]; ++k) put(j, kF);
  for (std::size_t j = s_; j-- > 0;) put(j, kB);
  return true;
}

// Whether stage j issues its next F in this round (the reference's f_required). With prioritize_b, a
// stage two or more forwards ahead of its successor holds back when its successor's next F and B
// would finish after a bubble it can afford.
bool Greedy::wants_forward(std::size_t j) {
  if (n(kF, j) >= p_.microbatches) return false;
  if (!(v_.prioritize_b && j + 1 < s_ && n(kF, j) >= n(kF, j + 1) + 2)) return true;
  const double next_plus_fw = end_[j + 1] + cost(kF, j + 1) + cost(kB, j + 1) + p_.comm;
  if (end_[j] >= next_plus_fw) return false;
  double w_cost = 0, mem_with_w = mem_[j] + mem(kF, j);
  for (int w = n(kW, j); mem_with_w > p_.max_mem[j] && w < n(kB, j); ++w) {
    w_cost += cost(kW, j);
    mem_with_w += mem(kW, j);
  }
  if (end_[j] + cost(kF, j) + w_cost <= next_plus_fw) return true;
  return next_plus_fw - end_[j] > max_bubble() - bubble_[j];
}

// Microbatch i > 0: forwards where wanted (a stage only when its successor also issues one), then the
// B of microbatch i from the last stage back; W make room for memory and fill waits.
bool Greedy::later_round(int i) {
  std::vector<bool> forward(s_);
  for (std::size_t j = 0; j < s_; ++j) forward[j] = wants_forward(j);
  for (std::size_t j = s_ - 1; j-- > 0;) forward[j] = forward[j] && forward[j + 1];
  for (std::size_t j = 0; j < s_; ++j) {
    if (!forward[j]) continue;
    if (!make_room(j, mem(kF, j))) return false;
    if (j > 0) {
      if (n(kF, j - 1) <= n(kF, j)) throw InputMissing{};
      fill_with_w(j, t(kF, j - 1, n(kF, j)) + p_.comm);
    }
    put(j, kF);
  }
  for (std::size_t j = s_; j-- > 0;) {
    if (n(kB, j) != i || n(kF, j) <= i) throw InputMissing{};
    if (!make_room(j, mem(kB, j))) return false;
    if (j + 1 < s_) fill_with_w(j, t(kB, j + 1, i) + p_.comm);
    if (j == 0 && n(kF, j) == p_.microbatches)
      while (n(kW, j) < n(kB, j)) put(j, kW);
    put(j, kB);
  }
  return true;
}

bool Greedy::run() {
  if (!first_round()) return false;
  for (int i = 1; i < p_.microbatches; ++i)
    if (!later_round(i)) return false;
  for (std::size_t j = 0; j < s_; ++j)
    while (n(kW, j) < p_.microbatches) put(j, kW);
  for (std::size_t j = 0; j < s_; ++j)
    if (peak_[j] > p_.max_mem[j] * (1 + 1e-12)) return false;
  return true;
}

ZbSolution Greedy::solution() const {
  ZbSolution out;
  out.table = {p_.stages, p_.microbatches, std::vector<std::vector<ScheduleStep>>(s_)};
  for (std::size_t j = 0; j < s_; ++j) {
    for (const auto& a : order_[j]) out.table.ranks[j].push_back({a});
    out.span.push_back(end_[j] - (t(kF, j, 0) - cost(kF, j)));
    out.max_span = std::max(out.max_span, out.span.back());
  }
  out.peak_mem = peak_;
  return out;
}

void check_problem(const ZbProblem& p) {
  if (p.stages < 1) fail("needs at least one stage (got " + std::to_string(p.stages) + ")");
  if (p.microbatches < 1) fail("--microbatches must be >= 1 (got " + std::to_string(p.microbatches) + ")");
  const std::size_t s = static_cast<std::size_t>(p.stages);
  for (const auto* v : {&p.f, &p.b, &p.w, &p.mem_f, &p.mem_b, &p.mem_w, &p.max_mem})
    if (v->size() != s)
      fail("a per-stage vector has " + std::to_string(v->size()) + " entries for " + std::to_string(s) + " stages");
  for (std::size_t j = 0; j < s; ++j) {
    for (double c : {p.f[j], p.b[j], p.w[j]})
      if (!(c >= 0) || !std::isfinite(c)) fail("stage " + std::to_string(j) + " has a negative or non-finite cost");
    if (!(p.mem_f[j] > 0) || std::abs(p.mem_f[j] + p.mem_b[j] + p.mem_w[j]) > 1e-9 * p.mem_f[j])
      fail("stage " + std::to_string(j) + ": F must add memory that its B and W release");
    if (p.max_mem[j] < p.mem_f[j])
      fail("stage " + std::to_string(j) + ": the memory limit holds not even one microbatch's activations");
  }
  if (!(p.comm >= 0) || !std::isfinite(p.comm)) fail("the transfer cost is negative or non-finite");
}

// "<N>" with an optional KB/MB/GB/TB or KiB/MiB/GiB/TiB suffix; < 0 when the text is not bytes.
double parse_bytes(const std::string& text) {
  std::size_t used = 0;
  double value = -1;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    return -1;
  }
  std::string unit = text.substr(used);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (!(value > 0) || !std::isfinite(value)) return -1;
  if (unit.empty() || unit == "B") return value;
  // A decimal (KB: 1e3) or binary (KIB: 2^10) prefix K, M, G or T, then B.
  const std::size_t prefix = std::string("KMGT").find(unit[0]);
  const bool binary = unit.size() == 3 && unit[1] == 'I' && unit[2] == 'B';
  if (prefix == std::string::npos || !(binary || (unit.size() == 2 && unit[1] == 'B'))) return -1;
  return value * std::pow(binary ? 1024.0 : 1000.0, static_cast<double>(prefix + 1));
}

}  // namespace

namespace {

// The best of the heuristic's eight variants (shortest longest stage, the first on ties), if any fits.
std::optional<ZbSolution> best_variant(const ZbProblem& problem) {
  std::optional<ZbSolution> best;
  for (bool allow : {true, false})
    for (bool prioritize : {true, false})
      for (bool greedy : {true, false}) {
        Greedy g(problem, {allow, prioritize, greedy});
        try {
          if (!g.run()) continue;
        } catch (const InputMissing&) {
          continue;
        }
        ZbSolution s = g.solution();
        if (best && !(s.max_span < best->max_span)) continue;
        s.variant = std::string(allow ? "bubble-before-first-B" : "no-bubble-before-first-B") +
                    (prioritize ? ", prioritize-B" : "") + (greedy ? ", greedy-W" : "");
        best = std::move(s);
      }
  return best;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

ZbSolution zb_auto_solve(const ZbProblem& problem) {
  check_problem(problem);
  if (auto best = best_variant(problem)) return *best;
  // Unequal stages can break the heuristic's invariants (a stage's forward would run before its
  // input): it was written for equal stages, and the authors' runtime gives it the median stage. Then
  // schedule for the medians and time that order under the real costs.
  ZbProblem equal = problem;
  const auto s = static_cast<std::size_t>(problem.stages);
  equal.f.assign(s, median(problem.f));
  equal.b.assign(s, median(problem.b));
  equal.w.assign(s, median(problem.w));
  if (auto best = best_variant(equal)) {
    ZbSolution out = zb_evaluate(problem, best->table);
    out.variant = best->variant + ", median stage costs";
    return out;
  }
  fail("no schedule of " + std::to_string(problem.microbatches) + " microbatches on " + std::to_string(problem.stages) +
       " stages fits the activation memory limit");
}

ZbSolution zb_evaluate(const ZbProblem& p, const ScheduleTable& table) {
  check_problem(p);
  const auto s = static_cast<std::size_t>(p.stages);
  if (table.ranks.size() != s)
    fail("the order has " + std::to_string(table.ranks.size()) + " ranks, not " + std::to_string(s));
  const auto m = static_cast<std::size_t>(p.microbatches);
  std::vector<std::vector<double>> f_done(s, std::vector<double>(m, -1)), b_done = f_done;
  std::vector<std::size_t> next(s, 0);
  std::vector<double> free_at(s, 0), first(s, -1), mem(s, 0);
  ZbSolution out;
  out.table = table;
  out.peak_mem.assign(s, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t r = 0; r < s; ++r)
      for (; next[r] < table.ranks[r].size(); ++next[r]) {
        const ScheduleStep& step = table.ranks[r][next[r]];
        if (step.size() != 1 || step[0].stage != static_cast<int>(r) || step[0].microbatch < 0 ||
            static_cast<std::size_t>(step[0].microbatch) >= m)
          fail("rank " + std::to_string(r) + " step " + std::to_string(next[r]) + " is not one action of stage " +
               std::to_string(r));
        const ScheduleAction& a = step[0];
        const auto mb = static_cast<std::size_t>(a.microbatch);
        double ready = 0, cost = 0;
        if (a.kind == ActionKind::F) {
          ready = r == 0 ? 0 : f_done[r - 1][mb] < 0 ? -1 : f_done[r - 1][mb] + p.comm;
          cost = p.f[r];
        } else if (a.kind == ActionKind::W) {
          ready = b_done[r][mb];
          cost = p.w[r];
        } else {
          ready = r + 1 == s ? f_done[r][mb] : b_done[r + 1][mb] < 0 ? -1 : b_done[r + 1][mb] + p.comm;
          cost = a.kind == ActionKind::B ? p.b[r] + p.w[r] : p.b[r];
        }
        if (ready < 0) break;  // its input is not computed yet: another rank must go first
        const double start = std::max(free_at[r], ready);
        if (first[r] < 0) first[r] = start;
        free_at[r] = start + cost;
        if (a.kind != ActionKind::W) (a.kind == ActionKind::F ? f_done : b_done)[r][mb] = free_at[r];
        mem[r] += a.kind == ActionKind::F   ? p.mem_f[r]
                  : a.kind == ActionKind::I ? p.mem_b[r]
                  : a.kind == ActionKind::W ? p.mem_w[r]
                                            : p.mem_b[r] + p.mem_w[r];
        out.peak_mem[r] = std::max(out.peak_mem[r], mem[r]);
        progress = true;
      }
  }
  for (std::size_t r = 0; r < s; ++r) {
    if (next[r] < table.ranks[r].size())
      fail("the order deadlocks: rank " + std::to_string(r) + " waits at step " + std::to_string(next[r]));
    out.span.push_back(free_at[r] - std::max(first[r], 0.0));
    out.max_span = std::max(out.max_span, out.span.back());
  }
  return out;
}

double zb_bubble_rate(const ZbProblem& p, const ZbSolution& solution) {
  double busy = 0;
  for (std::size_t j = 0; j < p.f.size(); ++j) busy = std::max(busy, p.microbatches * (p.f[j] + p.b[j] + p.w[j]));
  return solution.max_span > 0 ? (solution.max_span - busy) / solution.max_span : 0;
}

ZbProblem zb_problem(const ScheduleContext& ctx) {
  ZbProblem p;
  p.stages = ctx.regions;
  p.microbatches = ctx.microbatches;
  const std::size_t s = static_cast<std::size_t>(ctx.regions);
  const StageCosts& c = ctx.costs;
  if (c.forward.empty()) {
    p.f = p.b = p.w = std::vector<double>(s, 1.0);
  } else {
    if (c.forward.size() != s || c.input_grad.size() != s || c.weight_grad.size() != s)
      fail("stage costs cover " + std::to_string(c.forward.size()) + " PP regions, the schedule has " +
           std::to_string(s));
    p.f = c.forward, p.b = c.input_grad, p.w = c.weight_grad, p.comm = c.transfer;
  }
  const std::string& limit = ctx.memory_limit;
  int k = 0;
  if (limit.size() >= 2 && limit.back() == 'p' &&
      std::all_of(limit.begin(), limit.end() - 1,
                  [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); }) &&
      limit.size() <= 6)
    k = std::stoi(limit.substr(0, limit.size() - 1));
  if (k >= 1) {
    // Counted in microbatches: F holds one until its W frees it.
    p.mem_f = std::vector<double>(s, 1.0);
    p.max_mem = std::vector<double>(s, static_cast<double>(k) * ctx.ranks);
  } else {
    const double bytes = parse_bytes(limit);
    if (bytes <= 0)
      fail("--zb-memory-limit '" + limit + "' is not <k>p (k >= 1, e.g. 1p, 2p) or a byte size (e.g. 20GiB)");
    if (c.activation_bytes.size() != s)
      fail("--zb-memory-limit " + limit +
           " in bytes needs each region's activation size, which the simulator measures (piper simulate); use 1p "
           "or 2p here");
    p.mem_f = c.activation_bytes;
    p.max_mem = std::vector<double>(s, bytes);
  }
  p.mem_b = std::vector<double>(s, 0.0);
  p.mem_w.resize(s);
  for (std::size_t j = 0; j < s; ++j) p.mem_w[j] = -p.mem_f[j];
  return p;
}

ScheduleTable zb_auto_table(const ScheduleContext& ctx) {
  if (ctx.microbatches < 1) fail("--microbatches must be >= 1 (got " + std::to_string(ctx.microbatches) + ")");
  if (ctx.regions != ctx.ranks)
    fail("needs one PP region per rank (" + std::to_string(ctx.ranks) + " for --pp " + std::to_string(ctx.ranks) +
         "), the model has " + std::to_string(ctx.regions));
  for (int i = 0; i < ctx.regions; ++i)
    if (ctx.rank_of_region[static_cast<std::size_t>(i)] != i)
      fail("needs region PP " + std::to_string(i) + " on rank " + std::to_string(i) + ", it is on rank " +
           std::to_string(ctx.rank_of_region[static_cast<std::size_t>(i)]));
  return zb_auto_solve(zb_problem(ctx)).table;
}

}  // namespace piper::core
