// Reads Chrome trace JSON into a measured Track and overlays it on a predicted Track.
#include "piper/gui/chrome_trace.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <limits>
#include <fstream>
#include <map>
#include <numeric>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"
#include "piper/core/limits.hpp"

namespace piper::gui {

using nlohmann::json;

namespace {

const std::regex& microbatch_pattern() {
  static const std::regex mb(R"((?:^|\s)mb(\d+))");
  return mb;
}

// Reading an event's fields: json's value() threw type_error for a wrong type ("type must be
// string, but is number", naming neither file nor event), std::stoi threw "stoi" for a device or
// microbatch number past int, a pid past int wrapped onto another device, and times of 1e300 us
// were drawn as infinities. Each field is now checked where it is read, its event named.
[[noreturn]] void bad_event(const std::string& where, std::size_t i, const std::string& field, const std::string& why,
                            const json& v) {
  throw core::Error(fmt::format("{}: traceEvents[{}]{}{}: {}, got {}", where, i, field.empty() ? "" : ".", field, why,
                                core::printable(v.dump(), 40)));
}

std::string string_field(const json& e, const char* key, const std::string& where, std::size_t i) {
  if (!e.contains(key)) return {};
  if (!e.at(key).is_string()) bad_event(where, i, key, "expected a string", e.at(key));
  return e.at(key).get<std::string>();
}

// pid: an integer that fits an int (it becomes a device number unless a process_name names one);
// tid: any integer (a lane key).
long long id_field(const json& e, const char* key, const std::string& where, std::size_t i) {
  if (!e.contains(key)) return 0;
  const json& v = e.at(key);
  const bool pid = std::string(key) == "pid";
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<unsigned long long>() > LLONG_MAX) ||
      (pid && (v.get<long long>() < INT_MIN || v.get<long long>() > INT_MAX)))
    bad_event(where, i, key,
              pid ? fmt::format("expected an integer in [{}, {}]", INT_MIN, INT_MAX) : "expected an integer", v);
  return v.get<long long>();
}

// Times in microseconds, finite and >= 0: a start at most 1e18 (profilers write epoch microseconds,
// about 1.8e15 in 2027), a duration at most 1e12 (1e6 s, a calibration's bound on an op's time).
double time_field(const json& e, const char* key, double max, const std::string& where, std::size_t i) {
  if (!e.contains(key)) throw core::Error(fmt::format("{}: traceEvents[{}]: event without a '{}'", where, i, key));
  const json& v = e.at(key);
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0 || v.get<double>() > max)
    bad_event(where, i, key, fmt::format("expected a time in [0, {:g}] microseconds", max), v);
  return v.get<double>();
}

// The number `pattern` captures in `text` ("device 3", "mb12"), or -1 when there is none. A device
// number past int is refused (std::stoi threw "stoi"); a microbatch number past it only labels a span
// and is read as none.
int number_in(const std::regex& pattern, const std::string& text, const std::string& where, std::size_t i,
              const char* field, bool strict) {
  std::smatch m;
  if (!std::regex_search(text, m, pattern)) return -1;
  const std::string digits = m[1].str();
  if (digits.size() > 9) {
    if (!strict) return -1;
    throw core::Error(fmt::format("{}: traceEvents[{}].{}: the number {} in '{}' is out of range", where, i, field,
                                  core::printable(digits, 20), core::printable(text, 60)));
  }
  return std::stoi(digits);
}

// The metadata ("M") events: which device a pid is (its process_name: "device 3", "GPU 3", "rank 3")
// and each thread's name. Every event's string fields are checked here, once.
struct TraceNames {
  std::map<long long, int> device_of_pid;
  std::map<std::pair<long long, long long>, std::string> thread_names;
};

