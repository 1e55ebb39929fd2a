// tests/cuda/cuda_ops_test.cpp: the CUDA backend's own paths against the scalar reference
// backend on fresh random inputs (seed printed on failure), odd sizes and every weight type:
// matmuls, the fused ops' bits, rope_qk, top_k, downloads; plus the weight arena's caching.
// The ops every backend shares run in tests/ops/backend_ops_test.cpp (compiled into this
// executable with the CUDA backend). Every test skips with a message when no GPU is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "backend/cuda/cuda_util.h"
#include "backend/cuda/kernels.h"
#include "core/check.h"
#include "core/dtype.h"
#include "cuda_test_common.h"
#include "ops/ops_common.h"
#include "ops/test_weights.h"
#include "quant/quant.h"

namespace kiln {
namespace {

using kiln::testing::close;
using kiln::testing::cuda_under_test;
using kiln::testing::ops_seed;
using kiln::testing::random_vec;
using Kernels = ::kiln::CudaMatmul;  // the name CudaMatmul is the parity suite's below

Backend& ref() { return *cuda_under_test().ref; }
CudaBackend& gpu() { return *cuda_under_test().cuda; }

using kiln::testing::make_weights;
using kiln::testing::TestWeights;

// f32 accumulation of k products in any order (FMA or not) against the reference's double
// sum over the same dequantized weights: bounded by a few k * 2^-24 * sum|w x| in the worst
// case; random signs keep it far below. The GPU dequantizes bit-exactly (host test).
double matmul_tol(const float* w, const float* x, int64_t k) {
  double abs_sum = 0;
  for (int64_t i = 0; i < k; ++i) abs_sum += std::fabs(double(w[i]) * x[i]);
  return 2e-5 * abs_sum + 1e-6;
}

// MatmulKernels::V2 above 16 tokens rounds each weight and activation to f16 (relative error
// <= 2^-11 each, so <= 2^-10 + 2^-22 per product) before an f32-accumulated tensor-core GEMM;
// values below f16's normal range (6.1e-5) round with an absolute error <= 2^-25 instead.
double matmul_tol_f16(const float* w, const float* x, int64_t k) {
  double bound = 0;
  for (int64_t i = 0; i < k; ++i) {
    const double aw = std::fabs(double(w[i])), ax = std::fabs(double(x[i]));
    bound += aw * ax * (std::ldexp(1.0, -10) + 2e-5) + std::ldexp(1.0, -25) * (aw + ax) * 1.01;
  }
  return bound + 1e-6;
}

// The bound for `n_tok` tokens on the backend with these kernels.
double matmul_tol_for(Kernels kernels, int64_t n_tok, const float* w, const float* x, int64_t k) {
  return kernels == Kernels::V2 && n_tok > 16 ? matmul_tol_f16(w, x, k) : matmul_tol(w, x, k);
}

struct MatmulCase {
  DType type;
  std::vector<int64_t> ks;
};

class CudaMatmul : public ::testing::TestWithParam<MatmulCase> {};

TEST_P(CudaMatmul, AllShapesAndPaths) {
  KILN_REQUIRE_CUDA();
  const MatmulCase& c = GetParam();
  std::mt19937_64 rng(ops_seed() ^ static_cast<uint64_t>(c.type));
  for (int64_t k : c.ks) {
    for (int64_t n_rows : {1, 3, 31, 257}) {
      TestWeights w = make_weights(c.type, n_rows, k, rng);
      // 1: matvec; 3, 9 (8 + 1): batched matvec columns; 17, 70: the GEMM path with partial
      // tiles in both directions (the f32 tile kernel: MatmulTileFallbackWithoutGemm).
      for (int64_t n_tok : {1, 3, 9, 17, 70}) {
        const std::vector<float> x = random_vec(rng, n_tok * k, 1.0f);
        std::vector<float> y_ref(n_tok * n_rows);
        ref().matmul(w.m, x, n_tok, y_ref);
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(c.type) << " matmul V2 rows " << n_rows << " k " << k
                     << " n_tok " << n_tok << " seed " << ops_seed());
        std::vector<float> y(y_ref.size(), NAN);
        gpu().matmul(w.m, x, n_tok, y);
        for (int64_t t = 0; t < n_tok; ++t)
          for (int64_t r = 0; r < n_rows; ++r)
            ASSERT_TRUE(close(
                y[t * n_rows + r], y_ref[t * n_rows + r],
                matmul_tol_for(Kernels::V2, n_tok, w.deq.data() + r * k, x.data() + t * k, k)))
                << "t " << t << " r " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Types, CudaMatmul,
    // Each type also gets a k whose rows are a multiple of 16 bytes (the matvec's 16-byte
    // load path; for Q8_0 Q4_0 Q5_0 IQ4_NL at 1024 and Q2_K Q3_K Q6_K at 1024 / 2048 also the
    // shared-memory staged path) and ks whose rows are not.
    ::testing::Values(
        MatmulCase{DType::F32, {1, 31, 64, 257}}, MatmulCase{DType::F16, {1, 31, 96, 257}},
        MatmulCase{DType::BF16, {3, 64, 100}}, MatmulCase{DType::Q8_0, {32, 96, 256, 544, 1024}},
        MatmulCase{DType::Q4_0, {32, 256, 544, 1024}},
        MatmulCase{DType::Q5_0, {32, 256, 544, 1024}}, MatmulCase{DType::Q4_1, {32, 160, 256}},
        MatmulCase{DType::Q5_1, {32, 160, 256}}, MatmulCase{DType::Q2_K, {256, 1024}},
        MatmulCase{DType::Q3_K, {256, 2048}}, MatmulCase{DType::Q4_K, {256, 768}},
        MatmulCase{DType::Q5_K, {256, 768}}, MatmulCase{DType::Q6_K, {256, 2048}},
        MatmulCase{DType::IQ4_NL, {32, 544, 1024}}, MatmulCase{DType::IQ4_XS, {256, 768}}),
    [](const auto& info) { return std::string(dtype_name(info.param.type)); });

TEST(CudaOps, MatmulNanActivationPropagates) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  for (DType t : {DType::F16, DType::Q8_0, DType::Q4_K}) {
    TestWeights w = make_weights(t, 5, 256, rng);
    for (int64_t n_tok : {1, 20}) {
      std::vector<float> x = random_vec(rng, 256 * n_tok);
      for (int64_t tok = 0; tok < n_tok; ++tok) x[tok * 256 + 17] = NAN;
      std::vector<float> y(5 * n_tok, 0.0f);
      gpu().matmul(w.m, x, n_tok, y);
      for (float v : y) EXPECT_TRUE(std::isnan(v)) << dtype_name(t) << " n_tok " << n_tok;
    }
  }
}

// V2 above 16 tokens without a GEMM workspace (a build without cuBLAS, or cuBLAS refusing to
// reserve one): the first slice's f32 tile kernel, on device memory through kernels.h, held to
// the f32 bound, partial tiles in both directions; a NaN activation reaches its token's outputs.
// (CudaOptions::matmul = V1 ran this kernel through the backend until issue 31 removed V1.)
TEST(CudaOps, MatmulTileFallbackWithoutGemm) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  struct Shape {
    DType type;
    int64_t n_rows, k;
  };
  for (const Shape sh :
       {Shape{DType::F32, 65, 31}, Shape{DType::F16, 130, 96}, Shape{DType::BF16, 3, 100},
        Shape{DType::Q8_0, 70, 544}, Shape{DType::Q4_1, 5, 160}, Shape{DType::Q3_K, 31, 256},
        Shape{DType::Q4_K, 257, 768}, Shape{DType::Q6_K, 64, 2048}}) {
    TestWeights w = make_weights(sh.type, sh.n_rows, sh.k, rng);
    cuda::DeviceBuffer wbuf, xbuf, ybuf;
    auto* dw = static_cast<std::byte*>(wbuf.ensure(w.bytes.size(), "w"));
    cuda::check_cuda(cudaMemcpy(dw, w.bytes.data(), w.bytes.size(), cudaMemcpyHostToDevice), "w");
    const cuda::DeviceWeight d{sh.type, sh.k, sh.n_rows, w.m.row_bytes, dw};
    for (int64_t n_tok : {17, 70}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(sh.type) << " rows " << sh.n_rows << " k "
                                        << sh.k << " n_tok " << n_tok << " seed " << ops_seed());
      std::vector<float> x = random_vec(rng, n_tok * sh.k, 1.0f);
      x[size_t(5 * sh.k + sh.k / 2)] = NAN;  // token 5
      std::vector<float> y_ref(n_tok * sh.n_rows), y(y_ref.size(), 0.0f);
      ref().matmul(w.m, x, n_tok, y_ref);
      auto* dx = static_cast<float*>(xbuf.ensure(x.size() * sizeof(float), "x"));
      auto* dy = static_cast<float*>(ybuf.ensure(y.size() * sizeof(float), "y"));
      cuda::check_cuda(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice),
                       "x");
      cuda::check_cuda(cuda::launch_matmul(d, dx, n_tok, dy, nullptr, nullptr), "tile kernel");
      cuda::check_cuda(cudaMemcpy(y.data(), dy, y.size() * sizeof(float), cudaMemcpyDeviceToHost),
                       "y");
      for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t r = 0; r < sh.n_rows; ++r) {
          const float got = y[size_t(t * sh.n_rows + r)];
          if (t == 5) {
            ASSERT_TRUE(std::isnan(got)) << "r " << r;
            continue;
          }
          ASSERT_TRUE(close(got, y_ref[size_t(t * sh.n_rows + r)],
                            matmul_tol(w.deq.data() + r * sh.k, x.data() + t * sh.k, sh.k)))
              << "t " << t << " r " << r;
        }
    }
  }
}

