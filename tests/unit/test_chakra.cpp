// Chakra export round trip: the .et files, read back with the generated protobuf code, hold one node
// per op of each device's plan, the plan's dependencies, matching send/recv pairs and collective types;
// each collective names its ASTRA-sim communicator group (pg_name), and the group file beside the
// traces lists exactly the plan's groups.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include <google/protobuf/io/coded_stream.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "et_def.pb.h"
#include "piper/chakra/export.hpp"
#include "piper/core/scenario.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/simulate.hpp"

namespace fs = std::filesystem;
namespace core = piper::core;
namespace pb = ChakraProtoMsg;

namespace {

struct Trace {
  pb::GlobalMetadata meta;
  std::vector<pb::Node> nodes;
};

// Reads a file the way Chakra's protolib decodeMessage does: varint32 size, then that many bytes.
Trace read_trace(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  google::protobuf::io::CodedInputStream coded(reinterpret_cast<const std::uint8_t*>(bytes.data()),
                                               static_cast<int>(bytes.size()));
  Trace t;
  bool first = true;
  std::uint32_t size = 0;
  while (coded.ReadVarint32(&size)) {
    std::string message;
    EXPECT_TRUE(coded.ReadString(&message, static_cast<int>(size))) << path;
    if (first) {
      EXPECT_TRUE(t.meta.ParseFromString(message)) << path;
      first = false;
    } else {
      pb::Node n;
      EXPECT_TRUE(n.ParseFromString(message)) << path;
      t.nodes.push_back(std::move(n));
    }
  }
  return t;
}

const pb::AttributeProto* attr(const pb::Node& n, const std::string& name) {
  for (const auto& a : n.attr())
    if (a.name() == name) return &a;
  return nullptr;
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  return nlohmann::json::parse(in);
}

core::Program compile(int pp, int dp, int ep, int zero, const std::string& schedule, int microbatches,
                      const std::string& model = "qwen3-9m") {
  core::Scenario s;
  s.model = model;
  s.strategy.pp = pp;
  s.strategy.dp = dp;
  s.strategy.ep = ep;
  s.strategy.zero = zero;
  s.strategy.schedule = schedule;
  s.strategy.microbatches = microbatches;
  return core::compile_scenario(s).result.program;
}

class Chakra : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("piper_chakra_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Exports `p` and checks every device's file against its plan; returns node types counted over all.
  std::map<std::string, int> round_trip(const core::Program& p) {
    const auto paths = piper::chakra::export_traces(p, dir_.string(), "t");
    EXPECT_EQ(static_cast<int>(paths.size()), p.num_devices);
    std::map<std::string, int> kinds;
    // Transfers by (src, dst, tag): the sending and the receiving side must each appear once, with
    // one size (ASTRA-sim pairs them by these three alone, and a replay waits on the smaller side).
    std::map<std::tuple<int, int, int>, std::pair<int, int>> transfers;
    std::map<std::tuple<int, int, int>, std::set<std::int64_t>> transfer_sizes;
    // ASTRA-sim's --comm-group-configuration file: {"<id>": [npu, ...]}, ids 1..N ("0" means all NPUs).
    const nlohmann::json groups = read_json(dir_ / "t.comm_groups.json");
    EXPECT_TRUE(groups.is_object());
    std::set<int> ids, expected_ids;
    for (const auto& [name, members] : groups.items()) ids.insert(std::stoi(name));
    for (int i = 1; i <= static_cast<int>(groups.size()); ++i) expected_ids.insert(i);
    EXPECT_EQ(ids, expected_ids) << "group ids are 1..N";
    // Which family each group id was named for: one family per id.
    std::map<std::string, int> family_of_group;
    for (int d = 0; d < p.num_devices; ++d) {
      const fs::path path = dir_ / ("t." + std::to_string(d) + ".et");
      EXPECT_EQ(paths[static_cast<std::size_t>(d)], path.string());
      const Trace t = read_trace(path);
      const core::Plan& plan = p.plan_for(d);
      EXPECT_EQ(static_cast<std::int64_t>(t.nodes.size()), plan.op_count()) << "device " << d;
      EXPECT_FALSE(t.meta.version().empty());

      // Map each node back to its op through the piper_stream / piper_index attributes.
      std::map<std::string, int> stream_index;
      for (int s = 0; s < static_cast<int>(plan.streams.size()); ++s)
        stream_index[plan.streams[static_cast<std::size_t>(s)].name] = s;
      std::map<std::uint64_t, core::OpRef> op_of;
      std::set<core::OpRef> seen;
      for (std::size_t i = 0; i < t.nodes.size(); ++i) {
        const pb::Node& n = t.nodes[i];
        EXPECT_EQ(n.id(), i) << "ids are 0..n-1 in file order";
        const core::OpRef ref{stream_index.at(attr(n, "piper_stream")->string_val()),
                              static_cast<int>(attr(n, "piper_index")->int64_val())};
        EXPECT_TRUE(seen.insert(ref).second) << "one node per op";
        op_of[n.id()] = ref;
      }
      for (const pb::Node& n : t.nodes) {
        const core::OpRef ref = op_of.at(n.id());
        const core::Op& op =
            plan.streams[static_cast<std::size_t>(ref.stream)].ops[static_cast<std::size_t>(ref.index)];
        // Dependencies: exactly the stream predecessor and the waits, all as data_deps, all earlier.
        std::set<core::OpRef> expected(op.waits.begin(), op.waits.end());
        if (ref.index > 0) expected.insert({ref.stream, ref.index - 1});
        std::set<core::OpRef> got;
        for (std::uint64_t dep : n.data_deps()) {
          EXPECT_LT(dep, n.id());
          got.insert(op_of.at(dep));
        }
        EXPECT_EQ(got, expected) << "device " << d << " node " << n.name();
        EXPECT_EQ(n.ctrl_deps_size(), 0);
        switch (op.kind) {
          case core::OpKind::Compute:
          case core::OpKind::Update:
            EXPECT_EQ(n.type(), pb::COMP_NODE);
            EXPECT_EQ(attr(n, "num_ops")->int64_val(), static_cast<std::int64_t>(op.flops));
            EXPECT_EQ(attr(n, "tensor_size")->uint64_val(), static_cast<std::uint64_t>(op.memory_bytes));
            kinds["COMP"] += 1;
            break;
          case core::OpKind::Send:
          case core::OpKind::Recv: {
            const bool send = op.kind == core::OpKind::Send;
            EXPECT_EQ(n.type(), send ? pb::COMM_SEND_NODE : pb::COMM_RECV_NODE);
            const int src = attr(n, "comm_src")->int32_val(), dst = attr(n, "comm_dst")->int32_val();
            EXPECT_EQ(send ? src : dst, d);
            EXPECT_EQ(attr(n, "comm_size")->int64_val(), op.bytes);
            const std::tuple<int, int, int> key{src, dst, attr(n, "comm_tag")->int32_val()};
            auto& pair = transfers[key];
            (send ? pair.first : pair.second) += 1;
            transfer_sizes[key].insert(attr(n, "comm_size")->int64_val());
            kinds[send ? "SEND" : "RECV"] += 1;
            break;
          }
          default: {
            EXPECT_EQ(n.type(), pb::COMM_COLL_NODE);
            const std::map<core::OpKind, std::pair<pb::CollectiveCommType, const char*>> expected_type = {
                {core::OpKind::AllReduce, {pb::ALL_REDUCE, "ALL_REDUCE"}},
                {core::OpKind::ReduceScatter, {pb::REDUCE_SCATTER, "REDUCE_SCATTER"}},
                {core::OpKind::AllGather, {pb::ALL_GATHER, "ALL_GATHER"}},
                {core::OpKind::AllToAll, {pb::ALL_TO_ALL, "ALL_TO_ALL"}}};
            const auto& [type, name] = expected_type.at(op.kind);
            EXPECT_EQ(attr(n, "comm_type")->int64_val(), type);
            // ASTRA-sim's all-gather size is each rank's part (ceil(bytes / n)); the others' the full buffer.
            const std::int64_t ranks = static_cast<std::int64_t>(p.group_of(op.family, d).size());
            EXPECT_EQ(attr(n, "comm_size")->int64_val(),
                      op.kind == core::OpKind::AllGather ? (op.bytes + ranks - 1) / ranks : op.bytes)
                << n.name();
            EXPECT_EQ(attr(n, "piper_bytes")->int64_val(), op.bytes);
            // pg_name: a group of the file holding exactly this op's group in the plan.
            const pb::AttributeProto* pg = attr(n, "pg_name");
            EXPECT_TRUE(pg != nullptr && pg->value_case() == pb::AttributeProto::kStringVal) << n.name();
            if (pg != nullptr) {
              EXPECT_TRUE(groups.contains(pg->string_val())) << pg->string_val();
              if (groups.contains(pg->string_val())) {
                EXPECT_EQ(groups.at(pg->string_val()).get<std::vector<int>>(), p.group_of(op.family, d)) << n.name();
              }
              const auto [it, inserted] = family_of_group.emplace(pg->string_val(), op.family);
              EXPECT_EQ(it->second, op.family) << "group " << pg->string_val() << " serves one family";
            }
            kinds[name] += 1;
          }
        }
      }
    }
    for (const auto& [key, sides] : transfers) EXPECT_EQ(sides, std::make_pair(1, 1)) << "unmatched transfer";
    for (const auto& [key, sizes] : transfer_sizes) EXPECT_EQ(sizes.size(), 1u) << "a send and its recv differ in size";
    // The file holds the groups of the families the collectives use, each once: every group of such a
    // family (Program::groups) and nothing else.
    std::set<int> families;
    for (const auto& [name, f] : family_of_group) families.insert(f);
    std::multiset<std::vector<int>> expected_groups, file_groups;
    for (int f : families)
      for (const auto& g : p.groups(f)) expected_groups.insert(g);
    for (const auto& [name, members] : groups.items()) file_groups.insert(members.get<std::vector<int>>());
    EXPECT_EQ(file_groups, expected_groups);
    return kinds;
  }
  fs::path dir_;
};

}  // namespace

