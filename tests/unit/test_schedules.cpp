// Schedule families: every family compiles and verifies for several (p, m, v), composed with EP and
// ZeRO-3; their unit-time bubbles and peak activations equal the published closed forms; their
// constraints fail with one line.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/schedule_view.hpp"
#include "piper/core/strategy.hpp"

namespace core = piper::core;

namespace {

core::StrategyOptions shape(const std::string& family, int p, int m, int v = 1) {
  core::StrategyOptions o;
  o.schedule = family;
  o.pp = p;
  o.microbatches = m;
  o.virtual_stages = v;
  return o;
}

// Unit costs of the papers' comparisons: F = 1, B = 2 (BI = 1, BW = W = 1); an F&B pair = F + B = 3.
const core::UnitCosts kCosts{1, 2, 1};
constexpr int F = 1, B = 2, W = 1, FB = F + B;

}  // namespace

TEST(Schedules, RegistryHasEveryPublishedFamily) {
  std::vector<std::string> names;
  for (const auto& f : core::schedule_registry()) names.push_back(f.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"gpipe", "1f1b", "interleaved-1f1b", "interleaved-1f1b-overlap", "looped-bfs",
                                      "zb-h1", "zb-h2", "zb-auto", "zb-v", "dualpipev", "dualpipe"}));
}

// compile() lowers and verifies (send/recv matching, collective order, no wait cycle), so a
// schedule that compiles here is deadlock-free; a cyclic order fails with "order would create a cycle".
TEST(Schedules, EveryFamilyCompilesAndVerifiesForSeveralShapes) {
  struct Case {
    std::string family;
    int p, m, v;
  };
  std::vector<Case> cases;
  for (const std::string f : {"gpipe", "1f1b", "zb-h2", "zb-v", "dualpipev", "dualpipe"})
    for (auto [p, m] : {std::pair{2, 4}, std::pair{4, 8}, std::pair{4, 10}, std::pair{8, 16}})
      cases.push_back({f, p, m, 1});
  for (const std::string f : {"interleaved-1f1b", "looped-bfs", "zb-h1"})
    for (auto [p, m, v] : {std::tuple{2, 4, 2}, std::tuple{4, 8, 2}, std::tuple{4, 4, 3}, std::tuple{4, 12, 1}})
      cases.push_back({f, p, m, v});
  for (auto [p, m, v] : {std::tuple{2, 4, 2}, std::tuple{4, 8, 2}, std::tuple{4, 4, 3}, std::tuple{1, 4, 1}})
    cases.push_back({"interleaved-1f1b-overlap", p, m, v});
  cases.push_back({"zb-v", 4, 3, 1});  // fewer microbatches than the V's depth
  cases.push_back({"zb-h1", 4, 2, 1});
  for (const auto& c : cases) {
    SCOPED_TRACE(c.family + " p" + std::to_string(c.p) + " m" + std::to_string(c.m) + " v" + std::to_string(c.v));
    core::UnitSchedule s;
    ASSERT_NO_THROW(s = core::unit_time_schedule(shape(c.family, c.p, c.m, c.v), kCosts));
    ASSERT_EQ(static_cast<int>(s.ranks.size()), c.p);
    // Every rank runs each of its (stage, microbatch) forwards and backwards exactly once.
    const int stages_per_rank = c.family == "zb-v" || c.family == "dualpipev" ? 2 : c.family == "dualpipe" ? 2 : c.v;
    for (const auto& r : s.ranks) EXPECT_EQ(r.busy, stages_per_rank * c.m * (F + B) / (c.family == "dualpipe" ? 2 : 1));
  }
}

TEST(Schedules, EveryFamilyComposesWithExpertParallelismAndZero3AtEightRanks) {
  for (const auto& family : core::schedule_registry()) {
    SCOPED_TRACE(family.name);
    core::Scenario s;
    s.model = "qwen3-1b";  // 16 blocks: enough for 2 x 8 regions; 4 experts
    s.seq_len = 256;
    s.strategy = shape(family.name, 8, 32,
                       family.name == "interleaved-1f1b" || family.name == "interleaved-1f1b-overlap" ||
                               family.name == "looped-bfs" || family.name == "zb-h1"
                           ? 2
                           : 1);
    s.strategy.dp = 4, s.strategy.ep = 4, s.strategy.zero = 3;
    core::CompiledScenario c;
    ASSERT_NO_THROW(c = core::compile_scenario(s));
    EXPECT_EQ(c.result.program.num_devices, 32);
    EXPECT_GT(c.result.dag.counts_by_kind().at("ALL_TO_ALL"), 0);
    EXPECT_GT(c.result.dag.counts_by_kind().at("ALL_GATHER"), 0);
  }
}

