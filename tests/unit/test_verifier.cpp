// Tests of the verifier: a hand-built correct PP2 x DP program verifies clean, and each kind of
// corruption (lost or resized transfer, reordered collectives, wait cycle, rendezvous cycle, buffer
// misuse) is reported by the check that names it.
#include <gtest/gtest.h>

#include <algorithm>

#include "piper/core/error.hpp"
#include "piper/core/verifier.hpp"

using namespace piper::core;

namespace {

constexpr int kCompute = 0, kPp = 1, kDp = 2;  // stream indices of both plans

Op op(OpKind kind, const std::string& label, int node, std::vector<OpRef> waits = {}, std::vector<int> uses = {}) {
  Op o;
  o.kind = kind;
  o.label = label;
  o.node = node;
  if (kind != OpKind::Compute && kind != OpKind::Update) o.pair = node;  // pairing id: the node's number here
  o.waits = std::move(waits);
  o.uses = std::move(uses);
  return o;
}

Op transfer(OpKind kind, const std::string& label, int node, DeviceSetId me, DeviceSetId peer,
            std::vector<OpRef> waits = {}, std::vector<int> uses = {}) {
  Op o = op(kind, label, node, std::move(waits), std::move(uses));
  o.bytes = 1024;
  o.device_set = me;
  o.peer_set = peer;
  return o;
}

Op all_reduce(const std::string& label, int node, int family, std::int64_t bytes, std::vector<OpRef> waits) {
  Op o = op(OpKind::AllReduce, label, node, std::move(waits));
  o.bytes = bytes;
  o.family = family;
  return o;
}

// PP2 x DP`dp`: stage 0 runs on the even devices (plan 0), stage 1 on the odd ones (plan 1); the
// j-th even device sends its activation to the j-th odd device and gets the gradient back. Each stage
// all-reduces two gradient buckets over its data-parallel family.
Program pp2(int dp) {
  Program p;
  p.model_name = "pp2";
  p.num_devices = 2 * dp;
  std::vector<int> evens, odds;
  for (int j = 0; j < dp; ++j) {
    evens.push_back(2 * j);
    odds.push_back(2 * j + 1);
  }
  p.device_sets = {evens, odds};
  p.families = {CommFamily{0, dp, 1, FamilyPurpose::Dp}, CommFamily{1, dp, 1, FamilyPurpose::Dp}};
  for (int d = 0; d < p.num_devices; ++d) p.plan_of_device.push_back(d % 2);

  Plan s0;
  s0.streams = {{"compute", {}}, {"pp", {}}, {"dp", {}}};
  s0.streams[kCompute].ops = {op(OpKind::Compute, "F mb0 PP0", 1, {}, {0, 2}),
                              op(OpKind::Compute, "B mb0 PP0", 10, {{kPp, 1}}, {0, 1, 2})};
  // The SEND reads the activation too: it is before B through RECV (stream order) and B's wait.
  s0.streams[kPp].ops = {transfer(OpKind::Send, "SEND act mb0", 2, 0, 1, {{kCompute, 0}}, {2}),
                         transfer(OpKind::Recv, "RECV grad mb0", 9, 0, 1)};
  s0.streams[kDp].ops = {all_reduce("AR bucket0 PP0", 20, 0, 4096, {{kCompute, 1}}),
                         all_reduce("AR bucket1 PP0", 21, 0, 8192, {{kCompute, 1}})};
  s0.buffers = {Buffer{"params PP0", BufferKind::Parameters, 1 << 20, {}, {}},
                Buffer{"grads PP0", BufferKind::Gradients, 1 << 20, {}, {}},
                Buffer{"act mb0 PP0", BufferKind::Activations, 4096, {kCompute, 0}, {kCompute, 1}}};

  Plan s1;
  s1.streams = {{"compute", {}}, {"pp", {}}, {"dp", {}}};
  s1.streams[kCompute].ops = {op(OpKind::Compute, "F mb0 PP1", 3, {{kPp, 0}}, {0, 2, 3}),
                              op(OpKind::Compute, "B mb0 PP1", 8, {}, {0, 1, 2})};
  s1.streams[kPp].ops = {transfer(OpKind::Recv, "RECV act mb0", 2, 1, 0, {}, {3}),
                         transfer(OpKind::Send, "SEND grad mb0", 9, 1, 0, {{kCompute, 1}})};
  s1.streams[kDp].ops = {all_reduce("AR bucket0 PP1", 22, 1, 4096, {{kCompute, 1}}),
                         all_reduce("AR bucket1 PP1", 23, 1, 8192, {{kCompute, 1}})};
  // The received input lives until B: RECV happens-before B only transitively (B follows F, which waits
  // on RECV), so a verifier without transitive happens-before would reject this clean program.
  s1.buffers = {Buffer{"params PP1", BufferKind::Parameters, 1 << 20, {}, {}},
                Buffer{"grads PP1", BufferKind::Gradients, 1 << 20, {}, {}},
                Buffer{"act mb0 PP1", BufferKind::Activations, 4096, {kCompute, 0}, {kCompute, 1}},
                Buffer{"recv act mb0", BufferKind::Received, 1024, {kPp, 0}, {kCompute, 1}}};
  p.plans = {s0, s1};
  return p;
}

std::string describe(const std::vector<VerifyIssue>& issues) {
  std::string s;
  for (const auto& i : issues) s += i.check + ": " + i.message + "\n";
  return s.empty() ? "(clean)" : s;
}

// True when some issue of `check` has a message containing every one of `parts`.
bool has_issue(const std::vector<VerifyIssue>& issues, const std::string& check, std::vector<std::string> parts) {
  return std::any_of(issues.begin(), issues.end(), [&](const VerifyIssue& i) {
    return i.check == check && std::all_of(parts.begin(), parts.end(), [&](const std::string& part) {
             return i.message.find(part) != std::string::npos;
           });
  });
}

}  // namespace

