// Symmetry reduction: the reduced simulation (one device per class) equals the full one, span by
// span, on several schedule families with EP and ZeRO and on a heterogeneous cluster; the classes
// match the placement worked out by hand; asymmetric placement and the SimGrid engine fall back.
#include <gtest/gtest.h>

#include "piper/core/scenario.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/sim/symmetry.hpp"

using namespace piper;
using namespace piper::sim;

namespace {

struct Config {
  std::string schedule;
  int pp, dp, ep, zero, microbatches;
  std::string cluster;
};

core::Scenario scenario_of(const Config& c) {
  core::Scenario s;
  s.model = "qwen3-9b";  // MoE: EP has experts to shard
  s.strategy.schedule = c.schedule;
  s.strategy.pp = c.pp;
  s.strategy.dp = c.dp;
  s.strategy.ep = c.ep;
  s.strategy.zero = c.zero;
  s.strategy.microbatches = c.microbatches;
  s.cluster = c.cluster;
  s.engine = "analytic";
  return s;
}

SimulationResult run(const Config& c, bool symmetry) {
  SimulateOptions o;
  o.symmetry = symmetry;
  return simulate(scenario_of(c), o);
}

// Exact equality: the reduced run must reproduce every float of the full run, not approximate it.
void expect_same(const SimulationResult& reduced, const SimulationResult& full) {
  ASSERT_EQ(reduced.timeline.devices.size(), full.timeline.devices.size());
  EXPECT_EQ(reduced.report.step_time_s, full.report.step_time_s);
  EXPECT_EQ(reduced.report.peak_memory_bytes, full.report.peak_memory_bytes);
  EXPECT_EQ(reduced.report.bubble_fraction, full.report.bubble_fraction);
  ASSERT_EQ(reduced.report.per_device.size(), full.report.per_device.size());
  for (std::size_t d = 0; d < full.report.per_device.size(); ++d) {
    const auto& a = reduced.report.per_device[d];
    const auto& b = full.report.per_device[d];
    EXPECT_EQ(a.busy_s, b.busy_s) << "device " << d;
    EXPECT_EQ(a.comm_s, b.comm_s) << "device " << d;
    EXPECT_EQ(a.peak_memory_bytes, b.peak_memory_bytes) << "device " << d;
    EXPECT_EQ(a.peak_memory_time_s, b.peak_memory_time_s) << "device " << d;
  }
  for (std::size_t d = 0; d < full.timeline.devices.size(); ++d) {
    const auto& a = reduced.timeline.devices[d];
    const auto& b = full.timeline.devices[d];
    ASSERT_EQ(a.spans.size(), b.spans.size()) << "device " << d;
    for (std::size_t i = 0; i < a.spans.size(); ++i) {
      ASSERT_EQ(a.spans[i].start_s, b.spans[i].start_s) << "device " << d << " span " << i;
      ASSERT_EQ(a.spans[i].end_s, b.spans[i].end_s) << "device " << d << " span " << i;
    }
    ASSERT_EQ(a.memory.size(), b.memory.size()) << "device " << d;
    for (std::size_t i = 0; i < a.memory.size(); ++i) {
      ASSERT_EQ(a.memory[i].time_s, b.memory[i].time_s);
      ASSERT_EQ(a.memory[i].bytes, b.memory[i].bytes);
    }
  }
}

class ReducedEqualsFull : public ::testing::TestWithParam<Config> {};

TEST_P(ReducedEqualsFull, SpansMemoryAndReport) {
  const Config c = GetParam();
  const SimulationResult reduced = run(c, true);
  const SimulationResult full = run(c, false);
  EXPECT_EQ(reduced.report.simulation.rfind("reduced:", 0), 0u) << reduced.report.simulation;
  EXPECT_EQ(full.report.simulation, "full: symmetry off (--no-symmetry)");
  expect_same(reduced, full);
}

// 32 devices (four DGX nodes of 8): DP replicas of each stage spread over the nodes.
INSTANTIATE_TEST_SUITE_P(
    Families, ReducedEqualsFull,
    ::testing::Values(Config{"gpipe", 4, 8, 1, 0, 8, "dgx-h200"}, Config{"1f1b", 4, 8, 4, 0, 8, "dgx-h200"},
                      Config{"interleaved-1f1b", 4, 8, 1, 1, 8, "dgx-h200"}, Config{"zb-h1", 4, 8, 1, 2, 8, "dgx-h200"},
                      Config{"zb-v", 2, 16, 8, 1, 8, "dgx-h200"}, Config{"dualpipev", 4, 8, 8, 3, 8, "dgx-h200"},
                      Config{"dualpipe", 4, 8, 2, 1, 8, "dgx-h200"},
                      // Three H100 nodes and one A100 node: node types split classes.
                      Config{"1f1b", 4, 8, 1, 0, 8, PIPER_SOURCE_DIR "/examples/clusters/mixed-h100-a100.json"},
                      Config{"zb-v", 2, 16, 8, 1, 8, PIPER_SOURCE_DIR "/examples/clusters/mixed-h100-a100.json"}));

// The reduced run's devices of one class share their representative's spans and memory samples
// (no copy per device), and a write to one copy stays out of the others (copy on write).
TEST(Symmetry, DevicesOfAClassShareTheirTimelineUntilWritten) {
  const Config c{"1f1b", 4, 8, 1, 0, 8, "dgx-h200"};
  SimulationResult r = run(c, true);
  const core::Program& p = *r.program;
  const Symmetry sym = find_symmetry(p, r.cluster);
  ASSERT_TRUE(sym.reduces()) << sym.note;
  auto& devices = r.timeline.devices;
  int shared = 0;
  for (int d = 0; d < p.num_devices; ++d) {
    const int rep = sym.representative_of(d);
    if (rep == d) continue;
    EXPECT_TRUE(
        devices[static_cast<std::size_t>(d)].spans.shares_storage_with(devices[static_cast<std::size_t>(rep)].spans))
        << d;
    EXPECT_TRUE(
        devices[static_cast<std::size_t>(d)].memory.shares_storage_with(devices[static_cast<std::size_t>(rep)].memory))
        << d;
    ++shared;
  }
  EXPECT_EQ(shared, p.num_devices - sym.classes());

  int other = 0;  // a device of device 0's class
  while (other == 0 || sym.representative_of(other) != sym.representative_of(0)) ++other;
  const double before = devices[0].spans[0].end_s;
  devices[static_cast<std::size_t>(other)].spans[0].end_s = before + 1;  // non-const access: a private copy
  EXPECT_FALSE(devices[static_cast<std::size_t>(other)].spans.shares_storage_with(devices[0].spans));
  EXPECT_EQ(devices[0].spans[0].end_s, before);
  EXPECT_EQ(devices[static_cast<std::size_t>(other)].spans[0].end_s, before + 1);
  EXPECT_EQ(devices[static_cast<std::size_t>(other)].spans.size(), devices[0].spans.size());
}

// pp 4 x dp 8 on four 8-GPU nodes: the strategy places stage s on devices d = s (mod 4) (plan_of_device
// cycles), so each node holds two replicas of every stage; every replica of a stage has its peers
// on its own node and the same DP-group layout (4 nodes x 2). Hence exactly one class per stage.
TEST(Symmetry, OneClassPerStageOnAUniformCluster) {
  const Config c{"1f1b", 4, 8, 1, 0, 8, "dgx-h200"};
  const auto compiled = core::compile_scenario(scenario_of(c));
  const core::Program& p = compiled.result.program;
  const Symmetry sym = find_symmetry(p, with_devices(load_cluster("dgx-h200"), p.num_devices));
  ASSERT_TRUE(sym.reduces()) << sym.note;
  EXPECT_EQ(sym.classes(), 4);
  for (int d = 0; d < p.num_devices; ++d)
    for (int e = 0; e < p.num_devices; ++e)
      EXPECT_EQ(sym.class_of_device[d] == sym.class_of_device[e], p.plan_of_device[d] == p.plan_of_device[e]);
}

// On the mixed cluster node 3 (devices 24..31) is an A100 node holding two replicas of each stage:
// each stage splits into an H100 class and an A100 class.
TEST(Symmetry, HeterogeneousNodesSplitClasses) {
  const Config c{"1f1b", 4, 8, 1, 0, 8, PIPER_SOURCE_DIR "/examples/clusters/mixed-h100-a100.json"};
  const auto compiled = core::compile_scenario(scenario_of(c));
  const core::Program& p = compiled.result.program;
  const Cluster cluster = with_devices(load_cluster(c.cluster), p.num_devices);
  const Symmetry sym = find_symmetry(p, cluster);
  EXPECT_EQ(sym.classes(), 8) << sym.note;
  for (int d = 0; d < p.num_devices; ++d)
    for (int e = 0; e < p.num_devices; ++e) {
      const bool same = p.plan_of_device[d] == p.plan_of_device[e] && (d >= 24) == (e >= 24);
      EXPECT_EQ(sym.class_of_device[d] == sym.class_of_device[e], same) << d << " " << e;
    }
  EXPECT_NE(sym.note.find("node types split"), std::string::npos) << sym.note;
}

// pp 3 x dp 6 x ep 2 on 8-GPU nodes: stage s = d mod 3, so EP pair {6, 9} straddles nodes 0 and 1
// while {0, 3} does not, and the irregularity propagates through peers until no two devices are
// alike: the simulator says so and runs the full simulation.
TEST(Symmetry, AsymmetricPlacementFallsBackToFull) {
  const Config c{"1f1b", 3, 6, 2, 0, 6, "dgx-h200"};
  const SimulationResult result = run(c, true);
  EXPECT_EQ(result.report.simulation.rfind("full: no symmetry", 0), 0u) << result.report.simulation;
  const SimulationResult full = run(c, false);
  expect_same(result, full);
}

#ifdef PIPER_HAVE_SIMGRID
// Link contention couples flows of different classes: the SimGrid engine is never reduced.
TEST(Symmetry, SimgridRunsFull) {
  Config c{"1f1b", 2, 2, 1, 0, 2, "dgx-h200"};
  core::Scenario s = scenario_of(c);
  s.engine = "simgrid";
  const SimulationResult result = simulate(s, {});
  EXPECT_EQ(result.report.simulation.rfind("full: the simgrid engine", 0), 0u) << result.report.simulation;
}
#endif

}  // namespace
