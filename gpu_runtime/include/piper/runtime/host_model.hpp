// The host backend's model: parameters of the segments one device holds (experts sharded, ZeRO
// shards), deterministic initialisation, and forward/backward of a segment's layers on the residual
// stream state, built on the kernels. The reference trainer is the same model holding every layer.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "piper/core/model.hpp"
#include "piper/runtime/kernels.hpp"

namespace piper::runtime::host {

// The residual stream between layers: x (residual), u (output of the last norm, the input of
// attention/MLP/router/experts) and the routing of the last router (consumed by the experts).
struct ForwardState {
  Mat x, u;
  Eigen::MatrixXi topk;
  Mat gates;
  std::vector<float> serialize() const;
  static ForwardState deserialize(std::span<const float> data);
};

// Gradients w.r.t. the ForwardState fields.
struct BackwardState {
  Mat dx, du, dgates;
  std::vector<float> serialize() const;
  static BackwardState deserialize(std::span<const float> data);
};

// Tokens of one microbatch of one data-parallel rank: inputs and next-token targets.
struct MicrobatchData {
  std::vector<int> tokens, targets;
};

// Expert-parallel bookkeeping. Source side (the rank whose tokens they are): which routing slots
// (t * top_k + j) went to which owner rank, and the experts' outputs per slot.
struct ExpertSource {
  std::vector<std::vector<int>> slots_to;  // per owner rank in the group
  Mat y;                                   // [T * top_k, H]
  Eigen::MatrixXi topk;
  Mat gates;
};
// Rows exchanged with one peer: expert ids (forward dispatch only) and one row per entry.
struct ExpertPacket {
  std::vector<int> expert;
  Mat rows;
};
std::vector<float> pack_packets(const std::vector<ExpertPacket>& packets, std::int64_t block_floats,
                                std::int64_t hidden);
std::vector<ExpertPacket> unpack_packets(std::span<const float> data, int peers, std::int64_t block_floats,
                                         std::int64_t hidden);

// One layer's saved forward state (and BI's saved gradients for BW).
struct LayerCache {
  RmsNormCache norm;
  LayerNormCache lnorm;  // GPT: LayerNorm instead of RMSNorm
  AttentionCache attn;
  MlpCache mlp;
  GeluMlpCache gmlp;  // GPT: GELU MLP instead of SwiGLU
  RouterCache router;
  ExpertsCache experts;
  ExpertSource source;             // experts run locally: the routing of this layer
  std::vector<int> source_counts;  // experts sharded: entries received from each source rank
  std::vector<int> etp_counts;     // expert TP: entries of each rank of the ETP group (gathered in F)
  HeadCache head;
  std::vector<int> tokens;  // embedding
  Mat dx_embed;             // embedding: saved by BI for BW
  Mat dy_norm;              // norm: saved by BI for BW
};
struct SegmentStash {
  std::vector<LayerCache> layers;
  // Full recomputation: F keeps only the segment's input (and its microbatch's tokens); B or BI
  // reruns the segment's forward from them before the backward.
  std::optional<ForwardState> input;
  MicrobatchData data;
  float loss_scale = 0;
  // Floats held for the backward (activations kept from F): what recomputation saves.
  std::int64_t floats() const;
};

// Activation recomputation of a segment (Korthikanti et al. 2022): none; selective (the attention
// core's QK^T, softmax and .V are dropped after F and rerun in B); full (only the input is kept).
enum class RecomputeMode { None, Selective, Full };

// The tensor-parallel group of a segment, as the model's collectives need it. Every call is
// collective over the group (all ranks call it in the same order with the same sizes). Rank r's
// block of a gather/scatter is the r-th contiguous 1/size of the buffer.
class TpComm {
 public:
  virtual ~TpComm() = default;
  virtual int size() const = 0;
  virtual int rank() const = 0;
  virtual void allreduce_sum(float* data, std::int64_t n) = 0;
  virtual void allreduce_max(float* data, std::int64_t n) = 0;
  virtual void allgather(const float* in, std::int64_t n, float* out) = 0;       // out: size * n
  virtual void reduce_scatter(const float* in, std::int64_t n, float* out) = 0;  // in: size * n, out: n
};

// Parameters, gradients and optimizer state of one segment on one device.
struct SegmentParams {
  int segment = -1;
  int first_layer = 0, last_layer = 0;
  int shard_degree = 1, shard_index = 0;  // experts: this device holds experts [shard_index*E/S, ...)
  int replicas = 1, replica_index = 0;    // data-parallel copies and this device's index among them
  int zero_level = 0;
  // ZeRO shards: replicas (plain ZeRO) or the HSDP shard group size; this device owns chunk
  // replica_index % zero_shards, and the groups of zero_shards consecutive replicas replicate it.
  int zero_shards = 1;
  // Tensor parallelism (Megatron layout): this device holds TP rank tp_rank's slice of each split
  // tensor; with sequence parallelism the residual stream holds 1/tp_degree of the token rows.
  int tp_degree = 1, tp_rank = 0;
  bool sequence_parallel = false;
  RecomputeMode recompute = RecomputeMode::None;
  TpComm* tp = nullptr;  // set by the backend when tp_degree > 1
  // Context parallelism: each sequence's seq_len / cp_degree local rows are CP rank cp_rank's two
  // load-balanced chunks (AttentionCp); attention exchanges K/V over `cp` (set by the backend).
  int cp_degree = 1, cp_rank = 0;
  TpComm* cp = nullptr;
  AttentionCp cp_attention;
  // Routed experts without TP on a TP stage without SP: the t TP ranks route the same tokens, so the
  // experts see each token t times; BW divides their weight gradients by this.
  int token_copies = 1;
  bool expert_tp = false;  // routed experts alone in their segment, split by TP (expert TP); experts inside a
                           // TP segment of other layers stay whole (replicated)
  // Tied embeddings (GPT) with the head in this segment but the embedding elsewhere: the head layer
  // holds a copy of (this TP rank's slice of) the embedding table, kept identical to it by summing
  // the two gradients before the update (HostModel::tied_grads; the backend pairs the devices).
  bool tied_copy = false;
  std::vector<float> params, grads;        // this device's (expert-sharded) part, all replicas' chunks
  std::vector<std::int64_t> layer_offset;  // start of each layer in params (size = layers + 1)
  // ZeRO >= 1: the chunk [chunk_begin, chunk_end) of params this replica updates, its master copy,
  // reduced gradient and AdamW moments; ZeRO 0: moments of the whole vector.
  std::int64_t chunk_begin = 0, chunk_end = 0, chunk_floats = 0;
  std::vector<float> master, grad_chunk, adam_m, adam_v;
  bool grad_chunk_ready = false;
  int gathered = 0;  // ZeRO-3: live gathered copies (params valid while > 0)
};

// Gradient clipping: whether this device's reduced gradient of `sp` counts in the global norm, so
// that every element counts once over all devices: replica 0's, or with ZeRO the first shard
// group's chunks (the groups of zero_shards replicas hold the same chunks).
inline bool counts_in_grad_norm(const SegmentParams& sp) {
  return sp.zero_level >= 1 ? sp.replica_index < sp.zero_shards : sp.replica_index == 0;
}

// One contiguous part of a layer's canonical full parameter vector: for comparing and checkpointing.
struct ParamRecord {
  int layer = 0;
  std::int64_t offset = 0;
  std::vector<float> values;
};

struct SegmentSpec {
  int segment = -1, first_layer = 0, last_layer = 0;
  int shard_degree = 1, shard_index = 0, replicas = 1, replica_index = 0, zero_level = 0;
  int zero_shards = 1;  // HSDP: replicas per ZeRO shard group (= replicas without HSDP)
  int tp_degree = 1, tp_rank = 0;
  bool sequence_parallel = false;
  RecomputeMode recompute = RecomputeMode::None;
  int token_copies = 1;
  int cp_degree = 1, cp_rank = 0;  // context parallelism: this device holds CP rank cp_rank's chunks
};

struct LocalTensor;

class HostModel {
 public:
  HostModel(const core::Model& model, std::vector<SegmentSpec> segments, std::uint64_t seed);

