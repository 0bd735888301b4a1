// Strategy generator: turns parallelism knobs into place/replicate/shard directives and delegates the
// split/order part to a schedule family looked up by name in the registry (schedules.cpp).
#include "piper/core/strategy.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "piper/core/directives.hpp"
#include "piper/core/limits.hpp"
#include "piper/core/program_builder.hpp"
#include "piper/core/settings.hpp"

namespace piper::core {
namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument(message); }

std::string num(double v) {
  std::string s = std::to_string(v);
  s.erase(s.find_last_not_of('0') + 1);
  if (!s.empty() && s.back() == '.') s.pop_back();
  return s;
}

void check_placement(const StrategyOptions& o, const std::vector<int>& rank_of_region) {
  if (rank_of_region.empty()) fail("placement has no PP regions");
  for (size_t i = 0; i < rank_of_region.size(); ++i)
    if (rank_of_region[i] < 0 || rank_of_region[i] >= o.pp)
      fail("region PP " + std::to_string(i) + " is placed on rank " + std::to_string(rank_of_region[i]) +
           ", outside --pp " + std::to_string(o.pp));
}

// --v-head / --v-embedding only where the family takes them (the V placements); --zb-memory-limit only
// for the cost-aware family, whose scheduler it bounds (elsewhere it would be ignored).
void check_own_ends(const StrategyOptions& o, const ScheduleFamily& family) {
  if (!family.cost_aware && o.zb_memory_limit != StrategyOptions{}.zb_memory_limit)
    fail("--zb-memory-limit applies only to --schedule zb-auto (its scheduler's memory limit), not --schedule " +
         family.name);
  if (family.own_ends) return;
  if (!o.v_head.empty()) fail("--v-head applies only to V placements (zb-v, dualpipev), not --schedule " + family.name);
  if (!o.v_embedding.empty())
    fail("--v-embedding applies only to V placements (zb-v, dualpipev), not --schedule " + family.name);
}

}  // namespace

int device_of(const StrategyOptions& o, int k, int c, int r, int d) {
  const int block = o.device_order == "tp-cp-dp-pp" ? d + o.dp * r : r + d * o.pp;  // the tp x cp block
  return k + o.tp * (c + o.cp * block);
}

DeviceRanks ranks_of_device(const StrategyOptions& o, int device) {
  DeviceRanks x;
  x.k = device % o.tp;
  x.c = device / o.tp % o.cp;
  const int block = device / (o.tp * o.cp);
  if (o.device_order == "tp-cp-dp-pp") {
    x.d = block % o.dp;
    x.r = block / o.dp;
  } else {
    x.r = block % o.pp;
    x.d = block / o.pp;
  }
  return x;
}

// d-major, then c, then k: each TP group consecutive in the list, CP groups blocks of tp x cp entries
// (the context_parallel pass and the verifier read them so), in either device order.
std::vector<int> devices_of_rank(const StrategyOptions& o, int rank) {
  std::vector<int> devices;
  for (int d = 0; d < o.dp; ++d)
    for (int c = 0; c < o.cp; ++c)
      for (int k = 0; k < o.tp; ++k) devices.push_back(device_of(o, k, c, rank, d));
  return devices;
}

int own_end_rank(const StrategyOptions& o, bool head) {
  const std::string& v = head ? o.v_head : o.v_embedding;
  const std::string flag = head ? "--v-head" : "--v-embedding";
  if (v.empty()) return -1;
  if (v == "auto")
    fail(flag + " auto chooses with the model's costs: give --model (piper simulate/compile/directives)");
  if (head && v == "alone") {
    if (o.pp < 2) fail("--v-head alone needs --pp 2 or more (the head takes the last rank, the V the others)");
    return o.pp - 1;
  }
  const bool digits = v.size() <= 9 && std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; });
  const int rank = digits ? std::stoi(v) : -1;
  if (rank < 0 || rank >= o.pp)
    fail(flag + " must be " + (head ? "auto, alone" : "auto") + " or a pipeline rank 0.." + std::to_string(o.pp - 1) +
         " (got '" + v + "')");
  return rank;
}

