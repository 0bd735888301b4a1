// Hugging Face config.json import: the model families Piper models, their fields mapped onto a
// ModelConfig, one warning line for fields it does not model and one-line refusals.
#include <algorithm>
#include <iostream>
#include <mutex>
#include <set>

#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/model.hpp"
#include "spec_fields.hpp"

namespace piper::core {

using nlohmann::json;
using spec::FieldReader;
using spec::require_object;
using spec::validate_config;

namespace {

// A readable model name for an HF config: its _name_or_path, else the file (or its folder for a
// checkpoint's config.json), else the model_type.
std::string hf_model_name(const json& j, const std::string& where, const std::string& model_type) {
  if (j.contains("_name_or_path") && j["_name_or_path"].is_string() && !j["_name_or_path"].get<std::string>().empty())
    return j["_name_or_path"].get<std::string>();
  std::filesystem::path p(where);
  std::string stem = p.stem().string();
  if (stem == "config" && p.has_parent_path()) stem = p.parent_path().filename().string();
  return stem.empty() ? model_type : stem;
}

// The families the importer reads, by model_type, and the architectures that name them.
const std::vector<std::pair<std::string, std::string>>& hf_families() {
  static const std::vector<std::pair<std::string, std::string>> f = {{"llama", "LlamaForCausalLM"},
                                                                     {"mistral", "MistralForCausalLM"},
                                                                     {"mixtral", "MixtralForCausalLM"},
                                                                     {"qwen2", "Qwen2ForCausalLM"},
                                                                     {"qwen3", "Qwen3ForCausalLM"},
                                                                     {"qwen3_moe", "Qwen3MoeForCausalLM"},
                                                                     {"deepseek_v2", "DeepseekV2ForCausalLM"},
                                                                     {"deepseek_v3", "DeepseekV3ForCausalLM"},
                                                                     {"gemma", "GemmaForCausalLM"},
                                                                     {"gemma2", "Gemma2ForCausalLM"},
                                                                     {"gemma3_text", "Gemma3ForCausalLM"},
                                                                     {"phi3", "Phi3ForCausalLM"},
                                                                     {"gpt2", "GPT2LMHeadModel"},
                                                                     {"gpt_neox", "GPTNeoXForCausalLM"}};
  return f;
}

std::string hf_supported_list(bool architectures) {
  std::string s;
  for (const auto& [type, arch] : hf_families()) s += (s.empty() ? "" : ", ") + (architectures ? arch : type);
  return s;
}

// config.json fields that do not change a training step's cost: token ids, dtypes, library
// versions, initialisation, norm epsilons, RoPE bases and scaling (the rotation's element-wise cost
// does not depend on them), logit scales and soft-caps, routing-loss coefficients and score
// functions (balanced routing is assumed), inference-only settings. Accepted silently.
const std::set<std::string>& hf_cost_irrelevant_fields() {
  static const std::set<std::string> s = {"_name_or_path",
                                          "architectures",
                                          "model_type",
                                          "auto_map",
                                          "bos_token_id",
                                          "eos_token_id",
                                          "pad_token_id",
                                          "sep_token_id",
                                          "decoder_start_token_id",
                                          "torch_dtype",
                                          "dtype",
                                          "transformers_version",
                                          "use_cache",
                                          "initializer_range",
                                          "initializer_factor",
                                          "rms_norm_eps",
                                          "layer_norm_eps",
                                          "layer_norm_epsilon",
                                          "rope_theta",
                                          "rope_scaling",
                                          "rope_local_base_freq",
                                          "rotary_emb_base",
                                          "rotary_pct",
                                          "partial_rotary_factor",
                                          "original_max_position_embeddings",
                                          "max_sequence_length",
                                          "pretraining_tp",
                                          "router_aux_loss_coef",
                                          "output_router_logits",
                                          "router_jitter_noise",
                                          "norm_topk_prob",
                                          "scoring_func",
                                          "routed_scaling_factor",
                                          "aux_loss_alpha",
                                          "seq_aux",
                                          "topk_method",
                                          "ep_size",
                                          "query_pre_attn_scalar",
                                          "attn_logit_softcapping",
                                          "final_logit_softcapping",
                                          "cache_implementation",
                                          "use_parallel_residual",
                                          "classifier_dropout",
                                          "summary_type",
                                          "summary_use_proj",
                                          "summary_activation",
                                          "summary_proj_to_labels",
                                          "summary_first_dropout",
                                          "task_specific_params",
                                          "scale_attn_weights",
                                          "scale_attn_by_inverse_layer_idx",
                                          "reorder_and_upcast_attn",
                                          "n_ctx",
                                          "use_mrope",
                                          "id2label",
                                          "label2id",
                                          "tokenizer_class",
                                          "return_dict",
                                          "output_hidden_states",
                                          "output_attentions",
                                          "torchscript",
                                          "use_bfloat16",
                                          "problem_type",
                                          "is_decoder",
                                          "is_encoder_decoder",
                                          "tie_encoder_decoder"};
  return s;
}

std::string hf_model_type(const json& j, const FieldReader& r) {
  if (auto t = r.opt_string("model_type")) return *t;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string()) {
    const std::string a = j["architectures"][0].get<std::string>();
    for (const auto& [type, arch] : hf_families())
      if (arch == a) return type;
    r.fail("architectures", "unsupported architecture '" + a + "' (supported: " + hf_supported_list(true) + ")");
  }
  r.fail("model_type", "missing (and no \"architectures\" to infer it from)");
}

// A dropout probability: a number in [0, 1); absent or null = 0.
double hf_probability(const json& j, const FieldReader& r, const std::string& f) {
  if (!r.has(f)) return 0;
  const json& v = j.at(f);
  if (!v.is_number() || v.get<double>() < 0 || v.get<double>() >= 1) r.fail(f, "must be a probability in [0, 1)");
  return v.get<double>();
}

}  // namespace

