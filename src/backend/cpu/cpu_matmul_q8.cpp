// backend/cpu/cpu_matmul_q8.cpp: Q8_0 / Q4_0 / Q5_0 matmuls of several tokens (prefill) on
// AVX-512 VNNI, giving each token the plain kernel's (cpu_matmul.cpp DotQ8Family) bits.
//
// The plain kernel spends, per row, token and 32-weight block, two psignb (AVX-512 has no
// 512-bit psignb), a 256-bit vpdpbusd, a scalar multiply for the scale and a 256-bit
// cvt + fma. Here the weights are biased to unsigned once per row block (w + 128, packed with
// every dword twice) and the activations are interleaved in token pairs once per token group
// (dword 2L: token 2p's quants 4L..4L+3, dword 2L+1: token 2p+1's), so one 512-bit vpdpbusd
// gives two tokens' 8 lane sums. The bias adds 128 * (sum of the lane's 4 activations), which
// the accumulator starts at minus (stored with the activations): every int32 lane is then
// exactly the plain kernel's sum of w * y (|lane| < 2^18, no overflow). The lanes are then
// reduced to each (row, token)'s block total, 16 at a time (DotQ8Vnni below), and the float
// steps are the plain kernel's: fma(dw * yd, float(total), acc) block by block. So each
// token's output is the plain kernel's bits whatever the tiling. The scales of a tile's lanes
// are multiplied a chunk of blocks ahead and read back as one load per 16 outputs.
#define HWY_WANT_AVX3_DL 1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_matmul_q8.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>

#if defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "amx_tiles.h"
#include "cpu_matmul_q8.h"
#include "quant/blocks.h"

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX3_DL

// One row's weights as signed quants (32 per block) and f32 block scales, as the plain
// kernel's Unpack gives them (cpu_matmul.cpp UnpackRowQ8).
using Q8UnpackRow = void (*)(const std::byte* row, int64_t nb, int8_t* q, float* d);

// Highway's AVX3_DL target string names AVX-VNNI but not AVX512-VNNI, which the 512-bit forms
// need (as in cpu_matmul.cpp); no lambdas in these functions: clang would compile them
// without the target.
#define KILN_Q8_VNNI __attribute__((target(HWY_TARGET_STR ",avx512vnni"), noinline))

namespace {

// Token tile (8 tokens): block i, pair p at q + (i * 4 + p) * kQ8ActPairBytes (64 bytes of
// interleaved signed quants, then 16 int32 corrections); token t's scale at yd[i * 8 + t].
struct Q8Tile {
  const int8_t* q;
  const float* yd;
};

// Rows b0..b1 into the packed form: quants (w + 128 as u8, dword L at dwords 2L and 2L+1) at
// pq[(r - b0) * nb + i], scales at pd[(r - b0) * nb + i].
KILN_Q8_VNNI void PackQ8Rows(const WeightMatrix& w, int64_t b0, int64_t b1, Q8UnpackRow unpack,
                             int8_t* row_q, __m512i* pq, float* pd) {
  const int64_t nb = w.n_cols / 32;
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t r = b0; r < b1; ++r) {
    __m512i* dst = pq + (r - b0) * nb;
    float* d = pd + (r - b0) * nb;
    const int8_t* src = row_q;
    int64_t stride = 32;
    if (w.dtype == DType::Q8_0) {
      // The quants as they lie in the blocks, the f16 scales 16 at a time by vcvtph2ps (exact,
      // as the plain kernel's scalar f16_to_f32 per block, which cost ~4 % of a Q8_0 prefill).
      const auto* blk = reinterpret_cast<const quant::block_q8_0*>(w.row(r).data());
      alignas(32) uint16_t h[16];
      int64_t i = 0;
      for (; i + 16 <= nb; i += 16) {
        for (int k = 0; k < 16; ++k) h[k] = blk[i + k].d.bits;
        _mm512_storeu_ps(d + i,
                         _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h))));
      }
      for (; i < nb; ++i) d[i] = f16_to_f32(blk[i].d);
      src = blk[0].qs;
      stride = sizeof(quant::block_q8_0);
    } else {
      unpack(w.row(r).data(), nb, row_q, d);
    }
    for (int64_t i = 0; i < nb; ++i) {
      const __m512i q = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + stride * i)));
      _mm512_store_si512(dst + i, _mm512_xor_si512(_mm512_permutexvar_epi32(dup, q), bias));
    }
  }
}

