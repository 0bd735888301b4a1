// Tests of context parallelism (the context_parallel directive, --cp): per-device FLOPs, K/V bytes and
// activation memory derived by hand for a small GQA model (2 layers, seq 8, cp 2), the CP groups in
// the Program (TP innermost, then CP) and the DP gradient groups over DP x CP, directive and verifier
// errors, the simulator's cost of the ring and all-gather exchange, and step times on both engines.
#include <unistd.h>

#include <algorithm>
#include <sstream>

#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/verifier.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/search/sweep.hpp"
#include "piper/search/tune.hpp"
#include "spec_file.hpp"

using namespace piper::core;
using nlohmann::json;
using piper::test::write_spec;

namespace {

// Llama-style, flash attention with GQA: h = 32, 4 heads of 8, 2 KV heads, ffn 64, vocab 64, s = 8,
// b = 1, bf16 (2 bytes).
ModelConfig small_llama(int layers = 2, std::int64_t seq = 8) {
  ModelConfig c;
  c.name = "cp-llama";
  c.vocab = 64;
  c.hidden = 32;
  c.layers = layers;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.ffn = 64;
  c.training.seq_len = seq;
  c.training.micro_batch_size = 1;
  c.training.precision = Precision::BF16;
  return c;
}

Scenario cp_scenario(const ModelConfig& c, StrategyOptions o) {
  Scenario sc;
  sc.model = write_spec(c);
  sc.strategy = o;
  return sc;
}

const Layer& first_of(const Model& m, LayerKind kind) {
  for (const auto& l : m.layers())
    if (l.kind == kind) return l;
  throw std::logic_error("no such layer");
}

const Op* first_op(const Program& p, int device, OpKind kind, Pass pass = Pass::None) {
  for (const auto& st : p.plan_for(device).streams)
    for (const auto& op : st.ops)
      if (op.kind == kind && (kind != OpKind::Compute || op.pass == pass)) return &op;
  return nullptr;
}

std::string compile_error(const Scenario& sc) {
  try {
    (void)compile_scenario(sc);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// Attention of one device, by hand (T = s/cp = 4 local tokens, h = 32, heads·hd = 32, KV 2·8 = 16):
// projections 2·T·(h·32 + 2·h·16 + 32·h) = 2·4·3072 = 24576 FLOPs; the core over the whole sequence
// is 2·b·s²·heads·(qk + v) = 2·64·4·16 = 8192 at cp 1 (Costs' full-matrix convention), and with the
// load-balanced causal chunks each of the 2 devices does half of it: 2 ring blocks of
// 2·4²·4·16 = 2048. F = 24576 + 4096 = 28672, exactly half of cp 1's 2·24576 + 8192 = 57344.
// BI adds the core's backward, twice its forward.
TEST(ContextParallel, AttentionFlopsPerDeviceByHand) {
  const Model m = build_model(small_llama());
  const Layer& attn = first_of(m, LayerKind::Attention);
  const Costs one = layer_costs(attn, m.training(), ParallelLayout{});
  ParallelLayout cp2;
  cp2.cp = 2;
  const Costs two = layer_costs(attn, m.training(), cp2);
  EXPECT_DOUBLE_EQ(one.forward_flops, 57344);
  EXPECT_DOUBLE_EQ(two.forward_flops, 28672);
  EXPECT_DOUBLE_EQ(two.backward_input_flops - 24576, 2 * 4096);
  EXPECT_DOUBLE_EQ(two.backward_weight_flops, 24576);
  EXPECT_EQ(two.params, one.params);  // parameters are replicated over CP
  // Every layer's work and activations halve: each device runs its 4 tokens through everything.
  for (const auto& layer : m.layers()) {
    const Costs a = layer_costs(layer, m.training(), ParallelLayout{});
    const Costs b = layer_costs(layer, m.training(), cp2);
    EXPECT_DOUBLE_EQ(2 * b.forward_flops, a.forward_flops) << layer.name;
    EXPECT_DOUBLE_EQ(2 * b.backward_flops(), a.backward_flops()) << layer.name;
    EXPECT_EQ(2 * b.activation_bytes, a.activation_bytes) << layer.name;
  }
}

// K/V bytes by hand: one block is b·(s/cp) tokens of K and V over the KV heads (GQA: 2, not 4):
// 2·(8/2)·2·8·2 bytes = 256. Ring: F passes it on cp-1 = 1 time; B passes K/V again with dK/dV
// (cp-1 steps of 2 blocks) and returns the accumulator (1 block): 3·256 = 768 in 2 steps.
// All-gather: F gathers cp·256 = 512 (all-gather units); B gathers again and reduce-scatters: 1024.
// With TP 2 each device holds one KV head: half of each.
TEST(ContextParallel, KvBytesPerStepByHand) {
  const Model m = build_model(small_llama());
  const Layer& attn = first_of(m, LayerKind::Attention);
  ParallelLayout ring;
  ring.cp = 2;
  const Costs r = layer_costs(attn, m.training(), ring);
  EXPECT_EQ(r.forward_cp_bytes, 256);
  EXPECT_EQ(r.forward_cp_steps, 1);
  EXPECT_EQ(r.backward_cp_bytes, 768);
  EXPECT_EQ(r.backward_cp_steps, 2);
  ParallelLayout gather = ring;
  gather.cp_all_gather = true;
  const Costs g = layer_costs(attn, m.training(), gather);
  EXPECT_EQ(g.forward_cp_bytes, 512);
  EXPECT_EQ(g.forward_cp_steps, 1);
  EXPECT_EQ(g.backward_cp_bytes, 1024);
  EXPECT_EQ(g.backward_cp_steps, 2);
  ParallelLayout tp = ring;
  tp.tp = 2;
  EXPECT_EQ(layer_costs(attn, m.training(), tp).forward_cp_bytes, 128);
  // cp 4 on s = 8: blocks of 2 tokens, 2·2·8·2 = 128 bytes; F 3 steps, B 7 blocks in 4 steps.
  ParallelLayout cp4;
  cp4.cp = 4;
  const Costs f = layer_costs(attn, m.training(), cp4);
  EXPECT_EQ(f.forward_cp_bytes, 3 * 128);
  EXPECT_EQ(f.forward_cp_steps, 3);
  EXPECT_EQ(f.backward_cp_bytes, 7 * 128);
  EXPECT_EQ(f.backward_cp_steps, 4);
  // Selective recomputation reruns the core, and its exchange, in the backward.
  ParallelLayout sel = ring;
  sel.recompute = 1;
  const Costs s = layer_costs(attn, m.training(), sel);
  EXPECT_EQ(s.backward_cp_bytes, 768 + 256);
  EXPECT_DOUBLE_EQ(s.recompute_flops, 4096);
  // Non-attention layers exchange nothing.
  EXPECT_EQ(layer_costs(first_of(m, LayerKind::Mlp), m.training(), ring).forward_cp_bytes, 0);
}

// The kernels of a pass add up to its FLOPs, and the core runs as cp blocks of the local shape.
TEST(ContextParallel, KernelsMatchCosts) {
  const Model m = build_model(small_llama());
  ParallelLayout cp2;
  cp2.cp = 2;
  for (int tp : {1, 2})
    for (int recompute = 0; recompute < 4; ++recompute)
      for (bool all_gather : {false, true}) {
        ParallelLayout l = cp2;
        l.tp = tp;
        l.recompute = recompute;
        l.cp_all_gather = all_gather;
        for (const auto& layer : m.layers()) {
          const Costs c = layer_costs(layer, m.training(), l);
          const std::string at = layer.name + " tp " + std::to_string(tp) + " recompute " + std::to_string(recompute);
          EXPECT_DOUBLE_EQ(kernel_flops(layer_kernels(layer, m.training(), l, 0)), c.forward_flops) << at;
          EXPECT_DOUBLE_EQ(kernel_flops(layer_kernels(layer, m.training(), l, 1)), c.backward_input_flops) << at;
          EXPECT_DOUBLE_EQ(kernel_flops(layer_kernels(layer, m.training(), l, 2)), c.backward_weight_flops) << at;
        }
      }
  for (const auto& k : layer_kernels(first_of(m, LayerKind::Attention), m.training(), cp2, 0))
    if (k.kind == KernelKind::AttentionForward) {
      EXPECT_EQ(k.m, 4);
      EXPECT_EQ(k.count, 2);
    }
}

// The Program: devices k + tp·(c + cp·(r + d·pp)); the CP group of device 0 at TP 2, CP 2, DP 2 is
// {0, 2}; the gradient all-reduce spans DP x CP (same TP rank: {0, 2, 4, 6}); the ops carry the K/V
// bytes of both blocks of the one segment; activations sent between pipeline ranks are the local
// tokens' (4 x 32 x 2 = 256 bytes).
TEST(ContextParallel, GroupsAndOpsInTheProgram) {
  StrategyOptions o;
  o.tp = 2;
  o.cp = 2;
  o.dp = 2;
  const auto compiled = compile_scenario(cp_scenario(small_llama(), o));
  const Program& p = compiled.result.program;
  ASSERT_TRUE(verify(p).empty());
  ASSERT_EQ(p.num_devices, 8);
  const ProgramSegment& seg = p.segments.front();
  EXPECT_EQ(seg.cp_degree, 2);
  EXPECT_EQ(p.families.at(static_cast<std::size_t>(seg.cp_family)).purpose, FamilyPurpose::Cp);
  EXPECT_EQ(p.group_of(seg.cp_family, 0), (std::vector<int>{0, 2}));
  EXPECT_EQ(p.group_of(seg.cp_family, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(seg.replicas, 4);
  const Op* ar = first_op(p, 0, OpKind::AllReduce);
  ASSERT_NE(ar, nullptr);
  EXPECT_EQ(p.group_of(ar->family, 0), (std::vector<int>{0, 2, 4, 6}));
  const Op* f = first_op(p, 0, OpKind::Compute, Pass::F);
  const Op* b = first_op(p, 0, OpKind::Compute, Pass::B);
  ASSERT_TRUE(f && b);
  EXPECT_EQ(f->cp_bytes, 2 * 128);  // two layers, one KV head each under TP 2
  EXPECT_EQ(f->cp_steps, 2);
  EXPECT_EQ(b->cp_bytes, 2 * 384);
  EXPECT_EQ(b->cp_steps, 4);
  EXPECT_EQ(Program::from_json(p.to_json()), p);

  StrategyOptions pp;
  pp.pp = 2;
  pp.cp = 2;
  pp.microbatches = 2;
  const Program q = compile_scenario(cp_scenario(small_llama(), pp)).result.program;
  ASSERT_TRUE(verify(q).empty());
  const Op* send = first_op(q, 0, OpKind::Send);
  ASSERT_NE(send, nullptr);
  EXPECT_EQ(send->bytes, 4 * 32 * 2);
  // CP rank 1 of pipeline rank 0 is device 1, and it sends to CP rank 1 of rank 1: device 3.
  EXPECT_EQ(q.group_of(q.segments.front().cp_family, 1), (std::vector<int>{0, 1}));
  EXPECT_EQ(q.peer_of(*first_op(q, 1, OpKind::Send), 1), 3);
}

TEST(ContextParallel, DirectiveAndFlagErrors) {
  StrategyOptions o;
  o.cp = 3;  // 8 tokens do not cut into 6 chunks
  const std::string chunks = compile_error(cp_scenario(small_llama(), o));
  EXPECT_NE(chunks.find("--cp 3"), std::string::npos) << chunks;
  EXPECT_NE(chunks.find("6 equal chunks"), std::string::npos) << chunks;
  ModelConfig standard = small_llama();
  standard.name = "cp-standard";
  standard.attention_kernel = AttentionKernel::Standard;
  o.cp = 2;
  const std::string kernel = compile_error(cp_scenario(standard, o));
  EXPECT_NE(kernel.find("flash"), std::string::npos) << kernel;
  auto parse_error = [](const json& program) -> std::string {
    try {
      (void)parse_directives(program);
    } catch (const DirectiveError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(
      parse_error(json::parse(R"([{"op": "context_parallel", "degree": 2, "comm": "ring2"}])")).find("field 'comm'"),
      std::string::npos);
  EXPECT_NE(parse_error(json::parse(R"([{"op": "context_parallel", "degree": 0}])")).find("field 'degree'"),
            std::string::npos);
  const std::string twice =
      parse_error(json::parse(R"([{"op": "context_parallel", "degree": 2}, {"op": "context_parallel", "degree": 2}])"));
  EXPECT_NE(twice.find("directive 1"), std::string::npos) << twice;
  EXPECT_NE(twice.find("a second context_parallel"), std::string::npos) << twice;
  StrategyOptions ag;
  ag.cp_all_gather = true;
  EXPECT_THROW(validate_strategy_options(ag), std::invalid_argument);
}

TEST(ContextParallel, VerifierChecksGroups) {
  StrategyOptions o;
  o.cp = 2;
  o.dp = 2;
  const Program good = compile_scenario(cp_scenario(small_llama(), o)).result.program;
  ASSERT_TRUE(verify(good).empty());
  auto has = [](const std::vector<VerifyIssue>& issues, const std::string& text) {
    for (const auto& i : issues)
      if (i.check == "cp-group" && i.message.find(text) != std::string::npos) return true;
    return false;
  };
  {
    Program bad = good;
    bad.training.seq_len = 10;  // 10 tokens do not cut into 4 chunks
    EXPECT_TRUE(has(verify(bad), "does not cut into 4 equal chunks"));
  }
  {
    Program bad = good;
    bad.families[static_cast<std::size_t>(bad.segments[0].cp_family)].group_size = 4;
    EXPECT_TRUE(has(verify(bad), "is not its device set's CP groups"));
  }
  {
    Program bad = good;
    bad.segments[0].cp_family = -1;
    EXPECT_TRUE(has(verify(bad), "no CP family"));
  }
  {
    // Device 1 gets its own plan whose first CP op moves different bytes than its group's device 0.
    Program bad = good;
    Plan changed = bad.plan_for(1);
    for (auto& st : changed.streams)
      for (auto& op : st.ops)
        if (op.cp_steps > 0) {
          op.cp_bytes += 2;
          goto done;
        }
  done:
    bad.plans.push_back(changed);
    bad.plan_of_device[1] = static_cast<int>(bad.plans.size()) - 1;
    EXPECT_TRUE(has(verify(bad), "issue different CP compute ops"));
  }
}

// The simulator: ring, cp_steps transfers of cp_bytes / cp_steps to the next CP rank (NVLink: latency
// + bytes / bandwidth), each hiding under (cp-1)/cp of the attention core's time spread over the steps;
// all-gather, cp_steps all-gathers over the CP group, not hidden.
TEST(ContextParallel, SimulatorCostsTheExchange) {
  StrategyOptions o;
  o.cp = 2;
  const Program ring = compile_scenario(cp_scenario(small_llama(), o)).result.program;
  o.cp_all_gather = true;
  const Program gather = compile_scenario(cp_scenario(small_llama(), o)).result.program;
  const piper::sim::Cluster cluster = piper::sim::with_devices(piper::sim::load_cluster("dgx-a100-80g"), 2);
  const piper::sim::CostModel cost(cluster);
  const auto& node = cluster.nodes.front();
  const Op* f = first_op(ring, 0, OpKind::Compute, Pass::F);
  ASSERT_NE(f, nullptr);
  double attention = 0;
  for (const auto& k : ring.segments[static_cast<std::size_t>(f->segment)].kernels[0])
    if (k.kind == KernelKind::AttentionForward) attention += k.count * cost.timing(0).seconds(k);
  ASSERT_GT(attention, 0);
  const double transfer = node.nvlink_latency_s + 256.0 / node.nvlink_effective_bandwidth_bytes_per_s();
  EXPECT_NEAR(cost.cp_seconds(ring, 0, *f), 2 * std::max(0.0, transfer - attention * 0.5 / 2), 1e-15);
  Op plain = *f;
  plain.cp_steps = 0;
  plain.cp_bytes = 0;
  EXPECT_NEAR(cost.compute_seconds(ring, 0, *f) - cost.compute_seconds(ring, 0, plain), cost.cp_seconds(ring, 0, *f),
              1e-15);
  const Op* g = first_op(gather, 0, OpKind::Compute, Pass::F);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->cp_bytes, 1024);
  // Two ranks on NVLink: an all-gather of 512 bytes is one latency and half of it over the link.
  EXPECT_NEAR(cost.cp_seconds(gather, 0, *g),
              2 * (node.nvlink_latency_s + 256.0 / node.nvlink_effective_bandwidth_bytes_per_s()), 1e-15);
}

// Step time on both engines: a compute-bound model (s = 4096, h = 1024) at cp 2 does half the work
// per device, so its step drops, but not below half of cp 1's (the ring, the gradient all-reduce over
// the CP pair and smaller, less efficient kernels).
TEST(ContextParallel, StepTimeDropsOnBothEngines) {
  ModelConfig c = small_llama(2, 4096);
  c.name = "cp-llama-big";
  c.hidden = 1024;
  c.heads = 16;
  c.kv_heads = 4;
  c.head_dim = 64;
  c.ffn = 4096;
  c.vocab = 32000;
  const std::string cluster = ::testing::TempDir() + "/cp-cluster-" + std::to_string(::getpid()) + ".json";
  std::ofstream(cluster) << R"({"preset": "dgx-a100-80g", "node": {"gpu": {"kernel_table": ""}}})";
  for (const char* engine : {"analytic", "simgrid"}) {
    auto step = [&](int cp, bool all_gather) {
      StrategyOptions o;
      o.cp = cp;
      o.cp_all_gather = all_gather;
      o.microbatches = 2;
      Scenario sc = cp_scenario(c, o);
      piper::sim::SimulateOptions so;
      so.cluster = cluster;
      so.engine = engine;
      const auto report = piper::sim::simulate(sc, so).report;
      EXPECT_EQ(report.tokens_per_step, 2 * 4096) << engine << " cp " << cp;  // CP splits the tokens, it adds none
      return report.step_time_s;
    };
    const double one = step(1, false), ring = step(2, false), gather = step(2, true);
    EXPECT_LT(ring, one) << engine;
    EXPECT_GT(ring, one / 2) << engine;
    EXPECT_LT(gather, one) << engine;
    EXPECT_GT(gather, one / 2) << engine;
  }
}

// tune searches the CP degrees it is given: one that does not divide the devices, or whose 2·cp
// chunks do not cut the sequence, is left out with its reason; every CP candidate compiles, simulates,
// and keeps the memory and step-time lower bounds below the simulated figures (branch and bound and
// pruning rely on them).
TEST(ContextParallel, TuneSearchesCp) {
  using namespace piper::sim;
  using namespace piper::search;
  TuneSpec spec;
  spec.model = "qwen3-9m";
  spec.cluster = "dgx-h200";
  spec.devices = 4;
  spec.global_batch = 8;
  spec.micro_batch_sizes = {1};
  spec.zero_levels = {0, 1};
  spec.max_virtual = 1;
  spec.tp_degrees = {1, 2};
  spec.recompute_modes = {"none", "selective"};
  spec.schedules = {"1f1b"};
  spec.reduce_every = {"microbatch"};
  spec.top_k = 0;
  spec.placement_search = false;
  spec.seq_len = 24;  // cuts into 2·2 and 2·4 chunks
  spec.cp_degrees = {1, 2, 3, 4};
  EnumerationStats stats;
  const auto candidates = enumerate_candidates(spec, &stats);
  EXPECT_EQ(stats.cp_degrees, (std::vector<int>{1, 2, 4}));
  ASSERT_EQ(stats.cp_rejected.size(), 1u);
  EXPECT_EQ(stats.cp_rejected.front(), "CP 3: does not divide the 4 devices");
  spec.seq_len = 20;  // 2·2 = 4 divides it, 2·4 = 8 does not
  EnumerationStats short_stats;
  (void)enumerate_candidates(spec, &short_stats);
  EXPECT_EQ(short_stats.cp_degrees, (std::vector<int>{1, 2}));
  spec.seq_len = 24;
  int checked = 0;
  for (const auto& c : candidates) {
    EXPECT_EQ(c.pp * c.dp * c.tp * c.cp, 4) << c.key();
    if (c.cp == 1) continue;
    EXPECT_NE(c.key().find("/cp" + std::to_string(c.cp)), std::string::npos) << c.key();
    EXPECT_NE(c.describe().find("x CP " + std::to_string(c.cp)), std::string::npos) << c.describe();
    const TuneRow row = evaluate_candidate(spec, c, "analytic");
    ASSERT_EQ(row.status, "ok") << c.key() << ": " << row.reason;
    EXPECT_LE(memory_lower_bound(spec, c), row.peak_memory_bytes) << c.key();
    EXPECT_LE(step_time_lower_bound(spec, c), row.step_time_s) << c.key();
    // The results row reads back to the same candidate.
    const std::string line = to_csv(spec, row);
    std::vector<std::string> fields;
    std::string field;
    for (char ch : line) {
      if (ch == ',')
        fields.push_back(field), field.clear();
      else
        field += ch;
    }
    fields.push_back(field);
    EXPECT_EQ(tune_row_from_csv(fields, nullptr, "row").candidate, c) << line;
    ++checked;
  }
  EXPECT_GT(checked, 4);
  // EP groups span the DP x CP ranks (Megatron-core's layout): at CP 2 x DP 2 the search offers EP 4
  // (qwen3-9m has 8 experts), which divides neither DP nor CP alone.
  EXPECT_TRUE(std::any_of(candidates.begin(), candidates.end(),
                          [](const TuneCandidate& c) { return c.cp == 2 && c.dp == 2 && c.ep == 4; }));
  for (const auto& c : candidates) EXPECT_EQ((c.dp * c.cp) % c.ep, 0) << c.key();
}

// Scenario files carry the strategy's CP knobs (written only when used) and check them.
TEST(ContextParallel, ScenarioKeys) {
  Scenario sc;
  sc.model = "qwen3-9m";
  sc.strategy.cp = 2;
  sc.strategy.cp_all_gather = true;
  const json j = sc.to_json();
  EXPECT_EQ(j["strategy"]["cp"], 2);
  EXPECT_EQ(j["strategy"]["cp_all_gather"], true);
  const Scenario back = Scenario::from_json(j, "s.json");
  EXPECT_EQ(back.strategy.cp, 2);
  EXPECT_TRUE(back.strategy.cp_all_gather);
  EXPECT_FALSE(Scenario{}.to_json()["strategy"].contains("cp"));
  json bad = j;
  bad["strategy"]["cp"] = 0;
  try {
    (void)Scenario::from_json(bad, "s.json");
    ADD_FAILURE() << "cp 0 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("strategy.cp"), std::string::npos) << e.what();
  }
  bad = j;
  bad["strategy"]["cp_all_gather"] = "yes";
  EXPECT_THROW((void)Scenario::from_json(bad, "s.json"), Error);
}

// Sweep specs take a `cp` knob: each degree is one combination, its key and CSV row say which, and a
// CP 2 point holds the same tokens per step as CP 1 on twice the devices.
TEST(ContextParallel, SweepKnob) {
  using namespace piper::sim;
  using namespace piper::search;
  const SweepSpec spec =
      SweepSpec::parse(R"({"model": "qwen3-9m", "cluster": "dgx-h200", "seq_len": 64, "cp": [1, 2]})", "s.json");
  const auto points = expand(spec);
  ASSERT_EQ(points.size(), 2u);
  EXPECT_EQ(points[0].cp, 1);
  EXPECT_EQ(points[1].cp, 2);
  EXPECT_EQ(points[0].key().find("/cp"), std::string::npos);
  EXPECT_NE(points[1].key().find("/cp2"), std::string::npos);
  const SweepRow one = run_point(points[0]), two = run_point(points[1]);
  ASSERT_EQ(one.status, "ok") << one.reason;
  ASSERT_EQ(two.status, "ok") << two.reason;
  EXPECT_EQ(two.devices, 2);
  EXPECT_DOUBLE_EQ(two.tokens_per_s * two.step_time_s, one.tokens_per_s * one.step_time_s);
  EXPECT_EQ(to_json(two).at("cp"), 2);
  // The CSV's cp column (found by name: settings' columns follow the table's order).
  const auto& columns = sweep_csv_columns();
  const auto at = static_cast<std::size_t>(std::find(columns.begin(), columns.end(), "cp") - columns.begin());
  ASSERT_LT(at, columns.size());
  std::vector<std::string> fields;
  const std::string row = to_csv(two);  // no quoted fields here; an empty last field counts too
  for (std::size_t b = 0, e = 0; e != std::string::npos; b = e + 1) {
    e = row.find(',', b);
    fields.push_back(row.substr(b, e == std::string::npos ? std::string::npos : e - b));
  }
  ASSERT_EQ(fields.size(), columns.size());
  EXPECT_EQ(fields[at], "2");
  EXPECT_THROW(SweepSpec::parse(R"({"model": "qwen3-9m", "cp": ["two"]})", "s.json"), SweepError);
}
