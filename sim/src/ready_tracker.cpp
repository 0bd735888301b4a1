// ReadyTracker: per-stream cursors, waits, transfer rendezvous and collective instances over flat
// per-plan tables, so that 10^4-device programs cost a few array lookups per op.
#include "piper/sim/ready_tracker.hpp"

#include <algorithm>
#include <map>
#include <unordered_map>

#include <fmt/format.h>

namespace piper::sim {

using core::OpKind;
using core::OpRef;
using Activity = ReadyTracker::Activity;

namespace {

constexpr std::size_t ix(std::int64_t i) { return static_cast<std::size_t>(i); }

bool is_collective(OpKind k) {
  return k == OpKind::AllReduce || k == OpKind::ReduceScatter || k == OpKind::AllGather || k == OpKind::AllToAll;
}

}  // namespace

struct ReadyTracker::State {
  struct OpInfo {
    OpKind kind;
    std::int32_t node;
    std::int32_t waits_begin, waits_end;  // into Plan::waits
    std::int32_t seq;                     // collectives: position in its family's sequence on this plan
  };
  struct PlanIndex {
    std::vector<std::int32_t> stream_base;  // stream -> first flat op; back() = op count
    std::vector<OpInfo> ops;
    std::vector<OpRef> waits;
    std::vector<std::vector<OpRef>> family_seq;  // family -> its collectives in sequence order
    std::unordered_map<std::int32_t, std::vector<std::int32_t>> send_by_node, recv_by_node;  // node -> flat ops
    std::int32_t flat(OpRef r) const { return stream_base[ix(r.stream)] + r.index; }
    OpRef ref(std::int32_t flat) const {
      auto it = std::upper_bound(stream_base.begin(), stream_base.end(), flat);
      const int s = static_cast<int>(it - stream_base.begin()) - 1;
      return {s, flat - stream_base[ix(s)]};
    }
  };
  struct FamilyIndex {
    std::vector<std::vector<int>> groups;
    std::vector<std::int32_t> group_of_device;  // -1: not a member
    std::int32_t seq_count = 0;                 // collectives per member (max over plans)
    std::vector<std::int32_t> arrived;          // group * seq_count + seq
  };

  const core::Program& program;
  const Symmetry* sym = nullptr;  // reduced mode when set
  std::vector<int> plan_of;
  std::vector<int> ranks;                                       // collective_ranks() buffer (full mode)
  std::map<std::pair<int, int>, std::vector<int>> real_groups;  // (family, device) -> group (reduced)
  std::vector<PlanIndex> plans;
  std::vector<std::int64_t> device_base;
  std::vector<std::int64_t> stream_state_base;  // device -> first entry of done/issued
  std::vector<std::int32_t> done;
  std::vector<std::uint8_t> issued;
  std::vector<std::uint8_t> transfer_state;  // per SEND instance: bit 0 SEND arrived, bit 1 RECV arrived
  std::vector<FamilyIndex> families;
  std::vector<std::vector<int>> positions;  // device set -> device -> position
  std::vector<Activity> ready;
  std::vector<int> dirty_list;
  std::vector<std::uint8_t> dirty;
  std::int64_t total_ops = 0, finished_ops = 0;

  explicit State(const core::Program& p) : program(p) {}

  const std::vector<int>& position_table(core::DeviceSetId set) {
    auto& t = positions[ix(set)];
    if (t.empty()) {
      t.assign(ix(program.num_devices), -1);
      const auto& devices = program.device_sets[ix(set)];
      for (std::size_t i = 0; i < devices.size(); ++i) t[ix(devices[i])] = static_cast<int>(i);
    }
    return t;
  }
  int peer_of(const core::Op& op, int device) {
    const int pos = position_table(op.device_set)[ix(device)];
    const auto& peers = program.device_sets[ix(op.peer_set)];
    if (pos < 0 || ix(pos) >= peers.size()) return -1;
    return sym ? sym->representative_of(peers[ix(pos)]) : peers[ix(pos)];
  }
  const core::Op& op_at(int device, OpRef r) const {
    return program.plans[ix(plan_of[ix(device)])].streams[ix(r.stream)].ops[ix(r.index)];
  }
  // The op of kind `want` with `node` on `device` whose peer is `peer` (flat index), or -1.
  std::int32_t counterpart(int device, std::int32_t node, bool want_send, int peer) {
    const PlanIndex& pi = plans[ix(plan_of[ix(device)])];
    const auto& table = want_send ? pi.send_by_node : pi.recv_by_node;
    auto it = table.find(node);
    if (it == table.end()) return -1;
    if (it->second.size() == 1) return it->second.front();  // the verifier matched it; peers agree
    for (std::int32_t f : it->second)
      if (peer_of(op_at(device, pi.ref(f)), device) == peer) return f;
    return -1;
  }

