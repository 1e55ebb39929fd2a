// backend/cpu/kq_avx2-inl.h: the Q4_K and Q6_K int8 dots of machines with AVX2 but no AVX-512
// (AMD Zen 2/3, Intel client cores), where every Q4_K / Q6_K matmul takes them: decode, batched
// decode and prefill. They compute cpu_matmul.cpp's plain DotQ45K / DotQ6K exactly: the same
// exact super-block totals (integer sums, exact in any order) and, per token, the same float
// FMAs per block in block order (docs/determinism.md). What differs is how the sub-block scales
// reach the multiply-adds: the plain kernels build each sub-block's scale vector from a byte in
// memory (a byte extract and a broadcast, 3 ops, 8 times per block); here the block's scales are
// widened to words once and each sub-block's vector is one in-lane shuffle of them. The plain
// kernels stay as they are, the reference these are compared with bit for bit (tests/ops
// MatmulKQOne and MatmulKQBatch on every target, MatmulKRows16 on an AVX2 machine) and the
// arithmetic the AVX-512 kernels also reproduce. Included once per Highway target by
// cpu_matmul.cpp; only the AVX2 target defines anything.
#if defined(KILN_BACKEND_CPU_KQ_AVX2_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KILN_BACKEND_CPU_KQ_AVX2_INL_H_
#undef KILN_BACKEND_CPU_KQ_AVX2_INL_H_
#else
#define KILN_BACKEND_CPU_KQ_AVX2_INL_H_
#endif

#include <cstdint>
#include <cstring>

#include "core/half.h"
#include "backend/cpu/k4_scales.h"
#include "backend/cpu/prefetch.h"
#include "float_dot-inl.h"
#include "hwy/highway.h"
#include "quant/blocks.h"

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {

// ScalesMinsK4 (a block's scales and mins as bytes): k4_scales.h.

#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
// Lane t = the sum of v[t]'s eight int32 lanes: pairwise horizontal adds give
// [t0 t1 t2 t3 | t0 t1 t2 t3] partials, then the halves. Integer sums, so any grouping of the
// lanes gives the same total (two's complement wraps alike in every order, and the totals the
// kernels take fit in int32): the exact block totals of docs/determinism.md.
HWY_INLINE __m256i Totals8(const __m256i (&v)[8]) {
  const __m256i h0 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i h1 =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                          _mm256_permute2x128_si256(h0, h1, 0x31));
}
// Up to 4 rows' Q4_K block step against one token: v[r] row r's T1 lanes, v[4 + r] its T2
// lanes; acc lane r += dy[r] * T1, then += ny[r] * T2 (the plain kernel's two FMAs).
HWY_INLINE __m128 RowsT1T2Fma(const __m256i (&v)[8], const float* dy, const float* ny, __m128 acc) {
  const __m256 tot = _mm256_cvtepi32_ps(Totals8(v));
  acc = _mm_fmadd_ps(_mm_load_ps(dy), _mm256_castps256_ps128(tot), acc);
  return _mm_fmadd_ps(_mm_load_ps(ny), _mm256_extractf128_ps(tot, 1), acc);
}
#endif

#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2
// f16_to_f32 in one instruction (F16C, part of Highway's AVX2 target): the same float for all
// 65536 halves, NaN payloads included (checked exhaustively by tests/unit
// Half.F16cInstructionIsF16ToF32), where the portable conversion spends a dozen scalar ops, twice
// per Q4_K block.
HWY_INLINE float F16c(f16 h) { return _cvtsh_ss(h.bits); }

// pshufb control that puts word `lo` of each 128-bit lane in every word of the low lane and
// word `hi` in every word of the high lane.
HWY_INLINE __m256i WordSplat(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(((2 * hi + 1) << 8) | (2 * hi))),
                          _mm_set1_epi16(static_cast<int16_t>(((2 * lo + 1) << 8) | (2 * lo))));
}

// The kernels below prefetch each block's lines into L2 (PrefetchSpanL2, prefetch.h) at a
// distance ahead of the block being read: a single core streams ~10 GB/s from DRAM without it
// on the Zen 3 dev box. A line of the span missed by the three or four prefetches is the first
// line of the next block's span.

