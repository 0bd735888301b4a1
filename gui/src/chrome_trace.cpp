// Reads Chrome trace JSON into a measured Track and overlays it on a predicted Track.
#include "piper/gui/chrome_trace.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <numeric>
#include <regex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"

namespace piper::gui {

using nlohmann::json;

namespace {

int microbatch_of(const std::string& name) {
  static const std::regex mb(R"((?:^|\s)mb(\d+))");
  std::smatch m;
  return std::regex_search(name, m, mb) ? std::stoi(m[1].str()) : -1;
}

SpanKind kind_of(const std::string& name, const std::string& cat) {
  const std::string first = name.substr(0, name.find(' '));
  SpanKind k = span_kind_from_name(first);
  if (k == SpanKind::Other) k = span_kind_from_name(cat);
  return k;
}

}  // namespace

std::shared_ptr<Track> parse_chrome_trace(const std::string& text, const std::string& where, const std::string& title) {
  json j;
  try {
    j = core::parse_json(text, where);
  } catch (const json::parse_error& e) {
    throw core::Error(where + ": not a Chrome trace (JSON error at byte " + std::to_string(e.byte) + ")");
  }
  const json* events = nullptr;
  if (j.is_array())
    events = &j;
  else if (j.is_object() && j.contains("traceEvents") && j["traceEvents"].is_array())
    events = &j["traceEvents"];
  if (!events) throw core::Error(where + ": not a Chrome trace (no 'traceEvents' array)");

  auto track = std::make_shared<Track>();
  track->title = title.empty() ? where : title;
  std::map<long long, int> device_of_pid;
  std::map<std::pair<long long, long long>, std::string> thread_names;
  static const std::regex device_name(R"((?:device|gpu|rank|GPU|Device|Rank)\s*(\d+))");
  for (const json& e : *events) {
    if (!e.is_object() || e.value("ph", "") != "M") continue;
    const long long pid = e.value("pid", 0LL);
    const std::string name = e.contains("args") && e["args"].is_object() ? e["args"].value("name", "") : "";
    if (e.value("name", "") == "process_name") {
      std::smatch m;
      if (std::regex_search(name, m, device_name)) device_of_pid[pid] = std::stoi(m[1].str());
    } else if (e.value("name", "") == "thread_name") {
      thread_names[{pid, e.value("tid", 0LL)}] = name;
    }
  }
  // (device, tid) -> event indices; "B"/"E" pairs are matched per thread with a stack.
  std::map<std::pair<int, long long>, std::vector<std::int32_t>> lanes;
  std::map<std::pair<long long, long long>, std::vector<json>> open;
  auto device = [&](long long pid) {
    auto it = device_of_pid.find(pid);
    return it != device_of_pid.end() ? it->second : static_cast<int>(pid);
  };
  auto add = [&](long long pid, long long tid, const std::string& name, const std::string& cat, double ts_us,
                 double dur_us) {
    MeasuredEvent ev;
    ev.name = name;
    ev.start_s = ts_us * 1e-6;
    ev.end_s = (ts_us + std::max(0.0, dur_us)) * 1e-6;
    ev.device = device(pid);
    auto tn = thread_names.find({pid, tid});
    ev.thread = tn != thread_names.end() ? tn->second : "thread " + std::to_string(tid);
    if (!cat.empty() && name.find(' ') == std::string::npos && span_kind_from_name(name) == SpanKind::Other)
      ev.name = cat + " " + name;
    lanes[{ev.device, tid}].push_back(static_cast<std::int32_t>(track->measured.size()));
    track->measured.push_back(std::move(ev));
  };
  for (const json& e : *events) {
    if (!e.is_object()) continue;
    const std::string ph = e.value("ph", "");
    if (ph != "X" && ph != "B" && ph != "E") continue;
    if (!e.contains("ts") || !e["ts"].is_number()) throw core::Error(where + ": event without a numeric 'ts'");
    const long long pid = e.value("pid", 0LL), tid = e.value("tid", 0LL);
    if (ph == "X") {
      add(pid, tid, e.value("name", ""), e.value("cat", ""), e["ts"].get<double>(), e.value("dur", 0.0));
    } else if (ph == "B") {
      open[{pid, tid}].push_back(e);
    } else {
      auto& stack = open[{pid, tid}];
      if (stack.empty()) continue;
      const json b = stack.back();
      stack.pop_back();
      add(pid, tid, b.value("name", ""), b.value("cat", ""), b["ts"].get<double>(),
          e["ts"].get<double>() - b["ts"].get<double>());
    }
  }
  if (track->measured.empty()) throw core::Error(where + ": the Chrome trace has no complete ('X') events");

  std::map<int, DeviceRow> rows;
  for (auto& [key, indices] : lanes) {
    DeviceRow& row = rows[key.first];
    row.device = key.first;
    std::sort(indices.begin(), indices.end(), [&](std::int32_t a, std::int32_t b) {
      return track->measured[static_cast<std::size_t>(a)].start_s <
             track->measured[static_cast<std::size_t>(b)].start_s;
    });
    Lane& lane = row.lanes.emplace_back();
    lane.measured = true;
    lane.name = track->measured[static_cast<std::size_t>(indices.front())].thread;
    double max_end = -1e300;
    for (std::int32_t i : indices) {
      const MeasuredEvent& ev = track->measured[static_cast<std::size_t>(i)];
      lane.start_s.push_back(ev.start_s);
      lane.end_s.push_back(ev.end_s);
      max_end = std::max(max_end, ev.end_s);
      lane.max_end_s.push_back(max_end);
      lane.kind.push_back(static_cast<std::uint8_t>(kind_of(ev.name, "")));
      lane.microbatch.push_back(static_cast<std::int16_t>(microbatch_of(ev.name)));
      lane.op_index.push_back(i);
      track->step_time_s = std::max(track->step_time_s, ev.end_s);
    }
    track->span_count += static_cast<std::int64_t>(indices.size());
  }
  for (auto& [d, row] : rows) track->rows.push_back(std::move(row));
  return track;
}

std::shared_ptr<Track> read_chrome_trace(const std::string& path, const std::string& title) {
  return parse_chrome_trace(core::read_input_file(path), path, title);
}

void match_measured_lane(Track& track, int row, int lane_index, const std::string& stream) {
  DeviceRow& r = track.rows.at(static_cast<std::size_t>(row));
  Lane& m = r.lanes.at(static_cast<std::size_t>(lane_index));
  m.predicted_lane = -1;
  m.predicted_pos.assign(m.size(), -1);
  m.error = LaneError{};
  for (std::size_t l = 0; l < r.lanes.size(); ++l)
    if (!r.lanes[l].measured && r.lanes[l].name == stream) m.predicted_lane = static_cast<int>(l);
  if (m.predicted_lane < 0 || !track.timeline) {
    m.error.unmatched = static_cast<int>(m.size());
    return;
  }
  // The k-th measured span named L is the k-th predicted op labelled L (both in start order).
  const Lane& p = r.lanes[static_cast<std::size_t>(m.predicted_lane)];
  std::map<std::string, std::vector<std::int32_t>> by_label;
  for (std::size_t i = 0; i < p.size(); ++i)
    by_label[track.op(row, m.predicted_lane, i)->label].push_back(static_cast<std::int32_t>(i));
  std::map<std::string, std::size_t> next;
  double abs_error_sum = 0;
  for (std::size_t i = 0; i < m.size(); ++i) {
    const std::string& name = track.measured.at(static_cast<std::size_t>(m.op_index[i])).name;
    auto found = by_label.find(name);
    std::size_t& k = next[name];
    if (found == by_label.end() || k >= found->second.size()) {
      ++m.error.unmatched;
      continue;
    }
    const std::int32_t pos = found->second[k++];
    m.predicted_pos[i] = pos;
    const double measured = m.end_s[i] - m.start_s[i];
    const double predicted = p.end_s[static_cast<std::size_t>(pos)] - p.start_s[static_cast<std::size_t>(pos)];
    ++m.error.matched;
    m.error.measured_s += measured;
    m.error.predicted_s += predicted;
    if (predicted > 0) abs_error_sum += std::abs(measured - predicted) / predicted;
  }
  if (m.error.matched > 0) m.error.mean_abs_error = abs_error_sum / m.error.matched;
}

void overlay_measured(Track& predicted, const Track& measured) {
  // Measured lanes keep op_index into their own event list: copy the events and shift the indices.
  const auto offset = static_cast<std::int32_t>(predicted.measured.size());
  predicted.measured.insert(predicted.measured.end(), measured.measured.begin(), measured.measured.end());
  for (const DeviceRow& mrow : measured.rows) {
    auto it = std::find_if(predicted.rows.begin(), predicted.rows.end(),
                           [&](const DeviceRow& r) { return r.device == mrow.device; });
    if (it == predicted.rows.end()) {
      predicted.rows.push_back(DeviceRow{mrow.device, {}, {}});
      it = predicted.rows.end() - 1;
    }
    for (Lane lane : mrow.lanes) {
      const std::string stream = lane.name;
      lane.name = "measured " + lane.name;
      for (auto& i : lane.op_index) i += offset;
      const auto row = static_cast<int>(it - predicted.rows.begin());
      it->lanes.push_back(std::move(lane));
      match_measured_lane(predicted, row, static_cast<int>(it->lanes.size()) - 1, stream);
    }
  }
  predicted.span_count += measured.span_count;
  predicted.step_time_s = std::max(predicted.step_time_s, measured.step_time_s);
}

}  // namespace piper::gui