void validate_strategy_options(const StrategyOptions& o) {
  auto at_least_one = [](const char* flag, int v) {
    if (v < 1) fail(std::string(flag) + " must be >= 1 (got " + std::to_string(v) + ")");
  };
  at_least_one("--pp", o.pp);
  at_least_one("--dp", o.dp);
  at_least_one("--ep", o.ep);
  at_least_one("--microbatches", o.microbatches);
  at_least_one("--tp", o.tp);
  at_least_one("--cp", o.cp);
  if (o.cp_all_gather && o.cp < 2) fail("--cp-all-gather needs --cp >= 2");
  at_least_one("--etp", o.etp);
  if (o.sequence_parallel && o.tp < 2) fail("--sequence-parallel needs --tp >= 2");
  if (o.tp_comm_overlap && o.tp < 2) fail("--tp-comm-overlap needs --tp >= 2");
  if (o.tp_comm_overlap && !o.sequence_parallel)
    fail(
        "--tp-comm-overlap needs --sequence-parallel (the overlap splits SP's all-gathers and reduce-scatters around "
        "the GEMMs; without SP, TP all-reduces, which Megatron-LM and TorchTitan do not overlap)");
  if (o.recompute == "auto")
    fail(
        "--recompute auto is chosen by the simulator's memory model: use it with piper simulate and --memory-budget "
        "GiB");
  if (o.recompute != "none" && o.recompute != "selective" && o.recompute != "full" && o.recompute != "op")
    fail("--recompute must be none, selective, full or op (got '" + o.recompute + "')");
  if (o.recompute_every < 0) fail("--recompute-every must be >= 1 (got " + std::to_string(o.recompute_every) + ")");
  if (o.recompute_first < 0) fail("--recompute-first must be >= 1 (got " + std::to_string(o.recompute_first) + ")");
  if (o.recompute_every > 0 && o.recompute_first > 0)
    fail("--recompute-every and --recompute-first cannot be combined (choose one block selection)");
  if ((o.recompute_every > 0 || o.recompute_first > 0) && o.recompute == "none")
    fail(std::string(o.recompute_every > 0 ? "--recompute-every" : "--recompute-first") +
         " needs --recompute selective, full or op (the mode of the chosen blocks)");
  if (o.a2a_chunks < 1) fail("--a2a-chunks must be >= 1 (got " + std::to_string(o.a2a_chunks) + ")");
  if (o.a2a_chunks > 1 && o.ep < 2) fail("--a2a-chunks needs --ep >= 2 (it chunks the expert all-to-alls)");
  if (o.fp8_dispatch && o.ep < 2) fail("--fp8-dispatch needs --ep >= 2 (it sets the dtype of the expert all-to-alls)");
  if (o.comm_sms < 0) fail("--comm-sms must be >= 1 (got " + std::to_string(o.comm_sms) + ")");
  if (!(o.clip_grad >= 0) || !std::isfinite(o.clip_grad))
    fail("--clip-grad must be a positive norm (got " + std::to_string(o.clip_grad) + ")");
  if (o.global_batch < 0) fail("--global-batch must be >= 1 (got " + std::to_string(o.global_batch) + ")");
  at_least_one("--virtual-stages", o.virtual_stages);
  // Resource limits (limits.hpp), before any generator loops over ranks, regions or microbatches.
  check_limit(Limit::Microbatches, o.microbatches, "--microbatches", "microbatches");
  check_limit(Limit::Devices, static_cast<std::int64_t>(o.pp) * o.dp * o.cp, "--pp x --dp x --cp", "devices");
  check_limit(Limit::Layers, static_cast<std::int64_t>(o.pp) * o.virtual_stages, "--pp x --virtual", "PP regions");
  // Megatron-core's rule: a stage's dp x cp x tp devices hold the experts as ETP x EP x expert-DP groups
  // (EP groups may span DP and CP ranks: experts are token-local, each device routes its own tokens).
  if ((static_cast<std::int64_t>(o.dp) * o.cp * o.tp) % (static_cast<std::int64_t>(o.ep) * o.etp) != 0) {
    if (o.tp == 1 && o.etp == 1 && o.cp == 1)
      fail("--ep " + std::to_string(o.ep) + " must divide --dp " + std::to_string(o.dp));
    fail("--ep " + std::to_string(o.ep) + " x --etp " + std::to_string(o.etp) + " must divide --dp " +
         std::to_string(o.dp) + (o.cp > 1 ? " x --cp " + std::to_string(o.cp) : "") + " x --tp " +
         std::to_string(o.tp) + " (a stage's devices hold the experts as ETP x EP x expert-data-parallel groups)");
  }
  if (o.zero < 0 || o.zero > 3) fail("--zero must be 0, 1, 2 or 3 (got " + std::to_string(o.zero) + ")");
  if (o.dp_shard != 0) {
    if (o.zero < 1) fail("--dp-shard needs --zero 1, 2 or 3 (it groups the ZeRO shards)");
    if (o.dp_shard < 2 || o.dp % o.dp_shard != 0)
      fail("--dp-shard " + std::to_string(o.dp_shard) + " must be at least 2 and divide --dp " + std::to_string(o.dp));
  }
  if (!o.reduce_every.empty() && o.reduce_every != "step" && o.reduce_every != "microbatch")
    fail("--reduce-every must be step or microbatch (got '" + o.reduce_every + "')");
  if (o.fp8_all_gather && o.zero != 3)
    fail("--fp8-all-gather applies only with --zero 3 (its per-use parameter gathers)");
  if (!o.collective_copies.empty() && o.zero != 3)
    fail("--collective-copies applies only with --zero 3 (the copies around its per-use parameter gathers)");
  if (!o.collective_copies.empty() && o.reduce_every == "step")
    fail("--collective-copies fsdp2 is modelled with --reduce-every microbatch only (FSDP2's default)");
  if (o.gather_prefetch != 1 && o.zero != 3)
    fail("--gather-prefetch applies only with --zero 3 (its per-use parameter gathers)");
  for (bool head : {true, false})
    if (const std::string& v = head ? o.v_head : o.v_embedding; !v.empty() && v != "auto") own_end_rank(o, head);
  if (o.p2p_blocking && o.pp < 2) fail("--p2p-blocking applies only with --pp 2 or more (its pipeline transfers)");
  if (!o.reduce_every.empty() && o.zero < 2)
    fail("--reduce-every applies to --zero 2 and 3 (ZeRO-0/1 reduce once per step)");
  if (!(o.bucket_mb >= 0) || !std::isfinite(o.bucket_mb) || o.bucket_mb > 1e9)  // bytes must fit in int64
    fail("--bucket-mb must be a number in [0, 1e9] (got " + num(o.bucket_mb) + ")");
  // Every setting's own type and range, from the table (settings.hpp); the rules above say more.
  for (const auto& s : strategy_settings())
    if (s.name == "schedule")
      continue;  // schedule_family names the valid ones
    else if (const std::string why = setting_problem(s, setting_value(s, o)); !why.empty())
      fail(setting_flag(s) + ": " + why);
}

