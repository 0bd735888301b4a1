// Chrome trace export of a Timeline (simulated or measured): processes = devices, threads = streams.
#include "piper/core/timeline.hpp"

#include <cmath>
#include <cstdint>
#include <ostream>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace piper::core {

namespace {

// Escapes a label for a JSON string (labels are ASCII in practice; json handles the rest).
std::string quoted(const std::string& s) { return nlohmann::json(s).dump(); }

// Times are rounded to whole nanoseconds and written as microseconds with three decimals. A span's
// duration is its rounded end less its rounded start (not its rounded length), so spans that touch
// (one ends where the next starts) never overlap by a nanosecond in the trace.
std::int64_t ns(double seconds) { return std::llround(seconds * 1e9); }
std::string us(std::int64_t ns) {
  const std::int64_t magnitude = ns < 0 ? -ns : ns;
  return fmt::format("{}{}.{:03}", ns < 0 ? "-" : "", magnitude / 1000, magnitude % 1000);
}
std::string us(double seconds) { return us(ns(seconds)); }

}  // namespace

void write_chrome_trace(const Timeline& timeline, std::ostream& out) {
  const Program& program = *timeline.program;
  // Device -> position tables for the sets SEND/RECV ops use, so flow ids cost O(1) per op.
  std::unordered_map<DeviceSetId, std::vector<int>> positions;
  auto peer_of = [&](const Op& op, int device) {
    auto [it, fresh] = positions.try_emplace(op.device_set);
    if (fresh) {
      it->second.assign(static_cast<std::size_t>(program.num_devices), -1);
      const auto& set = program.device_sets.at(static_cast<std::size_t>(op.device_set));
      for (std::size_t i = 0; i < set.size(); ++i) it->second[static_cast<std::size_t>(set[i])] = static_cast<int>(i);
    }
    int pos = it->second[static_cast<std::size_t>(device)];
    const auto& peers = program.device_sets.at(static_cast<std::size_t>(op.peer_set));
    return pos >= 0 && static_cast<std::size_t>(pos) < peers.size() ? peers[static_cast<std::size_t>(pos)] : -1;
  };

  out << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"source\":" << quoted(timeline.source)
      << ",\"model\":" << quoted(program.model_name) << "},\"traceEvents\":[\n";
  bool first = true;
  auto emit = [&](const std::string& event) {
    if (!first) out << ",\n";
    first = false;
    out << event;
  };
  for (std::size_t d = 0; d < timeline.devices.size(); ++d) {
    const int device = static_cast<int>(d);
    const Plan& plan = program.plan_for(device);
    emit(fmt::format(R"({{"ph":"M","pid":{},"name":"process_name","args":{{"name":"device {}"}}}})", d, d));
    emit(fmt::format(R"({{"ph":"M","pid":{},"name":"process_sort_index","args":{{"sort_index":{}}}}})", d, d));
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      emit(fmt::format(R"({{"ph":"M","pid":{},"tid":{},"name":"thread_name","args":{{"name":{}}}}})", d, s,
                       quoted(plan.streams[s].name)));
    for (const OpSpan& span : timeline.devices[d].spans) {
      const Op& op = timeline.op(device, span);
      const std::string name = op.label.empty() ? to_string(op.kind) : op.label;
      emit(fmt::format(
          R"({{"ph":"X","pid":{},"tid":{},"name":{},"cat":"{}","ts":{},"dur":{},"args":{{"kind":"{}","node":{},"index":{}}}}})",
          d, span.stream, quoted(name), to_string(op.kind), us(span.start_s), us(ns(span.end_s) - ns(span.start_s)),
          to_string(op.kind), op.node, span.index));
      // Flow arrow SEND -> RECV: both ends carry the id (sender device, pairing id: core/readiness.hpp).
      if (op.kind == OpKind::Send || op.kind == OpKind::Recv) {
        const int peer = peer_of(op, device);
        if (peer < 0) continue;
        const int sender = op.kind == OpKind::Send ? device : peer;
        const std::int64_t id = static_cast<std::int64_t>(sender) * (std::int64_t{1} << 32) + op.pair;
        if (op.kind == OpKind::Send)
          emit(fmt::format(R"({{"ph":"s","pid":{},"tid":{},"name":"transfer","cat":"p2p","id":{},"ts":{}}})", d,
                           span.stream, id, us(span.start_s)));
        else
          emit(fmt::format(R"({{"ph":"f","bp":"e","pid":{},"tid":{},"name":"transfer","cat":"p2p","id":{},"ts":{}}})",
                           d, span.stream, id, us(span.end_s)));
      }
    }
    for (const MemorySample& m : timeline.devices[d].memory)
      emit(fmt::format(R"({{"ph":"C","pid":{},"name":"memory","ts":{},"args":{{"MiB":{:.3f}}}}})", d, us(m.time_s),
                       static_cast<double>(m.bytes) / (1024.0 * 1024.0)));
  }
  out << "\n]}\n";
}

}  // namespace piper::core
