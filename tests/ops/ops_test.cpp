// tests/ops/ops_test.cpp: the cpu backend's matmuls against the scalar reference backend, on
// fresh random inputs (seed printed on failure), odd sizes, each weight type, with the error
// bound of each path stated where it is checked (the other ops: backend_ops_test.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "ops_common.h"
#include "test_weights.h"
#include "quant/quant.h"

namespace kiln {
namespace {

using kiln::testing::close;
using kiln::testing::ops_seed;
using kiln::testing::random_vec;

struct Backends {
  std::unique_ptr<Backend> ref = make_ref_backend();
  std::unique_ptr<Backend> cpu1 = make_cpu_backend({.threads = 1});
  // more threads than cores: odd splits
  std::unique_ptr<Backend> cpu3 = make_cpu_backend({.threads = 3});
};

Backends& backends() {
  static Backends b;
  return b;
}

using kiln::testing::make_weights;
using kiln::testing::TestWeights;

// Activation block size the cpu backend quantizes x into for this weight type (0: f32).
int act_block(DType t) {
  switch (t) {
    case DType::Q8_0:
    case DType::Q4_0:
    case DType::Q5_0:
    case DType::IQ4_NL:
    case DType::MXFP4:
      return 32;
    case DType::Q2_K:
    case DType::Q3_K:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
    case DType::IQ4_XS:
      return 256;
    default:
      return 0;
  }
}

struct MatmulCase {
  DType type;
  std::vector<int64_t> ks;
};

class MatmulVsRef : public ::testing::TestWithParam<MatmulCase> {};

// Every shape of the case against the reference, through the cpu backends (1 and 3 threads).
void check_against_ref(const MatmulCase& c) {
  ASSERT_TRUE(quant::can_quantize(c.type)) << dtype_name(c.type);
  std::mt19937_64 rng(ops_seed() ^ static_cast<uint64_t>(c.type));
  const int ab = act_block(c.type);
  for (int64_t k : c.ks) {
    for (int64_t n_rows : {1, 3, 31, 257}) {
      TestWeights w = make_weights(c.type, n_rows, k, rng);
      for (int64_t n_tok : {1, 3, 6, 8, 13, 37}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(c.type) << " rows " << n_rows << " k " << k
                                          << " n_tok " << n_tok << " seed " << ops_seed());
        const std::vector<float> x = random_vec(rng, n_tok * k, 1.0f);
        std::vector<float> y_ref(n_tok * n_rows), y1(y_ref.size(), NAN), y3(y_ref.size(), NAN);
        backends().ref->matmul(w.m, x, n_tok, y_ref);
        backends().cpu1->matmul(w.m, x, n_tok, y1);
        backends().cpu3->matmul(w.m, x, n_tok, y3);
        for (int64_t t = 0; t < n_tok; ++t) {
          const float* xt = x.data() + t * k;
          for (int64_t r = 0; r < n_rows; ++r) {
            const float* wr = w.deq.data() + r * k;
            // f32 paths: accumulation order only, bounded by 1e-5 * sum|w*x|.
            double abs_sum = 0;
            for (int64_t i = 0; i < k; ++i) abs_sum += std::fabs(double(wr[i]) * xt[i]);
            double tol = 1e-5 * abs_sum + 1e-7;
            // BF16 by bf16 pairs (cpu/bf16_pairs.h): each x_i rounded to bf16 first, off by
            // at most 2^-8 |x_i| (half an ulp of an 8-bit significand), as llama.cpp rounds it.
            if (c.type == DType::BF16 && cpu_bf16_pairs()) tol += 0x1p-8 * abs_sum;
            if (ab > 0) {
              // Quantized activations: each x_i moves by at most d_b/2 (d_b = amax_b/127 of
              // its block), roughly uniformly, so the error has sigma^2 =
              // sum_b d_b^2/12 * sum_{i in b} w_i^2; we allow 6 sigma.
              double var = 0;
              for (int64_t b0 = 0; b0 < k; b0 += ab) {
                float amax = 0;
                double w2 = 0;
                for (int64_t i = b0; i < b0 + ab; ++i) {
                  amax = std::max(amax, std::fabs(xt[i]));
                  w2 += double(wr[i]) * wr[i];
                }
                const double d = amax / 127.0;
                var += d * d / 12.0 * w2;
              }
              tol += 6.0 * std::sqrt(var);
            }
            const float want = y_ref[t * n_rows + r];
            ASSERT_TRUE(close(y1[t * n_rows + r], want, tol)) << "1 thread, t " << t << " r " << r;
            ASSERT_TRUE(close(y3[t * n_rows + r], want, tol)) << "3 threads, t " << t << " r " << r;
          }
        }
      }
    }
  }
}

TEST_P(MatmulVsRef, AllShapes) { check_against_ref(GetParam()); }

// The int8 kernels of issue 34 (IQ4_NL, IQ4_XS, Q2_K, Q3_K) on every SIMD target this machine
// runs (AVX2 takes maddubs where AVX-512 VNNI takes vpdpbusd, and 4-token tiles, not 8).
TEST(MatmulVsRef, IntKernelsOnEveryTarget) {
  kiln::testing::for_each_simd_target([] {
    SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target());
    for (const MatmulCase& c :
         {MatmulCase{DType::IQ4_NL, {32, 544}}, MatmulCase{DType::IQ4_XS, {256, 768}},
          MatmulCase{DType::Q2_K, {256, 768}}, MatmulCase{DType::Q3_K, {256, 768}}}) {
      check_against_ref(c);
      if (::testing::Test::HasFatalFailure()) return;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(
    Types, MatmulVsRef,
    ::testing::Values(MatmulCase{DType::F32, {1, 31, 257}}, MatmulCase{DType::F16, {1, 31, 257}},
                      MatmulCase{DType::BF16, {3, 100}}, MatmulCase{DType::Q8_0, {32, 96, 544}},
                      MatmulCase{DType::Q4_0, {32, 544}}, MatmulCase{DType::Q5_0, {32, 544}},
                      MatmulCase{DType::Q4_1, {32, 160}}, MatmulCase{DType::Q5_1, {32, 160}},
                      MatmulCase{DType::Q2_K, {256, 768, 2304}},
                      MatmulCase{DType::Q3_K, {256, 768, 2304}},
                      MatmulCase{DType::Q4_K, {256, 768}}, MatmulCase{DType::Q5_K, {256, 768}},
                      MatmulCase{DType::Q6_K, {256, 768}}, MatmulCase{DType::IQ4_NL, {32, 544}},
                      MatmulCase{DType::IQ4_XS, {256, 768}},
                      MatmulCase{DType::MXFP4, {32, 96, 544}}),
    [](const auto& info) { return std::string(dtype_name(info.param.type)); });

// A quantized weight times an activation row holding a NaN gives NaN, as the f32 math would.
TEST(MatmulVsRef, NanActivationPropagates) {
  std::mt19937_64 rng(ops_seed());
  for (DType t : {DType::Q8_0, DType::Q4_K, DType::F16, DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS,
                  DType::Q2_K, DType::Q3_K}) {
    TestWeights w = make_weights(t, 4, 256, rng);
    std::vector<float> x = random_vec(rng, 256);
    x[17] = NAN;
    std::vector<float> y(4, 0.0f);
    backends().cpu1->matmul(w.m, x, 1, y);
    for (float v : y) EXPECT_TRUE(std::isnan(v)) << dtype_name(t);
  }
}

// The other ops, on every backend: backend_ops_test.cpp.

}  // namespace
}  // namespace kiln
