// CudaModel::Weights and its matrix operand (cuda_model.cpp, cuda_model_compute.cpp): one layer's
// parameters or fp32 gradients in a segment's device buffer. Internal to piper_cuda.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "piper/runtime/cuda/cuda_model.hpp"

namespace piper::runtime::cuda {

namespace model_detail {

// A stored row-major matrix operand.
struct M {
  const void* p;
  std::int64_t rows, cols;
};

}  // namespace model_detail

struct CudaModel::Weights {
  const core::Layer* layer = nullptr;
  std::vector<std::pair<char*, host::TensorSpec>> tensors;  // params (storage type) or grads (fp32)
  model_detail::M mat(std::size_t i) const {
    return {tensors[i].first, tensors[i].second.rows, tensors[i].second.cols};
  }
  void* ptr(std::size_t i) const { return tensors[i].first; }
  float* grad(std::size_t i) const { return reinterpret_cast<float*>(tensors[i].first); }
  // The tensor named `name` (host::layer_tensors' names: "pos", "norm_bias", "bias_o", ...).
  bool has(const std::string& name) const {
    for (const auto& t : tensors)
      if (t.second.name == name) return true;
    return false;
  }
  std::size_t at(const std::string& name) const {
    for (std::size_t i = 0; i < tensors.size(); ++i)
      if (tensors[i].second.name == name) return i;
    throw std::logic_error("runtime: layer '" + layer->name + "' has no tensor '" + name + "'");
  }
};

}  // namespace piper::runtime::cuda
