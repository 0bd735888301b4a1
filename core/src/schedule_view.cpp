// Unit-time list scheduling of a compiled Program (per-pass integer costs, zero-cost rendezvous
// communication), for `piper schedule show` and the published bubble/memory formula tests.
#include "piper/core/schedule_view.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "piper/core/compiler.hpp"
#include "piper/core/error.hpp"
#include "piper/core/readiness.hpp"

namespace piper::core {

namespace {

int op_cost(const Op& op, const UnitCosts& c) {
  if (op.kind != OpKind::Compute) return 0;
  switch (op.pass) {
    case Pass::F:
      return c.forward;
    case Pass::B:
      return c.backward;
    case Pass::BI:
      return c.backward - c.weight;
    case Pass::BW:
      return c.weight;
    case Pass::None:
      return 0;
  }
  return 0;
}

int tag_or(const TagMap& tags, const char* key, int fallback) {
  auto it = tags.find(key);
  return it == tags.end() ? fallback : it->second;
}

ActionKind action_kind(Pass p) {
  return p == Pass::F ? ActionKind::F : p == Pass::B ? ActionKind::B : p == Pass::BI ? ActionKind::I : ActionKind::W;
}

}  // namespace

// One event loop over the devices' streams whose local state (ready times, rendezvous, collectives in
// progress) every step reads; split, it would pass that state around whole.
UnitSchedule unit_time_schedule(const Program& program,  // NOLINT(readability-function-size)
                                const UnitCosts& costs) {
  const int devices = program.num_devices;
  struct DeviceState {
    const Plan* plan = nullptr;
    std::vector<std::size_t> next;                 // per stream: first op not yet done
    std::vector<std::vector<char>> done, waiting;  // per stream, per op: scheduled / at a rendezvous
    std::vector<std::vector<int>> start, end;      // per stream, per op (valid once done)
  };
  std::vector<DeviceState> state(static_cast<std::size_t>(devices));
  std::size_t remaining = 0;
  for (int d = 0; d < devices; ++d) {
    auto& s = state[static_cast<std::size_t>(d)];
    s.plan = &program.plan_for(d);
    const std::size_t n = s.plan->streams.size();
    s.next.assign(n, 0);
    s.done.resize(n), s.waiting.resize(n), s.start.resize(n), s.end.resize(n);
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t ops = s.plan->streams[k].ops.size();
      s.done[k].assign(ops, 0), s.waiting[k].assign(ops, 0);
      s.start[k].assign(ops, 0), s.end[k].assign(ops, 0);
      remaining += ops;
    }
  }
  // A rendezvous: an occurrence of a pairing id, named by (id, first member of its meeting: the
  // sending device of a transfer, the group's first device of a collective), core/readiness.hpp's rule.
  const PairIndex pairs(program);
  struct Rendezvous {
    int needed = 0;
    int ready_time = 0;
    std::vector<std::tuple<int, int, std::size_t>> arrived;  // (device, stream, op)
  };
  std::map<std::pair<std::int32_t, int>, Rendezvous> meeting;
  auto finish = [&](int d, std::size_t k, std::size_t i, int start, int end) {
    auto& s = state[static_cast<std::size_t>(d)];
    s.start[k][i] = start, s.end[k][i] = end, s.done[k][i] = 1, s.waiting[k][i] = 0;
    while (s.next[k] < s.done[k].size() && s.done[k][s.next[k]]) ++s.next[k];
    --remaining;
  };
  // Every stream runs in issue order (the execution semantics of the simulator and runtime);
  // communication costs nothing. Overlapped F&B pairs need no special case: the order pass makes a
  // group's members wait for all of the group's inputs.
  auto try_op = [&](int d, std::size_t k, std::size_t i) -> bool {
    auto& s = state[static_cast<std::size_t>(d)];
    const Op& op = s.plan->streams[k].ops[i];
    int ready = i > 0 ? s.end[k][i - 1] : 0;
    for (const auto& w : op.waits) {
      const auto ws = static_cast<std::size_t>(w.stream), wi = static_cast<std::size_t>(w.index);
      if (!s.done[ws][wi]) return false;
      ready = std::max(ready, s.end[ws][wi]);
    }
    const bool transfer = op.kind == OpKind::Send || op.kind == OpKind::Recv;
    if (!transfer && (op.kind == OpKind::Compute || op.kind == OpKind::Update)) {
      finish(d, k, i, ready, ready + op_cost(op, costs));
      return true;
    }
    // A pairing id spans every pair of a transfer's device sets and every group of a family: the
    // meeting's first member names the occurrence. All of a transfer's or group's members must arrive
    // (a side missing from the plans never completes).
    const std::vector<Member> members = pairs.meeting(d, OpRef{static_cast<int>(k), static_cast<int>(i)});
    const int group_key = members.front().first;
    const int needed = transfer ? 2 : static_cast<int>(program.group_of(op.family, d).size());
    auto& m = meeting[{op.pair, group_key}];
    m.needed = needed;
    m.ready_time = std::max(m.ready_time, ready);
    m.arrived.emplace_back(d, static_cast<int>(k), i);
    s.waiting[k][i] = 1;
    if (static_cast<int>(m.arrived.size()) == m.needed) {
      const Rendezvous met = m;
      meeting.erase({op.pair, group_key});
      for (auto [pd, pk, pi] : met.arrived)
        finish(pd, static_cast<std::size_t>(pk), pi, met.ready_time, met.ready_time);
    }
    return true;
  };
  while (remaining > 0) {
    bool progress = false;
    for (int d = 0; d < devices; ++d) {
      auto& s = state[static_cast<std::size_t>(d)];
      for (std::size_t k = 0; k < s.next.size(); ++k) {
        const std::size_t n = s.done[k].size();
        for (std::size_t i = s.next[k]; i < n; ++i) {
          if (s.done[k][i]) continue;
          if (s.waiting[k][i] || !try_op(d, k, i)) break;
          progress = true;
          if (!s.done[k][i]) break;
        }
      }
    }
    if (!progress) throw Error("schedule view: the program makes no progress (a wait cycle)");
  }

