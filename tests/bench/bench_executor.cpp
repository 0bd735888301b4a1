// Executor overhead: time the executor spends on its own bookkeeping (cursors, waits, timeline,
// buffer accounting) per op and as a share of the step, outside kernels and communication.
// Run: mpirun --allow-run-as-root --oversubscribe -np 4 build/bin/bench_executor [steps]  (or without mpirun: 1 device)
#include <cstdlib>
#include <string>

#include <fmt/format.h>
#include <mpi.h>

#include "piper/core/scenario.hpp"
#include "piper/runtime/trainer.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int steps = argc > 1 ? std::atoi(argv[1]) : 20;

  // The runtime's test model, pipelined over every rank with 1F1B and 8 microbatches.
  piper::core::Scenario s;
  s.model = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json";
  s.strategy.pp = size;
  s.strategy.microbatches = 8;
  s.strategy.schedule = "1f1b";
  const auto program = piper::core::compile_scenario(s).result.program;

  piper::runtime::TrainOptions o;
  o.steps = steps;
  o.print = false;
  const auto r = piper::runtime::train_distributed(program, o);

  // Per rank: [ops, total, backend, idle, overhead]; report each rank, then the worst share.
  double mine[5] = {static_cast<double>(r.ops), r.total_s, r.backend_s, r.idle_s, r.overhead_s};
  std::vector<double> all(static_cast<std::size_t>(5 * size));
  MPI_Gather(mine, 5, MPI_DOUBLE, all.data(), 5, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    fmt::print("executor overhead: {} ({} devices, 1F1B, 8 microbatches), {} steps, step time {:.2f} ms\n",
               program.model_name, size, steps, r.step_time_s * 1e3);
    fmt::print("{:>6} {:>8} {:>12} {:>12} {:>12} {:>14} {:>10}\n", "device", "ops", "backend ms", "idle ms",
               "overhead ms", "overhead/op us", "share");
    double worst = 0;
    for (int d = 0; d < size; ++d) {
      const double* v = &all[static_cast<std::size_t>(5 * d)];
      const double share = v[1] > 0 ? v[4] / v[1] : 0;
      worst = std::max(worst, share);
      fmt::print("{:>6} {:>8.0f} {:>12.2f} {:>12.2f} {:>12.3f} {:>14.2f} {:>9.2f}%\n", d, v[0], v[2] * 1e3, v[3] * 1e3,
                 v[4] * 1e3, v[4] / v[0] * 1e6, 100 * share);
    }
    fmt::print("largest executor share of step time: {:.2f}%\n", 100 * worst);
  }
  MPI_Finalize();
  return 0;
}