TEST(Verifier, CorrectProgramIsClean) {
  auto issues = verify(pp2(2));
  EXPECT_TRUE(issues.empty()) << describe(issues);
  EXPECT_NO_THROW(verify_or_throw(pp2(2)));
}

TEST(Verifier, DevicesSplitOverMorePlansStayClean) {
  // Device 2 gets its own copy of stage 0's plan: groups and transfers now cross plans.
  Program p = pp2(2);
  p.plans.push_back(p.plans[0]);
  p.plan_of_device = {0, 1, 2, 1};
  auto issues = verify(p);
  EXPECT_TRUE(issues.empty()) << describe(issues);
}

TEST(Verifier, MissingRecv) {
  Program p = pp2(2);
  // Stage 0 no longer receives the gradient of pair 9 (the last op of its pp stream).
  p.plans[0].streams[kPp].ops.pop_back();
  p.plans[0].streams[kCompute].ops[1].waits.clear();
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "send-recv", {"device 1 (plan 1)", "SEND pair 9", "no RECV with pair 9 on device 0"}))
      << describe(issues);
}

TEST(Verifier, MissingSend) {
  Program p = pp2(2);
  // Stage 1 never sends the gradient back: its RECV partner on stage 0 has no SEND.
  p.plans[1].streams[kPp].ops.pop_back();
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "send-recv", {"RECV pair 9 from device 1", "no SEND with pair 9 on device 1"}))
      << describe(issues);
}

TEST(Verifier, RecvBytesDiffer) {
  Program p = pp2(2);
  p.plans[1].streams[kPp].ops[0].bytes = 512;
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "send-recv", {"SEND pair 2", "sends 1024 bytes", "expects 512 bytes"}))
      << describe(issues);
  try {
    verify_or_throw(p);
    FAIL() << "expected PlanError";
  } catch (const PlanError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("verify: send-recv: ", 0), 0u) << e.what();
  }
}

