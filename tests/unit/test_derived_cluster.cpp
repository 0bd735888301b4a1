// Derived cluster specs ({"cluster": <preset or file>, "runtime", "attention_kernel"}, sim/cluster.hpp) and
// specs given inline: what `piper simulate --runtime / --attention-kernel` write (docs/cost-model.md).
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "piper/core/scenario.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/simulate.hpp"
#include "scratch_test.hpp"

using namespace piper;
using namespace piper::sim;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ClusterError& e) {
    return e.what();
  }
  return "(no error)";
}

class DerivedCluster : public piper::test::ScratchTest {
 protected:
  void write(const std::string& name, const std::string& text) const { std::ofstream(dir_ / name) << text; }
};

double step_on(const std::string& cluster) {
  core::Scenario s;
  s.model = "qwen3-9m";
  s.strategy.pp = 2;
  s.strategy.microbatches = 4;
  SimulateOptions o;
  o.cluster = cluster;
  o.engine = "analytic";
  return simulate(s, o).report.step_time_s;
}

}  // namespace

// The base cluster's nodes, network and name, with the runtime's settings replaced; those not given
// stay the base's.
TEST_F(DerivedCluster, TakesTheBaseAndReplacesTheRuntimeSettings) {
  const Cluster base = load_cluster("dgx-h100");
  const Cluster d = cluster_from_json(json{{"cluster", "dgx-h100"}, {"runtime", "eager"}, {"attention_kernel", "fa2"}},
                                      (dir_ / "d.json").string());
  EXPECT_EQ(d.nodes, base.nodes);
  EXPECT_EQ(d.network, base.network);
  EXPECT_EQ(d.name, base.name);
  EXPECT_EQ(d.runtime, "eager");
  EXPECT_EQ(d.attention_kernel, "fa2");
  EXPECT_EQ(base.runtime, "fused");
  EXPECT_EQ(cluster_from_json(json{{"cluster", "dgx-h100"}, {"name", "mine"}}, "d.json").name, "mine");

  // A file taken relative to the derived spec's folder, whatever the working directory; its own
  // runtime kept where the derived spec does not set one.
  write("base.json", R"({"preset": "dgx-a100-80g", "nodes": 2, "runtime": "eager"})");
  write("derived.json", R"({"cluster": "base.json", "attention_kernel": "fa1"})");
  const Cluster f = load_cluster((dir_ / "derived.json").string());
  EXPECT_EQ(f.nodes.size(), 2u);
  EXPECT_EQ(f.nodes, load_cluster((dir_ / "base.json").string()).nodes);
  EXPECT_EQ(f.runtime, "eager");
  EXPECT_EQ(f.attention_kernel, "fa1");
}

// A spec given in place of a file name: errors name where it was given.
TEST_F(DerivedCluster, InlineSpecs) {
  const Cluster c = load_cluster(R"(  {"preset": "dgx-h200", "nodes": 3, "runtime": "eager"})");
  EXPECT_EQ(c.nodes.size(), 3u);
  EXPECT_EQ(c.runtime, "eager");
  EXPECT_EQ(load_cluster(R"({"cluster": "dgx-h200", "runtime": "eager"})").nodes, load_cluster("dgx-h200").nodes);
  EXPECT_EQ(
      error_of([] { load_cluster(R"({"preset": "dgx-h200", "nodes": 0.5})"); }).rfind("--cluster: field 'nodes'", 0),
      0u);
  EXPECT_EQ(error_of([] { load_cluster("{\"preset\": "); }).rfind("--cluster: invalid JSON", 0), 0u);
  EXPECT_EQ(error_of([] {
              load_cluster(R"({"cluster": "dgx-h200", "runtime": "lazy"})", "s.json: field 'cluster':");
            }).rfind("s.json: field 'cluster': field 'runtime'", 0),
            0u);
}

