// Front ends build the typed directive program (core::ProgramBuilder -> core::DirectiveProgram) and
// serialize it only where a file is written. The JSON form of a few strategies' programs must be the
// one the JSON-editing generator wrote before (cc041a1, `piper directives`), written out here by hand,
// and the typed program must be what that JSON reads as.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "piper/core/directives.hpp"
#include "piper/core/program_builder.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/strategy.hpp"

namespace {

using namespace piper::core;
using nlohmann::json;

StrategyOptions options(int pp, int dp, const std::string& schedule, int microbatches) {
  StrategyOptions o;
  o.pp = pp, o.dp = dp, o.schedule = schedule, o.microbatches = microbatches;
  return o;
}

// The generated program's JSON form is `expected`, and its typed directives are exactly what the
// parser reads from that JSON (the builder gives absent fields the parser's defaults).
void expect_program(const StrategyOptions& o, const char* expected) {
  const DirectiveProgram p = generate_program(o);
  EXPECT_EQ(p.to_json(), json::parse(expected)) << p.to_json().dump();
  EXPECT_EQ(p.directives, parse_directives(json::parse(expected)).directives);
}

TEST(TypedProgram, PipelineDataParallelZero3) {
  StrategyOptions o = options(2, 2, "1f1b", 2);
  o.zero = 3;
  expect_program(o, R"([
    {"op": "place", "filter": {"PP": 0}, "devices": [0, 2], "stream": "pp"},
    {"op": "place", "filter": {"PP": 1}, "devices": [1, 3], "stream": "pp"},
    {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 2], "gather_stream": "dp", "gather_unit": "block",
     "reduce_stream": "dp", "shard_grads": true, "shard_params": true},
    {"op": "replicate", "filter": {"PP": 1}, "devices": [1, 3], "gather_stream": "dp", "gather_unit": "block",
     "reduce_stream": "dp", "shard_grads": true, "shard_params": true},
    {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2},
    {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 1, "PASS": "F"}],
                                [{"PP": 0, "MB": 0, "PASS": "B"}], [{"PP": 0, "MB": 1, "PASS": "B"}]]},
    {"op": "order", "filters": [[{"PP": 1, "MB": 0, "PASS": "F"}], [{"PP": 1, "MB": 0, "PASS": "B"}],
                                [{"PP": 1, "MB": 1, "PASS": "F"}], [{"PP": 1, "MB": 1, "PASS": "B"}]]}])");
  // The typed fields the passes read, as the ZeRO-3 flags mean them.
  const DirectiveProgram generated = generate_program(o);  // r refers into it: keep it alive
  const auto& r = std::get<ReplicateDirective>(generated.directives.at(2));
  EXPECT_TRUE(r.shard_grads && r.shard_params && r.gather_blocks && r.reduce_every_microbatch);
  EXPECT_FALSE(r.shard_optimizer || r.gather_fp8);
  EXPECT_EQ(r.prefetch, 1);
  EXPECT_EQ(r.gather_stream, "dp");
}

TEST(TypedProgram, TensorAndSequenceParallel) {
  StrategyOptions o = options(1, 1, "1f1b", 1);
  o.tp = 2, o.sequence_parallel = true;
  // One pipeline rank: no point-to-point stream on the place directive.
  expect_program(o, R"([
    {"op": "place", "filter": {"PP": 0}, "devices": [0, 1]},
    {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], "reduce_stream": "dp"},
    {"op": "tensor_parallel", "filter": {"PP": 0}, "degree": 2, "sequence_parallel": true},
    {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 1},
    {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 0, "PASS": "B"}]]}])");
}

TEST(TypedProgram, ExpertParallel) {
  StrategyOptions o = options(1, 2, "1f1b", 1);
  o.ep = 2;
  // EP over every replica: the shard directive names no degree.
  expect_program(o, R"([
    {"op": "place", "filter": {"PP": 0}, "devices": [0, 1]},
    {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], "reduce_stream": "dp"},
    {"op": "shard", "filter": {"PP": 0, "EP": "*"}, "devices": [0, 1], "stream": "ep"},
    {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 1},
    {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 0, "PASS": "B"}]]}])");
  EXPECT_EQ(std::get<ShardDirective>(generate_program(o).directives.at(2)).degree, 0);
}

TEST(TypedProgram, ContextParallel) {
  StrategyOptions o = options(1, 1, "1f1b", 1);
  o.cp = 2;
  expect_program(o, R"([
    {"op": "place", "filter": {"PP": 0}, "devices": [0, 1]},
    {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 1], "reduce_stream": "dp"},
    {"op": "context_parallel", "degree": 2},
    {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 1},
    {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 0, "PASS": "B"}]]}])");
}

