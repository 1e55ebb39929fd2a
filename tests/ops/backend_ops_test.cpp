// tests/ops/backend_ops_test.cpp: one op suite for every backend. The non-matmul ops of each
// backend in backends_under_test() (tests/ops/backend_suite.h: the CPU variants here, the CUDA
// backend in kiln_cuda_ops_tests) against the scalar reference backend, on fresh random
// inputs (seed printed on failure) and odd sizes, with the bound each op's arithmetic allows.
// Matmuls and attention have their own suites: their bounds depend on each backend's paths.
#include <gtest/gtest.h>

#include <bit>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <algorithm>

#include "backend/backend.h"
#include "core/dtype.h"
#include "ops/backend_suite.h"
#include "ops/ops_common.h"
#include "ops/test_weights.h"
#include "quant/quant.h"

namespace kiln {
namespace {

using kiln::testing::BackendUnderTest;
using kiln::testing::close;
using kiln::testing::ops_seed;
using kiln::testing::random_vec;

Backend& ref() {
  static std::unique_ptr<Backend> r = make_ref_backend();
  return *r;
}

class BackendOps : public ::testing::TestWithParam<BackendUnderTest> {
 protected:
  void SetUp() override {
    be_ = GetParam().get();
    if (be_ == nullptr) GTEST_SKIP() << GetParam().why();
  }
  Backend& be() { return *be_; }

 private:
  Backend* be_ = nullptr;
};

// Rows of a quantized random matrix, decoded by both: the decode rounds each product
// separately, as the reference does, so the bits are equal.
TEST_P(BackendOps, GetRowsEveryTypeBitExact) {
  std::mt19937_64 rng(ops_seed());
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4_0, DType::Q4_1,
                  DType::Q5_0, DType::Q5_1, DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K,
                  DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS, DType::MXFP4}) {
    const int64_t k = traits(t).block_size == 1 ? 67 : 512;
    const kiln::testing::TestWeights tw = kiln::testing::make_weights(t, 31, k, rng);
    const WeightMatrix& w = tw.m;
    const std::vector<int32_t> ids = {30, 0, 7, 7, 12};
    std::vector<float> a(ids.size() * k), b(a.size(), NAN);
    ref().get_rows(w, ids, a);
    be().get_rows(w, ids, b);
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_EQ(std::bit_cast<uint32_t>(b[i]), std::bit_cast<uint32_t>(a[i]))
          << dtype_name(t) << " " << i << " seed " << ops_seed();
  }
}

TEST_P(BackendOps, RmsnormAndSoftmax) {
  std::mt19937_64 rng(ops_seed());
  for (int64_t n : {1, 3, 31, 128, 257, 2048, 4096, 5003, 8192, 12288, 16384}) {
    for (int64_t rows : {1, 3, 31}) {
      const std::vector<float> x = random_vec(rng, rows * n, 3.0f), wt = random_vec(rng, n);
      std::vector<float> a(x.size()), b(x.size(), NAN);
      for (bool with_w : {false, true}) {
        std::span<const float> ws = with_w ? std::span<const float>(wt) : std::span<const float>();
        ref().rmsnorm(x, ws, n, 1e-6f, a);
        be().rmsnorm(x, ws, n, 1e-6f, b);
        for (size_t i = 0; i < a.size(); ++i)  // f32 sum of squares vs double, rsqrt: 2e-6
          ASSERT_TRUE(close(b[i], a[i], 2e-6 * std::fabs(a[i]) + 1e-7))
              << "rmsnorm n " << n << " i " << i;
      }
      std::vector<float> s1 = x, s2 = x;
      ref().softmax(s1, n);
      be().softmax(s2, n);
      for (size_t i = 0; i < s1.size(); ++i)  // exp within 2 ulp, an f32 sum: 1e-5 relative
        ASSERT_TRUE(close(s2[i], s1[i], 1e-5 * s1[i] + 1e-9)) << "softmax n " << n << " i " << i;
    }
  }
}

