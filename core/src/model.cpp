// The model layer list, config validation and build_model, the zoo, spec JSON import (Hugging Face:
// hf_import.cpp) and the RAII annotation builder; cost formulas in model_costs.cpp, pipeline-region
// balancing in model_pipeline.cpp.
#include "piper/core/model.hpp"

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <limits>
#include <set>

#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"
#include "piper/core/suggest.hpp"
#include "spec_fields.hpp"

namespace piper::core {

using nlohmann::json;
using spec::field_error;
using spec::FieldReader;
using spec::require_object;
using spec::validate_config;

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

int bytes_per_element(Precision p) {
  switch (p) {
    case Precision::BF16:
      return 2;
    case Precision::FP16:
      return 2;
    case Precision::FP32:
      return 4;
    case Precision::TF32:
      return 4;
    case Precision::FP8:
      return 2;
  }
  return 2;
}

std::string to_string(GradAccumulation g) {
  return g == GradAccumulation::Fused ? "fused" : g == GradAccumulation::Separate ? "separate" : "auto";
}

std::optional<GradAccumulation> grad_accumulation_from_string(const std::string& s) {
  if (s == "fused") return GradAccumulation::Fused;
  if (s == "separate") return GradAccumulation::Separate;
  return std::nullopt;
}

bool fp32_storage(Precision p) { return p == Precision::FP32 || p == Precision::TF32; }

int gradient_bytes_per_element(const TrainingShape& t) {
  return t.fp32_main_grads ? 4 : bytes_per_element(t.precision);
}

std::string to_string(Precision p) {
  switch (p) {
    case Precision::BF16:
      return "bf16";
    case Precision::FP16:
      return "fp16";
    case Precision::FP32:
      return "fp32";
    case Precision::TF32:
      return "tf32";
    case Precision::FP8:
      return "fp8";
  }
  return "?";
}

std::string to_string(LayerKind k) {
  switch (k) {
    case LayerKind::Embedding:
      return "embedding";
    case LayerKind::Norm:
      return "norm";
    case LayerKind::Attention:
      return "attention";
    case LayerKind::Mlp:
      return "mlp";
    case LayerKind::MoeRouter:
      return "moe_router";
    case LayerKind::MoeExperts:
      return "moe_experts";
    case LayerKind::Head:
      return "head";
  }
  return "?";
}

Costs& Costs::operator+=(const Costs& o) {
  params += o.params;
  param_bytes += o.param_bytes;
  gemm_weight_params += o.gemm_weight_params;
  forward_flops += o.forward_flops;
  backward_input_flops += o.backward_input_flops;
  backward_weight_flops += o.backward_weight_flops;
  activation_bytes += o.activation_bytes;
  output_bytes += o.output_bytes;
  forward_memory_bytes += o.forward_memory_bytes;
  backward_memory_bytes += o.backward_memory_bytes;
  forward_elementwise_bytes += o.forward_elementwise_bytes;
  backward_elementwise_bytes += o.backward_elementwise_bytes;
  forward_tp_bytes += o.forward_tp_bytes;
  backward_tp_bytes += o.backward_tp_bytes;
  forward_tp_collectives += o.forward_tp_collectives;
  backward_tp_collectives += o.backward_tp_collectives;
  forward_cp_bytes += o.forward_cp_bytes;
  backward_cp_bytes += o.backward_cp_bytes;
  forward_cp_steps += o.forward_cp_steps;
  backward_cp_steps += o.backward_cp_steps;
  recompute_flops += o.recompute_flops;
  forward_gemm_kernels += o.forward_gemm_kernels;
  backward_input_gemm_kernels += o.backward_input_gemm_kernels;
  backward_weight_gemm_kernels += o.backward_weight_gemm_kernels;
  return *this;
}

// ---------------------------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------------------------

Model::Model(std::string name, std::vector<Layer> layers, TrainingShape training)
    : name_(std::move(name)), layers_(std::move(layers)), training_(training) {}

std::int64_t Model::parameter_count() const {
  std::int64_t n = 0;
  for (const auto& l : layers_) n += layer_costs(l, training_).params;
  return n;
}

int Model::pp_regions() const {
  int regions = 0;
  for (const auto& l : layers_) {
    auto it = l.tags.find("PP");
    if (it != l.tags.end()) regions = std::max(regions, it->second + 1);
  }
  return regions;
}

// ---------------------------------------------------------------------------------------------
// Config validation and build_model
// ---------------------------------------------------------------------------------------------
namespace spec {

namespace {
// A field's name in the front end's file (FieldNames), or the spec's.
struct Namer {
  const FieldNames& names;
  std::string operator()(const char* field) const {
    const auto it = names.find(field);
    return it == names.end() ? field : it->second;
  }
};

// moe.routing_groups must split the experts evenly; the limit lies in [1, groups].
void validate_routing_groups(const ModelConfig& c, const std::string& where, const Namer& n) {
  if (c.routing_groups == 0) {
    if (c.routing_group_limit != 0)
      field_error(where, n("moe.routing_group_limit"),
                  "needs " + n("moe.routing_groups") + " (the number of expert groups)");
    return;
  }
  if (c.routing_groups < 0 || c.experts % c.routing_groups != 0)
    field_error(where, n("moe.routing_groups"),
                "must be a positive integer that divides " + n("moe.experts") + " (" + std::to_string(c.experts) + ")");
  if (c.routing_group_limit < 1 || c.routing_group_limit > c.routing_groups)
    field_error(where, n("moe.routing_group_limit"),
                "must lie between 1 and " + n("moe.routing_groups") + " (" + std::to_string(c.routing_groups) + ")");
}
// Fields within their own limits still multiply: 65,536 experts of width 2^20 in blocks of hidden
// 2^20 overflowed the cost model's int64 byte counts (a negative peak memory, "out of memory: no",
// exit 0). Bounded here in floating point, before any int64 product is formed, from above (what the
// cost model counts is less): one layer's buffers (its parameters' training state at 16 bytes each,
// one microbatch's activations at 4 bytes an element) at 2^53 bytes, a plan's bound on a buffer, and
// the whole model's at 2^62, half of int64.
void validate_products(const ModelConfig& c, const std::string& where, const Namer& n) {
  constexpr double kBuffer = 9007199254740992.0, kModel = 4611686018427387904.0;  // 2^53, 2^62
  auto d = [](std::int64_t v) { return static_cast<double>(v); };
  auto term = [&](const char* field, std::int64_t v) { return fmt::format("{} {}", n(field), v); };
  auto refuse_above = [&](double bytes, double bound, const char* field, const std::string& what,
                          const std::vector<std::string>& factors) {
    if (bytes <= bound) return;
    field_error(where, n(field),
                fmt::format("{} ({}) come to {:.3g} bytes, more than the {} piper counts; make one of them smaller",
                            what, fmt::join(factors, " x "), bytes,
                            bound == kBuffer ? "2^53 bytes of one buffer" : "2^62 bytes of a whole model"));
  };
  const bool mla = c.kv_lora_rank > 0;
  const double h = d(c.hidden), heads = d(c.heads), qk = d(c.head_dim + (mla ? c.qk_rope_head_dim : 0));
  const double v = d(mla ? c.v_head_dim : c.head_dim);
  const double attention = h * heads * (qk + v) + 2 * h * d(c.kv_heads) * d(c.head_dim) +
                           d(c.q_lora_rank) * (h + heads * qk) + d(c.kv_lora_rank) * (h + heads * (qk + v)) +
                           h * d(c.qk_rope_head_dim);
  const double experts = 3 * h * (d(c.experts) * d(c.expert_ffn) + d(c.shared_experts) * d(c.shared_expert_ffn));
  const double dense = 3 * h * d(c.ffn), embedding = d(c.vocab) * h + d(c.max_positions) * h;
  constexpr double kStateBytes = 16, kElementBytes = 4;
  refuse_above(attention * kStateBytes, kBuffer, "heads", "an attention layer's training state",
               {term("heads", c.heads), term("head_dim", c.head_dim), term("hidden", c.hidden), "16 bytes"});
  refuse_above(
      experts * kStateBytes, kBuffer, "moe.experts", "a MoE layer's training state",
      {term("moe.experts", c.experts), term("moe.expert_ffn", c.expert_ffn), term("hidden", c.hidden), "16 bytes"});
  refuse_above(dense * kStateBytes, kBuffer, "ffn", "an MLP's training state",
               {term("ffn", c.ffn), term("hidden", c.hidden), "16 bytes"});
  refuse_above(embedding * kStateBytes, kBuffer, "vocab", "the embedding's training state",
               {term("vocab", c.vocab), term("hidden", c.hidden), "16 bytes"});
  const double block = attention + std::max(dense, experts);
  refuse_above((d(c.layers) * block + 2 * embedding) * kStateBytes, kModel, "layers", "the model's training state",
               {term("layers", c.layers), fmt::format("{:.3g} parameters a block", block), "16 bytes"});
  // One microbatch's activations: every layer's widest tensor, and standard attention's scores.
  const double tokens = d(c.training.seq_len) * d(c.training.micro_batch_size);
  const double widest = std::max({h, heads * (qk + v) + 2 * d(c.kv_heads) * d(c.head_dim), 3 * d(c.ffn),
                                  3 * d(c.top_k) * d(c.expert_ffn), d(c.vocab), d(c.experts)});
  refuse_above(
      tokens * widest * kElementBytes, kBuffer, "training.seq_len", "one microbatch's widest activation",
      {term("training.seq_len", c.training.seq_len), term("training.micro_batch_size", c.training.micro_batch_size),
       fmt::format("width {:.3g}", widest), "4 bytes"});
  if (c.attention_kernel == AttentionKernel::Standard)
    refuse_above(
        d(c.training.micro_batch_size) * heads * d(c.training.seq_len) * d(c.training.seq_len) * 5, kBuffer,
        "training.seq_len", "standard attention's scores",
        {term("training.micro_batch_size", c.training.micro_batch_size), term("heads", c.heads),
         term("training.seq_len", c.training.seq_len), term("training.seq_len", c.training.seq_len), "5 bytes"});
  refuse_above(d(c.layers) * 8 * tokens * widest * kElementBytes, kModel, "layers", "one microbatch's activations",
               {term("layers", c.layers), term("training.seq_len", c.training.seq_len),
                term("training.micro_batch_size", c.training.micro_batch_size), fmt::format("8 x width {:.3g}", widest),
                "4 bytes"});
}

}  // namespace

void validate_config(const ModelConfig& c, const std::string& where, const FieldNames& names) {
  const Namer n{names};
  auto positive = [&](std::int64_t v, const char* field) {
    if (v <= 0) field_error(where, n(field), "must be a positive integer");
  };
  auto non_negative = [&](std::int64_t v, const char* field) {
    if (v < 0) field_error(where, n(field), "must be a non-negative integer");
  };
  positive(c.vocab, "vocab");
  positive(c.hidden, "hidden");
  positive(c.layers, "layers");
  positive(c.heads, "heads");
  positive(c.kv_heads, "kv_heads");
  positive(c.head_dim, "head_dim");
  if (c.heads % c.kv_heads != 0)
    field_error(where, n("kv_heads"), "must divide " + n("heads") + " (" + std::to_string(c.heads) + ")");
  non_negative(c.ffn, "ffn");
  non_negative(c.max_positions, "max_positions");
  non_negative(c.experts, "moe.experts");
  const bool has_dense_block = c.experts == 0 || c.first_dense_layers > 0;
  if (has_dense_block && c.ffn <= 0)
    field_error(where, n("ffn"), "must be a positive integer (the model has dense blocks)");
  if (c.experts > 0) {
    positive(c.top_k, "moe.top_k");
    if (c.top_k > c.experts)
      field_error(where, n("moe.top_k"),
                  "must not exceed " + n("moe.experts") + " (" + std::to_string(c.experts) + ")");
    positive(c.expert_ffn, "moe.expert_ffn");
    non_negative(c.shared_experts, "moe.shared_experts");
    if (c.shared_experts > 0) positive(c.shared_expert_ffn, "moe.shared_expert_ffn");
    non_negative(c.first_dense_layers, "moe.first_dense_layers");
    if (c.first_dense_layers > c.layers)
      field_error(where, n("moe.first_dense_layers"),
                  "must not exceed " + n("layers") + " (" + std::to_string(c.layers) + ")");
    // Every block dense: the MoE fields (and --ep, whose shard directives then match nothing) would be
    // silently ignored.
    if (c.first_dense_layers == c.layers)
      field_error(where, n("moe.first_dense_layers"),
                  "equals " + n("layers") + " (" + std::to_string(c.layers) +
                      "): no block would be a MoE block, so the experts would be ignored");
    validate_routing_groups(c, where, n);
  }
  non_negative(c.kv_lora_rank, "mla.kv_lora_rank");
  non_negative(c.q_lora_rank, "mla.q_lora_rank");
  if (c.kv_lora_rank > 0) {
    positive(c.qk_rope_head_dim, "mla.qk_rope_head_dim");
    positive(c.v_head_dim, "mla.v_head_dim");
  } else if (c.q_lora_rank > 0) {
    field_error(where, n("mla.kv_lora_rank"), "must be positive when mla.q_lora_rank is set");
  }
  non_negative(c.sliding_window, "sliding_window.window");
  non_negative(c.global_every, "sliding_window.global_every");
  if (c.global_every > 0 && c.sliding_window == 0)
    field_error(where, n("sliding_window.global_every"), "needs a positive sliding_window.window");
  positive(c.training.seq_len, "training.seq_len");
  positive(c.training.micro_batch_size, "training.micro_batch_size");
  // Resource limits (limits.hpp): past them the DAG would not fit in memory or the costs (int64
  // bytes) would overflow; checked here so every front end (spec, HF config, flags) is covered.
  auto within = [&](Limit l, std::int64_t v, const char* field, const char* unit) {
    check_limit(l, v, where + ": field '" + n(field) + "'", unit);
  };
  within(Limit::Layers, c.layers, "layers", "layers");
  const std::pair<std::int64_t, const char*> widths[] = {{c.vocab, "vocab"},
                                                         {c.hidden, "hidden"},
                                                         {c.ffn, "ffn"},
                                                         {c.heads, "heads"},
                                                         {c.kv_heads, "kv_heads"},
                                                         {c.head_dim, "head_dim"},
                                                         {c.max_positions, "max_positions"},
                                                         {c.expert_ffn, "moe.expert_ffn"},
                                                         {c.shared_expert_ffn, "moe.shared_expert_ffn"},
                                                         {c.q_lora_rank, "mla.q_lora_rank"},
                                                         {c.kv_lora_rank, "mla.kv_lora_rank"},
                                                         {c.qk_rope_head_dim, "mla.qk_rope_head_dim"},
                                                         {c.v_head_dim, "mla.v_head_dim"}};
  for (const auto& [value, field] : widths) within(Limit::ModelWidth, value, field, "");
  within(Limit::Experts, c.experts, "moe.experts", "experts");
  within(Limit::Experts, c.shared_experts, "moe.shared_experts", "shared experts");
  within(Limit::TokensPerMicrobatch, c.training.seq_len, "training.seq_len", "tokens");
  within(Limit::TokensPerMicrobatch, c.training.micro_batch_size, "training.micro_batch_size", "sequences");
  within(Limit::TokensPerMicrobatch, c.training.seq_len * c.training.micro_batch_size, "training",
         "tokens per microbatch");
  validate_products(c, where, n);
  // Learned absolute positions (GPT) have one row per position: a longer sequence has none to read.
  if (c.max_positions > 0 && c.training.seq_len > c.max_positions)
    field_error(where, n("training.seq_len"),
                std::to_string(c.training.seq_len) + " exceeds max_positions " + std::to_string(c.max_positions) +
                    " (the model's learned positions)");
}

}  // namespace spec

Model build_model(const ModelConfig& c) {
  validate_config(c, c.name.empty() ? "model" : c.name);
  std::vector<Layer> layers;
  auto add = [&](std::string name, LayerKind kind, LayerShape shape, int block, TagMap tags = {}) {
    layers.push_back(Layer{std::move(name), kind, shape, std::move(tags), block});
  };

  LayerShape norm;
  norm.hidden = c.hidden;
  norm.norm = c.norm;
  norm.attention_kernel = c.attention_kernel;

  LayerShape embed;
  embed.vocab = c.vocab;
  embed.hidden = c.hidden;
  embed.max_positions = c.max_positions;

  LayerShape attn;
  attn.hidden = c.hidden;
  attn.heads = c.heads;
  attn.kv_heads = c.kv_heads;
  attn.head_dim = c.head_dim;
  attn.q_lora_rank = c.q_lora_rank;
  attn.kv_lora_rank = c.kv_lora_rank;
  attn.qk_rope_head_dim = c.qk_rope_head_dim;
  attn.v_head_dim = c.v_head_dim;
  attn.qk_norm = c.qk_norm;
  attn.bias = c.bias;
  attn.qkv_bias = c.qkv_bias;
  attn.attention_kernel = c.attention_kernel;
  attn.dropout = c.dropout;

  auto mlp_shape = [&](std::int64_t ffn) {
    LayerShape m;
    m.hidden = c.hidden;
    m.ffn = ffn;
    m.activation = c.activation;
    m.bias = c.bias;
    m.attention_kernel = c.attention_kernel;
    m.dropout = c.dropout;
    return m;
  };
  LayerShape moe;
  moe.hidden = c.hidden;
  moe.experts = c.experts;
  moe.top_k = c.top_k;
  moe.routing_groups = c.routing_groups;
  moe.routing_group_limit = c.routing_group_limit;
  LayerShape experts = moe;
  experts.ffn = c.expert_ffn;

  add("embed", LayerKind::Embedding, embed, -1);
  int moe_block = 0;
  for (int i = 0; i < static_cast<int>(c.layers); ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    add(p + "attn_norm", LayerKind::Norm, norm, i);
    LayerShape block_attn = attn;
    block_attn.window = c.block_uses_window(i) ? c.sliding_window : 0;
    add(p + "attn", LayerKind::Attention, block_attn, i);
    add(p + "mlp_norm", LayerKind::Norm, norm, i);
    if (c.experts == 0 || i < c.first_dense_layers) {
      add(p + "mlp", LayerKind::Mlp, mlp_shape(c.ffn), i);
    } else {
      // Shared experts see every token, so they are one dense MLP of the summed width.
      if (c.shared_experts > 0)
        add(p + "shared_mlp", LayerKind::Mlp, mlp_shape(c.shared_experts * c.shared_expert_ffn), i);
      add(p + "router", LayerKind::MoeRouter, moe, i);
      add(p + "experts", LayerKind::MoeExperts, experts, i, TagMap{{"EP", moe_block++}});
    }
  }
  add("norm", LayerKind::Norm, norm, -1);
  LayerShape head;
  head.vocab = c.vocab;
  head.hidden = c.hidden;
  head.tied_with_embedding = c.tie_embeddings;
  add("head", LayerKind::Head, head, -1);
  Model model(c.name, std::move(layers), c.training);
  model.set_config(c);
  return model;
}

// ---------------------------------------------------------------------------------------------
// Zoo
// ---------------------------------------------------------------------------------------------
namespace {

ModelConfig qwen3_shape(std::string name, std::int64_t vocab, std::int64_t hidden, std::int64_t layers,
                        std::int64_t heads, std::int64_t kv, std::int64_t head_dim, std::int64_t experts,
                        std::int64_t top_k, std::int64_t expert_ffn) {
  ModelConfig c;
  c.name = std::move(name);
  c.vocab = vocab;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = heads;
  c.kv_heads = kv;
  c.head_dim = head_dim;
  c.qk_norm = true;
  c.experts = experts;
  c.top_k = top_k;
  c.expert_ffn = expert_ffn;
  return c;
}

ModelConfig llama3(std::string name, std::int64_t hidden, std::int64_t layers, std::int64_t heads, std::int64_t ffn) {
  ModelConfig c;
  c.name = std::move(name);
  c.vocab = 128256;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = heads;
  c.kv_heads = 8;
  c.head_dim = 128;
  c.ffn = ffn;
  return c;
}

}  // namespace

std::vector<std::string> zoo_names() {
  return {"qwen3-9m", "qwen3-1b", "qwen3-9b", "qwen3-30b-a3b", "llama3-8b", "llama3-70b", "gpt3-175b", "deepseek-v3"};
}

std::optional<ModelConfig> zoo_config(const std::string& name) {
  if (name == "qwen3-9m") {
    auto c = qwen3_shape(name, 2048, 256, 4, 8, 4, 32, 8, 2, 128);
    c.training.seq_len = 256;  // tiny: CPU tests run it for real
    return c;
  }
  if (name == "qwen3-1b") return qwen3_shape(name, 151936, 1024, 16, 16, 8, 64, 4, 2, 3584);
  if (name == "qwen3-9b") return qwen3_shape(name, 151936, 2048, 24, 32, 8, 64, 8, 2, 7168);
  if (name == "qwen3-30b-a3b") {
    auto c = qwen3_shape(name, 151936, 2048, 48, 32, 4, 128, 128, 8, 768);
    c.ffn = 6144;  // HF intermediate_size; unused since every block is MoE
    return c;
  }
  if (name == "llama3-8b") return llama3(name, 4096, 32, 32, 14336);
  if (name == "llama3-70b") return llama3(name, 8192, 80, 64, 28672);
  if (name == "gpt3-175b") {
    ModelConfig c;
    c.name = name;
    c.vocab = 50257;
    c.hidden = 12288;
    c.layers = 96;
    c.heads = 96;
    c.kv_heads = 96;
    c.head_dim = 128;
    c.ffn = 49152;
    c.activation = MlpActivation::GELU;
    c.norm = NormKind::LayerNorm;
    c.bias = true;
    c.tie_embeddings = true;
    c.max_positions = 2048;
    c.training.seq_len = 2048;
    return c;
  }
  if (name == "deepseek-v3") {
    ModelConfig c;
    c.name = name;
    c.vocab = 129280;
    c.hidden = 7168;
    c.layers = 61;
    c.heads = 128;
    c.kv_heads = 128;
    c.head_dim = 128;  // qk_nope_head_dim
    c.ffn = 18432;
    c.experts = 256;
    c.top_k = 8;
    c.expert_ffn = 2048;
    c.shared_experts = 1;
    c.shared_expert_ffn = 2048;
    c.first_dense_layers = 3;
    c.routing_groups = 8;  // config.json n_group / topk_group: each token reaches at most 4 nodes
    c.routing_group_limit = 4;
    c.q_lora_rank = 1536;
    c.kv_lora_rank = 512;
    c.qk_rope_head_dim = 64;
    c.v_head_dim = 128;
    return c;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// JSON: our spec format and Hugging Face config.json
// ---------------------------------------------------------------------------------------------
namespace {

MlpActivation parse_activation(const FieldReader& r, const std::string& s) {
  if (s == "swiglu") return MlpActivation::SwiGLU;
  if (s == "gelu") return MlpActivation::GELU;
  r.fail("activation", "unknown activation '" + s + "' (expected \"swiglu\" or \"gelu\")");
}
NormKind parse_norm(const FieldReader& r, const std::string& s) {
  if (s == "rmsnorm") return NormKind::RMSNorm;
  if (s == "layernorm") return NormKind::LayerNorm;
  r.fail("norm", "unknown norm '" + s + "' (expected \"rmsnorm\" or \"layernorm\")");
}
Precision parse_precision(const FieldReader& r, const std::string& s) {
  if (s == "bf16") return Precision::BF16;
  if (s == "fp16") return Precision::FP16;
  if (s == "fp32") return Precision::FP32;
  if (s == "tf32") return Precision::TF32;
  if (s == "fp8") return Precision::FP8;
  r.fail("precision", "unknown precision '" + s + "' (expected \"bf16\", \"fp16\", \"fp32\", \"tf32\" or \"fp8\")");
}

}  // namespace

ModelConfig config_from_spec_json(const json& j, const std::string& where) {
  require_object(j, where, "model spec");
  if (const std::string other = wrong_input_kind(j, "a model spec"); !other.empty())
    throw ModelError(where + ": " + other);
  FieldReader r(j, where);
  r.reject_unknown({"name",      "description",    "vocab",         "hidden",        "layers", "heads",
                    "kv_heads",  "head_dim",       "ffn",           "activation",    "norm",   "qk_norm",
                    "bias",      "tie_embeddings", "max_positions", "moe",           "mla",    "training",
                    "attention", "dropout",        "qkv_bias",      "sliding_window"});
  ModelConfig c;
  auto name = r.opt_string("name");
  if (!name || name->empty()) r.fail("name", "missing required field (a non-empty string)");
  // The name is printed in reports, titles and error lines: a newline or NUL in it split them, and a
  // bidirectional override reordered what followed it on the terminal.
  if (!plain_text(*name))
    r.fail("name", fmt::format("'{}': control or bidirectional-override characters are not allowed in a name",
                               printable_text(*name, 80)));
  c.name = *name;
  (void)r.opt_string("description");  // free text, but text: a number there was accepted silently
  c.vocab = r.req_positive("vocab");
  c.hidden = r.req_positive("hidden");
  c.layers = r.req_positive("layers");
  c.heads = r.req_positive("heads");
  c.kv_heads = r.positive_or("kv_heads", c.heads);
  if (!r.has("head_dim") && c.hidden % c.heads != 0)
    r.fail("head_dim", "missing, and hidden is not divisible by heads");
  c.head_dim = r.positive_or("head_dim", c.hidden / c.heads);
  c.ffn = r.non_negative_or("ffn", 0);
  c.activation = parse_activation(r, r.opt_string("activation").value_or("swiglu"));
  c.norm = parse_norm(r, r.opt_string("norm").value_or("rmsnorm"));
  c.qk_norm = r.bool_or("qk_norm", false);
  c.bias = r.bool_or("bias", false);
  c.qkv_bias = r.bool_or("qkv_bias", false);
  c.tie_embeddings = r.bool_or("tie_embeddings", false);
  c.max_positions = r.non_negative_or("max_positions", 0);
  {
    const std::string kernel = r.opt_string("attention").value_or("flash");
    if (kernel == "flash")
      c.attention_kernel = AttentionKernel::Flash;
    else if (kernel == "standard")
      c.attention_kernel = AttentionKernel::Standard;
    else
      r.fail("attention", "must be \"flash\" or \"standard\", got \"" + kernel + "\"");
  }
  if (r.has("dropout")) {
    const json& p = j.at("dropout");
    if (!p.is_number() || p.get<double>() < 0 || p.get<double>() >= 1)
      r.fail("dropout", "must be a probability in [0, 1)");
    c.dropout_probability = p.get<double>();
    c.dropout = c.dropout_probability > 0;
  }
  if (const json* moe = r.opt_object("moe")) {
    FieldReader m(*moe, where, "moe.");
    m.reject_unknown({"experts", "top_k", "expert_ffn", "shared_experts", "shared_expert_ffn", "first_dense_layers",
                      "routing_groups", "routing_group_limit"});
    c.experts = m.req_positive("experts");
    c.top_k = m.req_positive("top_k");
    c.expert_ffn = m.req_positive("expert_ffn");
    c.shared_experts = m.non_negative_or("shared_experts", 0);
    if (c.shared_experts == 0 && m.has("shared_expert_ffn"))
      m.fail("shared_expert_ffn", "needs moe.shared_experts >= 1 (without shared experts it would be ignored)");
    c.shared_expert_ffn = m.positive_or("shared_expert_ffn", c.shared_experts > 0 ? c.expert_ffn : 0);
    c.first_dense_layers = m.non_negative_or("first_dense_layers", 0);
    c.routing_groups = m.non_negative_or("routing_groups", 0);
    c.routing_group_limit = m.non_negative_or("routing_group_limit", c.routing_groups);
  }
  if (const json* sw = r.opt_object("sliding_window")) {
    FieldReader m(*sw, where, "sliding_window.");
    m.reject_unknown({"window", "global_every"});
    c.sliding_window = m.req_positive("window");
    c.global_every = m.non_negative_or("global_every", 0);
  }
  if (const json* mla = r.opt_object("mla")) {
    FieldReader m(*mla, where, "mla.");
    m.reject_unknown({"q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"});
    c.q_lora_rank = m.non_negative_or("q_lora_rank", 0);
    c.kv_lora_rank = m.req_positive("kv_lora_rank");
    c.qk_rope_head_dim = m.req_positive("qk_rope_head_dim");
    c.v_head_dim = m.req_positive("v_head_dim");
  }
  if (const json* tr = r.opt_object("training")) {
    FieldReader t(*tr, where, "training.");
    t.reject_unknown({"seq_len", "micro_batch_size", "precision", "fp32_main_grads", "main_grad_accumulation"});
    c.training.seq_len = t.positive_or("seq_len", c.training.seq_len);
    c.training.micro_batch_size = t.positive_or("micro_batch_size", c.training.micro_batch_size);
    c.training.precision = parse_precision(t, t.opt_string("precision").value_or("bf16"));
    c.training.fp32_main_grads = t.bool_or("fp32_main_grads", false);
    if (const auto mode = t.opt_string("main_grad_accumulation")) {
      const auto parsed = grad_accumulation_from_string(*mode);
      if (!parsed)
        t.fail(
            "main_grad_accumulation",
            "expected \"fused\" (the weight-gradient GEMMs accumulate, Megatron-LM's gradient_accumulation_fusion) or "
            "\"separate\" (their own kernels: PyTorch autograd, DeepSpeed's BF16_Optimizer), got '" +
                *mode + "'");
      c.training.grad_accumulation = *parsed;
    }
  }
  validate_config(c, where);
  return c;
}

json config_to_spec_json(const ModelConfig& c) {
  json j;
  j["name"] = c.name;
  j["vocab"] = c.vocab;
  j["hidden"] = c.hidden;
  j["layers"] = c.layers;
  j["heads"] = c.heads;
  j["kv_heads"] = c.kv_heads;
  j["head_dim"] = c.head_dim;
  j["ffn"] = c.ffn;
  j["activation"] = c.activation == MlpActivation::SwiGLU ? "swiglu" : "gelu";
  j["norm"] = c.norm == NormKind::RMSNorm ? "rmsnorm" : "layernorm";
  j["qk_norm"] = c.qk_norm;
  j["bias"] = c.bias;
  if (c.qkv_bias) j["qkv_bias"] = true;
  j["tie_embeddings"] = c.tie_embeddings;
  j["max_positions"] = c.max_positions;
  if (c.attention_kernel == AttentionKernel::Standard) j["attention"] = "standard";
  if (c.sliding_window > 0) {
    j["sliding_window"] = {{"window", c.sliding_window}};
    if (c.global_every > 0) j["sliding_window"]["global_every"] = c.global_every;
  }
  if (c.dropout) j["dropout"] = c.dropout_probability;
  if (c.experts > 0) {
    j["moe"] = {{"experts", c.experts},
                {"top_k", c.top_k},
                {"expert_ffn", c.expert_ffn},
                {"shared_experts", c.shared_experts},
                {"first_dense_layers", c.first_dense_layers}};
    if (c.shared_experts > 0) j["moe"]["shared_expert_ffn"] = c.shared_expert_ffn;
    if (c.routing_groups > 0) {
      j["moe"]["routing_groups"] = c.routing_groups;
      j["moe"]["routing_group_limit"] = c.routing_group_limit;
    }
  }
  if (c.kv_lora_rank > 0) {
    j["mla"] = {{"q_lora_rank", c.q_lora_rank},
                {"kv_lora_rank", c.kv_lora_rank},
                {"qk_rope_head_dim", c.qk_rope_head_dim},
                {"v_head_dim", c.v_head_dim}};
  }
  j["training"] = {{"seq_len", c.training.seq_len},
                   {"micro_batch_size", c.training.micro_batch_size},
                   {"precision", to_string(c.training.precision)}};
  if (c.training.fp32_main_grads) j["training"]["fp32_main_grads"] = true;
  if (c.training.grad_accumulation != GradAccumulation::Auto)
    j["training"]["main_grad_accumulation"] = to_string(c.training.grad_accumulation);
  return j;
}

ModelConfig load_model_config(const std::string& name_or_path) {
  if (auto z = zoo_config(name_or_path)) return *z;
  std::filesystem::path path(name_or_path);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) path /= "config.json";  // an HF checkpoint folder
  // access(2), not an open: opening a FIFO waits for a writer (read_input_file opens one without waiting).
  if (!std::filesystem::exists(path, ec) || ::access(path.c_str(), R_OK) != 0) {
    std::string names;
    for (const auto& n : zoo_names()) names += (names.empty() ? "" : ", ") + n;
    throw ModelError(name_or_path + ": neither a zoo model (" + names + ") nor a readable file");
  }
  const std::string where = path.string();
  return config_from_text(read_input_file(where), where);
}

ModelConfig config_from_text(const std::string& text, const std::string& where) {
  json j;
  try {
    j = parse_json(text, where);
  } catch (const json::exception& e) {  // also number overflow (out_of_range.406)
    std::string reason = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix; the rest is one readable line.
    if (auto pos = reason.find("] "); pos != std::string::npos) reason = reason.substr(pos + 2);
    throw ModelError(where + ": not JSON: " + reason);
  }
  if (!j.is_object()) throw ModelError(where + ": expected a JSON object");
  if (j.contains("model_type") || j.contains("architectures")) return config_from_hf_json(j, where);
  return config_from_spec_json(j, where);
}

// ---------------------------------------------------------------------------------------------
// ModelBuilder
// ---------------------------------------------------------------------------------------------

ModelBuilder::Scope ModelBuilder::annotate(const std::string& tag) {
  // Same-tag nesting has no meaning (a layer holds one index per tag), so refuse it.
  if (open_.count(tag)) throw ModelError(name_ + ": annotate(\"" + tag + "\"): a scope with this tag is already open");
  open_[tag] = next_index_[tag]++;
  return Scope(this, tag);
}

ModelBuilder::Scope::~Scope() {
  if (builder_) builder_->open_.erase(tag_);
}

int ModelBuilder::Scope::index() const {
  if (!builder_) throw ModelError("annotate(\"" + tag_ + "\"): scope was moved from");
  return builder_->open_.at(tag_);
}

ModelBuilder& ModelBuilder::add(Layer layer) {
  for (const auto& [tag, index] : open_) layer.tags[tag] = index;
  layers_.push_back(std::move(layer));
  return *this;
}

Model ModelBuilder::build() const { return Model(name_, layers_, training_); }

}  // namespace piper::core
