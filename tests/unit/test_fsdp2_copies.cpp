// PyTorch FSDP2's copies around its ZeRO-3 collectives (replicate's "collective_copies": "fsdp2",
// --collective-copies fsdp2; docs/cost-model.md "Copies around the ZeRO-3 collectives"), derived by
// hand for a tiny model from pytorch/pytorch torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
// at 8fc2039decebd92b15b38296df8bf9aa13275be0 (torch/distributed/_composable/fsdp/ in late-2024 PyTorch):
//  * foreach_all_gather_copy_out waits for the all-gather on the current (compute) stream, then one
//    torch.split_with_sizes_copy reads the gathered flat output and writes every parameter's unsharded
//    tensor: 2 x 2 bytes a bf16 parameter, before the first use of each gather (F, and the backward);
//  * foreach_reduce's foreach_reduce_scatter_copy_in (torch._chunk_cat, one kernel) on the current stream
//    reads the unsharded bf16 gradients and writes the reduce-scatter input in the reduction dtype:
//    2 + 2 bytes a parameter (2 + 4 with fp32 reduction), after the weight gradients.
// Each is one launch of the table's "copy" class: bytes / rate + the launch floor. The rate is read here
// from the H200 table's raw "copy" measurements (sim/data/kernels-h200-sxm.json), not from the code under
// test: every copy below moves fewer bytes than the smallest measurement, where the curve is constant.
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "piper/core/kernels.hpp"
#include "piper/core/model.hpp"
#include "piper/core/program.hpp"
#include "piper/core/program_builder.hpp"
#include "piper/core/scenario.hpp"
#include "piper/sim/cluster.hpp"
#include "piper/sim/cost_model.hpp"
#include "expect.hpp"

using namespace piper;
using piper::test::error_of;
using piper::test::expect_rel;

namespace {

// hidden h = 256, 4 heads of 64 (q, k and v 256 wide), SwiGLU ffn f = 512, RMSNorm, untied head.
// A block's parameters: attention 4·h² = 262,144; MLP 3·h·f = 393,216; two norms 2·h = 512.
constexpr double kBlockParams = 4.0 * 256 * 256 + 3.0 * 256 * 512 + 2.0 * 256;  // 655,872

std::string tiny_model(bool fp32_main_grads) {
  nlohmann::json spec = {{"name", fp32_main_grads ? "fsdp2-tiny-fp32-grads" : "fsdp2-tiny"},
                         {"vocab", 1024},
                         {"hidden", 256},
                         {"layers", 2},
                         {"heads", 4},
                         {"kv_heads", 4},
                         {"head_dim", 64},
                         {"ffn", 512},
                         {"activation", "swiglu"},
                         {"norm", "rmsnorm"},
                         {"tie_embeddings", false},
                         {"training", {{"seq_len", 128}, {"micro_batch_size", 2}, {"precision", "bf16"}}}};
  if (fp32_main_grads) spec["training"]["fp32_main_grads"] = true;
  const std::string path =
      ::testing::TempDir() + "/" + spec["name"].get<std::string>() + "-" + std::to_string(::getpid()) + ".json";
  core::write_file_atomically(path, spec.dump());
  return path;
}

core::CompiledScenario compile(const std::string& model, const std::string& copies, int zero = 3) {
  core::Scenario sc;
  sc.model = model;
  sc.strategy.dp = 2;
  sc.strategy.zero = zero;
  sc.strategy.microbatches = 2;
  sc.strategy.collective_copies = copies;
  return core::compile_scenario(sc);
}

// The H200 table's smallest measurement of a memory-bound kernel class ("copy"; "add", as Megatron's
// fp32 main-grad accumulation is costed): its bytes (gbps x s) and bytes/s.
std::pair<double, double> smallest_measurement(const std::string& kernel) {
  std::ifstream in(std::string(PIPER_SOURCE_DIR) + "/sim/data/kernels-h200-sxm.json");
  const nlohmann::json t = nlohmann::json::parse(in);
  double bytes = 0, rate = 0;
  for (const auto& m : t["memory_bound"])
    if (m["kernel"] == kernel) {
      const double b = m["gbps"].get<double>() * 1e9 * m["s"].get<double>();
      if (rate == 0 || b < bytes) bytes = b, rate = m["gbps"].get<double>() * 1e9;
    }
  return {bytes, rate};
}

constexpr double kLaunchFloor = 2e-6;  // the table names no launch_floor_us: the 2 µs default

// Compute ops of device 0 by label, so that the two programs' ops pair up.
std::vector<const core::Op*> compute_ops(const core::Program& p) {
  std::vector<const core::Op*> out;
  for (const auto& s : p.plan_for(0).streams)
    for (const auto& op : s.ops)
      if (op.kind == core::OpKind::Compute) out.push_back(&op);
  return out;
}

int copy_kernels(const core::Program& p) {
  int n = 0;
  for (const auto& seg : p.segments)
    for (const auto& list : seg.kernels)
      for (const auto& k : list) n += k.kind == core::KernelKind::Copy;
  return n;
}

}  // namespace

