// The host model's compute: per-layer forward/backward of a segment on the residual stream, with its
// tensor-parallel collectives, and the expert-parallel routing (dispatch, experts, combine).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

#include "host_model_view.hpp"
#include "piper/runtime/host_model.hpp"

namespace piper::runtime::host {

namespace {

Mat zeros_like_rows(Eigen::Index rows, Eigen::Index cols) { return Mat::Zero(rows, cols); }

}  // namespace

namespace {

// ---- Tensor-parallel collectives on token-row matrices (rows are tokens, row-major storage) ----
bool tp_on(const SegmentParams& sp) { return sp.tp_degree > 1; }

void tp_sum(const SegmentParams& sp, Mat& m) {
  if (tp_on(sp)) sp.tp->allreduce_sum(m.data(), m.size());
}

// Sequence parallelism: rank r holds the r-th contiguous 1/t of a microbatch's token rows.
Mat tp_gather_rows(const SegmentParams& sp, const Mat& local) {
  Mat full(local.rows() * sp.tp_degree, local.cols());
  sp.tp->allgather(local.data(), local.size(), full.data());
  return full;
}

Mat tp_scatter_sum_rows(const SegmentParams& sp, const Mat& partial) {
  if (partial.rows() % sp.tp_degree != 0)
    throw std::invalid_argument("runtime: " + std::to_string(partial.rows()) + " token rows do not split over " +
                                std::to_string(sp.tp_degree) + " sequence-parallel ranks");
  Mat local(partial.rows() / sp.tp_degree, partial.cols());
  sp.tp->reduce_scatter(partial.data(), local.size(), local.data());
  return local;
}

// Entering a column-parallel GEMM: SP gathers the sequence (g in Megatron's f/g notation); plain TP
// already holds the whole, replicated input.
Mat tp_enter(const SegmentParams& sp, const Mat& m) { return sp.sequence_parallel ? tp_gather_rows(sp, m) : m; }
// Leaving a row-parallel GEMM (forward) or entering a column-parallel one (backward): the partial
// sums of the ranks are all-reduced, or reduce-scattered to the sequence slice under SP.
Mat tp_leave(const SegmentParams& sp, Mat partial) {
  if (!tp_on(sp)) return partial;
  if (sp.sequence_parallel) return tp_scatter_sum_rows(sp, partial);
  tp_sum(sp, partial);
  return partial;
}

// Expert TP (Megatron-core's ETP): each rank of the group holds 1/e of every local expert's FFN
// (fc1 columns, fc2 rows). Before fc1 the group gathers its routed rows and their experts (counts
// differ: padded to the largest); after fc2 (and after the input gradient's GEMMs) the partial sums
// are reduce-scattered back to the rows' owners.
struct EtpRows {
  Mat rows;
  std::vector<int> expert, counts;
};
EtpRows etp_gather(const SegmentParams& sp, const Mat& rows, const std::vector<int>* expert,
                   const std::vector<int>* counts_known) {
  const int e = sp.tp_degree;
  EtpRows out;
  if (counts_known) {
    out.counts = *counts_known;
  } else {
    float n = static_cast<float>(rows.rows());
    std::vector<float> all(static_cast<std::size_t>(e));
    sp.tp->allgather(&n, 1, all.data());
    for (float v : all) out.counts.push_back(static_cast<int>(v));
  }
  const Eigen::Index pad = std::max<Eigen::Index>(1, *std::max_element(out.counts.begin(), out.counts.end()));
  const Eigen::Index h = rows.cols();
  Mat mine = Mat::Zero(pad, h);
  if (rows.rows()) mine.topRows(rows.rows()) = rows;
  Mat all(pad * e, h);
  sp.tp->allgather(mine.data(), mine.size(), all.data());
  Eigen::Index total = 0;
  for (int c : out.counts) total += c;
  out.rows.resize(total, h);
  Eigen::Index at = 0;
  for (int r = 0; r < e; ++r) {
    const int c = out.counts[static_cast<std::size_t>(r)];
    if (c) out.rows.middleRows(at, c) = all.middleRows(r * pad, c);
    at += c;
  }
  if (expert) {
    std::vector<float> ids(static_cast<std::size_t>(pad), -1.0f), all_ids(static_cast<std::size_t>(pad * e));
    for (std::size_t i = 0; i < expert->size(); ++i) ids[i] = static_cast<float>((*expert)[i]);
    sp.tp->allgather(ids.data(), pad, all_ids.data());
    for (int r = 0; r < e; ++r)
      for (int i = 0; i < out.counts[static_cast<std::size_t>(r)]; ++i)
        out.expert.push_back(static_cast<int>(all_ids[static_cast<std::size_t>(r * pad + i)]));
  }
  return out;
}
Mat etp_scatter(const SegmentParams& sp, const Mat& partial, const std::vector<int>& counts) {
  const int e = sp.tp_degree;
  const Eigen::Index pad = std::max<Eigen::Index>(1, *std::max_element(counts.begin(), counts.end()));
  const Eigen::Index h = partial.cols();
  Mat padded = Mat::Zero(pad * e, h);
  Eigen::Index at = 0;
  for (int r = 0; r < e; ++r) {
    const int c = counts[static_cast<std::size_t>(r)];
    if (c) padded.middleRows(r * pad, c) = partial.middleRows(at, c);
    at += c;
  }
  Mat mine(pad, h);
  sp.tp->reduce_scatter(padded.data(), mine.size(), mine.data());
  return mine.topRows(counts[static_cast<std::size_t>(sp.tp_rank)]);
}

// Vocab-parallel LM head with the parallel cross-entropy: logits stay split by vocabulary; the row
// max and the softmax denominator are all-reduced, the target logit comes from the rank owning it.
double head_forward_vocab_parallel(const SegmentParams& sp, const ConstMatMap& wh, const Mat& u,
                                   const std::vector<int>& targets, float loss_scale, HeadCache* c) {
  const Eigen::Index T = u.rows(), V = wh.cols();
  const int first = sp.tp_rank * static_cast<int>(V);
  Mat logits = u * wh;
  Vec mx = logits.rowwise().maxCoeff();
  sp.tp->allreduce_max(mx.data(), mx.size());
  logits = (logits.colwise() - mx).array().exp().matrix();
  Vec sum_z(2 * T);  // [sum of exp, target logit - max] per row
  sum_z.head(T) = logits.rowwise().sum();
  sum_z.tail(T).setZero();
  for (Eigen::Index t = 0; t < T; ++t) {
    const int y = targets[static_cast<std::size_t>(t)] - first;
    if (y >= 0 && y < V) sum_z(T + t) = std::log(logits(t, y));
  }
  sp.tp->allreduce_sum(sum_z.data(), sum_z.size());
  double loss_sum = 0;
  for (Eigen::Index t = 0; t < T; ++t) {
    loss_sum += std::log(static_cast<double>(sum_z(t))) - static_cast<double>(sum_z(T + t));
    logits.row(t) /= sum_z(t);
    const int y = targets[static_cast<std::size_t>(t)] - first;
    if (y >= 0 && y < V) logits(t, y) -= 1.0f;
  }
  if (c) c->u = u, c->dlogits = logits * loss_scale;
  return loss_sum;
}

std::int64_t mat_floats(const Mat& m) { return m.size(); }
template <class... M>
std::int64_t mats(const M&... m) {
  return (std::int64_t{0} + ... + static_cast<std::int64_t>(m.size()));
}

}  // namespace

std::int64_t SegmentStash::floats() const {
  std::int64_t n = 0;
  for (const auto& c : layers) {
    n += mats(c.norm.x, c.norm.rstd, c.lnorm.xhat, c.lnorm.rstd);
    n += mats(c.gmlp.u, c.gmlp.a, c.gmlp.h);
    n += mats(c.attn.u, c.attn.q_lin, c.attn.k_lin, c.attn.v, c.attn.q_rstd, c.attn.k_rstd, c.attn.q, c.attn.k,
              c.attn.o);
    for (const auto& p : c.attn.probs) n += mat_floats(p);
    n += mats(c.mlp.u, c.mlp.a, c.mlp.b, c.mlp.h);
    n += mats(c.router.u, c.router.gates) + c.router.topk.size();
    for (const auto& e : c.experts.per_expert) n += mats(e.u, e.a, e.b, e.h);
    n += mats(c.source.y, c.source.gates) + c.source.topk.size();
    n += mats(c.head.u, c.head.dlogits) + static_cast<std::int64_t>(c.tokens.size());
  }
  if (input)
    n += mats(input->x, input->u, input->gates) + input->topk.size() +
         static_cast<std::int64_t>(data.tokens.size() + data.targets.size());
  return n;
}

// ---------------------------------------------------------------------------------------------
// Forward / backward of a segment
// ---------------------------------------------------------------------------------------------
double HostModel::forward(int seg, const MicrobatchData& data, float loss_scale, ForwardState& s, SegmentStash& stash) {
  SegmentParams& sp = segment(seg);
  if (tp_on(sp) && sp.tp == nullptr)
    throw std::logic_error("runtime: tensor-parallel segment " + std::to_string(seg) + " has no TP group");
  const bool full = sp.recompute == RecomputeMode::Full;
  stash = SegmentStash{};
  if (full) stash.input = s, stash.data = data, stash.loss_scale = loss_scale;
  double loss = 0;
  forward_layers(sp, data, loss_scale, s, stash, &loss);
  // Full recomputation keeps nothing but the input: the layers' caches go now, B rebuilds them.
  if (full) stash.layers.clear();
  return loss;
}

AttentionShape HostModel::segment_attention(SegmentParams& sp) const {
  AttentionShape shape = attn_shape_;
  shape.heads /= sp.tp_degree;
  shape.kv_heads /= sp.tp_degree;
  if (sp.cp_degree > 1) {
    shape.seq_len /= sp.cp_degree;
    shape.cp = &sp.cp_attention;
  }
  return shape;
}

void HostModel::forward_layers(SegmentParams& sp, const MicrobatchData& data, float loss_scale, ForwardState& s,
                               SegmentStash& stash, double* loss) {
  // A rerun for full recomputation keeps the attention core: the backward is about to use it.
  const bool drop_core = sp.recompute == RecomputeMode::Selective && loss != nullptr;
  const AttentionShape shape = segment_attention(sp);
  stash.layers.assign(static_cast<std::size_t>(sp.last_layer - sp.first_layer), LayerCache{});
  for (int l = sp.first_layer; l < sp.last_layer; ++l) {
    LayerCache& c = stash.layers[static_cast<std::size_t>(l - sp.first_layer)];
    LayerView v = view(sp, l, false);
    switch (v.layer->kind) {
      case core::LayerKind::Embedding:
        c.tokens = data.tokens;
        s.x = tp_leave(
            sp, embedding_forward(v.cmat(0), data.tokens, sp.tp_rank * static_cast<int>(v.tensors[0].second.rows)));
        // Learned positions (replicated over TP) are added once, after the vocab-parallel reduction;
        // with SP this rank holds the token rows from tp_rank * rows on.
        if (v.has("pos"))
          positions_forward(s.x, v.cmat(v.at("pos")), shape.seq_len,
                            sp.sequence_parallel ? sp.tp_rank * static_cast<int>(s.x.rows()) : 0);
        s.u.resize(0, 0);
        break;
      case core::LayerKind::Norm:
        if (v.has("norm_bias"))
          s.u = layernorm_forward(s.x, v.cvec(0), v.cvec(1), &c.lnorm);
        else
          s.u = rmsnorm_forward(s.x, v.cvec(0), &c.norm);
        break;
      case core::LayerKind::Attention: {
        Mat y = tp_leave(sp, attention_forward(shape, v.attention(shape), tp_enter(sp, s.u), &c.attn));
        if (shape.bias) bias_add(y, v.cvec(v.at("bias_o")));  // row-parallel output bias: once, after the reduction
        s.x += y;
        if (drop_core) attention_drop_core(c.attn);
        break;
      }
      case core::LayerKind::Mlp:
        if (v.has("wg")) {
          s.x += tp_leave(sp, mlp_forward({v.cmat(0), v.cmat(1), v.cmat(2)}, tp_enter(sp, s.u), &c.mlp));
        } else {
          Mat y = tp_leave(sp, gelu_mlp_forward(v.gelu(), tp_enter(sp, s.u), &c.gmlp));
          if (v.has("bias_fc2")) bias_add(y, v.cvec(v.at("bias_fc2")));
          s.x += y;
        }
        break;
      case core::LayerKind::MoeRouter:
        router_forward(v.cmat(0), top_k_, s.u, &c.router, &s.topk, &s.gates);
        break;
      case core::LayerKind::MoeExperts: {
        if (sp.shard_degree > 1)
          throw std::logic_error("runtime: sharded experts run through the expert-parallel path");
        c.source = route(s, 1);
        auto packets = dispatch_forward(s, c.source);
        Mat y;
        if (sp.expert_tp) {
          EtpRows g = etp_gather(sp, packets[0].rows, &packets[0].expert, nullptr);
          c.etp_counts = g.counts;
          y = etp_scatter(sp, experts_forward(expert_weights(sp, l), 0, g.expert, g.rows, &c.experts), c.etp_counts);
        } else {
          y = experts_forward(expert_weights(sp, l), 0, packets[0].expert, packets[0].rows, &c.experts);
        }
        combine_forward(s, c.source, {ExpertPacket{{}, std::move(y)}});
        break;
      }
      case core::LayerKind::Head: {
        double ls = 0;
        const bool tp = tp_on(sp);
        if (!tied_) {
          ls = tp ? head_forward_vocab_parallel(sp, v.cmat(0), tp_enter(sp, s.u), data.targets, loss_scale, &c.head)
                  : head_forward(v.cmat(0), s.u, data.targets, loss_scale, &c.head);
        } else if (!tp) {
          ls = tied_head_forward(tied_table(sp), s.u, data.targets, loss_scale, &c.head);
        } else {  // the vocab-parallel head takes this rank's rows of the table as [H, V/t] columns
          const Mat wh = tied_table(sp).transpose();
          ls = head_forward_vocab_parallel(sp, ConstMatMap(wh.data(), wh.rows(), wh.cols()), tp_enter(sp, s.u),
                                           data.targets, loss_scale, &c.head);
        }
        if (tp && sp.tp_rank != 0) ls = 0;  // every TP rank computed the same loss: count it once
        if (loss) *loss += ls;
        break;
      }
    }
  }
}

void HostModel::backward_input(int seg, BackwardState& g, SegmentStash& stash) {
  SegmentParams& sp = segment(seg);
  if (stash.layers.empty() && stash.input) {  // full recomputation: rerun the forward from the kept input
    ForwardState s = *stash.input;
    forward_layers(sp, stash.data, stash.loss_scale, s, stash, nullptr);
    stash.input.reset();
  }
  const AttentionShape shape = segment_attention(sp);
  for (int l = sp.last_layer - 1; l >= sp.first_layer; --l) {
    LayerCache& c = stash.layers.at(static_cast<std::size_t>(l - sp.first_layer));
    LayerView v = view(sp, l, false);
    if (g.du.size() == 0 && g.dx.size() > 0) g.du = zeros_like_rows(g.dx.rows(), g.dx.cols());
    switch (v.layer->kind) {
      case core::LayerKind::Head:
        g.du = tp_leave(
            sp, tied_ ? tied_head_backward_input(tied_table(sp), c.head) : head_backward_input(v.cmat(0), c.head));
        g.dx = zeros_like_rows(g.du.rows(), g.du.cols());
        break;
      case core::LayerKind::Norm:
        c.dy_norm = g.du;
        if (v.has("norm_bias"))
          g.dx += layernorm_backward_input(c.lnorm, v.cvec(0), g.du);
        else
          g.dx += rmsnorm_backward_input(c.norm, v.cvec(0), g.du);
        g.du.setZero();
        break;
      case core::LayerKind::MoeExperts: {
        auto packets = dispatch_backward(g, c.source);
        Mat du = sp.expert_tp
                     ? etp_scatter(sp,
                                   experts_backward_input(expert_weights(sp, l), c.experts,
                                                          etp_gather(sp, packets[0].rows, nullptr, &c.etp_counts).rows),
                                   c.etp_counts)
                     : experts_backward_input(expert_weights(sp, l), c.experts, packets[0].rows);
        combine_backward(g, c.source, {ExpertPacket{{}, std::move(du)}});
        break;
      }
      case core::LayerKind::MoeRouter:
        g.du += router_backward_input(v.cmat(0), c.router, g.dgates);
        g.dgates.resize(0, 0);
        break;
      case core::LayerKind::Mlp:
        if (v.has("wg"))
          g.du += tp_leave(sp, mlp_backward_input({v.cmat(0), v.cmat(1), v.cmat(2)}, c.mlp, tp_enter(sp, g.dx)));
        else
          g.du += tp_leave(sp, gelu_mlp_backward_input(v.gelu(), c.gmlp, tp_enter(sp, g.dx)));
        break;
      case core::LayerKind::Attention:
        g.du += tp_leave(sp, attention_backward_input(shape, v.attention(shape), c.attn, tp_enter(sp, g.dx)));
        break;
      case core::LayerKind::Embedding:
        c.dx_embed = tp_enter(sp, g.dx);
        g = BackwardState{};
        break;
    }
  }
}

namespace {

// Replicated weights of a TP segment whose per-rank gradients are partial: the per-head q/k norms
// (each rank sees its heads), and under SP every replicated weight (each rank sees its tokens).
// Their contribution of this microbatch is summed over the TP group here, in BW.
template <class TensorsOf>
std::vector<std::pair<float*, std::int64_t>> partial_tp_grads(SegmentParams& sp, const TensorsOf& tensors_of) {
  std::vector<std::pair<float*, std::int64_t>> partial;
  if (tp_on(sp))
    for (int l = sp.first_layer; l < sp.last_layer; ++l) {
      float* p = sp.grads.data() + sp.layer_offset.at(static_cast<std::size_t>(l - sp.first_layer));
      for (const auto& t : tensors_of(l)) {
        // Learned positions and the row-parallel output biases take their gradient from the
        // gathered (whole) rows, identical on every TP rank: complete, not partial.
        const std::string& n = t.full.name;
        const bool whole = n == "pos" || n == "bias_o" || n == "bias_fc2";
        const bool per_head = n == "q_norm" || n == "k_norm";
        if (t.split == TpSplit::Replicated && !whole && (sp.sequence_parallel || per_head))
          partial.emplace_back(p, t.local.size());
        p += t.local.size();
      }
    }
  return partial;
}

}  // namespace

void HostModel::backward_weight(int seg, SegmentStash& stash) {
  SegmentParams& sp = segment(seg);
  const AttentionShape shape = segment_attention(sp);
  const std::vector<std::pair<float*, std::int64_t>> partial =
      partial_tp_grads(sp, [&](int l) { return tensors_of(sp, l); });
  std::vector<float> before;
  for (auto [p, n] : partial) before.insert(before.end(), p, p + n), std::fill(p, p + n, 0.0f);
  // (token_copies > 1 only on segments without TP, whose `partial` is empty: its pointers stay valid.)
  std::vector<float> copies_before;
  if (sp.token_copies > 1) copies_before.swap(sp.grads), sp.grads.assign(copies_before.size(), 0.0f);
  for (int l = sp.first_layer; l < sp.last_layer; ++l) {
    LayerCache& c = stash.layers.at(static_cast<std::size_t>(l - sp.first_layer));
    LayerView gv = view(sp, l, true);
    switch (gv.layer->kind) {
      case core::LayerKind::Embedding:
        embedding_backward_weight(c.tokens, c.dx_embed, gv.mat(0),
                                  sp.tp_rank * static_cast<int>(gv.tensors[0].second.rows));
        if (gv.has("pos"))
          positions_backward_weight(c.dx_embed, gv.mat(gv.at("pos")), shape.seq_len);  // dx_embed: whole rows
        break;
      case core::LayerKind::Norm:
        if (gv.has("norm_bias"))
          layernorm_backward_weight(c.lnorm, c.dy_norm, gv.vec(0), gv.vec(1));
        else
          rmsnorm_backward_weight(c.norm, c.dy_norm, gv.vec(0));
        break;
      case core::LayerKind::Attention: {
        AttentionGrads g{gv.mat(0),
                         gv.mat(1),
                         gv.mat(2),
                         gv.mat(3),
                         shape.qk_norm ? gv.vec(4) : gv.vec(0),
                         shape.qk_norm ? gv.vec(5) : gv.vec(0),
                         gv.vec_or_empty("bias_q"),
                         gv.vec_or_empty("bias_k"),
                         gv.vec_or_empty("bias_v")};
        attention_backward_weight(shape, c.attn, g);
        if (shape.bias) bias_backward_weight(c.attn.dout, gv.vec(gv.at("bias_o")));  // dout: the whole rows
        break;
      }
      case core::LayerKind::Mlp: {
        if (gv.has("wg")) {
          MlpGrads g{gv.mat(0), gv.mat(1), gv.mat(2)};
          mlp_backward_weight(c.mlp, g);
        } else {
          GeluMlpGrads g{gv.mat(gv.at("wu")), gv.mat(gv.at("wd")), gv.vec_or_empty("bias_fc1")};
          gelu_mlp_backward_weight(c.gmlp, g);
          if (gv.has("bias_fc2")) bias_backward_weight(c.gmlp.dout, gv.vec(gv.at("bias_fc2")));
        }
        break;
      }
      case core::LayerKind::MoeRouter:
        router_backward_weight(c.router, gv.mat(0));
        break;
      case core::LayerKind::MoeExperts: {
        std::vector<MlpGrads> g;
        for (std::size_t i = 0; i + 2 < gv.tensors.size(); i += 3)
          g.push_back({gv.mat(i), gv.mat(i + 1), gv.mat(i + 2)});
        experts_backward_weight(c.experts, g);
        break;
      }
      case core::LayerKind::Head:
        if (tied_)
          tied_head_backward_weight(c.head, tied_table_grad(sp));
        else
          head_backward_weight(c.head, gv.mat(0));
        break;
    }
  }
  if (sp.token_copies > 1) {
    const float inv = 1.0f / static_cast<float>(sp.token_copies);
    for (std::size_t i = 0; i < sp.grads.size(); ++i) sp.grads[i] = copies_before[i] + sp.grads[i] * inv;
  }
  if (!partial.empty()) {
    std::vector<float> sum;
    for (auto [p, n] : partial) sum.insert(sum.end(), p, p + n);
    sp.tp->allreduce_sum(sum.data(), static_cast<std::int64_t>(sum.size()));
    std::size_t at = 0;
    for (auto [p, n] : partial)
      for (std::int64_t i = 0; i < n; ++i, ++at) p[i] = before[at] + sum[at];
  }
}

// ---------------------------------------------------------------------------------------------
// Expert parallelism
// ---------------------------------------------------------------------------------------------
ExpertSource HostModel::route(const ForwardState& s, int group_size) const {
  if (s.topk.size() == 0) throw std::logic_error("runtime: experts reached without a router output");
  ExpertSource src;
  src.topk = s.topk;
  src.gates = s.gates;
  src.slots_to.assign(static_cast<std::size_t>(group_size), {});
  const int per_rank = experts_ / group_size;
  for (Eigen::Index t = 0; t < s.topk.rows(); ++t)
    for (Eigen::Index j = 0; j < s.topk.cols(); ++j)
      src.slots_to[static_cast<std::size_t>(s.topk(t, j) / per_rank)].push_back(
          static_cast<int>(t * s.topk.cols() + j));
  src.y = Mat::Zero(s.topk.rows() * s.topk.cols(), s.x.cols());
  return src;
}

std::vector<ExpertPacket> HostModel::dispatch_forward(const ForwardState& s, const ExpertSource& src) const {
  std::vector<ExpertPacket> out(src.slots_to.size());
  const auto k = static_cast<int>(src.topk.cols());
  for (std::size_t p = 0; p < out.size(); ++p) {
    const auto& slots = src.slots_to[p];
    out[p].rows.resize(static_cast<Eigen::Index>(slots.size()), s.u.cols());
    for (std::size_t i = 0; i < slots.size(); ++i) {
      out[p].expert.push_back(src.topk(slots[i] / k, slots[i] % k));
      out[p].rows.row(static_cast<Eigen::Index>(i)) = s.u.row(slots[i] / k);
    }
  }
  return out;
}

namespace {
Mat concat_rows(const std::vector<ExpertPacket>& from, std::int64_t hidden, std::vector<int>* experts,
                std::vector<int>* counts) {
  Eigen::Index n = 0;
  for (const auto& p : from) n += p.rows.rows();
  Mat rows(n, hidden);
  Eigen::Index at = 0;
  for (const auto& p : from) {
    if (p.rows.rows()) rows.middleRows(at, p.rows.rows()) = p.rows;
    at += p.rows.rows();
    if (experts) experts->insert(experts->end(), p.expert.begin(), p.expert.end());
    if (counts) counts->push_back(static_cast<int>(p.rows.rows()));
  }
  return rows;
}

std::vector<ExpertPacket> split_rows(const Mat& rows, const std::vector<int>& counts) {
  std::vector<ExpertPacket> out(counts.size());
  Eigen::Index at = 0;
  for (std::size_t p = 0; p < counts.size(); ++p) {
    out[p].rows = rows.middleRows(at, counts[p]);
    at += counts[p];
  }
  return out;
}
}  // namespace

Mat HostModel::experts_forward_entries(int seg, const std::vector<ExpertPacket>& from, SegmentStash& stash,
                                       std::vector<ExpertPacket>* to_sources) {
  SegmentParams& sp = segment(seg);
  stash.layers.assign(1, LayerCache{});
  LayerCache& c = stash.layers[0];
  std::vector<int> experts;
  Mat rows = concat_rows(from, hidden_, &experts, &c.source_counts);
  const int first = sp.shard_index * experts_ / sp.shard_degree;
  Mat y;
  if (sp.expert_tp) {
    EtpRows g = etp_gather(sp, rows, &experts, nullptr);
    c.etp_counts = g.counts;
    y = etp_scatter(sp, experts_forward(expert_weights(sp, sp.first_layer), first, g.expert, g.rows, &c.experts),
                    c.etp_counts);
  } else {
    y = experts_forward(expert_weights(sp, sp.first_layer), first, experts, rows, &c.experts);
  }
  *to_sources = split_rows(y, c.source_counts);
  return y;
}

void HostModel::combine_forward(ForwardState& s, ExpertSource& src,
                                const std::vector<ExpertPacket>& from_owners) const {
  for (std::size_t p = 0; p < from_owners.size(); ++p) {
    const auto& slots = src.slots_to[p];
    if (static_cast<Eigen::Index>(slots.size()) != from_owners[p].rows.rows())
      throw std::runtime_error("runtime: expert combine got " + std::to_string(from_owners[p].rows.rows()) +
                               " rows from rank " + std::to_string(p) + ", expected " + std::to_string(slots.size()));
    for (std::size_t i = 0; i < slots.size(); ++i)
      src.y.row(slots[i]) = from_owners[p].rows.row(static_cast<Eigen::Index>(i));
  }
  const auto k = src.topk.cols();
  for (Eigen::Index t = 0; t < src.topk.rows(); ++t)
    for (Eigen::Index j = 0; j < k; ++j) s.x.row(t) += src.gates(t, j) * src.y.row(t * k + j);
  s.topk.resize(0, 0);
  s.gates.resize(0, 0);
}

// x += sum_j g_j y_j:  dy_j = g_j dx,  dg_j = dx . y_j.
std::vector<ExpertPacket> HostModel::dispatch_backward(BackwardState& g, const ExpertSource& src) const {
  const auto k = src.topk.cols();
  g.dgates = Mat::Zero(src.topk.rows(), k);
  for (Eigen::Index t = 0; t < src.topk.rows(); ++t)
    for (Eigen::Index j = 0; j < k; ++j) g.dgates(t, j) = g.dx.row(t).dot(src.y.row(t * k + j));
  std::vector<ExpertPacket> out(src.slots_to.size());
  for (std::size_t p = 0; p < out.size(); ++p) {
    const auto& slots = src.slots_to[p];
    out[p].rows.resize(static_cast<Eigen::Index>(slots.size()), g.dx.cols());
    for (std::size_t i = 0; i < slots.size(); ++i)
      out[p].rows.row(static_cast<Eigen::Index>(i)) = src.gates(slots[i] / k, slots[i] % k) * g.dx.row(slots[i] / k);
  }
  return out;
}

void HostModel::experts_backward_entries(int seg, const std::vector<ExpertPacket>& from, SegmentStash& stash,
                                         std::vector<ExpertPacket>* to_sources) {
  SegmentParams& sp = segment(seg);
  LayerCache& c = stash.layers.at(0);
  Mat dy = concat_rows(from, hidden_, nullptr, nullptr);
  Mat du = sp.expert_tp ? etp_scatter(sp,
                                      experts_backward_input(expert_weights(sp, sp.first_layer), c.experts,
                                                             etp_gather(sp, dy, nullptr, &c.etp_counts).rows),
                                      c.etp_counts)
                        : experts_backward_input(expert_weights(sp, sp.first_layer), c.experts, dy);
  *to_sources = split_rows(du, c.source_counts);
}

void HostModel::combine_backward(BackwardState& g, const ExpertSource& src,
                                 const std::vector<ExpertPacket>& from_owners) const {
  const auto k = static_cast<int>(src.topk.cols());
  if (g.du.size() == 0) g.du = Mat::Zero(g.dx.rows(), g.dx.cols());
  for (std::size_t p = 0; p < from_owners.size(); ++p) {
    const auto& slots = src.slots_to[p];
    if (static_cast<Eigen::Index>(slots.size()) != from_owners[p].rows.rows())
      throw std::runtime_error("runtime: expert backward combine got a wrong row count from rank " + std::to_string(p));
    for (std::size_t i = 0; i < slots.size(); ++i)
      g.du.row(slots[i] / k) += from_owners[p].rows.row(static_cast<Eigen::Index>(i));
  }
}

}  // namespace piper::runtime::host
