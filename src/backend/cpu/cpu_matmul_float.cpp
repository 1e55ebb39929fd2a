// backend/cpu/cpu_matmul_float.cpp: the register-tiled F32/F16/BF16 matmul for calls of 2+
// tokens (prefill). cpu_matmul.cpp's DotTile reads one weight row against up to 4 tokens: 2
// weight and 8 activation loads per 8 FMAs, so it is load-bound, and a 64-token tile's
// activations do not stay in L1. Here a tile of R rows x T tokens keeps both accumulators of
// every output in registers: each weight chunk is converted once for T tokens and each
// activation chunk loaded once for R rows, while a row block stays in L2 for every token tile.
// Every output still runs DotTile's float ops in DotTile's order (float_dot-inl.h: the same
// chunk split, tail and reduction), so the result is the old kernel's bits for any tile, call
// size or thread split (tests/ops MatmulFloatTile). BF16 on AVX512_BF16 machines takes the same
// tiles with bf16 pairs instead (bf16_pairs.h: MatmulBF16PairsTiled).
#define HWY_WANT_AVX3_DL 1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_matmul_float.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <type_traits>

#include "core/check.h"
#include "core/dtype.h"
#include "float_dot-inl.h"  // per-target guard: expanded once per Highway target, like this file
#include "kernels.h"

