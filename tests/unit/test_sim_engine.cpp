// The analytic engine against hand-derived schedules: pipeline step time and bubbles with unit op
// costs, the 1F1B activation-memory pattern, OOM, heterogeneous clusters on the critical path,
// compute slowed by communication, deadlock reports, and the Chrome trace's event counts.
#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>

#include <gtest/gtest.h>

#include "piper/core/scenario.hpp"
#include "piper/sim/engine.hpp"
#include "piper/sim/ready_tracker.hpp"
#include "piper/sim/report.hpp"
#include "piper/sim/simulate.hpp"
#include "expect.hpp"
#include "unit_costs.hpp"

using namespace piper;
using namespace piper::sim;
using nlohmann::json;

namespace {

// Unit-time view (unit_costs.hpp): each pipeline stage's F = 1 s and B = 2 s per microbatch
// (BI = BW = 1 s when split), everything else free.
constexpr double kF = 1, kB = 2, kW = 1;
OpOverride unit_costs(const core::Program& program) { return piper::test::unit_costs(program, kF, kB, kW); }

std::shared_ptr<const core::Program> compile(const std::string& schedule, int pp, int microbatches, int dp = 1) {
  core::Scenario s;
  s.model = "qwen3-1b";
  s.strategy.schedule = schedule;
  s.strategy.pp = pp;
  s.strategy.dp = dp;
  s.strategy.microbatches = microbatches;
  return std::make_shared<const core::Program>(core::compile_scenario(s).result.program);
}

struct SimRun {
  core::Timeline timeline;
  Report report;
};

// Simulates with the unit-time view (`unit` true) or the given override (none: the cost model).
SimRun simulate_unit(std::shared_ptr<const core::Program> program, const OpOverride& costs = {},
                     const Cluster& base = load_cluster("dgx-h200"), bool unit = true) {
  Cluster cluster = with_devices(base, program->num_devices);
  CostModel cost(cluster);
  if (costs)
    cost.set_override(costs);
  else if (unit)
    cost.set_override(unit_costs(*program));
  SimRun r;
  r.timeline = make_analytic_engine()->run(program, cluster, cost);
  r.report = make_report(r.timeline, cluster);
  return r;
}

// Pipeline families and their closed forms with per-stage F, B (= BI + W) and W, from the schedules
// issue. Adding a family is one line here.
struct Family {
  const char* schedule;
  double (*busy)(double p, double m);    // per rank
  double (*bubble)(double p, double m);  // per rank: step time - busy
  std::vector<int> (*microbatches)(int p);
};
constexpr double kFB = kF + kB;  // an overlapped F&B pair (DualPipe's F&B = F + B)
const Family kFamilies[] = {
    {"1f1b", [](double, double m) { return m * (kF + kB); }, [](double p, double) { return (p - 1) * (kF + kB); },
     [](int) {
       return std::vector<int>{1, 4, 8, 13};
     }},
    // ZB-H1: (p-1)(F+B-2W), for M >= p.
    {"zb-h1", [](double, double m) { return m * (kF + kB); },
     [](double p, double) { return (p - 1) * (kF + kB - 2 * kW); },
     [](int p) {
       return std::vector<int>{p, 2 * p + 1};
     }},
    // DualPipeV: 2p stages (PP) on p ranks, two per rank; (PP/2-1)(F&B+B-3W), for M >= 2p.
    {"dualpipev", [](double, double m) { return 2 * m * (kF + kB); },
     [](double p, double) { return (2 * p / 2 - 1) * (kFB + kB - 3 * kW); },
     [](int p) {
       return std::vector<int>{2 * p, 2 * p + 2};
     }},
};

}  // namespace

TEST(SimAnalytic, PipelineStepAndBubbleMatchTheFormulas) {
  for (const Family& family : kFamilies)
    for (int p : {4, 8})
      for (int m : family.microbatches(p)) {
        SCOPED_TRACE(std::string(family.schedule) + " p=" + std::to_string(p) + " M=" + std::to_string(m));
        SimRun r = simulate_unit(compile(family.schedule, p, m));
        // Unit costs are exact in binary floating point: sums are exact, tolerance 1e-9 s.
        const double step = family.busy(p, m) + family.bubble(p, m);
        EXPECT_NEAR(r.report.step_time_s, step, 1e-9);
        ASSERT_EQ(r.report.per_device.size(), static_cast<std::size_t>(p));
        for (const auto& d : r.report.per_device) {
          EXPECT_NEAR(d.idle_s, family.bubble(p, m), 1e-9) << "device " << d.device;
          EXPECT_NEAR(d.busy_s, family.busy(p, m), 1e-9) << "device " << d.device;
        }
        EXPECT_NEAR(r.report.bubble_fraction, family.bubble(p, m) / step, 1e-12);
      }
}

