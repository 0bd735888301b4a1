// The host backend: compute ops run the Eigen model on the op's microbatch and segment; SEND/RECV and
// collectives are non-blocking MPI on communicators created once per Program communicator group
// (virtual devices: host_loopback.cpp).
#include "piper/runtime/host_backend.hpp"

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "piper/runtime/executor.hpp"

namespace piper::runtime {

namespace {

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw RuntimeError(fmt::format("{} failed: {}", what, std::string(text, static_cast<std::size_t>(len))));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Backend
// ---------------------------------------------------------------------------------------------
// A segment's TP group over MPI. The model calls it inside compute ops, which the executor runs
// synchronously; while a collective waits for its peers this rank keeps matching the receives its
// other streams have posted, so that a peer's synchronous send (its stream may be blocked on it)
// completes as it would if this op were asynchronous.
class HostBackend::MpiTpComm : public host::TpComm {
 public:
  MpiTpComm(HostBackend& owner, MPI_Comm comm) : owner_(owner), comm_(comm) {
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_rank(comm_, &rank_);
  }
  ~MpiTpComm() override { MPI_Comm_free(&comm_); }
  MpiTpComm(const MpiTpComm&) = delete;
  MpiTpComm& operator=(const MpiTpComm&) = delete;
  int size() const override { return size_; }
  int rank() const override { return rank_; }
  void allreduce_sum(float* d, std::int64_t n) override {
    MPI_Request r;
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, d, count(n), MPI_FLOAT, MPI_SUM, comm_, &r), "MPI_Iallreduce (TP)");
    wait(r);
  }
  void allreduce_max(float* d, std::int64_t n) override {
    MPI_Request r;
    check_mpi(MPI_Iallreduce(MPI_IN_PLACE, d, count(n), MPI_FLOAT, MPI_MAX, comm_, &r), "MPI_Iallreduce (TP)");
    wait(r);
  }
  void allgather(const float* in, std::int64_t n, float* out) override {
    MPI_Request r;
    check_mpi(MPI_Iallgather(in, count(n), MPI_FLOAT, out, count(n), MPI_FLOAT, comm_, &r), "MPI_Iallgather (TP)");
    wait(r);
  }
  void reduce_scatter(const float* in, std::int64_t n, float* out) override {
    MPI_Request r;
    check_mpi(MPI_Ireduce_scatter_block(in, out, count(n), MPI_FLOAT, MPI_SUM, comm_, &r),
              "MPI_Ireduce_scatter_block (TP)");
    wait(r);
  }

 private:
  static int count(std::int64_t n) {
    if (n > std::numeric_limits<int>::max()) throw RuntimeError("runtime: a TP collective exceeds MPI's int count");
    return static_cast<int>(n);
  }
  void wait(MPI_Request& r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      int done = 0;
      check_mpi(MPI_Test(&r, &done, MPI_STATUS_IGNORE), "MPI_Test (TP)");
      if (done) return;
      owner_.mpi_->match_posted_receives();
      owner_.progress();  // the device's other streams keep moving while this compute op waits
      if (spins > 1000) {
        if (std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(owner_.config_.stall_timeout_s))
          throw RuntimeError(
              fmt::format("runtime: a tensor-parallel collective of device {} waited {:.0f} s for its group (a peer "
                          "died or the plan deadlocks)",
                          owner_.device_, owner_.config_.stall_timeout_s));
        std::this_thread::sleep_for(std::chrono::microseconds(50));  // ranks often outnumber cores in tests
      }
    }
  }
  HostBackend& owner_;
  MPI_Comm comm_;
  int size_ = 1, rank_ = 0;
};

HostBackend::HostBackend(const core::Program& program, int device, MPI_Comm world, const HostConfig& config)
    : device_(device), config_(config) {
  check_capabilities(program, host_capabilities());
  model_ = std::make_unique<host::HostModel>(program_model(program), device_segments(program, device), config.seed);
  auto mpi = std::make_unique<MpiTransport>(program, device, world);
  mpi_ = mpi.get();
  transport_ = std::move(mpi);
  // TP and CP groups: a duplicate of the family's communicator, so the collectives inside compute ops
  // never mix with the plan's own collectives on that family. Every member duplicates in family
  // order, which is the same on all of them.
  setup_group_comms(program, [this](int family, const char* what) -> std::unique_ptr<host::TpComm> {
    if (mpi_->family_comm(family) == MPI_COMM_NULL) return nullptr;
    MPI_Comm c = MPI_COMM_NULL;
    check_mpi(MPI_Comm_dup(mpi_->family_comm(family), &c), fmt::format("MPI_Comm_dup ({})", what).c_str());
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    return std::make_unique<MpiTpComm>(*this, c);
  });
  init_flow(program);
}

