// The small GPT of the tensor-parallel tests (Korthikanti's setting) and how they compile it: shared by
// test_tensor_parallel.cpp and test_gradient_accumulation.cpp.
#pragma once

#include <string>

#include "piper/core/model.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "spec_file.hpp"

namespace piper::test::tp {

// A small GPT in Korthikanti's setting (standard attention, dropout, GELU, ffn = 4h): s = 64,
// b = 2, h = 64, a = 4 heads, vocab 256, L layers.
inline core::ModelConfig small_gpt(int layers = 2) {
  core::ModelConfig c;
  c.name = "tp-gpt";
  c.vocab = 256;
  c.hidden = 64;
  c.layers = layers;
  c.heads = 4;
  c.kv_heads = 4;
  c.head_dim = 16;
  c.ffn = 256;
  c.activation = core::MlpActivation::GELU;
  c.norm = core::NormKind::LayerNorm;
  c.bias = true;
  c.max_positions = 64;
  c.attention_kernel = core::AttentionKernel::Standard;
  c.dropout = true;
  c.dropout_probability = 0.1;
  c.training.seq_len = 64;
  c.training.micro_batch_size = 2;
  c.training.precision = core::Precision::BF16;
  return c;
}

// small_gpt's sequence, micro-batch, hidden size and heads.
inline constexpr double s = 64, b = 2, h = 64, a = 4;

inline core::Scenario tp_scenario(const std::string& model_path, core::StrategyOptions o) {
  core::Scenario sc;
  sc.model = model_path;
  sc.strategy = o;
  return sc;
}

using piper::test::write_spec;

}  // namespace piper::test::tp
