// Host (Eigen, fp32) kernels: forward, backward-input and backward-weight of each layer, and AdamW.
#include "piper/runtime/kernels.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <numeric>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace piper::runtime::host {

// ---------------------------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------------------------
Mat embedding_forward(const ConstMatMap& table, const std::vector<int>& tokens, int first_row) {
  Mat x = Mat::Zero(static_cast<Eigen::Index>(tokens.size()), table.cols());
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const int row = tokens[t] - first_row;
    if (row >= 0 && row < table.rows()) x.row(static_cast<Eigen::Index>(t)) = table.row(row);
  }
  return x;
}

void embedding_backward_weight(const std::vector<int>& tokens, const Mat& dx, MatMap dtable, int first_row) {
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    const int row = tokens[t] - first_row;
    if (row >= 0 && row < dtable.rows()) dtable.row(row) += dx.row(static_cast<Eigen::Index>(t));
  }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (Zhang & Sennrich 2019)
// ---------------------------------------------------------------------------------------------
Mat rmsnorm_forward(const Mat& x, const ConstVecMap& g, RmsNormCache* c) {
  const float inv_h = 1.0f / static_cast<float>(x.cols());
  Vec rstd = ((x.array().square().rowwise().sum() * inv_h) + kNormEps).rsqrt().matrix();
  Mat y = (x.array().colwise() * rstd.array()).rowwise() * g.transpose().array();
  if (c) c->x = x, c->rstd = std::move(rstd);
  return y;
}

// dy/dx of y_j = g_j x_j r with r = (mean x^2 + eps)^-1/2:  dx = r g*dy - r^3 x (sum_k g_k dy_k x_k) / H.
Mat rmsnorm_backward_input(const RmsNormCache& c, const ConstVecMap& g, const Mat& dy) {
  const float inv_h = 1.0f / static_cast<float>(c.x.cols());
  Mat gdy = dy.array().rowwise() * g.transpose().array();
  Vec dot = (gdy.array() * c.x.array()).rowwise().sum().matrix();
  Vec coef = (c.rstd.array().cube() * dot.array() * inv_h).matrix();
  return (gdy.array().colwise() * c.rstd.array() - c.x.array().colwise() * coef.array()).matrix();
}

void rmsnorm_backward_weight(const RmsNormCache& c, const Mat& dy, VecMap dg) {
  dg += ((dy.array() * c.x.array()).colwise() * c.rstd.array()).colwise().sum().transpose().matrix();
}

// ---------------------------------------------------------------------------------------------
// LayerNorm (Ba et al. 2016)
// ---------------------------------------------------------------------------------------------
Mat layernorm_forward(const Mat& x, const ConstVecMap& g, const ConstVecMap& b, LayerNormCache* c) {
  const float inv_h = 1.0f / static_cast<float>(x.cols());
  Vec mean = x.rowwise().sum() * inv_h;
  Mat xc = x.colwise() - mean;
  Vec rstd = ((xc.array().square().rowwise().sum() * inv_h) + kLayerNormEps).rsqrt().matrix();
  Mat xhat = xc.array().colwise() * rstd.array();
  Mat y = (xhat.array().rowwise() * g.transpose().array()).rowwise() + b.transpose().array();
  if (c) c->xhat = std::move(xhat), c->rstd = std::move(rstd);
  return y;
}

// With z = g * dy (the gradient at xhat), the mean and the variance both depend on every x_k:
// dx = r (z - mean(z) - xhat mean(z * xhat)).
Mat layernorm_backward_input(const LayerNormCache& c, const ConstVecMap& g, const Mat& dy) {
  const float inv_h = 1.0f / static_cast<float>(c.xhat.cols());
  Mat z = dy.array().rowwise() * g.transpose().array();
  Vec mz = z.rowwise().sum() * inv_h;
  Vec mzx = (z.array() * c.xhat.array()).rowwise().sum().matrix() * inv_h;
  Mat inner = (z.colwise() - mz).array() - c.xhat.array().colwise() * mzx.array();
  return inner.array().colwise() * c.rstd.array();
}

void layernorm_backward_weight(const LayerNormCache& c, const Mat& dy, VecMap dg, VecMap db) {
  dg += (dy.array() * c.xhat.array()).colwise().sum().transpose().matrix();
  db += dy.colwise().sum().transpose();
}

