// Helpers shared by the directive passes (pass_context.hpp).
#include "pass_context.hpp"

#include <algorithm>
#include <set>

namespace piper::core::passes {

std::string set_str(const std::vector<int>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i == 8) {
      out += ",… " + std::to_string(s.size()) + " devices";
      break;
    }
    if (i) out += ',';
    out += std::to_string(s[i]);
  }
  return out + "]";
}

std::vector<EdgeRec> out_edges_of(const Graph& g, Vertex u) {
  std::vector<EdgeRec> out;
  for (auto e : boost::make_iterator_range(boost::out_edges(u, g))) out.push_back({u, boost::target(e, g), g[e]});
  return out;
}
std::vector<EdgeRec> in_edges_of(const Graph& g, Vertex v) {
  std::vector<EdgeRec> out;
  for (auto e : boost::make_iterator_range(boost::in_edges(v, g))) out.push_back({boost::source(e, g), v, g[e]});
  return out;
}

// Matched nodes must sit on exactly the directive's devices (in order).
void check_devices(PassContext& cx, const std::vector<Vertex>& matched, const std::vector<int>& devices, int index) {
  for (auto v : matched) {
    const auto& placed = cx.dag.device_sets.at(cx.node(v).devices);
    if (placed != devices)
      fail(index, "devices",
           set_str(devices) + " differ from the placement " + set_str(placed) + " of '" + cx.node(v).label + "'");
  }
}

std::vector<int> segments_of(PassContext& cx, const std::vector<Vertex>& nodes) {
  std::set<int> s;
  for (auto v : nodes) s.insert(cx.node(v).segment);
  return {s.begin(), s.end()};
}

std::string common_tags_label(const GlobalDag& dag, const std::vector<int>& segments) {
  TagMap common = dag.segments.at(static_cast<std::size_t>(segments.front())).tags;
  for (int s : segments) {
    const auto& t = dag.segments.at(static_cast<std::size_t>(s)).tags;
    for (auto it = common.begin(); it != common.end();)
      it = (t.contains(it->first) && t.at(it->first) == it->second) ? std::next(it) : common.erase(it);
  }
  std::string out;
  for (const auto& [k, v] : common) out += " " + k + std::to_string(v);
  if (segments.size() == 1)
    out += " s" + std::to_string(segments.front());
  else
    out += " s" + std::to_string(*std::min_element(segments.begin(), segments.end())) + "-" +
           std::to_string(*std::max_element(segments.begin(), segments.end()));
  return out;
}

}  // namespace piper::core::passes
