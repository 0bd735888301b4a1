// `piper._piper`, the native half of the `piper` Python package: compile, simulate, sweep, tune,
// schedule_show, directives and verify over the same library functions the CLI calls, taking and
// returning the CLI's JSON shapes as dicts/lists. The pure-Python half (python/piper/__init__.py)
// gives them keyword signatures, docstrings, Python exception classes and table forms.
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
#include "piper/core/settings.hpp"
#include "piper/core/verifier.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/engine.hpp"
#include "piper/sim/kernel_table.hpp"
#include "piper/search/results_csv.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/search/sweep.hpp"
#include "piper/search/tune.hpp"

namespace py = pybind11;
namespace core = piper::core;
namespace sim = piper::sim;
namespace search = piper::search;
using nlohmann::json;

namespace {

// _piper.NativeInputError: every bad input, with the one-line message the CLI prints after
// "piper: error: " (piper.InputError in Python). _piper.NativeInternalError: anything else, a bug.
struct PiperError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct InternalError : std::runtime_error {
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
  } catch (const std::bad_alloc&) {
    throw;  // pybind11 turns it into MemoryError
  } catch (const std::exception& e) {
    throw InternalError(one_line(e.what()));
  }
}

// Python objects cross as JSON text through the standard json module: exact for every value the
// CLI's files hold (doubles round-trip), and no second converter to keep in step with the first.
json to_cpp(const py::handle& obj, const char* what) {
  std::string text;
  try {
    text = py::module_::import("json").attr("dumps")(obj, py::arg("allow_nan") = false).cast<std::string>();
  } catch (py::error_already_set& e) {
    // The exception's own line ("Object of type bytes is not JSON serializable"), not what(), which
    // appends the Python traceback.
    throw PiperError(std::string(what) +
                     ": not JSON-serialisable: " + one_line(py::str(e.value()).cast<std::string>()));
  }
  return guarded([&] { return core::parse_json(text, what); });
}

py::object to_py(const json& j) { return py::module_::import("json").attr("loads")(j.dump()); }

// A JSON input file read as the CLI reads it: bounded by the input-bytes limit (a device such as
// /dev/zero stops there), nested no deeper than json-depth, a key given twice refused. Python's own
// open().read() and json.loads had none of these: /dev/zero ran the process out of memory, and
// {"pp": 2, "pp": 4} silently kept 4.
py::object read_json(const std::string& path) {
  return to_py(guarded([&] {
    const std::string text = core::read_input_file(path);
    try {
      return core::parse_json(text, path);
    } catch (const json::exception& e) {
      throw core::Error(path + ": not JSON: " + json_message(e));
    }
  }));
}

// Any input file's bytes, read as the CLI reads one (the input-bytes limit): what read_results parses.
py::bytes read_input(const std::string& path) {
  return py::bytes(guarded([&] { return core::read_input_file(path); }));
}

core::Scenario scenario_of(const py::handle& obj, const std::string& base_dir) {
  const json j = to_cpp(obj, "scenario");
  return guarded([&] { return core::Scenario::from_json(j, "scenario", base_dir); });
}

py::object compile(const py::handle& scenario, const std::string& base_dir) {
  const core::Scenario s = scenario_of(scenario, base_dir);
  const json program = guarded([&] {
    sim::check_scenario_cluster_and_engine(s);
    return core::compile_scenario(s).result.program.to_json();
  });
  return to_py(program);
}

py::object directives(const py::handle& scenario, const std::string& base_dir) {
  json j = to_cpp(scenario, "scenario");
  // Without a model this is `piper directives` without --model: the generator alone, unchecked.
  const bool has_model = j.is_object() && j.contains("model");
  if (j.is_object() && !has_model) j["model"] = "";
  const core::Scenario s = guarded([&] { return core::Scenario::from_json(j, "scenario", base_dir); });
  return to_py(guarded(
      [&] { return (has_model ? core::scenario_program(s) : core::strategy_directives(s.strategy)).to_json(); }));
}

sim::SimulateOptions simulate_options(const std::string& cluster, const std::string& engine,
                                      const std::string& calibration) {
  sim::SimulateOptions o;
  o.cluster = cluster;
  o.engine = engine;
  o.calibration_path = calibration;
  return o;
}

