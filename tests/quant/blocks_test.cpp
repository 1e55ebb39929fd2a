// tests/quant/blocks_test.cpp: block layouts. Sizes agree with the dtype table, and a block
// built by hand (known scales and codes) decodes to the values the format's definition gives,
// computed here element by element from the bit layout rather than by the decoder's loops.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/half.h"
#include "quant/blocks.h"
#include "quant/quant.h"

namespace kiln::quant {
namespace {

template <typename Block>
std::vector<float> decode(DType t, const Block& b, int n) {
  std::vector<std::byte> bytes(sizeof(Block));
  std::memcpy(bytes.data(), &b, sizeof(Block));
  std::vector<float> out(static_cast<size_t>(n));
  dequantize_row(t, bytes, out);
  return out;
}

// Scales are powers of two and codes small integers, so every expected value is exact in
// any evaluation order and the comparison can be exact.
void expect_exact(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "element " << i;
}

TEST(QuantBlocks, SizesMatchDtypeTable) {
  const std::array<std::pair<DType, size_t>, 14> sizes = {{
      {DType::Q4_0, sizeof(block_q4_0)},
      {DType::Q4_1, sizeof(block_q4_1)},
      {DType::Q5_0, sizeof(block_q5_0)},
      {DType::Q5_1, sizeof(block_q5_1)},
      {DType::Q8_0, sizeof(block_q8_0)},
      {DType::Q8_1, sizeof(block_q8_1)},
      {DType::Q2_K, sizeof(block_q2_K)},
      {DType::Q3_K, sizeof(block_q3_K)},
      {DType::Q4_K, sizeof(block_q4_K)},
      {DType::Q5_K, sizeof(block_q5_K)},
      {DType::Q6_K, sizeof(block_q6_K)},
      {DType::Q8_K, sizeof(block_q8_K)},
      {DType::IQ4_NL, sizeof(block_iq4_nl)},
      {DType::IQ4_XS, sizeof(block_iq4_xs)},
  }};
  for (auto [t, size] : sizes) {
    EXPECT_EQ(traits(t).type_size, size) << dtype_name(t);
    EXPECT_TRUE(can_dequantize(t)) << dtype_name(t);
    EXPECT_TRUE(can_quantize(t)) << dtype_name(t);
  }
  EXPECT_EQ(traits(DType::Q4_K).block_size, static_cast<uint32_t>(kQK_K));
  EXPECT_EQ(traits(DType::Q4_0).block_size, static_cast<uint32_t>(kQK4_0));
  EXPECT_FALSE(can_dequantize(DType::IQ2_XXS));
}

TEST(QuantBlocks, FloatFormats) {
  const std::vector<float> want = {1.0f, -2.5f, 0.0f, 65504.0f, -0.000061035156f, 3.0f};
  std::vector<std::byte> h(want.size() * 2), b(want.size() * 2), f(want.size() * 4);
  for (size_t i = 0; i < want.size(); ++i) {
    const uint16_t hb = f32_to_f16(want[i]).bits, bb = f32_to_bf16(want[i]).bits;
    std::memcpy(h.data() + 2 * i, &hb, 2);
    std::memcpy(b.data() + 2 * i, &bb, 2);
    std::memcpy(f.data() + 4 * i, &want[i], 4);
  }
  std::vector<float> out(want.size());
  dequantize_row(DType::F16, h, out);
  expect_exact(out, want);
  dequantize_row(DType::F32, f, out);
  expect_exact(out, want);
  dequantize_row(DType::BF16, b, out);
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(out[i], want[i], std::fabs(want[i]) / 128) << i;  // bf16: 8 significant bits
  // bf16 is the top half of the f32 bits.
  const uint16_t one = 0x3f80;
  std::memcpy(b.data(), &one, 2);
  dequantize_row(DType::BF16, b, out);
  EXPECT_EQ(out[0], 1.0f);
}

TEST(QuantBlocks, Q4_0) {
  block_q4_0 b{};
  b.d = f32_to_f16(0.5f);
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  std::vector<float> want(32);
  for (int e = 0; e < 32; ++e) {
    const int q = e < 16 ? (b.qs[e] & 15) : (b.qs[e - 16] >> 4);
    want[e] = 0.5f * static_cast<float>(q - 8);
  }
  expect_exact(decode(DType::Q4_0, b, 32), want);
  EXPECT_EQ(want[0], -4.0f);  // code 0 is -8 * d
  EXPECT_EQ(want[16], 3.5f);  // code 15 is 7 * d
}

// ggml's kvalues_iq4nl, spelled out here rather than read from blocks.h.
constexpr int kGrid[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                           1,    13,   25,  38,  53,  69,  89,  113};

TEST(QuantBlocks, IQ4_NL) {
  block_iq4_nl b{};
  b.d = f32_to_f16(0.25f);
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  std::vector<float> want(32);
  for (int e = 0; e < 32; ++e) {
    const int q = e < 16 ? (b.qs[e] & 15) : (b.qs[e - 16] >> 4);
    want[e] = 0.25f * static_cast<float>(kGrid[q]);
  }
  expect_exact(decode(DType::IQ4_NL, b, 32), want);
  EXPECT_EQ(want[0], -31.75f);  // code 0: -127 * d
  EXPECT_EQ(want[16], 28.25f);  // code 15: 113 * d
}

TEST(QuantBlocks, IQ4_XS) {
  block_iq4_xs b{};
  b.d = f32_to_f16(0.5f);
  // Sub-block scales ls = 32 + s with s in [-32, 31]: the low nibble in scales_l, the high
  // 2 bits in scales_h.
  const int s[8] = {-32, 31, 0, 1, -1, 17, -17, 5};
  for (int ib = 0; ib < 8; ++ib) {
    const int ls = s[ib] + 32;
    b.scales_l[ib / 2] = static_cast<uint8_t>(b.scales_l[ib / 2] | ((ls & 15) << (4 * (ib % 2))));
    b.scales_h = static_cast<uint16_t>(b.scales_h | ((ls >> 4) << (2 * ib)));
  }
  for (int j = 0; j < 128; ++j) b.qs[j] = static_cast<uint8_t>((j * 7 + 3) & 0xFF);
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int ib = e / 32, k = e % 32;
    const uint8_t byte = b.qs[ib * 16 + k % 16];
    const int q = k < 16 ? (byte & 15) : (byte >> 4);
    want[e] = 0.5f * static_cast<float>(s[ib]) * static_cast<float>(kGrid[q]);
  }
  expect_exact(decode(DType::IQ4_XS, b, 256), want);
}

TEST(QuantBlocks, Q4_1) {
  block_q4_1 b{};
  b.d = f32_to_f16(0.25f);
  b.m = f32_to_f16(-1.5f);
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(((j * 5) & 15) | (j << 4));
  std::vector<float> want(32);
  for (int e = 0; e < 32; ++e) {
    const int q = e < 16 ? (b.qs[e] & 15) : (b.qs[e - 16] >> 4);
    want[e] = 0.25f * static_cast<float>(q) - 1.5f;
  }
  expect_exact(decode(DType::Q4_1, b, 32), want);
}

TEST(QuantBlocks, Q5_0AndQ5_1) {
  const uint32_t qh = 0xA5C3F00Fu;
  block_q5_0 b{};
  b.d = f32_to_f16(2.0f);
  block_q5_1 c{};
  c.d = f32_to_f16(0.125f);
  c.m = f32_to_f16(3.0f);
  std::memcpy(b.qh, &qh, 4);
  std::memcpy(c.qh, &qh, 4);
  for (int j = 0; j < 16; ++j) b.qs[j] = c.qs[j] = static_cast<uint8_t>(j | (((j + 3) & 15) << 4));
  std::vector<float> want0(32), want1(32);
  for (int e = 0; e < 32; ++e) {
    const int lo = e < 16 ? (b.qs[e] & 15) : (b.qs[e - 16] >> 4);
    const int q = lo | static_cast<int>(((qh >> e) & 1) << 4);
    want0[e] = 2.0f * static_cast<float>(q - 16);
    want1[e] = 0.125f * static_cast<float>(q) + 3.0f;
  }
  expect_exact(decode(DType::Q5_0, b, 32), want0);
  expect_exact(decode(DType::Q5_1, c, 32), want1);
}

TEST(QuantBlocks, Q8_0AndQ8_1) {
  block_q8_0 b{};
  block_q8_1 c{};
  b.d = c.d = f32_to_f16(0.0625f);
  for (int j = 0; j < 32; ++j) b.qs[j] = c.qs[j] = static_cast<int8_t>(j * 8 - 128);
  std::vector<float> want(32);
  for (int e = 0; e < 32; ++e) want[e] = 0.0625f * static_cast<float>(e * 8 - 128);
  expect_exact(decode(DType::Q8_0, b, 32), want);
  expect_exact(decode(DType::Q8_1, c, 32), want);
}

TEST(QuantBlocks, Q2_K) {
  block_q2_K b{};
  b.d = f32_to_f16(0.5f);
  b.dmin = f32_to_f16(0.25f);
  for (int i = 0; i < 16; ++i) b.scales[i] = static_cast<uint8_t>((i & 15) | ((15 - i) << 4));
  for (int i = 0; i < 64; ++i) b.qs[i] = static_cast<uint8_t>(i * 37 + 11);
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int n = e / 128, p = e % 128, shift = 2 * (p / 32), l = p % 32;
    const int q = (b.qs[n * 32 + l] >> shift) & 3;
    const uint8_t sc = b.scales[e / 16];
    want[e] = 0.5f * static_cast<float>(sc & 15) * static_cast<float>(q) -
              0.25f * static_cast<float>(sc >> 4);
  }
  expect_exact(decode(DType::Q2_K, b, 256), want);
}

