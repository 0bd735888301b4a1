// `piper tune`: search the strategy space with the simulator (search::run_tune), print the best plans
// that fit, write the winner's directive program and a Pareto plot (throughput vs peak memory).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "cli/common.hpp"
#include "cli/runtime_flags.hpp"
#include "piper/core/program.hpp"
#include "piper/search/tune.hpp"
#ifdef PIPER_HAVE_PLOT
#include "piper/plot/plot.hpp"
#endif

namespace piper::cli {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct TuneArgs {
  search::TuneSpec spec;
  RuntimeFlags runtime;
  double memory_cap_gib = 0;
  double memory_reserve_gib = -1;  // < 0: the default (search::kDefaultMemoryReserveFraction of the HBM)
  double budget_s = 0;
  int jobs = 1;
  int show = 10;
  bool no_placement = false;
  std::string sequence_parallel = "both";
  std::string output_path, directives_path, scenario_path, plot_path;
};

// Throughput against peak memory: every simulated candidate, the Pareto front, the best plan, the cap.
void plot_pareto(const search::TuneSpec& spec, const search::TuneSummary& s, const std::string& csv_path,
                 const std::string& png_path) {
#ifdef PIPER_HAVE_PLOT
  plot::Chart chart;
  chart.title =
      fmt::format("{} on {} x {}: throughput vs peak memory", spec.model, spec.devices, cluster_label(spec.cluster));
  chart.x.label = "peak memory per device (GiB)";
  chart.y.label = "throughput (tokens/s)";
  plot::Series fits{"fits the cap (analytic)", {}, {}, plot::Style::Points, "#0072B2", 3.5};
  plot::Series over{"over the cap", {}, {}, plot::Style::Points, "#E69F00", 3.5};
  std::vector<search::TuneRow> analytic;
  for (const auto& r : search::read_tune_results(csv_path)) {
    if (r.engine != "analytic" || r.status != "ok") continue;
    analytic.push_back(r);
    auto& series = r.fits(s.memory_cap_bytes) ? fits : over;
    series.x.push_back(static_cast<double>(r.peak_memory_bytes) / kGiB);
    series.y.push_back(r.tokens_per_s);
  }
  plot::Series front{"Pareto front", {}, {}, plot::Style::LinePoints, "#009E73", 4.5};
  for (const auto& r : search::pareto_front(analytic)) {
    front.x.push_back(static_cast<double>(r.peak_memory_bytes) / kGiB);
    front.y.push_back(r.tokens_per_s);
  }
  chart.series = {over, fits, front};
  if (!s.ranked.empty()) {
    const auto& b = s.ranked.front();
    chart.series.push_back({fmt::format("best ({})", b.engine),
                            {static_cast<double>(b.peak_memory_bytes) / kGiB},
                            {b.tokens_per_s},
                            plot::Style::Points,
                            "#D55E00",
                            8});
  }
  if (std::isfinite(s.memory_cap_bytes))
    chart.references.push_back(
        {true, s.memory_cap_bytes / kGiB, fmt::format("cap {:.0f} GiB", s.memory_cap_bytes / kGiB)});
  chart.x.min = 0;
  chart.y.min = 0;
  try {
    plot::write_png(chart, png_path);
  } catch (const plot::PlotError& e) {
    throw CliError("", e.what());
  }
#else
  (void)spec, (void)s, (void)csv_path, (void)png_path;  // run_tune refuses --plot before the search
#endif
}

// The search options of the flags: jobs, time budget, and a progress bar on a terminal.
search::TuneOptions tune_options(const TuneArgs& a) {
  const bool tty = isatty(fileno(stderr)) != 0;
  search::TuneOptions options;
  options.jobs = a.jobs;
  options.budget_s = a.budget_s;
  // The bar redraws one line in place, so only on a terminal; a log or a pipe gets whole lines once
  // the search has run a minute (it printed nothing until the end).
  auto log = std::make_shared<ProgressLog>("tune", 60);
  options.on_progress = [tty, log](const search::TuneProgress& p) {
    if (!tty) {
      if (const std::string line = log->report(p.phase, p.done, p.total, p.elapsed_s); !line.empty()) {
        fmt::print(stderr, "{}", line);
        std::fflush(stderr);
      }
      return;
    }
    constexpr int kWidth = 30;
    const int filled = p.total ? static_cast<int>(kWidth * p.done / p.total) : kWidth;
    static std::string phase;
    static double phase_start = 0;
    static std::size_t phase_first = 0;
    if (p.phase != phase) phase = p.phase, phase_start = p.elapsed_s, phase_first = p.done;
    // ETA from this phase's own rate (resumed rows excluded).
    const double rate = p.done > phase_first ? (p.elapsed_s - phase_start) / static_cast<double>(p.done - phase_first)
                                             : std::numeric_limits<double>::quiet_NaN();
    fmt::print(stderr, "\r{:<9} [{}{}] {}/{}  elapsed {}  eta {}   ", p.phase,
               std::string(static_cast<std::size_t>(filled), '#'),
               std::string(static_cast<std::size_t>(kWidth - filled), ' '), p.done, p.total,
               format_duration(p.elapsed_s), format_duration(rate * static_cast<double>(p.total - p.done)));
    if (p.done == p.total) fmt::print(stderr, "\n");
    std::fflush(stderr);
  };
  return options;
}

// What the search enumerated, pruned and simulated, before the ranking.
void print_search_summary(const TuneArgs& a, const search::TuneSummary& s) {
  const search::TuneSpec& spec = a.spec;
  const auto& e = s.enumeration;
  fmt::print("{} on {} x {}, global batch {} sequences, memory cap {:.2f} GiB\n", spec.model, spec.devices,
             cluster_label(spec.cluster), spec.effective_global_batch(), s.memory_cap_bytes / kGiB);
  if (s.memory_reserve_bytes > 0 || spec.memory_cap_bytes <= 0)
    fmt::print(
        "reserve     {:.2f} GiB of the {:.2f} GiB HBM kept for the CUDA context, NCCL buffers and fragmentation{}\n",
        s.memory_reserve_bytes / kGiB, s.hbm_bytes / kGiB,
        a.memory_reserve_gib < 0
            ? fmt::format(" ({:.0f} %; --memory-reserve-gib to change)", search::kDefaultMemoryReserveFraction * 100)
            : std::string());
  std::string tps;
  for (int t : e.tp_degrees) tps += (tps.empty() ? "" : ",") + std::to_string(t);
  fmt::print("TP degrees  {}{}\n", tps, e.tp_rejected.empty() ? "" : " (left out:");
  for (const auto& why : e.tp_rejected) fmt::print("              {}\n", why);
  if (!e.tp_rejected.empty()) fmt::print("            )\n");
  if (!spec.cp_degrees.empty()) {  // only when asked for: CP 1 alone is the default
    std::string cps;
    for (int c : e.cp_degrees) cps += (cps.empty() ? "" : ",") + std::to_string(c);
    fmt::print("CP degrees  {}{}\n", cps, e.cp_rejected.empty() ? "" : " (left out:");
    for (const auto& why : e.cp_rejected) fmt::print("              {}\n", why);
    if (!e.cp_rejected.empty()) fmt::print("            )\n");
  }
  fmt::print(
      "enumerated  {} legal candidates with their SP, recompute and ZeRO options, from {} (TP, PP, EP, micro batch,\n"
      "            family, virtual) tuples ({} with a global batch that does not split, {} refused by the family)\n",
      s.candidates, e.considered, e.batch_indivisible, e.family_rejected);
  fmt::print("pruned      {} by the memory lower bound; {} by the step time lower bound (above the {} best)\n",
             s.pruned, s.bounded, search::ordinal(std::max(a.show, spec.top_k)));
  fmt::print("deferred    {} recompute variants whose twin with less recomputation fits (simulated last)\n",
             s.dominated);
  fmt::print("simulated   {} analytic ({} placement variants), {} SimGrid; {} fit the cap; {} rows resumed from {}\n",
             s.simulated, s.placement_variants, s.simgrid, s.fitting, s.resumed, a.output_path);
  fmt::print("wall time   {:.1f} s with -j {}\n", s.elapsed_s, a.jobs);
  if (s.budget_exhausted)
    fmt::print("budget      {:.0f} s exhausted in {}; rerun with the same -o to continue\n", a.budget_s, s.stopped);
  if (s.coinciding > 0)
    fmt::print(
        "coinciding  {} plans left out of the ranking: at PP 1 their schedule family orders the same ops as a "
        "ranked one's\n",
        s.coinciding);
}

// The files the flags ask for from the best plan: directives, scenario, Pareto plot.
void write_tune_outputs(const TuneArgs& a, const search::TuneSummary& s) {
  const search::TuneSpec& spec = a.spec;
  const search::TuneRow& best = s.ranked.front();
  const std::vector<int> ranges = search::effective_pp_ranges(spec, best.candidate);
  std::string ranges_text;
  for (int r : ranges) ranges_text += (ranges_text.empty() ? "" : ",") + std::to_string(r);
  if (!a.directives_path.empty()) {
    core::write_file_atomically(a.directives_path, search::tune_directives(spec, best.candidate).dump(2) + "\n");
    fmt::print("directives -> {} (compile with --model {} --micro-batch-size {}{} --pp-ranges {})\n", a.directives_path,
               spec.model, best.candidate.micro_batch_size,
               spec.seq_len > 0 ? fmt::format(" --seq-len {}", spec.seq_len) : std::string(), ranges_text);
  }
  if (!a.scenario_path.empty()) {
    core::Scenario scenario = search::tune_scenario(spec, best.candidate, best.engine);
    scenario.stage_starts = ranges;
    core::write_file_atomically(a.scenario_path, scenario_file_text(scenario, a.scenario_path));
    fmt::print("scenario -> {} (open it in piper-studio)\n", a.scenario_path);
  }
  if (!a.plot_path.empty()) {
    plot_pareto(spec, s, a.output_path, a.plot_path);
    fmt::print("plot -> {}\n", a.plot_path);
  }
}

int run_tune(TuneArgs& a) {
#ifndef PIPER_HAVE_PLOT
  // Refused before the search, not after it: a search takes minutes and writes the CSV, and the
  // house rule for bad input is one line and nothing written.
  if (!a.plot_path.empty())
    throw CliError(
        "", fmt::format("--plot '{}': this piper was built without Qt 6 Gui, so it cannot draw plots", a.plot_path));
#endif
  // GiB a device: 1e308 overflowed to "memory cap inf GiB" (exit 0) and "--memory-reserve-gib inf".
  constexpr double kMaxDeviceGiB = 1e6;
  for (const auto& [flag, gib] :
       {std::pair{"--memory-cap", a.memory_cap_gib}, {"--memory-reserve-gib", a.memory_reserve_gib}})
    if (gib > kMaxDeviceGiB)
      throw CliError("", fmt::format("{} {:g}: more GiB than any device has (at most {:g})", flag, gib, kMaxDeviceGiB));
  search::TuneSpec& spec = a.spec;
  spec.cluster = a.runtime.applied_to(spec.cluster);
  spec.memory_cap_bytes = a.memory_cap_gib * kGiB;
  spec.memory_reserve_bytes = a.memory_reserve_gib < 0 ? -1 : a.memory_reserve_gib * kGiB;
  spec.placement_search = !a.no_placement;
  spec.exact_top = a.show;  // the printed plans are exactly the best (branch and bound keeps them)
  spec.sequence_parallel = a.sequence_parallel == "on"    ? std::vector<bool>{true}
                           : a.sequence_parallel == "off" ? std::vector<bool>{false}
                                                          : std::vector<bool>{false, true};
  const search::TuneOptions options = tune_options(a);
  search::TuneSummary s;
  try {
    s = search::run_tune(spec, a.output_path, options);
  } catch (const search::TuneError& e) {
    throw CliError("", e.what());
  }
  print_search_summary(a, s);
  if (s.ranked.empty()) {
    // Exit 1, as `piper verify` does when it finds issues: the search ran, and found nothing usable.
    fmt::print("no simulated plan fits {:.2f} GiB\n", s.memory_cap_bytes / kGiB);
    return 1;
  }
  fmt::print("\nrank  engine      step ms    tokens/s     MFU  peak GiB  PP  TP  DP  EP  strategy\n");
  const int shown = std::min<int>(a.show, static_cast<int>(s.ranked.size()));
  for (int i = 0; i < shown; ++i) {
    const auto& r = s.ranked[static_cast<std::size_t>(i)];
    const auto& c = r.candidate;
    fmt::print("{:>4}  {:<8} {:>10.3f} {:>11.0f} {:>6.1f}% {:>9.2f} {:>3} {:>3} {:>3} {:>3}  {}\n", i + 1, r.engine,
               r.step_time_s * 1e3, r.tokens_per_s, r.mfu * 100, static_cast<double>(r.peak_memory_bytes) / kGiB, c.pp,
               c.tp, c.dp, c.ep, c.describe());
  }
  const search::TuneRow& best = s.ranked.front();
  fmt::print("\nbest: {} ({}): {:.3f} ms/step, {:.0f} tokens/s, MFU {:.1f} %, peak {:.2f} GiB\n",
             best.candidate.describe(), best.engine, best.step_time_s * 1e3, best.tokens_per_s, best.mfu * 100,
             static_cast<double>(best.peak_memory_bytes) / kGiB);
  write_tune_outputs(a, s);
  return 0;
}

// The lists of knobs the search tries (each flag a list; the spec's enumeration checks them).
void add_search_space_flags(CLI::App* cmd, TuneArgs& args) {
  TuneArgs* a = &args;
  cmd->add_option("--micro-batch-size", a->spec.micro_batch_sizes, "sequences per microbatch to try (a list)")
      ->check(kPositiveInt)
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--zero", a->spec.zero_levels, "ZeRO levels to try (a list)")
      ->check(CLI::Range(0, 3))
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--pp", a->spec.pp_degrees,
                  "pipeline-parallel degrees to try (a list; default: every divisor of the devices)")
      ->check(kPositiveInt)
      ->delimiter(',');
  cmd->add_option("--dp", a->spec.dp_degrees,
                  "data-parallel degrees to try (a list; default: every divisor of the devices)")
      ->check(kPositiveInt)
      ->delimiter(',');
  cmd->add_option("--ep", a->spec.ep_degrees,
                  "expert-parallel degrees to try (a list; default: every divisor of DP that divides the experts)")
      ->check(kPositiveInt)
      ->delimiter(',');
  cmd->add_option(
         "--tp", a->spec.tp_degrees,
         "tensor-parallel degrees to try (a list; default: every divisor of the GPUs per node the model accepts)")
      ->check(kPositiveInt)
      ->delimiter(',');
  cmd->add_option("--cp", a->spec.cp_degrees,
                  "context-parallel degrees to try (a list; default: 1 only; a degree whose 2 x cp chunks do not cut "
                  "the sequence is left out)")
      ->check(kPositiveInt)
      ->delimiter(',');
  cmd->add_option(
         "--etp", a->spec.etp_degrees,
         "expert tensor-parallel degrees to try (a list; each divides the TP degree; default: 1, whole experts)")
      ->check(kPositiveInt)
      ->delimiter(',');
  cmd->add_option("--sequence-parallel", a->sequence_parallel, "sequence parallelism with TP > 1: on, off or both")
      ->check(CLI::IsMember({"on", "off", "both"}))
      ->capture_default_str();
  cmd->add_option("--recompute", a->spec.recompute_modes,
                  "recompute modes to try (a list of none, selective, full, op)")
      ->check(CLI::IsMember({"none", "selective", "full", "op"}))
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--comm-sms", a->spec.comm_sms,
                  "SMs of each GPU given to communication to try (a list; 0: shared; default: shared only; "
                  "sm_partition directive)")
      ->check(kNonNegativeInt)
      ->delimiter(',');
  cmd->add_option(
         "--dp-shard", a->spec.dp_shards,
         "HSDP shard groups to try with ZeRO >= 1 (a list of replicas per group; 0: plain ZeRO; default: plain only)")
      ->check(kNonNegativeInt)
      ->delimiter(',');
  cmd->add_option("--reduce-every", a->spec.reduce_every,
                  "ZeRO-2/3 gradient reductions to try (microbatch, step; default: both)")
      ->check(CLI::IsMember({"microbatch", "step"}))
      ->delimiter(',');
  cmd->add_option("--schedules", a->spec.schedules,
                  "schedule families to try (default: all; see 'piper schedule list')")
      ->delimiter(',');
  cmd->add_option("--max-virtual", a->spec.max_virtual, "most PP regions per rank tried")
      ->check(kPositiveInt)
      ->capture_default_str();
}

}  // namespace