// 1F1B (Narayanan et al. 2021): bubble (p-1)(F+B) on every rank, p-r activations on rank r.
TEST(ScheduleFormulas, OneFOneB) {
  for (int p : {4, 8})
    for (int m : {p, 2 * p, 3 * p + 1}) {
      const auto s = core::unit_time_schedule(shape("1f1b", p, m), kCosts);
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(s.ranks[r].bubble, (p - 1) * (F + B)) << "p" << p << " m" << m << " rank " << r;
        EXPECT_EQ(s.ranks[r].peak_activations, p - r) << "p" << p << " m" << m << " rank " << r;
      }
    }
}

// ZB-H1 (Qi et al. 2023): bubble (p-1)(F+B-2W) (B the full backward), p activations on every rank.
TEST(ScheduleFormulas, ZeroBubbleH1) {
  for (int p : {4, 8})
    for (int m : {p, 2 * p, 3 * p + 1}) {
      const auto s = core::unit_time_schedule(shape("zb-h1", p, m), kCosts);
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(s.ranks[r].bubble, (p - 1) * (F + B - 2 * W)) << "p" << p << " m" << m << " rank " << r;
        EXPECT_EQ(s.ranks[r].peak_activations, p) << "p" << p << " m" << m << " rank " << r;
      }
    }
}

// Interleaved 1F1B: bubble (p-1)(F+B)/v in units of a whole rank's F and B. Each of the v chunks costs
// F and B here, so a rank's stage costs vF and vB: the bubble is (p-1)(vF+vB)/v = (p-1)(F+B).
TEST(ScheduleFormulas, Interleaved) {
  for (int p : {4, 8})
    for (int v : {2, 4})
      for (int m : {p, 2 * p}) {
        const auto s = core::unit_time_schedule(shape("interleaved-1f1b", p, m, v), kCosts);
        for (int r = 0; r < p; ++r) {
          EXPECT_EQ(s.ranks[r].bubble * v, (p - 1) * (v * F + v * B)) << "p" << p << " v" << v << " m" << m;
          EXPECT_EQ(s.ranks[r].busy, m * (v * F + v * B));
        }
      }
}

// DualPipe and DualPipeV (DeepSeek-V3 report, Table 2): bubble (PP/2-1)(F&B+B-3W) with PP the
// number of stages (p per model copy for DualPipe, 2p for DualPipeV's V); DualPipe keeps at most
// PP+1 stage activations on a rank.
TEST(ScheduleFormulas, DualPipeAndDualPipeV) {
  for (int p : {4, 8}) {
    for (int m : {2 * p, 3 * p, 4 * p + 2}) {
      const int stages = 2 * p;
      const auto s = core::unit_time_schedule(shape("dualpipev", p, m), kCosts);
      for (int r = 0; r < p; ++r)
        EXPECT_EQ(s.ranks[r].bubble, (stages / 2 - 1) * (FB + B - 3 * W))
            << "dualpipev p" << p << " m" << m << " rank " << r;
    }
    for (int m : {2 * p, 4 * p}) {
      const int stages = p;
      const auto s = core::unit_time_schedule(shape("dualpipe", p, m), kCosts);
      int peak = 0;
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(s.ranks[r].bubble, (stages / 2 - 1) * (FB + B - 3 * W))
            << "dualpipe p" << p << " m" << m << " rank " << r;
        peak = std::max(peak, s.ranks[r].peak_activations);
      }
      EXPECT_EQ(peak, stages + 1) << "dualpipe p" << p << " m" << m;
    }
  }
}

TEST(ScheduleFormulas, RenderedGridMarksOverlappedPairs) {
  const auto o = shape("dualpipev", 2, 4);
  const auto table = core::schedule_table(o);
  const std::string text = core::render_unit_schedule(core::unit_time_schedule(o, kCosts), &table);
  EXPECT_NE(text.find("0F0"), std::string::npos);
  // Rank 0 of 2: phases 1-3 are 0F0 0F1 | 0F2 3F0 | 3I0 3W0 3F1, then the overlapped (0F3;3B1).
  EXPECT_NE(text.find("3B1*"), std::string::npos);
  EXPECT_NE(text.find("0F3*"), std::string::npos);
  EXPECT_EQ(text.find("0F2*"), std::string::npos);
  EXPECT_NE(text.find("peak activations"), std::string::npos);
}

