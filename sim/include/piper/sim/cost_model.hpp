// Cost model: how long an op takes on a device of a Cluster — roofline compute with an efficiency
// curve, alpha-beta point-to-point transfers and NCCL-like collectives — optionally overridden by a
// calibration file of measured times or by a per-op function (tests, unit-time views).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/program.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/kernel_table.hpp"

namespace piper::sim {

// Measured op times that replace the model where they match. JSON format (written by the runtime):
//   {"format": "piper-calibration", "version": 1, "gpu": "H200-SXM" (informational),
//    "entries": [{"kind": "COMPUTE"|"UPD"|"SEND"|"ALL_REDUCE"|..., "pass": "F"|"B"|"BI"|"BW"|"" ,
//                 "flops": 1.2e12?, "memory_bytes": 123?, "bytes": 456?, "group_size": 8?,
//                 "key": "label or shape key"?, "seconds": 0.0123}]}
// An entry matches an op when kind and pass are equal and each field the entry gives is equal to the
// op's (flops within 1e-9 relative; group_size: the collective's group, or 2 for SEND/RECV; key: the
// op's label). Among matches the entry giving the most fields wins; the first such entry on ties.
struct CalibrationEntry {
  core::OpKind kind = core::OpKind::Compute;
  core::Pass pass = core::Pass::None;
  std::optional<double> flops;
  std::optional<std::int64_t> memory_bytes;
  std::optional<std::int64_t> bytes;
  std::optional<int> group_size;
  std::optional<std::string> key;
  double seconds = 0;
};

struct Calibration {
  std::string gpu;
  std::vector<CalibrationEntry> entries;
  std::optional<double> lookup(const core::Op& op, int group_size) const;
  nlohmann::json to_json() const;
  static Calibration from_json(const nlohmann::json& j, const std::string& where);  // throws ClusterError
  static Calibration load(const std::string& path);                                 // size-checked read, then parse
  // A calibration file's text; JSON errors (syntax or a field's type) become ClusterError.
  static Calibration parse(const std::string& text, const std::string& where);
};

// How fast work progresses on a device, relative to the model's times, as a function of k, the
// communication ops (kernels) running there now (engine.hpp; docs/contention.md):
//  * Shared SMs (no sm_partition, the default): each running comm kernel holds comm_sm_share of the
//    GPU's SMs (its NCCL channels' CTAs), up to comm_sm_share_max together; compute runs on the rest:
//    compute(k) = 1 - min(k * comm_sm_share, max(comm_sm_share, comm_sm_share_max)). Comm kernels
//    bring their own SMs, so they do not slow each other here (only links do): comm(k) = 1.
//  * sm_partition giving communication s of the GPU's N SMs: compute runs on the other N - s SMs
//    whether or not communication runs (a static partition, as green contexts make it):
//    compute(k) = (N - s) / N. The comm kernels share the s SMs: one reaches full bandwidth with
//    comm_sm_share * N SMs, so together they move at most comm_capacity = s / (comm_sm_share * N)
//    kernel-equivalents of NVLink traffic (infinite when comm_sm_share is 0).
// `idle` = compute(0) and `with_comm` = compute(1) are kept for callers that only need those two.
struct ComputeRates {
  double idle = 1;
  double with_comm = 1;
  double per_kernel = 0;            // shared SMs: compute share one comm kernel takes (0 with a partition)
  double max_held = 0;              // shared SMs: the most compute share comm kernels take together
  double comm_capacity = INFINITY;  // partition: kernel-equivalents of comm traffic the s SMs carry
  double compute(int comm_kernels) const {
    if (comm_kernels <= 0) return idle;
    if (per_kernel <= 0) return with_comm;
    return 1.0 - std::min(comm_kernels * per_kernel, max_held);
  }
  friend bool operator==(const ComputeRates&, const ComputeRates&) = default;
};
// Why `sms` SMs for communication do not fit `gpu`, "" when they do: a GPU spec without sm_count, or
// sms >= N (no SM left for compute). The one rule behind compute_rates and the simulate, sweep and tune
// checks; `cluster` (the preset or file as given) is named in the first reason when not empty.
std::string sm_partition_misfit(int sms, const GpuSpec& gpu, const std::string& cluster = "");
// For one GPU model. Throws ClusterError (one line, sm_partition_misfit's reason) when the partition
// does not fit.
ComputeRates compute_rates(const std::optional<core::SmPartition>& partition, const GpuSpec& gpu);
// Per device of `program` (indexed by device). Throws like the above, naming the first device that fails.
std::vector<ComputeRates> compute_rates(const core::Program& program, const Cluster& cluster);

// Per-op override: a value replaces every other estimate of that op (compute or communication).
using OpOverride = std::function<std::optional<double>(const core::Op&)>;

// Communication formulas, with S = op.bytes (the full buffer: all-reduce input, reduce-scatter input,
// all-gather output, all-to-all total sent per rank), n ranks, alpha = latency, B = bandwidth per
// rank per direction:
//   point-to-point     alpha + S / B                  (intra-node: NVLink figures; else NIC per GPU)
// (intra-node B is the NVLink line rate times the node's nvlink_efficiency: what NCCL reaches)
//   ring all-reduce    2(n-1) alpha + 2 (n-1)/n S / B
//   reduce-scatter     (n-1) alpha + (n-1)/n S / B
//   all-gather         (n-1) alpha + (n-1)/n S / B
//   all-to-all         (n-1) (alpha + S / (n B))      (pairwise exchange, n-1 rounds)
// Flat forms apply when the group is inside one node (NVLink alpha, B) or has one rank per node
// (network latency, per-GPU NIC bandwidth = nics * nic_bandwidth / gpus_per_node of the slowest node).
// Hierarchical (group spans k > 1 nodes with m > 1 ranks on the busiest node; NCCL's tree/ring of rings):
//   all-reduce      = RS_intra(m, S) + AR_inter(k, S/m) + AG_intra(m, S)
//   reduce-scatter  = RS_intra(m, S) + RS_inter(k, S/m)
//   all-gather      = AG_inter(k, S/m) + AG_intra(m, S)
//   all-to-all      = (m-1)(alpha_i + S/(n B_i)) + (n-m)(alpha_e + S/(n B_e))   (intra peers over NVLink)
// An all-to-all of routed experts under node-limited routing (Op::route_*, DeepSeek-V3's dispatch
// and combine as DeepEP runs them) sends each token once to every other node it reaches (to the
// rank of the same local index there), which forwards it over NVLink to its experts' ranks. A token
// reaches at most b nodes (routing_nodes()), on average b (k-1)/k others, so with t = route_top_k:
//   direct = S/n (same-node experts), ib = S b / (t k) per other node, forward = S (k-1) / (k m)
//   time   = (m-1)(alpha_i + direct/B_i) + (k-1)(alpha_e + ib/B_e) + (m-1)(alpha_i + forward/B_i)
// (three phases one after the other; uniform routing sends S (k-1)/k over the network, this S b (k-1) / (t k)).
// Devices sharing one physical GPU (NodeSpec::devices_per_gpu > 1) exchange data as device copies:
// alpha = the node's NVLink latency, B = half the HBM bandwidth (a copy reads and writes every byte);
// a collective whose ranks all share one GPU takes the flat form with those figures.
// Times here are for an op alone on its links; the engines share links among concurrent ops
// (analytic: fair share per link, engine.hpp; SimGrid: max-min over its flows).
class CostModel {
 public:
  explicit CostModel(const Cluster& cluster, std::optional<Calibration> calibration = std::nullopt);

