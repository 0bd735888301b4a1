// `piper run --backend cuda` on a machine without a GPU: one line naming the cause, exit 2, nothing
// written; and the CUDA-only flags refused without --backend cuda. (On a GPU machine the first test
// skips: tests/gpu/ covers the real runs.)
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "shell.hpp"

#include "piper/runtime/cuda/device.hpp"

namespace fs = std::filesystem;

namespace {

using piper::test::Result;
using piper::test::sh;

const std::string kModel = std::string(PIPER_SOURCE_DIR) + "/tests/data/runtime-tiny-moe.json";

}  // namespace

TEST(CudaCli, NoGpuIsOneLineAndExit2) {
  std::string why;
  if (piper::runtime::cuda::device_available(&why)) GTEST_SKIP() << "a GPU is present";
  const fs::path report = fs::temp_directory_path() / ("piper-cuda-cli-" + std::to_string(getpid()) + ".json");
  const Result r = sh(std::string(PIPER_CLI) + " run --backend cuda --virtual-devices --model " + kModel +
                      " --pp 2 --microbatches 2 --steps 1 --report " + report.string());
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output, "piper: error: --backend cuda: " + why + "\n");
  EXPECT_EQ(r.output.rfind("piper: error: --backend cuda: no GPU (", 0), 0u) << r.output;
  EXPECT_FALSE(fs::exists(report));
}

TEST(CudaCli, CudaFlagsNeedTheCudaBackend) {
  const Result r = sh(std::string(PIPER_CLI) + " run --precision bf16 --model " + kModel + " --steps 1");
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_EQ(r.output, "piper: error: --precision needs --backend cuda (the host backend computes in fp32)\n");
  const Result v = sh(std::string(PIPER_CLI) + " run --virtual-devices --reference --model " + kModel + " --steps 1");
  EXPECT_EQ(v.code, 2) << v.output;
  EXPECT_EQ(v.output,
            "piper: error: --virtual-devices runs the plan's devices; --reference runs no plan devices: give one\n");
  const Result p = sh(std::string(PIPER_CLI) + " run --backend cuda --precision fp16 --model " + kModel);
  EXPECT_EQ(p.code, 2) << p.output;
}
