// The "simgrid" engine: runs a Program on a SimGrid platform built from the Cluster, releasing each
// op (transfer as one network flow, collective as rounds of flows or, for a schedule alone on its
// links, one timer; compute and fixed delays as SimGrid timers) as the ReadyTracker frees it; flows are
// started from a stock of Execs made by pool actors (see Run::PoolActor) or as SimgridOptions says.
// SimGrid 3.32 cannot be initialised twice in a process, so every run happens in a forked child that
// sends the op times back through a pipe.
#include "piper/sim/simgrid_engine.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <iostream>
#include <set>
#include <string>
#include <unordered_map>

#include <simgrid/kernel/Timer.hpp>
#include <simgrid/kernel/resource/Action.hpp>
#include <simgrid/s4u.hpp>
#include <simgrid/simix.hpp>

#include "piper/core/error.hpp"
#include "piper/sim/ready_tracker.hpp"
#include "simgrid_collectives.hpp"
#include "simgrid_platform.hpp"

namespace sg = simgrid::s4u;

namespace piper::sim {
namespace {

using simgrid_detail::Phase;
using simgrid_detail::RoundSchedule;
using Activity = ReadyTracker::Activity;

using simgrid_detail::kUnitsPerByte;

bool is_collective_kind(core::OpKind k) {
  return k == core::OpKind::AllReduce || k == core::OpKind::ReduceScatter || k == core::OpKind::AllGather ||
         k == core::OpKind::AllToAll;
}

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
  Run(const core::Program& program, const Cluster& cluster, const CostModel& cost, const SimgridOptions& options)
      : program_(program), cost_(cost), options_(options), tracker_(program) {
    const int n = program.num_devices;
    node_of_ = cluster.node_of_devices();
    if (static_cast<int>(node_of_.size()) < n)
      throw ClusterError("cluster '" + cluster.name + "' has " + std::to_string(node_of_.size()) +
                         " GPUs, the program needs " + std::to_string(n));
    rates_ = compute_rates(program, cluster);
    std::vector<double> comm_capacity;
    for (const ComputeRates& r : rates_) comm_capacity.push_back(r.comm_capacity);
    platform_ = std::make_unique<simgrid_detail::Platform>(cluster, n, route_pairs(), comm_capacity);
    sharing_ = GpuSharing(cost.gpu_of_devices(), n);
    times_.assign(static_cast<std::size_t>(2 * tracker_.total_ops()), 0.0);
    comm_active_.assign(static_cast<std::size_t>(n), 0);
    computing_.resize(static_cast<std::size_t>(n));
    link_flows_.assign(static_cast<std::size_t>(platform_->num_links()), 0);
    link_merge_.assign(static_cast<std::size_t>(platform_->num_links()), -1);
  }

  // Simulates; returns op (start, end) times for every device in (stream, index) order.
  std::vector<double> simulate() {
    // A worker only creates, starts and waits for one flow at a time, and a pool actor only creates
    // Execs (the bookkeeping runs in maestro): a small stack is enough, and thousands of SimGrid's
    // default 8 MiB would reserve tens of GiB of address space.
    sg::Engine::set_config("contexts/stack-size:128");
    using Starter = SimgridOptions::FlowStarter;
    use_workers_ = options_.flow_starter == Starter::Workers;
    use_pool_ = options_.flow_starter == Starter::Pool || options_.flow_starter == Starter::Auto;
    if (use_pool_) {
      pool_.resize(kPoolActors);
      for (int j = 0; j < kPoolActors; ++j) {
        pool_[static_cast<std::size_t>(j)].wake = sg::Semaphore::create(0);
        sg::Actor::create("pool" + std::to_string(j), platform_->host(0), [this, j] { pool_loop(j); });
      }
      // Ended flows are released one time advance later: SimGrid posts an Exec's end after the
      // bookkeeping of that instant has run (see pool_flow_ended).
      sg::Engine::on_time_advance_cb([this](double) {
        graveyard_old_.clear();
        graveyard_old_.swap(graveyard_);
      });
      sg::Link::on_communication_state_change_cb(
          [this](simgrid::kernel::resource::NetworkAction& a, simgrid::kernel::resource::Action::State) {
            pool_flow_ended(a);
          });
    } else if (!use_workers_) {
      sg::Engine::on_time_advance_cb([this](double) { graveyard_.clear(); });
      sg::Activity::on_completion_cb([this](const sg::Activity& a) { comm_completed(a); });
    }
    guarded([this] { pump(); });
    settle();
    sg::Engine::get_instance()->run();
    if (error_) std::rethrow_exception(error_);
    if (!tracker_.done()) tracker_.throw_stuck();
    std::vector<double> out;
    out.reserve(times_.size());
    for (int d = 0; d < program_.num_devices; ++d) {
      const core::Plan& plan = program_.plan_for(d);
      for (std::size_t s = 0; s < plan.streams.size(); ++s)
        for (std::size_t i = 0; i < plan.streams[s].ops.size(); ++i) {
          const auto k = static_cast<std::size_t>(tracker_.instance(d, {static_cast<int>(s), static_cast<int>(i)}));
          out.push_back(times_[2 * k]);
          out.push_back(times_[2 * k + 1]);
        }
    }
    return out;
  }