  const Cluster& cluster() const { return cluster_; }
  void set_override(OpOverride f) { override_ = std::move(f); }
  const OpOverride& op_override() const { return override_; }

  // COMPUTE and UPD ops: override, then calibration, then the per-kernel model (the op's segment lists
  // its kernels: timed by the GPU's kernel table, or its efficiency curve without one; UPD by the
  // table's AdamW bandwidth), else (plans without kernel lists) the roofline of the device's GPU.
  double compute_seconds(const core::Program& program, int device, const core::Op& op) const;
  // The per-kernel model alone (TP collectives not included); nullopt where it does not apply.
  std::optional<double> kernel_seconds(const core::Program& program, int device, const core::Op& op) const;
  // How kernels are timed on `device` (its node's table, the cluster's runtime profile).
  KernelTiming timing(int device) const;
  // The least time one launch of `k` takes on any GPU of the cluster (KernelTiming::seconds on the
  // fastest node for it): the tuner's step time bound.
  double fastest_kernel_seconds(const core::Kernel& k) const;
  // The tensor-parallel collectives a COMPUTE op performs inside itself (0 for non-TP ops).
  double tp_seconds(const core::Program& program, int device, const core::Op& op) const;
  // The part of compute_seconds() that is TP collectives: tp_seconds() (with comm_overlap, what the
  // GEMMs do not hide), or 0 when an override or a calibration gives the op's time (a measured time is
  // not split into GEMMs and collectives).
  double tp_part_seconds(const core::Program& program, int device, const core::Op& op) const;
  // With tp_comm_overlap: one launch of projection GEMM `k` overlapped with a TP collective of `m1`
  // seconds over `t` ranks, the GEMM run as t chunks of m/t token rows: max(g_t, m1) + min(g_t, m1) / t,
  // g_t the chunks' time by `timing` (docs/cost-model.md, "TP communication overlap").
  static double tp_overlap_seconds(const KernelTiming& timing, const core::Kernel& k, int t, double m1);
  // The exposed time of the context-parallel K/V exchange a COMPUTE op performs inside itself (0 for
  // ops without one). Ring: cp_steps transfers of cp_bytes / cp_steps to the next CP rank, each under
  // one block of the attention core (the op's attention kernels, a; the cp blocks of a layer hide cp-1
  // transfers): cp_steps · max(0, transfer − a·(cp-1)/(cp·cp_steps)). All-gather variant: cp_steps
  // all-gathers of cp_bytes / cp_steps over the CP group, not overlapped.
  double cp_seconds(const core::Program& program, int device, const core::Op& op) const;
  // Roofline alone (no override or calibration); the FLOPs run as `gemm_kernels` GEMMs (< 1: one).
  double roofline_seconds(int device, double flops, std::int64_t memory_bytes, int gemm_kernels = 1) const;