// ---------------------------------------------------------------------------------------------
// Bias, GELU, learned positions
// ---------------------------------------------------------------------------------------------
void bias_add(Mat& x, const ConstVecMap& b) { x.rowwise() += b.transpose(); }

void bias_backward_weight(const Mat& dy, VecMap db) { db += dy.colwise().sum().transpose(); }

namespace {
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;
}  // namespace

// gelu(a) = a/2 (1 + tanh(c (a + k a^3)))
Mat gelu_forward(const Mat& a) {
  return a.unaryExpr([](float x) { return 0.5f * x * (1.0f + std::tanh(kGeluC * (x + kGeluA * x * x * x))); });
}

// gelu'(a) = (1 + t)/2 + a/2 (1 - t^2) c (1 + 3 k a^2), t = tanh(c (a + k a^3))
Mat gelu_backward(const Mat& a, const Mat& dy) {
  Mat d = a.unaryExpr([](float x) {
    const float t = std::tanh(kGeluC * (x + kGeluA * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluC * (1.0f + 3.0f * kGeluA * x * x);
  });
  return d.cwiseProduct(dy);
}

void positions_forward(Mat& x, const ConstMatMap& pos, int seq_len, int first_position) {
  for (Eigen::Index t = 0; t < x.rows(); ++t) x.row(t) += pos.row((first_position + t) % seq_len);
}

void positions_backward_weight(const Mat& dx, MatMap dpos, int seq_len, int first_position) {
  for (Eigen::Index t = 0; t < dx.rows(); ++t) dpos.row((first_position + t) % seq_len) += dx.row(t);
}

// ---------------------------------------------------------------------------------------------
// Attention
// ---------------------------------------------------------------------------------------------
namespace {

// RoPE (Su et al. 2021), rotate-half layout as in Hugging Face Llama/Qwen: pairs (i, i + hd/2) of
// each head rotate by pos * theta^(-2i/hd). `sign` = -1 applies the inverse rotation (backward).
void rope_inplace(Mat& m, int heads, int head_dim, const std::vector<int>& positions, float theta, float sign) {
  const int half = head_dim / 2;
  for (Eigen::Index t = 0; t < m.rows(); ++t) {
    const float pos = static_cast<float>(positions[static_cast<std::size_t>(t)]);
    for (int i = 0; i < half; ++i) {
      const float angle = pos * std::pow(theta, -2.0f * static_cast<float>(i) / static_cast<float>(head_dim));
      const float cs = std::cos(angle), sn = sign * std::sin(angle);
      for (int h = 0; h < heads; ++h) {
        float& a = m(t, h * head_dim + i);
        float& b = m(t, h * head_dim + i + half);
        const float a0 = a, b0 = b;
        a = a0 * cs - b0 * sn;
        b = b0 * cs + a0 * sn;
      }
    }
  }
}

// Per-head RMSNorm of a [T, heads*hd] projection with weight w [hd]; writes the factors to rstd [T, heads].
Mat head_norm_forward(const Mat& lin, int heads, int hd, const ConstVecMap& w, Mat& rstd) {
  Mat out(lin.rows(), lin.cols());
  rstd.resize(lin.rows(), heads);
  for (int h = 0; h < heads; ++h) {
    RmsNormCache c;
    Mat block = lin.middleCols(h * hd, hd);
    out.middleCols(h * hd, hd) = rmsnorm_forward(block, w, &c);
    rstd.col(h) = c.rstd;
  }
  return out;
}

Mat head_norm_backward(const Mat& lin, int heads, int hd, const ConstVecMap& w, const Mat& rstd, const Mat& dy,
                       Vec& dw) {
  Mat dx(lin.rows(), lin.cols());
  dw = Vec::Zero(hd);
  for (int h = 0; h < heads; ++h) {
    RmsNormCache c{lin.middleCols(h * hd, hd), rstd.col(h)};
    Mat dyh = dy.middleCols(h * hd, hd);
    dx.middleCols(h * hd, hd) = rmsnorm_backward_input(c, w, dyh);
    rmsnorm_backward_weight(c, dyh, VecMap(dw.data(), hd));
  }
  return dx;
}

// The position in its sequence of each of `rows` local rows (context parallelism: AttentionCp's chunks).
std::vector<int> row_positions(const AttentionShape& s, Eigen::Index rows) {
  std::vector<int> out(static_cast<std::size_t>(rows));
  for (Eigen::Index t = 0; t < rows; ++t) {
    const int i = static_cast<int>(t % s.seq_len);
    out[static_cast<std::size_t>(t)] = s.context_parallel() ? s.cp->position(s.cp->rank, i, s.seq_len) : i;
  }
  return out;
}

// Context parallelism: this rank's L local queries of each sequence against the cp·L keys of every
// rank (k_all, v_all: rank r's rows r·T ..), masked by global position (key position <= query
// position). probs[b·heads + h] is [L, cp·L].
void cp_keys(const AttentionShape& s, const Mat& all, Eigen::Index T, Eigen::Index b, int col, Mat& out) {
  const int L = s.seq_len, hd = s.head_dim;
  out.resize(static_cast<Eigen::Index>(s.cp->cp) * L, hd);
  for (int r = 0; r < s.cp->cp; ++r)
    out.middleRows(static_cast<Eigen::Index>(r) * L, L) = all.block(r * T + b * L, col, L, hd);
}

void cp_core_forward(const AttentionShape& s, AttentionCache& k) {
  const int hd = s.head_dim, group = s.heads / s.kv_heads, L = s.seq_len, cp = s.cp->cp;
  const Eigen::Index T = k.q.rows(), seqs = T / L;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<int> qpos(static_cast<std::size_t>(L)), kpos(static_cast<std::size_t>(cp) * L);
  for (int i = 0; i < L; ++i) qpos[static_cast<std::size_t>(i)] = s.cp->position(s.cp->rank, i, L);
  for (int r = 0; r < cp; ++r)
    for (int i = 0; i < L; ++i) kpos[static_cast<std::size_t>(r * L + i)] = s.cp->position(r, i, L);
  k.o.setZero(T, static_cast<Eigen::Index>(s.heads) * hd);
  k.probs.assign(static_cast<std::size_t>(seqs * s.heads), Mat());
  Mat kb, vb;
  for (Eigen::Index b = 0; b < seqs; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const int g = h / group;
      cp_keys(s, k.k_all, T, b, g * hd, kb);
      cp_keys(s, k.v_all, T, b, g * hd, vb);
      Mat scores = (k.q.block(b * L, h * hd, L, hd) * kb.transpose()) * scale;
      for (int i = 0; i < L; ++i) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int j = 0; j < cp * L; ++j)
          if (kpos[static_cast<std::size_t>(j)] <= qpos[static_cast<std::size_t>(i)]) mx = std::max(mx, scores(i, j));
        float sum = 0;
        for (int j = 0; j < cp * L; ++j) {
          const bool seen = kpos[static_cast<std::size_t>(j)] <= qpos[static_cast<std::size_t>(i)];
          scores(i, j) = seen ? std::exp(scores(i, j) - mx) : 0.0f;
          sum += scores(i, j);
        }
        scores.row(i) /= sum;
      }
      k.o.block(b * L, h * hd, L, hd) = scores * vb;
      k.probs[static_cast<std::size_t>(b * s.heads + h)] = std::move(scores);
    }
}

}  // namespace

