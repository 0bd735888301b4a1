// Kernels: what a runtime launches for one layer's pass (GEMMs with their shapes, the attention core,
// memory-bound element-wise work), per device and per microbatch. Lowering lists them per segment
// (ProgramSegment::kernels); the simulator's per-kernel cost model times each against the GPU's
// efficiency table (sim/kernel_table.hpp). FLOPs follow core::Costs' conventions exactly, so the
// kernels of a pass add up to the FLOPs of the op that runs it (a test checks this for every model).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "piper/core/model.hpp"
#include "piper/core/program_types.hpp"

namespace piper::core {

enum class KernelKind : std::uint8_t {
  Gemm,              // C[m x n] = A[m x k] B[k x n], `batch` independent products
  AttentionForward,  // fused (flash) causal attention: batch sequences of m = s tokens, n heads, k KV heads
  AttentionBackward,
  Norm,          // RMSNorm / LayerNorm forward over `elems` elements
  NormBackward,  // input gradient (reads x, dy; writes dx)
  NormWeight,    // gain (and bias) gradient: column sums of x̂·dy
  Activation,    // SwiGLU (silu(gate)·up; elems = outputs) or GELU
  ActivationBackward,
  Residual,  // residual add (forward) / the residual branch's gradient add (backward)
  Rope,      // rotary embedding of q and k (elems = q and k elements); the backward is the same
  Loss,      // softmax cross-entropy over fp32 logits (elems = tokens x vocabulary)
  LossBackward,
  Embedding,          // row gather (elems = tokens x hidden)
  EmbeddingBackward,  // scatter-add of the output gradient into the table
  Permute,            // MoE token permutation for dispatch and combine (elems = routed copies x hidden)
  Elementwise,        // other memory-bound work given by its HBM traffic `bytes` (standard-attention models)
  // A copy (with a dtype cast, if any) of a runtime's own buffers, given by the bytes it reads and writes
  // (`bytes`): the copies a ZeRO runtime makes around its collectives (replicate's collective_copies,
  // docs/cost-model.md "Copies around the ZeRO-3 collectives"), timed at the table's copy rate.
  Copy,
  // Standard (non-flash) attention's core, the s x s score matrix in HBM: forward Q·K^T, the fused
  // scale-mask-softmax, the attention dropout and P·V; backward their gradients (dP, dV, the dropout
  // and softmax gradients, dQ, dK). batch sequences of m = s tokens, n heads, head_dim / v_dim; flops:
  // the batched products'; bytes: the score traffic beyond their operands (core::standard_score_bytes),
  // what the cost model times where its table has no measurement of the whole core.
  StandardAttentionForward,
  StandardAttentionBackward,
};
std::string to_string(KernelKind k);                       // "gemm", "attention_fwd", ...
KernelKind kernel_kind_from_string(const std::string& s);  // throws Error
bool is_elementwise(KernelKind k);                         // every kind but Gemm and the attention cores
bool is_standard_attention(KernelKind k);                  // StandardAttentionForward or -Backward

struct Kernel {
  KernelKind kind = KernelKind::Gemm;
  Precision dtype = Precision::BF16;
  std::int64_t m = 0, n = 0, k = 0;      // GEMM shape; attention: m = s, n = heads, k = KV heads
  std::int64_t batch = 1;                // GEMM: batched products; attention: sequences
  std::int64_t head_dim = 0, v_dim = 0;  // attention: q/k and v head dimensions
  std::int64_t window = 0;               // attention: sliding window (keys per query), 0 = full
  std::int64_t elems = 0;                // element-wise kinds: elements of the kernel's tensor
  std::int64_t bytes = 0;                // Elementwise: its HBM traffic; GEMM: what its epilogue moves beyond
                                         // writing the result once (a fused accumulation into a held gradient);
                                         // standard attention: its score traffic
  bool dropout = false;                  // standard attention: dropout on the probabilities
  double flops = 0;                      // FLOPs of one launch, in core::Costs' convention
  double count = 1;                      // launches in the pass (layers of a segment, local experts)
  friend bool operator==(const Kernel&, const Kernel&) = default;
};

// Kernel lists of a segment per pass, indexed F = 0, BI = 1, BW = 2 (a fused B runs BI then BW).
using PassKernels = std::array<std::vector<Kernel>, 3>;
// The PassKernels lists an op of pass `p` runs, as [first, last]: F {0, 0}, BI {1, 1}, BW {2, 2}, a
// fused B {1, 2}.
inline std::pair<std::size_t, std::size_t> pass_kernel_lists(Pass p) {
  const std::size_t first = p == Pass::F ? 0 : p == Pass::BW ? 2 : 1;
  return {first, p == Pass::B ? 2 : first};
}

// The kernels of one layer in one pass (0 = F, 1 = BI, 2 = BW) under a layout, on one device of a segment
// sharded `shard_degree` ways (routed experts: E / shard_degree local experts). Their FLOPs add up to
// layer_costs(layer, shape, layout)'s FLOPs of that pass.
std::vector<Kernel> layer_kernels(const Layer& layer, const TrainingShape& shape, const ParallelLayout& layout,
                                  int pass, int shard_degree = 1);
// All three passes of layers [first, last), identical launches merged (count added), in run order.
PassKernels segment_kernels(const std::vector<Layer>& layers, int first, int last, const TrainingShape& shape,
                            const ParallelLayout& layout, int shard_degree);
// Sum of flops * count.
double kernel_flops(const std::vector<Kernel>& ks);

nlohmann::json kernels_to_json(const PassKernels& k);
PassKernels kernels_from_json(const nlohmann::json& j, const std::string& where);  // throws PlanError

}  // namespace piper::core