// The kernels over model_ and the dataflow over transport_.
void HostBackend::init_flow(const core::Program& program) {
  kernels_ = std::make_unique<HostKernels>(*model_, data_shape(program), config_.adamw);
  flow_ = std::make_unique<Dataflow<HostKernels, HostTransport>>(program, device_, *kernels_, *transport_, config_.seed,
                                                                 config_.data_path);
  flow_->set_loss_scaling(config_.adamw.loss_scaling);
}

// TP and CP groups: one group comm per TP (CP) family this device uses, made by `group_comm` in
// family order.
void HostBackend::setup_group_comms(const core::Program& program, const GroupComm& group_comm) {
  const int device = device_;
  std::vector<bool> tp_family(program.families.size(), false);
  for (const auto& seg : program.segments)
    if (seg.tp_degree > 1) {
      if (seg.tp_family < 0 || seg.tp_family >= static_cast<int>(program.families.size()))
        throw std::invalid_argument(
            fmt::format("plan: a segment with tp_degree {} has no valid tp_family ({})", seg.tp_degree, seg.tp_family));
      tp_family[static_cast<std::size_t>(seg.tp_family)] = true;
    }
  for (std::size_t f = 0; f < tp_family.size(); ++f)
    if (tp_family[f])
      if (auto c = group_comm(static_cast<int>(f), "TP")) tp_comms_[static_cast<int>(f)] = std::move(c);
  // CP groups: the same, per CP family (members in CP-rank order, so the communicator's rank is the CP rank).
  for (const auto& seg : program.segments) {
    if (seg.cp_degree <= 1 || program.position_in(seg.devices, device) < 0) continue;
    if (seg.cp_family < 0 || seg.cp_family >= static_cast<int>(program.families.size()))
      throw std::invalid_argument(
          fmt::format("plan: a segment with cp_degree {} has no valid cp_family ({})", seg.cp_degree, seg.cp_family));
  }
  std::vector<bool> cp_family(program.families.size(), false);
  for (const auto& seg : program.segments)
    if (seg.cp_degree > 1) cp_family[static_cast<std::size_t>(seg.cp_family)] = true;
  for (std::size_t f = 0; f < cp_family.size(); ++f)
    if (cp_family[f])
      if (auto c = group_comm(static_cast<int>(f), "CP")) cp_comms_[static_cast<int>(f)] = std::move(c);
  for (auto& sp : model_->segments()) {
    if (sp.cp_degree <= 1) continue;
    const auto& seg = program.segments.at(static_cast<std::size_t>(sp.segment));
    auto it = cp_comms_.find(seg.cp_family);
    if (it == cp_comms_.end() || static_cast<int>(program.group_of(seg.cp_family, device).size()) != seg.cp_degree)
      throw std::invalid_argument(
          fmt::format("plan: segment {}'s CP family {} gives device {} no group of cp_degree {}", sp.segment,
                      seg.cp_family, device, seg.cp_degree));
    model_->set_cp_comm(sp.segment, it->second.get());
  }
  for (auto& sp : model_->segments()) {
    if (sp.tp_degree <= 1) continue;
    const auto& seg = program.segments.at(static_cast<std::size_t>(sp.segment));
    auto it = tp_comms_.find(seg.tp_family);
    const auto group = program.group_of(seg.tp_family, device);
    if (it == tp_comms_.end() || static_cast<int>(group.size()) != seg.tp_degree)
      throw std::invalid_argument(
          fmt::format("plan: segment {}'s TP family {} gives device {} a group of {} devices, not tp_degree {}",
                      sp.segment, seg.tp_family, device, group.size(), seg.tp_degree));
    model_->set_tp_comm(sp.segment, it->second.get());
  }
}

// ---------------------------------------------------------------------------------------------
// Transport: MPI
// ---------------------------------------------------------------------------------------------
MpiTransport::MpiTransport(const core::Program& program, int device, MPI_Comm world) : device_(device) {
  check_mpi(MPI_Comm_dup(world, &world_), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(world_, MPI_ERRORS_RETURN);
  // One communicator per group of every family, created collectively by all ranks in family order.
  for (std::size_t f = 0; f < program.families.size(); ++f) {
    const auto group = program.group_of(static_cast<int>(f), device);
    int color = MPI_UNDEFINED, key = 0;
    if (!group.empty()) {
      const auto groups = program.groups(static_cast<int>(f));
      color = static_cast<int>(std::find(groups.begin(), groups.end(), group) - groups.begin());
      key = static_cast<int>(std::find(group.begin(), group.end(), device) - group.begin());
    }
    MPI_Comm c = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(world_, color, key, &c), "MPI_Comm_split");
    if (c != MPI_COMM_NULL) MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    family_comm_.push_back(c);
  }
}

MpiTransport::~MpiTransport() {
  for (auto& c : family_comm_)
    if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
  if (world_ != MPI_COMM_NULL) MPI_Comm_free(&world_);
}

MPI_Comm MpiTransport::family_comm(int family) const {
  if (family < 0 || family >= static_cast<int>(family_comm_.size())) return MPI_COMM_NULL;
  return family_comm_[static_cast<std::size_t>(family)];
}

