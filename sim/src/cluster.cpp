// Cluster specs: built-in presets (public vendor figures, cited) and the JSON spec format.
#include "piper/sim/cluster.hpp"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "piper/core/limits.hpp"
#include "piper/core/suggest.hpp"
#include "piper/sim/kernel_table.hpp"

namespace piper::sim {

using nlohmann::json;

namespace {

constexpr double kGB = 1e9;        // vendor bandwidths are decimal: 1 GB/s = 1e9 bytes/s
constexpr double kGbit = 1e9 / 8;  // NIC line rates: 400 Gb/s = 50e9 bytes/s
constexpr double kTera = 1e12;
constexpr std::int64_t kGiB = std::int64_t{1} << 30;

// Assumptions shared by every preset (not vendor figures; documented in docs/simulator.md, "Cost model"):
//  * launch overhead 5 us per op (CUDA kernel launch + framework dispatch, a few us on H100);
//  * comm kernels take 20 of 132 SMs (DeepSeek-V3 report, sec. 3.2.2: 20 SMs for communication) -> 0.15;
//  * efficiency curve: 75 % of peak for large GEMMs, half of that at 2 GFLOP per op;
//  * NVLink latency 3 us and network latency 5 us per message (NCCL-level, not wire-level).
GpuSpec gpu_with_defaults(std::string name, double tflops, int sms, std::int64_t hbm, double hbm_gb_per_s) {
  GpuSpec g;
  g.name = std::move(name);
  g.peak_flops = tflops * kTera;
  g.sm_count = sms;
  g.hbm_bytes = hbm;
  g.hbm_bandwidth_bytes_per_s = hbm_gb_per_s * kGB;
  g.launch_overhead_s = 5e-6;
  g.comm_sm_share = 20.0 / sms;
  g.max_efficiency = 0.75;
  g.half_efficiency_flops = 2e9;
  return g;
}

// NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS dense BF16, 2,039 GB/s HBM2e, 108 SMs; NVLink 3
// 600 GB/s total = 300 GB/s per direction. DGX A100 (Selene's node): 8 x ConnectX-6 HDR 200 Gb/s.
// Kernel efficiency tables (kernel_table.hpp, docs/cost-model.md): the H200's is measured; the A100's,
// H100's and H800's (the H100's compute die and HBM3) are published microbenchmarks, cited, with the
// H200's measurements under stated rules where none is published (sim/data/README.md).
GpuSpec with_table(GpuSpec g, const char* table) {
  g.kernel_table = table;
  return g;
}
GpuSpec a100_sxm_80g() {
  return with_table(gpu_with_defaults("A100-SXM4-80GB", 312, 108, 80 * kGiB, 2039), "a100-80gb-sxm");
}
// NVIDIA H100 datasheet (SXM5): 989 TFLOPS dense BF16, 3.35 TB/s HBM3, 80 GB, 132 SMs; NVLink 4 900 GB/s
// total = 450 GB/s per direction. DGX H100: 8 x ConnectX-7 400 Gb/s for compute traffic.
GpuSpec h100_sxm() { return with_table(gpu_with_defaults("H100-SXM5-80GB", 989, 132, 80 * kGiB, 3350), "h100-sxm"); }
// NVIDIA H200 datasheet (SXM): 989 TFLOPS dense BF16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
// DGX H200: 8 x ConnectX-7 400 Gb/s.
GpuSpec h200_sxm() {
  return with_table(gpu_with_defaults("H200-SXM-141GB", 989, 132, 141'000'000'000, 4800), "h200-sxm");
}
// H800 SXM: the H100 compute die (989 TFLOPS dense BF16, 80 GB HBM3 3.35 TB/s) with NVLink cut to
// 400 GB/s total (200 GB/s per direction), as DeepSeek-V3's report describes its cluster (sec. 3.1:
// NVLink + 8 x 400 Gb/s InfiniBand per node).
GpuSpec h800_sxm() { return with_table(gpu_with_defaults("H800-SXM-80GB", 989, 132, 80 * kGiB, 3350), "h100-sxm"); }

// What NCCL reaches of the NVLink line rate (bus bandwidth of large messages / line rate), as NCCL's
// maintainer states it (S. Jeaugey, NVIDIA): A100 NVLink 3: 12 links x 25 GB/s = 300 GB/s line rate,
// ~20 GB/s effective per link with the SMs' 128-byte payloads, "limits it to ~230GB/s" in all
// (github.com/NVIDIA/nccl-tests/issues/149, 2023-07-05) -> 230/300; NVLink 4 (H100, H200, H800):
// "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink
// bandwidth of 370GB/s" (github.com/NVIDIA/nccl-tests/issues/212, 2024-05-06) -> 370/450.
constexpr double kNvlink3Efficiency = 230.0 / 300.0;
constexpr double kNvlink4Efficiency = 370.0 / 450.0;

NodeSpec node_of(GpuSpec gpu, double nvlink_gb_per_s_per_direction, double nvlink_efficiency, int nics,
                 double nic_gbit) {
  NodeSpec n;
  n.gpus_per_node = 8;
  n.gpu = std::move(gpu);
  n.nvlink_bandwidth_bytes_per_s = nvlink_gb_per_s_per_direction * kGB;
  n.nvlink_efficiency = nvlink_efficiency;
  n.nvlink_latency_s = 3e-6;
  n.nics = nics;
  n.nic_bandwidth_bytes_per_s = nic_gbit * kGbit;
  return n;
}

struct Preset {
  const char* name;
  NodeSpec node;
  NetworkSpec network;
};

const std::vector<Preset>& presets() {
  static const std::vector<Preset> p = {
      {"dgx-a100-80g", node_of(a100_sxm_80g(), 300, kNvlink3Efficiency, 8, 200), {5e-6, "rail-optimized", 1}},
      {"dgx-h100", node_of(h100_sxm(), 450, kNvlink4Efficiency, 8, 400), {5e-6, "rail-optimized", 1}},
      {"dgx-h200", node_of(h200_sxm(), 450, kNvlink4Efficiency, 8, 400), {5e-6, "rail-optimized", 1}},
      {"hgx-h800", node_of(h800_sxm(), 200, kNvlink4Efficiency, 8, 400), {5e-6, "rail-optimized", 1}},
  };
  return p;
}

const std::vector<std::pair<std::string, GpuSpec>>& gpu_presets() {
  static const std::vector<std::pair<std::string, GpuSpec>> g = {
      {"a100-sxm-80g", a100_sxm_80g()}, {"h100-sxm", h100_sxm()}, {"h200-sxm", h200_sxm()}, {"h800-sxm", h800_sxm()}};
  return g;
}

// Reads JSON fields with one-line errors naming the file and the field path.
// `name` as a spec at `spec_path` names a file: as given when it exists, else relative to the spec's
// folder when it exists there (a cluster file's kernel table, a derived spec's base cluster).
std::string beside_spec(const std::string& name, const std::string& spec_path) {
  std::error_code ec;
  const std::filesystem::path beside = std::filesystem::path(spec_path).parent_path() / name;
  return !std::filesystem::exists(name, ec) && std::filesystem::exists(beside, ec) ? beside.string() : name;
}

struct Reader {
  std::string where;
  [[noreturn]] void fail(const std::string& field, const std::string& msg) const {
    throw ClusterError(fmt::format("{}: field '{}': {}", where, field, msg));
  }
  // At most `max`: every field has a physical bound far past any real machine, so that no value
  // (1e308 GFLOP/s, a 1e308 us latency) turns a prediction into inf.
  double number(const json& j, const std::string& key, const std::string& path, double min, bool positive,
                double max = kMaxField) const {
    const json& v = j.at(key);
    if (!v.is_number()) fail(path + key, "expected a number, got " + std::string(v.type_name()));
    double x = v.get<double>();
    if (!std::isfinite(x) || x < min || (positive && x <= 0))
      fail(path + key, fmt::format("must be {} {}, got {}", positive ? ">" : ">=", min, x));
    if (x > max) fail(path + key, fmt::format("must be <= {:g}, got {:g}", max, x));
    return x;
  }
  static constexpr double kMaxField = 1e9;
  // A "name": printed in reports, titles and the --kernels header, where a newline or NUL split the
  // line, an override reordered what followed it, and an empty one printed "()".
  std::string name(const json& j, const std::string& path) const {
    const json& v = j.at("name");
    if (!v.is_string() || v.get<std::string>().empty()) fail(path + "name", "expected a non-empty string");
    const std::string text = v.get<std::string>();
    if (!core::plain_text(text))
      fail(path + "name", fmt::format("'{}': control or bidirectional-override characters are not allowed in a name",
                                      core::printable_text(text, 80)));
    return text;
  }
  // A rate, bandwidth, size or efficiency: at least `floor`, a physical lower bound that `what` says
  // in units ("1 GFLOP/s"). Only an upper bound was checked, and 1e-300 TFLOP/s predicted a step
  // time of 300 digits and 0 tokens/s.
  double at_least(const json& j, const std::string& key, const std::string& path, double floor, const char* what,
                  double max = kMaxField) const {
    const json& v = j.at(key);
    if (!v.is_number()) fail(path + key, "expected a number, got " + std::string(v.type_name()));
    const double x = v.get<double>();
    if (!std::isfinite(x) || x < floor) fail(path + key, fmt::format("must be >= {} ({}), got {}", floor, what, x));
    if (x > max) fail(path + key, fmt::format("must be <= {:g}, got {:g}", max, x));
    return x;
  }
  // A whole number in [min, limit]: counts of nodes and GPUs, which size tables (limits.hpp).
  int count(const json& j, const std::string& key, const std::string& path, double min, core::Limit limit,
            const char* unit) const {
    const double x = number(j, key, path, min, false);
    if (x != std::floor(x)) fail(path + key, fmt::format("expected a whole number, got {}", x));
    const double max = static_cast<double>(core::limit_value(limit));
    if (x > max)
      fail(path + key, core::limit_message(limit, x > 9e18 ? INT64_MAX : static_cast<std::int64_t>(x), unit));
    return static_cast<int>(x);
  }
  void check_keys(const json& j, const std::string& path, std::initializer_list<const char*> known) const {
    if (!j.is_object()) fail(path.empty() ? "(top level)" : path.substr(0, path.size() - 1), "expected an object");
    for (auto it = j.begin(); it != j.end(); ++it) {
      bool ok = false;
      std::string list;
      for (const char* k : known) {
        ok = ok || it.key() == k;
        list += (list.empty() ? "" : ", ") + std::string(k);
      }
      if (!ok)
        fail(path + it.key(), "unknown field" + core::did_you_mean(it.key(), {known.begin(), known.end()}) +
                                  " (expected one of: " + list + ")");
    }
  }
};

void apply_gpu(const Reader& r, const json& j, const std::string& path, GpuSpec& g) {
  if (j.is_string()) {
    const std::string name = j.get<std::string>();
    for (const auto& [n, spec] : gpu_presets())
      if (n == name) {
        g = spec;
        return;
      }
    std::string list;
    for (const auto& [n, spec] : gpu_presets()) list += (list.empty() ? "" : ", ") + n;
    r.fail(path.substr(0, path.size() - 1), "unknown GPU '" + name + "' (expected one of: " + list + ")");
  }
  r.check_keys(j, path,
               {"name", "preset", "peak_tflops", "sm_count", "hbm_gib", "hbm_bandwidth_gb_per_s", "launch_overhead_us",
                "comm_sm_share", "comm_sm_share_max", "max_efficiency", "half_efficiency_gflops", "kernel_table"});
  if (j.contains("preset")) apply_gpu(r, j.at("preset"), path + "preset.", g);
  if (j.contains("name")) g.name = r.name(j, path);
  if (j.contains("peak_tflops")) g.peak_flops = r.at_least(j, "peak_tflops", path, 1e-3, "1 GFLOP/s") * kTera;
  if (j.contains("sm_count")) {
    const double sms = r.number(j, "sm_count", path, 1, false, 1e6);
    if (sms != std::floor(sms)) r.fail(path + "sm_count", fmt::format("expected a whole number, got {:g}", sms));
    g.sm_count = static_cast<int>(sms);
  }
  if (j.contains("hbm_gib"))
    g.hbm_bytes =
        static_cast<std::int64_t>(r.at_least(j, "hbm_gib", path, 1.0 / 1024, "1 MiB") * static_cast<double>(kGiB));
  if (j.contains("hbm_bandwidth_gb_per_s"))
    g.hbm_bandwidth_bytes_per_s = r.at_least(j, "hbm_bandwidth_gb_per_s", path, 1e-3, "1 MB/s") * kGB;
  if (j.contains("launch_overhead_us"))
    g.launch_overhead_s = r.number(j, "launch_overhead_us", path, 0, false, 1e6) * 1e-6;
  if (j.contains("comm_sm_share")) {
    g.comm_sm_share = r.number(j, "comm_sm_share", path, 0, false);
    if (g.comm_sm_share >= 1) r.fail(path + "comm_sm_share", "must be < 1");
  }
  if (j.contains("comm_sm_share_max")) {
    g.comm_sm_share_max = r.number(j, "comm_sm_share_max", path, 0, false);
    if (g.comm_sm_share_max >= 1) r.fail(path + "comm_sm_share_max", "must be < 1");
    // Below comm_sm_share it was silently raised to it (compute(k) takes the larger of the two):
    // docs/contention.md has it at least comm_sm_share.
    if (g.comm_sm_share_max < g.comm_sm_share)
      r.fail(path + "comm_sm_share_max",
             fmt::format("must be >= comm_sm_share ({:g}), got {:g}", g.comm_sm_share, g.comm_sm_share_max));
  }
  if (j.contains("max_efficiency")) g.max_efficiency = r.at_least(j, "max_efficiency", path, 1e-3, "0.1 % of peak", 1);
  // At most 1e6 GFLOP: the efficiency curve f / (f + half) of a larger one slows every kernel by
  // orders of magnitude (a 1 GFLOP GEMM at 1e-9 of peak).
  if (j.contains("half_efficiency_gflops"))
    g.half_efficiency_flops = r.number(j, "half_efficiency_gflops", path, 0, false, 1e6) * 1e9;
  if (j.contains("kernel_table")) {
    if (!j.at("kernel_table").is_string())
      r.fail(path + "kernel_table", "expected a table name or file path (or \"\")");
    g.kernel_table = j.at("kernel_table").get<std::string>();
    if (!g.kernel_table.empty()) {
      const auto& names = kernel_table_names();
      // A file path is taken relative to the cluster file's folder when it is not found as given.
      if (std::find(names.begin(), names.end(), g.kernel_table) == names.end()) {
        g.kernel_table = beside_spec(g.kernel_table, r.where);
        std::error_code ec;
        if (!std::filesystem::exists(g.kernel_table, ec)) {
          std::string list;
          for (const auto& n : names) list += ", " + n;
          r.fail(path + "kernel_table",
                 "'" + g.kernel_table + "' is neither a built-in table (" + list.substr(2) + ") nor a file");
        }
      }
      try {
        load_kernel_table(g.kernel_table);
      } catch (const ClusterError& e) {
        r.fail(path + "kernel_table", e.what());
      }
    }
  }
}

void apply_node(const Reader& r, const json& j, const std::string& path, NodeSpec& n, bool allow_selector) {
  if (allow_selector)
    r.check_keys(j, path,
                 {"nodes", "first", "count", "gpus_per_node", "gpu", "nvlink_bandwidth_gb_per_s", "nvlink_efficiency",
                  "nvlink_latency_us", "nics", "nic_bandwidth_gbit_per_s", "devices_per_gpu"});
  else
    r.check_keys(j, path,
                 {"gpus_per_node", "gpu", "nvlink_bandwidth_gb_per_s", "nvlink_efficiency", "nvlink_latency_us", "nics",
                  "nic_bandwidth_gbit_per_s", "devices_per_gpu"});
  if (j.contains("gpus_per_node"))
    n.gpus_per_node = r.count(j, "gpus_per_node", path, 1, core::Limit::Devices, "GPUs per node");
  if (j.contains("gpu")) apply_gpu(r, j.at("gpu"), path + "gpu.", n.gpu);
  if (j.contains("nvlink_bandwidth_gb_per_s"))
    n.nvlink_bandwidth_bytes_per_s = r.at_least(j, "nvlink_bandwidth_gb_per_s", path, 1e-3, "1 MB/s") * kGB;
  if (j.contains("nvlink_efficiency"))
    n.nvlink_efficiency = r.at_least(j, "nvlink_efficiency", path, 1e-3, "0.1 % of the line rate", 1);
  if (j.contains("nvlink_latency_us"))
    n.nvlink_latency_s = r.number(j, "nvlink_latency_us", path, 0, false, 1e6) * 1e-6;
  if (j.contains("nics")) {
    n.nics = static_cast<int>(r.number(j, "nics", path, 0, false, 1024));
    if (j.at("nics").get<double>() != n.nics)
      r.fail(path + "nics", fmt::format("expected a whole number, got {}", j.at("nics").get<double>()));
  }
  if (j.contains("nic_bandwidth_gbit_per_s"))
    n.nic_bandwidth_bytes_per_s = r.at_least(j, "nic_bandwidth_gbit_per_s", path, 1e-3, "1 Mbit/s") * kGbit;
  if (j.contains("devices_per_gpu"))
    n.devices_per_gpu = r.count(j, "devices_per_gpu", path, 1, core::Limit::Devices, "devices per GPU");
  if (n.gpus_per_node % n.devices_per_gpu != 0)
    r.fail(path + "devices_per_gpu", fmt::format("{} does not divide gpus_per_node {} (a node holds whole GPUs)",
                                                 n.devices_per_gpu, n.gpus_per_node));
}

void check_node_complete(const Reader& r, const NodeSpec& n, const std::string& path) {
  if (n.gpu.peak_flops <= 0) r.fail(path + "gpu.peak_tflops", "missing (give it, or a \"preset\")");
  if (n.gpu.hbm_bytes <= 0) r.fail(path + "gpu.hbm_gib", "missing (give it, or a \"preset\")");
  if (n.gpu.hbm_bandwidth_bytes_per_s <= 0) r.fail(path + "gpu.hbm_bandwidth_gb_per_s", "missing");
  if (n.nvlink_bandwidth_bytes_per_s <= 0 && n.gpus_per_node > 1) r.fail(path + "nvlink_bandwidth_gb_per_s", "missing");
}

Cluster preset_cluster(const Preset& p, int nodes) {
  Cluster c;
  c.name = p.name;
  c.nodes.assign(static_cast<std::size_t>(nodes), p.node);
  c.network = p.network;
  return c;
}

// The "network" object over the preset's network spec.
void apply_network(const Reader& r, const json& n, NetworkSpec& network) {
  r.check_keys(n, "network.", {"latency_us", "topology", "oversubscription"});
  if (n.contains("latency_us")) network.latency_s = r.number(n, "latency_us", "network.", 0, false, 1e6) * 1e-6;
  if (n.contains("topology")) {
    const json& t = n.at("topology");
    if (!t.is_string() || (t.get<std::string>() != "rail-optimized" && t.get<std::string>() != "fat-tree"))
      r.fail("network.topology", "expected \"rail-optimized\" or \"fat-tree\"");
    network.topology = t.get<std::string>();
  }
  // At most 1000: a leaf link thinned further is slower than any real network (1e9 made a 400 Gb/s NIC
  // one of 400 bit/s).
  if (n.contains("oversubscription"))
    network.oversubscription = r.number(n, "oversubscription", "network.", 1, false, 1000);
  // Only a fat-tree has the leaf links it thins: on a rail-optimized network it was ignored (qwen3-1b
  // DP 16 on two nodes, 51.427 ms at 1 and at 4; a fat-tree at 4: 71.239 ms).
  if (network.oversubscription > 1 && network.topology != "fat-tree")
    r.fail("network.oversubscription",
           fmt::format("{:g} thins a fat-tree's leaf links, and the topology is {}, which has none: it would be "
                       "ignored (give \"topology\": \"fat-tree\", or drop it)",
                       network.oversubscription, network.topology));
}

// The "overrides" array: each entry's node fields applied to the nodes it selects (by "nodes":
// [indices] or "first" and "count"). Each node is overridden at most once, by one selector: a node
// listed twice, a selection of no node, "nodes" beside "first"/"count" (which were ignored) and two
// overrides of one node (the last won) are refused.
void apply_overrides(const Reader& r, const json& list, std::vector<NodeSpec>& nodes) {
  const int count = static_cast<int>(nodes.size());
  if (!list.is_array()) r.fail("overrides", "expected an array of node overrides");
  std::vector<int> overridden_by(nodes.size(), -1);  // the override that set each node
  for (std::size_t i = 0; i < list.size(); ++i) {
    const std::string path = fmt::format("overrides[{}].", i);
    const json& o = list[i];
    if (!o.is_object()) r.fail(path.substr(0, path.size() - 1), "expected an object");
    std::vector<int> which;
    const std::string selector = o.contains("nodes") ? "nodes" : "first";
    if (o.contains("nodes")) {
      for (const char* other : {"first", "count"})
        if (o.contains(other)) r.fail(path + other, "give either \"nodes\" or \"first\" and \"count\", not both");
      if (!o.at("nodes").is_array()) r.fail(path + "nodes", "expected an array of node indices");
      if (o.at("nodes").empty()) r.fail(path + "nodes", "selects no node (give at least one node index)");
      for (const json& x : o.at("nodes")) {
        if (!x.is_number_integer()) r.fail(path + "nodes", "expected integer node indices");
        if (x.get<long long>() < 0 || x.get<long long>() >= count)
          r.fail(path + "nodes",
                 fmt::format("node {} out of range (the cluster has {} nodes)", x.get<long long>(), count));
        if (std::find(which.begin(), which.end(), x.get<int>()) != which.end())
          r.fail(path + "nodes", fmt::format("node {} is listed twice", x.get<int>()));
        which.push_back(x.get<int>());
      }
    } else if (o.contains("first")) {
      const int first = r.count(o, "first", path, 0, core::Limit::Devices, "nodes");
      const int n = o.contains("count") ? r.count(o, "count", path, 1, core::Limit::Devices, "nodes") : 1;
      if (static_cast<std::int64_t>(first) + n > count)
        r.fail(path + "count", fmt::format("nodes {}..{} out of range (the cluster has {} nodes)", first,
                                           static_cast<std::int64_t>(first) + n - 1, count));
      for (int k = 0; k < n; ++k) which.push_back(first + k);
    } else {
      r.fail(path + "nodes", "missing (give \"nodes\": [indices] or \"first\" and \"count\")");
    }
    for (int w : which) {
      if (w < 0 || w >= count)
        r.fail(path + "nodes", fmt::format("node {} out of range (the cluster has {} nodes)", w, count));
      int& by = overridden_by[static_cast<std::size_t>(w)];
      if (by >= 0)
        r.fail(path + selector, fmt::format("node {} is already overridden by overrides[{}] (give each node's fields "
                                            "in one override)",
                                            w, by));
      by = static_cast<int>(i);
      apply_node(r, o, path, nodes[static_cast<std::size_t>(w)], true);
      check_node_complete(r, nodes[static_cast<std::size_t>(w)], path);
    }
  }
}

// Nodes talk over their NICs: with none, every inter-node byte took infinite time and the
// simulator printed inf. A cluster that may grow past one node (not "fixed") needs them too.
// Without a NIC bandwidth the analytic engine predicted 3.5e9 s per step.
void check_multi_node(const Reader& r, const json& j, const Cluster& c) {
  if (c.nodes.size() > 1 || !c.fixed_size)
    for (std::size_t i = 0; i < c.nodes.size(); ++i) {
      if (c.nodes[i].nics < 1)
        r.fail(j.contains("overrides") ? "overrides" : "node.nics",
               fmt::format("node {} has no NICs; nodes of a multi-node cluster need nics >= 1 (a single node without "
                           "a network is \"nodes\": 1)",
                           i));
      if (c.nodes[i].nic_bandwidth_bytes_per_s <= 0)
        r.fail(j.contains("overrides") ? "overrides" : "node.nic_bandwidth_gbit_per_s",
               fmt::format("node {} has no NIC bandwidth; nodes of a multi-node cluster need it (a single node without "
                           "a network is \"nodes\": 1)",
                           i));
    }
}

// "attention_kernel" scales the attention rates of the GPUs' kernel tables: a name no table holds is
// an error naming the file (the cost model's own check names no file), and a cluster whose GPUs have
// no table (kernel_table "") has nothing for it to scale: it was ignored, any name accepted.
void check_attention_kernel(const Reader& r, const Cluster& c) {
  std::set<std::string> tables;
  for (const auto& node : c.nodes)
    if (!node.gpu.kernel_table.empty()) tables.insert(node.gpu.kernel_table);
  if (tables.empty())
    r.fail("attention_kernel",
           fmt::format("'{}' scales a kernel table's attention rates, and no GPU of the cluster has a kernel table "
                       "(\"kernel_table\": \"\"): it would be ignored (drop it, or give the GPU a table)",
                       c.attention_kernel));
  for (const std::string& name : tables) {
    const auto table = load_kernel_table(name);
    try {
      table->attention_kernel(c.attention_kernel);
    } catch (const std::invalid_argument& e) {
      r.fail("attention_kernel", e.what());
    }
  }
}

}  // namespace

json GpuSpec::to_json() const {
  return {{"name", name},
          {"peak_tflops", peak_flops / kTera},
          {"sm_count", sm_count},
          {"hbm_gib", static_cast<double>(hbm_bytes) / static_cast<double>(kGiB)},
          {"hbm_bandwidth_gb_per_s", hbm_bandwidth_bytes_per_s / kGB},
          {"launch_overhead_us", launch_overhead_s * 1e6},
          {"comm_sm_share", comm_sm_share},
          {"comm_sm_share_max", comm_sm_share_max},
          {"max_efficiency", max_efficiency},
          {"half_efficiency_gflops", half_efficiency_flops / 1e9},
          {"kernel_table", kernel_table}};
}

json NodeSpec::to_json() const {
  return {{"gpus_per_node", gpus_per_node},
          {"gpu", gpu.to_json()},
          {"nvlink_bandwidth_gb_per_s", nvlink_bandwidth_bytes_per_s / kGB},
          {"nvlink_efficiency", nvlink_efficiency},
          {"nvlink_latency_us", nvlink_latency_s * 1e6},
          {"nics", nics},
          {"nic_bandwidth_gbit_per_s", nic_bandwidth_bytes_per_s / kGbit},
          {"devices_per_gpu", devices_per_gpu}};
}

int Cluster::num_devices() const {
  int n = 0;
  for (const auto& node : nodes) n += node.gpus_per_node;
  return n;
}

int Cluster::node_of(int device) const {
  if (device >= 0) {
    // Homogeneous fast path, then a walk over heterogeneous nodes.
    const int g = nodes.empty() ? 0 : nodes.front().gpus_per_node;
    if (g > 0 && device / g < static_cast<int>(nodes.size()) &&
        nodes[static_cast<std::size_t>(device / g)].gpus_per_node == g) {
      bool uniform_prefix = true;
      for (int i = 0; i < device / g && uniform_prefix; ++i)
        uniform_prefix = nodes[static_cast<std::size_t>(i)].gpus_per_node == g;
      if (uniform_prefix) return device / g;
    }
    int first = 0;
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      if (device < first + nodes[i].gpus_per_node) return static_cast<int>(i);
      first += nodes[i].gpus_per_node;
    }
  }
  throw ClusterError(fmt::format("cluster '{}': device {} out of range ({} devices)", name, device, num_devices()));
}

int Cluster::local_index(int device) const {
  int node = node_of(device);
  int first = 0;
  for (int i = 0; i < node; ++i) first += nodes[static_cast<std::size_t>(i)].gpus_per_node;
  return device - first;
}

std::vector<int> Cluster::node_of_devices() const {
  std::vector<int> out;
  out.reserve(static_cast<std::size_t>(num_devices()));
  for (std::size_t i = 0; i < nodes.size(); ++i)
    out.insert(out.end(), static_cast<std::size_t>(nodes[i].gpus_per_node), static_cast<int>(i));
  return out;
}

std::vector<int> Cluster::gpu_of_devices() const {
  std::vector<int> out;
  out.reserve(static_cast<std::size_t>(num_devices()));
  int first = 0;  // the node's first GPU
  for (const auto& node : nodes) {
    for (int i = 0; i < node.gpus_per_node; ++i) out.push_back(first + i / node.devices_per_gpu);
    first += node.gpus_per_node / node.devices_per_gpu;
  }
  return out;
}

int Cluster::devices_on_gpu(int device, int devices) const {
  const NodeSpec& n = node(device);
  if (n.devices_per_gpu == 1) return 1;
  const int first = device - local_index(device) % n.devices_per_gpu;  // the GPU's first device
  return std::max(1, std::min(devices, first + n.devices_per_gpu) - first);
}

bool Cluster::shares_gpus() const {
  return std::any_of(nodes.begin(), nodes.end(), [](const NodeSpec& n) { return n.devices_per_gpu > 1; });
}

bool Cluster::homogeneous() const {
  return std::all_of(nodes.begin(), nodes.end(), [&](const NodeSpec& n) { return n == nodes.front(); });
}

json Cluster::to_json() const {
  json j{{"name", name},
         {"fixed", fixed_size},
         {"runtime", runtime},
         {"network",
          {{"latency_us", network.latency_s * 1e6},
           {"topology", network.topology},
           {"oversubscription", network.oversubscription}}}};
  if (!attention_kernel.empty()) j["attention_kernel"] = attention_kernel;
  // Runs of identical nodes are written once, as {"count": n, ...}.
  json node_list = json::array();
  for (std::size_t i = 0; i < nodes.size();) {
    std::size_t k = i;
    while (k < nodes.size() && nodes[k] == nodes[i]) ++k;
    json n = nodes[i].to_json();
    n["count"] = k - i;
    node_list.push_back(std::move(n));
    i = k;
  }
  j["node_groups"] = std::move(node_list);
  j["devices"] = num_devices();
  return j;
}

std::vector<std::string> cluster_presets() {
  std::vector<std::string> out;
  for (const auto& p : presets()) out.push_back(p.name);
  return out;
}

namespace {

// How many derived clusters may stand on one another ({"cluster": ...} naming a derived cluster).
constexpr int kMaxClusterNesting = 8;

bool is_preset(const std::string& name) {
  return std::any_of(presets().begin(), presets().end(), [&](const Preset& p) { return p.name == name; });
}

// "runtime" and "attention_kernel" (the training runtime's settings) into `c`; checked against its GPUs'
// tables once the nodes are known (check_attention_kernel).
void read_runtime_settings(const Reader& r, const json& j, Cluster& c) {
  if (j.contains("runtime")) {
    const json& rt = j.at("runtime");
    const std::string s = rt.is_string() ? rt.get<std::string>() : "";
    try {
      runtime_profile_from_string(s);
    } catch (const ClusterError&) {
      r.fail("runtime", "expected one of " + runtime_profile_names() +
                            " (torch.compile or Megatron's fused kernels; PyTorch eager; eager with a fused "
                            "cross-entropy; eager with the RMSNorm in torch ops; Piper's CUDA backend: "
                            "docs/cost-model.md)");
    }
    c.runtime = s;
  }
  if (j.contains("attention_kernel")) {
    const json& ak = j.at("attention_kernel");
    if (!ak.is_string()) r.fail("attention_kernel", "expected the name of an attention implementation (e.g. \"fa2\")");
    c.attention_kernel = ak.get<std::string>();
  }
}

// {"cluster": "<preset or file>", "runtime"?, "attention_kernel"?, "name"?, "comment"?}: that cluster with
// the training runtime's settings replaced (what `--runtime` and `--attention-kernel` write). A file is
// taken relative to this spec's folder when it is not found as given.
Cluster derived_cluster(const json& j, const std::string& where) {
  Reader r{where};
  r.check_keys(j, "", {"cluster", "name", "runtime", "attention_kernel", "comment"});
  if (!j.at("cluster").is_string() || j.at("cluster").get<std::string>().empty())
    r.fail("cluster", "expected a preset name or a cluster file");
  Cluster c = load_cluster(cluster_named_in(j.at("cluster").get<std::string>(), where),
                           fmt::format("{}: field 'cluster':", where));
  if (j.contains("name")) c.name = r.name(j, "");
  read_runtime_settings(r, j, c);
  if (j.contains("attention_kernel")) check_attention_kernel(r, c);
  return c;
}

}  // namespace

Cluster cluster_from_json(const json& j, const std::string& where) {
  if (j.is_object() && j.contains("cluster")) return derived_cluster(j, where);
  Reader r{where};
  r.check_keys(
      j, "",
      {"name", "preset", "nodes", "fixed", "node", "overrides", "network", "runtime", "attention_kernel", "comment"});
  NodeSpec base;
  NetworkSpec network;
  std::string name = where;
  if (j.contains("preset")) {
    if (!j.at("preset").is_string()) r.fail("preset", "expected a string");
    const std::string p = j.at("preset").get<std::string>();
    auto it = std::find_if(presets().begin(), presets().end(), [&](const Preset& x) { return x.name == p; });
    if (it == presets().end()) {
      std::string list;
      for (const auto& n : cluster_presets()) list += (list.empty() ? "" : ", ") + n;
      r.fail("preset", "unknown preset '" + p + "' (expected one of: " + list + ")");
    }
    base = it->node;
    network = it->network;
    name = p;
  }
  if (j.contains("name")) name = r.name(j, "");
  if (j.contains("node")) apply_node(r, j.at("node"), "node.", base, false);
  check_node_complete(r, base, j.contains("node") ? "node." : "");
  if (j.contains("network")) apply_network(r, j.at("network"), network);
  int count = 1;
  bool fixed = false;
  if (j.contains("nodes")) {
    const json& n = j.at("nodes");
    if (!n.is_number_integer() || n.get<long long>() < 1) r.fail("nodes", "expected a positive integer");
    if (n.get<long long>() > core::limit_value(core::Limit::Devices))
      r.fail("nodes", core::limit_message(core::Limit::Devices, n.get<long long>(), "nodes"));
    count = static_cast<int>(n.get<long long>());
    fixed = true;
  }
  if (j.contains("fixed")) {
    if (!j.at("fixed").is_boolean()) r.fail("fixed", "expected true or false");
    fixed = j.at("fixed").get<bool>();
  }
  Cluster c;
  c.name = name;
  c.network = network;
  c.fixed_size = fixed;
  read_runtime_settings(r, j, c);
  c.nodes.assign(static_cast<std::size_t>(count), base);
  if (j.contains("overrides")) apply_overrides(r, j.at("overrides"), c.nodes);
  if (!c.attention_kernel.empty()) check_attention_kernel(r, c);
  check_multi_node(r, j, c);
  std::int64_t devices = 0;
  for (const auto& node : c.nodes) devices += node.gpus_per_node;
  if (devices > core::limit_value(core::Limit::Devices))
    r.fail(j.contains("nodes") ? "nodes" : "node.gpus_per_node",
           core::limit_message(core::Limit::Devices, devices, "GPUs"));
  return c;
}

Cluster load_cluster(const std::string& preset_or_path, const std::string& given_by) {
  for (const auto& p : presets())
    if (p.name == preset_or_path) return preset_cluster(p, 1);
  // Derived clusters name other clusters: a file that names itself would recurse without end.
  static thread_local int depth = 0;
  if (depth >= kMaxClusterNesting)
    throw ClusterError(
        fmt::format("{} '{}': clusters derived from clusters nest deeper than {} (does a file name "
                    "itself in \"cluster\"?)",
                    given_by, preset_or_path, kMaxClusterNesting));
  struct Nest {
    Nest() { ++depth; }
    ~Nest() { --depth; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;
  } nest;
  // A spec given inline (`--cluster '{"cluster": "dgx-h100", "runtime": "eager"}'`).
  if (is_inline_cluster_spec(preset_or_path)) {
    std::string where = given_by;
    if (!where.empty() && where.back() == ':') where.pop_back();
    return cluster_from_text(preset_or_path, where);
  }
  std::error_code ec;
  if (!std::filesystem::exists(preset_or_path, ec)) {
    std::string list;
    for (const auto& n : cluster_presets()) list += (list.empty() ? "" : ", ") + n;
    throw ClusterError(fmt::format("{} '{}': neither a preset ({}) nor a file", given_by, preset_or_path, list));
  }
  return cluster_from_text(core::read_input_file(preset_or_path), preset_or_path);
}

Cluster cluster_from_text(const std::string& text, const std::string& where) {
  const std::string& preset_or_path = where;
  json j;
  try {
    j = core::parse_json(text, where);
  } catch (const json::exception& e) {  // also number overflow (out_of_range.406)
    std::string m = e.what();
    std::replace(m.begin(), m.end(), '\n', ' ');
    throw ClusterError(preset_or_path + ": invalid JSON: " + m);
  }
  try {
    return cluster_from_json(j, preset_or_path);
  } catch (const json::exception& e) {
    throw ClusterError(preset_or_path + ": " + e.what());
  }
}

bool is_inline_cluster_spec(const std::string& text) {
  const std::size_t first = text.find_first_not_of(" \t\r\n");
  return first != std::string::npos && text[first] == '{';
}

std::string cluster_named_in(const std::string& name, const std::string& spec_path) {
  return is_preset(name) ? name : beside_spec(name, spec_path);
}

std::string derived_cluster_spec(const std::string& cluster, const std::string& runtime,
                                 const std::string& attention_kernel) {
  std::error_code ec;
  const bool file = !is_inline_cluster_spec(cluster) && std::filesystem::is_regular_file(cluster, ec);
  json spec = {{"cluster", file ? std::filesystem::absolute(cluster).lexically_normal().string() : cluster}};
  if (!runtime.empty()) spec["runtime"] = runtime;
  if (!attention_kernel.empty()) spec["attention_kernel"] = attention_kernel;
  return spec.dump();
}

std::optional<DerivedClusterParts> derived_cluster_parts(const std::string& text) {
  if (!is_inline_cluster_spec(text)) return std::nullopt;
  const json spec = json::parse(text, nullptr, false);
  if (!spec.is_object() || !spec.contains("cluster") || !spec.at("cluster").is_string()) return std::nullopt;
  DerivedClusterParts parts{spec.at("cluster").get<std::string>(), "", ""};
  for (const auto& [key, value] : spec.items()) {
    if (key == "runtime" && value.is_string())
      parts.runtime = value.get<std::string>();
    else if (key == "attention_kernel" && value.is_string())
      parts.attention_kernel = value.get<std::string>();
    else if (key != "cluster" && key != "name" && key != "comment")
      return std::nullopt;
  }
  return parts;
}

std::vector<std::string> attention_kernel_names(const Cluster& cluster) {
  std::set<std::string> tables;
  for (const auto& node : cluster.nodes)
    if (!node.gpu.kernel_table.empty()) tables.insert(node.gpu.kernel_table);
  std::vector<std::string> names;
  for (auto it = tables.begin(); it != tables.end(); ++it) {
    std::vector<std::string> held;
    for (const auto& [name, kernel] : load_kernel_table(*it)->attention_kernels) held.push_back(name);
    if (it == tables.begin()) {
      names = held;
      continue;
    }
    std::vector<std::string> both;
    std::set_intersection(names.begin(), names.end(), held.begin(), held.end(), std::back_inserter(both));
    names = both;
  }
  return names;
}

Cluster with_devices(const Cluster& cluster, int devices) {
  if (cluster.nodes.empty()) throw ClusterError(fmt::format("cluster '{}' has no nodes", cluster.name));
  const int have = cluster.num_devices();
  if (devices <= have) return cluster;
  if (cluster.fixed_size)
    throw ClusterError(fmt::format("cluster '{}' has {} devices ({} nodes) but the program needs {}", cluster.name,
                                   have, cluster.nodes.size(), devices));
  Cluster out = cluster;
  const NodeSpec last = cluster.nodes.back();
  int missing = devices - have;
  while (missing > 0) {
    out.nodes.push_back(last);
    missing -= last.gpus_per_node;
  }
  return out;
}

}  // namespace piper::sim
