// Tests of the strategy generator: schedule orders written out by hand, placement/replication/sharding
// against the published directive fixtures, and one-line errors for bad knobs and programs.
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "piper/core/strategy.hpp"

using nlohmann::json;
using namespace piper::core;

namespace {

json load_fixture(const std::string& name) {
  std::ifstream in(std::string(PIPER_FIXTURES) + "/piper-directives/" + name);
  EXPECT_TRUE(in.good()) << name;
  return json::parse(in);
}

json only_ops(const json& program, const std::vector<std::string>& ops) {
  json out = json::array();
  for (const auto& d : program)
    for (const auto& op : ops)
      if (d["op"] == op) out.push_back(d);
  return out;
}

// Order directives of a program, indexed by the pipeline rank of their first filter's region.
std::vector<json> orders_by_rank(const json& program, const std::vector<int>& rank_of_region) {
  std::vector<json> orders;
  for (const auto& d : only_ops(program, {"order"})) {
    int rank = rank_of_region.at(d["filters"][0][0]["PP"].get<size_t>());
    if (static_cast<int>(orders.size()) <= rank) orders.resize(static_cast<size_t>(rank) + 1);
    orders[static_cast<size_t>(rank)] = d;
  }
  return orders;
}

// "F3" per group; every group must hold exactly one filter (total order).
std::vector<std::string> total_order(const json& order) {
  std::vector<std::string> seq;
  for (const auto& group : order["filters"]) {
    EXPECT_EQ(group.size(), 1u) << group.dump();
    seq.push_back(group[0]["PASS"].get<std::string>() + std::to_string(group[0]["MB"].get<int>()));
  }
  return seq;
}

template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

StrategyOptions fixture_options(int pp, int dp, int ep, int zero) {
  StrategyOptions o;
  o.pp = pp, o.dp = dp, o.ep = ep, o.zero = zero;
  o.microbatches = 2;
  o.pp_stream = "pp_stream";
  o.dp_stream = "dp_stream";
  o.ep_stream = "ep_stream";
  return o;
}

}  // namespace

TEST(Strategy, OneFOneBMatchesMegatronOrderForFourRanksEightMicrobatches) {
  StrategyOptions o;
  o.pp = 4, o.microbatches = 8, o.schedule = "1f1b";
  json program = generate_program(o).to_json();
  auto orders = orders_by_rank(program, {0, 1, 2, 3});
  ASSERT_EQ(orders.size(), 4u);
  ASSERT_EQ(only_ops(program, {"split"}).size(), 1u);
  EXPECT_EQ(only_ops(program, {"split"})[0]["num_microbatches"], 8);

  // Written out from the PipeDream-flush rule: rank 0 warms up with 3 forwards.
  const std::vector<std::string> rank0 = {"F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5",
                                          "B2", "F6", "B3", "F7", "B4", "B5", "B6", "B7"};
  const std::vector<std::string> rank1 = {"F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2",
                                          "F5", "B3", "F6", "B4", "F7", "B5", "B6", "B7"};
  const std::vector<std::string> rank3 = {"F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3",
                                          "F4", "B4", "F5", "B5", "F6", "B6", "F7", "B7"};
  EXPECT_EQ(total_order(orders[0]), rank0);
  EXPECT_EQ(total_order(orders[1]), rank1);
  EXPECT_EQ(total_order(orders[3]), rank3);

  for (int r = 0; r < 4; ++r) {
    // Forwards before the first backward: warmup (p-1-r) plus the first steady forward.
    auto seq = total_order(orders[static_cast<size_t>(r)]);
    int leading_forwards = 0;
    while (seq[static_cast<size_t>(leading_forwards)][0] == 'F') ++leading_forwards;
    EXPECT_EQ(leading_forwards, (4 - 1 - r) + 1) << "rank " << r;
    for (const auto& group : orders[static_cast<size_t>(r)]["filters"]) EXPECT_EQ(group[0]["PP"], r);
  }
}

TEST(Strategy, OneFOneBWithFewerMicrobatchesThanWarmup) {
  StrategyOptions o;
  o.pp = 4, o.microbatches = 2, o.schedule = "1f1b";
  auto orders = orders_by_rank(generate_program(o).to_json(), {0, 1, 2, 3});
  EXPECT_EQ(total_order(orders[0]), (std::vector<std::string>{"F0", "F1", "B0", "B1"}));
  EXPECT_EQ(total_order(orders[3]), (std::vector<std::string>{"F0", "B0", "F1", "B1"}));
}

