// The split pass: one split directive copies its region once per microbatch (tag dim_name).
#include "pass.hpp"

#include <algorithm>
#include <deque>

#include "piper/core/limits.hpp"

namespace piper::core::passes {

namespace {

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
    fail(index, "num_microbatches",
         "with the splits before it, " + limit_message(Limit::Microbatches, microbatches, "microbatches"));
  const std::int64_t nodes =
      static_cast<std::int64_t>(boost::num_vertices(cx.g())) + static_cast<std::int64_t>(matched.size()) * d.count;
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
    for (const auto& r : inside_or_out) cx.dag.add_edge(copy[k][pos[r.u]], in[r.v] ? copy[k][pos[r.v]] : r.v, r.e);
    for (const auto& r : from_outside) cx.dag.add_edge(r.u, copy[k][pos[r.v]], r.e);
  }
  for (auto v : matched) cx.remove(v);
  cx.dag.microbatches *= d.count;
  cx.dag.splits.push_back({d.dim_name, d.count});
}

}  // namespace

void run_split(PassRun& run, const SplitDirective& d, int index) { apply_split(run.cx, d, index); }

}  // namespace piper::core::passes
