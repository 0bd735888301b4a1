// Tests of directive parsing and of each rewrite pass (split, backward split, place, shard,
// replicate, order): what they insert, what they reject, and that a failure changes nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <map>
#include <set>
#include <tuple>
#include <fstream>
#include <sstream>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/program_builder.hpp"
#include "piper/core/verifier.hpp"

using namespace piper::core;
using nlohmann::json;

namespace {

Model qwen9m(int regions) {
  Model m = build_model(*zoo_config("qwen3-9m"));
  std::vector<int> starts;
  for (int r = 0; r < regions; ++r) starts.push_back(r * 4 / regions);
  annotate_pipeline_ranges(m, starts);
  return m;
}

GlobalDag apply_program(const Model& m, const json& program) {
  GlobalDag dag = build_dag(m);
  apply_directives(dag, parse_directives(program));
  return dag;
}

// The DirectiveError raised by applying (or parsing) `program`.
DirectiveError error_of(const Model& m, const json& program) {
  try {
    apply_program(m, program);
  } catch (const DirectiveError& e) {
    return e;
  }
  ADD_FAILURE() << "no DirectiveError for " << program.dump();
  return DirectiveError(-99, "", "");
}

json place(int pp, std::vector<int> devices) {
  return json{{"op", "place"}, {"filter", json{{"PP", pp}}}, {"devices", json(devices)}};
}
// A program from directives (json::array would try to read a lone object as a key/value pair).
json prog(std::initializer_list<json> directives) {
  json out = json::array();
  for (const auto& d : directives) out.push_back(d);
  return out;
}

json split(int n) { return {{"op", "split"}, {"filter", json::object()}, {"dim_name", "MB"}, {"num_microbatches", n}}; }
// The data-parallel copies of a region placed on several devices (a program must reduce them).
json replicate(int pp, std::vector<int> devices) {
  return json{{"op", "replicate"}, {"filter", json{{"PP", pp}}}, {"devices", json(devices)}};
}
json step(int pp, int mb, const char* pass) { return prog({json{{"PP", pp}, {"MB", mb}, {"PASS", pass}}}); }

std::int64_t count(const GlobalDag& dag, const std::string& kind) {
  auto c = dag.counts_by_kind();
  return c.contains(kind) ? c[kind] : 0;
}

}  // namespace

