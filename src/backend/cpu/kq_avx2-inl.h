// backend/cpu/kq_avx2-inl.h: the Q4_K and Q6_K int8 dots of machines with AVX2 but no AVX-512
// (AMD Zen 2/3, Intel client cores), where every Q4_K / Q6_K matmul takes them: decode, batched
// decode and prefill. They compute cpu_matmul.cpp's plain DotQ45K / DotQ6K exactly: the same
// int32 lanes (integer sums are exact in any order) and, per token, the same two float FMAs per
// block in block order, then Hsum. What differs is how the sub-block scales reach the
// multiply-adds: the plain kernels build each sub-block's scale vector from a byte in memory (a
// byte extract and a broadcast, 3 ops, 8 times per block); here the block's scales are widened
// to words once and each sub-block's vector is one in-lane shuffle of them. The plain kernels
// stay as they are, the reference these are compared with bit for bit (tests/ops MatmulKQOne,
// MatmulKQBatch, MatmulKQPrefill on an AVX2 machine) and the arithmetic the AVX-512 kernels
// also reproduce. Included once per Highway target by cpu_matmul.cpp; only the AVX2 target
// defines anything.
#if defined(KILN_BACKEND_CPU_KQ_AVX2_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KILN_BACKEND_CPU_KQ_AVX2_INL_H_
#undef KILN_BACKEND_CPU_KQ_AVX2_INL_H_
#else
#define KILN_BACKEND_CPU_KQ_AVX2_INL_H_
#endif

#include <cstdint>
#include <cstring>

#include "core/half.h"
#include "float_dot-inl.h"
#include "hwy/highway.h"
#include "quant/blocks.h"

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {

// The 8 six-bit scales (bytes 0..7) and mins (bytes 8..15) of a Q4_K/Q5_K block.
HWY_INLINE void ScalesMinsK4(const uint8_t* packed, uint8_t out[16]) {
  uint32_t u[4];
  std::memcpy(u, packed, 12);
  constexpr uint32_t kMask1 = 0x3f3f3f3f, kMask2 = 0x0f0f0f0f, kMask3 = 0x03030303;
  u[3] = ((u[2] >> 4) & kMask2) | (((u[1] >> 6) & kMask3) << 4);
  const uint32_t aux = u[1] & kMask1;
  u[1] = (u[2] & kMask2) | (((u[0] >> 6) & kMask3) << 4);
  u[2] = aux;
  u[0] &= kMask1;
  std::memcpy(out, u, 16);
}

#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2
// f16_to_f32 in one instruction (F16C, part of Highway's AVX2 target): the same float for all
// 65536 halves, NaN payloads included (checked exhaustively by tests/unit Half.F16cInstructionIsF16ToF32),
// where the portable conversion spends a dozen scalar ops, twice per Q4_K block.
HWY_INLINE float F16c(f16 h) { return _cvtsh_ss(h.bits); }

// pshufb control that puts word `lo` of each 128-bit lane in every word of the low lane and
// word `hi` in every word of the high lane.
HWY_INLINE __m256i WordSplat(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(((2 * hi + 1) << 8) | (2 * hi))),
                          _mm_set1_epi16(static_cast<int16_t>(((2 * lo + 1) << 8) | (2 * lo))));
}

// The lines of a kBytes block at p into L2 (a prefetch never faults). Issued per block at a
// distance ahead of the block being read: rows lie back to back, so the address walks through
// the thread's rows as fast as the kernel reads them and keeps more lines in flight than the
// hardware prefetcher does for one core (a single core streams ~10 GB/s from DRAM without it on
// the Zen 3 dev box). A line of the span missed by the three or four prefetches is the first
// line of the next block's span.
template <size_t kBytes>
HWY_INLINE void PrefetchBlockL2(const std::byte* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t j = 0; j < (kBytes + 63) / 64; ++j) _mm_prefetch(c + 64 * j, _MM_HINT_T1);
}

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

