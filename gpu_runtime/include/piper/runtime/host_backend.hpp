// The host backend: one MPI rank is one device of the Program, or one thread of a process that runs
// every device (virtual devices). Compute ops run the Eigen kernels of their segment's layers on their
// microbatch. Between MPI ranks, transfers are MPI_Issend/Improbe+Imrecv and collectives are
// non-blocking MPI collectives on one communicator per Program communicator group; between threads,
// both go through the loopback hub (comm.hpp) and TP/CP collectives meet as threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <mpi.h>

#include "piper/core/program.hpp"
#include "piper/runtime/backend.hpp"
#include "piper/runtime/comm.hpp"
#include "piper/runtime/dataflow.hpp"
#include "piper/runtime/host_model.hpp"
#include "piper/runtime/rank_group.hpp"

namespace piper::runtime {

struct HostConfig {
  std::uint64_t seed = 1;
  std::string data_path;
  host::AdamWConfig adamw;
  double stall_timeout_s = 20;  // a TP collective inside a compute op waits at most this long for its group
};

// The host side of the two dataflow interfaces (dataflow.hpp). Kernels: the Eigen model; buffers are
// fp32 host vectors; every op completes synchronously.
class HostKernels {
 public:
  struct Ctx {};
  struct Mark {};
  using Buf = std::vector<float>;
  using Forward = host::ForwardState;
  using Backward = host::BackwardState;
  using Stash = host::SegmentStash;
  using Source = host::ExpertSource;
  using Packet = host::ExpertPacket;

  HostKernels(host::HostModel& model, const DataShape& shape, host::AdamWConfig adamw)
      : m_(model), shape_(shape), adamw_(adamw) {}
  const core::Model& model() const { return m_.model(); }
  bool tied() const { return m_.tied(); }
  int embedding_layer() const { return m_.embedding_layer(); }
  int head_layer() const { return m_.head_layer(); }
  Ctx ctx(int) const { return {}; }
  void begin_step(int) { grad_scale_ = 1; }
  double end_step(double host_loss) { return host_loss; }
  Mark begin_op(const Ctx&) { return {}; }
  void end_op(const Ctx&, Mark&) {}
  bool op_done(const core::OpRef&, Mark&, const core::Op&) { return true; }

  double forward(const Ctx&, int s, const host::MicrobatchData& d, float scale, Forward& st, Stash& stash) {
    return m_.forward(s, d, scale, st, stash);
  }
  void backward_input(const Ctx&, int s, Backward& g, Stash& stash) { m_.backward_input(s, g, stash); }
  void backward_weight(const Ctx&, int s, Stash& stash) { m_.backward_weight(s, stash); }
  Source route(const Ctx&, const Forward& st, int ranks) { return m_.route(st, ranks); }
  std::vector<Packet> dispatch_forward(const Ctx&, const Forward& st, const Source& src) {
    return m_.dispatch_forward(st, src);
  }
  std::vector<Packet> dispatch_backward(const Ctx&, Backward& g, const Source& src) {
    return m_.dispatch_backward(g, src);
  }
  void experts_forward_entries(const Ctx&, int s, const std::vector<Packet>& from, Stash& st, std::vector<Packet>* to) {
    m_.experts_forward_entries(s, from, st, to);
  }
  void experts_backward_entries(const Ctx&, int s, const std::vector<Packet>& from, Stash& st,
                                std::vector<Packet>* to) {
    m_.experts_backward_entries(s, from, st, to);
  }
  void combine_forward(const Ctx&, Forward& st, Source& src, const std::vector<Packet>& in) {
    m_.combine_forward(st, src, in);
  }
  void combine_backward(const Ctx&, Backward& g, const Source& src, const std::vector<Packet>& in) {
    m_.combine_backward(g, src, in);
  }
  void update(const Ctx&, int s, int step) {
    host::AdamWConfig cfg = adamw_.at(step);
    cfg.grad_scale = grad_scale_;
    m_.update(s, cfg, step);
  }
  // Gradient clipping: this device's owned sum of squares into out[0]; the all-reduced sum sets the
  // scale of this step's updates.
  void grad_sq(const Ctx&, const std::vector<int>& segments, Buf& out, double loss_scale) {
    double sum = 0;
    for (int s : segments) sum += m_.owned_grad_sq(s, loss_scale);
    out.assign(1, static_cast<float>(sum));
  }
  double clip_to(const Ctx&, const Buf& norm_sq, double max_norm, double loss_scale) {
    grad_scale_ = unscale_and_clip(norm_sq.at(0), max_norm, loss_scale);
    return norm_sq.at(0);
  }
  void discard_grads(const Ctx&, int s) { m_.discard_grads(s); }
  void poison(int s) { m_.poison_params(s); }

