// Tests of the unplaced global DAG: segmentation by tag stack, the F/B/UPD structure, BGL queries
// and the JSON/DOT dumps.
#include <gtest/gtest.h>

#include <boost/graph/topological_sort.hpp>
#include <nlohmann/json.hpp>

#include "piper/core/dag.hpp"
#include "piper/core/scenario.hpp"

using namespace piper::core;

namespace {
Model qwen9m_two_regions() {
  Model m = build_model(*zoo_config("qwen3-9m"));
  annotate_pipeline_ranges(m, {0, 2});
  return m;
}
}  // namespace

TEST(Segments, ContiguousLayersWithEqualTagsFormOneSegment) {
  const auto segments = segment_model(qwen9m_two_regions());
  ASSERT_EQ(segments.size(), 9u);  // per region: (attn, experts) x 2 blocks; + norm/head on PP1
  const std::vector<TagMap> expected = {{{"PP", 0}}, {{"PP", 0}, {"EP", 0}}, {{"PP", 0}}, {{"PP", 0}, {"EP", 1}},
                                        {{"PP", 1}}, {{"PP", 1}, {"EP", 2}}, {{"PP", 1}}, {{"PP", 1}, {"EP", 3}},
                                        {{"PP", 1}}};
  for (std::size_t i = 0; i < segments.size(); ++i) EXPECT_EQ(segments[i].tags, expected[i]) << i;
  EXPECT_TRUE(segments.back().has_loss);
  EXPECT_EQ(segments[1].fanout, 2);  // qwen3-9m routes each token to its top-2 experts
  EXPECT_EQ(segments[0].fanout, 1);
  // Segment costs are the sums of their layers'.
  const Model m = qwen9m_two_regions();
  double flops = 0;
  for (int l = segments[0].first_layer; l < segments[0].last_layer; ++l)
    flops += m.layer_cost(static_cast<std::size_t>(l)).forward_flops;
  EXPECT_DOUBLE_EQ(segments[0].costs.forward_flops, flops);
}

TEST(Dag, ForwardChainMirroredBackwardAndOneUpdatePerSegment) {
  const GlobalDag dag = build_dag(qwen9m_two_regions());
  auto counts = dag.counts_by_kind();
  EXPECT_EQ(counts["F"], 9);
  EXPECT_EQ(counts["B"], 9);
  EXPECT_EQ(counts["UPD"], 9);  // every segment of qwen3-9m has parameters
  EXPECT_FALSE(dag.has_cycle());
  // Edges: 8 activation + 8 gradient + 9 stash + 9 B->UPD.
  EXPECT_EQ(boost::num_edges(dag.graph), 8u + 8u + 9u + 9u);
  // The loss turn: the last F feeds the last B (the stash edge of the head segment).
  Vertex last_f = 8, last_b = 9;  // F nodes are created first (0..8), then B from the last segment
  EXPECT_EQ(dag.graph[last_f].pass, Pass::F);
  EXPECT_EQ(dag.graph[last_b].pass, Pass::B);
  EXPECT_EQ(dag.graph[last_b].segment, 8);
  EXPECT_TRUE(boost::edge(last_f, last_b, dag.graph).second);
  // A topological order exists and puts every F before its B.
  std::vector<Vertex> order;
  boost::topological_sort(dag.graph, std::back_inserter(order));
  EXPECT_EQ(order.size(), boost::num_vertices(dag.graph));
}

TEST(Dag, CycleDetectionSeesATemporalBackEdge) {
  GlobalDag dag = build_dag(qwen9m_two_regions());
  dag.add_edge(9, 0, {EdgeKind::Temporal, 0, ""});  // last B before the first F: a cycle
  EXPECT_TRUE(dag.has_cycle());
}

TEST(Dag, DeviceSetsAreInternedByContentAndOrder) {
  DeviceSetTable t;
  auto a = t.intern({0, 2});
  EXPECT_EQ(t.intern({0, 2}), a);
  EXPECT_NE(t.intern({2, 0}), a);  // order matters: it pairs ranks of sender and receiver sets
  EXPECT_EQ(t.size(), 2u);
}

TEST(Dag, JsonAndDotDumpsListEveryNode) {
  const GlobalDag dag = build_dag(qwen9m_two_regions());
  auto j = dag.to_json();
  EXPECT_EQ(j["nodes"].size(), dag.live_node_count());
  EXPECT_EQ(j["edges"].size(), boost::num_edges(dag.graph));
  const std::string dot = dag.to_dot();
  EXPECT_EQ(dot.rfind("digraph piper {", 0), 0u);
  EXPECT_NE(dot.find("F PP0 s0"), std::string::npos);
  EXPECT_NE(dot.find("n8 -> n9"), std::string::npos);
}

// GlobalDag moves its graph by swap (Boost's adjacency_list has no move operations) and every other
// member as usual: a moved DAG equals the one it was copied from, member by member, and the
// moved-from one is left with no graph to copy or free twice.
TEST(DagMove, MovesEveryMemberAndTheGraph) {
  Scenario s;
  s.model = "qwen3-9m";
  s.strategy.pp = 2;
  s.strategy.dp = 2;
  s.strategy.microbatches = 4;
  s.strategy.clip_grad = 1.0;
  s.strategy.comm_sms = 16;
  const GlobalDag original = compile_scenario(s).result.dag;
  ASSERT_TRUE(original.sm_partition.has_value());
  ASSERT_GT(original.clip_grad, 0);
  ASSERT_FALSE(original.splits.empty());

  auto expect_equal = [&](const GlobalDag& d) {
    EXPECT_EQ(d.to_json(), original.to_json());  // nodes, edges, families, model, microbatches
    EXPECT_EQ(boost::num_vertices(d.graph), boost::num_vertices(original.graph));
    EXPECT_EQ(d.device_sets.all(), original.device_sets.all());
    EXPECT_EQ(d.segments.size(), original.segments.size());
    EXPECT_EQ(d.training.seq_len, original.training.seq_len);
    EXPECT_EQ(d.layers.size(), original.layers.size());
    EXPECT_EQ(d.microbatches, original.microbatches);
    ASSERT_EQ(d.splits.size(), original.splits.size());
    EXPECT_EQ(d.splits.front().dim_name, original.splits.front().dim_name);
    EXPECT_EQ(d.sm_partition.has_value(), original.sm_partition.has_value());
    EXPECT_EQ(d.clip_grad, original.clip_grad);
  };
  GlobalDag copy = original;
  GlobalDag moved(std::move(copy));
  expect_equal(moved);
  EXPECT_EQ(boost::num_vertices(copy.graph), 0U);  // NOLINT(bugprone-use-after-move): the point

  GlobalDag assigned;
  assigned.add_node(DagNode{});
  assigned = std::move(moved);
  expect_equal(assigned);

  // The moved graph is whole: its vertices' edge entries point into its own edge list.
  const auto edges = boost::num_edges(assigned.graph);
  const Vertex a = assigned.add_node(DagNode{});
  const Vertex b = assigned.add_node(DagNode{});
  assigned.add_edge(a, b, DagEdge{});
  EXPECT_EQ(boost::num_edges(assigned.graph), edges + 1);
  EXPECT_EQ(boost::in_degree(b, assigned.graph), 1U);
  EXPECT_FALSE(assigned.has_cycle());
  boost::remove_edge(a, b, assigned.graph);
  EXPECT_EQ(boost::num_edges(assigned.graph), edges);
}
