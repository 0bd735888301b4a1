// Kernel efficiency tables and the per-kernel cost model. Expected values are derived here from the
// table's raw measurements (read independently from sim/data/kernels-h200-sxm.json) and the
// interpolation rules of docs/cost-model.md, not taken from the code under test.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/kernels.hpp"
#include "piper/core/scenario.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/kernel_table.hpp"
#include "expect.hpp"

using namespace piper;
using namespace piper::sim;
using nlohmann::json;

using piper::test::error_of;
using piper::test::expect_rel;

namespace {

// The raw measurements, read once (a reference: loops over its members must not outlive it).
const json& raw_table() {
  static const json t = [] {
    std::ifstream in(std::string(PIPER_SOURCE_DIR) + "/sim/data/kernels-h200-sxm.json");
    return json::parse(in);
  }();
  return t;
}

// The dispatch latency in kernels.py's single-launch GEMM timings, by docs/cost-model.md's rule: the
// median over (dtype, K, N) curves of the time at M = 0 on the line through the two smallest M.
double dispatch_latency() {
  std::map<std::tuple<std::string, std::int64_t, std::int64_t>, std::map<std::int64_t, double>> curves;
  for (const auto& g : raw_table()["gemm"]) {
    if (!g.contains("tflops")) continue;
    const std::int64_t m = g["m"], k = g["k"], n = g["n"];
    curves[{g["dtype"], k, n}][m] = 2.0 * m * k * n / (g["tflops"].get<double>() * 1e12);
  }
  std::vector<double> at_zero;
  for (const auto& [key, c] : curves) {
    if (c.size() < 2) continue;
    auto it = c.begin();
    const auto [m1, t1] = *it++;
    const auto [m2, t2] = *it;
    at_zero.push_back(t1 - (t2 - t1) / static_cast<double>(m2 - m1) * static_cast<double>(m1));
  }
  std::sort(at_zero.begin(), at_zero.end());
  const std::size_t n = at_zero.size();
  return n % 2 ? at_zero[n / 2] : (at_zero[n / 2 - 1] + at_zero[n / 2]) / 2;
}

// The best measured rate of a dtype, before any correction.
double best_measured(const std::string& dt) {
  double best = 0;
  for (const auto& g : raw_table()["gemm"])
    if (g["dtype"] == dt && g.contains("tflops")) best = std::max(best, g["tflops"].get<double>() * 1e12);
  return best;
}

// A GEMM measurement as the table uses it: its time less the dispatch latency (at least a quarter of
// it), at most the dtype's best measured rate.
double measured_gemm(const std::string& dt, std::int64_t m, std::int64_t k, std::int64_t n) {
  static const double latency = dispatch_latency();
  for (const auto& g : raw_table()["gemm"])
    if (g["dtype"] == dt && g["m"] == m && g["k"] == k && g["n"] == n) {
      const double work = 2.0 * m * k * n, s = work / (g["tflops"].get<double>() * 1e12);
      return std::min(work / std::max(s - latency, s / 4), best_measured(dt));
    }
  ADD_FAILURE() << "no measurement " << dt << " " << m << " " << k << " " << n;
  return 0;
}

// The time of an element-wise kernel of `kind` over n elements (bf16) under kt's profile.
double elementwise_seconds(const KernelTiming& kt, core::KernelKind kind, double n) {
  core::Kernel k;
  k.kind = kind;
  k.elems = static_cast<std::int64_t>(n);
  return kt.seconds(k);
}

// `bytes` moved in `launches` kernels of the table's `kernel` class, derived by hand.
double memory_bound_by_hand(const KernelTable& t, double bytes, int launches, const char* kernel) {
  return bytes / t.memory_rate(kernel, bytes / launches) + launches * t.launch_floor_s;
}

}  // namespace

// kernels.py timed each GEMM as one launch between two events on an idle GPU: the H200 table takes
// the dispatch latency that carries off every GEMM (not off attention or memory-bound kernels).
TEST(KernelTable, RemovesTheDispatchLatencyOfSingleLaunchGemmTimings) {
  const auto t = load_kernel_table("h200-sxm");
  expect_rel(t->gemm_dispatch_latency_s, dispatch_latency());
  // About 27 µs here: 512 x 1024 x 1024 measured 32 µs, 2048 x 1024 x 1024 38 µs.
  EXPECT_GT(t->gemm_dispatch_latency_s, 10e-6);
  EXPECT_LT(t->gemm_dispatch_latency_s, 40e-6);
  // A large GEMM changes little, a small one a lot.
  const double big = 2.0 * 32768 * 8192 * 8192, small = 2.0 * 512 * 1024 * 1024;
  double big_raw = 0, small_raw = 0;
  for (const auto& g : raw_table()["gemm"]) {
    if (g["dtype"] == "bf16" && g["m"] == 32768 && g["k"] == 8192 && g["n"] == 8192)
      big_raw = g["tflops"].get<double>() * 1e12;
    if (g["dtype"] == "bf16" && g["m"] == 512 && g["k"] == 1024 && g["n"] == 1024)
      small_raw = g["tflops"].get<double>() * 1e12;
  }
  expect_rel(t->gemm_rate("bf16", 32768, 8192, 8192),
             std::min(big / (big / big_raw - t->gemm_dispatch_latency_s), best_measured("bf16")));
  expect_rel(t->gemm_rate("bf16", 512, 1024, 1024),
             small / std::max(small / small_raw - t->gemm_dispatch_latency_s, small / small_raw / 4));
  // No corrected GEMM outruns the table's best rate of its dtype before the correction: with 30 µs
  // off, a 0.1 ms GEMM at 500 TFLOP/s would run at 714 and the best (a 1 ms GEMM at 600) at 618.6;
  // both stay at 600.
  const json capped = {{"gemm_dispatch_latency", 30},
                       {"gemm",
                        {{{"dtype", "bf16"}, {"m", 1000}, {"k", 1000}, {"n", 25000}, {"tflops", 500}},
                         {{"dtype", "bf16"}, {"m", 1000}, {"k", 1000}, {"n", 300000}, {"tflops", 600}}}},
                       {"attention", json::array()},
                       {"memory_bound", json::array()},
                       {"adamw", json::array()}};
  const KernelTable ct = KernelTable::from_json(capped, "capped.json");
  expect_rel(ct.gemm.front().flops_per_s, 600e12);
  expect_rel(ct.gemm.back().flops_per_s, 600e12);
  // A cited figure of the dtype (a published shape search's best) is the bound where there is one.
  json cited = capped;
  cited["gemm"][1]["tflops"] = 450;
  cited["gemm"][1]["source"] = {{"url", "https://example.org"}, {"quote", "450"}};
  const KernelTable cb = KernelTable::from_json(cited, "cited.json");
  expect_rel(cb.gemm.front().flops_per_s, 450e12);
  expect_rel(cb.gemm.back().flops_per_s, 450e12);  // cited: kept as published
  // The published tables derived from this one keep its dispatch latency (a host cost), unscaled.
  for (const char* name : {"a100-80gb-sxm", "a100-40gb-sxm", "h100-sxm"})
    expect_rel(load_kernel_table(name)->gemm_dispatch_latency_s, t->gemm_dispatch_latency_s, 1e-5);
  // A table without the key keeps its GEMMs as given.
  const json plain = {{"gemm", {{{"dtype", "bf16"}, {"m", 512}, {"k", 1024}, {"n", 1024}, {"tflops", 10}}}},
                      {"attention", json::array()},
                      {"memory_bound", json::array()},
                      {"adamw", json::array()}};
  EXPECT_EQ(KernelTable::from_json(plain, "plain.json").gemm_dispatch_latency_s, 0);
  EXPECT_EQ(KernelTable::from_json(plain, "plain.json").gemm.front().flops_per_s, 10e12);
  json bad = plain;
  bad["gemm_dispatch_latency"] = "guess";
  EXPECT_NE(error_of([&] { KernelTable::from_json(bad, "bad.json"); }).find("gemm_dispatch_latency"),
            std::string::npos);
}

