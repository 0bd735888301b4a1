// The host model: state serialisation, parameter layout and initialisation, AdamW with ZeRO chunks,
// and the deterministic token stream; the per-layer forward/backward and the expert-parallel routing
// are in host_model_compute.cpp.
#include "piper/runtime/host_model.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

#include "host_model_view.hpp"
#include "piper/core/limits.hpp"

namespace piper::runtime::host {

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1), a pure function of (seed, layer, element): every rank initialises its shard
// exactly as the single-process reference does.
float uniform_pm1(std::uint64_t seed, int layer, std::int64_t element) {
  std::uint64_t h = splitmix64(seed ^ splitmix64(static_cast<std::uint64_t>(layer) * 0x100000001b3ULL + 17) ^
                               splitmix64(static_cast<std::uint64_t>(element)));
  return static_cast<float>(static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
}

void put_mat(std::vector<float>& out, const Mat& m) { out.insert(out.end(), m.data(), m.data() + m.size()); }

Mat get_mat(std::span<const float> data, std::size_t& pos, Eigen::Index rows, Eigen::Index cols) {
  if (pos + static_cast<std::size_t>(rows * cols) > data.size())
    throw std::runtime_error("runtime: truncated tensor message");
  Mat m = ConstMatMap(data.data() + pos, rows, cols);
  pos += static_cast<std::size_t>(rows * cols);
  return m;
}

bool in_range(int first_layer, int last_layer, int layer) { return first_layer <= layer && layer < last_layer; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// State serialisation: a 5-float header then the tensors.
// ---------------------------------------------------------------------------------------------
std::vector<float> ForwardState::serialize() const {
  const bool has_u = u.size() > 0, has_routing = topk.size() > 0;
  std::vector<float> out = {static_cast<float>(x.rows()), static_cast<float>(x.cols()),
                            static_cast<float>(has_routing ? topk.cols() : 0), has_u ? 1.0f : 0.0f,
                            has_routing ? 1.0f : 0.0f};
  put_mat(out, x);
  if (has_u) put_mat(out, u);
  if (has_routing) {
    for (Eigen::Index t = 0; t < topk.rows(); ++t)
      for (Eigen::Index j = 0; j < topk.cols(); ++j) out.push_back(static_cast<float>(topk(t, j)));
    put_mat(out, gates);
  }
  return out;
}

ForwardState ForwardState::deserialize(std::span<const float> data) {
  if (data.size() < 5) throw std::runtime_error("runtime: truncated activation message");
  const auto T = static_cast<Eigen::Index>(data[0]), H = static_cast<Eigen::Index>(data[1]),
             k = static_cast<Eigen::Index>(data[2]);
  std::size_t pos = 5;
  ForwardState s;
  s.x = get_mat(data, pos, T, H);
  if (data[3] != 0) s.u = get_mat(data, pos, T, H);
  if (data[4] != 0) {
    Mat ids = get_mat(data, pos, T, k);
    s.topk = ids.cast<int>();
    s.gates = get_mat(data, pos, T, k);
  }
  return s;
}

std::vector<float> BackwardState::serialize() const {
  const bool has_du = du.size() > 0, has_dg = dgates.size() > 0;
  std::vector<float> out = {static_cast<float>(dx.rows()), static_cast<float>(dx.cols()),
                            static_cast<float>(has_dg ? dgates.cols() : 0), has_du ? 1.0f : 0.0f, has_dg ? 1.0f : 0.0f};
  put_mat(out, dx);
  if (has_du) put_mat(out, du);
  if (has_dg) put_mat(out, dgates);
  return out;
}

BackwardState BackwardState::deserialize(std::span<const float> data) {
  if (data.size() < 5) throw std::runtime_error("runtime: truncated gradient message");
  const auto T = static_cast<Eigen::Index>(data[0]), H = static_cast<Eigen::Index>(data[1]),
             k = static_cast<Eigen::Index>(data[2]);
  std::size_t pos = 5;
  BackwardState s;
  s.dx = get_mat(data, pos, T, H);
  if (data[3] != 0) s.du = get_mat(data, pos, T, H);
  if (data[4] != 0) s.dgates = get_mat(data, pos, T, k);
  return s;
}

// Per peer a block of block_floats: [n, n expert ids, n rows of `hidden`], zero padded.
std::vector<float> pack_packets(const std::vector<ExpertPacket>& packets, std::int64_t block_floats,
                                std::int64_t hidden) {
  std::vector<float> out(static_cast<std::size_t>(block_floats) * packets.size(), 0.0f);
  for (std::size_t p = 0; p < packets.size(); ++p) {
    float* b = out.data() + p * static_cast<std::size_t>(block_floats);
    const auto n = packets[p].rows.rows();
    if (1 + n * (1 + hidden) > block_floats) throw std::runtime_error("runtime: expert packet exceeds its block");
    b[0] = static_cast<float>(n);
    for (Eigen::Index i = 0; i < n; ++i)
      b[1 + i] = packets[p].expert.empty() ? -1.0f : static_cast<float>(packets[p].expert[static_cast<std::size_t>(i)]);
    if (n > 0) std::memcpy(b + 1 + n, packets[p].rows.data(), sizeof(float) * static_cast<std::size_t>(n * hidden));
  }
  return out;
}

std::vector<ExpertPacket> unpack_packets(std::span<const float> data, int peers, std::int64_t block_floats,
                                         std::int64_t hidden) {
  std::vector<ExpertPacket> out(static_cast<std::size_t>(peers));
  for (int p = 0; p < peers; ++p) {
    const float* b = data.data() + static_cast<std::size_t>(p) * static_cast<std::size_t>(block_floats);
    const auto n = static_cast<Eigen::Index>(b[0]);
    auto& pk = out[static_cast<std::size_t>(p)];
    for (Eigen::Index i = 0; i < n; ++i) pk.expert.push_back(static_cast<int>(b[1 + i]));
    pk.rows = ConstMatMap(b + 1 + n, n, hidden);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------------
std::vector<TensorSpec> layer_tensors(const core::Layer& l) {
  const auto& s = l.shape;
  switch (l.kind) {
    case core::LayerKind::Embedding: {
      std::vector<TensorSpec> t = {{"embed", s.vocab, s.hidden}};
      if (s.max_positions > 0) t.push_back({"pos", s.max_positions, s.hidden});  // learned absolute positions
      return t;
    }
    case core::LayerKind::Norm:
      if (s.norm == core::NormKind::LayerNorm) return {{"norm", 1, s.hidden}, {"norm_bias", 1, s.hidden}};
      return {{"norm", 1, s.hidden}};
    case core::LayerKind::Attention: {
      std::vector<TensorSpec> t = {{"wq", s.hidden, s.heads * s.head_dim},
                                   {"wk", s.hidden, s.kv_heads * s.head_dim},
                                   {"wv", s.hidden, s.kv_heads * s.head_dim},
                                   {"wo", s.heads * s.head_dim, s.hidden}};
      if (s.qk_norm) t.push_back({"q_norm", 1, s.head_dim}), t.push_back({"k_norm", 1, s.head_dim});
      if (s.bias)
        t.push_back({"bias_q", 1, s.heads * s.head_dim}), t.push_back({"bias_k", 1, s.kv_heads * s.head_dim}),
            t.push_back({"bias_v", 1, s.kv_heads * s.head_dim}), t.push_back({"bias_o", 1, s.hidden});
      return t;
    }
    case core::LayerKind::Mlp: {
      if (s.activation == core::MlpActivation::GELU) {
        std::vector<TensorSpec> t = {{"wu", s.hidden, s.ffn}, {"wd", s.ffn, s.hidden}};
        if (s.bias) t.push_back({"bias_fc1", 1, s.ffn}), t.push_back({"bias_fc2", 1, s.hidden});
        return t;
      }
      return {{"wg", s.hidden, s.ffn}, {"wu", s.hidden, s.ffn}, {"wd", s.ffn, s.hidden}};
    }
    case core::LayerKind::MoeRouter:
      return {{"wr", s.hidden, s.experts}};
    case core::LayerKind::MoeExperts: {
      std::vector<TensorSpec> t;
      for (std::int64_t e = 0; e < s.experts; ++e)
        t.push_back({"wg", s.hidden, s.ffn}), t.push_back({"wu", s.hidden, s.ffn}),
            t.push_back({"wd", s.ffn, s.hidden});
      return t;
    }
    case core::LayerKind::Head:
      if (s.tied_with_embedding) return {};  // the embedding's table serves as the head
      return {{"wh", s.hidden, s.vocab}};
  }
  return {};
}

std::vector<std::array<std::int64_t, 3>> LocalTensor::runs() const {
  if (split == TpSplit::Columns) {
    std::vector<std::array<std::int64_t, 3>> out;
    out.reserve(static_cast<std::size_t>(local.rows));
    for (std::int64_t i = 0; i < local.rows; ++i)
      out.push_back({i * local.cols, full_offset + i * full.cols + part * local.cols, local.cols});
    return out;
  }
  return {{0, full_offset + (split == TpSplit::Rows ? part * local.size() : 0), local.size()}};
}

std::vector<LocalTensor> local_tensors(const core::Layer& layer, int shard_degree, int shard_index, int tp_degree,
                                       int tp_rank) {
  const auto full = layer_tensors(layer);
  std::size_t first = 0, last = full.size();
  if (layer.kind == core::LayerKind::MoeExperts && shard_degree > 1) {
    const std::size_t per = full.size() / static_cast<std::size_t>(shard_degree);
    first = per * static_cast<std::size_t>(shard_index), last = first + per;
  }
  std::vector<LocalTensor> out;
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < full.size(); offset += full[i].size(), ++i) {
    if (i < first || i >= last) continue;
    LocalTensor t{full[i], full[i], TpSplit::Replicated, tp_rank, offset};
    if (tp_degree > 1) {
      const std::string& n = full[i].name;
      switch (layer.kind) {
        case core::LayerKind::Embedding:  // vocab rows; positions replicated
          if (n == "embed") t.split = TpSplit::Rows;
          break;
        case core::LayerKind::Attention:  // heads; the output bias is replicated
          if (n == "wq" || n == "wk" || n == "wv" || n == "bias_q" || n == "bias_k" || n == "bias_v")
            t.split = TpSplit::Columns;
          else if (n == "wo")
            t.split = TpSplit::Rows;
          break;
        case core::LayerKind::Mlp:  // ffn; the output bias is replicated
          if (n == "wd")
            t.split = TpSplit::Rows;
          else if (n != "bias_fc2")
            t.split = TpSplit::Columns;
          break;
        case core::LayerKind::Head:
          t.split = TpSplit::Columns;
          break;                           // vocab columns
        case core::LayerKind::MoeExperts:  // expert TP: ffn of each expert
          t.split = n == "wd" ? TpSplit::Rows : TpSplit::Columns;
          break;
        default:
          break;  // norms, router
      }
      if (t.split == TpSplit::Columns) {
        if (t.full.cols % tp_degree != 0)
          throw std::invalid_argument("runtime: " + std::to_string(t.full.cols) + " columns of " + layer.name + "." +
                                      n + " do not split over " + std::to_string(tp_degree) + " tensor-parallel ranks");
        t.local.cols /= tp_degree;
      } else if (t.split == TpSplit::Rows) {
        if (t.full.rows % tp_degree != 0)
          throw std::invalid_argument("runtime: " + std::to_string(t.full.rows) + " rows of " + layer.name + "." + n +
                                      " do not split over " + std::to_string(tp_degree) + " tensor-parallel ranks");
        t.local.rows /= tp_degree;
      }
    }
    out.push_back(t);
  }
  return out;
}

// The tied table this segment's head uses, and its gradient: the embedding's (same segment) or the
// head's copy.
ConstMatMap HostModel::tied_table(SegmentParams& sp) {
  LayerView v = view(sp, sp.tied_copy ? head_layer_ : embed_layer_, false);
  return v.cmat(v.at("embed"));
}
MatMap HostModel::tied_table_grad(SegmentParams& sp) {
  LayerView v = view(sp, sp.tied_copy ? head_layer_ : embed_layer_, true);
  return v.mat(v.at("embed"));
}

// A lower bound of what one microbatch holds for its backward pass on the host (each layer's output,
// tokens x hidden floats, and each attention layer's probabilities, micro_batch_size x heads x seq^2
// floats), against the machine's memory: a 10^7-token sequence is refused in one line instead of
// ending in std::bad_alloc.
void HostModel::check_fits_in_memory(const std::string& who) const {
  const double s = static_cast<double>(model_.training().seq_len),
               b = static_cast<double>(model_.training().micro_batch_size);
  double bytes = 0;
  for (const auto& l : model_.layers()) {
    bytes += 4.0 * b * s * static_cast<double>(std::max<std::int64_t>(l.shape.hidden, 1));
    if (l.kind == core::LayerKind::Attention) bytes += 4.0 * b * static_cast<double>(l.shape.heads) * s * s;
  }
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return;
  const double have = static_cast<double>(pages) * static_cast<double>(page);
  if (bytes > have)
    throw std::invalid_argument(fmt::format(
        "{}one microbatch of {} x {} tokens needs at least {:.3g} GiB for its activations and attention scores, more "
        "than this "
        "machine's {:.3g} GiB of memory (lower training.seq_len or micro_batch_size)",
        who, model_.training().micro_batch_size, model_.training().seq_len, bytes / 1073741824.0, have / 1073741824.0));
}

namespace {

// Layer features the host kernels do not implement, refused rather than trained as another model.
void check_host_supports(const core::Model& model, const core::Layer& l, const std::string& who) {
  // Dropout would need masks drawn identically by every layout; the host backend trains without it
  // rather than silently run another model than the spec's.
  if (l.shape.dropout)
    throw std::invalid_argument(
        who + "field 'dropout' is " +
        (model.config() ? fmt::format("{}", model.config()->dropout_probability) : std::string("set")) +
        "; the host backend trains without dropout (set it to 0)");
  // Imported architectures the host kernels do not implement (Hugging Face import): refused
  // rather than trained as another model.
  if (l.shape.qkv_bias)
    throw std::invalid_argument(who +
                                "field 'qkv_bias' is set; the host backend has biases on every linear layer or none");
  if (l.shape.window > 0 && l.shape.window < model.training().seq_len)
    throw std::invalid_argument(who + "field 'sliding_window' is " + std::to_string(l.shape.window) +
                                "; the host backend runs full causal attention (use a seq_len <= the window)");
  if (l.kind == core::LayerKind::Attention && (l.shape.q_lora_rank || l.shape.kv_lora_rank))
    throw std::invalid_argument("runtime: the host backend has no MLA attention (" + l.name + ")");
  if (l.kind == core::LayerKind::Mlp && l.shape.activation == core::MlpActivation::SwiGLU && l.shape.bias)
    throw std::invalid_argument(who + "the host backend has no SwiGLU MLP biases (" + l.name +
                                "; biases run with \"activation\": \"gelu\")");
}

// A segment layout the host backend cannot run: ZeRO shards that do not divide the replicas, CP with
// learned positions or with expert sharding, heads that do not split over the TP ranks.
void check_segment_spec(const SegmentSpec& sp, const AttentionShape& attn) {
  const int zero_shards = std::max(1, sp.zero_shards);
  if (sp.replicas % zero_shards != 0)
    throw std::invalid_argument("runtime: segment " + std::to_string(sp.segment) + " has " +
                                std::to_string(sp.replicas) + " replicas, not a multiple of its " +
                                std::to_string(zero_shards) + " ZeRO shards");
  if (sp.cp_degree > 1 && !attn.rope)
    throw std::invalid_argument(
        "runtime: segment " + std::to_string(sp.segment) +
        " is context-parallel but the model has learned positions; the host backend runs CP with RoPE only");
  if (sp.tp_degree > 1 && (attn.heads % sp.tp_degree != 0 || attn.kv_heads % sp.tp_degree != 0))
    throw std::invalid_argument("runtime: " + std::to_string(attn.heads) + " heads / " + std::to_string(attn.kv_heads) +
                                " KV heads do not split over " + std::to_string(sp.tp_degree) +
                                " tensor-parallel ranks");
}

}  // namespace

HostModel::HostModel(const core::Model& model, std::vector<SegmentSpec> specs, std::uint64_t seed) : model_(model) {
  for (std::size_t i = 0; i < model_.layers().size(); ++i) {
    const auto& l = model_.layers()[i];
    if (l.kind == core::LayerKind::Embedding) embed_layer_ = static_cast<int>(i);
    if (l.kind == core::LayerKind::Head) head_layer_ = static_cast<int>(i), tied_ = l.shape.tied_with_embedding;
  }
  const std::string who = "runtime: model '" + model_.name() + "': ";
  const std::int64_t positions =
      embed_layer_ >= 0 ? model_.layers()[static_cast<std::size_t>(embed_layer_)].shape.max_positions : 0;
  // GPT-style initialisation of the token and position tables (std 0.02, Radford et al. 2019) when the
  // table is also the head (tied) or positions are learned; std 1 otherwise (an RMSNorm follows).
  gpt_init_ = tied_ || positions > 0;
  if (positions > 0 && positions < model_.training().seq_len)
    throw std::invalid_argument(who + "training.seq_len " + std::to_string(model_.training().seq_len) +
                                " exceeds max_positions " + std::to_string(positions) +
                                " (the learned position table)");
  for (const auto& l : model_.layers()) {
    check_host_supports(model_, l, who);
    if (l.kind == core::LayerKind::Attention) {
      attn_shape_ = AttentionShape{static_cast<int>(l.shape.heads),
                                   static_cast<int>(l.shape.kv_heads),
                                   static_cast<int>(l.shape.head_dim),
                                   static_cast<int>(model_.training().seq_len),
                                   l.shape.qk_norm,
                                   10000.0f,
                                   positions == 0,
                                   l.shape.bias};
    }
    if (l.kind == core::LayerKind::MoeRouter)
      top_k_ = static_cast<int>(l.shape.top_k), experts_ = static_cast<int>(l.shape.experts);
    hidden_ = std::max(hidden_, l.shape.hidden);
  }
  if (tied_ && embed_layer_ < 0)
    throw std::invalid_argument(who + "the head is tied to an embedding the model does not have");
  check_fits_in_memory(who);
  for (const auto& sp : specs) {
    check_segment_spec(sp, attn_shape_);
    SegmentParams p;
    p.segment = sp.segment;
    p.first_layer = sp.first_layer;
    p.last_layer = sp.last_layer;
    p.shard_degree = sp.shard_degree;
    p.shard_index = sp.shard_index;
    p.replicas = sp.replicas;
    p.replica_index = sp.replica_index;
    p.zero_level = sp.zero_level;
    p.zero_shards = std::max(1, sp.zero_shards);
    p.tp_degree = sp.tp_degree;
    p.tp_rank = sp.tp_rank;
    p.sequence_parallel = sp.sequence_parallel && sp.tp_degree > 1;
    p.recompute = sp.recompute;
    p.token_copies = sp.token_copies;
    p.cp_degree = sp.cp_degree;
    p.cp_rank = sp.cp_rank;
    p.expert_tp = sp.tp_degree > 1 && sp.last_layer == sp.first_layer + 1 &&
                  model_.layers().at(static_cast<std::size_t>(sp.first_layer)).kind == core::LayerKind::MoeExperts;
    p.tied_copy = tied_ && in_range(sp.first_layer, sp.last_layer, head_layer_) &&
                  !in_range(sp.first_layer, sp.last_layer, embed_layer_);
    std::int64_t n = 0;
    p.layer_offset.push_back(0);
    for (int l = sp.first_layer; l < sp.last_layer; ++l) {
      const auto& layer = model_.layers().at(static_cast<std::size_t>(l));
      if (sp.shard_degree > 1 && layer.kind != core::LayerKind::MoeExperts)
        throw std::invalid_argument("runtime: segment " + std::to_string(sp.segment) + " is sharded but layer '" +
                                    layer.name + "' is not routed experts (the host backend shards experts only)");
      if (sp.shard_degree > 1 && layer.shape.experts % sp.shard_degree != 0)
        throw std::invalid_argument("runtime: " + std::to_string(layer.shape.experts) + " experts of '" + layer.name +
                                    "' do not split over " + std::to_string(sp.shard_degree) + " devices");
      for (const auto& t : tensors_of(p, l)) n += t.local.size();
      p.layer_offset.push_back(n);
    }
    p.params.assign(static_cast<std::size_t>(n), 0.0f);
    p.grads.assign(static_cast<std::size_t>(n), 0.0f);
    p.chunk_floats = p.zero_level >= 1 ? (n + p.zero_shards - 1) / p.zero_shards : n;
    p.chunk_begin =
        p.zero_level >= 1 ? std::min<std::int64_t>(n, (p.replica_index % p.zero_shards) * p.chunk_floats) : 0;
    p.chunk_end = p.zero_level >= 1 ? std::min<std::int64_t>(n, p.chunk_begin + p.chunk_floats) : n;
    init_params(p, seed);
    const auto chunk = static_cast<std::size_t>(p.chunk_end - p.chunk_begin);
    if (p.zero_level >= 1) {
      p.master.assign(p.params.begin() + p.chunk_begin, p.params.begin() + p.chunk_end);
      p.grad_chunk.assign(chunk, 0.0f);
    }
    p.adam_m.assign(chunk, 0.0f);
    p.adam_v.assign(chunk, 0.0f);
    by_index_[p.segment] = segments_.size();
    segments_.push_back(std::move(p));
    if (segments_.back().zero_level >= 3) poison_params(segments_.back().segment);
  }
}

std::vector<LocalTensor> HostModel::tensors_of(const SegmentParams& sp, int layer) const {
  const auto& l = model_.layers().at(static_cast<std::size_t>(layer));
  const bool whole = l.kind == core::LayerKind::MoeExperts && !sp.expert_tp;  // experts inside a TP segment: replicated
  auto out = local_tensors(l, sp.shard_degree, sp.shard_index, whole ? 1 : sp.tp_degree, whole ? 0 : sp.tp_rank);
  if (sp.tied_copy && layer == head_layer_) {
    // This TP rank's vocabulary rows of the embedding table, laid out (and checkpointed) as the embedding's.
    auto e = local_tensors(model_.layers().at(static_cast<std::size_t>(embed_layer_)), 1, 0, sp.tp_degree, sp.tp_rank);
    e.resize(1);  // the token table only
    e[0].canonical_layer = embed_layer_;
    out.push_back(e[0]);
  }
  return out;
}

std::span<float> HostModel::tied_grads(int seg) {
  SegmentParams& sp = segment(seg);
  if (!tied_) return {};
  const bool has_embed = in_range(sp.first_layer, sp.last_layer, embed_layer_),
             has_head = in_range(sp.first_layer, sp.last_layer, head_layer_);
  if (has_embed == has_head) return {};
  LayerView v = view(sp, has_embed ? embed_layer_ : head_layer_, true);
  const auto& t = v.tensors.at(v.at("embed"));
  return {t.first, static_cast<std::size_t>(t.second.size())};
}

std::int64_t HostModel::layer_param_count(int layer) const {
  std::int64_t n = 0;
  for (const auto& t : layer_tensors(model_.layers().at(static_cast<std::size_t>(layer)))) n += t.size();
  return n;
}

SegmentParams& HostModel::segment(int index) {
  auto it = by_index_.find(index);
  if (it == by_index_.end())
    throw std::logic_error("runtime: this device holds no parameters of segment " + std::to_string(index));
  return segments_[it->second];
}

// Matrices ~ U(-a, a) with std 1/sqrt(fan_in) (embedding: std 1); norm weights 1. Each element is
// drawn from its canonical index, so every shard and slice holds exactly the reference's values.
void HostModel::init_params(SegmentParams& sp, std::uint64_t seed) {
  for (int l = sp.first_layer; l < sp.last_layer; ++l) {
    std::int64_t at = sp.layer_offset[static_cast<std::size_t>(l - sp.first_layer)];
    for (const auto& t : tensors_of(sp, l)) {
      // The tied head's copy is drawn as the embedding's table (its canonical layer).
      const int owner = t.canonical_layer >= 0 ? t.canonical_layer : l;
      const bool table = model_.layers().at(static_cast<std::size_t>(owner)).kind == core::LayerKind::Embedding;
      const bool bias = t.full.name.find("bias") != std::string::npos,
                 norm = !bias && t.full.name.find("norm") != std::string::npos;
      const double std = bias || norm ? 0.0
                         : table      ? (gpt_init_ ? 0.02 : 1.0)
                                      : 1.0 / std::sqrt(static_cast<double>(t.full.rows));
      const float a = static_cast<float>(std * std::sqrt(3.0));
      for (const auto& [local, full, len] : t.runs())
        for (std::int64_t i = 0; i < len; ++i)
          sp.params[static_cast<std::size_t>(at + local + i)] = norm   ? 1.0f
                                                                : bias ? 0.0f
                                                                       : a * uniform_pm1(seed, owner, full + i);
      at += t.local.size();
    }
  }
}

void HostModel::set_tp_comm(int seg, TpComm* comm) {
  auto& sp = segment(seg);
  if (comm == nullptr || comm->size() != sp.tp_degree || comm->rank() != sp.tp_rank)
    throw std::logic_error("runtime: segment " + std::to_string(seg) +
                           " got a tensor-parallel group that does not match its degree and rank");
  sp.tp = comm;
}

void HostModel::set_cp_comm(int seg, TpComm* comm) {
  auto& sp = segment(seg);
  if (comm == nullptr || comm->size() != sp.cp_degree || comm->rank() != sp.cp_rank)
    throw std::logic_error("runtime: segment " + std::to_string(seg) +
                           " got a context-parallel group that does not match its degree and rank");
  sp.cp = comm;
  sp.cp_attention.cp = sp.cp_degree;
  sp.cp_attention.rank = sp.cp_rank;
  sp.cp_attention.gather = [comm](const Mat& local) {
    Mat all(local.rows() * comm->size(), local.cols());
    comm->allgather(local.data(), local.size(), all.data());
    return all;
  };
  sp.cp_attention.scatter_sum = [comm](const Mat& partial) {
    Mat local(partial.rows() / comm->size(), partial.cols());
    comm->reduce_scatter(partial.data(), local.size(), local.data());
    return local;
  };
}

HostModel::LayerView HostModel::view(SegmentParams& sp, int layer, bool grads) {
  LayerView v;
  v.layer = &model_.layers().at(static_cast<std::size_t>(layer));
  float* p = (grads ? sp.grads.data() : sp.params.data()) +
             sp.layer_offset.at(static_cast<std::size_t>(layer - sp.first_layer));
  for (const auto& t : tensors_of(sp, layer)) {
    v.tensors.emplace_back(p, t.local);
    p += t.local.size();
  }
  return v;
}

std::vector<MlpWeights> HostModel::expert_weights(SegmentParams& sp, int layer) {
  LayerView v = view(sp, layer, false);
  std::vector<MlpWeights> w;
  for (std::size_t i = 0; i + 2 < v.tensors.size(); i += 3) w.push_back({v.cmat(i), v.cmat(i + 1), v.cmat(i + 2)});
  return w;
}

// ---------------------------------------------------------------------------------------------
// Optimizer
// ---------------------------------------------------------------------------------------------
void HostModel::update(int seg, const AdamWConfig& cfg, int step) {
  SegmentParams& sp = segment(seg);
  if (sp.zero_level >= 1) {
    if (!sp.grad_chunk_ready)  // one replica: no reduce-scatter ran, the chunk is the whole gradient
      sp.grad_chunk.assign(sp.grads.begin() + sp.chunk_begin, sp.grads.begin() + sp.chunk_end);
    adamw_update(cfg, step, sp.master, sp.grad_chunk, sp.adam_m, sp.adam_v);
    if (sp.zero_level < 3) std::copy(sp.master.begin(), sp.master.end(), sp.params.begin() + sp.chunk_begin);
  } else {
    adamw_update(cfg, step, sp.params, sp.grads, sp.adam_m, sp.adam_v);
  }
  discard_grads(seg);
}

void HostModel::discard_grads(int seg) {
  SegmentParams& sp = segment(seg);
  std::fill(sp.grads.begin(), sp.grads.end(), 0.0f);
  std::fill(sp.grad_chunk.begin(), sp.grad_chunk.end(), 0.0f);
  sp.grad_chunk_ready = false;
}

double HostModel::owned_grad_sq(int seg, double loss_scale) const {
  const SegmentParams& sp = segments_.at(by_index_.at(seg));
  if (!counts_in_grad_norm(sp)) return 0;
  const bool chunked = sp.zero_level >= 1;
  // The reduced gradient: local elements [begin, end) of the segment.
  const std::int64_t begin = chunked ? sp.chunk_begin : 0;
  const std::int64_t end = chunked ? sp.chunk_end : static_cast<std::int64_t>(sp.grads.size());
  const float* g = chunked && sp.grad_chunk_ready ? sp.grad_chunk.data() : sp.grads.data() + begin;
  double sum = 0;
  for (int l = sp.first_layer; l < sp.last_layer; ++l) {
    std::int64_t at = sp.layer_offset[static_cast<std::size_t>(l - sp.first_layer)];
    for (const auto& t : tensors_of(sp, l)) {
      const std::int64_t len = static_cast<std::int64_t>(t.local.size());
      const bool copy = t.canonical_layer >= 0 && t.canonical_layer != l;  // a tied head's table
      const bool replicated = sp.tp_degree > 1 && t.split == TpSplit::Replicated;
      if (!copy && !(replicated && sp.tp_rank != 0))
        for (std::int64_t i = std::max(at, begin); i < std::min(at + len, end); ++i) {
          const double u = static_cast<double>(g[i - begin]) / loss_scale;  // a power of two: exact
          sum += u * u;
        }
      at += len;
    }
  }
  return sum;
}

void HostModel::poison_params(int seg) {
  auto& p = segment(seg).params;
  std::fill(p.begin(), p.end(), std::numeric_limits<float>::quiet_NaN());
}

std::vector<ParamRecord> HostModel::param_records() const {
  std::vector<ParamRecord> out;
  for (const auto& sp : segments_) {
    auto r = sp.zero_level >= 3 ? records(sp, sp.master, sp.chunk_begin, sp.chunk_end)
                                : records(sp, sp.params, 0, static_cast<std::int64_t>(sp.params.size()));
    std::move(r.begin(), r.end(), std::back_inserter(out));
  }
  return out;
}

std::vector<ParamRecord> HostModel::grad_records() const {
  std::vector<ParamRecord> out;
  for (const auto& sp : segments_) {
    auto r = records(sp, sp.grads, 0, static_cast<std::int64_t>(sp.grads.size()));
    std::move(r.begin(), r.end(), std::back_inserter(out));
  }
  return out;
}

std::vector<HostModel::CanonicalRun> HostModel::canonical_runs(const SegmentParams& sp) const {
  std::vector<CanonicalRun> out;
  for (int l = sp.first_layer; l < sp.last_layer; ++l) {
    std::int64_t at = sp.layer_offset[static_cast<std::size_t>(l - sp.first_layer)];
    for (const auto& t : tensors_of(sp, l)) {
      const bool replicated = sp.tp_degree > 1 && t.split == TpSplit::Replicated;
      for (const auto& [local, full, len] : t.runs())
        out.push_back({t.canonical_layer >= 0 ? t.canonical_layer : l, at + local, full, len, replicated});
      at += t.local.size();
    }
  }
  return out;
}

// `src` holds the segment's local elements [begin, end): each local run that overlaps it becomes one
// record at its canonical offset. Replicated tensors of a TP group are reported by TP rank 0.
std::vector<ParamRecord> HostModel::records(const SegmentParams& sp, const std::vector<float>& src, std::int64_t begin,
                                            std::int64_t end) const {
  std::vector<ParamRecord> out;
  for (const auto& run : canonical_runs(sp)) {
    if (run.replicated && sp.tp_rank != 0) continue;
    const std::int64_t a = std::max(run.local, begin), b = std::min(run.local + run.length, end);
    if (a >= b) continue;
    ParamRecord r;
    r.layer = run.layer;
    r.offset = run.canonical + (a - run.local);
    r.values.assign(src.begin() + (a - begin), src.begin() + (b - begin));
    out.push_back(std::move(r));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Token stream
// ---------------------------------------------------------------------------------------------
TokenStream::TokenStream(std::int64_t vocab, std::int64_t seq_len, std::uint64_t seed, const std::string& data_path)
    : vocab_(vocab), seq_len_(seq_len), seed_(seed) {
  if (!data_path.empty()) {
    // Bounded by Limit::DataBytes before allocating: /dev/zero or a 10 GB file is refused, not read whole.
    std::string text;
    try {
      text = core::read_input_file(data_path, core::Limit::DataBytes);
    } catch (const core::Error& e) {
      throw std::invalid_argument(std::string("--data ") + e.what());
    }
    bytes_.assign(text.begin(), text.end());
    if (static_cast<std::int64_t>(bytes_.size()) < seq_len + 2)
      throw std::invalid_argument(data_path + ": --data holds " + std::to_string(bytes_.size()) +
                                  " bytes, fewer than one sequence (" + std::to_string(seq_len + 1) + ")");
  }
}

// Synthetic: an arithmetic sequence mod vocab with a random start and a stride in 1..4, so the next
// token is predictable from context and the loss falls.
std::vector<int> TokenStream::sequence(std::int64_t index) const {
  std::vector<int> out(static_cast<std::size_t>(seq_len_ + 1));
  if (!bytes_.empty()) {
    const auto span = static_cast<std::int64_t>(bytes_.size()) - seq_len_ - 1;
    const std::int64_t start = (index * seq_len_) % span;
    for (std::size_t i = 0; i < out.size(); ++i)
      out[i] = static_cast<int>(bytes_[static_cast<std::size_t>(start) + i] % vocab_);
    return out;
  }
  const std::uint64_t h = splitmix64(seed_ * 0x2545f4914f6cdd1dULL + static_cast<std::uint64_t>(index));
  const auto start = static_cast<std::int64_t>(h % static_cast<std::uint64_t>(vocab_));
  const auto stride = static_cast<std::int64_t>(1 + (h >> 32) % 4);
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<int>((start + static_cast<std::int64_t>(i) * stride) % vocab_);
  return out;
}

MicrobatchData TokenStream::microbatch(int step, int mb, int rank, int microbatches, int ranks,
                                       std::int64_t micro_batch_size) const {
  MicrobatchData d;
  const std::int64_t first = ((static_cast<std::int64_t>(step) * microbatches + mb) * ranks + rank) * micro_batch_size;
  for (std::int64_t b = 0; b < micro_batch_size; ++b) {
    auto s = sequence(first + b);
    d.tokens.insert(d.tokens.end(), s.begin(), s.end() - 1);
    d.targets.insert(d.targets.end(), s.begin() + 1, s.end());
  }
  return d;
}

}  // namespace piper::runtime::host
