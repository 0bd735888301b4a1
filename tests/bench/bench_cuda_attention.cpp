// Causal attention on one GPU, bf16. Part 1, at the dense-1b benchmark's shape (4 sequences of 1024
// tokens, 32 heads, 8 KV heads, head_dim 64) and a head_dim-128 shape of the same width: the time of
// each path (cuDNN's fused attention, the flash kernels, the explicit-probabilities reference), forward
// and backward, their throughput (causal model FLOPs: forward 2 L^2 hd heads sequences, i.e. half of
// the two full L x L products; backward 2.5 times that, FlashAttention's accounting) and the largest
// difference of each fast path's outputs from the reference's, relative to the largest value.
// Part 2, at every shape of the H200 measurement (kernels.json "attention": PyTorch's SDPA on cuDNN):
// the cuDNN path's forward and backward time as a ratio of the measured one (measured / ours, so 1.0
// is cuDNN's speed) and the flash kernels' alike, then the smallest ratios against the target (at least
// 0.70 at every shape); exits 3 when it is not met. The table is $PIPER_KERNELS_JSON, else
// sim/data/kernels-h200-sxm.json of the data root (tests/gpu/data_root.hpp). Without a GPU prints "skipped: no GPU"
// and exits 77.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../gpu/data_root.hpp"
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

double fwd_flops(const cu::AttentionDims& d) {
  return 2.0 * d.seq_len * static_cast<double>(d.seq_len) * d.head_dim * d.heads * (d.tokens / d.seq_len);
}

// Device buffers of one shape: random bf16 inputs and every path's outputs.
struct Buffers {
  cu::AttentionDims d;
  cu::DeviceBuffer q, k, v, d_o, o, lse, delta, dq, dk, dv, ws_f, ws_b;
  explicit Buffers(const cu::AttentionDims& dims) : d(dims) {
    const std::size_t T = static_cast<std::size_t>(d.tokens), qn = T * d.heads * d.head_dim,
                      kn = T * d.kv_heads * d.head_dim, rows = T * d.heads;
    q = random_bf16(qn, 1), k = random_bf16(kn, 2), v = random_bf16(kn, 3), d_o = random_bf16(qn, 4);
    o = cu::DeviceBuffer(qn * 2), lse = cu::DeviceBuffer(rows * 4), delta = cu::DeviceBuffer(rows * 4);
    dq = cu::DeviceBuffer(qn * 2), dk = cu::DeviceBuffer(kn * 2), dv = cu::DeviceBuffer(kn * 2);
  }
  // Mean ms of the forward and the backward on `path` (not the reference).
  std::pair<double, double> time(cu::AttentionPath path, int reps) {
    if (path == cu::AttentionPath::Cudnn) {
      ws_f = cu::DeviceBuffer(std::max<std::size_t>(1, cu::cudnn_attention_workspace(d, false)));
      ws_b = cu::DeviceBuffer(std::max<std::size_t>(1, cu::cudnn_attention_workspace(d, true)));
      const double f = time_ms(reps, [&] {
        cu::cudnn_attention_forward(d, q.get(), k.get(), v.get(), lse.as<float>(), o.get(), ws_f.get(), nullptr);
      });
      const double b = time_ms(reps, [&] {
        cu::cudnn_attention_backward(d, q.get(), k.get(), v.get(), o.get(), lse.as<float>(), d_o.get(), dq.get(),
                                     dk.get(), dv.get(), ws_b.get(), nullptr);
      });
      return {f, b};
    }
    const double f = time_ms(
        reps, [&] { cu::flash_attention_forward(d, q.get(), k.get(), v.get(), lse.as<float>(), o.get(), nullptr); });
    const double b = time_ms(reps, [&] {
      cu::flash_attention_backward(d, q.get(), k.get(), v.get(), o.get(), lse.as<float>(), d_o.get(), delta.as<float>(),
                                   dq.get(), dk.get(), dv.get(), nullptr);
    });
    return {f, b};
  }
  std::vector<std::vector<float>> outputs() const { return {to_host(o), to_host(dq), to_host(dk), to_host(dv)}; }
};

void print_path(const char* name, const cu::AttentionDims& d, std::pair<double, double> t, double ref_f, double ref_b) {
  const double ff = fwd_flops(d), bf = 2.5 * ff;
  std::printf("  %-7s forward  %8.3f ms (%6.1f TFLOP/s, %4.1f %% of peak, %5.1fx the reference)\n", name, t.first,
              ff / t.first / 1e9, 100 * ff / t.first / 1e9 / kPeakTflops, ref_f / t.first);
  std::printf("  %-7s backward %8.3f ms (%6.1f TFLOP/s, %4.1f %% of peak, %5.1fx the reference)\n", name, t.second,
              bf / t.second / 1e9, 100 * bf / t.second / 1e9 / kPeakTflops, ref_b / t.second);
}

