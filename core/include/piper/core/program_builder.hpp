// The typed builder of directive programs, for front ends (the strategy generator, the schedule
// families, scenarios, tune, the PyTorch CSV import): each directive is added with typed arguments and
// becomes a typed Directive of the DirectiveProgram (directives.hpp), together with its JSON form,
// written here and nowhere else (the one serializer; a CTest grep, Contract.FrontEndsBuildTypedDirectives,
// keeps it so). The JSON form is the published format exactly as a person writes it (optional fields
// only when given, whole megabytes as integers): the form scenario files store, `piper directives`
// prints and the GUI shows. build() checks the program as the parser checks a file (validated()).
#pragma once

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
  std::optional<std::string> reduce_stream, gather_stream, gather_unit, gather_dtype, reduce_every, collective_copies;
  std::optional<int> shard_group, prefetch;
};

class ProgramBuilder {
 public:
  ProgramBuilder() = default;
  // Continues an existing program (a file's, or another generator's).
  explicit ProgramBuilder(DirectiveProgram program) : program_(std::move(program)) {}

  ProgramBuilder& place(const Filter& filter, const std::vector<int>& devices,
                        const std::optional<std::string>& stream = {}, bool blocking = false,
                        const std::string& holds = "");
  ProgramBuilder& replicate(const Filter& filter, const std::vector<int>& devices, const ReplicateArgs& args = {});
  ProgramBuilder& shard(const Filter& filter, const std::vector<int>& devices,
                        const std::optional<std::string>& stream = {}, std::optional<int> degree = {},
                        std::optional<int> chunks = {}, const std::optional<std::string>& dispatch_dtype = {});
  ProgramBuilder& split(const Filter& filter, int num_microbatches, const std::optional<std::string>& dim_name = {});
  ProgramBuilder& order(const std::vector<std::vector<Filter>>& groups);
  ProgramBuilder& tensor_parallel(const Filter& filter, int degree, bool sequence_parallel = false,
                                  bool comm_overlap = false, int expert_degree = 1);
  // "none", "selective", "full" or "op"; every / first > 0: only those blocks (RecomputeDirective)
  ProgramBuilder& recompute(const Filter& filter, const std::string& mode, int every = 0, int first = 0);
  ProgramBuilder& sm_partition(int sms);                                  // the communication streams' SMs
  ProgramBuilder& clip_grad(double max_norm);                             // gradient clipping by global norm
  ProgramBuilder& context_parallel(int degree, bool all_gather = false);  // the whole model's CP degree
  ProgramBuilder& append(const DirectiveProgram& directives);             // another program's directives, in order

  const DirectiveProgram& program() const { return program_; }
  DirectiveProgram take() { return std::move(program_); }
  nlohmann::json to_json() const { return program_.to_json(); }   // for a file, a print, the GUI's editor
  DirectiveProgram build() const { return validated(program_); }  // the parser's checks and errors

 private:
  void add(Directive d, nlohmann::json source);
  DirectiveProgram program_;
};

// {"PP": pp} and {"PP": pp, tag: "*"}: the filters generators write most.
Filter region_filter(int pp);
Filter region_filter(int pp, const std::string& any_tag);

}  // namespace piper::core
