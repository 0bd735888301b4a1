// The analytic engine: a discrete-event simulation of a Program with alpha-beta communication whose
// bandwidth part is shared fairly among concurrent ops on a link or on an SM partition, driven by
// ReadyTracker. Compute runs at the device's ComputeRates (engine.hpp).
#include <algorithm>
#include <cmath>
#include <map>

#include "piper/sim/engine.hpp"
#include "piper/sim/ready_tracker.hpp"

namespace piper::sim {

namespace {

using Activity = ReadyTracker::Activity;
constexpr std::size_t ix(std::int64_t i) { return static_cast<std::size_t>(i); }

// One simulation. Activities run as fluid work: a running activity has `remaining` seconds of work
// at full speed, progressing at `rate` from `since` on; when a rate changes, the work done at the old
// rate is charged and the end event is pushed again (older events go stale by version).
//  * Compute: rate compute_rates(d).compute(k) / GpuSharing divisor, k the comm kernels running on d.
//  * Communication with a modelled time: its latency part (alpha terms) runs first, on no link, then
//    its bandwidth part at rate min(1, 1/n_l over its links l (n_l: comm activities on l; each
//    device has an NVLink out/in and a NIC out/in link), comm_capacity(d) / demand(d) over its
//    sending devices d under an sm_partition (demand: the NVLink-equivalents of comm traffic they
//    send: a transfer's sender, every rank of a collective)).
//    A bottleneck fair share: with two flows on one link each runs at 1/2, as max-min gives them.
//  * Calibrated or overridden communication, and device copies inside one GPU: fixed durations.
class Run {
 public:
  Run(std::shared_ptr<const core::Program> program_ptr, const Cluster& cluster, const CostModel& cost,
      const Symmetry* symmetry)
      : program_(*program_ptr),
        cost_(cost),
        symmetry_(symmetry),
        tracker_(program_, symmetry),
        rates_(compute_rates(program_, cluster)),
        sharing_(cost.gpu_of_devices(), program_.num_devices),
        node_of_(cluster.node_of_devices()) {
    const int n = program_.num_devices;
    timeline_ = symmetry ? empty_timeline(program_ptr, "analytic", *symmetry) : empty_timeline(program_ptr, "analytic");
    span_base_.resize(program_.plans.size());
    for (std::size_t p = 0; p < program_.plans.size(); ++p) span_base_[p] = stream_span_base(program_.plans[p]);
    comm_active_.assign(ix(n), 0);
    computes_.resize(ix(n));
    link_users_.resize(ix(4 * n));
    sm_demand_.assign(ix(n), 0.0);
    sm_users_.resize(ix(n));
    for (int d = 0; d < n; ++d) sm_limited_ = sm_limited_ || std::isfinite(rates_[ix(d)].comm_capacity);
  }

  core::Timeline simulate() {
    std::vector<Activity> ready;
    while (true) {
      ready.clear();
      tracker_.take_ready(ready);
      for (Activity& a : ready) start(std::move(a));
      // Stale events (rescheduled by a speed change) must not advance the clock.
      auto live = [&](const Pending& e) { return e.version == running_[ix(e.slot)].version; };
      while (!events_.empty() && std::none_of(events_.begin()->second.begin(), events_.begin()->second.end(), live))
        events_.erase(events_.begin());
      if (events_.empty()) break;
      // Finish everything that ends at the next event time (including ends pushed at that same time
      // while finishing), then release dependents once.
      const auto bucket = events_.begin();
      now_ = bucket->first;
      for (std::size_t k = 0; k < bucket->second.size(); ++k) {
        const Pending e = bucket->second[k];  // by value: pushes below may grow this bucket
        if (e.version != running_[ix(e.slot)].version) continue;
        if (e.join)
          join(e.slot);
        else
          finish(e.slot);
      }
      events_.erase(bucket);
    }
    if (!tracker_.done()) tracker_.throw_stuck();
    timeline_.step_time_s = 0;
    for (const auto& dt : timeline_.devices)
      for (const auto& sp : dt.spans) timeline_.step_time_s = std::max(timeline_.step_time_s, sp.end_s);
    if (symmetry_) {
      fill_memory(timeline_, symmetry_->representative);
      expand_timeline(timeline_, *symmetry_);
    } else {
      fill_memory(timeline_);
    }
    return std::move(timeline_);
  }

