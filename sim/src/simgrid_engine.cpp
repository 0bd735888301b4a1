// The "simgrid" engine: runs a Program on a SimGrid platform built from the Cluster, releasing each
// activity (compute Exec, transfer Comm, collective as rounds of Comms) from SimGrid completion
// callbacks as the ReadyTracker frees it. SimGrid 3.32 cannot be initialised twice in a process, so
// every run happens in a forked child that sends the op times back through a pipe.
#include "piper/sim/simgrid_engine.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <set>
#include <string>

#include <simgrid/s4u.hpp>

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

// One run of a Program inside the child process.
class Run {
 public:
  Run(const core::Program& program, const Cluster& cluster, const CostModel& cost, const SimgridOptions& options)
      : program_(program), cost_(cost), options_(options), tracker_(program) {
    const int n = program.num_devices;
    std::vector<int> cores(static_cast<std::size_t>(n));
    for (int d = 0; d < n; ++d) cores[static_cast<std::size_t>(d)] = static_cast<int>(program.plan_for(d).streams.size());
    node_of_ = cluster.node_of_devices();
    if (static_cast<int>(node_of_.size()) < n)
      throw ClusterError("cluster '" + cluster.name + "' has " + std::to_string(node_of_.size()) + " GPUs, the program needs " + std::to_string(n));
    platform_ = std::make_unique<simgrid_detail::Platform>(cluster, compute_rates(program, cluster), n, std::move(cores), route_pairs());
    times_.assign(static_cast<std::size_t>(2 * tracker_.total_ops()), 0.0);
    comm_active_.assign(static_cast<std::size_t>(n), 0);
  }

