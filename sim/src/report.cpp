// Report: headline figures, per-device busy/idle/overlap/memory, OOM details and the critical path,
// all computed from a Timeline (simulated or measured) and the Cluster it ran on.
#include "piper/sim/report.hpp"

#include <algorithm>
#include <array>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "piper/core/model.hpp"
#include "piper/core/program.hpp"
#include "piper/sim/engine.hpp"
#include "piper/sim/ready_tracker.hpp"

namespace piper::sim {

using core::OpKind;
using nlohmann::json;

namespace {

constexpr std::size_t ix(std::int64_t i) { return static_cast<std::size_t>(i); }
constexpr int kKinds = 6;  // BufferKind values
const std::array<core::BufferKind, kKinds> kAllKinds = {
    core::BufferKind::Parameters,  core::BufferKind::Gradients, core::BufferKind::OptimizerStates,
    core::BufferKind::Activations, core::BufferKind::Received,  core::BufferKind::GatheredParameters};

bool is_compute(OpKind k) { return k == OpKind::Compute || k == OpKind::Update; }

using Intervals = std::vector<std::pair<double, double>>;

// Sorts and merges intervals in place; returns their total length.
double merge(Intervals& v) {
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& iv : v) {
    if (iv.second <= iv.first) continue;
    if (!out.empty() && iv.first <= out.back().second)
      out.back().second = std::max(out.back().second, iv.second);
    else
      out.push_back(iv);
  }
  v.swap(out);
  double total = 0;
  for (const auto& iv : v) total += iv.second - iv.first;
  return total;
}

double intersection(const Intervals& a, const Intervals& b) {
  double total = 0;
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (hi > lo) total += hi - lo;
    (a[i].second < b[j].second) ? ++i : ++j;
  }
  return total;
}

std::string gib(std::int64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1024.0 * 1024 * 1024));
}

// The TP collectives' share of a COMPUTE span: the cost model's figure, never more than the span.
double tp_part(const CostModel* cost, const core::Program& program, int device, const core::Op& op,
               const core::OpSpan& s) {
  if (!cost || op.kind != OpKind::Compute) return 0;
  return std::min(cost->tp_part_seconds(program, device, op), s.end_s - s.start_s);
}

}  // namespace

CompileStats compile_stats_of(const core::Program& program) {
  return {program.stats.compile_seconds, program.stats.dag_nodes, program.stats.compiler_peak_rss_bytes};
}

CriticalPath critical_path(const core::Timeline& timeline, const Symmetry* symmetry, const CostModel* cost) {
  CriticalPath path;
  const core::Program& program = *timeline.program;
  std::vector<std::vector<std::int32_t>> base(program.plans.size());
  for (std::size_t p = 0; p < program.plans.size(); ++p) base[p] = stream_span_base(program.plans[p]);
  auto span = [&](int d, core::OpRef r) -> const core::OpSpan& {
    return timeline.devices[ix(d)].spans[ix(base[ix(program.plan_of_device[ix(d)])][ix(r.stream)] + r.index)];
  };
  int device = -1;
  core::OpRef ref;
  double last = -1;
  for (std::size_t d = 0; d < timeline.devices.size(); ++d) {
    if (symmetry && !symmetry->is_representative(static_cast<int>(d))) continue;
    for (const auto& s : timeline.devices[d].spans)
      if (s.end_s > last) last = s.end_s, device = static_cast<int>(d), ref = {s.stream, s.index};
  }
  if (device < 0) return path;
  std::vector<CriticalPathStep> reversed;
  PartnerFinder partners(program);
  const std::int64_t limit = program.total_ops() + 1;
  for (std::int64_t guard = 0; guard < limit; ++guard) {
    const core::OpSpan& cur = span(device, ref);
    const core::Op& op = program.plan_for(device).streams[ix(ref.stream)].ops[ix(ref.index)];
    const double seconds = cur.end_s - cur.start_s;
    path.ops += 1;
    if (is_compute(op.kind)) {
      path.compute_s += seconds;
      path.tp_s += tp_part(cost, program, device, op, cur);
      path.seconds_by_device[device] += seconds;
    } else {
      path.comm_s += seconds;
    }
    if (reversed.size() < CriticalPath::kMaxSteps)
      reversed.push_back(
          {device, program.plan_for(device).streams[ix(ref.stream)].name, op.label, cur.start_s, cur.end_s});
    // The dependency (of any member of this op's activity) that ended last released it.
    std::vector<std::pair<int, core::OpRef>> members =
        is_compute(op.kind) ? std::vector<std::pair<int, core::OpRef>>{{device, ref}} : partners(device, ref);
    int best_d = -1;
    core::OpRef best;
    double best_end = -1;
    auto consider = [&](int d, core::OpRef r) {
      const double e = span(d, r).end_s;
      if (e > best_end) best_end = e, best_d = d, best = r;
    };
    for (const auto& [d, r] : members) {
      if (r.index > 0) consider(d, {r.stream, r.index - 1});
      for (const auto& w : program.plan_for(d).streams[ix(r.stream)].ops[ix(r.index)].waits) consider(d, w);
    }
    if (best_d < 0) {
      path.wait_s += cur.start_s;
      break;
    }
    path.wait_s += std::max(0.0, cur.start_s - best_end);
    device = best_d;
    ref = best;
  }
  path.steps.assign(reversed.rbegin(), reversed.rend());
  return path;
}

