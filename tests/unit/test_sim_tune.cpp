// `piper tune`: the search's best equals a brute-force simulation of every combination the compiler
// accepts, enumeration covers every legal strategy, resuming loses and duplicates nothing, and the
// placement search balances with the cost model. The bounds are test_sim_tune_bounds.cpp's.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include <gtest/gtest.h>

#include "piper/core/strategy.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/search/results_csv.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/search/sweep.hpp"
#include "piper/search/tune.hpp"
#include "tune_support.hpp"

using namespace piper;
using namespace piper::sim;
using namespace piper::search;
using namespace piper::search::test;
namespace fs = std::filesystem;

namespace {

// small_spec narrowed to one micro-batch size, ZeRO-0 and one region per rank.
TuneSpec narrow_spec(int devices, int global_batch, int micro_batch_size, std::vector<std::string> schedules) {
  TuneSpec s = small_spec();
  s.devices = devices;
  s.global_batch = global_batch;
  s.micro_batch_sizes = {micro_batch_size};
  s.zero_levels = {0};
  s.max_virtual = 1;
  s.schedules = std::move(schedules);
  return s;
}

// The strategy a row or a brute-force point stands for. Regions per rank, not the --virtual value:
// families with a fixed shape accept --virtual 1 and their own count alike.
// pp dp ep zero family regions/rank M mbs tp sp recompute
using Strategy = std::tuple<int, int, int, int, std::string, int, int, std::int64_t, int, bool, std::string>;

struct BruteForce {
  std::map<Strategy, Outcome> ok;  // every combination that compiles and simulates
};

// Every combination of a superset of the knobs (degrees 1..8, every microbatch count, every family, the
// expert-overlap one with EP only as the tuner documents, --virtual 1..max, the spec's ZeRO levels, TP
// degrees with and without SP, recompute modes) simulated
// through the sweep machinery, which asks the compiler (not the tuner) what is legal. Kept: the ones
// on exactly 8 devices whose step holds the global batch.
BruteForce brute_force(const TuneSpec& spec) {
  BruteForce out;
  const core::ModelConfig cfg = core::load_model_config(spec.model);
  for (int tp : spec.tp_degrees)
    for (bool sp : {false, true})
      for (const auto& rc : spec.recompute_modes)
        for (int pp = 1; pp <= spec.devices; ++pp)
          for (int dp = 1; dp <= spec.devices; ++dp) {
            if (pp * dp * tp != spec.devices) continue;
            for (int ep = 1; ep <= dp; ++ep)
              for (auto mbs : spec.micro_batch_sizes)
                for (int m = 1; m <= spec.global_batch; ++m) {
                  if (static_cast<std::int64_t>(m) * dp * mbs != spec.global_batch) continue;
                  for (const auto& family : core::schedule_registry())
                    // The tuner tries the expert-overlap family only where it has all-to-alls to hide.
                    for (int v = 1; v <= spec.max_virtual && (!family.expert_overlap || ep >= 2); ++v)
                      for (int zero : spec.zero_levels) {
                        core::Scenario s;
                        s.model = spec.model;
                        s.micro_batch_size = mbs;
                        s.strategy.pp = pp, s.strategy.dp = dp, s.strategy.ep = ep, s.strategy.zero = zero;
                        s.strategy.schedule = family.name;
                        s.strategy.microbatches = m;
                        s.strategy.virtual_stages = v;
                        s.strategy.tp = tp, s.strategy.sequence_parallel = sp, s.strategy.recompute = rc;
                        const Outcome o = simulate_outcome(s, spec.cluster, "analytic");
                        if (o.status != "ok") continue;
                        EXPECT_EQ(o.devices, spec.devices);
                        EXPECT_DOUBLE_EQ(o.tokens_per_step,
                                         static_cast<double>(spec.global_batch * cfg.training.seq_len))
                            << family.name << " pp" << pp << " dp" << dp << " m" << m;
                        int regions = 0;
                        core::scenario_program(s, &regions);
                        out.ok[{pp, dp, ep, zero, family.name, regions / pp, m, mbs, tp, sp, rc}] = o;
                      }
                }
          }
  return out;
}

Strategy strategy_of(const TuneCandidate& c) {
  return {c.pp,           c.dp,
          c.ep,           c.zero,
          c.schedule,     c.virtual_stages,
          c.microbatches, c.micro_batch_size,
          c.tp,           c.sequence_parallel,
          c.recompute};
}

}  // namespace

