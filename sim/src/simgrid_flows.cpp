// Run's network flows (simgrid_run.hpp): a flow started by maestro as a Comm (FlowStarter::Maestro),
// by a worker actor (Workers) or from the pool actors' stock of Execs (Pool), the actors' loops,
// and the bookkeeping when a flow ends.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <simgrid/kernel/resource/Action.hpp>
#include <simgrid/simix.hpp>

#include "simgrid_run.hpp"

namespace piper::sim::simgrid_detail {

// Hands the pending flows to workers: worker `self` (when >= 0) keeps the first one, idle workers
// take the next ones, new workers the rest. Returns the flow kept by `self`, or -1. Maestro only.
int Run::dispatch(int self) {
  int kept = -1;
  for (int id : pending_) {
    if (self >= 0 && kept < 0) {
      kept = id;
      continue;
    }
    if (!idle_workers_.empty()) {
      const int w = idle_workers_.back();
      idle_workers_.pop_back();
      workers_[static_cast<std::size_t>(w)].job = id;
      workers_[static_cast<std::size_t>(w)].wake->release();
    } else {
      const int w = static_cast<int>(workers_.size());
      workers_.emplace_back();
      workers_.back().wake = sg::Semaphore::create(0);
      workers_.back().job = id;
      workers_.back().wake->release();
      sg::Actor::create("worker" + std::to_string(w), platform_->host(slots_[static_cast<std::size_t>(id)].src),
                        [this, w] { worker_loop(w); });
    }
  }
  pending_.clear();
  return kept;
}

// After bookkeeping in maestro: start what it released; once no flow runs and no timer is set,
// nothing can happen any more, so the idle workers exit (SimGrid would report them deadlocked).
void Run::settle() {
  if (use_workers_) dispatch(-1);
  retire_if_done();
}

void Run::retire_if_done() {
  if (!error_ && (flows_in_use_ > 0 || simgrid::kernel::timer::Timer::next() >= 0)) return;
  if (use_pool_ && !pool_retired_) {
    pool_retired_ = true;
    stock_.clear();
    for (auto& a : pool_) {
      a.exit = true;
      a.wake->release();
    }
  }
  for (int w : idle_workers_) {
    workers_[static_cast<std::size_t>(w)].job = -1;
    workers_[static_cast<std::size_t>(w)].wake->release();
  }
  idle_workers_.clear();
}

void Run::worker_loop(int w) {
  int job = -1;
  for (;;) {
    if (job < 0) {
      workers_[static_cast<std::size_t>(w)].wake->acquire();
      job = std::exchange(workers_[static_cast<std::size_t>(w)].job, -1);
      if (job < 0) return;
    }
    run_flow(job);
    int next = -1;
    bool exit = false;
    simgrid::kernel::actor::simcall_answered([this, w, job, &next, &exit] {
      guarded([this, job] { flow_ended(job); });
      next = dispatch(w);
      if (next < 0) {
        retire_if_done();
        // After a failure nothing new starts: the workers exit as their flows end.
        if (error_ || (flows_in_use_ == 0 && simgrid::kernel::timer::Timer::next() < 0))
          exit = true;
        else
          idle_workers_.push_back(w);
      }
    });
    if (exit) return;
    job = next;
  }
}

// Pool actor j: on each wake-up, creates a batch of Execs (listed with j) for the stock, and
// starts the flows that were waiting for one.
void Run::pool_loop(int j) {
  PoolActor& self = pool_[static_cast<std::size_t>(j)];
  std::vector<sg::ExecPtr> fresh;
  for (;;) {
    self.wake->acquire();
    if (self.exit) return;
    // Maestro does not run while this actor does, so pending_ cannot grow before the simcall.
    const std::size_t n = kPoolBatch + pending_.size();
    fresh.clear();
    for (std::size_t i = 0; i < n; ++i) fresh.push_back(sg::Exec::init());
    simgrid::kernel::actor::simcall_answered([this, &fresh] {
      refill_asked_ = false;
      for (auto& e : fresh) stock_.push_back(std::move(e));
      std::vector<int> waiting;
      waiting.swap(pending_);
      for (int id : waiting) launch(id);
      if (stock_.size() < kPoolBatch / 2) ask_refill();
      retire_if_done();
    });
  }
}

void Run::ask_refill() {
  if (refill_asked_ || pool_retired_) return;
  refill_asked_ = true;
  pool_[static_cast<std::size_t>(next_pool_)].wake->release();
  next_pool_ = (next_pool_ + 1) % kPoolActors;
}

// Starts flow `id` on an Exec from the stock (maestro).
void Run::launch(int id) {
  Slot& s = slots_[static_cast<std::size_t>(id)];
  sg::ExecPtr e = std::move(stock_.back());
  stock_.pop_back();
  e->set_hosts({platform_->host(s.src), platform_->host(s.dst)});
  e->set_flops_amounts({0.0, 0.0});
  e->set_bytes_amounts({0.0, s.units, 0.0, 0.0});
  // Noted before start(): SimGrid may end an empty flow inside it.
  flow_of_impl_.emplace(e->get_impl(), id);
  e->start();
  s.comm = std::move(e);
}

// Pool: SimGrid signals that a network action changed state. It does so while it updates its
// actions, where starting new ones is not safe, and an Exec that nobody waits for fires no
// s4u::Activity::on_completion; so the flow's end is noted here and its bookkeeping runs in a
// timer at the same instant (SimGrid runs timers due now right after the update).
// NetworkAction is only declared in SimGrid's public headers; it derives from Action alone, so
// it is that Action.
void Run::pool_flow_ended(simgrid::kernel::resource::NetworkAction& network_action) {
  const auto& action = reinterpret_cast<const simgrid::kernel::resource::Action&>(network_action);
  if (action.get_state() != simgrid::kernel::resource::Action::State::FINISHED) return;
  const auto it = flow_of_impl_.find(action.get_activity());
  if (it == flow_of_impl_.end()) return;
  const int id = it->second;
  flow_of_impl_.erase(it);
  graveyard_.push_back(std::move(slots_[static_cast<std::size_t>(id)].comm));
  if (ended_.empty())
    at(now(), [this] {
      std::vector<int> ended;
      ended.swap(ended_);
      for (int flow : ended) flow_ended(flow);
    });
  ended_.push_back(id);
}

void Run::run_flow(int id) {
  const Slot& s = slots_[static_cast<std::size_t>(id)];
  sg::ExecPtr e = sg::Exec::init();
  e->set_hosts({platform_->host(s.src), platform_->host(s.dst)});
  e->set_flops_amounts({0.0, 0.0});
  e->set_bytes_amounts({0.0, s.units, 0.0, 0.0});
  e->start();
  e->wait();
}

int Run::new_slot(SlotKind kind, int owner, int schedule, int participant, int step) {
  const int id = take(slots_, free_slots_);
  Slot& s = slots_[static_cast<std::size_t>(id)];
  s.kind = kind;
  s.owner = owner;
  s.schedule = schedule;
  s.participant = participant;
  s.step = step;
  return id;
}

// A flow of `bytes` from src to dst after `latency` seconds (the route's links have no latency of
// their own, see simgrid_platform.hpp). CM02 gives a flow in its latency phase no share of any
// link, so waiting on a timer first is the same model, and the Comm exists only while it moves
// bytes: SimGrid 3.32 keeps every live host-to-host Comm in one std::list (maestro's) and scans
// it linearly when one ends, so fewer live Comms make every completion cheaper.
void Run::start_comm(int src, int dst, double bytes, double latency, SlotKind kind, int owner, int schedule,
                     int participant, int step) {
  if (latency > 0)
    after(latency, [this, src, dst, bytes, kind, owner, schedule, participant, step] {
      start_flow(src, dst, bytes, kind, owner, schedule, participant, step);
    });
  else
    start_flow(src, dst, bytes, kind, owner, schedule, participant, step);
}

// Flows per link, kept only for merging (merge_lone_collectives reads them, nothing else does): a
// flow about to start (change +1) first splits any merged schedule that holds one of its links.
void Run::occupy_route(int src, int dst, int change) {
  if (!options_.merge_lone_collectives) return;
  int links[simgrid_detail::Platform::kMaxRouteLinks];
  const int nlinks = platform_->route_links(src, dst, links);
  if (change > 0)
    for (int l = 0; l < nlinks; ++l) {
      const int m = link_merge_[static_cast<std::size_t>(links[l])];
      if (m >= 0) split_merge(m);
    }
  for (int l = 0; l < nlinks; ++l) link_flows_[static_cast<std::size_t>(links[l])] += change;
}

void Run::start_flow(int src, int dst, double bytes, SlotKind kind, int owner, int schedule, int participant,
                     int step) {
  occupy_route(src, dst, +1);
  const int id = new_slot(kind, owner, schedule, participant, step);
  Slot& s = slots_[static_cast<std::size_t>(id)];
  s.src = src;
  s.dst = dst;
  s.units = static_cast<double>(std::llround(std::max(0.0, bytes) * kUnitsPerByte));
  ++flows_in_use_;
  // Nothing to move (a hand-edited plan's zero-byte transfer): the latency it waited was all of it.
  // SimGrid refuses an empty communication ("Cannot have a communication with no flop") and aborts.
  if (s.units <= 0) {
    at(now(), [this, id] { flow_ended(id); });
    return;
  }
  if (use_workers_) {
    pending_.push_back(id);
    return;
  }
  if (use_pool_) {
    if (stock_.empty()) {
      pending_.push_back(id);
      ask_refill();
      return;
    }
    launch(id);
    if (stock_.size() < kPoolBatch / 2) ask_refill();
    return;
  }
  sg::CommPtr comm = sg::Comm::sendto_init(platform_->host(src), platform_->host(dst));
  comm->set_payload_size(static_cast<std::uint64_t>(s.units));
  comm->set_data(reinterpret_cast<void*>(static_cast<std::uintptr_t>(id) + 1));
  s.comm = comm;
  comm->start();
}

void Run::comm_completed(const sg::Activity& a) {
  if (a.get_state() != sg::Activity::State::FINISHED || a.get_data<void>() == nullptr) return;
  const auto id = static_cast<std::size_t>(reinterpret_cast<std::uintptr_t>(a.get_data<void>()) - 1);
  graveyard_.push_back(std::move(slots_[id].comm));
  guarded([this, id] { flow_ended(static_cast<int>(id)); });
}

// The bookkeeping when flow `id` has ended (maestro).
void Run::flow_ended(int id) {
  const Slot s = slots_[static_cast<std::size_t>(id)];
  free_slots_.push_back(id);
  occupy_route(s.src, s.dst, -1);
  --flows_in_use_;
  switch (s.kind) {
    case SlotKind::Activity:
      finished_now_.push_back(s.owner);
      break;
    case SlotKind::Flow:
      flow_done(s.owner, s.schedule, s.participant, s.step);
      break;
  }
  pump();
}

}  // namespace piper::sim::simgrid_detail
