// tests/ops/matmul_tiling_test.cpp: the cpu matmul's per-token bit invariance
// (docs/determinism.md): a token's outputs must be the same bits whether its call holds 1 token or
// many, whatever row/token tile of the kernel it lands in and however many threads split the rows.
// Fresh random inputs each run (seed printed on failure), odd shapes, every weight type.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>

#include "backend/backend.h"
#include "backend/cpu/bf16_pairs.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/kernels.h"
#include "core/dtype.h"
#include "core/half.h"
#include "hwy/targets.h"
#include "ops_common.h"
#include "quant/blocks.h"
#include "quant/quant.h"

namespace kiln {
namespace {

using kiln::testing::ops_seed;
using kiln::testing::random_vec;

class MatmulTiling : public ::testing::TestWithParam<DType> {};

TEST_P(MatmulTiling, TokenResultsIndependentOfBatchAndThreads) {
  const DType type = GetParam();
  static std::unique_ptr<Backend> cpu1 = make_cpu_backend({.threads = 1}),
                                  cpu2 = make_cpu_backend({.threads = 2});
  std::mt19937_64 rng(ops_seed() ^ (static_cast<uint64_t>(type) << 8));
  const int64_t blk = traits(type).block_size;
  // k: two blocks of the type (three for 32-wide ones), so every path runs its block loop.
  const int64_t k = blk >= 256 ? 2 * blk : (blk > 1 ? 3 * blk : 67);
  for (int64_t n_rows : {1, 2, 5, 67}) {
    std::vector<std::byte> bytes(*row_bytes(type, k) * n_rows);
    for (int64_t r = 0; r < n_rows; ++r) {
      const std::vector<float> src = random_vec(rng, k, 0.05f);
      quant::quantize_row(
          type, src,
          std::span<std::byte>(bytes).subspan(r * *row_bytes(type, k), *row_bytes(type, k)));
    }
    const WeightMatrix w{.dtype = type,
                         .n_cols = k,
                         .n_rows = n_rows,
                         .row_bytes = *row_bytes(type, k),
                         .bytes = bytes};
    for (int64_t n_tok : {2, 3, 5, 7, 9, 13, 16, 37}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(type) << " rows " << n_rows << " k " << k
                                        << " n_tok " << n_tok << " seed " << ops_seed());
      const std::vector<float> x = random_vec(rng, n_tok * k, 1.0f);
      std::vector<float> y_all(n_tok * n_rows, NAN), y_all2(y_all.size(), NAN);
      cpu1->matmul(w, x, n_tok, y_all);
      cpu2->matmul(w, x, n_tok, y_all2);
      ASSERT_EQ(0, std::memcmp(y_all.data(), y_all2.data(), y_all.size() * sizeof(float)))
          << "1 vs 2 threads differ";
      for (int64_t t = 0; t < n_tok; ++t) {
        std::vector<float> y_one(n_rows, NAN);
        cpu1->matmul(w, std::span<const float>(x).subspan(t * k, k), 1, y_one);
        for (int64_t r = 0; r < n_rows; ++r) {
          const float a = y_all[t * n_rows + r], b = y_one[r];
          ASSERT_FALSE(std::isnan(b)) << "t " << t << " r " << r;
          ASSERT_EQ(0, std::memcmp(&a, &b, sizeof(float)))
              << "t " << t << " r " << r << ": batched " << a << " vs alone " << b;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, MatmulTiling,
                         ::testing::Values(DType::F32, DType::F16, DType::BF16, DType::Q8_0,
                                           DType::Q4_0, DType::Q5_0, DType::Q4_1, DType::Q4_K,
                                           DType::Q5_K, DType::Q6_K, DType::Q3_K, DType::Q2_K,
                                           DType::IQ4_NL, DType::IQ4_XS, DType::MXFP4),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Blocks with an f16 d and dmin (Q4_K, Q5_K, Q2_K): d = 2^(d_exp - 0..3), dmin = 2^(-9 - 0..3).
template <class Block>
void set_d_dmin(std::vector<std::byte>& bytes, int d_exp, std::mt19937_64& rng) {
  for (size_t off = 0; off < bytes.size(); off += sizeof(Block)) {
    Block blk;
    std::memcpy(&blk, bytes.data() + off, sizeof blk);
    blk.d = f32_to_f16(std::ldexp(1.0f, d_exp - static_cast<int>(rng() % 4)));
    blk.dmin = f32_to_f16(std::ldexp(1.0f, -9 - static_cast<int>(rng() % 4)));
    std::memcpy(bytes.data() + off, &blk, sizeof blk);
  }
}

// Raw random K-quant rows: every quant, scale and min value (Q5_K: every fifth bit), with finite
// moderate block scales (raw random f16 bits could be inf/NaN); a quarter of Q6_K blocks get
// scales of -128.
std::vector<std::byte> random_k_rows(DType type, int64_t k, int64_t n_rows, std::mt19937_64& rng) {
  std::vector<std::byte> bytes(*row_bytes(type, k) * n_rows);
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  if (type == DType::Q4_K) {
    set_d_dmin<quant::block_q4_K>(bytes, -8, rng);
  } else if (type == DType::Q5_K) {
    set_d_dmin<quant::block_q5_K>(bytes, -9, rng);
  } else if (type == DType::Q2_K) {
    set_d_dmin<quant::block_q2_K>(bytes, -8, rng);
  } else if (type == DType::Q3_K) {  // every code, high bit and 6-bit scale: raw bytes
    for (size_t off = 0; off < bytes.size(); off += sizeof(quant::block_q3_K)) {
      quant::block_q3_K blk;
      std::memcpy(&blk, bytes.data() + off, sizeof blk);
      blk.d = f32_to_f16(std::ldexp(rng() % 2 ? 1.0f : -1.0f, -9 - static_cast<int>(rng() % 4)));
      std::memcpy(bytes.data() + off, &blk, sizeof blk);
    }
  } else if (type == DType::IQ4_XS) {  // every code and 6-bit scale: raw bytes
    for (size_t off = 0; off < bytes.size(); off += sizeof(quant::block_iq4_xs)) {
      quant::block_iq4_xs blk;
      std::memcpy(&blk, bytes.data() + off, sizeof blk);
      blk.d = f32_to_f16(std::ldexp(rng() % 2 ? 1.0f : -1.0f, -9 - static_cast<int>(rng() % 4)));
      std::memcpy(bytes.data() + off, &blk, sizeof blk);
    }
  } else {
    for (size_t off = 0; off < bytes.size(); off += sizeof(quant::block_q6_K)) {
      quant::block_q6_K blk;
      std::memcpy(&blk, bytes.data() + off, sizeof blk);
      blk.d = f32_to_f16(std::ldexp(1.0f, -10 - static_cast<int>(rng() % 4)));
      if (rng() % 4 == 0) std::memset(blk.scales, 0x80, sizeof blk.scales);  // -128
      std::memcpy(bytes.data() + off, &blk, sizeof blk);
    }
  }
  return bytes;
}

// Backends with the fast kernels on 1 and 2 threads, the same without AMX (CpuOptions::amx;
// on a machine without AMX the two pairs run the same kernels), and one with the portable
// kernels (CpuOptions::portable_kernels), every fast kernel's oracle.
struct Cpus {
  std::unique_ptr<Backend> fast1 = make_cpu_backend({.threads = 1});
  std::unique_ptr<Backend> fast2 = make_cpu_backend({.threads = 2});
  std::unique_ptr<Backend> no_amx1 = make_cpu_backend({.threads = 1, .amx = false});
  std::unique_ptr<Backend> no_amx2 = make_cpu_backend({.threads = 2, .amx = false});
  std::unique_ptr<Backend> portable = make_cpu_backend({.threads = 1, .portable_kernels = true});
};
Cpus& cpus() {
  static Cpus c;
  return c;
}

// w x through the fast kernels (1 and 2 threads) and the portable ones (1 thread).
struct FastPortable {
  std::vector<float> fast1, fast2, portable;
};
FastPortable run_fast_portable(const WeightMatrix& w, const std::vector<float>& x, int64_t n_tok,
                               bool amx = true) {
  FastPortable r;
  r.fast1.resize(size_t(n_tok * w.n_rows));
  r.fast2.resize(r.fast1.size());
  r.portable.resize(r.fast1.size());
  (amx ? cpus().fast1 : cpus().no_amx1)->matmul(w, x, n_tok, r.fast1);
  (amx ? cpus().fast2 : cpus().no_amx2)->matmul(w, x, n_tok, r.fast2);
  cpus().portable->matmul(w, x, n_tok, r.portable);
  return r;
}

// n_tok random tokens of k: token 0 all zero (activation scale 0), token 1 with one huge element,
// token 3 with a NaN (which must come out NaN).
std::vector<float> edge_tokens(std::mt19937_64& rng, int64_t n_tok, int64_t k) {
  std::vector<float> x = random_vec(rng, size_t(n_tok * k), 1.0f);
  std::fill_n(x.begin(), k, 0.0f);
  if (n_tok > 1) x[size_t(k + 5)] = 3e30f;
  if (n_tok > 3) x[size_t(3 * k + 7)] = NAN;
  return x;
}

// The fast kernels change no bit: fast with 1 and 2 threads equals portable, and over
// edge_tokens' batch token 3's NaN reaches its outputs while token 2 stays finite.
void expect_same_bits(const FastPortable& r, int64_t n_tok, int64_t n_rows, const char* kernel) {
  ASSERT_EQ(0, std::memcmp(r.fast1.data(), r.portable.data(), r.fast1.size() * sizeof(float)))
      << kernel << " vs plain kernel differ";
  ASSERT_EQ(0, std::memcmp(r.fast1.data(), r.fast2.data(), r.fast1.size() * sizeof(float)))
      << kernel << " kernel: 1 vs 2 threads differ";
  if (n_tok > 3) {
    ASSERT_TRUE(std::isnan(r.fast1[size_t(3 * n_rows)]));
  }
  if (n_tok > 2) {
    ASSERT_FALSE(std::isnan(r.fast1[size_t(2 * n_rows)]));
  }
}

// The v2 batched Q4_K / Q6_K kernels (AVX-512 VNNI, 2+ tokens; on AVX2 machines kq_avx2-inl.h's)
// must give the plain kernels' bits, which the portable backend runs, so this is also the proof
// that the fast kernels change nothing but speed. On every SIMD target this machine runs (so an
// AVX-512 machine tests the AVX2 kernels too). Raw random blocks reach every quant, scale and min
// value; odd row counts (the two-row calls and a single row left over) split over 1 and 2 threads;
// 2..9 tokens (every token count of one tile, pairs and an odd last token) and 13/37 (several
// tiles, row-blocked); rows of 1..8 blocks and of 13 (above kBatchL1MaxBlocks: 5+ tokens in
// pieces); a column block of a wider matrix (strided rows); one token all zero, one with a huge
// element, one with a NaN.
TEST(MatmulKQBatch, SameBitsAsPlainKernel) {
  std::mt19937_64 rng(ops_seed() ^ 0x2545f491ULL);
  kiln::testing::for_each_simd_target([&] {
    SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target() << " seed " << ops_seed());
    for (DType type : {DType::Q4_K, DType::Q6_K}) {
      for (int64_t k : {256, 768, 2048, 3328}) {
        for (int64_t n_rows : {1, 2, 3, 67, 131}) {
          for (bool strided : {false, true}) {
            if (strided && n_rows != 67) continue;
            // strided: columns [256, 256 + k) of a matrix 512 wider.
            const int64_t k_all = strided ? k + 512 : k;
            const size_t rb = *row_bytes(type, k_all);
            const std::vector<std::byte> bytes = random_k_rows(type, k_all, n_rows, rng);
            const WeightMatrix full{
                .dtype = type, .n_cols = k_all, .n_rows = n_rows, .row_bytes = rb, .bytes = bytes};
            const WeightMatrix w = strided ? full.columns(256, k) : full;
            for (int64_t n_tok : {2, 3, 4, 5, 6, 7, 8, 9, 13, 37}) {
              SCOPED_TRACE(::testing::Message()
                           << dtype_name(type) << " k " << k << " rows " << n_rows << " strided "
                           << strided << " n_tok " << n_tok);
              const std::vector<float> x = edge_tokens(rng, n_tok, k);
              for (bool amx : {true, false}) {  // 37 tokens of Q4_K: AMX where usable
                expect_same_bits(run_fast_portable(w, x, n_tok, amx), n_tok, n_rows,
                                 amx ? "batched (AMX where usable)" : "batched v2");
                if (::testing::Test::HasFatalFailure()) return;
              }
            }
          }
        }
      }
    }
  });
}

// The Q4_K / Q5_K / Q6_K kernels of many tokens (MatmulKRows16 on AVX-512 VNNI, cpu_matmul_kq.cpp,
// from kKRowsMinTok tokens, Q6_K from kKRowsMinTokQ6K; Q4_K's and Q6_K's AMX kernels there from
// 16 tokens where the CPU has AMX-INT8, with and without CpuOptions::amx; on AVX2 machines
// kq_avx2-inl.h's) must give the plain kernels' bits, which the portable backend runs, so this is
// also the proof that the fast kernels change nothing but speed. Raw random blocks reach every
// quant, scale and min value; odd row counts (a partial 16-row group, a whole and a partial one)
// split over 1 and 2 threads and, at 3328 columns, rows past one row block; rows of 1, 3, 8, 9
// and 13 blocks; token counts below each kernel's minimum (the one-token and batched kernels
// there), at and past it with every remainder of the 4-token tile, 509; a column block of a
// wider matrix (strided rows); one token all zero, one with a huge element, one with a NaN.
TEST(MatmulKRows16, SameBitsAsPlainKernel) {
  std::mt19937_64 rng(ops_seed() ^ 0x61c88647ULL);
  SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target() << " seed " << ops_seed());
  for (DType type : {DType::Q4_K, DType::Q5_K, DType::Q6_K})
    for (int64_t k : {256, 768, 2048, 2304, 3328}) {
      for (int64_t n_rows : {1, 2, 3, 29, 67, 131, 333}) {
        if (n_rows == 29 && k != 768) continue;
        if (n_rows == 333 && k != 3328) continue;
        for (bool strided : {false, true}) {
          if (strided && n_rows != 67) continue;
          const int64_t k_all = strided ? k + 512 : k;
          const size_t rb = *row_bytes(type, k_all);
          const std::vector<std::byte> bytes = random_k_rows(type, k_all, n_rows, rng);
          const WeightMatrix full{
              .dtype = type, .n_cols = k_all, .n_rows = n_rows, .row_bytes = rb, .bytes = bytes};
          const WeightMatrix w = strided ? full.columns(256, k) : full;
          for (int64_t n_tok : {1, 2, 5, 9, 15, 16, 17, 18, 37, 63, 64, 66, 127, 131, 509}) {
            if (n_tok == 509 && (k > 768 || n_rows > 67)) continue;
            SCOPED_TRACE(::testing::Message()
                         << dtype_name(type) << " k " << k << " rows " << n_rows << " strided "
                         << strided << " n_tok " << n_tok);
            const std::vector<float> x = edge_tokens(rng, n_tok, k);
            for (bool amx : {true, false}) {  // Q4_K from 16 tokens: AMX where the CPU has it
              expect_same_bits(run_fast_portable(w, x, n_tok, amx), n_tok, n_rows,
                               amx ? "many tokens (AMX where usable)" : "many tokens (no AMX)");
              if (::testing::Test::HasFatalFailure()) return;
            }
          }
        }
      }
    }
}

// The CPU backend's Q8_K activation encoding (cpu::quantize_act_row, split into lanes for
// speed) must stay the reference encoder's bytes: the scale comes from the first element of
// the largest magnitude, so rows where +max and -max tie pin the pick; also all-zero rows,
// -0, a NaN and an infinity (both encode to NaN scale and zero quants and sums). Both the
// AVX-512 encoder (portable = false) and the scalar loop (portable = true).
TEST(ActQuant, Q8KSameBytesAsReference) {
  std::mt19937_64 rng(ops_seed() ^ 0x9e3779b9ULL);
  SCOPED_TRACE(::testing::Message() << "seed " << ops_seed());
  constexpr int64_t n = 4 * 256;
  const size_t bytes = cpu::act_row_bytes(cpu::ActKind::Q8_K, n);
  ASSERT_EQ(bytes, *row_bytes(DType::Q8_K, n));
  std::vector<std::byte> got(bytes), want(bytes);
  for (int variant = 0; variant < 400; ++variant) {
    SCOPED_TRACE(::testing::Message() << "variant " << variant);
    std::vector<float> x = random_vec(rng, n, 1.0f);
    if (variant % 4 == 1)  // small integers: many ties of +-max, in both orders
      for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 7) - 3);
    if (variant % 4 == 2) {
      std::fill_n(x.begin(), 256, 0.0f);  // block 0: zeros
      x[300] = -0.0f;
      x[256 + 17] = NAN;       // block 1: a NaN
      x[512 + 3] = -INFINITY;  // block 2: an infinity
    }
    quant::quantize_row(DType::Q8_K, x, want);
    for (bool portable : {false, true}) {
      cpu::quantize_act_row(cpu::ActKind::Q8_K, x.data(), n, got.data(), portable);
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), bytes)) << "portable " << portable;
    }
  }
}