// bf16 gradients reduced in bf16: F of a block gains one copy-out of 4·P bytes, its B (fused BI + BW)
// that copy-out again (the backward's gather) and the reduce-scatter copy-in of 4·P bytes.
TEST(Fsdp2Copies, CostsTheCopyOutAndTheReduceScatterCopyInByHand) {
  const std::string model = tiny_model(false);
  const auto none = compile(model, "");
  const auto fsdp2 = compile(model, "fsdp2");
  const core::Program &a = none.result.program, &b = fsdp2.result.program;
  const auto [measured_bytes, copy_rate] = smallest_measurement("copy");
  ASSERT_GT(copy_rate, 0);
  const double P = kBlockParams;
  ASSERT_LT(6 * P, measured_bytes) << "the copies must lie below the smallest measurement (constant rate)";
  const double copy_out = 2 * 2 * P / copy_rate + kLaunchFloor;      // read + write bf16
  const double rs_copy_in = (2 + 2) * P / copy_rate + kLaunchFloor;  // read bf16 gradient, write bf16 input

  const sim::Cluster cluster = sim::load_cluster("dgx-h200");
  const sim::CostModel cost(cluster);
  const auto ops_a = compute_ops(a), ops_b = compute_ops(b);
  ASSERT_EQ(ops_a.size(), ops_b.size());
  int blocks_f = 0, blocks_b = 0;
  for (std::size_t i = 0; i < ops_a.size(); ++i) {
    const core::Op &x = *ops_a[i], &y = *ops_b[i];
    ASSERT_EQ(x.label, y.label);
    const auto& seg = b.segments.at(static_cast<std::size_t>(y.segment));
    const double added = cost.compute_seconds(b, 0, y) - cost.compute_seconds(a, 0, x);
    if (static_cast<double>(seg.params) != P) continue;  // embedding and head: their own P, checked below
    if (y.pass == core::Pass::F) {
      expect_rel(added, copy_out, 1e-6);
      ++blocks_f;
    } else {
      ASSERT_EQ(y.pass, core::Pass::B);
      expect_rel(added, copy_out + rs_copy_in, 1e-6);
      ++blocks_b;
    }
  }
  // Two blocks, two microbatches: four F and four B of blocks.
  EXPECT_EQ(blocks_f, 4);
  EXPECT_EQ(blocks_b, 4);
  // Every segment with parameters lists the copies (F: copy-out; BI: copy-out; BW: copy-in), sized by
  // its own parameters; the embedding (1024 x 256) and the head with its norm (1024 x 256 + 256) too.
  std::vector<double> params;
  for (const auto& seg : b.segments) {
    if (seg.params == 0) continue;
    params.push_back(static_cast<double>(seg.params));
    const auto copies = [](const std::vector<core::Kernel>& list) {
      std::vector<std::int64_t> out;
      for (const auto& k : list)
        if (k.kind == core::KernelKind::Copy) out.push_back(k.bytes);
      return out;
    };
    EXPECT_EQ(copies(seg.kernels[0]), std::vector<std::int64_t>{4 * seg.params});
    EXPECT_EQ(copies(seg.kernels[1]), std::vector<std::int64_t>{4 * seg.params});
    EXPECT_EQ(copies(seg.kernels[2]), std::vector<std::int64_t>{4 * seg.params});
  }
  std::sort(params.begin(), params.end());
  EXPECT_EQ(params, (std::vector<double>{1024.0 * 256, 1024.0 * 256 + 256, P, P}));
  // The default runtime (DeepSpeed-style ZeRO-3, FSDP1, Piper's backends) lists no copies.
  EXPECT_EQ(copy_kernels(a), 0);
  EXPECT_EQ(copy_kernels(b), 3 * 4);
  // The copies travel in the plan: JSON round-trips them.
  EXPECT_EQ(core::Program::from_json(b.to_json()), b);
}

