// The replicate pass: data parallelism of the selected segments (gradient reductions, ZeRO gathers, HSDP).
#include "pass.hpp"

#include <algorithm>
#include <map>

#include <fmt/format.h>

namespace piper::core::passes {

namespace {

// Segments grouped by communicator family: fully replicated ones over all devices; partially
// sharded ones (shard degree < devices) over the strided groups holding the same shard. With
// HSDP, `across` is the family of the cross-group all-reduce (-1: none).
struct Families {
  int reduce = -1, across = -1;
  auto operator<=>(const Families&) const = default;
};

// Marks the selected segments replicated (replicas, ZeRO level and shards) and groups those with
// state to reduce by the families their gradients are reduced over.
std::map<Families, std::vector<int>> reduction_families(PassContext& cx, const ReplicateDirective& d, int index,
                                                        const std::vector<Vertex>& matched, int zero) {
  auto& dag = cx.dag;
  const int n = static_cast<int>(d.devices.size());
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
    return hsdp_by_split[split] =
               std::pair{dag.family_index({dag.device_sets.intern(within), k, 1, FamilyPurpose::DpShard}),
                         dag.family_index({dag.device_sets.intern(across), groups, 1, FamilyPurpose::DpReplicate})};
  };
  std::map<Families, std::vector<int>> by_family;
  for (int s : segments_of(cx, matched)) {
    auto& seg = dag.segments.at(static_cast<std::size_t>(s));
    if (cx.replicated.at(static_cast<std::size_t>(s)))
      fail(index, "filter", "segment " + std::to_string(s) + " is already replicated");
    cx.replicated[static_cast<std::size_t>(s)] = true;
    if (seg.shard_degree >= n || (seg.shard_degree > 1 && seg.shard_degree * seg.tp_degree >= n))
      continue;  // fully sharded: nothing to reduce
    // A TP segment's replicas are the strided groups of devices with the same TP rank; routed experts'
    // (expert-data-parallel) those with the same ETP rank and EP shard: positions equal mod tp x shard.
    const int split = seg.tp_degree * seg.shard_degree;
    seg.replicas = n / split;
    seg.zero_level = zero;
    seg.reduce_every_microbatch = d.reduce_every_microbatch && zero >= 2;
    seg.zero_shards = zero_shards_of(seg.replicas, d.shard_group);
    if (seg.replicas % seg.zero_shards != 0)
      fail(index, "shard_group",
           fmt::format("{} does not divide the {} replicas of segment {}", d.shard_group, seg.replicas, s));
    if (!seg.has_state() || seg.replicas == 1) continue;
    seg.fsdp2_copies = d.fsdp2_copies && zero == 3;  // its gathers and reduce-scatters are emitted below
    seg.gather_fp8 = d.gather_fp8 && zero == 3;
    if (seg.zero_shards < seg.replicas) {
      auto [within, across] = hsdp_families(split, seg.replicas, seg.zero_shards);
      by_family[{within, across}].push_back(s);
      continue;
    }
    CommFamily fam = split == 1              ? CommFamily{set, n, 1, FamilyPurpose::Dp}
                     : seg.shard_degree == 1 ? CommFamily{set, n / split, split, FamilyPurpose::Dp}
                                             : CommFamily{set, n / split, split, FamilyPurpose::DpEp};
    by_family[{dag.family_index(fam), -1}].push_back(s);
  }
  return by_family;
}

// One directive's device set: its UPD and, per segment, the backward nodes that produce its gradient
// and the compute nodes that use its parameters.
struct BucketContext {
  PassContext& cx;
  const ReplicateDirective& d;
  int zero;
  Vertex upd = boost::graph_traits<Graph>::null_vertex();
  std::map<int, std::vector<Vertex>> producers, consumers;  // segment -> nodes
  bool has_upd() const { return upd != boost::graph_traits<Graph>::null_vertex(); }
};

// The bucket's gradient reduction(s), and HSDP's cross-group all-reduce; returns the nodes the UPD waits for.
std::vector<Vertex> emit_reductions(BucketContext& b, const DagNode& red, const Families& families,
                                    const std::vector<int>& bucket, std::int64_t bytes, const std::string& what) {
  PassContext& cx = b.cx;
  auto& dag = cx.dag;
  // One reduction after the last microbatch, or (reduce_every "microbatch") one per microbatch,
  // each after that microbatch's backward of the bucket's segments.
  std::map<std::vector<int>, std::vector<Vertex>> rounds;
  for (int s : bucket)
    for (auto p : b.producers[s]) {
      std::vector<int> key;
      if (b.d.reduce_every_microbatch)
        for (const auto& dim : cx.split_dims)
          key.push_back(cx.node(p).tags.contains(dim) ? cx.node(p).tags.at(dim) : -1);
      rounds[key].push_back(p);
    }
  if (rounds.empty()) rounds[{}];
  std::vector<Vertex> reduced;
  for (auto& [key, from] : rounds) {
    DagNode round = red;
    if (b.d.reduce_every_microbatch && !from.empty()) {
      round.tags = cx.node(from.front()).tags;
      round.label = to_string(red.kind) + tags_label(round.tags) + " s" + std::to_string(bucket.front());
    }
    Vertex vr = cx.add(round);
    for (auto p : from) {
      if (b.has_upd()) boost::remove_edge(p, b.upd, cx.g());
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
  return reduced;
}

// ZeRO-1/2: one gather of the updated shards after the UPD; ZeRO-3: one before each use. `bytes`: the
// bucket's parameters in their storage dtype (bf16 parameters gather 2 bytes each whatever the
// gradients' dtype: Megatron's distributed optimizer, DeepSpeed's and FSDP's param_dtype gathers).
void emit_gathers(BucketContext& b, const DagNode& red, const std::vector<int>& bucket, std::int64_t bytes,
                  std::int64_t fp8_bytes, const std::string& what) {
  PassContext& cx = b.cx;
  auto& dag = cx.dag;
  DagNode ag = red;
  ag.kind = NodeKind::AllGather;
  ag.stream = b.d.gather_stream;
  if (b.zero == 1 || b.zero == 2) {
    // Each rank updated its shard of the parameters: gather the full parameters back.
    ag.label = "ALL_GATHER" + what;
    ag.bytes = bytes;
    Vertex va = cx.add(ag);
    if (b.has_upd()) dag.add_edge(b.upd, va, {EdgeKind::Data, bytes, "param"});
  } else if (b.zero == 3) {
    // ZeRO-3: gather the bucket's parameters before each use: once per microbatch for F and once
    // for the backward (kept from BI to BW), freed after the last use.
    std::map<std::pair<bool, std::vector<int>>, std::vector<Vertex>> uses;
    for (int s : bucket)
      for (auto c : b.consumers[s]) {
        std::vector<int> key;
        for (const auto& dim : cx.split_dims)
          key.push_back(cx.node(c).tags.contains(dim) ? cx.node(c).tags.at(dim) : -1);
        uses[{is_backward(cx.node(c).pass), key}].push_back(c);
      }
    // fp8 gathers (Float8 training): the fp8 GEMMs' weights one byte each, the other parameters
    // (embedding, head, norms, biases, router) in their dtype.
    const std::int64_t gathered = b.d.gather_fp8 ? fp8_bytes : bytes;
    for (auto& [key, users] : uses) {
      DagNode pre = ag;
      pre.bytes = gathered;
      pre.pass = key.first ? Pass::B : Pass::F;
      pre.tags = cx.node(users.front()).tags;
      pre.prefetch = b.d.prefetch;
      pre.label = "ALL_GATHER" + std::string(key.first ? " B" : " F") + tags_label(pre.tags) + " s" +
                  std::to_string(bucket.front());
      Vertex va = cx.add(pre);
      for (auto c : users) dag.add_edge(va, c, {EdgeKind::Data, gathered, "param"});
    }
  }
}

void emit_bucket(BucketContext& b, const Families& families, const std::vector<int>& bucket) {
  PassContext& cx = b.cx;
  auto& dag = cx.dag;
  const int family = families.reduce;
  std::int64_t bytes = 0;
  for (int s : bucket)
    bytes += dag.segments[static_cast<std::size_t>(s)].state_params() * gradient_bytes_per_element(dag.training);
  const std::string what = common_tags_label(dag, bucket);
  DagNode red;
  red.kind = b.zero == 0 ? NodeKind::AllReduce : NodeKind::ReduceScatter;
  // The family's own order of the set's devices (HSDP lists its groups one after another).
  red.devices = dag.families[static_cast<std::size_t>(family)].devices;
  red.stream = b.d.reduce_stream;
  red.family = family;
  red.bytes = bytes;
  red.segment = bucket.front();
  red.buffer_segments = bucket;
  red.tags = dag.segments[static_cast<std::size_t>(bucket.front())].tags;
  red.label = to_string(red.kind) + what;
  const std::vector<Vertex> reduced = emit_reductions(b, red, families, bucket, bytes, what);
  if (b.has_upd())
    for (Vertex vr : reduced) dag.add_edge(vr, b.upd, {EdgeKind::Data, bytes, "grad"});
  std::int64_t param_bytes = 0, fp8_bytes = 0;
  for (int s : bucket) {
    const Segment& seg = dag.segments[static_cast<std::size_t>(s)];
    param_bytes += seg.state_params() * bytes_per_element(dag.training.precision);
    fp8_bytes += seg.fp8_gather_bytes(bytes_per_element(dag.training.precision));
  }
  emit_gathers(b, red, bucket, param_bytes, fp8_bytes, what);
}

void apply_replicate(PassContext& cx, const ReplicateDirective& d, int index) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  check_devices(cx, matched, d.devices, index);
  auto& dag = cx.dag;
  if (d.gather_fp8 && dag.training.precision != Precision::FP8)
    fail(index, "gather_dtype",
         "\"fp8\" needs fp8 training (Float8 weights to gather); the model trains in " +
             to_string(dag.training.precision));
  BucketContext b{cx,
                  d,
                  d.shard_params ? 3 : d.shard_grads ? 2 : d.shard_optimizer ? 1 : 0,
                  boost::graph_traits<Graph>::null_vertex(),
                  {},
                  {}};
  auto by_family = reduction_families(cx, d, index, matched, b.zero);
  const DeviceSetId set = dag.device_sets.intern(d.devices);  // interned above: the same id
  for (auto v : dag.live_nodes()) {
    auto& nd = cx.node(v);
    if (nd.kind == NodeKind::Update && nd.devices == set) b.upd = v;
    if (nd.kind != NodeKind::Compute || nd.devices != set) continue;
    if (nd.pass == Pass::B || nd.pass == Pass::BW) b.producers[nd.segment].push_back(v);
    b.consumers[nd.segment].push_back(v);
  }
  const std::int64_t cap = static_cast<std::int64_t>(d.bucket_size_mb * 1024.0 * 1024.0);
  for (auto& [families, segs] : by_family) {
    std::sort(segs.rbegin(), segs.rend());  // gradients become ready last segment first
    std::vector<std::vector<int>> buckets;
    std::int64_t filled = 0;
    for (int s : segs) {
      std::int64_t bytes =
          dag.segments[static_cast<std::size_t>(s)].state_params() * gradient_bytes_per_element(dag.training);
      if (buckets.empty() || cap == 0 || filled + bytes > cap) buckets.emplace_back(), filled = 0;
      buckets.back().push_back(s);
      filled += bytes;
    }
    for (const auto& bucket : buckets) emit_bucket(b, families, bucket);
  }
}

}  // namespace

void run_replicate(PassRun& run, const ReplicateDirective& d, int index) { apply_replicate(run.cx, d, index); }

}  // namespace piper::core::passes