// V2's shape-dependent choices: more rows than one resident wave of warps (each warp loops
// over rows), activations too wide for 4 tokens of shared memory (one token per column), too
// wide for shared memory at all (the first kernels run, once V1), and a prefill large enough
// for the GEMM path.
TEST(CudaOps, MatmulV2ShapePaths) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  struct Shape {
    DType type;
    int64_t n_rows, k;
    std::vector<int64_t> toks;
  };
  const Shape shapes[] = {
      {DType::Q4_K, 4500, 256, {1, 5}}, {DType::Q8_0, 4500, 1024, {1, 2}},
      {DType::F16, 4500, 256, {1, 3}},  {DType::Q6_K, 4500, 2048, {1}},
      {DType::Q4_K, 40, 5632, {1, 6}},  {DType::Q8_0, 20, 5632, {7}},
      {DType::F32, 9, 22528, {1, 2}},   {DType::Q4_0, 9, 22528, {1, 3}},
      {DType::Q4_K, 300, 512, {64}},    {DType::F16, 129, 96, {33}},
  };
  for (const Shape& sh : shapes) {
    TestWeights w = make_weights(sh.type, sh.n_rows, sh.k, rng);
    for (int64_t n_tok : sh.toks) {
      SCOPED_TRACE(::testing::Message() << dtype_name(sh.type) << " rows " << sh.n_rows << " k "
                                        << sh.k << " n_tok " << n_tok << " seed " << ops_seed());
      const std::vector<float> x = random_vec(rng, n_tok * sh.k, 1.0f);
      std::vector<float> y_ref(n_tok * sh.n_rows), y(y_ref.size(), NAN);
      ref().matmul(w.m, x, n_tok, y_ref);
      gpu().matmul(w.m, x, n_tok, y);
      for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t r = 0; r < sh.n_rows; ++r)
          ASSERT_TRUE(close(y[t * sh.n_rows + r], y_ref[t * sh.n_rows + r],
                            matmul_tol_for(Kernels::V2, n_tok, w.deq.data() + r * sh.k,
                                           x.data() + t * sh.k, sh.k)))
              << "t " << t << " r " << r;
    }
  }
}

