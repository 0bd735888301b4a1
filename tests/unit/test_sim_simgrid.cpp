// Tests of the SimGrid engine: a single transfer costs exactly alpha + S / B; ring all-reduce,
// reduce-scatter, all-gather and all-to-all decomposed into flows take their closed forms (derived
// here from the cluster figures, not from the cost model); the SimGrid and analytic engines agree on
// contention-free compiled programs; and two all-reduces sharing a thin fat-tree leaf uplink take
// twice the bandwidth time on SimGrid and not on the analytic engine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "piper/core/scenario.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/engine.hpp"
#include "piper/sim/ready_tracker.hpp"
#include "piper/sim/simgrid_engine.hpp"

#ifndef PIPER_HAVE_SIMGRID
TEST(SimgridEngine, NotBuilt) { GTEST_SKIP() << "piper was built without SimGrid"; }
#else

using namespace piper;
using core::OpKind;

namespace {

constexpr double kGB = 1e9;

// `nodes` nodes of `gpus` GPUs: NVLink 450 GB/s and 2 us; `nics` NICs of 50 GB/s (400 Gbit/s); 5 us
// network latency. Compute figures matter only for compiled programs.
sim::Cluster make_cluster(int nodes, int gpus, int nics = 8, const std::string& topology = "rail-optimized",
                          double oversubscription = 1) {
  sim::NodeSpec n;
  n.gpus_per_node = gpus;
  n.gpu.name = "test-gpu";
  n.gpu.peak_flops = 989e12;
  n.gpu.sm_count = 132;
  n.gpu.hbm_bytes = std::int64_t{141} << 30;
  n.gpu.hbm_bandwidth_bytes_per_s = 4.8e12;
  n.gpu.launch_overhead_s = 5e-6;
  n.gpu.comm_sm_share = 0.1;
  n.gpu.max_efficiency = 0.7;
  n.nvlink_bandwidth_bytes_per_s = 450 * kGB;
  n.nvlink_latency_s = 2e-6;
  n.nics = nics;
  n.nic_bandwidth_bytes_per_s = 50 * kGB;
  sim::Cluster c;
  c.name = "test";
  c.nodes.assign(static_cast<std::size_t>(nodes), n);
  c.network.latency_s = 5e-6;
  c.network.topology = topology;
  c.network.oversubscription = oversubscription;
  return c;
}

// A program whose devices each run one collective of `kind` (S bytes) in the groups of `family`.
std::shared_ptr<core::Program> collective_program(OpKind kind, int devices, std::int64_t bytes,
                                                  std::vector<std::vector<int> > groups) {
  auto p = std::make_shared<core::Program>();
  p->model_name = "hand-made";
  p->num_devices = devices;
  std::vector<int> all;
  for (const auto& g : groups) all.insert(all.end(), g.begin(), g.end());
  p->device_sets = {all};
  p->families = {core::CommFamily{0, static_cast<int>(groups.front().size()), 1, core::FamilyPurpose::Dp}};
  core::Op op;
  op.kind = kind;
  op.node = 0;
  op.pair = 0;
  op.label = core::to_string(kind);
  op.bytes = bytes;
  op.device_set = 0;
  op.family = 0;
  core::Plan plan;
  plan.streams = {{"comm", {op}}};
  p->plans = {plan};
  p->plan_of_device.assign(static_cast<std::size_t>(devices), 0);
  return p;
}

std::vector<int> iota(int n) {
  std::vector<int> v(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = i;
  return v;
}

// Device 0 sends `bytes` to device `dst` (a SEND/RECV pair with the same node id).
std::shared_ptr<core::Program> transfer_program(int devices, int dst, std::int64_t bytes) {
  auto p = std::make_shared<core::Program>();
  p->model_name = "hand-made";
  p->num_devices = devices;
  p->device_sets = {{0}, {dst}};
  core::Op send;
  send.kind = OpKind::Send;
  send.node = 7;
  send.pair = 0;
  send.label = "SEND";
  send.bytes = bytes;
  send.device_set = 0;
  send.peer_set = 1;
  core::Op recv = send;
  recv.kind = OpKind::Recv;
  recv.label = "RECV";
  recv.device_set = 1;
  recv.peer_set = 0;
  core::Plan sender, receiver, idle;
  sender.streams = {{"pp", {send}}};
  receiver.streams = {{"pp", {recv}}};
  idle.streams = {{"pp", {}}};
  p->plans = {sender, receiver, idle};
  p->plan_of_device.assign(static_cast<std::size_t>(devices), 2);
  p->plan_of_device[0] = 0;
  p->plan_of_device[static_cast<std::size_t>(dst)] = 1;
  return p;
}

core::Timeline run_engine(sim::Engine& engine, std::shared_ptr<const core::Program> p, const sim::Cluster& c) {
  sim::CostModel cost(c);
  return engine.run(p, c, cost);
}

// Every test runs three times: flows started from SimGrid's callbacks, by worker actors, and from
// the pool actors' stock (SimgridOptions::FlowStarter); all must give the same results.
sim::SimgridOptions::FlowStarter starter = sim::SimgridOptions::FlowStarter::Maestro;

std::unique_ptr<sim::Engine> simgrid_engine(int max_ring_steps = 0) {
  sim::SimgridOptions options;
  options.max_ring_steps = max_ring_steps;
  options.flow_starter = starter;
  return sim::make_simgrid_engine(options);
}

class SimgridEngine : public ::testing::TestWithParam<sim::SimgridOptions::FlowStarter> {
 protected:
  void SetUp() override { starter = GetParam(); }
};

double simgrid_step(std::shared_ptr<const core::Program> p, const sim::Cluster& c, int max_ring_steps = 0) {
  auto engine = simgrid_engine(max_ring_steps);
  return run_engine(*engine, p, c).step_time_s;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-300); }

}  // namespace