 private:
  struct Running {
    Activity activity;
    double remaining = 0;  // work left at full speed (seconds), as of `since`
    double rate = 1;
    double since = 0;  // comm: the end of its latency part
    std::uint32_t version = 0;
    bool shared = false;              // comm whose bandwidth part is shared (links, SMs)
    bool joined = false;              // shared comm past its latency part, on its links
    std::vector<std::int32_t> links;  // link ids it occupies (4 per device)
    double sm_demand = 0;             // NVLink-equivalents of traffic it runs on each of its devices
  };
  // Pending ends, bucketed by time. Data-parallel replicas end their ops at identical times, so
  // distinct times are far fewer than events: a small ordered map of buckets replaces a binary heap
  // over every event, which at 16K devices no longer fits in cache. A bucket keeps push order, the
  // (time, push sequence) order of the heap it replaces, so results are unchanged.
  struct Pending {
    std::int32_t slot;
    std::uint32_t version;
    bool join = false;  // the end of a shared comm's latency part: it takes its links then
  };

  const core::Program& program_;
  const CostModel& cost_;
  const Symmetry* symmetry_;
  ReadyTracker tracker_;
  std::vector<ComputeRates> rates_;
  GpuSharing sharing_;
  std::vector<int> node_of_;
  core::Timeline timeline_;
  std::vector<std::vector<std::int32_t>> span_base_;
  std::vector<std::int32_t> comm_active_;              // running comm activities per device
  std::vector<std::vector<std::int32_t>> computes_;    // running compute activities per device
  std::vector<std::vector<std::int32_t>> link_users_;  // running shared comm per link
  std::vector<double> sm_demand_;                      // per device, under an sm_partition
  std::vector<std::vector<std::int32_t>> sm_users_;    // shared comm per device, under an sm_partition
  bool sm_limited_ = false;
  std::vector<Running> running_;
  std::vector<std::int32_t> free_slots_;
  std::map<double, std::vector<Pending>> events_;
  std::vector<std::int32_t> affected_;
  double now_ = 0;

  core::OpSpan& span(int device, core::OpRef r) {
    const auto& base = span_base_[ix(program_.plan_of_device[ix(device)])];
    return timeline_.devices[ix(device)].spans[ix(base[ix(r.stream)] + r.index)];
  }
  const core::Op& op_of(int device, core::OpRef r) const {
    return program_.plan_for(device).streams[ix(r.stream)].ops[ix(r.index)];
  }
  double compute_rate(int device) const {
    return rates_[ix(device)].compute(comm_active_[ix(device)]) / sharing_.divisor(device);
  }
  double comm_rate(const Running& r) const {
    double rate = 1;
    for (std::int32_t l : r.links) rate = std::min(rate, 1.0 / static_cast<double>(link_users_[ix(l)].size()));
    if (sm_limited_ && r.sm_demand > 0)
      for (std::size_t i = 0; i < sm_members(r); ++i) {
        const int d = r.activity.members[i].first;
        rate = std::min(rate, rates_[ix(d)].comm_capacity / sm_demand_[ix(d)]);
      }
    return rate;
  }
  // The members whose SMs move the data: a transfer's sender, every rank of a collective.
  static std::size_t sm_members(const Running& r) {
    return r.activity.kind == Activity::Kind::Transfer ? 1 : r.activity.members.size();
  }
  // The activity in `slot` runs at `rate` from now on: charge the work done, push its new end.
  void set_rate(std::int32_t slot, double rate) {
    Running& r = running_[ix(slot)];
    if (now_ > r.since) {
      r.remaining = std::max(0.0, r.remaining - (now_ - r.since) * r.rate);
      r.since = now_;
    }
    r.rate = rate;
    r.version += 1;
    events_[r.since + r.remaining / rate].push_back({slot, r.version});
  }
  void reschedule_computes(int device) {
    const double rate = compute_rate(device);
    for (std::int32_t slot : computes_[ix(device)]) set_rate(slot, rate);
  }
  // Communication started or ended on `device`: its compute may change speed.
  void set_comm(int device, int delta) {
    const int before = comm_active_[ix(device)];
    comm_active_[ix(device)] += delta;
    const ComputeRates& rr = rates_[ix(device)];
    if (rr.compute(before) != rr.compute(comm_active_[ix(device)])) reschedule_computes(device);
  }

