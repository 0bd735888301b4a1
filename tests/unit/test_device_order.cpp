// --device-order (issue 23): how pipeline, data-parallel, context-parallel and tensor-parallel ranks
// fill the device numbers. tp-cp-pp-dp (the default) puts a replica's pipeline ranks on consecutive
// devices; tp-cp-dp-pp (Megatron-LM's default) puts a pipeline rank's replicas, and so its expert
// groups, on consecutive devices. Device lists derived by hand, the default's programs byte-identical
// to those of the generator before the setting existed, the refusals, a simulation where the order
// decides whether an expert group's all-to-all stays inside a node, and the host runtime's equivalence.
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/settings.hpp"
#include "piper/core/strategy.hpp"
#include "piper/core/verifier.hpp"
#include "piper/runtime/trainer.hpp"
#include "piper/search/tune.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/engine.hpp"
#include "shell.hpp"

using namespace piper::core;
using nlohmann::json;
namespace fs = std::filesystem;
namespace sim = piper::sim;
using piper::test::sh;

namespace {

const std::string kSource = PIPER_SOURCE_DIR;
const std::string kMegatron = "tp-cp-dp-pp";

// The devices of each `place {PP: i}` directive of a generated program, by region.
std::vector<std::vector<int>> placed_devices(const StrategyOptions& o) {
  const json j = generate_program(o).to_json();
  std::vector<std::vector<int>> out;
  for (const auto& d : j)
    if (d.at("op") == "place") out.push_back(d.at("devices").get<std::vector<int>>());
  return out;
}

StrategyOptions knobs(int pp, int dp, int tp, const std::string& order) {
  StrategyOptions o;
  o.pp = pp;
  o.dp = dp;
  o.tp = tp;
  o.microbatches = 4;
  o.device_order = order;
  return o;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// PP 2 x DP 2 x TP 2, 1F1B (region i on rank i), lists d-major then k.
// tp-cp-pp-dp: device k + 2 (r + 2 d): rank 0 -> d 0: 0, 1; d 1: 4, 5. Rank 1 -> 2, 3, 6, 7.
// tp-cp-dp-pp: device k + 2 (d + 2 r): rank 0 -> d 0: 0, 1; d 1: 2, 3. Rank 1 -> 4, 5, 6, 7.
TEST(DeviceOrder, DeviceListsByHand) {
  EXPECT_EQ(placed_devices(knobs(2, 2, 2, "tp-cp-pp-dp")), (std::vector<std::vector<int>>{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  EXPECT_EQ(placed_devices(knobs(2, 2, 2, kMegatron)), (std::vector<std::vector<int>>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  // With CP 2 (TP 1), PP 2, DP 2: tp-cp-dp-pp gives device c + 2 (d + 2 r): rank 0 -> 0, 1, 2, 3;
  // tp-cp-pp-dp gives c + 2 (r + 2 d): rank 0 -> 0, 1, 4, 5 (CP pairs stay adjacent either way).
  StrategyOptions cp = knobs(2, 2, 1, kMegatron);
  cp.cp = 2;
  EXPECT_EQ(placed_devices(cp), (std::vector<std::vector<int>>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  cp.device_order = "tp-cp-pp-dp";
  EXPECT_EQ(placed_devices(cp), (std::vector<std::vector<int>>{{0, 1, 4, 5}, {2, 3, 6, 7}}));
}

// device_of and ranks_of_device invert each other on every device of PP 3 x DP 2 x CP 2 x TP 2, in both
// orders, and device_of is a permutation of 0..23.
TEST(DeviceOrder, DeviceOfIsAPermutationAndRanksOfDeviceItsInverse) {
  for (const std::string order : {"tp-cp-pp-dp", "tp-cp-dp-pp"}) {
    StrategyOptions o = knobs(3, 2, 2, order);
    o.cp = 2;
    std::set<int> seen;
    for (int r = 0; r < 3; ++r)
      for (int d = 0; d < 2; ++d)
        for (int c = 0; c < 2; ++c)
          for (int k = 0; k < 2; ++k) {
            const int x = device_of(o, k, c, r, d);
            EXPECT_TRUE(seen.insert(x).second) << order << " device " << x << " twice";
            EXPECT_EQ(ranks_of_device(o, x), (DeviceRanks{k, c, r, d})) << order << " device " << x;
          }
    EXPECT_EQ(seen.size(), 24u);
    EXPECT_EQ(*seen.rbegin(), 23);
  }
  // Spot values from the formulas: k 1, c 0, r 2, d 1 -> tp-cp-pp-dp 1 + 2 (0 + 2 (2 + 1 x 3)) = 21,
  // tp-cp-dp-pp 1 + 2 (0 + 2 (1 + 2 x 2)) = 21 as well; k 0, c 1, r 1, d 0 -> 2 + 4 x 1 = 6 and
  // 2 + 4 x 2 = 10.
  StrategyOptions a = knobs(3, 2, 2, "tp-cp-pp-dp"), b = knobs(3, 2, 2, kMegatron);
  a.cp = b.cp = 2;
  EXPECT_EQ(device_of(a, 1, 0, 2, 1), 21);
  EXPECT_EQ(device_of(b, 1, 0, 2, 1), 21);
  EXPECT_EQ(device_of(a, 0, 1, 1, 0), 6);
  EXPECT_EQ(device_of(b, 0, 1, 1, 0), 10);
}

// DualPipe (mirrored) PP 4 x DP 2, EP 2: region i on rank i and its mirror on rank 3 - i.
// tp-cp-dp-pp: rank r holds devices d + 2 r = {2r, 2r + 1}: region 0 -> 0, 1 then rank 3's 6, 7;
// region 1 -> 2, 3, 4, 5; region 2 -> 4, 5, 2, 3; region 3 -> 6, 7, 0, 1. Each EP group (2 consecutive
// entries) is then a pair of adjacent devices. tp-cp-pp-dp: rank r holds r + 4 d = {r, r + 4}: region 0
// -> 0, 4, 3, 7.
TEST(DeviceOrder, MirroredDualPipeByHand) {
  StrategyOptions o = knobs(4, 2, 1, kMegatron);
  o.ep = 2;
  o.schedule = "dualpipe";
  o.microbatches = 8;  // DualPipe: even and >= 2 x pp
  EXPECT_EQ(placed_devices(o), (std::vector<std::vector<int>>{{0, 1, 6, 7}, {2, 3, 4, 5}, {4, 5, 2, 3}, {6, 7, 0, 1}}));
  const json j = generate_program(o).to_json();
  for (const auto& d : j)
    if (d.at("op") == "shard") {
      EXPECT_EQ(d.at("degree"), 2) << d.dump();  // groups of 2 consecutive entries
    }
  o.device_order = "tp-cp-pp-dp";
  EXPECT_EQ(placed_devices(o), (std::vector<std::vector<int>>{{0, 4, 3, 7}, {1, 5, 2, 6}, {2, 6, 1, 5}, {3, 7, 0, 4}}));
}

// The default order's programs are byte for byte those `piper directives` printed before the setting
// existed (tests/data/device-order/, written by the generator at commit 788be01), with the flag left out
// and with it given as the default.
TEST(DeviceOrder, DefaultIsByteIdenticalToTheGeneratorBefore) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"pp2-dp2-tp2-1f1b", "--pp 2 --dp 2 --tp 2 --microbatches 4"},
      {"pp2-dp2-ep2-dualpipe", "--pp 2 --dp 2 --ep 2 --schedule dualpipe --microbatches 4"},
      {"pp2-dp2-cp2-tp2-ep4-interleaved",
       "--pp 2 --dp 2 --cp 2 --tp 2 --ep 4 --zero 1 --schedule interleaved-1f1b --virtual 2 --microbatches 4"},
  };
  for (const auto& [name, flags] : cases) {
    const std::string before = piper::test::read_file(kSource + "/tests/data/device-order/" + name + ".json");
    ASSERT_FALSE(before.empty()) << name;
    for (const std::string extra : {"", " --device-order tp-cp-pp-dp"}) {
      const auto r = sh(std::string(PIPER_CLI) + " directives " + flags + extra + " 2>/dev/null");
      ASSERT_EQ(r.code, 0) << name << extra << ": " << r.output;
      EXPECT_EQ(r.output, before) << name << extra;
    }
    // And the other order does move devices.
    const auto other = sh(std::string(PIPER_CLI) + " directives " + flags + " --device-order tp-cp-dp-pp 2>/dev/null");
    ASSERT_EQ(other.code, 0) << other.output;
    EXPECT_NE(other.output, before) << name;
  }
}

// A bad value: one line naming the flag (CLI, validate_strategy_options) or the scenario key, with the
// allowed values; the default is not written to scenario files, the other value is.
TEST(DeviceOrder, BadValuesAreRefusedInOneLine) {
  StrategyOptions o = knobs(2, 2, 1, "pp-dp");
  EXPECT_EQ(message_of([&] { validate_strategy_options(o); }),
            "--device-order: unknown value 'pp-dp'; expected tp-cp-pp-dp or tp-cp-dp-pp");
  const auto cli = sh(std::string(PIPER_CLI) + " directives --pp 2 --dp 2 --device-order tp-dp-pp");
  EXPECT_NE(cli.code, 0);
  EXPECT_NE(cli.output.find("--device-order"), std::string::npos) << cli.output;
  EXPECT_NE(cli.output.find("{tp-cp-pp-dp,tp-cp-dp-pp}"), std::string::npos) << cli.output;  // CLI11 lists them
  EXPECT_EQ(std::count(cli.output.begin(), cli.output.end(), '\n'), 1) << cli.output;
  EXPECT_EQ(message_of([] {
              Scenario::from_json(json{{"model", "qwen3-9m"}, {"strategy", {{"device_order", "dp-pp"}}}}, "s.json");
            }),
            "s.json: field 'strategy.device_order': unknown value 'dp-pp'; expected tp-cp-pp-dp or tp-cp-dp-pp");
  EXPECT_FALSE(strategy_to_json(knobs(2, 2, 1, "tp-cp-pp-dp")).contains("device_order"));
  EXPECT_EQ(strategy_to_json(knobs(2, 2, 1, kMegatron)).at("device_order"), kMegatron);
}

namespace {

// A MoE whose all-to-alls carry most of the traffic: 4 blocks of 16 experts, top-8, hidden 1024,
// s = 1024, b = 2 (2,048 tokens per microbatch).
ModelConfig a2a_heavy_moe() {
  ModelConfig c;
  c.name = "device-order-moe";
  c.vocab = 1024;
  c.hidden = 1024;
  c.layers = 4;
  c.heads = 8;
  c.kv_heads = 8;
  c.head_dim = 128;
  c.ffn = 2048;
  c.experts = 16;
  c.top_k = 8;
  c.expert_ffn = 512;
  c.training.seq_len = 1024;
  c.training.micro_batch_size = 2;
  c.training.precision = Precision::BF16;
  return c;
}

struct Simulated {
  double step = 0;
  std::set<int> ep_group_nodes;  // how many nodes each EP group spans (the distinct counts)
};

Simulated simulate_moe(const std::string& order) {
  const std::string path = ::testing::TempDir() + "/device-order-moe-" + std::to_string(::getpid()) + ".json";
  write_file_atomically(path, config_to_spec_json(a2a_heavy_moe()).dump());
  Scenario s;
  s.model = path;
  s.strategy.pp = 2;
  s.strategy.dp = 8;
  s.strategy.ep = 8;
  s.strategy.microbatches = 4;
  s.strategy.device_order = order;
  const CompiledScenario compiled = compile_scenario(s);
  const auto program = std::make_shared<const Program>(compiled.result.program);
  EXPECT_TRUE(verify(*program).empty()) << order;
  const sim::Cluster cluster = sim::with_devices(sim::load_cluster("dgx-h100"), program->num_devices);
  Simulated out;
  for (const auto& d : compiled.program.to_json())
    if (d.at("op") == "shard") {
      const auto devices = d.at("devices").get<std::vector<int>>();
      for (std::size_t g = 0; g < devices.size(); g += 8) {
        std::set<int> nodes;
        for (std::size_t i = g; i < g + 8; ++i) nodes.insert(cluster.node_of(devices[i]));
        out.ep_group_nodes.insert(static_cast<int>(nodes.size()));
      }
    }
  const sim::CostModel cost(cluster);
  const Timeline t = sim::make_engine("analytic")->run(program, cluster, cost);
  for (const auto& dev : t.devices)
    for (const auto& span : dev.spans) out.step = std::max(out.step, span.end_s);
  return out;
}

}  // namespace

// PP 2 x DP 8, EP 8 on 16 GPUs of dgx-h100 (two nodes of 8; NVLink 450 GB/s per GPU, 50 GB/s of
// InfiniBand per GPU). tp-cp-dp-pp gives rank r the devices 8 r .. 8 r + 7: one node, so each EP group
// of 8 is a whole node and its dispatch/combine all-to-alls (per block and microbatch, 2,048 tokens x
// top-8 x 1,024 x 2 bytes = 32 MiB each way, four times: F dispatch and combine, B both) run on NVLink.
// tp-cp-pp-dp gives rank r the devices r + 2 d: the even devices, four on each node, so each EP group
// spans both nodes and half of every device's all-to-all bytes cross InfiniBand, 9x slower than NVLink.
// The pipeline transfer moves the other way (inside a node -> across nodes) but carries one activation
// of 2,048 x 1,024 x 2 bytes = 4 MiB per microbatch and direction, an eighth of one all-to-all; the
// gradient all-reduce of the dense layers also stays inside a node under tp-cp-dp-pp. So the step
// is shorter under tp-cp-dp-pp.
TEST(DeviceOrder, ExpertGroupsInsideANodeMakeTheStepShorter) {
  const Simulated megatron = simulate_moe(kMegatron), piper = simulate_moe("tp-cp-pp-dp");
  EXPECT_EQ(megatron.ep_group_nodes, (std::set<int>{1}));
  EXPECT_EQ(piper.ep_group_nodes, (std::set<int>{2}));
  ASSERT_GT(megatron.step, 0);
  EXPECT_LT(megatron.step, piper.step) << "tp-cp-dp-pp " << megatron.step << " s, tp-cp-pp-dp " << piper.step << " s";
}

// The tuner's rank orders in tp-cp-dp-pp: device group g is then the devices d + dp g (one node each
// here), so a relabelled program moves whole groups, and on a cluster whose nodes differ the groups
// differ too (in tp-cp-pp-dp each group r + 2 d has devices on both nodes, so all groups are alike).
TEST(DeviceOrder, TunerRankOrdersFollowTheDeviceOrder) {
  namespace search = piper::search;
  search::TuneSpec spec;
  spec.model = "qwen3-1b";
  spec.devices = 16;
  spec.seq_len = 1024;
  spec.global_batch = 16;
  search::TuneCandidate c;
  c.pp = 2, c.dp = 8, c.schedule = "1f1b", c.microbatches = 2, c.micro_batch_size = 1;
  c.device_order = kMegatron;
  search::TuneCandidate reversed = c;
  reversed.rank_order = {1, 0};
  // Rank 0 on group 1 = devices d + 8 x 1 = 8..15, rank 1 on group 0 = 0..7.
  std::vector<std::vector<int>> places;
  for (const auto& d : search::tune_directives(spec, reversed))
    if (d.value("op", "") == "place") places.push_back(d.at("devices").get<std::vector<int>>());
  EXPECT_EQ(places, (std::vector<std::vector<int>>{{8, 9, 10, 11, 12, 13, 14, 15}, {0, 1, 2, 3, 4, 5, 6, 7}}));

  const fs::path cluster = fs::temp_directory_path() / ("piper-device-order-" + std::to_string(::getpid()) + ".json");
  std::ofstream(cluster)
      << R"({"name": "mixed", "preset": "dgx-h200", "nodes": 2, "fixed": true, "overrides": [{"nodes": [1], "gpu": "a100-sxm-80g"}]})";
  spec.cluster = cluster.string();
  const auto variants = search::rank_order_variants(spec, c);
  ASSERT_FALSE(variants.empty()) << "group 0 is node 0 (H200), group 1 node 1 (A100)";
  EXPECT_EQ(variants.front().device_order, kMegatron);
  search::TuneCandidate plain = c;
  plain.device_order = "tp-cp-pp-dp";
  EXPECT_TRUE(search::rank_order_variants(spec, plain).empty()) << "every group has 4 H200s and 4 A100s";
  fs::remove(cluster);
}

// piper tune proposes Megatron's order for its leaders with PP and EP where it puts an expert group on
// fewer nodes: PP 2 x DP 8 x EP 8 on two 8-GPU nodes (the group of 8 on one node instead of two, as in
// ExpertGroupsInsideANodeMakeTheStepShorter), not on one node (8 devices: a group is inside it either
// way), not without EP, not twice. The variant simulates faster, and a search over that space ranks it
// first.
TEST(DeviceOrder, TunerTriesMegatronsOrderWhereExpertGroupsSpanNodes) {
  namespace search = piper::search;
  const std::string path = ::testing::TempDir() + "/device-order-tune-" + std::to_string(::getpid()) + ".json";
  write_file_atomically(path, config_to_spec_json(a2a_heavy_moe()).dump());
  search::TuneSpec spec;
  spec.model = path;
  spec.cluster = "dgx-h100";
  spec.devices = 16;
  spec.global_batch = 32;
  search::TuneCandidate c;
  c.pp = 2, c.dp = 8, c.ep = 8, c.schedule = "1f1b", c.microbatches = 4, c.micro_batch_size = 1;
  const auto variants = search::device_order_variants(spec, c);
  ASSERT_EQ(variants.size(), 1u);
  EXPECT_EQ(variants[0].device_order, kMegatron);
  EXPECT_EQ(variants[0].placement, "Megatron's device order");
  EXPECT_TRUE(search::device_order_variants(spec, variants[0]).empty());
  search::TuneCandidate dense = c;
  dense.ep = 1;
  EXPECT_TRUE(search::device_order_variants(spec, dense).empty());
  search::TuneSpec one_node = spec;
  one_node.devices = 8;
  search::TuneCandidate small = c;
  small.dp = small.ep = 4;
  EXPECT_TRUE(search::device_order_variants(one_node, small).empty());

  const search::TuneRow plain = search::evaluate_candidate(spec, c, "analytic");
  const search::TuneRow megatron = search::evaluate_candidate(spec, variants[0], "analytic");
  ASSERT_EQ(megatron.status, "ok") << megatron.reason;
  EXPECT_LT(megatron.step_time_s, plain.step_time_s);

  spec.pp_degrees = {2};
  spec.ep_degrees = {8};
  spec.tp_degrees = {1};
  spec.schedules = {"1f1b"};
  spec.recompute_modes = {"none"};
  spec.sequence_parallel = {false};
  spec.zero_levels = {0};
  spec.micro_batch_sizes = {1};
  spec.top_k = 0;
  const fs::path csv = fs::temp_directory_path() / ("piper-device-order-tune-" + std::to_string(::getpid()) + ".csv");
  const search::TuneSummary summary = search::run_tune(spec, csv.string());
  ASSERT_FALSE(summary.ranked.empty());
  EXPECT_EQ(summary.ranked.front().candidate.device_order, kMegatron) << summary.ranked.front().candidate.describe();
  fs::remove(csv);
}

namespace {

const std::string kTinyMoe = kSource + "/tests/data/runtime-tiny-moe.json";

// As test_runtime.cpp's expect_equivalent: the plan run over mpirun against the single-process
// reference, 3 AdamW steps (tolerances explained there).
void expect_equivalent(const std::string& name, int ranks, const StrategyOptions& o) {
  const fs::path dir = fs::temp_directory_path() / ("piper-device-order-" + std::to_string(::getpid())) / name;
  fs::create_directories(dir);
  Scenario s;
  s.model = kTinyMoe;
  s.strategy = o;
  const fs::path plan = dir / "plan.json";
  std::ofstream(plan) << compile_scenario(s).result.program.to_json().dump();
  const std::string common = " run --plan " + plan.string() + " --steps 3 --lr 3e-3 --adam-eps 1e-6 --seed 7";
  const auto ref = sh(std::string(PIPER_CLI) + common + " --reference --report " + (dir / "ref.json").string() +
                      " --dump-params " + (dir / "ref.bin").string());
  ASSERT_EQ(ref.code, 0) << ref.output;
  const auto run = sh(piper::test::mpirun(ranks) + PIPER_CLI + common + " --report " + (dir / "run.json").string() +
                      " --dump-params " + (dir / "run.bin").string());
  ASSERT_EQ(run.code, 0) << run.output;
  const auto losses = [](const fs::path& p) {
    std::ifstream in(p);
    return json::parse(in).at("losses").get<std::vector<double>>();
  };
  const auto a = losses(dir / "ref.json"), b = losses(dir / "run.json");
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * std::abs(a[i])) << name << " step " << i;
  EXPECT_LT(piper::runtime::max_param_difference((dir / "ref.bin").string(), (dir / "run.bin").string()), 1e-4);
  std::error_code ec;
  fs::remove_all(dir.parent_path(), ec);
}

}  // namespace

// tp-cp-dp-pp plans run on the host runtime: 1F1B PP 2 x DP 2 x EP 2 with ZeRO-1, and the mirrored
// DualPipeV, each matching the single-process reference.
TEST(DeviceOrderRuntimeEquivalence, OneFOneB_PP2xDP2xEP2_Zero1) {
  StrategyOptions o = knobs(2, 2, 1, kMegatron);
  o.ep = 2;
  o.zero = 1;
  expect_equivalent("1f1b", 4, o);
}

TEST(DeviceOrderRuntimeEquivalence, DualPipeV_PP2xDP2xEP2) {
  StrategyOptions o = knobs(2, 2, 1, kMegatron);
  o.ep = 2;
  o.schedule = "dualpipev";
  expect_equivalent("dualpipev", 4, o);
}
