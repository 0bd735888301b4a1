// The CUDA model: device tensors, state messages and expert packets, parameter upload from the host
// layout, AdamW on fp32 master weights with ZeRO chunks; forward/BI/BW of each layer kind and the
// expert-parallel routing are in cuda_model_compute.cpp. Each function mirrors the HostModel function
// of the same name in gpu_runtime/src/host_model.cpp (or host_model_compute.cpp).
#include "piper/runtime/cuda/cuda_model.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "cuda_model_weights.hpp"

namespace piper::runtime::cuda {

namespace {

constexpr std::size_t kAlign = 256;
std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

void put(const Exec& e, const Tensor& msg, std::size_t at, const Tensor& t) {
  if (t.bytes())
    check(cudaMemcpyAsync(static_cast<char*>(msg.data()) + at, t.data(), t.bytes(), cudaMemcpyDeviceToDevice, e.stream),
          "cudaMemcpyAsync");
}

void put_header(const Exec& e, const Tensor& msg, const std::int64_t (&h)[8]) {
  // Pageable source: the copy is staged before cudaMemcpyAsync returns, so `h` may go out of scope.
  check(cudaMemcpyAsync(msg.data(), h, sizeof(h), cudaMemcpyHostToDevice, e.stream), "cudaMemcpyAsync header");
}

void get_header(const Exec& e, const Tensor& msg, std::int64_t (&h)[8]) {
  check(cudaMemcpyAsync(h, msg.data(), sizeof(h), cudaMemcpyDeviceToHost, e.stream), "cudaMemcpyAsync header");
  check(cudaStreamSynchronize(e.stream), "cudaStreamSynchronize");
}

Tensor view(const Tensor& msg, std::size_t at, std::int64_t rows, std::int64_t cols, std::size_t elem) {
  return Tensor{msg.mem, msg.offset + at, rows, cols, elem};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Tensors
// ---------------------------------------------------------------------------------------------
Tensor new_tensor(const Exec& e, std::int64_t rows, std::int64_t cols, std::size_t elem) {
  return Tensor{e.alloc->allocate(static_cast<std::size_t>(rows * cols) * elem), 0, rows, cols, elem};
}

Tensor zeros(const Exec& e, std::int64_t rows, std::int64_t cols, std::size_t elem) {
  Tensor t = new_tensor(e, rows, cols, elem);
  if (t.bytes()) check(cudaMemsetAsync(t.data(), 0, t.bytes(), e.stream), "cudaMemsetAsync");
  return t;
}

Tensor upload_ints(const Exec& e, const std::vector<int>& v) {
  Tensor t = new_tensor(e, static_cast<std::int64_t>(v.size()), 1, sizeof(int));
  if (t.bytes())
    check(cudaMemcpyAsync(t.data(), v.data(), t.bytes(), cudaMemcpyHostToDevice, e.stream), "cudaMemcpyAsync");
  return t;
}

std::vector<int> download_ints(const Exec& e, const Tensor& t) {
  std::vector<int> out(static_cast<std::size_t>(t.size()));
  if (t.bytes())
    check(cudaMemcpyAsync(out.data(), t.data(), t.bytes(), cudaMemcpyDeviceToHost, e.stream), "cudaMemcpyAsync");
  check(cudaStreamSynchronize(e.stream), "cudaStreamSynchronize");
  return out;
}

std::vector<float> download_floats(const Exec& e, const Tensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.size()));
  if (t.bytes())
    check(cudaMemcpyAsync(out.data(), t.data(), t.bytes(), cudaMemcpyDeviceToHost, e.stream), "cudaMemcpyAsync");
  check(cudaStreamSynchronize(e.stream), "cudaStreamSynchronize");
  return out;
}

// ---------------------------------------------------------------------------------------------
// Messages: header (rows, cols, k, has_u / has_du, has_routing / has_dgates) then x, u, topk, gates.
// ---------------------------------------------------------------------------------------------
std::size_t MessageShape::bytes() const {
  const std::size_t act = align_up(static_cast<std::size_t>(tokens * hidden) * dtype_bytes(dt));
  const std::size_t small = align_up(static_cast<std::size_t>(tokens * top_k) * 4);
  return kAlign + 2 * act + 2 * small;
}

namespace {
struct Offsets {
  std::size_t a, b, c, d;
};
Offsets offsets(const MessageShape& m) {
  const std::size_t act = align_up(static_cast<std::size_t>(m.tokens * m.hidden) * dtype_bytes(m.dt));
  const std::size_t small = align_up(static_cast<std::size_t>(m.tokens * m.top_k) * 4);
  return {kAlign, kAlign + act, kAlign + 2 * act, kAlign + 2 * act + small};
}
}  // namespace

Tensor pack_forward(const Exec& e, const MessageShape& m, const ForwardState& s) {
  Tensor msg = new_tensor(e, 1, static_cast<std::int64_t>(m.bytes()), 1);
  const Offsets o = offsets(m);
  const std::int64_t h[8] = {s.x.rows, s.x.cols, s.topk.cols, s.u.empty() ? 0 : 1, s.topk.empty() ? 0 : 1, 0, 0, 0};
  if (s.x.rows > m.tokens || s.topk.cols > m.top_k) throw std::logic_error("runtime: activation exceeds its message");
  put_header(e, msg, h);
  put(e, msg, o.a, s.x);
  put(e, msg, o.b, s.u);
  put(e, msg, o.c, s.topk);
  put(e, msg, o.d, s.gates);
  return msg;
}

Tensor pack_backward(const Exec& e, const MessageShape& m, const BackwardState& s) {
  Tensor msg = new_tensor(e, 1, static_cast<std::int64_t>(m.bytes()), 1);
  const Offsets o = offsets(m);
  const std::int64_t h[8] = {s.dx.rows, s.dx.cols, s.dgates.cols, s.du.empty() ? 0 : 1, s.dgates.empty() ? 0 : 1, 0,
                             0,         0};
  if (s.dx.rows > m.tokens || s.dgates.cols > m.top_k) throw std::logic_error("runtime: gradient exceeds its message");
  put_header(e, msg, h);
  put(e, msg, o.a, s.dx);
  put(e, msg, o.b, s.du);
  put(e, msg, o.d, s.dgates);
  return msg;
}

ForwardState unpack_forward(const Exec& e, const MessageShape& m, const Tensor& msg) {
  std::int64_t h[8];
  get_header(e, msg, h);
  const Offsets o = offsets(m);
  const std::size_t es = dtype_bytes(m.dt);
  ForwardState s;
  s.x = view(msg, o.a, h[0], h[1], es);
  if (h[3]) s.u = view(msg, o.b, h[0], h[1], es);
  if (h[4]) s.topk = view(msg, o.c, h[0], h[2], 4), s.gates = view(msg, o.d, h[0], h[2], 4);
  return s;
}

BackwardState unpack_backward(const Exec& e, const MessageShape& m, const Tensor& msg) {
  std::int64_t h[8];
  get_header(e, msg, h);
  const Offsets o = offsets(m);
  const std::size_t es = dtype_bytes(m.dt);
  BackwardState s;
  s.dx = view(msg, o.a, h[0], h[1], es);
  if (h[3]) s.du = view(msg, o.b, h[0], h[1], es);
  if (h[4]) s.dgates = view(msg, o.d, h[0], h[2], 4);
  return s;
}

std::size_t PacketShape::ids_bytes() const { return align_up(static_cast<std::size_t>(1 + capacity) * 4); }
std::size_t PacketShape::block_bytes() const {
  return ids_bytes() + align_up(static_cast<std::size_t>(capacity * hidden) * dtype_bytes(dt));
}

Tensor pack_packets(const Exec& e, const PacketShape& s, const std::vector<ExpertPacket>& packets) {
  const std::size_t block = s.block_bytes();
  Tensor out = zeros(e, 1, static_cast<std::int64_t>(block * packets.size()), 1);
  for (std::size_t p = 0; p < packets.size(); ++p) {
    const auto n = packets[p].rows.rows;
    if (n > s.capacity) throw std::logic_error("runtime: expert packet exceeds its block");
    std::vector<int> head(static_cast<std::size_t>(1 + n), -1);
    head[0] = static_cast<int>(n);
    for (std::int64_t i = 0; i < n && !packets[p].expert.empty(); ++i)
      head[static_cast<std::size_t>(1 + i)] = packets[p].expert[static_cast<std::size_t>(i)];
    check(cudaMemcpyAsync(static_cast<char*>(out.data()) + p * block, head.data(), head.size() * 4,
                          cudaMemcpyHostToDevice, e.stream),
          "cudaMemcpyAsync packet header");
    put(e, out, p * block + s.ids_bytes(), packets[p].rows);
  }
  return out;
}

std::vector<ExpertPacket> unpack_packets(const Exec& e, const PacketShape& s, const Tensor& data, int peers) {
  const std::size_t block = s.block_bytes();
  std::vector<int> heads(static_cast<std::size_t>(peers) * static_cast<std::size_t>(1 + s.capacity));
  for (int p = 0; p < peers; ++p)
    check(cudaMemcpyAsync(heads.data() + static_cast<std::size_t>(p) * static_cast<std::size_t>(1 + s.capacity),
                          static_cast<const char*>(data.data()) + static_cast<std::size_t>(p) * block,
                          static_cast<std::size_t>(1 + s.capacity) * 4, cudaMemcpyDeviceToHost, e.stream),
          "cudaMemcpyAsync packet header");
  check(cudaStreamSynchronize(e.stream), "cudaStreamSynchronize");
  std::vector<ExpertPacket> out(static_cast<std::size_t>(peers));
  for (int p = 0; p < peers; ++p) {
    const int* h = heads.data() + static_cast<std::size_t>(p) * static_cast<std::size_t>(1 + s.capacity);
    const int n = h[0];
    for (int i = 0; i < n; ++i) out[static_cast<std::size_t>(p)].expert.push_back(h[1 + i]);
    out[static_cast<std::size_t>(p)].rows =
        view(data, static_cast<std::size_t>(p) * block + s.ids_bytes(), n, s.hidden, dtype_bytes(s.dt));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Layout and parameters
// ---------------------------------------------------------------------------------------------

CudaModel::CudaModel(const core::Model& model, std::vector<host::SegmentSpec> segments, std::uint64_t seed, DType dt,
                     Allocator& alloc, cudaStream_t init_stream)
    : layout_(model, std::move(segments), seed), dt_(dt), alloc_(alloc) {
  std::int64_t positions = 0;  // learned absolute positions (GPT) instead of RoPE
  for (const auto& l : layout_.model().layers())
    if (l.kind == core::LayerKind::Embedding) positions = l.shape.max_positions;
  for (const auto& l : layout_.model().layers())
    if (l.kind == core::LayerKind::Attention)
      attn_shape_ = host::AttentionShape{static_cast<int>(l.shape.heads),
                                         static_cast<int>(l.shape.kv_heads),
                                         static_cast<int>(l.shape.head_dim),
                                         static_cast<int>(layout_.model().training().seq_len),
                                         l.shape.qk_norm,
                                         10000.0f,
                                         positions == 0,
                                         l.shape.bias};
  const Exec e{init_stream, nullptr, &alloc_};
  for (auto& sp : layout_.segments()) {
    SegmentDevice d;
    const auto n = static_cast<std::int64_t>(sp.params.size());
    // ZeRO 0 keeps the whole vector as fp32 master; ZeRO >= 1 the host already holds the chunk.
    d.master = new_tensor(e, static_cast<std::int64_t>(sp.zero_level >= 1 ? sp.master.size() : sp.params.size()), 1, 4);
    d.params = new_tensor(e, n, 1, elem());
    d.grads = new_tensor(e, n, 1, 4);
    d.grad_chunk = new_tensor(e, static_cast<std::int64_t>(sp.grad_chunk.size()), 1, 4);
    d.adam_m = new_tensor(e, static_cast<std::int64_t>(sp.adam_m.size()), 1, 4);
    d.adam_v = new_tensor(e, static_cast<std::int64_t>(sp.adam_v.size()), 1, 4);
    upload_segment(e, sp, d);  // the host's initial values (moments zero)
    device_.emplace(sp.segment, std::move(d));
  }
  loss_ = zeros(e, 1, 1, 4);
  check(cudaStreamSynchronize(init_stream), "cudaStreamSynchronize");
}

void CudaModel::upload_segment(const Exec& e, const host::SegmentParams& sp, SegmentDevice& d) {
  auto up = [&](Tensor& t, const std::vector<float>& v) {
    if (static_cast<std::size_t>(t.size()) != v.size())
      throw std::logic_error("runtime: host and device state sizes differ");
    if (t.bytes())
      check(cudaMemcpyAsync(t.data(), v.data(), t.bytes(), cudaMemcpyHostToDevice, e.stream), "cudaMemcpyAsync");
  };
  up(d.master, sp.zero_level >= 1 ? sp.master : sp.params);
  // Params in the storage type: converted from the host values (NaN-poisoned for ZeRO-3, as the host).
  const auto n = static_cast<std::int64_t>(sp.params.size());
  Tensor staging = new_tensor(e, n, 1, 4);
  up(staging, sp.params);
  if (n) convert(DType::F32, staging.data(), dt_, d.params.data(), n, e.stream);
  up(d.adam_m, sp.adam_m);
  up(d.adam_v, sp.adam_v);
  for (Tensor* t : {&d.grads, &d.grad_chunk})
    if (t->bytes()) check(cudaMemsetAsync(t->data(), 0, t->bytes(), e.stream), "cudaMemsetAsync");
  d.grad_chunk_ready = false;
  d.gathered = 0;
  check(cudaStreamSynchronize(e.stream), "cudaStreamSynchronize");  // the host vectors are read above
}

host::HostModel& CudaModel::state_to_host(const Exec& e) {
  for (auto& sp : layout_.segments()) {
    SegmentDevice& d = device(sp.segment);
    // The fp32 masters, never the storage-type params: a bf16 run resumes exactly where it stopped.
    (sp.zero_level >= 1 ? sp.master : sp.params) = download_floats(e, d.master);
    sp.adam_m = download_floats(e, d.adam_m);
    sp.adam_v = download_floats(e, d.adam_v);
  }
  return layout_;
}

void CudaModel::state_from_host(const Exec& e) {
  for (auto& sp : layout_.segments()) upload_segment(e, sp, device(sp.segment));
}

SegmentDevice& CudaModel::device(int seg) {
  auto it = device_.find(seg);
  if (it == device_.end())
    throw std::logic_error("runtime: this device holds no parameters of segment " + std::to_string(seg));
  return it->second;
}

// As HostModel::view: the layer's tensors at their offsets (experts: this device's shard only).
CudaModel::Weights CudaModel::weights(int seg, int layer, bool grads) {
  host::SegmentParams& sp = layout_.segment(seg);
  SegmentDevice& d = device(seg);
  Weights w;
  w.layer = &layout_.model().layers().at(static_cast<std::size_t>(layer));
  const std::size_t es = grads ? 4 : elem();
  char* p = static_cast<char*>(grads ? d.grads.data() : d.params.data()) +
            static_cast<std::size_t>(sp.layer_offset.at(static_cast<std::size_t>(layer - sp.first_layer))) * es;
  // The host layout's tensors of this layer on this device (expert shards; a tied head's copy of the
  // embedding table), named as in host::layer_tensors.
  for (const auto& t : layout_.tensors_of(sp, layer)) {
    w.tensors.emplace_back(p, host::TensorSpec{t.full.name, t.local.rows, t.local.cols});
    p += static_cast<std::size_t>(t.local.size()) * es;
  }
  return w;
}

CudaModel::Weights CudaModel::head_weights(int seg, bool grads, bool& tied) {
  tied = layout_.tied();
  const host::SegmentParams& sp = layout_.segment(seg);
  return weights(seg, tied && !sp.tied_copy ? layout_.embedding_layer() : layout_.head_layer(), grads);
}

// ---------------------------------------------------------------------------------------------
// Optimizer
// ---------------------------------------------------------------------------------------------
void CudaModel::update(const Exec& e, int seg, const AdamW& cfg, int step) {
  host::SegmentParams& sp = layout_.segment(seg);
  SegmentDevice& d = device(seg);
  const std::int64_t chunk = sp.chunk_end - sp.chunk_begin;
  if (sp.zero_level >= 1) {
    if (!d.grad_chunk_ready && chunk > 0)  // one replica: no reduce-scatter ran, the chunk is the whole gradient
      check(cudaMemcpyAsync(d.grad_chunk.data(), d.grads.as<float>() + sp.chunk_begin,
                            static_cast<std::size_t>(chunk) * 4, cudaMemcpyDeviceToDevice, e.stream),
            "cudaMemcpyAsync");
    if (sp.zero_level < 3 && chunk > 0)  // the updated chunk also lands in this device's whole parameters
      adamw_store(cfg, step, d.master.as<float>(), d.grad_chunk.as<float>(), d.adam_m.as<float>(), d.adam_v.as<float>(),
                  chunk, dt_, static_cast<char*>(d.params.data()) + static_cast<std::size_t>(sp.chunk_begin) * elem(),
                  false, e.stream);
    else if (chunk > 0)
      adamw(cfg, step, d.master.as<float>(), d.grad_chunk.as<float>(), d.adam_m.as<float>(), d.adam_v.as<float>(),
            chunk, e.stream);
    if (d.grads.bytes()) check(cudaMemsetAsync(d.grads.data(), 0, d.grads.bytes(), e.stream), "cudaMemsetAsync");
  } else if (d.master.size() > 0) {  // whole gradients, zeroed as they are read
    adamw_store(cfg, step, d.master.as<float>(), d.grads.as<float>(), d.adam_m.as<float>(), d.adam_v.as<float>(),
                d.master.size(), dt_, d.params.data(), true, e.stream);
  } else if (d.grads.bytes()) {
    check(cudaMemsetAsync(d.grads.data(), 0, d.grads.bytes(), e.stream), "cudaMemsetAsync");
  }
  if (d.grad_chunk.bytes())
    check(cudaMemsetAsync(d.grad_chunk.data(), 0, d.grad_chunk.bytes(), e.stream), "cudaMemsetAsync");
  d.grad_chunk_ready = false;
}

const std::vector<std::pair<std::int64_t, std::int64_t>>& CudaModel::counted_grad_runs(int seg) {
  if (const auto it = counted_runs_.find(seg); it != counted_runs_.end()) return it->second;
  const host::SegmentParams& sp = layout_.segment(seg);
  std::vector<std::pair<std::int64_t, std::int64_t>>& runs = counted_runs_[seg];
  for (int l = sp.first_layer; l < sp.last_layer; ++l) {
    std::int64_t at = sp.layer_offset[static_cast<std::size_t>(l - sp.first_layer)];
    for (const auto& t : layout_.tensors_of(sp, l)) {
      const std::int64_t len = t.local.size();
      const bool copy = t.canonical_layer >= 0 && t.canonical_layer != l;  // a tied head's table
      const bool replicated = sp.tp_degree > 1 && t.split == host::TpSplit::Replicated;
      if (!copy && !(replicated && sp.tp_rank != 0) && len > 0) {
        if (!runs.empty() && runs.back().first + runs.back().second == at)
          runs.back().second += len;  // adjacent: one launch
        else
          runs.emplace_back(at, len);
      }
      at += len;
    }
  }
  return runs;
}

void CudaModel::discard_grads(const Exec& e, int seg) {
  SegmentDevice& d = device(seg);
  if (d.grads.bytes()) check(cudaMemsetAsync(d.grads.data(), 0, d.grads.bytes(), e.stream), "cudaMemsetAsync");
  if (d.grad_chunk.bytes())
    check(cudaMemsetAsync(d.grad_chunk.data(), 0, d.grad_chunk.bytes(), e.stream), "cudaMemsetAsync");
  d.grad_chunk_ready = false;
}

void CudaModel::poison_params(const Exec& e, int seg) {
  // All-ones bytes are a NaN in both fp32 and bf16.
  SegmentDevice& d = device(seg);
  if (d.params.bytes()) check(cudaMemsetAsync(d.params.data(), 0xff, d.params.bytes(), e.stream), "cudaMemsetAsync");
}

std::vector<host::ParamRecord> CudaModel::param_records(const Exec& e) {
  for (auto& sp : layout_.segments()) {
    SegmentDevice& d = device(sp.segment);
    Tensor f32 = new_tensor(e, d.params.size(), 1, 4);
    if (d.params.size()) convert(dt_, d.params.data(), DType::F32, f32.data(), d.params.size(), e.stream);
    sp.params = download_floats(e, f32);
    if (sp.zero_level >= 1) sp.master = download_floats(e, d.master);
  }
  return layout_.param_records();
}

}  // namespace piper::runtime::cuda
