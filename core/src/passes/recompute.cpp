// The recompute pass: records each selected segment's recomputation mode (costed by recost.cpp).
#include "pass.hpp"

#include <vector>

namespace piper::core::passes {

namespace {

void apply_recompute(PassContext& cx, const RecomputeDirective& d, int index, std::vector<int>& rc_by) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  for (int s : segments_of(cx, matched)) {
    if (rc_by[static_cast<std::size_t>(s)] >= 0)
      fail(index, "filter",
           "segment " + std::to_string(s) + " already has a recompute mode (directive " +
               std::to_string(rc_by[static_cast<std::size_t>(s)]) + ")");
    rc_by[static_cast<std::size_t>(s)] = index;
    cx.dag.segments.at(static_cast<std::size_t>(s)).recompute = d.mode;
  }
}

}  // namespace

void run_recompute(PassRun& run, const RecomputeDirective& d, int index) { apply_recompute(run.cx, d, index, run.rc_by); }

}  // namespace piper::core::passes