TEST(QuantBlocks, Q3_K) {
  block_q3_K b{};
  b.d = f32_to_f16(0.5f);
  int s6[16];
  for (int i = 0; i < 16; ++i) s6[i] = (i * 13 + 5) % 64;  // stored scale = signed scale + 32
  for (int i = 0; i < 16; ++i) {
    if (i < 8)
      b.scales[i] |= static_cast<uint8_t>(s6[i] & 15);
    else
      b.scales[i - 8] |= static_cast<uint8_t>((s6[i] & 15) << 4);
    b.scales[8 + i % 4] |= static_cast<uint8_t>((s6[i] >> 4) << (2 * (i / 4)));
  }
  for (int i = 0; i < 64; ++i) b.qs[i] = static_cast<uint8_t>(i * 53 + 7);
  for (int i = 0; i < 32; ++i) b.hmask[i] = static_cast<uint8_t>(i * 29 + 3);
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int n = e / 128, p = e % 128, j = p / 32, l = p % 32;
    const int low = (b.qs[n * 32 + l] >> (2 * j)) & 3;
    const bool high = (b.hmask[l] >> (4 * n + j)) & 1;
    const int q = low - (high ? 0 : 4);
    want[e] = 0.5f * static_cast<float>(s6[e / 16] - 32) * static_cast<float>(q);
  }
  expect_exact(decode(DType::Q3_K, b, 256), want);
}

