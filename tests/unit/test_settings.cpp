// Tests of the one table of strategy settings (core/settings.hpp, strategy_settings.def): every setting
// given by CLI flag, scenario key, Python keyword (the strategy object reader), sweep spec and results
// CSV column reads back as the same StrategyOptions; unknown keys and bad values are one-line errors
// naming the key.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/common.hpp"
#include "piper/core/error.hpp"
#include "piper/core/scenario.hpp"
#include "piper/core/settings.hpp"
#include "piper/search/results_csv.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/search/sweep.hpp"
#include "piper/search/tune.hpp"

using namespace piper;
using nlohmann::json;

namespace {

// A valid value of `s` other than its default, chosen from the table's own range or choices.
json other_value(const core::Setting& s) {
  const json def = core::setting_default(s);
  switch (s.type) {
    case core::SettingType::Bool:
      return !def.get<bool>();
    case core::SettingType::Int: {
      const int min = static_cast<int>(s.min);
      return def.get<int>() != min ? min : min + 1;
    }
    case core::SettingType::Double:
      return def.get<double>() != 25.5 ? 25.5 : 12.25;
    case core::SettingType::String: {
      const auto choices = core::setting_choices(s);
      return choices.empty() ? json("x") : json(choices.back());
    }
  }
  return nullptr;
}

// The CLI text of a value (a Bool flag takes none).
std::vector<std::string> flag_args(const core::Setting& s, const json& v) {
  if (s.type == core::SettingType::Bool) return {core::setting_flag(s)};
  return {core::setting_flag(s), v.is_string() ? v.get<std::string>() : v.dump()};
}

core::StrategyOptions with(const core::Setting& s, const json& v) {
  core::StrategyOptions o;
  core::set_setting(s, o, v, s.name);
  EXPECT_NE(o, core::StrategyOptions{}) << s.name << ": the test value is the default";
  return o;
}

std::string column(const std::string& row, const std::vector<std::string>& columns, const std::string& name) {
  const auto fields = search::csv_split(row);
  const auto at = std::find(columns.begin(), columns.end(), name);
  EXPECT_NE(at, columns.end()) << name;
  return at == columns.end() ? std::string() : fields.at(static_cast<std::size_t>(at - columns.begin()));
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(Settings, NamesAreUniqueSnakeCaseWithHelpAndAValidDefault) {
  std::vector<std::string> names = core::setting_names();
  ASSERT_GE(names.size(), 17u);
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end());
  for (const auto& s : core::strategy_settings()) {
    auto snake = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'; };
    EXPECT_TRUE(std::all_of(s.name.begin(), s.name.end(), snake)) << s.name;
    EXPECT_FALSE(s.help.empty()) << s.name;
    EXPECT_EQ(s.help.find('\n'), std::string::npos) << s.name;
    EXPECT_EQ(core::setting_problem(s, core::setting_default(s)), "") << s.name;
    EXPECT_EQ(core::find_setting(s.name), &s);
  }
  EXPECT_EQ(core::setting_flag(*core::find_setting("dp_shard")), "--dp-shard");
  EXPECT_EQ(core::setting_flag(*core::find_setting("virtual")), "--virtual");
}

// The table-driven round trip: each setting, set alone to a value other than its default, comes back
// as the same StrategyOptions through every way in.
TEST(Settings, EverySettingRoundTripsThroughFlagKeyKeywordAndCsv) {
  for (const core::Setting& s : core::strategy_settings()) {
    SCOPED_TRACE(s.name);
    const json v = other_value(s);
    const core::StrategyOptions expected = with(s, v);

    // CLI flag.
    CLI::App app;
    cli::StrategyFlags flags;
    flags.add_to(&app);
    std::vector<std::string> args = flag_args(s, v);
    std::reverse(args.begin(), args.end());  // CLI11 takes them last first
    app.parse(args);
    EXPECT_EQ(flags.options, expected);

    // Scenario key, and the scenario file written back.
    const json scenario = {{"model", "qwen3-9m"}, {"strategy", {{s.name, v}}}};
    const core::Scenario read = core::Scenario::from_json(scenario, "s.json");
    EXPECT_EQ(read.strategy, expected);
    EXPECT_EQ(core::Scenario::from_json(read.to_json(), "again.json").strategy, expected);

    // Python keyword (piper.strategy reads its keywords as a strategy object without a prefix).
    core::StrategyOptions kw;
    core::read_strategy_json(json{{s.name, v}}, kw, "strategy", "");
    EXPECT_EQ(kw, expected);
    EXPECT_EQ(core::strategy_to_json(expected, true).at(s.name), v);

    // Sweep spec key -> combination -> results CSV column and JSON row.
    const auto points = search::expand(search::SweepSpec::from_json(json{{s.name, json::array({v})}}, "spec.json"));
    ASSERT_EQ(points.size(), 1u);
    EXPECT_EQ(points[0].strategy(), expected);
    search::SweepRow row;
    row.point = points[0];
    row.status = "invalid";
    const std::string text = column(search::to_csv(row), search::sweep_csv_columns(), s.name);
    core::StrategyOptions from_csv;
    core::set_setting(s, from_csv, core::setting_from_text(s, text, "csv"), "csv");
    EXPECT_EQ(from_csv, expected);
    EXPECT_EQ(search::to_json(row).at(s.name), v);

    // Tune results CSV (global_batch is the spec's there, never a candidate's).
    if (s.name == "global_batch") continue;
    search::TuneSpec spec;
    search::TuneRow tune_row;
    static_cast<core::StrategyOptions&>(tune_row.candidate) = expected;
    tune_row.candidate.zero = s.name == "zero" ? expected.zero : 3;  // reduce_every is a ZeRO-2/3 choice
    tune_row.status = "pruned";
    const search::TuneRow back =
        search::tune_row_from_csv(search::csv_split(search::to_csv(spec, tune_row)), nullptr, "t.csv");
    EXPECT_EQ(back.candidate, tune_row.candidate);
  }
}

TEST(Settings, UnknownScenarioKeyIsOneLineNamingFileAndKey) {
  const std::string near = error_of([] {
    core::Scenario::from_json(json::parse(R"({"model": "qwen3-9m", "strategy": {"microbatchs": 4}})"), "s.json");
  });
  EXPECT_EQ(near, "s.json: field 'strategy.microbatchs': unknown field (did you mean 'microbatches'?)");
  const std::string far = error_of([] {
    core::Scenario::from_json(json::parse(R"({"model": "qwen3-9m", "strategy": {"context_length_factor": 4}})"),
                              "s.json");
  });
  EXPECT_EQ(far.rfind("s.json: field 'strategy.context_length_factor': unknown field (expected one of: pp, dp, ", 0),
            0u)
      << far;
  EXPECT_EQ(far.find('\n'), std::string::npos);
  // The same rule in a sweep spec.
  EXPECT_EQ(error_of([] { search::SweepSpec::from_json(json::parse(R"({"dp_shards": [2]})"), "sw.json"); }),
            "sw.json: unknown field 'dp_shards' (did you mean 'dp_shard'?)");
}

TEST(Settings, BadEnumValueNamesTheKeyAndTheChoices) {
  EXPECT_EQ(error_of([] {
              core::Scenario::from_json(json::parse(R"({"model": "qwen3-9m", "strategy": {"recompute": "ful"}})"),
                                        "s.json");
            }),
            "s.json: field 'strategy.recompute': unknown value 'ful' (did you mean 'full'?); expected none, selective, "
            "full, op or auto");
  EXPECT_EQ(error_of([] {
              core::Scenario::from_json(json::parse(R"({"model": "qwen3-9m", "strategy": {"reduce_every": 1}})"),
                                        "s.json");
            }),
            "s.json: field 'strategy.reduce_every': must be a string (got 1)");
  EXPECT_EQ(
      error_of([] { search::SweepSpec::from_json(json::parse(R"({"reduce_every": ["step", "steps"]})"), "sw.json"); }),
      "sw.json: field 'reduce_every': unknown value 'steps' (did you mean 'step'?); expected microbatch or step");
  EXPECT_EQ(error_of([] {
              core::Scenario::from_json(json::parse(R"({"model": "qwen3-9m", "strategy": {"zero": 4}})"), "s.json");
            }),
            "s.json: field 'strategy.zero': must be an integer in 0..3 (got 4)");
  // The CLI flag refuses it before anything runs, naming the flag.
  CLI::App app;
  cli::StrategyFlags flags;
  flags.add_to(&app);
  const std::string cli = error_of([&] { app.parse(std::vector<std::string>{"ful", "--recompute"}); });
  EXPECT_NE(cli.find("--recompute"), std::string::npos) << cli;
  CLI::App app2;
  cli::StrategyFlags flags2;
  flags2.add_to(&app2);
  EXPECT_EQ(error_of([&] {
              app2.parse(std::vector<std::string>{"7", "--zero"});
            }),
            "--zero: must be an integer in 0..3 (got 7)");
  CLI::App app3;
  cli::StrategyFlags flags3;
  flags3.add_to(&app3);
  EXPECT_EQ(error_of([&] {
              app3.parse(std::vector<std::string>{"2x", "--pp"});
            }),
            "--pp: must be an integer, got '2x'");
}

// gather_prefetch (added as one line of the table): the replicate directive's ZeRO-3 `prefetch`.
// With 0 no gather runs ahead of its unit, so no more gathered copies are live than with the default
// 1, and with no limit (2^20) at least as many; the generated program carries the field only when set.
TEST(Settings, GatherPrefetchBoundsTheZero3Gathers) {
  auto scenario = [](int prefetch) {
    core::Scenario s;
    s.model = "qwen3-9m";
    s.strategy.pp = 2, s.strategy.dp = 2, s.strategy.zero = 3, s.strategy.microbatches = 4;
    s.strategy.gather_prefetch = prefetch;
    return s;
  };
  auto prefetch_of = [&](int prefetch) {
    std::vector<json> out;
    for (const auto& d : core::scenario_program(scenario(prefetch)).to_json())
      if (d.at("op") == "replicate") out.push_back(d.contains("prefetch") ? d.at("prefetch") : json(nullptr));
    return out;
  };
  EXPECT_EQ(prefetch_of(1), (std::vector<json>{nullptr, nullptr}));
  EXPECT_EQ(prefetch_of(0), (std::vector<json>{0, 0}));
  auto peak = [&](int prefetch) {
    sim::SimulateOptions options;
    options.cluster = "dgx-h200";
    options.engine = "analytic";
    return sim::simulate(scenario(prefetch), options).report.peak_memory_bytes;
  };
  const auto none = peak(0), one = peak(1), unbounded = peak(1 << 20);
  EXPECT_LE(none, one);
  EXPECT_LE(one, unbounded);
  EXPECT_LT(none, unbounded);
  core::Scenario zero2 = scenario(0);
  zero2.strategy.zero = 2;
  EXPECT_EQ(error_of([&] { core::compile_scenario(zero2); }),
            "--gather-prefetch applies only with --zero 3 (its per-use parameter gathers)");
}

// A long search's progress in a log: quiet for the first interval, then one line per interval while a
// phase runs and one as each phase ends (once), with the elapsed time.
TEST(ProgressLog, QuietAtFirstThenOneLineAnIntervalAndOneAtEachPhaseEnd) {
  piper::cli::ProgressLog log("tune", 60);
  EXPECT_EQ(log.report("estimate", 10, 10, 1), "") << "a phase that ends in the first minute says nothing";
  EXPECT_EQ(log.report("analytic", 5, 100, 59.9), "");
  EXPECT_EQ(log.report("analytic", 6, 100, 60), "tune: analytic: 6 of 100, elapsed 1m00s\n");
  EXPECT_EQ(log.report("analytic", 7, 100, 119), "");
  EXPECT_EQ(log.report("analytic", 50, 100, 121), "tune: analytic: 50 of 100, elapsed 2m01s\n");
  EXPECT_EQ(log.report("analytic", 100, 100, 130), "tune: analytic: 100 of 100 done, elapsed 2m10s\n");
  EXPECT_EQ(log.report("analytic", 100, 100, 200), "") << "its end is said once";
  EXPECT_EQ(log.report("simgrid", 0, 0, 201), "tune: simgrid: 0 of 0 done, elapsed 3m21s\n");
  EXPECT_EQ(log.report("placement", 1, 4, 230), "");
  EXPECT_EQ(log.report("placement", 2, 4, 262), "tune: placement: 2 of 4, elapsed 4m22s\n");
  EXPECT_EQ(piper::cli::format_duration(7325), "2h02m");
  EXPECT_EQ(piper::cli::format_duration(-1), "?");
}
