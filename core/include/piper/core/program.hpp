// The Program: per-device plans lowered from the rewritten DAG (core/lower.hpp). It is the only input
// of the simulator and the runtime. Devices that differ only by data-parallel rank share one Plan.
// This header is the contract: it does not include the DAG (dag.hpp) or Boost, and consumers read
// typed fields, never tags by name (Op::microbatch, CommFamily::purpose; tags are labels only).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/kernels.hpp"
#include "piper/core/program_types.hpp"

namespace piper::core {

enum class OpKind { Compute, Update, Send, Recv, AllReduce, ReduceScatter, AllGather, AllToAll };
std::string to_string(OpKind k);  // "COMPUTE", "UPD", "SEND", ...
OpKind op_kind_from_string(const std::string& s);

// A position in a plan: stream index and op index within that stream.
struct OpRef {
  int stream = -1;
  int index = -1;
  friend bool operator==(const OpRef&, const OpRef&) = default;
  friend auto operator<=>(const OpRef&, const OpRef&) = default;
};

enum class BufferKind { Parameters, Gradients, OptimizerStates, Activations, Received, GatheredParameters };
std::string to_string(BufferKind k);
BufferKind buffer_kind_from_string(const std::string& s);

// A buffer of one device. Persistent buffers (parameters, gradients, optimizer states) have no
// alloc/free op: they live for the whole step. Transient ones are allocated when `alloc` starts and
// freed when `free` ends.
struct Buffer {
  std::string name;
  BufferKind kind = BufferKind::Activations;
  std::int64_t bytes = 0;
  OpRef alloc;  // {-1,-1}: persistent
  OpRef free;   // {-1,-1}: persistent
  bool persistent() const { return alloc.stream < 0; }
};

struct Op {
  OpKind kind = OpKind::Compute;
  Pass pass = Pass::None;
  std::int32_t node = -1;  // DAG node it came from; SEND and RECV both carry the SEND node (the pair's key)
  std::string label;       // "F mb3 PP2"
  TagMap tags;             // the node's tags, for labels and dumps only: read typed fields instead
  // The microbatch the op works on, 0..Program::microbatches-1: the split copies' indices in
  // mixed radix, the first split outermost (GlobalDag::splits), whatever their dimension names.
  // -1: not tied to one microbatch (UPD, gradient collectives, the tied-embedding sum, and ops of a
  // region that a nested split did not cover, which the runtime refuses).
  int microbatch = -1;
  double flops = 0;
  std::int64_t memory_bytes = 0;        // HBM traffic (roofline input)
  std::int64_t bytes = 0;               // communication payload per device
  DeviceSetId device_set = kNoDevices;  // the set this op's node runs on (resolves peers)
  DeviceSetId peer_set = kNoDevices;    // SEND/RECV: the other side; peer = peer_set[pos(me, device_set)]
  int family = -1;                      // collectives: Program::families index; group = the one holding me
  // Pairing id (SEND, RECV and collectives; -1 on COMPUTE and UPD): unique within the Program per
  // transfer or collective occurrence. The SEND on device d meets the RECV with the same id on
  // peer_of(op, d); a collective meets the ops with the same id on every member of group_of(family, d).
  // Plan-relative: devices sharing a plan share its ids, the peer or group resolving from the device.
  // A plan holds at most one SEND, one RECV and one collective per id. The rules: core/readiness.hpp.
  int pair = -1;
  std::vector<OpRef> waits;   // ops of other streams of this device that must finish first
  std::vector<int> uses;      // transient buffers read or written (persistent state is per segment)
  int segment = -1;           // Program::segments index: which model layers a COMPUTE op runs; SEND: the
                              // producer's segment, RECV: the consumer's, ALL_TO_ALL: the sharded one
  std::vector<int> segments;  // UPD and gradient/parameter collectives: the segments whose state they touch
  // COMPUTE ops of a tensor-parallel segment: the TP collectives performed inside the op over the
  // segment's TP group (ProgramSegment::tp_family). tp_bytes sums the full (unsharded) tensor bytes
  // of each collective counted in all-gather units: an all-gather or reduce-scatter of an N-byte
  // tensor counts N, an all-reduce counts 2N; each device moves tp_bytes·(t-1)/t over the fabric
  // (ring). tp_collectives is the number of collective calls (latency term).
  std::int64_t tp_bytes = 0;
  int tp_collectives = 0;
  // COMPUTE ops of a context-parallel segment: the K/V exchange inside the op over the segment's CP
  // group (ProgramSegment::cp_family). Ring: cp_bytes is what this device sends to the next CP rank,
  // in cp_steps equal steps, each overlapping one block of the attention core. All-gather variant:
  // cp_bytes sums the collectives' full-tensor bytes in all-gather units (as tp_bytes), in cp_steps calls.
  std::int64_t cp_bytes = 0;
  int cp_steps = 0;
  // COMPUTE: HBM traffic of memory-bound element-wise kernels that run between the op's GEMMs
  // (models with standard attention); the simulator adds their time to the roofline.
  std::int64_t elementwise_bytes = 0;
  double recompute_flops = 0;  // part of `flops` that recomputes forward work (not model FLOPs)
  // COMPUTE: GEMM kernels the op launches (core::Costs::*_gemm_kernels); the simulator applies its
  // efficiency curve per kernel. 0: unknown, costed as one kernel.
  int gemm_kernels = 0;
  // ALL_TO_ALL of routed experts under node-limited routing (model moe.routing_groups, DeepSeek-V3):
  // the experts form route_groups groups and each token's route_top_k copies go to at most
  // route_group_limit groups. 0: uniform routing. Costed by CostModel::collective_op_seconds.
  int route_groups = 0, route_group_limit = 0, route_top_k = 0;
};

struct Stream {
  std::string name;
  std::vector<Op> ops;  // issue order
};

struct Plan {
  std::vector<Stream> streams;
  std::vector<Buffer> buffers;
  std::int64_t op_count() const;
};

// One model segment as the simulator and runtime need it: which layers, and how its parameters are
// distributed (shard degree = expert/tensor sharding; replicas = data-parallel copies; ZeRO level).
struct ProgramSegment {
  int first_layer = 0, last_layer = 0;  // [first, last) layers of the model
  TagMap tags;
  DeviceSetId devices = kNoDevices;
  std::int64_t params = 0;  // whole segment, before sharding
  int shard_degree = 1;
  int replicas = 1;
  int zero_level = 0;
  // Tensor parallelism (Megatron layout): the TP group of device d is group_of(tp_family, d),
  // consecutive chunks of tp_degree devices of `devices` (purpose "tp"); the DP replicas are the
  // strided groups of devices with the same TP rank. -1 / 1: no TP.
  int tp_degree = 1;
  bool sequence_parallel = false;
  Recompute recompute = Recompute::None;
  int tp_family = -1;
  bool tp_comm_overlap = false;  // TP collectives overlapped with the GEMMs (cost_model.hpp)
  // ZeRO >= 1: how many ways the state is sharded: `replicas`, or the HSDP shard group size (the
  // replica at data rank i holds shard i % zero_shards; groups of zero_shards consecutive replicas).
  int zero_shards = 1;
  // ZeRO-2/3: gradients reduced after every microbatch (one REDUCE_SCATTER per microbatch and bucket,
  // summed into the shard) instead of once per step (core::Segment::reduce_every_microbatch).
  bool reduce_every_microbatch = false;
  // What one device launches for one microbatch of this segment, per pass (F, BI, BW; a B runs BI then
  // BW): the simulator's per-kernel cost model times these (core/kernels.hpp). Empty in plans written
  // before kernels were listed, and for segments of builder models; their ops are costed by FLOPs.
  PassKernels kernels;
  // Context parallelism (ContextParallelDirective): each device holds seq_len / cp_degree tokens of a
  // sequence (load-balanced causal chunks c and 2·cp_degree-1-c for CP rank c); the CP group of device
  // d is group_of(cp_family, d) (purpose "cp"), its members in CP-rank order; attention exchanges K/V
  // around that ring, or by all-gather (cp_all_gather). The DP replicas (gradient reduction) span DP x CP.
  int cp_degree = 1;
  bool cp_all_gather = false;
  int cp_family = -1;
  // Tied embeddings: on the segment holding a head tied to the embedding of another segment (which
  // keeps its own copy of the table, summed with the embedding's by the tied-embedding family), the
  // embedding's segment index; -1 elsewhere. The DAG's Segment::tied_to, which the tied-embedding pass
  // pairs; consumers read this pair, never layer ranges. In JSON: "tied_to", omitted when -1.
  int tied_to = -1;
  // Routed experts whose all-to-alls are chunked (ShardDirective::chunks): each microbatch's F, B or BI
  // of the segment is a2a_chunks ops of 1/a2a_chunks of its tokens. In JSON "a2a_chunks", omitted when 1.
  int a2a_chunks = 1;
  // Routed experts whose all-to-alls toward them move fp8 (ShardDirective::dispatch_dtype): the costs
  // say so (each such ALL_TO_ALL's bytes); a backend that moves its own dtype refuses the plan. In JSON
  // "fp8_dispatch": true, omitted when false.
  bool fp8_dispatch = false;
  friend bool operator==(const ProgramSegment&, const ProgramSegment&) = default;
};

struct ProgramStats {
  std::int64_t dag_nodes = 0;
  std::map<std::string, std::int64_t> nodes_by_kind;
  double compile_seconds = 0;
  std::int64_t compiler_peak_rss_bytes = 0;
};

// Plan JSON format version ("version"). 2: ops carry "microbatch" (Op::microbatch); 3: SEND, RECV and
// collective ops carry "pair" (Op::pair). Older plans are refused with a line saying to compile them again.
inline constexpr int kPlanVersion = 3;

struct Program {
  std::string model_name;
  nlohmann::json model_spec;  // the model config as a spec file (core::config_from_spec_json), if known
  std::vector<ProgramSegment> segments;
  TrainingShape training;
  int microbatches = 1;  // number of microbatch copies per step (product of split counts)
  int num_devices = 0;
  std::vector<std::vector<int>> device_sets;  // interned sets, as in the DAG
  std::vector<CommFamily> families;           // communicator families (explicit groups derivable)
  std::vector<Plan> plans;                    // distinct plans
  std::vector<int> plan_of_device;            // device -> index into plans
  // The sm_partition directive's split of each GPU's SMs (none: communication and compute share the
  // SMs dynamically, the cluster's comm_sm_share). In JSON: "sm_partition": {"stream", "sms"}, omitted when none.
  std::optional<SmPartition> sm_partition;
  // The clip_grad directive's max global gradient norm (0: no clipping): the plan then holds one
  // ALL_REDUCE of family purpose grad-norm per device between its gradient reductions and its
  // updates. In JSON: "clip_grad", omitted when 0.
  double clip_grad = 0;
  ProgramStats stats;  // not part of equality; informational

