// `piper calibrate` (table_calibration.hpp): multipliers recovered from measurements made with known
// ones, the derived table's rates checked by hand, the lower bound, and the one-line refusals.
#include <cmath>
#include <functional>
#include <filesystem>
#include <set>
#include <tuple>

#include <unistd.h>

#include <gtest/gtest.h>

#include "piper/core/scenario.hpp"
#include "piper/sim/table_calibration.hpp"
#include "shell.hpp"

using namespace piper;
using namespace piper::sim;
using nlohmann::json;

namespace {

std::shared_ptr<const core::Program> compile(const std::string& model, int pp, int microbatches) {
  core::Scenario s;
  s.model = model;
  s.strategy.pp = pp;
  s.strategy.microbatches = microbatches;
  return std::make_shared<const core::Program>(core::compile_scenario(s).result.program);
}

Cluster h200() { return with_devices(load_cluster("dgx-h200"), 8); }

std::string scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("piper_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

// The H200 cluster with the calibration's table (derived from h200-sxm) on every GPU, written under the
// scratch folder `name`.
Cluster h200_with_table(TableCalibration c, const std::string& name) {
  c.base = "h200-sxm";
  const std::string table = scratch(name) + "/t.json";
  core::write_file_atomically(table, c.table_json("t", "test").dump());
  Cluster cal = h200();
  for (auto& n : cal.nodes) n.gpu.kernel_table = table;
  return cal;
}

ClassSeconds step_by_class(const core::Program& p, const CostModel& cost, int device) {
  ClassSeconds out{};
  for (const auto& stream : p.plan_for(device).streams)
    for (const auto& op : stream.ops) {
      const ClassSeconds s = class_seconds(p, cost, device, op);
      for (int k = 0; k < kKernelClasses; ++k) out[static_cast<std::size_t>(k)] += s[static_cast<std::size_t>(k)];
    }
  return out;
}

// Device 0's COMPUTE and UPD op times as `seconds(launches, the op's time by kernel class)` makes them.
Calibration op_times(const core::Program& p, const CostModel& cost,
                     const std::function<double(double, const ClassSeconds&)>& seconds) {
  Calibration measured;
  for (const auto& stream : p.plan_for(0).streams)
    for (const auto& op : stream.ops) {
      if (op.kind != core::OpKind::Compute && op.kind != core::OpKind::Update) continue;
      double launches = 0;
      const ClassSeconds s = class_seconds(p, cost, 0, op, &launches);
      CalibrationEntry e;
      e.kind = op.kind;
      e.pass = op.pass;
      e.flops = op.flops;
      e.memory_bytes = op.memory_bytes;
      e.seconds = seconds(launches, s);
      measured.entries.push_back(e);
    }
  return measured;
}

}  // namespace

// A kernel trace whose class totals are the h200 table's times times known multipliers (two steps,
// each class in several kernels with real kernel names) gives those multipliers back.
TEST(TableCalibration, TraceRecoversEachClassMultiplier) {
  auto p = compile("qwen3-9m", 1, 2);
  CostModel cost(h200());
  const ClassSeconds base = step_by_class(*p, cost, 0);
  for (double s : base) ASSERT_GT(s, 0);
  const ClassSeconds truth{1.3, 2.0, 0.8, 1.1};
  const char* names[4][2] = {{"nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "sm90_xmma_gemm_bf16bf16_bf16f32"},
                             {"cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "flash_bwd_kernel"},
                             {"void at::native::vectorized_elementwise_kernel<4>", "RMSNormKernel"},
                             {"void at::native::(anonymous namespace)::multi_tensor_apply_kernel<a", "fused_adam"}};
  json events = json::array();
  const int steps = 2;
  for (int k = 0; k < 4; ++k) {
    const double us = base[static_cast<std::size_t>(k)] * truth[static_cast<std::size_t>(k)] * 1e6 * steps;
    events.push_back({{"ph", "X"}, {"cat", "kernel"}, {"name", names[k][0]}, {"dur", 0.25 * us}});
    events.push_back({{"ph", "X"}, {"cat", "kernel"}, {"name", names[k][1]}, {"dur", 0.75 * us}});
  }
  // Communication kernels and CPU events do not count.
  events.push_back(
      {{"ph", "X"}, {"cat", "kernel"}, {"name", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"}, {"dur", 1e9}});
  events.push_back({{"ph", "X"}, {"cat", "cpu_op"}, {"name", "aten::mm"}, {"dur", 1e9}});
  const TableCalibration c = calibrate_from_trace(*p, cost, json{{"traceEvents", events}}, steps, 0, "t.json");
  for (int k = 0; k < 4; ++k) {
    EXPECT_TRUE(c.observed[static_cast<std::size_t>(k)]);
    // Exact but for the fit's weak pull towards a common multiplier.
    EXPECT_NEAR(c.multiplier[static_cast<std::size_t>(k)], truth[static_cast<std::size_t>(k)], 1e-4) << k;
  }
}

// The derived table the calibration writes: a compute-bound GEMM (8192 x 8192 x 8192, bf16) takes the
// base time less the launch floor, times the GEMM multiplier, plus the floor; AdamW's bandwidth is
// the base's over its multiplier.
TEST(TableCalibration, DerivedTableScalesTheBaseRatesByHand) {
  TableCalibration c;
  c.base = "h200-sxm";
  c.multiplier = {1.25, 3.0, 0.9, 1.5};
  c.observed = {true, true, true, true};
  const json j = c.table_json("calibrated", "test");
  const KernelTable derived = KernelTable::from_json(j, "calibrated.json");
  const auto base = load_kernel_table("h200-sxm");
  core::Kernel g;
  g.kind = core::KernelKind::Gemm;
  g.m = g.n = g.k = 8192;
  g.batch = 1;
  g.flops = 2.0 * 8192 * 8192 * 8192;
  KernelTiming tb{base.get(), RuntimeProfile::Fused, 989.4e12, 4.8e12};
  KernelTiming td{&derived, RuntimeProfile::Fused, 989.4e12, 4.8e12};
  const double floor = base->launch_floor_s;
  EXPECT_NEAR(td.seconds(g) - floor, 1.25 * (tb.seconds(g) - floor), 1e-12);
  EXPECT_NEAR(derived.adamw_bytes_per_s, base->adamw_bytes_per_s / 1.5, 1e-3);
  EXPECT_NEAR(derived.memory.front().bytes_per_s, base->memory.front().bytes_per_s / 0.9, 1e-3);
  EXPECT_EQ(j.at("calibration").at("multipliers").at("attention").get<double>(), 3.0);
}

// Op times measured with every compute class 1.7x the table's rates and AdamW 1.2x, the launch floors as
// the table's (F, B and UPD rows: the
// compute classes are not separable, and equal multipliers explain the rows exactly) are fitted as
// such; the calibrated table then predicts another model's plan at PP 2 with the same multipliers.
TEST(TableCalibration, OpTimesFitAndPredictAnotherPlan) {
  auto p = compile("qwen3-9m", 1, 2);
  CostModel cost(h200());
  const Calibration measured = op_times(*p, cost, [](double launches, const ClassSeconds& s) {
    return launches + 1.7 * (s[0] + s[1] + s[2]) + 1.2 * s[3];
  });
  TableCalibration c = calibrate_from_ops(*p, cost, measured);
  ASSERT_GE(c.observations.size(), 3u);
  // Exact but for the fit's weak pull towards a common multiplier (here towards AdamW's 1.2).
  for (int k = 0; k < 3; ++k) EXPECT_NEAR(c.multiplier[static_cast<std::size_t>(k)], 1.7, 2e-3) << k;
  EXPECT_NEAR(c.multiplier[3], 1.2, 1e-4);
  CostModel calibrated(h200_with_table(c, "table_calibration"));
  auto q = compile("qwen3-1b", 2, 4);
  for (int d = 0; d < 2; ++d) {
    const ClassSeconds b = step_by_class(*q, cost, d), after = step_by_class(*q, calibrated, d);
    // Launch floors are not rates: compare without them, within a small tolerance for the
    // roofline's max(compute, memory) of small kernels.
    const double before = 1.7 * (b[0] + b[1] + b[2]) + 1.2 * b[3], got = after[0] + after[1] + after[2] + after[3];
    EXPECT_NEAR(got / before, 1.0, 0.02) << d;
  }
}

// The calibrated table reproduces the op times it was fitted to: a run measured at 3x the table's
// whole time for each op (launch floors included, as a slower GPU or runtime would show it) is fitted
// exactly (gpt-small at PP 1: three rows, F, B and UPD, four classes), so a cost model on the written table predicts
// each measured op time. The fit used to scale the launch floors with the rates, which the table cannot do: its printed
// "fitted ms" claimed the measured times while the table predicted 8 % less (gpt-small).
TEST(TableCalibration, CalibratedTableReproducesTheMeasuredOpTimes) {
  auto p = compile(std::string(PIPER_SOURCE_DIR) + "/examples/models/gpt-small.json", 1, 2);
  CostModel cost(h200());
  Calibration measured;
  std::vector<std::pair<const core::Op*, double>> ops;
  std::set<std::tuple<int, int, double, std::int64_t>> keys;
  for (const auto& stream : p->plan_for(0).streams)
    for (const auto& op : stream.ops) {
      if (op.kind != core::OpKind::Compute && op.kind != core::OpKind::Update) continue;
      // An entry per (kind, pass, FLOPs, bytes), as `run --calibrate` writes: the first op of each
      // (the second microbatch's B, which adds its gradients into the first's, shares the first's).
      if (!keys.emplace(static_cast<int>(op.kind), static_cast<int>(op.pass), op.flops, op.memory_bytes).second)
        continue;
      const std::optional<double> base = cost.kernel_seconds(*p, 0, op);
      ASSERT_TRUE(base);
      CalibrationEntry e;
      e.kind = op.kind;
      e.pass = op.pass;
      e.flops = op.flops;
      e.memory_bytes = op.memory_bytes;
      e.seconds = 3 * *base;
      measured.entries.push_back(e);
      ops.emplace_back(&op, e.seconds);
    }
  TableCalibration c = calibrate_from_ops(*p, cost, measured);
  CostModel calibrated(h200_with_table(c, "table_calibration_reproduce"));
  for (const auto& [op, want] : ops) {
    const std::optional<double> got = calibrated.kernel_seconds(*p, 0, *op);
    ASSERT_TRUE(got);
    EXPECT_NEAR(*got / want, 1.0, 1e-4) << core::to_string(op->kind) << " " << core::to_string(op->pass);
  }
  // What the table records as each row's fit is what it predicts.
  const json table = c.table_json("t", "test");  // held: a range over a temporary's member dangles
  for (const auto& o : table.at("calibration").at("observations"))
    EXPECT_NEAR(o.at("fitted_s").get<double>() / o.at("measured_s").get<double>(), 1.0, 1e-4) << o.dump();
}

// A kernel trace holds the kernels' durations, not the gaps between them: a trace whose kernels take
// exactly what the h200 table's rates give (a table with the same rates and no launch floor times
// them) calibrates to multipliers of 1. Comparing the durations with predictions that held the
// 2 us floors put every class below 1, the memory-bound one most.
TEST(TableCalibration, TraceOfTheTablesOwnKernelTimesFitsMultipliersOfOne) {
  auto p = compile("qwen3-9m", 1, 2);
  CostModel cost(h200());
  const std::string dir = scratch("table_calibration_nofloor");
  core::write_file_atomically(dir + "/nofloor.json", R"({"base": "h200-sxm", "launch_floor_us": 0})");
  Cluster nofloor = h200();
  for (auto& n : nofloor.nodes) n.gpu.kernel_table = dir + "/nofloor.json";
  CostModel durations(nofloor);
  json events = json::array();
  const KernelTiming t = durations.timing(0);
  const char* names[3] = {"nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "flash_fwd_kernel",
                          "void at::native::vectorized_elementwise_kernel<4>"};
  for (const auto& stream : p->plan_for(0).streams)
    for (const auto& op : stream.ops) {
      if (op.kind == core::OpKind::Update) {
        events.push_back({{"ph", "X"},
                          {"cat", "kernel"},
                          {"name", "multi_tensor_apply_kernel"},
                          {"dur", *durations.kernel_seconds(*p, 0, op) * 1e6}});
        continue;
      }
      if (op.kind != core::OpKind::Compute) continue;
      const auto [first, last] = core::pass_kernel_lists(op.pass);
      // The element-wise traffic beyond the listed kernels (the second microbatch's gradients added
      // into the first's) is one more memory-bound kernel.
      double rest = *durations.kernel_seconds(*p, 0, op);
      for (std::size_t l = first; l <= last; ++l)
        for (const auto& k : p->segments[static_cast<std::size_t>(op.segment)].kernels[l])
          rest -= k.count * t.seconds(k);
      if (rest > 1e-12) events.push_back({{"ph", "X"}, {"cat", "kernel"}, {"name", names[2]}, {"dur", rest * 1e6}});
      for (std::size_t l = first; l <= last; ++l)
        for (const auto& k : p->segments[static_cast<std::size_t>(op.segment)].kernels[l]) {
          const int cls =
              k.kind == core::KernelKind::Gemm                                                                ? 0
              : k.kind == core::KernelKind::AttentionForward || k.kind == core::KernelKind::AttentionBackward ? 1
                                                                                                              : 2;
          const double us = k.count * t.seconds(k) * 1e6;
          if (us > 0) events.push_back({{"ph", "X"}, {"cat", "kernel"}, {"name", names[cls]}, {"dur", us}});
        }
    }
  const TableCalibration c = calibrate_from_trace(*p, cost, json{{"traceEvents", events}}, 1, 0, "t.json");
  for (int k = 0; k < 4; ++k) {
    EXPECT_TRUE(c.observed[static_cast<std::size_t>(k)]) << k;
    EXPECT_NEAR(c.multiplier[static_cast<std::size_t>(k)], 1.0, 1e-3) << to_string(static_cast<KernelClass>(k));
  }
}

// Observations only explained by a negative multiplier: the class is held at the lower bound and flagged.
TEST(TableCalibration, ImpossibleSplitHoldsAClassAtTheBound) {
  TableCalibration c;
  // Row 1: 1 s of GEMM and 1 s of memory measured at 3 s; row 2: 1 s GEMM, 3 s memory measured at
  // 2.5 s. The exact fit is m = -0.25, g = 3.25; with m at 0.5 the least squares in g,
  // ((g - 2.5) / 3)^2 + ((g - 1) / 2.5)^2, is least at g = (2.5 / 9 + 1 / 6.25) / (1 / 9 + 1 / 6.25).
  c.observations.push_back({"a", {1, 0, 1, 0}, 3.0});
  c.observations.push_back({"b", {1, 0, 3, 0}, 2.5});
  fit_multipliers(c);
  EXPECT_TRUE(c.at_bound[2]);
  EXPECT_DOUBLE_EQ(c.multiplier[2], TableCalibration::kMinMultiplier);
  EXPECT_NEAR(c.multiplier[0], (2.5 / 9 + 1 / 6.25) / (1.0 / 9 + 1 / 6.25), 1e-4);
  EXPECT_FALSE(c.observed[1]);
  EXPECT_DOUBLE_EQ(c.multiplier[1], 1.0);
}

TEST(TableCalibration, KernelNamesAreClassified) {
  KernelClass k;
  EXPECT_FALSE(classify_kernel("ncclDevKernel_ReduceScatter", k));
  ASSERT_TRUE(classify_kernel("ampere_bf16_s16816gemm_bf16_128x256_ldg8", k));
  EXPECT_EQ(k, KernelClass::Gemm);
  ASSERT_TRUE(classify_kernel("fmha_cutlassF_bf16_aligned_64x64", k));
  EXPECT_EQ(k, KernelClass::Attention);
  ASSERT_TRUE(classify_kernel("void at::native::reduce_kernel<512, 1>", k));
  EXPECT_EQ(k, KernelClass::Memory);
}

TEST(TableCalibration, CliRefusesBadInputsInOneLine) {
  const std::string dir = scratch("table_calibration_cli");
  core::write_file_atomically(dir + "/empty.json",
                              R"({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "dur": 1}]})");
  const std::string flags = " --model qwen3-9m --pp 1 --microbatches 2 -o " + dir + "/out.json";
  auto run = [&](const std::string& args) {
    const auto r = piper::test::run_cli_in(dir, PIPER_CLI, args);
    return piper::test::Result{r.exit_code, r.err};
  };
  auto r = run("calibrate" + flags);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("give exactly one of --calibration"), std::string::npos) << r.output;
  r = run("calibrate" + flags + " --trace " + dir + "/empty.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("no GPU kernel events"), std::string::npos) << r.output;
  core::write_file_atomically(dir + "/notable.json",
                              R"({"preset": "dgx-h200", "node": {"gpu": {"kernel_table": ""}}})");
  r = run("calibrate" + flags + " --trace " + dir + "/empty.json --cluster " + dir + "/notable.json");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.output.find("has no kernel table to calibrate"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir + "/out.json"));
}

// A trace holding several GPUs' kernels (the profiler of a process driving two GPUs, two ranks' traces
// merged) would add them up as one device's step: refused in one line naming two of them. One GPU's
// kernels, named by "args": {"device"} or by "pid", are taken.
TEST(TableCalibration, TraceOfSeveralGpusRefused) {
  auto p = compile("qwen3-9m", 1, 2);
  CostModel cost(h200());
  auto kernel = [](const json& where) {
    json e = {{"ph", "X"}, {"cat", "kernel"}, {"name", "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"}, {"dur", 100}};
    e.update(where);
    return e;
  };
  const json one = {{"traceEvents", {kernel({{"args", {{"device", 0}}}}), kernel({{"pid", 0}})}}};
  EXPECT_NO_THROW(calibrate_from_trace(*p, cost, one, 1, 0, "t.json"));
  const json two = {{"traceEvents", {kernel({{"args", {{"device", 0}}}}), kernel({{"args", {{"device", 1}}}})}}};
  try {
    calibrate_from_trace(*p, cost, two, 1, 0, "t.json");
    FAIL() << "accepted a trace of two GPUs";
  } catch (const piper::core::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("t.json: kernel events of 2 GPUs (0, 1, ...:"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos);
  }
}

// Measured times far FASTER than the table (op times of 1 ns, a trace's kernels of 1 ns, a trace
// divided by --trace-steps 1e9) were fitted with every multiplier at its lower bound, 0.5, the table
// written and exit 0; the opposite side (1000 times slower) was refused. Both sides are refused, in
// one line naming the file and the measured and predicted times.
TEST(TableCalibration, MeasuredTimesFarFasterThanTheTableAreRefused) {
  auto p = compile("qwen3-9m", 1, 2);
  CostModel cost(h200());
  auto scaled = [&](double factor) {
    return op_times(*p, cost, [factor](double launches, const ClassSeconds& s) {
      return factor * (launches + s[0] + s[1] + s[2] + s[3]);
    });
  };
  auto error_of = [](const auto& f) -> std::string {
    try {
      f();
    } catch (const core::Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_EQ(error_of([&] { calibrate_from_ops(*p, cost, scaled(0.01), "c.json"); }), "(no error)");
  std::string e = error_of([&] { calibrate_from_ops(*p, cost, scaled(1e-4), "c.json"); });
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  EXPECT_EQ(e.rfind("c.json: ", 0), 0u) << e;
  EXPECT_NE(e.find("times faster than the table's"), std::string::npos) << e;
  EXPECT_NE(e.find("a unit slipped"), std::string::npos) << e;
  // A measured time of 0 (or below) is no measurement: named by its entry.
  Calibration zero = scaled(1);
  zero.entries[1].seconds = 0;
  EXPECT_EQ(error_of([&] { calibrate_from_ops(*p, cost, zero, "c.json"); }),
            "c.json: field 'entries[1].seconds': a measured op time must be > 0 s, got 0");

  // A trace: one step's GEMM time at 1e-4 of the table's, or an honest trace over 1e9 "steps".
  const ClassSeconds step = step_by_class(*p, cost, 0);
  auto trace = [](double gemm_us, int kernels) {
    json events = json::array();
    for (int i = 0; i < kernels; ++i)
      events.push_back({{"ph", "X"}, {"cat", "kernel"}, {"name", "nvjet_sm90_gemm"}, {"dur", gemm_us / kernels}});
    return json{{"traceEvents", events}};
  };
  EXPECT_EQ(error_of([&] { calibrate_from_trace(*p, cost, trace(step[0] * 1e6, 4), 1, 0, "t.json"); }), "(no error)");
  e = error_of([&] { calibrate_from_trace(*p, cost, trace(step[0] * 1e2, 4), 1, 0, "t.json"); });
  EXPECT_EQ(e.rfind("t.json: gemm kernels of one step: measured ", 0), 0u) << e;
  EXPECT_NE(e.find("times faster than the table's"), std::string::npos) << e;
  // Every kernel of the class taking 0 us is as far from the table.
  e = error_of([&] { calibrate_from_trace(*p, cost, trace(0, 4), 1, 0, "t.json"); });
  EXPECT_NE(e.find("t.json: gemm kernels of one step: measured 0 ms"), std::string::npos) << e;
  // More steps than the trace holds kernels: a step without a single kernel.
  e = error_of([&] { calibrate_from_trace(*p, cost, trace(step[0] * 1e6 * 5, 4), 5, 0, "t.json"); });
  EXPECT_EQ(e,
            "t.json: --trace-steps 5: more steps than the trace has GPU kernels (4); give the steps the trace covers");
}

// A calibration file of another version was read as version 1.
TEST(TableCalibration, CalibrationFileVersionIsChecked) {
  const json ok = {{"format", "piper-calibration"},
                   {"version", 1},
                   {"entries", {{{"kind", "COMPUTE"}, {"pass", "F"}, {"seconds", 0.01}}}}};
  EXPECT_NO_THROW(Calibration::from_json(ok, "c.json"));
  for (const json& v : {json(99), json("1"), json(1.5)}) {
    json j = ok;
    j["version"] = v;
    try {
      Calibration::from_json(j, "c.json");
      FAIL() << "accepted version " << v.dump();
    } catch (const ClusterError& e) {
      EXPECT_EQ(std::string(e.what()), "c.json: field 'version': unsupported version " + v.dump() + " (expected 1)");
    }
  }
}

// The CLI: a trace far faster than the table exits 2 in one line and writes no table.
TEST(TableCalibration, CliRefusesFarTooFastTimesAndWritesNothing) {
  const std::string dir = scratch("table_calibration_fast");
  core::write_file_atomically(dir + "/fast.json",
                              R"({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "dur": 0.001}]})");
  const auto r = piper::test::run_cli_in(
      dir, PIPER_CLI, "calibrate --model qwen3-9m --pp 1 --microbatches 2 -o " + dir + "/out.json --trace fast.json");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("fast.json: gemm kernels of one step: measured"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("times faster than the table's"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/out.json"));
}