// alpha + S / B, exactly, over NVLink and over the network, from 1 byte to 30 GB.
TEST_P(SimgridEngine, SingleTransferIsAlphaPlusSizeOverBandwidth) {
  const sim::Cluster c = make_cluster(2, 4);
  for (double s : {1.0, 1e3, 1e6, 1e9, 3e10}) {
    const auto bytes = static_cast<std::int64_t>(s);
    const double intra = simgrid_step(transfer_program(8, 1, bytes), c);
    EXPECT_LE(rel(intra, 2e-6 + s / (450 * kGB)), 1e-9) << "NVLink, " << s << " bytes";
    // Inter-node: NIC bandwidth per GPU = 8 NICs * 50 GB/s / 4 GPUs = 100 GB/s.
    const double inter = simgrid_step(transfer_program(8, 5, bytes), c);
    EXPECT_LE(rel(inter, 5e-6 + s / (100 * kGB)), 1e-9) << "network, " << s << " bytes";
  }
}

// Zero bytes (a hand-edited plan's transfer or collective) cost their latencies alone, as on the
// analytic engine: SimGrid refuses an empty communication, and the run aborted with signal 6.
TEST_P(SimgridEngine, ZeroByteTransfersAndCollectivesAreLatencyOnly) {
  const sim::Cluster c = make_cluster(2, 4);
  EXPECT_LE(rel(simgrid_step(transfer_program(8, 1, 0), c), 2e-6), 1e-9) << "NVLink";
  EXPECT_LE(rel(simgrid_step(transfer_program(8, 5, 0), c), 5e-6), 1e-9) << "network";
  const double ring = simgrid_step(collective_program(OpKind::AllReduce, 8, 0, {iota(8)}), make_cluster(1, 8));
  EXPECT_LE(rel(ring, 2 * 7 * 2e-6), 1e-9) << "ring all-reduce: 2(n-1) alpha";
}

// Ring all-reduce of S bytes on n ranks: 2(n-1) alpha + 2(n-1)/n S / B (within 0.1 %, the issue's
// bar; the measured error is ~1e-12). 8 and 64 ranks share one NVLink node (alpha = 2 us, B = 450 GB/s);
// 256 ranks are 256 single-GPU nodes with one 50 GB/s NIC each (alpha = 5 us, B = 50 GB/s).
TEST_P(SimgridEngine, RingAllReduceMatchesClosedForm) {
  const double S = 1e9;
  for (int n : {8, 64}) {
    const sim::Cluster c = make_cluster(1, n);
    const double want = 2 * (n - 1) * 2e-6 + 2.0 * (n - 1) / n * S / (450 * kGB);
    const double got =
        simgrid_step(collective_program(OpKind::AllReduce, n, static_cast<std::int64_t>(S), {iota(n)}), c);
    EXPECT_LE(rel(got, want), 1e-3) << n << " ranks: " << got << " s vs " << want << " s";
    EXPECT_LE(rel(got, want), 1e-9) << n << " ranks";
  }
  {
    const int n = 256;
    const sim::Cluster c = make_cluster(n, 1, 1);  // one 50 GB/s NIC per single-GPU node
    const double want = 2 * (n - 1) * 5e-6 + 2.0 * (n - 1) / n * S / (50 * kGB);
    const double got =
        simgrid_step(collective_program(OpKind::AllReduce, n, static_cast<std::int64_t>(S), {iota(n)}), c);
    EXPECT_LE(rel(got, want), 1e-3) << n << " ranks: " << got << " s vs " << want << " s";
  }
}

