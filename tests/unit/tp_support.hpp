// The small GPT of the tensor-parallel tests (Korthikanti's setting) and how they compile it: shared by
// test_tensor_parallel.cpp and test_gradient_accumulation.cpp.
#pragma once

#include <unistd.h>

#include <gtest/gtest.h>

#include <string>

#include "piper/core/error.hpp"
#include "piper/core/model.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"

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

// Writes the spec to a file of its own and returns the path.
inline std::string write_spec(const core::ModelConfig& c) {
  // One file per process: CTest runs this binary's tests in parallel processes.
  const std::string path = ::testing::TempDir() + "/" + c.name + "-" + std::to_string(::getpid()) + ".json";
  core::write_file_atomically(path, core::config_to_spec_json(c).dump());
  return path;
}

}  // namespace piper::test::tp
