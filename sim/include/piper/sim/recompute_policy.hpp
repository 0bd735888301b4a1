// `--recompute auto --memory-budget GiB`: picks the activation-recomputation policy whose simulated
// peak memory fits a budget, the one with the shortest simulated step (the least recomputation time
// as the simulator costs it). It needs the simulator's memory model, so it lives here, not in core.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "piper/core/scenario.hpp"
#include "piper/sim/simulate.hpp"

namespace piper::sim {

struct RecomputePolicy {
  std::string recompute = "none";  // StrategyOptions::recompute
  int every = 0;                   // StrategyOptions::recompute_every
  std::string name() const;        // "none", "selective", "full every 2nd block", ...
};

struct RecomputeTrial {
  RecomputePolicy policy;
  std::int64_t peak_memory_bytes = 0;  // simulated, max over devices
  double step_time_s = 0;
  double recompute_flops = 0;  // per step, summed over devices
  bool fits = false;
};

struct RecomputeChoice {
  RecomputeTrial chosen;
  std::vector<RecomputeTrial> trials;  // every candidate, in candidate order
  std::int64_t budget_bytes = 0;
  std::string summary() const;  // one line: the policy chosen and why
};

// The candidates for a model of `blocks` transformer blocks, from least to most recomputation:
// none, selective, op, full on every K-th block for K = min(blocks, 8) down to 2, full.
std::vector<RecomputePolicy> recompute_candidates(int blocks);

// Simulates `scenario` (its strategy's recompute fields are replaced) under each candidate and picks
// the fastest that fits (ties: less recomputation). Throws std::invalid_argument naming the budget
// when none fits or the budget is not positive.
RecomputeChoice choose_recompute(const core::Scenario& scenario, double budget_gib,
                                 const SimulateOptions& options = {});

}  // namespace piper::sim
