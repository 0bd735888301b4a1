// Shared by the runtime's end-to-end tests (test_runtime.cpp, test_runtime_equivalence.cpp): the tiny
// models, the tolerances, scratch folders, compiling a plan, strategy builders, and the two checks
// most tests are made of (expect_equivalent: a plan against the single-process reference in both
// launches; expect_resume_chain: checkpoints resumed across layouts).
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "shell.hpp"
#include <nlohmann/json.hpp>

#include "piper/core/scenario.hpp"
#include "piper/runtime/host_model.hpp"
#include "piper/runtime/trainer.hpp"

namespace runtime_test {

namespace fs = std::filesystem;
using nlohmann::json;
namespace core = piper::core;

inline const std::string kModel = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json";
// Tensor parallelism runs on dense models (routed experts keep expert parallelism).
inline const std::string kDense = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-dense.json";
// GPT-style: LayerNorm, GELU, biases, learned positions; tied head (kGpt) or its own (kGptUntied).
inline const std::string kGpt = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-gpt.json";
inline const std::string kGptUntied = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-gpt-untied.json";

// Tolerances. Losses: fp32 sums in another order (per-microbatch, per-rank partial sums, MPI
// reductions) differ by ~1e-7 relative, so 1e-5 leaves two orders of margin. Parameters after 3
// AdamW steps: Adam divides each gradient by its own RMS, so with the usual eps = 1e-8 an element
// whose gradient is at rounding level (~1e-9) moves by a random fraction of lr per step (seen: 1.1e-4
// at lr 1e-3). With eps = 1e-6 a gradient rounding difference dg moves a parameter by at most
// steps * lr * dg / eps ~ 3 * 3e-3 * 1e-10 / 1e-6 ~ 1e-6 (seen: 2e-6 worst), while a wrong gradient
// still moves it by O(lr) per step, far above the 1e-4 bound.
constexpr double kLossRelTol = 1e-5;
constexpr double kParamAbsTol = 1e-4;
constexpr const char* kOptimizer = " --lr 3e-3 --adam-eps 1e-6";

using piper::test::mpirun;
using piper::test::Result;
using piper::test::sh;

inline fs::path temp_root() { return fs::temp_directory_path() / ("piper-runtime-test-" + std::to_string(getpid())); }

inline fs::path temp_dir(const std::string& name) {
  fs::path d = temp_root() / name;
  fs::create_directories(d);
  return d;
}

// Compiles the tiny model with strategy knobs (or a published directive program) and writes the plan.
inline fs::path compile_plan(const fs::path& dir, const core::StrategyOptions& strategy,
                             const std::string& directives_file = "", const std::string& model = kModel,
                             const std::function<void(core::Scenario&)>& edit = {}) {
  core::Scenario s;
  s.model = model;
  s.strategy = strategy;
  if (edit) edit(s);
  if (!directives_file.empty()) {
    std::ifstream in(directives_file);
    s.directives = json::parse(in);
    s.directives_source = directives_file;
  }
  const auto compiled = core::compile_scenario(s);
  fs::path plan = dir / "plan.json";
  std::ofstream(plan) << compiled.result.program.to_json().dump();
  return plan;
}

// The JSON header line of a checkpoint file.
inline json checkpoint_header(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::string line;
  std::getline(in, line);
  return json::parse(line);
}

inline std::size_t count_of(const std::string& text, const std::string& what) {
  std::size_t count = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++count;
  return count;
}

inline std::vector<double> losses_of(const fs::path& report) {
  std::ifstream in(report);
  return json::parse(in).at("losses").get<std::vector<double>>();
}

// Runs the plan distributed and as the reference for `steps`, and checks losses and parameters.
inline void expect_equivalent(const std::string& name, int ranks, const core::StrategyOptions& strategy,
                              const std::string& directives = "", const std::string& model = kModel,
                              const std::function<void(core::Scenario&)>& edit = {}) {
  const fs::path dir = temp_dir(name);
  const fs::path plan = compile_plan(dir, strategy, directives, model, edit);
  const std::string common = " run --plan " + plan.string() + " --steps 3" + kOptimizer + " --seed 7";
  Result ref = sh(std::string(PIPER_CLI) + common + " --reference --report " + (dir / "ref.json").string() +
                  " --dump-params " + (dir / "ref.bin").string());
  ASSERT_EQ(ref.code, 0) << ref.output;
  // The same plan as MPI ranks and as virtual devices (threads of one process, loopback transport):
  // one training loop and dataflow, two rank groups and transports.
  for (const std::string launch : {"mpi", "virtual"}) {
    const std::string prefix = launch == "mpi" ? mpirun(ranks) + PIPER_CLI : std::string(PIPER_CLI);
    const std::string flags = launch == "mpi" ? "" : " --virtual-devices";
    Result run = sh(prefix + common + flags + " --report " + (dir / (launch + ".json")).string() + " --dump-params " +
                    (dir / (launch + ".bin")).string());
    ASSERT_EQ(run.code, 0) << launch << ": " << run.output;
    const auto a = losses_of(dir / "ref.json"), b = losses_of(dir / (launch + ".json"));
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(b.size(), 3u);
    for (std::size_t i = 0; i < a.size(); ++i)
      EXPECT_NEAR(b[i], a[i], kLossRelTol * std::abs(a[i])) << name << " (" << launch << ") step " << i + 1;
    EXPECT_LT(piper::runtime::max_param_difference((dir / "ref.bin").string(), (dir / (launch + ".bin")).string()),
              kParamAbsTol)
        << name << " (" << launch << ")";
    // Gradient clipping: the global norm each launch all-reduced is the reference model's norm.
    const json ra = json::parse(std::ifstream(dir / "ref.json"));
    const json rb = json::parse(std::ifstream(dir / (launch + ".json")));
    ASSERT_EQ(ra.contains("grad_norms"), rb.contains("grad_norms")) << name << " (" << launch << ")";
    if (!ra.contains("grad_norms")) continue;
    const auto na = ra["grad_norms"].get<std::vector<double>>(), nb = rb["grad_norms"].get<std::vector<double>>();
    ASSERT_EQ(na.size(), nb.size());
    for (std::size_t i = 0; i < na.size(); ++i)
      EXPECT_NEAR(nb[i], na[i], kLossRelTol * na[i]) << name << " (" << launch << ") grad norm of step " << i + 1;
  }
}

// Gradient clipping by global norm (clip_grad): a max norm of 0.05 clips every step of these runs
// (their norms are 0.4-1.8), so a wrong owned-gradient rule (a replica, TP rank, ZeRO shard group or
// tied copy counted twice or not at all) shows in the all-reduced norm, which expect_equivalent
// compares with the reference model's.
inline core::StrategyOptions clipped(core::StrategyOptions o) {
  o.clip_grad = 0.05;
  return o;
}

// Rewrites every tag filter of a directive program (objects with an "MB" key) with `filter`, and
// replaces its split directive by `splits`.
inline json rewrite_microbatches(const json& j, const std::function<void(json&)>& filter, const json& splits) {
  if (j.is_array()) {
    json out = json::array();
    for (const auto& e : j) {
      if (e.is_object() && e.value("op", "") == "split") {
        for (const auto& s : splits) out.push_back(s);
        continue;
      }
      out.push_back(rewrite_microbatches(e, filter, splits));
    }
    return out;
  }
  if (!j.is_object()) return j;
  json out = json::object();
  for (auto it = j.begin(); it != j.end(); ++it) out[it.key()] = rewrite_microbatches(it.value(), filter, splits);
  if (out.contains("MB")) filter(out);
  return out;
}

// The directive program the strategy generator emits for `o` on `model`, rewritten as above and
// written to dir/program.json (the file expect_equivalent compiles).
inline std::string rewritten_program(const std::string& name, const core::StrategyOptions& o,
                                     const std::function<void(json&)>& filter, const json& splits,
                                     const std::string& model = kModel) {
  core::Scenario s;
  s.model = model;
  s.strategy = o;
  const json program = rewrite_microbatches(core::scenario_program(s).to_json(), filter, splits);
  const fs::path file = temp_dir(name + "-program") / "program.json";
  std::ofstream(file) << program.dump(1);
  return file.string();
}

inline json split_directive(const std::string& dim, int count) {
  return {{"op", "split"}, {"filter", json::object()}, {"dim_name", dim}, {"num_microbatches", count}};
}

inline core::StrategyOptions strategy(int pp, int dp, int ep, int zero, int microbatches, const std::string& schedule,
                                      int virtual_stages = 1, double bucket_mb = 0) {
  core::StrategyOptions o;
  o.pp = pp, o.dp = dp, o.ep = ep, o.zero = zero, o.microbatches = microbatches, o.schedule = schedule;
  o.virtual_stages = virtual_stages, o.bucket_mb = bucket_mb;
  return o;
}

// Megatron-style knobs on top of a strategy.
inline core::StrategyOptions megatron(core::StrategyOptions o, int tp, bool sequence_parallel,
                                      const std::string& recompute) {
  o.tp = tp, o.sequence_parallel = sequence_parallel, o.recompute = recompute;
  return o;
}

// Context parallelism on top of a strategy (all-gather variant or the ring).
inline core::StrategyOptions context_parallel(core::StrategyOptions o, int cp, bool all_gather = false) {
  o.cp = cp, o.cp_all_gather = all_gather;
  return o;
}

// Expert tensor parallelism on top of a strategy.
inline core::StrategyOptions with_etp(core::StrategyOptions o, int etp) {
  o.etp = etp;
  return o;
}

// HSDP on top of a strategy: ZeRO shards over groups of k data-parallel replicas.
inline core::StrategyOptions hsdp(core::StrategyOptions o, int k) {
  o.dp_shard = k;
  return o;
}

// One layout of a resume chain: its strategy and its MPI rank count.
struct Leg {
  core::StrategyOptions strategy;
  int ranks = 1;
};

// Trains steps 1-2 under legs[0] (saving a checkpoint), 3-4 under legs[1] and 5-6 under legs[2], each
// resuming the last checkpoint, and checks the six losses and the final parameters against one
// uninterrupted single-process reference run. `first_flags` go to the first leg only; its result is
// returned for further checks.
inline Result expect_resume_chain(const std::string& name, const std::array<Leg, 3>& legs, int seed,
                                  const std::string& model = kModel, const std::string& first_flags = "") {
  const fs::path dir = temp_dir(name);
  std::array<fs::path, 3> plans;
  for (std::size_t i = 0; i < legs.size(); ++i)
    plans[i] =
        compile_plan(temp_dir(name + "/" + std::string(1, static_cast<char>('a' + i))), legs[i].strategy, "", model);
  const std::string flags = std::string(kOptimizer) + " --seed " + std::to_string(seed);
  const std::string ckpt = (dir / "state.ckpt").string();
  Result ref =
      sh(std::string(PIPER_CLI) + " run --reference --plan " + plans[0].string() + flags + " --steps 6 --report " +
         (dir / "ref.json").string() + " --dump-params " + (dir / "ref.bin").string());
  EXPECT_EQ(ref.code, 0) << ref.output;
  Result first;
  std::vector<double> got;
  for (std::size_t i = 0; i < legs.size(); ++i) {
    const fs::path report = dir / (std::string(1, static_cast<char>('a' + i)) + ".json");
    std::string cmd = mpirun(legs[i].ranks) + PIPER_CLI + " run --plan " + plans[i].string() + flags + " --steps " +
                      std::to_string(2 * (i + 1)) + " --report " + report.string();
    if (i > 0) cmd += " --resume " + ckpt;
    if (i + 1 < legs.size())
      cmd += " --save " + ckpt;
    else
      cmd += " --dump-params " + (dir / "last.bin").string();
    if (i == 0) cmd += first_flags;
    Result r = sh(cmd);
    EXPECT_EQ(r.code, 0) << name << " leg " << i << ": " << r.output;
    if (r.code != 0) return r;
    if (i == 0) first = r;
    for (double l : losses_of(report)) got.push_back(l);
  }
  const auto want = losses_of(dir / "ref.json");
  EXPECT_EQ(want.size(), 6u);
  EXPECT_EQ(got.size(), 6u);
  for (std::size_t i = 0; i < std::min(want.size(), got.size()); ++i)
    EXPECT_NEAR(got[i], want[i], kLossRelTol * std::abs(want[i])) << name << " step " << i + 1;
  EXPECT_LT(piper::runtime::max_param_difference((dir / "ref.bin").string(), (dir / "last.bin").string()), kParamAbsTol)
      << name;
  return first;
}

}  // namespace runtime_test
