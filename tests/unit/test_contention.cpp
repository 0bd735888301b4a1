// Contention of concurrent communication, derived by hand on tiny hand-made programs: flows sharing
// a link in the analytic engine (and SimGrid agreeing), compute slowed by the SMs the running comm
// kernels hold, and comm kernels sharing an sm_partition's SMs (docs/contention.md).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "piper/sim/engine.hpp"

using namespace piper;
using namespace piper::sim;
using nlohmann::json;

namespace {

constexpr std::int64_t kBytes = 4'000'000'000;  // 4 GB: the bandwidth part dominates the latency

core::Op comm_op(core::OpKind kind, std::int32_t node, int set, int peer) {
  core::Op op;
  op.kind = kind;
  op.node = node;
  op.pair = node;  // a SEND and its RECV share the pairing id (core/readiness.hpp)
  op.bytes = kBytes;
  op.device_set = set;
  op.peer_set = peer;
  op.label = kind == core::OpKind::Send ? "SEND" : "RECV";
  return op;
}

// Device 0 sends to each device of `peers` on a stream of its own (all start at t = 0); with
// `compute`, device 0 also runs one F on its compute stream.
core::Program fan_out(int devices, const std::vector<int>& peers, bool compute = false) {
  core::Program p;
  p.model_name = "hand-made";
  p.num_devices = devices;
  for (int d = 0; d < devices; ++d) p.device_sets.push_back({d});
  p.plans.resize(static_cast<std::size_t>(devices));
  for (int d = 0; d < devices; ++d) p.plan_of_device.push_back(d);
  core::Plan& sender = p.plans[0];
  if (compute) {
    core::Op f;
    f.kind = core::OpKind::Compute;
    f.pass = core::Pass::F;
    f.label = "F";
    sender.streams.push_back({"compute", {f}});
  }
  for (std::size_t i = 0; i < peers.size(); ++i) {
    const int peer = peers[i];
    const auto node = static_cast<std::int32_t>(10 + i);
    sender.streams.push_back({"s" + std::to_string(i), {comm_op(core::OpKind::Send, node, 0, peer)}});
    p.plans[static_cast<std::size_t>(peer)].streams.push_back({"r", {comm_op(core::OpKind::Recv, node, peer, 0)}});
  }
  for (auto& plan : p.plans)
    if (plan.streams.empty()) plan.streams.push_back({"idle", {}});
  return p;
}

bool have_simgrid() {
  const std::vector<std::string> names = engine_names();
  return std::find(names.begin(), names.end(), "simgrid") != names.end();
}

// The SEND spans of device 0 (its streams after the compute one, if any).
std::vector<core::OpSpan> sends(const core::Timeline& t, bool compute) {
  std::vector<core::OpSpan> out;
  for (const auto& s : t.devices[0].spans)
    if (!compute || s.stream > 0) out.push_back(s);
  return out;
}

core::Timeline run(const std::string& engine, const core::Program& p, const Cluster& base,
                   const OpOverride& costs = {}) {
  auto program = std::make_shared<const core::Program>(p);
  Cluster cluster = with_devices(base, program->num_devices);
  CostModel cost(cluster);
  if (costs) cost.set_override(costs);
  return make_engine(engine)->run(program, cluster, cost);
}

}  // namespace

// Two transfers from device 0 over NVLink (to 1 and to 2): both leave on device 0's NVLink out,
// each at half the bandwidth, so each ends at alpha + 2 S / B instead of alpha + S / B. The one to
// device 8 (another node) leaves on the NIC: a link of its own, so it keeps its time alpha_e + S / B_e.
TEST(Contention, TwoFlowsOnOneLinkTakeTwiceAsLongInTheAnalyticEngine) {
  const Cluster h100 = cluster_from_json(json{{"preset", "dgx-h100"}, {"nodes", 2}}, "c.json");
  const CostModel cost(with_devices(h100, 16));
  const double alpha = cost.latency_s(0, 1), bw = cost.bandwidth_bytes_per_s(0, 1);
  const double alpha_e = cost.latency_s(0, 8), bw_e = cost.bandwidth_bytes_per_s(0, 8);
  const double S = static_cast<double>(kBytes);

  const core::Timeline alone = run("analytic", fan_out(16, {1}), h100);
  EXPECT_NEAR(alone.devices[0].spans[0].end_s, alpha + S / bw, 1e-9);
  const core::Timeline two = run("analytic", fan_out(16, {1, 2, 8}), h100);
  const auto s = sends(two, false);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_NEAR(s[0].end_s, alpha + 2 * S / bw, 1e-9);
  EXPECT_NEAR(s[1].end_s, alpha + 2 * S / bw, 1e-9);
  EXPECT_NEAR(s[2].end_s, alpha_e + S / bw_e, 1e-9);
  // SimGrid's max-min sharing gives the same times; within 1e-6 relative (its payloads are
  // rounded to 2^-20 bytes and its clock to a microsecond-scale precision).
  if (!have_simgrid()) GTEST_SKIP() << "built without SimGrid";
  const auto g = sends(run("simgrid", fan_out(16, {1, 2, 8}), h100), false);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(g[i].end_s, s[i].end_s, 1e-6 * s[i].end_s) << i;
}

