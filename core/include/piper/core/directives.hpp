// Piper directives: parsing of the JSON program (published format plus Piper's extensions) and the
// rewrite passes (one file each under core/src/passes/), applied in the order of the pass manager's
// table (pass_names(); core/src/passes/pass_manager.cpp): split -> backward-split -> tensor-parallel
// -> recompute -> recost -> place -> finish-placement -> tp-groups -> shard -> replicate ->
// tied-embedding -> update-costs -> order -> sm-partition (which only records the SM split).
#pragma once

#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/dag.hpp"
#include "piper/core/error.hpp"

namespace piper::core {

// Conjunctive filter {tag: index | "*"}; the empty filter matches everything. PASS is a pseudo-tag.
struct Filter {
  std::map<std::string, int> exact;             // tag -> required index
  std::vector<std::string> any;                 // tag must be present, any index
  std::optional<Pass> pass;                     // PASS: F | B | BI | BW
  bool matches_tags(const TagMap& tags) const;  // ignores PASS
  bool matches(const DagNode& n) const;         // compute nodes only; checks PASS too
  nlohmann::json to_json() const;
  std::string to_string() const;
  friend bool operator==(const Filter&, const Filter&) = default;
};

struct PlaceDirective {
  Filter filter;
  std::vector<int> devices;
  std::string stream = "pp";  // stream for this region's point-to-point transfers
  // Synchronous transfers, as DeepSpeed's pipeline engine issues them (a blocking send/recv on the
  // compute stream): a SEND's next compute op waits for the transfer to end, and a RECV is posted
  // only when the compute op before its consumer has ended.
  bool blocking = false;
  // "head" or "embedding": the region (filter exactly {PP: i}) holds only the model's final norm +
  // LM head + loss, or only its embedding, as a region of its own (V placements move it off the V's
  // first rank; docs/schedules.md). The compiler checks what the region holds; "" = no claim.
  std::string holds;
  friend bool operator==(const PlaceDirective&, const PlaceDirective&) = default;
};

struct ReplicateDirective {
  Filter filter;
  std::vector<int> devices;
  double bucket_size_mb = 0;     // 0: one gradient collective per segment
  bool shard_optimizer = false;  // Piper extension (ZeRO-1): reduce-scatter + all-gather, full grads kept
  bool shard_grads = false;      // ZeRO-2: gradients reduce-scattered
  bool shard_params = false;     // ZeRO-3: parameters all-gathered before each use
  int prefetch = 1;              // ZeRO-3: gathers that may run ahead of the compute using the current one
  bool gather_blocks = false;    // ZeRO-3 "gather_unit": "block": one segment (and gather) per transformer block
  // ZeRO-3 "gather_dtype": "fp8" (Piper extension): the per-use parameter gathers move fp8 weights, one
  // byte a parameter (TorchTitan's Float8 with enable_fsdp_float8_all_gather); fp8 training only.
  bool gather_fp8 = false;
  // Hybrid sharding (HSDP, FSDP's HYBRID_SHARD): ZeRO shards over groups of this many consecutive
  // replicas, and the groups replicate each other (an all-reduce of each shard across groups).
  // 0: one group of every replica (plain ZeRO).
  int shard_group = 0;
  // When gradients are reduced (Piper extension "reduce_every"): once per step after the last
  // microbatch's backward ("step": Megatron-LM, DeepSpeed ZeRO-1, FSDP under no_sync, which keeps
  // the whole unsharded gradient until then), or after every microbatch's backward ("microbatch":
  // DeepSpeed ZeRO-2 and FSDP2's default, which keep only the gradient shard between microbatches).
  // Default: "microbatch" with shard_grads (ZeRO-2/3), "step" otherwise.
  bool reduce_every_microbatch = false;
  // ZeRO-3 "collective_copies" (Piper extension): which runtime's copies around the parameter gathers and
  // gradient reduce-scatters are costed. "fsdp2": PyTorch FSDP2's, on the compute stream: each gather's
  // copy-out of the gathered parameters (read and write them in the gathered dtype) before their first
  // use in F and in the backward, and each reduce-scatter's copy-in of the unsharded gradients into its
  // input (read them, write them in the reduction dtype) after BW, instead of Megatron-LM's fp32
  // main-grad accumulation (docs/cost-model.md "Copies around the ZeRO-3 collectives"). "none" (the
  // default): no such copies (FSDP1 gathers into the flat parameter its views read; DeepSpeed's ZeRO-3
  // has not been read for them; Piper's backends). Needs shard_params and reduce_every "microbatch".
  bool fsdp2_copies = false;
  std::string reduce_stream = "dp";
  std::string gather_stream;  // empty: same as reduce_stream
  friend bool operator==(const ReplicateDirective&, const ReplicateDirective&) = default;
};

struct ShardDirective {
  Filter filter;
  std::vector<int> devices;
  int degree = 0;  // Piper extension: shard over consecutive groups of `degree` devices (0 = all)
  std::string stream = "ep";
  // Piper extension: the dispatch and combine all-to-alls and the expert compute between them split
  // into this many chunks of tokens, so chunk i's experts overlap chunk i+1's dispatch (docs/compiler.md).
  int chunks = 1;
  // Piper extension: "fp8" moves the all-to-alls toward the experts (the forward's dispatch and the
  // backward's gradient of the combine) as e4m3 values with one fp32 scale per 128 (DeepSeek-V3's
  // low-precision communication; needs fp8 training); "" (or "activation") the activations' dtype.
  std::string dispatch_dtype;
  friend bool operator==(const ShardDirective&, const ShardDirective&) = default;
};

struct SplitDirective {
  Filter filter;
  std::string dim_name = "MB";
  int count = 1;  // "num_microbatches" in the published format
  friend bool operator==(const SplitDirective&, const SplitDirective&) = default;
};

struct OrderDirective {
  std::vector<std::vector<Filter>> groups;  // groups run in sequence; filters within a group may interleave
  friend bool operator==(const OrderDirective&, const OrderDirective&) = default;
};

// Piper extension: Megatron tensor parallelism of the selected segments over consecutive groups of
// `degree` devices of their placement, optionally with sequence parallelism. Routed-expert segments
// keep expert parallelism and are left alone.
struct TensorParallelDirective {
  Filter filter;
  std::vector<int> devices;  // optional: when given, must equal the placement
  int degree = 1;
  bool sequence_parallel = false;
  // Piper extension "comm_overlap": the TP collectives run chunk by chunk under the GEMMs that produce
  // or consume them (Megatron-LM's --tp-comm-overlap, TorchTitan's async TP) instead of between them.
  bool comm_overlap = false;
  // Piper extension "expert_degree" (Megatron-core's --expert-tensor-parallel-size): the selected
  // routed-expert segments split each expert's FFN over consecutive groups of this many devices
  // (fc1 column-, fc2 row-parallel). 1 (default): experts stay whole and keep only EP.
  int expert_degree = 1;
  friend bool operator==(const TensorParallelDirective&, const TensorParallelDirective&) = default;
};

// Piper extension: activation recomputation of the selected segments.
// Block selection (the compiler then makes each transformer block a segment of its own, tag BLK, as
// ZeRO-3's block gather unit does): "every": K keeps only the blocks b of the selection with
// (b + 1) % K == 0 (TorchTitan's ac_freq: every K-th block, the first at K - 1); "first": N keeps the
// first N blocks of the selection (Megatron's --recompute-method block --recompute-num-layers N, with
// one directive per pipeline stage). Embedding, final norm and head belong to no block: never selected.
struct RecomputeDirective {
  Filter filter;
  Recompute mode = Recompute::None;
  int every = 0;  // 0: every selected segment
  int first = 0;  // 0: every selected segment
  bool selects_blocks() const {
    return every > 0 || first > 0 || filter.exact.contains("BLK") ||
           std::find(filter.any.begin(), filter.any.end(), "BLK") != filter.any.end();
  }
  friend bool operator==(const RecomputeDirective&, const RecomputeDirective&) = default;
};

// Piper extension: a static split of every GPU's SMs, `sms` for the communication streams and the rest
// for compute (core::SmPartition). At most one per program; the SM count is checked against the
// cluster by the simulator and against the GPU by the CUDA backend, which know them.
struct SmPartitionDirective {
  SmPartition partition;
  friend bool operator==(const SmPartitionDirective&, const SmPartitionDirective&) = default;
};

// Piper extension: context parallelism of the whole model (Megatron-LM's --context-parallel-size). Each
// region's placement is cut into CP groups of `degree` devices (TP innermost, then CP: with TP degree
// t, CP rank c of a group is device set[b·t·degree + c·t + k]); every device holds seq_len / degree
// tokens of each sequence (the load-balanced causal chunks i and 2·degree-1-i), and attention
// exchanges K/V over the group: around a ring (`comm` "ring", default) or by an all-gather
// ("all_gather", with a reduce-scatter of dK/dV in the backward). At most one per program.
struct ContextParallelDirective {
  int degree = 1;
  bool all_gather = false;
  friend bool operator==(const ContextParallelDirective&, const ContextParallelDirective&) = default;
};

// Gradient clipping by global norm (Megatron-LM's --clip-grad, TorchTitan's max_norm,
// torch.nn.utils.clip_grad_norm_): before any update of the step, every device adds the squares of
// the gradients it owns and one all-reduce over every device (family purpose "grad-norm") gives the
// global norm; every update scales its gradients by min(1, max_norm / (norm + 1e-6)). The all-reduce
// waits for every gradient reduction of the step and every update waits for it, as in the
// frameworks, whose optimizer step follows the whole backward. At most one per program.
struct ClipGradDirective {
  double max_norm = 1.0;
  friend bool operator==(const ClipGradDirective&, const ClipGradDirective&) = default;
};

using Directive = std::variant<PlaceDirective, ReplicateDirective, ShardDirective, SplitDirective, OrderDirective,
                               TensorParallelDirective, RecomputeDirective, SmPartitionDirective,
                               ContextParallelDirective, ClipGradDirective>;

// The typed directive program: what the passes apply and what front ends build (ProgramBuilder,
// program_builder.hpp), combine and edit (the members below), never as raw JSON. `source` is each
// directive's JSON form: as read (parse_directives), or as the builder wrote it (its one serializer);
// to_json() is that form, for files, dumps and errors.
struct DirectiveProgram {
  std::vector<Directive> directives;
  std::vector<nlohmann::json> source;  // the JSON form of each directive, for files, dumps and errors
  nlohmann::json to_json() const;
  std::size_t size() const { return directives.size(); }
  // Another program's directives after this one's, in order.
  DirectiveProgram& append(const DirectiveProgram& other);
  // Every device id d of every directive (place, replicate, shard, tensor_parallel) becomes map(d): the
  // same program on other devices. The JSON form changes with the typed directives.
  DirectiveProgram& relabel_devices(const std::function<int(int)>& map);
  // Drops the directives `drop` selects, their JSON form with them.
  DirectiveProgram& remove_if(const std::function<bool(const Directive&)>& drop);
};

// Parse a directive program. Errors name the directive index and field (DirectiveError).
DirectiveProgram parse_directives(const nlohmann::json& program);
// A built program checked as a read one is: its JSON form parsed (the parser's checks and field-level
// errors, DirectiveError naming the directive's index in `program`).
DirectiveProgram validated(const DirectiveProgram& program);
DirectiveProgram load_directives_file(const std::string& path);  // errors prefixed with the path
std::string op_name(const Directive& d);                         // "place", "replicate", ...

// Called after every pass that changed the DAG, with the pass's name (pass_names()) and its
// directive's index (-1 for an internal pass), so --dump-after can write the DAG.
using AfterPassHook = std::function<void(const std::string& op, int index, const GlobalDag& dag)>;

// The passes' names in the order they run (internal ones included).
std::vector<std::string> pass_names();

// Apply a program to a freshly built DAG. Validates each directive against the DAG; verifies the
// DAG after each pass; throws DirectiveError without touching `dag` when anything is wrong
// (the passes work on a copy that replaces `dag` only on success).
void apply_directives(GlobalDag& dag, const DirectiveProgram& program, const AfterPassHook& hook = {});

}  // namespace piper::core
