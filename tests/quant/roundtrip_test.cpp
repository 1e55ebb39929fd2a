// tests/quant/roundtrip_test.cpp: quantize -> dequantize error bounds on random data, the
// reference dot products against the dot of decoded rows, and the odd inputs (zeros, large
// magnitudes, NaN/Inf) that must either round-trip or show up as NaN, never as plausible numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/half.h"
#include "quant/quant.h"

namespace kiln::quant {
namespace {

struct Bound {
  DType t;
  double max_rel_rms;  // RMS error / RMS of the data, on N(0,1) rows
};

// Bounds sit ~15 % above what the llama.cpp reference algorithms reach on Gaussian data
// (the achieved figure is printed; it varies by < 2 % between seeds); an encoder that picks
// worse scales or codes misses them.
const std::vector<Bound>& bounds() {
  static const std::vector<Bound> b = {
      {DType::F32, 0.0},        {DType::F16, 2.5e-4},     {DType::BF16, 2e-3},
      {DType::Q8_0, 6.2e-3},    {DType::Q8_1, 6.2e-3},    {DType::Q8_K, 8e-3},
      {DType::Q6_K, 2.05e-2},   {DType::Q5_K, 4.15e-2},   {DType::Q5_0, 4.9e-2},
      {DType::Q5_1, 4.35e-2},   {DType::Q4_K, 8.2e-2},    {DType::Q4_0, 9.9e-2},
      {DType::Q4_1, 9e-2},      {DType::Q3_K, 1.73e-1},   {DType::Q2_K, 3.4e-1},
      {DType::IQ4_NL, 8.75e-2}, {DType::IQ4_XS, 8.85e-2},
  };
  return b;
}

double bound_of(DType t) {
  for (const Bound& b : bounds())
    if (b.t == t) return b.max_rel_rms;
  return 1.0;
}

uint32_t test_seed() {
  static const uint32_t seed = std::random_device{}();
  return seed;
}

std::vector<float> gaussian(size_t n, std::mt19937& rng, float sigma = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<std::byte> encode(DType t, const std::vector<float>& x) {
  std::vector<std::byte> out(*row_bytes(t, x.size()));
  quantize_row(t, x, out);
  return out;
}

std::vector<float> decode(DType t, const std::vector<std::byte>& b, size_t n) {
  std::vector<float> out(n);
  dequantize_row(t, b, out);
  return out;
}

TEST(QuantRoundTrip, GaussianRowsWithinBound) {
  std::mt19937 rng(test_seed());
  std::printf("seed %u\n", test_seed());
  constexpr size_t n = 4096;
  for (const Bound& b : bounds()) {
    double err2 = 0, ref2 = 0;
    for (int row = 0; row < 8; ++row) {
      const auto x = gaussian(n, rng);
      const auto y = decode(b.t, encode(b.t, x), n);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(std::isfinite(y[i])) << dtype_name(b.t) << " element " << i;
        err2 += (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
        ref2 += double(x[i]) * x[i];
      }
    }
    const double rel = std::sqrt(err2 / ref2);
    std::printf("  %-5s relative RMS error %.5f (bound %.5f)\n",
                std::string(dtype_name(b.t)).c_str(), rel, b.max_rel_rms);
    EXPECT_LE(rel, b.max_rel_rms) << dtype_name(b.t);
  }
}

TEST(QuantRoundTrip, EncodingIsDeterministic) {
  std::mt19937 rng(test_seed() + 1);
  const auto x = gaussian(1024, rng);
  for (const Bound& b : bounds()) EXPECT_EQ(encode(b.t, x), encode(b.t, x)) << dtype_name(b.t);
}

TEST(QuantRoundTrip, RequantizingDecodedRowIsStable) {
  // Encoding what a block decodes to must not drift far: the second round trip may move a
  // value by at most one quantization step, measured as the first round trip's error.
  std::mt19937 rng(test_seed() + 2);
  const auto x = gaussian(1024, rng);
  for (const Bound& b : bounds()) {
    const auto y = decode(b.t, encode(b.t, x), x.size());
    const auto z = decode(b.t, encode(b.t, y), x.size());
    double e1 = 0, e2 = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      e1 += (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
      e2 += (double(z[i]) - y[i]) * (double(z[i]) - y[i]);
    }
    EXPECT_LE(e2, e1 + 1e-12) << dtype_name(b.t);
  }
}

TEST(QuantRoundTrip, ZerosStayZero) {
  const std::vector<float> x(512, 0.0f);
  for (const Bound& b : bounds()) {
    const auto y = decode(b.t, encode(b.t, x), x.size());
    for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y[i], 0.0f) << dtype_name(b.t) << " " << i;
  }
}

TEST(QuantRoundTrip, LargeMagnitudesKeepRelativeError) {
  // 3e4 is near the top of f16 (65504): the f16 block scales must still hold it.
  std::mt19937 rng(test_seed() + 3);
  const auto x = gaussian(1024, rng, 1e4f);
  for (const Bound& b : bounds()) {
    const auto y = decode(b.t, encode(b.t, x), x.size());
    double err2 = 0, ref2 = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << dtype_name(b.t);
      err2 += (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
      ref2 += double(x[i]) * x[i];
    }
    EXPECT_LE(std::sqrt(err2 / ref2), b.max_rel_rms * 1.2 + 1e-6) << dtype_name(b.t);
  }
}

TEST(QuantRoundTrip, NonFiniteInputDecodesAsNaN) {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> x(512, 0.5f);
    x[300] = bad;  // second 256-block, tenth 32-block
    for (const Bound& b : bounds()) {
      const auto y = decode(b.t, encode(b.t, x), x.size());
      if (b.t == DType::F32 || b.t == DType::F16 || b.t == DType::BF16) {
        EXPECT_FALSE(std::isfinite(y[300])) << dtype_name(b.t);
        continue;
      }
      const size_t block = traits(b.t).block_size;
      const size_t first = 300 / block * block;
      for (size_t i = first; i < first + block; ++i)
        ASSERT_TRUE(std::isnan(y[i])) << dtype_name(b.t) << " element " << i << " = " << y[i];
      // Other blocks are unaffected.
      EXPECT_TRUE(std::isfinite(y[0])) << dtype_name(b.t);
    }
  }
}

TEST(QuantRoundTrip, NaNScaleInStoredBlockPropagates) {
  // A corrupt file with a NaN block scale must decode to NaN, not to zeros or finite values.
  for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q2_K,
                  DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K}) {
    const size_t n = traits(t).block_size;
    std::vector<float> x(n, 1.0f);
    x[0] = -2.0f;
    auto enc = encode(t, x);
    // Every format keeps its f16 scale d either first or last two... locate it by format.
    size_t d_off = 0;
    if (t == DType::Q2_K)
      d_off = 80;
    else if (t == DType::Q3_K)
      d_off = 108;
    else if (t == DType::Q6_K)
      d_off = 208;
    enc[d_off] = std::byte{0x00};
    enc[d_off + 1] = std::byte{0x7e};  // f16 quiet NaN
    const auto y = decode(t, enc, n);
    size_t nan_count = 0;
    for (float v : y) nan_count += std::isnan(v) ? 1 : 0;
    EXPECT_GT(nan_count, 0u) << dtype_name(t);
  }
}

