// Tests of scenarios: the one JSON file that decides a Program, shared by the CLI, GUI and sweeps.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <vector>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"
#include "piper/core/program.hpp"
#include "piper/core/scenario.hpp"

using namespace piper::core;
using nlohmann::json;

TEST(Scenario, JsonRoundTripKeepsEveryField) {
  Scenario s;
  s.model = "qwen3-9m";
  s.seq_len = 128;
  s.micro_batch_size = 2;
  s.stage_starts = {0, 2};
  s.strategy.pp = 2;
  s.strategy.dp = 2;
  s.strategy.ep = 2;
  s.strategy.zero = 1;
  s.strategy.dp_shard = 2;
  s.strategy.microbatches = 4;
  s.cluster = "dgx-h200";
  const Scenario back = Scenario::from_json(s.to_json(), "test");
  EXPECT_EQ(back.to_json(), s.to_json());
  EXPECT_EQ(back.stage_starts, (std::vector<int>{0, 2}));
  EXPECT_EQ(back.strategy.dp_shard, 2);
}

// HSDP through the whole compiler: each device keeps the state of one shard of its group of 2, so
// every sharded persistent buffer is twice its plain ZeRO-3 size over 4 replicas (up to the integer
// division of odd sizes), and the Program records the shard count and survives its JSON round trip.
TEST(Scenario, HybridShardingSizesTheStateByTheShardGroup) {
  auto compiled = [](int dp_shard) {
    Scenario s;
    s.model = "qwen3-9m";
    s.strategy.pp = 2, s.strategy.dp = 4, s.strategy.zero = 3, s.strategy.microbatches = 4;
    s.strategy.dp_shard = dp_shard;
    return compile_scenario(s).result.program;
  };
  const Program plain = compiled(0), hsdp = compiled(2);
  ASSERT_EQ(plain.plans.size(), hsdp.plans.size());
  int compared = 0;
  for (std::size_t p = 0; p < plain.plans.size(); ++p) {
    const auto& a = plain.plans[p].buffers;
    const auto& b = hsdp.plans[p].buffers;
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (!a[i].persistent()) continue;
      ASSERT_EQ(a[i].name, b[i].name);
      EXPECT_NEAR(static_cast<double>(b[i].bytes), 2.0 * static_cast<double>(a[i].bytes), 2.0) << a[i].name;
      ++compared;
    }
  }
  EXPECT_GT(compared, 0);
  int hybrid = 0;
  for (const auto& seg : hsdp.segments)
    if (seg.params > 0 && seg.replicas > 1) {
      EXPECT_EQ(seg.replicas, 4);
      EXPECT_EQ(seg.zero_shards, 2);
      ++hybrid;
    }
  EXPECT_GT(hybrid, 0);
  const Program back = Program::from_json(hsdp.to_json());
  EXPECT_TRUE(back == hsdp);
  json bad = hsdp.to_json();
  for (auto& seg : bad["segments"])
    if (seg.contains("zero_shards")) seg["zero_shards"] = 3;
  try {
    (void)Program::from_json(bad);
    ADD_FAILURE() << "no error for zero_shards 3 of 4 replicas";
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("zero_shards': 3 does not divide the 4 replicas"), std::string::npos)
        << e.what();
  }
}

TEST(Scenario, ExplicitPipelineRangesReplaceBalancing) {
  Scenario s;
  s.model = "qwen3-9m";
  s.stage_starts = {0, 3};  // blocks 0-2 on PP0, block 3 (+ head) on PP1
  s.strategy.pp = 2;
  s.strategy.microbatches = 2;
  const auto c = compile_scenario(s);
  for (const auto& layer : c.model.layers())
    if (layer.block >= 0) {
      EXPECT_EQ(layer.tags.at("PP"), layer.block < 3 ? 0 : 1) << layer.name;
    }
  EXPECT_EQ(c.result.program.num_devices, 2);
}

