// The CUDA backend end to end on virtual devices (one process, one GPU, loopback transport) against
// the host single-process reference: compiled plans of 1F1B, ZB-H1, DualPipeV, ZeRO-3 and EP on the
// tiny MoE model train 3 steps; fp32 losses must agree within 1e-5 relative and parameters within
// 1e-4 (the host equivalence tests' bounds, justified in tests/unit/test_runtime.cpp: same optimizer
// settings, so a rounding-level gradient difference stays far below the bound while a wrong gradient
// moves a parameter by O(lr) per step). bf16 storage: losses within 5e-3 relative (bf16 keeps 8
// significand bits, so each stored activation and weight is off by up to 2^-9 = 2e-3 relative; with
// fp32 accumulation the per-token losses' errors are of that order and average out over the batch).
// bf16 parameters are only printed: their storage rounding (up to 2^-9 * |p|, 3.4e-3 for the
// embedding's |p| <= sqrt(3)) is as large as 3 AdamW steps of lr 3e-3, so an absolute bound could not
// tell a wrong update from rounding. The bf16 bound is a first estimate that a GPU run must confirm.
// Also: SM partitioning (same bounds), checkpoints resumed on the GPU and on the host, --calibrate.
// Without a GPU: exit 77 (CTest skip).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <string>

#include <unistd.h>

#include <gtest/gtest.h>

#include "data_root.hpp"
#include "piper/core/scenario.hpp"
#include "piper/runtime/cuda/cuda_trainer.hpp"
#include "piper/runtime/cuda/device.hpp"
#include "piper/runtime/cuda/kernels.hpp"
#include "piper/runtime/trainer.hpp"

namespace fs = std::filesystem;
namespace core = piper::core;
namespace rt = piper::runtime;
namespace cu = piper::runtime::cuda;

namespace {

const std::string kModel = piper::test::data_root() + "/tests/data/runtime-tiny-moe.json";
constexpr double kLossRelTol = 1e-5, kParamAbsTol = 1e-4;
constexpr double kBf16LossRelTol = 5e-3;

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("piper-cuda-test-" + std::to_string(getpid())) / name;
  fs::create_directories(d);
  return d;
}

const std::string kGpt = piper::test::data_root() + "/tests/data/runtime-tiny-gpt.json";
const std::string kGptUntied = piper::test::data_root() + "/tests/data/runtime-tiny-gpt-untied.json";
// Dense, 4 heads over 2 KV heads with qk-norm: TP 2 splits heads, KV heads, FFN and vocabulary.
const std::string kDense = piper::test::data_root() + "/tests/data/runtime-tiny-dense.json";

// head_dim 64 and 100-token sequences: bf16 runs take the fast attention path (flash_attention.cu).
const std::string kHd64Model = piper::test::data_root() + "/tests/data/runtime-small-hd64.json";

core::Program compile(int pp, int dp, int ep, int zero, int microbatches, const std::string& schedule,
                      const std::string& model = kModel,
                      const std::function<void(core::StrategyOptions&)>& more = nullptr) {
  core::Scenario s;
  s.model = model;
  s.strategy.pp = pp, s.strategy.dp = dp, s.strategy.ep = ep, s.strategy.zero = zero;
  s.strategy.microbatches = microbatches, s.strategy.schedule = schedule;
  if (more) more(s.strategy);
  return core::compile_scenario(s).result.program;
}

rt::TrainOptions options(const fs::path& dump) {
  rt::TrainOptions o;
  o.steps = 3;
  o.seed = 7;
  o.adamw.lr = 3e-3f;
  o.adamw.eps = 1e-6f;
  o.dump_params_path = dump.string();
  o.print = false;
  return o;
}

