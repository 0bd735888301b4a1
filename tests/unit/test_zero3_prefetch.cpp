// ZeRO-3's prefetch limit (the replicate directive's "prefetch", default 1): on each device the
// per-use parameter gathers form units, one per compute op that first uses them (here each dense
// segment's gather: a step's gathers do not gate its other segments), and the gathers of unit k
// wait for the last use of unit k - 1 - prefetch, so at most prefetch + 1 units' gathered copies
// are live.
// Checked on the published PP2 x DP2 x EP2 ZeRO-3 program (qwen3-9m, 1F1B): the waits read back from
// the lowered plans, and the gathered bytes the simulator holds at its peak.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/model.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/verifier.hpp"
#include "piper/sim/simulate.hpp"

using namespace piper::core;
using nlohmann::json;

namespace {

constexpr int kMicrobatches = 4;
constexpr int kNoLimit = 1 << 20;

// The published ZeRO-3 program with `prefetch` on both replicate directives (none: the default) and
// the gathers on a stream of their own (nothing else holds them back), followed by 1F1B over
// kMicrobatches, compiled for qwen3-9m split evenly over the two regions.
CompileResult compile_zero3(int prefetch) {
  std::ifstream in(std::string(PIPER_FIXTURES) + "/piper-directives/pp2_dp2_ep2_zero3.json");
  json program = json::parse(in);
  for (auto& d : program)
    if (d["op"] == "replicate") {
      d["gather_stream"] = "gather";
      if (prefetch >= 0) d["prefetch"] = prefetch;
    }
  int ranks = 0;
  const auto rank_of_region = rank_of_region_from_program(parse_directives(program), &ranks);
  StrategyOptions o;
  o.pp = ranks;
  o.microbatches = kMicrobatches;
  o.schedule = "1f1b";
  for (auto& d : schedule_directives(o, rank_of_region).to_json()) program.push_back(d);
  Model m = build_model(*zoo_config("qwen3-9m"));
  annotate_pipeline_ranges(m, {0, 2});
  return compile(m, parse_directives(program));
}

// A unit: the gathers whose copies the same compute op uses first.
struct Unit {
  int first_use = -1;          // index of that compute op on the compute stream
  int last_use = -1;           // index of the last compute op using one of its copies
  std::vector<OpRef> gathers;  // the ALL_GATHERs filling the copies
  std::int64_t bytes = 0;      // their gathered bytes
};

// The plan's per-use gather units in the order of their first use, read from its buffers.
std::vector<Unit> units_by_first_use(const Plan& plan, int* compute_stream) {
  *compute_stream = -1;
  for (std::size_t s = 0; s < plan.streams.size(); ++s)
    if (plan.streams[s].name == "compute") *compute_stream = static_cast<int>(s);
  const auto& ops = plan.streams[static_cast<std::size_t>(*compute_stream)].ops;
  std::map<int, Unit> by_first_use;
  for (std::size_t b = 0; b < plan.buffers.size(); ++b) {
    const Buffer& buf = plan.buffers[b];
    if (buf.kind != BufferKind::GatheredParameters) continue;
    int first = -1, last = -1;
    for (std::size_t i = 0; i < ops.size(); ++i)
      if (std::find(ops[i].uses.begin(), ops[i].uses.end(), static_cast<int>(b)) != ops[i].uses.end()) {
        if (first < 0) first = static_cast<int>(i);
        last = static_cast<int>(i);
      }
    Unit& u = by_first_use[first];
    u.first_use = first;
    u.last_use = std::max(u.last_use, last);
    u.gathers.push_back(buf.alloc);
    u.bytes += buf.bytes;
  }
  std::vector<Unit> out;
  for (auto& [first, u] : by_first_use) out.push_back(std::move(u));
  return out;
}

}  // namespace

// 1F1B uses each copy once, before the next unit's first use: the wait is that use.
TEST(Zero3Prefetch, EachUnitWaitsForTheLastUseOfTheUnitPrefetchPlusOneBefore) {
  for (int prefetch : {0, 1, 2}) {
    const CompileResult r = compile_zero3(prefetch);
    EXPECT_TRUE(verify(r.program).empty()) << "prefetch " << prefetch;
    for (const Plan& plan : r.program.plans) {
      int compute = -1;
      const auto units = units_by_first_use(plan, &compute);
      // Each dense segment of the device's stage is gathered for the forward and for the backward of
      // every microbatch, and each gather is its segment's own unit (a step's gathers do not gate its
      // other segments): one unit per gathered copy.
      std::size_t copies = 0;
      for (const Buffer& b : plan.buffers) copies += b.kind == BufferKind::GatheredParameters;
      EXPECT_GE(units.size(), static_cast<std::size_t>(2 * kMicrobatches)) << "prefetch " << prefetch;
      EXPECT_EQ(units.size(), copies) << "prefetch " << prefetch;
      for (std::size_t k = 0; k < units.size(); ++k) {
        ASSERT_GE(units[k].first_use, 0);
        for (const OpRef& g : units[k].gathers) {
          const Op& op = plan.streams[static_cast<std::size_t>(g.stream)].ops[static_cast<std::size_t>(g.index)];
          ASSERT_EQ(op.kind, OpKind::AllGather);
          int waited = -1;  // the compute op this gather waits for, if any
          for (const OpRef& w : op.waits)
            if (w.stream == compute) waited = w.index;
          if (k < static_cast<std::size_t>(prefetch) + 1) {
            EXPECT_EQ(waited, -1) << "prefetch " << prefetch << ": unit " << k << " (" << op.label << ") needs no wait";
          } else {
            ASSERT_LT(units[k - 1 - static_cast<std::size_t>(prefetch)].last_use, units[k].first_use);
            EXPECT_EQ(waited, units[k - 1 - static_cast<std::size_t>(prefetch)].last_use)
                << "prefetch " << prefetch << ": unit " << k << " (" << op.label << ")";
          }
        }
      }
    }
  }
}

