// The global training DAG (Boost.Graph, bundled properties): compute, update and communication nodes
// over interned device sets, with data and temporal edges. Directives rewrite it; lowering reads it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <boost/graph/adjacency_list.hpp>
#include <nlohmann/json_fwd.hpp>

#include "piper/core/model.hpp"
#include "piper/core/program_types.hpp"

namespace piper::core {

enum class NodeKind { Compute, Update, Send, Recv, AllReduce, ReduceScatter, AllGather, AllToAll, OrderDummy };
std::string to_string(NodeKind k);
bool is_collective(NodeKind k);
bool is_communication(NodeKind k);

class DeviceSetTable {
 public:
  DeviceSetId intern(const std::vector<int>& devices);
  const std::vector<int>& at(DeviceSetId id) const { return sets_.at(static_cast<std::size_t>(id)); }
  std::size_t size() const { return sets_.size(); }
  const std::vector<std::vector<int>>& all() const { return sets_; }

 private:
  std::vector<std::vector<int>> sets_;
  std::unordered_map<std::string, DeviceSetId> index_;
};

struct DagNode {
  NodeKind kind = NodeKind::Compute;
  Pass pass = Pass::None;
  TagMap tags;  // annotation tags + split tags (GlobalDag::splits) of the segment
  DeviceSetId devices = kNoDevices;
  std::string stream = "compute";         // logical stream
  int segment = -1;                       // model segment index (compute, update and comm derived from one)
  int first_layer = -1, last_layer = -1;  // [first, last) model layers of a compute node
  Costs costs;                            // per device: already divided by any shard degree
  std::int64_t bytes = 0;                 // communication payload per device (send/recv/collectives)
  DeviceSetId peer_devices = kNoDevices;  // SEND: receiver set; RECV: sender set
  int family = -1;                        // collectives: index into GlobalDag::families
  std::vector<int> buffer_segments;       // UPD / gradient / param collectives: segments whose params they carry
  int prefetch = -1;                      // ZeRO-3 per-use gathers: how many may run ahead of their use (-1: no limit)
  bool blocking = false;  // SEND/RECV of a "blocking" place directive (synchronous on the compute stream)
  std::string label;      // human-readable, e.g. "F mb3 PP2 seg5"
  bool removed = false;   // tombstone left by rewrites (BGL vecS keeps indices stable)
};

// A ZeRO-3 per-use parameter gather (a pass of its own, F or B), as opposed to the gather of updated
// shards after the optimizer step of ZeRO-1/2 (no pass).
inline bool is_parameter_gather(const DagNode& n) { return n.kind == NodeKind::AllGather && n.pass != Pass::None; }

enum class EdgeKind { Data, Temporal };
struct DagEdge {
  EdgeKind kind = EdgeKind::Data;
  std::int64_t bytes = 0;  // tensor size for data edges
  std::string tensor;      // "act", "grad", "stash", "param", ...
};

using Graph = boost::adjacency_list<boost::vecS, boost::vecS, boost::bidirectionalS, DagNode, DagEdge>;
using Vertex = Graph::vertex_descriptor;

// One contiguous run of layers with the same tag stack (the unit the DAG is built from).
// ZeRO shards of a segment with `replicas` data-parallel copies under an HSDP shard group of
// `group` replicas (0: none): the group when it splits the replicas, else every replica (the rule
// of replicate's shard_group; piper tune's memory bound uses it too).
inline int zero_shards_of(int replicas, int group) { return group > 1 && group < replicas ? group : replicas; }

struct Segment {
  int index = 0;
  int first_layer = 0, last_layer = 0;  // [first, last)
  TagMap tags;
  Costs costs;            // sum of the layers' costs, whole (unsharded)
  bool has_loss = false;  // holds the LM head + loss (the turn of the DAG)
  int fanout = 1;         // tokens fan out by top-k when the segment starts with routed experts
  // Routed experts under node-limited routing (model moe.routing_groups / routing_group_limit; 0 =
  // uniform): lowering copies them onto the segment's ALL_TO_ALL ops (Op::route_*).
  int routing_groups = 0, routing_group_limit = 0;
  // Set by the replicate/shard passes; lowering sizes the per-device state buffers from them.
  int shard_degree = 1;  // shard: parameters split over this many devices
  int replicas = 1;      // replicate: data-parallel copies holding (shards of) the params
  int zero_level = 0;    // 0 none, 1 optimizer states, 2 + gradients, 3 + parameters sharded
  int zero_shards = 1;   // ZeRO >= 1: shards of the state (replicas, or the HSDP group size)
  // ZeRO-2/3 reducing after every microbatch (ReplicateDirective::reduce_every_microbatch): only the
  // gradient shard persists. Otherwise (ZeRO-2/3 reducing once per step) the whole gradient does.
  bool reduce_every_microbatch = false;
  // ZeRO-3 under replicate's collective_copies "fsdp2" (ReplicateDirective::fsdp2_copies), on a segment
  // whose parameters are gathered: lowering lists FSDP2's copy-out and reduce-scatter copy-in kernels.
  bool fsdp2_copies = false;
  bool gather_fp8 = false;  // ZeRO-3 gathers move fp8 weights (ReplicateDirective::gather_fp8)
  std::int64_t grad_divisor() const { return zero_level >= 2 && reduce_every_microbatch ? zero_shards : 1; }
  // What divides state that ZeRO shards from `level` on (1 optimizer states, 2 gradients, 3 parameters).
  std::int64_t zero_divisor(int level) const { return zero_level >= level ? zero_shards : 1; }
  // Elements of one device's share of `params` split `divisor` ways: whole elements, the last shard
  // padded (FSDP's and DeepSpeed's flat buffers pad to a multiple of the shard count), so the shards
  // hold every parameter even where the count does not divide.
  static std::int64_t shard_elems(std::int64_t params, std::int64_t divisor) {
    return (params + divisor - 1) / divisor;
  }
  // Set by the tensor_parallel / recompute passes (Megatron layout, see ARCHITECTURE.md).
  int tp_degree = 1;               // tensor-parallel group size (consecutive devices of the set)
  bool sequence_parallel = false;  // TP all-reduces become reduce-scatter + all-gather
  bool tp_comm_overlap = false;    // TP collectives overlap the GEMMs (TensorParallelDirective::comm_overlap)
  Recompute recompute = Recompute::None;
  int tp_family = -1;  // GlobalDag::families index of the TP groups (purpose "tp")
  // Set by the context_parallel pass (ContextParallelDirective): CP degree, K/V exchange, CP groups.
  int cp_degree = 1;
  bool cp_all_gather = false;
  int cp_family = -1;                            // GlobalDag::families index of the CP groups (purpose "cp")
  std::int64_t tp_local_params = 0;              // parameters one TP rank holds (norms replicated), when tp_degree > 1
  std::int64_t tp_local_gemm_weight_params = 0;  // of those, fp8 GEMM weights (Costs::gemm_weight_params)
  // Routed experts under a tensor_parallel directive: tp_degree is its expert_degree (ETP) and the
  // experts' input is the 1/token_split sequence slice of the stage (its SP degree, else 1).
  int token_split = 1;
  // Set by the shard pass (ShardDirective::chunks): each F/B/BI node of these experts is N nodes of 1/N
  // of the tokens, each between its own dispatch and combine all-to-alls.
  int a2a_chunks = 1;
  // Set by the shard pass (ShardDirective::dispatch_dtype "fp8"): the all-to-alls toward these experts
  // move fp8 (a byte a value and an fp32 scale per 128).
  bool fp8_dispatch = false;
  // Parameters of one shard (EP shard, TP rank, or both: an ETP slice of E/ep experts), before ZeRO.
  std::int64_t local_params() const { return (tp_degree > 1 ? tp_local_params : costs.params) / shard_degree; }
  // Of those, the weights of the GEMMs fp8 training runs in fp8 (Costs::gemm_weight_params): what
  // keeps a 1-byte fp8 copy under precision fp8. The tied copy (an LM head's) has none.
  std::int64_t local_gemm_weight_params() const {
    return (tp_degree > 1 ? tp_local_gemm_weight_params : costs.gemm_weight_params) / shard_degree;
  }
  // Bytes of one shard's parameters gathered in fp8 (ReplicateDirective::gather_fp8, TorchTitan's Float8):
  // the fp8 GEMMs' weights one byte each, every other parameter (the tied copy's included) in `dt` bytes.
  std::int64_t fp8_gather_bytes(std::int64_t dt) const {
    const std::int64_t gemm = local_gemm_weight_params();
    return gemm + (state_params() - gemm) * dt;
  }
  // A head tied to the embedding of another segment keeps its own copy of the table (Megatron's
  // embedding group; both runtime backends do the same, V placements included): V·h parameters,
  // whole (vocabulary-parallel under TP), with gradient and optimizer state like the segment's own.
  std::int64_t tied_copy = 0;
  std::int64_t tied_vocab = 0;  // with tied_copy: the table's vocabulary (tied_copy / V is the hidden size)
  int tied_to = -1;             // with tied_copy: the embedding's segment
  // One TP rank's rows of the copy: ceil(V / t) of the padded vocabulary (core::tp_padded_vocab).
  std::int64_t copy_local_params() const {
    return tp_degree > 1 && tied_vocab > 0
               ? tp_padded_vocab(tied_vocab, tp_degree) / tp_degree * (tied_copy / tied_vocab)
               : tied_copy;
  }
  // Everything this segment's plan keeps state for, per shard: its parameters and the tied copy.
  std::int64_t state_params() const { return local_params() + copy_local_params(); }
  bool has_state() const { return costs.params > 0 || tied_copy > 0; }
  bool placed = false;
};

class GlobalDag {
 public:
  GlobalDag() = default;
  GlobalDag(const GlobalDag&) = default;
  GlobalDag& operator=(const GlobalDag&) = default;
  // Boost 1.74's adjacency_list has no move constructor or move assignment, so moving a GlobalDag
  // copied its whole graph: three copies and their destruction per `piper simulate` (a compiled
  // scenario moved into the result, into the engine's run and out of it), 40 % of one at 1,024 GPUs.
  // The graph moves by swapping its storage; the other members move as usual (members(): every one
  // but the graph).
  GlobalDag(GlobalDag&& other) noexcept { *this = std::move(other); }
  GlobalDag& operator=(GlobalDag&& other) noexcept;
  ~GlobalDag() = default;

