// The host backend's virtual devices: every device of the Program as one thread of this process.
// Transfers and the plan's collectives meet at the loopback hub (comm.hpp); the TP and CP collectives
// inside compute ops meet as threads (rank_group.hpp's ThreadMeeting). Sums run in rank order, so
// every member of a collective gets the same bits.
#include <algorithm>
#include <functional>

#include <fmt/format.h>

#include "piper/runtime/executor.hpp"
#include "piper/runtime/host_backend.hpp"
#include "piper/runtime/trainer.hpp"

namespace piper::runtime {

// ---------------------------------------------------------------------------------------------
// The threads' shared state
// ---------------------------------------------------------------------------------------------
HostThreads::HostThreads(const core::Program& program, double stall_timeout_s) : program_(program) {
  // One meeting per group of every family that some segment uses for TP or CP.
  std::vector<bool> used(program.families.size(), false);
  auto mark = [&](int family) {
    if (family >= 0 && family < static_cast<int>(used.size())) used[static_cast<std::size_t>(family)] = true;
  };
  for (const auto& seg : program.segments) {
    if (seg.tp_degree > 1) mark(seg.tp_family);
    if (seg.cp_degree > 1) mark(seg.cp_family);
  }
  for (std::size_t f = 0; f < used.size(); ++f)
    if (used[f])
      for (const auto& group : program.groups(static_cast<int>(f)))
        if (!group.empty())
          meetings_[{static_cast<int>(f), group.front()}] =
              std::make_unique<ThreadMeeting>(static_cast<int>(group.size()), stall_timeout_s);
}

void HostThreads::abort() {
  aborted_ = true;
  for (auto& [key, meeting] : meetings_) meeting->abandon();
}

ThreadMeeting* HostThreads::group_meeting(int family, int device) {
  const auto group = program_.group_of(family, device);
  if (group.empty()) return nullptr;
  auto it = meetings_.find({family, group.front()});
  return it == meetings_.end() ? nullptr : it->second.get();
}

// ---------------------------------------------------------------------------------------------
// Transport
// ---------------------------------------------------------------------------------------------
namespace {

using Buf = std::vector<float>;
using Rendezvous = LoopbackTable<HostThreads::Member, HostThreads::Nothing>::Rendezvous;

void require_size(const Buf& b, std::size_t n, const char* what) {
  if (b.size() != n)
    throw RuntimeError(fmt::format("runtime: loopback {} of {} floats met a buffer of {}", what, n, b.size()));
}

// Runs with the hub locked by the member that completed the exchange; every buffer is its owner's
// until the owner sees the exchange complete.
void move_data(Rendezvous& rv) {
  auto post = [&](int m) -> const CommPost<Buf>& { return rv.members.at(m).post; };
  const int n = static_cast<int>(rv.members.size());
  const CommPost<Buf>& first = post(0);
  switch (first.kind) {
    case CommKind::Send:
    case CommKind::Recv:
      *post(1).recv = *post(0).send;  // the receive buffer takes the message's size, as MPI's probe does
      break;
    case CommKind::AllReduce: {
      Buf acc = *first.recv;
      for (int m = 1; m < n; ++m) {
        require_size(*post(m).recv, acc.size(), "all-reduce");
        std::transform(acc.begin(), acc.end(), post(m).recv->begin(), acc.begin(), std::plus<float>());
      }
      for (int m = 0; m < n; ++m) *post(m).recv = acc;
      break;
    }
    case CommKind::ReduceScatter: {
      const std::size_t block = first.recv->size();
      for (int m = 0; m < n; ++m) require_size(*post(m).send, block * static_cast<std::size_t>(n), "reduce-scatter");
      for (int m = 0; m < n; ++m) {
        Buf& out = *post(m).recv;
        require_size(out, block, "reduce-scatter");
        const auto at = static_cast<std::ptrdiff_t>(block * static_cast<std::size_t>(m));
        std::copy_n(post(0).send->begin() + at, block, out.begin());
        for (int r = 1; r < n; ++r)
          std::transform(out.begin(), out.end(), post(r).send->begin() + at, out.begin(), std::plus<float>());
      }
      break;
    }
    case CommKind::AllGather: {
      const std::size_t block = first.send->size();
      for (int m = 0; m < n; ++m) {
        require_size(*post(m).send, block, "all-gather");
        require_size(*post(m).recv, block * static_cast<std::size_t>(n), "all-gather");
      }
      for (int m = 0; m < n; ++m)
        for (int r = 0; r < n; ++r)
          std::copy(post(r).send->begin(), post(r).send->end(),
                    post(m).recv->begin() + static_cast<std::ptrdiff_t>(block * static_cast<std::size_t>(r)));
      break;
    }
    case CommKind::AllToAll: {
      const std::size_t block = first.send->size() / static_cast<std::size_t>(n);
      for (int m = 0; m < n; ++m) {
        require_size(*post(m).send, block * static_cast<std::size_t>(n), "all-to-all");
        require_size(*post(m).recv, block * static_cast<std::size_t>(n), "all-to-all");
      }
      for (int m = 0; m < n; ++m)
        for (int r = 0; r < n; ++r)
          std::copy_n(post(r).send->begin() + static_cast<std::ptrdiff_t>(block * static_cast<std::size_t>(m)), block,
                      post(m).recv->begin() + static_cast<std::ptrdiff_t>(block * static_cast<std::size_t>(r)));
      break;
    }
  }
}

}  // namespace

int LoopbackTransport::post(const CommPost<Buf>& r, const HostKernels::Ctx&) {
  const LoopbackName name = namer_.name(r.kind, r.peer, r.pair, r.family, r.group);
  threads_.table().join(name, HostThreads::Member{r}, device_, move_data);
  const int ticket = next_ticket_++;
  tickets_.emplace(ticket, name);
  return ticket;
}

bool LoopbackTransport::test(int ticket) {
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) throw RuntimeError(fmt::format("runtime: unknown loopback ticket {}", ticket));
  if (threads_.aborted()) throw ReportedByAnotherRank();  // a peer failed: this exchange may never complete
  // The data moved when the exchange launched: complete as soon as it has.
  if (!threads_.table().test(
          it->second, [](Rendezvous&) { return true; }, [](Rendezvous&) {}))
    return false;
  tickets_.erase(it);
  return true;
}

