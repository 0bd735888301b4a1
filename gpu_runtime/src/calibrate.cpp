// Measured per-op times -> piper-calibration entries (median per op class), and the MPI gather that
// lets one rank write them for a distributed run.
#include "piper/runtime/calibrate.hpp"

#include <algorithm>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>

#include "piper/core/readiness.hpp"

namespace piper::runtime {

using core::OpKind;
using nlohmann::json;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

void CalibrationRecorder::add_step(const std::vector<core::DeviceTimeline>& devices) {
  if (static_cast<int>(devices.size()) != program_.num_devices)
    throw std::invalid_argument(
        fmt::format("calibration: {} measured devices for a program of {}", devices.size(), program_.num_devices));
  struct Pair {
    double send = -1, recv = -1;
    const core::Op* op = nullptr;
  };
  struct Instance {
    double shortest = 0;
    int members = 0, size = 0;
    const core::Op* op = nullptr;
  };
  // An occurrence is (pairing id, its meeting's first member: the sender, the group's first device):
  // who meets whom is core/readiness.hpp's rule.
  const core::PairIndex index(program_);
  std::map<std::pair<int, int>, Pair> pairs;          // (pairing id, sender)
  std::map<std::pair<int, int>, Instance> instances;  // (pairing id, first member)
  for (int d = 0; d < program_.num_devices; ++d) {
    const core::Plan& plan = program_.plan_for(d);
    const auto& spans = devices[static_cast<std::size_t>(d)].spans;
    if (static_cast<std::int64_t>(spans.size()) != plan.op_count())
      throw std::invalid_argument(
          fmt::format("calibration: device {} measured {} ops, its plan has {}", d, spans.size(), plan.op_count()));
    std::size_t flat = 0;
    for (std::size_t si = 0; si < plan.streams.size(); ++si)
      for (std::size_t oi = 0; oi < plan.streams[si].ops.size(); ++oi) {
        const core::Op& op = plan.streams[si].ops[oi];
        const core::OpRef at{static_cast<int>(si), static_cast<int>(oi)};
        const core::OpSpan& s = spans[flat++];
        const double seconds = std::max(0.0, s.end_s - s.start_s);
        if (op.kind == OpKind::Compute || op.kind == OpKind::Update) {
          samples_[Key{op.kind, op.pass, op.flops, op.memory_bytes, 0, 0}].push_back(seconds);
        } else if (op.kind == OpKind::Send || op.kind == OpKind::Recv) {
          const bool send = op.kind == OpKind::Send;
          const int sender = send ? d : index.counterpart(d, at).first;
          if (sender < 0) continue;
          Pair& p = pairs[{op.pair, sender}];
          (send ? p.send : p.recv) = seconds;
          if (send) p.op = &op;
        } else if (core::is_collective(op.kind)) {
          const std::vector<int> group = program_.group_of(op.family, d);
          if (group.empty()) continue;
          Instance& in = instances[{op.pair, group.front()}];
          in.shortest = in.members == 0 ? seconds : std::min(in.shortest, seconds);
          ++in.members;
          in.size = static_cast<int>(group.size());
          in.op = &op;
        }
      }
  }
  for (const auto& [k, p] : pairs)
    if (p.send >= 0 && p.recv >= 0 && p.op)
      samples_[Key{OpKind::Send, p.op->pass, 0, 0, p.op->bytes, 2}].push_back(std::min(p.send, p.recv));
  for (const auto& [k, in] : instances)
    if (in.members == in.size)
      samples_[Key{in.op->kind, in.op->pass, 0, 0, in.op->bytes, in.size}].push_back(in.shortest);
  ++steps_;
}

json CalibrationRecorder::to_json(const std::string& gpu, const json& measured) const {
  json entries = json::array();
  for (const auto& [k, v] : samples_) {
    json e{{"kind", core::to_string(k.kind)}, {"pass", k.pass == core::Pass::None ? "" : core::to_string(k.pass)}};
    if (k.kind == OpKind::Compute || k.kind == OpKind::Update) {
      e["flops"] = k.flops;
      e["memory_bytes"] = k.memory_bytes;
    } else {
      e["bytes"] = k.bytes;
      e["group_size"] = k.group_size;
    }
    e["seconds"] = median(v);
    entries.push_back(std::move(e));
  }
  json m = measured;
  m["steps"] = steps_;
  m["statistic"] = "median";
  return {{"format", "piper-calibration"},
          {"version", 1},
          {"gpu", gpu},
          {"measured", std::move(m)},
          {"entries", std::move(entries)}};
}

bool calibration_uses_step(int step_index, int steps) { return steps < 2 || step_index > 0; }

void check_calibrate_path(const std::string& path) {
  if (!path.empty() && std::filesystem::is_directory(path))
    throw std::invalid_argument(path + ": is a folder; --calibrate takes a file name");
}

void write_calibration_distributed(const std::string& path, const core::Program& program,
                                   const std::vector<core::DeviceTimeline>& mine, const std::string& gpu,
                                   const json& measured, RankGroup& group) {
  const int rank = group.rank(), size = group.size();
  // Flat doubles: per kept step, its span count then (start, end) per span (spans are in plan order).
  std::vector<double> flat;
  for (const auto& step : mine) {
    flat.push_back(static_cast<double>(step.spans.size()));
    for (const auto& s : step.spans) flat.insert(flat.end(), {s.start_s, s.end_s});
  }
  const auto [all, offsets, sizes] = group.gather(flat);
  if (rank != 0) return;
  CalibrationRecorder recorder(program);
  std::vector<std::size_t> at(static_cast<std::size_t>(size));
  for (int d = 0; d < size; ++d)
    at[static_cast<std::size_t>(d)] = static_cast<std::size_t>(offsets[static_cast<std::size_t>(d)]);
  for (std::size_t step = 0; step < mine.size(); ++step) {
    std::vector<core::DeviceTimeline> devices(static_cast<std::size_t>(size));
    for (int d = 0; d < size; ++d) {
      std::size_t& p = at[static_cast<std::size_t>(d)];
      const auto count = static_cast<std::size_t>(all.at(p++));
      // The plan order is (stream, index) flattened: rebuild the refs from the plan.
      const core::Plan& plan = program.plan_for(d);
      auto& spans = devices[static_cast<std::size_t>(d)].spans;
      for (std::size_t s = 0; s < plan.streams.size(); ++s)
        for (std::size_t i = 0; i < plan.streams[s].ops.size() && spans.size() < count; ++i, p += 2)
          spans.push_back({static_cast<std::int32_t>(s), static_cast<std::int32_t>(i), all.at(p), all.at(p + 1)});
    }
    recorder.add_step(devices);
  }
  try {
    core::write_file_atomically(path, recorder.to_json(gpu, measured).dump(1) + "\n");
  } catch (const std::exception& e) {
    throw std::invalid_argument(e.what());
  }
}

}  // namespace piper::runtime