// The AVX-512 Q8_0 activation encoder (portable = false) writes the scalar loop's bytes:
// random blocks, small integers (ties of +-max, exact .5 products), zeros and -0, a NaN, an
// infinity, huge and tiny magnitudes.
TEST(ActQuant, Q8_0SameBytesBothWays) {
  std::mt19937_64 rng(ops_seed() ^ 0x51ed27ULL);
  SCOPED_TRACE(::testing::Message() << "seed " << ops_seed());
  for (int64_t n : {int64_t{32}, int64_t{224}, int64_t{2048}}) {
    const size_t bytes = cpu::act_row_bytes(cpu::ActKind::Q8_0, n);
    std::vector<std::byte> simd(bytes), scalar(bytes);
    for (int variant = 0; variant < 300; ++variant) {
      SCOPED_TRACE(::testing::Message() << "n " << n << " variant " << variant);
      std::vector<float> x = random_vec(rng, size_t(n), 1.0f);
      if (variant % 5 == 1)
        for (float& v : x) v = static_cast<float>(static_cast<int>(rng() % 255) - 127);
      if (variant % 5 == 2) {
        std::fill_n(x.begin(), 32, 0.0f);
        x[1] = -0.0f;
        if (n > 32) x[32 + 5] = NAN;
        if (n > 64) x[64 + 30] = -INFINITY;
      }
      if (variant % 5 == 3)
        for (size_t i = 0; i < x.size(); ++i) x[i] *= (i % 3 == 0) ? 1e30f : 1e-30f;
      cpu::quantize_act_row(cpu::ActKind::Q8_0, x.data(), n, simd.data(), /*portable=*/false);
      cpu::quantize_act_row(cpu::ActKind::Q8_0, x.data(), n, scalar.data(), /*portable=*/true);
      // NaN scales compare by bits: both sides write the same NAN constant.
      ASSERT_EQ(0, std::memcmp(simd.data(), scalar.data(), bytes));
    }
  }
}

