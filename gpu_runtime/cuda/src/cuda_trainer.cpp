// The CUDA training driver: virtual devices (threads over the loopback transport) or MPI + NCCL ranks;
// losses, report, parameter dump (the format of trainer.cpp, read by read_param_dump) and trace.
#include "piper/runtime/cuda/cuda_trainer.hpp"

#include <barrier>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <mpi.h>
#include <nlohmann/json.hpp>

#include "piper/core/timeline.hpp"
#include "piper/runtime/cuda/cuda_backend.hpp"
#include "piper/runtime/executor.hpp"

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

void write_dump(const std::string& path, const std::string& records) { core::write_file_atomically(path, std::string("PIPERPRM") + records); }

void write_report(const std::string& path, const TrainResult& r, const std::string& mode, int devices, const std::string& precision) {
  nlohmann::json j = {{"mode", mode}, {"backend", "cuda"}, {"precision", precision}, {"devices", devices}, {"first_step", r.first_step},
                      {"losses", r.losses}, {"tokens_per_s", r.tokens_per_s}, {"step_time_s", r.step_time_s}};
  j["executor"] = {{"ops", r.ops}, {"backend_s", r.backend_s}, {"idle_s", r.idle_s}, {"overhead_s", r.overhead_s}, {"total_s", r.total_s}};
  core::write_file_atomically(path, j.dump(1) + "\n");
}

void write_trace(const std::string& path, const core::Program& program, std::vector<core::DeviceTimeline> devices) {
  core::Timeline t;
  t.source = "measured";
  t.program = std::make_shared<const core::Program>(program);
  for (auto& d : devices) {
    for (const auto& s : d.spans) t.step_time_s = std::max(t.step_time_s, s.end_s);
    t.devices.push_back(std::move(d));
  }
  std::ostringstream out;
  core::write_chrome_trace(t, out);
  core::write_file_atomically(path, out.str());
}

// The GPU spans with the executor's memory samples (host-observed buffer lifetimes).
core::DeviceTimeline merged(const CudaBackend& b, const StepMeasurement& m) {
  core::DeviceTimeline d = b.gpu_timeline();
  d.memory = m.timeline.memory;
  d.peak_memory_bytes = m.timeline.peak_memory_bytes;
  d.peak_memory_time_s = m.timeline.peak_memory_time_s;
  return d;
}

CudaConfig config_of(const TrainOptions& o, const CudaRunOptions& c) { return CudaConfig{o.seed, o.data_path, o.adamw, c.dtype}; }

void refuse_checkpoints(const TrainOptions& o) {
  if (!o.save_path.empty() || !o.resume_path.empty())
    throw std::invalid_argument("--save/--resume: checkpoints are not implemented for --backend cuda yet");
}