// The reference dots equal the dot of the decoded operands up to float rounding: the integer
// part is exact and only the per-block scaling is rounded.
TEST(QuantVecDot, MatchesDotOfDecodedRows) {
  std::mt19937 rng(test_seed() + 4);
  const DType types[] = {DType::F32,  DType::F16,    DType::BF16,   DType::Q4_0,
                         DType::Q4_1, DType::Q5_0,   DType::Q5_1,   DType::Q8_0,
                         DType::Q2_K, DType::Q3_K,   DType::Q4_K,   DType::Q5_K,
                         DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS, DType::MXFP4};
  for (DType t : types) {
    for (size_t n : {size_t{256}, size_t{1024}, size_t{4096}}) {
      const auto wx = gaussian(n, rng);
      const auto ax = gaussian(n, rng);
      const auto w = encode(t, wx);
      const DType at = vec_dot_type(t);
      const auto a = encode(at, ax);
      const auto wd = decode(t, w, n);
      const auto ad = decode(at, a, n);
      double ref = 0, mag = 0, exact = 0;
      for (size_t i = 0; i < n; ++i) {
        ref += double(wd[i]) * ad[i];
        mag += std::fabs(double(wd[i]) * ad[i]);
        exact += double(wx[i]) * ax[i];
      }
      // Q4_1/Q5_1 take their min term from Q8_1's s = d * sum(q), stored as f16.
      double min_term = 0;
      if (at == DType::Q8_1) {
        const size_t wb = traits(t).type_size, ab = traits(at).type_size;
        for (size_t blk = 0; blk < n / 32; ++blk) {
          f16 m, s;
          std::memcpy(&m, w.data() + blk * wb + 2, 2);
          std::memcpy(&s, a.data() + blk * ab + 2, 2);
          min_term += std::fabs(double(f16_to_f32(m)) * f16_to_f32(s));
        }
      }
      const float got = vec_dot(t, static_cast<int64_t>(n), w, a);
      ASSERT_TRUE(std::isfinite(got));
      EXPECT_NEAR(got, ref, 2e-6 * mag + 1e-3 * min_term + 1e-6) << dtype_name(t) << " n=" << n;
      // And against the unquantized inputs, within the quantization error of both operands.
      // Each operand's relative error is at most its round-trip bound; on unit Gaussians the
      // dot's error is then ~N(0, (ew^2 + ea^2) n): allow 5 sigma.
      const double ew = bound_of(t), ea = bound_of(at);
      EXPECT_NEAR(got, exact, 5 * std::sqrt((ew * ew + ea * ea) * double(n)) + 1e-4)
          << dtype_name(t) << " n=" << n;
    }
  }
  std::printf("seed %u\n", test_seed());
}