// The one-token kernels change no bit of w x for five tokens: random, tiny (1e-3), all zero
// (activation scale 0), one huge element, one NaN (which must come out NaN); fast with 1 and 2
// threads against portable.
void expect_one_token_same_bits(const WeightMatrix& w, std::mt19937_64& rng) {
  const int64_t k = w.n_cols;
  for (int variant = 0; variant < 5; ++variant) {
    SCOPED_TRACE(::testing::Message() << "variant " << variant);
    std::vector<float> x = random_vec(rng, k, variant == 1 ? 1e-3f : 1.0f);
    if (variant == 2) std::fill(x.begin(), x.end(), 0.0f);  // activation scale 0
    if (variant == 3) x[5] = 3e30f;                         // one huge element
    if (variant == 4) x[7] = NAN;                           // must come out NaN
    const auto [fast1, fast2, portable] = run_fast_portable(w, x, 1);
    ASSERT_EQ(0, std::memcmp(fast1.data(), portable.data(), fast1.size() * sizeof(float)))
        << "one-token vs plain kernel differ";
    ASSERT_EQ(0, std::memcmp(fast1.data(), fast2.data(), fast1.size() * sizeof(float)))
        << "one-token kernel: 1 vs 2 threads differ";
    if (variant == 4) {
      ASSERT_TRUE(std::isnan(fast1[0]));
    } else {
      ASSERT_FALSE(std::isnan(fast1[0]));
    }
  }
}

