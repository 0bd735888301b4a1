// PyTorch torch.distributed.pipelining compute-only CSV <-> ScheduleTable <-> directive program.
#include "piper/core/pytorch_csv.hpp"

#include <algorithm>
#include <cstdint>
#include <map>
#include <regex>
#include <set>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "piper/core/limits.hpp"

namespace piper::core {

using nlohmann::json;

namespace {

std::string action_text(const ScheduleAction& a) {
  return fmt::format("{}{}{}", a.stage, to_char(a.kind), a.microbatch);
}

ActionKind kind_from_char(char c) {
  switch (c) {
    case 'F':
      return ActionKind::F;
    case 'B':
      return ActionKind::B;
    case 'I':
      return ActionKind::I;
    default:
      return ActionKind::W;
  }
}

// Pass 4: the order can run. Each step (cell) waits for the step before it in its row and for the
// steps holding its actions' inputs: F(s, m) for F(s + 1, m); F(s, m) and the backward (B or I) of
// (s + 1, m) for a backward of (s, m); I(s, m) for W(s, m). Kahn's algorithm over the steps; any step
// left over waits, through a cycle, on itself. A backward before its forward or ranks waiting on each
// other were imported with exit 0, and `piper compile` then found a cycle in the generated program.
template <typename Cells, typename Shown, typename At>
void check_runnable(const Cells& cells, int stages, const Shown& shown, const At& at) {
  using Key = std::tuple<int, ActionKind, int>;
  std::map<Key, std::size_t> cell_of;
  for (std::size_t i = 0; i < cells.size(); ++i)
    for (const auto& act : cells[i].step) cell_of[{act.stage, act.kind, act.microbatch}] = i;
  // Per step, the steps it needs, with the action each one holds; those of its own row first.
  std::vector<std::vector<std::pair<std::size_t, ScheduleAction>>> inputs(cells.size());
  std::vector<std::vector<std::size_t>> users(cells.size());
  std::vector<std::size_t> waiting(cells.size(), 0);
  auto need = [&](std::size_t i, const ScheduleAction& input) {
    const auto it = cell_of.find({input.stage, input.kind, input.microbatch});
    if (it == cell_of.end() || it->second == i) return;  // the completeness and overlap checks' cases
    inputs[i].emplace_back(it->second, input);
    users[it->second].push_back(i);
    ++waiting[i];
  };
  for (std::size_t i = 0; i < cells.size(); ++i) {
    if (i > 0 && cells[i - 1].row == cells[i].row) {
      users[i - 1].push_back(i);
      ++waiting[i];
    }
    for (const auto& act : cells[i].step) {
      const int s = act.stage, m = act.microbatch;
      if (act.kind == ActionKind::F && s > 0) need(i, {s - 1, ActionKind::F, m});
      if (act.kind == ActionKind::B || act.kind == ActionKind::I) {
        need(i, {s, ActionKind::F, m});
        if (s + 1 < stages) {
          const bool full = cell_of.contains({s + 1, ActionKind::B, m});
          need(i, {s + 1, full ? ActionKind::B : ActionKind::I, m});
        }
      }
      if (act.kind == ActionKind::W) need(i, {s, ActionKind::I, m});
    }
    std::stable_partition(inputs[i].begin(), inputs[i].end(),
                          [&](const auto& in) { return cells[in.first].row == cells[i].row; });
  }
  std::vector<char> done(cells.size(), 0);
  std::vector<std::size_t> ready;
  for (std::size_t i = 0; i < cells.size(); ++i)
    if (waiting[i] == 0) ready.push_back(i);
  std::size_t ran = 0;
  while (!ready.empty()) {
    const std::size_t i = ready.back();
    ready.pop_back();
    done[i] = 1, ++ran;
    for (std::size_t u : users[i])
      if (--waiting[u] == 0) ready.push_back(u);
  }
  if (ran == cells.size()) return;
  // The first step left over whose row ran up to it waits for an input that never runs.
  for (std::size_t i = 0; i < cells.size(); ++i) {
    if (done[i] || (i > 0 && cells[i - 1].row == cells[i].row && !done[i - 1])) continue;
    for (const auto& entry : inputs[i]) {
      const std::size_t j = entry.first;
      const ScheduleAction& input = entry.second;
      if (done[j]) continue;
      const auto& user = *std::find_if(cells[i].step.begin(), cells[i].step.end(),
                                       [&](const ScheduleAction& a) { return a.microbatch == input.microbatch; });
      if (cells[j].row == cells[i].row)
        throw at(cells[i].row, cells[i].col,
                 input.stage == user.stage ? fmt::format("{} comes before its forward {} (column {})", shown(user),
                                                         shown(input), cells[j].col + 1)
                                           : fmt::format("{} comes before {} (column {}), whose output it needs",
                                                         shown(user), shown(input), cells[j].col + 1));
      throw at(cells[i].row, cells[i].col,
               fmt::format("{} waits for {} (row {}, column {}), which can never run: the rows' orders wait on each "
                           "other",
                           shown(user), shown(input), cells[j].row + 1, cells[j].col + 1));
    }
  }
}

}  // namespace

std::string describe(CsvSpelling s) {
  switch (s) {
    case CsvSpelling::Modern:
      return "PyTorch >= 2.5 spelling (I = input gradient, W = weight gradient, B = full backward)";
    case CsvSpelling::Legacy:
      return "PyTorch < 2.5 spelling (B with a W for the same stage and microbatch = input gradient, W = weight "
             "gradient)";
    case CsvSpelling::Either:
      break;
  }
  return "no split backward (B = full backward in every PyTorch spelling)";
}

std::string schedule_to_pytorch_csv(const ScheduleTable& table) {
  std::string out;
  for (const auto& row : table.ranks) {
    for (std::size_t i = 0; i < row.size(); ++i) {
      if (i) out += ',';
      const auto& step = row[i];
      if (step.size() == 1) {
        out += action_text(step.front());
      } else if (!step.empty()) {
        out += '(';
        for (std::size_t k = 0; k < step.size(); ++k) {
          if (k) out += ';';
          out += action_text(step[k]);
        }
        out += ")OVERLAP_F_B";
      }
    }
    out += '\n';
  }
  return out;
}

// Three passes over one table (actions as written, the spelling, placement and order) that share the
// cell locator of their errors: kept together so that every message names its row and column alike.
ScheduleTable schedule_from_pytorch_csv(const std::string& text,  // NOLINT(readability-function-size)
                                        const std::string& where, CsvSpelling* spelling) {
  static const std::regex single(R"((\d+)([FBIW])(\d+))");
  static const std::regex overlap(R"(\((.*)\)OVERLAP_F_B)");
  auto at = [&](std::size_t row, std::size_t col, const std::string& why) {
    return std::invalid_argument(fmt::format("{}: row {} (rank {}), column {}: {}", where, row + 1, row, col + 1, why));
  };
  // Rows and cells (compute-only CSVs never quote; surrounding quotes and CR are tolerated).
  std::vector<std::vector<std::string>> rows;
  // A UTF-8 byte-order mark (a spreadsheet's export) is not part of the first cell.
  std::size_t pos = text.rfind("\xEF\xBB\xBF", 0) == 0 ? 3 : 0;
  while (pos < text.size()) {
    std::size_t eol = text.find('\n', pos);
    std::string line = text.substr(pos, eol == std::string::npos ? std::string::npos : eol - pos);
    pos = eol == std::string::npos ? text.size() : eol + 1;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<std::string> cells;
    std::size_t c = 0;
    while (true) {
      std::size_t comma = line.find(',', c);
      std::string cell = line.substr(c, comma == std::string::npos ? std::string::npos : comma - c);
      if (cell.size() >= 2 && cell.front() == '"' && cell.back() == '"') cell = cell.substr(1, cell.size() - 2);
      cells.push_back(cell);
      if (comma == std::string::npos) break;
      c = comma + 1;
    }
    rows.push_back(std::move(cells));
  }
  while (!rows.empty() && rows.back().size() == 1 && rows.back().front().empty()) rows.pop_back();
  if (rows.empty()) throw std::invalid_argument(where + ": no rows (expected one row of actions per rank)");
  if (rows.size() > static_cast<std::size_t>(limit_value(Limit::Devices)))
    throw std::invalid_argument(where + ": " +
                                limit_message(Limit::Devices, static_cast<std::int64_t>(rows.size()), "ranks (rows)"));

  // Pass 1: every cell's actions, as written.
  struct Cell {
    std::size_t row, col;
    std::string text;
    ScheduleStep step;
  };
  std::vector<Cell> cells;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    // A rank with nothing to run: a blank line in the middle became an idle device of the program.
    if (std::all_of(rows[r].begin(), rows[r].end(), [](const std::string& c) { return c.empty(); }))
      throw std::invalid_argument(fmt::format(
          "{}: row {} (rank {}): no actions (a blank row?): every rank runs at least one stage", where, r + 1, r));
    for (std::size_t c = 0; c < rows[r].size(); ++c) {
      const std::string& cell = rows[r][c];
      if (cell.empty()) continue;  // an idle slot
      ScheduleStep step;
      std::vector<std::string> parts;
      std::smatch m;
      if (std::regex_match(cell, m, overlap)) {
        const std::string inner = m[1];
        const auto semi = inner.find(';');
        if (semi == std::string::npos || inner.find(';', semi + 1) != std::string::npos)
          throw at(r, c, "'" + printable(cell, 40) + "': an OVERLAP_F_B step holds exactly two actions (F;B)");
        parts = {inner.substr(0, semi), inner.substr(semi + 1)};
      } else {
        parts = {cell};
      }
      for (const auto& part : parts) {
        std::smatch a;
        if (!std::regex_match(part, a, single))
          throw at(
              r, c,
              "'" + printable(cell, 40) + "' is not a compute action like 2F0, 3B1, 3I1, 7W4 or (0F7;7B3)OVERLAP_F_B");
        // Stage and microbatch numbers size tables: bound them (limits.hpp) before converting.
        auto bounded = [&](const std::string& digits, Limit l, const char* unit) {
          const std::int64_t v = digits.size() > 15 ? INT64_MAX : std::stoll(digits);
          if (v == INT64_MAX || v + 1 > limit_value(l))
            throw at(r, c, "'" + printable(cell, 40) + "': " + limit_message(l, v == INT64_MAX ? v : v + 1, unit));
          return static_cast<int>(v);
        };
        ScheduleAction act{bounded(a[1], Limit::Layers, "stages"), kind_from_char(a[2].str()[0]),
                           bounded(a[3], Limit::Microbatches, "microbatches")};
        step.push_back(act);
      }
      cells.push_back({r, c, cell, std::move(step)});
    }
  }