  UnitSchedule out;
  out.ranks.resize(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) {
    const auto& s = state[static_cast<std::size_t>(d)];
    auto& rank = out.ranks[static_cast<std::size_t>(d)];
    for (std::size_t k = 0; k < s.next.size(); ++k) {
      const auto& ops = s.plan->streams[k].ops;
      for (std::size_t i = 0; i < ops.size(); ++i) {
        const Op& op = ops[i];
        if (op.kind != OpKind::Compute) continue;
        // The second copy of a mirrored pair (position past the first half of its device set).
        const auto& set = program.device_sets.at(static_cast<std::size_t>(op.device_set));
        const int position = program.position_in(op.device_set, d);
        const int copy = set.size() > 1 && position >= static_cast<int>(set.size()) / 2 ? 1 : 0;
        TimedOp t;
        t.stage = tag_or(op.tags, "PP", 0);
        t.microbatch = std::max(op.microbatch, 0) + copy * program.microbatches;
        t.pass = op.pass;
        t.start = s.start[k][i];
        t.end = s.end[k][i];
        rank.busy += t.end - t.start;
        out.step_time = std::max(out.step_time, t.end);
        rank.ops.push_back(t);
      }
    }
    std::sort(rank.ops.begin(), rank.ops.end(), [](const TimedOp& a, const TimedOp& b) { return a.start < b.start; });
    // Activation buffers: +1 when their F starts, -1 when their last user ends (frees first on ties).
    std::vector<std::pair<int, int>> events;
    for (const auto& b : s.plan->buffers) {
      if (b.kind != BufferKind::Activations || b.persistent()) continue;
      events.emplace_back(s.start[static_cast<std::size_t>(b.alloc.stream)][static_cast<std::size_t>(b.alloc.index)],
                          +1);
      events.emplace_back(s.end[static_cast<std::size_t>(b.free.stream)][static_cast<std::size_t>(b.free.index)], -1);
    }
    std::sort(events.begin(), events.end());
    int alive = 0;
    for (auto [t, delta] : events) rank.peak_activations = std::max(rank.peak_activations, alive += delta);
  }
  for (auto& rank : out.ranks) rank.bubble = out.step_time - rank.busy;
  return out;
}