// The one-token Q4_K / Q5_K / Q6_K / IQ4_XS kernels (AVX-512 VNNI, decode; on AVX2 machines
// kq_avx2-inl.h's for Q4_K / Q6_K) and Q2_K / Q3_K ones (kq23-inl.h's row kernels, both targets)
// must give the plain kernels' bits,
// which the portable backend runs, so this is also the proof that the fast kernels change nothing
// but speed. On every SIMD target this machine runs. Raw random blocks reach every quant, scale and
// min value (the int16 lane sums' bounds and the vector decoding of the 6-bit scales); widths of 1,
// 3 and 4 blocks (the expert slices' 1024 columns) and of 13 (matrices where the software
// prefetch's span lies inside for most row groups and past the end for the last), odd row counts (a
// last row group of 1..3 rows) split over 1 and 2 threads; an all-zero token, one with a huge
// element and one with a NaN.
TEST(MatmulKQOne, SameBitsAsPlainKernel) {
  std::mt19937_64 rng(ops_seed() ^ 0x5bd1e995ULL);
  kiln::testing::for_each_simd_target([&] {
    SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target() << " seed " << ops_seed());
    for (DType type :
         {DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::Q2_K, DType::Q3_K, DType::IQ4_XS}) {
      for (int64_t k : {256, 768, 1024, 3328}) {
        for (int64_t n_rows : {1, 3, 11, 67, 131}) {
          const size_t rb = *row_bytes(type, k);
          const std::vector<std::byte> bytes = random_k_rows(type, k, n_rows, rng);
          const WeightMatrix w{
              .dtype = type, .n_cols = k, .n_rows = n_rows, .row_bytes = rb, .bytes = bytes};
          SCOPED_TRACE(::testing::Message()
                       << dtype_name(type) << " k " << k << " rows " << n_rows);
          expect_one_token_same_bits(w, rng);
          if (::testing::Test::HasFatalFailure()) return;
        }
      }
    }
  });
}