  void mark_dirty(int device) {
    if (!dirty[ix(device)]) {
      dirty[ix(device)] = 1;
      dirty_list.push_back(device);
    }
  }

  void offer(int device, int stream, std::int32_t flat) {
    const PlanIndex& pi = plans[ix(plan_of[ix(device)])];
    const OpInfo& info = pi.ops[ix(flat)];
    const OpRef r{stream, flat - pi.stream_base[ix(stream)]};
    if (info.kind == OpKind::Compute || info.kind == OpKind::Update) {
      ready.push_back({Activity::Kind::Compute, {{device, r}}});
      return;
    }
    if (info.kind == OpKind::Send || info.kind == OpKind::Recv) {
      const bool sending = info.kind == OpKind::Send;
      const core::Op& op = op_at(device, r);
      const int peer = peer_of(op, device);
      if (peer < 0) return;  // unmatched: stays stuck, reported by stuck_report()
      const std::int32_t other = counterpart(peer, info.node, !sending, device);
      if (other < 0) return;
      const int sender = sending ? device : peer;
      const std::int64_t send_instance = sending ? device_base[ix(device)] + flat : device_base[ix(peer)] + other;
      std::uint8_t& st = transfer_state[ix(send_instance)];
      st |= sending ? 1 : 2;
      if (st == 3) {
        const PlanIndex& qi = plans[ix(plan_of[ix(peer)])];
        const OpRef theirs = qi.ref(other);
        Activity a{Activity::Kind::Transfer, {}};
        if (sending)
          a.members = {{device, r}, {peer, theirs}};
        else
          a.members = {{peer, theirs}, {device, r}};
        (void)sender;
        ready.push_back(std::move(a));
      }
      return;
    }
    if (is_collective(info.kind)) {
      const core::Op& op = op_at(device, r);
      FamilyIndex& fam = families[ix(op.family)];
      const std::int32_t g = fam.group_of_device[ix(device)];
      if (g < 0 || info.seq >= fam.seq_count) return;
      const std::size_t slot = ix(static_cast<std::int64_t>(g) * fam.seq_count + info.seq);
      const auto& group = fam.groups[ix(g)];
      if (++fam.arrived[slot] == static_cast<std::int32_t>(group.size())) {
        Activity a{Activity::Kind::Collective, {}};
        a.members.reserve(group.size());
        for (int member : group) {
          const auto& seq = plans[ix(plan_of[ix(member)])].family_seq[ix(op.family)];
          a.members.emplace_back(member, seq.at(ix(info.seq)));
        }
        ready.push_back(std::move(a));
      }
    }
  }

