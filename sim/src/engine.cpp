// Engine registry and the engine-independent parts of a run: the timeline layout and memory tracking.
#include "piper/sim/engine.hpp"

#include <algorithm>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "piper/core/error.hpp"

namespace piper::sim {

Engine::~Engine() = default;

core::Timeline Engine::run_reduced(std::shared_ptr<const core::Program> program, const Cluster& cluster,
                                   const CostModel& cost, const Symmetry&) {
  return run(std::move(program), cluster, cost);
}

void expand_timeline(core::Timeline& timeline, const Symmetry& symmetry) {
  for (std::size_t d = 0; d < timeline.devices.size(); ++d) {
    const int rep = symmetry.representative_of(static_cast<int>(d));
    if (rep != static_cast<int>(d)) timeline.devices[d] = timeline.devices[static_cast<std::size_t>(rep)];
  }
}

namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, EngineFactory> factories;
};

Registry& registry() {
  static Registry r;
  static std::once_flag builtins;
  std::call_once(builtins, [] {
    r.factories["analytic"] = [] { return make_analytic_engine(); };
    r.factories["simgrid"] = [] { return make_simgrid_engine(); };
  });
  return r;
}

}  // namespace

void register_engine(const std::string& name, EngineFactory factory) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.factories[name] = std::move(factory);
}

std::vector<std::string> engine_names() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& [name, f] : r.factories) out.push_back(name);
  return out;
}

std::unique_ptr<Engine> make_engine(const std::string& name) {
  EngineFactory factory;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    auto it = r.factories.find(name);
    if (it == r.factories.end()) {
      std::string list;
      for (const auto& [n, f] : r.factories) list += (list.empty() ? "" : ", ") + n;
      throw core::Error(fmt::format("--engine '{}': unknown engine (expected one of: {})", name, list));
    }
    factory = it->second;
  }
  return factory();
}

std::vector<std::int32_t> stream_span_base(const core::Plan& plan) {
  std::vector<std::int32_t> base;
  std::int32_t n = 0;
  for (const auto& s : plan.streams) {
    base.push_back(n);
    n += static_cast<std::int32_t>(s.ops.size());
  }
  base.push_back(n);
  return base;
}

GpuSharing::GpuSharing(const std::vector<int>& gpu_of_devices, int devices)
    : gpu_of_(gpu_of_devices.begin(),
              gpu_of_devices.begin() + std::min<std::ptrdiff_t>(devices, std::ssize(gpu_of_devices))) {
  for (std::size_t d = 0; d < gpu_of_.size(); ++d) {
    const auto g = static_cast<std::size_t>(gpu_of_[d]);
    if (devices_.size() <= g) devices_.resize(g + 1);
    devices_[g].push_back(static_cast<int>(d));
    enabled_ = enabled_ || devices_[g].size() > 1;
  }
  busy_.assign(devices_.size(), 0);
}

const std::vector<int>& GpuSharing::change(int d, int delta) {
  const auto g = static_cast<std::size_t>(gpu_of_.at(static_cast<std::size_t>(d)));
  busy_[g] += delta;
  return devices_[g];
}

core::Timeline empty_timeline(std::shared_ptr<const core::Program> program, const std::string& source,
                              const Symmetry& symmetry) {
  core::Timeline t;
  t.source = source;
  t.program = program;
  t.devices.resize(static_cast<std::size_t>(program->num_devices));
  for (int rep : symmetry.representative) {
    const auto& plan = program->plan_for(rep);
    auto& spans = t.devices[static_cast<std::size_t>(rep)].spans;
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i)
        spans.push_back({static_cast<std::int32_t>(s), static_cast<std::int32_t>(i), 0, 0});
  }
  return t;
}

core::Timeline empty_timeline(std::shared_ptr<const core::Program> program, const std::string& source) {
  core::Timeline t;
  t.source = source;
  t.program = program;
  t.devices.resize(static_cast<std::size_t>(program->num_devices));
  // Devices of one plan share the span layout: build it once per plan (each device's engine writes
  // take their own copy).
  std::vector<core::SharedVector<core::OpSpan>> layout(program->plans.size());
  for (std::size_t p = 0; p < program->plans.size(); ++p) {
    const auto& plan = program->plans[p];
    for (std::size_t s = 0; s < plan.streams.size(); ++s)
      for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i)
        layout[p].push_back({static_cast<std::int32_t>(s), static_cast<std::int32_t>(i), 0, 0});
  }
  for (int d = 0; d < program->num_devices; ++d)
    t.devices[static_cast<std::size_t>(d)].spans =
        layout[static_cast<std::size_t>(program->plan_of_device[static_cast<std::size_t>(d)])];
  return t;
}

void fill_memory(core::Timeline& timeline) {
  std::vector<int> all(timeline.devices.size());
  for (std::size_t d = 0; d < all.size(); ++d) all[d] = static_cast<int>(d);
  fill_memory(timeline, all);
}

void fill_memory(core::Timeline& timeline, const std::vector<int>& devices) {
  const core::Program& program = *timeline.program;
  std::vector<std::vector<std::int32_t>> bases(program.plans.size());
  for (std::size_t p = 0; p < program.plans.size(); ++p) bases[p] = stream_span_base(program.plans[p]);
  struct Change {
    double time_s;
    std::int64_t bytes;  // negative: free (sorted first at equal times)
  };
  std::vector<Change> changes;
  for (const int device : devices) {
    const auto d = static_cast<std::size_t>(device);
    const int p = program.plan_of_device[d];
    const core::Plan& plan = program.plans[static_cast<std::size_t>(p)];
    const auto& base = bases[static_cast<std::size_t>(p)];
    core::DeviceTimeline& dt = timeline.devices[d];
    auto span = [&](core::OpRef r) -> const core::OpSpan& {
      return dt.spans[static_cast<std::size_t>(base[static_cast<std::size_t>(r.stream)] + r.index)];
    };
    std::int64_t persistent = 0;
    changes.clear();
    for (const core::Buffer& b : plan.buffers) {
      if (b.persistent()) {
        persistent += b.bytes;
        continue;
      }
      changes.push_back({span(b.alloc).start_s, b.bytes});
      if (b.free.stream >= 0) changes.push_back({span(b.free).end_s, -b.bytes});
    }
    std::sort(changes.begin(), changes.end(), [](const Change& a, const Change& b) {
      return a.time_s < b.time_s || (a.time_s == b.time_s && a.bytes < b.bytes);
    });
    dt.memory.clear();
    dt.memory.reserve(changes.size() + 1);
    dt.memory.push_back({0.0, persistent});
    std::int64_t bytes = persistent;
    dt.peak_memory_bytes = persistent;
    dt.peak_memory_time_s = 0;
    for (std::size_t i = 0; i < changes.size(); ++i) {
      bytes += changes[i].bytes;
      // One sample per distinct time: the level after every change at that time.
      if (i + 1 < changes.size() && changes[i + 1].time_s == changes[i].time_s) {
        // Peaks inside a tie (alloc before a free at the same time cannot happen: frees sort first).
        if (bytes > dt.peak_memory_bytes) dt.peak_memory_bytes = bytes, dt.peak_memory_time_s = changes[i].time_s;
        continue;
      }
      if (dt.memory.back().time_s == changes[i].time_s)
        dt.memory.back().bytes = bytes;
      else
        dt.memory.push_back({changes[i].time_s, bytes});
      if (bytes > dt.peak_memory_bytes) dt.peak_memory_bytes = bytes, dt.peak_memory_time_s = changes[i].time_s;
    }
  }
}

}  // namespace piper::sim
