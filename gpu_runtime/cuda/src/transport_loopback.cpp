// The loopback transport: N virtual devices of one process exchange tensors on one GPU. Each request
// waits at a host-side rendezvous until every member has posted; the last member to arrive enqueues
// the whole exchange on its own stream (after waiting on the events the others recorded when they
// posted), then every member completes when that work's event has.
#include "piper/runtime/cuda/transport.hpp"

#include <fmt/format.h>

#include "piper/runtime/cuda/device.hpp"
#include "piper/runtime/cuda/kernels.hpp"

namespace piper::runtime::cuda {

namespace {
void copy(void* dst, const void* src, std::size_t bytes, cudaStream_t s) {
  if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync (loopback)");
}
cudaEvent_t new_event() {
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return e;
}
}  // namespace

LoopbackTransport::~LoopbackTransport() = default;

int LoopbackTransport::post(const CommRequest& r) {
  int rank = 0, expected = 2, a = 0, b = 0, c = 0;
  if (r.kind == CommKind::Send || r.kind == CommKind::Recv) {
    // Both sides name the transfer by (sender, receiver, pairing id): core/readiness.hpp's rule.
    a = r.kind == CommKind::Send ? device_ : r.peer;
    b = r.kind == CommKind::Send ? r.peer : device_;
    c = r.pair;
    rank = r.kind == CommKind::Send ? 0 : 1;
  } else {
    // Every member of a collective occurrence carries one pairing id (core/readiness.hpp), so
    // (family, first member, id) names it whatever order the members post in (groups of a family
    // are disjoint; the sequence number tells steps apart). The rendezvous itself is this hub's:
    // the virtual devices are threads of one process, with no PairIndex of their own.
    a = r.family;
    b = r.group.empty() ? -1 : r.group.front();
    c = r.pair;
    expected = static_cast<int>(r.group.size());
    rank = -1;
    for (std::size_t i = 0; i < r.group.size(); ++i)
      if (r.group[i] == device_) rank = static_cast<int>(i);
    if (rank < 0)
      throw CudaError(fmt::format("loopback: device {} posted a collective of a group it is not in", device_));
  }
  const int kind = r.kind == CommKind::Recv ? static_cast<int>(CommKind::Send) : static_cast<int>(r.kind);
  const auto seq = sequence_[{kind, a, b, c}]++;
  LoopbackHub::Key key{kind, a, b, c, seq};
  LoopbackHub::Member m;
  m.request = r;
  m.posted = new_event();
  check(cudaEventRecord(m.posted, r.stream), "cudaEventRecord");
  {
    std::lock_guard<std::mutex> lock(hub_.mutex_);
    auto& rv = hub_.open_[key];
    rv.expected = expected;
    if (rv.members.count(rank))
      throw CudaError(fmt::format("loopback: device {} posted the same exchange twice", device_));
    rv.members.emplace(rank, std::move(m));
    if (static_cast<int>(rv.members.size()) == rv.expected) launch(rv, r.stream);
  }
  const int t = next_ticket_++;
  tickets_[t] = Ticket{key, rank};
  return t;
}

// Called with the hub locked by the last member to post; enqueues everything on `stream`.
void LoopbackTransport::launch(LoopbackHub::Rendezvous& rv, cudaStream_t stream) {
  for (auto& [rank, m] : rv.members) check(cudaStreamWaitEvent(stream, m.posted, 0), "cudaStreamWaitEvent");
  const CommRequest& first = rv.members.begin()->second.request;
  const int n = static_cast<int>(rv.members.size());
  auto req = [&](int r) -> const CommRequest& { return rv.members.at(r).request; };
  switch (first.kind) {
    case CommKind::Send:
    case CommKind::Recv: {
      const CommRequest& s = req(0);
      const CommRequest& d = req(1);
      if (s.count != d.count)
        throw CudaError(fmt::format("loopback: a {}-byte message received into {} bytes", s.count, d.count));
      copy(d.recv, s.send, s.count, stream);
      break;
    }
    case CommKind::AllReduce: {
      // Sum in rank order into rank 0's buffer, then broadcast it: deterministic.
      float* acc = static_cast<float*>(req(0).recv);
      for (int r = 1; r < n; ++r)
        accumulate(DType::F32, acc, req(r).recv, static_cast<std::int64_t>(first.count), stream);
      for (int r = 1; r < n; ++r) copy(req(r).recv, acc, first.count * 4, stream);
      break;
    }
    case CommKind::ReduceScatter: {
      const std::size_t block = first.count;
      for (int r = 0; r < n; ++r) {
        float* out = static_cast<float*>(req(r).recv);
        copy(out, static_cast<const float*>(req(0).send) + static_cast<std::size_t>(r) * block, block * 4, stream);
        for (int m = 1; m < n; ++m)
          accumulate(DType::F32, out, static_cast<const float*>(req(m).send) + static_cast<std::size_t>(r) * block,
                     static_cast<std::int64_t>(block), stream);
      }
      break;
    }
    case CommKind::AllGather:
      for (int m = 0; m < n; ++m)
        for (int r = 0; r < n; ++r)
          copy(static_cast<char*>(req(m).recv) + static_cast<std::size_t>(r) * first.count, req(r).send, first.count,
               stream);
      break;
    case CommKind::AllToAll:
      for (int m = 0; m < n; ++m)
        for (int r = 0; r < n; ++r)
          copy(static_cast<char*>(req(m).recv) + static_cast<std::size_t>(r) * first.count,
               static_cast<const char*>(req(r).send) + static_cast<std::size_t>(m) * first.count, first.count, stream);
      break;
  }
  rv.done = new_event();
  check(cudaEventRecord(rv.done, stream), "cudaEventRecord");
  rv.launched = true;
}

bool LoopbackTransport::test(int ticket) {
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) throw CudaError("loopback: unknown ticket");
  std::lock_guard<std::mutex> lock(hub_.mutex_);
  auto rv_it = hub_.open_.find(it->second.key);
  auto& rv = rv_it->second;
  if (!rv.launched) return false;
  const cudaError_t q = cudaEventQuery(rv.done);
  if (q == cudaErrorNotReady) return false;
  check(q, "cudaEventQuery (loopback)");
  auto& me = rv.members.at(it->second.rank);
  if (!me.seen_done) {
    me.seen_done = true;
    ++rv.finished;
  }
  tickets_.erase(it);
  if (rv.finished == rv.expected) {
    for (auto& [rank, m] : rv.members) cudaEventDestroy(m.posted);
    cudaEventDestroy(rv.done);
    hub_.open_.erase(rv_it);
  }
  return true;
}

}  // namespace piper::runtime::cuda