void attention_core_forward(const AttentionShape& s, AttentionCache& k) {
  if (s.context_parallel()) return cp_core_forward(s, k);
  const int hd = s.head_dim, group = s.heads / s.kv_heads, L = s.seq_len;
  const Eigen::Index T = k.q.rows();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const Eigen::Index seqs = T / L;
  k.o.setZero(T, static_cast<Eigen::Index>(s.heads) * hd);
  k.probs.assign(static_cast<std::size_t>(seqs * s.heads), Mat());
  for (Eigen::Index b = 0; b < seqs; ++b)
    for (int h = 0; h < s.heads; ++h) {
      const int g = h / group;
      Mat scores = (k.q.block(b * L, h * hd, L, hd) * k.k.block(b * L, g * hd, L, hd).transpose()) * scale;
      for (int i = 0; i < L; ++i) {  // causal softmax over j <= i
        float mx = scores.row(i).head(i + 1).maxCoeff();
        scores.row(i).head(i + 1) = (scores.row(i).head(i + 1).array() - mx).exp().matrix();
        scores.row(i).head(i + 1) /= scores.row(i).head(i + 1).sum();
        scores.row(i).tail(L - i - 1).setZero();
      }
      k.o.block(b * L, h * hd, L, hd) = scores * k.v.block(b * L, g * hd, L, hd);
      k.probs[static_cast<std::size_t>(b * s.heads + h)] = std::move(scores);
    }
}