TEST(QuantVecDot, ActivationTypes) {
  EXPECT_EQ(vec_dot_type(DType::Q4_0), DType::Q8_0);
  EXPECT_EQ(vec_dot_type(DType::Q5_0), DType::Q8_0);
  EXPECT_EQ(vec_dot_type(DType::Q8_0), DType::Q8_0);
  EXPECT_EQ(vec_dot_type(DType::Q4_1), DType::Q8_1);
  EXPECT_EQ(vec_dot_type(DType::Q5_1), DType::Q8_1);
  for (DType t : {DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_XS})
    EXPECT_EQ(vec_dot_type(t), DType::Q8_K);
  EXPECT_EQ(vec_dot_type(DType::IQ4_NL), DType::Q8_0);
  EXPECT_EQ(vec_dot_type(DType::F16), DType::F32);
}

TEST(QuantVecDot, Q8_1CarriesBlockSums) {
  // Q8_1's s field is d * sum(q): what the Q4_1/Q5_1 dots use for the min term.
  std::mt19937 rng(test_seed() + 5);
  const auto x = gaussian(64, rng);
  const auto enc = encode(DType::Q8_1, x);
  for (int blk = 0; blk < 2; ++blk) {
    const std::byte* p = enc.data() + blk * 36;
    f16 d, s;
    std::memcpy(&d, p, 2);
    std::memcpy(&s, p + 2, 2);
    int sum = 0;
    for (int j = 0; j < 32; ++j) sum += static_cast<int8_t>(p[4 + j]);
    // llama.cpp multiplies by d before rounding d to f16, so allow f16's half-ulp of each.
    const float want = static_cast<float>(sum) * f16_to_f32(d);
    EXPECT_NEAR(f16_to_f32(s), want, std::fabs(want) * 1.5e-3f);
  }
}

}  // namespace
}  // namespace kiln::quant
