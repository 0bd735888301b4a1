// Cost model: roofline compute, alpha-beta point-to-point and NCCL-like collective formulas, and the
// calibration file that overrides them with measured times.
#include "piper/sim/cost_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include <fmt/format.h>

#include "piper/core/limits.hpp"

namespace piper::sim {

using core::OpKind;
using nlohmann::json;

namespace {

bool is_collective(OpKind k) {
  return k == OpKind::AllReduce || k == OpKind::ReduceScatter || k == OpKind::AllGather || k == OpKind::AllToAll;
}

// Flat ring/pairwise forms for n ranks sharing one (alpha, B).
double flat(OpKind kind, double n, double alpha, double bw, double bytes) {
  if (n <= 1) return 0;
  switch (kind) {
    case OpKind::AllReduce:
      return 2 * (n - 1) * alpha + 2 * (n - 1) / n * bytes / bw;
    case OpKind::ReduceScatter:
    case OpKind::AllGather:
      return (n - 1) * alpha + (n - 1) / n * bytes / bw;
    case OpKind::AllToAll:
      return (n - 1) * (alpha + bytes / (n * bw));
    default:
      return 0;
  }
}

}  // namespace

// ---- SM sharing and partitioning ----

std::string sm_partition_misfit(int sms, const GpuSpec& gpu, const std::string& cluster) {
  if (gpu.sm_count <= 0)
    return cluster.empty()
               ? fmt::format("the cluster's GPU '{}' has no sm_count to partition", gpu.name)
               : fmt::format("cluster '{}': its GPU '{}' has no sm_count to partition (give node.gpu.sm_count)",
                             cluster, gpu.name);
  if (sms >= gpu.sm_count)  // the count is at fault, not the cluster: the GPU is named
    return fmt::format("{} SMs for communication leave none for compute on '{}' ({} SMs)", sms, gpu.name, gpu.sm_count);
  return "";
}

ComputeRates compute_rates(const std::optional<core::SmPartition>& partition, const GpuSpec& gpu) {
  if (!partition) {
    ComputeRates r;
    r.per_kernel = gpu.comm_sm_share;
    r.max_held = std::max(gpu.comm_sm_share, gpu.comm_sm_share_max);
    r.with_comm = r.compute(1);
    return r;
  }
  if (const std::string why = sm_partition_misfit(partition->sms, gpu); !why.empty())
    throw ClusterError(fmt::format("sm_partition: {}{}", gpu.sm_count > 0 ? "field 'sms': " : "", why));
  const double compute = static_cast<double>(gpu.sm_count - partition->sms) / gpu.sm_count;
  ComputeRates r{compute, compute};
  if (gpu.comm_sm_share > 0) r.comm_capacity = partition->sms / (gpu.comm_sm_share * gpu.sm_count);
  return r;
}

std::vector<ComputeRates> compute_rates(const core::Program& program, const Cluster& cluster) {
  const std::vector<int> node_of = cluster.node_of_devices();
  if (static_cast<int>(node_of.size()) < program.num_devices)
    throw ClusterError(fmt::format("cluster '{}' has {} devices but the program needs {}", cluster.name, node_of.size(),
                                   program.num_devices));
  // Per node, not per device: 10^5 devices share a few GPU specs.
  std::vector<ComputeRates> per_node;
  per_node.reserve(cluster.nodes.size());
  for (const auto& node : cluster.nodes) per_node.push_back(compute_rates(program.sm_partition, node.gpu));
  std::vector<ComputeRates> out(static_cast<std::size_t>(program.num_devices));
  for (std::size_t d = 0; d < out.size(); ++d) out[d] = per_node[static_cast<std::size_t>(node_of[d])];
  return out;
}

// ---- calibration ----

std::optional<double> Calibration::lookup(const core::Op& op, int group_size) const {
  const CalibrationEntry* best = nullptr;
  int best_fields = -1;
  for (const auto& e : entries) {
    if (e.kind != op.kind || e.pass != op.pass) continue;
    int fields = 0;
    if (e.flops) {
      if (std::abs(*e.flops - op.flops) > 1e-9 * std::max(1.0, std::abs(op.flops))) continue;
      ++fields;
    }
    if (e.memory_bytes) {
      if (*e.memory_bytes != op.memory_bytes) continue;
      ++fields;
    }
    if (e.bytes) {
      if (*e.bytes != op.bytes) continue;
      ++fields;
    }
    if (e.group_size) {
      if (*e.group_size != group_size) continue;
      ++fields;
    }
    if (e.key) {
      if (*e.key != op.label) continue;
      ++fields;
    }
    if (fields > best_fields) best = &e, best_fields = fields;
  }
  if (!best) return std::nullopt;
  return best->seconds;
}

json Calibration::to_json() const {
  json list = json::array();
  for (const auto& e : entries) {
    json j{{"kind", core::to_string(e.kind)},
           {"pass", e.pass == core::Pass::None ? "" : core::to_string(e.pass)},
           {"seconds", e.seconds}};
    if (e.flops) j["flops"] = *e.flops;
    if (e.memory_bytes) j["memory_bytes"] = *e.memory_bytes;
    if (e.bytes) j["bytes"] = *e.bytes;
    if (e.group_size) j["group_size"] = *e.group_size;
    if (e.key) j["key"] = *e.key;
    list.push_back(std::move(j));
  }
  return {{"format", "piper-calibration"}, {"version", 1}, {"gpu", gpu}, {"entries", std::move(list)}};
}

// The longest op time a calibration may record: 10^6 s (11 days) is far past any real op.
constexpr double kMaxCalibrationSeconds = 1e6;

Calibration Calibration::from_json(const json& j, const std::string& where) {
  auto fail = [&](const std::string& field, const std::string& m) {
    throw ClusterError(fmt::format("{}: field '{}': {}", where, field, m));
  };
  if (!j.is_object() || j.value("format", "") != "piper-calibration") fail("format", "expected \"piper-calibration\"");
  // Every key is one this reader knows: a misspelt match field ("flop") would otherwise be ignored
  // and its entry match more ops than meant. "measured" is the run's free-form provenance.
  if (auto u = core::unknown_field(j, {"format", "version", "gpu", "measured", "entries"})) fail(u->key, u->message);
  // Version 1 is the only one written (Calibration::to_json, the runtime's calibrate.cpp): another was
  // read as version 1.
  if (j.contains("version") && !(j.at("version").is_number_integer() && j.at("version").get<std::int64_t>() == 1))
    fail("version", "unsupported version " + core::printable(j.at("version").dump(), 40) + " (expected 1)");
  Calibration c;
  c.gpu = j.value("gpu", "");
  if (!j.contains("entries") || !j.at("entries").is_array()) fail("entries", "expected an array");
  const json& list = j.at("entries");
  for (std::size_t i = 0; i < list.size(); ++i) {
    const json& e = list[i];
    const std::string at = fmt::format("entries[{}].", i);
    if (!e.is_object()) fail(fmt::format("entries[{}]", i), "expected an object");
    if (auto u =
            core::unknown_field(e, {"kind", "pass", "seconds", "flops", "memory_bytes", "bytes", "group_size", "key"}))
      fail(at + u->key, u->message);
    CalibrationEntry c_e;
    try {
      c_e.kind = core::op_kind_from_string(e.at("kind").get<std::string>());
    } catch (const std::exception&) {
      fail(at + "kind", "expected an op kind (COMPUTE, UPD, SEND, RECV, ALL_REDUCE, ...)");
    }
    const std::string pass = e.value("pass", "");
    if (!pass.empty()) {
      try {
        c_e.pass = core::pass_from_string(pass);
      } catch (const std::exception&) {
        fail(at + "pass", "expected F, B, BI, BW or \"\"");
      }
    }
    // A measured op time: finite and below a day-scale bound (1e308 s made every prediction inf).
    if (!e.contains("seconds") || !e.at("seconds").is_number() || !(e.at("seconds").get<double>() >= 0) ||
        !(e.at("seconds").get<double>() <= kMaxCalibrationSeconds))
      fail(at + "seconds", fmt::format("expected a number in [0, {:g}]", kMaxCalibrationSeconds));
    c_e.seconds = e.at("seconds").get<double>();
    // Whole-number fields must be JSON integers: converting 1e300 to an integer is undefined.
    auto integer = [&](const char* field, std::int64_t max) {
      const json& v = e.at(field);
      if (!v.is_number_integer() || v.get<std::int64_t>() < 0 || v.get<std::int64_t>() > max)
        fail(at + field, fmt::format("expected an integer in [0, {}]", max));
      return v.get<std::int64_t>();
    };
    if (e.contains("flops")) {
      if (!e.at("flops").is_number() || e.at("flops").get<double>() < 0) fail(at + "flops", "expected a number >= 0");
      c_e.flops = e.at("flops").get<double>();
    }
    if (e.contains("memory_bytes")) c_e.memory_bytes = integer("memory_bytes", INT64_MAX);
    if (e.contains("bytes")) c_e.bytes = integer("bytes", INT64_MAX);
    if (e.contains("group_size"))
      c_e.group_size = static_cast<int>(integer("group_size", core::limit_value(core::Limit::Devices)));
    if (e.contains("key")) {
      if (!e.at("key").is_string()) fail(at + "key", "expected a string");
      c_e.key = e.at("key").get<std::string>();
    }
    c.entries.push_back(std::move(c_e));
  }
  return c;
}

Calibration Calibration::load(const std::string& path) { return parse(core::read_input_file(path), path); }

Calibration Calibration::parse(const std::string& text, const std::string& where) {
  const std::string& path = where;
  try {
    return from_json(core::parse_json(text, path), path);
  } catch (const json::exception& e) {
    std::string m = e.what();
    std::replace(m.begin(), m.end(), '\n', ' ');
    throw ClusterError(path + ": " + m);
  }
}

// ---- cost model ----

namespace {

// The table's multipliers for attention implementation `name`; ClusterError naming the ones it has.
KernelTable::AttentionKernel attention_kernel_of(const KernelTable& t, const std::string& name) {
  try {
    return t.attention_kernel(name);
  } catch (const std::invalid_argument& e) {
    throw ClusterError(std::string("cluster: field 'attention_kernel': ") + e.what());
  }
}

}  // namespace

CostModel::CostModel(const Cluster& cluster, std::optional<Calibration> calibration)
    : cluster_(cluster),
      node_of_(cluster.node_of_devices()),
      gpu_of_(cluster.gpu_of_devices()),
      calibration_(std::move(calibration)) {
  // An attention implementation a table does not name is refused here, in one line, rather than at
  // the first kernel timed.
  if (!cluster_.attention_kernel.empty())
    for (const auto& node : cluster_.nodes)
      if (!node.gpu.kernel_table.empty())
        attention_kernel_of(*load_kernel_table(node.gpu.kernel_table), cluster_.attention_kernel);
}

bool CostModel::on_one_gpu(const std::vector<int>& ranks) const {
  if (ranks.size() < 2) return false;
  const int g = gpu_of_.at(static_cast<std::size_t>(ranks.front()));
  return std::all_of(ranks.begin(), ranks.end(), [&](int r) { return gpu_of_.at(static_cast<std::size_t>(r)) == g; });
}

std::optional<double> CostModel::replaced(const core::Op& op, int group_size) const {
  if (override_)
    if (auto s = override_(op)) return s;
  if (calibration_) return calibration_->lookup(op, group_size);
  return std::nullopt;
}

double CostModel::roofline_seconds(int device, double flops, std::int64_t memory_bytes, int gemm_kernels) const {
  const GpuSpec& g = cluster_.nodes[static_cast<std::size_t>(node_of_.at(static_cast<std::size_t>(device)))].gpu;
  const double compute = g.gemm_seconds(flops, gemm_kernels);
  double memory = memory_bytes > 0 ? static_cast<double>(memory_bytes) / g.hbm_bandwidth_bytes_per_s : 0;
  return std::max(compute, memory) + g.launch_overhead_s;
}

double CostModel::compute_seconds(const core::Program& program, int device, const core::Op& op) const {
  if (auto s = replaced(op, 1)) return *s;
  return with_tp(program, device, op, base_seconds(program, device, op)) + cp_seconds(program, device, op);
}

double CostModel::base_seconds(const core::Program& program, int device, const core::Op& op) const {
  if (auto s = kernel_seconds(program, device, op)) return *s;
  // The GPU's peak is dense bf16; other precisions scale it by the datasheet ratio. UPD runs on the
  // CUDA cores, memory-bound.
  const double dtype_peak = op.kind == OpKind::Compute ? dtype_peak_ratio(program.training.precision) : 1.0;
  double seconds = roofline_seconds(device, op.flops / dtype_peak, op.memory_bytes, op.gemm_kernels);
  // Memory-bound element-wise kernels run between the GEMMs: their time adds to the roofline.
  if (op.elementwise_bytes > 0) {
    const GpuSpec& g = cluster_.nodes[static_cast<std::size_t>(node_of_.at(static_cast<std::size_t>(device)))].gpu;
    seconds += static_cast<double>(op.elementwise_bytes) / g.hbm_bandwidth_bytes_per_s;
  }
  return seconds;
}

// The op's TP collectives (tp_seconds, m) with its compute (c): run between the GEMMs, c + m; with
// comm_overlap (Megatron's --tp-comm-overlap, async TP), each collective is split into t chunks around
// the TP ring and pipelined with the GEMM it feeds or drains (SP's all-gather with the column-parallel
// GEMM after it, its reduce-scatter with the row-parallel GEMM before it): tp_overlap_seconds().
double CostModel::with_tp(const core::Program& program, int device, const core::Op& op, double c) const {
  const double m = tp_seconds(program, device, op);
  if (m <= 0) return c;
  const auto& seg = program.segments[static_cast<std::size_t>(op.segment)];
  if (!seg.tp_comm_overlap) return c + m;
  const int t = std::max(1, seg.tp_degree);
  const double n = op.tp_collectives, m1 = m / n;
  // The n calls pair with the projection GEMMs (unbatched) of the pass's first kernel list, F or BI,
  // whose input or output they carry (a fused B's weight-gradient GEMMs carry none); in proportion to
  // the launches where there are more of them than calls.
  double launches = 0, exposed = 0;
  if (op.pass != core::Pass::None) {
    const KernelTiming& timing = node_timing(node_of_.at(static_cast<std::size_t>(device)));
    for (const auto& k : seg.kernels[core::pass_kernel_lists(op.pass).first])
      if (k.kind == core::KernelKind::Gemm && k.batch == 1) {
        launches += k.count;
        exposed += k.count * (tp_overlap_seconds(timing, k, t, m1) - timing.seconds(k));
      }
  }
  if (launches <= 0) return std::max(c, m) + std::min(c, m) / t;  // no kernel list: the op is one GEMM
  // Each call beside one GEMM launch; calls beyond the launches run alone.
  return c + std::min(1.0, n / launches) * exposed + std::max(0.0, n - launches) * m1;
}

// One projection GEMM `k` overlapped with a TP collective of m1 seconds over t ranks: the runtime
// splits the GEMM along its token rows into t GEMMs of m/t rows (TE's ring exchange, async TP), each
// timed by the kernel table at its own shape (a smaller GEMM runs at its own efficiency, and pays its
// own launch), pipelined with the t chunks of the collective so that one chunk of the shorter of the
// two stays exposed: max(g_t, m1) + min(g_t, m1) / t, g_t the t chunks' time (at least the whole's).
double CostModel::tp_overlap_seconds(const KernelTiming& timing, const core::Kernel& k, int t, double m1) {
  core::Kernel chunk = k;
  chunk.m = (k.m + t - 1) / t;
  chunk.flops = k.flops / t;
  chunk.bytes = k.bytes / t;
  // Never below the whole GEMM's time: a table's interpolation can make t smaller GEMMs add up to a
  // hair less, which splitting cannot.
  const double g = std::max(t * timing.seconds(chunk), timing.seconds(k));
  return std::max(g, m1) + std::min(g, m1) / t;
}

// ---- per-kernel costing ----

namespace {

// A content hash of what a pass's time depends on: the kernels (shape, dtype, count) and the node.
std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}
std::uint64_t bits(double x) {
  std::uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

}  // namespace

// Each node's table and kernel timing, built once (the cluster's runtime profile is the same for all).
const KernelTiming& CostModel::node_timing(int node) const {
  std::call_once(timings_once_, [&] {
    const RuntimeProfile profile = runtime_profile_from_string(cluster_.runtime);
    tables_.resize(cluster_.nodes.size());
    timings_.resize(cluster_.nodes.size());
    for (std::size_t i = 0; i < cluster_.nodes.size(); ++i) {
      const GpuSpec& g = cluster_.nodes[i].gpu;
      if (!g.kernel_table.empty()) tables_[i] = load_kernel_table(g.kernel_table);
      timings_[i] = {tables_[i].get(),        profile, g.peak_flops, g.hbm_bandwidth_bytes_per_s, g.max_efficiency,
                     g.half_efficiency_flops, {}};
      if (!cluster_.attention_kernel.empty() && tables_[i])
        timings_[i].attention_kernel = attention_kernel_of(*tables_[i], cluster_.attention_kernel);
      const KernelTiming& t = timings_[i];
      if (std::none_of(distinct_timings_.begin(), distinct_timings_.end(), [&](std::size_t j) {
            const KernelTiming& u = timings_[j];
            return u.table == t.table && u.peak_flops == t.peak_flops && u.hbm_bytes_per_s == t.hbm_bytes_per_s &&
                   u.fallback_efficiency == t.fallback_efficiency && u.half_efficiency_flops == t.half_efficiency_flops;
          }))
        distinct_timings_.push_back(i);
    }
  });
  return timings_[static_cast<std::size_t>(node)];
}

double CostModel::fastest_kernel_seconds(const core::Kernel& k) const {
  if (cluster_.nodes.empty()) return 0;
  node_timing(0);  // builds the timings
  double best = std::numeric_limits<double>::infinity();
  for (std::size_t i : distinct_timings_) best = std::min(best, timings_[i].seconds(k));
  return best;
}

KernelTiming CostModel::timing(int device) const { return node_timing(node_of_.at(static_cast<std::size_t>(device))); }

std::optional<double> CostModel::kernel_seconds(const core::Program& program, int device, const core::Op& op) const {
  if (op.kind == OpKind::Update) return update_seconds(program, device, op);
  if (op.kind != OpKind::Compute || op.segment < 0 || static_cast<std::size_t>(op.segment) >= program.segments.size())
    return std::nullopt;
  if (op.pass == core::Pass::None) return std::nullopt;
  const int node = node_of_.at(static_cast<std::size_t>(device));
  const core::PassKernels& pk = program.segments[static_cast<std::size_t>(op.segment)].kernels;
  // The kernel lists the pass runs: F; BI; BW; a fused B is BI then BW.
  const auto [first, last] = core::pass_kernel_lists(op.pass);
  std::uint64_t key = mix(static_cast<std::uint64_t>(node), static_cast<std::uint64_t>(op.pass));
  bool any = false;
  for (std::size_t l = first; l <= last; ++l)
    for (const auto& k : pk[l]) {
      any = true;
      key = mix(key, static_cast<std::uint64_t>(k.kind) << 8 | static_cast<std::uint64_t>(k.dtype));
      for (std::int64_t v : {k.m, k.n, k.k, k.batch, k.head_dim, k.v_dim, k.elems, k.bytes, std::int64_t{k.dropout}})
        key = mix(key, static_cast<std::uint64_t>(v));
      key = mix(mix(key, bits(k.flops)), bits(k.count));
    }
  if (!any) return std::nullopt;
  const KernelTiming& t = node_timing(node);
  PassTime pt;
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = pass_cache_.find(key);
    if (it != pass_cache_.end()) pt = it->second;
  }
  if (pt.flops < 0) {
    pt = {0, 0, 0};
    for (std::size_t l = first; l <= last; ++l)
      for (const auto& k : pk[l]) {
        pt.seconds += k.count * t.seconds(k);
        pt.flops += k.count * k.flops;
        // (Standard attention's kernel carries the op's score traffic.)
        if (k.kind == core::KernelKind::Elementwise || core::is_standard_attention(k.kind))
          pt.elementwise_bytes += k.count * static_cast<double>(k.bytes);
      }
    std::lock_guard<std::mutex> lock(cache_mu_);
    pass_cache_.emplace(key, pt);
  }
  // The op runs the listed kernels; should a directive have changed its FLOPs from the layers' (a
  // chunk of chunked expert all-to-alls runs 1/N of the tokens: ShardDirective::chunks), the time
  // scales with them, and so does the kernels' element-wise traffic.
  const double share = pt.flops > 0 && op.flops > 0 ? op.flops / pt.flops : 1.0;
  double seconds = pt.flops > 0 && op.flops > 0 ? pt.seconds * op.flops / pt.flops : pt.seconds;
  // Element-wise traffic the op carries beyond its kernels' (Megatron's fp32 main-grad accumulation
  // in the weight-gradient pass) runs at the GPU's copy bandwidth.
  const double extra = static_cast<double>(op.elementwise_bytes) - pt.elementwise_bytes * share;
  if (extra > 0) {
    core::Kernel copy;
    copy.kind = core::KernelKind::Elementwise;
    copy.bytes = static_cast<std::int64_t>(extra);
    seconds += t.seconds(copy);
  }
  return seconds;
}

