// The loopback transport: N virtual devices of one process exchange tensors on one GPU. Each request
// waits at a host-side rendezvous (comm.hpp's LoopbackTable, named by its LoopbackNamer) until every
// member has posted; the last member to arrive enqueues the whole exchange on its own stream (after
// waiting on the events the others recorded when they posted), then every member completes when
// that work's event has.
#include "piper/runtime/cuda/transport.hpp"

#include <fmt/format.h>

#include "piper/runtime/cuda/device.hpp"
#include "piper/runtime/cuda/kernels.hpp"
#include "piper/runtime/trainer.hpp"

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
  const LoopbackName name = namer_.name(r.kind, r.peer, r.pair, r.family, r.group);
  LoopbackHub::Member m;
  m.request = r;
  m.posted = new_event();
  check(cudaEventRecord(m.posted, r.stream), "cudaEventRecord");
  hub_.table_.join(name, std::move(m), device_, [&](LoopbackHub::Table::Rendezvous& rv) { launch(rv, r.stream); });
  const int t = next_ticket_++;
  tickets_.emplace(t, name);
  return t;
}

// Called with the hub locked by the last member to post; enqueues everything on `stream`.
void LoopbackTransport::launch(LoopbackHub::Table::Rendezvous& rv, cudaStream_t stream) {
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
  rv.shared = new_event();
  check(cudaEventRecord(rv.shared, stream), "cudaEventRecord");
}

bool LoopbackTransport::test(int ticket) {
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) throw CudaError("loopback: unknown ticket");
  if (hub_.aborted_) throw ReportedByAnotherRank();  // a peer failed: this exchange may never complete
  auto done = [](LoopbackHub::Table::Rendezvous& rv) {
    const cudaError_t q = cudaEventQuery(rv.shared);
    if (q == cudaErrorNotReady) return false;
    check(q, "cudaEventQuery (loopback)");
    return true;
  };
  auto release = [](LoopbackHub::Table::Rendezvous& rv) {
    for (auto& [rank, m] : rv.members) cudaEventDestroy(m.posted);
    cudaEventDestroy(rv.shared);
  };
  if (!hub_.table_.test(it->second, done, release)) return false;
  tickets_.erase(it);
  return true;
}

}  // namespace piper::runtime::cuda