TEST(SimAnalytic, OneFOneBHoldsPMinusRActivationsOnRankR) {
  const int p = 4, m = 8;
  auto program = compile("1f1b", p, m);
  SimRun r = simulate_unit(program);
  const std::string activations = core::to_string(core::BufferKind::Activations);
  for (int rank = 0; rank < p; ++rank) {
    // One microbatch's stash on this rank, read from the plan's buffers (all microbatches are equal).
    std::int64_t total = 0;
    for (const auto& b : program->plan_for(rank).buffers)
      if (b.kind == core::BufferKind::Activations) total += b.bytes;
    const std::int64_t per_microbatch = total / m;
    ASSERT_EQ(per_microbatch * m, total);
    ASSERT_GT(per_microbatch, 0);
    EXPECT_EQ(r.report.per_device[static_cast<std::size_t>(rank)].peak_bytes_by_kind.at(activations),
              (p - rank) * per_microbatch)
        << "rank " << rank;
  }
}

TEST(SimAnalytic, DeviceOverItsHbmReportsOom) {
  auto program = compile("1f1b", 2, 4);
  SimRun fits = simulate_unit(program);
  EXPECT_FALSE(fits.report.oom);
  // 1 MiB of HBM: the persistent state alone does not fit.
  Cluster tiny =
      cluster_from_json(json{{"preset", "dgx-h200"}, {"node", {{"gpu", {{"hbm_gib", 1.0 / 1024}}}}}}, "tiny.json");
  SimRun over = simulate_unit(program, {}, tiny);
  EXPECT_TRUE(over.report.oom);
  EXPECT_EQ(over.report.oom_details.device, 0);
  EXPECT_EQ(over.report.oom_details.devices_over, 2);
  EXPECT_EQ(over.report.oom_details.hbm_bytes, std::int64_t{1} << 20);
  EXPECT_GT(over.report.oom_details.bytes, over.report.oom_details.hbm_bytes);
  ASSERT_FALSE(over.report.oom_details.largest_holders.empty());
  // Holders are sorted and add up to the bytes in use at that time.
  std::int64_t sum = 0;
  for (const auto& h : over.report.oom_details.largest_holders) sum += h.bytes;
  EXPECT_EQ(sum, over.report.oom_details.bytes);
  EXPECT_GE(over.report.oom_details.largest_holders.front().bytes,
            over.report.oom_details.largest_holders.back().bytes);
}

TEST(SimAnalytic, SlowNodeSetsTheCriticalPath) {
  // Two 4-GPU nodes; node 1's GPUs have a quarter of the FLOP/s and HBM bandwidth. PP8: stages 4-7
  // run there, so the steady state of the pipeline is paced by them.
  json spec = {
      {"preset", "dgx-h100"},
      {"nodes", 2},
      {"node", {{"gpus_per_node", 4}}},
      {"overrides", {{{"nodes", {1}}, {"gpu", {{"peak_tflops", 989.0 / 4}, {"hbm_bandwidth_gb_per_s", 3350.0 / 4}}}}}}};
  Cluster mixed = cluster_from_json(spec, "mixed.json");
  auto program = compile("1f1b", 8, 8);
  SimRun r = simulate_unit(program, {}, mixed, false);
  double fast = 0, slow = 0;
  for (const auto& [device, seconds] : r.report.critical_path.seconds_by_device) (device < 4 ? fast : slow) += seconds;
  EXPECT_GT(slow, 2 * fast) << "critical path compute: fast node " << fast << " s, slow node " << slow << " s";
  // The path ends at the step's end and starts at 0: compute + comm + waiting = step time.
  const auto& cp = r.report.critical_path;
  EXPECT_NEAR(cp.compute_s + cp.comm_s + cp.wait_s, r.report.step_time_s, 1e-9 * r.report.step_time_s);
  EXPECT_NEAR(cp.steps.back().end_s, r.report.step_time_s, 1e-12);
  SimRun homogeneous = simulate_unit(
      program, {},
      cluster_from_json(json{{"preset", "dgx-h100"}, {"nodes", 2}, {"node", {{"gpus_per_node", 4}}}}, "h.json"), false);
  EXPECT_GT(r.report.step_time_s, homogeneous.report.step_time_s);
}

