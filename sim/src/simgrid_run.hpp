// The Run class of the "simgrid" engine (simgrid_engine.cpp): one run of a Program inside the forked
// child, private to piper_sim. Its members are defined in simgrid_engine.cpp (set-up, the run and
// the op times), simgrid_flows.cpp (network flows: the Maestro, Workers and Pool starters, their
// actors, the end of a flow), simgrid_activities.cpp (ops released by the ReadyTracker: compute
// timers, delays, transfers, collectives set up) and simgrid_rounds.cpp (a collective's phases and
// rounds of flows, merged schedules).
#pragma once

#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include <simgrid/kernel/Timer.hpp>
#include <simgrid/s4u.hpp>

#include "piper/sim/ready_tracker.hpp"
#include "piper/sim/simgrid_engine.hpp"
#include "simgrid_collectives.hpp"
#include "simgrid_platform.hpp"

namespace piper::sim::simgrid_detail {

namespace sg = simgrid::s4u;

// Index of an unused element of `pool`: the last one released to `free`, else a new one appended.
template <class T>
int take(std::vector<T>& pool, std::vector<int>& free) {
  if (free.empty()) {
    pool.emplace_back();
    return static_cast<int>(pool.size()) - 1;
  }
  const int i = free.back();
  free.pop_back();
  return i;
}

// One run of a Program inside the child process.
class Run {
 public:
  Run(const core::Program& program, const Cluster& cluster, const CostModel& cost, const SimgridOptions& options);

  // Simulates; returns op (start, end) times for every device in (stream, index) order.
  std::vector<double> simulate();

 private:
  using Activity = ReadyTracker::Activity;

  // A network flow: what it stands for, and what its worker puts on the network.
  enum class SlotKind { Activity, Flow };
  struct Slot {
    SlotKind kind = SlotKind::Activity;
    int owner = -1;  // Activity: index into live_; Flow: index into collectives_
    int schedule = 0, participant = 0, step = 0;
    int src = 0, dst = 0;
    double units = 0;      // payload in kUnitsPerByte units
    sg::ActivityPtr comm;  // the running Comm (FlowStarter::Maestro)
  };
  // FlowStarter::Maestro: a flow is a Comm::sendto started by the bookkeeping itself, and its end
  // comes back through s4u::Activity::on_completion. But SimGrid 3.32 keeps every live host-to-host
  // Comm in maestro's std::list and takes it out on completion with a linear std::list::remove,
  // so each completion scans every live flow (35-45 % of the time at 1,024 GPUs, quadratic in the
  // cluster size).
  // FlowStarter::Workers: a flow is a two-host parallel Exec (no flops, `units` from src to dst),
  // which SimGrid's default host model turns into the same CM02 network action as a Comm, created
  // by a worker actor; SimGrid lists an Exec with the actor that created it. The worker starts it,
  // waits for it and runs the bookkeeping its end frees (in maestro, through a simcall, at that
  // simulated instant before time advances, so later flows still start when they are released).
  // Each worker's list holds one entry. Idle workers wait on their semaphore; the pool grows to the
  // largest number of concurrent flows, and idle workers exit once nothing is left to happen.
  struct Worker {
    sg::SemaphorePtr wake;
    int job = -1;  // slot to run when woken; -1: exit
  };
  // FlowStarter::Pool: a flow is the same two-host Exec, but the bookkeeping starts it itself (in
  // maestro, no actor switch) from a stock of Execs that pool actors create in batches of kPoolBatch.
  // An Exec is listed with the actor that created it, so each pool actor's list holds its unused
  // stock and the live flows of its own batches, not every live flow: a completion scans about one
  // batch. When the stock runs low, the next pool actor (round robin) is woken to add a batch; it
  // runs at the same simulated instant, before time advances, and first starts the flows that found
  // the stock empty. So every flow starts when it is released, as with the other starters.
  struct PoolActor {
    sg::SemaphorePtr wake;
    bool exit = false;
  };
  static constexpr int kPoolActors = 64;
  static constexpr std::size_t kPoolBatch = 32;
  // Compute ops do not become SimGrid Execs: a GPU's compute streams never share a core, so an op of
  // w seconds runs at ComputeRates::compute(k), k the communications running on its device
  // (engine.hpp), and every change of k happens in this class. A timer at the op's end, moved when
  // the speed changes, is the same model without a SimGrid activity per op (each costs a CPU action,
  // an LMM variable, and an entry in an activity list that SimGrid 3.32 scans linearly).
  struct Compute {
    int live = -1, device = -1;
    double remaining = 0;  // seconds of work at full speed left at `since`
    double rate = 1, since = 0;
    simgrid::kernel::timer::Timer* timer = nullptr;
  };
  struct Live {
    Activity activity;
    int collective = -1;  // index into collectives_ when it is a decomposed collective
    bool counts_as_comm = false;
  };
  struct ScheduleState {
    const RoundSchedule* s = nullptr;
    int rounds_per_step = 1, steps = 0;
    int merge = -1;  // index into merges_ while the ring runs merged
    std::vector<int> sends_done;
    std::vector<char> inflight, received;  // received[step * n + i]
  };
  // A schedule whose rounds run merged (SimgridOptions::merge_lone_collectives): when a schedule (a ring,
  // or a pairwise all-to-all) starts with its links free (no flow on them), no two flows of a round
  // sharing a link, and all flows of a round alike (same route latency and lone-flow rate), each
  // participant's round j runs alone from start + offset[j], a latency then units / rate of
  // transfer, in lockstep with the others: that is what the max-min model gives a flow alone on its
  // links. So the schedule needs no flow at all while nothing else touches its links: one timer at
  // start + offset[rounds] ends it. Its links are held; a flow that starts on one of them first
  // splits the schedule (split_merge): the rounds done so far are counted as done, and each
  // participant's current round is put back as it would be at that instant (the rest of its latency
  // on a timer, or a flow with the bytes it has left), so the run goes on as if never merged.
  struct Merge {
    int collective = -1, schedule = -1;
    double start = 0, units = 0;
    std::vector<double> offset;         // round j starts at start + offset[j]; offset[rounds]: the end
    std::vector<double> latency, rate;  // per round (rate in units per second)
    simgrid::kernel::timer::Timer* timer = nullptr;
    std::vector<int> links;
  };
  struct CollectiveRun {
    int live = -1;
    std::vector<Phase> phases;
    std::size_t phase = 0;
    std::vector<ScheduleState> states;
    std::int64_t flows_left = 0;
  };

