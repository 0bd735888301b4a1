// A scenario: everything that decides a Program (model, training shape, PP regions, and a directive
// program or strategy flags). Shared by the CLI, the GUI and sweeps, and storable as one JSON file.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/compiler.hpp"
#include "piper/core/model.hpp"
#include "piper/core/strategy.hpp"

namespace piper::core {

struct Scenario {
  std::string model = "qwen3-9m";     // zoo name, model spec JSON or HF config.json path
  std::int64_t seq_len = 0;           // 0: the model's default
  std::int64_t micro_batch_size = 0;  // 0: the model's default
  int stages = 0;                     // PP regions; 0: from the program or the schedule family
  std::vector<int> stage_starts;      // explicit PP regions: first block of each (overrides balancing)
  // Uneven pipelines (Megatron's --decoder-first/last-pipeline-num-layers): blocks of the first and of
  // the last PP region; the other regions share the rest evenly (first_last_stage_starts). 0: balanced.
  int first_stage_layers = 0;
  int last_stage_layers = 0;
  std::optional<nlohmann::json> directives;  // a directive program; empty: generated from `strategy`
  std::string directives_source;             // file the program came from (for error messages)
  StrategyOptions strategy;
  bool append_schedule = false;  // directives is placement-only: append strategy.schedule
  std::string cluster;           // cluster preset or file (used by the simulator)
  std::string engine;            // simulator engine (empty: default)
  // Training settings for `piper run --scenario` (its flags of the same names win): an object with
  // any of kTrainKeys, each checked for its type here; empty when none.
  nlohmann::json train = nlohmann::json::object();
  std::string source;  // where from_json read it (its `where`), for error messages; empty from flags

  nlohmann::json to_json() const;
  // Reads a scenario file's JSON; `where` names it in errors. Relative paths resolve against `base_dir`.
  static Scenario from_json(const nlohmann::json& j, const std::string& where, const std::string& base_dir = "");
};

// A "cluster" field (a preset, a file, or a spec written inline) with the file it names passed through
// `map`: the field itself, or, for a derived spec written inline ({"cluster": "base.json", "runtime":
// ...}: sim/cluster.hpp), its "cluster". So a scenario or sweep file resolves (and --save-scenario
// relocates) the base of an inline derived spec as it does a cluster file it names directly.
std::string map_cluster_file(const std::string& cluster, const std::function<std::string(const std::string&)>& map);

// The keys of a scenario's "train" section: `piper run`'s flags of the same names (--lr-decay for
// lr_decay, ...): steps, seed, lr, min_lr, warmup_steps, lr_decay, lr_decay_steps, weight_decay,
// beta1, beta2, adam_eps, the loss-scaling settings, data and resume (files, relative to the
// scenario's folder), on_nonfinite and precision.
const std::vector<std::string>& scenario_train_keys();

struct CompiledScenario {
  ModelConfig config;
  Model model;               // with PP annotations
  DirectiveProgram program;  // the directive program that was compiled (to_json() for a file)
  CompileResult result;
};

// Loads the model, balances its PP regions, builds the directive program and compiles it. Errors are
// core::Error subclasses whose one-line message names the file or flag at fault.
CompiledScenario compile_scenario(const Scenario& s, const AfterPassHook& hook = {});

// The first block of each of `regions` PP regions over `blocks` transformer blocks when the first
// region has `first` blocks and the last `last` (0: not fixed); the regions between share the rest
// evenly, as Megatron-LM requires. Throws Error naming the flags when they cannot.
std::vector<int> first_last_stage_starts(int blocks, int regions, int first, int last);

// The model's architecture with the scenario's training shape (seq_len, micro_batch_size) applied.
ModelConfig scenario_model_config(const Scenario& s);

// Annotates `model`'s PP regions as compile_scenario does: the scenario's explicit ranges, or `regions`
// regions balanced by compute, then rebalanced per device when `program` places several regions on
// one device (V placements, mirrored pairs). Throws ModelError naming the region count.
void annotate_regions(const Scenario& s, Model& model, const DirectiveProgram& program, int regions);

// The directive program a scenario compiles (without compiling it); `regions` receives the PP count.
// A scenario's own program is parsed (errors name its source); a generated one is typed as built
// (compile_scenario checks it, validated()).
DirectiveProgram scenario_program(const Scenario& s, int* regions = nullptr);

// `piper directives`: the directive program the strategy generator emits for `o`. With a model (zoo
// name or file), first checks the strategy against it (e.g. --ep against its experts).
DirectiveProgram strategy_directives(const StrategyOptions& o, const std::string& model = "");

// --v-head / --v-embedding auto: every choice (in the V, a region of its own on rank 0..pp-1, or the
// head alone on the last rank), in the V first; {o} when neither is auto. Error for a non-V family.
std::vector<StrategyOptions> v_end_choices(const StrategyOptions& o);
// Without a simulator (piper compile/directives): the choice with the shortest v_step_estimate.
// sim::simulate instead simulates every choice (analytic engine) and keeps the fastest. Other values
// are returned unchanged.
StrategyOptions resolve_v_ends(StrategyOptions o, const ModelConfig& cfg);
// The step of the V placement `o` (a V family, no "auto") for `cfg`'s model, its blocks balanced as a
// scenario balances them: the schedule table replayed with each region's roofline work per pass
// (FLOPs, or HBM bytes at 300 FLOP/byte), communication free (schedule_makespan).
double v_step_estimate(const StrategyOptions& o, const ModelConfig& cfg);
// The per-rank F + B FLOPs of the V placement that `o` (a V family, no "auto") gives `cfg`'s model.
std::vector<double> v_rank_loads(const StrategyOptions& o, const ModelConfig& cfg);

// PP regions a directive program refers to: 1 + the largest "PP" index in any filter (at least 1).
int pp_regions_in_program(const DirectiveProgram& program);

}  // namespace piper::core