TEST_P(BackendOps, Rope) {
  std::mt19937_64 rng(ops_seed());
  for (RopeStyle style : {RopeStyle::Normal, RopeStyle::NeoX}) {
    for (int64_t head_dim : {2, 64, 80, 128}) {
      for (int64_t n_rot : {head_dim, head_dim / 2 + (head_dim / 2) % 2}) {
        if (n_rot == 0) continue;
        const int64_t n_tok = 5, n_head = 3;
        std::vector<int32_t> pos = {0, 1, 17, 4095, 131071};
        RopeParams p{.n_rot = n_rot,
                     .freq_base = style == RopeStyle::NeoX ? 1e6f : 1e4f,
                     .freq_scale = 1.0f,
                     .style = style};
        if (head_dim == 80) p.freq_scale = 0.25f;
        std::vector<float> a = random_vec(rng, n_tok * n_head * head_dim), b = a;
        ref().rope(a, n_tok, n_head, head_dim, pos, p);
        be().rope(b, n_tok, n_head, head_dim, pos, p);
        for (size_t i = 0; i < a.size(); ++i)
          ASSERT_TRUE(close(b[i], a[i], GetParam().rope_rel * (1 + std::fabs(a[i]))))
              << "style " << int(style) << " hd " << head_dim << " n_rot " << n_rot << " i " << i;
      }
    }
  }
}

// Rope with per-pair frequency factors (Llama 3 rope_freqs, LongRoPE) and YaRN (the ramp
// between the correction dims, the magnitude scale, attn_factor), odd token and head counts;
// rope_qk must give the bits of rope() on Q then on K.
TEST_P(BackendOps, RopeFactorsAndYarn) {
  std::mt19937_64 rng(ops_seed());
  std::uniform_real_distribution<float> factor_dist(1.0f, 8.0f);
  for (RopeStyle style : {RopeStyle::Normal, RopeStyle::NeoX}) {
    for (int64_t head_dim : {6, 64, 96, 130}) {
      for (int64_t n_rot : {head_dim, head_dim / 2 + (head_dim / 2) % 2}) {
        for (int variant = 0; variant < 4; ++variant) {
          const int64_t n_tok = 7, n_head_q = 5, n_head_k = 1;
          std::vector<int32_t> pos = {0, 1, 3, 127, 129, 4095, 65537};
          RopeParams p{.n_rot = n_rot,
                       .freq_base = style == RopeStyle::NeoX ? 1e6f : 5e5f,
                       .freq_scale = 1.0f,
                       .style = style};
          std::vector<float> factors(static_cast<size_t>(n_rot / 2));
          for (float& f : factors) f = factor_dist(rng);
          if (variant != 1) p.freq_factors = factors;  // 0: factors, 2/3: factors + YaRN
          if (variant >= 1) {                          // YaRN, as qwen2 / gpt-oss read it
            p.freq_scale = variant == 3 ? 1.0f / 32 : 0.25f;
            p.ext_factor = 1.0f;
            p.n_ctx_orig = variant == 3 ? 4096 : 128;
            p.attn_factor = variant == 2 ? 0.75f : 1.0f;
            p.beta_fast = 32;
            p.beta_slow = 1;
          }
          const RopeYarnTerms y = rope_yarn_terms(p);
          std::vector<float> q = random_vec(rng, n_tok * n_head_q * head_dim);
          std::vector<float> k = random_vec(rng, n_tok * n_head_k * head_dim);
          std::vector<float> qa = q, ka = k, qb = q, kb = k, qc = q, kc = k;
          ref().rope(qa, n_tok, n_head_q, head_dim, pos, p);
          ref().rope(ka, n_tok, n_head_k, head_dim, pos, p);
          be().rope(qb, n_tok, n_head_q, head_dim, pos, p);
          be().rope(kb, n_tok, n_head_k, head_dim, pos, p);
          be().rope_qk(qc, n_head_q, kc, n_head_k, n_tok, head_dim, pos, p);
          const double bound = GetParam().rope_rel * y.mscale;
          for (size_t i = 0; i < qa.size(); ++i)
            ASSERT_TRUE(close(qb[i], qa[i], bound * (1 + std::fabs(qa[i]))))
                << "q style " << int(style) << " hd " << head_dim << " n_rot " << n_rot
                << " variant " << variant << " i " << i;
          for (size_t i = 0; i < ka.size(); ++i)
            ASSERT_TRUE(close(kb[i], ka[i], bound * (1 + std::fabs(ka[i])))) << "k i " << i;
          ASSERT_EQ(std::memcmp(qb.data(), qc.data(), qb.size() * sizeof(float)), 0);
          ASSERT_EQ(std::memcmp(kb.data(), kc.data(), kb.size() * sizeof(float)), 0);
          // The dims past n_rot pass through untouched.
          for (int64_t r = 0; r < n_tok * n_head_q; ++r)
            for (int64_t d = n_rot; d < head_dim; ++d)
              ASSERT_EQ(qb[r * head_dim + d], q[r * head_dim + d]);
        }
      }
    }
  }
}