namespace {

// Two devices: device 0 computes (10 s) while sending to device 1 (4 s transfer). With the
// communication kernel taking 25 % of the SMs, compute runs at 0.75 for 4 s: 10 + 4 * 0.25 = 11 s.
core::Program overlap_program() {
  core::Program p;
  p.model_name = "hand-made";
  p.num_devices = 2;
  p.device_sets = {{0}, {1}};
  p.plan_of_device = {0, 1};
  core::Op f;
  f.kind = core::OpKind::Compute;
  f.pass = core::Pass::F;
  f.label = "F";
  core::Op send;
  send.kind = core::OpKind::Send;
  send.node = 5;
  send.pair = 0;
  send.bytes = 1000;
  send.device_set = 0;
  send.peer_set = 1;
  send.label = "SEND";
  core::Op recv = send;
  recv.kind = core::OpKind::Recv;
  recv.device_set = 1;
  recv.peer_set = 0;
  recv.label = "RECV";
  core::Plan a;
  a.streams = {{"compute", {f}}, {"pp", {send}}};
  core::Plan b;
  b.streams = {{"pp", {recv}}};
  p.plans = {a, b};
  return p;
}

}  // namespace

TEST(SimAnalytic, CommunicationStealsComputeShare) {
  auto program = std::make_shared<const core::Program>(overlap_program());
  Cluster c = cluster_from_json(json{{"preset", "dgx-h100"}, {"node", {{"gpu", {{"comm_sm_share", 0.25}}}}}}, "c.json");
  auto costs = [](const core::Op& op) -> std::optional<double> {
    return op.kind == core::OpKind::Compute ? 10.0 : 4.0;
  };
  SimRun r = simulate_unit(program, costs, c);
  const auto& spans0 = r.timeline.devices[0].spans;  // sorted by (stream, index): compute F, then SEND
  EXPECT_NEAR(spans0[0].end_s, 11.0, 1e-12);
  EXPECT_NEAR(spans0[1].end_s, 4.0, 1e-12);
  // Rendezvous: the RECV ends with its SEND.
  EXPECT_EQ(r.timeline.devices[1].spans[0].start_s, spans0[1].start_s);
  EXPECT_EQ(r.timeline.devices[1].spans[0].end_s, spans0[1].end_s);
  EXPECT_NEAR(r.report.per_device[0].comm_compute_overlap, 1.0, 1e-12);
}

// sm_partition: compute runs on (N - s) / N of the SMs whether or not communication runs. The same
// program as above (F = 10 s of work on device 0, a 4 s SEND from t = 0) on 132-SM H100s: giving
// communication 33 SMs runs F at 0.75 from start to end, 10 / 0.75 s, where shared SMs gave 11 s.
TEST(SimAnalytic, SmPartitionSetsComputeSpeedByHand) {
  Cluster c = cluster_from_json(json{{"preset", "dgx-h100"}, {"node", {{"gpu", {{"comm_sm_share", 0.25}}}}}}, "c.json");
  auto costs = [](const core::Op& op) -> std::optional<double> {
    return op.kind == core::OpKind::Compute ? 10.0 : 4.0;
  };
  for (int sms : {33, 66}) {
    core::Program p = overlap_program();
    p.sm_partition = core::SmPartition{"comm", sms};
    SimRun r = simulate_unit(std::make_shared<const core::Program>(p), costs, c);
    const double rate = (132.0 - sms) / 132.0;
    EXPECT_NEAR(r.timeline.devices[0].spans[0].end_s, 10.0 / rate, 1e-9) << sms;
    EXPECT_NEAR(r.timeline.devices[0].spans[1].end_s, 4.0, 1e-12);  // communication keeps its time
  }
  // The SimGrid engine follows the same rule (its hosts' speed is the idle rate).
  const std::vector<std::string> engines = engine_names();
  if (std::find(engines.begin(), engines.end(), "simgrid") != engines.end()) {
    core::Program p = overlap_program();
    p.sm_partition = core::SmPartition{"comm", 33};
    auto program = std::make_shared<const core::Program>(p);
    Cluster cluster = with_devices(c, program->num_devices);
    CostModel cost(cluster);
    cost.set_override(costs);
    const core::Timeline t = make_simgrid_engine()->run(program, cluster, cost);
    EXPECT_NEAR(t.devices[0].spans[0].end_s, 10.0 / 0.75, 1e-6);
  }
  // More SMs than the GPU has: one line naming the field, before anything runs.
  core::Program p = overlap_program();
  p.sm_partition = core::SmPartition{"comm", 200};
  EXPECT_THROW(simulate_unit(std::make_shared<const core::Program>(p), costs, c), ClusterError);
}

