// SimGrid engine benchmark: qwen3-9b, 1F1B, PP8 x DP128 (1,024 GPUs of dgx-h200), 64 microbatches;
// times the analytic engine and the SimGrid engine (exact, and with rounds of rings merged into at
// most 32 steps, an approximation) and prints their step times. Prints figures; asserts nothing.
// Usage: bench_simgrid [--dp N] [--microbatches N] [--model NAME] [--max-ring-steps q ...]
//                      [--flow-starter auto|maestro|workers|pool] [--no-merge]
// (--no-merge: SimgridOptions::merge_lone_collectives = false, every ring round as flows.)
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "piper/core/scenario.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/engine.hpp"
#include "piper/sim/simgrid_engine.hpp"

using namespace piper;
using Clock = std::chrono::steady_clock;

static double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// CPU seconds used by finished child processes (the SimGrid engine runs in a forked child), a figure
// that does not depend on how loaded the machine is.
static double children_cpu_s() {
  rusage u{};
  getrusage(RUSAGE_CHILDREN, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

int main(int argc, char** argv) {
  int dp = 128, microbatches = 64;
  std::string model = "qwen3-9b";
  std::vector<int> merges;
  sim::SimgridOptions::FlowStarter starter = sim::SimgridOptions::FlowStarter::Auto;
  bool merge_lone = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dp" && i + 1 < argc)
      dp = std::atoi(argv[++i]);
    else if (a == "--microbatches" && i + 1 < argc)
      microbatches = std::atoi(argv[++i]);
    else if (a == "--model" && i + 1 < argc)
      model = argv[++i];
    else if (a == "--max-ring-steps" && i + 1 < argc)
      merges.push_back(std::atoi(argv[++i]));
    else if (a == "--no-merge")
      merge_lone = false;
    else if (a == "--flow-starter" && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v == "auto")
        starter = sim::SimgridOptions::FlowStarter::Auto;
      else if (v == "maestro")
        starter = sim::SimgridOptions::FlowStarter::Maestro;
      else if (v == "workers")
        starter = sim::SimgridOptions::FlowStarter::Workers;
      else if (v == "pool")
        starter = sim::SimgridOptions::FlowStarter::Pool;
      else {
        std::fprintf(stderr, "bench_simgrid: --flow-starter must be auto, maestro, workers or pool, not '%s'\n",
                     v.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "bench_simgrid: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  if (merges.empty()) merges = {0, 32};

  core::Scenario s;
  s.model = model;
  s.strategy.schedule = "1f1b";
  s.strategy.pp = 8;
  s.strategy.dp = dp;
  s.strategy.microbatches = microbatches;
  auto t0 = Clock::now();
  core::CompiledScenario compiled = core::compile_scenario(s);
  const double compile_s = since(t0);
  auto program = std::make_shared<const core::Program>(std::move(compiled.result.program));
  const sim::Cluster cluster = sim::with_devices(sim::load_cluster("dgx-h200"), program->num_devices);
  const sim::CostModel cost(cluster);
  std::printf("%s 1F1B PP8 x DP%d, %d microbatches: %d GPUs, %lld op instances, compiled in %.2f s\n", model.c_str(),
              dp, microbatches, program->num_devices, static_cast<long long>(program->total_ops()), compile_s);
  std::printf("%-36s %12s %12s %14s %16s\n", "engine", "wall s", "CPU s", "step ms", "vs analytic");

  auto t1 = Clock::now();
  const core::Timeline analytic = sim::make_analytic_engine()->run(program, cluster, cost);
  std::printf("%-36s %12.3f %12s %14.6f %16s\n", "analytic", since(t1), "-", analytic.step_time_s * 1e3, "-");
  std::fflush(stdout);
  for (int q : merges) {
    auto t2 = Clock::now();
    const double cpu0 = children_cpu_s();
    sim::SimgridOptions options;
    options.max_ring_steps = q;
    options.flow_starter = starter;
    options.merge_lone_collectives = merge_lone;
    const core::Timeline t = sim::make_simgrid_engine(options)->run(program, cluster, cost);
    const std::string name =
        (q == 0 ? std::string("simgrid (exact)") : "simgrid (max_ring_steps " + std::to_string(q) + ")") +
        (merge_lone ? "" : " no merge");
    std::printf("%-36s %12.3f %12.3f %14.6f %+15.2e\n", name.c_str(), since(t2), children_cpu_s() - cpu0,
                t.step_time_s * 1e3, t.step_time_s / analytic.step_time_s - 1);
    std::fflush(stdout);
  }
  return 0;
}
