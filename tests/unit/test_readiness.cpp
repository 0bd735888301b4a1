// Pairing ids (Op::pair) and the one readiness component (core/readiness.hpp): lowering gives every
// transfer and collective occurrence an id that both sides carry; plans that break it are refused in
// one line; and the simulator's ReadyTracker, which now meets ops by id, produces the same timelines
// as a brute-force reference that matches ops from the Program's device sets without the ids (a
// transfer by its SEND node and reciprocal peers, a collective by its position in the family's
// sequence on each member: the rules before pairing ids).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "piper/core/compiler.hpp"
#include "piper/core/error.hpp"
#include "piper/core/readiness.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/verifier.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/ready_tracker.hpp"
#include "piper/sim/symmetry.hpp"

using namespace piper;
using namespace piper::core;
using nlohmann::json;

namespace {

constexpr std::size_t ix(std::int64_t i) { return static_cast<std::size_t>(i); }

struct Case {
  std::string name;
  Scenario scenario;
};

Scenario base(const std::string& schedule, int pp, int dp, int microbatches) {
  Scenario s;
  s.model = "qwen3-9m";
  s.strategy.schedule = schedule;
  s.strategy.pp = pp;
  s.strategy.dp = dp;
  s.strategy.microbatches = microbatches;
  return s;
}

// Every schedule family and parallelism whose communication lowering pairs.
std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back({"gpipe", base("gpipe", 2, 2, 4)});
  out.push_back({"1f1b", base("1f1b", 4, 1, 4)});
  Scenario interleaved = base("interleaved-1f1b", 2, 2, 4);
  interleaved.strategy.virtual_stages = 2;
  out.push_back({"interleaved", interleaved});
  out.push_back({"zb-h1", base("zb-h1", 2, 2, 4)});
  out.push_back({"dualpipe", base("dualpipe", 2, 1, 4)});
  Scenario dualpipev = base("dualpipev", 2, 2, 4);
  dualpipev.strategy.ep = 2;
  out.push_back({"dualpipev-ep", dualpipev});
  Scenario zero3 = base("1f1b", 2, 4, 4);
  zero3.strategy.zero = 3;
  zero3.strategy.ep = 2;
  zero3.strategy.bucket_mb = 1;
  out.push_back({"zero3-ep", zero3});
  Scenario tp = base("1f1b", 2, 2, 2);
  tp.strategy.tp = 2;
  out.push_back({"tp", tp});
  Scenario cp = base("1f1b", 2, 1, 2);
  cp.strategy.cp = 2;
  out.push_back({"cp", cp});
  return out;
}

const Op& op_at(const Program& p, int device, OpRef r) {
  return p.plan_for(device).streams[ix(r.stream)].ops[ix(r.index)];
}

template <class F>
void each_op(const Program& p, int device, F&& fn) {
  const Plan& plan = p.plan_for(device);
  for (std::size_t s = 0; s < plan.streams.size(); ++s)
    for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i)
      fn(plan.streams[s].ops[i], OpRef{static_cast<int>(s), static_cast<int>(i)});
}

// The meeting of an op by the rules before pairing ids, from the device sets alone: a transfer's
// other side is the op of opposite kind on peer_of with the same SEND node whose own peer is this
// device ({SEND, RECV}); a collective's members run the k-th collective of its family in their own
// streams' order ({group in group order}).
std::vector<Member> reference_meeting(const Program& p, int device, OpRef r) {
  const Op& op = op_at(p, device, r);
  if (op.kind == OpKind::Compute || op.kind == OpKind::Update) return {{device, r}};
  if (op.kind == OpKind::Send || op.kind == OpKind::Recv) {
    const int peer = p.peer_of(op, device);
    const OpKind want = op.kind == OpKind::Send ? OpKind::Recv : OpKind::Send;
    std::vector<Member> found;
    each_op(p, peer, [&](const Op& o, OpRef at) {
      if (o.kind == want && o.node == op.node && p.peer_of(o, peer) == device) found.emplace_back(peer, at);
    });
    if (found.size() != 1) return {{device, r}};
    return op.kind == OpKind::Send ? std::vector<Member>{{device, r}, found[0]}
                                   : std::vector<Member>{found[0], {device, r}};
  }
  auto sequence = [&](int d) {
    std::vector<OpRef> seq;
    each_op(p, d, [&](const Op& o, OpRef at) {
      if (is_collective(o.kind) && o.family == op.family) seq.push_back(at);
    });
    return seq;
  };
  const auto mine = sequence(device);
  const auto k = ix(std::find(mine.begin(), mine.end(), r) - mine.begin());
  std::vector<Member> out;
  for (int m : p.group_of(op.family, device)) out.emplace_back(m, sequence(m).at(k));
  return out;
}

