// Static checks of a Program at the level of plans (classes of devices): transfers, collectives,
// buffer lifetimes and deadlock freedom, without expanding the data-parallel degree.
//
// Semantics of a Program (the contract this file checks):
//  * Device d runs plans[plan_of_device[d]]. Its streams run concurrently; ops of one stream run in
//    order. op.waits lists ops of other streams of the same device that must finish before op starts.
//  * Who meets whom is core/readiness.hpp's rule, keyed by the pairing id (Op::pair): every SEND, RECV
//    and collective has one, COMPUTE and UPD none, and a plan holds at most one SEND, one RECV and one
//    collective per id.
//  * A SEND on device d goes to peer_of(op, d). Its RECV is the op of kind RECV on that peer with the
//    same pairing id, whose own peer_of is d; both carry the same bytes. Every RECV has its SEND as well.
//  * A collective (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL) on device d runs in the group
//    group_of(op.family, d). Every member of a group issues the same sequence of (pairing id, kind,
//    bytes) on that family, read over the device's streams in index order, ops in order (so matching
//    by id and by position agree). A collective completes only when every member has reached it.
//  * A transient buffer is allocated when its `alloc` op starts and freed when its `free` op ends:
//    alloc happens-before-or-equals every use, and every use happens-before-or-equals the free.
//    Happens-before inside a device is stream order plus waits, transitively (vector clocks).
//  * No deadlock: the wait graph over all op instances is acyclic. Edges: stream order and waits; a
//    SEND and its RECV are one rendezvous vertex (both sides complete together, as NCCL send/recv
//    do), and so are all members of one collective group instance.
//
// Scale: devices of one plan have identical ops, so every check works per plan; device-level facts
// (peers, groups) are resolved by iterating class members once per distinct (plan, device set, peer
// set) or per family, never per op and device. The deadlock graph is the quotient over plans: one
// vertex per (plan, op), plus one rendezvous vertex per matched (SEND op, RECV op) pair of plans and
// per collective position of each (family, set of plans in the group). A real cycle among device
// instances maps onto a cycle of the quotient, so no deadlock is missed; in pathological asymmetric
// programs (devices of one plan talking to different peer plans in ways that only close a loop in
// the quotient) the check may report a cycle that no single set of devices can realise.
#include "piper/core/verifier.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <unordered_set>

#include "piper/core/error.hpp"
#include "piper/core/readiness.hpp"
#include "verifier_impl.hpp"

