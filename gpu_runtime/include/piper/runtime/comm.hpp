// What every transport shares: the kinds of communication, and the rendezvous of the loopback
// transports, where the virtual devices of one process (one thread each) meet to exchange tensors.
// The host loopback (host_backend.hpp) and the CUDA loopback (cuda/transport.hpp) name an exchange and
// track its members here; each does only the data movement of its own memory.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace piper::runtime {

enum class CommKind { Send, Recv, AllReduce, ReduceScatter, AllGather, AllToAll };

// One exchange as the loopback hub knows it, and this device's place in it.
struct LoopbackName {
  using Key = std::tuple<int, int, int, int, std::int64_t>;  // (kind, a, b, c, sequence)
  Key key;
  int rank = 0;      // this device's member index: 0 sender / 1 receiver, or its rank in the group
  int expected = 2;  // members the exchange waits for
};

// Names the exchanges of one device. Both sides of a transfer name it by (sender, receiver,
// pairing id), every member of a collective occurrence by (family, first member, pairing id): the
// pairing ids of core/readiness.hpp, so members meet whatever order they post in (the groups of a
// family are disjoint). A per-name sequence number tells the steps apart.
class LoopbackNamer {
 public:
  explicit LoopbackNamer(int device) : device_(device) {}
  // Throws std::logic_error when a collective's group does not hold this device.
  LoopbackName name(CommKind kind, int peer, int pair, int family, const std::vector<int>& group) {
    LoopbackName n;
    int a = 0, b = 0;
    if (kind == CommKind::Send || kind == CommKind::Recv) {
      a = kind == CommKind::Send ? device_ : peer;
      b = kind == CommKind::Send ? peer : device_;
      n.rank = kind == CommKind::Send ? 0 : 1;
    } else {
      a = family;
      b = group.empty() ? -1 : group.front();
      n.expected = static_cast<int>(group.size());
      n.rank = -1;
      for (std::size_t i = 0; i < group.size(); ++i)
        if (group[i] == device_) n.rank = static_cast<int>(i);
      if (n.rank < 0)
        throw std::logic_error("loopback: device " + std::to_string(device_) +
                               " posted a collective of a group it is not in");
    }
    const int k = static_cast<int>(kind == CommKind::Recv ? CommKind::Send : kind);
    const std::int64_t seq = sequence_[{k, a, b, pair}]++;
    n.key = {k, a, b, pair, seq};
    return n;
  }

 private:
  int device_;
  std::map<std::tuple<int, int, int, int>, std::int64_t> sequence_;
};

// The open exchanges of a set of virtual devices. Member: what one device posted; Shared: what the
// exchange holds once launched (the CUDA loopback: its completion event). Thread-safe.
template <class Member, class Shared>
class LoopbackTable {
 public:
  struct Rendezvous {
    int expected = 0;
    std::map<int, Member> members;  // by member index
    std::set<int> seen_done;        // members that saw the exchange complete
    bool launched = false;
    Shared shared{};
  };
  // Adds `m` as member `n.rank` of its exchange; the member that completes it calls launch(rendezvous)
  // with the table locked (it moves the data, or enqueues the moves).
  template <class Launch>
  void join(const LoopbackName& n, Member m, int device, Launch&& launch) {
    std::lock_guard<std::mutex> lock(mutex_);
    Rendezvous& rv = open_[n.key];
    rv.expected = n.expected;
    if (rv.members.count(n.rank))
      throw std::logic_error("loopback: device " + std::to_string(device) + " posted the same exchange twice");
    rv.members.emplace(n.rank, std::move(m));
    if (static_cast<int>(rv.members.size()) == rv.expected) {
      launch(rv);
      rv.launched = true;
    }
  }
  // Whether the exchange completed for member `n.rank`: launched and done(rendezvous) true. The last
  // member to see it complete calls release(rendezvous) and the table forgets it.
  template <class Done, class Release>
  bool test(const LoopbackName& n, Done&& done, Release&& release) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = open_.find(n.key);
    if (it == open_.end()) throw std::logic_error("loopback: an exchange tested after it was released");
    Rendezvous& rv = it->second;
    if (!rv.launched || !done(rv)) return false;
    rv.seen_done.insert(n.rank);
    if (static_cast<int>(rv.seen_done.size()) == rv.expected) {
      release(rv);
      open_.erase(it);
    }
    return true;
  }

 private:
  std::mutex mutex_;
  std::map<LoopbackName::Key, Rendezvous> open_;
};

}  // namespace piper::runtime
