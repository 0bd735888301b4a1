// The CUDA training driver: virtual devices (threads over the loopback transport) or MPI + NCCL ranks;
// losses, report, parameter dump (the format of trainer.cpp, read by read_param_dump), trace,
// checkpoints (the host's canonical files and code) and --calibrate.
#include "piper/runtime/cuda/cuda_trainer.hpp"

#include <barrier>
#include <cmath>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include "piper/core/timeline.hpp"
#include "piper/runtime/calibrate.hpp"
#include "piper/runtime/checkpoint.hpp"
#include "piper/runtime/cuda/cuda_backend.hpp"
#include "piper/runtime/cuda/sm_partition.hpp"
#include "piper/runtime/executor.hpp"
#include "piper/runtime/mpi_gather.hpp"

namespace piper::runtime::cuda {

namespace {

// Same byte format as trainer.cpp's parameter dumps (magic, then (layer, offset, count, floats)).
std::string serialize_records(const std::vector<host::ParamRecord>& records) {
  std::string out;
  auto put = [&](const auto& v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  for (const auto& r : records) {
    put(static_cast<std::int32_t>(r.layer));
    put(static_cast<std::int64_t>(r.offset));
    put(static_cast<std::int64_t>(r.values.size()));
    out.append(reinterpret_cast<const char*>(r.values.data()), r.values.size() * sizeof(float));
  }
  return out;
}

void write_dump(const std::string& path, const std::string& records) {
  core::write_file_atomically(path, std::string("PIPERPRM") + records);
}

void write_report(const std::string& path, const TrainResult& r, const std::string& mode, int devices,
                  const std::string& precision) {
  nlohmann::json j = {{"mode", mode},
                      {"backend", "cuda"},
                      {"precision", precision},
                      {"devices", devices},
                      {"first_step", r.first_step},
                      {"losses", r.losses},
                      {"tokens_per_s", r.tokens_per_s},
                      {"step_time_s", r.step_time_s},
                      {"step_times_s", r.step_times_s}};
  j["executor"] = {{"ops", r.ops},
                   {"backend_s", r.backend_s},
                   {"idle_s", r.idle_s},
                   {"overhead_s", r.overhead_s},
                   {"total_s", r.total_s}};
  core::write_file_atomically(path, j.dump(1) + "\n");
}

// The GPU spans with the executor's memory samples (host-observed buffer lifetimes).
core::DeviceTimeline merged(const CudaBackend& b, const StepMeasurement& m) {
  core::DeviceTimeline d = b.gpu_timeline();
  d.memory = m.timeline.memory;
  d.peak_memory_bytes = m.timeline.peak_memory_bytes;
  d.peak_memory_time_s = m.timeline.peak_memory_time_s;
  return d;
}

CudaConfig config_of(const TrainOptions& o, const CudaRunOptions& c, std::shared_ptr<const SmPartitioner> sm) {
  return CudaConfig{o.seed, o.data_path, o.adamw, c.dtype, std::move(sm)};
}

std::string gpu_name() {
  int device = 0;
  cudaDeviceProp p{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&p, device) != cudaSuccess) return "GPU";
  return p.name;
}

nlohmann::json calibration_source(const std::string& mode) {
  return {{"backend", "cuda"},
          {"mode", mode},
          {"clock", "CUDA events around each op's work (communication: until its data is unpacked)"}};
}

// The CUDA backend as the shared training loop drives it. The GPU state is not checked for
// non-finite values (the loss is) and --on-nonfinite skip is refused before the run.
class CudaTrainee : public RankTrainee {
 public:
  explicit CudaTrainee(CudaBackend& b) : b_(b) {}
  Backend& backend() override { return b_; }
  double loss_sum() override { return b_.loss_sum(); }
  bool state_is_finite() override { return true; }
  void snapshot() override { throw std::logic_error("the CUDA backend does not skip non-finite steps"); }
  void rollback() override { snapshot(); }
  std::vector<StateRecord> checkpoint_records() override { return b_.checkpoint_records(); }
  const core::Model& model() override { return b_.model(); }
  std::vector<host::ParamRecord> param_records() override { return b_.param_records(); }
  core::DeviceTimeline measured(const StepMeasurement& m) override { return merged(b_, m); }