TEST(Scenario, ErrorsNameTheFieldOrFlag) {
  auto message = [](auto fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(message([] {
              Scenario::from_json(json{{"model", "qwen3-9m"}, {"stages", 0}}, "s.json");
            }),
            "s.json: field 'stages': must be an integer >= 1");
  EXPECT_EQ(message([] {
              Scenario::from_json(json{{"modle", "x"}}, "s.json");
            }),
            "s.json: field 'modle': unknown field (did you mean 'model'?)");
  Scenario s;
  s.model = "llama3-8b";
  s.strategy.ep = 2;
  EXPECT_NE(message([&] { compile_scenario(s); }).find("--ep 2"), std::string::npos);
  s.strategy.ep = 1;
  s.stage_starts = {0, 40};
  EXPECT_NE(message([&] { compile_scenario(s); }).find("past the last block"), std::string::npos);
}

TEST(Scenario, GeneratedProgramsSkipShardingRegionsWithoutExperts) {
  // tiny-moe's first block is dense: with DualPipeV over 2 ranks (4 regions, one block each) region 0
  // has no experts, so the generated program must not ask to shard it.
  Scenario s;
  s.model = std::string(PIPER_SOURCE_DIR) + "/examples/models/tiny-moe.json";
  s.strategy.schedule = "dualpipev";
  s.strategy.pp = 2;
  s.strategy.dp = 2;
  s.strategy.ep = 2;
  s.strategy.microbatches = 4;
  const auto c = compile_scenario(s);
  int shards = 0;
  for (const auto& d : c.program.to_json()) shards += d["op"] == "shard";
  EXPECT_EQ(shards, 3);  // regions 1, 2 and 3 hold experts
  EXPECT_EQ(c.result.program.num_devices, 4);
}

// Tied embeddings across stages: the last stage keeps its own copy of the token table (Megatron's
// embedding group; the host runtime does the same), with its gradient and optimizer state, so its plan
// holds V*h more parameters per TP rank: gpt-small (V 50,257, h 768, bf16 parameters and gradients
// (its spec keeps no fp32 main grads), 12 bytes of AdamW state per parameter). One stage shares the
// table; a V placement (ZB-V: rank 0 holds the first and the last region) keeps the copy, as the
// runtime does (two segments, summed locally).
TEST(Scenario, TiedEmbeddingCopyIsCostedOnTheHeadsStage) {
  auto copy_bytes = [](int pp, const std::string& schedule, int tp, int dp, int zero) {
    Scenario s;
    s.model = std::string(PIPER_SOURCE_DIR) + "/examples/models/gpt-small.json";
    s.strategy.pp = pp, s.strategy.tp = tp, s.strategy.dp = dp, s.strategy.zero = zero;
    s.strategy.schedule = schedule, s.strategy.microbatches = 2 * pp;
    if (schedule == "zb-v") s.strategy.virtual_stages = 2;
    const Program p = compile_scenario(s).result.program;
    std::map<BufferKind, std::int64_t> bytes;
    int plans_with_copy = 0;
    for (const auto& plan : p.plans) {
      bool has = false;
      for (const auto& b : plan.buffers)
        if (b.name.find("tied embedding copy") != std::string::npos) bytes[b.kind] += b.bytes, has = true;
      plans_with_copy += has;
    }
    EXPECT_LE(plans_with_copy, 1) << pp << " " << schedule;
    return bytes;
  };
  const std::int64_t table = 50257LL * 768;
  auto two = copy_bytes(2, "1f1b", 1, 1, 0);
  EXPECT_EQ(two[BufferKind::Parameters], table * 2);
  EXPECT_EQ(two[BufferKind::Gradients], table * 2);
  EXPECT_EQ(two[BufferKind::OptimizerStates], table * 12);
  // Vocabulary-parallel rows: half of the vocabulary padded to a multiple of 2, 25,129 rows per TP rank.
  auto tp2 = copy_bytes(2, "1f1b", 2, 1, 0);
  EXPECT_EQ(tp2[BufferKind::Parameters], 25129LL * 768 * 2);
  auto zero1 = copy_bytes(2, "1f1b", 1, 2, 1);  // ZeRO-1 over 2 replicas shards the copy's state too
  EXPECT_EQ(zero1[BufferKind::Parameters], table * 2);
  EXPECT_EQ(zero1[BufferKind::OptimizerStates], table * 12 / 2);
  EXPECT_TRUE(copy_bytes(1, "1f1b", 1, 1, 0).empty());
  auto v = copy_bytes(2, "zb-v", 1, 1, 0);
  EXPECT_EQ(v[BufferKind::Parameters], table * 2);
  EXPECT_EQ(v[BufferKind::OptimizerStates], table * 12);
}

// The two copies' gradients are summed by a plan op: one ALL_REDUCE per device over the pair
// (embedding device p, head device p), of the copy's V*h gradient elements, after the device's last
// backward of its segment and before every reduction and update of that segment on the device. None
// for one stage or a V placement (one device holds both: a local sum). A mirrored placement (DualPipe:
// a device holds the embedding of one replica and the head of another) cannot be paired: the
// compiler refuses it in one line naming the layout, rather than emit a plan without the sum.
TEST(Scenario, TiedCopiesAreSummedByAPairAllReduce) {
  auto compile = [](int pp, int dp, int zero, const std::string& schedule) {
    Scenario s;
    s.model = std::string(PIPER_SOURCE_DIR) + "/examples/models/gpt-small.json";
    s.strategy.pp = pp, s.strategy.dp = dp, s.strategy.zero = zero, s.strategy.schedule = schedule;
    s.strategy.microbatches = 2 * pp;
    if (schedule == "zb-v") s.strategy.virtual_stages = 2;
    return compile_scenario(s).result.program;
  };
  auto tied_family = [](const Program& p) {
    int found = -1;
    for (std::size_t f = 0; f < p.families.size(); ++f)
      if (p.families[f].purpose == FamilyPurpose::TiedEmbedding) found = static_cast<int>(f);
    return found;
  };
  for (int zero : {0, 2}) {
    SCOPED_TRACE(zero);
    const Program p = compile(2, 2, zero, "1f1b");
    const int fam = tied_family(p);
    ASSERT_GE(fam, 0);
    int embed = -1, head = -1;
    for (std::size_t s = 0; s < p.segments.size(); ++s) {
      if (p.segments[s].first_layer == 0) embed = static_cast<int>(s);
      if (p.segments[s].last_layer == p.segments.back().last_layer) head = static_cast<int>(s);
    }
    ASSERT_NE(embed, head);
    const auto& de = p.device_sets.at(static_cast<std::size_t>(p.segments[static_cast<std::size_t>(embed)].devices));
    const auto& dh = p.device_sets.at(static_cast<std::size_t>(p.segments[static_cast<std::size_t>(head)].devices));
    ASSERT_EQ(de.size(), 2u);
    for (std::size_t i = 0; i < de.size(); ++i) {
      EXPECT_EQ(p.group_of(fam, de[i]), (std::vector<int>{de[i], dh[i]}));
      EXPECT_EQ(p.group_of(fam, dh[i]), (std::vector<int>{de[i], dh[i]}));
    }
    for (int d = 0; d < p.num_devices; ++d) {
      const Plan& plan = p.plan_for(d);
      const int mine = std::find(de.begin(), de.end(), d) != de.end() ? embed : head;
      std::vector<OpRef> sums;
      OpRef last_backward{-1, -1};
      for (int st = 0; st < static_cast<int>(plan.streams.size()); ++st)
        for (int i = 0; i < static_cast<int>(plan.streams[static_cast<std::size_t>(st)].ops.size()); ++i) {
          const Op& op = plan.streams[static_cast<std::size_t>(st)].ops[static_cast<std::size_t>(i)];
          if (op.family == fam) sums.push_back({st, i});
          if (op.kind == OpKind::Compute && op.segment == mine && op.pass == Pass::B) last_backward = {st, i};
        }
      ASSERT_EQ(sums.size(), 1u) << "device " << d;
      const Op& sum =
          plan.streams[static_cast<std::size_t>(sums[0].stream)].ops[static_cast<std::size_t>(sums[0].index)];
      EXPECT_EQ(sum.bytes, 50257LL * 768 * 2);  // bf16 gradients (no fp32 main grads in this spec)
      EXPECT_NE(std::find(sum.waits.begin(), sum.waits.end(), last_backward), sum.waits.end()) << "device " << d;
      int readers = 0;
      for (const auto& st : plan.streams)
        for (const auto& op : st.ops) {
          const bool reads = op.kind == OpKind::Update || op.kind == OpKind::ReduceScatter ||
                             (op.kind == OpKind::AllReduce && op.family != fam);
          if (!reads || std::find(op.segments.begin(), op.segments.end(), mine) == op.segments.end()) continue;
          ++readers;
          EXPECT_NE(std::find(op.waits.begin(), op.waits.end(), sums[0]), op.waits.end())
              << op.label << " on device " << d;
        }
      // Its data-parallel reduction (ZeRO-2: one per microbatch, 2·pp = 4 here) and its update.
      EXPECT_EQ(readers, (zero >= 2 ? 4 : 1) + 1) << "device " << d;
    }
  }
  EXPECT_LT(tied_family(compile(1, 2, 0, "1f1b")), 0);
  EXPECT_LT(tied_family(compile(2, 1, 0, "zb-v")), 0);
  try {
    compile(2, 2, 0, "dualpipe");
    ADD_FAILURE() << "a mirrored tied placement compiled";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "directives: the tied embedding (segment 0, on [0,2,1,3]) and the head's copy (segment 1, on "
                 "[1,3,0,2]) are placed "
                 "mirrored (device 1 holds the embedding at position 2 and the head at 0): the two copies cannot be "
                 "paired for their "
                 "gradient sum (untie the embeddings, or place the head's segment at the embedding's positions)");
  }
}

