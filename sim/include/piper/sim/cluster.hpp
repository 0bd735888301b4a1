// Cluster specs: GPUs, nodes, intra-node fabric and inter-node network, loaded from a preset name or
// a JSON file. The simulator's cost model and the SimGrid platform are built from a Cluster.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/error.hpp"

namespace piper::sim {

// A bad cluster spec or a cluster too small for a program. what() is one line naming file and field.
class ClusterError : public core::Error {
 public:
  using core::Error::Error;
};

// One GPU model. Compute time of an op with `flops` FLOPs in k GEMM kernels and `bytes` of HBM
// traffic is the roofline
//   max(gemm_seconds(flops, k), bytes / hbm_bandwidth_bytes_per_s) + launch_overhead_s
// where efficiency(f) = max_efficiency * f / (f + half_efficiency_flops) applies per kernel: small
// kernels reach a small fraction of peak, large GEMMs approach max_efficiency (half of it at
// f = half_efficiency_flops). With this curve the sum over kernels depends only on the total and the
// count: sum_i f_i / (peak * efficiency(f_i)) = (flops + k * half_efficiency_flops) / (peak * max_efficiency).
struct GpuSpec {
  std::string name;
  double peak_flops = 0;  // dense bf16/fp16 tensor-core FLOP/s (no sparsity)
  int sm_count = 0;
  std::int64_t hbm_bytes = 0;
  double hbm_bandwidth_bytes_per_s = 0;
  double launch_overhead_s = 0;  // per kernel-sized op
  double comm_sm_share = 0;      // fraction of compute throughput a running comm kernel takes
  // The most compute throughput running comm kernels take together (shared SMs): k kernels take
  // min(k * comm_sm_share, max(comm_sm_share, comm_sm_share_max)) (docs/contention.md).
  double comm_sm_share_max = 0.5;
  double max_efficiency = 1;         // asymptotic fraction of peak_flops reached by large ops
  double half_efficiency_flops = 0;  // op size reaching max_efficiency / 2 (0: always max)
  // The kernel efficiency table (kernel_table.hpp) of this GPU: a built-in name ("h200-sxm",
  // "h100-sxm") or a table file; "" for none. With a table, compute ops that list their kernels are
  // costed kernel by kernel against it; without one, by the efficiency curve above.
  std::string kernel_table;
  double efficiency(double flops) const {
    return half_efficiency_flops <= 0 ? max_efficiency : max_efficiency * flops / (flops + half_efficiency_flops);
  }
  // Seconds for `flops` run as `kernels` GEMM kernels (< 1: one kernel), the curve applied per kernel.
  double gemm_seconds(double flops, int kernels) const {
    if (flops <= 0) return 0;
    const double k = kernels < 1 ? 1.0 : static_cast<double>(kernels), per_kernel = flops / k;
    return k * per_kernel / (peak_flops * efficiency(per_kernel));
  }
  nlohmann::json to_json() const;
  friend bool operator==(const GpuSpec&, const GpuSpec&) = default;
};

// One node: identical GPUs on an NVLink/NVSwitch fabric, NICs to the inter-node network.
struct NodeSpec {
  int gpus_per_node = 8;
  GpuSpec gpu;
  double nvlink_bandwidth_bytes_per_s = 0;  // per GPU per direction (line rate)
  // Fraction of the NVLink line rate that NCCL's transfers reach (SM copies move 128-byte payloads;
  // protocol overhead): the bus bandwidth nccl-tests reports for large messages over the line rate.
  double nvlink_efficiency = 1;
  double nvlink_latency_s = 0;
  int nics = 8;
  double nic_bandwidth_bytes_per_s = 0;  // each NIC, per direction
  // Devices (ranks) that share one physical GPU: consecutive runs of this many devices of the node
  // run on one GPU, as `piper run --virtual-devices` places them (1: a GPU per device; it divides
  // gpus_per_node, which then counts devices). Sharing devices split the GPU's compute among the ones
  // computing (processor sharing), its HBM evenly, and move data between each other as device copies
  // (docs/simulator.md, "Devices sharing a GPU").
  int devices_per_gpu = 1;
  // Inter-node bandwidth one GPU can use when all GPUs of the node talk off-node (rail-optimized:
  // GPU i uses NIC i): nics * nic_bandwidth / gpus_per_node.
  double nic_bandwidth_per_gpu_bytes_per_s() const {
    return gpus_per_node > 0 ? nics * nic_bandwidth_bytes_per_s / gpus_per_node : 0;
  }
  // What the cost model and the SimGrid platform use for intra-node transfers.
  double nvlink_effective_bandwidth_bytes_per_s() const { return nvlink_bandwidth_bytes_per_s * nvlink_efficiency; }
  nlohmann::json to_json() const;
  friend bool operator==(const NodeSpec&, const NodeSpec&) = default;
};

struct NetworkSpec {
  double latency_s = 0;                     // end-to-end NIC-to-NIC latency across the switches
  std::string topology = "rail-optimized";  // "rail-optimized" | "fat-tree"
  double oversubscription = 1;              // fat-tree: downlink/uplink ratio at the leaf (1 = full bisection)
  friend bool operator==(const NetworkSpec&, const NetworkSpec&) = default;
};

struct Cluster {
  std::string name;
  std::vector<NodeSpec> nodes;  // devices are numbered node by node: node 0 holds 0..g0-1, ...
  NetworkSpec network;
  bool fixed_size = false;  // the spec fixes its node count: with_devices() will not grow it
  // Which element-wise kernels the training runtime fuses ("runtime": "fused" | "eager" | "eager-fused-loss" |
  // "eager-unfused-norm" | "piper-cuda";
  // kernel_table.hpp). Only the per-kernel cost model reads it.
  std::string runtime = "fused";
  // Which attention kernel the runtime uses ("attention_kernel"): "" = the kernel tables' own (cuDNN on
  // Hopper), else an implementation every table names in "attention_kernels" ("fa2": FlashAttention-2,
  // PyTorch's flash SDPA backend). Only the per-kernel cost model reads it.
  std::string attention_kernel;

