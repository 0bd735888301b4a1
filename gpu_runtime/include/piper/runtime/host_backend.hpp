// The host backend: one MPI rank is one device of the Program. Compute ops run the Eigen kernels of
// their segment's layers on their microbatch; transfers are MPI_Issend/Improbe+Imrecv; collectives are
// non-blocking MPI collectives on one communicator per Program communicator group.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <mpi.h>

#include "piper/core/program.hpp"
#include "piper/runtime/backend.hpp"
#include "piper/runtime/host_model.hpp"

namespace piper::runtime {

struct HostConfig {
  std::uint64_t seed = 1;
  std::string data_path;
  host::AdamWConfig adamw;
  double stall_timeout_s = 20;  // a TP collective inside a compute op waits at most this long for its group
};

// The data-parallel shape of a program, as the data and the loss need it.
struct DataShape {
  int microbatches = 1;  // Program::microbatches
  int ranks = 1;         // data-parallel ranks: devices of a compute op's device set
  std::int64_t micro_batch_size = 1, seq_len = 1;
  std::int64_t global_tokens() const {
    return static_cast<std::int64_t>(microbatches) * ranks * micro_batch_size * seq_len;
  }
};
DataShape data_shape(const core::Program& program);

// The model a Program trains: its spec with the Program's training shape; checks the layer count.
core::Model program_model(const core::Program& program);

// Which segments `device` holds and how (shard / replica index, ZeRO level).
std::vector<host::SegmentSpec> device_segments(const core::Program& program, int device);

class HostBackend : public Backend {
 public:
  HostBackend(const core::Program& program, int device, MPI_Comm world, const HostConfig& config);
  ~HostBackend() override;
  HostBackend(const HostBackend&) = delete;
  HostBackend& operator=(const HostBackend&) = delete;

  void begin_step(int step) override;
  bool start(const core::OpRef& at, const core::Op& op) override;
  bool poll(const core::OpRef& at, const core::Op& op) override;
  void buffer_freed(int buffer) override;
  void end_step() override;
  std::string describe_wait(const core::Op& op) const override;

  double loss_sum() const { return loss_sum_; }  // this device's summed token losses of the step
  host::HostModel& model() { return *model_; }
  int steps_done() const { return steps_done_; }
  void set_steps_done(int steps) { steps_done_ = steps; }

 private:
  struct Pending;
  class MpiTpComm;
  // Tied embeddings (GPT) with the embedding and the head in different segments: the two copies'
  // gradients are summed once both are complete (after the segment's last backward of the step),
  // before anything reads them (the data-parallel reduction, the update). Across devices the plan's
  // "tied-embedding" ALL_REDUCE does it (the plan orders it); on one device (V placements) the
  // backend adds the two after the later segment's last backward, and holds the reductions and the
  // update that read them until then.
  struct TiedSync {
    int embed_seg = -1, head_seg = -1;  // the segments, when they differ and this device holds one
    bool local = false;                 // this device holds both (same data and TP rank)
    int family = -1;                    // the plan's "tied-embedding" family (-1: none)
    std::map<int, int> backward_done;   // segment -> B/BW ops run this step
    bool finished = false;              // the sum is in place for this step
    int held() const { return embed_seg >= 0 ? embed_seg : head_seg; }  // across devices: the one here
  };
  void setup_tied(const core::Program& program);
  void tied_backward_done(int seg);
  bool touches_tied(const core::Op& op) const;  // a local sum still due before this op
  bool is_tied_sum(const core::Op& op) const;
  // Posts the receive of every in-flight RECV whose message has arrived (also while a compute op
  // blocks in a TP collective).
  void match_posted_receives();
  void run_compute(const core::Op& op);
  void start_comm(const core::OpRef& at, const core::Op& op);
  void finish_comm(const core::Op& op, Pending& p);
  MPI_Comm comm_of(const core::Op& op) const;
  int mb_of(const core::Op& op) const;
  int data_rank_of(const core::Op& op) const;
  host::MicrobatchData local_tokens(host::MicrobatchData d, const core::Op& op) const;  // CP: this rank's chunks
  const core::ProgramSegment& seg(int s) const { return program_.segments.at(static_cast<std::size_t>(s)); }

  const core::Program& program_;
  const core::Plan& plan_;
  int device_;
  MPI_Comm world_ = MPI_COMM_NULL;
  std::vector<MPI_Comm> family_comm_;                   // this device's group communicator per family (or null)
  std::map<int, std::unique_ptr<MpiTpComm>> tp_comms_;  // TP family -> this device's TP group
  std::map<int, std::unique_ptr<MpiTpComm>> cp_comms_;  // CP family -> this device's CP group
  std::vector<int> set_tp_;                             // device set -> TP degree of its stage
  std::vector<int> set_cp_;                             // device set -> CP degree of its segments
  HostConfig config_;
  DataShape shape_;
  float loss_scale_ = 1;
  int num_layers_ = 0;
  std::unique_ptr<host::HostModel> model_;
  std::unique_ptr<host::TokenStream> stream_;
  int step_ = 0, steps_done_ = 0;
  double loss_sum_ = 0;

  // Data in flight between ops, keyed by microbatch and model layer boundary (the tensor entering
  // that layer in the forward direction, or leaving it in the backward direction).
  // The data-parallel rank is part of the key: with mirrored placements one device runs different
  // ranks' data in different segments (its position differs between their device sets).
  using Key = std::tuple<int, int, int>;     // (microbatch, data-parallel rank, layer)
  using SegKey = std::pair<int, int>;        // (segment, microbatch)
  using EpKey = std::tuple<int, bool, int>;  // (segment, backward, microbatch)
  std::map<Key, host::ForwardState> forward_;
  std::map<Key, host::BackwardState> backward_;
  std::map<SegKey, host::SegmentStash> stash_;
  std::map<SegKey, host::ExpertSource> ep_source_;
  std::map<SegKey, host::BackwardState> ep_grad_;
  std::map<EpKey, std::vector<host::ExpertPacket>> ep_in_, ep_out_;
  std::map<EpKey, int> a2a_seen_;
  std::map<core::OpRef, std::unique_ptr<Pending>> pending_;
  TiedSync tied_;
};

}  // namespace piper::runtime
