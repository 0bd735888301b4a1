// The NCCL transport: one MPI rank per GPU. The world communicator is bootstrapped over MPI
// (ncclGetUniqueId on rank 0, MPI_Bcast, ncclCommInitRank); every other communicator is split from it
// once, in an order all ranks derive from the Program. Requests are enqueued at once on the op's
// stream; completion is an event recorded after them.
#include "piper/runtime/cuda/transport.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "piper/runtime/cuda/device.hpp"

#ifdef PIPER_HAVE_NCCL
#include <nccl.h>
#endif

namespace piper::runtime::cuda {

namespace {
bool is_backward_pass(core::Pass p) { return p == core::Pass::B || p == core::Pass::BI; }
}  // namespace

std::vector<P2PChannel> p2p_channels(const core::Program& program) {
  // NCCL matches a channel's sends and receives by issue order, so each channel's SENDs must be on
  // one stream of the sender, its RECVs on one stream of the receiver, in the same pairing-id order.
  std::map<P2PChannel, std::pair<std::vector<int>, std::vector<int>>> order;  // send ids, recv ids
  std::map<P2PChannel, std::pair<std::set<int>, std::set<int>>> streams_of;
  for (int d = 0; d < program.num_devices; ++d) {
    const auto& plan = program.plan_for(d);
    for (std::size_t si = 0; si < plan.streams.size(); ++si)
      for (const auto& op : plan.streams[si].ops) {
        if (op.kind != core::OpKind::Send && op.kind != core::OpKind::Recv) continue;
        const auto& seg = program.segments.at(static_cast<std::size_t>(op.segment));
        const bool bwd = is_backward_pass(op.pass), send = op.kind == core::OpKind::Send;
        const int peer = program.peer_of(op, d);
        // The boundary the tensor crosses: SEND forward leaves at last_layer, backward at first_layer;
        // RECV the other way round.
        const int boundary = send == bwd ? seg.first_layer : seg.last_layer;
        const P2PChannel ch{send ? d : peer, send ? peer : d, boundary, bwd};
        (send ? order[ch].first : order[ch].second).push_back(op.pair);
        (send ? streams_of[ch].first : streams_of[ch].second).insert(static_cast<int>(si));
      }
  }
  std::vector<P2PChannel> out;
  for (const auto& [ch, nodes] : order) {
    if (nodes.first != nodes.second || streams_of[ch].first.size() != 1 || streams_of[ch].second.size() != 1)
      throw CudaError(fmt::format(
          "nccl: transfers {} -> {} at layer {} ({}) are not sent and received in one order on one stream each, "
          "which NCCL's issue-order matching needs (use --virtual-devices, or the host backend)",
          ch.src, ch.dst, ch.boundary, ch.backward ? "gradients" : "activations"));
    out.push_back(ch);
  }
  return out;
}

#ifdef PIPER_HAVE_NCCL

namespace {

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw CudaError(fmt::format("{}: {}", what, ncclGetErrorString(r)));
}

class NcclTransport : public Transport {
 public:
  NcclTransport(const core::Program& program, int device, MPI_Comm world, int max_ctas) : device_(device) {
    // Point-to-point channels of every device's plan, in one global order (checked before any
    // communicator exists: see p2p_channels).
    const auto channels = p2p_channels(program);
    int size = 0;
    MPI_Comm_size(world, &size);
    ncclUniqueId id{};
    if (device == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, world);
    // Split communicators are given the same configuration, so the CTA cap holds for all of them.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    if (max_ctas > 0) config.maxCTAs = max_ctas, config.minCTAs = 1;
    check_nccl(ncclCommInitRankConfig(&world_, size, id, device, &config), "ncclCommInitRankConfig");
    // One communicator per group of every family (family order, as the host backend's MPI_Comm_split).
    for (std::size_t f = 0; f < program.families.size(); ++f) {
      const auto group = program.group_of(static_cast<int>(f), device);
      int color = NCCL_SPLIT_NOCOLOR, key = 0;
      if (!group.empty()) {
        const auto groups = program.groups(static_cast<int>(f));
        color = static_cast<int>(std::find(groups.begin(), groups.end(), group) - groups.begin());
        key = static_cast<int>(std::find(group.begin(), group.end(), device) - group.begin());
      }
      ncclComm_t c = nullptr;
      ncclConfig_t split_config = config;
      check_nccl(ncclCommSplit(world_, color, key, &c, &split_config), "ncclCommSplit (family)");
      family_.push_back(c);
    }
    for (const auto& ch : channels) {
      const bool member = ch.src == device || ch.dst == device;
      ncclComm_t c = nullptr;
      ncclConfig_t split_config = config;
      check_nccl(ncclCommSplit(world_, member ? 0 : NCCL_SPLIT_NOCOLOR, ch.src == device ? 0 : 1, &c, &split_config),
                 "ncclCommSplit (channel)");
      if (member) p2p_[ch] = c;
    }
  }

