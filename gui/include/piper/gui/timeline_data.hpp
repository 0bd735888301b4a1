// GUI-side index of a Timeline: per device row, one lane per stream with spans sorted by start and a
// prefix maximum of end times, so painting and hit-testing are binary searches over visible ranges.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "piper/core/timeline.hpp"

namespace piper::gui {

// Colour classes of ops: compute passes, the update, and each communication kind.
enum class SpanKind : std::uint8_t {
  F,
  B,
  BI,
  BW,
  Update,
  Send,
  Recv,
  AllReduce,
  ReduceScatter,
  AllGather,
  AllToAll,
  Other
};
constexpr int kSpanKindCount = 12;
SpanKind span_kind(const core::Op& op);
const char* span_kind_name(SpanKind k);   // "F", "B", "BI", "BW", "UPD", "SEND", ...
const char* span_kind_short(SpanKind k);  // label prefix: "F", "B", "BI", "BW", "U", "S", "R", "AR", ...
SpanKind span_kind_from_name(const std::string& first_word);  // inverse of span_kind_name (Other if unknown)

// Measured lane vs the predicted lane of the same stream: ops matched by label, in order.
struct LaneError {
  int matched = 0, unmatched = 0;  // measured spans with / without a predicted op of that label
  double measured_s = 0;           // summed durations of the matched measured spans
  double predicted_s = 0;          // and of their predicted ops
  double mean_abs_error = 0;       // mean over matched ops of |measured - predicted| / predicted
  double total_error() const { return predicted_s > 0 ? measured_s / predicted_s - 1 : 0; }
};

struct Lane {
  std::string name;  // stream name; measured lanes are prefixed "measured "
  int stream = -1;   // stream index in the device's plan; -1 for measured lanes
  bool measured = false;
  std::vector<double> start_s, end_s;
  std::vector<double> max_end_s;         // max_end_s[i] = max(end_s[0..i]): binary search for the first visible span
  std::vector<std::uint8_t> kind;        // SpanKind
  std::vector<std::int16_t> microbatch;  // MB tag or -1 (labels "F3")
  std::vector<std::int32_t> op_index;  // predicted: index into plan.streams[stream].ops; measured: into Track::measured
  std::vector<std::int32_t> pos_of_op;  // predicted: op index -> position in this lane
  // Measured lanes overlaid on a predicted row: the predicted lane of the same stream (-1: none) and,
  // per span, the position of the predicted op it matched (-1: none); see overlay_measured.
  int predicted_lane = -1;
  std::vector<std::int32_t> predicted_pos;
  LaneError error;
  std::size_t size() const { return start_s.size(); }
  // Positions [first, last) of spans that intersect [t0_s, t1_s).
  std::pair<std::size_t, std::size_t> visible(double t0_s, double t1_s) const;
  // Position of the span containing t_s (nearest within tolerance_s), or -1.
  std::int64_t hit(double t_s, double tolerance_s) const;
};

struct DeviceRow {
  int device = 0;
  std::vector<Lane> lanes;
  std::vector<int> lane_of_stream;  // plan stream -> lane index (-1 if none)
};

// A measured (or foreign) event read from a Chrome trace, kept for tooltips.
struct MeasuredEvent {
  std::string name;
  double start_s = 0, end_s = 0;
  int device = 0;
  std::string thread;
};

// One timeline as the view draws it (the primary scenario, a compared one, or a measured trace alone).
struct Track {
  std::string title;
  std::shared_ptr<const core::Timeline> timeline;  // null for a measured-only track
  std::vector<DeviceRow> rows;                     // rows[i].device == i for predicted tracks
  double step_time_s = 0;
  std::int64_t hbm_bytes = 0;  // HBM per device (0: unknown)
  std::int64_t span_count = 0;
  std::vector<MeasuredEvent> measured;
  // Per device (indexed by device id): each BufferKind's own peak, as the report gives it (empty: unknown).
  std::vector<std::map<std::string, std::int64_t>> peak_bytes_by_kind;
  const core::Op* op(int row, int lane, std::size_t pos) const;
};

// Builds the track of a timeline (O(ops log ops)); safe to call off the GUI thread.
std::shared_ptr<Track> make_track(std::shared_ptr<const core::Timeline> timeline, std::string title,
                                  std::int64_t hbm_bytes);

// Label drawn on a span when wide enough: kind short name + microbatch ("F3", "BW7", "AR").
std::string span_label(SpanKind kind, int microbatch);

}  // namespace piper::gui