 private:
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
  std::vector<ComputeRates> rates_;
  GpuSharing sharing_;  // devices sharing a GPU split its compute (engine.hpp)  // per device: compute speed idle /
                        // while communicating (cost_model.hpp)
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

  // Every device pair a transfer or a collective round of this program uses.
  std::vector<std::pair<int, int>> route_pairs() const {
    std::vector<std::pair<int, int>> pairs;
    std::vector<std::set<core::OpKind>> family_kinds(program_.families.size());
    for (int d = 0; d < program_.num_devices; ++d)
      for (const auto& stream : program_.plan_for(d).streams)
        for (const auto& op : stream.ops) {
          if (op.kind == core::OpKind::Send) pairs.emplace_back(d, program_.peer_of(op, d));
          if (is_collective_kind(op.kind) && op.family >= 0)
            family_kinds[static_cast<std::size_t>(op.family)].insert(op.kind);
        }
    for (std::size_t f = 0; f < family_kinds.size(); ++f) {
      if (family_kinds[f].empty()) continue;
      for (const auto& group : program_.groups(static_cast<int>(f)))
        for (core::OpKind kind : family_kinds[f])
          simgrid_detail::for_each_pair(simgrid_detail::decompose_collective(kind, group, 1.0, node_of_),
                                        [&](int s, int t) { pairs.emplace_back(s, t); });
    }
    return pairs;
  }

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