// 1,024 ranks on one NVLink fabric with rounds merged into 64 steps per ring (SimgridOptions::
// max_ring_steps): the merged step adds (c-1) route latencies, so the closed form is unchanged.
// Exact (max_ring_steps 0) the ring is alone on its links, so it runs merged as one timer
// (SimgridOptions::merge_lone_collectives; as 2.1 M flows it took ~40 s of SimGrid): within 1e-9.
TEST_P(SimgridEngine, RingAllReduceOn1024RanksWithMergedRounds) {
  const int n = 1024;
  const double S = 4e9;
  const sim::Cluster c = make_cluster(1, n);
  const double want = 2 * (n - 1) * 2e-6 + 2.0 * (n - 1) / n * S / (450 * kGB);
  const double got =
      simgrid_step(collective_program(OpKind::AllReduce, n, static_cast<std::int64_t>(S), {iota(n)}), c, 64);
  EXPECT_LE(rel(got, want), 1e-3) << got << " s vs " << want << " s";
  const double exact =
      simgrid_step(collective_program(OpKind::AllReduce, n, static_cast<std::int64_t>(S), {iota(n)}), c, 0);
  EXPECT_LE(rel(exact, want), 1e-9) << exact << " s vs " << want << " s";
}

// Reduce-scatter and all-gather: (n-1) alpha + (n-1)/n S / B; all-to-all (pairwise exchange):
// (n-1)(alpha + S / (n B)). Flat on one node (NVLink) and on one GPU per node (network).
TEST_P(SimgridEngine, ReduceScatterAllGatherAllToAllMatchClosedForms) {
  const double S = 256e6;
  struct Case {
    sim::Cluster cluster;
    int n;
    double alpha, bandwidth;
  };
  const std::vector<Case> cases = {{make_cluster(1, 8), 8, 2e-6, 450 * kGB},
                                   {make_cluster(16, 1, 1), 16, 5e-6, 50 * kGB}};
  for (const auto& k : cases) {
    const double n = k.n;
    const double ring = (n - 1) * k.alpha + (n - 1) / n * S / k.bandwidth;
    const double a2a = (n - 1) * (k.alpha + S / (n * k.bandwidth));
    const auto bytes = static_cast<std::int64_t>(S);
    EXPECT_LE(rel(simgrid_step(collective_program(OpKind::ReduceScatter, k.n, bytes, {iota(k.n)}), k.cluster), ring),
              1e-9);
    EXPECT_LE(rel(simgrid_step(collective_program(OpKind::AllGather, k.n, bytes, {iota(k.n)}), k.cluster), ring), 1e-9);
    EXPECT_LE(rel(simgrid_step(collective_program(OpKind::AllToAll, k.n, bytes, {iota(k.n)}), k.cluster), a2a), 1e-9);
  }
}

// A group of 4 nodes x 4 GPUs is hierarchical: intra-node ring (m = 4, NVLink), inter-node rings
// over the k = 4 nodes (S/m bytes, 5 us, 8 NICs * 50 GB/s / 4 GPUs = 100 GB/s per GPU), intra ring.
TEST_P(SimgridEngine, HierarchicalCollectivesMatchClosedForms) {
  const sim::Cluster c = make_cluster(4, 4);
  const double S = 512e6, m = 4, k = 4, n = 16;
  const double ai = 2e-6, bi = 450 * kGB, ae = 5e-6, be = 100 * kGB;
  auto ring = [](double r, double a, double b, double s) { return (r - 1) * a + (r - 1) / r * s / b; };
  const double rs = ring(m, ai, bi, S) + ring(k, ae, be, S / m);
  const double ag = ring(k, ae, be, S / m) + ring(m, ai, bi, S);
  const double ar = ring(m, ai, bi, S) + 2 * ring(k, ae, be, S / m) + ring(m, ai, bi, S);
  const double a2a = (m - 1) * (ai + S / (n * bi)) + (n - m) * (ae + S / (n * be));
  const auto bytes = static_cast<std::int64_t>(S);
  EXPECT_LE(rel(simgrid_step(collective_program(OpKind::AllReduce, 16, bytes, {iota(16)}), c), ar), 1e-9);
  EXPECT_LE(rel(simgrid_step(collective_program(OpKind::ReduceScatter, 16, bytes, {iota(16)}), c), rs), 1e-9);
  EXPECT_LE(rel(simgrid_step(collective_program(OpKind::AllGather, 16, bytes, {iota(16)}), c), ag), 1e-9);
  EXPECT_LE(rel(simgrid_step(collective_program(OpKind::AllToAll, 16, bytes, {iota(16)}), c), a2a), 1e-9);
}

