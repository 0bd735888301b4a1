// The Program's exact JSON round trip (Program::to_json, Program::from_json, operator==) and the op and
// buffer kind names; every reading error names its field.
#include "piper/core/program.hpp"

#include <algorithm>
#include <cmath>
#include <array>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"
#include "piper/core/model.hpp"
#include "program_checks.hpp"

namespace piper::core {

using nlohmann::json;

namespace {

constexpr const char* kOpKindNames[] = {"COMPUTE",        "UPD",        "SEND",      "RECV", "ALL_REDUCE",
                                        "REDUCE_SCATTER", "ALL_GATHER", "ALL_TO_ALL"};
constexpr const char* kBufferKindNames[] = {"parameters",  "gradients", "optimizer_states",
                                            "activations", "received",  "gathered_parameters"};

template <class Enum, std::size_t N>
std::optional<Enum> parse_enum(const char* const (&names)[N], const std::string& s) {
  for (std::size_t i = 0; i < N; ++i)
    if (s == names[i]) return static_cast<Enum>(i);
  return std::nullopt;
}

std::optional<Precision> parse_precision(const std::string& s) {
  for (Precision p : {Precision::BF16, Precision::FP16, Precision::FP32, Precision::TF32, Precision::FP8})
    if (to_string(p) == s) return p;
  return std::nullopt;
}

// ---- JSON reading with a field path, so every error names the offending field ----

using plan_checks::at_index;
using plan_checks::check_kernel_precision;
using plan_checks::check_microbatches_run;
using plan_checks::check_spec_matches_segments;
using plan_checks::check_spec_training;
using plan_checks::check_training_shape;
using plan_checks::fail;
std::string member(const std::string& path, const char* key) { return path.empty() ? key : path + "." + key; }

const json& require(const json& obj, const std::string& path, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end()) fail(member(path, key), "missing");
  return *it;
}
const json* optional_field(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

// A key of `obj` that this reader does not know is refused: a hand-edited plan's typo ("wait" for
// "waits") would otherwise be dropped silently. A few comparisons per key, so the check stays linear
// in the plan (ops have a few keys each).
void reject_unknown(const json& obj, const std::string& path, std::span<const std::string_view> known) {
  if (auto u = unknown_field(obj, known)) fail(path.empty() ? u->key : path + "." + u->key, u->message);
}
void reject_unknown(const json& obj, const std::string& path, std::initializer_list<std::string_view> known) {
  reject_unknown(obj, path, std::span<const std::string_view>(known.begin(), known.size()));
}

// The keys an op and a segment may have (op_to_json, Program::to_json).
constexpr std::string_view kOpKeys[] = {"kind",
                                        "pass",
                                        "node",
                                        "label",
                                        "tags",
                                        "microbatch",
                                        "segment",
                                        "segments",
                                        "flops",
                                        "memory_bytes",
                                        "bytes",
                                        "elementwise_bytes",
                                        "recompute_flops",
                                        "gemm_kernels",
                                        "tp_bytes",
                                        "tp_collectives",
                                        "cp_bytes",
                                        "cp_steps",
                                        "device_set",
                                        "peer_set",
                                        "family",
                                        "pair",
                                        "waits",
                                        "uses",
                                        "route_groups",
                                        "route_group_limit",
                                        "route_top_k"};
constexpr std::string_view kSegmentKeys[] = {
    "layers",    "tags",       "devices",         "params",       "shard_degree",
    "replicas",  "zero_level", "zero_shards",     "tp_degree",    "sequence_parallel",
    "recompute", "tp_family",  "tp_comm_overlap", "cp_degree",    "cp_comm",
    "cp_family", "tied_to",    "a2a_chunks",      "fp8_dispatch", "reduce_every_microbatch",
    "kernels",
};

const json& as_object(const json& j, const std::string& path) {
  if (!j.is_object()) fail(path, std::string("expected an object, got ") + j.type_name());
  return j;
}
const json& as_array(const json& j, const std::string& path) {
  if (!j.is_array()) fail(path, std::string("expected an array, got ") + j.type_name());
  return j;
}
std::int64_t as_int64(const json& j, const std::string& path) {
  if (!j.is_number_integer()) fail(path, std::string("expected an integer, got ") + j.type_name());
  return j.get<std::int64_t>();
}
int as_int(const json& j, const std::string& path) {
  std::int64_t v = as_int64(j, path);
  if (v < INT32_MIN || v > INT32_MAX) fail(path, "integer " + std::to_string(v) + " out of range");
  return static_cast<int>(v);
}
double as_double(const json& j, const std::string& path) {
  if (!j.is_number()) fail(path, std::string("expected a number, got ") + j.type_name());
  return j.get<double>();
}
// A size in bytes (an op's traffic, a buffer): a whole number in [0, 2^53]. A negative one freed
// memory it never held and reached SimGrid as a transfer it aborts on; 2^53 bytes (8 PiB) is past
// any device's memory and keeps every sum of sizes exact in a double.
std::int64_t as_bytes(const json& j, const std::string& path) {
  const std::int64_t v = as_int64(j, path);
  constexpr std::int64_t kMaxBytes = std::int64_t{1} << 53;
  if (v < 0 || v > kMaxBytes) fail(path, fmt::format("must be a byte count in [0, 2^53], got {}", v));
  return v;
}
// An amount of work (FLOPs): finite, in [0, 1e24]. 1e24 FLOPs is a million seconds on a 1e18 FLOP/s
// device; a larger one only makes a step time of hundreds of digits.
double as_flops(const json& j, const std::string& path) {
  const double v = as_double(j, path);
  if (!(v >= 0.0 && v <= 1e24)) fail(path, fmt::format("must be a number of FLOPs in [0, 1e24], got {}", v));
  return v;
}
// A count (collectives, ring steps): an integer >= 0.
int as_count(const json& j, const std::string& path) {
  const int v = as_int(j, path);
  if (v < 0) fail(path, fmt::format("must be >= 0, got {}", v));
  return v;
}
std::string as_string(const json& j, const std::string& path) {
  if (!j.is_string()) fail(path, std::string("expected a string, got ") + j.type_name());
  return j.get<std::string>();
}

// An index field: -1 (none) when `allow_none`, else within [0, size).
int check_index(int v, const std::string& path, std::size_t size, const char* what, bool allow_none) {
  if (allow_none && v == -1) return v;
  if (v < 0 || static_cast<std::size_t>(v) >= size)
    fail(path, what + std::string(" ") + std::to_string(v) + " out of range [0, " + std::to_string(size) + ")");
  return v;
}
int as_index(const json& j, const std::string& path, std::size_t size, const char* what, bool allow_none) {
  return check_index(as_int(j, path), path, size, what, allow_none);
}

json ref_to_json(const OpRef& r) { return json::array({r.stream, r.index}); }

OpRef ref_from_json(const json& j, const std::string& path) {
  if (!j.is_array() || j.size() != 2) fail(path, "expected [stream, index]");
  return OpRef{as_int(j[0], at_index(path, 0)), as_int(j[1], at_index(path, 1))};
}

// A reference to an op of `plan`, checked against its streams.
void check_ref(const OpRef& r, const Plan& plan, const std::string& path) {
  if (r.stream < 0 || static_cast<std::size_t>(r.stream) >= plan.streams.size())
    fail(path, "stream " + std::to_string(r.stream) + " out of range [0, " + std::to_string(plan.streams.size()) + ")");
  const auto& ops = plan.streams[static_cast<std::size_t>(r.stream)].ops;
  if (r.index < 0 || static_cast<std::size_t>(r.index) >= ops.size())
    fail(path, "op " + std::to_string(r.index) + " out of range [0, " + std::to_string(ops.size()) + ")");
}

TagMap tags_from_json(const json& j, const std::string& path) {
  as_object(j, path);
  TagMap tags;
  for (auto it = j.begin(); it != j.end(); ++it) tags[it.key()] = as_int(it.value(), member(path, it.key().c_str()));
  return tags;
}

// ---- writing: default-valued op fields are omitted to keep large plans small ----

json op_to_json(const Op& op) {
  json j;
  j["kind"] = to_string(op.kind);
  if (op.pass != Pass::None) j["pass"] = to_string(op.pass);
  if (op.node != -1) j["node"] = op.node;
  if (!op.label.empty()) j["label"] = op.label;
  if (!op.tags.empty()) j["tags"] = op.tags;
  if (op.microbatch != -1) j["microbatch"] = op.microbatch;
  if (op.flops != 0) j["flops"] = op.flops;
  if (op.memory_bytes != 0) j["memory_bytes"] = op.memory_bytes;
  if (op.bytes != 0) j["bytes"] = op.bytes;
  if (op.device_set != kNoDevices) j["device_set"] = op.device_set;
  if (op.peer_set != kNoDevices) j["peer_set"] = op.peer_set;
  if (op.family != -1) j["family"] = op.family;
  if (op.pair != -1) j["pair"] = op.pair;
  if (!op.waits.empty()) {
    json waits = json::array();
    for (const auto& w : op.waits) waits.push_back(ref_to_json(w));
    j["waits"] = std::move(waits);
  }
  if (!op.uses.empty()) j["uses"] = op.uses;
  if (op.segment != -1) j["segment"] = op.segment;
  if (!op.segments.empty()) j["segments"] = op.segments;
  if (op.tp_bytes != 0) j["tp_bytes"] = op.tp_bytes;
  if (op.tp_collectives != 0) j["tp_collectives"] = op.tp_collectives;
  if (op.cp_bytes != 0) j["cp_bytes"] = op.cp_bytes;
  if (op.cp_steps != 0) j["cp_steps"] = op.cp_steps;
  if (op.elementwise_bytes != 0) j["elementwise_bytes"] = op.elementwise_bytes;
  if (op.recompute_flops != 0) j["recompute_flops"] = op.recompute_flops;
  if (op.gemm_kernels != 0) j["gemm_kernels"] = op.gemm_kernels;
  if (op.route_groups != 0) {
    j["route_groups"] = op.route_groups;
    j["route_group_limit"] = op.route_group_limit;
    j["route_top_k"] = op.route_top_k;
  }
  return j;
}

json buffer_to_json(const Buffer& b) {
  json j{{"name", b.name}, {"kind", to_string(b.kind)}, {"bytes", b.bytes}};
  if (b.alloc != OpRef{}) j["alloc"] = ref_to_json(b.alloc);
  if (b.free != OpRef{}) j["free"] = ref_to_json(b.free);
  return j;
}

// An ALL_TO_ALL's node-limited routing (Op::route_*): all three or none; 1 <= limit <= groups.
void read_routing(const json& j, const std::string& path, Op& op) {
  const json* g = optional_field(j, "route_groups");
  if (g == nullptr) {
    for (const char* f : {"route_group_limit", "route_top_k"})
      if (optional_field(j, f) != nullptr) fail(member(path, f), "needs route_groups");
    return;
  }
  op.route_groups = as_int(*g, member(path, "route_groups"));
  for (const char* f : {"route_group_limit", "route_top_k"})
    if (optional_field(j, f) == nullptr) fail(member(path, f), "missing (route_groups is set)");
  op.route_group_limit = as_int(j.at("route_group_limit"), member(path, "route_group_limit"));
  op.route_top_k = as_int(j.at("route_top_k"), member(path, "route_top_k"));
  if (op.kind != OpKind::AllToAll) fail(member(path, "route_groups"), "only an ALL_TO_ALL has routing");
  if (op.route_groups < 1) fail(member(path, "route_groups"), "must be >= 1");
  if (op.route_group_limit < 1 || op.route_group_limit > op.route_groups)
    fail(member(path, "route_group_limit"), "must lie between 1 and route_groups");
  if (op.route_top_k < 1) fail(member(path, "route_top_k"), "must be >= 1");
}

// Reads an op's own fields; references to streams, buffers, sets and families are checked later,
// once the whole plan and program tables are known.
Op op_from_json(const json& j, const std::string& path) {
  as_object(j, path);
  reject_unknown(j, path, kOpKeys);
  Op op;
  {
    std::string p = member(path, "kind");
    std::string s = as_string(require(j, path, "kind"), p);
    auto kind = parse_enum<OpKind>(kOpKindNames, s);
    if (!kind) fail(p, "unknown op kind '" + s + "'");
    op.kind = *kind;
  }
  if (const json* f = optional_field(j, "pass")) {
    std::string p = member(path, "pass");
    std::string s = as_string(*f, p);
    try {
      op.pass = pass_from_string(s);
    } catch (const std::exception&) {
      fail(p, "unknown pass '" + s + "'");
    }
  }
  if (const json* f = optional_field(j, "node")) op.node = as_int(*f, member(path, "node"));
  if (const json* f = optional_field(j, "label")) op.label = as_string(*f, member(path, "label"));
  if (const json* f = optional_field(j, "tags")) op.tags = tags_from_json(*f, member(path, "tags"));
  if (const json* f = optional_field(j, "microbatch")) op.microbatch = as_int(*f, member(path, "microbatch"));
  if (const json* f = optional_field(j, "flops")) op.flops = as_flops(*f, member(path, "flops"));
  if (const json* f = optional_field(j, "memory_bytes")) op.memory_bytes = as_bytes(*f, member(path, "memory_bytes"));
  if (const json* f = optional_field(j, "bytes")) op.bytes = as_bytes(*f, member(path, "bytes"));
  if (const json* f = optional_field(j, "device_set")) op.device_set = as_int(*f, member(path, "device_set"));
  if (const json* f = optional_field(j, "peer_set")) op.peer_set = as_int(*f, member(path, "peer_set"));
  if (const json* f = optional_field(j, "family")) op.family = as_int(*f, member(path, "family"));
  if (const json* f = optional_field(j, "pair")) {
    op.pair = as_int(*f, member(path, "pair"));
    if (op.pair < 0) fail(member(path, "pair"), "must be >= 0, got " + std::to_string(op.pair));
  }
  const bool communicates = op.kind != OpKind::Compute && op.kind != OpKind::Update;
  if (communicates && op.pair < 0) fail(member(path, "pair"), to_string(op.kind) + " needs a pairing id");
  if (!communicates && op.pair >= 0) fail(member(path, "pair"), to_string(op.kind) + " has no pairing id");
  if (const json* f = optional_field(j, "waits")) {
    std::string p = member(path, "waits");
    as_array(*f, p);
    for (std::size_t i = 0; i < f->size(); ++i) op.waits.push_back(ref_from_json((*f)[i], at_index(p, i)));
  }
  if (const json* f = optional_field(j, "uses")) {
    std::string p = member(path, "uses");
    as_array(*f, p);
    for (std::size_t i = 0; i < f->size(); ++i) op.uses.push_back(as_int((*f)[i], at_index(p, i)));
  }
  if (const json* f = optional_field(j, "segment")) op.segment = as_int(*f, member(path, "segment"));
  if (const json* f = optional_field(j, "segments")) {
    std::string p = member(path, "segments");
    as_array(*f, p);
    for (std::size_t i = 0; i < f->size(); ++i) op.segments.push_back(as_int((*f)[i], at_index(p, i)));
  }
  if (const json* f = optional_field(j, "tp_bytes")) op.tp_bytes = as_bytes(*f, member(path, "tp_bytes"));
  if (const json* f = optional_field(j, "tp_collectives"))
    op.tp_collectives = as_count(*f, member(path, "tp_collectives"));
  if (const json* f = optional_field(j, "cp_bytes")) op.cp_bytes = as_bytes(*f, member(path, "cp_bytes"));
  if (const json* f = optional_field(j, "cp_steps")) op.cp_steps = as_count(*f, member(path, "cp_steps"));
  if (const json* f = optional_field(j, "elementwise_bytes"))
    op.elementwise_bytes = as_bytes(*f, member(path, "elementwise_bytes"));
  if (const json* f = optional_field(j, "recompute_flops"))
    op.recompute_flops = as_flops(*f, member(path, "recompute_flops"));
  if (const json* f = optional_field(j, "gemm_kernels")) {
    op.gemm_kernels = as_int(*f, member(path, "gemm_kernels"));
    if (op.gemm_kernels < 0) fail(member(path, "gemm_kernels"), "must be >= 0");
  }
  read_routing(j, path, op);
  return op;
}

Plan plan_from_json(const json& j, const std::string& path, std::size_t num_sets, std::size_t num_families,
                    int microbatches) {
  as_object(j, path);
  reject_unknown(j, path, {"streams", "buffers"});
  Plan plan;
  std::string sp = member(path, "streams");
  const json& streams = as_array(require(j, path, "streams"), sp);
  for (std::size_t s = 0; s < streams.size(); ++s) {
    std::string p = at_index(sp, s);
    as_object(streams[s], p);
    reject_unknown(streams[s], p, {"name", "ops"});
    Stream stream;
    stream.name = as_string(require(streams[s], p, "name"), member(p, "name"));
    std::string op_path = member(p, "ops");
    const json& ops = as_array(require(streams[s], p, "ops"), op_path);
    stream.ops.reserve(ops.size());
    for (std::size_t i = 0; i < ops.size(); ++i) stream.ops.push_back(op_from_json(ops[i], at_index(op_path, i)));
    plan.streams.push_back(std::move(stream));
  }
  std::string bp = member(path, "buffers");
  const json& buffers = as_array(require(j, path, "buffers"), bp);
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    std::string p = at_index(bp, b);
    as_object(buffers[b], p);
    reject_unknown(buffers[b], p, {"name", "kind", "bytes", "alloc", "free"});
    Buffer buf;
    buf.name = as_string(require(buffers[b], p, "name"), member(p, "name"));
    std::string kind = as_string(require(buffers[b], p, "kind"), member(p, "kind"));
    auto k = parse_enum<BufferKind>(kBufferKindNames, kind);
    if (!k) fail(member(p, "kind"), "unknown buffer kind '" + kind + "'");
    buf.kind = *k;
    buf.bytes = as_bytes(require(buffers[b], p, "bytes"), member(p, "bytes"));
    if (const json* f = optional_field(buffers[b], "alloc")) {
      buf.alloc = ref_from_json(*f, member(p, "alloc"));
      check_ref(buf.alloc, plan, member(p, "alloc"));
    }
    if (const json* f = optional_field(buffers[b], "free")) {
      buf.free = ref_from_json(*f, member(p, "free"));
      check_ref(buf.free, plan, member(p, "free"));
    }
    plan.buffers.push_back(std::move(buf));
  }
  // Cross references inside the plan and into the program tables.
  for (std::size_t s = 0; s < plan.streams.size(); ++s) {
    for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
      const Op& op = plan.streams[s].ops[i];
      std::string p = at_index(member(at_index(sp, s), "ops"), i);
      for (std::size_t w = 0; w < op.waits.size(); ++w) check_ref(op.waits[w], plan, at_index(member(p, "waits"), w));
      for (std::size_t u = 0; u < op.uses.size(); ++u)
        check_index(op.uses[u], at_index(member(p, "uses"), u), plan.buffers.size(), "buffer", false);
      check_index(op.device_set, member(p, "device_set"), num_sets, "device set", true);
      check_index(op.peer_set, member(p, "peer_set"), num_sets, "device set", true);
      check_index(op.family, member(p, "family"), num_families, "family", true);
      check_index(op.microbatch, member(p, "microbatch"), static_cast<std::size_t>(microbatches), "microbatch", true);
    }
  }
  return plan;
}

}  // namespace

