// Compile + simulate + index one scenario for the studio, translating errors into editor locations.
#include "piper/gui/session.hpp"

#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"
#include "piper/sim/simulate.hpp"

namespace piper::gui {

std::string scenario_title(const core::Scenario& s, const sim::Report& r) {
  std::string model = std::filesystem::path(s.model).filename().string();
  std::string schedule = s.directives ? (s.append_schedule ? s.strategy.schedule + " (appended)" : "directive program")
                                      : s.strategy.schedule;
  return fmt::format("{} · {} · {} devices, {} microbatches · {}{} ({})", model, schedule, r.devices, r.microbatches,
                     r.cluster.empty() ? "cluster" : r.cluster, r.runtime.empty() ? "" : ", " + r.runtime, r.engine);
}

ScenarioRun run_scenario(const core::Scenario& scenario) {
  ScenarioRun run;
  run.scenario = scenario;
  try {
    sim::SimulateOptions options;
    options.engine = scenario.engine.empty() ? kStudioEngine : scenario.engine;
    sim::SimulationResult result = sim::simulate(scenario, options);
    if (result.compiled) run.program_json = result.compiled->program.to_json();
    auto timeline = std::make_shared<core::Timeline>(std::move(result.timeline));
    run.report = std::move(result.report);
    run.title = scenario_title(scenario, run.report);
    const std::int64_t hbm = result.cluster.num_devices() > 0 ? result.cluster.gpu(0).hbm_bytes : 0;
    run.timeline = timeline;
    auto track = make_track(timeline, run.title, hbm);
    track->peak_bytes_by_kind.resize(timeline->devices.size());
    for (const sim::DeviceReport& d : run.report.per_device)
      if (d.device >= 0 && d.device < static_cast<int>(track->peak_bytes_by_kind.size()))
        track->peak_bytes_by_kind[static_cast<std::size_t>(d.device)] = d.peak_bytes_by_kind;
    run.track = track;
  } catch (const core::DirectiveError& e) {
    throw RunError{e.what(), e.index(), e.field()};
  } catch (const std::exception& e) {
    throw RunError{e.what(), -1, ""};
  }
  return run;
}

core::Scenario load_scenario_file(const std::string& path) {
  std::string text;
  try {
    text = core::read_input_file(path);
    core::check_json_depth(text, path);
  } catch (const std::exception& e) {
    throw RunError{e.what(), -1, ""};
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw RunError{fmt::format("{}: not JSON (byte {}): {}", path, e.byte, e.what()), -1, ""};
  }
  try {
    return core::Scenario::from_json(j, path, std::filesystem::path(path).parent_path().string());
  } catch (const std::exception& e) {
    throw RunError{e.what(), -1, ""};
  }
}

}  // namespace piper::gui
