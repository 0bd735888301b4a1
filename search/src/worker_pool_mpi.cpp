// The MPI worker pool: rank 0 owns the results; every rank runs a round-robin share of the items on
// its worker threads and streams each result line to rank 0 as soon as it is computed.
#include "piper/search/worker_pool_mpi.hpp"

#include <mpi.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>

namespace piper::search {

namespace {

constexpr int kTagRow = 1;   // payload: the item's index, a space, its result line
constexpr int kTagDone = 2;  // a rank finished its share

bool env_above_one(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::atoi(v) > 1;
}

}  // namespace

bool launched_under_mpi() {
  return env_above_one("OMPI_COMM_WORLD_SIZE") || env_above_one("PMIX_SIZE") || env_above_one("PMI_SIZE");
}

MpiPool::MpiPool(int jobs, Report report) : jobs_(jobs), report_(std::move(report)) {
  int provided = 0;
  // Only the main thread calls MPI; worker threads hand results over through a queue.
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

MpiPool::~MpiPool() { MPI_Finalize(); }

void MpiPool::share(std::string& text) {
  long long n = static_cast<long long>(text.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  text.resize(static_cast<std::size_t>(n));
  if (n > 0) MPI_Bcast(text.data(), static_cast<int>(n), MPI_CHAR, 0, MPI_COMM_WORLD);
}

void MpiPool::share(std::vector<std::size_t>& items) {
  long long n = static_cast<long long>(items.size());
  MPI_Bcast(&n, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  std::vector<unsigned long long> wide(items.begin(), items.end());
  wide.resize(static_cast<std::size_t>(n));
  if (n > 0) MPI_Bcast(wide.data(), static_cast<int>(n), MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  items.assign(wide.begin(), wide.end());
}

void MpiPool::abort(const std::string& message) { end_job(message, false); }

void MpiPool::end_job(const std::string& message, bool internal) {
  const int code = report_(message, internal);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);  // MPI_Abort does not return; this tells the compiler so
}

void MpiPool::run(const std::vector<std::size_t>& items, const std::function<bool(std::size_t)>& alone,
                  const std::function<std::string(std::size_t)>& work,
                  const std::function<void(std::size_t, const std::string&)>& sink) {
  std::vector<std::size_t> mine;
  for (std::size_t k = static_cast<std::size_t>(rank_); k < items.size(); k += static_cast<std::size_t>(size_))
    mine.push_back(items[k]);
  if (rank_ == 0)
    receive_all(mine, alone, work, sink);
  else
    send_share(mine, alone, work);
}

// A rank other than 0: workers compute; the main thread sends each result as soon as it is queued.
void MpiPool::send_share(const std::vector<std::size_t>& mine, const std::function<bool(std::size_t)>& alone,
                         const std::function<std::string(std::size_t)>& work) {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::string> queue;
  bool finished = false;
  std::string failure;
  std::thread compute([&] {
    try {
      run_local(mine, jobs_, alone, work, [&](std::size_t i, const std::string& line) {
        std::lock_guard lock(mutex);
        queue.push_back(std::to_string(i) + " " + line);
        cv.notify_one();
      });
    } catch (const std::exception& e) {
      std::lock_guard lock(mutex);
      failure = e.what();
    }
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
  if (!failure.empty()) end_job("rank " + std::to_string(rank_) + ": " + failure, true);
  MPI_Send(nullptr, 0, MPI_CHAR, 0, kTagDone, MPI_COMM_WORLD);
}

// Rank 0: its own share on a thread, the others' results received here; every result goes through
// `sink` one at a time. Only the main thread may call MPI (MPI_THREAD_FUNNELED): it ends the job
// when the sink fails (a results file that cannot be written) or rank 0's own work does.
void MpiPool::receive_all(const std::vector<std::size_t>& mine, const std::function<bool(std::size_t)>& alone,
                          const std::function<std::string(std::size_t)>& work,
                          const std::function<void(std::size_t, const std::string&)>& sink) {
  std::mutex mutex;
  std::string failure;  // the first one: the sink's (bad input) or rank 0's work's (internal)
  bool internal = false;
  auto record = [&](std::size_t i, const std::string& line) {
    std::lock_guard lock(mutex);
    if (!failure.empty()) return;
    try {
      sink(i, line);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  };
  auto stop_on_failure = [&] {
    std::lock_guard lock(mutex);
    if (!failure.empty()) end_job(failure, internal);
  };
  std::thread compute([&] {
    try {
      run_local(mine, jobs_, alone, work, record);
    } catch (const std::exception& e) {
      std::lock_guard lock(mutex);
      if (failure.empty()) failure = "rank 0: " + std::string(e.what()), internal = true;
    }
  });
  for (int remaining = size_ - 1; remaining > 0;) {
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
    const std::size_t space = msg.find(' ');
    if (space != std::string::npos) record(std::stoull(msg.substr(0, space)), msg.substr(space + 1));
    stop_on_failure();
  }
  compute.join();
  stop_on_failure();
}

}  // namespace piper::search