// ScalesMinsK4's 16 bytes in a register, built from the four words without a trip through
// memory (a 16-byte load of four 4-byte stores cannot be store-forwarded: it waits for them to
// retire, once per block).
HWY_INLINE __m128i ScalesMinsK4Vec(const uint8_t* packed) {
  uint32_t u0, u1, u2;
  std::memcpy(&u0, packed, 4);
  std::memcpy(&u1, packed + 4, 4);
  std::memcpy(&u2, packed + 8, 4);
  constexpr uint32_t kMask1 = 0x3f3f3f3f, kMask2 = 0x0f0f0f0f, kMask3 = 0x03030303;
  const uint32_t w3 = ((u2 >> 4) & kMask2) | (((u1 >> 6) & kMask3) << 4);
  const uint32_t w2 = u1 & kMask1;
  const uint32_t w1 = (u2 & kMask2) | (((u0 >> 6) & kMask3) << 4);
  const uint32_t w0 = u0 & kMask1;
  return _mm_setr_epi32(static_cast<int>(w0), static_cast<int>(w1), static_cast<int>(w2),
                        static_cast<int>(w3));
}

// A Q4_K block's scales as the kernels use them: d, dmin, the mins as words (m[k/2] in word
// k, for the madd with Q8_K's 16 bsums) and the 8 scales as words in both lanes.
struct Q4KHead {
  float d, dmin;
  __m256i mins16, sc16;
};
HWY_INLINE Q4KHead LoadQ4KHead(const quant::block_q4_K* b) {
  const __m128i smv = ScalesMinsK4Vec(b->scales);
  const __m128i mins8 = _mm_srli_si128(smv, 8);
  return Q4KHead{F16c(b->d), F16c(b->dmin), _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins8, mins8)),
                 _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(smv))};
}
// Sub-blocks 2j (lo) and 2j + 1 (hi) of a Q4_K block: their unsigned quants and scale vectors.
HWY_INLINE void Q4KPair(const quant::block_q4_K* b, const Q4KHead& h, int j, __m256i& lo,
                        __m256i& hi, __m256i& sc_lo, __m256i& sc_hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i q4 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * j));
  lo = _mm256_and_si256(q4, m4);
  hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
  sc_lo = _mm256_shuffle_epi8(h.sc16, WordSplat(2 * j, 2 * j));
  sc_hi = _mm256_shuffle_epi8(h.sc16, WordSplat(2 * j + 1, 2 * j + 1));
}
// The int32 lanes of sub-blocks 2j, 2j + 1 against one token's 64 quants at a.
HWY_INLINE __m256i Q4KPairDot(__m256i lo, __m256i hi, __m256i sc_lo, __m256i sc_hi,
                              const int8_t* a) {
  const __m256i p0 = _mm256_madd_epi16(
      _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), sc_lo);
  const __m256i p1 = _mm256_madd_epi16(
      _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32))),
      sc_hi);
  return _mm256_add_epi32(p0, p1);
}
// DotQ45K<T, false>'s bits (Q4_K against Q8_K): per block the T tokens' exact totals T1 and T2,
// reduced together (Totals8), and one 8-wide FMA each. pf: prefetch distance in bytes (0: none).
template <int T>
HWY_INLINE void DotQ4KAvx2(const std::byte* row, int64_t nb, const quant::block_q8_K* const* ys,
                           float* out, int64_t pf) {
  static_assert(T >= 1 && T <= 8);
  __m256 acc = _mm256_setzero_ps();  // token t in lane t
  for (int64_t i = 0; i < nb; ++i) {
    const auto* b = reinterpret_cast<const quant::block_q4_K*>(row + i * sizeof(quant::block_q4_K));
    if (pf) PrefetchSpanL2<sizeof(quant::block_q4_K)>(reinterpret_cast<const std::byte*>(b) + pf);
    const Q4KHead h = LoadQ4KHead(b);
    __m256i isum[8], msum[8];
    for (int t = 0; t < 8; ++t) isum[t] = msum[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256i lo, hi, sc_lo, sc_hi;
      Q4KPair(b, h, j, lo, hi, sc_lo, sc_hi);
      for (int t = 0; t < T; ++t)
        isum[t] = _mm256_add_epi32(isum[t], Q4KPairDot(lo, hi, sc_lo, sc_hi, ys[t][i].qs + 64 * j));
    }
    alignas(32) float dy[8] = {}, ny[8] = {};
    for (int t = 0; t < T; ++t) {
      const quant::block_q8_K& y = ys[t][i];
      msum[t] = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums)),
                                  h.mins16);
      dy[t] = h.d * y.d;
      ny[t] = -h.dmin * y.d;
    }
    acc = _mm256_fmadd_ps(_mm256_load_ps(dy), _mm256_cvtepi32_ps(Totals8(isum)), acc);
    acc = _mm256_fmadd_ps(_mm256_load_ps(ny), _mm256_cvtepi32_ps(Totals8(msum)), acc);
  }
  alignas(32) float o[8];
  _mm256_store_ps(o, acc);
  for (int t = 0; t < T; ++t) out[t] = o[t];
}