  Graph graph;
  DeviceSetTable device_sets;
  std::vector<CommFamily> families;
  std::vector<Segment> segments;
  TrainingShape training;
  std::string model_name;
  std::vector<Layer> layers;  // the model's layers (passes that re-cost segments read them)
  int microbatches = 1;       // product of the split counts
  // The split directives applied, in order (outermost first): the tag each one adds to the nodes it
  // copies and its count. Lowering numbers microbatches from them (Op::microbatch).
  struct Split {
    std::string dim_name;
    int count = 1;
  };
  std::vector<Split> splits;
  std::optional<SmPartition> sm_partition;  // set by the sm_partition directive
  double clip_grad = 0;                     // set by the clip_grad directive: the max global norm (0: none)
  // A member added above belongs in members() too (DagMove.MovesEveryMemberAndTheGraph checks them).

  Vertex add_node(const DagNode& n) { return boost::add_vertex(n, graph); }
  void add_edge(Vertex u, Vertex v, const DagEdge& e) { boost::add_edge(u, v, e, graph); }
  int family_index(const CommFamily& f);   // interns a family
  std::vector<Vertex> live_nodes() const;  // not removed, in index order
  std::size_t live_node_count() const;
  int num_devices() const;  // 1 + the largest device id in any set
  // Counts of live nodes by kind name ("F", "B", "SEND", "ALL_REDUCE", ...).
  std::map<std::string, std::int64_t> counts_by_kind() const;
  bool has_cycle() const;  // BGL depth-first search over live nodes
  nlohmann::json to_json() const;
  std::string to_dot() const;