namespace {

// Model FLOPs and tokens per plan, times the devices running it.
// Model FLOPs of one microbatch: every layer's forward and backward at TP 1 without recomputation, as
// the model spec builds it with the plan's training shape; nullopt for plans without a spec (builder
// models). This is the work MFU counts: what the devices repeat (norms and routed experts replicated
// across a TP group without sequence parallelism, recomputed forwards) is hardware work, not model work.
std::optional<double> model_flops_per_microbatch(const core::Program& program) {
  if (program.model_spec.is_null()) return std::nullopt;
  const core::Model model = core::plan_model(program);
  double flops = 0;
  for (std::size_t i = 0; i < model.layers().size(); ++i) {
    const core::Costs costs = model.layer_cost(i);
    flops += costs.forward_flops + costs.backward_flops();
  }
  return flops;
}

void add_model_work(const core::Program& program, Report& r) {
  std::vector<int> devices_of_plan(program.plans.size(), 0);
  for (int p : program.plan_of_device) devices_of_plan[ix(p)] += 1;
  const double tokens_per_mb = static_cast<double>(program.training.tokens_per_microbatch());
  const std::optional<double> per_mb = model_flops_per_microbatch(program);
  for (std::size_t p = 0; p < program.plans.size(); ++p)
    for (const auto& s : program.plans[p].streams)
      for (const auto& op : s.ops) {
        if (op.kind != OpKind::Compute) continue;
        // Without a model spec: the compute ops' FLOPs less their recomputed forward work.
        if (!per_mb && op.pass != core::Pass::None)
          r.model_flops += (op.flops - op.recompute_flops) * devices_of_plan[p];
        // Each forward of the segment holding layer 0 consumes one microbatch (sharded copies count once;
        // a TP group shares it, and a CP group holds 1/cp of its tokens on each device).
        if (op.pass == core::Pass::F && op.segment >= 0 && ix(op.segment) < program.segments.size() &&
            program.segments[ix(op.segment)].first_layer == 0)
          r.tokens_per_step += tokens_per_mb * devices_of_plan[p] /
                               std::max(1, program.segments[ix(op.segment)].shard_degree) /
                               std::max(1, program.segments[ix(op.segment)].tp_degree) /
                               std::max(1, program.segments[ix(op.segment)].cp_degree);
      }
  if (per_mb && tokens_per_mb > 0) r.model_flops = *per_mb * r.tokens_per_step / tokens_per_mb;
}

// Tokens per second and MFU from the step time.
void set_rates(const core::Program& program, const Cluster& cluster, Report& r) {
  // node_of_devices() once: per-device Cluster lookups are not constant-time on big clusters.
  const std::vector<int> node_of = cluster.node_of_devices();
  auto gpu_of = [&](int d) -> const GpuSpec& { return cluster.nodes[ix(node_of[ix(d)])].gpu; };
  double peak_flops = 0;
  // MFU against the physical GPUs: devices sharing one count for a share of its peak each.
  for (int d = 0; d < program.num_devices; ++d)
    peak_flops += gpu_of(d).peak_flops / cluster.devices_on_gpu(d, program.num_devices);
  if (r.step_time_s > 0) {
    r.tokens_per_s = r.tokens_per_step / r.step_time_s;
    r.mfu = peak_flops > 0 ? r.model_flops / (r.step_time_s * peak_flops) : 0;
  }
}

// The span of an op of one device's timeline.
struct SpanOf {
  const core::DeviceTimeline& dt;
  const std::vector<std::int32_t>& base;  // stream_span_base of the device's plan
  const core::OpSpan& operator()(core::OpRef x) const { return dt.spans[ix(base[ix(x.stream)] + x.index)]; }
};

// A buffer's allocation or free, for the per-kind peaks.
struct Change {
  double time_s;
  std::int64_t bytes;
  int kind;
};

// Peak of each buffer kind on its own (frees before allocations at equal times); `changes` is scratch.
void set_peaks_by_kind(const core::Plan& plan, const SpanOf& span, std::vector<Change>& changes, DeviceReport& dr) {
  std::array<std::int64_t, kKinds> level{}, peak{};
  changes.clear();
  for (const auto& buf : plan.buffers) {
    const int k = static_cast<int>(buf.kind);
    if (buf.persistent()) {
      level[ix(k)] += buf.bytes;
      continue;
    }
    changes.push_back({span(buf.alloc).start_s, buf.bytes, k});
    if (buf.free.stream >= 0) changes.push_back({span(buf.free).end_s, -buf.bytes, k});
  }
  std::sort(changes.begin(), changes.end(), [](const Change& x, const Change& y) {
    return x.time_s < y.time_s || (x.time_s == y.time_s && x.bytes < y.bytes);
  });
  peak = level;
  for (const auto& c : changes) {
    level[ix(c.kind)] += c.bytes;
    peak[ix(c.kind)] = std::max(peak[ix(c.kind)], level[ix(c.kind)]);
  }
  for (int k = 0; k < kKinds; ++k)
    if (peak[ix(k)] > 0) dr.peak_bytes_by_kind[core::to_string(kAllKinds[ix(k)])] = peak[ix(k)];
}

// The first device over its HBM: when it first went over and which buffer kinds held the memory then.
void set_oom_details(int d, const DeviceReport& dr, const core::DeviceTimeline& dt, const core::Plan& plan,
                     const SpanOf& span, OomReport& o) {
  o.device = d;
  o.hbm_bytes = dr.hbm_bytes;
  for (const auto& m : dt.memory)
    if (m.bytes > dr.hbm_bytes) {
      o.time_s = m.time_s;
      o.bytes = m.bytes;
      break;
    }
  std::array<std::int64_t, kKinds> held{};
  for (const auto& buf : plan.buffers) {
    const bool live = buf.persistent() ||
                      (span(buf.alloc).start_s <= o.time_s && (buf.free.stream < 0 || span(buf.free).end_s > o.time_s));
    if (live) held[ix(static_cast<int>(buf.kind))] += buf.bytes;
  }
  for (int k = 0; k < kKinds; ++k)
    if (held[ix(k)] > 0) o.largest_holders.push_back({core::to_string(kAllKinds[ix(k)]), held[ix(k)]});
  std::sort(o.largest_holders.begin(), o.largest_holders.end(),
            [](const MemoryHolder& x, const MemoryHolder& y) { return x.bytes > y.bytes; });
}

}  // namespace