void attention_drop_core(AttentionCache& c) {
  c.probs.clear();
  c.probs.shrink_to_fit();
  c.o = Mat();
}

Mat attention_forward(const AttentionShape& s, const AttentionWeights& w, const Mat& u, AttentionCache* c) {
  const int hd = s.head_dim;
  AttentionCache local;
  AttentionCache& k = c ? *c : local;
  k.u = u;
  k.q_lin = u * w.wq;
  k.k_lin = u * w.wk;
  k.v = u * w.wv;
  if (s.bias) bias_add(k.q_lin, w.bq), bias_add(k.k_lin, w.bk), bias_add(k.v, w.bv);
  if (s.qk_norm) {
    k.q = head_norm_forward(k.q_lin, s.heads, hd, w.q_norm, k.q_rstd);
    k.k = head_norm_forward(k.k_lin, s.kv_heads, hd, w.k_norm, k.k_rstd);
  } else {
    k.q = k.q_lin;
    k.k = k.k_lin;
  }
  if (s.rope) {
    const std::vector<int> pos = row_positions(s, u.rows());
    rope_inplace(k.q, s.heads, hd, pos, s.rope_theta, 1.0f);
    rope_inplace(k.k, s.kv_heads, hd, pos, s.rope_theta, 1.0f);
  }
  if (s.context_parallel()) {  // K and V of the whole sequence (ring attention's blocks, all at once)
    k.k_all = s.cp->gather(k.k);
    k.v_all = s.cp->gather(k.v);
  }
  attention_core_forward(s, k);
  return k.o * w.wo;
}

Mat attention_backward_input(const AttentionShape& s, const AttentionWeights& w, AttentionCache& c, const Mat& dout) {
  const int hd = s.head_dim, group = s.heads / s.kv_heads, L = s.seq_len;
  const Eigen::Index T = c.u.rows(), seqs = T / L;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  if (c.probs.empty()) attention_core_forward(s, c);  // selective recomputation: the core was not kept
  c.dout = dout;
  Mat d_o = dout * w.wo.transpose();
  Mat dq = Mat::Zero(T, c.q.cols()), dk = Mat::Zero(T, c.k.cols());
  c.dv = Mat::Zero(T, c.v.cols());
  if (s.context_parallel()) {
    // dK and dV of every rank's keys, summed back to their owners (ring attention's returning dK/dV).
    const int cp = s.cp->cp;
    Mat dk_all = Mat::Zero(cp * T, c.k.cols()), dv_all = Mat::Zero(cp * T, c.v.cols());
    Mat kb, vb;
    for (Eigen::Index b = 0; b < seqs; ++b)
      for (int h = 0; h < s.heads; ++h) {
        const int g = h / group;
        cp_keys(s, c.k_all, T, b, g * hd, kb);
        cp_keys(s, c.v_all, T, b, g * hd, vb);
        const Mat& p = c.probs[static_cast<std::size_t>(b * s.heads + h)];
        Mat doh = d_o.block(b * L, h * hd, L, hd);
        Mat dp = doh * vb.transpose();
        Mat dvb = p.transpose() * doh;
        Vec rowdot = (dp.array() * p.array()).rowwise().sum().matrix();
        Mat ds = (p.array() * (dp.array().colwise() - rowdot.array())).matrix() * scale;
        dq.block(b * L, h * hd, L, hd) += ds * kb;
        Mat dkb = ds.transpose() * c.q.block(b * L, h * hd, L, hd);
        for (int r = 0; r < cp; ++r) {
          dk_all.block(r * T + b * L, g * hd, L, hd) += dkb.middleRows(static_cast<Eigen::Index>(r) * L, L);
          dv_all.block(r * T + b * L, g * hd, L, hd) += dvb.middleRows(static_cast<Eigen::Index>(r) * L, L);
        }
      }
    dk = s.cp->scatter_sum(dk_all);
    c.dv = s.cp->scatter_sum(dv_all);
  }
  for (Eigen::Index b = 0; b < seqs && !s.context_parallel(); ++b)
    for (int h = 0; h < s.heads; ++h) {
      const int g = h / group;
      const Mat& p = c.probs[static_cast<std::size_t>(b * s.heads + h)];
      Mat doh = d_o.block(b * L, h * hd, L, hd);
      Mat dp = doh * c.v.block(b * L, g * hd, L, hd).transpose();
      c.dv.block(b * L, g * hd, L, hd) += p.transpose() * doh;
      // softmax backward: dS = P * (dP - rowsum(dP * P)); masked entries have P = 0.
      Vec rowdot = (dp.array() * p.array()).rowwise().sum().matrix();
      Mat ds = (p.array() * (dp.array().colwise() - rowdot.array())).matrix() * scale;
      dq.block(b * L, h * hd, L, hd) += ds * c.k.block(b * L, g * hd, L, hd);
      dk.block(b * L, g * hd, L, hd) += ds.transpose() * c.q.block(b * L, h * hd, L, hd);
    }
  if (s.rope) {
    const std::vector<int> pos = row_positions(s, T);
    rope_inplace(dq, s.heads, hd, pos, s.rope_theta, -1.0f);
    rope_inplace(dk, s.kv_heads, hd, pos, s.rope_theta, -1.0f);
  }
  if (s.qk_norm) {
    c.dq_lin = head_norm_backward(c.q_lin, s.heads, hd, w.q_norm, c.q_rstd, dq, c.dq_norm);
    c.dk_lin = head_norm_backward(c.k_lin, s.kv_heads, hd, w.k_norm, c.k_rstd, dk, c.dk_norm);
  } else {
    c.dq_lin = std::move(dq);
    c.dk_lin = std::move(dk);
  }
  return c.dq_lin * w.wq.transpose() + c.dk_lin * w.wk.transpose() + c.dv * w.wv.transpose();
}

