// The worker pool over the ranks of an MPI job (`piper sweep` under mpirun): every rank runs a
// round-robin share of the items on its own threads and streams its result lines to rank 0, which
// owns the results file. In its own library (piper_search_mpi), so that piper_search needs no MPI.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "piper/search/worker_pool.hpp"

namespace piper::search {

// True when this process was started by mpirun/mpiexec in a job of more than one rank (Open MPI,
// PMIx or PMI environment), so that a plain `piper sweep` never initializes MPI.
bool launched_under_mpi();

// MPI_COMM_WORLD as a WorkerPool: initializes MPI (funneled: only the calling thread calls MPI) and
// finalizes it when destroyed. A failure that must end the job is given to `report`, which prints its
// one line and returns the exit status the job ends with: internal is false for abort() and a failed
// sink (bad input: a results file that cannot be written), true for an exception of work (a bug:
// work answers bad input with a result line).
class MpiPool final : public WorkerPool {
 public:
  using Report = std::function<int(const std::string& message, bool internal)>;
  MpiPool(int jobs, Report report);
  ~MpiPool() override;
  MpiPool(const MpiPool&) = delete;
  MpiPool& operator=(const MpiPool&) = delete;
  bool owner() const override { return rank_ == 0; }
  int processes() const override { return size_; }
  int rank() const { return rank_; }
  void share(std::string& text) override;
  void share(std::vector<std::size_t>& items) override;
  void run(const std::vector<std::size_t>& items, const std::function<bool(std::size_t)>& alone,
           const std::function<std::string(std::size_t)>& work,
           const std::function<void(std::size_t, const std::string&)>& sink) override;
  [[noreturn]] void abort(const std::string& message) override;

 private:
  void send_share(const std::vector<std::size_t>& mine, const std::function<bool(std::size_t)>& alone,
                  const std::function<std::string(std::size_t)>& work);
  [[noreturn]] void end_job(const std::string& message, bool internal);
  void receive_all(const std::vector<std::size_t>& mine, const std::function<bool(std::size_t)>& alone,
                   const std::function<std::string(std::size_t)>& work,
                   const std::function<void(std::size_t, const std::string&)>& sink);
  int jobs_;
  Report report_;
  int rank_ = 0, size_ = 1;
};

}  // namespace piper::search