Report make_report(const core::Timeline& timeline, const Cluster& cluster, const CompileStats& compile,
                   const Symmetry* symmetry, const CostModel* cost) {
  const core::Program& program = *timeline.program;
  Report r;
  r.engine = timeline.source;
  r.model = program.model_name;
  r.cluster = cluster.name;
  std::vector<std::string> settings;
  if (cluster.runtime != "fused") settings.push_back("runtime " + cluster.runtime);
  if (!cluster.attention_kernel.empty()) settings.push_back("attention " + cluster.attention_kernel);
  r.runtime = fmt::format("{}", fmt::join(settings, ", "));
  r.devices = program.num_devices;
  r.microbatches = program.microbatches;
  r.step_time_s = timeline.step_time_s;
  r.compile_time_s = compile.compile_time_s;
  r.dag_nodes = compile.dag_nodes;
  r.total_ops = program.total_ops();
  add_model_work(program, r);
  set_rates(program, cluster, r);

  std::vector<std::vector<std::int32_t>> base(program.plans.size());
  for (std::size_t p = 0; p < program.plans.size(); ++p) base[p] = stream_span_base(program.plans[p]);
  Intervals compute, comm;
  std::vector<Change> changes;
  double bubble_sum = 0;
  r.per_device.reserve(ix(program.num_devices));
  for (int d = 0; d < program.num_devices; ++d) {
    if (symmetry && !symmetry->is_representative(d)) {
      // Same spans and memory as its representative, which has a lower id (already reported, and
      // the first OOM device if this one is over).
      DeviceReport dr = r.per_device[ix(symmetry->representative_of(d))];
      dr.device = d;
      bubble_sum += dr.bubble_fraction;
      if (dr.oom) r.oom_details.devices_over += 1;
      r.per_device.push_back(std::move(dr));
      continue;
    }
    const core::DeviceTimeline& dt = timeline.devices[ix(d)];
    const core::Plan& plan = program.plan_for(d);
    DeviceReport dr;
    dr.device = d;
    compute.clear();
    comm.clear();
    for (const auto& s : dt.spans) {
      const core::Op& op = plan.streams[ix(s.stream)].ops[ix(s.index)];
      (is_compute(op.kind) ? compute : comm).emplace_back(s.start_s, s.end_s);
      dr.tp_comm_s += tp_part(cost, program, d, op, s);
    }
    dr.busy_s = merge(compute);
    dr.comm_s = merge(comm);
    dr.comm_compute_overlap = dr.comm_s > 0 ? intersection(compute, comm) / dr.comm_s : 0;
    dr.idle_s = std::max(0.0, r.step_time_s - dr.busy_s);
    dr.bubble_fraction = r.step_time_s > 0 ? dr.idle_s / r.step_time_s : 0;
    bubble_sum += dr.bubble_fraction;
    dr.peak_memory_bytes = dt.peak_memory_bytes;
    dr.peak_memory_time_s = dt.peak_memory_time_s;
    dr.hbm_bytes = cluster.device_hbm_bytes(d, program.num_devices);
    dr.oom = dr.peak_memory_bytes > dr.hbm_bytes;
    const SpanOf span{dt, base[ix(program.plan_of_device[ix(d)])]};
    set_peaks_by_kind(plan, span, changes, dr);
    r.peak_memory_bytes = std::max(r.peak_memory_bytes, dr.peak_memory_bytes);
    if (dr.oom) {
      r.oom = true;
      r.oom_details.devices_over += 1;
      if (r.oom_details.device < 0) set_oom_details(d, dr, dt, plan, span, r.oom_details);
    }
    r.per_device.push_back(std::move(dr));
  }
  r.bubble_fraction = program.num_devices > 0 ? bubble_sum / program.num_devices : 0;
  r.critical_path = critical_path(timeline, symmetry, cost);
  return r;
}