// End time of every op instance when each activity lasts `duration` and starts as soon as every
// member's stream predecessor and waits have ended (no contention: the times are unique). `meet`
// gives an op's members; the ops are swept until nothing changes.
using Ends = std::map<std::pair<int, OpRef>, double>;
double duration(const Program& p, int device, OpRef r) {
  const Op& op = op_at(p, device, r);
  return 1.0 + static_cast<double>(static_cast<int>(op.kind)) + 0.25 * (r.index % 3);
}
template <class Meet>
Ends reference_times(const Program& p, Meet&& meet) {
  Ends ends;
  auto ready_at = [&](int d, OpRef r, double& t) {
    if (r.index > 0) {
      auto it = ends.find({d, OpRef{r.stream, r.index - 1}});
      if (it == ends.end()) return false;
      t = std::max(t, it->second);
    }
    for (const OpRef& w : op_at(p, d, r).waits) {
      auto it = ends.find({d, w});
      if (it == ends.end()) return false;
      t = std::max(t, it->second);
    }
    return true;
  };
  for (bool changed = true; changed;) {
    changed = false;
    for (int d = 0; d < p.num_devices; ++d)
      each_op(p, d, [&](const Op&, OpRef r) {
        if (ends.count({d, r})) return;
        const std::vector<Member> members = meet(d, r);
        double start = 0, length = 0;
        for (const auto& [md, mr] : members) {
          if (!ready_at(md, mr, start)) return;
          length = std::max(length, duration(p, md, mr));
        }
        for (const auto& m : members) ends[m] = start + length;
        changed = true;
      });
  }
  return ends;
}

// The same times through the simulator's ReadyTracker (full mode, or reduced by symmetry, where a
// non-representative's ops take its representative's times).
Ends tracker_times(const Program& p, const sim::Symmetry* symmetry) {
  sim::ReadyTracker tracker(p, symmetry);
  Ends ends;
  std::vector<sim::ReadyTracker::Activity> ready;
  while (!tracker.done()) {
    ready.clear();
    tracker.take_ready(ready);
    if (ready.empty()) tracker.throw_stuck();
    for (const auto& a : ready) {
      double start = 0, length = 0;
      for (const auto& [d, r] : a.members) {
        if (r.index > 0) start = std::max(start, ends.at({d, OpRef{r.stream, r.index - 1}}));
        for (const OpRef& w : op_at(p, d, r).waits) start = std::max(start, ends.at({d, w}));
        length = std::max(length, duration(p, d, r));
      }
      for (const auto& [d, r] : a.members) ends[{d, r}] = start + length;
      tracker.finished(a, start + length);
    }
  }
  return ends;
}

}  // namespace

// Lowering's ids: every SEND, RECV and collective has one, COMPUTE and UPD none; a SEND's RECV on its
// peer carries its id, every member of a collective group carries the same id on one occurrence;
// one id per DAG node (transfers by the SEND node); the verifier accepts the plan; the core index
// finds exactly the reference meeting for every op instance.
TEST(PairingIds, ConsistentOverEveryScheduleFamilyAndParallelism) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const CompiledScenario compiled = compile_scenario(c.scenario);
    const Program& p = compiled.result.program;
    EXPECT_NO_THROW(verify_or_throw(p));
    const PairIndex index(p);
    std::map<int, std::int32_t> node_of_pair;
    std::set<OpKind> kinds;
    for (int d = 0; d < p.num_devices; ++d)
      each_op(p, d, [&](const Op& op, OpRef r) {
        kinds.insert(op.kind);
        if (op.kind == OpKind::Compute || op.kind == OpKind::Update) {
          EXPECT_EQ(op.pair, -1);
          return;
        }
        ASSERT_GE(op.pair, 0) << op.label;
        auto [it, fresh] = node_of_pair.try_emplace(op.pair, op.node);
        EXPECT_EQ(it->second, op.node) << "pairing id " << op.pair << " names two DAG nodes";
        const std::vector<Member> expected = reference_meeting(p, d, r);
        ASSERT_EQ(expected.size(),
                  op.kind == OpKind::Send || op.kind == OpKind::Recv ? 2u : p.group_of(op.family, d).size())
            << "device " << d << " " << op.label;
        for (const auto& [md, mr] : expected) EXPECT_EQ(op_at(p, md, mr).pair, op.pair) << op.label;
        EXPECT_EQ(index.meeting(d, r), expected) << "device " << d << " " << op.label;
      });
    EXPECT_TRUE(kinds.count(OpKind::Send) || c.scenario.strategy.pp == 1);
  }
}

