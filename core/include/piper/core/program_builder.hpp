// A typed builder of directive programs, for front ends (the strategy generator, tune's rank orders):
// each directive is added with typed arguments, optional fields are written only when given, and the
// result is the published JSON format exactly as a person writes it (the form scenario files store,
// `piper directives` prints and the GUI shows). build() parses it into the DirectiveProgram the
// passes apply, with the parser's validation and field-level errors.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/directives.hpp"

namespace piper::core {

// The optional fields of a replicate directive (absent: the format's default).
struct ReplicateArgs {
  std::optional<double> bucket_size_mb;  // whole megabytes are written as integers, as the format does
  bool shard_optimizer = false;          // ZeRO-1 (written only when true, as are the two below)
  bool shard_grads = false;              // ZeRO-2
  bool shard_params = false;             // ZeRO-3
  std::optional<std::string> reduce_stream, gather_stream, gather_unit, gather_dtype, reduce_every;
  std::optional<int> shard_group, prefetch;
};

class ProgramBuilder {
 public:
  ProgramBuilder() = default;
  // Continues an existing program (a file's, or another generator's).
  explicit ProgramBuilder(nlohmann::json program);

  ProgramBuilder& place(const Filter& filter, const std::vector<int>& devices,
                        const std::optional<std::string>& stream = {}, bool blocking = false,
                        const std::string& holds = "");
  ProgramBuilder& replicate(const Filter& filter, const std::vector<int>& devices, const ReplicateArgs& args = {});
  ProgramBuilder& shard(const Filter& filter, const std::vector<int>& devices,
                        const std::optional<std::string>& stream = {}, std::optional<int> degree = {},
                        std::optional<int> chunks = {});
  ProgramBuilder& split(const Filter& filter, int num_microbatches, const std::optional<std::string>& dim_name = {});
  ProgramBuilder& order(const std::vector<std::vector<Filter>>& groups);
  ProgramBuilder& tensor_parallel(const Filter& filter, int degree, bool sequence_parallel = false,
                                  bool comm_overlap = false, int expert_degree = 1);
  // "none", "selective", "full" or "op"; every / first > 0: only those blocks (RecomputeDirective)
  ProgramBuilder& recompute(const Filter& filter, const std::string& mode, int every = 0, int first = 0);
  ProgramBuilder& sm_partition(int sms);                                  // the communication streams' SMs
  ProgramBuilder& context_parallel(int degree, bool all_gather = false);  // the whole model's CP degree
  ProgramBuilder& append(const nlohmann::json& directives);               // another program's directives, in order

  // Every device id d of every directive becomes map(d) (the same program on other devices).
  ProgramBuilder& relabel_devices(const std::function<int(int)>& map);

  const nlohmann::json& program() const { return program_; }
  nlohmann::json take() { return std::move(program_); }
  DirectiveProgram build() const { return parse_directives(program_); }

 private:
  nlohmann::json program_ = nlohmann::json::array();
};

// {"PP": pp} and {"PP": pp, tag: "*"}: the filters generators write most.
Filter region_filter(int pp);
Filter region_filter(int pp, const std::string& any_tag);

}  // namespace piper::core
