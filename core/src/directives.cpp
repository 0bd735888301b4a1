// Piper directives: filters and JSON parsing with field-level errors. The rewrite passes are under
// core/src/passes/ (pass_manager.cpp orders and runs them).
#include "piper/core/directives.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <type_traits>

#include <fmt/format.h>

#include "piper/core/limits.hpp"
#include "piper/core/suggest.hpp"

namespace piper::core {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Filters

bool Filter::matches_tags(const TagMap& tags) const {
  for (const auto& [k, v] : exact) {
    auto it = tags.find(k);
    if (it == tags.end() || it->second != v) return false;
  }
  for (const auto& k : any)
    if (!tags.contains(k)) return false;
  return true;
}

bool Filter::matches(const DagNode& n) const {
  if (n.kind != NodeKind::Compute || n.removed) return false;
  if (pass && n.pass != *pass) return false;
  return matches_tags(n.tags);
}

json Filter::to_json() const {
  json j = json::object();
  for (const auto& [k, v] : exact) j[k] = v;
  for (const auto& k : any) j[k] = "*";
  if (pass) j["PASS"] = core::to_string(*pass);
  return j;
}

std::string Filter::to_string() const { return to_json().dump(); }

// ---------------------------------------------------------------------------------------------
// Parsing

namespace {

constexpr long long kMaxTagIndex = 1 << 30;
constexpr double kMaxBucketMb = 1e9;         // 1 PB: past it, the bucket size in bytes overflows int64
constexpr long long kMaxSms = 1 << 20;       // far above any GPU; the real bound is the device's SM count
constexpr long long kMaxPrefetch = 1 << 20;  // gathers ahead; past the number of gathers it means no limit

[[noreturn]] void fail(int index, const std::string& field, const std::string& message) {
  throw DirectiveError(index, field, message);
}

std::string type_name(const json& j) { return j.type_name(); }

void check_fields(const json& d, int index, std::initializer_list<const char*> allowed) {
  for (auto it = d.begin(); it != d.end(); ++it) {
    const std::string& key = it.key();  // a plain reference: clang 14 cannot capture structured bindings
    if (key == "op") continue;
    if (std::none_of(allowed.begin(), allowed.end(), [&](const char* a) { return key == a; })) {
      std::string list;
      for (const char* a : allowed) list += std::string(list.empty() ? "" : ", ") + a;
      fail(index, key,
           "unknown field for '" + d["op"].get<std::string>() + "'" +
               did_you_mean(key, {allowed.begin(), allowed.end()}) + " (allowed: " + list + ")");
    }
  }
}

const json& require(const json& d, int index, const char* field) {
  auto it = d.find(field);
  if (it == d.end()) fail(index, field, "missing required field");
  return *it;
}

Filter parse_filter(const json& j, int index, const std::string& field, bool allow_pass) {
  if (!j.is_object()) fail(index, field, "must be an object {tag: index | \"*\"}, got " + type_name(j));
  Filter f;
  for (const auto& [tag, value] : j.items()) {
    const std::string where = field + "." + tag;
    if (tag == "PASS") {
      if (!allow_pass) fail(index, where, "PASS is only allowed in order filters");
      if (!value.is_string()) fail(index, where, "must be one of \"F\", \"B\", \"BI\", \"BW\"");
      try {
        f.pass = pass_from_string(value.get<std::string>());
      } catch (const std::invalid_argument& e) {
        fail(index, where, e.what());
      }
      if (*f.pass == Pass::None) fail(index, where, "must be one of \"F\", \"B\", \"BI\", \"BW\"");
    } else if (value.is_string()) {
      if (value.get<std::string>() != "*") fail(index, where, "must be a non-negative integer or \"*\"");
      f.any.push_back(tag);
    } else if (value.is_number_integer()) {
      if (value.get<long long>() < 0) fail(index, where, "tag index must be >= 0");
      // Larger indices would wrap when narrowed to int and silently select another region.
      if (value.get<long long>() > kMaxTagIndex)
        fail(index, where,
             "tag index " + std::to_string(value.get<long long>()) + " is larger than " + std::to_string(kMaxTagIndex));
      f.exact[tag] = static_cast<int>(value.get<long long>());
    } else {
      fail(index, where, "must be a non-negative integer or \"*\", got " + type_name(value));
    }
  }
  return f;
}

std::vector<int> parse_devices(const json& d, int index) {
  const json& j = require(d, index, "devices");
  if (!j.is_array() || j.empty()) fail(index, "devices", "must be a non-empty array of device ids");
  std::vector<int> out;
  std::set<int> seen;
  for (std::size_t i = 0; i < j.size(); ++i) {
    const std::string where = "devices[" + std::to_string(i) + "]";
    if (!j[i].is_number_integer()) fail(index, where, "must be an integer, got " + type_name(j[i]));
    long long v = j[i].get<long long>();
    if (v < 0) fail(index, where, "device id " + std::to_string(v) + " is negative");
    // Device ids size per-device tables later; an id past the device limit is refused here.
    if (v >= limit_value(Limit::Devices))
      fail(index, where,
           "device id " + std::to_string(v) + ": " +
               limit_message(Limit::Devices, v == INT64_MAX ? v : v + 1, "devices"));
    if (!seen.insert(static_cast<int>(v)).second) fail(index, where, "device " + std::to_string(v) + " listed twice");
    out.push_back(static_cast<int>(v));
  }
  return out;
}

std::string get_string(const json& d, int index, const char* field, const std::string& fallback) {
  auto it = d.find(field);
  if (it == d.end()) return fallback;
  if (!it->is_string() || it->get<std::string>().empty()) fail(index, field, "must be a non-empty string");
  return it->get<std::string>();
}

bool get_bool(const json& d, int index, const char* field) {
  auto it = d.find(field);
  if (it == d.end()) return false;
  if (!it->is_boolean()) fail(index, field, "must be true or false, got " + type_name(*it));
  return it->get<bool>();
}

// One case per directive kind, each reading and checking that kind's fields in place, so that the
// accepted fields of a kind and their messages sit together.
Directive parse_one(const json& d, int index) {  // NOLINT(readability-function-size)
  if (!d.is_object()) fail(index, "", "must be an object with an \"op\" field, got " + type_name(d));
  auto op_it = d.find("op");
  if (op_it == d.end()) fail(index, "op", "missing required field");
  if (!op_it->is_string()) fail(index, "op", "must be a string");
  const std::string op = op_it->get<std::string>();
  if (op == "place") {
    check_fields(d, index, {"filter", "devices", "stream", "blocking", "holds"});
    PlaceDirective p;
    p.filter = parse_filter(require(d, index, "filter"), index, "filter", false);
    p.devices = parse_devices(d, index);
    p.stream = get_string(d, index, "stream", "pp");
    p.blocking = get_bool(d, index, "blocking");
    p.holds = get_string(d, index, "holds", "");
    if (!p.holds.empty() && p.holds != "head" && p.holds != "embedding")
      fail(index, "holds", "must be \"head\" or \"embedding\", got \"" + p.holds + "\"");
    if (!p.holds.empty() && (p.filter.exact.size() != 1 || !p.filter.exact.contains("PP") || !p.filter.any.empty()))
      fail(index, "holds", "needs a filter naming one PP region and nothing else ({\"PP\": i})");
    return p;
  }
  if (op == "replicate") {
    check_fields(d, index,
                 {"filter", "devices", "bucket_size", "shard_grads", "shard_params", "shard_optimizer", "reduce_stream",
                  "gather_stream", "prefetch", "gather_unit", "gather_dtype", "shard_group", "reduce_every",
                  "collective_copies"});
    ReplicateDirective r;
    r.filter = parse_filter(require(d, index, "filter"), index, "filter", false);
    r.devices = parse_devices(d, index);
    if (auto it = d.find("bucket_size"); it != d.end()) {
      if (!it->is_number() || it->get<double>() < 0 || it->get<double>() > kMaxBucketMb)
        fail(index, "bucket_size", fmt::format("must be a number of MB in [0, {:g}]", kMaxBucketMb));
      r.bucket_size_mb = it->get<double>();
    }
    r.shard_optimizer = get_bool(d, index, "shard_optimizer");
    r.shard_grads = get_bool(d, index, "shard_grads");
    r.shard_params = get_bool(d, index, "shard_params");
    if (r.shard_params && !r.shard_grads) fail(index, "shard_params", "requires shard_grads (ZeRO-3 implies ZeRO-2)");
    if (auto it = d.find("prefetch"); it != d.end()) {
      if (!r.shard_params) fail(index, "prefetch", "applies only with shard_params (ZeRO-3 gathers)");
      if (!it->is_number_integer() || it->get<long long>() < 0 || it->get<long long>() > kMaxPrefetch)
        fail(index, "prefetch",
             fmt::format("must be an integer in [0, {}] (gathers running ahead of their use)", kMaxPrefetch));
      r.prefetch = it->get<int>();
    }
    if (auto it = d.find("gather_unit"); it != d.end()) {
      if (!r.shard_params) fail(index, "gather_unit", "applies only with shard_params (ZeRO-3 gathers)");
      if (!it->is_string() || (*it != "segment" && *it != "block"))
        fail(index, "gather_unit",
             "must be \"segment\" (the published format's unit) or \"block\" (one transformer block)");
      r.gather_blocks = *it == "block";
    }
    if (auto it = d.find("gather_dtype"); it != d.end()) {
      if (!r.shard_params) fail(index, "gather_dtype", "applies only with shard_params (ZeRO-3 gathers)");
      if (!it->is_string() || (*it != "fp8" && *it != "param"))
        fail(index, "gather_dtype", "must be \"fp8\" (one byte a parameter) or \"param\" (the parameters' own dtype)");
      r.gather_fp8 = *it == "fp8";
    }
    if (auto it = d.find("shard_group"); it != d.end()) {
      if (!r.shard_optimizer && !r.shard_grads)
        fail(index, "shard_group", "applies only with ZeRO (shard_optimizer, shard_grads or shard_params)");
      // Checked before narrowing; that it divides each segment's replicas is checked when applied.
      if (!it->is_number_integer() || it->get<long long>() < 2 ||
          it->get<long long>() > static_cast<long long>(r.devices.size()))
        fail(index, "shard_group",
             fmt::format("must be an integer in [2, {}] (replicas per ZeRO shard group)", r.devices.size()));
      r.shard_group = it->get<int>();
    }
    r.reduce_every_microbatch = r.shard_grads;
    if (auto it = d.find("reduce_every"); it != d.end()) {
      if (!it->is_string() || (*it != "step" && *it != "microbatch"))
        fail(index, "reduce_every",
             "must be \"step\" (one reduction after the last microbatch) or \"microbatch\" (one after each)");
      r.reduce_every_microbatch = *it == "microbatch";
      if (r.reduce_every_microbatch && !r.shard_grads)
        fail(index, "reduce_every",
             "\"microbatch\" applies only with shard_grads (ZeRO-2/3 keep only a gradient shard)");
    }
    if (auto it = d.find("collective_copies"); it != d.end()) {
      if (!it->is_string() || (*it != "fsdp2" && *it != "none"))
        fail(index, "collective_copies",
             "must be \"fsdp2\" (PyTorch FSDP2's copies around its gathers and reduce-scatters) or \"none\"");
      r.fsdp2_copies = *it == "fsdp2";
      if (r.fsdp2_copies && !r.shard_params)
        fail(index, "collective_copies", "\"fsdp2\" applies only with shard_params (ZeRO-3 gathers)");
      if (r.fsdp2_copies && !r.reduce_every_microbatch)
        fail(index, "collective_copies",
             "\"fsdp2\" is modelled with reduce_every \"microbatch\" only (FSDP2's default; without gradient "
             "sync its unsharded gradients accumulate first)");
    }
    r.reduce_stream = get_string(d, index, "reduce_stream", "dp");
    r.gather_stream = get_string(d, index, "gather_stream", r.reduce_stream);
    return r;
  }
  if (op == "shard") {
    check_fields(d, index, {"filter", "devices", "stream", "degree", "chunks", "dispatch_dtype"});
    ShardDirective s;
    s.filter = parse_filter(require(d, index, "filter"), index, "filter", false);
    s.devices = parse_devices(d, index);
    s.stream = get_string(d, index, "stream", "ep");
    if (auto it = d.find("degree"); it != d.end()) {
      if (!it->is_number_integer() || it->get<long long>() < 1) fail(index, "degree", "must be a positive integer");
      // Checked before narrowing: 2^32 would become 0 and divide by zero below.
      if (it->get<long long>() > static_cast<long long>(s.devices.size()))
        fail(index, "degree", fmt::format("{} exceeds the {} devices", it->get<long long>(), s.devices.size()));
      s.degree = static_cast<int>(it->get<long long>());
      if (s.devices.size() % static_cast<std::size_t>(s.degree) != 0)
        fail(index, "degree", fmt::format("{} does not divide the {} devices", s.degree, s.devices.size()));
    }
    if (auto it = d.find("chunks"); it != d.end()) {
      if (!it->is_number_integer() || it->get<long long>() < 1 || it->get<long long>() > (1 << 20))
        fail(index, "chunks", "must be an integer in 1..1048576 (got " + it->dump() + ")");
      s.chunks = static_cast<int>(it->get<long long>());
    }
    if (auto it = d.find("dispatch_dtype"); it != d.end()) {
      if (!it->is_string() || (*it != "fp8" && *it != "activation"))
        fail(index, "dispatch_dtype",
             "must be \"fp8\" (e4m3 with a scale per 128 values) or \"activation\" (the activations' dtype), got " +
                 it->dump());
      if (*it == "fp8") s.dispatch_dtype = "fp8";
    }
    return s;
  }
  if (op == "split") {
    check_fields(d, index, {"filter", "dim_name", "num_microbatches"});
    SplitDirective s;
    s.filter = parse_filter(require(d, index, "filter"), index, "filter", false);
    s.dim_name = get_string(d, index, "dim_name", "MB");
    if (s.dim_name == "PASS") fail(index, "dim_name", "PASS is reserved");
    const json& n = require(d, index, "num_microbatches");
    if (!n.is_number_integer() || n.get<long long>() < 1) fail(index, "num_microbatches", "must be a positive integer");
    if (n.get<long long>() > limit_value(Limit::Microbatches))
      fail(index, "num_microbatches", limit_message(Limit::Microbatches, n.get<long long>(), "microbatches"));
    s.count = n.get<int>();
    return s;
  }
  if (op == "order") {
    check_fields(d, index, {"filters"});
    const json& groups = require(d, index, "filters");
    if (!groups.is_array() || groups.empty()) fail(index, "filters", "must be a non-empty array of filter groups");
    OrderDirective o;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      const std::string gf = "filters[" + std::to_string(g) + "]";
      if (!groups[g].is_array() || groups[g].empty()) fail(index, gf, "must be a non-empty array of filters");
      std::vector<Filter> group;
      for (std::size_t k = 0; k < groups[g].size(); ++k)
        group.push_back(parse_filter(groups[g][k], index, gf + "[" + std::to_string(k) + "]", true));
      o.groups.push_back(std::move(group));
    }
    return o;
  }
  if (op == "tensor_parallel") {
    check_fields(d, index, {"filter", "devices", "degree", "sequence_parallel", "comm_overlap", "expert_degree"});
    TensorParallelDirective t;
    t.filter = parse_filter(require(d, index, "filter"), index, "filter", false);
    if (d.contains("devices")) t.devices = parse_devices(d, index);
    const json& n = require(d, index, "degree");
    if (!n.is_number_integer() || n.get<long long>() < 1 || n.get<long long>() > 1'000'000)
      fail(index, "degree", "must be a positive integer");
    t.degree = n.get<int>();
    if (!t.devices.empty() && t.devices.size() % static_cast<std::size_t>(t.degree) != 0)
      fail(index, "degree", fmt::format("{} does not divide the {} devices", t.degree, t.devices.size()));
    t.sequence_parallel = get_bool(d, index, "sequence_parallel");
    if (t.sequence_parallel && t.degree == 1) fail(index, "sequence_parallel", "needs degree > 1");
    t.comm_overlap = get_bool(d, index, "comm_overlap");
    if (t.comm_overlap && t.degree == 1) fail(index, "comm_overlap", "needs degree > 1");
    // Megatron-LM's --tp-comm-overlap and TorchTitan's async TP pipeline SP's all-gathers and
    // reduce-scatters with the GEMMs; without SP, TP all-reduces, which neither overlaps (Megatron
    // asserts sequence_parallel): the overlap was costed anyway, a step 25 % faster than any runtime.
    if (t.comm_overlap && !t.sequence_parallel)
      fail(index, "comm_overlap",
           "needs \"sequence_parallel\": true (the overlap splits SP's all-gathers and reduce-scatters around the "
           "GEMMs; without SP, TP all-reduces, which Megatron-LM and TorchTitan do not overlap)");
    if (const auto it = d.find("expert_degree"); it != d.end()) {
      if (!it->is_number_integer() || it->get<long long>() < 1 || it->get<long long>() > 1'000'000)
        fail(index, "expert_degree", "must be a positive integer");
      t.expert_degree = it->get<int>();
      if (!t.devices.empty() && t.devices.size() % static_cast<std::size_t>(t.expert_degree) != 0)
        fail(index, "expert_degree",
             fmt::format("{} does not divide the {} devices", t.expert_degree, t.devices.size()));
    }
    return t;
  }
  if (op == "recompute") {
    check_fields(d, index, {"filter", "mode", "every", "first"});
    RecomputeDirective r;
    for (const char* field : {"every", "first"}) {
      auto it = d.find(field);
      if (it == d.end()) continue;
      if (!it->is_number_integer() || it->get<long long>() < 1 || it->get<long long>() > kMaxTagIndex)
        fail(index, field, fmt::format("must be a positive integer number of blocks, got {}", it->dump()));
      (std::string(field) == "every" ? r.every : r.first) = it->get<int>();
    }
    if (r.every > 0 && r.first > 0)
      fail(index, "first", "cannot be combined with \"every\" (choose one block selection)");
    r.filter = parse_filter(require(d, index, "filter"), index, "filter", false);
    const json& m = require(d, index, "mode");
    if (!m.is_string()) fail(index, "mode", "must be \"none\", \"selective\" or \"full\"");
    try {
      r.mode = recompute_from_string(m.get<std::string>());
    } catch (const std::invalid_argument& e) {
      fail(index, "mode", e.what());
    }
    return r;
  }
  if (op == "sm_partition") {
    check_fields(d, index, {"stream", "sms"});
    SmPartitionDirective p;
    p.partition.stream = get_string(d, index, "stream", "comm");
    // Only the communication streams as one class: per-stream partitions would need one SM group per
    // stream, and NCCL's and the simulator's SM use is per device, not per stream.
    if (p.partition.stream != "comm")
      fail(index, "stream",
           "must be \"comm\" (every communication stream of a device), got \"" + p.partition.stream + "\"");
    const json& n = require(d, index, "sms");
    if (!n.is_number_integer() || n.get<long long>() < 1 || n.get<long long>() > kMaxSms)
      fail(index, "sms", fmt::format("must be an integer number of SMs in [1, {}]", kMaxSms));
    p.partition.sms = n.get<int>();
    return p;
  }
  if (op == "context_parallel") {
    check_fields(d, index, {"degree", "comm"});
    ContextParallelDirective c;
    const json& n = require(d, index, "degree");
    if (!n.is_number_integer() || n.get<long long>() < 1 || n.get<long long>() > 1'000'000)
      fail(index, "degree", "must be a positive integer");
    c.degree = n.get<int>();
    const std::string comm = get_string(d, index, "comm", "ring");
    if (comm != "ring" && comm != "all_gather")
      fail(index, "comm", "must be \"ring\" or \"all_gather\", got \"" + comm + "\"");
    c.all_gather = comm == "all_gather";
    return c;
  }
  if (op == "clip_grad") {
    check_fields(d, index, {"max_norm"});
    ClipGradDirective c;
    const json& n = require(d, index, "max_norm");
    if (!n.is_number() || !(n.get<double>() > 0) || !std::isfinite(n.get<double>()))
      fail(index, "max_norm", "must be a positive number (the global gradient norm to clip to)");
    c.max_norm = n.get<double>();
    return c;
  }
  fail(index, "op",
       "unknown op '" + op + "'" +
           did_you_mean(op, {"place", "replicate", "shard", "split", "order", "tensor_parallel", "recompute",
                             "sm_partition", "context_parallel", "clip_grad"}) +
           " (expected place, replicate, shard, split, order, tensor_parallel, recompute, sm_partition, "
           "context_parallel or clip_grad)");
}

}  // namespace

