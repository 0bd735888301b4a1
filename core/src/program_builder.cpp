// The typed directive-program builder (program_builder.hpp).
#include "piper/core/program_builder.hpp"

#include <cmath>

namespace piper::core {

using nlohmann::json;

namespace {

json directive(const char* op, const Filter& filter) { return json{{"op", op}, {"filter", filter.to_json()}}; }

}  // namespace

Filter region_filter(int pp) { return Filter{{{"PP", pp}}, {}, {}}; }
Filter region_filter(int pp, const std::string& any_tag) { return Filter{{{"PP", pp}}, {any_tag}, {}}; }

ProgramBuilder::ProgramBuilder(json program) : program_(std::move(program)) {
  if (!program_.is_array())
    throw Error(std::string("a directive program must be a JSON array, got ") + program_.type_name());
}

ProgramBuilder& ProgramBuilder::place(const Filter& filter, const std::vector<int>& devices,
                                      const std::optional<std::string>& stream, bool blocking,
                                      const std::string& holds) {
  json d = directive("place", filter);
  d["devices"] = devices;
  if (stream) d["stream"] = *stream;
  if (blocking) d["blocking"] = true;
  if (!holds.empty()) d["holds"] = holds;
  program_.push_back(std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::replicate(const Filter& filter, const std::vector<int>& devices,
                                          const ReplicateArgs& a) {
  json d = directive("replicate", filter);
  d["devices"] = devices;
  if (a.bucket_size_mb) {
    if (*a.bucket_size_mb == std::floor(*a.bucket_size_mb))
      d["bucket_size"] = static_cast<long long>(*a.bucket_size_mb);
    else
      d["bucket_size"] = *a.bucket_size_mb;
  }
  if (a.shard_optimizer) d["shard_optimizer"] = true;
  if (a.shard_grads) d["shard_grads"] = true;
  if (a.shard_params) d["shard_params"] = true;
  if (a.reduce_stream) d["reduce_stream"] = *a.reduce_stream;
  if (a.gather_stream) d["gather_stream"] = *a.gather_stream;
  if (a.gather_unit) d["gather_unit"] = *a.gather_unit;
  if (a.gather_dtype) d["gather_dtype"] = *a.gather_dtype;
  if (a.reduce_every) d["reduce_every"] = *a.reduce_every;
  if (a.shard_group) d["shard_group"] = *a.shard_group;
  if (a.prefetch) d["prefetch"] = *a.prefetch;
  program_.push_back(std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::shard(const Filter& filter, const std::vector<int>& devices,
                                      const std::optional<std::string>& stream, std::optional<int> degree,
                                      std::optional<int> chunks) {
  json d = directive("shard", filter);
  d["devices"] = devices;
  if (stream) d["stream"] = *stream;
  if (degree) d["degree"] = *degree;
  if (chunks) d["chunks"] = *chunks;
  program_.push_back(std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::split(const Filter& filter, int num_microbatches,
                                      const std::optional<std::string>& dim_name) {
  json d = directive("split", filter);
  d["num_microbatches"] = num_microbatches;
  if (dim_name) d["dim_name"] = *dim_name;
  program_.push_back(std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::order(const std::vector<std::vector<Filter>>& groups) {
  json filters = json::array();
  for (const auto& group : groups) {
    json g = json::array();
    for (const auto& f : group) g.push_back(f.to_json());
    filters.push_back(std::move(g));
  }
  program_.push_back(json{{"op", "order"}, {"filters", std::move(filters)}});
  return *this;
}

ProgramBuilder& ProgramBuilder::tensor_parallel(const Filter& filter, int degree, bool sequence_parallel,
                                                bool comm_overlap, int expert_degree) {
  json d = directive("tensor_parallel", filter);
  d["degree"] = degree;
  if (sequence_parallel) d["sequence_parallel"] = true;
  if (comm_overlap) d["comm_overlap"] = true;
  if (expert_degree > 1) d["expert_degree"] = expert_degree;
  program_.push_back(std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::recompute(const Filter& filter, const std::string& mode, int every, int first) {
  json d = directive("recompute", filter);
  d["mode"] = mode;
  if (every > 0) d["every"] = every;
  if (first > 0) d["first"] = first;
  program_.push_back(std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::context_parallel(int degree, bool all_gather) {
  json d{{"op", "context_parallel"}, {"degree", degree}};
  if (all_gather) d["comm"] = "all_gather";
  program_.push_back(std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::sm_partition(int sms) {
  program_.push_back(json{{"op", "sm_partition"}, {"stream", "comm"}, {"sms", sms}});
  return *this;
}

ProgramBuilder& ProgramBuilder::append(const json& directives) {
  if (!directives.is_array())
    throw Error(std::string("a directive program must be a JSON array, got ") + directives.type_name());
  for (const auto& d : directives) program_.push_back(d);
  return *this;
}

ProgramBuilder& ProgramBuilder::relabel_devices(const std::function<int(int)>& map) {
  for (auto& d : program_)
    if (d.is_object() && d.contains("devices") && d["devices"].is_array())
      for (auto& dev : d["devices"])
        if (dev.is_number_integer()) dev = map(dev.get<int>());
  return *this;
}

}  // namespace piper::core
