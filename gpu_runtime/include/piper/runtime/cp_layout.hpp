// Context parallelism's index arithmetic as the CUDA attention kernels use it (gpu_runtime/cuda/src/
// kernels.cu), in a header the host compiler reads too, so that it is checked against the host
// backend's layout (host::AttentionCp, kernels.cpp's cp_keys) without a GPU (test_runtime_capabilities).
//
// A CP rank's L local rows of a sequence are the load-balanced chunks `rank` and 2·cp-1-rank, L/2
// rows each; the keys of a sequence are every rank's rows gathered rank after rank (an all-gather's
// order), so key j (0 <= j < cp·L) is rank j / L's local row j % L.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define PIPER_HOST_DEVICE __host__ __device__
#else
#define PIPER_HOST_DEVICE
#endif

namespace piper::runtime::cp_layout {

// The position in its sequence of CP rank `rank`'s local row i (i itself without CP).
PIPER_HOST_DEVICE inline int position(int cp, int rank, int i, int L) {
  if (cp <= 1) return i;
  const int chunk = L / 2;
  return i < chunk ? rank * chunk + i : (2 * cp - 1 - rank) * chunk + (i - chunk);
}

// The row of key j of sequence `seq` in the gathered K/V buffer, whose rank blocks hold `tokens` rows
// each (seq·L + j without CP).
PIPER_HOST_DEVICE inline std::int64_t key_row(int tokens, int L, int seq, int j) {
  return static_cast<std::int64_t>(j / L) * tokens + static_cast<std::int64_t>(seq) * L + j % L;
}

// Whether key j is visible to CP rank `rank`'s local query i under the causal mask: its position in
// the sequence is not after the query's.
PIPER_HOST_DEVICE inline bool key_visible(int cp, int rank, int L, int i, int j) {
  if (cp <= 1) return j <= i;
  return position(cp, j / L, j % L, L) <= position(cp, rank, i, L);
}

}  // namespace piper::runtime::cp_layout