// Tokens ys[0..m) into the tile; a last odd token's partner is all zero (its outputs are not
// read).
KILN_Q8_VNNI void FillQ8Tile(const ActQ8_0* const* ys, int m, int64_t nb, int8_t* q, float* yd) {
  const __m512i inter = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const int pairs = (m + 1) / 2;
  for (int64_t i = 0; i < nb; ++i) {
    for (int p = 0; p < pairs; ++p) {
      const auto* qa = reinterpret_cast<const __m256i*>(ys[2 * p][i].qs);
      const __m256i ya = _mm256_loadu_si256(qa);
      const __m256i yb =
          2 * p + 1 < m ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ys[2 * p + 1][i].qs))
                        : _mm256_setzero_si256();
      const __m512i y =
          _mm512_permutexvar_epi32(inter, _mm512_inserti64x4(_mm512_castsi256_si512(ya), yb, 1));
      // -128 * (sum of the lane's 4 quants): what the weights' +128 bias adds.
      const __m512i corr = _mm512_sub_epi32(_mm512_setzero_si512(),
                                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, y));
      int8_t* dst = q + (i * 4 + p) * static_cast<int64_t>(kQ8ActPairBytes);
      _mm512_store_si512(dst, y);
      _mm512_store_si512(dst + 64, corr);
    }
    for (int t = 0; t < kQ8VnniTok; ++t) yd[i * kQ8VnniTok + t] = t < m ? ys[t][i].d : 0.0f;
  }
}

// Register tiles of R rows x P token pairs: per block, one vpdpbusd per (row, pair) gives a
// register of two tokens' 8 lane sums (token 2p in the even dwords, 2p+1 in the odd ones). The
// plain kernel's arithmetic needs each (row, token)'s block total: groups of 8 such registers
// are reduced to one register of 16 totals (ReduceQ8Lanes8, integer adds: exact), and one
// 16-wide fma(dw * yd, float(total), acc) per group and block, in block order, gives the 16
// outputs their plain-kernel bits. Register n = r * P + p of a tile is register n % 8 of group
// n / 8 (registers past R * P are zero).
//
// Lane L of a reduced group holds register j = (L / 4 % 2) * 4 + L % 4's total, its even
// token for L < 8 and its odd token for L >= 8: unpack-and-add of register pairs keeps the
// parities apart (level 1), 64-bit unpacks put four registers' partials side by side in each
// 128-bit unit (level 2, no add), and two 128-bit shuffle-and-add levels sum the four units.
HWY_INLINE __m512i AddLo32Hi32(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
HWY_INLINE __m512i AddUnitPairs(__m512i a, __m512i b) {
  return _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x88), _mm512_shuffle_i32x4(a, b, 0xDD));
}
HWY_INLINE __m512i ReduceQ8Lanes8(const __m512i* v) {
  const __m512i s01 = AddLo32Hi32(v[0], v[1]), s23 = AddLo32Hi32(v[2], v[3]);
  const __m512i s45 = AddLo32Hi32(v[4], v[5]), s67 = AddLo32Hi32(v[6], v[7]);
  const __m512i even =
      AddUnitPairs(_mm512_unpacklo_epi64(s01, s23), _mm512_unpacklo_epi64(s45, s67));
  const __m512i odd =
      AddUnitPairs(_mm512_unpackhi_epi64(s01, s23), _mm512_unpackhi_epi64(s45, s67));
  return AddUnitPairs(even, odd);
}

// Where each lane of a tile's reduced groups comes from: r * 8 + t, the index of its output in
// out[] and of its scale dw[r] * yd[t] in [row 0 | row 1 | row 2 | row 3] x 8 tokens; -1 (out)
// and 0 (scale) for lanes past the tile's registers.
template <int R, int P>
struct Q8LaneMap {
  static constexpr int kGroups = (R * P + 7) / 8;
  int32_t scale[kGroups][16] = {};
  int8_t out[kGroups][16] = {};
  constexpr Q8LaneMap() {
    for (int g = 0; g < kGroups; ++g)
      for (int lane = 0; lane < 16; ++lane) {
        const int n = 8 * g + (lane / 4 % 2) * 4 + lane % 4;
        const int r = n / P, t = 2 * (n % P) + (lane >= 8 ? 1 : 0);
        scale[g][lane] = n < R * P ? r * 8 + t : 0;
        out[g][lane] = static_cast<int8_t>(n < R * P ? r * 8 + t : -1);
      }
  }
};