// UPD with a kernel table: a fused multi-tensor AdamW streams the op's HBM traffic at the bandwidth
// the table's AdamW measurement reached (one launch per op: multi_tensor_apply batches the tensors).
// fp32 training updates fp32 parameters: the fp32 measurement's bandwidth.
std::optional<double> CostModel::update_seconds(const core::Program& program, int device, const core::Op& op) const {
  const KernelTable* t = node_timing(node_of_.at(static_cast<std::size_t>(device))).table;
  if (!t || op.memory_bytes <= 0) return std::nullopt;
  const double bw = core::fp32_storage(program.training.precision) && t->adamw_fp32_bytes_per_s > 0
                        ? t->adamw_fp32_bytes_per_s
                        : t->adamw_bytes_per_s;
  if (bw <= 0) return std::nullopt;
  return static_cast<double>(op.memory_bytes) / bw + t->launch_floor_s;
}

double CostModel::tp_seconds(const core::Program& program, int device, const core::Op& op) const {
  if (op.tp_collectives <= 0 || op.segment < 0 || static_cast<std::size_t>(op.segment) >= program.segments.size())
    return 0;
  const int family = program.segments[static_cast<std::size_t>(op.segment)].tp_family;
  if (family < 0) return 0;
  // The TP collectives run inside the op, not overlapped with its GEMMs (Megatron-LM's forward; the
  // overlap its backward has is not modelled, docs/tensor-parallel.md):
  // each is costed as an all-gather of its share of tp_bytes over the TP group (an all-reduce
  // counts twice in tp_bytes, so it costs a reduce-scatter + all-gather, the ring all-reduce).
  const std::vector<int> group = program.group_of(family, device);
  const double per_call = static_cast<double>(op.tp_bytes) / op.tp_collectives;
  return op.tp_collectives * collective_seconds(OpKind::AllGather, group, static_cast<std::int64_t>(per_call));
}

