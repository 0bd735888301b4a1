// The CUDA backend's model: the GPU counterpart of host::HostModel (host_model.hpp), structured the same
// way so that the two can be read side by side. Parameters use the host's canonical layout
// (layer_tensors, segment offsets, ZeRO chunks) and its initialisation: a host::HostModel is built
// once for the layout and initial values, then the device holds params (storage type), fp32 grads,
// fp32 master weights and AdamW moments. Activations are device tensors in the storage type.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include <cuda_runtime_api.h>

#include "piper/core/model.hpp"
#include "piper/runtime/cuda/allocator.hpp"
#include "piper/runtime/cuda/device.hpp"
#include "piper/runtime/cuda/gemm.hpp"
#include "piper/runtime/comm.hpp"
#include "piper/runtime/cuda/kernels.hpp"
#include "piper/runtime/host_model.hpp"

namespace piper::runtime::cuda {
class Transport;  // transport.hpp
}

namespace piper::runtime::cuda {

// A rows x cols view of `elem`-byte elements into a shared device block. Kernels never write into a
// tensor that a cache may share: each result is a new tensor (so caches can share instead of copy).
struct Tensor {
  std::shared_ptr<Block> mem;
  std::size_t offset = 0;
  std::int64_t rows = 0, cols = 0;
  std::size_t elem = 0;
  void* data() const { return mem && mem->get() ? static_cast<char*>(mem->get()) + offset : nullptr; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data());
  }
  std::int64_t size() const { return rows * cols; }
  std::size_t bytes() const { return static_cast<std::size_t>(size()) * elem; }
  bool empty() const { return size() == 0; }
  // Rows [first, first + count) as a view sharing the block.
  Tensor row_range(std::int64_t first, std::int64_t count) const {
    return Tensor{mem, offset + static_cast<std::size_t>(first * cols) * elem, count, cols, elem};
  }
};

// Where an op's work goes: its stream, that stream's GEMM handle, and the device's allocator.
struct Exec {
  cudaStream_t stream = nullptr;
  Gemm* gemm = nullptr;
  Allocator* alloc = nullptr;
};

Tensor new_tensor(const Exec& e, std::int64_t rows, std::int64_t cols, std::size_t elem);
Tensor zeros(const Exec& e, std::int64_t rows, std::int64_t cols, std::size_t elem);
Tensor upload_ints(const Exec& e, const std::vector<int>& v);
// Synchronises `e.stream` (the tensor's producer) and copies to the host.
std::vector<int> download_ints(const Exec& e, const Tensor& t);
std::vector<float> download_floats(const Exec& e, const Tensor& t);

// host::ForwardState on the device: x, u [T, H] (storage type), topk [T, k] (int32), gates [T, k] (fp32).
struct ForwardState {
  Tensor x, u, topk, gates;
};
// host::BackwardState on the device: dx, du [T, H] (storage type), dgates [T, k] (fp32).
struct BackwardState {
  Tensor dx, du, dgates;
};

// Messages between devices have a fixed capacity (the receiver of a NCCL transfer must know the byte
// count up front): a 64-byte header (rows, cols, k, which fields are present) then the tensors at
// 256-byte aligned offsets, sized for T = micro_batch_size * seq_len tokens.
struct MessageShape {
  std::int64_t tokens = 0, hidden = 0, top_k = 0;
  DType dt = DType::F32;
  std::size_t bytes() const;
};
Tensor pack_forward(const Exec& e, const MessageShape& m, const ForwardState& s);
Tensor pack_backward(const Exec& e, const MessageShape& m, const BackwardState& s);
// Unpacking reads the header to the host (synchronising `e.stream`); the fields view the message.
ForwardState unpack_forward(const Exec& e, const MessageShape& m, const Tensor& msg);
BackwardState unpack_backward(const Exec& e, const MessageShape& m, const Tensor& msg);

// Expert-parallel bookkeeping, as host::ExpertSource / host::ExpertPacket.
struct ExpertSource {
  std::vector<std::vector<int>> slots_to;  // per owner rank: routing slots t * k + j (host)
  std::vector<Tensor> slot_index;          // the same on the device
  Tensor y;                                // [T * k, H] experts' outputs per slot
  Tensor topk, gates;
  std::vector<int> topk_host;
  std::int64_t tokens = 0;
  int k = 0;
};
struct ExpertPacket {
  std::vector<int> expert;
  Tensor rows;
};
// Per peer a block of fixed size: int32 count, int32 expert ids (capacity entries), then the rows.
struct PacketShape {
  std::int64_t capacity = 0, hidden = 0;
  DType dt = DType::F32;
  std::size_t ids_bytes() const;
  std::size_t block_bytes() const;
};
Tensor pack_packets(const Exec& e, const PacketShape& s, const std::vector<ExpertPacket>& packets);
std::vector<ExpertPacket> unpack_packets(const Exec& e, const PacketShape& s, const Tensor& data, int peers);

