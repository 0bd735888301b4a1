// Piper directives: JSON parsing with field-level errors, and one rewrite pass per directive kind,
// applied in a fixed order (split -> backward split -> place -> shard/replicate -> order).
#include "piper/core/directives.hpp"

#include <algorithm>
#include <deque>
#include <fstream>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
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
constexpr double kMaxBucketMb = 1e9;     // 1 PB: past it, the bucket size in bytes overflows int64
constexpr long long kMaxSms = 1 << 20;  // far above any GPU; the real bound is the device's SM count
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
      fail(index, key, "unknown field for '" + d["op"].get<std::string>() + "'" + did_you_mean(key, {allowed.begin(), allowed.end()}) +
                           " (allowed: " + list + ")");
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
        fail(index, where, "tag index " + std::to_string(value.get<long long>()) + " is larger than " + std::to_string(kMaxTagIndex));
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
    if (v >= limit_value(Limit::Devices)) fail(index, where, "device id " + std::to_string(v) + ": " + limit_message(Limit::Devices, v == INT64_MAX ? v : v + 1, "devices"));
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

Directive parse_one(const json& d, int index) {
  if (!d.is_object()) fail(index, "", "must be an object with an \"op\" field, got " + type_name(d));
  auto op_it = d.find("op");
  if (op_it == d.end()) fail(index, "op", "missing required field");
  if (!op_it->is_string()) fail(index, "op", "must be a string");
  const std::string op = op_it->get<std::string>();
  if (op == "place") {
    check_fields(d, index, {"filter", "devices", "stream"});
    PlaceDirective p;
    p.filter = parse_filter(require(d, index, "filter"), index, "filter", false);
    p.devices = parse_devices(d, index);
    p.stream = get_string(d, index, "stream", "pp");
    return p;
  }
  if (op == "replicate") {
    check_fields(d, index, {"filter", "devices", "bucket_size", "shard_grads", "shard_params", "shard_optimizer",
                            "reduce_stream", "gather_stream", "prefetch", "gather_unit", "shard_group", "reduce_every"});
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
        fail(index, "prefetch", fmt::format("must be an integer in [0, {}] (gathers running ahead of their use)", kMaxPrefetch));
      r.prefetch = it->get<int>();
    }
    if (auto it = d.find("gather_unit"); it != d.end()) {
      if (!r.shard_params) fail(index, "gather_unit", "applies only with shard_params (ZeRO-3 gathers)");
      if (!it->is_string() || (*it != "segment" && *it != "block"))
        fail(index, "gather_unit", "must be \"segment\" (the published format's unit) or \"block\" (one transformer block)");
      r.gather_blocks = *it == "block";
    }
    if (auto it = d.find("shard_group"); it != d.end()) {
      if (!r.shard_optimizer && !r.shard_grads) fail(index, "shard_group", "applies only with ZeRO (shard_optimizer, shard_grads or shard_params)");
      // Checked before narrowing; that it divides each segment's replicas is checked when applied.
      if (!it->is_number_integer() || it->get<long long>() < 2 || it->get<long long>() > static_cast<long long>(r.devices.size()))
        fail(index, "shard_group", fmt::format("must be an integer in [2, {}] (replicas per ZeRO shard group)", r.devices.size()));
      r.shard_group = it->get<int>();
    }
    r.reduce_every_microbatch = r.shard_grads;
    if (auto it = d.find("reduce_every"); it != d.end()) {
      if (!it->is_string() || (*it != "step" && *it != "microbatch"))
        fail(index, "reduce_every", "must be \"step\" (one reduction after the last microbatch) or \"microbatch\" (one after each)");
      r.reduce_every_microbatch = *it == "microbatch";
      if (r.reduce_every_microbatch && !r.shard_grads)
        fail(index, "reduce_every", "\"microbatch\" applies only with shard_grads (ZeRO-2/3 keep only a gradient shard)");
    }
    r.reduce_stream = get_string(d, index, "reduce_stream", "dp");
    r.gather_stream = get_string(d, index, "gather_stream", r.reduce_stream);
    return r;
  }
  if (op == "shard") {
    check_fields(d, index, {"filter", "devices", "stream", "degree"});
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
    check_fields(d, index, {"filter", "devices", "degree", "sequence_parallel", "comm_overlap"});
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
    return t;
  }
  if (op == "recompute") {
    check_fields(d, index, {"filter", "mode"});
    RecomputeDirective r;
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
      fail(index, "stream", "must be \"comm\" (every communication stream of a device), got \"" + p.partition.stream + "\"");
    const json& n = require(d, index, "sms");
    if (!n.is_number_integer() || n.get<long long>() < 1 || n.get<long long>() > kMaxSms)
      fail(index, "sms", fmt::format("must be an integer number of SMs in [1, {}]", kMaxSms));
    p.partition.sms = n.get<int>();
    return p;
  }
  fail(index, "op", "unknown op '" + op + "'" +
                        did_you_mean(op, {"place", "replicate", "shard", "split", "order", "tensor_parallel", "recompute", "sm_partition"}) +
                        " (expected place, replicate, shard, split, order, tensor_parallel, recompute or sm_partition)");
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
        return "order";
      },
      d);
}

DirectiveProgram parse_directives(const json& program) {
  if (!program.is_array())
    throw Error(std::string("a directive program must be a JSON array, got ") + program.type_name());
  DirectiveProgram out;
  int sm_partition_at = -1;
  for (std::size_t i = 0; i < program.size(); ++i) {
    out.directives.push_back(parse_one(program[i], static_cast<int>(i)));
    out.source.push_back(program[i]);
    if (std::holds_alternative<SmPartitionDirective>(out.directives.back())) {
      if (sm_partition_at >= 0)
        fail(static_cast<int>(i), "op", fmt::format("a second sm_partition (directive {} already partitions the SMs)", sm_partition_at));
      sm_partition_at = static_cast<int>(i);
    }
  }
  return out;
}

json DirectiveProgram::to_json() const { return json(source); }

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

// ---------------------------------------------------------------------------------------------
// Passes

namespace {

std::string set_str(const std::vector<int>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i == 8) {
      out += ",… " + std::to_string(s.size()) + " devices";
      break;
    }
    if (i) out += ',';
    out += std::to_string(s[i]);
  }
  return out + "]";
}

// The live compute nodes by tag value. Filters select compute nodes only; once the (backward) splits
// are done no pass adds, removes or retags one, yet every directive runs a filter and each order
// directive one per step (8 stages, 40 microbatches, an F and a B each: 8 directives x 80 steps), and
// scanning the whole DAG for each filter dominated compile time. candidates() holds every node the
// filter can select (those carrying its rarest exact tag value), ascending, so match() returns exactly
// what a scan of all vertices in index order returns.
class TagIndex {
 public:
  explicit TagIndex(const Graph& g) : g_(g) {
    for (auto v : boost::make_iterator_range(boost::vertices(g))) {
      const DagNode& n = g[v];
      if (n.kind != NodeKind::Compute || n.removed) continue;
      compute_.push_back(v);
      for (const auto& [tag, value] : n.tags) by_tag_[tag][value].push_back(v);
    }
  }

  const std::vector<Vertex>& candidates(const Filter& f) const {
    static const std::vector<Vertex> none;
    const std::vector<Vertex>* out = &compute_;
    for (const auto& [tag, value] : f.exact) {
      const std::vector<Vertex>* list = find(tag, value);
      if (!list) return none;
      if (list->size() < out->size()) out = list;
    }
    return *out;
  }

  std::vector<Vertex> match(const Filter& f) const {
    std::vector<Vertex> out;
    for (auto v : candidates(f))
      if (f.matches(g_[v])) out.push_back(v);
    return out;
  }

 private:
  const std::vector<Vertex>* find(const std::string& tag, int value) const {
    auto t = by_tag_.find(tag);
    if (t == by_tag_.end()) return nullptr;
    auto v = t->second.find(value);
    return v == t->second.end() ? nullptr : &v->second;
  }