TEST(Strategy, GPipeRunsAllForwardsThenAllBackwards) {
  StrategyOptions o;
  o.pp = 2, o.microbatches = 3, o.schedule = "gpipe";
  json program = generate_program(o).to_json();
  auto orders = orders_by_rank(program, {0, 1});
  ASSERT_EQ(orders.size(), 2u);
  const std::vector<std::string> expected = {"F0", "F1", "F2", "B0", "B1", "B2"};
  EXPECT_EQ(total_order(orders[0]), expected);
  EXPECT_EQ(total_order(orders[1]), expected);
  EXPECT_EQ(only_ops(program, {"split"})[0],
            json::parse(R"({"op":"split","filter":{},"dim_name":"MB","num_microbatches":3})"));
}

TEST(Strategy, PlacementMatchesPublishedFixtures) {
  const std::vector<std::string> ops = {"place", "replicate", "shard"};
  // The zero2/zero3 fixtures put the expert all-to-all on the data-parallel stream.
  auto zero2 = fixture_options(2, 2, 2, 2);
  zero2.ep_stream = "dp_stream";
  EXPECT_EQ(only_ops(generate_program(zero2).to_json(), ops), load_fixture("pp2_dp2_ep2_zero2.json"));
  auto zero3 = fixture_options(2, 2, 2, 3);
  zero3.ep_stream = "dp_stream";
  // ZeRO-3 adds one Piper field to the published program: FSDP's gather unit, a transformer block.
  json generated = only_ops(generate_program(zero3).to_json(), ops);
  for (auto& d : generated)
    if (d["op"] == "replicate") {
      EXPECT_EQ(d["gather_unit"], "block");
      d.erase("gather_unit");
    }
  EXPECT_EQ(generated, load_fixture("pp2_dp2_ep2_zero3.json"));
  EXPECT_EQ(only_ops(generate_program(fixture_options(2, 2, 2, 0)).to_json(), ops), load_fixture("pp2_dp2_ep2.json"));
  auto bucket = fixture_options(2, 2, 2, 0);
  bucket.bucket_mb = 100;
  EXPECT_EQ(only_ops(generate_program(bucket).to_json(), ops), load_fixture("pp2_dp2_ep2_bucket100.json"));
  EXPECT_EQ(only_ops(generate_program(fixture_options(1, 2, 1, 0)).to_json(), ops), load_fixture("dp2.json"));
}

TEST(Strategy, DevicesArePipelineRankPlusDataRankTimesPp) {
  StrategyOptions o;
  o.pp = 4, o.dp = 3;
  json places = only_ops(generate_program(o).to_json(), {"place"});
  ASSERT_EQ(places.size(), 4u);
  EXPECT_EQ(places[2]["filter"], json::parse(R"({"PP":2})"));
  EXPECT_EQ(places[2]["devices"], json::parse("[2, 6, 10]"));
  EXPECT_EQ(places[2]["stream"], "pp");
}

TEST(Strategy, ZeroOneAndPartialExpertSharding) {
  StrategyOptions o;
  o.pp = 1, o.dp = 4, o.ep = 2, o.zero = 1;
  json program = generate_program(o).to_json();
  json rep = only_ops(program, {"replicate"});
  ASSERT_EQ(rep.size(), 1u);
  EXPECT_EQ(rep[0], json::parse(R"({"op":"replicate","filter":{"PP":0},"devices":[0,1,2,3],
                                    "reduce_stream":"dp","shard_optimizer":true})"));
  json shard = only_ops(program, {"shard"});
  ASSERT_EQ(shard.size(), 1u);
  EXPECT_EQ(shard[0], json::parse(R"({"op":"shard","filter":{"PP":0,"EP":"*"},"devices":[0,1,2,3],
                                      "stream":"ep","degree":2})"));
}

TEST(Strategy, DpShardWritesTheShardGroupOnlyWhenItSplitsTheReplicas) {
  StrategyOptions o;
  o.pp = 1, o.dp = 4, o.zero = 3, o.dp_shard = 2;
  json rep = only_ops(generate_program(o).to_json(), {"replicate"});
  ASSERT_EQ(rep.size(), 1u);
  EXPECT_EQ(rep[0]["shard_group"], 2);
  o.dp_shard = 4;  // one group of every replica: plain ZeRO
  rep = only_ops(generate_program(o).to_json(), {"replicate"});
  ASSERT_EQ(rep.size(), 1u);
  EXPECT_FALSE(rep[0].contains("shard_group"));
  // TP 2 x DP 4: the shard groups count data-parallel replicas, not devices.
  o.tp = 2, o.dp_shard = 2;
  rep = only_ops(generate_program(o).to_json(), {"replicate"});
  ASSERT_EQ(rep.size(), 1u);
  EXPECT_EQ(rep[0]["shard_group"], 2);
  EXPECT_EQ(rep[0]["devices"].size(), 8u);
}

