// The thread worker pool shared by sweeps and the tuner (the MPI one is worker_pool_mpi.cpp).
#include "piper/search/worker_pool.hpp"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace piper::search {

std::size_t run_pool(std::size_t count, int jobs, const std::function<void(std::size_t)>& work,
                     const std::function<bool()>& stop) {
  std::atomic<std::size_t> next{0};
  std::atomic<std::size_t> started{0};
  std::mutex mutex;
  std::exception_ptr failure;
  auto worker = [&] {
    try {
      while (true) {
        if (stop && stop()) {
          next = count;
          return;
        }
        const std::size_t i = next++;
        if (i >= count) return;
        started += 1;
        work(i);
      }
    } catch (...) {
      std::lock_guard lock(mutex);
      if (!failure) failure = std::current_exception();
      next = count;
    }
  };
  const int threads_wanted = std::max(1, std::min<int>(jobs, static_cast<int>(count)));
  std::vector<std::thread> threads;
  for (int t = 1; t < threads_wanted; ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  if (failure) std::rethrow_exception(failure);
  return std::min(started.load(), count);
}

void run_local(const std::vector<std::size_t>& items, int jobs, const std::function<bool(std::size_t)>& alone,
               const std::function<std::string(std::size_t)>& work,
               const std::function<void(std::size_t, const std::string&)>& emit) {
  std::vector<std::size_t> parallel, serial;
  for (std::size_t i : items) (alone && alone(i) ? serial : parallel).push_back(i);
  std::mutex mutex;
  run_pool(parallel.size(), jobs, [&](std::size_t k) {
    const std::string line = work(parallel[k]);
    std::lock_guard lock(mutex);
    emit(parallel[k], line);
  });
  // Forking while other threads may hold locks (allocator arenas aside, e.g. stdio or a registry
  // mutex) could deadlock the child, so these run with no other worker alive.
  for (std::size_t i : serial) emit(i, work(i));
}

void ThreadPool::run(const std::vector<std::size_t>& items, const std::function<bool(std::size_t)>& alone,
                     const std::function<std::string(std::size_t)>& work,
                     const std::function<void(std::size_t, const std::string&)>& sink) {
  run_local(items, jobs_, alone, work, sink);
}

void ThreadPool::abort(const std::string& message) { throw std::runtime_error(message); }

}  // namespace piper::search