namespace piper::core {

namespace verifier_detail {

std::vector<VerifyIssue> Verifier::run() {
  check_structure();
  check_pairing_ids();
  if (!issues_.empty()) return issues_;  // the other checks index freely into the tables
  index_ops();
  check_collective_ids();
  check_send_recv();
  check_collectives();
  check_tensor_parallel();
  check_context_parallel();
  check_expert_groups();
  for (std::size_t p = 0; p < prog_.plans.size(); ++p) check_buffers(static_cast<int>(p));
  check_deadlock();
  return issues_;
}

void Verifier::check_structure() {
  const auto num_sets = prog_.device_sets.size();
  if (prog_.plan_of_device.size() != ix(prog_.num_devices))
    add("structure", "plan_of_device has " + std::to_string(prog_.plan_of_device.size()) + " entries for " +
                         std::to_string(prog_.num_devices) + " devices");
  for (std::size_t d = 0; d < prog_.plan_of_device.size(); ++d) {
    int p = prog_.plan_of_device[d];
    if (p < 0 || ix(p) >= prog_.plans.size())
      add("structure", "device " + std::to_string(d) + " runs plan " + std::to_string(p) + " which does not exist");
  }
  for (std::size_t s = 0; s < num_sets; ++s)
    for (int d : prog_.device_sets[s])
      if (d < 0 || d >= prog_.num_devices)
        add("structure", "device set " + std::to_string(s) + " holds device " + std::to_string(d) + " out of range");
  for (std::size_t f = 0; f < prog_.families.size(); ++f) {
    try {
      (void)prog_.groups(static_cast<int>(f));
    } catch (const PlanError& e) {
      add("structure", e.what());
    }
  }
  auto in_range = [](int v, std::size_t n) { return v >= 0 && ix(v) < n; };
  for (std::size_t p = 0; p < prog_.plans.size(); ++p) {
    const Plan& plan = prog_.plans[p];
    auto valid_ref = [&](OpRef r) {
      return in_range(r.stream, plan.streams.size()) && in_range(r.index, plan.streams[ix(r.stream)].ops.size());
    };
    for (std::size_t s = 0; s < plan.streams.size(); ++s) {
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        const Op& op = plan.streams[s].ops[i];
        // Formatted only for a message: building it for every op cost more than the checks.
        auto at = [&] {
          return "plan " + std::to_string(p) + " stream '" + plan.streams[s].name + "' op " + std::to_string(i) + " '" +
                 op.label + "': ";
        };
        if (op.device_set != kNoDevices && !in_range(op.device_set, num_sets))
          add("structure", at() + "device set " + std::to_string(op.device_set) + " does not exist");
        if (op.peer_set != kNoDevices && !in_range(op.peer_set, num_sets))
          add("structure", at() + "peer set " + std::to_string(op.peer_set) + " does not exist");
        if ((op.kind == OpKind::Send || op.kind == OpKind::Recv) && (op.device_set < 0 || op.peer_set < 0))
          add("structure", at() + to_string(op.kind) + " needs a device set and a peer set");
        if (op.family != -1 && !in_range(op.family, prog_.families.size()))
          add("structure", at() + "family " + std::to_string(op.family) + " does not exist");
        if (is_collective_op(op.kind) && op.family < 0) add("structure", at() + to_string(op.kind) + " has no family");
        for (const OpRef& w : op.waits)
          if (!valid_ref(w))
            add("structure", at() + "waits on stream " + std::to_string(w.stream) + " op " + std::to_string(w.index) +
                                 " which does not exist");
        for (int u : op.uses)
          if (!in_range(u, plan.buffers.size()))
            add("structure", at() + "uses buffer " + std::to_string(u) + " which does not exist");
      }
    }
    for (const Buffer& b : plan.buffers) {
      for (const OpRef& r : {b.alloc, b.free})
        if (r.stream != -1 && !valid_ref(r))
          add("structure", "plan " + std::to_string(p) + " buffer '" + b.name + "': alloc/free refers to stream " +
                               std::to_string(r.stream) + " op " + std::to_string(r.index) + " which does not exist");
    }
  }
}

void Verifier::index_ops() {
  members_.assign(prog_.plans.size(), {});
  member_index_.assign(ix(prog_.num_devices), -1);
  for (int d = 0; d < prog_.num_devices; ++d) {
    auto& m = members_[ix(prog_.plan_of_device[ix(d)])];
    member_index_[ix(d)] = static_cast<int>(m.size());
    m.push_back(d);
  }
  stream_base_.resize(prog_.plans.size());
  by_pair_.resize(prog_.plans.size());
  position_.resize(prog_.device_sets.size());
  for (std::size_t p = 0; p < prog_.plans.size(); ++p) {
    const Plan& plan = prog_.plans[p];
    for (std::size_t s = 0; s < plan.streams.size(); ++s) {
      stream_base_[p].push_back(static_cast<int>(loc_.size()));
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        loc_.push_back({static_cast<int>(p), static_cast<int>(s), static_cast<int>(i)});
        const Op& op = plan.streams[s].ops[i];
        if (op.kind == OpKind::Send || op.kind == OpKind::Recv)
          by_pair_[p][pair_key(op.pair, op.kind)].push_back({static_cast<int>(s), static_cast<int>(i)});
      }
    }
  }
}

const std::vector<int>& Verifier::positions(DeviceSetId set) {
  auto& table = position_[ix(set)];
  if (table.empty()) {
    table.assign(ix(prog_.num_devices), -1);
    const auto& devices = prog_.device_sets[ix(set)];
    for (std::size_t i = 0; i < devices.size(); ++i) table[ix(devices[i])] = static_cast<int>(i);
  }
  return table;
}

