// Gradient clipping by global norm as the compiler and the simulator see it: the clip_grad directive
// (its checks), the norm ALL_REDUCE the clip-grad pass adds (one per updating device, one family
// over all of them, after every gradient reduction and before every update), the plan file's field,
// and the synchronisation's cost: every optimizer step now follows the whole step's reductions.
// The runtime side (the owned-gradient rule, equal norms in every launch) is in test_runtime.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/directives.hpp"
#include "piper/core/error.hpp"
#include "piper/core/program.hpp"
#include "piper/core/scenario.hpp"
#include "piper/sim/simulate.hpp"

using namespace piper::core;
using nlohmann::json;

namespace {

std::string refusal(const json& program) {
  try {
    parse_directives(program);
  } catch (const Error& e) {
    return e.what();
  }
  return "accepted";
}

TEST(ClipGrad, DirectiveChecks) {
  const DirectiveProgram p = parse_directives(json::parse(R"([{"op": "clip_grad", "max_norm": 0.5}])"));
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(std::get<ClipGradDirective>(p.directives[0]).max_norm, 0.5);
  EXPECT_EQ(op_name(p.directives[0]), "clip_grad");
  for (const char* bad : {R"([{"op": "clip_grad", "max_norm": 0}])", R"([{"op": "clip_grad", "max_norm": -1}])",
                          R"([{"op": "clip_grad", "max_norm": "1"}])", R"([{"op": "clip_grad"}])"})
    EXPECT_NE(refusal(json::parse(bad)).find("max_norm"), std::string::npos)
        << bad << ": " << refusal(json::parse(bad));
  EXPECT_NE(refusal(json::parse(R"([{"op": "clip_grad", "max_norm": 1, "norm": 2}])")).find("norm"), std::string::npos);
  EXPECT_NE(refusal(json::parse(R"([{"op": "clip_grad", "max_norm": 1}, {"op": "clip_grad", "max_norm": 2}])"))
                .find("a second clip_grad (directive 0 already clips the gradients)"),
            std::string::npos);
  EXPECT_NE(refusal(json::parse(R"([{"op": "clip_gard", "max_norm": 1}])")).find("clip_grad"), std::string::npos);
}

Scenario scenario(double clip, int pp, int dp, int zero, int ep = 1) {
  Scenario s;
  s.model = "qwen3-9m";
  s.strategy.pp = pp;
  s.strategy.dp = dp;
  s.strategy.zero = zero;
  s.strategy.ep = ep;
  s.strategy.microbatches = 4;
  s.strategy.clip_grad = clip;
  return s;
}

// Per device: the norm op, the (stream, index) of every UPD, and whether each UPD's waits (or stream
// order) put it after the norm op; the norm op after every gradient collective of its device.
TEST(ClipGrad, OneNormAllReducePerDeviceBetweenReductionsAndUpdates) {
  for (const int zero : {0, 1, 3}) {
    const Program p = compile_scenario(scenario(1.0, 2, 2, zero)).result.program;
    EXPECT_EQ(p.clip_grad, 1.0);
    int norm_family = -1;
    for (std::size_t f = 0; f < p.families.size(); ++f)
      if (p.families[f].purpose == FamilyPurpose::GradNorm) {
        EXPECT_EQ(norm_family, -1) << "one grad-norm family";
        norm_family = static_cast<int>(f);
      }
    ASSERT_GE(norm_family, 0);
    const auto group = p.group_of(norm_family, 0);
    EXPECT_EQ(static_cast<int>(group.size()), p.num_devices) << "every device in one group";
    for (int d = 0; d < p.num_devices; ++d) {
      const Plan& plan = p.plan_for(d);
      std::vector<OpRef> norms, updates;
      std::map<std::pair<int, int>, bool> gradient_collective;
      for (std::size_t s = 0; s < plan.streams.size(); ++s)
        for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
          const Op& op = plan.streams[s].ops[i];
          const OpRef at{static_cast<std::int32_t>(s), static_cast<std::int32_t>(i)};
          if (op.family == norm_family) norms.push_back(at);
          if (op.kind == OpKind::Update) updates.push_back(at);
        }
      ASSERT_EQ(norms.size(), 1u) << "device " << d << " zero " << zero;
      ASSERT_FALSE(updates.empty());
      const OpRef n = norms[0];
      for (const OpRef& u : updates) {
        const Op& op = plan.streams[static_cast<std::size_t>(u.stream)].ops[static_cast<std::size_t>(u.index)];
        const bool waits = std::any_of(op.waits.begin(), op.waits.end(),
                                       [&](const OpRef& w) { return w.stream == n.stream && w.index >= n.index; });
        EXPECT_TRUE(waits || (u.stream == n.stream && u.index > n.index))
            << "device " << d << " zero " << zero << ": '" << op.label << "' does not wait for the norm";
      }
      // The norm waits for the last gradient collective of each collective stream it reads.
      const Op& norm = plan.streams[static_cast<std::size_t>(n.stream)].ops[static_cast<std::size_t>(n.index)];
      for (std::size_t s = 0; s < plan.streams.size(); ++s) {
        int last = -1;
        for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
          const Op& op = plan.streams[s].ops[i];
          const bool reduces = (op.kind == OpKind::AllReduce || op.kind == OpKind::ReduceScatter) &&
                               op.family != norm_family && op.pass == Pass::None;
          if (reduces) last = static_cast<int>(i);
        }
        if (last < 0) continue;
        EXPECT_TRUE(std::any_of(norm.waits.begin(), norm.waits.end(),
                                [&](const OpRef& w) { return w.stream == static_cast<int>(s) && w.index >= last; }))
            << "device " << d << " zero " << zero << ": the norm does not wait for stream " << s << "'s reductions";
      }
    }
  }
}

TEST(ClipGrad, PlanFileKeepsTheNormAndChecksIt) {
  const Program p = compile_scenario(scenario(0.25, 2, 2, 1)).result.program;
  json j = p.to_json();
  EXPECT_EQ(j["clip_grad"], 0.25);
  EXPECT_TRUE(Program::from_json(j) == p);
  const Program without = compile_scenario(scenario(0, 2, 2, 1)).result.program;
  EXPECT_FALSE(without.to_json().contains("clip_grad"));
  j["clip_grad"] = -1;
  try {
    Program::from_json(j);
    FAIL() << "a negative clip_grad was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("field 'clip_grad'"), std::string::npos) << e.what();
  }
}

// Without clipping a device's update may start once its own gradients are reduced, while other
// buckets are still in flight; with it, every update waits for all of them and for the norm: the
// step cannot be shorter, and where reductions end at different times it is longer.
TEST(ClipGrad, TheNormSynchronisationCostsTimeInBothEngines) {
  for (const std::string engine : {"analytic", "simgrid"}) {
    piper::sim::SimulateOptions o;
    o.engine = engine;
    Scenario plain = scenario(0, 1, 8, 1), clipped = scenario(1.0, 1, 8, 1);
    plain.strategy.bucket_mb = clipped.strategy.bucket_mb = 1;
    const double a = piper::sim::simulate(plain, o).report.step_time_s;
    const double b = piper::sim::simulate(clipped, o).report.step_time_s;
    EXPECT_GT(b, a) << engine;
    EXPECT_LT(b, a * 1.5) << engine << ": one 4-byte all-reduce and a wait, not a second step";
  }
}

}  // namespace
