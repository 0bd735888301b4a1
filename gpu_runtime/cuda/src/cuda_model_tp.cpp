// CudaModel's tensor and sequence parallelism (host_model_compute.cpp's tp_sum, tp_enter/tp_leave,
// partial replicated gradients and vocab-parallel head, on the device): the collectives a compute op
// runs over its segment's TP group through the backend's transport, and waits for.
#include <string>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "piper/runtime/cuda/cuda_model.hpp"
#include "piper/runtime/cuda/transport.hpp"

namespace piper::runtime::cuda {

// ---------------------------------------------------------------------------------------------
// Tensor parallelism (host_model_compute.cpp's tp_sum and vocab-parallel head)
// ---------------------------------------------------------------------------------------------
namespace {
constexpr int kTpPair = -2;  // the collectives inside compute ops, named apart from the plan's (pair >= -1)
// The op waits for its TP collective (the group meets inside the op, as host::TpComm's calls block).
void wait_for(Transport& t, int ticket) {
  while (!t.test(ticket)) std::this_thread::yield();
}
}  // namespace

void CudaModel::set_tp(int seg, TpLink link) { tp_[seg] = std::move(link); }

const TpLink* CudaModel::tp_of(int seg) const {
  const auto it = tp_.find(seg);
  return it == tp_.end() ? nullptr : &it->second;
}

host::AttentionShape CudaModel::segment_attention(int seg) {
  host::AttentionShape a = attn_shape_;
  const int t = layout_.segment(seg).tp_degree;
  a.heads /= t;
  a.kv_heads /= t;
  return a;
}

void CudaModel::tp_collective(const Exec& e, int seg, CommKind kind, const void* send, void* recv, std::size_t count) {
  const TpLink* tp = tp_of(seg);
  CommRequest r;
  r.kind = kind;
  r.pair = kTpPair;
  r.family = tp->family;
  r.group = tp->group;
  r.send = send;
  r.recv = recv;
  r.count = count;
  r.stream = e.stream;
  wait_for(*tp->transport, tp->transport->post(r));
}

void CudaModel::tp_sum_floats(const Exec& e, int seg, float* p, std::int64_t n) {
  if (tp_of(seg) && n > 0) tp_collective(e, seg, CommKind::AllReduce, nullptr, p, static_cast<std::size_t>(n));
}

void CudaModel::tp_sum(const Exec& e, int seg, Tensor& t) {
  if (!tp_of(seg)) return;
  const std::int64_t n = t.rows * t.cols;
  if (dt_ == DType::F32) return tp_sum_floats(e, seg, t.as<float>(), n);
  // bf16/fp16 partial sums are added in fp32 (the transports reduce fp32), then stored once.
  Tensor f = new_tensor(e, t.rows, t.cols, 4);
  convert(dt_, t.data(), DType::F32, f.data(), n, e.stream);
  tp_sum_floats(e, seg, f.as<float>(), n);
  convert(DType::F32, f.data(), dt_, t.data(), n, e.stream);
}

bool CudaModel::sequence_parallel(int seg) { return tp_of(seg) && layout_.segment(seg).sequence_parallel; }

Tensor CudaModel::tp_enter(const Exec& e, int seg, const Tensor& local) {
  if (!sequence_parallel(seg)) return local;
  const auto ranks = static_cast<std::int64_t>(tp_of(seg)->group.size());
  Tensor full = new_tensor(e, local.rows * ranks, local.cols, elem());
  tp_collective(e, seg, CommKind::AllGather, local.data(), full.data(), local.bytes());  // rank order = row order
  return full;
}

Tensor CudaModel::tp_leave(const Exec& e, int seg, Tensor partial) {
  if (!sequence_parallel(seg)) {
    tp_sum(e, seg, partial);
    return partial;
  }
  const auto ranks = static_cast<std::int64_t>(tp_of(seg)->group.size());
  if (partial.rows % ranks != 0)
    throw std::invalid_argument(
        fmt::format("runtime: {} token rows do not split over {} sequence-parallel ranks", partial.rows, ranks));
  const std::int64_t rows = partial.rows / ranks, n = rows * partial.cols;
  Tensor in = partial, out = new_tensor(e, rows, partial.cols, 4);
  if (dt_ != DType::F32) {  // bf16/fp16 partial sums are added in fp32 (the transports reduce fp32)
    in = new_tensor(e, partial.rows, partial.cols, 4);
    convert(dt_, partial.data(), DType::F32, in.data(), partial.rows * partial.cols, e.stream);
  }
  tp_collective(e, seg, CommKind::ReduceScatter, in.data(), out.data(), static_cast<std::size_t>(n));
  if (dt_ == DType::F32) return out;
  Tensor local = new_tensor(e, rows, partial.cols, elem());
  convert(DType::F32, out.data(), dt_, local.data(), n, e.stream);
  return local;
}

float* CudaModel::partial_grad_begin(const Exec& e, int seg, float* grad, std::int64_t n, Tensor& scratch) {
  if (grad == nullptr || !sequence_parallel(seg)) return grad;
  scratch = zeros(e, n, 1, 4);
  return scratch.as<float>();
}

void CudaModel::partial_grad_end(const Exec& e, int seg, float* grad, std::int64_t n, Tensor& scratch) {
  if (scratch.empty()) return;
  tp_sum_floats(e, seg, scratch.as<float>(), n);
  accumulate(DType::F32, grad, scratch.data(), n, e.stream);
}

Tensor CudaModel::tp_gather_floats(const Exec& e, int seg, const float* send, std::int64_t n) {
  Tensor all = new_tensor(e, static_cast<std::int64_t>(tp_of(seg)->group.size()), n, 4);
  tp_collective(e, seg, CommKind::AllGather, send, all.data(), static_cast<std::size_t>(n) * 4);  // bytes per rank
  return all;
}

void CudaModel::vocab_parallel_cross_entropy(const Exec& e, int seg, Tensor& logits, const Tensor& targets, int first,
                                             float loss_scale, float* loss) {
  const int T = static_cast<int>(logits.rows), V = static_cast<int>(logits.cols);
  const int ranks = static_cast<int>(tp_of(seg)->group.size());
  Tensor mx = new_tensor(e, T, 1, 4);
  vocab_parallel_row_max(dt_, logits.data(), T, V, mx.as<float>(), e.stream);
  const Tensor all_max = tp_gather_floats(e, seg, mx.as<float>(), T);
  Tensor sums = new_tensor(e, 2, T, 4);
  vocab_parallel_sums(dt_, logits.data(), targets.as<int>(), T, V, first, all_max.as<float>(), ranks, sums.as<float>(),
                      e.stream);
  const Tensor all_sums = tp_gather_floats(e, seg, sums.as<float>(), 2 * static_cast<std::int64_t>(T));
  vocab_parallel_finish(dt_, logits.data(), targets.as<int>(), T, V, first, all_max.as<float>(), all_sums.as<float>(),
                        ranks, loss_scale, loss, e.stream);
}

}  // namespace piper::runtime::cuda