// DotQ45K<T, false>'s bits (Q4_K against Q8_K). pf: prefetch distance in bytes (0: none).
template <int T>
HWY_INLINE void DotQ4KAvx2(const std::byte* row, int64_t nb, const quant::block_q8_K* const* ys,
                           float* out, int64_t pf) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const auto* b = reinterpret_cast<const quant::block_q4_K*>(row + i * sizeof(quant::block_q4_K));
    if (pf) PrefetchBlockL2<sizeof(quant::block_q4_K)>(reinterpret_cast<const std::byte*>(b) + pf);
    const float d = F16c(b->d), dmin = F16c(b->dmin);
    const __m128i smv = ScalesMinsK4Vec(b->scales);
    const __m128i mins8 = _mm_srli_si128(smv, 8);
    const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins8, mins8));  // m[k/2]
    const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(smv));  // sc 0..7, both lanes
    __m256i isum[T];
    for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i q4 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * j));
      const __m256i lo = _mm256_and_si256(q4, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
      const __m256i sc_lo = _mm256_shuffle_epi8(sc16, WordSplat(2 * j, 2 * j));
      const __m256i sc_hi = _mm256_shuffle_epi8(sc16, WordSplat(2 * j + 1, 2 * j + 1));
      for (int t = 0; t < T; ++t) {
        const int8_t* a = ys[t][i].qs + 64 * j;
        const __m256i p0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), sc_lo);
        const __m256i p1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32))),
            sc_hi);
        isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(p0, p1));
      }
    }
    for (int t = 0; t < T; ++t) {
      const quant::block_q8_K& y = ys[t][i];
      const __m256i msum =
          _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(y.bsums)), mins16);
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(isum[t]), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * y.d), _mm256_cvtepi32_ps(msum), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = Hsum(acc[t]);
}

// DotQ45K<1, false>'s bits for R rows (rows[k]: one row each, out[k] its output) against one
// token: the token's activations are loaded once for the R rows, and the R rows' float chains
// (two FMAs per block, in block order: the latency the block loop waits on with one row) run
// side by side. pf: prefetch distance; the R rows' blocks i are read together, so the span
// prefetched per block step is R blocks long, from R blocks ahead of rows[0]'s block i + pf.
template <int R>
HWY_INLINE void DotQ4KAvx2Rows(const std::byte* const* rows, int64_t nb,
                               const quant::block_q8_K* y, float* out, int64_t pf) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int k = 0; k < R; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    if (pf)
      PrefetchBlockL2<R * sizeof(quant::block_q4_K)>(rows[0] + pf +
                                                     R * i * int64_t{sizeof(quant::block_q4_K)});
    const quant::block_q8_K& yb = y[i];
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(yb.bsums));
    for (int k = 0; k < R; ++k) {
      const auto* b = reinterpret_cast<const quant::block_q4_K*>(rows[k]) + i;
      const float d = F16c(b->d), dmin = F16c(b->dmin);
      const __m128i smv = ScalesMinsK4Vec(b->scales);
      const __m128i mins8 = _mm_srli_si128(smv, 8);
      const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins8, mins8));
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(smv));
      __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i q4 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * j));
        const __m256i lo = _mm256_and_si256(q4, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
        const __m256i sc_lo = _mm256_shuffle_epi8(sc16, WordSplat(2 * j, 2 * j));
        const __m256i sc_hi = _mm256_shuffle_epi8(sc16, WordSplat(2 * j + 1, 2 * j + 1));
        const int8_t* a = yb.qs + 64 * j;
        const __m256i p0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), sc_lo);
        const __m256i p1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32))),
            sc_hi);
        isum = _mm256_add_epi32(isum, _mm256_add_epi32(p0, p1));
      }
      const __m256i msum = _mm256_madd_epi16(bsums, mins16);
      acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d * yb.d), _mm256_cvtepi32_ps(isum), acc[k]);
      acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * yb.d), _mm256_cvtepi32_ps(msum), acc[k]);
    }
  }
  for (int k = 0; k < R; ++k) out[k] = Hsum(acc[k]);
}

