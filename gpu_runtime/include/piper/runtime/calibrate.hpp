// `piper run --calibrate`: measured per-op times of a run as a `piper-calibration` file (the format
// sim::Calibration reads, sim/include/piper/sim/cost_model.hpp), for every backend: each gives the
// measured spans of its devices' steps (the executor's host clock, or CUDA events), this turns them
// into entries.
#pragma once

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/program.hpp"
#include "piper/core/timeline.hpp"
#include "piper/runtime/rank_group.hpp"

namespace piper::runtime {

// Collects the measured steps of a run and summarises them per op class (median over instances):
//  * COMPUTE and UPD: one entry per (kind, pass, flops, memory_bytes), from the op's span;
//  * SEND: one entry per (pass, bytes), group_size 2, from each SEND/RECV pair: the shorter of the two
//    spans, since the side that arrives last at the rendezvous waits least (its span is the transfer);
//  * collectives: one entry per (kind, pass, bytes, group size), from each instance (one DAG node on
//    one group): the shortest member's span, for the same reason.
// Ops that share those fields share an entry (the simulator's lookup matches on them).
class CalibrationRecorder {
 public:
  explicit CalibrationRecorder(const core::Program& program) : program_(program) {}
  // One step: the spans of every device of the program (index = device), each sorted by (stream,
  // index) as the executor returns them. Throws std::invalid_argument when a device is missing.
  void add_step(const std::vector<core::DeviceTimeline>& devices);
  int steps() const { return steps_; }
  // {"format": "piper-calibration", "version": 1, "gpu": gpu, "entries": [...], "measured": {...}};
  // `measured` (informational, ignored by the reader) says how the times were taken.
  nlohmann::json to_json(const std::string& gpu, const nlohmann::json& measured) const;

 private:
  struct Key {
    core::OpKind kind;
    core::Pass pass;
    double flops;
    std::int64_t memory_bytes, bytes;
    int group_size;
    auto operator<=>(const Key&) const = default;
  };
  const core::Program& program_;
  std::map<Key, std::vector<double>> samples_;
  int steps_ = 0;
};

// Which of `steps` measured steps a calibration uses: all but the first when there are two or more
// (the first one pays for allocation and warm-up), else the only one.
bool calibration_uses_step(int step_index, int steps);

// Refuses a --calibrate path that can never be written, before any step runs (std::invalid_argument).
void check_calibrate_path(const std::string& path);

// Rank 0 of `group` gathers every rank's kept steps (`mine`: this rank's spans, one
// DeviceTimeline per kept step; rank r is device r) and writes the calibration atomically. Collective.
// A failed write throws std::invalid_argument on rank 0 only.
void write_calibration_distributed(const std::string& path, const core::Program& program,
                                   const std::vector<core::DeviceTimeline>& mine, const std::string& gpu,
                                   const nlohmann::json& measured, RankGroup& group);

}  // namespace piper::runtime