void attention_backward_weight(const AttentionShape& s, const AttentionCache& c, AttentionGrads& g) {
  g.wq += c.u.transpose() * c.dq_lin;
  g.wk += c.u.transpose() * c.dk_lin;
  g.wv += c.u.transpose() * c.dv;
  g.wo += c.o.transpose() * c.dout;
  if (s.qk_norm) {
    g.q_norm += c.dq_norm;
    g.k_norm += c.dk_norm;
  }
  if (s.bias) {
    bias_backward_weight(c.dq_lin, g.bq);
    bias_backward_weight(c.dk_lin, g.bk);
    bias_backward_weight(c.dv, g.bv);
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU MLP (Shazeer 2020)
// ---------------------------------------------------------------------------------------------
namespace {
float sigmoid(float a) { return 1.0f / (1.0f + std::exp(-a)); }
}  // namespace

Mat mlp_forward(const MlpWeights& w, const Mat& u, MlpCache* c) {
  MlpCache local;
  MlpCache& k = c ? *c : local;
  k.u = u;
  k.a = u * w.wg;
  k.b = u * w.wu;
  k.h = k.a.unaryExpr([](float a) { return a * sigmoid(a); }).cwiseProduct(k.b);
  return k.h * w.wd;
}

Mat mlp_backward_input(const MlpWeights& w, MlpCache& c, const Mat& dout) {
  c.dout = dout;
  Mat dh = dout * w.wd.transpose();
  // silu'(a) = s(a) (1 + a (1 - s(a)))
  Mat dsilu = c.a.unaryExpr([](float a) {
    float s = sigmoid(a);
    return s * (1.0f + a * (1.0f - s));
  });
  Mat silu = c.a.unaryExpr([](float a) { return a * sigmoid(a); });
  c.da = dh.cwiseProduct(c.b).cwiseProduct(dsilu);
  c.db = dh.cwiseProduct(silu);
  return c.da * w.wg.transpose() + c.db * w.wu.transpose();
}

void mlp_backward_weight(const MlpCache& c, MlpGrads& g) {
  g.wd += c.h.transpose() * c.dout;
  g.wg += c.u.transpose() * c.da;
  g.wu += c.u.transpose() * c.db;
}

// ---------------------------------------------------------------------------------------------
// GELU MLP (GPT-2 / Megatron GPT)
// ---------------------------------------------------------------------------------------------
Mat gelu_mlp_forward(const GeluMlpWeights& w, const Mat& u, GeluMlpCache* c) {
  GeluMlpCache local;
  GeluMlpCache& k = c ? *c : local;
  k.u = u;
  k.a = u * w.w1;
  if (w.b1.size() > 0) bias_add(k.a, w.b1);
  k.h = gelu_forward(k.a);
  return k.h * w.w2;
}

Mat gelu_mlp_backward_input(const GeluMlpWeights& w, GeluMlpCache& c, const Mat& dout) {
  c.dout = dout;
  c.da = gelu_backward(c.a, dout * w.w2.transpose());
  return c.da * w.w1.transpose();
}

void gelu_mlp_backward_weight(const GeluMlpCache& c, GeluMlpGrads& g) {
  g.w2 += c.h.transpose() * c.dout;
  g.w1 += c.u.transpose() * c.da;
  if (g.b1.size() > 0) bias_backward_weight(c.da, g.b1);
}

// ---------------------------------------------------------------------------------------------
// MoE router and experts
// ---------------------------------------------------------------------------------------------
void router_forward(const ConstMatMap& wr, int top_k, const Mat& u, RouterCache* c, Eigen::MatrixXi* topk, Mat* gates) {
  Mat logits = u * wr;
  const Eigen::Index T = u.rows(), E = wr.cols();
  topk->resize(T, top_k);
  gates->resize(T, top_k);
  std::vector<int> order(static_cast<std::size_t>(E));
  for (Eigen::Index t = 0; t < T; ++t) {
    std::iota(order.begin(), order.end(), 0);
    // Ties go to the lower expert id, so every rank and the reference pick the same experts.
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int a, int b) {
      return logits(t, a) > logits(t, b) || (logits(t, a) == logits(t, b) && a < b);
    });
    float mx = logits(t, order[0]), sum = 0;
    for (int j = 0; j < top_k; ++j) sum += std::exp(logits(t, order[static_cast<std::size_t>(j)]) - mx);
    for (int j = 0; j < top_k; ++j) {
      (*topk)(t, j) = order[static_cast<std::size_t>(j)];
      (*gates)(t, j) = std::exp(logits(t, order[static_cast<std::size_t>(j)]) - mx) / sum;
    }
  }
  if (c) c->u = u, c->topk = *topk, c->gates = *gates;
}

