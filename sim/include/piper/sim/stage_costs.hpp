// Per-region costs for the cost-aware schedule families (zb-auto): what one microbatch's F, BI and BW
// take on each PP region, one pipeline transfer, and the activation bytes a microbatch keeps alive,
// read off a compiled program with the simulator's cost model.
#pragma once

#include <string>

#include "piper/core/program.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/sim/cost_model.hpp"

namespace piper::sim {

// Per region: the summed cost of microbatch 0's F (BI, BW) compute ops on each device of the region,
// the slowest device's; transfer: the slowest pipeline SEND of microbatch 0; activation_bytes: the
// activation buffers that microbatch 0's forwards allocate, the largest device's. A full B (unsplit)
// counts as BI.
core::StageCosts measure_stage_costs(const core::Program& program, const CostModel& cost);

// Whether `scenario` generates its schedule with a cost-aware family that has no costs yet.
bool needs_stage_costs(const core::Scenario& scenario);

// The scenario with its strategy's stage_costs measured, when needs_stage_costs: compiled once under
// unit costs (memory limit 1p, which needs no byte sizes), then measured on `cluster` with the
// calibration and override the simulation will use. Otherwise the scenario unchanged.
core::Scenario with_stage_costs(const core::Scenario& scenario, const std::string& cluster,
                                const std::string& calibration_path, const OpOverride& override = {});

}  // namespace piper::sim
