// Reads Chrome trace JSON into a measured Track and overlays it on a predicted Track.
#include "piper/gui/chrome_trace.hpp"

#include <algorithm>
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
  if (j.is_array()) events = &j;
  else if (j.is_object() && j.contains("traceEvents") && j["traceEvents"].is_array()) events = &j["traceEvents"];
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
  auto add = [&](long long pid, long long tid, const std::string& name, const std::string& cat, double ts_us, double dur_us) {
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
      add(pid, tid, b.value("name", ""), b.value("cat", ""), b["ts"].get<double>(), e["ts"].get<double>() - b["ts"].get<double>());
    }
  }
  if (track->measured.empty()) throw core::Error(where + ": the Chrome trace has no complete ('X') events");

  std::map<int, DeviceRow> rows;
  for (auto& [key, indices] : lanes) {
    DeviceRow& row = rows[key.first];
    row.device = key.first;
    std::sort(indices.begin(), indices.end(), [&](std::int32_t a, std::int32_t b) {
      return track->measured[static_cast<std::size_t>(a)].start_s < track->measured[static_cast<std::size_t>(b)].start_s;
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

void overlay_measured(Track& predicted, const Track& measured) {
  // Measured lanes keep op_index into their own event list: copy the events and shift the indices.
  const auto offset = static_cast<std::int32_t>(predicted.measured.size());
  predicted.measured.insert(predicted.measured.end(), measured.measured.begin(), measured.measured.end());
  for (const DeviceRow& mrow : measured.rows) {
    auto it = std::find_if(predicted.rows.begin(), predicted.rows.end(), [&](const DeviceRow& r) { return r.device == mrow.device; });
    if (it == predicted.rows.end()) {
      predicted.rows.push_back(DeviceRow{mrow.device, {}, {}});
      it = predicted.rows.end() - 1;
    }
    for (Lane lane : mrow.lanes) {
      lane.name = "measured " + lane.name;
      for (auto& i : lane.op_index) i += offset;
      it->lanes.push_back(std::move(lane));
    }
  }
  predicted.span_count += measured.span_count;
  predicted.step_time_s = std::max(predicted.step_time_s, measured.step_time_s);
}

}  // namespace piper::gui