// Raw random Q8_0 / Q4_0 / Q5_0 / IQ4_NL rows: every quant value (Q8_0's -128 included, which
// quantize_row never writes), with finite moderate block scales, one block in 16 zero.
std::vector<std::byte> random_q8_family_rows(DType type, int64_t k, int64_t n_rows,
                                             std::mt19937_64& rng) {
  std::vector<std::byte> bytes(*row_bytes(type, k) * n_rows);
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  const size_t block = *row_bytes(type, 32);
  for (size_t off = 0; off < bytes.size(); off += block) {
    if (type == DType::MXFP4) {  // its scale is an exponent byte: 2^(e - 128) in [2^-16, 2^0]
      bytes[off] = static_cast<std::byte>(rng() % 16 == 0 ? 0 : 112 + rng() % 17);
      continue;
    }
    const f16 d =
        rng() % 16 == 0
            ? f32_to_f16(0.0f)
            : f32_to_f16(std::ldexp(rng() % 2 ? 1.0f : -1.0f, -8 - static_cast<int>(rng() % 6)));
    std::memcpy(bytes.data() + off, &d, sizeof d);  // d leads every block of these types
  }
  return bytes;
}

// The one-token Q8_0-family kernels (AVX-512 VNNI: every type, rows in groups of 4 and pairs;
// AVX2: Q8_0, rows in pairs) must give the plain kernel's bits, on every SIMD target this machine
// runs (where a target has no fast kernel both sides run the plain one): raw random quants (-128
// included) and block scales (some zero), rows of 1..65 blocks, row counts that leave every
// remainder of the 8-row groups (a pair, a single row) over 1 and 2 threads, a column block of
// a wider matrix (strided rows); the token zero, tiny, with a huge element, with a NaN.
TEST(MatmulQ8One, SameBitsAsPlainKernel) {
  std::mt19937_64 rng(ops_seed() ^ 0x3c6ef372ULL);
  kiln::testing::for_each_simd_target([&] {
    SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target() << " seed " << ops_seed());
    for (DType type : {DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::IQ4_NL, DType::MXFP4}) {
      for (int64_t k : {32, 96, 2048, 2080}) {
        for (int64_t n_rows : {1, 2, 3, 8, 11, 67, 131}) {
          for (bool strided : {false, true}) {
            if (strided && n_rows != 67) continue;
            const int64_t k_all = strided ? k + 64 : k;
            const std::vector<std::byte> bytes = random_q8_family_rows(type, k_all, n_rows, rng);
            const WeightMatrix full{.dtype = type,
                                    .n_cols = k_all,
                                    .n_rows = n_rows,
                                    .row_bytes = *row_bytes(type, k_all),
                                    .bytes = bytes};
            const WeightMatrix w = strided ? full.columns(32, k) : full;
            SCOPED_TRACE(::testing::Message() << dtype_name(type) << " k " << k << " rows "
                                              << n_rows << " strided " << strided);
            expect_one_token_same_bits(w, rng);
            if (::testing::Test::HasFatalFailure()) return;
          }
        }
      }
    }
  });
}

