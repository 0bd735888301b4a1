// SimGrid platform built from a Cluster: one host per GPU, NVLink and NIC links per GPU, leaf
// uplinks for oversubscribed fat-trees, and a full routing table over the device pairs a Program
// uses. Link figures are the Cluster's, as the CostModel reads them, so that an uncontended transfer
// costs exactly its alpha + S / B.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "piper/sim/cluster.hpp"

namespace simgrid::s4u {
class Host;
class Link;
}  // namespace simgrid::s4u

namespace piper::sim::simgrid_detail {

// Payloads are given to SimGrid in 2^-20 byte units (and bandwidths in units/s) so that fractional
// collective chunks (S / n) are not rounded to whole bytes: SimGrid payloads are integers.
constexpr double kUnitsPerByte = 1048576.0;

// Silences SimGrid's logs below critical (call before creating the s4u::Engine).
void quiet_simgrid_logs();

// Sets the SimGrid configuration that makes CM02 an exact alpha-beta model when uncontended: no
// TCP window bound (TCP-gamma huge), no latency/bandwidth factors, no cross-traffic, no RTT-based
// weighting of concurrent flows (weight-S 0). Call after creating the s4u::Engine, before the platform.
void configure_simgrid_for_alpha_beta();

// What is built (all in one full-routing zone):
//  * host "gpu<d>" per device: the end point of its routes (compute runs on engine timers, not on
//    SimGrid hosts: see simgrid_engine.cpp);
//  * per device: NVLink up/down links (nvlink bandwidth) and network up/down links (NIC bandwidth
//    per GPU = nics * nic_bandwidth / gpus_per_node: rail-optimized, GPU i drives its own rail);
//    links have latency 0: the engine waits route_latency_s() on a timer before it starts a Comm,
//    which CM02 makes the same as a link latency (a flow in its latency phase has no bandwidth share);
//  * fat-tree with oversubscription o > 1: per node a leaf up and a leaf down link of bandwidth
//    nics * nic_bandwidth / o (latency 0) on every inter-node route — the shared, thin link;
//  * under an sm_partition (comm_capacity finite, cost_model.hpp): per device an "sm" link of
//    comm_capacity x its node's effective NVLink bandwidth, first on every route from that device:
//    the comm kernels a GPU runs share the SMs of the partition as its flows share that link;
//  * routes: same node [(sm(src)), nvlink_up(src), nvlink_down(dst)]; other nodes [(sm(src)),
//    net_up(src), (leaf_up(node src), leaf_down(node dst)), net_down(dst)].
class Platform {
 public:
  // `comm_capacity`: per device, ComputeRates::comm_capacity (empty or infinite: no sm link).
  Platform(const Cluster& cluster, int num_devices, const std::vector<std::pair<int, int>>& routes,
           const std::vector<double>& comm_capacity = {});

  simgrid::s4u::Host* host(int device) const { return hosts_[static_cast<std::size_t>(device)]; }
  // Latency of the route src -> dst (seconds): the NVLink latency inside a node, the network latency
  // between nodes (half of it charged to each end).
  double route_latency_s(int src, int dst) const;
  const std::vector<int>& node_of() const { return node_of_; }
  // The links of the route src -> dst (as built above), as ids in [0, num_links()), written to
  // `out` (at most kMaxRouteLinks; returns how many); and the rate a flow alone on that route gets
  // (its thinnest link, in kUnitsPerByte units per second). The engine uses them to know which
  // flows share a link (simgrid_engine.cpp, exact ring merging).
  static constexpr int kMaxRouteLinks = 5;
  int route_links(int src, int dst, int* out) const;
  double route_rate_units(int src, int dst) const;
  int num_links() const { return static_cast<int>(link_rate_.size()); }

 private:
  std::vector<int> node_of_;
  std::vector<simgrid::s4u::Host*> hosts_;
  std::vector<double> nvlink_latency_half_, network_latency_half_;
  bool thin_leaf_ = false;
  int num_devices_ = 0;
  std::vector<double> link_rate_;  // by link id: 4d nvlink up, 4d+1 nvlink down, 4d+2 net up, 4d+3 net down
                                   // of device d; 4D+2n leaf up, 4D+2n+1 leaf down of node n (D devices);
                                   // then the sm links
  std::vector<int> sm_link_;       // per device: its sm link id, or -1
};

}  // namespace piper::sim::simgrid_detail