#ifndef KILN_CPU_MATMUL_FLOAT_ONCE
#define KILN_CPU_MATMUL_FLOAT_ONCE
namespace kiln::cpu {
// Weight bytes per row block: the rows every token tile sweeps stay in L2 (1 MiB per core on
// the dev box), next to the activations streaming through it. Measured on 512 x 2048 x 2048
// F16, 1 thread (BM_FloatTileOnOff): 128 KiB 127, 256 KiB 166, 512 KiB 171, 768 KiB 176,
// 1 MiB 119 GFLOP/s.
constexpr int64_t kFloatRowBlockBytes = 768 << 10;
}  // namespace kiln::cpu
#endif

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {

// The register tile: R rows x T tokens x 2 accumulators, plus R weight vectors and one
// activation vector live at a time (AVX-512: 24 + 4 + 1 of 32 registers; AVX2: 12 + 2 + 1 of
// 16; other targets a small safe tile). AVX-512, F16, 1 thread (BM_FloatTileOnOff, 512 tokens,
// 2048 x 2048 | 2048 x 8192 GFLOP/s): 4x3 154-173 | 106-131, 3x4 107-133 | 73-83, 2x6 102 | 81,
// 6x2 133 | 109. Column blocks that keep a tile's activations in L1 on the 8192-wide rows (the
// accumulators parked between blocks) measured no faster (1024: 117, 2048: 118-138 against
// 129-134 unblocked), so rows are not cut.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kTileRows = 4, kTileTok = 3;
#elif HWY_TARGET == HWY_AVX2
constexpr int kTileRows = 2, kTileTok = 3;
#else
constexpr int kTileRows = 2, kTileTok = 2;
#endif

// out[r * T + t] = dot(row r, token t) for R rows x T tokens: DotTile's ops for each output.
// Noinline: inlined into the row/token loops, GCC keeps the 2 * R * T accumulators in memory
// (stored on every iteration) instead of registers.
template <int R, int T, class L>
HWY_NOINLINE void DotBlock(const L* w, const float* const* xs, int64_t n, float* out) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<DF> acc0[R][T], acc1[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc0[r][t] = acc1[r][t] = hn::Zero(d);
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    hn::Vec<DF> wv[R];
    for (int r = 0; r < R; ++r) wv[r] = w[r](d, i);
    for (int t = 0; t < T; ++t) {
      const auto x = hn::LoadU(d, xs[t] + i);
      for (int r = 0; r < R; ++r) acc0[r][t] = hn::MulAdd(wv[r], x, acc0[r][t]);
    }
    for (int r = 0; r < R; ++r) wv[r] = w[r](d, i + N);
    for (int t = 0; t < T; ++t) {
      const auto x = hn::LoadU(d, xs[t] + i + N);
      for (int r = 0; r < R; ++r) acc1[r][t] = hn::MulAdd(wv[r], x, acc1[r][t]);
    }
  }
  if (i + N <= n) {
    for (int r = 0; r < R; ++r) {
      const auto w0 = w[r](d, i);
      for (int t = 0; t < T; ++t) acc0[r][t] = hn::MulAdd(w0, hn::LoadU(d, xs[t] + i), acc0[r][t]);
    }
    i += N;
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      out[r * T + t] = DotFinish(d, acc0[r][t], acc1[r][t], w[r], xs[t], i, n);
}

// DotBlock for a tile of m <= T tokens.
template <int R, int T, class L>
HWY_INLINE void DotBlockTok(int m, const L* w, const float* const* xs, int64_t n, float* out) {
  if constexpr (T > 1)
    if (m < T) return DotBlockTok<R, T - 1>(m, w, xs, n, out);
  DotBlock<R, T>(w, xs, n, out);
}

// Row blocks (weights in L2) x token tiles x row tiles: row(r) gives row r as the tile takes it,
// tok(t) token t's activations, and tile(R, m, rows, xs, out) fills out[q * m + t] for R rows
// (std::integral_constant: kTileRows, then 1 for the rows left) x m <= kTileTok tokens.
template <class Row, class Tok, class Tile>
void ForEachTile(const MatmulJob& job, int64_t r0, int64_t r1, Row row, Tok tok, Tile tile) {
  const WeightMatrix& w = *job.w;
  const int64_t ldy = w.n_rows;
  const int64_t rb = std::max<int64_t>(
      kTileRows, kFloatRowBlockBytes / std::max<int64_t>(1, static_cast<int64_t>(w.row_bytes)));
  using W = decltype(row(0));
  decltype(tok(0)) xs[kTileTok];
  float out[kTileRows * kTileTok];
  for (int64_t b0 = r0; b0 < r1; b0 += rb) {
    const int64_t b1 = std::min(r1, b0 + rb);
    for (int64_t t0 = 0; t0 < job.n_tok; t0 += kTileTok) {
      const int m = static_cast<int>(std::min<int64_t>(kTileTok, job.n_tok - t0));
      for (int k = 0; k < m; ++k) xs[k] = tok(t0 + k);
      int64_t r = b0;
      for (; r + kTileRows <= b1; r += kTileRows) {
        W ws[kTileRows];
        for (int q = 0; q < kTileRows; ++q) ws[q] = row(r + q);
        tile(std::integral_constant<int, kTileRows>{}, m, ws, xs, out);
        for (int q = 0; q < kTileRows; ++q)
          for (int t = 0; t < m; ++t) job.y[(t0 + t) * ldy + r + q] = out[q * m + t];
      }
      for (; r < b1; ++r) {
        const W w1[1] = {row(r)};
        tile(std::integral_constant<int, 1>{}, m, w1, xs, out);
        for (int t = 0; t < m; ++t) job.y[(t0 + t) * ldy + r] = out[t];
      }
    }
  }
}

template <class Elem, class L>
void MatmulFloatTiledT(const MatmulJob& job, int64_t r0, int64_t r1) {
  const WeightMatrix& w = *job.w;
  const int64_t n = w.n_cols;
  ForEachTile(
      job, r0, r1, [&](int64_t r) { return L{reinterpret_cast<const Elem*>(w.row(r).data())}; },
      [&](int64_t t) { return job.x + t * n; },
      [&](auto R, int m, const L* ws, const float* const* xs, float* out) {
        DotBlockTok<decltype(R)::value, kTileTok>(m, ws, xs, n, out);
      });
}

#if KILN_BF16_PAIRS
// DotPairsBlock for a tile of m <= T tokens.
template <int R, int T>
KILN_BF16_PAIRS_NOINLINE void DotPairsTile(int m, const bf16* const* w, const bf16* const* xs,
                                           int64_t n, float* out) {
  if constexpr (T > 1)
    if (m < T) return DotPairsTile<R, T - 1>(m, w, xs, n, out);
  DotPairsBlock<R, T>(w, xs, n, out);
}

// BF16 weights by the pair arithmetic (bf16_pairs.h) in ForEachTile's loops, against the tokens'
// bf16 rows (ActKind::BF16, encoded once per call). Two products per lane per instruction take
// the register tile's 24 accumulators as f32 FMAs take them.
void MatmulBF16PairsTiled(const MatmulJob& job, int64_t r0, int64_t r1) {
  KILN_CHECK(job.xq != nullptr, "BF16 pair kernels: the activations are not encoded as bf16");
  const WeightMatrix& w = *job.w;
  const int64_t n = w.n_cols;
  ForEachTile(
      job, r0, r1, [&](int64_t r) { return reinterpret_cast<const bf16*>(w.row(r).data()); },
      [&](int64_t t) { return PairsToken(job, t); },
      [&](auto R, int m, const bf16* const* ws, const bf16* const* xs, float* out) {
        DotPairsTile<decltype(R)::value, kTileTok>(m, ws, xs, n, out);
      });
}
#endif

void MatmulFloatTiledK(const MatmulJob& job, int64_t r0, int64_t r1) {
  switch (job.w->dtype) {
    case DType::F32:
      return MatmulFloatTiledT<float, LoadF32>(job, r0, r1);
    case DType::F16:
      return MatmulFloatTiledT<f16, LoadF16>(job, r0, r1);
    case DType::BF16:
#if KILN_BF16_PAIRS
      if (HasAvx512Bf16()) return MatmulBF16PairsTiled(job, r0, r1);
#endif
      return MatmulFloatTiledT<bf16, LoadBF16>(job, r0, r1);
    default:
      KILN_CHECK(false, "matmul_float_tiled: {} is not an f32-family weight type",
                 dtype_name(job.w->dtype));
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kiln::cpu {
HWY_EXPORT(MatmulFloatTiledK);

void matmul_float_tiled(const MatmulJob& job, int64_t r0, int64_t r1) {
  HWY_DYNAMIC_DISPATCH(MatmulFloatTiledK)(job, r0, r1);
}
}  // namespace kiln::cpu
#endif
