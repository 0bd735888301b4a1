// The model: a sequence of layers with annotation tags and per-microbatch costs, plus the model zoo,
// JSON spec files, Hugging Face config import, and the RAII builder that mirrors piper.annotate.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace piper::core {

// Tag stack of a layer or DAG node: {"PP": 2, "EP": 5, "MB": 3}. Ordered map so printing is stable.
using TagMap = std::map<std::string, int>;

// Training precision. BF16/FP16: mixed precision (half-precision weights, activations and GEMMs,
// fp32 master weights and moments). FP32: everything fp32, GEMMs on the CUDA cores. TF32: fp32
// storage, GEMMs on the tensor cores in TF32. FP8: BF16's storage with e4m3 GEMMs (Transformer
// Engine's recipe), which also keeps a 1-byte fp8 copy of each weight of its fp8 GEMMs (the linear
// layers of the transformer blocks; Costs::gemm_weight_params).
enum class Precision { BF16, FP16, FP32, TF32, FP8 };
int bytes_per_element(Precision p);  // storage: 2, 2, 4, 4, 2
std::string to_string(Precision p);  // "bf16", "fp16", "fp32", "tf32", "fp8"
bool fp32_storage(Precision p);      // FP32, TF32: no separate master weights

// How gradients accumulate over a step's microbatches (TrainingShape::grad_accumulation).
enum class GradAccumulation { Auto, Fused, Separate };
std::string to_string(GradAccumulation g);
// "fused" or "separate" (the model spec's and the Program's "main_grad_accumulation"); nullopt otherwise.
std::optional<GradAccumulation> grad_accumulation_from_string(const std::string& s);

// What a training step looks like: it scales every cost.
struct TrainingShape {
  std::int64_t seq_len = 4096;
  std::int64_t micro_batch_size = 1;  // sequences per microbatch
  Precision precision = Precision::BF16;
  // Megatron-LM's mixed-precision recipe: gradients accumulate in an fp32 `main_grad` buffer (its
  // default with bf16: "bfloat16 requires gradient accumulation and all-reduce to be done in
  // fp32", megatron/arguments.py), which the weight-gradient GEMMs read and write every microbatch
  // (gradient_accumulation_fusion), the data-parallel reduction sends, and the optimizer reads; the
  // optimizer then copies its fp32 main parameters to the bf16 model parameters. False: gradients
  // in the training precision (the ZeRO paper's 2 + 2 + 12 bytes per parameter).
  bool fp32_main_grads = false;
  // How each microbatch's weight gradients join the ones already held ("main_grad_accumulation"):
  //  * Fused: the weight-gradient GEMM's epilogue reads and writes the held gradient every microbatch
  //    (Megatron-LM's gradient_accumulation_fusion into its main_grad buffer): 2 x 4 bytes a parameter
  //    with fp32 main grads, 2 x 2 in bf16/fp16;
  //  * Separate: their own kernels. With fp32 main grads, DeepSpeed's BF16_Optimizer, which zeroes the
  //    bf16 gradients before each microbatch's backward and adds them into the fp32 ones after it
  //    (clear_lp_grads: write 2; hp_grad.add_(lp.grad.to(fp32)): read 2, write 4, read 4 + 4, write 4:
  //    20 bytes a parameter, every microbatch). In the training precision, PyTorch autograd's
  //    AccumulateGrad: the first backward of a step keeps its new gradient, each later one adds into
  //    it in place (read 2 + 2, write 2: 6 bytes a parameter for bf16/fp16), wherever whole gradients
  //    persist across microbatches (ZeRO-0/1, ZeRO-2/3 reducing once per step);
  //  * Auto (the field omitted): Fused with fp32 main grads (Megatron-LM's default), Separate without
  //    (PyTorch's autograd, DDP and FSDP).
  GradAccumulation grad_accumulation = GradAccumulation::Auto;
  bool separate_grad_accumulation() const {
    return grad_accumulation == GradAccumulation::Separate ||
           (grad_accumulation == GradAccumulation::Auto && !fp32_main_grads);
  }
  std::int64_t tokens_per_microbatch() const { return seq_len * micro_batch_size; }
};
// Bytes per element of the gradient buffer: 4 with fp32 main grads, else the training precision's.
int gradient_bytes_per_element(const TrainingShape& t);

