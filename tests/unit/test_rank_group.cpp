// The pieces every launch of the training loop shares: thread rank groups (collectives, a member that
// fails, a member that never arrives), the loopback naming the host and CUDA virtual devices use, and
// `piper run --virtual-devices` on the host backend where a run goes wrong (divergence, a stalled
// transfer, a checkpoint resumed across launches). Equivalence with the reference for every strategy
// is in test_runtime.cpp (each RuntimeEquivalence test runs both launches).
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "piper/core/scenario.hpp"
#include "piper/runtime/comm.hpp"
#include "piper/runtime/executor.hpp"
#include "piper/runtime/rank_group.hpp"
#include "piper/runtime/trainer.hpp"
#include "shell.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using piper::runtime::CommKind;
using piper::runtime::Gathered;
using piper::runtime::LoopbackNamer;
using piper::runtime::RankGroup;
using piper::runtime::ReportedByAnotherRank;
using piper::runtime::run_rank_threads;
using piper::runtime::RuntimeError;
using piper::runtime::ThreadMeeting;
using piper::test::Result;
using piper::test::sh;

namespace {

TEST(ThreadRankGroup, CollectivesCombineEveryRankInRankOrder) {
  constexpr int kRanks = 4;
  std::vector<std::vector<double>> sums(kRanks), maxes(kRanks);
  std::vector<int> broadcasts(kRanks);
  Gathered<std::string> bytes;
  Gathered<std::vector<double>> doubles;
  run_rank_threads(kRanks, [&](RankGroup& g) {
    const int r = g.rank();
    ASSERT_EQ(g.size(), kRanks);
    std::vector<double> s = {1.0 * r, 10.0};  // sums 0+1+2+3 = 6 and 40
    g.sum(s);
    std::vector<double> m = {-1.0 * r, 1.0 * r};
    g.max(m);
    g.barrier();
    broadcasts[static_cast<std::size_t>(r)] = g.broadcast(100 + r);                           // rank 0's value: 100
    auto b = g.gather(std::string(static_cast<std::size_t>(r), static_cast<char>('a' + r)));  // "", "b", "cc", "ddd"
    auto d = g.gather(std::vector<double>{static_cast<double>(r)});
    sums[static_cast<std::size_t>(r)] = s;
    maxes[static_cast<std::size_t>(r)] = m;
    if (r == 0) bytes = b, doubles = d;
    if (r != 0) {
      EXPECT_TRUE(b.all.empty() && b.offsets.empty() && b.sizes.empty());
      EXPECT_TRUE(d.all.empty());
    }
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(sums[static_cast<std::size_t>(r)], (std::vector<double>{6.0, 40.0}));
    EXPECT_EQ(maxes[static_cast<std::size_t>(r)], (std::vector<double>{0.0, 3.0}));
    EXPECT_EQ(broadcasts[static_cast<std::size_t>(r)], 100);
  }
  EXPECT_EQ(bytes.all, "bccddd");
  EXPECT_EQ(bytes.offsets, (std::vector<int>{0, 0, 1, 3}));
  EXPECT_EQ(bytes.sizes, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(doubles.all, (std::vector<double>{0, 1, 2, 3}));
}

// A rank that throws releases the others from their next group operation: the run ends with the
// first error as thrown, not a hang and not "reported by another rank".
TEST(ThreadRankGroup, AFailingRankStopsTheOthersWithItsError) {
  std::atomic<int> reported{0};
  try {
    run_rank_threads(3, [&](RankGroup& g) {
      if (g.rank() == 1) throw std::invalid_argument("rank 1 cannot go on");
      try {
        for (;;) g.barrier();  // would never end without the abandon
      } catch (const ReportedByAnotherRank&) {
        ++reported;
        throw;
      }
    });
    FAIL() << "expected the failing rank's error";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "rank 1 cannot go on");
  }
  EXPECT_EQ(reported.load(), 2);
}

TEST(ThreadMeeting, AMemberThatNeverArrivesIsAStallNotAHang) {
  ThreadMeeting meeting(2, 0.2);
  try {
    meeting.meet(
        0, nullptr, [](const std::vector<const void*>&) {}, "a tensor-parallel all-reduce");
    FAIL() << "expected a stall";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("a tensor-parallel all-reduce waited"), std::string::npos) << e.what();
  }
}

// Both ends of a transfer name it alike; collective members by (family, first member, pairing id)
// whatever their own rank; repeats get the next sequence number.
TEST(LoopbackNamer, BothEndsAndEveryMemberNameAnExchangeAlike) {
  LoopbackNamer dev2(2), dev5(5), dev7(7);
  const auto send = dev2.name(CommKind::Send, 5, 11, -1, {});
  const auto recv = dev5.name(CommKind::Recv, 2, 11, -1, {});
  EXPECT_EQ(send.key, recv.key);
  EXPECT_EQ(send.rank, 0);
  EXPECT_EQ(recv.rank, 1);
  EXPECT_EQ(send.expected, 2);
  EXPECT_NE(dev2.name(CommKind::Send, 5, 11, -1, {}).key, send.key);  // the next step's transfer
  EXPECT_NE(dev2.name(CommKind::Send, 5, 12, -1, {}).key, dev5.name(CommKind::Recv, 2, 11, -1, {}).key);

  const std::vector<int> group = {7, 5, 2};
  const auto a = dev7.name(CommKind::AllReduce, -1, 3, 4, group);
  const auto b = dev5.name(CommKind::AllReduce, -1, 3, 4, group);
  const auto c = dev2.name(CommKind::AllReduce, -1, 3, 4, group);
  EXPECT_EQ(a.key, b.key);
  EXPECT_EQ(b.key, c.key);
  EXPECT_EQ(a.rank, 0);
  EXPECT_EQ(b.rank, 1);
  EXPECT_EQ(c.rank, 2);
  EXPECT_EQ(c.expected, 3);
  EXPECT_NE(dev2.name(CommKind::AllGather, -1, 3, 4, group).key, c.key);  // another kind
  EXPECT_THROW(LoopbackNamer(9).name(CommKind::AllReduce, -1, 3, 4, group), std::logic_error);
}

// ---- piper run --virtual-devices (host backend) ----

const std::string kModel = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json";

fs::path scratch(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("piper-rank-group-" + std::to_string(::getpid())) / name;
  fs::create_directories(d);
  return d;
}

fs::path compile_plan(const fs::path& dir, int pp, int dp, const std::string& schedule = "1f1b", int microbatches = 4) {
  piper::core::Scenario s;
  s.model = kModel;
  s.strategy.pp = pp;
  s.strategy.dp = dp;
  s.strategy.microbatches = microbatches;
  s.strategy.schedule = schedule;
  fs::create_directories(dir);
  const fs::path plan = dir / "plan.json";
  std::ofstream(plan) << piper::core::compile_scenario(s).result.program.to_json().dump();
  return plan;
}

int error_lines(const std::string& output) {
  int n = 0;
  for (std::size_t at = output.find("piper: "); at != std::string::npos; at = output.find("piper: ", at + 1)) ++n;
  return n;
}

TEST(VirtualDevices, DivergenceStopsEveryDeviceWithOneLine) {
  const fs::path dir = scratch("diverge");
  const std::string plan = compile_plan(dir, 2, 2).string();
  const fs::path ck = dir / "ck";
  Result r = sh(std::string(PIPER_CLI) + " run --virtual-devices --plan " + plan + " --steps 3 --adam-eps 0 --save " +
                ck.string());
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(error_lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find("(training diverged)"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(ck)) << "nothing is saved after a diverged step";
  r = sh(std::string(PIPER_CLI) + " run --virtual-devices --plan " + plan +
         " --steps 3 --adam-eps 0 --on-nonfinite skip");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("skipped: "), std::string::npos) << r.output;
}

// A 2-device PP plan (compile_plan) with one field of device 1's first op of `kind` set to `value`,
// written to dir/bad.json.
fs::path with_device1_first_op(const fs::path& dir, const std::string& kind, const std::string& field,
                               const json& value) {
  json p = json::parse(std::ifstream(compile_plan(dir, 2, 1)));
  bool changed = false;
  for (auto& stream : p["plans"][p["plan_of_device"][1].get<int>()]["streams"])
    for (auto& op : stream["ops"])
      if (op["kind"] == kind && !changed) op[field] = value, changed = true;
  EXPECT_TRUE(changed);
  const fs::path bad = dir / "bad.json";
  std::ofstream(bad) << p.dump();
  return bad;
}

// A RECV whose transfer its peer never sends: both devices stall and the run ends as a runtime
// failure (exit 4) in one line, as the MPI launch does.
TEST(VirtualDevices, AStalledTransferExitsFourInOneLine) {
  const fs::path bad = with_device1_first_op(scratch("stall"), "RECV", "pair", 99999);
  const Result r =
      sh(std::string(PIPER_CLI) + " run --virtual-devices --plan " + bad.string() + " --steps 1 --stall-timeout 1");
  EXPECT_EQ(r.code, 4) << r.output;
  EXPECT_EQ(error_lines(r.output), 1) << r.output;
  EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
}

// A plan whose op names a segment its device does not hold is refused before step 1, in one line,
// as bad input (exit 2), in both launches.
TEST(VirtualDevices, AnOpOnASegmentTheDeviceDoesNotHoldIsBadInput) {
  const fs::path bad = with_device1_first_op(scratch("not-held"), "COMPUTE", "segment", 0);  // device 0's segment
  for (const std::string& launch :
       {std::string(PIPER_CLI) + " run --virtual-devices", piper::test::mpirun(2) + std::string(PIPER_CLI) + " run"}) {
    const Result r = sh(launch + " --plan " + bad.string() + " --steps 1");
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(error_lines(r.output), 1) << r.output;
    EXPECT_NE(r.output.find("plan: device 1's op 'F mb0 PP1 s4' works on segment 0, which the device does not hold"),
              std::string::npos)
        << r.output;
  }
}

// A device that fails mid-step releases the others from their transfers at once, instead of leaving
// them to a stall timeout: with a timeout far beyond `timeout 200`, a run that waited would end in 124.
// The failure: device 1's first compute op is turned into a backward, which finds no gradient and
// stops device 1 at once; device 0 waits for device 1's backward transfer, which never comes.
TEST(VirtualDevices, AFailingDeviceReleasesTheOthersAtOnce) {
  const fs::path bad = with_device1_first_op(scratch("fail"), "COMPUTE", "pass", "B");
  const Result r = sh("timeout 200 " + std::string(PIPER_CLI) + " run --virtual-devices --plan " + bad.string() +
                      " --steps 2 --stall-timeout 1000");
  EXPECT_EQ(r.code, 4) << "124: the other device waited for its stall timeout\n" << r.output;
  EXPECT_EQ(error_lines(r.output), 1) << r.output;
  EXPECT_NE(r.output.find("plan order violated"), std::string::npos) << r.output;
}

// A checkpoint written by virtual devices resumes under MPI ranks of another layout and the other
// way round, and both continuations agree with an uninterrupted reference run.
TEST(VirtualDevices, CheckpointsResumeAcrossLaunches) {
  const fs::path dir = scratch("resume");
  const std::string a = compile_plan(dir / "a", 2, 2).string();
  const std::string b = compile_plan(dir / "b", 2, 1, "zb-h1", 8).string();  // the same 8 sequences per step
  const std::string opt = " --lr 3e-3 --adam-eps 1e-6 --seed 7";
  const std::string cli = std::string(PIPER_CLI);
  ASSERT_EQ(
      sh(cli + " run --reference --plan " + a + opt + " --steps 4 --dump-params " + (dir / "ref.bin").string()).code,
      0);
  Result r = sh(cli + " run --virtual-devices --plan " + a + opt + " --steps 2 --save " + (dir / "v.ck").string());
  ASSERT_EQ(r.code, 0) << r.output;
  r = sh(piper::test::mpirun(2) + cli + " run --plan " + b + opt + " --steps 4 --resume " + (dir / "v.ck").string() +
         " --dump-params " + (dir / "mv.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  r = sh(piper::test::mpirun(2) + cli + " run --plan " + b + opt + " --steps 2 --save " + (dir / "m.ck").string());
  ASSERT_EQ(r.code, 0) << r.output;
  r = sh(cli + " run --virtual-devices --plan " + a + opt + " --steps 4 --resume " + (dir / "m.ck").string() +
         " --dump-params " + (dir / "vm.bin").string());
  ASSERT_EQ(r.code, 0) << r.output;
  for (const char* run : {"mv.bin", "vm.bin"})
    EXPECT_LT(piper::runtime::max_param_difference((dir / "ref.bin").string(), (dir / run).string()), 1e-4) << run;
  fs::remove_all(dir.parent_path());
}

}  // namespace