json Report::to_json() const {
  json device_rows = json::array();
  for (const auto& d : per_device)
    device_rows.push_back({{"device", d.device},
                           {"busy_s", d.busy_s},
                           {"idle_s", d.idle_s},
                           {"bubble_fraction", d.bubble_fraction},
                           {"comm_s", d.comm_s},
                           {"comm_compute_overlap", d.comm_compute_overlap},
                           {"tp_comm_s", d.tp_comm_s},
                           {"peak_memory_bytes", d.peak_memory_bytes},
                           {"peak_memory_time_s", d.peak_memory_time_s},
                           {"peak_bytes_by_kind", d.peak_bytes_by_kind},
                           {"hbm_bytes", d.hbm_bytes},
                           {"oom", d.oom}});
  json holders = json::array();
  for (const auto& h : oom_details.largest_holders) holders.push_back({{"kind", h.kind}, {"bytes", h.bytes}});
  json steps = json::array();
  for (const auto& s : critical_path.steps)
    steps.push_back(
        {{"device", s.device}, {"stream", s.stream}, {"label", s.label}, {"start_s", s.start_s}, {"end_s", s.end_s}});
  json by_device = json::array();
  for (const auto& [d, sec] : critical_path.seconds_by_device) by_device.push_back({{"device", d}, {"compute_s", sec}});
  json j{{"format", "piper-report"},
         {"engine", engine},
         {"model", model},
         {"cluster", cluster},
         {"runtime", runtime},
         {"devices", devices},
         {"microbatches", microbatches},
         {"step_time_s", step_time_s},
         {"tokens_per_step", tokens_per_step},
         {"tokens_per_s", tokens_per_s},
         {"model_flops", model_flops},
         {"mfu", mfu},
         {"bubble_fraction", bubble_fraction},
         {"compile_time_s", compile_time_s},
         {"simulate_time_s", simulate_time_s},
         {"simulation", simulation},
         {"dag_nodes", dag_nodes},
         {"total_ops", total_ops},
         {"oom", oom},
         {"peak_memory_bytes", peak_memory_bytes},
         {"critical_path",
          {{"compute_s", critical_path.compute_s},
           {"tp_s", critical_path.tp_s},
           {"comm_s", critical_path.comm_s},
           {"wait_s", critical_path.wait_s},
           {"ops", critical_path.ops},
           {"by_device", by_device},
           {"steps", steps}}},
         {"per_device", std::move(device_rows)}};
  if (oom)
    j["oom_details"] = {{"device", oom_details.device},
                        {"time_s", oom_details.time_s},
                        {"bytes", oom_details.bytes},
                        {"hbm_bytes", oom_details.hbm_bytes},
                        {"devices_over", oom_details.devices_over},
                        {"largest_holders", holders}};
  return j;
}