TEST_F(Chakra, PipelineExpertZeroPlan) {
  const core::Program p = compile(2, 2, 2, 1, "1f1b", 4);
  const auto kinds = round_trip(p);
  // PP 2 with 4 microbatches moves activations forward and gradients back: transfers on both sides.
  EXPECT_GT(kinds.at("SEND"), 0);
  EXPECT_EQ(kinds.at("SEND"), kinds.at("RECV"));
  EXPECT_GT(kinds.at("ALL_TO_ALL"), 0);      // EP 2
  EXPECT_GT(kinds.at("REDUCE_SCATTER"), 0);  // ZeRO-1 gradients
  EXPECT_GT(kinds.at("ALL_GATHER"), 0);      // ZeRO-1 updated shards
  EXPECT_EQ(kinds.count("ALL_REDUCE"), 0u);
  std::int64_t nodes = 0;
  for (const auto& [k, n] : kinds) nodes += n;
  EXPECT_EQ(nodes, p.total_ops());
}

// ZeRO-3 on 8 devices (PP 2 x DP 4): parameter all-gathers and gradient reduce-scatters run in the
// 4-device DP group of each stage; the two stages' groups are distinct and disjoint.
TEST_F(Chakra, Zero3GroupsPerStage) {
  const core::Program p = compile(2, 4, 1, 3, "1f1b", 4);
  const auto kinds = round_trip(p);
  EXPECT_GT(kinds.at("REDUCE_SCATTER"), 0);
  EXPECT_GT(kinds.at("ALL_GATHER"), 0);
  const nlohmann::json groups = read_json(dir_ / "t.comm_groups.json");
  std::set<std::vector<int>> distinct;
  for (const auto& [name, members] : groups.items()) {
    const auto m = members.get<std::vector<int>>();
    EXPECT_EQ(m.size(), 4u) << name;
    distinct.insert(m);
  }
  EXPECT_EQ(distinct.size(), 2u) << "one DP group per stage";
  std::set<int> all;
  for (const auto& g : distinct) all.insert(g.begin(), g.end());
  EXPECT_EQ(all.size(), 8u) << "the stages' groups are disjoint and cover the devices";
}