  const Graph& g_;
  std::vector<Vertex> compute_;  // ascending, like every list below
  std::map<std::string, std::map<int, std::vector<Vertex>>> by_tag_;
};

// Working state of one apply_directives call.
struct PassContext {
  GlobalDag& dag;
  std::vector<std::string> p2p_stream;   // per vertex: stream of its region's point-to-point transfers
  std::vector<std::string> split_dims;   // dims created by split, outermost first
  std::vector<bool> replicated;          // per segment
  // Strict: the DAG is checked for cycles after every pass. Otherwise once per phase (see
  // apply_directives): a cycle found then is reported by rerunning the passes strictly.
  bool strict = true;

  Graph& g() { return dag.graph; }
  DagNode& node(Vertex v) { return dag.graph[v]; }

  // The live compute nodes by tag, kept until a compute node is added or removed (add, remove).
  std::optional<TagIndex> index;
  const TagIndex& tag_index() {
    if (!index) index.emplace(dag.graph);
    return *index;
  }
  // The nodes a filter selects, ascending.
  std::vector<Vertex> match(const Filter& f) { return tag_index().match(f); }

  Vertex add(DagNode n) {
    // Backstop for passes other than split (which checks up front, naming its directive).
    const auto nodes = static_cast<std::int64_t>(boost::num_vertices(dag.graph)) + 1;
    if (nodes > limit_value(Limit::DagNodes)) check_limit(Limit::DagNodes, nodes, "global training DAG", "nodes");
    if (n.label.empty()) n.label = node_label(n);
    if (n.kind == NodeKind::Compute) index.reset();
    Vertex v = dag.add_node(std::move(n));
    if (p2p_stream.size() <= v) p2p_stream.resize(v + 1);
    return v;
  }

  void remove(Vertex v) {
    if (dag.graph[v].kind == NodeKind::Compute) index.reset();
    boost::clear_vertex(v, dag.graph);
    dag.graph[v].removed = true;
  }
};

struct EdgeRec {
  Vertex u, v;
  DagEdge e;
};

std::vector<EdgeRec> out_edges_of(const Graph& g, Vertex u) {
  std::vector<EdgeRec> out;
  for (auto e : boost::make_iterator_range(boost::out_edges(u, g))) out.push_back({u, boost::target(e, g), g[e]});
  return out;
}
std::vector<EdgeRec> in_edges_of(const Graph& g, Vertex v) {
  std::vector<EdgeRec> out;
  for (auto e : boost::make_iterator_range(boost::in_edges(v, g))) out.push_back({boost::source(e, g), v, g[e]});
  return out;
}

bool is_backward(Pass p) { return p == Pass::B || p == Pass::BI || p == Pass::BW; }

// A split region must be contiguous within the forward pass and within the backward pass: no path
// leaves the region and comes back (the region is convex in the F sub-DAG and in the B sub-DAG).
void check_contiguous(PassContext& cx, const std::vector<Vertex>& matched, int index) {
  const Graph& g = cx.g();
  std::vector<char> in(boost::num_vertices(g), 0), seen(boost::num_vertices(g), 0);
  for (auto v : matched) in[v] = 1;
  std::deque<Vertex> queue;
  auto same_pass_family = [&](Vertex a, Vertex b) {
    return g[b].kind == NodeKind::Compute && (g[a].pass == Pass::F) == (g[b].pass == Pass::F);
  };
  for (auto u : matched)
    for (auto e : boost::make_iterator_range(boost::out_edges(u, g))) {
      Vertex w = boost::target(e, g);
      if (!in[w] && same_pass_family(u, w) && !seen[w]) seen[w] = 1, queue.push_back(w);
    }
  while (!queue.empty()) {
    Vertex x = queue.front();
    queue.pop_front();
    for (auto e : boost::make_iterator_range(boost::out_edges(x, g))) {
      Vertex w = boost::target(e, g);
      if (!same_pass_family(x, w)) continue;
      if (in[w])
        fail(index, "filter",
             "selects a non-contiguous region: '" + g[w].label + "' is reached from the region through '" + g[x].label +
                 "', which the filter does not select");
      if (!seen[w]) seen[w] = 1, queue.push_back(w);
    }
  }
}

void apply_split(PassContext& cx, const SplitDirective& d, int index) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  if (std::find(cx.split_dims.begin(), cx.split_dims.end(), d.dim_name) != cx.split_dims.end())
    fail(index, "dim_name", "dimension '" + d.dim_name + "' was already split");
  for (auto v : matched)
    if (cx.node(v).tags.contains(d.dim_name))
      fail(index, "dim_name", "'" + d.dim_name + "' is already a tag of '" + cx.node(v).label + "'");
  check_contiguous(cx, matched, index);
  // Nested splits multiply: refuse before copying anything.
  const std::int64_t microbatches = static_cast<std::int64_t>(cx.dag.microbatches) * d.count;
  if (microbatches > limit_value(Limit::Microbatches))
    fail(index, "num_microbatches", "with the splits before it, " + limit_message(Limit::Microbatches, microbatches, "microbatches"));
  const std::int64_t nodes = static_cast<std::int64_t>(boost::num_vertices(cx.g())) +
                             static_cast<std::int64_t>(matched.size()) * d.count;
  if (nodes > limit_value(Limit::DagNodes))
    fail(index, "num_microbatches", "the global DAG would reach " + limit_message(Limit::DagNodes, nodes, "nodes"));
  cx.split_dims.push_back(d.dim_name);

  Graph& g = cx.g();
  std::vector<char> in(boost::num_vertices(g), 0);
  for (auto v : matched) in[v] = 1;
  std::vector<EdgeRec> inside_or_out, from_outside;
  for (auto u : matched) {
    for (auto& r : out_edges_of(g, u)) inside_or_out.push_back(r);
    for (auto& r : in_edges_of(g, u))
      if (!in[r.u]) from_outside.push_back(r);
  }
  // Copies are created microbatch-major, so creation order (the lowering's tie-break) follows microbatches.
  std::vector<std::vector<Vertex>> copy(static_cast<std::size_t>(d.count));
  std::vector<std::size_t> pos(boost::num_vertices(g), 0);
  for (std::size_t i = 0; i < matched.size(); ++i) pos[matched[i]] = i;
  for (int k = 0; k < d.count; ++k) {
    for (auto v : matched) {
      DagNode n = cx.node(v);
      n.tags[d.dim_name] = k;
      n.label.clear();
      copy[k].push_back(cx.add(std::move(n)));
    }
  }
  for (int k = 0; k < d.count; ++k) {
    for (const auto& r : inside_or_out)
      cx.dag.add_edge(copy[k][pos[r.u]], in[r.v] ? copy[k][pos[r.v]] : r.v, r.e);
    for (const auto& r : from_outside) cx.dag.add_edge(r.u, copy[k][pos[r.v]], r.e);
  }
  for (auto v : matched) cx.remove(v);
  cx.dag.microbatches *= d.count;
  cx.dag.splits.push_back({d.dim_name, d.count});
}