// DotQ6K<T>'s bits (Q6_K against Q8_K). pf: as above.
template <int T>
HWY_INLINE void DotQ6KAvx2(const std::byte* row, int64_t nb, const quant::block_q8_K* const* ys,
                           float* out, int64_t pf) {
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const auto* b = reinterpret_cast<const quant::block_q6_K*>(row + i * sizeof(quant::block_q6_K));
    if (pf) PrefetchBlockL2<sizeof(quant::block_q6_K)>(reinterpret_cast<const std::byte*>(b) + pf);
    const float d = F16c(b->d);
    const __m256i sc_all =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
    // Scales 0..7 and 8..15 as words in both lanes: sub-block s's vector (scales[2s] in the
    // low lane, scales[2s + 1] in the high one) is one shuffle of one of them.
    const __m256i sc_a = _mm256_permute2x128_si256(sc_all, sc_all, 0x00);
    const __m256i sc_b = _mm256_permute2x128_si256(sc_all, sc_all, 0x11);
    __m256i isum[T];
    for (int t = 0; t < T; ++t)  // the -32 offset: sum_g sc_g * 32 * bsum_g
      isum[t] = _mm256_sub_epi32(
          _mm256_setzero_si256(),
          _mm256_slli_epi32(
              _mm256_madd_epi16(sc_all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ys[t][i].bsums))),
              5));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const auto* ql = reinterpret_cast<const __m256i*>(b->ql + 64 * h);
      __m256i w4[4];
      Q6KGroups(_mm256_loadu_si256(ql), _mm256_loadu_si256(ql + 1),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * h)), w4);
      const __m256i sc_h = h == 0 ? sc_a : sc_b;
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const int sub = 4 * h + g;
        const __m256i sc = _mm256_shuffle_epi8(sc_h, WordSplat(2 * g, 2 * g + 1));
        for (int t = 0; t < T; ++t) {
          const __m256i a =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ys[t][i].qs + 32 * sub));
          isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w4[g], a), sc));
        }
      }
    }
    for (int t = 0; t < T; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * ys[t][i].d), _mm256_cvtepi32_ps(isum[t]), acc[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = Hsum(acc[t]);
}
// DotQ6K<1>'s bits for R rows against one token (as DotQ4KAvx2Rows).
template <int R>
HWY_INLINE void DotQ6KAvx2Rows(const std::byte* const* rows, int64_t nb,
                               const quant::block_q8_K* y, float* out, int64_t pf) {
  __m256 acc[R];
  for (int k = 0; k < R; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    if (pf)
      PrefetchBlockL2<R * sizeof(quant::block_q6_K)>(rows[0] + pf +
                                                     R * i * int64_t{sizeof(quant::block_q6_K)});
    const quant::block_q8_K& yb = y[i];
    const __m256i bsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(yb.bsums));
    for (int k = 0; k < R; ++k) {
      const auto* b = reinterpret_cast<const quant::block_q6_K*>(rows[k]) + i;
      const float d = F16c(b->d);
      const __m256i sc_all =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
      const __m256i sc_a = _mm256_permute2x128_si256(sc_all, sc_all, 0x00);
      const __m256i sc_b = _mm256_permute2x128_si256(sc_all, sc_all, 0x11);
      __m256i isum =
          _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc_all, bsums), 5));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const auto* ql = reinterpret_cast<const __m256i*>(b->ql + 64 * h);
        __m256i w4[4];
        Q6KGroups(_mm256_loadu_si256(ql), _mm256_loadu_si256(ql + 1),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qh + 32 * h)), w4);
        const __m256i sc_h = h == 0 ? sc_a : sc_b;
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          const __m256i sc = _mm256_shuffle_epi8(sc_h, WordSplat(2 * g, 2 * g + 1));
          const __m256i a =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(yb.qs + 32 * (4 * h + g)));
          isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(w4[g], a), sc));
        }
      }
      acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(d * yb.d), _mm256_cvtepi32_ps(isum), acc[k]);
    }
  }
  for (int k = 0; k < R; ++k) out[k] = Hsum(acc[k]);
}
// Q8_0 against one token's Q8_0 activations (act: 4-byte float scale, then 32 quants, as
// cpu_matmul_q8.h's ActQ8_0), R rows at a time: DotQ8Family<1, UnpackQ8_0>'s bits per row (|w|
// times w's sign moved onto a, one maddubs and one madd per block, then one FMA of d_w * d_a in
// block order, Hsum). The plain kernel converts each block's f16 scale with a dozen scalar ops
// for 32 weights; here F16C, the token's block loaded once for the R rows, and the prefetch span.
template <int R, class Act>
HWY_INLINE void DotQ8_0Avx2Rows(const std::byte* const* rows, int64_t nb, const Act* y,
                                float* out, int64_t pf) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int k = 0; k < R; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    if (pf)
      PrefetchBlockL2<R * sizeof(quant::block_q8_0)>(rows[0] + pf +
                                                     R * i * int64_t{sizeof(quant::block_q8_0)});
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[i].qs));
    const float yd = y[i].d;
    for (int k = 0; k < R; ++k) {
      const auto* b = reinterpret_cast<const quant::block_q8_0*>(rows[k]) + i;
      const float dw = F16c(b->d);
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs));
      const __m256i dot = _mm256_add_epi32(
          _mm256_setzero_si256(),
          _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)), ones));
      acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * yd), _mm256_cvtepi32_ps(dot), acc[k]);
    }
  }
  for (int k = 0; k < R; ++k) out[k] = Hsum(acc[k]);
}
#endif  // HWY_AVX2

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#endif  // KILN_BACKEND_CPU_KQ_AVX2_INL_H_ toggle
