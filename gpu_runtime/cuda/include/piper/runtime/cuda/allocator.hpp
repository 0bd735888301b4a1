// A simple caching device allocator for one (possibly virtual) device: freed blocks are kept for reuse
// once every stream of the device has passed the point where they were freed, so no kernel still in
// flight on another stream can see its memory handed out again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

namespace piper::runtime::cuda {

class Allocator;

// One device allocation; returns itself to its allocator when destroyed.
class Block {
 public:
  Block(Allocator* owner, void* ptr, std::size_t bytes) : owner_(owner), ptr_(ptr), bytes_(bytes) {}
  ~Block();
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  Allocator* owner_;
  void* ptr_;
  std::size_t bytes_;
};

class Allocator {
 public:
  // `cache_limit` bounds the bytes kept cached when idle; the backend sets it from the plan's peak
  // transient bytes (buffer lifetimes), so a step's working set is served from the cache.
  explicit Allocator(std::size_t cache_limit = 0) : cache_limit_(cache_limit) {}
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // Streams whose in-flight work a freed block must outlive (every stream of the device).
  void add_stream(cudaStream_t s) { streams_.push_back(s); }
  void set_cache_limit(std::size_t bytes) { cache_limit_ = bytes; }

  // A zero-byte request returns an empty block (null pointer).
  std::shared_ptr<Block> allocate(std::size_t bytes);

  std::size_t allocated_bytes() const { return allocated_; }
  std::size_t cached_bytes() const { return cached_; }

 private:
  friend class Block;
  struct Retired {
    void* ptr;
    std::size_t bytes;
    std::vector<cudaEvent_t> events;  // one per stream: the block is free once all completed
  };
  void release(void* ptr, std::size_t bytes);
  void reclaim();               // moves retired blocks whose events completed to the free lists
  void trim(std::size_t keep);  // cudaFree cached blocks beyond `keep` bytes
  cudaEvent_t event();

  std::size_t cache_limit_;
  std::vector<cudaStream_t> streams_;
  std::multimap<std::size_t, void*> free_;  // rounded size -> block
  std::deque<Retired> retired_;             // in release order (see reclaim)
  std::vector<cudaEvent_t> spare_events_;
  std::size_t allocated_ = 0, cached_ = 0;
};

// Rounds a request to the allocator's size classes (512 B below 1 MiB by powers of two, then 1 MiB steps).
std::size_t round_block_size(std::size_t bytes);

}  // namespace piper::runtime::cuda
