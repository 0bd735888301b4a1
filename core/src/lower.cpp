// Lowering: the rewritten global DAG becomes per-device plans (ops per stream, waits, buffers),
// compiled once per class of devices that hold the same device sets (e.g. all DP ranks of a stage).
#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <set>
#include <utility>

#include "piper/core/error.hpp"
#include "piper/core/lower.hpp"

namespace piper::core {

namespace {

double op_flops(const DagNode& n);
std::int64_t op_memory_bytes(const DagNode& n);

// Ordering edges added by lowering (u, v): v starts after u completes. They are not in the DAG.
using Edges = std::vector<std::pair<Vertex, Vertex>>;

// Stream-ordering policy: one global topological order of the DAG (Kahn's algorithm), taking among
// the ready nodes the one with the earliest estimated start, then the smallest node id. Every device
// issues its ops in this one order, so every pair of devices agrees on the order of their shared
// communication and no wait cycle can arise from lowering. A RECV is emitted right after its SEND
// (its only predecessor), so each transfer is one event of the global order and rendezvous transfers
// cannot deadlock either.
//
// Why a key and not the node id alone: a stream runs its ops in issue order, so a communication op
// issued before another one whose data the device needs first blocks it (head-of-line blocking).
// With ids (microbatch-major) as the only key, the all-to-all of an early microbatch's backward, fed
// by a RECV from another device, was issued on the `ep` stream ahead of the all-to-all of a later
// microbatch's forward that the order directive runs first; the forward then waited for a gradient
// that the rest of the pipeline produces much later (a V schedule with overlapped F&B pairs lost
// half its speed to it; experiments/pp-ep-moe/README.md).
// The key of a compute op is its estimated start: the longest path to it with each compute op
// weighted by its roofline work (FLOPs, or memory bytes times a machine balance of 300 FLOP/byte,
// about an H100's), the expert all-to-alls by their bytes at a network balance (below) and other
// communication weighted zero; the order directives' temporal edges serialise each device's steps, so
// this approximates when the op runs. The key of a communication op is the smallest key of the
// compute it feeds (through other communication) less its own weight: it is issued in the order its
// data is consumed, as a program posts its receives and all-to-alls for the step that needs them.
// Why the all-to-alls weigh: they sit inside a step, between the attention and the experts of one
// microbatch, and in an overlapped F&B step (a schedule's pair of one microbatch's forward and
// another's backward, docs/schedules.md) the other microbatch's compute that does not wait for them
// should run under them. Weighted zero, an expert pass fed by an all-to-all looked ready as early as
// the attention beside it and could be issued first, so the compute stream waited for the all-to-all
// with independent work queued behind it (Megatron-core's layer-level pairing issues the forward's
// attention first, then the backward's experts, while the backward's combine and the forward's
// dispatch move). Other communication (pipeline transfers at step boundaries, gradient collectives
// feeding the update) stays at zero.
// `extra` edges (the ZeRO-3 prefetch limit) order like the DAG's own edges.
std::vector<Vertex> global_order(const Graph& g, const Edges& extra) {
  const std::size_t n = boost::num_vertices(g);
  std::vector<int> indegree(n, 0);
  for (Vertex v = 0; v < n; ++v)
    if (!g[v].removed) indegree[v] = static_cast<int>(boost::in_degree(v, g));
  std::vector<std::vector<Vertex>> extra_out(extra.empty() ? 0 : n);
  for (const auto& [u, v] : extra) extra_out[u].push_back(v), ++indegree[v];
  auto extra_successors = [&](Vertex v) -> const std::vector<Vertex>& {
    static const std::vector<Vertex> none;
    return extra_out.empty() ? none : extra_out[v];
  };

  // Pass 1: estimated start times along a topological order (any; here by id).
  constexpr double kMachineBalanceFlopsPerByte = 300;
  // An expert all-to-all's bytes at a network balance: an H100's 989 TFLOP/s over the 50 GB/s of one
  // 400 Gb/s NIC (EP groups wide enough for their all-to-alls to matter span nodes).
  constexpr double kNetworkBalanceFlopsPerByte = 20000;
  auto is_compute = [&](Vertex v) { return g[v].kind == NodeKind::Compute || g[v].kind == NodeKind::Update; };
  auto work = [&](Vertex v) {
    if (g[v].kind == NodeKind::AllToAll) return kNetworkBalanceFlopsPerByte * static_cast<double>(g[v].bytes);
    if (!is_compute(v)) return 0.0;
    return std::max(op_flops(g[v]), kMachineBalanceFlopsPerByte * static_cast<double>(op_memory_bytes(g[v])));
  };
  std::vector<double> key(n, 0.0);
  std::vector<Vertex> topo;
  topo.reserve(n);
  {
    std::vector<int> left = indegree;
    std::vector<Vertex> ready;
    for (Vertex v = 0; v < n; ++v)
      if (!g[v].removed && left[v] == 0) ready.push_back(v);
    while (!ready.empty()) {
      const Vertex v = ready.back();
      ready.pop_back();
      topo.push_back(v);
      const double end = key[v] + work(v);
      auto reach = [&](Vertex w) {
        key[w] = std::max(key[w], end);
        if (--left[w] == 0) ready.push_back(w);
      };
      for (auto e : boost::make_iterator_range(boost::out_edges(v, g))) reach(boost::target(e, g));
      for (Vertex w : extra_successors(v)) reach(w);
    }
  }
  // Communication takes the earliest key of what it feeds (successors first: reverse topological).
  for (auto it = topo.rbegin(); it != topo.rend(); ++it) {
    const Vertex v = *it;
    if (!is_communication(g[v].kind)) continue;
    double consumed = std::numeric_limits<double>::infinity();
    for (auto e : boost::make_iterator_range(boost::out_edges(v, g)))
      if (g[e].kind == EdgeKind::Data) consumed = std::min(consumed, key[boost::target(e, g)]);
    if (consumed != std::numeric_limits<double>::infinity()) key[v] = std::max(key[v], consumed - work(v));
  }

  // Pass 2: Kahn's algorithm by (estimated start, id).
  using Key = std::pair<double, Vertex>;
  std::priority_queue<Key, std::vector<Key>, std::greater<>> ready;
  for (Vertex v = 0; v < n; ++v)
    if (!g[v].removed && indegree[v] == 0) ready.push({key[v], v});
  std::vector<Vertex> order;
  order.reserve(n);
  std::vector<Vertex> now;
  while (!ready.empty()) {
    now.assign(1, ready.top().second);
    ready.pop();
    while (!now.empty()) {
      Vertex v = now.back();
      now.pop_back();
      order.push_back(v);
      for (auto e : boost::make_iterator_range(boost::out_edges(v, g))) {
        Vertex w = boost::target(e, g);
        if (--indegree[w] > 0) continue;
        if (g[v].kind == NodeKind::Send && g[w].kind == NodeKind::Recv)
          now.push_back(w);
        else
          ready.push({key[w], w});
      }
      for (Vertex w : extra_successors(v))
        if (--indegree[w] == 0) ready.push({key[w], w});
    }
  }
  return order;
}

// Device classes: devices holding exactly the same device sets get the same plan. Classes are
// numbered in the order of their first device.
struct DeviceClasses {
  std::map<std::vector<DeviceSetId>, int> class_of;
  std::vector<const std::vector<DeviceSetId>*> signature;  // class -> the device sets its devices hold
  std::vector<int> plan_of_device;
};

DeviceClasses device_classes(const GlobalDag& dag) {
  const Graph& g = dag.graph;
  const std::size_t num_sets = dag.device_sets.size();
  std::vector<char> set_used(num_sets, 0);
  for (Vertex v = 0; v < boost::num_vertices(g); ++v)
    if (!g[v].removed && g[v].kind != NodeKind::OrderDummy && g[v].devices != kNoDevices)
      set_used[static_cast<std::size_t>(g[v].devices)] = 1;
  std::vector<std::vector<DeviceSetId>> membership(static_cast<std::size_t>(dag.num_devices()));
  for (std::size_t s = 0; s < num_sets; ++s)
    if (set_used[s])
      for (int d : dag.device_sets.at(static_cast<DeviceSetId>(s)))
        membership[static_cast<std::size_t>(d)].push_back(static_cast<DeviceSetId>(s));
  DeviceClasses c;
  c.plan_of_device.resize(membership.size());
  for (std::size_t d = 0; d < membership.size(); ++d) {
    auto [it, fresh] = c.class_of.try_emplace(std::move(membership[d]), static_cast<int>(c.signature.size()));
    if (fresh) c.signature.push_back(&it->first);
    c.plan_of_device[d] = it->second;
  }
  return c;
}

// The ZeRO-3 prefetch limit (FSDP's limit_all_gathers, DeepSpeed's stage3_max_live_parameters).
// Without it nothing holds a per-use parameter gather back: the gather stream runs ahead of the
// compute and holds every gathered copy it has fetched (every microbatch's, for a whole stage).
// On each device the per-use gathers form units, one per compute op that first uses them (usually
// one gather: its segment's compute; gathers of several segments bucketed together share one),
// taken in the order of that op. With a
// prefetch of p, the gathers of unit k wait until unit k-1-p's copies are freed, that is for its
// last use, so at most p + 1 units' copies are live (p = 1: the next unit's gathers overlap the
// current unit's compute, as FSDP's prefetch does). Where that last use comes after unit k's own
// first use (a backward copy kept from BI to a deferred BW), the gathers wait for unit k-1-p's
// latest use before it instead. Every edge ends at a gather whose first use comes after the compute
// it waits for in `order`: moving each gather to just before its first use keeps `order`
// topological, so the edges cannot close a cycle, and every device still issues its ops in one
// global order.
Edges prefetch_edges(const Graph& g, const std::vector<Vertex>& order, const DeviceClasses& classes,
                     std::size_t num_sets) {
  std::vector<std::size_t> rank(boost::num_vertices(g), 0);
  for (std::size_t i = 0; i < order.size(); ++i) rank[order[i]] = i;
  struct Gather {
    Vertex v;
    std::vector<Vertex> uses;  // compute consumers, in `order`
  };
  std::vector<Gather> gathers;
  for (auto v : order) {
    if (!is_parameter_gather(g[v]) || g[v].prefetch < 0) continue;
    Gather gt{v, {}};
    for (auto e : boost::make_iterator_range(boost::out_edges(v, g)))
      if (g[boost::target(e, g)].kind == NodeKind::Compute) gt.uses.push_back(boost::target(e, g));
    std::sort(gt.uses.begin(), gt.uses.end(), [&](Vertex a, Vertex b) { return rank[a] < rank[b]; });
    if (!gt.uses.empty()) gathers.push_back(std::move(gt));
  }
  if (gathers.empty()) return {};
  std::set<std::pair<Vertex, Vertex>> edges;
  std::vector<char> in_class(num_sets);
  std::vector<const Gather*> seq;
  std::vector<std::vector<const Gather*>> units;
  for (const auto* sig : classes.signature) {
    std::fill(in_class.begin(), in_class.end(), 0);
    for (auto s : *sig) in_class[static_cast<std::size_t>(s)] = 1;
    seq.clear();
    for (const auto& gt : gathers)
      if (in_class[static_cast<std::size_t>(g[gt.v].devices)]) seq.push_back(&gt);
    std::stable_sort(seq.begin(), seq.end(),
                     [&](const Gather* a, const Gather* b) { return rank[a->uses[0]] < rank[b->uses[0]]; });
    units.clear();
    for (const Gather* gt : seq) {
      if (units.empty() || units.back()[0]->uses[0] != gt->uses[0]) units.emplace_back();
      units.back().push_back(gt);
    }
    for (std::size_t k = 0; k < units.size(); ++k)
      for (const Gather* gt : units[k]) {
        const auto ahead = static_cast<std::size_t>(g[gt->v].prefetch);
        if (k < ahead + 1) continue;
        // The latest use of unit k-1-p before this unit's first use (its first use always is).
        const std::size_t start = rank[gt->uses[0]];
        Vertex done = units[k - 1 - ahead][0]->uses[0];
        for (const Gather* earlier : units[k - 1 - ahead])
          for (Vertex u : earlier->uses)
            if (rank[u] < start && rank[u] > rank[done]) done = u;
        edges.insert({done, gt->v});
      }
  }
  return {edges.begin(), edges.end()};
}

double op_flops(const DagNode& n) {
  if (n.kind == NodeKind::Update) return n.costs.forward_flops;
  if (n.kind != NodeKind::Compute) return 0;
  switch (n.pass) {
    case Pass::F:
      return n.costs.forward_flops;
    case Pass::B:
      return n.costs.backward_flops();
    case Pass::BI:
      return n.costs.backward_input_flops;
    case Pass::BW:
      return n.costs.backward_weight_flops;
    case Pass::None:
      return 0;
  }
  return 0;
}

int op_gemm_kernels(const DagNode& n) {
  if (n.kind != NodeKind::Compute) return 0;
  switch (n.pass) {
    case Pass::F:
      return n.costs.forward_gemm_kernels;
    case Pass::B:
      return n.costs.backward_input_gemm_kernels + n.costs.backward_weight_gemm_kernels;
    case Pass::BI:
      return n.costs.backward_input_gemm_kernels;
    case Pass::BW:
      return n.costs.backward_weight_gemm_kernels;
    case Pass::None:
      return 0;
  }
  return 0;
}

// Each microbatch's backward joins its weight gradients to the ones the step already holds
// (TrainingShape::grad_accumulation), per parameter of the segment on this device:
//  * fused (Megatron-LM's gradient_accumulation_fusion): the weight-gradient GEMMs' epilogue reads and
//    writes the held gradient, every microbatch, as traffic of those GEMMs (accumulate_in_gemm_epilogues,
//    below); the parameters no GEMM produces by Megatron's gradient hook, serial traffic added to B (or
//    BW when B is split);
//  the others as serial HBM traffic added to B (or BW):
//  * separate with fp32 main grads (DeepSpeed's BF16_Optimizer): zero the bf16 gradients, add them into
//    the fp32 ones by their own kernels: 20 bytes, every microbatch;
//  * separate in the training precision (PyTorch autograd's AccumulateGrad): the step's first
//    microbatch keeps its new gradient, each later one adds into it in place (read 2 + 2, write 2 for
//    bf16);
//  * ZeRO-2/3 reducing every microbatch (the accumulation not named), with or without fp32 reduction
//    (FSDP's reduce_dtype): nothing on the compute stream, below.
// Not under FSDP2's copies (Segment::fsdp2_copies): FSDP2 keeps no main_grad; autograd writes the
// unsharded gradient in the parameters' dtype and the reduce-scatter copy-in casts it (add_fsdp2_copy_kernels).
//
// Whether a segment's backward accumulates at all (see above): not under FSDP2's copies, and not under
// ZeRO-2/3 reducing every microbatch unless the model names an accumulation.
bool accumulates_gradients(const Segment& seg, const TrainingShape& t) {
  if (seg.fsdp2_copies) return false;
  // ZeRO-2/3 reducing every microbatch keeps no whole gradient to add into: the reduce-scatter's input
  // (cast to fp32 where it reduces in fp32) and its accumulation into the held shard run off the
  // compute stream (FSDP1's post-backward stream, DeepSpeed's reduction stream; FSDP2's copy-in is
  // listed as its own kernel), unless the model names an accumulation.
  return !(seg.zero_level >= 2 && seg.reduce_every_microbatch && t.grad_accumulation == GradAccumulation::Auto);
}

// Fused accumulation (Megatron-LM's gradient_accumulation_fusion: fused_weight_gradient_mlp_cuda's
// wgrad_gemm_accum_fp32/fp16, a GEMM with beta = 1 into the held gradient) happens in the weight-gradient
// GEMMs' epilogue: each reads the held gradient and writes it at its width g where a plain GEMM writes
// its result at the training precision, (2g - dt) more bytes per output element. They go into the GEMM
// kernel's memory term (Kernel::bytes), not serial time: a compute-bound GEMM hides them. The profiled
// weight-gradient passes of Qi et al. 2024 (Table 9: Megatron-LM in fp16, these fused GEMMs alone) take
// what the GEMMs take without the traffic (experiments/fidelity, "Stage times"). Returns the parameters
// whose accumulation the GEMMs carry (their outputs' elements); 0 where the segment's accumulation is not fused.
std::int64_t accumulate_in_gemm_epilogues(const Segment& seg, const TrainingShape& t, PassKernels& kernels) {
  if (!accumulates_gradients(seg, t) || t.separate_grad_accumulation()) return 0;
  const std::int64_t extra = 2 * gradient_bytes_per_element(t) - bytes_per_element(t.precision);
  double covered = 0;
  for (Kernel& k : kernels[2])
    if (k.kind == KernelKind::Gemm) {
      k.bytes = k.m * k.n * k.batch * extra;
      covered += k.count * static_cast<double>(k.m * k.n * k.batch);
    }
  return static_cast<std::int64_t>(covered);
}

// `epilogue_params`: the parameters of the node's segment whose fused accumulation its weight-gradient
// GEMMs carry (accumulate_in_gemm_epilogues).
std::int64_t grad_accumulation_bytes(const GlobalDag& dag, const DagNode& n, int microbatch,
                                     std::int64_t epilogue_params) {
  if (n.kind != NodeKind::Compute || (n.pass != Pass::B && n.pass != Pass::BW) || n.segment < 0) return 0;
  const Segment& seg = dag.segments.at(static_cast<std::size_t>(n.segment));
  const TrainingShape& t = dag.training;
  if (!accumulates_gradients(seg, t)) return 0;
  const std::int64_t g = gradient_bytes_per_element(t);
  // A chunked B (ShardDirective::chunks) accumulates once per chunk: each of its ops carries this.
  const std::int64_t params = seg.state_params();
  // Fused: the parameters no GEMM produces (biases, norms, the embedding's scatter-add) join by
  // Megatron-LM's gradient hook, main_grad.add_(grad): read the gradient, read and write the main grad.
  if (!t.separate_grad_accumulation())
    return (2 * g + bytes_per_element(t.precision)) * std::max<std::int64_t>(0, params - epilogue_params);
  if (t.fp32_main_grads) return 20 * params;    // DeepSpeed's BF16_Optimizer
  return microbatch == 0 ? 0 : 3 * g * params;  // autograd's in-place add
}

// PyTorch FSDP2's copies around a ZeRO-3 segment's collectives that run on the compute stream, per
// microbatch, as kernels of the passes that run them (docs/cost-model.md "Copies around the ZeRO-3
// collectives"; read in pytorch/pytorch torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py at
// 8fc2039decebd92b15b38296df8bf9aa13275be0, torch/distributed/_composable/fsdp/ in late-2024 PyTorch):
//  * all-gather copy-out: foreach_all_gather_copy_out waits for the all-gather on the current (compute)
//    stream and torch.split_with_sizes_copy's the gathered flat output into each parameter's unsharded
//    tensor, one kernel reading and writing all P gathered parameters in the gathered dtype a (2 for
//    bf16; with fp8 gathers 1 for the fp8 GEMMs' weights): 2·a·P bytes before the first use of each gather, F's and the
//    backward's (listed first in F and BI);
//  * reduce-scatter copy-in: foreach_reduce's foreach_reduce_scatter_copy_in (torch._chunk_cat, one
//    kernel even when it casts bf16 to fp32: aten/src/ATen/native/cuda/TensorShape.cu's
//    _chunk_cat_out_cuda) on the current stream, before the reduce-scatter stream waits for it (so since
//    pytorch/pytorch#129721, June 2024): it reads the P unsharded gradients in the parameters' dtype g
//    and writes the reduce-scatter input in the reduction dtype r: (g + r)·P bytes after BW (listed last).
// Not on the compute stream, so not listed: the all-gather copy-in (cast of the fp32 shard to the
// parameters' dtype and _foreach_copy_ into the all-gather input, P/N elements, on the all-gather
// copy-in stream ahead of the collective) and the reduce-scatter's view-out and accumulation into the
// sharded gradient (P/N, on the reduce-scatter stream).
void add_fsdp2_copy_kernels(const Segment& seg, const TrainingShape& t, PassKernels& pk) {
  if (!seg.fsdp2_copies || (pk[0].empty() && pk[1].empty() && pk[2].empty())) return;
  const std::int64_t params = seg.state_params();
  Kernel copy_out;
  copy_out.kind = KernelKind::Copy;
  copy_out.bytes = 2 * (seg.gather_fp8 ? seg.fp8_gather_bytes(bytes_per_element(t.precision))
                                       : params * bytes_per_element(t.precision));
  pk[0].insert(pk[0].begin(), copy_out);
  pk[1].insert(pk[1].begin(), copy_out);
  Kernel copy_in;
  copy_in.kind = KernelKind::Copy;
  copy_in.bytes = (bytes_per_element(t.precision) + gradient_bytes_per_element(t)) * params;
  pk[2].push_back(copy_in);
}

std::int64_t op_memory_bytes(const DagNode& n) {
  if (n.kind == NodeKind::Update) return n.costs.forward_memory_bytes;
  if (n.kind != NodeKind::Compute) return 0;
  return n.pass == Pass::F ? n.costs.forward_memory_bytes : n.costs.backward_memory_bytes;
}

OpKind op_kind(NodeKind k) {
  switch (k) {
    case NodeKind::Compute:
      return OpKind::Compute;
    case NodeKind::Update:
      return OpKind::Update;
    case NodeKind::Send:
      return OpKind::Send;
    case NodeKind::Recv:
      return OpKind::Recv;
    case NodeKind::AllReduce:
      return OpKind::AllReduce;
    case NodeKind::ReduceScatter:
      return OpKind::ReduceScatter;
    case NodeKind::AllGather:
      return OpKind::AllGather;
    case NodeKind::AllToAll:
      return OpKind::AllToAll;
    case NodeKind::OrderDummy:
      break;
  }
  throw InternalError("ORDER_DUMMY has no op");
}

// The microbatch a node works on: its split indices in mixed radix, the first split outermost, for
// any dimension names. -1 for nodes outside the microbatches (no pass: UPD, gradient collectives,
// the tied-embedding sum) and for nodes a nested split did not copy (they stand for several
// microbatches at once; the runtime refuses them).
int microbatch_of(const GlobalDag& dag, const DagNode& node) {
  if (node.pass == Pass::None) return -1;
  int index = 0;
  for (const auto& split : dag.splits) {
    auto it = node.tags.find(split.dim_name);
    if (it == node.tags.end()) return -1;
    index = index * split.count + it->second;
  }
  return index;
}

// Transfers of a "blocking" place directive (DeepSpeed's pipeline engine: a synchronous send/recv on
// the compute stream): the compute op after a SEND's producer waits for the SEND to end, and a RECV
// waits for the compute op before its first consumer, so it is posted no earlier than the compute
// stream reaches it. Added as waits (one per stream, the latest), which every engine, the verifier
// and the runtime already honour.
void make_transfers_blocking(const Graph& g, const std::vector<Vertex>& plan_order, const std::vector<OpRef>& ref,
                             Plan& plan) {
  auto add_wait = [](Op& op, OpRef on) {
    for (auto& w : op.waits)
      if (w.stream == on.stream) {
        w.index = std::max(w.index, on.index);
        return;
      }
    op.waits.push_back(on);
    std::sort(op.waits.begin(), op.waits.end(), [](const OpRef& a, const OpRef& b) { return a.stream < b.stream; });
  };
  auto& compute = plan.streams.front().ops;  // stream 0 is "compute"
  for (auto v : plan_order) {
    const auto& node = g[v];
    if (!node.blocking || ref[v].stream < 0) continue;
    if (node.kind == NodeKind::Send) {
      int producer = -1;
      for (auto e : boost::make_iterator_range(boost::in_edges(v, g)))
        if (const Vertex u = boost::source(e, g); g[u].kind == NodeKind::Compute && ref[u].stream == 0)
          producer = std::max(producer, ref[u].index);
      if (producer >= 0 && producer + 1 < static_cast<int>(compute.size()))
        add_wait(compute[static_cast<std::size_t>(producer + 1)], ref[v]);
    } else if (node.kind == NodeKind::Recv) {
      int consumer = std::numeric_limits<int>::max();
      for (auto e : boost::make_iterator_range(boost::out_edges(v, g)))
        if (const Vertex u = boost::target(e, g); g[u].kind == NodeKind::Compute && ref[u].stream == 0)
          consumer = std::min(consumer, ref[u].index);
      if (consumer != std::numeric_limits<int>::max() && consumer > 0)
        add_wait(plan.streams[static_cast<std::size_t>(ref[v].stream)].ops[static_cast<std::size_t>(ref[v].index)],
                 OpRef{0, consumer - 1});
    }
  }
}

}  // namespace

// The phases are calls; what stays inline is the one pass over the global order that emits every op
// into its plans, which reads and writes all the tables built above.
Program lower(const GlobalDag& dag) {  // NOLINT(readability-function-size)
  const Graph& g = dag.graph;
  const std::size_t n = boost::num_vertices(g);
  const std::size_t num_sets = dag.device_sets.size();
  const DeviceClasses classes = device_classes(dag);
  auto order = global_order(g, {});
  if (order.size() != dag.live_node_count()) throw InternalError("cannot lower a DAG with a cycle");
  const Edges prefetch = prefetch_edges(g, order, classes, num_sets);
  if (!prefetch.empty()) order = global_order(g, prefetch);
  if (order.size() != dag.live_node_count()) throw InternalError("the ZeRO-3 prefetch limit closed a cycle");
  std::vector<std::size_t> rank(n, 0);
  for (std::size_t i = 0; i < order.size(); ++i) rank[order[i]] = i;

  // Effective predecessors: ORDER_DUMMY nodes are looked through; a RECV does not wait on its SEND
  // locally (that is a cross-device edge the runtime resolves by matching).
  std::vector<std::vector<Vertex>> preds(n);
  std::function<void(Vertex, std::vector<Vertex>&)> collect = [&](Vertex v, std::vector<Vertex>& out) {
    for (auto e : boost::make_iterator_range(boost::in_edges(v, g))) {
      Vertex u = boost::source(e, g);
      if (g[u].kind == NodeKind::OrderDummy)
        collect(u, out);
      else if (!(g[u].kind == NodeKind::Send && g[v].kind == NodeKind::Recv))
        out.push_back(u);
    }
  };
  for (const auto& [u, v] : prefetch) preds[v].push_back(u);
  std::vector<std::vector<Vertex>> succs(n);
  for (auto v : order) {
    if (g[v].kind == NodeKind::OrderDummy) continue;
    collect(v, preds[v]);
    for (auto u : preds[v]) succs[u].push_back(v);
  }

  Program program;
  program.model_name = dag.model_name;
  program.training = dag.training;
  program.microbatches = dag.microbatches;
  program.num_devices = dag.num_devices();
  program.device_sets = dag.device_sets.all();
  program.families = dag.families;
  program.sm_partition = dag.sm_partition;
  program.clip_grad = dag.clip_grad;
  std::vector<std::int64_t> epilogue_params;  // per segment: accumulate_in_gemm_epilogues
  for (const auto& seg : dag.segments) {
    PassKernels kernels = segment_kernels(dag.layers, seg.first_layer, seg.last_layer, dag.training,
                                          {seg.tp_degree, seg.sequence_parallel, static_cast<int>(seg.recompute),
                                           seg.cp_degree, seg.cp_all_gather, seg.token_split},
                                          seg.shard_degree);
    add_fsdp2_copy_kernels(seg, dag.training, kernels);
    epilogue_params.push_back(accumulate_in_gemm_epilogues(seg, dag.training, kernels));
    program.segments.push_back({seg.first_layer,
                                seg.last_layer,
                                seg.tags,
                                kNoDevices,
                                seg.costs.params,
                                seg.shard_degree,
                                seg.replicas,
                                seg.zero_level,
                                seg.tp_degree,
                                seg.sequence_parallel,
                                seg.recompute,
                                seg.tp_family,
                                seg.tp_comm_overlap,
                                seg.zero_shards,
                                seg.reduce_every_microbatch,
                                std::move(kernels),
                                seg.cp_degree,
                                seg.cp_all_gather,
                                seg.cp_family,
                                seg.tied_copy > 0 ? seg.tied_to : -1,
                                seg.a2a_chunks,
                                seg.fp8_dispatch});
  }

  program.plan_of_device = classes.plan_of_device;

  // Segment -> device set (all copies of a segment share one set; checked by placement).
  std::vector<DeviceSetId> segment_set(dag.segments.size(), kNoDevices);
  for (auto v : order)
    if (g[v].kind == NodeKind::Compute) segment_set[static_cast<std::size_t>(g[v].segment)] = g[v].devices;
  for (std::size_t s = 0; s < segment_set.size(); ++s) program.segments[s].devices = segment_set[s];

  // Pairing ids (Op::pair): one per SEND node, which its RECV shares, and one per collective node (every
  // group of its family runs one occurrence), numbered in the global order. Every device holding the
  // node carries the same id; its peer or group resolves from the device, so plans stay shared.
  std::vector<int> pair_of(n, -1);
  int next_pair = 0;
  for (auto v : order)
    if (g[v].kind == NodeKind::Send || is_collective(g[v].kind)) pair_of[v] = next_pair++;

  const int dt = bytes_per_element(dag.training.precision);
  const std::int64_t state_bytes_per_param = fp32_storage(dag.training.precision) ? 8 : 12;
  // Each device set's nodes in the global order. A plan emits the nodes of its sets, so it walks those
  // (merged by rank), not the whole order: walking the order once per plan made lowering
  // O(plans x nodes), cubic in a deep pipeline whose stages are all plans of their own.
  std::vector<std::vector<Vertex>> nodes_of_set(num_sets);
  for (auto v : order)
    if (g[v].kind != NodeKind::OrderDummy && g[v].devices != kNoDevices)
      nodes_of_set[static_cast<std::size_t>(g[v].devices)].push_back(v);
  std::vector<Vertex> plan_order;  // the current plan's nodes in the global order
  std::vector<OpRef> ref(n);       // OpRef{} except for plan_order's nodes
  for (const auto* sig : classes.signature) {
    for (auto v : plan_order) ref[v] = OpRef{};
    plan_order.clear();
    std::vector<char> in_plan(num_sets, 0);
    for (auto s : *sig) {
      if (std::exchange(in_plan[static_cast<std::size_t>(s)], 1) != 0) continue;
      const auto& nodes = nodes_of_set[static_cast<std::size_t>(s)];
      plan_order.insert(plan_order.end(), nodes.begin(), nodes.end());
    }
    std::sort(plan_order.begin(), plan_order.end(), [&](Vertex a, Vertex b) { return rank[a] < rank[b]; });
    auto here = [&](Vertex v) { return g[v].devices != kNoDevices && in_plan[static_cast<std::size_t>(g[v].devices)]; };
    Plan plan;
    std::map<std::string, int> stream_index;
    auto stream_of = [&](const std::string& name) {
      auto [it, fresh] = stream_index.try_emplace(name, static_cast<int>(plan.streams.size()));
      if (fresh) plan.streams.push_back(Stream{name, {}});
      return it->second;
    };
    stream_of("compute");
    std::vector<int> latest;   // stream -> 1 + index of its latest predecessor of the current op
    std::vector<int> touched;  // streams with a nonzero entry in `latest`
    for (auto v : plan_order) {
      const auto& node = g[v];
      Op op;
      op.kind = op_kind(node.kind);
      op.pass = node.pass;
      op.node = static_cast<std::int32_t>(v);
      if (node.kind == NodeKind::Recv)  // a transfer is named by its SEND node on both sides
        for (auto e : boost::make_iterator_range(boost::in_edges(v, g)))
          if (g[boost::source(e, g)].kind == NodeKind::Send) op.node = static_cast<std::int32_t>(boost::source(e, g));
      if (op.kind != OpKind::Compute && op.kind != OpKind::Update) op.pair = pair_of[static_cast<std::size_t>(op.node)];
      op.label = node.label;
      op.tags = node.tags;
      op.microbatch = microbatch_of(dag, node);
      op.flops = op_flops(node);
      op.memory_bytes = op_memory_bytes(node);
      if (node.kind == NodeKind::Compute) {
        const bool fwd = node.pass == Pass::F;
        op.elementwise_bytes = fwd ? node.costs.forward_elementwise_bytes : node.costs.backward_elementwise_bytes;
        op.tp_bytes = fwd ? node.costs.forward_tp_bytes : node.costs.backward_tp_bytes;
        op.tp_collectives = fwd ? node.costs.forward_tp_collectives : node.costs.backward_tp_collectives;
        op.cp_bytes = fwd ? node.costs.forward_cp_bytes : node.costs.backward_cp_bytes;
        op.cp_steps = fwd ? node.costs.forward_cp_steps : node.costs.backward_cp_steps;
        if (node.pass == Pass::B || node.pass == Pass::BI) op.recompute_flops = node.costs.recompute_flops;
        op.gemm_kernels = op_gemm_kernels(node);
        op.elementwise_bytes += grad_accumulation_bytes(
            dag, node, op.microbatch, node.segment >= 0 ? epilogue_params[static_cast<std::size_t>(node.segment)] : 0);
      }
      op.bytes = node.bytes;
      op.device_set = node.devices;
      op.peer_set = node.peer_devices;
      op.family = node.family;
      // COMPUTE: the layers it runs; SEND/RECV: its own side's segment (the producer on the sender,
      // the consumer on the receiver); ALL_TO_ALL: the sharded segment. The runtime keys data on it.
      if (node.kind == NodeKind::Compute || node.kind == NodeKind::Send || node.kind == NodeKind::Recv ||
          node.kind == NodeKind::AllToAll)
        op.segment = node.segment;
      if (node.kind == NodeKind::AllToAll && node.segment >= 0) {
        const Segment& routed = dag.segments.at(static_cast<std::size_t>(node.segment));
        if (routed.routing_groups > 0) {
          op.route_groups = routed.routing_groups;
          op.route_group_limit = routed.routing_group_limit;
          op.route_top_k = routed.fanout;
        }
      }
      op.segments = node.buffer_segments;
      const int s =
          stream_of(node.kind == NodeKind::Compute || node.kind == NodeKind::Update ? "compute" : node.stream);
      // Wait on the latest predecessor of each other stream; earlier ones are implied by stream order.
      // Waits are listed by stream index. (One table reused over all ops: a map per op was a tenth of
      // lowering's time.)
      latest.resize(plan.streams.size(), 0);
      touched.clear();
      for (auto u : preds[v]) {
        if (!here(u) || ref[u].stream < 0 || ref[u].stream == s) continue;
        int& idx = latest[static_cast<std::size_t>(ref[u].stream)];
        if (idx == 0) touched.push_back(ref[u].stream);
        idx = std::max(idx, ref[u].index + 1);
      }
      std::sort(touched.begin(), touched.end());
      for (int stream : touched) {
        op.waits.push_back(OpRef{stream, latest[static_cast<std::size_t>(stream)] - 1});
        latest[static_cast<std::size_t>(stream)] = 0;
      }
      ref[v] = OpRef{s, static_cast<int>(plan.streams[static_cast<std::size_t>(s)].ops.size())};
      plan.streams[static_cast<std::size_t>(s)].ops.push_back(std::move(op));
    }
    auto op_at = [&](OpRef r) -> Op& {
      return plan.streams[static_cast<std::size_t>(r.stream)].ops[static_cast<std::size_t>(r.index)];
    };
    make_transfers_blocking(g, plan_order, ref, plan);

    // Persistent state of each segment on this plan, sized by its sharding (ZeRO-aware).
    // FP8 (Transformer Engine) also keeps a 1-byte fp8 copy of the weights of its fp8 GEMMs (`gemm`
    // of `params`: the blocks' linear layers, not the embedding, head, norms, biases or router),
    // sharded by ZeRO-3 like the parameters.
    const bool fp8 = dag.training.precision == Precision::FP8;
    auto add_state = [&](const Segment& seg, std::int64_t params, std::int64_t gemm, const std::string& what) {
      const std::string suffix = what + " s" + std::to_string(seg.index);
      plan.buffers.push_back({"params" + suffix,
                              BufferKind::Parameters,
                              Segment::shard_elems(params, seg.zero_divisor(3)) * dt +
                                  (fp8 ? Segment::shard_elems(gemm, seg.zero_divisor(3)) : 0),
                              {},
                              {}});
      plan.buffers.push_back(
          {"grads" + suffix,
           BufferKind::Gradients,
           Segment::shard_elems(params, seg.grad_divisor()) * gradient_bytes_per_element(dag.training),
           {},
           {}});
      plan.buffers.push_back({"optimizer" + suffix,
                              BufferKind::OptimizerStates,
                              Segment::shard_elems(params, seg.zero_divisor(1)) * state_bytes_per_param,
                              {},
                              {}});
    };
    for (const auto& seg : dag.segments) {
      auto set = segment_set[static_cast<std::size_t>(seg.index)];
      if (set == kNoDevices || !in_plan[static_cast<std::size_t>(set)]) continue;
      if (seg.costs.params > 0) add_state(seg, seg.local_params(), seg.local_gemm_weight_params(), "");
      if (seg.tied_copy > 0) add_state(seg, seg.copy_local_params(), 0, " tied embedding copy");
    }
    // Transient buffers: allocated by their producer, freed by their last consumer on this device.
    for (auto v : plan_order) {
      const auto& node = g[v];
      BufferKind kind;
      std::int64_t bytes = 0;
      std::vector<Vertex> consumers;
      if (node.kind == NodeKind::Compute && node.pass == Pass::F) {
        kind = BufferKind::Activations;
        bytes = node.costs.activation_bytes;
        for (auto e : boost::make_iterator_range(boost::out_edges(v, g)))
          if (g[e].tensor == "stash") consumers.push_back(boost::target(e, g));
      } else if (node.kind == NodeKind::Recv || node.kind == NodeKind::AllToAll || is_parameter_gather(node)) {
        kind = node.kind == NodeKind::AllGather ? BufferKind::GatheredParameters : BufferKind::Received;
        bytes = node.bytes;
        consumers = succs[v];
      } else {
        continue;
      }
      std::erase_if(consumers, [&](Vertex c) { return ref[c].stream < 0; });
      if (bytes <= 0) continue;
      Vertex last = v;
      for (auto c : consumers)
        if (rank[c] > rank[last]) last = c;
      const int id = static_cast<int>(plan.buffers.size());
      plan.buffers.push_back({std::string(kind == BufferKind::Activations ? "act "
                                          : kind == BufferKind::Received  ? "recv "
                                                                          : "gathered ") +
                                  node.label,
                              kind, bytes, ref[v], ref[last]});
      op_at(ref[v]).uses.push_back(id);
      for (auto c : consumers) op_at(ref[c]).uses.push_back(id);
    }
    program.plans.push_back(std::move(plan));
  }
  return program;
}

}  // namespace piper::core
