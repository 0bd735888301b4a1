// `piper sweep` under mpirun: rank 0 owns the spec and the CSV; every rank simulates a round-robin
// share of the pending combinations on its worker threads and streams its rows to rank 0.
#include "cli/sweep_mpi.hpp"

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "cli/common.hpp"
#include "piper/core/limits.hpp"
#include "piper/sim/results_csv.hpp"
#include "piper/sim/sweep.hpp"

namespace piper::cli {

namespace fs = std::filesystem;

namespace {

constexpr int kTagRow = 1;   // payload: status letter + CSV line
constexpr int kTagDone = 2;  // a rank finished its share

bool env_above_one(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::atoi(v) > 1;
}

void broadcast_string(std::string& s, int root) {
  long long n = static_cast<long long>(s.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, root, MPI_COMM_WORLD);
  s.resize(static_cast<std::size_t>(n));
  if (n > 0) MPI_Bcast(s.data(), static_cast<int>(n), MPI_CHAR, root, MPI_COMM_WORLD);
}

// Runs `points` on `jobs` threads (simgrid ones afterwards, alone: that engine forks per run) and
// calls `emit` for each row, one call at a time.
void run_share(const std::vector<sim::SweepPoint>& points, const std::string& calibration, int jobs,
               const std::function<void(const sim::SweepRow&)>& emit) {
  std::vector<sim::SweepPoint> parallel, serial;
  for (const auto& p : points) (p.engine == "simgrid" ? serial : parallel).push_back(p);
  std::mutex mutex;
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    for (std::size_t i = next++; i < parallel.size(); i = next++) {
      sim::SweepRow row = sim::run_point(parallel[i], calibration);
      std::lock_guard lock(mutex);
      emit(row);
    }
  };
  const int threads = std::max(1, std::min<int>(jobs, static_cast<int>(parallel.size())));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  for (const auto& p : serial) emit(sim::run_point(p, calibration));
}

char status_letter(const sim::SweepRow& row) { return row.status == "ok" ? 'o' : row.status == "invalid" ? 'i' : 'e'; }

}  // namespace

bool launched_under_mpi() {
  return env_above_one("OMPI_COMM_WORLD_SIZE") || env_above_one("PMIX_SIZE") || env_above_one("PMI_SIZE");
}

