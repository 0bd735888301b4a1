// The tuner's bounds: a lower bound of a candidate's peak memory (pruning) and of its step time
// (branch and bound). Each must stay below what the simulator finds (test_sim_tune checks both).
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "piper/core/kernels.hpp"
#include "piper/core/model.hpp"
#include "piper/search/tune.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/kernel_table.hpp"
#include "tune_internal.hpp"

namespace piper::search {

using namespace detail;

// ---------------------------------------------------------------------------------------------
// Memory lower bound
// ---------------------------------------------------------------------------------------------

std::int64_t memory_lower_bound(const TuneSpec& spec, const TuneCandidate& c) {
  const std::shared_ptr<const Shape> shape = shape_of(spec, c);
  const core::Model& model = shape->model;
  const RegionPlacement& place = shape->place;
  const int dt = core::bytes_per_element(model.training().precision);
  const std::int64_t state_bytes = core::fp32_storage(model.training().precision) ? 8 : 12;
  const int grad_bytes = core::gradient_bytes_per_element(model.training());  // fp32 main grads: 4
  // Data-parallel replicas of a region: dp per rank, twice that for a mirrored family (the two
  // copies). A TP segment's replicas are the devices with the same TP rank; routed experts (no TP)
  // are sharded over all the region's devices, tp of them per replica.
  const std::int64_t region_replicas = static_cast<std::int64_t>(c.dp) * c.cp * (place.mirrored ? 2 : 1);
  std::vector<std::int64_t> persistent_of_region(static_cast<std::size_t>(place.regions), 0);
  std::vector<std::int64_t> activation_of_region(static_cast<std::size_t>(place.regions), 0);
  // The per-device costs lowering uses (the compiler's own layer_costs under the TP layout and
  // recompute mode): parameters of split tensors divided by t, activations as Korthikanti et al.
  // (divided by t with SP, the attention core dropped by selective, block inputs only with full).
  const std::shared_ptr<const std::vector<core::Costs>> layer_costs = shape->costs(c);
  for (std::size_t i = 0; i < model.layers().size(); ++i) {
    const int r = shape->region_of_layer[i];
    const core::Costs& costs = (*layer_costs)[i];
    // Lowering sizes each segment's state as params/shard * bytes / (replicas if sharded by ZeRO),
    // with integer division; summing it per layer rounds down at least as much, so it stays a bound.
    // Routed experts: E / ep experts per device (their costs are already those of a 1/etp slice); the
    // region's dp x tp devices hold ep x etp distinct slices.
    const std::int64_t shard = shape->ep_tagged[i] ? c.ep : 1;
    const std::int64_t devices = region_replicas * (shape->experts[i] ? c.tp : 1);
    const std::int64_t replicas = std::max<std::int64_t>(1, devices / (shard * (shape->experts[i] ? c.etp : 1)));
    const std::int64_t shards = core::zero_shards_of(static_cast<int>(replicas), c.dp_shard);  // HSDP: the group's
    const std::int64_t params = costs.params / shard;
    persistent_of_region[static_cast<std::size_t>(r)] +=
        params * dt / (c.zero >= 3 ? shards : 1) +
        params * grad_bytes / (c.zero >= 2 && c.reduce_every != "step" ? shards : 1) +
        params * state_bytes / (c.zero >= 1 ? shards : 1);
    activation_of_region[static_cast<std::size_t>(r)] += costs.activation_bytes / shard;
  }
  std::int64_t peak = 0;
  for (int rank = 0; rank < c.pp; ++rank) {
    std::int64_t persistent = 0, chain[2] = {0, 0};
    for (int r = 0; r < place.regions; ++r) {
      const int home = place.rank_of_region[static_cast<std::size_t>(r)];
      const bool first = home == rank;
      const bool second = place.mirrored && c.pp - 1 - home == rank;
      if (!first && !second) continue;
      // A region on both copies of one rank (the middle rank of an odd mirrored pipeline) is still
      // one set of buffers per device.
      persistent += persistent_of_region[static_cast<std::size_t>(r)];
      chain[first ? 0 : 1] += activation_of_region[static_cast<std::size_t>(r)];
    }
    // Without a table: one microbatch's forward passes through every region of a model copy before
    // any of its backward passes start, so the activations it leaves on a device (one per region the
    // copy has there) are all alive together. The two copies of a mirrored family are separate
    // chains: count the larger.
    std::int64_t transient = std::max(chain[0], chain[1]);
    if (!shape->held.empty())
      for (const auto& pattern : shape->held[static_cast<std::size_t>(rank)]) {
        std::int64_t held = 0;
        for (const auto& [region, count] : pattern)
          if (region >= 0 && region < place.regions)
            held += count * activation_of_region[static_cast<std::size_t>(region)];
        transient = std::max(transient, held);
      }
    peak = std::max(peak, persistent + transient);
  }
  return peak;
}

// ---------------------------------------------------------------------------------------------
// Step time lower bound
// ---------------------------------------------------------------------------------------------

namespace {

// The fastest GPU and link of the cluster, so that the bound holds on every device.
struct FastestRates {
  double flops = 0, hbm = 0, link = 0;
  double att_fwd = 0, att_bwd = 0;  // the fastest measured attention rates (0 without a table)
  double floor = 0;                 // the smallest launch time of a kernel
};

FastestRates fastest_rates(const sim::Cluster& cluster, core::Precision pr) {
  FastestRates f;
  double launch = std::numeric_limits<double>::infinity();
  for (const auto& node : cluster.nodes) {
    // Without a table: the curve's asymptote (fp8 at twice the bf16 peak); with one, its fastest
    // GEMM measurement in the training dtype (fp32 may run as tf32).
    f.flops =
        std::max(f.flops, node.gpu.peak_flops * node.gpu.max_efficiency * std::max(1.0, sim::dtype_peak_ratio(pr)));
    launch = std::min(launch, node.gpu.launch_overhead_s);
    f.hbm = std::max(f.hbm, node.gpu.hbm_bandwidth_bytes_per_s);
    f.link = std::max({f.link, node.nvlink_bandwidth_bytes_per_s, node.nic_bandwidth_per_gpu_bytes_per_s()});
    if (!node.gpu.kernel_table.empty()) {
      const auto t = sim::load_kernel_table(node.gpu.kernel_table);
      launch = std::min(launch, t->launch_floor_s);
      const std::string dt = pr == core::Precision::FP16 ? "bf16" : core::to_string(pr);
      for (const auto& g : t->gemm)
        if (g.dtype == dt || (dt == "fp32" && g.dtype == "tf32")) f.flops = std::max(f.flops, g.flops_per_s);
    }
  }
  launch = std::max(0.0, launch);
  for (const auto& node : cluster.nodes)
    if (!node.gpu.kernel_table.empty())
      for (const auto& a : sim::load_kernel_table(node.gpu.kernel_table)->attention)
        f.att_fwd = std::max(f.att_fwd, a.fwd_flops_per_s), f.att_bwd = std::max(f.att_bwd, a.bwd_flops_per_s);
  f.floor = std::min(launch, sim::KernelTable::kDefaultLaunchFloor);
  return f;
}

// A lower bound of one kernel's time: at least the launch floor plus its FLOPs at the fastest rate
// (GEMMs), its causal FLOPs at the fastest measured attention rate, or its fewest bytes (the fused
// profile's) at the HBM peak.
double kernel_bound(const FastestRates& f, const core::Kernel& k) {
  double t = f.floor;
  const double dt = core::bytes_per_element(k.dtype);
  if (k.kind == core::KernelKind::Gemm) {
    t += k.flops / f.flops;  // the exact FLOPs (a rounded shape's time is scaled to them)
  } else if (k.kind == core::KernelKind::AttentionForward || k.kind == core::KernelKind::AttentionBackward) {
    const double rate = k.kind == core::KernelKind::AttentionBackward ? f.att_bwd : f.att_fwd;
    // Without a table attention runs at most at the GEMM rate on Piper's (full-matrix) FLOPs.
    t += rate > 0 ? sim::causal_attention_flops(k) / rate : k.flops / f.flops;
  } else {
    const double bytes = k.kind == core::KernelKind::Elementwise || k.kind == core::KernelKind::Copy
                             ? static_cast<double>(k.bytes)
                         : k.kind == core::KernelKind::Loss || k.kind == core::KernelKind::LossBackward
                             ? static_cast<double>(k.elems) * 4
                             : static_cast<double>(k.elems) * dt * 2;
    t += bytes / f.hbm;
  }
  return t * k.count;
}

struct PassBound {
  double seconds = 0, tp = 0, etp = 0;  // etp: the routed experts' collectives over their ETP groups
  int e = 1;
  double total(int t, double link_bw) const {
    return seconds + (t > 1 && link_bw > 0 ? tp * (t - 1.0) / t / link_bw : 0.0) +
           (e > 1 && link_bw > 0 ? etp * (e - 1.0) / e / link_bw : 0.0);
  }
};

}  // namespace

double step_time_lower_bound(const TuneSpec& spec, const TuneCandidate& c) {
  if (!spec.calibration_path.empty()) return 0;  // measured op times replace the cost model's
  const std::shared_ptr<const Shape> shape = shape_of(spec, c);
  const core::Model& model = shape->model;
  const RegionPlacement& place = shape->place;
  const std::shared_ptr<const sim::CostModel> costs = cost_model_of(spec);
  const FastestRates rates = fastest_rates(costs->cluster(), model.training().precision);
  if (rates.flops <= 0 || rates.hbm <= 0) return 0;
  const double link = rates.link;
  // Per region and microbatch: a lower bound of its F and of its B (BI + BW when split) per device
  // under c's layout, from the kernels its layers launch (core::layer_kernels, what lowering lists),
  // each timed as the cost model times it on the cluster's fastest GPU for it (a compute op takes
  // its kernels' times, scaled by nothing smaller, plus traffic and collectives; kernel_bound, the
  // fastest rates alone, is the floor); plus the TP collectives (an all-gather moves (t-1)/t of its
  // bytes through each device's link). Ops of one pass of a region run one after another, so their
  // kernels add up. The per-layer kernel times depend only on the layout, EP degree and cluster:
  // computed once per such key for the shape (Shape::kernel_times), which thousands of candidates share.
  std::vector<PassBound> f(static_cast<std::size_t>(place.regions)), b = f;
  const std::shared_ptr<const std::vector<core::Costs>> layer_costs = shape->costs(c);
  const auto kernel_times = shape->kernel_times(c, costs.get(), [&] {
    Shape::KernelTimes times(model.layers().size(), {0.0, 0.0});
    for (std::size_t i = 0; i < model.layers().size(); ++i) {
      const core::Layer& layer = model.layers()[i];
      const core::ParallelLayout L = layout_of(c, layer);
      for (int p = 0; p < 3; ++p)
        for (const auto& kern : core::layer_kernels(layer, model.training(), L, p, shape->ep_tagged[i] ? c.ep : 1))
          times[i][p == 0 ? 0 : 1] +=
              std::max(kernel_bound(rates, kern), kern.count * costs->fastest_kernel_seconds(kern));
    }
    return times;
  });
  for (std::size_t i = 0; i < model.layers().size(); ++i) {
    const auto r = static_cast<std::size_t>(shape->region_of_layer[i]);
    const core::Layer& layer = model.layers()[i];
    const core::Costs& k = (*layer_costs)[i];
    f[r].seconds += (*kernel_times)[i][0];
    b[r].seconds += (*kernel_times)[i][1];
    const bool experts = layer.kind == core::LayerKind::MoeExperts;
    (experts ? f[r].etp : f[r].tp) += static_cast<double>(k.forward_tp_bytes);
    (experts ? b[r].etp : b[r].tp) += static_cast<double>(k.backward_tp_bytes);
    f[r].e = b[r].e = c.etp;
  }
  // A device's compute ops run one at a time on its compute stream. Rank r runs every microbatch's F
  // and B of each region it holds, and cannot start before the first microbatch has gone through
  // every region before its earliest one (the regions form a chain).
  const double per_copy = place.mirrored ? c.microbatches / 2.0 : c.microbatches;
  double worst = 0;
  for (int rank = 0; rank < c.pp; ++rank) {
    double busy = 0, fill = std::numeric_limits<double>::infinity();
    for (int r = 0; r < place.regions; ++r) {
      const int home = place.rank_of_region[static_cast<std::size_t>(r)];
      const int copies = (home == rank ? 1 : 0) + (place.mirrored && c.pp - 1 - home == rank ? 1 : 0);
      if (copies == 0) continue;
      busy += copies * per_copy *
              (f[static_cast<std::size_t>(r)].total(c.tp, link) + b[static_cast<std::size_t>(r)].total(c.tp, link));
      double before = 0;
      for (int s = 0; s < r; ++s) before += f[static_cast<std::size_t>(s)].total(c.tp, link);
      fill = std::min(fill, before);
    }
    if (std::isfinite(fill)) worst = std::max(worst, fill + busy);
  }
  return worst;
}

}  // namespace piper::search