Report Report::from_json(const json& j) {
  Report r;
  r.engine = j.value("engine", "");
  r.model = j.value("model", "");
  r.cluster = j.value("cluster", "");
  r.runtime = j.value("runtime", "");
  r.devices = j.value("devices", 0);
  r.microbatches = j.value("microbatches", 0);
  r.step_time_s = j.value("step_time_s", 0.0);
  r.tokens_per_step = j.value("tokens_per_step", 0.0);
  r.tokens_per_s = j.value("tokens_per_s", 0.0);
  r.model_flops = j.value("model_flops", 0.0);
  r.mfu = j.value("mfu", 0.0);
  r.bubble_fraction = j.value("bubble_fraction", 0.0);
  r.compile_time_s = j.value("compile_time_s", 0.0);
  r.simulate_time_s = j.value("simulate_time_s", 0.0);
  r.simulation = j.value("simulation", "");
  r.dag_nodes = j.value("dag_nodes", std::int64_t{0});
  r.total_ops = j.value("total_ops", std::int64_t{0});
  r.oom = j.value("oom", false);
  r.peak_memory_bytes = j.value("peak_memory_bytes", std::int64_t{0});
  for (const auto& d : j.value("per_device", json::array())) {
    DeviceReport dr;
    dr.device = d.value("device", 0);
    dr.busy_s = d.value("busy_s", 0.0);
    dr.idle_s = d.value("idle_s", 0.0);
    dr.bubble_fraction = d.value("bubble_fraction", 0.0);
    dr.comm_s = d.value("comm_s", 0.0);
    dr.comm_compute_overlap = d.value("comm_compute_overlap", 0.0);
    dr.tp_comm_s = d.value("tp_comm_s", 0.0);
    dr.peak_memory_bytes = d.value("peak_memory_bytes", std::int64_t{0});
    dr.peak_memory_time_s = d.value("peak_memory_time_s", 0.0);
    dr.peak_bytes_by_kind = d.value("peak_bytes_by_kind", std::map<std::string, std::int64_t>{});
    dr.hbm_bytes = d.value("hbm_bytes", std::int64_t{0});
    dr.oom = d.value("oom", false);
    r.per_device.push_back(std::move(dr));
  }
  if (j.contains("oom_details")) {
    const json& o = j.at("oom_details");
    r.oom_details.device = o.value("device", -1);
    r.oom_details.time_s = o.value("time_s", 0.0);
    r.oom_details.bytes = o.value("bytes", std::int64_t{0});
    r.oom_details.hbm_bytes = o.value("hbm_bytes", std::int64_t{0});
    r.oom_details.devices_over = o.value("devices_over", 0);
    for (const auto& h : o.value("largest_holders", json::array()))
      r.oom_details.largest_holders.push_back({h.value("kind", ""), h.value("bytes", std::int64_t{0})});
  }
  if (j.contains("critical_path")) {
    const json& c = j.at("critical_path");
    r.critical_path.compute_s = c.value("compute_s", 0.0);
    r.critical_path.tp_s = c.value("tp_s", 0.0);
    r.critical_path.comm_s = c.value("comm_s", 0.0);
    r.critical_path.wait_s = c.value("wait_s", 0.0);
    r.critical_path.ops = c.value("ops", std::int64_t{0});
    for (const auto& b : c.value("by_device", json::array()))
      r.critical_path.seconds_by_device[b.value("device", 0)] = b.value("compute_s", 0.0);
    for (const auto& s : c.value("steps", json::array()))
      r.critical_path.steps.push_back({s.value("device", 0), s.value("stream", ""), s.value("label", ""),
                                       s.value("start_s", 0.0), s.value("end_s", 0.0)});
  }
  return r;
}