// gates = softmax over the selected logits: dl_j = g_j (dg_j - sum_i g_i dg_i); unselected get 0.
Mat router_backward_input(const ConstMatMap& wr, RouterCache& c, const Mat& dgates) {
  const Eigen::Index T = c.u.rows(), k = c.topk.cols();
  c.dlogits = Mat::Zero(T, wr.cols());
  for (Eigen::Index t = 0; t < T; ++t) {
    float dot = c.gates.row(t).dot(dgates.row(t));
    for (Eigen::Index j = 0; j < k; ++j) c.dlogits(t, c.topk(t, j)) = c.gates(t, j) * (dgates(t, j) - dot);
  }
  return c.dlogits * wr.transpose();
}

void router_backward_weight(const RouterCache& c, MatMap dwr) { dwr += c.u.transpose() * c.dlogits; }

Mat experts_forward(const std::vector<MlpWeights>& experts, int first_expert, const std::vector<int>& expert,
                    const Mat& rows, ExpertsCache* c) {
  ExpertsCache local;
  ExpertsCache& k = c ? *c : local;
  k.expert = expert;
  k.rows_of.assign(experts.size(), {});
  for (std::size_t i = 0; i < expert.size(); ++i)
    k.rows_of.at(static_cast<std::size_t>(expert[i] - first_expert)).push_back(static_cast<int>(i));
  k.per_expert.assign(experts.size(), MlpCache{});
  Mat y(rows.rows(), rows.cols());
  for (std::size_t e = 0; e < experts.size(); ++e) {
    const auto& idx = k.rows_of[e];
    if (idx.empty()) continue;
    Mat in(static_cast<Eigen::Index>(idx.size()), rows.cols());
    for (std::size_t i = 0; i < idx.size(); ++i) in.row(static_cast<Eigen::Index>(i)) = rows.row(idx[i]);
    Mat out = mlp_forward(experts[e], in, &k.per_expert[e]);
    for (std::size_t i = 0; i < idx.size(); ++i) y.row(idx[i]) = out.row(static_cast<Eigen::Index>(i));
  }
  return y;
}

