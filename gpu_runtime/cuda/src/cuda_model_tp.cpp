// CudaModel's tensor and sequence parallelism (host_model_compute.cpp's tp_sum, tp_enter/tp_leave,
// partial replicated gradients and vocab-parallel head, on the device) and context parallelism (the
// K/V exchange of host AttentionCp): the collectives a compute op runs over its segment's TP or CP group
// through the backend's transport, and waits for; and expert tensor parallelism's gathers and
// reduce-scatters of the routed rows over the ETP group.
#include <algorithm>
#include <stdexcept>
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
// The collectives inside compute ops, named apart from the plan's (pair >= -1): TP's and CP's.
constexpr int kTpPair = -2;
constexpr int kCpPair = -3;
}  // namespace

void CudaModel::set_tp(int seg, TpLink link) { tp_[seg] = std::move(link); }

const TpLink* CudaModel::tp_of(int seg) const {
  const auto it = tp_.find(seg);
  return it == tp_.end() ? nullptr : &it->second;
}

host::AttentionShape CudaModel::segment_attention(int seg) {
  host::AttentionShape a = attn_shape_;
  host::SegmentParams& sp = layout_.segment(seg);
  a.heads /= sp.tp_degree;
  a.kv_heads /= sp.tp_degree;
  if (sp.cp_degree > 1) {  // this CP rank's two chunks of each sequence (host segment_attention)
    a.seq_len /= sp.cp_degree;
    a.cp = &sp.cp_attention;
  }
  return a;
}

void CudaModel::group_collective(const Exec& e, const TpLink& link, int pair, CommKind kind, const void* send,
                                 void* recv, std::size_t count) {
  CommRequest r;
  r.kind = kind;
  r.pair = pair;
  r.family = link.family;
  r.group = link.group;
  r.send = send;
  r.recv = recv;
  r.count = count;
  r.stream = e.stream;
  // The op waits for its collective (the group meets inside the op, as host::TpComm's calls block),
  // while the device's other streams keep moving.
  const int ticket = link.transport->post(r);
  while (!link.transport->test(ticket)) {
    if (progress_) progress_();
    std::this_thread::yield();
  }
}

void CudaModel::tp_collective(const Exec& e, int seg, CommKind kind, const void* send, void* recv, std::size_t count) {
  group_collective(e, *tp_of(seg), kTpPair, kind, send, recv, count);
}

Tensor CudaModel::reduce_scatter_rows(const Exec& e, const TpLink& link, int pair, const Tensor& all) {
  const auto ranks = static_cast<std::int64_t>(link.group.size());
  if (all.rows % ranks != 0)
    throw std::invalid_argument(fmt::format("runtime: {} rows do not split over {} ranks", all.rows, ranks));
  const std::int64_t rows = all.rows / ranks, n = rows * all.cols;
  Tensor in = all, out = new_tensor(e, rows, all.cols, 4);
  if (dt_ != DType::F32) {  // bf16/fp16 partial sums are added in fp32 (the transports reduce fp32)
    in = new_tensor(e, all.rows, all.cols, 4);
    convert(dt_, all.data(), DType::F32, in.data(), all.rows * all.cols, e.stream);
  }
  group_collective(e, link, pair, CommKind::ReduceScatter, in.data(), out.data(), static_cast<std::size_t>(n));
  if (dt_ == DType::F32) return out;
  Tensor local = new_tensor(e, rows, all.cols, elem());
  convert(DType::F32, out.data(), dt_, local.data(), n, e.stream);
  return local;
}

// ---------------------------------------------------------------------------------------------
// Context parallelism (host_model.cpp's set_cp_comm: AttentionCp's gather and scatter_sum)
// ---------------------------------------------------------------------------------------------
void CudaModel::set_cp(int seg, TpLink link) {
  host::SegmentParams& sp = layout_.segment(seg);
  sp.cp_attention.cp = sp.cp_degree;  // the kernels' positions; gather and scatter_sum stay unset (the host's)
  sp.cp_attention.rank = sp.cp_rank;
  cp_[seg] = std::move(link);
}

const TpLink* CudaModel::cp_of(int seg) const {
  const auto it = cp_.find(seg);
  return it == cp_.end() ? nullptr : &it->second;
}

Tensor CudaModel::cp_gather(const Exec& e, int seg, const Tensor& local) {
  const TpLink& cp = *cp_of(seg);
  Tensor all = new_tensor(e, local.rows * static_cast<std::int64_t>(cp.group.size()), local.cols, local.elem);
  group_collective(e, cp, kCpPair, CommKind::AllGather, local.data(), all.data(), local.bytes());  // rank order
  return all;
}