// Errors of a plan given by value name it "plan"; Program::from_json's own messages already start
// with "plan: field ...", so the prefix is added only where it is missing (it read "plan: plan: ").
std::string plan_prefixed(const std::string& message) {
  return message.rfind("plan: ", 0) == 0 ? message : "plan: " + message;
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
        throw core::Error(plan_prefixed(e.what()));
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
      throw core::Error(plan_prefixed(e.what()));
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
  const search::SweepSpec spec = guarded([&] { return search::SweepSpec::from_json(j, "sweep spec", base_dir); });
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
  search::SweepOptions options;
  options.jobs = jobs;
  options.on_row = [&rows](const search::SweepRow& row, std::size_t, std::size_t) {
    rows.push_back(search::to_json(row));
  };
  search::SweepSummary s;
  try {
    s = guarded([&] { return search::run_sweep(spec, path, options); });
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

// `piper tune`: the search written to `output` (a CSV, resumable), the summary and the ranked rows
// as CSV fields (the Python half types them by column, as the CLI's file reads).
py::dict tune(const py::dict& a) {
  search::TuneSpec spec;
  auto str = [&](const char* k) { return a[k].cast<std::string>(); };
  spec.model = str("model");
  spec.cluster = str("cluster");
  spec.devices = a["devices"].cast<int>();
  spec.global_batch = a["global_batch"].cast<std::int64_t>();
  spec.seq_len = a["seq_len"].cast<std::int64_t>();
  spec.micro_batch_sizes = a["micro_batch_size"].cast<std::vector<std::int64_t>>();
  spec.zero_levels = a["zero"].cast<std::vector<int>>();
  spec.pp_degrees = a["pp"].cast<std::vector<int>>();
  spec.dp_degrees = a["dp"].cast<std::vector<int>>();
  spec.ep_degrees = a["ep"].cast<std::vector<int>>();
  spec.tp_degrees = a["tp"].cast<std::vector<int>>();
  spec.etp_degrees = a["etp"].cast<std::vector<int>>();
  spec.sequence_parallel = a["sequence_parallel"].cast<std::vector<bool>>();
  spec.recompute_modes = a["recompute"].cast<std::vector<std::string>>();
  spec.comm_sms = a["comm_sms"].cast<std::vector<int>>();
  spec.dp_shards = a["dp_shard"].cast<std::vector<int>>();
  spec.reduce_every = a["reduce_every"].cast<std::vector<std::string>>();
  spec.schedules = a["schedules"].cast<std::vector<std::string>>();
  spec.max_virtual = a["max_virtual"].cast<int>();
  spec.memory_cap_bytes = a["memory_cap_bytes"].cast<double>();
  spec.memory_reserve_bytes = a["memory_reserve_bytes"].cast<double>();
  spec.top_k = a["top"].cast<int>();
  spec.placement_search = a["placement_search"].cast<bool>();
  spec.exact_top = a["show"].cast<int>();
  spec.calibration_path = str("calibration");
  const std::string path = str("output");
  search::TuneOptions options;
  options.jobs = a["jobs"].cast<int>();
  options.budget_s = a["budget_s"].cast<double>();
  const search::TuneSummary s = guarded([&] { return search::run_tune(spec, path, options); });
  const auto& e = s.enumeration;
  py::dict out;
  out["model"] = spec.model;
  out["cluster"] = spec.cluster;
  out["devices"] = spec.devices;
  out["global_batch"] = spec.effective_global_batch();
  out["memory_cap_bytes"] = s.memory_cap_bytes;
  out["memory_reserve_bytes"] = s.memory_reserve_bytes;
  out["hbm_bytes"] = s.hbm_bytes;
  out["tp_degrees"] = e.tp_degrees;
  out["tp_rejected"] = e.tp_rejected;
  out["considered"] = e.considered;
  out["candidates"] = s.candidates;
  out["pruned"] = s.pruned;
  out["bounded"] = s.bounded;
  out["dominated"] = s.dominated;
  out["simulated"] = s.simulated;
  out["placement_variants"] = s.placement_variants;
  out["simgrid"] = s.simgrid;
  out["resumed"] = s.resumed;
  out["ran"] = s.ran;
  out["fitting"] = s.fitting;
  out["coinciding"] = s.coinciding;
  out["elapsed_s"] = s.elapsed_s;
  out["budget_exhausted"] = s.budget_exhausted;
  py::list ranked;
  for (const auto& r : s.ranked) {
    py::dict d;
    d["fields"] = search::csv_split(search::to_csv(spec, r));
    d["strategy"] = r.candidate.describe();
    d["pp_ranges"] = search::effective_pp_ranges(spec, r.candidate);
    ranked.append(d);
  }
  out["ranked"] = ranked;
  return out;
}

// The best candidate's directive program and scenario (as `piper tune --emit-directives/--emit-scenario`
// write them), from a ranked row's CSV fields.
py::dict tune_outputs(const std::vector<std::string>& fields) {
  search::TuneSpec spec;
  const search::TuneRow row = guarded([&] { return search::tune_row_from_csv(fields, &spec, "tune row"); });
  const auto [directives, scenario] = guarded([&] {
    core::Scenario sc = search::tune_scenario(spec, row.candidate, row.engine);
    sc.stage_starts = search::effective_pp_ranges(spec, row.candidate);
    return std::make_pair(search::tune_directives(spec, row.candidate), sc.to_json());
  });
  py::dict d;
  d["directives"] = to_py(directives);
  d["scenario"] = to_py(scenario);
  return d;
}

std::vector<std::string> buffer_kinds() {
  std::vector<std::string> out;
  for (int k = 0; k <= static_cast<int>(core::BufferKind::GatheredParameters); ++k)
    out.push_back(core::to_string(static_cast<core::BufferKind>(k)));
  return out;
}

std::vector<std::string> schedule_names() {
  std::vector<std::string> out;
  for (const auto& f : core::schedule_registry()) out.push_back(f.name);
  return out;
}

// piper.strategy(**settings): the keywords checked against the settings table (strict: an unknown
// one is an error with a did-you-mean), every setting returned.
py::object strategy(const py::handle& settings) {
  const json j = to_cpp(settings, "strategy");
  return to_py(guarded([&] {
    core::StrategyOptions o;
    core::read_strategy_json(j, o, "strategy", "");  // each key's type and range, as a scenario file's
    return core::strategy_to_json(o, true);
  }));
}

}  // namespace

PYBIND11_MODULE(_piper, m) {
  m.doc() = "The native half of the piper package: use `import piper`, whose functions have Python signatures.";
  py::register_exception<PiperError>(m, "NativeInputError", PyExc_ValueError);
  py::register_exception<InternalError>(m, "NativeInternalError", PyExc_RuntimeError);
  m.attr("__version__") = PIPER_VERSION;

  m.def("compile", &compile, py::arg("scenario"), py::arg("base_dir") = "",
        "Compile a scenario dict (the JSON of a scenario file) into the Program dict that `piper compile -o` writes.");
  m.def("directives", &directives, py::arg("scenario"), py::arg("base_dir") = "",
        "The directive program (list) a scenario compiles; without 'model', the one `piper directives` prints.");
  m.def(
      "simulate", &simulate, py::arg("scenario") = py::none(), py::arg("plan") = py::none(), py::arg("cluster") = "",
      py::arg("engine") = "", py::arg("calibration") = "", py::arg("base_dir") = "",
      "Simulate a scenario dict (or plan=, a Program dict); returns the report dict `piper simulate --report` writes.");
  m.def("read_json", &read_json, py::arg("path"), "A JSON input file, read and parsed as the CLI reads it.");
  m.def("read_input", &read_input, py::arg("path"), "An input file's bytes, bounded as the CLI bounds them.");
  m.def("verify", &verify, py::arg("plan"),
        "Verify a Program dict; returns the issues as [{check, message}] (empty: ok).");
  m.def("sweep", &sweep, py::arg("spec"), py::arg("output") = py::none(), py::arg("jobs") = 1, py::arg("base_dir") = "",
        "Run a sweep spec dict; rows are appended to output (a CSV, resumable) if given. Returns the summary and "
        "the rows run now.");
  m.def("models", &models,
        "The built-in model zoo: [{name, params, layers, hidden, experts, top_k}], as `piper models` lists it.");
  m.def("schedule_show", &schedule_show, py::arg("name"), py::arg("ranks") = 4, py::arg("microbatches") = 8,
        py::arg("virtual") = 1, py::arg("costs") = std::vector<int>{1, 2, 1},
        "Unit-time view of a schedule family: the text `piper schedule show` prints, step_time and per-rank ops.");
  m.def("tune", &tune, py::arg("args"), "`piper tune` with the arguments of piper.tune as a dict.");
  m.def("tune_outputs", &tune_outputs, py::arg("fields"), "The directives and scenario of a ranked tune row.");
  m.def("sweep_columns", &search::sweep_csv_columns, "The columns of a sweep CSV, in order.");
  m.def("tune_columns", &search::tune_csv_columns, "The columns of a tune CSV, in order.");
  m.def("strategy", &strategy, py::arg("settings"),
        "A strategy dict (every setting) from settings keyed by the table's names; unknown or bad ones are errors.");
  m.def(
      "strategy_settings", [] { return to_py(core::settings_table_json()); },
      "The strategy settings table: [{name, flag, type, default, help, choices?, min?, max?}].");
  m.def("engine_names", &sim::engine_names, "The simulation engines.");
  m.def("cluster_presets", &sim::cluster_presets, "The cluster preset names.");
  m.def("runtime_profiles", &sim::runtime_profiles, "The runtime profiles a cluster's \"runtime\" names.");
  m.def("derived_cluster_spec", &sim::derived_cluster_spec, py::arg("cluster"), py::arg("runtime"),
        py::arg("attention_kernel"), "The derived cluster spec (inline JSON) of a cluster under a training runtime.");
  m.def(
      "check_cluster", [](const std::string& spec) { guarded([&] { (void)sim::load_cluster(spec); }); },
      py::arg("spec"), "Load a cluster (preset, file or inline spec) as the CLI does; raises on an error.");
  m.def("schedule_names", &schedule_names, "The registered schedule families.");
  m.def("buffer_kinds", &buffer_kinds, "The memory kinds of a report's peak_bytes_by_kind, in order.");
  m.attr("default_memory_reserve_fraction") = search::kDefaultMemoryReserveFraction;
}