// Attention interpolates within each measured head dimension, never across: a head-dim-128 query of few
// heads takes the head-dim-128 measurements (clamped into their box), not the faster or slower
// head-dim-64 ones nearer in batch·heads; a head dimension between two measured ones is linear in log
// head_dim between the two surfaces. By hand on a four-entry table.
TEST(KernelTable, AttentionInterpolatesWithinEachMeasuredHeadDimension) {
  const auto entry = [](int b, int s, int heads, int d, double fwd, double bwd) {
    return json{{"b", b}, {"s", s}, {"heads", heads}, {"head_dim", d}, {"fwd_tflops", fwd}, {"bwd_tflops", bwd}};
  };
  const json j = {{"gemm", {{{"dtype", "bf16"}, {"m", 512}, {"k", 1024}, {"n", 1024}, {"tflops", 10}}}},
                  {"attention",
                   {entry(1, 8192, 16, 64, 100, 80), entry(1, 8192, 32, 64, 120, 90), entry(1, 8192, 32, 128, 300, 250),
                    entry(1, 8192, 64, 128, 340, 270)}},
                  {"memory_bound", json::array()},
                  {"adamw", json::array()}};
  const KernelTable t = KernelTable::from_json(j, "hd.json");
  // 16 heads of 128: below head-dim 128's box (32-64 heads): its 32-head point, not a mix with head dim 64's.
  expect_rel(t.attention_rate(false, 1, 8192, 16, 128), 300e12);
  expect_rel(t.attention_rate(true, 1, 8192, 16, 128), 250e12);
  // 48 heads of 128: inverse squared distance in log2(batch·heads) between 32 (log 5) and 64 (log 6).
  const double d32 = std::log2(48.0) - 5, d64 = 6 - std::log2(48.0);
  const double w32 = 1 / (d32 * d32), w64 = 1 / (d64 * d64);
  expect_rel(t.attention_rate(false, 1, 8192, 48, 128), (w32 * 300 + w64 * 340) / (w32 + w64) * 1e12);
  // Head dim 96 at 32 heads: between 120 (64) and 300 (128), at log2(96/64) / log2(128/64) of the way.
  const double f = std::log2(96.0 / 64.0);
  expect_rel(t.attention_rate(false, 1, 8192, 32, 96), (120 + f * (300 - 120)) * 1e12);
  // Outside the measured head dimensions: the nearest's surface.
  expect_rel(t.attention_rate(false, 1, 8192, 32, 256), 300e12);
  expect_rel(t.attention_rate(true, 1, 8192, 16, 32), 80e12);
}

TEST(KernelTable, MeasuredShapesReturnTheirMeasurement) {
  const auto t = load_kernel_table("h200-sxm");
  // gemm_rate takes (m, n, k); the file lists m, k, n.
  expect_rel(t->gemm_rate("bf16", 2048, 8192, 2048), measured_gemm("bf16", 2048, 2048, 8192));
  expect_rel(t->gemm_rate("bf16", 8192, 4096, 14336), measured_gemm("bf16", 8192, 14336, 4096));
  expect_rel(t->gemm_rate("fp8", 8192, 4096, 4096), measured_gemm("fp8", 8192, 4096, 4096));
  expect_rel(t->gemm_rate("fp16", 512, 1024, 1024), measured_gemm("bf16", 512, 1024, 1024));  // fp16 runs as bf16
  for (const auto& a : raw_table()["attention"]) {
    expect_rel(t->attention_rate(false, a["b"], a["s"], a["heads"], a["head_dim"]),
               a["fwd_tflops"].get<double>() * 1e12);
    expect_rel(t->attention_rate(true, a["b"], a["s"], a["heads"], a["head_dim"]),
               a["bwd_tflops"].get<double>() * 1e12);
  }
  for (const auto& m : raw_table()["memory_bound"]) {
    if (m["kernel"] == "cross_entropy_fwd_fp32") continue;  // in bytes moved: CrossEntropyRatesAreInBytesMoved
    const double bytes = m["gbps"].get<double>() * 1e9 * m["s"].get<double>();
    expect_rel(t->memory_rate(m["kernel"], bytes), m["gbps"].get<double>() * 1e9);
  }
}

TEST(KernelTable, InterpolatesInLogMAndScalesBelowTheSmallestSize) {
  const auto t = load_kernel_table("h200-sxm");
  // m = 4096 lies halfway (in log2) between 2048 and 8192 for the same (k, n) = (4096, 4096).
  const double a = measured_gemm("bf16", 2048, 4096, 4096), b = measured_gemm("bf16", 8192, 4096, 4096);
  expect_rel(t->gemm_rate("bf16", 4096, 4096, 4096), (a + b) / 2);
  // m = 256 x n = 1024: an output half the smallest measured one (512 x 1024): the same time as
  // m = 512, so half the rate.
  expect_rel(t->gemm_rate("bf16", 256, 1024, 1024), measured_gemm("bf16", 512, 1024, 1024) / 2);
  // m = 256 x n = 4096: below the smallest M, but its output is larger than the smallest measured
  // one: it fills the GPU as well, at the clamped shape's (m = 512) rate.
  expect_rel(t->gemm_rate("bf16", 256, 4096, 4096), measured_gemm("bf16", 512, 4096, 4096));
  // A thin batched GEMM (P·V: n = head_dim 64 below the smallest measured N, 1024) with a large
  // output keeps the clamped N's rate instead of 64 / 1024 of it.
  expect_rel(t->gemm_rate("bf16", 2048, 64, 2048, 64), t->gemm_rate("bf16", 2048, 1024, 2048, 64));
  // A batched GEMM fills the GPU as one with batch x the rows.
  expect_rel(t->gemm_rate("bf16", 1024, 4096, 4096, 2), measured_gemm("bf16", 2048, 4096, 4096));
  // tf32 is measured at m = 8192 only: bf16's curve times the ratio there.
  const double ratio = measured_gemm("tf32", 8192, 4096, 4096) / measured_gemm("bf16", 8192, 4096, 4096);
  expect_rel(t->gemm_rate("tf32", 2048, 4096, 4096), measured_gemm("bf16", 2048, 4096, 4096) * ratio);
  // An unmeasured (k, n) lies within the range of its neighbours.
  const double r = t->gemm_rate("bf16", 8192, 6000, 6000);
  EXPECT_GT(r, 600e12);
  EXPECT_LT(r, 770e12);
}

