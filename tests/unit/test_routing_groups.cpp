// Node-limited routing (model moe.routing_groups / routing_group_limit; Hugging Face n_group /
// topk_group, DeepSeek-V2/V3): the spec and the importer read it, lowering puts it on the routed
// experts' ALL_TO_ALL ops, plans carry it, and the cost model's routed all-to-all
// (CostModel::routed_all_to_all, docs/compiler.md) is derived here by hand from the cluster's figures.
#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "expect.hpp"
#include "piper/core/compiler.hpp"
#include "piper/core/error.hpp"
#include "piper/core/model.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"

using namespace piper;
using namespace piper::core;
using nlohmann::json;
using piper::test::error_of;

namespace {

const std::string kSource = PIPER_SOURCE_DIR;

ModelConfig routed_moe(std::int64_t groups, std::int64_t limit) {
  ModelConfig c;
  c.name = "routed-moe-" + std::to_string(groups) + "-" + std::to_string(limit);
  c.vocab = 256;
  c.hidden = 64;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 4;
  c.head_dim = 16;
  c.ffn = 128;
  c.experts = 8;
  c.top_k = 2;
  c.expert_ffn = 64;
  c.routing_groups = groups;
  c.routing_group_limit = limit;
  c.training.seq_len = 64;
  c.training.micro_batch_size = 2;
  c.training.precision = Precision::BF16;
  return c;
}

Program compile_ep(const ModelConfig& c) {
  const std::string path = ::testing::TempDir() + "/" + c.name + "-" + std::to_string(::getpid()) + ".json";
  write_file_atomically(path, config_to_spec_json(c).dump());
  Scenario sc;
  sc.model = path;
  sc.strategy.dp = 4;
  sc.strategy.ep = 4;
  sc.strategy.microbatches = 2;
  return compile_scenario(sc).result.program;
}

std::vector<const Op*> all_to_alls(const Program& p) {
  std::vector<const Op*> out;
  for (const auto& plan : p.plans)
    for (const auto& s : plan.streams)
      for (const auto& op : s.ops)
        if (op.kind == OpKind::AllToAll) out.push_back(&op);
  return out;
}

// `nodes` nodes of `gpus` GPUs: NVLink 450 GB/s (NCCL reaches all of it here) and 2 us; 8 NICs of
// 50 GB/s (so 400 / gpus GB/s per GPU); 5 us network latency.
sim::Cluster cluster(int nodes, int gpus) {
  sim::NodeSpec n;
  n.gpus_per_node = gpus;
  n.gpu.name = "test-gpu";
  n.gpu.peak_flops = 989e12;
  n.gpu.sm_count = 132;
  n.gpu.hbm_bytes = std::int64_t{141} << 30;
  n.gpu.hbm_bandwidth_bytes_per_s = 4.8e12;
  n.nvlink_bandwidth_bytes_per_s = 450e9;
  n.nvlink_latency_s = 2e-6;
  n.nics = 8;
  n.nic_bandwidth_bytes_per_s = 50e9;
  sim::Cluster c;
  c.name = "test";
  c.nodes.assign(static_cast<std::size_t>(nodes), n);
  c.network.latency_s = 5e-6;
  return c;
}

Op a2a(std::int64_t bytes, int groups, int limit, int top_k) {
  Op op;
  op.kind = OpKind::AllToAll;
  op.bytes = bytes;
  op.route_groups = groups;
  op.route_group_limit = limit;
  op.route_top_k = top_k;
  return op;
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return json::parse(text.str());
}

std::vector<int> iota(int n) {
  std::vector<int> v;
  for (int i = 0; i < n; ++i) v.push_back(i);
  return v;
}

}  // namespace

