// Cluster presets and spec errors, the kernel tables' rate floors, and the cost model's closed forms
// recomputed here from the cluster's alpha and beta (relative tolerance 1e-12: the same arithmetic in
// another order).
#include <cmath>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/kernel_table.hpp"
#include "expect.hpp"

using namespace piper;
using namespace piper::sim;
using nlohmann::json;

using piper::test::error_of;

namespace {

void expect_rel(double actual, double expected, double tol = 1e-12) {
  EXPECT_NEAR(actual, expected, tol * std::abs(expected)) << "expected " << expected;
}

std::vector<int> one_per_node(int n, int gpus_per_node) {
  std::vector<int> ranks;
  for (int i = 0; i < n; ++i) ranks.push_back(i * gpus_per_node);
  return ranks;
}

}  // namespace

TEST(SimCluster, PresetsCarryTheDatasheetFigures) {
  // Figures from the vendor datasheets cited in cluster.cpp.
  Cluster h200 = load_cluster("dgx-h200");
  EXPECT_EQ(h200.num_devices(), 8);
  EXPECT_EQ(h200.gpu(0).peak_flops, 989e12);
  EXPECT_EQ(h200.gpu(7).hbm_bytes, 141'000'000'000);
  EXPECT_EQ(h200.gpu(0).hbm_bandwidth_bytes_per_s, 4.8e12);
  EXPECT_EQ(h200.nodes[0].nvlink_bandwidth_bytes_per_s, 450e9);                      // 900 GB/s bidirectional
  EXPECT_EQ(h200.nodes[0].nic_bandwidth_per_gpu_bytes_per_s(), 50e9);                // 8 x 400 Gb/s over 8 GPUs
  EXPECT_EQ(load_cluster("hgx-h800").nodes[0].nvlink_bandwidth_bytes_per_s, 200e9);  // 400 GB/s bidirectional
  EXPECT_EQ(load_cluster("dgx-a100-80g").gpu(0).peak_flops, 312e12);
  // NCCL's effective NVLink bandwidth as its maintainer gives it: ~230 GB/s of A100's 300 GB/s line
  // rate (nccl-tests issue 149), 370 GB/s of NVLink 4's 450 GB/s (nccl-tests issue 212).
  EXPECT_DOUBLE_EQ(load_cluster("dgx-a100-80g").nodes[0].nvlink_effective_bandwidth_bytes_per_s(), 230e9);
  EXPECT_DOUBLE_EQ(h200.nodes[0].nvlink_effective_bandwidth_bytes_per_s(), 370e9);
  EXPECT_DOUBLE_EQ(load_cluster("dgx-h100").nodes[0].nvlink_effective_bandwidth_bytes_per_s(), 370e9);
  EXPECT_DOUBLE_EQ(load_cluster("hgx-h800").nodes[0].nvlink_effective_bandwidth_bytes_per_s(), 200e9 * 370 / 450);
  EXPECT_EQ(load_cluster("dgx-h100").gpu(0).sm_count, 132);
  EXPECT_EQ(cluster_presets().size(), 4u);
}

TEST(SimCluster, GrowsToFitAProgramUnlessFixed) {
  Cluster c = with_devices(load_cluster("dgx-h100"), 20);
  EXPECT_EQ(c.nodes.size(), 3u);  // ceil(20 / 8)
  EXPECT_EQ(c.node_of(19), 2);
  EXPECT_EQ(c.local_index(19), 3);
  Cluster fixed = cluster_from_json(json{{"preset", "dgx-h100"}, {"nodes", 2}}, "two.json");
  EXPECT_TRUE(fixed.fixed_size);
  std::string e = error_of([&] { with_devices(fixed, 20); });
  EXPECT_NE(e.find("has 16 devices"), std::string::npos) << e;
  EXPECT_NE(e.find("needs 20"), std::string::npos) << e;
}

TEST(SimCluster, HeterogeneousOverridesAndOneLineErrors) {
  json j = {{"preset", "dgx-h100"},
            {"nodes", 3},
            {"overrides", {{{"nodes", {2}}, {"gpus_per_node", 4}, {"gpu", "a100-sxm-80g"}}}}};
  Cluster c = cluster_from_json(j, "mixed.json");
  EXPECT_EQ(c.num_devices(), 20);
  EXPECT_EQ(c.gpu(16).peak_flops, 312e12);
  EXPECT_EQ(c.gpu(15).peak_flops, 989e12);
  EXPECT_FALSE(c.homogeneous());

  auto one_line_naming = [](const std::string& e, const std::string& file, const std::string& field) {
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    EXPECT_NE(e.find(file), std::string::npos) << e;
    EXPECT_NE(e.find(field), std::string::npos) << e;
  };
  one_line_naming(error_of([] { cluster_from_json(json{{"preset", "dgx-h9"}}, "a.json"); }), "a.json", "preset");
  one_line_naming(error_of([] {
                    cluster_from_json(json{{"preset", "dgx-h100"}, {"node", {{"nics", -1}}}}, "b.json");
                  }),
                  "b.json", "node.nics");
  one_line_naming(error_of([] {
                    cluster_from_json(json{{"preset", "dgx-h100"}, {"node", {{"gpu", {{"hbm_gb", 3}}}}}}, "c.json");
                  }),
                  "c.json", "node.gpu.hbm_gb");
  one_line_naming(error_of([] {
                    cluster_from_json(json{{"node", {{"gpus_per_node", 2}}}}, "d.json");
                  }),
                  "d.json", "peak_tflops");
  one_line_naming(
      error_of([] {
        cluster_from_json(json{{"preset", "dgx-h100"}, {"nodes", 2}, {"overrides", {{{"nodes", {5}}}}}}, "e.json");
      }),
      "e.json", "overrides[0].nodes");
  one_line_naming(error_of([] { load_cluster("no-such-cluster"); }), "no-such-cluster", "preset");
  const auto path = std::filesystem::temp_directory_path() / "piper_sim_bad_cluster.json";
  std::ofstream(path) << "{\"preset\": \"dgx-h100\",\n \"nodes\": }";
  one_line_naming(error_of([&] { load_cluster(path.string()); }), path.string(), "JSON");
  std::filesystem::remove(path);
}

// Tiny positive rates and sizes were taken as given: peak_tflops 1e-300 predicted a step of 300 digits
// and 0 tokens/s, exit 0. Each rate, bandwidth and size has a physical floor, named with its unit; the
// floor itself is accepted.
TEST(SimCluster, TinyRatesAndSizesAreRefusedNamingTheFloor) {
  const json base = {{"preset", "dgx-h100"}};
  auto with = [&](const std::string& section, const std::string& key, double v) {
    json j = base;
    if (section == "gpu")
      j["node"]["gpu"][key] = v;
    else if (section == "node")
      j["node"][key] = v;
    else
      j["network"] = json{{"topology", "fat-tree"}, {key, v}};
    return j;
  };
  struct Case {
    std::string section, key, field, floor;
    double at_floor;
  };
  const std::vector<Case> cases = {
      {"gpu", "peak_tflops", "node.gpu.peak_tflops", "must be >= 0.001 (1 GFLOP/s)", 0.001},
      {"gpu", "hbm_bandwidth_gb_per_s", "node.gpu.hbm_bandwidth_gb_per_s", "must be >= 0.001 (1 MB/s)", 0.001},
      {"gpu", "hbm_gib", "node.gpu.hbm_gib", "must be >= 0.0009765625 (1 MiB)", 1.0 / 1024},
      {"gpu", "max_efficiency", "node.gpu.max_efficiency", "must be >= 0.001 (0.1 % of peak)", 0.001},
      {"node", "nvlink_bandwidth_gb_per_s", "node.nvlink_bandwidth_gb_per_s", "must be >= 0.001 (1 MB/s)", 0.001},
      {"node", "nvlink_efficiency", "node.nvlink_efficiency", "must be >= 0.001 (0.1 % of the line rate)", 0.001},
      {"node", "nic_bandwidth_gbit_per_s", "node.nic_bandwidth_gbit_per_s", "must be >= 0.001 (1 Mbit/s)", 0.001},
  };
  for (const Case& c : cases) {
    const std::string e = error_of([&] { cluster_from_json(with(c.section, c.key, 1e-300), "tiny.json"); });
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    EXPECT_NE(e.find("tiny.json: field '" + c.field + "': " + c.floor + ", got 1e-300"), std::string::npos) << e;
    EXPECT_NO_THROW(cluster_from_json(with(c.section, c.key, c.at_floor), "tiny.json")) << c.field;
  }
  // A fractional SM count was truncated (1.5 -> 1 SM).
  EXPECT_NE(error_of([&] {
              cluster_from_json(with("gpu", "sm_count", 1.5), "sm.json");
            }).find("sm.json: field 'node.gpu.sm_count': expected a whole number, got 1.5"),
            std::string::npos);
  // A leaf link thinned a billion times is a NIC of 400 bits/s.
  EXPECT_NE(error_of([&] {
              cluster_from_json(with("network", "oversubscription", 1e9), "o.json");
            }).find("o.json: field 'network.oversubscription': must be <= 1000, got 1e+09"),
            std::string::npos);
  EXPECT_NO_THROW(cluster_from_json(with("network", "oversubscription", 1000), "o.json"));
}

// A table rate of 1e-300 TFLOP/s (or GB/s), or a measured time of 1e-300 ms, was taken: a step of
// 300 digits, or attention that cost nothing. Rates and times have a physical floor, named with its unit.
TEST(KernelTable, TinyRatesAndTimesAreRefusedNamingTheFloor) {
  auto err = [](const std::string& text) {
    return error_of([&] { KernelTable::from_json(json::parse(text), "t.json"); });
  };
  const std::string gemm = R"({"gemm": [{"dtype": "bf16", "m": 512, "n": 512, "k": 512, "tflops": %}]})";
  auto at = [](std::string text, const std::string& v) { return text.replace(text.find('%'), 1, v); };
  EXPECT_NE(err(at(gemm, "1e-300")).find("t.json: field 'gemm[0].tflops': must be >= 0.001 (1 GFLOP/s), got 1e-300"),
            std::string::npos)
      << err(at(gemm, "1e-300"));
  EXPECT_EQ(err(at(gemm, "0.001")), "");
  const std::string attn =
      R"({"attention": [{"b": 1, "s": 64, "heads": 1, "head_dim": 64, "fwd_tflops": %, "bwd_tflops": 1}]})";
  EXPECT_NE(err(at(attn, "1e-300")).find("field 'attention[0].fwd_tflops': must be >= 0.001 (1 GFLOP/s)"),
            std::string::npos);
  const std::string mem = R"({"memory_bound": [{"kernel": "add", "gbps": %, "bytes": 1e6}]})";
  EXPECT_NE(err(at(mem, "1e-300")).find("field 'memory_bound[0].gbps': must be >= 0.001 (1 MB/s), got 1e-300"),
            std::string::npos)
      << err(at(mem, "1e-300"));
  EXPECT_EQ(err(at(mem, "0.001")), "");
  const std::string std_attn =
      R"({"attention_standard": [{"implementation": "megatron", "dropout": true, "dtype": "fp16", "b": 1,)"
      R"( "heads": 1, "s": 64, "head_dim": 64, "fwd_ms": %, "bwd_ms": 2}]})";
  EXPECT_NE(err(at(std_attn, "1e-300")).find("field 'attention_standard[0].fwd_ms': must be >= 1e-06 (1 ns)"),
            std::string::npos)
      << err(at(std_attn, "1e-300"));
  const std::string adamw = R"({"adamw": [{"params": 1e8, "s": %}]})";
  EXPECT_NE(err(at(adamw, "1e-300")).find("field 'adamw[0].s': must be >= 1e-09 (1 ns)"), std::string::npos)
      << err(at(adamw, "1e-300"));
  EXPECT_EQ(err(at(adamw, "0.01")), "");
  // An attention implementation's rate multiplier, bounded as a table's scales are.
  EXPECT_NE(err(R"({"attention_kernels": {"fa3": {"fwd_scale": 1e-300, "bwd_scale": 1}}})")
                .find("field 'attention_kernels.fa3.fwd_scale': must be in [0.001, 1000]"),
            std::string::npos)
      << err(R"({"attention_kernels": {"fa3": {"fwd_scale": 1e-300, "bwd_scale": 1}}})");
}

// Overrides that select no node, a node twice, or by two selectors at once, and a node that two
// overrides both set, were accepted (the last write won, "first" and "count" were ignored beside
// "nodes"); a comm_sm_share_max below comm_sm_share was silently raised to it.
TEST(SimCluster, AmbiguousOverridesAreRefusedInOneLine) {
  auto err = [](const json& overrides) {
    return error_of([&] {
      cluster_from_json(json{{"preset", "dgx-h100"}, {"nodes", 4}, {"overrides", overrides}}, "o.json");
    });
  };
  auto expect_has = [](const std::string& e, const std::string& want) {
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    EXPECT_NE(e.find(want), std::string::npos) << e;
  };
  expect_has(err(json::array({{{"nodes", {3, 3}}, {"gpu", "a100-sxm-80g"}}})),
             "o.json: field 'overrides[0].nodes': node 3 is listed twice");
  expect_has(err(json::array({{{"nodes", json::array()}, {"gpu", "a100-sxm-80g"}}})),
             "o.json: field 'overrides[0].nodes': selects no node");
  expect_has(err(json::array({{{"nodes", {1}}, {"first", 0}, {"count", 1}, {"gpu", "a100-sxm-80g"}}})),
             "o.json: field 'overrides[0].first': give either \"nodes\" or \"first\" and \"count\", not both");
  expect_has(err(json::array({{{"nodes", {1}}, {"count", 1}}})),
             "o.json: field 'overrides[0].count': give either \"nodes\" or \"first\" and \"count\", not both");
  expect_has(err(json::array({{{"nodes", {3}}, {"gpu", "a100-sxm-80g"}}, {{"first", 2}, {"count", 2}}})),
             "o.json: field 'overrides[1].first': node 3 is already overridden by overrides[0]");
  expect_has(err(json::array({{{"nodes", {3}}, {"gpu", "a100-sxm-80g"}}, {{"nodes", {3}}, {"gpu", "h100-sxm"}}})),
             "o.json: field 'overrides[1].nodes': node 3 is already overridden by overrides[0]");
  // Distinct nodes in two overrides are fine.
  EXPECT_NO_THROW(cluster_from_json(
      json{{"preset", "dgx-h100"},
           {"nodes", 4},
           {"overrides", {{{"nodes", {3}}, {"gpu", "a100-sxm-80g"}}, {{"first", 0}, {"count", 2}, {"nics", 4}}}}},
      "o.json"));
  // comm_sm_share_max is at least comm_sm_share (docs/contention.md).
  const std::string e = error_of([] {
    cluster_from_json(
        json{{"preset", "dgx-h100"}, {"node", {{"gpu", {{"comm_sm_share", 0.5}, {"comm_sm_share_max", 0.1}}}}}},
        "s.json");
  });
  expect_has(e, "s.json: field 'node.gpu.comm_sm_share_max': must be >= comm_sm_share (0.5), got 0.1");
  EXPECT_NO_THROW(cluster_from_json(
      json{{"preset", "dgx-h100"}, {"node", {{"gpu", {{"comm_sm_share", 0.3}, {"comm_sm_share_max", 0.3}}}}}},
      "s.json"));
}

TEST(SimCost, RingAllReduceMatchesClosedForm) {
  const std::int64_t bytes = 1 << 30;
  const double S = static_cast<double>(bytes);
  // Inside one node: NVLink alpha and beta.
  {
    Cluster c = load_cluster("dgx-h200");
    CostModel cost(c);
    const double a = c.nodes[0].nvlink_latency_s, b = 370e9;  // NCCL's effective NVLink 4 bandwidth
    const double n = 8;
    expect_rel(cost.collective_seconds(core::OpKind::AllReduce, {0, 1, 2, 3, 4, 5, 6, 7}, bytes),
               2 * (n - 1) * a + 2 * (n - 1) / n * S / b);
  }
  // One rank per node (a data-parallel group over 64 and 1,024 pipelines): network alpha, NIC beta per GPU.
  for (int n : {64, 1024}) {
    Cluster c = with_devices(load_cluster("dgx-h200"), n * 8);
    CostModel cost(c);
    const double a = c.network.latency_s;
    const double b = c.nodes[0].nics * c.nodes[0].nic_bandwidth_bytes_per_s / c.nodes[0].gpus_per_node;
    const double nn = n;
    expect_rel(cost.collective_seconds(core::OpKind::AllReduce, one_per_node(n, 8), bytes),
               2 * (nn - 1) * a + 2 * (nn - 1) / nn * S / b);
    expect_rel(cost.collective_seconds(core::OpKind::ReduceScatter, one_per_node(n, 8), bytes),
               (nn - 1) * a + (nn - 1) / nn * S / b);
    expect_rel(cost.collective_seconds(core::OpKind::AllGather, one_per_node(n, 8), bytes),
               (nn - 1) * a + (nn - 1) / nn * S / b);
    expect_rel(cost.collective_seconds(core::OpKind::AllToAll, one_per_node(n, 8), bytes),
               (nn - 1) * (a + S / (nn * b)));
  }
}

TEST(SimCost, HierarchicalWhenAGroupSpansNodes) {
  Cluster c = with_devices(load_cluster("dgx-h100"), 16);
  CostModel cost(c);
  const double S = 256e6;
  const double ai = c.nodes[0].nvlink_latency_s, bi = 370e9;  // NCCL's effective NVLink 4 bandwidth
  const double ae = c.network.latency_s, be = 50e9;           // 8 x 400 Gb/s over 8 GPUs
  std::vector<int> all(16);
  for (int i = 0; i < 16; ++i) all[static_cast<std::size_t>(i)] = i;
  const double m = 8, k = 2;
  const double rs_intra = (m - 1) * ai + (m - 1) / m * S / bi;
  const double ar_inter = 2 * (k - 1) * ae + 2 * (k - 1) / k * (S / m) / be;
  expect_rel(cost.collective_seconds(core::OpKind::AllReduce, all, static_cast<std::int64_t>(S)),
             rs_intra + ar_inter + rs_intra);
  expect_rel(cost.collective_seconds(core::OpKind::AllToAll, all, static_cast<std::int64_t>(S)),
             (m - 1) * (ai + S / (16 * bi)) + (16 - m) * (ae + S / (16 * be)));
}

TEST(SimCost, PointToPointAndRoofline) {
  Cluster c = with_devices(load_cluster("dgx-h200"), 16);
  CostModel cost(c);
  expect_rel(cost.p2p_seconds(0, 1, 1'000'000), 3e-6 + 1e6 / 370e9);  // NVLink at NCCL's effective rate
  expect_rel(cost.p2p_seconds(0, 8, 1'000'000), 5e-6 + 1e6 / 50e9);   // one 400 Gb/s NIC per GPU
  const GpuSpec& g = c.gpu(0);
  const double f = 4e12;
  expect_rel(cost.roofline_seconds(0, f, 0), f / (989e12 * 0.75 * f / (f + 2e9)) + 5e-6);
  // Memory-bound: 48 GB of traffic at 4.8 TB/s.
  expect_rel(cost.roofline_seconds(0, 1e9, 48'000'000'000), 48e9 / 4.8e12 + g.launch_overhead_s);
}

TEST(SimCost, EfficiencyCurveAppliesPerGemmKernel) {
  Cluster c = load_cluster("dgx-a100-80g");
  CostModel cost(c);
  // Three GEMMs of 1, 3 and 8 GFLOP run one after another, each at the curve's efficiency for its
  // own size: f / (312 TFLOP/s * 0.75 * f / (f + 2 GFLOP)).
  double separate = 0;
  for (double f : {1e9, 3e9, 8e9}) separate += f / (312e12 * 0.75 * f / (f + 2e9));
  // As one op of 12 GFLOP in 3 kernels: (12 + 3 * 2) GFLOP / (312 TFLOP/s * 0.75) = 76.9 us.
  expect_rel(separate, 18e9 / (312e12 * 0.75));
  expect_rel(cost.roofline_seconds(0, 12e9, 0, 3), separate + 5e-6);
  // One kernel (and 0 = unknown) is the old per-op curve.
  expect_rel(cost.roofline_seconds(0, 12e9, 0, 1), 12e9 / (312e12 * 0.75 * 12e9 / 14e9) + 5e-6);
  expect_rel(cost.roofline_seconds(0, 12e9, 0, 0), cost.roofline_seconds(0, 12e9, 0, 1));
  // A COMPUTE op carries its kernel count from the compiler.
  core::Program program;
  core::Op op;
  op.flops = 12e9;
  op.gemm_kernels = 3;
  expect_rel(cost.compute_seconds(program, 0, op), separate + 5e-6);
}

TEST(SimCost, CalibrationAndOverrideReplaceTheModel) {
  Cluster c = load_cluster("dgx-h200");
  Calibration cal =
      Calibration::from_json(json{{"format", "piper-calibration"},
                                  {"entries",
                                   {{{"kind", "COMPUTE"}, {"pass", "F"}, {"seconds", 0.5}},
                                    {{"kind", "COMPUTE"}, {"pass", "F"}, {"flops", 1e12}, {"seconds", 0.25}},
                                    {{"kind", "ALL_REDUCE"}, {"group_size", 8}, {"seconds", 0.125}}}}},
                             "cal.json");
  // Round trip through JSON keeps every field.
  cal = Calibration::from_json(cal.to_json(), "cal.json");
  CostModel cost(c, cal);
  core::Program program;
  core::Op f;
  f.pass = core::Pass::F;
  f.flops = 1e12;
  EXPECT_EQ(cost.compute_seconds(program, 0, f), 0.25);  // the more specific entry wins
  f.flops = 2e12;
  EXPECT_EQ(cost.compute_seconds(program, 0, f), 0.5);
  core::Op ar;
  ar.kind = core::OpKind::AllReduce;
  ar.bytes = 1 << 20;
  EXPECT_EQ(cost.collective_op_seconds(ar, {0, 1, 2, 3, 4, 5, 6, 7}), 0.125);
  EXPECT_NE(cost.collective_op_seconds(ar, {0, 1}), 0.125);
  cost.set_override([](const core::Op& op) -> std::optional<double> {
    if (op.kind == core::OpKind::AllReduce) return 7.0;
    return std::nullopt;
  });
  EXPECT_EQ(cost.collective_op_seconds(ar, {0, 1}), 7.0);
  EXPECT_EQ(cost.compute_seconds(program, 0, f), 0.5);
  std::string e;
  try {
    Calibration::from_json(json{{"format", "piper-calibration"}, {"entries", {{{"kind", "NOPE"}, {"seconds", 1}}}}},
                           "x.json");
  } catch (const core::Error& err) {
    e = err.what();
  }
  EXPECT_NE(e.find("x.json: field 'entries[0].kind'"), std::string::npos) << e;
}

TEST(SimCluster, ExampleSpecsLoad) {
  int loaded = 0;
  for (const auto& entry : std::filesystem::directory_iterator(std::string(PIPER_SOURCE_DIR) + "/examples/clusters")) {
    if (entry.path().extension() != ".json") continue;
    SCOPED_TRACE(entry.path().string());
    Cluster c = load_cluster(entry.path().string());
    EXPECT_GT(c.num_devices(), 0);
    ++loaded;
  }
  EXPECT_GE(loaded, 3);
}

// A misspelt cluster field names the nearest valid one.
TEST(ClusterSpec, MisspeltFieldSuggestsTheNearest) {
  try {
    cluster_from_text(R"({"preset": "dgx-h100", "netwrok": {}})", "c.json");
    FAIL() << "expected an error";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown field (did you mean 'network'?)"), std::string::npos) << e.what();
  }
}