std::string Report::to_text(int max_devices) const {
  std::string out;
  auto row = [&](const std::string& k, const std::string& v) { out += fmt::format("{:<22}{}\n", k, v); };
  row("model", fmt::format("{} on {} devices ({}{}), {} microbatches", model, devices, cluster,
                           runtime.empty() ? "" : "; " + runtime, microbatches));
  row("engine", engine);
  row("step time", fmt::format("{:.3f} ms", step_time_s * 1e3));
  row("throughput", fmt::format("{:.0f} tokens/s ({:.0f} tokens/step)", tokens_per_s, tokens_per_step));
  row("MFU", fmt::format("{:.1f} %", mfu * 100));
  row("bubble fraction", fmt::format("{:.1f} % (mean over devices)", bubble_fraction * 100));
  row("peak memory", fmt::format("{} (max over devices)", gib(peak_memory_bytes)));
  if (oom) {
    std::string holders;
    for (const auto& h : oom_details.largest_holders)
      holders += fmt::format("{}{} {}", holders.empty() ? "" : ", ", h.kind, gib(h.bytes));
    row("OUT OF MEMORY",
        fmt::format("device {} at {:.3f} ms: {} > HBM {} ({} device{} over); held: {}", oom_details.device,
                    oom_details.time_s * 1e3, gib(oom_details.bytes), gib(oom_details.hbm_bytes),
                    oom_details.devices_over, oom_details.devices_over == 1 ? "" : "s", holders));
  } else {
    row("out of memory", "no");
  }
  row("compile time", fmt::format("{:.1f} ms ({} DAG nodes, {} ops)", compile_time_s * 1e3, dag_nodes, total_ops));
  row("simulate time", fmt::format("{:.1f} ms", simulate_time_s * 1e3));
  if (!simulation.empty()) row("simulation", simulation);
  // Critical path: where its compute time sits.
  std::vector<std::pair<double, int>> top;
  for (const auto& [d, s] : critical_path.seconds_by_device) top.emplace_back(s, d);
  std::sort(top.rbegin(), top.rend());
  std::string where;
  for (std::size_t i = 0; i < top.size() && i < 4; ++i)
    where += fmt::format("{}device {} {:.2f} ms", i ? ", " : "", top[i].second, top[i].first * 1e3);
  // TP collectives run inside COMPUTE ops: shown apart only when the plan has any.
  const bool tp =
      std::any_of(per_device.begin(), per_device.end(), [](const DeviceReport& d) { return d.tp_comm_s > 0; });
  const std::string tp_on_path = tp ? fmt::format(" (TP collectives {:.3f} ms)", critical_path.tp_s * 1e3) : "";
  row("critical path",
      fmt::format("{} ops: compute {:.3f} ms{}, comm {:.3f} ms, waiting {:.3f} ms", critical_path.ops,
                  critical_path.compute_s * 1e3, tp_on_path, critical_path.comm_s * 1e3, critical_path.wait_s * 1e3));
  if (!where.empty()) row("  compute on path", where);
  out += fmt::format("\n{:>6} {:>10} {:>10} {:>8} {:>10} {:>8}{} {:>12}\n", "device", "busy ms", "idle ms", "bubble",
                     "comm ms", "overlap", tp ? fmt::format(" {:>10}", "TP ms") : "", "peak memory");
  int shown = 0;
  for (const auto& d : per_device) {
    if (shown++ >= max_devices) {
      out += fmt::format("{:>6} ({} more devices)\n", "...", per_device.size() - static_cast<std::size_t>(max_devices));
      break;
    }
    out += fmt::format("{:>6} {:>10.3f} {:>10.3f} {:>7.1f}% {:>10.3f} {:>7.1f}%{} {:>12}{}\n", d.device, d.busy_s * 1e3,
                       d.idle_s * 1e3, d.bubble_fraction * 100, d.comm_s * 1e3, d.comm_compute_overlap * 100,
                       tp ? fmt::format(" {:>10.3f}", d.tp_comm_s * 1e3) : "", gib(d.peak_memory_bytes),
                       d.oom ? "  OOM" : "");
  }
  return out;
}

}  // namespace piper::sim