TEST(KernelTable, H100KeepsH200ComputeWhereNothingIsPublishedAndScalesMemory) {
  const auto h200 = load_kernel_table("h200-sxm"), h100 = load_kernel_table("h100-sxm");
  // (k, n) = (4096, 14336) has no published H100 figure: the H200's measurement ("h100-same-die" rule).
  // Its correction is bounded by the H100 table's best cited bf16 rate (a square), not the H200's.
  std::ifstream in(std::string(PIPER_SOURCE_DIR) + "/sim/data/kernels-h100-sxm.json");
  const json h100_raw = json::parse(in);
  double h100_best = 0;
  for (const auto& g : h100_raw["gemm"])
    if (g["dtype"] == "bf16" && g.contains("source")) h100_best = std::max(h100_best, g["tflops"].get<double>() * 1e12);
  const double work = 2.0 * 8192 * 4096 * 14336;
  double raw_s = 0;
  for (const auto& g : raw_table()["gemm"])
    if (g["dtype"] == "bf16" && g["m"] == 8192 && g["k"] == 4096 && g["n"] == 14336)
      raw_s = work / (g["tflops"].get<double>() * 1e12);
  expect_rel(h100->gemm_rate("bf16", 8192, 14336, 4096),
             std::min(work / (raw_s - h200->gemm_dispatch_latency_s), h100_best));
  expect_rel(h100->memory_rate("add", 1e8), h200->memory_rate("add", 1e8) * 3.35 / 4.8);
  expect_rel(h100->adamw_bytes_per_s, h200->adamw_bytes_per_s * 3.35 / 4.8);
  // AdamW: 1e9 bf16 parameters, 22 bytes each, in the measured time.
  double s = 0;
  for (const auto& a : raw_table()["adamw"])
    if (a["params"] == 1000000000 && a["param_dtype"] == "torch.bfloat16") s = a["s"];
  expect_rel(h200->adamw_bytes_per_s, 22e9 / s);
}

TEST(KernelTable, TimesKernelsByHand) {
  const auto t = load_kernel_table("h200-sxm");
  KernelTiming kt;
  kt.table = t.get();
  kt.peak_flops = 989e12;
  kt.hbm_bytes_per_s = 4.8e12;
  core::Kernel g;
  g.m = 2048;
  g.n = 8192;
  g.k = 2048;
  g.flops = 2.0 * 2048 * 8192 * 2048;
  expect_rel(kt.seconds(g), g.flops / measured_gemm("bf16", 2048, 2048, 8192) + t->launch_floor_s);
  // Flash attention forward at a measured shape: b·heads·s²·(qk + v) causal FLOPs at its rate.
  core::Kernel a;
  a.kind = core::KernelKind::AttentionForward;
  a.batch = 16;
  a.m = 1024;
  a.n = 32;
  a.k = 8;
  a.head_dim = a.v_dim = 128;
  const double causal = 16.0 * 32 * 1024 * 1024 * 256;
  expect_rel(kt.seconds(a), causal / t->attention_rate(false, 16, 1024, 32, 128) + t->launch_floor_s);
  a.kind = core::KernelKind::AttentionBackward;
  expect_rel(kt.seconds(a), 2.5 * causal / t->attention_rate(true, 16, 1024, 32, 128) + t->launch_floor_s);
  // Fused RMSNorm over 8192 x 2048 bf16: read and write, 2·2 bytes per element, at rmsnorm's rate.
  core::Kernel n;
  n.kind = core::KernelKind::Norm;
  n.elems = 8192 * 2048;
  const double bytes = 4.0 * n.elems;
  expect_rel(kt.seconds(n), bytes / t->memory_rate("rmsnorm", bytes) + t->launch_floor_s);
  // Eager SwiGLU: silu then mul, 5 element passes in 2 launches.
  core::Kernel act;
  act.kind = core::KernelKind::Activation;
  act.elems = 1 << 24;
  const double fused_bytes = 3.0 * 2 * act.elems, eager_bytes = 5.0 * 2 * act.elems;
  expect_rel(kt.seconds(act), fused_bytes / t->memory_rate("silu_mul", fused_bytes) + t->launch_floor_s);
  kt.profile = RuntimeProfile::Eager;
  expect_rel(kt.seconds(act), eager_bytes / t->memory_rate("silu_mul", eager_bytes / 2) + 2 * t->launch_floor_s);
  // eager-fused-loss: the loss as one fused kernel (fp32 logits: 8 bytes a logit forward, one
  // launch), everything else as eager.
  core::Kernel loss;
  loss.kind = core::KernelKind::Loss;
  loss.elems = 4096L * 50368;
  const double fused_loss = 8.0 * loss.elems, eager_loss = 12.0 * loss.elems;
  kt.profile = RuntimeProfile::EagerFusedLoss;
  expect_rel(kt.seconds(loss), fused_loss / t->memory_rate("cross_entropy_fwd_fp32", fused_loss) + t->launch_floor_s);
  expect_rel(kt.seconds(act), eager_bytes / t->memory_rate("silu_mul", eager_bytes / 2) + 2 * t->launch_floor_s);
  kt.profile = RuntimeProfile::Eager;
  expect_rel(kt.seconds(loss),
             eager_loss / t->memory_rate("cross_entropy_fwd_fp32", eager_loss / 2) + 2 * t->launch_floor_s);
  EXPECT_EQ(runtime_profile_from_string(to_string(RuntimeProfile::EagerFusedLoss)), RuntimeProfile::EagerFusedLoss);
}

