// backend/cuda/matvec_mma_float.cu: F16/BF16 weights against 1-8 tokens on the tensor cores
// (mma.sync m16n8k8 .tf32), the kernel launch_matmul_v3 takes for them wherever it fits (chosen
// by measurement: docs/BENCHMARKS.md, session 30). V3's float kernel (matvec_q8.cu), which
// stays for F32 weights and other widths, spends one f32 FMA and a share of an activation load
// from L1 per weight and token, so from two tokens on it reads the weights well below its
// one-token bandwidth; that sets the cost of a speculative verify step and of a DFlash draft
// pass. Here one instruction takes 16 rows x 8 tokens x 8 columns.
//
// The operands are exact where it matters: an f16 or bf16 weight converts to f32 exactly and
// its mantissa fits tf32's 10 bits, so the weight itself is the tensor core's operand. An
// activation x is split into hi = tf32(x) (round to nearest) and lo = tf32(x - hi) (x - hi is
// exact in f32); the two products w*hi + w*lo carry about 22 of x's 24 bits, and tf32 has f32's
// range, so no scaling.
//
// One order per output whatever the token count: token n of a call is column n of the mma's
// B operand, and an mma's output column depends only on that column of B and of C. Every
// output runs the same sequence of mma's (its warp's 64-column steps in increasing order; in
// a step the 8 column groups in order, hi then lo), and the block adds its warps' partial
// sums in warp order. How the columns are split over the warps depends on the matrix shape
// only. So a token's output has the same bits alone or among 8, at any column of the call
// (tests/cuda/cuda_matvec_q8_test.cpp, CudaMatvecMmaFloat.*).
//
// Column mapping (why no shuffles are needed): a k8 mma sums over 8 "virtual" columns; thread
// (g = lane / 4, t = lane % 4) holds A's virtual columns t and t + 4 of rows g and g + 8 and
// B's virtual columns t and t + 4 of token g. Thread t loads 8 consecutive real columns
// (16 bytes of weights per row, 32 of activations) and the step's mma j (0..3) maps virtual
// column t to real column 8t + 2j and t + 4 to 8t + 2j + 1, for A and B alike: the four mma's
// cover the 32 columns once, each product pairing a weight with its own activation.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kTile = 16;      // rows of one m16 tile
constexpr int kTokens = 8;     // one n8 tile
constexpr int kStepCols = 64;  // columns per warp step: one 128-byte line of an f16 row

thread_local FloatMmaShape t_shape{};  // set_float_mma_shape (cuda_matvec_bench's sweep)

__device__ __forceinline__ uint32_t to_tf32(float v) {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
#else
  __trap();  // sm_80+ only (the build targets sm_90)
#endif
  return r;
}

// c += A (16 x 8: a0 row g col t, a1 row g+8 col t, a2 row g col t+4, a3 row g+8 col t+4)
// x B (8 x 8: b0 row t col g, b1 row t+4 col g); c0/c1 row g cols 2t, 2t+1, c2/c3 row g+8.
__device__ __forceinline__ void mma_tf32(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// Element e (0 or 1) of a word of two 16-bit weights, as f32 bits (exact, low 13 bits zero).
template <DType T>
__device__ __forceinline__ uint32_t weight_bits(uint32_t word, int e) {
  const uint32_t h = (word >> (16 * e)) & 0xFFFFu;
  if constexpr (T == DType::BF16) {
    return h << 16;
  } else {
    return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
  }
}

// One warp step as loaded: per m-tile rows g and g + 8, both 32-column halves (8 weights
// each), and token g's 8 activations of each half (zeros for a token past the call's).
template <int MT>
struct Step {
  uint4 wg[MT][2], wh[MT][2];
  float4 x[2][2];
};

// The 32 columns of half h for every m-tile: four column groups, each hi then lo; the split
// of x is shared by the m-tiles.
template <DType T, int MT>
__device__ __forceinline__ void step_half(float (&c)[MT][4], const Step<MT>& st, int h) {
  const float xs[8] = {st.x[h][0].x, st.x[h][0].y, st.x[h][0].z, st.x[h][0].w,
                       st.x[h][1].x, st.x[h][1].y, st.x[h][1].z, st.x[h][1].w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float x0 = xs[2 * j], x1 = xs[2 * j + 1];
    const uint32_t hi0 = to_tf32(x0), hi1 = to_tf32(x1);
    const uint32_t lo0 = to_tf32(__fsub_rn(x0, __uint_as_float(hi0)));
    const uint32_t lo1 = to_tf32(__fsub_rn(x1, __uint_as_float(hi1)));
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const uint32_t gw[4] = {st.wg[m][h].x, st.wg[m][h].y, st.wg[m][h].z, st.wg[m][h].w};
      const uint32_t hw[4] = {st.wh[m][h].x, st.wh[m][h].y, st.wh[m][h].z, st.wh[m][h].w};
      const uint32_t a0 = weight_bits<T>(gw[j], 0), a2 = weight_bits<T>(gw[j], 1);
      const uint32_t a1 = weight_bits<T>(hw[j], 0), a3 = weight_bits<T>(hw[j], 1);
      mma_tf32(c[m], a0, a1, a2, a3, hi0, hi1);
      mma_tf32(c[m], a0, a1, a2, a3, lo0, lo1);
    }
  }
}

