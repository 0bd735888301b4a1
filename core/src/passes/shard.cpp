// The shard pass: expert parallelism of the selected segments (all-to-all dispatch and combine).
#include "pass.hpp"

#include <map>
#include <vector>

#include <fmt/format.h>

namespace piper::core::passes {

namespace {

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
  c.gemm_weight_params /= degree;
  c.forward_memory_bytes /= degree;
  c.backward_memory_bytes /= degree;
}

// Chunk i of n of a quantity of x units: the first x mod n chunks take one more.
std::int64_t part(std::int64_t x, int i, int n) { return x / n + (i < x % n ? 1 : 0); }

// Costs of chunk i of n of an expert node: 1/n of the tokens' work, traffic and tensors. The GEMM
// kernel and collective counts stay (each chunk launches its own); parameters are the segment's.
Costs chunk_costs(Costs c, int i, int n) {
  const double f = 1.0 / n;
  c.forward_flops *= f;
  c.backward_input_flops *= f;
  c.backward_weight_flops *= f;
  c.recompute_flops *= f;
  for (std::int64_t* x : {&c.activation_bytes, &c.output_bytes, &c.forward_memory_bytes, &c.backward_memory_bytes,
                          &c.forward_elementwise_bytes, &c.backward_elementwise_bytes, &c.forward_tp_bytes,
                          &c.backward_tp_bytes, &c.forward_cp_bytes, &c.backward_cp_bytes})
    *x = part(*x, i, n);
  return c;
}

// ShardDirective::chunks: every matched node that meets an all-to-all (F, B or BI; not BW, which
// only reads the stash and BI's gradient) becomes n nodes of 1/n of the tokens. Each chunk keeps the
// node's edges with 1/n of their bytes (an edge between two chunked nodes joins chunk i to chunk i;
// gradients to the update stay whole), so the crossing edges that get all-to-alls below are per chunk,
// and chunk i's experts can run while chunk i+1 is dispatched. Returns the matched nodes with the copies.
std::vector<Vertex> chunk_nodes(PassContext& cx, const std::vector<Vertex>& matched, int n) {
  Graph& g = cx.g();
  std::vector<char> in(boost::num_vertices(g), 0);
  for (auto v : matched) in[v] = 1;
  auto crossing = [&](Vertex other, const DagEdge& e) {
    return !in[other] && e.kind == EdgeKind::Data && cx.node(other).kind != NodeKind::Update;
  };
  std::map<Vertex, std::vector<Vertex>> copies;
  for (auto v : matched) {
    bool meets = false;
    for (const auto& r : in_edges_of(g, v)) meets = meets || crossing(r.u, r.e);
    for (const auto& r : out_edges_of(g, v)) meets = meets || crossing(r.v, r.e);
    if (meets) copies[v] = {v};
  }
  std::vector<EdgeRec> edges;  // every edge of a chunked node, once
  for (const auto& [v, list] : copies) {
    for (auto& r : out_edges_of(g, v)) edges.push_back(std::move(r));
    for (auto& r : in_edges_of(g, v))
      if (!copies.contains(r.u)) edges.push_back(std::move(r));
  }
  for (const auto& r : edges) boost::remove_edge(r.u, r.v, g);
  std::vector<Vertex> out = matched;
  for (auto& [v, list] : copies) {
    const DagNode base = cx.node(v);
    for (int i = 0; i < n; ++i) {
      DagNode c = base;
      c.costs = chunk_costs(base.costs, i, n);
      c.label = base.label + fmt::format(" chunk {}/{}", i + 1, n);
      if (i == 0) {
        cx.node(v) = std::move(c);
      } else {
        list.push_back(cx.add(std::move(c)));
        out.push_back(list.back());
      }
    }
  }
  for (const auto& r : edges) {
    const auto cu = copies.find(r.u), cv = copies.find(r.v);
    for (int i = 0; i < n; ++i) {
      const Vertex u = cu != copies.end() ? cu->second[static_cast<std::size_t>(i)] : r.u;
      const Vertex v = cv != copies.end() ? cv->second[static_cast<std::size_t>(i)] : r.v;
      DagEdge e = r.e;
      if (e.kind == EdgeKind::Data && cx.node(u).kind != NodeKind::Update && cx.node(v).kind != NodeKind::Update)
        e.bytes = part(e.bytes, i, n);
      cx.dag.add_edge(u, v, e);
    }
  }
  return out;
}

void apply_shard(PassContext& cx, const ShardDirective& d, int index) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  check_devices(cx, matched, d.devices, index);
  const int degree = d.degree > 0 ? d.degree : static_cast<int>(d.devices.size());
  // Routed experts split by expert TP (tp_degree e, consecutive ETP groups): a device's position i in
  // the set is ETP rank i mod e, EP rank (i / e) mod degree, expert-data-parallel rank i / (e degree),
  // as Megatron-core orders expert ranks (tp-ep-dp). The EP groups (same ETP rank, consecutive
  // EP ranks) are then strided by e inside blocks of e·degree devices.
  int etp = 0;
  for (int s : segments_of(cx, matched)) {
    auto& seg = cx.dag.segments.at(static_cast<std::size_t>(s));
    if (seg.shard_degree != 1) fail(index, "filter", "segment " + std::to_string(s) + " is already sharded");
    if (etp != 0 && seg.tp_degree != etp)
      fail(index, "filter",
           "selects segments of different expert tensor-parallel degrees (" + std::to_string(etp) + " and " +
               std::to_string(seg.tp_degree) + ")");
    etp = seg.tp_degree;
    seg.shard_degree = degree;
  }
  if (d.devices.size() % (static_cast<std::size_t>(etp) * static_cast<std::size_t>(degree)) != 0)
    fail(index, "degree",
         fmt::format("{} x expert_degree {} does not divide the {} devices", degree, etp, d.devices.size()));
  const bool fp8 = d.dispatch_dtype == "fp8";
  if (fp8 && cx.dag.training.precision != Precision::FP8)
    fail(index, "dispatch_dtype",
         "fp8 all-to-alls need fp8 training (the experts' first GEMM takes the fp8 tokens); the model trains in " +
             to_string(cx.dag.training.precision));
  if (degree == 1) return;
  if (fp8)
    for (int s : segments_of(cx, matched)) cx.dag.segments.at(static_cast<std::size_t>(s)).fp8_dispatch = true;
  if (d.chunks > 1) {
    int split = 1;
    for (int s : segments_of(cx, matched))
      split = std::max(split, cx.dag.segments.at(static_cast<std::size_t>(s)).token_split);
    const std::int64_t tokens = cx.dag.training.tokens_per_microbatch() / split;
    if (d.chunks > tokens)
      fail(index, "chunks",
           fmt::format("{} chunks exceed the {} tokens of a microbatch on a device", d.chunks, tokens));
    matched = chunk_nodes(cx, matched, d.chunks);
    for (int s : segments_of(cx, matched)) cx.dag.segments.at(static_cast<std::size_t>(s)).a2a_chunks = d.chunks;
  }
  Graph& g = cx.g();
  std::vector<int> ep_order;  // the set listed EP group by EP group
  const auto block = static_cast<std::size_t>(etp) * static_cast<std::size_t>(degree);
  for (std::size_t b = 0; b < d.devices.size(); b += block)
    for (int r = 0; r < etp; ++r)
      for (int j = 0; j < degree; ++j) ep_order.push_back(d.devices[b + static_cast<std::size_t>(j * etp + r)]);
  DeviceSetId set = cx.dag.device_sets.intern(ep_order);
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
    // fp8 toward the experts (DeepSeek-V3, section 3.3.3): a byte a value and an fp32 scale per 128
    // values (1x128 tiles); the results coming back keep the activations' dtype.
    if (fp8 && into) {
      const std::int64_t values = a2a.bytes / bytes_per_element(cx.dag.training.precision);
      a2a.bytes = values + (values + 127) / 128 * 4;
    }
    a2a.label = std::string("ALL_TO_ALL ") + (into ? "dispatch " : "combine ") + sn.label;
    boost::remove_edge(r.u, r.v, g);
    Vertex a = cx.add(std::move(a2a));
    DagEdge e = r.e;
    cx.dag.add_edge(r.u, a, e);
    e.bytes = cx.node(a).bytes;
    cx.dag.add_edge(a, r.v, e);
  }
}

}  // namespace

void run_shard(PassRun& run, const ShardDirective& d, int index) { apply_shard(run.cx, d, index); }

}  // namespace piper::core::passes
