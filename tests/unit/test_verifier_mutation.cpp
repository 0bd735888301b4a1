// Mutation testing of the verifier: compiled Programs of every schedule family (plain, EP and ZeRO
// variants) get one fault injected at a time (a dropped SEND, RECV or collective, two transfers or
// two collectives swapped on one device, an intra- or cross-device wait cycle, a buffer freed before its last use, a
// collective moved to another family or resized), and the verifier must report every one, naming the device and the op.
//
// Plans are shared by classes of devices (data-parallel replicas run one plan). A fault written into
// a shared plan would hit every replica alike, and some faults (a swapped pair of collectives, a
// resized all-reduce) are then no fault at all: every group member still agrees. So the test first
// splits the target device out into a plan of its own (a copy of its class's plan; the split
// program verifies clean) and injects the fault there, on that one device.
//
// Ground truth. Most kinds are faults by definition (a SEND without its RECV, a use after the free,
// group members disagreeing on a collective). A swap of collectives of two different families and an
// added cross-stream wait are faults only if they deadlock, which depends on the other devices; for
// those an independent oracle decides: it expands the Program to every device and executes it under
// the documented semantics (streams in order, waits, rendezvous transfers, collectives that start
// when all members arrived) until it finishes or gets stuck. Mutations the oracle runs to the end
// are benign and not counted.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include "piper/core/scenario.hpp"
#include "piper/core/schedule_view.hpp"
#include "piper/core/verifier.hpp"

using namespace piper::core;

