// `piper simulate --kernels D`: the kernels device D runs per microbatch, each timed as the per-kernel
// cost model times it, so a user can see where a pass's time goes and which table entry it came from.
#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <utility>

#include "piper/core/error.hpp"
#include "piper/sim/cost_model.hpp"

namespace piper::sim {

namespace {

std::string breakdown_shape(const core::Kernel& k) {
  using core::KernelKind;
  if (k.kind == KernelKind::Gemm)
    return k.batch > 1 ? fmt::format("{} x {}x{}x{}", k.batch, k.m, k.n, k.k) : fmt::format("{}x{}x{}", k.m, k.n, k.k);
  if (k.kind == KernelKind::AttentionForward || k.kind == KernelKind::AttentionBackward)
    return fmt::format("b{} s{} h{}/{} d{}{}", k.batch, k.m, k.n, k.k, k.head_dim,
                       k.window > 0 ? fmt::format(" w{}", k.window) : std::string());
  if (core::is_standard_attention(k.kind))
    return fmt::format("b{} s{} h{} d{}{}", k.batch, k.m, k.n, k.head_dim, k.dropout ? " dropout" : "");
  return k.elems > 0 ? fmt::format("{} elems", k.elems) : std::string("-");
}

// "251.3 TFLOP/s" for compute-bound kernels, "1.52 TB/s" for memory-bound ones.
std::string breakdown_rate(const core::Kernel& k, double seconds, double bytes) {
  if (seconds <= 0) return "-";
  // The attention core in the causal FLOPs its table rates are measured in (half of Piper's full-matrix count).
  if (k.kind == core::KernelKind::AttentionForward || k.kind == core::KernelKind::AttentionBackward)
    return fmt::format("{:.1f} TFLOP/s", causal_attention_flops(k) / seconds / 1e12);
  if (k.kind == core::KernelKind::Gemm && k.flops > 0) return fmt::format("{:.1f} TFLOP/s", k.flops / seconds / 1e12);
  return bytes > 0 ? fmt::format("{:.2f} TB/s", bytes / seconds / 1e12) : std::string("-");
}

}  // namespace

std::string kernel_breakdown(const core::Program& program, const CostModel& model, int device) {
  if (device < 0 || device >= program.num_devices)
    throw core::Error(fmt::format("--kernels {}: the plan has devices 0 to {}", device, program.num_devices - 1));
  const KernelTiming timing = model.timing(device);
  const GpuSpec& gpu = model.cluster().gpu(device);
  std::string out = fmt::format(
      "Kernels of device {} per microbatch on {} ({}, runtime {}):\n", device, gpu.name,
      timing.table ? "kernel table " + timing.table->name : std::string("no kernel table: efficiency curve"),
      to_string(timing.profile));
  // The passes each segment runs on this device, in plan order, each with its first op: the engines'
  // time for one such op adds TP collectives and traffic beyond the kernels.
  std::vector<const core::Op*> firsts;
  std::set<std::pair<int, int>> listed;
  for (const core::Stream& s : program.plan_for(device).streams)
    for (const core::Op& op : s.ops)
      if (op.kind == core::OpKind::Compute && op.segment >= 0 && op.pass != core::Pass::None &&
          listed.insert({op.segment, static_cast<int>(op.pass)}).second)
        firsts.push_back(&op);
  if (firsts.empty()) return out + "  (no compute ops)\n";
  // Consecutive segments that run the same kernels in the same pass (a model's repeated blocks) are
  // listed once, their segments and layers as a range.
  struct Block {
    core::Pass pass;
    int first_segment, last_segment, first_layer, last_layer;
    std::string times, rows;
  };
  std::vector<Block> blocks;
  for (const core::Op* op : firsts) {
    const core::ProgramSegment& seg = program.segments.at(static_cast<std::size_t>(op->segment));
    const auto [first, last] = core::pass_kernel_lists(op->pass);
    double total = 0;
    std::string rows;
    for (std::size_t l = first; l <= last; ++l)
      for (const core::Kernel& k : seg.kernels[l]) {
        const double each = timing.seconds(k), bytes = timing.bytes(k);
        total += each * k.count;
        rows += fmt::format("  {:<20} {:<5} {:<26} {:>8g} {:>9.2f} {:>10.1f} {:>9.1f} {:>10.1f}  {}\n",
                            to_string(k.kind), to_string(k.dtype), breakdown_shape(k), k.count, k.flops / 1e9,
                            bytes / 1e6, each * 1e6, each * k.count * 1e6, breakdown_rate(k, each, bytes));
      }
    std::string times =
        fmt::format("kernels {:.3f} ms, op {:.3f} ms", total * 1e3, model.compute_seconds(program, device, *op) * 1e3);
    Block* prev = blocks.empty() ? nullptr : &blocks.back();
    if (prev && prev->pass == op->pass && prev->times == times && prev->rows == rows &&
        (prev->last_segment + 1 == op->segment || prev->first_segment - 1 == op->segment)) {
      prev->first_segment = std::min(prev->first_segment, op->segment);  // backward passes run downwards
      prev->last_segment = std::max(prev->last_segment, op->segment);
      prev->first_layer = std::min(prev->first_layer, seg.first_layer);
      prev->last_layer = std::max(prev->last_layer, seg.last_layer - 1);
    } else {
      blocks.push_back(
          {op->pass, op->segment, op->segment, seg.first_layer, seg.last_layer - 1, std::move(times), std::move(rows)});
    }
  }
  for (const Block& b : blocks) {
    const bool one = b.first_segment == b.last_segment;
    out += fmt::format("\n{} (layers {}-{}), {}{}: {}\n",
                       one ? fmt::format("segment {}", b.first_segment)
                           : fmt::format("segments {}-{}", b.first_segment, b.last_segment),
                       b.first_layer, b.last_layer, core::to_string(b.pass), one ? "" : ", each", b.times);
    out += fmt::format("  {:<20} {:<5} {:<26} {:>8} {:>9} {:>10} {:>9} {:>10}  {}\n", "kernel", "dtype", "shape",
                       "launches", "GFLOP", "MB each", "us each", "us total", "achieved");
    out += b.rows;
  }
  return out;
}

}  // namespace piper::sim
