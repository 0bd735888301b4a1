// Builds the SimGrid platform of a Cluster (see simgrid_platform.hpp for what and why).
#include "simgrid_platform.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include <simgrid/s4u.hpp>
#include <xbt/log.h>

namespace sg = simgrid::s4u;

namespace piper::sim::simgrid_detail {

void quiet_simgrid_logs() { xbt_log_control_set("root.thresh:critical"); }

void configure_simgrid_for_alpha_beta() {
  sg::Engine::set_config("network/model:CM02");
  sg::Engine::set_config("network/crosstraffic:0");
  sg::Engine::set_config("network/TCP-gamma:1e30");
  sg::Engine::set_config("network/latency-factor:1");
  sg::Engine::set_config("network/bandwidth-factor:1");
  sg::Engine::set_config("network/weight-S:0");
}

Platform::Platform(const Cluster& cluster, int num_devices, const std::vector<std::pair<int, int>>& routes,
                   const std::vector<double>& comm_capacity) {
  node_of_ = cluster.node_of_devices();
  node_of_.resize(static_cast<std::size_t>(num_devices));
  auto* zone = sg::create_full_zone("cluster");
  hosts_.resize(static_cast<std::size_t>(num_devices));
  std::vector<sg::Link*> nv_up(hosts_.size()), nv_dn(hosts_.size()), net_up(hosts_.size()), net_dn(hosts_.size());
  nvlink_latency_half_.resize(hosts_.size());
  num_devices_ = num_devices;
  link_rate_.assign(4 * hosts_.size(), 0.0);
  network_latency_half_.resize(hosts_.size());
  for (int d = 0; d < num_devices; ++d) {
    const auto du = static_cast<std::size_t>(d);
    const NodeSpec& node = cluster.node(d);
    const std::string id = std::to_string(d);
    hosts_[du] = zone->create_host("gpu" + id, 1.0);
    nvlink_latency_half_[du] = node.nvlink_latency_s / 2;
    network_latency_half_[du] = cluster.network.latency_s / 2;
    const double nv = std::max(1.0, node.nvlink_effective_bandwidth_bytes_per_s()) * kUnitsPerByte;
    nv_up[du] = zone->create_link("nvlink_up" + id, nv)->set_latency(0)->seal();
    nv_dn[du] = zone->create_link("nvlink_down" + id, nv)->set_latency(0)->seal();
    const double nic = std::max(1.0, node.nic_bandwidth_per_gpu_bytes_per_s()) * kUnitsPerByte;
    link_rate_[4 * du] = link_rate_[4 * du + 1] = nv;
    link_rate_[4 * du + 2] = link_rate_[4 * du + 3] = nic;
    net_up[du] = zone->create_link("net_up" + id, nic)->set_latency(0)->seal();
    net_dn[du] = zone->create_link("net_down" + id, nic)->set_latency(0)->seal();
  }
  const bool thin_leaf = cluster.network.topology == "fat-tree" && cluster.network.oversubscription > 1;
  thin_leaf_ = thin_leaf;
  std::vector<sg::Link*> leaf_up, leaf_dn;
  if (thin_leaf) {
    for (std::size_t n = 0; n < cluster.nodes.size(); ++n) {
      const NodeSpec& node = cluster.nodes[n];
      const double bw = node.nics * node.nic_bandwidth_bytes_per_s / cluster.network.oversubscription * kUnitsPerByte;
      leaf_up.push_back(zone->create_link("leaf_up" + std::to_string(n), bw)->set_latency(0)->seal());
      leaf_dn.push_back(zone->create_link("leaf_down" + std::to_string(n), bw)->set_latency(0)->seal());
      link_rate_.push_back(bw);
      link_rate_.push_back(bw);
    }
  }
  std::vector<sg::Link*> sm(hosts_.size(), nullptr);
  sm_link_.assign(hosts_.size(), -1);
  for (std::size_t d = 0; d < comm_capacity.size() && d < hosts_.size(); ++d) {
    if (!std::isfinite(comm_capacity[d]) || comm_capacity[d] <= 0) continue;
    const NodeSpec& node = cluster.node(static_cast<int>(d));
    const double bw = comm_capacity[d] * std::max(1.0, node.nvlink_effective_bandwidth_bytes_per_s()) * kUnitsPerByte;
    sm[d] = zone->create_link("sm" + std::to_string(d), bw)->set_latency(0)->seal();
    sm_link_[d] = static_cast<int>(link_rate_.size());
    link_rate_.push_back(bw);
  }
  std::vector<std::pair<int, int>> pairs = routes;
  std::sort(pairs.begin(), pairs.end());
  pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());
  for (auto [s, t] : pairs) {
    if (s == t) continue;
    const auto su = static_cast<std::size_t>(s), tu = static_cast<std::size_t>(t);
    std::vector<sg::LinkInRoute> links;
    if (sm[su]) links.emplace_back(sm[su]);
    if (node_of_[su] == node_of_[tu]) {
      links.emplace_back(nv_up[su]);
      links.emplace_back(nv_dn[tu]);
    } else {
      links.emplace_back(net_up[su]);
      if (thin_leaf) {
        links.emplace_back(leaf_up[static_cast<std::size_t>(node_of_[su])]);
        links.emplace_back(leaf_dn[static_cast<std::size_t>(node_of_[tu])]);
      }
      links.emplace_back(net_dn[tu]);
    }
    zone->add_route(hosts_[su]->get_netpoint(), hosts_[tu]->get_netpoint(), nullptr, nullptr, links, false);
  }
  zone->seal();
}

double Platform::route_latency_s(int src, int dst) const {
  const auto su = static_cast<std::size_t>(src), tu = static_cast<std::size_t>(dst);
  if (src == dst) return 0;
  if (node_of_[su] == node_of_[tu]) return nvlink_latency_half_[su] + nvlink_latency_half_[tu];
  return network_latency_half_[su] + network_latency_half_[tu];
}

int Platform::route_links(int src, int dst, int* out) const {
  if (src == dst) return 0;
  const auto su = static_cast<std::size_t>(src), tu = static_cast<std::size_t>(dst);
  int k = 0;
  if (sm_link_[su] >= 0) out[k++] = sm_link_[su];
  if (node_of_[su] == node_of_[tu]) {
    out[k++] = 4 * src;
    out[k++] = 4 * dst + 1;
    return k;
  }
  out[k++] = 4 * src + 2;
  if (thin_leaf_) {
    out[k++] = 4 * num_devices_ + 2 * node_of_[su];
    out[k++] = 4 * num_devices_ + 2 * node_of_[tu] + 1;
  }
  out[k++] = 4 * dst + 3;
  return k;
}

double Platform::route_rate_units(int src, int dst) const {
  int links[kMaxRouteLinks];
  const int k = route_links(src, dst, links);
  double rate = INFINITY;
  for (int i = 0; i < k; ++i) rate = std::min(rate, link_rate_[static_cast<std::size_t>(links[i])]);
  return rate;
}

}  // namespace piper::sim::simgrid_detail