TEST(Parse, ErrorsNameTheDirectiveIndexAndField) {
  auto err = [](const json& program) {
    try {
      parse_directives(program);
    } catch (const DirectiveError& e) {
      return std::make_pair(e.index(), e.field());
    }
    return std::make_pair(-1, std::string("(none)"));
  };
  EXPECT_EQ(err(json::parse(R"([{"op":"place","filter":{},"devices":[0]},{"op":"frobnicate"}])")),
            std::make_pair(1, std::string("op")));
  EXPECT_EQ(err(json::parse(R"([{"op":"place","filter":{}}])")), std::make_pair(0, std::string("devices")));
  EXPECT_EQ(err(json::parse(R"([{"op":"place","filter":{},"devices":[0,-1]}])")),
            std::make_pair(0, std::string("devices[1]")));
  EXPECT_EQ(err(json::parse(R"([{"op":"place","filter":{},"devices":"0"}])")),
            std::make_pair(0, std::string("devices")));
  EXPECT_EQ(err(json::parse(R"([{"op":"split","filter":{},"num_microbatches":"4"}])")),
            std::make_pair(0, std::string("num_microbatches")));
  EXPECT_EQ(err(json::parse(R"([{"op":"order","filters":[[{"PP":0,"PASS":"X"}]]}])")),
            std::make_pair(0, std::string("filters[0][0].PASS")));
  EXPECT_EQ(err(json::parse(R"([{"op":"place","filter":{"PP":0},"devices":[0],"strem":"x"}])")),
            std::make_pair(0, std::string("strem")));
  EXPECT_EQ(err(json::parse(R"([{"op":"replicate","filter":{},"devices":[0,1],"shard_params":true}])")),
            std::make_pair(0, std::string("shard_params")));
  // ZeRO-3's prefetch limit: only with shard_params, a non-negative integer.
  for (const char* bad :
       {R"("shard_grads":true,"prefetch":1)", R"("shard_grads":true,"shard_params":true,"prefetch":-1)",
        R"("shard_grads":true,"shard_params":true,"prefetch":1.5)",
        R"("shard_grads":true,"shard_params":true,"prefetch":"2")"})
    EXPECT_EQ(err(json::parse(std::string(R"([{"op":"replicate","filter":{},"devices":[0,1],)") + bad + "}]")),
              std::make_pair(0, std::string("prefetch")))
        << bad;
  // HSDP's shard_group: only with ZeRO, an integer from 2 to the number of devices.
  for (const char* bad :
       {R"("shard_group":2)", R"("shard_optimizer":true,"shard_group":1)", R"("shard_optimizer":true,"shard_group":5)",
        R"("shard_optimizer":true,"shard_group":2.5)", R"("shard_optimizer":true,"shard_group":"2")"})
    EXPECT_EQ(err(json::parse(std::string(R"([{"op":"replicate","filter":{},"devices":[0,1,2,3],)") + bad + "}]")),
              std::make_pair(0, std::string("shard_group")))
        << bad;
  // gather_dtype: only with shard_params, "fp8" or "param".
  for (const char* bad :
       {R"("shard_grads":true,"gather_dtype":"fp8")", R"("shard_grads":true,"shard_params":true,"gather_dtype":"fp4")",
        R"("shard_grads":true,"shard_params":true,"gather_dtype":8)"})
    EXPECT_EQ(err(json::parse(std::string(R"([{"op":"replicate","filter":{},"devices":[0,1],)") + bad + "}]")),
              std::make_pair(0, std::string("gather_dtype")))
        << bad;
  EXPECT_THROW(parse_directives(json::object()), Error);
}

TEST(Parse, FileErrorsNameTheFile) {
  const auto path = std::filesystem::temp_directory_path() / "piper_not_json.json";
  std::ofstream(path) << "[{\"op\": ";
  try {
    load_directives_file(path.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(path.string() + ": not JSON", 0), 0u) << e.what();
  }
  std::ofstream(path) << R"([{"op":"place","filter":{},"devices":[-3]}])";
  try {
    load_directives_file(path.string());
    FAIL();
  } catch (const DirectiveError& e) {
    EXPECT_EQ(std::string(e.what()), path.string() + ": directive 0 field 'devices[0]': device id -3 is negative");
  }
  std::filesystem::remove(path);
}

TEST(Split, CopiesTheRegionPerMicrobatchAndTagsIt) {
  const GlobalDag dag = apply_program(qwen9m(1), prog({split(3)}));
  EXPECT_EQ(count(dag, "F"), 9 * 3);  // 9 segments x 3 microbatches
  EXPECT_EQ(count(dag, "B"), 9 * 3);
  EXPECT_EQ(dag.microbatches, 3);
  std::set<int> mbs;
  for (auto v : dag.live_nodes())
    if (dag.graph[v].kind == NodeKind::Compute) {
      mbs.insert(dag.graph[v].tags.at("MB"));
    }
  EXPECT_EQ(mbs, (std::set<int>{0, 1, 2}));
  // UPD is shared: without place directives everything runs on device 0, so one update is fed by
  // every segment's B of every microbatch.
  EXPECT_EQ(count(dag, "UPD"), 1);
  for (auto v : dag.live_nodes())
    if (dag.graph[v].kind == NodeKind::Update) {
      EXPECT_EQ(boost::in_degree(v, dag.graph), 9u * 3u);
    }
}

TEST(Split, RejectsANonContiguousRegionAndARepeatedDimension) {
  const Model m = qwen9m(1);
  // Experts of block 0 and block 1 with attention between them: not contiguous.
  auto e = error_of(m, json::parse(R"([{"op":"split","filter":{"EP":"*"},"num_microbatches":2}])"));
  EXPECT_EQ(e.index(), 0);
  EXPECT_EQ(e.field(), "filter");
  EXPECT_NE(std::string(e.what()).find("non-contiguous"), std::string::npos);
  e = error_of(m, prog({split(2), split(2)}));
  EXPECT_EQ(e.index(), 1);
  EXPECT_EQ(e.field(), "dim_name");
}