// Saved forward state per layer (and BI's results for BW), as host::LayerCache.
struct NormCache {
  Tensor x, rstd;
  Tensor mean;  // LayerNorm only
};
struct AttentionCache {
  Tensor u, q_lin, k_lin, v, q_rstd, k_rstd, q, k, o;
  // Reference path: [seqs*heads*L, L] probabilities ([seqs*heads*L, cp*L] under context parallelism); flash and cuDNN
  // paths: [seqs*heads, L] log-sum-exp (each path's own, read only by its backward).
  Tensor probs;
  // Context parallelism: every CP rank's k and v, rank after rank (the all-gather's order; kernels.hpp's
  // AttentionDims), which the core reads instead of k and v.
  Tensor k_all, v_all;
  AttentionPath path = AttentionPath::Reference;  // which attention path the forward took
  Tensor dout, dq_lin, dk_lin, dv, dq_norm, dk_norm;
};
// SwiGLU (a gate, b up, h = silu(a) * b) or GELU (a = u w1 + b1, h = gelu(a); b and db unused).
struct MlpCache {
  Tensor u, a, b, h;
  Tensor dout, da, db;
};
struct RouterCache {
  Tensor u, topk, gates, dlogits;
};
struct ExpertsCache {
  struct Group {
    int local = 0;  // expert index within this device's shard
    Tensor index;   // entries routed to it (device int32)
    MlpCache mlp;
  };
  std::vector<Group> groups;
  std::int64_t entries = 0;
  std::vector<int> etp_counts;  // expert TP: each ETP rank's rows in the gathered rows (host LayerCache's)
};
struct HeadCache {
  Tensor u, dlogits;
};
struct LayerCache {
  NormCache norm;
  AttentionCache attn;
  MlpCache mlp;
  RouterCache router;
  ExpertsCache experts;
  ExpertSource source;
  std::vector<int> source_counts;
  HeadCache head;
  Tensor tokens;
  Tensor dx_embed;
  Tensor dy_norm;
};
struct SegmentStash {
  std::vector<LayerCache> layers;
  // Full recomputation (as host::SegmentStash): F keeps only the segment's input and its microbatch;
  // B or BI reruns the segment's forward from them before the backward.
  std::optional<ForwardState> input;
  host::MicrobatchData data;
  float loss_scale = 0;
};

// Device arrays of one segment; sizes and chunk bounds come from the host layout.
struct SegmentDevice {
  Tensor params;  // storage type, this device's whole (expert-sharded) vector
  Tensor grads;   // fp32, same length
  Tensor master;  // fp32: ZeRO 0 the whole vector, ZeRO >= 1 this replica's chunk
  Tensor grad_chunk, adam_m, adam_v;
  bool grad_chunk_ready = false;
  int gathered = 0;
};

// The tensor-parallel group of a segment (tp_degree > 1): its collectives go through the backend's
// transport on the TP family, in the compute stream's order; the op waits for each (host::TpComm's
// blocking semantics, as the host backend runs them).
// The group of a segment's tensor-parallel (or context-parallel) ranks: the transport its collectives
// go through, the Program family and the devices in TP (CP) rank order.
struct TpLink {
  Transport* transport = nullptr;
  int family = -1;
  std::vector<int> group;  // the devices, in TP-rank order
};

class CudaModel {
 public:
  CudaModel(const core::Model& model, std::vector<host::SegmentSpec> segments, std::uint64_t seed, DType dt,
            Allocator& alloc, cudaStream_t init_stream);

  const core::Model& model() const { return layout_.model(); }
  DType dtype() const { return dt_; }
  std::size_t elem() const { return dtype_bytes(dt_); }
  int top_k() const { return layout_.top_k(); }
  std::int64_t hidden() const { return layout_.hidden(); }
  int experts() const { return layout_.experts(); }
  // Host layout (offsets, chunk bounds) of a segment; its values are stale after the first step.
  host::SegmentParams& layout(int seg) { return layout_.segment(seg); }
  SegmentDevice& device(int seg);
  bool holds(int seg) const { return layout_.holds(seg); }

  // As HostModel::forward; the head adds its summed token loss to loss_accumulator() (device fp32).
  void forward(const Exec& e, int seg, const host::MicrobatchData& data, float loss_scale, ForwardState& state,
               SegmentStash& stash);
  void backward_input(const Exec& e, int seg, BackwardState& state, SegmentStash& stash);
  void backward_weight(const Exec& e, int seg, SegmentStash& stash);

