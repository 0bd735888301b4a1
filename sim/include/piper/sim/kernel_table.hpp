// Kernel efficiency tables: the throughput one GPU model achieves per kernel class and shape, measured
// (for the H200, ../shared/measurements/h200/kernels.json by kernels.py) and interpolated. The
// per-kernel cost model (cost_model.hpp) times each core::Kernel of an op against the table of the
// op's GPU. Format and interpolation rules: docs/cost-model.md.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "piper/core/kernels.hpp"

namespace piper::sim {

// Which element-wise kernels a runtime fuses (docs/cost-model.md, "Runtime profiles"): how many
// launches and bytes each element-wise kernel kind costs. Named in the cluster ("runtime").
//  * fused: torch.compile / Megatron-LM's fused kernels (one kernel per kind: RMSNorm, SwiGLU, RoPE,
//    cross-entropy, the residual add) — the default;
//  * eager: PyTorch eager mode, composite ops launched one by one (counted from the eager profile of
//    dense-1b, ../shared/measurements/h200/torch-profile-dense1b.txt);
//  * eager-fused-loss: eager with one fused cross-entropy kernel (flash-attn's CrossEntropyLoss, the
//    default loss of MosaicML llm-foundry's MPT models): the loss as fused, the rest as eager.
//  * eager-unfused-norm: eager with the RMSNorm written in torch ops (TorchTitan's Llama RMSNorm, not
//    F.rms_norm): the norms as the casts, powers, means and products autograd runs.
//  * piper-cuda: Piper's own CUDA backend (gpu_runtime/cuda/src/kernels.cu): fused kernels, but RoPE
//    rotates copies of q and k, and the cross-entropy runs in the storage type, its gradient written in
//    the forward.
enum class RuntimeProfile { Fused, Eager, EagerFusedLoss, EagerUnfusedNorm, PiperCuda };
std::string to_string(RuntimeProfile p);
RuntimeProfile runtime_profile_from_string(const std::string& s);  // throws ClusterError
std::string runtime_profile_names();                               // "fused", "eager", ... for messages
std::vector<std::string> runtime_profiles();                       // the names, in that order

class KernelTable {
 public:
  struct Gemm {
    std::string dtype;  // "bf16", "fp16", "fp32", "tf32", "fp8"
    std::int64_t m = 0, n = 0, k = 0;
    double flops_per_s = 0;
    bool cited = false;  // a published figure ("source"), not a kernels.py measurement or derived from one
  };
  // Causal attention, FLOPs in kernels.py's convention: forward 2·b·heads·s²·d (half the s x s
  // matrix, q·k and p·v), backward 2.5x the forward's FLOPs.
  struct Attention {
    std::int64_t batch = 0, s = 0, heads = 0, kv_heads = 0, head_dim = 0;
    double fwd_flops_per_s = 0, bwd_flops_per_s = 0;
  };
  // Read in bytes moved per launch (a "cross_entropy_fwd_fp32" entry, which kernels.py counts at 6
  // bytes a logit, is converted to the 14 its op moves: kernel_table.cpp).
  struct Memory {
    std::string kernel;  // "add", "rmsnorm", "silu_mul", "copy", "cross_entropy_fwd_fp32"
    double bytes = 0;    // bytes moved by one launch (read + write)
    double bytes_per_s = 0;
  };

  std::string name;  // "h200-sxm" or the file it was read from
  std::vector<Gemm> gemm;
  std::vector<Attention> attention;
  // Other attention implementations than the one `attention` measures, as multipliers of its rates
  // ("attention_kernels": {"fa2": {"fwd_scale": f, "bwd_scale": b, "source" | "derived"}}): a cluster's
  // "attention_kernel" picks one (docs/cost-model.md, "Attention implementations").
  struct AttentionKernel {
    double fwd_scale = 1, bwd_scale = 1;
  };
  std::map<std::string, AttentionKernel> attention_kernels;
  // attention_kernels' entry `name`; std::invalid_argument "kernel table 'T' has no attention kernel
  // 'name' (it has: ...)" where it has none (the cluster loader and the cost model name the field).
  const AttentionKernel& attention_kernel(const std::string& name) const;
  std::vector<Memory> memory;
  // Standard attention's whole core (core::KernelKind::StandardAttention*: the batched products, the
  // softmax and the dropout over the s x s scores) measured by sequence length in a 2-byte dtype:
  // "attention_standard": [{"implementation", "dropout", "b", "heads", "s", "head_dim", "dtype", "fwd_ms",
  // "bwd_ms"}], kept as seconds per score element (b·heads·s²). A table without entries takes the
  // A100-40GB's cited ones scaled by the two tables' copy bandwidth (load_kernel_table; docs/cost-model.md,
  // "Standard attention").
  struct StandardAttention {
    std::string implementation;  // "megatron" (fused scale-mask-softmax) or "pytorch" (torch ops)
    bool dropout = false;
    double scores = 0;  // b·heads·s² of the measurement
    double fwd_s_per_score = 0, bwd_s_per_score = 0;
  };
  std::vector<StandardAttention> standard_attention;
  // Seconds per score element of the standard-attention core (2-byte storage), interpolated in log(scores)
  // over the entries of `implementation` (any implementation's where it has none) with the same dropout
  // (any where none match), clamped to the measured range; 0 without entries.
  double standard_attention_seconds_per_score(bool backward, bool dropout, const std::string& implementation,
                                              double scores) const;
  // Fused multi-tensor AdamW over half-precision (bf16) and fp32 parameters, from the table's largest
  // measured run of each.
  double adamw_bytes_per_s = 0, adamw_fp32_bytes_per_s = 0;
  // Added to every kernel: the GPU-side gap between back-to-back kernels (an assumption of 2 µs until
  // kernels_extra.py measures it; GPUs without a table use the same).
  static constexpr double kDefaultLaunchFloor = 2e-6;
  double launch_floor_s = kDefaultLaunchFloor;
  // kernels.py times one GEMM launch between two CUDA events on an idle GPU, so each measured time
  // includes the CPU's dispatch of the matmul (the GPU waits for it after the first event); in
  // training the CPU runs ahead and it is hidden. "gemm_dispatch_latency": "estimate" (or a number
  // of µs) removes it from every GEMM entry that is not cited: the estimate is the median, over the
  // table's (dtype, K, N) curves, of the time at M = 0 of the line through the two smallest M. A
  // corrected time keeps at least a quarter of the measured one. 0 when the table has no such key.
  double gemm_dispatch_latency_s = 0;