// Node-limited routing (Op::route_*, CostModel::routed_all_to_all): 4 nodes x 4 GPUs, 8 groups, a
// token reaching 2 of them, top_k 8: same-node exchange of S/16 per peer, one exchange per rail of
// S * 2 / (8 * 4) = S/16 per other node, then forwarding 3S/16 to each same-node peer, one phase
// after the other. Both engines take that closed form.
TEST_P(SimgridEngine, RoutedAllToAllMatchesItsClosedForm) {
  const sim::Cluster c = make_cluster(4, 4);
  const double S = 512e6, ai = 2e-6, bi = 450 * kGB, ae = 5e-6, be = 100 * kGB;
  const double want = 3 * (ai + S / 16 / bi) + 3 * (ae + S / 16 / be) + 3 * (ai + 3 * S / 16 / bi);
  auto p = collective_program(OpKind::AllToAll, 16, static_cast<std::int64_t>(S), {iota(16)});
  core::Op& op = p->plans[0].streams[0].ops[0];
  op.route_groups = 8;
  op.route_group_limit = 2;
  op.route_top_k = 8;
  EXPECT_LE(rel(simgrid_step(p, c), want), 1e-9) << simgrid_step(p, c) << " s vs " << want << " s";
  EXPECT_LE(rel(run_engine(*sim::make_engine("analytic"), p, c).step_time_s, want), 1e-9);
}

// SM stealing (engine.hpp): compute runs at 1 - comm_sm_share = 0.9 of its speed while a
// communication runs on its device. Device 0 computes for w = 4.8 GB / 4.8 TB/s + 5 us launch =
// 1.005 ms while its stream "pp" sends S bytes over NVLink (T = 2 us + S / 450 GB/s), both from 0:
//   w > 0.9 T:  the op ends at T + (w - 0.9 T) = w + 0.1 T;      w < 0.9 T:  it ends at w / 0.9.
// The SimGrid engine moves the compute op's end timer when the transfer starts and ends.
TEST_P(SimgridEngine, ComputeSlowsWhileItsDeviceCommunicates) {
  const sim::Cluster c = make_cluster(1, 2);
  const double w = 4.8e9 / 4.8e12 + 5e-6;
  for (double S : {225e6, 900e6}) {
    auto p = transfer_program(2, 1, static_cast<std::int64_t>(S));
    core::Op compute;
    compute.kind = OpKind::Compute;
    compute.node = 1;
    compute.label = "F";
    compute.memory_bytes = static_cast<std::int64_t>(4.8e9);
    compute.device_set = 0;
    p->plans[0].streams.insert(p->plans[0].streams.begin(), core::Stream{"compute", {compute}});
    const double T = 2e-6 + S / (450 * kGB);
    const double want = w > 0.9 * T ? w + 0.1 * T : w / 0.9;
    auto engine = simgrid_engine();
    const core::Timeline t = run_engine(*engine, p, c);
    ASSERT_EQ(t.devices[0].spans.size(), 2u);
    EXPECT_LE(rel(t.devices[0].spans[0].end_s, want), 1e-9)
        << S << " bytes: " << t.devices[0].spans[0].end_s << " s vs " << want << " s";
    EXPECT_LE(rel(t.devices[0].spans[1].end_s, T), 1e-9) << S << " bytes";
  }
}