  const core::Model& model() const { return model_; }
  int top_k() const { return top_k_; }
  std::int64_t hidden() const { return hidden_; }
  int experts() const { return experts_; }
  SegmentParams& segment(int index);
  bool holds(int index) const { return by_index_.count(index) > 0; }
  std::vector<SegmentParams>& segments() { return segments_; }

  // Full canonical parameter count of a layer (all experts).
  std::int64_t layer_param_count(int layer) const;

  // Forward of layers [first, last) of `seg`. The embedding creates the state from data.tokens; the
  // head returns the summed token loss (else 0) and keeps dloss * loss_scale for the backward.
  double forward(int seg, const MicrobatchData& data, float loss_scale, ForwardState& state, SegmentStash& stash);
  // BI over the layers in reverse: state holds the gradient at the segment's output (empty when
  // the segment ends with the head) and receives the gradient at its input.
  void backward_input(int seg, BackwardState& state, SegmentStash& stash);
  // BW: weight gradients of the segment's layers from the stash (after backward_input).
  void backward_weight(int seg, SegmentStash& stash);

  // Experts sharded over a group: the source side splits slots by owner, the owner runs its experts.
  ExpertSource route(const ForwardState& state, int group_size) const;
  std::vector<ExpertPacket> dispatch_forward(const ForwardState& state, const ExpertSource& src) const;
  Mat experts_forward_entries(int seg, const std::vector<ExpertPacket>& from, SegmentStash& stash,
                              std::vector<ExpertPacket>* to_sources);
  void combine_forward(ForwardState& state, ExpertSource& src, const std::vector<ExpertPacket>& from_owners) const;
  std::vector<ExpertPacket> dispatch_backward(BackwardState& grad, const ExpertSource& src) const;
  void experts_backward_entries(int seg, const std::vector<ExpertPacket>& from, SegmentStash& stash,
                                std::vector<ExpertPacket>* to_sources);
  void combine_backward(BackwardState& grad, const ExpertSource& src,
                        const std::vector<ExpertPacket>& from_owners) const;

