// What a scenario file holds beside its strategy: the file written back (Scenario::to_json), the keys
// of its "train" section, and the cluster file it names (through an inline derived spec too).
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/scenario.hpp"
#include "piper/core/settings.hpp"
#include "piper/core/strategy.hpp"

namespace piper::core {

using nlohmann::json;

json Scenario::to_json() const {
  json j{{"model", model}};
  if (seq_len) j["seq_len"] = seq_len;
  if (micro_batch_size) j["micro_batch_size"] = micro_batch_size;
  if (stages) j["stages"] = stages;
  if (!stage_starts.empty()) j["pp_ranges"] = stage_starts;
  if (first_stage_layers > 0) j["first_stage_layers"] = first_stage_layers;
  if (last_stage_layers > 0) j["last_stage_layers"] = last_stage_layers;
  if (directives) {
    j["directives"] = *directives;
    if (append_schedule) j["append_schedule"] = true;
  }
  // Essential settings always, the others only when not at their default (settings.hpp); beside a
  // directive program only those it takes (from_json refuses the others): the schedule's, when appended.
  j["strategy"] = strategy_to_json(strategy);
  if (directives)
    for (const Setting& s : strategy_settings())
      if (s.generator_only || !append_schedule) j["strategy"].erase(s.name);
  if (!cluster.empty()) j["cluster"] = cluster;
  if (!engine.empty()) j["engine"] = engine;
  if (!train.empty()) j["train"] = train;
  return j;
}

std::string map_cluster_file(const std::string& cluster, const std::function<std::string(const std::string&)>& map) {
  const std::size_t first = cluster.find_first_not_of(" \t\r\n");
  if (first == std::string::npos || cluster[first] != '{') return map(cluster);
  json spec = json::parse(cluster, nullptr, false);
  if (!spec.is_object() || !spec.contains("cluster") || !spec.at("cluster").is_string()) return cluster;
  spec["cluster"] = map(spec.at("cluster").get<std::string>());
  return spec.dump();
}

const std::vector<std::string>& scenario_train_keys() {
  static const std::vector<std::string> keys = {
      "steps",          "seed",  "lr",           "min_lr",   "warmup_steps", "lr_decay",           "lr_decay_steps",
      "weight_decay",   "beta1", "beta2",        "adam_eps", "loss_scale",   "initial_loss_scale", "loss_scale_window",
      "min_loss_scale", "data",  "on_nonfinite", "resume",   "precision"};
  return keys;
}

}  // namespace piper::core
