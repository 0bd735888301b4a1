// ReadyTracker: per-stream cursors, waits, transfer rendezvous and collective instances over flat
// per-plan tables, so that 10^4-device programs cost a few array lookups per op. The rules (stream
// order, waits, who meets whom by pairing id) are core/readiness.hpp's; the tables here only cache
// them: a collective occurrence is keyed by its pairing id's slot in its family (PairIndex::family_slot),
// a transfer's other side is PairIndex::find on the peer's plan.
#include "piper/sim/ready_tracker.hpp"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "piper/core/readiness.hpp"

namespace piper::sim {

using core::OpKind;
using core::OpRef;
using Activity = ReadyTracker::Activity;

namespace {

constexpr std::size_t ix(std::int64_t i) { return static_cast<std::size_t>(i); }

using core::is_collective;

}  // namespace

struct ReadyTracker::State {
  struct OpInfo {
    OpKind kind;
    std::int32_t pair;                    // Op::pair
    std::int32_t waits_begin, waits_end;  // into Plan::waits
    std::int32_t seq;                     // collectives: the pairing id's slot in its family
  };
  struct PlanIndex {
    std::vector<std::int32_t> stream_base;  // stream -> first flat op; back() = op count
    std::vector<OpInfo> ops;
    std::vector<OpRef> waits;
    std::vector<std::vector<OpRef>> family_seq;  // family -> slot -> this plan's op ({-1,-1}: none)
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
    std::int32_t seq_count = 0;                 // occurrences of the family (PairIndex::family_slots)
    std::vector<std::int32_t> arrived;          // group * seq_count + seq
  };

  const core::Program& program;
  const core::PairIndex pairs;    // who meets whom (core/readiness.hpp)
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

  explicit State(const core::Program& p) : program(p), pairs(p) {}

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
  // The SEND (want_send) or RECV with pairing id `pair` on `device` (flat index), or -1.
  std::int32_t counterpart(int device, std::int32_t pair, bool want_send) {
    const int p = plan_of[ix(device)];
    const OpRef r = pairs.find(p, want_send ? core::MeetSide::Send : core::MeetSide::Recv, pair);
    return r.stream < 0 ? -1 : plans[ix(p)].flat(r);
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
      const std::int32_t other = counterpart(peer, info.pair, !sending);
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
      if (g < 0 || info.seq < 0 || info.seq >= fam.seq_count) return;
      const std::size_t slot = ix(static_cast<std::int64_t>(g) * fam.seq_count + info.seq);
      const auto& group = fam.groups[ix(g)];
      if (++fam.arrived[slot] == static_cast<std::int32_t>(group.size())) {
        Activity a{Activity::Kind::Collective, {}};
        a.members.reserve(group.size());
        for (int member : group) {
          const auto& seq = plans[ix(plan_of[ix(member)])].family_seq[ix(op.family)];
          a.members.emplace_back(member, seq.at(ix(info.seq)));  // arrived: so it holds the id
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
        State::OpInfo info{op.kind, op.pair, static_cast<std::int32_t>(pi.waits.size()), 0, -1};
        for (const OpRef& w : op.waits) pi.waits.push_back(w);
        info.waits_end = static_cast<std::int32_t>(pi.waits.size());
        const OpRef r{static_cast<int>(s), static_cast<int>(i)};
        if (is_collective(op.kind) && op.family >= 0 && ix(op.family) < pi.family_seq.size()) {
          info.seq = st.pairs.family_slot(op.pair);
          auto& seq = pi.family_seq[ix(op.family)];
          if (seq.empty()) seq.assign(ix(st.pairs.family_slots(op.family)), OpRef{});
          // An id registered under another family (an unverified program) never meets: it stays stuck.
          if (info.seq >= 0 && ix(info.seq) < seq.size())
            seq[ix(info.seq)] = r;
          else
            info.seq = -1;
        }
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
    fam.seq_count = st.pairs.family_slots(static_cast<int>(f));
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

// The pairing-id index of core/readiness.hpp, reordered as partners() documents it.
struct PartnerFinder::Index {
  explicit Index(const core::Program& p) : pairs(p) {}
  core::PairIndex pairs;
};

PartnerFinder::PartnerFinder(const core::Program& program)
    : program_(program), index_(std::make_unique<Index>(program)) {}
PartnerFinder::~PartnerFinder() = default;

std::vector<std::pair<int, OpRef>> PartnerFinder::operator()(int device, OpRef r) {
  std::vector<std::pair<int, OpRef>> out = index_->pairs.meeting(device, r);
  // A transfer lists the op itself first (the critical path breaks ties by member order).
  if (out.size() == 2 && out[1] == std::pair<int, OpRef>{device, r} &&
      program_.plan_for(device).streams.at(ix(r.stream)).ops.at(ix(r.index)).kind == OpKind::Recv)
    std::swap(out[0], out[1]);
  return out;
}

}  // namespace piper::sim