// DotQ45K<1, false>'s bits for R <= 4 rows (rows[k]: one row each, out[k] its output) against
// one token: the token's activations are loaded once for the R rows, and the R rows' totals are
// reduced together (T1 of rows 0..3 in lanes 0..3, T2 in 4..7). pf: prefetch distance; the R
// rows' blocks i are read together, so the span prefetched per block step is R blocks long, from
// R blocks ahead of rows[0]'s block i + pf.
template <int R>
HWY_INLINE void DotQ4KAvx2Rows(const std::byte* const* rows, int64_t nb, const quant::block_q8_K* y,
                               float* out, int64_t pf) {
  static_assert(R >= 1 && R <= 4);
  __m128 acc = _mm_setzero_ps();  // row k in lane k
  for (int64_t i = 0; i < nb; ++i) {
    if (pf)
      PrefetchSpanL2<R * sizeof(quant::block_q4_K)>(rows[0] + pf +
                                                    R * i * int64_t{sizeof(quant::block_q4_K)});
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].bsums));
    __m256i v[8];
    for (int k = 0; k < 8; ++k) v[k] = _mm256_setzero_si256();
    alignas(16) float dy[4] = {}, ny[4] = {};
    for (int k = 0; k < R; ++k) {
      const auto* b = reinterpret_cast<const quant::block_q4_K*>(rows[k]) + i;
      const Q4KHead h = LoadQ4KHead(b);
      __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m256i lo, hi, sc_lo, sc_hi;
        Q4KPair(b, h, j, lo, hi, sc_lo, sc_hi);
        isum = _mm256_add_epi32(isum, Q4KPairDot(lo, hi, sc_lo, sc_hi, y[i].qs + 64 * j));
      }
      v[k] = isum;
      v[4 + k] = _mm256_madd_epi16(bsums, h.mins16);
      dy[k] = h.d * y[i].d;
      ny[k] = -h.dmin * y[i].d;
    }
    acc = RowsT1T2Fma(v, dy, ny, acc);
  }
  alignas(16) float o[4];
  _mm_store_ps(o, acc);
  for (int k = 0; k < R; ++k) out[k] = o[k];
}

// A Q6_K block's scales as words: all 16 (for the -32 offset's madd with the bsums), and 0..7
// and 8..15 in both lanes, of which sub-block s's vector (scales[2s] in the low lane,
// scales[2s + 1] in the high one) is one shuffle (Q6KSubScale).
struct Q6KHead {
  float d;
  __m256i sc_all, sc_a, sc_b;
};
HWY_INLINE Q6KHead LoadQ6KHead(const quant::block_q6_K* b) {
  const __m256i sc_all =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
  return Q6KHead{F16c(b->d), sc_all, _mm256_permute2x128_si256(sc_all, sc_all, 0x00),
                 _mm256_permute2x128_si256(sc_all, sc_all, 0x11)};
}
HWY_INLINE __m256i Q6KSubScale(const Q6KHead& h, int sub) {
  const int g = sub % 4;
  return _mm256_shuffle_epi8(sub < 4 ? h.sc_a : h.sc_b, WordSplat(2 * g, 2 * g + 1));
}
// Half hf of a Q6_K block as its four 32-quant groups (Q6KGroups).
HWY_INLINE void Q6KHalf(const quant::block_q6_K* b, int hf, __m256i (&w4)[4]) {
  const auto* ql = reinterpret_cast<const __m256i*>(b->ql + 64 * hf);
  Q6KGroups(_mm256_loadu_si256(ql), _mm256_loadu_si256(ql + 1),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * hf)), w4);
}
// One token's int32 lanes start: the -32 offset, -sum_g sc_g * 32 * bsum_g.
HWY_INLINE __m256i Q6KOffset(const Q6KHead& h, const quant::block_q8_K& y) {
  return _mm256_sub_epi32(
      _mm256_setzero_si256(),
      _mm256_slli_epi32(_mm256_madd_epi16(h.sc_all, _mm256_loadu_si256(
                                                        reinterpret_cast<const __m256i*>(y.bsums))),
                        5));
}
// Sub-block `sub` (quants w, scale vector sc) against one token's 32 quants at a.
HWY_INLINE __m256i Q6KSubDot(__m256i w, __m256i sc, const int8_t* a) {
  return _mm256_madd_epi16(
      _mm256_maddubs_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), sc);
}

