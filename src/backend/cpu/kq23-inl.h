// backend/cpu/kq23-inl.h: the Q2_K and Q3_K int8 dots against Q8_K activations on x86 (AVX2
// and AVX-512 targets), the formats of the Q2_K / Q3_K_S/M/L mixes, which before this took the
// dequantize-to-f32 path. Both store 2-bit codes four to a byte (byte l of each 32-byte group
// holds elements l, l+32, l+64, l+96 of its 128-element half), so one shift and mask per group
// yields 32 consecutive codes as unsigned bytes, multiplied against the activations by maddubs
// and scaled per 16-element group by one madd. Q2_K: sum_g d * sc_g * sum(q * a) - dmin *
// sum_g m_g * bsum_g. Q3_K: the code q | hbit << 2 in [0, 7] stands for q + 4 * hbit - 4, so
// sum((v) * a) = sum(u * a) - 4 * bsum, exact in int32 (|pair| <= 2 * 7 * 127). One float FMA
// per block and token for each term, then Hsum. Included once per Highway target by
// cpu_matmul.cpp; only the x86 int8 targets define anything.
#if defined(KILN_BACKEND_CPU_KQ23_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KILN_BACKEND_CPU_KQ23_INL_H_
#undef KILN_BACKEND_CPU_KQ23_INL_H_
#else
#define KILN_BACKEND_CPU_KQ23_INL_H_
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

#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
HWY_INLINE __m256i LoadQ23(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
// Groups 2k (lanes 0..7) and 2k+1 (lanes 8..15) of a madd over 32 consecutive elements.
HWY_INLINE __m256i GroupScalePair(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(hi)),
                          _mm_set1_epi16(static_cast<int16_t>(lo)));
}

// Q3_K's 16 signed 6-bit scales (stored + 32) from its 12 packed bytes: the low 4 bits of
// scale j in the low (j < 8) or high nibble of byte j % 8, the high 2 bits at bit 2 * (j / 4)
// of byte 8 + j % 4.
HWY_INLINE void Q3KScales(const uint8_t* packed, int16_t s[16]) {
  for (int j = 0; j < 16; ++j) {
    const int lo = j < 8 ? (packed[j] & 0xF) : (packed[j - 8] >> 4);
    const int hi = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
    s[j] = static_cast<int16_t>((lo | (hi << 4)) - 32);
  }
}

template <int T>
HWY_INLINE void DotQ2K(const std::byte* row, int64_t nb, const quant::block_q8_K* const* ys,
                       float* out) {
  const __m256i m3 = _mm256_set1_epi8(3);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const auto* b = reinterpret_cast<const quant::block_q2_K*>(row + i * sizeof(quant::block_q2_K));
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales));
    const __m256i mins16 =
        _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), _mm_set1_epi8(0x0F)));
    __m256i isum[T];
    for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
    for (int n = 0; n < 2; ++n) {
      const __m256i q = LoadQ23(b->qs + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const __m256i w = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
        const int g = 8 * n + 2 * j;
        const __m256i sc = GroupScalePair(b->scales[g] & 0xF, b->scales[g + 1] & 0xF);
        for (int t = 0; t < T; ++t) {
          const __m256i a = LoadQ23(ys[t][i].qs + 128 * n + 32 * j);
          isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), sc));
        }
      }
    }
    const float d = f16_to_f32(b->d), dmin = f16_to_f32(b->dmin);
    for (int t = 0; t < T; ++t) {
      const quant::block_q8_K& y = ys[t][i];
      const __m256i msum = _mm256_madd_epi16(LoadQ23(y.bsums), mins16);
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), _mm256_cvtepi32_ps(isum[t]), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * y.d), _mm256_cvtepi32_ps(msum), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) out[t] = Hsum(acc[t]);
}

template <int T>
HWY_INLINE void DotQ3K(const std::byte* row, int64_t nb, const quant::block_q8_K* const* ys,
                       float* out) {
  const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const auto* b = reinterpret_cast<const quant::block_q3_K*>(row + i * sizeof(quant::block_q3_K));
    alignas(32) int16_t s[16];
    Q3KScales(b->scales, s);
    const __m256i sc16 = _mm256_load_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i hm = LoadQ23(b->hmask);
    __m256i isum[T];
    for (int t = 0; t < T; ++t)  // the -4 of every code: -4 * sum_g sc_g * bsum_g
      isum[t] =
          _mm256_sub_epi32(_mm256_setzero_si256(),
                           _mm256_slli_epi32(_mm256_madd_epi16(sc16, LoadQ23(ys[t][i].bsums)), 2));
    for (int n = 0; n < 2; ++n) {
      const __m256i q = LoadQ23(b->qs + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const __m256i hbit = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * n + j), one);
        const __m256i w = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3),
                                          _mm256_slli_epi16(hbit, 2));
        const int g = 8 * n + 2 * j;
        const __m256i sc = GroupScalePair(s[g], s[g + 1]);
        for (int t = 0; t < T; ++t) {
          const __m256i a = LoadQ23(ys[t][i].qs + 128 * n + 32 * j);
          isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), sc));
        }
      }
    }
    const float d = f16_to_f32(b->d);
    for (int t = 0; t < T; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * ys[t][i].d), _mm256_cvtepi32_ps(isum[t]), acc[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = Hsum(acc[t]);
}
#endif

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#endif  // include guard
