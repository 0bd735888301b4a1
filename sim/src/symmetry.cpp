// Symmetry reduction: color refinement of devices over (plan, node type, peers, collective groups),
// the classes an engine without link contention may simulate once each (see symmetry.hpp).
#include "piper/sim/symmetry.hpp"

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>

namespace piper::sim {

using core::OpKind;

namespace {

constexpr std::size_t ix(std::int64_t i) { return static_cast<std::size_t>(i); }

bool is_collective(OpKind k) {
  return k == OpKind::AllReduce || k == OpKind::ReduceScatter || k == OpKind::AllGather || k == OpKind::AllToAll;
}

// Assigns dense ids to signatures in order of first appearance (deterministic over device order).
class Interner {
 public:
  int id(const std::vector<std::int64_t>& key) {
    auto [it, inserted] = ids_.try_emplace(key, static_cast<int>(ids_.size()));
    return it->second;
  }
  int size() const { return static_cast<int>(ids_.size()); }

 private:
  std::map<std::vector<std::int64_t>, int> ids_;
};

struct PlanRelations {
  std::vector<std::pair<core::DeviceSetId, core::DeviceSetId>> p2p;  // distinct (device set, peer set)
  std::vector<int> families;                                         // distinct collective families
  // SEND/RECV ops sharing (kind, pairing id) on this plan: their p2p indices. The engines find a
  // counterpart by pairing id on the peer's plan (core/readiness.hpp), which the verifier makes
  // unique; an unverified program that repeats one keeps its peers distinct by class or runs full.
  std::vector<std::vector<int>> same_node;
};

// Each plan's transfers and collective families.
std::vector<PlanRelations> plan_relations(const core::Program& program) {
  std::vector<PlanRelations> rel(program.plans.size());
  for (std::size_t p = 0; p < program.plans.size(); ++p) {
    std::map<std::pair<core::DeviceSetId, core::DeviceSetId>, int> pairs;
    std::map<std::pair<int, std::int32_t>, std::vector<int>> by_node;
    std::set<int> fams;
    for (const auto& stream : program.plans[p].streams)
      for (const auto& op : stream.ops) {
        if (op.kind == OpKind::Send || op.kind == OpKind::Recv) {
          auto [it, inserted] = pairs.try_emplace({op.device_set, op.peer_set}, static_cast<int>(pairs.size()));
          if (inserted) rel[p].p2p.push_back(it->first);
          by_node[{op.kind == OpKind::Send ? 0 : 1, op.pair}].push_back(it->second);
        } else if (is_collective(op.kind) && op.family >= 0) {
          fams.insert(op.family);
        }
      }
    rel[p].families.assign(fams.begin(), fams.end());
    for (auto& [key, list] : by_node)
      if (list.size() > 1) rel[p].same_node.push_back(list);
  }
  return rel;
}

// The peer of a device across a (device set, peer set) pair, -1 if none, by position tables of the
// device sets that resolve peers.
class PeerOf {
 public:
  PeerOf(const core::Program& program, const std::vector<PlanRelations>& rel) : program_(program) {
    const int n = program.num_devices;
    for (const auto& r : rel)
      for (const auto& [set, peers] : r.p2p) {
        auto& t = position_[set];
        if (!t.empty()) continue;
        t.assign(ix(n), -1);
        const auto& devices = program.device_sets[ix(set)];
        for (std::size_t i = 0; i < devices.size(); ++i) t[ix(devices[i])] = static_cast<int>(i);
      }
  }
  int operator()(const std::pair<core::DeviceSetId, core::DeviceSetId>& pr, int d) const {
    const int pos = position_.at(pr.first)[ix(d)];
    const auto& peers = program_.device_sets[ix(pr.second)];
    return pos >= 0 && ix(pos) < peers.size() ? peers[ix(pos)] : -1;
  }