  // Pass 2: which spelling. PyTorch >= 2.5 writes I (input gradient), W (weight gradient) and B (full
  // backward); older releases had no I and wrote the input gradient as B whenever the same stage and
  // microbatch also has a W. An I anywhere means the new spelling, so a B that also has a W is then a
  // mix of both; a W without any I can only be the old spelling (in the new one a W needs its I).
  std::set<std::pair<int, int>> has_weight;
  const Cell* first_input = nullptr;
  for (const auto& cell : cells)
    for (const auto& act : cell.step) {
      if (act.kind == ActionKind::W) has_weight.insert({act.stage, act.microbatch});
      if (act.kind == ActionKind::I && !first_input) first_input = &cell;
    }
  const CsvSpelling found = first_input          ? CsvSpelling::Modern
                            : has_weight.empty() ? CsvSpelling::Either
                                                 : CsvSpelling::Legacy;
  for (auto& cell : cells)
    for (auto& act : cell.step) {
      if (act.kind != ActionKind::B || !has_weight.contains({act.stage, act.microbatch})) continue;
      if (found == CsvSpelling::Modern)
        throw at(
            cell.row, cell.col,
            fmt::format(
                "mixed spellings: {}B{} has a weight gradient {}W{}, so it is an input gradient in the PyTorch < 2.5 "
                "spelling, but row {} column {} writes input gradients as I (PyTorch >= 2.5); use one spelling",
                act.stage, act.microbatch, act.stage, act.microbatch, first_input->row + 1, first_input->col + 1));
      act.kind = ActionKind::I;
    }
  if (spelling) *spelling = found;
  // Messages show actions as the file wrote them.
  auto shown = [&](const ScheduleAction& a) {
    return found == CsvSpelling::Legacy && a.kind == ActionKind::I ? fmt::format("{}B{}", a.stage, a.microbatch)
                                                                   : action_text(a);
  };
  const char input_letter = found == CsvSpelling::Legacy ? 'B' : 'I';