  double p2p_seconds(int src, int dst, std::int64_t bytes) const;
  double collective_seconds(core::OpKind kind, const std::vector<int>& ranks, std::int64_t bytes) const;
  // The same with the override and calibration applied (what the engines call for an op).
  double transfer_seconds(const core::Op& send, int src, int dst) const;
  double collective_op_seconds(const core::Op& op, const std::vector<int>& ranks) const;
  // An ALL_TO_ALL under node-limited routing over `ranks` (k > 1 nodes of m ranks each, each node's ranks
  // consecutive in `ranks`): the per-round chunks of its three phases (above). nullopt where the op
  // has uniform routing or the group does not span whole, balanced nodes (the uniform form applies).
  struct RoutedAllToAll {
    int nodes = 0, per_node = 0;
    double direct_chunk = 0, ib_chunk = 0, forward_chunk = 0;
  };
  std::optional<RoutedAllToAll> routed_all_to_all(const core::Op& op, const std::vector<int>& ranks,
                                                  std::int64_t bytes) const;
  // The closed form of a collective op moving `bytes` (the routed form where routed_all_to_all applies),
  // before any override or calibration: what an engine's flows reproduce when links are not shared.
  double collective_formula_seconds(const core::Op& op, const std::vector<int>& ranks, std::int64_t bytes) const;