// EP 2 inside DP 2 with PP 2: the all-to-alls run in 2-device expert groups, never over all 8 NPUs
// (what made ASTRA-sim deadlock before pg_name was written).
TEST_F(Chakra, ExpertAllToAllInItsGroup) {
  const core::Program p = compile(2, 4, 2, 0, "dualpipev", 4);
  round_trip(p);
  for (int d = 0; d < p.num_devices; ++d) {
    const Trace t = read_trace(dir_ / ("t." + std::to_string(d) + ".et"));
    for (const pb::Node& n : t.nodes)
      if (n.type() == pb::COMM_COLL_NODE && attr(n, "comm_type")->int64_val() == pb::ALL_TO_ALL) {
        const auto members =
            read_json(dir_ / "t.comm_groups.json").at(attr(n, "pg_name")->string_val()).get<std::vector<int>>();
        EXPECT_EQ(members.size(), 2u) << n.name();
        EXPECT_NE(std::find(members.begin(), members.end(), d), members.end()) << "device " << d << " is in its group";
      }
  }
}

// DualPipeV with expert parallelism on a real MoE (qwen3-30b-a3b, the shape docs/simulator.md
// exports), under every ZeRO level and with TP, CP and chunked all-to-alls: the V puts both ends of
// the pipeline on rank 0, so transfers run both ways between the same two devices and the
// overlapped F&B steps interleave two microbatches' all-to-alls; each trace still depends only on
// earlier nodes, every send meets one receive of its size, and each collective names its plan group.
TEST_F(Chakra, DualPipeVExpertParallelTracesAreConsistent) {
  for (int zero : {0, 1, 3}) {
    SCOPED_TRACE("zero " + std::to_string(zero));
    const core::Program p = compile(2, 2, 2, zero, "dualpipev", 4, "qwen3-30b-a3b");
    const auto kinds = round_trip(p);
    EXPECT_GT(kinds.at("SEND"), 0);
    EXPECT_GT(kinds.at("ALL_TO_ALL"), 0);
    fs::remove_all(dir_);
  }
  core::Scenario s;
  s.model = "qwen3-30b-a3b";
  s.strategy.pp = 2;
  s.strategy.dp = 2;
  s.strategy.ep = 2;
  s.strategy.schedule = "dualpipev";
  s.strategy.microbatches = 4;
  s.strategy.tp = 2;
  s.strategy.sequence_parallel = true;
  s.strategy.a2a_chunks = 2;
  round_trip(core::compile_scenario(s).result.program);
  fs::remove_all(dir_);
  s.strategy.tp = 1;
  s.strategy.sequence_parallel = false;
  s.strategy.cp = 2;
  round_trip(core::compile_scenario(s).result.program);
}