TEST(CudaOps, WeightArenaUploadsOnceAndSeesChangedBytes) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  TestWeights w = make_weights(DType::Q4_K, 64, 512, rng);
  const std::vector<float> x = random_vec(rng, 512);
  std::vector<float> y1(64), y2(64), y_ref(64);
  gpu().matmul(w.m, x, 1, y1);
  const CudaStats s0 = gpu().stats();
  gpu().matmul(w.m, x, 1, y2);
  gpu().matmul(w.m.rows(16, 8), x, 1, std::span<float>(y2).subspan(0, 8));  // a slice: a hit
  const CudaStats s1 = gpu().stats();
  EXPECT_EQ(s1.weight_uploads, s0.weight_uploads);
  EXPECT_EQ(s1.weight_bytes_uploaded, s0.weight_bytes_uploaded);
  EXPECT_GE(s1.weight_cache_hits, s0.weight_cache_hits + 2);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(y2[i], y1[16 + i]) << i;
  // Same address, new bytes (verify mode): the result must follow the bytes.
  TestWeights w2 = make_weights(DType::Q4_K, 64, 512, rng);
  std::memcpy(w.bytes.data(), w2.bytes.data(), w.bytes.size());
  gpu().matmul(w.m, x, 1, y1);
  ref().matmul(w.m, x, 1, y_ref);
  for (int r = 0; r < 64; ++r)
    ASSERT_TRUE(close(y1[r], y_ref[r], matmul_tol(w2.deq.data() + r * 512, x.data(), 512))) << r;
}