// Op::microbatch: lowering numbers the split copies in mixed radix, the first split outermost, for
// any dimension names; ops outside the passes (UPD, gradient reductions) are tied to none.
TEST(Split, LoweringNumbersMicrobatchesForAnyDimensionAndNesting) {
  const Model m = qwen9m(2);
  auto dim_split = [](const std::string& dim, int n) {
    return json{{"op", "split"}, {"filter", json::object()}, {"dim_name", dim}, {"num_microbatches", n}};
  };
  const json placed = prog({place(0, {0, 2}), place(1, {1, 3}),
                            json{{"op", "replicate"}, {"filter", json{{"PP", 0}}}, {"devices", {0, 2}}},
                            json{{"op", "replicate"}, {"filter", json{{"PP", 1}}}, {"devices", {1, 3}}}});
  for (const auto& [splits, total] : std::vector<std::pair<json, int>>{
           {prog({dim_split("SAMPLE", 3)}), 3}, {prog({dim_split("OUTER", 2), dim_split("INNER", 3)}), 6}}) {
    json program = splits;
    for (const auto& d : placed) program.push_back(d);
    const CompileResult r = compile(m, parse_directives(program));
    ASSERT_EQ(r.program.microbatches, total);
    // Every (device, kind, pass, segment) runs each microbatch exactly once; the index matches the tags.
    std::map<std::tuple<int, OpKind, Pass, int>, std::multiset<int>> seen;
    int untied = 0;
    for (int d = 0; d < r.program.num_devices; ++d)
      for (const auto& st : r.program.plan_for(d).streams)
        for (const auto& op : st.ops) {
          if (op.pass == Pass::None) {
            EXPECT_EQ(op.microbatch, -1) << op.label;
            ++untied;
            continue;
          }
          const int want =
              op.tags.contains("SAMPLE") ? op.tags.at("SAMPLE") : op.tags.at("OUTER") * 3 + op.tags.at("INNER");
          EXPECT_EQ(op.microbatch, want) << op.label;
          seen[{d, op.kind, op.pass, op.segment}].insert(op.microbatch);
        }
    EXPECT_GT(untied, 0);  // UPD and the data-parallel ALL_REDUCE
    std::multiset<int> all;
    for (int i = 0; i < total; ++i) all.insert(i);
    EXPECT_FALSE(seen.empty());
    for (const auto& [key, mbs] : seen)
      EXPECT_EQ(mbs, all) << "device " << std::get<0>(key) << " segment " << std::get<3>(key);
    // The field survives the plan file.
    EXPECT_TRUE(Program::from_json(r.program.to_json()) == r.program);
  }
}

TEST(BackwardSplit, OrderNamingBIOrBWSplitsTheBackward) {
  json program = prog({split(2), place(0, {0})});
  program.push_back(
      {{"op", "order"},
       {"filters",
        {step(0, 0, "F"), step(0, 1, "F"), step(0, 0, "BI"), step(0, 1, "BI"), step(0, 0, "BW"), step(0, 1, "BW")}}});
  const GlobalDag dag = apply_program(qwen9m(1), program);
  EXPECT_EQ(count(dag, "B"), 0);
  EXPECT_EQ(count(dag, "BI"), 9 * 2);
  EXPECT_EQ(count(dag, "BW"), 9 * 2);
  // Weight gradients feed the update; BI carries the input gradient on; BW follows its BI.
  double bi_flops = 0, bw_flops = 0;
  for (auto v : dag.live_nodes()) {
    const auto& n = dag.graph[v];
    if (n.kind == NodeKind::Update) {
      for (auto e : boost::make_iterator_range(boost::in_edges(v, dag.graph))) {
        EXPECT_EQ(dag.graph[boost::source(e, dag.graph)].pass, Pass::BW);
      }
    }
    if (n.pass == Pass::BI) bi_flops += n.costs.backward_input_flops + n.costs.backward_weight_flops;
    if (n.pass == Pass::BW) bw_flops += n.costs.backward_input_flops + n.costs.backward_weight_flops;
  }
  double total_b = 0;
  for (const auto& s : segment_model(qwen9m(1))) total_b += 2 * s.costs.backward_flops();  // 2 microbatches
  EXPECT_DOUBLE_EQ(bi_flops + bw_flops, total_b);
  EXPECT_GT(bw_flops, 0);
}