TEST(PairingIds, EveryKindOfCollectiveIsCovered) {
  std::set<OpKind> kinds;
  for (const Case& c : cases()) {
    const CompiledScenario compiled = compile_scenario(c.scenario);
    const Program& p = compiled.result.program;
    for (int d = 0; d < p.num_devices; ++d) each_op(p, d, [&](const Op& op, OpRef) { kinds.insert(op.kind); });
  }
  for (OpKind k :
       {OpKind::Send, OpKind::Recv, OpKind::AllReduce, OpKind::ReduceScatter, OpKind::AllGather, OpKind::AllToAll})
    EXPECT_TRUE(kinds.count(k)) << to_string(k);
}

// Ids round-trip through plan JSON and take part in equality.
TEST(PairingIds, RoundTripAndEquality) {
  const CompiledScenario compiled = compile_scenario(cases()[0].scenario);
  const Program& p = compiled.result.program;
  const Program back = Program::from_json(p.to_json());
  EXPECT_TRUE(back == p);
  Program changed = back;
  for (auto& s : changed.plans[0].streams)
    for (auto& op : s.ops)
      if (op.pair >= 0) {
        op.pair += 1000;
        EXPECT_FALSE(changed == p);
        return;
      }
  FAIL() << "no op with a pairing id";
}

// A plan whose RECV carries another id than its SEND is refused by the verifier in one line naming
// the device, the stream and the op.
TEST(PairingIds, TamperedPlanIsRefusedInOneLine) {
  const CompiledScenario compiled = compile_scenario(base("1f1b", 2, 2, 2));
  json j = compiled.result.program.to_json();
  bool tampered = false;
  for (auto& plan : j["plans"])
    for (auto& stream : plan["streams"])
      for (auto& op : stream["ops"])
        if (!tampered && op["kind"] == "RECV") {
          op["pair"] = op["pair"].get<int>() + 100000;
          tampered = true;
        }
  ASSERT_TRUE(tampered);
  const Program p = Program::from_json(j);  // well-formed; the meeting is what is wrong
  try {
    verify_or_throw(p);
    FAIL() << "the tampered plan verified";
  } catch (const PlanError& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_NE(what.find("send-recv"), std::string::npos) << what;
    EXPECT_NE(what.find("device "), std::string::npos) << what;
    EXPECT_NE(what.find("stream '"), std::string::npos) << what;
    EXPECT_NE(what.find("op "), std::string::npos) << what;
    EXPECT_NE(what.find("with pair"), std::string::npos) << what;
  }
}

// Missing, negative or misplaced ids are refused when the plan is read, naming the field.
TEST(PairingIds, MalformedIdsAreRefusedOnLoad) {
  const CompiledScenario compiled = compile_scenario(base("1f1b", 2, 1, 2));
  const json good = compiled.result.program.to_json();
  auto error_of = [](const json& j) -> std::string {
    try {
      (void)Program::from_json(j);
    } catch (const PlanError& e) {
      return e.what();
    }
    return "";
  };
  auto first = [](json& j, const std::string& kind) -> json& {
    for (auto& plan : j["plans"])
      for (auto& stream : plan["streams"])
        for (auto& op : stream["ops"])
          if (op["kind"] == kind) return op;
    throw std::logic_error("no " + kind);
  };
  json j = good;
  first(j, "SEND").erase("pair");
  std::string e = error_of(j);
  EXPECT_NE(e.find("SEND needs a pairing id"), std::string::npos) << e;
  EXPECT_NE(e.find(".pair'"), std::string::npos) << e;
  j = good;
  first(j, "RECV")["pair"] = -3;
  e = error_of(j);
  EXPECT_NE(e.find("must be >= 0, got -3"), std::string::npos) << e;
  j = good;
  first(j, "COMPUTE")["pair"] = 0;
  e = error_of(j);
  EXPECT_NE(e.find("COMPUTE has no pairing id"), std::string::npos) << e;
  // Two SENDs of one plan with one id: the verifier's structure check.
  Program p = compiled.result.program;
  std::vector<Op*> sends;
  for (auto& plan : p.plans) {
    sends.clear();
    for (auto& s : plan.streams)
      for (auto& op : s.ops)
        if (op.kind == OpKind::Send) sends.push_back(&op);
    if (sends.size() >= 2) break;
  }
  ASSERT_GE(sends.size(), 2u);
  sends[1]->pair = sends[0]->pair;
  const auto issues = verify(p);
  EXPECT_TRUE(std::any_of(issues.begin(), issues.end(), [](const VerifyIssue& i) {
    return i.check == "structure" && i.message.find("SEND is a second op with pairing id") != std::string::npos;
  }));
  // A collective id that names two families: one occurrence cannot span them.
  Program q = compile_scenario(cases()[0].scenario).result.program;  // GPipe PP 2 x DP 2: a DP family per stage
  std::vector<Op*> collectives;
  for (auto& plan : q.plans)
    for (auto& st : plan.streams)
      for (auto& op : st.ops)
        if (is_collective(op.kind)) collectives.push_back(&op);
  auto other = std::find_if(collectives.begin(), collectives.end(), [&](const Op* o) {
    return o->family != collectives.front()->family && o->kind == collectives.front()->kind;
  });
  ASSERT_NE(other, collectives.end());
  (*other)->pair = collectives.front()->pair;
  const auto q_issues = verify(q);
  EXPECT_TRUE(std::any_of(q_issues.begin(), q_issues.end(), [](const VerifyIssue& i) {
    return i.check == "collective-order" && i.message.find("has pairing id") != std::string::npos &&
           i.message.find("device ") != std::string::npos;
  })) << (q_issues.empty() ? "" : q_issues.front().message);
}

