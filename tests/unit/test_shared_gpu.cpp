// Devices sharing one GPU (NodeSpec::devices_per_gpu, docs/simulator.md "Devices sharing a GPU"),
// derived by hand: processor sharing of compute in both engines, device copies between them, HBM and
// MFU split among them, and the spec's checks.
#include <cmath>
#include <map>

#include <gtest/gtest.h>

#include "piper/core/scenario.hpp"
#include "piper/sim/engine.hpp"
#include "piper/sim/report.hpp"
#include "unit_costs.hpp"

using namespace piper;
using namespace piper::sim;
using nlohmann::json;
using piper::test::unit_costs;

namespace {

std::shared_ptr<const core::Program> compile(int pp, int dp, int microbatches, const std::string& schedule = "gpipe") {
  core::Scenario s;
  s.model = "qwen3-9m";
  s.strategy.schedule = schedule;
  s.strategy.pp = pp;
  s.strategy.dp = dp;
  s.strategy.microbatches = microbatches;
  return std::make_shared<const core::Program>(core::compile_scenario(s).result.program);
}

Cluster h200(int devices_per_gpu) {
  return cluster_from_json(json{{"preset", "dgx-h200"}, {"nodes", 1}, {"node", {{"devices_per_gpu", devices_per_gpu}}}},
                           "c.json");
}

double step(const std::string& engine, std::shared_ptr<const core::Program> program, const Cluster& c) {
  CostModel cost(c);
  cost.set_override(unit_costs(*program));
  return make_engine(engine)->run(program, c, cost).step_time_s;
}

std::vector<std::string> engines() {
  std::vector<std::string> out{"analytic"};
  for (const auto& e : engine_names())
    if (e == "simgrid") out.push_back(e);
  return out;
}

}  // namespace

// DP 2, one microbatch: each device computes F + B = 3 s at once. On two GPUs the step is 3 s; on one
// shared GPU both run at half speed for the whole step: 6 s.
TEST(SharedGpu, TwoReplicasOnOneGpuTakeTwiceAsLong) {
  auto p = compile(1, 2, 1);
  for (const auto& e : engines()) {
    EXPECT_NEAR(step(e, p, h200(1)), 3.0, 1e-9) << e;
    EXPECT_NEAR(step(e, p, h200(2)), 6.0, 1e-9) << e;
  }
}

// GPipe PP 2 with 2 microbatches (F = 1, B = 2 per stage): on two GPUs (m + p - 1)(F + B) = 9 s. On one
// GPU the work, 2 stages x 2 microbatches x 3 s = 12 s, is done at the GPU's one speed whenever some
// device computes, and one always does (stage 0's forwards, then both, stage 1's backwards, ...): 12 s.
TEST(SharedGpu, PipelineOnOneGpuTakesItsTotalWork) {
  auto p = compile(2, 1, 2);
  for (const auto& e : engines()) {
    EXPECT_NEAR(step(e, p, h200(1)), 9.0, 1e-9) << e;
    EXPECT_NEAR(step(e, p, h200(8)), 12.0, 1e-9) << e;
  }
}

// Transfers between devices of one GPU are device copies: alpha = NVLink latency, B = HBM / 2 (read and
// write); a collective inside one GPU takes the flat ring form with them.
TEST(SharedGpu, CopiesInsideOneGpuRunAtHalfTheHbmBandwidth) {
  const Cluster c = h200(2);
  CostModel cost(c);
  const NodeSpec& n = c.nodes[0];
  const double bw = n.gpu.hbm_bandwidth_bytes_per_s / 2;
  const std::int64_t bytes = 1 << 30;
  EXPECT_TRUE(cost.same_gpu(0, 1));
  EXPECT_FALSE(cost.same_gpu(1, 2));
  EXPECT_NEAR(cost.p2p_seconds(0, 1, bytes), n.nvlink_latency_s + bytes / bw, 1e-15);
  EXPECT_NEAR(cost.p2p_seconds(1, 2, bytes), n.nvlink_latency_s + bytes / n.nvlink_effective_bandwidth_bytes_per_s(),
              1e-15);
  // Ring all-gather of 2 ranks: (n - 1) alpha + (n - 1)/n S / B.
  EXPECT_NEAR(cost.collective_seconds(core::OpKind::AllGather, {0, 1}, bytes), n.nvlink_latency_s + 0.5 * bytes / bw,
              1e-15);
}

// The report splits each GPU's HBM and peak among the program's devices on it.
TEST(SharedGpu, HbmAndPeakAreSplitAmongTheDevicesOnAGpu) {
  const Cluster c = h200(8);
  EXPECT_EQ(c.devices_on_gpu(0, 2), 2);
  EXPECT_EQ(c.devices_on_gpu(1, 8), 8);
  EXPECT_EQ(c.device_hbm_bytes(0, 4), c.nodes[0].gpu.hbm_bytes / 4);
  EXPECT_EQ(h200(1).device_hbm_bytes(0, 4), c.nodes[0].gpu.hbm_bytes);
  const std::vector<int> gpus = h200(4).gpu_of_devices();
  EXPECT_EQ(gpus, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));

  auto p = compile(1, 2, 1);
  CostModel cost(c);
  cost.set_override(unit_costs(*p));
  const core::Timeline t = make_analytic_engine()->run(p, c, cost);
  const Report shared = make_report(t, c), alone = make_report(t, h200(1));
  EXPECT_EQ(shared.per_device[0].hbm_bytes, c.nodes[0].gpu.hbm_bytes / 2);
  // Same timeline: MFU against one GPU's peak is twice that against two.
  EXPECT_NEAR(shared.mfu, 2 * alone.mfu, 1e-12);
}

TEST(SharedGpu, SpecErrorsNameTheField) {
  try {
    cluster_from_json(json{{"preset", "dgx-h200"}, {"node", {{"devices_per_gpu", 3}}}}, "c.json");
    FAIL() << "3 devices per GPU on an 8-device node was accepted";
  } catch (const ClusterError& e) {
    EXPECT_NE(std::string(e.what()).find("node.devices_per_gpu"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cluster_from_json(json{{"preset", "dgx-h200"}, {"node", {{"devices_per_gpu", 0}}}}, "c.json"),
               ClusterError);
  EXPECT_THROW(cluster_from_json(json{{"preset", "dgx-h200"}, {"node", {{"device_per_gpu", 2}}}}, "c.json"),
               ClusterError);
}