// Two DP groups {0, 2} and {1, 3} on 2 nodes x 2 GPUs (2 NICs of 50 GB/s: 50 GB/s per GPU) of a
// fat-tree with oversubscription 2: the leaf uplink of a node carries 2 * 50 / 2 = 50 GB/s. Both
// all-reduces (n = 2: two rounds of S/2) cross it at once, so each flow gets 25 GB/s:
//   simgrid  = 2 alpha + 2 S / B      analytic = 2 alpha + S / B      (B = 50 GB/s)
// i.e. the bandwidth term doubles (x1.9999 for S = 1 GB); on a full-bisection fat-tree both agree.
TEST_P(SimgridEngine, SharedLeafUplinkSlowsAllReducesOnSimgridOnly) {
  const double S = 1e9, alpha = 5e-6, B = 50 * kGB;
  auto program = collective_program(OpKind::AllReduce, 4, static_cast<std::int64_t>(S), {{0, 2}, {1, 3}});
  program->families[0].stride = 1;
  const sim::Cluster thin = make_cluster(2, 2, 2, "fat-tree", 2);
  const sim::Cluster full = make_cluster(2, 2, 2, "fat-tree", 1);
  auto analytic = sim::make_analytic_engine();
  const double a = run_engine(*analytic, program, thin).step_time_s;
  const double s_thin = simgrid_step(program, thin);
  const double s_full = simgrid_step(program, full);
  EXPECT_LE(rel(a, 2 * alpha + S / B), 1e-9);
  EXPECT_LE(rel(s_thin, 2 * alpha + 2 * S / B), 1e-9);
  EXPECT_LE(rel(s_full, 2 * alpha + S / B), 1e-9);
  EXPECT_NEAR(s_thin / a, (2 * alpha + 2 * S / B) / (2 * alpha + S / B), 1e-9);
}

namespace {

// The engine-agreement cases below were chosen for where their flows meet (contention-free, or
// contended on given links) under FLOP-costed ops and one ZeRO reduction per step: the plans keep
// those (kernel lists dropped, reduce_every "step"), so that the cases stay what their comments say
// whatever the per-kernel cost model predicts (test_kernel_table covers that).
core::CompiledScenario compile(int pp, int dp, int zero, const std::string& schedule, int microbatches) {
  core::Scenario s;
  s.model = "qwen3-9m";
  s.strategy.pp = pp;
  s.strategy.dp = dp;
  s.strategy.zero = zero;
  s.strategy.schedule = schedule;
  s.strategy.microbatches = microbatches;
  if (zero >= 2) s.strategy.reduce_every = "step";
  core::CompiledScenario c = core::compile_scenario(s);
  for (auto& seg : c.result.program.segments) seg.kernels = {};
  return c;
}

// Largest relative difference of any op start or end between two timelines of one program.
double max_span_difference(const core::Timeline& a, const core::Timeline& b) {
  double worst = 0;
  for (std::size_t d = 0; d < a.devices.size(); ++d)
    for (std::size_t k = 0; k < a.devices[d].spans.size(); ++k) {
      const auto& x = a.devices[d].spans[k];
      const auto& y = b.devices[d].spans[k];
      worst = std::max({worst, rel(x.start_s, y.start_s) * (y.start_s != 0 || x.start_s != 0),
                        rel(x.end_s, y.end_s) * (y.end_s != 0 || x.end_s != 0)});
    }
  return worst;
}

}  // namespace

// Contention-free compiled programs (no two flows on one link at a time: pipeline transfers of a
// device share its one "pp" stream; ZeRO-3 gathers and reduce-scatters share the "dp" stream; rings
// of one node use distinct NVLink ports) with communication slowing compute (comm_sm_share 0.1):
// both engines give every op the same start and end within 1e-6 relative.
TEST_P(SimgridEngine, AgreesWithAnalyticOnContentionFreePrograms) {
  struct Case {
    int pp, dp, zero;
    std::string schedule;
    int microbatches;
  };
  const std::vector<Case> cases = {{2, 1, 0, "1f1b", 4}, {4, 1, 0, "1f1b", 8}, {4, 1, 0, "gpipe", 4},
                                   {1, 4, 3, "1f1b", 2}, {1, 8, 0, "1f1b", 2}, {2, 2, 0, "1f1b", 4},
                                   {2, 4, 0, "zb-h1", 4}};
  for (const auto& k : cases) {
    auto compiled = compile(k.pp, k.dp, k.zero, k.schedule, k.microbatches);
    auto program = std::make_shared<const core::Program>(std::move(compiled.result.program));
    const sim::Cluster c = make_cluster(1, 8);
    auto analytic = sim::make_analytic_engine();
    auto simgrid = simgrid_engine();
    const core::Timeline a = run_engine(*analytic, program, c);
    const core::Timeline s = run_engine(*simgrid, program, c);
    const std::string what =
        k.schedule + " PP" + std::to_string(k.pp) + " DP" + std::to_string(k.dp) + " ZeRO-" + std::to_string(k.zero);
    EXPECT_GT(a.step_time_s, 0) << what;
    EXPECT_LE(rel(s.step_time_s, a.step_time_s), 1e-6) << what << ": " << s.step_time_s << " vs " << a.step_time_s;
    EXPECT_LE(max_span_difference(s, a), 1e-6) << what;
  }
}

