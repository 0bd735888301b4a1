// The published Piper directive programs (tests/fixtures/piper-directives) compile for qwen3-9m,
// verify clean, round-trip through JSON, and insert exactly the communication derived by hand.
#include <gtest/gtest.h>

#include <fstream>

#include "piper/core/compiler.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/verifier.hpp"

using namespace piper::core;
using nlohmann::json;

namespace {

json load(const std::string& name) {
  std::ifstream in(std::string(PIPER_FIXTURES) + "/piper-directives/" + name);
  EXPECT_TRUE(in.good()) << name;
  return json::parse(in);
}

// qwen3-9m balanced over `regions` PP regions.
Model qwen9m(int regions) {
  Model m = build_model(*zoo_config("qwen3-9m"));
  balance_pipeline(m, regions);
  return m;
}

// qwen3-9m with explicit, equal PP ranges (the hand counts below assume them).
Model qwen9m_even(int regions) {
  Model m = build_model(*zoo_config("qwen3-9m"));
  std::vector<int> starts;
  for (int r = 0; r < regions; ++r) starts.push_back(r * 4 / regions);
  annotate_pipeline_ranges(m, starts);
  return m;
}

// Appends 1F1B with M microbatches to a placement-only program, as `piper compile --schedule` does.
json with_1f1b(json program, int microbatches) {
  int ranks = 0;
  auto rank_of_region = rank_of_region_from_program(parse_directives(program), &ranks);
  StrategyOptions o;
  o.pp = ranks;
  o.microbatches = microbatches;
  o.schedule = "1f1b";
  for (auto& d : schedule_directives(o, rank_of_region).to_json()) program.push_back(d);
  return program;
}

CompileResult compile_json(const Model& m, const json& program) { return compile(m, parse_directives(program)); }

std::int64_t count(const CompileResult& r, const std::string& kind) {
  auto it = r.program.stats.nodes_by_kind.find(kind);
  return it == r.program.stats.nodes_by_kind.end() ? 0 : it->second;
}

// Ops of one device by kind name (COMPUTE ops counted by pass).
std::map<std::string, int> ops_of(const Program& p, int device) {
  std::map<std::string, int> out;
  for (const auto& s : p.plan_for(device).streams)
    for (const auto& op : s.ops) ++out[op.kind == OpKind::Compute ? to_string(op.pass) : to_string(op.kind)];
  return out;
}

}  // namespace

TEST(Fixtures, EveryProgramCompilesAndVerifies) {
  for (const char* name :
       {"dp2.json", "pp2_dp2_ep2.json", "pp2_dp2_ep2_bucket100.json", "pp2_dp2_ep2_custom_order.json",
        "pp2_dp2_ep2_zero2.json", "pp2_dp2_ep2_zero3.json", "pp4_dp2_ep2_v_placement.json"}) {
    SCOPED_TRACE(name);
    json program = load(name);
    bool has_order = false;
    for (const auto& d : program) has_order |= d["op"] == "order";
    int regions = 0;
    for (const auto& d : program)
      if (d["op"] == "place") regions = std::max(regions, d["filter"]["PP"].get<int>() + 1);
    const auto result = compile_json(qwen9m(regions), has_order ? program : with_1f1b(program, 4));
    EXPECT_TRUE(verify(result.program).empty());
    // Exact JSON round trip of a real compiled program.
    EXPECT_EQ(Program::from_json(result.program.to_json()), result.program);
    EXPECT_EQ(result.program.num_devices, name == std::string("dp2.json") ? 2 : 4);
  }
}

// qwen3-9m over 2 regions has 9 segments (embedding joins block 0, norm+head joins block 3):
//   PP0: s0 [embed, b0 attn+router]  s1 [b0 experts, EP0]  s2 [b1 attn+router]  s3 [b1 experts, EP1]
//   PP1: s4 [b2 attn+router]  s5 [b2 experts, EP2]  s6 [b3 attn+router]  s7 [b3 experts, EP3]  s8 [norm, head]
// With M = 4 microbatches:
//   SEND/RECV: one activation edge s3->s4 and one gradient edge s4->s3 per microbatch: 2*M each.
//   ALL_TO_ALL: 4 MoE layers x 2 passes x (dispatch + combine) per microbatch: 16*M.
//   Gradient collectives: one per non-expert segment with parameters (experts are sharded, not
//   reduced): s0, s2 on PP0 and s4, s6, s8 on PP1 = 5.
TEST(Fixtures, Pp2Dp2Ep2CommunicationMatchesHandCount) {
  const int M = 4;
  const auto r = compile_json(qwen9m_even(2), with_1f1b(load("pp2_dp2_ep2.json"), M));
  EXPECT_EQ(count(r, "F"), 9 * M);
  EXPECT_EQ(count(r, "B"), 9 * M);
  EXPECT_EQ(count(r, "SEND"), 2 * M);
  EXPECT_EQ(count(r, "RECV"), 2 * M);
  EXPECT_EQ(count(r, "ALL_TO_ALL"), 16 * M);
  EXPECT_EQ(count(r, "ALL_REDUCE"), 5);
  EXPECT_EQ(count(r, "REDUCE_SCATTER"), 0);
  EXPECT_EQ(count(r, "ALL_GATHER"), 0);
  EXPECT_EQ(count(r, "UPD"), 2);  // one per device set
  // Device 0 (PP0, DP rank 0): 4 segments x M forwards and backwards, M sends (activations) and
  // M receives (gradients), 2 MoE layers x 2 passes x 2 all-to-alls x M, 2 all-reduces, 1 update.
  auto d0 = ops_of(r.program, 0);
  EXPECT_EQ(d0["F"], 4 * M);
  EXPECT_EQ(d0["B"], 4 * M);
  EXPECT_EQ(d0["SEND"], M);
  EXPECT_EQ(d0["RECV"], M);
  EXPECT_EQ(d0["ALL_TO_ALL"], 8 * M);
  EXPECT_EQ(d0["ALL_REDUCE"], 2);
  EXPECT_EQ(d0["UPD"], 1);
  // DP ranks of a stage share one plan: 2 plans for 4 devices.
  EXPECT_EQ(r.program.plans.size(), 2u);
  EXPECT_EQ(r.program.plan_of_device[0], r.program.plan_of_device[2]);
  EXPECT_NE(r.program.plan_of_device[0], r.program.plan_of_device[1]);
  // Device 0 sends activations to device 1, device 2 to device 3 (j-th to j-th of the sets).
  for (const auto& s : r.program.plan_for(0).streams)
    for (const auto& op : s.ops)
      if (op.kind == OpKind::Send) {
        EXPECT_EQ(r.program.peer_of(op, 0), 1);
        EXPECT_EQ(r.program.peer_of(op, 2), 3);
        EXPECT_EQ(s.name, "pp_stream>[1,3]");  // the place stream, per direction and peer set
      }
}