  // Hands the pending flows to workers: worker `self` (when >= 0) keeps the first one, idle workers
  // take the next ones, new workers the rest. Returns the flow kept by `self`, or -1. Maestro only.
  int dispatch(int self) {
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
  void settle() {
    if (use_workers_) dispatch(-1);
    retire_if_done();
  }
  void retire_if_done() {
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

  void worker_loop(int w) {
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
  void pool_loop(int j) {
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

  void ask_refill() {
    if (refill_asked_ || pool_retired_) return;
    refill_asked_ = true;
    pool_[static_cast<std::size_t>(next_pool_)].wake->release();
    next_pool_ = (next_pool_ + 1) % kPoolActors;
  }

  // Starts flow `id` on an Exec from the stock (maestro).
  void launch(int id) {
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
  void pool_flow_ended(simgrid::kernel::resource::NetworkAction& network_action) {
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

  void run_flow(int id) {
    const Slot& s = slots_[static_cast<std::size_t>(id)];
    sg::ExecPtr e = sg::Exec::init();
    e->set_hosts({platform_->host(s.src), platform_->host(s.dst)});
    e->set_flops_amounts({0.0, 0.0});
    e->set_bytes_amounts({0.0, s.units, 0.0, 0.0});
    e->start();
    e->wait();
  }

  int new_slot(SlotKind kind, int owner, int schedule, int participant, int step) {
    const int id = take(slots_, free_slots_);
    Slot& s = slots_[static_cast<std::size_t>(id)];
    s.kind = kind;
    s.owner = owner;
    s.schedule = schedule;
    s.participant = participant;
    s.step = step;
    return id;
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

  double compute_rate(int d) const {
    const ComputeRates& r = rates_[static_cast<std::size_t>(d)];
    return r.compute(comm_active_[static_cast<std::size_t>(d)]) / sharing_.divisor(d);
  }

  void start_compute(int live, int d, double seconds) {
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

  void arm(int c) {
    Compute& k = computes_[static_cast<std::size_t>(c)];
    k.timer = at(k.since + k.remaining / k.rate, [this, c] { compute_done(c); });
  }

  void compute_done(int c) {
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
  void compute_rate_changed(int d) {
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

  // A flow of `bytes` from src to dst after `latency` seconds (the route's links have no latency of
  // their own, see simgrid_platform.hpp). CM02 gives a flow in its latency phase no share of any
  // link, so waiting on a timer first is the same model, and the Comm exists only while it moves
  // bytes: SimGrid 3.32 keeps every live host-to-host Comm in one std::list (maestro's) and scans
  // it linearly when one ends, so fewer live Comms make every completion cheaper.
  void start_comm(int src, int dst, double bytes, double latency, SlotKind kind, int owner, int schedule = 0,
                  int participant = 0, int step = 0) {
    if (latency > 0)
      after(latency, [this, src, dst, bytes, kind, owner, schedule, participant, step] {
        start_flow(src, dst, bytes, kind, owner, schedule, participant, step);
      });
    else
      start_flow(src, dst, bytes, kind, owner, schedule, participant, step);
  }

  // Flows per link, kept only for merging (merge_lone_collectives reads them, nothing else does): a
  // flow about to start (change +1) first splits any merged schedule that holds one of its links.
  void occupy_route(int src, int dst, int change) {
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

  void start_flow(int src, int dst, double bytes, SlotKind kind, int owner, int schedule, int participant, int step) {
    occupy_route(src, dst, +1);
    const int id = new_slot(kind, owner, schedule, participant, step);
    Slot& s = slots_[static_cast<std::size_t>(id)];
    s.src = src;
    s.dst = dst;
    s.units = static_cast<double>(std::llround(std::max(0.0, bytes) * kUnitsPerByte));
    ++flows_in_use_;
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

  void comm_completed(const sg::Activity& a) {
    if (a.get_state() != sg::Activity::State::FINISHED || a.get_data<void>() == nullptr) return;
    const auto id = static_cast<std::size_t>(reinterpret_cast<std::uintptr_t>(a.get_data<void>()) - 1);
    graveyard_.push_back(std::move(slots_[id].comm));
    guarded([this, id] { flow_ended(static_cast<int>(id)); });
  }

  // Compute throughput of a device is ComputeRates::compute(k) while k communications run on it.
  void comm_delta(const Activity& a, int delta) {
    for (const auto& [d, r] : a.members) {
      int& c = comm_active_[static_cast<std::size_t>(d)];
      const int before = c;
      c += delta;
      const ComputeRates& rr = rates_[static_cast<std::size_t>(d)];
      if (rr.compute(before) != rr.compute(c)) compute_rate_changed(d);
    }
  }

  const core::Op& op_of(int device, core::OpRef r) const {
    return program_.plan_for(device).streams[static_cast<std::size_t>(r.stream)].ops[static_cast<std::size_t>(r.index)];
  }

  void start(Activity a) {
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
  void start_delay(int live, double seconds) {
    after(seconds, [this, live] {
      finished_now_.push_back(live);
      pump();
    });
  }

  void start_phase(int c) {
    CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
    const Phase& phase = run.phases[run.phase];
    run.states.assign(phase.schedules.size(), {});
    run.flows_left = 0;
    for (std::size_t k = 0; k < phase.schedules.size(); ++k) {
      const RoundSchedule& s = phase.schedules[k];
      ScheduleState& st = run.states[k];
      st.s = &s;
      const int q = options_.max_ring_steps;
      st.rounds_per_step =
          (s.pattern == RoundSchedule::Pattern::Ring && q > 0 && s.rounds > q) ? (s.rounds + q - 1) / q : 1;
      st.steps = (s.rounds + st.rounds_per_step - 1) / st.rounds_per_step;
      const auto n = static_cast<std::size_t>(s.size());
      st.sends_done.assign(n, 0);
      st.inflight.assign(n, 0);
      st.received.assign(static_cast<std::size_t>(st.steps) * n, 0);
      run.flows_left += static_cast<std::int64_t>(st.steps) * s.size();
    }
    if (run.flows_left == 0) return finish_collective(c);
    for (std::size_t k = 0; k < run.states.size(); ++k) {
      if (options_.merge_lone_collectives && try_merge(c, static_cast<int>(k))) continue;
      for (int i = 0; i < run.states[k].s->size(); ++i) try_flow(c, static_cast<int>(k), i);
    }
  }

  // Runs schedule k of collective c merged if its rounds run alone on their links (see Merge).
  bool try_merge(int c, int k) {
    ScheduleState& st = collectives_[static_cast<std::size_t>(c)].states[static_cast<std::size_t>(k)];
    const RoundSchedule& s = *st.s;
    if (st.rounds_per_step != 1 || st.steps < 2) return false;
    const int n = s.size();
    // The payload as start_flow gives it to SimGrid.
    const double units = static_cast<double>(std::llround(std::max(0.0, s.chunk_bytes) * kUnitsPerByte));
    if (units <= 0) return false;
    const bool ring = s.pattern == RoundSchedule::Pattern::Ring;
    // A ring's rounds all use the same pairs, so its first round stands for all.
    const int distinct_rounds = ring ? 1 : st.steps;
    std::vector<double> latency(static_cast<std::size_t>(distinct_rounds)), rate(latency.size());
    std::vector<int> links, round_links;
    int route[simgrid_detail::Platform::kMaxRouteLinks];
    for (int j = 0; j < distinct_rounds; ++j) {
      const int first = s.devices[0], second = s.devices[static_cast<std::size_t>(s.target(j, 0))];
      const double lat = platform_->route_latency_s(first, second), r = platform_->route_rate_units(first, second);
      round_links.clear();
      for (int i = 0; i < n; ++i) {
        const int src = s.devices[static_cast<std::size_t>(i)],
                  dst = s.devices[static_cast<std::size_t>(s.target(j, i))];
        if (platform_->route_latency_s(src, dst) != lat || platform_->route_rate_units(src, dst) != r) return false;
        const int count = platform_->route_links(src, dst, route);
        for (int l = 0; l < count; ++l) {
          const auto lu = static_cast<std::size_t>(route[l]);
          if (link_flows_[lu] > 0 || link_merge_[lu] >= 0) return false;
          round_links.push_back(route[l]);
        }
      }
      std::sort(round_links.begin(), round_links.end());
      if (std::adjacent_find(round_links.begin(), round_links.end()) != round_links.end()) return false;
      links.insert(links.end(), round_links.begin(), round_links.end());
      latency[static_cast<std::size_t>(j)] = lat;
      rate[static_cast<std::size_t>(j)] = r;
    }
    std::sort(links.begin(), links.end());
    links.erase(std::unique(links.begin(), links.end()), links.end());
    const int m = take(merges_, free_merges_);
    Merge& M = merges_[static_cast<std::size_t>(m)];
    M.collective = c;
    M.schedule = k;
    M.start = now();
    M.units = units;
    M.latency.resize(static_cast<std::size_t>(st.steps));
    M.rate.resize(M.latency.size());
    M.offset.resize(M.latency.size() + 1);
    M.offset[0] = 0;
    for (std::size_t j = 0; j < M.latency.size(); ++j) {
      M.latency[j] = latency[ring ? 0 : j];
      M.rate[j] = rate[ring ? 0 : j];
      const double period = M.latency[j] + units / M.rate[j];
      // A ring's rounds are alike: j * period, one rounding, not a sum of j.
      M.offset[j + 1] = ring ? static_cast<double>(j + 1) * period : M.offset[j] + period;
    }
    M.links = std::move(links);
    for (int l : M.links) link_merge_[static_cast<std::size_t>(l)] = m;
    st.merge = m;
    M.timer = at(M.start + M.offset.back(), [this, m] { merge_done(m); });
    return true;
  }

  void release_links(int m) {
    for (int l : merges_[static_cast<std::size_t>(m)].links)
      if (link_merge_[static_cast<std::size_t>(l)] == m) link_merge_[static_cast<std::size_t>(l)] = -1;
    merges_[static_cast<std::size_t>(m)].links.clear();
  }

  // The merged schedule's last rounds end now.
  void merge_done(int m) {
    Merge& M = merges_[static_cast<std::size_t>(m)];
    M.timer = nullptr;  // SimGrid deletes a timer after running it
    release_links(m);
    const int c = M.collective, k = M.schedule;
    free_merges_.push_back(m);
    CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
    ScheduleState& st = run.states[static_cast<std::size_t>(k)];
    st.merge = -1;
    std::fill(st.sends_done.begin(), st.sends_done.end(), st.steps);
    run.flows_left -= static_cast<std::int64_t>(st.steps) * st.s->size();
    if (run.flows_left == 0) {
      if (++run.phase < run.phases.size())
        start_phase(c);
      else
        finish_collective(c);
    }
    pump();
  }

  // A flow is about to start on a link of merged schedule m: put the schedule back into its
  // unmerged state at this instant (see Merge) and free its links.
  void split_merge(int m) {
    Merge& M = merges_[static_cast<std::size_t>(m)];
    const double elapsed = now() - M.start;
    const int rounds = static_cast<int>(M.latency.size());
    // The round under way: the last whose start offset is not after `elapsed`.
    int j = static_cast<int>(std::upper_bound(M.offset.begin(), M.offset.end(), elapsed) - M.offset.begin()) - 1;
    j = std::max(0, j);
    double into = elapsed - M.offset[static_cast<std::size_t>(std::min(j, rounds))];
    const int c = M.collective, k = M.schedule;
    ScheduleState& st = collectives_[static_cast<std::size_t>(c)].states[static_cast<std::size_t>(k)];
    bool in_latency = true;
    double left = 0;  // units left of round j's flows
    if (j < rounds && into >= M.latency[static_cast<std::size_t>(j)]) {
      in_latency = false;
      left = M.units - (into - M.latency[static_cast<std::size_t>(j)]) * M.rate[static_cast<std::size_t>(j)];
      if (std::llround(left) <= 0) {  // round j's flows end now: round j + 1 starts its latency
        ++j;
        into = 0;
        in_latency = true;
      }
    }
    release_links(m);
    if (j >= rounds) return;  // the schedule ends now: its timer (due now) does the bookkeeping
    M.timer->remove();
    M.timer = nullptr;
    free_merges_.push_back(m);
    st.merge = -1;
    CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
    const RoundSchedule& s = *st.s;
    const int n = s.size();
    run.flows_left -= static_cast<std::int64_t>(j) * n;
    for (int i = 0; i < n; ++i) {
      st.sends_done[static_cast<std::size_t>(i)] = j;
      st.inflight[static_cast<std::size_t>(i)] = 1;
      for (int done = 0; done < j; ++done)
        st.received[static_cast<std::size_t>(done) * static_cast<std::size_t>(n) + static_cast<std::size_t>(i)] = 1;
    }
    const double latency_left = M.latency[static_cast<std::size_t>(j)] - into, chunk = s.chunk_bytes;
    for (int i = 0; i < n; ++i) {
      const int src = s.devices[static_cast<std::size_t>(i)], dst = s.devices[static_cast<std::size_t>(s.target(j, i))];
      if (in_latency)
        start_comm(src, dst, chunk, latency_left, SlotKind::Flow, c, k, i, j);
      else
        start_flow(src, dst, left / kUnitsPerByte, SlotKind::Flow, c, k, i, j);
    }
  }

  // Participant i starts its next step once its previous send and its previous receive are done.
  void try_flow(int c, int k, int i) {
    ScheduleState& st = collectives_[static_cast<std::size_t>(c)].states[static_cast<std::size_t>(k)];
    const auto iu = static_cast<std::size_t>(i);
    const int step = st.sends_done[iu];
    if (st.merge >= 0 || st.inflight[iu] || step >= st.steps) return;
    if (step > 0 && !st.received[static_cast<std::size_t>(step - 1) * static_cast<std::size_t>(st.s->size()) + iu])
      return;
    st.inflight[iu] = 1;
    const int first_round = step * st.rounds_per_step;
    const int rounds = std::min(st.rounds_per_step, st.s->rounds - first_round);
    const int src = st.s->devices[iu], dst = st.s->devices[static_cast<std::size_t>(st.s->target(first_round, i))];
    // A step of c merged rounds pays the c route latencies of its rounds, then moves c chunks.
    start_comm(src, dst, rounds * st.s->chunk_bytes, rounds * platform_->route_latency_s(src, dst), SlotKind::Flow, c,
               k, i, step);
  }

  void flow_done(int c, int k, int i, int step) {
    CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
    ScheduleState& st = run.states[static_cast<std::size_t>(k)];
    const int n = st.s->size();
    const int t = st.s->target(step * st.rounds_per_step, i);
    st.inflight[static_cast<std::size_t>(i)] = 0;
    st.sends_done[static_cast<std::size_t>(i)] += 1;
    st.received[static_cast<std::size_t>(step) * static_cast<std::size_t>(n) + static_cast<std::size_t>(t)] = 1;
    if (--run.flows_left == 0) {
      if (++run.phase < run.phases.size()) return start_phase(c);
      return finish_collective(c);
    }
    try_flow(c, k, i);
    try_flow(c, k, t);
  }

  void finish_collective(int c) {
    CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
    finished_now_.push_back(run.live);
    run.phases.clear();
    run.states.clear();
    free_collectives_.push_back(c);
  }

  void finish(int live) {
    Live& L = live_[static_cast<std::size_t>(live)];
    const double t = now();
    for (const auto& [d, r] : L.activity.members) times_[static_cast<std::size_t>(2 * tracker_.instance(d, r) + 1)] = t;
    if (L.counts_as_comm) comm_delta(L.activity, -1);
    tracker_.finished(L.activity, t);
    L.activity.members.clear();
    free_live_.push_back(live);
  }

  // Starts everything ready; activities that take no time finish at once and may free more.
  void pump() {
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

  // The bookkeeping when flow `id` has ended (maestro).
  void flow_ended(int id) {
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
};

// Runs `body` in a forked child; returns what it wrote. The child's first byte says how it ended:
// 0 data follows, 1 deadlock message, 2 error message.
std::string run_in_child(const std::function<std::string()>& body) {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  int fds[2];
  if (pipe(fds) != 0) throw core::Error(std::string("simgrid engine: pipe: ") + std::strerror(errno));
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    throw core::Error(std::string("simgrid engine: fork: ") + std::strerror(errno));
  }
  if (pid == 0) {
    close(fds[0]);
    std::string out;
    try {
      out = std::string(1, '\0') + body();
    } catch (const DeadlockError& e) {
      out = std::string(1, '\1') + e.what();
    } catch (const std::exception& e) {
      out = std::string(1, '\2') + e.what();
    }
    const char* p = out.data();
    std::size_t left = out.size();
    while (left > 0) {
      const ssize_t w = write(fds[1], p, left);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) _exit(3);
      p += w;
      left -= static_cast<std::size_t>(w);
    }
    close(fds[1]);
    _exit(0);
  }
  close(fds[1]);
  std::string data;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t r = read(fds[0], buffer, sizeof buffer);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    data.append(buffer, static_cast<std::size_t>(r));
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (data.empty()) {
    if (WIFSIGNALED(status))
      throw core::Error("simgrid engine: the SimGrid process died with signal " + std::to_string(WTERMSIG(status)) +
                        " (its messages are above)");
    throw core::Error("simgrid engine: the SimGrid process ended without a result (exit status " +
                      std::to_string(WEXITSTATUS(status)) + ")");
  }
  if (data[0] == '\1') throw DeadlockError(data.substr(1));
  if (data[0] == '\2') throw core::Error(data.substr(1));
  return data.substr(1);
}

class SimgridEngine : public Engine {
 public:
  explicit SimgridEngine(SimgridOptions options) : options_(options) {}
  std::string name() const override { return "simgrid"; }

  core::Timeline run(std::shared_ptr<const core::Program> program, const Cluster& cluster,
                     const CostModel& cost) override {
    compute_rates(*program, cluster);  // a partition that does not fit fails here, in one line, not in the child
    const std::string bytes = run_in_child([&]() -> std::string {
      int argc = 1;
      char arg0[] = "piper-simgrid";
      char* argv[] = {arg0, nullptr};
      simgrid_detail::quiet_simgrid_logs();
      sg::Engine engine(&argc, argv);
      simgrid_detail::configure_simgrid_for_alpha_beta();
      Run run(*program, cluster, cost, options_);
      const std::vector<double> times = run.simulate();
      return std::string(reinterpret_cast<const char*>(times.data()), times.size() * sizeof(double));
    });
    core::Timeline timeline = empty_timeline(program, "simgrid");
    const auto* t = reinterpret_cast<const double*>(bytes.data());
    const std::size_t count = bytes.size() / sizeof(double);
    std::size_t k = 0;
    for (auto& device : timeline.devices)
      for (auto& span : device.spans) {
        if (k + 2 > count) throw core::Error("simgrid engine: short result from the SimGrid process");
        span.start_s = t[k];
        span.end_s = t[k + 1];
        k += 2;
        timeline.step_time_s = std::max(timeline.step_time_s, span.end_s);
      }
    if (k != count) throw core::Error("simgrid engine: result size does not match the program");
    fill_memory(timeline);
    return timeline;
  }

 private:
  SimgridOptions options_;
};

}  // namespace

std::unique_ptr<Engine> make_simgrid_engine(const SimgridOptions& options) {
  return std::make_unique<SimgridEngine>(options);
}
std::unique_ptr<Engine> make_simgrid_engine() { return make_simgrid_engine(SimgridOptions{}); }

}  // namespace piper::sim