// The scales of blocks i0..i0+n in the lane order of each group, s[(i - i0) * G + g][lane],
// written a chunk ahead of their use (a load of a just-stored vector's part waits for the
// store). Each is the plain kernel's product dw * yd.
template <int R, int G>
HWY_INLINE void Q8Scales(const float* wd, int64_t nb, const float* tyd, int64_t i0, int64_t n,
                         const __m512i* lane_scale, float (*s)[16]) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t i = i0 + j;
    const __m256 yd8 = _mm256_load_ps(tyd + i * kQ8VnniTok);
    const __m512 yd = _mm512_insertf32x8(_mm512_castps256_ps512(yd8), yd8, 1);
    const float d0 = wd[i], d1 = R > 1 ? wd[nb + i] : 0.0f;
    const float d2 = R > 2 ? wd[2 * nb + i] : 0.0f, d3 = R > 3 ? wd[3 * nb + i] : 0.0f;
    const __m512 p01 =
        _mm512_mul_ps(_mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1), yd);
    const __m512 p23 =
        _mm512_mul_ps(_mm512_insertf32x8(_mm512_set1_ps(d2), _mm256_set1_ps(d3), 1), yd);
    for (int g = 0; g < G; ++g)
      _mm512_store_ps(s[j * G + g], _mm512_permutex2var_ps(p01, lane_scale[g], p23));
  }
}

// Blocks per scale chunk.
constexpr int64_t kQ8ScaleChunk = 16;

// Rows 0..R-1 of the packed block (quants wq + r * nb, scales wd + r * nb) x the tile's
// pairs 0..P-1; out[r * 8 + t].
template <int R, int P>
KILN_Q8_VNNI void DotQ8Vnni(const __m512i* wq, const float* wd, int64_t nb, Q8Tile tile,
                            float* out) {
  static constexpr Q8LaneMap<R, P> kMap{};
  constexpr int G = Q8LaneMap<R, P>::kGroups;
  __m512i lane_scale[G];
  __m512 acc[G];
  for (int g = 0; g < G; ++g) {
    lane_scale[g] = _mm512_loadu_si512(kMap.scale[g]);
    acc[g] = _mm512_setzero_ps();
  }
  alignas(64) float s[2][kQ8ScaleChunk * G][16];
  Q8Scales<R, G>(wd, nb, tile.yd, 0, std::min(nb, kQ8ScaleChunk), lane_scale, s[0]);
  for (int64_t c0 = 0; c0 < nb; c0 += kQ8ScaleChunk) {
    const int64_t c1 = std::min(nb, c0 + kQ8ScaleChunk);
    float(*sc)[16] = s[(c0 / kQ8ScaleChunk) & 1];
    if (c1 < nb)
      Q8Scales<R, G>(wd, nb, tile.yd, c1, std::min(nb, c1 + kQ8ScaleChunk) - c1, lane_scale,
                     s[(c0 / kQ8ScaleChunk + 1) & 1]);
    for (int64_t i = c0; i < c1; ++i) {
      __m512i w[R];
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) w[r] = _mm512_load_si512(wq + r * nb + i);
      const int8_t* ai = tile.q + i * 4 * static_cast<int64_t>(kQ8ActPairBytes);
      __m512i v[8 * G];
      _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p) {
        const __m512i y = _mm512_load_si512(ai + p * kQ8ActPairBytes);
        const __m512i corr = _mm512_load_si512(ai + p * kQ8ActPairBytes + 64);
        _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) v[r * P + p] =
            _mm512_dpbusd_epi32(corr, w[r], y);
      }
      _Pragma("GCC unroll 8") for (int n = R * P; n < 8 * G; ++n) v[n] = _mm512_setzero_si512();
      const float(*si)[16] = sc + (i - c0) * G;
      _Pragma("GCC unroll 2") for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(
          _mm512_load_ps(si[g]), _mm512_cvtepi32_ps(ReduceQ8Lanes8(v + 8 * g)), acc[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float o[16];
    _mm512_store_ps(o, acc[g]);
    for (int lane = 0; lane < 16; ++lane)
      if (kMap.out[g][lane] >= 0) out[kMap.out[g][lane]] = o[lane];
  }
}