Mat experts_backward_input(const std::vector<MlpWeights>& experts, ExpertsCache& c, const Mat& dy) {
  Mat du(dy.rows(), dy.cols());
  for (std::size_t e = 0; e < experts.size(); ++e) {
    const auto& idx = c.rows_of[e];
    if (idx.empty()) continue;
    Mat d(static_cast<Eigen::Index>(idx.size()), dy.cols());
    for (std::size_t i = 0; i < idx.size(); ++i) d.row(static_cast<Eigen::Index>(i)) = dy.row(idx[i]);
    Mat dx = mlp_backward_input(experts[e], c.per_expert[e], d);
    for (std::size_t i = 0; i < idx.size(); ++i) du.row(idx[i]) = dx.row(static_cast<Eigen::Index>(i));
  }
  return du;
}

void experts_backward_weight(ExpertsCache& c, std::vector<MlpGrads>& g) {
  for (std::size_t e = 0; e < g.size(); ++e)
    if (!c.rows_of[e].empty()) mlp_backward_weight(c.per_expert[e], g[e]);
}

// ---------------------------------------------------------------------------------------------
// LM head + cross-entropy
// ---------------------------------------------------------------------------------------------
double head_forward(const ConstMatMap& wh, const Mat& u, const std::vector<int>& targets, float loss_scale,
                    HeadCache* c) {
  Mat logits = u * wh;
  double loss_sum = 0;
  for (Eigen::Index t = 0; t < logits.rows(); ++t) {
    const float mx = logits.row(t).maxCoeff();
    logits.row(t) = (logits.row(t).array() - mx).exp().matrix();
    const float sum = logits.row(t).sum();
    const int y = targets[static_cast<std::size_t>(t)];
    loss_sum += std::log(static_cast<double>(sum)) - std::log(static_cast<double>(logits(t, y)));
    logits.row(t) /= sum;  // now softmax
    logits(t, y) -= 1.0f;
  }
  if (c) c->u = u, c->dlogits = logits * loss_scale;
  return loss_sum;
}

Mat head_backward_input(const ConstMatMap& wh, const HeadCache& c) { return c.dlogits * wh.transpose(); }

void head_backward_weight(const HeadCache& c, MatMap dwh) { dwh += c.u.transpose() * c.dlogits; }

double tied_head_forward(const ConstMatMap& table, const Mat& u, const std::vector<int>& targets, float loss_scale,
                         HeadCache* c) {
  const Mat wh = table.transpose();
  return head_forward(ConstMatMap(wh.data(), wh.rows(), wh.cols()), u, targets, loss_scale, c);
}

Mat tied_head_backward_input(const ConstMatMap& table, const HeadCache& c) { return c.dlogits * table; }

void tied_head_backward_weight(const HeadCache& c, MatMap dtable) { dtable += c.dlogits.transpose() * c.u; }

// ---------------------------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------------------------
float AdamWConfig::lr_at(int step) const {
  if (warmup_steps > 0 && step <= warmup_steps)
    return static_cast<float>(static_cast<double>(lr) * step / warmup_steps);  // the last one is lr exactly
  if (decay == LrDecay::Constant) return lr;
  if (step >= decay_steps) return min_lr;
  const double ratio =
      static_cast<double>(step - warmup_steps) / static_cast<double>(std::max(1, decay_steps - warmup_steps));
  const double coeff = decay == LrDecay::Cosine ? 0.5 * (std::cos(std::numbers::pi * ratio) + 1.0) : 1.0 - ratio;
  return static_cast<float>(min_lr + coeff * (static_cast<double>(lr) - min_lr));
}

