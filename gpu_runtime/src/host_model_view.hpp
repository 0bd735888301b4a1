// HostModel::LayerView (host_model.cpp, host_model_compute.cpp): one layer's tensors in a segment's
// parameter or gradient buffer, as Eigen maps by position or name. Internal to piper_runtime.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "piper/runtime/host_model.hpp"

namespace piper::runtime::host {

struct HostModel::LayerView {
  const core::Layer* layer = nullptr;
  float* base = nullptr;
  std::vector<std::pair<float*, TensorSpec>> tensors;
  MatMap mat(std::size_t i) { return MatMap(tensors[i].first, tensors[i].second.rows, tensors[i].second.cols); }
  ConstMatMap cmat(std::size_t i) {
    return ConstMatMap(tensors[i].first, tensors[i].second.rows, tensors[i].second.cols);
  }
  VecMap vec(std::size_t i) { return VecMap(tensors[i].first, tensors[i].second.size()); }
  ConstVecMap cvec(std::size_t i) { return ConstVecMap(tensors[i].first, tensors[i].second.size()); }
  std::size_t find(const char* name) const {  // tensors.size() when the layer has none of that name
    std::size_t i = 0;
    while (i < tensors.size() && tensors[i].second.name != name) ++i;
    return i;
  }
  bool has(const char* name) const { return find(name) < tensors.size(); }
  std::size_t at(const char* name) const {
    if (!has(name)) throw std::logic_error(std::string("runtime: layer '") + layer->name + "' has no tensor " + name);
    return find(name);
  }
  // Optional tensors (biases): an empty map when the layer has none.
  ConstVecMap cvec_or_empty(const char* name) { return has(name) ? cvec(find(name)) : ConstVecMap(nullptr, 0); }
  VecMap vec_or_empty(const char* name) { return has(name) ? vec(find(name)) : VecMap(nullptr, 0); }
  AttentionWeights attention(const AttentionShape& shape) {
    // (Eigen maps cannot be rebound after construction: the biases go in the aggregate.)
    return {cmat(0),
            cmat(1),
            cmat(2),
            cmat(3),
            shape.qk_norm ? cvec(4) : cvec(0),
            shape.qk_norm ? cvec(5) : cvec(0),
            cvec_or_empty("bias_q"),
            cvec_or_empty("bias_k"),
            cvec_or_empty("bias_v")};
  }
  GeluMlpWeights gelu() { return {cmat(at("wu")), cmat(at("wd")), cvec_or_empty("bias_fc1")}; }
};

}  // namespace piper::runtime::host