using DotQ8Fn = void (*)(const __m512i*, const float*, int64_t, Q8Tile, float*);
template <int R>
constexpr DotQ8Fn kDotQ8Row[4] = {&DotQ8Vnni<R, 1>, &DotQ8Vnni<R, 2>, &DotQ8Vnni<R, 3>,
                                  &DotQ8Vnni<R, 4>};
// [rows - 1][pairs - 1]
constexpr const DotQ8Fn* kDotQ8[kQ8VnniRows] = {kDotQ8Row<1>, kDotQ8Row<2>, kDotQ8Row<3>,
                                                kDotQ8Row<4>};

template <class T>
T* Align64(std::byte*& p, size_t count) {
  p = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  T* out = reinterpret_cast<T*>(p);
  p += count * sizeof(T);
  return out;
}

// ---------------------------------------------------------------- AMX (Sapphire Rapids+)
// TDPBSSD multiplies a tile of 16 tokens x 32 signed activation quants (one block, read in
// place from the activation rows) by a B tile of the same block of 16 rows (their 32 signed
// quants, 4 consecutive ones of each row side by side: the VNNI layout), giving each
// (token, row) the exact int32 total of the block's 32 products. The epilogue is the plain
// kernel's float step per block, 16 rows wide: fma(dw * yd, float(total), acc), in block order.
// Blocks go in pairs, the next pair's products issued before the current pair's epilogue
// (DotQ8Amx).

#define KILN_Q8_AMX \
  __attribute__((target(HWY_TARGET_STR ",avx512vnni,amx-tile,amx-int8"), noinline))

// Tiles (configure_amx_tiles): C 0..3 hold two blocks' results in flight while two more are
// computed; A 4, 5 one block (32 quants) of m tokens; B 6, 7 one block of 16 rows.

// Rows r..r+n (n <= 16; the others zero, their outputs not read) as B tiles, bt + i * 512 for
// block i, and their scales in tile order, bd[i * 16 + k]; rq/rd hold the unpacked rows.
KILN_Q8_AMX void PackQ8AmxRows(const WeightMatrix& w, int64_t r, int n, Q8UnpackRow unpack,
                               int8_t* rq, float* rd, int8_t* bt, float* bd) {
  const int64_t nb = w.n_cols / 32;
  for (int k = 0; k < 16; ++k) {
    if (k < n) {
      unpack(w.row(r + k).data(), nb, rq + k * nb * 32, rd + k * nb);
    } else {
      std::memset(rq + k * nb * 32, 0, static_cast<size_t>(nb) * 32);
      std::fill_n(rd + k * nb, nb, 0.0f);
    }
  }
  for (int64_t i = 0; i < nb; ++i) {
    __m256i v[16];
    for (int k = 0; k < 16; ++k)
      v[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rq + (k * nb + i) * 32));
    amx_store_b_columns(v, bt + i * 512);
    for (int k = 0; k < 16; ++k) bd[i * 16 + k] = rd[k * nb + i];
  }
}

// Q8_0 rows packed straight from the format: its quants are the int8 operands as they stand
// and its scale an f16 (UnpackQ8_0's q and d), so the unpack's copy into rq/rd is skipped.
KILN_Q8_AMX void PackQ8_0AmxRows(const WeightMatrix& w, int64_t r, int n, int8_t* bt, float* bd) {
  const int64_t nb = w.n_cols / 32;
  const quant::block_q8_0* rows[16];
  for (int k = 0; k < n; ++k)
    rows[k] = reinterpret_cast<const quant::block_q8_0*>(w.row(r + k).data());
  for (int64_t i = 0; i < nb; ++i) {
    __m256i v[16];
    for (int k = 0; k < 16; ++k) {
      v[k] = k < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[k][i].qs))
                   : _mm256_setzero_si256();
      bd[i * 16 + k] = k < n ? _cvtsh_ss(rows[k][i].d.bits) : 0.0f;
    }
    amx_store_b_columns(v, bt + i * 512);
  }
}

// acc[t] (16 rows) += block i's totals c[t] scaled by dw * yd of token t, for t < m.
template <int kM>
HWY_INLINE void Q8AmxEpilogue(const int32_t (*c)[16], const float* bd, const std::byte* xq,
                              size_t ldx, int64_t i, int m, __m512* acc) {
  const __m512 dw = _mm512_load_ps(bd + i * 16);
  _Pragma("GCC unroll 16") for (int t = 0; t < (kM > 0 ? kM : 16); ++t) {
    if (kM == 0 && t >= m) break;
    const float yd = reinterpret_cast<const ActQ8_0*>(xq + t * ldx)[i].d;
    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(yd)),
                             _mm512_cvtepi32_ps(_mm512_load_si512(c[t])), acc[t]);
  }
}