// Layouts the pair all-reduce cannot serve are refused, not compiled without the sum: sets sharing
// only some devices (here the head's stage on [2,1], the embedding's on [0,1]).
TEST(Scenario, TiedCopiesOnSetsSharingSomeDevicesAreRefused) {
  Scenario s;
  s.model = std::string(PIPER_SOURCE_DIR) + "/examples/models/gpt-small.json";
  s.stages = 2;
  s.directives = json::parse(R"([
    {"op": "split", "filter": {}, "num_microbatches": 2},
    {"op": "place", "filter": {"PP": 0}, "devices": [0, 1]},
    {"op": "place", "filter": {"PP": 1}, "devices": [2, 1]},
    {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1]},
    {"op": "replicate", "filter": {"PP": 1}, "devices": [2, 1]}])");
  try {
    compile_scenario(s);
    ADD_FAILURE() << "tied copies on [0,1] and [2,1] compiled";
  } catch (const Error& e) {
    EXPECT_EQ(
        std::string(e.what()).find(
            "directives: the tied embedding (segment 0, on [0,1]) and the head's copy (segment 1, on [2,1]) share "
            "some devices but not all: the two copies cannot be paired for their gradient sum"),
        0u)
        << e.what();
  }
}

// The copy is state like the head's own weight: with the head on its own stage, a tied model's head
// stage reduces, updates and accumulates as many gradient elements as the untied model's (whose head
// owns a V*h matrix). Read from the plans: the head stage's data-parallel ALL_REDUCE bytes, its UPD's
// memory traffic and FLOPs, and its backward's elementwise (fp32 main-grad) traffic.
TEST(Scenario, TiedCopyIsReducedAndUpdatedLikeAnUntiedHead) {
  json spec = json::parse(read_input_file(std::string(PIPER_SOURCE_DIR) + "/examples/models/gpt-small.json"));
  spec["training"]["fp32_main_grads"] = true;
  const std::string dir = ::testing::TempDir();
  const std::string tied = dir + "/gpt-small-tied-" + std::to_string(::getpid()) + ".json";
  const std::string untied = dir + "/gpt-small-untied-" + std::to_string(::getpid()) + ".json";
  write_file_atomically(tied, spec.dump());
  spec["tie_embeddings"] = false;
  write_file_atomically(untied, spec.dump());
  struct HeadStage {
    std::int64_t reduced = 0, upd_bytes = 0, backward_elementwise = 0;
    double upd_flops = 0;
  };
  auto head_stage = [](const std::string& model) {
    Scenario s;
    s.model = model;
    s.strategy.pp = 2, s.strategy.dp = 2, s.strategy.microbatches = 4;
    const Program p = compile_scenario(s).result.program;
    HeadStage h;
    const Plan& plan = p.plan_for(p.num_devices - 1);  // the last device holds the last stage
    for (const auto& st : plan.streams)
      for (const auto& op : st.ops) {
        if (op.kind == OpKind::AllReduce &&
            p.families.at(static_cast<std::size_t>(op.family)).purpose != FamilyPurpose::TiedEmbedding)
          h.reduced += op.bytes;
        if (op.kind == OpKind::Update) h.upd_bytes += op.memory_bytes, h.upd_flops += op.flops;
        if (op.kind == OpKind::Compute && op.pass == Pass::B) h.backward_elementwise += op.elementwise_bytes;
      }
    return h;
  };
  const HeadStage a = head_stage(tied), b = head_stage(untied);
  EXPECT_GT(a.reduced, 50257LL * 768 * 4);  // at least the copy's fp32 gradient
  EXPECT_EQ(a.reduced, b.reduced);
  EXPECT_EQ(a.upd_bytes, b.upd_bytes);
  EXPECT_EQ(a.upd_flops, b.upd_flops);
  EXPECT_EQ(a.backward_elementwise, b.backward_elementwise);
}