std::string op_name(const Directive& d) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, PlaceDirective>) return "place";
        if constexpr (std::is_same_v<T, ReplicateDirective>) return "replicate";
        if constexpr (std::is_same_v<T, ShardDirective>) return "shard";
        if constexpr (std::is_same_v<T, SplitDirective>) return "split";
        if constexpr (std::is_same_v<T, TensorParallelDirective>) return "tensor_parallel";
        if constexpr (std::is_same_v<T, RecomputeDirective>) return "recompute";
        if constexpr (std::is_same_v<T, SmPartitionDirective>) return "sm_partition";
        if constexpr (std::is_same_v<T, ContextParallelDirective>) return "context_parallel";
        if constexpr (std::is_same_v<T, ClipGradDirective>) return "clip_grad";
        return "order";
      },
      d);
}

DirectiveProgram parse_directives(const json& program) {
  if (!program.is_array())
    throw Error(std::string("a directive program must be a JSON array, got ") + program.type_name());
  DirectiveProgram out;
  int sm_partition_at = -1, context_parallel_at = -1, clip_grad_at = -1;
  for (std::size_t i = 0; i < program.size(); ++i) {
    out.directives.push_back(parse_one(program[i], static_cast<int>(i)));
    out.source.push_back(program[i]);
    if (std::holds_alternative<ContextParallelDirective>(out.directives.back())) {
      if (context_parallel_at >= 0)
        fail(static_cast<int>(i), "op",
             fmt::format("a second context_parallel (directive {} already sets the CP degree)", context_parallel_at));
      context_parallel_at = static_cast<int>(i);
    }
    if (std::holds_alternative<ClipGradDirective>(out.directives.back())) {
      if (clip_grad_at >= 0)
        fail(static_cast<int>(i), "op",
             fmt::format("a second clip_grad (directive {} already clips the gradients)", clip_grad_at));
      clip_grad_at = static_cast<int>(i);
    }
    if (std::holds_alternative<SmPartitionDirective>(out.directives.back())) {
      if (sm_partition_at >= 0)
        fail(static_cast<int>(i), "op",
             fmt::format("a second sm_partition (directive {} already partitions the SMs)", sm_partition_at));
      sm_partition_at = static_cast<int>(i);
    }
  }
  return out;
}