TEST(SimAnalytic, DeadlockIsReportedOnOneLine) {
  // Both devices SEND first and RECV second on one stream: each SEND waits for a RECV never reached.
  core::Program p = overlap_program();
  core::Op s = p.plans[0].streams[1].ops[0];  // SEND 0 -> 1, node 5
  core::Op r = p.plans[1].streams[0].ops[0];  // RECV on 1 from 0, node 5
  core::Op s2 = s, r2 = r;
  s2.node = 6, s2.pair = 1, s2.device_set = 1, s2.peer_set = 0;  // SEND 1 -> 0, node 6
  r2.node = 6, r2.pair = 1, r2.device_set = 0, r2.peer_set = 1;  // RECV on 0 from 1, node 6
  p.plans[0].streams = {{"pp", {s, r2}}};
  p.plans[1].streams = {{"pp", {s2, r}}};
  auto program = std::make_shared<const core::Program>(p);
  std::string message;
  try {
    simulate_unit(program);
  } catch (const DeadlockError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("deadlock"), std::string::npos) << message;
  EXPECT_NE(message.find("device 0 stream 'pp' op 0 'SEND' SEND waits for device 1"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos);
}

// Spans that touch must not overlap in the trace: a span from 0.6 ns to 2.4 ns followed by one from
// 2.4 ns, with start and length rounded separately, ended at 1 + 2 = 3 ns, after the next began (2 ns).
TEST(SimTrace, ChromeTraceSpansThatTouchDoNotOverlap) {
  auto program = compile("1f1b", 4, 4, 2);
  SimRun r = simulate_unit(program, {}, load_cluster("dgx-h200"), false);
  core::Timeline tl = r.timeline;
  auto& spans = tl.devices[0].spans;
  std::vector<std::size_t> same_stream;
  for (std::size_t i = 0; i < spans.size() && same_stream.size() < 2; ++i)
    if (spans[i].stream == spans[0].stream) same_stream.push_back(i);
  ASSERT_EQ(same_stream.size(), 2u);
  spans[same_stream[0]].start_s = 0.6e-9, spans[same_stream[0]].end_s = 2.4e-9;
  spans[same_stream[1]].start_s = 2.4e-9, spans[same_stream[1]].end_s = 5e-9;
  std::ostringstream out;
  core::write_chrome_trace(tl, out);
  // Integer nanoseconds of each of stream 0's first two spans on device 0.
  std::vector<std::pair<std::int64_t, std::int64_t>> seen;
  const json trace = json::parse(out.str());
  for (const auto& e : trace.at("traceEvents"))
    if (e.at("ph") == "X" && e.at("pid").get<int>() == 0 && e.at("tid").get<int>() == spans[0].stream &&
        seen.size() < 2)
      seen.push_back({std::llround(e.at("ts").get<double>() * 1000), std::llround(e.at("dur").get<double>() * 1000)});
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], std::make_pair(std::int64_t{1}, std::int64_t{1}));  // 1 ns to 2 ns
  EXPECT_EQ(seen[1].first, 2);
  EXPECT_LE(seen[0].first + seen[0].second, seen[1].first);
}

TEST(SimTrace, ChromeTraceIsValidJsonWithOneEventPerOp) {
  auto program = compile("1f1b", 4, 4, 2);
  SimRun r = simulate_unit(program, {}, load_cluster("dgx-h200"), false);
  std::ostringstream out;
  core::write_chrome_trace(r.timeline, out);
  json trace = json::parse(out.str());
  std::map<std::string, std::int64_t> count;
  for (const auto& e : trace.at("traceEvents")) count[e.at("ph").get<std::string>()] += 1;
  std::int64_t sends = 0, recvs = 0, samples = 0;
  for (int d = 0; d < program->num_devices; ++d) {
    for (const auto& s : program->plan_for(d).streams)
      for (const auto& op : s.ops) sends += op.kind == core::OpKind::Send, recvs += op.kind == core::OpKind::Recv;
    samples += static_cast<std::int64_t>(r.timeline.devices[static_cast<std::size_t>(d)].memory.size());
  }
  EXPECT_EQ(count["X"], program->total_ops());
  EXPECT_EQ(count["s"], sends);
  EXPECT_EQ(count["f"], recvs);
  EXPECT_GT(sends, 0);
  EXPECT_EQ(count["C"], samples);
  // Report JSON round trip keeps the headline fields.
  Report back = Report::from_json(r.report.to_json());
  EXPECT_EQ(back.step_time_s, r.report.step_time_s);
  EXPECT_EQ(back.per_device.size(), r.report.per_device.size());
  EXPECT_EQ(back.critical_path.ops, r.report.critical_path.ops);
}