  void scan(int device) {
    const int p = plan_of[ix(device)];
    const PlanIndex& pi = plans[ix(p)];
    const std::int64_t base = stream_state_base[ix(device)];
    const int streams = static_cast<int>(pi.stream_base.size()) - 1;
    for (int s = 0; s < streams; ++s) {
      if (issued[ix(base + s)]) continue;
      const std::int32_t head = done[ix(base + s)];
      if (head >= pi.stream_base[ix(s + 1)] - pi.stream_base[ix(s)]) continue;
      const std::int32_t flat = pi.stream_base[ix(s)] + head;
      const OpInfo& info = pi.ops[ix(flat)];
      bool ok = true;
      for (std::int32_t w = info.waits_begin; w < info.waits_end && ok; ++w) {
        const OpRef& dep = pi.waits[ix(w)];
        ok = done[ix(base + dep.stream)] > dep.index;
      }
      if (!ok) continue;
      issued[ix(base + s)] = 1;
      offer(device, s, flat);
    }
  }
};

ReadyTracker::ReadyTracker(const core::Program& program) : ReadyTracker(program, nullptr) {}

ReadyTracker::ReadyTracker(const core::Program& program, const Symmetry* symmetry)
    : s_(std::make_unique<State>(program)) {
  State& st = *s_;
  st.sym = symmetry;
  // Reduced mode: non-representatives hold no op instances and are never scanned.
  auto simulated = [&](int d) { return !symmetry || symmetry->is_representative(d); };
  const int n = program.num_devices;
  st.plan_of.assign(program.plan_of_device.begin(), program.plan_of_device.end());
  st.positions.resize(program.device_sets.size());
  st.plans.resize(program.plans.size());
  for (std::size_t p = 0; p < program.plans.size(); ++p) {
    const core::Plan& plan = program.plans[p];
    State::PlanIndex& pi = st.plans[p];
    pi.family_seq.resize(program.families.size());
    std::int32_t flat = 0;
    for (const auto& stream : plan.streams) {
      pi.stream_base.push_back(flat);
      flat += static_cast<std::int32_t>(stream.ops.size());
    }
    pi.stream_base.push_back(flat);
    pi.ops.reserve(ix(flat));
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        const core::Op& op = plan.streams[s].ops[i];
        State::OpInfo info{op.kind, op.node, static_cast<std::int32_t>(pi.waits.size()), 0, -1};
        for (const OpRef& w : op.waits) pi.waits.push_back(w);
        info.waits_end = static_cast<std::int32_t>(pi.waits.size());
        const OpRef r{static_cast<int>(s), static_cast<int>(i)};
        if (is_collective(op.kind) && op.family >= 0 && ix(op.family) < pi.family_seq.size()) {
          info.seq = static_cast<std::int32_t>(pi.family_seq[ix(op.family)].size());
          pi.family_seq[ix(op.family)].push_back(r);
        }
        if (op.kind == OpKind::Send) pi.send_by_node[op.node].push_back(pi.flat(r));
        if (op.kind == OpKind::Recv) pi.recv_by_node[op.node].push_back(pi.flat(r));
        pi.ops.push_back(info);
      }
  }
  st.device_base.resize(ix(n) + 1);
  st.stream_state_base.resize(ix(n) + 1);
  std::int64_t ops = 0, streams = 0;
  for (int d = 0; d < n; ++d) {
    st.device_base[ix(d)] = ops;
    st.stream_state_base[ix(d)] = streams;
    if (!simulated(d)) continue;
    const auto& pi = st.plans[ix(st.plan_of[ix(d)])];
    ops += pi.stream_base.back();
    streams += static_cast<std::int64_t>(pi.stream_base.size()) - 1;
  }
  st.device_base[ix(n)] = ops;
  st.stream_state_base[ix(n)] = streams;
  st.total_ops = ops;
  st.done.assign(ix(streams), 0);
  st.issued.assign(ix(streams), 0);
  st.transfer_state.assign(ix(ops), 0);
  st.families.resize(program.families.size());
  for (std::size_t f = 0; f < program.families.size(); ++f) {
    auto& fam = st.families[f];
    fam.groups = program.groups(static_cast<int>(f));
    if (symmetry) {
      // Quotient groups: the representatives of the classes a group touches (equal for every group
      // touching a class, by the symmetry rule), each counted once.
      std::map<std::vector<int>, int> ids;
      std::vector<std::vector<int>> quotient;
      for (const auto& g : fam.groups) {
        std::vector<int> reps;
        for (int d : g) {
          const int r = symmetry->representative_of(d);
          if (std::find(reps.begin(), reps.end(), r) == reps.end()) reps.push_back(r);
        }
        if (ids.try_emplace(reps, static_cast<int>(quotient.size())).second) quotient.push_back(std::move(reps));
      }
      fam.groups = std::move(quotient);
    }
    fam.group_of_device.assign(ix(n), -1);
    for (std::size_t g = 0; g < fam.groups.size(); ++g)
      for (int d : fam.groups[g]) fam.group_of_device[ix(d)] = static_cast<std::int32_t>(g);
    for (const auto& pi : st.plans)
      fam.seq_count = std::max(fam.seq_count, static_cast<std::int32_t>(pi.family_seq[f].size()));
    fam.arrived.assign(fam.groups.size() * ix(fam.seq_count), 0);
  }
  st.dirty.assign(ix(n), 0);
  for (int d = 0; d < n; ++d)
    if (simulated(d)) st.mark_dirty(d);
}

