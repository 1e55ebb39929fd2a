// tests/ops/ops_test.cpp: every non-attention op of the cpu backend against the scalar
// reference backend, on fresh random inputs (seed printed on failure), odd sizes, each weight
// type, with the error bound of each path stated where it is checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "core/dtype.h"
#include "ops_common.h"
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

// A weight matrix of `type` holding quantized random values, with its dequantized copy.
struct TestWeights {
  std::vector<std::byte> bytes;
  std::vector<float> deq;  // [n_rows][n_cols], what the ref backend sees
  WeightMatrix m;
};

TestWeights make_weights(DType type, int64_t n_rows, int64_t n_cols, std::mt19937_64& rng) {
  TestWeights w;
  const size_t rb = *row_bytes(type, n_cols);
  w.bytes.resize(rb * n_rows);
  w.deq.resize(static_cast<size_t>(n_rows * n_cols));
  for (int64_t r = 0; r < n_rows; ++r) {
    const std::vector<float> src = random_vec(rng, n_cols, 0.05f);
    auto dst = std::span<std::byte>(w.bytes).subspan(r * rb, rb);
    quant::quantize_row(type, src, dst);
    quant::dequantize_row(type, dst, std::span<float>(w.deq).subspan(r * n_cols, n_cols));
  }
  w.m = WeightMatrix{.dtype = type, .n_cols = n_cols, .n_rows = n_rows, .row_bytes = rb, .bytes = w.bytes};
  return w;
}

// Activation block size the cpu backend quantizes x into for this weight type (0: f32).
int act_block(DType t) {
  switch (t) {
    case DType::Q8_0: case DType::Q4_0: case DType::Q5_0: return 32;
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: return 256;
    default: return 0;
  }
}

struct MatmulCase {
  DType type;
  std::vector<int64_t> ks;
};

class MatmulVsRef : public ::testing::TestWithParam<MatmulCase> {};

TEST_P(MatmulVsRef, AllShapes) {
  const MatmulCase& c = GetParam();
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

INSTANTIATE_TEST_SUITE_P(
    Types, MatmulVsRef,
    ::testing::Values(MatmulCase{DType::F32, {1, 31, 257}}, MatmulCase{DType::F16, {1, 31, 257}},
                      MatmulCase{DType::BF16, {3, 100}}, MatmulCase{DType::Q8_0, {32, 96, 544}},
                      MatmulCase{DType::Q4_0, {32, 544}}, MatmulCase{DType::Q5_0, {32, 544}},
                      MatmulCase{DType::Q4_1, {32, 160}}, MatmulCase{DType::Q5_1, {32, 160}},
                      MatmulCase{DType::Q2_K, {256, 768}}, MatmulCase{DType::Q3_K, {256, 768}},
                      MatmulCase{DType::Q4_K, {256, 768}}, MatmulCase{DType::Q5_K, {256, 768}},
                      MatmulCase{DType::Q6_K, {256, 768}}),
    [](const auto& info) { return std::string(dtype_name(info.param.type)); });

// A quantized weight times an activation row holding a NaN gives NaN, as the f32 math would.
TEST(MatmulVsRef, NanActivationPropagates) {
  std::mt19937_64 rng(ops_seed());
  for (DType t : {DType::Q8_0, DType::Q4_K, DType::F16, DType::Q6_K}) {
    TestWeights w = make_weights(t, 4, 256, rng);
    std::vector<float> x = random_vec(rng, 256);
    x[17] = NAN;
    std::vector<float> y(4, 0.0f);
    backends().cpu1->matmul(w.m, x, 1, y);
    for (float v : y) EXPECT_TRUE(std::isnan(v)) << dtype_name(t);
  }
}

TEST(OpsVsRef, GetRows) {
  std::mt19937_64 rng(ops_seed());
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_K, DType::Q6_K}) {
    TestWeights w = make_weights(t, 31, 256, rng);
    const std::vector<int32_t> ids = {30, 0, 7, 7, 12};
    std::vector<float> a(ids.size() * 256), b(a.size(), NAN);
    backends().ref->get_rows(w.m, ids, a);
    backends().cpu3->get_rows(w.m, ids, b);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(close(b[i], a[i], 0)) << dtype_name(t) << " " << i;
  }
}

TEST(OpsVsRef, RmsnormAndSoftmax) {
  std::mt19937_64 rng(ops_seed());
  for (int64_t n : {1, 3, 31, 257, 4096}) {
    for (int64_t rows : {1, 3, 31}) {
      const std::vector<float> x = random_vec(rng, rows * n, 3.0f), wt = random_vec(rng, n);
      std::vector<float> a(x.size()), b(x.size(), NAN);
      for (bool with_w : {false, true}) {
        std::span<const float> ws = with_w ? std::span<const float>(wt) : std::span<const float>();
        backends().ref->rmsnorm(x, ws, n, 1e-6f, a);
        backends().cpu3->rmsnorm(x, ws, n, 1e-6f, b);
        for (size_t i = 0; i < a.size(); ++i)  // f32 sum of squares vs double: 2e-6 relative
          ASSERT_TRUE(close(b[i], a[i], 2e-6 * std::fabs(a[i]) + 1e-7)) << "rmsnorm n " << n << " i " << i;
      }
      std::vector<float> s1 = x, s2 = x;
      backends().ref->softmax(s1, n);
      backends().cpu3->softmax(s2, n);
      for (size_t i = 0; i < s1.size(); ++i)  // hwy Exp is within 1 ulp: 1e-5 relative
        ASSERT_TRUE(close(s2[i], s1[i], 1e-5 * s1[i] + 1e-9)) << "softmax n " << n << " i " << i;
    }
  }
}

