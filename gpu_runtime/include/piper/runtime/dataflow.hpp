// The executor dataflow shared by every backend: which tensor an op of a device's plan reads and
// writes, where it lives between ops (keyed by microbatch, data-parallel rank and layer boundary), how
// sends/receives and collectives are routed and packed (ZeRO chunk blocks, expert packets), the
// tied-embedding sum and ZeRO-3's gathered-parameter lifetimes. It is written once, against two small
// interfaces that a backend implements:
//  - Kernels: what the device computes (a segment's forward/backward passes, the expert routing, the
//    update) and how its tensors become messages and float vectors (pack/unpack, ranges of a segment's
//    gradients, masters and parameters). The host backend implements it with Eigen on the CPU, the
//    CUDA backend with its GPU model (gpu_runtime/cuda).
//  - Transport: post/test of one communication (Send, Recv, AllReduce, ReduceScatter, AllGather,
//    AllToAll) between the buffers the kernels made: MPI on the host, NCCL or loopback on CUDA.
// Dataflow<K, T> is the runtime::Backend that the Executor drives; see docs/runtime.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "piper/core/program.hpp"
#include "piper/runtime/backend.hpp"
#include "piper/runtime/comm.hpp"
#include "piper/runtime/executor.hpp"
#include "piper/runtime/host_model.hpp"