  // Optimizer step of one segment with its reduced gradients (ZeRO >= 1: the chunk), then zero grads.
  void update(int seg, const AdamWConfig& cfg, int step);
  // Zeroes the segment's gradients (and ZeRO chunk) without an update: what update leaves behind,
  // for a step whose update is skipped (loss scaling's overflow).
  void discard_grads(int seg);
  // ZeRO-3: parameters outside a gather are poisoned with NaN so a plan that uses them fails loudly.
  void poison_params(int seg);

  // This device's parameters as records of the canonical layout (ZeRO-3: its master chunk). TP
  // slices map to their canonical offsets; replicated tensors of a TP segment come from TP rank 0.
  std::vector<ParamRecord> param_records() const;
  // This device's accumulated gradients in the canonical layout (tests compare them with the
  // reference's; no ZeRO chunking).
  std::vector<ParamRecord> grad_records() const;
  // Gradient clipping: the sum of squares of the reduced gradients of segment `seg` that this device
  // owns, so that the sum over all devices counts every element of the model once: replica 0 (ZeRO:
  // the first shard group's chunks), TP-replicated tensors on TP rank 0, and a tied head's copy of
  // the embedding table never (its embedding's segment counts it). Loss scaling: each gradient is
  // divided by `loss_scale` (a power of two: exact) before it is squared, so a square cannot overflow.
  double owned_grad_sq(int seg, double loss_scale = 1) const;
  // Where a segment's local vector sits in the canonical layout: contiguous runs in local order
  // (expert shards: whole experts; TP: one run per row of a column-split tensor). `replicated` marks
  // tensors every TP rank of a group holds in full.
  struct CanonicalRun {
    int layer = 0;
    std::int64_t local = 0, canonical = 0, length = 0;
    bool replicated = false;
  };
  std::vector<CanonicalRun> canonical_runs(const SegmentParams& sp) const;
  // The TP group of a segment this device holds with tp_degree > 1 (the backend owns it).
  void set_tp_comm(int seg, TpComm* comm);
  void set_cp_comm(int seg, TpComm* comm);  // the CP group's communicator (cp_degree > 1)