TEST(CudaOps, WeightRegionIsUploadedOnceAtCreation) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  TestWeights w = make_weights(DType::Q8_0, 300, 1024, rng);
  CudaOptions o;
  o.matmul = Kernels::V2;  // the f32 bound below
  o.weight_region = w.bytes;
  auto be = make_cuda_backend(o);
  ASSERT_TRUE(be) << be.error();
  const CudaStats s0 = (*be)->stats();
  EXPECT_EQ(s0.weight_bytes_uploaded, w.bytes.size());
  EXPECT_EQ(s0.weight_uploads, 1u);
  const std::vector<float> x = random_vec(rng, 2 * 1024);
  std::vector<float> y(2 * 100), y_ref(y.size());
  const WeightMatrix part = w.m.rows(150, 100);
  (*be)->matmul(part, x, 2, y);
  ref().matmul(part, x, 2, y_ref);
  EXPECT_EQ((*be)->stats().weight_uploads, 1u);
  for (size_t i = 0; i < y.size(); ++i)
    ASSERT_TRUE(
        close(y[i], y_ref[i],
              matmul_tol(w.deq.data() + (150 + i % 100) * 1024, x.data() + (i / 100) * 1024, 1024)))
        << i;
}

// Zero-copy: the region is registered host memory read over PCIe; same results as the arena.
// If the driver refuses the registration the backend falls back to the upload (fails open),
// which must then be correct too; the test says which mode ran.
TEST(CudaOps, ZeroCopyRegionMatchesReference) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  TestWeights w = make_weights(DType::Q4_K, 200, 1024, rng);
  CudaOptions o;
  o.matmul = Kernels::V2;  // matmul_tol_for's bounds are the f32-activation kernels'
  o.weight_region = w.bytes;
  o.zero_copy = true;
  auto be = make_cuda_backend(o);
  ASSERT_TRUE(be) << be.error();
  const CudaStats s0 = (*be)->stats();
  std::printf("zero-copy registration %s\n", s0.zero_copy ? "succeeded" : "refused (arena used)");
  EXPECT_EQ(s0.weight_bytes_uploaded, s0.zero_copy ? 0u : w.bytes.size());
  for (int64_t n_tok : {1, 5, 40}) {
    const std::vector<float> x = random_vec(rng, n_tok * 1024);
    std::vector<float> y(n_tok * 200), y_ref(y.size());
    (*be)->matmul(w.m, x, n_tok, y);
    ref().matmul(w.m, x, n_tok, y_ref);
    for (int64_t t = 0; t < n_tok; ++t)
      for (int64_t r = 0; r < 200; ++r)
        ASSERT_TRUE(close(
            y[t * 200 + r], y_ref[t * 200 + r],
            matmul_tol_for(o.matmul, n_tok, w.deq.data() + r * 1024, x.data() + t * 1024, 1024)))
            << "n_tok " << n_tok << " t " << t << " r " << r;
  }
  const std::vector<int32_t> ids = {199, 0, 77};
  std::vector<float> a(ids.size() * 1024), b(a.size(), NAN);
  ref().get_rows(w.m, ids, a);
  (*be)->get_rows(w.m, ids, b);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(b[i], a[i]) << i;
  EXPECT_EQ((*be)->stats().weight_uploads, s0.weight_uploads);  // nothing uploaded per call
}

