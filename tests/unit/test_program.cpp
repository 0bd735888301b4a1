// Tests of the Program: kind names, peers and communicator groups, the exact JSON round trip with
// field-naming errors, and atomic file writes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "piper/core/error.hpp"
#include "piper/core/program.hpp"

using namespace piper::core;
using nlohmann::json;

namespace {

Op make_op(OpKind kind, const std::string& label, int node) {
  Op op;
  op.kind = kind;
  op.node = node;
  op.label = label;
  return op;
}

// Two devices, one plan each, two streams each: device 0 computes F and sends its output to device 1,
// which receives it and computes; both then all-reduce over the family {0, 1}.
Program small_program() {
  Program p;
  p.model_name = "tiny";
  p.training.seq_len = 128;
  p.training.micro_batch_size = 2;
  p.training.precision = Precision::FP32;
  p.microbatches = 1;
  p.num_devices = 2;
  p.device_sets = {{0}, {1}, {0, 1}};
  p.families = {CommFamily{2, 2, 1, FamilyPurpose::Dp}};
  p.plan_of_device = {0, 1};

  Plan p0;
  p0.streams = {{"compute", {}}, {"comm", {}}};
  Op f0 = make_op(OpKind::Compute, "F mb0 PP0", 1);
  f0.pass = Pass::F;
  f0.tags = {{"PP", 0}, {"MB", 0}};
  f0.microbatch = 0;
  f0.flops = 1.0e12 / 3.0;  // not representable in a short decimal: checks the double round trip
  f0.memory_bytes = 123456789012;
  f0.device_set = 0;
  f0.uses = {0, 1};
  Op send = make_op(OpKind::Send, "SEND act", 2);
  send.pair = 0;
  send.bytes = 4096;
  send.pass = Pass::F;
  send.microbatch = 0;
  send.device_set = 0;
  send.peer_set = 1;
  send.waits = {{0, 0}};
  send.uses = {1};
  Op ar0 = make_op(OpKind::AllReduce, "AR grads", 5);
  ar0.pair = 1;
  ar0.bytes = 1 << 20;
  ar0.device_set = 2;
  ar0.family = 0;
  ar0.waits = {{0, 0}};
  p0.streams[0].ops = {f0};
  p0.streams[1].ops = {send, ar0};
  p0.buffers = {Buffer{"params", BufferKind::Parameters, 1000, {}, {}},
                Buffer{"act mb0", BufferKind::Activations, 4096, {0, 0}, {1, 0}}};

  Plan p1;
  p1.streams = {{"compute", {}}, {"comm", {}}};
  Op recv = make_op(OpKind::Recv, "RECV act", 2);
  recv.pair = 0;
  recv.bytes = 4096;
  recv.pass = Pass::F;
  recv.microbatch = 0;
  recv.device_set = 1;
  recv.peer_set = 0;
  recv.uses = {0};
  Op f1 = make_op(OpKind::Compute, "F mb0 PP1", 3);
  f1.pass = Pass::F;
  f1.flops = 0.1;
  f1.microbatch = 0;
  f1.device_set = 1;
  f1.waits = {{1, 0}};
  f1.uses = {0};
  Op ar1 = ar0;
  ar1.node = 6;
  ar1.waits = {{0, 0}};
  p1.streams[0].ops = {f1};
  p1.streams[1].ops = {recv, ar1};
  p1.buffers = {Buffer{"recv act", BufferKind::Received, 4096, {1, 0}, {0, 0}}};

  p.plans = {p0, p1};
  p.stats.dag_nodes = 7;
  p.stats.nodes_by_kind = {{"F", 2}, {"SEND", 1}};
  p.stats.compile_seconds = 0.25;
  p.stats.compiler_peak_rss_bytes = 1 << 30;
  return p;
}

std::string error_of(const json& j) {
  try {
    (void)Program::from_json(j);
  } catch (const PlanError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Program, KindNamesRoundTrip) {
  const std::vector<std::pair<OpKind, std::string>> ops = {{OpKind::Compute, "COMPUTE"},
                                                           {OpKind::Update, "UPD"},
                                                           {OpKind::Send, "SEND"},
                                                           {OpKind::Recv, "RECV"},
                                                           {OpKind::AllReduce, "ALL_REDUCE"},
                                                           {OpKind::ReduceScatter, "REDUCE_SCATTER"},
                                                           {OpKind::AllGather, "ALL_GATHER"},
                                                           {OpKind::AllToAll, "ALL_TO_ALL"}};
  for (const auto& [kind, name] : ops) {
    EXPECT_EQ(to_string(kind), name);
    EXPECT_EQ(op_kind_from_string(name), kind);
  }
  const std::vector<std::pair<BufferKind, std::string>> buffers = {
      {BufferKind::Parameters, "parameters"},
      {BufferKind::Gradients, "gradients"},
      {BufferKind::OptimizerStates, "optimizer_states"},
      {BufferKind::Activations, "activations"},
      {BufferKind::Received, "received"},
      {BufferKind::GatheredParameters, "gathered_parameters"}};
  for (const auto& [kind, name] : buffers) {
    EXPECT_EQ(to_string(kind), name);
    EXPECT_EQ(buffer_kind_from_string(name), kind);
  }
  EXPECT_THROW(op_kind_from_string("FOO"), PlanError);
  EXPECT_THROW(buffer_kind_from_string("weights"), PlanError);
}

TEST(Program, PeersAndCounts) {
  Program p = small_program();
  EXPECT_EQ(p.position_in(2, 1), 1);
  EXPECT_EQ(p.position_in(0, 1), -1);
  EXPECT_EQ(p.peer_of(p.plans[0].streams[1].ops[0], 0), 1);
  EXPECT_EQ(p.peer_of(p.plans[1].streams[1].ops[0], 1), 0);
  EXPECT_EQ(p.plans[0].op_count(), 3);
  // Two devices with 3 ops each.
  EXPECT_EQ(p.total_ops(), 6);
  // One plan shared by three devices counts its ops three times.
  p.num_devices = 4;
  p.plan_of_device = {0, 1, 0, 0};
  EXPECT_EQ(p.total_ops(), 3 * 3 + 3);
}

TEST(Program, GroupsConsecutiveAndStrided) {
  Program p;
  p.num_devices = 24;
  // Even devices 0..22 in order: positions 0..11.
  std::vector<int> evens;
  for (int d = 0; d < 24; d += 2) evens.push_back(d);
  p.device_sets = {evens};
  p.families = {CommFamily{0, 4, 1, FamilyPurpose::Ep}, CommFamily{0, 4, 3, FamilyPurpose::Dp}};
  // Stride 1, group size 4: consecutive chunks of positions.
  std::vector<std::vector<int>> chunks = {{0, 2, 4, 6}, {8, 10, 12, 14}, {16, 18, 20, 22}};
  EXPECT_EQ(p.groups(0), chunks);
  EXPECT_EQ(p.group_of(0, 10), (std::vector<int>{8, 10, 12, 14}));
  // Stride 3: group j holds positions j, j+3, j+6, j+9.
  std::vector<std::vector<int>> strided = {{0, 6, 12, 18}, {2, 8, 14, 20}, {4, 10, 16, 22}};
  EXPECT_EQ(p.groups(1), strided);
  EXPECT_EQ(p.group_of(1, 14), (std::vector<int>{2, 8, 14, 20}));
  EXPECT_TRUE(p.group_of(1, 3).empty());                         // odd devices are not in the family
  p.families.push_back(CommFamily{0, 5, 1, FamilyPurpose::Dp});  // 12 devices do not split into groups of 5
  EXPECT_THROW(p.groups(2), PlanError);
}

TEST(Program, JsonRoundTripIsExact) {
  Program p = small_program();
  std::string text = p.to_json().dump();
  Program q = Program::from_json(json::parse(text));
  EXPECT_TRUE(q == p);
  EXPECT_EQ(q.plans[0].streams[0].ops[0].flops, 1.0e12 / 3.0);  // bit-exact
  EXPECT_EQ(q.plans[1].streams[0].ops[0].flops, 0.1);
  EXPECT_EQ(q.stats.dag_nodes, 7);
  EXPECT_EQ(q.stats.nodes_by_kind, (std::map<std::string, std::int64_t>{{"F", 2}, {"SEND", 1}}));
  EXPECT_EQ(q.stats.compile_seconds, 0.25);
  EXPECT_EQ(q.stats.compiler_peak_rss_bytes, 1 << 30);
  EXPECT_EQ(q.training.precision, Precision::FP32);
  EXPECT_EQ(q.training.seq_len, 128);
  // Serialising again gives the same text.
  EXPECT_EQ(q.to_json().dump(), text);
}

TEST(Program, JsonOmitsDefaultOpFields) {
  json j = small_program().to_json();
  const json& f1 = j["plans"][1]["streams"][0]["ops"][0];
  EXPECT_FALSE(f1.contains("peer_set"));
  EXPECT_FALSE(f1.contains("family"));
  EXPECT_FALSE(f1.contains("bytes"));
  EXPECT_FALSE(f1.contains("tags"));
  EXPECT_EQ(f1["microbatch"], 0);
  EXPECT_FALSE(j["plans"][1]["streams"][1]["ops"][1].contains("microbatch"));  // the ALL_REDUCE: none
  EXPECT_TRUE(f1.contains("waits"));
  EXPECT_FALSE(j["plans"][0]["buffers"][0].contains("alloc"));  // persistent
}

TEST(Program, EqualityComparesEveryFieldButStats) {
  const Program p = small_program();
  Program q = p;
  q.stats.dag_nodes = 99;
  q.stats.compile_seconds = 9;
  EXPECT_TRUE(q == p);

  std::vector<std::function<void(Program&)>> changes = {
      [](Program& x) {
        auto& f = x.plans[0].streams[0].ops[0].flops;
        f = std::nextafter(f, 1e300);
      },
      [](Program& x) { x.plans[0].streams[1].ops[0].waits.clear(); },
      [](Program& x) { x.plans[1].streams[1].ops[0].bytes += 1; },
      [](Program& x) { x.plans[0].streams[0].ops[0].tags["PP"] = 1; },
      [](Program& x) {
        x.plans[0].buffers[1].free = {0, 0};
      },
      [](Program& x) { x.plans[1].streams[1].name = "pp"; },
      [](Program& x) { x.families[0].purpose = FamilyPurpose::Ep; },
      [](Program& x) {
        x.plan_of_device = {1, 0};
      },
      [](Program& x) {
        x.device_sets[2] = {1, 0};
      },
      [](Program& x) { x.training.precision = Precision::BF16; },
      [](Program& x) { x.microbatches = 2; },
      [](Program& x) { x.plans[1].streams[0].ops[0].microbatch = -1; },
  };
  for (std::size_t i = 0; i < changes.size(); ++i) {
    Program r = p;
    changes[i](r);
    EXPECT_FALSE(r == p) << "change " << i;
  }
}

// "stats": {"dag_nodes": -1} was read and printed as "(-1 DAG nodes, 46 ops)": a count or size below
// zero is refused, naming the field.
TEST(Program, NegativeStatsAreRefusedNamingTheField) {
  const json good = small_program().to_json();
  for (const auto& [path, value] : std::vector<std::pair<std::string, json>>{
           {"dag_nodes", -1}, {"compile_seconds", -0.5}, {"compiler_peak_rss_bytes", -1}}) {
    json j = good;
    j["stats"][path] = value;
    EXPECT_EQ(error_of(j), "plan: field 'stats." + path + "': must be >= 0, got " + value.dump()) << path;
  }
  json j = good;
  j["stats"]["nodes_by_kind"]["F"] = -2;
  EXPECT_EQ(error_of(j), "plan: field 'stats.nodes_by_kind.F': must be >= 0, got -2");
  j = good;
  j["stats"]["dag_nodes"] = 0;
  EXPECT_EQ(error_of(j), "(no error)");
}

TEST(Program, FromJsonNamesTheField) {
  const json good = small_program().to_json();
  {
    json j = good;
    j["plans"][1]["streams"][0]["ops"][0].erase("kind");
    EXPECT_EQ(error_of(j), "plan: field 'plans[1].streams[0].ops[0].kind': missing");
  }
  {
    json j = good;
    j["plans"][0]["streams"][1]["ops"][1]["kind"] = "FOO";
    EXPECT_EQ(error_of(j), "plan: field 'plans[0].streams[1].ops[1].kind': unknown op kind 'FOO'");
  }
  {
    json j = good;
    j["plans"][0]["streams"][1]["ops"][0]["bytes"] = "many";
    EXPECT_EQ(error_of(j), "plan: field 'plans[0].streams[1].ops[0].bytes': expected an integer, got string");
  }
  {
    json j = good;
    j["plans"][0]["streams"][1]["ops"][0]["waits"] = json::array({json::array({0, 3})});
    EXPECT_EQ(error_of(j), "plan: field 'plans[0].streams[1].ops[0].waits[0]': op 3 out of range [0, 1)");
  }
  {
    json j = good;
    j["plans"][1]["streams"][0]["ops"][0]["uses"] = json::array({0, 4});
    EXPECT_EQ(error_of(j), "plan: field 'plans[1].streams[0].ops[0].uses[1]': buffer 4 out of range [0, 1)");
  }
  {
    json j = good;
    j["plans"][0]["streams"][1]["ops"][1]["family"] = 1;
    EXPECT_EQ(error_of(j), "plan: field 'plans[0].streams[1].ops[1].family': family 1 out of range [0, 1)");
  }
  {
    json j = good;
    j["plans"][0]["buffers"][1]["free"] = json::array({2, 0});
    EXPECT_EQ(error_of(j), "plan: field 'plans[0].buffers[1].free': stream 2 out of range [0, 2)");
  }
  {
    json j = good;
    j["plan_of_device"][1] = 2;
    EXPECT_EQ(error_of(j), "plan: field 'plan_of_device[1]': plan 2 out of range [0, 2)");
  }
  {
    json j = good;
    j["device_sets"][2][1] = 5;
    EXPECT_EQ(error_of(j), "plan: field 'device_sets[2][1]': device 5 out of range [0, 2)");
  }
  {
    json j = good;
    j["training"]["precision"] = "int4";
    EXPECT_EQ(error_of(j),
              "plan: field 'training.precision': unknown precision 'int4' (expected bf16, fp16, fp32, tf32 or fp8)");
  }
  {
    json j = good;
    j.erase("families");
    EXPECT_EQ(error_of(j), "plan: field 'families': missing");
  }
  {
    json j = good;
    j["plans"][1]["streams"][0]["ops"][0]["microbatch"] = 1;  // the program has 1 microbatch
    EXPECT_EQ(error_of(j), "plan: field 'plans[1].streams[0].ops[0].microbatch': microbatch 1 out of range [0, 1)");
    j["plans"][1]["streams"][0]["ops"][0]["microbatch"] = -2;
    EXPECT_EQ(error_of(j), "plan: field 'plans[1].streams[0].ops[0].microbatch': microbatch -2 out of range [0, 1)");
  }
  {
    json j = good;
    j["families"][0]["purpose"] = "pp";
    EXPECT_EQ(error_of(j),
              "plan: field 'families[0].purpose': unknown family purpose 'pp' (expected one of dp, dp-ep, dp-shard, "
              "dp-replicate, ep, tp, tied-embedding, cp, grad-norm)");
  }
  {
    // Version 1 plans have no per-op microbatch, and it cannot be derived from tags whose split
    // dimension names the plan does not record: refused in one line.
    json j = good;
    j["version"] = 1;
    EXPECT_EQ(error_of(j),
              "plan: field 'version': version 1 plans carry no per-op microbatch; compile the plan again with this "
              "piper (expected 3)");
    // Version 2 plans have no pairing ids: who meets whom is not guessed from node ids or positions.
    j["version"] = 2;
    EXPECT_EQ(error_of(j),
              "plan: field 'version': version 2 plans carry no pairing ids (Op::pair); compile the plan again with "
              "this piper (expected 3)");
    j["version"] = 4;
    EXPECT_EQ(error_of(j), "plan: field 'version': unsupported version 4 (expected 3)");
  }
}

// Family purposes are an enum in memory and the same strings as before in plan files.
TEST(Program, FamilyPurposeNamesRoundTrip) {
  const std::vector<std::pair<FamilyPurpose, std::string>> names = {{FamilyPurpose::Dp, "dp"},
                                                                    {FamilyPurpose::DpEp, "dp-ep"},
                                                                    {FamilyPurpose::DpShard, "dp-shard"},
                                                                    {FamilyPurpose::DpReplicate, "dp-replicate"},
                                                                    {FamilyPurpose::Ep, "ep"},
                                                                    {FamilyPurpose::Tp, "tp"},
                                                                    {FamilyPurpose::TiedEmbedding, "tied-embedding"},
                                                                    {FamilyPurpose::Cp, "cp"},
                                                                    {FamilyPurpose::GradNorm, "grad-norm"}};
  for (const auto& [purpose, name] : names) {
    EXPECT_EQ(to_string(purpose), name);
    EXPECT_EQ(family_purpose_from_string(name), purpose);
  }
  EXPECT_THROW(family_purpose_from_string("TP"), std::invalid_argument);
  EXPECT_EQ(small_program().to_json()["families"][0]["purpose"], "dp");
}

TEST(Program, WriteFileAtomically) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() / ("piper_test_program_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::string path = (dir / "plan.json").string();
  write_file_atomically(path, "old contents");
  write_file_atomically(path, "new");
  std::ifstream in(path);
  std::stringstream read;
  read << in.rdbuf();
  EXPECT_EQ(read.str(), "new");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  EXPECT_EQ(names, std::vector<std::string>{"plan.json"});  // no temporary left behind

  std::string missing = (dir / "no-such-folder" / "plan.json").string();
  try {
    write_file_atomically(missing, "x");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("cannot write " + missing + ": ", 0), 0u) << e.what();
  }
  fs::remove_all(dir);
}

// A write killed (SIGKILL, SIGTERM) between creating its temporary and renaming it left
// `NAME.tmp.PID` beside the intact previous output, forever. The next write of NAME removes those of
// processes that are gone; a live process's (a write in progress) and another output's are left alone.
// A link in a sticky, world-writable folder that belongs to neither this user nor the folder's owner
// is not followed (the kernel's fs.protected_symlinks rule, which resolving links in user space would
// bypass): another user's dangling link in /tmp would otherwise aim the write at a file of ours. A
// temporary planted under the write's name (a link) is replaced, never written through.
TEST(Program, WriteFileAtomicallyDoesNotFollowAnotherUsersLinkInASharedFolder) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("piper_test_sticky_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  ASSERT_EQ(::chmod(dir.c_str(), 01777), 0);
  const fs::path victim = dir / "victim.json", planted = dir / "planted";
  const fs::path temp = dir / (temporary_prefix("own.json") + std::to_string(::getpid()));
  fs::create_symlink(planted, temp);  // a link where the write's temporary goes
  write_file_atomically((dir / "own.json").string(), "mine");
  EXPECT_FALSE(fs::exists(planted)) << "written through a planted temporary link";
  EXPECT_FALSE(fs::is_symlink(dir / "own.json"));
  fs::create_symlink(victim, dir / "link.json");
  if (::geteuid() != 0 || ::lchown((dir / "link.json").c_str(), 65534, 65534) != 0) {
    fs::remove_all(dir);
    GTEST_SKIP() << "needs root to make a link of another user";
  }
  try {
    write_file_atomically((dir / "link.json").string(), "aimed");
    ADD_FAILURE() << "followed another user's link";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("another user's symbolic link in a shared sticky folder"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(victim));
  fs::remove_all(dir);
}

TEST(Program, WriteFileAtomicallyRemovesTheTemporariesOfKilledWrites) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("piper_test_stale_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // reaped: its pid names no process
  const std::string dead = std::to_string(child), live = std::to_string(::getppid());
  const std::string longest = std::string(250, 'a') + ".json";  // NAME_MAX: the temporary's name is cut
  // Another long output sharing its first 200 bytes has temporaries of its own, which stay.
  const std::string sibling = std::string(250, 'a') + ".yaml";
  EXPECT_EQ(temporary_prefix("plan.json"), "plan.json.tmp.");
  EXPECT_NE(temporary_prefix(longest), temporary_prefix(sibling));
  EXPECT_LE(temporary_prefix(longest).size() + 10, 255u);
  const std::vector<std::string> stale = {"plan.json.tmp." + dead, temporary_prefix(longest) + dead};
  const std::vector<std::string> kept = {"plan.json.tmp." + live, "other.json.tmp." + dead, "plan.json.tmp.x" + dead,
                                         temporary_prefix(sibling) + dead};
  for (const auto& name : stale) std::ofstream(dir / name) << "half an output";
  for (const auto& name : kept) std::ofstream(dir / name) << "not this write's to remove";
  write_file_atomically((dir / "plan.json").string(), "new");
  write_file_atomically((dir / longest).string(), "new");
  for (const auto& name : stale) EXPECT_FALSE(fs::exists(dir / name)) << name;
  for (const auto& name : kept) EXPECT_TRUE(fs::exists(dir / name)) << name;
  std::ifstream in(dir / "plan.json");
  std::stringstream read;
  read << in.rdbuf();
  EXPECT_EQ(read.str(), "new");
  fs::remove_all(dir);
}

// The tensor-parallel contract: segment fields tp_degree / sequence_parallel / recompute / tp_family
// and the op fields tp_bytes / tp_collectives round-trip, are omitted at their defaults, and the TP
// group of a device is the consecutive chunk of the segment's set.
TEST(Program, TensorParallelFieldsRoundTrip) {
  EXPECT_EQ(to_string(Recompute::None), "none");
  EXPECT_EQ(to_string(Recompute::Selective), "selective");
  EXPECT_EQ(to_string(Recompute::Full), "full");
  EXPECT_EQ(recompute_from_string("selective"), Recompute::Selective);
  EXPECT_EQ(recompute_from_string("full"), Recompute::Full);
  EXPECT_THROW(recompute_from_string("partial"), std::invalid_argument);

  Program p = small_program();
  p.num_devices = 4;
  p.device_sets.push_back({0, 1, 2, 3});                         // set 3
  p.families.push_back(CommFamily{3, 2, 1, FamilyPurpose::Tp});  // family 1: {0,1} {2,3}
  p.plan_of_device = {0, 1, 0, 1};
  ProgramSegment plain;
  plain.devices = 2;
  ProgramSegment tp;
  tp.devices = 3;
  tp.tp_degree = 2;
  tp.sequence_parallel = true;
  tp.recompute = Recompute::Selective;
  tp.tp_family = 1;
  p.segments = {plain, tp};
  p.plans[0].streams[0].ops[0].tp_bytes = 3 * 4096;
  p.plans[0].streams[0].ops[0].tp_collectives = 3;
  p.plans[0].streams[0].ops[0].gemm_kernels = 7;

  const json j = p.to_json();
  EXPECT_EQ(j["plans"][0]["streams"][0]["ops"][0]["gemm_kernels"], 7);
  EXPECT_FALSE(j["plans"][1]["streams"][0]["ops"][0].contains("gemm_kernels"));
  EXPECT_FALSE(j["segments"][0].contains("tp_degree"));
  EXPECT_FALSE(j["segments"][0].contains("sequence_parallel"));
  EXPECT_FALSE(j["segments"][0].contains("recompute"));
  EXPECT_FALSE(j["segments"][0].contains("tp_family"));
  EXPECT_EQ(j["segments"][1]["tp_degree"], 2);
  EXPECT_EQ(j["segments"][1]["sequence_parallel"], true);
  EXPECT_EQ(j["segments"][1]["recompute"], "selective");
  EXPECT_EQ(j["segments"][1]["tp_family"], 1);
  EXPECT_EQ(j["plans"][0]["streams"][0]["ops"][0]["tp_bytes"], 3 * 4096);
  EXPECT_FALSE(j["plans"][1]["streams"][0]["ops"][0].contains("tp_bytes"));
  const Program back = Program::from_json(j);
  EXPECT_TRUE(back == p);
  EXPECT_EQ(back.segments[1].recompute, Recompute::Selective);
  EXPECT_EQ(back.group_of(back.segments[1].tp_family, 2), (std::vector<int>{2, 3}));
  EXPECT_EQ(back.group_of(back.segments[1].tp_family, 1), (std::vector<int>{0, 1}));

  json bad = j;
  bad["plans"][0]["streams"][0]["ops"][0]["gemm_kernels"] = -1;
  EXPECT_NE(error_of(bad).find("gemm_kernels"), std::string::npos) << error_of(bad);
  bad = j;
  bad["segments"][1]["recompute"] = "partial";
  EXPECT_NE(error_of(bad).find("segments[1].recompute"), std::string::npos) << error_of(bad);
  bad = j;
  bad["segments"][1]["tp_family"] = 7;
  EXPECT_NE(error_of(bad).find("segments[1].tp_family"), std::string::npos) << error_of(bad);
  bad = j;
  bad["segments"][1]["tp_degree"] = 0;
  EXPECT_NE(error_of(bad).find("segments[1].tp_degree"), std::string::npos) << error_of(bad);
}
