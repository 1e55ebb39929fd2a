// tests/unit/core_test.cpp: Status/Expected, dtype table, f16/bf16 conversions.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/dtype.h"
#include "core/half.h"
#include "core/json_depth.h"
#include "core/status.h"

namespace kiln {
namespace {

Expected<int> parse_positive(int x) {
  if (x <= 0) return Status::errorf("value {} is not positive", x);
  return x;
}

Status chain(int x) {
  KILN_ASSIGN_OR_RETURN(int v, parse_positive(x));
  if (v > 10) return Status::error("too big");
  return Status::ok();
}

TEST(Status, ExpectedCarriesValueOrMessage) {
  auto ok = parse_positive(3);
  ASSERT_TRUE(ok);
  EXPECT_EQ(*ok, 3);
  auto bad = parse_positive(-2);
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error(), "value -2 is not positive");
  EXPECT_TRUE(chain(5).is_ok());
  EXPECT_EQ(chain(-1).message(), "value -1 is not positive");
  EXPECT_EQ(chain(11).context("loading").message(), "loading: too big");
}

TEST(DType, GgmlBlockGeometry) {
  EXPECT_EQ(traits(DType::Q4_K).block_size, 256u);
  EXPECT_EQ(traits(DType::Q4_K).type_size, 144u);
  EXPECT_EQ(traits(DType::Q8_0).type_size, 34u);
  EXPECT_EQ(*row_bytes(DType::Q6_K, 512), 420u);
  EXPECT_FALSE(row_bytes(DType::Q4_0, 33).has_value());
  EXPECT_FALSE(dtype_traits(4).has_value());  // removed Q4_2
  EXPECT_EQ(dtype_from_name("Q4_K"), DType::Q4_K);
  EXPECT_EQ(dtype_name(DType::BF16), "bf16");
}

TEST(Half, F16RoundTripsEveryValue) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    f16 h{uint16_t(b)};
    float f = f16_to_f32(h);
    if (std::isnan(f)) {  // NaN payloads may change; NaN-ness may not
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    EXPECT_EQ(f32_to_f16(f).bits, h.bits) << b;
  }
}

#if defined(__x86_64__)
__attribute__((target("f16c"))) float f16c_to_f32(uint16_t bits) { return _cvtsh_ss(bits); }

// The AVX2 K-quant kernels (backend/cpu/kq_avx2-inl.h) read block scales with the F16C
// instruction where the plain kernels, whose bits they must give, call f16_to_f32: the two must
// agree bit for bit on every half, NaN payloads included (a NaN block scale reaches the output).
TEST(Half, F16cInstructionIsF16ToF32) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "no F16C on this CPU";
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const f16 h{uint16_t(b)};
    ASSERT_EQ(std::bit_cast<uint32_t>(f16c_to_f32(uint16_t(b))),
              std::bit_cast<uint32_t>(f16_to_f32(h)))
        << std::hex << b;
  }
}
#endif

TEST(Half, F16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_f16(1.0f).bits, 0x3C00);
  EXPECT_EQ(f32_to_f16(65504.0f).bits, 0x7BFF);
  EXPECT_EQ(f32_to_f16(1e6f).bits, 0x7C00);                // overflow to inf
  EXPECT_EQ(f32_to_f16(1.0f + 1.0f / 2048).bits, 0x3C00);  // tie -> even
  EXPECT_EQ(f32_to_f16(1.0f + 3.0f / 2048).bits, 0x3C02);  // tie -> even (up)
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> d(-70000.f, 70000.f);
  for (int i = 0; i < 100000; ++i) {
    float x = d(rng);
    float y = f16_to_f32(f32_to_f16(x));
    if (std::fabs(x) < 65504) {
      EXPECT_LE(std::fabs(x - y), std::fabs(x) * (1.0f / 2048) + 1e-7f);
    }
  }
}

TEST(Half, Bf16) {
  EXPECT_EQ(f32_to_bf16(1.0f).bits, 0x3F80);
  EXPECT_EQ(bf16_to_f32(bf16{0x3F80}), 1.0f);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3F808000u)).bits, 0x3F80);  // tie -> even
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3F818000u)).bits, 0x3F82);
}

// The depth of '[' / '{' outside strings: brackets inside strings (escaped quotes too) do not
// count, closers bring it down, and counting stops just past the limit.
TEST(JsonDepth, CountsNestingOutsideStrings) {
  EXPECT_EQ(json_nesting_depth(""), 0);
  EXPECT_EQ(json_nesting_depth("3"), 0);
  EXPECT_EQ(json_nesting_depth("[]"), 1);
  EXPECT_EQ(json_nesting_depth(R"({"a": [1, {"b": []}], "c": {}})"), 4);
  EXPECT_EQ(json_nesting_depth(R"(["[[[[", "{{"])"), 1);
  EXPECT_EQ(json_nesting_depth(R"(["\"[[[", "\\", [[]]])"), 3);  // \" and \\ stay inside
  EXPECT_EQ(json_nesting_depth("[][][][]"), 1);
  EXPECT_EQ(json_nesting_depth("]]]][]"), 1);  // stray closers never go below zero
  const std::string deep = std::string(100000, '[');
  EXPECT_EQ(json_nesting_depth(deep), kMaxJsonDepth + 1);
  EXPECT_EQ(json_nesting_depth(deep, 10), 11);
  EXPECT_EQ(json_nesting_depth(std::string(kMaxJsonDepth, '{')), kMaxJsonDepth);
}

}  // namespace
}  // namespace kiln