 private:
  CudaBackend& b_;
};

TrainResult train_virtual(const core::Program& program, const TrainOptions& o, const CudaRunOptions& c) {
  const int n = program.num_devices;
  check(cudaSetDevice(0), "cudaSetDevice");
  check_save_path(o.save_path);
  check_calibrate_path(o.calibrate_path);
  std::optional<SaveLock> lock;
  if (!o.save_path.empty()) lock.emplace(o.save_path);
  // One partition for the GPU that every virtual device shares.
  const auto sm = SmPartitioner::create(program.sm_partition);
  if (o.print && program.sm_partition) fmt::print("sm_partition: {}\n", sm->describe());
  LoopbackHub hub(n);
  std::vector<std::unique_ptr<LoopbackTransport>> transports;
  std::vector<std::unique_ptr<CudaBackend>> backends;
  // Built in this thread, before any device runs: a setup error stops the run before the first step.
  for (int d = 0; d < n; ++d) {
    transports.push_back(std::make_unique<LoopbackTransport>(hub, d));
    backends.push_back(std::make_unique<CudaBackend>(program, d, *transports.back(), config_of(o, c, sm)));
  }
  const DataShape shape = data_shape(program);
  TrainResult r;
  if (!o.resume_path.empty()) {
    const Checkpoint ckpt =
        read_compatible_checkpoint(o.resume_path, read_checkpoint_bytes(o.resume_path, program), program);
    check_steps_after_resume(o, ckpt.info.step);
    for (auto& b : backends) b->restore(ckpt.state), b->set_steps_done(ckpt.info.step);
    r.first_step = ckpt.info.step;
  }
  // Every device's records, assembled and written atomically (checkpoint.hpp).
  auto save = [&](int step) {
    std::vector<StateRecord> records;
    for (auto& b : backends) {
      auto mine = b->checkpoint_records();
      records.insert(records.end(), std::make_move_iterator(mine.begin()), std::make_move_iterator(mine.end()));
    }
    write_checkpoint(o.save_path, checkpoint_info(program, step), assemble_state(backends.front()->model(), records));
    if (o.print) fmt::print("checkpoint after step {} -> {}\n", step, o.save_path);
  };
  const int ran = o.steps - r.first_step;
  std::vector<std::vector<core::DeviceTimeline>> calibration(static_cast<std::size_t>(n));  // per device, kept steps
  std::string save_error, diverged;
  bool stop = false;
  std::vector<double> loss(static_cast<std::size_t>(n)), step_s(static_cast<std::size_t>(n));
  std::vector<StepMeasurement> last(static_cast<std::size_t>(n));
  double total_step_s = 0;
  int step_now = r.first_step;
  auto on_step = [&]() noexcept {
    double sum = 0, slowest = 0;
    for (int d = 0; d < n; ++d)
      sum += loss[static_cast<std::size_t>(d)], slowest = std::max(slowest, step_s[static_cast<std::size_t>(d)]);
    r.losses.push_back(sum / static_cast<double>(shape.global_tokens()));
    r.step_times_s.push_back(slowest);
    total_step_s += slowest;
    for (const auto& m : last)
      r.backend_s += m.backend_seconds, r.idle_s += m.idle_seconds, r.overhead_s += m.overhead_seconds, r.ops += m.ops;
    r.total_s += slowest;
    if (o.print) fmt::print("step {:>4}  loss {:.6f}  ({:.1f} ms)\n", step_now + 1, r.losses.back(), slowest * 1e3);
    ++step_now;
    // --on-nonfinite stop (the only mode here): a non-finite loss ends the run before any save.
    if (!std::isfinite(r.losses.back())) {
      diverged = nonfinite_message(step_now, "loss " + nonfinite_value(r.losses.back()));
      stop = true;
      return;
    }
    // Every device finished the step (its ops completed on the GPU): the state is final.
    if (saves_after(o, step_now)) {
      try {
        save(step_now);
      } catch (const std::exception& e) {
        save_error = e.what();
        stop = true;
      }
    }
  };
  std::barrier sync(n, on_step);
  std::mutex error_mutex;
  std::string error;
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d)
    threads.emplace_back([&, d] {
      const auto i = static_cast<std::size_t>(d);
      try {
        check(cudaSetDevice(0), "cudaSetDevice");
        Executor executor(program.plan_for(d), *backends[i], ExecutorOptions{o.stall_timeout_s});
        for (int step = r.first_step; step < o.steps; ++step) {
          last[i] = executor.run_step(step);
          loss[i] = backends[i]->loss_sum();
          step_s[i] = last[i].step_seconds;
          if (!o.calibrate_path.empty() && calibration_uses_step(step - r.first_step, ran))
            calibration[i].push_back(backends[i]->gpu_timeline());
          sync.arrive_and_wait();
          if (stop) break;  // set by the completion step when a checkpoint could not be written
        }
      } catch (const std::exception& e) {
        {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (error.empty()) error = fmt::format("virtual device {}: {}", d, e.what());
        }
        sync.arrive_and_drop();  // the others stall on this device's missing ops and stop at their timeout
      }
    });
  for (auto& t : threads) t.join();
  if (!error.empty()) throw RuntimeError(error);
  if (!diverged.empty()) throw TrainingDiverged(diverged);
  if (!save_error.empty()) throw std::invalid_argument(save_error);
  if (!o.save_path.empty() && ran <= 0) save(r.first_step);
  if (!o.calibrate_path.empty() && ran > 0) {
    CalibrationRecorder recorder(program);
    for (std::size_t k = 0; k < calibration.front().size(); ++k) {
      std::vector<core::DeviceTimeline> devices;
      for (auto& per_device : calibration) devices.push_back(per_device.at(k));
      recorder.add_step(devices);
    }
    core::write_file_atomically(o.calibrate_path,
                                recorder.to_json(gpu_name(), calibration_source("virtual devices")).dump(1) + "\n");
    if (o.print) fmt::print("calibration ({} steps) -> {}\n", recorder.steps(), o.calibrate_path);
  }
  r.step_time_s = ran > 0 ? total_step_s / ran : 0;
  r.tokens_per_s = r.step_time_s > 0 ? static_cast<double>(shape.global_tokens()) / r.step_time_s : 0;
  if (!o.dump_params_path.empty()) {
    std::string all;
    for (auto& b : backends) all += serialize_records(b->param_records());
    write_dump(o.dump_params_path, all);
  }
  if (!o.trace_path.empty() && ran > 0) {
    std::vector<core::DeviceTimeline> devices;
    for (int d = 0; d < n; ++d)
      devices.push_back(merged(*backends[static_cast<std::size_t>(d)], last[static_cast<std::size_t>(d)]));
    write_measured_trace(o.trace_path, program, std::move(devices));
  }
  if (!o.report_path.empty())
    write_report(o.report_path, r, "cuda-virtual", n, c.dtype == DType::F32 ? "fp32" : "bf16");
  return r;
}

TrainResult train_mpi(const core::Program& program, const TrainOptions& o, const CudaRunOptions& c) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  if (size != program.num_devices) {
    if (rank != 0) throw ReportedByAnotherRank();
    throw std::invalid_argument(
        fmt::format("the plan has {} devices but {} MPI ranks were started (mpirun -np {}, one rank per GPU; or "
                    "--virtual-devices on one GPU)",
                    program.num_devices, size, program.num_devices));
  }
  // One GPU per rank of a node: the local rank picks it.
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int local = 0, gpus = 0;
  MPI_Comm_rank(node, &local);
  MPI_Comm_free(&node);
  std::string error;
  std::unique_ptr<Transport> transport;
  std::unique_ptr<CudaBackend> backend;
  std::shared_ptr<const SmPartitioner> sm;
  std::optional<Checkpoint> ckpt;
  std::optional<SaveLock> lock;  // rank 0 writes the checkpoint
  const std::string checkpoint_bytes =
      o.resume_path.empty() ? std::string() : broadcast_checkpoint_bytes(o.resume_path, program, rank, error);
  try {
    if (error.empty()) {
      check_save_path(o.save_path);
      check_calibrate_path(o.calibrate_path);
      check(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
      check(cudaSetDevice(local % gpus), "cudaSetDevice");
      p2p_channels(program);  // a plan NCCL cannot run: one line from one rank, before NCCL starts
      sm = SmPartitioner::create(program.sm_partition);  // a partition this GPU cannot realise, likewise
      if (rank == 0 && !o.save_path.empty()) lock.emplace(o.save_path);
      if (!o.resume_path.empty()) {
        ckpt = read_compatible_checkpoint(o.resume_path, checkpoint_bytes, program);
        check_steps_after_resume(o, ckpt->info.step);
      }
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
  // Collective on every rank (NCCL init and splits): errors past this point abort the job.
  if (o.print && program.sm_partition) fmt::print("sm_partition: {}\n", sm->describe());
  transport = make_nccl_transport(program, rank, MPI_COMM_WORLD, sm->nccl_max_ctas());
  backend = std::make_unique<CudaBackend>(program, rank, *transport, config_of(o, c, sm));
  int first_step = 0;
  if (ckpt) {
    backend->restore(ckpt->state);
    backend->set_steps_done(ckpt->info.step);
    first_step = ckpt->info.step;
  }
  // The training loop every backend shares (trainer.hpp); --on-nonfinite skip is refused in train_cuda.
  CudaTrainee trainee(*backend);
  const RankLoopLabels labels{gpu_name(), calibration_source("nccl"), [&](const TrainResult& result, int devices) {
                                write_report(o.report_path, result, "cuda-nccl", devices,
                                             c.dtype == DType::F32 ? "fp32" : "bf16");
                              }};
  return train_ranks(program, o, trainee, rank, first_step, labels);
}

}  // namespace

TrainResult train_cuda(const core::Program& program, const TrainOptions& options, const CudaRunOptions& cuda) {
  // A plan this backend cannot run (TP, SP, CP, expert TP, HSDP, GPT-style layers, ...) is refused in
  // one line before any GPU is touched (Capabilities, dataflow.hpp).
  std::string why = unsupported_feature(program, cuda_capabilities());
  if (why.empty() && options.skip_nonfinite)
    why =
        "--on-nonfinite skip: the CUDA backend stops on a non-finite loss; skipping steps is implemented on the host "
        "backend only";
  if (!why.empty()) {
    if (!cuda.virtual_devices) {
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      if (rank != 0) throw ReportedByAnotherRank();
    }
    throw std::invalid_argument(why);
  }
  return cuda.virtual_devices ? train_virtual(program, options, cuda) : train_mpi(program, options, cuda);
}

}  // namespace piper::runtime::cuda
