// The CUDA backend: runs one device's plan on a GPU. It mirrors runtime::HostBackend (host_backend.hpp)
// op for op: compute ops run the CudaModel on their segment and microbatch, communication goes through a
// Transport (NCCL or loopback). One CUDA stream per Program stream; every op records an event and
// completes when it has (the executor starts an op only after the ops it waits for completed, which
// orders work across streams); buffers come from a caching allocator sized from the plan.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "piper/core/program.hpp"
#include "piper/core/timeline.hpp"
#include "piper/runtime/backend.hpp"
#include "piper/runtime/cuda/cuda_model.hpp"
#include "piper/runtime/cuda/sm_partition.hpp"
#include "piper/runtime/cuda/transport.hpp"
#include "piper/runtime/checkpoint.hpp"
#include "piper/runtime/host_backend.hpp"

namespace piper::runtime::cuda {

struct CudaConfig {
  std::uint64_t seed = 1;
  std::string data_path;
  host::AdamWConfig adamw;
  DType dtype = DType::F32;
  // The GPU's SM partition (the program's sm_partition), shared by the virtual devices of one GPU;
  // null: plain streams, no limits.
  std::shared_ptr<const SmPartitioner> sm;
};

class CudaBackend : public Backend {
 public:
  // Uses the current CUDA device (the caller selects it with cudaSetDevice).
  CudaBackend(const core::Program& program, int device, Transport& transport, const CudaConfig& config);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  void begin_step(int step) override;
  bool start(const core::OpRef& at, const core::Op& op) override;
  bool poll(const core::OpRef& at, const core::Op& op) override;
  void buffer_freed(int buffer) override;
  void end_step() override;
  std::string describe_wait(const core::Op& op) const override;

  double loss_sum() const { return loss_sum_; }
  int steps_done() const { return steps_done_; }
  void set_steps_done(int steps) { steps_done_ = steps; }
  std::vector<host::ParamRecord> param_records();
  // Checkpoints in the canonical layout (checkpoint.hpp): this device's records (fp32 masters and
  // AdamW moments), and the reverse (its shards and chunks of a canonical state; gradients zeroed).
  std::vector<StateRecord> checkpoint_records();
  void restore(const CanonicalState& state);
  const core::Model& model() const { return model_->model(); }
  // The last step's spans measured with CUDA events (start recorded before the op's work is
  // enqueued, end after it), relative to an event recorded at begin_step.
  const core::DeviceTimeline& gpu_timeline() const { return timeline_; }

 private:
  struct Pending;
  Exec exec(int stream) const;
  Exec util() const;
  void run_compute(const Exec& e, const core::Op& op);
  void start_comm(const Exec& e, const core::Op& op, Pending& p);
  void finish_comm(const Exec& e, const core::Op& op, Pending& p);
  int mb_of(const core::Op& op) const;
  int data_rank_of(const core::Op& op) const;
  const core::ProgramSegment& seg(int s) const { return program_.segments.at(static_cast<std::size_t>(s)); }

  const core::Program& program_;
  const core::Plan& plan_;
  int device_;
  Transport& transport_;
  CudaConfig config_;
  DataShape shape_;
  float loss_scale_ = 1;
  int num_layers_ = 0;
  std::vector<cudaStream_t> streams_;
  cudaStream_t util_ = nullptr;  // private stream for host<->device copies outside ops
  std::vector<std::unique_ptr<Gemm>> gemms_;
  std::unique_ptr<Allocator> alloc_;
  std::unique_ptr<CudaModel> model_;
  std::unique_ptr<host::TokenStream> stream_;
  MessageShape msg_;
  int step_ = 0, steps_done_ = 0;
  double loss_sum_ = 0;
  cudaEvent_t step_start_ = nullptr;
  core::DeviceTimeline timeline_;
  std::vector<std::size_t> stream_base_;

  using Key = std::tuple<int, int, int>;
  using SegKey = std::pair<int, int>;
  using EpKey = std::tuple<int, bool, int>;
  std::map<Key, ForwardState> forward_;
  std::map<Key, BackwardState> backward_;
  std::map<SegKey, SegmentStash> stash_;
  std::map<SegKey, ExpertSource> ep_source_;
  std::map<SegKey, BackwardState> ep_grad_;
  std::map<EpKey, std::vector<ExpertPacket>> ep_in_, ep_out_;
  std::map<EpKey, int> a2a_seen_;
  std::map<core::OpRef, std::unique_ptr<Pending>> pending_;
};

}  // namespace piper::runtime::cuda