// Not contention-free: in 1F1B PP4 x DP2 with ZeRO-1 on one node, the last backward of stages 1-3
// sends its input gradient to the previous stage while the stage's gradient reduce-scatter starts:
// both leave the GPU through its one NVLink port, and both engines share the port's bandwidth
// (docs/contention.md). Everything that ends before the first such overlap (found in the analytic
// timeline) agrees within 1e-9. The steps then agree within 5e-4 relative: the analytic engine's
// bottleneck fair share holds the ring's links for its whole bandwidth part, SimGrid's rounds hold
// them flow by flow (measured: 1e-4). An analytic engine that did not share the port was 0.2 % fast.
TEST_P(SimgridEngine, SendSharingAnNvlinkPortWithReduceScatterIsSharedByBothEngines) {
  auto compiled = compile(4, 2, 1, "1f1b", 8);
  auto program = std::make_shared<const core::Program>(std::move(compiled.result.program));
  const sim::Cluster c = make_cluster(1, 8);
  auto analytic = sim::make_analytic_engine();
  const core::Timeline a = run_engine(*analytic, program, c);
  const core::Timeline s = run_engine(*simgrid_engine(), program, c);
  // The contended pair: a SEND and a collective leaving one GPU through its NVLink port (transfers in
  // opposite directions, or to different peers, use different links and stay uncontended).
  auto is_send = [](const core::Op& op) { return op.kind == OpKind::Send; };
  auto is_coll = [](const core::Op& op) {
    return op.kind == OpKind::AllReduce || op.kind == OpKind::ReduceScatter || op.kind == OpKind::AllGather ||
           op.kind == OpKind::AllToAll;
  };
  auto is_pair = [&](const core::Op& x, const core::Op& y) {
    return (is_send(x) && is_coll(y)) || (is_coll(x) && is_send(y));
  };
  double first_overlap = INFINITY;
  for (int d = 0; d < program->num_devices; ++d) {
    const auto& spans = a.devices[static_cast<std::size_t>(d)].spans;
    for (std::size_t i = 0; i < spans.size(); ++i)
      for (std::size_t j = i + 1; j < spans.size(); ++j)
        if (is_pair(a.op(d, spans[i]), a.op(d, spans[j])) && spans[i].start_s < spans[j].end_s &&
            spans[j].start_s < spans[i].end_s)
          first_overlap = std::min(first_overlap, std::max(spans[i].start_s, spans[j].start_s));
  }
  ASSERT_TRUE(std::isfinite(first_overlap)) << "expected a SEND overlapping a REDUCE_SCATTER on one device";
  int compared = 0;
  for (std::size_t d = 0; d < a.devices.size(); ++d)
    for (std::size_t k = 0; k < a.devices[d].spans.size(); ++k) {
      const auto& x = a.devices[d].spans[k];
      if (x.end_s > first_overlap) continue;
      ++compared;
      EXPECT_NEAR(s.devices[d].spans[k].end_s, x.end_s, 1e-9 * x.end_s);
    }
  EXPECT_GT(compared, 100);
  EXPECT_LE(rel(s.step_time_s, a.step_time_s), 5e-4) << s.step_time_s << " vs " << a.step_time_s;
}

// A SEND whose RECV never comes: the engine stops with the tracker's one-line deadlock report
// (thrown in the SimGrid process, rethrown here as sim::DeadlockError).
TEST_P(SimgridEngine, UnmatchedSendIsReportedAsDeadlock) {
  auto program = transfer_program(2, 1, 1000);
  program->plans[1].streams[0].ops.clear();
  EXPECT_THROW(simgrid_step(program, make_cluster(1, 2)), sim::DeadlockError);
}