int ReadyTracker::transfer_receiver(const Activity& a) const {
  const State& st = *s_;
  if (!st.sym) return a.members[1].first;
  const auto [src, send] = a.members[0];
  return st.program.peer_of(st.op_at(src, send), src);
}

const std::vector<int>& ReadyTracker::collective_ranks(const Activity& a) {
  State& st = *s_;
  const auto [d0, r0] = a.members.front();
  if (!st.sym) {
    st.ranks.clear();
    for (const auto& m : a.members) st.ranks.push_back(m.first);
    return st.ranks;
  }
  const int family = st.op_at(d0, r0).family;
  auto [it, inserted] = st.real_groups.try_emplace({family, d0});
  if (inserted) it->second = st.program.group_of(family, d0);
  return it->second;
}

ReadyTracker::~ReadyTracker() = default;

void ReadyTracker::take_ready(std::vector<Activity>& out) {
  State& st = *s_;
  // Devices are scanned in the order they became dirty; a scan may make other devices' activities
  // ready (rendezvous) but never dirties a device itself.
  for (std::size_t i = 0; i < st.dirty_list.size(); ++i) {
    const int d = st.dirty_list[i];
    st.dirty[ix(d)] = 0;
    st.scan(d);
  }
  st.dirty_list.clear();
  if (out.empty())
    out.swap(st.ready);
  else
    for (auto& a : st.ready) out.push_back(std::move(a));
  st.ready.clear();
}

std::vector<Activity> ReadyTracker::take_ready() {
  std::vector<Activity> out;
  take_ready(out);
  return out;
}

void ReadyTracker::started(const Activity&, double) {}

void ReadyTracker::finished(const Activity& a, double) {
  State& st = *s_;
  for (const auto& [device, r] : a.members) {
    const std::int64_t k = st.stream_state_base[ix(device)] + r.stream;
    st.done[ix(k)] += 1;
    st.issued[ix(k)] = 0;
    st.finished_ops += 1;
    st.mark_dirty(device);
  }
}

bool ReadyTracker::done() const { return s_->finished_ops == s_->total_ops; }
std::int64_t ReadyTracker::total_ops() const { return s_->total_ops; }
std::int64_t ReadyTracker::finished_ops() const { return s_->finished_ops; }

std::int64_t ReadyTracker::instance(int device, OpRef r) const {
  const State& st = *s_;
  return st.device_base[ix(device)] + st.plans[ix(st.plan_of[ix(device)])].stream_base[ix(r.stream)] + r.index;
}
std::int64_t ReadyTracker::device_base(int device) const { return s_->device_base[ix(device)]; }

std::string ReadyTracker::stuck_report() const {
  State& st = *s_;
  std::string out = fmt::format("deadlock: {} of {} ops finished;", st.finished_ops, st.total_ops);
  int shown = 0;
  for (int d = 0; d < st.program.num_devices && shown < 3; ++d) {
    if (st.sym && !st.sym->is_representative(d)) continue;
    const auto& pi = st.plans[ix(st.plan_of[ix(d)])];
    const core::Plan& plan = st.program.plan_for(d);
    const std::int64_t base = st.stream_state_base[ix(d)];
    bool any = false;
    for (std::size_t s = 0; s + 1 < pi.stream_base.size(); ++s) {
      const std::int32_t head = st.done[ix(base + static_cast<std::int64_t>(s))];
      if (head >= pi.stream_base[s + 1] - pi.stream_base[s]) continue;
      const core::Op& op = plan.streams[s].ops[ix(head)];
      std::string why;
      if (!st.issued[ix(base + static_cast<std::int64_t>(s))]) {
        why = "waits on another stream";
        for (const OpRef& w : op.waits)
          if (st.done[ix(base + w.stream)] <= w.index)
            why = fmt::format("waits on stream '{}' op {} '{}'", plan.streams[ix(w.stream)].name, w.index,
                              plan.streams[ix(w.stream)].ops[ix(w.index)].label);
      } else if (op.kind == OpKind::Send || op.kind == OpKind::Recv) {
        why = fmt::format("{} waits for device {}", op.kind == OpKind::Send ? "SEND" : "RECV", st.peer_of(op, d));
      } else {
        why = fmt::format("collective waits for the other members of family {} ('{}')", op.family,
                          core::to_string(st.program.families[ix(op.family)].purpose));
      }
      out += fmt::format(" device {} stream '{}' op {} '{}' {};", d, plan.streams[s].name, head, op.label, why);
      any = true;
    }
    shown += any ? 1 : 0;
  }
  if (!out.empty() && out.back() == ';') out.pop_back();
  return out;
}