enum class LayerKind { Embedding, Norm, Attention, Mlp, MoeRouter, MoeExperts, Head };
std::string to_string(LayerKind k);

enum class MlpActivation { SwiGLU, GELU };
enum class NormKind { RMSNorm, LayerNorm };
// How the attention core runs: Flash (fused; keeps only q, k, v, the output and softmax statistics)
// or Standard (Megatron-LM 2022: the s x s scores, softmax output, dropout mask and dropout output
// are materialised and stored for backward, as Korthikanti et al. 2022 count them).
enum class AttentionKernel { Flash, Standard };

// Per-microbatch costs of one layer (or one DAG segment: costs add). FLOPs count a multiply-add as 2.
struct Costs {
  std::int64_t params = 0;                 // parameter count held by the layer
  std::int64_t param_bytes = 0;            // params * bytes of the training precision
  double forward_flops = 0;                // F
  double backward_input_flops = 0;         // BI: gradient w.r.t. the layer input
  double backward_weight_flops = 0;        // BW: gradient w.r.t. the weights
  std::int64_t activation_bytes = 0;       // kept from F until B (or BW) for the backward pass
  std::int64_t output_bytes = 0;           // the tensor passed to the next layer
  std::int64_t forward_memory_bytes = 0;   // HBM traffic of F (reads + writes), for memory-bound ops
  std::int64_t backward_memory_bytes = 0;  // HBM traffic of B
  // Memory-bound element-wise kernels (norms, softmax, dropout, activation, residual) of layers whose
  // model counts them separately (standard attention): they run between the GEMMs, so the simulator
  // adds their time to the roofline instead of hiding it under it. Zero for the other models.
  std::int64_t forward_elementwise_bytes = 0;
  std::int64_t backward_elementwise_bytes = 0;
  // Tensor-parallel collectives inside the layer (ParallelLayout::tp > 1), in all-gather units (see
  // core::Op::tp_bytes): forward, and backward (all in the input-gradient half).
  std::int64_t forward_tp_bytes = 0, backward_tp_bytes = 0;
  int forward_tp_collectives = 0, backward_tp_collectives = 0;
  // Context-parallel communication inside the layer (ParallelLayout::cp > 1, see core::Op::cp_bytes):
  // bytes one device sends (ring) or the collectives' full-tensor bytes (all-gather variant), and the
  // ring steps or collective calls. Backward: all in the input-gradient half.
  std::int64_t forward_cp_bytes = 0, backward_cp_bytes = 0;
  int forward_cp_steps = 0, backward_cp_steps = 0;
  double recompute_flops = 0;  // forward FLOPs redone in the backward (inside backward_input_flops)
  // Matrix-multiply kernels launched per pass (Megatron layout: fused QKV, output projection, fc1
  // with SwiGLU's gate and up fused, fc2, the attention core's batched GEMMs or one fused flash
  // kernel, router, head; a backward GEMM is one input-gradient and one weight-gradient kernel).
  // The simulator applies its GEMM efficiency curve per kernel instead of per op (cluster.hpp).
  // Zero: unknown (the op counts as one kernel). Not divided by TP: a split GEMM is still a kernel.
  int forward_gemm_kernels = 0, backward_input_gemm_kernels = 0, backward_weight_gemm_kernels = 0;
  // Of `params`, the weights of the GEMMs Transformer Engine runs in fp8 (precision fp8): the linear
  // layers inside the transformer blocks (attention projections, MLP fc1/fc2, routed experts).
  // Embedding, LM head, norms, biases and the MoE router stay bf16. Lowering gives these, and only
  // these, a 1-byte fp8 copy under fp8 training. Divided under TP and expert sharding like params.
  std::int64_t gemm_weight_params = 0;
  double backward_flops() const { return backward_input_flops + backward_weight_flops; }
  Costs& operator+=(const Costs& o);
};

