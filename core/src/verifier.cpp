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
#include <boost/graph/adjacency_list.hpp>
#include <boost/graph/depth_first_search.hpp>
#include <boost/graph/topological_sort.hpp>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "piper/core/error.hpp"
#include "piper/core/readiness.hpp"

namespace piper::core {

namespace {

bool is_collective_op(OpKind k) {
  return k == OpKind::AllReduce || k == OpKind::ReduceScatter || k == OpKind::AllGather || k == OpKind::AllToAll;
}

// Container index from the Program's int indices (validated by check_structure first).
constexpr std::size_t ix(int i) { return static_cast<std::size_t>(i); }

using DiGraph = boost::adjacency_list<boost::vecS, boost::vecS, boost::directedS>;

// A back edge found by depth-first search closes a cycle; tree edges give the path back along it.
struct CycleFound {
  std::size_t from, to;
};
struct CycleVisitor : boost::default_dfs_visitor {
  std::vector<std::size_t>* parent;
  template <class Edge, class G>
  void tree_edge(Edge e, const G& g) const {
    (*parent)[boost::target(e, g)] = boost::source(e, g);
  }
  template <class Edge, class G>
  void back_edge(Edge e, const G& g) const {
    throw CycleFound{boost::source(e, g), boost::target(e, g)};
  }
};

class Verifier {
 public:
  explicit Verifier(const Program& p) : prog_(p) {}