// `adjust` changes both runs' options alike (loss scaling, say).
void expect_equivalent(const std::string& name, const core::Program& program, cu::DType dt = cu::DType::F32,
                       const std::function<void(rt::TrainOptions&)>& adjust = {}) {
  const fs::path dir = temp_dir(name);
  rt::TrainOptions ref_options = options(dir / "ref.bin"), cuda_options = options(dir / "cuda.bin");
  if (adjust) adjust(ref_options), adjust(cuda_options);
  const auto ref = rt::train_reference(program, ref_options);
  cu::CudaRunOptions c;
  c.virtual_devices = true;
  c.dtype = dt;
  const auto run = cu::train_cuda(program, cuda_options, c);
  EXPECT_EQ(run.skipped_steps, ref.skipped_steps) << name;
  EXPECT_EQ(run.loss_scales, ref.loss_scales) << name;
  const bool f32 = dt == cu::DType::F32;
  ASSERT_EQ(ref.losses.size(), 3u);
  ASSERT_EQ(run.losses.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(run.losses[i], ref.losses[i], (f32 ? kLossRelTol : kBf16LossRelTol) * std::abs(ref.losses[i]))
        << name << " step " << i + 1;
  const double diff = rt::max_param_difference((dir / "ref.bin").string(), (dir / "cuda.bin").string());
  if (f32) {
    EXPECT_LT(diff, kParamAbsTol) << name;
  }
  std::printf("[%s] %s: losses %.7f %.7f %.7f (reference %.7f %.7f %.7f), max |param diff| %.3g\n", name.c_str(),
              cu::dtype_name(dt), run.losses[0], run.losses[1], run.losses[2], ref.losses[0], ref.losses[1],
              ref.losses[2], diff);
}

}  // namespace

