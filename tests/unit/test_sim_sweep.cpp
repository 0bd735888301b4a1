// Sweeps: cartesian expansion, invalid combinations carrying their reason, resuming after a kill
// (partial last line) without losing or duplicating rows, and -j 2 giving the rows of -j 1.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "piper/sim/cluster.hpp"
#include "piper/sim/simulate.hpp"
#include "piper/search/sweep.hpp"
#include "piper/search/worker_pool.hpp"

using namespace piper;
using namespace piper::sim;
using namespace piper::search;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// 2 pp x 3 dp x 2 ep = 12 combinations; ep 3 divides none of dp 1, 2, 4, so 6 are invalid.
SweepSpec small_spec() {
  return SweepSpec::from_json(json::parse(R"({"model": "qwen3-9m", "cluster": "dgx-h200", "engine": "analytic",
      "pp": [1, 2], "dp": [1, 2, 4], "ep": [1, 3], "schedule": "1f1b", "microbatches": 4})"),
                              "spec.json");
}

fs::path temp_csv(const std::string& name) {
  const fs::path p =
      fs::temp_directory_path() / ("piper_test_sweep_" + std::to_string(::getpid()) + "_" + name + ".csv");
  fs::remove(p);
  return p;
}

std::vector<std::string> lines_of(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

std::string field(const std::string& line, const std::string& column) {
  const auto& cols = sweep_csv_columns();
  const std::size_t i = static_cast<std::size_t>(std::find(cols.begin(), cols.end(), column) - cols.begin());
  // Test rows have no quoted fields before `reason` (the last column), so a plain split works.
  std::vector<std::string> fields;
  std::stringstream s(line);
  for (std::string f; std::getline(s, f, ',');) fields.push_back(f);
  return i < fields.size() ? fields[i] : "";
}

// key -> column value, over the data rows (after the header) of a results file's lines.
std::map<std::string, std::string> column_by_key(const std::vector<std::string>& lines, const std::string& column) {
  std::map<std::string, std::string> out;
  for (std::size_t i = 1; i < lines.size(); ++i) out[field(lines[i], "key")] = field(lines[i], column);
  return out;
}
std::map<std::string, std::string> column_by_key(const fs::path& p, const std::string& column) {
  return column_by_key(lines_of(p), column);
}

}  // namespace

TEST(Sweep, ExpandsTheCartesianProduct) {
  const SweepSpec spec = small_spec();
  const auto points = expand(spec);
  EXPECT_EQ(points.size(), 12u);
  std::set<std::string> keys;
  for (const auto& p : points) keys.insert(p.key());
  EXPECT_EQ(keys.size(), 12u) << "keys must identify combinations";
  // Unlisted knobs keep one default value; a scalar is a one-element list.
  EXPECT_EQ(spec.values("zero"), std::vector<json>{0});
  EXPECT_EQ(spec.values("microbatches"), std::vector<json>{4});
}