namespace piper::runtime {

// ---- Backend-neutral views of a Program (dataflow.cpp) ----

// The data-parallel shape of a program, as the data and the loss need it.
struct DataShape {
  int microbatches = 1;  // Program::microbatches
  int ranks = 1;         // data-parallel ranks: devices of a compute op's device set
  std::int64_t micro_batch_size = 1, seq_len = 1;
  std::int64_t global_tokens() const {
    return static_cast<std::int64_t>(microbatches) * ranks * micro_batch_size * seq_len;
  }
};
DataShape data_shape(const core::Program& program);

// The model a Program trains: its spec with the Program's training shape; checks the layer count.
core::Model program_model(const core::Program& program);

// Which segments `device` holds and how (shard / replica index, ZeRO level, TP and CP ranks).
std::vector<host::SegmentSpec> device_segments(const core::Program& program, int device);

// The tensor and context parallelism of a device set: that of its TP segments (routed experts' ETP
// aside) and the largest CP degree of its segments.
struct StageTp {
  int degree = 1;
  bool sequence_parallel = false;
  int cp = 1;  // context parallelism (model-wide): blocks of degree·cp devices share a data-parallel rank
};
StageTp stage_tp(const core::Program& program, core::DeviceSetId set);

// What a backend can run. A plan that needs anything else is refused, in one line naming the
// feature, before step 1 (check_capabilities).
struct Capabilities {
  std::string backend;            // "the CUDA backend"
  std::string alternative;        // what runs it instead, e.g. "the host backend (--backend host)"
  bool tensor_parallel = true;    // TP (column/row-parallel GEMMs)
  bool sequence_parallel = true;  // SP (TP with sequence-sharded norms)
  bool expert_tensor_parallel = true;
  bool context_parallel = true;
  bool hsdp = true;                     // ZeRO shards over groups smaller than the replicas
  bool reduce_every_microbatch = true;  // ZeRO-2/3 reduce-scatter after every microbatch
  bool gpt_layers = true;               // LayerNorm, GELU, linear biases, learned positions, tied embeddings
  // Experts whose all-to-alls are chunked (ShardDirective::chunks: several ops of one segment, microbatch
  // and pass, each on 1/N of the tokens): no backend keys its data by chunk yet, so both refuse them.
  bool chunked_all_to_all = false;
};
Capabilities host_capabilities();
Capabilities cuda_capabilities();
// The first feature the plan needs that `caps` lacks, as one line ("plan: segment 1 is tensor-parallel
// (tp_degree 2); the CUDA backend does not run tensor parallelism, ..."); empty when it can run.
std::string unsupported_feature(const core::Program& program, const Capabilities& caps);
// Throws std::invalid_argument with unsupported_feature's line when it is not empty.
void check_capabilities(const core::Program& program, const Capabilities& caps);

// Gradient clipping by global norm: the factor every gradient of the step is multiplied by,
// min(1, max_norm / (norm + 1e-6)) with norm = sqrt(norm_sq) (torch.nn.utils.clip_grad_norm_'s rule;
// a non-finite norm gives a non-finite factor, and the update's non-finite state stops the run).
float clip_scale(double norm_sq, double max_norm);
// The factor every gradient of the step is multiplied by before the update: the clipping factor of
// the unscaled norm's square over the loss scale (a power of two: exact).
float unscale_and_clip(double unscaled_norm_sq, double max_norm, double loss_scale);

// ---- The two interfaces ----

// One communication of one device over buffers of the kernels' type. Sizes are the buffers' own:
// AllReduce sums `recv` in place; ReduceScatter sends ranks blocks of recv's size; AllGather
// receives ranks blocks of send's size; AllToAll exchanges ranks equal blocks of send.
template <class Buf>
struct CommPost {
  CommKind kind = CommKind::Send;
  int peer = -1;           // Send/Recv: the device at the other end
  int pair = -1;           // the pairing id (Op::pair): a SEND and its RECV, or one collective occurrence, share it
  int boundary = 0;        // Send/Recv: model layer boundary the tensor crosses
  bool backward = false;   // Send/Recv: gradient (true) or activation
  int family = -1;         // collectives: Program family
  std::vector<int> group;  // collectives: the devices of my group, in rank order
  Buf* send = nullptr;     // stays valid until the transport's test() is true
  Buf* recv = nullptr;
};

// The float vectors of a segment that collectives read and write (fp32 everywhere; Params is written
// converted to the storage type by a backend that keeps another one).
enum class Vec { Grads, GradChunk, Master, Params, TiedGrads };

// The interfaces, as the members Dataflow calls (checked when Dataflow<K, T> is instantiated):
//
// struct Kernels {
//   using Ctx, Mark, Buf, Forward, Backward, Stash, Source, Packet;  // Mark: an op's completion marker
//   const core::Model& model();  Ctx ctx(int stream);
//   void begin_step(int step);  double end_step(double host_loss);  // returns the step's loss sum
//   Mark begin_op(const Ctx&);  void end_op(const Ctx&, Mark&);  bool op_done(const core::OpRef&, Mark&, const
//   core::Op&); double forward(ctx, seg, data, loss_scale, Forward&, Stash&);   // the head's summed loss (or 0) void
//   backward_input(ctx, seg, Backward&, Stash&);  void backward_weight(ctx, seg, Stash&); Source route(ctx, const
//   Forward&, ranks);  dispatch_forward / dispatch_backward -> std::vector<Packet>; experts_forward_entries /
//   experts_backward_entries (ctx, seg, from, Stash&, std::vector<Packet>* to); combine_forward(ctx, Forward&, Source&,
//   from);  combine_backward(ctx, Backward&, const Source&, from); void update(ctx, seg, int step);  void grad_sq(ctx,
//   segments, Buf& out, double loss_scale);  // the squares of the gradients over the loss scale (unscaled first: the
//   scaled squares could overflow)  double clip_to(ctx, const Buf& norm_sq, double max_norm, double loss_scale);
//   // returns norm_sq  void discard_grads(ctx, seg);  // an overflowed step: zero the gradients, no update  void
//   poison(int seg); Buf pack_forward(ctx, Forward&&);  Buf pack_backward(ctx, Backward&&);  Buf message_buffer(ctx);
//   Forward unpack_forward(ctx, Buf&);  Backward unpack_backward(ctx, Buf&); Buf pack_packets(ctx, const
//   std::vector<Packet>&, ranks);  Buf packet_buffer(ctx, ranks); std::vector<Packet> unpack_packets(ctx, Buf&, ranks);
//   Buf floats(ctx, std::int64_t n);   // zeroed fp32 std::int64_t size(seg, Vec);  void zero(ctx, seg, Vec); void
//   read(ctx, Buf& dst, std::int64_t at, seg, Vec, std::int64_t from, std::int64_t n);  // dst[at..] = v[from..] void
//   write(ctx, seg, Vec, std::int64_t at, const Buf& src, std::int64_t from, std::int64_t n, bool add); bool&
//   grad_chunk_ready(seg);  int& gathered(seg);  host::SegmentParams& layout(seg); bool tied();  int embedding_layer();
//   int head_layer();  int top_k();
// };
// struct Transport {
//   int post(const CommPost<Buf>&, const Ctx&);  bool test(int ticket);  std::string name() const;
// };

// ---- The dataflow ----

class DataflowBase {
 public:
  DataflowBase(const core::Program& program, int device);
  const core::Program& program() const { return program_; }
  const core::Plan& plan() const { return plan_; }
  int device() const { return device_; }
  const DataShape& shape() const { return shape_; }
  float loss_scale() const { return loss_scale_; }
  double grad_norm() const { return grad_norm_; }  // clip_grad: the last step's global gradient norm; else -1
  // Loss scaling (host::LossScaling, the same on every device): set before step 1; the state moves
  // at each end_step, identically on every device (all see the same global gradient norm).
  void set_loss_scaling(const host::LossScaling& cfg) {
    scaling_ = cfg;
    scale_state_ = host::initial_loss_scale(cfg);
  }
  host::LossScaleState loss_scale_state() const { return scale_state_; }
  void set_loss_scale_state(host::LossScaleState s) { scale_state_ = s; }  // resuming a checkpoint
  bool overflowed() const { return overflowed_; }  // the last step's gradients overflowed: its update was skipped
  int steps_done() const { return steps_done_; }   // optimizer steps so far (AdamW's bias correction counts them)
  void set_steps_done(int steps) { steps_done_ = steps; }

