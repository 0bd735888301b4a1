// The global training DAG: node/edge vocabulary, segmentation of a model, the initial F/B/UPD graph,
// and the DAG's own queries (cycle check with BGL, counts, JSON and Graphviz dumps).
#include "piper/core/dag.hpp"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include <boost/graph/depth_first_search.hpp>
#include <nlohmann/json.hpp>

namespace piper::core {

std::string to_string(NodeKind k) {
  switch (k) {
    case NodeKind::Compute:
      return "COMPUTE";
    case NodeKind::Update:
      return "UPD";
    case NodeKind::Send:
      return "SEND";
    case NodeKind::Recv:
      return "RECV";
    case NodeKind::AllReduce:
      return "ALL_REDUCE";
    case NodeKind::ReduceScatter:
      return "REDUCE_SCATTER";
    case NodeKind::AllGather:
      return "ALL_GATHER";
    case NodeKind::AllToAll:
      return "ALL_TO_ALL";
    case NodeKind::OrderDummy:
      return "ORDER_DUMMY";
  }
  return "?";
}

std::string to_string(Pass p) {
  switch (p) {
    case Pass::None:
      return "";
    case Pass::F:
      return "F";
    case Pass::B:
      return "B";
    case Pass::BI:
      return "BI";
    case Pass::BW:
      return "BW";
  }
  return "?";
}

Pass pass_from_string(const std::string& s) {
  if (s == "F") return Pass::F;
  if (s == "B") return Pass::B;
  if (s == "BI") return Pass::BI;
  if (s == "BW") return Pass::BW;
  if (s.empty()) return Pass::None;
  throw std::invalid_argument("unknown pass '" + s + "' (expected F, B, BI or BW)");
}

std::string to_string(Recompute r) {
  switch (r) {
    case Recompute::None:
      return "none";
    case Recompute::Selective:
      return "selective";
    case Recompute::Full:
      return "full";
    case Recompute::Op:
      return "op";
  }
  return "?";
}

Recompute recompute_from_string(const std::string& s) {
  if (s == "none") return Recompute::None;
  if (s == "selective") return Recompute::Selective;
  if (s == "full") return Recompute::Full;
  if (s == "op") return Recompute::Op;
  throw std::invalid_argument("unknown recompute mode '" + s + "' (expected none, selective, full or op)");
}

bool is_collective(NodeKind k) {
  return k == NodeKind::AllReduce || k == NodeKind::ReduceScatter || k == NodeKind::AllGather ||
         k == NodeKind::AllToAll;
}

bool is_communication(NodeKind k) { return is_collective(k) || k == NodeKind::Send || k == NodeKind::Recv; }

std::string node_kind_name(const DagNode& n) {
  return n.kind == NodeKind::Compute ? to_string(n.pass) : to_string(n.kind);
}

DeviceSetId DeviceSetTable::intern(const std::vector<int>& devices) {
  std::string key;
  key.reserve(devices.size() * 6);
  for (int d : devices) key += std::to_string(d) + ',';
  auto [it, inserted] = index_.try_emplace(key, static_cast<DeviceSetId>(sets_.size()));
  if (inserted) sets_.push_back(devices);
  return it->second;
}

int GlobalDag::family_index(const CommFamily& f) {
  for (std::size_t i = 0; i < families.size(); ++i)
    if (families[i] == f) return static_cast<int>(i);
  families.push_back(f);
  return static_cast<int>(families.size() - 1);
}

std::vector<Vertex> GlobalDag::live_nodes() const {
  std::vector<Vertex> out;
  out.reserve(boost::num_vertices(graph));
  for (auto v : boost::make_iterator_range(boost::vertices(graph)))
    if (!graph[v].removed) out.push_back(v);
  return out;
}

std::size_t GlobalDag::live_node_count() const {
  std::size_t n = 0;
  for (auto v : boost::make_iterator_range(boost::vertices(graph))) n += graph[v].removed ? 0 : 1;
  return n;
}

int GlobalDag::num_devices() const {
  int top = -1;
  for (const auto& s : device_sets.all())
    for (int d : s) top = std::max(top, d);
  return top + 1;
}

std::map<std::string, std::int64_t> GlobalDag::counts_by_kind() const {
  std::map<std::string, std::int64_t> counts;
  for (auto v : live_nodes()) ++counts[node_kind_name(graph[v])];
  return counts;
}

namespace {
struct CycleFound {};
struct BackEdgeVisitor : boost::default_dfs_visitor {
  template <class E, class G>
  void back_edge(E, const G&) const {
    throw CycleFound{};
  }
};
}  // namespace

bool GlobalDag::has_cycle() const {
  // Removed nodes have no edges, so they cannot take part in a cycle.
  try {
    boost::depth_first_search(graph, boost::visitor(BackEdgeVisitor{}));
  } catch (const CycleFound&) {
    return true;
  }
  return false;
}

static nlohmann::json tags_json(const TagMap& tags) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : tags) j[k] = v;
  return j;
}