json DirectiveProgram::to_json() const { return json(source); }

DirectiveProgram validated(const DirectiveProgram& program) { return parse_directives(program.to_json()); }

DirectiveProgram& DirectiveProgram::append(const DirectiveProgram& other) {
  directives.insert(directives.end(), other.directives.begin(), other.directives.end());
  source.insert(source.end(), other.source.begin(), other.source.end());
  return *this;
}

DirectiveProgram& DirectiveProgram::relabel_devices(const std::function<int(int)>& map) {
  for (std::size_t i = 0; i < directives.size(); ++i) {
    std::vector<int>* devices = std::visit(
        [](auto& d) -> std::vector<int>* {
          if constexpr (requires { d.devices; })
            return &d.devices;
          else
            return nullptr;
        },
        directives[i]);
    if (devices == nullptr || devices->empty()) continue;
    for (int& d : *devices) d = map(d);
    source[i]["devices"] = *devices;
  }
  return *this;
}

DirectiveProgram& DirectiveProgram::remove_if(const std::function<bool(const Directive&)>& drop) {
  std::size_t kept = 0;
  for (std::size_t i = 0; i < directives.size(); ++i) {
    if (drop(directives[i])) continue;
    if (kept != i) {  // never a self-move, which would empty the directive's strings
      directives[kept] = std::move(directives[i]);
      source[kept] = std::move(source[i]);
    }
    ++kept;
  }
  directives.resize(kept);
  source.resize(kept);
  return *this;
}

DirectiveProgram load_directives_file(const std::string& path) {
  const std::string text = read_input_file(path);
  json j;
  try {
    j = parse_json(text, path);
  } catch (const json::exception& e) {  // also number overflow (out_of_range.406)
    std::string what = e.what();
    if (auto p = what.find("parse error"); p != std::string::npos) what = what.substr(p);
    throw Error(path + ": not JSON: " + what);
  }
  try {
    return parse_directives(j);
  } catch (const DirectiveError& e) {
    throw e.in_file(path);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

}  // namespace piper::core