TEST(Sweep, SpecErrorsNameTheField) {
  try {
    SweepSpec::from_json(json::parse(R"({"pp": [1, "two"]})"), "bad.json");
    FAIL() << "expected SweepError";
  } catch (const SweepError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json: field 'pp'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(SweepSpec::from_json(json::parse(R"({"dp_size": 2})"), "bad.json"), SweepError);
  try {
    SweepSpec::from_json(json::parse(R"({"microbatchs": [4]})"), "bad.json");
    FAIL() << "expected SweepError";
  } catch (const SweepError& e) {
    EXPECT_STREQ(e.what(), "bad.json: unknown field 'microbatchs' (did you mean 'microbatches'?)");
  }
  EXPECT_THROW(SweepSpec::from_json(json::parse(R"({"engine": "fast"})"), "bad.json"), SweepError);
}

TEST(Sweep, InvalidCombinationsCarryTheReason) {
  SweepPoint p = expand(small_spec()).front();
  p.pp = 1, p.dp = 4, p.ep = 3;
  const SweepRow row = run_point(p);
  EXPECT_EQ(row.status, "invalid");
  EXPECT_NE(row.reason.find("--ep 3 must divide --dp 4"), std::string::npos) << row.reason;
  EXPECT_EQ(to_csv(row).find('\n'), std::string::npos);
  // Not simulated, so no figures: blank in the CSV and null in JSON, never a 0 that plots as a point.
  for (const char* column : {"devices", "step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "peak_memory_bytes",
                             "oom", "compile_time_s", "simulate_time_s", "tp_comm_s"}) {
    EXPECT_EQ(field(to_csv(row), column), "") << column;
    EXPECT_TRUE(to_json(row).at(column).is_null()) << column;
  }
  EXPECT_EQ(field(to_csv(row), "status"), "invalid");
}

TEST(Sweep, ARowsClusterErrorNamesTheSpecsField) {
  // A cluster that fails in a row (the spec's is checked up front, but a file can go while a sweep
  // runs) was named "--cluster", a flag sweep does not take.
  SweepPoint p = expand(small_spec()).front();
  p.cluster = (fs::temp_directory_path() / ("piper_test_sweep_" + std::to_string(::getpid()) + "_gone.json")).string();
  const SweepRow row = run_point(p);
  EXPECT_EQ(row.status, "invalid");
  EXPECT_EQ(row.reason.rfind("field 'cluster': '" + p.cluster + "': neither a preset", 0), 0u) << row.reason;
}

TEST(Sweep, RowMatchesADirectSimulation) {
  SweepPoint p = expand(small_spec()).front();
  p.pp = 2, p.dp = 2, p.ep = 1;
  const SweepRow row = run_point(p);
  ASSERT_EQ(row.status, "ok") << row.reason;
  core::Scenario s;
  s.model = "qwen3-9m";
  s.strategy.pp = 2, s.strategy.dp = 2, s.strategy.microbatches = 4, s.strategy.schedule = "1f1b";
  SimulateOptions options;
  options.cluster = "dgx-h200";
  options.engine = "analytic";
  const SimulationResult direct = simulate(s, options);
  EXPECT_EQ(row.devices, 4);
  EXPECT_EQ(row.step_time_s, direct.report.step_time_s);  // same program, same deterministic engine
  EXPECT_EQ(row.peak_memory_bytes, direct.report.peak_memory_bytes);
  EXPECT_EQ(field(to_csv(row), "step_time_s"), fmt::format("{}", direct.report.step_time_s));
  EXPECT_EQ(to_json(row).at("step_time_s").get<double>(), direct.report.step_time_s);
}

TEST(Sweep, ResumesAfterAKillWithoutLosingOrDuplicatingRows) {
  const SweepSpec spec = small_spec();
  const fs::path csv = temp_csv("resume");
  const SweepSummary first = run_sweep(spec, csv.string());
  EXPECT_EQ(first.ran, 12u);
  EXPECT_EQ(first.ok, 6u);
  EXPECT_EQ(first.invalid, 6u);
  const auto full = lines_of(csv);
  ASSERT_EQ(full.size(), 13u);  // header + 12 rows
  EXPECT_EQ(full.front(), sweep_csv_header());

  // A kill after 2 rows, in the middle of writing the third.
  {
    std::ofstream out(csv, std::ios::trunc | std::ios::binary);
    out << full[0] << "\n" << full[1] << "\n" << full[2] << "\n" << full[3].substr(0, full[3].size() / 2);
  }
  const SweepSummary second = run_sweep(spec, csv.string());
  EXPECT_EQ(second.resumed, 2u);
  EXPECT_EQ(second.ran, 10u);

  const auto after = lines_of(csv);
  ASSERT_EQ(after.size(), 13u);
  EXPECT_EQ(after[1], full[1]) << "rows already written are kept as they were";
  EXPECT_EQ(after[2], full[2]);
  std::multiset<std::string> keys;
  for (std::size_t i = 1; i < after.size(); ++i) keys.insert(field(after[i], "key"));
  std::set<std::string> expected;
  for (const auto& p : expand(spec)) expected.insert(p.key());
  EXPECT_EQ(std::set<std::string>(keys.begin(), keys.end()), expected);
  EXPECT_EQ(keys.size(), expected.size()) << "no row duplicated";
  EXPECT_EQ(column_by_key(after, "step_time_s"), column_by_key(full, "step_time_s")) << "reruns give the same figures";

  // A complete rerun does nothing.
  const SweepSummary third = run_sweep(spec, csv.string());
  EXPECT_EQ(third.resumed, 12u);
  EXPECT_EQ(third.ran, 0u);
  EXPECT_EQ(lines_of(csv).size(), 13u);
  fs::remove(csv);
}

TEST(Sweep, RefusesAFileThatIsNotASweepResult) {
  const fs::path csv = temp_csv("foreign");
  std::ofstream(csv) << "a,b,c\n1,2,3\n";
  EXPECT_THROW(run_sweep(small_spec(), csv.string()), SweepError);
  EXPECT_EQ(lines_of(csv).size(), 2u) << "a foreign file is left alone";
  fs::remove(csv);
}

TEST(Sweep, TwoJobsGiveTheRowsOfOne) {
  const SweepSpec spec = small_spec();
  const fs::path one = temp_csv("j1"), two = temp_csv("j2");
  SweepOptions jobs;
  jobs.jobs = 1;
  run_sweep(spec, one.string(), jobs);
  jobs.jobs = 2;
  run_sweep(spec, two.string(), jobs);
  const auto a = column_by_key(one, "step_time_s"), b = column_by_key(two, "step_time_s");
  EXPECT_EQ(a.size(), 12u);
  EXPECT_EQ(a, b);  // each combination is simulated alone, so threads must not change a bit of it
  EXPECT_EQ(column_by_key(one, "status"), column_by_key(two, "status"));
  EXPECT_EQ(column_by_key(one, "peak_memory_bytes"), column_by_key(two, "peak_memory_bytes"));
  fs::remove(one);
  fs::remove(two);
}

// comm_sms is a sweep axis honoured by the simulator (docs/sm-partition.md): with a partition of s of
// a GPU's N SMs, compute runs at (N - s) / N of its speed for the whole step. On one device (no
// communication at all) the step is its compute ops back to back, so it takes exactly N / (N - s)
// times as long: H200's 132 SMs (datasheet) with 33 for communication give 132/99 = 4/3, with 66 give 2.
TEST(Sweep, CommSmsScalesComputeByTheSmShare) {
  const SweepSpec spec = SweepSpec::from_json(
      json::parse(
          R"({"model": "qwen3-9m", "cluster": "dgx-h200", "pp": 1, "dp": 1, "microbatches": 4, "comm_sms": [0, 33, 66]})"),
      "spec.json");
  ASSERT_EQ(load_cluster("dgx-h200").nodes.front().gpu.sm_count, 132);
  const auto points = expand(spec);
  ASSERT_EQ(points.size(), 3u);
  std::map<int, SweepRow> rows;
  for (const auto& p : points) rows[p.comm_sms] = run_point(p);
  for (const auto& [sms, row] : rows) ASSERT_EQ(row.status, "ok") << sms << ": " << row.reason;
  const double t0 = rows.at(0).step_time_s;
  EXPECT_NEAR(rows.at(33).step_time_s, t0 * 132.0 / 99.0, 1e-9 * t0);
  EXPECT_NEAR(rows.at(66).step_time_s, t0 * 2.0, 1e-9 * t0);
  // The knob is in the key (only when set, so older keys are unchanged) and in its own column.
  EXPECT_EQ(rows.at(0).point.key().find("/sms"), std::string::npos);
  EXPECT_NE(rows.at(33).point.key().find("/sms33"), std::string::npos);
  EXPECT_EQ(field(to_csv(rows.at(33)), "comm_sms"), "33");
  EXPECT_EQ(to_json(rows.at(66)).at("comm_sms"), 66);
}

TEST(Sweep, CommSmsErrorsNameTheField) {
  auto message = [](const char* spec) {
    try {
      SweepSpec::from_json(json::parse(spec), "bad.json");
    } catch (const SweepError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(
      message(R"({"cluster": "dgx-h200", "comm_sms": [24, 132]})"),
      "bad.json: field 'comm_sms': 132 SMs for communication leave none for compute on 'H200-SXM-141GB' (132 SMs)");
  EXPECT_NE(
      message(R"({"comm_sms": -8})").find("bad.json: field 'comm_sms': must be an integer >= 1 (or 0: off) (got -8)"),
      std::string::npos);
  EXPECT_NE(message(R"({"comm_sms": "24"})").find("bad.json: field 'comm_sms'"), std::string::npos);
  EXPECT_EQ(message(R"({"cluster": "dgx-h200", "comm_sms": [0, 20, 131]})"),
            "no error");  // as `simulate --comm-sms` takes them
}

// dp_shard is a sweep axis (HSDP, docs/compiler.md): with ZeRO-3 over 4 replicas, groups of 2 keep
// twice the sharded state per device, so the peak memory grows; a group size that does not divide
// dp is an invalid row with the strategy's one-line reason, not a failed sweep.
TEST(Sweep, DpShardIsAnAxis) {
  const SweepSpec spec = SweepSpec::from_json(
      json::parse(
          R"({"model": "qwen3-9m", "cluster": "dgx-h200", "pp": 1, "dp": 4, "zero": 3, "microbatches": 4, "dp_shard": [0, 2, 3]})"),
      "spec.json");
  const auto points = expand(spec);
  ASSERT_EQ(points.size(), 3u);
  std::map<int, SweepRow> rows;
  for (const auto& p : points) rows[p.dp_shard] = run_point(p);
  ASSERT_EQ(rows.at(0).status, "ok") << rows.at(0).reason;
  ASSERT_EQ(rows.at(2).status, "ok") << rows.at(2).reason;
  EXPECT_GT(rows.at(2).peak_memory_bytes, rows.at(0).peak_memory_bytes);
  EXPECT_EQ(rows.at(3).status, "invalid");
  EXPECT_EQ(rows.at(3).reason, "--dp-shard 3 must be at least 2 and divide --dp 4");
  EXPECT_EQ(rows.at(0).point.key().find("/hs"), std::string::npos);
  EXPECT_NE(rows.at(2).point.key().find("/hs2"), std::string::npos);
  EXPECT_EQ(field(to_csv(rows.at(2)), "dp_shard"), "2");
  EXPECT_EQ(to_json(rows.at(2)).at("dp_shard"), 2);
  try {
    SweepSpec::from_json(json::parse(R"({"dp_shard": [-2]})"), "bad.json");
    ADD_FAILURE() << "no error for a negative dp_shard";
  } catch (const SweepError& e) {
    EXPECT_EQ(std::string(e.what()), "bad.json: field 'dp_shard': must be an integer >= 2 (or 0: off) (got -2)");
  }
}

// tp_comm_s is the report's TP collective time on the critical path: 0 without TP, the direct
// simulation's figure with it.
TEST(Sweep, TpCommColumnIsTheCriticalPathsTpTime) {
  const SweepSpec spec = SweepSpec::from_json(
      json::parse(
          R"({"model": "qwen3-9m", "cluster": "dgx-a100-80g", "pp": 1, "dp": 1, "microbatches": 2, "tp": [1, 2]})"),
      "spec.json");
  std::map<int, SweepRow> rows;
  for (const auto& p : expand(spec)) rows[p.tp] = run_point(p);
  ASSERT_EQ(rows.at(1).status, "ok") << rows.at(1).reason;
  ASSERT_EQ(rows.at(2).status, "ok") << rows.at(2).reason;
  EXPECT_EQ(rows.at(1).tp_comm_s, 0);
  core::Scenario s;
  s.model = "qwen3-9m";
  s.strategy.tp = 2, s.strategy.microbatches = 2;
  SimulateOptions options;
  options.cluster = "dgx-a100-80g";
  options.engine = "analytic";
  const double direct = simulate(s, options).report.critical_path.tp_s;
  EXPECT_GT(direct, 0);
  EXPECT_EQ(rows.at(2).tp_comm_s, direct);
  EXPECT_EQ(std::stod(field(to_csv(rows.at(2)), "tp_comm_s")), direct);
  EXPECT_EQ(to_json(rows.at(2)).at("tp_comm_s"), direct);
}

// A file an older piper sweep wrote (the header less the columns added since) is refused by name and
// left as it was.
TEST(Sweep, RefusesAnOlderSweepFileNamingTheMissingColumns) {
  const fs::path csv = temp_csv("older");
  std::vector<std::string> older = sweep_csv_columns();
  std::erase_if(older, [](const std::string& c) { return c == "dp_shard" || c == "tp_comm_s" || c == "cp"; });
  std::string header;
  for (const auto& c : older) header += (header.empty() ? "" : ",") + c;
  std::ofstream(csv) << header << "\n";
  try {
    run_sweep(small_spec(), csv.string());
    ADD_FAILURE() << "an older results file was accepted";
  } catch (const SweepError& e) {
    EXPECT_EQ(
        std::string(e.what()),
        csv.string() +
            ": line 1: written by an older piper sweep (no dp_shard, tp_comm_s and cp columns); choose another -o");
  }
  EXPECT_EQ(lines_of(csv), std::vector<std::string>{header});
  fs::remove(csv);
}

// The thread worker pool: every item's line reaches the sink once, one call at a time; the items that
// must run alone (SimGrid's: it forks) start after every other item has finished and overlap nothing.
TEST(WorkerPool, ThreadPoolRunsEveryItemOnceAndTheAloneOnesLastOneAtATime) {
  ThreadPool pool(4);
  std::vector<std::size_t> items(40);
  std::iota(items.begin(), items.end(), 0);
  auto alone = [](std::size_t i) { return i % 5 == 0; };
  std::atomic<int> running{0}, others_done{0}, in_sink{0};
  std::atomic<bool> alone_overlapped{false}, alone_early{false}, sink_overlapped{false};
  std::map<std::size_t, std::string> got;
  pool.run(
      items, alone,
      [&](std::size_t i) {
        const int now = ++running;
        if (alone(i) && now != 1) alone_overlapped = true;
        if (alone(i) && others_done != 32) alone_early = true;
        --running;
        if (!alone(i)) ++others_done;
        return "line " + std::to_string(i);
      },
      [&](std::size_t i, const std::string& line) {
        if (++in_sink != 1) sink_overlapped = true;
        EXPECT_TRUE(got.emplace(i, line).second) << "item " << i << " twice";
        --in_sink;
      });
  ASSERT_EQ(got.size(), 40u);
  for (const auto& [i, line] : got) EXPECT_EQ(line, "line " + std::to_string(i));
  EXPECT_FALSE(alone_overlapped);
  EXPECT_FALSE(alone_early);
  EXPECT_FALSE(sink_overlapped);
  // The first exception of work stops the run and reaches the caller; abort() throws.
  EXPECT_THROW(
      pool.run(
          items, {}, [](std::size_t i) -> std::string { throw std::runtime_error("item " + std::to_string(i)); },
          [](std::size_t, const std::string&) {}),
      std::runtime_error);
  EXPECT_THROW(pool.abort("stop"), std::runtime_error);
  EXPECT_TRUE(pool.owner());
  EXPECT_EQ(pool.processes(), 1);
}
