// The `piper` Python module: compile, simulate, sweep, schedule_show, directives and verify over the
// same library functions the CLI calls, taking and returning the CLI's JSON shapes as dicts/lists.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"
#include "piper/core/program.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/schedule_view.hpp"
#include "piper/core/verifier.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/sim/sweep.hpp"

namespace py = pybind11;
namespace core = piper::core;
namespace sim = piper::sim;
using nlohmann::json;

namespace {

// piper.Error: every bad input, with the one-line message the CLI prints after "piper: error: ".
struct PiperError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

// nlohmann prefixes "[json.exception.type_error.302] "; the CLI strips it, so do we.
std::string json_message(const json::exception& e) {
  std::string m = e.what();
  if (!m.empty() && m.front() == '[') {
    const auto close = m.find("] ");
    if (close != std::string::npos) m = m.substr(close + 2);
  }
  return m;
}

// Runs `fn` with the GIL released (the simulator may take seconds) and turns the libraries' error
// types into piper.Error, the way the CLI's main() turns them into one line and exit status 2.
template <class F>
auto guarded(F&& fn) -> decltype(fn()) {
  try {
    py::gil_scoped_release release;
    return fn();
  } catch (const core::Error& e) {
    throw PiperError(one_line(e.what()));
  } catch (const std::invalid_argument& e) {
    throw PiperError(one_line(e.what()));
  } catch (const json::exception& e) {
    throw PiperError(one_line(json_message(e)));
  } catch (const std::runtime_error& e) {
    throw PiperError(one_line(e.what()));
  }
}

// Python objects cross as JSON text through the standard json module: exact for every value the
// CLI's files hold (doubles round-trip), and no second converter to keep in step with the first.
json to_cpp(const py::handle& obj, const char* what) {
  std::string text;
  try {
    text = py::module_::import("json").attr("dumps")(obj).cast<std::string>();
  } catch (py::error_already_set& e) {
    throw PiperError(std::string(what) + ": not JSON-serialisable: " + one_line(e.what()));
  }
  return guarded([&] { return core::parse_json(text, what); });
}

py::object to_py(const json& j) { return py::module_::import("json").attr("loads")(j.dump()); }

core::Scenario scenario_of(const py::handle& obj, const std::string& base_dir) {
  const json j = to_cpp(obj, "scenario");
  return guarded([&] { return core::Scenario::from_json(j, "scenario", base_dir); });
}

py::object compile(const py::handle& scenario, const std::string& base_dir) {
  const core::Scenario s = scenario_of(scenario, base_dir);
  const json program = guarded([&] { return core::compile_scenario(s).result.program.to_json(); });
  return to_py(program);
}

py::object directives(const py::handle& scenario, const std::string& base_dir) {
  json j = to_cpp(scenario, "scenario");
  // Without a model this is `piper directives` without --model: the generator alone, unchecked.
  const bool has_model = j.is_object() && j.contains("model");
  if (j.is_object() && !has_model) j["model"] = "";
  const core::Scenario s = guarded([&] { return core::Scenario::from_json(j, "scenario", base_dir); });
  return to_py(guarded([&] {
    return has_model ? core::scenario_program(s) : core::strategy_directives(s.strategy);
  }));
}

sim::SimulateOptions simulate_options(const std::string& cluster, const std::string& engine,
                                      const std::string& calibration) {
  sim::SimulateOptions o;
  o.cluster = cluster;
  o.engine = engine;
  o.calibration_path = calibration;
  return o;
}

py::object simulate(const py::object& scenario, const py::object& plan, const std::string& cluster,
                    const std::string& engine, const std::string& calibration, const std::string& base_dir) {
  const sim::SimulateOptions options = simulate_options(cluster, engine, calibration);
  if (scenario.is_none() == plan.is_none()) throw PiperError("simulate: give a scenario or plan=, not both or neither");
  if (!plan.is_none()) {
    const json j = to_cpp(plan, "plan");
    return to_py(guarded([&] {
      core::Program program;
      try {
        program = core::Program::from_json(j);
        core::verify_or_throw(program);
      } catch (const core::Error& e) {
        throw core::Error(std::string("plan: ") + e.what());
      }
      return sim::simulate_program(std::make_shared<const core::Program>(std::move(program)), options).report.to_json();
    }));
  }
  const core::Scenario s = scenario_of(scenario, base_dir);
  return to_py(guarded([&] { return sim::simulate(s, options).report.to_json(); }));
}

py::list verify(const py::handle& plan) {
  const json j = to_cpp(plan, "plan");
  const std::vector<core::VerifyIssue> issues = guarded([&] {
    try {
      return core::verify(core::Program::from_json(j));
    } catch (const core::Error& e) {
      throw core::Error(std::string("plan: ") + e.what());
    }
  });
  py::list out;
  for (const auto& issue : issues) {
    py::dict d;
    d["check"] = issue.check;
    d["message"] = one_line(issue.message);
    out.append(d);
  }
  return out;
}

py::dict sweep(const py::handle& spec_obj, const py::object& output, int jobs, const std::string& base_dir) {
  const json j = to_cpp(spec_obj, "sweep spec");
  if (jobs < 1) throw PiperError("sweep: jobs must be a positive integer");
  const sim::SweepSpec spec = guarded([&] { return sim::SweepSpec::from_json(j, "sweep spec", base_dir); });
  // Without output= the rows go to a private temporary CSV that is removed afterwards.
  std::string path;
  std::filesystem::path temp_dir;
  if (output.is_none()) {
    std::string pattern = (std::filesystem::temp_directory_path() / "piper-sweep-XXXXXX").string();
    if (!mkdtemp(pattern.data())) throw PiperError("sweep: cannot create a temporary folder");
    temp_dir = pattern;
    path = (temp_dir / "rows.csv").string();
  } else {
    path = output.cast<std::string>();
  }
  std::vector<json> rows;
  sim::SweepOptions options;
  options.jobs = jobs;
  options.on_row = [&rows](const sim::SweepRow& row, std::size_t, std::size_t) { rows.push_back(sim::to_json(row)); };
  sim::SweepSummary s;
  try {
    s = guarded([&] { return sim::run_sweep(spec, path, options); });
  } catch (...) {
    if (!temp_dir.empty()) std::filesystem::remove_all(temp_dir);
    throw;
  }
  if (!temp_dir.empty()) std::filesystem::remove_all(temp_dir);
  py::dict out;
  out["combinations"] = s.combinations;
  out["resumed"] = s.resumed;
  out["ran"] = s.ran;
  out["ok"] = s.ok;
  out["invalid"] = s.invalid;
  out["failed"] = s.failed;
  out["rows"] = to_py(json(rows));
  return out;
}

py::dict schedule_show(const std::string& name, int ranks, int microbatches, int virtual_stages,
                       const std::vector<int>& costs) {
  if (ranks < 1 || microbatches < 1 || virtual_stages < 1)
    throw PiperError("schedule_show: ranks, microbatches and virtual must be positive integers");
  if (costs.size() != 3 || costs[0] < 1 || costs[1] < 1 || costs[2] < 1)
    throw PiperError("schedule_show: costs must be three positive integers F, B, W");
  core::StrategyOptions o;
  o.schedule = name;
  o.pp = ranks;
  o.microbatches = microbatches;
  o.virtual_stages = virtual_stages;
  const core::UnitCosts c{costs[0], costs[1], costs[2]};
  const auto [text, schedule] = guarded([&] {
    core::schedule_family(name);  // an unknown family is one line, as the CLI's --help check
    return std::make_pair(core::schedule_show_text(o, c), core::to_json(core::unit_time_schedule(o, c)));
  });
  py::dict out = to_py(schedule).cast<py::dict>();
  out["text"] = text;
  return out;
}

// The built-in model zoo, as `piper models` lists it, with exact parameter counts.
py::list models() {
  py::list out;
  for (const std::string& name : core::zoo_names()) {
    const core::ModelConfig cfg = *core::zoo_config(name);
    py::dict d;
    d["name"] = name;
    d["params"] = core::build_model(cfg).parameter_count();
    d["layers"] = cfg.layers;
    d["hidden"] = cfg.hidden;
    d["experts"] = cfg.experts;
    d["top_k"] = cfg.top_k;
    out.append(d);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(piper, m) {
  m.doc() = "Piper: compile, simulate and sweep distributed-training strategies (the piper CLI as functions).";
  py::register_exception<PiperError>(m, "Error", PyExc_ValueError);
  m.attr("__version__") = PIPER_VERSION;

  m.def("compile", &compile, py::arg("scenario"), py::kw_only(), py::arg("base_dir") = "",
        "Compile a scenario dict (the JSON of a scenario file) into the Program dict that `piper compile -o` writes.");
  m.def("directives", &directives, py::arg("scenario"), py::kw_only(), py::arg("base_dir") = "",
        "The directive program (list) a scenario compiles; without 'model', the one `piper directives` prints.");
  m.def("simulate", &simulate, py::arg("scenario") = py::none(), py::kw_only(), py::arg("plan") = py::none(),
        py::arg("cluster") = "", py::arg("engine") = "", py::arg("calibration") = "", py::arg("base_dir") = "",
        "Simulate a scenario dict (or plan=, a Program dict); returns the report dict `piper simulate --report` writes.");
  m.def("verify", &verify, py::arg("plan"),
        "Verify a Program dict; returns the issues as [{check, message}] (empty: ok).");
  m.def("sweep", &sweep, py::arg("spec"), py::kw_only(), py::arg("output") = py::none(), py::arg("jobs") = 1,
        py::arg("base_dir") = "",
        "Run a sweep spec dict; rows are appended to output (a CSV, resumable) if given. Returns the summary and "
        "the rows run now.");
  m.def("models", &models, "The built-in model zoo: [{name, params, layers, hidden, experts, top_k}], as `piper models` lists it.");
  m.def("schedule_show", &schedule_show, py::arg("name"), py::kw_only(), py::arg("ranks") = 4,
        py::arg("microbatches") = 8, py::arg("virtual") = 1, py::arg("costs") = std::vector<int>{1, 2, 1},
        "Unit-time view of a schedule family: the text `piper schedule show` prints, step_time and per-rank ops.");
}