  Buf pack_forward(const Ctx&, Forward&& st) { return st.serialize(); }
  Buf pack_backward(const Ctx&, Backward&& g) { return g.serialize(); }
  Buf message_buffer(const Ctx&) { return {}; }  // sized by the transport when the message arrives
  Forward unpack_forward(const Ctx&, Buf& b) { return host::ForwardState::deserialize(b); }
  Backward unpack_backward(const Ctx&, Buf& b) { return host::BackwardState::deserialize(b); }
  Buf pack_packets(const Ctx&, const std::vector<Packet>& out, int) {
    return host::pack_packets(out, packet_block(), m_.hidden());
  }
  Buf packet_buffer(const Ctx&, int ranks) { return Buf(static_cast<std::size_t>(packet_block() * ranks), 0.0f); }
  std::vector<Packet> unpack_packets(const Ctx&, Buf& b, int ranks) {
    return host::unpack_packets(b, ranks, packet_block(), m_.hidden());
  }

  Buf floats(const Ctx&, std::int64_t n) { return Buf(static_cast<std::size_t>(n), 0.0f); }
  std::int64_t size(int s, Vec v) { return static_cast<std::int64_t>(vec(s, v).size()); }
  void zero(const Ctx&, int s, Vec v) {
    auto x = vec(s, v);
    std::fill(x.begin(), x.end(), 0.0f);
  }
  void read(const Ctx&, Buf& dst, std::int64_t at, int s, Vec v, std::int64_t from, std::int64_t n) {
    auto x = vec(s, v);
    std::copy(x.begin() + from, x.begin() + from + n, dst.begin() + at);
  }
  void write(const Ctx&, int s, Vec v, std::int64_t at, const Buf& src, std::int64_t from, std::int64_t n, bool add);
  bool& grad_chunk_ready(int s) { return m_.segment(s).grad_chunk_ready; }
  int& gathered(int s) { return m_.segment(s).gathered; }
  host::SegmentParams& layout(int s) { return m_.segment(s); }

 private:
  std::span<float> vec(int s, Vec v);
  // An all-to-all block per peer: a count, then up to T·k entries of an expert id and a row.
  std::int64_t packet_block() const {
    return 1 + shape_.micro_batch_size * shape_.seq_len * m_.top_k() * (1 + m_.hidden());
  }
  host::HostModel& m_;
  DataShape shape_;
  host::AdamWConfig adamw_;
  float grad_scale_ = 1;
};

// The host side of the dataflow's Transport interface.
class HostTransport {
 public:
  virtual ~HostTransport() = default;
  virtual int post(const CommPost<std::vector<float>>& r, const HostKernels::Ctx& ctx) = 0;
  virtual bool test(int ticket) = 0;
  virtual std::string name() const = 0;
};

// Transport: non-blocking MPI. SEND is MPI_Issend (tag: the pair's node), RECV probes its message
// (MPI_Improbe) and receives it (MPI_Imrecv); collectives run on one communicator per Program
// communicator group, created collectively by all ranks in family order.
class MpiTransport : public HostTransport {
 public:
  MpiTransport(const core::Program& program, int device, MPI_Comm world);
  ~MpiTransport() override;
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;
  int post(const CommPost<std::vector<float>>& r, const HostKernels::Ctx&) override;
  bool test(int ticket) override;
  std::string name() const override { return ""; }
  // Posts the receive of every posted RECV whose message has arrived (also while a compute op blocks
  // in a TP collective, so that a peer's synchronous send completes).
  void match_posted_receives();
  MPI_Comm family_comm(int family) const;

