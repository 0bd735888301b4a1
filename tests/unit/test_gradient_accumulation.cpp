// How gradients join across a step's microbatches, derived by hand for the small GPT of the tensor-parallel
// tests: PyTorch autograd's in-place add, Megatron-LM's fused accumulation into fp32 (or bf16) main
// grads, DeepSpeed's BF16_Optimizer, ZeRO-2/3's per-microbatch reduction; and fp32 main grads' gradient
// buffer, data-parallel reduction and optimizer traffic (docs/cost-model.md, "Gradient accumulation").
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/compiler.hpp"
#include "piper/core/scenario.hpp"
#include "piper/sim/cost_model.hpp"
#include "tp_support.hpp"

using namespace piper::core;
using namespace piper::test::tp;
using nlohmann::json;

// Gradient accumulation in the training precision, by hand for the small GPT on TP 2 x DP 2 over three
// microbatches (P local parameters of one TP rank, as in Fp32MainGradsByHand below). PyTorch autograd
// (the default without fp32 main grads): microbatch 0's backward keeps its new gradients, 1 and 2 add
// into them in place (read 2 + 2, write 2): 6P bytes more each. Megatron-LM's fused accumulation
// into a bf16 main_grad buffer: the weight-gradient GEMMs read it and write it in their epilogue every
// microbatch, 2 bytes per output element more than writing a fresh bf16 result, as traffic of those
// GEMM kernels (their roofline hides it when compute-bound); the Pg parameters of one TP rank's weight
// GEMMs (per block QKV and O, 4h²/2, fc1 and fc2, 2·h·256/2; the head's vocabulary half 256/2·h) so,
// and the rest (embedding, norms, biases) by Megatron's gradient hook main_grad.add_(grad): read 2,
// read and write 2 + 2, 6 bytes each on the backward's element-wise traffic.
// ZeRO-2 reducing every microbatch frees the whole gradients after each reduce-scatter, whose output
// joins the held shard off the compute stream (FSDP's post-backward stream, DeepSpeed's reduction
// stream): nothing on the backward, in bf16 or fp32; reducing once per step keeps them, as ZeRO-1.
// sum over a segment's weight-gradient GEMMs (its BW list) of launches x of(kernel).
template <class Of>
double sum_bw_gemms(const ProgramSegment& seg, Of of) {
  double sum = 0;
  for (const auto& k : seg.kernels[2])
    if (k.kind == KernelKind::Gemm) sum += k.count * static_cast<double>(of(k));
  return sum;
}

// What the weight-gradient GEMMs' epilogues move beyond a plain GEMM's result (Kernel::bytes), summed
// over the segments' BW lists: the fused accumulation's traffic on one device of a single-stage plan.
double bw_gemm_epilogue_bytes(const Program& p) {
  double bytes = 0;
  for (const auto& seg : p.segments) bytes += sum_bw_gemms(seg, [](const Kernel& k) { return k.bytes; });
  return bytes;
}