  ExpertSource route(const Exec& e, const ForwardState& state, int group_size) const;
  std::vector<ExpertPacket> dispatch_forward(const Exec& e, const ForwardState& state, const ExpertSource& src) const;
  void experts_forward_entries(const Exec& e, int seg, const std::vector<ExpertPacket>& from, SegmentStash& stash,
                               std::vector<ExpertPacket>* to_sources);
  void combine_forward(const Exec& e, ForwardState& state, ExpertSource& src,
                       const std::vector<ExpertPacket>& from_owners) const;
  std::vector<ExpertPacket> dispatch_backward(const Exec& e, BackwardState& grad, const ExpertSource& src) const;
  void experts_backward_entries(const Exec& e, int seg, const std::vector<ExpertPacket>& from, SegmentStash& stash,
                                std::vector<ExpertPacket>* to_sources);
  void combine_backward(const Exec& e, BackwardState& grad, const ExpertSource& src,
                        const std::vector<ExpertPacket>& from_owners) const;

  void set_tp(int seg, TpLink link);  // before the first step, for each held segment with tp_degree > 1
  // Before the first step, for each held segment with cp_degree > 1: its CP group (this device at its
  // CP rank), whose ranks exchange K/V in every attention layer (host::HostModel::set_cp_comm).
  void set_cp(int seg, TpLink link);
  // Called while a compute op waits for its group's collective (the backend's Backend::progress: the
  // device's other streams keep moving).
  void set_progress(std::function<void()> f) { progress_ = std::move(f); }
  // The [offset, length) runs of a segment's local gradient vector that count in the global gradient
  // norm (host::HostModel::owned_grad_sq's rule): not a tied head's copy of the embedding table, and a
  // TP-replicated tensor on TP rank 0 only.
  // (Derived from the layout once per segment, on first use.)
  const std::vector<std::pair<std::int64_t, std::int64_t>>& counted_grad_runs(int seg);

  void update(const Exec& e, int seg, const AdamW& cfg, int step);
  void discard_grads(const Exec& e, int seg);  // zero the gradients (and ZeRO chunk) without an update
  void poison_params(const Exec& e, int seg);

  float* loss_accumulator() const { return loss_.as<float>(); }
  // Copies the device parameters into the host layout and returns HostModel::param_records().
  std::vector<host::ParamRecord> param_records(const Exec& e);
  // Checkpoints reuse the host's canonical-layout code (checkpoint.hpp), which reads and writes a
  // host::HostModel: state_to_host copies the fp32 master weights and AdamW moments into the host
  // layout and returns it (for state_records); state_from_host uploads the host layout's state (after
  // load_state) to the device: parameters in the storage type, masters, moments, zero gradients.
  host::HostModel& state_to_host(const Exec& e);
  host::HostModel& host_state() { return layout_; }
  void state_from_host(const Exec& e);

