// The host backend's model: parameters of the segments one device holds (experts sharded, ZeRO
// shards), deterministic initialisation, and forward/backward of a segment's layers on the residual
// stream state, built on the kernels. The reference trainer is the same model holding every layer.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
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
std::vector<float> pack_packets(const std::vector<ExpertPacket>& packets, std::int64_t block_floats, std::int64_t hidden);
std::vector<ExpertPacket> unpack_packets(std::span<const float> data, int peers, std::int64_t block_floats, std::int64_t hidden);

// One layer's saved forward state (and BI's saved gradients for BW).
struct LayerCache {
  RmsNormCache norm;
  AttentionCache attn;
  MlpCache mlp;
  RouterCache router;
  ExpertsCache experts;
  ExpertSource source;            // experts run locally: the routing of this layer
  std::vector<int> source_counts; // experts sharded: entries received from each source rank
  HeadCache head;
  std::vector<int> tokens;        // embedding
  Mat dx_embed;                   // embedding: saved by BI for BW
  Mat dy_norm;                    // norm: saved by BI for BW
};
struct SegmentStash {
  std::vector<LayerCache> layers;
};

// Parameters, gradients and optimizer state of one segment on one device.
struct SegmentParams {
  int segment = -1;
  int first_layer = 0, last_layer = 0;
  int shard_degree = 1, shard_index = 0;    // experts: this device holds experts [shard_index*E/S, ...)
  int replicas = 1, replica_index = 0;      // data-parallel copies and ZeRO shard owner index
  int zero_level = 0;
  std::vector<float> params, grads;         // this device's (expert-sharded) part, all replicas' chunks
  std::vector<std::int64_t> layer_offset;   // start of each layer in params (size = layers + 1)
  // ZeRO >= 1: the chunk [chunk_begin, chunk_end) of params this replica updates, its master copy,
  // reduced gradient and AdamW moments; ZeRO 0: moments of the whole vector.
  std::int64_t chunk_begin = 0, chunk_end = 0, chunk_floats = 0;
  std::vector<float> master, grad_chunk, adam_m, adam_v;
  bool grad_chunk_ready = false;
  int gathered = 0;                         // ZeRO-3: live gathered copies (params valid while > 0)
};

// One contiguous part of a layer's canonical full parameter vector: for comparing and checkpointing.
struct ParamRecord {
  int layer = 0;
  std::int64_t offset = 0;
  std::vector<float> values;
};

struct SegmentSpec {
  int segment = -1, first_layer = 0, last_layer = 0;
  int shard_degree = 1, shard_index = 0, replicas = 1, replica_index = 0, zero_level = 0;
};

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
  void combine_backward(BackwardState& grad, const ExpertSource& src, const std::vector<ExpertPacket>& from_owners) const;

  // Optimizer step of one segment with its reduced gradients (ZeRO >= 1: the chunk), then zero grads.
  void update(int seg, const AdamWConfig& cfg, int step);
  // ZeRO-3: parameters outside a gather are poisoned with NaN so a plan that uses them fails loudly.
  void poison_params(int seg);

  // This device's parameters as records of the canonical layout (ZeRO-3: its master chunk).
  std::vector<ParamRecord> param_records() const;

 private:
  struct LayerView;
  LayerView view(SegmentParams& sp, int layer, bool grads);
  std::vector<MlpWeights> expert_weights(SegmentParams& sp, int layer);
  void init_params(SegmentParams& sp, std::uint64_t seed);

  core::Model model_;
  AttentionShape attn_shape_;
  int top_k_ = 0, experts_ = 0;
  std::int64_t hidden_ = 0;
  std::vector<SegmentParams> segments_;
  std::map<int, std::size_t> by_index_;
};

// The canonical tensors of a layer, in storage order: (name, rows, cols); experts repeat
// (wg, wu, wd) per expert. Norm weights are named "*norm*" and initialised to 1.
struct TensorSpec {
  std::string name;
  std::int64_t rows = 0, cols = 0;
  std::int64_t size() const { return rows * cols; }
};
std::vector<TensorSpec> layer_tensors(const core::Layer& layer);

// Deterministic token stream: synthetic (arithmetic sequences mod vocab) or a file's bytes mod vocab.
class TokenStream {
 public:
  TokenStream(std::int64_t vocab, std::int64_t seq_len, std::uint64_t seed, const std::string& data_path = "");
  // Sequence `index` of the whole run (seq_len + 1 tokens: inputs and shifted targets).
  std::vector<int> sequence(std::int64_t index) const;
  // Microbatch `mb` of data rank `rank` at `step`: sequences in the order the reference uses.
  MicrobatchData microbatch(int step, int mb, int rank, int microbatches, int ranks, std::int64_t micro_batch_size) const;

 private:
  std::int64_t vocab_, seq_len_;
  std::uint64_t seed_;
  std::vector<unsigned char> bytes_;
};

}  // namespace piper::runtime::host
