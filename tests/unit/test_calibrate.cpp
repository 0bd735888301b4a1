// `piper run --calibrate` on the host backend: the file it writes is a piper-calibration that the
// simulator's loader reads, with an entry for every op class of the plan, and a simulation calibrated
// with it predicts the measured step (the error is printed, never asserted: wall-clock times).
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "piper/core/scenario.hpp"
#include "piper/runtime/calibrate.hpp"
#include "piper/sim/cost_model.hpp"
#include "piper/sim/simulate.hpp"
#include "shell.hpp"

namespace fs = std::filesystem;
using namespace piper;
using nlohmann::json;
using piper::test::mpirun;
using piper::test::sh;

namespace {

const std::string kModel = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json";

fs::path scratch() {
  const fs::path d = fs::temp_directory_path() / ("piper-calibrate-test-" + std::to_string(getpid()));
  fs::create_directories(d);
  return d;
}

core::Program compile_plan(const fs::path& plan) {
  core::Scenario s;
  s.model = kModel;
  s.strategy.pp = 2;
  s.strategy.dp = 2;
  s.strategy.ep = 2;
  s.strategy.microbatches = 4;
  s.strategy.schedule = "1f1b";
  core::Program p = core::compile_scenario(s).result.program;
  std::ofstream(plan) << p.to_json().dump();
  return p;
}

bool is_collective(core::OpKind k) {
  return k == core::OpKind::AllReduce || k == core::OpKind::ReduceScatter || k == core::OpKind::AllGather ||
         k == core::OpKind::AllToAll;
}

}  // namespace

TEST(Calibrate, HostRunWritesWhatTheSimulatorReads) {
  const fs::path dir = scratch();
  const fs::path plan = dir / "plan.json", calib = dir / "calib.json", report = dir / "run.json";
  const core::Program program = compile_plan(plan);
  const auto run = sh(mpirun(4) + PIPER_CLI + " run --plan " + plan.string() + " --steps 4 --seed 3 --calibrate " +
                      calib.string() + " --report " + report.string());
  ASSERT_EQ(run.code, 0) << run.output;

  // The simulator's own loader reads it.
  const sim::Calibration c = sim::Calibration::load(calib.string());
  std::ifstream in(calib);
  const json j = json::parse(in);
  EXPECT_EQ(j.at("measured").at("steps"), 3);  // 4 steps, the first one left out (warm-up)
  EXPECT_EQ(c.gpu, "host-cpu");

  // Every op class of the plan has a measured time: compute and update ops by their work, transfers
  // by their SEND (group of 2), collectives by kind, bytes and group size.
  int looked_up = 0;
  std::set<core::OpKind> kinds;
  for (int d = 0; d < program.num_devices; ++d)
    for (const auto& stream : program.plan_for(d).streams)
      for (const auto& op : stream.ops) {
        if (op.kind == core::OpKind::Recv) continue;  // a transfer is costed by its SEND
        const int group = op.kind == core::OpKind::Send ? 2
                          : is_collective(op.kind)      ? static_cast<int>(program.group_of(op.family, d).size())
                                                        : 1;
        const auto seconds = c.lookup(op, group);
        ASSERT_TRUE(seconds.has_value()) << "no entry for '" << op.label << "' on device " << d;
        EXPECT_GE(*seconds, 0);
        kinds.insert(op.kind);
        ++looked_up;
      }
  EXPECT_GT(looked_up, 0);
  // The plan of PP2 x DP2 x EP2 has compute, updates, transfers, gradient all-reduces and all-to-alls.
  for (auto k : {core::OpKind::Compute, core::OpKind::Update, core::OpKind::Send, core::OpKind::AllReduce,
                 core::OpKind::AllToAll})
    EXPECT_TRUE(kinds.contains(k)) << core::to_string(k);

  // Closed loop: simulate the plan with the calibration on a cluster whose communication takes no
  // compute share (the host's ranks do not share SMs) and compare with the measured mean step.
  const fs::path cluster = dir / "host-like.json";
  std::ofstream(cluster) << R"({"preset": "dgx-h100", "node": {"gpu": {"comm_sm_share": 0}}})";
  sim::SimulateOptions o;
  o.cluster = cluster.string();
  o.engine = "analytic";
  o.calibration_path = calib.string();
  const auto predicted = sim::simulate_program(std::make_shared<const core::Program>(program), o).report.step_time_s;
  std::ifstream rin(report);
  const json measured = json::parse(rin);
  // Compared with the mean of the steps the calibration used (the first pays for warm-up).
  const auto steps = measured.at("step_times_s").get<std::vector<double>>();
  ASSERT_EQ(steps.size(), 4u);
  const double mean = (steps[1] + steps[2] + steps[3]) / 3;
  EXPECT_GT(predicted, 0);
  fmt::print("calibrated prediction {:.3f} ms, measured mean of steps 2-4 {:.3f} ms: error {:+.1f} %\n",
             predicted * 1e3, mean * 1e3, 100 * (predicted - mean) / mean);
  std::error_code ec;
  fs::remove_all(dir, ec);
}