TEST(Place, InsertsSendRecvBetweenDeviceSetsAndRejectsConflicts) {
  const Model m = qwen9m(2);
  const GlobalDag dag = apply_program(m, prog({place(0, {0}), place(1, {1})}));
  EXPECT_EQ(count(dag, "SEND"), 2);  // activation forward, gradient backward
  EXPECT_EQ(count(dag, "RECV"), 2);
  EXPECT_EQ(count(dag, "UPD"), 2);  // one per device set
  auto e = error_of(m, prog({place(0, {0}), {{"op", "place"}, {"filter", {{"EP", 0}}}, {"devices", {1}}}}));
  EXPECT_EQ(e.index(), 1);
  EXPECT_NE(std::string(e.what()).find("already placed"), std::string::npos);
  // A region left unplaced is named.
  try {
    apply_program(m, prog({place(0, {0})}));
    FAIL();
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("PP\":1"), std::string::npos) << err.what();
  }
  e = error_of(m, prog({place(7, {0})}));
  EXPECT_EQ(e.field(), "filter");
  EXPECT_NE(std::string(e.what()).find("matches no node"), std::string::npos);
}

// Expert parallelism over data-parallel replicas: each device holds a quarter of the experts'
// parameters, but receives every token routed to them from the four devices, so with balanced
// routing it computes as many token-expert pairs (FLOPs) as one unsharded device on its own tokens.
TEST(Shard, DividesParametersKeepsPerDeviceFlopsAndInsertsAllToAllsAtTheRegionBoundary) {
  const Model m = qwen9m(1);
  const GlobalDag dag = apply_program(m, json::parse(R"([
    {"op":"place","filter":{"PP":0},"devices":[0,1,2,3]},
    {"op":"shard","filter":{"EP":0},"devices":[0,1,2,3],"stream":"ep"},
    {"op":"replicate","filter":{"PP":0},"devices":[0,1,2,3]}])"));
  EXPECT_EQ(count(dag, "ALL_TO_ALL"), 4);  // dispatch + combine, forward and backward
  const auto segs = segment_model(m);
  for (auto v : dag.live_nodes()) {
    const auto& n = dag.graph[v];
    if (n.kind == NodeKind::Compute && n.segment == 1 && n.pass == Pass::F) {
      EXPECT_DOUBLE_EQ(n.costs.forward_flops, segs[1].costs.forward_flops);
      EXPECT_EQ(n.costs.params, segs[1].costs.params / 4);
    }
    if (n.kind == NodeKind::AllToAll) {
      EXPECT_EQ(n.bytes, segs[0].costs.output_bytes * 2);  // top-2: each token goes to two experts
      EXPECT_EQ(n.stream, "ep");
    }
  }
  auto e = error_of(m, json::parse(R"([
    {"op":"place","filter":{"PP":0},"devices":[0,1]},
    {"op":"shard","filter":{"EP":0},"devices":[1,0]}])"));
  EXPECT_EQ(e.field(), "devices");
}