// Id order: ASTRA-sim issues ready nodes by id, one communication at a time per NPU, so a collective
// never takes an id while a compute op or a transfer is ready: every non-collective node numbered
// after a collective c depends on c or on a node numbered after it.
TEST_F(Chakra, CollectivesYieldToReadyComputeAndTransfers) {
  for (const core::Program& p : {compile(2, 4, 1, 3, "1f1b", 4), compile(2, 4, 2, 1, "dualpipev", 4)}) {
    piper::chakra::export_traces(p, dir_.string(), "o");
    for (int d = 0; d < p.num_devices; ++d) {
      const Trace t = read_trace(dir_ / ("o." + std::to_string(d) + ".et"));
      int checked = 0;
      for (const pb::Node& c : t.nodes) {
        if (c.type() != pb::COMM_COLL_NODE) continue;
        for (std::size_t x = c.id() + 1; x < t.nodes.size(); ++x) {
          const pb::Node& n = t.nodes[x];
          if (n.type() == pb::COMM_COLL_NODE) continue;
          std::uint64_t latest = 0;
          for (std::uint64_t dep : n.data_deps()) latest = std::max(latest, dep);
          EXPECT_TRUE(n.data_deps_size() > 0 && latest >= c.id())
              << "device " << d << ": " << n.name() << " was ready before collective " << c.name();
          ++checked;
        }
      }
      EXPECT_GT(checked, 0) << "device " << d;
    }
  }
}

