// The Verifier class behind verify() (verifier.hpp), private to piper_core. Its checks are defined in
// verifier.cpp (structure, pairing ids, send/recv), verifier_groups.cpp (collectives, expert, tensor
// and context parallel groups) and verifier_order.cpp (buffer lifetimes, deadlock); verifier.cpp's
// opening comment states the contract they check.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "piper/core/verifier.hpp"

namespace piper::core::verifier_detail {

inline bool is_collective_op(OpKind k) {
  return k == OpKind::AllReduce || k == OpKind::ReduceScatter || k == OpKind::AllGather || k == OpKind::AllToAll;
}

// Container index from the Program's int indices (validated by check_structure first).
constexpr std::size_t ix(int i) { return static_cast<std::size_t>(i); }

class Verifier {
 public:
  explicit Verifier(const Program& p) : prog_(p) {}

  std::vector<VerifyIssue> run();

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

  void check_structure();
  void index_ops();

  static std::int64_t pair_key(std::int32_t pair, OpKind kind) {
    return static_cast<std::int64_t>(pair) * 2 + (kind == OpKind::Recv ? 1 : 0);
  }

  const std::vector<int>& positions(DeviceSetId set);

  // ---- pairing ids (core/readiness.hpp): who meets whom ----

  void check_pairing_ids();
  void check_collective_ids();

  // ---- send / recv ----

  int peer_map(int plan, DeviceSetId set, DeviceSetId peer_set);
  int compose(int p, int there, int q, int back);
  void match(int p, OpRef r);
  void check_send_recv();

  // ---- collectives ----

  std::string describe_collective(int plan, OpRef r) const;
  void check_collectives();

  std::string sequence_difference(std::size_t f, int a, int da, const std::vector<OpRef>& sa, int b, int db,
                                  const std::vector<OpRef>& sb) const;

  // ---- expert groups: the all-to-alls of a segment sharded S ways run over groups of S devices, and
  // with expert TP each such group takes one device of each ETP group it meets (the devices of an
  // EP group hold different experts' same slice; two members of one ETP group hold the same experts) ----

  void check_expert_groups();

  // ---- tensor parallelism: each TP segment's family is its set cut into consecutive groups of its
  // degree, and the members of every TP group issue the same TP compute ops in the same order
  // (their collectives happen inside those ops, so a mismatch would hang or mix tensors) ----

  void check_tensor_parallel();

  // ---- context parallelism: model-wide (one degree and K/V exchange on every segment), a sequence
  // that cuts into 2·cp equal chunks, each CP segment's family its set's CP groups (blocks of tp·cp
  // devices, TP innermost, each group listed in CP-rank order), and the members of every CP group
  // issuing the same CP compute ops in the same order (their K/V exchange happens inside those ops) ----

  void check_context_parallel();

  // ---- buffers: vector clocks over stream order and waits within one plan ----

  void check_buffers(int p);

  // ---- deadlock: cycle search over the class-level wait graph ----

  void check_deadlock();
};

}  // namespace piper::core::verifier_detail