// The three ways of starting flows (SimgridOptions::FlowStarter) put the same CM02 actions on the
// same links at the same instants, so they must give the same timelines, op by op, not only the
// same step time. Programs with link contention (where the max-min sharing decides the times) and
// without: a compiled 1F1B PP4 x DP2 ZeRO-1 on one node (a SEND shares an NVLink port with a
// reduce-scatter, which the analytic engine shares too), the same on 4 nodes x 2 GPUs of a fat-tree
// with oversubscription 2 (DP rings share the thin leaf uplinks), ZB-H1 PP2 x DP4 with ZeRO-3, and
// the two-group all-reduce on a shared leaf uplink: in the fat-tree cases, sharing the uplinks (which
// the analytic engine does not have) makes the step longer than the analytic engine's.
// Differences could only come from the order in which SimGrid's solver sums the shares of
// concurrent flows: 1e-12 relative bounds that (measured: 0).
TEST(SimgridFlowStarters, GiveTheSameTimelineOpByOp) {
  struct Case {
    std::string what;
    std::shared_ptr<const core::Program> program;
    sim::Cluster cluster;
  };
  std::vector<Case> cases;
  auto compiled_program = [](int pp, int dp, int zero, const std::string& schedule, int microbatches) {
    auto compiled = compile(pp, dp, zero, schedule, microbatches);
    return std::make_shared<const core::Program>(std::move(compiled.result.program));
  };
  cases.push_back({"1F1B PP4 DP2 ZeRO-1, one node", compiled_program(4, 2, 1, "1f1b", 8), make_cluster(1, 8)});
  cases.push_back({"1F1B PP4 DP2 ZeRO-1, thin fat-tree", compiled_program(4, 2, 1, "1f1b", 8),
                   make_cluster(4, 2, 2, "fat-tree", 2)});
  cases.push_back({"ZB-H1 PP2 DP4 ZeRO-3, thin fat-tree", compiled_program(2, 4, 3, "zb-h1", 4),
                   make_cluster(4, 2, 2, "fat-tree", 2)});
  {
    auto p = collective_program(OpKind::AllReduce, 4, 1'000'000'000, {{0, 2}, {1, 3}});
    p->families[0].stride = 1;
    cases.push_back({"two all-reduces on a shared uplink", p, make_cluster(2, 2, 2, "fat-tree", 2)});
  }
  using Starter = sim::SimgridOptions::FlowStarter;
  for (const auto& k : cases) {
    std::vector<core::Timeline> runs;
    for (Starter s : {Starter::Maestro, Starter::Workers, Starter::Pool}) {
      sim::SimgridOptions options;
      options.flow_starter = s;
      runs.push_back(run_engine(*sim::make_simgrid_engine(options), k.program, k.cluster));
    }
    // The fat-tree cases are contended on the uplinks: sharing them makes the step longer than the
    // analytic engine's. (The one-node case is checked against it in SendSharingAnNvlinkPort....)
    const double analytic = run_engine(*sim::make_analytic_engine(), k.program, k.cluster).step_time_s;
    if (k.cluster.network.topology == "fat-tree") {
      EXPECT_GT(runs[0].step_time_s, analytic * (1 + 1e-3)) << k.what;
    }
    EXPECT_LE(max_span_difference(runs[1], runs[0]), 1e-12) << k.what << ": workers vs maestro";
    EXPECT_LE(max_span_difference(runs[2], runs[0]), 1e-12) << k.what << ": pool vs maestro";
  }
}

// SimgridOptions::merge_lone_collectives is exact: a ring or all-to-all alone on its links runs as
// one timer, and is
// split back into its flows when another flow comes onto one of its links. Merged and unmerged runs
// give every op the same start and end, on programs where rings run alone (and merge) and where
// other traffic comes onto their links mid-ring (and splits them): ZB-H1 PP2 x DP4 with ZeRO-3 and
// 1F1B PP2 x DP4 with ZeRO-1 on a thin fat-tree (the DP rings of both stages cross the same leaf
// uplinks, and pipeline transfers cross them too), the two all-reduces on a shared leaf uplink (the
// second ring splits the first at its first flow), 1F1B PP2 x DP4 on one NVLink node and ZB-H1 on
// 8 single-GPU nodes. Rounding differs (one product instead of a sum of steps): 1e-12 relative.
TEST(SimgridMergedRings, EqualUnmergedOpByOp) {
  struct Case {
    std::string what;
    std::shared_ptr<const core::Program> program;
    sim::Cluster cluster;
  };
  auto compiled_program = [](int pp, int dp, int zero, const std::string& schedule, int microbatches) {
    auto compiled = compile(pp, dp, zero, schedule, microbatches);
    return std::make_shared<const core::Program>(std::move(compiled.result.program));
  };
  std::vector<Case> cases;
  cases.push_back({"ZB-H1 PP2 DP4 ZeRO-3, thin fat-tree", compiled_program(2, 4, 3, "zb-h1", 4),
                   make_cluster(4, 2, 2, "fat-tree", 2)});
  cases.push_back({"1F1B PP2 DP4 ZeRO-1, thin fat-tree", compiled_program(2, 4, 1, "1f1b", 8),
                   make_cluster(4, 2, 2, "fat-tree", 2)});
  cases.push_back({"1F1B PP2 DP4, one node", compiled_program(2, 4, 0, "1f1b", 8), make_cluster(1, 8)});
  cases.push_back(
      {"ZB-H1 PP2 DP4 ZeRO-3, 8 single-GPU nodes", compiled_program(2, 4, 3, "zb-h1", 4), make_cluster(8, 1, 1)});
  {
    auto p = collective_program(OpKind::AllReduce, 8, 1'000'000'000, {{0, 2, 4, 6}, {1, 3, 5, 7}});
    p->families[0].stride = 1;
    cases.push_back({"two all-reduces on a shared uplink", p, make_cluster(4, 2, 2, "fat-tree", 2)});
  }
  for (const auto& k : cases) {
    sim::SimgridOptions merged, unmerged;
    unmerged.merge_lone_collectives = false;
    const core::Timeline a = run_engine(*sim::make_simgrid_engine(merged), k.program, k.cluster);
    const core::Timeline b = run_engine(*sim::make_simgrid_engine(unmerged), k.program, k.cluster);
    EXPECT_GT(b.step_time_s, 0) << k.what;
    EXPECT_LE(max_span_difference(a, b), 1e-12) << k.what;
  }
}

// The same on qwen3-9b (MoE) programs of every schedule family, compiled for 32 GPUs: DP replicas
// spread over four nodes (hierarchical collectives: intra-node rings, then inter-node rings), EP
// all-to-alls and pipeline transfers on the same NVLink and network ports, ZeRO 1-3; on dgx-h200
// (rail-optimized) and on the mixed H100/A100 cluster (a 2:1 fat-tree: inter-node rings share leaf
// uplinks, and the A100 node's links are slower, so some rings are not alike and never merge).
TEST(SimgridMergedRings, EqualUnmergedOnCompiledPrograms) {
  struct Config {
    std::string schedule;
    int pp, dp, ep, zero;
    std::string cluster;
  };
  const std::string mixed = PIPER_SOURCE_DIR "/examples/clusters/mixed-h100-a100.json";
  const std::vector<Config> configs = {{"1f1b", 4, 8, 4, 0, "dgx-h200"},  {"interleaved-1f1b", 4, 8, 1, 1, "dgx-h200"},
                                       {"zb-h1", 4, 8, 1, 2, "dgx-h200"}, {"dualpipev", 4, 8, 8, 3, "dgx-h200"},
                                       {"1f1b", 4, 8, 1, 1, mixed},       {"zb-v", 2, 16, 8, 1, mixed}};
  for (const auto& c : configs) {
    core::Scenario s;
    s.model = "qwen3-9b";
    s.strategy.schedule = c.schedule;
    s.strategy.pp = c.pp;
    s.strategy.dp = c.dp;
    s.strategy.ep = c.ep;
    s.strategy.zero = c.zero;
    s.strategy.microbatches = 8;
    auto compiled = core::compile_scenario(s);
    auto program = std::make_shared<const core::Program>(std::move(compiled.result.program));
    const sim::Cluster cluster = sim::with_devices(sim::load_cluster(c.cluster), program->num_devices);
    sim::SimgridOptions merged, unmerged;
    unmerged.merge_lone_collectives = false;
    const core::Timeline a = run_engine(*sim::make_simgrid_engine(merged), program, cluster);
    const core::Timeline b = run_engine(*sim::make_simgrid_engine(unmerged), program, cluster);
    const std::string what = c.schedule + " PP" + std::to_string(c.pp) + " DP" + std::to_string(c.dp) + " EP" +
                             std::to_string(c.ep) + " ZeRO-" + std::to_string(c.zero) + " on " + c.cluster;
    EXPECT_GT(b.step_time_s, 0) << what;
    EXPECT_LE(max_span_difference(a, b), 1e-12) << what;
  }
}

INSTANTIATE_TEST_SUITE_P(FlowStarters, SimgridEngine,
                         ::testing::Values(sim::SimgridOptions::FlowStarter::Maestro,
                                           sim::SimgridOptions::FlowStarter::Workers,
                                           sim::SimgridOptions::FlowStarter::Pool),
                         [](const ::testing::TestParamInfo<sim::SimgridOptions::FlowStarter>& info) {
                           switch (info.param) {
                             case sim::SimgridOptions::FlowStarter::Maestro:
                               return std::string("Maestro");
                             case sim::SimgridOptions::FlowStarter::Workers:
                               return std::string("Workers");
                             case sim::SimgridOptions::FlowStarter::Pool:
                               return std::string("Pool");
                             case sim::SimgridOptions::FlowStarter::Auto:
                               break;
                           }
                           return std::string("Auto");
                         });

#endif  // PIPER_HAVE_SIMGRID
