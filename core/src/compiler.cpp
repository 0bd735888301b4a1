// The compile driver shared by every front end: build the DAG, apply directives, lower, verify.
#include "piper/core/compiler.hpp"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <optional>
#include <string>

#include "piper/core/lower.hpp"
#include "piper/core/verifier.hpp"

namespace piper::core {

std::int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;  // reported in kB
  return 0;
}

CompileResult compile(const Model& model, const DirectiveProgram& program, const AfterPassHook& hook) {
  CompileResult result;
  compile(model, program, result, hook);
  return result;
}

namespace {

// ZeRO-3 with "gather_unit": "block" (what `--zero 3` writes): each transformer block becomes a DAG
// segment of its own (tag BLK), so its parameters are gathered, used and freed block by block, as
// FSDP wraps each block; a recompute directive that selects blocks ("every", "first", or a BLK
// filter) needs the same cut, so that a block is recomputed or not as a whole. Otherwise a segment is
// the published format's unit (a run of layers with one tag stack, e.g. a whole pipeline stage of a
// dense model). Returns the model with each block tagged, or nothing when no directive asks for block
// units (then the caller's model is compiled, uncopied).
std::optional<Model> gather_unit_model(const Model& model, const DirectiveProgram& program) {
  const bool blocks = std::any_of(program.directives.begin(), program.directives.end(), [](const Directive& d) {
    if (const auto* rc = std::get_if<RecomputeDirective>(&d)) return rc->selects_blocks();
    const auto* r = std::get_if<ReplicateDirective>(&d);
    return r && r->shard_params && r->gather_blocks;
  });
  if (!blocks) return std::nullopt;
  Model m = model;
  for (Layer& l : m.mutable_layers())
    if (l.block >= 0) l.tags["BLK"] = l.block;
  return m;
}

}  // namespace

void compile(const Model& model, const DirectiveProgram& program, CompileResult& result, const AfterPassHook& hook) {
  if (model.layers().empty()) throw ModelError("model '" + model.name() + "': field 'layers': has no layers");
  const auto start = std::chrono::steady_clock::now();
  const std::optional<Model> blocks = gather_unit_model(model, program);
  result.dag = build_dag(blocks ? *blocks : model);
  apply_directives(result.dag, program, hook);
  result.program = lower(result.dag);
  if (model.config()) {
    ModelConfig c = *model.config();
    c.training = model.training();  // the plan's training shape, after any CLI overrides
    result.program.model_spec = config_to_spec_json(c);
  }
  verify_or_throw(result.program);
  auto& stats = result.program.stats;
  stats.dag_nodes = static_cast<std::int64_t>(result.dag.live_node_count());
  stats.nodes_by_kind = result.dag.counts_by_kind();
  stats.compile_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats.compiler_peak_rss_bytes = peak_rss_bytes();
}

}  // namespace piper::core