// m tokens (activation rows ldx bytes apart from xq) x one packed 16-row group: rows k < n of
// token t to y[t * ldy + k]. kM: 16 for a whole tile, 0 for a last partial one of m tokens.
// Blocks i and i + 1 into C tiles c0, c1 (A tiles 4, 5; B tiles 6, 7), and those C tiles to c.
// Macros: GCC's tile intrinsics paste their tile numbers into the asm text, so they must be
// literals (a template parameter's name reached the assembler).
#define KILN_Q8_AMX_ISSUE_PAIR(c0, c1, bt, a, lda, i)       \
  do {                                                      \
    _tile_zero(c0);                                         \
    _tile_zero(c1);                                         \
    _tile_loadd(4, (a) + (i) * sizeof(ActQ8_0), lda);       \
    _tile_loadd(6, (bt) + (i)*512, 64);                     \
    _tile_loadd(5, (a) + ((i) + 1) * sizeof(ActQ8_0), lda); \
    _tile_loadd(7, (bt) + ((i) + 1) * 512, 64);             \
    _tile_dpbssd(c0, 4, 6);                                 \
    _tile_dpbssd(c1, 5, 7);                                 \
  } while (0)
#define KILN_Q8_AMX_STORE_PAIR(c0, c1, c) \
  do {                                    \
    _tile_stored(c0, (c)[0], 64);         \
    _tile_stored(c1, (c)[1], 64);         \
  } while (0)

template <int kM>
KILN_Q8_AMX void DotQ8Amx(const int8_t* bt, const float* bd, int64_t nb, const std::byte* xq,
                          size_t ldx, int m, int n, float* y, int64_t ldy) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) int32_t c[2][16][16];
  const std::byte* a = xq + offsetof(ActQ8_0, qs);
  const auto lda = static_cast<long>(ldx);
  // Pairs of blocks alternate between C tiles 0/1 and 2/3: the next pair's products are issued
  // before the current pair's results are stored and scaled, so the tile unit and the epilogue
  // overlap; the epilogues still run in block order.
  int64_t i = 0;
  if (nb >= 2) KILN_Q8_AMX_ISSUE_PAIR(0, 1, bt, a, lda, 0);
  while (i + 2 <= nb) {
    if (i + 4 <= nb) KILN_Q8_AMX_ISSUE_PAIR(2, 3, bt, a, lda, i + 2);
    KILN_Q8_AMX_STORE_PAIR(0, 1, c);
    Q8AmxEpilogue<kM>(c[0], bd, xq, ldx, i, m, acc);
    Q8AmxEpilogue<kM>(c[1], bd, xq, ldx, i + 1, m, acc);
    i += 2;
    if (i + 2 > nb) break;
    if (i + 4 <= nb) KILN_Q8_AMX_ISSUE_PAIR(0, 1, bt, a, lda, i + 2);
    KILN_Q8_AMX_STORE_PAIR(2, 3, c);
    Q8AmxEpilogue<kM>(c[0], bd, xq, ldx, i, m, acc);
    Q8AmxEpilogue<kM>(c[1], bd, xq, ldx, i + 1, m, acc);
    i += 2;
  }
  if (i < nb) {  // a last odd block (every pair before it is stored)
    _tile_zero(0);
    _tile_loadd(4, a + i * sizeof(ActQ8_0), lda);
    _tile_loadd(6, bt + i * 512, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_stored(0, c[0], 64);
    Q8AmxEpilogue<kM>(c[0], bd, xq, ldx, i, m, acc);
  }
  const auto rows = static_cast<__mmask16>((1u << n) - 1);
  for (int t = 0; t < m; ++t) _mm512_mask_storeu_ps(y + t * ldy, rows, acc[t]);
}

