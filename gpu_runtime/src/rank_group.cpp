// The two RankGroups: MPI_COMM_WORLD, and threads of one process meeting at a ThreadMeeting.
#include "piper/runtime/rank_group.hpp"

#include <algorithm>
#include <thread>
#include <type_traits>

#include <fmt/format.h>
#include <mpi.h>

#include "piper/runtime/executor.hpp"
#include "piper/runtime/trainer.hpp"

namespace piper::runtime {

// ---------------------------------------------------------------------------------------------
// MPI
// ---------------------------------------------------------------------------------------------
namespace {

template <class Container>
Gathered<Container> mpi_gather(const Container& mine, int rank, int size) {
  using T = typename Container::value_type;
  static_assert(std::is_same_v<T, char> || std::is_same_v<T, double>, "mpi_gather: bytes or doubles");
  const MPI_Datatype type = std::is_same_v<T, double> ? MPI_DOUBLE : MPI_BYTE;
  Gathered<Container> g;
  int n = static_cast<int>(mine.size());
  if (rank == 0) g.sizes.resize(static_cast<std::size_t>(size)), g.offsets.resize(static_cast<std::size_t>(size));
  MPI_Gather(&n, 1, MPI_INT, g.sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int total = 0;
  for (std::size_t i = 0; i < g.sizes.size(); ++i) g.offsets[i] = total, total += g.sizes[i];
  g.all.resize(static_cast<std::size_t>(total));
  MPI_Gatherv(mine.data(), n, type, g.all.data(), g.sizes.data(), g.offsets.data(), type, 0, MPI_COMM_WORLD);
  return g;
}

class MpiWorldGroup : public RankGroup {
 public:
  MpiWorldGroup() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void barrier() override { MPI_Barrier(MPI_COMM_WORLD); }
  void sum(std::vector<double>& v) override {
    MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  }
  void max(std::vector<double>& v) override {
    MPI_Allreduce(MPI_IN_PLACE, v.data(), static_cast<int>(v.size()), MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  }
  Gathered<std::string> gather(const std::string& mine) override { return mpi_gather(mine, rank_, size_); }
  Gathered<std::vector<double>> gather(const std::vector<double>& mine) override {
    return mpi_gather(mine, rank_, size_);
  }
  int broadcast(int value) override {
    MPI_Bcast(&value, 1, MPI_INT, 0, MPI_COMM_WORLD);
    return value;
  }

 private:
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<RankGroup> mpi_world_group() { return std::make_unique<MpiWorldGroup>(); }

// ---------------------------------------------------------------------------------------------
// Threads
// ---------------------------------------------------------------------------------------------
void ThreadMeeting::wait_all(std::unique_lock<std::mutex>& lock, const char* what, const std::function<void()>& idle) {
  if (abandoned_) throw ReportedByAnotherRank();
  const std::uint64_t generation = generation_;
  if (++arrived_ == members_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  auto released = [&] { return generation_ != generation || abandoned_; };
  auto timed_out = [&] {
    abandoned_ = true;  // the group cannot meet again: release the others too
    cv_.notify_all();
    throw RuntimeError(fmt::format("runtime: {} waited {:.0f} s for its members (a peer died or the plan deadlocks)",
                                   what, timeout_s_));
  };
  if (idle) {
    const auto t0 = std::chrono::steady_clock::now();
    while (!released()) {
      lock.unlock();
      idle();
      lock.lock();
      if (cv_.wait_for(lock, std::chrono::microseconds(100), released)) break;
      if (timeout_s_ > 0 && std::chrono::steady_clock::now() - t0 > std::chrono::duration<double>(timeout_s_))
        timed_out();
    }
  } else if (timeout_s_ <= 0) {
    cv_.wait(lock, released);
  } else if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s_), released)) {
    timed_out();
  }
  if (generation_ == generation) throw ReportedByAnotherRank();  // released by abandon()
}

void ThreadMeeting::meet(int member, const void* mine, const std::function<void(const std::vector<const void*>&)>& use,
                         const char* what, const std::function<void()>& idle) {
  std::unique_lock<std::mutex> lock(mutex_);
  slots_.at(static_cast<std::size_t>(member)) = mine;
  wait_all(lock, what, idle);
  // Every slot is filled and stays valid until the second wait: read them without the lock.
  const std::vector<const void*> slots = slots_;
  lock.unlock();
  use(slots);
  lock.lock();
  wait_all(lock, what, idle);
}

void ThreadMeeting::abandon() {
  std::lock_guard<std::mutex> lock(mutex_);
  abandoned_ = true;
  cv_.notify_all();
}

void ThreadRankGroup::barrier() {
  meeting_.meet(rank_, nullptr, [](const std::vector<const void*>&) {});
}

namespace {
template <class Op>
void reduce(ThreadMeeting& meeting, int rank, std::vector<double>& v, Op op) {
  std::vector<double> out = v;
  meeting.meet(rank, &v, [&](const std::vector<const void*>& all) {
    for (std::size_t r = 0; r < all.size(); ++r) {
      const auto& theirs = *static_cast<const std::vector<double>*>(all[r]);
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = r == 0 ? theirs.at(i) : op(out[i], theirs.at(i));
    }
  });
  v = std::move(out);
}

template <class Container>
Gathered<Container> gather_threads(ThreadMeeting& meeting, int rank, const Container& mine) {
  Gathered<Container> g;
  meeting.meet(rank, &mine, [&](const std::vector<const void*>& all) {
    if (rank != 0) return;
    for (const void* p : all) {
      const auto& theirs = *static_cast<const Container*>(p);
      g.offsets.push_back(static_cast<int>(g.all.size()));
      g.sizes.push_back(static_cast<int>(theirs.size()));
      g.all.insert(g.all.end(), theirs.begin(), theirs.end());
    }
  });
  return g;
}
}  // namespace

void ThreadRankGroup::sum(std::vector<double>& v) {
  reduce(meeting_, rank_, v, [](double a, double b) { return a + b; });
}
void ThreadRankGroup::max(std::vector<double>& v) {
  reduce(meeting_, rank_, v, [](double a, double b) { return std::max(a, b); });
}
Gathered<std::string> ThreadRankGroup::gather(const std::string& mine) { return gather_threads(meeting_, rank_, mine); }
Gathered<std::vector<double>> ThreadRankGroup::gather(const std::vector<double>& mine) {
  return gather_threads(meeting_, rank_, mine);
}
int ThreadRankGroup::broadcast(int value) {
  int out = value;
  meeting_.meet(rank_, &value, [&](const std::vector<const void*>& all) { out = *static_cast<const int*>(all[0]); });
  return out;
}

void run_rank_threads(int ranks, const std::function<void(RankGroup&)>& body, const std::function<void()>& on_failure) {
  ThreadMeeting meeting(ranks);
  std::mutex error_mutex;
  std::exception_ptr first;
  bool reported = false;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        ThreadRankGroup group(meeting, r);
        body(group);
      } catch (const ReportedByAnotherRank&) {
        {
          std::lock_guard<std::mutex> lock(error_mutex);
          reported = true;
        }
        meeting.abandon();
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!first) first = std::current_exception();
        }
        meeting.abandon();
        if (on_failure) on_failure();
      }
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
  if (reported) throw ReportedByAnotherRank();
}

}  // namespace piper::runtime
