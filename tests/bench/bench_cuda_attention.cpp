// Causal attention on one GPU: the bf16 fast path (flash_attention.cu) against the explicit-probabilities
// reference kernels, forward and backward, at the dense-1b benchmark's shape (4 sequences of 1024
// tokens, 32 heads, 8 KV heads, head_dim 64) and a head_dim-128 shape of the same width. Prints the
// time of each, the fast path's throughput (causal model FLOPs: forward 2 L^2 hd heads sequences, i.e.
// half of the two full L x L products; backward 2.5 times that, FlashAttention's accounting) and the
// largest difference between the two paths' outputs relative to the largest value. Without a GPU
// prints "skipped: no GPU" and exits 77. Never run on a GPU yet.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "piper/runtime/cuda/device.hpp"
#include "piper/runtime/cuda/kernels.hpp"

namespace cu = piper::runtime::cuda;

namespace {

// NVIDIA H100/H200 SXM dense BF16 tensor-core peak, TFLOP/s (datasheet), as bench_cuda_step.
constexpr double kPeakTflops = 989.4;

cu::DeviceBuffer random_bf16(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> h(n);
  for (auto& x : h) x = dist(gen);
  cu::DeviceBuffer f32(n * 4), out(n * 2);
  cu::check(cudaMemcpy(f32.get(), h.data(), n * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  cu::convert(cu::DType::F32, f32.get(), cu::DType::BF16, out.get(), static_cast<std::int64_t>(n), nullptr);
  cu::check(cudaDeviceSynchronize(), "convert");
  return out;
}

std::vector<float> to_host(const cu::DeviceBuffer& b) {
  const std::size_t n = b.bytes() / 2;
  cu::DeviceBuffer f32(n * 4);
  cu::convert(cu::DType::BF16, b.get(), cu::DType::F32, f32.get(), static_cast<std::int64_t>(n), nullptr);
  std::vector<float> h(n);
  cu::check(cudaMemcpy(h.data(), f32.get(), n * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return h;
}

// max |a - b| / max |b|
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 1e-30;
  for (std::size_t i = 0; i < a.size(); ++i)
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - b[i]))),
    scale = std::max(scale, static_cast<double>(std::abs(b[i])));
  return diff / scale;
}

// Mean milliseconds of `reps` runs of f after one warm-up run, timed with CUDA events.
// Mean time of `reps` calls on the default stream, after one untimed call.
double time_ms(int reps, const std::function<void()>& f) {
  f();
  return cu::time_on_stream_ms(nullptr, reps, f);
}

void run_shape(int sequences, int L, int heads, int kv_heads, int hd) {
  const cu::AttentionDims d{sequences * L, L, heads, kv_heads, hd};
  const std::size_t T = static_cast<std::size_t>(d.tokens), qn = T * heads * hd, kn = T * kv_heads * hd;
  const std::size_t rows = static_cast<std::size_t>(sequences) * heads * L;
  auto q = random_bf16(qn, 1), k = random_bf16(kn, 2), v = random_bf16(kn, 3), d_o = random_bf16(qn, 4);
  cu::DeviceBuffer o(qn * 2), lse(rows * 4), delta(rows * 4), dq(qn * 2), dk(kn * 2), dv(kn * 2);
  cu::DeviceBuffer ro(qn * 2), probs(rows * L * 4), ds(rows * L * 4), rq(qn * 2), rk(kn * 2), rv(kn * 2);
  const auto bf = cu::DType::BF16;

  const double fast_f = time_ms(
      10, [&] { cu::flash_attention_forward(d, q.get(), k.get(), v.get(), lse.as<float>(), o.get(), nullptr); });
  const double fast_b = time_ms(10, [&] {
    cu::flash_attention_backward(d, q.get(), k.get(), v.get(), o.get(), lse.as<float>(), d_o.get(), delta.as<float>(),
                                 dq.get(), dk.get(), dv.get(), nullptr);
  });
  const double ref_f = time_ms(
      2, [&] { cu::attention_core_forward(bf, d, q.get(), k.get(), v.get(), probs.as<float>(), ro.get(), nullptr); });
  const double ref_b = time_ms(2, [&] {
    cu::attention_core_backward(bf, d, q.get(), k.get(), v.get(), probs.as<float>(), d_o.get(), ds.as<float>(),
                                rq.get(), rk.get(), rv.get(), nullptr);
  });
  cu::check(cudaDeviceSynchronize(), "attention");

  const double fwd_flops = 2.0 * L * static_cast<double>(L) * hd * heads * sequences, bwd_flops = 2.5 * fwd_flops;
  std::printf("attention %d x %d tokens, %d heads (%d KV), head_dim %d:\n", sequences, L, heads, kv_heads, hd);
  std::printf("  forward   fast %8.3f ms (%6.1f TFLOP/s, %4.1f %% of peak)  reference %9.3f ms  speedup %6.1fx\n",
              fast_f, fwd_flops / fast_f / 1e9, 100 * fwd_flops / fast_f / 1e9 / kPeakTflops, ref_f, ref_f / fast_f);
  std::printf("  backward  fast %8.3f ms (%6.1f TFLOP/s, %4.1f %% of peak)  reference %9.3f ms  speedup %6.1fx\n",
              fast_b, bwd_flops / fast_b / 1e9, 100 * bwd_flops / fast_b / 1e9 / kPeakTflops, ref_b, ref_b / fast_b);
  std::printf("  fast vs reference, max |diff| / max |value|: o %.2e  dq %.2e  dk %.2e  dv %.2e\n",
              rel_diff(to_host(o), to_host(ro)), rel_diff(to_host(dq), to_host(rq)), rel_diff(to_host(dk), to_host(rk)),
              rel_diff(to_host(dv), to_host(rv)));
}

}  // namespace

int main() {
  std::string why;
  if (!cu::device_available(&why)) {
    std::printf("skipped: %s\n", why.c_str());
    return 77;
  }
  try {
    run_shape(4, 1024, 32, 8, 64);   // dense-1b's attention (bench_cuda_step)
    run_shape(4, 1024, 16, 4, 128);  // the same width with head_dim 128
  } catch (const std::exception& e) {
    std::printf("bench_cuda_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
