// The pass manager: the one table that orders the directive passes, and apply_directives, which runs
// them, verifying the DAG and calling the --dump-after hook after every pass, the internal ones
// included (a pass that had nothing to do is verified but not dumped).
#include "pass.hpp"

#include <array>

namespace piper::core::passes {

namespace {

// The order: split -> backward-split -> tensor_parallel/context_parallel/recompute -> recost -> place ->
// finish-placement -> tp-groups -> cp-groups -> shard -> replicate -> tied-embedding -> clip-grad -> update-costs ->
// order -> sm_partition. ARCHITECTURE.md lists it (checked by the architecture_doc test).
// Tensor parallelism and recomputation change per-device costs before placement creates the
// transfers (whose sizes they change); their groups are formed once the placement is known.
constexpr std::array kPasses = {
    directive_pass<SplitDirective, run_split>("split", false),
    internal_pass("backward-split", run_backward_split, false),
    directive_pass<TensorParallelDirective, run_tensor_parallel>("tensor-parallel", false),
    directive_pass<ContextParallelDirective, run_context_parallel>("context-parallel", false),
    directive_pass<RecomputeDirective, run_recompute>("recompute", false),
    internal_pass("recost", run_recost, false, true),
    directive_pass<PlaceDirective, run_place>("place", false),
    internal_pass("finish-placement", run_finish_placement, true),
    internal_pass("tp-groups", run_tp_groups, true, true),
    internal_pass("cp-groups", run_cp_groups, true),
    directive_pass<ShardDirective, run_shard>("shard", true),
    directive_pass<ReplicateDirective, run_replicate>("replicate", true),
    internal_pass("tied-embedding", run_tied_embedding, true, true),
    directive_pass<ClipGradDirective, run_clip_grad>("clip-grad", true, true),
    internal_pass("update-costs", run_update_costs, true),
    directive_pass<OrderDirective, run_order>("order", true),
    directive_pass<SmPartitionDirective, run_sm_partition>("sm-partition", true, true),
};

// Invariants checked after every pass (acyclicity: when strict; see apply_directives).
void verify_dag(PassContext& cx, const std::string& after, bool placed) {
  if (cx.strict && cx.dag.has_cycle()) throw InternalError("the DAG has a cycle after " + after);
  if (!placed) return;
  for (auto v : cx.dag.live_nodes()) {
    const auto& n = cx.node(v);
    if (n.devices == kNoDevices && n.kind != NodeKind::Update)
      throw InternalError("'" + n.label + "' has no devices after " + after);
    if (n.family >= 0 && cx.dag.families.at(static_cast<std::size_t>(n.family)).devices != n.devices)
      throw InternalError("'" + n.label + "' runs outside its communicator family after " + after);
  }
}

// Thrown by an unchecked run that finds a cycle at the end of a phase (apply_directives reruns strictly).
struct CycleInPhase {};

void apply_directives_in_place(GlobalDag& dag, const DirectiveProgram& program, const AfterPassHook& hook,
                               bool strict) {
  PassRun run{PassContext{dag,
                          std::vector<std::string>(boost::num_vertices(dag.graph)),
                          std::vector<char>(boost::num_vertices(dag.graph), 0),
                          {},
                          std::vector<bool>(dag.segments.size(), false),
                          strict,
                          {}},
              program,
              std::vector<int>(dag.segments.size(), -1),
              std::vector<int>(dag.segments.size(), -1),
              {}};
  // Unchecked (see apply_directives), the placed nodes' invariants are checked where a phase ends, as
  // cycles are: checking every node after each directive made compile quadratic in a deep pipeline's
  // order directives (one per stage).
  auto after = [&](const PassDef& pass, int index) {
    if (strict)
      verify_dag(run.cx, std::string(pass.name) + (index >= 0 ? " (directive " + std::to_string(index) + ")" : ""),
                 pass.placed);
    if (hook) hook(std::string(pass.name), index, dag);
  };
  for (const PassDef& pass : kPasses) {
    if (pass.internal) {
      if (pass.run_internal(run)) after(pass, -1);
    } else {
      for (std::size_t i = 0; i < program.directives.size(); ++i)
        if (pass.applies(program.directives[i])) {
          pass.run_directive(run, program.directives[i], static_cast<int>(i));
          after(pass, static_cast<int>(i));
        }
    }
    if (pass.ends_phase && !strict) {
      if (dag.has_cycle()) throw CycleInPhase{};
      verify_dag(run.cx, std::string(pass.name), pass.placed);
    }
  }
}

}  // namespace

std::span<const PassDef> pass_table() { return kPasses; }

}  // namespace piper::core::passes

namespace piper::core {

using passes::apply_directives_in_place;
using passes::CycleInPhase;

std::vector<std::string> pass_names() {
  std::vector<std::string> out;
  for (const auto& p : passes::pass_table()) out.emplace_back(p.name);
  return out;
}

void apply_directives(GlobalDag& dag, const DirectiveProgram& program, const AfterPassHook& hook) {
  // All-or-nothing: the caller's DAG changes only on success. The passes work on the caller's DAG and a
  // failure restores it from a backup, rather than working on a copy: the DAG before the directives (no
  // microbatch split yet) is far smaller than after them, so the backup is the cheaper copy.
  const GlobalDag backup = dag;
  auto run_strictly = [&] {
    try {
      apply_directives_in_place(dag, program, hook, true);
    } catch (...) {
      dag = backup;
      throw;
    }
  };
  // A hook (--dump-after) watches every pass, so it always gets the strict run, as before.
  if (hook) return run_strictly();
  // The cycle check after every pass cost a quarter of compile time on a 1,024-GPU program (41 checks
  // of a DAG of up to 12,000 nodes and 50,000 edges), so a run without a hook checks once per phase
  // (up to placement, placement, shard + replicate, order), and so for the placed nodes' devices and
  // families (a node check after each of a 256-stage pipeline's order directives was a third of its
  // compile). No pass removes a node or an edge
  // without rerouting the paths through it (copies, subdivided edges, merged sink updates), so a
  // cycle made by a pass lasts to the end of its phase; and orders only add nodes and edges, so an
  // acyclic DAG after the last order was acyclic after each. Any failure of this run (a cycle at a
  // phase end, or a later pass's error reached because an earlier cycle went unnoticed) is therefore
  // a failure of the strict run too: rerun strictly, which reports exactly the error it always did.
  try {
    apply_directives_in_place(dag, program, hook, false);
  } catch (...) {
    dag = backup;
    run_strictly();
    throw InternalError("the directive passes failed once and then succeeded");  // unreachable, see above
  }
}

}  // namespace piper::core
