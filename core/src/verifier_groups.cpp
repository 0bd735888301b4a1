// The verifier's group checks (verifier_impl.hpp): collectives issued alike by every member of a
// group, and the expert, tensor and context parallel groups' layouts and compute ops.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "piper/core/error.hpp"
#include "piper/core/readiness.hpp"
#include "verifier_impl.hpp"

namespace piper::core::verifier_detail {

std::string Verifier::describe_collective(int plan, OpRef r) const {
  const Op& op = op_at(plan, r);
  return to_string(op.kind) + " pair " + std::to_string(op.pair) + " (" + std::to_string(op.bytes) + " bytes) '" +
         op.label + "'";
}

void Verifier::check_collectives() {
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
std::string Verifier::sequence_difference(std::size_t f, int a, int da, const std::vector<OpRef>& sa, int b, int db,
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

void Verifier::check_expert_groups() {
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
                                std::to_string(member) + " but segment " + std::to_string(op.segment) + " is sharded " +
                                std::to_string(sg.shard_degree) + " ways");
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

void Verifier::check_tensor_parallel() {
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
      add("tp-group", at + " (tp_degree " + std::to_string(sg.tp_degree) + "): family " + std::to_string(sg.tp_family) +
                          " is not its device set in consecutive groups of " + std::to_string(sg.tp_degree));
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

void Verifier::check_context_parallel() {
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

}  // namespace piper::core::verifier_detail