TrainResult train_virtual(const core::Program& program, const TrainOptions& o, const CudaRunOptions& c) {
  const int n = program.num_devices;
  check(cudaSetDevice(0), "cudaSetDevice");
  LoopbackHub hub(n);
  std::vector<std::unique_ptr<LoopbackTransport>> transports;
  std::vector<std::unique_ptr<CudaBackend>> backends;
  // Built in this thread, before any device runs: a setup error stops the run before the first step.
  for (int d = 0; d < n; ++d) {
    transports.push_back(std::make_unique<LoopbackTransport>(hub, d));
    backends.push_back(std::make_unique<CudaBackend>(program, d, *transports.back(), config_of(o, c)));
  }
  const DataShape shape = data_shape(program);
  TrainResult r;
  std::vector<double> loss(static_cast<std::size_t>(n)), step_s(static_cast<std::size_t>(n));
  std::vector<StepMeasurement> last(static_cast<std::size_t>(n));
  double total_step_s = 0;
  int step_now = 0;
  auto on_step = [&]() noexcept {
    double sum = 0, slowest = 0;
    for (int d = 0; d < n; ++d) sum += loss[static_cast<std::size_t>(d)], slowest = std::max(slowest, step_s[static_cast<std::size_t>(d)]);
    r.losses.push_back(sum / static_cast<double>(shape.global_tokens()));
    total_step_s += slowest;
    for (const auto& m : last) r.backend_s += m.backend_seconds, r.idle_s += m.idle_seconds, r.overhead_s += m.overhead_seconds, r.ops += m.ops;
    r.total_s += slowest;
    if (o.print) fmt::print("step {:>4}  loss {:.6f}  ({:.1f} ms)\n", step_now + 1, r.losses.back(), slowest * 1e3);
    ++step_now;
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
        for (int step = 0; step < o.steps; ++step) {
          last[i] = executor.run_step(step);
          loss[i] = backends[i]->loss_sum();
          step_s[i] = last[i].step_seconds;
          sync.arrive_and_wait();
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
  r.step_time_s = o.steps > 0 ? total_step_s / o.steps : 0;
  r.tokens_per_s = r.step_time_s > 0 ? static_cast<double>(shape.global_tokens()) / r.step_time_s : 0;
  if (!o.dump_params_path.empty()) {
    std::string all;
    for (auto& b : backends) all += serialize_records(b->param_records());
    write_dump(o.dump_params_path, all);
  }
  if (!o.trace_path.empty() && o.steps > 0) {
    std::vector<core::DeviceTimeline> devices;
    for (int d = 0; d < n; ++d) devices.push_back(merged(*backends[static_cast<std::size_t>(d)], last[static_cast<std::size_t>(d)]));
    write_trace(o.trace_path, program, std::move(devices));
  }
  if (!o.report_path.empty()) write_report(o.report_path, r, "cuda-virtual", n, c.dtype == DType::F32 ? "fp32" : "bf16");
  return r;
}

TrainResult train_mpi(const core::Program& program, const TrainOptions& o, const CudaRunOptions& c) {
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  if (size != program.num_devices) {
    if (rank != 0) throw ReportedByAnotherRank();
    throw std::invalid_argument(fmt::format("the plan has {} devices but {} MPI ranks were started (mpirun -np {}, one rank per GPU; or --virtual-devices on one GPU)",
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
  try {
    check(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
    check(cudaSetDevice(local % gpus), "cudaSetDevice");
    p2p_channels(program);  // a plan NCCL cannot run: one line from one rank, before NCCL starts
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
  transport = make_nccl_transport(program, rank, MPI_COMM_WORLD);
  backend = std::make_unique<CudaBackend>(program, rank, *transport, config_of(o, c));
  const DataShape shape = data_shape(program);
  Executor executor(program.plan_for(rank), *backend, ExecutorOptions{o.stall_timeout_s});
  TrainResult r;
  StepMeasurement last;
  double total_step_s = 0;
  for (int step = 0; step < o.steps; ++step) {
    MPI_Barrier(MPI_COMM_WORLD);
    last = executor.run_step(step);
    double sum = backend->loss_sum(), step_s = last.step_seconds;
    MPI_Allreduce(MPI_IN_PLACE, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &step_s, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    r.losses.push_back(sum / static_cast<double>(shape.global_tokens()));
    total_step_s += step_s;
    r.backend_s += last.backend_seconds;
    r.idle_s += last.idle_seconds;
    r.overhead_s += last.overhead_seconds;
    r.total_s += last.step_seconds;
    r.ops += last.ops;
    if (o.print && rank == 0) fmt::print("step {:>4}  loss {:.6f}  ({:.1f} ms)\n", step + 1, r.losses.back(), step_s * 1e3);
  }
  r.step_time_s = o.steps > 0 ? total_step_s / o.steps : 0;
  r.tokens_per_s = r.step_time_s > 0 ? static_cast<double>(shape.global_tokens()) / r.step_time_s : 0;
  if (!o.dump_params_path.empty()) {
    const std::string mine = serialize_records(backend->param_records());
    int bytes = static_cast<int>(mine.size());
    std::vector<int> sizes(static_cast<std::size_t>(size)), offsets(static_cast<std::size_t>(size));
    MPI_Gather(&bytes, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    int total = 0;
    for (int i = 0; i < size; ++i) offsets[static_cast<std::size_t>(i)] = total, total += sizes[static_cast<std::size_t>(i)];
    std::string all(static_cast<std::size_t>(rank == 0 ? total : 0), '\0');
    MPI_Gatherv(mine.data(), bytes, MPI_BYTE, all.data(), sizes.data(), offsets.data(), MPI_BYTE, 0, MPI_COMM_WORLD);
    if (rank == 0) write_dump(o.dump_params_path, all);
  }
  if (!o.trace_path.empty() && o.steps > 0) {
    // Spans as (stream, index, start, end) doubles, gathered on rank 0.
    const core::DeviceTimeline mine = merged(*backend, last);
    std::vector<double> flat;
    for (const auto& s : mine.spans) flat.insert(flat.end(), {static_cast<double>(s.stream), static_cast<double>(s.index), s.start_s, s.end_s});
    int count = static_cast<int>(flat.size());
    std::vector<int> sizes(static_cast<std::size_t>(size)), offsets(static_cast<std::size_t>(size));
    MPI_Gather(&count, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
    int total = 0;
    for (int i = 0; i < size; ++i) offsets[static_cast<std::size_t>(i)] = total, total += sizes[static_cast<std::size_t>(i)];
    std::vector<double> all(static_cast<std::size_t>(rank == 0 ? total : 0));
    MPI_Gatherv(flat.data(), count, MPI_DOUBLE, all.data(), sizes.data(), offsets.data(), MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      std::vector<core::DeviceTimeline> devices(static_cast<std::size_t>(size));
      for (int d = 0; d < size; ++d)
        for (int i = offsets[static_cast<std::size_t>(d)]; i + 3 < offsets[static_cast<std::size_t>(d)] + sizes[static_cast<std::size_t>(d)]; i += 4) {
          const auto at = static_cast<std::size_t>(i);
          devices[static_cast<std::size_t>(d)].spans.push_back(
              {static_cast<std::int32_t>(all[at]), static_cast<std::int32_t>(all[at + 1]), all[at + 2], all[at + 3]});
        }
      write_trace(o.trace_path, program, std::move(devices));
    }
  }
  if (rank == 0 && !o.report_path.empty()) write_report(o.report_path, r, "cuda-nccl", size, c.dtype == DType::F32 ? "fp32" : "bf16");
  return r;
}

}  // namespace

TrainResult train_cuda(const core::Program& program, const TrainOptions& options, const CudaRunOptions& cuda) {
  refuse_checkpoints(options);
  return cuda.virtual_devices ? train_virtual(program, options, cuda) : train_mpi(program, options, cuda);
}

}  // namespace piper::runtime::cuda