TEST(Strategy, NoDataParallelMeansNoReplicateOrShard) {
  StrategyOptions o;
  o.pp = 2;
  EXPECT_TRUE(only_ops(generate_program(o).to_json(), {"replicate", "shard"}).empty());
}

TEST(Strategy, RankOfRegionFromVPlacement) {
  int ranks = 0;
  json program = load_fixture("pp4_dp2_ep2_v_placement.json");
  auto rank_of_region = rank_of_region_from_program(parse_directives(program), &ranks);
  EXPECT_EQ(rank_of_region, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(ranks, 2);

  // 1F1B appended to the V placement: one order per PP region, each region ordered as a stage of a
  // 4-stage pipeline (warmup 3-k), so the two regions of a rank interleave by data dependencies.
  StrategyOptions o;
  o.pp = ranks, o.microbatches = 3, o.schedule = "1f1b";
  json sched = schedule_directives(o, rank_of_region).to_json();
  auto orders = only_ops(sched, {"order"});
  ASSERT_EQ(orders.size(), 4u);
  std::vector<std::vector<std::string>> expected = {
      {"F0", "F1", "F2", "B0", "B1", "B2"},   // region 0: warmup min(3, 3)
      {"F0", "F1", "F2", "B0", "B1", "B2"},   // region 1: warmup 2, one steady pair, then cooldown
      {"F0", "F1", "B0", "F2", "B1", "B2"},   // region 2: warmup 1
      {"F0", "B0", "F1", "B1", "F2", "B2"}};  // region 3: no warmup
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(total_order(orders[static_cast<size_t>(k)]), expected[static_cast<size_t>(k)]) << "region " << k;
    for (const auto& group : orders[static_cast<size_t>(k)]["filters"]) EXPECT_EQ(group[0]["PP"], k);
  }
}

TEST(Strategy, ErrorsAreOneLineAndNameTheFlag) {
  StrategyOptions o;
  o.dp = 4, o.ep = 3;
  EXPECT_EQ(error_of([&] { generate_program(o); }), "--ep 3 must divide --dp 4");

  StrategyOptions bad_zero;
  bad_zero.zero = 4;
  EXPECT_NE(error_of([&] { generate_program(bad_zero); }).find("--zero"), std::string::npos);

  StrategyOptions hsdp;
  hsdp.dp = 4, hsdp.dp_shard = 2;
  EXPECT_EQ(error_of([&] { generate_program(hsdp); }), "--dp-shard needs --zero 1, 2 or 3 (it groups the ZeRO shards)");
  hsdp.zero = 1, hsdp.dp_shard = 3;
  EXPECT_EQ(error_of([&] { generate_program(hsdp); }), "--dp-shard 3 must be at least 2 and divide --dp 4");
  hsdp.dp_shard = 1;
  EXPECT_EQ(error_of([&] { generate_program(hsdp); }), "--dp-shard 1 must be at least 2 and divide --dp 4");

  StrategyOptions no_mb;
  no_mb.microbatches = 0;
  EXPECT_NE(error_of([&] { generate_program(no_mb); }).find("--microbatches"), std::string::npos);

  ScheduleContext ctx;
  ctx.microbatches = 0;
  ctx.rank_of_region = {0};
  EXPECT_EQ(error_of([&] { schedule_family("1f1b").directives(ctx); }).rfind("1f1b: --microbatches must be >= 1", 0),
            0u);

  std::string unknown = error_of([&] { schedule_family("nope"); });
  EXPECT_NE(unknown.find("'nope'"), std::string::npos) << unknown;
  for (const auto& family : schedule_registry()) EXPECT_NE(unknown.find(family.name), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("gpipe"), std::string::npos);
  EXPECT_NE(unknown.find("1f1b"), std::string::npos);
  EXPECT_EQ(unknown.find('\n'), std::string::npos);
}

TEST(Strategy, RankOfRegionRejectsScheduledOrIncompletePrograms) {
  int ranks = 0;
  std::string scheduled = error_of(
      [&] { rank_of_region_from_program(parse_directives(load_fixture("pp2_dp2_ep2_custom_order.json")), &ranks); });
  EXPECT_NE(scheduled.find("program already has split/order directives; drop --schedule"), std::string::npos)
      << scheduled;

  json gap = json::parse(R"([{"op":"place","filter":{"PP":0},"devices":[0]},
                             {"op":"place","filter":{"PP":2},"devices":[1]}])");
  EXPECT_NE(error_of([&] { rank_of_region_from_program(parse_directives(gap), &ranks); }).find("PP 1"),
            std::string::npos);

  json none = json::parse(R"([{"op":"replicate","filter":{"PP":0},"devices":[0,1]}])");
  EXPECT_NE(error_of([&] { rank_of_region_from_program(parse_directives(none), &ranks); }).find("no place"),
            std::string::npos);
}