  int num_devices() const;
  int node_of(int device) const;      // throws ClusterError when out of range
  int local_index(int device) const;  // index of the GPU inside its node
  const NodeSpec& node(int device) const { return nodes.at(static_cast<std::size_t>(node_of(device))); }
  const GpuSpec& gpu(int device) const { return node(device).gpu; }
  // node_of for every device at once (O(devices)); engines use it instead of per-call lookups.
  std::vector<int> node_of_devices() const;
  // The physical GPU of every device (numbered across the cluster); equal to the device's own index
  // unless a node's devices_per_gpu > 1.
  std::vector<int> gpu_of_devices() const;
  // True when some node puts more than one device on a GPU.
  bool shares_gpus() const;
  // How many of the first `devices` devices (a program's) run on `device`'s GPU, itself included:
  // they split its HBM evenly and its peak for MFU (1 without sharing).
  int devices_on_gpu(int device, int devices) const;
  // HBM one of `devices` devices may use: its GPU's, split evenly among the devices sharing it.
  std::int64_t device_hbm_bytes(int device, int devices) const {
    return gpu(device).hbm_bytes / devices_on_gpu(device, devices);
  }
  bool homogeneous() const;

  nlohmann::json to_json() const;
};

// Preset names: dgx-a100-80g, dgx-h100, dgx-h200, hgx-h800.
std::vector<std::string> cluster_presets();
// A preset name or a path to a cluster JSON file (format in docs/simulator.md,
// "Cluster specs"). Throws ClusterError with one line naming the file and field; a name that is
// neither is named as coming from `given_by` (the flag, or a scenario file's field).
Cluster load_cluster(const std::string& preset_or_path, const std::string& given_by = "--cluster");
// Whether `text` is a cluster spec written inline (JSON text), not a preset name or a file path.
bool is_inline_cluster_spec(const std::string& text);
// A derived spec's "cluster" as the spec at `spec_path` names it: a preset, or a file taken relative to
// the spec's folder when it is not found as given.
std::string cluster_named_in(const std::string& name, const std::string& spec_path);
// The derived spec (inline JSON) of `cluster` under a training runtime's settings ("" leaves the
// cluster's own): what --runtime / --attention-kernel and Python's runtime= make. A file is named by its
// absolute path, so the spec reads the same from any folder. Checks nothing: load_cluster of it does.
std::string derived_cluster_spec(const std::string& cluster, const std::string& runtime,
                                 const std::string& attention_kernel);
// The parts of a derived spec written inline (what derived_cluster_spec makes): its "cluster" and the
// runtime settings it sets ("" where it leaves the cluster's own). nullopt for anything else (a preset,
// a file, a full inline spec, text that is not such an object). Checks nothing but the shape.
struct DerivedClusterParts {
  std::string cluster, runtime, attention_kernel;
};
std::optional<DerivedClusterParts> derived_cluster_parts(const std::string& text);
// The attention implementations a cluster may name in "attention_kernel": those every kernel table of
// its GPUs holds (sorted; empty when no GPU has a table).
std::vector<std::string> attention_kernel_names(const Cluster& cluster);
// Parses a cluster spec; `where` (a file name) prefixes errors.
//   {"name": "...", "preset": "dgx-h200"?, "nodes": N, "fixed": bool?,
//    "node": {"gpus_per_node", "gpu": {...}|"h100-sxm", "nvlink_bandwidth_gbps"...}?,   (overrides of the preset's
//    node) "overrides": [{"nodes": [i, j] | "first": i, "count": n, ...node fields...}], "network": {"latency_us",
//    "topology", "oversubscription"}}
Cluster cluster_from_json(const nlohmann::json& j, const std::string& where);
// A cluster file's text (what load_cluster reads): JSON parse errors become ClusterError too.
Cluster cluster_from_text(const std::string& text, const std::string& where);
// The same node type repeated to hold `devices` GPUs: ceil(devices / gpus_per_node(last node)) nodes;
// extra nodes copy the last node. A fixed-size cluster with fewer devices throws ClusterError.
Cluster with_devices(const Cluster& cluster, int devices);

}  // namespace piper::sim