int run_sweep_mpi(const std::string& spec_path, const std::string& output_path, int jobs) {
  int provided = 0;
  // Only the main thread calls MPI; worker threads hand rows over through a queue.
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  struct Finalize {
    ~Finalize() { MPI_Finalize(); }
  } finalize;
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  // Rank 0 validates the spec and the results file; the verdict and the spec text go to everyone.
  std::string error, text, pending_text;
  sim::SweepSpec spec;
  std::vector<sim::SweepPoint> all;
  sim::SweepSummary summary;
  std::set<std::string> done;
  if (rank == 0) {
    try {
      // One bounded read (Limit::InputBytes), parsed here and broadcast as is.
      text = core::read_input_file(spec_path);
      spec = sim::SweepSpec::parse(text, spec_path, fs::path(spec_path).parent_path().string());
      done = sim::repair_results(output_path);
    } catch (const std::exception& e) {  // SweepError, or a limit/read error: every rank must hear it
      error = e.what();
    }
  }
  broadcast_string(error, 0);
  if (!error.empty()) {
    if (rank == 0) throw CliError("", error);
    return kExitBadInput;
  }
  broadcast_string(text, 0);
  if (rank != 0) {
    try {
      spec = sim::SweepSpec::parse(text, spec_path, fs::path(spec_path).parent_path().string());
    } catch (const std::exception& e) {
      fmt::print(stderr, "rank {}: {}\n", rank, e.what());
      MPI_Abort(MPI_COMM_WORLD, kExitBadInput);
    }
  }
  all = sim::expand(spec);
  // Pending combinations (as run_sweep: resumed keys and duplicates skipped), by index into `all`.
  std::vector<int> pending;
  if (rank == 0) {
    std::set<std::string> queued;
    for (std::size_t i = 0; i < all.size(); ++i) {
      const std::string k = all[i].key();
      if (done.count(k)) {
        summary.resumed += 1;
        continue;
      }
      if (queued.insert(k).second) pending.push_back(static_cast<int>(i));
    }
  }
  int count = static_cast<int>(pending.size());
  MPI_Bcast(&count, 1, MPI_INT, 0, MPI_COMM_WORLD);
  pending.resize(static_cast<std::size_t>(count));
  if (count > 0) MPI_Bcast(pending.data(), count, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<sim::SweepPoint> mine;
  for (int k = rank; k < count; k += size)
    mine.push_back(all[static_cast<std::size_t>(pending[static_cast<std::size_t>(k)])]);
  summary.combinations = all.size();

  if (rank != 0) {
    // Workers compute; the main thread sends each row as soon as it is queued.
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::string> queue;
    bool finished = false;
    std::thread compute([&] {
      run_share(mine, spec.calibration_path, jobs, [&](const sim::SweepRow& row) {
        std::lock_guard lock(mutex);
        queue.push_back(std::string(1, status_letter(row)) + sim::to_csv(row) + "\n");
        cv.notify_one();
      });
      std::lock_guard lock(mutex);
      finished = true;
      cv.notify_one();
    });
    while (true) {
      std::unique_lock lock(mutex);
      cv.wait(lock, [&] { return finished || !queue.empty(); });
      if (queue.empty() && finished) break;
      std::string msg = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      MPI_Send(msg.data(), static_cast<int>(msg.size()), MPI_CHAR, 0, kTagRow, MPI_COMM_WORLD);
    }
    compute.join();
    MPI_Send(nullptr, 0, MPI_CHAR, 0, kTagDone, MPI_COMM_WORLD);
    return 0;
  }

  // Rank 0: append rows (its own and received ones) through the appender run_sweep uses (one write +
  // fdatasync each; a failed write is cut off and stops the run).
  std::optional<sim::ResultsAppender> out;
  try {
    out.emplace(output_path, sim::sweep_csv_columns());
  } catch (const sim::ResultsFileError& e) {
    print_error("", e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kExitBadInput);
    return kExitBadInput;
  }
  std::mutex mutex;
  std::string write_error;
  auto record = [&](char status, const std::string& line) {
    std::lock_guard lock(mutex);
    if (!write_error.empty()) return;
    try {
      out->append(line);
    } catch (const sim::ResultsFileError& e) {
      write_error = e.what();
      return;
    }
    summary.ran += 1;
    (status == 'o' ? summary.ok : status == 'i' ? summary.invalid : summary.failed) += 1;
  };
  // Only the main thread may call MPI (MPI_THREAD_FUNNELED): it stops the job on a failed write.
  auto stop_on_write_error = [&] {
    std::lock_guard lock(mutex);
    if (write_error.empty()) return;
    print_error("", write_error);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kExitBadInput);
  };
  std::thread compute([&] {
    run_share(mine, spec.calibration_path, jobs,
              [&](const sim::SweepRow& row) { record(status_letter(row), sim::to_csv(row)); });
  });
  for (int remaining = size - 1; remaining > 0;) {
    MPI_Status st;
    MPI_Probe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &st);
    int n = 0;
    MPI_Get_count(&st, MPI_CHAR, &n);
    std::string msg(static_cast<std::size_t>(n), '\0');
    MPI_Recv(msg.data(), n, MPI_CHAR, st.MPI_SOURCE, st.MPI_TAG, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    if (st.MPI_TAG == kTagDone) {
      remaining -= 1;
      continue;
    }
    if (!msg.empty() && msg.back() == '\n') msg.pop_back();
    if (!msg.empty()) record(msg[0], msg.substr(1));
    stop_on_write_error();
  }
  compute.join();
  stop_on_write_error();
  fmt::print("{} combinations: {} already in {}, {} run ({} ok, {} invalid, {} failed) on {} MPI ranks\n",
             summary.combinations, summary.resumed, output_path, summary.ran, summary.ok, summary.invalid,
             summary.failed, size);
  return 0;
}

}  // namespace piper::cli