// Splits B into BI (input gradient, on the critical path) and BW (weight gradient, deferrable) for
// every B node selected by an order filter that names BI or BW.
void apply_backward_split(PassContext& cx, const std::vector<Filter>& filters) {
  // The B nodes whose tags some filter matches (its PASS aside), ascending.
  std::vector<char> selected(boost::num_vertices(cx.g()), 0);
  for (const auto& f : filters)
    for (auto v : cx.tag_index().candidates(f))
      if (!selected[v] && cx.node(v).pass == Pass::B && f.matches_tags(cx.node(v).tags)) selected[v] = 1;
  std::vector<Vertex> targets;
  for (Vertex v = 0; v < selected.size(); ++v)
    if (selected[v]) targets.push_back(v);
  Graph& g = cx.g();
  for (auto b : targets) {
    DagNode bi = cx.node(b), bw = cx.node(b);
    bi.pass = Pass::BI;
    bi.costs.backward_weight_flops = 0;
    bi.costs.backward_weight_gemm_kernels = 0;
    bw.costs.backward_input_gemm_kernels = 0;
    bi.costs.backward_memory_bytes = cx.node(b).costs.backward_memory_bytes / 2;
    bw.pass = Pass::BW;
    bw.costs.backward_input_flops = 0;
    bw.costs.backward_memory_bytes -= bi.costs.backward_memory_bytes;
    // Element-wise kernels and TP collectives of the backward belong to the input-gradient half.
    bw.costs.backward_elementwise_bytes = 0;
    bw.costs.backward_tp_bytes = 0;
    bw.costs.backward_tp_collectives = 0;
    bi.label.clear();
    bw.label.clear();
    auto ins = in_edges_of(g, b), outs = out_edges_of(g, b);
    Vertex vi = cx.add(std::move(bi)), vw = cx.add(std::move(bw));
    for (const auto& r : ins) {
      cx.dag.add_edge(r.u, vi, r.e);
      if (r.e.tensor == "stash") cx.dag.add_edge(r.u, vw, r.e);
    }
    for (const auto& r : outs) cx.dag.add_edge(cx.node(r.v).kind == NodeKind::Update ? vw : vi, r.v, r.e);
    // BW reads what BI computed (the gradient at the layer outputs): it runs after its BI.
    cx.dag.add_edge(vi, vw, {EdgeKind::Data, 0, "igrad"});
    cx.remove(b);
  }
}

void apply_place(PassContext& cx, const PlaceDirective& d, int index, std::vector<int>& placed_by) {
  if (d.filter.pass) fail(index, "filter", "place cannot select a single pass");
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  DeviceSetId set = cx.dag.device_sets.intern(d.devices);
  if (placed_by.size() < cx.p2p_stream.size()) placed_by.resize(cx.p2p_stream.size(), -1);
  for (auto v : matched) {
    auto& n = cx.node(v);
    if (n.devices != kNoDevices && n.devices != set)
      fail(index, "filter",
           "'" + n.label + "' is already placed on " + set_str(cx.dag.device_sets.at(n.devices)) + " by directive " +
               std::to_string(placed_by[v]));
    n.devices = set;
    cx.p2p_stream[v] = d.stream;
    placed_by[v] = index;
  }
}

std::string common_tags_label(const GlobalDag& dag, const std::vector<int>& segments) {
  TagMap common = dag.segments.at(static_cast<std::size_t>(segments.front())).tags;
  for (int s : segments) {
    const auto& t = dag.segments.at(static_cast<std::size_t>(s)).tags;
    for (auto it = common.begin(); it != common.end();) it = (t.contains(it->first) && t.at(it->first) == it->second) ? std::next(it) : common.erase(it);
  }
  std::string out;
  for (const auto& [k, v] : common) out += " " + k + std::to_string(v);
  if (segments.size() == 1) out += " s" + std::to_string(segments.front());
  else out += " s" + std::to_string(*std::min_element(segments.begin(), segments.end())) + "-" +
              std::to_string(*std::max_element(segments.begin(), segments.end()));
  return out;
}

// After all place directives: every compute node is placed, UPD nodes follow their segments and
// merge per device set, and every data edge between different device sets becomes SEND -> RECV.
void finish_placement(PassContext& cx, bool any_place) {
  auto& dag = cx.dag;
  Graph& g = cx.g();
  if (!any_place) {
    DeviceSetId zero = dag.device_sets.intern({0});
    for (auto v : dag.live_nodes())
      if (cx.node(v).kind == NodeKind::Compute) cx.node(v).devices = zero, cx.p2p_stream[v] = "pp";
  }
  for (auto v : dag.live_nodes()) {
    const auto& n = cx.node(v);
    if (n.kind == NodeKind::Compute && n.devices == kNoDevices)
      throw Error("directives: '" + n.label + "' is not placed by any place directive (tags " +
                  Filter{n.tags, {}, {}}.to_string() + ")");
    if (n.kind == NodeKind::Compute) dag.segments.at(static_cast<std::size_t>(n.segment)).placed = true;
  }
  // UPD: on the device set of the backward nodes that feed it; one UPD per device set.
  std::map<DeviceSetId, Vertex> upd_of_set;
  for (auto v : dag.live_nodes()) {
    auto& n = cx.node(v);
    if (n.kind != NodeKind::Update) continue;
    DeviceSetId set = kNoDevices;
    for (const auto& r : in_edges_of(g, v)) {
      DeviceSetId s = cx.node(r.u).devices;
      if (set != kNoDevices && s != set)
        throw Error("directives: the copies of segment " + std::to_string(n.segment) +
                    " are placed on different device sets (" + set_str(dag.device_sets.at(set)) + " and " +
                    set_str(dag.device_sets.at(s)) + "); one segment's parameters must live on one device set");
      set = s;
    }
    n.devices = set;
    auto [it, fresh] = upd_of_set.try_emplace(set, v);
    if (fresh) continue;
    Vertex keep = it->second;
    for (const auto& r : in_edges_of(g, v)) dag.add_edge(r.u, keep, r.e);
    auto& kn = cx.node(keep);
    kn.buffer_segments.insert(kn.buffer_segments.end(), n.buffer_segments.begin(), n.buffer_segments.end());
    cx.remove(v);
  }
  for (auto& [set, v] : upd_of_set) {
    auto& n = cx.node(v);
    std::sort(n.buffer_segments.begin(), n.buffer_segments.end());
    n.label = "UPD" + common_tags_label(dag, n.buffer_segments);
  }
  // Point-to-point transfers between device sets.
  std::vector<EdgeRec> cross;
  for (auto e : boost::make_iterator_range(boost::edges(g))) {
    Vertex u = boost::source(e, g), v = boost::target(e, g);
    if (g[u].kind == NodeKind::Compute && g[v].kind == NodeKind::Compute && g[u].devices != g[v].devices)
      cross.push_back({u, v, g[e]});
  }
  for (const auto& r : cross) {
    const auto& su = dag.device_sets.at(cx.node(r.u).devices);
    const auto& sv = dag.device_sets.at(cx.node(r.v).devices);
    if (su.size() != sv.size())
      throw Error("directives: '" + cx.node(r.u).label + "' on " + set_str(su) + " feeds '" + cx.node(r.v).label +
                  "' on " + set_str(sv) + ": device sets of different sizes cannot be paired for point-to-point");
    boost::remove_edge(r.u, r.v, g);
    DagNode send;
    send.kind = NodeKind::Send;
    send.pass = cx.node(r.u).pass;
    send.tags = cx.node(r.u).tags;
    send.segment = cx.node(r.u).segment;
    send.devices = cx.node(r.u).devices;
    send.peer_devices = cx.node(r.v).devices;
    // One stream per direction and peer set: a rendezvous SEND must never queue behind a RECV from
    // another peer (or a send to another peer), which would hold the pipeline beyond its schedule.
    // Send and receive streams never share a name (the sets differ), so an exchange between mirrored
    // sets ([0,1] -> [1,0]) sends and receives at once, as an NCCL send/recv group does.
    send.stream = cx.p2p_stream[r.u] + ">" + set_str(sv);
    send.bytes = r.e.bytes;
    send.label = "SEND " + cx.node(r.u).label + " -> s" + std::to_string(cx.node(r.v).segment);
    DagNode recv = send;
    recv.kind = NodeKind::Recv;
    recv.pass = cx.node(r.v).pass;
    recv.tags = cx.node(r.v).tags;
    recv.segment = cx.node(r.v).segment;
    recv.devices = cx.node(r.v).devices;
    recv.peer_devices = cx.node(r.u).devices;
    recv.stream = cx.p2p_stream[r.v] + "<" + set_str(su);
    recv.label = "RECV " + cx.node(r.v).label + " <- s" + std::to_string(cx.node(r.u).segment);
    Vertex vs = cx.add(std::move(send));
    Vertex vr = cx.add(std::move(recv));
    dag.add_edge(r.u, vs, r.e);
    dag.add_edge(vs, vr, r.e);
    dag.add_edge(vr, r.v, r.e);
  }
}