// Up to kMatvecGroupMax weights of one type and width against one input in one grid: task i
// owns blocks [end[i-1], end[i]) (kernels.h launch_matvec_float_mma_group).
struct MmaGroup {
  const uint8_t* w[kMatvecGroupMax];
  float* y[kMatvecGroupMax];
  size_t row_bytes[kMatvecGroupMax];
  int64_t n_rows[kMatvecGroupMax];
  int64_t end[kMatvecGroupMax];
  int n;
};

// grid: the group's row blocks (16 MT rows each), W warps per block; warp w of a block takes
// the block's steps w, w + W, w + 2W, ... (a step: 64 columns), U of them loaded together.
// Rows 16-byte aligned, n_cols % 64 == 0, x 16-byte aligned, 1 <= n_tok <= 8.
template <DType T, int W, int U, int MT>
__global__ void __launch_bounds__(W* kWarp)
    matvec_mma_float_kernel(MmaGroup grp, int64_t n_cols, const float* __restrict__ x, int n_tok) {
  constexpr int kRows = kTile * MT;
  __shared__ float red[W][kRows][kTokens];
  int64_t b = blockIdx.x;
  int task = 0;
#pragma unroll  // constant indices: the arguments stay in the parameter bank
  for (int i = 1; i < kMatvecGroupMax; ++i)
    if (i < grp.n && b >= grp.end[i - 1]) task = i;
  const uint8_t* w = grp.w[0];
  float* y = grp.y[0];
  size_t row_bytes = grp.row_bytes[0];
  int64_t n_rows = grp.n_rows[0];
#pragma unroll
  for (int i = 1; i < kMatvecGroupMax; ++i)
    if (task == i) {
      w = grp.w[i], y = grp.y[i], row_bytes = grp.row_bytes[i], n_rows = grp.n_rows[i];
      b -= grp.end[i - 1];
    }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int g = lane / 4, t = lane % 4;
  const int64_t r0 = b * kRows;
  // Rows past the matrix read its last row; their sums are not stored.
  const uint8_t* row_g[MT];
  const uint8_t* row_h[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int64_t rg = r0 + kTile * m + g, rh = rg + 8;
    row_g[m] = w + (rg < n_rows ? rg : n_rows - 1) * row_bytes;
    row_h[m] = w + (rh < n_rows ? rh : n_rows - 1) * row_bytes;
  }
  const int64_t n_steps = n_cols / kStepCols;
  const bool has_token = g < n_tok;
  const float* xt = x + (has_token ? g : 0) * n_cols;

  Step<MT> st[U];
  // Weights only (no kernel writes them), so the first steps' loads may precede pdl_enter().
  auto load_weights = [&](int64_t s0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t s = s0 + int64_t(u) * W;
      if (s >= n_steps) break;
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t col = s * kStepCols + h * 32 + 8 * t;  // 8 weights = 16 bytes
          st[u].wg[m][h] = __ldg(reinterpret_cast<const uint4*>(row_g[m] + col * 2));
          st[u].wh[m][h] = __ldg(reinterpret_cast<const uint4*>(row_h[m] + col * 2));
        }
    }
  };
  auto load_acts = [&](int64_t s0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t s = s0 + int64_t(u) * W;
      if (s >= n_steps) break;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t col = s * kStepCols + h * 32 + 8 * t;
        const float4* p = reinterpret_cast<const float4*>(xt + col);
        st[u].x[h][0] = has_token ? __ldg(p) : make_float4(0, 0, 0, 0);
        st[u].x[h][1] = has_token ? __ldg(p + 1) : make_float4(0, 0, 0, 0);
      }
    }
  };

  float c[MT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0.0f;
  int64_t s0 = warp;
  load_weights(s0);
  pdl_enter();
  for (; s0 < n_steps; s0 += int64_t(W) * U) {
    if (s0 != warp) load_weights(s0);
    load_acts(s0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + int64_t(u) * W >= n_steps) break;  // warp-uniform: every lane takes the mma's
      step_half<T, MT>(c, st[u], 0);
      step_half<T, MT>(c, st[u], 1);
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    red[warp][kTile * m + g][2 * t] = c[m][0];
    red[warp][kTile * m + g][2 * t + 1] = c[m][1];
    red[warp][kTile * m + g + 8][2 * t] = c[m][2];
    red[warp][kTile * m + g + 8][2 * t + 1] = c[m][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * kTokens; i += W * kWarp) {
    const int row = i / kTokens, tok = i % kTokens;
    if (tok < n_tok && r0 + row < n_rows) {
      float sum = red[0][row][tok];
#pragma unroll
      for (int k = 1; k < W; ++k) sum = __fadd_rn(sum, red[k][row][tok]);
      y[int64_t(tok) * n_rows + r0 + row] = sum;
    }
  }
}

template <DType T, int W, int U, int MT>
cudaError_t launch_shape(const MmaGroup& g, int64_t n_cols, const float* x, int64_t n_tok,
                         cudaStream_t s) {
  return launch(matvec_mma_float_kernel<T, W, U, MT>, dim3(unsigned(g.end[g.n - 1])), W * kWarp, 0,
                s, g, n_cols, x, int(n_tok));
}

// The (U, MT) pairs a launch may take: (2, 1), (4, 1), (1, 2), (2, 2).
template <DType T, int W>
cudaError_t launch_by_unroll(const MmaGroup& g, int64_t n_cols, const float* x, int64_t n_tok,
                             const FloatMmaShape& sh, cudaStream_t s) {
  if (sh.mtiles == 2)
    return sh.unroll == 1 ? launch_shape<T, W, 1, 2>(g, n_cols, x, n_tok, s)
                          : launch_shape<T, W, 2, 2>(g, n_cols, x, n_tok, s);
  return sh.unroll == 4 ? launch_shape<T, W, 4, 1>(g, n_cols, x, n_tok, s)
                        : launch_shape<T, W, 2, 1>(g, n_cols, x, n_tok, s);
}

template <DType T>
cudaError_t launch_typed(const MmaGroup& g, int64_t n_cols, const float* x, int64_t n_tok,
                         const FloatMmaShape& sh, cudaStream_t s) {
  if (sh.warps == 4) return launch_by_unroll<T, 4>(g, n_cols, x, n_tok, sh, s);
  if (sh.warps == 8) return launch_by_unroll<T, 8>(g, n_cols, x, n_tok, sh, s);
  return launch_by_unroll<T, 16>(g, n_cols, x, n_tok, sh, s);
}

bool valid_shape(const FloatMmaShape& sh) {
  const bool pair = (sh.mtiles == 1 && (sh.unroll == 2 || sh.unroll == 4)) ||
                    (sh.mtiles == 2 && (sh.unroll == 1 || sh.unroll == 2));
  return (sh.warps == 4 || sh.warps == 8 || sh.warps == 16) && pair;
}

// The shape a launch takes: the policy's, or set_float_mma_shape's where set.
FloatMmaShape shape_for(int64_t n_rows, int64_t n_cols) {
  if (t_shape.warps != 0) return t_shape;
  FloatMmaShape sh = float_mma_shape(n_rows, n_cols);
  return sh;
}

// The group's table, or false when it does not fit one grid.
bool make_mma_group(std::span<const DeviceWeight> ws, std::span<float* const> ys, int rows,
                    MmaGroup* g) {
  if (ws.empty() || ws.size() != ys.size() || ws.size() > size_t(kMatvecGroupMax)) return false;
  *g = MmaGroup{};
  g->n = int(ws.size());
  int64_t end = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    g->w[i] = reinterpret_cast<const uint8_t*>(ws[i].data);
    g->y[i] = ys[i];
    g->row_bytes[i] = ws[i].row_bytes;
    g->n_rows[i] = ws[i].n_rows;
    end += (ws[i].n_rows + rows - 1) / rows;
    g->end[i] = end;
  }
  return end > 0 && end <= int64_t(0x7FFFFFFF);
}