TEST(Replicate, ZeroLevelsChooseTheCollectives) {
  const Model m = qwen9m(1);
  auto run = [&](const std::string& extra) {
    return apply_program(m, json::parse(R"([{"op":"place","filter":{"PP":0},"devices":[0,1]},
                                     {"op":"replicate","filter":{"PP":0},"devices":[0,1])" +
                                        extra + "}]"));
  };
  // 9 segments in one region, all with parameters; no sharding: one collective per segment.
  const auto z0 = run("");
  EXPECT_EQ(count(z0, "ALL_REDUCE"), 9);
  const auto z1 = run(R"(,"shard_optimizer":true)");
  EXPECT_EQ(count(z1, "REDUCE_SCATTER"), 9);
  EXPECT_EQ(count(z1, "ALL_GATHER"), 9);  // gather the updated shards back
  const auto bucketed = run(R"(,"bucket_size":1000)");
  EXPECT_EQ(count(bucketed, "ALL_REDUCE"), 1);
  // UPD costs follow ZeRO: with sharded optimizer states each device updates half the parameters.
  auto upd_params = [](const GlobalDag& dag) {
    for (auto v : dag.live_nodes())
      if (dag.graph[v].kind == NodeKind::Update) {
        return dag.graph[v].costs.params;
      }
    return std::int64_t{-1};
  };
  EXPECT_EQ(upd_params(z0), m.parameter_count());
  EXPECT_EQ(upd_params(z1), m.parameter_count() / 2);
  // HBM traffic per updated bf16 parameter: AdamW reads the gradient and writes the parameter
  // (2 + 2), reads and writes fp32 master weights, m and v (2 x 12), plus the gradient-norm read
  // and the gradient zeroing (2 + 2): 32 bytes.
  for (auto v : z1.live_nodes()) {
    if (z1.graph[v].kind == NodeKind::Update) {
      EXPECT_EQ(z1.graph[v].costs.forward_memory_bytes, 32 * z1.graph[v].costs.params);
    }
  }
}

TEST(Replicate, ExpertsShardedOverFewerDevicesAreReducedAcrossStridedGroups) {
  const Model m = qwen9m(1);
  const GlobalDag dag = apply_program(m, json::parse(R"([
    {"op":"place","filter":{"PP":0},"devices":[0,1,2,3]},
    {"op":"shard","filter":{"EP":"*"},"devices":[0,1,2,3],"degree":2},
    {"op":"replicate","filter":{"PP":0},"devices":[0,1,2,3]}])"));
  // 5 dense segments over all 4 devices, 4 expert segments over the groups {0,2} and {1,3}.
  int dense = 0, experts = 0;
  for (auto v : dag.live_nodes()) {
    const auto& n = dag.graph[v];
    if (n.kind != NodeKind::AllReduce) continue;
    const auto& fam = dag.families.at(static_cast<std::size_t>(n.family));
    if (fam.purpose == FamilyPurpose::Dp) {
      ++dense;
      EXPECT_EQ(fam.group_size, 4);
    }
    if (fam.purpose == FamilyPurpose::DpEp) {
      ++experts;
      EXPECT_EQ(fam.stride, 2);
      EXPECT_EQ(fam.group_size, 2);
    }
  }
  EXPECT_EQ(dense, 5);
  EXPECT_EQ(experts, 4);
}

