// The shared executor dataflow (runtime::Dataflow) on the CUDA backend's code path, without a GPU or
// MPI: the devices of a plan run as threads of one process (as the CUDA backend's virtual devices do),
// over an in-process transport whose requests complete only on a later test() (like NCCL/loopback
// work in flight), with kernels whose ops complete only on a later poll (like CUDA events). The
// kernels are the host's Eigen kernels, so the losses must match the single-process reference.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "piper/core/scenario.hpp"
#include "piper/runtime/dataflow.hpp"
#include "piper/runtime/executor.hpp"
#include "piper/runtime/host_backend.hpp"
#include "piper/runtime/trainer.hpp"

namespace core = piper::core;
namespace rt = piper::runtime;

namespace {

const std::string kMoe = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json";
const std::string kGpt = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-gpt.json";
using Buf = std::vector<float>;

// Rendezvous of the virtual devices: point-to-point messages by (source, destination, pairing id);
// collectives by (kind, family, the group's first device, how many of them this family ran before).
class Hub {
 public:
  using P2PKey = std::tuple<int, int, int>;
  using CollKey = std::tuple<int, int, int, int>;
  struct Member {
    Buf send;
    Buf* recv = nullptr;
  };
  struct Exchange {
    std::map<int, Member> members;  // by rank in the group
    bool done = false;
  };
  std::mutex mutex;
  std::map<P2PKey, Buf> mailbox;
  std::map<CollKey, Exchange> open;
};

// The in-process transport: a request completes on its second test() at the earliest (the dataflow
// must keep it in flight and come back), a receive once its message is there, a collective once every
// member posted.
class ThreadTransport {
 public:
  ThreadTransport(Hub& hub, int device) : hub_(hub), device_(device) {}
  int post(const rt::CommPost<Buf>& r, const rt::HostKernels::Ctx&) {
    std::lock_guard<std::mutex> lock(hub_.mutex);
    Ticket t;
    t.kind = r.kind;
    if (r.kind == rt::CommKind::Send) {
      hub_.mailbox[{device_, r.peer, r.pair}] = *r.send;
    } else if (r.kind == rt::CommKind::Recv) {
      t.p2p = {r.peer, device_, r.pair};
      t.recv = r.recv;
    } else {
      const int seq = sequence_[{static_cast<int>(r.kind), r.family}]++;
      t.coll = {static_cast<int>(r.kind), r.family, r.group.front(), seq};
      auto& ex = hub_.open[t.coll];
      const int rank = static_cast<int>(std::find(r.group.begin(), r.group.end(), device_) - r.group.begin());
      ex.members[rank] = Hub::Member{r.kind == rt::CommKind::AllReduce ? *r.recv : *r.send, r.recv};
      if (static_cast<int>(ex.members.size()) == static_cast<int>(r.group.size())) finish(r.kind, ex);
    }
    tickets_[next_] = t;
    return next_++;
  }
  bool test(int ticket) {
    std::lock_guard<std::mutex> lock(hub_.mutex);
    Ticket& t = tickets_.at(ticket);
    if (t.tests++ == 0) return false;
    if (t.kind == rt::CommKind::Recv) {
      auto it = hub_.mailbox.find(t.p2p);
      if (it == hub_.mailbox.end()) return false;
      *t.recv = std::move(it->second);
      hub_.mailbox.erase(it);
    } else if (t.kind != rt::CommKind::Send) {
      if (!hub_.open.at(t.coll).done) return false;
    }
    ++completed;
    tickets_.erase(ticket);
    return true;
  }
  std::string name() const { return "threads"; }
  int completed = 0;