  void start(Activity&& a) {
    std::int32_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      slot = static_cast<std::int32_t>(running_.size());
      running_.emplace_back();
    }
    Running& r = running_[ix(slot)];
    r.activity = std::move(a);
    r.version += 1;
    r.since = now_;
    r.rate = 1;
    r.shared = false;
    r.joined = false;
    r.links.clear();
    r.sm_demand = 0;
    for (const auto& [d, ref] : r.activity.members) span(d, ref).start_s = now_;
    if (r.activity.kind == Activity::Kind::Compute) {
      const auto [d, ref] = r.activity.members.front();
      r.remaining = cost_.compute_seconds(program_, d, op_of(d, ref));
      if (sharing_.enabled() && computes_[ix(d)].empty())
        for (int e : sharing_.busy(d)) reschedule_computes(e);
      r.rate = compute_rate(d);
      computes_[ix(d)].push_back(slot);
    } else {
      for (const auto& m : r.activity.members) set_comm(m.first, +1);
      plan_comm(r);
    }
    tracker_.started(running_[ix(slot)].activity, now_);
    Running& q = running_[ix(slot)];
    if (q.shared && q.since > now_)
      events_[q.since].push_back({slot, q.version, true});
    else if (q.shared)
      join(slot);
    else
      events_[q.since + q.remaining / q.rate].push_back({slot, q.version});
  }

  // A shared comm's latency part ended: as in SimGrid (a timer, then the flow), it takes its links
  // and SMs only now, and its bandwidth part starts at its fair share.
  void join(std::int32_t slot) {
    occupy(slot, +1);
    Running& r = running_[ix(slot)];
    r.joined = true;
    r.version += 1;
    events_[r.since + r.remaining / r.rate].push_back({slot, r.version});
  }

  void finish(std::int32_t slot) {
    Running& r = running_[ix(slot)];
    r.version += 1;
    for (const auto& [d, ref] : r.activity.members) span(d, ref).end_s = now_;
    if (r.activity.kind == Activity::Kind::Compute) {
      const int d = r.activity.members.front().first;
      auto& list = computes_[ix(d)];
      list.erase(std::find(list.begin(), list.end(), slot));
      if (sharing_.enabled() && list.empty())
        for (int e : sharing_.idle(d)) reschedule_computes(e);
    } else {
      if (r.joined) occupy(slot, -1);
      for (const auto& m : r.activity.members) set_comm(m.first, -1);
    }
    tracker_.finished(running_[ix(slot)].activity, now_);
    free_slots_.push_back(slot);
  }

  // Work, latency, links and SM demand of a communication activity (Running::shared when its time
  // is the model's and it moves data over links).
  void plan_comm(Running& r) {
    const auto [d0, ref0] = r.activity.members.front();
    const core::Op& op = op_of(d0, ref0);
    double seconds = 0, latency = 0, bandwidth = 0;
    bool intra = false, inter = false;
    if (r.activity.kind == Activity::Kind::Transfer) {
      const int dst = tracker_.transfer_receiver(r.activity);
      seconds = cost_.transfer_seconds(op, d0, dst);
      r.shared = d0 != dst && !cost_.same_gpu(d0, dst) && seconds == cost_.p2p_seconds(d0, dst, op.bytes);
      if (r.shared) {
        latency = cost_.transfer_latency_seconds(op, d0, dst);
        bandwidth = cost_.bandwidth_bytes_per_s(d0, dst);
        (program_node(d0) == program_node(dst) ? intra : inter) = true;
      }
    } else {
      const std::vector<int>& ranks = tracker_.collective_ranks(r.activity);
      seconds = cost_.collective_op_seconds(op, ranks);
      r.shared = ranks.size() > 1 && !cost_.on_one_gpu(ranks) && op.bytes > 0 &&
                 seconds == cost_.collective_formula_seconds(op, ranks, op.bytes);
      if (r.shared) {
        latency = cost_.collective_latency_seconds(op, ranks);
        levels(ranks, intra, inter);
        bandwidth = intra ? cost_.nvlink_bytes_per_s(d0) : cost_.bandwidth_bytes_per_s(ranks[0], ranks[1]);
      }
    }
    if (!r.shared) {
      r.remaining = seconds;
      return;
    }
    r.since = now_ + latency;
    r.remaining = std::max(0.0, seconds - latency);
    // Links: a transfer's sender out and receiver in; every member's out and in for a collective.
    const bool transfer = r.activity.kind == Activity::Kind::Transfer;
    for (std::size_t i = 0; i < r.activity.members.size(); ++i) {
      const int d = r.activity.members[i].first;
      const bool out = !transfer || i == 0, in = !transfer || i == 1;
      if (intra && out) r.links.push_back(4 * d + 0);
      if (intra && in) r.links.push_back(4 * d + 1);
      if (inter && out) r.links.push_back(4 * d + 2);
      if (inter && in) r.links.push_back(4 * d + 3);
    }
    if (sm_limited_) {
      const double unit = cost_.nvlink_bytes_per_s(d0);
      r.sm_demand = unit > 0 ? std::min(1.0, bandwidth / unit) : 1.0;
    }
  }
  int program_node(int device) const { return node_of_[ix(device)]; }
  // Whether a group has two ranks on one node (NVLink traffic) and ranks on two nodes (NIC traffic).
  void levels(const std::vector<int>& ranks, bool& intra, bool& inter) const {
    std::vector<int> nodes;
    nodes.reserve(ranks.size());
    for (int d : ranks) nodes.push_back(program_node(d));
    std::sort(nodes.begin(), nodes.end());
    intra = std::adjacent_find(nodes.begin(), nodes.end()) != nodes.end();
    inter = nodes.front() != nodes.back();
  }