// The register-tiled F32/F16/BF16 kernel (2+ tokens) and BF16's one-token kernel by zipping
// (float_dot-inl.h DotBF16Zip, whose per-lane sums sit in other lanes until the end) must give
// DotTile's bits: the portable backend runs DotTile for every call, so this is also the proof
// that they change nothing but speed. Widths below one vector, with a scalar tail and an odd last
// vector chunk; every token count of 1..37 (each partial tile) and 509 (fewer at the wide
// widths); row counts that leave partial row tiles and, at the wide widths, cross row blocks
// (768 KiB of weights), split over 1 and 2 threads; a column block of a wider matrix (strided
// rows); one token with a NaN, one with a huge element.
// Where two outputs first differ: the index and both values with their bits.
std::string first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    uint32_t ua, ub;
    std::memcpy(&ua, &a[i], 4);
    std::memcpy(&ub, &b[i], 4);
    if (ua != ub)
      return "output " + std::to_string(i) + ": " + std::to_string(a[i]) + " (0x" +
             (std::ostringstream{} << std::hex << ua).str() + ") vs " + std::to_string(b[i]) +
             " (0x" + (std::ostringstream{} << std::hex << ub).str() + ")";
  }
  return "sizes " + std::to_string(a.size()) + " / " + std::to_string(b.size());
}

// One pass of MatmulFloatTile over its shapes; `light`: a subset, for the other SIMD targets.
void check_float_tile(std::mt19937_64& rng, bool light) {
  for (DType type : {DType::F32, DType::F16, DType::BF16}) {
    for (int64_t k : {5, 37, 100, 2048 + 16 + 3, 4099}) {
      const bool wide = k > 2048;
      if (light && k == 4099) continue;
      for (int64_t n_rows : {1, 6, 67, 259}) {
        if (light && (n_rows == 1 || n_rows == 259)) continue;
        for (bool strided : {false, true}) {
          if (strided && n_rows != 67) continue;
          // strided: columns [3, 3 + k) of a matrix 8 wider.
          const int64_t k_all = strided ? k + 8 : k;
          const size_t rb = *row_bytes(type, k_all);
          std::vector<std::byte> bytes(rb * static_cast<size_t>(n_rows));
          for (int64_t r = 0; r < n_rows; ++r)
            quant::quantize_row(type, random_vec(rng, k_all, 0.05f),
                                std::span<std::byte>(bytes).subspan(r * rb, rb));
          const WeightMatrix full{
              .dtype = type, .n_cols = k_all, .n_rows = n_rows, .row_bytes = rb, .bytes = bytes};
          const WeightMatrix w = strided ? full.columns(3, k) : full;
          std::vector<int64_t> toks;
          for (int64_t t = 1; t <= 37; ++t)
            if ((!wide && !light) || t <= 5 || t % 4 == 1) toks.push_back(t);
          if (!light && (!wide || n_rows <= 67)) toks.push_back(509);
          for (int64_t n_tok : toks) {
            SCOPED_TRACE(::testing::Message()
                         << dtype_name(type) << " k " << k << " rows " << n_rows << " strided "
                         << strided << " n_tok " << n_tok);
            std::vector<float> x = random_vec(rng, n_tok * k, 1.0f);
            if (n_tok > 1) x[k + k / 2] = 3e30f;    // token 1: one huge element
            if (n_tok > 2) x[2 * k + k - 1] = NAN;  // token 2: NaN (in the tail where k has one)
            const auto [fast1, fast2, portable] = run_fast_portable(w, x, n_tok);
            ASSERT_EQ(0, std::memcmp(fast1.data(), portable.data(), fast1.size() * sizeof(float)))
                << "float tile vs DotTile differ: " << first_difference(fast1, portable);
            ASSERT_EQ(0, std::memcmp(fast1.data(), fast2.data(), fast1.size() * sizeof(float)))
                << "float tile: 1 vs 2 threads differ";
            if (n_tok > 2) {
              ASSERT_TRUE(std::isnan(fast1[2 * n_rows]));
            }
            ASSERT_FALSE(std::isnan(fast1[0]));
          }
        }
      }
    }
  }
}

TEST(MatmulFloatTile, SameBitsAsDotTile) {
  std::mt19937_64 rng(ops_seed() ^ 0x3c6ef372ULL);
  SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target() << " seed " << ops_seed());
  check_float_tile(rng, false);
}

// The same on every other SIMD target this machine can run (AVX2, SSE4, ...): each has its own
// vector width and register tile (cpu_matmul_float.cpp kTileRows x kTileTok).
TEST(MatmulFloatTile, SameBitsOnEveryTarget) {
  std::mt19937_64 rng(ops_seed() ^ 0x1f83d9abULL);
  kiln::testing::for_each_simd_target([&] {
    SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target() << " seed " << ops_seed());
    check_float_tile(rng, true);
  });
}