// HSDP (shard_group 2 over 4 replicas): each bucket is reduce-scattered inside the shard groups
// {0,1} and {2,3}, its half summed across the groups holding the same half ({0,2} and {1,3}), and
// the updated halves gathered inside the shard groups again; each device updates half the model.
TEST(Replicate, HybridShardingReducesInsideGroupsThenAcrossThem) {
  const Model m = qwen9m(1);
  auto run = [&](const std::string& zero) {
    return apply_program(m, json::parse(R"([{"op":"place","filter":{"PP":0},"devices":[0,1,2,3]},
                                     {"op":"replicate","filter":{"PP":0},"devices":[0,1,2,3],)" +
                                        zero + "}]"));
  };
  const GlobalDag plain = run(R"("shard_optimizer":true)");
  const GlobalDag hsdp = run(R"("shard_optimizer":true,"shard_group":2)");
  auto family_devices = [](const GlobalDag& dag, int family) {
    const auto& f = dag.families.at(static_cast<std::size_t>(family));
    return std::make_pair(dag.device_sets.at(f.devices), f.group_size);
  };
  using Family = std::pair<std::vector<int>, int>;
  const Family within{{0, 1, 2, 3}, 2}, across{{0, 2, 1, 3}, 2};
  // Reduce-scatter bytes per segment label, from the plain ZeRO-1 DAG (the same buckets).
  std::map<std::string, std::int64_t> rs_bytes;
  for (auto v : plain.live_nodes())
    if (plain.graph[v].kind == NodeKind::ReduceScatter) rs_bytes[plain.graph[v].label] = plain.graph[v].bytes;
  ASSERT_EQ(rs_bytes.size(), 9u);  // one per segment with parameters
  int rs = 0, ar = 0, ag = 0;
  for (auto v : hsdp.live_nodes()) {
    const auto& n = hsdp.graph[v];
    if (n.kind == NodeKind::ReduceScatter) {
      ++rs;
      EXPECT_EQ(family_devices(hsdp, n.family), within) << n.label;
      EXPECT_EQ(n.bytes, rs_bytes.at(n.label)) << n.label;
    } else if (n.kind == NodeKind::AllReduce) {
      ++ar;
      EXPECT_EQ(family_devices(hsdp, n.family), across) << n.label;
      EXPECT_EQ(hsdp.device_sets.at(n.devices), across.first) << n.label;
      // Its input is the reduce-scatter of the same bucket: half the gradient bytes.
      std::int64_t from = -1;
      for (auto e : boost::make_iterator_range(boost::in_edges(v, hsdp.graph)))
        if (hsdp.graph[boost::source(e, hsdp.graph)].kind == NodeKind::ReduceScatter)
          from = hsdp.graph[boost::source(e, hsdp.graph)].bytes;
      EXPECT_EQ(n.bytes * 2, from) << n.label;
    } else if (n.kind == NodeKind::AllGather) {
      ++ag;
      EXPECT_EQ(family_devices(hsdp, n.family), within) << n.label;
    }
  }
  EXPECT_EQ(rs, 9);
  EXPECT_EQ(ar, 9);
  EXPECT_EQ(ag, 9);
  for (const auto& seg : hsdp.segments)
    if (seg.costs.params > 0) {
      EXPECT_EQ(seg.replicas, 4);
      EXPECT_EQ(seg.zero_shards, 2);
    }
  for (auto v : hsdp.live_nodes())
    if (hsdp.graph[v].kind == NodeKind::Update) {
      EXPECT_EQ(hsdp.graph[v].costs.params, m.parameter_count() / 2);
    }
  // A group size that does not divide a segment's replicas names the field.
  auto e = error_of(m, json::parse(R"([{"op":"place","filter":{"PP":0},"devices":[0,1,2,3,4,5]},
      {"op":"replicate","filter":{"PP":0},"devices":[0,1,2,3,4,5],"shard_optimizer":true,"shard_group":4}])"));
  EXPECT_EQ(e.field(), "shard_group");
  EXPECT_NE(std::string(e.what()).find("does not divide the 6 replicas"), std::string::npos) << e.what();
}

TEST(Order, RejectsCyclesAndCrossingDeviceSets) {
  const Model m = qwen9m(2);
  json base = prog({split(2), place(0, {0, 2}), place(1, {1, 3}), replicate(0, {0, 2}), replicate(1, {1, 3})});
  json cycle = base;
  cycle.push_back({{"op", "order"}, {"filters", {step(1, 0, "B"), step(1, 0, "F")}}});
  auto e = error_of(m, cycle);
  EXPECT_EQ(e.index(), 5);
  EXPECT_EQ(e.field(), "filters[1]");
  EXPECT_NE(std::string(e.what()).find("cycle"), std::string::npos);
  json across = base;
  across.push_back({{"op", "order"}, {"filters", {step(0, 0, "F"), step(1, 0, "F")}}});
  e = error_of(m, across);
  EXPECT_EQ(e.field(), "filters[1][0]");
  EXPECT_NE(std::string(e.what()).find("cannot cross device sets"), std::string::npos);
}

TEST(Apply, AFailedProgramLeavesTheDagUntouched) {
  GlobalDag dag = build_dag(qwen9m(2));
  const std::string before = dag.to_json().dump();
  json bad = prog({split(2), place(0, {0}), place(1, {1})});
  bad.push_back({{"op", "order"}, {"filters", {step(1, 0, "B"), step(1, 0, "F")}}});
  EXPECT_THROW(apply_directives(dag, parse_directives(bad)), DirectiveError);
  EXPECT_EQ(dag.to_json().dump(), before);
}