namespace {

bool is_collective(OpKind k) {
  return k == OpKind::AllReduce || k == OpKind::ReduceScatter || k == OpKind::AllGather || k == OpKind::AllToAll;
}
std::size_t ix(int i) { return static_cast<std::size_t>(i); }

// ---- the oracle: explicit execution of every device ----

// True when the program runs to completion under the execution semantics.
bool runs_to_completion(const Program& p) {
  const int n = p.num_devices;
  std::vector<std::vector<int>> next(ix(n));                // device, stream -> next op index
  std::vector<std::vector<std::vector<char>>> done(ix(n));  // device, stream, op
  std::size_t remaining = 0;
  for (int d = 0; d < n; ++d) {
    const Plan& plan = p.plan_for(d);
    next[ix(d)].assign(plan.streams.size(), 0);
    for (const auto& s : plan.streams) {
      done[ix(d)].emplace_back(s.ops.size(), 0);
      remaining += s.ops.size();
    }
  }
  auto head = [&](int d, int s) -> const Op* {
    const auto& ops = p.plan_for(d).streams[ix(s)].ops;
    const int i = next[ix(d)][ix(s)];
    if (ix(i) >= ops.size()) return nullptr;
    for (const OpRef& w : ops[ix(i)].waits)
      if (!done[ix(d)][ix(w.stream)][ix(w.index)]) return nullptr;
    return &ops[ix(i)];
  };
  auto finish = [&](int d, int s) {
    done[ix(d)][ix(s)][ix(next[ix(d)][ix(s)]++)] = 1;
    --remaining;
  };
  // The stream of device e whose ready head matches `want`, or -1.
  auto find_head = [&](int e, const std::function<bool(const Op&)>& want) {
    for (std::size_t s = 0; s < p.plan_for(e).streams.size(); ++s)
      if (const Op* h = head(e, static_cast<int>(s)); h && want(*h)) return static_cast<int>(s);
    return -1;
  };
  bool progress = true;
  while (remaining > 0 && progress) {
    progress = false;
    for (int d = 0; d < n; ++d)
      for (std::size_t s = 0; s < p.plan_for(d).streams.size(); ++s) {
        const Op* op = nullptr;
        while ((op = head(d, static_cast<int>(s)))) {
          if (op->kind == OpKind::Compute || op->kind == OpKind::Update) {
            finish(d, static_cast<int>(s));
          } else if (op->kind == OpKind::Send || op->kind == OpKind::Recv) {
            const int e = p.peer_of(*op, d);
            if (e < 0) return false;
            const OpKind other = op->kind == OpKind::Send ? OpKind::Recv : OpKind::Send;
            const int node = op->node;
            const int t =
                find_head(e, [&](const Op& h) { return h.kind == other && h.node == node && p.peer_of(h, e) == d; });
            if (t < 0) break;
            finish(d, static_cast<int>(s));
            finish(e, t);
          } else {
            const auto group = p.group_of(op->family, d);
            std::vector<std::pair<int, int>> members;
            const Op key = *op;
            for (int e : group) {
              const int t = e == d ? static_cast<int>(s) : find_head(e, [&](const Op& h) {
                return is_collective(h.kind) && h.family == key.family && h.node == key.node && h.kind == key.kind;
              });
              if (t < 0) break;
              members.push_back({e, t});
            }
            if (members.size() != group.size()) break;
            for (auto [e, t] : members) finish(e, t);
          }
          progress = true;
        }
      }
  }
  return remaining == 0;
}

// ---- program surgery ----

// Gives `device` a plan of its own (a copy of its class's plan); returns the new plan's index.
int isolate(Program& p, int device) {
  p.plans.push_back(p.plans[ix(p.plan_of_device[ix(device)])]);
  p.plan_of_device[ix(device)] = static_cast<int>(p.plans.size()) - 1;
  return p.plan_of_device[ix(device)];
}

// Applies f to every OpRef of the plan (waits, buffer alloc/free).
void for_each_ref(Plan& plan, const std::function<void(OpRef&)>& f) {
  for (auto& s : plan.streams)
    for (auto& op : s.ops)
      for (auto& w : op.waits) f(w);
  for (auto& b : plan.buffers) {
    if (b.alloc.stream >= 0) f(b.alloc);
    if (b.free.stream >= 0) f(b.free);
  }
}

// Removes an op; references to it move to its stream predecessor (or successor), later ones shift.
void erase_op(Plan& plan, OpRef r) {
  auto& ops = plan.streams[ix(r.stream)].ops;
  const int last = static_cast<int>(ops.size()) - 1;
  for_each_ref(plan, [&](OpRef& x) {
    if (x.stream != r.stream) return;
    if (x.index == r.index)
      x.index = r.index > 0 ? r.index - 1 : (last > 0 ? 0 : -1);
    else if (x.index > r.index)
      --x.index;
  });
  for (auto& s : plan.streams)
    for (auto& op : s.ops) std::erase_if(op.waits, [](const OpRef& w) { return w.index < 0; });
  ops.erase(ops.begin() + r.index);
}

// Swaps two ops of one stream; references follow the ops.
void swap_ops(Plan& plan, int stream, int a, int b) {
  auto& ops = plan.streams[ix(stream)].ops;
  std::swap(ops[ix(a)], ops[ix(b)]);
  for_each_ref(plan, [&](OpRef& x) {
    if (x.stream != stream) return;
    if (x.index == a)
      x.index = b;
    else if (x.index == b)
      x.index = a;
  });
  // An op never waits on its own stream: drop waits that now point at the swapped partner's stream.
  for (int i : {a, b}) std::erase_if(ops[ix(i)].waits, [&](const OpRef& w) { return w.stream == stream; });
}

// Happens-before inside one plan (stream order + waits, transitively), as a reachability table.
struct Order {
  std::vector<std::vector<int>> base;
  std::vector<std::vector<char>> reach;  // reach[u][v]: u happens-before-or-equals v
  explicit Order(const Plan& plan) {
    int n = 0;
    for (const auto& s : plan.streams) {
      base.emplace_back();
      for (std::size_t i = 0; i < s.ops.size(); ++i) base.back().push_back(n++);
    }
    reach.assign(ix(n), std::vector<char>(ix(n), 0));
    // Ops in issue order of a topological sort: repeat relaxation until stable (plans are small).
    std::vector<std::vector<int>> preds(ix(n));
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        const int v = base[s][i];
        if (i > 0) preds[ix(v)].push_back(base[s][i - 1]);
        for (const OpRef& w : plan.streams[s].ops[i].waits) preds[ix(v)].push_back(base[ix(w.stream)][ix(w.index)]);
      }
    std::vector<int> order, state(ix(n), 0);
    std::function<void(int)> visit = [&](int v) {
      state[ix(v)] = 1;
      for (int u : preds[ix(v)])
        if (!state[ix(u)]) visit(u);
      order.push_back(v);
    };
    for (int v = 0; v < n; ++v)
      if (!state[ix(v)]) visit(v);
    for (int v : order) {
      reach[ix(v)][ix(v)] = 1;
      for (int u : preds[ix(v)])
        for (int x = 0; x < n; ++x)
          if (reach[ix(x)][ix(u)]) reach[ix(x)][ix(v)] = 1;
    }
  }
  bool before(OpRef a, OpRef b) const {
    return reach[ix(base[ix(a.stream)][ix(a.index)])][ix(base[ix(b.stream)][ix(b.index)])];
  }
};