namespace {

// A zoo model compiled with a pipeline of `pp` stages over `microbatches`.
core::CompiledScenario compile_pipeline(const char* model, int pp, int microbatches) {
  core::Scenario sc;
  sc.model = model;
  sc.strategy.pp = pp;
  sc.strategy.microbatches = microbatches;
  return core::compile_scenario(sc);
}

}  // namespace

TEST(KernelTable, CostModelSumsTheKernelsOfAnOp) {
  const auto compiled = compile_pipeline("qwen3-9m", 2, 2);
  const core::Program& p = compiled.result.program;
  const Cluster cluster = load_cluster("dgx-h200");
  const CostModel cost(cluster);
  const KernelTiming kt = cost.timing(0);
  int compute = 0, updates = 0;
  for (const auto& op : p.plan_for(0).streams[0].ops) {
    if (op.kind == core::OpKind::Compute) {
      const auto& pk = p.segments.at(static_cast<std::size_t>(op.segment)).kernels;
      double by_hand = 0;
      const std::vector<int> lists = op.pass == core::Pass::F ? std::vector<int>{0} : std::vector<int>{1, 2};
      for (int l : lists)
        for (const auto& k : pk[static_cast<std::size_t>(l)]) by_hand += k.count * kt.seconds(k);
      // The second microbatch's backward adds its bf16 gradients into the first's (autograd's
      // in-place add, 6 bytes a parameter): one more element-wise kernel.
      if (op.pass != core::Pass::F && op.microbatch >= 1) {
        core::Kernel accumulate;
        accumulate.kind = core::KernelKind::Elementwise;
        accumulate.bytes = 6 * p.segments.at(static_cast<std::size_t>(op.segment)).params;
        by_hand += kt.seconds(accumulate);
      }
      ASSERT_GT(by_hand, 0);
      expect_rel(cost.compute_seconds(p, 0, op), by_hand);
      ++compute;
    } else if (op.kind == core::OpKind::Update) {
      expect_rel(cost.compute_seconds(p, 0, op),
                 static_cast<double>(op.memory_bytes) / load_kernel_table("h200-sxm")->adamw_bytes_per_s +
                     load_kernel_table("h200-sxm")->launch_floor_s);
      ++updates;
    }
  }
  EXPECT_GT(compute, 0);
  EXPECT_GT(updates, 0);
  // Without a table (the A100 preset with "kernel_table": "") the kernels are still listed and timed,
  // GEMMs by the GPU's curve: 312 TFLOP/s x 0.75 x f / (f + 2 GFLOP), plus the 2 µs floor; element-wise
  // at 2,039 GB/s.
  const Cluster a100 =
      cluster_from_text(R"({"preset": "dgx-a100-80g", "node": {"gpu": {"kernel_table": ""}}})", "c.json");
  EXPECT_TRUE(a100.gpu(0).kernel_table.empty());
  const KernelTiming curve = CostModel(a100).timing(0);
  core::Kernel g;
  g.m = 4096;
  g.n = 2048;
  g.k = 1024;
  g.flops = 2.0 * 4096 * 2048 * 1024;
  expect_rel(curve.seconds(g), g.flops / (312e12 * 0.75 * g.flops / (g.flops + 2e9)) + 2e-6);
  core::Kernel add;
  add.kind = core::KernelKind::Residual;
  add.elems = 1 << 20;
  expect_rel(curve.seconds(add), 3.0 * 2 * add.elems / 2039e9 + 2e-6);
  const CostModel a100_cost(a100);
  for (const auto& op : p.plan_for(0).streams[0].ops)
    if (op.kind == core::OpKind::Compute) {
      EXPECT_TRUE(a100_cost.kernel_seconds(p, 0, op).has_value());
    }
  // The eager profile launches more element-wise kernels: every compute op is slower.
  Cluster eager = cluster;
  eager.runtime = "eager";
  const CostModel eager_cost(eager);
  for (const auto& op : p.plan_for(0).streams[0].ops)
    if (op.kind == core::OpKind::Compute) {
      EXPECT_GT(eager_cost.compute_seconds(p, 0, op), cost.compute_seconds(p, 0, op));
    }
}

TEST(KernelTable, ClusterFieldsAndTableFilesAreChecked) {
  EXPECT_EQ(load_cluster("dgx-h200").gpu(0).kernel_table, "h200-sxm");
  EXPECT_EQ(load_cluster("dgx-h100").gpu(0).kernel_table, "h100-sxm");
  auto cl = [](const std::string& text) { return cluster_from_text(text, "c.json"); };
  EXPECT_NE(error_of([&] { cl(R"({"preset": "dgx-h200", "runtime": "lazy"})"); }).find("field 'runtime'"),
            std::string::npos);
  EXPECT_EQ(cl(R"({"preset": "dgx-h200", "runtime": "eager"})").runtime, "eager");
  EXPECT_EQ(cl(R"({"preset": "dgx-h200", "runtime": "eager-fused-loss"})").runtime, "eager-fused-loss");
  const std::string e =
      error_of([&] { cl(R"({"preset": "dgx-h200", "node": {"gpu": {"kernel_table": "nope.json"}}})"); });
  EXPECT_NE(e.find("field 'node.gpu.kernel_table'"), std::string::npos) << e;
  EXPECT_EQ(cl(R"({"preset": "dgx-h200", "node": {"gpu": {"kernel_table": ""}}})").gpu(0).kernel_table, "");
  // A table file: a base table with scaled memory, and a broken one.
  const std::string dir = ::testing::TempDir() + "/kt-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/slow.json") << R"({"base": "h200-sxm", "memory_scale": 0.5, "launch_floor_us": 4})";
  const auto slow = load_kernel_table(dir + "/slow.json");
  expect_rel(slow->memory_rate("add", 1e8), load_kernel_table("h200-sxm")->memory_rate("add", 1e8) / 2);
  EXPECT_DOUBLE_EQ(slow->launch_floor_s, 4e-6);
  std::ofstream(dir + "/bad.json") << R"({"gemm": [{"dtype": "bf16", "m": 512, "k": 1024, "n": -3, "tflops": 10}]})";
  const std::string b = error_of([&] { load_kernel_table(dir + "/bad.json"); });
  EXPECT_NE(b.find("gemm[0].n"), std::string::npos) << b;
  std::ofstream(dir + "/bad2.json") << R"({"gemm": [{"dtype": "int4", "m": 512, "k": 1024, "n": 3, "tflops": 10}]})";
  EXPECT_NE(error_of([&] { load_kernel_table(dir + "/bad2.json"); }).find("unknown dtype 'int4'"), std::string::npos);
}