void resolve_global_batch(StrategyOptions& o, std::int64_t micro_batch_size) {
  if (o.global_batch <= 0) return;
  const std::int64_t per_microbatch = micro_batch_size * o.dp;
  if (per_microbatch <= 0 || o.global_batch % per_microbatch != 0)
    fail("--global-batch " + std::to_string(o.global_batch) + " is not divisible by micro-batch size " +
         std::to_string(micro_batch_size) + " x --dp " + std::to_string(o.dp));
  o.microbatches = static_cast<int>(o.global_batch / per_microbatch);
}

const ScheduleFamily& schedule_family(const std::string& name) {
  const auto& registry = schedule_registry();
  for (const auto& family : registry)
    if (family.name == name) return family;
  std::string valid;
  for (const auto& family : registry) valid += (valid.empty() ? "" : ", ") + family.name;
  fail("--schedule '" + name + "' is unknown; valid schedules: " + valid);
}

DirectiveProgram placement_directives(const StrategyOptions& o, const std::vector<int>& rank_of_region, bool mirrored) {
  validate_strategy_options(o);
  check_placement(o, rank_of_region);
  const int regions = static_cast<int>(rank_of_region.size());
  auto devices_of_region = [&](int i) {
    const int rank = rank_of_region[static_cast<size_t>(i)];
    std::vector<int> devices = devices_of_rank(o, rank);
    // The mirrored copy: a data-parallel replica of the region on the opposite pipeline rank.
    if (mirrored)
      for (int d : devices_of_rank(o, o.pp - 1 - rank)) devices.push_back(d);
    return devices;
  };
  const int replicas = o.dp * o.cp * o.tp * (mirrored ? 2 : 1);  // devices per region
  // A segment's CP groups are cut from blocks of its TP degree x CP devices (TP innermost), and a routed
  // expert's TP degree is --etp: `--cp 2 --etp 2` on 2 devices failed in the cp-groups pass, naming a
  // "TP 2" that was never given.
  if (o.cp > 1 && o.etp > 1 && replicas % (o.etp * o.cp) != 0)
    fail("--etp " + std::to_string(o.etp) + " with --cp " + std::to_string(o.cp) +
         ": --etp x --cp = " + std::to_string(o.etp * o.cp) + " must divide the " + std::to_string(replicas) +
         " devices of a pipeline region (--dp x --cp x --tp): an expert's tensor-parallel group cannot span its "
         "context-parallel ranks (give --dp or --tp a multiple of --etp)");
  ProgramBuilder out;
  // Directive order follows the published programs: all place, then all replicate, then all shard.
  // With one pipeline rank there are no point-to-point transfers, so no stream (as in dp2.json).
  // The ends as regions of their own (--v-embedding, --v-head) say so with "holds".
  for (int i = 0; i < regions; ++i) {
    const char* holds = i == 0 && !o.v_embedding.empty()        ? "embedding"
                        : i == regions - 1 && !o.v_head.empty() ? "head"
                                                                : "";
    out.place(region_filter(i), devices_of_region(i), o.pp > 1 ? std::optional(o.pp_stream) : std::nullopt,
              o.p2p_blocking, holds);
  }
  // Dense layers have replicas / tp data-parallel copies; routed experts replicas / (ep x etp).
  if (replicas / o.tp > 1 || replicas / (o.ep * o.etp) > 1) {
    ReplicateArgs rep;
    rep.reduce_stream = o.dp_stream;
    if (o.bucket_mb > 0) rep.bucket_size_mb = o.bucket_mb;
    rep.shard_optimizer = o.zero == 1;
    rep.shard_grads = o.zero >= 2;
    if (o.zero == 3) {
      rep.shard_params = true;
      rep.gather_stream = o.dp_stream;
      rep.gather_unit = "block";  // FSDP's unit: one transformer block
      if (o.fp8_all_gather) rep.gather_dtype = "fp8";
      if (o.gather_prefetch != 1) rep.prefetch = o.gather_prefetch;
      if (!o.collective_copies.empty()) rep.collective_copies = o.collective_copies;
    }
    // A shard group is dp_shard data-parallel replicas with their CP ranks (consecutive in the region's
    // devices, CP inside DP), as TorchTitan's dp_shard x cp mesh: a group of dp_shard consecutive
    // replicas was the CP ranks of one replica, so `--cp 2 --dp 2 --dp-shard 2` sharded over CP and
    // replicated over DP (each device 1/2 of the state, where plain ZeRO over DP x CP keeps 1/4).
    if (o.dp_shard > 1 && o.dp_shard * o.cp < replicas / o.tp) rep.shard_group = o.dp_shard * o.cp;
    if (o.zero >= 2 && !o.reduce_every.empty()) rep.reduce_every = o.reduce_every;
    for (int i = 0; i < regions; ++i) out.replicate(region_filter(i), devices_of_region(i), rep);
  }
  // Experts sharded over consecutive groups of ep of the replicas (Piper extension).
  if (o.ep > 1)
    for (int i = 0; i < regions; ++i)
      out.shard(region_filter(i, "EP"), devices_of_region(i), o.ep_stream,
                o.ep < replicas ? std::optional(o.ep) : std::nullopt,
                o.a2a_chunks > 1 ? std::optional(o.a2a_chunks) : std::nullopt,
                o.fp8_dispatch ? std::optional<std::string>("fp8") : std::nullopt);
  // Piper extensions: tensor (and sequence) parallelism and recomputation of every region.
  if (o.tp > 1 || o.etp > 1)
    for (int i = 0; i < regions; ++i)
      out.tensor_parallel(region_filter(i), o.tp, o.sequence_parallel, o.tp_comm_overlap, o.etp);
  if (o.recompute != "none")
    for (int i = 0; i < regions; ++i)
      out.recompute(region_filter(i), o.recompute, o.recompute_every, o.recompute_first);
  if (o.cp > 1) out.context_parallel(o.cp, o.cp_all_gather);
  if (o.comm_sms > 0) out.sm_partition(o.comm_sms);
  if (o.clip_grad > 0) out.clip_grad(o.clip_grad);
  return out.take();
}

