// Training drivers: the distributed run (Executor over the host backend, one MPI rank per device), the
// single-process reference, checkpoints (canonical layout, see checkpoint.cpp) and parameter dumps.
#include "piper/runtime/trainer.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include "piper/core/limits.hpp"
#include "piper/core/timeline.hpp"
#include "piper/runtime/calibrate.hpp"
#include "piper/runtime/checkpoint.hpp"
#include "piper/runtime/executor.hpp"
#include "piper/runtime/host_backend.hpp"
#include "byte_buffer.hpp"

namespace piper::runtime {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Byte buffers: the hardened reader shared with the other binary files (byte_buffer.hpp).
using bytes::get;
using bytes::get_floats;
using bytes::put;
using bytes::put_floats;

// Parameter dumps hold at most one checkpoint's worth of floats: bounded by Limit::CheckpointBytes.
std::string read_all(const std::string& path) {
  try {
    return core::read_input_file(path, core::Limit::CheckpointBytes);
  } catch (const core::Error& e) {
    throw std::invalid_argument(e.what());
  }
}

std::string serialize_records(const std::vector<host::ParamRecord>& records) {
  std::string out;
  for (const auto& r : records) {
    put(out, static_cast<std::int32_t>(r.layer));
    put(out, static_cast<std::int64_t>(r.offset));
    put(out, static_cast<std::int64_t>(r.values.size()));
    put_floats(out, r.values);
  }
  return out;
}

constexpr char kDumpMagic[8] = {'P', 'I', 'P', 'E', 'R', 'P', 'R', 'M'};

void write_dump(const std::string& path, const std::string& records) {
  core::write_file_atomically(path, std::string(kDumpMagic, 8) + records);
}

void write_report(const std::string& path, const TrainResult& r, const TrainOptions& o, const std::string& mode,
                  int devices) {
  core::write_file_atomically(path, report_json(r, o, mode, devices).dump(1) + "\n");
}

// What an update changes (--on-nonfinite skip): restored when a step turns out non-finite.
struct StateSnapshot {
  std::vector<std::array<std::vector<float>, 4>> segments;  // params, master, adam_m, adam_v
  void take(host::HostModel& m) {
    segments.resize(m.segments().size());
    for (std::size_t i = 0; i < segments.size(); ++i) {
      const auto& sp = m.segments()[i];
      segments[i] = {sp.params, sp.master, sp.adam_m, sp.adam_v};
    }
  }
  void restore(host::HostModel& m) const {
    for (std::size_t i = 0; i < segments.size(); ++i) {
      auto& sp = m.segments()[i];
      sp.params = segments[i][0], sp.master = segments[i][1], sp.adam_m = segments[i][2], sp.adam_v = segments[i][3];
      std::fill(sp.grads.begin(), sp.grads.end(), 0.0f);
      std::fill(sp.grad_chunk.begin(), sp.grad_chunk.end(), 0.0f);
      sp.grad_chunk_ready = false;
    }
  }
};

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

}  // namespace

std::string model_fingerprint(const core::Program& program, bool with_training_shape) {
  // The model alone (its spec): the layout (segments, sharding, ZeRO) may change between save and
  // resume, and the training shape is checked separately with its own message. The spec's "training"
  // holds that shape (sequence length, micro-batch size), so it is left out: with it, a resume under
  // another micro-batch size of the same global batch was refused ("their specs differ"), and a
  // resume under another sequence length did not say so.
  if (program.model_spec.is_null()) return fmt::format("{:016x}", fnv1a("name:" + program.model_name));
  json spec = program.model_spec;
  if (const auto t = spec.find("training"); !with_training_shape && t != spec.end() && t->is_object()) {
    t->erase("seq_len");
    t->erase("micro_batch_size");
  }
  return fmt::format("{:016x}", fnv1a(spec.dump()));
}

// ---------------------------------------------------------------------------------------------
// Checkpoints: what the host and CUDA trainers share (canonical layout, see checkpoint.hpp)
// ---------------------------------------------------------------------------------------------
namespace {
// A float as JSON shows it best: its shortest decimal form (3e-4, not 0.0003000000142492354).
double shortest(float f) { return std::stod(fmt::format("{}", f)); }
}  // namespace

