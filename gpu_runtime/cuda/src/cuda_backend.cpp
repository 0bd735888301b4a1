// The CUDA backend: the shared executor dataflow (dataflow.hpp) over CudaKernels (the CudaModel on CUDA
// streams, completion by CUDA events) and CudaTransport (NCCL or loopback).
#include "piper/runtime/cuda/cuda_backend.hpp"

#include <algorithm>
#include <span>
#include <stdexcept>

#include <fmt/format.h>

#include "piper/runtime/executor.hpp"

namespace piper::runtime::cuda {

namespace {

cudaEvent_t timed_event(cudaStream_t s) {
  cudaEvent_t e = nullptr;
  check(cudaEventCreate(&e), "cudaEventCreate");
  check(cudaEventRecord(e, s), "cudaEventRecord");
  return e;
}

void d2d(void* dst, const void* src, std::size_t bytes, cudaStream_t s) {
  if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------
CudaKernels::Mark::~Mark() {
  if (begin) cudaEventDestroy(begin);
  if (end) cudaEventDestroy(end);
}

CudaKernels::CudaKernels(const core::Program& program, int device, const core::Model& model, const CudaConfig& config)
    : device_(device), plan_(program.plan_for(device)), config_(config) {
  const DataShape shape = data_shape(program);
  // The caching allocator keeps up to twice the plan's transient bytes (all its activation, received
  // and gathered buffers; the plan's estimate of what one step holds), at least 256 MiB.
  std::int64_t transient = 0;
  for (const auto& b : plan_.buffers)
    if (!b.persistent()) transient += b.bytes;
  alloc_ = std::make_unique<Allocator>(
      std::max<std::size_t>(std::size_t{256} << 20, static_cast<std::size_t>(2 * transient)));
  if (!config_.sm) config_.sm = SmPartitioner::create(std::nullopt);
  for (std::size_t s = 0; s < plan_.streams.size(); ++s) {
    // A stream that runs compute or update ops belongs to the compute partition, any other to the
    // communication partition (sm_partition's "comm": every stream but the compute one).
    const auto& ops = plan_.streams[s].ops;
    const bool computes = std::any_of(ops.begin(), ops.end(), [](const core::Op& op) {
      return op.kind == core::OpKind::Compute || op.kind == core::OpKind::Update;
    });
    cudaStream_t st = config_.sm->create_stream(!computes);
    streams_.push_back(st);
    alloc_->add_stream(st);
    // cuBLASLt handles (each with a 32 MiB workspace) only for streams that run compute ops.
    gemms_.push_back(computes ? std::make_unique<Gemm>(st, config_.sm->gemm_sm_target()) : nullptr);
  }
  check(cudaStreamCreateWithFlags(&util_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  alloc_->add_stream(util_);
  check(cudaEventCreateWithFlags(&tied_sum_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  check(cudaEventCreateWithFlags(&grads_zeroed_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  compute_marks_.assign(streams_.size(), nullptr);
  for (std::size_t s = 0; s < streams_.size(); ++s)
    if (gemms_[s])
      check(cudaEventCreateWithFlags(&compute_marks_[s], cudaEventDisableTiming), "cudaEventCreateWithFlags");
  for (const auto& seg : program.segments) reduce_every_.push_back(seg.reduce_every_microbatch);
  model_ =
      std::make_unique<CudaModel>(model, device_segments(program, device), config.seed, config.dtype, *alloc_, util_);
  msg_ = MessageShape{shape.micro_batch_size * shape.seq_len, model_->hidden(), model_->top_k(), config.dtype};
  packets_ = PacketShape{shape.micro_batch_size * shape.seq_len * model_->top_k(), model_->hidden(), config.dtype};
  std::size_t base = 0;
  for (const auto& s : plan_.streams) stream_base_.push_back(base), base += s.ops.size();
}

CudaKernels::~CudaKernels() {
  cudaDeviceSynchronize();
  model_.reset();
  gemms_.clear();
  alloc_.reset();
  if (step_start_) cudaEventDestroy(step_start_);
  if (tied_sum_) cudaEventDestroy(tied_sum_);
  if (grads_zeroed_) cudaEventDestroy(grads_zeroed_);
  for (auto e : compute_marks_)
    if (e) cudaEventDestroy(e);
  for (auto s : streams_) cudaStreamDestroy(s);
  if (util_) cudaStreamDestroy(util_);
}

Exec CudaKernels::ctx(int stream) const {
  return Exec{streams_.at(static_cast<std::size_t>(stream)), gemms_.at(static_cast<std::size_t>(stream)).get(),
              alloc_.get()};
}
Exec CudaKernels::util() const { return Exec{util_, nullptr, alloc_.get()}; }

void CudaKernels::begin_step(int) {
  grad_scale_ = 1;
  tied_sum_recorded_ = false;
  if (step_start_) cudaEventDestroy(step_start_);
  step_start_ = timed_event(util_);
  // Completed before any op's events are read against it: cudaEventElapsedTime fails (NotReady) if
  // either event is pending, and an op on another stream can finish before the idle util stream
  // has processed this record.
  check(cudaEventSynchronize(step_start_), "cudaEventSynchronize (step start)");
  timeline_ = core::DeviceTimeline{};
  timeline_.spans.assign(static_cast<std::size_t>(plan_.op_count()), core::OpSpan{});
}

double CudaKernels::end_step(double) {
  // Every op completed: the loss accumulator is final. Read it and clear it for the next step.
  float loss = 0;
  check(cudaMemcpyAsync(&loss, model_->loss_accumulator(), sizeof(float), cudaMemcpyDeviceToHost, util_),
        "cudaMemcpyAsync loss");
  check(cudaMemsetAsync(model_->loss_accumulator(), 0, sizeof(float), util_), "cudaMemsetAsync");
  check(cudaStreamSynchronize(util_), "cudaStreamSynchronize");
  return loss;
}

CudaKernels::Mark CudaKernels::begin_op(const Exec& e) {
  // After this step's tied-embedding sum was enqueued, every op waits for it on the GPU (see write()).
  if (tied_sum_recorded_) check(cudaStreamWaitEvent(e.stream, tied_sum_, 0), "cudaStreamWaitEvent (tied sum)");
  Mark m;
  m.begin = timed_event(e.stream);
  return m;
}

void CudaKernels::end_op(const Exec& e, Mark& m) { m.end = timed_event(e.stream); }

bool CudaKernels::op_done(const core::OpRef& at, Mark& m, const core::Op& op) {
  const cudaError_t q = cudaEventQuery(m.end);
  if (q == cudaErrorNotReady) return false;
  check(q, fmt::format("'{}' on device {}", op.label, device_).c_str());
  float b = 0, en = 0;
  check(cudaEventElapsedTime(&b, step_start_, m.begin), "cudaEventElapsedTime");
  check(cudaEventElapsedTime(&en, step_start_, m.end), "cudaEventElapsedTime");
  timeline_.spans[stream_base_[static_cast<std::size_t>(at.stream)] + static_cast<std::size_t>(at.index)] =
      core::OpSpan{at.stream, at.index, b * 1e-3, en * 1e-3};
  return true;
}

void CudaKernels::update(const Exec& e, int s, int step) {
  const host::AdamWConfig a = config_.adamw.at(step);  // this step's learning rate (the schedule)
  const AdamW cfg{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, grad_scale_};
  model_->update(e, s, cfg, step);
}

// The rule of HostModel::owned_grad_sq: host::counts_in_grad_norm's gradients, whole or the ZeRO
// chunk, of the runs CudaModel::counted_grad_runs lists (never a tied head's copy of the embedding
// table, a TP-replicated tensor on TP rank 0 only), each unscaled before it is squared.
void CudaKernels::grad_sq(const Exec& e, const std::vector<int>& segments, Tensor& out, double loss_scale) {
  const float inv = static_cast<float>(1.0 / loss_scale);  // a power of two: g * inv is exact
  for (int s : segments) {
    const host::SegmentParams& sp = model_->layout(s);
    if (!host::counts_in_grad_norm(sp)) continue;
    SegmentDevice& d = model_->device(s);
    // [begin, end) of the segment's vector, read from `g` (which holds element `begin` first).
    const bool chunked = sp.zero_level >= 1;
    const std::int64_t begin = chunked ? sp.chunk_begin : 0, end = chunked ? sp.chunk_end : d.grads.size();
    const float* g =
        chunked && d.grad_chunk_ready ? d.grad_chunk.as<float>() : d.grads.as<float>() + (chunked ? begin : 0);
    for (const auto& [at, len] : model_->counted_grad_runs(s)) {
      const std::int64_t b = std::max(at, begin), en = std::min(at + len, end);
      if (en > b) sum_squares(g + (b - begin), en - b, out.as<float>(), e.stream, inv);
    }
  }
}

std::pair<std::int64_t, std::int64_t> CudaKernels::tied_range(int s) {
  host::SegmentParams& sp = model_->layout(s);
  const std::span<float> t = model_->host_state().tied_grads(s);
  if (t.empty()) return {0, 0};
  return {t.data() - sp.grads.data(), static_cast<std::int64_t>(t.size())};
}

double CudaKernels::clip_to(const Exec& e, const Tensor& norm_sq, double max_norm, double loss_scale) {
  const double sq = download_floats(e, norm_sq).at(0);
  grad_scale_ = unscale_and_clip(sq, max_norm, loss_scale);
  return sq;
}

void CudaKernels::discard_grads(const Exec& e, int s) { model_->discard_grads(e, s); }

void CudaKernels::poison(int s) {
  // Poisoned before any later op is issued: the next gather's conversion cannot race with it.
  model_->poison_params(util(), s);
  check(cudaStreamSynchronize(util_), "cudaStreamSynchronize");
}

float* CudaKernels::fp32(int s, Vec v) {
  auto& d = model_->device(s);
  switch (v) {
    case Vec::Grads:
      return d.grads.as<float>();
    case Vec::GradChunk:
      return d.grad_chunk.as<float>();
    case Vec::Master:
      return d.master.as<float>();
    case Vec::TiedGrads:
      return d.grads.as<float>() + tied_range(s).first;
    case Vec::Params:  // in the storage type: written by write() with a conversion only
      break;
  }
  throw RuntimeError(fmt::format("runtime: the CUDA backend has no fp32 view of this vector of segment {}", s));
}

std::int64_t CudaKernels::size(int s, Vec v) {
  auto& d = model_->device(s);
  switch (v) {
    case Vec::Grads:
      return d.grads.size();
    case Vec::GradChunk:
      return d.grad_chunk.size();
    case Vec::Master:
      return d.master.size();
    case Vec::Params:
      return static_cast<std::int64_t>(model_->layout(s).params.size());
    case Vec::TiedGrads:
      return tied_range(s).second;
  }
  return 0;
}

// ZeRO-2/3 reducing after every microbatch (Dataflow::post_block_collective): the reduce-scatter of a
// microbatch reads the segment's gradients and zeroes them on its communication stream, and in the plan
// it need not wait for the backward passes of the segment's other microbatches, which accumulate into
// the same gradients on the compute stream (one may be running, the next may start at once). The host
// runs each op whole, in the order the ops start; here the two streams are ordered alike: the reads wait
// for the work already enqueued on the compute streams, and these wait for the zeroing before the work
// enqueued after it. Without it the reduce-scatter could copy part of a backward's gradient and zero
// the rest, or zero what a running backward had just added.
bool CudaKernels::is_compute_stream(cudaStream_t st) const {
  for (std::size_t i = 0; i < streams_.size(); ++i)
    if (streams_[i] == st) return gemms_[i] != nullptr;
  return false;
}

bool CudaKernels::reduced_every_microbatch(int s) const {
  return s >= 0 && static_cast<std::size_t>(s) < reduce_every_.size() && reduce_every_[static_cast<std::size_t>(s)];
}

void CudaKernels::wait_for_compute(cudaStream_t st) {
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    if (!gemms_[i] || streams_[i] == st) continue;
    check(cudaEventRecord(compute_marks_[i], streams_[i]), "cudaEventRecord (compute mark)");
    check(cudaStreamWaitEvent(st, compute_marks_[i], 0), "cudaStreamWaitEvent (compute mark)");
  }
}

void CudaKernels::zero(const Exec& e, int s, Vec v) {
  const std::int64_t n = size(s, v);
  if (n > 0) check(cudaMemsetAsync(fp32(s, v), 0, static_cast<std::size_t>(n) * 4, e.stream), "cudaMemsetAsync");
  if (v == Vec::Grads && reduced_every_microbatch(s) && !is_compute_stream(e.stream)) {
    check(cudaEventRecord(grads_zeroed_, e.stream), "cudaEventRecord (gradients zeroed)");
    for (std::size_t i = 0; i < streams_.size(); ++i)
      if (gemms_[i] && streams_[i] != e.stream)
        check(cudaStreamWaitEvent(streams_[i], grads_zeroed_, 0), "cudaStreamWaitEvent (gradients zeroed)");
  }
}

void CudaKernels::read(const Exec& e, Tensor& dst, std::int64_t at, int s, Vec v, std::int64_t from, std::int64_t n) {
  if (v == Vec::Grads && reduced_every_microbatch(s) && !is_compute_stream(e.stream)) wait_for_compute(e.stream);
  if (n > 0) d2d(dst.as<float>() + at, fp32(s, v) + from, static_cast<std::size_t>(n) * 4, e.stream);
}

void CudaKernels::write(const Exec& e, int s, Vec v, std::int64_t at, const Tensor& src, std::int64_t from,
                        std::int64_t n, bool add) {
  if (n <= 0) return;
  const float* in = src.as<float>() + from;
  if (v == Vec::Params) {  // fp32 masters arriving: converted to the storage type
    if (add) throw RuntimeError("runtime: the CUDA backend does not add into parameters");
    convert(DType::F32, in, config_.dtype,
            static_cast<char*>(model_->device(s).params.data()) + static_cast<std::size_t>(at) * model_->elem(), n,
            e.stream);
  } else if (add) {
    accumulate(DType::F32, fp32(s, v) + at, in, n, e.stream);
  } else {
    d2d(fp32(s, v) + at, in, static_cast<std::size_t>(n) * 4, e.stream);
  }
  // The tied-embedding sum in place (the dataflow's last write of it, summed locally or all-reduced):
  // the dataflow then releases at once the reductions and updates of the two segments it deferred
  // (Dataflow::touches_tied), on other streams, and in the plan these need not wait for the backward
  // that enqueued the sum (V placements with ZeRO-2/3's per-microbatch reduce-scatters: the early
  // microbatches' reduce-scatters of the embedding's segment). On the host the sum is done when the
  // flag is set; here it is enqueued, so every op begun after it waits for it (and for that backward).
  if (v == Vec::TiedGrads && !add) {
    check(cudaEventRecord(tied_sum_, e.stream), "cudaEventRecord (tied sum)");
    tied_sum_recorded_ = true;
  }
}

// ---------------------------------------------------------------------------------------------
// Transport
// ---------------------------------------------------------------------------------------------
int CudaTransport::post(const CommPost<Tensor>& r, const Exec& e) {
  CommRequest q;
  q.kind = r.kind;
  q.stream = e.stream;
  q.pair = r.pair;
  q.peer = r.peer;
  q.boundary = r.boundary;
  q.backward = r.backward;
  q.family = r.family;
  q.group = r.group;
  // Counts as Transport expects them: Send/Recv bytes; AllReduce fp32 elements; ReduceScatter fp32
  // elements per rank's block; AllGather and AllToAll bytes per rank's block.
  switch (r.kind) {
    case CommKind::Send:
      q.send = r.send->data();
      q.count = r.send->bytes();
      break;
    case CommKind::Recv:
      q.recv = r.recv->data();
      q.count = r.recv->bytes();
      break;
    case CommKind::AllReduce:
      q.recv = r.recv->data();
      q.count = static_cast<std::size_t>(r.recv->size());
      break;
    case CommKind::ReduceScatter:
      q.send = r.send->data();
      q.recv = r.recv->data();
      q.count = static_cast<std::size_t>(r.recv->size());
      break;
    case CommKind::AllGather:
      q.send = r.send->data();
      q.recv = r.recv->data();
      q.count = r.send->bytes();
      break;
    case CommKind::AllToAll:
      q.send = r.send->data();
      q.recv = r.recv->data();
      q.count = r.recv->bytes() / std::max<std::size_t>(1, r.group.size());
      break;
  }
  return t_.post(q);
}

// ---------------------------------------------------------------------------------------------
// Backend
// ---------------------------------------------------------------------------------------------
CudaBackend::CudaBackend(const core::Program& program, int device, Transport& transport, const CudaConfig& config) {
  const core::Model model = program_model(program);
  check_capabilities(program, cuda_capabilities());
  kernels_ = std::make_unique<CudaKernels>(program, device, model, config);
  // Each held segment's TP group (dense blocks; routed experts in a TP segment are expert TP) and CP
  // group, whose collectives inside the compute ops go through this transport: the family's group of
  // this device, with the device at its TP (CP) rank.
  auto link = [&](std::size_t s, const char* what, int family, int degree, int rank) {
    const std::vector<int> group = family >= 0 && family < static_cast<int>(program.families.size())
                                       ? program.group_of(family, device)
                                       : std::vector<int>{};
    const auto at = std::find(group.begin(), group.end(), device);
    if (static_cast<int>(group.size()) != degree || at - group.begin() != rank)
      throw std::invalid_argument(fmt::format(
          "plan: segment {}'s {} family {} gives device {} a group of {} devices without it at its {} rank, not one "
          "of degree {}",
          s, what, family, device, group.size(), what, degree));
    return TpLink{&transport, family, group};
  };
  CudaModel& m = kernels_->cuda_model();
  for (std::size_t s = 0; s < program.segments.size(); ++s) {
    const core::ProgramSegment& seg = program.segments[s];
    const int si = static_cast<int>(s);
    if (!m.holds(si)) continue;
    if (seg.tp_degree > 1) m.set_tp(si, link(s, "TP", seg.tp_family, seg.tp_degree, m.layout(si).tp_rank));
    if (seg.cp_degree > 1) m.set_cp(si, link(s, "CP", seg.cp_family, seg.cp_degree, m.layout(si).cp_rank));
  }
  kernels_->cuda_model().set_progress([this] { progress(); });
  transport_ = std::make_unique<CudaTransport>(transport);
  flow_ = std::make_unique<Dataflow<CudaKernels, CudaTransport>>(program, device, *kernels_, *transport_, config.seed,
                                                                 config.data_path);
  flow_->set_loss_scaling(config.adamw.loss_scaling);
}

CudaBackend::~CudaBackend() {
  cudaDeviceSynchronize();
  flow_.reset();  // pending ops' events and buffers, then the data in flight, before the model
  transport_.reset();
  kernels_.reset();
}

std::vector<StateRecord> CudaBackend::checkpoint_records() {
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return state_records(kernels_->cuda_model().state_to_host(kernels_->util()));
}

void CudaBackend::restore(const CanonicalState& state) {
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  load_state(kernels_->cuda_model().host_state(), state);
  kernels_->cuda_model().state_from_host(kernels_->util());
}

std::vector<host::ParamRecord> CudaBackend::param_records() {
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return kernels_->cuda_model().param_records(kernels_->util());
}

}  // namespace piper::runtime::cuda