// Matched nodes must sit on exactly the directive's devices (in order).
void check_devices(PassContext& cx, const std::vector<Vertex>& matched, const std::vector<int>& devices, int index) {
  for (auto v : matched) {
    const auto& placed = cx.dag.device_sets.at(cx.node(v).devices);
    if (placed != devices)
      fail(index, "devices",
           set_str(devices) + " differ from the placement " + set_str(placed) + " of '" + cx.node(v).label + "'");
  }
}

std::vector<int> segments_of(PassContext& cx, const std::vector<Vertex>& nodes) {
  std::set<int> s;
  for (auto v : nodes) s.insert(cx.node(v).segment);
  return {s.begin(), s.end()};
}

// Per-device costs of a segment sharded over `degree` devices that are data-parallel replicas (each
// holds its own microbatch; expert parallelism as generated and as in the published programs): each
// device keeps 1/degree of the parameters and of their weight traffic, but the all-to-all brings it
// every token routed to its experts from all `degree` devices, so with balanced routing it computes
// (and stashes activations for) exactly as many token-expert pairs as one unsharded device would.
// Dividing the FLOPs as well, as this pass once did, made expert parallelism look degree x cheaper
// than it is (experiments/pp-ep-moe/README.md).
void scale_costs(Costs& c, int degree) {
  c.params /= degree;
  c.param_bytes /= degree;
  c.forward_memory_bytes /= degree;
  c.backward_memory_bytes /= degree;
}

void apply_shard(PassContext& cx, const ShardDirective& d, int index) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  check_devices(cx, matched, d.devices, index);
  const int degree = d.degree > 0 ? d.degree : static_cast<int>(d.devices.size());
  for (int s : segments_of(cx, matched)) {
    auto& seg = cx.dag.segments.at(static_cast<std::size_t>(s));
    if (seg.shard_degree != 1) fail(index, "filter", "segment " + std::to_string(s) + " is already sharded");
    seg.shard_degree = degree;
  }
  if (degree == 1) return;
  Graph& g = cx.g();
  DeviceSetId set = cx.dag.device_sets.intern(d.devices);
  int family = cx.dag.family_index({set, degree, 1, FamilyPurpose::Ep});
  std::vector<char> in(boost::num_vertices(g), 0);
  for (auto v : matched) in[v] = 1;
  std::vector<EdgeRec> crossing;
  for (auto v : matched) {
    auto& n = cx.node(v);
    scale_costs(n.costs, degree);
    for (auto& r : in_edges_of(g, v))
      if (!in[r.u] && r.e.kind == EdgeKind::Data && cx.node(r.u).kind != NodeKind::Update) crossing.push_back(r);
    for (auto& r : out_edges_of(g, v))
      if (!in[r.v] && r.e.kind == EdgeKind::Data && cx.node(r.v).kind != NodeKind::Update) crossing.push_back(r);
  }
  for (const auto& r : crossing) {
    const bool into = in[r.v];
    Vertex sharded = into ? r.v : r.u;
    const auto& sn = cx.node(sharded);
    DagNode a2a;
    a2a.kind = NodeKind::AllToAll;
    a2a.pass = sn.pass;
    a2a.tags = sn.tags;
    a2a.segment = sn.segment;
    a2a.devices = set;
    a2a.stream = d.stream;
    a2a.family = family;
    a2a.bytes = r.e.bytes * cx.dag.segments.at(static_cast<std::size_t>(sn.segment)).fanout;
    a2a.label = std::string("ALL_TO_ALL ") + (into ? "dispatch " : "combine ") + sn.label;
    boost::remove_edge(r.u, r.v, g);
    Vertex a = cx.add(std::move(a2a));
    DagEdge e = r.e;
    cx.dag.add_edge(r.u, a, e);
    e.bytes = cx.node(a).bytes;
    cx.dag.add_edge(a, r.v, e);
  }
}