Tensor CudaModel::cp_scatter_sum(const Exec& e, int seg, const Tensor& all) {
  return reduce_scatter_rows(e, *cp_of(seg), kCpPair, all);
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
  return reduce_scatter_rows(e, *tp_of(seg), kTpPair, partial);
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

// ---------------------------------------------------------------------------------------------
// Expert tensor parallelism (host_model_compute.cpp's etp_gather / etp_scatter)
// ---------------------------------------------------------------------------------------------
namespace {
// Copies `count` rows of `src` from row `from` to `dst` at row `to` (same columns and element size).
void copy_rows(const Exec& e, const Tensor& dst, std::int64_t to, const Tensor& src, std::int64_t from,
               std::int64_t count) {
  if (count <= 0) return;
  const std::size_t row = static_cast<std::size_t>(src.cols) * src.elem;
  check(cudaMemcpyAsync(static_cast<char*>(dst.data()) + static_cast<std::size_t>(to) * row,
                        static_cast<const char*>(src.data()) + static_cast<std::size_t>(from) * row,
                        static_cast<std::size_t>(count) * row, cudaMemcpyDeviceToDevice, e.stream),
        "cudaMemcpyAsync (expert TP rows)");
}
// n floats from the host (pageable: staged before the call returns).
Tensor upload_floats(const Exec& e, const std::vector<float>& v) {
  Tensor t = new_tensor(e, static_cast<std::int64_t>(v.size()), 1, 4);
  if (t.bytes())
    check(cudaMemcpyAsync(t.data(), v.data(), t.bytes(), cudaMemcpyHostToDevice, e.stream), "cudaMemcpyAsync");
  return t;
}
}  // namespace

CudaModel::EtpRows CudaModel::etp_gather(const Exec& e, int seg, const Tensor& rows, const std::vector<int>* expert,
                                         const std::vector<int>* counts_known) {
  const int ranks = static_cast<int>(tp_of(seg)->group.size());
  const std::int64_t h = hidden();
  EtpRows out;
  if (counts_known) {
    out.counts = *counts_known;
  } else {
    const Tensor n = upload_floats(e, {static_cast<float>(rows.rows)});
    for (float v : download_floats(e, tp_gather_floats(e, seg, n.as<float>(), 1)))
      out.counts.push_back(static_cast<int>(v));
  }
  const std::int64_t pad = std::max<std::int64_t>(1, *std::max_element(out.counts.begin(), out.counts.end()));
  Tensor mine = zeros(e, pad, h, elem());
  copy_rows(e, mine, 0, rows, 0, rows.rows);
  Tensor all = new_tensor(e, pad * ranks, h, elem());
  tp_collective(e, seg, CommKind::AllGather, mine.data(), all.data(), mine.bytes());  // bytes per rank
  std::int64_t total = 0;
  for (int c : out.counts) total += c;
  out.rows = new_tensor(e, total, h, elem());
  std::int64_t at = 0;
  for (int r = 0; r < ranks; ++r) {
    copy_rows(e, out.rows, at, all, r * pad, out.counts[static_cast<std::size_t>(r)]);
    at += out.counts[static_cast<std::size_t>(r)];
  }
  if (expert) {
    std::vector<float> ids(static_cast<std::size_t>(pad), -1.0f);
    for (std::size_t i = 0; i < expert->size(); ++i) ids[i] = static_cast<float>((*expert)[i]);
    const Tensor mine_ids = upload_floats(e, ids);
    const std::vector<float> all_ids =
        download_floats(e, tp_gather_floats(e, seg, mine_ids.as<float>(), static_cast<std::int64_t>(pad)));
    for (int r = 0; r < ranks; ++r)
      for (int i = 0; i < out.counts[static_cast<std::size_t>(r)]; ++i)
        out.expert.push_back(static_cast<int>(all_ids[static_cast<std::size_t>(r * pad + i)]));
  }
  return out;
}

Tensor CudaModel::etp_scatter(const Exec& e, int seg, const Tensor& partial, const std::vector<int>& counts) {
  const int ranks = static_cast<int>(tp_of(seg)->group.size());
  const std::int64_t pad = std::max<std::int64_t>(1, *std::max_element(counts.begin(), counts.end()));
  // Each rank's rows in its padded block, summed over the group; this rank keeps its own.
  Tensor padded = zeros(e, pad * ranks, partial.cols, elem());
  std::int64_t at = 0;
  for (int r = 0; r < ranks; ++r) {
    copy_rows(e, padded, r * pad, partial, at, counts[static_cast<std::size_t>(r)]);
    at += counts[static_cast<std::size_t>(r)];
  }
  return reduce_scatter_rows(e, *tp_of(seg), kTpPair, padded)
      .row_range(0, counts[static_cast<std::size_t>(layout_.segment(seg).tp_rank)]);
}

Tensor CudaModel::routed_experts_forward(const Exec& e, int seg, int layer, int first_expert,
                                         const std::vector<int>& expert, const Tensor& rows, ExpertsCache& c) {
  if (!layout_.segment(seg).expert_tp) return experts_forward(e, seg, layer, first_expert, expert, rows, c);
  EtpRows g = etp_gather(e, seg, rows, &expert, nullptr);
  Tensor y = experts_forward(e, seg, layer, first_expert, g.expert, g.rows, c);
  c.etp_counts = std::move(g.counts);
  return etp_scatter(e, seg, y, c.etp_counts);
}

Tensor CudaModel::routed_experts_backward_input(const Exec& e, int seg, int layer, ExpertsCache& c, const Tensor& dy) {
  if (!layout_.segment(seg).expert_tp) return experts_backward_input(e, seg, layer, c, dy);
  const EtpRows g = etp_gather(e, seg, dy, nullptr, &c.etp_counts);
  return etp_scatter(e, seg, experts_backward_input(e, seg, layer, c, g.rows), c.etp_counts);
}

}  // namespace piper::runtime::cuda
