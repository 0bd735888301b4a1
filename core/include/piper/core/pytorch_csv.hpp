// PyTorch interop: the compute-only schedule CSV of torch.distributed.pipelining (one row per rank,
// actions such as 2F0, 3I1, 7W4, (0F7;7B3)OVERLAP_F_B) to and from Piper schedule tables and programs.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/directives.hpp"
#include "piper/core/strategy.hpp"

namespace piper::core {

// One row per rank, comma-separated actions, '\n' after each row (as the published fixtures).
std::string schedule_to_pytorch_csv(const ScheduleTable& table);

// How the CSV spells the split backward. PyTorch >= 2.5: I = input gradient, W = weight gradient,
// B = full backward. PyTorch < 2.5 had no I: a B whose stage and microbatch also have a W was the
// input gradient. Either: no W at all, so B is the full backward in both.
enum class CsvSpelling { Either, Modern, Legacy };
std::string describe(CsvSpelling s);  // one phrase for the CLI's note

// Parses and validates a compute-only CSV in either spelling (detected; stored in *spelling). Empty cells are idle
// slots. Errors are one line, "WHERE: row R (rank R-1), column C: ...": a malformed action, a stage on two ranks, an
// action given twice, W before its I, B mixed with I/W, both spellings in one file, or a missing stage, forward or
// backward.
ScheduleTable schedule_from_pytorch_csv(const std::string& text, const std::string& where,
                                        CsvSpelling* spelling = nullptr);

// Stage -> rank of a valid table (each stage on one rank).
std::vector<int> stage_ranks(const ScheduleTable& table);

// The directive program a table implies: place (stage -> rank; `o` gives dp/ep/zero), split, and
// one order per rank. o.pp is set from the table.
DirectiveProgram program_from_schedule_table(const ScheduleTable& table, StrategyOptions o);

// Reads a table back from a directive program with one order directive per pipeline rank (ranks
// numbered as rank_of_region_from_program numbers them). Throws std::invalid_argument.
ScheduleTable schedule_table_from_program(const DirectiveProgram& program);

}  // namespace piper::core
