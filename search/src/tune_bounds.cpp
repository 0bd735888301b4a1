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
    const std::int64_t shards =
        core::zero_shards_of(static_cast<int>(replicas), c.dp_shard * c.cp);  // HSDP: the group's
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

// The fastest link a TP collective can cross in the cluster, so that the bound holds on every device:
// NVLink or a NIC, or a GPU's own memory where devices share a GPU (a copy within one GPU moves
// each byte through HBM twice, CostModel's same-GPU bandwidth).
double fastest_link(const sim::Cluster& cluster) {
  double link = 0;
  for (const auto& node : cluster.nodes) {
    link = std::max({link, node.nvlink_bandwidth_bytes_per_s, node.nic_bandwidth_per_gpu_bytes_per_s()});
    if (node.devices_per_gpu > 1) link = std::max(link, node.gpu.hbm_bandwidth_bytes_per_s / 2);
  }
  return link;
}

struct PassBound {
  double seconds = 0, tp = 0, etp = 0;  // etp: the routed experts' collectives over their ETP groups
  int e = 1;
  double exposed = 0;  // expert all-to-alls the pass waits for between its own compute ops (seconds)
  // With TP communication overlap an op takes at least max(c, m) (CostModel's with_tp: each collective
  // beside its chunked GEMM, max(g_t, m1) + min(g_t, m1) / t, chunks no faster in sum than the kernel
  // table's bound), and a sum of such maxima is at least the maximum of the sums. The exposed all-to-alls
  // run between compute ops, not inside one: they add either way.
  double total(int t, double link_bw, bool overlap) const {
    const double comm = (t > 1 && link_bw > 0 ? tp * (t - 1.0) / t / link_bw : 0.0) +
                        (e > 1 && link_bw > 0 ? etp * (e - 1.0) / e / link_bw : 0.0);
    return (overlap ? std::max(seconds, comm) : seconds + comm) + exposed;
  }
};

// Whether every step of the candidate's schedule runs one action: each step is then one region's pass
// of one microbatch, a chain of segments that the next step waits for (the order pass's temporal
// edges), so an expert all-to-all between two of its segments leaves the compute stream waiting.
// Not known without a per-rank table, and not so where a step overlaps two actions (an overlapped F&B pair).
bool steps_run_one_action(const Shape& shape) {
  if (!shape.table || shape.place.mirrored) return false;
  for (const auto& rank : shape.table->ranks)
    for (const auto& step : rank)
      if (step.size() != 1) return false;
  return true;
}

}  // namespace

double step_time_lower_bound(const TuneSpec& spec, const TuneCandidate& c) {
  if (!spec.calibration_path.empty()) return 0;  // measured op times replace the cost model's
  const std::shared_ptr<const Shape> shape = shape_of(spec, c);
  const core::Model& model = shape->model;
  const RegionPlacement& place = shape->place;
  const std::shared_ptr<const sim::CostModel> costs = cost_model_of(spec);
  const double link = fastest_link(costs->cluster());
  // Per region and microbatch: a lower bound of its F and of its B (BI + BW when split) per device
  // under c's layout, from the kernels its layers launch (core::layer_kernels, what lowering lists),
  // each timed as the cost model times it (KernelTiming: the kernel table, the runtime profile) on
  // the cluster's fastest GPU for that kernel: a compute op takes its kernels' times, scaled by
  // nothing smaller, plus traffic and collectives. Plus the TP collectives (an all-gather moves
  // (t-1)/t of its bytes through each device's link). Ops of one pass of a region run one after
  // another, so their kernels add up. Recomputation limited to some blocks (recompute_every,
  // recompute_first) is bounded by no recomputation. The per-layer kernel times depend only on the
  // layout, EP degree and cluster: computed once per such key for the shape (Shape::kernel_times),
  // which thousands of candidates share.
  TuneCandidate layout = c;
  if (c.recompute_every > 0 || c.recompute_first > 0) {
    layout.recompute = "none";
    layout.recompute_every = layout.recompute_first = 0;
  }
  std::vector<PassBound> f(static_cast<std::size_t>(place.regions)), b = f;
  const std::shared_ptr<const std::vector<core::Costs>> layer_costs = shape->costs(layout);  // TP bytes
  const auto kernel_times = shape->kernel_times(layout, spec, [&] {
    Shape::KernelTimes times(model.layers().size(), {0.0, 0.0});
    for (std::size_t i = 0; i < model.layers().size(); ++i) {
      const core::Layer& layer = model.layers()[i];
      const core::ParallelLayout L = layout_of(layout, layer);
      for (int p = 0; p < 3; ++p)
        for (const auto& kern : core::layer_kernels(layer, model.training(), L, p, shape->ep_tagged[i] ? c.ep : 1))
          times[i][p == 0 ? 0 : 1] += kern.count * costs->fastest_kernel_seconds(kern);
    }
    return times;
  });
  // Expert all-to-alls (EP >= 2, unchunked, steps of one action): each routed-experts layer's F and B
  // send the dispatch and the combine (shard pass: T·k rows of h over the device's sequence slice, as
  // the test of ExpertTensorParallel derives), each taking at least bytes·(ep-1)/ep over the fastest
  // link (CostModel's flat all-to-all). A pass of a region waits for all of them but the one at its
  // edge (the last combine of F, the first combine gradient of B: the neighbouring region's step
  // sends or waits for it): all of a region's but its longest. Node-limited routing has its own
  // cheaper form (CostModel::routed_all_to_all): left out.
  const bool a2a_exposed = c.ep > 1 && c.a2a_chunks <= 1 && link > 0 && steps_run_one_action(*shape);
  const std::int64_t slice = static_cast<std::int64_t>(c.sequence_parallel ? c.tp : 1) * std::max(1, c.cp);
  const std::int64_t local_tokens = model.training().tokens_per_microbatch() / slice;  // whole rows, as the compiler
  const auto rows = static_cast<double>(local_tokens);
  const double dt = core::bytes_per_element(model.training().precision);
  // Per region: the sum of its all-to-alls' times and the longest one (the edge one is at most that).
  std::vector<double> a2a_sum(static_cast<std::size_t>(place.regions), 0), a2a_max = a2a_sum;
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
    if (a2a_exposed && experts && shape->ep_tagged[i] && layer.shape.routing_groups <= 0) {
      const double bytes = rows * static_cast<double>(layer.shape.hidden) * dt * static_cast<double>(layer.shape.top_k);
      const double seconds = bytes * (c.ep - 1.0) / c.ep / link;
      a2a_sum[r] += 2 * seconds;
      a2a_max[r] = std::max(a2a_max[r], seconds);
    }
  }
  for (std::size_t r = 0; r < a2a_sum.size(); ++r) f[r].exposed = b[r].exposed = a2a_sum[r] - a2a_max[r];
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
              (f[static_cast<std::size_t>(r)].total(c.tp, link, c.tp_comm_overlap) +
               b[static_cast<std::size_t>(r)].total(c.tp, link, c.tp_comm_overlap));
      double before = 0;
      for (int s = 0; s < r; ++s) before += f[static_cast<std::size_t>(s)].total(c.tp, link, c.tp_comm_overlap);
      fill = std::min(fill, before);
    }
    if (std::isfinite(fill)) worst = std::max(worst, fill + busy);
  }
  return worst;
}

}  // namespace piper::search