void check_adamw(const AdamWConfig& cfg) {
  auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  if (!(cfg.lr >= 0)) fail(fmt::format("--lr must be >= 0 (got {})", cfg.lr));
  if (!(cfg.min_lr >= 0 && cfg.min_lr <= cfg.lr))
    fail(fmt::format("--min-lr must be between 0 and --lr {} (got {})", cfg.lr, cfg.min_lr));
  if (!(cfg.beta1 >= 0 && cfg.beta1 < 1)) fail(fmt::format("--beta1 must be in [0, 1) (got {})", cfg.beta1));
  if (!(cfg.beta2 >= 0 && cfg.beta2 < 1)) fail(fmt::format("--beta2 must be in [0, 1) (got {})", cfg.beta2));
  if (!(cfg.weight_decay >= 0)) fail(fmt::format("--weight-decay must be >= 0 (got {})", cfg.weight_decay));
  if (cfg.warmup_steps < 0) fail(fmt::format("--warmup-steps must be >= 0 (got {})", cfg.warmup_steps));
  if (cfg.decay != LrDecay::Constant && cfg.decay_steps <= cfg.warmup_steps)
    fail(fmt::format("--lr-decay {}: --lr-decay-steps {} must exceed --warmup-steps {} (the decay runs between them)",
                     lr_decay_name(cfg.decay), cfg.decay_steps, cfg.warmup_steps));
}

LossScaleState initial_loss_scale(const LossScaling& cfg) {
  return LossScaleState{cfg.mode == LossScaleMode::None ? 1.0 : cfg.initial, 0};
}

LossScaleState next_loss_scale(const LossScaling& cfg, LossScaleState s, bool overflow) {
  if (cfg.mode != LossScaleMode::Dynamic) return s;
  if (overflow) return LossScaleState{std::max(cfg.min_scale, s.scale / 2), 0};
  if (++s.good_steps >= cfg.window) s = LossScaleState{s.scale * 2, 0};
  return s;
}

bool is_loss_scale(double x) {
  int e = 0;
  return x >= 1 && std::isfinite(x) && std::frexp(x, &e) == 0.5;
}

void check_loss_scaling(const LossScaling& cfg) {
  if (cfg.mode == LossScaleMode::None) return;
  const char* flag = cfg.mode == LossScaleMode::Static ? "--loss-scale" : "--initial-loss-scale";
  if (!is_loss_scale(cfg.initial))
    throw std::invalid_argument(fmt::format(
        "{} must be a power of two >= 1 (got {}): scaling by it and back must be exact", flag, cfg.initial));
  if (cfg.mode != LossScaleMode::Dynamic) return;
  if (cfg.window < 1) throw std::invalid_argument(fmt::format("--loss-scale-window must be >= 1 (got {})", cfg.window));
  if (!is_loss_scale(cfg.min_scale) || cfg.min_scale > cfg.initial)
    throw std::invalid_argument(
        fmt::format("--min-loss-scale must be a power of two between 1 and --initial-loss-scale {} (got {})",
                    cfg.initial, cfg.min_scale));
}

std::string loss_scale_mode_name(LossScaleMode m) {
  return m == LossScaleMode::Static ? "static" : m == LossScaleMode::Dynamic ? "dynamic" : "none";
}

LrDecay parse_lr_decay(const std::string& name) {
  if (name == "constant") return LrDecay::Constant;
  if (name == "cosine") return LrDecay::Cosine;
  if (name == "linear") return LrDecay::Linear;
  throw std::invalid_argument("--lr-decay must be constant, cosine or linear (got '" + name + "')");
}

std::string lr_decay_name(LrDecay d) {
  return d == LrDecay::Cosine ? "cosine" : d == LrDecay::Linear ? "linear" : "constant";
}

void adamw_update(const AdamWConfig& cfg, int step, std::span<float> params, std::span<const float> grads,
                  std::span<float> m, std::span<float> v) {
  const float c1 = 1.0f - std::pow(cfg.beta1, static_cast<float>(step));
  const float c2 = 1.0f - std::pow(cfg.beta2, static_cast<float>(step));
  for (std::size_t i = 0; i < params.size(); ++i) {
    const float g = grads[i] * cfg.grad_scale;
    m[i] = cfg.beta1 * m[i] + (1.0f - cfg.beta1) * g;
    v[i] = cfg.beta2 * v[i] + (1.0f - cfg.beta2) * g * g;
    const float mhat = m[i] / c1, vhat = v[i] / c2;
    params[i] -= cfg.lr * (mhat / (std::sqrt(vhat) + cfg.eps) + cfg.weight_decay * params[i]);
  }
}

}  // namespace piper::runtime::host
