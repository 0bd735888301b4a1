// The verifier's happens-before checks (verifier_impl.hpp): buffer lifetimes by vector clocks within
// a plan, and deadlock freedom by a cycle search over the class-level wait graph.
#include <algorithm>
#include <boost/graph/adjacency_list.hpp>
#include <boost/graph/depth_first_search.hpp>
#include <boost/graph/topological_sort.hpp>
#include <map>
#include <set>
#include <unordered_set>
#include <vector>

#include "piper/core/error.hpp"
#include "verifier_impl.hpp"

namespace piper::core::verifier_detail {

namespace {

using DiGraph = boost::adjacency_list<boost::vecS, boost::vecS, boost::directedS>;

// A back edge found by depth-first search closes a cycle; tree edges give the path back along it.
struct CycleFound {
  std::size_t from, to;
};
struct CycleVisitor : boost::default_dfs_visitor {
  std::vector<std::size_t>* parent;
  template <class Edge, class G>
  void tree_edge(Edge e, const G& g) const {
    (*parent)[boost::target(e, g)] = boost::source(e, g);
  }
  template <class Edge, class G>
  void back_edge(Edge e, const G& g) const {
    throw CycleFound{boost::source(e, g), boost::target(e, g)};
  }
};

}  // namespace

void Verifier::check_buffers(int p) {
  const Plan& plan = prog_.plans[ix(p)];
  if (plan.buffers.empty()) return;
  const std::size_t num_streams = plan.streams.size();
  const std::size_t base = ix(stream_base_[ix(p)].empty() ? 0 : stream_base_[ix(p)][0]);
  const std::size_t n = static_cast<std::size_t>(plan.op_count());
  DiGraph g(n);
  auto local = [&](OpRef r) { return vertex(p, r) - base; };
  for (std::size_t s = 0; s < num_streams; ++s)
    for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
      OpRef me{static_cast<int>(s), static_cast<int>(i)};
      if (i > 0) boost::add_edge(local({me.stream, me.index - 1}), local(me), g);
      for (const OpRef& w : plan.streams[s].ops[i].waits) boost::add_edge(local(w), local(me), g);
    }
  std::vector<std::size_t> order;
  try {
    boost::topological_sort(g, std::back_inserter(order));
  } catch (const boost::not_a_dag&) {
    return;  // an intra-device wait cycle: reported by the deadlock check
  }
  // clock[v * S + s]: highest op index of stream s known to have finished before v starts.
  std::vector<int> clock(n * num_streams, -1);
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const Loc& me = loc_[*it + base];
    int* c = &clock[*it * num_streams];
    auto absorb = [&](OpRef pred) {
      const int* pc = &clock[local(pred) * num_streams];
      for (std::size_t s = 0; s < num_streams; ++s) c[s] = std::max(c[s], pc[s]);
      c[pred.stream] = std::max(c[pred.stream], pred.index);
    };
    if (me.index > 0) absorb({me.stream, me.index - 1});
    for (const OpRef& w : op_at(p, {me.stream, me.index}).waits) absorb(w);
  }
  auto before_or_equal = [&](OpRef a, OpRef b) {
    return a == b || clock[local(b) * num_streams + ix(a.stream)] >= a.index;
  };

  std::vector<std::vector<OpRef>> users(plan.buffers.size());
  for (std::size_t s = 0; s < num_streams; ++s)
    for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i)
      for (int u : plan.streams[s].ops[i].uses) users[ix(u)].push_back({static_cast<int>(s), static_cast<int>(i)});
  for (std::size_t b = 0; b < plan.buffers.size(); ++b) {
    const Buffer& buf = plan.buffers[b];
    auto head = [&] { return where(p) + " buffer '" + buf.name + "'"; };  // for messages only
    bool has_alloc = buf.alloc.stream >= 0, has_free = buf.free.stream >= 0;
    if (!has_alloc && !has_free) continue;  // persistent
    if (!has_free) {
      add("buffer", head() + " is never freed");
      continue;
    }
    if (!has_alloc) {
      add("buffer", head() + " is freed but never allocated");
      continue;
    }
    if (!before_or_equal(buf.alloc, buf.free)) {
      add("buffer",
          head() + " may be freed by " + op_name(p, buf.free) + " before its alloc at " + op_name(p, buf.alloc));
      continue;
    }
    for (const OpRef& u : users[b]) {
      if (!before_or_equal(buf.alloc, u))
        add("buffer", head() + " is used by " + op_name(p, u) + " before (or concurrently with) its alloc at " +
                          op_name(p, buf.alloc));
      if (!before_or_equal(u, buf.free))
        add("buffer", head() + " is used by " + op_name(p, u) + " after (or concurrently with) its free at " +
                          op_name(p, buf.free));
    }
  }
}

