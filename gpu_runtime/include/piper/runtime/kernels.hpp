// Host (Eigen, fp32) kernels of the transformer layers: one forward and a backward split into the
// input gradient (BI) and the weight gradient (BW) per kernel, plus AdamW. The reference beside which
// any faster (CUDA) kernel is checked.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <Eigen/Dense>

namespace piper::runtime::host {

// Row-major so that a row is a token and a tensor's storage is one contiguous span of a flat vector.
using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vec = Eigen::VectorXf;
using MatMap = Eigen::Map<Mat>;
using ConstMatMap = Eigen::Map<const Mat>;
using VecMap = Eigen::Map<Vec>;
using ConstVecMap = Eigen::Map<const Vec>;

constexpr float kNormEps = 1e-6f;
constexpr float kLayerNormEps = 1e-5f;  // GPT-2 / Megatron LayerNorm

// ---- Embedding: x[t] = table[token[t]] ----
// A vocab-parallel shard holds rows [first_row, first_row + table.rows()): other tokens give zero rows
// (forward) and no gradient (backward); the TP all-reduce of the rows completes the lookup.
Mat embedding_forward(const ConstMatMap& table, const std::vector<int>& tokens, int first_row = 0);
void embedding_backward_weight(const std::vector<int>& tokens, const Mat& dx, MatMap dtable, int first_row = 0);

// ---- RMSNorm over the columns of each row: y = x / rms(x) * g ----
struct RmsNormCache {
  Mat x;
  Vec rstd;  // 1 / sqrt(mean(x^2) + eps), per row
};
Mat rmsnorm_forward(const Mat& x, const ConstVecMap& g, RmsNormCache* cache);
Mat rmsnorm_backward_input(const RmsNormCache& c, const ConstVecMap& g, const Mat& dy);
void rmsnorm_backward_weight(const RmsNormCache& c, const Mat& dy, VecMap dg);

// ---- LayerNorm over the columns of each row: y = (x - mean) / sqrt(var + eps) * g + b (Ba et al. 2016) ----
struct LayerNormCache {
  Mat xhat;  // normalised input
  Vec rstd;  // 1 / sqrt(var(x) + eps), per row
};
Mat layernorm_forward(const Mat& x, const ConstVecMap& g, const ConstVecMap& b, LayerNormCache* cache);
Mat layernorm_backward_input(const LayerNormCache& c, const ConstVecMap& g, const Mat& dy);
void layernorm_backward_weight(const LayerNormCache& c, const Mat& dy, VecMap dg, VecMap db);

// ---- Bias of a linear layer, broadcast over the token rows: y = x + b; db = column sums of dy ----
void bias_add(Mat& x, const ConstVecMap& b);
void bias_backward_weight(const Mat& dy, VecMap db);

// ---- GELU, tanh approximation (Hendrycks & Gimpel 2016), as GPT-2 and Megatron use it ----
Mat gelu_forward(const Mat& a);
Mat gelu_backward(const Mat& a, const Mat& dy);  // dy * gelu'(a)

// ---- Learned absolute positions (GPT): x[t] += pos[(first_position + t) % seq_len] ----
void positions_forward(Mat& x, const ConstMatMap& pos, int seq_len, int first_position = 0);
void positions_backward_weight(const Mat& dx, MatMap dpos, int seq_len, int first_position = 0);

// ---- Causal self-attention with grouped KV heads, RoPE, optional Qwen3 per-head q/k RMSNorm ----
// Context parallelism (Megatron's load-balanced causal chunks): each sequence of S tokens is cut into
// 2·cp chunks of C = S / (2·cp) and CP rank r holds chunks r and 2·cp-1-r, so its seq_len = S / cp
// local rows per sequence are positions [r·C, (r+1)·C) then [(2·cp-1-r)·C, (2·cp-r)·C). The host
// kernels compute ring attention's result exactly by its all-gather form: K and V of every rank
// gathered (`gather`: [rows] -> [cp·rows], rank order), the causal mask from global positions, and
// dK/dV summed back to their owners (`scatter_sum`: [cp·rows] partials -> this rank's [rows] sum).
struct AttentionCp {
  int cp = 1, rank = 0;
  std::function<Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>(
      const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>&)>
      gather, scatter_sum;
  // The position in its sequence of CP rank r's local row i (0 <= i < local_len = S / cp).
  int position(int r, int i, int local_len) const {
    const int chunk = local_len / 2;
    return i < chunk ? r * chunk + i : (2 * cp - 1 - r) * chunk + (i - chunk);
  }
};
struct AttentionShape {
  int heads = 1, kv_heads = 1, head_dim = 1;
  int seq_len = 1;  // rows are sequences of seq_len tokens one after another
  bool qk_norm = false;
  float rope_theta = 10000.0f;
  bool rope = true;                 // false: learned absolute positions (GPT) added at the embedding instead
  bool bias = false;                // q, k, v projection biases (GPT); the output bias is added by the caller
  const AttentionCp* cp = nullptr;  // context parallelism (seq_len is then the local rows per sequence)
  bool context_parallel() const { return cp != nullptr && cp->cp > 1; }
};
struct AttentionWeights {
  ConstMatMap wq, wk, wv, wo;                                  // [H, heads*hd], [H, kv*hd], [H, kv*hd], [heads*hd, H]
  ConstVecMap q_norm, k_norm;                                  // [hd] each (unused without qk_norm)
  ConstVecMap bq{nullptr, 0}, bk{nullptr, 0}, bv{nullptr, 0};  // [heads*hd], [kv*hd], [kv*hd] with bias
};
struct AttentionGrads {
  MatMap wq, wk, wv, wo;
  VecMap q_norm, k_norm;
  VecMap bq{nullptr, 0}, bk{nullptr, 0}, bv{nullptr, 0};
};
struct AttentionCache {
  Mat u;                   // input
  Mat q_lin, k_lin, v;     // projections (before qk-norm and RoPE)
  Mat q_rstd, k_rstd;      // [T, heads], [T, kv] per-head RMSNorm factors
  Mat q, k;                // after qk-norm and RoPE
  Mat k_all, v_all;        // context parallelism: every CP rank's k and v (AttentionCp::gather)
  std::vector<Mat> probs;  // per (sequence, head): [seq, seq] softmax
  Mat o;                   // [T, heads*hd] attention output before wo
  // Saved by backward_input for backward_weight:
  Mat dout, dq_lin, dk_lin, dv;
  Vec dq_norm, dk_norm;
};
Mat attention_forward(const AttentionShape& s, const AttentionWeights& w, const Mat& u, AttentionCache* c);
// The attention core (QK^T, causal softmax, .V) from c.q, c.k, c.v: fills c.probs and c.o. Selective
// recomputation (Korthikanti et al. 2022) drops exactly these after the forward and reruns this in
// the backward, which attention_backward_input does when c.probs is empty.
void attention_core_forward(const AttentionShape& s, AttentionCache& c);
void attention_drop_core(AttentionCache& c);
Mat attention_backward_input(const AttentionShape& s, const AttentionWeights& w, AttentionCache& c, const Mat& dout);
void attention_backward_weight(const AttentionShape& s, const AttentionCache& c, AttentionGrads& g);

// ---- SwiGLU MLP: y = (silu(u wg) * (u wu)) wd ----
struct MlpWeights {
  ConstMatMap wg, wu, wd;  // [H, F], [H, F], [F, H]
};
struct MlpGrads {
  MatMap wg, wu, wd;
};
struct MlpCache {
  Mat u, a, b, h;    // h = silu(a) * b
  Mat dout, da, db;  // saved by backward_input
};
Mat mlp_forward(const MlpWeights& w, const Mat& u, MlpCache* c);
Mat mlp_backward_input(const MlpWeights& w, MlpCache& c, const Mat& dout);
void mlp_backward_weight(const MlpCache& c, MlpGrads& g);

// ---- GELU MLP (GPT): y = gelu(u w1 + b1) w2; the output bias b2 is added by the caller (after the
// tensor-parallel reduction, so that it is added once) ----
struct GeluMlpWeights {
  ConstMatMap w1, w2;  // [H, F], [F, H]
  ConstVecMap b1;      // [F]
};
struct GeluMlpGrads {
  MatMap w1, w2;
  VecMap b1;
};
struct GeluMlpCache {
  Mat u, a, h;   // a = u w1 + b1, h = gelu(a)
  Mat dout, da;  // saved by backward_input
};
Mat gelu_mlp_forward(const GeluMlpWeights& w, const Mat& u, GeluMlpCache* c);
Mat gelu_mlp_backward_input(const GeluMlpWeights& w, GeluMlpCache& c, const Mat& dout);
void gelu_mlp_backward_weight(const GeluMlpCache& c, GeluMlpGrads& g);

// ---- MoE router: softmax over the top-k logits of u wr (Qwen3-MoE normalises the top-k) ----
struct RouterCache {
  Mat u;
  Eigen::MatrixXi topk;  // [T, k] expert ids, best first
  Mat gates;             // [T, k]
  Mat dlogits;           // [T, E] saved by backward_input
};
void router_forward(const ConstMatMap& wr, int top_k, const Mat& u, RouterCache* c, Eigen::MatrixXi* topk, Mat* gates);
Mat router_backward_input(const ConstMatMap& wr, RouterCache& c, const Mat& dgates);
void router_backward_weight(const RouterCache& c, MatMap dwr);

// ---- Routed experts on a list of (row, expert) entries: y_i = mlp_{expert_i}(rows_i) ----
// Expert e's weights are at index e - first_expert of `experts` (a device holds a contiguous range).
struct ExpertsCache {
  std::vector<int> expert;  // per entry
  std::vector<MlpCache> per_expert;
  std::vector<std::vector<int>> rows_of;  // local expert -> entry indices
};
Mat experts_forward(const std::vector<MlpWeights>& experts, int first_expert, const std::vector<int>& expert,
                    const Mat& rows, ExpertsCache* c);
Mat experts_backward_input(const std::vector<MlpWeights>& experts, ExpertsCache& c, const Mat& dy);
void experts_backward_weight(ExpertsCache& c, std::vector<MlpGrads>& g);

// ---- LM head + cross-entropy: loss_sum = sum_t (logsumexp(l_t) - l_t[target_t]), l = u wh ----
struct HeadCache {
  Mat u;
  Mat dlogits;  // (softmax - onehot) * loss_scale, computed in the forward
};
double head_forward(const ConstMatMap& wh, const Mat& u, const std::vector<int>& targets, float loss_scale,
                    HeadCache* c);
Mat head_backward_input(const ConstMatMap& wh, const HeadCache& c);
void head_backward_weight(const HeadCache& c, MatMap dwh);
// Tied head (GPT): the logits use the embedding table [V, H] as l = u table^T; the weight gradient
// dlogits^T u accumulates into the table's gradient.
double tied_head_forward(const ConstMatMap& table, const Mat& u, const std::vector<int>& targets, float loss_scale,
                         HeadCache* c);
Mat tied_head_backward_input(const ConstMatMap& table, const HeadCache& c);
void tied_head_backward_weight(const HeadCache& c, MatMap dtable);

// ---- Loss scaling (fp16 training): PyTorch's GradScaler, Megatron-LM's DynamicGradScaler ----
// The loss gradient is multiplied by the scale, and every gradient divided by it before clipping and
// the update. Dynamic: a step whose gradients overflow (a non-finite global gradient norm) has its
// update skipped and the scale halved (not below min_scale); after `window` steps in a row without
// an overflow the scale doubles. Scales are powers of two, so scaling and unscaling are exact.
enum class LossScaleMode { None, Static, Dynamic };
struct LossScaling {
  LossScaleMode mode = LossScaleMode::None;
  double initial = 65536;  // the static scale, or the dynamic one's start (GradScaler's init_scale 2^16)
  int window = 2000;       // GradScaler's growth_interval (Megatron's --loss-scale-window is 1000)
  double min_scale = 1;    // Megatron's --min-loss-scale
};
// The scaler's state between steps (saved in checkpoints).
struct LossScaleState {
  double scale = 1;
  int good_steps = 0;  // steps since the last overflow or growth
};
LossScaleState initial_loss_scale(const LossScaling& cfg);
// The state after a step that did (or did not) overflow; Static and None keep the scale.
LossScaleState next_loss_scale(const LossScaling& cfg, LossScaleState s, bool overflow);
// A usable scale: a finite power of two >= 1 (scaling by it and back is exact).
bool is_loss_scale(double x);
// Refuses a scale that is not a power of two >= 1, a window < 1 or min_scale above the initial scale
// (std::invalid_argument naming the flag).
void check_loss_scaling(const LossScaling& cfg);
std::string loss_scale_mode_name(LossScaleMode m);  // "none", "static", "dynamic"
// The gradient of each token's loss in a step of `tokens` tokens, times `scale`: scale * (1 / tokens),
// the power of two applied after the rounding of 1 / tokens (so a scaled run's gradients are its
// unscaled run's times the scale, exactly). A scale beyond float's range gives inf: an overflow.
inline float scaled_loss_gradient(double scale, std::int64_t tokens) {
  const float s =
      scale > std::numeric_limits<float>::max() ? std::numeric_limits<float>::infinity() : static_cast<float>(scale);
  return s * (1.0f / static_cast<float>(tokens));
}

// ---- AdamW (Loshchilov & Hutter 2019), decoupled weight decay, bias-corrected; step counts from 1 ----
enum class LrDecay { Constant, Cosine, Linear };
struct AdamWConfig {
  float lr = 3e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.01f;
  // The learning rate over optimizer steps (Megatron-LM's and TorchTitan's schedules): a linear
  // warmup to lr over the first warmup_steps steps (step s: lr * s / warmup_steps), then `decay` from
  // lr at step warmup_steps to min_lr at step decay_steps (constant: lr throughout), min_lr after it.
  int warmup_steps = 0;
  LrDecay decay = LrDecay::Constant;
  int decay_steps = 0;  // > warmup_steps when decay is not constant (the trainers default it to --steps)
  float min_lr = 0;
  // Multiplies every gradient before the moments: gradient clipping's min(1, max_norm / norm), over
  // the loss scale when there is one.
  float grad_scale = 1;
  LossScaling loss_scaling;
  // The learning rate of optimizer step `step` (counting from 1).
  float lr_at(int step) const;
  // This configuration with lr = lr_at(step): what the update of that step uses.
  AdamWConfig at(int step) const {
    AdamWConfig c = *this;
    c.lr = lr_at(step);
    return c;
  }
};
// Refuses settings no schedule can follow (std::invalid_argument naming the flag): negative rates,
// betas outside [0, 1), min_lr above lr, a decay that ends before its warmup does.
void check_adamw(const AdamWConfig& cfg);
LrDecay parse_lr_decay(const std::string& name);  // "constant", "cosine", "linear"; else invalid_argument
std::string lr_decay_name(LrDecay d);
void adamw_update(const AdamWConfig& cfg, int step, std::span<float> params, std::span<const float> grads,
                  std::span<float> m, std::span<float> v);

}  // namespace piper::runtime::host