// A "blocking" place directive (DeepSpeed's synchronous send/recv): the compute op after a SEND's
// producer waits for the transfer, and a RECV is posted only once the compute op before its consumer
// has ended. GPipe on 2 ranks, 2 microbatches, F = 1, B = 2, each transfer 0.5 s, by hand:
//  * non-blocking: rank 0 F0 [0,1] F1 [1,2]; sends [1,1.5] [2,2.5]; rank 1 F0 [1.5,2.5] F1 [2.5,3.5]
//    B0 [3.5,5.5] B1 [5.5,7.5]; gradients [5.5,6] [7.5,8]; rank 0 B0 [6,8] B1 [8,10]: 10 s.
//  * blocking: rank 0 F1 waits for the first send: [1.5,2.5]; the second send waits for rank 1's F0
//    to end (2.5): [2.5,3]; rank 1 F1 [3,4] B0 [4,6]; its B1 waits for the gradient send [6,6.5]:
//    [6.5,8.5]; rank 0 B0 [6.5,8.5]; the last gradient [8.5,9]; rank 0 B1 [9,11]: 11 s.
TEST(SimEngine, BlockingTransfersSerializeWithTheComputeStream) {
  auto with_blocking = [](bool blocking) {
    core::Scenario s;
    s.model = "qwen3-1b";
    s.strategy.schedule = "gpipe";
    s.strategy.pp = 2;
    s.strategy.microbatches = 2;
    s.strategy.p2p_blocking = blocking;  // the place directives' "blocking"
    return std::make_shared<const core::Program>(core::compile_scenario(s).result.program);
  };
  const OpOverride half_second_transfers = [](const core::Op& op) -> std::optional<double> {
    if (op.kind == core::OpKind::Send || op.kind == core::OpKind::Recv) return 0.5;
    return std::nullopt;
  };
  for (const bool blocking : {false, true}) {
    const auto program = with_blocking(blocking);
    const OpOverride unit = unit_costs(*program);
    const OpOverride costs = [&](const core::Op& op) {
      const auto t = half_second_transfers(op);
      return t ? t : unit(op);
    };
    // Compute at full speed beside transfers (comm_sm_share 0), as the hand timeline assumes.
    const Cluster no_sm_share =
        cluster_from_text(R"({"preset": "dgx-h200", "node": {"gpu": {"comm_sm_share": 0}}})", "c.json");
    EXPECT_DOUBLE_EQ(simulate_unit(program, costs, no_sm_share).report.step_time_s, blocking ? 11.0 : 10.0)
        << "blocking " << blocking;
    // Rank 0's compute ops wait on its SENDs exactly when blocking.
    const auto& plan0 = program->plan_for(0);
    int waits_on_send = 0;
    for (const auto& op : plan0.streams[0].ops)
      for (const auto& w : op.waits)
        waits_on_send +=
            plan0.streams[static_cast<std::size_t>(w.stream)].ops[static_cast<std::size_t>(w.index)].kind ==
            core::OpKind::Send;
    EXPECT_EQ(waits_on_send > 0, blocking) << waits_on_send;
  }
  core::Scenario one_stage;
  one_stage.model = "qwen3-1b";
  one_stage.strategy.p2p_blocking = true;
  EXPECT_EQ(piper::test::error_of([&] { core::compile_scenario(one_stage); }),
            "--p2p-blocking applies only with --pp 2 or more (its pipeline transfers)");
  EXPECT_NE(
      piper::test::error_of([] {
        core::parse_directives(json::parse(R"([{"op": "place", "filter": {"PP": 0}, "devices": [0], "blocking": 1}])"));
      }).find("blocking"),
      std::string::npos);
}