TEST(Calibrate, RefusesAFolderAndTheReference) {
  const fs::path dir = scratch();
  const std::string common = std::string(PIPER_CLI) + " run --model " + kModel + " --pp 2 --microbatches 2 --steps 1";
  const auto folder = sh(mpirun(2) + common + " --calibrate " + dir.string());
  EXPECT_NE(folder.code, 0) << folder.output;                                  // mpirun's status: a rank's exit 2
  EXPECT_EQ(folder.output.find("step "), std::string::npos) << folder.output;  // refused before the first step
  // Refused by the output check every command makes before it runs: rank 0's, in one line.
  EXPECT_NE(folder.output.find("--calibrate: is a folder, not a regular file"), std::string::npos) << folder.output;
  std::size_t error_lines = 0;
  for (std::size_t at = folder.output.find("piper: error"); at != std::string::npos;
       at = folder.output.find("piper: error", at + 1))
    ++error_lines;
  EXPECT_EQ(error_lines, 1u) << folder.output;
  const auto reference = sh(common + " --reference --calibrate " + (dir / "c.json").string());
  EXPECT_EQ(reference.code, 2) << reference.output;
  EXPECT_NE(reference.output.find("needs a distributed run"), std::string::npos) << reference.output;
  EXPECT_FALSE(fs::exists(dir / "c.json"));
  std::error_code ec;
  fs::remove_all(dir, ec);
}

// The recorder on a hand-made step: a SEND/RECV pair counts the shorter span (the side that came
// last to the rendezvous), compute ops of equal work share one median.
TEST(Calibrate, RecorderTakesTheShorterSideAndTheMedian) {
  core::Program p;
  p.model_name = "hand-made";
  p.num_devices = 2;
  p.device_sets = {{0}, {1}};
  p.plan_of_device = {0, 1};
  core::Op f;
  f.kind = core::OpKind::Compute;
  f.pass = core::Pass::F;
  f.flops = 1e9;
  f.memory_bytes = 100;
  core::Op send;
  send.kind = core::OpKind::Send;
  send.node = 5;
  send.pair = 0;
  send.bytes = 1000;
  send.device_set = 0;
  send.peer_set = 1;
  core::Op recv = send;
  recv.kind = core::OpKind::Recv;
  recv.device_set = 1;
  recv.peer_set = 0;
  core::Plan a, b;
  a.streams = {{"compute", {f, f, f}}, {"pp", {send}}};
  b.streams = {{"pp", {recv}}};
  p.plans = {a, b};
  runtime::CalibrationRecorder rec(p);
  core::DeviceTimeline d0, d1;
  d0.spans = {{0, 0, 0.0, 1.0}, {0, 1, 1.0, 4.0}, {0, 2, 4.0, 6.0}, {1, 0, 0.0, 5.0}};  // F: 1, 3, 2 s; SEND 5 s
  d1.spans = {{0, 0, 3.0, 5.0}};                                                        // RECV came late: 2 s
  rec.add_step({d0, d1});
  const sim::Calibration c = sim::Calibration::from_json(rec.to_json("test", json::object()), "rec");
  EXPECT_DOUBLE_EQ(*c.lookup(f, 1), 2.0);     // median of 1, 3, 2
  EXPECT_DOUBLE_EQ(*c.lookup(send, 2), 2.0);  // min(5, 2)
  EXPECT_EQ(c.entries.size(), 2u);
}