namespace {

// unit_time_schedule of a family; `before_program` sees the options once they passed
// validate_strategy_options, before the directive program and the compile (both grow with the ops:
// the program of 400 ranks x 1600 microbatches alone took 9 s and 2.9 GB).
UnitSchedule unit_time_schedule_of(const StrategyOptions& options, const UnitCosts& costs,
                                   const std::function<void(const StrategyOptions&)>& before_program) {
  if (costs.forward < 1 || costs.backward < 1 || costs.weight < 1 || costs.weight >= costs.backward)
    throw Error("--costs F,B,W: need integers F >= 1, B >= 2 and 1 <= W < B (BI = B - W must be positive)");
  // Unit costs are small: times are ints, and 2 x 10^9 units overflowed them.
  constexpr int kMaxUnitCost = 100;
  if (costs.forward > kMaxUnitCost || costs.backward > kMaxUnitCost)
    throw Error(fmt::format("--costs F,B,W: unit costs are at most {} (got F={} B={} W={})", kMaxUnitCost,
                            costs.forward, costs.backward, costs.weight));
  StrategyOptions o = options;
  o.dp = 1, o.ep = 1, o.zero = 0, o.bucket_mb = 0;
  const ScheduleFamily& family = schedule_family(o.schedule);
  // The directive program first: its errors name the flags (--pp x --virtual past the PP-region
  // limit), where the model's named a zoo model the user never gave.
  if (before_program) {
    validate_strategy_options(o);  // its errors name the flags (--pp x --virtual past the PP-region limit)
    before_program(o);
  }
  const DirectiveProgram program = validated(generate_program(o));
  const int regions = family.regions(o);
  // A small dense model (no expert segments) with one block per region: one compute op per
  // (region, microbatch, pass), so a unit cost per op is a unit cost per pipeline step.
  ModelConfig cfg = *zoo_config("llama3-8b");
  cfg.layers = regions;
  cfg.training.seq_len = 128;
  Model model = build_model(cfg);
  std::vector<int> starts;
  for (int i = 0; i < regions; ++i) starts.push_back(i);
  annotate_pipeline_ranges(model, starts);
  return unit_time_schedule(compile(model, program).program, costs);
}

}  // namespace

UnitSchedule unit_time_schedule(const StrategyOptions& options, const UnitCosts& costs) {
  return unit_time_schedule_of(options, costs, nullptr);
}

std::string render_unit_schedule(const UnitSchedule& s, const ScheduleTable* table) {
  auto kind_char = [](Pass p) {
    switch (p) {
      case Pass::F:
        return 'F';
      case Pass::B:
        return 'B';
      case Pass::BI:
        return 'I';
      case Pass::BW:
        return 'W';
      case Pass::None:
        break;
    }
    return '?';
  };
  // Overlapped actions per rank, in DAG terms (the table's microbatches), to mark them with '*'.
  std::vector<std::set<std::tuple<int, int, int>>> overlapped(s.ranks.size());
  const int copy_microbatches = table ? table->microbatches : 0;
  if (table)
    for (std::size_t r = 0; r < table->ranks.size() && r < overlapped.size(); ++r)
      for (const auto& step : table->ranks[r])
        if (step.size() > 1)
          for (const auto& a : step) overlapped[r].insert({a.stage, static_cast<int>(a.kind), a.microbatch});
  std::vector<std::vector<std::string>> labels(s.ranks.size());
  std::size_t width = 1;
  for (std::size_t r = 0; r < s.ranks.size(); ++r)
    for (const auto& op : s.ranks[r].ops) {
      std::string label = fmt::format("{}{}{}", op.stage, kind_char(op.pass), op.microbatch);
      const int dag_mb = copy_microbatches > 0 ? op.microbatch % copy_microbatches : op.microbatch;
      if (overlapped[r].contains({op.stage, static_cast<int>(action_kind(op.pass)), dag_mb})) label += '*';
      width = std::max(width, label.size());
      labels[r].push_back(std::move(label));
    }
  const std::size_t cell = width + 1;
  // One line per rank of cell x step_time characters: refused before it is built (10^9 time units of
  // --costs took minutes and gigabytes).
  constexpr double kMaxGridChars = 1 << 28;
  const double grid = static_cast<double>(s.ranks.size()) * static_cast<double>(cell) * s.step_time;
  if (grid > kMaxGridChars)
    throw Error(
        fmt::format("schedule grid of {} ranks x {} time units would take {:.0f} characters (at most {:.0f}): "
                    "give fewer ranks or microbatches, or smaller --costs",
                    s.ranks.size(), s.step_time, grid, kMaxGridChars));
  std::string out;
  // Time ruler: a mark every 5 units.
  out += fmt::format("{:<8}", "time");
  for (int t = 0; t < s.step_time; t += 5)
    out += fmt::format("{:<{}}", t, cell * static_cast<std::size_t>(std::min(5, s.step_time - t)));
  out += "\n";
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    std::string row(cell * static_cast<std::size_t>(s.step_time), ' ');
    for (int t = 0; t < s.step_time; ++t) row[cell * static_cast<std::size_t>(t)] = '.';
    const auto& ops = s.ranks[r].ops;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].end == ops[i].start) continue;
      const std::size_t at = cell * static_cast<std::size_t>(ops[i].start);
      const std::size_t span = cell * static_cast<std::size_t>(ops[i].end - ops[i].start) - 1;
      std::string text = labels[r][i];
      text.resize(span, '-');
      row.replace(at, span + 1, text + ' ');
    }
    while (!row.empty() && row.back() == ' ') row.pop_back();
    out += fmt::format("rank {:<3}{}\n", r, row);
  }
  out += fmt::format("\nstep time {} units; bubble = step time - busy time of the rank\n", s.step_time);
  for (std::size_t r = 0; r < s.ranks.size(); ++r)
    out += fmt::format("rank {:<3} busy {:>5}  bubble {:>5}  peak activations {:>3}\n", r, s.ranks[r].busy,
                       s.ranks[r].bubble, s.ranks[r].peak_activations);
  if (table) out += "* = one of the two ops of an overlapped F&B step\n";
  return out;
}

}  // namespace piper::core