TEST(CudaOps, BadDeviceIndexIsAnError) {
  KILN_REQUIRE_CUDA();
  CudaOptions o;
  o.device = 1000;
  auto be = make_cuda_backend(o);
  ASSERT_FALSE(be);
  EXPECT_NE(be.error().find("does not exist"), std::string::npos) << be.error();
}

// The fused residual add + norm (forward.cpp's block boundaries) must keep the bits of the two
// ops it replaces, in device memory (the resident path a real run takes: the fused kernel
// where the row fits the float4 path, the two kernels elsewhere) and on host spans; and be
// within rmsnorm's bound of the reference.
TEST(CudaOps, AddRmsnormHasTheBitsOfAddThenRmsnorm) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  CudaBackend& be = gpu();
  for (int64_t n : {1, 3, 64, 100, 1024, 2048, 4096, 5120, 8192, 12288}) {
    for (int64_t rows : {1, 3, 17}) {
      const size_t len = static_cast<size_t>(rows * n);
      const std::vector<float> x = random_vec(rng, len, 3.0f), a = random_vec(rng, len, 2.0f);
      const std::vector<float> wt = random_vec(rng, static_cast<size_t>(n));
      for (bool with_w : {false, true}) {
        const std::span<const float> ws =
            with_w ? std::span<const float>(wt) : std::span<const float>();
        BackendBuffer<float> dx1 = be.alloc<float>(len), dx2 = be.alloc<float>(len);
        BackendBuffer<float> da = be.alloc<float>(len);
        BackendBuffer<float> dy1 = be.alloc<float>(len), dy2 = be.alloc<float>(len);
        be.upload<float>(x, dx1.span());
        be.upload<float>(x, dx2.span());
        be.upload<float>(a, da.span());
        be.add(dx1.span(), da.span(), dx1.span());
        be.rmsnorm(dx1.span(), ws, n, 1e-6f, dy1.span());
        be.add_rmsnorm(dx2.span(), da.span(), ws, n, 1e-6f, dy2.span());
        std::vector<float> x1(len), x2(len), y1(len), y2(len);
        be.download<float>(dx1.span(), x1);
        be.download<float>(dx2.span(), x2);
        be.download<float>(dy1.span(), y1);
        be.download<float>(dy2.span(), y2);
        ASSERT_EQ(std::memcmp(x1.data(), x2.data(), len * sizeof(float)), 0)
            << "x, n " << n << " rows " << rows;
        ASSERT_EQ(std::memcmp(y1.data(), y2.data(), len * sizeof(float)), 0)
            << "y, n " << n << " rows " << rows;
        // Host spans, and the reference.
        std::vector<float> hx = x, hy(len, NAN), rx = x, ry(len);
        be.add_rmsnorm(hx, a, ws, n, 1e-6f, hy);
        ASSERT_EQ(std::memcmp(hx.data(), x1.data(), len * sizeof(float)), 0) << "host x, n " << n;
        ASSERT_EQ(std::memcmp(hy.data(), y1.data(), len * sizeof(float)), 0) << "host y, n " << n;
        ref().add_rmsnorm(rx, a, ws, n, 1e-6f, ry);
        for (size_t i = 0; i < len; ++i) {
          ASSERT_TRUE(close(x2[i], rx[i], 0)) << "add, n " << n << " i " << i;
          ASSERT_TRUE(close(y2[i], ry[i], 2e-6 * std::fabs(ry[i]) + 1e-7))
              << "norm, n " << n << " i " << i;
        }
      }
    }
  }
}