TEST(TypedProgram, InterleavedOneFOneB) {
  StrategyOptions o = options(2, 1, "interleaved-1f1b", 2);
  o.virtual_stages = 2;
  // Regions 0 and 2 on rank 0, 1 and 3 on rank 1; each rank's chunks interleaved.
  expect_program(o, R"([
    {"op": "place", "filter": {"PP": 0}, "devices": [0], "stream": "pp"},
    {"op": "place", "filter": {"PP": 1}, "devices": [1], "stream": "pp"},
    {"op": "place", "filter": {"PP": 2}, "devices": [0], "stream": "pp"},
    {"op": "place", "filter": {"PP": 3}, "devices": [1], "stream": "pp"},
    {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2},
    {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 1, "PASS": "F"}],
                                [{"PP": 2, "MB": 0, "PASS": "F"}], [{"PP": 2, "MB": 1, "PASS": "F"}],
                                [{"PP": 2, "MB": 0, "PASS": "B"}], [{"PP": 2, "MB": 1, "PASS": "B"}],
                                [{"PP": 0, "MB": 0, "PASS": "B"}], [{"PP": 0, "MB": 1, "PASS": "B"}]]},
    {"op": "order", "filters": [[{"PP": 1, "MB": 0, "PASS": "F"}], [{"PP": 1, "MB": 1, "PASS": "F"}],
                                [{"PP": 3, "MB": 0, "PASS": "F"}], [{"PP": 3, "MB": 0, "PASS": "B"}],
                                [{"PP": 3, "MB": 1, "PASS": "F"}], [{"PP": 3, "MB": 1, "PASS": "B"}],
                                [{"PP": 1, "MB": 0, "PASS": "B"}], [{"PP": 1, "MB": 1, "PASS": "B"}]]}])");
}

TEST(TypedProgram, ZeroBubbleV) {
  // The V: regions 0 and 3 on rank 0, 1 and 2 on rank 1; B split into BI and BW.
  expect_program(options(2, 1, "zb-v", 2), R"([
    {"op": "place", "filter": {"PP": 0}, "devices": [0], "stream": "pp"},
    {"op": "place", "filter": {"PP": 1}, "devices": [1], "stream": "pp"},
    {"op": "place", "filter": {"PP": 2}, "devices": [1], "stream": "pp"},
    {"op": "place", "filter": {"PP": 3}, "devices": [0], "stream": "pp"},
    {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2},
    {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 1, "PASS": "F"}],
                                [{"PP": 3, "MB": 0, "PASS": "F"}], [{"PP": 3, "MB": 0, "PASS": "BI"}],
                                [{"PP": 3, "MB": 0, "PASS": "BW"}], [{"PP": 3, "MB": 1, "PASS": "F"}],
                                [{"PP": 3, "MB": 1, "PASS": "BI"}], [{"PP": 3, "MB": 1, "PASS": "BW"}],
                                [{"PP": 0, "MB": 0, "PASS": "BI"}], [{"PP": 0, "MB": 0, "PASS": "BW"}],
                                [{"PP": 0, "MB": 1, "PASS": "BI"}], [{"PP": 0, "MB": 1, "PASS": "BW"}]]},
    {"op": "order", "filters": [[{"PP": 1, "MB": 0, "PASS": "F"}], [{"PP": 2, "MB": 0, "PASS": "F"}],
                                [{"PP": 1, "MB": 1, "PASS": "F"}], [{"PP": 2, "MB": 1, "PASS": "F"}],
                                [{"PP": 2, "MB": 0, "PASS": "BI"}], [{"PP": 2, "MB": 0, "PASS": "BW"}],
                                [{"PP": 1, "MB": 0, "PASS": "BI"}], [{"PP": 1, "MB": 0, "PASS": "BW"}],
                                [{"PP": 2, "MB": 1, "PASS": "BI"}], [{"PP": 2, "MB": 1, "PASS": "BW"}],
                                [{"PP": 1, "MB": 1, "PASS": "BI"}], [{"PP": 1, "MB": 1, "PASS": "BW"}]]}])");
}