  const Plan& plan_for(int device) const {
    return plans.at(static_cast<std::size_t>(plan_of_device.at(static_cast<std::size_t>(device))));
  }
  // Position of `device` in device set `set`, or -1.
  int position_in(DeviceSetId set, int device) const;
  // SEND/RECV: the device on the other side for `device`.
  int peer_of(const Op& op, int device) const;
  // Collective: the ranks of the group that `device` belongs to in family `f`.
  std::vector<int> group_of(int family, int device) const;
  // All groups of a family, each a list of device ids.
  std::vector<std::vector<int>> groups(int family) const;
  std::int64_t total_ops() const;  // summed over devices (not plans)

  nlohmann::json to_json() const;
  static Program from_json(const nlohmann::json& j);  // throws PlanError naming the field
  friend bool operator==(const Program& a, const Program& b);
};

// Writes `contents` to `path`. A regular file (or a new path) is replaced atomically: a temporary
// file in the same folder, fsync, then rename (through a symbolic link, its target is replaced, or
// created for a dangling link). A device, FIFO or socket is written into, never replaced. An empty
// path, a folder or any failed write throws Error("cannot write PATH: <reason>"). The temporary is
// `NAME.tmp.PID`; those of the same NAME whose process is gone (a write killed before its rename) are
// removed first, those of live processes left alone.
void write_file_atomically(const std::string& path, const std::string& contents);
// Opens an existing device or FIFO `path` to write into it; the descriptor is blocking. open(2) of a
// FIFO waits for a reader, forever if none comes (`run --dump-params fifo` hung after training): a
// reader started just after gets a moment, then Error("cannot write PATH: ...") as for any failure.
int open_to_write_through(const std::string& path);
// The file a write to `path` lands on: `path` with its symbolic links followed, a dangling link's
// too (a write goes through a link, never replaces it); relative targets from the link's folder.
// Throws Error("cannot write PATH: too many levels of symbolic links") for a loop.
std::string output_target(const std::string& path);
// The name of write_file_atomically's temporaries for an output file named `name`, less the pid that
// follows: `NAME.tmp.`, or for a name too long to take it within NAME_MAX, its first 180 bytes and a
// hash of the whole name (two long names that share their start get temporaries of their own).
std::string temporary_prefix(const std::string& name);
// The plan's model as a compile builds it: its `model_spec` with the plan's sequence length and micro
// batch size (ModelError naming "plan: field 'model_spec'" for a spec a compile would refuse). The
// spec must be present (Program::model_spec not null).
Model plan_model(const Program& p);

}  // namespace piper::core