TEST(Apply, HookSeesEveryPassInTheFixedOrder) {
  // Written out of order on purpose: the passes still run split -> place -> replicate -> order, and the
  // internal passes that changed the DAG (index -1) are seen too, each in its place.
  json program = json::parse(R"([
    {"op":"order","filters":[[{"PP":0,"MB":0,"PASS":"F"}],[{"PP":0,"MB":1,"PASS":"F"}]]},
    {"op":"replicate","filter":{"PP":0},"devices":[0,1]},
    {"op":"place","filter":{"PP":0},"devices":[0,1]},
    {"op":"split","filter":{},"num_microbatches":2}])");
  std::vector<std::string> seen;
  GlobalDag dag = build_dag(qwen9m(1));
  apply_directives(dag, parse_directives(program), [&](const std::string& op, int index, const GlobalDag&) {
    seen.push_back(op + std::to_string(index));
  });
  EXPECT_EQ(seen, (std::vector<std::string>{"split3", "place2", "finish-placement-1", "replicate1", "update-costs-1",
                                            "order0"}));
}

// Schedules are directive generators: the compiler, simulator and runtime must not know their names.
TEST(Layering, CompilerSimulatorAndRuntimeNeverNameASchedule) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (const char* file : {"dag.cpp", "directives.cpp", "lower.cpp", "program.cpp", "verifier.cpp", "compiler.cpp"})
    files.push_back(fs::path(PIPER_SOURCE_DIR) / "core/src" / file);
  for (const auto& e : fs::directory_iterator(fs::path(PIPER_SOURCE_DIR) / "core/src/passes"))
    files.push_back(e.path());
  for (const char* dir :
       {"sim/src", "sim/include", "search/src", "search/include", "gpu_runtime/src", "gpu_runtime/include"})
    for (const auto& e : fs::recursive_directory_iterator(fs::path(PIPER_SOURCE_DIR) / dir))
      if (e.is_regular_file()) files.push_back(e.path());
  ASSERT_GT(files.size(), 10u);
  for (const auto& file : files) {
    std::ifstream in(file);
    ASSERT_TRUE(in.good()) << file;
    std::stringstream ss;
    ss << in.rdbuf();
    std::string text = ss.str();
    std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
    for (const char* name :
         {"gpipe", "1f1b", "dualpipe", "zb-h1", "zb-h2", "zb-v", "zero bubble", "interleaved", "looped"})
      EXPECT_EQ(text.find(name), std::string::npos) << file << " mentions " << name;
  }
}