// When the first of two flows on a link ends, the other speeds up to the full bandwidth: with
// 2 S to device 1 and S to device 2, both at B/2 until the second ends at alpha + 2 S / B, having
// moved S; the first then moves its last S alone and ends at alpha + 3 S / B.
TEST(Contention, AFlowSpeedsUpWhenTheOtherLeavesTheLink) {
  const Cluster h100 = load_cluster("dgx-h100");
  const CostModel cost(with_devices(h100, 3));
  const double alpha = cost.latency_s(0, 1), bw = cost.bandwidth_bytes_per_s(0, 1), S = static_cast<double>(kBytes);
  core::Program p = fan_out(3, {1, 2});
  p.plans[0].streams[0].ops[0].bytes = 2 * kBytes;
  p.plans[1].streams[0].ops[0].bytes = 2 * kBytes;
  const auto s = sends(run("analytic", p, h100), false);
  EXPECT_NEAR(s[1].end_s, alpha + 2 * S / bw, 1e-9);
  EXPECT_NEAR(s[0].end_s, alpha + 3 * S / bw, 1e-9);
  if (!have_simgrid()) GTEST_SKIP() << "built without SimGrid";
  const auto g = sends(run("simgrid", p, h100), false);
  for (std::size_t i = 0; i < 2; ++i) EXPECT_NEAR(g[i].end_s, s[i].end_s, 1e-6 * s[i].end_s) << i;
}

// Compute slowed by the SMs the running comm kernels hold: F = 10 s of work on device 0 while two
// 4 s transfers (fixed times) run there. comm_sm_share 0.25 each, at most 0.5 together: F runs at
// 1 - 0.5 for 4 s (2 s of work), then alone: 4 + 8 = 12 s. With comm_sm_share_max 0.3 it runs at
// 0.7 (2.8 s of work): 4 + 7.2 = 11.2 s. One transfer alone: 10 + 4 * 0.25 = 11 s.
TEST(Contention, ComputeSlowsByTheSmsEveryRunningCommKernelHolds) {
  auto costs = [](const core::Op& op) -> std::optional<double> {
    return op.kind == core::OpKind::Compute ? 10.0 : 4.0;
  };
  struct Case {
    double share_max;
    std::vector<int> peers;
    double f_end;
  };
  for (const Case& c : {Case{0.5, {1, 2}, 12.0}, Case{0.3, {1, 2}, 11.2}, Case{0.5, {1}, 11.0}}) {
    const Cluster cl =
        cluster_from_json(json{{"preset", "dgx-h100"},
                               {"node", {{"gpu", {{"comm_sm_share", 0.25}, {"comm_sm_share_max", c.share_max}}}}}},
                          "c.json");
    std::vector<std::string> engines = {"analytic"};
    if (have_simgrid()) engines.push_back("simgrid");
    for (const std::string& e : engines) {
      const core::Timeline t = run(e, fan_out(3, c.peers, true), cl, costs);
      EXPECT_NEAR(t.devices[0].spans[0].end_s, c.f_end, 1e-6) << e << " max " << c.share_max;
      for (const auto& s : sends(t, true)) EXPECT_NEAR(s.end_s, 4.0, 1e-6) << e;  // comm keeps its time
    }
  }
}