cudaError_t launch_group(std::span<const DeviceWeight> ws, std::span<float* const> ys,
                         const float* x, int64_t n_tok, cudaStream_t s) {
  const FloatMmaShape sh = shape_for(ws[0].n_rows, ws[0].n_cols);
  if (!valid_shape(sh)) return cudaErrorInvalidValue;
  MmaGroup g;
  if (!make_mma_group(ws, ys, kTile * sh.mtiles, &g)) return cudaErrorNotSupported;
  if (ws[0].dtype == DType::BF16)
    return launch_typed<DType::BF16>(g, ws[0].n_cols, x, n_tok, sh, s);
  return launch_typed<DType::F16>(g, ws[0].n_cols, x, n_tok, sh, s);
}

}  // namespace

bool float_mma_fits(const DeviceWeight& w, const float* x, int64_t n_tok) {
  return (w.dtype == DType::F16 || w.dtype == DType::BF16) && n_tok >= 1 && n_tok <= kTokens &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && w.row_bytes % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0 && w.n_cols % kStepCols == 0 && w.n_cols > 0 &&
         w.n_rows > 0 && (w.n_rows + kTile - 1) / kTile <= int64_t(0x7FFFFFFF);
}

// Enough warps in flight for the read bandwidth: a matrix of few rows has few blocks, so each
// takes more warps (and each warp fewer steps); a matrix of many rows takes two tiles per
// block (fewer, longer blocks: a shorter partial last wave). From cuda_matvec_bench
// --float-mma-sweep (docs/BENCHMARKS.md, session 29). From the shape only (the bits depend on
// the warps; unroll and m-tiles change no bit).
FloatMmaShape float_mma_shape(int64_t n_rows, int64_t n_cols) {
  const int64_t tiles = (n_rows + kTile - 1) / kTile, steps = n_cols / kStepCols;
  FloatMmaShape sh;
  sh.warps = tiles >= 256 ? 8 : 16;
  while (sh.warps > 4 && steps < sh.warps) sh.warps /= 2;
  sh.unroll = 2;
  sh.mtiles = tiles >= 512 ? 2 : 1;
  return sh;
}

