// One training step of a dense 1.1B model (examples/models/dense-1b.json) on one GPU in bf16 through
// the CUDA backend (one virtual device): step time, MFU against the GPU's dense bf16 peak, the
// executor's share of the step, and a large cuBLASLt GEMM's throughput against the same peak.
// Prints its figures; without a GPU prints "skipped: no GPU" and exits 77. Never run on a GPU yet.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "../gpu/data_root.hpp"
#include "piper/core/model.hpp"
#include "piper/core/scenario.hpp"
#include "piper/runtime/cuda/cuda_trainer.hpp"
#include "piper/runtime/cuda/device.hpp"
#include "piper/runtime/cuda/gemm.hpp"
#include "piper/runtime/cuda/kernels.hpp"

namespace cu = piper::runtime::cuda;
namespace core = piper::core;

namespace {

// NVIDIA H100/H200 SXM dense (no sparsity) BF16 tensor-core peak, TFLOP/s (datasheet).
constexpr double kPeakTflops = 989.4;

double gemm_tflops(int n) {
  cudaStream_t s = nullptr;
  cu::check(cudaStreamCreate(&s), "cudaStreamCreate");
  cu::Gemm g(s);
  const std::size_t bytes = static_cast<std::size_t>(n) * n * 2;
  cu::DeviceBuffer a(bytes), b(bytes), c(bytes);
  cu::check(cudaMemsetAsync(a.get(), 0, bytes, s), "memset");
  cu::check(cudaMemsetAsync(b.get(), 0, bytes, s), "memset");
  cu::GemmShape shape{n, n, n, false, false, 0, 0, 0};
  for (int i = 0; i < 3; ++i) g.run(cu::DType::BF16, shape, a.get(), b.get(), c.get());
  const double ms = cu::time_on_stream_ms(s, 20, [&] { g.run(cu::DType::BF16, shape, a.get(), b.get(), c.get()); });
  cudaStreamDestroy(s);
  return 2.0 * n * static_cast<double>(n) * n / (ms * 1e-3) / 1e12;
}

}  // namespace

int main(int argc, char** argv) {
  std::string why;
  if (!cu::device_available(&why)) {
    std::printf("skipped: %s\n", why.c_str());
    return 77;
  }
  const int steps = argc > 1 ? std::atoi(argv[1]) : 5;
  cudaDeviceProp prop{};
  cu::check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

  core::Scenario s;
  s.model = piper::test::data_root() + "/examples/models/dense-1b.json";
  s.strategy.pp = 1, s.strategy.dp = 1, s.strategy.microbatches = 2, s.strategy.schedule = "1f1b";
  const core::Program program = core::compile_scenario(s).result.program;
  // The step's model FLOPs as the compiler costs them (forward + backward of every layer).
  double flops = 0;
  for (const auto& st : program.plan_for(0).streams)
    for (const auto& op : st.ops)
      if (op.kind == core::OpKind::Compute) flops += op.flops;
  // PaLM's count, as ../shared/measurements/h200/torch_dense1b.py (scripts/measure/) counts PyTorch's runs:
  // 6 x non-embedding parameters + 6 x layers x heads x head_dim x sequence (causal attention) per token.
  const core::ModelConfig cfg = core::scenario_model_config(s);
  const auto d = [](std::int64_t x) { return static_cast<double>(x); };
  const double step_tokens = d(program.training.tokens_per_microbatch()) * program.microbatches;
  const double palm_flops =
      step_tokens * (6 * (d(core::build_model(cfg).parameter_count()) - d(cfg.vocab) * d(cfg.hidden)) +
                     6 * d(cfg.layers) * d(cfg.heads) * d(cfg.head_dim) * d(program.training.seq_len));

  piper::runtime::TrainOptions o;
  o.steps = steps;
  o.print = true;
  cu::CudaRunOptions c;
  c.virtual_devices = true;
  c.dtype = cu::DType::BF16;
  const auto r = cu::train_cuda(program, o, c);

  // Steady state: the mean over the steps after the first, which loads kernels, asks cuBLASLt's
  // heuristic for every shape and fills the caching allocator.
  double steady = r.step_time_s;
  if (r.step_times_s.size() > 1) {
    steady = 0;
    for (std::size_t i = 1; i < r.step_times_s.size(); ++i) steady += r.step_times_s[i];
    steady /= static_cast<double>(r.step_times_s.size() - 1);
  }
  const double tflops = flops / steady / 1e12;
  const double gemm = gemm_tflops(8192);
  std::printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  std::printf("dense-1b bf16, 1 GPU, %d steps; attention: %s\n", steps,
              cu::attention_path_name(cu::choose_attention(cu::DType::BF16, cu::AttentionDims{4096, 1024, 32, 8, 64})));
  std::printf(
      "first step %.1f ms; steady step %.1f ms (mean of steps 2..%d), %.0f tokens/s, model %.2f TFLOP/step, %.1f "
      "TFLOP/s\n",
      r.step_times_s.empty() ? 0.0 : r.step_times_s.front() * 1e3, steady * 1e3, steps,
      r.tokens_per_s * r.step_time_s / steady, flops / 1e12, tflops);
  std::printf("MFU %.1f %% of %.1f TFLOP/s; PaLM's count (torch_dense1b.py's) %.1f %% (target >= 50 %%)\n",
              100 * tflops / kPeakTflops, kPeakTflops, 100 * palm_flops / steady / 1e12 / kPeakTflops);
  std::printf("executor overhead %.2f %% of the step, all steps (target <= 2 %%)\n",
              r.total_s > 0 ? 100 * r.overhead_s / r.total_s : 0.0);
  std::printf("cuBLASLt bf16 GEMM 8192^3: %.1f TFLOP/s = %.1f %% of peak\n", gemm, 100 * gemm / kPeakTflops);
  return 0;
}
