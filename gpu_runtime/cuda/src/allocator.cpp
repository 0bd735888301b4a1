// The caching device allocator: size classes, deferred reuse behind per-stream events, trimming.
#include "piper/runtime/cuda/allocator.hpp"

#include <algorithm>

#include "piper/runtime/cuda/device.hpp"

namespace piper::runtime::cuda {

std::size_t round_block_size(std::size_t bytes) {
  constexpr std::size_t kMiB = 1 << 20;
  if (bytes >= kMiB) return (bytes + kMiB - 1) / kMiB * kMiB;
  std::size_t s = 512;
  while (s < bytes) s *= 2;
  return s;
}

Block::~Block() {
  if (ptr_) owner_->release(ptr_, bytes_);
}

Allocator::~Allocator() {
  // Outstanding work may still use retired blocks: wait for the device before freeing anything.
  cudaDeviceSynchronize();
  for (auto& r : retired_) {
    cudaFree(r.ptr);
    for (auto e : r.events) cudaEventDestroy(e);
  }
  for (auto& [size, ptr] : free_) cudaFree(ptr);
  for (auto e : spare_events_) cudaEventDestroy(e);
}

cudaEvent_t Allocator::event() {
  if (!spare_events_.empty()) {
    cudaEvent_t e = spare_events_.back();
    spare_events_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  return e;
}

std::shared_ptr<Block> Allocator::allocate(std::size_t bytes) {
  if (bytes == 0) return std::make_shared<Block>(this, nullptr, 0);
  const std::size_t size = round_block_size(bytes);
  reclaim();
  auto it = free_.find(size);
  if (it != free_.end()) {
    void* p = it->second;
    free_.erase(it);
    cached_ -= size;
    return std::make_shared<Block>(this, p, size);
  }
  void* p = nullptr;
  if (cudaMalloc(&p, size) != cudaSuccess) {
    cudaGetLastError();
    // Out of memory: wait for in-flight work, return every cached block to the driver and retry.
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    reclaim();
    trim(0);
    check(cudaMalloc(&p, size), "cudaMalloc");
  }
  allocated_ += size;
  return std::make_shared<Block>(this, p, size);
}

void Allocator::release(void* ptr, std::size_t bytes) {
  Retired r{ptr, bytes, {}};
  // Destructors must not throw: an event failure leaves the block unreclaimable, never reused early.
  for (cudaStream_t s : streams_) {
    cudaEvent_t e = nullptr;
    try {
      e = event();
    } catch (const CudaError&) {
      return;
    }
    cudaEventRecord(e, s);
    r.events.push_back(e);
  }
  retired_.push_back(std::move(r));
}

void Allocator::reclaim() {
  // Retired blocks are in release order, and each has one event on every stream, recorded after the
  // previous block's on that stream: a block's events complete no later than the next block's. So
  // the first block still pending ends the scan (one query per stream per call, not one per retired
  // block: the step frees hundreds of blocks and allocates after each op).
  auto done = [](const Retired& r) {
    return std::all_of(r.events.begin(), r.events.end(),
                       [](cudaEvent_t e) { return cudaEventQuery(e) == cudaSuccess; });
  };
  while (!retired_.empty() && done(retired_.front())) {
    Retired& r = retired_.front();
    free_.emplace(r.bytes, r.ptr);
    cached_ += r.bytes;
    spare_events_.insert(spare_events_.end(), r.events.begin(), r.events.end());
    retired_.pop_front();
  }
  cudaGetLastError();  // cudaEventQuery's cudaErrorNotReady is not an error
  if (cache_limit_ > 0 && cached_ > cache_limit_) trim(cache_limit_);
}

void Allocator::trim(std::size_t keep) {
  // Largest blocks first: they are the least likely to match a later request exactly.
  while (cached_ > keep && !free_.empty()) {
    auto it = std::prev(free_.end());
    cudaFree(it->second);
    cached_ -= it->first;
    allocated_ -= it->first;
    free_.erase(it);
  }
}

}  // namespace piper::runtime::cuda
