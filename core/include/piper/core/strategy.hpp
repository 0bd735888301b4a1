// Strategy generator: turns parallelism knobs (--pp/--dp/--ep/--zero/--schedule/--microbatches) into a
// directive program. Each schedule family is one function emitting split + order directives; adding
// a family is adding one entry to schedule_registry().
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/directives.hpp"

namespace piper::core {

// Per-region costs for the cost-aware schedule families (zb-auto): seconds of one microbatch's F, BI
// (input gradient) and BW (weight gradient) per PP region, of one pipeline transfer, and the bytes of
// activations one microbatch keeps alive in each region. The simulator fills them from its cost model
// (sim::measure_stage_costs); empty vectors: unit costs (F = BI = BW = 1, transfers free) and no byte
// sizes.
struct StageCosts {
  std::vector<double> forward, input_grad, weight_grad;
  double transfer = 0;
  std::vector<double> activation_bytes;
  friend bool operator==(const StageCosts&, const StageCosts&) = default;
};

// The strategy settings: one member per line of strategy_settings.def (the settings table, whose
// names, help, ranges and defaults every front end uses; see settings.hpp).
struct StrategyOptions {
#define PIPER_STRATEGY_SETTING(type, member, name, default_value, ...) type member = default_value;
#include "piper/core/strategy_settings.def"
#undef PIPER_STRATEGY_SETTING
  // Logical stream names written into the directives. Parameters (not constants) so that programs
  // can match other tools' naming, e.g. the published fixtures' "pp_stream"/"dp_stream".
  std::string pp_stream = "pp";  // place: point-to-point transfers between pipeline ranks
  std::string dp_stream = "dp";  // replicate: gradient reduction and (ZeRO-3) parameter gathers
  std::string ep_stream = "ep";  // shard: expert all-to-all
  StageCosts stage_costs;        // cost-aware schedules only (not a setting: measured, see StageCosts)
  friend bool operator==(const StrategyOptions&, const StrategyOptions&) = default;
};

// Checks the knobs (pp, dp, ep, etp >= 1, (dp x tp) % (ep x etp) == 0, zero in 0..3, microbatches >= 1,
// virtual_stages >= 1, bucket_mb >= 0). Throws std::invalid_argument with one line naming the flag.
void validate_strategy_options(const StrategyOptions& o);

// --global-batch N: microbatches = N / (micro_batch_size * dp); throws std::invalid_argument naming
// the flag when it does not divide. No-op when global_batch is 0.
void resolve_global_batch(StrategyOptions& o, std::int64_t micro_batch_size);

// What a schedule generator needs to know: how PP regions map to ranks and the microbatch count.
struct ScheduleContext {
  int ranks = 1;    // pipeline ranks (pp)
  int regions = 1;  // PP regions of the model
  int microbatches = 1;
  int virtual_stages = 1;
  std::vector<int> rank_of_region;  // region -> pipeline rank
  bool mirrored = false;            // each region also lives on rank ranks-1-r (see ScheduleFamily)
  std::string memory_limit = "1p";  // zb-auto: --zb-memory-limit
  StageCosts costs;                 // cost-aware families: StrategyOptions::stage_costs
  // V placements: region 0 holds only the embedding / the last region only the final norm + head +
  // loss, as regions of their own on any rank; the family's shape applies to the regions between.
  bool own_embedding = false;
  bool own_head = false;
};

// One compute action of a schedule, named as PyTorch's torch.distributed.pipelining names them:
// stage (PP region), kind, microbatch. I is the input-gradient half of B (BI), W the weight half (BW).
enum class ActionKind { F, B, I, W };
char to_char(ActionKind k);
struct ScheduleAction {
  int stage = 0;
  ActionKind kind = ActionKind::F;
  int microbatch = 0;
  friend bool operator==(const ScheduleAction&, const ScheduleAction&) = default;
};
// One slot of a rank's order: one action, or two overlapped ones (an F&B pair, as in DualPipe).
using ScheduleStep = std::vector<ScheduleAction>;
// A schedule in its published form: per pipeline rank, the total order of its compute steps
// (PyTorch's compute-only `pipeline_order`). Directives and the PyTorch CSV are both derived from it.
struct ScheduleTable {
  int stages = 0;        // PP regions
  int microbatches = 0;  // microbatch copies in the DAG (a mirrored family runs each on both copies)
  std::vector<std::vector<ScheduleStep>> ranks;
};

struct ScheduleFamily {
  std::string name;
  std::string constraints;                                                         // one line, for `schedule list`
  std::function<int(const StrategyOptions&)> regions;                              // PP regions it needs for pp ranks
  std::function<std::vector<int>(const StrategyOptions&, int regions)> placement;  // region -> rank
  // Emits the split + order directives (typed, through ProgramBuilder). Throws std::invalid_argument
  // on unmet constraints with a one-line reason.
  std::function<DirectiveProgram(const ScheduleContext&)> directives;
  // The per-rank step order (for `schedule show`, CSV export). Throws std::invalid_argument when the
  // placement has no single per-rank order (e.g. 1F1B with several regions per rank).
  std::function<ScheduleTable(const ScheduleContext&)> table;
  // Mirrored (DualPipe): the model exists twice; region r lives on rank placement(r) for the first
  // copy and on rank pp-1-placement(r) for the second, as a data-parallel pair whose gradients are
  // reduced together. The split count is microbatches/2: each DAG microbatch runs once on each copy.
  bool mirrored = false;
  // Cost-aware (zb-auto): the order depends on ScheduleContext::costs, which the simulator measures
  // with its cost model before compiling the schedule (sim::simulate; elsewhere unit costs).
  bool cost_aware = false;
  // Accepts the embedding and the head as regions of their own (--v-embedding, --v-head; the
  // ScheduleContext's own_embedding / own_head): the V placements.
  bool own_ends = false;
  // Overlaps one microbatch's expert all-to-alls with another's compute (interleaved-1f1b-overlap):
  // valid for any model, worth trying only with expert parallelism, so `tune` skips it below --ep 2.
  bool expert_overlap = false;
};

const std::vector<ScheduleFamily>& schedule_registry();
const ScheduleFamily& schedule_family(const std::string& name);  // throws std::invalid_argument

// Devices: pipeline rank r, data-parallel rank d, context-parallel rank c, tensor-parallel rank k ->
// a device number by --device-order (innermost first). TP groups are consecutive devices (inside a
// node), CP next (Megatron's tp-cp order); then
//   tp-cp-pp-dp (the default): device k + tp * (c + cp * (r + d * pp)), a replica's pipeline ranks
//     adjacent, data-parallel ranks outermost;
//   tp-cp-dp-pp (Megatron-LM's default): device k + tp * (c + cp * (d + dp * r)), a pipeline rank's
//     replicas (and so its expert groups) on consecutive devices, pipeline ranks outermost.
int device_of(const StrategyOptions& o, int k, int c, int r, int d);
// The inverse of device_of for a device below pp x dp x cp x tp: its ranks {k, c, r, d}.
struct DeviceRanks {
  int k = 0, c = 0, r = 0, d = 0;
  friend bool operator==(const DeviceRanks&, const DeviceRanks&) = default;
};
DeviceRanks ranks_of_device(const StrategyOptions& o, int device);
// The devices of pipeline rank r, listed d-major, then c, then k (device_of each).
std::vector<int> devices_of_rank(const StrategyOptions& o, int rank);
// Placement, replicate and shard directives for `regions` PP regions.
// With `mirrored`, region i is placed on the devices of rank_of_region[i] followed by those of rank
// pp-1-rank_of_region[i] (a data-parallel pair; see ScheduleFamily::mirrored).
// The programs below are typed and not yet checked by the parser (validated(), directives.hpp).
DirectiveProgram placement_directives(const StrategyOptions& o, const std::vector<int>& rank_of_region,
                                      bool mirrored = false);
// The full program: placement + replication + sharding + the schedule's split/order.
DirectiveProgram generate_program(const StrategyOptions& o);
// Split/order of a schedule for a placement-only program with `regions` regions placed as given;
// `own_embedding` / `own_head`: its first / last region holds only the embedding / the head (a place
// directive's "holds"). --v-embedding / --v-head in `o` say the same.
DirectiveProgram schedule_directives(const StrategyOptions& o, const std::vector<int>& rank_of_region,
                                     bool own_embedding = false, bool own_head = false);
// --v-head / --v-embedding: -1 when empty (the end stays in the V), else the pipeline rank. Throws
// std::invalid_argument naming the flag for "auto" (resolved with the model's costs, see
// scenario.hpp's resolve_v_ends) and for anything that is not a rank of --pp.
int own_end_rank(const StrategyOptions& o, bool head);
// Reads the region -> pipeline-rank map of a placement-only program, for appending a schedule.
// Each distinct device list of the `place {PP:i}` directives is one pipeline rank, numbered in
// increasing region order (so region 0 is on rank 0). Sets *pipeline_ranks (if not null).
// Throws std::invalid_argument if the program already has split/order directives, has no such place
// directives, or its PP regions are not 0..n-1 each placed once. Sets *own_embedding / *own_head (if
// not null) when region 0 / the last region is placed with "holds": "embedding" / "head".
std::vector<int> rank_of_region_from_program(const DirectiveProgram& program, int* pipeline_ranks,
                                             bool* own_embedding = nullptr, bool* own_head = nullptr);

// The step time of `table` when each rank runs its steps in order as soon as their inputs are ready
// (F(s) after F(s-1); B or I(s) after F(s) and B or I(s+1); W(s) after I(s); an overlapped pair
// after both, for the sum), communication free; stage_cost[s] = the times of F, I and W (B = I + W).
double schedule_makespan(const ScheduleTable& table, const std::vector<std::array<double, 3>>& stage_cost);

// The per-rank step order of a schedule for the knobs (its own regions and placement).
ScheduleTable schedule_table(const StrategyOptions& o);
// Split + one order per pipeline rank (overlapped steps become two-filter groups; I/W become
// PASS BI/BW). `split_count` microbatches; rank r's steps must name only regions placed on rank r
// (or, `mirrored`, on rank ranks-1-r). A rank repeating an earlier rank's steps gets no order of its own.
DirectiveProgram directives_from_table(const ScheduleTable& table, const std::vector<int>& rank_of_region,
                                       int split_count, bool mirrored = false);

}  // namespace piper::core
