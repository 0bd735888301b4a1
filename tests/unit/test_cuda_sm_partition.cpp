// How the CUDA backend realises an sm_partition on a GPU, without a GPU: green contexts take exact
// partitions of the architecture's granularity (Hopper: at least 8 SMs, multiples of 8) and refuse
// others in one line naming the field and the valid counts; without green contexts NCCL's CTA cap and
// cuBLASLt's SM-count target take any count; nothing may leave compute without an SM.
#include <gtest/gtest.h>

#include "piper/runtime/cuda/sm_partition.hpp"

using namespace piper;
using namespace piper::runtime::cuda;

namespace {

std::string error_of(int sms, int device_sms, bool green, SmGranularity g) {
  try {
    plan_sm_partition(core::SmPartition{"comm", sms}, device_sms, green, g);
  } catch (const CudaError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(CudaSmPartition, GranularityFollowsCudaGuideline) {
  EXPECT_EQ(green_context_granularity(9).min_sms, 8);
  EXPECT_EQ(green_context_granularity(9).multiple, 8);
  EXPECT_EQ(green_context_granularity(10).multiple, 8);
  EXPECT_EQ(green_context_granularity(8).min_sms, 4);
  EXPECT_EQ(green_context_granularity(8).multiple, 2);
  EXPECT_EQ(green_context_granularity(7).min_sms, 2);
}

TEST(CudaSmPartition, HopperGreenContextsTakeMultiplesOfEight) {
  const SmGranularity hopper = green_context_granularity(9);
  const SmPlan p = plan_sm_partition(core::SmPartition{"comm", 24}, 132, true, hopper);
  EXPECT_EQ(p.mechanism, SmMechanism::GreenContexts);
  EXPECT_EQ(p.comm_sms, 24);
  EXPECT_EQ(p.compute_sms, 108);
  // DeepSeek-V3's 20 SMs are not a Hopper green-context partition: refused, with the neighbours.
  const std::string e = error_of(20, 132, true, hopper);
  EXPECT_NE(e.find("sm_partition: field 'sms': 20 SMs"), std::string::npos) << e;
  EXPECT_NE(e.find("use 16 or 24"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  EXPECT_NE(error_of(4, 132, true, hopper).find("use 8"), std::string::npos);
  EXPECT_NE(error_of(132, 132, true, hopper).find("at least one"), std::string::npos);
}

TEST(CudaSmPartition, CtaLimitsTakeAnyCountThatLeavesCompute) {
  const SmPlan p = plan_sm_partition(core::SmPartition{"comm", 20}, 132, false, green_context_granularity(9));
  EXPECT_EQ(p.mechanism, SmMechanism::CtaLimits);
  EXPECT_EQ(p.comm_sms, 20);
  EXPECT_EQ(p.compute_sms, 112);
  EXPECT_NE(error_of(140, 132, false, {}).find("at least one of this GPU's 132 SMs"), std::string::npos);
}

// Without a partition the partitioner sets no limits (and needs no GPU to say so).
TEST(CudaSmPartition, NoPartitionNoLimits) {
  const auto sm = SmPartitioner::create(std::nullopt);
  EXPECT_EQ(sm->gemm_sm_target(), 0);
  EXPECT_EQ(sm->nccl_max_ctas(), 0);
  EXPECT_EQ(sm->describe(), "SMs shared by communication and compute");
}