DirectiveProgram schedule_directives(const StrategyOptions& o, const std::vector<int>& rank_of_region,
                                     bool own_embedding, bool own_head) {
  validate_strategy_options(o);
  const ScheduleFamily& family = schedule_family(o.schedule);
  check_own_ends(o, family);
  ScheduleContext ctx;
  ctx.own_embedding = own_embedding || !o.v_embedding.empty();
  ctx.own_head = own_head || !o.v_head.empty();
  if (!family.own_ends && (ctx.own_embedding || ctx.own_head))
    fail("--schedule " + family.name + " cannot order a program whose " + (ctx.own_head ? "head" : "embedding") +
         " is a region of its own (\"holds\"); use a V placement (zb-v, dualpipev)");
  ctx.ranks = o.pp;
  ctx.regions = static_cast<int>(rank_of_region.size());
  ctx.microbatches = o.microbatches;
  ctx.virtual_stages = o.virtual_stages;
  ctx.rank_of_region = rank_of_region;
  ctx.mirrored = family.mirrored;
  ctx.memory_limit = o.zb_memory_limit;
  ctx.costs = o.stage_costs;
  return family.directives(ctx);
}

DirectiveProgram generate_program(const StrategyOptions& o) {
  validate_strategy_options(o);
  const ScheduleFamily& family = schedule_family(o.schedule);
  check_own_ends(o, family);
  const int regions = family.regions(o);
  const std::vector<int> rank_of_region = family.placement(o, regions);
  DirectiveProgram program = placement_directives(o, rank_of_region, family.mirrored);
  return program.append(schedule_directives(o, rank_of_region));
}

