// Builds the per-lane sorted span arrays the timeline view paints and hit-tests.
#include "piper/gui/timeline_data.hpp"

#include <algorithm>
#include <numeric>

namespace piper::gui {

namespace {
constexpr const char* kNames[kSpanKindCount] = {
    "F", "B", "BI", "BW", "UPD", "SEND", "RECV", "ALL_REDUCE", "REDUCE_SCATTER", "ALL_GATHER", "ALL_TO_ALL", "OTHER"};
constexpr const char* kShort[kSpanKindCount] = {"F", "B", "BI", "BW", "U", "S", "R", "AR", "RS", "AG", "A2A", ""};
}  // namespace

SpanKind span_kind(const core::Op& op) {
  using core::OpKind;
  switch (op.kind) {
    case OpKind::Compute:
      switch (op.pass) {
        case core::Pass::F:
          return SpanKind::F;
        case core::Pass::B:
          return SpanKind::B;
        case core::Pass::BI:
          return SpanKind::BI;
        case core::Pass::BW:
          return SpanKind::BW;
        default:
          return SpanKind::Other;
      }
    case OpKind::Update:
      return SpanKind::Update;
    case OpKind::Send:
      return SpanKind::Send;
    case OpKind::Recv:
      return SpanKind::Recv;
    case OpKind::AllReduce:
      return SpanKind::AllReduce;
    case OpKind::ReduceScatter:
      return SpanKind::ReduceScatter;
    case OpKind::AllGather:
      return SpanKind::AllGather;
    case OpKind::AllToAll:
      return SpanKind::AllToAll;
  }
  return SpanKind::Other;
}

const char* span_kind_name(SpanKind k) { return kNames[static_cast<int>(k)]; }
const char* span_kind_short(SpanKind k) { return kShort[static_cast<int>(k)]; }

SpanKind span_kind_from_name(const std::string& w) {
  for (int i = 0; i < kSpanKindCount; ++i)
    if (w == kNames[i]) return static_cast<SpanKind>(i);
  if (w == "COMPUTE") return SpanKind::Other;
  return SpanKind::Other;
}

std::string span_label(SpanKind kind, int microbatch) {
  std::string s = span_kind_short(kind);
  if (microbatch >= 0) s += std::to_string(microbatch);
  return s;
}

std::pair<std::size_t, std::size_t> Lane::visible(double t0_s, double t1_s) const {
  // max_end_s is non-decreasing even when spans overlap (measured traces), start_s is sorted.
  auto first = static_cast<std::size_t>(std::upper_bound(max_end_s.begin(), max_end_s.end(), t0_s) - max_end_s.begin());
  auto last = static_cast<std::size_t>(std::lower_bound(start_s.begin(), start_s.end(), t1_s) - start_s.begin());
  return {first, std::max(first, last)};
}

std::int64_t Lane::hit(double t_s, double tolerance_s) const {
  auto [first, last] = visible(t_s - tolerance_s, t_s + tolerance_s);
  std::int64_t best = -1;
  double best_distance = tolerance_s;
  for (std::size_t i = first; i < last; ++i) {
    double d = t_s < start_s[i] ? start_s[i] - t_s : (t_s > end_s[i] ? t_s - end_s[i] : 0.0);
    if (best < 0 ? d <= best_distance : d < best_distance) {
      best_distance = d;
      best = static_cast<std::int64_t>(i);
    }
  }
  return best;
}

const core::Op* Track::op(int row, int lane, std::size_t pos) const {
  if (!timeline) return nullptr;
  const Lane& l = rows.at(static_cast<std::size_t>(row)).lanes.at(static_cast<std::size_t>(lane));
  if (l.measured) return nullptr;
  const auto& plan = timeline->program->plan_for(rows[static_cast<std::size_t>(row)].device);
  return &plan.streams.at(static_cast<std::size_t>(l.stream)).ops.at(static_cast<std::size_t>(l.op_index[pos]));
}

std::shared_ptr<Track> make_track(std::shared_ptr<const core::Timeline> timeline, std::string title,
                                  std::int64_t hbm_bytes) {
  auto track = std::make_shared<Track>();
  track->title = std::move(title);
  track->timeline = timeline;
  track->step_time_s = timeline->step_time_s;
  track->hbm_bytes = hbm_bytes;
  const core::Program& program = *timeline->program;
  track->rows.resize(timeline->devices.size());
  for (std::size_t d = 0; d < timeline->devices.size(); ++d) {
    DeviceRow& row = track->rows[d];
    row.device = static_cast<int>(d);
    const core::Plan& plan = program.plan_for(static_cast<int>(d));
    const auto& spans = timeline->devices[d].spans;
    // Spans are sorted by (stream, index): split them into per-stream runs.
    std::vector<std::size_t> begin(plan.streams.size() + 1, spans.size());
    for (std::size_t i = spans.size(); i-- > 0;) begin[static_cast<std::size_t>(spans[i].stream)] = i;
    for (std::size_t s = plan.streams.size(); s-- > 0;) begin[s] = std::min(begin[s], begin[s + 1]);
    row.lane_of_stream.assign(plan.streams.size(), -1);
    for (std::size_t s = 0; s < plan.streams.size(); ++s) {
      std::size_t b = begin[s], e = begin[s + 1];
      if (b == e) continue;
      row.lane_of_stream[s] = static_cast<int>(row.lanes.size());
      Lane& lane = row.lanes.emplace_back();
      lane.name = plan.streams[s].name;
      lane.stream = static_cast<int>(s);
      std::vector<std::size_t> order(e - b);
      std::iota(order.begin(), order.end(), b);
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t x, std::size_t y) { return spans[x].start_s < spans[y].start_s; });
      const std::size_t n = order.size();
      lane.start_s.resize(n);
      lane.end_s.resize(n);
      lane.max_end_s.resize(n);
      lane.kind.resize(n);
      lane.microbatch.resize(n);
      lane.op_index.resize(n);
      lane.pos_of_op.assign(plan.streams[s].ops.size(), -1);
      double max_end = -1e300;
      for (std::size_t k = 0; k < n; ++k) {
        const core::OpSpan& sp = spans[order[k]];
        const core::Op& op = plan.streams[s].ops.at(static_cast<std::size_t>(sp.index));
        lane.start_s[k] = sp.start_s;
        lane.end_s[k] = sp.end_s;
        max_end = std::max(max_end, sp.end_s);
        lane.max_end_s[k] = max_end;
        lane.kind[k] = static_cast<std::uint8_t>(span_kind(op));
        lane.microbatch[k] = static_cast<std::int16_t>(op.microbatch);
        lane.op_index[k] = sp.index;
        lane.pos_of_op[static_cast<std::size_t>(sp.index)] = static_cast<std::int32_t>(k);
      }
      track->span_count += static_cast<std::int64_t>(n);
    }
  }
  return track;
}

}  // namespace piper::gui
