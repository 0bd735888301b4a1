// Static checks of a Program before anything runs: matched point-to-point transfers, consistent
// collective order, no cross-device wait cycle (deadlock), and sound buffer lifetimes.
#pragma once

#include <string>
#include <vector>

#include "piper/core/program.hpp"

namespace piper::core {

struct VerifyIssue {
  std::string check;    // "send-recv", "collective-order", "deadlock", "buffer"
  std::string message;  // one line naming device/plan, stream, op
};

// Returns every problem found (empty = clean). Works on plans (classes of devices), so its cost does
// not grow with the data-parallel degree.
std::vector<VerifyIssue> verify(const Program& program);
// Throws PlanError with the first issue (and the count of the others).
void verify_or_throw(const Program& program);

}  // namespace piper::core
