// The backend-neutral executor: one cursor per stream, an op starts once its stream reached it and
// its cross-stream waits completed; communication stays in flight while other streams progress.
#include "piper/runtime/executor.hpp"

#include <algorithm>
#include <chrono>
#include <thread>

#include <fmt/format.h>

namespace piper::runtime {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
}  // namespace

Executor::Executor(const core::Plan& plan, Backend& backend, ExecutorOptions options)
    : plan_(plan), backend_(backend), options_(options) {
  std::size_t n = 0;
  for (const auto& s : plan_.streams) stream_base_.push_back(n), n += s.ops.size();
  allocs_.assign(n, {});
  frees_.assign(n, {});
  for (std::size_t b = 0; b < plan_.buffers.size(); ++b) {
    const auto& buf = plan_.buffers[b];
    if (buf.persistent()) {
      persistent_bytes_ += buf.bytes;
      continue;
    }
    allocs_.at(stream_base_.at(static_cast<std::size_t>(buf.alloc.stream)) + static_cast<std::size_t>(buf.alloc.index))
        .push_back(static_cast<int>(b));
    frees_.at(stream_base_.at(static_cast<std::size_t>(buf.free.stream)) + static_cast<std::size_t>(buf.free.index))
        .push_back(static_cast<int>(b));
  }
}