TEST(TensorParallel, GradientAccumulationInTheTrainingPrecisionByHand) {
  const double P = 256 / 2 * 64 + 64 * 64 + 2 * (2 * 2 * h + (4 * h * h + 4 * h) / 2 + (2 * h * 256 + 256 + h) / 2) +
                   2 * h + 256 / 2 * h;
  StrategyOptions o;
  o.tp = 2;
  o.dp = 2;
  o.microbatches = 3;
  o.zero = 1;
  // The B op's element-wise bytes of each microbatch on device 0.
  auto b_bytes = [&](const ModelConfig& c, const StrategyOptions& opts) {
    const Program p = compile_scenario(tp_scenario(write_spec(c), opts)).result.program;
    std::vector<std::int64_t> out(3, -1);
    for (const auto& st : p.plan_for(0).streams)
      for (const auto& op : st.ops)
        if (op.kind == OpKind::Compute && op.pass == Pass::B && op.microbatch >= 0 && op.microbatch < 3)
          out[static_cast<std::size_t>(op.microbatch)] = op.elementwise_bytes;
    return out;
  };
  ModelConfig c = small_gpt();
  c.name = "tp-gpt-accumulate-auto";
  const auto autograd = b_bytes(c, o);
  ASSERT_GE(autograd[0], 0);
  EXPECT_EQ(autograd[1] - autograd[0], 6 * P);
  EXPECT_EQ(autograd[2] - autograd[0], 6 * P);
  c.name = "tp-gpt-accumulate-fused";
  c.training.grad_accumulation = GradAccumulation::Fused;
  const auto fused = b_bytes(c, o);
  const double Pg = 2 * (4 * h * h / 2 + 2 * h * 256 / 2) + 256 / 2 * h;
  for (std::size_t mb = 0; mb < 3; ++mb) EXPECT_EQ(fused[mb] - autograd[0], 6 * (P - Pg)) << "microbatch " << mb;
  EXPECT_EQ(bw_gemm_epilogue_bytes(compile_scenario(tp_scenario(write_spec(c), o)).result.program), 2 * Pg);
  ModelConfig plain = c;  // autograd's accumulation: plain GEMMs
  plain.name = "tp-gpt-accumulate-auto";
  plain.training.grad_accumulation = GradAccumulation::Auto;
  EXPECT_EQ(bw_gemm_epilogue_bytes(compile_scenario(tp_scenario(write_spec(plain), o)).result.program), 0);
  c.name = "tp-gpt-accumulate-zero2";
  c.training.grad_accumulation = GradAccumulation::Auto;
  StrategyOptions z2 = o;
  z2.zero = 2;  // reduces every microbatch by default
  const auto per_microbatch = b_bytes(c, z2);
  EXPECT_EQ(per_microbatch[0], autograd[0]);
  EXPECT_EQ(per_microbatch[1], autograd[0]);
  EXPECT_EQ(per_microbatch[2], autograd[0]);
  // Reduced in fp32 (FSDP's reduce_dtype, fp32 main grads): no whole fp32 main_grad either; the cast
  // and the shard's accumulation run off the compute stream.
  c.name = "tp-gpt-accumulate-zero2-fp32";
  c.training.fp32_main_grads = true;
  const auto fp32_reduced = b_bytes(c, z2);
  for (std::size_t mb = 0; mb < 3; ++mb) EXPECT_EQ(fp32_reduced[mb], autograd[0]) << "microbatch " << mb;
  c.training.fp32_main_grads = false;
  z2.reduce_every = "step";
  c.name = "tp-gpt-accumulate-zero2-step";
  const auto per_step = b_bytes(c, z2);
  EXPECT_EQ(per_step[1] - per_step[0], 6 * P);
}