double CostModel::cp_seconds(const core::Program& program, int device, const core::Op& op) const {
  if (op.cp_steps <= 0 || op.segment < 0 || static_cast<std::size_t>(op.segment) >= program.segments.size()) return 0;
  const core::ProgramSegment& seg = program.segments[static_cast<std::size_t>(op.segment)];
  if (seg.cp_family < 0 || seg.cp_degree <= 1) return 0;
  const std::vector<int> group = program.group_of(seg.cp_family, device);
  if (group.size() < 2) return 0;
  const auto per_step = static_cast<std::int64_t>(static_cast<double>(op.cp_bytes) / op.cp_steps);
  if (seg.cp_all_gather) return op.cp_steps * collective_seconds(OpKind::AllGather, group, per_step);
  const auto me = std::find(group.begin(), group.end(), device);
  const int next =
      group[static_cast<std::size_t>((me - group.begin() + 1) % static_cast<std::ptrdiff_t>(group.size()))];
  const double transfer = p2p_seconds(device, next, per_step);
  // The attention core's time in this pass: its kernels, as the per-kernel model times them.
  double attention = 0;
  const int node = node_of_.at(static_cast<std::size_t>(device));
  const auto [first, last] = core::pass_kernel_lists(op.pass);
  if (op.pass != core::Pass::None)
    for (std::size_t l = first; l <= last; ++l)
      for (const auto& k : seg.kernels[l])
        if (k.kind == core::KernelKind::AttentionForward || k.kind == core::KernelKind::AttentionBackward)
          attention += k.count * node_timing(node).seconds(k);
  const double hidden_per_step = attention * (seg.cp_degree - 1) / (static_cast<double>(seg.cp_degree) * op.cp_steps);
  return op.cp_steps * std::max(0.0, transfer - hidden_per_step);
}