// Without collectives the group file is an empty object (ASTRA-sim reads it all the same).
TEST_F(Chakra, PipelineOnlyEmptyGroupFile) {
  const core::Program p = compile(2, 1, 1, 0, "1f1b", 2);
  piper::chakra::export_traces(p, dir_.string(), "t");
  EXPECT_EQ(read_json(dir_ / "t.comm_groups.json"), nlohmann::json::object());
}

// duration_micros: 0 without compute times; with them, the caller's seconds in whole microseconds on
// COMPUTE and UPD nodes only.
TEST_F(Chakra, ComputeTimesOnComputeNodes) {
  const core::Program p = compile(2, 2, 1, 1, "1f1b", 2);
  piper::chakra::export_traces(p, dir_.string(), "plain");
  for (const pb::Node& n : read_trace(dir_ / "plain.0.et").nodes) EXPECT_EQ(n.duration_micros(), 0u) << n.name();
  piper::chakra::ExportOptions options;
  options.prefix = "timed";
  // 1 us per 10^6 FLOPs plus 2.4 us, so the rounding (2.4 -> 2) is visible.
  options.compute_seconds = [](int, const core::Op& op) { return op.flops * 1e-12 + 2.4e-6; };
  piper::chakra::export_traces(p, dir_.string(), options);
  int timed = 0;
  for (const pb::Node& n : read_trace(dir_ / "timed.1.et").nodes) {
    const std::string kind = attr(n, "piper_kind")->string_val();
    if (n.type() == pb::COMP_NODE) {
      const double flops = static_cast<double>(attr(n, "num_ops")->int64_val());
      EXPECT_EQ(n.duration_micros(), static_cast<std::uint64_t>(std::llround(flops * 1e-6 + 2.4))) << n.name();
      ++timed;
    } else {
      EXPECT_EQ(n.duration_micros(), 0u) << n.name();
    }
  }
  EXPECT_GT(timed, 0);
}

