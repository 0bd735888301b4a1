// The CUDA training driver: virtual devices (threads over the loopback transport) or MPI + NCCL ranks,
// both through the training loop every backend shares (trainer.hpp): losses, report, parameter dump,
// trace, checkpoints and --calibrate.
#include "piper/runtime/cuda/cuda_trainer.hpp"

#include <memory>
#include <optional>

#include <fmt/format.h>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include "piper/core/timeline.hpp"
#include "piper/runtime/calibrate.hpp"
#include "piper/runtime/checkpoint.hpp"
#include "piper/runtime/cuda/cuda_backend.hpp"
#include "piper/runtime/cuda/sm_partition.hpp"
#include "piper/runtime/executor.hpp"
#include "piper/runtime/rank_group.hpp"

namespace piper::runtime::cuda {

namespace {

void write_report(const TrainResult& r, const TrainOptions& o, const std::string& mode, int devices, DType dtype) {
  nlohmann::json j = report_json(r, o, mode, devices);
  j["backend"] = "cuda";
  j["precision"] = dtype_name(dtype);
  core::write_file_atomically(o.report_path, j.dump(1) + "\n");
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
  double grad_norm() override { return b_.grad_norm(); }
  DataflowBase& flow() override { return b_.flow(); }
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

// Every device of the plan as a thread of this process on one GPU, over the loopback transport; the
// training loop is the shared one (trainer.hpp's train_threads).
TrainResult train_virtual(const core::Program& program, const TrainOptions& o, const CudaRunOptions& c) {
  const int n = program.num_devices;
  check(cudaSetDevice(0), "cudaSetDevice");
  const auto lock = prepare_outputs(o);
  // One partition for the GPU that every virtual device shares.
  const auto sm = SmPartitioner::create(program.sm_partition);
  if (o.print && program.sm_partition) fmt::print("sm_partition: {}\n", sm->describe());
  LoopbackHub hub(n);
  std::vector<std::unique_ptr<LoopbackTransport>> transports;
  std::vector<std::unique_ptr<CudaBackend>> backends;
  std::vector<std::unique_ptr<CudaTrainee>> trainees;
  std::vector<RankTrainee*> ranks;
  // Built in this thread, before any device runs: a setup error stops the run before the first step.
  for (int d = 0; d < n; ++d) {
    transports.push_back(std::make_unique<LoopbackTransport>(hub, d));
    backends.push_back(std::make_unique<CudaBackend>(program, d, *transports.back(), config_of(o, c, sm)));
    trainees.push_back(std::make_unique<CudaTrainee>(*backends.back()));
    ranks.push_back(trainees.back().get());
  }
  int first_step = 0;
  if (!o.resume_path.empty()) {
    const Checkpoint ckpt =
        read_compatible_checkpoint(o.resume_path, read_checkpoint_bytes(o.resume_path, program), program);
    check_steps_after_resume(o, ckpt.info.step);
    check_schedule_after_resume(o, ckpt.info);
    for (auto& b : backends) b->restore(ckpt.state), resume_flow(b->flow(), ckpt.info, o.adamw.loss_scaling);
    first_step = ckpt.info.step;
  }
  const RankLoopLabels labels{
      gpu_name(), calibration_source("virtual devices"),
      [&](const TrainResult& result, int devices) { write_report(result, o, "cuda-virtual", devices, c.dtype); }};
  return train_threads(
      program, o, ranks, first_step, labels, [] { check(cudaSetDevice(0), "cudaSetDevice"); }, [&hub] { hub.abort(); });
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
        check_schedule_after_resume(o, ckpt->info);
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
    resume_flow(backend->flow(), ckpt->info, o.adamw.loss_scaling);
    first_step = ckpt->info.step;
  }
  // The training loop every backend shares (trainer.hpp); --on-nonfinite skip is refused in train_cuda.
  CudaTrainee trainee(*backend);
  const RankLoopLabels labels{gpu_name(), calibration_source("nccl"), [&](const TrainResult& result, int devices) {
                                write_report(result, o, "cuda-nccl", devices, c.dtype);
                              }};
  const auto world = mpi_world_group();
  return train_ranks(program, o, trainee, *world, first_step, labels);
}

}  // namespace

TrainResult train_cuda(const core::Program& program, const TrainOptions& options, const CudaRunOptions& cuda) {
  // A plan this backend cannot run (expert TP, chunked all-to-alls, ...) is refused in
  // one line before any GPU is touched (Capabilities, dataflow.hpp).
  std::string why = unsupported_feature(program, cuda_capabilities());
  if (why.empty()) why = loss_scaling_problem(program, options);
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