TEST(Verifier, RecvFromWrongPeer) {
  Program p = pp2(2);
  // Odd devices receive from the even devices in reverse order: 1 <- 2 and 3 <- 0.
  p.device_sets.push_back({2, 0});
  p.plans[1].streams[kPp].ops[0].peer_set = 2;
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "send-recv", {"SEND pair 2", "receives from device 2 instead"})) << describe(issues);
}

TEST(Verifier, CollectiveOrderDiffersWithinAGroup) {
  Program p = pp2(2);
  p.plans.push_back(p.plans[0]);
  p.plan_of_device = {0, 1, 2, 1};
  // Device 2 (plan 2) reduces its buckets in the other order than device 0, its DP partner.
  std::swap(p.plans[2].streams[kDp].ops[0], p.plans[2].streams[kDp].ops[1]);
  auto issues = verify(p);
  EXPECT_TRUE(
      has_issue(issues, "collective-order",
                {"family 0", "device 0 (plan 0)", "device 2 (plan 2)", "differ at collective 0", "pair 20", "pair 21"}))
      << describe(issues);
}

TEST(Verifier, CollectiveOutsideItsFamily) {
  Program p = pp2(2);
  p.plans[1].streams[kDp].ops[0].family = 0;  // odd devices are not in family 0's set
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "collective-order", {"device 1 (plan 1)", "family 0", "not in its device set"}))
      << describe(issues);
}

TEST(Verifier, CrossDeviceWaitCycleIsADeadlock) {
  Program p = pp2(2);
  // Stage 0 waits for the gradient before sending the activation that produces it.
  auto& pp = p.plans[0].streams[kPp].ops;
  std::swap(pp[0], pp[1]);
  p.plans[0].streams[kCompute].ops[1].waits = {{kPp, 0}};
  auto issues = verify(p);
  // A transfer is one rendezvous vertex named by its SEND: the cycle runs SEND act (0 -> 1) ->
  // F and B of stage 1 -> SEND grad (1 -> 0), which stage 0 waits for before sending the activation.
  ASSERT_TRUE(has_issue(issues, "deadlock", {"SEND grad mb0", "SEND act mb0", "cycle of"})) << describe(issues);
  EXPECT_TRUE(has_issue(issues, "deadlock", {"(cycle of 2 ops)"}) ||
              has_issue(issues, "deadlock", {"(cycle of 4 ops)"}))
      << describe(issues);
}

TEST(Verifier, IntraDeviceWaitCycleIsADeadlock) {
  Program p = pp2(2);
  // F waits on the SEND that waits on F.
  p.plans[0].streams[kCompute].ops[0].waits = {{kPp, 0}};
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "deadlock", {"(cycle of 2 ops)"})) << describe(issues);
}

TEST(Verifier, CollectiveRendezvousCycleIsADeadlock) {
  // Devices 0 and 1 share an all-reduce; device 0 issues it before sending to device 1, device 1
  // after receiving from device 0. Stream order alone has no cycle: only the rendezvous of the
  // all-reduce (and of the transfer) closes one.
  Program p;
  p.num_devices = 2;
  p.device_sets = {{0}, {1}, {0, 1}};
  p.families = {CommFamily{2, 2, 1, FamilyPurpose::Dp}};
  p.plan_of_device = {0, 1};
  Plan a, b;
  a.streams = {{"main", {all_reduce("AR", 7, 0, 64, {}), transfer(OpKind::Send, "SEND x", 3, 0, 1)}}};
  b.streams = {{"main", {transfer(OpKind::Recv, "RECV x", 3, 1, 0), all_reduce("AR", 7, 0, 64, {})}}};
  p.plans = {a, b};
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "deadlock", {"the rendezvous of", "SEND x"})) << describe(issues);

  // The same program with device 1 reducing before it receives is fine.
  std::swap(p.plans[1].streams[0].ops[0], p.plans[1].streams[0].ops[1]);
  issues = verify(p);
  EXPECT_TRUE(issues.empty()) << describe(issues);
}