ScheduleTable schedule_table(const StrategyOptions& o) {
  validate_strategy_options(o);
  const ScheduleFamily& family = schedule_family(o.schedule);
  check_own_ends(o, family);
  ScheduleContext ctx;
  ctx.own_embedding = !o.v_embedding.empty();
  ctx.own_head = !o.v_head.empty();
  ctx.ranks = o.pp;
  ctx.regions = family.regions(o);
  ctx.microbatches = o.microbatches;
  ctx.virtual_stages = o.virtual_stages;
  ctx.rank_of_region = family.placement(o, ctx.regions);
  ctx.mirrored = family.mirrored;
  ctx.memory_limit = o.zb_memory_limit;
  ctx.costs = o.stage_costs;
  return family.table(ctx);
}

std::vector<int> rank_of_region_from_program(const DirectiveProgram& program, int* pipeline_ranks, bool* own_embedding,
                                             bool* own_head) {
  std::map<int, std::string> holds;  // region -> "head" / "embedding"
  std::map<int, std::vector<int>> devices_of_region;
  for (size_t k = 0; k < program.directives.size(); ++k) {
    const Directive& d = program.directives[k];
    if (std::holds_alternative<SplitDirective>(d) || std::holds_alternative<OrderDirective>(d))
      fail("directive " + std::to_string(k) + ": program already has split/order directives; drop --schedule");
    const auto* place = std::get_if<PlaceDirective>(&d);
    if (place == nullptr) continue;
    const Filter& filter = place->filter;
    if (filter.exact.size() != 1 || !filter.exact.contains("PP") || !filter.any.empty() || filter.pass)
      continue;  // places of sub-regions (e.g. {PP:i, EP:j}) do not define a pipeline rank
    const int region = filter.exact.at("PP");
    if (!devices_of_region.emplace(region, place->devices).second)
      fail("directive " + std::to_string(k) + " field 'filter': region PP " + std::to_string(region) +
           " is placed twice");
    if (!place->holds.empty()) holds[region] = place->holds;
  }
  if (devices_of_region.empty()) fail("program has no place directives with filter {PP: i}; nothing to schedule");
  const int regions = static_cast<int>(devices_of_region.size());
  if (devices_of_region.rbegin()->first != regions - 1) {
    for (int i = 0; i < regions; ++i)
      if (!devices_of_region.count(i))
        fail("program places no region PP " + std::to_string(i) + "; PP regions must be 0..n-1");
  }
  // Ranks numbered by first appearance in region order, so region 0 sits on rank 0.
  std::vector<std::vector<int>> rank_devices;
  std::vector<int> rank_of_region;
  for (const auto& [region, devices] : devices_of_region) {
    int rank = -1;
    for (size_t r = 0; r < rank_devices.size(); ++r)
      if (rank_devices[r] == devices) rank = static_cast<int>(r);
    if (rank < 0) {
      rank = static_cast<int>(rank_devices.size());
      rank_devices.push_back(devices);
    }
    rank_of_region.push_back(rank);
  }
  if (pipeline_ranks) *pipeline_ranks = static_cast<int>(rank_devices.size());
  // Schedules take the ends as regions of their own only where they are (region 0, the last one).
  for (const auto& [region, what] : holds)
    if ((what == "embedding" && region != 0) || (what == "head" && region != regions - 1))
      fail("region PP " + std::to_string(region) + " holds the " + what + ", which must be region PP " +
           (what == "embedding" ? "0" : std::to_string(regions - 1)) + " (the " +
           (what == "embedding" ? "first" : "last") + " region)");
  if (own_embedding) *own_embedding = holds.count(0) && holds[0] == "embedding";
  if (own_head) *own_head = holds.count(regions - 1) && holds[regions - 1] == "head";
  return rank_of_region;
}

}  // namespace piper::core