json report_json(const TrainResult& r, const TrainOptions& o, const std::string& mode, int devices) {
  json j = {{"mode", mode},
            {"devices", devices},
            {"first_step", r.first_step},
            {"losses", r.losses},
            {"tokens_per_s", r.tokens_per_s},
            {"step_time_s", r.step_time_s},
            {"step_times_s", r.step_times_s},
            {"optimizer", optimizer_json(o.adamw)}};
  std::vector<double> lrs;
  for (int step = r.first_step; step < r.first_step + static_cast<int>(r.losses.size()); ++step)
    lrs.push_back(shortest(o.adamw.lr_at(step + 1)));
  j["lrs"] = lrs;
  if (!r.skipped_steps.empty()) j["skipped_steps"] = r.skipped_steps;  // --on-nonfinite skip
  if (!r.grad_norms.empty()) j["grad_norms"] = r.grad_norms;           // clip_grad
  if (!r.loss_scales.empty()) j["loss_scales"] = r.loss_scales;        // loss scaling
  if (mode != "reference")
    j["executor"] = {{"ops", r.ops},
                     {"backend_s", r.backend_s},
                     {"idle_s", r.idle_s},
                     {"overhead_s", r.overhead_s},
                     {"total_s", r.total_s}};
  return j;
}

json optimizer_json(const host::AdamWConfig& a) {
  json j = {{"name", "adamw"},
            {"lr", shortest(a.lr)},
            {"min_lr", shortest(a.min_lr)},
            {"warmup_steps", a.warmup_steps},
            {"lr_decay", host::lr_decay_name(a.decay)},
            {"lr_decay_steps", a.decay_steps},
            {"beta1", shortest(a.beta1)},
            {"beta2", shortest(a.beta2)},
            {"eps", shortest(a.eps)},
            {"weight_decay", shortest(a.weight_decay)}};
  const host::LossScaling& ls = a.loss_scaling;
  if (ls.mode == host::LossScaleMode::Static) j["loss_scaling"] = {{"mode", "static"}, {"scale", ls.initial}};
  if (ls.mode == host::LossScaleMode::Dynamic)
    j["loss_scaling"] = {
        {"mode", "dynamic"}, {"initial_scale", ls.initial}, {"window", ls.window}, {"min_scale", ls.min_scale}};
  return j;
}

CheckpointInfo checkpoint_info(const core::Program& program, int step, const host::AdamWConfig& adamw,
                               host::LossScaleState loss_scale) {
  const DataShape shape = data_shape(program);
  CheckpointInfo i;
  i.model_name = program.model_name;
  i.fingerprint = model_fingerprint(program);
  i.step = step;
  i.sequences_per_step = static_cast<std::int64_t>(shape.microbatches) * shape.ranks * shape.micro_batch_size;
  i.data_position = static_cast<std::int64_t>(step) * i.sequences_per_step;
  i.seq_len = shape.seq_len;
  i.saved_layout = layout_summary(program);
  i.optimizer = optimizer_json(adamw).dump();
  if (adamw.loss_scaling.mode != host::LossScaleMode::None) i.loss_scale = loss_scale;
  return i;
}

// A resumed run's scaler: a dynamic one continues from the checkpoint's state (when it has one); a
// static scale, or none, starts from the run's own setting.
static host::LossScaleState resumed_loss_scale(const host::LossScaling& cfg, const CheckpointInfo& info) {
  if (cfg.mode == host::LossScaleMode::Dynamic && info.loss_scale) return *info.loss_scale;
  return host::initial_loss_scale(cfg);
}

void resume_flow(DataflowBase& flow, const CheckpointInfo& info, const host::LossScaling& cfg) {
  flow.set_steps_done(info.step);
  flow.set_loss_scale_state(resumed_loss_scale(cfg, info));
}

std::string loss_scaling_problem(const core::Program& program, const TrainOptions& o) {
  if (o.adamw.loss_scaling.mode == host::LossScaleMode::None || program.clip_grad > 0) return "";
  return "--loss-scale needs the plan's gradient-norm all-reduce, through which every device learns of an overflow "
         "before any update: add --clip-grad (Megatron-LM's default is 1.0)";
}

void check_save_path(const std::string& path) {
  if (!path.empty() && fs::is_directory(path))
    throw std::invalid_argument(path + ": is a folder; --save takes a checkpoint file name");
}

void check_steps_after_resume(const TrainOptions& o, int checkpoint_step) {
  if (o.steps < checkpoint_step)
    throw std::invalid_argument(fmt::format(
        "--steps {} is below the step of the checkpoint {} ({}): nothing would run; give --steps {} or more", o.steps,
        o.resume_path, checkpoint_step, checkpoint_step));
  // --steps equal to the checkpoint's step runs nothing (a resave or a parameter dump); the outputs that
  // measure steps were taken and never written, exit 0 (a --report of no losses and 0 tokens/s).
  if (o.steps != checkpoint_step) return;
  const char* measuring = !o.calibrate_path.empty() ? "--calibrate"
                          : !o.trace_path.empty()   ? "--trace"
                          : !o.report_path.empty()  ? "--report"
                                                    : nullptr;
  if (measuring != nullptr)
    throw std::invalid_argument(fmt::format(
        "{}: --steps {} is the step of the checkpoint {}: no step would run to measure; give --steps {} or more",
        measuring, o.steps, o.resume_path, checkpoint_step + 1));
  // Else it is done already, as Megatron's run resumed at its train_iters: said, where it printed
  // nothing at all and exited 0.
  if (o.print)
    fmt::print("no step to run: the checkpoint {} is at step {} already (--steps {})\n", o.resume_path, checkpoint_step,
               o.steps);
}