TEST(OpsVsRef, Rope) {
  std::mt19937_64 rng(ops_seed());
  for (RopeStyle style : {RopeStyle::Normal, RopeStyle::NeoX}) {
    for (int64_t head_dim : {2, 64, 80}) {
      for (int64_t n_rot : {head_dim, head_dim / 2 + (head_dim / 2) % 2}) {
        if (n_rot == 0) continue;
        const int64_t n_tok = 5, n_head = 3;
        std::vector<int32_t> pos = {0, 1, 17, 4095, 131071};
        RopeParams p{n_rot, style == RopeStyle::NeoX ? 1e6f : 1e4f, 1.0f, style};
        if (head_dim == 80) p.freq_scale = 0.25f;
        std::vector<float> a = random_vec(rng, n_tok * n_head * head_dim), b = a;
        backends().ref->rope(a, n_tok, n_head, head_dim, pos, p);
        backends().cpu3->rope(b, n_tok, n_head, head_dim, pos, p);
        for (size_t i = 0; i < a.size(); ++i)  // f32 sin/cos of a double-reduced angle
          ASSERT_TRUE(close(b[i], a[i], 4e-6 * (1 + std::fabs(a[i]))))
              << "style " << int(style) << " hd " << head_dim << " n_rot " << n_rot << " i " << i;
      }
    }
  }
}

TEST(OpsVsRef, Elementwise) {
  std::mt19937_64 rng(ops_seed());
  for (size_t n : {size_t{1}, size_t{3}, size_t{31}, size_t{257}, size_t{70001}}) {
    const std::vector<float> g = random_vec(rng, n, 4.0f), u = random_vec(rng, n, 2.0f);
    std::vector<float> a(n), b(n, NAN);
    backends().ref->swiglu(g, u, a);
    backends().cpu3->swiglu(g, u, b);
    for (size_t i = 0; i < n; ++i)
      ASSERT_TRUE(close(b[i], a[i], 1e-5 * std::fabs(a[i]) + 1e-6 * std::fabs(u[i]))) << "swiglu " << i;
    backends().ref->geglu(g, u, a);
    backends().cpu3->geglu(g, u, b);
    for (size_t i = 0; i < n; ++i)  // tanh within 4 ulp; 1 + tanh cancels for g << 0
      ASSERT_TRUE(close(b[i], a[i], 1e-5 * std::fabs(a[i]) + 1e-6 * (1 + std::fabs(g[i])) * std::fabs(u[i])))
          << "geglu " << i;
    backends().ref->add(g, u, a);
    backends().cpu3->add(g, u, b);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], a[i], 0)) << "add " << i;
    backends().ref->mul(g, u, a);
    backends().cpu3->mul(g, u, b);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], a[i], 0)) << "mul " << i;
    b = g;
    backends().cpu3->add(b, u, b);  // aliasing out == a
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], g[i] + u[i], 0)) << "add aliased " << i;
    a = g;
    b = g;
    backends().ref->scale(a, 0.37f);
    backends().cpu3->scale(b, 0.37f);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], a[i], 0)) << "scale " << i;
    a = g;
    b = g;
    backends().ref->softcap(a, 3.0f);
    backends().cpu3->softcap(b, 3.0f);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], a[i], 2e-6 * 3.0)) << "softcap " << i;
    a = g;
    b = g;
    backends().ref->sigmoid(a);
    backends().cpu3->sigmoid(b);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], a[i], 1e-6)) << "sigmoid " << i;
  }
}

TEST(OpsVsRef, StoreRowsF16BitExact) {
  std::mt19937_64 rng(ops_seed());
  const int64_t width = 67, n_phys = 9;
  std::vector<float> src = random_vec(rng, 4 * width, 100.0f);
  src[0] = 70000.0f;  // overflows to inf
  src[1] = 1e-6f;     // subnormal in f16
  src[2] = -0.0f;
  const std::vector<int32_t> rows = {8, 0, 3, 5};
  std::vector<f16> pa(n_phys * width), pb(n_phys * width);
  backends().ref->store_rows_f16(src, width, rows, pa);
  backends().cpu3->store_rows_f16(src, width, rows, pb);
  for (size_t i = 0; i < pa.size(); ++i) ASSERT_EQ(pa[i].bits, pb[i].bits) << i << " seed " << ops_seed();
}

TEST(OpsVsRef, Argmax) {
  std::mt19937_64 rng(ops_seed());
  for (size_t n : {size_t{1}, size_t{3}, size_t{257}, size_t{32000}}) {
    std::vector<float> x = random_vec(rng, n);
    if (n > 3) x[n / 2] = x[n - 1] = 50.0f;  // tie: first wins
    EXPECT_EQ(backends().cpu3->argmax(x), backends().ref->argmax(x)) << n;
  }
}

}  // namespace
}  // namespace kiln