void apply_replicate(PassContext& cx, const ReplicateDirective& d, int index) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  check_devices(cx, matched, d.devices, index);
  auto& dag = cx.dag;
  Graph& g = cx.g();
  const int n = static_cast<int>(d.devices.size());
  const int zero = d.shard_params ? 3 : d.shard_grads ? 2 : d.shard_optimizer ? 1 : 0;
  DeviceSetId set = dag.device_sets.intern(d.devices);
  // HSDP: the replicas of one slot j (TP rank or expert shard) are devices[j + i * split], i < R.
  // Shard group g holds replicas i in [g k, (g + 1) k); the replicate group of shard q holds the
  // replicas i = q + g k. Each family lists its groups one after another in an interned order.
  // The pair depends on the split only (k is the directive's and R = n / split): built once per split,
  // not once per segment (O(devices) each).
  std::map<int, std::pair<int, int>> hsdp_by_split;
  auto hsdp_families = [&](int split, int replicas, int k) {
    if (auto it = hsdp_by_split.find(split); it != hsdp_by_split.end()) return it->second;
    const int groups = replicas / k;
    std::vector<int> within, across;
    auto device = [&](int j, int g, int q) { return d.devices[static_cast<std::size_t>(j + (g * k + q) * split)]; };
    for (int j = 0; j < split; ++j)
      for (int g = 0; g < groups; ++g)
        for (int q = 0; q < k; ++q) within.push_back(device(j, g, q));
    for (int j = 0; j < split; ++j)
      for (int q = 0; q < k; ++q)
        for (int g = 0; g < groups; ++g) across.push_back(device(j, g, q));
    return hsdp_by_split[split] = std::pair{dag.family_index({dag.device_sets.intern(within), k, 1, FamilyPurpose::DpShard}),
                                            dag.family_index({dag.device_sets.intern(across), groups, 1, FamilyPurpose::DpReplicate})};
  };
  // Segments grouped by communicator family: fully replicated ones over all devices; partially
  // sharded ones (shard degree < devices) over the strided groups holding the same shard. With
  // HSDP, `across` is the family of the cross-group all-reduce (-1: none).
  struct Families {
    int reduce = -1, across = -1;
    auto operator<=>(const Families&) const = default;
  };
  std::map<Families, std::vector<int>> by_family;
  for (int s : segments_of(cx, matched)) {
    auto& seg = dag.segments.at(static_cast<std::size_t>(s));
    if (cx.replicated.at(static_cast<std::size_t>(s))) fail(index, "filter", "segment " + std::to_string(s) + " is already replicated");
    cx.replicated[static_cast<std::size_t>(s)] = true;
    if (seg.shard_degree >= n) continue;  // fully sharded: nothing to reduce
    // A TP segment's replicas are the strided groups of devices with the same TP rank.
    const int split = seg.tp_degree > 1 ? seg.tp_degree : seg.shard_degree;
    seg.replicas = n / split;
    seg.zero_level = zero;
    seg.reduce_every_microbatch = d.reduce_every_microbatch && zero >= 2;
    seg.zero_shards = zero_shards_of(seg.replicas, d.shard_group);
    if (seg.replicas % seg.zero_shards != 0)
      fail(index, "shard_group", fmt::format("{} does not divide the {} replicas of segment {}", d.shard_group, seg.replicas, s));
    if (!seg.has_state() || seg.replicas == 1) continue;
    if (seg.zero_shards < seg.replicas) {
      auto [within, across] = hsdp_families(split, seg.replicas, seg.zero_shards);
      by_family[{within, across}].push_back(s);
      continue;
    }
    CommFamily fam = split == 1                ? CommFamily{set, n, 1, FamilyPurpose::Dp}
                     : seg.tp_degree > 1       ? CommFamily{set, n / split, split, FamilyPurpose::Dp}
                                               : CommFamily{set, n / split, split, FamilyPurpose::DpEp};
    by_family[{dag.family_index(fam), -1}].push_back(s);
  }
  // The UPD of this device set, and the backward nodes that produce each segment's gradient.
  Vertex upd = boost::graph_traits<Graph>::null_vertex();
  std::map<int, std::vector<Vertex>> producers, consumers;  // segment -> nodes
  for (auto v : dag.live_nodes()) {
    auto& nd = cx.node(v);
    if (nd.kind == NodeKind::Update && nd.devices == set) upd = v;
    if (nd.kind != NodeKind::Compute || nd.devices != set) continue;
    if (nd.pass == Pass::B || nd.pass == Pass::BW) producers[nd.segment].push_back(v);
    consumers[nd.segment].push_back(v);
  }
  const std::int64_t cap = static_cast<std::int64_t>(d.bucket_size_mb * 1024.0 * 1024.0);
  for (auto& [families, segs] : by_family) {
    const int family = families.reduce;
    std::sort(segs.rbegin(), segs.rend());  // gradients become ready last segment first
    std::vector<std::vector<int>> buckets;
    std::int64_t filled = 0;
    for (int s : segs) {
      std::int64_t bytes = dag.segments[static_cast<std::size_t>(s)].state_params() * gradient_bytes_per_element(dag.training);
      if (buckets.empty() || cap == 0 || filled + bytes > cap) buckets.emplace_back(), filled = 0;
      buckets.back().push_back(s);
      filled += bytes;
    }
    for (const auto& bucket : buckets) {
      std::int64_t bytes = 0;
      for (int s : bucket) bytes += dag.segments[static_cast<std::size_t>(s)].state_params() * gradient_bytes_per_element(dag.training);
      const std::string what = common_tags_label(dag, bucket);
      DagNode red;
      red.kind = zero == 0 ? NodeKind::AllReduce : NodeKind::ReduceScatter;
      // The family's own order of the set's devices (HSDP lists its groups one after another).
      red.devices = dag.families[static_cast<std::size_t>(family)].devices;
      red.stream = d.reduce_stream;
      red.family = family;
      red.bytes = bytes;
      red.segment = bucket.front();
      red.buffer_segments = bucket;
      red.tags = dag.segments[static_cast<std::size_t>(bucket.front())].tags;
      red.label = to_string(red.kind) + what;
      // One reduction after the last microbatch, or (reduce_every "microbatch") one per microbatch,
      // each after that microbatch's backward of the bucket's segments.
      std::map<std::vector<int>, std::vector<Vertex>> rounds;
      for (int s : bucket)
        for (auto p : producers[s]) {
          std::vector<int> key;
          if (d.reduce_every_microbatch)
            for (const auto& dim : cx.split_dims) key.push_back(cx.node(p).tags.contains(dim) ? cx.node(p).tags.at(dim) : -1);
          rounds[key].push_back(p);
        }
      if (rounds.empty()) rounds[{}];
      std::vector<Vertex> reduced;
      for (auto& [key, from] : rounds) {
        DagNode round = red;
        if (d.reduce_every_microbatch && !from.empty()) {
          round.tags = cx.node(from.front()).tags;
          round.label = to_string(red.kind) + tags_label(round.tags) + " s" + std::to_string(bucket.front());
        }
        Vertex vr = cx.add(round);
        for (auto p : from) {
          if (upd != boost::graph_traits<Graph>::null_vertex()) boost::remove_edge(p, upd, g);
          dag.add_edge(p, vr, {EdgeKind::Data, bytes, "grad"});
        }
        reduced.push_back(vr);
      }
      if (families.across >= 0) {
        // HSDP: each shard, reduced inside its group (over every round), is summed over the groups
        // holding the same shard: once, after the last round.
        DagNode across = red;
        across.kind = NodeKind::AllReduce;
        across.family = families.across;
        across.devices = dag.families[static_cast<std::size_t>(families.across)].devices;
        across.bytes = bytes / dag.segments[static_cast<std::size_t>(bucket.front())].zero_shards;
        across.label = "ALL_REDUCE across" + what;
        const Vertex va = cx.add(across);
        for (Vertex vr : reduced) dag.add_edge(vr, va, {EdgeKind::Data, across.bytes, "grad"});
        reduced = {va};
      }
      if (upd != boost::graph_traits<Graph>::null_vertex())
        for (Vertex vr : reduced) dag.add_edge(vr, upd, {EdgeKind::Data, bytes, "grad"});
      DagNode ag = red;
      ag.kind = NodeKind::AllGather;
      ag.stream = d.gather_stream;
      if (zero == 1 || zero == 2) {
        // Each rank updated its shard of the parameters: gather the full parameters back.
        ag.label = "ALL_GATHER" + what;
        Vertex va = cx.add(ag);
        if (upd != boost::graph_traits<Graph>::null_vertex()) dag.add_edge(upd, va, {EdgeKind::Data, bytes, "param"});
      } else if (zero == 3) {
        // ZeRO-3: gather the bucket's parameters before each use: once per microbatch for F and once
        // for the backward (kept from BI to BW), freed after the last use.
        std::map<std::pair<bool, std::vector<int>>, std::vector<Vertex>> uses;
        for (int s : bucket)
          for (auto c : consumers[s]) {
            std::vector<int> key;
            for (const auto& dim : cx.split_dims) key.push_back(cx.node(c).tags.contains(dim) ? cx.node(c).tags.at(dim) : -1);
            uses[{is_backward(cx.node(c).pass), key}].push_back(c);
          }
        for (auto& [key, users] : uses) {
          DagNode pre = ag;
          pre.pass = key.first ? Pass::B : Pass::F;
          pre.tags = cx.node(users.front()).tags;
          pre.prefetch = d.prefetch;
          pre.label = "ALL_GATHER" + std::string(key.first ? " B" : " F") + tags_label(pre.tags) + " s" +
                      std::to_string(bucket.front());
          Vertex va = cx.add(pre);
          for (auto c : users) dag.add_edge(va, c, {EdgeKind::Data, bytes, "param"});
        }
      }
    }
  }
}