Model plan_model(const Program& p) {
  ModelConfig c = config_from_spec_json(p.model_spec, "plan: field 'model_spec'");
  c.training.seq_len = p.training.seq_len;
  c.training.micro_batch_size = p.training.micro_batch_size;
  return build_model(c);
}

std::string to_string(OpKind k) { return kOpKindNames[static_cast<int>(k)]; }

OpKind op_kind_from_string(const std::string& s) {
  if (auto k = parse_enum<OpKind>(kOpKindNames, s)) return *k;
  throw PlanError("unknown op kind '" + s + "'");
}

std::string to_string(BufferKind k) { return kBufferKindNames[static_cast<int>(k)]; }

BufferKind buffer_kind_from_string(const std::string& s) {
  if (auto k = parse_enum<BufferKind>(kBufferKindNames, s)) return *k;
  throw PlanError("unknown buffer kind '" + s + "'");
}

json Program::to_json() const {
  json j;
  j["format"] = "piper-program";
  j["version"] = kPlanVersion;
  j["model"] = model_name;
  j["training"] = {{"seq_len", training.seq_len},
                   {"micro_batch_size", training.micro_batch_size},
                   {"precision", to_string(training.precision)}};
  if (training.fp32_main_grads) j["training"]["fp32_main_grads"] = true;  // omitted at its default
  if (training.grad_accumulation != GradAccumulation::Auto)
    j["training"]["main_grad_accumulation"] = to_string(training.grad_accumulation);
  j["microbatches"] = microbatches;
  if (!model_spec.is_null()) j["model_spec"] = model_spec;
  json segs = json::array();
  for (const auto& sg : segments) {
    json o{{"layers", {sg.first_layer, sg.last_layer}},
           {"tags", sg.tags},
           {"devices", sg.devices},
           {"params", sg.params},
           {"shard_degree", sg.shard_degree},
           {"replicas", sg.replicas},
           {"zero_level", sg.zero_level}};
    // Tensor-parallel fields are omitted at their defaults, so programs without TP are unchanged.
    if (sg.tp_degree != 1) o["tp_degree"] = sg.tp_degree;
    if (sg.sequence_parallel) o["sequence_parallel"] = true;
    if (sg.recompute != Recompute::None) o["recompute"] = to_string(sg.recompute);
    if (sg.tp_family != -1) o["tp_family"] = sg.tp_family;
    if (sg.tp_comm_overlap) o["tp_comm_overlap"] = true;
    if (sg.cp_degree != 1) o["cp_degree"] = sg.cp_degree;
    if (sg.cp_all_gather) o["cp_comm"] = "all_gather";
    if (sg.cp_family != -1) o["cp_family"] = sg.cp_family;
    if (sg.tied_to != -1) o["tied_to"] = sg.tied_to;
    if (sg.a2a_chunks != 1) o["a2a_chunks"] = sg.a2a_chunks;
    if (sg.fp8_dispatch) o["fp8_dispatch"] = true;
    if (sg.zero_shards != sg.replicas) o["zero_shards"] = sg.zero_shards;  // HSDP only
    if (sg.reduce_every_microbatch) o["reduce_every_microbatch"] = true;
    if (!sg.kernels[0].empty() || !sg.kernels[1].empty() || !sg.kernels[2].empty())
      o["kernels"] = kernels_to_json(sg.kernels);
    segs.push_back(std::move(o));
  }
  j["segments"] = std::move(segs);
  j["num_devices"] = num_devices;
  j["device_sets"] = device_sets;
  json fams = json::array();
  for (const auto& f : families)
    fams.push_back({{"devices", f.devices},
                    {"group_size", f.group_size},
                    {"stride", f.stride},
                    {"purpose", to_string(f.purpose)}});
  j["families"] = std::move(fams);
  json plan_array = json::array();
  for (const auto& plan : plans) {
    json streams = json::array();
    for (const auto& s : plan.streams) {
      json ops = json::array();
      for (const auto& op : s.ops) ops.push_back(op_to_json(op));
      streams.push_back({{"name", s.name}, {"ops", std::move(ops)}});
    }
    json buffers = json::array();
    for (const auto& b : plan.buffers) buffers.push_back(buffer_to_json(b));
    plan_array.push_back({{"streams", std::move(streams)}, {"buffers", std::move(buffers)}});
  }
  j["plans"] = std::move(plan_array);
  j["plan_of_device"] = plan_of_device;
  if (sm_partition) j["sm_partition"] = {{"stream", sm_partition->stream}, {"sms", sm_partition->sms}};
  if (clip_grad > 0) j["clip_grad"] = clip_grad;
  j["stats"] = {{"dag_nodes", stats.dag_nodes},
                {"nodes_by_kind", stats.nodes_by_kind},
                {"compile_seconds", stats.compile_seconds},
                {"compiler_peak_rss_bytes", stats.compiler_peak_rss_bytes}};
  return j;
}

