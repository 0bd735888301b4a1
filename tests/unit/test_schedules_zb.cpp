// The automatic zero-bubble scheduler (zb-auto: ZB-1p, ZB-2p; Qi et al., ICLR 2024): under uniform
// costs its times equal the hand-derived ones (ZB-1p = ZB-H1, ZB-2p zero bubble), the compiled plan's
// peak activations never exceed the limit, it verifies and simulates in both engines at the hand-derived
// step time, and bad limits fail with one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "piper/core/scenario.hpp"
#include "piper/core/schedule_view.hpp"
#include "piper/core/schedules_zb.hpp"
#include "piper/core/strategy.hpp"
#include "piper/sim/simulate.hpp"
#include "unit_costs.hpp"

namespace core = piper::core;
namespace sim = piper::sim;

namespace {

core::StrategyOptions shape(int p, int m, const std::string& limit, const std::string& family = "zb-auto") {
  core::StrategyOptions o;
  o.schedule = family;
  o.pp = p;
  o.microbatches = m;
  o.zb_memory_limit = limit;
  return o;
}

core::ZbProblem uniform(int p, int m, double limit_microbatches, double comm = 0) {
  core::ZbProblem z;
  z.stages = p, z.microbatches = m, z.comm = comm;
  const auto s = static_cast<std::size_t>(p);
  z.f = z.b = z.w = std::vector<double>(s, 1.0);
  z.mem_f = std::vector<double>(s, 1.0);
  z.mem_b = std::vector<double>(s, 0.0);
  z.mem_w = std::vector<double>(s, -1.0);
  z.max_mem = std::vector<double>(s, limit_microbatches);
  return z;
}

// A rank's span in the compiled plan's unit-time view: last op end - first op start.
int span(const core::RankTimeline& r) {
  int first = r.ops.front().start, last = 0;
  for (const auto& op : r.ops) first = std::min(first, op.start), last = std::max(last, op.end);
  return last - first;
}

std::string error_of(const core::StrategyOptions& o) {
  try {
    core::generate_program(o);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

// p = 4, m = 8, F = B = W = 1 (B the input gradient), free transfers. Each stage is busy m(F+B+W) = 24.
// ZB-2p: rank 0 runs 2(p-1)+1 = 7 forwards, exactly until its first B arrives at 7 (F on 4 stages,
// B back over 4: 1+1+1+1 + 1+1+1 after its own F0), then never waits: span 24, zero bubble (the
// paper's Table 3 ZB-2p row, and ZB-H2's (p-1)(F+B-2W) = 0). ZB-1p: p = 4 in flight; rank 0 idles
// (p-1)(F+B-W) = 3 (ZB-H1's bubble): span 27.
TEST(ZbAuto, UniformCostsGiveTheHandDerivedSpans) {
  const auto two = core::zb_auto_solve(uniform(4, 8, 8));
  EXPECT_EQ(two.max_span, 24.0) << two.variant;
  for (double s : two.span) EXPECT_EQ(s, 24.0);
  const auto one = core::zb_auto_solve(uniform(4, 8, 4));
  EXPECT_EQ(one.max_span, 27.0) << one.variant;
  EXPECT_EQ(one.span[0], 27.0);
  for (double peak : one.peak_mem) EXPECT_LE(peak, 4.0);
  for (double peak : two.peak_mem) EXPECT_LE(peak, 8.0);
}

// The compiled plans under Piper's unit costs (F = 1, B = 2 split into BI = 1 and BW = 1): ZB-1p's step
// equals ZB-H1's, m(F+B) + (p-1)(F+B-2W) = 24 + 3 = 27, and so does ZB-2p's (the last stage cannot
// start before (p-1)F = 3 and is busy 24); ZB-2p's gain is each rank's span, 24 on every rank.
TEST(ZbAuto, CompiledPlansMatchZbH1AndZeroBubble) {
  const core::UnitCosts costs{1, 2, 1};
  const auto h1 = core::unit_time_schedule(shape(4, 8, "1p", "zb-h1"), costs);
  const auto one = core::unit_time_schedule(shape(4, 8, "1p"), costs);
  const auto two = core::unit_time_schedule(shape(4, 8, "2p"), costs);
  EXPECT_EQ(h1.step_time, 27);
  EXPECT_EQ(one.step_time, 27);
  EXPECT_EQ(two.step_time, 27);
  EXPECT_EQ(span(one.ranks[0]), 27);
  for (const auto& r : two.ranks) EXPECT_EQ(span(r), 24);
}

// The limit holds on the compiled plan (activations alive from F's start to their last use's end) for
// several shapes, and every shape compiles, i.e. verifies (no wait cycle, matched transfers).
TEST(ZbAuto, PeakActivationsNeverExceedTheLimit) {
  const core::UnitCosts costs{1, 2, 1};
  for (int p : {2, 4, 8})
    for (int m : {1, p, 2 * p, 3 * p + 1})
      for (int k : {1, 2, 3}) {
        SCOPED_TRACE("p" + std::to_string(p) + " m" + std::to_string(m) + " limit " + std::to_string(k) + "p");
        core::UnitSchedule s;
        ASSERT_NO_THROW(s = core::unit_time_schedule(shape(p, m, std::to_string(k) + "p"), costs));
        ASSERT_EQ(static_cast<int>(s.ranks.size()), p);
        for (const auto& r : s.ranks) {
          EXPECT_LE(r.peak_activations, k * p);
          EXPECT_EQ(r.busy, m * 3);
        }
      }
}

// Uneven costs and transfers: every variant keeps the limit, and more memory never lengthens the span.
TEST(ZbAuto, UnevenCostsKeepTheLimit) {
  core::ZbProblem z = uniform(4, 12, 4, 0.25);
  z.f = {1.0, 1.2, 0.9, 1.5};
  z.b = {1.1, 1.0, 1.3, 1.6};
  z.w = {0.8, 0.9, 0.7, 1.0};
  const auto one = core::zb_auto_solve(z);
  for (double peak : one.peak_mem) EXPECT_LE(peak, 4.0);
  z.max_mem = std::vector<double>(4, 8.0);
  const auto two = core::zb_auto_solve(z);
  for (double peak : two.peak_mem) EXPECT_LE(peak, 8.0);
  EXPECT_LE(two.max_span, one.max_span);
}

// Both engines run the plan to the hand-derived step time of 27 unit seconds (everything but F, BI, BW
// free), so their event orders agree with the unit-time view.
TEST(ZbAuto, BothEnginesGiveTheHandDerivedStepTime) {
  for (const std::string engine : {"analytic", "simgrid"})
    for (const std::string limit : {"1p", "2p"}) {
      SCOPED_TRACE(engine + " " + limit);
      core::Scenario s;
      s.model = "qwen3-9m";
      s.stages = 4;
      s.strategy = shape(4, 8, limit);
      s.engine = engine;
      const core::CompiledScenario c = core::compile_scenario(s);
      sim::SimulateOptions o;
      o.op_override = piper::test::unit_costs(c.result.program);
      o.cluster = "dgx-h200";
      const auto r = sim::simulate(s, o);
      EXPECT_NEAR(r.report.step_time_s, 27.0, 1e-9);  // segment shares of 1/3 do not sum exactly
    }
}

TEST(ZbAuto, BadLimitsFailWithOneLine) {
  EXPECT_EQ(error_of(shape(4, 8, "abc")),
            "zb-auto: --zb-memory-limit 'abc' is not <k>p (k >= 1, e.g. 1p, 2p) or a byte size (e.g. 20GiB)");
  EXPECT_EQ(error_of(shape(4, 8, "0p")),
            "zb-auto: --zb-memory-limit '0p' is not <k>p (k >= 1, e.g. 1p, 2p) or a byte size (e.g. 20GiB)");
  EXPECT_EQ(error_of(shape(4, 8, "20GiB")),
            "zb-auto: --zb-memory-limit 20GiB in bytes needs each region's activation size, which the simulator "
            "measures (piper simulate); use 1p or 2p here");
  auto v2 = shape(4, 8, "1p");
  v2.virtual_stages = 2;
  EXPECT_EQ(error_of(v2), "zb-auto: --virtual 2 is not supported (its shape fixes 1 region(s) per rank)");
  core::ZbProblem tight = uniform(4, 8, 0.5);
  try {
    core::zb_auto_solve(tight);
    ADD_FAILURE() << "a limit below one microbatch was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "zb-auto: stage 0: the memory limit holds not even one microbatch's activations");
  }
}