// Under sm_partition the comm kernels share its s SMs. One kernel reaches full NVLink bandwidth with
// comm_sm_share * N = 0.25 * 132 = 33 SMs; s = 16 carries 16/33 of it. One NVLink transfer alone:
// alpha + S / (B * 16/33). Two from device 0 share the 16 SMs (and its NVLink out): each at 8/33,
// alpha + S / (B * 8/33). Both engines (SimGrid: an sm link of 16/33 B on the sender's routes).
TEST(Contention, CommKernelsShareThePartitionSms) {
  const Cluster cl =
      cluster_from_json(json{{"preset", "dgx-h100"}, {"node", {{"gpu", {{"comm_sm_share", 0.25}}}}}}, "c.json");
  const CostModel cost(with_devices(cl, 3));
  const double alpha = cost.latency_s(0, 1), bw = cost.bandwidth_bytes_per_s(0, 1), S = static_cast<double>(kBytes);
  std::vector<std::string> engines = {"analytic"};
  if (have_simgrid()) engines.push_back("simgrid");
  for (const std::string& e : engines) {
    core::Program one = fan_out(3, {1});
    one.sm_partition = core::SmPartition{"comm", 16};
    const double t1 = run(e, one, cl).devices[0].spans[0].end_s;
    EXPECT_NEAR(t1, alpha + S / (bw * 16 / 33), 1e-6 * t1) << e;
    core::Program two = fan_out(3, {1, 2});
    two.sm_partition = core::SmPartition{"comm", 16};
    for (const auto& s : sends(run(e, two, cl), false)) EXPECT_NEAR(s.end_s, alpha + S / (bw * 8 / 33), 1e-6 * t1) << e;
    // 66 SMs carry two kernels at full speed: only the shared NVLink out halves them.
    two.sm_partition = core::SmPartition{"comm", 66};
    for (const auto& s : sends(run(e, two, cl), false)) EXPECT_NEAR(s.end_s, alpha + 2 * S / bw, 1e-6 * t1) << e;
  }
}

// A bad comm_sm_share_max is refused in one line naming the field.
TEST(Contention, CommSmShareMaxIsValidated) {
  try {
    cluster_from_json(json{{"preset", "dgx-h100"}, {"node", {{"gpu", {{"comm_sm_share_max", 1.5}}}}}}, "c.json");
    FAIL() << "accepted comm_sm_share_max 1.5";
  } catch (const ClusterError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("comm_sm_share_max"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  const Cluster c = load_cluster("dgx-h100");
  EXPECT_DOUBLE_EQ(c.nodes[0].gpu.comm_sm_share_max, 0.5);
  EXPECT_EQ(c.nodes[0].gpu.to_json().at("comm_sm_share_max"), 0.5);
  const Cluster set =
      cluster_from_json(json{{"preset", "dgx-h100"}, {"node", {{"gpu", {{"comm_sm_share_max", 0.3}}}}}}, "c.json");
  EXPECT_DOUBLE_EQ(set.nodes[0].gpu.comm_sm_share_max, 0.3);
}

// The rule itself (cost_model.hpp), by hand: 132 SMs, comm_sm_share 0.25, comm_sm_share_max 0.5.
// Shared SMs: compute 1, 0.75, 0.5, then 0.5 (capped) with 0..3 comm kernels; no comm cap. A
// partition of 16 SMs: compute 116/132 whatever runs; comm kernels carry 16 / 33 of one at full speed.
TEST(Contention, ComputeRatesByHand) {
  sim::GpuSpec gpu = load_cluster("dgx-h100").nodes[0].gpu;
  gpu.comm_sm_share = 0.25;
  gpu.comm_sm_share_max = 0.5;
  const ComputeRates shared = compute_rates(std::nullopt, gpu);
  EXPECT_DOUBLE_EQ(shared.compute(0), 1.0);
  EXPECT_DOUBLE_EQ(shared.compute(1), 0.75);
  EXPECT_DOUBLE_EQ(shared.compute(2), 0.5);
  EXPECT_DOUBLE_EQ(shared.compute(3), 0.5);
  EXPECT_TRUE(std::isinf(shared.comm_capacity));
  const ComputeRates part = compute_rates(core::SmPartition{"comm", 16}, gpu);
  for (int k : {0, 1, 3}) EXPECT_DOUBLE_EQ(part.compute(k), 116.0 / 132) << k;
  EXPECT_DOUBLE_EQ(part.comm_capacity, 16.0 / 33);
  gpu.comm_sm_share = 0;  // no SM model: a partition caps nothing
  EXPECT_TRUE(std::isinf(compute_rates(core::SmPartition{"comm", 16}, gpu).comm_capacity));
}