void check_schedule_after_resume(const TrainOptions& o, const CheckpointInfo& info) {
  if (info.optimizer.empty()) return;  // a checkpoint of a piper that did not record it
  const json parsed = json::parse(info.optimizer, nullptr, false), now = optimizer_json(o.adamw);
  const json saved = parsed.is_object() ? parsed : json::object();  // a hand-made header: every key differs
  // The settings lr_at reads; --min-lr and --lr-decay-steps only where a decay reads them.
  std::vector<std::string> keys = {"lr", "warmup_steps", "lr_decay"};
  if (now.at("lr_decay") != "constant" || saved.value("lr_decay", "constant") != "constant")
    keys.insert(keys.end(), {"min_lr", "lr_decay_steps"});
  auto flags = [&](const json& j) {
    std::string out;
    for (const auto& k : keys) {
      std::string flag = k;
      std::replace(flag.begin(), flag.end(), '_', '-');
      out += fmt::format("{}--{} {}", out.empty() ? "" : " ", flag,
                         !j.contains(k)        ? std::string("?")
                         : j.at(k).is_number() ? fmt::format("{}", j.at(k).get<double>())
                         : j.at(k).is_string() ? j.at(k).get<std::string>()
                                               : j.at(k).dump());
    }
    return out;
  };
  for (const auto& k : keys)
    if (!saved.contains(k) || saved.at(k) != now.at(k))
      throw std::invalid_argument(fmt::format(
          "--resume {}: the checkpoint's learning-rate schedule is {}, this run's {}: the run would not continue it; "
          "give the checkpoint's settings (--lr-decay-steps defaults to --steps)",
          o.resume_path, flags(saved), flags(now)));
}

// A step skipped by loss scaling: what the printed line and nothing else says about it.
static std::string overflow_note(double scale) { return fmt::format("gradients overflowed at loss scale {}", scale); }