// Q4_K / Q5_K's 12 scale bytes, packed from 8 six-bit scales and mins.
void pack_k4_scales(const int sc[8], const int mn[8], uint8_t out[12]) {
  std::memset(out, 0, 12);
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      out[j] = static_cast<uint8_t>(sc[j]);
      out[j + 4] = static_cast<uint8_t>(mn[j]);
    } else {
      out[j + 4] = static_cast<uint8_t>((sc[j] & 15) | ((mn[j] & 15) << 4));
      out[j - 4] |= static_cast<uint8_t>((sc[j] >> 4) << 6);
      out[j] |= static_cast<uint8_t>((mn[j] >> 4) << 6);
    }
  }
}

TEST(QuantBlocks, Q4_KAndQ5_K) {
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = (j * 23 + 9) % 64;
    mn[j] = (j * 41 + 60) % 64;
  }
  block_q4_K b{};
  block_q5_K c{};
  b.d = c.d = f32_to_f16(0.25f);
  b.dmin = c.dmin = f32_to_f16(0.125f);
  pack_k4_scales(sc, mn, b.scales);
  pack_k4_scales(sc, mn, c.scales);
  for (int i = 0; i < 128; ++i) b.qs[i] = c.qs[i] = static_cast<uint8_t>(i * 71 + 13);
  for (int i = 0; i < 32; ++i) c.qh[i] = static_cast<uint8_t>(i * 97 + 1);
  std::vector<float> want4(256), want5(256);
  for (int e = 0; e < 256; ++e) {
    const int chunk = e / 64, r = e % 64;
    const uint8_t byte = b.qs[chunk * 32 + r % 32];
    const int lo = r < 32 ? (byte & 15) : (byte >> 4);
    const int hi = (c.qh[r % 32] >> (2 * chunk + (r >= 32 ? 1 : 0))) & 1;
    const int sb = e / 32;
    want4[e] = 0.25f * static_cast<float>(sc[sb]) * static_cast<float>(lo) -
               0.125f * static_cast<float>(mn[sb]);
    want5[e] = 0.25f * static_cast<float>(sc[sb]) * static_cast<float>(lo + 16 * hi) -
               0.125f * static_cast<float>(mn[sb]);
  }
  expect_exact(decode(DType::Q4_K, b, 256), want4);
  expect_exact(decode(DType::Q5_K, c, 256), want5);
}

