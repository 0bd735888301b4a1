// Reliability, input side, the eleventh and twelfth probes (docs/reliability.md): wrong answers with
// exit 0 from valid but unusual settings, and the newer surfaces (context and expert tensor
// parallelism, TP overlap, plans, checkpoints, clusters, scenarios, outputs). Each case runs the real
// `piper` binary (the HostileInput fixture).
#include <cstddef>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "hostile_input.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using piper::test::CliResult;
using piper::test::HostileInput;
using piper::test::kSource;
using piper::test::read_file;

namespace {

// ---- Round 11: wrong answers with exit 0 (docs/reliability.md, "eleventh probe") -----------------

// A directive program that placed a region on two devices with no replicate directive selecting it
// compiled, simulated (no gradient reduction, so a faster step) and trained with exit 0: each device
// updated its own copy from its half of the batch, and the losses left the reference's at step 2
// (4.478950 against 4.464804 for runtime-tiny-dense, PP 2 x DP 2). Every published and generated
// program replicates each region over the devices it is placed on.
TEST_F(HostileInput, RegionPlacedOnSeveralDevicesWithoutReplicateRefused) {
  const CliResult program = run("directives --model '" + piper::test::kTiny + "' --pp 2 --dp 2 --microbatches 2");
  ASSERT_EQ(program.exit_code, 0) << program.err;
  json d = json::parse(program.out);
  input("all.json", d.dump());
  json without = json::array();
  for (const auto& x : d)
    if (!(x.at("op") == "replicate" && x.at("filter") == json{{"PP", 1}})) without.push_back(x);
  ASSERT_EQ(without.size() + 1, d.size());
  input("norep.json", without.dump());
  for (const std::string& cmd :
       {"compile --model '" + piper::test::kTiny + "' --directives norep.json -o plan.json",
        "simulate --model '" + piper::test::kTiny + "' --directives norep.json --engine analytic",
        "run --model '" + piper::test::kTiny + "' --directives norep.json --virtual-devices"})
    expect_one_line(run(cmd), {"norep.json", "directive 1", "field 'devices'", "2 devices [1,3]",
                               "no replicate directive selects", "would train apart"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
  // With every replicate the same program compiles; so does a TP group of the placement's size
  // without one (a single replica: nothing to reduce).
  EXPECT_EQ(run("compile --model '" + piper::test::kTiny + "' --directives all.json -o plan.json").exit_code, 0);
  input("tp.json", R"([{"op": "place", "filter": {"PP": 0}, "devices": [0, 1]},
                       {"op": "tensor_parallel", "filter": {"PP": 0}, "degree": 2}])");
  EXPECT_EQ(run("compile --model '" + piper::test::kTiny + "' --directives tp.json -o plan.json").exit_code, 0);
}

// --pp-ranges (or --stages) with fewer or more regions than --pp x --virtual asks for: the regions
// set the shape and --virtual was dropped without a word. `--pp 2 --virtual 2 --schedule
// interleaved-1f1b --pp-ranges 0 1` (qwen3-9m) simulated plain 1F1B over 2 regions, 1.359 ms a step as
// with --virtual 1, against 1.016 ms for the 4 regions --virtual 2 places; the V families already
// refused the same mismatch ("needs 4 PP regions for --pp 2").
TEST_F(HostileInput, PpRangesDisagreeingWithVirtualRefused) {
  const std::string base = "simulate --model qwen3-9m --engine analytic --pp 2 --microbatches 4 ";
  expect_one_line(run(base + "--schedule interleaved-1f1b --virtual 2 --pp-ranges 0 1"),
                  {"--pp-ranges 0,1", "2 PP regions", "--pp 2 --virtual 2", "4"});
  expect_one_line(run(base + "--schedule interleaved-1f1b --virtual 2 --stages 3"),
                  {"--stages 3", "3 PP regions", "--pp 2 --virtual 2", "4"});
  expect_one_line(run("compile --model qwen3-1b --seq-len 256 --pp 2 --microbatches 4 --schedule zb-h1 --virtual 2 "
                      "--pp-ranges 0 3 6 9 12 -o plan.json"),
                  {"--pp-ranges 0,3,6,9,12", "5 PP regions", "--pp 2 --virtual 2"});
  EXPECT_FALSE(fs::exists(dir_ / "plan.json"));
  // Ranges of the asked count, and ranges without --virtual (uneven chunks: a shape of its own), run.
  EXPECT_EQ(run(base + "--schedule interleaved-1f1b --virtual 2 --pp-ranges 0 1 2 3").exit_code, 0);
  EXPECT_EQ(run(base + "--schedule interleaved-1f1b --stages 3").exit_code, 0);
  EXPECT_EQ(run(base + "--schedule dualpipev --pp-ranges 0 1 2 3").exit_code, 0);
}

// ---- Round 12: newer surfaces (docs/reliability.md, "twelfth probe") ------------------------------

// A plan whose "microbatches" was edited past the microbatches its compute ops run (2 to 4) verified
// ok and trained with exit 0: the virtual-device run took 2 microbatches and divided the loss by 4
// (2.262867 at step 2 against the reference's 4.443177 on 4 microbatches). So did one whose ops were
// edited to run microbatch 0 twice and 1 never.
TEST_F(HostileInput, PlanMicrobatchesThatNoComputeOpRunsRefused) {
  const CliResult made =
      run("compile --model '" + piper::test::kTiny + "' --pp 2 --dp 2 --microbatches 2 -o plan.json");
  ASSERT_EQ(made.exit_code, 0) << made.err;
  json plan = json::parse(read_file(dir_ / "plan.json"));
  plan["microbatches"] = 4;
  input("mb4.json", plan.dump());
  for (const std::string cmd : {"verify mb4.json", "simulate --plan mb4.json --engine analytic",
                                "run --plan mb4.json --virtual-devices --steps 1 --report r.json"})
    expect_one_line(run(cmd),
                    {"mb4.json", "field 'microbatches'", "4, but the compute ops of plans[0] run no microbatch 2"});
  EXPECT_FALSE(fs::exists(dir_ / "r.json"));
  // One device's ops edited to run microbatch 0 twice and 1 never (it trained on another batch).
  plan = json::parse(read_file(dir_ / "plan.json"));
  for (auto& stream : plan.at("plans").at(1).at("streams"))
    for (auto& op : stream.at("ops"))
      if (op.value("microbatch", -1) == 1) op["microbatch"] = 0;
  input("twice.json", plan.dump());
  expect_one_line(run("verify twice.json"),
                  {"twice.json", "field 'microbatches'", "2, but the compute ops of plans[1] run no microbatch 1"});
  // The plan as compiled, and plans of every microbatch count a family writes, still load.
  EXPECT_EQ(run("verify plan.json").exit_code, 0);
  for (const std::string flags :
       {"--schedule dualpipe --pp 2 --microbatches 4", "--schedule zb-v --pp 2 --microbatches 4",
        "--schedule interleaved-1f1b --pp 2 --virtual 2 --microbatches 4"}) {
    ASSERT_EQ(run("compile --model '" + piper::test::kTiny + "' " + flags + " -o p.json").exit_code, 0) << flags;
    EXPECT_EQ(run("verify p.json").exit_code, 0) << flags;
  }
}

// A checkpoint's model fingerprint hashed the model spec with its training shape, so a resume under
// another micro-batch size of the same global batch (2 x 2 sequences saved, 1 x 4 resumed) was
// refused as "their specs differ", and one under another sequence length did not say so. The shape is
// checked apart, with its own messages, as docs/reliability.md says.
TEST_F(HostileInput, ResumeUnderAnotherMicroBatchSizeOfTheSameGlobalBatch) {
  const std::string model = "--model '" + piper::test::kTiny + "' --seed 3 ";
  const CliResult saved = run("run " + model + "--pp 2 --microbatches 2 --virtual-devices --steps 2 --save ck");
  ASSERT_EQ(saved.exit_code, 0) << saved.err;
  const CliResult resumed = run("run " + model +
                                "--pp 2 --micro-batch-size 1 --microbatches 4 --virtual-devices --steps 4 --resume ck "
                                "--report r.json");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  const CliResult whole = run("run " + model + "--microbatches 2 --reference --steps 4 --report ref.json");
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const json losses = json::parse(read_file(dir_ / "r.json")).at("losses");
  const json reference = json::parse(read_file(dir_ / "ref.json")).at("losses");
  ASSERT_EQ(losses.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i)
    EXPECT_NEAR(losses[i].get<double>(), reference[i + 2].get<double>(), 1e-5 * reference[i + 2].get<double>());
  expect_one_line(run("run " + model + "--pp 2 --seq-len 8 --microbatches 2 --virtual-devices --steps 4 --resume ck"),
                  {"ck: checkpoint trained on sequences of 16 tokens, the plan uses 8"});
  expect_one_line(run("run " + model + "--pp 2 --microbatches 4 --virtual-devices --steps 4 --resume ck"),
                  {"ck: checkpoint took 4 sequences per step, the plan takes 8"});
}

// Cluster fields that had no effect. "attention_kernel" on a cluster whose GPUs have no kernel table
// was ignored, any name accepted: llama3-8b at TP 8 simulated in 75.693 ms with "fa2" and with "zz"
// alike. An unknown name on a table was refused naming "cluster", not the file.
TEST_F(HostileInput, ClusterFieldsThatHadNoEffectRefused) {
  input("none.json",
        R"({"preset": "dgx-h200", "nodes": 1, "node": {"gpu": {"preset": "h200-sxm", "kernel_table": ""}},
            "attention_kernel": "fa2"})");
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --cluster none.json"),
                  {"none.json: field 'attention_kernel'", "'fa2' scales a kernel table's attention rates",
                   "no GPU of the cluster has a kernel table"});
  input("fa9.json", R"({"preset": "dgx-h200", "nodes": 1, "attention_kernel": "fa9"})");
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --cluster fa9.json"),
                  {"fa9.json: field 'attention_kernel'", "kernel table 'h200-sxm' has no attention kernel 'fa9'"});
  input("fa2.json", R"({"preset": "dgx-h200", "nodes": 1, "attention_kernel": "fa2"})");
  EXPECT_EQ(run("simulate --model qwen3-9m --engine analytic --cluster fa2.json").exit_code, 0);
  // A network's "oversubscription" thins a fat-tree's leaf links; a rail-optimized network (the presets')
  // has none, and the field was ignored: qwen3-1b DP 16 on two nodes, 51.427 ms at 1 and at 4.
  input("rail.json", R"({"preset": "dgx-h200", "nodes": 2, "network": {"oversubscription": 4}})");
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --dp 16 --cluster rail.json"),
                  {"rail.json: field 'network.oversubscription'", "the topology is rail-optimized", "ignored"});
  input("fat.json",
        R"({"preset": "dgx-h200", "nodes": 2, "network": {"topology": "fat-tree", "oversubscription": 4}})");
  EXPECT_EQ(run("simulate --model qwen3-9m --engine analytic --dp 16 --cluster fat.json").exit_code, 0);
  // A scenario file's misspelt "engine" was reported as the flag "--engine 'analytc'", which was not
  // given (its "cluster" already named the file's field).
  input("s.json", R"({"model": "qwen3-9m", "engine": "analytc"})");
  expect_one_line(run("simulate --scenario s.json"),
                  {"s.json: field 'engine': unknown engine 'analytc' (expected one of: analytic, simgrid)"});
  EXPECT_EQ(run("simulate --scenario s.json --engine analytic").exit_code, 0);  // the flag wins
}

