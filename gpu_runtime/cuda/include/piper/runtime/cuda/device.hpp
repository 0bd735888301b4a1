// CUDA device helpers for the CUDA backend: availability probe, error checks that throw with the
// failing call named, and an owning device buffer. Host-only header (no CUDA kernels here).
#pragma once

#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>

namespace piper::runtime::cuda {

// Thrown for any CUDA, cuBLASLt or NCCL failure; the message names the call and the error string.
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// True when at least one usable GPU is visible; otherwise `why` says what is missing ("no CUDA
// device", "driver too old", ...). Never throws: tests use it to skip cleanly on CPU-only machines.
bool device_available(std::string* why = nullptr);

void check(cudaError_t status, const char* what);

// Storage type of activations and parameters: fp32 for equivalence tests, bf16 for speed, fp16 with
// loss scaling (fp32 accumulation in every kernel either way).
enum class DType { F32, BF16, F16 };
const char* dtype_name(DType t);  // "fp32", "bf16", "fp16" (--precision's names)
std::size_t dtype_bytes(DType t);

// Mean device time, in ms, of `reps` calls of `launch`, which enqueues work on `stream`: CUDA events
// recorded on the stream before the first call and after the last (no warm-up: callers do their own).
double time_on_stream_ms(cudaStream_t stream, int reps, const std::function<void()>& launch);

// Owning, move-only device allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace piper::runtime::cuda
