// Tests of expert tensor parallelism (--etp, tensor_parallel "expert_degree") and EP groups formed over
// DP x TP (issue 26), every figure derived by hand on a small MoE and on Mixtral-8x7B: per-device expert
// parameters and state, collective groups and bytes, FLOPs, validation errors, verifier and simulator.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/verifier.hpp"
#include "piper/search/results_csv.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/search/sweep.hpp"
#include "piper/search/tune.hpp"
#include "spec_file.hpp"

using namespace piper::core;
using nlohmann::json;
using piper::test::write_spec;

namespace {

// A small MoE: h = 64, 2 blocks of 4 SwiGLU experts (f = 64), top-2; s = 64, b = 2 (T = 128 tokens
// per microbatch), bf16 (2 bytes per element).
constexpr std::int64_t kH = 64, kF = 64, kE = 4, kK = 2, kT = 128, kDt = 2;
constexpr std::int64_t kExpertParams = kE * 3 * kH * kF;  // 49,152 per block

ModelConfig small_moe() {
  ModelConfig c;
  c.name = "etp-moe";
  c.vocab = 256;
  c.hidden = kH;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 4;
  c.head_dim = 16;
  c.ffn = 128;
  c.experts = kE;
  c.top_k = kK;
  c.expert_ffn = kF;
  c.training.seq_len = 64;
  c.training.micro_batch_size = 2;
  c.training.precision = Precision::BF16;
  return c;
}

StrategyOptions opts(int tp, int dp, int ep, int etp, bool sp = true) {
  StrategyOptions o;
  o.tp = tp;
  o.dp = dp;
  o.ep = ep;
  o.etp = etp;
  o.sequence_parallel = sp && tp > 1;
  o.microbatches = 2;
  return o;
}

Program compile_moe(const StrategyOptions& o) {
  Scenario sc;
  sc.model = write_spec(small_moe());
  sc.strategy = o;
  return compile_scenario(sc).result.program;
}

// The first routed-expert segment.
int expert_segment(const Program& p) {
  for (std::size_t s = 0; s < p.segments.size(); ++s)
    if (p.segments[s].tags.contains("EP")) return static_cast<int>(s);
  return -1;
}

std::int64_t buffer_bytes(const Program& p, int device, const std::string& name) {
  for (const auto& b : p.plan_for(device).buffers)
    if (b.name == name) return b.bytes;
  return -1;
}

std::int64_t persistent_bytes(const Program& p, int device) {
  std::int64_t n = 0;
  for (const auto& b : p.plan_for(device).buffers)
    if (b.persistent()) n += b.bytes;
  return n;
}

// The ops of `kind` of device d that belong to segment s.
std::vector<Op> ops_of(const Program& p, int d, OpKind kind, int s, Pass pass = Pass::None) {
  std::vector<Op> out;
  for (const auto& st : p.plan_for(d).streams)
    for (const auto& op : st.ops)
      if (op.kind == kind && op.segment == s && (pass == Pass::None || op.pass == pass)) out.push_back(op);
  return out;
}

std::set<int> group(const Program& p, int family, int d) {
  const auto g = p.group_of(family, d);
  return {g.begin(), g.end()};
}

std::string error_of(const StrategyOptions& o) {
  try {
    (void)compile_moe(o);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

// Megatron-core's layout (expert ranks ordered tp-ep-dp inside a stage): per device, the expert
// parameters are E·3hf / (ep·etp); the rest of each stage's dp·tp devices are expert-data-parallel copies.
TEST(ExpertTensorParallel, PerDeviceExpertParametersAndGroupsByHand) {
  struct Case {
    int tp, dp, ep, etp;
    std::int64_t params;      // expert parameters per device
    std::set<int> etp_group;  // device 0's ETP group ({} when etp = 1)
    std::set<int> ep_group;   // device 0's EP (all-to-all) group ({} when ep = 1)
    std::set<int> edp_group;  // device 0's expert-data-parallel (gradient) group ({} when edp = 1)
  };
  const std::vector<Case> cases = {
      // TP 2, EP 2 (EP over the TP group, as Megatron forms it over DP x TP): 2 whole experts each.
      {2, 1, 2, 1, kExpertParams / 2, {}, {0, 1}, {}},
      // TP 2, ETP 2: every expert split in two (fc1 columns, fc2 rows), no all-to-all.
      {2, 1, 1, 2, kExpertParams / 2, {0, 1}, {}, {}},
      // TP 2 x DP 2, EP 2 x ETP 2: positions 0..3 are (ETP, EP) = (0,0) (1,0) (0,1) (1,1).
      {2, 2, 2, 2, kExpertParams / 4, {0, 1}, {0, 2}, {}},
      // TP 4, EP 2, ETP 1: EP groups {0,1} {2,3}; devices 0 and 2 hold the same experts.
      {4, 1, 2, 1, kExpertParams / 2, {}, {0, 1}, {0, 2}},
      // TP 4, EP 1, ETP 2: ETP groups {0,1} {2,3}; devices 0 and 2 hold the same halves.
      {4, 1, 1, 2, kExpertParams / 2, {0, 1}, {}, {0, 2}},
      // TP 2, EP 1, ETP 1: whole experts on both TP ranks (asked for), reduced over both.
      {2, 1, 1, 1, kExpertParams, {}, {}, {0, 1}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(::testing::Message() << "tp " << c.tp << " dp " << c.dp << " ep " << c.ep << " etp " << c.etp);
    const Program p = compile_moe(opts(c.tp, c.dp, c.ep, c.etp));
    EXPECT_TRUE(verify(p).empty());
    const int s = expert_segment(p);
    ASSERT_GE(s, 0);
    const auto& seg = p.segments[static_cast<std::size_t>(s)];
    EXPECT_EQ(seg.params, kExpertParams);  // the segment's whole parameters
    EXPECT_EQ(seg.shard_degree, c.ep);
    EXPECT_EQ(seg.tp_degree, c.etp);
    for (int d = 0; d < c.tp * c.dp; ++d) {
      // bf16 parameters and gradients (2 + 2 bytes), fp32 master and Adam moments (12 bytes).
      EXPECT_EQ(buffer_bytes(p, d, "params s" + std::to_string(s)), c.params * 2);
      EXPECT_EQ(buffer_bytes(p, d, "grads s" + std::to_string(s)), c.params * 2);
      EXPECT_EQ(buffer_bytes(p, d, "optimizer s" + std::to_string(s)), c.params * 12);
    }
    if (c.etp > 1) {
      ASSERT_GE(seg.tp_family, 0);
      EXPECT_EQ(group(p, seg.tp_family, 0), c.etp_group);
    } else {
      EXPECT_EQ(seg.tp_family, -1);
    }
    const auto a2a = ops_of(p, 0, OpKind::AllToAll, s, Pass::F);
    if (c.ep > 1) {
      ASSERT_FALSE(a2a.empty());
      EXPECT_EQ(group(p, a2a.front().family, 0), c.ep_group);
    } else {
      EXPECT_TRUE(a2a.empty());
    }
    std::vector<Op> reductions;
    for (const auto& st : p.plan_for(0).streams)
      for (const auto& op : st.ops)
        if ((op.kind == OpKind::AllReduce || op.kind == OpKind::ReduceScatter) &&
            std::find(op.segments.begin(), op.segments.end(), s) != op.segments.end())
          reductions.push_back(op);
    if (c.edp_group.empty()) {
      EXPECT_TRUE(reductions.empty());
    } else {
      ASSERT_EQ(reductions.size(), 1u);
      EXPECT_EQ(group(p, reductions.front().family, 0), c.edp_group);
      // One bf16 gradient of this device's expert parameters.
      EXPECT_EQ(reductions.front().bytes, c.params * 2);
    }
  }
}

// Per-device FLOPs, all-to-all bytes and ETP collectives, by hand. With SP over TP t each device
// routes its T/t tokens: T·k/t rows of 2·3hf FLOPs each in F, whatever the ETP degree e (the ETP
// group gathers e times the rows and each runs 1/e of the FFN). The dispatch sends those rows
// (T/t·h·2 bytes, times k); the ETP group all-gathers e·T·k/t rows of h before fc1 and
// reduce-scatters them after fc2 (2 collectives, 2·e·T·k/t·h·2 bytes in all-gather units).
TEST(ExpertTensorParallel, FlopsAllToAllAndEtpCollectivesByHand) {
  struct Case {
    int tp, dp, ep, etp;
    bool sp;
  };
  for (const Case& c : {Case{2, 1, 2, 1, true}, Case{2, 1, 1, 2, true}, Case{2, 2, 2, 2, true}, Case{4, 1, 2, 2, true},
                        Case{2, 2, 2, 2, false}}) {
    SCOPED_TRACE(::testing::Message() << "tp " << c.tp << " dp " << c.dp << " ep " << c.ep << " etp " << c.etp << " sp "
                                      << c.sp);
    const Program p = compile_moe(opts(c.tp, c.dp, c.ep, c.etp, c.sp));
    const int s = expert_segment(p);
    const std::int64_t slice = c.sp ? c.tp : 1, rows = kT * kK / slice;
    const auto f = ops_of(p, 0, OpKind::Compute, s, Pass::F);
    ASSERT_EQ(f.size(), 2u);  // two microbatches
    EXPECT_DOUBLE_EQ(f[0].flops, 2.0 * static_cast<double>(rows) * 3 * kH * kF);
    EXPECT_EQ(f[0].tp_collectives, c.etp > 1 ? 2 : 0);
    EXPECT_EQ(f[0].tp_bytes, c.etp > 1 ? 2 * c.etp * rows * kH * kDt : 0);
    const auto b = ops_of(p, 0, OpKind::Compute, s, Pass::B);
    ASSERT_EQ(b.size(), 2u);
    EXPECT_DOUBLE_EQ(b[0].flops, 2 * 2.0 * static_cast<double>(rows) * 3 * kH * kF);
    EXPECT_EQ(b[0].tp_bytes, f[0].tp_bytes);
    const auto a2a = ops_of(p, 0, OpKind::AllToAll, s);
    if (c.ep > 1) {
      ASSERT_EQ(a2a.size(), 8u);  // dispatch and combine, forward and backward, two microbatches
      for (const auto& op : a2a) EXPECT_EQ(op.bytes, kT / slice * kH * kDt * kK) << op.label;
    }
  }
}

// Mixtral-8x7B (tests/data/hf, 32 blocks, h 4096, 8 experts of f 14336, 32 heads / 8 KV heads of 128,
// vocabulary 32000, untied), bf16 with fp32 Adam: 2 + 2 + 12 = 16 bytes of state per parameter.
//   per block: attention 4096·4096·2 + 4096·1024·2 = 41,943,040; two norms 8,192; router 32,768;
//              experts 8·3·4096·14336 = 1,409,286,144.
//   TP 8 alone (experts whole on every TP rank): 32·(41,943,040/8 + 8,192 + 32,768 + 1,409,286,144)
//              + 2·32000·4096/8 + 4096 = 45,299,011,584 parameters = 724,784,185,344 B (675.0 GiB).
//   TP 8 x EP 8: 32·(5,242,880 + 8,192 + 32,768 + 176,160,768) + 32,768,000 + 4,096
//              = 5,838,999,552 parameters = 93,423,992,832 B (87.0 GiB); the same with ETP 8.
TEST(ExpertTensorParallel, Mixtral8x7bAtTp8Ep8HoldsOneEighthOfTheExperts) {
  Scenario sc;
  sc.model = std::string(PIPER_SOURCE_DIR) + "/tests/data/hf/mixtral-8x7b-v0.1.json";
  sc.seq_len = 4096;
  sc.strategy = opts(8, 1, 1, 1);
  EXPECT_EQ(persistent_bytes(compile_scenario(sc).result.program, 0), 724'784'185'344);
  sc.strategy = opts(8, 1, 8, 1);
  const Program ep8 = compile_scenario(sc).result.program;
  for (int d : {0, 7}) EXPECT_EQ(persistent_bytes(ep8, d), 93'423'992'832);
  sc.strategy = opts(8, 1, 1, 8);
  EXPECT_EQ(persistent_bytes(compile_scenario(sc).result.program, 3), 93'423'992'832);
  sc.strategy = opts(8, 1, 2, 4);
  EXPECT_EQ(persistent_bytes(compile_scenario(sc).result.program, 5), 93'423'992'832);
}

// The rules, each refused in one line naming the flag or field.
TEST(ExpertTensorParallel, InvalidLayoutsAreRefusedInOneLine) {
  auto one_line = [](const std::string& m) { return m.find('\n') == std::string::npos; };
  StrategyOptions o = opts(2, 1, 4, 1);
  std::string m = error_of(o);
  EXPECT_EQ(m,
            "--ep 4 x --etp 1 must divide --dp 1 x --tp 2 (a stage's devices hold the experts as ETP x EP x "
            "expert-data-parallel groups)");
  o = opts(4, 1, 1, 3);
  EXPECT_NE(error_of(o).find("--ep 1 x --etp 3 must divide --dp 1 x --tp 4"), std::string::npos);
  o = opts(2, 1, 1, 0);
  EXPECT_EQ(error_of(o), "--etp must be >= 1 (got 0)");
  // EP over DP x TP: accepted where EP does not divide DP (the rule it replaced).
  EXPECT_EQ(error_of(opts(4, 1, 4, 1)), "(accepted)");
  EXPECT_EQ(error_of(opts(2, 3, 2, 1)), "(accepted)");

  // Directive level: expert_degree must be a positive integer that divides the expert FFN and the devices.
  const std::string spec = write_spec(small_moe());
  auto directive_error = [&](json program) {
    try {
      Scenario sc;
      sc.model = spec;
      sc.directives = program;
      (void)compile_scenario(sc);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  auto program = [](json tp) {
    return json::array(
        {{{"op", "place"}, {"filter", {{"PP", 0}}}, {"devices", {0, 1, 2, 3}}},
         {{"op", "shard"}, {"filter", {{"PP", 0}, {"EP", "*"}}}, {"devices", {0, 1, 2, 3}}, {"degree", 2}},
         tp,
         {{"op", "replicate"}, {"filter", {{"PP", 0}}}, {"devices", {0, 1, 2, 3}}}});
  };
  json tp = {{"op", "tensor_parallel"},
             {"filter", {{"PP", 0}}},
             {"degree", 2},
             {"sequence_parallel", true},
             {"expert_degree", 2}};
  EXPECT_EQ(directive_error(program(tp)), "(accepted)");
  tp["expert_degree"] = 0;
  m = directive_error(program(tp));
  EXPECT_EQ(m, "directive 2 field 'expert_degree': must be a positive integer");
  tp["expert_degree"] = 3;
  m = directive_error(program(tp));
  EXPECT_EQ(m, "directive 2 field 'expert_degree': 3 does not divide the 64 ffn columns of layer 'layers.0.experts'");
  tp["expert_degree"] = 4;  // 4 x EP 2 does not divide the 4 devices
  m = directive_error(program(tp));
  EXPECT_EQ(m, "directive 1 field 'degree': 2 x expert_degree 4 does not divide the 4 devices");
  EXPECT_TRUE(one_line(m));
  // Experts on a 1/2 sequence slice beside segments that pass whole sequences.
  json experts_only = {
      {"op", "tensor_parallel"}, {"filter", {{"PP", 0}, {"EP", "*"}}}, {"degree", 2}, {"sequence_parallel", true}};
  m = directive_error(program(experts_only));
  EXPECT_NE(m.find("directive 2 field 'sequence_parallel': routed experts of segment 1 receive a 1/2 sequence slice "
                   "but segment 0 passes them whole sequences"),
            std::string::npos)
      << m;
  EXPECT_TRUE(one_line(m));
}

// The verifier accepts every layout above and refuses a plan whose experts' ETP family is not their
// set in consecutive groups of the degree, or whose EP groups take two devices of one ETP group; both engines simulate
// ETP plans, the ETP collectives showing in the TP time of the devices.
TEST(ExpertTensorParallel, VerifierAndBothEnginesRunEtpPlans) {
  const auto program = std::make_shared<const Program>(compile_moe(opts(2, 2, 2, 2)));
  EXPECT_TRUE(verify(*program).empty());
  Program bad = *program;
  const int s = expert_segment(bad);
  bad.segments[static_cast<std::size_t>(s)].tp_degree = 4;
  const auto issues = verify(bad);
  ASSERT_FALSE(issues.empty());
  EXPECT_EQ(issues.front().check, "tp-group");
  // EP groups cut from the set in consecutive pairs coincide with the ETP groups: refused.
  Program same = *program;
  const auto a2a = ops_of(same, 0, OpKind::AllToAll, s);
  ASSERT_FALSE(a2a.empty());
  same.families[static_cast<std::size_t>(a2a.front().family)].devices =
      same.segments[static_cast<std::size_t>(s)].devices;
  const auto ep_issues = verify(same);
  const auto it =
      std::find_if(ep_issues.begin(), ep_issues.end(), [](const VerifyIssue& i) { return i.check == "ep-group"; });
  ASSERT_NE(it, ep_issues.end());
  EXPECT_NE(it->message.find("the EP group of device 0 holds 2 devices of its expert-TP group (segment 1)"),
            std::string::npos)
      << it->message;
  EXPECT_EQ(it->message.find('\n'), std::string::npos);

  piper::sim::SimulateOptions so;
  so.cluster = "dgx-a100-80g";
  const auto etp1 = std::make_shared<const Program>(compile_moe(opts(2, 2, 2, 1)));
  for (const std::string engine : {"analytic", "simgrid"}) {
    SCOPED_TRACE(engine);
    so.engine = engine;
    const auto r2 = piper::sim::simulate_program(program, so), r1 = piper::sim::simulate_program(etp1, so);
    ASSERT_EQ(r2.report.per_device.size(), 4u);
    EXPECT_GT(r2.report.step_time_s, 0);
    // Same dense TP collectives; ETP 2 adds the experts' all-gathers and reduce-scatters.
    for (int d = 0; d < 4; ++d)
      EXPECT_GT(r2.report.per_device[static_cast<std::size_t>(d)].tp_comm_s,
                r1.report.per_device[static_cast<std::size_t>(d)].tp_comm_s);
  }
}

// piper tune --etp: candidates with expert TP (dividing their TP degree) are enumerated, keyed and
// costed; the pruning bounds stay below the simulated peak and step (branch and bound relies on it).
TEST(ExpertTensorParallel, TuneSearchesEtpWithBoundsBelowTheSimulation) {
  using namespace piper::sim;
  using namespace piper::search;
  TuneSpec spec;
  spec.model = write_spec(small_moe());
  spec.devices = 4;
  spec.tp_degrees = {2, 4};
  spec.etp_degrees = {1, 2};
  spec.zero_levels = {0, 1};
  spec.micro_batch_sizes = {2};
  spec.schedules = {"1f1b"};
  spec.recompute_modes = {"none"};
  int with_etp = 0;
  for (const auto& c : enumerate_candidates(spec)) {
    EXPECT_EQ(c.tp % c.etp, 0) << c.key();
    if (c.etp == 1) continue;
    with_etp += 1;
    EXPECT_NE(c.key().find("/etp2"), std::string::npos) << c.key();
    const TuneRow row = evaluate_candidate(spec, c, "analytic");
    ASSERT_EQ(row.status, "ok") << c.key() << ": " << row.reason;
    EXPECT_LE(memory_lower_bound(spec, c), row.peak_memory_bytes) << c.key();
    EXPECT_LE(step_time_lower_bound(spec, c), row.step_time_s) << c.key();
    const auto back = tune_row_from_csv(csv_split(to_csv(spec, row)), nullptr, "row");
    EXPECT_EQ(back.candidate.etp, 2);
  }
  EXPECT_GT(with_etp, 0);
}

// Sweep spec key "etp": one row per value, keyed apart, the column written.
TEST(ExpertTensorParallel, SweepTakesTheEtpKnob) {
  using namespace piper::sim;
  using namespace piper::search;
  const SweepSpec spec = SweepSpec::from_json({{"model", write_spec(small_moe())},
                                               {"tp", 2},
                                               {"sequence_parallel", true},
                                               {"etp", json::array({1, 2})},
                                               {"microbatches", 2}},
                                              "spec.json");
  const auto points = expand(spec);
  ASSERT_EQ(points.size(), 2u);
  EXPECT_EQ(points[0].key().find("/etp2"), std::string::npos);  // (the model file is named etp-moe-*)
  EXPECT_NE(points[1].key().find("/etp2"), std::string::npos);
  const auto& cols = sweep_csv_columns();
  EXPECT_NE(std::find(cols.begin(), cols.end(), "etp"), cols.end());
  SweepRow probe;
  probe.point = points[1];
  EXPECT_EQ(to_json(probe)["etp"], 2);
  // The point compiles with expert TP and simulates.
  const SweepRow row = run_point(points[1]);
  EXPECT_EQ(row.status, "ok") << row.reason;
  EXPECT_GT(row.tp_comm_s, 0);
}

// EP groups across DP x CP (Megatron-core forms expert groups over DP x CP; issue 26). Experts are
// token-local, so each CP rank routes its own seq/cp tokens. The generator numbers a stage's devices
// c + cp·d (TP 1), so the positions of the experts' set are (DP 0, CP 0), (DP 0, CP 1), (DP 1, CP 0),
// (DP 1, CP 1): EP 2 takes the two CP ranks of a replica ({0, 1}), the expert-DP group is then {0, 2};
// EP 4 spans both replicas' CP ranks and leaves no expert copy to reduce. Per device, with CP 2:
// T/2 = 64 tokens, 64·k = 128 routed rows, F FLOPs 2·128·3hf, each all-to-all 128 rows of h bf16.
TEST(ExpertTensorParallel, EpGroupsAcrossDpAndCpByHand) {
  struct Case {
    int dp, cp, ep;
    std::set<int> ep_group, edp_group;  // device 0's
  };
  for (const Case& c : {Case{1, 2, 2, {0, 1}, {}}, Case{2, 2, 2, {0, 1}, {0, 2}}, Case{2, 2, 4, {0, 1, 2, 3}, {}}}) {
    SCOPED_TRACE(::testing::Message() << "dp " << c.dp << " cp " << c.cp << " ep " << c.ep);
    StrategyOptions o = opts(1, c.dp, c.ep, 1);
    o.cp = c.cp;
    const auto program = std::make_shared<const Program>(compile_moe(o));
    const Program& p = *program;
    EXPECT_TRUE(verify(p).empty());
    const int s = expert_segment(p);
    const auto& seg = p.segments[static_cast<std::size_t>(s)];
    EXPECT_EQ(seg.shard_degree, c.ep);
    EXPECT_EQ(seg.cp_degree, c.cp);
    for (int d = 0; d < c.dp * c.cp; ++d)
      EXPECT_EQ(buffer_bytes(p, d, "params s" + std::to_string(s)), kExpertParams / c.ep * 2);
    const std::int64_t rows = kT / c.cp * kK;
    const auto f = ops_of(p, 0, OpKind::Compute, s, Pass::F);
    ASSERT_EQ(f.size(), 2u);
    EXPECT_DOUBLE_EQ(f[0].flops, 2.0 * static_cast<double>(rows) * 3 * kH * kF);
    const auto a2a = ops_of(p, 0, OpKind::AllToAll, s);
    ASSERT_EQ(a2a.size(), 8u);
    for (const auto& op : a2a) EXPECT_EQ(op.bytes, rows * kH * kDt) << op.label;
    EXPECT_EQ(group(p, a2a.front().family, 0), c.ep_group);
    std::vector<Op> reductions;
    for (const auto& st : p.plan_for(0).streams)
      for (const auto& op : st.ops)
        if (op.kind == OpKind::AllReduce && std::find(op.segments.begin(), op.segments.end(), s) != op.segments.end())
          reductions.push_back(op);
    if (c.edp_group.empty()) {
      EXPECT_TRUE(reductions.empty());
    } else {
      ASSERT_EQ(reductions.size(), 1u);
      EXPECT_EQ(group(p, reductions.front().family, 0), c.edp_group);
    }
    // The verifier checks these plans' expert groups: an EP family cut in groups of another size is refused.
    Program bad = p;
    bad.segments[static_cast<std::size_t>(s)].shard_degree = c.ep * 2;
    const auto issues = verify(bad);
    ASSERT_FALSE(issues.empty());
    EXPECT_EQ(issues.front().check, "ep-group");
    // Both engines simulate them.
    piper::sim::SimulateOptions so;
    so.cluster = "dgx-h100";
    for (const std::string engine : {"analytic", "simgrid"}) {
      so.engine = engine;
      EXPECT_GT(piper::sim::simulate_program(program, so).report.step_time_s, 0) << engine;
    }
  }
  // The rule now counts CP: --ep x --etp must divide --dp x --cp x --tp.
  StrategyOptions o = opts(1, 1, 4, 1);
  o.cp = 2;
  EXPECT_EQ(error_of(o),
            "--ep 4 x --etp 1 must divide --dp 1 x --cp 2 x --tp 1 (a stage's devices hold the experts as ETP x EP x "
            "expert-data-parallel groups)");
}

// MFU counts each token's model work once: a TP group without sequence parallelism computes the routed
// experts (ETP 1) and the norms on every TP rank, and recomputation repeats the forward; both are hardware
// work. So the report's model FLOPs per token are those of the plain layout whatever the layout: the sum
// of the plain (TP 1, no recomputation) plan's compute ops over its tokens.
TEST(ExpertTensorParallel, ModelFlopsCountEachTokensWorkOnceWhateverTheLayout) {
  piper::sim::SimulateOptions so;
  so.cluster = "dgx-h100";
  so.engine = "analytic";
  const Program plain = compile_moe(opts(1, 1, 1, 1));
  double plain_flops = 0;
  for (const auto& st : plain.plan_for(0).streams)
    for (const auto& op : st.ops)
      if (op.kind == OpKind::Compute && op.pass != Pass::None) plain_flops += op.flops;
  const double per_token = plain_flops / (2.0 * kT);  // two microbatches of kT tokens on the one device
  struct Case {
    int tp, dp, ep, etp;
    bool sp;
    std::string recompute;
  };
  for (const Case& c :
       {Case{1, 1, 1, 1, false, "none"}, Case{2, 1, 1, 1, false, "none"}, Case{2, 1, 2, 1, false, "none"},
        Case{2, 1, 2, 1, true, "none"}, Case{2, 2, 2, 2, false, "full"}, Case{1, 2, 2, 1, false, "full"},
        Case{2, 1, 1, 1, false, "selective"}}) {
    SCOPED_TRACE(::testing::Message() << "tp " << c.tp << " dp " << c.dp << " ep " << c.ep << " etp " << c.etp << " sp "
                                      << c.sp << " recompute " << c.recompute);
    StrategyOptions o = opts(c.tp, c.dp, c.ep, c.etp, c.sp);
    o.recompute = c.recompute;
    const auto program = std::make_shared<const Program>(compile_moe(o));
    const auto report = piper::sim::simulate_program(program, so).report;
    ASSERT_DOUBLE_EQ(report.tokens_per_step, 2.0 * kT * c.dp);
    EXPECT_NEAR(report.model_flops / report.tokens_per_step, per_token, 1e-9 * per_token);
  }
}