// --tp-comm-overlap without --sequence-parallel (or a tensor_parallel directive's "comm_overlap"
// without "sequence_parallel") was costed as overlapped: llama3-8b at TP 8, 63.111 ms against 83.607
// without it, where Megatron-LM asserts sequence parallelism for the overlap and TorchTitan's async TP
// pipelines SP's collectives only.
TEST_F(HostileInput, TpCommOverlapWithoutSequenceParallelRefused) {
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --tp 2 --tp-comm-overlap"),
                  {"--tp-comm-overlap needs --sequence-parallel"});
  input("d.json", R"([{"op": "place", "filter": {"PP": 0}, "devices": [0, 1]},
                      {"op": "tensor_parallel", "filter": {"PP": 0}, "degree": 2, "comm_overlap": true}])");
  expect_one_line(run("compile --model qwen3-9m --directives d.json -o p.json"),
                  {"d.json", "directive 1 field 'comm_overlap'", "needs \"sequence_parallel\": true"});
  EXPECT_FALSE(fs::exists(dir_ / "p.json"));
  EXPECT_EQ(run("simulate --model qwen3-9m --engine analytic --tp 2 --sequence-parallel --tp-comm-overlap").exit_code,
            0);
}

// Errors that named the wrong cause or no place. `--v-head auto` where the family refuses the shape
// whatever the ends (DualPipeV with 1 microbatch over PP 2) said "no placement of model 'qwen3-9m' fits
// --pp 2 (too few blocks)": its 4 blocks fit.
TEST_F(HostileInput, VHeadAutoNamesTheFamilysRefusal) {
  for (const std::string cmd : {"directives --model qwen3-9m", "simulate --model qwen3-9m --engine analytic"}) {
    const CliResult r = run(cmd + " --schedule dualpipev --pp 2 --v-head auto");
    expect_one_line(r, {"--v-head/--v-embedding auto", "dualpipev: --microbatches 1 must be >= 2 x --pp = 4"});
    EXPECT_EQ(r.err.find("too few blocks"), std::string::npos) << r.err;
  }
  EXPECT_EQ(run("directives --model qwen3-9m --schedule dualpipev --pp 2 --microbatches 4 --v-head auto").exit_code, 0);
  // --recompute-first N past a region's blocks said "the filter selects only 1 blocks": not which
  // region (qwen3-9m's second PP region holds 1 block beside the LM head, the balancer's choice).
  expect_one_line(run("simulate --model qwen3-9m --engine analytic --pp 2 --microbatches 2 --recompute full "
                      "--recompute-first 3"),
                  {"--recompute full --recompute-first 3", "the filter {\"PP\":1} selects only 1 block"});
}