Command add_tune_command(CLI::App& app) {
  auto a = std::make_shared<TuneArgs>();
  CLI::App* cmd = app.add_subcommand("tune",
                                     "search PP x TP x DP x EP, SP, recompute, schedules, microbatching and ZeRO with "
                                     "the simulator; print the best plans that fit");
  cmd->add_option("--model", a->spec.model, "zoo name, model spec JSON or HF config.json")->required();
  cmd->add_option("--cluster", a->spec.cluster, "cluster preset or spec file")->capture_default_str();
  a->runtime.add_to(cmd);
  cmd->add_option("--devices", a->spec.devices, "GPUs to use")->required()->check(kPositiveInt);
  cmd->add_option("--global-batch", a->spec.global_batch, "sequences per step (default: 4 per device)")
      ->check(kPositiveInt);
  cmd->add_option("--seq-len", a->spec.seq_len, "tokens per sequence (default: the model's)")->check(kPositiveInt);
  add_search_space_flags(cmd, *a);
  // Positive: a cap of 0 GiB (read as "no cap given") would silently be the default.
  auto* cap = cmd->add_option("--memory-cap", a->memory_cap_gib,
                              "GiB per device a plan may use (default: the GPU's HBM less the reserve)")
                  ->check(kPositiveNumber);
  cmd->add_option("--memory-reserve-gib", a->memory_reserve_gib,
                  "GiB of HBM kept out of the default cap for the CUDA context, NCCL buffers and fragmentation "
                  "(default: 5 % of the HBM)")
      ->check(kNonNegativeNumber)
      ->excludes(cap);
  cmd->add_option("--budget-s", a->budget_s, "stop starting simulations after this many seconds (0: no limit)")
      ->check(kNonNegativeNumber);
  cmd->add_option("--top", a->spec.top_k, "best plans re-simulated on the SimGrid engine")
      ->check(kNonNegativeInt)
      ->capture_default_str();
  cmd->add_flag("--no-placement-search", a->no_placement, "keep the generator's PP boundaries");
  cmd->add_option("--show", a->show, "plans printed")->check(kPositiveInt)->capture_default_str();
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  a->jobs = static_cast<int>(cores);
  cmd->add_option("-j,--jobs", a->jobs, "worker threads for analytic simulations")
      ->check(kPositiveInt)
      ->capture_default_str();
  cmd->add_option("-o,--output", a->output_path, "results CSV; rerunning with the same file resumes")
      ->required()
      ->check(kOutputPath);
  cmd->add_option("--emit-directives", a->directives_path, "write the best plan's directive program (JSON)")
      ->check(kOutputPath);
  cmd->add_option("--emit-scenario", a->scenario_path, "write the best plan's scenario (JSON, opens in piper-studio)")
      ->check(kOutputPath);
  cmd->add_option("--plot", a->plot_path, "write a Pareto plot (throughput vs peak memory) as PNG")
      ->check(kOutputPath)
      ->check(kPngPath);
  return {cmd, [a] { return run_tune(*a); }};
}

}  // namespace piper::cli