// copy_2d (one cudaMemcpy2DAsync) on resident buffers against the host loop, odd widths and
// offsets (the latent-attention column gathers), and on host spans.
TEST(CudaOps, Copy2dGathersColumnsAsTheHostLoop) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  CudaBackend& be = gpu();
  struct Shape {
    int64_t rows, src_w, src_col, dst_w, dst_col, width;
  };
  for (const Shape& sh : {Shape{1, 8, 0, 8, 0, 8}, Shape{37, 144, 128, 16, 0, 16},
                          Shape{512, 576, 0, 9216, 1152, 512}, Shape{3, 7, 2, 5, 1, 3},
                          Shape{96, 80, 16, 64, 0, 64}}) {
    const auto ns = static_cast<size_t>(sh.rows * sh.src_w);
    const auto nd = static_cast<size_t>(sh.rows * sh.dst_w);
    const std::vector<float> src = random_vec(rng, ns), dst0 = random_vec(rng, nd);
    std::vector<float> want = dst0;
    for (int64_t r = 0; r < sh.rows; ++r)
      for (int64_t c = 0; c < sh.width; ++c)
        want[static_cast<size_t>(r * sh.dst_w + sh.dst_col + c)] =
            src[static_cast<size_t>(r * sh.src_w + sh.src_col + c)];
    BackendBuffer<float> ds = be.alloc<float>(ns), dd = be.alloc<float>(nd);
    be.upload<float>(src, ds.span());
    be.upload<float>(dst0, dd.span());
    be.copy_2d<float>(ds.span(), sh.src_w, sh.src_col, dd.span(), sh.dst_w, sh.dst_col, sh.rows,
                      sh.width);
    std::vector<float> got(nd);
    be.download<float>(dd.span(), got);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), nd * sizeof(float)), 0) << sh.rows << " rows";
    std::vector<float> host = dst0;
    be.copy_2d<float>(src, sh.src_w, sh.src_col, host, sh.dst_w, sh.dst_col, sh.rows, sh.width);
    ASSERT_EQ(std::memcmp(host.data(), want.data(), nd * sizeof(float)), 0) << "host spans";
  }
}

// rope_qk on resident buffers: one launch for Q and K against two rope() ops, memcmp; Q and K head
// counts as in GQA (32/8) and odd ones, decode (1 token) and several tokens.
TEST(CudaOps, RopeQkEqualsTwoRopes) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed() + 3);
  {
    CudaOptions o;
    auto be = make_cuda_backend(o);
    ASSERT_TRUE(be) << be.error();
    Backend& b = **be;
    for (RopeStyle style : {RopeStyle::Normal, RopeStyle::NeoX}) {
      for (auto [hq, hk, hd, n_rot, n_tok] :
           {std::array<int64_t, 5>{32, 8, 128, 128, 1}, std::array<int64_t, 5>{32, 8, 128, 64, 7},
            std::array<int64_t, 5>{5, 3, 80, 80, 3}, std::array<int64_t, 5>{2, 2, 2, 2, 2}}) {
        SCOPED_TRACE(::testing::Message() << "style " << int(style) << " hq " << hq << " hk " << hk
                                          << " hd " << hd << " n_tok " << n_tok);
        std::vector<int32_t> pos(static_cast<size_t>(n_tok));
        for (int64_t t = 0; t < n_tok; ++t) pos[size_t(t)] = int32_t(t * 997 + 3);
        const RopeParams p{.n_rot = n_rot,
                           .freq_base = style == RopeStyle::NeoX ? 1e6f : 1e4f,
                           .freq_scale = 0.5f,
                           .style = style};
        const std::vector<float> q = random_vec(rng, size_t(n_tok * hq * hd));
        const std::vector<float> k = random_vec(rng, size_t(n_tok * hk * hd));
        BackendBuffer<float> q1 = b.alloc<float>(q.size()), k1 = b.alloc<float>(k.size());
        BackendBuffer<float> q2 = b.alloc<float>(q.size()), k2 = b.alloc<float>(k.size());
        b.upload<float>(q, q1.span());
        b.upload<float>(k, k1.span());
        b.upload<float>(q, q2.span());
        b.upload<float>(k, k2.span());
        b.rope_qk(q1.span(), hq, k1.span(), hk, n_tok, hd, pos, p);
        b.rope(q2.span(), n_tok, hq, hd, pos, p);
        b.rope(k2.span(), n_tok, hk, hd, pos, p);
        std::vector<float> a(q.size()), c(q.size()), ak(k.size()), ck(k.size());
        b.download<float>(q1.span(), a);
        b.download<float>(q2.span(), c);
        b.download<float>(k1.span(), ak);
        b.download<float>(k2.span(), ck);
        ASSERT_EQ(std::memcmp(a.data(), c.data(), a.size() * 4), 0);
        ASSERT_EQ(std::memcmp(ak.data(), ck.data(), ak.size() * 4), 0);
        // And the reference's values (host spans: the op's own check of the angles).
        std::vector<float> rq = q;
        ref().rope(rq, n_tok, hq, hd, pos, p);
        for (size_t i = 0; i < rq.size(); ++i)
          ASSERT_TRUE(close(a[i], rq[i], 1e-6 * (1 + std::fabs(rq[i])))) << "i " << i;
      }
    }
  }
}

