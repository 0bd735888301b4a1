// Tests of the compiler's and the report's fast paths against the slow ones they replace: the
// filter index against a scan of every vertex, cycle checks once per phase against checks after every
// pass, and PartnerFinder against a scan of the plans.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/scenario.hpp"
#include "piper/sim/ready_tracker.hpp"

using namespace piper;
using namespace piper::core;
using nlohmann::json;

namespace {

core::Scenario scenario(const std::string& schedule, int pp, int dp, int ep, int zero, int microbatches,
                        double bucket_mb = 0, int virtual_stages = 1) {
  core::Scenario s;
  s.model = "qwen3-9m";
  s.strategy.schedule = schedule;
  s.strategy.pp = pp;
  s.strategy.dp = dp;
  s.strategy.ep = ep;
  s.strategy.zero = zero;
  s.strategy.microbatches = microbatches;
  s.strategy.bucket_mb = bucket_mb;
  s.strategy.virtual_stages = virtual_stages;
  return s;
}

// The Program as JSON without the two fields that measure the compile run itself.
std::string program_text(const Program& p) {
  json j = p.to_json();
  j["stats"].erase("compile_seconds");
  j["stats"].erase("compiler_peak_rss_bytes");
  return j.dump();
}

Model qwen9m_one_region() {
  Model m = build_model(*zoo_config("qwen3-9m"));
  annotate_pipeline_ranges(m, {0});
  return m;
}

}  // namespace

// A hook makes apply_directives check for cycles after every pass; without one it checks once per
// phase. The DAG and the Program must not depend on it.
TEST(FastPaths, CheckingCyclesPerPhaseCompilesTheSameProgram) {
  const std::vector<core::Scenario> cases = {
      scenario("1f1b", 2, 4, 2, 3, 8, 1),    // ZeRO-3 gathers, small buckets
      scenario("zb-h1", 2, 2, 2, 1, 4),      // backward split into BI and BW
      scenario("dualpipev", 2, 2, 2, 2, 8),  // V placement, overlapped F&B steps
      scenario("interleaved-1f1b", 2, 2, 1, 0, 4, 0, 2),
  };
  for (const auto& s : cases) {
    const CompiledScenario fast = compile_scenario(s);
    int passes = 0;
    const CompiledScenario strict = compile_scenario(s, [&](const std::string&, int, const GlobalDag&) { ++passes; });
    EXPECT_GT(passes, 3) << s.strategy.schedule;
    EXPECT_EQ(fast.result.dag.to_json().dump(), strict.result.dag.to_json().dump()) << s.strategy.schedule;
    EXPECT_EQ(program_text(fast.result.program), program_text(strict.result.program)) << s.strategy.schedule;
  }
}

// Order directive 3 closes a cycle; directive 4 selects nothing. Checking every pass stops at 3; a run
// that checks once per phase reaches 4 first, and must still report 3 (it reruns strictly).
TEST(FastPaths, AnErrorAfterAnUncheckedCycleReportsTheCycle) {
  Model m = build_model(*zoo_config("qwen3-9m"));
  annotate_pipeline_ranges(m, {0, 2});
  auto step = [](int pp, int mb, const char* pass) {
    return json::array({json{{"PP", pp}, {"MB", mb}, {"PASS", pass}}});
  };
  json program = json::parse(R"([
    {"op":"split","filter":{},"dim_name":"MB","num_microbatches":2},
    {"op":"place","filter":{"PP":0},"devices":[0]},
    {"op":"place","filter":{"PP":1},"devices":[1]}])");
  program.push_back({{"op", "order"}, {"filters", {step(1, 0, "B"), step(1, 0, "F")}}});
  program.push_back({{"op", "order"}, {"filters", {step(0, 0, "F"), step(0, 7, "F")}}});
  const std::vector<AfterPassHook> hooks = {{}, [](const std::string&, int, const GlobalDag&) {}};
  for (const auto& hook : hooks) {
    GlobalDag dag = build_dag(m);
    const std::string before = dag.to_json().dump();
    try {
      apply_directives(dag, parse_directives(program), hook);
      ADD_FAILURE() << "no error";
    } catch (const DirectiveError& e) {
      EXPECT_EQ(e.index(), 3) << e.what();
      EXPECT_EQ(e.field(), "filters[1]") << e.what();
      EXPECT_NE(std::string(e.what()).find("cycle"), std::string::npos) << e.what();
    }
    EXPECT_EQ(dag.to_json().dump(), before);  // all or nothing, in both modes
  }
}