// Tied embeddings: when the head's segment keeps a copy of the table (Segment::tied_copy) on other
// devices than the embedding's, the two copies' gradients are summed by an ALL_REDUCE over pairs
// (family "tied-embedding": the device at position p of the embedding's set with the one at position
// p of the head's, same data-parallel and TP rank), after each side's last backward of the segment
// and before its data-parallel reduction and update (Megatron-LM's distributed optimizer sums the
// embedding group first, then reduce-scatters; a sum of local gradients commutes with the
// data-parallel sum). Its own stream, so that only the buckets holding the table wait for it.
// Sets that share a device (V placements: a local sum; mirrored placements, which the runtime
// refuses) get no op.
void link_tied_embedding(PassContext& cx) {
  auto& dag = cx.dag;
  const auto tied = std::find_if(dag.segments.begin(), dag.segments.end(), [](const Segment& s) { return s.tied_copy > 0; });
  if (tied == dag.segments.end()) return;
  const int head = tied->index, embed = tied->tied_to;
  // Each segment's device set; two sets for one segment (a mirrored placement's two copies): no op.
  DeviceSetId e = kNoDevices, h = kNoDevices;
  bool mirrored = false;
  auto note = [&](DeviceSetId& set, DeviceSetId d) { mirrored |= set != kNoDevices && set != d, set = d; };
  for (auto v : dag.live_nodes()) {
    const auto& n = cx.node(v);
    if (n.kind != NodeKind::Compute) continue;
    if (n.segment == embed) note(e, n.devices);
    if (n.segment == head) note(h, n.devices);
  }
  if (mirrored || e == kNoDevices || h == kNoDevices) return;
  const std::vector<int>& de = dag.device_sets.at(e);
  const std::vector<int>& dh = dag.device_sets.at(h);
  if (de.size() != dh.size()) return;
  const std::set<int> in_e(de.begin(), de.end());
  if (std::any_of(dh.begin(), dh.end(), [&](int d) { return in_e.contains(d); })) return;
  std::vector<int> pairs;
  for (std::size_t p = 0; p < de.size(); ++p) pairs.push_back(de[p]), pairs.push_back(dh[p]);
  DagNode sum;
  sum.kind = NodeKind::AllReduce;
  sum.family = dag.family_index({dag.device_sets.intern(pairs), 2, 1, FamilyPurpose::TiedEmbedding});
  sum.devices = dag.families[static_cast<std::size_t>(sum.family)].devices;
  sum.stream = "tied";
  sum.bytes = tied->copy_local_params() * gradient_bytes_per_element(dag.training);
  sum.segment = head;
  sum.buffer_segments = {embed, head};
  sum.label = "ALL_REDUCE tied embedding s" + std::to_string(embed) + "+s" + std::to_string(head);
  const Vertex vs = cx.add(sum);
  for (auto v : dag.live_nodes()) {
    if (v == vs) continue;
    const auto& n = cx.node(v);
    const int side = n.devices == e ? embed : n.devices == h ? head : -1;
    const bool mine = side >= 0 && n.segment == side;
    if (n.kind == NodeKind::Compute && mine && (n.pass == Pass::B || n.pass == Pass::BW))
      dag.add_edge(v, vs, {EdgeKind::Data, sum.bytes, "grad"});
    // Reductions and updates of the buffers holding the table (each on its own side's devices).
    const bool reduces = n.kind == NodeKind::Update || n.kind == NodeKind::ReduceScatter ||
                         (n.kind == NodeKind::AllReduce && n.family != sum.family);
    const auto& bs = n.buffer_segments;
    if (reduces && (std::find(bs.begin(), bs.end(), embed) != bs.end() || std::find(bs.begin(), bs.end(), head) != bs.end()))
      dag.add_edge(vs, v, {EdgeKind::Data, sum.bytes, "grad"});
  }
}

// UPD costs once sharding is known: AdamW reads/writes parameters, gradients and the optimizer
// states of this device's shard (ZeRO: Rajbhandari et al. 2020, 2 + 2 + 12 bytes per parameter in
// mixed precision), at about 10 FLOPs per parameter. The step also reads every gradient once for
// the global gradient norm (clipping: Megatron-LM's default --clip-grad 1.0, GPT-3, Llama) and
// zeroes the gradient buffer for the next step: two more passes of dt bytes per parameter.
void cost_updates(PassContext& cx) {
  auto& dag = cx.dag;
  const int dt = bytes_per_element(dag.training.precision);
  const int state = fp32_storage(dag.training.precision) ? 8 : 12;
  for (auto v : dag.live_nodes()) {
    auto& n = cx.node(v);
    if (n.kind != NodeKind::Update) continue;
    std::int64_t params = 0;
    for (int s : n.buffer_segments) {
      const auto& seg = dag.segments.at(static_cast<std::size_t>(s));
      params += seg.state_params() / seg.zero_divisor(1);
    }
    n.costs = Costs{};
    n.costs.params = params;
    n.costs.forward_flops = 10.0 * static_cast<double>(params);
    if (dag.training.fp32_main_grads && !fp32_storage(dag.training.precision)) {
      // Megatron-LM's Float16OptimizerWithFloat16Params (megatron/optimizer/optimizer.py): the
      // gradient norm reads the fp32 main_grad (4), Adam reads it (4) and reads and writes the fp32
      // main parameter and both moments (2 x 12), _copy_main_params_to_model_params reads the main
      // parameter (4) and writes the model parameter (dt), and the main_grad buffer is zeroed (4).
      n.costs.forward_memory_bytes = params * (4 + 4 + 2 * state + 4 + dt + 4);
    } else {
      n.costs.forward_memory_bytes = params * (2 * dt + 2 * state + 2 * dt);
    }
  }
}

void apply_order(PassContext& cx, const OrderDirective& d, int index) {
  auto& dag = cx.dag;
  std::vector<std::vector<Vertex>> groups;
  std::map<Vertex, std::size_t> group_of;
  DeviceSetId set = kNoDevices;
  std::string set_origin;
  std::vector<int> set_members;
  // Each set is sorted once (V placements select nodes on two mirrored sets many times over).
  std::map<DeviceSetId, std::vector<int>> sorted_sets;
  auto sorted_devices = [&](DeviceSetId id) -> const std::vector<int>& {
    auto [it, fresh] = sorted_sets.try_emplace(id);
    if (fresh) {
      it->second = dag.device_sets.at(id);
      std::sort(it->second.begin(), it->second.end());
    }
    return it->second;
  };
  for (std::size_t gi = 0; gi < d.groups.size(); ++gi) {
    std::vector<Vertex> members;
    for (std::size_t fi = 0; fi < d.groups[gi].size(); ++fi) {
      auto matched = cx.match(d.groups[gi][fi]);
      auto field = [&] { return "filters[" + std::to_string(gi) + "][" + std::to_string(fi) + "]"; };
      if (matched.empty()) fail(index, field(), "matches no node (" + d.groups[gi][fi].to_string() + ")");
      for (auto v : matched) {
        const auto& n = cx.node(v);
        if (set == kNoDevices) set = n.devices, set_origin = field(), set_members = sorted_devices(n.devices);
        // Sets holding the same devices in another order (mirrored data-parallel copies) share one
        // order: each device still sees one total order of its own nodes.
        if (n.devices != set && sorted_devices(n.devices) != set_members)
          fail(index, field(),
               "'" + n.label + "' runs on " + set_str(dag.device_sets.at(n.devices)) + " but " + set_origin +
                   " selects nodes on " + set_str(dag.device_sets.at(set)) + ": an order cannot cross device sets");
        auto [it, fresh] = group_of.try_emplace(v, gi);
        if (!fresh && it->second != gi)
          fail(index, field(), "'" + n.label + "' is already selected by group " + std::to_string(it->second));
        if (fresh) members.push_back(v);
      }
    }
    groups.push_back(std::move(members));
  }
  // The members of one group form one step (e.g. an overlapped F&B pair): the step starts when the
  // inputs of all its members are ready, so each member also waits for the others' producers.
  std::vector<std::vector<std::pair<Vertex, Vertex>>> costart(groups.size());
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    if (groups[gi].size() < 2) continue;
    std::set<Vertex> members(groups[gi].begin(), groups[gi].end()), producers;
    // A producer is internal when it is a member or communication fed by a member (e.g. the
    // all-to-all between two segments of one matched chain); only external producers gate the step.
    std::map<Vertex, bool> memo;
    std::function<bool(Vertex)> internal = [&](Vertex p) -> bool {
      if (members.contains(p)) return true;
      if (!is_communication(dag.graph[p].kind)) return false;
      if (auto it = memo.find(p); it != memo.end()) return it->second;
      bool fed = false;
      for (auto e : boost::make_iterator_range(boost::in_edges(p, dag.graph)))
        if (dag.graph[e].kind == EdgeKind::Data && internal(boost::source(e, dag.graph))) fed = true;
      return memo[p] = fed;
    };
    // ZeRO-3's per-use parameter gathers do not gate the step: each member waits for its own
    // segment's parameters only, so a step's later segments gather while its first ones compute
    // (FSDP's prefetch; the replicate directive's `prefetch` bounds how far ahead).
    for (auto w : groups[gi])
      for (auto e : boost::make_iterator_range(boost::in_edges(w, dag.graph)))
        if (dag.graph[e].kind == EdgeKind::Data && !internal(boost::source(e, dag.graph)) &&
            !is_parameter_gather(dag.graph[boost::source(e, dag.graph)]))
          producers.insert(boost::source(e, dag.graph));
    for (auto v : groups[gi])
      for (auto u : producers)
        if (!boost::edge(u, v, dag.graph).second) costart[gi].emplace_back(u, v);
  }
  auto add_costart = [&](std::size_t gi) {
    for (auto [u, v] : costart[gi]) dag.add_edge(u, v, {EdgeKind::Temporal, 0, "step"});
  };
  std::vector<Vertex> dummies;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) add_costart(gi);
  for (std::size_t gi = 0; gi + 1 < groups.size(); ++gi) {
    DagNode dummy;
    dummy.kind = NodeKind::OrderDummy;
    dummy.devices = set;
    dummy.label = "ORDER " + std::to_string(index) + "." + std::to_string(gi);
    Vertex v = cx.add(dummy);
    dummies.push_back(v);
    for (auto u : groups[gi]) dag.add_edge(u, v, {EdgeKind::Temporal, 0, ""});
    for (auto w : groups[gi + 1]) dag.add_edge(v, w, {EdgeKind::Temporal, 0, ""});
  }
  // Unchecked (not strict): order passes only add nodes and edges, so if the DAG is acyclic once every
  // order has run, it was after each of them; apply_directives checks it then.
  if (!cx.strict || !dag.has_cycle()) return;
  // Slow path, errors only: find the first group (or group boundary) that closes a cycle.
  for (auto v : dummies) boost::clear_vertex(v, dag.graph);
  for (const auto& edges : costart)
    for (auto [u, v] : edges) boost::remove_edge(u, v, dag.graph);
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    add_costart(gi);
    if (dag.has_cycle())
      fail(index, "filters[" + std::to_string(gi) + "]",
           "group " + std::to_string(gi) + " cannot run as one step: one of its nodes depends on another");
    if (gi == 0) continue;
    for (auto u : groups[gi - 1]) dag.add_edge(u, dummies[gi - 1], {EdgeKind::Temporal, 0, ""});
    for (auto w : groups[gi]) dag.add_edge(dummies[gi - 1], w, {EdgeKind::Temporal, 0, ""});
    if (dag.has_cycle())
      fail(index, "filters[" + std::to_string(gi) + "]",
           "order would create a cycle: group " + std::to_string(gi) + " must run after group " + std::to_string(gi - 1) +
               ", but a node of group " + std::to_string(gi - 1) + " depends on it");
  }
  fail(index, "filters", "order would create a cycle");
}