void print_diff(const char* name, const std::vector<std::vector<float>>& got,
                const std::vector<std::vector<float>>& ref) {
  std::printf("  %-7s vs reference, max |diff| / max |value|: o %.2e  dq %.2e  dk %.2e  dv %.2e\n", name,
              rel_diff(got[0], ref[0]), rel_diff(got[1], ref[1]), rel_diff(got[2], ref[2]), rel_diff(got[3], ref[3]));
}

void run_shape(int sequences, int L, int heads, int kv_heads, int hd) {
  const cu::AttentionDims d{sequences * L, L, heads, kv_heads, hd};
  const auto bf = cu::DType::BF16;
  Buffers b(d);
  const std::size_t rows = static_cast<std::size_t>(d.tokens) * heads;
  cu::DeviceBuffer probs(rows * L * 4), ds(rows * L * 4);
  const double ref_f = time_ms(2, [&] {
    cu::attention_core_forward(bf, d, b.q.get(), b.k.get(), b.v.get(), probs.as<float>(), b.o.get(), nullptr);
  });
  const double ref_b = time_ms(2, [&] {
    cu::attention_core_backward(bf, d, b.q.get(), b.k.get(), b.v.get(), probs.as<float>(), b.d_o.get(), ds.as<float>(),
                                b.dq.get(), b.dk.get(), b.dv.get(), nullptr);
  });
  cu::check(cudaDeviceSynchronize(), "attention");
  const auto ref = b.outputs();
  std::printf("attention %d x %d tokens, %d heads (%d KV), head_dim %d: reference forward %.3f ms, backward %.3f ms\n",
              sequences, L, heads, kv_heads, hd, ref_f, ref_b);
  std::string why;
  if (cu::cudnn_attention_supported(bf, d, &why)) {
    print_path("cudnn", d, b.time(cu::AttentionPath::Cudnn, 10), ref_f, ref_b);
    print_diff("cudnn", b.outputs(), ref);
  } else {
    std::printf("  cudnn   not run: %s\n", why.c_str());
  }
  print_path("flash", d, b.time(cu::AttentionPath::Flash, 10), ref_f, ref_b);
  print_diff("flash", b.outputs(), ref);
}

std::string kernels_json() {
  if (const char* p = std::getenv("PIPER_KERNELS_JSON"); p != nullptr && *p != '\0') return p;
  return piper::test::data_root() + "/sim/data/kernels-h200-sxm.json";
}

// Part 2; returns false when the target is not met.
bool against_measured_cudnn() {
  const std::string path = kernels_json();
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path + " (set PIPER_KERNELS_JSON)");
  const auto table = nlohmann::json::parse(in);
  std::printf("\nagainst the measured cuDNN attention of %s (%s, cuDNN %s): measured time / ours (1.00 = cuDNN)\n",
              path.c_str(), table.value("device", "?").c_str(), table.value("cudnn", nlohmann::json()).dump().c_str());
  std::printf("  %5s %6s %9s %3s %16s %16s\n", "batch", "L", "heads/kv", "hd", "cudnn fwd  bwd", "flash fwd  bwd");
  double worst_f = 1e30, worst_b = 1e30;
  int shapes = 0;
  for (const auto& a : table.at("attention")) {
    const int B = a.at("b"), L = a.at("s");
    const cu::AttentionDims d{B * L, L, a.at("heads"), a.at("kv_heads"), a.at("head_dim")};
    const double mf = 1e3 * a.at("fwd_s").get<double>(), mb = 1e3 * a.at("bwd_s").get<double>();
    Buffers b(d);
    std::string why;
    if (!cu::cudnn_attention_supported(cu::DType::BF16, d, &why)) {
      std::printf("  %5d %6d %5d/%-3d %3d cudnn not run: %s\n", B, L, d.heads, d.kv_heads, d.head_dim, why.c_str());
      worst_f = worst_b = 0;
      continue;
    }
    const auto c = b.time(cu::AttentionPath::Cudnn, 5);
    const auto f = cu::use_flash_attention(cu::DType::BF16, d) ? b.time(cu::AttentionPath::Flash, 2)
                                                               : std::pair<double, double>{0, 0};
    std::printf("  %5d %6d %5d/%-3d %3d %8.2f %6.2f %8.2f %6.2f\n", B, L, d.heads, d.kv_heads, d.head_dim, mf / c.first,
                mb / c.second, f.first > 0 ? mf / f.first : 0.0, f.second > 0 ? mb / f.second : 0.0);
    worst_f = std::min(worst_f, mf / c.first);
    worst_b = std::min(worst_b, mb / c.second);
    ++shapes;
  }
  const bool met = shapes > 0 && worst_f >= 0.70 && worst_b >= 0.70;
  std::printf(
      "cuDNN path over %d shapes: smallest ratio forward %.2f, backward %.2f (target >= 0.70 at every shape): %s\n",
      shapes, worst_f, worst_b, met ? "met" : "NOT met");
  return met;
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
    if (!against_measured_cudnn()) return 3;
  } catch (const std::exception& e) {
    std::printf("bench_cuda_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