TEST(KernelTable, SlidingWindowAttentionCountsTheCausalBand) {
  // s = 8192, window 4096: causal query-key pairs s·w - w²/2 = 25,165,824 against s²/2 = 33,554,432
  // for full causal attention, i.e. 3/4 of the work; a window >= s changes nothing.
  core::Kernel k;
  k.kind = core::KernelKind::AttentionForward;
  k.m = 8192, k.n = 32, k.k = 8, k.batch = 1, k.head_dim = 128, k.v_dim = 128;
  const double full = causal_attention_flops(k);
  EXPECT_DOUBLE_EQ(full, 32.0 * 8192 * 8192 * 256);
  k.window = 4096;
  EXPECT_DOUBLE_EQ(causal_attention_flops(k), 32.0 * 2 * 25'165'824 * 256);
  EXPECT_DOUBLE_EQ(causal_attention_flops(k) / full, 0.75);
  k.window = 8192;
  EXPECT_DOUBLE_EQ(causal_attention_flops(k), full);
  k.kind = core::KernelKind::AttentionBackward;
  k.window = 4096;
  EXPECT_DOUBLE_EQ(causal_attention_flops(k), 2.5 * 32.0 * 2 * 25'165'824 * 256);
}

// "attention_kernel": "fa2" costs attention at the table's rates times the FlashAttention-2 multipliers,
// which the H100 table cites as the ratio of FA2 to FA3 figures at one shape; the H200 takes the H100's.
// (FlashAttention 1.x's multipliers: KernelTablePresets.FlashAttentionFigureSetsFa1AndTheA100HeadDim64.)
TEST(KernelTable, AttentionKernelsScaleTheTablesAttention) {
  std::ifstream in(std::string(PIPER_SOURCE_DIR) + "/sim/data/kernels-h100-sxm.json");
  const json h100 = json::parse(in);
  const std::string quote = h100["attention_kernels"]["fa2"]["source"]["quote"];
  // The four figures of the quote, in its order: FA2 fwd, FA2 bwd, FA3 fwd, FA3 bwd (TFLOPS).
  std::vector<double> tflops;
  for (std::size_t at = quote.find("ms, "); at != std::string::npos; at = quote.find("ms, ", at + 1))
    tflops.push_back(std::stod(quote.substr(at + 4)));
  ASSERT_EQ(tflops.size(), 4u) << quote;
  const auto h = load_kernel_table("h100-sxm");
  ASSERT_EQ(h->attention_kernels.count("fa2"), 1u);
  expect_rel(h->attention_kernels.at("fa2").fwd_scale, tflops[0] / tflops[2], 1e-5);
  expect_rel(h->attention_kernels.at("fa2").bwd_scale, tflops[1] / tflops[3], 1e-5);
  EXPECT_DOUBLE_EQ(load_kernel_table("h200-sxm")->attention_kernels.at("fa2").fwd_scale,
                   h->attention_kernels.at("fa2").fwd_scale);
  EXPECT_DOUBLE_EQ(load_kernel_table("a100-80gb-sxm")->attention_kernels.at("fa2").bwd_scale, 1.0);
  // Timing: the same kernel under cuDNN (the table) and FA2.
  const auto t = load_kernel_table("h200-sxm");
  KernelTiming kt;
  kt.table = t.get();
  kt.peak_flops = 989e12;
  kt.hbm_bytes_per_s = 4.8e12;
  core::Kernel a;
  a.kind = core::KernelKind::AttentionBackward;
  a.batch = 2;
  a.m = 8192;
  a.n = 32;
  a.k = 8;
  a.head_dim = a.v_dim = 128;
  const double causal_bwd = 2.5 * 2.0 * 32 * 8192 * 8192 * 256;
  expect_rel(kt.seconds(a), causal_bwd / t->attention_rate(true, 2, 8192, 32, 128) + t->launch_floor_s);
  kt.attention_kernel = t->attention_kernels.at("fa2");
  expect_rel(kt.seconds(a),
             causal_bwd / (t->attention_rate(true, 2, 8192, 32, 128) * tflops[1] / tflops[3]) + t->launch_floor_s,
             1e-5);

  // The cluster names it; a table without it is refused in one line naming the field and what exists.
  auto cl = [](const std::string& text) { return cluster_from_text(text, "c.json"); };
  EXPECT_EQ(cl(R"({"preset": "dgx-h100", "attention_kernel": "fa2"})").attention_kernel, "fa2");
  EXPECT_NE(error_of([&] { cl(R"({"preset": "dgx-h100", "attention_kernel": 2})"); }).find("field 'attention_kernel'"),
            std::string::npos);
  const Cluster fa2 = cl(R"({"preset": "dgx-h100", "attention_kernel": "fa2"})");
  EXPECT_DOUBLE_EQ(CostModel(fa2).timing(0).attention_kernel.fwd_scale, h->attention_kernels.at("fa2").fwd_scale);
  // Refused when the cluster is read, naming the file; a cluster built in code, by the cost model.
  const std::string e = error_of([&] { cl(R"({"preset": "dgx-h100", "attention_kernel": "fa9"})"); });
  EXPECT_NE(e.find("c.json: field 'attention_kernel': kernel table 'h100-sxm' has no attention kernel 'fa9' (it has: "
                   "fa1, fa2)"),
            std::string::npos)
      << e;
  Cluster fa9 = fa2;
  fa9.attention_kernel = "fa9";
  const std::string e9 = error_of([&] { CostModel{fa9}; });
  EXPECT_NE(e9.find("kernel table 'h100-sxm' has no attention kernel 'fa9'"), std::string::npos) << e9;
  // The twelfth probe: GPUs without a kernel table have no attention rates to scale, and the field was
  // ignored, any name accepted (a step time of 75.693 ms for llama3-8b TP 8 with "fa2" or "zz" alike).
  const std::string none = error_of([&] {
    cl(R"({"preset": "dgx-h100", "node": {"gpu": {"preset": "h100-sxm", "kernel_table": ""}}, "attention_kernel": "fa2"})");
  });
  EXPECT_NE(none.find("c.json: field 'attention_kernel': 'fa2' scales a kernel table's attention rates, and no GPU of "
                      "the cluster has a kernel table"),
            std::string::npos)
      << none;
  // A table file's variants are checked like its entries.
  const std::string dir = ::testing::TempDir() + "/ak-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/ak.json") << R"({"base": "h200-sxm", "attention_kernels": {"mine": {"fwd_scale": 0.5}}})";
  EXPECT_NE(error_of([&] { load_kernel_table(dir + "/ak.json"); }).find("attention_kernels.mine.bwd_scale"),
            std::string::npos);
}