  const core::Program& program_;
  const CostModel& cost_;
  SimgridOptions options_;
  ReadyTracker tracker_;
  std::vector<int> node_of_;
  std::unique_ptr<simgrid_detail::Platform> platform_;
  std::vector<double> times_;
  std::vector<int> comm_active_;
  std::vector<ComputeRates> rates_;  // per device: compute speed idle / while communicating (cost_model.hpp)
  GpuSharing sharing_;               // devices sharing a GPU split its compute (engine.hpp)
  std::vector<Slot> slots_;
  std::vector<int> free_slots_;
  std::vector<Live> live_;
  std::vector<int> free_live_;
  std::vector<CollectiveRun> collectives_;
  std::vector<int> free_collectives_;
  std::vector<int> finished_now_;  // live activities that end at the current time without SimGrid
  std::vector<Activity> ready_;
  std::deque<Worker> workers_;  // a deque: a worker's entry stays put while the pool grows
  std::vector<int> idle_workers_;
  std::vector<int> pending_;  // flows released by the bookkeeping, not yet given to workers
  int flows_in_use_ = 0;      // pending or running flows
  std::exception_ptr error_;  // what the bookkeeping threw; the run drains, then it is rethrown
  bool use_workers_ = false;
  bool use_pool_ = false;
  std::vector<PoolActor> pool_;
  std::vector<sg::ExecPtr> stock_;  // Execs created by pool actors, not started yet
  int next_pool_ = 0;
  bool refill_asked_ = false, pool_retired_ = false;
  std::vector<sg::ActivityPtr> graveyard_;             // ended Comms, released once time advances (Maestro)
  std::vector<sg::ActivityPtr> graveyard_old_;         // Pool: ended Execs, released at the second time advance
  std::unordered_map<const void*, int> flow_of_impl_;  // Pool: running Exec (its ActivityImpl) -> slot
  std::vector<int> ended_;                             // Pool: flows ended now, bookkeeping pending
  std::vector<Compute> computes_;
  std::vector<int> free_computes_;
  std::vector<std::vector<int>> computing_;  // per device: its running computes
  std::vector<int> link_flows_;              // per platform link: flows on it now
  std::vector<int> link_merge_;              // per platform link: the merge holding it, or -1
  std::vector<Merge> merges_;
  std::vector<int> free_merges_;

  static double now() { return sg::Engine::get_clock(); }

  // simgrid_engine.cpp
  std::vector<std::pair<int, int>> route_pairs() const;

  // Runs `fn`; an exception stops all further bookkeeping and is rethrown after the run.
  template <class F>
  void guarded(F&& fn) {
    if (error_) return;
    try {
      fn();
    } catch (...) {
      error_ = std::current_exception();
    }
  }

  // Runs `fn` as bookkeeping at time `date` (from SimGrid's timer loop, in maestro).
  template <class F>
  simgrid::kernel::timer::Timer* at(double date, F fn) {
    return simgrid::kernel::timer::Timer::set(date, [this, fn = std::move(fn)] {
      guarded(fn);
      settle();
    });
  }
  template <class F>
  void after(double seconds, F fn) {
    at(now() + seconds, std::move(fn));
  }

  const core::Op& op_of(int device, core::OpRef r) const {
    return program_.plan_for(device).streams[static_cast<std::size_t>(r.stream)].ops[static_cast<std::size_t>(r.index)];
  }

  // simgrid_flows.cpp
  int dispatch(int self);
  void settle();
  void retire_if_done();
  void worker_loop(int w);
  void pool_loop(int j);
  void ask_refill();
  void launch(int id);
  void pool_flow_ended(simgrid::kernel::resource::NetworkAction& network_action);
  void run_flow(int id);
  int new_slot(SlotKind kind, int owner, int schedule, int participant, int step);
  void start_comm(int src, int dst, double bytes, double latency, SlotKind kind, int owner, int schedule = 0,
                  int participant = 0, int step = 0);
  void occupy_route(int src, int dst, int change);
  void start_flow(int src, int dst, double bytes, SlotKind kind, int owner, int schedule, int participant, int step);
  void comm_completed(const sg::Activity& a);
  void flow_ended(int id);

  // simgrid_activities.cpp
  double compute_rate(int d) const;
  void start_compute(int live, int d, double seconds);
  void arm(int c);
  void compute_done(int c);
  void compute_rate_changed(int d);
  void comm_delta(const Activity& a, int delta);
  void start(Activity a);
  void start_delay(int live, double seconds);
  void finish(int live);
  void pump();

  // simgrid_rounds.cpp
  void start_phase(int c);
  bool try_merge(int c, int k);
  void release_links(int m);
  void merge_done(int m);
  void split_merge(int m);
  void try_flow(int c, int k, int i);
  void flow_done(int c, int k, int i, int step);
  void finish_collective(int c);
};

}  // namespace piper::sim::simgrid_detail