// BF16 weights on AVX512_BF16 machines (cpu/bf16_pairs.h): the one-token kernel (1 token), the
// register tiles (2+ tokens) and the portable path, 1 and 2 threads, against the scalar oracle
// computed here directly (round_bf16_row_ref, then dot_bf16_pairs_ref per output), so the vector
// rounding of the activations is checked too. Widths below one chunk, with partial last chunks
// landing in either accumulator, and past a row block; three kinds of values: moderate ones;
// tiny ones, whose products and sums fall below FLT_MIN (bf16 and f32 denormals among them:
// read as zero, results flushed, as the instruction defines); and raw random bits (infinities,
// NaNs, overflow). Equal means the same bits, or both NaN (a NaN's payload is not defined here).
bool same_or_both_nan(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) ||
         (std::isnan(a) && std::isnan(b));
}
TEST(MatmulBF16Pairs, SameBitsAsScalarOracle) {
  if (!cpu_bf16_pairs()) GTEST_SKIP() << "no AVX512_BF16 on the AVX3_DL target here";
  std::mt19937_64 rng(ops_seed() ^ 0x9e3779b9ULL);
  const auto value = [&](int kind, float scale) -> float {
    std::normal_distribution<float> nd(0.0f, scale);
    if (kind == 0) return nd(rng);
    if (kind == 1) {  // around 2^-63 per factor: products near FLT_MIN; some denormals outright
      if (rng() % 8 == 0)
        return std::bit_cast<float>(static_cast<uint32_t>(rng() % 0x800000) |
                                    static_cast<uint32_t>(rng() % 2) << 31);
      return std::ldexp(nd(rng) / scale, -60 - static_cast<int>(rng() % 8));
    }
    return std::bit_cast<float>(static_cast<uint32_t>(rng()));
  };
  for (int kind = 0; kind < 3; ++kind) {
    for (int64_t k : {5, 32, 37, 64, 95, 100, 2048 + 16 + 3}) {
      for (int64_t n_rows : {1, 3, 67}) {
        std::vector<bf16> wb(static_cast<size_t>(k * n_rows));
        for (auto& v : wb) v = f32_to_bf16(value(kind, 0.05f));
        if (kind == 1)  // bf16 denormals among the weights
          for (size_t i = 0; i < wb.size(); i += 7)
            wb[i] = bf16{static_cast<uint16_t>(rng() % 0x7f)};
        const WeightMatrix w{.dtype = DType::BF16,
                             .n_cols = k,
                             .n_rows = n_rows,
                             .row_bytes = static_cast<size_t>(k) * sizeof(bf16),
                             .bytes = std::as_bytes(std::span(wb))};
        for (int64_t n_tok : {1, 2, 5, 7}) {
          SCOPED_TRACE(::testing::Message() << "kind " << kind << " k " << k << " rows " << n_rows
                                            << " n_tok " << n_tok << " seed " << ops_seed());
          std::vector<float> x(static_cast<size_t>(n_tok * k));
          for (auto& v : x) v = value(kind, 1.0f);
          std::vector<float> want(static_cast<size_t>(n_tok * n_rows));
          std::vector<bf16> xb(static_cast<size_t>(cpu::pairs_padded(k)));
          for (int64_t t = 0; t < n_tok; ++t) {
            cpu::round_bf16_row_ref(x.data() + t * k, k, xb.data());
            for (int64_t r = 0; r < n_rows; ++r)
              want[t * n_rows + r] = cpu::dot_bf16_pairs_ref(wb.data() + r * k, xb.data(), k);
          }
          const auto [fast1, fast2, portable] = run_fast_portable(w, x, n_tok);
          for (size_t i = 0; i < want.size(); ++i) {
            ASSERT_TRUE(same_or_both_nan(fast1[i], want[i]))
                << "1 thread, output " << i << ": " << fast1[i] << " vs " << want[i];
            ASSERT_TRUE(same_or_both_nan(fast2[i], want[i])) << "2 threads, output " << i;
            ASSERT_TRUE(same_or_both_nan(portable[i], want[i])) << "portable, output " << i;
          }
        }
      }
    }
  }
}