// Blocks of up to q8_amx_groups(nb) groups of 16 rows, packed at once (one long read of the
// rows: 16 rows at a time left the hardware prefetcher a short stream per group, and the reads
// ran at a fraction of the memory's speed) x tiles of 16 tokens (a last one of fewer).
KILN_Q8_AMX void MatmulQ8Amx(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch,
                             Q8UnpackRow unpack) {
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 32, ldy = w.n_rows, groups = q8_amx_groups(nb);
  auto* p = reinterpret_cast<std::byte*>(scratch);
  int8_t* rq = Align64<int8_t>(p, static_cast<size_t>(16 * nb * 32));
  float* rd = Align64<float>(p, static_cast<size_t>(16 * nb));
  int8_t* bt = Align64<int8_t>(p, static_cast<size_t>(groups * nb * 512));
  float* bd = Align64<float>(p, static_cast<size_t>(groups * nb * 16));
  int configured = 0;
  for (int64_t b0 = r0; b0 < r1; b0 += 16 * groups) {
    const int64_t b1 = std::min(r1, b0 + 16 * groups);
    for (int64_t r = b0; r < b1; r += 16) {
      const int64_t g = (r - b0) / 16;
      const int n = static_cast<int>(std::min<int64_t>(16, b1 - r));
      if (w.dtype == DType::Q8_0)
        PackQ8_0AmxRows(w, r, n, bt + g * nb * 512, bd + g * nb * 16);
      else
        PackQ8AmxRows(w, r, n, unpack, rq, rd, bt + g * nb * 512, bd + g * nb * 16);
    }
    for (int64_t t0 = 0; t0 < job.n_tok; t0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, job.n_tok - t0));
      if (m != configured) {
        configure_amx_tiles(m, 32, 8);
        configured = m;
      }
      const std::byte* xq = job.xq + t0 * job.xq_row_bytes;
      for (int64_t r = b0; r < b1; r += 16) {
        const int64_t g = (r - b0) / 16;
        const int n = static_cast<int>(std::min<int64_t>(16, b1 - r));
        float* y = job.y + t0 * ldy + r;
        if (m == 16)
          DotQ8Amx<16>(bt + g * nb * 512, bd + g * nb * 16, nb, xq, job.xq_row_bytes, m, n, y, ldy);
        else
          DotQ8Amx<0>(bt + g * nb * 512, bd + g * nb * 16, nb, xq, job.xq_row_bytes, m, n, y, ldy);
      }
    }
  }
  _tile_release();
}
#undef KILN_Q8_AMX_ISSUE_PAIR
#undef KILN_Q8_AMX_STORE_PAIR
#undef KILN_Q8_AMX

}  // namespace

// Token groups x row blocks x token tiles x register tiles of up to 4 rows x 8 tokens: each
// token's tile is built once per group and each row block packed once per group. `scratch`
// holds q8_vnni_scratch_bytes(n_cols). From kQ8AmxMinTok tokens on a machine with AMX-INT8
// (and CpuOptions::amx), the AMX kernel above instead.
void MatmulQ8Vnni(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch,
                  Q8UnpackRow unpack) {
  static_assert(kQ8VnniTok == 8 && kQ8VnniRows == 4);
  if (job.amx && job.n_tok >= kQ8AmxMinTok && amx_usable())
    return MatmulQ8Amx(job, r0, r1, scratch, unpack);
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 32, ldy = w.n_rows;
  const int64_t rb = q8_vnni_rows_per_block(nb), group = q8_vnni_group_tokens(nb);
  auto* p = reinterpret_cast<std::byte*>(scratch);
  __m512i* pq = Align64<__m512i>(p, static_cast<size_t>(rb * nb));
  float* pd = Align64<float>(p, static_cast<size_t>(rb * nb));
  int8_t* tq =
      Align64<int8_t>(p, static_cast<size_t>(group / kQ8VnniTok * nb * 4) * kQ8ActPairBytes);
  float* tyd = Align64<float>(p, static_cast<size_t>(group * nb));
  int8_t* row_q = Align64<int8_t>(p, static_cast<size_t>(nb * 32));
  const ActQ8_0* ys[kQ8VnniTok];
  float out[kQ8VnniRows * 8];
  for (int64_t g0 = 0; g0 < job.n_tok; g0 += group) {
    const int64_t g1 = std::min(job.n_tok, g0 + group);
    for (int64_t t0 = g0; t0 < g1; t0 += kQ8VnniTok) {
      const int m = static_cast<int>(std::min<int64_t>(kQ8VnniTok, g1 - t0));
      for (int k = 0; k < m; ++k)
        ys[k] = reinterpret_cast<const ActQ8_0*>(job.xq + (t0 + k) * job.xq_row_bytes);
      const int64_t tile = (t0 - g0) / kQ8VnniTok;
      FillQ8Tile(ys, m, nb, tq + tile * nb * 4 * static_cast<int64_t>(kQ8ActPairBytes),
                 tyd + tile * nb * kQ8VnniTok);
    }
    for (int64_t b0 = r0; b0 < r1; b0 += rb) {
      const int64_t b1 = std::min(r1, b0 + rb);
      PackQ8Rows(w, b0, b1, unpack, row_q, pq, pd);
      for (int64_t t0 = g0; t0 < g1; t0 += kQ8VnniTok) {
        const int m = static_cast<int>(std::min<int64_t>(kQ8VnniTok, g1 - t0));
        const int64_t k = (t0 - g0) / kQ8VnniTok;
        const Q8Tile tile{tq + k * nb * 4 * static_cast<int64_t>(kQ8ActPairBytes),
                          tyd + k * nb * kQ8VnniTok};
        const int pairs = (m + 1) / 2;
        for (int64_t r = b0; r < b1; r += kQ8VnniRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kQ8VnniRows, b1 - r));
          kDotQ8[rows - 1][pairs - 1](pq + (r - b0) * nb, pd + (r - b0) * nb, nb, tile, out);
          for (int rr = 0; rr < rows; ++rr)
            for (int j = 0; j < m; ++j) job.y[(t0 + j) * ldy + r + rr] = out[rr * 8 + j];
        }
      }
    }
  }
}

