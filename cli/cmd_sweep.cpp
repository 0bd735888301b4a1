// `piper sweep`: simulate every combination of a spec's strategy knobs and append one CSV row each;
// rerunning with the same -o resumes (the logic is search::run_sweep, shared with the Python module).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include <fmt/format.h>

#include "cli/common.hpp"
#include "piper/search/sweep.hpp"
#include "piper/search/worker_pool_mpi.hpp"

namespace piper::cli {

namespace {

struct SweepArgs {
  std::string spec_path;
  std::string output_path;
  int jobs = 1;
};

// Under mpirun (more than one rank) the combinations are spread over the ranks (worker_pool_mpi.hpp):
// rank 0 reads the spec and owns the results file; the other ranks print nothing and end with rank
// 0's status (2 for a bad spec or results file; a file that fails mid-run ends the job with 2, and a
// simulation that throws, a bug, with 3).
int run_sweep_mpi(const SweepArgs& a) {
  search::MpiPool pool(a.jobs, [](const std::string& message, bool internal) {
    if (internal) {
      print_internal_error(message);
      return kExitInternal;
    }
    print_error("", message);
    return kExitBadInput;
  });
  search::SweepSummary s;
  try {
    const search::SweepSpec spec = search::load_sweep_spec(a.spec_path, pool);
    search::SweepOptions options;
    options.jobs = a.jobs;
    s = search::run_sweep(spec, a.output_path, pool, options);
  } catch (const search::SweepError& e) {
    // Every rank is here (the spec and the owner's verdict on the results file are shared). mpirun
    // ends the whole job as soon as one rank exits non-zero, so the owner says why first and the
    // others wait for its word (a broadcast it sends after printing) before they exit.
    if (pool.owner()) {
      print_error("", e.what());
      std::fflush(stderr);
    }
    std::string said;
    pool.share(said);
    return kExitBadInput;
  }
  if (pool.owner())
    fmt::print("{} combinations: {} already in {}, {} run ({} ok, {} invalid, {} failed) on {} MPI ranks\n",
               s.combinations, s.resumed, a.output_path, s.ran, s.ok, s.invalid, s.failed, pool.processes());
  return 0;
}

int run_sweep(const SweepArgs& a) {
  if (search::launched_under_mpi()) return run_sweep_mpi(a);
  search::SweepSpec spec;
  try {
    spec = search::SweepSpec::load(a.spec_path);
  } catch (const search::SweepError& e) {
    throw CliError("", e.what());
  }
  const bool tty = isatty(fileno(stderr)) != 0;
  search::SweepOptions options;
  options.jobs = a.jobs;
  // Rows simulated in this run (the callback runs on one thread at a time), for the best-rows lines.
  std::vector<search::SweepRow> ran;
  const auto start = std::chrono::steady_clock::now();
  // The bar redraws one line in place, so only on a terminal; logs and pipes get nothing. Its ETA is
  // the mean time per finished combination of this run times the ones left.
  options.on_row = [tty, &ran, start](const search::SweepRow& row, std::size_t done, std::size_t total) {
    ran.push_back(row);
    if (!tty) return;
    constexpr int kWidth = 30;
    const int filled = total ? static_cast<int>(kWidth * done / total) : kWidth;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double eta =
        done > 0 && total >= done ? elapsed / static_cast<double>(ran.size()) * static_cast<double>(total - done) : 0;
    fmt::print(stderr, "\r[{}{}] {}/{} ETA {:.0f} s {:<50.50}", std::string(static_cast<std::size_t>(filled), '#'),
               std::string(static_cast<std::size_t>(kWidth - filled), ' '), done, total, eta, row.point.key());
    if (done == total) fmt::print(stderr, "\n");
    std::fflush(stderr);
  };
  search::SweepSummary s;
  try {
    s = search::run_sweep(spec, a.output_path, options);
  } catch (const search::SweepError& e) {
    throw CliError("", e.what());
  }
  fmt::print("{} combinations: {} already in {}, {} run ({} ok, {} invalid, {} failed)\n", s.combinations, s.resumed,
             a.output_path, s.ran, s.ok, s.invalid, s.failed);
  // The fastest plans that fit, of those simulated in this run (resumed rows are in the CSV).
  std::vector<const search::SweepRow*> fits;
  for (const auto& r : ran)
    if (r.status == "ok" && !r.oom) fits.push_back(&r);
  std::sort(fits.begin(), fits.end(), [](const search::SweepRow* x, const search::SweepRow* y) {
    return x->step_time_s != y->step_time_s ? x->step_time_s < y->step_time_s : x->point.key() < y->point.key();
  });
  // A resumed sweep's fastest plan may be a resumed row: say what the lines rank (probe 5: they
  // read as the best of the whole sweep).
  if (s.resumed > 0 && !fits.empty())
    fmt::print("best of the {} run now ({} resumed rows are in {}, not ranked here):\n", s.ran, s.resumed,
               a.output_path);
  for (std::size_t i = 0; i < std::min<std::size_t>(3, fits.size()); ++i)
    fmt::print("best {}: {}  step {:.3f} ms  MFU {:.1f} %  peak {:.2f} GiB\n", i + 1, fits[i]->point.key(),
               fits[i]->step_time_s * 1e3, fits[i]->mfu * 100,
               static_cast<double>(fits[i]->peak_memory_bytes) / (1 << 30));
  return 0;
}

}  // namespace

Command add_sweep_command(CLI::App& app) {
  auto args = std::make_shared<SweepArgs>();
  CLI::App* cmd = app.add_subcommand("sweep",
                                     "simulate every combination of a spec's strategy knobs into a CSV (resumable; "
                                     "under mpirun -np N the combinations are spread over the ranks)");
  cmd->add_option("spec", args->spec_path, "sweep spec JSON: model, cluster and a list of values per knob")->required();
  cmd->add_option("-o,--output", args->output_path, "results CSV; rerunning with the same file resumes")
      ->required()
      ->check(kOutputPath);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  args->jobs = static_cast<int>(cores);
  cmd->add_option("-j,--jobs", args->jobs, "worker threads (simgrid combinations run one at a time)")
      ->check(kPositiveInt)
      ->capture_default_str();
  return {cmd, [args] { return run_sweep(*args); }};
}

}  // namespace piper::cli