  std::vector<VerifyIssue> run() {
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

 private:
  struct Loc {
    int plan, stream, index;
  };
  // For devices of `plan`, the peer of each member (by member index) through (device set, peer set).
  struct PeerMap {
    std::vector<int> peer;        // per member of the plan; -1 when unresolvable
    std::vector<int> peer_plans;  // distinct plans of the peers
    std::string error;            // non-empty: some member has no peer
  };

  const Program& prog_;
  std::vector<VerifyIssue> issues_;
  std::vector<std::vector<int>> members_;      // plan -> devices running it
  std::vector<int> member_index_;              // device -> its index in members_[plan]
  std::vector<std::vector<int>> stream_base_;  // plan, stream -> global vertex of op 0
  std::vector<Loc> loc_;                       // global vertex -> op
  std::vector<std::vector<int>> position_;     // device set -> (device -> position), built lazily
  std::map<std::tuple<int, int, int>, int> peer_map_ids_;
  std::vector<PeerMap> peer_maps_;
  std::map<std::tuple<int, int, int>, int> compose_cache_;  // (map, plan, map') -> failing member or -1
  std::vector<std::unordered_map<std::int64_t, std::vector<OpRef>>> by_pair_;  // plan -> (pair, kind) -> ops
  std::vector<std::pair<std::size_t, std::size_t>> transfer_edges_;            // SEND -> RECV vertices
  std::vector<std::vector<std::size_t>> collective_instances_;                 // member op vertices of each

  void add(const char* check, std::string message) { issues_.push_back({check, std::move(message)}); }

  // The devices of one group of each family must issue the same compute ops (as `sequence(plan,
  // family)` lists them); each pair of plans is compared once.
  template <class Sequence>
  void check_groups_issue_alike(const std::set<int>& families, const Sequence& sequence, const char* check,
                                const std::string& what) {
    for (int family : families) {
      std::map<std::pair<int, int>, bool> compared;
      for (const auto& group : prog_.groups(family)) {
        const int first = prog_.plan_of_device[ix(group.front())];
        for (int d : group) {
          const int plan = prog_.plan_of_device[ix(d)];
          if (plan == first || compared.contains({first, plan})) continue;
          compared[{first, plan}] = true;
          if (sequence(first, family) != sequence(plan, family))
            add(check, "device " + std::to_string(d) + " (plan " + std::to_string(plan) + ") and device " +
                           std::to_string(group.front()) + " (plan " + std::to_string(first) + ") are in one " + what +
                           " group (family " + std::to_string(family) + ") but issue different " + what +
                           " compute ops");
        }
      }
    }
  }

  const Op& op_at(int plan, OpRef r) const { return prog_.plans[ix(plan)].streams[ix(r.stream)].ops[ix(r.index)]; }
  std::size_t vertex(int plan, OpRef r) const { return ix(stream_base_[ix(plan)][ix(r.stream)] + r.index); }

  std::string where(int plan) const {
    const auto& m = members_[ix(plan)];
    if (m.empty()) return "plan " + std::to_string(plan) + " (no devices)";
    return "device " + std::to_string(m.front()) + " (plan " + std::to_string(plan) + ")";
  }
  std::string op_name(int plan, OpRef r) const {
    const Op& op = op_at(plan, r);
    return "stream '" + prog_.plans[ix(plan)].streams[ix(r.stream)].name + "' op " + std::to_string(r.index) + " '" +
           op.label + "'";
  }
  std::string device_op(int device, int plan, OpRef r) const {
    return "device " + std::to_string(device) + " (plan " + std::to_string(plan) + ") " + op_name(plan, r);
  }

  // ---- structure: every index in range, so later checks can index freely ----

  void check_structure() {
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
            return "plan " + std::to_string(p) + " stream '" + plan.streams[s].name + "' op " + std::to_string(i) +
                   " '" + op.label + "': ";
          };
          if (op.device_set != kNoDevices && !in_range(op.device_set, num_sets))
            add("structure", at() + "device set " + std::to_string(op.device_set) + " does not exist");
          if (op.peer_set != kNoDevices && !in_range(op.peer_set, num_sets))
            add("structure", at() + "peer set " + std::to_string(op.peer_set) + " does not exist");
          if ((op.kind == OpKind::Send || op.kind == OpKind::Recv) && (op.device_set < 0 || op.peer_set < 0))
            add("structure", at() + to_string(op.kind) + " needs a device set and a peer set");
          if (op.family != -1 && !in_range(op.family, prog_.families.size()))
            add("structure", at() + "family " + std::to_string(op.family) + " does not exist");
          if (is_collective_op(op.kind) && op.family < 0)
            add("structure", at() + to_string(op.kind) + " has no family");
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

  void index_ops() {
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

  static std::int64_t pair_key(std::int32_t pair, OpKind kind) {
    return static_cast<std::int64_t>(pair) * 2 + (kind == OpKind::Recv ? 1 : 0);
  }

  const std::vector<int>& positions(DeviceSetId set) {
    auto& table = position_[ix(set)];
    if (table.empty()) {
      table.assign(ix(prog_.num_devices), -1);
      const auto& devices = prog_.device_sets[ix(set)];
      for (std::size_t i = 0; i < devices.size(); ++i) table[ix(devices[i])] = static_cast<int>(i);
    }
    return table;
  }

  // ---- pairing ids (core/readiness.hpp): who meets whom ----

  // Every SEND, RECV and collective has an id and COMPUTE/UPD none; a plan holds at most one op per
  // (side, id).
  void check_pairing_ids() {
    for (std::size_t p = 0; p < prog_.plans.size(); ++p) {
      const Plan& plan = prog_.plans[p];
      std::unordered_set<std::int64_t> seen;  // (id, side) of this plan's ops
      for (std::size_t s = 0; s < plan.streams.size(); ++s)
        for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
          const Op& op = plan.streams[s].ops[i];
          const MeetSide side = meet_side(op.kind);
          auto at = [&] {
            return "plan " + std::to_string(p) + " stream '" + plan.streams[s].name + "' op " + std::to_string(i) +
                   " '" + op.label + "': " + to_string(op.kind) + " ";
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
  void check_collective_ids() {
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

  // ---- send / recv ----

  int peer_map(int plan, DeviceSetId set, DeviceSetId peer_set) {
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
  int compose(int p, int there, int q, int back) {
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
  void match(int p, OpRef r) {
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
      std::string head = device_op(d, p, r) + " " + to_string(op.kind) + " pair " + std::to_string(op.pair) + " " +
                         verb + " device " + std::to_string(e);
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
          mismatch = device_op(bad_d, p, r) + " " + to_string(op.kind) + " pair " + std::to_string(op.pair) + " " +
                     verb + " device " + std::to_string(bad_e) + ": its " + to_string(want) + " " +
                     (sending ? "receives from" : "sends to") + " device " + std::to_string(other_peer) + " instead";
          continue;
        }
        matched = true;
        if (sending) {
          transfer_edges_.emplace_back(vertex(p, r), vertex(q, c));
          if (other.bytes != op.bytes)
            add("send-recv", head + ": sends " + std::to_string(op.bytes) + " bytes but its RECV (" +
                                 device_op(e, q, c) + ") expects " + std::to_string(other.bytes) + " bytes");
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

  void check_send_recv() {
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

  // ---- collectives ----

  std::string describe_collective(int plan, OpRef r) const {
    const Op& op = op_at(plan, r);
    return to_string(op.kind) + " pair " + std::to_string(op.pair) + " (" + std::to_string(op.bytes) + " bytes) '" +
           op.label + "'";
  }

  void check_collectives() {
    const std::size_t num_families = prog_.families.size();
    // Sequence of collectives per plan and family, in stream index order then op order.
    std::vector<std::vector<std::vector<OpRef>>> seq(prog_.plans.size(), std::vector<std::vector<OpRef>>(num_families));
    for (std::size_t p = 0; p < prog_.plans.size(); ++p) {
      const Plan& plan = prog_.plans[p];
      for (std::size_t s = 0; s < plan.streams.size(); ++s)
        for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
          const Op& op = plan.streams[s].ops[i];
          if (is_collective_op(op.kind)) seq[p][ix(op.family)].push_back({static_cast<int>(s), static_cast<int>(i)});
        }
    }
    // Devices issuing a family's collectives must belong to its set.
    for (std::size_t p = 0; p < prog_.plans.size(); ++p)
      for (std::size_t f = 0; f < num_families; ++f) {
        if (seq[p][f].empty()) continue;
        const auto& pos = positions(prog_.families[f].devices);
        for (int d : members_[p])
          if (pos[ix(d)] < 0) {
            add("collective-order", "device " + std::to_string(d) + " (plan " + std::to_string(p) + ") " +
                                        op_name(static_cast<int>(p), seq[p][f].front()) +
                                        " issues a collective on family " + std::to_string(f) + " ('" +
                                        to_string(prog_.families[f].purpose) + "') but is not in its device set");
            break;
          }
      }

    std::set<std::tuple<std::size_t, int, int>> reported;
    std::set<std::pair<std::size_t, std::vector<int>>> classes;
    for (std::size_t f = 0; f < num_families; ++f) {
      for (const auto& group : prog_.groups(static_cast<int>(f))) {
        std::vector<int> plans;  // distinct plans of the group, with one device of each
        std::vector<int> device;
        for (int d : group) {
          int p = prog_.plan_of_device[ix(d)];
          if (std::find(plans.begin(), plans.end(), p) == plans.end()) {
            plans.push_back(p);
            device.push_back(d);
          }
        }
        bool consistent = true;
        for (std::size_t k = 1; k < plans.size(); ++k) {
          int a = plans[0], b = plans[k];
          std::string diff = sequence_difference(f, a, device[0], seq[ix(a)][f], b, device[k], seq[ix(b)][f]);
          if (diff.empty()) continue;
          consistent = false;
          if (reported.insert({f, std::min(a, b), std::max(a, b)}).second) add("collective-order", diff);
        }
        if (!consistent) continue;
        std::sort(plans.begin(), plans.end());
        if (!classes.insert({f, plans}).second) continue;
        // One rendezvous per position of the sequence, joining the members' ops.
        for (std::size_t k = 0; k < seq[ix(plans[0])][f].size(); ++k) {
          std::vector<std::size_t> members;
          for (int q : plans) members.push_back(vertex(q, seq[ix(q)][f][k]));
          collective_instances_.push_back(std::move(members));
        }
      }
    }
  }

  // Empty when the two sequences agree on (pairing id, kind, bytes) at every position.
  std::string sequence_difference(std::size_t f, int a, int da, const std::vector<OpRef>& sa, int b, int db,
                                  const std::vector<OpRef>& sb) const {
    std::string head = "family " + std::to_string(f) + " ('" + to_string(prog_.families[f].purpose) + "'): device " +
                       std::to_string(da) + " (plan " + std::to_string(a) + ") and device " + std::to_string(db) +
                       " (plan " + std::to_string(b) + ") of one group ";
    std::size_t n = std::min(sa.size(), sb.size());
    for (std::size_t k = 0; k < n; ++k) {
      const Op& x = op_at(a, sa[k]);
      const Op& y = op_at(b, sb[k]);
      if (x.pair != y.pair || x.kind != y.kind || x.bytes != y.bytes)
        return head + "differ at collective " + std::to_string(k) + ": " + describe_collective(a, sa[k]) + " vs " +
               describe_collective(b, sb[k]);
    }
    if (sa.size() != sb.size()) {
      // Name the first collective the shorter side never matches, so the message points at an op.
      const bool a_longer = sa.size() > sb.size();
      const int plan = a_longer ? a : b, device = a_longer ? da : db;
      const OpRef extra = a_longer ? sa[n] : sb[n];
      return head + "issue " + std::to_string(sa.size()) + " and " + std::to_string(sb.size()) +
             " collectives; the first unmatched one is " + device_op(device, plan, extra) + " (" +
             describe_collective(plan, extra) + ")";
    }
    return {};
  }

  // ---- buffers: vector clocks over stream order and waits within one plan ----

  // ---- expert groups: the all-to-alls of a segment sharded S ways run over groups of S devices, and
  // with expert TP each such group takes one device of each ETP group it meets (the devices of an
  // EP group hold different experts' same slice; two members of one ETP group hold the same experts) ----

  void check_expert_groups() {
    std::set<std::pair<int, int>> seen;  // (segment, family)
    for (std::size_t p = 0; p < prog_.plans.size(); ++p) {
      if (members_[p].empty()) continue;
      for (std::size_t st = 0; st < prog_.plans[p].streams.size(); ++st)
        for (std::size_t i = 0; i < prog_.plans[p].streams[st].ops.size(); ++i) {
          const Op& op = prog_.plans[p].streams[st].ops[i];
          if (op.kind != OpKind::AllToAll || op.segment < 0 || ix(op.segment) >= prog_.segments.size() || op.family < 0)
            continue;
          if (!seen.insert({op.segment, op.family}).second) continue;
          const ProgramSegment& sg = prog_.segments[ix(op.segment)];
          const OpRef r{static_cast<int>(st), static_cast<int>(i)};
          const int d = members_[p].front();
          const std::string at = device_op(d, static_cast<int>(p), r);
          for (int member : prog_.device_sets[ix(prog_.families[ix(op.family)].devices)]) {
            const std::vector<int> ep = prog_.group_of(op.family, member);
            if (static_cast<int>(ep.size()) != sg.shard_degree) {
              add("ep-group", at + " exchanges over " + std::to_string(ep.size()) + " devices on device " +
                                  std::to_string(member) + " but segment " + std::to_string(op.segment) +
                                  " is sharded " + std::to_string(sg.shard_degree) + " ways");
              break;
            }
            if (sg.tp_degree <= 1 || sg.tp_family < 0) continue;
            const std::vector<int> etp = prog_.group_of(sg.tp_family, member);
            const auto shared = std::count_if(etp.begin(), etp.end(),
                                              [&](int x) { return std::find(ep.begin(), ep.end(), x) != ep.end(); });
            if (shared != 1) {
              add("ep-group", at + ": the EP group of device " + std::to_string(member) + " holds " +
                                  std::to_string(shared) + " devices of its expert-TP group (segment " +
                                  std::to_string(op.segment) + "); an EP group takes one device of each ETP group");
              break;
            }
          }
        }
    }
  }

  // ---- tensor parallelism: each TP segment's family is its set cut into consecutive groups of its
  // degree, and the members of every TP group issue the same TP compute ops in the same order
  // (their collectives happen inside those ops, so a mismatch would hang or mix tensors) ----

  void check_tensor_parallel() {
    std::set<int> tp_families;
    for (std::size_t s = 0; s < prog_.segments.size(); ++s) {
      const ProgramSegment& sg = prog_.segments[s];
      const std::string at = "segment " + std::to_string(s);
      if (sg.tp_degree <= 1) {
        if (sg.tp_family != -1)
          add("tp-group", at + " has tp_family " + std::to_string(sg.tp_family) + " but tp_degree 1");
        continue;
      }
      if (sg.tp_family < 0 || ix(sg.tp_family) >= prog_.families.size()) {
        add("tp-group", at + " has tp_degree " + std::to_string(sg.tp_degree) + " but no TP family");
        continue;
      }
      const CommFamily& f = prog_.families[ix(sg.tp_family)];
      if (f.purpose != FamilyPurpose::Tp || f.stride != 1 || f.group_size != sg.tp_degree || f.devices != sg.devices ||
          prog_.device_sets[ix(f.devices)].size() % ix(sg.tp_degree) != 0) {
        add("tp-group", at + " (tp_degree " + std::to_string(sg.tp_degree) + "): family " +
                            std::to_string(sg.tp_family) + " is not its device set in consecutive groups of " +
                            std::to_string(sg.tp_degree));
        continue;
      }
      tp_families.insert(sg.tp_family);
    }
    // A plan's TP sequence for one family: its compute ops of segments in that family, in issue order.
    // Keyed by DAG node, not pairing id: the TP collectives run inside COMPUTE ops, which meet no
    // other op (core/readiness.hpp) and carry no id; the node says the members run the same work.
    auto sequence = [&](int plan, int family) {
      std::vector<std::tuple<int, int, std::int64_t, int>> seq;
      for (const auto& stream : prog_.plans[ix(plan)].streams)
        for (const auto& op : stream.ops) {
          if (op.kind != OpKind::Compute || op.segment < 0 || ix(op.segment) >= prog_.segments.size()) continue;
          if (prog_.segments[ix(op.segment)].tp_family != family) continue;
          seq.emplace_back(op.node, static_cast<int>(op.pass), op.tp_bytes, op.tp_collectives);
        }
      return seq;
    };
    for (const auto& p : prog_.plans)
      for (const auto& stream : p.streams)
        for (const auto& op : stream.ops)
          if (op.tp_collectives > 0 && (op.segment < 0 || ix(op.segment) >= prog_.segments.size() ||
                                        prog_.segments[ix(op.segment)].tp_degree <= 1)) {
            add("tp-group", "op '" + op.label + "' performs TP collectives but its segment is not tensor-parallel");
            return;
          }
    check_groups_issue_alike(tp_families, sequence, "tp-group", "TP");
  }

  // ---- context parallelism: model-wide (one degree and K/V exchange on every segment), a sequence
  // that cuts into 2·cp equal chunks, each CP segment's family its set's CP groups (blocks of tp·cp
  // devices, TP innermost, each group listed in CP-rank order), and the members of every CP group
  // issuing the same CP compute ops in the same order (their K/V exchange happens inside those ops) ----

  void check_context_parallel() {
    std::set<int> cp_families;
    for (std::size_t s = 0; s < prog_.segments.size(); ++s) {
      const ProgramSegment& sg = prog_.segments[s];
      const ProgramSegment& first = prog_.segments.front();
      const std::string at = "segment " + std::to_string(s);
      if (sg.cp_degree != first.cp_degree || sg.cp_all_gather != first.cp_all_gather) {
        add("cp-group", at + " has cp_degree " + std::to_string(sg.cp_degree) + " but segment 0 has " +
                            std::to_string(first.cp_degree) +
                            ": context parallelism is model-wide, one degree and K/V exchange");
        return;
      }
      if (sg.cp_degree <= 1) {
        if (sg.cp_family != -1)
          add("cp-group", at + " has cp_family " + std::to_string(sg.cp_family) + " but cp_degree 1");
        continue;
      }
      const std::int64_t chunks = 2 * static_cast<std::int64_t>(sg.cp_degree);
      if (prog_.training.seq_len % chunks != 0) {
        add("cp-group", at + " (cp_degree " + std::to_string(sg.cp_degree) + "): the sequence length " +
                            std::to_string(prog_.training.seq_len) + " does not cut into " + std::to_string(chunks) +
                            " equal chunks");
        continue;
      }
      if (sg.cp_family < 0 || ix(sg.cp_family) >= prog_.families.size() || sg.devices < 0 ||
          ix(sg.devices) >= prog_.device_sets.size()) {
        add("cp-group", at + " has cp_degree " + std::to_string(sg.cp_degree) + " but no CP family");
        continue;
      }
      const CommFamily& f = prog_.families[ix(sg.cp_family)];
      const std::vector<int>& devices = prog_.device_sets[ix(sg.devices)];
      const std::size_t tp = ix(std::max(1, sg.tp_degree)), cp = ix(sg.cp_degree);
      std::vector<int> grouped;
      if (devices.size() % (tp * cp) == 0)
        for (std::size_t block = 0; block < devices.size(); block += tp * cp)
          for (std::size_t k = 0; k < tp; ++k)
            for (std::size_t c = 0; c < cp; ++c) grouped.push_back(devices[block + c * tp + k]);
      if (f.purpose != FamilyPurpose::Cp || f.stride != 1 || f.group_size != sg.cp_degree || grouped.empty() ||
          prog_.device_sets[ix(f.devices)] != grouped) {
        add("cp-group", at + " (cp_degree " + std::to_string(sg.cp_degree) + ", tp_degree " + std::to_string(tp) +
                            "): family " + std::to_string(sg.cp_family) +
                            " is not its device set's CP groups (blocks of tp x cp devices, TP innermost)");
        continue;
      }
      cp_families.insert(sg.cp_family);
    }
    for (const auto& p : prog_.plans)
      for (const auto& stream : p.streams)
        for (const auto& op : stream.ops)
          if (op.cp_steps > 0 && (op.segment < 0 || ix(op.segment) >= prog_.segments.size() ||
                                  prog_.segments[ix(op.segment)].cp_degree <= 1)) {
            add("cp-group",
                "op '" + op.label + "' exchanges K/V over a CP group but its segment is not context-parallel");
            return;
          }
    auto sequence = [&](int plan, int family) {
      std::vector<std::tuple<int, int, std::int64_t, int>> seq;
      for (const auto& stream : prog_.plans[ix(plan)].streams)
        for (const auto& op : stream.ops) {
          if (op.kind != OpKind::Compute || op.segment < 0 || ix(op.segment) >= prog_.segments.size()) continue;
          if (prog_.segments[ix(op.segment)].cp_family != family) continue;
          seq.emplace_back(op.node, static_cast<int>(op.pass), op.cp_bytes, op.cp_steps);  // by node: as TP's
        }
      return seq;
    };
    check_groups_issue_alike(cp_families, sequence, "cp-group", "CP");
  }

  void check_buffers(int p) {
    const Plan& plan = prog_.plans[ix(p)];
    if (plan.buffers.empty()) return;
    const std::size_t num_streams = plan.streams.size();
    const std::size_t base = ix(stream_base_[ix(p)].empty() ? 0 : stream_base_[ix(p)][0]);
    const std::size_t n = static_cast<std::size_t>(plan.op_count());
    DiGraph g(n);
    auto local = [&](OpRef r) { return vertex(p, r) - base; };
    for (std::size_t s = 0; s < num_streams; ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        OpRef me{static_cast<int>(s), static_cast<int>(i)};
        if (i > 0) boost::add_edge(local({me.stream, me.index - 1}), local(me), g);
        for (const OpRef& w : plan.streams[s].ops[i].waits) boost::add_edge(local(w), local(me), g);
      }
    std::vector<std::size_t> order;
    try {
      boost::topological_sort(g, std::back_inserter(order));
    } catch (const boost::not_a_dag&) {
      return;  // an intra-device wait cycle: reported by the deadlock check
    }
    // clock[v * S + s]: highest op index of stream s known to have finished before v starts.
    std::vector<int> clock(n * num_streams, -1);
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      const Loc& me = loc_[*it + base];
      int* c = &clock[*it * num_streams];
      auto absorb = [&](OpRef pred) {
        const int* pc = &clock[local(pred) * num_streams];
        for (std::size_t s = 0; s < num_streams; ++s) c[s] = std::max(c[s], pc[s]);
        c[pred.stream] = std::max(c[pred.stream], pred.index);
      };
      if (me.index > 0) absorb({me.stream, me.index - 1});
      for (const OpRef& w : op_at(p, {me.stream, me.index}).waits) absorb(w);
    }
    auto before_or_equal = [&](OpRef a, OpRef b) {
      return a == b || clock[local(b) * num_streams + ix(a.stream)] >= a.index;
    };

    std::vector<std::vector<OpRef>> users(plan.buffers.size());
    for (std::size_t s = 0; s < num_streams; ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i)
        for (int u : plan.streams[s].ops[i].uses) users[ix(u)].push_back({static_cast<int>(s), static_cast<int>(i)});
    for (std::size_t b = 0; b < plan.buffers.size(); ++b) {
      const Buffer& buf = plan.buffers[b];
      auto head = [&] { return where(p) + " buffer '" + buf.name + "'"; };  // for messages only
      bool has_alloc = buf.alloc.stream >= 0, has_free = buf.free.stream >= 0;
      if (!has_alloc && !has_free) continue;  // persistent
      if (!has_free) {
        add("buffer", head() + " is never freed");
        continue;
      }
      if (!has_alloc) {
        add("buffer", head() + " is freed but never allocated");
        continue;
      }
      if (!before_or_equal(buf.alloc, buf.free)) {
        add("buffer",
            head() + " may be freed by " + op_name(p, buf.free) + " before its alloc at " + op_name(p, buf.alloc));
        continue;
      }
      for (const OpRef& u : users[b]) {
        if (!before_or_equal(buf.alloc, u))
          add("buffer", head() + " is used by " + op_name(p, u) + " before (or concurrently with) its alloc at " +
                            op_name(p, buf.alloc));
        if (!before_or_equal(u, buf.free))
          add("buffer", head() + " is used by " + op_name(p, u) + " after (or concurrently with) its free at " +
                            op_name(p, buf.free));
      }
    }
  }

  // ---- deadlock: cycle search over the class-level wait graph ----

  void check_deadlock() {
    // Vertices: one per (plan, op), then one per rendezvous: a transfer (SEND op, RECV op) or a
    // collective instance (its members' ops). A rendezvous op reaches its rendezvous vertex, and
    // whatever waits for the op waits for its rendezvous vertices (all of them: for different
    // devices of the plan the op may meet different peer plans). Keeping one vertex per pair or
    // instance, rather than merging every op that ever meets into one, is what keeps a device that
    // both sends and receives one DAG edge (mirrored placements) from looking like a self-wait.
    std::sort(transfer_edges_.begin(), transfer_edges_.end());
    transfer_edges_.erase(std::unique(transfer_edges_.begin(), transfer_edges_.end()), transfer_edges_.end());
    std::vector<std::vector<std::size_t>> rendezvous;
    for (auto [u, v] : transfer_edges_) rendezvous.push_back({u, v});
    for (auto& members : collective_instances_) rendezvous.push_back(members);
    const std::size_t num_ops = loc_.size();
    std::vector<std::vector<std::size_t>> completion(num_ops);
    for (std::size_t j = 0; j < rendezvous.size(); ++j)
      for (std::size_t m : rendezvous[j])
        if (std::find(completion[m].begin(), completion[m].end(), num_ops + j) == completion[m].end())
          completion[m].push_back(num_ops + j);
    DiGraph g(num_ops + rendezvous.size());
    auto after = [&](std::size_t u, std::size_t v) {  // v starts after u completes
      if (completion[u].empty()) boost::add_edge(u, v, g);
      for (std::size_t c : completion[u]) boost::add_edge(c, v, g);
    };
    for (std::size_t p = 0; p < prog_.plans.size(); ++p) {
      const Plan& plan = prog_.plans[p];
      for (std::size_t s = 0; s < plan.streams.size(); ++s)
        for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
          OpRef me{static_cast<int>(s), static_cast<int>(i)};
          std::size_t v = vertex(static_cast<int>(p), me);
          if (i > 0) after(v - 1, v);
          for (const OpRef& w : plan.streams[s].ops[i].waits) after(vertex(static_cast<int>(p), w), v);
          for (std::size_t c : completion[v]) boost::add_edge(v, c, g);
        }
    }

    std::vector<std::size_t> parent(num_ops + rendezvous.size());
    CycleVisitor visitor;
    visitor.parent = &parent;
    try {
      boost::depth_first_search(g, boost::visitor(visitor));
    } catch (const CycleFound& c) {
      // The back edge from -> to closes the cycle to -> ... -> from -> to; print it as "waits on".
      std::vector<std::size_t> cycle{c.to, c.from};
      while (cycle.back() != c.to) cycle.push_back(parent[cycle.back()]);
      std::size_t length = 0;
      for (std::size_t k = 0; k + 1 < cycle.size(); ++k) length += cycle[k] < num_ops ? 1 : 0;
      auto op_text = [&](std::size_t v) {
        const Loc& l = loc_[v];
        return where(l.plan) + " " + op_name(l.plan, {l.stream, l.index});
      };
      // A rendezvous names every device taking part, not just one side.
      auto name = [&](std::size_t v) {
        if (v < num_ops) return op_text(v);
        const auto& members = rendezvous[v - num_ops];
        std::string text = "the rendezvous of";
        constexpr std::size_t kMembers = 8;
        for (std::size_t k = 0; k < members.size() && k < kMembers; ++k) text += (k ? ", " : " ") + op_text(members[k]);
        if (members.size() > kMembers) text += ", ...";
        return text;
      };
      // Runs of stream order (an op waiting on its predecessor, directly or through the
      // predecessor's rendezvous) print as one entry: the waits and the rendezvous between devices
      // are what close the cycle, and the fault is among them.
      auto same_run = [&](std::size_t a, std::size_t b) {  // b is a's stream predecessor
        return a < num_ops && b < num_ops && loc_[a].plan == loc_[b].plan && loc_[a].stream == loc_[b].stream &&
               loc_[b].index + 1 == loc_[a].index;
      };
      constexpr std::size_t kShown = 16;
      std::string message;
      std::size_t shown = 0, k = 0;
      while (k + 1 < cycle.size() && shown < kShown) {
        std::size_t end = k;
        const std::size_t last = cycle.size() - 1;  // cycle[last] repeats cycle[0]
        while (end < last && cycle[end] < num_ops) {
          if (end + 1 < last && same_run(cycle[end], cycle[end + 1])) {
            ++end;
          } else if (end + 2 < last && cycle[end + 1] >= num_ops && same_run(cycle[end], cycle[end + 2])) {
            end += 2;  // the predecessor is a rendezvous op: x waits on its rendezvous, which waits on it
          } else {
            break;
          }
        }
        if (!message.empty()) message += " waits on ";
        message += name(cycle[k]);
        if (end > k)
          message += " after its stream predecessors back to op " + std::to_string(loc_[cycle[end]].index) + " '" +
                     op_at(loc_[cycle[end]].plan, {loc_[cycle[end]].stream, loc_[cycle[end]].index}).label + "'";
        k = end + 1;
        ++shown;
      }
      if (k + 1 < cycle.size()) message += " waits on ...";
      message += " (cycle of " + std::to_string(length) + " op" + (length == 1 ? "" : "s") + ")";
      add("deadlock", message);
    }
  }
};

}  // namespace

std::vector<VerifyIssue> verify(const Program& program) { return Verifier(program).run(); }

void verify_or_throw(const Program& program) {
  auto issues = verify(program);
  if (issues.empty()) return;
  std::string message = "verify: " + issues.front().check + ": " + issues.front().message;
  if (issues.size() > 1) message += " (+" + std::to_string(issues.size() - 1) + " more)";
  throw PlanError(message);
}

}  // namespace piper::core