TEST(QuantBlocks, Q6_K) {
  block_q6_K b{};
  b.d = f32_to_f16(0.5f);
  for (int i = 0; i < 16; ++i) b.scales[i] = static_cast<int8_t>(i * 17 - 128);
  for (int i = 0; i < 128; ++i) b.ql[i] = static_cast<uint8_t>(i * 89 + 5);
  for (int i = 0; i < 64; ++i) b.qh[i] = static_cast<uint8_t>(i * 61 + 17);
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) {
    const int n = e / 128, p = e % 128, k = p / 32, l = p % 32;
    const uint8_t lbyte = b.ql[n * 64 + l + (k & 1) * 32];
    const int lo = k < 2 ? (lbyte & 15) : (lbyte >> 4);
    const int hi = (b.qh[n * 32 + l] >> (2 * k)) & 3;
    const int q = (lo | (hi << 4)) - 32;
    want[e] = 0.5f * static_cast<float>(b.scales[e / 16]) * static_cast<float>(q);
  }
  expect_exact(decode(DType::Q6_K, b, 256), want);
}

TEST(QuantBlocks, Q8_K) {
  block_q8_K b{};
  b.d = 0.03125f;
  for (int i = 0; i < 256; ++i) b.qs[i] = static_cast<int8_t>(i - 128);
  std::vector<float> want(256);
  for (int e = 0; e < 256; ++e) want[e] = 0.03125f * static_cast<float>(e - 128);
  expect_exact(decode(DType::Q8_K, b, 256), want);
}

// The reference encoders reproduce a block that is exactly representable: decode(encode(x))
// == x when x was itself decoded from a block whose extreme code sits where the encoder puts it.
TEST(QuantBlocks, ExactBlocksSurviveReencoding) {
  // Q8_0: amax/127 == d exactly when the extreme code is +-127 and d is a power of two.
  block_q8_0 b{};
  b.d = f32_to_f16(0.0625f);
  for (int j = 0; j < 32; ++j) b.qs[j] = static_cast<int8_t>((j * 19) % 255 - 127);
  b.qs[5] = -127;
  const auto x = decode(DType::Q8_0, b, 32);
  std::vector<std::byte> enc(sizeof(block_q8_0));
  quantize_row(DType::Q8_0, x, enc);
  EXPECT_EQ(std::memcmp(enc.data(), &b, sizeof(b)), 0);
  // Q4_0: the largest magnitude is negative and maps to code 0 (d = max / -8).
  block_q4_0 c{};
  c.d = f32_to_f16(0.25f);
  for (int j = 0; j < 16; ++j)
    c.qs[j] = static_cast<uint8_t>(((j * 7 + 1) & 15) | (((j * 3 + 2) & 15) << 4));
  c.qs[3] = 0x80;  // element 3 -> code 0 (-8 d), element 19 -> code 8 (0)
  const auto y = decode(DType::Q4_0, c, 32);
  std::vector<std::byte> enc4(sizeof(block_q4_0));
  quantize_row(DType::Q4_0, y, enc4);
  std::vector<float> y2(32);
  dequantize_row(DType::Q4_0, enc4, y2);
  expect_exact(y2, y);
}

// MXFP4: ggml's doubled E2M1 table and its half scale 2^(e - 128), the subnormal exponents
// 0 and 1 included; element j in the low nibble of qs[j], j + 16 in the high one.
TEST(QuantBlocks, Mxfp4) {
  EXPECT_EQ(mxfp4_scale_half(128), 1.0f);
  EXPECT_EQ(mxfp4_scale_half(127), 0.5f);
  EXPECT_EQ(mxfp4_scale_half(2), std::ldexp(1.0f, -126));
  EXPECT_EQ(mxfp4_scale_half(1), std::ldexp(1.0f, -127));
  EXPECT_EQ(mxfp4_scale_half(0), std::ldexp(1.0f, -128));
  EXPECT_EQ(mxfp4_scale_half(254), std::ldexp(1.0f, 126));
  const float e2m1[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};  // the format's values, from its spec
  block_mxfp4 b{};
  b.e = 129;  // half scale 2: x = 2 * (2 * e2m1) = 4 * e2m1
  for (int j = 0; j < 16; ++j) b.qs[j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  std::vector<float> want(32);
  for (int e = 0; e < 32; ++e) {
    const int q = e < 16 ? (b.qs[e] & 15) : (b.qs[e - 16] >> 4);
    want[e] = (q & 8 ? -4.0f : 4.0f) * e2m1[q & 7];
  }
  expect_exact(decode(DType::MXFP4, b, 32), want);
  // The encoder: the block's largest |x| sets e = floor(log2 amax) - 2 + 127; values on the
  // grid come back exactly.
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = want[static_cast<size_t>(i)] / 8.0f;  // amax 3: e 126
  std::vector<std::byte> enc(sizeof(block_mxfp4));
  quantize_row(DType::MXFP4, x, enc);
  EXPECT_EQ(static_cast<int>(enc[0]), 126);
  std::vector<float> back(32);
  dequantize_row(DType::MXFP4, enc, back);
  expect_exact(back, x);
}

}  // namespace
}  // namespace kiln::quant
