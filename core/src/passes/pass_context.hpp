// The working state the directive passes share (internal to piper_core; see pass.hpp for the
// pass interface): the DAG being rewritten with its per-vertex bookkeeping, an index of the compute
// nodes by tag, and the small helpers several passes use.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "piper/core/dag.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"

namespace piper::core::passes {

// Every error of a pass names its directive and field.
[[noreturn]] inline void fail(int index, const std::string& field, const std::string& message) {
  throw DirectiveError(index, field, message);
}

// "[0,1,2]", cut after 8 devices.
std::string set_str(const std::vector<int>& s);

// The live compute nodes by tag value. Filters select compute nodes only; once the (backward) splits
// are done no pass adds, removes or retags one, yet every directive runs a filter and each order
// directive one per step (8 stages, 40 microbatches, an F and a B each: 8 directives x 80 steps), and
// scanning the whole DAG for each filter dominated compile time. candidates() holds every node the
// filter can select (those carrying all its exact tag values), ascending, so match() returns exactly
// what a scan of all vertices in index order returns. Filters of several exact tags (an order step's
// {PP, mb}) look up an index of that set of tags, built on its first use: picking the rarest tag's
// list instead left every step of a deep pipeline matching a whole region's or microbatch's nodes.
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
    if (f.exact.empty()) return compute_;
    if (f.exact.size() == 1) {
      const std::vector<Vertex>* list = find(f.exact.begin()->first, f.exact.begin()->second);
      return list ? *list : none;
    }
    std::vector<std::string> names;
    std::vector<int> values;
    for (const auto& [tag, value] : f.exact) names.push_back(tag), values.push_back(value);
    auto [index, fresh] = by_tags_.try_emplace(names);
    if (fresh)
      for (auto v : compute_) {
        std::vector<int> key;
        for (const auto& name : names) {
          auto it = g_[v].tags.find(name);
          if (it == g_[v].tags.end()) break;
          key.push_back(it->second);
        }
        if (key.size() == names.size()) index->second[key].push_back(v);
      }
    auto it = index->second.find(values);
    return it == index->second.end() ? none : it->second;
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
  // tag names (ascending) -> their values -> nodes carrying exactly those values; filled by candidates()
  mutable std::map<std::vector<std::string>, std::map<std::vector<int>, std::vector<Vertex>>> by_tags_;
};

// Working state of one apply_directives call.
struct PassContext {
  GlobalDag& dag;
  std::vector<std::string> p2p_stream;  // per vertex: stream of its region's point-to-point transfers
  std::vector<char> p2p_blocking;       // per vertex: its region's transfers are blocking (place "blocking")
  std::vector<std::string> split_dims;  // dims created by split, outermost first
  std::vector<bool> replicated;         // per segment
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
    Vertex v = dag.add_node(n);
    if (p2p_stream.size() <= v) p2p_stream.resize(v + 1);
    if (p2p_blocking.size() <= v) p2p_blocking.resize(v + 1, 0);
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

std::vector<EdgeRec> out_edges_of(const Graph& g, Vertex u);
std::vector<EdgeRec> in_edges_of(const Graph& g, Vertex v);

inline bool is_backward(Pass p) { return p == Pass::B || p == Pass::BI || p == Pass::BW; }

// Matched nodes must sit on exactly the directive's devices (in order).
void check_devices(PassContext& cx, const std::vector<Vertex>& matched, const std::vector<int>& devices, int index);
// The segments of these nodes, ascending.
std::vector<int> segments_of(PassContext& cx, const std::vector<Vertex>& nodes);
// " PP0 s2-5": the tags the segments share and their range, for labels.
std::string common_tags_label(const GlobalDag& dag, const std::vector<int>& segments);

}  // namespace piper::core::passes