namespace {
int mpi_count(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    throw RuntimeError(fmt::format("runtime: {} exceeds MPI's int count", what));
  return static_cast<int>(n);
}
}  // namespace

int MpiTransport::post(const CommPost<std::vector<float>>& r, const HostKernels::Ctx&) {
  Ticket t;
  MPI_Comm c = MPI_COMM_NULL;
  if (r.kind != CommKind::Send && r.kind != CommKind::Recv) {
    c = family_comm(r.family);
    if (c == MPI_COMM_NULL)
      throw RuntimeError(fmt::format("runtime: device {} holds no group of family {}", device_, r.family));
  }
  const int ranks = static_cast<int>(r.group.size());
  switch (r.kind) {
    case CommKind::Send:  // synchronous: completes when the receiver matched it, the rendezvous the simulator models
      check_mpi(MPI_Issend(r.send->data(), mpi_count(r.send->size(), "a message"), MPI_FLOAT, r.peer, r.pair, world_,
                           &t.request),
                "MPI_Issend");
      break;
    case CommKind::Recv:  // probed in test()
      t.receive = true;
      t.peer = r.peer;
      t.tag = r.pair;  // both sides carry the pairing id (core/readiness.hpp)
      t.recv = r.recv;
      break;
    case CommKind::AllReduce:
      check_mpi(MPI_Iallreduce(MPI_IN_PLACE, r.recv->data(), mpi_count(r.recv->size(), "an all-reduce"), MPI_FLOAT,
                               MPI_SUM, c, &t.request),
                "MPI_Iallreduce");
      break;
    case CommKind::ReduceScatter:
      check_mpi(MPI_Ireduce_scatter_block(r.send->data(), r.recv->data(), mpi_count(r.recv->size(), "a block"),
                                          MPI_FLOAT, MPI_SUM, c, &t.request),
                "MPI_Ireduce_scatter_block");
      break;
    case CommKind::AllGather: {
      const int block = mpi_count(r.send->size(), "a block");
      check_mpi(MPI_Iallgather(r.send->data(), block, MPI_FLOAT, r.recv->data(), block, MPI_FLOAT, c, &t.request),
                "MPI_Iallgather");
      break;
    }
    case CommKind::AllToAll: {
      const int block = mpi_count(r.send->size() / static_cast<std::size_t>(std::max(1, ranks)), "a block");
      check_mpi(MPI_Ialltoall(r.send->data(), block, MPI_FLOAT, r.recv->data(), block, MPI_FLOAT, c, &t.request),
                "MPI_Ialltoall");
      break;
    }
  }
  const int id = next_ticket_++;
  tickets_[id] = t;
  return id;
}

bool MpiTransport::test(int ticket) {
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) throw RuntimeError(fmt::format("runtime: unknown MPI request {}", ticket));
  Ticket& t = it->second;
  if (t.receive && !t.matched) {
    match_posted_receives();
    if (!t.matched) return false;
  }
  int done = 0;
  check_mpi(MPI_Test(&t.request, &done, MPI_STATUS_IGNORE), "MPI_Test");
  if (!done) return false;
  tickets_.erase(it);
  return true;
}

void MpiTransport::match_posted_receives() {
  for (auto& [id, t] : tickets_) {
    if (!t.receive || t.matched) continue;
    int flag = 0;
    MPI_Status status;
    check_mpi(MPI_Improbe(t.peer, t.tag, world_, &flag, &t.message, &status), "MPI_Improbe");
    if (!flag) continue;
    int count = 0;
    MPI_Get_count(&status, MPI_FLOAT, &count);
    t.recv->assign(static_cast<std::size_t>(count), 0.0f);
    check_mpi(MPI_Imrecv(t.recv->data(), count, MPI_FLOAT, &t.message, &t.request), "MPI_Imrecv");
    t.matched = true;
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels: the Eigen model's float vectors
// ---------------------------------------------------------------------------------------------
std::span<float> HostKernels::vec(int s, Vec v) {
  auto& sp = m_.segment(s);
  switch (v) {
    case Vec::Grads:
      return sp.grads;
    case Vec::GradChunk:
      return sp.grad_chunk;
    case Vec::Master:
      return sp.master;
    case Vec::Params:
      return sp.params;
    case Vec::TiedGrads:
      return m_.tied_grads(s);
  }
  return {};
}

void HostKernels::write(const Ctx&, int s, Vec v, std::int64_t at, const Buf& src, std::int64_t from, std::int64_t n,
                        bool add) {
  auto x = vec(s, v);
  const auto b = src.begin() + from;
  if (add)
    std::transform(b, b + n, x.begin() + at, x.begin() + at, std::plus<float>());
  else
    std::copy(b, b + n, x.begin() + at);
}

HostBackend::~HostBackend() {
  flow_.reset();
  kernels_.reset();
  model_.reset();
  tp_comms_.clear();
  cp_comms_.clear();
  transport_.reset();
}

}  // namespace piper::runtime