TraceNames trace_names(const json& events, const std::string& where) {
  TraceNames out;
  static const std::regex device_name(R"((?:device|gpu|rank|GPU|Device|Rank)\s*(\d+))");
  for (std::size_t i = 0; i < events.size(); ++i) {
    const json& e = events[i];
    if (!e.is_object()) continue;
    for (const char* key : {"ph", "name", "cat"}) (void)string_field(e, key, where, i);
    if (e.value("ph", "") != "M") continue;
    const long long pid = id_field(e, "pid", where, i);
    std::string name;
    if (e.contains("args") && e["args"].is_object() && e["args"].contains("name")) {
      if (!e["args"]["name"].is_string()) bad_event(where, i, "args.name", "expected a string", e["args"]["name"]);
      name = e["args"]["name"].get<std::string>();
    }
    if (e.value("name", "") == "process_name") {
      if (const int d = number_in(device_name, name, where, i, "args.name", true); d >= 0) out.device_of_pid[pid] = d;
    } else if (e.value("name", "") == "thread_name") {
      out.thread_names[{pid, id_field(e, "tid", where, i)}] = name;
    }
  }
  return out;
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
  const TraceNames names = trace_names(*events, where);
  // (device, tid) -> event indices; "B"/"E" pairs are matched per thread with a stack.
  std::map<std::pair<int, long long>, std::vector<std::int32_t>> lanes;
  std::map<std::pair<long long, long long>, std::vector<std::pair<std::size_t, double>>> open;  // "B": event, ts
  auto device = [&](long long pid) {
    auto it = names.device_of_pid.find(pid);
    return it != names.device_of_pid.end() ? it->second : static_cast<int>(pid);
  };
  std::size_t event_index = 0;    // the event being read, for add()'s messages
  std::vector<int> microbatches;  // of each measured event, from its name
  auto add = [&](long long pid, long long tid, const std::string& name, const std::string& cat, double ts_us,
                 double dur_us) {
    MeasuredEvent ev;
    microbatches.push_back(number_in(microbatch_pattern(), name, where, event_index, "name", false));
    ev.name = name;
    ev.start_s = ts_us * 1e-6;
    ev.end_s = (ts_us + dur_us) * 1e-6;
    ev.device = device(pid);
    auto tn = names.thread_names.find({pid, tid});
    ev.thread = tn != names.thread_names.end() ? tn->second : "thread " + std::to_string(tid);
    if (!cat.empty() && name.find(' ') == std::string::npos && span_kind_from_name(name) == SpanKind::Other)
      ev.name = cat + " " + name;
    lanes[{ev.device, tid}].push_back(static_cast<std::int32_t>(track->measured.size()));
    track->measured.push_back(std::move(ev));
  };
  for (std::size_t i = 0; i < events->size(); ++i) {
    const json& e = (*events)[i];
    if (!e.is_object()) continue;
    const std::string ph = e.value("ph", "");
    if (ph != "X" && ph != "B" && ph != "E") continue;
    const double ts = time_field(e, "ts", 1e18, where, i);
    const long long pid = id_field(e, "pid", where, i), tid = id_field(e, "tid", where, i);
    event_index = i;
    if (ph == "X") {
      add(pid, tid, e.value("name", ""), e.value("cat", ""), ts,
          e.contains("dur") ? time_field(e, "dur", 1e12, where, i) : 0.0);
    } else if (ph == "B") {
      open[{pid, tid}].push_back({i, ts});
    } else {
      auto& stack = open[{pid, tid}];
      if (stack.empty()) continue;
      const auto [b, begin] = stack.back();
      stack.pop_back();
      if (ts < begin)
        bad_event(where, i, "ts", fmt::format("ends before its 'B' event (traceEvents[{}], ts {})", b, begin), e["ts"]);
      event_index = b;
      const json& be = (*events)[b];
      add(pid, tid, be.value("name", ""), be.value("cat", ""), begin, ts - begin);
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
      // A microbatch past int16 is drawn without one (-1) rather than wrapped to another's number.
      lane.microbatch.push_back(static_cast<std::int16_t>(microbatches[static_cast<std::size_t>(i)] <=
                                                                  std::numeric_limits<std::int16_t>::max()
                                                              ? microbatches[static_cast<std::size_t>(i)]
                                                              : -1));
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