// fp32 main grads (Megatron-LM's bf16 recipe), by hand for the small GPT on TP 2 × DP 2: the local
// parameters P of one TP rank are the embedding's vocabulary half and its positions (256/2·64 +
// 64·64), per block the two LayerNorms (2·2h) and half of attention (4h² + 4h) and MLP
// (2·h·ffn + ffn + h), the final LayerNorm (2h) and the head's vocabulary half (256/2·h, not tied
// here). Each microbatch's weight-gradient GEMMs read and write the Pg fp32 main grads of their
// outputs in their epilogue (4 + 4 bytes where a plain GEMM writes 2: 6 Pg bytes of GEMM traffic), the
// other P - Pg parameters join by Megatron's gradient hook (read 2, read and write 4 + 4: 10 bytes each
// of element-wise traffic), the gradient buffer and the data-parallel all-reduce hold 4P bytes instead
// of 2P, and the optimizer step moves 42 bytes per parameter instead of 32 (norm 4 + Adam 4 + 2·12 +
// copy to bf16 4 + 2 + zeroing 4).
TEST(TensorParallel, Fp32MainGradsByHand) {
  const double P = 256 / 2 * 64 + 64 * 64 + 2 * (2 * 2 * h + (4 * h * h + 4 * h) / 2 + (2 * h * 256 + 256 + h) / 2) +
                   2 * h + 256 / 2 * h;
  const double Pg = 2 * (4 * h * h / 2 + 2 * h * 256 / 2) + 256 / 2 * h;
  ModelConfig c = small_gpt();
  StrategyOptions o;
  o.tp = 2;
  o.dp = 2;
  const Program bf16 = compile_scenario(tp_scenario(write_spec(c), o)).result.program;
  c.name = "tp-gpt-fp32-grads";
  c.training.fp32_main_grads = true;
  const Program fp32 = compile_scenario(tp_scenario(write_spec(c), o)).result.program;
  EXPECT_TRUE(fp32.training.fp32_main_grads);
  EXPECT_EQ(Program::from_json(fp32.to_json()), fp32);
  auto find = [](const Program& p, OpKind kind, Pass pass) -> const Op* {
    for (const auto& st : p.plan_for(0).streams)
      for (const auto& op : st.ops)
        if (op.kind == kind && (kind != OpKind::Compute || op.pass == pass)) return &op;
    return nullptr;
  };
  const Op *b16 = find(bf16, OpKind::Compute, Pass::B), *b32 = find(fp32, OpKind::Compute, Pass::B);
  const Op *f16 = find(bf16, OpKind::Compute, Pass::F), *f32 = find(fp32, OpKind::Compute, Pass::F);
  const Op *u16 = find(bf16, OpKind::Update, Pass::None), *u32 = find(fp32, OpKind::Update, Pass::None);
  const Op *r16 = find(bf16, OpKind::AllReduce, Pass::None), *r32 = find(fp32, OpKind::AllReduce, Pass::None);
  ASSERT_TRUE(b16 && b32 && f16 && f32 && u16 && u32 && r16 && r32);
  EXPECT_EQ(b32->elementwise_bytes - b16->elementwise_bytes, 10 * (P - Pg));
  EXPECT_EQ(bw_gemm_epilogue_bytes(fp32), 6 * Pg);
  EXPECT_EQ(bw_gemm_epilogue_bytes(bf16), 0);
  EXPECT_EQ(f32->elementwise_bytes, f16->elementwise_bytes);  // the forward accumulates nothing
  EXPECT_EQ(u16->memory_bytes, 32 * P);
  EXPECT_EQ(u32->memory_bytes, 42 * P);
  EXPECT_EQ(r16->bytes, 2 * P);
  EXPECT_EQ(r32->bytes, 4 * P);
  auto grads = [](const Program& p) {
    std::int64_t bytes = 0;
    for (const auto& buf : p.plan_for(0).buffers)
      if (buf.kind == BufferKind::Gradients) bytes += buf.bytes;
    return bytes;
  };
  EXPECT_EQ(grads(bf16), 2 * P);
  EXPECT_EQ(grads(fp32), 4 * P);
  // The simulator adds the hook's share to the backward as one more element-wise kernel: its traffic
  // at the GPU's HBM bandwidth (the A100 without its kernel table) plus the 2 µs launch floor; the
  // GEMMs' share moves each weight-gradient GEMM's memory term, max(compute, memory) + floor, by hand.
  const piper::sim::Cluster cluster = piper::sim::with_devices(
      piper::sim::cluster_from_text(R"({"preset": "dgx-a100-80g", "node": {"gpu": {"kernel_table": ""}}})", "c.json"),
      4);
  const piper::sim::CostModel cost(cluster);
  double gemm_delta = 0;  // the fp32 plan's BW GEMMs against the same GEMMs without their epilogue bytes
  for (const auto& seg : fp32.segments)
    gemm_delta += sum_bw_gemms(seg, [](const Kernel& k) {
      const double flops = 2.0 * k.m * k.n * k.k * k.batch;
      const double compute = flops / (312e12 * 0.75 * flops / (flops + 2e9));  // the A100's curve
      const double plain = (k.m * k.k + k.k * k.n + k.m * k.n) * k.batch * 2.0 / 2039e9;
      return std::max(compute, plain + static_cast<double>(k.bytes) / 2039e9) - std::max(compute, plain);
    });
  EXPECT_NEAR(cost.compute_seconds(fp32, 0, *b32) - cost.compute_seconds(bf16, 0, *b16),
              10 * (P - Pg) / 2039e9 + 2e-6 + gemm_delta, 1e-12);
  // With the backward split (zero-bubble schedules) the accumulation belongs to BW: 10 bytes per
  // parameter of the stage (its UPD moves 42) that its BW GEMMs do not produce, nothing in BI.
  StrategyOptions zb = o;
  zb.dp = 1;
  zb.pp = 2;
  zb.schedule = "zb-h1";
  zb.microbatches = 2;
  c.name = "tp-gpt-fp32-zb";
  const Program split32 = compile_scenario(tp_scenario(write_spec(c), zb)).result.program;
  c.name = "tp-gpt-bf16-zb";
  c.training.fp32_main_grads = false;
  const Program split16 = compile_scenario(tp_scenario(write_spec(c), zb)).result.program;
  c.training.fp32_main_grads = true;
  const Op *bi32 = find(split32, OpKind::Compute, Pass::BI), *bi16 = find(split16, OpKind::Compute, Pass::BI);
  const Op *bw32 = find(split32, OpKind::Compute, Pass::BW), *bw16 = find(split16, OpKind::Compute, Pass::BW);
  const Op* upd = find(split32, OpKind::Update, Pass::None);
  ASSERT_TRUE(bi32 && bi16 && bw32 && bw16 && upd);
  EXPECT_EQ(bi32->elementwise_bytes, bi16->elementwise_bytes);
  double stage_gemm_params = 0;  // device 0's stage: the segments its BW ops run
  for (const auto& st : split32.plan_for(0).streams)
    for (const auto& op : st.ops)
      if (op.kind == OpKind::Compute && op.pass == Pass::BW && op.microbatch == 0)
        stage_gemm_params += sum_bw_gemms(split32.segments[static_cast<std::size_t>(op.segment)],
                                          [](const Kernel& k) { return k.m * k.n * k.batch; });
  EXPECT_GT(stage_gemm_params, 0);
  EXPECT_EQ(bw32->elementwise_bytes - bw16->elementwise_bytes,
            10 * (static_cast<double>(upd->memory_bytes) / 42 - stage_gemm_params));
  EXPECT_GT(upd->memory_bytes, 0);
  // DeepSpeed's BF16_Optimizer accumulates by separate kernels: zero the bf16 gradient (write 2), then
  // hp.add_(lp.to(fp32)) (read 2, write 4; read 4 + 4, write 4): 20 bytes per parameter, not 8.
  c.name = "tp-gpt-fp32-separate";
  c.training.grad_accumulation = GradAccumulation::Separate;
  const Program sep = compile_scenario(tp_scenario(write_spec(c), o)).result.program;
  EXPECT_EQ(Program::from_json(sep.to_json()), sep);
  EXPECT_EQ(Program::from_json(sep.to_json()).training.grad_accumulation, GradAccumulation::Separate);
  const Op* bsep = find(sep, OpKind::Compute, Pass::B);
  ASSERT_TRUE(bsep);
  EXPECT_EQ(bsep->elementwise_bytes - b16->elementwise_bytes, 20 * P);
  EXPECT_EQ(config_from_spec_json(config_to_spec_json(c), "round trip").training.grad_accumulation,
            GradAccumulation::Separate);
  c.training.grad_accumulation = GradAccumulation::Auto;
  // The spec field round-trips and is type-checked.
  EXPECT_TRUE(config_from_spec_json(config_to_spec_json(c), "round trip").training.fp32_main_grads);
  auto refused = [](const json& bad) {
    try {
      (void)config_from_spec_json(bad, "m.json");
    } catch (const ModelError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  json mode = config_to_spec_json(c);
  mode["training"]["main_grad_accumulation"] = "later";
  EXPECT_NE(refused(mode).find("m.json: field 'training.main_grad_accumulation': expected \"fused\""),
            std::string::npos)
      << refused(mode);
  mode["training"]["main_grad_accumulation"] = "fused";  // also names how bf16 gradients accumulate
  mode["training"].erase("fp32_main_grads");
  EXPECT_EQ(refused(mode), "accepted");
  EXPECT_EQ(config_from_spec_json(mode, "m.json").training.grad_accumulation, GradAccumulation::Fused);
  json spec = config_to_spec_json(c);
  spec["training"]["fp32_main_grads"] = "yes";
  try {
    (void)config_from_spec_json(spec, "m.json");
    ADD_FAILURE() << "fp32_main_grads \"yes\" accepted";
  } catch (const ModelError& e) {
    EXPECT_NE(std::string(e.what()).find("m.json: field 'training.fp32_main_grads'"), std::string::npos) << e.what();
  }
}