  // Achieved FLOP/s of an m x n x k GEMM (batch: batched products) in `dtype`; 0 when the table has
  // no GEMM data.
  double gemm_rate(const std::string& dtype, std::int64_t m, std::int64_t n, std::int64_t k,
                   std::int64_t batch = 1) const;
  // Achieved FLOP/s (kernels.py convention) of causal attention; 0 without attention data.
  double attention_rate(bool backward, std::int64_t batch, std::int64_t s, std::int64_t heads,
                        std::int64_t head_dim) const;
  // Achieved bytes/s of a memory-bound kernel of `kernel`'s class moving `bytes`; 0 without data.
  double memory_rate(const std::string& kernel, double bytes) const;

  // Reads the format kernels.py writes ({"gemm": [...], "attention": [...], "memory_bound": [...],
  // "adamw": [...]}), optionally with "name", "launch_floor_us", and, for a table derived from
  // another, "base" (a built-in table's name) with "compute_scale" and "memory_scale". Throws
  // ClusterError naming `where` and the field.
  static KernelTable from_json(const nlohmann::json& j, const std::string& where);
};

// Datasheet ratio of a dtype's dense tensor-core peak to bf16's on A100 and H100 (fp32 runs on the CUDA
// cores: 1/16; tf32 1/2; fp8 2; bf16 and fp16 1): what scales a GPU's bf16 peak where no table says.
double dtype_peak_ratio(core::Precision p);
// Causal attention work in kernels.py's convention (what a table's attention rates are measured in):
// forward b·heads·s²·(qk + v), backward 2.5 times that. Piper's own count (Kernel::flops) is the full
// s x s matrix, twice the forward. A sliding-window kernel (Kernel::window = w < s) counts the causal
// band instead: s² becomes 2·s·w - w².
double causal_attention_flops(const core::Kernel& k);

// The bounds of a derived table's rate multipliers ("compute_scale", ..., what `piper calibrate` writes
// as 1 / multiplier): [kMinTableScale, 1 / kMinTableScale].
inline constexpr double kMinTableScale = 1e-3;

// Built-in tables: "h200-sxm" (measured), "h100-sxm" (derived from it: docs/cost-model.md).
std::vector<std::string> kernel_table_names();
// A built-in name or a path to a table file; loaded once and shared (thread-safe). Throws ClusterError.
std::shared_ptr<const KernelTable> load_kernel_table(const std::string& name_or_path);

// Seconds one launch of `k` takes on a GPU with this table under a runtime profile: max(compute,
// memory) plus the launch floor. Without a table (nullptr) or where it lacks a class, the GPU's
// efficiency curve (cluster.hpp: max_efficiency · f / (f + half_efficiency_flops) of the dense bf16
// peak, scaled by the dtype's datasheet ratio) for GEMMs and attention, and the HBM peak bandwidth
// for element-wise kernels.
struct KernelTiming {
  const KernelTable* table = nullptr;
  RuntimeProfile profile = RuntimeProfile::Fused;
  double peak_flops = 0;
  double hbm_bytes_per_s = 0;
  double fallback_efficiency = 0.75;
  double half_efficiency_flops = 0;
  KernelTable::AttentionKernel attention_kernel{};  // the cluster's attention implementation (1, 1: the table's own)
  double seconds(const core::Kernel& k) const;
  // One launch's floor: the table's launch_floor_s, or KernelTable::kDefaultLaunchFloor without a table.
  double launch_floor() const { return table ? table->launch_floor_s : KernelTable::kDefaultLaunchFloor; }
  // The part of seconds(k) that is launch floors (KernelTable::launch_floor_s per launch): what a
  // table's rate scales do not move.
  double launch_seconds(const core::Kernel& k) const;
  // HBM bytes `k` moves as seconds() counts them (GEMM: its operands and result; the flash attention
  // core: 0, it is timed by FLOPs alone; standard attention: its products' and its score traffic).
  double bytes(const core::Kernel& k) const;
};

}  // namespace piper::sim
