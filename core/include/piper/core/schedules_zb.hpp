// The automatic zero-bubble scheduler of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024),
// section 3.1's heuristic: given per-stage costs of F, B (input gradient) and W (weight gradient), the
// cost of a pipeline transfer and a per-stage activation memory limit, it places forwards greedily
// while memory allows, fills the time a stage would wait with deferred W, and keeps the best of its
// eight variants. ZB-1p is the limit of 1F1B (p microbatches in flight), ZB-2p twice that. The
// paper's ILP refinement is not implemented. Schedule family `zb-auto` (schedules.cpp) is this.
#pragma once

#include <string>
#include <vector>

#include "piper/core/strategy.hpp"

namespace piper::core {

// The heuristic's inputs for `stages` stages (one per pipeline rank). Memory is in any unit: a
// microbatch's F adds mem_f, its B mem_b, its W mem_w (mem_f + mem_b + mem_w == 0).
struct ZbProblem {
  int stages = 1, microbatches = 1;
  std::vector<double> f, b, w;  // seconds (or any time unit) per stage
  double comm = 0;              // one pipeline transfer
  std::vector<double> mem_f, mem_b, mem_w, max_mem;
};

struct ZbSolution {
  ScheduleTable table;           // per rank: F, I, W steps in issue order
  std::vector<double> span;      // per stage: end of its last op - start of its first (the paper's time)
  std::vector<double> peak_mem;  // per stage: most memory held at once, in the problem's unit
  double max_span = 0;           // the paper's objective: the longest stage span
  std::string variant;           // which of the eight heuristic variants won
};

// Runs the heuristic's eight variants and keeps the one with the shortest longest-stage span (the
// first on ties). Throws std::invalid_argument ("zb-auto: ...", one line) when no variant fits the
// memory limit or an input is malformed.
ZbSolution zb_auto_solve(const ZbProblem& problem);

// Times a given per-rank order (one region per rank, rank r = stage r) under the problem's costs, as
// the heuristic times its own: each op starts when its rank is free and its input has arrived (F: the
// previous stage's F + comm; I or B: the next stage's I or B + comm). A full B costs b + w. Returns
// per-stage spans and max_span (peak_mem counts mem_f at F and releases it at W or B); throws
// std::invalid_argument when the order deadlocks or names another rank's stage. Used to compare the
// hand-made families with zb-auto under the same costs (the paper's Table 5).
ZbSolution zb_evaluate(const ZbProblem& problem, const ScheduleTable& table);

// The paper's bubble rate (section 5.3): (cost - m(F+B+W)) / cost with cost = the longest stage span
// and F, B, W of the busiest stage.
double zb_bubble_rate(const ZbProblem& problem, const ZbSolution& solution);

// The problem posed for a schedule context: ctx.costs (unit costs when empty) and ctx.memory_limit
// ("<k>p": k x ranks microbatch activations; bytes: needs ctx.costs.activation_bytes). A
// microbatch's activations stay alive from its F until its W (Piper frees a buffer at its last use).
ZbProblem zb_problem(const ScheduleContext& ctx);

// The family's table: checks the context (one region per rank), poses and solves the problem.
ScheduleTable zb_auto_table(const ScheduleContext& ctx);

}  // namespace piper::core
