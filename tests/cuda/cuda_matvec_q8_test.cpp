// tests/cuda/cuda_matvec_q8_test.cpp: MatmulKernels::V3 (matvec_q8.cu) on device memory through
// kernels.h: int8-activation dp4a kernels for Q8_0 Q4_0 Q5_0 Q4_K Q5_K Q6_K and the float
// kernel, against a double-precision reference on the host-dequantized weights, for every
// kernel path (shared-memory staged rows, aligned and unaligned direct rows, Q4_K's pairs of
// units, 1..64 tokens), and each token's output bit-identical to a 1-token call
// (docs/determinism.md). Skips with a message when no GPU is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_util.h"
#include "backend/cuda/kernels.h"
#include "core/dtype.h"
#include "ops/ops_common.h"
#include "quant/quant.h"

namespace kiln {
namespace {

using kiln::testing::close;
using kiln::testing::ops_seed;
using kiln::testing::random_vec;

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define REQUIRE_GPU()                                                      \
  do {                                                                     \
    if (!have_gpu()) GTEST_SKIP() << "no CUDA device, CUDA tests skipped"; \
  } while (0)

template <typename T>
T* to_device(cuda::DeviceBuffer& buf, const std::vector<T>& host, size_t offset_bytes = 0) {
  auto* base =
      static_cast<std::byte*>(buf.ensure(host.size() * sizeof(T) + offset_bytes + 16, "test"));
  cuda::check_cuda(
      cudaMemcpy(base + offset_bytes, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
      "upload");
  return reinterpret_cast<T*>(base + offset_bytes);
}

std::vector<float> from_device(const float* d, size_t n) {
  std::vector<float> h(n);
  cuda::check_cuda(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), "download");
  return h;
}

constexpr int64_t kMaxTok = cuda::kQ8MaxTokens;

struct Case {
  DType type;
  int64_t k, rows;
  size_t misalign;  // bytes added to the weight's device address (2: the unaligned path)
};

// V3 output of n_tok tokens (x holds at least n_tok rows of k).
std::vector<float> run_v3(const cuda::DeviceWeight& w, const float* dx, int64_t n_tok, void* act,
                          size_t act_bytes, float* dy) {
  cuda::check_cuda(cudaMemset(dy, 0xff, size_t(n_tok * w.n_rows) * sizeof(float)), "memset");
  cuda::check_cuda(cuda::launch_matmul_v3(w, dx, n_tok, dy, act, act_bytes, nullptr), "v3");
  cuda::check_cuda(cudaDeviceSynchronize(), "sync");
  return from_device(dy, size_t(n_tok * w.n_rows));
}

void run_case(const Case& c, std::mt19937_64& rng) {
  SCOPED_TRACE(::testing::Message() << dtype_name(c.type) << " k " << c.k << " rows " << c.rows
                                    << " misalign " << c.misalign << " seed " << ops_seed());
  const size_t rb = *row_bytes(c.type, c.k);
  std::vector<std::byte> bytes(rb * c.rows);
  std::vector<float> deq(size_t(c.rows * c.k));
  for (int64_t r = 0; r < c.rows; ++r) {
    const std::vector<float> src = random_vec(rng, c.k, 0.05f);
    auto dst = std::span<std::byte>(bytes).subspan(r * rb, rb);
    quant::quantize_row(c.type, src, dst);
    quant::dequantize_row(c.type, dst, std::span<float>(deq).subspan(r * c.k, c.k));
  }
  std::vector<float> x = random_vec(rng, size_t(kMaxTok * c.k), 1.0f);
  // A token with a wide dynamic range inside its blocks (the quantization error is relative
  // to each block's largest value).
  for (int64_t i = 0; i < c.k; i += 7) x[size_t(3 * c.k + i)] *= 40.0f;

  cuda::DeviceBuffer wbuf, xbuf, ybuf, abuf;
  const auto* dw = to_device(wbuf, bytes, c.misalign);
  const float* dx = to_device(xbuf, x);
  float* dy = static_cast<float*>(ybuf.ensure(size_t(kMaxTok * c.rows) * sizeof(float), "y"));
  const size_t act_bytes = cuda::act_q8_bytes(c.k, kMaxTok);
  void* act = abuf.ensure(std::max<size_t>(act_bytes, 16), "act");
  const cuda::DeviceWeight w{c.type, c.k, c.rows, rb, dw};

  const bool int8 = cuda::matvec_q8_supports(c.type);
  // Reference and bound per (token, row): f32 accumulation in any order is within a few
  // 1e-6 of sum|w x|; the int8 activations move each x_i by at most d_b/2 (d_b = amax_b/127
  // of its 32-block), roughly uniformly: sigma^2 = sum_b d_b^2/12 sum_{i in b} w_i^2, 6 sigma
  // allowed (the bound tests/ops uses for the CPU's int8 path).
  std::vector<double> want(size_t(kMaxTok * c.rows)), tol(want.size());
  for (int64_t t = 0; t < kMaxTok; ++t) {
    const float* xt = x.data() + t * c.k;
    for (int64_t r = 0; r < c.rows; ++r) {
      const float* wr = deq.data() + r * c.k;
      double s = 0, abs_sum = 0, var = 0;
      for (int64_t b0 = 0; b0 < c.k; b0 += 32) {
        float amax = 0;
        double w2 = 0;
        for (int64_t i = b0; i < b0 + 32; ++i) {
          s += double(wr[i]) * xt[i];
          abs_sum += std::fabs(double(wr[i]) * xt[i]);
          amax = std::max(amax, std::fabs(xt[i]));
          w2 += double(wr[i]) * wr[i];
        }
        const double d = amax / 127.0;
        var += d * d / 12.0 * w2;
      }
      want[t * c.rows + r] = s;
      tol[t * c.rows + r] = 2e-5 * abs_sum + 1e-6 + (int8 ? 6.0 * std::sqrt(var) : 0.0);
    }
  }
  // 1-token outputs of every token: the bits every batched call must reproduce.
  const int64_t max_tok = int8 ? kMaxTok : 8;
  std::vector<float> single(size_t(max_tok * c.rows));
  for (int64_t t = 0; t < max_tok; ++t) {
    const std::vector<float> y = run_v3(w, dx + t * c.k, 1, act, act_bytes, dy);
    std::copy(y.begin(), y.end(), single.begin() + t * c.rows);
  }
  for (int64_t n_tok : {1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64}) {
    if (n_tok > max_tok) continue;
    SCOPED_TRACE(::testing::Message() << "n_tok " << n_tok);
    const std::vector<float> y = run_v3(w, dx, n_tok, act, act_bytes, dy);
    for (int64_t t = 0; t < n_tok; ++t)
      for (int64_t r = 0; r < c.rows; ++r) {
        const size_t i = size_t(t * c.rows + r);
        ASSERT_TRUE(close(y[i], float(want[i]), tol[i])) << "t " << t << " r " << r;
        ASSERT_EQ(std::memcmp(&y[i], &single[i], sizeof(float)), 0)
            << "t " << t << " r " << r << ": " << y[i] << " batched vs " << single[i] << " alone";
      }
  }
}

// Each int8 type on its shared-memory staged path (rows 16-byte aligned, a whole number of
// chunks), on the direct path, and on the 2-byte-load path (rows whose size is not a multiple
// of 16, or a base moved by 2 bytes); several rows per warp with a partial last group. Q4_K's
// pairs (n_cols / 64 of them; 2 per lane in flight at 1-2 tokens, 1 from 3 tokens on): 4
// (fewer than the lanes), 8, 12, 44 (lanes with 2 pairs and with 1), 64 (one full group of 2),
// 224 (a partial last group of 2), on aligned and moved rows.
TEST(CudaMatvecQ8, EveryTypeAndPathMatchesReferenceAndIsTokenInvariant) {
  REQUIRE_GPU();
  std::mt19937_64 rng(ops_seed());
  const Case cases[] = {
      {DType::Q8_0, 1024, 37, 0}, {DType::Q8_0, 2048, 5, 0},  {DType::Q8_0, 544, 7, 0},
      {DType::Q8_0, 1024, 9, 2},  {DType::Q4_0, 2048, 37, 0}, {DType::Q4_0, 96, 3, 0},
      {DType::Q5_0, 2048, 37, 0}, {DType::Q5_0, 160, 6, 0},   {DType::Q4_K, 512, 37, 0},
      {DType::Q4_K, 768, 1, 2},   {DType::Q4_K, 256, 300, 0}, {DType::Q4_K, 256, 5, 2},
      {DType::Q4_K, 2816, 7, 0},  {DType::Q4_K, 2816, 9, 2},  {DType::Q4_K, 4096, 37, 0},
      {DType::Q4_K, 14336, 5, 0}, {DType::Q4_K, 14336, 3, 2}, {DType::Q5_K, 768, 37, 0},
      {DType::Q5_K, 512, 5, 2},   {DType::Q6_K, 2048, 37, 0}, {DType::Q6_K, 256, 7, 0},
      {DType::Q6_K, 4096, 3, 2},  {DType::F16, 256, 37, 0},   {DType::F32, 512, 9, 0},
      {DType::BF16, 1024, 5, 0},
  };
  for (const Case& c : cases) {
    run_case(c, rng);
    if (HasFatalFailure()) return;
  }
}

// V3's float kernel with 1, 2 and 4 rows per warp (launch_matvec_float_v3): every variant has
// the bits of rows = 1 for every token count 1..8 (launch_matmul_v3's default is one of them,
// so run_case's reference and token-invariance checks cover the values), on row counts that
// leave partial row groups (1, 5, 37, 4501: several row blocks per warp) and columns that end
// inside a lane's piece group (8, 24, 264, 4104).
TEST(CudaMatvecQ8, FloatRowsAndColumnsKeepBits) {
  REQUIRE_GPU();
  std::mt19937_64 rng(ops_seed() + 2);
  for (DType t : {DType::F16, DType::BF16, DType::F32}) {
    for (int64_t k : {8, 24, 264, 4104}) {
      for (int64_t rows : {1, 5, 37, 4501}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " k " << k << " rows " << rows
                                          << " seed " << ops_seed() + 2);
        const size_t rb = *row_bytes(t, k);
        std::vector<std::byte> bytes(rb * rows);
        for (int64_t r = 0; r < rows; ++r)
          quant::quantize_row(t, random_vec(rng, k, 0.05f),
                              std::span<std::byte>(bytes).subspan(r * rb, rb));
        const std::vector<float> x = random_vec(rng, size_t(8 * k), 1.0f);
        cuda::DeviceBuffer wbuf, xbuf, ybuf;
        const cuda::DeviceWeight w{t, k, rows, rb, to_device(wbuf, bytes)};
        const float* dx = to_device(xbuf, x);
        float* dy = static_cast<float*>(ybuf.ensure(size_t(8 * rows) * sizeof(float), "y"));
        for (int64_t n_tok = 1; n_tok <= 8; ++n_tok) {
          std::vector<float> base;
          for (int r : {1, 2, 4}) {
            cuda::check_cuda(cudaMemset(dy, 0xff, size_t(n_tok * rows) * sizeof(float)), "memset");
            ASSERT_EQ(cuda::launch_matvec_float_v3(w, dx, n_tok, dy, r, nullptr), cudaSuccess);
            cuda::check_cuda(cudaDeviceSynchronize(), "sync");
            const std::vector<float> y = from_device(dy, size_t(n_tok * rows));
            if (r == 1) {
              base = y;
              continue;
            }
            ASSERT_EQ(std::memcmp(y.data(), base.data(), y.size() * sizeof(float)), 0)
                << "rows per warp " << r << ", n_tok " << n_tok;
          }
        }
      }
    }
  }
  // What the launcher refuses: 0 or 9 tokens, rows 3, a quantized type.
  cuda::DeviceBuffer wbuf, xbuf, ybuf;
  const std::vector<std::byte> bytes(size_t(64) * 2 * 4);
  const cuda::DeviceWeight w{DType::F16, 64, 4, 128, to_device(wbuf, bytes)};
  const float* dx = to_device(xbuf, std::vector<float>(9 * 64, 1.0f));
  float* dy = static_cast<float*>(ybuf.ensure(9 * 4 * sizeof(float), "y"));
  EXPECT_EQ(cuda::launch_matvec_float_v3(w, dx, 0, dy, 1, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::launch_matvec_float_v3(w, dx, 9, dy, 1, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::launch_matvec_float_v3(w, dx, 1, dy, 3, nullptr), cudaErrorInvalidValue);
  const cuda::DeviceWeight wq{DType::Q8_0, 64, 4, 68, w.data};
  EXPECT_EQ(cuda::launch_matvec_float_v3(wq, dx, 1, dy, 1, nullptr), cudaErrorInvalidValue);
}

// The tensor-core float kernel (matvec_mma_float.cu): F16/BF16 against a double reference within
// the float kernel's bound, and every token's output memcmp-equal to its 1-token call at every
// token count 1-8 (a token at column t of the call against column 0 alone). Shapes that take
// 4, 8 and 16 warps per block (fewer steps than warps too), partial last row blocks, a token
// of a wide range and one of large values (tf32 keeps f32's range).
TEST(CudaMatvecQ8, FloatMmaMatchesReferenceAndIsTokenInvariant) {
  REQUIRE_GPU();
  std::mt19937_64 rng(ops_seed() + 5);
  struct Shape {
    int64_t k, rows;
  };
  const Shape shapes[] = {{64, 1},      {192, 37},        {1088, 17},
                          {4096, 4501}, {4160, 4096 + 9}, {2048, 16384 + 3}};
  for (DType t : {DType::F16, DType::BF16}) {
    for (const Shape& sh : shapes) {
      const int64_t k = sh.k, rows = sh.rows;
      SCOPED_TRACE(::testing::Message()
                   << dtype_name(t) << " k " << k << " rows " << rows << " warps "
                   << cuda::float_mma_shape(rows, k).warps << " seed " << ops_seed() + 5);
      const size_t rb = *row_bytes(t, k);
      std::vector<std::byte> bytes(rb * rows);
      std::vector<float> deq(size_t(rows * k));
      for (int64_t r = 0; r < rows; ++r) {
        auto dst = std::span<std::byte>(bytes).subspan(r * rb, rb);
        quant::quantize_row(t, random_vec(rng, k, 0.05f), dst);
        quant::dequantize_row(t, dst, std::span<float>(deq).subspan(r * k, k));
      }
      std::vector<float> x = random_vec(rng, size_t(8 * k), 1.0f);
      for (int64_t i = 0; i < k; i += 7) x[size_t(3 * k + i)] *= 40.0f;
      for (int64_t i = 0; i < k; ++i) x[size_t(6 * k + i)] *= 3.0e4f;
      cuda::DeviceBuffer wbuf, xbuf, ybuf;
      const cuda::DeviceWeight w{t, k, rows, rb, to_device(wbuf, bytes)};
      const float* dx = to_device(xbuf, x);
      float* dy = static_cast<float*>(ybuf.ensure(size_t(8 * rows) * sizeof(float), "y"));
      const auto run = [&](const float* xs, int64_t n_tok) {
        cuda::check_cuda(cudaMemset(dy, 0xff, size_t(n_tok * rows) * sizeof(float)), "memset");
        EXPECT_EQ(cuda::launch_matvec_float_mma(w, xs, n_tok, dy, nullptr), cudaSuccess);
        cuda::check_cuda(cudaDeviceSynchronize(), "sync");
        return from_device(dy, size_t(n_tok * rows));
      };
      std::vector<float> single(size_t(8 * rows));
      for (int64_t tok = 0; tok < 8; ++tok) {
        const std::vector<float> y = run(dx + tok * k, 1);
        std::copy(y.begin(), y.end(), single.begin() + tok * rows);
      }
      for (int64_t tok = 0; tok < 8; ++tok)
        for (int64_t r = 0; r < rows; ++r) {
          double s = 0, abs_sum = 0;
          for (int64_t i = 0; i < k; ++i) {
            const double p = double(deq[size_t(r * k + i)]) * x[size_t(tok * k + i)];
            s += p;
            abs_sum += std::fabs(p);
          }
          ASSERT_TRUE(close(single[size_t(tok * rows + r)], float(s), 2e-5 * abs_sum + 1e-6))
              << "t " << tok << " r " << r;
        }
      for (int64_t n_tok = 2; n_tok <= 8; ++n_tok) {
        const std::vector<float> y = run(dx, n_tok);
        ASSERT_EQ(std::memcmp(y.data(), single.data(), y.size() * sizeof(float)), 0)
            << "n_tok " << n_tok;
      }
      // Steps loaded together and tiles per block change no bit (the warps per block do).
      const cuda::FloatMmaShape policy = cuda::float_mma_shape(rows, k);
      struct ShapeReset {
        ~ShapeReset() { cuda::set_float_mma_shape({}); }
      } reset;
      for (const auto [unroll, mtiles] :
           {std::pair{2, 1}, std::pair{4, 1}, std::pair{1, 2}, std::pair{2, 2}}) {
        cuda::set_float_mma_shape({policy.warps, unroll, mtiles});
        for (int64_t n_tok : {1, 5, 8}) {
          const std::vector<float> y = run(dx, n_tok);
          ASSERT_EQ(std::memcmp(y.data(), single.data(), y.size() * sizeof(float)), 0)
              << "unroll " << unroll << " mtiles " << mtiles << " n_tok " << n_tok;
        }
      }
    }
  }
  // What the launcher refuses: 0 or 9 tokens, a width not a multiple of 64, F32 and quantized
  // weights, rows off 16-byte alignment.
  cuda::DeviceBuffer wbuf, xbuf, ybuf;
  const std::vector<std::byte> bytes(size_t(128) * 2 * 4 + 16);
  const std::byte* base = to_device(wbuf, bytes);
  const cuda::DeviceWeight w{DType::F16, 128, 4, 256, base};
  const float* dx = to_device(xbuf, std::vector<float>(9 * 128, 1.0f));
  float* dy = static_cast<float*>(ybuf.ensure(9 * 4 * sizeof(float), "y"));
  EXPECT_EQ(cuda::launch_matvec_float_mma(w, dx, 0, dy, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::launch_matvec_float_mma(w, dx, 9, dy, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::launch_matvec_float_mma({DType::F16, 96, 4, 192, base}, dx, 1, dy, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::launch_matvec_float_mma({DType::F32, 128, 4, 512, base}, dx, 1, dy, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::launch_matvec_float_mma({DType::Q8_0, 128, 4, 136, base}, dx, 1, dy, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::launch_matvec_float_mma({DType::F16, 128, 4, 256, base + 2}, dx, 1, dy, nullptr),
            cudaErrorInvalidValue);
}

// The float_mma grouped launch (a layer's Q/K/V: 2048 x 2048, 512, 512 rows; odd row counts):
// each output memcmp-equal to its weight's own launch, 1-8 tokens; weights whose launch shapes
// differ (so would their bits) are refused with nothing launched.
TEST(CudaMatvecQ8, FloatMmaGroupHasEachWeightsBits) {
  REQUIRE_GPU();
  std::mt19937_64 rng(ops_seed() + 7);
  for (DType t : {DType::F16, DType::BF16}) {
    const int64_t k = 2048;
    const int64_t rows[] = {2048, 509, 517};
    const size_t rb = *row_bytes(t, k);
    cuda::DeviceBuffer wbuf[3], ybuf[3], xbuf;
    std::vector<cuda::DeviceWeight> ws;
    std::vector<float*> ys;
    for (int i = 0; i < 3; ++i) {
      std::vector<std::byte> bytes(rb * rows[i]);
      for (int64_t r = 0; r < rows[i]; ++r)
        quant::quantize_row(t, random_vec(rng, k, 0.05f),
                            std::span<std::byte>(bytes).subspan(r * rb, rb));
      ws.push_back({t, k, rows[i], rb, to_device(wbuf[i], bytes)});
      ys.push_back(static_cast<float*>(ybuf[i].ensure(size_t(8 * rows[i]) * sizeof(float), "y")));
    }
    const float* dx = to_device(xbuf, random_vec(rng, size_t(8 * k), 1.0f));
    for (int64_t n_tok = 1; n_tok <= 8; ++n_tok) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " n_tok " << n_tok);
      std::vector<std::vector<float>> alone;
      for (int i = 0; i < 3; ++i) {
        ASSERT_EQ(cuda::launch_matvec_float_mma(ws[i], dx, n_tok, ys[i], nullptr), cudaSuccess);
        cuda::check_cuda(cudaDeviceSynchronize(), "sync");
        alone.push_back(from_device(ys[i], size_t(n_tok * rows[i])));
        cuda::check_cuda(cudaMemset(ys[i], 0xff, size_t(n_tok * rows[i]) * sizeof(float)),
                         "memset");
      }
      ASSERT_EQ(cuda::launch_matvec_float_mma_group(ws, ys, dx, n_tok, nullptr), cudaSuccess);
      cuda::check_cuda(cudaDeviceSynchronize(), "sync");
      for (int i = 0; i < 3; ++i) {
        const std::vector<float> y = from_device(ys[i], size_t(n_tok * rows[i]));
        ASSERT_EQ(std::memcmp(y.data(), alone[i].data(), y.size() * sizeof(float)), 0)
            << "weight " << i;
      }
    }
  }
  // 2048 rows take 16 warps per block, 20000 take 8: not one launch.
  cuda::DeviceBuffer a, b, xb, ya, yb;
  const size_t rb = *row_bytes(DType::F16, 2048);
  const std::vector<std::byte> zeros(rb * 20000);
  const cuda::DeviceWeight wa{DType::F16, 2048, 2048, rb, to_device(a, zeros)};
  const cuda::DeviceWeight wb{DType::F16, 2048, 20000, rb, to_device(b, zeros)};
  ASSERT_NE(cuda::float_mma_shape(2048, 2048).warps, cuda::float_mma_shape(20000, 2048).warps);
  float* y2[2] = {static_cast<float*>(ya.ensure(2048 * sizeof(float), "y")),
                  static_cast<float*>(yb.ensure(20000 * sizeof(float), "y"))};
  const cuda::DeviceWeight pair[2] = {wa, wb};
  EXPECT_EQ(cuda::launch_matvec_float_mma_group(pair, y2, to_device(xb, std::vector<float>(2048)),
                                                1, nullptr),
            cudaErrorNotSupported);
}

// Grouped launches (launch_matvec_*_group): every output memcmp-equal to its weight's own
// launch, for groups of 2-4 weights of odd row counts (partial row blocks at each task's end),
// every int8 mode (staged, direct aligned, direct unaligned) and the float kernel's rows per
// warp, 1-16 tokens; and what a group refuses.
TEST(CudaMatvecQ8, GroupedLaunchHasEachWeightsBits) {
  REQUIRE_GPU();
  std::mt19937_64 rng(ops_seed() + 5);
  struct G {
    DType t;
    int64_t k;
    size_t misalign;
    std::vector<int64_t> rows;
  };
  const G groups[] = {{DType::Q4_K, 512, 0, {96, 33, 1, 160}}, {DType::Q6_K, 2048, 0, {37, 64}},
                      {DType::Q8_0, 2048, 0, {5, 129, 40}},    {DType::Q8_0, 96, 2, {7, 9}},
                      {DType::Q5_0, 2048, 0, {17, 3, 11}},     {DType::Q4_K, 256, 0, {4501, 13}},
                      {DType::Q4_K, 2816, 2, {5, 9, 1}},       {DType::Q4_K, 14336, 0, {7, 3}},
                      {DType::F16, 264, 0, {37, 5, 64}},       {DType::BF16, 4104, 0, {9, 31}},
                      {DType::F32, 24, 0, {1, 2, 3, 4}}};
  for (const G& g : groups) {
    const size_t rb = *row_bytes(g.t, g.k);
    const bool is_float = g.t == DType::F16 || g.t == DType::BF16 || g.t == DType::F32;
    std::vector<cuda::DeviceBuffer> wbufs(g.rows.size()), ybufs(g.rows.size()),
        sbufs(g.rows.size());
    std::vector<cuda::DeviceWeight> ws;
    std::vector<float*> ys, solo;
    for (size_t i = 0; i < g.rows.size(); ++i) {
      std::vector<std::byte> bytes(rb * size_t(g.rows[i]));
      for (int64_t r = 0; r < g.rows[i]; ++r)
        quant::quantize_row(g.t, random_vec(rng, g.k, 0.05f),
                            std::span<std::byte>(bytes).subspan(size_t(r) * rb, rb));
      ws.push_back(cuda::DeviceWeight{
          g.t, g.k, g.rows[i], rb,
          reinterpret_cast<const std::byte*>(to_device(wbufs[i], bytes, g.misalign))});
      ys.push_back(static_cast<float*>(ybufs[i].ensure(size_t(16 * g.rows[i]) * 4, "y")));
      solo.push_back(static_cast<float*>(sbufs[i].ensure(size_t(16 * g.rows[i]) * 4, "y")));
    }
    const std::vector<float> x = random_vec(rng, size_t(16 * g.k), 1.0f);
    cuda::DeviceBuffer xbuf, abuf;
    const float* dx = to_device(xbuf, x);
    void* act = abuf.ensure(cuda::act_q8_bytes(g.k, 16) + 16, "act");
    for (int64_t n_tok : {1, 2, 3, 4, 5, 8, 9, 16}) {
      if (is_float && n_tok > 8) continue;
      for (int rows : {1, 2, 4}) {
        if (!is_float && rows > 1) continue;
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(g.t) << " k " << g.k << " misalign " << g.misalign << " n_tok "
                     << n_tok << " rows " << rows << " seed " << ops_seed() + 5);
        for (size_t i = 0; i < ws.size(); ++i) {
          cuda::check_cuda(cudaMemset(ys[i], 0xff, size_t(n_tok * ws[i].n_rows) * 4), "memset");
          cuda::check_cuda(cudaMemset(solo[i], 0, size_t(n_tok * ws[i].n_rows) * 4), "memset");
        }
        if (is_float) {
          ASSERT_EQ(cuda::launch_matvec_float_v3_group(ws, ys, dx, n_tok, rows, nullptr),
                    cudaSuccess);
          for (size_t i = 0; i < ws.size(); ++i)
            ASSERT_EQ(cuda::launch_matvec_float_v3(ws[i], dx, n_tok, solo[i], rows, nullptr),
                      cudaSuccess);
        } else {
          ASSERT_EQ(cuda::launch_quantize_act_q8(dx, g.k, n_tok, act, nullptr), cudaSuccess);
          ASSERT_EQ(cuda::launch_matvec_q8_group(ws, ys, act, n_tok, nullptr), cudaSuccess);
          for (size_t i = 0; i < ws.size(); ++i)
            ASSERT_EQ(cuda::launch_matvec_q8(ws[i], act, n_tok, solo[i], nullptr), cudaSuccess);
        }
        cuda::check_cuda(cudaDeviceSynchronize(), "sync");
        for (size_t i = 0; i < ws.size(); ++i) {
          const size_t n = size_t(n_tok * ws[i].n_rows);
          const std::vector<float> a = from_device(ys[i], n), b = from_device(solo[i], n);
          ASSERT_EQ(std::memcmp(a.data(), b.data(), n * sizeof(float)), 0) << "weight " << i;
          for (float v : a) ASSERT_TRUE(std::isfinite(v)) << "weight " << i;
        }
      }
    }
  }
  // Refused, nothing launched: mixed types, mixed widths, five weights, an empty weight.
  cuda::DeviceBuffer wbuf, ybuf, abuf, xbuf;
  const std::vector<std::byte> bytes(size_t(1) << 16);
  const auto* p = reinterpret_cast<const std::byte*>(to_device(wbuf, bytes));
  float* y = static_cast<float*>(ybuf.ensure(1 << 16, "y"));
  void* act = abuf.ensure(cuda::act_q8_bytes(256, 1), "act");
  const float* dx = to_device(xbuf, std::vector<float>(256, 1.0f));
  const cuda::DeviceWeight q8{DType::Q8_0, 256, 4, *row_bytes(DType::Q8_0, 256), p};
  const cuda::DeviceWeight q4{DType::Q4_K, 256, 4, *row_bytes(DType::Q4_K, 256), p};
  const cuda::DeviceWeight q8w{DType::Q8_0, 512, 4, *row_bytes(DType::Q8_0, 512), p};
  const cuda::DeviceWeight q8e{DType::Q8_0, 256, 0, *row_bytes(DType::Q8_0, 256), p};
  float* yy[5] = {y, y, y, y, y};
  const cuda::DeviceWeight mixed[2] = {q8, q4}, widths[2] = {q8, q8w},
                           five[5] = {q8, q8, q8, q8, q8}, empty[2] = {q8, q8e};
  EXPECT_EQ(cuda::launch_matvec_q8_group(mixed, std::span(yy, 2), act, 1, nullptr),
            cudaErrorNotSupported);
  EXPECT_EQ(cuda::launch_matvec_q8_group(widths, std::span(yy, 2), act, 1, nullptr),
            cudaErrorNotSupported);
  EXPECT_EQ(cuda::launch_matvec_q8_group(five, std::span(yy, 5), act, 1, nullptr),
            cudaErrorNotSupported);
  EXPECT_EQ(cuda::launch_matvec_q8_group(empty, std::span(yy, 2), act, 1, nullptr),
            cudaErrorNotSupported);
  const cuda::DeviceWeight f16{DType::F16, 256, 4, 512, p};
  const cuda::DeviceWeight f16s[2] = {f16, f16};
  EXPECT_EQ(cuda::launch_matvec_float_v3_group(f16s, std::span(yy, 2), dx, 9, 1, nullptr),
            cudaErrorNotSupported);
  EXPECT_EQ(cuda::launch_matvec_float_v3_group(f16s, std::span(yy, 2), dx, 1, 3, nullptr),
            cudaErrorNotSupported);
  cuda::check_cuda(cudaDeviceSynchronize(), "sync");
}

// The tensor-core path (mma.sync, launch_matvec_q8 from mma_min_tokens tokens) against the dp4a
// kernels (mma_min_tokens 0), memcmp: each output's float operations and their grouping are
// the dp4a kernels' (matvec_q8.cu). Every tile width (nb 1, 2, 4 tiles of 8 tokens), token
// counts that leave partial tiles and columns, rows that leave a partial block of 16, rows of
// fewer than 32 units or pairs (virtual lanes with nothing to add) and of many (14336 wide),
// Q6_K and Q8_0 rows moved by 2 bytes, NaN activations; grouped launches with the tensor cores
// against their weights alone.
TEST(CudaMatvecQ8, MmaHasTheDp4aBits) {
  REQUIRE_GPU();
  std::mt19937_64 rng(ops_seed() + 11);
  const Case cases[] = {
      {DType::Q4_K, 256, 37, 0},  {DType::Q4_K, 512, 16, 0},   {DType::Q4_K, 2816, 9, 0},
      {DType::Q4_K, 4096, 70, 0}, {DType::Q4_K, 14336, 17, 0}, {DType::Q4_K, 1536, 1100, 0},
      {DType::Q6_K, 256, 5, 0},   {DType::Q6_K, 2048, 33, 0},  {DType::Q6_K, 4096, 19, 2},
      {DType::Q6_K, 14336, 3, 0}, {DType::Q8_0, 96, 7, 0},     {DType::Q8_0, 1024, 37, 0},
      {DType::Q8_0, 4096, 21, 2},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << dtype_name(c.type) << " k " << c.k << " rows " << c.rows
                                      << " misalign " << c.misalign << " seed " << ops_seed() + 11);
    const size_t rb = *row_bytes(c.type, c.k);
    std::vector<std::byte> bytes(rb * size_t(c.rows));
    for (int64_t r = 0; r < c.rows; ++r)
      quant::quantize_row(c.type, random_vec(rng, c.k, 0.05f),
                          std::span<std::byte>(bytes).subspan(size_t(r) * rb, rb));
    std::vector<float> x = random_vec(rng, size_t(kMaxTok * c.k), 1.0f);
    x[size_t(5 * c.k + 3)] = NAN;  // token 5's first block: NaN outputs on both paths
    cuda::DeviceBuffer wbuf, xbuf, abuf, ybuf, zbuf;
    const cuda::DeviceWeight w{
        c.type, c.k, c.rows, rb,
        reinterpret_cast<const std::byte*>(to_device(wbuf, bytes, c.misalign))};
    const float* dx = to_device(xbuf, x);
    void* act = abuf.ensure(cuda::act_q8_bytes(c.k, kMaxTok) + 16, "act");
    const size_t n_max = size_t(kMaxTok * c.rows);
    float* y = static_cast<float*>(ybuf.ensure(n_max * 4, "y"));
    float* z = static_cast<float*>(zbuf.ensure(n_max * 4, "z"));
    for (int64_t n_tok : {1, 3, 7, 8, 9, 16, 17, 24, 33, 64}) {
      SCOPED_TRACE(::testing::Message() << "n_tok " << n_tok);
      const size_t n = size_t(n_tok * c.rows);
      ASSERT_EQ(cuda::launch_quantize_act_q8(dx, c.k, n_tok, act, nullptr), cudaSuccess);
      ASSERT_EQ(cuda::launch_matvec_q8(w, act, n_tok, y, nullptr, 0), cudaSuccess);
      const std::vector<float> want = from_device(y, n);
      // Every form of the Q4_K/Q6_K kernel (through rings of 3, 4 or 6 shared-memory stages, 4
      // or 8 warps (-4, -8), where the row is whole stages and nb <= 2; fragments from global
      // memory otherwise).
      for (int staged : {3, 4, 6, -4, -8, 0})
        for (int nb : {1, 2, 4}) {
          cuda::set_mma_stages(staged < 0 ? cuda::kMmaStagesDefault : staged);
          cuda::set_mma_warps(staged < 0 ? -staged : cuda::kMmaWarpsDefault);
          cuda::check_cuda(cudaMemset(z, 0xff, n * 4), "memset");
          ASSERT_EQ(cuda::launch_matvec_q8_mma(w, act, n_tok, z, nb, nullptr), cudaSuccess);
          cuda::check_cuda(cudaDeviceSynchronize(), "sync");
          cuda::set_mma_stages(cuda::kMmaStagesDefault);
          cuda::set_mma_warps(cuda::kMmaWarpsDefault);
          const std::vector<float> got = from_device(z, n);
          for (size_t i = 0; i < n; ++i)
            ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
                << "staged " << staged << " nb " << nb << " t " << i / size_t(c.rows) << " r "
                << i % size_t(c.rows) << ": " << got[i] << " mma vs " << want[i] << " dp4a";
        }
      if (n_tok > 5) {
        for (int64_t r = 0; r < c.rows; ++r) ASSERT_TRUE(std::isnan(want[size_t(5 * c.rows + r)]));
      }
      // Through launch_matvec_q8's threshold (the tensor cores from 8 tokens on).
      cuda::check_cuda(cudaMemset(z, 0xff, n * 4), "memset");
      ASSERT_EQ(cuda::launch_matvec_q8(w, act, n_tok, z, nullptr, 8), cudaSuccess);
      cuda::check_cuda(cudaDeviceSynchronize(), "sync");
      const std::vector<float> dflt = from_device(z, n);
      ASSERT_EQ(std::memcmp(dflt.data(), want.data(), n * 4), 0);
    }
  }
  // Grouped: a layer's Q/K/V-like weights of one layout, tensor cores on, against each alone
  // on dp4a.
  const size_t rb = *row_bytes(DType::Q4_K, 4096);
  const int64_t rows[3] = {4096, 1024, 1024};
  std::vector<cuda::DeviceBuffer> wbufs(3), ybufs(3), sbufs(3);
  std::vector<cuda::DeviceWeight> ws;
  std::vector<float*> ys, solo;
  for (int i = 0; i < 3; ++i) {
    std::vector<std::byte> bytes(rb * size_t(rows[i]));
    for (int64_t r = 0; r < rows[i]; ++r)
      quant::quantize_row(DType::Q4_K, random_vec(rng, 4096, 0.05f),
                          std::span<std::byte>(bytes).subspan(size_t(r) * rb, rb));
    ws.push_back(
        cuda::DeviceWeight{DType::Q4_K, 4096, rows[i], rb,
                           reinterpret_cast<const std::byte*>(to_device(wbufs[i], bytes))});
    ys.push_back(static_cast<float*>(ybufs[i].ensure(size_t(24 * rows[i]) * 4, "y")));
    solo.push_back(static_cast<float*>(sbufs[i].ensure(size_t(24 * rows[i]) * 4, "y")));
  }
  const std::vector<float> x = random_vec(rng, size_t(24 * 4096), 1.0f);
  cuda::DeviceBuffer xbuf, abuf;
  const float* dx = to_device(xbuf, x);
  void* act = abuf.ensure(cuda::act_q8_bytes(4096, 24) + 16, "act");
  for (int64_t n_tok : {8, 13, 16, 24}) {
    SCOPED_TRACE(::testing::Message() << "group n_tok " << n_tok);
    ASSERT_EQ(cuda::launch_quantize_act_q8(dx, 4096, n_tok, act, nullptr), cudaSuccess);
    ASSERT_EQ(cuda::launch_matvec_q8_group(ws, ys, act, n_tok, nullptr, 1), cudaSuccess);
    for (int i = 0; i < 3; ++i)
      ASSERT_EQ(cuda::launch_matvec_q8(ws[i], act, n_tok, solo[i], nullptr, 0), cudaSuccess);
    cuda::check_cuda(cudaDeviceSynchronize(), "sync");
    for (int i = 0; i < 3; ++i) {
      const size_t n = size_t(n_tok * rows[i]);
      const std::vector<float> a = from_device(ys[i], n), b = from_device(solo[i], n);
      ASSERT_EQ(std::memcmp(a.data(), b.data(), n * 4), 0) << "weight " << i;
    }
  }
}

// More rows than one wave of warps, so warps loop over row blocks; the 4096- and 14336-wide
// rows of the 8B shapes (Q4_K also on rows moved by 2 bytes).
TEST(CudaMatvecQ8, LargeShapes) {
  REQUIRE_GPU();
  std::mt19937_64 rng(ops_seed() + 1);
  for (const Case& c : {Case{DType::Q4_K, 1024, 4500, 0}, Case{DType::Q4_K, 14336, 600, 0},
                        Case{DType::Q4_K, 4096, 1500, 2}, Case{DType::Q8_0, 4096, 1100, 0},
                        Case{DType::Q6_K, 4096, 700, 0}}) {
    run_case(c, rng);
    if (HasFatalFailure()) return;
  }
}

// Q4_K's pairs on 16-byte aligned rows (16-byte loads) and on rows moved by 2 bytes (aligned
// words and funnel shifts, and the 8-token launch shape from 2 tokens on): the same pair order
// per lane, so the same bits for every token count, with pair counts below, at and past one
// lane group.
TEST(CudaMatvecQ8, Q4KAlignedAndMovedRowsHaveTheSameBits) {
  REQUIRE_GPU();
  std::mt19937_64 rng(ops_seed() + 7);
  for (int64_t k : {256, 2816, 4096, 14336}) {
    const int64_t rows = 13;
    const size_t rb = *row_bytes(DType::Q4_K, k);
    std::vector<std::byte> bytes(rb * rows);
    for (int64_t r = 0; r < rows; ++r)
      quant::quantize_row(DType::Q4_K, random_vec(rng, k, 0.05f),
                          std::span<std::byte>(bytes).subspan(size_t(r) * rb, rb));
    const std::vector<float> x = random_vec(rng, size_t(kMaxTok * k), 1.0f);
    cuda::DeviceBuffer wa, wm, xbuf, yabuf, ymbuf, abuf;
    const cuda::DeviceWeight aligned{DType::Q4_K, k, rows, rb, to_device(wa, bytes)};
    const cuda::DeviceWeight moved{DType::Q4_K, k, rows, rb, to_device(wm, bytes, 2)};
    const float* dx = to_device(xbuf, x);
    const size_t act_bytes = cuda::act_q8_bytes(k, kMaxTok);
    void* act = abuf.ensure(act_bytes, "act");
    float* dya = static_cast<float*>(yabuf.ensure(size_t(kMaxTok * rows) * sizeof(float), "y"));
    float* dym = static_cast<float*>(ymbuf.ensure(size_t(kMaxTok * rows) * sizeof(float), "y"));
    for (int64_t n_tok : {1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64}) {
      SCOPED_TRACE(::testing::Message()
                   << "k " << k << " n_tok " << n_tok << " seed " << ops_seed() + 7);
      const std::vector<float> ya = run_v3(aligned, dx, n_tok, act, act_bytes, dya);
      const std::vector<float> ym = run_v3(moved, dx, n_tok, act, act_bytes, dym);
      ASSERT_EQ(std::memcmp(ya.data(), ym.data(), ya.size() * sizeof(float)), 0);
      for (float v : ya) ASSERT_TRUE(std::isfinite(v));
    }
  }
}

TEST(CudaMatvecQ8, NanActivationPropagates) {
  REQUIRE_GPU();
  std::mt19937_64 rng(ops_seed());
  for (DType t :
       {DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::F16}) {
    const int64_t k = 512, rows = 5;
    const size_t rb = *row_bytes(t, k);
    std::vector<std::byte> bytes(rb * rows);
    for (int64_t r = 0; r < rows; ++r)
      quant::quantize_row(t, random_vec(rng, k, 0.05f),
                          std::span<std::byte>(bytes).subspan(r * rb, rb));
    for (int64_t n_tok : {1, 5}) {
      std::vector<float> x = random_vec(rng, size_t(n_tok * k));
      for (int64_t tok = 0; tok < n_tok; ++tok) x[size_t(tok * k + 17)] = NAN;
      if (n_tok > 1) x[size_t(k + 40)] = INFINITY;  // inf alone: not finite either
      cuda::DeviceBuffer wbuf, xbuf, ybuf, abuf;
      const cuda::DeviceWeight w{t, k, rows, rb, to_device(wbuf, bytes)};
      const float* dx = to_device(xbuf, x);
      float* dy = static_cast<float*>(ybuf.ensure(size_t(n_tok * rows) * sizeof(float), "y"));
      const size_t ab = cuda::act_q8_bytes(k, n_tok);
      const std::vector<float> y = run_v3(w, dx, n_tok, abuf.ensure(ab, "act"), ab, dy);
      for (float v : y) EXPECT_TRUE(std::isnan(v)) << dtype_name(t) << " n_tok " << n_tok;
    }
  }
}

// Types and token counts outside the int8 path run V2 through the same entry point.
TEST(CudaMatvecQ8, FallbacksMatchReference) {
  REQUIRE_GPU();
  std::mt19937_64 rng(ops_seed());
  struct Fb {
    DType type;
    int64_t k, n_tok;
  };
  for (const Fb& f : {Fb{DType::Q4_1, 256, 3}, Fb{DType::Q2_K, 512, 1}, Fb{DType::Q3_K, 256, 5},
                      Fb{DType::F16, 256, 12}, Fb{DType::Q4_K, 256, 70}, Fb{DType::F32, 31, 1}}) {
    SCOPED_TRACE(::testing::Message()
                 << dtype_name(f.type) << " k " << f.k << " n_tok " << f.n_tok);
    const int64_t rows = 19;
    const size_t rb = *row_bytes(f.type, f.k);
    std::vector<std::byte> bytes(rb * rows);
    std::vector<float> deq(size_t(rows * f.k));
    for (int64_t r = 0; r < rows; ++r) {
      auto dst = std::span<std::byte>(bytes).subspan(r * rb, rb);
      quant::quantize_row(f.type, random_vec(rng, f.k, 0.05f), dst);
      quant::dequantize_row(f.type, dst, std::span<float>(deq).subspan(r * f.k, f.k));
    }
    const std::vector<float> x = random_vec(rng, size_t(f.n_tok * f.k));
    cuda::DeviceBuffer wbuf, xbuf, ybuf, abuf;
    const cuda::DeviceWeight w{f.type, f.k, rows, rb, to_device(wbuf, bytes)};
    float* dy = static_cast<float*>(ybuf.ensure(size_t(f.n_tok * rows) * sizeof(float), "y"));
    const size_t ab = std::max<size_t>(cuda::act_q8_bytes(f.k, f.n_tok), 16);
    const std::vector<float> y =
        run_v3(w, to_device(xbuf, x), f.n_tok, abuf.ensure(ab, "act"), ab, dy);
    for (int64_t t = 0; t < f.n_tok; ++t)
      for (int64_t r = 0; r < rows; ++r) {
        double s = 0, a = 0;
        for (int64_t i = 0; i < f.k; ++i) {
          s += double(deq[r * f.k + i]) * x[t * f.k + i];
          a += std::fabs(double(deq[r * f.k + i]) * x[t * f.k + i]);
        }
        ASSERT_TRUE(close(y[t * rows + r], float(s), 2e-5 * a + 1e-6)) << "t " << t << " r " << r;
      }
  }
}

// The backend with CudaOptions::matmul = V3 (host spans): the same bound against the reference
// backend, and a token's row the same bits in a 1-token and a 7-token call (the int8 kernels
// and F16/BF16's tensor-core kernel; F32 takes V3's float kernel, within the bound).
TEST(CudaMatvecQ8, BackendV3MatchesReference) {
  REQUIRE_GPU();
  {
    CudaOptions o;
    o.matmul = CudaMatmul::V3;
    o.verify_weight_cache = true;  // the test's weight buffers are freed and their addresses reused
    auto be = make_cuda_backend(o);
    ASSERT_TRUE(be) << be.error();
    const std::unique_ptr<Backend> ref = make_ref_backend();
    std::mt19937_64 rng(ops_seed());
    const std::vector<DType> types = {DType::Q4_K, DType::Q8_0, DType::Q6_K, DType::F16,
                                      DType::BF16, DType::Q3_K, DType::F32};
    for (DType t : types) {
      SCOPED_TRACE(::testing::Message() << dtype_name(t) << " seed " << ops_seed());
      const int64_t k = 2048, rows = 45, n_tok = 7;
      const size_t rb = *row_bytes(t, k);
      std::vector<std::byte> bytes(rb * rows);
      std::vector<float> deq(size_t(rows * k));
      for (int64_t r = 0; r < rows; ++r) {
        auto dst = std::span<std::byte>(bytes).subspan(r * rb, rb);
        quant::quantize_row(t, random_vec(rng, k, 0.05f), dst);
        quant::dequantize_row(t, dst, std::span<float>(deq).subspan(r * k, k));
      }
      const WeightMatrix w{
          .dtype = t, .n_cols = k, .n_rows = rows, .row_bytes = rb, .bytes = bytes};
      const std::vector<float> x = random_vec(rng, size_t(n_tok * k));
      std::vector<float> y(size_t(n_tok * rows), NAN), y_ref(y.size()), y1(size_t(rows), NAN);
      (*be)->matmul(w, x, n_tok, y);
      ref->matmul(w, x, n_tok, y_ref);
      (*be)->matmul(w, std::span<const float>(x).subspan(size_t(5 * k), size_t(k)), 1, y1);
      for (int64_t tok = 0; tok < n_tok; ++tok)
        for (int64_t r = 0; r < rows; ++r) {
          double abs_sum = 0, var = 0;
          for (int64_t b0 = 0; b0 < k; b0 += 32) {
            float amax = 0;
            double w2 = 0;
            for (int64_t i = b0; i < b0 + 32; ++i) {
              abs_sum += std::fabs(double(deq[r * k + i]) * x[tok * k + i]);
              amax = std::max(amax, std::fabs(x[tok * k + i]));
              w2 += double(deq[r * k + i]) * deq[r * k + i];
            }
            var += double(amax) * amax / (127.0 * 127.0 * 12.0) * w2;
          }
          const double tol = 2e-5 * abs_sum + 1e-6 + 6.0 * std::sqrt(var);
          ASSERT_TRUE(close(y[tok * rows + r], y_ref[tok * rows + r], tol))
              << "t " << tok << " r " << r;
        }
      if (cuda::matvec_q8_supports(t) || t == DType::F16 || t == DType::BF16) {
        EXPECT_EQ(std::memcmp(y1.data(), y.data() + 5 * rows, size_t(rows) * sizeof(float)), 0);
      }
    }
  }
}

// matmul_batch on resident memory (the forward pass's Q/K/V and gate/up): one quantization of
// the shared input serves every weight, and each y has exactly the bits of matmul() of that
// task alone; on V3 (up to 64 int8 tokens) and on the Auto default (int8 up to 16 tokens,
// cuBLAS above: there the batch is one matmul() per task, so the same bits by construction).
// Task lists: mixed types (one launch each), runs of one type (grouped launches, 3 and 2),
// float weights (the grouped float path up to 8 tokens, matmul() per task above: F16/BF16's
// tensor-core kernel, F32's V3 float kernel, and F16 beside F32, which no grouped launch takes).
TEST(CudaMatvecQ8, ResidentMatmulBatchEqualsOneMatmulPerTask) {
  REQUIRE_GPU();
  const std::vector<std::vector<DType>> lists = {{DType::Q4_K, DType::Q6_K, DType::Q8_0},
                                                 {DType::Q4_K, DType::Q4_K, DType::Q4_K},
                                                 {DType::Q4_K, DType::Q4_K, DType::Q6_K},
                                                 {DType::F16, DType::F16, DType::F16},
                                                 {DType::BF16, DType::BF16},
                                                 {DType::F32, DType::F32},
                                                 {DType::F16, DType::F32}};
  for (const std::vector<DType>& types : lists)
    for (const CudaMatmul kernels : {CudaMatmul::V3, CudaMatmul::Auto}) {
      CudaOptions o;
      o.matmul = kernels;
      o.verify_weight_cache = true;
      auto be = make_cuda_backend(o);
      ASSERT_TRUE(be) << be.error();
      Backend& b = **be;
      for (const int64_t k : {int64_t(1024), int64_t(2816)}) {  // Q4_K: 16 and 44 pairs a row
        std::mt19937_64 rng(ops_seed());
        const int nw = int(types.size());
        const int64_t rows[3] = {96, 33, 160};
        std::vector<std::vector<std::byte>> bytes(3);
        std::vector<WeightMatrix> ws;
        for (int i = 0; i < nw; ++i) {
          const size_t rb = *row_bytes(types[i], k);
          bytes[i].resize(rb * size_t(rows[i]));
          for (int64_t r = 0; r < rows[i]; ++r)
            quant::quantize_row(types[i], random_vec(rng, k, 0.05f),
                                std::span<std::byte>(bytes[i]).subspan(size_t(r) * rb, rb));
          ws.push_back(WeightMatrix{.dtype = types[i],
                                    .n_cols = k,
                                    .n_rows = rows[i],
                                    .row_bytes = rb,
                                    .bytes = bytes[i]});
        }
        for (int64_t n_tok : {1, 3, 8, 16, 17, 40}) {
          SCOPED_TRACE(::testing::Message() << "k " << k << " n_tok " << n_tok << " auto "
                                            << (kernels == CudaMatmul::Auto) << " first "
                                            << dtype_name(types[0]) << " x" << nw);
          const std::vector<float> x = random_vec(rng, size_t(n_tok * k));
          BackendBuffer<float> dx = b.alloc<float>(x.size());
          b.upload<float>(x, dx.span());
          std::vector<BackendBuffer<float>> batch_y, solo_y;
          std::vector<Backend::MatmulTask> tasks;
          for (int i = 0; i < nw; ++i) {
            batch_y.push_back(b.alloc<float>(size_t(n_tok * rows[i])));
            solo_y.push_back(b.alloc<float>(size_t(n_tok * rows[i])));
            tasks.push_back({&ws[i], dx.span(), batch_y.back().span()});
          }
          b.matmul_batch(tasks, n_tok);
          for (int i = 0; i < nw; ++i) b.matmul(ws[i], dx.span(), n_tok, solo_y[i].span());
          for (int i = 0; i < nw; ++i) {
            std::vector<float> hb(size_t(n_tok * rows[i]), NAN), hs(hb.size(), 0.0f);
            b.download<float>(batch_y[i].span(), hb);
            b.download<float>(solo_y[i].span(), hs);
            EXPECT_EQ(std::memcmp(hb.data(), hs.data(), hb.size() * sizeof(float)), 0)
                << dtype_name(types[i]);
            for (float v : hb) ASSERT_TRUE(std::isfinite(v));
          }
        }
      }
    }
}

TEST(CudaMatvecQ8, RejectsWhatItCannotRun) {
  REQUIRE_GPU();
  EXPECT_EQ(cuda::act_q8_bytes(100, 1), 0u);  // not a multiple of 32
  EXPECT_EQ(cuda::act_q8_bytes(256, kMaxTok + 1), 0u);
  EXPECT_GT(cuda::act_q8_bytes(256, kMaxTok), 0u);
  EXPECT_FALSE(cuda::matvec_q8_supports(DType::F16));
  EXPECT_FALSE(cuda::matvec_q8_supports(DType::Q2_K));
  cuda::DeviceBuffer buf;
  void* p = buf.ensure(1 << 16, "t");
  const cuda::DeviceWeight f16{DType::F16, 256, 4, 512, static_cast<const std::byte*>(p)};
  EXPECT_EQ(cuda::launch_matvec_q8(f16, p, 1, static_cast<float*>(p), nullptr),
            cudaErrorInvalidValue);
  const cuda::DeviceWeight q4k{DType::Q4_K, 256, 4, 144, static_cast<const std::byte*>(p)};
  EXPECT_EQ(cuda::launch_matvec_q8(q4k, p, kMaxTok + 1, static_cast<float*>(p), nullptr),
            cudaErrorInvalidValue);
  // Q4_K rows of a partial 256-element block (the pairs index whole blocks).
  const cuda::DeviceWeight q4k_part{DType::Q4_K, 288, 4, 144, static_cast<const std::byte*>(p)};
  EXPECT_EQ(cuda::launch_matvec_q8(q4k_part, p, 1, static_cast<float*>(p), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::launch_quantize_act_q8(static_cast<float*>(p), 100, 1, p, nullptr),
            cudaErrorInvalidValue);
  cudaGetLastError();
}

}  // namespace
}  // namespace kiln