TEST(Verifier, BufferUsedAfterItsFree) {
  Program p = pp2(2);
  // The activation is freed by F, but B (later on the same stream) still reads it.
  p.plans[0].buffers[2].free = {kCompute, 0};
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(
      issues, "buffer",
      {"buffer 'act mb0 PP0'", "used by stream 'compute' op 1 'B mb0 PP0'", "after (or concurrently with) its free"}))
      << describe(issues);
}

TEST(Verifier, BufferUseNotOrderedWithItsFree) {
  Program p = pp2(2);
  // The all-reduce starts after B (it waits on it), so using the activation there is after its free.
  p.plans[0].streams[kDp].ops[0].uses = {2};
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "buffer", {"used by stream 'dp' op 0 'AR bucket0 PP0'", "after"})) << describe(issues);
  // A use on another stream with no ordering to the alloc is reported too.
  p = pp2(2);
  p.plans[1].streams[kPp].ops[0].uses = {2, 3};  // RECV does not wait for F, which allocates 'act mb0 PP1'
  issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "buffer",
                        {"buffer 'act mb0 PP1'", "'RECV act mb0'", "before (or concurrently with) its alloc"}))
      << describe(issues);
}

TEST(Verifier, TransientBufferNeverFreed) {
  Program p = pp2(2);
  p.plans[1].buffers[3].free = OpRef{};
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "buffer", {"device 1 (plan 1) buffer 'recv act mb0' is never freed"}))
      << describe(issues);
}

TEST(Verifier, OutOfRangeReferencesAreStructureIssues) {
  Program p = pp2(2);
  p.plans[0].streams[kPp].ops[0].waits = {{7, 0}};
  auto issues = verify(p);
  EXPECT_TRUE(has_issue(issues, "structure", {"plan 0 stream 'pp' op 0", "stream 7"})) << describe(issues);
}

TEST(Verifier, ThousandDevicesSharingTwoPlansAreClean) {
  Program p = pp2(512);
  ASSERT_EQ(p.num_devices, 1024);
  // Also a strided family over stage 0: two groups of 256 (even positions / odd positions).
  p.families.push_back(CommFamily{0, 256, 2, FamilyPurpose::Dp});
  p.plans[0].streams[kDp].ops.push_back(all_reduce("AR strided", 30, 2, 128, {{kCompute, 1}}));
  auto issues = verify(p);
  EXPECT_TRUE(issues.empty()) << describe(issues);

  // One broken pairing among 1024 devices is still found: device 1022 -> 1023 becomes 1022 -> 1.
  Program q = pp2(512);
  std::vector<int> odds = q.device_sets[1];
  odds.back() = 1;
  q.device_sets.push_back(odds);
  q.plans[0].streams[kPp].ops[0].peer_set = 2;
  issues = verify(q);
  EXPECT_TRUE(has_issue(issues, "send-recv", {"device 1022 (plan 0)", "SEND pair 2 to device 1"})) << describe(issues);
}

TEST(Verifier, CrossedSendsDeadlockUnderRendezvous) {
  // Each device sends first and receives second on one stream. With buffered sends this would run;
  // with rendezvous transfers (NCCL, and Piper's executor) each SEND waits for a RECV that is queued
  // behind the other device's SEND.
  Program p;
  p.num_devices = 2;
  p.device_sets = {{0}, {1}};
  p.plan_of_device = {0, 1};
  Plan a, b;
  a.streams = {{"pp", {transfer(OpKind::Send, "SEND x", 3, 0, 1), transfer(OpKind::Recv, "RECV y", 4, 0, 1)}}};
  b.streams = {{"pp", {transfer(OpKind::Send, "SEND y", 4, 1, 0), transfer(OpKind::Recv, "RECV x", 3, 1, 0)}}};
  p.plans = {a, b};
  EXPECT_TRUE(has_issue(verify(p), "deadlock", {"SEND x", "SEND y"})) << describe(verify(p));
  // Receiving first on one side breaks the cycle.
  std::swap(p.plans[1].streams[0].ops[0], p.plans[1].streams[0].ops[1]);
  EXPECT_TRUE(verify(p).empty()) << describe(verify(p));
}
