// CUDA device probe, error checks, stream timing and the owning device buffer.
#include "piper/runtime/cuda/device.hpp"

#include <fmt/format.h>

namespace piper::runtime::cuda {

bool device_available(std::string* why) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (why) *why = fmt::format("no GPU ({})", cudaGetErrorString(status));
    cudaGetLastError();  // clear the sticky-free error so later probes start clean
    return false;
  }
  if (count == 0) {
    if (why) *why = "no GPU (no CUDA device visible)";
    return false;
  }
  return true;
}

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw CudaError(fmt::format("{}: {}", what, cudaGetErrorString(status)));
}

std::size_t dtype_bytes(DType t) { return t == DType::F32 ? 4 : 2; }
const char* dtype_name(DType t) { return t == DType::F32 ? "fp32" : t == DType::BF16 ? "bf16" : "fp16"; }

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes > 0) check(cudaMalloc(&ptr_, bytes), "cudaMalloc");
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) cudaFree(ptr_);
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    if (ptr_) cudaFree(ptr_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

double time_on_stream_ms(cudaStream_t stream, int reps, const std::function<void()>& launch) {
  cudaEvent_t begin = nullptr, end = nullptr;
  check(cudaEventCreate(&begin), "cudaEventCreate");
  check(cudaEventCreate(&end), "cudaEventCreate");
  check(cudaEventRecord(begin, stream), "cudaEventRecord");
  for (int i = 0; i < reps; ++i) launch();
  check(cudaEventRecord(end, stream), "cudaEventRecord");
  check(cudaEventSynchronize(end), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, begin, end), "cudaEventElapsedTime");
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  return ms / reps;
}

}  // namespace piper::runtime::cuda
