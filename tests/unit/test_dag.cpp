// Tests of the unplaced global DAG: segmentation by tag stack, the F/B/UPD structure, BGL queries
// and the JSON/DOT dumps.
#include <gtest/gtest.h>

#include <boost/graph/topological_sort.hpp>
#include <nlohmann/json.hpp>

#include "piper/core/dag.hpp"

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
