// The recompute pass: records each selected segment's recomputation mode (costed by recost.cpp),
// optionally only for some transformer blocks of the selection ("every" / "first").
#include "pass.hpp"

#include <set>
#include <vector>

namespace piper::core::passes {

namespace {

// The block a segment belongs to (its BLK tag; the compiler tags blocks when a directive selects
// them), or -1 for the embedding, final norm and head.
int block_of(const Segment& s) {
  auto it = s.tags.find("BLK");
  return it == s.tags.end() ? -1 : it->second;
}

void apply_recompute(PassContext& cx, const RecomputeDirective& d, int index, std::vector<int>& rc_by) {
  auto matched = cx.match(d.filter);
  if (matched.empty()) fail(index, "filter", "matches no node (" + d.filter.to_string() + ")");
  std::vector<int> segments = segments_of(cx, matched);
  if (d.every > 0 || d.first > 0) {
    std::set<int> blocks;
    for (int s : segments)
      if (int b = block_of(cx.dag.segments.at(static_cast<std::size_t>(s))); b >= 0) blocks.insert(b);
    if (blocks.empty()) fail(index, "filter", "selects no transformer block (" + d.filter.to_string() + ")");
    std::set<int> chosen;
    int rank = 0;
    for (int b : blocks) {
      if (d.every > 0 ? (b + 1) % d.every == 0 : rank < d.first) chosen.insert(b);
      ++rank;
    }
    if (d.first > static_cast<int>(blocks.size()))
      fail(index, "first",  // the filter named: a generated program's filters are its PP regions
           "asks for " + std::to_string(d.first) + " blocks but the filter " + d.filter.to_string() + " selects only " +
               std::to_string(blocks.size()) + (blocks.size() == 1 ? " block" : " blocks"));
    std::vector<int> kept;
    for (int s : segments)
      if (chosen.contains(block_of(cx.dag.segments.at(static_cast<std::size_t>(s))))) kept.push_back(s);
    segments = std::move(kept);  // "every" larger than the selection's blocks chooses none: nothing recomputed
  }
  for (int s : segments) {
    if (rc_by[static_cast<std::size_t>(s)] >= 0)
      fail(index, "filter",
           "segment " + std::to_string(s) + " already has a recompute mode (directive " +
               std::to_string(rc_by[static_cast<std::size_t>(s)]) + ")");
    rc_by[static_cast<std::size_t>(s)] = index;
    cx.dag.segments.at(static_cast<std::size_t>(s)).recompute = d.mode;
  }
}

}  // namespace

void run_recompute(PassRun& run, const RecomputeDirective& d, int index) {
  apply_recompute(run.cx, d, index, run.rc_by);
}

}  // namespace piper::core::passes