nlohmann::json GlobalDag::to_json() const {
  nlohmann::json nodes = nlohmann::json::array();
  for (auto v : live_nodes()) {
    const auto& n = graph[v];
    nlohmann::json jn = {{"id", v},
                         {"kind", node_kind_name(n)},
                         {"label", n.label},
                         {"tags", tags_json(n.tags)},
                         {"stream", n.stream},
                         {"segment", n.segment}};
    if (n.devices != kNoDevices) jn["devices"] = device_sets.at(n.devices);
    if (n.peer_devices != kNoDevices) jn["peer_devices"] = device_sets.at(n.peer_devices);
    if (n.kind == NodeKind::Compute) {
      jn["flops"] = n.pass == Pass::F    ? n.costs.forward_flops
                    : n.pass == Pass::BI ? n.costs.backward_input_flops
                    : n.pass == Pass::BW ? n.costs.backward_weight_flops
                                         : n.costs.backward_flops();
      jn["activation_bytes"] = n.costs.activation_bytes;
    }
    if (n.bytes) jn["bytes"] = n.bytes;
    if (n.family >= 0) jn["family"] = n.family;
    nodes.push_back(std::move(jn));
  }
  nlohmann::json edges = nlohmann::json::array();
  for (auto e : boost::make_iterator_range(boost::edges(graph))) {
    const auto& pe = graph[e];
    edges.push_back({{"from", boost::source(e, graph)},
                     {"to", boost::target(e, graph)},
                     {"kind", pe.kind == EdgeKind::Data ? "data" : "temporal"},
                     {"tensor", pe.tensor},
                     {"bytes", pe.bytes}});
  }
  nlohmann::json fams = nlohmann::json::array();
  for (const auto& f : families)
    fams.push_back({{"devices", device_sets.at(f.devices)},
                    {"group_size", f.group_size},
                    {"stride", f.stride},
                    {"purpose", to_string(f.purpose)}});
  return {
      {"model", model_name}, {"microbatches", microbatches}, {"nodes", nodes}, {"edges", edges}, {"families", fams}};
}

std::string GlobalDag::to_dot() const {
  std::ostringstream os;
  os << "digraph piper {\n  rankdir=LR;\n  node [shape=box, fontname=\"monospace\"];\n";
  for (auto v : live_nodes()) {
    const auto& n = graph[v];
    const char* color = n.kind == NodeKind::Compute      ? (n.pass == Pass::F ? "lightblue" : "lightsalmon")
                        : n.kind == NodeKind::Update     ? "palegreen"
                        : n.kind == NodeKind::OrderDummy ? "white"
                                                         : "khaki";
    os << "  n" << v << " [label=\"" << n.label;
    if (n.devices != kNoDevices) {
      os << "\\ndev [";
      const auto& s = device_sets.at(n.devices);
      for (std::size_t i = 0; i < s.size() && i < 8; ++i) os << (i ? "," : "") << s[i];
      if (s.size() > 8) os << ",…";
      os << "]";
    }
    os << "\", style=filled, fillcolor=" << color << "];\n";
  }
  for (auto e : boost::make_iterator_range(boost::edges(graph))) {
    os << "  n" << boost::source(e, graph) << " -> n" << boost::target(e, graph);
    if (graph[e].kind == EdgeKind::Temporal) os << " [style=dashed]";
    os << ";\n";
  }
  os << "}\n";
  return os.str();
}

