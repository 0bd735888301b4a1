// Per-kernel timing (KernelTiming, kernel_table.hpp): what one launch of a core::Kernel takes on a GPU with
// a kernel efficiency table (kernel_table.cpp reads and interpolates the tables) under a runtime
// profile; docs/cost-model.md.
#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "piper/core/suggest.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/kernel_table.hpp"

namespace piper::sim {

using core::Kernel;
using core::KernelKind;

namespace {
constexpr std::pair<RuntimeProfile, const char*> kProfileNames[] = {
    {RuntimeProfile::Fused, "fused"},
    {RuntimeProfile::Eager, "eager"},
    {RuntimeProfile::EagerFusedLoss, "eager-fused-loss"},
    {RuntimeProfile::EagerUnfusedNorm, "eager-unfused-norm"},
    {RuntimeProfile::PiperCuda, "piper-cuda"}};
}  // namespace

std::string to_string(RuntimeProfile p) {
  for (const auto& [q, name] : kProfileNames)
    if (q == p) return name;
  return "fused";
}

RuntimeProfile runtime_profile_from_string(const std::string& s) {
  for (const auto& [q, name] : kProfileNames)
    if (s == name) return q;
  throw ClusterError("unknown runtime profile '" + s + "'" + core::did_you_mean(s, runtime_profiles()) +
                     " (expected one of " + runtime_profile_names() + ")");
}

std::vector<std::string> runtime_profiles() {
  std::vector<std::string> out;
  for (const auto& [q, name] : kProfileNames) out.emplace_back(name);
  return out;
}

std::string runtime_profile_names() {
  std::string out;
  for (const std::string& name : runtime_profiles()) out += (out.empty() ? "\"" : ", \"") + name + "\"";
  return out;
}

namespace {

// Bytes per element (in units of the kernel's dtype unless noted) and launches of each element-wise
// kind under a runtime profile, and the measured kernel class whose bandwidth it gets.
struct ElementwiseCost {
  double bytes_per_elem;       // in elements of the kernel's dtype
  double fp32_bytes_per_elem;  // fp32 traffic on top (the loss's fp32 logits)
  int launches;
  const char* table_kernel;
};

ElementwiseCost elementwise_cost(KernelKind kind, RuntimeProfile p) {
  const bool loss = kind == KernelKind::Loss || kind == KernelKind::LossBackward;
  const bool eager = p == RuntimeProfile::Eager || p == RuntimeProfile::EagerUnfusedNorm ||
                     (p == RuntimeProfile::EagerFusedLoss && !loss);
  if (p == RuntimeProfile::EagerUnfusedNorm) {
    // RMSNorm written in torch ops (TorchTitan's: x * rsqrt(x.float().pow(2).mean(-1) + eps), .type_as(x),
    // * weight). Forward: the cast (read 1, write 4 fp32 bytes), pow (4, 4), mean (4), the product with
    // the rsqrt (4, 4), type_as (4, write 1), the weight (1, 1): 4 elements of the dtype and 28 fp32
    // bytes in 8 launches (with the add and rsqrt over the rows). Input gradient, autograd's reverse:
    // the weight's product (1, 1), type_as (1, 4), the product with the rsqrt (4, 4) and the rsqrt's
    // gradient (a product 4, 4, 4 and a row sum 4), mean's expansion into pow's gradient (self.pow(1)
    // 4, 4; times 2 4, 4; times the gradient 4, 4), the sum of the two paths (4, 4, 4) and the cast
    // back (4, 1): 4 and 68 in 11 launches. The weight's gradient: a product (1, 1, 1) and a sum (1).
    if (kind == KernelKind::Norm) return {4, 28, 8, "add"};
    if (kind == KernelKind::NormBackward) return {4, 68, 11, "add"};
    if (kind == KernelKind::NormWeight) return {4, 0, 2, "add"};
  }
  if (p == RuntimeProfile::PiperCuda) {
    // Piper's CUDA backend (gpu_runtime/cuda/src/kernels.cu, cuda_model_compute.cpp). RoPE rotates in
    // place a copy of q and of k (cudaMemcpyAsync, then rope_k: read and write each, 4 element passes
    // in 2 launches; with per-head q/k norms the norm's output is rotated instead, counted the same).
    // cross_entropy_k reads each logit row three times (the max, the exp-sum, the gradient) and writes
    // the gradient over the logits, in the storage type, in the forward (4 passes, 1 launch): its
    // backward has no kernel. The rest as fused.
    if (kind == KernelKind::Rope) return {4, 0, 2, "add"};
    if (kind == KernelKind::Loss) return {4, 0, 1, "cross_entropy_fwd_fp32"};
    if (kind == KernelKind::LossBackward) return {0, 0, 1, "cross_entropy_fwd_fp32"};
  }
  switch (kind) {
    // RMSNorm: read x, write y (fused in both: PyTorch's F.rms_norm, and its backward kernel).
    case KernelKind::Norm:
      return {2, 0, 1, "rmsnorm"};
    case KernelKind::NormBackward:
      return {3, 0, 1, "rmsnorm"};
    case KernelKind::NormWeight:
      return {2, 0, 1, "rmsnorm"};
    // SwiGLU: fused reads gate and up and writes one output (3 per output element); eager runs
    // silu (read 1, write 1) then mul (read 2, write 1). Backward: fused reads gate, up and dy and
    // writes both gradients (5); eager: mul's two gradients (read 2, write 1 each) and silu's (3).
    case KernelKind::Activation:
      return eager ? ElementwiseCost{5, 0, 2, "silu_mul"} : ElementwiseCost{3, 0, 1, "silu_mul"};
    case KernelKind::ActivationBackward:
      return eager ? ElementwiseCost{9, 0, 3, "silu_mul"} : ElementwiseCost{5, 0, 1, "silu_mul"};
    case KernelKind::Residual:
      return {3, 0, 1, "add"};
    // RoPE: fused reads and writes q and k once; eager's rotate_half runs x·cos, a negated half, a
    // concatenation, ·sin and the add: 5 kernels, about 9 element passes.
    case KernelKind::Rope:
      return eager ? ElementwiseCost{9, 0, 5, "add"} : ElementwiseCost{2, 0, 1, "add"};
    // Cross-entropy over the head's fp32 logits: fused reads them and writes the fp32 softmax
    // forward, and reads it and writes the logits' gradient backward; eager adds log_softmax's
    // separate pass each way.
    case KernelKind::Loss:
      return eager ? ElementwiseCost{0, 12, 2, "cross_entropy_fwd_fp32"}
                   : ElementwiseCost{0, 8, 1, "cross_entropy_fwd_fp32"};
    case KernelKind::LossBackward:
      return eager ? ElementwiseCost{1, 12, 3, "cross_entropy_fwd_fp32"}
                   : ElementwiseCost{1, 4, 1, "cross_entropy_fwd_fp32"};
    case KernelKind::Embedding:
      return {2, 0, 1, "copy"};
    case KernelKind::EmbeddingBackward:
      return {3, 0, 1, "add"};
    case KernelKind::Permute:
      return {2, 0, 1, "copy"};
    // A runtime's buffer copy (split_with_sizes_copy, _chunk_cat): one launch, its bytes given.
    case KernelKind::Copy:
      return {0, 0, 1, "copy"};
    default:
      return {0, 0, 1, "add"};  // Elementwise: its bytes are given
  }
}

// Standard attention's batched products as cuBLAS runs them (b·heads independent products, each an
// s x s score matrix against s x head_dim operands): forward Q·K^T and P·V; backward dP = dO·V^T,
// dV = P^T·dO, dQ = dS·K, dK = dS^T·Q. Their FLOPs add up to the core's (k.flops).
std::vector<Kernel> standard_attention_products(const Kernel& k) {
  const bool bwd = k.kind == KernelKind::StandardAttentionBackward;
  const std::int64_t S = k.m, qk = k.head_dim, v = k.v_dim, batch = k.batch * k.n;
  const std::vector<std::array<std::int64_t, 3>> shapes =
      bwd ? std::vector<std::array<std::int64_t, 3>>{{S, S, v}, {S, v, S}, {S, qk, S}, {S, qk, S}}
          : std::vector<std::array<std::int64_t, 3>>{{S, S, qk}, {S, v, S}};
  double work = 0;
  for (const auto& sh : shapes) work += 2.0 * static_cast<double>(sh[0] * sh[1]) * static_cast<double>(sh[2] * batch);
  std::vector<Kernel> out;
  for (const auto& sh : shapes) {
    Kernel g;
    g.kind = KernelKind::Gemm;
    g.dtype = k.dtype;
    g.m = sh[0], g.n = sh[1], g.k = sh[2], g.batch = batch;
    const double f = 2.0 * static_cast<double>(sh[0] * sh[1]) * static_cast<double>(sh[2] * batch);
    g.flops = work > 0 ? k.flops * f / work : 0;
    out.push_back(g);
  }
  return out;
}

// The runtime's standard-attention implementation: Megatron-LM's fused scale-mask-softmax under the fused
// profiles, torch ops (softmax, dropout) under the eager ones.
const char* standard_attention_implementation(RuntimeProfile p) {
  return p == RuntimeProfile::Fused || p == RuntimeProfile::PiperCuda ? "megatron" : "pytorch";
}

}  // namespace

double dtype_peak_ratio(core::Precision p) {
  switch (p) {
    case core::Precision::FP32:
      return 1.0 / 16;
    case core::Precision::TF32:
      return 0.5;
    case core::Precision::FP8:
      return 2.0;
    default:
      return 1.0;
  }
}

double causal_attention_flops(const Kernel& k) {
  const double s = static_cast<double>(k.m), w = static_cast<double>(k.window);
  // Query-key pairs under the causal mask, times 2: s² in all, 2·s·w - w² within a sliding window.
  const double pairs2 = k.window > 0 && w < s ? 2 * s * w - w * w : s * s;
  return static_cast<double>(k.batch) * static_cast<double>(k.n) * pairs2 * static_cast<double>(k.head_dim + k.v_dim) *
         (k.kind == KernelKind::AttentionBackward ? 2.5 : 1.0);
}

double KernelTiming::seconds(const Kernel& k) const {
  const double launch = launch_floor();
  // Without a table: GEMMs at the GPU's curve-free efficiency of its dense bf16 peak, scaled by the
  // datasheet ratio of the dtype's peak on A100 and H100 (fp32 on the CUDA cores 1/16, tf32 1/2, fp8
  // 2x); element-wise work at the HBM peak (what the FLOP roofline assumed; no measurement says more).
  const double f = k.flops > 0 ? k.flops : 1;
  const double curve = half_efficiency_flops > 0 ? f / (f + half_efficiency_flops) : 1;
  const double fallback_rate = peak_flops * fallback_efficiency * curve * dtype_peak_ratio(k.dtype);
  if (k.kind == KernelKind::Gemm) {
    const double mm = static_cast<double>(k.m), nn = static_cast<double>(k.n), kk = static_cast<double>(k.k);
    const double b = static_cast<double>(k.batch);
    double rate = table ? table->gemm_rate(core::to_string(k.dtype), k.m, k.n, k.k, k.batch) : 0;
    if (rate <= 0) rate = fallback_rate;
    const double compute = 2 * mm * nn * kk * b / rate;
    const double memory = bytes(k) / hbm_bytes_per_s;
    // A GEMM whose rounded shape differs from its exact FLOPs (k / tp not whole) is scaled to them.
    const double exact = k.flops > 0 ? k.flops / (2 * mm * nn * kk * b) : 1;
    return std::max(compute * exact, memory) + launch;
  }
  if (k.kind == KernelKind::AttentionForward || k.kind == KernelKind::AttentionBackward) {
    const bool bwd = k.kind == KernelKind::AttentionBackward;
    const double rate = table ? table->attention_rate(bwd, k.batch, k.m, k.n, std::max(k.head_dim, k.v_dim)) : 0;
    if (rate <= 0) return k.flops / fallback_rate + launch;  // no table: Piper's full-matrix FLOPs at GEMM speed
    return causal_attention_flops(k) / (rate * (bwd ? attention_kernel.bwd_scale : attention_kernel.fwd_scale)) +
           launch;
  }
  if (core::is_standard_attention(k.kind)) {
    // Measured as a whole where the table has it (memory-bound on the scores: their bytes scale with the
    // dtype's), never faster than its products' FLOPs at the GEMM rate of the score-producing shape;
    // otherwise its products as GEMMs and its score traffic as an element-wise kernel.
    const double S = static_cast<double>(k.m), scores = static_cast<double>(k.batch * k.n) * S * S;
    const double per =
        table ? table->standard_attention_seconds_per_score(k.kind == KernelKind::StandardAttentionBackward, k.dropout,
                                                            standard_attention_implementation(profile), scores)
              : 0;
    if (per > 0) {
      double rate = table->gemm_rate(core::to_string(k.dtype), k.m, k.m, k.head_dim, k.batch * k.n);
      if (rate <= 0) rate = fallback_rate;
      return std::max(per * scores * core::bytes_per_element(k.dtype) / 2, k.flops / rate) + launch;
    }
    double total = 0;
    for (const Kernel& g : standard_attention_products(k)) total += seconds(g);
    Kernel traffic;
    traffic.kind = KernelKind::Elementwise;
    traffic.bytes = k.bytes;
    return total + seconds(traffic);
  }
  const ElementwiseCost c = elementwise_cost(k.kind, profile);
  const double moved = bytes(k);
  if (moved <= 0) return 0;
  double rate = table ? table->memory_rate(c.table_kernel, moved / c.launches) : 0;
  if (rate <= 0) rate = hbm_bytes_per_s;  // no measurement: the HBM peak, as the roofline costs it
  return moved / rate + c.launches * launch;
}

double KernelTiming::launch_seconds(const Kernel& k) const {
  const double launch = launch_floor();
  if (k.kind == KernelKind::Gemm || k.kind == KernelKind::AttentionForward || k.kind == KernelKind::AttentionBackward)
    return launch;
  if (core::is_standard_attention(k.kind)) {
    const bool measured = table && !table->standard_attention.empty();
    // Measured: one launch's floor; otherwise the products' and the element-wise kernel's.
    return measured ? launch : static_cast<double>(standard_attention_products(k).size() + 1) * launch;
  }
  return bytes(k) > 0 ? elementwise_cost(k.kind, profile).launches * launch : 0;
}

double KernelTiming::bytes(const Kernel& k) const {
  const double dt = core::bytes_per_element(k.dtype);
  if (k.kind == KernelKind::Gemm) {
    // Read A and B, write C once; k.bytes: what the epilogue moves beyond that (a fused gradient accumulation).
    const double mm = static_cast<double>(k.m), nn = static_cast<double>(k.n), kk = static_cast<double>(k.k);
    return (mm * kk + kk * nn + mm * nn) * static_cast<double>(k.batch) * dt + static_cast<double>(k.bytes);
  }
  if (k.kind == KernelKind::AttentionForward || k.kind == KernelKind::AttentionBackward) return 0;
  if (core::is_standard_attention(k.kind)) {
    double moved = static_cast<double>(k.bytes);  // the score traffic, then the products' operands and results
    for (const Kernel& g : standard_attention_products(k)) moved += bytes(g);
    return moved;
  }
  if (k.kind == KernelKind::Elementwise || k.kind == KernelKind::Copy) return static_cast<double>(k.bytes);
  const ElementwiseCost c = elementwise_cost(k.kind, profile);
  return static_cast<double>(k.elems) * (c.bytes_per_elem * dt + c.fp32_bytes_per_elem);
}

}  // namespace piper::sim