// A grid of 10^9 time units (huge --costs) is refused before its rows are built, not drawn.
TEST(ScheduleFormulas, OversizedGridRefusedBeforeItIsBuilt) {
  core::UnitSchedule s;
  s.step_time = 1000000000;
  s.ranks.resize(2);
  try {
    (void)core::render_unit_schedule(s, nullptr);
    FAIL() << "rendered";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 ranks x 1000000000 time units"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)core::unit_time_schedule(shape("1f1b", 2, 2), core::UnitCosts{1, 1000, 1}), core::Error);
}

// `schedule show 1f1b --ranks 400 --microbatches 1600` compiled 1.3 million ops for minutes and 4.6 GB
// before the grid it was to print (over 2 * 10^7 characters) was refused or drawn. A grid that cannot
// take fewer than 2 * 10^6 characters is refused from the flags, before the directive program and the
// compile; the bound is a lower one (never above the text shown).
TEST(ScheduleFormulas, ShowRefusesAnEnormousGridBeforeCompiling) {
  // 4 x 2048 x (100 + 100) time units of cells 7 wide: 11.5 million characters. A small compile, so
  // that without the check the test fails in about a second (a grid drawn, no error).
  try {
    (void)core::schedule_show_text(shape("1f1b", 4, 2048), core::UnitCosts{100, 100, 1});
    FAIL() << "shown";
  } catch (const core::Error& e) {
    EXPECT_STREQ(e.what(),
                 "schedule show: a grid of --ranks 4 x --microbatches 2048 with --costs 100,100,1 takes at least "
                 "11468800 characters (at most 2000000): give fewer ranks or microbatches, or smaller --costs "
                 "(schedule export-csv writes a schedule of any size)");
  }
  for (const auto& family : core::schedule_registry())
    for (const auto& [p, m, v] : {std::tuple{2, 4, 1}, std::tuple{4, 12, 1}, std::tuple{2, 8, 2}}) {
      const auto o = shape(family.name, p, m, v);
      std::string text;
      try {
        text = core::schedule_show_text(o, kCosts);
      } catch (const core::Error&) {
        continue;  // a shape the family does not take
      } catch (const std::invalid_argument&) {
        continue;
      }
      const double least = core::schedule_grid_chars_at_least(o, kCosts);
      EXPECT_GT(least, 0) << family.name;
      EXPECT_LE(least, static_cast<double>(text.size())) << family.name << " " << p << "x" << m << " v" << v;
    }
}

// DualPipeV's eight phases for rank 0 of 4 ranks and 10 microbatches, derived by hand from the rule
// (phase 1: 6 F0; 2: F0 F1; 3: 3 x I1 W1 F1; 4: 3 x (F0&B1, F1&B0); 5: 3 x B1, F1&B0; 6: B1 I0;
// 7: 3 x W0 I0; 8: W0), stages 0 and 7.
TEST(Schedules, DualPipeVPhasesOfRankZero) {
  const auto t = core::schedule_table(shape("dualpipev", 4, 10));
  std::string got;
  for (const auto& step : t.ranks[0]) {
    if (!got.empty()) got += ' ';
    for (std::size_t k = 0; k < step.size(); ++k) {
      if (k) got += '&';
      got += std::to_string(step[k].stage) + core::to_char(step[k].kind) + std::to_string(step[k].microbatch);
    }
  }
  EXPECT_EQ(got,
            "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 0F7&7B3 7F4&0B0 0F8&7B4 7F5&0B1 "
            "0F9&7B5 7F6&0B2 7B6 7F7&0B3 7B7 7F8&0B4 7B8 7F9&0B5 7B9 0I6 0W6 0I7 0W7 0I8 0W8 0I9 0W9");
}

namespace {

// A rank's steps as text: "4F0 4F1 0F2&4B0 ...", overlapped members joined by '&'.
std::string steps_text(const std::vector<core::ScheduleStep>& steps) {
  std::string got;
  for (const auto& step : steps) {
    if (!got.empty()) got += ' ';
    for (std::size_t k = 0; k < step.size(); ++k) {
      if (k) got += '&';
      got += std::to_string(step[k].stage) + core::to_char(step[k].kind) + std::to_string(step[k].microbatch);
    }
  }
  return got;
}

}  // namespace

// interleaved-1f1b-overlap runs interleaved-1f1b's forwards and its backwards each in the same order,
// with one more warmup forward on every rank ((v-1)p + 2(p-1-r) + 1 with m a multiple of p), and pairs
// each later forward with the next backward: m*v - warmup two-member steps, each an F and a B.
TEST(Schedules, OverlapPairsTheSteadyStateOfInterleaved) {
  using Kind = core::ActionKind;
  for (auto [p, m, v] : {std::tuple{2, 4, 2}, std::tuple{4, 8, 2}, std::tuple{4, 12, 3}}) {
    const auto plain = core::schedule_table(shape("interleaved-1f1b", p, m, v));
    const auto paired = core::schedule_table(shape("interleaved-1f1b-overlap", p, m, v));
    for (int r = 0; r < p; ++r) {
      SCOPED_TRACE("p" + std::to_string(p) + " m" + std::to_string(m) + " v" + std::to_string(v) + " rank " +
                   std::to_string(r));
      auto of_kind = [](const std::vector<core::ScheduleStep>& steps, Kind k) {
        std::vector<core::ScheduleAction> out;
        for (const auto& st : steps)
          for (const auto& a : st)
            if (a.kind == k) out.push_back(a);
        return out;
      };
      EXPECT_EQ(of_kind(paired.ranks[r], Kind::F), of_kind(plain.ranks[r], Kind::F));
      EXPECT_EQ(of_kind(paired.ranks[r], Kind::B), of_kind(plain.ranks[r], Kind::B));
      const int warmup = (v - 1) * p + 2 * (p - 1 - r) + 1;
      int pairs = 0, leading_forwards = 0;
      for (const auto& st : paired.ranks[r]) {
        if (st.size() == 2) {
          ++pairs;
          EXPECT_EQ(st[0].kind, Kind::F);
          EXPECT_EQ(st[1].kind, Kind::B);
          EXPECT_FALSE(st[0].stage == st[1].stage && st[0].microbatch == st[1].microbatch);
        } else if (pairs == 0 && st[0].kind == Kind::F) {
          ++leading_forwards;
        }
      }
      EXPECT_EQ(leading_forwards, warmup);
      EXPECT_EQ(pairs, m * v - warmup);
    }
  }
  // Rank 1 of 2, v = 2, m = 4 (stages 1 and 3), derived from the rule: warmup (2-1)*2 + 2*0 + 1 = 3
  // forwards (1F0 1F1 3F0), then forward k with the backward after it; backwards walk 3, 3, 1, 1, ...
  EXPECT_EQ(steps_text(core::schedule_table(shape("interleaved-1f1b-overlap", 2, 4, 2)).ranks[1]),
            "1F0 1F1 3F0 3F1&3B0 1F2&3B1 1F3&1B0 3F2&1B1 3F3&3B2 3B3 1B2 1B3");
  // Without a pipeline, one forward runs ahead and each later forward pairs with the previous backward.
  EXPECT_EQ(steps_text(core::schedule_table(shape("interleaved-1f1b-overlap", 1, 4, 1)).ranks[0]),
            "0F0 0F1&0B0 0F2&0B1 0F3&0B2 0B3");
}

TEST(Schedules, ConstraintsFailWithOneLine) {
  auto message = [](const core::StrategyOptions& o) {
    try {
      core::generate_program(o);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(shape("dualpipev", 4, 6)), "dualpipev: --microbatches 6 must be >= 2 x --pp = 8");
  EXPECT_EQ(message(shape("dualpipe", 3, 12)), "dualpipe: --pp 3 must be even (the two directions meet in the middle)");
  EXPECT_EQ(message(shape("dualpipe", 4, 9)), "dualpipe: --microbatches 9 must be even and >= 2 x --pp = 8");
  EXPECT_EQ(message(shape("interleaved-1f1b", 4, 6, 2)),
            "interleaved-1f1b: --microbatches 6 must be a multiple of --pp 4 with --virtual 2 (microbatches go through "
            "the virtual stages in groups of pp)");
  EXPECT_EQ(message(shape("interleaved-1f1b-overlap", 4, 8, 1)),
            "interleaved-1f1b-overlap: needs --virtual 2 or more with --pp 4 (Megatron-core overlaps F and B only in "
            "the interleaved schedule)");
  EXPECT_EQ(message(shape("zb-v", 4, 8, 3)),
            "zb-v: --virtual 3 is not supported (its shape fixes 2 region(s) per rank)");
  for (const auto& o : {shape("dualpipev", 4, 6), shape("interleaved-1f1b", 4, 6, 2)})
    EXPECT_EQ(message(o).find('\n'), std::string::npos);
}

// The mirrored copies of DualPipe: region k on ranks k and p-1-k, reduced together.
TEST(Schedules, DualPipePlacesMirroredCopiesAndReducesThemTogether) {
  auto o = shape("dualpipe", 4, 8);
  o.dp = 2;
  const auto program = core::generate_program(o).to_json();
  int replicates = 0;
  for (const auto& d : program) {
    if (d["op"] == "place" && d["filter"]["PP"] == 1) {
      EXPECT_EQ(d["devices"], (nlohmann::json{1, 5, 2, 6}));
    }
    if (d["op"] == "replicate" && d["filter"]["PP"] == 0) {
      EXPECT_EQ(d["devices"], (nlohmann::json{0, 4, 3, 7}));
    }
    if (d["op"] == "split") {
      EXPECT_EQ(d["num_microbatches"], 4);  // each DAG microbatch runs on both copies
    }
    replicates += d["op"] == "replicate";
  }
  EXPECT_EQ(replicates, 4);
}
