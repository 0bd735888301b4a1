// The backend-neutral executor over a scripted backend: stream order, cross-stream waits, buffer
// accounting and the stall watchdog, on a hand-made three-op plan.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "piper/runtime/executor.hpp"

using namespace piper;

namespace {

// compute: A, C (C waits for comm op 0); comm: B (waits for A, completes after `polls` polls).
// Buffers: params 1000 B persistent; X 100 B from A to C; Y 50 B from B to C.
core::Plan three_op_plan() {
  core::Plan plan;
  core::Op a, b, c;
  a.label = "A";
  b.label = "B";
  b.kind = core::OpKind::Send;
  b.pair = 0;
  b.waits = {{0, 0}};
  c.label = "C";
  c.waits = {{1, 0}};
  plan.streams = {core::Stream{"compute", {a, c}}, core::Stream{"comm", {b}}};
  plan.buffers = {{"params", core::BufferKind::Parameters, 1000, {}, {}},
                  {"X", core::BufferKind::Activations, 100, {0, 0}, {0, 1}},
                  {"Y", core::BufferKind::Received, 50, {1, 0}, {0, 1}}};
  return plan;
}

struct ScriptedBackend : runtime::Backend {
  int polls_needed = 3;
  int polls = 0;
  std::vector<std::string> events;
  std::vector<int> freed;
  void begin_step(int) override { events.clear(), polls = 0; }
  bool start(const core::OpRef&, const core::Op& op) override {
    events.push_back("start " + op.label);
    return op.kind == core::OpKind::Compute;
  }
  bool poll(const core::OpRef&, const core::Op& op) override {
    if (++polls < polls_needed) return false;
    events.push_back("done " + op.label);
    return true;
  }
  void buffer_freed(int b) override { freed.push_back(b); }
  void end_step() override {}
};

}  // namespace

TEST(RuntimeExecutor, WaitsOrderAndMemory) {
  const core::Plan plan = three_op_plan();
  ScriptedBackend backend;
  runtime::Executor ex(plan, backend);
  const auto m = ex.run_step(0);
  // C may only start once B (on the other stream) completed, although it is next on its stream.
  EXPECT_EQ(backend.events, (std::vector<std::string>{"start A", "start B", "done B", "start C"}));
  EXPECT_EQ(m.ops, 3);
  ASSERT_EQ(m.timeline.spans.size(), 3u);
  EXPECT_LE(m.timeline.spans[2].end_s, m.timeline.spans[1].start_s);  // B (comm #0) ended before C started
  // Peak: params + X + Y = 1000 + 100 + 50; both transient buffers freed after C.
  EXPECT_EQ(m.timeline.peak_memory_bytes, 1150);
  EXPECT_EQ(m.timeline.memory.back().bytes, 1000);
  EXPECT_EQ(backend.freed, (std::vector<int>{1, 2}));
}

TEST(RuntimeExecutor, StallTimeoutNamesTheStuckOp) {
  const core::Plan plan = three_op_plan();
  ScriptedBackend backend;
  backend.polls_needed = 1 << 30;  // B never completes: a dead peer
  runtime::Executor ex(plan, backend, runtime::ExecutorOptions{0.2});
  try {
    ex.run_step(5);
    FAIL() << "expected a stall error";
  } catch (const runtime::RuntimeError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("step 5: no progress"), std::string::npos) << what;
    EXPECT_NE(what.find("comm: B"), std::string::npos) << what;
    EXPECT_NE(what.find("compute: not started C"), std::string::npos) << what;
  }
}
