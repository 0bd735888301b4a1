// Chunked expert all-to-alls (--a2a-chunks N, the shard directive's "chunks"; issue 26): the plan's
// shape, the step time of a tiny MoE derived by hand in both engines (with shared SMs, without the SM
// model, and under an sm_partition), and the refusals of bad values in one line naming the flag.
// fp8 all-to-alls toward the experts (--fp8-dispatch, the shard directive's "dispatch_dtype"): their
// bytes by hand, and the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/verifier.hpp"
#include "piper/runtime/dataflow.hpp"
#include "piper/sim/engine.hpp"
#include "shell.hpp"
#include "spec_file.hpp"

using namespace piper::core;
using nlohmann::json;
namespace sim = piper::sim;

namespace {

// MoE blocks (two unless said) of 4 experts, top-2; s = 64, b = 2: T = 128 tokens per microbatch.
ModelConfig tiny_moe(int layers, Precision precision = Precision::BF16) {
  ModelConfig c;
  c.name = "a2a-moe" + std::to_string(layers);
  c.vocab = 256;
  c.hidden = 64;
  c.layers = layers;
  c.heads = 4;
  c.kv_heads = 4;
  c.head_dim = 16;
  c.ffn = 128;
  c.experts = 4;
  c.top_k = 2;
  c.expert_ffn = 64;
  c.training.seq_len = 64;
  c.training.micro_batch_size = 2;
  c.training.precision = precision;
  return c;
}

std::string spec_path(int layers = 2, Precision precision = Precision::BF16) {
  return piper::test::write_spec(tiny_moe(layers, precision));
}

StrategyOptions opts(int chunks, const std::string& schedule = "1f1b", int microbatches = 1) {
  StrategyOptions o;
  o.dp = 2;
  o.ep = 2;
  o.microbatches = microbatches;
  o.schedule = schedule;
  o.a2a_chunks = chunks;
  return o;
}

Scenario scenario(const StrategyOptions& o, int layers = 2, Precision precision = Precision::BF16) {
  Scenario sc;
  sc.model = spec_path(layers, precision);
  sc.strategy = o;
  return sc;
}

Program compile_moe(const StrategyOptions& o, int layers = 2, Precision precision = Precision::BF16) {
  return compile_scenario(scenario(o, layers, precision)).result.program;
}

// Program JSON without the compiler's statistics (its own compile time).
std::string plan_text(const Program& p) {
  json j = p.to_json();
  j.erase("stats");
  return j.dump();
}

std::vector<int> expert_segments(const Program& p) {
  std::vector<int> out;
  for (std::size_t s = 0; s < p.segments.size(); ++s)
    if (p.segments[s].tags.contains("EP")) out.push_back(static_cast<int>(s));
  return out;
}

std::vector<Op> ops_of(const Program& p, OpKind kind, int segment, Pass pass) {
  std::vector<Op> out;
  for (const auto& st : p.plan_for(0).streams)
    for (const auto& op : st.ops)
      if (op.kind == kind && op.segment == segment && op.pass == pass) out.push_back(op);
  return out;
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

// N = 1 is today's plan, byte for byte; N = 2 doubles the experts' F and B ops and their all-to-alls,
// each with half the FLOPs, bytes and stashed activations, in the order dispatch 1, dispatch 2,
// combine 1, combine 2 on the `ep` stream.
TEST(A2aChunks, PlanShapeByHand) {
  const Program base = compile_moe(opts(1));
  StrategyOptions unset = opts(1);
  unset.a2a_chunks = StrategyOptions{}.a2a_chunks;
  EXPECT_TRUE(plan_text(base) == plan_text(compile_moe(unset)));
  EXPECT_EQ(plan_text(base).find("a2a_chunks"), std::string::npos);
  EXPECT_EQ(strategy_directives(opts(1), "").to_json().dump().find("chunks"), std::string::npos);

  const Program two = compile_moe(opts(2));
  EXPECT_TRUE(verify(two).empty());
  const std::vector<int> experts = expert_segments(two);
  ASSERT_EQ(experts.size(), 2u);
  for (int s : experts) {
    SCOPED_TRACE(s);
    EXPECT_EQ(two.segments[static_cast<std::size_t>(s)].a2a_chunks, 2);
    EXPECT_EQ(base.segments[static_cast<std::size_t>(s)].a2a_chunks, 1);
    for (Pass pass : {Pass::F, Pass::B}) {
      const auto one = ops_of(base, OpKind::Compute, s, pass), halves = ops_of(two, OpKind::Compute, s, pass);
      ASSERT_EQ(one.size(), 1u);
      ASSERT_EQ(halves.size(), 2u);
      for (const auto& h : halves) EXPECT_DOUBLE_EQ(h.flops, one[0].flops / 2);
      const auto a1 = ops_of(base, OpKind::AllToAll, s, pass), a2 = ops_of(two, OpKind::AllToAll, s, pass);
      ASSERT_EQ(a1.size(), 2u);  // dispatch and combine
      ASSERT_EQ(a2.size(), 4u);
      // T·k = 256 routed rows of h = 64 bf16 values: 32 KiB per all-to-all, 16 KiB per chunk.
      for (const auto& a : a1) EXPECT_EQ(a.bytes, 128 * 2 * 64 * 2);
      for (const auto& a : a2) EXPECT_EQ(a.bytes, 128 * 2 * 64 * 2 / 2);
    }
    // The forward's all-to-alls: both dispatches, then both combines (chunk 1 before chunk 2).
    const auto f = ops_of(two, OpKind::AllToAll, s, Pass::F);
    EXPECT_NE(f[0].label.find("dispatch"), std::string::npos) << f[0].label;
    EXPECT_NE(f[0].label.find("chunk 1/2"), std::string::npos) << f[0].label;
    EXPECT_NE(f[1].label.find("dispatch"), std::string::npos) << f[1].label;
    EXPECT_NE(f[1].label.find("chunk 2/2"), std::string::npos) << f[1].label;
    EXPECT_NE(f[2].label.find("combine"), std::string::npos) << f[2].label;
    EXPECT_NE(f[3].label.find("combine"), std::string::npos) << f[3].label;
  }
  // Stashed activations: the chunks' buffers add up to the whole one.
  auto act = [](const Program& p) {
    std::int64_t n = 0;
    for (const auto& b : p.plan_for(0).buffers)
      if (b.kind == BufferKind::Activations) n += b.bytes;
    return n;
  };
  EXPECT_EQ(act(two), act(base));
  // Program JSON carries the count and round-trips.
  EXPECT_EQ(Program::from_json(two.to_json()), two);
  EXPECT_NE(two.to_json().dump().find("\"a2a_chunks\":2"), std::string::npos);
}

// With the backward split (DualPipeV), the experts' BI is chunked (it meets the all-to-alls) and BW
// stays one op per microbatch (it reads only the stash and BI's gradient); the plan verifies and
// both engines simulate it.
TEST(A2aChunks, DualPipeVChunksBiNotBw) {
  StrategyOptions o = opts(4, "dualpipev", 4);
  o.pp = 2;
  const auto program = std::make_shared<const Program>(compile_moe(o, 4));
  EXPECT_TRUE(verify(*program).empty());
  const int s = expert_segments(*program).front();
  int f = 0, b = 0, bi = 0, bw = 0;
  for (const auto& st : program->plan_for(0).streams)
    for (const auto& op : st.ops)
      if (op.kind == OpKind::Compute && op.segment == s)
        f += op.pass == Pass::F, b += op.pass == Pass::B, bi += op.pass == Pass::BI, bw += op.pass == Pass::BW;
  // 4 microbatches x 4 chunks of F, and of B or BI (DualPipeV splits the later microbatches' B);
  // one BW per split microbatch.
  EXPECT_EQ(f, 16);
  EXPECT_EQ(b + bi, 16);
  EXPECT_GT(bw, 0);
  EXPECT_EQ(bi, 4 * bw);
  for (const std::string engine : {"analytic", "simgrid"}) {
    const auto names = sim::engine_names();
    if (std::find(names.begin(), names.end(), engine) == names.end()) continue;
    const sim::Cluster cluster = sim::with_devices(sim::load_cluster("dgx-h100"), program->num_devices);
    const sim::CostModel cost(cluster);
    const Timeline t = sim::make_engine(engine)->run(program, cluster, cost);
    EXPECT_FALSE(t.devices.empty()) << engine;
  }
}

namespace {

// Fixed times for the hand derivation: per block and microbatch, the experts' F takes 4 s and their B
// 8 s, each all-to-all (dispatch or combine, forward or backward) 2 s, split evenly over the chunks;
// everything else is free.
sim::OpOverride hand_costs(const Program& p, int chunks) {
  const std::vector<int> experts = expert_segments(p);
  return [experts, chunks](const Op& op) -> std::optional<double> {
    const bool expert = std::find(experts.begin(), experts.end(), op.segment) != experts.end();
    if (op.kind == OpKind::AllToAll) return 2.0 / chunks;
    if (op.kind == OpKind::Compute && expert) return (op.pass == Pass::F ? 4.0 : 8.0) / chunks;
    return 0.0;
  };
}

double step_time(const std::string& engine, const Program& p, int chunks, double sm_share,
                 std::optional<SmPartition> partition = std::nullopt) {
  Program q = p;
  q.sm_partition = partition;
  const auto program = std::make_shared<const Program>(q);
  sim::Cluster base = sim::cluster_from_json(
      json{{"preset", "dgx-h100"}, {"node", {{"gpu", {{"comm_sm_share", sm_share}}}}}}, "c.json");
  const sim::Cluster cluster = sim::with_devices(base, program->num_devices);
  sim::CostModel cost(cluster);
  cost.set_override(hand_costs(*program, chunks));
  const Timeline t = sim::make_engine(engine)->run(program, cluster, cost);
  double end = 0;
  for (const auto& d : t.devices)
    for (const auto& s : d.spans) end = std::max(end, s.end_s);
  return end;
}

}  // namespace

// One microbatch through two MoE blocks on DP 2 x EP 2 (1F1B, PP 1), per block: dispatch d = 2 s,
// experts e = 4 s (F) or 8 s (B), combine c = 2 s. Unchunked, each block's pass is a chain:
// F 2 + 4 + 2 = 8 s, B 2 + 8 + 2 = 12 s; the step 2 (8 + 12) = 40 s.
// In two chunks (1 s all-to-alls, 2 s / 4 s experts), without the SM model: d1 [0,1], d2 [1,2],
// e1 [1,3], e2 [3,5], c1 [3,4], c2 [5,6]: F takes 1 + 4 + 1 = 6 s, B likewise 1 + 8 + 1 = 10 s;
// the step 2 (6 + 10) = 32 s.
// With shared SMs (comm_sm_share 0.25), compute beside a running all-to-all runs at 0.75: in F, e1
// does 0.75 s of work under d2, ends at 2 + 1.25 = 3.25; c1 [3.25, 4.25] slows e2 likewise, which
// ends at 4.25 + 1.25 = 5.5; c2 ends at 6.5. In B, B1 ends at 2 + 3.25 = 5.25, B2 at 6.25 + 3.25 =
// 9.5, the last all-to-all at 10.5: the step 2 (6.5 + 10.5) = 34 s (unchunked nothing overlaps: 40 s).
// Under sm_partition 33 of 132 SMs, compute runs at 0.75 throughout (e = 16/3, B = 32/3 s) and the
// all-to-alls keep their times: unchunked 2 (2 + 16/3 + 2 + 2 + 32/3 + 2) = 48 s, chunked
// 2 (1 + 16/3 + 1 + 1 + 32/3 + 1) = 40 s.
TEST(A2aChunks, StepTimeByHandInBothEngines) {
  const Program one = compile_moe(opts(1)), two = compile_moe(opts(2));
  const SmPartition part{"comm", 33};
  for (const std::string engine : {"analytic", "simgrid"}) {
    const auto names = sim::engine_names();
    if (std::find(names.begin(), names.end(), engine) == names.end()) continue;
    SCOPED_TRACE(engine);
    const double tol = engine == "analytic" ? 1e-9 : 1e-5;
    EXPECT_NEAR(step_time(engine, one, 1, 0.0), 40.0, tol);
    EXPECT_NEAR(step_time(engine, two, 2, 0.0), 32.0, tol);
    EXPECT_NEAR(step_time(engine, one, 1, 0.25), 40.0, tol);
    EXPECT_NEAR(step_time(engine, two, 2, 0.25), 34.0, tol);
    EXPECT_NEAR(step_time(engine, one, 1, 0.25, part), 48.0, tol);
    EXPECT_NEAR(step_time(engine, two, 2, 0.25, part), 40.0, tol);
  }
}

// Bad values, one line each, naming the flag; the directive's own field; the runtimes' refusal.
TEST(A2aChunks, BadValuesAreRefusedInOneLine) {
  auto one_line = [](const std::string& s) { return s.find('\n') == std::string::npos; };
  StrategyOptions zero = opts(0);
  EXPECT_NE(error_of(zero).find("--a2a-chunks"), std::string::npos) << error_of(zero);
  StrategyOptions no_ep = opts(2);
  no_ep.ep = 1;
  EXPECT_EQ(error_of(no_ep), "--a2a-chunks needs --ep >= 2 (it chunks the expert all-to-alls)");
  // 128 tokens per microbatch on a device: 129 chunks cannot all hold one.
  EXPECT_EQ(error_of(opts(129)), "--a2a-chunks 129: 129 chunks exceed the 128 tokens of a microbatch on a device");
  EXPECT_EQ(error_of(opts(128)), "(accepted)");

  using piper::test::sh;
  const std::string cli = std::string(PIPER_CLI) + " simulate --model " + spec_path() +
                          " --dp 2 --ep 2 --microbatches 1 --engine analytic --a2a-chunks ";
  for (const std::string bad : {"0", "1.5", "two", "129"}) {
    const auto r = sh(cli + bad);
    EXPECT_EQ(r.code, 2) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("piper: error: --a2a-chunks"), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
  EXPECT_EQ(sh(cli + "2").code, 0);

  // In a directive file: the field, by index.
  json program = strategy_directives(opts(2), spec_path()).to_json();
  bool found = false;
  for (auto& d : program)
    if (d["op"] == "shard") d["chunks"] = 0, found = true;
  ASSERT_TRUE(found);
  try {
    (void)parse_directives(program);
    ADD_FAILURE() << "chunks 0 accepted";
  } catch (const DirectiveError& e) {
    EXPECT_EQ(e.field(), "chunks");
    EXPECT_TRUE(one_line(e.what())) << e.what();
  }

  // Neither runtime keys data by chunk yet: both refuse such a plan before step 1, in one line.
  const Program two = compile_moe(opts(2));
  for (const auto& caps : {piper::runtime::host_capabilities(), piper::runtime::cuda_capabilities()}) {
    const std::string why = piper::runtime::unsupported_feature(two, caps);
    EXPECT_NE(why.find("chunks its expert all-to-alls (2 chunks)"), std::string::npos) << why;
    EXPECT_NE(why.find("--a2a-chunks 1"), std::string::npos) << why;
    EXPECT_TRUE(one_line(why)) << why;
  }
  EXPECT_EQ(piper::runtime::unsupported_feature(compile_moe(opts(1)), piper::runtime::host_capabilities()), "");
}

namespace {

StrategyOptions fp8_opts(bool fp8_dispatch) {
  StrategyOptions o = opts(1);
  o.fp8_dispatch = fp8_dispatch;
  return o;
}

}  // namespace

// T·k = 128 tokens x top-2 = 256 routed rows of h = 64 values: 16,384 values an all-to-all. Toward the
// experts (the forward's dispatch, the backward's gradient of the combine, both labelled "dispatch")
// fp8 moves a byte each plus an fp32 scale per 128 values: 16,384 + 128 x 4 = 16,896 bytes; back from
// the experts they stay bf16 (the fp8 recipe's activations): 32,768 bytes. Without the setting all four
// move 32,768.
TEST(Fp8Dispatch, AllToAllBytesByHand) {
  const Program plain = compile_moe(fp8_opts(false), 2, Precision::FP8);
  const Program fp8 = compile_moe(fp8_opts(true), 2, Precision::FP8);
  EXPECT_TRUE(verify(fp8).empty());
  const std::vector<int> experts = expert_segments(fp8);
  ASSERT_EQ(experts.size(), 2u);
  for (int s : experts) {
    SCOPED_TRACE(s);
    EXPECT_TRUE(fp8.segments[static_cast<std::size_t>(s)].fp8_dispatch);
    EXPECT_FALSE(plain.segments[static_cast<std::size_t>(s)].fp8_dispatch);
    for (Pass pass : {Pass::F, Pass::B}) {
      SCOPED_TRACE(static_cast<int>(pass));
      for (const auto& a : ops_of(plain, OpKind::AllToAll, s, pass)) EXPECT_EQ(a.bytes, 32768);
      const auto a = ops_of(fp8, OpKind::AllToAll, s, pass);
      ASSERT_EQ(a.size(), 2u);
      int toward = 0;
      for (const auto& op : a) {
        const bool dispatch = op.label.find("dispatch") != std::string::npos;
        toward += dispatch;
        EXPECT_EQ(op.bytes, dispatch ? 16896 : 32768) << op.label;
      }
      EXPECT_EQ(toward, 1);
    }
  }
  // Dense segments and the plan's other ops are untouched.
  EXPECT_EQ(plain.segments.size(), fp8.segments.size());
  // The plan and the directives say it, and round-trip.
  EXPECT_EQ(Program::from_json(fp8.to_json()), fp8);
  EXPECT_NE(fp8.to_json().dump().find("\"fp8_dispatch\":true"), std::string::npos);
  EXPECT_EQ(plain.to_json().dump().find("fp8_dispatch"), std::string::npos);
  EXPECT_NE(strategy_directives(fp8_opts(true), "").to_json().dump().find("\"dispatch_dtype\":\"fp8\""),
            std::string::npos);
  EXPECT_EQ(strategy_directives(fp8_opts(false), "").to_json().dump().find("dispatch_dtype"), std::string::npos);
}

TEST(Fp8Dispatch, RefusedInOneLine) {
  StrategyOptions no_ep = fp8_opts(true);
  no_ep.ep = 1;
  EXPECT_EQ(error_of(no_ep), "--fp8-dispatch needs --ep >= 2 (it sets the dtype of the expert all-to-alls)");
  // A bf16 model has no fp8 tokens to send.
  EXPECT_EQ(error_of(fp8_opts(true)),
            "--fp8-dispatch: fp8 all-to-alls need fp8 training (the experts' first GEMM takes the fp8 tokens); the "
            "model trains in bf16");
  // A directive file's bad value names the field.
  json program = strategy_directives(fp8_opts(true), spec_path(2, Precision::FP8)).to_json();
  for (auto& d : program)
    if (d["op"] == "shard") d["dispatch_dtype"] = "fp16";
  try {
    (void)parse_directives(program);
    ADD_FAILURE() << "dispatch_dtype fp16 accepted";
  } catch (const DirectiveError& e) {
    EXPECT_EQ(e.field(), "dispatch_dtype");
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
  }
  // A plan edited to fp8 all-to-alls under bf16 training is refused on load.
  json plan = compile_moe(opts(1)).to_json();
  for (auto& sg : plan["segments"])
    if (sg.contains("tags") && sg["tags"].dump().find("EP") != std::string::npos) sg["fp8_dispatch"] = true;
  try {
    (void)Program::from_json(plan);
    ADD_FAILURE() << "fp8_dispatch under bf16 accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("fp8_dispatch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("need fp8 training"), std::string::npos) << e.what();
  }
  // Neither runtime moves fp8: both refuse the plan before step 1, in one line.
  const Program fp8 = compile_moe(fp8_opts(true), 2, Precision::FP8);
  for (const auto& caps : {piper::runtime::host_capabilities(), piper::runtime::cuda_capabilities()}) {
    const std::string why = piper::runtime::unsupported_feature(fp8, caps);
    EXPECT_NE(why.find("moves its expert all-to-alls in fp8"), std::string::npos) << why;
    EXPECT_NE(why.find("compile without --fp8-dispatch"), std::string::npos) << why;
    EXPECT_EQ(why.find('\n'), std::string::npos) << why;
  }
}
