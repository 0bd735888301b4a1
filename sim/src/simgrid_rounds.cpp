// Run's collectives (simgrid_run.hpp): a decomposed collective (simgrid_collectives.hpp) runs phase
// after phase, each participant's rounds as flows once its previous send and receive are done, or a
// schedule alone on its links merged into one timer (Merge) until a flow needs one of them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simgrid_run.hpp"

namespace piper::sim::simgrid_detail {

void Run::start_phase(int c) {
  CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
  const Phase& phase = run.phases[run.phase];
  run.states.assign(phase.schedules.size(), {});
  run.flows_left = 0;
  for (std::size_t k = 0; k < phase.schedules.size(); ++k) {
    const RoundSchedule& s = phase.schedules[k];
    ScheduleState& st = run.states[k];
    st.s = &s;
    const int q = options_.max_ring_steps;
    st.rounds_per_step =
        (s.pattern == RoundSchedule::Pattern::Ring && q > 0 && s.rounds > q) ? (s.rounds + q - 1) / q : 1;
    st.steps = (s.rounds + st.rounds_per_step - 1) / st.rounds_per_step;
    const auto n = static_cast<std::size_t>(s.size());
    st.sends_done.assign(n, 0);
    st.inflight.assign(n, 0);
    st.received.assign(static_cast<std::size_t>(st.steps) * n, 0);
    run.flows_left += static_cast<std::int64_t>(st.steps) * s.size();
  }
  if (run.flows_left == 0) return finish_collective(c);
  for (std::size_t k = 0; k < run.states.size(); ++k) {
    if (options_.merge_lone_collectives && try_merge(c, static_cast<int>(k))) continue;
    for (int i = 0; i < run.states[k].s->size(); ++i) try_flow(c, static_cast<int>(k), i);
  }
}

// Runs schedule k of collective c merged if its rounds run alone on their links (see Merge).
bool Run::try_merge(int c, int k) {
  ScheduleState& st = collectives_[static_cast<std::size_t>(c)].states[static_cast<std::size_t>(k)];
  const RoundSchedule& s = *st.s;
  if (st.rounds_per_step != 1 || st.steps < 2) return false;
  const int n = s.size();
  // The payload as start_flow gives it to SimGrid.
  const double units = static_cast<double>(std::llround(std::max(0.0, s.chunk_bytes) * kUnitsPerByte));
  if (units <= 0) return false;
  const bool ring = s.pattern == RoundSchedule::Pattern::Ring;
  // A ring's rounds all use the same pairs, so its first round stands for all.
  const int distinct_rounds = ring ? 1 : st.steps;
  std::vector<double> latency(static_cast<std::size_t>(distinct_rounds)), rate(latency.size());
  std::vector<int> links, round_links;
  int route[simgrid_detail::Platform::kMaxRouteLinks];
  for (int j = 0; j < distinct_rounds; ++j) {
    const int first = s.devices[0], second = s.devices[static_cast<std::size_t>(s.target(j, 0))];
    const double lat = platform_->route_latency_s(first, second), r = platform_->route_rate_units(first, second);
    round_links.clear();
    for (int i = 0; i < n; ++i) {
      const int src = s.devices[static_cast<std::size_t>(i)], dst = s.devices[static_cast<std::size_t>(s.target(j, i))];
      if (platform_->route_latency_s(src, dst) != lat || platform_->route_rate_units(src, dst) != r) return false;
      const int count = platform_->route_links(src, dst, route);
      for (int l = 0; l < count; ++l) {
        const auto lu = static_cast<std::size_t>(route[l]);
        if (link_flows_[lu] > 0 || link_merge_[lu] >= 0) return false;
        round_links.push_back(route[l]);
      }
    }
    std::sort(round_links.begin(), round_links.end());
    if (std::adjacent_find(round_links.begin(), round_links.end()) != round_links.end()) return false;
    links.insert(links.end(), round_links.begin(), round_links.end());
    latency[static_cast<std::size_t>(j)] = lat;
    rate[static_cast<std::size_t>(j)] = r;
  }
  std::sort(links.begin(), links.end());
  links.erase(std::unique(links.begin(), links.end()), links.end());
  const int m = take(merges_, free_merges_);
  Merge& M = merges_[static_cast<std::size_t>(m)];
  M.collective = c;
  M.schedule = k;
  M.start = now();
  M.units = units;
  M.latency.resize(static_cast<std::size_t>(st.steps));
  M.rate.resize(M.latency.size());
  M.offset.resize(M.latency.size() + 1);
  M.offset[0] = 0;
  for (std::size_t j = 0; j < M.latency.size(); ++j) {
    M.latency[j] = latency[ring ? 0 : j];
    M.rate[j] = rate[ring ? 0 : j];
    const double period = M.latency[j] + units / M.rate[j];
    // A ring's rounds are alike: j * period, one rounding, not a sum of j.
    M.offset[j + 1] = ring ? static_cast<double>(j + 1) * period : M.offset[j] + period;
  }
  M.links = std::move(links);
  for (int l : M.links) link_merge_[static_cast<std::size_t>(l)] = m;
  st.merge = m;
  M.timer = at(M.start + M.offset.back(), [this, m] { merge_done(m); });
  return true;
}

void Run::release_links(int m) {
  for (int l : merges_[static_cast<std::size_t>(m)].links)
    if (link_merge_[static_cast<std::size_t>(l)] == m) link_merge_[static_cast<std::size_t>(l)] = -1;
  merges_[static_cast<std::size_t>(m)].links.clear();
}

// The merged schedule's last rounds end now.
void Run::merge_done(int m) {
  Merge& M = merges_[static_cast<std::size_t>(m)];
  M.timer = nullptr;  // SimGrid deletes a timer after running it
  release_links(m);
  const int c = M.collective, k = M.schedule;
  free_merges_.push_back(m);
  CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
  ScheduleState& st = run.states[static_cast<std::size_t>(k)];
  st.merge = -1;
  std::fill(st.sends_done.begin(), st.sends_done.end(), st.steps);
  run.flows_left -= static_cast<std::int64_t>(st.steps) * st.s->size();
  if (run.flows_left == 0) {
    if (++run.phase < run.phases.size())
      start_phase(c);
    else
      finish_collective(c);
  }
  pump();
}

// A flow is about to start on a link of merged schedule m: put the schedule back into its
// unmerged state at this instant (see Merge) and free its links.
void Run::split_merge(int m) {
  Merge& M = merges_[static_cast<std::size_t>(m)];
  const double elapsed = now() - M.start;
  const int rounds = static_cast<int>(M.latency.size());
  // The round under way: the last whose start offset is not after `elapsed`.
  int j = static_cast<int>(std::upper_bound(M.offset.begin(), M.offset.end(), elapsed) - M.offset.begin()) - 1;
  j = std::max(0, j);
  double into = elapsed - M.offset[static_cast<std::size_t>(std::min(j, rounds))];
  const int c = M.collective, k = M.schedule;
  ScheduleState& st = collectives_[static_cast<std::size_t>(c)].states[static_cast<std::size_t>(k)];
  bool in_latency = true;
  double left = 0;  // units left of round j's flows
  if (j < rounds && into >= M.latency[static_cast<std::size_t>(j)]) {
    in_latency = false;
    left = M.units - (into - M.latency[static_cast<std::size_t>(j)]) * M.rate[static_cast<std::size_t>(j)];
    if (std::llround(left) <= 0) {  // round j's flows end now: round j + 1 starts its latency
      ++j;
      into = 0;
      in_latency = true;
    }
  }
  release_links(m);
  if (j >= rounds) return;  // the schedule ends now: its timer (due now) does the bookkeeping
  M.timer->remove();
  M.timer = nullptr;
  free_merges_.push_back(m);
  st.merge = -1;
  CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
  const RoundSchedule& s = *st.s;
  const int n = s.size();
  run.flows_left -= static_cast<std::int64_t>(j) * n;
  for (int i = 0; i < n; ++i) {
    st.sends_done[static_cast<std::size_t>(i)] = j;
    st.inflight[static_cast<std::size_t>(i)] = 1;
    for (int done = 0; done < j; ++done)
      st.received[static_cast<std::size_t>(done) * static_cast<std::size_t>(n) + static_cast<std::size_t>(i)] = 1;
  }
  const double latency_left = M.latency[static_cast<std::size_t>(j)] - into, chunk = s.chunk_bytes;
  for (int i = 0; i < n; ++i) {
    const int src = s.devices[static_cast<std::size_t>(i)], dst = s.devices[static_cast<std::size_t>(s.target(j, i))];
    if (in_latency)
      start_comm(src, dst, chunk, latency_left, SlotKind::Flow, c, k, i, j);
    else
      start_flow(src, dst, left / kUnitsPerByte, SlotKind::Flow, c, k, i, j);
  }
}

// Participant i starts its next step once its previous send and its previous receive are done.
void Run::try_flow(int c, int k, int i) {
  ScheduleState& st = collectives_[static_cast<std::size_t>(c)].states[static_cast<std::size_t>(k)];
  const auto iu = static_cast<std::size_t>(i);
  const int step = st.sends_done[iu];
  if (st.merge >= 0 || st.inflight[iu] || step >= st.steps) return;
  if (step > 0 && !st.received[static_cast<std::size_t>(step - 1) * static_cast<std::size_t>(st.s->size()) + iu])
    return;
  st.inflight[iu] = 1;
  const int first_round = step * st.rounds_per_step;
  const int rounds = std::min(st.rounds_per_step, st.s->rounds - first_round);
  const int src = st.s->devices[iu], dst = st.s->devices[static_cast<std::size_t>(st.s->target(first_round, i))];
  // A step of c merged rounds pays the c route latencies of its rounds, then moves c chunks.
  start_comm(src, dst, rounds * st.s->chunk_bytes, rounds * platform_->route_latency_s(src, dst), SlotKind::Flow, c, k,
             i, step);
}

void Run::flow_done(int c, int k, int i, int step) {
  CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
  ScheduleState& st = run.states[static_cast<std::size_t>(k)];
  const int n = st.s->size();
  const int t = st.s->target(step * st.rounds_per_step, i);
  st.inflight[static_cast<std::size_t>(i)] = 0;
  st.sends_done[static_cast<std::size_t>(i)] += 1;
  st.received[static_cast<std::size_t>(step) * static_cast<std::size_t>(n) + static_cast<std::size_t>(t)] = 1;
  if (--run.flows_left == 0) {
    if (++run.phase < run.phases.size()) return start_phase(c);
    return finish_collective(c);
  }
  try_flow(c, k, i);
  try_flow(c, k, t);
}

void Run::finish_collective(int c) {
  CollectiveRun& run = collectives_[static_cast<std::size_t>(c)];
  finished_now_.push_back(run.live);
  run.phases.clear();
  run.states.clear();
  free_collectives_.push_back(c);
}

}  // namespace piper::sim::simgrid_detail