 private:
  struct Ticket {
    MPI_Request request = MPI_REQUEST_NULL;
    MPI_Message message = MPI_MESSAGE_NULL;
    bool receive = false, matched = false;
    int peer = -1, tag = -1;
    std::vector<float>* recv = nullptr;
  };
  int device_;
  MPI_Comm world_ = MPI_COMM_NULL;
  std::vector<MPI_Comm> family_comm_;  // this device's group communicator per family (or null)
  std::map<int, Ticket> tickets_;
  int next_ticket_ = 0;
};

// What the virtual devices of one process share: the loopback hub of their transfers and collectives,
// and one ThreadMeeting per TP or CP group. Built before the devices' threads start.
class HostThreads {
 public:
  HostThreads(const core::Program& program, double stall_timeout_s);
  struct Member {
    CommPost<std::vector<float>> post;
  };
  struct Nothing {};
  LoopbackTable<Member, Nothing>& table() { return table_; }
  // The meeting of `family`'s group that holds `device` (nullptr: none).
  ThreadMeeting* group_meeting(int family, int device);
  // A device failed: every transfer still waiting and every TP/CP meeting ends in ReportedByAnotherRank
  // (the others stop now instead of at their stall timeout).
  void abort();
  bool aborted() const { return aborted_; }

 private:
  std::atomic<bool> aborted_{false};
  const core::Program& program_;
  LoopbackTable<Member, Nothing> table_;
  std::map<std::pair<int, int>, std::unique_ptr<ThreadMeeting>> meetings_;  // (family, first member)
};

// Transport between the threads of HostThreads: the member that completes an exchange moves the
// data (sums in rank order, so every member gets the same bits) before any member sees it complete.
class LoopbackTransport : public HostTransport {
 public:
  LoopbackTransport(HostThreads& threads, int device) : threads_(threads), device_(device), namer_(device) {}
  int post(const CommPost<std::vector<float>>& r, const HostKernels::Ctx&) override;
  bool test(int ticket) override;
  std::string name() const override { return "loopback"; }

 private:
  HostThreads& threads_;
  int device_;
  LoopbackNamer namer_;
  std::map<int, LoopbackName> tickets_;
  int next_ticket_ = 0;
};

class HostBackend : public Backend {
 public:
  HostBackend(const core::Program& program, int device, MPI_Comm world, const HostConfig& config);
  // A virtual device: one thread of `threads`.
  HostBackend(const core::Program& program, int device, HostThreads& threads, const HostConfig& config);
  ~HostBackend() override;
  HostBackend(const HostBackend&) = delete;
  HostBackend& operator=(const HostBackend&) = delete;

  void begin_step(int step) override { flow_->begin_step(step); }
  bool start(const core::OpRef& at, const core::Op& op) override { return flow_->start(at, op); }
  bool poll(const core::OpRef& at, const core::Op& op) override { return flow_->poll(at, op); }
  void buffer_freed(int buffer) override { flow_->buffer_freed(buffer); }
  void end_step() override { flow_->end_step(); }
  std::string describe_wait(const core::Op& op) const override { return flow_->describe_wait(op); }

  double loss_sum() const { return flow_->loss_sum(); }    // this device's summed token losses of the step
  double grad_norm() const { return flow_->grad_norm(); }  // the step's global gradient norm (clip_grad), or -1
  host::HostModel& model() { return *model_; }
  DataflowBase& flow() { return *flow_; }  // steps done, loss scaling

 private:
  class MpiTpComm;
  class ThreadTpComm;
  using GroupComm = std::function<std::unique_ptr<host::TpComm>(int family, const char* what)>;
  void init_flow(const core::Program& program);
  void setup_group_comms(const core::Program& program, const GroupComm& group_comm);

  int device_;
  HostConfig config_;
  std::unique_ptr<HostTransport> transport_;
  MpiTransport* mpi_ = nullptr;                            // transport_ between MPI ranks
  std::map<int, std::unique_ptr<host::TpComm>> tp_comms_;  // TP family -> this device's TP group
  std::map<int, std::unique_ptr<host::TpComm>> cp_comms_;  // CP family -> this device's CP group
  std::unique_ptr<host::HostModel> model_;
  std::unique_ptr<HostKernels> kernels_;
  std::unique_ptr<Dataflow<HostKernels, HostTransport>> flow_;
};

}  // namespace piper::runtime
