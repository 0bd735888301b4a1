// The host backend: one MPI rank is one device of the Program. Compute ops run the Eigen kernels of
// their segment's layers on their microbatch; transfers are MPI_Issend/Improbe+Imrecv; collectives are
// non-blocking MPI collectives on one communicator per Program communicator group.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <mpi.h>

#include "piper/core/program.hpp"
#include "piper/runtime/backend.hpp"
#include "piper/runtime/dataflow.hpp"
#include "piper/runtime/host_model.hpp"

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
  void require_tied() const {}
  Ctx ctx(int) const { return {}; }
  void begin_step(int) {}
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
  void update(const Ctx&, int s, int step) { m_.update(s, adamw_, step); }
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
};

// Transport: non-blocking MPI. SEND is MPI_Issend (tag: the pair's node), RECV probes its message
// (MPI_Improbe) and receives it (MPI_Imrecv); collectives run on one communicator per Program
// communicator group, created collectively by all ranks in family order.
class MpiTransport {
 public:
  MpiTransport(const core::Program& program, int device, MPI_Comm world);
  ~MpiTransport();
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;
  int post(const CommPost<std::vector<float>>& r, const HostKernels::Ctx&);
  bool test(int ticket);
  std::string name() const { return ""; }
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

class HostBackend : public Backend {
 public:
  HostBackend(const core::Program& program, int device, MPI_Comm world, const HostConfig& config);
  ~HostBackend() override;
  HostBackend(const HostBackend&) = delete;
  HostBackend& operator=(const HostBackend&) = delete;

  void begin_step(int step) override { flow_->begin_step(step); }
  bool start(const core::OpRef& at, const core::Op& op) override { return flow_->start(at, op); }
  bool poll(const core::OpRef& at, const core::Op& op) override { return flow_->poll(at, op); }
  void buffer_freed(int buffer) override { flow_->buffer_freed(buffer); }
  void end_step() override { flow_->end_step(); }
  std::string describe_wait(const core::Op& op) const override { return flow_->describe_wait(op); }

  double loss_sum() const { return flow_->loss_sum(); }  // this device's summed token losses of the step
  host::HostModel& model() { return *model_; }
  int steps_done() const { return flow_->steps_done(); }
  void set_steps_done(int steps) { flow_->set_steps_done(steps); }

 private:
  class MpiTpComm;
  void setup_group_comms(const core::Program& program);

  int device_;
  HostConfig config_;
  std::unique_ptr<MpiTransport> transport_;
  std::map<int, std::unique_ptr<MpiTpComm>> tp_comms_;  // TP family -> this device's TP group
  std::map<int, std::unique_ptr<MpiTpComm>> cp_comms_;  // CP family -> this device's CP group
  std::unique_ptr<host::HostModel> model_;
  std::unique_ptr<HostKernels> kernels_;
  std::unique_ptr<Dataflow<HostKernels, MpiTransport>> flow_;
};

}  // namespace piper::runtime
