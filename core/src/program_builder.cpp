// The typed directive-program builder (program_builder.hpp): each method makes the typed directive, with
// the defaults the parser gives an absent field, and its JSON form. This file is the one serializer of
// directives (Contract.FrontEndsBuildTypedDirectives allows it alone to write a directive's JSON).
#include "piper/core/program_builder.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace piper::core {

using nlohmann::json;

namespace {

json directive(const char* op, const Filter& filter) { return json{{"op", op}, {"filter", filter.to_json()}}; }

}  // namespace

Filter region_filter(int pp) { return Filter{{{"PP", pp}}, {}, {}}; }
Filter region_filter(int pp, const std::string& any_tag) { return Filter{{{"PP", pp}}, {any_tag}, {}}; }

void ProgramBuilder::add(Directive d, json source) {
  program_.directives.push_back(std::move(d));
  program_.source.push_back(std::move(source));
}

ProgramBuilder& ProgramBuilder::place(const Filter& filter, const std::vector<int>& devices,
                                      const std::optional<std::string>& stream, bool blocking,
                                      const std::string& holds) {
  PlaceDirective p{filter, devices, stream.value_or("pp"), blocking, holds};
  json d = directive("place", filter);
  d["devices"] = devices;
  if (stream) d["stream"] = *stream;
  if (blocking) d["blocking"] = true;
  if (!holds.empty()) d["holds"] = holds;
  add(std::move(p), std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::replicate(const Filter& filter, const std::vector<int>& devices,
                                          const ReplicateArgs& a) {
  ReplicateDirective r;
  r.filter = filter;
  r.devices = devices;
  r.bucket_size_mb = a.bucket_size_mb.value_or(0);
  r.shard_optimizer = a.shard_optimizer;
  r.shard_grads = a.shard_grads;
  r.shard_params = a.shard_params;
  r.prefetch = a.prefetch.value_or(1);
  r.gather_blocks = a.gather_unit == "block";
  r.gather_fp8 = a.gather_dtype == "fp8";
  r.shard_group = a.shard_group.value_or(0);
  r.reduce_every_microbatch = a.reduce_every ? *a.reduce_every == "microbatch" : a.shard_grads;
  r.fsdp2_copies = a.collective_copies == "fsdp2";
  r.reduce_stream = a.reduce_stream.value_or("dp");
  r.gather_stream = a.gather_stream.value_or(r.reduce_stream);
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
  if (a.collective_copies) d["collective_copies"] = *a.collective_copies;
  if (a.shard_group) d["shard_group"] = *a.shard_group;
  if (a.prefetch) d["prefetch"] = *a.prefetch;
  add(std::move(r), std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::shard(const Filter& filter, const std::vector<int>& devices,
                                      const std::optional<std::string>& stream, std::optional<int> degree,
                                      std::optional<int> chunks, const std::optional<std::string>& dispatch_dtype) {
  ShardDirective s{filter,
                   devices,
                   degree.value_or(0),
                   stream.value_or("ep"),
                   chunks.value_or(1),
                   dispatch_dtype == "fp8" ? "fp8" : ""};
  json d = directive("shard", filter);
  d["devices"] = devices;
  if (stream) d["stream"] = *stream;
  if (degree) d["degree"] = *degree;
  if (chunks) d["chunks"] = *chunks;
  if (dispatch_dtype) d["dispatch_dtype"] = *dispatch_dtype;
  add(std::move(s), std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::split(const Filter& filter, int num_microbatches,
                                      const std::optional<std::string>& dim_name) {
  SplitDirective s;  // the format's default dimension unless given
  s.filter = filter;
  s.count = num_microbatches;
  if (dim_name) s.dim_name = *dim_name;
  json d = directive("split", filter);
  d["num_microbatches"] = num_microbatches;
  if (dim_name) d["dim_name"] = *dim_name;
  add(std::move(s), std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::order(const std::vector<std::vector<Filter>>& groups) {
  json filters = json::array();
  for (const auto& group : groups) {
    json g = json::array();
    for (const auto& f : group) g.push_back(f.to_json());
    filters.push_back(std::move(g));
  }
  add(OrderDirective{groups}, json{{"op", "order"}, {"filters", std::move(filters)}});
  return *this;
}

ProgramBuilder& ProgramBuilder::tensor_parallel(const Filter& filter, int degree, bool sequence_parallel,
                                                bool comm_overlap, int expert_degree) {
  TensorParallelDirective t{filter, {}, degree, sequence_parallel, comm_overlap, std::max(expert_degree, 1)};
  json d = directive("tensor_parallel", filter);
  d["degree"] = degree;
  if (sequence_parallel) d["sequence_parallel"] = true;
  if (comm_overlap) d["comm_overlap"] = true;
  if (expert_degree > 1) d["expert_degree"] = expert_degree;
  add(std::move(t), std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::recompute(const Filter& filter, const std::string& mode, int every, int first) {
  RecomputeDirective r{filter, Recompute::None, std::max(every, 0), std::max(first, 0)};
  try {
    r.mode = recompute_from_string(mode);
  } catch (const std::invalid_argument&) {
    // Left to build() / validated(), which names the directive and field as for a file's program.
  }
  json d = directive("recompute", filter);
  d["mode"] = mode;
  if (every > 0) d["every"] = every;
  if (first > 0) d["first"] = first;
  add(std::move(r), std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::context_parallel(int degree, bool all_gather) {
  json d{{"op", "context_parallel"}, {"degree", degree}};
  if (all_gather) d["comm"] = "all_gather";
  add(ContextParallelDirective{degree, all_gather}, std::move(d));
  return *this;
}

ProgramBuilder& ProgramBuilder::clip_grad(double max_norm) {
  add(ClipGradDirective{max_norm}, json{{"op", "clip_grad"}, {"max_norm", max_norm}});
  return *this;
}

ProgramBuilder& ProgramBuilder::sm_partition(int sms) {
  add(SmPartitionDirective{SmPartition{"comm", sms}}, json{{"op", "sm_partition"}, {"stream", "comm"}, {"sms", sms}});
  return *this;
}

ProgramBuilder& ProgramBuilder::append(const DirectiveProgram& directives) {
  program_.append(directives);
  return *this;
}

}  // namespace piper::core