// Shape parameters of one layer; only the fields of its kind are meaningful.
struct LayerShape {
  std::int64_t vocab = 0, hidden = 0;
  std::int64_t heads = 0, kv_heads = 0, head_dim = 0;
  // Multi-head latent attention (DeepSeek-V3); zero when the attention is plain MHA/GQA.
  std::int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool qk_norm = false;   // Qwen3's per-head RMSNorm on q and k
  bool bias = false;      // GPT-3 style biases on linear layers
  bool qkv_bias = false;  // Qwen2 style: biases on the q, k and v projections only
  // Sliding-window attention (Mistral, Gemma's local layers): each query attends to at most this
  // many keys, so the flash kernel's work scales with min(s, window) per query. 0 = full attention.
  std::int64_t window = 0;
  std::int64_t ffn = 0;  // dense MLP / expert / shared-expert hidden size
  MlpActivation activation = MlpActivation::SwiGLU;
  NormKind norm = NormKind::RMSNorm;
  std::int64_t experts = 0, top_k = 0;  // MoE router / routed experts
  // Node-limited routing (DeepSeek-V2/V3): experts in routing_groups groups, each token's top_k drawn
  // from at most routing_group_limit of them. 0 = unrestricted.
  std::int64_t routing_groups = 0, routing_group_limit = 0;
  std::int64_t max_positions = 0;    // learned position embedding rows (GPT-3); 0 = RoPE
  bool tied_with_embedding = false;  // head shares the embedding matrix (no own params)
  AttentionKernel attention_kernel = AttentionKernel::Flash;
  bool dropout = false;  // dropout layers present (their 1-byte masks are kept)
};

struct Layer {
  std::string name;  // "layers.3.attn"
  LayerKind kind;
  LayerShape shape;
  TagMap tags;     // annotation tags, e.g. {PP:1} or {PP:1, EP:3}
  int block = -1;  // transformer block index, -1 for embedding / final norm / head
};

// The vocabulary a vocabulary-parallel embedding or head holds under TP degree t: padded up to a
// multiple of t, so each rank holds ceil(V / t) rows (Megatron-LM pads so, and further to a multiple of
// 128·t by default (--make-vocab-size-divisible-by): a spec states that padded vocabulary itself).
constexpr std::int64_t tp_padded_vocab(std::int64_t vocab, int tp) {
  const std::int64_t t = tp > 1 ? tp : 1;
  return (vocab + t - 1) / t * t;
}

// Costs of one layer for a training shape. The formulas live in model_costs.cpp with their sources.
Costs layer_costs(const Layer& layer, const TrainingShape& shape);

// How a layer is parallelised and recomputed inside one device (Megatron layout, see ARCHITECTURE.md).
struct ParallelLayout {
  int tp = 1;  // tensor-parallel degree
  bool sequence_parallel = false;
  int recompute = 0;  // 0 none, 1 selective, 2 full, 3 op (core::Recompute's order)
  // Context parallelism (Megatron): each device holds seq_len / cp tokens of every sequence (2 of the
  // 2·cp load-balanced causal chunks); attention exchanges K/V over the CP group, by a ring
  // (cp_all_gather false) or an all-gather + reduce-scatter of dK/dV.
  int cp = 1;
  bool cp_all_gather = false;
  // Routed experts only: their input is the 1/token_split sequence slice of the stage's TP group (its
  // sequence parallelism), and `tp` is the expert-tensor-parallel degree (ETP: fc1 column-, fc2
  // row-parallel; the ETP group all-gathers the routed rows before fc1 and reduce-scatters after fc2).
  int token_split = 1;
};
// Per-device costs of one layer under a layout: FLOPs, parameters and traffic of the split GEMMs
// divided by tp, TP collectives counted, activation bytes as Korthikanti et al. 2022 Table 2, and
// the recomputed forward work added to the backward (input-gradient) pass. layout {1,false,0} gives
// exactly layer_costs(layer, shape). With cp > 1 every per-token quantity is that of the seq_len / cp
// local tokens, and the attention core does 1/cp of the whole sequence's work (the causal load balance;
// context_parallel_costs in model_costs.cpp).
Costs layer_costs(const Layer& layer, const TrainingShape& shape, const ParallelLayout& layout);
// Standard attention's element-wise traffic over its `scores` (b·heads·s²) score elements, in `dt` bytes
// an element (model_costs.cpp): forward the fused scale-mask-softmax, the attention dropout and the
// write of QK^T's epilogue; backward the softmax and dropout gradients and the write of dP's epilogue.
std::int64_t standard_score_bytes(const LayerShape& sh, std::int64_t scores, std::int64_t dt, bool backward);
// The shape one device of a context-parallel group of `cp` sees: seq_len / cp tokens per sequence.
TrainingShape context_parallel_local_shape(const TrainingShape& shape, int cp);
// Op-level recomputation (Recompute::Op): the (K, N) of the layer's matmuls, in the block's order,
// whose outputs are kept (`kept`) or recomputed in the backward (every other one: the 1st, 3rd, ...
// kept; model_costs.cpp).
std::vector<std::pair<std::int64_t, std::int64_t>> op_recompute_matmuls(const Layer& layer, bool kept);