// ---- one mutation ----

struct Mutation {
  std::string kind;  // fault kind
  std::string what;  // for failure messages
  Program program;
  int device = -1;               // the faulty device (its own plan)
  std::set<std::string> ops;     // labels one of which the message must name
  std::set<std::string> checks;  // acceptable verifier checks
  bool needs_oracle = false;
};

bool names_device(const std::string& message, int device) {
  return std::regex_search(message, std::regex("device " + std::to_string(device) + "([^0-9]|$)"));
}

// Picks up to `count` spread positions from n candidates.
std::vector<std::size_t> spread(std::size_t n, std::size_t count) {
  std::vector<std::size_t> out;
  if (n <= count) {
    for (std::size_t k = 0; k < n; ++k) out.push_back(k);
  } else {
    for (std::size_t k = 0; k < count; ++k) out.push_back(count == 1 ? 0 : k * (n - 1) / (count - 1));
  }
  return out;
}

constexpr std::size_t kPositions = 3;

std::vector<Mutation> mutations_of(const Program& clean, int device, int& benign, int& false_alarms) {
  std::vector<Mutation> out;
  Program base = clean;
  const int plan_index = isolate(base, device);
  const Plan& plan = base.plans[ix(plan_index)];
  auto label = [&](OpRef r) { return plan.streams[ix(r.stream)].ops[ix(r.index)].label; };
  auto op_at = [&](OpRef r) -> const Op& { return plan.streams[ix(r.stream)].ops[ix(r.index)]; };
  std::vector<OpRef> sends, recvs, colls;
  for (std::size_t s = 0; s < plan.streams.size(); ++s)
    for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
      OpRef r{static_cast<int>(s), static_cast<int>(i)};
      const Op& op = op_at(r);
      if (op.kind == OpKind::Send) sends.push_back(r);
      if (op.kind == OpKind::Recv) recvs.push_back(r);
      if (is_collective(op.kind) && base.group_of(op.family, device).size() > 1) colls.push_back(r);
    }
  auto make = [&](const std::string& kind, const std::string& what, std::set<std::string> ops,
                  std::set<std::string> checks) {
    Mutation m{kind, what, base, device, std::move(ops), std::move(checks), false};
    return m;
  };
  auto counterpart_label = [&](OpRef r) {
    const Op& op = op_at(r);
    const int e = base.peer_of(op, device);
    for (const auto& s : base.plan_for(e).streams)
      for (const auto& o : s.ops)
        if (o.node == op.node && (o.kind == OpKind::Send || o.kind == OpKind::Recv) && o.kind != op.kind)
          return o.label;
    return std::string();
  };

  // Dropped SEND / RECV.
  for (const auto* list : {&sends, &recvs})
    for (std::size_t k : spread(list->size(), kPositions)) {
      const OpRef r = (*list)[k];
      Mutation m = make(list == &sends ? "drop-send" : "drop-recv", "drop " + label(r),
                        {label(r), counterpart_label(r)}, {"send-recv"});
      erase_op(m.program.plans[ix(plan_index)], r);
      out.push_back(std::move(m));
    }

  // A collective missing on this device: its group members issue one more than it does.
  for (std::size_t k : spread(colls.size(), kPositions)) {
    const OpRef r = colls[k];
    Mutation m = make("drop-collective", "drop " + label(r), {label(r)}, {"collective-order"});
    erase_op(m.program.plans[ix(plan_index)], r);
    out.push_back(std::move(m));
  }

  // Two transfers of one stream swapped (streams carry one direction to one peer set): this device
  // then waits for a transfer its peer issues only after the other one, a cross-device deadlock
  // unless the peer happens to issue them on separate streams (the oracle decides).
  std::vector<std::pair<OpRef, OpRef>> transfers;
  for (const auto* list : {&sends, &recvs})
    for (std::size_t a = 0; a + 1 < list->size(); ++a)
      if ((*list)[a].stream == (*list)[a + 1].stream) transfers.push_back({(*list)[a], (*list)[a + 1]});
  for (std::size_t k : spread(transfers.size(), kPositions)) {
    const auto [a, b] = transfers[k];
    Mutation m = make("swap-transfers", "swap " + label(a) + " and " + label(b), {label(a), label(b)}, {"deadlock"});
    m.needs_oracle = true;
    swap_ops(m.program.plans[ix(plan_index)], a.stream, a.index, b.index);
    out.push_back(std::move(m));
  }

  // Two collectives of one stream swapped: of the same family (the group sees another order), or of
  // two different families (a deadlock when the other group members interleave them the other way).
  std::vector<std::pair<OpRef, OpRef>> same, different;
  for (std::size_t a = 0; a < colls.size(); ++a)
    for (std::size_t b = a + 1; b < colls.size(); ++b) {
      if (colls[a].stream != colls[b].stream) continue;
      const Op &x = op_at(colls[a]), &y = op_at(colls[b]);
      if (x.family == y.family && (x.node != y.node || x.kind != y.kind || x.bytes != y.bytes))
        same.push_back({colls[a], colls[b]});
      if (x.family != y.family) different.push_back({colls[a], colls[b]});
    }
  for (const auto* list : {&same, &different})
    for (std::size_t k : spread(list->size(), kPositions)) {
      const auto [a, b] = (*list)[k];
      const bool diff = list == &different;
      Mutation m = make(
          diff ? "swap-collectives-2-families" : "swap-collectives", "swap " + label(a) + " and " + label(b),
          {label(a), label(b)},
          diff ? std::set<std::string>{"deadlock", "collective-order"} : std::set<std::string>{"collective-order"});
      m.needs_oracle = diff;
      swap_ops(m.program.plans[ix(plan_index)], a.stream, a.index, b.index);
      out.push_back(std::move(m));
    }

  // Wait cycles. Intra-device: an op waits on a later op of another stream that (transitively) waits
  // on it. Cross-device: an op waits on an op of another stream with no order between them on this
  // device, which closes a cycle only through other devices (the oracle confirms it does).
  const Order order(plan);
  std::vector<std::pair<OpRef, OpRef>> intra, cross;
  for (std::size_t s = 0; s < plan.streams.size(); ++s)
    for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
      const OpRef b{static_cast<int>(s), static_cast<int>(i)};
      for (const OpRef& w : op_at(b).waits) intra.push_back({w, b});  // w before b: make w wait on b
    }
  for (const OpRef& r : recvs)
    for (std::size_t s = 0; s < plan.streams.size(); ++s) {
      if (static_cast<int>(s) == r.stream) continue;
      // The first op of stream s that is unordered with the RECV and precedes work that feeds a SEND.
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        const OpRef a{static_cast<int>(s), static_cast<int>(i)};
        if (order.before(a, r) || order.before(r, a)) continue;
        cross.push_back({a, r});
        break;
      }
    }
  for (std::size_t k : spread(intra.size(), kPositions)) {
    const auto [a, b] = intra[k];
    Mutation m = make("wait-cycle", label(a) + " waits on " + label(b), {label(a), label(b)}, {"deadlock"});
    m.program.plans[ix(plan_index)].streams[ix(a.stream)].ops[ix(a.index)].waits.push_back(b);
    out.push_back(std::move(m));
  }
  for (std::size_t k = 0, taken = 0; k < cross.size() && taken < kPositions; ++k) {
    const auto [a, b] = cross[k];
    Mutation m =
        make("cross-device-wait-cycle", label(a) + " waits on " + label(b), {label(a), label(b)}, {"deadlock"});
    m.program.plans[ix(plan_index)].streams[ix(a.stream)].ops[ix(a.index)].waits.push_back(b);
    m.needs_oracle = true;
    if (runs_to_completion(m.program)) {  // no cycle through other devices: not a fault
      ++benign;
      if (auto v = verify(m.program); !v.empty()) {
        ++false_alarms;
        if (std::getenv("PIPER_MUTATION_VERBOSE"))
          std::printf("false alarm: %s: %s: %s\n", m.what.c_str(), v[0].check.c_str(), v[0].message.c_str());
      }
      continue;
    }
    ++taken;
    out.push_back(std::move(m));
  }

  // A transient buffer freed before its last use: at its alloc op, or just before the last user.
  std::vector<std::tuple<int, OpRef, OpRef>> early;  // buffer, new free, the user left behind
  for (std::size_t bi = 0; bi < plan.buffers.size(); ++bi) {
    const Buffer& buf = plan.buffers[bi];
    if (buf.persistent() || buf.free.stream < 0) continue;
    std::vector<OpRef> users;
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i)
        for (int u : plan.streams[s].ops[i].uses)
          if (u == static_cast<int>(bi)) users.push_back({static_cast<int>(s), static_cast<int>(i)});
    OpRef last{-1, -1};
    for (const OpRef& u : users)
      if (u != buf.alloc && (last.stream < 0 || order.before(last, u))) last = u;
    if (last.stream < 0) continue;
    early.push_back({static_cast<int>(bi), buf.alloc, last});
    if (last.index > 0 && OpRef{last.stream, last.index - 1} != buf.alloc)
      early.push_back({static_cast<int>(bi), {last.stream, last.index - 1}, last});
  }
  for (std::size_t k : spread(early.size(), 2 * kPositions)) {
    const auto [bi, at, user] = early[k];
    Mutation m = make("free-before-last-use", "free '" + plan.buffers[ix(bi)].name + "' at " + label(at),
                      {label(user), label(at)}, {"buffer"});
    m.program.plans[ix(plan_index)].buffers[ix(bi)].free = at;
    out.push_back(std::move(m));
  }

  // A collective put in another family (one this device belongs to, else any other), or resized.
  for (std::size_t k : spread(colls.size(), kPositions)) {
    const OpRef r = colls[k];
    const Op& op = op_at(r);
    int other = -1;
    for (int f = 0; f < static_cast<int>(base.families.size()); ++f)
      if (f != op.family && (other < 0 || !base.group_of(f, device).empty())) other = f;
    if (other >= 0) {
      Mutation m = make("group-family-mismatch", label(r) + " in family " + std::to_string(other), {label(r)},
                        {"collective-order"});
      m.program.plans[ix(plan_index)].streams[ix(r.stream)].ops[ix(r.index)].family = other;
      out.push_back(std::move(m));
    }
    Mutation m = make("group-bytes-mismatch", label(r) + " resized", {label(r)}, {"collective-order"});
    m.program.plans[ix(plan_index)].streams[ix(r.stream)].ops[ix(r.index)].bytes += 4;
    out.push_back(std::move(m));
  }
  return out;
}

