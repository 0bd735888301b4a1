// V placements (ZB-V, DualPipeV) with the embedding and the LM head as PP regions of their own
// (--v-embedding, --v-head, the place directive's "holds"): where their ops run, how the blocks are
// balanced around them, the automatic choice, and the one-line refusals.
#include <algorithm>
#include <functional>
#include <tuple>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/sim/simulate.hpp"

using namespace piper;

namespace {

core::Scenario v_scenario(const std::string& schedule, int pp, const std::string& head, const std::string& embedding,
                          int microbatches = 8) {
  core::Scenario s;
  s.model = "qwen3-1b";
  s.strategy.schedule = schedule;
  s.strategy.pp = pp;
  s.strategy.microbatches = microbatches;
  s.strategy.v_head = head;
  s.strategy.v_embedding = embedding;
  return s;
}

// The program segments whose layers are all of `kind`'s end: the head (final norm + head) or the embedding.
std::set<int> end_segments(const core::CompiledScenario& c, bool head) {
  std::set<int> out;
  const auto& layers = c.model.layers();
  for (std::size_t s = 0; s < c.result.program.segments.size(); ++s) {
    const auto& seg = c.result.program.segments[s];
    bool all = seg.first_layer < seg.last_layer;
    for (int l = seg.first_layer; l < seg.last_layer; ++l)
      all &= layers[static_cast<std::size_t>(l)].block < 0 &&
             (head ? layers[static_cast<std::size_t>(l)].kind != core::LayerKind::Embedding
                   : layers[static_cast<std::size_t>(l)].kind == core::LayerKind::Embedding);
    if (all) out.insert(static_cast<int>(s));
  }
  return out;
}

// Per device: how many compute ops of `segments`, and how many other compute ops.
std::vector<std::pair<int, int>> compute_ops(const core::Program& p, const std::set<int>& segments) {
  std::vector<std::pair<int, int>> out(static_cast<std::size_t>(p.num_devices));
  for (int d = 0; d < p.num_devices; ++d)
    for (const auto& stream : p.plan_for(d).streams)
      for (const auto& op : stream.ops)
        if (op.kind == core::OpKind::Compute)
          ++(segments.count(op.segment) ? out[static_cast<std::size_t>(d)].first
                                        : out[static_cast<std::size_t>(d)].second);
  return out;
}

TEST(VEnds, HeadAndEmbeddingOpsRunOnTheChosenRanks) {
  // ZB-V on 4 ranks (one device each), head on rank 3, embedding on rank 2: F, BI and BW of the head
  // for each of the 8 microbatches on device 3 only; F and B of the embedding on device 2 only.
  const auto c = core::compile_scenario(v_scenario("zb-v", 4, "3", "2"));
  const auto head = end_segments(c, true), embedding = end_segments(c, false);
  ASSERT_EQ(head.size(), 1u);
  ASSERT_EQ(embedding.size(), 1u);
  const auto h = compute_ops(c.result.program, head), e = compute_ops(c.result.program, embedding);
  for (int d = 0; d < 4; ++d) {
    EXPECT_EQ(h[static_cast<std::size_t>(d)].first, d == 3 ? 3 * 8 : 0) << "device " << d;
    EXPECT_EQ(e[static_cast<std::size_t>(d)].first, d == 2 ? 2 * 8 : 0) << "device " << d;
  }
  // The program says so: the first and last place directives carry "holds".
  int holds = 0;
  for (const auto& d : c.program.to_json())
    if (d.value("op", "") == "place" && d.contains("holds")) ++holds;
  EXPECT_EQ(holds, 2);
}

TEST(VEnds, HeadAloneTakesTheLastRankAndTheVTheOthers) {
  const auto c = core::compile_scenario(v_scenario("dualpipev", 4, "alone", ""));
  const auto ops = compute_ops(c.result.program, end_segments(c, true));
  for (int d = 0; d < 3; ++d) {
    EXPECT_EQ(ops[static_cast<std::size_t>(d)].first, 0) << "device " << d;
    EXPECT_GT(ops[static_cast<std::size_t>(d)].second, 0) << "device " << d;
  }
  // The head's F and full backward (I then W) per microbatch; nothing else on device 3.
  EXPECT_EQ(ops[3].first, 3 * 8);
  EXPECT_EQ(ops[3].second, 0);
}

// qwen3-1b: 16 equal MoE blocks of F+B cost c, an embedding of cost E (a gather: no GEMM FLOPs) and a
// final norm + head of cost H, between 4 c and 6 c in FLOPs (vocabulary 151,936 x hidden 1024, about
// 2 x 155.6 MFLOP per token forward, against a block's attention + 2 of 4 experts of 3 x 1024 x 3584).
// On 4 ranks every V region holds at least one block, so:
//   in the V (default): rank 0 holds regions 0 and 7 and the head: E + H + 2c at best (it is the
//     busiest, so the balancer gives its regions one block each); the other 14 blocks go 5, 5, 4;
//   head alone on rank 3: H there; the V spans ranks 0..2 with 16 blocks: 6, 5, 5 (ceil(16/3)), the
//     6 not on rank 0, which also holds E;
//   head of its own on rank 3 beside its two V regions: H + 2c there at best.
TEST(VEnds, BlocksBalanceAroundTheHeadAsDerivedByHand) {
  core::Scenario s = v_scenario("dualpipev", 4, "", "");
  const auto cfg = core::scenario_model_config(s);
  const core::Model model = core::build_model(cfg);
  double c = 0, h = 0, e = 0;
  for (std::size_t l = 0; l < model.layers().size(); ++l) {
    const auto cost = model.layer_cost(l);
    const double f = cost.forward_flops + cost.backward_flops();
    const auto& layer = model.layers()[l];
    if (layer.block < 0) (layer.kind == core::LayerKind::Embedding ? e : h) += f;
    if (layer.block == 0) c += f;
  }
  ASSERT_GT(h, 4 * c);  // the premise of the derivation
  ASSERT_LT(h, 6 * c);
  auto sorted = [](std::vector<double> v) {
    std::sort(v.rbegin(), v.rend());
    return v;
  };
  const double tol = 1e-9 * (16 * c + h + e);
  const auto in_v = core::v_rank_loads(s.strategy, cfg);
  EXPECT_NEAR(in_v[0], e + h + 2 * c, tol);
  const auto others = sorted({in_v[1], in_v[2], in_v[3]});
  EXPECT_NEAR(others[0], 5 * c, tol);
  EXPECT_NEAR(others[1], 5 * c, tol);
  EXPECT_NEAR(others[2], 4 * c, tol);
  s.strategy.v_head = "alone";
  const auto alone = core::v_rank_loads(s.strategy, cfg);
  EXPECT_NEAR(alone[3], h, tol);
  EXPECT_NEAR(alone[0], e + 5 * c, tol);
  EXPECT_NEAR(std::max(alone[1], alone[2]), 6 * c, tol);
  EXPECT_NEAR(std::min(alone[1], alone[2]), 5 * c, tol);
  s.strategy.v_head = "3";
  const auto own = core::v_rank_loads(s.strategy, cfg);
  EXPECT_NEAR(own[3], h + 2 * c, tol);
}

// The simulated busy time follows the blocks: with the head alone, the V's three ranks hold 5 + E, 5
// and 6 blocks, so their busy times are within 6/5 of each other (2 % for the embedding and the
// transfers), and the busiest device of the default V (rank 0: head + 2 blocks) sheds its two blocks:
// at least 1.5 blocks' time less.
TEST(VEnds, BusyTimeBalancedWithinTheBoundDerivedByHand) {
  sim::SimulateOptions options;
  options.cluster = "dgx-h200";
  options.engine = "analytic";
  const auto in_v = sim::simulate(v_scenario("dualpipev", 4, "", ""), options).report;
  const auto alone = sim::simulate(v_scenario("dualpipev", 4, "alone", ""), options).report;
  double lo = 1e30, hi = 0;
  for (int d = 0; d < 3; ++d)
    lo = std::min(lo, alone.per_device[static_cast<std::size_t>(d)].busy_s),
    hi = std::max(hi, alone.per_device[static_cast<std::size_t>(d)].busy_s);
  EXPECT_LT(hi, lo * 6 / 5 * 1.02);
  EXPECT_GT(hi, lo * 6 / 5 * 0.98);  // one rank does hold the sixth block
  const double per_block = std::min(alone.per_device[1].busy_s, alone.per_device[2].busy_s) / 5;
  EXPECT_NEAR(in_v.per_device[0].busy_s - alone.per_device[3].busy_s, 2 * per_block, 0.5 * per_block);
}

// auto takes the choice whose replayed schedule is shortest; the simulator agrees within 2 %.
TEST(VEnds, AutoIsNoSlowerThanEveryExplicitChoiceInTheSimulator) {
  sim::SimulateOptions options;
  options.cluster = "dgx-h200";
  options.engine = "analytic";
  for (int pp : {4, 8}) {
    const double chosen = sim::simulate(v_scenario("dualpipev", pp, "auto", "", 2 * pp), options).report.step_time_s;
    double best = 1e30;
    for (const std::string& head : std::vector<std::string>{"", "0", std::to_string(pp - 1), "alone"})
      best = std::min(best, sim::simulate(v_scenario("dualpipev", pp, head, "", 2 * pp), options).report.step_time_s);
    EXPECT_LT(chosen, best * 1.02) << "pp " << pp;
  }
}

// Both engines run the plans with the ends elsewhere (the verifier passed them at compile time), and
// agree within 5 % (inside one NVLink node the transfers they model differently are short).
TEST(VEnds, BothEnginesRunTheEndsElsewhere) {
  for (const std::string& head : std::vector<std::string>{"3", "alone"}) {
    sim::SimulateOptions options;
    options.cluster = "dgx-h200";
    options.engine = "analytic";
    const double analytic = sim::simulate(v_scenario("zb-v", 4, head, "2"), options).report.step_time_s;
    options.engine = "simgrid";
    const double simgrid = sim::simulate(v_scenario("zb-v", 4, head, "2"), options).report.step_time_s;
    EXPECT_NEAR(simgrid, analytic, 0.05 * analytic) << head;
  }
}

TEST(VEnds, ScheduleTableNamesEveryActionOnceOnItsRegionsRank) {
  for (const std::string family : {"zb-v", "dualpipev"})
    for (const std::string head : {"0", "2", "alone"}) {
      core::StrategyOptions o;
      o.schedule = family;
      o.pp = 3;
      o.microbatches = 6;
      o.v_head = head;
      o.v_embedding = "1";
      const auto table = core::schedule_table(o);
      const int regions = head == "alone" ? 2 * 2 + 2 : 2 * 3 + 2;
      EXPECT_EQ(table.stages, regions) << family << " " << head;
      std::set<std::tuple<int, char, int>> seen;
      int full_b = 0;
      for (std::size_t r = 0; r < table.ranks.size(); ++r)
        for (const auto& step : table.ranks[r])
          for (const auto& a : step) {
            EXPECT_TRUE(seen.insert({a.stage, core::to_char(a.kind), a.microbatch}).second)
                << family << " " << head << ": stage " << a.stage << " " << core::to_char(a.kind) << a.microbatch;
            if (a.stage == regions - 1) {
              EXPECT_EQ(static_cast<int>(r), head == "alone" ? 2 : std::stoi(head));
            }
            if (a.stage == 0) {
              EXPECT_EQ(r, 1u);
            }
            if (a.kind == core::ActionKind::B) ++full_b;
          }
      // Per stage and microbatch: F, and either B or I + W.
      EXPECT_EQ(static_cast<int>(seen.size()) + full_b, regions * 6 * 3) << family << " " << head;
    }
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(VEnds, ImpossibleRequestsAreRefusedInOneLine) {
  core::StrategyOptions o;
  o.schedule = "zb-v";
  o.pp = 4;
  o.microbatches = 8;
  o.v_head = "4";
  EXPECT_EQ(error_of([&] { core::generate_program(o); }),
            "--v-head must be auto, alone or a pipeline rank 0..3 (got '4')");
  o.v_head = "";
  o.v_embedding = "alone";
  EXPECT_EQ(error_of([&] { core::generate_program(o); }),
            "--v-embedding must be auto or a pipeline rank 0..3 (got 'alone')");
  o.v_embedding = "";
  o.v_head = "auto";
  EXPECT_EQ(error_of([&] { core::generate_program(o); }),
            "--v-head auto chooses with the model's costs: give --model (piper simulate/compile/directives)");
  o.v_head = "1";
  o.schedule = "1f1b";
  EXPECT_EQ(error_of([&] { core::generate_program(o); }),
            "--v-head applies only to V placements (zb-v, dualpipev), not --schedule 1f1b");
  o.schedule = "dualpipev";
  o.pp = 1;
  o.v_head = "alone";
  EXPECT_EQ(error_of([&] { core::generate_program(o); }),
            "--v-head alone needs --pp 2 or more (the head takes the last rank, the V the others)");
}

// A region claimed as the head's must hold exactly the layers after the last block (scenarios annotate
// it so; a model annotated otherwise is refused), and "holds" takes two values.
TEST(VEnds, HoldsIsCheckedAgainstWhatTheRegionHolds) {
  core::Model model =
      core::build_model(core::load_model_config(std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json"));
  core::balance_pipeline(model, 2);  // the head joins the last block in region 1
  auto program = [](const std::string& holds) {
    nlohmann::json p = nlohmann::json::array();
    p.push_back({{"op", "place"}, {"filter", {{"PP", 0}}}, {"devices", {0}}, {"stream", "pp"}});
    p.push_back({{"op", "place"}, {"filter", {{"PP", 1}}}, {"devices", {1}}, {"stream", "pp"}, {"holds", holds}});
    return p;
  };
  const std::string head = error_of([&] { core::compile(model, core::parse_directives(program("head"))); });
  EXPECT_EQ(head.rfind("directive 1 field 'holds': region PP 1 holds layer ", 0), 0u) << head;
  EXPECT_NE(head.find("not only the final norm and head"), std::string::npos) << head;
  EXPECT_EQ(head.find('\n'), std::string::npos);
  const std::string embedding = error_of([&] { core::compile(model, core::parse_directives(program("embedding"))); });
  EXPECT_EQ(embedding.rfind("directive 1 field 'holds': region PP 1 holds layer ", 0), 0u) << embedding;
  EXPECT_EQ(error_of([&] { core::parse_directives(program("tail")); }),
            "directive 1 field 'holds': must be \"head\" or \"embedding\", got \"tail\"");
  // Balanced with the head as a region of its own, the same claim holds.
  core::balance_pipeline(model, 3, {false, true});
  nlohmann::json p = program("head");
  p[1]["filter"]["PP"] = 2;
  const nlohmann::json middle = {{"op", "place"}, {"filter", {{"PP", 1}}}, {"devices", {0}}, {"stream", "pp"}};
  p.insert(p.begin() + 1, middle);
  EXPECT_EQ(error_of([&] { core::compile(model, core::parse_directives(p)); }), "(no error)");
}

}  // namespace