// A compute time that is not a duration (NaN, negative) is an error naming the op; nothing is written.
TEST_F(Chakra, BadComputeTimeWritesNothing) {
  const core::Program p = compile(2, 1, 1, 0, "1f1b", 2);
  for (const double bad : {-1.0, std::nan("")}) {
    piper::chakra::ExportOptions options;
    options.compute_seconds = [bad](int, const core::Op&) { return bad; };
    try {
      piper::chakra::export_traces(p, (dir_ / "out").string(), options);
      ADD_FAILURE() << "accepted compute time " << bad;
    } catch (const core::Error& e) {
      EXPECT_NE(std::string(e.what()).find("compute time"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(dir_ / "out"));
  }
}

TEST_F(Chakra, DataParallelAllReduce) {
  const auto kinds = round_trip(compile(1, 4, 1, 0, "1f1b", 2));
  EXPECT_GT(kinds.at("ALL_REDUCE"), 0);
  EXPECT_EQ(kinds.count("SEND"), 0u);
}

TEST_F(Chakra, GlobalMetadataFirst) {
  const core::Program p = compile(2, 1, 1, 0, "gpipe", 2);
  piper::chakra::export_traces(p, dir_.string(), "m");
  const Trace t = read_trace(dir_ / "m.1.et");
  std::map<std::string, const pb::AttributeProto*> a;
  for (const auto& x : t.meta.attr()) a[x.name()] = &x;
  EXPECT_EQ(a.at("schema")->string_val(), "1.0.2-chakra.1.0.0");
  EXPECT_EQ(a.at("device")->int64_val(), 1);
  EXPECT_EQ(a.at("devices")->int64_val(), 2);
}

// `piper export-chakra`: a bad plan is one line naming the file, exit status 2, and no folder.
TEST_F(Chakra, CliBadPlanWritesNothing) {
  fs::create_directories(dir_);
  const fs::path plan = dir_ / "bad-plan.json", out = dir_ / "out";
  std::ofstream(plan) << "{\"format\": \"piper-program\"}";
  const std::string cmd = std::string(PIPER_CLI) + " export-chakra " + plan.string() + " -o " + out.string() + " 2>" +
                          (dir_ / "err.txt").string();
  const int status = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(status), 2);
  std::ifstream err(dir_ / "err.txt");
  std::string line, extra;
  std::getline(err, line);
  EXPECT_EQ(line.rfind("piper: error: " + plan.string() + ": ", 0), 0u) << line;
  EXPECT_FALSE(std::getline(err, extra)) << "one line only";
  EXPECT_FALSE(fs::exists(out));
}

TEST_F(Chakra, CliWritesOneFilePerDevice) {
  fs::create_directories(dir_);
  const fs::path plan = dir_ / "plan.json", out = dir_ / "traces";
  const std::string compile = std::string(PIPER_CLI) + " compile --model qwen3-9m --pp 2 --dp 2 --microbatches 2 -o " +
                              plan.string() + " >/dev/null";
  ASSERT_EQ(std::system(compile.c_str()), 0);
  const std::string cmd =
      std::string(PIPER_CLI) + " export-chakra " + plan.string() + " -o " + out.string() + " >/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  for (int d = 0; d < 4; ++d) EXPECT_TRUE(fs::exists(out / ("piper." + std::to_string(d) + ".et"))) << d;
  EXPECT_FALSE(fs::exists(out / "piper.4.et"));
  EXPECT_TRUE(fs::exists(out / "piper.comm_groups.json"));
}

// `piper export-chakra --compute-times`: every compute node carries the simulator's cost-model time
// (CostModel::compute_seconds on the default cluster, the per-kernel model) in whole microseconds,
// and the group file is written beside the traces.
TEST_F(Chakra, CliComputeTimesFromCostModel) {
  fs::create_directories(dir_);
  const fs::path plan = dir_ / "plan.json", out = dir_ / "traces";
  const std::string compile = std::string(PIPER_CLI) +
                              " compile --model qwen3-9m --pp 2 --dp 2 --zero 1 --microbatches 2 -o " + plan.string() +
                              " >/dev/null";
  ASSERT_EQ(std::system(compile.c_str()), 0);
  const std::string cmd = std::string(PIPER_CLI) + " export-chakra " + plan.string() + " -o " + out.string() +
                          " --compute-times >/dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_TRUE(fs::exists(out / "piper.comm_groups.json"));
  std::ifstream in(plan);
  const core::Program p = core::Program::from_json(nlohmann::json::parse(in));
  const piper::sim::CostModel cost(
      piper::sim::with_devices(piper::sim::load_cluster(piper::sim::kDefaultCluster), p.num_devices));
  for (int d = 0; d < p.num_devices; ++d) {
    const core::Plan& plan_d = p.plan_for(d);
    std::map<std::string, int> stream_index;
    for (int s = 0; s < static_cast<int>(plan_d.streams.size()); ++s)
      stream_index[plan_d.streams[static_cast<std::size_t>(s)].name] = s;
    int compute = 0;
    for (const pb::Node& n : read_trace(out / ("piper." + std::to_string(d) + ".et")).nodes) {
      if (n.type() != pb::COMP_NODE) continue;
      const core::Op& op =
          plan_d.streams[static_cast<std::size_t>(stream_index.at(attr(n, "piper_stream")->string_val()))]
              .ops[static_cast<std::size_t>(attr(n, "piper_index")->int64_val())];
      const double seconds = cost.compute_seconds(p, d, op);
      EXPECT_GT(seconds, 0) << n.name();
      EXPECT_EQ(n.duration_micros(), static_cast<std::uint64_t>(std::llround(seconds * 1e6))) << n.name();
      ++compute;
    }
    EXPECT_GT(compute, 0) << "device " << d;
  }
}

// --cluster and --calibration only cost compute times: without --compute-times they are an error.
TEST_F(Chakra, CliClusterNeedsComputeTimes) {
  fs::create_directories(dir_);
  const fs::path plan = dir_ / "plan.json", out = dir_ / "traces";
  const std::string compile =
      std::string(PIPER_CLI) + " compile --model qwen3-9m --pp 2 --microbatches 2 -o " + plan.string() + " >/dev/null";
  ASSERT_EQ(std::system(compile.c_str()), 0);
  const std::string cmd = std::string(PIPER_CLI) + " export-chakra " + plan.string() + " -o " + out.string() +
                          " --cluster dgx-h100 >/dev/null 2>" + (dir_ / "err.txt").string();
  EXPECT_EQ(WEXITSTATUS(std::system(cmd.c_str())), 2);
  std::ifstream err(dir_ / "err.txt");
  std::string line;
  std::getline(err, line);
  EXPECT_NE(line.find("--compute-times"), std::string::npos) << line;
  EXPECT_FALSE(fs::exists(out));
}

// --compute-times on a cluster whose devices share GPUs ("devices_per_gpu"): each compute node gave
// a whole GPU's time, where the simulator splits a GPU's compute among its devices computing at that
// moment. Now each node carries the op's simulated time. By hand, on one H200 holding 2 devices: under
// DP 2 both devices run the same ops at the same moments, so every forward and update takes twice its
// time on a whole GPU (a backward at least twice: see below); under PP 2 with one microbatch the last stage's forward
// runs while the first stage waits for its backward, so it takes its whole-GPU time, not twice (a fixed x2 would be
// wrong there).
TEST_F(Chakra, CliComputeTimesOnSharedGpusAreTheSimulatedOnes) {
  fs::create_directories(dir_);
  const fs::path shared = dir_ / "shared.json";
  std::ofstream(shared) << R"({"preset": "dgx-h200", "nodes": 1, "node": {"devices_per_gpu": 2}})";
  auto durations = [&](const std::string& flags, const std::string& cluster, const std::string& name) {
    const fs::path plan = dir_ / (name + ".plan.json"), out = dir_ / name;
    const std::string compile =
        std::string(PIPER_CLI) + " compile --model qwen3-9m " + flags + " -o " + plan.string() + " >/dev/null";
    EXPECT_EQ(std::system(compile.c_str()), 0) << compile;
    const std::string cmd = std::string(PIPER_CLI) + " export-chakra " + plan.string() + " -o " + out.string() +
                            " --compute-times --cluster " + cluster + " >" + (dir_ / "out.txt").string();
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
    std::map<std::pair<int, std::string>, std::uint64_t> micros;  // (device, node name) -> duration
    for (int d = 0; d < 2; ++d)
      for (const pb::Node& n : read_trace(out / ("piper." + std::to_string(d) + ".et")).nodes)
        if (n.type() == pb::COMP_NODE) micros[{d, n.name()}] = n.duration_micros();
    return micros;
  };
  const auto whole = durations("--dp 2", "dgx-h200", "dp-whole");
  const auto halves = durations("--dp 2", shared.string(), "dp-shared");
  std::ifstream said(dir_ / "out.txt");
  const std::string text((std::istreambuf_iterator<char>(said)), {});
  EXPECT_NE(text.find("as simulated on cluster"), std::string::npos) << text;
  ASSERT_EQ(whole.size(), halves.size());
  ASSERT_GT(whole.size(), 4u);
  for (const auto& [key, us] : whole) {
    ASSERT_TRUE(halves.contains(key)) << key.second;
    EXPECT_GE(us, 5u) << key.second;  // long enough for whole microseconds to show the factor
    // Whole microseconds: 2 x a rounded time is off by at most 1. A backward also overlaps the
    // gradient all-reduce of the segments after it (device copies on the GPU), whose SMs slow it
    // further in the simulation: at least twice there.
    if (key.second.rfind("B ", 0) == 0)
      EXPECT_GE(static_cast<double>(halves.at(key)), 2.0 * static_cast<double>(us) - 1.0) << key.second;
    else
      EXPECT_NEAR(static_cast<double>(halves.at(key)), 2.0 * static_cast<double>(us), 1.0) << key.second;
  }
  const auto pp_whole = durations("--pp 2 --microbatches 1", "dgx-h200", "pp-whole");
  const auto pp_shared = durations("--pp 2 --microbatches 1", shared.string(), "pp-shared");
  int alone = 0;
  for (const auto& [key, us] : pp_whole)
    if (key.first == 1 && key.second.rfind("F ", 0) == 0) {
      EXPECT_EQ(pp_shared.at(key), us) << key.second;
      ++alone;
    }
  EXPECT_GE(alone, 1);  // the forward of each of the stage's segments
}
