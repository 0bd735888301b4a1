// The pass interface of the directive compiler, in the spirit of MLIR's pass manager but small: a
// pass has a name (the --dump-after name), says whether it is internal (runs once, owned by no
// directive) or applies one kind of directive (runs once per such directive, in program order), and
// rewrites the DAG. pass_manager.cpp holds the one table that orders them and runs them, verifying the
// DAG and calling the --dump-after hook after every pass, the internal ones included.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "pass_context.hpp"

namespace piper::core::passes {

// The state one apply_directives run shares between its passes.
struct PassRun {
  PassContext cx;
  const DirectiveProgram& program;
  std::vector<int> tp_by, rc_by;  // per segment: the tensor_parallel / recompute directive that set it, or -1
  std::vector<int> placed_by;     // per vertex: the place directive that placed it, or -1
};

struct PassDef {
  std::string_view name;  // for --dump-after and the after-<index>-<name> files
  bool internal;          // true: runs once with no directive (index -1)
  bool placed;            // every node has its devices after this pass (the verifier checks them)
  // Without a hook the cycle check runs only where a phase ends (see apply_directives).
  bool ends_phase;
  // Directive passes: whether a directive is of this pass's kind, and the rewrite it does.
  bool (*applies)(const Directive&);
  void (*run_directive)(PassRun&, const Directive&, int index);
  // Internal passes: the rewrite; false when there was nothing to do (then no dump).
  bool (*run_internal)(PassRun&);
};

// The passes in the order they run.
std::span<const PassDef> pass_table();

// Builds a directive pass's entry from a function of its directive type.
template <class D, void (*Run)(PassRun&, const D&, int)>
constexpr PassDef directive_pass(std::string_view name, bool placed, bool ends_phase = false) {
  return {name,
          false,
          placed,
          ends_phase,
          [](const Directive& d) { return std::holds_alternative<D>(d); },
          [](PassRun& run, const Directive& d, int index) { Run(run, std::get<D>(d), index); },
          nullptr};
}
constexpr PassDef internal_pass(std::string_view name, bool (*run)(PassRun&), bool placed, bool ends_phase = false) {
  return {name, true, placed, ends_phase, nullptr, nullptr, run};
}

// One file per pass under core/src/passes/.
void run_split(PassRun& run, const SplitDirective& d, int index);                       // split.cpp
bool run_backward_split(PassRun& run);                                                  // backward_split.cpp
void run_tensor_parallel(PassRun& run, const TensorParallelDirective& d, int index);    // tensor_parallel.cpp
bool run_tp_groups(PassRun& run);                                                       // tensor_parallel.cpp
void run_context_parallel(PassRun& run, const ContextParallelDirective& d, int index);  // context_parallel.cpp
bool run_cp_groups(PassRun& run);                                                       // context_parallel.cpp
void run_recompute(PassRun& run, const RecomputeDirective& d, int index);               // recompute.cpp
bool run_recost(PassRun& run);                                                          // recost.cpp
void run_place(PassRun& run, const PlaceDirective& d, int index);                       // place.cpp
bool run_finish_placement(PassRun& run);                                                // place.cpp
void run_shard(PassRun& run, const ShardDirective& d, int index);                       // shard.cpp
void run_replicate(PassRun& run, const ReplicateDirective& d, int index);               // replicate.cpp
bool run_tied_embedding(PassRun& run);                                                  // tied_embedding.cpp
bool run_update_costs(PassRun& run);                                                    // update_costs.cpp
void run_order(PassRun& run, const OrderDirective& d, int index);                       // order.cpp
void run_sm_partition(PassRun& run, const SmPartitionDirective& d, int index);          // sm_partition.cpp
void run_clip_grad(PassRun& run, const ClipGradDirective& d, int index);                // clip_grad.cpp

}  // namespace piper::core::passes