// Every SEND, RECV and collective has an id and COMPUTE/UPD none; a plan holds at most one op per
// (side, id).
void Verifier::check_pairing_ids() {
  for (std::size_t p = 0; p < prog_.plans.size(); ++p) {
    const Plan& plan = prog_.plans[p];
    std::unordered_set<std::int64_t> seen;  // (id, side) of this plan's ops
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        const Op& op = plan.streams[s].ops[i];
        const MeetSide side = meet_side(op.kind);
        auto at = [&] {
          return "plan " + std::to_string(p) + " stream '" + plan.streams[s].name + "' op " + std::to_string(i) + " '" +
                 op.label + "': " + to_string(op.kind) + " ";
        };
        const std::string id = std::to_string(op.pair);
        if (side == MeetSide::None) {
          if (op.pair != -1)
            add("structure", at() + "has pairing id " + id + " (only SEND, RECV and collectives meet)");
          continue;
        }
        if (op.pair < 0) {
          add("structure", at() + "has no pairing id");
          continue;
        }
        if (!seen.emplace(static_cast<std::int64_t>(op.pair) * 4 + static_cast<int>(side)).second)
          add("structure", at() + "is a second op with pairing id " + id + " on this plan");
      }
  }
}

// A collective's pairing id names one family and one kind over the whole Program (one occurrence
// cannot span two families' groups).
void Verifier::check_collective_ids() {
  std::unordered_map<int, std::tuple<int, OpKind, int, OpRef>> first;  // id -> (family, kind, plan, op)
  for (std::size_t p = 0; p < prog_.plans.size(); ++p) {
    if (members_[p].empty()) continue;
    const Plan& plan = prog_.plans[p];
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        const Op& op = plan.streams[s].ops[i];
        if (meet_side(op.kind) != MeetSide::Collective) continue;
        const OpRef r{static_cast<int>(s), static_cast<int>(i)};
        auto [it, fresh] = first.try_emplace(op.pair, op.family, op.kind, static_cast<int>(p), r);
        const auto& [family, kind, q, other] = it->second;
        if (fresh || (family == op.family && kind == op.kind)) continue;
        add("collective-order", device_op(members_[p].front(), static_cast<int>(p), r) + " " + to_string(op.kind) +
                                    " on family " + std::to_string(op.family) + " has pairing id " +
                                    std::to_string(op.pair) + ", as " + device_op(members_[ix(q)].front(), q, other) +
                                    " " + to_string(kind) + " on family " + std::to_string(family));
      }
  }
}

int Verifier::peer_map(int plan, DeviceSetId set, DeviceSetId peer_set) {
  auto key = std::make_tuple(plan, set, peer_set);
  if (auto it = peer_map_ids_.find(key); it != peer_map_ids_.end()) return it->second;
  PeerMap m;
  const auto& pos = positions(set);
  const auto& peers = prog_.device_sets[ix(peer_set)];
  std::vector<char> seen(prog_.plans.size(), 0);
  for (int d : members_[ix(plan)]) {
    int k = pos[ix(d)];
    int peer = -1;
    if (k < 0) {
      if (m.error.empty())
        m.error = "device " + std::to_string(d) + " is not in the op's device set " + std::to_string(set);
    } else if (ix(k) >= peers.size()) {
      if (m.error.empty())
        m.error = "device " + std::to_string(d) + " has position " + std::to_string(k) + " but peer set " +
                  std::to_string(peer_set) + " has only " + std::to_string(peers.size()) + " devices";
    } else {
      peer = peers[ix(k)];
      int q = prog_.plan_of_device[ix(peer)];
      if (!seen[ix(q)]) {
        seen[ix(q)] = 1;
        m.peer_plans.push_back(q);
      }
    }
    m.peer.push_back(peer);
  }
  int id = static_cast<int>(peer_maps_.size());
  peer_maps_.push_back(std::move(m));
  peer_map_ids_.emplace(key, id);
  return id;
}

// For members of plan p whose peer (through map `there`) runs plan q: does the peer's own map `back`
// point at them? Returns the first member index that fails, or -1.
int Verifier::compose(int p, int there, int q, int back) {
  auto key = std::make_tuple(there, q, back);
  if (auto it = compose_cache_.find(key); it != compose_cache_.end()) return it->second;
  int failing = -1;
  const auto& out = peer_maps_[ix(there)].peer;
  const auto& in = peer_maps_[ix(back)].peer;
  const auto& m = members_[ix(p)];
  for (std::size_t i = 0; i < m.size() && failing < 0; ++i) {
    int e = out[i];
    if (e < 0 || prog_.plan_of_device[ix(e)] != q) continue;
    if (in[ix(member_index_[ix(e)])] != m[i]) failing = static_cast<int>(i);
  }
  compose_cache_.emplace(key, failing);
  return failing;
}