  // Pass 3: placement, duplicates and order, in the new spelling.
  ScheduleTable t;
  t.ranks.resize(rows.size());
  std::map<int, std::pair<std::size_t, std::size_t>> stage_home;  // stage -> (row, col) of first use
  struct Seen {
    std::size_t row, col;
  };
  std::map<std::tuple<int, ActionKind, int>, Seen> seen;
  int max_stage = -1, max_mb = -1;
  for (auto& cellv : cells) {
    const std::size_t r = cellv.row, c = cellv.col;
    const std::string& cell = cellv.text;
    ScheduleStep& step = cellv.step;
    {
      if (step.size() == 2 && !(step[0].kind == ActionKind::F && step[1].kind != ActionKind::F))
        throw at(r, c, "'" + printable(cell, 40) + "': an overlapped step is a forward then a backward");
      // A microbatch's backward on any stage follows all of its forwards (through the last stage's), so
      // the two halves of a step would wait on each other.
      if (step.size() == 2 && step[0].microbatch == step[1].microbatch)
        throw at(
            r, c,
            fmt::format("'{}': the backward {} needs the forward {} of the same microbatch, so they cannot overlap",
                        printable(cell, 40), shown(step[1]), shown(step[0])));
      for (const auto& act : step) {
        auto [home, fresh] = stage_home.try_emplace(act.stage, std::make_pair(r, c));
        if (!fresh && home->second.first != r)
          throw at(r, c,
                   fmt::format("stage {} is already on rank {} (row {}, column {}); a stage lives on one rank",
                               act.stage, home->second.first, home->second.first + 1, home->second.second + 1));
        auto [it, first] = seen.try_emplace({act.stage, act.kind, act.microbatch}, Seen{r, c});
        if (!first)
          throw at(
              r, c,
              fmt::format("{} is already at row {}, column {}", shown(act), it->second.row + 1, it->second.col + 1));
        if (act.kind == ActionKind::W && !seen.contains({act.stage, ActionKind::I, act.microbatch}))
          throw at(r, c,
                   fmt::format("{} comes before its input gradient {}{}{}", shown(act), act.stage, input_letter,
                               act.microbatch));
        if ((act.kind == ActionKind::I || act.kind == ActionKind::W) &&
            seen.contains({act.stage, ActionKind::B, act.microbatch}))
          throw at(r, c,
                   fmt::format("{}: stage {} microbatch {} already has a full backward B", shown(act), act.stage,
                               act.microbatch));
        if (act.kind == ActionKind::B && seen.contains({act.stage, ActionKind::I, act.microbatch}))
          throw at(r, c,
                   fmt::format("{}: stage {} microbatch {} already has a split backward {}", shown(act), act.stage,
                               act.microbatch, input_letter));
        max_stage = std::max(max_stage, act.stage);
        max_mb = std::max(max_mb, act.microbatch);
      }
      t.ranks[r].push_back(step);  // a copy: pass 4 reads the cells
    }
  }
  t.stages = max_stage + 1;
  t.microbatches = max_mb + 1;
  // Completeness: every stage on some rank, every (stage, microbatch) with one F and one backward.
  for (int s = 0; s < t.stages; ++s) {
    auto home = stage_home.find(s);
    if (home == stage_home.end())
      throw std::invalid_argument(
          fmt::format("{}: stage {} appears on no row (stages must be 0..{})", where, s, t.stages - 1));
    const std::size_t r = home->second.first, end_col = rows[r].size();
    for (int mb = 0; mb < t.microbatches; ++mb) {
      if (!seen.contains({s, ActionKind::F, mb}))
        throw at(r, end_col, fmt::format("missing microbatch: stage {} has no forward {}F{}", s, s, mb));
      const bool full = seen.contains({s, ActionKind::B, mb}), input = seen.contains({s, ActionKind::I, mb});
      if (!full && !input)
        throw at(r, end_col,
                 fmt::format("missing microbatch: stage {} has no backward {}B{} (or {}I{})", s, s, mb, s, mb));
      if (input && !seen.contains({s, ActionKind::W, mb}))
        throw at(r, end_col,
                 fmt::format("missing microbatch: stage {} has {}{}{} but no {}W{}", s, s, input_letter, mb, s, mb));
    }
  }
  check_runnable(cells, t.stages, shown, at);
  return t;
}