// One field after another in the order of a Hugging Face config, each read, checked and mapped where
// it is; splitting it would scatter that mapping.
ModelConfig config_from_hf_json(const json& j, const std::string& where,  // NOLINT(readability-function-size)
                                std::vector<std::string>* unmodelled) {
  require_object(j, where, "Hugging Face config");
  FieldReader r(j, where);
  const std::string type = hf_model_type(j, r);
  if (type == "gemma3")
    r.fail("model_type",
           "'gemma3' is the vision-language model and its SigLIP vision tower is not modelled "
           "(import its text_config, model_type gemma3_text)");
  bool known = false;
  for (const auto& f : hf_families()) known = known || f.first == type;
  if (!known)
    r.fail("model_type", "unsupported model_type '" + type + "' (supported: " + hf_supported_list(false) + ")");
  const bool gpt2 = type == "gpt2", neox = type == "gpt_neox";
  const bool gemma = type == "gemma" || type == "gemma2" || type == "gemma3_text";
  const bool deepseek = type == "deepseek_v2" || type == "deepseek_v3";
  const bool qwen = type == "qwen2" || type == "qwen3" || type == "qwen3_moe";
  std::vector<std::string> not_modelled;  // read, relevant to cost, but not modelled

  ModelConfig c;
  c.name = hf_model_name(j, where, type);
  // GPT-2 names its dimensions after the original TensorFlow code.
  auto key = [&](const char* name, const char* gpt2_name) { return std::string(gpt2 ? gpt2_name : name); };
  c.vocab = r.req_positive("vocab_size");
  c.hidden = r.req_positive(key("hidden_size", "n_embd"));
  c.layers = r.req_positive(key("num_hidden_layers", "n_layer"));
  c.heads = r.req_positive(key("num_attention_heads", "n_head"));
  c.kv_heads = r.positive_or("num_key_value_heads", c.heads);
  if (!r.has("head_dim") && c.hidden % c.heads != 0)
    r.fail("head_dim", "missing, and the hidden size is not divisible by the number of attention heads");
  c.head_dim = r.positive_or("head_dim", c.hidden / c.heads);
  c.ffn = gpt2 ? r.positive_or("n_inner", 4 * c.hidden) : r.req_positive("intermediate_size");

  // Activation. GPT-2 and GPT-NeoX: a plain two-matrix MLP. Every other family: a gated MLP
  // (gate, up, down), whose activation (SiLU: SwiGLU; GELU: Gemma's GeGLU) does not change the
  // three GEMMs or the stored tensors, so all are costed as Piper's gated "swiglu" MLP.
  {
    const std::string act_key =
        gpt2 ? "activation_function" : (gemma && r.has("hidden_activation") ? "hidden_activation" : "hidden_act");
    if (gemma) r.has("hidden_act");  // Gemma configs carry both; hidden_activation wins
    const std::string act = r.opt_string(act_key).value_or(gpt2 ? "gelu_new" : (neox || gemma) ? "gelu" : "silu");
    static const std::set<std::string> gelu = {"gelu",       "gelu_new", "gelu_fast", "gelu_pytorch_tanh",
                                               "quick_gelu", "relu"};
    if (gpt2 || neox) {
      if (!gelu.count(act)) r.fail(act_key, "unsupported activation '" + act + "' (GELU/ReLU MLPs are modelled)");
      c.activation = MlpActivation::GELU;
    } else {
      if (act != "silu" && act != "swish" && !gelu.count(act))
        r.fail(act_key, "unsupported activation '" + act + "' (gated SiLU/GELU MLPs are modelled)");
      c.activation = MlpActivation::SwiGLU;
    }
  }
  c.norm = gpt2 || neox ? NormKind::LayerNorm : NormKind::RMSNorm;

  // Biases. GPT-2: every linear layer. GPT-NeoX: every linear layer (attention_bias may drop the
  // attention's). Qwen2: q, k and v only (hard-wired in its attention). Llama-style families:
  // attention_bias (q, k, v, o) and mlp_bias.
  if (gpt2) {
    c.bias = true;
  } else if (neox) {
    if (!r.bool_or("attention_bias", true))
      r.fail("attention_bias", "false: GPT-NeoX's MLP biases without attention biases are not modelled");
    c.bias = true;
  } else {
    const bool attn_bias = r.bool_or("attention_bias", false), mlp_bias = r.bool_or("mlp_bias", false);
    if (attn_bias != mlp_bias)
      r.fail(attn_bias ? "attention_bias" : "mlp_bias",
             "biases on the attention projections but not the MLP (or the reverse) are not modelled");
    c.bias = attn_bias;
    c.qkv_bias = type == "qwen2" && !c.bias;
  }
  c.tie_embeddings = r.bool_or("tie_word_embeddings", gpt2 || gemma);           // transformers' defaults
  c.qk_norm = type == "qwen3" || type == "qwen3_moe" || type == "gemma3_text";  // q_norm / k_norm

  // Positions: GPT-2 learns n_positions rows; the others are rotary. The training sequence defaults
  // to 4096 tokens, or the model's context if shorter.
  std::int64_t context = 0;
  if (gpt2) {
    c.max_positions = r.positive_or("n_positions", 1024);
    context = c.max_positions;
  } else {
    context = r.positive_or("max_position_embeddings", 0);
  }
  if (context > 0) c.training.seq_len = std::min(c.training.seq_len, context);

  // Dropout: the residual / hidden dropout stores 1-byte masks (Piper's "dropout"). Attention
  // dropout runs inside the flash kernel, which regenerates its mask in the backward: no cost kept.
  double p = 0;
  for (const char* f : {"resid_pdrop", "embd_pdrop", "hidden_dropout", "hidden_dropout_prob"})
    p = std::max(p, hf_probability(j, r, f));
  for (const char* f : {"attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"}) hf_probability(j, r, f);
  if (p > 0) {
    c.dropout = true;
    c.dropout_probability = p;
  }

  if (type == "mixtral") {
    c.experts = r.req_positive("num_local_experts");
    c.top_k = r.req_positive("num_experts_per_tok");
    c.expert_ffn = c.ffn;  // Mixtral's intermediate_size is each expert's
  } else if (type == "qwen3_moe") {
    c.experts = r.req_positive("num_experts");
    c.top_k = r.req_positive("num_experts_per_tok");
    c.expert_ffn = r.req_positive("moe_intermediate_size");
    // Piper models "first k blocks dense, the rest MoE"; other sparsity patterns are refused
    // rather than silently approximated.
    if (r.positive_or("decoder_sparse_step", 1) != 1)
      r.fail("decoder_sparse_step", "only 1 (every block MoE) is supported");
    if (r.has("mlp_only_layers")) {
      const json& m = j["mlp_only_layers"];
      if (!m.is_array()) r.fail("mlp_only_layers", "must be an array of layer indices");
      std::vector<std::int64_t> idx;
      for (const auto& e : m) {
        if (!e.is_number_integer()) r.fail("mlp_only_layers", "must be an array of layer indices");
        idx.push_back(e.get<std::int64_t>());
      }
      std::sort(idx.begin(), idx.end());
      for (std::size_t i = 0; i < idx.size(); ++i)
        if (idx[i] != static_cast<std::int64_t>(i))
          r.fail("mlp_only_layers", "only a prefix 0..k-1 of dense layers is supported");
      c.first_dense_layers = static_cast<std::int64_t>(idx.size());
    }
  } else if (deepseek) {
    c.experts = r.req_positive("n_routed_experts");
    c.top_k = r.req_positive("num_experts_per_tok");
    c.expert_ffn = r.req_positive("moe_intermediate_size");
    c.shared_experts = r.non_negative_or("n_shared_experts", 0);
    c.shared_expert_ffn = c.shared_experts > 0 ? c.expert_ffn : 0;
    c.first_dense_layers = r.non_negative_or("first_k_dense_replace", 0);
    if (r.positive_or("moe_layer_freq", 1) != 1)
      r.fail("moe_layer_freq", "only 1 (every block after the dense prefix MoE) is supported");
    c.q_lora_rank = r.non_negative_or("q_lora_rank", 0);  // null in V2-Lite: uncompressed q
    c.kv_lora_rank = r.req_positive("kv_lora_rank");
    c.qk_rope_head_dim = r.req_positive("qk_rope_head_dim");
    c.v_head_dim = r.req_positive("v_head_dim");
    c.head_dim = r.req_positive("qk_nope_head_dim");
    // Node-limited routing: each token's experts drawn from topk_group of n_group groups (DeepSeek
    // places one group per node), which bounds the all-to-all's inter-node traffic (docs/compiler.md).
    const std::int64_t groups = r.positive_or("n_group", 1), picked = r.positive_or("topk_group", groups);
    if (picked > groups) r.fail("topk_group", "must not exceed n_group (" + std::to_string(groups) + ")");
    if (picked < groups) {
      c.routing_groups = groups;
      c.routing_group_limit = picked;
    }
    // The multi-token-prediction module (DeepSeek-V3's extra block) is not built.
    if (r.non_negative_or("num_nextn_predict_layers", 0) > 0) not_modelled.push_back("num_nextn_predict_layers");
  }

  // Sliding-window attention.
  if (qwen) {
    r.has("sliding_window");
    r.has("max_window_layers");
    if (r.bool_or("use_sliding_window", false))
      r.fail("use_sliding_window", "true: Qwen's windowed layers (from max_window_layers on) are not modelled");
  } else if (type == "mistral" || type == "mixtral" || type == "phi3" || type == "gemma2" || type == "gemma3_text") {
    c.sliding_window = r.non_negative_or("sliding_window", type == "gemma2" ? 4096 : type == "gemma3_text" ? 4096 : 0);
    r.has("sliding_window_size");              // an old Gemma 2 alias of sliding_window
    if (type == "gemma2") c.global_every = 2;  // Gemma 2: even layers local, odd layers global
    if (type == "gemma3_text") c.global_every = r.positive_or("sliding_window_pattern", 6);
  }
  if (r.has("layer_types")) {  // newer transformers spell the pattern out per layer
    const json& lt = j.at("layer_types");
    if (!lt.is_array() || static_cast<std::int64_t>(lt.size()) != c.layers)
      r.fail("layer_types", "must be an array with one entry per layer");
    std::vector<bool> sliding;
    for (const auto& e : lt) {
      if (!e.is_string() || (e != "sliding_attention" && e != "full_attention"))
        r.fail("layer_types", "entries must be \"sliding_attention\" or \"full_attention\"");
      sliding.push_back(e == "sliding_attention");
    }
    const auto first_full = std::find(sliding.begin(), sliding.end(), false);
    if (std::find(sliding.begin(), sliding.end(), true) == sliding.end()) {
      c.sliding_window = 0, c.global_every = 0;
    } else {
      if (c.sliding_window <= 0)
        r.fail("sliding_window", "must be a positive integer (layer_types has sliding layers)");
      c.global_every = first_full == sliding.end() ? 0 : (first_full - sliding.begin()) + 1;
      for (std::int64_t i = 0; i < c.layers; ++i)
        if (sliding[static_cast<std::size_t>(i)] != c.block_uses_window(i))
          r.fail("layer_types", "only k-1 sliding layers followed by one full-attention layer, repeated, is modelled");
    }
  }

  std::vector<std::string> unknown = not_modelled;
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!r.read_keys().count(it.key()) && !hf_cost_irrelevant_fields().count(it.key())) unknown.push_back(it.key());
  // Errors about the config name its keys, not the spec's fields.
  const spec::FieldNames names = {{"vocab", "vocab_size"},
                                  {"hidden", key("hidden_size", "n_embd")},
                                  {"layers", key("num_hidden_layers", "n_layer")},
                                  {"heads", key("num_attention_heads", "n_head")},
                                  {"kv_heads", "num_key_value_heads"},
                                  {"head_dim", deepseek ? "qk_nope_head_dim" : "head_dim"},
                                  {"ffn", key("intermediate_size", "n_inner")},
                                  {"max_positions", "n_positions"},
                                  {"moe.experts", type == "mixtral" ? "num_local_experts"
                                                  : deepseek        ? "n_routed_experts"
                                                                    : "num_experts"},
                                  {"moe.top_k", "num_experts_per_tok"},
                                  {"moe.expert_ffn", type == "mixtral" ? "intermediate_size" : "moe_intermediate_size"},
                                  {"moe.shared_experts", "n_shared_experts"},
                                  {"moe.first_dense_layers", deepseek ? "first_k_dense_replace" : "mlp_only_layers"},
                                  {"moe.routing_groups", "n_group"},
                                  {"moe.routing_group_limit", "topk_group"},
                                  {"mla.q_lora_rank", "q_lora_rank"},
                                  {"mla.kv_lora_rank", "kv_lora_rank"},
                                  {"mla.qk_rope_head_dim", "qk_rope_head_dim"},
                                  {"mla.v_head_dim", "v_head_dim"},
                                  {"sliding_window.window", "sliding_window"}};
  validate_config(c, where, names);
  if (unmodelled) {
    *unmodelled = unknown;
  } else if (!unknown.empty()) {
    std::string list;
    for (const auto& f : unknown) list += (list.empty() ? "" : ", ") + f;
    // A command reads its model more than once (compile, then its report): one warning a file.
    static std::mutex mutex;
    static std::set<std::string> warned;
    const std::lock_guard<std::mutex> lock(mutex);
    if (warned.insert(where + list).second)
      std::cerr << "piper: warning: " << where << ": fields not modelled: " << list << "\n";
  }
  return c;
}

}  // namespace piper::core
