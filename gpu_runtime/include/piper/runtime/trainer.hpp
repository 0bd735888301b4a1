// Training drivers over a Program: the distributed run (one MPI rank per device, the Executor over the
// host backend) and the single-process reference on the same global batch; checkpoints and
// parameter dumps used to compare the two.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/program.hpp"
#include "piper/runtime/backend.hpp"
#include "piper/runtime/checkpoint.hpp"
#include "piper/runtime/executor.hpp"
#include "piper/runtime/kernels.hpp"
#include "piper/runtime/rank_group.hpp"

namespace piper::runtime {

class DataflowBase;  // dataflow.hpp

// Thrown on ranks that stop because another rank reported the error: one line, not one per rank.
struct ReportedByAnotherRank : std::runtime_error {
  ReportedByAnotherRank() : std::runtime_error("reported by another rank") {}
};

// A step whose loss, gradient norm or updated state is NaN or infinite, with --on-nonfinite stop
// (the default): one line naming the step and what was non-finite; the run stops before saving.
struct TrainingDiverged : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TrainOptions {
  int steps = 3;  // total steps of the run (a resumed run continues up to this step)
  std::uint64_t seed = 1;
  std::string data_path;  // empty: synthetic token stream
  host::AdamWConfig adamw;
  std::string report_path;       // run.json: losses, tokens_per_s, step_time_s
  std::string trace_path;        // Chrome trace of the last step (measured timeline)
  std::string save_path;         // checkpoint file written after the last step (and every save_every steps)
  int save_every = 0;            // 0: only after the last step
  std::string resume_path;       // checkpoint to continue from (any layout of the same model)
  std::string dump_params_path;  // final parameters in canonical layout (for equivalence tests)
  std::string calibrate_path;    // measured per-op times as a piper-calibration file (calibrate.hpp)
  double stall_timeout_s = 20;
  // A non-finite loss, gradient norm or updated state: stop with TrainingDiverged (false), or skip
  // the step (true: the state before it is kept, as Megatron skips an overflowed step) and go on.
  bool skip_nonfinite = false;
  bool print = true;
};

struct TrainResult {
  int first_step = 0;
  std::vector<double> losses;        // one per step run
  std::vector<int> skipped_steps;    // --on-nonfinite skip: the steps (1-based) whose update was dropped
  std::vector<double> step_times_s;  // one per step run (slowest rank)
  std::vector<double> grad_norms;    // clip_grad: each step's global gradient norm (before clipping)
  std::vector<double> loss_scales;   // loss scaling: the scale each step ran with
  double step_time_s = 0;            // mean over steps (slowest rank)
  double tokens_per_s = 0;
  // Executor accounting summed over steps on this rank (distributed runs only).
  double backend_s = 0, idle_s = 0, overhead_s = 0, total_s = 0;
  std::int64_t ops = 0;
};

// The same model on the same global batch (all microbatches of all data-parallel ranks), in one process.
TrainResult train_reference(const core::Program& program, const TrainOptions& options);
// Must run under MPI (MPI_Init done by the caller) with as many ranks as the Program has devices.
TrainResult train_distributed(const core::Program& program, const TrainOptions& options);
// Every device of the Program in this process, one thread each (virtual devices): the same backend,
// loop and results as train_distributed, over the loopback transport. Needs no MPI.
TrainResult train_virtual(const core::Program& program, const TrainOptions& options);

// ---- The training loop, one for every backend and rank group (train_distributed and train_virtual,
// the CUDA backend's MPI + NCCL and virtual-device runs) ----
// One rank's backend as the loop drives it.
class RankTrainee {
 public:
  virtual ~RankTrainee() = default;
  virtual Backend& backend() = 0;
  virtual double loss_sum() = 0;       // this rank's summed token losses of the last step
  virtual double grad_norm() = 0;      // clip_grad: the last step's global gradient norm (every rank's)
  virtual DataflowBase& flow() = 0;    // the shared dataflow: steps done, loss scale, overflow
  virtual bool state_is_finite() = 0;  // after the update (a backend that cannot tell: true)
  virtual void snapshot() = 0;         // --on-nonfinite skip: keep the state before a step...
  virtual void rollback() = 0;         // ...and restore it when the step diverged
  virtual std::vector<StateRecord> checkpoint_records() = 0;
  virtual const core::Model& model() = 0;
  virtual std::vector<host::ParamRecord> param_records() = 0;
  // The last step's measured timeline of this rank (calibration and trace).
  virtual core::DeviceTimeline measured(const StepMeasurement& m) = 0;
};
// What the loop writes that differs by backend.
struct RankLoopLabels {
  std::string device;                 // calibration's device name ("host-cpu", the GPU's name)
  nlohmann::json calibration_source;  // calibration's "measured" field
  std::function<void(const TrainResult&, int devices)> write_report;
};
// Runs steps first_step..o.steps-1 on every rank of `group` (collective; rank r is device r), then
// saves, dumps, traces, calibrates and reports (rank 0) as the options ask.
TrainResult train_ranks(const core::Program& program, const TrainOptions& o, RankTrainee& trainee, RankGroup& group,
                        int first_step, const RankLoopLabels& labels);
// The virtual-device run of any backend: `trainees[d]` is device d's backend, built (and resumed)
// by the caller before any device runs; `per_thread` runs first on each device's thread (the CUDA
// backend selects its GPU there). The ranks meet as threads (run_rank_threads); on_failure runs when
// a device fails, to release the others from their transport (LoopbackHub::abort).
TrainResult train_threads(const core::Program& program, const TrainOptions& o,
                          const std::vector<RankTrainee*>& trainees, int first_step, const RankLoopLabels& labels,
                          const std::function<void()>& per_thread = {}, const std::function<void()>& on_failure = {});

// Parameter dumps: one file with records (layer, offset, values) of the canonical parameter layout.
// Reads a dump into layer -> values (NaN where no record covered an element). The file is not
// trusted: a negative or oversized layer, offset or count, or a truncated record, throws
// std::invalid_argument naming the file, the record and its byte.
std::map<int, std::vector<float>> read_param_dump(const std::string& path);
// Largest |a - b| over all parameters; throws if a layer or element is missing from either.
double max_param_difference(const std::string& path_a, const std::string& path_b);

// What identifies a model for checkpoint compatibility: its spec only (never the layout), less its
// training shape; `with_training_shape`: the whole spec, as checkpoints written before the twelfth
// reliability probe hold it (still read).
std::string model_fingerprint(const core::Program& program, bool with_training_shape = false);

// ---- checkpoint steps shared by the host and CUDA trainers (the format is checkpoint.hpp's) ----
// The header of a checkpoint of `program` after `step` optimizer steps (with loss scaling, its state
// after that step).
CheckpointInfo checkpoint_info(const core::Program& program, int step, const host::AdamWConfig& adamw,
                               host::LossScaleState loss_scale = {});
// A resumed run's dataflow: the checkpoint's step count, and (dynamic loss scaling) its scaler state;
// a static scale, or a checkpoint without a state, starts from the run's own setting.
void resume_flow(DataflowBase& flow, const CheckpointInfo& info, const host::LossScaling& cfg);
// Loss scaling finds an overflow on any device before any update through the plan's gradient-norm
// all-reduce (clip_grad): a plan without one cannot skip an overflowed step everywhere. The one-line
// reason, or empty.
std::string loss_scaling_problem(const core::Program& program, const TrainOptions& o);
// run.json (--report): losses, step times, tokens/s, the optimizer settings and each step's learning
// rate, and (distributed runs) rank 0's executor accounting.
nlohmann::json report_json(const TrainResult& r, const TrainOptions& o, const std::string& mode, int devices);
// The optimizer settings as a checkpoint records them (CheckpointInfo::optimizer).
nlohmann::json optimizer_json(const host::AdamWConfig& adamw);
// Refuses a --save path that can never be written, before any step runs (std::invalid_argument).
void check_save_path(const std::string& path);
// The single-process runs' output checks, before any step: check_save_path, check_calibrate_path,
// and the --save file's lock (held while the returned value lives; null without --save).
std::unique_ptr<SaveLock> prepare_outputs(const TrainOptions& o);
// Refuses --steps below a resumed checkpoint's step (nothing could run; std::invalid_argument).
void check_steps_after_resume(const TrainOptions& o, int checkpoint_step);
// Refuses a resumed run whose learning-rate schedule (--lr, --min-lr, --warmup-steps, --lr-decay and,
// for a decay, --lr-decay-steps) is not the one its checkpoint records (CheckpointInfo::optimizer):
// the run would not continue the checkpoint's schedule, as Megatron-LM refuses it (std::invalid_argument).
void check_schedule_after_resume(const TrainOptions& o, const CheckpointInfo& info);
// The one-line message of a non-finite step (`what`: "loss nan", "gradient norm inf", ...), for
// TrainingDiverged.
std::string nonfinite_message(int step, const std::string& what);
// "nan", "inf" or "-inf" (fmt would print a NaN's sign bit: "-nan").
std::string nonfinite_value(double v);
// Whether every value this model updates is finite (ZeRO-3: the master chunk; parameters are
// poisoned outside gathers by design) and every second moment non-negative.
bool state_is_finite(host::HostModel& model);
// Whether the run saves after `done` steps: every --save-every steps, and after the last one.
bool saves_after(const TrainOptions& o, int done);
// Parses a checkpoint and checks that it fits `program`; std::invalid_argument naming `path` otherwise.
Checkpoint read_compatible_checkpoint(const std::string& path, const std::string& bytes, const core::Program& program);
// Rank 0 of MPI_COMM_WORLD reads the file and broadcasts it (ranks need not share a file system).
// Collective. On failure `error` is set (rank 0: the reason; others: "reported by rank 0").
std::string broadcast_checkpoint_bytes(const std::string& path, const core::Program& program, int rank,
                                       std::string& error);
// Every rank sends its records of the canonical state to rank 0, which assembles and writes the file
// atomically. Collective. A failed write stops every rank: std::invalid_argument on rank 0,
// ReportedByAnotherRank elsewhere.
void save_distributed(const TrainOptions& o, const core::Program& program, const std::vector<StateRecord>& records,
                      const core::Model& model, int step, RankGroup& group, host::LossScaleState loss_scale);
// Writes every device's measured timeline of one step (spans relative to the step start) as a
// Chrome trace (`--trace`), atomically.
void write_measured_trace(const std::string& path, const core::Program& program,
                          std::vector<core::DeviceTimeline> devices);

}  // namespace piper::runtime
