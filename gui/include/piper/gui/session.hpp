// What the studio computes for one scenario (compile + simulate + view index), runnable off the GUI
// thread, and how a failure is located in the directive editor.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "piper/core/scenario.hpp"
#include "piper/gui/timeline_data.hpp"
#include "piper/sim/report.hpp"

namespace piper::gui {

struct ScenarioRun {
  core::Scenario scenario;
  std::string title;            // "qwen3-1b · 1f1b · PP4 DP1 M8 · dgx-h200 (analytic)"
  nlohmann::json program_json;  // the directive program that was compiled
  std::shared_ptr<const core::Timeline> timeline;
  std::shared_ptr<const Track> track;
  sim::Report report;
};

// A failed compile or simulation, located in the directive program where possible.
struct RunError {
  std::string message;       // one line
  int directive_index = -1;  // DirectiveError::index()
  std::string field;         // DirectiveError::field()
};

// The GUI's default engine is the analytic one (interactive re-simulation); a scenario's own engine
// field wins.
constexpr const char* kStudioEngine = "analytic";

// Compiles and simulates `scenario`, then builds the view index. Throws RunError. Thread-safe.
ScenarioRun run_scenario(const core::Scenario& scenario);
std::string scenario_title(const core::Scenario& scenario, const sim::Report& report);

// Reads a scenario file (core::Scenario::from_json, paths relative to the file). Throws RunError.
core::Scenario load_scenario_file(const std::string& path);

}  // namespace piper::gui