TEST(Tune, EnumerationRules) {
  TuneSpec spec = small_spec();
  EnumerationStats stats;
  const auto candidates = enumerate_candidates(spec, &stats);
  ASSERT_FALSE(candidates.empty());
  EXPECT_EQ(stats.legal, candidates.size());
  std::set<std::string> keys;
  for (const auto& c : candidates) {
    EXPECT_EQ(c.pp * c.dp, 8) << c.key();
    EXPECT_EQ(c.dp % c.ep, 0) << c.key();
    EXPECT_EQ(8 % c.ep, 0) << "qwen3-9m has 8 experts: " << c.key();
    EXPECT_EQ(static_cast<std::int64_t>(c.microbatches) * c.dp * c.micro_batch_size, 16) << c.key();
    EXPECT_LE(c.pp * c.virtual_stages, 4) << "at most one region per block: " << c.key();
    EXPECT_TRUE(keys.insert(c.key()).second) << "duplicate " << c.key();
  }
  // PP 8 needs 8 regions but the model has 4 blocks; ZeRO only varies with more than one replica.
  EXPECT_EQ(std::count_if(candidates.begin(), candidates.end(), [](const TuneCandidate& c) { return c.pp == 8; }), 0);
  EXPECT_EQ(std::count_if(candidates.begin(), candidates.end(),
                          [](const TuneCandidate& c) { return c.dp == 1 && c.zero != 0; }),
            0);
  // Experts: every divisor of dp that divides the 8 experts may shard them.
  std::set<int> eps;
  for (const auto& c : candidates) eps.insert(c.ep);
  EXPECT_EQ(eps, (std::set<int>{1, 2, 4, 8}));
  // A dense model has nothing to shard.
  spec.model = "llama3-8b";
  for (const auto& c : enumerate_candidates(spec)) EXPECT_EQ(c.ep, 1) << c.key();
}

// TP degrees by default: divisors of the 8 GPUs of a node that the model takes. qwen3-9m has 8 heads
// but 4 KV heads, so TP 8 is left out with the reason; SP only with TP > 1; PP x TP x DP = devices;
// every (SP, recompute) option of every strategy.
TEST(Tune, EnumerationOfTensorParallelismAndRecompute) {
  TuneSpec spec = small_spec();
  spec.tp_degrees.clear();
  spec.recompute_modes = {"full", "none", "selective"};
  spec.micro_batch_sizes = {2};
  EnumerationStats stats;
  const auto candidates = enumerate_candidates(spec, &stats);
  EXPECT_EQ(stats.tp_degrees, (std::vector<int>{1, 2, 4}));
  ASSERT_EQ(stats.tp_rejected.size(), 1u);
  EXPECT_NE(stats.tp_rejected.front().find("TP 8"), std::string::npos) << stats.tp_rejected.front();
  EXPECT_NE(stats.tp_rejected.front().find("4 KV heads"), std::string::npos) << stats.tp_rejected.front();
  std::map<std::tuple<int, bool, std::string>, int> count;
  std::set<std::string> keys;
  for (const auto& c : candidates) {
    EXPECT_EQ(c.pp * c.tp * c.dp, 8) << c.key();
    if (c.tp == 1) {
      EXPECT_FALSE(c.sequence_parallel) << c.key();
    }
    EXPECT_TRUE(keys.insert(c.key()).second) << "duplicate " << c.key();
    count[{c.tp, c.sequence_parallel, c.recompute}] += 1;
  }
  // 1 (TP 1) + 2 (TP 2, TP 4: with and without SP) layouts, each with three recompute modes.
  EXPECT_EQ(count.size(), 5u * 3u);
  // The same strategy appears once per recompute mode: as many "full" as "none" rows per layout.
  for (const auto& [k, n] : count) EXPECT_EQ(n, (count[{std::get<0>(k), std::get<1>(k), "none"}])) << std::get<2>(k);

  // A cluster of 4-GPU nodes keeps TP groups inside a node: TP 8 is left out for that reason, and an
  // explicit list is honoured (SP off only).
  const fs::path cluster = fs::temp_directory_path() / ("piper_test_tune_" + std::to_string(::getpid()) + "_4gpu.json");
  {
    std::ofstream out(cluster);
    out << R"({"name": "four", "preset": "dgx-h200", "nodes": 2, "node": {"gpus_per_node": 4}})";
  }
  spec.cluster = cluster.string();
  spec.tp_degrees = {2, 8};
  spec.sequence_parallel = {false};
  stats = {};
  const auto four = enumerate_candidates(spec, &stats);
  EXPECT_EQ(stats.tp_degrees, (std::vector<int>{2}));
  ASSERT_EQ(stats.tp_rejected.size(), 1u);
  EXPECT_NE(stats.tp_rejected.front().find("inside a node"), std::string::npos) << stats.tp_rejected.front();
  for (const auto& c : four) {
    EXPECT_EQ(c.tp, 2);
    EXPECT_FALSE(c.sequence_parallel);
  }
  fs::remove(cluster);
}