 private:
  struct Weights;
  Weights weights(int seg, int layer, bool grads);
  // The layers of a segment's forward; `count_loss` false for a full recomputation's rerun, whose head
  // rebuilds its logit gradients without adding the loss again. Selective recomputation drops each
  // attention core's output and statistics after a counted forward; the backward rebuilds them.
  void forward_layers(const Exec& e, int seg, const host::MicrobatchData& data, float loss_scale, ForwardState& s,
                      SegmentStash& stash, bool count_loss);
  // The weights whose first tensor the head of segment `seg` multiplies by: its own [H, V] matrix, or
  // for a head tied to the embedding (`tied` set) the table [V, H]: the embedding's when it is in this
  // segment, else the head's copy of it.
  Weights head_weights(int seg, bool grads, bool& tied);
  void upload_segment(const Exec& e, const host::SegmentParams& sp, SegmentDevice& d);
  Tensor experts_forward(const Exec& e, int seg, int layer, int first_expert, const std::vector<int>& expert,
                         const Tensor& rows, ExpertsCache& c);
  Tensor experts_backward_input(const Exec& e, int seg, int layer, ExpertsCache& c, const Tensor& dy);
  void experts_backward_weight(const Exec& e, int seg, int layer, ExpertsCache& c);
  // Tensor parallelism (host_model_compute.cpp's tp_sum and vocab-parallel head, on the device): the
  // attention shape of a segment (its TP rank's heads), the sum of a partial tensor over the TP group
  // in place, an all-gather of n floats per rank, and the vocab-parallel cross-entropy.
  host::AttentionShape segment_attention(int seg);
  // Layer steps of forward_layers / backward_input: the (vocab-parallel) embedding with its positions,
  // the head's logits and (vocab-parallel) cross-entropy, and an attention layer's input gradient
  // (the caller sums it over the TP group).
  void embedding_layer_forward(const Exec& e, int seg, const Weights& w, const host::MicrobatchData& data,
                               ForwardState& s, LayerCache& c);
  void head_forward(const Exec& e, int seg, const host::MicrobatchData& data, float loss_scale, const Tensor& u,
                    LayerCache& c, bool count_loss);
  Tensor attention_backward_input(const Exec& e, int seg, const Weights& w, AttentionCache& k, const Tensor& dx);
  const TpLink* tp_of(int seg) const;
  // One collective over a group (transport.hpp's counts), waited for; `pair` names the kind of group
  // apart from the plan's own collectives. tp_collective: over the segment's TP group.
  void group_collective(const Exec& e, const TpLink& link, int pair, CommKind kind, const void* send, void* recv,
                        std::size_t count);
  void tp_collective(const Exec& e, int seg, CommKind kind, const void* send, void* recv, std::size_t count);
  // The sum over the group of `all` ([ranks·rows, cols]; bf16/fp16 summed in fp32), of which this rank
  // keeps its block of rows (SP's tp_leave, CP's dK/dV, ETP's partial outputs).
  Tensor reduce_scatter_rows(const Exec& e, const TpLink& link, int pair, const Tensor& all);
  // Context parallelism (host AttentionCp's gather and scatter_sum): every CP rank's rows of `local`,
  // rank after rank; and the sum over the CP group of `all` ([cp·rows, cols]) of which this rank keeps
  // its block (summed in fp32, stored in the storage type).
  const TpLink* cp_of(int seg) const;
  Tensor cp_gather(const Exec& e, int seg, const Tensor& local);
  Tensor cp_scatter_sum(const Exec& e, int seg, const Tensor& all);
  // Expert tensor parallelism (host etp_gather / etp_scatter): each ETP rank holds 1/e of every local
  // expert's FFN. Before the experts' fc1 the ETP group gathers its routed rows (and, where `expert` is
  // given, their experts; the counts are gathered unless known), rank after rank; after fc2 (and after
  // the input gradient's GEMMs) the partial sums are reduce-scattered back to the rows' owners.
  struct EtpRows {
    Tensor rows;
    std::vector<int> expert, counts;
  };
  EtpRows etp_gather(const Exec& e, int seg, const Tensor& rows, const std::vector<int>* expert,
                     const std::vector<int>* counts_known);
  Tensor etp_scatter(const Exec& e, int seg, const Tensor& partial, const std::vector<int>& counts);
  // The experts of a layer on `rows` routed to `expert` (global ids from `first_expert`), through the
  // ETP group where the segment has expert TP; and their input gradient likewise.
  Tensor routed_experts_forward(const Exec& e, int seg, int layer, int first_expert, const std::vector<int>& expert,
                                const Tensor& rows, ExpertsCache& c);
  Tensor routed_experts_backward_input(const Exec& e, int seg, int layer, ExpertsCache& c, const Tensor& dy);
  void tp_sum(const Exec& e, int seg, Tensor& t);
  void tp_sum_floats(const Exec& e, int seg, float* p, std::int64_t n);
  Tensor tp_gather_floats(const Exec& e, int seg, const float* send, std::int64_t n);
  void vocab_parallel_cross_entropy(const Exec& e, int seg, Tensor& logits, const Tensor& targets, int first,
                                    float loss_scale, float* loss);
  // Sequence parallelism (host tp_enter / tp_leave): entering a column-parallel GEMM gathers the
  // ranks' token rows (identity without SP); leaving a row-parallel one (or a column-parallel one's
  // backward) sums the partial results, all-reduced, or reduce-scattered to this rank's rows under SP.
  bool sequence_parallel(int seg);
  Tensor tp_enter(const Exec& e, int seg, const Tensor& local);
  Tensor tp_leave(const Exec& e, int seg, Tensor partial);
  // Under SP a replicated weight's gradient from this rank's token rows is partial (host
  // partial_tp_grads): begin returns where the kernel writes it (zeroed scratch under SP, else the
  // gradient itself), end sums the scratch over the TP group and adds it to the gradient.
  float* partial_grad_begin(const Exec& e, int seg, float* grad, std::int64_t n, Tensor& scratch);
  void partial_grad_end(const Exec& e, int seg, float* grad, std::int64_t n, Tensor& scratch);

  host::HostModel layout_;
  DType dt_;
  Allocator& alloc_;
  host::AttentionShape attn_shape_;
  std::map<int, SegmentDevice> device_;
  std::map<int, TpLink> tp_, cp_;
  std::function<void()> progress_;
  std::map<int, std::vector<std::pair<std::int64_t, std::int64_t>>> counted_runs_;  // counted_grad_runs
  Tensor loss_;
};

}  // namespace piper::runtime::cuda