std::vector<int> stage_ranks(const ScheduleTable& table) {
  std::vector<int> rank_of(static_cast<std::size_t>(table.stages), -1);
  for (std::size_t r = 0; r < table.ranks.size(); ++r)
    for (const auto& step : table.ranks[r])
      for (const auto& a : step) {
        int& home = rank_of.at(static_cast<std::size_t>(a.stage));
        if (home >= 0 && home != static_cast<int>(r))
          throw std::invalid_argument(fmt::format("stage {} is on ranks {} and {}", a.stage, home, r));
        home = static_cast<int>(r);
      }
  for (std::size_t s = 0; s < rank_of.size(); ++s)
    if (rank_of[s] < 0) throw std::invalid_argument(fmt::format("stage {} is on no rank", s));
  return rank_of;
}

DirectiveProgram program_from_schedule_table(const ScheduleTable& table, StrategyOptions o) {
  const std::vector<int> rank_of = stage_ranks(table);
  o.pp = static_cast<int>(table.ranks.size());
  DirectiveProgram program = placement_directives(o, rank_of);
  return program.append(directives_from_table(table, rank_of, table.microbatches));
}

ScheduleTable schedule_table_from_program(const DirectiveProgram& program) {
  // The placement part numbers the ranks; the split gives the microbatch count.
  DirectiveProgram placement;
  int microbatches = 0;
  std::vector<const OrderDirective*> orders;
  for (std::size_t i = 0; i < program.size(); ++i) {
    const Directive& d = program.directives[i];
    if (const auto* order = std::get_if<OrderDirective>(&d))
      orders.push_back(order);
    else if (const auto* split = std::get_if<SplitDirective>(&d))
      microbatches = split->count;
    else
      placement.directives.push_back(d), placement.source.push_back(program.source[i]);
  }
  int ranks = 0;
  const std::vector<int> rank_of = rank_of_region_from_program(placement, &ranks);
  ScheduleTable t;
  t.stages = static_cast<int>(rank_of.size());
  t.microbatches = microbatches;
  t.ranks.resize(static_cast<std::size_t>(ranks));
  std::set<int> ordered;
  for (std::size_t k = 0; k < orders.size(); ++k) {
    std::vector<ScheduleStep> steps;
    int rank = -1;
    for (const auto& group : orders[k]->groups) {
      ScheduleStep step;
      for (const auto& f : group) {
        if (!f.exact.contains("PP") || !f.exact.contains("MB") || !f.pass)
          throw std::invalid_argument(
              fmt::format("order {}: every filter needs PP, MB and PASS to be a PyTorch action", k));
        const ActionKind kind = *f.pass == Pass::F    ? ActionKind::F
                                : *f.pass == Pass::B  ? ActionKind::B
                                : *f.pass == Pass::BI ? ActionKind::I
                                                      : ActionKind::W;
        const int stage = f.exact.at("PP");
        if (stage < 0 || stage >= t.stages)
          throw std::invalid_argument(fmt::format("order {}: PP {} is not placed", k, stage));
        rank = rank_of[static_cast<std::size_t>(stage)];
        step.push_back({stage, kind, f.exact.at("MB")});
      }
      steps.push_back(std::move(step));
    }
    if (rank < 0 || !ordered.insert(rank).second)
      throw std::invalid_argument(fmt::format("order {}: need exactly one order directive per pipeline rank", k));
    t.ranks[static_cast<std::size_t>(rank)] = std::move(steps);
  }
  return t;
}

}  // namespace piper::core
