// Run's activities (simgrid_run.hpp): each op the ReadyTracker releases starts as a compute timer
// (moved when the device's compute speed changes), a delay on no link, a transfer flow or a
// decomposed collective (simgrid_rounds.cpp), and finishes into the tracker, which frees the next.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "simgrid_run.hpp"

namespace piper::sim::simgrid_detail {

double Run::compute_rate(int d) const {
  const ComputeRates& r = rates_[static_cast<std::size_t>(d)];
  return r.compute(comm_active_[static_cast<std::size_t>(d)]) / sharing_.divisor(d);
}

void Run::start_compute(int live, int d, double seconds) {
  const int c = take(computes_, free_computes_);
  Compute& k = computes_[static_cast<std::size_t>(c)];
  k.live = live;
  k.device = d;
  k.remaining = seconds;
  k.since = now();
  if (sharing_.enabled() && computing_[static_cast<std::size_t>(d)].empty())
    for (int e : sharing_.busy(d)) compute_rate_changed(e);
  k.rate = compute_rate(d);
  computing_[static_cast<std::size_t>(d)].push_back(c);
  arm(c);
}

void Run::arm(int c) {
  Compute& k = computes_[static_cast<std::size_t>(c)];
  k.timer = at(k.since + k.remaining / k.rate, [this, c] { compute_done(c); });
}

void Run::compute_done(int c) {
  Compute& k = computes_[static_cast<std::size_t>(c)];
  auto& running = computing_[static_cast<std::size_t>(k.device)];
  running.erase(std::find(running.begin(), running.end(), c));
  k.timer = nullptr;  // SimGrid deletes a timer after running it
  if (sharing_.enabled() && running.empty())
    for (int e : sharing_.idle(k.device)) compute_rate_changed(e);
  finished_now_.push_back(k.live);
  free_computes_.push_back(c);
  pump();
}

// Device d's compute speed changed now: charge its running computes the work done at the old
// speed and move their end timers.
void Run::compute_rate_changed(int d) {
  const double t = now(), rate = compute_rate(d);
  for (int c : computing_[static_cast<std::size_t>(d)]) {
    Compute& k = computes_[static_cast<std::size_t>(c)];
    k.remaining = std::max(0.0, k.remaining - (t - k.since) * k.rate);
    k.since = t;
    k.rate = rate;
    k.timer->remove();
    arm(c);
  }
}

// Compute throughput of a device is ComputeRates::compute(k) while k communications run on it.
void Run::comm_delta(const Activity& a, int delta) {
  for (const auto& [d, r] : a.members) {
    int& c = comm_active_[static_cast<std::size_t>(d)];
    const int before = c;
    c += delta;
    const ComputeRates& rr = rates_[static_cast<std::size_t>(d)];
    if (rr.compute(before) != rr.compute(c)) compute_rate_changed(d);
  }
}

void Run::start(Activity a) {
  const int live = take(live_, free_live_);
  Live& L = live_[static_cast<std::size_t>(live)];
  L.activity = std::move(a);
  L.collective = -1;
  L.counts_as_comm = L.activity.kind != Activity::Kind::Compute;
  const double t = now();
  for (const auto& [d, r] : L.activity.members) times_[static_cast<std::size_t>(2 * tracker_.instance(d, r))] = t;
  tracker_.started(L.activity, t);
  if (L.counts_as_comm) comm_delta(L.activity, +1);

  const auto& [d0, r0] = L.activity.members.front();
  const core::Op& op = op_of(d0, r0);
  switch (L.activity.kind) {
    case Activity::Kind::Compute: {
      const double w = cost_.compute_seconds(program_, d0, op);
      if (w > 0)
        start_compute(live, d0, w);
      else
        finished_now_.push_back(live);
      break;
    }
    case Activity::Kind::Transfer: {
      const int src = d0, dst = L.activity.members.back().first;
      const double formula = cost_.p2p_seconds(src, dst, op.bytes);
      const double seconds = cost_.transfer_seconds(op, src, dst);
      // Calibrated or overridden, or a device copy inside one shared GPU: a delay on no link.
      if (seconds != formula || cost_.same_gpu(src, dst))
        seconds > 0 ? start_delay(live, seconds) : finished_now_.push_back(live);
      else if (src == dst)
        finished_now_.push_back(live);
      else
        start_comm(src, dst, static_cast<double>(op.bytes), platform_->route_latency_s(src, dst), SlotKind::Activity,
                   live);
      break;
    }
    case Activity::Kind::Collective: {
      std::vector<int> ranks;
      ranks.reserve(L.activity.members.size());
      for (const auto& m : L.activity.members) ranks.push_back(m.first);
      const double formula = cost_.collective_formula_seconds(op, ranks, op.bytes);
      const double seconds = cost_.collective_op_seconds(op, ranks);
      if (seconds != formula || cost_.on_one_gpu(ranks)) {
        seconds > 0 ? start_delay(live, seconds) : finished_now_.push_back(live);
        break;
      }
      const auto routed = cost_.routed_all_to_all(op, ranks, op.bytes);
      auto phases = routed ? simgrid_detail::decompose_routed_all_to_all(ranks, routed->nodes, routed->per_node,
                                                                         routed->direct_chunk, routed->ib_chunk,
                                                                         routed->forward_chunk)
                           : simgrid_detail::decompose_collective(
                                 op.kind, ranks, static_cast<double>(std::max<std::int64_t>(0, op.bytes)), node_of_);
      if (phases.empty()) {
        finished_now_.push_back(live);
        break;
      }
      const int c = take(collectives_, free_collectives_);
      CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
      run.live = live;
      run.phases = std::move(phases);
      run.phase = 0;
      live_[static_cast<std::size_t>(live)].collective = c;
      start_phase(c);
      break;
    }
  }
}

// An op that lasts `seconds` and occupies no link.
void Run::start_delay(int live, double seconds) {
  after(seconds, [this, live] {
    finished_now_.push_back(live);
    pump();
  });
}

void Run::finish(int live) {
  Live& L = live_[static_cast<std::size_t>(live)];
  const double t = now();
  for (const auto& [d, r] : L.activity.members) times_[static_cast<std::size_t>(2 * tracker_.instance(d, r) + 1)] = t;
  if (L.counts_as_comm) comm_delta(L.activity, -1);
  tracker_.finished(L.activity, t);
  L.activity.members.clear();
  free_live_.push_back(live);
}

// Starts everything ready; activities that take no time finish at once and may free more.
void Run::pump() {
  for (;;) {
    while (!finished_now_.empty()) {
      const int live = finished_now_.back();
      finished_now_.pop_back();
      finish(live);
    }
    ready_.clear();
    tracker_.take_ready(ready_);
    if (ready_.empty() && finished_now_.empty()) return;
    for (auto& a : ready_) start(std::move(a));
  }
}

}  // namespace piper::sim::simgrid_detail