std::string nonfinite_value(double v) { return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"; }

std::string nonfinite_message(int step, const std::string& what) {
  return fmt::format(
      "step {}: {} (training diverged); stopped before saving (--on-nonfinite skip skips such steps instead)", step,
      what);
}

bool state_is_finite(host::HostModel& model) {
  auto finite = [](const std::vector<float>& v) {
    return std::all_of(v.begin(), v.end(), [](float x) { return std::isfinite(x); });
  };
  for (const auto& sp : model.segments()) {
    if (!finite(sp.zero_level >= 3 ? sp.master : sp.params) || !finite(sp.adam_m) || !finite(sp.adam_v)) return false;
    if (std::any_of(sp.adam_v.begin(), sp.adam_v.end(), [](float x) { return x < 0; })) return false;
  }
  return true;
}

bool saves_after(const TrainOptions& o, int done) {
  if (o.save_path.empty()) return false;
  return done == o.steps || (o.save_every > 0 && done % o.save_every == 0);
}

Checkpoint read_compatible_checkpoint(const std::string& path, const std::string& bytes, const core::Program& program) {
  Checkpoint ckpt = parse_checkpoint(path, bytes);
  check_compatible(path, ckpt, program);
  return ckpt;
}

std::string broadcast_checkpoint_bytes(const std::string& path, const core::Program& program, int rank,
                                       std::string& error) {
  std::string bytes;
  long long length = -1;
  if (rank == 0) {
    try {
      bytes = read_checkpoint_bytes(path, program);
      length = static_cast<long long>(bytes.size());
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  MPI_Bcast(&length, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  if (length >= 0) {
    bytes.resize(static_cast<std::size_t>(length));
    MPI_Bcast(bytes.data(), static_cast<int>(length), MPI_BYTE, 0, MPI_COMM_WORLD);
  } else if (rank != 0) {
    error = "reported by rank 0";
  }
  return bytes;
}

void save_distributed(const TrainOptions& o, const core::Program& program, const std::vector<StateRecord>& records,
                      const core::Model& model, int step, RankGroup& group, host::LossScaleState loss_scale) {
  const int rank = group.rank();
  const std::string all = group.gather(serialize_state_records(records)).all;
  std::string error;
  if (rank == 0) {
    try {
      write_checkpoint(o.save_path, checkpoint_info(program, step, o.adamw, loss_scale),
                       assemble_state(model, parse_state_records(all)));
      if (o.print) fmt::print("checkpoint after step {} -> {}\n", step, o.save_path);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (group.broadcast(error.empty() ? 0 : 1) != 0) {
    if (rank == 0) throw std::invalid_argument(error);
    throw ReportedByAnotherRank();
  }
}

// Loads a checkpoint into `model` (all checks first); returns the step to continue from.
static CheckpointInfo resume_from(const std::string& path, const std::string& bytes, const core::Program& program,
                                  host::HostModel& model) {
  const Checkpoint ckpt = read_compatible_checkpoint(path, bytes, program);
  load_state(model, ckpt.state);
  return ckpt.info;
}

// ---------------------------------------------------------------------------------------------
// Reference
// ---------------------------------------------------------------------------------------------
TrainResult train_reference(const core::Program& program, const TrainOptions& o) {
  const core::Model model = program_model(program);
  const DataShape shape = data_shape(program);
  host::SegmentSpec all;
  all.segment = 0;
  all.first_layer = 0;
  all.last_layer = static_cast<int>(model.layers().size());
  host::HostModel m(model, {all}, o.seed);
  host::TokenStream stream(model.config() ? model.config()->vocab : 0, shape.seq_len, o.seed, o.data_path);
  TrainResult r;
  if (const std::string why = loss_scaling_problem(program, o); !why.empty()) throw std::invalid_argument(why);
  const auto lock = prepare_outputs(o);
  const host::LossScaling& scaling = o.adamw.loss_scaling;
  host::LossScaleState scaler = host::initial_loss_scale(scaling);
  if (!o.resume_path.empty()) {
    const CheckpointInfo info = resume_from(o.resume_path, read_checkpoint_bytes(o.resume_path, program), program, m);
    r.first_step = info.step;
    scaler = resumed_loss_scale(scaling, info);
    check_steps_after_resume(o, r.first_step);
    check_schedule_after_resume(o, info);
  }
  double total_s = 0;
  StateSnapshot before;
  for (int step = r.first_step; step < o.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const float scale = host::scaled_loss_gradient(scaler.scale, shape.global_tokens());
    double loss = 0;
    for (int mb = 0; mb < shape.microbatches; ++mb)
      for (int rank = 0; rank < shape.ranks; ++rank) {
        const auto data = stream.microbatch(step, mb, rank, shape.microbatches, shape.ranks, shape.micro_batch_size);
        host::ForwardState s;
        host::SegmentStash stash;
        loss += m.forward(0, data, scale, s, stash);
        host::BackwardState g;
        m.backward_input(0, g, stash);
        m.backward_weight(0, stash);
      }
    // Non-finite loss or gradient norm: checked before the update (which would spread it into the
    // state); a finite gradient can still give a non-finite update (a zero --adam-eps: 0/0).
    double grad_sq = 0;  // of the unscaled gradients (over a power of two: exact)
    for (const auto& sp : m.segments())
      for (float g : sp.grads) {
        const double u = static_cast<double>(g) / scaler.scale;
        grad_sq += u * u;
      }
    const double mean_loss = loss / static_cast<double>(shape.global_tokens());
    // Loss scaling: a non-finite norm is an overflow of the scaled gradients; the update is skipped.
    const bool overflow = scaling.mode != host::LossScaleMode::None && !std::isfinite(grad_sq);
    std::string bad;
    if (!std::isfinite(mean_loss))
      bad = "loss " + nonfinite_value(mean_loss);
    else if (!std::isfinite(grad_sq) && !overflow)
      bad = "gradient norm " + nonfinite_value(grad_sq);
    if (bad.empty() && overflow) {
      m.discard_grads(0);
    } else if (bad.empty()) {
      if (o.skip_nonfinite) before.take(m);
      host::AdamWConfig cfg = o.adamw.at(step + 1);
      cfg.grad_scale = unscale_and_clip(grad_sq, program.clip_grad, scaler.scale);  // one model: its norm
      m.update(0, cfg, step + 1);
      if (!state_is_finite(m)) bad = "the update made parameters or AdamW moments non-finite";
    }
    if (!bad.empty()) {
      if (!o.skip_nonfinite) throw TrainingDiverged(nonfinite_message(step + 1, bad));
      if (before.segments.empty()) before.take(m);  // nothing was updated: the current state is the one to keep
      before.restore(m);
    }
    before.segments.clear();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    total_s += dt;
    r.step_times_s.push_back(dt);
    r.losses.push_back(mean_loss);
    if (program.clip_grad > 0) r.grad_norms.push_back(std::sqrt(grad_sq));
    if (overflow) bad = overflow_note(scaler.scale);
    if (!bad.empty()) r.skipped_steps.push_back(step + 1);
    if (scaling.mode != host::LossScaleMode::None) r.loss_scales.push_back(scaler.scale);
    scaler = host::next_loss_scale(scaling, scaler, overflow);
    if (o.print)
      fmt::print("step {:>4}  loss {:.6f}  ({:.1f} ms){}\n", step + 1, r.losses.back(), dt * 1e3,
                 bad.empty() ? "" : "  skipped: " + bad);
    if (saves_after(o, step + 1)) {
      write_checkpoint(o.save_path, checkpoint_info(program, step + 1, o.adamw, scaler),
                       assemble_state(m.model(), state_records(m)));
      if (o.print) fmt::print("checkpoint after step {} -> {}\n", step + 1, o.save_path);
    }
  }
  const int ran = o.steps - r.first_step;
  r.step_time_s = ran > 0 ? total_s / ran : 0;
  r.tokens_per_s = r.step_time_s > 0 ? static_cast<double>(shape.global_tokens()) / r.step_time_s : 0;
  if (!o.save_path.empty() && ran <= 0)
    write_checkpoint(o.save_path, checkpoint_info(program, r.first_step, o.adamw, scaler),
                     assemble_state(m.model(), state_records(m)));
  if (!o.dump_params_path.empty()) write_dump(o.dump_params_path, serialize_records(m.param_records()));
  if (!o.report_path.empty()) write_report(o.report_path, r, o, "reference", 1);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Distributed
// ---------------------------------------------------------------------------------------------
namespace {

// The host backend as the training loop drives it.
class HostTrainee : public RankTrainee {
 public:
  explicit HostTrainee(HostBackend& b) : b_(b) {}
  Backend& backend() override { return b_; }
  double loss_sum() override { return b_.loss_sum(); }
  double grad_norm() override { return b_.grad_norm(); }
  DataflowBase& flow() override { return b_.flow(); }
  bool state_is_finite() override { return runtime::state_is_finite(b_.model()); }
  void snapshot() override { before_.take(b_.model()); }
  void rollback() override { before_.restore(b_.model()); }
  std::vector<StateRecord> checkpoint_records() override { return state_records(b_.model()); }
  const core::Model& model() override { return b_.model().model(); }
  std::vector<host::ParamRecord> param_records() override { return b_.model().param_records(); }
  core::DeviceTimeline measured(const StepMeasurement& m) override { return m.timeline; }

 private:
  HostBackend& b_;
  StateSnapshot before_;
};

}  // namespace

TrainResult train_distributed(const core::Program& program, const TrainOptions& o) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  if (size != program.num_devices) {
    if (rank != 0) throw ReportedByAnotherRank();
    throw std::invalid_argument(fmt::format("the plan has {} devices but {} MPI ranks were started (mpirun -np {})",
                                            program.num_devices, size, program.num_devices));
  }
  // Setup errors (model, data, checkpoint) are the same on every rank or local to one: the lowest
  // failing rank reports, every rank stops before the first step.
  std::unique_ptr<HostBackend> backend;
  std::string error;
  TrainResult r;
  // Rank 0 reads the checkpoint and sends it to every rank (ranks need not share a file system).
  std::string checkpoint;
  std::optional<SaveLock> lock;  // rank 0 writes the checkpoint, so rank 0 holds the lock
  if (rank == 0 && !o.save_path.empty()) {
    try {
      lock.emplace(o.save_path);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Every rank learns of it before the backend's collective setup (communicator splits).
  int locked_out = error.empty() ? 0 : 1;
  MPI_Bcast(&locked_out, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (locked_out && rank != 0) error = "reported by rank 0";
  if (!o.resume_path.empty() && !locked_out)
    checkpoint = broadcast_checkpoint_bytes(o.resume_path, program, rank, error);
  try {
    check_save_path(o.save_path);
    check_calibrate_path(o.calibrate_path);
    if (const std::string why = loss_scaling_problem(program, o); !why.empty()) throw std::invalid_argument(why);
    HostConfig cfg{o.seed, o.data_path, o.adamw, o.stall_timeout_s};
    if (error.empty()) backend = std::make_unique<HostBackend>(program, rank, MPI_COMM_WORLD, cfg);
    if (error.empty() && !o.resume_path.empty()) {
      const CheckpointInfo info = resume_from(o.resume_path, checkpoint, program, backend->model());
      r.first_step = info.step;
      resume_flow(backend->flow(), info, o.adamw.loss_scaling);
      check_steps_after_resume(o, r.first_step);
      check_schedule_after_resume(o, info);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  int first_failing = error.empty() ? size : rank;
  MPI_Allreduce(MPI_IN_PLACE, &first_failing, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (first_failing < size) {
    if (rank == first_failing) throw std::invalid_argument(error);
    throw ReportedByAnotherRank();
  }
  int steps_agree[2] = {r.first_step, -r.first_step};
  MPI_Allreduce(MPI_IN_PLACE, steps_agree, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (steps_agree[0] != -steps_agree[1]) {
    if (rank != 0) throw ReportedByAnotherRank();
    throw std::invalid_argument(o.resume_path + ": ranks read different steps from the checkpoint");
  }
  HostTrainee trainee(*backend);
  const RankLoopLabels labels{
      "host-cpu",
      {{"backend", "host"}, {"clock", "executor (host steady clock, op start to completion)"}},
      [&](const TrainResult& result, int devices) { write_report(o.report_path, result, o, "distributed", devices); }};
  const auto world = mpi_world_group();
  return train_ranks(program, o, trainee, *world, r.first_step, labels);
}

std::unique_ptr<SaveLock> prepare_outputs(const TrainOptions& o) {
  check_save_path(o.save_path);
  check_calibrate_path(o.calibrate_path);
  return o.save_path.empty() ? nullptr : std::make_unique<SaveLock>(o.save_path);
}

TrainResult train_virtual(const core::Program& program, const TrainOptions& o) {
  if (const std::string why = loss_scaling_problem(program, o); !why.empty()) throw std::invalid_argument(why);
  const auto lock = prepare_outputs(o);
  const HostConfig cfg{o.seed, o.data_path, o.adamw, o.stall_timeout_s};
  HostThreads threads(program, o.stall_timeout_s);
  // Built in this thread, before any device runs: a setup error stops the run before the first step.
  std::vector<std::unique_ptr<HostBackend>> backends;
  std::vector<std::unique_ptr<HostTrainee>> trainees;
  std::vector<RankTrainee*> ranks;
  for (int d = 0; d < program.num_devices; ++d) {
    backends.push_back(std::make_unique<HostBackend>(program, d, threads, cfg));
    trainees.push_back(std::make_unique<HostTrainee>(*backends.back()));
    ranks.push_back(trainees.back().get());
  }
  int first_step = 0;
  if (!o.resume_path.empty()) {  // read and checked once, loaded into every device's part
    const Checkpoint ckpt =
        read_compatible_checkpoint(o.resume_path, read_checkpoint_bytes(o.resume_path, program), program);
    check_steps_after_resume(o, ckpt.info.step);
    check_schedule_after_resume(o, ckpt.info);
    first_step = ckpt.info.step;
    for (auto& b : backends)
      load_state(b->model(), ckpt.state), resume_flow(b->flow(), ckpt.info, o.adamw.loss_scaling);
  }
  const RankLoopLabels labels{
      "host-cpu",
      {{"backend", "host"},
       {"mode", "virtual devices"},
       {"clock", "executor (host steady clock, op start to completion)"}},
      [&](const TrainResult& result, int devices) { write_report(o.report_path, result, o, "virtual", devices); }};
  return train_threads(program, o, ranks, first_step, labels, {}, [&threads] { threads.abort(); });
}

TrainResult train_threads(const core::Program& program, const TrainOptions& o,
                          const std::vector<RankTrainee*>& trainees, int first_step, const RankLoopLabels& labels,
                          const std::function<void()>& per_thread, const std::function<void()>& on_failure) {
  TrainResult result;
  run_rank_threads(
      static_cast<int>(trainees.size()),
      [&](RankGroup& group) {
        if (per_thread) per_thread();
        TrainResult r =
            train_ranks(program, o, *trainees.at(static_cast<std::size_t>(group.rank())), group, first_step, labels);
        if (group.rank() == 0) result = std::move(r);
      },
      on_failure);
  return result;
}

// ---------------------------------------------------------------------------------------------
// The training loop over MPI ranks (every backend)
// ---------------------------------------------------------------------------------------------
namespace {

// The last step's measured timeline of every rank, gathered on rank 0 (collective): spans as
// (stream, index, start, end), then memory samples as (time, bytes).
std::vector<core::DeviceTimeline> gather_timelines(const core::DeviceTimeline& timeline, RankGroup& group) {
  std::vector<double> mine;
  mine.push_back(static_cast<double>(timeline.spans.size()));
  for (const auto& s : timeline.spans)
    mine.insert(mine.end(), {static_cast<double>(s.stream), static_cast<double>(s.index), s.start_s, s.end_s});
  for (const auto& m : timeline.memory) mine.insert(mine.end(), {m.time_s, static_cast<double>(m.bytes)});
  const auto [all, offsets, sizes] = group.gather(mine);
  std::vector<core::DeviceTimeline> devices;
  if (group.rank() != 0) return devices;
  for (int d = 0; d < group.size(); ++d) {
    std::size_t at = static_cast<std::size_t>(offsets[static_cast<std::size_t>(d)]);
    const std::size_t end = at + static_cast<std::size_t>(sizes[static_cast<std::size_t>(d)]);
    core::DeviceTimeline dt;
    const auto spans = static_cast<std::size_t>(all[at++]);
    for (std::size_t i = 0; i < spans; ++i, at += 4)
      dt.spans.push_back(
          {static_cast<std::int32_t>(all[at]), static_cast<std::int32_t>(all[at + 1]), all[at + 2], all[at + 3]});
    for (; at + 1 < end; at += 2) {
      dt.memory.push_back({all[at], static_cast<std::int64_t>(all[at + 1])});
      if (dt.memory.back().bytes > dt.peak_memory_bytes)
        dt.peak_memory_bytes = dt.memory.back().bytes, dt.peak_memory_time_s = all[at];
    }
    devices.push_back(std::move(dt));
  }
  return devices;
}

}  // namespace

void write_measured_trace(const std::string& path, const core::Program& program,
                          std::vector<core::DeviceTimeline> devices) {
  core::Timeline t;
  t.source = "measured";
  t.program = std::make_shared<const core::Program>(program);
  for (auto& dt : devices) {
    for (const auto& s : dt.spans) t.step_time_s = std::max(t.step_time_s, s.end_s);
    t.devices.push_back(std::move(dt));
  }
  std::ostringstream out;
  core::write_chrome_trace(t, out);
  core::write_file_atomically(path, out.str());
}

TrainResult train_ranks(const core::Program& program, const TrainOptions& o, RankTrainee& trainee, RankGroup& group,
                        int first_step, const RankLoopLabels& labels) {
  const int rank = group.rank(), size = group.size();
  TrainResult r;
  r.first_step = first_step;
  const DataShape shape = data_shape(program);
  Executor executor(program.plan_for(rank), trainee.backend(), ExecutorOptions{o.stall_timeout_s});
  StepMeasurement last;
  std::vector<core::DeviceTimeline> calibration_steps;  // --calibrate: this rank's kept steps
  double total_step_s = 0;
  for (int step = r.first_step; step < o.steps; ++step) {
    if (o.skip_nonfinite) trainee.snapshot();  // the state before the step, restored if it diverged
    group.barrier();                           // align step starts so the timeline's devices share a time origin
    const double loss_scale = trainee.flow().loss_scale_state().scale;  // this step's (end_step moves it)
    last = executor.run_step(step);
    if (!o.calibrate_path.empty() && calibration_uses_step(step - r.first_step, o.steps - r.first_step))
      calibration_steps.push_back(trainee.measured(last));
    // The update ran inside the step, so divergence shows as a non-finite loss or a non-finite
    // updated state (a non-finite gradient makes its AdamW update NaN) on some rank: all ranks agree.
    std::vector<double> sums = {trainee.loss_sum(), trainee.state_is_finite() ? 0.0 : 1.0};
    std::vector<double> slowest = {last.step_seconds};
    group.sum(sums);
    group.max(slowest);
    const double step_s = slowest[0];
    const double mean_loss = sums[0] / static_cast<double>(shape.global_tokens());
    std::string bad;
    if (!std::isfinite(mean_loss))
      bad = "loss " + nonfinite_value(mean_loss);
    else if (sums[1] != 0)
      bad = "the update made parameters or AdamW moments non-finite";
    if (!bad.empty()) {
      if (!o.skip_nonfinite) {
        if (rank != 0) throw ReportedByAnotherRank();
        throw TrainingDiverged(nonfinite_message(step + 1, bad));
      }
      trainee.rollback();
      r.skipped_steps.push_back(step + 1);
    } else if (trainee.flow().overflowed()) {  // loss scaling: every device skipped the update
      bad = overflow_note(loss_scale);
      r.skipped_steps.push_back(step + 1);
    }
    r.losses.push_back(mean_loss);
    if (program.clip_grad > 0) r.grad_norms.push_back(trainee.grad_norm());
    if (o.adamw.loss_scaling.mode != host::LossScaleMode::None) r.loss_scales.push_back(loss_scale);
    r.step_times_s.push_back(step_s);
    total_step_s += step_s;
    r.backend_s += last.backend_seconds;
    r.idle_s += last.idle_seconds;
    r.overhead_s += last.overhead_seconds;
    r.total_s += last.step_seconds;
    r.ops += last.ops;
    if (o.print && rank == 0)
      fmt::print("step {:>4}  loss {:.6f}  ({:.1f} ms){}\n", step + 1, r.losses.back(), step_s * 1e3,
                 bad.empty() ? "" : "  skipped: " + bad);
    if (saves_after(o, step + 1))
      save_distributed(o, program, trainee.checkpoint_records(), trainee.model(), step + 1, group,
                       trainee.flow().loss_scale_state());
  }
  const int ran = o.steps - r.first_step;
  r.step_time_s = ran > 0 ? total_step_s / ran : 0;
  r.tokens_per_s = r.step_time_s > 0 ? static_cast<double>(shape.global_tokens()) / r.step_time_s : 0;

  if (!o.save_path.empty() && ran <= 0)
    save_distributed(o, program, trainee.checkpoint_records(), trainee.model(), r.first_step, group,
                     trainee.flow().loss_scale_state());
  if (!o.dump_params_path.empty()) {
    const std::string mine = serialize_records(trainee.param_records());
    if (const auto g = group.gather(mine); rank == 0) write_dump(o.dump_params_path, g.all);
  }
  if (!o.trace_path.empty() && ran > 0) {
    auto devices = gather_timelines(trainee.measured(last), group);
    if (rank == 0) write_measured_trace(o.trace_path, program, std::move(devices));
  }
  if (!o.calibrate_path.empty() && ran > 0) {
    write_calibration_distributed(o.calibrate_path, program, calibration_steps, labels.device,
                                  labels.calibration_source, group);
    if (o.print && rank == 0) fmt::print("calibration ({} steps) -> {}\n", calibration_steps.size(), o.calibrate_path);
  }
  if (rank == 0 && !o.report_path.empty()) labels.write_report(r, size);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Parameter dumps
// ---------------------------------------------------------------------------------------------
// The file is untrusted (any path the user names): every field is checked before it sizes or
// indexes anything, and a bad one is refused in one line naming the file, record and byte.
std::map<int, std::vector<float>> read_param_dump(const std::string& path) {
  const std::string data = read_all(path);
  if (data.size() < 8 || std::memcmp(data.data(), kDumpMagic, 8) != 0)
    throw std::invalid_argument(path + ": not a parameter dump");
  // Every element of a layer is in some record, so no layer ends past the floats the file holds.
  const auto file_floats = static_cast<std::int64_t>((data.size() - 8) / sizeof(float));
  std::map<int, std::vector<float>> out;
  std::size_t pos = 8;
  std::vector<float> values;
  for (int record = 0; pos < data.size(); ++record) {
    const std::size_t start = pos;
    auto bad = [&](const std::string& why) {
      return std::invalid_argument(
          fmt::format("{}: damaged parameter dump: record {} (byte {}): {}", path, record, start, why));
    };
    constexpr std::size_t kHeader = sizeof(std::int32_t) + 2 * sizeof(std::int64_t);
    if (data.size() - pos < kHeader) throw bad("truncated header");
    const auto layer = get<std::int32_t>(data, pos);
    const auto offset = get<std::int64_t>(data, pos);
    const auto count = get<std::int64_t>(data, pos);
    if (layer < 0) throw bad(fmt::format("negative layer {}", layer));
    if (offset < 0) throw bad(fmt::format("negative offset {}", offset));
    if (count < 0) throw bad(fmt::format("negative count {}", count));
    if (count > static_cast<std::int64_t>((data.size() - pos) / sizeof(float)))
      throw bad(fmt::format("{} floats announced, {} bytes left", count, data.size() - pos));
    if (offset > file_floats - count)
      throw bad(fmt::format("offset {} + count {} runs past the {} floats the file holds", offset, count, file_floats));
    get_floats(data, pos, values, static_cast<std::size_t>(count));
    auto& v = out[layer];
    if (static_cast<std::int64_t>(v.size()) < offset + count)
      v.resize(static_cast<std::size_t>(offset + count), std::numeric_limits<float>::quiet_NaN());
    std::copy(values.begin(), values.end(), v.begin() + offset);
  }
  return out;
}

double max_param_difference(const std::string& path_a, const std::string& path_b) {
  const auto a = read_param_dump(path_a), b = read_param_dump(path_b);
  if (a.size() != b.size()) throw std::runtime_error(fmt::format("dumps hold {} and {} layers", a.size(), b.size()));
  double worst = 0;
  for (const auto& [layer, va] : a) {
    auto it = b.find(layer);
    if (it == b.end() || it->second.size() != va.size())
      throw std::runtime_error(fmt::format("layer {} differs in size between the dumps", layer));
    for (std::size_t i = 0; i < va.size(); ++i) {
      if (std::isnan(va[i]) || std::isnan(it->second[i]))
        throw std::runtime_error(fmt::format("layer {} element {} is missing or NaN", layer, i));
      worst = std::max(worst, static_cast<double>(std::abs(va[i] - it->second[i])));
    }
  }
  return worst;
}

}  // namespace piper::runtime