 protected:
  // The data-parallel rank of this device in `op` (TP ranks of a group and the CP ranks of a block
  // share one); this rank's tokens of a microbatch (CP: its chunks of each sequence).
  int data_rank_of(const core::Op& op) const;
  host::MicrobatchData local_tokens(host::MicrobatchData d, const core::Op& op) const;
  const core::ProgramSegment& seg(int s) const { return program_.segments.at(static_cast<std::size_t>(s)); }
  std::vector<int> group_of(const core::Op& op) const;
  std::string describe(const core::Op& op, const std::string& transport) const;
  // Tied embeddings whose embedding and head sit in different segments: which copy this device
  // holds and how the two are summed (see Dataflow::tied_backward_done).
  struct TiedSync {
    int embed_seg = -1, head_seg = -1;  // the segments, when they differ and this device holds one
    bool local = false;                 // this device holds both (same data and TP rank)
    int family = -1;                    // the plan's "tied-embedding" family (-1: none)
    std::map<int, int> backward_done;   // segment -> B/BW ops run this step
    bool finished = false;              // the sum is in place for this step
    int held() const { return embed_seg >= 0 ? embed_seg : head_seg; }  // across devices: the one here
  };
  void setup_tied(bool tied, int embedding_layer, int head_layer, const std::string& model_name);
  bool is_tied_sum(const core::Op& op) const {
    return tied_.family >= 0 && op.family == tied_.family && op.kind == core::OpKind::AllReduce;
  }
  bool touches_tied(const core::Op& op) const;  // a local sum still due before this op
  bool is_grad_norm(const core::Op& op) const { return norm_family_ >= 0 && op.family == norm_family_; }

  const core::Program& program_;
  const core::Plan& plan_;
  int device_;
  DataShape shape_;
  float loss_scale_ = 1;  // the loss gradient of a token this step (begin_step: scale / tokens)
  int num_layers_ = 0;
  std::vector<int> set_tp_, set_cp_;  // device set -> TP degree of its stage, CP degree of its segments
  std::unique_ptr<host::TokenStream> stream_;
  TiedSync tied_;
  int norm_family_ = -1;   // the grad-norm family (clip_grad), or -1
  double grad_norm_ = -1;  // the last step's global gradient norm (clip_grad), or -1
  host::LossScaling scaling_;
  host::LossScaleState scale_state_;
  bool overflowed_ = false;
  std::vector<int> held_segments_;  // the segments this device holds parameters of
  int step_ = 0, steps_done_ = 0;
  double loss_sum_ = 0;
};

template <class Map, class K>
auto take_from(Map& m, const K& key, const char* what) {
  auto it = m.find(key);
  if (it == m.end()) throw RuntimeError(fmt::format("runtime: plan order violated: {} is not available", what));
  auto v = std::move(it->second);
  m.erase(it);
  return v;
}

inline bool is_backward_pass(core::Pass p) { return p == core::Pass::B || p == core::Pass::BI; }

template <class K, class T>
class Dataflow : public Backend, public DataflowBase {
 public:
  using Ctx = typename K::Ctx;
  using Buf = typename K::Buf;

