// The analytic engine: a discrete-event simulation of a Program with alpha-beta communication and no
// link contention, driven by ReadyTracker. Compute runs at the device's ComputeRates (engine.hpp).
#include <algorithm>
#include <map>

#include "piper/sim/engine.hpp"
#include "piper/sim/ready_tracker.hpp"

namespace piper::sim {

namespace {

using Activity = ReadyTracker::Activity;
constexpr std::size_t ix(std::int64_t i) { return static_cast<std::size_t>(i); }

class AnalyticEngine : public Engine {
 public:
  std::string name() const override { return "analytic"; }

  core::Timeline run(std::shared_ptr<const core::Program> program_ptr, const Cluster& cluster,
                     const CostModel& cost) override {
    return simulate(std::move(program_ptr), cluster, cost, nullptr);
  }
  bool supports_symmetry() const override { return true; }
  core::Timeline run_reduced(std::shared_ptr<const core::Program> program_ptr, const Cluster& cluster,
                             const CostModel& cost, const Symmetry& symmetry) override {
    return simulate(std::move(program_ptr), cluster, cost, &symmetry);
  }

 private:
  // Full simulation, or (symmetry set) the representatives only, expanded at the end.
  core::Timeline simulate(std::shared_ptr<const core::Program> program_ptr, const Cluster& cluster,
                          const CostModel& cost, const Symmetry* symmetry) {
    const core::Program& program = *program_ptr;
    const int n = program.num_devices;
    if (cluster.num_devices() < n)
      throw ClusterError("cluster '" + cluster.name + "' has " + std::to_string(cluster.num_devices()) +
                         " devices but the program needs " + std::to_string(n));
    core::Timeline timeline =
        symmetry ? empty_timeline(program_ptr, "analytic", *symmetry) : empty_timeline(program_ptr, "analytic");
    std::vector<std::vector<std::int32_t>> span_base(program.plans.size());
    for (std::size_t p = 0; p < program.plans.size(); ++p) span_base[p] = stream_span_base(program.plans[p]);

    ReadyTracker tracker(program, symmetry);
    // Compute speed per device with and without communication running (SM sharing or partition).
    const std::vector<ComputeRates> rates = compute_rates(program, cluster);
    std::vector<std::int32_t> comm_active(ix(n), 0);
    std::vector<std::vector<std::int32_t>> computes(ix(n));  // running compute activities per device
    GpuSharing sharing(cost.gpu_of_devices(), n);

    struct Running {
      Activity activity;
      double remaining = 0;  // compute: work left at full speed (seconds), as of `since`
      double rate = 1;
      double since = 0;
      std::uint32_t version = 0;
    };
    std::vector<Running> running;
    std::vector<std::int32_t> free_slots;
    // Pending ends, bucketed by time. Data-parallel replicas end their ops at identical times, so
    // distinct times are far fewer than events: a small ordered map of buckets replaces a binary heap
    // over every event, which at 16K devices no longer fits in cache. A bucket keeps push order, the
    // (time, push sequence) order of the heap it replaces, so results are unchanged.
    struct Pending {
      std::int32_t slot;
      std::uint32_t version;
    };
    std::map<double, std::vector<Pending>> events;

    auto span = [&](int device, core::OpRef r) -> core::OpSpan& {
      const auto& base = span_base[ix(program.plan_of_device[ix(device)])];
      return timeline.devices[ix(device)].spans[ix(base[ix(r.stream)] + r.index)];
    };
    auto op_of = [&](int device, core::OpRef r) -> const core::Op& {
      return program.plan_for(device).streams[ix(r.stream)].ops[ix(r.index)];
    };
    auto rate_of = [&](int device) {
      return (comm_active[ix(device)] > 0 ? rates[ix(device)].with_comm : rates[ix(device)].idle) /
             sharing.divisor(device);
    };
    // Running compute on `device` continues at its current rate from `now`.
    auto reschedule = [&](int device, double now) {
      const double rate = rate_of(device);
      for (std::int32_t slot : computes[ix(device)]) {
        Running& r = running[ix(slot)];
        r.remaining = std::max(0.0, r.remaining - (now - r.since) * r.rate);
        r.rate = rate;
        r.since = now;
        r.version += 1;
        events[now + r.remaining / rate].push_back({slot, r.version});
      }
    };
    // Comm started or ended on `device`: running compute there changes speed.
    auto set_comm = [&](int device, int delta, double now) {
      const int before = comm_active[ix(device)];
      comm_active[ix(device)] += delta;
      const int after = comm_active[ix(device)];
      const ComputeRates& rr = rates[ix(device)];
      if ((before > 0) != (after > 0) && rr.idle != rr.with_comm) reschedule(device, now);
    };
    // `device` began or stopped computing: the devices sharing its GPU change speed.
    auto share_changed = [&](const std::vector<int>& devices, double now) {
      for (int d : devices) reschedule(d, now);
    };

    std::vector<Activity> ready;
    double now = 0;
    while (true) {
      ready.clear();
      tracker.take_ready(ready);
      for (Activity& a : ready) {
        std::int32_t slot;
        if (!free_slots.empty()) {
          slot = free_slots.back();
          free_slots.pop_back();
        } else {
          slot = static_cast<std::int32_t>(running.size());
          running.emplace_back();
        }
        Running& r = running[ix(slot)];
        r.activity = std::move(a);
        r.version += 1;
        r.since = now;
        for (const auto& [d, ref] : r.activity.members) span(d, ref).start_s = now;
        double end = now;
        if (r.activity.kind == Activity::Kind::Compute) {
          const auto [d, ref] = r.activity.members.front();
          r.remaining = cost.compute_seconds(program, d, op_of(d, ref));
          if (sharing.enabled() && computes[ix(d)].empty()) share_changed(sharing.busy(d), now);
          r.rate = rate_of(d);
          end = now + r.remaining / r.rate;
          computes[ix(d)].push_back(slot);
        } else if (r.activity.kind == Activity::Kind::Transfer) {
          const auto [src, send] = r.activity.members[0];
          const int dst = r.activity.members[1].first;
          end = now + cost.transfer_seconds(op_of(src, send), src, tracker.transfer_receiver(r.activity));
          set_comm(src, +1, now);
          set_comm(dst, +1, now);
        } else {
          const auto [d0, ref0] = r.activity.members.front();
          end = now + cost.collective_op_seconds(op_of(d0, ref0), tracker.collective_ranks(r.activity));
          for (const auto& m : r.activity.members) set_comm(m.first, +1, now);
        }
        tracker.started(r.activity, now);
        events[end].push_back({slot, r.version});
      }
      // Stale events (compute rescheduled by a speed change) must not advance the clock.
      auto live = [&](const Pending& e) { return e.version == running[ix(e.slot)].version; };
      while (!events.empty() && std::none_of(events.begin()->second.begin(), events.begin()->second.end(), live))
        events.erase(events.begin());
      if (events.empty()) break;
      // Finish everything that ends at the next event time (including ends pushed at that same time
      // while finishing), then release dependents once.
      const auto bucket = events.begin();
      now = bucket->first;
      for (std::size_t k = 0; k < bucket->second.size(); ++k) {
        const Pending e = bucket->second[k];  // by value: pushes below may grow this bucket
        Running& r = running[ix(e.slot)];
        if (e.version != r.version) continue;  // rescheduled by a speed change
        r.version += 1;
        for (const auto& [d, ref] : r.activity.members) span(d, ref).end_s = now;
        if (r.activity.kind == Activity::Kind::Compute) {
          const int d = r.activity.members.front().first;
          auto& list = computes[ix(d)];
          list.erase(std::find(list.begin(), list.end(), e.slot));
          if (sharing.enabled() && list.empty()) share_changed(sharing.idle(d), now);
        } else {
          for (const auto& m : r.activity.members) set_comm(m.first, -1, now);
        }
        tracker.finished(r.activity, now);
        free_slots.push_back(e.slot);
      }
      events.erase(bucket);
    }
    if (!tracker.done()) tracker.throw_stuck();
    timeline.step_time_s = 0;
    for (const auto& dt : timeline.devices)
      for (const auto& sp : dt.spans) timeline.step_time_s = std::max(timeline.step_time_s, sp.end_s);
    if (symmetry) {
      fill_memory(timeline, symmetry->representative);
      expand_timeline(timeline, *symmetry);
    } else {
      fill_memory(timeline);
    }
    return timeline;
  }
};

}  // namespace

std::unique_ptr<Engine> make_analytic_engine() { return std::make_unique<AnalyticEngine>(); }

}  // namespace piper::sim
