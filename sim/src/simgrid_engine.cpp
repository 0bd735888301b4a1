// The "simgrid" engine: runs a Program on a SimGrid platform built from the Cluster, releasing each
// op (transfer as one network flow, collective as rounds of flows or, for a schedule alone on its
// links, one timer; compute and fixed delays as SimGrid timers) as the ReadyTracker frees it; flows are
// started from a stock of Execs made by pool actors (see Run::PoolActor) or as SimgridOptions says.
// SimGrid 3.32 cannot be initialised twice in a process, so every run happens in a forked child that
// sends the op times back through a pipe. This file holds the engine, the child process and Run's
// set-up and result (simgrid_run.hpp; the rest of Run is in simgrid_flows.cpp, simgrid_activities.cpp
// and simgrid_rounds.cpp).
#include "piper/sim/simgrid_engine.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <simgrid/kernel/resource/Action.hpp>
#include <simgrid/s4u.hpp>

#include "piper/core/error.hpp"
#include "simgrid_run.hpp"

namespace sg = simgrid::s4u;

namespace piper::sim {
namespace {

bool is_collective_kind(core::OpKind k) {
  return k == core::OpKind::AllReduce || k == core::OpKind::ReduceScatter || k == core::OpKind::AllGather ||
         k == core::OpKind::AllToAll;
}

}  // namespace

namespace simgrid_detail {

Run::Run(const core::Program& program, const Cluster& cluster, const CostModel& cost, const SimgridOptions& options)
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
std::vector<double> Run::simulate() {
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

// Every device pair a transfer or a collective round of this program uses.
std::vector<std::pair<int, int>> Run::route_pairs() const {
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

}  // namespace simgrid_detail

namespace {

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
      simgrid_detail::Run run(*program, cluster, cost, options_);
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
