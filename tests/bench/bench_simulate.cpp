// Simulator scale benchmark: compile qwen3-9b with 1F1B over PP8 x DP{128, 2048} (1,024 and 16,384
// GPUs), 64 microbatches, and time the engine (symmetry reduction included, as `piper simulate` runs
// it) and the report on it. Prints figures; asserts nothing.
// Usage: bench_simulate [dp ...] [--engine analytic|simgrid] [--microbatches N] [--model NAME]
//                       [--schedule NAME] [--pp N] [--no-symmetry]
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "piper/core/compiler.hpp"
#include "piper/core/scenario.hpp"
#include "piper/sim/simulate.hpp"

using namespace piper;
using Clock = std::chrono::steady_clock;

// CPU seconds of this process: on a shared machine wall time includes waiting for a core.
static double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

static double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

int main(int argc, char** argv) {
  std::vector<int> dps;
  std::string engine = "analytic", model = "qwen3-9b", schedule = "1f1b";
  int microbatches = 64, pp = 8;
  bool symmetry = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--engine" && i + 1 < argc)
      engine = argv[++i];
    else if (a == "--microbatches" && i + 1 < argc)
      microbatches = std::atoi(argv[++i]);
    else if (a == "--model" && i + 1 < argc)
      model = argv[++i];
    else if (a == "--schedule" && i + 1 < argc)
      schedule = argv[++i];
    else if (a == "--pp" && i + 1 < argc)
      pp = std::atoi(argv[++i]);
    else if (a == "--no-symmetry")
      symmetry = false;
    else
      dps.push_back(std::atoi(a.c_str()));
  }
  if (dps.empty()) dps = {128, 2048};
  std::printf("%-8s %-6s %-10s %8s %12s %10s %8s %10s %12s %10s %12s %14s\n", "devices", "dp", "schedule", "engine",
              "op instances", "compile s", "classes", "simulate s", "sim CPU s", "report s", "step ms", "peak RSS MiB");
  for (int dp : dps) {
    core::Scenario s;
    s.model = model;
    s.strategy.schedule = schedule;
    s.strategy.pp = pp;
    s.strategy.dp = dp;
    s.strategy.microbatches = microbatches;
    auto t0 = Clock::now();
    core::CompiledScenario compiled = core::compile_scenario(s);
    const double compile_s = since(t0);
    auto program = std::make_shared<const core::Program>(std::move(compiled.result.program));
    sim::Cluster cluster = sim::with_devices(sim::load_cluster("dgx-h200"), program->num_devices);
    sim::CostModel cost(cluster);
    auto t1 = Clock::now();
    const double c1 = cpu_seconds();
    // As sim::simulate() does: find the classes, reduce when the engine and program allow it.
    auto eng = sim::make_engine(engine);
    int classes = program->num_devices;
    core::Timeline timeline;
    std::optional<sim::Symmetry> sym;
    if (symmetry && eng->supports_symmetry()) {
      sym = sim::find_symmetry(*program, cluster);
      if (!sym->reduces()) sym.reset();
      if (sym) classes = sym->classes();
      timeline = sym ? eng->run_reduced(program, cluster, cost, *sym) : eng->run(program, cluster, cost);
    } else {
      timeline = eng->run(program, cluster, cost);
    }
    const double simulate_s = since(t1), simulate_cpu_s = cpu_seconds() - c1;
    auto t2 = Clock::now();
    sim::Report report = sim::make_report(timeline, cluster, sim::compile_stats_of(*program), sym ? &*sym : nullptr);
    const double report_s = since(t2);
    std::printf("%-8d %-6d %-10s %8s %12lld %10.2f %8d %10.3f %12.3f %10.3f %12.3f %14.0f\n", program->num_devices, dp,
                schedule.c_str(), engine.c_str(), static_cast<long long>(program->total_ops()), compile_s, classes,
                simulate_s, simulate_cpu_s, report_s, report.step_time_s * 1e3,
                static_cast<double>(core::peak_rss_bytes()) / (1024.0 * 1024.0));
    std::fflush(stdout);
  }
  return 0;
}