// A misspelt key inside a section (here strategy) is an error with the nearest valid key, not ignored.
TEST(Scenario, UnknownKeysInsideStrategyAreRejectedWithTheNearestKey) {
  auto message = [](const json& j) {
    try {
      Scenario::from_json(j, "s.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(message(json{{"model", "qwen3-9m"}, {"strategy", {{"pp", 2}, {"microbatchs", 4}}}}),
            "s.json: field 'strategy.microbatchs': unknown field (did you mean 'microbatches'?)");
  EXPECT_EQ(message(json{{"model", "qwen3-9m"}, {"strategy", {{"global_bach", 64}}}}),
            "s.json: field 'strategy.global_bach': unknown field (did you mean 'global_batch'?)");
  // Nothing near: the message lists the valid keys.
  const std::string far = message(json{{"model", "qwen3-9m"}, {"strategy", {{"learning_rate", 1}}}});
  EXPECT_NE(far.find("field 'strategy.learning_rate': unknown field (expected one of: pp, dp,"), std::string::npos)
      << far;
  EXPECT_EQ(message(json{{"model", "qwen3-9m"}, {"strategy", {{"pp", 2}, {"microbatches", 4}}}}), "(no error)");
}

// Errors in a program generated from strategy flags name the flag the user wrote, not the directive
// and field of a program they never saw.
TEST(Scenario, ErrorsOfAGeneratedProgramNameTheFlag) {
  Scenario s;
  s.model = "qwen3-9m";
  s.strategy.tp = 3;
  s.strategy.schedule = "1f1b";
  std::string message = "(no error)";
  try {
    compile_scenario(s);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_EQ(message.rfind("--tp 3: 3 does not divide the", 0), 0u) << message;
  EXPECT_EQ(message.find("directive"), std::string::npos) << message;
}

// More PP regions than the model has blocks: the error names --pp, not the balancer's internal name.
TEST(Scenario, TooManyRegionsNameTheFlagNotTheBalancer) {
  Scenario s;
  s.model = "qwen3-9m";
  s.strategy.pp = 64;
  s.strategy.schedule = "1f1b";
  s.strategy.microbatches = 64;
  std::string message = "(no error)";
  try {
    compile_scenario(s);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_EQ(message.find("balance_pipeline"), std::string::npos) << message;
  EXPECT_NE(message.find("--pp 64"), std::string::npos) << message;
}
