// CudaModel::Weights and its matrix operand (cuda_model.cpp, cuda_model_compute.cpp): one layer's
// parameters or fp32 gradients in a segment's device buffer. Internal to piper_cuda.
#pragma once

#include <cstdint>
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
};

}  // namespace piper::runtime::cuda