// swiglu_matmul on resident buffers (SwiGLU inside the int8 activation quantization) against
// swiglu() then matmul(), memcmp, on the int8 types (one token, batched, the tensor-core range) and
// where the fused path does not apply (F16; 17 tokens, past the int8 range of Auto, cuBLAS).
TEST(CudaOps, SwigluMatmulEqualsTheTwoOps) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed() + 4);
  {
    CudaOptions o;
    o.verify_weight_cache = true;
    auto be = make_cuda_backend(o);
    ASSERT_TRUE(be) << be.error();
    Backend& b = **be;
    for (DType t : {DType::Q4_K, DType::Q6_K, DType::Q8_0, DType::F16}) {
      const int64_t k = 512, rows = 37;
      const size_t rb = *row_bytes(t, k);
      std::vector<std::byte> bytes(rb * size_t(rows));
      for (int64_t r = 0; r < rows; ++r)
        quant::quantize_row(t, random_vec(rng, k, 0.05f),
                            std::span<std::byte>(bytes).subspan(size_t(r) * rb, rb));
      const WeightMatrix w{
          .dtype = t, .n_cols = k, .n_rows = rows, .row_bytes = rb, .bytes = bytes};
      for (int64_t n_tok : {1, 3, 8, 16, 17}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " n_tok " << n_tok);
        const std::vector<float> g = random_vec(rng, size_t(n_tok * k), 4.0f);
        const std::vector<float> u = random_vec(rng, size_t(n_tok * k));
        BackendBuffer<float> dg = b.alloc<float>(g.size()), du = b.alloc<float>(u.size());
        BackendBuffer<float> act = b.alloc<float>(g.size()), act2 = b.alloc<float>(g.size());
        BackendBuffer<float> y1 = b.alloc<float>(size_t(n_tok * rows));
        BackendBuffer<float> y2 = b.alloc<float>(size_t(n_tok * rows));
        b.upload<float>(g, dg.span());
        b.upload<float>(u, du.span());
        b.swiglu_matmul(w, dg.span(), du.span(), n_tok, act.span(), y1.span());
        b.swiglu(dg.span(), du.span(), act2.span());
        b.matmul(w, act2.span(), n_tok, y2.span());
        std::vector<float> a1(size_t(n_tok * rows)), a2(a1.size());
        b.download<float>(y1.span(), a1);
        b.download<float>(y2.span(), a2);
        ASSERT_EQ(std::memcmp(a1.data(), a2.data(), a1.size() * 4), 0);
        for (float v : a1) ASSERT_TRUE(std::isfinite(v));
      }
    }
  }
}