TEST(CudaBackendEquivalence, OneFOneB_PP2xDP2) { expect_equivalent("1f1b", compile(2, 2, 1, 0, 4, "1f1b")); }
TEST(CudaBackendEquivalence, ZBH1_PP2) { expect_equivalent("zbh1", compile(2, 1, 1, 0, 4, "zb-h1")); }
TEST(CudaBackendEquivalence, DualPipeV_PP2xDP2xEP2) {
  expect_equivalent("dualpipev", compile(2, 2, 2, 0, 4, "dualpipev"));
}
TEST(CudaBackendEquivalence, Zero3_PP2xDP2xEP2) { expect_equivalent("zero3", compile(2, 2, 2, 3, 4, "1f1b")); }
TEST(CudaBackendEquivalence, EP2_Zero2_PP2xDP2) { expect_equivalent("ep-zero2", compile(2, 2, 2, 2, 4, "1f1b")); }
// HSDP: ZeRO-3 shards over groups of 2 of the 4 data-parallel replicas (reduce-scatter in the group,
// all-reduce across the groups, gathers in the group), with EP 2 on the experts.
TEST(CudaBackendEquivalence, Hsdp_Zero3_PP2xDP4xEP2) {
  expect_equivalent("hsdp-zero3", compile(2, 4, 2, 3, 4, "1f1b", kModel, [](auto& o) { o.dp_shard = 2; }));
}
// The ZeRO-2/3 cases above reduce after every microbatch (the default, DeepSpeed's and FSDP2's); this
// one once per step, keeping whole gradients (FSDP's no_sync).
TEST(CudaBackendEquivalence, Zero2_ReduceOncePerStep_PP2xDP2) {
  expect_equivalent("zero2-step", compile(2, 2, 1, 2, 4, "1f1b", kModel, [](auto& o) { o.reduce_every = "step"; }));
}
// GPT-style layers: LayerNorm, GELU, linear biases, learned positions and a head tied to the embedding.
// PP 2 puts the embedding and the head on different stages (the head keeps a copy of the table, and the
// two gradients are summed over the tied-embedding family); PP 1 keeps them in one segment; the untied
// model has its own head matrix. With gradient clipping the tied copy must not count twice in the norm.
TEST(CudaBackendEquivalence, Gpt_Tied_PP2xDP2) { expect_equivalent("gpt-tied", compile(2, 2, 1, 0, 4, "1f1b", kGpt)); }
TEST(CudaBackendEquivalence, Gpt_Tied_OneSegment_DP2) {
  expect_equivalent("gpt-tied-pp1", compile(1, 2, 1, 0, 2, "1f1b", kGpt));
}
TEST(CudaBackendEquivalence, Gpt_Untied_PP2xDP2) {
  expect_equivalent("gpt-untied", compile(2, 2, 1, 0, 4, "1f1b", kGptUntied));
}
TEST(CudaBackendEquivalence, Gpt_Tied_ClipGrad_Zero1_PP2xDP2) {
  expect_equivalent("gpt-tied-clip", compile(2, 2, 1, 1, 4, "1f1b", kGpt, [](auto& o) { o.clip_grad = 0.05; }));
}
// V placements hold the embedding and the tied head on one device, which sums the two gradients after
// its last backward of the step and then releases the reductions it deferred for that sum. ZeRO-2/3
// reduce-scatter the embedding's segment after every microbatch, and in the plan the early ones do not
// wait for that last backward: on the GPU they must still start after it and the sum (a review found
// them reading and zeroing the gradients while both could still be running on the compute stream).
TEST(CudaBackendEquivalence, Gpt_Tied_DualPipeV_Zero2_PP2xDP2) {
  expect_equivalent("gpt-tied-dualpipev-zero2", compile(2, 2, 1, 2, 4, "dualpipev", kGpt));
}
TEST(CudaBackendEquivalence, Gpt_Tied_ZBV_Zero3_PP2xDP2) {
  expect_equivalent("gpt-tied-zbv-zero3", compile(2, 2, 1, 3, 4, "zb-v", kGpt));
}
// Recomputation reruns what it dropped: full keeps each segment's input and reruns its forward (the
// head without counting the loss again) before the backward, selective drops each attention core's
// output and statistics and rebuilds them at the start of the backward; the values are unchanged.
TEST(CudaBackendEquivalence, FullRecompute_PP2xDP2xEP2) {
  expect_equivalent("full", compile(2, 2, 2, 0, 4, "1f1b", kModel, [](auto& o) { o.recompute = "full"; }));
}
TEST(CudaBackendEquivalence, SelectiveRecompute_ZBH1_PP2xDP2) {
  expect_equivalent("selective", compile(2, 2, 1, 0, 4, "zb-h1", kModel, [](auto& o) { o.recompute = "selective"; }));
}
TEST(CudaBackendEquivalence, Gpt_FullRecomputeEverySecondBlock_PP2xDP2) {
  expect_equivalent("gpt-full-every2", compile(2, 2, 1, 0, 4, "1f1b", kGpt, [](auto& o) {
                      o.recompute = "full";
                      o.recompute_every = 2;
                    }));
}
// fp16 storage trains only with loss scaling (its gradients would flush to zero): dynamic scaling from
// 2^16 with clipping that does not bind, within the bf16 bounds of the fp32 reference (fp16 keeps 3
// more mantissa bits than bf16), with the reference's scales and no skipped step.
TEST(CudaBackendEquivalence, Fp16_DynamicLossScale_OneFOneB_PP2xDP2) {
  expect_equivalent("fp16-1f1b", compile(2, 2, 1, 0, 4, "1f1b", kModel, [](auto& o) { o.clip_grad = 1e6; }),
                    cu::DType::F16, [](rt::TrainOptions& o) {
                      o.adamw.loss_scaling.mode = rt::host::LossScaleMode::Dynamic;
                      o.adamw.loss_scaling.initial = 65536;
                    });
}
// Scales beyond float's range (2^130, 2^129, 2^128) overflow every device's gradients whatever their
// values: the GPU skips all three steps as the reference does (gradients and ZeRO chunks zeroed, no
// update kernel), halving the scale, and the parameters stay the initial ones.
TEST(CudaBackendEquivalence, LossScaleOverflowSkipsTheUpdates_Zero1_PP2xDP2) {
  expect_equivalent("overflow-zero1", compile(2, 2, 1, 1, 4, "1f1b", kModel, [](auto& o) { o.clip_grad = 1.0; }),
                    cu::DType::F32, [](rt::TrainOptions& o) {
                      o.adamw.loss_scaling.mode = rt::host::LossScaleMode::Dynamic;
                      o.adamw.loss_scaling.initial = std::ldexp(1.0, 130);
                    });
}
// Tensor parallelism (Megatron's layout, no SP): column-parallel q/k/v and gate/up, row-parallel
// output and down projections summed over the TP group inside the op, a vocab-parallel embedding and
// head (the cross-entropy's max and sums gathered over the group), qk-norm weight gradients summed;
// the TP-replicated tensors count once in the clipping norm.
TEST(CudaBackendEquivalence, TensorParallel_TP2xPP2) {
  expect_equivalent("tp2-pp2", compile(2, 1, 1, 0, 4, "1f1b", kDense, [](auto& o) { o.tp = 2; }));
}
TEST(CudaBackendEquivalence, TensorParallel_TP2xDP2_Zero1_ClipGrad) {
  expect_equivalent("tp2-dp2-zero1-clip", compile(1, 2, 1, 1, 2, "1f1b", kDense, [](auto& o) {
                      o.tp = 2;
                      o.clip_grad = 0.05;
                    }));
}
// Sequence parallelism: the residual stream holds this rank's token rows; gathers before the
// column-parallel GEMMs, reduce-scatters after the row-parallel ones, norm weight gradients summed.
// Routed experts without TP on a TP 2 stage without SP: both TP ranks run every token through the
// experts, and each adds half its expert gradient (the host's token copies; a review found the CUDA
// model adding the whole of it, twice the host's gradient after the expert-DP sum).
TEST(CudaBackendEquivalence, TensorParallel_TP2_MoE_ExpertsOnBothTpRanks) {
  expect_equivalent("tp2-moe", compile(1, 1, 1, 0, 2, "1f1b", kModel, [](auto& o) { o.tp = 2; }));
}
TEST(CudaBackendEquivalence, SequenceParallel_TP2xPP2_SelectiveRecompute) {
  expect_equivalent("sp-tp2", compile(2, 1, 1, 0, 4, "1f1b", kDense, [](auto& o) {
                      o.tp = 2;
                      o.sequence_parallel = true;
                      o.recompute = "selective";
                    }));
}
TEST(CudaBackendEquivalence, Gpt_Tied_SequenceParallel_TP2xDP2) {
  expect_equivalent("gpt-sp-tp2", compile(1, 2, 1, 0, 2, "1f1b", kGpt, [](auto& o) {
                      o.tp = 2;
                      o.sequence_parallel = true;
                    }));
}
TEST(CudaBackendEquivalence, Gpt_Tied_TensorParallel_TP2xPP2) {
  expect_equivalent("gpt-tied-tp2", compile(2, 1, 1, 0, 4, "1f1b", kGpt, [](auto& o) { o.tp = 2; }));
}
TEST(CudaBackendEquivalence, Bf16_TensorParallel_TP2xPP2) {
  expect_equivalent("bf16-tp2", compile(2, 1, 1, 0, 4, "1f1b", kDense, [](auto& o) { o.tp = 2; }), cu::DType::BF16);
}
// Context parallelism (the host's RuntimeEquivalence.CP* cases): each CP rank holds the load-balanced
// chunks rank and 2·cp-1-rank of every sequence; RoPE at those positions, K/V gathered over the CP group,
// the reference kernels masking by global position, dK/dV reduce-scattered back to their owners, the
// gradients reduced over DP x CP.
TEST(CudaBackendEquivalence, ContextParallel_CP2) {
  expect_equivalent("cp2", compile(1, 1, 1, 0, 2, "1f1b", kDense, [](auto& o) { o.cp = 2; }));
}
TEST(CudaBackendEquivalence, ContextParallel_CP4_SelectiveRecompute) {
  expect_equivalent("cp4-selective", compile(1, 1, 1, 0, 2, "1f1b", kDense, [](auto& o) {
                      o.cp = 4, o.cp_all_gather = true;
                      o.recompute = "selective";
                    }));
}
TEST(CudaBackendEquivalence, ContextParallel_CP2xPP2_FullRecompute) {
  expect_equivalent("cp2-pp2-full", compile(2, 1, 1, 0, 4, "1f1b", kDense, [](auto& o) {
                      o.cp = 2;
                      o.recompute = "full";
                    }));
}
TEST(CudaBackendEquivalence, ContextParallel_CP2xDP2_Zero1_ClipGrad) {
  expect_equivalent("cp2-dp2-zero1-clip", compile(1, 2, 1, 1, 2, "1f1b", kDense, [](auto& o) {
                      o.cp = 2;
                      o.clip_grad = 0.05;
                    }));
}
TEST(CudaBackendEquivalence, ContextParallel_CP2xEP2_MoE) {
  expect_equivalent("cp2-ep2", compile(1, 1, 2, 0, 2, "1f1b", kModel, [](auto& o) { o.cp = 2; }));
}
TEST(CudaBackendEquivalence, ContextParallel_TP2xCP2_SequenceParallel) {
  expect_equivalent("tp2-cp2-sp", compile(1, 1, 1, 0, 2, "1f1b", kDense, [](auto& o) {
                      o.tp = 2, o.cp = 2;
                      o.sequence_parallel = true;
                    }));
}
// Expert tensor parallelism (the host's RuntimeEquivalence.*ETP2* cases): each ETP rank holds 1/2 of
// every local expert's FFN; the routed rows (and their experts) are gathered over the ETP group before
// fc1 and the partial sums reduce-scattered after fc2 and after the input gradient's GEMMs.
TEST(CudaBackendEquivalence, ExpertTensorParallel_TP2_SP_ETP2) {
  expect_equivalent("tp2-sp-etp2", compile(1, 1, 1, 0, 2, "1f1b", kModel, [](auto& o) {
                      o.tp = 2, o.etp = 2;
                      o.sequence_parallel = true;
                    }));
}
TEST(CudaBackendEquivalence, ExpertTensorParallel_TP2_ETP2_WithoutSp_ClipGrad) {
  expect_equivalent("tp2-etp2-clip", compile(1, 1, 1, 0, 2, "1f1b", kModel, [](auto& o) {
                      o.tp = 2, o.etp = 2;
                      o.clip_grad = 0.05;
                    }));
}
TEST(CudaBackendEquivalence, ExpertTensorParallel_TP2_SP_DP2xEP2xETP2) {
  expect_equivalent("tp2-sp-ep2-etp2", compile(1, 2, 2, 0, 2, "1f1b", kModel, [](auto& o) {
                      o.tp = 2, o.etp = 2;
                      o.sequence_parallel = true;
                    }));
}
TEST(CudaBackendEquivalence, ExpertTensorParallel_DP2xETP2_Zero1) {
  expect_equivalent("dp2-etp2-zero1", compile(1, 2, 1, 1, 2, "1f1b", kModel, [](auto& o) { o.etp = 2; }));
}
TEST(CudaBackendEquivalence, Bf16_ExpertTensorParallel_TP2_SP_ETP2) {
  expect_equivalent("bf16-tp2-sp-etp2",
                    compile(1, 1, 1, 0, 2, "1f1b", kModel,
                            [](auto& o) {
                              o.tp = 2, o.etp = 2;
                              o.sequence_parallel = true;
                            }),
                    cu::DType::BF16);
}
TEST(CudaBackendEquivalence, Bf16_ContextParallel_CP2xPP2) {
  expect_equivalent("bf16-cp2-pp2", compile(2, 1, 1, 0, 4, "1f1b", kDense, [](auto& o) { o.cp = 2; }), cu::DType::BF16);
}
TEST(CudaBackendEquivalence, Bf16_OneFOneB_PP2xDP2) {
  expect_equivalent("bf16-1f1b", compile(2, 2, 1, 0, 4, "1f1b"), cu::DType::BF16);
}
// A fast attention path end to end (forward, BI with its statistics, then BW) in bf16, against the
// host reference with the bf16 loss bound: the path PIPER_ATTENTION names (scripts/gpu-check.sh runs it
// with cudnn and with flash), else the default choice, which must be a fast path at this shape.
// PIPER_ATTENTION=reference runs the same plan on the reference kernels.
TEST(CudaBackendEquivalence, Bf16_FlashAttention_PP2xDP2) {
  const core::Program p = compile(2, 2, 1, 0, 4, "1f1b", kHd64Model);
  const cu::AttentionDims dims{200, 100, 4, 2, 64};
  const cu::AttentionPath path = cu::choose_attention(cu::DType::BF16, dims);
  std::printf("attention path: %s\n", cu::attention_path_name(path));
  if (!cu::attention_reference_forced()) {
    EXPECT_NE(path, cu::AttentionPath::Reference);
  }
  expect_equivalent("bf16-flash-1f1b", p, cu::DType::BF16);
  // Selective recomputation on the fast path: its output and log-sum-exp are rebuilt in the backward.
  expect_equivalent("bf16-flash-selective",
                    compile(2, 2, 1, 0, 4, "1f1b", kHd64Model, [](auto& o) { o.recompute = "selective"; }),
                    cu::DType::BF16);
}

