// Host kernels: every backward (input and weight gradients) against central finite differences of
// the forward, and AdamW against its closed form.
#include <cmath>
#include <functional>
#include <random>

#include <gtest/gtest.h>

#include "piper/runtime/kernels.hpp"

using namespace piper::runtime::host;

namespace {

Mat random_mat(Eigen::Index r, Eigen::Index c, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> n(0.0f, scale);
  Mat m(r, c);
  for (Eigen::Index i = 0; i < m.size(); ++i) m.data()[i] = n(rng);
  return m;
}

// Compares analytic[i] with (L(x+e) - L(x-e)) / 2e for every element of `x`. fp32 forward, e = 1e-2:
// truncation error O(e^2) ~ 1e-4 and rounding ~ 1e-7 |L| / e ~ 1e-5 |L|, so we allow
// |diff| <= 3e-3 + 2e-2 |analytic| (a wrong gradient is off by O(1)).
void expect_gradient(float* x, Eigen::Index n, const float* analytic, const std::function<double()>& loss,
                     const char* what) {
  const float e = 1e-2f;
  int checked = 0;
  for (Eigen::Index i = 0; i < n; ++i) {
    const float keep = x[i];
    x[i] = keep + e;
    const double up = loss();
    x[i] = keep - e;
    const double down = loss();
    x[i] = keep;
    const double fd = (up - down) / (2.0 * e);
    EXPECT_NEAR(analytic[i], fd, 3e-3 + 2e-2 * std::abs(fd)) << what << " element " << i;
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

double weighted_sum(const Mat& y, const Mat& r) { return static_cast<double>((y.array() * r.array()).sum()); }

}  // namespace

TEST(RuntimeKernels, RmsNormInputAndWeight) {
  std::mt19937 rng(1);
  Mat x = random_mat(3, 8, rng), r = random_mat(3, 8, rng);
  Vec g = Vec::Random(8).array() + 1.5f;
  auto loss = [&] {
    RmsNormCache c;
    return weighted_sum(rmsnorm_forward(x, ConstVecMap(g.data(), 8), &c), r);
  };
  RmsNormCache c;
  rmsnorm_forward(x, ConstVecMap(g.data(), 8), &c);
  Mat dx = rmsnorm_backward_input(c, ConstVecMap(g.data(), 8), r);
  Vec dg = Vec::Zero(8);
  rmsnorm_backward_weight(c, r, VecMap(dg.data(), 8));
  expect_gradient(x.data(), x.size(), dx.data(), loss, "dx");
  expect_gradient(g.data(), g.size(), dg.data(), loss, "dg");
}

TEST(RuntimeKernels, AttentionGqaRopeQkNormInputAndWeights) {
  std::mt19937 rng(2);
  AttentionShape s{4, 2, 4, 5, true, 10000.0f};
  const int H = 8, T = 10;  // two sequences of 5
  Mat u = random_mat(T, H, rng), r = random_mat(T, H, rng);
  Mat wq = random_mat(H, 16, rng, 0.4f), wk = random_mat(H, 8, rng, 0.4f), wv = random_mat(H, 8, rng, 0.4f),
      wo = random_mat(16, H, rng, 0.4f);
  Vec qn = Vec::Random(4).array() + 1.5f, kn = Vec::Random(4).array() + 1.5f;
  auto weights = [&] {
    return AttentionWeights{ConstMatMap(wq.data(), H, 16), ConstMatMap(wk.data(), H, 8), ConstMatMap(wv.data(), H, 8),
                            ConstMatMap(wo.data(), 16, H), ConstVecMap(qn.data(), 4),    ConstVecMap(kn.data(), 4)};
  };
  auto loss = [&] { return weighted_sum(attention_forward(s, weights(), u, nullptr), r); };
  AttentionCache c;
  attention_forward(s, weights(), u, &c);
  Mat du = attention_backward_input(s, weights(), c, r);
  Mat gq = Mat::Zero(H, 16), gk = Mat::Zero(H, 8), gv = Mat::Zero(H, 8), go = Mat::Zero(16, H);
  Vec gqn = Vec::Zero(4), gkn = Vec::Zero(4);
  AttentionGrads g{MatMap(gq.data(), H, 16), MatMap(gk.data(), H, 8), MatMap(gv.data(), H, 8),
                   MatMap(go.data(), 16, H), VecMap(gqn.data(), 4),   VecMap(gkn.data(), 4)};
  attention_backward_weight(s, c, g);
  expect_gradient(u.data(), u.size(), du.data(), loss, "du");
  expect_gradient(wq.data(), wq.size(), gq.data(), loss, "dwq");
  expect_gradient(wk.data(), wk.size(), gk.data(), loss, "dwk");
  expect_gradient(wv.data(), wv.size(), gv.data(), loss, "dwv");
  expect_gradient(wo.data(), wo.size(), go.data(), loss, "dwo");
  expect_gradient(qn.data(), qn.size(), gqn.data(), loss, "dq_norm");
  expect_gradient(kn.data(), kn.size(), gkn.data(), loss, "dk_norm");
}

TEST(RuntimeKernels, AttentionIsCausal) {
  // Changing the last token of a sequence must not change any earlier output row.
  std::mt19937 rng(3);
  AttentionShape s{2, 1, 4, 4, false, 10000.0f};
  Mat u = random_mat(4, 8, rng), wq = random_mat(8, 8, rng), wk = random_mat(8, 4, rng), wv = random_mat(8, 4, rng),
      wo = random_mat(8, 8, rng);
  Vec one = Vec::Ones(4);
  AttentionWeights w{ConstMatMap(wq.data(), 8, 8), ConstMatMap(wk.data(), 8, 4), ConstMatMap(wv.data(), 8, 4),
                     ConstMatMap(wo.data(), 8, 8), ConstVecMap(one.data(), 4),   ConstVecMap(one.data(), 4)};
  Mat a = attention_forward(s, w, u, nullptr);
  u.row(3).setRandom();
  Mat b = attention_forward(s, w, u, nullptr);
  EXPECT_LT((a.topRows(3) - b.topRows(3)).cwiseAbs().maxCoeff(), 1e-6f);
  EXPECT_GT((a.row(3) - b.row(3)).cwiseAbs().maxCoeff(), 1e-3f);
}

TEST(RuntimeKernels, SwigluMlpInputAndWeights) {
  std::mt19937 rng(4);
  Mat u = random_mat(4, 6, rng), r = random_mat(4, 6, rng);
  Mat wg = random_mat(6, 5, rng, 0.5f), wu = random_mat(6, 5, rng, 0.5f), wd = random_mat(5, 6, rng, 0.5f);
  auto w = [&] {
    return MlpWeights{ConstMatMap(wg.data(), 6, 5), ConstMatMap(wu.data(), 6, 5), ConstMatMap(wd.data(), 5, 6)};
  };
  auto loss = [&] { return weighted_sum(mlp_forward(w(), u, nullptr), r); };
  MlpCache c;
  mlp_forward(w(), u, &c);
  Mat du = mlp_backward_input(w(), c, r);
  Mat gg = Mat::Zero(6, 5), gu = Mat::Zero(6, 5), gd = Mat::Zero(5, 6);
  MlpGrads g{MatMap(gg.data(), 6, 5), MatMap(gu.data(), 6, 5), MatMap(gd.data(), 5, 6)};
  mlp_backward_weight(c, g);
  expect_gradient(u.data(), u.size(), du.data(), loss, "du");
  expect_gradient(wg.data(), wg.size(), gg.data(), loss, "dwg");
  expect_gradient(wu.data(), wu.size(), gu.data(), loss, "dwu");
  expect_gradient(wd.data(), wd.size(), gd.data(), loss, "dwd");
}

TEST(RuntimeKernels, RouterGatesInputAndWeight) {
  std::mt19937 rng(5);
  Mat u = random_mat(6, 4, rng), wr = random_mat(4, 5, rng), r = random_mat(6, 2, rng);
  auto loss = [&] {
    Eigen::MatrixXi topk;
    Mat gates;
    router_forward(ConstMatMap(wr.data(), 4, 5), 2, u, nullptr, &topk, &gates);
    return weighted_sum(gates, r);
  };
  RouterCache c;
  Eigen::MatrixXi topk;
  Mat gates;
  router_forward(ConstMatMap(wr.data(), 4, 5), 2, u, &c, &topk, &gates);
  for (Eigen::Index t = 0; t < 6; ++t) EXPECT_NEAR(gates.row(t).sum(), 1.0f, 1e-6f);  // top-k renormalised
  Mat du = router_backward_input(ConstMatMap(wr.data(), 4, 5), c, r);
  Mat dwr = Mat::Zero(4, 5);
  router_backward_weight(c, MatMap(dwr.data(), 4, 5));
  // A perturbation of 1e-2 can flip a near-tie of the top-k; this seed has none (margins checked).
  expect_gradient(u.data(), u.size(), du.data(), loss, "du");
  expect_gradient(wr.data(), wr.size(), dwr.data(), loss, "dwr");
}

TEST(RuntimeKernels, ExpertsOnEntriesInputAndWeights) {
  std::mt19937 rng(6);
  const int H = 4, F = 3;
  std::vector<Mat> w;
  for (int e = 0; e < 6; ++e) w.push_back(random_mat(e % 3 == 2 ? F : H, e % 3 == 2 ? H : F, rng, 0.6f));
  // This device holds experts 2 and 3 of a larger set: entries name global expert ids.
  std::vector<int> expert = {3, 2, 3, 3, 2};
  Mat rows = random_mat(5, H, rng), r = random_mat(5, H, rng);
  auto weights = [&] {
    std::vector<MlpWeights> ws;
    for (int e = 0; e < 2; ++e)
      ws.push_back({ConstMatMap(w[3 * e].data(), H, F), ConstMatMap(w[3 * e + 1].data(), H, F),
                    ConstMatMap(w[3 * e + 2].data(), F, H)});
    return ws;
  };
  auto loss = [&] { return weighted_sum(experts_forward(weights(), 2, expert, rows, nullptr), r); };
  ExpertsCache c;
  experts_forward(weights(), 2, expert, rows, &c);
  Mat drows = experts_backward_input(weights(), c, r);
  std::vector<Mat> gw;
  for (const auto& m : w) gw.push_back(Mat::Zero(m.rows(), m.cols()));
  std::vector<MlpGrads> g;
  for (int e = 0; e < 2; ++e)
    g.push_back(
        {MatMap(gw[3 * e].data(), H, F), MatMap(gw[3 * e + 1].data(), H, F), MatMap(gw[3 * e + 2].data(), F, H)});
  experts_backward_weight(c, g);
  expect_gradient(rows.data(), rows.size(), drows.data(), loss, "drows");
  for (std::size_t i = 0; i < w.size(); ++i) expect_gradient(w[i].data(), w[i].size(), gw[i].data(), loss, "dw expert");
}

TEST(RuntimeKernels, HeadCrossEntropyInputAndWeight) {
  std::mt19937 rng(7);
  Mat u = random_mat(4, 5, rng), wh = random_mat(5, 7, rng);
  std::vector<int> targets = {0, 6, 3, 3};
  auto loss = [&] { return head_forward(ConstMatMap(wh.data(), 5, 7), u, targets, 1.0f, nullptr); };
  HeadCache c;
  const double l = head_forward(ConstMatMap(wh.data(), 5, 7), u, targets, 1.0f, &c);
  // Uniform logits give log(vocab) per token: a closed form for the loss itself.
  Mat zero_u = Mat::Zero(4, 5);
  EXPECT_NEAR(head_forward(ConstMatMap(wh.data(), 5, 7), zero_u, targets, 1.0f, nullptr), 4 * std::log(7.0), 1e-5);
  EXPECT_GT(l, 0.0);
  Mat du = head_backward_input(ConstMatMap(wh.data(), 5, 7), c);
  Mat dwh = Mat::Zero(5, 7);
  head_backward_weight(c, MatMap(dwh.data(), 5, 7));
  expect_gradient(u.data(), u.size(), du.data(), loss, "du");
  expect_gradient(wh.data(), wh.size(), dwh.data(), loss, "dwh");
}

TEST(RuntimeKernels, EmbeddingWeightGradient) {
  std::mt19937 rng(8);
  Mat table = random_mat(6, 3, rng), r = random_mat(4, 3, rng);
  std::vector<int> tokens = {1, 4, 1, 0};
  auto loss = [&] { return weighted_sum(embedding_forward(ConstMatMap(table.data(), 6, 3), tokens), r); };
  Mat dt = Mat::Zero(6, 3);
  embedding_backward_weight(tokens, r, MatMap(dt.data(), 6, 3));
  expect_gradient(table.data(), table.size(), dt.data(), loss, "dtable");
}

TEST(RuntimeKernels, AdamWFirstStepClosedForm) {
  // Step 1 from zero moments: mhat = g, vhat = g^2, so p -= lr * (g / (|g| + eps) + wd * p).
  AdamWConfig cfg;
  cfg.lr = 0.1f;
  cfg.weight_decay = 0.01f;
  std::vector<float> p = {1.0f, -2.0f}, g = {0.5f, -0.25f}, m(2, 0.0f), v(2, 0.0f);
  adamw_update(cfg, 1, p, g, m, v);
  EXPECT_NEAR(p[0], 1.0f - 0.1f * (1.0f + 0.01f * 1.0f), 1e-6f);
  EXPECT_NEAR(p[1], -2.0f - 0.1f * (-1.0f + 0.01f * -2.0f), 1e-6f);
  EXPECT_NEAR(m[0], 0.05f, 1e-7f);
  EXPECT_NEAR(v[1], 0.05f * 0.0625f, 1e-8f);
}

// ---- GPT-style kernels: LayerNorm, GELU, biases, learned positions, tied head ----

TEST(RuntimeKernels, LayerNormInputAndWeights) {
  std::mt19937 rng(9);
  Mat x = random_mat(3, 8, rng), r = random_mat(3, 8, rng);
  Vec g = Vec::Random(8).array() + 1.5f, b = Vec::Random(8);
  auto loss = [&] {
    return weighted_sum(layernorm_forward(x, ConstVecMap(g.data(), 8), ConstVecMap(b.data(), 8), nullptr), r);
  };
  LayerNormCache c;
  Mat y = layernorm_forward(x, ConstVecMap(g.data(), 8), ConstVecMap(b.data(), 8), &c);
  // Closed form: with g = 1 and b = 0 every row has mean 0 and variance var/(var + eps) ~ 1.
  Vec one = Vec::Ones(8), zero = Vec::Zero(8);
  Mat n = layernorm_forward(x, ConstVecMap(one.data(), 8), ConstVecMap(zero.data(), 8), nullptr);
  for (Eigen::Index t = 0; t < n.rows(); ++t) {
    EXPECT_NEAR(n.row(t).mean(), 0.0f, 1e-6f);
    EXPECT_NEAR(n.row(t).squaredNorm() / 8.0f, 1.0f, 1e-3f);
  }
  Mat dx = layernorm_backward_input(c, ConstVecMap(g.data(), 8), r);
  Vec dg = Vec::Zero(8), db = Vec::Zero(8);
  layernorm_backward_weight(c, r, VecMap(dg.data(), 8), VecMap(db.data(), 8));
  expect_gradient(x.data(), x.size(), dx.data(), loss, "dx");
  expect_gradient(g.data(), g.size(), dg.data(), loss, "dg");
  expect_gradient(b.data(), b.size(), db.data(), loss, "db");
}

TEST(RuntimeKernels, GeluTanhApproximation) {
  // Values by hand: gelu(0) = 0; gelu(a) -> a for large a and -> 0 for very negative a;
  // gelu(1) = 0.5 (1 + tanh(0.7978846 * 1.044715)) = 0.841192.
  Mat a(1, 4);
  a << 0.0f, 1.0f, 8.0f, -8.0f;
  Mat y = gelu_forward(a);
  EXPECT_NEAR(y(0, 0), 0.0f, 1e-7f);
  EXPECT_NEAR(y(0, 1), 0.841192f, 1e-5f);
  EXPECT_NEAR(y(0, 2), 8.0f, 1e-5f);
  EXPECT_NEAR(y(0, 3), 0.0f, 1e-5f);
  std::mt19937 rng(10);
  Mat x = random_mat(3, 5, rng, 2.0f), r = random_mat(3, 5, rng);
  auto loss = [&] { return weighted_sum(gelu_forward(x), r); };
  Mat dx = gelu_backward(x, r);
  expect_gradient(x.data(), x.size(), dx.data(), loss, "dgelu");
}

TEST(RuntimeKernels, BiasAddGradient) {
  std::mt19937 rng(11);
  Mat x = random_mat(4, 3, rng), r = random_mat(4, 3, rng);
  Vec b = Vec::Random(3);
  auto loss = [&] {
    Mat y = x;
    bias_add(y, ConstVecMap(b.data(), 3));
    return weighted_sum(y, r);
  };
  Vec db = Vec::Zero(3);
  bias_backward_weight(r, VecMap(db.data(), 3));
  expect_gradient(b.data(), b.size(), db.data(), loss, "db");
}

TEST(RuntimeKernels, GeluMlpInputAndWeights) {
  std::mt19937 rng(12);
  Mat u = random_mat(4, 6, rng), r = random_mat(4, 6, rng);
  Mat w1 = random_mat(6, 8, rng, 0.5f), w2 = random_mat(8, 6, rng, 0.5f);
  Vec b1 = Vec::Random(8) * 0.5f;
  auto w = [&] {
    return GeluMlpWeights{ConstMatMap(w1.data(), 6, 8), ConstMatMap(w2.data(), 8, 6), ConstVecMap(b1.data(), 8)};
  };
  auto loss = [&] { return weighted_sum(gelu_mlp_forward(w(), u, nullptr), r); };
  GeluMlpCache c;
  gelu_mlp_forward(w(), u, &c);
  Mat du = gelu_mlp_backward_input(w(), c, r);
  Mat g1 = Mat::Zero(6, 8), g2 = Mat::Zero(8, 6);
  Vec gb1 = Vec::Zero(8);
  GeluMlpGrads g{MatMap(g1.data(), 6, 8), MatMap(g2.data(), 8, 6), VecMap(gb1.data(), 8)};
  gelu_mlp_backward_weight(c, g);
  expect_gradient(u.data(), u.size(), du.data(), loss, "du");
  expect_gradient(w1.data(), w1.size(), g1.data(), loss, "dw1");
  expect_gradient(w2.data(), w2.size(), g2.data(), loss, "dw2");
  expect_gradient(b1.data(), b1.size(), gb1.data(), loss, "db1");
}

// GPT attention: multi-head, no RoPE (positions are learned elsewhere), q/k/v biases.
TEST(RuntimeKernels, AttentionWithBiasesWithoutRope) {
  std::mt19937 rng(13);
  AttentionShape s{2, 2, 4, 5, false, 10000.0f, false, true};
  const int H = 8, T = 10;
  Mat u = random_mat(T, H, rng), r = random_mat(T, H, rng);
  Mat wq = random_mat(H, 8, rng, 0.4f), wk = random_mat(H, 8, rng, 0.4f), wv = random_mat(H, 8, rng, 0.4f),
      wo = random_mat(8, H, rng, 0.4f);
  Vec bq = Vec::Random(8), bk = Vec::Random(8), bv = Vec::Random(8), unused = Vec::Ones(4);
  auto weights = [&] {
    return AttentionWeights{ConstMatMap(wq.data(), H, 8), ConstMatMap(wk.data(), H, 8),  ConstMatMap(wv.data(), H, 8),
                            ConstMatMap(wo.data(), 8, H), ConstVecMap(unused.data(), 4), ConstVecMap(unused.data(), 4),
                            ConstVecMap(bq.data(), 8),    ConstVecMap(bk.data(), 8),     ConstVecMap(bv.data(), 8)};
  };
  auto loss = [&] { return weighted_sum(attention_forward(s, weights(), u, nullptr), r); };
  AttentionCache c;
  attention_forward(s, weights(), u, &c);
  Mat du = attention_backward_input(s, weights(), c, r);
  Mat gq = Mat::Zero(H, 8), gk = Mat::Zero(H, 8), gv = Mat::Zero(H, 8), go = Mat::Zero(8, H);
  Vec gbq = Vec::Zero(8), gbk = Vec::Zero(8), gbv = Vec::Zero(8), gn = Vec::Zero(4);
  AttentionGrads g{MatMap(gq.data(), H, 8), MatMap(gk.data(), H, 8), MatMap(gv.data(), H, 8),
                   MatMap(go.data(), 8, H), VecMap(gn.data(), 4),    VecMap(gn.data(), 4),
                   VecMap(gbq.data(), 8),   VecMap(gbk.data(), 8),   VecMap(gbv.data(), 8)};
  attention_backward_weight(s, c, g);
  expect_gradient(u.data(), u.size(), du.data(), loss, "du");
  expect_gradient(wq.data(), wq.size(), gq.data(), loss, "dwq");
  expect_gradient(wk.data(), wk.size(), gk.data(), loss, "dwk");
  expect_gradient(wv.data(), wv.size(), gv.data(), loss, "dwv");
  expect_gradient(wo.data(), wo.size(), go.data(), loss, "dwo");
  expect_gradient(bq.data(), bq.size(), gbq.data(), loss, "dbq");
  expect_gradient(bk.data(), bk.size(), gbk.data(), loss, "dbk");
  expect_gradient(bv.data(), bv.size(), gbv.data(), loss, "dbv");
  // Without RoPE the attention has no notion of order inside the causal window: the last token of a
  // sequence sees its prefix as a set, so swapping two earlier tokens leaves its output unchanged.
  Mat before = attention_forward(s, weights(), u, nullptr);
  u.row(0).swap(u.row(2));
  Mat after = attention_forward(s, weights(), u, nullptr);
  EXPECT_LT((before.row(4) - after.row(4)).cwiseAbs().maxCoeff(), 1e-5f);
  EXPECT_GT((before.row(1) - after.row(1)).cwiseAbs().maxCoeff(), 1e-3f);  // row 1 saw token 0, now token 2
}

TEST(RuntimeKernels, LearnedPositionsWeightGradient) {
  std::mt19937 rng(14);
  // Rows 3.. of two 4-token sequences (a sequence-parallel slice starting at row 3): positions 3, 0, 1, 2, 3.
  Mat pos = random_mat(6, 3, rng), x0 = random_mat(5, 3, rng), r = random_mat(5, 3, rng);
  auto loss = [&] {
    Mat x = x0;
    positions_forward(x, ConstMatMap(pos.data(), 6, 3), 4, 3);
    return weighted_sum(x, r);
  };
  Mat x = x0;
  positions_forward(x, ConstMatMap(pos.data(), 6, 3), 4, 3);
  EXPECT_LT((x.row(1) - x0.row(1) - pos.row(0)).cwiseAbs().maxCoeff(), 1e-6f);  // row 4 = position 0
  Mat dpos = Mat::Zero(6, 3);
  positions_backward_weight(r, MatMap(dpos.data(), 6, 3), 4, 3);
  expect_gradient(pos.data(), pos.size(), dpos.data(), loss, "dpos");
  EXPECT_EQ(dpos.bottomRows(2).cwiseAbs().maxCoeff(), 0.0f);  // positions 4, 5 are unused at seq_len 4
}

// Tied embeddings: the table is used twice (lookup and head), so its gradient is the sum of the
// embedding's scatter-add and the head's dlogits^T u; finite differences of the whole composition check both.
TEST(RuntimeKernels, TiedHeadGradientAddsToTheEmbedding) {
  std::mt19937 rng(15);
  const int V = 7, H = 5;
  Mat table = random_mat(V, H, rng);
  Vec g = Vec::Ones(H), b = Vec::Zero(H);
  std::vector<int> tokens = {1, 4, 1, 6}, targets = {4, 1, 6, 0};
  auto forward = [&](HeadCache* hc, LayerNormCache* lc) {
    const ConstMatMap t(table.data(), V, H);
    Mat u = layernorm_forward(embedding_forward(t, tokens), ConstVecMap(g.data(), H), ConstVecMap(b.data(), H), lc);
    return tied_head_forward(t, u, targets, 1.0f, hc);
  };
  auto loss = [&] { return forward(nullptr, nullptr); };
  HeadCache hc;
  LayerNormCache lc;
  forward(&hc, &lc);
  // Same loss as the untied head holding the table's transpose.
  Mat wh = table.transpose();
  Mat u = layernorm_forward(embedding_forward(ConstMatMap(table.data(), V, H), tokens), ConstVecMap(g.data(), H),
                            ConstVecMap(b.data(), H), nullptr);
  EXPECT_NEAR(head_forward(ConstMatMap(wh.data(), H, V), u, targets, 1.0f, nullptr), loss(), 1e-5);
  Mat dtable = Mat::Zero(V, H);
  tied_head_backward_weight(hc, MatMap(dtable.data(), V, H));
  Mat du = tied_head_backward_input(ConstMatMap(table.data(), V, H), hc);
  embedding_backward_weight(tokens, layernorm_backward_input(lc, ConstVecMap(g.data(), H), du),
                            MatMap(dtable.data(), V, H));
  expect_gradient(table.data(), table.size(), dtable.data(), loss, "dtable (lookup + head)");
}