// tensor_parallel: marks the selected segments (routed experts keep EP). Costs are rewritten once all
// tensor_parallel and recompute directives have run (recost_segments); groups are made after place.
void apply_tensor_parallel(PassContext& cx, const TensorParallelDirective& d, int index, std::vector<int>& tp_by) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  for (int s : segments_of(cx, matched)) {
    auto& seg = cx.dag.segments.at(static_cast<std::size_t>(s));
    bool experts = false;
    for (int l = seg.first_layer; l < seg.last_layer; ++l)
      experts = experts || cx.dag.layers.at(static_cast<std::size_t>(l)).kind == LayerKind::MoeExperts;
    if (experts) continue;
    if (tp_by[static_cast<std::size_t>(s)] >= 0)
      fail(index, "filter",
           "segment " + std::to_string(s) + " is already tensor-parallel (directive " +
               std::to_string(tp_by[static_cast<std::size_t>(s)]) + ")");
    tp_by[static_cast<std::size_t>(s)] = index;
    for (int l = seg.first_layer; l < seg.last_layer; ++l) {
      const Layer& layer = cx.dag.layers.at(static_cast<std::size_t>(l));
      const auto& sh = layer.shape;
      auto indivisible = [&](const char* what, std::int64_t v) {
        if (v > 0 && v % d.degree != 0)
          fail(index, "degree",
               fmt::format("{} does not divide the {} {} of layer '{}'", d.degree, v, what, layer.name));
      };
      if (layer.kind == LayerKind::Attention) indivisible("heads", sh.heads);
      if (layer.kind == LayerKind::Mlp) indivisible("ffn columns", sh.ffn);
      // The vocabulary is not checked: Megatron pads it to a multiple of the TP degree.
    }
    if (d.sequence_parallel && cx.dag.training.seq_len % d.degree != 0)
      fail(index, "sequence_parallel",
           fmt::format("{} does not divide the sequence length {}", d.degree, cx.dag.training.seq_len));
    seg.tp_degree = d.degree;
    seg.sequence_parallel = d.sequence_parallel;
    seg.tp_comm_overlap = d.comm_overlap;
  }
}

void apply_recompute(PassContext& cx, const RecomputeDirective& d, int index, std::vector<int>& rc_by) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  for (int s : segments_of(cx, matched)) {
    if (rc_by[static_cast<std::size_t>(s)] >= 0)
      fail(index, "filter",
           "segment " + std::to_string(s) + " already has a recompute mode (directive " +
               std::to_string(rc_by[static_cast<std::size_t>(s)]) + ")");
    rc_by[static_cast<std::size_t>(s)] = index;
    cx.dag.segments.at(static_cast<std::size_t>(s)).recompute = d.mode;
  }
}

// Rewrites the per-device costs of every TP or recomputed segment from its layers (core::layer_costs
// with a ParallelLayout): its compute nodes (F, B, BI, BW as the backward split shares them), its
// stash, and, between two sequence-parallel segments of the same degree, the activations and
// gradients they pass (sliced along the sequence).
void recost_segments(PassContext& cx) {
  auto& dag = cx.dag;
  std::vector<char> changed(dag.segments.size(), 0);
  std::vector<Costs> costs(dag.segments.size());
  for (auto& seg : dag.segments) {
    if (seg.tp_degree == 1 && seg.recompute == Recompute::None) continue;
    const ParallelLayout layout{seg.tp_degree, seg.sequence_parallel, static_cast<int>(seg.recompute)};
    Costs c;
    for (int l = seg.first_layer; l < seg.last_layer; ++l)
      c += layer_costs(dag.layers.at(static_cast<std::size_t>(l)), dag.training, layout);
    seg.tp_local_params = c.params;
    costs[static_cast<std::size_t>(seg.index)] = c;
    changed[static_cast<std::size_t>(seg.index)] = 1;
  }
  Graph& g = cx.g();
  for (auto v : dag.live_nodes()) {
    auto& n = cx.node(v);
    if (n.kind != NodeKind::Compute || !changed[static_cast<std::size_t>(n.segment)]) continue;
    Costs c = costs[static_cast<std::size_t>(n.segment)];
    if (n.pass == Pass::BI) {  // as apply_backward_split divides a B
      c.backward_weight_flops = 0;
      c.backward_weight_gemm_kernels = 0;
      c.backward_memory_bytes /= 2;
    } else if (n.pass == Pass::BW) {
      c.backward_input_flops = 0;
      c.backward_input_gemm_kernels = 0;
      c.backward_memory_bytes -= c.backward_memory_bytes / 2;
      c.backward_elementwise_bytes = 0;
      c.backward_tp_bytes = 0;
      c.backward_tp_collectives = 0;
      c.recompute_flops = 0;
    }
    n.costs = c;
  }
  auto sp_degree = [&](int segment) {
    const auto& sg = dag.segments.at(static_cast<std::size_t>(segment));
    return sg.sequence_parallel ? sg.tp_degree : 1;
  };
  for (auto e : boost::make_iterator_range(boost::edges(g))) {
    Vertex u = boost::source(e, g), v = boost::target(e, g);
    if (g[u].kind != NodeKind::Compute || g[e].kind != EdgeKind::Data) continue;
    if (g[e].tensor == "stash" && changed[static_cast<std::size_t>(g[u].segment)]) {
      g[e].bytes = g[u].costs.activation_bytes;
    } else if ((g[e].tensor == "act" || g[e].tensor == "grad") && g[v].kind == NodeKind::Compute) {
      const int t = sp_degree(g[u].segment);
      if (t > 1 && t == sp_degree(g[v].segment)) g[e].bytes /= t;
    }
  }
}