// The groups of an order directive are found through an index of the compute nodes by tag; each must
// select exactly what testing every vertex with Filter::matches selects. The filters cover a PASS-only
// filter (no exact tag: every compute node is a candidate), a wildcard, and filters without PASS.
TEST(FastPaths, OrderGroupsSelectWhatAScanOfEveryVertexSelects) {
  const Model m = qwen9m_one_region();
  const json placed = json::parse(R"([
    {"op":"split","filter":{},"dim_name":"MB","num_microbatches":3},
    {"op":"place","filter":{},"devices":[0]}])");
  const std::vector<json> filters = {
      json{{"MB", 0}, {"PASS", "F"}}, json{{"MB", 1}, {"PASS", "F"}, {"PP", "*"}}, json{{"MB", 2}, {"PASS", "F"}},
      json{{"MB", 2}, {"PASS", "B"}}, json{{"MB", 1}, {"PASS", "B"}, {"PP", 0}},   json{{"PASS", "B"}}};
  json program = placed;
  json groups = json::array();
  for (const auto& f : filters) groups.push_back(json::array({f}));
  program.push_back({{"op", "order"}, {"filters", groups}});

  // Expected: a scan of every vertex of the DAG before the order pass (which adds no compute node).
  GlobalDag before = build_dag(m);
  apply_directives(before, parse_directives(placed));
  std::vector<std::set<Vertex>> expected;
  for (const auto& f : filters) {
    const Filter filter =
        std::get<OrderDirective>(
            parse_directives(json::array({json{{"op", "order"}, {"filters", json::array({json::array({f})})}}}))
                .directives[0])
            .groups[0][0];
    std::set<Vertex> s;
    for (Vertex v = 0; v < boost::num_vertices(before.graph); ++v)
      if (filter.matches(before.graph[v])) s.insert(v);
    expected.push_back(s);
  }
  // The last filter overlaps the two before it: the pass must refuse it, naming group 5.
  GlobalDag overlapping = build_dag(m);
  try {
    apply_directives(overlapping, parse_directives(program));
    ADD_FAILURE() << "overlapping groups accepted";
  } catch (const DirectiveError& e) {
    EXPECT_EQ(e.field(), "filters[5][0]") << e.what();
  }
  // Without the overlapping filter: group g's members feed dummy g and are fed by dummy g-1.
  program.back()["filters"].erase(5);
  GlobalDag dag = build_dag(m);
  apply_directives(dag, parse_directives(program));
  std::map<std::string, Vertex> dummy;
  for (auto v : dag.live_nodes())
    if (dag.graph[v].kind == NodeKind::OrderDummy) dummy[dag.graph[v].label] = v;
  ASSERT_EQ(dummy.size(), 4u);
  for (std::size_t g = 0; g < 5; ++g) {
    std::set<Vertex> got;
    if (g < 4)
      for (auto e : boost::make_iterator_range(boost::in_edges(dummy.at("ORDER 2." + std::to_string(g)), dag.graph)))
        got.insert(boost::source(e, dag.graph));
    else
      for (auto e : boost::make_iterator_range(boost::out_edges(dummy.at("ORDER 2.3"), dag.graph)))
        got.insert(boost::target(e, dag.graph));
    EXPECT_FALSE(got.empty()) << g;
    EXPECT_EQ(got, expected[g]) << "group " << g;
  }
}

// PartnerFinder (indexes built once per Program) against the definition: the RECV of a SEND is the op
// of the peer's plan with the same node and opposite kind whose peer is this device, first in stream
// order; a collective's members run the k-th collective of its family in their own plans.
TEST(FastPaths, PartnerFinderAgreesWithAScanOfThePlans) {
  const CompiledScenario c = compile_scenario(scenario("1f1b", 2, 4, 2, 3, 4, 1));
  const Program& p = c.result.program;
  auto reference = [&](int device, OpRef r) {
    const Op& op =
        p.plan_for(device).streams[static_cast<std::size_t>(r.stream)].ops[static_cast<std::size_t>(r.index)];
    std::vector<std::pair<int, OpRef>> out;
    auto each_op = [&](int d, auto&& fn) {
      const Plan& plan = p.plan_for(d);
      for (std::size_t s = 0; s < plan.streams.size(); ++s)
        for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i)
          if (fn(plan.streams[s].ops[i], OpRef{static_cast<int>(s), static_cast<int>(i)})) return;
    };
    if (op.kind == OpKind::Send || op.kind == OpKind::Recv) {
      out.emplace_back(device, r);
      const int peer = p.peer_of(op, device);
      const OpKind want = op.kind == OpKind::Send ? OpKind::Recv : OpKind::Send;
      each_op(peer, [&](const Op& o, OpRef at) {
        if (o.kind != want || o.node != op.node || p.peer_of(o, peer) != device) return false;
        out.emplace_back(peer, at);
        return true;
      });
      return out;
    }
    auto kth = [&](int d) {
      std::vector<OpRef> seq;
      each_op(d, [&](const Op& o, OpRef at) {
        if (o.kind != OpKind::Compute && o.kind != OpKind::Update && o.kind != OpKind::Send && o.kind != OpKind::Recv &&
            o.family == op.family)
          seq.push_back(at);
        return false;
      });
      return seq;
    };
    const auto mine = kth(device);
    const auto k = static_cast<std::size_t>(std::find(mine.begin(), mine.end(), r) - mine.begin());
    for (int member : p.group_of(op.family, device)) out.emplace_back(member, member == device ? r : kth(member).at(k));
    return out;
  };
  sim::PartnerFinder finder(p);
  int transfers = 0, collectives = 0;
  for (int d = 0; d < p.num_devices; ++d) {
    const Plan& plan = p.plan_for(d);
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        const OpKind kind = plan.streams[s].ops[i].kind;
        if (kind == OpKind::Compute || kind == OpKind::Update) continue;
        const OpRef r{static_cast<int>(s), static_cast<int>(i)};
        const auto expected = reference(d, r);
        EXPECT_EQ(finder(d, r), expected) << "device " << d << " stream " << s << " op " << i;
        EXPECT_EQ(sim::ReadyTracker::partners(p, d, r), expected);
        (kind == OpKind::Send || kind == OpKind::Recv ? transfers : collectives) += 1;
      }
  }
  EXPECT_GT(transfers, 0);
  EXPECT_GT(collectives, 0);
}