// The ReadyTracker meets ops by pairing id; a reference that meets them by SEND node and family
// position from the device sets gives every op instance the same end time, in full mode and reduced
// by symmetry (every representative's ops).
TEST(PairingIds, ReadyTrackerTimelinesEqualTheBruteForceReference) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const CompiledScenario compiled = compile_scenario(c.scenario);
    const Program& p = compiled.result.program;
    const Ends reference = reference_times(p, [&](int d, OpRef r) { return reference_meeting(p, d, r); });
    EXPECT_EQ(static_cast<std::int64_t>(reference.size()), p.total_ops());
    const Ends full = tracker_times(p, nullptr);
    EXPECT_EQ(full, reference);
    const sim::Symmetry symmetry =
        sim::find_symmetry(p, sim::with_devices(sim::load_cluster("dgx-h200"), p.num_devices));
    EXPECT_TRUE(symmetry.usable) << symmetry.note;
    const Ends reduced = tracker_times(p, &symmetry);
    for (const auto& [member, end] : reduced) {
      auto it = reference.find(member);
      ASSERT_NE(it, reference.end());
      EXPECT_DOUBLE_EQ(end, it->second) << "device " << member.first;
    }
  }
}

// The rule of when an op may start, stated once.
TEST(Readiness, MayStartNeedsItsStreamTurnAndEveryWait) {
  Op op;
  op.waits = {{1, 2}, {2, 0}};
  std::vector<int> done = {3, 3, 1};
  auto count = [&](int s) { return done[ix(s)]; };
  EXPECT_TRUE(may_start(op, OpRef{0, 3}, count));
  EXPECT_FALSE(may_start(op, OpRef{0, 4}, count));  // not its stream's next op
  done[1] = 2;
  EXPECT_FALSE(may_start(op, OpRef{0, 3}, count));  // stream 1's op 2 has not finished
  done[1] = 3, done[2] = 0;
  EXPECT_FALSE(may_start(op, OpRef{0, 3}, count));
}

// Tied embeddings are a typed pair of the Program: the head's segment names the embedding's
// (ProgramSegment::tied_to), lowered from the tied-embedding segments; read and checked on load.
TEST(TiedPair, TheHeadSegmentNamesTheEmbeddingSegment) {
  Scenario s = base("1f1b", 2, 1, 2);
  s.model = "gpt3-175b";
  const CompiledScenario compiled = compile_scenario(s);
  const Program& p = compiled.result.program;
  int tied = 0;
  for (std::size_t i = 0; i < p.segments.size(); ++i) {
    const ProgramSegment& sg = p.segments[i];
    if (sg.tied_to < 0) continue;
    ++tied;
    EXPECT_EQ(p.segments[ix(sg.tied_to)].first_layer, 0);  // the embedding is the model's first layer
    int last = 0;
    for (const auto& other : p.segments) last = std::max(last, other.last_layer);
    EXPECT_EQ(sg.last_layer, last);  // the head its last
  }
  EXPECT_EQ(tied, 1);
  const json j = p.to_json();
  EXPECT_TRUE(Program::from_json(j) == p);
  json bad = j;
  for (auto& sg : bad["segments"])
    if (sg.contains("tied_to")) sg["tied_to"] = 99;
  try {
    (void)Program::from_json(bad);
    FAIL() << "tied_to 99 was read";
  } catch (const PlanError& e) {
    EXPECT_NE(std::string(e.what()).find("tied_to"), std::string::npos) << e.what();
  }
  // An untied model has no pair.
  const CompiledScenario untied = compile_scenario(base("1f1b", 2, 1, 2));
  for (const auto& sg : untied.result.program.segments) EXPECT_EQ(sg.tied_to, -1);
}