// Architecture hyper-parameters, as in a model spec file.
struct ModelConfig {
  std::string name;
  std::int64_t vocab = 0, hidden = 0, layers = 0;
  std::int64_t heads = 0, kv_heads = 0, head_dim = 0;
  std::int64_t ffn = 0;  // dense MLP hidden size
  MlpActivation activation = MlpActivation::SwiGLU;
  NormKind norm = NormKind::RMSNorm;
  bool qk_norm = false, bias = false, tie_embeddings = false;
  bool qkv_bias = false;  // biases on q, k, v only (Qwen2); `bias` covers every linear layer
  std::int64_t max_positions = 0;
  // Sliding-window attention (spec "sliding_window": {"window": W, "global_every": p}): block i
  // attends within W keys unless p > 0 and (i + 1) % p == 0 (a full-attention block: Gemma 2 has
  // p = 2, Gemma 3 p = 6). window 0 = full attention everywhere.
  std::int64_t sliding_window = 0, global_every = 0;
  bool block_uses_window(std::int64_t block) const {
    return sliding_window > 0 && !(global_every > 0 && (block + 1) % global_every == 0);
  }
  AttentionKernel attention_kernel = AttentionKernel::Flash;  // spec "attention": "flash" | "standard"
  bool dropout = false;                                       // spec "dropout": probability > 0
  double dropout_probability = 0;
  // MoE: experts > 0 turns blocks (from first_dense_layers on) into MoE blocks.
  std::int64_t experts = 0, top_k = 0, expert_ffn = 0;
  std::int64_t shared_experts = 0, shared_expert_ffn = 0;
  std::int64_t first_dense_layers = 0;
  // Node-limited routing (spec moe.routing_groups / moe.routing_group_limit; Hugging Face n_group /
  // topk_group): the experts form routing_groups equal groups and each token's top_k experts come
  // from at most routing_group_limit of them. 0 = unrestricted routing.
  std::int64_t routing_groups = 0, routing_group_limit = 0;
  // MLA attention (0 = off).
  std::int64_t q_lora_rank = 0, kv_lora_rank = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  TrainingShape training;
};

class Model {
 public:
  Model() = default;
  Model(std::string name, std::vector<Layer> layers, TrainingShape training);

  const std::string& name() const { return name_; }
  const std::vector<Layer>& layers() const { return layers_; }
  std::vector<Layer>& mutable_layers() { return layers_; }
  const TrainingShape& training() const { return training_; }
  void set_training(const TrainingShape& t) { training_ = t; }

  // The architecture this model was built from (build_model sets it; builder models have none).
  const std::optional<ModelConfig>& config() const { return config_; }
  void set_config(const ModelConfig& c) { config_ = c; }

  Costs layer_cost(std::size_t i) const { return layer_costs(layers_.at(i), training_); }
  std::int64_t parameter_count() const;
  // Number of PP regions annotated (max PP index + 1), 0 when no layer has a PP tag.
  int pp_regions() const;

 private:
  std::string name_;
  std::vector<Layer> layers_;
  TrainingShape training_;
  std::optional<ModelConfig> config_;
};

// Build the layer list of a transformer from its config (no PP tags; experts tagged EP per block).
Model build_model(const ModelConfig& config);

// Zoo: qwen3-9m, qwen3-1b, qwen3-9b, qwen3-30b-a3b, llama3-8b, llama3-70b, gpt3-175b, deepseek-v3.
std::vector<std::string> zoo_names();
std::optional<ModelConfig> zoo_config(const std::string& name);