// A misspelt op or field names the nearest valid one.
TEST(Parse, MisspeltOpsAndFieldsSuggestTheNearest) {
  auto message = [](const char* text) {
    try {
      parse_directives(json::parse(text));
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(message(R"([{"op": "replicat", "filter": {}, "devices": [0, 1]}])")
                .rfind("directive 0 field 'op': unknown op 'replicat' (did you mean 'replicate'?) (expected place,", 0),
            0u);
  EXPECT_EQ(message(R"([{"op": "replicate", "filter": {}, "devices": [0, 1], "shard_optimiser": true}])")
                .rfind("directive 0 field 'shard_optimiser': unknown field for 'replicate' (did you mean "
                       "'shard_optimizer'?) (allowed: ",
                       0),
            0u);
}

// Front ends write programs through the typed builder: optional fields only when given, whole
// megabytes as integers, the published format exactly as written by hand; build() parses it.
TEST(ProgramBuilder, WritesThePublishedFormatAndBuildsTheTypedProgram) {
  ReplicateArgs zero3;
  zero3.bucket_size_mb = 25;
  zero3.shard_grads = zero3.shard_params = true;
  zero3.gather_unit = "block";
  zero3.shard_group = 2;
  ReplicateArgs plain;
  plain.bucket_size_mb = 2.5;
  ProgramBuilder b;
  b.split(Filter{}, 2)
      .place(region_filter(0), {0, 2, 4, 6}, "pp")
      .place(region_filter(1), {1, 3, 5, 7})
      .replicate(region_filter(0), {0, 2, 4, 6}, zero3)
      .replicate(region_filter(1), {1, 3, 5, 7}, plain)
      .shard(region_filter(0, "EP"), {0, 2, 4, 6}, "ep", 2)
      .tensor_parallel(region_filter(1), 2, true)
      .recompute(region_filter(1), "full")
      .sm_partition(16)
      .order({{Filter{{{"PP", 0}, {"MB", 0}}, {}, Pass::F}}, {Filter{{{"PP", 0}, {"MB", 1}}, {}, Pass::F}}});
  EXPECT_EQ(b.to_json(), json::parse(R"([
    {"op": "split", "filter": {}, "num_microbatches": 2},
    {"op": "place", "filter": {"PP": 0}, "devices": [0, 2, 4, 6], "stream": "pp"},
    {"op": "place", "filter": {"PP": 1}, "devices": [1, 3, 5, 7]},
    {"op": "replicate", "filter": {"PP": 0}, "devices": [0, 2, 4, 6], "bucket_size": 25, "shard_grads": true,
     "shard_params": true, "gather_unit": "block", "shard_group": 2},
    {"op": "replicate", "filter": {"PP": 1}, "devices": [1, 3, 5, 7], "bucket_size": 2.5},
    {"op": "shard", "filter": {"PP": 0, "EP": "*"}, "devices": [0, 2, 4, 6], "stream": "ep", "degree": 2},
    {"op": "tensor_parallel", "filter": {"PP": 1}, "degree": 2, "sequence_parallel": true},
    {"op": "recompute", "filter": {"PP": 1}, "mode": "full"},
    {"op": "sm_partition", "stream": "comm", "sms": 16},
    {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 0, "MB": 1, "PASS": "F"}]]}])"));
  EXPECT_TRUE(b.to_json().at(3).at("bucket_size").is_number_integer());
  const DirectiveProgram p = b.build();
  ASSERT_EQ(p.directives.size(), 10u);
  EXPECT_EQ(p.directives, b.program().directives);  // the typed program is the one its JSON form reads as
  const auto& r = std::get<ReplicateDirective>(p.directives[3]);
  EXPECT_EQ(r.bucket_size_mb, 25);
  EXPECT_TRUE(r.shard_params && r.gather_blocks && r.reduce_every_microbatch);
  EXPECT_EQ(r.shard_group, 2);
  EXPECT_EQ(std::get<PlaceDirective>(p.directives[2]).stream, "pp");  // the format's default
  EXPECT_EQ(std::get<ShardDirective>(p.directives[5]).degree, 2);
  EXPECT_EQ(std::get<SmPartitionDirective>(p.directives[8]).partition.sms, 16);
}

TEST(ProgramBuilder, RelabelsDevicesAndKeepsTheParsersErrors) {
  ProgramBuilder b(parse_directives(json::parse(
      R"([{"op": "place", "filter": {"PP": 0}, "devices": [0, 1]}, {"op": "split", "filter": {}, "num_microbatches": 2}])")));
  DirectiveProgram p = b.take();
  p.relabel_devices([](int d) { return 3 - d; });
  EXPECT_EQ(std::get<PlaceDirective>(p.directives.at(0)).devices, (std::vector<int>{3, 2}));
  EXPECT_EQ(p.to_json().at(0).at("devices"), json::parse("[3, 2]"));
  EXPECT_EQ(p.to_json().at(1), json::parse(R"({"op": "split", "filter": {}, "num_microbatches": 2})"));
  p.remove_if([](const Directive& d) { return std::holds_alternative<PlaceDirective>(d); });
  EXPECT_EQ(p.to_json(), json::parse(R"([{"op": "split", "filter": {}, "num_microbatches": 2}])"));
  ASSERT_EQ(p.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<SplitDirective>(p.directives[0]));
  ProgramBuilder bad;
  bad.tensor_parallel(region_filter(0), 1, true);
  try {
    bad.build();
    ADD_FAILURE() << "no error";
  } catch (const DirectiveError& e) {
    EXPECT_EQ(e.index(), 0);
    EXPECT_EQ(e.field(), "sequence_parallel");
  }
}