// Every optional field of every builder method: the typed directive is what its JSON form reads as.
TEST(TypedProgram, EveryBuiltDirectiveReadsBackAsBuilt) {
  ReplicateArgs hsdp;
  hsdp.bucket_size_mb = 12.5;
  hsdp.shard_optimizer = hsdp.shard_grads = hsdp.shard_params = true;
  hsdp.reduce_stream = "r", hsdp.gather_stream = "g", hsdp.gather_unit = "segment", hsdp.gather_dtype = "fp8";
  hsdp.reduce_every = "step", hsdp.shard_group = 2, hsdp.prefetch = 3;
  ProgramBuilder b;
  b.place(region_filter(0), {0, 1, 2, 3}, "p2p", true)
      .place(region_filter(1), {4, 5, 6, 7}, std::nullopt, false, "head")
      .replicate(region_filter(0), {0, 1, 2, 3}, hsdp)
      .replicate(region_filter(1), {4, 5, 6, 7})
      .shard(region_filter(0, "EP"), {0, 1, 2, 3}, std::nullopt, 2)
      .split(Filter{}, 4, std::string("SUB"))
      .tensor_parallel(region_filter(0), 2, true, true, 2)
      .recompute(region_filter(0), "selective", 2)
      .recompute(region_filter(1), "full", 0, 1)
      .context_parallel(2, true)
      .sm_partition(8)
      .order({{Filter{{{"PP", 0}, {"SUB", 1}}, {}, Pass::BW}, Filter{{{"PP", 0}}, {"SUB"}, Pass::F}}});
  const DirectiveProgram& p = b.program();
  ASSERT_EQ(p.size(), 12u);
  EXPECT_EQ(parse_directives(p.to_json()).directives, p.directives);
  EXPECT_EQ(b.build().directives, p.directives);
  // A few typed fields, as the builder's arguments give them.
  EXPECT_EQ(std::get<PlaceDirective>(p.directives[0]).stream, "p2p");
  EXPECT_EQ(std::get<PlaceDirective>(p.directives[1]).stream, "pp");  // absent: the format's default
  EXPECT_FALSE(std::get<ReplicateDirective>(p.directives[2]).reduce_every_microbatch);
  EXPECT_EQ(std::get<ReplicateDirective>(p.directives[3]).gather_stream, "dp");
  EXPECT_EQ(std::get<SplitDirective>(p.directives[5]).dim_name, "SUB");
  EXPECT_EQ(std::get<RecomputeDirective>(p.directives[7]).mode, Recompute::Selective);
}

// The typed edits keep the JSON form in step: relabelled devices, dropped directives, appended ones.
TEST(TypedProgram, EditsChangeTheTypedDirectivesAndTheirJsonTogether) {
  StrategyOptions o = options(2, 2, "gpipe", 1);
  DirectiveProgram p = generate_program(o);
  p.relabel_devices([](int d) { return d ^ 1; });  // swap the pipeline ranks' devices
  EXPECT_EQ(std::get<PlaceDirective>(p.directives[0]).devices, (std::vector<int>{1, 3}));
  EXPECT_EQ(p.to_json()[0], json::parse(R"({"op": "place", "filter": {"PP": 0}, "devices": [1, 3], "stream": "pp"})"));
  EXPECT_EQ(p.to_json()[3]["devices"], json::parse("[0, 2]"));
  EXPECT_EQ(parse_directives(p.to_json()).directives, p.directives);
  p.remove_if([](const Directive& d) { return std::holds_alternative<OrderDirective>(d); });
  EXPECT_EQ(p.size(), 5u);
  EXPECT_EQ(p.to_json().size(), 5u);
  DirectiveProgram schedule = schedule_directives(o, {0, 1});
  p.append(schedule);
  EXPECT_EQ(p.size(), 5u + schedule.size());
  EXPECT_EQ(parse_directives(p.to_json()).directives, p.directives);
}

// A scenario's own program is read once and stays as its file wrote it (fields the builder would omit
// included); the compiled program's JSON form is that file's.
TEST(TypedProgram, AScenariosOwnProgramKeepsItsJson) {
  const json file = json::parse(R"([
    {"op": "place", "filter": {"PP": 0}, "devices": [0], "stream": "pp", "blocking": false},
    {"op": "split", "filter": {}, "num_microbatches": 2, "dim_name": "MB"},
    {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 1, "PASS": "F"}],
                                [{"PP": 0, "MB": 0, "PASS": "B"}], [{"PP": 0, "MB": 1, "PASS": "B"}]]}])");
  Scenario s;
  s.model = "qwen3-9m";
  s.directives = file;
  s.directives_source = "own.json";
  int regions = 0;
  EXPECT_EQ(scenario_program(s, &regions).to_json(), file);
  EXPECT_EQ(regions, 1);
  EXPECT_EQ(compile_scenario(s).program.to_json(), file);
}

}  // namespace