// kernels.py times F.cross_entropy(logits.float(), target) over T x V bf16 logits and writes gbps = T·V·6 / s;
// that op moves 14 bytes a logit (the cast reads 2 and writes 4, log_softmax reads 4 and writes 4), the
// traffic the eager loss is costed at, so the class's rate in bytes moved is T·V·14 / s.
TEST(KernelTable, CrossEntropyRatesAreInBytesMoved) {
  auto t = load_kernel_table("h200-sxm");
  for (const auto& m : raw_table()["memory_bound"]) {
    if (m["kernel"] != "cross_entropy_fwd_fp32") continue;
    const double logits = m["tokens"].get<double>() * m["vocab"].get<double>(), s = m["s"].get<double>();
    expect_rel(t->memory_rate("cross_entropy_fwd_fp32", logits * 14), logits * 14 / s);
  }
  // The eager loss forward over those logits: 12 fp32 bytes a logit in two launches (the cast's fp32 write
  // and log_softmax's read and write; the cast's bf16 read is the head's output, not counted), so a
  // measured 32k-vocabulary run predicts within the launch floor and 2 bytes in 14 of its own time.
  core::Kernel loss;
  loss.kind = core::KernelKind::Loss;
  loss.elems = 8192L * 32000;
  KernelTiming kt{t.get(), RuntimeProfile::Eager, 989.4e12, 4.8e12, 0.75, 0, {}};
  double measured = 0;
  for (const auto& m : raw_table()["memory_bound"])
    if (m["kernel"] == "cross_entropy_fwd_fp32" && m["vocab"] == 32000) measured = m["s"].get<double>();
  ASSERT_GT(measured, 0);
  EXPECT_NEAR(kt.seconds(loss), measured * 12 / 14 + 2 * t->launch_floor_s, measured * 0.02);
}

// piper-cuda: Piper's CUDA backend's own kernels (docs/cost-model.md): RoPE on copies of q and k (4 passes
// in 2 launches), the cross-entropy in the storage type with its gradient written in the forward (4
// passes, 1 launch; no backward kernel), everything else as fused.
TEST(KernelTable, PiperCudaProfileCountsItsKernels) {
  const auto t = load_kernel_table("h200-sxm");
  KernelTiming kt{t.get(), RuntimeProfile::PiperCuda, 989.4e12, 4.8e12, 0.75, 0, {}};
  const double n = 16384.0 * 4096;
  auto timed = [&](core::KernelKind kind) { return elementwise_seconds(kt, kind, n); };
  auto by_hand = [&](double bf16_elems, int launches, const char* kernel) {
    return memory_bound_by_hand(*t, bf16_elems * 2 * n, launches, kernel);
  };
  expect_rel(timed(core::KernelKind::Rope), by_hand(4, 2, "add"));
  expect_rel(timed(core::KernelKind::Loss), by_hand(4, 1, "cross_entropy_fwd_fp32"));
  EXPECT_EQ(timed(core::KernelKind::LossBackward), 0.0);
  const double swiglu = timed(core::KernelKind::Activation), norm = timed(core::KernelKind::Norm);
  kt.profile = RuntimeProfile::Fused;
  EXPECT_DOUBLE_EQ(swiglu, timed(core::KernelKind::Activation));
  EXPECT_DOUBLE_EQ(norm, timed(core::KernelKind::Norm));
  EXPECT_LT(timed(core::KernelKind::Rope), by_hand(4, 2, "add"));  // fused: one read, one write
  EXPECT_EQ(runtime_profile_from_string("piper-cuda"), RuntimeProfile::PiperCuda);
  EXPECT_EQ(to_string(RuntimeProfile::PiperCuda), "piper-cuda");
}

// eager-unfused-norm: the RMSNorm as TorchTitan writes it in torch ops, counted op by op (docs/cost-model.md):
// forward 36 bytes a bf16 element in 8 launches, input gradient 76 in 11, weight gradient 8 in 2, all at
// the table's element-wise ("add") rate for the bytes of one launch; the other kernels as eager.
TEST(KernelTable, UnfusedNormProfileCountsTheTorchOps) {
  const auto t = load_kernel_table("h200-sxm");
  KernelTiming kt{t.get(), RuntimeProfile::EagerUnfusedNorm, 989.4e12, 4.8e12, 0.75, 0, {}};
  const double n = 16384.0 * 4096;
  auto timed = [&](core::KernelKind kind) { return elementwise_seconds(kt, kind, n); };
  auto by_hand = [&](double bytes_per_elem, int launches) {
    return memory_bound_by_hand(*t, bytes_per_elem * n, launches, "add");
  };
  expect_rel(timed(core::KernelKind::Norm), by_hand(36, 8));
  expect_rel(timed(core::KernelKind::NormBackward), by_hand(76, 11));
  expect_rel(timed(core::KernelKind::NormWeight), by_hand(8, 2));
  // Everything else is eager's: SwiGLU's 5 passes in 2 launches.
  const double swiglu = timed(core::KernelKind::Activation);
  kt.profile = RuntimeProfile::Eager;
  EXPECT_DOUBLE_EQ(swiglu, timed(core::KernelKind::Activation));
  EXPECT_LT(timed(core::KernelKind::Norm), by_hand(36, 8) / 5);  // F.rms_norm: one read, one write
  EXPECT_EQ(runtime_profile_from_string("eager-unfused-norm"), RuntimeProfile::EagerUnfusedNorm);
  EXPECT_EQ(to_string(RuntimeProfile::EagerUnfusedNorm), "eager-unfused-norm");
  const std::string e = error_of([&] { cluster_from_text(R"({"preset": "dgx-h200", "runtime": "lazy"})", "c.json"); });
  EXPECT_NE(e.find("\"eager-unfused-norm\""), std::string::npos) << e;
}

