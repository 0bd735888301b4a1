// The simulator's front door, shared by the CLI, the GUI and sweeps: scenario (or Program) + cluster
// + engine -> compiled program, Timeline and Report.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "piper/core/scenario.hpp"
#include "piper/core/timeline.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/engine.hpp"
#include "piper/sim/report.hpp"

namespace piper::sim {

struct SimulateOptions {
  std::string cluster;           // preset or file; empty: the scenario's, else "dgx-h200"
  std::string engine;            // "analytic" | "simgrid"; empty: the scenario's, else kDefaultEngine
  std::string calibration_path;  // optional calibration JSON
  OpOverride op_override;        // optional per-op durations (tests, unit-time views)
  // Simulate one device per symmetry class when the engine and program allow it (symmetry.hpp); the
  // result equals the full simulation. false: always simulate every device (--no-symmetry).
  bool symmetry = true;
  // simulate_program: where the program came from (a plan file), for error messages; empty: "plan".
  std::string program_source;
};

constexpr const char* kDefaultCluster = "dgx-h200";

struct SimulationResult {
  // Set by simulate(Scenario): the compiled scenario; its result.program was moved into `program`.
  std::optional<core::CompiledScenario> compiled;
  std::shared_ptr<const core::Program> program;
  Cluster cluster;  // grown to the program's device count (with_devices)
  core::Timeline timeline;
  Report report;
};

// --v-head / --v-embedding auto (core::v_end_choices): the scenario with the choice whose analytic
// simulation on `cluster` is fastest (the earlier one on a tie: in the V first); unchanged otherwise.
// simulate() applies it, and so does the sweep.
core::Scenario choose_v_ends(const core::Scenario& scenario, const std::string& cluster);
SimulationResult simulate(const core::Scenario& scenario, const SimulateOptions& options = {});
// A scenario's own "cluster" and "engine" fields, checked and named as its file's fields: what
// simulate does with them, for the front ends that compile or run a scenario without simulating it
// (a misspelt engine or a missing cluster file there was taken silently). Throws core::Error.
void check_scenario_cluster_and_engine(const core::Scenario& scenario);
// A Program already compiled (e.g. read from --plan); compile stats come from program.stats.
SimulationResult simulate_program(std::shared_ptr<const core::Program> program, const SimulateOptions& options = {});

}  // namespace piper::sim