// `--cp 2 --etp 2`, which the help's rule admits (--ep x --etp divides --dp x --cp x --tp), failed in
// the cp-groups pass as "--cp 2: 2 x TP 2 does not divide the 2 devices segment 1 is placed on": a TP
// degree never given. A segment's CP groups sit beside its TP group, so ETP x CP must divide a
// region's devices.
TEST_F(HostileInput, ContextParallelWithExpertTensorParallelNamesBothFlags) {
  const std::string moe = "--model '" + kSource + "/tests/data/runtime-tiny-moe.json' ";
  expect_one_line(run("compile " + moe + "--cp 2 --etp 2 -o p.json"),
                  {"--etp 2 with --cp 2", "--etp x --cp = 4 must divide the 2 devices of a pipeline region"});
  EXPECT_FALSE(fs::exists(dir_ / "p.json"));
  // Where ETP x CP divides the region's devices: DP or TP of 2, or DualPipe's mirrored copies.
  for (const std::string flags :
       {"--cp 2 --etp 2 --dp 2", "--cp 2 --etp 2 --tp 2", "--cp 2 --etp 2 --schedule dualpipe --pp 2 --microbatches 4"})
    EXPECT_EQ(run("compile " + moe + flags + " -o p.json").exit_code, 0) << flags;
}