double CostModel::tp_part_seconds(const core::Program& program, int device, const core::Op& op) const {
  if (op.tp_collectives <= 0 || replaced(op, 1)) return 0;
  const double c = base_seconds(program, device, op);
  return with_tp(program, device, op, c) - c;
}

double CostModel::latency_s(int src, int dst) const {
  const int a = node_of_.at(static_cast<std::size_t>(src)), b = node_of_.at(static_cast<std::size_t>(dst));
  return a == b ? cluster_.nodes[static_cast<std::size_t>(a)].nvlink_latency_s : cluster_.network.latency_s;
}

double CostModel::bandwidth_bytes_per_s(int src, int dst) const {
  const int a = node_of_.at(static_cast<std::size_t>(src)), b = node_of_.at(static_cast<std::size_t>(dst));
  const NodeSpec& na = cluster_.nodes[static_cast<std::size_t>(a)];
  if (same_gpu(src, dst)) return na.gpu.hbm_bandwidth_bytes_per_s / 2;
  if (a == b) return na.nvlink_effective_bandwidth_bytes_per_s();
  const NodeSpec& nb = cluster_.nodes[static_cast<std::size_t>(b)];
  return std::min(na.nic_bandwidth_per_gpu_bytes_per_s(), nb.nic_bandwidth_per_gpu_bytes_per_s());
}