struct Variant {
  std::string name;
  StrategyOptions o;
  std::string model = "qwen3-9m";
};

std::vector<Variant> variants() {
  std::vector<Variant> out;
  for (const auto& family : schedule_registry()) {
    auto add = [&](const std::string& tag, int pp, int dp, int ep, int zero, int virtual_stages, int dp_shard = 0) {
      StrategyOptions o;
      o.schedule = family.name;
      o.pp = pp, o.dp = dp, o.ep = ep, o.zero = zero, o.microbatches = 4, o.virtual_stages = virtual_stages;
      o.dp_shard = dp_shard;
      out.push_back({family.name + " " + tag, o});
    };
    // Families with chunks per rank use 2 (the V families fix it themselves).
    const bool looped =
        family.name == "interleaved-1f1b" || family.name == "interleaved-1f1b-overlap" || family.name == "looped-bfs";
    const int v = looped ? 2 : (family.name == "zb-v" || family.name == "dualpipev") ? 2 : 1;
    add("pp2 dp2", 2, 2, 1, 0, v);
    add("pp2 dp2 ep2 zero1", 2, 2, 2, 1, v);
    add("pp2 dp4 ep2 zero3", 2, 4, 2, 3, v);
    add("pp2 dp4 zero2 hsdp2", 2, 4, 1, 2, v, 2);  // two collective families per bucket (HSDP)
    // A tied GPT: the first and the last stage sum the table's gradient over pairs (tied-embedding).
    if (family.name == "1f1b" || looped) {
      add("gpt tied pp2 dp2 zero1", 2, 2, 1, 1, v);
      out.back().model = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-gpt.json";
    }
  }
  return out;
}

}  // namespace

