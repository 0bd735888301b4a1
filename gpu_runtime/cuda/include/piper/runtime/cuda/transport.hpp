// Communication of the CUDA backend behind one small interface: NCCL between processes (one rank per
// GPU, communicators split from an MPI-bootstrapped world), or loopback between the virtual devices
// of one process that share one GPU (device-to-device copies and the accumulate kernel).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

#include <cuda_runtime_api.h>
#include <mpi.h>

#include "piper/core/program.hpp"
#include "piper/runtime/comm.hpp"

namespace piper::runtime::cuda {

// CommKind is runtime::CommKind (comm.hpp), shared with the dataflow and the host transports.

// One communication of one device. Buffers are device pointers that stay valid until test() is true.
struct CommRequest {
  CommKind kind = CommKind::Send;
  int peer = -1;           // Send/Recv: the device at the other end
  int boundary = 0;        // Send/Recv: model layer boundary the tensor crosses
  bool backward = false;   // Send/Recv: gradient (true) or activation
  int pair = -1;           // Op::pair, the pairing id: who meets whom (core/readiness.hpp)
  int family = -1;         // collectives: Program family
  std::vector<int> group;  // collectives: the devices of my group, in rank order
  const void* send = nullptr;
  void* recv = nullptr;
  // Send/Recv: message bytes. AllReduce: fp32 elements in place in `recv`. ReduceScatter: fp32
  // elements per rank's block (send holds ranks blocks). AllGather/AllToAll: bytes per rank's block.
  std::size_t count = 0;
  cudaStream_t stream = nullptr;  // the op's stream (the work is ordered after its prior work)
};

class Transport {
 public:
  virtual ~Transport() = default;
  // Starts a request and returns its ticket.
  virtual int post(const CommRequest& r) = 0;
  // True once the request has completed on the GPU: its data written, its source no longer read.
  virtual bool test(int ticket) = 0;
  virtual std::string name() const = 0;
};

// ---- Loopback: the virtual devices of one process (one thread each) rendezvous here ----
// Exchanges are named and tracked by comm.hpp's LoopbackNamer and LoopbackTable (shared with the host
// backend's virtual devices); this transport only enqueues the copies and sums on the GPU.
class LoopbackHub {
 public:
  explicit LoopbackHub(int devices) : devices_(devices) {}
  int devices() const { return devices_; }
  // A device failed: every exchange still tested ends in ReportedByAnotherRank (trainer.hpp), so the
  // others stop now instead of at their stall timeout.
  void abort() { aborted_ = true; }

 private:
  friend class LoopbackTransport;
  std::atomic<bool> aborted_{false};
  struct Member {
    CommRequest request;
    cudaEvent_t posted = nullptr;  // recorded on the member's stream when it posted
  };
  // Shared: the event recorded after all the work, on the launching member's stream.
  using Table = LoopbackTable<Member, cudaEvent_t>;
  Table table_;
  int devices_;
};

class LoopbackTransport : public Transport {
 public:
  LoopbackTransport(LoopbackHub& hub, int device) : hub_(hub), device_(device), namer_(device) {}
  ~LoopbackTransport() override;
  int post(const CommRequest& r) override;
  bool test(int ticket) override;
  std::string name() const override { return "loopback"; }

 private:
  static void launch(LoopbackHub::Table::Rendezvous& rv, cudaStream_t stream);
  LoopbackHub& hub_;
  int device_;
  LoopbackNamer namer_;
  std::map<int, LoopbackName> tickets_;
  int next_ticket_ = 0;
};

// ---- NCCL: one rank per GPU ----
// Creates the world communicator over MPI and every communicator the Program needs, once: one per
// group of every collective family, and one per point-to-point channel (sender, receiver, layer
// boundary, direction) so that transfers of different channels never match each other in NCCL's
// issue-order matching. Collective over all ranks of `world` (every rank must construct it).
// A point-to-point channel: every tensor from `src` to `dst` crossing one layer boundary in one direction.
struct P2PChannel {
  int src = 0, dst = 0, boundary = 0;
  bool backward = false;
  auto operator<=>(const P2PChannel&) const = default;
};
// The Program's channels, sorted. Throws CudaError when a channel's SENDs (or RECVs) are spread over
// several streams or its two sides list its transfers in different orders: NCCL would mismatch them.
std::vector<P2PChannel> p2p_channels(const core::Program& program);

// `max_ctas` > 0 caps the CTAs (hence SMs) of every NCCL kernel (ncclConfig_t::maxCTAs): the
// communication side of an SM partition.
std::unique_ptr<Transport> make_nccl_transport(const core::Program& program, int device, MPI_Comm world,
                                               int max_ctas = 0);
bool nccl_available();

}  // namespace piper::runtime::cuda