double CostModel::p2p_seconds(int src, int dst, std::int64_t bytes) const {
  if (src == dst) return 0;
  return latency_s(src, dst) + static_cast<double>(bytes) / bandwidth_bytes_per_s(src, dst);
}

// Ranks per node (the busiest node sets m) and the slowest links on each level. Sorting keeps this
// O(n log n) for 10^4-rank groups.
CostModel::GroupLinks CostModel::group_links(const std::vector<int>& ranks) const {
  std::vector<int> nodes;
  nodes.reserve(ranks.size());
  for (int r : ranks) nodes.push_back(node_of_.at(static_cast<std::size_t>(r)));
  std::sort(nodes.begin(), nodes.end());
  GroupLinks g;
  for (std::size_t i = 0; i < nodes.size();) {
    std::size_t j = i;
    while (j < nodes.size() && nodes[j] == nodes[i]) ++j;
    const NodeSpec& ns = cluster_.nodes[static_cast<std::size_t>(nodes[i])];
    g.alpha_i = std::max(g.alpha_i, ns.nvlink_latency_s);
    g.bw_i = std::min(g.bw_i, ns.nvlink_effective_bandwidth_bytes_per_s());
    g.bw_e = std::min(g.bw_e, ns.nic_bandwidth_per_gpu_bytes_per_s());
    g.nodes += 1;
    g.busiest = std::max(g.busiest, static_cast<double>(j - i));
    i = j;
  }
  return g;
}