 private:
  auto members() {
    return std::tie(device_sets, families, segments, training, model_name, layers, microbatches, splits, sm_partition,
                    clip_grad);
  }
};

inline GlobalDag& GlobalDag::operator=(GlobalDag&& other) noexcept {
  if (this == &other) return *this;
  // adjacency_list::swap copies the graph three times. Its storage (public members, "would be
  // protected if friends were more portable") swaps in O(1): the vertex vector, the edge list the
  // vertices' out- and in-edge entries point into (std::list iterators survive a swap), the property.
  graph.m_vertices.swap(other.graph.m_vertices);
  graph.m_edges.swap(other.graph.m_edges);
  graph.m_property.swap(other.graph.m_property);
  members() = std::apply([](auto&... m) { return std::forward_as_tuple(std::move(m)...); }, other.members());
  return *this;
}

// Kind name as printed in stats and dumps: "F", "B", "BI", "BW", "UPD", "SEND", ..., "ORDER_DUMMY".
std::string node_kind_name(const DagNode& n);

// Tags as a label suffix: " mb3 EP1 PP2" (microbatch first).
std::string tags_label(const TagMap& tags);
// Label of a node from its kind, tags and segment: "F mb3 PP2 s5".
std::string node_label(const DagNode& n);

// Segments of a model: contiguous layers with equal tag maps. The segment holding the head is last.
std::vector<Segment> segment_model(const Model& model);

// Build the unplaced training DAG: F chain over segments, mirrored B chain, F->B stash edges, the
// loss at the turn (the last F feeds the last B), one UPD per segment fed by its B.
GlobalDag build_dag(const Model& model);

}  // namespace piper::core