// After placement: each TP segment's set splits into consecutive groups of its degree (family "tp").
void make_tp_groups(PassContext& cx, const DirectiveProgram& program, const std::vector<int>& tp_by) {
  auto& dag = cx.dag;
  std::vector<DeviceSetId> set_of(dag.segments.size(), kNoDevices);
  for (auto v : dag.live_nodes())
    if (cx.node(v).kind == NodeKind::Compute) set_of[static_cast<std::size_t>(cx.node(v).segment)] = cx.node(v).devices;
  for (auto& seg : dag.segments) {
    const int index = tp_by[static_cast<std::size_t>(seg.index)];
    if (index < 0) continue;
    const auto& d = std::get<TensorParallelDirective>(program.directives[static_cast<std::size_t>(index)]);
    const DeviceSetId set = set_of[static_cast<std::size_t>(seg.index)];
    const auto& devices = dag.device_sets.at(set);
    if (!d.devices.empty() && d.devices != devices)
      fail(index, "devices", set_str(d.devices) + " differ from the placement " + set_str(devices) + " of segment " +
                                 std::to_string(seg.index));
    if (devices.size() % static_cast<std::size_t>(seg.tp_degree) != 0)
      fail(index, "degree",
           fmt::format("{} does not divide the {} devices segment {} is placed on", seg.tp_degree, devices.size(), seg.index));
    seg.tp_family = dag.family_index({set, seg.tp_degree, 1, FamilyPurpose::Tp});
  }
}

// Invariants checked after every pass (acyclicity: when strict; see apply_directives).
void verify_dag(PassContext& cx, const std::string& after, bool placed) {
  if (cx.strict && cx.dag.has_cycle()) throw InternalError("the DAG has a cycle after " + after);
  if (!placed) return;
  for (auto v : cx.dag.live_nodes()) {
    const auto& n = cx.node(v);
    if (n.devices == kNoDevices && n.kind != NodeKind::Update)
      throw InternalError("'" + n.label + "' has no devices after " + after);
    if (n.family >= 0 && cx.dag.families.at(static_cast<std::size_t>(n.family)).devices != n.devices)
      throw InternalError("'" + n.label + "' runs outside its communicator family after " + after);
  }
}

// Thrown by an unchecked run that finds a cycle at the end of a phase (apply_directives reruns strictly).
struct CycleInPhase {};

void apply_directives_in_place(GlobalDag& dag, const DirectiveProgram& program, const AfterPassHook& hook,
                               bool strict) {
  PassContext cx{dag, std::vector<std::string>(boost::num_vertices(dag.graph)), {},
                 std::vector<bool>(dag.segments.size(), false), strict, {}};
  auto after = [&](const std::string& op, int index, bool placed) {
    verify_dag(cx, op + (index >= 0 ? " (directive " + std::to_string(index) + ")" : ""), placed);
    if (hook) hook(op, index, dag);
  };
  auto phase_done = [&] {
    if (!strict && dag.has_cycle()) throw CycleInPhase{};
  };
  const auto& ds = program.directives;
  auto each = [&](auto tag, auto&& fn) {
    using T = typename decltype(tag)::type;
    for (std::size_t i = 0; i < ds.size(); ++i)
      if (const auto* d = std::get_if<T>(&ds[i])) fn(*d, static_cast<int>(i));
  };
  each(std::type_identity<SplitDirective>{}, [&](const SplitDirective& d, int i) { apply_split(cx, d, i), after("split", i, false); });

  std::vector<Filter> wants_split;
  each(std::type_identity<OrderDirective>{}, [&](const OrderDirective& d, int) {
    for (const auto& grp : d.groups)
      for (const auto& f : grp)
        if (f.pass == Pass::BI || f.pass == Pass::BW) wants_split.push_back(f);
  });
  if (!wants_split.empty()) apply_backward_split(cx, wants_split), after("backward-split", -1, false);

  // Each place directive is dumped after it runs; the last one also completes the placement
  // (unplaced check, UPD per device set, SEND/RECV between device sets).
  // Tensor parallelism and recomputation change per-device costs before placement creates the
  // transfers (whose sizes they change); their groups are formed once the placement is known.
  std::vector<int> tp_by(dag.segments.size(), -1), rc_by(dag.segments.size(), -1);
  bool any_layout = false;
  each(std::type_identity<TensorParallelDirective>{}, [&](const TensorParallelDirective& d, int i) {
    apply_tensor_parallel(cx, d, i, tp_by), any_layout = true;
  });
  each(std::type_identity<RecomputeDirective>{}, [&](const RecomputeDirective& d, int i) {
    apply_recompute(cx, d, i, rc_by), any_layout = true;
  });
  if (any_layout) recost_segments(cx), after("tensor-parallel", -1, false);
  phase_done();

  std::vector<int> placed_by, places;
  each(std::type_identity<PlaceDirective>{}, [&](const PlaceDirective&, int i) { places.push_back(i); });
  for (int i : places) {
    apply_place(cx, std::get<PlaceDirective>(ds[static_cast<std::size_t>(i)]), i, placed_by);
    if (i != places.back()) after("place", i, false);
  }
  finish_placement(cx, !places.empty());
  make_tp_groups(cx, program, tp_by);
  after("place", places.empty() ? -1 : places.back(), true);
  phase_done();

  each(std::type_identity<ShardDirective>{}, [&](const ShardDirective& d, int i) { apply_shard(cx, d, i), after("shard", i, true); });
  each(std::type_identity<ReplicateDirective>{}, [&](const ReplicateDirective& d, int i) { apply_replicate(cx, d, i), after("replicate", i, true); });
  link_tied_embedding(cx);
  phase_done();
  cost_updates(cx);
  each(std::type_identity<OrderDirective>{}, [&](const OrderDirective& d, int i) { apply_order(cx, d, i), after("order", i, true); });
  each(std::type_identity<SmPartitionDirective>{}, [&](const SmPartitionDirective& d, int) { dag.sm_partition = d.partition; });
  phase_done();
}

}  // namespace

void apply_directives(GlobalDag& dag, const DirectiveProgram& program, const AfterPassHook& hook) {
  // All-or-nothing: the caller's DAG changes only on success. The passes work on the caller's DAG and a
  // failure restores it from a backup, rather than working on a copy and moving it back: Boost 1.74's
  // adjacency_list has no move constructor (a "move" copies the graph), and the DAG before the
  // directives (no microbatch split yet) is far smaller than after them.
  const GlobalDag backup = dag;
  auto run_strictly = [&] {
    try {
      apply_directives_in_place(dag, program, hook, true);
    } catch (...) {
      dag = backup;
      throw;
    }
  };
  // A hook (--dump-after) watches every pass, so it always gets the strict run, as before.
  if (hook) return run_strictly();
  // The cycle check after every pass cost a quarter of compile time on a 1,024-GPU program (41 checks
  // of a DAG of up to 12,000 nodes and 50,000 edges), so a run without a hook checks once per phase
  // (up to placement, placement, shard + replicate, order). No pass removes a node or an edge
  // without rerouting the paths through it (copies, subdivided edges, merged sink updates), so a
  // cycle made by a pass lasts to the end of its phase; and orders only add nodes and edges, so an
  // acyclic DAG after the last order was acyclic after each. Any failure of this run (a cycle at a
  // phase end, or a later pass's error reached because an earlier cycle went unnoticed) is therefore
  // a failure of the strict run too: rerun strictly, which reports exactly the error it always did.
  try {
    apply_directives_in_place(dag, program, hook, false);
  } catch (...) {
    dag = backup;
    run_strictly();
    throw InternalError("the directive passes failed once and then succeeded");  // unreachable, see above
  }
}

}  // namespace piper::core
