// Readiness: the one statement of when an op of a device may start and which ops meet which, keyed
// by the pairing ids lowering gives every SEND, RECV and collective (Op::pair). The simulator's
// ReadyTracker and PartnerFinder, the schedule view, the GUI's dependency arrows and calibration ask
// it (PairIndex) instead of matching ops themselves, and the verifier checks plans against the same
// rule (core/src/verifier.cpp). The runtime's transports (the loopback hub, the host backend's MPI
// tags, NCCL's channel order), the Chrome-trace flow arrows and the Chakra export key on the same
// ids: they meet ops across processes or files, where no PairIndex is shared.
//
// The rules, for device d running plan P = Program::plan_for(d):
//  1. Stream order: an op starts after the op before it on its stream has finished.
//  2. Waits: and after every op of Op::waits (other streams of d) has finished (may_start()).
//  3. Meeting: a SEND on d meets the RECV with the same pairing id on peer_of(SEND, d); the two start
//     together once both are posted (rendezvous). A collective on d meets, on every member m of
//     group_of(family, d), the op with the same pairing id on m's plan; the occurrence starts once
//     every member has posted its op. A COMPUTE or UPD op meets no other op.
// Pairing ids are plan-relative: devices differing only by data-parallel rank share a plan and so
// its ids; the peer or group resolves from the device as above. A plan holds at most one SEND, one
// RECV and one collective per id (the verifier checks it), so (plan, side, id) names one op.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "piper/core/program.hpp"

namespace piper::core {

bool is_collective(OpKind k);  // ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL

// Rules 1 and 2 for the op at `at` of a device: done(stream) is how many ops of that stream of the
// device have finished. True when `at` is its stream's next op and every wait has finished.
template <class Done>
bool may_start(const Op& op, OpRef at, Done&& done) {
  if (done(at.stream) != at.index) return false;
  for (const OpRef& w : op.waits)
    if (done(w.stream) <= w.index) return false;
  return true;
}

// The side of a meeting an op takes: the key, with the pairing id, of its op on a plan.
enum class MeetSide : std::uint8_t { None, Send, Recv, Collective };
MeetSide meet_side(OpKind k);

// A (device, op) member of a meeting.
using Member = std::pair<int, OpRef>;

// Rule 3 over one Program: per plan, the op of each (side, pairing id). Memory is one entry per
// communication op of each distinct plan, never per device.
class PairIndex {
 public:
  explicit PairIndex(const Program& program);

  const Program& program() const { return program_; }
  // Number of pairing ids: they are 0..pair_count()-1 (ids no plan uses are allowed).
  int pair_count() const { return pair_count_; }
  // The op of plan `plan` with pairing id `pair` on `side`, or {-1, -1}.
  OpRef find(int plan, MeetSide side, int pair) const;
  OpRef find_on(int device, MeetSide side, int pair) const;
  // SEND or RECV at `r` on `device`: its other side (peer device, its op), or {-1, {-1,-1}} when the
  // peer is unresolvable or has no op with the id.
  Member counterpart(int device, OpRef r) const;
  // Every member of the meeting of the op at `r` on `device`: a transfer as {SEND side, RECV side}
  // (only the op itself when its other side is missing); a collective in group order (members whose
  // plan lacks the id left out); a COMPUTE or UPD op alone.
  std::vector<Member> meeting(int device, OpRef r) const;
  // Collectives: the position of `pair` among the pairing ids of its family, dense from 0 to
  // family_slots(family)-1 (per-occurrence tables key on it); -1 for a non-collective id.
  int family_slot(int pair) const {
    return pair >= 0 && pair < pair_count_ ? slot_[static_cast<std::size_t>(pair)] : -1;
  }
  int family_slots(int family) const { return slots_of_family_[static_cast<std::size_t>(family)]; }

 private:
  const Op& op_at(int plan, OpRef r) const;
  const Program& program_;
  int pair_count_ = 0;
  std::vector<std::int32_t> slot_;                            // pair -> family slot
  std::vector<std::int32_t> slots_of_family_;                 // family -> number of its pairing ids
  std::vector<std::unordered_map<std::int64_t, OpRef>> ops_;  // plan -> (pair * 4 + side) -> op
};

}  // namespace piper::core
