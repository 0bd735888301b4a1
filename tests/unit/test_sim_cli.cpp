// End-to-end `piper simulate`: report JSON fields, trace file, --plan input, and one-line errors.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <regex>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "scratch_test.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct Result {
  int code;
  std::string out, err;
};

Result run(const std::string& args, const fs::path& dir) {
  const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd = std::string(PIPER_CLI) + " " + args + " >" + out.string() + " 2>" + err.string();
  const int status = std::system(cmd.c_str());
  auto slurp = [](const fs::path& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  };
  return {WEXITSTATUS(status), slurp(out), slurp(err)};
}

class SimCli : public piper::test::ScratchTest {};

}  // namespace

TEST_F(SimCli, WritesReportAndTrace) {
  const fs::path report = dir_ / "report.json", trace = dir_ / "trace.json";
  Result r =
      run("simulate --model qwen3-9m --pp 2 --dp 2 --microbatches 4 --engine analytic --cluster dgx-h100 --report " +
              report.string() + " --trace " + trace.string(),
          dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("step time"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("critical path"), std::string::npos) << r.out;
  json j = json::parse(std::ifstream(report));
  for (const char* key : {"step_time_s", "tokens_per_s", "mfu", "bubble_fraction", "compile_time_s", "simulate_time_s",
                          "oom", "per_device", "critical_path"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_EQ(j.at("devices"), 4);
  EXPECT_EQ(j.at("engine"), "analytic");
  EXPECT_GT(j.at("step_time_s").get<double>(), 0);
  EXPECT_GT(j.at("mfu").get<double>(), 0);
  EXPECT_LT(j.at("mfu").get<double>(), 1);
  // 4 microbatches x 2 replicas x the model's tokens per microbatch; qwen3-9m's default shape is read
  // back from the compile-only command so this test does not restate it.
  ASSERT_EQ(j.at("per_device").size(), 4u);
  for (const auto& d : j.at("per_device"))
    for (const char* key : {"busy_s", "idle_s", "bubble_fraction", "peak_memory_bytes", "comm_compute_overlap"})
      EXPECT_TRUE(d.contains(key)) << key;
  json t = json::parse(std::ifstream(trace));
  EXPECT_GT(t.at("traceEvents").size(), 10u);
}

TEST_F(SimCli, SimulatesAPlanFile) {
  const fs::path plan = dir_ / "plan.json", report = dir_ / "report.json";
  ASSERT_EQ(run("compile --model qwen3-9m --pp 2 --microbatches 2 -o " + plan.string(), dir_).code, 0);
  Result r = run("simulate --plan " + plan.string() + " --engine analytic --report " + report.string(), dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(std::ifstream(report)).at("devices"), 2);
}

// --save-scenario then --scenario replays the same step: the file's model, strategy, cluster and
// engine; --engine wins over the file's; a compile input beside --scenario is a one-line error.
TEST_F(SimCli, ReplaysASavedScenario) {
  const fs::path sc = dir_ / "s.json", first = dir_ / "first.json", again = dir_ / "again.json";
  ASSERT_EQ(run("simulate --model qwen3-9m --pp 2 --dp 2 --microbatches 4 --engine analytic --cluster dgx-h100 "
                "--save-scenario " +
                    sc.string() + " --report " + first.string(),
                dir_)
                .code,
            0);
  Result r = run("simulate --scenario " + sc.string() + " --report " + again.string(), dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  const json a = json::parse(std::ifstream(first)), b = json::parse(std::ifstream(again));
  EXPECT_EQ(b.at("step_time_s"), a.at("step_time_s"));
  EXPECT_EQ(b.at("engine"), "analytic");
  EXPECT_EQ(b.at("devices"), 4);
  EXPECT_NE(r.out.find("(dgx-h100)"), std::string::npos) << r.out;
  Result s = run("simulate --scenario " + sc.string() + " --engine simgrid --report " + again.string(), dir_);
  ASSERT_EQ(s.code, 0) << s.err;
  EXPECT_EQ(json::parse(std::ifstream(again)).at("engine"), "simgrid");
  Result c = run("compile --scenario " + sc.string(), dir_);
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_NE(c.out.find("qwen3-9m: 4 devices"), std::string::npos) << c.out;
  Result bad = run("simulate --scenario " + sc.string() + " --pp 4", dir_);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("piper: error: --pp cannot be used with --scenario"), std::string::npos) << bad.err;
  EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << bad.err;
  // A bad cluster in the file is the file's field, not a --cluster flag.
  { std::ofstream(dir_ / "bad-cluster.json") << R"({"model": "qwen3-9m", "cluster": "dgx-h9000"})"; }
  Result cl = run("simulate --scenario " + (dir_ / "bad-cluster.json").string(), dir_);
  EXPECT_EQ(cl.code, 2);
  EXPECT_NE(cl.err.find("bad-cluster.json: field 'cluster': 'dgx-h9000': neither a preset"), std::string::npos)
      << cl.err;
  Result none = run("compile --pp 2", dir_);
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.err.find("--model is required (or give --scenario FILE)"), std::string::npos) << none.err;
}

TEST_F(SimCli, BadClusterIsOneLineAndWritesNothing) {
  const fs::path report = dir_ / "report.json";
  Result r = run("simulate --model qwen3-9m --engine analytic --cluster dgx-h9000 --report " + report.string(), dir_);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("piper: error: --cluster 'dgx-h9000'"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_FALSE(fs::exists(report));
  Result e = run("simulate --model qwen3-9m --engine nope", dir_);
  EXPECT_EQ(e.code, 2);
  EXPECT_NE(e.err.find("--engine 'nope'"), std::string::npos) << e.err;
}

// --runtime / --attention-kernel: the same prediction as a cluster file that sets them, named in the
// report, kept by --save-scenario; a bad value is one line naming the flag, and nothing is written.
TEST_F(SimCli, RuntimeFlagsCostTheNamedRuntime) {
  const fs::path spelled = dir_ / "spelled.json", flagged = dir_ / "flagged.json", sc = dir_ / "s.json",
                 again = dir_ / "again.json", fused = dir_ / "fused.json";
  { std::ofstream(dir_ / "c.json") << R"({"preset": "dgx-h100", "runtime": "eager", "attention_kernel": "fa2"})"; }
  const std::string base = "simulate --model qwen3-9m --pp 2 --microbatches 4 --engine analytic ";
  ASSERT_EQ(run(base + "--cluster " + (dir_ / "c.json").string() + " --report " + spelled.string(), dir_).code, 0);
  Result r = run(base + "--cluster dgx-h100 --runtime eager --attention-kernel fa2 --report " + flagged.string() +
                     " --save-scenario " + sc.string(),
                 dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("(dgx-h100; runtime eager, attention fa2)"), std::string::npos) << r.out;
  const json a = json::parse(std::ifstream(spelled)), b = json::parse(std::ifstream(flagged));
  EXPECT_EQ(b.at("step_time_s"), a.at("step_time_s"));
  EXPECT_EQ(b.at("runtime"), "runtime eager, attention fa2");
  ASSERT_EQ(run(base + "--cluster dgx-h100 --report " + fused.string(), dir_).code, 0);
  EXPECT_LT(json::parse(std::ifstream(fused)).at("step_time_s").get<double>(), b.at("step_time_s").get<double>());
  r = run("simulate --scenario " + sc.string() + " --report " + again.string(), dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(std::ifstream(again)).at("step_time_s"), b.at("step_time_s"));
  // Over a scenario file's own cluster.
  r = run("simulate --scenario " + sc.string() + " --runtime fused --report " + again.string(), dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("(dgx-h100; attention fa2)"), std::string::npos) << r.out;

  const fs::path none = dir_ / "none.json";
  r = run(base + "--runtime eagr --report " + none.string(), dir_);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("piper: error: --runtime 'eagr': unknown runtime profile 'eagr' (did you mean 'eager'?)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  r = run(base + "--cluster dgx-a100-80g --attention-kernel fa3 --report " + none.string(), dir_);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("piper: error: --attention-kernel 'fa3': kernel table 'a100-80gb-sxm' has no attention kernel "
                       "'fa3' (it has: fa1, fa2)"),
            std::string::npos)
      << r.err;
  r = run(base + "--cluster dgx-h9000 --runtime eager --report " + none.string(), dir_);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("piper: error: --cluster 'dgx-h9000': neither a preset"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(none));
  // piper tune states the runtime it searched for.
  r = run(
      "tune --model qwen3-9m --devices 2 --global-batch 4 --micro-batch-size 1 --zero 0 --schedules 1f1b "
      "--max-virtual 1 --ep 1 --tp 1 --recompute none --top 0 --show 1 --no-placement-search -j 1 --cluster dgx-h100 "
      "--runtime eager -o " +
          (dir_ / "tune.csv").string(),
      dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("qwen3-9m on 2 x dgx-h100 (runtime eager), global batch 4"), std::string::npos) << r.out;
}

// `piper tune` end to end: the best plan's directive program and scenario compile to the plan it
// reports, the plot is a PNG, a rerun resumes everything, and bad flags are one-line errors.
TEST_F(SimCli, TuneWritesTheWinnersProgramAndResumes) {
  const fs::path csv = dir_ / "tune.csv", best = dir_ / "best.json", scenario = dir_ / "best-scenario.json",
                 png = dir_ / "pareto.png";
  const std::string args =
      "tune --model qwen3-9m --devices 4 --global-batch 8 --micro-batch-size 1 --zero 0,1 "
      "--schedules 1f1b,zb-h1 --tp 1,2 --recompute none,full --top 1 -j 2 -o " +
      csv.string();
  // The Pareto plot needs Qt 6 Gui (piper_plot); builds without it (the sanitize preset) test the rest.
#ifdef PIPER_HAVE_PLOT
  const std::string plot_args = " --plot " + png.string();
#else
  const std::string plot_args;
#endif
  Result r =
      run(args + " --emit-directives " + best.string() + " --emit-scenario " + scenario.string() + plot_args, dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("best: PP "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  simgrid "), std::string::npos) << "the top plan is re-simulated on SimGrid: " << r.out;
  ASSERT_TRUE(fs::exists(best));
#ifdef PIPER_HAVE_PLOT
  ASSERT_TRUE(fs::exists(png));
#endif
  const auto line = [](const std::string& text, const std::string& prefix) {
    const auto at = text.find(prefix);
    return at == std::string::npos ? std::string() : text.substr(at, text.find('\n', at) - at);
  };
  // The scenario is the winner's strategy.
  std::ifstream in(scenario);
  const json sc = json::parse(in);
  EXPECT_EQ(sc["model"], "qwen3-9m");
  EXPECT_EQ(sc["micro_batch_size"], 1);
  const int tp = sc["strategy"].value("tp", 1);
  const bool sp = sc["strategy"].value("sequence_parallel", false);
  const std::string recompute = sc["strategy"].value("recompute", "none");
  const std::string head = "best: PP " + std::to_string(sc["strategy"]["pp"].get<int>()) +
                           (tp > 1 ? " x TP " + std::to_string(tp) + (sp ? " (SP)" : "") : "") + " x DP " +
                           std::to_string(sc["strategy"]["dp"].get<int>());
  EXPECT_EQ(line(r.out, "best: ").rfind(head, 0), 0u) << line(r.out, "best: ") << " vs " << head;
  EXPECT_NE(line(r.out, "best: ").find(", " + sc["strategy"]["schedule"].get<std::string>()), std::string::npos);
  EXPECT_EQ(line(r.out, "best: ").find("recompute") != std::string::npos, recompute != "none") << line(r.out, "best: ");
  EXPECT_NE(r.out.find("TP degrees  1,2\n"), std::string::npos) << r.out;
  // The directive program compiles, and carries the winner's TP and recompute directives.
  Result compiled = run("compile --model qwen3-9m --micro-batch-size 1 --directives " + best.string(), dir_);
  EXPECT_EQ(compiled.code, 0) << compiled.err;
  std::ifstream program_in(best);
  const json program = json::parse(program_in);
  int tp_directives = 0, recompute_directives = 0;
  for (const auto& d : program) {
    tp_directives += d.value("op", "") == "tensor_parallel" && d.value("degree", 0) == tp &&
                     d.value("sequence_parallel", false) == sp;
    recompute_directives += d.value("op", "") == "recompute" && d.value("mode", "") == recompute;
  }
  EXPECT_EQ(tp_directives > 0, tp > 1) << program.dump();
  EXPECT_EQ(recompute_directives > 0, recompute != "none") << program.dump();
  // The CSV carries the new knobs.
  std::ifstream csv_in(csv);
  std::string header;
  std::getline(csv_in, header);
  EXPECT_NE(header.find(",tp,sequence_parallel,recompute,"), std::string::npos) << header;

  Result again = run(args, dir_);
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("rows resumed"), std::string::npos);
  EXPECT_EQ(line(again.out, "best: "), line(r.out, "best: "));

  Result bad = run("tune --model qwen3-9m --devices 4 --schedules nope -o " + (dir_ / "x.csv").string(), dir_);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("--schedules 'nope' is unknown"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(dir_ / "x.csv")) << "nothing written for bad input";
  Result foreign = run("tune --model qwen3-9m --devices 4 --global-batch 16 -o " + csv.string(), dir_);
  EXPECT_EQ(foreign.code, 2);
  EXPECT_NE(foreign.err.find("holds a tune of qwen3-9m"), std::string::npos) << foreign.err;
}

#ifndef PIPER_HAVE_PLOT
// Without Qt 6 Gui, --plot is refused before the search starts: one line, exit 2, and neither the
// results CSV nor the directive program is written (it used to run the whole search first).
TEST_F(SimCli, TunePlotWithoutQtIsRefusedBeforeTheSearch) {
  const fs::path csv = dir_ / "tune.csv", best = dir_ / "best.json", png = dir_ / "pareto.png";
  Result r = run("tune --model qwen3-9m --devices 4 --global-batch 8 -o " + csv.string() + " --emit-directives " +
                     best.string() + " --plot " + png.string(),
                 dir_);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "piper: error: --plot '" + png.string() +
                       "': this piper was built without Qt 6 Gui, so it cannot draw plots\n");
  EXPECT_EQ(r.out, "") << "nothing searched";
  EXPECT_FALSE(fs::exists(csv));
  EXPECT_FALSE(fs::exists(best));
  EXPECT_FALSE(fs::exists(png));
}
#endif

// The printed search: the default reserve is stated, ordinals are English, the table has PP TP DP EP
// columns; and a search where nothing fits exits 1 (not 0).
TEST_F(SimCli, TuneStatesItsReserveAndExitsOneWhenNothingFits) {
  const fs::path csv = dir_ / "tune.csv";
  const std::string args =
      "tune --model qwen3-9m --devices 2 --global-batch 4 --micro-batch-size 1 --zero 0 "
      "--schedules 1f1b --max-virtual 1 --ep 1 --tp 1,2 --recompute none --top 0 --show 5 --no-placement-search -j 1 "
      "-o ";
  Result r = run(args + csv.string(), dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("reserve     6.57 GiB of the 131.32 GiB HBM kept for the CUDA context, NCCL buffers and "
                       "fragmentation (5 %; --memory-reserve-gib to change)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("memory cap 124.75 GiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(above the 5th best)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("peak GiB  PP  TP  DP  EP  strategy"), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex(R"(\d\.\d\d   1   2   1   1  PP 1 x TP 2 x DP 1)"))) << r.out;
  r = run(args + (dir_ / "tune2.csv").string() + " --memory-reserve-gib 1", dir_);
  EXPECT_NE(r.out.find("memory cap 130.32 GiB"), std::string::npos) << r.out;
  // A 1 MiB cap: nothing fits.
  r = run(args + (dir_ / "tune3.csv").string() + " --memory-cap 0.001", dir_);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("no simulated plan fits 0.00 GiB"), std::string::npos) << r.out;
  // Pins.
  r = run(args + (dir_ / "tune4.csv").string() + " --pp 2", dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("best: PP 2 x DP 1"), std::string::npos) << r.out;
  r = run(args + (dir_ / "tune5.csv").string() + " --pp 3", dir_);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "piper: error: --pp 3: does not divide the 2 devices\n");
}