  Dataflow(const core::Program& program, int device, K& kernels, T& transport, std::uint64_t seed,
           const std::string& data_path)
      : DataflowBase(program, device), k_(kernels), t_(transport) {
    const core::Model& model = k_.model();
    stream_ = std::make_unique<host::TokenStream>(model.config() ? model.config()->vocab : 0, shape_.seq_len, seed,
                                                  data_path);
    setup_tied(k_.tied(), k_.embedding_layer(), k_.head_layer(), model.name());
  }

  double loss_sum() const { return loss_sum_; }

  void begin_step(int step) override {
    step_ = step;
    loss_sum_ = 0;
    overflowed_ = false;
    // The loss gradient of the step's mean token loss, times the loss scale (a power of two: exact).
    loss_scale_ = host::scaled_loss_gradient(scale_state_.scale, shape_.global_tokens());
    k_.begin_step(step);
  }

  void end_step() override {
    // Every tensor the plan produced must have been consumed: leftovers mean a plan the runtime misread.
    if (!forward_.empty() || !backward_.empty() || !stash_.empty() || !ep_in_.empty() || !ep_out_.empty() ||
        !ep_grad_.empty() || !pending_.empty())
      throw RuntimeError(fmt::format(
          "runtime: device {} ended step {} with unconsumed data ({} activations, {} gradients, {} stashes)", device_,
          step_, forward_.size(), backward_.size(), stash_.size()));
    ep_source_.clear();
    a2a_seen_.clear();
    if ((tied_.embed_seg >= 0 || tied_.head_seg >= 0) && !tied_.finished)
      throw RuntimeError(fmt::format("runtime: device {} ended step {} before its tied-embedding gradients were summed",
                                     device_, step_));
    tied_.backward_done.clear();
    tied_.finished = false;
    loss_sum_ = k_.end_step(loss_sum_);
    scale_state_ = host::next_loss_scale(scaling_, scale_state_, overflowed_);
    ++steps_done_;
  }

  bool start(const core::OpRef& at, const core::Op& op) override {
    auto p = std::make_unique<Pending>();
    if (touches_tied(op)) {
      p->deferred = true;
      pending_[at] = std::move(p);
      return false;
    }
    const Ctx c = k_.ctx(at.stream);
    p->mark = k_.begin_op(c);
    Pending& ref = *p;
    pending_[at] = std::move(p);
    switch (op.kind) {
      case core::OpKind::Compute:
        run_compute(c, op);
        k_.end_op(c, ref.mark);
        break;
      case core::OpKind::Update:
        for (int s : op.segments)
          if (overflowed_)
            k_.discard_grads(c, s);  // loss scaling: the step's gradients overflowed, its update is skipped
          else
            k_.update(c, s, steps_done_ + 1);
        k_.end_op(c, ref.mark);
        break;
      default:
        start_comm(c, op, ref);
        break;
    }
    return poll(at, op);
  }

  bool poll(const core::OpRef& at, const core::Op& op) override {
    auto it = pending_.find(at);
    if (it == pending_.end())
      throw RuntimeError(fmt::format("runtime: polled an op that is not in flight: {}", op.label));
    Pending& p = *it->second;
    if (p.deferred) {
      if (touches_tied(op)) return false;
      pending_.erase(it);
      return start(at, op);
    }
    if (p.ticket >= 0) {
      if (!t_.test(p.ticket)) return false;
      p.ticket = -1;
      const Ctx c = k_.ctx(at.stream);
      finish_comm(c, op, p);
      k_.end_op(c, p.mark);
    }
    if (!k_.op_done(at, p.mark, op)) return false;
    pending_.erase(it);
    return true;
  }

  // ZeRO-3: the parameters gathered for a use are released (poisoned) with the last buffer holding them.
  void buffer_freed(int buffer) override {
    const auto& b = plan_.buffers.at(static_cast<std::size_t>(buffer));
    if (b.kind != core::BufferKind::GatheredParameters) return;
    const auto& op =
        plan_.streams.at(static_cast<std::size_t>(b.alloc.stream)).ops.at(static_cast<std::size_t>(b.alloc.index));
    for (int s : op.segments) {
      int& g = k_.gathered(s);
      if (--g <= 0) {
        g = 0;
        k_.poison(s);
      }
    }
  }

  std::string describe_wait(const core::Op& op) const override { return describe(op, t_.name()); }