#undef KILN_Q8_VNNI
#endif  // HWY_ARCH_X86 && HWY_AVX3_DL

// Q8_0 activation blocks with AVX-512 (where this target has it), the same bytes as
// quantize_act_row's scalar loop, which is compiled for the baseline ISA (one serial max and one
// serial probe chain per block). Every step is the loop's: the max of |x| skipping NaN
// (vmaxps returns its second operand, the running max, when |x| is NaN; max is order-free),
// "some x not finite" for the probe (x * 0 is NaN exactly then), d = amax / 127 and its inverse
// in scalar, then per element the product and the rounding add as two separately rounded ops
// (the _round forms: no FMA contraction, as the baseline loop has none) and the mantissa bits.
bool QuantizeQ8_0RowK(const float* x, int64_t n, std::byte* dst) {
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX3_DL
  constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512i mant = _mm512_set1_epi32(0x007fffff), half = _mm512_set1_epi32(0x00400000);
  auto* out = reinterpret_cast<ActQ8_0*>(dst);
  for (int64_t b = 0; b < n / 32; ++b) {
    const float* xb = x + b * 32;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a = _mm512_max_ps(_mm512_and_ps(x1, abs_mask),
                                   _mm512_max_ps(_mm512_and_ps(x0, abs_mask), _mm512_setzero_ps()));
    const bool bad = (_mm512_fpclass_ps_mask(x0, 0x99) | _mm512_fpclass_ps_mask(x1, 0x99)) != 0;
    const float amax = _mm512_reduce_max_ps(a);
    const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
    ActQ8_0& q = out[b];
    q.d = bad ? NAN : d;
    if (bad) {
      std::memset(q.qs, 0, sizeof(q.qs));
      continue;
    }
    const __m512 iv = _mm512_set1_ps(id);
    for (int h = 0; h < 2; ++h) {
      const __m512 prod = _mm512_mul_round_ps(h ? x1 : x0, iv, kRn);
      const __m512i bits = _mm512_castps_si512(_mm512_add_round_ps(prod, magic, kRn));
      const __m512i qi = _mm512_sub_epi32(_mm512_and_si512(bits, mant), half);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.qs + 16 * h), _mm512_cvtepi32_epi8(qi));
    }
  }
  return true;
#else
  (void)x;
  (void)n;
  (void)dst;
  return false;
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kiln::cpu {
#if defined(__linux__)
// CPUID.(7,0):EDX bits 24 (AMX-TILE) and 25 (AMX-INT8), and Linux's per-process permission for
// the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once.
bool amx_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if ((d & (1u << 24)) == 0 || (d & (1u << 25)) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}
#else
bool amx_usable() { return false; }
#endif
HWY_EXPORT(QuantizeQ8_0RowK);
bool quantize_q8_0_simd(const float* x, int64_t n, std::byte* dst) {
  return HWY_DYNAMIC_DISPATCH(QuantizeQ8_0RowK)(x, n, dst);
}
}  // namespace kiln::cpu
#endif