// The oracle itself: two devices that each send before they receive deadlock under rendezvous
// transfers; receiving first on one side runs.
TEST(VerifierMutation, OracleFindsTheCrossedSendsDeadlock) {
  Program p;
  p.num_devices = 2;
  p.device_sets = {{0}, {1}};
  p.plan_of_device = {0, 1};
  auto transfer = [](OpKind kind, int node, DeviceSetId me, DeviceSetId peer) {
    Op o;
    o.kind = kind, o.node = node, o.pair = node, o.device_set = me, o.peer_set = peer,
    o.label = to_string(kind) + std::to_string(node);
    return o;
  };
  Plan a, b;
  a.streams = {{"pp", {transfer(OpKind::Send, 3, 0, 1), transfer(OpKind::Recv, 4, 0, 1)}}};
  b.streams = {{"pp", {transfer(OpKind::Send, 4, 1, 0), transfer(OpKind::Recv, 3, 1, 0)}}};
  p.plans = {a, b};
  EXPECT_FALSE(runs_to_completion(p));
  std::swap(p.plans[1].streams[0].ops[0], p.plans[1].streams[0].ops[1]);
  EXPECT_TRUE(runs_to_completion(p));
}

TEST(VerifierMutation, EveryInjectedFaultIsCaughtNamingDeviceAndOp) {
  std::map<std::string, std::pair<int, int>> per_kind;  // kind -> (caught, injected)
  int injected = 0, caught = 0, benign = 0, false_alarms = 0, programs = 0;
  std::vector<std::string> misses;
  for (const auto& v : variants()) {
    Scenario s;
    s.model = v.model;
    s.strategy = v.o;
    Program clean;
    try {
      clean = compile_scenario(s).result.program;
    } catch (const std::exception& e) {
      ADD_FAILURE() << v.name << ": " << e.what();
      continue;
    }
    ++programs;
    ASSERT_TRUE(runs_to_completion(clean)) << v.name << ": the oracle must run the clean program";
    // Targets: the first and the last device (different pipeline ranks and replicas).
    for (int device : {0, clean.num_devices - 1}) {
      Program split = clean;
      isolate(split, device);
      ASSERT_TRUE(verify(split).empty()) << v.name << ": splitting device " << device << " out must stay clean";
      for (auto& m : mutations_of(clean, device, benign, false_alarms)) {
        if (m.needs_oracle && runs_to_completion(m.program)) {
          ++benign;
          if (!verify(m.program).empty())
            ++false_alarms;  // e.g. two collectives whose groups do not interleave them: no deadlock, no fault
          continue;
        }
        ++injected;
        auto& k = per_kind[m.kind];
        ++k.second;
        const auto issues = verify(m.program);
        const bool ok = std::any_of(issues.begin(), issues.end(), [&](const VerifyIssue& i) {
          return m.checks.count(i.check) && names_device(i.message, m.device) &&
                 std::any_of(m.ops.begin(), m.ops.end(), [&](const std::string& l) {
                   return !l.empty() && i.message.find("'" + l + "'") != std::string::npos;
                 });
        });
        if (ok) {
          ++caught, ++k.first;
        } else {
          std::string got;
          for (const auto& i : issues) got += "\n    " + i.check + ": " + i.message;
          misses.push_back(v.name + " device " + std::to_string(device) + " " + m.kind + " (" + m.what +
                           "):" + (got.empty() ? " (clean)" : got));
        }
      }
    }
  }
  for (const auto& [kind, counts] : per_kind)
    std::printf("  %-28s %4d/%d caught\n", kind.c_str(), counts.first, counts.second);
  std::printf(
      "mutation: %d/%d caught (%d programs of %zu schedule families; %d benign swaps/waits run to completion in the "
      "oracle and are not "
      "counted; the verifier flags %d of them)\n",
      caught, injected, programs, schedule_registry().size(), benign, false_alarms);
  EXPECT_EQ(caught, injected);
  for (std::size_t i = 0; i < std::min<std::size_t>(misses.size(), 15); ++i) ADD_FAILURE() << misses[i];
  // Every kind was injected somewhere.
  for (const char* kind : {"drop-send", "drop-recv", "drop-collective", "swap-transfers", "swap-collectives",
                           "swap-collectives-2-families", "wait-cycle", "cross-device-wait-cycle",
                           "free-before-last-use", "group-family-mismatch", "group-bytes-mismatch"})
    EXPECT_GT(per_kind[kind].second, 0) << kind;
}
