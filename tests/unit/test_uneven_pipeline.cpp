// Uneven pipelines (issue 26): first/last PP regions with their own block counts (Megatron's
// --decoder-first/last-pipeline-num-layers) and interleaved schedules whose ranks hold different
// numbers of chunks (regions not a multiple of --pp). Layer-to-rank maps and a step time derived by
// hand; every uneven shape up to p = 5 compiles and verifies (no deadlock).
#include <unistd.h>

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "piper/core/compiler.hpp"
#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"
#include "piper/sim/simulate.hpp"
#include "unit_costs.hpp"

using namespace piper::core;

namespace {

const std::string kDense = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-dense.json";  // 4 blocks

// The pipeline rank (first device of the set: dp = tp = 1) of every transformer block.
std::map<int, int> rank_of_block(const Scenario& sc) {
  const CompiledScenario c = compile_scenario(sc);
  const Program& p = c.result.program;
  std::map<int, int> out;
  for (const auto& seg : p.segments)
    for (int l = seg.first_layer; l < seg.last_layer; ++l)
      if (int b = c.model.layers().at(static_cast<std::size_t>(l)).block; b >= 0)
        out[b] = p.device_sets.at(static_cast<std::size_t>(seg.devices)).at(0);
  return out;
}

// The zoo's qwen3-9m with 14 blocks instead of 4 (a spec file per process).
std::string deep_model() {
  static const std::string path = [] {
    ModelConfig c = load_model_config("qwen3-9m");
    c.layers = 14;
    c.name = "qwen3-9m-14";
    const std::string file = ::testing::TempDir() + "/uneven-" + std::to_string(::getpid()) + ".json";
    write_file_atomically(file, config_to_spec_json(c).dump());
    return file;
  }();
  return path;
}

Scenario scenario(int pp, int microbatches, const std::string& schedule, int stages = 0) {
  Scenario sc;
  sc.model = deep_model();
  sc.stages = stages;
  sc.strategy.pp = pp, sc.strategy.microbatches = microbatches, sc.strategy.schedule = schedule;
  return sc;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(UnevenPipeline, FirstAndLastStageStarts) {
  // 8 blocks, 4 regions, first 1, last 1: the two middle regions take 3 each.
  EXPECT_EQ(first_last_stage_starts(8, 4, 1, 1), (std::vector<int>{0, 1, 4, 7}));
  // Only the first fixed: 10 blocks, first 1, the other 3 regions 3 each.
  EXPECT_EQ(first_last_stage_starts(10, 4, 1, 0), (std::vector<int>{0, 1, 4, 7}));
  // Only the last: 7 blocks, 3 regions, last 1: 3 + 3 + 1.
  EXPECT_EQ(first_last_stage_starts(7, 3, 0, 1), (std::vector<int>{0, 3, 6}));
  EXPECT_EQ(error_of([] { first_last_stage_starts(8, 4, 1, 2); }),
            "--first-stage-layers 1 --last-stage-layers 2: the other 5 blocks do not divide evenly over the other 2 PP "
            "regions");
  EXPECT_EQ(error_of([] { first_last_stage_starts(4, 3, 2, 2); }),
            "--first-stage-layers 2 --last-stage-layers 2: leaves 0 blocks of 4 for the other 1 PP regions (at least "
            "one each)");
  EXPECT_EQ(error_of([] { first_last_stage_starts(4, 1, 2, 0); }),
            "--first-stage-layers 2: needs at least 2 PP regions (there are 1)");
}

// 1F1B on 4 ranks over 14 blocks: the first rank takes 1 block, the last 1, the two middle ranks 6
// each.
TEST(UnevenPipeline, FirstAndLastStageLayersPlaceBlocks) {
  Scenario sc = scenario(4, 4, "1f1b");
  const int blocks = 14;
  sc.first_stage_layers = 1, sc.last_stage_layers = 1;
  const auto ranks = rank_of_block(sc);
  ASSERT_EQ(static_cast<int>(ranks.size()), blocks);
  const int middle = 6;
  for (const auto& [block, rank] : ranks) {
    const int expected = block == 0 ? 0 : block == blocks - 1 ? 3 : 1 + (block - 1) / middle;
    EXPECT_EQ(rank, expected) << "block " << block;
  }
  // Interleaved, 8 regions (region k on rank k mod 4): region 0 = block 0, regions 1..6 two blocks
  // each (blocks 1-2, 3-4, ..., 11-12), region 7 = block 13.
  Scenario il = scenario(4, 4, "interleaved-1f1b");
  il.strategy.virtual_stages = 2;
  il.first_stage_layers = 1, il.last_stage_layers = 1;
  for (const auto& [block, rank] : rank_of_block(il)) {
    const int region = block == 0 ? 0 : block == 13 ? 7 : 1 + (block - 1) / 2;
    EXPECT_EQ(rank, region % 4) << "interleaved block " << block;
  }
}

// Five one-block chunks on two ranks (the 62-on-32 shape in small): chunk k on rank k mod 2, so rank
// 0 holds blocks 0, 2, 4 and rank 1 blocks 1, 3.
TEST(UnevenPipeline, InterleavedWithUnequalChunksPerRank) {
  Scenario sc = scenario(2, 2, "interleaved-1f1b", 0);
  sc.model = kDense;
  sc.stages = 3;  // 4 blocks in 3 chunks: rank 0 holds chunks 0 and 2, rank 1 chunk 1
  const auto ranks = rank_of_block(sc);
  std::map<int, std::set<int>> chunks;
  const CompiledScenario c = compile_scenario(sc);
  for (const auto& seg : c.result.program.segments)
    chunks[c.result.program.device_sets.at(static_cast<std::size_t>(seg.devices)).at(0)].insert(seg.tags.at("PP"));
  EXPECT_EQ(chunks[0], (std::set<int>{0, 2}));
  EXPECT_EQ(chunks[1], (std::set<int>{1}));
}

// Every uneven interleaved shape up to p = 5 (regions p+1 .. 3p-1, not multiples of p; microbatches
// p and 2p) compiles into a verified, deadlock-free program, for Interleaved 1F1B and ZB-H1.
TEST(UnevenPipeline, EveryUnevenShapeVerifies) {
  for (const std::string schedule : {"interleaved-1f1b", "zb-h1"})
    for (int p = 2; p <= 5; ++p)
      for (int regions = p + 1; regions < 3 * p; ++regions) {
        if (regions % p == 0) continue;
        for (int m : {p, 2 * p}) {
          SCOPED_TRACE(schedule + " p " + std::to_string(p) + " regions " + std::to_string(regions) + " m " +
                       std::to_string(m));
          Scenario sc = scenario(p, m, schedule, regions);
          EXPECT_NO_THROW(compile_scenario(sc));
        }
      }
}

// Step time by hand, unit costs (F = 1, B = 2 per region; transfers free): p = 2, 3 regions, m = 2.
// Rank 0 holds regions 0 and 2 (at most 3 forwards in flight: a warmup of one round of region 0, 2,
// plus 1), rank 1 region 1 (one stage downstream: warmup 2, so 3). Each runs its next forward when
// it can start no later than its next backward and the cap allows, else its next backward:
//   rank 0: F0.0 [0,1] F0.1 [1,2] F2.0 [2,3] B2.0 [3,5] F2.1 [5,6] B2.1 [6,8] B0.0 [8,10] B0.1 [10,12]
//   rank 1:            F1.0 [1,2] F1.1 [2,3]            B1.0 [5,7]           B1.1 [8,10]
// (F2.1 waits at 3: three forwards in flight on rank 0.) Step 12; rank 0 is busy 12 of 12, rank 1 6.
TEST(UnevenPipeline, AnalyticStepTimeByHand) {
  Scenario sc = scenario(2, 2, "interleaved-1f1b", 3);
  sc.model = kDense;
  const CompiledScenario c = compile_scenario(sc);
  auto program = std::make_shared<const Program>(c.result.program);
  piper::sim::SimulateOptions o;
  o.engine = "analytic";
  o.op_override = piper::test::unit_costs(*program);
  const auto r = piper::sim::simulate_program(program, o);
  EXPECT_DOUBLE_EQ(r.report.step_time_s, 12);
  ASSERT_EQ(r.report.per_device.size(), 2u);
  EXPECT_DOUBLE_EQ(r.report.per_device[0].busy_s, 12);
  EXPECT_DOUBLE_EQ(r.report.per_device[1].busy_s, 6);
}

// The shape: a 62-block model on 32 ranks, one block per chunk. Ranks 0..29 hold two chunks
// (k and k + 32), ranks 30 and 31 one; the program verifies (compile_scenario runs the verifier).
TEST(UnevenPipeline, SixtyTwoBlocksOnThirtyTwoRanks) {
  ModelConfig c = load_model_config("qwen3-9m");
  c.layers = 62;
  c.name = "qwen3-9m-62";
  const std::string file = ::testing::TempDir() + "/uneven62-" + std::to_string(::getpid()) + ".json";
  write_file_atomically(file, config_to_spec_json(c).dump());
  Scenario sc = scenario(32, 64, "interleaved-1f1b", 62);
  sc.model = file;
  const CompiledScenario compiled = compile_scenario(sc);
  std::map<int, std::set<int>> chunks;
  for (const auto& seg : compiled.result.program.segments)
    chunks[compiled.result.program.device_sets.at(static_cast<std::size_t>(seg.devices)).at(0)].insert(
        seg.tags.at("PP"));
  ASSERT_EQ(chunks.size(), 32u);
  for (int r = 0; r < 32; ++r)
    EXPECT_EQ(chunks[r], r < 30 ? (std::set<int>{r, r + 32}) : (std::set<int>{r})) << "rank " << r;
}
