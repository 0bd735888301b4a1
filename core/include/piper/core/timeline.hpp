// Timeline: what a simulated or measured step looked like — per device, per stream, op spans with
// start and end times, plus memory over time. Reports, Chrome traces and the GUI are functions of it.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "piper/core/program.hpp"

namespace piper::core {

// One executed op: it points into program->plan_for(device).streams[stream].ops[index].
struct OpSpan {
  std::int32_t stream = 0;
  std::int32_t index = 0;
  double start_s = 0;
  double end_s = 0;
};

// Device memory in use from `time_s` on (bytes), with the part held by each BufferKind.
struct MemorySample {
  double time_s = 0;
  std::int64_t bytes = 0;
};

struct DeviceTimeline {
  std::vector<OpSpan> spans;            // every op of the device's plan once; sorted by (stream, index)
  std::vector<MemorySample> memory;     // step function, sorted by time
  std::int64_t peak_memory_bytes = 0;
  double peak_memory_time_s = 0;
};

struct Timeline {
  std::string source;                   // "simgrid", "analytic", "measured"
  std::shared_ptr<const Program> program;
  double step_time_s = 0;               // end of the last op on any device
  std::vector<DeviceTimeline> devices;  // indexed by device id

  const Op& op(int device, const OpSpan& s) const {
    return program->plan_for(device).streams.at(static_cast<std::size_t>(s.stream)).ops.at(static_cast<std::size_t>(s.index));
  }
};

// Chrome trace event format (opens in Perfetto / chrome://tracing): one process per device, one thread
// per stream, ops as complete ("X") events named by their label, flow arrows from each SEND to its
// RECV, and memory as a counter track per device. Times in microseconds. Predicted and measured
// timelines share this writer.
void write_chrome_trace(const Timeline& timeline, std::ostream& out);

}  // namespace piper::core