// With fp32 gradient reduction (training.fp32_main_grads, TorchTitan's mixed_precision_reduce): the
// copy-in writes fp32, 2 + 4 bytes a parameter. Neither plan charges Megatron-LM's accumulation into a
// whole fp32 main_grad: ZeRO-3 reducing every microbatch keeps none (lowering's grad_accumulation_bytes).
TEST(Fsdp2Copies, Fp32ReductionCastsInTheCopyIn) {
  const std::string model = tiny_model(true);
  const auto none = compile(model, "");
  const auto fsdp2 = compile(model, "fsdp2");
  const core::Program &a = none.result.program, &b = fsdp2.result.program;
  const auto [measured_bytes, copy_rate] = smallest_measurement("copy");
  const double P = kBlockParams;
  ASSERT_LT(6 * P, measured_bytes);
  const double copy_out = 2 * 2 * P / copy_rate + kLaunchFloor;
  const double rs_copy_in = (2 + 4) * P / copy_rate + kLaunchFloor;

  const sim::CostModel cost(sim::load_cluster("dgx-h200"));
  const auto ops_a = compute_ops(a), ops_b = compute_ops(b);
  ASSERT_EQ(ops_a.size(), ops_b.size());
  int checked = 0;
  for (std::size_t i = 0; i < ops_a.size(); ++i) {
    const core::Op &x = *ops_a[i], &y = *ops_b[i];
    if (static_cast<double>(b.segments.at(static_cast<std::size_t>(y.segment)).params) != P) continue;
    const double added = cost.compute_seconds(b, 0, y) - cost.compute_seconds(a, 0, x);
    if (y.pass == core::Pass::F) {
      expect_rel(added, copy_out, 1e-6);
    } else {
      // The flash-attention block has no other element-wise traffic on its op.
      EXPECT_EQ(x.elementwise_bytes, 0);
      EXPECT_EQ(y.elementwise_bytes, 0);
      expect_rel(added, copy_out + rs_copy_in, 1e-6);
    }
    ++checked;
  }
  EXPECT_EQ(checked, 8);
}

// The setting is explicit and checked: ZeRO-3 only, reduce-every microbatch only; the directive field
// likewise, and the builder writes it.
TEST(Fsdp2Copies, IsRefusedWhereItDoesNotApply) {
  const std::string model = tiny_model(false);
  EXPECT_NE(error_of([&] { compile(model, "fsdp2", 2); }).find("--collective-copies applies only with --zero 3"),
            std::string::npos);
  EXPECT_NE(error_of([&] { compile(model, "deepspeed"); }).find("collective-copies"), std::string::npos);
  core::Scenario sc;
  sc.model = model;
  sc.strategy.dp = 2;
  sc.strategy.zero = 3;
  sc.strategy.reduce_every = "step";
  sc.strategy.collective_copies = "fsdp2";
  EXPECT_NE(error_of([&] { core::compile_scenario(sc); }).find("--reduce-every microbatch only"), std::string::npos);

  core::ReplicateArgs args;
  args.shard_grads = args.shard_params = true;
  args.collective_copies = "fsdp2";
  core::ProgramBuilder builder;
  builder.replicate(core::Filter{}, {0, 1}, args);
  EXPECT_EQ(builder.to_json()[0]["collective_copies"], "fsdp2");
  const core::DirectiveProgram built = builder.build();  // the directive below refers into it
  const auto& r = std::get<core::ReplicateDirective>(built.directives.at(0));
  EXPECT_TRUE(r.fsdp2_copies);
  const std::string zero2 = R"([{"op": "replicate", "filter": {}, "devices": [0, 1], "shard_grads": true,
                                 "collective_copies": "fsdp2"}])";
  EXPECT_NE(error_of([&] {
              core::parse_directives(nlohmann::json::parse(zero2));
            }).find("\"fsdp2\" applies only with shard_params"),
            std::string::npos);
  const std::string per_step = R"([{"op": "replicate", "filter": {}, "devices": [0, 1], "shard_grads": true,
                                    "shard_params": true, "reduce_every": "step", "collective_copies": "fsdp2"}])";
  EXPECT_NE(error_of([&] {
              core::parse_directives(nlohmann::json::parse(per_step));
            }).find("reduce_every \"microbatch\" only"),
            std::string::npos);
}