double CostModel::collective_seconds(OpKind kind, const std::vector<int>& ranks, std::int64_t bytes) const {
  const double n = static_cast<double>(ranks.size());
  if (ranks.size() <= 1 || bytes < 0) return 0;
  const double S = static_cast<double>(bytes);
  const GroupLinks g = group_links(ranks);
  const double alpha_i = g.alpha_i, bw_i = g.bw_i, bw_e = g.bw_e, k = g.nodes, m = g.busiest;
  const double alpha_e = cluster_.network.latency_s;
  if (k == 1 && on_one_gpu(ranks)) return flat(kind, n, alpha_i, bandwidth_bytes_per_s(ranks[0], ranks[1]), S);
  if (k == 1) return flat(kind, n, alpha_i, bw_i, S);
  if (m == 1) return flat(kind, n, alpha_e, bw_e, S);
  switch (kind) {
    case OpKind::AllReduce:
      return flat(OpKind::ReduceScatter, m, alpha_i, bw_i, S) + flat(OpKind::AllReduce, k, alpha_e, bw_e, S / m) +
             flat(OpKind::AllGather, m, alpha_i, bw_i, S);
    case OpKind::ReduceScatter:
      return flat(OpKind::ReduceScatter, m, alpha_i, bw_i, S) + flat(OpKind::ReduceScatter, k, alpha_e, bw_e, S / m);
    case OpKind::AllGather:
      return flat(OpKind::AllGather, k, alpha_e, bw_e, S / m) + flat(OpKind::AllGather, m, alpha_i, bw_i, S);
    case OpKind::AllToAll:
      return (m - 1) * (alpha_i + S / (n * bw_i)) + (n - m) * (alpha_e + S / (n * bw_e));
    default:
      return 0;
  }
}