// Parse our model spec JSON ({"name":..., "hidden":..., ...}); `where` prefixes errors (file name).
ModelConfig config_from_spec_json(const nlohmann::json& j, const std::string& where);
// Parse a Hugging Face config.json: Llama 1-3.x, Mistral, Mixtral, Qwen2/2.5, Qwen3, Qwen3-MoE,
// DeepSeek-V2/V3, Gemma 1/2/3 (text), Phi-3, GPT-2, GPT-NeoX. What cannot be modelled is refused
// with a one-line ModelError naming the field. Fields that matter to cost but are not modelled are
// listed in `unmodelled` when given; otherwise one line goes to stderr
// ("piper: warning: <where>: fields not modelled: a, b"). Fields irrelevant to cost (token ids,
// dtype, norm epsilons, RoPE bases, ...) are accepted silently.
ModelConfig config_from_hf_json(const nlohmann::json& j, const std::string& where,
                                std::vector<std::string>* unmodelled = nullptr);
nlohmann::json config_to_spec_json(const ModelConfig& c);

// Resolve --model: zoo name, path to a spec JSON, or path to an HF config.json (detected by its
// "architectures" or "model_type" key). Throws ModelError with a one-line message.
ModelConfig load_model_config(const std::string& name_or_path);
// A model file's text (what load_model_config reads): an HF config.json or a model spec.
ModelConfig config_from_text(const std::string& text, const std::string& where);

// Ends of the model that form PP regions of their own (V placements, docs/schedules.md): the
// embedding (the layers before the first block) as region 0, the final norm + head + loss (the
// layers after the last block) as the last region. By default they join the first and last block.
struct PipelineEnds {
  bool embedding = false;
  bool head = false;
  friend bool operator==(const PipelineEnds&, const PipelineEnds&) = default;
};

// Annotate PP regions automatically: `stages` contiguous regions balanced by per-layer compute
// cost (F+B FLOPs), embedding on the first, final norm + head on the last (each a region of its own
// with `ends`; ModelError when the model has no such layers). Replaces existing PP tags.
void balance_pipeline(Model& model, int stages, PipelineEnds ends = {});
// Explicit PP annotation: region r spans blocks [starts[r], starts[r+1]); embedding goes with 0 and
// the final norm and head with the last region.
void annotate_pipeline_ranges(Model& model, const std::vector<int>& block_starts);
// After balancing: when several regions share a device (V placements, DualPipe's mirrored pairs),
// moves region boundaries block by block to minimise the busiest device's load (then the next
// busiest, ...). devices_of_region[r] lists the devices that run region r. Never makes it worse.
// Regions of their own (`ends`) keep their boundaries.
void rebalance_for_devices(Model& model, const std::vector<std::vector<int>>& devices_of_region,
                           PipelineEnds ends = {});

// C++ builder with RAII annotation scopes, mirroring `with piper.annotate("PP"):`.
//   ModelBuilder b("tiny", shape);
//   { auto pp = b.annotate("PP"); b.add(...); }   // layers get PP:0
//   { auto pp = b.annotate("PP"); b.add(...); }   // layers get PP:1
class ModelBuilder {
 public:
  class Scope {
   public:
    Scope(Scope&& o) noexcept : builder_(o.builder_), tag_(std::move(o.tag_)) { o.builder_ = nullptr; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    Scope& operator=(Scope&&) = delete;
    ~Scope();
    int index() const;

   private:
    friend class ModelBuilder;
    Scope(ModelBuilder* b, std::string tag) : builder_(b), tag_(std::move(tag)) {}
    ModelBuilder* builder_;
    std::string tag_;
  };

  ModelBuilder(std::string name, TrainingShape training) : name_(std::move(name)), training_(training) {}
  [[nodiscard]] Scope annotate(const std::string& tag);
  // Adds a layer carrying the currently open annotation scopes.
  ModelBuilder& add(Layer layer);
  Model build() const;

 private:
  std::string name_;
  TrainingShape training_;
  std::vector<Layer> layers_;
  std::map<std::string, int> next_index_;
  TagMap open_;
};

}  // namespace piper::core