  ~NcclTransport() override {
    for (auto& [t, e] : events_) cudaEventDestroy(e.first);
    for (auto& [ch, c] : p2p_) ncclCommDestroy(c);
    for (auto c : family_)
      if (c) ncclCommDestroy(c);
    if (world_) ncclCommDestroy(world_);
  }

  int post(const CommRequest& r) override {
    ncclComm_t c = nullptr;
    switch (r.kind) {
      case CommKind::Send: {
        // The channel communicator has two ranks: the sender is 0, the receiver 1.
        c = channel(Channel{device_, r.peer, r.boundary, r.backward});
        check_nccl(ncclSend(r.send, r.count, ncclUint8, 1, c, r.stream), "ncclSend");
        break;
      }
      case CommKind::Recv: {
        c = channel(Channel{r.peer, device_, r.boundary, r.backward});
        check_nccl(ncclRecv(r.recv, r.count, ncclUint8, 0, c, r.stream), "ncclRecv");
        break;
      }
      case CommKind::AllReduce:
        c = family(r);
        check_nccl(ncclAllReduce(r.recv, r.recv, r.count, ncclFloat32, ncclSum, c, r.stream), "ncclAllReduce");
        break;
      case CommKind::ReduceScatter:
        c = family(r);
        check_nccl(ncclReduceScatter(r.send, r.recv, r.count, ncclFloat32, ncclSum, c, r.stream), "ncclReduceScatter");
        break;
      case CommKind::AllGather:
        c = family(r);
        check_nccl(ncclAllGather(r.send, r.recv, r.count, ncclUint8, c, r.stream), "ncclAllGather");
        break;
      case CommKind::AllToAll: {
        // All-to-all as grouped point-to-point: block r of send goes to rank r.
        c = family(r);
        const int n = static_cast<int>(r.group.size());
        check_nccl(ncclGroupStart(), "ncclGroupStart");
        for (int peer = 0; peer < n; ++peer) {
          check_nccl(ncclSend(static_cast<const char*>(r.send) + static_cast<std::size_t>(peer) * r.count, r.count,
                              ncclUint8, peer, c, r.stream),
                     "ncclSend");
          check_nccl(ncclRecv(static_cast<char*>(r.recv) + static_cast<std::size_t>(peer) * r.count, r.count, ncclUint8,
                              peer, c, r.stream),
                     "ncclRecv");
        }
        check_nccl(ncclGroupEnd(), "ncclGroupEnd");
        break;
      }
    }
    cudaEvent_t e = nullptr;
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    check(cudaEventRecord(e, r.stream), "cudaEventRecord");
    const int t = next_++;
    events_[t] = {e, c};
    return t;
  }

  bool test(int ticket) override {
    auto it = events_.find(ticket);
    if (it == events_.end()) throw CudaError("nccl: unknown ticket");
    const cudaError_t q = cudaEventQuery(it->second.first);
    if (q == cudaErrorNotReady) {
      // A peer that failed leaves this op waiting forever: surface NCCL's asynchronous errors of the
      // communicator the op runs on (each split communicator reports its own).
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(it->second.second, &async);
      check_nccl(async, "NCCL (asynchronous error)");
      return false;
    }
    check(q, "cudaEventQuery (nccl)");
    cudaEventDestroy(it->second.first);
    events_.erase(it);
    return true;
  }

  std::string name() const override { return "nccl"; }

 private:
  using Channel = P2PChannel;
  ncclComm_t channel(const Channel& ch) const {
    auto it = p2p_.find(ch);
    if (it == p2p_.end())
      throw CudaError(fmt::format("nccl: no channel {}->{} at layer {}", ch.src, ch.dst, ch.boundary));
    return it->second;
  }
  ncclComm_t family(const CommRequest& r) const {
    if (r.family < 0 || r.family >= static_cast<int>(family_.size()) || !family_[static_cast<std::size_t>(r.family)])
      throw CudaError(fmt::format("nccl: device {} holds no group of family {}", device_, r.family));
    return family_[static_cast<std::size_t>(r.family)];
  }

  int device_;
  ncclComm_t world_ = nullptr;
  std::vector<ncclComm_t> family_;
  std::map<Channel, ncclComm_t> p2p_;
  std::map<int, std::pair<cudaEvent_t, ncclComm_t>> events_;  // ticket -> completion event, its communicator
  int next_ = 0;
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(const core::Program& program, int device, MPI_Comm world, int max_ctas) {
  return std::make_unique<NcclTransport>(program, device, world, max_ctas);
}
bool nccl_available() { return true; }

#else

std::unique_ptr<Transport> make_nccl_transport(const core::Program&, int, MPI_Comm, int) {
  throw CudaError("this build has no NCCL: multi-GPU runs need it (use --virtual-devices on one GPU)");
}
bool nccl_available() { return false; }

#endif

}  // namespace piper::runtime::cuda