 private:
  const core::Program& program_;
  std::map<core::DeviceSetId, std::vector<int>> position_;
};

// Per family, each device's key of the collective group it is in (member classes + node layout; -1:
// not a member).
std::map<int, std::vector<int>> group_keys(const std::map<int, std::vector<std::vector<int>>>& groups,
                                           const std::vector<int>& color, const std::vector<int>& node_of,
                                           const std::vector<int>& node_type) {
  const int n = static_cast<int>(color.size());
  std::map<int, std::vector<int>> group_key;
  Interner keys;
  for (const auto& [f, list] : groups) {
    auto& gk = group_key[f];
    gk.assign(ix(n), -1);
    for (const auto& g : list) {
      std::vector<std::int64_t> key;
      std::vector<int> member_colors;
      for (int d : g) member_colors.push_back(color[ix(d)]);
      std::sort(member_colors.begin(), member_colors.end());
      member_colors.erase(std::unique(member_colors.begin(), member_colors.end()), member_colors.end());
      key.assign(member_colors.begin(), member_colors.end());
      key.push_back(-1);
      std::map<int, int> per_node;
      for (int d : g) per_node[node_of[ix(d)]] += 1;
      std::vector<std::pair<int, int>> layout;
      for (const auto& [node, count] : per_node) layout.emplace_back(node_type[ix(node)], count);
      std::sort(layout.begin(), layout.end());
      for (const auto& [t, c] : layout) key.push_back(t), key.push_back(c);
      const int id = keys.id(key);
      for (int d : g) gk[ix(d)] = id;
    }
  }
  return group_key;
}

// Why a counterpart found by (pairing id, peer class) is not unique on some device; empty if it is.
std::string ambiguous_counterparts(const core::Program& program, const std::vector<PlanRelations>& rel,
                                   const PeerOf& peer, const Symmetry& sym) {
  const std::vector<int>& color = sym.class_of_device;
  for (int d = 0; d < program.num_devices; ++d) {
    if (!sym.is_representative(d)) continue;  // peers' classes are equal across a class
    const auto& r = rel[ix(program.plan_of_device[ix(d)])];
    for (const auto& list : r.same_node) {
      std::vector<int> peer_colors;
      for (int k : list) {
        const int e = peer(r.p2p[ix(k)], d);
        peer_colors.push_back(e < 0 ? -1 : color[ix(e)]);
      }
      std::sort(peer_colors.begin(), peer_colors.end());
      if (std::adjacent_find(peer_colors.begin(), peer_colors.end()) != peer_colors.end())
        return fmt::format(
            "device {}: two transfers with one pairing id have peers in one class, so they cannot be told apart", d);
    }
  }
  return "";
}

}  // namespace

Symmetry find_symmetry(const core::Program& program, const Cluster& cluster) {
  const int n = program.num_devices;
  Symmetry sym;
  // Devices sharing a GPU slow each other down (engine.hpp): no device runs as its class does.
  const bool too_small = cluster.num_devices() < n;
  if (too_small || cluster.shares_gpus()) {
    sym.class_of_device.resize(ix(n));
    for (int d = 0; d < n; ++d) sym.class_of_device[ix(d)] = d, sym.representative.push_back(d);
    sym.usable = false;
    sym.note = too_small ? "cluster smaller than the program" : "devices share GPUs";
    return sym;
  }
  // Node types: nodes with equal specs are interchangeable for every cost.
  const std::vector<int> node_of = cluster.node_of_devices();
  std::vector<int> node_type(cluster.nodes.size());
  std::vector<const NodeSpec*> types;
  for (std::size_t k = 0; k < cluster.nodes.size(); ++k) {
    auto it = std::find_if(types.begin(), types.end(), [&](const NodeSpec* t) { return *t == cluster.nodes[k]; });
    node_type[k] = static_cast<int>(it - types.begin());
    if (it == types.end()) types.push_back(&cluster.nodes[k]);
  }
  auto type_of = [&](int d) { return node_type[ix(node_of[ix(d)])]; };

  const std::vector<PlanRelations> rel = plan_relations(program);
  const PeerOf peer(program, rel);
  std::set<int> families;
  for (const auto& r : rel) families.insert(r.families.begin(), r.families.end());
  std::map<int, std::vector<std::vector<int>>> groups;
  for (int f : families) groups[f] = program.groups(f);

  // Round 0: plan and node type.
  std::vector<int> color(ix(n));
  int colors = 0;
  {
    Interner in;
    for (int d = 0; d < n; ++d) color[ix(d)] = in.id({program.plan_of_device[ix(d)], type_of(d)});
    colors = in.size();
  }
  const int plan_classes = static_cast<int>(program.plans.size());
  const int typed_classes = colors;
  // Refine until stable: a device's signature is its color, its peers' colors and co-location, and
  // the key of each collective group it is in (member classes + node layout).
  std::vector<std::int64_t> sig;
  for (int round = 0;; ++round) {
    const std::map<int, std::vector<int>> group_key = group_keys(groups, color, node_of, node_type);
    Interner in;
    std::vector<int> next(ix(n));
    for (int d = 0; d < n; ++d) {
      const auto& r = rel[ix(program.plan_of_device[ix(d)])];
      sig.clear();
      sig.push_back(color[ix(d)]);
      for (const auto& pr : r.p2p) {
        const int e = peer(pr, d);
        sig.push_back(e < 0 ? -1 : color[ix(e)]);
        sig.push_back(e >= 0 && node_of[ix(e)] == node_of[ix(d)] ? 1 : 0);
      }
      for (int f : r.families) sig.push_back(group_key.at(f)[ix(d)]);
      next[ix(d)] = in.id(sig);
    }
    const int before = colors;
    color.swap(next);
    colors = in.size();
    if (colors == before) break;
  }
  sym.class_of_device = color;
  sym.representative.assign(ix(colors), -1);
  for (int d = 0; d < n; ++d)
    if (sym.representative[ix(color[ix(d)])] < 0) sym.representative[ix(color[ix(d)])] = d;

  // A counterpart found by (pairing id, peer class) must be unique on every device.
  if (std::string note = ambiguous_counterparts(program, rel, peer, sym); !note.empty()) {
    sym.usable = false;
    sym.note = note;
    return sym;
  }
  std::string why;
  if (typed_classes > plan_classes)
    why += fmt::format("; node types split {} plans into {} classes", plan_classes, typed_classes);
  if (colors > typed_classes)
    why += fmt::format("; peers' placement and collective layouts split them into {}", colors);
  if (colors == n)
    sym.note = fmt::format("no symmetry: all {} devices differ ({} plans{})", n, plan_classes, why);
  else
    sym.note = fmt::format("{} devices in {} classes ({} plans{})", n, colors, plan_classes, why);
  return sym;
}

}  // namespace piper::sim