// ZeRO-3: gradients are reduce-scattered once per segment and microbatch (5 x M, the default of
// shard_grads: DeepSpeed ZeRO-2/3, FSDP2); parameters are all-gathered before each use: 5 segments x
// M microbatches x 2 (forward, backward); no all-gather after the update.
TEST(Fixtures, Pp2Dp2Ep2Zero3CommunicationMatchesHandCount) {
  const int M = 4;
  const auto r = compile_json(qwen9m_even(2), with_1f1b(load("pp2_dp2_ep2_zero3.json"), M));
  EXPECT_EQ(count(r, "SEND"), 2 * M);
  EXPECT_EQ(count(r, "ALL_TO_ALL"), 16 * M);
  EXPECT_EQ(count(r, "ALL_REDUCE"), 0);
  EXPECT_EQ(count(r, "REDUCE_SCATTER"), 5 * M);
  EXPECT_EQ(count(r, "ALL_GATHER"), 5 * M * 2);
  // Parameters of a replicated segment are stored 1/2 per device; gathered copies are transient.
  const auto& plan = r.program.plan_for(0);
  int gathered = 0;
  for (const auto& b : plan.buffers) {
    if (b.kind == BufferKind::GatheredParameters) {
      ++gathered;
      EXPECT_FALSE(b.persistent());
    }
  }
  EXPECT_EQ(gathered, 2 * M * 2);  // device 0 holds s0 and s2
  const auto model = qwen9m_even(2);
  const auto segments = segment_model(model);
  for (const auto& b : plan.buffers)
    if (b.name == "params s0") {
      EXPECT_EQ(b.bytes, segments[0].costs.param_bytes / 2);
    } else if (b.name == "params s1") {
      EXPECT_EQ(b.bytes, segments[1].costs.param_bytes / 2);  // EP-sharded
    }
}

// ZeRO-2 with the same placement: reduce-scatter per segment and microbatch (per segment once with
// "reduce_every": "step"), then an all-gather of the updated parameter shards per segment after the
// update.
TEST(Fixtures, Zero2GathersUpdatedParametersOncePerSegment) {
  const auto r = compile_json(qwen9m_even(2), with_1f1b(load("pp2_dp2_ep2_zero2.json"), 4));
  EXPECT_EQ(count(r, "REDUCE_SCATTER"), 5 * 4);
  EXPECT_EQ(count(r, "ALL_GATHER"), 5);
  EXPECT_EQ(count(r, "ALL_REDUCE"), 0);
  nlohmann::json step = load("pp2_dp2_ep2_zero2.json");
  for (auto& d : step)
    if (d.value("op", "") == "replicate") d["reduce_every"] = "step";
  const auto once = compile_json(qwen9m_even(2), with_1f1b(step, 4));
  EXPECT_EQ(count(once, "REDUCE_SCATTER"), 5);
  EXPECT_EQ(count(once, "ALL_GATHER"), 5);
}

// bucket_size 100 MB: every replicated segment of a stage fits in one bucket (qwen3-9m is ~10 MB).
TEST(Fixtures, BucketsGroupGradientsPerStage) {
  const auto r = compile_json(qwen9m_even(2), with_1f1b(load("pp2_dp2_ep2_bucket100.json"), 4));
  EXPECT_EQ(count(r, "ALL_REDUCE"), 2);
}

// The custom order is used as written: on PP1, B of mb0 and F of mb1 form one group.
TEST(Fixtures, CustomOrderCompilesAsIs) {
  const auto r = compile_json(qwen9m(2), load("pp2_dp2_ep2_custom_order.json"));
  EXPECT_EQ(r.program.microbatches, 2);
  EXPECT_EQ(count(r, "ORDER_DUMMY"), 3 + 2);  // 4 groups on PP0, 3 groups on PP1
}

// V placement: regions 0 and 3 on devices {0,2}, regions 1 and 2 on {1,3}. The activation goes
// 0->1 (PP0->PP1), stays on device 1 (PP1->PP2), and comes back 1->0 (PP2->PP3).
TEST(Fixtures, VPlacementSendsAcrossTheVOnly) {
  const int M = 2;
  const auto r = compile_json(qwen9m_even(4), with_1f1b(load("pp4_dp2_ep2_v_placement.json"), M));
  // Region boundaries crossing device sets: PP0->PP1 and PP2->PP3, in both passes.
  EXPECT_EQ(count(r, "SEND"), 2 * 2 * M);
  EXPECT_EQ(r.program.plans.size(), 2u);
}
