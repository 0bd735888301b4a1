// Report: the headline figures of a simulated (or measured) step — step time, throughput, MFU,
// bubbles, memory and OOM, overlap, critical path — computed from a Timeline alone.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/timeline.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/symmetry.hpp"

namespace piper::sim {

struct DeviceReport {
  int device = 0;
  double busy_s = 0;                // union of the device's COMPUTE/UPD spans
  double idle_s = 0;                // step_time - busy
  double bubble_fraction = 0;       // idle / step_time
  double comm_s = 0;                // union of the device's communication spans
  double comm_compute_overlap = 0;  // time with both compute and communication running / comm_s (0 if no comm)
  double tp_comm_s = 0;             // TP collectives inside COMPUTE ops (part of busy_s, not of comm_s)
  std::int64_t peak_memory_bytes = 0;
  double peak_memory_time_s = 0;
  std::map<std::string, std::int64_t> peak_bytes_by_kind;  // BufferKind name -> its own peak over time
  std::int64_t hbm_bytes = 0;
  bool oom = false;
};

struct MemoryHolder {
  std::string kind;        // BufferKind name
  std::int64_t bytes = 0;  // held at the OOM time
};

// The first device (lowest id) whose memory exceeds its HBM.
struct OomReport {
  int device = -1;
  double time_s = 0;       // first time its memory exceeds HBM
  std::int64_t bytes = 0;  // in use at that time
  std::int64_t hbm_bytes = 0;
  int devices_over = 0;                       // how many devices exceed their HBM at some time
  std::vector<MemoryHolder> largest_holders;  // by kind, largest first
};

// The chain of ops that sets the step time: from the last-ending op back through, at each step, the
// dependency that ended last (stream predecessor, waits, and for transfers and collectives the same
// for every partner).
struct CriticalPathStep {
  int device = 0;
  std::string stream;
  std::string label;
  double start_s = 0, end_s = 0;
};
struct CriticalPath {
  double compute_s = 0;  // time on the path in COMPUTE/UPD ops
  double tp_s = 0;       // of which TP collectives inside those ops
  double comm_s = 0;     // in transfers and collectives
  double wait_s = 0;     // gaps between a step's predecessor end and its start
  std::int64_t ops = 0;
  std::map<int, double> seconds_by_device;  // compute time on the path, per device
  std::vector<CriticalPathStep> steps;      // in time order (at most kMaxSteps: the last ones)
  static constexpr std::size_t kMaxSteps = 256;
};

struct CompileStats {
  double compile_time_s = 0;
  std::int64_t dag_nodes = 0;
  std::int64_t compiler_peak_rss_bytes = 0;
};

struct Report {
  std::string engine;
  std::string model;
  std::string cluster;
  // The training runtime the kernels were costed for (Cluster::runtime, attention_kernel): "" for the
  // defaults (fused, the tables' attention), else e.g. "runtime eager, attention fa2".
  std::string runtime;
  int devices = 0;
  int microbatches = 0;
  double step_time_s = 0;
  double tokens_per_step = 0;
  double tokens_per_s = 0;
  double model_flops = 0;      // COMPUTE F/B/BI/BW FLOPs over all devices (no update)
  double mfu = 0;              // model_flops / (step_time * sum of peak FLOP/s)
  double bubble_fraction = 0;  // mean of the devices' bubble fractions
  double compile_time_s = 0;
  double simulate_time_s = 0;
  // How the engine ran: "full: <why>" or "reduced: <classes>" (symmetry.hpp); set by simulate().
  std::string simulation;
  std::int64_t dag_nodes = 0;
  std::int64_t total_ops = 0;
  bool oom = false;
  std::int64_t peak_memory_bytes = 0;  // max over devices
  OomReport oom_details;
  std::vector<DeviceReport> per_device;
  CriticalPath critical_path;

  nlohmann::json to_json() const;
  static Report from_json(const nlohmann::json& j);
  // A readable multi-line summary (per-device rows elided past `max_devices`).
  std::string to_text(int max_devices = 16) const;
};

// Needs timeline.program, spans and memory (fill_memory). simulate_time_s is left for the caller.
// With `symmetry` (the classes a reduced run used), each class's rows are computed once and copied.
// With `cost` (the model the timeline was simulated with), the TP collectives that COMPUTE ops run
// inside themselves are reported apart (tp_comm_s, critical_path.tp_s); without it they stay 0.
Report make_report(const core::Timeline& timeline, const Cluster& cluster, const CompileStats& compile = {},
                   const Symmetry* symmetry = nullptr, const CostModel* cost = nullptr);
CompileStats compile_stats_of(const core::Program& program);
// With `symmetry`, only representatives are scanned for the last-ending op (each is the lowest device
// of its class, so the same op is found). `cost` as for make_report.
CriticalPath critical_path(const core::Timeline& timeline, const Symmetry* symmetry = nullptr,
                           const CostModel* cost = nullptr);

}  // namespace piper::sim
