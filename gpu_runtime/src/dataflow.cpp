// The executor dataflow's backend-neutral parts (dataflow.hpp): the Program's data shape and per-device
// segments, the data-parallel rank and tokens of an op, the tied-embedding pairing, and the capability
// check that refuses a plan a backend cannot run.
#include "piper/runtime/dataflow.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

namespace piper::runtime {

// The tensor parallelism of a device set: that of its TP segments. Routed experts keep expert
// parallelism in segments without TP on the same devices; there the TP ranks of a group still share
// their data-parallel rank, and hold either the same tokens (plain TP) or their sequence slice (SP).
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
  core::Model model = core::plan_model(program);
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

// Tied embeddings across segments. The embedding (first segment) and the head's copy (last segment)
// get the same initial values and must get the same updates: the device at position p of the
// embedding segment's device set and the device at position p of the head segment's set hold the same
// data-parallel rank and TP rank, so summing their two local gradients of the table (before the
// data-parallel reduction, which then sums over the ranks) gives both the gradient of the tied model.
void DataflowBase::setup_tied(bool tied, int embedding_layer, int head_layer, const std::string& model_name) {
  if (!tied) return;
  const core::Program& program = program_;
  const std::string who = fmt::format("plan: model '{}' ties its head to the embedding", model_name);
  std::vector<int> embed_segs, head_segs;
  for (std::size_t s = 0; s < program.segments.size(); ++s) {
    const auto& sg = program.segments[s];
    if (sg.first_layer <= embedding_layer && embedding_layer < sg.last_layer) embed_segs.push_back(static_cast<int>(s));
    if (sg.first_layer <= head_layer && head_layer < sg.last_layer) head_segs.push_back(static_cast<int>(s));
  }
  if (embed_segs.size() != 1 || head_segs.size() != 1)
    throw std::invalid_argument(fmt::format(
        "{}, but the plan holds {} copies of the embedding and {} of the head (copies of the model in one plan); "
        "the host backend keeps exactly one embedding and one head in sync",
        who, embed_segs.size(), head_segs.size()));
  if (embed_segs[0] == head_segs[0]) return;  // one segment: the head uses the embedding's table directly
  // Which segments pair is typed: the head's segment names the embedding's (ProgramSegment::tied_to,
  // which lowering copies from the DAG's tied-embedding segments); the layer ranges above only count copies.
  const auto head = std::find_if(program.segments.begin(), program.segments.end(),
                                 [](const core::ProgramSegment& sg) { return sg.tied_to >= 0; });
  if (head == program.segments.end())
    throw std::invalid_argument(
        fmt::format("{}, but no segment of the plan keeps a tied copy of the table (segment field 'tied_to')", who));
  const int h = static_cast<int>(head - program.segments.begin()), e = head->tied_to;
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

bool DataflowBase::touches_tied(const core::Op& op) const {
  if (!tied_.local || tied_.finished) return false;
  if (op.kind != core::OpKind::AllReduce && op.kind != core::OpKind::ReduceScatter && op.kind != core::OpKind::Update)
    return false;
  return std::any_of(op.segments.begin(), op.segments.end(),
                     [&](int s) { return s == tied_.embed_seg || s == tied_.head_seg; });
}

// ---------------------------------------------------------------------------------------------
// Capabilities
// ---------------------------------------------------------------------------------------------
Capabilities host_capabilities() {
  return Capabilities{"the host backend", "", true, true, true, true, true, true, true};
}

Capabilities cuda_capabilities() {
  Capabilities c;
  c.backend = "the CUDA backend";
  c.alternative = "the host backend (--backend host) runs it";
  return c;
}

namespace {

bool holds_experts(const core::Model& model, const core::ProgramSegment& seg) {
  for (int l = seg.first_layer; l < seg.last_layer && l < static_cast<int>(model.layers().size()); ++l)
    if (model.layers().at(static_cast<std::size_t>(l)).kind == core::LayerKind::MoeExperts) return true;
  return false;
}

// The first GPT-style feature of the model (LayerNorm, GELU, biases, tied head, learned positions).
std::string gpt_feature(const core::Model& model) {
  for (const auto& l : model.layers()) {
    std::string what;
    if (l.kind == core::LayerKind::Norm && l.shape.norm == core::NormKind::LayerNorm)
      what = "LayerNorm";
    else if (l.kind == core::LayerKind::Mlp && l.shape.activation == core::MlpActivation::GELU)
      what = "a GELU MLP";
    else if ((l.kind == core::LayerKind::Attention || l.kind == core::LayerKind::Mlp) && l.shape.bias)
      what = "linear biases";
    else if (l.kind == core::LayerKind::Head && l.shape.tied_with_embedding)
      what = "a head tied to the embedding";
    else if (l.kind == core::LayerKind::Embedding && l.shape.max_positions > 0)
      what = "learned positions";
    if (!what.empty()) return fmt::format("{} (layer '{}')", what, l.name);
  }
  return "";
}

// The first segment-level feature the capabilities lack, as "segment S <does what>; <backend> does not
// run <feature>" (empty: none).
std::string segment_feature(const core::Program& program, const core::Model& model, const Capabilities& caps) {
  for (std::size_t s = 0; s < program.segments.size(); ++s) {
    const auto& seg = program.segments[s];
    const bool experts = holds_experts(model, seg);
    std::string what, feature;
    if (seg.tp_degree > 1 && experts && !caps.expert_tensor_parallel)
      what = fmt::format("splits its routed experts over {} expert-tensor-parallel ranks", seg.tp_degree),
      feature = "expert tensor parallelism (compile with --etp 1)";
    else if (seg.tp_degree > 1 && !experts && seg.sequence_parallel && !caps.sequence_parallel)
      what = fmt::format("is sequence-parallel (tp_degree {} with SP)", seg.tp_degree),
      feature = "sequence parallelism";
    else if (seg.tp_degree > 1 && !experts && !caps.tensor_parallel)
      what = fmt::format("is tensor-parallel (tp_degree {})", seg.tp_degree), feature = "tensor parallelism";
    else if (seg.cp_degree > 1 && !caps.context_parallel)
      what = fmt::format("is context-parallel (cp_degree {})", seg.cp_degree), feature = "context parallelism";
    else if (seg.zero_shards != seg.replicas && !caps.hsdp)
      what = fmt::format("uses HSDP (ZeRO shards over groups of {} of its {} replicas)", seg.zero_shards, seg.replicas),
      feature = "HSDP";
    else if (seg.a2a_chunks > 1 && !caps.chunked_all_to_all)
      what = fmt::format("chunks its expert all-to-alls ({} chunks)", seg.a2a_chunks),
      feature = "chunked all-to-alls (compile with --a2a-chunks 1)";
    else if (seg.fp8_dispatch)
      what = "moves its expert all-to-alls in fp8", feature = "fp8 all-to-alls (compile without --fp8-dispatch)";
    else if (seg.reduce_every_microbatch && !caps.reduce_every_microbatch)
      what = "reduces its ZeRO-2/3 gradients after every microbatch",
      feature = "per-microbatch reduction (compile with --reduce-every step)";
    if (!what.empty()) return fmt::format("segment {} {}; {} does not run {}", s, what, caps.backend, feature);
  }
  return "";
}

}  // namespace

std::string unsupported_feature(const core::Program& program, const Capabilities& caps) {
  const core::Model model = program_model(program);
  std::string why = segment_feature(program, model, caps);
  if (why.empty() && !caps.gpt_layers)
    if (const std::string f = gpt_feature(model); !f.empty())
      why = fmt::format("model '{}' has {}; {} runs RMSNorm/SwiGLU/RoPE models only (no GPT-style layers)",
                        model.name(), f, caps.backend);
  if (why.empty()) return why;
  return fmt::format("plan: {}{}", why, caps.alternative.empty() ? "" : fmt::format("; {}", caps.alternative));
}

void check_capabilities(const core::Program& program, const Capabilities& caps) {
  if (std::string why = unsupported_feature(program, caps); !why.empty()) throw std::invalid_argument(why);
}

// ---------------------------------------------------------------------------------------------
// DataflowBase
// ---------------------------------------------------------------------------------------------
DataflowBase::DataflowBase(const core::Program& program, int device)
    : program_(program), plan_(program.plan_for(device)), device_(device) {
  const core::Model model = program_model(program);
  num_layers_ = static_cast<int>(model.layers().size());
  shape_ = data_shape(program);
  for (std::size_t set = 0; set < program.device_sets.size(); ++set) {
    const StageTp t = stage_tp(program, static_cast<core::DeviceSetId>(set));
    set_tp_.push_back(t.degree);
    set_cp_.push_back(t.cp);
  }
  // Gradient clipping: the grad-norm family and the segments whose gradients this device adds.
  for (std::size_t f = 0; f < program.families.size(); ++f)
    if (program.families[f].purpose == core::FamilyPurpose::GradNorm) norm_family_ = static_cast<int>(f);
  for (std::size_t s = 0; s < program.segments.size(); ++s)
    if (program.position_in(program.segments[s].devices, device) >= 0) held_segments_.push_back(static_cast<int>(s));
  // A compute or update op of a segment this device does not hold (a damaged or hand-edited plan) is
  // bad input: refused before step 1, not an internal error mid-step.
  auto require_held = [&](const core::Op& op, int s) {
    if (!std::binary_search(held_segments_.begin(), held_segments_.end(), s))
      throw std::invalid_argument(fmt::format(
          "plan: device {}'s op '{}' works on segment {}, which the device does not hold", device, op.label, s));
  };
  for (const auto& st : plan_.streams)
    for (const auto& op : st.ops) {
      if (op.kind == core::OpKind::Compute) require_held(op, op.segment);
      if (op.kind == core::OpKind::Update)
        for (int s : op.segments) require_held(op, s);
    }
}

float unscale_and_clip(double unscaled_norm_sq, double max_norm, double loss_scale) {
  const float clip = max_norm > 0 ? clip_scale(unscaled_norm_sq, max_norm) : 1.0f;
  return static_cast<float>(static_cast<double>(clip) / loss_scale);
}

float clip_scale(double norm_sq, double max_norm) {
  const double norm = std::sqrt(norm_sq);
  if (!std::isfinite(norm)) return static_cast<float>(norm);
  return static_cast<float>(std::min(1.0, max_norm / (norm + 1e-6)));
}

int DataflowBase::data_rank_of(const core::Op& op) const {
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

host::MicrobatchData DataflowBase::local_tokens(host::MicrobatchData d, const core::Op& op) const {
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

std::vector<int> DataflowBase::group_of(const core::Op& op) const {
  std::vector<int> group;
  if (op.family >= 0 && op.family < static_cast<int>(program_.families.size()))
    group = program_.group_of(op.family, device_);
  if (group.empty())
    throw RuntimeError(
        fmt::format("runtime: device {} holds no group of family {} for '{}'", device_, op.family, op.label));
  return group;
}

std::string DataflowBase::describe(const core::Op& op, const std::string& transport) const {
  const std::string via = transport.empty() ? "" : fmt::format(" ({})", transport);
  if (op.kind == core::OpKind::Send || op.kind == core::OpKind::Recv)
    return fmt::format("'{}' with device {}{}", op.label, program_.peer_of(op, device_), via);
  if (op.family >= 0) {
    std::string members;
    for (int d : program_.group_of(op.family, device_)) members += fmt::format("{}{}", members.empty() ? "" : ",", d);
    return fmt::format("'{}' on devices [{}]{}", op.label, members, via);
  }
  return fmt::format("'{}'", op.label);
}

}  // namespace piper::runtime
