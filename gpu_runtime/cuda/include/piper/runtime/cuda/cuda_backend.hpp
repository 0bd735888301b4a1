// The CUDA backend: runs one device's plan on a GPU through the shared executor dataflow (dataflow.hpp),
// like runtime::HostBackend: compute ops run the CudaModel on their segment and microbatch,
// communication goes through a Transport (NCCL or loopback).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "piper/core/program.hpp"
#include "piper/core/timeline.hpp"
#include "piper/runtime/backend.hpp"
#include "piper/runtime/cuda/cuda_model.hpp"
#include "piper/runtime/cuda/sm_partition.hpp"
#include "piper/runtime/cuda/transport.hpp"
#include "piper/runtime/checkpoint.hpp"
#include "piper/runtime/dataflow.hpp"
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

// The CUDA side of the two dataflow interfaces (piper/runtime/dataflow.hpp). Kernels: the CudaModel on
// one CUDA stream per Program stream; buffers are device tensors; every op records a begin and an end
// event and completes when its end event has (the executor starts an op only after the ops it waits
// for completed, which orders work across streams); memory comes from a caching allocator sized from
// the plan.
class CudaKernels {
 public:
  using Ctx = Exec;
  using Buf = Tensor;
  using Forward = cuda::ForwardState;
  using Backward = cuda::BackwardState;
  using Stash = cuda::SegmentStash;
  using Source = cuda::ExpertSource;
  using Packet = cuda::ExpertPacket;
  // An op's begin and end events (destroyed with the mark).
  struct Mark {
    cudaEvent_t begin = nullptr, end = nullptr;
    Mark() = default;
    Mark(Mark&& o) noexcept : begin(o.begin), end(o.end) { o.begin = o.end = nullptr; }
    Mark& operator=(Mark&& o) noexcept {
      std::swap(begin, o.begin);
      std::swap(end, o.end);
      return *this;
    }
    Mark(const Mark&) = delete;
    Mark& operator=(const Mark&) = delete;
    ~Mark();
  };

  CudaKernels(const core::Program& program, int device, const core::Model& model, const CudaConfig& config);
  ~CudaKernels();
  CudaKernels(const CudaKernels&) = delete;
  CudaKernels& operator=(const CudaKernels&) = delete;

  const core::Model& model() const { return model_->model(); }
  bool tied() const { return model_->host_state().tied(); }
  int embedding_layer() const { return model_->host_state().embedding_layer(); }
  int head_layer() const { return model_->host_state().head_layer(); }
  Exec ctx(int stream) const;
  Exec util() const;
  void begin_step(int step);
  double end_step(double host_loss);
  Mark begin_op(const Exec& e);
  void end_op(const Exec& e, Mark& m);
  bool op_done(const core::OpRef& at, Mark& m, const core::Op& op);

  double forward(const Exec& e, int s, const host::MicrobatchData& d, float scale, Forward& st, Stash& stash) {
    model_->forward(e, s, d, scale, st, stash);
    return 0;  // the head adds its loss to the device accumulator, read at end_step
  }
  void backward_input(const Exec& e, int s, Backward& g, Stash& stash) { model_->backward_input(e, s, g, stash); }
  void backward_weight(const Exec& e, int s, Stash& stash) { model_->backward_weight(e, s, stash); }
  Source route(const Exec& e, const Forward& st, int ranks) { return model_->route(e, st, ranks); }
  std::vector<Packet> dispatch_forward(const Exec& e, const Forward& st, const Source& src) {
    return model_->dispatch_forward(e, st, src);
  }
  std::vector<Packet> dispatch_backward(const Exec& e, Backward& g, const Source& src) {
    return model_->dispatch_backward(e, g, src);
  }
  void experts_forward_entries(const Exec& e, int s, const std::vector<Packet>& from, Stash& st,
                               std::vector<Packet>* to) {
    model_->experts_forward_entries(e, s, from, st, to);
  }
  void experts_backward_entries(const Exec& e, int s, const std::vector<Packet>& from, Stash& st,
                                std::vector<Packet>* to) {
    model_->experts_backward_entries(e, s, from, st, to);
  }
  void combine_forward(const Exec& e, Forward& st, Source& src, const std::vector<Packet>& in) {
    model_->combine_forward(e, st, src, in);
  }
  void combine_backward(const Exec& e, Backward& g, const Source& src, const std::vector<Packet>& in) {
    model_->combine_backward(e, g, src, in);
  }
  void update(const Exec& e, int s, int step);
  // Gradient clipping (dataflow.hpp): this device's owned sum of squares into out (one fp32), and
  // the all-reduced sum read back (a 4-byte copy that waits for the reduction) as the update scale.
  void grad_sq(const Exec& e, const std::vector<int>& segments, Tensor& out, double loss_scale);
  // Returns the (unscaled) norm's square; sets the update's factor (clipping over the loss scale).
  double clip_to(const Exec& e, const Tensor& norm_sq, double max_norm, double loss_scale);
  void discard_grads(const Exec& e, int s);  // loss scaling's overflowed step: zero gradients, no update
  void poison(int s);

