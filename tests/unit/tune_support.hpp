// Helpers of the tune tests (test_sim_tune.cpp, test_sim_tune_bounds.cpp): a small search and a
// temporary results file.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <string>

#include "piper/search/tune.hpp"

namespace piper::search::test {

inline std::filesystem::path temp_csv(const std::string& name) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("piper_test_tune_" + std::to_string(::getpid()) + "_" + name + ".csv");
  std::filesystem::remove(p);
  return p;
}

// qwen3-9m (4 blocks, 256 tokens per sequence) on one 8-GPU node, 16 sequences per step.
inline TuneSpec small_spec() {
  TuneSpec s;
  s.model = "qwen3-9m";
  s.cluster = "dgx-h200";
  s.devices = 8;
  s.global_batch = 16;
  s.micro_batch_sizes = {1, 2};
  s.zero_levels = {0, 3};
  s.max_virtual = 3;
  s.tp_degrees = {1};
  s.recompute_modes = {"none"};
  s.reduce_every = {"microbatch"};  // the ZeRO-2/3 reduction axis has its own test
  s.top_k = 0;
  s.placement_search = false;
  return s;
}

}  // namespace piper::search::test
