// tests/quant/pinned_test.cpp: every reference encoder, decoder and dot product pinned to the
// exact bits it produced before issue 31 rewrote src/quant around shared block loops. The
// golden files pin Q8_0/Q4_0 bytes against llama.cpp, but no file holds a K-quant encoding
// llama.cpp made from the same input, so these hashes are what keeps those bits from drifting.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "core/splitmix.h"
#include "quant/quant.h"

namespace kiln::quant {
namespace {

// A uniform float in [-1, 1), exact (24 random bits), the same on every machine.
float uniform(uint64_t& state) {
  return static_cast<float>(splitmix64(state) >> 40) * 0x1p-23f - 1.0f;
}

// Rows of 256-element super-blocks, each of a different character: the branches of the
// scale searches (zero and constant blocks, outliers, one-signed data, tiny and large
// magnitudes) all get taken.
std::vector<float> pinned_row(uint64_t seed, size_t n) {
  std::vector<float> x(n);
  uint64_t s = seed;
  for (size_t i = 0; i < n; ++i) {
    const float g = uniform(s) + uniform(s) + uniform(s) + uniform(s);  // bell-shaped
    const size_t j = i % 256;
    switch ((i / 256) % 8) {
      case 0:
        x[i] = g;
        break;
      case 1:
        x[i] = g * 1e-3f;
        break;
      case 2:
        x[i] = g * 3e3f;
        break;
      case 3:
        x[i] = g * g * g;
        break;
      case 4:
        x[i] = 0.5f + std::fabs(g) * 0.125f;
        break;  // one-signed, narrow: large dot sums
      case 5:
        x[i] = (j / 16) % 3 == 0 ? 0.0f : g;
        break;
      case 6:
        x[i] = j < 128 ? 0.75f : 0.0f;
        break;
      default:
        x[i] = j == 77 ? 40.0f * g : g;
        break;
    }
  }
  return x;
}

struct Hash {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64
  void bytes(const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      h ^= static_cast<const unsigned char*>(p)[i];
      h *= 0x100000001b3ull;
    }
  }
  // A NaN's sign and payload are not part of the contract, only that it is NaN.
  void floats(const std::vector<float>& v) {
    for (float f : v) {
      const uint32_t bits = std::isnan(f) ? 0x7fc00000u : std::bit_cast<uint32_t>(f);
      bytes(&bits, sizeof(bits));
    }
  }
};

// Encoding of a finite row and of one with a non-finite block, their decodings, and the
// finite row's dots with an encoded activation row, block by block.
uint64_t pinned_hash(DType t) {
  constexpr size_t n = 64 * 256;
  Hash h;
  std::vector<float> x = pinned_row(1, n);
  std::vector<std::byte> w(*row_bytes(t, n));
  std::vector<float> y(n);
  quantize_row(t, x, w);
  h.bytes(w.data(), w.size());
  dequantize_row(t, w, y);
  h.floats(y);

  // Activations correlated with the weights: large integer block sums, where the order in
  // which a dot applies the two scales changes the rounding.
  const DType at = vec_dot_type(t);
  std::vector<float> act = pinned_row(2, n);
  for (size_t i = 0; i < n; ++i) act[i] = x[i] + 0.25f * act[i];
  std::vector<std::byte> a(*row_bytes(at, n));
  quantize_row(at, act, a);
  // One dot per block: a longer sum would round away a last-bit change in one block's term.
  const size_t per = traits(t).block_size > 1 ? traits(t).block_size : 256;
  const size_t w_bytes = *row_bytes(t, per), a_bytes = *row_bytes(at, per);
  for (size_t r = 0; r < n / per; ++r) {
    const float dot =
        vec_dot(t, static_cast<int64_t>(per), std::span(w).subspan(r * w_bytes, w_bytes),
                std::span(a).subspan(r * a_bytes, a_bytes));
    h.bytes(&dot, sizeof(dot));
  }

  x[300] = std::numeric_limits<float>::infinity();
  quantize_row(t, x, w);
  h.bytes(w.data(), w.size());
  dequantize_row(t, w, y);
  h.floats(y);
  return h.h;
}

TEST(QuantPinned, SameBitsAsBeforeTheRewrite) {
#if !defined(__x86_64__) || defined(__FMA__)
  // The hashes come from an x86-64 build without FMA; a compiler that may fuse a * b + c
  // (aarch64, -mfma) rounds the scale searches differently, as it would llama.cpp's.
  GTEST_SKIP() << "hashes are for x86-64 without fused multiply-add";
#endif
  // Printed by this test built against src/quant as of 81c4e61 (before issue 31), whose
  // Q8_0/Q4_0 output the golden files show equal to llama-quantize's.
  struct Pin {
    DType t;
    uint64_t hash;
  };
  const Pin pins[] = {
      {DType::F32, 0x7837b56ccd223cceull},  {DType::F16, 0xdedcc61f4821df2full},
      {DType::BF16, 0x93d7776fdb20269full}, {DType::Q4_0, 0xfd5e3a683e3913d0ull},
      {DType::Q4_1, 0xc77ab99b945a0a12ull}, {DType::Q5_0, 0x62ac3eabb58a8345ull},
      {DType::Q5_1, 0x1ac90ed05cb9c825ull}, {DType::Q8_0, 0x871cc040cebd25d2ull},
      {DType::Q8_1, 0xc9f53e1a13e25cd4ull}, {DType::Q2_K, 0xa168cf473fc6c9edull},
      {DType::Q3_K, 0xbb0011c08ff18193ull}, {DType::Q4_K, 0x7f86cc29602816d1ull},
      {DType::Q5_K, 0x8cd85f2b6d7a03f2ull}, {DType::Q6_K, 0xb3d1e501fb13eb44ull},
      {DType::Q8_K, 0x3b4f0800f34fc684ull},
  };
  for (const Pin& p : pins)
    EXPECT_EQ(pinned_hash(p.t), p.hash)
        << dtype_name(p.t) << ": got 0x" << std::hex << pinned_hash(p.t);
}

}  // namespace
}  // namespace kiln::quant