TEST(RoutingGroups, SpecAndHuggingFaceImportReadIt) {
  // DeepSeek-V3's config.json: "n_group": 8, "topk_group": 4.
  const ModelConfig hf = load_model_config(kSource + "/tests/data/hf/deepseek-v3.json");
  EXPECT_EQ(hf.routing_groups, 8);
  EXPECT_EQ(hf.routing_group_limit, 4);
  const ModelConfig zoo = *zoo_config("deepseek-v3");
  EXPECT_EQ(zoo.routing_groups, 8);
  EXPECT_EQ(zoo.routing_group_limit, 4);
  // Our spec writes and reads it back.
  const json spec = config_to_spec_json(routed_moe(4, 2));
  EXPECT_EQ(spec.at("moe").at("routing_groups"), 4);
  EXPECT_EQ(spec.at("moe").at("routing_group_limit"), 2);
  const ModelConfig back = config_from_spec_json(spec, "spec.json");
  EXPECT_EQ(back.routing_groups, 4);
  EXPECT_EQ(back.routing_group_limit, 2);
  // Without the limit the groups restrict nothing: the limit defaults to all of them.
  json open = spec;
  open["moe"].erase("routing_group_limit");
  EXPECT_EQ(config_from_spec_json(open, "spec.json").routing_group_limit, 4);
  EXPECT_FALSE(config_to_spec_json(routed_moe(0, 0)).at("moe").contains("routing_groups"));
}

TEST(RoutingGroups, BadValuesAreRefusedInOneLine) {
  const json good = config_to_spec_json(routed_moe(4, 2));
  auto with = [&](const char* field, json value) {
    json j = good;
    j["moe"][field] = std::move(value);
    return error_of([&] { (void)build_model(config_from_spec_json(j, "m.json")); });
  };
  const std::string not_dividing = with("routing_groups", 3);  // 8 experts
  EXPECT_NE(not_dividing.find("moe.routing_groups"), std::string::npos) << not_dividing;
  EXPECT_NE(not_dividing.find("divides moe.experts (8)"), std::string::npos) << not_dividing;
  const std::string too_many = with("routing_group_limit", 5);
  EXPECT_NE(too_many.find("moe.routing_group_limit"), std::string::npos) << too_many;
  const std::string zero = with("routing_group_limit", 0);
  EXPECT_NE(zero.find("moe.routing_group_limit"), std::string::npos) << zero;
  json orphan = good;
  orphan["moe"].erase("routing_groups");
  const std::string alone = error_of([&] { (void)build_model(config_from_spec_json(orphan, "m.json")); });
  EXPECT_NE(alone.find("needs moe.routing_groups"), std::string::npos) << alone;
  for (const std::string& e : {not_dividing, too_many, zero, alone}) EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  // The importer: topk_group above n_group.
  json hf = read_json(kSource + "/tests/data/hf/deepseek-v3.json");
  hf["topk_group"] = 9;
  const std::string bad_hf = error_of([&] { (void)config_from_hf_json(hf, "config.json"); });
  EXPECT_NE(bad_hf.find("topk_group"), std::string::npos) << bad_hf;
}

TEST(RoutingGroups, LoweringPutsItOnTheAllToAllOpsAndPlansCarryIt) {
  const Program routed = compile_ep(routed_moe(4, 2));
  const auto ops = all_to_alls(routed);
  ASSERT_FALSE(ops.empty());
  for (const Op* op : ops) {
    EXPECT_EQ(op->route_groups, 4);
    EXPECT_EQ(op->route_group_limit, 2);
    EXPECT_EQ(op->route_top_k, 2);  // the model's top_k
  }
  const Program uniform = compile_ep(routed_moe(0, 0));  // all_to_alls points into it: keep it alive
  for (const Op* op : all_to_alls(uniform)) EXPECT_EQ(op->route_groups, 0);

  const Program back = Program::from_json(routed.to_json());
  const auto again = all_to_alls(back);
  ASSERT_EQ(again.size(), ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(again[i]->route_groups, ops[i]->route_groups);
    EXPECT_EQ(again[i]->route_group_limit, ops[i]->route_group_limit);
    EXPECT_EQ(again[i]->route_top_k, ops[i]->route_top_k);
  }
  // A plan file that states impossible routing is refused, naming the field.
  const json plan = routed.to_json();
  auto edited = [&](const std::function<void(json&)>& edit) {
    json j = plan;
    for (auto& p : j.at("plans"))
      for (auto& s : p.at("streams"))
        for (auto& op : s.at("ops"))
          if (op.at("kind") == "ALL_TO_ALL") {
            edit(op);
            return error_of([&] { (void)Program::from_json(j); });
          }
    return std::string("no ALL_TO_ALL in the plan");
  };
  EXPECT_NE(edited([](json& op) { op["route_group_limit"] = 5; }).find("route_group_limit"), std::string::npos);
  EXPECT_NE(edited([](json& op) { op.erase("route_top_k"); }).find("route_top_k"), std::string::npos);
  EXPECT_NE(edited([](json& op) { op["route_top_k"] = 0; }).find("route_top_k"), std::string::npos);
  EXPECT_NE(edited([](json& op) { op.erase("route_groups"); }).find("needs route_groups"), std::string::npos);
}

