// The unit-time view the engine tests simulate under: each pipeline stage's F = f seconds and B = b
// per microbatch (BI = b - w, BW = w when split), everything else free. A stage may hold several
// model segments (embedding, blocks, head): each segment's op gets the stage's time divided by the
// stage's segment count.
#pragma once

#include <map>
#include <vector>

#include "piper/core/program.hpp"
#include "piper/sim/cost_model.hpp"

namespace piper::test {

inline sim::OpOverride unit_costs(const core::Program& program, double f = 1, double b = 2, double w = 1) {
  std::map<int, int> segments_of_stage;
  auto stage = [](const auto& tags) { return tags.count("PP") ? tags.at("PP") : 0; };
  for (const auto& seg : program.segments) segments_of_stage[stage(seg.tags)] += 1;
  std::vector<double> share;
  for (const auto& seg : program.segments) share.push_back(1.0 / segments_of_stage[stage(seg.tags)]);
  return [share, f, b, w](const core::Op& op) -> std::optional<double> {
    if (op.kind != core::OpKind::Compute || op.segment < 0) return 0.0;
    const double s = share.at(static_cast<std::size_t>(op.segment));
    switch (op.pass) {
      case core::Pass::F:
        return f * s;
      case core::Pass::B:
        return b * s;
      case core::Pass::BI:
        return (b - w) * s;
      case core::Pass::BW:
        return w * s;
      default:
        return 0.0;
    }
  };
}

}  // namespace piper::test