// Flags that were taken without effect or with a wrong count: `calibrate --trace-steps 3` beside
// --calibration (op times are per step; the count was ignored), `simulate --show-devices -1`
// ("... (3 more devices)" under a 2-device table).
TEST_F(HostileInput, CalibrateTraceStepsWithoutATraceAndNegativeShowDevicesRefused) {
  input("cal.json",
        R"({"format": "piper-calibration", "entries": [{"kind": "COMPUTE", "pass": "F", "seconds": 0.001},
            {"kind": "COMPUTE", "pass": "B", "seconds": 0.002}, {"kind": "UPD", "seconds": 0.001}]})");
  expect_one_line(run("calibrate --model qwen3-9m --calibration cal.json --trace-steps 3 -o t.json"),
                  {"--trace-steps requires --trace"});
  EXPECT_FALSE(fs::exists(dir_ / "t.json"));
  expect_one_line(run("simulate --model qwen3-9m --pp 2 --engine analytic --show-devices -1"), {"--show-devices"});
  EXPECT_EQ(run("calibrate --model qwen3-9m --calibration cal.json -o t.json").exit_code, 0);
}

// `--dp-shard N` with `--cp C` grouped N consecutive replicas of the region, which are the CP ranks of
// one data-parallel replica: `--cp 2 --dp 2 --zero 3 --dp-shard 2` (one shard group holding both DP
// replicas, i.e. plain ZeRO-3) sharded each parameter over the CP pair and replicated it over DP, 1/2
// of the state a device where plain ZeRO-3 over DP x CP keeps 1/4. A group is N replicas with their CP
// ranks, as TorchTitan's dp_shard x cp mesh shards.
TEST_F(HostileInput, HsdpShardGroupsHoldTheirReplicasContextParallelRanks) {
  auto parameters = [&](const std::string& flags) {
    const CliResult r = run("simulate --model qwen3-9m --engine analytic --zero 3 " + flags + " --report r.json");
    EXPECT_EQ(r.exit_code, 0) << flags << ": " << r.err;
    return json::parse(read_file(dir_ / "r.json")).at("per_device").at(0).at("peak_bytes_by_kind").at("parameters");
  };
  EXPECT_EQ(parameters("--cp 2 --dp 2 --dp-shard 2"), parameters("--cp 2 --dp 2"));
  EXPECT_EQ(parameters("--cp 2 --dp 4 --dp-shard 2"), parameters("--dp 4"));  // 4 shards: 2 replicas x 2 CP ranks
  // The shard groups are the CP ranks of two DP replicas: devices 0-3 and 4-7.
  ASSERT_EQ(run("compile --model qwen3-9m --zero 3 --cp 2 --dp 4 --dp-shard 2 -o p.json").exit_code, 0);
  const json plan = json::parse(read_file(dir_ / "p.json"));
  bool found = false;
  for (const auto& f : plan.at("families"))
    if (f.at("purpose") == "dp-shard") {
      found = true;
      EXPECT_EQ(f.at("group_size"), 4);
      EXPECT_EQ(plan.at("device_sets").at(f.at("devices").get<std::size_t>()), json::parse("[0, 1, 2, 3, 4, 5, 6, 7]"));
    }
  EXPECT_TRUE(found);
  // It trains as the single-process reference does.
  const std::string moe = "--model '" + kSource + "/tests/data/runtime-tiny-moe.json' --microbatches 2 --steps 2 ";
  const CliResult hsdp = run("run " + moe + "--cp 2 --dp 4 --zero 3 --dp-shard 2 --virtual-devices --report a.json");
  ASSERT_EQ(hsdp.exit_code, 0) << hsdp.err;
  ASSERT_EQ(run("run " + moe + "--dp 4 --reference --report b.json").exit_code, 0);
  const json a = json::parse(read_file(dir_ / "a.json")).at("losses"),
             b = json::parse(read_file(dir_ / "b.json")).at("losses");
  for (std::size_t i = 0; i < 2; ++i) EXPECT_NEAR(a[i].get<double>(), b[i].get<double>(), 1e-5 * b[i].get<double>());
}

