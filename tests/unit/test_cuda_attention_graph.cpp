// The CUDA backend's cuDNN attention graphs, without a GPU: cuDNN's own rules (the cudnn-frontend's
// validate() for a Hopper GPU, compute capability 9.0) accept the forward and backward graphs that
// read the backend's layouts in place at every shape the H200 measurement timed (the shapes whose
// speed scripts/gpu-check.sh compares) and at the test models' shapes, and refuse shapes cuDNN cannot
// run with its reason. Skipped where the backend was built without the cudnn-frontend headers or
// libcudnn cannot be loaded.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "piper/runtime/cuda/kernels.hpp"

namespace cu = piper::runtime::cuda;

namespace {

constexpr int kHopper = 90;

// "" when the graphs validate; skips the test where cuDNN is absent.
std::string validate(const cu::AttentionDims& d) { return cu::cudnn_attention_validate(d, kHopper); }

bool cudnn_missing(std::string* why) {
  if (!cu::cudnn_attention_compiled()) {
    *why = "built without the cudnn-frontend headers";
    return true;
  }
  const std::string r = validate(cu::AttentionDims{64, 64, 2, 1, 64});
  if (r.rfind("cannot load cuDNN", 0) == 0) {
    *why = r;
    return true;
  }
  return false;
}

}  // namespace

TEST(CudnnAttentionGraph, EveryMeasuredH200ShapeValidatesOnHopper) {
  std::string why;
  if (cudnn_missing(&why)) GTEST_SKIP() << why;
  std::ifstream in(std::string(PIPER_SOURCE_DIR) + "/sim/data/kernels-h200-sxm.json");
  ASSERT_TRUE(in) << "sim/data/kernels-h200-sxm.json";
  const auto table = nlohmann::json::parse(in);
  int shapes = 0;
  for (const auto& a : table.at("attention")) {
    const int b = a.at("b"), s = a.at("s");
    const cu::AttentionDims d{b * s, s, a.at("heads"), a.at("kv_heads"), a.at("head_dim")};
    EXPECT_EQ(validate(d), "") << b << " x " << s << ", " << d.heads << "/" << d.kv_heads << " heads, hd "
                               << d.head_dim;
    ++shapes;
  }
  EXPECT_EQ(shapes, 24);
}

TEST(CudnnAttentionGraph, TestModelShapesValidate) {
  std::string why;
  if (cudnn_missing(&why)) GTEST_SKIP() << why;
  // dense-1b (4 x 1024 tokens, 32 heads, 8 KV, hd 64), the hd-64 test model (L = 100, not a multiple of
  // any tile), the tiny MoE (hd 8), multi-head without grouping, hd 128 and 256.
  for (const cu::AttentionDims& d : {cu::AttentionDims{4096, 1024, 32, 8, 64}, cu::AttentionDims{200, 100, 4, 2, 64},
                                     cu::AttentionDims{64, 16, 4, 2, 8}, cu::AttentionDims{300, 100, 4, 4, 64},
                                     cu::AttentionDims{130, 130, 2, 1, 128}, cu::AttentionDims{256, 128, 4, 1, 256}})
    EXPECT_EQ(validate(d), "") << d.tokens << " tokens, L " << d.seq_len << ", " << d.heads << "/" << d.kv_heads
                               << " heads, hd " << d.head_dim;
}

TEST(CudnnAttentionGraph, RefusesWhatCudnnCannotRunWithItsReason) {
  std::string why;
  if (cudnn_missing(&why)) GTEST_SKIP() << why;
  // cuDNN's rule: head_dim a multiple of 8.
  EXPECT_NE(validate(cu::AttentionDims{200, 100, 4, 2, 12}).find("multiple of 8"), std::string::npos);
  // Ours: grouped heads divide, tokens are whole sequences.
  EXPECT_NE(validate(cu::AttentionDims{200, 100, 4, 3, 64}).find("multiple of kv_heads"), std::string::npos);
  EXPECT_NE(validate(cu::AttentionDims{150, 100, 4, 2, 64}).find("whole sequences"), std::string::npos);
}

TEST(CudnnAttentionGraph, WithoutAGpuNothingIsSupportedAndTheReasonIsGiven) {
  // supported() builds plans, which needs a GPU: here it must say no, never throw.
  std::string why;
  const bool ok = cu::cudnn_attention_supported(cu::DType::BF16, cu::AttentionDims{200, 100, 4, 2, 64}, &why);
  if (ok) GTEST_SKIP() << "a GPU is present";
  EXPECT_FALSE(why.empty());
  EXPECT_FALSE(cu::cudnn_attention_supported(cu::DType::F32, cu::AttentionDims{200, 100, 4, 2, 64}, &why));
  EXPECT_EQ(why, "cuDNN attention runs bf16 only");
}