namespace {

// Checks kernel_breakdown(device) of a compiled scenario against the kernels listed in the plan: each
// block's "kernels X ms" is the by-hand sum of its first segment's kernels, each block lists one row
// per kernel, and merged blocks ("segments a-b ..., each") cover the segments between. Returns the
// (blocks, (segment, pass) pairs covered).
std::pair<int, int> check_breakdown(const core::Program& p, const CostModel& cost, int device) {
  const KernelTiming kt = cost.timing(device);
  const std::string text = kernel_breakdown(p, cost, device);
  std::istringstream in(text);
  std::string line;
  int blocks = 0, covered = 0;
  while (std::getline(in, line)) {
    const bool merged = line.rfind("segments ", 0) == 0;
    if (!merged && line.rfind("segment ", 0) != 0) continue;
    ++blocks;
    std::size_t pos = merged ? 9 : 8, used = 0;
    const int first = std::stoi(line.substr(pos), &used);
    const int last = merged ? std::stoi(line.substr(pos + used + 1)) : first;
    EXPECT_EQ(merged, line.find(", each: ") != std::string::npos) << line;
    covered += last - first + 1;
    const bool forward = line.find("), F") != std::string::npos;
    const auto& pk = p.segments.at(static_cast<std::size_t>(first)).kernels;
    double by_hand = 0;
    std::size_t expected_rows = 0;
    for (std::size_t l : forward ? std::vector<std::size_t>{0} : std::vector<std::size_t>{1, 2}) {
      expected_rows += pk[l].size();
      for (const auto& k : pk[l]) by_hand += k.count * kt.seconds(k);
    }
    const std::size_t at = line.find("kernels ");
    EXPECT_NE(at, std::string::npos) << line;
    if (at == std::string::npos) continue;
    EXPECT_NEAR(std::stod(line.substr(at + 8)), by_hand * 1e3, 5e-4) << line;
    std::getline(in, line);  // column names
    EXPECT_NE(line.find("achieved"), std::string::npos);
    std::size_t rows = 0;
    while (in.peek() == ' ' && std::getline(in, line)) ++rows;
    EXPECT_EQ(rows, expected_rows) << text;
  }
  return {blocks, covered};
}

}  // namespace

TEST(KernelTable, BreakdownListsEveryKernelAsTheModelTimesIt) {
  const auto compiled = compile_pipeline("llama3-8b", 4, 4);
  const core::Program& p = compiled.result.program;
  const CostModel cost(load_cluster("dgx-h200"));
  // 1F1B without zero-bubble splitting: device 1's one segment runs F and a fused B.
  EXPECT_EQ(check_breakdown(p, cost, 1), std::make_pair(2, 2));
  const std::string text = kernel_breakdown(p, cost, 1);
  EXPECT_NE(text.find("TFLOP/s"), std::string::npos);
  EXPECT_NE(text.find("TB/s"), std::string::npos);
  EXPECT_EQ(error_of([&] { (void)kernel_breakdown(p, cost, 4); }), "--kernels 4: the plan has devices 0 to 3");
  // ZeRO-3 gives every block its own segment: the blocks' identical passes are listed once, as a
  // range, in the forward (segments upwards) and in the backward (downwards) alike.
  core::Scenario z;
  z.model = "llama3-8b";
  z.strategy.dp = 2;
  z.strategy.zero = 3;
  const auto zc = core::compile_scenario(z);
  const auto [blocks, covered] = check_breakdown(zc.result.program, cost, 0);
  EXPECT_LT(blocks, covered);
  const std::string ztext = kernel_breakdown(zc.result.program, cost, 0);
  EXPECT_NE(ztext.find("), F, each: "), std::string::npos) << ztext;
  EXPECT_NE(ztext.find("), B, each: "), std::string::npos) << ztext;
}

TEST(KernelTable, BytesAreWhatTheKernelMoves) {
  KernelTiming kt;
  core::Kernel g;
  g.m = 64;
  g.n = 32;
  g.k = 16;
  g.batch = 3;
  g.dtype = core::Precision::FP32;
  // Read A (m x k) and B (k x n), write C (m x n), per product, 4 bytes an element.
  EXPECT_DOUBLE_EQ(kt.bytes(g), (64.0 * 16 + 16 * 32 + 64 * 32) * 3 * 4);
  core::Kernel n;
  n.kind = core::KernelKind::Norm;
  n.elems = 1000;
  EXPECT_DOUBLE_EQ(kt.bytes(n), 4000);  // bf16: read and write
  core::Kernel act;
  act.kind = core::KernelKind::Activation;
  act.elems = 1000;
  kt.profile = RuntimeProfile::Eager;  // silu, then mul: 5 element passes
  EXPECT_DOUBLE_EQ(kt.bytes(act), 10000);
  core::Kernel attention;
  attention.kind = core::KernelKind::AttentionForward;
  EXPECT_DOUBLE_EQ(kt.bytes(attention), 0);
}

namespace {

// A standard-attention core kernel: b sequences of s tokens, `heads` heads of 64.
core::Kernel standard_core(bool backward, std::int64_t b, std::int64_t heads, std::int64_t s, bool dropout) {
  core::Kernel k;
  k.kind = backward ? core::KernelKind::StandardAttentionBackward : core::KernelKind::StandardAttentionForward;
  k.dtype = core::Precision::FP16;
  k.batch = b;
  k.n = heads;
  k.m = s;
  k.head_dim = k.v_dim = 64;
  k.dropout = dropout;
  const double unit = 2.0 * static_cast<double>(b * heads) * static_cast<double>(s * s) * 128;  // Q·K^T + P·V
  k.flops = backward ? 2 * unit : unit;
  k.bytes = b * heads * s * s * 11;  // any score traffic: used only without a measurement
  return k;
}

}  // namespace

TEST(KernelTable, StandardAttentionIsTimedPerScoreFromItsMeasurement) {
  // Two measurements of one implementation with dropout, 1 sequence x 1 head: s = 1024 (2^20 scores) in
  // 1 ms forward / 3 ms backward, s = 4096 (2^24 scores) in 8 / 32 ms; and one without dropout.
  const json j = json::parse(R"({"attention_standard": [
    {"implementation": "megatron", "dropout": true, "b": 1, "heads": 1, "s": 1024, "head_dim": 64, "dtype": "fp16", "fwd_ms": 1, "bwd_ms": 3},
    {"implementation": "megatron", "dropout": true, "b": 1, "heads": 1, "s": 4096, "head_dim": 64, "dtype": "fp16", "fwd_ms": 8, "bwd_ms": 32},
    {"implementation": "pytorch", "dropout": false, "b": 1, "heads": 1, "s": 1024, "head_dim": 64, "dtype": "fp16", "fwd_ms": 2, "bwd_ms": 4}]})");
  const KernelTable t = KernelTable::from_json(j, "std.json");
  KernelTiming kt;
  kt.table = &t;
  kt.peak_flops = 1e18;  // no GEMM data: the compute floor at the fallback rate, far below these times
  kt.hbm_bytes_per_s = 1e12;
  const double floor = t.launch_floor_s;
  // At s = 2048 (2^22 scores, halfway in log between 2^20 and 2^24) the per-score time is halfway between
  // 1e-3 / 2^20 and 8e-3 / 2^24 (the fused profile runs Megatron's).
  const double s20 = std::ldexp(1.0, 20), s22 = std::ldexp(1.0, 22), s24 = std::ldexp(1.0, 24);
  expect_rel(kt.seconds(standard_core(false, 1, 1, 2048, true)), (1e-3 / s20 + 8e-3 / s24) / 2 * s22 + floor);
  expect_rel(kt.seconds(standard_core(true, 1, 1, 2048, true)), (3e-3 / s20 + 32e-3 / s24) / 2 * s22 + floor);
  // The work's size is its score count, not s: 2 sequences of 4 heads at s = 1024 are 2^23 scores, three
  // quarters of the way in log from 2^20 to 2^24: a quarter of 1e-3 / 2^20 and three of 8e-3 / 2^24.
  const double s23 = std::ldexp(1.0, 23);
  expect_rel(kt.seconds(standard_core(false, 2, 4, 1024, true)), (0.25 * 1e-3 / s20 + 0.75 * 8e-3 / s24) * s23 + floor);
  // Beyond the measured range: the nearest measurement's per-score time (s = 8192: 4 x 2^24 scores).
  expect_rel(kt.seconds(standard_core(false, 1, 1, 8192, true)), 4 * 8e-3 + floor);
  // fp32 moves twice the bytes of the fp16 measurement.
  core::Kernel fp32 = standard_core(false, 1, 1, 1024, true);
  fp32.dtype = core::Precision::FP32;
  expect_rel(kt.seconds(fp32), 2e-3 + floor);
  // Without dropout the fused profile has no Megatron entry: PyTorch's without dropout.
  expect_rel(kt.seconds(standard_core(false, 1, 1, 1024, false)), 2e-3 + floor);
  // Eager runs PyTorch's; with dropout it has none: the other implementation's with dropout.
  kt.profile = RuntimeProfile::Eager;
  expect_rel(kt.seconds(standard_core(false, 1, 1, 1024, true)), 1e-3 + floor);
  // Never faster than the products' FLOPs: at 1 GFLOP/s the forward's 2^20·256 FLOPs take 0.27 s.
  kt.peak_flops = 1e9 / kt.fallback_efficiency;
  expect_rel(kt.seconds(standard_core(false, 1, 1, 1024, true)), s20 * 256 / 1e9 + floor);
}