 private:
  struct Ticket {
    rt::CommKind kind = rt::CommKind::Send;
    Hub::P2PKey p2p{};
    Hub::CollKey coll{};
    Buf* recv = nullptr;
    int tests = 0;
  };
  // The last member to post computes every member's result.
  static void finish(rt::CommKind kind, Hub::Exchange& ex) {
    const auto ranks = ex.members.size();
    const std::size_t n = ex.members.at(0).send.size();
    for (auto& [rank, m] : ex.members) {
      const auto r = static_cast<std::size_t>(rank);
      Buf& out = *m.recv;
      for (std::size_t i = 0; i < out.size(); ++i) {
        float v = 0;
        if (kind == rt::CommKind::AllReduce) {
          for (auto& [q, other] : ex.members) v += other.send[i];
        } else if (kind == rt::CommKind::ReduceScatter) {
          for (auto& [q, other] : ex.members) v += other.send[r * out.size() + i];
        } else if (kind == rt::CommKind::AllGather) {
          v = ex.members.at(static_cast<int>(i / n)).send[i % n];
        } else {  // AllToAll: block j of my result is member j's block for me
          const std::size_t block = n / ranks;
          v = ex.members.at(static_cast<int>(i / block)).send[r * block + i % block];
        }
        out[i] = v;
      }
    }
    ex.done = true;
  }
  Hub& hub_;
  int device_;
  std::map<std::pair<int, int>, int> sequence_;
  std::map<int, Ticket> tickets_;
  int next_ = 0;
};

// The host kernels with completion markers that report an op done only on its second poll.
class AsyncKernels : public rt::HostKernels {
 public:
  using rt::HostKernels::HostKernels;
  struct Mark {
    int polls = 0;
    bool ended = false;
  };
  Mark begin_op(const Ctx&) { return {}; }
  void end_op(const Ctx&, Mark& m) { m.ended = true; }
  bool op_done(const core::OpRef&, Mark& m, const core::Op&) {
    if (!m.ended) throw rt::RuntimeError("an op was polled done before its work ended");
    if (m.polls++ == 0) return false;
    ++completed;
    return true;
  }
  int completed = 0;
};

core::Program compile(core::StrategyOptions o, const std::string& model = kMoe) {
  core::Scenario s;
  s.model = model;
  s.strategy = o;
  return core::compile_scenario(s).result.program;
}

core::StrategyOptions strategy(int pp, int dp, int ep, int zero, const std::string& schedule) {
  core::StrategyOptions o;
  o.pp = pp, o.dp = dp, o.ep = ep, o.zero = zero, o.microbatches = 4, o.schedule = schedule;
  if (zero >= 2) o.reduce_every = "step";  // what the CUDA backend runs
  return o;
}

// Losses of `steps` steps with every device of `program` a thread over the dataflow.
std::vector<double> train_on_threads(const core::Program& program, int steps, const rt::host::AdamWConfig& adamw,
                                     int* comm_done, int* ops_done) {
  const int n = program.num_devices;
  const core::Model model = rt::program_model(program);
  const rt::DataShape shape = rt::data_shape(program);
  Hub hub;
  std::vector<std::vector<double>> loss(static_cast<std::size_t>(n),
                                        std::vector<double>(static_cast<std::size_t>(steps), 0.0));
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<int> comm(static_cast<std::size_t>(n)), ops(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d)
    threads.emplace_back([&, d] {
      const auto i = static_cast<std::size_t>(d);
      try {
        rt::host::HostModel m(model, rt::device_segments(program, d), 1);
        AsyncKernels kernels(m, shape, adamw);
        ThreadTransport transport(hub, d);
        rt::Dataflow<AsyncKernels, ThreadTransport> flow(program, d, kernels, transport, 1, "");
        rt::Executor executor(program.plan_for(d), flow, rt::ExecutorOptions{60});
        for (int step = 0; step < steps; ++step) {
          executor.run_step(step);
          loss[i][static_cast<std::size_t>(step)] = flow.loss_sum();
        }
        comm[i] = transport.completed, ops[i] = kernels.completed;
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int d = 0; d < n; ++d) EXPECT_EQ(errors[static_cast<std::size_t>(d)], "") << "device " << d;
  std::vector<double> out(static_cast<std::size_t>(steps), 0.0);
  for (int step = 0; step < steps; ++step) {
    for (int d = 0; d < n; ++d)
      out[static_cast<std::size_t>(step)] += loss[static_cast<std::size_t>(d)][static_cast<std::size_t>(step)];
    out[static_cast<std::size_t>(step)] /= static_cast<double>(shape.global_tokens());
  }
  *comm_done = *ops_done = 0;
  for (int d = 0; d < n; ++d)
    *comm_done += comm[static_cast<std::size_t>(d)], *ops_done += ops[static_cast<std::size_t>(d)];
  return out;
}

void expect_matches_reference(const core::StrategyOptions& o, const std::string& model = kMoe) {
  const core::Program program = compile(o, model);
  rt::TrainOptions t;
  t.steps = 3;
  t.print = false;
  t.adamw.eps = 1e-6f;  // as the MPI equivalence tests (test_runtime.cpp explains the tolerance)
  const auto reference = rt::train_reference(program, t);
  int comm = 0, ops = 0;
  const auto losses = train_on_threads(program, t.steps, t.adamw, &comm, &ops);
  ASSERT_EQ(losses.size(), reference.losses.size());
  for (std::size_t s = 0; s < losses.size(); ++s)
    EXPECT_NEAR(losses[s], reference.losses[s], 1e-5 * std::abs(reference.losses[s])) << "step " << s + 1;
  // Every op of every step went through the asynchronous completion, and communication ran.
  std::int64_t total_ops = 0;
  for (int d = 0; d < program.num_devices; ++d) total_ops += program.plan_for(d).op_count();
  EXPECT_EQ(ops, total_ops * t.steps);
  EXPECT_GT(comm, 0);
}

}  // namespace

TEST(RuntimeDataflow, OneFOneB_PP2xDP2_OnThreadsMatchesTheReference) {
  expect_matches_reference(strategy(2, 2, 1, 0, "1f1b"));
}
TEST(RuntimeDataflow, Zero3_PP2xDP2xEP2_OnThreadsMatchesTheReference) {
  expect_matches_reference(strategy(2, 2, 2, 3, "1f1b"));
}
TEST(RuntimeDataflow, DualPipeV_PP2xDP2xEP2_OnThreadsMatchesTheReference) {
  expect_matches_reference(strategy(2, 2, 2, 0, "dualpipev"));
}
TEST(RuntimeDataflow, ZBH1_Zero1_PP2xDP2_OnThreadsMatchesTheReference) {
  expect_matches_reference(strategy(2, 2, 1, 1, "zb-h1"));
}
// HSDP (ZeRO-3 shards over groups of 2 of 4 replicas: reduce-scatter in the group, all-reduce of the
// chunk across the groups) and ZeRO-2 reducing after every microbatch (the chunk accumulated by each
// reduce-scatter, the whole gradient zeroed after it): what the CUDA backend runs of them is this.
TEST(RuntimeDataflow, Hsdp_Zero3_DP4_OnThreadsMatchesTheReference) {
  core::StrategyOptions o = strategy(1, 4, 1, 3, "1f1b");
  o.dp_shard = 2;
  expect_matches_reference(o);
}
TEST(RuntimeDataflow, Zero2_ReduceEveryMicrobatch_PP2xDP2_OnThreadsMatchesTheReference) {
  core::StrategyOptions o = strategy(2, 2, 1, 2, "1f1b");
  o.reduce_every = "microbatch";
  expect_matches_reference(o);
}
// A GPT-style model whose head, on the second stage, keeps a copy of the embedding table: the two
// copies' gradients are summed over the tied-embedding family before the update.
TEST(RuntimeDataflow, GptTied_PP2xDP2_OnThreadsMatchesTheReference) {
  expect_matches_reference(strategy(2, 2, 1, 0, "1f1b"), kGpt);
}