// The 512-bit VNNI Q8_0 / Q4_0 / Q5_0 / IQ4_NL / MXFP4 kernel (AVX-512 VNNI, 2+ tokens) must give
// the plain kernel's bits, which the portable backend runs, so this is also the proof that it
// changes nothing but speed. Raw random blocks reach every quant value; row counts leave
// register tiles of one partial 16-row group, of a whole group and a partial one (29), and cross
// row blocks (64 rows at 8192 columns); 1..37 tokens (every token tile remainder, several
// tiles) and 512; widths of 1 and 3 blocks and the 1B model's 2048 / 8192; a column block of a
// wider matrix (strided rows); 1 and 2 threads; one token all zero, one with a huge element, one
// with a NaN. On a machine with AMX-INT8, 16+ tokens take the AMX kernel (CpuOptions::amx),
// checked here too (tile remainders of 1..15 tokens, row groups of 1..15 rows), and the VNNI
// kernel is checked with AMX off; the line printed says which this machine ran.
TEST(MatmulQ8Vnni, SameBitsAsPlainKernel) {
  std::printf("  AMX-INT8 kernel %s\n", cpu_has_amx() ? "checked" : "not on this machine");
  std::mt19937_64 rng(ops_seed() ^ 0x3c6ef372ULL);
  SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target() << " seed " << ops_seed());
  std::vector<int64_t> all_tok, few_tok = {1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 37, 512};
  for (int64_t t = 1; t <= 37; ++t) all_tok.push_back(t);
  all_tok.push_back(512);
  for (DType type : {DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::IQ4_NL, DType::MXFP4}) {
    for (int64_t k : {32, 96, 2048, 8192}) {
      const bool wide = k >= 2048;
      for (int64_t n_rows : {1, 3, 5, 6, 29, 67, 131}) {
        if (wide && n_rows != 5 && n_rows != 67) continue;
        for (bool strided : {false, true}) {
          if (strided && (n_rows != 67 || k == 8192)) continue;
          // strided: columns [64, 64 + k) of a matrix 96 wider.
          const int64_t k_all = strided ? k + 96 : k;
          const std::vector<std::byte> bytes = random_q8_family_rows(type, k_all, n_rows, rng);
          const WeightMatrix full{.dtype = type,
                                  .n_cols = k_all,
                                  .n_rows = n_rows,
                                  .row_bytes = *row_bytes(type, k_all),
                                  .bytes = bytes};
          const WeightMatrix w = strided ? full.columns(64, k) : full;
          for (int64_t n_tok : wide ? few_tok : all_tok) {
            SCOPED_TRACE(::testing::Message()
                         << dtype_name(type) << " k " << k << " rows " << n_rows << " strided "
                         << strided << " n_tok " << n_tok);
            const std::vector<float> x = edge_tokens(rng, n_tok, k);
            expect_same_bits(run_fast_portable(w, x, n_tok), n_tok, n_rows, "AMX or VNNI");
            expect_same_bits(run_fast_portable(w, x, n_tok, false), n_tok, n_rows, "VNNI");
            if (::testing::Test::HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

// Backend::matmul_batch's contract on the CPU: each task's y has exactly the bits of matmul()
// of that task alone, for decode-sized token counts (one encoding per distinct x, one pass
// over all tasks' rows) and beyond them (one matmul per task), with tasks sharing an input
// (Q/K/V, gate/up) or not, mixed weight types and encodings, 1 and 2 threads.
TEST(MatmulBatch, EachTaskHasItsOwnMatmulBits) {
  static std::unique_ptr<Backend> cpu1 = make_cpu_backend({.threads = 1}),
                                  cpu2 = make_cpu_backend({.threads = 2});
  std::mt19937_64 rng(ops_seed() ^ 0xba7c4);
  struct Spec {
    DType type;
    int64_t rows;
    int x;  // which input the task reads
  };
  const int64_t k = 512;
  const Spec specs[] = {{DType::Q4_K, 67, 0}, {DType::Q6_K, 33, 0}, {DType::Q8_0, 40, 0},
                        {DType::F16, 17, 1},  {DType::Q5_K, 9, 1},  {DType::F32, 5, 0},
                        {DType::Q4_0, 130, 1}};
  std::vector<std::vector<std::byte>> bytes;
  std::vector<WeightMatrix> ws;
  bytes.reserve(std::size(specs));
  for (const Spec& sp : specs) {
    const size_t rb = *row_bytes(sp.type, k);
    bytes.emplace_back(rb * static_cast<size_t>(sp.rows));
    for (int64_t r = 0; r < sp.rows; ++r)
      quant::quantize_row(sp.type, random_vec(rng, k, 0.05f),
                          std::span<std::byte>(bytes.back()).subspan(r * rb, rb));
    ws.push_back(WeightMatrix{
        .dtype = sp.type, .n_cols = k, .n_rows = sp.rows, .row_bytes = rb, .bytes = bytes.back()});
  }
  for (Backend* be : {cpu1.get(), cpu2.get()}) {
    for (int64_t n_tok : {1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 65}) {
      SCOPED_TRACE(::testing::Message() << "n_tok " << n_tok << " threads "
                                        << (be == cpu1.get() ? 1 : 2) << " seed " << ops_seed());
      const std::vector<float> x0 = random_vec(rng, n_tok * k), x1 = random_vec(rng, n_tok * k);
      std::vector<std::vector<float>> batched, alone;
      std::vector<Backend::MatmulTask> tasks;
      for (size_t i = 0; i < ws.size(); ++i) {
        batched.emplace_back(static_cast<size_t>(n_tok * specs[i].rows), NAN);
        alone.emplace_back(static_cast<size_t>(n_tok * specs[i].rows), NAN);
      }
      for (size_t i = 0; i < ws.size(); ++i)
        tasks.push_back({&ws[i], specs[i].x == 0 ? x0 : x1, batched[i]});
      be->matmul_batch(tasks, n_tok);
      for (size_t i = 0; i < ws.size(); ++i) {
        be->matmul(ws[i], specs[i].x == 0 ? x0 : x1, n_tok, alone[i]);
        for (float v : alone[i]) ASSERT_FALSE(std::isnan(v)) << dtype_name(specs[i].type);
        EXPECT_EQ(
            0, std::memcmp(batched[i].data(), alone[i].data(), batched[i].size() * sizeof(float)))
            << dtype_name(specs[i].type) << " task " << i;
      }
    }
  }
}

}  // namespace
}  // namespace kiln
