// The CUDA model's compute: forward/BI/BW of each layer kind with the CUDA kernels and cuBLASLt, the
// experts, and the expert-parallel routing (dispatch, combine). Each function mirrors the HostModel
// function of the same name in gpu_runtime/src/host_model_compute.cpp.
#include <algorithm>
#include <array>
#include <functional>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "cuda_model_weights.hpp"
#include "piper/runtime/cuda/cuda_model.hpp"

namespace piper::runtime::cuda {

using model_detail::M;

namespace {

M of(const Tensor& t) { return {t.data(), t.rows, t.cols}; }

Gemm& gemm_of(const Exec& e) {
  if (!e.gemm) throw std::logic_error("runtime: a GEMM was issued on a stream without compute ops");
  return *e.gemm;
}

GemmShape shape_of(M a, bool ta, M b, bool tb) {
  GemmShape s;
  s.m = static_cast<int>(ta ? a.cols : a.rows);
  s.k = static_cast<int>(ta ? a.rows : a.cols);
  s.n = static_cast<int>(tb ? b.rows : b.cols);
  s.trans_a = ta;
  s.trans_b = tb;
  return s;
}

// C = op(A) op(B) as a new tensor.
Tensor matmul(const Exec& e, DType dt, M a, bool ta, M b, bool tb) {
  const GemmShape s = shape_of(a, ta, b, tb);
  Tensor c = new_tensor(e, s.m, s.n, dtype_bytes(dt));
  if (s.m > 0 && s.n > 0) {
    if (s.k == 0)
      check(cudaMemsetAsync(c.data(), 0, c.bytes(), e.stream), "cudaMemsetAsync");
    else
      gemm_of(e).run(dt, s, a.p, b.p, c.data());
  }
  return c;
}

// C += op(A) op(B) in the storage type.
void matmul_acc(const Exec& e, DType dt, M a, bool ta, M b, bool tb, Tensor& c) {
  const GemmShape s = shape_of(a, ta, b, tb);
  if (s.m > 0 && s.n > 0 && s.k > 0) gemm_of(e).run(dt, s, a.p, b.p, c.data(), 1.0f, 1.0f);
}

// g (fp32) += alpha op(A) op(B): weight gradients accumulate in fp32 whatever the storage type (a bf16
// product is never rounded to bf16 before it is added).
void weight_grad(const Exec& e, DType dt, M a, bool ta, M b, bool tb, float* g, float alpha = 1.0f) {
  const GemmShape s = shape_of(a, ta, b, tb);
  if (s.m == 0 || s.n == 0 || s.k == 0) return;
  gemm_of(e).run_f32_out(dt, s, a.p, b.p, g, alpha, 1.0f);
}

Tensor plus(const Exec& e, DType dt, const Tensor& a, const Tensor& b) {
  Tensor out = new_tensor(e, a.rows, a.cols, a.elem);
  add(dt, a.data(), b.data(), a.size(), out.data(), e.stream);
  return out;
}

Tensor copy_of(const Exec& e, const Tensor& t) {
  Tensor out = new_tensor(e, t.rows, t.cols, t.elem);
  if (t.bytes())
    check(cudaMemcpyAsync(out.data(), t.data(), t.bytes(), cudaMemcpyDeviceToDevice, e.stream), "cudaMemcpyAsync");
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Layer kernels (mirroring host kernels.cpp)
// ---------------------------------------------------------------------------------------------
namespace {

AttentionDims dims_of(const host::AttentionShape& s, std::int64_t tokens) {
  AttentionDims d{static_cast<int>(tokens), s.seq_len, s.heads, s.kv_heads, s.head_dim};
  if (s.context_parallel()) d.cp = s.cp->cp, d.cp_rank = s.cp->rank;
  return d;
}

// RoPE of `m` ([T, heads*hd]) at its rows' positions (under CP, this rank's chunks'); sign -1 inverts it.
void rope_rows(const Exec& e, DType dt, const host::AttentionShape& a, Tensor& m, int heads, float sign) {
  const AttentionDims d = dims_of(a, m.rows);
  rope(dt, m.data(), static_cast<int>(m.rows), heads, a.head_dim, a.seq_len, a.rope_theta, sign, e.stream, d.cp,
       d.cp_rank);
}

Tensor mlp_forward(const Exec& e, DType dt, M wg, M wu, M wd, const Tensor& u, MlpCache& c) {
  c.u = u;
  c.a = matmul(e, dt, of(u), false, wg, false);
  c.b = matmul(e, dt, of(u), false, wu, false);
  c.h = new_tensor(e, c.a.rows, c.a.cols, c.a.elem);
  swiglu_forward(dt, c.a.data(), c.b.data(), c.a.size(), c.h.data(), e.stream);
  return matmul(e, dt, of(c.h), false, wd, false);
}

Tensor mlp_backward_input(const Exec& e, DType dt, M wg, M wu, M wd, MlpCache& c, const Tensor& dout) {
  c.dout = dout;
  Tensor dh = matmul(e, dt, of(dout), false, wd, true);
  c.da = new_tensor(e, c.a.rows, c.a.cols, c.a.elem);
  c.db = new_tensor(e, c.b.rows, c.b.cols, c.b.elem);
  swiglu_backward(dt, c.a.data(), c.b.data(), dh.data(), c.a.size(), c.da.data(), c.db.data(), e.stream);
  Tensor du = matmul(e, dt, of(c.da), false, wg, true);
  matmul_acc(e, dt, of(c.db), false, wu, true, du);
  return du;
}

void mlp_backward_weight(const Exec& e, DType dt, const MlpCache& c, float* gwg, float* gwu, float* gwd,
                         float alpha = 1.0f) {
  weight_grad(e, dt, of(c.h), true, of(c.dout), false, gwd, alpha);
  weight_grad(e, dt, of(c.u), true, of(c.da), false, gwg, alpha);
  weight_grad(e, dt, of(c.u), true, of(c.db), false, gwu, alpha);
}

// db (fp32) += the column sums of the rows `t` (a bias gradient).
void bias_grad(const Exec& e, DType dt, const Tensor& t, float* db) {
  bias_backward_weight(dt, t.data(), static_cast<int>(t.rows), static_cast<int>(t.cols), db, e.stream);
}

// x += b over its rows (a bias), in place.
void add_bias(const Exec& e, DType dt, Tensor& x, const void* b) {
  bias_add(dt, x.data(), b, static_cast<int>(x.rows), static_cast<int>(x.cols), e.stream);
}

// GPT's MLP: h = gelu(u w1 + b1), returned h w2 (the caller adds b2); b1 null without biases.
Tensor gelu_mlp_forward(const Exec& e, DType dt, M w1, M w2, const void* b1, const Tensor& u, MlpCache& c) {
  c.u = u;
  c.a = matmul(e, dt, of(u), false, w1, false);
  if (b1) add_bias(e, dt, c.a, b1);
  c.h = new_tensor(e, c.a.rows, c.a.cols, c.a.elem);
  gelu_forward(dt, c.a.data(), c.a.size(), c.h.data(), e.stream);
  return matmul(e, dt, of(c.h), false, w2, false);
}

Tensor gelu_mlp_backward_input(const Exec& e, DType dt, M w1, M w2, MlpCache& c, const Tensor& dout) {
  c.dout = dout;
  Tensor dh = matmul(e, dt, of(dout), false, w2, true);
  c.da = new_tensor(e, c.a.rows, c.a.cols, c.a.elem);
  gelu_backward(dt, c.a.data(), dh.data(), c.a.size(), c.da.data(), e.stream);
  return matmul(e, dt, of(c.da), false, w1, true);
}

// The attention core on q, k, v of `k`: its output k.o and what its backward reads (k.probs), on
// the path choose_attention picks (kept in k.path for the backward).
void attention_core(const Exec& e, DType dt, const host::AttentionShape& a, AttentionCache& k) {
  const std::size_t es = dtype_bytes(dt);
  const std::int64_t T = k.u.rows;
  const std::int64_t seqs = T / a.seq_len;
  k.o = new_tensor(e, T, static_cast<std::int64_t>(a.heads) * a.head_dim, es);
  // The flash and cuDNN paths keep one log-sum-exp per row, the reference the [L, cp·L] probabilities;
  // the backward takes the path the forward took (the reference one under context parallelism).
  const AttentionDims dims = dims_of(a, T);
  k.path = choose_attention(dt, dims);
  if (k.path == AttentionPath::Reference) {
    const bool cp = dims.cp > 1;
    k.probs = new_tensor(e, seqs * a.heads * a.seq_len, static_cast<std::int64_t>(a.seq_len) * dims.cp, 4);
    attention_core_forward(dt, dims, k.q.data(), (cp ? k.k_all : k.k).data(), (cp ? k.v_all : k.v).data(),
                           k.probs.as<float>(), k.o.data(), e.stream);
  } else if (k.path == AttentionPath::Flash) {
    k.probs = new_tensor(e, seqs * a.heads, a.seq_len, 4);
    flash_attention_forward(dims, k.q.data(), k.k.data(), k.v.data(), k.probs.as<float>(), k.o.data(), e.stream);
  } else {
    k.probs = new_tensor(e, seqs * a.heads, a.seq_len, 4);
    const Tensor ws = new_tensor(e, 1, static_cast<std::int64_t>(cudnn_attention_workspace(dims, false)), 1);
    cudnn_attention_forward(dims, k.q.data(), k.k.data(), k.v.data(), k.probs.as<float>(), k.o.data(), ws.data(),
                            e.stream);
  }
}

// An attention layer's forward on the normed rows `u`: projections (with the q, k, v biases of a
// GPT layer: `bias` null or {bq, bk, bv}), optional per-head q/k RMSNorm (weights q_norm, k_norm), RoPE
// (unless the model has learned positions), under context parallelism every CP rank's k and v
// (`cp_gather`, set exactly then), the attention core and the output projection, which it returns
// without its bias (the caller adds it); `k` keeps what the backward reads.
Tensor attention_layer_forward(const Exec& e, DType dt, const host::AttentionShape& a, const std::array<M, 4>& w,
                               const void* q_norm, const void* k_norm, const std::array<const void*, 3>* bias,
                               const Tensor& u, AttentionCache& k,
                               const std::function<Tensor(const Tensor&)>& cp_gather) {
  const auto& [wq, wk, wv, wo] = w;
  const std::size_t es = dtype_bytes(dt);
  const std::int64_t T = u.rows;
  k.u = u;
  k.q_lin = matmul(e, dt, of(u), false, wq, false);
  k.k_lin = matmul(e, dt, of(u), false, wk, false);
  k.v = matmul(e, dt, of(u), false, wv, false);
  if (bias)
    add_bias(e, dt, k.q_lin, (*bias)[0]), add_bias(e, dt, k.k_lin, (*bias)[1]), add_bias(e, dt, k.v, (*bias)[2]);
  if (a.qk_norm) {
    k.q_rstd = new_tensor(e, T, a.heads, 4);
    k.k_rstd = new_tensor(e, T, a.kv_heads, 4);
    k.q = new_tensor(e, k.q_lin.rows, k.q_lin.cols, es);
    k.k = new_tensor(e, k.k_lin.rows, k.k_lin.cols, es);
    // Per-head RMSNorm: [T, heads*hd] row-major is [T*heads, hd].
    rmsnorm_forward(dt, k.q_lin.data(), q_norm, static_cast<int>(T * a.heads), a.head_dim, host::kNormEps, k.q.data(),
                    k.q_rstd.as<float>(), e.stream);
    rmsnorm_forward(dt, k.k_lin.data(), k_norm, static_cast<int>(T * a.kv_heads), a.head_dim, host::kNormEps,
                    k.k.data(), k.k_rstd.as<float>(), e.stream);
  } else if (a.rope) {  // RoPE rotates in place: q_lin and k_lin stay as they were
    k.q = copy_of(e, k.q_lin);
    k.k = copy_of(e, k.k_lin);
  } else {
    k.q = k.q_lin;
    k.k = k.k_lin;
  }
  if (a.rope) {
    rope_rows(e, dt, a, k.q, a.heads, 1.0f);
    rope_rows(e, dt, a, k.k, a.kv_heads, 1.0f);
  }
  if (a.context_parallel()) {  // K and V of the whole sequence (ring attention's blocks, all at once)
    k.k_all = cp_gather(k.k);
    k.v_all = cp_gather(k.v);
  }
  attention_core(e, dt, a, k);
  return matmul(e, dt, of(k.o), false, wo, false);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Forward / backward of a segment
// ---------------------------------------------------------------------------------------------
void CudaModel::forward(const Exec& e, int seg, const host::MicrobatchData& data, float loss_scale, ForwardState& s,
                        SegmentStash& stash) {
  const bool full = layout_.segment(seg).recompute == host::RecomputeMode::Full;
  stash = SegmentStash{};
  if (full) stash.input = s, stash.data = data, stash.loss_scale = loss_scale;
  forward_layers(e, seg, data, loss_scale, s, stash, true);
  // Full recomputation keeps nothing but the input: the layers' caches go now, B rebuilds them.
  if (full) stash.layers.clear();
}

void CudaModel::forward_layers(const Exec& e, int seg, const host::MicrobatchData& data, float loss_scale,
                               ForwardState& s, SegmentStash& stash, bool count_loss) {
  host::SegmentParams& sp = layout_.segment(seg);
  const bool drop_core = sp.recompute == host::RecomputeMode::Selective && count_loss;
  stash.layers.assign(static_cast<std::size_t>(sp.last_layer - sp.first_layer), LayerCache{});
  const std::size_t es = elem();
  const host::AttentionShape shape = segment_attention(seg);  // this TP rank's heads
  for (int l = sp.first_layer; l < sp.last_layer; ++l) {
    LayerCache& c = stash.layers[static_cast<std::size_t>(l - sp.first_layer)];
    Weights w = weights(seg, l, false);
    switch (w.layer->kind) {
      case core::LayerKind::Embedding:
        embedding_layer_forward(e, seg, w, data, s, c);
        break;
      case core::LayerKind::Norm:
        c.norm.x = s.x;
        c.norm.rstd = new_tensor(e, s.x.rows, 1, 4);
        s.u = new_tensor(e, s.x.rows, s.x.cols, es);
        if (w.has("norm_bias")) {
          c.norm.mean = new_tensor(e, s.x.rows, 1, 4);
          layernorm_forward(dt_, s.x.data(), w.ptr(0), w.ptr(1), static_cast<int>(s.x.rows), static_cast<int>(s.x.cols),
                            host::kLayerNormEps, s.u.data(), c.norm.mean.as<float>(), c.norm.rstd.as<float>(),
                            e.stream);
        } else {
          rmsnorm_forward(dt_, s.x.data(), w.ptr(0), static_cast<int>(s.x.rows), static_cast<int>(s.x.cols),
                          host::kNormEps, s.u.data(), c.norm.rstd.as<float>(), e.stream);
        }
        break;
      case core::LayerKind::Attention: {
        const bool qk_norm = attn_shape_.qk_norm;
        std::array<const void*, 3> bias{};
        if (attn_shape_.bias) bias = {w.ptr(w.at("bias_q")), w.ptr(w.at("bias_k")), w.ptr(w.at("bias_v"))};
        Tensor out = attention_layer_forward(e, dt_, shape, {w.mat(0), w.mat(1), w.mat(2), w.mat(3)},
                                             qk_norm ? w.ptr(4) : nullptr, qk_norm ? w.ptr(5) : nullptr,
                                             attn_shape_.bias ? &bias : nullptr, tp_enter(e, seg, s.u), c.attn,
                                             [&](const Tensor& local) { return cp_gather(e, seg, local); });
        out = tp_leave(e, seg, out);  // row-parallel output projection: the ranks' partial sums
        if (attn_shape_.bias) add_bias(e, dt_, out, w.ptr(w.at("bias_o")));  // once, after the sum
        s.x = plus(e, dt_, s.x, out);
        if (drop_core) c.attn.o = Tensor{}, c.attn.probs = Tensor{};
        break;
      }
      case core::LayerKind::Mlp: {
        Tensor out;
        const Tensor u = tp_enter(e, seg, s.u);
        if (w.has("wg")) {
          out = mlp_forward(e, dt_, w.mat(0), w.mat(1), w.mat(2), u, c.mlp);
        } else {
          out = gelu_mlp_forward(e, dt_, w.mat(w.at("wu")), w.mat(w.at("wd")),
                                 w.has("bias_fc1") ? w.ptr(w.at("bias_fc1")) : nullptr, u, c.mlp);
        }
        out = tp_leave(e, seg, out);
        if (w.has("bias_fc2")) add_bias(e, dt_, out, w.ptr(w.at("bias_fc2")));
        s.x = plus(e, dt_, s.x, out);
        break;
      }
      case core::LayerKind::MoeRouter: {
        const std::int64_t T = s.u.rows;
        c.router.u = s.u;
        Tensor logits = matmul(e, dt_, of(s.u), false, w.mat(0), false);
        s.topk = new_tensor(e, T, top_k(), 4);
        s.gates = new_tensor(e, T, top_k(), 4);
        router_topk(dt_, logits.data(), static_cast<int>(T), experts(), top_k(), s.topk.as<int>(), s.gates.as<float>(),
                    e.stream);
        c.router.topk = s.topk;
        c.router.gates = s.gates;
        break;
      }
      case core::LayerKind::MoeExperts: {
        if (sp.shard_degree > 1)
          throw std::logic_error("runtime: sharded experts run through the expert-parallel path");
        c.source = route(e, s, 1);
        auto packets = dispatch_forward(e, s, c.source);
        Tensor y = routed_experts_forward(e, seg, l, 0, packets[0].expert, packets[0].rows, c.experts);
        combine_forward(e, s, c.source, {ExpertPacket{{}, std::move(y)}});
        break;
      }
      case core::LayerKind::Head:
        head_forward(e, seg, data, loss_scale, tp_enter(e, seg, s.u), c, count_loss);
        break;
    }
  }
}

void CudaModel::embedding_layer_forward(const Exec& e, int seg, const Weights& w, const host::MicrobatchData& data,
                                        ForwardState& s, LayerCache& c) {
  const host::SegmentParams& sp = layout_.segment(seg);
  const bool tp = tp_of(seg) != nullptr;
  c.tokens = upload_ints(e, data.tokens);
  const auto T = static_cast<std::int64_t>(data.tokens.size());
  s.x = new_tensor(e, T, hidden(), elem());
  // Vocab-parallel under TP: this rank's rows of the table, the others' zero, summed over the group.
  const int rows = static_cast<int>(w.tensors[0].second.rows);
  embedding_forward(dt_, w.ptr(0), c.tokens.as<int>(), static_cast<int>(T), static_cast<int>(hidden()), s.x.data(),
                    e.stream, tp ? sp.tp_rank * rows : 0, tp ? rows : -1);
  s.x = tp_leave(e, seg, s.x);  // SP: this rank's token rows of the sum
  if (w.has("pos"))             // learned absolute positions (GPT), replicated: added once, after the sum
    positions_forward(dt_, s.x.data(), w.ptr(w.at("pos")), static_cast<int>(s.x.rows), static_cast<int>(hidden()),
                      attn_shape_.seq_len, e.stream,
                      sp.sequence_parallel ? sp.tp_rank * static_cast<int>(s.x.rows) : 0);
  s.u = Tensor{};
}

void CudaModel::head_forward(const Exec& e, int seg, const host::MicrobatchData& data, float loss_scale,
                             const Tensor& u, LayerCache& c, bool count_loss) {
  const host::SegmentParams& sp = layout_.segment(seg);
  const bool tp = tp_of(seg) != nullptr;
  const std::int64_t T = u.rows;
  c.head.u = u;
  // logits, then in place (softmax - onehot) * scale; a tied head multiplies by the table [V, H]
  bool tied = false;
  const M wh = head_weights(seg, false, tied).mat(0);
  c.head.dlogits = matmul(e, dt_, of(u), false, wh, tied);
  Tensor targets = upload_ints(e, data.targets);
  Tensor loss = new_tensor(e, T, 1, 4);
  if (tp)  // vocab-parallel: this rank's columns of the logits
    vocab_parallel_cross_entropy(e, seg, c.head.dlogits, targets, sp.tp_rank * static_cast<int>(c.head.dlogits.cols),
                                 loss_scale, loss.as<float>());
  else
    cross_entropy(dt_, c.head.dlogits.data(), targets.as<int>(), static_cast<int>(T),
                  static_cast<int>(c.head.dlogits.cols), loss_scale, loss.as<float>(), e.stream);
  // Every TP rank computed the same loss: rank 0 counts it.
  if (count_loss && (!tp || sp.tp_rank == 0))
    sum_into(loss.as<float>(), static_cast<int>(T), loss_.as<float>(), e.stream);
}

void CudaModel::backward_input(const Exec& e, int seg, BackwardState& g, SegmentStash& stash) {
  host::SegmentParams& sp = layout_.segment(seg);
  if (stash.layers.empty() && stash.input) {  // full recomputation: rerun the forward from the kept input
    ForwardState s = *stash.input;
    forward_layers(e, seg, stash.data, stash.loss_scale, s, stash, false);
    stash.input.reset();
  }
  const std::size_t es = elem();
  for (int l = sp.last_layer - 1; l >= sp.first_layer; --l) {
    LayerCache& c = stash.layers.at(static_cast<std::size_t>(l - sp.first_layer));
    Weights w = weights(seg, l, false);
    if (g.du.empty() && !g.dx.empty()) g.du = zeros(e, g.dx.rows, g.dx.cols, es);
    switch (w.layer->kind) {
      case core::LayerKind::Head: {
        bool tied = false;
        const M wh = head_weights(seg, false, tied).mat(0);
        // Vocab-parallel: each rank's columns give a partial input gradient (SP: reduce-scattered to its rows).
        g.du = tp_leave(e, seg, matmul(e, dt_, of(c.head.dlogits), false, wh, !tied));
        g.dx = zeros(e, g.du.rows, g.du.cols, es);
        break;
      }
      case core::LayerKind::Norm: {
        c.dy_norm = g.du;
        Tensor dx = new_tensor(e, g.du.rows, g.du.cols, es);
        if (w.has("norm_bias"))
          layernorm_backward_input(dt_, c.norm.x.data(), c.norm.mean.as<float>(), c.norm.rstd.as<float>(), w.ptr(0),
                                   g.du.data(), static_cast<int>(g.du.rows), static_cast<int>(g.du.cols), dx.data(),
                                   e.stream);
        else
          rmsnorm_backward_input(dt_, c.norm.x.data(), c.norm.rstd.as<float>(), w.ptr(0), g.du.data(),
                                 static_cast<int>(g.du.rows), static_cast<int>(g.du.cols), dx.data(), e.stream);
        g.dx = plus(e, dt_, g.dx, dx);
        g.du = zeros(e, g.dx.rows, g.dx.cols, es);
        break;
      }
      case core::LayerKind::MoeExperts: {
        auto packets = dispatch_backward(e, g, c.source);
        Tensor du = routed_experts_backward_input(e, seg, l, c.experts, packets[0].rows);
        combine_backward(e, g, c.source, {ExpertPacket{{}, std::move(du)}});
        break;
      }
      case core::LayerKind::MoeRouter: {
        const std::int64_t T = c.router.u.rows;
        c.router.dlogits = new_tensor(e, T, experts(), es);
        router_backward(dt_, c.router.topk.as<int>(), c.router.gates.as<float>(), g.dgates.as<float>(),
                        static_cast<int>(T), experts(), top_k(), c.router.dlogits.data(), e.stream);
        Tensor du = matmul(e, dt_, of(c.router.dlogits), false, w.mat(0), true);
        g.du = plus(e, dt_, g.du, du);
        g.dgates = Tensor{};
        break;
      }
      case core::LayerKind::Mlp: {
        const Tensor dx = tp_enter(e, seg, g.dx);
        Tensor du = w.has("wg") ? mlp_backward_input(e, dt_, w.mat(0), w.mat(1), w.mat(2), c.mlp, dx)
                                : gelu_mlp_backward_input(e, dt_, w.mat(w.at("wu")), w.mat(w.at("wd")), c.mlp, dx);
        du = tp_leave(e, seg, du);  // column-parallel input gradient: partial over the ranks' columns
        g.du = plus(e, dt_, g.du, du);
        break;
      }
      case core::LayerKind::Attention: {
        // Column-parallel q/k/v: partial over the ranks' heads.
        const Tensor du = tp_leave(e, seg, attention_backward_input(e, seg, w, c.attn, tp_enter(e, seg, g.dx)));
        g.du = plus(e, dt_, g.du, du);
        break;
      }
      case core::LayerKind::Embedding:
        c.dx_embed = tp_enter(e, seg, g.dx);  // whole rows: the table's and the positions' gradients
        g = BackwardState{};
        break;
    }
  }
}

Tensor CudaModel::attention_backward_input(const Exec& e, int seg, const Weights& w, AttentionCache& k,
                                           const Tensor& dx) {
  const std::size_t es = elem();
  const host::AttentionShape a = segment_attention(seg);
  const std::int64_t T = k.u.rows;
  if (k.o.empty()) attention_core(e, dt_, a, k);  // selective recomputation: the core was dropped
  k.dout = dx;
  Tensor d_o = matmul(e, dt_, of(dx), false, w.mat(3), true);
  const AttentionDims dims = dims_of(a, T);
  const bool cp = dims.cp > 1;
  // Under context parallelism dK and dV of every rank's keys, summed back to their owners below.
  const Tensor& keys = cp ? k.k_all : k.k;
  const Tensor& values = cp ? k.v_all : k.v;
  Tensor dq = new_tensor(e, k.q.rows, k.q.cols, es), dk = new_tensor(e, keys.rows, keys.cols, es);
  k.dv = new_tensor(e, values.rows, values.cols, es);
  if (k.path == AttentionPath::Cudnn) {
    const Tensor ws = new_tensor(e, 1, static_cast<std::int64_t>(cudnn_attention_workspace(dims, true)), 1);
    cudnn_attention_backward(dims, k.q.data(), k.k.data(), k.v.data(), k.o.data(), k.probs.as<float>(), d_o.data(),
                             dq.data(), dk.data(), k.dv.data(), ws.data(), e.stream);
  } else {
    // Reference: ds is scratch of the probabilities' size; flash: delta, one value per row.
    Tensor ds = new_tensor(e, k.probs.rows, k.probs.cols, 4);
    if (k.path == AttentionPath::Flash)
      flash_attention_backward(dims, k.q.data(), k.k.data(), k.v.data(), k.o.data(), k.probs.as<float>(), d_o.data(),
                               ds.as<float>(), dq.data(), dk.data(), k.dv.data(), e.stream);
    else
      attention_core_backward(dt_, dims, k.q.data(), keys.data(), values.data(), k.probs.as<float>(), d_o.data(),
                              ds.as<float>(), dq.data(), dk.data(), k.dv.data(), e.stream);
  }
  if (cp) {  // ring attention's returning dK/dV: each rank keeps the sum over the group of its block
    dk = cp_scatter_sum(e, seg, dk);
    k.dv = cp_scatter_sum(e, seg, k.dv);
  }
  if (a.rope) {
    rope_rows(e, dt_, a, dq, a.heads, -1.0f);
    rope_rows(e, dt_, a, dk, a.kv_heads, -1.0f);
  }
  if (a.qk_norm) {
    k.dq_lin = new_tensor(e, dq.rows, dq.cols, es);
    k.dk_lin = new_tensor(e, dk.rows, dk.cols, es);
    rmsnorm_backward_input(dt_, k.q_lin.data(), k.q_rstd.as<float>(), w.ptr(4), dq.data(),
                           static_cast<int>(T * a.heads), a.head_dim, k.dq_lin.data(), e.stream);
    rmsnorm_backward_input(dt_, k.k_lin.data(), k.k_rstd.as<float>(), w.ptr(5), dk.data(),
                           static_cast<int>(T * a.kv_heads), a.head_dim, k.dk_lin.data(), e.stream);
    // The host computes the q/k norm weight gradients in BI and adds them in BW: same here.
    k.dq_norm = zeros(e, a.head_dim, 1, 4);
    k.dk_norm = zeros(e, a.head_dim, 1, 4);
    rmsnorm_backward_weight(dt_, k.q_lin.data(), k.q_rstd.as<float>(), dq.data(), static_cast<int>(T * a.heads),
                            a.head_dim, k.dq_norm.as<float>(), e.stream);
    rmsnorm_backward_weight(dt_, k.k_lin.data(), k.k_rstd.as<float>(), dk.data(), static_cast<int>(T * a.kv_heads),
                            a.head_dim, k.dk_norm.as<float>(), e.stream);
    // Replicated over TP but seen through this rank's heads only: summed over the group.
    tp_sum_floats(e, seg, k.dq_norm.as<float>(), a.head_dim);
    tp_sum_floats(e, seg, k.dk_norm.as<float>(), a.head_dim);
  } else {
    k.dq_lin = dq;
    k.dk_lin = dk;
  }
  Tensor du = matmul(e, dt_, of(k.dq_lin), false, w.mat(0), true);
  matmul_acc(e, dt_, of(k.dk_lin), false, w.mat(1), true, du);
  matmul_acc(e, dt_, of(k.dv), false, w.mat(2), true, du);
  return du;
}

void CudaModel::backward_weight(const Exec& e, int seg, SegmentStash& stash) {
  host::SegmentParams& sp = layout_.segment(seg);
  for (int l = sp.first_layer; l < sp.last_layer; ++l) {
    LayerCache& c = stash.layers.at(static_cast<std::size_t>(l - sp.first_layer));
    Weights gw = weights(seg, l, true);
    switch (gw.layer->kind) {
      case core::LayerKind::Embedding: {
        const int rows = static_cast<int>(gw.tensors[0].second.rows);
        const bool tp = tp_of(seg) != nullptr;
        embedding_backward_weight(dt_, c.tokens.as<int>(), c.dx_embed.data(), static_cast<int>(c.dx_embed.rows),
                                  static_cast<int>(c.dx_embed.cols), gw.grad(0), e.stream, tp ? sp.tp_rank * rows : 0,
                                  tp ? rows : -1);
      }
        if (gw.has("pos"))
          positions_backward_weight(dt_, c.dx_embed.data(), static_cast<int>(c.dx_embed.rows),
                                    static_cast<int>(c.dx_embed.cols), attn_shape_.seq_len, gw.grad(gw.at("pos")),
                                    e.stream);
        break;
      case core::LayerKind::Norm: {
        const std::int64_t cols = c.dy_norm.cols;
        float* const bias = gw.has("norm_bias") ? gw.grad(1) : nullptr;
        Tensor s0, s1;
        float* g0 = partial_grad_begin(e, seg, gw.grad(0), cols, s0);
        float* g1 = partial_grad_begin(e, seg, bias, cols, s1);
        if (bias)
          layernorm_backward_weight(dt_, c.norm.x.data(), c.norm.mean.as<float>(), c.norm.rstd.as<float>(),
                                    c.dy_norm.data(), static_cast<int>(c.dy_norm.rows), static_cast<int>(cols), g0, g1,
                                    e.stream);
        else
          rmsnorm_backward_weight(dt_, c.norm.x.data(), c.norm.rstd.as<float>(), c.dy_norm.data(),
                                  static_cast<int>(c.dy_norm.rows), static_cast<int>(cols), g0, e.stream);
        partial_grad_end(e, seg, gw.grad(0), cols, s0);
        partial_grad_end(e, seg, bias, cols, s1);
        break;
      }
      case core::LayerKind::Attention: {
        const AttentionCache& k = c.attn;
        weight_grad(e, dt_, of(k.u), true, of(k.dq_lin), false, gw.grad(0));
        weight_grad(e, dt_, of(k.u), true, of(k.dk_lin), false, gw.grad(1));
        weight_grad(e, dt_, of(k.u), true, of(k.dv), false, gw.grad(2));
        weight_grad(e, dt_, of(k.o), true, of(k.dout), false, gw.grad(3));
        if (attn_shape_.qk_norm) {
          accumulate(DType::F32, gw.grad(4), k.dq_norm.data(), attn_shape_.head_dim, e.stream);
          accumulate(DType::F32, gw.grad(5), k.dk_norm.data(), attn_shape_.head_dim, e.stream);
        }
        if (attn_shape_.bias) {
          bias_grad(e, dt_, k.dq_lin, gw.grad(gw.at("bias_q")));
          bias_grad(e, dt_, k.dk_lin, gw.grad(gw.at("bias_k")));
          bias_grad(e, dt_, k.dv, gw.grad(gw.at("bias_v")));
          bias_grad(e, dt_, k.dout, gw.grad(gw.at("bias_o")));
        }
        break;
      }
      case core::LayerKind::Mlp:
        if (gw.has("wg")) {
          mlp_backward_weight(e, dt_, c.mlp, gw.grad(0), gw.grad(1), gw.grad(2));
        } else {
          weight_grad(e, dt_, of(c.mlp.h), true, of(c.mlp.dout), false, gw.grad(gw.at("wd")));
          weight_grad(e, dt_, of(c.mlp.u), true, of(c.mlp.da), false, gw.grad(gw.at("wu")));
          if (gw.has("bias_fc1")) bias_grad(e, dt_, c.mlp.da, gw.grad(gw.at("bias_fc1")));
          if (gw.has("bias_fc2")) bias_grad(e, dt_, c.mlp.dout, gw.grad(gw.at("bias_fc2")));
        }
        break;
      case core::LayerKind::MoeRouter: {
        Tensor s0;
        float* g0 = partial_grad_begin(e, seg, gw.grad(0), hidden() * experts(), s0);
        weight_grad(e, dt_, of(c.router.u), true, of(c.router.dlogits), false, g0);
        partial_grad_end(e, seg, gw.grad(0), hidden() * experts(), s0);
        break;
      }
      case core::LayerKind::MoeExperts:
        experts_backward_weight(e, seg, l, c.experts);
        break;
      case core::LayerKind::Head: {
        bool tied = false;
        float* table_grad = head_weights(seg, true, tied).grad(0);
        if (tied)  // the table [V, H] (the embedding's in this segment, or the head's copy) += dlogits^T u
          weight_grad(e, dt_, of(c.head.dlogits), true, of(c.head.u), false, table_grad);
        else
          weight_grad(e, dt_, of(c.head.u), true, of(c.head.dlogits), false, table_grad);
        break;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Routed experts (host experts_forward / experts_backward_input / experts_backward_weight)
// ---------------------------------------------------------------------------------------------
Tensor CudaModel::experts_forward(const Exec& e, int seg, int layer, int first_expert, const std::vector<int>& expert,
                                  const Tensor& rows, ExpertsCache& c) {
  Weights w = weights(seg, layer, false);
  const std::size_t local = w.tensors.size() / 3;
  std::vector<std::vector<int>> rows_of(local);
  for (std::size_t i = 0; i < expert.size(); ++i)
    rows_of.at(static_cast<std::size_t>(expert[i] - first_expert)).push_back(static_cast<int>(i));
  c.groups.clear();
  c.entries = rows.rows;
  Tensor y = new_tensor(e, rows.rows, hidden(), elem());
  for (std::size_t x = 0; x < local; ++x) {
    if (rows_of[x].empty()) continue;
    ExpertsCache::Group gr;
    gr.local = static_cast<int>(x);
    gr.index = upload_ints(e, rows_of[x]);
    const int n = static_cast<int>(rows_of[x].size());
    Tensor in = new_tensor(e, n, hidden(), elem());
    gather_slots(dt_, rows.data(), gr.index.as<int>(), 1, nullptr, n, static_cast<int>(hidden()), in.data(), e.stream);
    Tensor out = mlp_forward(e, dt_, w.mat(3 * x), w.mat(3 * x + 1), w.mat(3 * x + 2), in, gr.mlp);
    scatter_rows(dt_, out.data(), gr.index.as<int>(), n, static_cast<int>(hidden()), y.data(), e.stream);
    c.groups.push_back(std::move(gr));
  }
  return y;
}

Tensor CudaModel::experts_backward_input(const Exec& e, int seg, int layer, ExpertsCache& c, const Tensor& dy) {
  Weights w = weights(seg, layer, false);
  Tensor du = new_tensor(e, dy.rows, hidden(), elem());
  for (auto& gr : c.groups) {
    const int n = static_cast<int>(gr.index.rows);
    Tensor d = new_tensor(e, n, hidden(), elem());
    gather_slots(dt_, dy.data(), gr.index.as<int>(), 1, nullptr, n, static_cast<int>(hidden()), d.data(), e.stream);
    const auto x = static_cast<std::size_t>(gr.local);
    Tensor dx = mlp_backward_input(e, dt_, w.mat(3 * x), w.mat(3 * x + 1), w.mat(3 * x + 2), gr.mlp, d);
    scatter_rows(dt_, dx.data(), gr.index.as<int>(), n, static_cast<int>(hidden()), du.data(), e.stream);
  }
  return du;
}

// Experts without TP on a TP stage without SP see the same tokens on each of the t TP ranks (token
// copies), and the expert data-parallel reduction sums the t identical gradients: each adds 1/t of
// its gradient, as the host backend does (host_model_compute.cpp, backward_weight).
void CudaModel::experts_backward_weight(const Exec& e, int seg, int layer, ExpertsCache& c) {
  Weights gw = weights(seg, layer, true);
  const float alpha = 1.0f / static_cast<float>(std::max(1, layout(seg).token_copies));
  for (const auto& gr : c.groups) {
    const auto x = static_cast<std::size_t>(gr.local);
    mlp_backward_weight(e, dt_, gr.mlp, gw.grad(3 * x), gw.grad(3 * x + 1), gw.grad(3 * x + 2), alpha);
  }
}

// ---------------------------------------------------------------------------------------------
// Expert parallelism (host route / dispatch / combine)
// ---------------------------------------------------------------------------------------------
ExpertSource CudaModel::route(const Exec& e, const ForwardState& s, int group_size) const {
  if (s.topk.empty()) throw std::logic_error("runtime: experts reached without a router output");
  ExpertSource src;
  src.topk = s.topk;
  src.gates = s.gates;
  src.tokens = s.topk.rows;
  src.k = static_cast<int>(s.topk.cols);
  src.topk_host = download_ints(e, s.topk);
  src.slots_to.assign(static_cast<std::size_t>(group_size), {});
  const int per_rank = experts() / group_size;
  for (std::size_t slot = 0; slot < src.topk_host.size(); ++slot)
    src.slots_to[static_cast<std::size_t>(src.topk_host[slot] / per_rank)].push_back(static_cast<int>(slot));
  for (const auto& slots : src.slots_to) src.slot_index.push_back(upload_ints(e, slots));
  src.y = zeros(e, src.tokens * src.k, hidden(), elem());
  return src;
}

std::vector<ExpertPacket> CudaModel::dispatch_forward(const Exec& e, const ForwardState& s,
                                                      const ExpertSource& src) const {
  std::vector<ExpertPacket> out(src.slots_to.size());
  for (std::size_t p = 0; p < out.size(); ++p) {
    const auto& slots = src.slots_to[p];
    const int n = static_cast<int>(slots.size());
    for (int slot : slots) out[p].expert.push_back(src.topk_host[static_cast<std::size_t>(slot)]);
    out[p].rows = new_tensor(e, n, s.u.cols, elem());
    gather_slots(dt_, s.u.data(), src.slot_index[p].as<int>(), src.k, nullptr, n, static_cast<int>(s.u.cols),
                 out[p].rows.data(), e.stream);
  }
  return out;
}

void CudaModel::experts_forward_entries(const Exec& e, int seg, const std::vector<ExpertPacket>& from,
                                        SegmentStash& stash, std::vector<ExpertPacket>* to_sources) {
  host::SegmentParams& sp = layout_.segment(seg);
  stash.layers.assign(1, LayerCache{});
  LayerCache& c = stash.layers[0];
  std::vector<int> experts_of;
  std::int64_t n = 0;
  for (const auto& p : from) n += p.rows.rows;
  Tensor rows = new_tensor(e, n, hidden(), elem());
  std::int64_t at = 0;
  for (const auto& p : from) {
    if (p.rows.bytes())
      check(cudaMemcpyAsync(static_cast<char*>(rows.data()) + static_cast<std::size_t>(at * hidden()) * elem(),
                            p.rows.data(), p.rows.bytes(), cudaMemcpyDeviceToDevice, e.stream),
            "cudaMemcpyAsync");
    at += p.rows.rows;
    experts_of.insert(experts_of.end(), p.expert.begin(), p.expert.end());
    c.source_counts.push_back(static_cast<int>(p.rows.rows));
  }
  const int first = sp.shard_index * experts() / sp.shard_degree;
  Tensor y = routed_experts_forward(e, seg, sp.first_layer, first, experts_of, rows, c.experts);
  to_sources->assign(c.source_counts.size(), ExpertPacket{});
  at = 0;
  for (std::size_t p = 0; p < c.source_counts.size(); ++p) {
    (*to_sources)[p].rows = y.row_range(at, c.source_counts[p]);
    at += c.source_counts[p];
  }
}

void CudaModel::combine_forward(const Exec& e, ForwardState& s, ExpertSource& src,
                                const std::vector<ExpertPacket>& from_owners) const {
  for (std::size_t p = 0; p < from_owners.size(); ++p) {
    const auto& slots = src.slots_to[p];
    if (static_cast<std::int64_t>(slots.size()) != from_owners[p].rows.rows)
      throw std::runtime_error(fmt::format("runtime: expert combine got {} rows from rank {}, expected {}",
                                           from_owners[p].rows.rows, p, slots.size()));
    scatter_rows(dt_, from_owners[p].rows.data(), src.slot_index[p].as<int>(), static_cast<int>(slots.size()),
                 static_cast<int>(hidden()), src.y.data(), e.stream);
  }
  Tensor x = new_tensor(e, s.x.rows, s.x.cols, elem());
  moe_combine(dt_, s.x.data(), src.y.data(), src.gates.as<float>(), static_cast<int>(src.tokens), src.k,
              static_cast<int>(hidden()), x.data(), e.stream);
  s.x = x;
  s.topk = Tensor{};
  s.gates = Tensor{};
}

// x += sum_j g_j y_j:  dy_j = g_j dx,  dg_j = dx . y_j.
std::vector<ExpertPacket> CudaModel::dispatch_backward(const Exec& e, BackwardState& g, const ExpertSource& src) const {
  g.dgates = new_tensor(e, src.tokens, src.k, 4);
  moe_gate_grad(dt_, g.dx.data(), src.y.data(), static_cast<int>(src.tokens), src.k, static_cast<int>(hidden()),
                g.dgates.as<float>(), e.stream);
  std::vector<ExpertPacket> out(src.slots_to.size());
  for (std::size_t p = 0; p < out.size(); ++p) {
    const int n = static_cast<int>(src.slots_to[p].size());
    out[p].rows = new_tensor(e, n, hidden(), elem());
    gather_slots(dt_, g.dx.data(), src.slot_index[p].as<int>(), src.k, src.gates.as<float>(), n,
                 static_cast<int>(hidden()), out[p].rows.data(), e.stream);
  }
  return out;
}

void CudaModel::experts_backward_entries(const Exec& e, int seg, const std::vector<ExpertPacket>& from,
                                         SegmentStash& stash, std::vector<ExpertPacket>* to_sources) {
  host::SegmentParams& sp = layout_.segment(seg);
  LayerCache& c = stash.layers.at(0);
  std::int64_t n = 0;
  for (const auto& p : from) n += p.rows.rows;
  Tensor dy = new_tensor(e, n, hidden(), elem());
  std::int64_t at = 0;
  for (const auto& p : from) {
    if (p.rows.bytes())
      check(cudaMemcpyAsync(static_cast<char*>(dy.data()) + static_cast<std::size_t>(at * hidden()) * elem(),
                            p.rows.data(), p.rows.bytes(), cudaMemcpyDeviceToDevice, e.stream),
            "cudaMemcpyAsync");
    at += p.rows.rows;
  }
  Tensor du = routed_experts_backward_input(e, seg, sp.first_layer, c.experts, dy);
  to_sources->assign(c.source_counts.size(), ExpertPacket{});
  at = 0;
  for (std::size_t p = 0; p < c.source_counts.size(); ++p) {
    (*to_sources)[p].rows = du.row_range(at, c.source_counts[p]);
    at += c.source_counts[p];
  }
}

void CudaModel::combine_backward(const Exec& e, BackwardState& g, const ExpertSource& src,
                                 const std::vector<ExpertPacket>& from_owners) const {
  if (g.du.empty()) g.du = zeros(e, g.dx.rows, g.dx.cols, elem());
  Tensor slots = zeros(e, src.tokens * src.k, hidden(), elem());
  for (std::size_t p = 0; p < from_owners.size(); ++p) {
    const auto& sl = src.slots_to[p];
    if (static_cast<std::int64_t>(sl.size()) != from_owners[p].rows.rows)
      throw std::runtime_error("runtime: expert backward combine got a wrong row count from rank " + std::to_string(p));
    scatter_rows(dt_, from_owners[p].rows.data(), src.slot_index[p].as<int>(), static_cast<int>(sl.size()),
                 static_cast<int>(hidden()), slots.data(), e.stream);
  }
  Tensor du = new_tensor(e, g.du.rows, g.du.cols, elem());
  moe_sum_slots(dt_, g.du.data(), slots.data(), static_cast<int>(src.tokens), src.k, static_cast<int>(hidden()),
                du.data(), e.stream);
  g.du = du;
}

}  // namespace piper::runtime::cuda
