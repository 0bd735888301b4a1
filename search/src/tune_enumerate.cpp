// The tuner's enumeration: every legal strategy of a tune spec, from the schedule registry (a family
// is asked for its region count and its schedule at the candidate's knobs; what it refuses is not a
// candidate), never from schedule names.
#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "piper/core/limits.hpp"
#include "piper/core/model.hpp"
#include "piper/core/strategy.hpp"
#include "piper/search/results_csv.hpp"
#include "piper/search/tune.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "tune_internal.hpp"

namespace piper::search {

using namespace detail;

namespace {

// What enumeration reads besides the spec, each list checked once before the candidates are built.
struct Knobs {
  std::int64_t batch = 0;
  std::vector<const core::ScheduleFamily*> families;
  std::map<std::int64_t, core::ModelConfig> configs;
  core::ModelConfig cfg;  // the first micro batch size's
  int units = 0;
  std::vector<std::string> recompute_modes;
  std::vector<bool> sp_modes;
  int node_gpus = 0;
  std::vector<int> comm_sms, dp_shards, etps, cps;
  std::vector<std::string> reduce_modes;
  std::map<int, std::vector<bool>> sp_of_tp;  // accepted TP degree -> its sequence-parallel modes
};

// The schedule families, the model at each micro batch size, the recompute and SP modes.
void read_model_knobs(const TuneSpec& spec, Knobs& k) {
  k.batch = spec.effective_global_batch();
  for (const auto& f : core::schedule_registry())
    if (spec.schedules.empty() ||
        std::find(spec.schedules.begin(), spec.schedules.end(), f.name) != spec.schedules.end())
      k.families.push_back(&f);
  for (const auto& name : spec.schedules) {
    try {
      core::schedule_family(name);
    } catch (const std::invalid_argument& e) {
      std::string m = e.what();  // "--schedule 'x' is unknown": the flag here is --schedules
      if (m.rfind("--schedule ", 0) == 0) m.insert(std::string("--schedule").size(), "s");
      throw TuneError(m);
    }
  }
  for (auto mbs : spec.micro_batch_sizes) {
    if (mbs < 1) throw TuneError(fmt::format("--micro-batch-size must be >= 1 (got {})", mbs));
    try {
      k.configs[mbs] = model_config(spec, mbs);
    } catch (const core::Error& e) {
      throw TuneError(e.what());
    }
  }
  k.cfg = k.configs.begin()->second;
  k.units = pipeline_units(k.cfg);
  k.recompute_modes = spec.recompute_modes;
  for (const auto& m : k.recompute_modes)
    if (recompute_level(m) < 0)
      throw TuneError(fmt::format("--recompute: unknown mode '{}' (expected none, selective, full or op)", m));
  std::sort(k.recompute_modes.begin(), k.recompute_modes.end(),
            [](const std::string& a, const std::string& b) { return recompute_level(a) < recompute_level(b); });
  k.recompute_modes.erase(std::unique(k.recompute_modes.begin(), k.recompute_modes.end()), k.recompute_modes.end());
  if (k.recompute_modes.empty()) k.recompute_modes = {"none"};
  k.sp_modes = spec.sequence_parallel;
  std::sort(k.sp_modes.begin(), k.sp_modes.end());
  k.sp_modes.erase(std::unique(k.sp_modes.begin(), k.sp_modes.end()), k.sp_modes.end());
  if (k.sp_modes.empty()) k.sp_modes = {false};
}

// The cluster's GPUs per node (TP groups stay inside one), SM partitions, HSDP groups, expert TP and
// the gradient reduction modes.
void read_cluster_knobs(const TuneSpec& spec, Knobs& k) {
  sim::Cluster cluster;
  try {
    cluster = sim::with_devices(sim::load_cluster(spec.cluster), spec.devices);
  } catch (const core::Error& e) {
    throw TuneError(e.what());
  }
  for (int d = 0; d < spec.devices; ++d) k.node_gpus = std::gcd(k.node_gpus, cluster.node(d).gpus_per_node);
  // SM partitions: the simulator's rule (at least one SM left for compute on every GPU, as `simulate
  // --comm-sms` checks) up front, in one line, rather than one invalid row per candidate.
  k.comm_sms = distinct_or(spec.comm_sms, {0});
  for (int sms : k.comm_sms) {
    if (sms < 0)
      throw TuneError(fmt::format("--comm-sms: {} is negative (0: SMs shared, N >= 1: N SMs for communication)", sms));
    if (sms == 0) continue;
    for (int d = 0; d < spec.devices; ++d)
      if (const std::string why = sim::sm_partition_misfit(sms, cluster.node(d).gpu, spec.cluster); !why.empty())
        throw TuneError(fmt::format("--comm-sms {}: {}", sms, why));
  }
  k.dp_shards = distinct_or(spec.dp_shards, {0});
  k.etps = distinct_or(spec.etp_degrees, {1});
  for (int e : k.etps)
    if (e < 1) throw TuneError(fmt::format("--etp must be >= 1 (got {})", e));
  k.reduce_modes = distinct_or(spec.reduce_every, {std::string("microbatch"), std::string("step")});
  for (const auto& re : k.reduce_modes)
    if (re != "microbatch" && re != "step")
      throw TuneError(fmt::format("--reduce-every: '{}' is not microbatch or step", re));
  for (int s : k.dp_shards)
    if (s < 0 || s == 1)
      throw TuneError(
          fmt::format("--dp-shard: {} is not a group size (0: plain ZeRO, N >= 2: HSDP over groups of N replicas)", s));
}

// TP degrees: TP groups are consecutive devices that must stay inside a node, so t divides the GPU
// count of every node (and the devices). What the model needs of t (heads, ffn columns, the sequence
// for SP) is asked of the compiler with a one-stage probe; KV heads are checked here because the
// Megatron layout the runtime executes splits them too, while the cost model does not need it.
void probe_tp_degrees(const TuneSpec& spec, Knobs& k, EnumerationStats& stats) {
  const std::vector<int> tps = distinct_or(spec.tp_degrees, divisors(std::gcd(k.node_gpus, spec.devices)));
  for (int t : tps) {
    if (t < 1) throw TuneError(fmt::format("--tp must be >= 1 (got {})", t));
    if (spec.devices % t != 0) {
      stats.tp_rejected.push_back(fmt::format("TP {}: does not divide the {} devices", t, spec.devices));
      continue;
    }
    if (k.node_gpus % t != 0) {
      stats.tp_rejected.push_back(
          fmt::format("TP {}: TP groups stay inside a node, and a node has {} GPUs", t, k.node_gpus));
      continue;
    }
    if (t > 1 && k.cfg.kv_heads > 0 && k.cfg.kv_heads % t != 0) {
      stats.tp_rejected.push_back(fmt::format("TP {}: does not divide the {} KV heads", t, k.cfg.kv_heads));
      continue;
    }
    for (bool sp : t == 1 ? std::vector<bool>{false} : k.sp_modes) {
      TuneCandidate probe;
      probe.tp = t;
      probe.sequence_parallel = sp;
      probe.schedule = core::schedule_registry().front().name;  // any family: one stage, one microbatch
      probe.micro_batch_size = k.configs.begin()->first;
      TuneSpec one = spec;
      one.devices = t;
      try {
        core::compile_scenario(tune_scenario(one, probe));
        k.sp_of_tp[t].push_back(sp);
      } catch (const core::Error& e) {
        stats.tp_rejected.push_back(fmt::format("TP {}{}: {}", t, sp ? " with SP" : "", one_line(e.what())));
      } catch (const std::invalid_argument& e) {
        stats.tp_rejected.push_back(fmt::format("TP {}{}: {}", t, sp ? " with SP" : "", one_line(e.what())));
      }
    }
    if (k.sp_of_tp.count(t)) stats.tp_degrees.push_back(t);
  }
}

bool pinned(const std::vector<int>& pins, int v) {
  return pins.empty() || std::find(pins.begin(), pins.end(), v) != pins.end();
}

// Pins (--pp, --dp, --ep): a degree that can never apply is an error, not an empty search.
void check_pins(const TuneSpec& spec, const core::ModelConfig& cfg) {
  for (const auto& [flag, pins] : {std::pair<const char*, const std::vector<int>*>{"--pp", &spec.pp_degrees},
                                   {"--dp", &spec.dp_degrees},
                                   {"--ep", &spec.ep_degrees}})
    for (int v : *pins) {
      if (v < 1) throw TuneError(fmt::format("{} must be >= 1 (got {})", flag, v));
      if (std::string(flag) != "--ep" && spec.devices % v != 0)
        throw TuneError(fmt::format("{} {}: does not divide the {} devices", flag, v, spec.devices));
      if (std::string(flag) == "--ep" && v > 1 && (cfg.experts <= 0 || cfg.experts % v != 0))
        throw TuneError(
            cfg.experts <= 0
                ? fmt::format("--ep {}: model '{}' has no MoE experts (use --ep 1)", v, cfg.name)
                : fmt::format("--ep {}: does not divide the {} experts of model '{}'", v, cfg.experts, cfg.name));
    }
}

// Context parallelism: the sequence must cut into 2·cp chunks (load-balanced causal CP).
void accept_cp_degrees(const TuneSpec& spec, Knobs& k, EnumerationStats& stats) {
  for (int cp : distinct_or(spec.cp_degrees, {1})) {
    if (cp < 1) throw TuneError(fmt::format("--cp must be >= 1 (got {})", cp));
    if (spec.devices % cp != 0)
      stats.cp_rejected.push_back(fmt::format("CP {}: does not divide the {} devices", cp, spec.devices));
    else if (cp > 1 && k.cfg.training.seq_len % (2 * cp) != 0)
      stats.cp_rejected.push_back(fmt::format("CP {}: the sequence length {} does not cut into {} equal chunks", cp,
                                              k.cfg.training.seq_len, 2 * cp));
    else
      k.cps.push_back(cp), stats.cp_degrees.push_back(cp);
  }
}

// Candidate c (degrees, family, regions fixed) at every SP, recompute, ZeRO, HSDP, reduction and SM
// partition choice. ZeRO levels differ only when a region has more than one data-parallel replica
// (CP ranks are replicas of the parameters too).
void add_knob_variants(const TuneSpec& spec, const Knobs& k, TuneCandidate c, const std::vector<bool>& sps,
                       int replicas, std::vector<TuneCandidate>& out) {
  for (bool sp : sps)
    for (const auto& rc : k.recompute_modes)
      for (int z : spec.zero_levels) {
        // Fixed settings that need a knob: TP overlap splits SP's collectives; a block selection
        // recomputes its blocks in a mode.
        if ((c.tp_comm_overlap && !sp) || ((c.recompute_every > 0 || c.recompute_first > 0) && rc == "none")) continue;
        if (z < 0 || z > 3) throw TuneError(fmt::format("ZeRO level {} is not 0..3", z));
        if (replicas == 1 && z != spec.zero_levels.front()) continue;
        c.sequence_parallel = sp;
        c.recompute = rc;
        c.zero = replicas == 1 ? 0 : z;
        for (int hs : k.dp_shards) {
          // HSDP groups the ZeRO shards of dp replicas and their CP ranks (strategy.cpp): a group must
          // divide dp and be smaller than the region's replicas (else it is plain ZeRO).
          if (hs > 0 && (c.zero == 0 || c.dp % hs != 0 || hs * c.cp >= replicas)) continue;
          c.dp_shard = hs;
          for (const auto& re : k.reduce_modes) {
            // The gradient reduction is a choice of ZeRO-2/3 only.
            if (c.zero < 2 && re != k.reduce_modes.front()) continue;
            c.reduce_every = c.zero >= 2 && re == "step" ? "step" : "";
            for (int sms : k.comm_sms) {
              c.comm_sms = sms;
              out.push_back(c);
            }
          }
        }
      }
}

// The candidates of one family at degrees `base` (tp, cp, pp, dp, ep, etp, micro batch size): one per
// region count the family gives for --virtual 1..max (a count seen at a smaller value is not new).
void add_family_candidates(const TuneSpec& spec, const Knobs& k, const core::ScheduleFamily& family,
                           const TuneCandidate& base, const std::vector<bool>& sps, EnumerationStats& stats,
                           std::vector<TuneCandidate>& out) {
  const std::int64_t per_replica = static_cast<std::int64_t>(base.dp) * base.micro_batch_size;
  std::set<int> regions_seen;
  // A family's region count grows with v where it takes v (v x pp, at least v), so v past the pipeline
  // units adds nothing: --max-virtual 1000000 must not spin through a million values per candidate.
  for (int v = 1; v <= std::clamp(spec.max_virtual, 1, std::max(1, k.units)); ++v) {
    stats.considered += 1;
    if (k.batch % per_replica != 0) {
      stats.batch_indivisible += 1;
      continue;
    }
    TuneCandidate c = base;
    c.schedule = family.name;
    c.microbatches = static_cast<int>(k.batch / per_replica);
    c.virtual_stages = v;
    // The family says what it accepts: its region count for v (families with a fixed shape refuse
    // other values or return the same count), then its schedule for these knobs.
    int regions = 0;
    try {
      regions = family.regions(strategy_of(c));
    } catch (const std::invalid_argument&) {
      stats.family_rejected += 1;
      continue;
    }
    if (regions_seen.count(regions)) continue;  // the same shape as a smaller v: not a new candidate
    regions_seen.insert(regions);
    if (regions > k.units || regions % c.pp != 0) {
      stats.family_rejected += 1;
      continue;
    }
    c.virtual_stages = regions / c.pp;
    try {
      // The schedule does not depend on the settings that need a knob add_knob_variants sets (a fixed TP
      // overlap needs SP, a fixed block selection a recompute mode): checked here with them, every
      // candidate was refused.
      core::StrategyOptions o = strategy_of(c);
      o.tp_comm_overlap = false;
      o.recompute_every = o.recompute_first = 0;
      if (family.regions(o) != regions) throw std::invalid_argument("region count changed");
      core::schedule_directives(o, family.placement(o, regions));
    } catch (const std::invalid_argument&) {
      stats.family_rejected += 1;
      continue;
    }
    add_knob_variants(spec, k, c, sps, c.dp * c.cp * (family.mirrored ? 2 : 1), out);
  }
}

}  // namespace

std::vector<TuneCandidate> enumerate_candidates(const TuneSpec& spec, EnumerationStats* stats_out) {
  EnumerationStats stats;
  std::vector<TuneCandidate> out;
  if (spec.devices < 1) throw TuneError(fmt::format("--devices must be >= 1 (got {})", spec.devices));
  // Before any work (also for callers other than run_tune).
  core::check_limit(core::Limit::Devices, spec.devices, "--devices", "devices");
  Knobs k;
  read_model_knobs(spec, k);
  read_cluster_knobs(spec, k);
  probe_tp_degrees(spec, k, stats);
  check_pins(spec, k.cfg);
  accept_cp_degrees(spec, k, stats);
  // Nothing left to search is bad input (a --tp that cannot divide the devices, a sequence past a
  // limit), not a search that found no plan that fits: one line with the first reason.
  auto refuse_if_none = [](const char* what, std::size_t left, const std::vector<std::string>& rejected) {
    if (left == 0 && !rejected.empty())
      throw TuneError(fmt::format("no {}-parallel degree applies: {}{}", what, rejected.front(),
                                  rejected.size() > 1 ? fmt::format(" (and {} more)", rejected.size() - 1) : ""));
  };
  refuse_if_none("tensor", stats.tp_degrees.size(), stats.tp_rejected);
  refuse_if_none("context", k.cps.size(), stats.cp_rejected);
  for (const auto& [tp, sps] : k.sp_of_tp)
    for (int cp : k.cps)
      for (int pp : spec.devices % (tp * cp) == 0 ? divisors(spec.devices / tp / cp) : std::vector<int>{}) {
        if (pp > k.units || !pinned(spec.pp_degrees, pp)) continue;
        const int dp = spec.devices / tp / cp / pp;
        if (!pinned(spec.dp_degrees, dp)) continue;
        // EP groups over the DP x CP ranks (Megatron-core's layout). strategy.cpp also accepts EP groups
        // that span TP ranks; the search does not enumerate those.
        for (int ep : divisors(dp * cp))
          for (int etp : k.etps) {
            if (!pinned(spec.ep_degrees, ep)) continue;
            if (ep > 1 && (k.cfg.experts <= 0 || k.cfg.experts % ep != 0)) continue;
            // Expert TP inside the TP groups, on a split of the experts' FFN.
            if (etp > 1 && (k.cfg.experts <= 0 || tp % etp != 0 || k.cfg.expert_ffn % etp != 0)) continue;
            for (auto mbs : spec.micro_batch_sizes) {
              TuneCandidate base;
              static_cast<core::StrategyOptions&>(base) = spec.fixed;
              base.tp = tp;
              base.cp = cp;
              base.pp = pp;
              base.dp = dp;
              base.ep = ep;
              base.etp = etp;
              // Chunked all-to-alls (a fixed setting) chunk the expert all-to-alls: none without EP.
              if (ep < 2) base.a2a_chunks = 1;
              base.micro_batch_size = mbs;
              for (const auto* family : k.families)
                if (!family->expert_overlap || ep >= 2) add_family_candidates(spec, k, *family, base, sps, stats, out);
            }
          }
      }
  stats.legal = out.size();
  if (stats_out) *stats_out = stats;
  return out;
}

}  // namespace piper::search
