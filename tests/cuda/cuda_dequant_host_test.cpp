// tests/cuda/cuda_dequant_host_test.cpp: the CUDA kernels' block decoding (dequant.cuh,
// compiled here for the host) against quant's reference dequantize_row, bit for bit, for
// every weight type, on fresh random rows. Needs no GPU: the bit logic every CUDA matvec,
// matmul and get_rows kernel runs is checked on every CI machine.
#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <random>
#include <vector>

#include "backend/cuda/dequant.cuh"
#include "core/dtype.h"
#include "quant/quant.h"

namespace kiln {
namespace {

uint64_t seed() {
  static const uint64_t s =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return s;
}

constexpr DType kTypes[] = {DType::F32,  DType::F16,    DType::BF16,   DType::Q8_0,
                            DType::Q4_0, DType::Q4_1,   DType::Q5_0,   DType::Q5_1,
                            DType::Q2_K, DType::Q3_K,   DType::Q4_K,   DType::Q5_K,
                            DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS, DType::MXFP4};

// Decodes a whole row unit by unit, as the kernels do; aligned: the instantiation the matvec
// uses for 16-byte aligned rows (legal only when row_is_aligned()).
std::vector<float> decode_units(DType t, std::span<const std::byte> row, int64_t n_cols,
                                bool aligned = false) {
  std::vector<float> out(static_cast<size_t>(cuda::units_per_row(n_cols) * cuda::kUnit), NAN);
  const auto* p = reinterpret_cast<const uint8_t*>(row.data());
  cuda::dispatch_dtype(t, [&]<DType T>() {
    for (int64_t u = 0; u < cuda::units_per_row(n_cols); ++u) {
      if (aligned)
        cuda::dequant_unit<T, 16>(p, u, n_cols, out.data() + u * cuda::kUnit);
      else
        cuda::dequant_unit<T, 2>(p, u, n_cols, out.data() + u * cuda::kUnit);
    }
  });
  return out;
}

bool row_is_aligned(DType t, size_t row_bytes, int64_t n_cols) {
  const bool is_float = t == DType::F32 || t == DType::F16 || t == DType::BF16;
  return row_bytes % 16 == 0 && (!is_float || n_cols % cuda::kUnit == 0);
}

TEST(CudaDequantHost, EveryTypeMatchesReferenceBitExact) {
  std::mt19937_64 rng(seed());
  for (DType t : kTypes) {
    ASSERT_TRUE(cuda::cuda_supports(t)) << dtype_name(t);
    const int64_t block = traits(t).block_size;
    // Odd lengths where the format allows them (float rows end in a partial unit).
    const std::vector<int64_t> lengths =
        block == 1 ? std::vector<int64_t>{1, 31, 33, 64, 100, 257}
                   : std::vector<int64_t>{block, 3 * block, 9 * block, 16 * block};
    int aligned_rows = 0;
    for (int64_t n : lengths) {
      for (int rep = 0; rep < 8; ++rep) {
        std::normal_distribution<float> dist(0.0f, rep % 2 ? 0.05f : 3.0f);
        std::vector<float> src(static_cast<size_t>(n));
        for (float& v : src) v = dist(rng);
        if (rep == 2) src[0] = 0.0f;
        std::vector<std::byte> bytes(*row_bytes(t, static_cast<uint64_t>(n)));
        quant::quantize_row(t, src, bytes);
        std::vector<float> want(static_cast<size_t>(n));
        quant::dequantize_row(t, bytes, want);
        const std::vector<float> got = decode_units(t, bytes, n);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
              << dtype_name(t) << " n " << n << " i " << i << ": " << got[i] << " vs " << want[i]
              << " (seed " << seed() << ")";
        // The partial unit's tail reads as zero (the matvec relies on it).
        for (size_t i = static_cast<size_t>(n); i < got.size(); ++i)
          ASSERT_EQ(got[i], 0.0f) << dtype_name(t) << " tail " << i;
        if (row_is_aligned(t, bytes.size(), n)) {
          ++aligned_rows;
          const std::vector<float> got16 = decode_units(t, bytes, n, true);
          for (int64_t i = 0; i < n; ++i)
            ASSERT_EQ(std::bit_cast<uint32_t>(got16[i]), std::bit_cast<uint32_t>(want[i]))
                << dtype_name(t) << " aligned n " << n << " i " << i << " (seed " << seed() << ")";
        }
      }
    }
    EXPECT_GT(aligned_rows, 0) << dtype_name(t) << ": no length exercised the aligned decoder";
  }
}

// Random bytes, not only what the quantizer emits: every bit pattern of scales, mins and high
// bits must decode as the reference does (a quantizer may never produce some of them).
TEST(CudaDequantHost, RandomBlockBytesMatchReference) {
  std::mt19937_64 rng(seed() + 1);
  for (DType t : kTypes) {
    if (t == DType::F32 || t == DType::F16 || t == DType::BF16) continue;  // NaN payloads
    const int64_t n = 16 * traits(t).block_size;  // 16 blocks: rows of a multiple of 16 bytes
    std::vector<std::byte> bytes(*row_bytes(t, static_cast<uint64_t>(n)));
    for (int rep = 0; rep < 16; ++rep) {
      for (std::byte& b : bytes) b = static_cast<std::byte>(rng() & 0xFF);
      // Keep the f16 scales finite and modest so the comparison is about the bits of q.
      const DTypeTraits tr = traits(t);
      for (size_t blk = 0; blk < bytes.size() / tr.type_size; ++blk) {
        std::byte* b = bytes.data() + blk * tr.type_size;
        const uint16_t h = 0x2000 | static_cast<uint16_t>(rng() & 0x0FFF);  // ~1e-4 .. 1e-3
        auto put = [&](size_t off) {
          b[off] = static_cast<std::byte>(h & 0xFF);
          b[off + 1] = static_cast<std::byte>(h >> 8);
        };
        switch (t) {
          case DType::Q2_K:
            put(80);
            put(82);
            break;
          case DType::Q3_K:
            put(108);
            break;
          case DType::Q6_K:
            put(208);
            break;
          case DType::MXFP4:  // every exponent byte is a finite power of two (or inf * 0)
            break;
          case DType::Q4_K:
          case DType::Q5_K:
          case DType::Q4_1:
          case DType::Q5_1:
            put(0);
            put(2);
            break;
          default:
            put(0);
            break;
        }
      }
      std::vector<float> want(static_cast<size_t>(n));
      quant::dequantize_row(t, bytes, want);
      for (bool aligned : {false, true}) {
        const std::vector<float> got = decode_units(t, bytes, n, aligned);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
              << dtype_name(t) << " aligned " << aligned << " i " << i << ": " << got[i] << " vs "
              << want[i] << " (seed " << seed() << ")";
      }
    }
  }
}

// The kernels' IQ4 grid (two packed words) is ggml's table.
TEST(CudaDequantHost, IQ4GridMatchesQuant) {
  for (uint32_t q = 0; q < 16; ++q) EXPECT_EQ(cuda::iq4_value(q), quant::kIQ4NLValues[q]) << q;
}

TEST(CudaDequantHost, UnsupportedTypesAreRejected) {
  EXPECT_FALSE(cuda::cuda_supports(DType::IQ2_XXS));
  EXPECT_FALSE(cuda::cuda_supports(DType::Q8_K));
  EXPECT_FALSE(cuda::cuda_supports(DType::I32));
}

}  // namespace
}  // namespace kiln
