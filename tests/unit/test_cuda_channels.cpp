// The NCCL transport's precondition, checked without a GPU: NCCL matches sends and receives of one
// communicator by issue order, so every point-to-point channel (sender, receiver, layer boundary,
// direction) must be sent on one stream and received on one stream in the same node order. Plans of
// every schedule family must satisfy it; a plan with two sends swapped must be refused.
#include <dlfcn.h>

#include <cublasLt.h>

#include <algorithm>
#include <string>

#include <gtest/gtest.h>

#include "piper/core/scenario.hpp"
#include "piper/runtime/cuda/device.hpp"
#include "piper/runtime/cuda/transport.hpp"

namespace core = piper::core;
namespace cu = piper::runtime::cuda;

namespace {

core::Program compile(int pp, int dp, int ep, int microbatches, const std::string& schedule, int virtual_stages = 1) {
  core::Scenario s;
  s.model = PIPER_SOURCE_DIR "/tests/data/runtime-tiny-moe.json";
  s.strategy.pp = pp, s.strategy.dp = dp, s.strategy.ep = ep, s.strategy.microbatches = microbatches;
  s.strategy.schedule = schedule, s.strategy.virtual_stages = virtual_stages;
  return core::compile_scenario(s).result.program;
}

}  // namespace

TEST(CudaNcclChannels, EveryScheduleFamilyIsMatchableByIssueOrder) {
  struct Case {
    const char* schedule;
    int pp, dp, ep, virtual_stages;
  };
  for (const Case& c : {Case{"1f1b", 2, 2, 1, 1}, Case{"gpipe", 4, 1, 1, 1}, Case{"interleaved-1f1b", 2, 1, 1, 2},
                        Case{"zb-h1", 2, 1, 1, 1}, Case{"zb-v", 2, 1, 1, 1}, Case{"dualpipe", 2, 1, 1, 1},
                        Case{"dualpipev", 2, 2, 2, 1}}) {
    const core::Program p = compile(c.pp, c.dp, c.ep, 4, c.schedule, c.virtual_stages);
    std::vector<cu::P2PChannel> channels;
    EXPECT_NO_THROW(channels = cu::p2p_channels(p)) << c.schedule;
    EXPECT_FALSE(channels.empty()) << c.schedule;
  }
}

TEST(CudaNcclChannels, SwappedSendsAreRefused) {
  core::Program p = compile(2, 1, 1, 4, "gpipe");
  // GPipe's first stage sends its microbatches' activations in order on one stream: swap two of them.
  bool swapped = false;
  for (auto& plan : p.plans)
    for (auto& stream : plan.streams) {
      std::vector<std::size_t> sends;
      for (std::size_t i = 0; i < stream.ops.size(); ++i)
        if (stream.ops[i].kind == core::OpKind::Send && stream.ops[i].pass == core::Pass::F) sends.push_back(i);
      if (!swapped && sends.size() >= 2) {
        std::swap(stream.ops[sends[0]], stream.ops[sends[1]]);
        swapped = true;
      }
    }
  ASSERT_TRUE(swapped);
  EXPECT_THROW(cu::p2p_channels(p), cu::CudaError);
}

// cuBLASLt is opened on the first call into it, not at start-up (gpu_runtime/cuda/src/
// cublaslt_loader.cpp): before the call the library is not in the process, after it the call has
// reached the real library. No GPU is needed to ask cuBLASLt for a status string.
TEST(CublasLtLoader, OpensTheLibraryOnTheFirstCall) {
  const auto loaded = [] {
    void* h = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_NOLOAD);
    if (h) dlclose(h);
    return h != nullptr;
  };
  EXPECT_FALSE(loaded()) << "linked, or opened before any GEMM";
  EXPECT_STREQ(cublasLtGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED), "the requested functionality is not supported");
  EXPECT_TRUE(loaded());
}