void set_float_mma_shape(FloatMmaShape shape) { t_shape = shape; }

cudaError_t launch_matvec_float_mma(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                                    cudaStream_t s) {
  if (!float_mma_fits(w, x, n_tok)) return cudaErrorInvalidValue;
  float* ys[1] = {y};
  return launch_group(std::span<const DeviceWeight>(&w, 1), ys, x, n_tok, s);
}

cudaError_t launch_matvec_float_mma_group(std::span<const DeviceWeight> ws,
                                          std::span<float* const> ys, const float* x, int64_t n_tok,
                                          cudaStream_t s) {
  if (ws.empty() || ws.size() != ys.size() || ws.size() > size_t(kMatvecGroupMax))
    return cudaErrorNotSupported;
  const FloatMmaShape sh = shape_for(ws[0].n_rows, ws[0].n_cols);
  for (const DeviceWeight& w : ws) {
    if (!float_mma_fits(w, x, n_tok)) return cudaErrorInvalidValue;
    const FloatMmaShape own = shape_for(w.n_rows, w.n_cols);
    // One kernel for all: the same type, width and warps per block (the bits), else none.
    if (w.dtype != ws[0].dtype || w.n_cols != ws[0].n_cols || own.warps != sh.warps ||
        own.unroll != sh.unroll || own.mtiles != sh.mtiles)
      return cudaErrorNotSupported;
  }
  return launch_group(ws, ys, x, n_tok, s);
}

}  // namespace kiln::cuda
