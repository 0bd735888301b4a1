// Reliability, input side, the thirteenth probe (docs/reliability.md, "thirteenth probe"): the twelfth
// probe's leftovers (a plan's model_spec edited after compiling, a scenario file's strategy errors
// naming flags) and what the probe found in sweeps and hand-edited plans. Each case runs the real
// `piper` binary (the HostileInput fixture). The Chakra export on shared GPUs is tested in
// tests/unit/test_chakra.cpp, the Chrome trace overlay in tests/unit/test_gui.cpp.
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "hostile_input.hpp"

namespace fs = std::filesystem;
using nlohmann::json;
using piper::test::CliResult;
using piper::test::HostileInput;
using piper::test::kTiny;
using piper::test::read_file;

namespace {

// A plan whose "model_spec" was edited after compiling ran with the ops compiled from the old spec:
// `simulate --plan` costed the old model, and `run` built the new one from the spec (a vocab of 128
// trained with the embedding ops sized for 64). The spec must still give every segment the layers and
// parameters the plan records.
TEST_F(HostileInput, PlanModelSpecEditedAfterCompilingRefused) {
  const json plan = tiny_plan();  // PP 2 x DP 2: segments [0, 9) and [9, 19) of runtime-tiny-dense
  auto edited = [&](const std::string& name, const std::string& key, const json& value) {
    json p = plan;
    p["model_spec"][key] = value;
    input(name, p.dump());
  };
  edited("vocab.json", "vocab", 128);  // the embedding: 64 x 32 = 2,048 parameters become 4,096
  for (const std::string cmd :
       {"verify vocab.json", "simulate --plan vocab.json --engine analytic",
        "run --plan vocab.json --virtual-devices --steps 1 --report r.json", "export-chakra vocab.json -o ch"})
    expect_one_line(run(cmd), {"vocab.json: plan: field 'model_spec'", "layers [0, 9] 22688 parameters",
                               "segments[0] was compiled with 20640", "edited after compiling"});
  EXPECT_FALSE(fs::exists(dir_ / "r.json"));
  EXPECT_FALSE(fs::exists(dir_ / "ch"));
  edited("kv.json", "kv_heads", 4);  // k and v projections twice as wide: both segments' blocks
  expect_one_line(run("verify kv.json"), {"field 'model_spec'", "segments[0] was compiled with 20640"});
  // One block more (23 layers: the embedding, 4 per block, norm and head): layers 17 and 18 are a
  // block's, not the final norm and head; one block fewer (15 layers) ends before segments[1] does.
  edited("more.json", "layers", 5);
  expect_one_line(run("verify more.json"), {"field 'model_spec'", "segments[1] was compiled with 20672"});
  edited("fewer.json", "layers", 3);
  expect_one_line(run("verify fewer.json"),
                  {"field 'model_spec'", "has 15 layers, but segments[1] was compiled for layers [9, 19]"});
  // The training shape, which the compiler writes into the plan and its model_spec alike: one edited
  // alone changed what `run` trains (seq_len) or the step time but no buffer or kernel (precision);
  // both edited, the kernels still say what the ops were compiled for.
  json p = plan;
  p["training"]["seq_len"] = 8;
  input("seq.json", p.dump());
  expect_one_line(run("verify seq.json"),
                  {"field 'training.seq_len': 8, but model_spec.training.seq_len is 16", "edited after compiling"});
  p = plan;
  p["training"]["precision"] = "bf16";
  input("prec.json", p.dump());
  expect_one_line(run("simulate --plan prec.json --engine analytic"),
                  {"field 'training.precision': bf16, but model_spec.training.precision is fp32"});
  p["model_spec"]["training"]["precision"] = "bf16";
  input("both.json", p.dump());
  expect_one_line(run("simulate --plan both.json --engine analytic"),
                  {"both.json: plan: field 'segments[0].kernels.F[", "a fp32 GEMM, but the plan trains in bf16"});
  // The plan as compiled loads, and so does an edit that changes no layer (the name).
  EXPECT_EQ(run("verify a.json").exit_code, 0);
  edited("named.json", "name", "renamed");
  EXPECT_EQ(run("verify named.json").exit_code, 0);
  // Plans of every layout still load: TP, EP with chunked all-to-alls, tied embeddings, V placements.
  for (const std::string& flags :
       {"--model '" + kTiny + "' --tp 2 --sequence-parallel",
        "--model '" + piper::test::kSource + "/tests/data/runtime-tiny-moe.json' --ep 2 --dp 2 --a2a-chunks 2",
        "--model '" + piper::test::kSource + "/tests/data/runtime-tiny-gpt.json' --pp 2 --microbatches 2",
        std::string("--model qwen3-9m --pp 2 --schedule dualpipev --microbatches 4 --zero 3 --dp 2")}) {
    ASSERT_EQ(run("compile " + flags + " -o p.json").exit_code, 0) << flags;
    EXPECT_EQ(run("verify p.json").exit_code, 0) << flags;
  }
}

// A scenario file's strategy errors named flags the user never gave ("--tp 3: 3 does not divide the 8
// heads"): now the file and its field, as its other errors do. The same strategy from flags still
// names the flags.
TEST_F(HostileInput, ScenarioStrategyErrorsNameTheFileAndField) {
  auto refused = [&](const std::string& scenario, const std::vector<std::string>& fragments) {
    input("s.json", scenario);
    for (const std::string cmd :
         {"compile --scenario s.json -o p.json", "simulate --scenario s.json --engine analytic"}) {
      const CliResult r = run(cmd);
      expect_one_line(r, fragments);
      EXPECT_EQ(r.err.find("--"), std::string::npos) << "a flag named in " << r.err;
    }
    EXPECT_FALSE(fs::exists(dir_ / "p.json"));
  };
  refused(R"({"model": "qwen3-9m", "strategy": {"tp": 3}})",
          {"s.json: field 'strategy.tp': 3 does not divide the 8 heads"});
  refused(R"({"model": "qwen3-9m", "strategy": {"tp": 2, "tp_comm_overlap": true}})",
          {"s.json: field 'strategy.tp_comm_overlap': needs 'strategy.sequence_parallel'"});
  refused(R"({"model": "qwen3-9m", "strategy": {"ep": 3}})",
          {"s.json: field 'strategy.ep': does not divide the 8 experts"});
  refused(R"({"model": "qwen3-9m", "strategy": {"pp": 2, "schedule": "dualpipev"}})",
          {"s.json: field 'strategy.microbatches': dualpipev: 'strategy.microbatches' 1 must be >= 2 x 'strategy.pp'"});
  refused(R"({"model": "qwen3-9m", "pp_ranges": [0, 1], "strategy": {"pp": 4}})",
          {"s.json: field 'pp_ranges': 2 PP regions for the 4 pipeline ranks of 'strategy.pp' 4"});
  refused(R"({"model": "qwen3-9m", "strategy": {"dp": 2, "zero": 3, "dp_shard": 3}})",
          {"s.json: field 'strategy.dp_shard': 3 must be at least 2 and divide 'strategy.dp' 2"});
  // From flags, the flags.
  expect_one_line(run("compile --model qwen3-9m --tp 3 -o p.json"), {"--tp 3: 3 does not divide the 8 heads"});
}

// A sweep spec's missing cluster file named the flag "--cluster", which `piper sweep` does not take.
TEST_F(HostileInput, SweepClusterNamedAsTheSpecsField) {
  input("sw.json", R"({"model": "qwen3-9m", "engine": "analytic", "pp": [2], "cluster": "nosuch.json"})");
  const CliResult r = run("sweep sw.json -o out.csv");
  expect_one_line(r, {"sw.json: field 'cluster': 'nosuch.json': neither a preset"});
  EXPECT_EQ(r.err.find("--cluster"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(dir_ / "out.csv"));
}

// A plan's kernel sizes read fractions as whole numbers: "m": 0.5 became a GEMM of 0 rows, costed
// as free, with exit 0.
TEST_F(HostileInput, PlanKernelSizesMustBeWholeNumbers) {
  json plan = tiny_plan();
  json& gemm = plan["segments"][1]["kernels"]["F"];
  std::size_t i = 0;
  while (i < gemm.size() && gemm[i]["kind"] != "gemm") ++i;
  ASSERT_LT(i, gemm.size());
  gemm[i]["m"] = 0.5;
  input("half.json", plan.dump());
  expect_one_line(run("simulate --plan half.json --engine analytic"),
                  {"half.json: plan: field 'segments[1].kernels.F[" + std::to_string(i) + "].m'",
                   "must be a whole number, got 0.5"});
}

}  // namespace

namespace {

// One of Piper's inputs given where another goes (a plan to --scenario or --model, a scenario to
// --plan, a model spec to --scenario): the reader named its first unknown key ("field 'device_sets':
// unknown field (expected one of: model, seq_len, ...)"), not the mix-up.
TEST_F(HostileInput, AnInputOfAnotherKindIsNamed) {
  (void)tiny_plan();  // a.json
  input("s.json", R"({"model": "qwen3-9m", "strategy": {"pp": 2}})");
  expect_one_line(run("simulate --scenario a.json"),
                  {"a.json: this is a plan (\"format\": \"piper-program\"), not a scenario", "simulate --plan"});
  expect_one_line(run("compile --model a.json -o p.json"), {"a.json: this is a plan", "not a model spec"});
  expect_one_line(
      run("simulate --plan s.json"),
      {"s.json: plan: this is a scenario (a \"model\" with its settings), not a plan: give it to --scenario"});
  expect_one_line(run("verify s.json"), {"this is a scenario", "not a plan"});
  expect_one_line(run("compile --scenario '" + kTiny + "' -o p.json"),
                  {"this is a model spec (\"vocab\", \"hidden\", \"layers\"), not a scenario: give it to --model"});
  expect_one_line(run("verify '" + piper::test::kSource + "/tests/data/hf/llama3-8b.json'"),
                  {"this is a Hugging Face config (\"model_type\"), not a plan: give it to --model"});
  EXPECT_FALSE(fs::exists(dir_ / "p.json"));
  // Each where it goes.
  EXPECT_EQ(run("compile --scenario s.json -o p.json").exit_code, 0);
  EXPECT_EQ(run("verify p.json").exit_code, 0);
}

}  // namespace
