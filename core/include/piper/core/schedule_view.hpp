// Unit-time view of a compiled pipeline schedule: list-schedules a Program with per-pass unit costs
// (a tiny scheduler, independent of the simulator) to draw the rank x time grid and to measure
// per-rank bubbles and peak activation counts against the published formulas.
#pragma once

#include <string>
#include <vector>

#include "piper/core/program.hpp"
#include "piper/core/strategy.hpp"

namespace piper::core {

// Integer time units per pass. A split backward costs BI = backward - weight and BW = weight.
struct UnitCosts {
  int forward = 1;
  int backward = 2;
  int weight = 1;
};

struct TimedOp {
  int stage = -1;       // PP region (the op's PP tag)
  int microbatch = -1;  // DAG microbatch; the second copy of a mirrored pair adds Program::microbatches
  Pass pass = Pass::None;
  int start = 0, end = 0;  // time units
};

struct RankTimeline {
  std::vector<TimedOp> ops;  // compute ops (F, B, BI, BW) in start order
  int busy = 0;              // summed cost of the rank's compute ops
  int bubble = 0;            // step time - busy: the rank's idle time within the step
  int peak_activations = 0;  // most activation buffers alive at once (alloc at F start, free at last use end)
};

struct UnitSchedule {
  int step_time = 0;                // end of the last compute op on any rank (the step starts at 0)
  std::vector<RankTimeline> ranks;  // one per device of the program
};

// Schedules every device of `program`: each stream runs its ops in issue order; an op starts when
// its stream predecessor and every op it waits for have ended; compute ops take their pass's unit
// cost, UPD and communication take none, and transfers and collectives are rendezvous (all
// participants start together). Overlapped steps need nothing special: the order pass already makes
// a group's members wait for all of the group's inputs. Throws Error on a wait cycle.
UnitSchedule unit_time_schedule(const Program& program, const UnitCosts& costs);

// Compiles the schedule family of `o` (pp ranks, dp 1, no EP/ZeRO) for a small dense model with
// exactly one transformer block per PP region and schedules it as above.
UnitSchedule unit_time_schedule(const StrategyOptions& o, const UnitCosts& costs);

// The rank x time grid ("7B3" = stage 7, backward, microbatch 3; I/W = BI/BW; '*' marks the two ops
// of an overlapped F&B step of `table`, if given), then per-rank busy, bubble and peak activations.
std::string render_unit_schedule(const UnitSchedule& s, const ScheduleTable* table);

// `piper schedule show`: the header line ("dualpipev on 4 ranks, ..."), then render_unit_schedule of
// the family's unit-time schedule, with overlapped-pair marks when the family has a per-rank table.
// The CLI and the Python bindings print/return exactly this. A grid that takes more than 2 * 10^6
// characters by schedule_grid_chars_at_least is refused (Error naming the flags) before the directive
// program and the compile, whose time and memory grow with the ops (minutes and gigabytes for 400
// ranks x 1600 microbatches).
std::string schedule_show_text(const StrategyOptions& o, const UnitCosts& costs);

// A lower bound on the characters of the grid schedule_show_text draws for `o` (valid options):
// every time unit of every op (PP regions x microbatches x (F + B)) takes a cell as wide as the
// widest label ("<last region>B<last microbatch>") and a space. Computed from the flags alone.
double schedule_grid_chars_at_least(const StrategyOptions& o, const UnitCosts& costs);

// The unit-time schedule as JSON: step_time and, per rank, busy, bubble, peak_activations and ops
// ({stage, microbatch, pass, start, end}); the Python bindings return it.
nlohmann::json to_json(const UnitSchedule& s);

}  // namespace piper::core