 private:
  struct Pending {
    bool deferred = false;  // a gradient reduction or update waiting for the tied-embedding sum
    typename K::Mark mark{};
    int ticket = -1;        // transport request in flight
    bool dispatch = false;  // ALL_TO_ALL: the first of its segment/pass/microbatch
    std::vector<int> group;
    Buf send{}, recv{};
  };
  // Data in flight between ops, keyed by microbatch and model layer boundary (the tensor entering
  // that layer in the forward direction, or leaving it in the backward direction). The data-parallel
  // rank is part of the key: with mirrored placements one device runs different ranks' data in
  // different segments (its position differs between their device sets).
  using Key = std::tuple<int, int, int>;     // (microbatch, data-parallel rank, layer)
  using SegKey = std::pair<int, int>;        // (segment, microbatch)
  using EpKey = std::tuple<int, bool, int>;  // (segment, backward, microbatch)

  void run_compute(const Ctx& c, const core::Op& op);
  void start_comm(const Ctx& c, const core::Op& op, Pending& p);
  void finish_comm(const Ctx& c, const core::Op& op, Pending& p);
  void post_block_collective(const Ctx& c, const core::Op& op, Pending& p, CommPost<Buf>& r);
  void start_all_to_all(const Ctx& c, const core::Op& op, Pending& p, CommPost<Buf>& r);
  void finish_all_to_all(const Ctx& c, const core::Op& op, Pending& p);
  void tied_backward_done(const Ctx& c, int seg);
  // What an ALL_REDUCE sums of a segment: the whole gradient, or with ZeRO the chunk a reduce-scatter
  // inside the shard group left (HSDP: the all-reduce across the groups holding the same shard).
  Vec reduced(int s) {
    if (k_.layout(s).zero_level < 1) return Vec::Grads;
    if (!k_.grad_chunk_ready(s))
      throw RuntimeError(fmt::format(
          "runtime: plan order violated: segment {}'s gradient chunk is all-reduced before its reduce-scatter", s));
    return Vec::GradChunk;
  }