namespace piper::core {

double schedule_grid_chars_at_least(const StrategyOptions& o, const UnitCosts& costs) {
  const ScheduleFamily& family = schedule_family(o.schedule);
  const int regions = family.regions(o);
  // A mirrored family runs microbatches / 2 on each of its two copies.
  const int microbatches = family.mirrored ? 2 * (o.microbatches / 2) : o.microbatches;
  auto digits = [](int n) {
    int d = 1;
    for (; n >= 10; n /= 10) ++d;
    return d;
  };
  const int cell = digits(std::max(regions - 1, 0)) + 1 + digits(std::max(microbatches - 1, 0)) + 1;
  return static_cast<double>(cell) * regions * microbatches * (static_cast<double>(costs.forward) + costs.backward);
}

std::string schedule_show_text(const StrategyOptions& o, const UnitCosts& costs) {
  // The program and its compile cost time and memory with the ops (400 ranks x 1600 microbatches:
  // minutes and 4.6 GB; a grid of 2 * 10^6 characters about 10 s and 1.2 GB), so a grid too big to
  // read is refused from the flags, before them.
  constexpr double kMaxShownGridChars = 2e6;
  const UnitSchedule s = unit_time_schedule_of(o, costs, [&](const StrategyOptions& valid) {
    const double least = schedule_grid_chars_at_least(valid, costs);
    if (least > kMaxShownGridChars)
      throw Error(fmt::format(
          "schedule show: a grid of --ranks {} x --microbatches {}{} with --costs {},{},{} takes at least {:.0f} "
          "characters (at most {:.0f}): give fewer ranks or microbatches, or smaller --costs (schedule export-csv "
          "writes a schedule of any size)",
          valid.pp, valid.microbatches,
          valid.virtual_stages > 1 ? fmt::format(" x --virtual {}", valid.virtual_stages) : "", costs.forward,
          costs.backward, costs.weight, least, kMaxShownGridChars));
  });
  std::optional<ScheduleTable> table;
  try {
    table = schedule_table(o);
  } catch (const std::invalid_argument&) {  // ordered per region: no per-rank marks
  }
  std::string text =
      fmt::format("{} on {} ranks, {} microbatches{}; costs F={} B={} W={} (comm 0)\n", o.schedule, o.pp,
                  o.microbatches, o.virtual_stages > 1 ? fmt::format(", {} virtual stages", o.virtual_stages) : "",
                  costs.forward, costs.backward, costs.weight);
  return text + render_unit_schedule(s, table ? &*table : nullptr);
}

nlohmann::json to_json(const UnitSchedule& s) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankTimeline& r : s.ranks) {
    nlohmann::json ops = nlohmann::json::array();
    for (const TimedOp& op : r.ops)
      ops.push_back({{"stage", op.stage},
                     {"microbatch", op.microbatch},
                     {"pass", to_string(op.pass)},
                     {"start", op.start},
                     {"end", op.end}});
    ranks.push_back({{"busy", r.busy}, {"bubble", r.bubble}, {"peak_activations", r.peak_activations}, {"ops", ops}});
  }
  return {{"step_time", s.step_time}, {"ranks", ranks}};
}

}  // namespace piper::core
