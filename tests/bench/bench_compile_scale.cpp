// Compile-cost benchmark at cluster scale: qwen3-30b-a3b, DualPipeV, EP 8, ZeRO-1, 64 microbatches,
// PP 8 x DP {128, 512, 2048} = 1,024 / 4,096 / 16,384 devices. Prints compile seconds, compiler peak
// memory, plan bytes and distinct plans per size and the growth ratios between sizes.
// Each size runs in its own process (`bench_compile_scale --devices N`) so that peak RSS is its own.
// Then deep pipelines, where every stage is a plan of its own: `piper schedule show 1f1b --ranks N
// --microbatches N` (compile and unit-time view) at N = 64, 128, 256 (`--pipeline N`).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "piper/core/compiler.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/schedule_view.hpp"

namespace {

namespace core = piper::core;

constexpr int kPipelineRanks = 8;

struct Figures {
  int devices = 0;
  double compile_seconds = 0;
  double peak_rss_bytes = 0;
  double plan_bytes = 0;
  int distinct_plans = 0;
};

// One size, in this process: prints one machine-readable line.
int run_one(int devices) {
  core::Scenario s;
  s.model = "qwen3-30b-a3b";
  s.strategy.schedule = "dualpipev";
  s.strategy.pp = kPipelineRanks;
  s.strategy.dp = devices / kPipelineRanks;
  s.strategy.ep = 8;
  s.strategy.zero = 1;
  s.strategy.microbatches = 64;
  const auto t0 = std::chrono::steady_clock::now();
  const core::CompiledScenario compiled = core::compile_scenario(s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::size_t plan_bytes = compiled.result.program.to_json().dump().size();
  fmt::print("RESULT {} {:.3f} {} {} {}\n", compiled.result.program.num_devices, seconds, core::peak_rss_bytes(),
             plan_bytes, compiled.result.program.plans.size());
  return 0;
}

// One deep pipeline, in this process: what `piper schedule show 1f1b --ranks N --microbatches N` runs.
int run_pipeline(int ranks) {
  core::StrategyOptions o;
  o.schedule = "1f1b";
  o.pp = ranks;
  o.microbatches = ranks;
  const auto t0 = std::chrono::steady_clock::now();
  const core::UnitSchedule s = core::unit_time_schedule(o, core::UnitCosts{});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("RESULT {} {:.3f} {} {} {}\n", s.ranks.size(), seconds, core::peak_rss_bytes(), 0, 0);
  return 0;
}

// Runs `argv0 mode size` per size; the RESULT lines, or nothing if a run failed.
std::vector<Figures> measure(const char* argv0, const char* mode, const std::vector<int>& sizes) {
  std::vector<Figures> rows;
  for (int size : sizes) {
    const std::string cmd = fmt::format("'{}' {} {}", argv0, mode, size);
    FILE* pipe = popen(cmd.c_str(), "r");
    if (!pipe) return {};
    char line[512];
    Figures f;
    while (fgets(line, sizeof line, pipe))
      if (std::sscanf(line, "RESULT %d %lf %lf %lf %d", &f.devices, &f.compile_seconds, &f.peak_rss_bytes,
                      &f.plan_bytes, &f.distinct_plans) == 5)
        rows.push_back(f);
    if (pclose(pipe) != 0 || rows.empty() || rows.back().devices != size) {
      fmt::print(stderr, "bench_compile_scale: the run {} {} failed\n", mode, size);
      return {};
    }
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--devices") return run_one(std::atoi(argv[2]));
  if (argc == 3 && std::string(argv[1]) == "--pipeline") return run_pipeline(std::atoi(argv[2]));
  const std::vector<Figures> rows = measure(argv[0], "--devices", {1024, 4096, 16384});
  if (rows.empty()) return 1;
  fmt::print("qwen3-30b-a3b, dualpipev, PP {} x DP, EP 8, ZeRO-1, 64 microbatches (one process per size, one core)\n",
             kPipelineRanks);
  fmt::print("{:>8} {:>12} {:>14} {:>14} {:>8}   growth vs previous (devices x{})\n", "devices", "compile s",
             "peak RSS MiB", "plan MiB", "plans", 4);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const Figures& f = rows[i];
    std::string growth;
    if (i > 0) {
      const Figures& g = rows[i - 1];
      growth = fmt::format("time x{:.2f}, memory x{:.2f}, plan bytes x{:.2f}", f.compile_seconds / g.compile_seconds,
                           f.peak_rss_bytes / g.peak_rss_bytes, f.plan_bytes / g.plan_bytes);
    }
    fmt::print("{:>8} {:>12.3f} {:>14.1f} {:>14.2f} {:>8}   {}\n", f.devices, f.compile_seconds,
               f.peak_rss_bytes / (1024.0 * 1024.0), f.plan_bytes / (1024.0 * 1024.0), f.distinct_plans, growth);
  }
  const Figures& big = rows.back();
  fmt::print("target at 16,384 devices: <= 5 s and <= 4 GiB: {} ({:.2f} s, {:.2f} GiB)\n",
             big.compile_seconds <= 5 && big.peak_rss_bytes <= 4.0 * (1 << 30) ? "met" : "NOT met", big.compile_seconds,
             big.peak_rss_bytes / (1024.0 * 1024.0 * 1024.0));

  // Deep pipelines: N plans of N microbatches each, so the ops grow as N^2; a compile linear in its
  // output grows x4 per doubling, one that walks every node once per plan x8.
  const std::vector<Figures> deep = measure(argv[0], "--pipeline", {64, 128, 256});
  if (deep.empty()) return 1;
  fmt::print("\nschedule show 1f1b --ranks N --microbatches N (compile and unit-time view; one process per size)\n");
  fmt::print("{:>8} {:>12} {:>14}   growth vs previous (ranks x2, ops x4)\n", "ranks", "seconds", "peak RSS MiB");
  for (std::size_t i = 0; i < deep.size(); ++i) {
    const Figures& f = deep[i];
    const std::string growth =
        i == 0 ? ""
               : fmt::format("time x{:.2f}, memory x{:.2f}", f.compile_seconds / deep[i - 1].compile_seconds,
                             f.peak_rss_bytes / deep[i - 1].peak_rss_bytes);
    fmt::print("{:>8} {:>12.3f} {:>14.1f}   {}\n", f.devices, f.compile_seconds, f.peak_rss_bytes / (1024.0 * 1024.0),
               growth);
  }
  return 0;
}