// Outputs taken and never written, exit 0. `run --save-scenario` and `calibrate --save-scenario`
// (only compile and simulate wrote it), and `run --reference --trace`. A run's scenario holds the training flags given
// ("train"), so that `run --scenario` repeats it; a run that fails writes none.
TEST_F(HostileInput, OutputsTakenButNeverWrittenAreWrittenOrRefused) {
  const std::string tiny = "--model '" + piper::test::kTiny + "' ";
  const CliResult ran = run("run " + tiny +
                            "--pp 2 --microbatches 2 --virtual-devices --steps 3 --lr 0.01 --warmup-steps 1 --seed 9 "
                            "--save-scenario s.json --report a.json");
  ASSERT_EQ(ran.exit_code, 0) << ran.err;
  const json saved = json::parse(read_file(dir_ / "s.json"));
  EXPECT_EQ(saved.at("train"), json::parse(R"({"lr": 0.01, "seed": 9, "steps": 3, "warmup_steps": 1})"));
  const CliResult again = run("run --scenario s.json --virtual-devices --report b.json");
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(json::parse(read_file(dir_ / "a.json")).at("losses"), json::parse(read_file(dir_ / "b.json")).at("losses"));
  // `run --reference --trace t.json` took the trace and wrote none (the reference runs no plan devices).
  expect_one_line(run("run " + tiny + "--reference --steps 1 --trace t.json --report r.json"),
                  {"--trace records the plan's devices' timeline", "not --reference"});
  EXPECT_FALSE(fs::exists(dir_ / "t.json"));
  EXPECT_FALSE(fs::exists(dir_ / "r.json"));
  // Resumed at --steps equal to the checkpoint's step, no step runs: --calibrate and --trace were
  // taken and never written (a parameter dump still is; --report: the fifteenth probe's
  // ResumedRunWithNoStepLeftWritesNoReport).
  ASSERT_EQ(run("run " + tiny + "--pp 2 --microbatches 2 --virtual-devices --steps 2 --save ck").exit_code, 0);
  expect_one_line(
      run("run " + tiny + "--pp 2 --microbatches 2 --virtual-devices --steps 2 --resume ck --calibrate cal.json"),
      {"--calibrate: --steps 2 is the step of the checkpoint ck: no step would run", "--steps 3 or more"});
  EXPECT_FALSE(fs::exists(dir_ / "cal.json"));
  EXPECT_EQ(run("run " + tiny + "--pp 2 --microbatches 2 --virtual-devices --steps 2 --resume ck --dump-params p.bin")
                .exit_code,
            0);
  // `compile --dump-dir d` without --dump-after dumps nothing: the folder was taken, never made.
  expect_one_line(run("compile --model qwen3-9m --dump-dir d -o p.json"), {"--dump-dir requires --dump-after"});
  EXPECT_FALSE(fs::exists(dir_ / "p.json"));
  // A run that diverges (AdamW's eps 0 over a zero gradient) writes no scenario.
  EXPECT_EQ(run("run " + tiny + "--virtual-devices --steps 2 --adam-eps 0 --save-scenario bad.json").exit_code, 2);
  EXPECT_FALSE(fs::exists(dir_ / "bad.json"));
  input("cal.json",
        R"({"format": "piper-calibration", "entries": [{"kind": "COMPUTE", "pass": "F", "seconds": 0.001},
            {"kind": "COMPUTE", "pass": "B", "seconds": 0.002}, {"kind": "UPD", "seconds": 0.001}]})");
  const CliResult calibrated =
      run("calibrate --model qwen3-9m --pp 2 --microbatches 2 --calibration cal.json -o t.json --save-scenario c.json");
  ASSERT_EQ(calibrated.exit_code, 0) << calibrated.err;
  const json scenario = json::parse(read_file(dir_ / "c.json"));
  EXPECT_EQ(scenario.at("model"), "qwen3-9m");
  EXPECT_EQ(scenario.at("cluster"), "dgx-h200");
  EXPECT_EQ(scenario.at("strategy").at("pp"), 2);
}

// `schedule export-csv --directives d.json --ranks 4` (or --microbatches, --virtual, --zb-memory-limit)
// exported the program's own schedule: the flag ignored, exit 0.
TEST_F(HostileInput, ScheduleExportShapeFlagsBesideADirectiveProgramRefused) {
  const CliResult program = run("directives --model qwen3-9m --pp 2 --microbatches 2");
  ASSERT_EQ(program.exit_code, 0) << program.err;
  input("d.json", program.out);
  for (const std::string flag : {"--ranks 4", "--microbatches 8", "--virtual 2", "--zb-memory-limit 2p"}) {
    const std::string name = flag.substr(0, flag.find(' '));
    expect_one_line(run("schedule export-csv --directives d.json " + flag + " -o s.csv"),
                    {name + " applies to a schedule name", "d.json fixes the schedule"});
  }
  EXPECT_FALSE(fs::exists(dir_ / "s.csv"));
  EXPECT_EQ(run("schedule export-csv --directives d.json -o s.csv").exit_code, 0);
}

}  // namespace