TEST_P(BackendOps, Elementwise) {
  std::mt19937_64 rng(ops_seed());
  for (size_t n : {size_t{1}, size_t{3}, size_t{31}, size_t{257}, size_t{70001}, size_t{5000000}}) {
    const std::vector<float> g = random_vec(rng, n, 4.0f), u = random_vec(rng, n, 2.0f);
    std::vector<float> a(n), b(n, NAN);
    ref().swiglu(g, u, a);
    be().swiglu(g, u, b);
    for (size_t i = 0; i < n; ++i)
      ASSERT_TRUE(close(b[i], a[i], 1e-5 * std::fabs(a[i]) + 1e-6 * std::fabs(u[i])))
          << "swiglu " << i;
    ref().geglu(g, u, a);
    be().geglu(g, u, b);
    for (size_t i = 0; i < n; ++i)  // tanh within 4 ulp; 1 + tanh cancels for g << 0
      ASSERT_TRUE(close(b[i], a[i],
                        1e-5 * std::fabs(a[i]) + 1e-6 * (1 + std::fabs(g[i])) * std::fabs(u[i])))
          << "geglu " << i;
    // gpt-oss's clamped SwiGLU: inputs of scale 4 and 2 reach both clamps (limit 7).
    ref().swiglu_oai(g, u, a, 1.702f, 7.0f);
    be().swiglu_oai(g, u, b, 1.702f, 7.0f);
    for (size_t i = 0; i < n; ++i)
      ASSERT_TRUE(close(b[i], a[i], 1e-5 * std::fabs(a[i]) + 1e-6 * (1 + std::fabs(u[i]))))
          << "swiglu_oai " << i;
    ref().add(g, u, a);
    be().add(g, u, b);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], a[i], 0)) << "add " << i;
    ref().mul(g, u, a);
    be().mul(g, u, b);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], a[i], 0)) << "mul " << i;
    b = g;
    be().add(b, u, b);  // aliasing out == a
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], g[i] + u[i], 0)) << "add aliased " << i;
    a = g;
    b = g;
    ref().scale(a, 0.37f);
    be().scale(b, 0.37f);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], a[i], 0)) << "scale " << i;
    a = g;
    b = g;
    ref().softcap(a, 3.0f);
    be().softcap(b, 3.0f);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], a[i], 2e-6 * 3.0)) << "softcap " << i;
    a = g;
    b = g;
    ref().sigmoid(a);
    be().sigmoid(b);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(close(b[i], a[i], 1e-6)) << "sigmoid " << i;
  }
}

TEST_P(BackendOps, StoreRowsF16BitExact) {
  std::mt19937_64 rng(ops_seed());
  const int64_t width = 67, n_phys = 9;
  std::vector<float> src = random_vec(rng, 4 * width, 100.0f);
  src[0] = 70000.0f;  // overflows to inf
  src[1] = 1e-6f;     // subnormal in f16
  src[2] = -0.0f;
  src[3] = 65520.0f;  // exactly halfway to the f16 overflow threshold: rounds to inf
  const std::vector<int32_t> rows = {8, 0, 3, 5};
  std::vector<f16> pa(n_phys * width), pb(n_phys * width);
  for (size_t i = 0; i < pa.size(); ++i) pa[i].bits = pb[i].bits = static_cast<uint16_t>(i);
  ref().store_rows_f16(src, width, rows, pa);
  be().store_rows_f16(src, width, rows, pb);
  // Rows not written keep their old bits in both.
  for (size_t i = 0; i < pa.size(); ++i)
    ASSERT_EQ(pa[i].bits, pb[i].bits) << i << " seed " << ops_seed();
}

