// The ranks of one training run as the training loop meets them: the MPI ranks of MPI_COMM_WORLD (one
// process per device), or the threads of one process (virtual devices, one thread each). The loop
// (trainer.hpp's train_ranks) is written once against RankGroup; every member calls its operations
// in the same order (they are collective).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace piper::runtime {

// On rank 0: `all` holds every rank's values back to back, rank r's starting at offsets[r] and
// sizes[r] long. On the other ranks all three are left empty.
template <class Container>
struct Gathered {
  Container all;
  std::vector<int> offsets, sizes;
};

class RankGroup {
 public:
  virtual ~RankGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual void barrier() = 0;
  // In place, element by element, over every rank's vector of the same length.
  virtual void sum(std::vector<double>& values) = 0;
  virtual void max(std::vector<double>& values) = 0;
  // Every rank's values on rank 0, in rank order.
  virtual Gathered<std::string> gather(const std::string& mine) = 0;
  virtual Gathered<std::vector<double>> gather(const std::vector<double>& mine) = 0;
  // Rank 0's value on every rank.
  virtual int broadcast(int value) = 0;
};

// MPI_COMM_WORLD (MPI_Init done by the caller).
std::unique_ptr<RankGroup> mpi_world_group();

// ---- Threads of one process ----

// Where `members` threads meet. meet(): each deposits a pointer, and once all have, each runs
// use(every member's pointer, in member order); then all leave together, so what a pointer points to
// may change only after meet() returns. A member that fails calls abandon(): every member waiting, or
// arriving later, throws ReportedByAnotherRank (trainer.hpp) instead of waiting for it. A wait longer
// than `timeout` (a member that never arrives) throws RuntimeError naming `what`.
class ThreadMeeting {
 public:
  explicit ThreadMeeting(int members, double timeout_s = 0) : members_(members), timeout_s_(timeout_s) {
    slots_.resize(static_cast<std::size_t>(members));
  }
  int members() const { return members_; }
  // `idle`, if set, runs (without the meeting's lock) every ~100 us while this member waits: a device
  // waiting inside a compute op keeps its other streams moving (Backend::progress).
  void meet(int member, const void* mine, const std::function<void(const std::vector<const void*>&)>& use,
            const char* what = "a thread group", const std::function<void()>& idle = {});
  void abandon();

 private:
  void wait_all(std::unique_lock<std::mutex>& lock, const char* what, const std::function<void()>& idle);
  std::mutex mutex_;
  std::condition_variable cv_;
  int members_;
  double timeout_s_;  // 0: no limit
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool abandoned_ = false;
  std::vector<const void*> slots_;
};

// One thread's view of a ThreadMeeting as a RankGroup.
class ThreadRankGroup : public RankGroup {
 public:
  ThreadRankGroup(ThreadMeeting& meeting, int rank) : meeting_(meeting), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return meeting_.members(); }
  void barrier() override;
  void sum(std::vector<double>& values) override;
  void max(std::vector<double>& values) override;
  Gathered<std::string> gather(const std::string& mine) override;
  Gathered<std::vector<double>> gather(const std::vector<double>& mine) override;
  int broadcast(int value) override;

 private:
  ThreadMeeting& meeting_;
  int rank_;
};

// Runs body(group) on `ranks` threads (rank r: group.rank() == r) and waits for all. A rank that
// throws abandons the group and calls on_failure (which should release whatever else the ranks wait
// on, e.g. their transport), so the others stop at their next group operation or wait. Rethrows the
// first error that is not ReportedByAnotherRank, as thrown.
void run_rank_threads(int ranks, const std::function<void(RankGroup&)>& body,
                      const std::function<void()>& on_failure = {});

}  // namespace piper::runtime