// One event loop over the plan's streams whose local state (cursors, spans, memory, the sweep's timers)
// every branch reads and writes; split, it would pass that state around whole.
StepMeasurement Executor::run_step(int step) {  // NOLINT(readability-function-size)
  const std::size_t streams = plan_.streams.size();
  std::vector<int> cursor(streams, 0);     // next op to start
  std::vector<int> completed(streams, 0);  // ops completed (a stream completes in order)
  std::vector<bool> in_flight(streams, false);
  StepMeasurement m;
  m.timeline.spans.reserve(static_cast<std::size_t>(plan_.op_count()));
  std::vector<core::OpSpan> spans(static_cast<std::size_t>(plan_.op_count()));
  std::int64_t memory = persistent_bytes_;

  backend_.begin_step(step);
  const auto t0 = Clock::now();
  m.timeline.memory.push_back({0.0, memory});
  m.timeline.peak_memory_bytes = memory;
  auto now_s = [&] { return seconds_between(t0, Clock::now()); };
  auto waits_done = [&](const core::Op& op) {
    return std::all_of(op.waits.begin(), op.waits.end(),
                       [&](const core::OpRef& w) { return completed[static_cast<std::size_t>(w.stream)] > w.index; });
  };
  auto finish = [&](std::size_t s) {
    const int index = completed[s]++;
    const std::size_t flat = stream_base_[s] + static_cast<std::size_t>(index);
    spans[flat].end_s = now_s();
    for (int b : frees_[flat]) {
      memory -= plan_.buffers[static_cast<std::size_t>(b)].bytes;
      m.timeline.memory.push_back({spans[flat].end_s, memory});
      backend_.buffer_freed(b);
    }
    in_flight[s] = false;
  };

  std::size_t remaining = static_cast<std::size_t>(plan_.op_count());
  auto last_progress = Clock::now();
  double backend_s = 0;     // this sweep's time inside the backend, of ops that progressed
  bool progressed = false;  // this sweep started or completed an op
  int running = -1;         // the stream whose compute op is inside Backend::start (it may wait there)
  // Point-to-point transfers: what a device waiting inside a compute op still starts and finishes
  // (below). Their data is a finished op's output or a later op's input, never what a running
  // compute op reads or writes; a collective's start or finish reads or writes the model's
  // gradients and parameters (a ZeRO reduce-scatter zeroes the gradients it sent), so it waits.
  auto p2p = [](const core::Op& op) { return op.kind == core::OpKind::Send || op.kind == core::OpKind::Recv; };
  // Starts as many ops of stream s as are ready (synchronous ones complete at once); with
  // `compute` false it stops before a compute op, with `p2p_only` before anything but a transfer.
  auto start_ready = [&](std::size_t s, bool compute, bool p2p_only = false) {
    const auto& ops = plan_.streams[s].ops;
    while (!in_flight[s] && cursor[s] < static_cast<int>(ops.size()) &&
           waits_done(ops[static_cast<std::size_t>(cursor[s])])) {
      const bool is_compute = ops[static_cast<std::size_t>(cursor[s])].kind == core::OpKind::Compute;
      if (!compute && is_compute) return;
      if (p2p_only && !p2p(ops[static_cast<std::size_t>(cursor[s])])) return;
      const int index = cursor[s]++;
      const std::size_t flat = stream_base_[s] + static_cast<std::size_t>(index);
      spans[flat] = core::OpSpan{static_cast<std::int32_t>(s), index, now_s(), 0.0};
      for (int b : allocs_[flat]) {
        memory += plan_.buffers[static_cast<std::size_t>(b)].bytes;
        m.timeline.memory.push_back({spans[flat].start_s, memory});
        if (memory > m.timeline.peak_memory_bytes)
          m.timeline.peak_memory_bytes = memory, m.timeline.peak_memory_time_s = spans[flat].start_s;
      }
      in_flight[s] = true;
      const auto b0 = Clock::now();
      if (is_compute) running = static_cast<int>(s);
      const bool done = backend_.start({static_cast<int>(s), index}, ops[static_cast<std::size_t>(index)]);
      if (is_compute) running = -1;
      backend_s += seconds_between(b0, Clock::now());
      progressed = true;
      if (!done) return;
      finish(s);
      --remaining;
    }
  };
  // Polls the in-flight ops of every stream but `skip` and starts their ready transfers and
  // collectives (not compute ops); with `p2p_only`, point-to-point transfers only.
  auto progress_transfers = [&](int skip, bool p2p_only) {
    for (std::size_t s = 0; s < streams; ++s) {
      if (static_cast<int>(s) == skip) continue;
      if (in_flight[s]) {
        const auto& op = plan_.streams[s].ops[static_cast<std::size_t>(completed[s])];
        if (p2p_only && !p2p(op)) continue;
        const auto b0 = Clock::now();
        const bool done = backend_.poll({static_cast<int>(s), completed[s]}, op);
        backend_s += seconds_between(b0, Clock::now());
        if (!done) continue;
        finish(s);
        --remaining;
        progressed = true;
      }
      start_ready(s, false, p2p_only);
    }
  };
  // While a compute op waits inside Backend::start for its group, the other streams' transfers keep
  // moving (Backend::progress): a send it would otherwise hold back can be what its group's peers wait
  // for.
  bool in_progress = false;
  backend_.set_progress([&] {
    if (running < 0 || in_progress) return;
    in_progress = true;
    const bool before = progressed;
    progressed = false;
    progress_transfers(running, true);
    if (progressed) last_progress = Clock::now();
    progressed = progressed || before;
    in_progress = false;
  });
  struct ClearProgress {
    Backend& b;
    ~ClearProgress() { b.set_progress({}); }
  } clear_progress{backend_};
  while (remaining > 0) {
    const auto sweep_start = Clock::now();
    backend_s = 0;
    progressed = false;
    // Every ready transfer and collective first, then the compute ops: a compute op can block inside
    // its tensor-parallel collectives until its TP peers meet it, and a send it would otherwise hold
    // back can be what a peer (and so the TP group) is waiting for.
    progress_transfers(-1, false);
    for (std::size_t s = 0; s < streams; ++s) start_ready(s, true);
    const auto sweep_end = Clock::now();
    const double sweep_s = seconds_between(sweep_start, sweep_end);
    if (progressed) {
      m.backend_seconds += backend_s;
      m.overhead_seconds += std::max(0.0, sweep_s - backend_s);
      last_progress = sweep_end;
    } else {
      m.idle_seconds += sweep_s;
      if (seconds_between(last_progress, sweep_end) > options_.stall_timeout_s) {
        std::string stuck;
        for (std::size_t s = 0; s < streams; ++s)
          if (cursor[s] < static_cast<int>(plan_.streams[s].ops.size()) || in_flight[s]) {
            const auto& op = plan_.streams[s].ops[static_cast<std::size_t>(in_flight[s] ? completed[s] : cursor[s])];
            stuck += fmt::format("{}{}: {}{}", stuck.empty() ? "" : "; ", plan_.streams[s].name,
                                 in_flight[s] ? "" : "not started ", backend_.describe_wait(op));
          }
        throw RuntimeError(fmt::format("step {}: no progress for {:.0f} s (a peer rank died or the plan deadlocks): {}",
                                       step, options_.stall_timeout_s, stuck));
      }
      // Nothing to do until a peer or the network moves: give the core away (ranks often outnumber
      // cores in tests), after a short spin so that fast transfers keep a low latency.
      if (seconds_between(last_progress, sweep_end) > 2e-4) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        m.idle_seconds += seconds_between(sweep_end, Clock::now());
      }
    }
  }
  m.step_seconds = now_s();
  backend_.end_step();
  m.timeline.spans = std::move(spans);  // flattened stream-major = sorted by (stream, index)
  m.ops = plan_.op_count();
  return m;
}

}  // namespace piper::runtime