// ---------------------------------------------------------------------------------------------
// TP and CP groups as threads
// ---------------------------------------------------------------------------------------------
// Blocking, like MpiTpComm: the model calls it inside compute ops. Every member reads the others'
// inputs while they wait, then writes its own output after the meeting.
class HostBackend::ThreadTpComm : public host::TpComm {
 public:
  ThreadTpComm(HostBackend& owner, ThreadMeeting& meeting, int rank) : owner_(owner), meeting_(meeting), rank_(rank) {}
  int size() const override { return meeting_.members(); }
  int rank() const override { return rank_; }
  void allreduce_sum(float* d, std::int64_t n) override {
    reduce(d, n, [](float a, float b) { return a + b; });
  }
  void allreduce_max(float* d, std::int64_t n) override {
    reduce(d, n, [](float a, float b) { return std::max(a, b); });
  }
  void allgather(const float* in, std::int64_t n, float* out) override {
    meeting_.meet(
        rank_, in,
        [&](const std::vector<const void*>& all) {
          for (std::size_t r = 0; r < all.size(); ++r)
            std::copy_n(static_cast<const float*>(all[r]), n, out + static_cast<std::int64_t>(r) * n);
        },
        "a tensor-parallel all-gather", idle_);
  }
  void reduce_scatter(const float* in, std::int64_t n, float* out) override {
    std::vector<float> acc(static_cast<std::size_t>(n), 0.0f);
    meeting_.meet(
        rank_, in,
        [&](const std::vector<const void*>& all) {
          for (const void* p : all) {
            const float* theirs = static_cast<const float*>(p) + static_cast<std::int64_t>(rank_) * n;
            std::transform(acc.begin(), acc.end(), theirs, acc.begin(), std::plus<float>());
          }
        },
        "a tensor-parallel reduce-scatter", idle_);
    std::copy(acc.begin(), acc.end(), out);
  }

 private:
  template <class Op>
  void reduce(float* d, std::int64_t n, Op op) {
    std::vector<float> acc(d, d + n);
    meeting_.meet(
        rank_, d,
        [&](const std::vector<const void*>& all) {
          std::copy_n(static_cast<const float*>(all[0]), n, acc.begin());
          for (std::size_t r = 1; r < all.size(); ++r)
            std::transform(acc.begin(), acc.end(), static_cast<const float*>(all[r]), acc.begin(), op);
        },
        "a tensor-parallel all-reduce", idle_);
    std::copy(acc.begin(), acc.end(), d);
  }
  HostBackend& owner_;
  // While it waits for its group, the device's other streams keep moving (Backend::progress).
  std::function<void()> idle_ = [this] { owner_.progress(); };
  ThreadMeeting& meeting_;
  int rank_;
};

HostBackend::HostBackend(const core::Program& program, int device, HostThreads& threads, const HostConfig& config)
    : device_(device), config_(config) {
  check_capabilities(program, host_capabilities());
  model_ = std::make_unique<host::HostModel>(program_model(program), device_segments(program, device), config.seed);
  transport_ = std::make_unique<LoopbackTransport>(threads, device);
  setup_group_comms(program, [&](int family, const char*) -> std::unique_ptr<host::TpComm> {
    ThreadMeeting* m = threads.group_meeting(family, device);
    if (!m) return nullptr;
    const auto group = program.group_of(family, device);
    const auto rank = static_cast<int>(std::find(group.begin(), group.end(), device) - group.begin());
    return std::make_unique<ThreadTpComm>(*this, *m, rank);
  });
  init_flow(program);
}

}  // namespace piper::runtime