  // Tied embeddings: whether the model ties its head to the embedding, and the gradient of the tied
  // table in a segment that holds one copy of it without the other (the embedding without the head,
  // or the head's copy); empty when the segment holds both or neither. The two spans of a pair must
  // be summed (same TP rank, same data rank) before the data-parallel reduction and the update.
  bool tied() const { return tied_; }
  int embedding_layer() const { return embed_layer_; }
  int head_layer() const { return head_layer_; }
  std::span<float> tied_grads(int seg);
  // The local tensors of layer `layer` in segment `sp` (local_tensors, plus the tied copy).
  std::vector<LocalTensor> tensors_of(const SegmentParams& sp, int layer) const;

 private:
  struct LayerView;
  std::vector<ParamRecord> records(const SegmentParams& sp, const std::vector<float>& src, std::int64_t begin,
                                   std::int64_t end) const;
  void forward_layers(SegmentParams& sp, const MicrobatchData& data, float loss_scale, ForwardState& s,
                      SegmentStash& stash, double* loss);
  LayerView view(SegmentParams& sp, int layer, bool grads);
  // The attention one device of segment `sp` runs: its TP share of the heads, its CP slice of the sequence.
  AttentionShape segment_attention(SegmentParams& sp) const;
  ConstMatMap tied_table(SegmentParams& sp);
  MatMap tied_table_grad(SegmentParams& sp);
  std::vector<MlpWeights> expert_weights(SegmentParams& sp, int layer);
  void init_params(SegmentParams& sp, std::uint64_t seed);
  void check_fits_in_memory(const std::string& who) const;

  core::Model model_;
  AttentionShape attn_shape_;
  bool tied_ = false, gpt_init_ = false;
  int embed_layer_ = -1, head_layer_ = -1;
  int top_k_ = 0, experts_ = 0;
  std::int64_t hidden_ = 0;
  std::vector<SegmentParams> segments_;
  std::map<int, std::size_t> by_index_;
};

// The canonical tensors of a layer, in storage order: (name, rows, cols); experts repeat
// (wg, wu, wd) per expert. Norm weights are named "*norm*" and initialised to 1, biases "*bias*"
// (initialised to 0). GPT layers: LayerNorm (norm, norm_bias), learned positions (embedding "pos"),
// biased attention (bias_q, bias_k, bias_v, bias_o), GELU MLP (wu, wd, bias_fc1, bias_fc2); a tied
// head holds nothing (it uses the embedding's table).
struct TensorSpec {
  std::string name;
  std::int64_t rows = 0, cols = 0;
  std::int64_t size() const { return rows * cols; }
};
std::vector<TensorSpec> layer_tensors(const core::Layer& layer);

// One tensor of a layer as one device holds it: its local shape, how it is split over the TP group
// (Megatron: column-parallel splits the output dim, row-parallel the input dim; the embedding's rows
// and the head's columns are the vocabulary), and where the full tensor starts in the layer's
// canonical vector. Expert-parallel shards hold a contiguous range of whole expert tensors.
enum class TpSplit { Replicated, Columns, Rows };
struct LocalTensor {
  TensorSpec local, full;
  TpSplit split = TpSplit::Replicated;
  int part = 0;                  // TP rank: which block of the split
  std::int64_t full_offset = 0;  // start of the full tensor in the layer's canonical vector
  int canonical_layer = -1;      // >= 0: the tensor belongs to that layer (the tied head's copy of the embedding)
  // Contiguous runs (local offset within the tensor, canonical offset within the layer, length).
  std::vector<std::array<std::int64_t, 3>> runs() const;
};
std::vector<LocalTensor> local_tensors(const core::Layer& layer, int shard_degree, int shard_index, int tp_degree,
                                       int tp_rank);

// Deterministic token stream: synthetic (arithmetic sequences mod vocab) or a file's bytes mod vocab.
class TokenStream {
 public:
  TokenStream(std::int64_t vocab, std::int64_t seq_len, std::uint64_t seed, const std::string& data_path = "");
  // Sequence `index` of the whole run (seq_len + 1 tokens: inputs and shifted targets).
  std::vector<int> sequence(std::int64_t index) const;
  // Microbatch `mb` of data rank `rank` at `step`: sequences in the order the reference uses.
  MicrobatchData microbatch(int step, int mb, int rank, int microbatches, int ranks,
                            std::int64_t micro_batch_size) const;

 private:
  std::int64_t vocab_, seq_len_;
  std::uint64_t seed_;
  std::vector<unsigned char> bytes_;
};

}  // namespace piper::runtime::host