  // Latency and per-direction bandwidth between two devices (intra: NVLink; inter: network + NIC/GPU;
  // on one shared GPU: a device copy).
  double latency_s(int src, int dst) const;
  double bandwidth_bytes_per_s(int src, int dst) const;

  // Fraction of compute throughput lost on `device` while >= 1 communication op runs there, when the
  // program does not partition the SMs (compute_rates() covers both cases).
  double comm_sm_share(int device) const { return cluster_.gpu(device).comm_sm_share; }
  // The latency part of an op's modelled time (its alpha terms: the time with zero bytes); the rest is
  // bandwidth-bound and slows when links or SMs are shared. 0 for calibrated or overridden ops.
  double transfer_latency_seconds(const core::Op& send, int src, int dst) const;
  double collective_latency_seconds(const core::Op& op, const std::vector<int>& ranks) const;
  // The NVLink bandwidth of `device`'s node as NCCL reaches it (the SM-partition model's unit of traffic).
  double nvlink_bytes_per_s(int device) const {
    return cluster_.nodes[static_cast<std::size_t>(node_of_.at(static_cast<std::size_t>(device)))]
        .nvlink_effective_bandwidth_bytes_per_s();
  }
  // The physical GPU of each device (Cluster::gpu_of_devices), and whether two devices share one.
  const std::vector<int>& gpu_of_devices() const { return gpu_of_; }
  bool same_gpu(int a, int b) const {
    return a != b && gpu_of_.at(static_cast<std::size_t>(a)) == gpu_of_.at(static_cast<std::size_t>(b));
  }
  // True when every rank of `ranks` (two or more) runs on one shared GPU.
  bool on_one_gpu(const std::vector<int>& ranks) const;

 private:
  Cluster cluster_;
  std::vector<int> node_of_;  // device -> node (cached)
  std::vector<int> gpu_of_;   // device -> physical GPU (cached)
  std::optional<Calibration> calibration_;
  OpOverride override_;
  std::optional<double> replaced(const core::Op& op, int group_size) const;
  // A collective group's nodes and slowest links: NVLink latency and bandwidth inside a node, the
  // per-GPU NIC bandwidth across; `nodes` it spans, `busiest` = most ranks on one of them.
  struct GroupLinks {
    double alpha_i = 0, bw_i = INFINITY, bw_e = INFINITY, nodes = 0, busiest = 0;
  };
  GroupLinks group_links(const std::vector<int>& ranks) const;
  std::optional<double> update_seconds(const core::Program& program, int device, const core::Op& op) const;
  double base_seconds(const core::Program& program, int device, const core::Op& op) const;  // without TP
  double with_tp(const core::Program& program, int device, const core::Op& op, double compute) const;
  const KernelTiming& node_timing(int node) const;
  // Per-node kernel tables and timings (built once) and pass times by content (kernels + node): ops of
  // the same segment and pass share one sum. Guarded for engines that cost ops from several threads.
  mutable std::once_flag timings_once_;
  mutable std::vector<std::shared_ptr<const KernelTable>> tables_;
  mutable std::vector<KernelTiming> timings_;
  mutable std::vector<std::size_t> distinct_timings_;  // one node per distinct GPU timing
  struct PassTime {
    double seconds = 0, flops = -1, elementwise_bytes = 0;
  };
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::uint64_t, PassTime> pass_cache_;
};

// The kernels `device` runs per microbatch for each segment and pass of its plan, each with its shape,
// FLOPs, HBM bytes, time and achieved rate as `model` times it, and the time the engines give one such
// op (TP collectives and traffic beyond the kernels included). `piper simulate --kernels D`. Throws
// core::Error for a device outside the program.
std::string kernel_breakdown(const core::Program& program, const CostModel& model, int device);

}  // namespace piper::sim
