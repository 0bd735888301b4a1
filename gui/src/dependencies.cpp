// Cross-device dependency lookup and critical-path extraction over a Timeline's Program.
#include "piper/gui/dependencies.hpp"

#include <algorithm>

namespace piper::gui {

using core::OpKind;

DependencyIndex::DependencyIndex(std::shared_ptr<const core::Timeline> timeline)
    : timeline_(std::move(timeline)), plans_(timeline_->program->plans.size()) {}

const DependencyIndex::PlanIndex& DependencyIndex::plan_index(int device) const {
  const core::Program& program = *timeline_->program;
  const auto p = static_cast<std::size_t>(program.plan_of_device.at(static_cast<std::size_t>(device)));
  if (!plans_[p]) {
    auto idx = std::make_unique<PlanIndex>();
    const core::Plan& plan = program.plans[p];
    idx->waiters.resize(plan.streams.size());
    idx->span_base.resize(plan.streams.size());
    std::size_t base = 0;
    for (std::size_t s = 0; s < plan.streams.size(); ++s) {
      idx->span_base[s] = base;
      base += plan.streams[s].ops.size();
      idx->waiters[s].resize(plan.streams[s].ops.size());
    }
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
        const core::Op& op = plan.streams[s].ops[i];
        core::OpRef me{static_cast<int>(s), static_cast<int>(i)};
        for (const core::OpRef& w : op.waits)
          idx->waiters.at(static_cast<std::size_t>(w.stream)).at(static_cast<std::size_t>(w.index)).push_back(me);
      }
    plans_[p] = std::move(idx);
  }
  return *plans_[p];
}

const core::Op& DependencyIndex::op(const OpKey& k) const {
  return timeline_->op(k.device, core::OpSpan{k.stream, k.index, 0, 0});
}

const core::OpSpan& DependencyIndex::span(const OpKey& k) const {
  const PlanIndex& idx = plan_index(k.device);
  return timeline_->devices.at(static_cast<std::size_t>(k.device))
      .spans.at(idx.span_base.at(static_cast<std::size_t>(k.stream)) + static_cast<std::size_t>(k.index));
}

// Who meets whom is core/readiness.hpp's rule (the pairing ids), never matched here.
std::vector<OpKey> DependencyIndex::partners_of(const OpKey& key) const {
  if (!pairs_) pairs_ = std::make_unique<core::PairIndex>(*timeline_->program);
  const core::OpRef me{key.stream, key.index};
  std::vector<OpKey> out;
  for (const auto& [device, r] : pairs_->meeting(key.device, me))
    if (device != key.device || r != me) out.push_back({device, r.stream, r.index});
  return out;
}

Dependencies DependencyIndex::of(const OpKey& key) const {
  Dependencies deps;
  const core::Op& me = op(key);
  const PlanIndex& idx = plan_index(key.device);
  if (key.index > 0) deps.incoming.push_back({key.device, key.stream, key.index - 1});
  for (const core::OpRef& w : me.waits) deps.incoming.push_back({key.device, w.stream, w.index});
  const auto& stream_ops =
      timeline_->program->plan_for(key.device).streams.at(static_cast<std::size_t>(key.stream)).ops;
  if (static_cast<std::size_t>(key.index) + 1 < stream_ops.size())
    deps.outgoing.push_back({key.device, key.stream, key.index + 1});
  for (const core::OpRef& w :
       idx.waiters.at(static_cast<std::size_t>(key.stream)).at(static_cast<std::size_t>(key.index)))
    deps.outgoing.push_back({key.device, w.stream, w.index});
  for (const OpKey& p : partners_of(key)) {
    if (me.kind == OpKind::Recv)
      deps.incoming.push_back(p);
    else if (me.kind == OpKind::Send)
      deps.outgoing.push_back(p);
    else
      deps.partners.push_back(p);
  }
  return deps;
}

std::vector<OpKey> DependencyIndex::predecessors(const OpKey& key) const {
  std::vector<OpKey> out;
  auto add_own = [&](const OpKey& k) {
    if (k.index > 0) out.push_back({k.device, k.stream, k.index - 1});
    for (const core::OpRef& w : op(k).waits) out.push_back({k.device, w.stream, w.index});
  };
  add_own(key);
  for (const OpKey& p : partners_of(key)) add_own(p);
  return out;
}

std::vector<OpKey> DependencyIndex::critical_path() const {
  OpKey last;
  double last_end = -1;
  for (std::size_t d = 0; d < timeline_->devices.size(); ++d) {
    const auto& spans = timeline_->devices[d].spans;
    for (const core::OpSpan& s : spans)
      if (s.end_s > last_end) {
        last_end = s.end_s;
        last = {static_cast<int>(d), s.stream, s.index};
      }
  }
  std::vector<OpKey> path;
  // Each step moves to an op that ends no later than the current one starts, so the walk terminates;
  // the bound guards against zero-length cycles in malformed timelines.
  const std::int64_t bound = timeline_->program->total_ops() + 1;
  for (OpKey cur = last; cur.valid() && static_cast<std::int64_t>(path.size()) < bound;) {
    path.push_back(cur);
    OpKey best;
    double best_end = -1;
    for (const OpKey& p : predecessors(cur)) {
      double e = span(p).end_s;
      if (e > best_end) {
        best_end = e;
        best = p;
      }
    }
    cur = best;
  }
  std::reverse(path.begin(), path.end());
  return path;
}

}  // namespace piper::gui
