// The host backend: compute ops run the Eigen model on the op's microbatch and segment; SEND/RECV and
// collectives are non-blocking MPI on communicators created once per Program communicator group.
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

bool is_backward(core::Pass p) { return p == core::Pass::B || p == core::Pass::BI; }

template <class Map, class K>
auto take(Map& m, const K& key, const char* what) {
  auto it = m.find(key);
  if (it == m.end()) throw RuntimeError(fmt::format("runtime: plan order violated: {} is not available", what));
  auto v = std::move(it->second);
  m.erase(it);
  return v;
}

// What an ALL_REDUCE sums: the whole gradient, or with ZeRO the chunk a reduce-scatter inside the
// shard group left (HSDP: the all-reduce across the groups holding the same shard).
std::vector<float>& reduced_grads(host::SegmentParams& sp) {
  if (sp.zero_level < 1) return sp.grads;
  if (!sp.grad_chunk_ready)
    throw RuntimeError(fmt::format(
        "runtime: plan order violated: segment {}'s gradient chunk is all-reduced before its reduce-scatter",
        sp.segment));
  return sp.grad_chunk;
}

}  // namespace

// The tensor parallelism of a device set: that of its TP segments. Routed experts keep expert
// parallelism in segments without TP on the same devices; there the TP ranks of a group still share
// their data-parallel rank, and hold either the same tokens (plain TP) or their sequence slice (SP).
struct StageTp {
  int degree = 1;
  bool sequence_parallel = false;
  int cp = 1;  // context parallelism (model-wide): blocks of degree·cp devices share a data-parallel rank
};
StageTp stage_tp(const core::Program& program, core::DeviceSetId set) {
  StageTp t;
  for (const auto& seg : program.segments)
    if (seg.devices == set && !seg.tags.contains("EP") && seg.tp_degree > t.degree)  // routed experts' ETP aside
      t = {seg.tp_degree, seg.sequence_parallel, t.cp};
  for (const auto& seg : program.segments)
    if (seg.devices == set) t.cp = std::max(t.cp, seg.cp_degree);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Program -> model and data shape
// ---------------------------------------------------------------------------------------------
core::Model program_model(const core::Program& program) {
  if (program.model_spec.is_null() || program.model_spec.empty())
    throw std::invalid_argument(
        "plan: field 'model_spec' is empty; the runtime needs the model to train (compile from a model spec or zoo "
        "name)");
  core::Model model = core::build_model(core::config_from_spec_json(program.model_spec, "plan model_spec"));
  model.set_training(program.training);
  const int layers = static_cast<int>(model.layers().size());
  for (std::size_t s = 0; s < program.segments.size(); ++s)
    if (program.segments[s].last_layer > layers)
      throw std::invalid_argument(fmt::format("plan: segment {} spans layers up to {} but model '{}' has {} layers", s,
                                              program.segments[s].last_layer, model.name(), layers));
  return model;
}

DataShape data_shape(const core::Program& program) {
  DataShape d;
  d.microbatches = program.microbatches;
  d.micro_batch_size = program.training.micro_batch_size;
  d.seq_len = program.training.seq_len;
  d.ranks = 0;
  for (const auto& seg : program.segments) {
    if (seg.devices == core::kNoDevices) throw std::invalid_argument("plan: a segment is not placed on any device");
    // The TP ranks of a group work on the same data, the CP ranks of a group on one sequence's chunks:
    // data-parallel ranks are the blocks of tp x cp devices.
    const StageTp t = stage_tp(program, seg.devices);
    const int n =
        static_cast<int>(program.device_sets.at(static_cast<std::size_t>(seg.devices)).size()) / (t.degree * t.cp);
    if (d.ranks != 0 && n != d.ranks)
      throw std::invalid_argument(fmt::format(
          "plan: segments run on device sets of {} and {} devices; the runtime needs one data-parallel degree", d.ranks,
          n));
    d.ranks = n;
  }
  // Every op of a pass (compute, transfer, per-use gather) runs on one microbatch's data.
  for (const auto& plan : program.plans)
    for (const auto& stream : plan.streams)
      for (const auto& op : stream.ops)
        if (op.pass != core::Pass::None && op.microbatch < 0)
          throw std::invalid_argument(
              fmt::format("plan: op '{}' works on no single microbatch (a split that does not cover the whole model); "
                          "the runtime runs every op of a pass on one microbatch",
                          op.label));
  return d;
}

std::vector<host::SegmentSpec> device_segments(const core::Program& program, int device) {
  const core::Model model = program_model(program);
  std::vector<host::SegmentSpec> out;
  for (std::size_t s = 0; s < program.segments.size(); ++s) {
    const auto& seg = program.segments[s];
    const int pos = program.position_in(seg.devices, device);
    if (pos < 0) continue;
    host::SegmentSpec sp;
    sp.segment = static_cast<int>(s);
    sp.first_layer = seg.first_layer;
    sp.last_layer = seg.last_layer;
    sp.shard_degree = seg.shard_degree;
    // Shard groups are consecutive devices of the set; replicas of a shard are strided by the degree.
    sp.shard_index = pos % seg.shard_degree;
    sp.replicas = seg.replicas;
    sp.replica_index = pos / seg.shard_degree;
    sp.zero_level = seg.zero_level;
    sp.zero_shards = seg.zero_shards;
    // CP rank: blocks of tp x cp devices, TP innermost (the cp-groups pass's layout).
    sp.cp_degree = seg.cp_degree;
    sp.cp_rank = seg.cp_degree > 1 ? pos / std::max(1, seg.tp_degree) % seg.cp_degree : 0;
    // TP groups are consecutive devices too (Program::group_of(tp_family)); the DP replicas of a
    // TP slice are the devices with the same TP rank.
    bool experts = false;
    for (int l = seg.first_layer; l < seg.last_layer; ++l)
      experts = experts || model.layers().at(static_cast<std::size_t>(l)).kind == core::LayerKind::MoeExperts;
    if (seg.tp_degree > 1 && experts) {
      // Expert TP (Megatron-core's tp-ep-dp order): position = ETP rank + e (EP rank + ep (expert-DP rank)).
      const int e = seg.tp_degree;
      sp.tp_degree = e;
      sp.tp_rank = pos % e;
      sp.shard_index = pos / e % seg.shard_degree;
      sp.replica_index = pos / (e * seg.shard_degree);
      if (const StageTp t = stage_tp(program, seg.devices); t.degree > 1)
        sp.token_copies = t.sequence_parallel ? 1 : t.degree;
    } else if (seg.tp_degree > 1) {
      if (seg.shard_degree > 1)
        throw std::invalid_argument(fmt::format(
            "plan: segment {} is both sharded ({}) and tensor-parallel ({}); the host backend does not combine them", s,
            seg.shard_degree, seg.tp_degree));
      sp.tp_degree = seg.tp_degree;
      sp.tp_rank = pos % seg.tp_degree;
      sp.replica_index = pos / seg.tp_degree;
      sp.sequence_parallel = seg.sequence_parallel;
    } else if (const StageTp t = stage_tp(program, seg.devices); t.degree > 1) {
      // Only routed experts work on whatever rows they are given; attention needs whole sequences.
      for (int l = seg.first_layer; l < seg.last_layer; ++l)
        if (model.layers().at(static_cast<std::size_t>(l)).kind != core::LayerKind::MoeExperts)
          throw std::invalid_argument(
              fmt::format("plan: segment {} runs without TP on the devices of a TP {} stage but holds layer '{}' (only "
                          "routed experts may)",
                          s, t.degree, model.layers().at(static_cast<std::size_t>(l)).name));
      sp.token_copies = t.sequence_parallel ? 1 : t.degree;
    }
    // Op-level recomputation (TorchTitan's policy) changes memory and time, not values: the host
    // backend keeps those segments' activations, as without recomputation.
    sp.recompute = seg.recompute == core::Recompute::Full        ? host::RecomputeMode::Full
                   : seg.recompute == core::Recompute::Selective ? host::RecomputeMode::Selective
                                                                 : host::RecomputeMode::None;
    out.push_back(sp);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Backend
// ---------------------------------------------------------------------------------------------
struct HostBackend::Pending {
  bool deferred = false;  // a gradient reduction or update waiting for the tied-embedding sum
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Message message = MPI_MESSAGE_NULL;
  bool matched = false;  // RECV: the message was probed and its receive posted
  bool receive = false;  // RECV (tag = the pair's node)
  int tag = -1;
  int peer = -1;
  bool dispatch = false;  // ALL_TO_ALL: the first of its segment/pass/microbatch
  std::int64_t block = 0;
  std::vector<float> send, recv;
};

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
      owner_.match_posted_receives();
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
    : program_(program), plan_(program.plan_for(device)), device_(device), config_(config) {
  check_mpi(MPI_Comm_dup(world, &world_), "MPI_Comm_dup");
  MPI_Comm_set_errhandler(world_, MPI_ERRORS_RETURN);
  const core::Model model = program_model(program);
  num_layers_ = static_cast<int>(model.layers().size());
  shape_ = data_shape(program);
  for (std::size_t set = 0; set < program.device_sets.size(); ++set) {
    const StageTp t = stage_tp(program, static_cast<core::DeviceSetId>(set));
    set_tp_.push_back(t.degree);
    set_cp_.push_back(t.cp);
  }
  loss_scale_ = 1.0f / static_cast<float>(shape_.global_tokens());
  model_ = std::make_unique<host::HostModel>(model, device_segments(program, device), config.seed);
  stream_ = std::make_unique<host::TokenStream>(model.config() ? model.config()->vocab : 0, shape_.seq_len, config.seed,
                                                config.data_path);
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
  // TP groups: a duplicate of the family's communicator per TP family this device uses, so the
  // collectives inside compute ops never mix with the plan's own collectives on that family. Every
  // member duplicates in family order, which is the same on all of them.
  std::vector<bool> tp_family(program.families.size(), false);
  for (const auto& seg : program.segments)
    if (seg.tp_degree > 1) {
      if (seg.tp_family < 0 || seg.tp_family >= static_cast<int>(program.families.size()))
        throw std::invalid_argument(
            fmt::format("plan: a segment with tp_degree {} has no valid tp_family ({})", seg.tp_degree, seg.tp_family));
      tp_family[static_cast<std::size_t>(seg.tp_family)] = true;
    }
  for (std::size_t f = 0; f < tp_family.size(); ++f) {
    if (!tp_family[f] || family_comm_[f] == MPI_COMM_NULL) continue;
    MPI_Comm c = MPI_COMM_NULL;
    check_mpi(MPI_Comm_dup(family_comm_[f], &c), "MPI_Comm_dup (TP)");
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    tp_comms_[static_cast<int>(f)] = std::make_unique<MpiTpComm>(*this, c);
  }
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
  for (std::size_t f = 0; f < cp_family.size(); ++f) {
    if (!cp_family[f] || family_comm_[f] == MPI_COMM_NULL) continue;
    MPI_Comm c = MPI_COMM_NULL;
    check_mpi(MPI_Comm_dup(family_comm_[f], &c), "MPI_Comm_dup (CP)");
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    cp_comms_[static_cast<int>(f)] = std::make_unique<MpiTpComm>(*this, c);
  }
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
  setup_tied(program);
}

// Tied embeddings across segments. The embedding (first segment) and the head's copy (last segment)
// get the same initial values and must get the same updates: the device at position p of the
// embedding segment's device set and the device at position p of the head segment's set hold the same
// data-parallel rank and TP rank, so summing their two local gradients of the table (before the
// data-parallel reduction, which then sums over the ranks) gives both the gradient of the tied model.
void HostBackend::setup_tied(const core::Program& program) {
  if (!model_->tied()) return;
  const std::string who = fmt::format("plan: model '{}' ties its head to the embedding", model_->model().name());
  std::vector<int> embed_segs, head_segs;
  for (std::size_t s = 0; s < program.segments.size(); ++s) {
    const auto& sg = program.segments[s];
    if (sg.first_layer <= model_->embedding_layer() && model_->embedding_layer() < sg.last_layer)
      embed_segs.push_back(static_cast<int>(s));
    if (sg.first_layer <= model_->head_layer() && model_->head_layer() < sg.last_layer)
      head_segs.push_back(static_cast<int>(s));
  }
  if (embed_segs.size() != 1 || head_segs.size() != 1)
    throw std::invalid_argument(fmt::format(
        "{}, but the plan holds {} copies of the embedding and {} of the head (copies of the model in one plan); "
        "the host backend keeps exactly one embedding and one head in sync",
        who, embed_segs.size(), head_segs.size()));
  if (embed_segs[0] == head_segs[0]) return;  // one segment: the head uses the embedding's table directly
  // Which segments pair is typed: the head's segment names the embedding's (ProgramSegment::tied_to,
  // which lowering copies from the DAG's tied-embedding segments); the layer ranges above only count copies.
  const auto tied = std::find_if(program.segments.begin(), program.segments.end(),
                                 [](const core::ProgramSegment& sg) { return sg.tied_to >= 0; });
  if (tied == program.segments.end())
    throw std::invalid_argument(
        fmt::format("{}, but no segment of the plan keeps a tied copy of the table (segment field 'tied_to')", who));
  const int h = static_cast<int>(tied - program.segments.begin()), e = tied->tied_to;
  const auto& se = program.segments[static_cast<std::size_t>(e)];
  const auto& sh = program.segments[static_cast<std::size_t>(h)];
  const auto& de = program.device_sets.at(static_cast<std::size_t>(se.devices));
  const auto& dh = program.device_sets.at(static_cast<std::size_t>(sh.devices));
  if (de.size() != dh.size() || se.tp_degree != sh.tp_degree || se.shard_degree != 1 || sh.shard_degree != 1)
    throw std::invalid_argument(
        fmt::format("{}, but its embedding segment ({} devices, TP {}) and head segment ({} devices, TP {}) are not "
                    "laid out alike, "
                    "so the tied copies cannot be paired",
                    who, de.size(), se.tp_degree, dh.size(), sh.tp_degree));
  for (std::size_t p = 0; p < de.size(); ++p)  // the same verdict on every rank
    if (const int q = program.position_in(sh.devices, de[p]); q >= 0 && q != static_cast<int>(p))
      throw std::invalid_argument(fmt::format(
          "{}, but device {} holds the embedding for one data-parallel rank and the head for another (a mirrored, "
          "bidirectional placement); the host backend pairs each embedding with one head copy and does not run it",
          who, de[p]));
  const int pe = program.position_in(se.devices, device_), ph = program.position_in(sh.devices, device_);
  if (pe < 0 && ph < 0) return;
  tied_.embed_seg = pe >= 0 ? e : -1;
  tied_.head_seg = ph >= 0 ? h : -1;
  tied_.local = pe >= 0 && ph >= 0;
  if (tied_.local) return;
  // Across devices: this device's plan must sum the table with its partner, once per step.
  for (std::size_t f = 0; f < program.families.size(); ++f)
    if (program.families[f].purpose == core::FamilyPurpose::TiedEmbedding) tied_.family = static_cast<int>(f);
  int sums = 0;
  for (const auto& st : program.plan_for(device_).streams)
    sums += static_cast<int>(
        std::count_if(st.ops.begin(), st.ops.end(), [&](const core::Op& op) { return is_tied_sum(op); }));
  if (sums != 1)
    throw std::invalid_argument(
        fmt::format("{}, but device {}'s plan holds {} tied-embedding ALL_REDUCE ops, not 1 (a plan from an older "
                    "piper: compile it again)",
                    who, device_, sums));
}

bool HostBackend::is_tied_sum(const core::Op& op) const {
  return tied_.family >= 0 && op.family == tied_.family && op.kind == core::OpKind::AllReduce;
}

// V placements: both copies on this device; they are added once both segments' backwards are done.
void HostBackend::tied_backward_done(int seg) {
  if (!tied_.local || (seg != tied_.embed_seg && seg != tied_.head_seg)) return;
  ++tied_.backward_done[seg];
  if (tied_.backward_done[tied_.embed_seg] != shape_.microbatches ||
      tied_.backward_done[tied_.head_seg] != shape_.microbatches)
    return;
  auto a = model_->tied_grads(tied_.embed_seg), b = model_->tied_grads(tied_.head_seg);
  if (a.size() != b.size()) throw RuntimeError("runtime: the tied embedding's two copies differ in size");
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = b[i] = a[i] + b[i];
  tied_.finished = true;
}

bool HostBackend::touches_tied(const core::Op& op) const {
  if (!tied_.local || tied_.finished) return false;
  if (op.kind != core::OpKind::AllReduce && op.kind != core::OpKind::ReduceScatter && op.kind != core::OpKind::Update)
    return false;
  return std::any_of(op.segments.begin(), op.segments.end(),
                     [&](int s) { return s == tied_.embed_seg || s == tied_.head_seg; });
}

void HostBackend::match_posted_receives() {
  for (auto& [at, p] : pending_) {
    if (!p->receive || p->matched) continue;
    int flag = 0;
    MPI_Status status;
    check_mpi(MPI_Improbe(p->peer, p->tag, world_, &flag, &p->message, &status), "MPI_Improbe");
    if (!flag) continue;
    int count = 0;
    MPI_Get_count(&status, MPI_FLOAT, &count);
    p->recv.assign(static_cast<std::size_t>(count), 0.0f);
    check_mpi(MPI_Imrecv(p->recv.data(), count, MPI_FLOAT, &p->message, &p->request), "MPI_Imrecv");
    p->matched = true;
  }
}

HostBackend::~HostBackend() {
  tp_comms_.clear();
  for (auto& c : family_comm_)
    if (c != MPI_COMM_NULL) MPI_Comm_free(&c);
  if (world_ != MPI_COMM_NULL) MPI_Comm_free(&world_);
}

MPI_Comm HostBackend::comm_of(const core::Op& op) const {
  if (op.family < 0 || op.family >= static_cast<int>(family_comm_.size()) ||
      family_comm_[static_cast<std::size_t>(op.family)] == MPI_COMM_NULL)
    throw RuntimeError(
        fmt::format("runtime: device {} holds no group of family {} for '{}'", device_, op.family, op.label));
  return family_comm_[static_cast<std::size_t>(op.family)];
}

int HostBackend::mb_of(const core::Op& op) const { return op.microbatch; }  // -1 only outside passes (data_shape)

int HostBackend::data_rank_of(const core::Op& op) const {
  // An all-to-all of experts with expert TP runs on its segment's set listed EP group by EP group:
  // the data rank is the device's in the segment's own set.
  const core::DeviceSetId set = op.kind == core::OpKind::AllToAll && op.segment >= 0 &&
                                        static_cast<std::size_t>(op.segment) < program_.segments.size()
                                    ? program_.segments[static_cast<std::size_t>(op.segment)].devices
                                    : op.device_set;
  const int pos = program_.position_in(set, device_);
  if (pos < 0)
    throw RuntimeError(fmt::format("runtime: device {} is not in the device set of '{}'", device_, op.label));
  // The TP ranks of a group share their data-parallel rank (TP groups are consecutive devices), and so
  // do the CP ranks of a block of tp x cp devices.
  return pos / (set_tp_.at(static_cast<std::size_t>(set)) * set_cp_.at(static_cast<std::size_t>(set)));
}

host::MicrobatchData HostBackend::local_tokens(host::MicrobatchData d, const core::Op& op) const {
  const int cp = set_cp_.at(static_cast<std::size_t>(op.device_set));
  if (cp <= 1) return d;
  const int pos = program_.position_in(op.device_set, device_);
  const int rank = pos / set_tp_.at(static_cast<std::size_t>(op.device_set)) % cp;
  // Chunks rank and 2·cp-1-rank of each sequence (AttentionCp's load-balanced layout).
  const std::size_t S = static_cast<std::size_t>(shape_.seq_len), C = S / (2 * static_cast<std::size_t>(cp));
  host::MicrobatchData out;
  for (std::size_t b = 0; b < d.tokens.size() / S; ++b)
    for (std::size_t chunk : {static_cast<std::size_t>(rank), static_cast<std::size_t>(2 * cp - 1 - rank)}) {
      const std::size_t first = b * S + chunk * C;
      out.tokens.insert(out.tokens.end(), d.tokens.begin() + static_cast<std::ptrdiff_t>(first),
                        d.tokens.begin() + static_cast<std::ptrdiff_t>(first + C));
      out.targets.insert(out.targets.end(), d.targets.begin() + static_cast<std::ptrdiff_t>(first),
                         d.targets.begin() + static_cast<std::ptrdiff_t>(first + C));
    }
  return out;
}

void HostBackend::begin_step(int step) {
  step_ = step;
  loss_sum_ = 0;
}

void HostBackend::end_step() {
  // Every tensor the plan produced must have been consumed: leftovers mean a plan the runtime misread.
  if (!forward_.empty() || !backward_.empty() || !stash_.empty() || !ep_in_.empty() || !ep_out_.empty() ||
      !ep_grad_.empty() || !pending_.empty())
    throw RuntimeError(
        fmt::format("runtime: device {} ended step {} with unconsumed data ({} activations, {} gradients, {} stashes)",
                    device_, step_, forward_.size(), backward_.size(), stash_.size()));
  ep_source_.clear();
  a2a_seen_.clear();
  if ((tied_.embed_seg >= 0 || tied_.head_seg >= 0) && !tied_.finished)
    throw RuntimeError(fmt::format("runtime: device {} ended step {} before its tied-embedding gradients were summed",
                                   device_, step_));
  tied_.backward_done.clear();
  tied_.finished = false;
  ++steps_done_;
}

bool HostBackend::start(const core::OpRef& at, const core::Op& op) {
  if (touches_tied(op)) {
    auto p = std::make_unique<Pending>();
    p->deferred = true;
    pending_[at] = std::move(p);
    return false;
  }
  switch (op.kind) {
    case core::OpKind::Compute:
      run_compute(op);
      return true;
    case core::OpKind::Update:
      for (int s : op.segments) model_->update(s, config_.adamw, steps_done_ + 1);
      return true;
    default:
      start_comm(at, op);
      return poll(at, op);
  }
}

void HostBackend::run_compute(const core::Op& op) {
  const int s = op.segment, mb = mb_of(op);
  const auto& sg = seg(s);
  const bool sharded = sg.shard_degree > 1;
  const bool has_head = sg.last_layer == num_layers_;
  const SegKey sk{s, mb};
  if (op.pass == core::Pass::F) {
    if (sharded) {
      auto from = take(ep_in_, EpKey{s, false, mb}, "dispatched expert inputs");
      model_->experts_forward_entries(s, from, stash_[sk], &ep_out_[EpKey{s, false, mb}]);
      return;
    }
    host::ForwardState state;
    if (sg.first_layer > 0)
      state = take(forward_, Key{mb, data_rank_of(op), sg.first_layer}, "the activation entering the segment");
    const auto data = local_tokens(
        stream_->microbatch(step_, mb, data_rank_of(op), shape_.microbatches, shape_.ranks, shape_.micro_batch_size),
        op);
    loss_sum_ += model_->forward(s, data, loss_scale_, state, stash_[sk]);
    if (!has_head) forward_[Key{mb, data_rank_of(op), sg.last_layer}] = std::move(state);
    return;
  }
  if (op.pass == core::Pass::BW) {
    model_->backward_weight(s, stash_.at(sk));
    stash_.erase(sk);
    tied_backward_done(s);
    return;
  }
  // B or BI
  if (sharded) {
    auto from = take(ep_in_, EpKey{s, true, mb}, "dispatched expert gradients");
    model_->experts_backward_entries(s, from, stash_.at(sk), &ep_out_[EpKey{s, true, mb}]);
  } else {
    host::BackwardState g;
    if (!has_head) g = take(backward_, Key{mb, data_rank_of(op), sg.last_layer}, "the gradient leaving the segment");
    model_->backward_input(s, g, stash_.at(sk));
    if (sg.first_layer > 0) backward_[Key{mb, data_rank_of(op), sg.first_layer}] = std::move(g);
  }
  if (op.pass == core::Pass::B) {
    model_->backward_weight(s, stash_.at(sk));
    stash_.erase(sk);
    tied_backward_done(s);
  }
}

void HostBackend::start_comm(const core::OpRef& at, const core::Op& op) {
  auto p = std::make_unique<Pending>();
  const int mb = mb_of(op);
  switch (op.kind) {
    case core::OpKind::Send: {
      const auto& sg = seg(op.segment);
      p->peer = program_.peer_of(op, device_);
      if (is_backward(op.pass))
        p->send = take(backward_, Key{mb, data_rank_of(op), sg.first_layer}, "the gradient to send").serialize();
      else
        p->send = take(forward_, Key{mb, data_rank_of(op), sg.last_layer}, "the activation to send").serialize();
      // Synchronous send: completes when the receiver matched it, the rendezvous the simulator models.
      check_mpi(MPI_Issend(p->send.data(), static_cast<int>(p->send.size()), MPI_FLOAT, p->peer, op.pair, world_,
                           &p->request),
                "MPI_Issend");
      break;
    }
    case core::OpKind::Recv:  // probed in poll()
      p->peer = program_.peer_of(op, device_);
      p->receive = true;
      p->tag = op.pair;  // both sides carry the pairing id (core/readiness.hpp)
      break;
    case core::OpKind::AllReduce: {
      if (is_tied_sum(op)) {  // this device's copy of the tied table: its local gradient
        const auto g = model_->tied_grads(tied_.held());
        p->send.assign(g.begin(), g.end());
      } else {
        // Whole gradients; with ZeRO (HSDP's all-reduce across shard groups) the reduced chunks.
        for (int s : op.segments) {
          const auto& g = reduced_grads(model_->segment(s));
          p->send.insert(p->send.end(), g.begin(), g.end());
        }
      }
      check_mpi(MPI_Iallreduce(MPI_IN_PLACE, p->send.data(), static_cast<int>(p->send.size()), MPI_FLOAT, MPI_SUM,
                               comm_of(op), &p->request),
                "MPI_Iallreduce");
      break;
    }
    case core::OpKind::ReduceScatter: {
      // Block r holds replica r's chunk of every segment of the bucket (zero padded).
      MPI_Comm c = comm_of(op);
      int ranks = 0;
      MPI_Comm_size(c, &ranks);
      std::int64_t block = 0;
      for (int s : op.segments) block += model_->segment(s).chunk_floats;
      p->send.assign(static_cast<std::size_t>(block * ranks), 0.0f);
      for (int r = 0; r < ranks; ++r) {
        std::int64_t at_floats = r * block;
        for (int s : op.segments) {
          auto& sp = model_->segment(s);
          if (sp.zero_shards != ranks)
            throw RuntimeError(fmt::format("runtime: '{}' reduces over {} ranks but segment {} has {} ZeRO shards",
                                           op.label, ranks, s, sp.zero_shards));
          const std::int64_t n = static_cast<std::int64_t>(sp.grads.size());
          const std::int64_t b = std::min(n, r * sp.chunk_floats), e = std::min(n, b + sp.chunk_floats);
          std::copy(sp.grads.begin() + b, sp.grads.begin() + e, p->send.begin() + at_floats);
          at_floats += sp.chunk_floats;
        }
      }
      // Reducing after every microbatch: what was sent is out of the local buffer, which gathers the
      // next microbatches' gradients from zero; the shard sums the rounds (see finish()).
      for (int s : op.segments)
        if (program_.segments.at(static_cast<std::size_t>(s)).reduce_every_microbatch) {
          auto& g = model_->segment(s).grads;
          std::fill(g.begin(), g.end(), 0.0f);
        }
      p->recv.assign(static_cast<std::size_t>(block), 0.0f);
      check_mpi(MPI_Ireduce_scatter_block(p->send.data(), p->recv.data(), static_cast<int>(block), MPI_FLOAT, MPI_SUM,
                                          c, &p->request),
                "MPI_Ireduce_scatter_block");
      break;
    }
    case core::OpKind::AllGather: {
      MPI_Comm c = comm_of(op);
      int ranks = 0;
      MPI_Comm_size(c, &ranks);
      for (int s : op.segments) {
        auto& sp = model_->segment(s);
        std::vector<float> chunk = sp.master;
        chunk.resize(static_cast<std::size_t>(sp.chunk_floats), 0.0f);
        p->send.insert(p->send.end(), chunk.begin(), chunk.end());
      }
      p->block = static_cast<std::int64_t>(p->send.size());
      p->recv.assign(static_cast<std::size_t>(p->block * ranks), 0.0f);
      check_mpi(MPI_Iallgather(p->send.data(), static_cast<int>(p->block), MPI_FLOAT, p->recv.data(),
                               static_cast<int>(p->block), MPI_FLOAT, c, &p->request),
                "MPI_Iallgather");
      break;
    }
    case core::OpKind::AllToAll: {
      MPI_Comm c = comm_of(op);
      int ranks = 0;
      MPI_Comm_size(c, &ranks);
      const int s = op.segment;
      if (s < 0 || seg(s).shard_degree != ranks)
        throw RuntimeError(fmt::format("runtime: '{}' exchanges over {} ranks but its segment is sharded {} ways",
                                       op.label, ranks, s < 0 ? 0 : seg(s).shard_degree));
      const bool backward = is_backward(op.pass);
      const EpKey key{s, backward, mb};
      // The first all-to-all of a (segment, pass, microbatch) carries tokens into the sharded
      // experts, the second carries their results back: dataflow order, not a schedule property.
      p->dispatch = a2a_seen_[key]++ == 0;
      const std::int64_t cap = shape_.micro_batch_size * shape_.seq_len * model_->top_k();
      p->block = 1 + cap * (1 + model_->hidden());
      std::vector<host::ExpertPacket> out;
      const SegKey sk{s, mb};
      const int first = seg(s).first_layer;
      if (!backward && p->dispatch) {
        auto& state = forward_.at(Key{mb, data_rank_of(op), first});
        ep_source_[sk] = model_->route(state, ranks);
        out = model_->dispatch_forward(state, ep_source_[sk]);
      } else if (backward && p->dispatch) {
        auto g = take(backward_, Key{mb, data_rank_of(op), seg(s).last_layer}, "the gradient entering the experts");
        out = model_->dispatch_backward(g, ep_source_.at(sk));
        ep_grad_[sk] = std::move(g);
      } else {
        out = take(ep_out_, key, "the experts' results");
      }
      p->send = host::pack_packets(out, p->block, model_->hidden());
      p->recv.assign(p->send.size(), 0.0f);
      check_mpi(MPI_Ialltoall(p->send.data(), static_cast<int>(p->block), MPI_FLOAT, p->recv.data(),
                              static_cast<int>(p->block), MPI_FLOAT, c, &p->request),
                "MPI_Ialltoall");
      break;
    }
    default:
      throw RuntimeError(fmt::format("runtime: unexpected op kind for communication: {}", op.label));
  }
  pending_[at] = std::move(p);
}

bool HostBackend::poll(const core::OpRef& at, const core::Op& op) {
  auto it = pending_.find(at);
  if (it == pending_.end())
    throw RuntimeError(fmt::format("runtime: polled an op that is not in flight: {}", op.label));
  Pending& p = *it->second;
  if (p.deferred) {
    if (touches_tied(op)) return false;
    pending_.erase(it);
    return start(at, op);
  }
  if (op.kind == core::OpKind::Recv && !p.matched) {
    match_posted_receives();
    if (!p.matched) return false;
  }
  int done = 0;
  check_mpi(MPI_Test(&p.request, &done, MPI_STATUS_IGNORE), "MPI_Test");
  if (!done) return false;
  finish_comm(op, p);
  pending_.erase(it);
  return true;
}

void HostBackend::finish_comm(const core::Op& op, Pending& p) {
  const int mb = mb_of(op);
  switch (op.kind) {
    case core::OpKind::Send:
      break;
    case core::OpKind::Recv: {
      const auto& sg = seg(op.segment);
      if (is_backward(op.pass))
        backward_[Key{mb, data_rank_of(op), sg.last_layer}] = host::BackwardState::deserialize(p.recv);
      else
        forward_[Key{mb, data_rank_of(op), sg.first_layer}] = host::ForwardState::deserialize(p.recv);
      break;
    }
    case core::OpKind::AllReduce: {
      if (is_tied_sum(op)) {
        auto g = model_->tied_grads(tied_.held());
        std::copy(p.send.begin(), p.send.end(), g.begin());
        tied_.finished = true;
        break;
      }
      std::size_t at = 0;
      for (int s : op.segments) {
        auto& g = reduced_grads(model_->segment(s));
        std::copy(p.send.begin() + static_cast<std::ptrdiff_t>(at),
                  p.send.begin() + static_cast<std::ptrdiff_t>(at + g.size()), g.begin());
        at += g.size();
      }
      break;
    }
    case core::OpKind::ReduceScatter: {
      std::int64_t at = 0;
      for (int s : op.segments) {
        auto& sp = model_->segment(s);
        const auto from = p.recv.begin() + at, to = from + static_cast<std::int64_t>(sp.grad_chunk.size());
        if (program_.segments.at(static_cast<std::size_t>(s)).reduce_every_microbatch)
          std::transform(from, to, sp.grad_chunk.begin(), sp.grad_chunk.begin(), std::plus<float>());
        else
          std::copy(from, to, sp.grad_chunk.begin());
        sp.grad_chunk_ready = true;
        at += sp.chunk_floats;
      }
      break;
    }
    case core::OpKind::AllGather: {
      const auto ranks = static_cast<std::int64_t>(p.recv.size()) / p.block;
      std::int64_t at = 0;
      for (int s : op.segments) {
        auto& sp = model_->segment(s);
        const std::int64_t n = static_cast<std::int64_t>(sp.params.size());
        for (std::int64_t r = 0; r < ranks; ++r) {
          const std::int64_t b = std::min(n, r * sp.chunk_floats), e = std::min(n, b + sp.chunk_floats);
          std::copy(p.recv.begin() + r * p.block + at, p.recv.begin() + r * p.block + at + (e - b),
                    sp.params.begin() + b);
        }
        at += sp.chunk_floats;
        if (op.pass != core::Pass::None) ++sp.gathered;  // ZeRO-3 gather before a use; released with its buffer
      }
      break;
    }
    case core::OpKind::AllToAll: {
      int ranks = 0;
      MPI_Comm_size(comm_of(op), &ranks);
      auto in = host::unpack_packets(p.recv, ranks, p.block, model_->hidden());
      const int s = op.segment;
      const bool backward = is_backward(op.pass);
      const SegKey sk{s, mb};
      if (p.dispatch) {
        ep_in_[EpKey{s, backward, mb}] = std::move(in);
      } else if (!backward) {
        auto state = take(forward_, Key{mb, data_rank_of(op), seg(s).first_layer}, "the activation around the experts");
        model_->combine_forward(state, ep_source_.at(sk), in);
        forward_[Key{mb, data_rank_of(op), seg(s).last_layer}] = std::move(state);
      } else {
        auto g = take(ep_grad_, sk, "the gradient around the experts");
        model_->combine_backward(g, ep_source_.at(sk), in);
        backward_[Key{mb, data_rank_of(op), seg(s).first_layer}] = std::move(g);
      }
      break;
    }
    default:
      break;
  }
}

void HostBackend::buffer_freed(int buffer) {
  const auto& b = plan_.buffers.at(static_cast<std::size_t>(buffer));
  if (b.kind != core::BufferKind::GatheredParameters) return;
  const auto& op =
      plan_.streams.at(static_cast<std::size_t>(b.alloc.stream)).ops.at(static_cast<std::size_t>(b.alloc.index));
  for (int s : op.segments) {
    auto& sp = model_->segment(s);
    if (--sp.gathered <= 0) {
      sp.gathered = 0;
      model_->poison_params(s);
    }
  }
}

std::string HostBackend::describe_wait(const core::Op& op) const {
  if (op.kind == core::OpKind::Send || op.kind == core::OpKind::Recv)
    return fmt::format("'{}' with device {}", op.label, program_.peer_of(op, device_));
  if (op.family >= 0) {
    std::string members;
    for (int d : program_.group_of(op.family, device_)) members += fmt::format("{}{}", members.empty() ? "" : ",", d);
    return fmt::format("'{}' on devices [{}]", op.label, members);
  }
  return fmt::format("'{}'", op.label);
}

}  // namespace piper::runtime