// Finds, for one SEND (or RECV) of plan p, its counterpart on every peer plan.
void Verifier::match(int p, OpRef r) {
  const Op& op = op_at(p, r);
  const bool sending = op.kind == OpKind::Send;
  const OpKind want = sending ? OpKind::Recv : OpKind::Send;
  const char* verb = sending ? "to" : "from";
  if (members_[ix(p)].empty()) return;
  int there = peer_map(p, op.device_set, op.peer_set);
  if (!peer_maps_[ix(there)].error.empty()) {
    add("send-recv", where(p) + " " + op_name(p, r) + ": " + peer_maps_[ix(there)].error);
    return;
  }
  const auto& m = members_[ix(p)];
  for (int q : std::vector<int>(peer_maps_[ix(there)].peer_plans)) {
    // A representative pair (d on p, e on q) for messages.
    std::size_t rep = 0;
    while (prog_.plan_of_device[ix(peer_maps_[ix(there)].peer[rep])] != q) ++rep;
    int d = m[rep];
    int e = peer_maps_[ix(there)].peer[rep];
    std::string head = device_op(d, p, r) + " " + to_string(op.kind) + " pair " + std::to_string(op.pair) + " " + verb +
                       " device " + std::to_string(e);
    auto found = by_pair_[ix(q)].find(pair_key(op.pair, want));
    if (found == by_pair_[ix(q)].end()) {
      add("send-recv", head + ": no " + to_string(want) + " with pair " + std::to_string(op.pair) + " on device " +
                           std::to_string(e) + " (plan " + std::to_string(q) + ")");
      continue;
    }
    bool matched = false;
    std::string mismatch;
    for (const OpRef& c : found->second) {
      const Op& other = op_at(q, c);
      int back = peer_map(q, other.device_set, other.peer_set);
      if (!peer_maps_[ix(back)].error.empty()) continue;  // reported from its own side
      int failing = compose(p, there, q, back);
      if (failing >= 0) {
        int bad_d = m[ix(failing)];
        int bad_e = peer_maps_[ix(there)].peer[ix(failing)];
        int other_peer = peer_maps_[ix(back)].peer[ix(member_index_[ix(bad_e)])];
        mismatch = device_op(bad_d, p, r) + " " + to_string(op.kind) + " pair " + std::to_string(op.pair) + " " + verb +
                   " device " + std::to_string(bad_e) + ": its " + to_string(want) + " " +
                   (sending ? "receives from" : "sends to") + " device " + std::to_string(other_peer) + " instead";
        continue;
      }
      matched = true;
      if (sending) {
        transfer_edges_.emplace_back(vertex(p, r), vertex(q, c));
        if (other.bytes != op.bytes)
          add("send-recv", head + ": sends " + std::to_string(op.bytes) + " bytes but its RECV (" + device_op(e, q, c) +
                               ") expects " + std::to_string(other.bytes) + " bytes");
      }
      break;
    }
    if (!matched) {
      if (!mismatch.empty())
        add("send-recv", mismatch);
      else
        add("send-recv", head + ": no usable " + to_string(want) + " with pair " + std::to_string(op.pair) +
                             " on device " + std::to_string(e));
    }
  }
}

void Verifier::check_send_recv() {
  for (std::size_t p = 0; p < prog_.plans.size(); ++p) {
    const Plan& plan = prog_.plans[p];
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        OpKind k = plan.streams[s].ops[i].kind;
        if (k == OpKind::Send || k == OpKind::Recv)
          match(static_cast<int>(p), {static_cast<int>(s), static_cast<int>(i)});
      }
  }
}

}  // namespace verifier_detail

using verifier_detail::Verifier;

std::vector<VerifyIssue> verify(const Program& program) { return Verifier(program).run(); }

void verify_or_throw(const Program& program) {
  auto issues = verify(program);
  if (issues.empty()) return;
  std::string message = "verify: " + issues.front().check + ": " + issues.front().message;
  if (issues.size() > 1) message += " (+" + std::to_string(issues.size() - 1) + " more)";
  throw PlanError(message);
}

}  // namespace piper::core