double CostModel::transfer_seconds(const core::Op& send, int src, int dst) const {
  if (auto s = replaced(send, 2)) return *s;
  return p2p_seconds(src, dst, send.bytes);
}

double CostModel::transfer_latency_seconds(const core::Op& send, int src, int dst) const {
  if (replaced(send, 2) || src == dst) return 0;
  return latency_s(src, dst);
}

double CostModel::collective_latency_seconds(const core::Op& op, const std::vector<int>& ranks) const {
  if (replaced(op, static_cast<int>(ranks.size())) || !is_collective(op.kind)) return 0;
  return collective_formula_seconds(op, ranks, 0);
}

double CostModel::collective_op_seconds(const core::Op& op, const std::vector<int>& ranks) const {
  if (auto s = replaced(op, static_cast<int>(ranks.size()))) return *s;
  return collective_formula_seconds(op, ranks, op.bytes);
}

// How many nodes one token's experts can span: the groups align with the nodes when the EP ranks fill
// whole nodes in expert order (routed_all_to_all checks that), so a token drawn from at most
// `limit` of `groups` groups reaches at most limit * (nodes per group) nodes, and never more than its
// top_k copies.
static int routing_nodes(int groups, int limit, int top_k, int nodes) {
  int b = nodes;
  if (groups % nodes == 0)
    b = std::min(limit, nodes);  // whole groups per node
  else if (nodes % groups == 0)
    b = std::min(nodes, limit * (nodes / groups));  // a group spans nodes / groups nodes
  return std::min(b, top_k);
}

