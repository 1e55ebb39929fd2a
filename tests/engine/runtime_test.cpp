// tests/engine/runtime_test.cpp: what engine/runtime decides before any backend exists: which
// models the CUDA backend refuses (cuda_refusal), the same answer with or without a GPU.
#include <gtest/gtest.h>

#include <string>

#include "engine/runtime.h"
#include "common/testdata.h"

namespace kiln {
namespace {

TEST(CudaRefusal, LatentRowsWiderThanTheKernelsAreRefusedByWidth) {
  auto m = Model::load(testing::model_path("deepseek2-mla-q8_0.gguf"));
  ASSERT_TRUE(m.has_value()) << m.error();
  model::HParams hp = (*m)->hparams();
  ASSERT_TRUE(hp.is_mla());
  // The fixture's rows (kv_lora 128 + rope 16) fit the kernels: CUDA runs it (golden-tested on
  // a GPU by tests/cuda).
  EXPECT_EQ(cuda_refusal(hp), "");
  // DeepSeek-V3's and Kimi-K2's: 512 + 64, the widest the kernels take (exactly the limit).
  hp.mla.kv_lora = 512;
  hp.mla.rope = 64;
  EXPECT_EQ(kCudaMaxHeadDim, 576);
  EXPECT_EQ(cuda_refusal(hp), "");
  // Past the limit: refused, naming the width and the rank.
  hp.mla.kv_lora = static_cast<int32_t>(kCudaMaxHeadDim) - 64 + 8;
  const std::string r = cuda_refusal(hp);
  EXPECT_NE(r.find("584"), std::string::npos) << r;
  EXPECT_NE(r.find("kv_lora_rank 520"), std::string::npos) << r;
  EXPECT_NE(r.find("wider than"), std::string::npos) << r;
  EXPECT_EQ(r.find('\n'), std::string::npos) << "one line";
  // Between the narrow kernels' 256 and the limit: multiples of 8 only (the wide kernel's
  // 16-byte loads); at 256, any even width as before.
  hp.mla.kv_lora = 256;
  EXPECT_EQ(cuda_refusal(hp), "");
  hp.mla.kv_lora = 258;
  const std::string odd = cuda_refusal(hp);
  EXPECT_NE(odd.find("multiples of 8"), std::string::npos) << odd;
  hp.mla.kv_lora = static_cast<int32_t>(kCudaNarrowHeadDim) - 64 - 2;
  EXPECT_EQ(cuda_refusal(hp), "");
}

TEST(CudaRefusal, SparseAttentionIsRefused) {
  auto m = Model::load(testing::model_path("glm5-f16.gguf"));
  ASSERT_TRUE(m.has_value()) << m.error();
  const std::string r = cuda_refusal((*m)->hparams());
  EXPECT_NE(r.find("sparse attention ('glm-dsa')"), std::string::npos) << r;
}

TEST(CudaRefusal, OrdinaryAttentionIsNotRefused) {
  auto m = Model::load(testing::model_path("stories260K.gguf"));
  ASSERT_TRUE(m.has_value()) << m.error();
  EXPECT_EQ(cuda_refusal((*m)->hparams()), "");
}

}  // namespace
}  // namespace kiln
