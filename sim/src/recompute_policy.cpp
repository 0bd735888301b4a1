// --recompute auto: simulate each recomputation policy and keep the fastest that fits the budget.
#include "piper/sim/recompute_policy.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

namespace piper::sim {

namespace {

std::string ordinal(int k) {
  const int tens = k % 100;
  const char* suffix = (tens >= 11 && tens <= 13) ? "th"
                       : k % 10 == 1              ? "st"
                       : k % 10 == 2              ? "nd"
                       : k % 10 == 3              ? "rd"
                                                  : "th";
  return std::to_string(k) + suffix;
}

std::string gib(std::int64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
}

}  // namespace

std::string RecomputePolicy::name() const {
  if (every > 0) return fmt::format("{} every {} block", recompute, ordinal(every));
  return recompute;
}

std::vector<RecomputePolicy> recompute_candidates(int blocks) {
  std::vector<RecomputePolicy> out = {{"none", 0}, {"selective", 0}, {"op", 0}};
  for (int k = std::min(blocks, 8); k >= 2; --k) out.push_back({"full", k});
  out.push_back({"full", 0});
  return out;
}

std::string RecomputeChoice::summary() const {
  return fmt::format(
      "recompute auto: {} (peak {} within the {} budget; step {:.4g} s; fastest of {} policies that fit, {} simulated)",
      chosen.policy.name(), gib(chosen.peak_memory_bytes), gib(budget_bytes), chosen.step_time_s,
      std::count_if(trials.begin(), trials.end(), [](const RecomputeTrial& t) { return t.fits; }), trials.size());
}

RecomputeChoice choose_recompute(const core::Scenario& scenario, double budget_gib, const SimulateOptions& options) {
  if (!(budget_gib > 0) || !std::isfinite(budget_gib) || budget_gib > 1e9)
    throw std::invalid_argument(fmt::format("--memory-budget must be a positive number of GiB (got {})", budget_gib));
  if (scenario.directives)
    throw std::invalid_argument(
        "--recompute auto chooses the strategy's recompute directives: it cannot be used with --directives");
  RecomputeChoice choice;
  choice.budget_bytes = static_cast<std::int64_t>(budget_gib * 1024.0 * 1024.0 * 1024.0);
  const int blocks = static_cast<int>(core::scenario_model_config(scenario).layers);
  const RecomputeTrial* best = nullptr;
  for (const RecomputePolicy& policy : recompute_candidates(blocks)) {
    core::Scenario s = scenario;
    s.strategy.recompute = policy.recompute;
    s.strategy.recompute_every = policy.every;
    s.strategy.recompute_first = 0;
    const SimulationResult r = simulate(s, options);
    RecomputeTrial t;
    t.policy = policy;
    t.peak_memory_bytes = r.report.peak_memory_bytes;
    t.step_time_s = r.report.step_time_s;
    for (std::size_t d = 0; d < r.program->plan_of_device.size(); ++d)
      for (const auto& stream : r.program->plans.at(static_cast<std::size_t>(r.program->plan_of_device[d])).streams)
        for (const auto& op : stream.ops) t.recompute_flops += op.recompute_flops;
    t.fits = t.peak_memory_bytes <= choice.budget_bytes;
    choice.trials.push_back(t);
  }
  for (const RecomputeTrial& t : choice.trials)
    if (t.fits && (!best || t.step_time_s < best->step_time_s ||
                   (t.step_time_s == best->step_time_s && t.recompute_flops < best->recompute_flops)))
      best = &t;
  if (!best) {
    const auto least = std::min_element(
        choice.trials.begin(), choice.trials.end(),
        [](const RecomputeTrial& a, const RecomputeTrial& b) { return a.peak_memory_bytes < b.peak_memory_bytes; });
    throw std::invalid_argument(
        fmt::format("--memory-budget {}: no recompute policy fits; the least memory is {} with {} at peak", budget_gib,
                    least->policy.name(), gib(least->peak_memory_bytes)));
  }
  choice.chosen = *best;
  return choice;
}

}  // namespace piper::sim