std::vector<Segment> segment_model(const Model& model) {
  std::vector<Segment> segments;
  const auto& layers = model.layers();
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const Costs c = model.layer_cost(i);
    if (segments.empty() || segments.back().tags != layers[i].tags) {
      Segment s;
      s.index = static_cast<int>(segments.size());
      s.first_layer = static_cast<int>(i);
      s.tags = layers[i].tags;
      if (layers[i].kind == LayerKind::MoeExperts) {
        s.fanout = static_cast<int>(std::max<std::int64_t>(1, layers[i].shape.top_k));
        s.routing_groups = static_cast<int>(layers[i].shape.routing_groups);
        s.routing_group_limit = static_cast<int>(layers[i].shape.routing_group_limit);
      }
      segments.push_back(std::move(s));
    }
    auto& s = segments.back();
    s.last_layer = static_cast<int>(i) + 1;
    s.costs += c;
    s.costs.output_bytes = c.output_bytes;  // the segment's output is its last layer's
    if (layers[i].kind == LayerKind::Head) s.has_loss = true;
  }
  // A tied head in another segment than the embedding keeps a copy of the table (one embedding and
  // one head; a model listing two is not costed).
  int embed = -1, head = -1, embeds = 0, heads = 0;
  std::int64_t table = 0, vocab = 0;
  for (const auto& s : segments)
    for (int l = s.first_layer; l < s.last_layer; ++l) {
      const Layer& layer = layers[static_cast<std::size_t>(l)];
      if (layer.kind == LayerKind::Embedding) embed = s.index, ++embeds;
      if (layer.kind == LayerKind::Head && layer.shape.tied_with_embedding)
        head = s.index, ++heads, table = layer.shape.vocab * layer.shape.hidden, vocab = layer.shape.vocab;
    }
  if (embeds == 1 && heads == 1 && embed != head) {
    segments[static_cast<std::size_t>(head)].tied_copy = table;
    segments[static_cast<std::size_t>(head)].tied_vocab = vocab;
    segments[static_cast<std::size_t>(head)].tied_to = embed;
  }
  return segments;
}

std::string tags_label(const TagMap& tags) {
  std::string out;
  // Microbatch first ("F mb3 PP2"), then the other tags in name order.
  if (auto it = tags.find("MB"); it != tags.end()) out += " mb" + std::to_string(it->second);
  for (const auto& [k, v] : tags)
    if (k != "MB") out += " " + k + std::to_string(v);
  return out;
}

std::string node_label(const DagNode& n) {
  return node_kind_name(n) + tags_label(n.tags) + (n.segment >= 0 ? " s" + std::to_string(n.segment) : "");
}

GlobalDag build_dag(const Model& model) {
  GlobalDag dag;
  dag.model_name = model.name();
  dag.training = model.training();
  dag.layers = model.layers();
  dag.segments = segment_model(model);
  const int n = static_cast<int>(dag.segments.size());
  std::vector<Vertex> f(n), b(n);
  for (int i = 0; i < n; ++i) {
    const auto& s = dag.segments[i];
    DagNode node;
    node.kind = NodeKind::Compute;
    node.pass = Pass::F;
    node.tags = s.tags;
    node.segment = i;
    node.first_layer = s.first_layer;
    node.last_layer = s.last_layer;
    node.costs = s.costs;
    node.label = node_label(node);
    f[i] = dag.add_node(node);
  }
  for (int i = n - 1; i >= 0; --i) {
    DagNode node = dag.graph[f[i]];
    node.pass = Pass::B;
    node.label = node_label(node);
    b[i] = dag.add_node(node);
  }
  for (int i = 0; i < n; ++i) {
    const auto& s = dag.segments[i];
    if (i + 1 < n) {
      dag.add_edge(f[i], f[i + 1], {EdgeKind::Data, s.costs.output_bytes, "act"});
      // Gradient w.r.t. segment i's output has the output's size.
      dag.add_edge(b[i + 1], b[i], {EdgeKind::Data, s.costs.output_bytes, "grad"});
    }
    // The stash: activations kept from F for B. For the last segment this is also the loss turn.
    dag.add_edge(f[i], b[i], {EdgeKind::Data, s.costs.activation_bytes, "stash"});
    if (s.has_state()) {
      DagNode upd;
      upd.kind = NodeKind::Update;
      upd.tags = s.tags;
      upd.segment = i;
      upd.buffer_segments = {i};
      upd.label = "UPD" + tags_label(s.tags) + " s" + std::to_string(i);
      auto u = dag.add_node(upd);
      dag.add_edge(b[i], u, {EdgeKind::Data, s.costs.param_bytes, "grad"});
    }
  }
  return dag;
}

}  // namespace piper::core
