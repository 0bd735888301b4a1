// The CUDA backend, op for op as HostBackend (gpu_runtime/src/host_backend.cpp): compute on the op's
// stream with the CudaModel, communication through the Transport, completion by CUDA events.
#include "piper/runtime/cuda/cuda_backend.hpp"

#include <algorithm>
#include <stdexcept>

#include <fmt/format.h>

#include "piper/runtime/executor.hpp"

namespace piper::runtime::cuda {

namespace {

bool is_backward(core::Pass p) { return p == core::Pass::B || p == core::Pass::BI; }

template <class Map, class K>
auto take(Map& m, const K& key, const char* what) {
  auto it = m.find(key);
  if (it == m.end()) throw RuntimeError(fmt::format("runtime: plan order violated: {} is not available", what));
  auto v = std::move(it->second);
  m.erase(it);
  return v;
}

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

struct CudaBackend::Pending {
  cudaEvent_t begin = nullptr;  // recorded before the op's work
  cudaEvent_t end = nullptr;    // recorded after all of it (for communication: after the finishing work)
  int ticket = -1;              // transport request in flight
  int peer = -1;
  bool dispatch = false;  // ALL_TO_ALL: the first of its segment/pass/microbatch
  std::vector<int> group;
  PacketShape packets;
  std::int64_t block = 0;
  Tensor send, recv;
};

CudaBackend::CudaBackend(const core::Program& program, int device, Transport& transport, const CudaConfig& config)
    : program_(program), plan_(program.plan_for(device)), device_(device), transport_(transport), config_(config) {
  const core::Model model = program_model(program);
  for (std::size_t s = 0; s < program.segments.size(); ++s) {
    if (program.segments[s].reduce_every_microbatch)
      throw std::invalid_argument(
          fmt::format("plan: segment {} reduces its ZeRO-2/3 gradients after every microbatch; the CUDA backend "
                      "reduces once per step (compile with --reduce-every step), the host backend runs both",
                      s));
    if (program.segments[s].zero_shards != program.segments[s].replicas)
      throw std::invalid_argument(
          fmt::format("plan: segment {} uses HSDP (ZeRO shards over groups of {} of its {} replicas); the CUDA backend "
                      "does not run it yet, the host backend does",
                      s, program.segments[s].zero_shards, program.segments[s].replicas));
  }
  for (std::size_t s = 0; s < program.segments.size(); ++s)
    if (program.segments[s].cp_degree > 1)
      throw std::invalid_argument(
          fmt::format("plan: segment {} is context-parallel (cp_degree {}); the CUDA backend does not run context "
                      "parallelism yet, the host backend does",
                      s, program.segments[s].cp_degree));
  num_layers_ = static_cast<int>(model.layers().size());
  shape_ = data_shape(program);
  loss_scale_ = 1.0f / static_cast<float>(shape_.global_tokens());
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
  std::vector<host::SegmentSpec> specs = device_segments(program, device);
  for (const auto& sp : specs)  // expert TP runs on the host backend only
    for (int l = sp.first_layer; sp.tp_degree > 1 && l < sp.last_layer; ++l)
      if (model.layers().at(static_cast<std::size_t>(l)).kind == core::LayerKind::MoeExperts)
        throw std::invalid_argument(
            fmt::format("plan: segment {} splits its routed experts over {} expert-tensor-parallel ranks; "
                        "the CUDA backend does not run expert TP (compile with --etp 1)",
                        sp.segment, sp.tp_degree));
  model_ = std::make_unique<CudaModel>(model, std::move(specs), config.seed, config.dtype, *alloc_, util_);
  stream_ = std::make_unique<host::TokenStream>(model.config() ? model.config()->vocab : 0, shape_.seq_len, config.seed,
                                                config.data_path);
  msg_ = MessageShape{shape_.micro_batch_size * shape_.seq_len, model_->hidden(), model_->top_k(), config.dtype};
  std::size_t base = 0;
  for (const auto& s : plan_.streams) stream_base_.push_back(base), base += s.ops.size();
}

CudaBackend::~CudaBackend() {
  cudaDeviceSynchronize();
  for (auto& [at, p] : pending_) {
    if (p->begin) cudaEventDestroy(p->begin);
    if (p->end) cudaEventDestroy(p->end);
  }
  pending_.clear();
  forward_.clear();
  backward_.clear();
  stash_.clear();
  ep_source_.clear();
  ep_grad_.clear();
  ep_in_.clear();
  ep_out_.clear();
  model_.reset();
  gemms_.clear();
  alloc_.reset();
  if (step_start_) cudaEventDestroy(step_start_);
  for (auto s : streams_) cudaStreamDestroy(s);
  if (util_) cudaStreamDestroy(util_);
}

Exec CudaBackend::exec(int stream) const {
  return Exec{streams_.at(static_cast<std::size_t>(stream)), gemms_.at(static_cast<std::size_t>(stream)).get(),
              alloc_.get()};
}
Exec CudaBackend::util() const { return Exec{util_, nullptr, alloc_.get()}; }

int CudaBackend::mb_of(const core::Op& op) const { return op.microbatch; }  // -1 only outside passes (data_shape)

int CudaBackend::data_rank_of(const core::Op& op) const {
  const int pos = program_.position_in(op.device_set, device_);
  if (pos < 0)
    throw RuntimeError(fmt::format("runtime: device {} is not in the device set of '{}'", device_, op.label));
  return pos;
}

void CudaBackend::begin_step(int step) {
  step_ = step;
  loss_sum_ = 0;
  if (step_start_) cudaEventDestroy(step_start_);
  step_start_ = timed_event(util_);
  // Completed before any op's events are read against it: cudaEventElapsedTime fails (NotReady) if
  // either event is pending, and an op on another stream can finish before the idle util stream
  // has processed this record.
  check(cudaEventSynchronize(step_start_), "cudaEventSynchronize (step start)");
  timeline_ = core::DeviceTimeline{};
  timeline_.spans.assign(static_cast<std::size_t>(plan_.op_count()), core::OpSpan{});
}

void CudaBackend::end_step() {
  if (!forward_.empty() || !backward_.empty() || !stash_.empty() || !ep_in_.empty() || !ep_out_.empty() ||
      !ep_grad_.empty() || !pending_.empty())
    throw RuntimeError(
        fmt::format("runtime: device {} ended step {} with unconsumed data ({} activations, {} gradients, {} stashes)",
                    device_, step_, forward_.size(), backward_.size(), stash_.size()));
  ep_source_.clear();
  a2a_seen_.clear();
  // Every op completed: the loss accumulator is final. Read it and clear it for the next step.
  float loss = 0;
  check(cudaMemcpyAsync(&loss, model_->loss_accumulator(), sizeof(float), cudaMemcpyDeviceToHost, util_),
        "cudaMemcpyAsync loss");
  check(cudaMemsetAsync(model_->loss_accumulator(), 0, sizeof(float), util_), "cudaMemsetAsync");
  check(cudaStreamSynchronize(util_), "cudaStreamSynchronize");
  loss_sum_ = loss;
  ++steps_done_;
}

bool CudaBackend::start(const core::OpRef& at, const core::Op& op) {
  auto p = std::make_unique<Pending>();
  const Exec e = exec(at.stream);
  p->begin = timed_event(e.stream);
  switch (op.kind) {
    case core::OpKind::Compute:
      run_compute(e, op);
      p->end = timed_event(e.stream);
      break;
    case core::OpKind::Update: {
      const AdamW cfg{config_.adamw.lr, config_.adamw.beta1, config_.adamw.beta2, config_.adamw.eps,
                      config_.adamw.weight_decay};
      for (int s : op.segments) model_->update(e, s, cfg, steps_done_ + 1);
      p->end = timed_event(e.stream);
      break;
    }
    default:
      start_comm(e, op, *p);
      break;
  }
  pending_[at] = std::move(p);
  return poll(at, op);
}

bool CudaBackend::poll(const core::OpRef& at, const core::Op& op) {
  auto it = pending_.find(at);
  if (it == pending_.end())
    throw RuntimeError(fmt::format("runtime: polled an op that is not in flight: {}", op.label));
  Pending& p = *it->second;
  const Exec e = exec(at.stream);
  if (p.ticket >= 0) {
    if (!transport_.test(p.ticket)) return false;
    p.ticket = -1;
    finish_comm(e, op, p);
    p.end = timed_event(e.stream);
  }
  const cudaError_t q = cudaEventQuery(p.end);
  if (q == cudaErrorNotReady) return false;
  check(q, fmt::format("'{}' on device {}", op.label, device_).c_str());
  float b = 0, en = 0;
  check(cudaEventElapsedTime(&b, step_start_, p.begin), "cudaEventElapsedTime");
  check(cudaEventElapsedTime(&en, step_start_, p.end), "cudaEventElapsedTime");
  timeline_.spans[stream_base_[static_cast<std::size_t>(at.stream)] + static_cast<std::size_t>(at.index)] =
      core::OpSpan{at.stream, at.index, b * 1e-3, en * 1e-3};
  cudaEventDestroy(p.begin);
  cudaEventDestroy(p.end);
  pending_.erase(it);
  return true;
}

void CudaBackend::run_compute(const Exec& e, const core::Op& op) {
  const int s = op.segment, mb = mb_of(op);
  const auto& sg = seg(s);
  const bool sharded = sg.shard_degree > 1;
  const bool has_head = sg.last_layer == num_layers_;
  const SegKey sk{s, mb};
  if (op.pass == core::Pass::F) {
    if (sharded) {
      auto from = take(ep_in_, EpKey{s, false, mb}, "dispatched expert inputs");
      model_->experts_forward_entries(e, s, from, stash_[sk], &ep_out_[EpKey{s, false, mb}]);
      return;
    }
    ForwardState state;
    if (sg.first_layer > 0)
      state = take(forward_, Key{mb, data_rank_of(op), sg.first_layer}, "the activation entering the segment");
    const auto data =
        stream_->microbatch(step_, mb, data_rank_of(op), shape_.microbatches, shape_.ranks, shape_.micro_batch_size);
    model_->forward(e, s, data, loss_scale_, state, stash_[sk]);
    if (!has_head) forward_[Key{mb, data_rank_of(op), sg.last_layer}] = std::move(state);
    return;
  }
  if (op.pass == core::Pass::BW) {
    model_->backward_weight(e, s, stash_.at(sk));
    stash_.erase(sk);
    return;
  }
  if (sharded) {
    auto from = take(ep_in_, EpKey{s, true, mb}, "dispatched expert gradients");
    model_->experts_backward_entries(e, s, from, stash_.at(sk), &ep_out_[EpKey{s, true, mb}]);
  } else {
    BackwardState g;
    if (!has_head) g = take(backward_, Key{mb, data_rank_of(op), sg.last_layer}, "the gradient leaving the segment");
    model_->backward_input(e, s, g, stash_.at(sk));
    if (sg.first_layer > 0) backward_[Key{mb, data_rank_of(op), sg.first_layer}] = std::move(g);
  }
  if (op.pass == core::Pass::B) {
    model_->backward_weight(e, s, stash_.at(sk));
    stash_.erase(sk);
  }
}

void CudaBackend::start_comm(const Exec& e, const core::Op& op, Pending& p) {
  const int mb = mb_of(op);
  CommRequest r;
  r.stream = e.stream;
  r.pair = op.pair;
  if (op.family >= 0 && op.kind != core::OpKind::Send && op.kind != core::OpKind::Recv) {
    p.group = program_.group_of(op.family, device_);
    if (p.group.empty())
      throw RuntimeError(
          fmt::format("runtime: device {} holds no group of family {} for '{}'", device_, op.family, op.label));
    r.family = op.family;
    r.group = p.group;
  }
  const int ranks = static_cast<int>(p.group.size());
  switch (op.kind) {
    case core::OpKind::Send: {
      const auto& sg = seg(op.segment);
      p.peer = program_.peer_of(op, device_);
      r.kind = CommKind::Send;
      r.peer = p.peer;
      r.backward = is_backward(op.pass);
      r.boundary = r.backward ? sg.first_layer : sg.last_layer;
      if (r.backward)
        p.send =
            pack_backward(e, msg_, take(backward_, Key{mb, data_rank_of(op), sg.first_layer}, "the gradient to send"));
      else
        p.send =
            pack_forward(e, msg_, take(forward_, Key{mb, data_rank_of(op), sg.last_layer}, "the activation to send"));
      r.send = p.send.data();
      r.count = p.send.bytes();
      break;
    }
    case core::OpKind::Recv: {
      const auto& sg = seg(op.segment);
      p.peer = program_.peer_of(op, device_);
      r.kind = CommKind::Recv;
      r.peer = p.peer;
      r.backward = is_backward(op.pass);
      r.boundary = r.backward ? sg.last_layer : sg.first_layer;
      p.recv = new_tensor(e, 1, static_cast<std::int64_t>(msg_.bytes()), 1);
      r.recv = p.recv.data();
      r.count = p.recv.bytes();
      break;
    }
    case core::OpKind::AllReduce: {
      // The bucket's gradients, concatenated (as the host backend does), summed in place.
      std::int64_t n = 0;
      for (int s : op.segments) n += model_->device(s).grads.size();
      p.recv = new_tensor(e, n, 1, 4);
      std::int64_t at = 0;
      for (int s : op.segments) {
        const auto& g = model_->device(s).grads;
        d2d(p.recv.as<float>() + at, g.data(), g.bytes(), e.stream);
        at += g.size();
      }
      r.kind = CommKind::AllReduce;
      r.recv = p.recv.data();
      r.count = static_cast<std::size_t>(n);
      break;
    }
    case core::OpKind::ReduceScatter: {
      // Block r holds replica r's chunk of every segment of the bucket (zero padded).
      std::int64_t block = 0;
      for (int s : op.segments) block += model_->layout(s).chunk_floats;
      p.block = block;
      p.send = zeros(e, block * ranks, 1, 4);
      for (int rk = 0; rk < ranks; ++rk) {
        std::int64_t at = rk * block;
        for (int s : op.segments) {
          auto& sp = model_->layout(s);
          if (sp.replicas != ranks)
            throw RuntimeError(fmt::format("runtime: '{}' reduces over {} ranks but segment {} has {} replicas",
                                           op.label, ranks, s, sp.replicas));
          const std::int64_t n = static_cast<std::int64_t>(sp.params.size());
          const std::int64_t b = std::min(n, rk * sp.chunk_floats), en = std::min(n, b + sp.chunk_floats);
          d2d(p.send.as<float>() + at, model_->device(s).grads.as<float>() + b, static_cast<std::size_t>(en - b) * 4,
              e.stream);
          at += sp.chunk_floats;
        }
      }
      p.recv = new_tensor(e, block, 1, 4);
      r.kind = CommKind::ReduceScatter;
      r.send = p.send.data();
      r.recv = p.recv.data();
      r.count = static_cast<std::size_t>(block);
      break;
    }
    case core::OpKind::AllGather: {
      // fp32 master chunks (padded to chunk_floats), converted to the storage type when they arrive.
      std::int64_t block = 0;
      for (int s : op.segments) block += model_->layout(s).chunk_floats;
      p.block = block;
      p.send = zeros(e, block, 1, 4);
      std::int64_t at = 0;
      for (int s : op.segments) {
        const auto& m = model_->device(s).master;
        d2d(p.send.as<float>() + at, m.data(), m.bytes(), e.stream);
        at += model_->layout(s).chunk_floats;
      }
      p.recv = new_tensor(e, block * ranks, 1, 4);
      r.kind = CommKind::AllGather;
      r.send = p.send.data();
      r.recv = p.recv.data();
      r.count = static_cast<std::size_t>(block) * 4;
      break;
    }
    case core::OpKind::AllToAll: {
      const int s = op.segment;
      if (s < 0 || seg(s).shard_degree != ranks)
        throw RuntimeError(fmt::format("runtime: '{}' exchanges over {} ranks but its segment is sharded {} ways",
                                       op.label, ranks, s < 0 ? 0 : seg(s).shard_degree));
      const bool backward = is_backward(op.pass);
      const EpKey key{s, backward, mb};
      // The first all-to-all of a (segment, pass, microbatch) carries tokens into the sharded
      // experts, the second carries their results back: dataflow order, not a schedule property.
      p.dispatch = a2a_seen_[key]++ == 0;
      p.packets =
          PacketShape{shape_.micro_batch_size * shape_.seq_len * model_->top_k(), model_->hidden(), config_.dtype};
      std::vector<ExpertPacket> out;
      const SegKey sk{s, mb};
      const int first = seg(s).first_layer;
      if (!backward && p.dispatch) {
        auto& state = forward_.at(Key{mb, data_rank_of(op), first});
        ep_source_[sk] = model_->route(e, state, ranks);
        out = model_->dispatch_forward(e, state, ep_source_[sk]);
      } else if (backward && p.dispatch) {
        auto g = take(backward_, Key{mb, data_rank_of(op), seg(s).last_layer}, "the gradient entering the experts");
        out = model_->dispatch_backward(e, g, ep_source_.at(sk));
        ep_grad_[sk] = std::move(g);
      } else {
        out = take(ep_out_, key, "the experts' results");
      }
      p.send = pack_packets(e, p.packets, out);
      p.recv = new_tensor(e, 1, static_cast<std::int64_t>(p.packets.block_bytes()) * ranks, 1);
      r.kind = CommKind::AllToAll;
      r.send = p.send.data();
      r.recv = p.recv.data();
      r.count = p.packets.block_bytes();
      break;
    }
    default:
      throw RuntimeError(fmt::format("runtime: unexpected op kind for communication: {}", op.label));
  }
  p.ticket = transport_.post(r);
}

void CudaBackend::finish_comm(const Exec& e, const core::Op& op, Pending& p) {
  const int mb = mb_of(op);
  switch (op.kind) {
    case core::OpKind::Send:
      break;
    case core::OpKind::Recv: {
      const auto& sg = seg(op.segment);
      if (is_backward(op.pass))
        backward_[Key{mb, data_rank_of(op), sg.last_layer}] = unpack_backward(e, msg_, p.recv);
      else
        forward_[Key{mb, data_rank_of(op), sg.first_layer}] = unpack_forward(e, msg_, p.recv);
      break;
    }
    case core::OpKind::AllReduce: {
      std::int64_t at = 0;
      for (int s : op.segments) {
        auto& g = model_->device(s).grads;
        d2d(g.data(), p.recv.as<float>() + at, g.bytes(), e.stream);
        at += g.size();
      }
      break;
    }
    case core::OpKind::ReduceScatter: {
      std::int64_t at = 0;
      for (int s : op.segments) {
        auto& d = model_->device(s);
        d2d(d.grad_chunk.data(), p.recv.as<float>() + at, d.grad_chunk.bytes(), e.stream);
        d.grad_chunk_ready = true;
        at += model_->layout(s).chunk_floats;
      }
      break;
    }
    case core::OpKind::AllGather: {
      const auto ranks = static_cast<std::int64_t>(p.group.size());
      std::int64_t at = 0;
      for (int s : op.segments) {
        auto& sp = model_->layout(s);
        auto& d = model_->device(s);
        const std::int64_t n = static_cast<std::int64_t>(sp.params.size());
        for (std::int64_t r = 0; r < ranks; ++r) {
          const std::int64_t b = std::min(n, r * sp.chunk_floats), en = std::min(n, b + sp.chunk_floats);
          if (en > b)
            convert(DType::F32, p.recv.as<float>() + r * p.block + at, config_.dtype,
                    static_cast<char*>(d.params.data()) + static_cast<std::size_t>(b) * model_->elem(), en - b,
                    e.stream);
        }
        at += sp.chunk_floats;
        if (op.pass != core::Pass::None) ++d.gathered;  // ZeRO-3 gather before a use; released with its buffer
      }
      break;
    }
    case core::OpKind::AllToAll: {
      const int ranks = static_cast<int>(p.group.size());
      auto in = unpack_packets(e, p.packets, p.recv, ranks);
      const int s = op.segment;
      const bool backward = is_backward(op.pass);
      const SegKey sk{s, mb};
      if (p.dispatch) {
        ep_in_[EpKey{s, backward, mb}] = std::move(in);
      } else if (!backward) {
        auto state = take(forward_, Key{mb, data_rank_of(op), seg(s).first_layer}, "the activation around the experts");
        model_->combine_forward(e, state, ep_source_.at(sk), in);
        forward_[Key{mb, data_rank_of(op), seg(s).last_layer}] = std::move(state);
      } else {
        auto g = take(ep_grad_, sk, "the gradient around the experts");
        model_->combine_backward(e, g, ep_source_.at(sk), in);
        backward_[Key{mb, data_rank_of(op), seg(s).first_layer}] = std::move(g);
      }
      break;
    }
    default:
      break;
  }
}

void CudaBackend::buffer_freed(int buffer) {
  const auto& b = plan_.buffers.at(static_cast<std::size_t>(buffer));
  if (b.kind != core::BufferKind::GatheredParameters) return;
  const auto& op =
      plan_.streams.at(static_cast<std::size_t>(b.alloc.stream)).ops.at(static_cast<std::size_t>(b.alloc.index));
  for (int s : op.segments) {
    auto& d = model_->device(s);
    if (--d.gathered <= 0) {
      d.gathered = 0;
      // Poisoned before any later op is issued: the next gather's conversion cannot race with it.
      model_->poison_params(util(), s);
      check(cudaStreamSynchronize(util_), "cudaStreamSynchronize");
    }
  }
}

std::string CudaBackend::describe_wait(const core::Op& op) const {
  if (op.kind == core::OpKind::Send || op.kind == core::OpKind::Recv)
    return fmt::format("'{}' with device {} ({})", op.label, program_.peer_of(op, device_), transport_.name());
  if (op.family >= 0) {
    std::string members;
    for (int d : program_.group_of(op.family, device_)) members += fmt::format("{}{}", members.empty() ? "" : ",", d);
    return fmt::format("'{}' on devices [{}] ({})", op.label, members, transport_.name());
  }
  return fmt::format("'{}'", op.label);
}

std::vector<StateRecord> CudaBackend::checkpoint_records() {
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return state_records(model_->state_to_host(util()));
}

void CudaBackend::restore(const CanonicalState& state) {
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  load_state(model_->host_state(), state);
  model_->state_from_host(util());
}

std::vector<host::ParamRecord> CudaBackend::param_records() {
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return model_->param_records(util());
}

}  // namespace piper::runtime::cuda