// SM partitioning changes where kernels run, not what they compute: DualPipeV with communication on
// 24 SMs (green contexts on Hopper, else CTA limits) matches the host reference like the run above.
TEST(CudaBackendSmPartition, DualPipeVWithCommOn24Sms) {
  core::Program p = compile(2, 2, 2, 0, 4, "dualpipev");
  p.sm_partition = core::SmPartition{"comm", 24};
  expect_equivalent("dualpipev-sm24", p);
}

// A checkpoint of a GPU run is the host's canonical file: 2 CUDA steps saved, then resumed for the
// third on the CUDA backend and on the host reference, both match 3 uninterrupted reference steps.
TEST(CudaBackendCheckpoint, ResumesOnGpuAndOnHost) {
  const core::Program program = compile(2, 2, 2, 2, 4, "1f1b");
  const fs::path dir = temp_dir("checkpoint");
  const auto full = rt::train_reference(program, options(dir / "full.bin"));
  cu::CudaRunOptions c;
  c.virtual_devices = true;
  rt::TrainOptions first = options(dir / "first.bin");
  first.steps = 2;
  first.save_path = (dir / "ckpt").string();
  cu::train_cuda(program, first, c);
  rt::TrainOptions gpu = options(dir / "gpu.bin");
  gpu.resume_path = first.save_path;
  const auto resumed_gpu = cu::train_cuda(program, gpu, c);
  rt::TrainOptions host = options(dir / "host.bin");
  host.resume_path = first.save_path;
  const auto resumed_host = rt::train_reference(program, host);
  ASSERT_EQ(resumed_gpu.losses.size(), 1u);
  ASSERT_EQ(resumed_host.losses.size(), 1u);
  EXPECT_NEAR(resumed_gpu.losses[0], full.losses[2], kLossRelTol * std::abs(full.losses[2]));
  EXPECT_NEAR(resumed_host.losses[0], full.losses[2], kLossRelTol * std::abs(full.losses[2]));
  EXPECT_LT(rt::max_param_difference((dir / "full.bin").string(), (dir / "gpu.bin").string()), kParamAbsTol);
  EXPECT_LT(rt::max_param_difference((dir / "full.bin").string(), (dir / "host.bin").string()), kParamAbsTol);
}

// --calibrate on virtual devices writes a calibration with the steps after the first.
TEST(CudaBackendCalibrate, WritesAPiperCalibration) {
  const core::Program program = compile(2, 2, 2, 0, 4, "dualpipev");
  const fs::path dir = temp_dir("calibrate");
  rt::TrainOptions o = options(dir / "p.bin");
  o.calibrate_path = (dir / "calib.json").string();
  cu::CudaRunOptions c;
  c.virtual_devices = true;
  cu::train_cuda(program, o, c);
  std::ifstream in(o.calibrate_path);
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("format"), "piper-calibration");
  EXPECT_EQ(j.at("measured").at("steps"), 2);
  EXPECT_FALSE(j.at("entries").empty());
}

int main(int argc, char** argv) {
  std::string why;
  if (!cu::device_available(&why)) {
    std::printf("skipped: %s\n", why.c_str());
    return 77;  // CTest SKIP_RETURN_CODE
  }
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  std::error_code ec;
  fs::remove_all(fs::temp_directory_path() / ("piper-cuda-test-" + std::to_string(getpid())), ec);
  return rc;
}