// copy_2d: columns of rows into columns of other rows, as one op (the latent-attention gathers);
// every destination value outside the copied columns keeps its bits.
TEST_P(BackendOps, Copy2dGathersColumns) {
  std::mt19937_64 rng(ops_seed());
  for (const auto [rows, src_w, src_col, dst_w, dst_col, width] :
       {std::array<int64_t, 6>{1, 8, 0, 8, 0, 8},
        {37, 144, 128, 16, 0, 16},
        {24, 320, 80, 64, 0, 64},
        {3, 7, 2, 5, 1, 3},
        {5, 9, 0, 9, 0, 0}}) {
    const std::vector<float> src = random_vec(rng, static_cast<size_t>(rows * src_w));
    const std::vector<float> dst0 = random_vec(rng, static_cast<size_t>(rows * dst_w));
    std::vector<float> want = dst0, got = dst0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < width; ++c)
        want[static_cast<size_t>(r * dst_w + dst_col + c)] =
            src[static_cast<size_t>(r * src_w + src_col + c)];
    be().copy_2d<float>(src, src_w, src_col, got, dst_w, dst_col, rows, width);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
        << rows << " x " << width;
  }
}

// gather_rows and scale_add_rows (the MoE rows routed to one expert, gathered and added back
// weighted, one op each): the bits of the per-row copy, scale and add they replace, rows in
// any order and odd widths; rows of out not named keep their bits. Repeated or out-of-range
// rows are refused.
TEST_P(BackendOps, GatherAndScaleAddRowsAsThePerRowOps) {
  std::mt19937_64 rng(ops_seed());
  for (const auto [n_tab, width, picks] :
       {std::array<int64_t, 3>{1, 8, 1}, {37, 2048, 11}, {19, 7, 19}, {64, 129, 5}}) {
    const std::vector<float> table = random_vec(rng, static_cast<size_t>(n_tab * width));
    std::vector<int32_t> ids(static_cast<size_t>(n_tab));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(static_cast<size_t>(picks));
    const auto W = static_cast<size_t>(width);
    std::vector<float> want(ids.size() * W), got(want.size(), NAN);
    for (size_t i = 0; i < ids.size(); ++i)
      ref().copy<float>(std::span(table).subspan(size_t(ids[i]) * W, W),
                        std::span(want).subspan(i * W, W));
    be().gather_rows(table, width, ids, got);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
        << "gather " << picks << " of " << n_tab << " x " << width << " seed " << ops_seed();

    const std::vector<float> y0 = random_vec(rng, ids.size() * W);
    const std::vector<float> scales = random_vec(rng, ids.size());
    std::vector<float> y_want = y0, y_got = y0, out_want = table, out_got = table;
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::span<float> row = std::span(y_want).subspan(i * W, W);
      const std::span<float> orow = std::span(out_want).subspan(size_t(ids[i]) * W, W);
      ref().scale(row, scales[i]);
      ref().add(orow, row, orow);
    }
    be().scale_add_rows(y_got, width, ids, scales, out_got);
    ASSERT_EQ(std::memcmp(out_got.data(), out_want.data(), out_got.size() * sizeof(float)), 0)
        << "scale_add " << picks << " of " << n_tab << " x " << width << " seed " << ops_seed();
    ASSERT_EQ(std::memcmp(y_got.data(), y_want.data(), y_got.size() * sizeof(float)), 0);
  }
  std::vector<float> table(4 * 3, 1.0f), rows(2 * 3), scales(2, 1.0f);
  const std::vector<int32_t> twice = {1, 1}, outside = {0, 4};
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the backend may run threads
  EXPECT_DEATH(be().scale_add_rows(rows, 3, twice, scales, table), "named twice");
  EXPECT_DEATH(be().gather_rows(table, 3, outside, rows), "row 4 of 4");
}

TEST_P(BackendOps, Argmax) {
  std::mt19937_64 rng(ops_seed());
  for (size_t n : {size_t{1}, size_t{3}, size_t{257}, size_t{32000}, size_t{152064}}) {
    std::vector<float> x = random_vec(rng, n);
    EXPECT_EQ(be().argmax(x), ref().argmax(x)) << n;
    if (n > 3) {
      x[n / 2] = x[n - 1] = 50.0f;  // tie: first wins
      EXPECT_EQ(be().argmax(x), ref().argmax(x)) << n;
      x[1] = 50.0f;
      EXPECT_EQ(be().argmax(x), 1) << n;
    }
    std::fill(x.begin(), x.end(), -INFINITY);
    EXPECT_EQ(be().argmax(x), ref().argmax(x)) << "all -inf, n " << n;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendOps,
                         ::testing::ValuesIn(kiln::testing::backends_under_test()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace kiln