// The acceptance test of the issue: on 8 devices, the search's best plan is the best of a brute-force
// simulation of every legal combination, and every legal combination is one of its candidates.
TEST(Tune, BestEqualsBruteForce) {
  TuneSpec spec = small_spec();
  // TP 1 and 2 (with and without SP) and every recompute mode; one micro batch size and up to two
  // regions per rank keep the brute force within a few seconds.
  spec.tp_degrees = {1, 2};
  spec.recompute_modes = {"none", "selective", "full"};
  spec.micro_batch_sizes = {2};
  spec.max_virtual = 2;
  const BruteForce bf = brute_force(spec);
  ASSERT_GT(bf.ok.size(), 20u);

  // A cap between the smallest and the largest peak, so that pruning has work to do.
  std::vector<std::int64_t> peaks;
  for (const auto& [k, o] : bf.ok) peaks.push_back(o.peak_memory_bytes);
  std::sort(peaks.begin(), peaks.end());
  spec.memory_cap_bytes = static_cast<double>(peaks[peaks.size() / 2]);
  const double cap = spec.memory_cap_bytes;

  const fs::path csv = temp_csv("brute");
  const TuneSummary s = run_tune(spec, csv.string());
  EXPECT_GT(s.pruned, 0u) << "the cap should prune something";
  EXPECT_GT(s.dominated, 0u) << "some plans fit without recomputation: their recompute twins are deferred";

  // Coverage: every legal brute-force strategy is a candidate, and every candidate is legal.
  std::set<Strategy> enumerated;
  for (const auto& c : enumerate_candidates(spec)) enumerated.insert(strategy_of(c));
  for (const auto& [k, o] : bf.ok) {
    // ZeRO levels coincide with one replica; the tuner keeps ZeRO 0 there.
    Strategy canon = k;
    if (std::get<1>(k) == 1) std::get<3>(canon) = 0;
    EXPECT_TRUE(enumerated.count(canon)) << "missing: pp" << std::get<0>(k) << " dp" << std::get<1>(k) << " z"
                                         << std::get<3>(k) << " " << std::get<4>(k) << " v" << std::get<5>(k) << " m"
                                         << std::get<6>(k);
  }
  for (const auto& st : enumerated) EXPECT_TRUE(bf.ok.count(st)) << "illegal candidate " << std::get<4>(st);

  // Why dominated recompute variants are deferred, not skipped: with the same strategy, more
  // recomputation is usually slower, but not always (a longer backward can move when a transfer or
  // all-reduce starts). Count both; the search must equal the brute force either way.
  int pairs = 0, faster = 0;
  for (const auto& [k, o] : bf.ok) {
    for (const auto& [lighter, heavier] :
         {std::pair<std::string, std::string>{"none", "selective"}, {"selective", "full"}}) {
      if (std::get<10>(k) != heavier) continue;
      Strategy twin = k;
      std::get<10>(twin) = lighter;
      if (!bf.ok.count(twin)) continue;
      pairs += 1;
      if (o.step_time_s < bf.ok.at(twin).step_time_s) faster += 1;
    }
  }
  EXPECT_GT(pairs, 50);
  EXPECT_LT(faster, pairs / 4) << "recomputation is normally slower";
  std::cout << pairs << " recompute twin pairs, " << faster << " where more recomputation is faster\n";
  std::set<int> tps;
  for (const auto& [k, o] : bf.ok) tps.insert(std::get<8>(k));
  EXPECT_EQ(tps, (std::set<int>{1, 2})) << "the brute force covers TP";

  double best = std::numeric_limits<double>::infinity();
  for (const auto& [k, o] : bf.ok)
    if (!o.oom && static_cast<double>(o.peak_memory_bytes) <= cap) best = std::min(best, o.step_time_s);
  ASSERT_FALSE(s.ranked.empty());
  const TuneRow& top = s.ranked.front();
  EXPECT_EQ(top.engine, "analytic");
  EXPECT_EQ(top.step_time_s, best) << top.candidate.key();
  // Same plan: the brute force simulated the winner's strategy with the same result.
  ASSERT_TRUE(bf.ok.count(strategy_of(top.candidate))) << top.candidate.key();
  const Outcome& same = bf.ok.at(strategy_of(top.candidate));
  EXPECT_EQ(same.step_time_s, top.step_time_s);
  EXPECT_EQ(same.peak_memory_bytes, top.peak_memory_bytes);
  for (const auto& r : s.ranked) EXPECT_LE(static_cast<double>(r.peak_memory_bytes), cap);
  fs::remove(csv);
}