void ReadyTracker::throw_stuck() const { throw DeadlockError(stuck_report()); }

std::vector<std::pair<int, OpRef>> ReadyTracker::partners(const core::Program& program, int device, OpRef r) {
  return PartnerFinder(program)(device, r);
}

struct PartnerFinder::Index {
  // plan -> DAG node -> its SEND and RECV ops, in stream order (streams in order, ops in order).
  std::map<int, std::unordered_map<std::int32_t, std::vector<OpRef>>> transfers;
  // (plan, family) -> the plan's collectives on that family, in the same order.
  std::map<std::pair<int, int>, std::vector<OpRef>> collectives;
};

PartnerFinder::PartnerFinder(const core::Program& program) : program_(program), index_(std::make_unique<Index>()) {}
PartnerFinder::~PartnerFinder() = default;

std::vector<std::pair<int, OpRef>> PartnerFinder::operator()(int device, OpRef r) {
  const core::Program& program = program_;
  const core::Op& op = program.plan_for(device).streams.at(ix(r.stream)).ops.at(ix(r.index));
  std::vector<std::pair<int, OpRef>> out;
  if (op.kind == OpKind::Send || op.kind == OpKind::Recv) {
    const int peer = program.peer_of(op, device);
    out.emplace_back(device, r);
    if (peer < 0) return out;
    const OpKind want = op.kind == OpKind::Send ? OpKind::Recv : OpKind::Send;
    const int peer_plan = program.plan_of_device.at(ix(peer));
    auto [it, fresh] = index_->transfers.try_emplace(peer_plan);
    if (fresh) {
      const core::Plan& plan = program.plans.at(ix(peer_plan));
      for (std::size_t s = 0; s < plan.streams.size(); ++s)
        for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
          const core::Op& o = plan.streams[s].ops[i];
          if (o.kind == OpKind::Send || o.kind == OpKind::Recv)
            it->second[o.node].push_back({static_cast<int>(s), static_cast<int>(i)});
        }
    }
    const core::Plan& plan = program.plans[ix(peer_plan)];
    if (auto candidates = it->second.find(op.node); candidates != it->second.end())
      for (OpRef c : candidates->second) {
        const core::Op& o = plan.streams[ix(c.stream)].ops[ix(c.index)];
        if (o.kind == want && program.peer_of(o, peer) == device) {
          out.emplace_back(peer, c);
          return out;
        }
      }
    return out;
  }
  if (!is_collective(op.kind)) return {{device, r}};
  auto sequence = [&](int plan_index) -> const std::vector<OpRef>& {
    auto [it, fresh] = index_->collectives.try_emplace({plan_index, op.family});
    if (fresh) {
      const core::Plan& plan = program.plans.at(ix(plan_index));
      for (std::size_t s = 0; s < plan.streams.size(); ++s)
        for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
          const core::Op& o = plan.streams[s].ops[i];
          if (is_collective(o.kind) && o.family == op.family)
            it->second.push_back({static_cast<int>(s), static_cast<int>(i)});
        }
    }
    return it->second;
  };
  const auto& mine = sequence(program.plan_of_device.at(ix(device)));
  const std::size_t k = ix(std::find(mine.begin(), mine.end(), r) - mine.begin());
  // The k-th collective of the family depends only on the member's plan (DP groups have 10^4 members).
  for (int member : program.group_of(op.family, device)) {
    if (member == device) {
      out.emplace_back(device, r);
      continue;
    }
    const auto& theirs = sequence(program.plan_of_device[ix(member)]);
    if (k < theirs.size()) out.emplace_back(member, theirs[k]);
  }
  return out;
}

}  // namespace piper::sim