TEST(KernelTable, StandardAttentionWithoutAMeasurementIsItsProductsAndScoreTraffic) {
  // No table: the batched products at the fallback GEMM rate and the score traffic at the HBM peak.
  KernelTiming kt;
  kt.peak_flops = 100e12;
  kt.hbm_bytes_per_s = 2e12;
  const core::Kernel f = standard_core(false, 2, 4, 512, true);
  const double rate = 100e12 * kt.fallback_efficiency, floor = KernelTable::kDefaultLaunchFloor;
  const double scores = 2.0 * 4 * 512 * 512;
  // Forward: Q·K^T and P·V, each 2·scores·64 FLOPs; each also reads and writes its operands: the s x s
  // matrix once, the two s x 64 ones, in 2-byte elements. The products are compute- or memory-bound.
  const double product_bytes = 8 * (512.0 * 512 + 2 * 512 * 64) * 2;
  const double product = std::max(2 * scores * 64 / rate, product_bytes / 2e12) + floor;
  expect_rel(kt.seconds(f), 2 * product + static_cast<double>(f.bytes) / 2e12 + floor);
  const core::Kernel b = standard_core(true, 2, 4, 512, true);
  expect_rel(kt.seconds(b), 4 * product + static_cast<double>(b.bytes) / 2e12 + floor);
  EXPECT_DOUBLE_EQ(kt.launch_seconds(f), 3 * floor);
  EXPECT_DOUBLE_EQ(kt.bytes(f), static_cast<double>(f.bytes) + 2 * product_bytes);
}

TEST(KernelTable, StandardAttentionIsCitedOnTheA100AndDerivedElsewhereByCopyBandwidth) {
  // The A100-40GB's entries are FlashAttention's appendix (Tables 15/16: Megatron, dropout, s = 1024 in
  // 1.88 / 2.94 ms at batch 16 x 8 heads).
  const auto a100 = load_kernel_table("a100-40gb-sxm");
  const double scores = 16.0 * 8 * 1024 * 1024;
  expect_rel(a100->standard_attention_seconds_per_score(false, true, "megatron", scores), 1.88e-3 / scores);
  expect_rel(a100->standard_attention_seconds_per_score(true, true, "megatron", scores), 2.94e-3 / scores);
  // Every other table: the A100-40GB's times the ratio of the two copy rates at 1 GiB moved.
  const double gib = 1073741824.0;
  for (const char* name : {"a100-80gb-sxm", "h100-sxm", "h200-sxm"}) {
    const auto t = load_kernel_table(name);
    const double ratio = a100->memory_rate("copy", gib) / t->memory_rate("copy", gib);
    EXPECT_LT(ratio, 1.0) << name;
    for (bool bwd : {false, true})
      expect_rel(t->standard_attention_seconds_per_score(bwd, true, "megatron", scores),
                 a100->standard_attention_seconds_per_score(bwd, true, "megatron", scores) * ratio);
  }
  // The A100-80GB: its cited stream 'scale' (1737 GB/s) against the 40 GB's (1382).
  expect_rel(load_kernel_table("a100-80gb-sxm")->standard_attention_seconds_per_score(false, true, "megatron", scores),
             1.88e-3 / scores * 1382 / 1737);
}

TEST(KernelTable, StandardAttentionEntriesAreChecked) {
  auto err = [](const std::string& entry) {
    return error_of(
        [&] { KernelTable::from_json(json::parse(R"({"attention_standard": [)" + entry + "]}"), "t.json"); });
  };
  const std::string ok = R"("b": 1, "heads": 1, "s": 64, "head_dim": 64, "fwd_ms": 1, "bwd_ms": 2)";
  EXPECT_NE(err(R"({"dropout": true, "dtype": "fp16", )" + ok + "}").find("attention_standard[0].implementation"),
            std::string::npos);
  // A misspelt implementation would match no runtime profile: refused, not silently another's.
  EXPECT_NE(err(R"({"implementation": "megatorn", "dropout": true, "dtype": "fp16", )" + ok + "}")
                .find("attention_standard[0].implementation': expected \"megatron\" or \"pytorch\""),
            std::string::npos);
  EXPECT_NE(err(R"({"implementation": "megatron", "dropout": 1, "dtype": "fp16", )" + ok + "}")
                .find("attention_standard[0].dropout"),
            std::string::npos);
  EXPECT_NE(err(R"({"implementation": "megatron", "dropout": true, "dtype": "fp32", )" + ok + "}")
                .find("attention_standard[0].dtype"),
            std::string::npos);
  EXPECT_NE(
      err(R"({"implementation": "megatron", "dropout": true, "dtype": "fp16", "b": 1, "heads": 1, "s": 64, "head_dim": 64, "fwd_ms": 0, "bwd_ms": 2})")
          .find("attention_standard[0].fwd_ms"),
      std::string::npos);
}