// DotQ6K<T>'s bits (Q6_K against Q8_K): the T tokens' exact totals reduced together. pf: as
// above.
template <int T>
HWY_INLINE void DotQ6KAvx2(const std::byte* row, int64_t nb, const quant::block_q8_K* const* ys,
                           float* out, int64_t pf) {
  static_assert(T >= 1 && T <= 8);
  __m256 acc = _mm256_setzero_ps();  // token t in lane t
  for (int64_t i = 0; i < nb; ++i) {
    const auto* b = reinterpret_cast<const quant::block_q6_K*>(row + i * sizeof(quant::block_q6_K));
    if (pf) PrefetchSpanL2<sizeof(quant::block_q6_K)>(reinterpret_cast<const std::byte*>(b) + pf);
    const Q6KHead h = LoadQ6KHead(b);
    __m256i isum[8];
    for (int t = 0; t < 8; ++t) isum[t] = t < T ? Q6KOffset(h, ys[t][i]) : _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int hf = 0; hf < 2; ++hf) {
      __m256i w4[4];
      Q6KHalf(b, hf, w4);
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const int sub = 4 * hf + g;
        const __m256i sc = Q6KSubScale(h, sub);
        for (int t = 0; t < T; ++t)
          isum[t] = _mm256_add_epi32(isum[t], Q6KSubDot(w4[g], sc, ys[t][i].qs + 32 * sub));
      }
    }
    alignas(32) float dy[8] = {};
    for (int t = 0; t < T; ++t) dy[t] = h.d * ys[t][i].d;
    acc = _mm256_fmadd_ps(_mm256_load_ps(dy), _mm256_cvtepi32_ps(Totals8(isum)), acc);
  }
  alignas(32) float o[8];
  _mm256_store_ps(o, acc);
  for (int t = 0; t < T; ++t) out[t] = o[t];
}

// DotQ6K<1>'s bits for R <= 8 rows against one token (as DotQ4KAvx2Rows).
template <int R>
HWY_INLINE void DotQ6KAvx2Rows(const std::byte* const* rows, int64_t nb, const quant::block_q8_K* y,
                               float* out, int64_t pf) {
  static_assert(R >= 1 && R <= 8);
  __m256 acc = _mm256_setzero_ps();  // row k in lane k
  for (int64_t i = 0; i < nb; ++i) {
    if (pf)
      PrefetchSpanL2<R * sizeof(quant::block_q6_K)>(rows[0] + pf +
                                                    R * i * int64_t{sizeof(quant::block_q6_K)});
    __m256i v[8];
    for (int k = 0; k < 8; ++k) v[k] = _mm256_setzero_si256();
    alignas(32) float dy[8] = {};
    for (int k = 0; k < R; ++k) {
      const auto* b = reinterpret_cast<const quant::block_q6_K*>(rows[k]) + i;
      const Q6KHead h = LoadQ6KHead(b);
      __m256i isum = Q6KOffset(h, y[i]);
#pragma GCC unroll 2
      for (int hf = 0; hf < 2; ++hf) {
        __m256i w4[4];
        Q6KHalf(b, hf, w4);
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const int sub = 4 * hf + g;
          isum = _mm256_add_epi32(isum, Q6KSubDot(w4[g], Q6KSubScale(h, sub), y[i].qs + 32 * sub));
        }
      }
      v[k] = isum;
      dy[k] = h.d * y[i].d;
    }
    acc = _mm256_fmadd_ps(_mm256_load_ps(dy), _mm256_cvtepi32_ps(Totals8(v)), acc);
  }
  alignas(32) float o[8];
  _mm256_store_ps(o, acc);
  for (int k = 0; k < R; ++k) out[k] = o[k];
}

#endif  // HWY_AVX2

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#endif  // KILN_BACKEND_CPU_KQ_AVX2_INL_H_ toggle