void Verifier::check_deadlock() {
  // Vertices: one per (plan, op), then one per rendezvous: a transfer (SEND op, RECV op) or a
  // collective instance (its members' ops). A rendezvous op reaches its rendezvous vertex, and
  // whatever waits for the op waits for its rendezvous vertices (all of them: for different
  // devices of the plan the op may meet different peer plans). Keeping one vertex per pair or
  // instance, rather than merging every op that ever meets into one, is what keeps a device that
  // both sends and receives one DAG edge (mirrored placements) from looking like a self-wait.
  std::sort(transfer_edges_.begin(), transfer_edges_.end());
  transfer_edges_.erase(std::unique(transfer_edges_.begin(), transfer_edges_.end()), transfer_edges_.end());
  std::vector<std::vector<std::size_t>> rendezvous;
  for (auto [u, v] : transfer_edges_) rendezvous.push_back({u, v});
  for (auto& members : collective_instances_) rendezvous.push_back(members);
  const std::size_t num_ops = loc_.size();
  std::vector<std::vector<std::size_t>> completion(num_ops);
  for (std::size_t j = 0; j < rendezvous.size(); ++j)
    for (std::size_t m : rendezvous[j])
      if (std::find(completion[m].begin(), completion[m].end(), num_ops + j) == completion[m].end())
        completion[m].push_back(num_ops + j);
  DiGraph g(num_ops + rendezvous.size());
  auto after = [&](std::size_t u, std::size_t v) {  // v starts after u completes
    if (completion[u].empty()) boost::add_edge(u, v, g);
    for (std::size_t c : completion[u]) boost::add_edge(c, v, g);
  };
  for (std::size_t p = 0; p < prog_.plans.size(); ++p) {
    const Plan& plan = prog_.plans[p];
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        OpRef me{static_cast<int>(s), static_cast<int>(i)};
        std::size_t v = vertex(static_cast<int>(p), me);
        if (i > 0) after(v - 1, v);
        for (const OpRef& w : plan.streams[s].ops[i].waits) after(vertex(static_cast<int>(p), w), v);
        for (std::size_t c : completion[v]) boost::add_edge(v, c, g);
      }
  }

  std::vector<std::size_t> parent(num_ops + rendezvous.size());
  CycleVisitor visitor;
  visitor.parent = &parent;
  try {
    boost::depth_first_search(g, boost::visitor(visitor));
  } catch (const CycleFound& c) {
    // The back edge from -> to closes the cycle to -> ... -> from -> to; print it as "waits on".
    std::vector<std::size_t> cycle{c.to, c.from};
    while (cycle.back() != c.to) cycle.push_back(parent[cycle.back()]);
    std::size_t length = 0;
    for (std::size_t k = 0; k + 1 < cycle.size(); ++k) length += cycle[k] < num_ops ? 1 : 0;
    auto op_text = [&](std::size_t v) {
      const Loc& l = loc_[v];
      return where(l.plan) + " " + op_name(l.plan, {l.stream, l.index});
    };
    // A rendezvous names every device taking part, not just one side.
    auto name = [&](std::size_t v) {
      if (v < num_ops) return op_text(v);
      const auto& members = rendezvous[v - num_ops];
      std::string text = "the rendezvous of";
      constexpr std::size_t kMembers = 8;
      for (std::size_t k = 0; k < members.size() && k < kMembers; ++k) text += (k ? ", " : " ") + op_text(members[k]);
      if (members.size() > kMembers) text += ", ...";
      return text;
    };
    // Runs of stream order (an op waiting on its predecessor, directly or through the
    // predecessor's rendezvous) print as one entry: the waits and the rendezvous between devices
    // are what close the cycle, and the fault is among them.
    auto same_run = [&](std::size_t a, std::size_t b) {  // b is a's stream predecessor
      return a < num_ops && b < num_ops && loc_[a].plan == loc_[b].plan && loc_[a].stream == loc_[b].stream &&
             loc_[b].index + 1 == loc_[a].index;
    };
    constexpr std::size_t kShown = 16;
    std::string message;
    std::size_t shown = 0, k = 0;
    while (k + 1 < cycle.size() && shown < kShown) {
      std::size_t end = k;
      const std::size_t last = cycle.size() - 1;  // cycle[last] repeats cycle[0]
      while (end < last && cycle[end] < num_ops) {
        if (end + 1 < last && same_run(cycle[end], cycle[end + 1])) {
          ++end;
        } else if (end + 2 < last && cycle[end + 1] >= num_ops && same_run(cycle[end], cycle[end + 2])) {
          end += 2;  // the predecessor is a rendezvous op: x waits on its rendezvous, which waits on it
        } else {
          break;
        }
      }
      if (!message.empty()) message += " waits on ";
      message += name(cycle[k]);
      if (end > k)
        message += " after its stream predecessors back to op " + std::to_string(loc_[cycle[end]].index) + " '" +
                   op_at(loc_[cycle[end]].plan, {loc_[cycle[end]].stream, loc_[cycle[end]].index}).label + "'";
      k = end + 1;
      ++shown;
    }
    if (k + 1 < cycle.size()) message += " waits on ...";
    message += " (cycle of " + std::to_string(length) + " op" + (length == 1 ? "" : "s") + ")";
    add("deadlock", message);
  }
}

}  // namespace piper::core::verifier_detail