  // Simulates; returns op (start, end) times for every device in (stream, index) order.
  std::vector<double> simulate() {
    sg::Engine::on_time_advance_cb([this](double) { graveyard_.clear(); });
    sg::Activity::on_completion_cb([this](const sg::Activity& a) { on_completion(a); });
    pump();
    sg::Engine::get_instance()->run();
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
  // What a running SimGrid activity stands for.
  enum class SlotKind { Activity, FlowDelay, Flow };
  struct Slot {
    sg::ActivityPtr act;
    SlotKind kind = SlotKind::Activity;
    int owner = -1;   // Activity: index into live_; FlowDelay/Flow: index into collectives_
    int schedule = 0, participant = 0, step = 0;
  };
  struct Live {
    Activity activity;
    int collective = -1;   // index into collectives_ when it is a decomposed collective
    bool counts_as_comm = false;
  };
  struct ScheduleState {
    const RoundSchedule* s = nullptr;
    int rounds_per_step = 1, steps = 0;
    std::vector<int> sends_done;
    std::vector<char> inflight, received;   // received[step * n + i]
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
  std::vector<Slot> slots_;
  std::vector<int> free_slots_;
  std::vector<Live> live_;
  std::vector<int> free_live_;
  std::vector<CollectiveRun> collectives_;
  std::vector<int> free_collectives_;
  std::vector<int> finished_now_;       // live activities that end at the current time without SimGrid
  std::vector<Activity> ready_;
  std::vector<sg::ActivityPtr> graveyard_;  // completed activities, released once time advances

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

  int new_slot(sg::ActivityPtr act, SlotKind kind, int owner, int schedule = 0, int participant = 0, int step = 0) {
    int id;
    if (!free_slots_.empty()) {
      id = free_slots_.back();
      free_slots_.pop_back();
    } else {
      id = static_cast<int>(slots_.size());
      slots_.emplace_back();
    }
    Slot& s = slots_[static_cast<std::size_t>(id)];
    s.act = std::move(act);
    s.kind = kind;
    s.owner = owner;
    s.schedule = schedule;
    s.participant = participant;
    s.step = step;
    s.act->set_data(reinterpret_cast<void*>(static_cast<std::uintptr_t>(id) + 1));
    return id;
  }

  void start_exec(sg::Host* host, double seconds, SlotKind kind, int owner, int schedule = 0, int participant = 0, int step = 0) {
    sg::ExecPtr e = sg::Exec::init();
    e->set_flops_amount(seconds);
    e->set_host(host);
    const int id = new_slot(e, kind, owner, schedule, participant, step);
    slots_[static_cast<std::size_t>(id)].act->start();
  }

  void start_comm(int src, int dst, double bytes, SlotKind kind, int owner, int schedule = 0, int participant = 0, int step = 0) {
    sg::CommPtr c = sg::Comm::sendto_init(platform_->host(src), platform_->host(dst));
    c->set_payload_size(static_cast<std::uint64_t>(std::llround(std::max(0.0, bytes) * kUnitsPerByte)));
    const int id = new_slot(c, kind, owner, schedule, participant, step);
    slots_[static_cast<std::size_t>(id)].act->start();
  }

  // Compute throughput of a device changes to ComputeRates::with_comm while >= 1 communication runs on it.
  void comm_delta(const Activity& a, int delta) {
    for (const auto& [d, r] : a.members) {
      int& c = comm_active_[static_cast<std::size_t>(d)];
      const int before = c;
      c += delta;
      if (!platform_->has_slow_state(d)) continue;
      if (before == 0 && c > 0) platform_->host(d)->set_pstate(1);
      if (before > 0 && c == 0) platform_->host(d)->set_pstate(0);
    }
  }

  const core::Op& op_of(int device, core::OpRef r) const {
    return program_.plan_for(device).streams[static_cast<std::size_t>(r.stream)].ops[static_cast<std::size_t>(r.index)];
  }

  void start(Activity a) {
    int live;
    if (!free_live_.empty()) {
      live = free_live_.back();
      free_live_.pop_back();
    } else {
      live = static_cast<int>(live_.size());
      live_.emplace_back();
    }
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
          start_exec(platform_->host(d0), w, SlotKind::Activity, live);
        else
          finished_now_.push_back(live);
        break;
      }
      case Activity::Kind::Transfer: {
        const int src = d0, dst = L.activity.members.back().first;
        const double formula = cost_.p2p_seconds(src, dst, op.bytes);
        const double seconds = cost_.transfer_seconds(op, src, dst);
        if (seconds != formula)  // calibrated or overridden: a delay on no link
          seconds > 0 ? start_exec(platform_->timer_host(), seconds, SlotKind::Activity, live) : finished_now_.push_back(live);
        else if (src == dst)
          finished_now_.push_back(live);
        else
          start_comm(src, dst, static_cast<double>(op.bytes), SlotKind::Activity, live);
        break;
      }
      case Activity::Kind::Collective: {
        std::vector<int> ranks;
        ranks.reserve(L.activity.members.size());
        for (const auto& m : L.activity.members) ranks.push_back(m.first);
        const double formula = cost_.collective_seconds(op.kind, ranks, op.bytes);
        const double seconds = cost_.collective_op_seconds(op, ranks);
        if (seconds != formula) {
          seconds > 0 ? start_exec(platform_->timer_host(), seconds, SlotKind::Activity, live) : finished_now_.push_back(live);
          break;
        }
        auto phases = simgrid_detail::decompose_collective(op.kind, ranks, static_cast<double>(std::max<std::int64_t>(0, op.bytes)), node_of_);
        if (phases.empty()) {
          finished_now_.push_back(live);
          break;
        }
        int c;
        if (!free_collectives_.empty()) {
          c = free_collectives_.back();
          free_collectives_.pop_back();
        } else {
          c = static_cast<int>(collectives_.size());
          collectives_.emplace_back();
        }
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
      st.rounds_per_step = (s.pattern == RoundSchedule::Pattern::Ring && q > 0 && s.rounds > q) ? (s.rounds + q - 1) / q : 1;
      st.steps = (s.rounds + st.rounds_per_step - 1) / st.rounds_per_step;
      const auto n = static_cast<std::size_t>(s.size());
      st.sends_done.assign(n, 0);
      st.inflight.assign(n, 0);
      st.received.assign(static_cast<std::size_t>(st.steps) * n, 0);
      run.flows_left += static_cast<std::int64_t>(st.steps) * s.size();
    }
    if (run.flows_left == 0) return finish_collective(c);
    for (std::size_t k = 0; k < run.states.size(); ++k)
      for (int i = 0; i < run.states[k].s->size(); ++i) try_flow(c, static_cast<int>(k), i);
  }

  // Participant i starts its next step once its previous send and its previous receive are done.
  void try_flow(int c, int k, int i) {
    ScheduleState& st = collectives_[static_cast<std::size_t>(c)].states[static_cast<std::size_t>(k)];
    const auto iu = static_cast<std::size_t>(i);
    const int step = st.sends_done[iu];
    if (st.inflight[iu] || step >= st.steps) return;
    if (step > 0 && !st.received[static_cast<std::size_t>(step - 1) * static_cast<std::size_t>(st.s->size()) + iu]) return;
    st.inflight[iu] = 1;
    const int first_round = step * st.rounds_per_step;
    const int rounds = std::min(st.rounds_per_step, st.s->rounds - first_round);
    const int src = st.s->devices[iu], dst = st.s->devices[static_cast<std::size_t>(st.s->target(first_round, i))];
    const double delay = (rounds - 1) * platform_->route_latency_s(src, dst);
    if (delay > 0)
      start_exec(platform_->timer_host(), delay, SlotKind::FlowDelay, c, k, i, step);
    else
      start_comm(src, dst, rounds * st.s->chunk_bytes, SlotKind::Flow, c, k, i, step);
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

  void on_completion(const sg::Activity& a) {
    if (a.get_state() != sg::Activity::State::FINISHED) return;
    const auto id = static_cast<std::size_t>(reinterpret_cast<std::uintptr_t>(a.get_data<void>()) - 1);
    Slot& s = slots_[id];
    graveyard_.push_back(std::move(s.act));
    free_slots_.push_back(static_cast<int>(id));
    const SlotKind kind = s.kind;
    const int owner = s.owner, k = s.schedule, i = s.participant, step = s.step;
    switch (kind) {
      case SlotKind::Activity:
        finished_now_.push_back(owner);
        break;
      case SlotKind::FlowDelay: {
        const ScheduleState& st = collectives_[static_cast<std::size_t>(owner)].states[static_cast<std::size_t>(k)];
        const int first_round = step * st.rounds_per_step;
        const int rounds = std::min(st.rounds_per_step, st.s->rounds - first_round);
        const int src = st.s->devices[static_cast<std::size_t>(i)];
        const int dst = st.s->devices[static_cast<std::size_t>(st.s->target(first_round, i))];
        start_comm(src, dst, rounds * st.s->chunk_bytes, SlotKind::Flow, owner, k, i, step);
        break;
      }
      case SlotKind::Flow:
        flow_done(owner, k, i, step);
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
      throw core::Error("simgrid engine: the SimGrid process died with signal " + std::to_string(WTERMSIG(status)) + " (its messages are above)");
    throw core::Error("simgrid engine: the SimGrid process ended without a result (exit status " + std::to_string(WEXITSTATUS(status)) + ")");
  }
  if (data[0] == '\1') throw DeadlockError(data.substr(1));
  if (data[0] == '\2') throw core::Error(data.substr(1));
  return data.substr(1);
}

class SimgridEngine : public Engine {
 public:
  explicit SimgridEngine(SimgridOptions options) : options_(options) {}
  std::string name() const override { return "simgrid"; }

  core::Timeline run(std::shared_ptr<const core::Program> program, const Cluster& cluster, const CostModel& cost) override {
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

std::unique_ptr<Engine> make_simgrid_engine(const SimgridOptions& options) { return std::make_unique<SimgridEngine>(options); }
std::unique_ptr<Engine> make_simgrid_engine() { return make_simgrid_engine(SimgridOptions{}); }

}  // namespace piper::sim