// The simulated peak of gathered parameters: with prefetch p, unit k's gathers start once the last
// use of unit k-1-p has finished and freed its copies: at most p + 1 units' copies are live. Without
// a limit the gathers of later microbatches pile up.
TEST(Zero3Prefetch, LiveGatheredCopiesStayWithinThePrefetchLimit) {
  std::map<int, std::int64_t> peak;  // prefetch -> max over devices of the gathered bytes' peak
  for (int prefetch : {0, 1, 2, kNoLimit}) {
    const CompileResult r = compile_zero3(prefetch);
    std::int64_t largest = 0;  // the largest unit
    for (const Plan& plan : r.program.plans) {
      int compute = -1;
      for (const Unit& u : units_by_first_use(plan, &compute)) largest = std::max(largest, u.bytes);
    }
    piper::sim::SimulateOptions options;
    options.engine = "analytic";
    const auto sim = piper::sim::simulate_program(std::make_shared<const Program>(r.program), options);
    for (const auto& d : sim.report.per_device) {
      auto it = d.peak_bytes_by_kind.find("gathered_parameters");
      ASSERT_NE(it, d.peak_bytes_by_kind.end());
      peak[prefetch] = std::max(peak[prefetch], it->second);
    }
    if (prefetch != kNoLimit) {
      EXPECT_LE(peak[prefetch], (prefetch + 1) * largest) << "prefetch " << prefetch;
    }
    EXPECT_GE(peak[prefetch], largest);
  }
  EXPECT_LE(peak[0], peak[1]);
  EXPECT_LE(peak[1], peak[2]);
  EXPECT_GT(peak[kNoLimit], peak[1]) << "without a limit the gather stream runs ahead of the compute";
}

// The default is a prefetch of 1.
TEST(Zero3Prefetch, DefaultIsOneGatherAhead) {
  const CompileResult a = compile_zero3(-1), b = compile_zero3(1);
  ASSERT_EQ(a.program.plans.size(), b.program.plans.size());
  for (std::size_t p = 0; p < a.program.plans.size(); ++p)
    for (std::size_t s = 0; s < a.program.plans[p].streams.size(); ++s)
      for (std::size_t i = 0; i < a.program.plans[p].streams[s].ops.size(); ++i) {
        const Op& x = a.program.plans[p].streams[s].ops[i];
        const Op& y = b.program.plans[p].streams[s].ops[i];
        EXPECT_EQ(x.label, y.label);
        ASSERT_EQ(x.waits.size(), y.waits.size()) << x.label;
        for (std::size_t w = 0; w < x.waits.size(); ++w) EXPECT_EQ(x.waits[w].index, y.waits[w].index) << x.label;
      }
}

// "gather_unit": "block" (what --zero 3 writes): each transformer block is a segment of its own, so
// ZeRO-3 gathers block by block. llama3-8b (32 blocks) over PP 2: stage 0 holds the embedding and
// blocks 0-15, stage 1 blocks 16-31 and the final norm + head, so 17 parameter segments per stage,
// each gathered once per microbatch for the forward and once for the backward; with the published
// unit a stage is one segment. With one block's copies live at a time (+ the next, prefetched),
// ZeRO-3 then needs less memory than ZeRO-2, as it does under FSDP.
TEST(Zero3Prefetch, BlockUnitsGatherEachTransformerBlock) {
  constexpr int M = 2;
  auto scenario = [&](int zero) {
    Scenario s;
    s.model = "llama3-8b";
    s.strategy.pp = 2, s.strategy.dp = 2, s.strategy.zero = zero;
    s.strategy.schedule = "1f1b", s.strategy.microbatches = M;
    return s;
  };
  const CompiledScenario blocks = compile_scenario(scenario(3));
  EXPECT_EQ(blocks.result.program.stats.nodes_by_kind.at("ALL_GATHER"), 2 * 17 * M * 2);

  // The same program with the published unit: one gather per stage, microbatch and pass.
  json program = blocks.program.to_json();
  for (auto& d : program)
    if (d["op"] == "replicate") d.erase("gather_unit");
  Scenario published = scenario(3);
  published.directives = program;
  published.directives_source = "published.json";
  const CompiledScenario stages = compile_scenario(published);
  EXPECT_EQ(stages.result.program.stats.nodes_by_kind.at("ALL_GATHER"), 2 * 1 * M * 2);

  piper::sim::SimulateOptions options;
  options.engine = "analytic";
  const auto peak = [&](const Scenario& s) { return piper::sim::simulate(s, options).report.peak_memory_bytes; };
  const std::int64_t zero2 = peak(scenario(2)), zero3_blocks = peak(scenario(3)), zero3_stages = peak(published);
  EXPECT_LT(zero3_blocks, zero2);
  EXPECT_LT(zero3_blocks, zero3_stages);
}

TEST(Zero3Prefetch, GatherUnitIsCheckedWhenParsed) {
  for (const char* bad : {R"("shard_grads":true,"gather_unit":"block")",
                          R"("shard_grads":true,"shard_params":true,"gather_unit":"layer")",
                          R"("shard_grads":true,"shard_params":true,"gather_unit":1)"}) {
    try {
      parse_directives(json::parse(std::string(R"([{"op":"replicate","filter":{},"devices":[0,1],)") + bad + "}]"));
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const DirectiveError& e) {
      EXPECT_EQ(e.field(), "gather_unit") << bad;
    }
  }
}