  K& k_;
  T& t_;
  std::map<Key, typename K::Forward> forward_;
  std::map<Key, typename K::Backward> backward_;
  std::map<SegKey, typename K::Stash> stash_;
  std::map<SegKey, typename K::Source> ep_source_;
  std::map<SegKey, typename K::Backward> ep_grad_;
  std::map<EpKey, std::vector<typename K::Packet>> ep_in_, ep_out_;
  std::map<EpKey, int> a2a_seen_;
  std::map<core::OpRef, std::unique_ptr<Pending>> pending_;
};

template <class K, class T>
void Dataflow<K, T>::run_compute(const Ctx& c, const core::Op& op) {
  const int s = op.segment, mb = op.microbatch;  // -1 only outside passes (data_shape)
  const auto& sg = seg(s);
  const bool sharded = sg.shard_degree > 1;
  const bool has_head = sg.last_layer == num_layers_;
  const SegKey sk{s, mb};
  if (op.pass == core::Pass::F) {
    if (sharded) {
      auto from = take_from(ep_in_, EpKey{s, false, mb}, "dispatched expert inputs");
      k_.experts_forward_entries(c, s, from, stash_[sk], &ep_out_[EpKey{s, false, mb}]);
      return;
    }
    typename K::Forward state{};
    if (sg.first_layer > 0)
      state = take_from(forward_, Key{mb, data_rank_of(op), sg.first_layer}, "the activation entering the segment");
    const auto data = local_tokens(
        stream_->microbatch(step_, mb, data_rank_of(op), shape_.microbatches, shape_.ranks, shape_.micro_batch_size),
        op);
    loss_sum_ += k_.forward(c, s, data, loss_scale_, state, stash_[sk]);
    if (!has_head) forward_[Key{mb, data_rank_of(op), sg.last_layer}] = std::move(state);
    return;
  }
  if (op.pass == core::Pass::BW) {
    k_.backward_weight(c, s, stash_.at(sk));
    stash_.erase(sk);
    tied_backward_done(c, s);
    return;
  }
  // B or BI
  if (sharded) {
    auto from = take_from(ep_in_, EpKey{s, true, mb}, "dispatched expert gradients");
    k_.experts_backward_entries(c, s, from, stash_.at(sk), &ep_out_[EpKey{s, true, mb}]);
  } else {
    typename K::Backward g{};
    if (!has_head)
      g = take_from(backward_, Key{mb, data_rank_of(op), sg.last_layer}, "the gradient leaving the segment");
    k_.backward_input(c, s, g, stash_.at(sk));
    if (sg.first_layer > 0) backward_[Key{mb, data_rank_of(op), sg.first_layer}] = std::move(g);
  }
  if (op.pass == core::Pass::B) {
    k_.backward_weight(c, s, stash_.at(sk));
    stash_.erase(sk);
    tied_backward_done(c, s);
  }
}

// V placements: both copies of a tied table on this device; they are added once both segments'
// backwards of the step are done (a[i] = b[i] = a[i] + b[i]).
template <class K, class T>
void Dataflow<K, T>::tied_backward_done(const Ctx& c, int s) {
  if (!tied_.local || (s != tied_.embed_seg && s != tied_.head_seg)) return;
  ++tied_.backward_done[s];
  if (tied_.backward_done[tied_.embed_seg] != shape_.microbatches ||
      tied_.backward_done[tied_.head_seg] != shape_.microbatches)
    return;
  const std::int64_t n = k_.size(tied_.embed_seg, Vec::TiedGrads);
  if (n != k_.size(tied_.head_seg, Vec::TiedGrads))
    throw RuntimeError("runtime: the tied embedding's two copies differ in size");
  Buf a = k_.floats(c, n);
  k_.read(c, a, 0, tied_.embed_seg, Vec::TiedGrads, 0, n);
  k_.write(c, tied_.head_seg, Vec::TiedGrads, 0, a, 0, n, true);  // head = embed + head
  Buf sum = k_.floats(c, n);
  k_.read(c, sum, 0, tied_.head_seg, Vec::TiedGrads, 0, n);
  k_.write(c, tied_.embed_seg, Vec::TiedGrads, 0, sum, 0, n, false);
  tied_.finished = true;
}

template <class K, class T>
void Dataflow<K, T>::start_comm(const Ctx& c, const core::Op& op, Pending& p) {
  const int mb = op.microbatch;
  CommPost<Buf> r;
  r.pair = op.pair;
  if (op.kind != core::OpKind::Send && op.kind != core::OpKind::Recv) {
    p.group = group_of(op);
    r.family = op.family;
    r.group = p.group;
  }
  switch (op.kind) {
    case core::OpKind::Send: {
      const auto& sg = seg(op.segment);
      r.kind = CommKind::Send;
      r.peer = program_.peer_of(op, device_);
      r.backward = is_backward_pass(op.pass);
      r.boundary = r.backward ? sg.first_layer : sg.last_layer;
      if (r.backward)
        p.send = k_.pack_backward(
            c, take_from(backward_, Key{mb, data_rank_of(op), sg.first_layer}, "the gradient to send"));
      else
        p.send =
            k_.pack_forward(c, take_from(forward_, Key{mb, data_rank_of(op), sg.last_layer}, "the activation to send"));
      r.send = &p.send;
      break;
    }
    case core::OpKind::Recv: {
      const auto& sg = seg(op.segment);
      r.kind = CommKind::Recv;
      r.peer = program_.peer_of(op, device_);
      r.backward = is_backward_pass(op.pass);
      r.boundary = r.backward ? sg.last_layer : sg.first_layer;
      p.recv = k_.message_buffer(c);
      r.recv = &p.recv;
      break;
    }
    case core::OpKind::AllReduce: {
      r.kind = CommKind::AllReduce;
      if (is_grad_norm(op)) {  // gradient clipping: this device's owned sum of squares
        p.recv = k_.floats(c, 1);
        k_.grad_sq(c, held_segments_, p.recv, scale_state_.scale);
      } else if (is_tied_sum(op)) {  // this device's copy of the tied table: its local gradient
        const std::int64_t n = k_.size(tied_.held(), Vec::TiedGrads);
        p.recv = k_.floats(c, n);
        k_.read(c, p.recv, 0, tied_.held(), Vec::TiedGrads, 0, n);
      } else {
        // The bucket's gradients, concatenated (whole; with ZeRO, HSDP's all-reduce across shard
        // groups, the reduced chunks), summed in place.
        std::int64_t n = 0;
        for (int s : op.segments) n += k_.size(s, reduced(s));
        p.recv = k_.floats(c, n);
        std::int64_t at = 0;
        for (int s : op.segments) {
          const Vec v = reduced(s);
          const std::int64_t len = k_.size(s, v);
          k_.read(c, p.recv, at, s, v, 0, len);
          at += len;
        }
      }
      r.recv = &p.recv;
      break;
    }
    case core::OpKind::ReduceScatter:
    case core::OpKind::AllGather:
      post_block_collective(c, op, p, r);
      break;
    case core::OpKind::AllToAll:
      start_all_to_all(c, op, p, r);
      break;
    default:
      throw RuntimeError(fmt::format("runtime: unexpected op kind for communication: {}", op.label));
  }
  p.ticket = t_.post(r, c);
}

// ZeRO chunking: block r of a reduce-scatter holds replica r's chunk of every segment of the bucket
// (zero padded to chunk_floats); an all-gather sends this replica's master chunk (padded) and receives
// every replica's.
template <class K, class T>
void Dataflow<K, T>::post_block_collective(const Ctx& c, const core::Op& op, Pending& p, CommPost<Buf>& r) {
  const int ranks = static_cast<int>(p.group.size());
  std::int64_t block = 0;
  for (int s : op.segments) block += k_.layout(s).chunk_floats;
  if (op.kind == core::OpKind::AllGather) {
    r.kind = CommKind::AllGather;
    p.send = k_.floats(c, block);
    std::int64_t at = 0;
    for (int s : op.segments) {
      k_.read(c, p.send, at, s, Vec::Master, 0, std::min(k_.size(s, Vec::Master), k_.layout(s).chunk_floats));
      at += k_.layout(s).chunk_floats;
    }
    p.recv = k_.floats(c, block * ranks);
    r.send = &p.send;
    r.recv = &p.recv;
    return;
  }
  r.kind = CommKind::ReduceScatter;
  p.send = k_.floats(c, block * ranks);
  for (int rk = 0; rk < ranks; ++rk) {
    std::int64_t at = rk * block;
    for (int s : op.segments) {
      const auto& sp = k_.layout(s);
      if (sp.zero_shards != ranks)
        throw RuntimeError(fmt::format("runtime: '{}' reduces over {} ranks but segment {} has {} ZeRO shards",
                                       op.label, ranks, s, sp.zero_shards));
      const std::int64_t n = k_.size(s, Vec::Grads);
      const std::int64_t b = std::min(n, rk * sp.chunk_floats), e = std::min(n, b + sp.chunk_floats);
      k_.read(c, p.send, at, s, Vec::Grads, b, e - b);
      at += sp.chunk_floats;
    }
  }
  // Reducing after every microbatch: what was sent is out of the local buffer, which gathers the
  // next microbatches' gradients from zero; the shard sums the rounds (see finish_comm()).
  for (int s : op.segments)
    if (seg(s).reduce_every_microbatch) k_.zero(c, s, Vec::Grads);
  p.recv = k_.floats(c, block);
  r.send = &p.send;
  r.recv = &p.recv;
}

template <class K, class T>
void Dataflow<K, T>::start_all_to_all(const Ctx& c, const core::Op& op, Pending& p, CommPost<Buf>& r) {
  const int ranks = static_cast<int>(p.group.size()), s = op.segment, mb = op.microbatch;
  if (s < 0 || seg(s).shard_degree != ranks)
    throw RuntimeError(fmt::format("runtime: '{}' exchanges over {} ranks but its segment is sharded {} ways", op.label,
                                   ranks, s < 0 ? 0 : seg(s).shard_degree));
  const bool backward = is_backward_pass(op.pass);
  const EpKey key{s, backward, mb};
  // The first all-to-all of a (segment, pass, microbatch) carries tokens into the sharded experts,
  // the second carries their results back: dataflow order, not a schedule property.
  p.dispatch = a2a_seen_[key]++ == 0;
  std::vector<typename K::Packet> out;
  const SegKey sk{s, mb};
  if (!backward && p.dispatch) {
    auto& state = forward_.at(Key{mb, data_rank_of(op), seg(s).first_layer});
    ep_source_[sk] = k_.route(c, state, ranks);
    out = k_.dispatch_forward(c, state, ep_source_[sk]);
  } else if (backward && p.dispatch) {
    auto g = take_from(backward_, Key{mb, data_rank_of(op), seg(s).last_layer}, "the gradient entering the experts");
    out = k_.dispatch_backward(c, g, ep_source_.at(sk));
    ep_grad_[sk] = std::move(g);
  } else {
    out = take_from(ep_out_, key, "the experts' results");
  }
  p.send = k_.pack_packets(c, out, ranks);
  p.recv = k_.packet_buffer(c, ranks);
  r.kind = CommKind::AllToAll;
  r.send = &p.send;
  r.recv = &p.recv;
}

template <class K, class T>
void Dataflow<K, T>::finish_comm(const Ctx& c, const core::Op& op, Pending& p) {
  const int mb = op.microbatch;
  switch (op.kind) {
    case core::OpKind::Send:
      break;
    case core::OpKind::Recv: {
      const auto& sg = seg(op.segment);
      if (is_backward_pass(op.pass))
        backward_[Key{mb, data_rank_of(op), sg.last_layer}] = k_.unpack_backward(c, p.recv);
      else
        forward_[Key{mb, data_rank_of(op), sg.first_layer}] = k_.unpack_forward(c, p.recv);
      break;
    }
    case core::OpKind::AllReduce: {
      if (is_grad_norm(op)) {
        const double sq = k_.clip_to(c, p.recv, program_.clip_grad, scale_state_.scale);
        // With loss scaling a non-finite norm is an overflow of the scaled gradients: every device
        // sees the same sum, so all skip this step's updates. Without it, the update spreads the
        // non-finite values and the loop stops or rolls back (--on-nonfinite).
        overflowed_ = scaling_.mode != host::LossScaleMode::None && !std::isfinite(sq);
        grad_norm_ = std::sqrt(sq);
        break;
      }
      if (is_tied_sum(op)) {
        k_.write(c, tied_.held(), Vec::TiedGrads, 0, p.recv, 0, k_.size(tied_.held(), Vec::TiedGrads), false);
        tied_.finished = true;
        break;
      }
      std::int64_t at = 0;
      for (int s : op.segments) {
        const Vec v = reduced(s);
        const std::int64_t len = k_.size(s, v);
        k_.write(c, s, v, 0, p.recv, at, len, false);
        at += len;
      }
      break;
    }
    case core::OpKind::ReduceScatter: {
      std::int64_t at = 0;
      for (int s : op.segments) {
        k_.write(c, s, Vec::GradChunk, 0, p.recv, at, k_.size(s, Vec::GradChunk), seg(s).reduce_every_microbatch);
        k_.grad_chunk_ready(s) = true;
        at += k_.layout(s).chunk_floats;
      }
      break;
    }
    case core::OpKind::AllGather: {
      const auto ranks = static_cast<std::int64_t>(p.group.size());
      std::int64_t block = 0;
      for (int s : op.segments) block += k_.layout(s).chunk_floats;
      std::int64_t at = 0;
      for (int s : op.segments) {
        const std::int64_t chunk = k_.layout(s).chunk_floats, n = k_.size(s, Vec::Params);
        for (std::int64_t r = 0; r < ranks; ++r) {
          const std::int64_t b = std::min(n, r * chunk), e = std::min(n, b + chunk);
          if (e > b) k_.write(c, s, Vec::Params, b, p.recv, r * block + at, e - b, false);
        }
        at += chunk;
        if (op.pass != core::Pass::None) ++k_.gathered(s);  // ZeRO-3 gather before a use; released with its buffer
      }
      break;
    }
    case core::OpKind::AllToAll:
      finish_all_to_all(c, op, p);
      break;
    default:
      break;
  }
}

template <class K, class T>
void Dataflow<K, T>::finish_all_to_all(const Ctx& c, const core::Op& op, Pending& p) {
  const int s = op.segment, mb = op.microbatch;
  auto in = k_.unpack_packets(c, p.recv, static_cast<int>(p.group.size()));
  const bool backward = is_backward_pass(op.pass);
  const SegKey sk{s, mb};
  if (p.dispatch) {
    ep_in_[EpKey{s, backward, mb}] = std::move(in);
  } else if (!backward) {
    auto state =
        take_from(forward_, Key{mb, data_rank_of(op), seg(s).first_layer}, "the activation around the experts");
    k_.combine_forward(c, state, ep_source_.at(sk), in);
    forward_[Key{mb, data_rank_of(op), seg(s).last_layer}] = std::move(state);
  } else {
    auto g = take_from(ep_grad_, sk, "the gradient around the experts");
    k_.combine_backward(c, g, ep_source_.at(sk), in);
    backward_[Key{mb, data_rank_of(op), seg(s).first_layer}] = std::move(g);
  }
}

}  // namespace piper::runtime
