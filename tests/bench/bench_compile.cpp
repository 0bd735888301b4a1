// Compile-time and compiler-memory benchmark: qwen3-9b, 1F1B, PP8 x DP{8,128}, 64 microbatches.
// The DP-8 row is the reference: plans shared across DP ranks should keep DP-128 close to it.
#include <cstdint>
#include <string>

#include <benchmark/benchmark.h>

#include "piper/core/compiler.hpp"
#include "piper/core/directives.hpp"
#include "piper/core/model.hpp"
#include "piper/core/program.hpp"
#include "piper/core/strategy.hpp"

namespace core = piper::core;

namespace {

constexpr double kBytesPerMiB = 1024.0 * 1024.0;

// One iteration = core::compile (DAG build, directives, lowering, verification), as `piper compile`
// runs it; the model and directive program are prepared outside the timed loop.
void BM_CompileQwen3_9b_1F1B(benchmark::State& state) {
  core::StrategyOptions opts;
  opts.pp = 8;
  opts.dp = static_cast<int>(state.range(0));
  opts.schedule = "1f1b";
  opts.microbatches = 64;

  core::Model model = core::build_model(*core::zoo_config("qwen3-9b"));
  core::balance_pipeline(model, core::schedule_family(opts.schedule).regions(opts));
  core::DirectiveProgram program = core::validated(core::generate_program(opts));

  core::CompileResult result;
  double compile_seconds = 0;
  for (auto _ : state) {
    result = core::compile(model, program);
    compile_seconds += result.program.stats.compile_seconds;
    benchmark::DoNotOptimize(result.program.plans.data());
  }
  // Counters are computed after the timed loop, so serializing the plan is not part of the time.
  const core::Program& p = result.program;
  state.counters["compile_s"] = compile_seconds / static_cast<double>(state.iterations());
  state.counters["peak_rss_MiB"] = static_cast<double>(core::peak_rss_bytes()) / kBytesPerMiB;
  state.counters["devices"] = p.num_devices;
  state.counters["distinct_plans"] = static_cast<double>(p.plans.size());
  state.counters["dag_nodes"] = static_cast<double>(p.stats.dag_nodes);
  state.counters["total_ops"] = static_cast<double>(p.total_ops());
  state.counters["plan_json_bytes"] = static_cast<double>(p.to_json().dump().size());
}

// DP 8 first, so the peak RSS reported for DP 128 includes at most the smaller run's high-water mark.
BENCHMARK(BM_CompileQwen3_9b_1F1B)
    ->ArgName("dp")
    ->Arg(8)
    ->Arg(128)
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