TEST_F(DerivedCluster, ErrorsNameTheField) {
  auto derived = [](const json& j) { return error_of([&] { cluster_from_json(j, "d.json"); }); };
  std::string e = derived({{"cluster", "dgx-h100"}, {"nodes", 2}});
  EXPECT_NE(e.find("d.json: field 'nodes': unknown field"), std::string::npos) << e;
  EXPECT_NE(e.find("cluster, name, runtime, attention_kernel, comment"), std::string::npos) << e;
  e = derived({{"cluster", 3}});
  EXPECT_NE(e.find("d.json: field 'cluster': expected a preset name or a cluster file"), std::string::npos) << e;
  e = derived({{"cluster", "dgx-h9000"}});
  EXPECT_NE(e.find("d.json: field 'cluster': 'dgx-h9000': neither a preset"), std::string::npos) << e;
  e = derived({{"cluster", "dgx-a100-80g"}, {"attention_kernel", "fa3"}});
  EXPECT_NE(e.find("d.json: field 'attention_kernel': kernel table 'a100-80gb-sxm' has no attention kernel 'fa3' "
                   "(it has: fa1, fa2)"),
            std::string::npos)
      << e;
  e = derived({{"cluster", "dgx-h100"}, {"runtime", "eagr"}});
  EXPECT_NE(e.find("d.json: field 'runtime': expected one of"), std::string::npos) << e;
  // A file that names itself, or two that name each other, stop at the nesting limit.
  write("self.json", R"({"cluster": "self.json"})");
  e = error_of([&] { load_cluster((dir_ / "self.json").string()); });
  EXPECT_NE(e.find("nest deeper than 8"), std::string::npos) << e;
  write("a.json", R"({"cluster": "b.json"})");
  write("b.json", R"({"cluster": "a.json"})");
  e = error_of([&] { load_cluster((dir_ / "a.json").string()); });
  EXPECT_NE(e.find("nest deeper than 8"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  // After a refused chain the next load is not counted as nested.
  EXPECT_EQ(load_cluster(R"({"cluster": "dgx-h100"})").nodes, load_cluster("dgx-h100").nodes);
}

// A derived cluster is costed as the same settings written into a full spec, and differs from the base.
TEST_F(DerivedCluster, CostsAsTheSameSettingsSpelledOut) {
  write("full.json", R"({"preset": "dgx-h100", "runtime": "eager", "attention_kernel": "fa2"})");
  const double derived = step_on(R"({"cluster": "dgx-h100", "runtime": "eager", "attention_kernel": "fa2"})");
  EXPECT_DOUBLE_EQ(derived, step_on((dir_ / "full.json").string()));
  EXPECT_GT(derived, step_on("dgx-h100"));  // eager's unfused kernels and FlashAttention-2's rates
}

// What the studio's preset panel reads back from a scenario's cluster: a derived spec's parts, and
// nothing for any other cluster text.
TEST(DerivedClusterParts, OfADerivedSpecOnly) {
  const auto parts = derived_cluster_parts(derived_cluster_spec("dgx-h100", "eager", "fa2"));
  ASSERT_TRUE(parts.has_value());
  EXPECT_EQ(parts->cluster, "dgx-h100");
  EXPECT_EQ(parts->runtime, "eager");
  EXPECT_EQ(parts->attention_kernel, "fa2");
  const auto runtime_only = derived_cluster_parts(R"({"cluster": "c.json", "runtime": "fused", "name": "n"})");
  ASSERT_TRUE(runtime_only.has_value());
  EXPECT_EQ(runtime_only->cluster, "c.json");
  EXPECT_EQ(runtime_only->attention_kernel, "");
  for (const char* other : {"dgx-h100", "c.json", R"({"preset": "dgx-h100", "nodes": 2})",
                            R"({"cluster": "dgx-h100", "nodes": 2})", R"({"cluster": 3})", "{not json"})
    EXPECT_FALSE(derived_cluster_parts(other).has_value()) << other;
}

TEST(DerivedClusterParts, AttentionKernelsAreThoseEveryTableHolds) {
  EXPECT_EQ(attention_kernel_names(load_cluster("dgx-h100")), (std::vector<std::string>{"fa1", "fa2"}));
  EXPECT_TRUE(attention_kernel_names(
                  cluster_from_text(R"({"preset": "dgx-h100", "node": {"gpu": {"kernel_table": ""}}})", "c.json"))
                  .empty());
}