// 4 nodes x 4 GPUs (n = 16, m = 4, k = 4): B_i = 450 GB/s, alpha_i = 2 us; B_e = 8 x 50 / 4 = 100 GB/s,
// alpha_e = 5 us. S bytes per rank, top_k t = 8.
//  uniform:              3 (a_i + S/16/B_i) + 12 (a_e + S/16/B_e)
//  8 groups, limit 2:    a token reaches b = 2 nodes (2 whole groups per node): direct S/16 to each
//                        same-node rank, S b / (t k) = S/16 to each other node's rail peer, which
//                        forwards S (k-1) / (k m) = 3S/16 to each of its node's other ranks:
//                        3 (a_i + S/16/B_i) + 3 (a_e + S/16/B_e) + 3 (a_i + 3S/16/B_i)
//  3 groups (not aligned with the 4 nodes): b = min(k, t) = 4, S b / (t k) = S/8 per other node.
//  one GPU per node (4 nodes x 1, B_e = 400 GB/s), 8 groups, limit 2: 3 (a_e + S/16/B_e).
TEST(RoutingGroups, RoutedAllToAllCostByHand) {
  const double S = 512e6, ai = 2e-6, bi = 450e9, ae = 5e-6, be = 100e9;
  const auto bytes = static_cast<std::int64_t>(S);
  const sim::CostModel cost(sim::with_devices(cluster(4, 4), 16));
  const std::vector<int> ranks = iota(16);
  const double uniform = 3 * (ai + S / 16 / bi) + 12 * (ae + S / 16 / be);
  const double limited = 3 * (ai + S / 16 / bi) + 3 * (ae + S / 16 / be) + 3 * (ai + 3 * S / 16 / bi);
  const double unaligned = 3 * (ai + S / 16 / bi) + 3 * (ae + S / 8 / be) + 3 * (ai + 3 * S / 16 / bi);
  test::expect_rel(cost.collective_op_seconds(a2a(bytes, 0, 0, 0), ranks), uniform);
  test::expect_rel(cost.collective_op_seconds(a2a(bytes, 8, 2, 8), ranks), limited);
  test::expect_rel(cost.collective_op_seconds(a2a(bytes, 3, 2, 8), ranks), unaligned);
  // The latency part is the same form with no bytes.
  test::expect_rel(cost.collective_latency_seconds(a2a(bytes, 8, 2, 8), ranks), 6 * ai + 3 * ae);
  // Ranks not in whole-node runs (node 0's ranks are not consecutive) and a group inside one node:
  // the uniform form.
  const std::vector<int> interleaved = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
  test::expect_rel(cost.collective_op_seconds(a2a(bytes, 8, 2, 8), interleaved),
                   cost.collective_seconds(OpKind::AllToAll, interleaved, bytes));
  const std::vector<int> one_node = {0, 1, 2, 3};
  test::expect_rel(cost.collective_op_seconds(a2a(bytes, 8, 2, 8), one_node), 3 * (ai + S / 4 / bi));

  const sim::CostModel per_node(sim::with_devices(cluster(4, 1), 4));
  test::expect_rel(per_node.collective_op_seconds(a2a(bytes, 8, 2, 8), iota(4)), 3 * (ae + S / 16 / 400e9));
}