  // A shared comm activity takes (+1) or leaves (-1) its links and SMs; every shared comm activity
  // on them gets its new rate.
  void occupy(std::int32_t slot, int delta) {
    affected_.clear();
    const Running& r = running_[ix(slot)];
    for (std::int32_t l : r.links) {
      auto& users = link_users_[ix(l)];
      if (delta > 0)
        users.push_back(slot);
      else
        users.erase(std::find(users.begin(), users.end(), slot));
      affected_.insert(affected_.end(), users.begin(), users.end());
    }
    if (sm_limited_ && r.sm_demand > 0)
      for (std::size_t i = 0; i < sm_members(r); ++i) {
        const int d = r.activity.members[i].first;
        auto& users = sm_users_[ix(d)];
        sm_demand_[ix(d)] += delta * r.sm_demand;
        if (delta > 0)
          users.push_back(slot);
        else
          users.erase(std::find(users.begin(), users.end(), slot));
        affected_.insert(affected_.end(), users.begin(), users.end());
      }
    std::sort(affected_.begin(), affected_.end());
    affected_.erase(std::unique(affected_.begin(), affected_.end()), affected_.end());
    for (std::int32_t s : affected_) {
      Running& q = running_[ix(s)];
      const double rate = comm_rate(q);
      if (s == slot) {
        q.rate = rate;  // joining: join() pushes its end
      } else if (rate != q.rate) {
        set_rate(s, rate);
      }
    }
  }
};

class AnalyticEngine : public Engine {
 public:
  std::string name() const override { return "analytic"; }

  core::Timeline run(std::shared_ptr<const core::Program> program_ptr, const Cluster& cluster,
                     const CostModel& cost) override {
    return simulate(std::move(program_ptr), cluster, cost, nullptr);
  }
  // Exact under contention too: devices of a class see the same activities on their own links and
  // SMs (each is counted once per device in the quotient as in the full program; symmetry.hpp).
  bool supports_symmetry() const override { return true; }
  core::Timeline run_reduced(std::shared_ptr<const core::Program> program_ptr, const Cluster& cluster,
                             const CostModel& cost, const Symmetry& symmetry) override {
    return simulate(std::move(program_ptr), cluster, cost, &symmetry);
  }

 private:
  // Full simulation, or (symmetry set) the representatives only, expanded at the end.
  core::Timeline simulate(std::shared_ptr<const core::Program> program_ptr, const Cluster& cluster,
                          const CostModel& cost, const Symmetry* symmetry) {
    const int n = program_ptr->num_devices;
    if (cluster.num_devices() < n)
      throw ClusterError("cluster '" + cluster.name + "' has " + std::to_string(cluster.num_devices()) +
                         " devices but the program needs " + std::to_string(n));
    Run run(std::move(program_ptr), cluster, cost, symmetry);
    return run.simulate();
  }
};

}  // namespace

std::unique_ptr<Engine> make_analytic_engine() { return std::make_unique<AnalyticEngine>(); }

}  // namespace piper::sim