  Tensor pack_forward(const Exec& e, Forward&& st) { return cuda::pack_forward(e, msg_, st); }
  Tensor pack_backward(const Exec& e, Backward&& g) { return cuda::pack_backward(e, msg_, g); }
  Tensor message_buffer(const Exec& e) { return new_tensor(e, 1, static_cast<std::int64_t>(msg_.bytes()), 1); }
  Forward unpack_forward(const Exec& e, Tensor& b) { return cuda::unpack_forward(e, msg_, b); }
  Backward unpack_backward(const Exec& e, Tensor& b) { return cuda::unpack_backward(e, msg_, b); }
  Tensor pack_packets(const Exec& e, const std::vector<Packet>& out, int) {
    return cuda::pack_packets(e, packets_, out);
  }
  Tensor packet_buffer(const Exec& e, int ranks) {
    return new_tensor(e, 1, static_cast<std::int64_t>(packets_.block_bytes()) * ranks, 1);
  }
  std::vector<Packet> unpack_packets(const Exec& e, Tensor& b, int ranks) {
    return cuda::unpack_packets(e, packets_, b, ranks);
  }

  Tensor floats(const Exec& e, std::int64_t n) { return zeros(e, n, 1, 4); }
  std::int64_t size(int s, Vec v);
  void zero(const Exec& e, int s, Vec v);
  void read(const Exec& e, Tensor& dst, std::int64_t at, int s, Vec v, std::int64_t from, std::int64_t n);
  void write(const Exec& e, int s, Vec v, std::int64_t at, const Tensor& src, std::int64_t from, std::int64_t n,
             bool add);
  bool& grad_chunk_ready(int s) { return model_->device(s).grad_chunk_ready; }
  int& gathered(int s) { return model_->device(s).gathered; }
  host::SegmentParams& layout(int s) { return model_->layout(s); }

  CudaModel& cuda_model() { return *model_; }
  const core::DeviceTimeline& gpu_timeline() const { return timeline_; }

 private:
  float* fp32(int s, Vec v);
  // {offset, length} of the tied table's gradient (the embedding's, or a head's copy) in segment s's
  // fp32 gradients, located by HostModel::tied_grads in the shared layout; {0, 0} when there is none.
  std::pair<std::int64_t, std::int64_t> tied_range(int s);
  int device_;
  const core::Plan& plan_;
  CudaConfig config_;
  std::vector<cudaStream_t> streams_;
  cudaStream_t util_ = nullptr;  // private stream for host<->device copies outside ops
  std::vector<std::unique_ptr<Gemm>> gemms_;
  std::unique_ptr<Allocator> alloc_;
  std::unique_ptr<CudaModel> model_;
  MessageShape msg_;
  PacketShape packets_;
  cudaEvent_t step_start_ = nullptr;
  float grad_scale_ = 1;  // this step's gradient clipping factor
  // Recorded after this step's tied-embedding sum (write() of Vec::TiedGrads); once recorded, every
  // op begun waits for it (begin_op).
  cudaEvent_t tied_sum_ = nullptr;
  bool tied_sum_recorded_ = false;
  // ZeRO-2/3 reducing after every microbatch: the reduce-scatter's reads of a segment's gradients and
  // the compute streams' backward passes are ordered as the host runs them (see zero() and read()).
  bool is_compute_stream(cudaStream_t st) const;
  bool reduced_every_microbatch(int s) const;
  void wait_for_compute(cudaStream_t st);   // `st` waits for the work enqueued on the compute streams
  std::vector<bool> reduce_every_;          // per program segment
  std::vector<cudaEvent_t> compute_marks_;  // per stream (compute streams only)
  cudaEvent_t grads_zeroed_ = nullptr;
  core::DeviceTimeline timeline_;
  std::vector<std::size_t> stream_base_;
};

// Transport: the NCCL or loopback Transport (transport.hpp), fed with the dataflow's device buffers.
class CudaTransport {
 public:
  explicit CudaTransport(Transport& t) : t_(t) {}
  int post(const CommPost<Tensor>& r, const Exec& e);
  bool test(int ticket) { return t_.test(ticket); }
  std::string name() const { return t_.name(); }

 private:
  Transport& t_;
};

class CudaBackend : public Backend {
 public:
  // Uses the current CUDA device (the caller selects it with cudaSetDevice).
  CudaBackend(const core::Program& program, int device, Transport& transport, const CudaConfig& config);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  void begin_step(int step) override { flow_->begin_step(step); }
  bool start(const core::OpRef& at, const core::Op& op) override { return flow_->start(at, op); }
  bool poll(const core::OpRef& at, const core::Op& op) override { return flow_->poll(at, op); }
  void buffer_freed(int buffer) override { flow_->buffer_freed(buffer); }
  void end_step() override { flow_->end_step(); }
  std::string describe_wait(const core::Op& op) const override { return flow_->describe_wait(op); }

  double loss_sum() const { return flow_->loss_sum(); }
  double grad_norm() const { return flow_->grad_norm(); }  // the step's global gradient norm (clip_grad), or -1
  DataflowBase& flow() { return *flow_; }                  // steps done, loss scaling
  std::vector<host::ParamRecord> param_records();
  // Checkpoints in the canonical layout (checkpoint.hpp): this device's records (fp32 masters and
  // AdamW moments), and the reverse (its shards and chunks of a canonical state; gradients zeroed).
  std::vector<StateRecord> checkpoint_records();
  void restore(const CanonicalState& state);
  const core::Model& model() const { return kernels_->model(); }
  // The last step's spans measured with CUDA events (start recorded before the op's work is
  // enqueued, end after it), relative to an event recorded at begin_step.
  const core::DeviceTimeline& gpu_timeline() const { return kernels_->gpu_timeline(); }

 private:
  std::unique_ptr<CudaKernels> kernels_;
  std::unique_ptr<CudaTransport> transport_;
  std::unique_ptr<Dataflow<CudaKernels, CudaTransport>> flow_;
};

}  // namespace piper::runtime::cuda
