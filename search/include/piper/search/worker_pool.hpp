// Where a search's independent items run: the threads of this process (ThreadPool) or the ranks of an
// MPI job, each on its own threads (MpiPool, worker_pool_mpi.hpp). Sweeps run on either; the tuner's
// phases use run_pool directly (its budget stops the pool).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace piper::search {

// Runs work(i) for i in [0, count) on `jobs` threads (the caller's thread is one of them). Before
// starting an item each worker asks `stop` (when given); once it says yes no new item starts and
// the running ones finish. Returns how many items started. The first exception thrown by `work` stops
// the pool and is rethrown.
std::size_t run_pool(std::size_t count, int jobs, const std::function<void(std::size_t)>& work,
                     const std::function<bool()>& stop = {});

// A pool of workers over one or more processes. Items are indices into a list every process holds
// (each derives it from the same shared input); one process, the owner, holds the results file and
// receives every item's result line.
class WorkerPool {
 public:
  virtual ~WorkerPool() = default;
  // Whether this process receives the results (the only process of a ThreadPool; MPI rank 0).
  virtual bool owner() const = 0;
  // How many processes share the items.
  virtual int processes() const = 0;
  // The owner's `text` (or `items`), on every process; collective: every process calls it.
  virtual void share(std::string& text) = 0;
  virtual void share(std::vector<std::size_t>& items) = 0;
  // Every process runs its share of `items` (dealt round-robin by position): first those `alone` says
  // no to, on its threads, then the others one at a time with no other worker alive (the SimGrid
  // engine forks a child per run). work(i) returns item i's result line; on the owner sink(i, line)
  // runs once per item of every process, one call at a time. An exception of work or sink stops the
  // run: the thread pool rethrows it; the MPI pool reports it in one line and ends the job (a sink's
  // as bad input, a work's as a bug).
  virtual void run(const std::vector<std::size_t>& items, const std::function<bool(std::size_t)>& alone,
                   const std::function<std::string(std::size_t)>& work,
                   const std::function<void(std::size_t, const std::string&)>& sink) = 0;
  // Ends every process after one line saying why (a process that cannot go on while the others wait
  // for it in a collective); the thread pool throws std::runtime_error(message) instead.
  [[noreturn]] virtual void abort(const std::string& message) = 0;
};

// The threads of this process: `jobs` workers (the caller's thread among them).
class ThreadPool final : public WorkerPool {
 public:
  explicit ThreadPool(int jobs) : jobs_(jobs) {}
  bool owner() const override { return true; }
  int processes() const override { return 1; }
  void share(std::string&) override {}
  void share(std::vector<std::size_t>&) override {}
  void run(const std::vector<std::size_t>& items, const std::function<bool(std::size_t)>& alone,
           const std::function<std::string(std::size_t)>& work,
           const std::function<void(std::size_t, const std::string&)>& sink) override;
  [[noreturn]] void abort(const std::string& message) override;

 private:
  int jobs_;
};

// Runs `items` of this process on `jobs` threads and then the `alone` ones one at a time, calling
// emit(i, line) one call at a time (what ThreadPool::run and each MPI rank do with its share).
void run_local(const std::vector<std::size_t>& items, int jobs, const std::function<bool(std::size_t)>& alone,
               const std::function<std::string(std::size_t)>& work,
               const std::function<void(std::size_t, const std::string&)>& emit);

}  // namespace piper::search