// The plan reader: one block per top-level field, in the file's order, each validated where it is
// read so that every error names its field.
Program Program::from_json(const json& j) {  // NOLINT(readability-function-size)
  as_object(j, "(top level)");
  if (const std::string other = wrong_input_kind(j, "a plan"); !other.empty()) throw PlanError("plan: " + other);
  reject_unknown(j, "",
                 {"format", "version", "model", "training", "microbatches", "model_spec", "segments", "num_devices",
                  "device_sets", "families", "plans", "plan_of_device", "sm_partition", "clip_grad", "stats"});
  Program p;
  {
    std::string format = as_string(require(j, "", "format"), "format");
    if (format != "piper-program") fail("format", "expected 'piper-program', got '" + format + "'");
    int version = as_int(require(j, "", "version"), "version");
    // Version 1 plans predate Op::microbatch; it cannot be derived from their tags (the split
    // dimension names are not recorded), so they are refused rather than guessed.
    if (version == 1)
      fail("version", "version 1 plans carry no per-op microbatch; compile the plan again with this piper (expected " +
                          std::to_string(kPlanVersion) + ")");
    // Version 2 plans predate Op::pair; who meets whom is not guessed from node ids or positions.
    if (version == 2)
      fail("version",
           "version 2 plans carry no pairing ids (Op::pair); compile the plan again with this piper (expected " +
               std::to_string(kPlanVersion) + ")");
    if (version != kPlanVersion)
      fail("version",
           "unsupported version " + std::to_string(version) + " (expected " + std::to_string(kPlanVersion) + ")");
  }
  p.model_name = as_string(require(j, "", "model"), "model");
  {
    const json& t = as_object(require(j, "", "training"), "training");
    reject_unknown(t, "training",
                   {"seq_len", "micro_batch_size", "precision", "fp32_main_grads", "main_grad_accumulation"});
    p.training.seq_len = as_int64(require(t, "training", "seq_len"), "training.seq_len");
    p.training.micro_batch_size = as_int64(require(t, "training", "micro_batch_size"), "training.micro_batch_size");
    std::string prec = as_string(require(t, "training", "precision"), "training.precision");
    auto parsed = parse_precision(prec);
    if (!parsed)
      fail("training.precision", "unknown precision '" + prec + "' (expected bf16, fp16, fp32, tf32 or fp8)");
    p.training.precision = *parsed;
    if (const json* f = optional_field(t, "fp32_main_grads")) {
      if (!f->is_boolean()) fail("training.fp32_main_grads", "expected true or false");
      p.training.fp32_main_grads = f->get<bool>();
    }
    if (const json* f = optional_field(t, "main_grad_accumulation")) {
      const auto mode = f->is_string() ? grad_accumulation_from_string(f->get<std::string>()) : std::nullopt;
      if (!mode) fail("training.main_grad_accumulation", "expected \"fused\" or \"separate\"");
      p.training.grad_accumulation = *mode;
    }
  }
  p.microbatches = as_int(require(j, "", "microbatches"), "microbatches");
  check_limit(Limit::Microbatches, p.microbatches, "plan: field 'microbatches'", "microbatches");
  check_training_shape(p);
  std::optional<Model> spec_model;  // the model its "model_spec" gives, checked against the segments
  if (const json* f = optional_field(j, "model_spec")) {
    p.model_spec = as_object(*f, "model_spec");
    // Every field valid and within the limits, learned positions covering seq_len: as a compile checks.
    spec_model = plan_model(p);
    check_spec_training(p);
  }
  if (const json* f = optional_field(j, "segments")) {
    as_array(*f, "segments");
    for (std::size_t i = 0; i < f->size(); ++i) {
      const std::string sp = at_index("segments", i);
      const json& o = as_object((*f)[i], sp);
      reject_unknown(o, sp, kSegmentKeys);
      ProgramSegment sg;
      const json& layers = as_array(require(o, sp, "layers"), member(sp, "layers"));
      if (layers.size() != 2) fail(member(sp, "layers"), "expected [first, last]");
      sg.first_layer = as_int(layers[0], member(sp, "layers"));
      sg.last_layer = as_int(layers[1], member(sp, "layers"));
      sg.tags = tags_from_json(require(o, sp, "tags"), member(sp, "tags"));
      sg.devices = as_int(require(o, sp, "devices"), member(sp, "devices"));
      sg.params = as_int64(require(o, sp, "params"), member(sp, "params"));
      sg.shard_degree = as_int(require(o, sp, "shard_degree"), member(sp, "shard_degree"));
      sg.replicas = as_int(require(o, sp, "replicas"), member(sp, "replicas"));
      sg.zero_level = as_int(require(o, sp, "zero_level"), member(sp, "zero_level"));
      if (sg.shard_degree < 1 || sg.replicas < 1) fail(sp, "shard_degree and replicas must be >= 1");
      sg.zero_shards = sg.replicas;
      if (const json* z = optional_field(o, "zero_shards")) {
        sg.zero_shards = as_int(*z, member(sp, "zero_shards"));
        if (sg.zero_shards < 1 || sg.replicas % sg.zero_shards != 0)
          fail(member(sp, "zero_shards"),
               std::to_string(sg.zero_shards) + " does not divide the " + std::to_string(sg.replicas) + " replicas");
      }
      if (const json* t = optional_field(o, "tp_degree")) {
        sg.tp_degree = as_int(*t, member(sp, "tp_degree"));
        if (sg.tp_degree < 1) fail(member(sp, "tp_degree"), "must be >= 1");
      }
      if (const json* t = optional_field(o, "sequence_parallel")) {
        if (!t->is_boolean()) fail(member(sp, "sequence_parallel"), "expected true or false");
        sg.sequence_parallel = t->get<bool>();
      }
      if (const json* t = optional_field(o, "recompute")) {
        std::string r = as_string(*t, member(sp, "recompute"));
        try {
          sg.recompute = recompute_from_string(r);
        } catch (const std::exception& e) {
          fail(member(sp, "recompute"), e.what());
        }
      }
      if (const json* t = optional_field(o, "tp_family")) sg.tp_family = as_int(*t, member(sp, "tp_family"));
      if (const json* t = optional_field(o, "tp_comm_overlap")) {
        if (!t->is_boolean()) fail(member(sp, "tp_comm_overlap"), "expected true or false");
        sg.tp_comm_overlap = t->get<bool>();
      }
      if (const json* t = optional_field(o, "cp_degree")) {
        sg.cp_degree = as_int(*t, member(sp, "cp_degree"));
        if (sg.cp_degree < 1) fail(member(sp, "cp_degree"), "must be >= 1");
      }
      if (const json* t = optional_field(o, "cp_comm")) {
        const std::string comm = as_string(*t, member(sp, "cp_comm"));
        if (comm != "ring" && comm != "all_gather")
          fail(member(sp, "cp_comm"), "expected \"ring\" or \"all_gather\", got '" + comm + "'");
        sg.cp_all_gather = comm == "all_gather";
      }
      if (const json* t = optional_field(o, "cp_family")) sg.cp_family = as_int(*t, member(sp, "cp_family"));
      if (const json* t = optional_field(o, "tied_to")) sg.tied_to = as_int(*t, member(sp, "tied_to"));
      if (const json* t = optional_field(o, "a2a_chunks")) {
        sg.a2a_chunks = as_int(*t, member(sp, "a2a_chunks"));
        if (sg.a2a_chunks < 1) fail(member(sp, "a2a_chunks"), "must be >= 1");
      }
      if (const json* t = optional_field(o, "fp8_dispatch")) {
        if (!t->is_boolean()) fail(member(sp, "fp8_dispatch"), "expected true or false");
        sg.fp8_dispatch = t->get<bool>();
      }
      if (const json* t = optional_field(o, "reduce_every_microbatch")) {
        if (!t->is_boolean()) fail(member(sp, "reduce_every_microbatch"), "expected true or false");
        sg.reduce_every_microbatch = t->get<bool>();
      }
      if (const json* k = optional_field(o, "kernels")) sg.kernels = kernels_from_json(*k, member(sp, "kernels"));
      p.segments.push_back(std::move(sg));
    }
  }
  if (spec_model) check_spec_matches_segments(p, *spec_model);
  check_kernel_precision(p);
  p.num_devices = as_int(require(j, "", "num_devices"), "num_devices");
  if (p.num_devices < 0) fail("num_devices", "negative");
  // Engines and the verifier size per-device tables by num_devices.
  check_limit(Limit::Devices, p.num_devices, "plan: field 'num_devices'", "devices");
  {
    const json& sets = as_array(require(j, "", "device_sets"), "device_sets");
    p.device_sets.reserve(sets.size());
    for (std::size_t s = 0; s < sets.size(); ++s) {
      std::string sp = at_index("device_sets", s);
      as_array(sets[s], sp);
      std::vector<int> devices;
      devices.reserve(sets[s].size());
      for (std::size_t i = 0; i < sets[s].size(); ++i)
        devices.push_back(
            as_index(sets[s][i], at_index(sp, i), static_cast<std::size_t>(p.num_devices), "device", false));
      p.device_sets.push_back(std::move(devices));
    }
  }
  {
    const json& fams = as_array(require(j, "", "families"), "families");
    for (std::size_t i = 0; i < fams.size(); ++i) {
      std::string fp = at_index("families", i);
      as_object(fams[i], fp);
      reject_unknown(fams[i], fp, {"devices", "group_size", "stride", "purpose"});
      CommFamily f;
      f.devices =
          as_index(require(fams[i], fp, "devices"), member(fp, "devices"), p.device_sets.size(), "device set", false);
      f.group_size = as_int(require(fams[i], fp, "group_size"), member(fp, "group_size"));
      f.stride = as_int(require(fams[i], fp, "stride"), member(fp, "stride"));
      {
        const std::string purpose = as_string(require(fams[i], fp, "purpose"), member(fp, "purpose"));
        try {
          f.purpose = family_purpose_from_string(purpose);
        } catch (const std::exception& e) {
          fail(member(fp, "purpose"), e.what());
        }
      }
      p.families.push_back(f);
    }
  }
  for (std::size_t i = 0; i < p.segments.size(); ++i) {
    check_index(p.segments[i].tp_family, member(at_index("segments", i), "tp_family"), p.families.size(), "family",
                true);
    check_index(p.segments[i].cp_family, member(at_index("segments", i), "cp_family"), p.families.size(), "family",
                true);
    check_index(p.segments[i].tied_to, member(at_index("segments", i), "tied_to"), p.segments.size(), "segment", true);
    if (p.segments[i].tied_to == static_cast<int>(i))
      fail(member(at_index("segments", i), "tied_to"), "a segment cannot be tied to itself");
  }
  {
    const json& plans = as_array(require(j, "", "plans"), "plans");
    p.plans.reserve(plans.size());
    for (std::size_t i = 0; i < plans.size(); ++i)
      p.plans.push_back(
          plan_from_json(plans[i], at_index("plans", i), p.device_sets.size(), p.families.size(), p.microbatches));
    check_microbatches_run(p);
  }
  {
    const json& pod = as_array(require(j, "", "plan_of_device"), "plan_of_device");
    if (pod.size() != static_cast<std::size_t>(p.num_devices))
      fail("plan_of_device",
           "has " + std::to_string(pod.size()) + " entries for " + std::to_string(p.num_devices) + " devices");
    p.plan_of_device.reserve(pod.size());
    for (std::size_t i = 0; i < pod.size(); ++i)
      p.plan_of_device.push_back(as_index(pod[i], at_index("plan_of_device", i), p.plans.size(), "plan", false));
  }
  if (const json* f = optional_field(j, "sm_partition")) {
    as_object(*f, "sm_partition");
    reject_unknown(*f, "sm_partition", {"stream", "sms"});
    SmPartition part;
    part.stream = as_string(require(*f, "sm_partition", "stream"), "sm_partition.stream");
    if (part.stream != "comm") fail("sm_partition.stream", "expected \"comm\", got '" + part.stream + "'");
    part.sms = as_int(require(*f, "sm_partition", "sms"), "sm_partition.sms");
    if (part.sms < 1) fail("sm_partition.sms", "must be >= 1");
    p.sm_partition = part;
  }
  if (const json* f = optional_field(j, "clip_grad")) {
    if (!f->is_number() || !(f->get<double>() > 0) || !std::isfinite(f->get<double>()))
      fail("clip_grad", "must be a positive number (the max global gradient norm)");
    p.clip_grad = f->get<double>();
  }
  if (const json* s = optional_field(j, "stats")) {
    as_object(*s, "stats");
    reject_unknown(*s, "stats", {"dag_nodes", "nodes_by_kind", "compile_seconds", "compiler_peak_rss_bytes"});
    // Counts, a time and a size: none below 0 ("dag_nodes": -1 was printed as "(-1 DAG nodes, ...)").
    const auto non_negative = [](auto v, const std::string& path) {
      if (v < 0) fail(path, fmt::format("must be >= 0, got {}", v));
      return v;
    };
    if (const json* f = optional_field(*s, "dag_nodes"))
      p.stats.dag_nodes = non_negative(as_int64(*f, "stats.dag_nodes"), "stats.dag_nodes");
    if (const json* f = optional_field(*s, "nodes_by_kind")) {
      as_object(*f, "stats.nodes_by_kind");
      for (auto it = f->begin(); it != f->end(); ++it) {
        const std::string path = "stats.nodes_by_kind." + it.key();
        p.stats.nodes_by_kind[it.key()] = non_negative(as_int64(it.value(), path), path);
      }
    }
    if (const json* f = optional_field(*s, "compile_seconds"))
      p.stats.compile_seconds = non_negative(as_double(*f, "stats.compile_seconds"), "stats.compile_seconds");
    if (const json* f = optional_field(*s, "compiler_peak_rss_bytes"))
      p.stats.compiler_peak_rss_bytes =
          non_negative(as_int64(*f, "stats.compiler_peak_rss_bytes"), "stats.compiler_peak_rss_bytes");
  }
  return p;
}

}  // namespace piper::core
