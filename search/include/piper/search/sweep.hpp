// Sweeps: expand a spec's lists of strategy knobs into every combination, simulate each (on a worker
// pool: threads, or MPI ranks), and append one CSV row per combination to a results file that a rerun resumes from.
// The CLI (`piper sweep`) and the Python module (`piper.sweep`) call the same functions.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"

namespace piper::search {

class WorkerPool;

// A bad sweep spec or results file: one line naming the file and field.
class SweepError : public core::Error {
 public:
  using core::Error::Error;
};

// Lists of values per knob; every knob not given in the spec holds one default value. The strategy
// knobs are the settings of core/settings.hpp, by name.
struct SweepSpec {
  std::string model = "qwen3-9m";
  std::string cluster = "dgx-h200";
  std::string calibration_path;
  std::vector<std::string> engine{"analytic"};
  std::vector<std::int64_t> seq_len{0}, micro_batch_size{0};  // 0: the model's default
  // The values of each strategy setting, indexed like core::strategy_settings() (default: its default).
  std::vector<std::vector<nlohmann::json>> settings;

  SweepSpec();
  // The values listed for the setting `name` (a setting of the table).
  const std::vector<nlohmann::json>& values(const std::string& name) const;
  std::vector<nlohmann::json>& values(const std::string& name);

  // Reads a spec's JSON; `where` names it in errors. Each knob is a value or a list of values.
  // Relative model/cluster/calibration file paths resolve against `base_dir`.
  static SweepSpec from_json(const nlohmann::json& j, const std::string& where, const std::string& base_dir = "");
  static SweepSpec load(const std::string& path);  // size-checked read, then parse
  static SweepSpec parse(const std::string& text, const std::string& where, const std::string& base_dir = "");
};

// One combination of knob values: the strategy settings plus where and how it is simulated.
struct SweepPoint : core::StrategyOptions {
  std::string model, cluster, engine;
  std::int64_t seq_len = 0, micro_batch_size = 0;
  // The spec's calibration file (SweepSpec::calibration_path), "" without one: part of the key, so a
  // results file resumed by a sweep with another calibration (or none) does not pass off the rows
  // simulated without it as its own. run_point takes the file to use separately.
  std::string calibration;
  const core::StrategyOptions& strategy() const { return *this; }
  // Stable identity of the combination (no commas): the resume key. The essential settings, then
  // seq_len and micro_batch_size when set, then every other setting not at its default, then the
  // calibration file when there is one.
  std::string key() const;
};

// The cartesian product, in spec order: engine outermost, then the essential settings (pp, dp, ep,
// zero, schedule, microbatches, virtual, bucket_mb), seq_len, micro_batch_size, and the other
// settings in table order.
std::vector<SweepPoint> expand(const SweepSpec& spec);

// One row of the results: the knobs plus the report's headline fields.
struct SweepRow {
  SweepPoint point;
  std::string status;  // "ok" | "invalid" (rejected before simulating) | "error" (simulation failed)
  std::string reason;  // one line; empty when ok
  int devices = 0;
  double step_time_s = 0, tokens_per_s = 0, mfu = 0, bubble_fraction = 0;
  std::int64_t peak_memory_bytes = 0;  // max over devices
  bool oom = false;
  double compile_time_s = 0, simulate_time_s = 0;
  double tp_comm_s = 0;  // TP collectives (inside compute ops) on the critical path
};

// CSV columns (the first is `key`) and one row without its newline; fields are quoted when needed.
const std::vector<std::string>& sweep_csv_columns();
std::string sweep_csv_header();
std::string to_csv(const SweepRow& row);
// The same row as a JSON object keyed by the CSV columns (oom as a bool); the Python bindings return it.
nlohmann::json to_json(const SweepRow& row);

// The headline figures of one compiled and simulated scenario, or why it could not be simulated.
struct Outcome {
  std::string status;  // "ok" | "invalid" (rejected before simulating) | "error" (simulation failed)
  std::string reason;  // one line; empty when ok
  int devices = 0;
  double step_time_s = 0, tokens_per_step = 0, tokens_per_s = 0, mfu = 0, bubble_fraction = 0;
  std::int64_t peak_memory_bytes = 0;  // max over devices
  bool oom = false;
  double compile_time_s = 0, simulate_time_s = 0;
  double tp_comm_s = 0;  // the report's critical_path.tp_s
};
// Copies an outcome into a results row (SweepRow, TuneRow: the same field names).
template <typename Row>
void copy_outcome(const Outcome& o, Row& row) {
  row.status = o.status;
  row.reason = o.reason;
  row.devices = o.devices;
  row.step_time_s = o.step_time_s;
  row.tokens_per_s = o.tokens_per_s;
  row.mfu = o.mfu;
  row.bubble_fraction = o.bubble_fraction;
  row.peak_memory_bytes = o.peak_memory_bytes;
  row.oom = o.oom;
  row.compile_time_s = o.compile_time_s;
  row.simulate_time_s = o.simulate_time_s;
  row.tp_comm_s = o.tp_comm_s;
}

// Compiles `scenario` and simulates it on `cluster` with `engine`; never throws for a bad scenario.
Outcome simulate_outcome(const core::Scenario& scenario, const std::string& cluster, const std::string& engine,
                         const std::string& calibration_path = "");

// Compiles and simulates one combination; never throws for a bad combination (status says why).
SweepRow run_point(const SweepPoint& point, const std::string& calibration_path = "");

// Reads an existing results file for resuming: returns the keys of its complete rows. A trailing
// partial line (a run killed mid-write) is cut off the file. Throws SweepError if its header differs.
// A missing or empty file yields no keys (and is not created).
std::set<std::string> repair_results(const std::string& csv_path);

struct SweepOptions {
  int jobs = 1;  // worker threads
  // Called after each row is written (from a worker thread, one call at a time).
  std::function<void(const SweepRow& row, std::size_t done, std::size_t total)> on_row;
};

struct SweepSummary {
  std::size_t combinations = 0;  // in the spec
  std::size_t resumed = 0;       // already in the CSV, not rerun
  std::size_t ran = 0, ok = 0, invalid = 0, failed = 0;
};

// Runs every combination not already in `csv_path` and appends its row (flushed one at a time; rows
// land in completion order). Analytic combinations run on `jobs` threads; simgrid ones run one at a
// time afterwards, with no other worker alive, because that engine forks a child per run.
SweepSummary run_sweep(const SweepSpec& spec, const std::string& csv_path, const SweepOptions& options = {});

// The same on any worker pool (worker_pool.hpp; under mpirun the MPI one): every process expands the
// spec, the owner resumes and appends to `csv_path`, and each combination runs on one process.
// options.jobs is the pool's; on_row sees the rows this process ran. A bad results file throws
// SweepError on every process. The summary is the owner's (other processes leave it empty).
SweepSummary run_sweep(const SweepSpec& spec, const std::string& csv_path, WorkerPool& pool,
                       const SweepOptions& options = {});

// Reads the spec at `path` on the owner of `pool` and shares it with every process; a bad spec (or
// an unreadable file) throws SweepError on every process, naming the file.
SweepSpec load_sweep_spec(const std::string& path, WorkerPool& pool);

}  // namespace piper::search