// Device top-k against the host default (Backend::top_k) on host spans and on device memory:
// single and many rows, vocabularies below one chunk and of real sizes, k from 1 (greedy) to
// the kernel's most, ties (equal values, first index first), -inf, -0 beside +0.
TEST(CudaOps, TopKSameAsHost) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  struct Case {
    int64_t rows, n;
    int32_t k;
  };
  for (const Case c :
       {Case{1, 1, 1}, Case{1, 7, 7}, Case{3, 1000, 40}, Case{2, 1025, 256}, Case{1, 32000, 1},
        Case{1, 32000, 40}, Case{64, 32000, 40}, Case{5, 152064, 100}, Case{2, 4097, 256},
        Case{5, 128256, 1}, Case{3, 8193, 1}, Case{64, 8192, 1}, Case{2, 1000000, 1}}) {
    SCOPED_TRACE(::testing::Message()
                 << "rows " << c.rows << " n " << c.n << " k " << c.k << " seed " << ops_seed());
    std::vector<float> x = random_vec(rng, size_t(c.rows * c.n));
    if (c.n > 100) {  // ties across chunks, infinities, signed zeros
      for (int64_t r = 0; r < c.rows; ++r) {
        float* row = x.data() + r * c.n;
        row[c.n - 1] = row[c.n / 2] = row[3] = 9.0f;
        row[5] = -INFINITY;
        row[c.n - 2] = 0.0f, row[1] = -0.0f;
      }
    }
    const size_t m = size_t(c.rows * c.k);
    std::vector<int32_t> want_i(m), got_i(m, -1), dev_i(m, -1);
    std::vector<float> want_v(m), got_v(m), dev_v(m);
    ref().top_k(x, c.n, c.k, want_i, want_v);
    gpu().top_k(x, c.n, c.k, got_i, got_v);
    EXPECT_EQ(got_i, want_i) << "host spans";
    EXPECT_EQ(std::memcmp(got_v.data(), want_v.data(), m * 4), 0) << "host spans";
    BackendBuffer<float> d = gpu().alloc<float>(x.size());
    gpu().upload(std::span<const float>(x), d.span());
    gpu().top_k(d.span(), c.n, c.k, dev_i, dev_v);
    EXPECT_EQ(dev_i, want_i) << "device memory";
    EXPECT_EQ(std::memcmp(dev_v.data(), want_v.data(), m * 4), 0) << "device memory";
  }
  // Beyond the kernel's k: the rows are downloaded and sorted on the host, same answer.
  std::vector<float> x = random_vec(rng, 3000);
  std::vector<int32_t> want_i(1000), got_i(1000);
  std::vector<float> want_v(1000), got_v(1000);
  ref().top_k(x, 3000, 1000, want_i, want_v);
  gpu().top_k(x, 3000, 1000, got_i, got_v);
  EXPECT_EQ(got_i, want_i);
}

// A download into host memory page-locked through register_host_memory (engine/host_logits.h
// does that for the logits) takes the direct DMA; one into plain memory the pinned bounce
// buffer. Same bytes both ways, whole or a part at an offset.
TEST(CudaOps, DirectDownloadSameBytesAsStaged) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  const size_t n = 32000 * 3 + 5;
  const std::vector<float> x = random_vec(rng, n);
  BackendBuffer<float> d = gpu().alloc<float>(n);
  gpu().upload(std::span<const float>(x), d.span());
  const size_t bytes = (n * 4 + 4095) / 4096 * 4096;
  std::unique_ptr<float, void (*)(void*)> mem(static_cast<float*>(std::aligned_alloc(4096, bytes)),
                                              std::free);
  const std::span<float> p(mem.get(), n);
  std::shared_ptr<void> reg =
      gpu().register_host_memory(std::as_writable_bytes(std::span<float>(mem.get(), bytes / 4)));
  ASSERT_NE(reg, nullptr) << "register_host_memory refused";
  std::vector<float> plain(n);
  for (int rep = 0; rep < 2; ++rep) {
    std::fill(p.begin(), p.end(), 0.0f);
    gpu().download(std::span<const float>(d.span()), p);
    gpu().download(std::span<const float>(d.span()), std::span<float>(plain));
    ASSERT_EQ(std::memcmp(p.data(), x.data(), n * 4), 0) << "direct download, rep " << rep;
    ASSERT_EQ(std::memcmp(plain.data(), x.data(), n * 4), 0) << "staged download, rep " << rep;
  }
  // A part of the buffer, at an offset.
  std::fill(p.begin(), p.end(), 0.0f);
  gpu().download(std::span<const float>(d.span()).subspan(7, 1000), p.subspan(3, 1000));
  EXPECT_EQ(std::memcmp(p.data() + 3, x.data() + 7, 1000 * 4), 0);
  EXPECT_EQ(p[2], 0.0f);
  EXPECT_EQ(p[1003], 0.0f);
  reg.reset();  // unregistered before the memory is freed
}

}  // namespace
}  // namespace kiln
