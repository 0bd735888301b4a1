// Readiness rules and the pairing-id index (core/readiness.hpp).
#include "piper/core/readiness.hpp"

#include <algorithm>

namespace piper::core {

namespace {

constexpr std::size_t ix(std::int64_t i) { return static_cast<std::size_t>(i); }
std::int64_t key(MeetSide side, int pair) { return static_cast<std::int64_t>(pair) * 4 + static_cast<int>(side); }

}  // namespace

bool is_collective(OpKind k) {
  return k == OpKind::AllReduce || k == OpKind::ReduceScatter || k == OpKind::AllGather || k == OpKind::AllToAll;
}

MeetSide meet_side(OpKind k) {
  if (k == OpKind::Send) return MeetSide::Send;
  if (k == OpKind::Recv) return MeetSide::Recv;
  return is_collective(k) ? MeetSide::Collective : MeetSide::None;
}

PairIndex::PairIndex(const Program& program) : program_(program) {
  ops_.resize(program.plans.size());
  std::vector<int> family_of_pair;
  for (std::size_t p = 0; p < program.plans.size(); ++p) {
    const Plan& plan = program.plans[p];
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        const Op& op = plan.streams[s].ops[i];
        const MeetSide side = meet_side(op.kind);
        if (side == MeetSide::None || op.pair < 0) continue;
        // A second op with the same (side, id) on one plan is refused by the verifier; the first wins.
        ops_[p].try_emplace(key(side, op.pair), OpRef{static_cast<int>(s), static_cast<int>(i)});
        pair_count_ = std::max(pair_count_, op.pair + 1);
        if (side != MeetSide::Collective || op.family < 0) continue;
        if (family_of_pair.size() <= ix(op.pair)) family_of_pair.resize(ix(op.pair) + 1, -1);
        family_of_pair[ix(op.pair)] = op.family;
      }
  }
  // Slots: a family's pairing ids in increasing order (lowering numbers them in the global order).
  slot_.assign(ix(pair_count_), -1);
  slots_of_family_.assign(program.families.size(), 0);
  for (std::size_t pair = 0; pair < family_of_pair.size(); ++pair) {
    const int f = family_of_pair[pair];
    if (f < 0 || ix(f) >= slots_of_family_.size()) continue;
    slot_[pair] = slots_of_family_[ix(f)]++;
  }
}

const Op& PairIndex::op_at(int plan, OpRef r) const {
  return program_.plans[ix(plan)].streams[ix(r.stream)].ops[ix(r.index)];
}

OpRef PairIndex::find(int plan, MeetSide side, int pair) const {
  if (plan < 0 || ix(plan) >= ops_.size() || pair < 0) return {};
  const auto& table = ops_[ix(plan)];
  auto it = table.find(key(side, pair));
  return it == table.end() ? OpRef{} : it->second;
}

OpRef PairIndex::find_on(int device, MeetSide side, int pair) const {
  return find(program_.plan_of_device.at(ix(device)), side, pair);
}

Member PairIndex::counterpart(int device, OpRef r) const {
  const Op& op = op_at(program_.plan_of_device.at(ix(device)), r);
  const MeetSide side = meet_side(op.kind);
  if (side != MeetSide::Send && side != MeetSide::Recv) return {-1, {}};
  const int peer = program_.peer_of(op, device);
  if (peer < 0) return {-1, {}};
  const OpRef theirs = find_on(peer, side == MeetSide::Send ? MeetSide::Recv : MeetSide::Send, op.pair);
  if (theirs.stream < 0) return {-1, {}};
  return {peer, theirs};
}

std::vector<Member> PairIndex::meeting(int device, OpRef r) const {
  const Op& op = op_at(program_.plan_of_device.at(ix(device)), r);
  const MeetSide side = meet_side(op.kind);
  if (side == MeetSide::Send || side == MeetSide::Recv) {
    const Member other = counterpart(device, r);
    if (other.first < 0) return {{device, r}};
    if (side == MeetSide::Send) return {{device, r}, other};
    return {other, {device, r}};
  }
  if (side == MeetSide::None || op.family < 0) return {{device, r}};
  std::vector<Member> out;
  for (int member : program_.group_of(op.family, device)) {
    if (member == device) {
      out.emplace_back(device, r);
      continue;
    }
    const OpRef theirs = find_on(member, MeetSide::Collective, op.pair);
    if (theirs.stream >= 0) out.emplace_back(member, theirs);
  }
  return out;
}

}  // namespace piper::core