std::optional<CostModel::RoutedAllToAll> CostModel::routed_all_to_all(const core::Op& op, const std::vector<int>& ranks,
                                                                      std::int64_t bytes) const {
  if (op.kind != OpKind::AllToAll || op.route_groups <= 0 || ranks.size() < 2 || on_one_gpu(ranks)) return std::nullopt;
  // Whole nodes, each holding a run of m consecutive ranks, and at least two of them.
  const auto node = [&](int r) { return node_of_.at(static_cast<std::size_t>(r)); };
  std::size_t m = 1;
  while (m < ranks.size() && node(ranks[m]) == node(ranks[0])) ++m;
  const std::size_t n = ranks.size();
  if (m == n || n % m != 0) return std::nullopt;
  std::vector<int> seen;
  for (std::size_t i = 0; i < n; i += m) {
    for (std::size_t j = i; j < i + m; ++j)
      if (node(ranks[j]) != node(ranks[i])) return std::nullopt;
    if (std::find(seen.begin(), seen.end(), node(ranks[i])) != seen.end()) return std::nullopt;
    seen.push_back(node(ranks[i]));
  }
  const int k = static_cast<int>(n / m);
  const int t = std::max(1, op.route_top_k);
  const double S = static_cast<double>(std::max<std::int64_t>(0, bytes));
  const double b = routing_nodes(op.route_groups, op.route_group_limit, t, k);
  RoutedAllToAll r;
  r.nodes = k;
  r.per_node = static_cast<int>(m);
  r.direct_chunk = S / static_cast<double>(n);
  r.ib_chunk = S * b / (t * static_cast<double>(k));
  r.forward_chunk = S * (k - 1) / (static_cast<double>(k) * static_cast<double>(m));
  return r;
}

double CostModel::collective_formula_seconds(const core::Op& op, const std::vector<int>& ranks,
                                             std::int64_t bytes) const {
  if (!is_collective(op.kind)) return 0;
  const auto routed = routed_all_to_all(op, ranks, bytes);
  if (!routed) return collective_seconds(op.kind, ranks, bytes);
  const GroupLinks g = group_links(ranks);  // the slowest links, as collective_seconds takes them
  const double m1 = routed->per_node - 1, k1 = routed->nodes - 1, alpha_e = cluster_.network.latency_s;
  return m1 * (g.alpha_i + routed->direct_chunk / g.bw_i) + k1 * (alpha_e + routed->ib_chunk / g.bw_e) +
         m1 * (g.alpha_i + routed->forward_chunk / g.bw_i);
}

}  // namespace piper::sim