TEST(Tune, ResumesAfterAKillWithoutLosingOrDuplicatingRows) {
  TuneSpec spec = small_spec();
  spec.micro_batch_sizes = {2};
  spec.recompute_modes = {"none", "full"};  // dominated rows are resumed too
  const fs::path csv = temp_csv("resume");
  const TuneSummary first = run_tune(spec, csv.string());
  std::vector<std::string> lines;
  {
    std::ifstream in(csv);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
  }
  ASSERT_GT(lines.size(), 10u);
  // Keep the header, 5 rows and half of the 6th, as a kill mid-write leaves it.
  auto write_cut = [&](const std::string& row_2) {
    std::ofstream out(csv, std::ios::trunc | std::ios::binary);
    for (int i = 0; i < 6; ++i) out << (i == 2 ? row_2 : lines[static_cast<std::size_t>(i)]) << "\n";
    out << lines[6].substr(0, lines[6].size() / 2);
  };
  auto bytes = [&] {
    std::ifstream in(csv, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  write_cut(lines[2]);
  const std::string cut = bytes();
  // A reader that only looks (tune --show, piper-studio) skips the partial line and leaves it: it may
  // be a row a running search is writing, which a cut would lose.
  EXPECT_EQ(read_tune_results(csv.string()).size(), 5u);
  EXPECT_EQ(bytes(), cut);
  // A resume that refuses a row leaves the file as it was, partial line included.
  std::string bogus = lines[2];
  bogus.replace(bogus.find(",ok,"), 4, ",bogus,");
  write_cut(bogus);
  const std::string refused = bytes();
  EXPECT_THROW(run_tune(spec, csv.string()), TuneError);
  EXPECT_EQ(bytes(), refused);
  write_cut(lines[2]);
  const TuneSummary second = run_tune(spec, csv.string());
  EXPECT_EQ(second.resumed, 5u);
  EXPECT_LT(second.ran, first.ran) << "resumed rows are not simulated again";
  std::vector<std::string> after;
  {
    std::ifstream in(csv);
    for (std::string l; std::getline(in, l);) after.push_back(l);
  }
  EXPECT_EQ(after.size(), lines.size());
  std::set<std::string> before_keys, after_keys;
  const auto& columns = tune_csv_columns();
  const std::size_t engine =
      static_cast<std::size_t>(std::find(columns.begin(), columns.end(), "engine") - columns.begin());
  for (std::size_t i = 1; i < lines.size(); ++i)
    before_keys.insert(csv_split(lines[i]).front() + "|" + csv_split(lines[i])[engine]);
  for (std::size_t i = 1; i < after.size(); ++i)
    EXPECT_TRUE(after_keys.insert(csv_split(after[i]).front() + "|" + csv_split(after[i])[engine]).second)
        << "duplicate " << after[i];
  EXPECT_EQ(before_keys, after_keys);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(after[static_cast<std::size_t>(i)], lines[static_cast<std::size_t>(i)]);
  ASSERT_FALSE(second.ranked.empty());
  EXPECT_EQ(second.ranked.front().candidate, first.ranked.front().candidate);

  // A file of another search is refused, not mixed.
  TuneSpec other = spec;
  other.global_batch = 32;
  EXPECT_THROW(run_tune(other, csv.string()), TuneError);
  // Nor is it resumed by a calibrated search: no column says which calibration made its rows (probe 7).
  TuneSpec calibrated = spec;
  calibrated.calibration_path = "cal.json";
  try {
    run_tune(calibrated, csv.string());
    ADD_FAILURE() << "a calibrated tune resumed an uncalibrated results file";
  } catch (const TuneError& e) {
    EXPECT_NE(std::string(e.what()).find("a tune with a calibration (cal.json) cannot resume a results file"),
              std::string::npos)
        << e.what();
  }

  // A file written before TP and recomputation were searched (the same columns less tp,
  // sequence_parallel and recompute) is refused with a line saying so, and left as it was.
  {
    std::ofstream old(csv, std::ios::trunc);
    old << "key,model,cluster,devices,global_batch,seq_len,pp,dp,ep,zero,schedule,virtual,microbatches,"
           "micro_batch_size,placement,pp_ranges,engine,estimated_memory_bytes,step_time_s,tokens_per_s,mfu,"
           "bubble_fraction,peak_memory_bytes,oom,compile_time_s,simulate_time_s,status,reason\n";
  }
  const auto old_size = fs::file_size(csv);
  try {
    run_tune(spec, csv.string());
    ADD_FAILURE() << "an older results file was accepted";
  } catch (const TuneError& e) {
    EXPECT_NE(std::string(e.what()).find("older piper tune"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("line 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(fs::file_size(csv), old_size);
  fs::remove(csv);
}

// FLOP balancing (the generator's default) counts routed experts at their full cost, but expert
// parallelism divides them over the EP group, so with EP 2 the MoE blocks weigh less than the balance
// assumed and the region holding the LM head is the heavy one. Balancing by the cost model's time
// with experts sharded moves the boundary, and the simulation confirms the gain.
TEST(Tune, PlacementSearchBalancesWithTheCostModel) {
  TuneSpec spec;
  spec.model = "qwen3-1b";
  spec.devices = 8;
  spec.seq_len = 512;  // short sequences: small ops run below peak efficiency, so time and FLOPs differ
  spec.global_batch = 32;
  TuneCandidate c;
  c.pp = 2, c.dp = 4, c.ep = 2, c.zero = 1, c.schedule = "1f1b", c.microbatches = 8, c.micro_batch_size = 1;
  const auto variants = placement_variants(spec, c);
  ASSERT_FALSE(variants.empty());
  ASSERT_LE(variants.size(), 3u) << "a few candidates per strategy";
  const auto base = effective_pp_ranges(spec, c);
  ASSERT_EQ(base.size(), 2u);
  // The balance weighs each block by its kernels' time under the cost model (the simulator's
  // timing). Where it lands on the generator's boundaries it is not repeated: the variants are then
  // the boundary moved one block either way. Each variant is a placement the default is not.
  for (const auto& v : variants) {
    EXPECT_NE(v.pp_ranges, base);
    ASSERT_EQ(v.pp_ranges.size(), 2u);
    EXPECT_EQ(v.pp_ranges.front(), 0);
    EXPECT_NE(v.placement.find("time-balanced"), std::string::npos) << v.placement;
  }
  const TuneRow d = evaluate_candidate(spec, c, "analytic");
  ASSERT_EQ(d.status, "ok") << d.reason;
  for (const auto& v : variants) ASSERT_EQ(evaluate_candidate(spec, v, "analytic").status, "ok");

  // The search simulates the alternatives of its leaders, so with it the best is never slower.
  spec.devices = 4;
  spec.global_batch = 16;
  spec.micro_batch_sizes = {1};
  spec.zero_levels = {1};
  spec.top_k = 0;
  spec.schedules = {"1f1b"};
  spec.tp_degrees = {1};
  spec.recompute_modes = {"none"};
  const fs::path a = temp_csv("placement_on"), b = temp_csv("placement_off");
  const TuneSummary with = run_tune(spec, a.string());
  spec.placement_search = false;
  const TuneSummary without = run_tune(spec, b.string());
  EXPECT_GT(with.placement_variants, 0u);
  EXPECT_EQ(without.placement_variants, 0u);
  ASSERT_FALSE(with.ranked.empty());
  ASSERT_FALSE(without.ranked.empty());
  EXPECT_LE(with.ranked.front().step_time_s, without.ranked.front().step_time_s);
  fs::remove(a);
  fs::remove(b);
}

TEST(Tune, ParetoFront) {
  auto row = [](double tps, std::int64_t mem) {
    TuneRow r;
    r.status = "ok";
    r.tokens_per_s = tps;
    r.peak_memory_bytes = mem;
    return r;
  };
  // (mem, tps): (1,10) (2,5) (3,20) (4,20) (5,30) -> front (1,10) (3,20) (5,30).
  const auto front = pareto_front({row(10, 1), row(5, 2), row(20, 3), row(20, 4), row(30, 5)});
  ASSERT_EQ(front.size(), 3u);
  EXPECT_EQ(front[0].peak_memory_bytes, 1);
  EXPECT_EQ(front[1].peak_memory_bytes, 3);
  EXPECT_EQ(front[2].peak_memory_bytes, 5);
}

// The order of pipeline ranks on device groups. qwen3-1b with PP 2 x TP 8 on two 8-GPU nodes: each
// pipeline rank is one node. ZB-V puts regions 0 and 3 (embedding and LM head) on rank 0.
TEST(Tune, RankOrderMattersOnlyWhereDeviceGroupsDiffer) {
  TuneSpec spec;
  spec.model = "qwen3-1b";
  spec.devices = 16;
  spec.seq_len = 1024;
  spec.global_batch = 16;
  TuneCandidate c;
  c.pp = 2, c.tp = 8, c.dp = 1, c.schedule = "zb-v", c.virtual_stages = 2, c.microbatches = 16, c.micro_batch_size = 1;

  // Uniform nodes: no alternative is proposed, and the reversed order is the same chain mirrored, so
  // it simulates to the same step.
  EXPECT_TRUE(rank_order_variants(spec, c).empty());
  TuneCandidate reversed = c;
  reversed.rank_order = {1, 0};
  const TuneRow d = evaluate_candidate(spec, c, "analytic");
  const TuneRow r = evaluate_candidate(spec, reversed, "analytic");
  ASSERT_EQ(d.status, "ok") << d.reason;
  ASSERT_EQ(r.status, "ok") << r.reason;
  EXPECT_NEAR(r.step_time_s, d.step_time_s, 1e-9 * d.step_time_s);
  // The relabelled program really moves region 0 to the second node.
  const auto program = tune_directives(spec, reversed);
  bool moved = false;
  for (const auto& dir : program)
    if (dir.value("op", "") == "place" && dir["filter"].value("PP", -1) == 0)
      moved = dir["devices"].front().get<int>() == 8;
  EXPECT_TRUE(moved) << program.dump();

  // Node 0 with H200s, node 1 with A100s: the groups differ. The generator's boundaries leave rank 1
  // (the middle regions) the busier one, so the busiest-on-fastest order puts it on the H200s.
  const fs::path cluster =
      fs::temp_directory_path() / ("piper_test_tune_" + std::to_string(::getpid()) + "_mixed.json");
  {
    std::ofstream out(cluster);
    out << R"({"name": "mixed", "preset": "dgx-h200", "nodes": 2, "fixed": true, "overrides": [{"nodes": [1], "gpu": "a100-sxm-80g"}]})";
  }
  spec.cluster = cluster.string();
  const auto variants = rank_order_variants(spec, c);
  ASSERT_EQ(variants.size(), 1u) << "on two groups the busiest-on-fastest order is the reversed one";
  EXPECT_EQ(variants.front().rank_order, (std::vector<int>{1, 0}));
  EXPECT_EQ(variants.front().placement, "busiest ranks on the fastest GPUs");
  const TuneRow slow = evaluate_candidate(spec, c, "analytic");
  const TuneRow fast = evaluate_candidate(spec, variants.front(), "analytic");
  ASSERT_EQ(fast.status, "ok") << fast.reason;
  std::cout << "default " << slow.step_time_s << " s, busiest rank on the H200s " << fast.step_time_s << " s\n";
  EXPECT_LT(fast.step_time_s, slow.step_time_s);

  // The search tries it for its leaders, and its best is never slower than without placement search.
  spec.schedules = {"zb-v", "1f1b"};
  spec.tp_degrees = {8};
  spec.recompute_modes = {"none"};
  spec.sequence_parallel = {false};
  spec.zero_levels = {0};
  spec.micro_batch_sizes = {1};
  spec.top_k = 0;
  const fs::path a = temp_csv("order_on"), b = temp_csv("order_off");
  const TuneSummary with = run_tune(spec, a.string());
  spec.placement_search = false;
  const TuneSummary without = run_tune(spec, b.string());
  ASSERT_FALSE(with.ranked.empty());
  ASSERT_FALSE(without.ranked.empty());
  EXPECT_LE(with.ranked.front().step_time_s, without.ranked.front().step_time_s);
  // (Whether a rank-order variant is simulated depends on the step-time bound: the per-kernel bound
  // skips variants that cannot beat the best step found, so only the outcome above is asserted.)
  fs::remove(a);
  fs::remove(b);
  fs::remove(cluster);
}

// --comm-sms is a search axis: every candidate once per value, the partition reaching the simulator.
// On one device (no communication) a partition of s of the H200's 132 SMs makes the whole step
// 132 / (132 - s) times longer (docs/sm-partition.md), so with 33 SMs each strategy is exactly 4/3
// slower and the search ranks the unpartitioned plans first; rows carry the value through the CSV.
TEST(Tune, CommSmsIsASearchAxis) {
  TuneSpec spec = narrow_spec(1, 4, 2, {"1f1b", "gpipe"});
  const auto shared = enumerate_candidates(spec);
  ASSERT_FALSE(shared.empty());
  spec.comm_sms = {33, 0, 33};  // order and duplicates do not matter
  const auto both = enumerate_candidates(spec);
  ASSERT_EQ(both.size(), 2 * shared.size());
  std::map<std::string, double> step_of;
  for (const auto& c : both) {
    const TuneRow row = evaluate_candidate(spec, c, "analytic");
    ASSERT_EQ(row.status, "ok") << c.key() << ": " << row.reason;
    step_of[c.key()] = row.step_time_s;
    if (c.comm_sms == 33) {
      EXPECT_NE(c.key().find("/sms33"), std::string::npos);
      EXPECT_NE(c.describe().find("communication on 33 SMs"), std::string::npos) << c.describe();
    }
  }
  for (const auto& c : shared) {
    TuneCandidate p = c;
    p.comm_sms = 33;
    ASSERT_TRUE(step_of.count(p.key())) << p.key();
    EXPECT_NEAR(step_of.at(p.key()), step_of.at(c.key()) * 132.0 / 99.0, 1e-9 * step_of.at(c.key())) << c.key();
  }

  const fs::path csv = temp_csv("comm_sms");
  const TuneSummary s = run_tune(spec, csv.string());
  ASSERT_FALSE(s.ranked.empty());
  EXPECT_EQ(s.ranked.front().candidate.comm_sms, 0);
  std::set<int> seen;
  for (const auto& r : read_tune_results(csv.string())) seen.insert(r.candidate.comm_sms);
  EXPECT_EQ(seen, (std::set<int>{0, 33}));
  fs::remove(csv);

  // Refused up front, one line naming the flag: more SMs than the GPU has, or a negative count.
  spec.comm_sms = {132};
  try {
    enumerate_candidates(spec);
    FAIL() << "expected TuneError";
  } catch (const TuneError& e) {
    EXPECT_STREQ(e.what(),
                 "--comm-sms 132: 132 SMs for communication leave none for compute on 'H200-SXM-141GB' (132 SMs)");
  }
  spec.comm_sms = {-8};
  EXPECT_THROW(enumerate_candidates(spec), TuneError);
}

// --dp-shard is a search axis for candidates with ZeRO and more data-parallel replicas than the
// group: each such candidate once more per group size that divides dp, none for ZeRO-0 or for groups
// that do not split the replicas. The memory bound follows the group (it stays below the simulated
// peak), the key and description carry it, and rows keep it through the CSV.
TEST(Tune, DpShardIsASearchAxis) {
  TuneSpec spec = small_spec();
  spec.devices = 4;
  spec.global_batch = 8;
  spec.micro_batch_sizes = {2};
  spec.zero_levels = {0, 3};
  spec.max_virtual = 1;
  spec.tp_degrees = {1};
  spec.recompute_modes = {"none"};
  spec.schedules = {"1f1b"};
  const auto plain = enumerate_candidates(spec);
  spec.dp_shards = {2, 0, 3, 2};  // 3 divides no dp here; order and duplicates do not matter
  const auto both = enumerate_candidates(spec);
  int expected_extra = 0;
  for (const auto& c : plain) expected_extra += c.zero >= 1 && c.dp > 2 && c.dp % 2 == 0;
  ASSERT_GT(expected_extra, 0);
  ASSERT_EQ(both.size(), plain.size() + static_cast<std::size_t>(expected_extra));
  int hybrid = 0;
  for (const auto& c : both) {
    if (c.dp_shard == 0) continue;
    ++hybrid;
    EXPECT_EQ(c.dp_shard, 2);
    EXPECT_GE(c.zero, 1);
    EXPECT_NE(c.key().find("/hs2"), std::string::npos);
    EXPECT_NE(c.describe().find("HSDP, groups of 2"), std::string::npos) << c.describe();
    const TuneRow row = evaluate_candidate(spec, c, "analytic");
    ASSERT_EQ(row.status, "ok") << c.key() << ": " << row.reason;
    EXPECT_LE(memory_lower_bound(spec, c), row.peak_memory_bytes) << c.key();
    TuneCandidate p = c;
    p.dp_shard = 0;
    EXPECT_GT(memory_lower_bound(spec, c), memory_lower_bound(spec, p)) << c.key();  // fewer shards per device
  }
  EXPECT_EQ(hybrid, expected_extra);

  const fs::path csv = temp_csv("dp_shard");
  (void)run_tune(spec, csv.string());
  std::set<int> seen;
  for (const auto& r : read_tune_results(csv.string())) seen.insert(r.candidate.dp_shard);
  EXPECT_EQ(seen, (std::set<int>{0, 2}));
  fs::remove(csv);

  spec.dp_shards = {1};
  try {
    enumerate_candidates(spec);
    FAIL() << "expected TuneError";
  } catch (const TuneError& e) {
    EXPECT_STREQ(e.what(), "--dp-shard: 1 is not a group size (0: plain ZeRO, N >= 2: HSDP over groups of N replicas)");
  }
}

// Each row carries the TP collectives' time on its critical path, the simulation's own figure, and
// keeps it through the CSV; 0 for candidates without TP.
TEST(Tune, RowsCarryTheCriticalPathsTpTime) {
  TuneSpec spec = narrow_spec(2, 4, 1, {"1f1b"});
  spec.tp_degrees = {1, 2};
  const fs::path csv = temp_csv("tp_comm");
  run_tune(spec, csv.string());
  int with_tp = 0, without = 0;
  for (const auto& r : read_tune_results(csv.string())) {
    if (r.status != "ok") continue;
    if (r.candidate.tp == 1) {
      EXPECT_EQ(r.tp_comm_s, 0) << r.candidate.key();
      ++without;
      continue;
    }
    ++with_tp;
    const TuneRow direct = evaluate_candidate(spec, r.candidate, r.engine);
    EXPECT_GT(direct.tp_comm_s, 0) << r.candidate.key();
    EXPECT_EQ(r.tp_comm_s, direct.tp_comm_s) << r.candidate.key();
    EXPECT_LT(r.tp_comm_s, r.step_time_s) << r.candidate.key();
  }
  EXPECT_GT(with_tp, 0);
  EXPECT_GT(without, 0);
  fs::remove(csv);
}

TEST(Tune, OrdinalsAreEnglish) {
  EXPECT_EQ(ordinal(1), "1st");
  EXPECT_EQ(ordinal(2), "2nd");
  EXPECT_EQ(ordinal(3), "3rd");
  EXPECT_EQ(ordinal(4), "4th");
  EXPECT_EQ(ordinal(10), "10th");
  EXPECT_EQ(ordinal(11), "11th");
  EXPECT_EQ(ordinal(12), "12th");
  EXPECT_EQ(ordinal(13), "13th");
  EXPECT_EQ(ordinal(21), "21st");
  EXPECT_EQ(ordinal(22), "22nd");
  EXPECT_EQ(ordinal(103), "103rd");
  EXPECT_EQ(ordinal(111), "111th");
}

// The default cap keeps 5 % of the HBM for the CUDA context, NCCL buffers and fragmentation; an
// explicit reserve replaces it, and an explicit cap is the whole budget.
TEST(Tune, DefaultCapKeepsAReserve) {
  TuneSpec spec = narrow_spec(1, 4, 2, {"1f1b"});
  const double hbm = static_cast<double>(load_cluster("dgx-h200").gpu(0).hbm_bytes);
  const fs::path csv = temp_csv("reserve");
  TuneSummary s = run_tune(spec, csv.string());
  EXPECT_DOUBLE_EQ(s.hbm_bytes, hbm);
  EXPECT_DOUBLE_EQ(s.memory_reserve_bytes, 0.05 * hbm);
  EXPECT_DOUBLE_EQ(s.memory_cap_bytes, 0.95 * hbm);
  spec.memory_reserve_bytes = 2.0 * (1 << 30);
  s = run_tune(spec, csv.string());
  EXPECT_DOUBLE_EQ(s.memory_cap_bytes, hbm - 2.0 * (1 << 30));
  spec.memory_cap_bytes = 10.0 * (1 << 30);
  s = run_tune(spec, csv.string());
  EXPECT_DOUBLE_EQ(s.memory_cap_bytes, 10.0 * (1 << 30));
  EXPECT_EQ(s.memory_reserve_bytes, 0);
  spec.memory_cap_bytes = 0;
  spec.memory_reserve_bytes = hbm;
  EXPECT_THROW(run_tune(spec, csv.string()), TuneError);
  fs::remove(csv);
}

// --pp, --dp and --ep restrict the search to the listed degrees; a degree that cannot divide the
// devices (or the experts) is refused up front.
TEST(Tune, PinsRestrictTheDegrees) {
  TuneSpec spec = small_spec();
  const auto all = enumerate_candidates(spec);
  spec.pp_degrees = {2};
  const auto pp2 = enumerate_candidates(spec);
  ASSERT_FALSE(pp2.empty());
  EXPECT_LT(pp2.size(), all.size());
  for (const auto& c : pp2) EXPECT_EQ(c.pp, 2);
  spec.pp_degrees = {};
  spec.dp_degrees = {4};
  spec.ep_degrees = {2};
  const auto dp4 = enumerate_candidates(spec);
  ASSERT_FALSE(dp4.empty());
  for (const auto& c : dp4) EXPECT_TRUE(c.dp == 4 && c.ep == 2) << c.key();
  spec.ep_degrees = {};
  spec.pp_degrees = {3};
  spec.dp_degrees = {};
  try {
    enumerate_candidates(spec);
    FAIL() << "expected TuneError";
  } catch (const TuneError& e) {
    EXPECT_STREQ(e.what(), "--pp 3: does not divide the 8 devices");
  }
}

// At PP 1 with one region per rank, 1f1b and interleaved-1f1b (and zb-h1 and zb-h2) order the same
// ops: the ranking lists each plan once and counts the others as coinciding. (gpipe does not
// coincide: it runs every forward before the first backward, so it holds more activations.)
TEST(Tune, RankingListsDistinctPlans) {
  TuneSpec spec = narrow_spec(2, 8, 1, {"1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "gpipe"});
  const fs::path csv = temp_csv("distinct");
  const TuneSummary s = run_tune(spec, csv.string());
  ASSERT_FALSE(s.ranked.empty());
  EXPECT_GE(s.coinciding, 2u);
  bool gpipe = false;
  for (const auto& r : s.ranked) gpipe |= r.candidate.pp == 1 && r.candidate.schedule == "gpipe";
  EXPECT_TRUE(gpipe) << "a plan that only shares the shape is not collapsed";
  std::set<std::tuple<std::string, double, std::int64_t>> plans;
  for (const auto& r : s.ranked) {
    TuneCandidate unnamed = r.candidate;
    unnamed.schedule.clear();
    EXPECT_TRUE(plans.insert({unnamed.key(), r.step_time_s, r.peak_memory_bytes}).second)
        << "listed twice: " << r.candidate.describe();
  }
  fs::remove(csv);
}

// The ZeRO-2/3 gradient reduction is a search axis: both modes for ZeRO-2/3, one plan for ZeRO-0/1.
// Per step keeps the whole gradient (memory bound grows by (1 - 1/shards) of the gradient bytes) and
// adds each later microbatch's into it; per microbatch moves the gradient once per microbatch and adds
// only into its shard. Neither is faster in general (communication against HBM traffic), but they differ.
TEST(Tune, SearchesTheZeroGradientReduction) {
  TuneSpec spec = narrow_spec(8, 16, 1, {"1f1b"});
  spec.zero_levels = {1, 2};
  spec.reduce_every = {};
  int z1 = 0, z2_step = 0, z2_mb = 0;
  for (const auto& c : enumerate_candidates(spec)) {
    if (c.zero == 1) {
      ++z1;
      EXPECT_EQ(c.reduce_every, "") << c.key();
    } else if (c.zero == 2) {
      (c.reduce_every == "step" ? z2_step : z2_mb) += 1;
      if (c.reduce_every != "step" || c.dp < 2 || c.microbatches < 2) continue;
      TuneCandidate mb = c;
      mb.reduce_every = "";
      EXPECT_NE(c.key(), mb.key());
      EXPECT_GT(memory_lower_bound(spec, c), memory_lower_bound(spec, mb)) << c.key();
      const TuneRow a = evaluate_candidate(spec, c, "analytic"), b = evaluate_candidate(spec, mb, "analytic");
      ASSERT_EQ(a.status, "ok") << a.reason;
      ASSERT_EQ(b.status, "ok") << b.reason;
      EXPECT_NE(a.step_time_s, b.step_time_s) << c.key();
      EXPECT_GT(a.peak_memory_bytes, b.peak_memory_bytes) << c.key();
    }
  }
  EXPECT_GT(z1, 0);
  EXPECT_EQ(z2_step, z2_mb);
  EXPECT_GT(z2_step, 0);
  spec.reduce_every = {"sometimes"};
  EXPECT_THROW(enumerate_candidates(spec), TuneError);
}

// A fixed setting that needs EP (TuneSpec::fixed.a2a_chunks: chunked expert all-to-alls) applies to
// the candidates with EP >= 2; those without EP run unchunked, as the fixed setting cannot apply.
TEST(Tune, FixedExpertChunksApplyWhereThereIsExpertParallelism) {
  TuneSpec spec = small_spec();
  spec.model = std::string(PIPER_SOURCE_DIR) + "/examples/models/tiny-moe.json";
  spec.fixed.a2a_chunks = 2;
  const auto candidates = enumerate_candidates(spec);
  ASSERT_FALSE(candidates.empty());
  int chunked = 0, unchunked = 0;
  for (const auto& c : candidates) {
    EXPECT_EQ(c.a2a_chunks, c.ep >= 2 ? 2 : 1) << c.key();
    (c.ep >= 2 ? chunked : unchunked) += 1;
  }
  EXPECT_GT(chunked, 0);
  EXPECT_GT(unchunked, 0);
  spec.ep_degrees = {2};
  spec.zero_levels = {0};
  spec.micro_batch_sizes = {1};
  spec.schedules = {"1f1b"};
  const fs::path csv = temp_csv("a2a-chunks");
  const TuneSummary s = run_tune(spec, csv.string());
  ASSERT_FALSE(s.ranked.empty());
  fs::remove(csv);
}
