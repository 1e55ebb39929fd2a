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
#include "backend/cpu/prefetch.h"
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
    const float d = _cvtsh_ss(b->d.bits), dmin = _cvtsh_ss(b->dmin.bits);  // F16C: exact
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
    const float d = _cvtsh_ss(b->d.bits);  // F16C: exact
    for (int t = 0; t < T; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * ys[t][i].d), _mm256_cvtepi32_ps(isum[t]), acc[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = Hsum(acc[t]);
}

// ---- one token, R rows (decode)
// The plain kernels above for T = 1 spend most of a block on scalar work around the integer
// dots: 8 scale pairs built from scalars (GroupScalePair) and, for Q3_K, 16 scales unpacked one by
// one (Q3KScales). Below, a block's scales become one vector of 16 words (Q3_K's by four 32-bit
// mask-and-shift words, llama.cpp's layout trick) and each group pair's [sc_g x8 | sc_g+1 x8]
// one pshufb of it; R rows run side by side (independent chains), each token group loaded once
// for all of them; the lines kMatvecPrefetchBytes ahead are prefetched (rows back to back) as the
// other one-token kernels do. Every row's integer lanes and float steps are the T = 1 kernel's
// (integer sums are exact in any order; the scales are the same integers), so its bits are too
// (tests/ops MatmulKQOne).

// pshufb control: word `lo` of a 128-bit lane into every word of the low lane, `hi` the high.
HWY_INLINE __m256i Q23PairCtl(int lo, int hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(((2 * hi + 1) << 8) | (2 * hi))),
                          _mm_set1_epi16(static_cast<int16_t>(((2 * lo + 1) << 8) | (2 * lo))));
}
// Group pair (8n + 2j, 8n + 2j + 1) of 16 word scales `half_n` (lane-broadcast half n).
HWY_INLINE __m256i Q23ScalePair(__m256i half_n, int j) {
  return _mm256_shuffle_epi8(half_n, Q23PairCtl(2 * j, 2 * j + 1));
}
// Q3_K's 16 scales (stored + 32) as signed bytes, Q3KScales' values.
HWY_INLINE __m128i Q3KScalesVec(const uint8_t* packed) {
  uint32_t aux[3];
  std::memcpy(aux, packed, 12);
  constexpr uint32_t k2 = 0x03030303u, k4 = 0x0f0f0f0fu;
  const uint32_t t = aux[2];
  const __m128i u = _mm_setr_epi32(static_cast<int>((aux[0] & k4) | ((t & k2) << 4)),
                                   static_cast<int>((aux[1] & k4) | (((t >> 2) & k2) << 4)),
                                   static_cast<int>(((aux[0] >> 4) & k4) | (((t >> 4) & k2) << 4)),
                                   static_cast<int>(((aux[1] >> 4) & k4) | (((t >> 6) & k2) << 4)));
  return _mm_sub_epi8(u, _mm_set1_epi8(32));
}

template <int R>
HWY_INLINE void DotQ2KRows(const std::byte* row, size_t stride, int64_t nb,
                           const quant::block_q8_K* y, float* out, const std::byte* pf) {
  using quant::block_q2_K;
  const __m256i m3 = _mm256_set1_epi8(3);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    if (pf != nullptr) PrefetchSpanL2<R * sizeof(block_q2_K)>(pf + i * R * sizeof(block_q2_K));
    const block_q2_K* b[R];
    __m256i sc[R][2], isum[R];
    for (int r = 0; r < R; ++r) {
      b[r] = reinterpret_cast<const block_q2_K*>(row + r * stride) + i;
      const __m256i s16 = _mm256_cvtepu8_epi16(_mm_and_si128(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[r]->scales)), _mm_set1_epi8(0x0F)));
      sc[r][0] = _mm256_permute2x128_si256(s16, s16, 0x00);
      sc[r][1] = _mm256_permute2x128_si256(s16, s16, 0x11);
      isum[r] = _mm256_setzero_si256();
    }
    for (int n = 0; n < 2; ++n) {
      __m256i q[R];
      for (int r = 0; r < R; ++r) q[r] = LoadQ23(b[r]->qs + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const __m256i a = LoadQ23(y[i].qs + 128 * n + 32 * j);
        for (int r = 0; r < R; ++r) {
          const __m256i w = _mm256_and_si256(_mm256_srli_epi16(q[r], 2 * j), m3);
          isum[r] = _mm256_add_epi32(
              isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), Q23ScalePair(sc[r][n], j)));
        }
      }
    }
    const __m256i bsums = LoadQ23(y[i].bsums);
    for (int r = 0; r < R; ++r) {
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[r]->scales));
      const __m256i mins16 =
          _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), _mm_set1_epi8(0x0F)));
      const __m256i msum = _mm256_madd_epi16(bsums, mins16);
      const float d = _cvtsh_ss(b[r]->d.bits), dmin = _cvtsh_ss(b[r]->dmin.bits);  // exact
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y[i].d), _mm256_cvtepi32_ps(isum[r]), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(-dmin * y[i].d), _mm256_cvtepi32_ps(msum), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = Hsum(acc[r]);
}

template <int R>
HWY_INLINE void DotQ3KRows(const std::byte* row, size_t stride, int64_t nb,
                           const quant::block_q8_K* y, float* out, const std::byte* pf) {
  using quant::block_q3_K;
  const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    if (pf != nullptr) PrefetchSpanL2<R * sizeof(block_q3_K)>(pf + i * R * sizeof(block_q3_K));
    const __m256i bsums = LoadQ23(y[i].bsums);
    const block_q3_K* b[R];
    __m256i sc[R][2], isum[R], hm[R];
    for (int r = 0; r < R; ++r) {
      b[r] = reinterpret_cast<const block_q3_K*>(row + r * stride) + i;
      const __m256i s16 = _mm256_cvtepi8_epi16(Q3KScalesVec(b[r]->scales));
      sc[r][0] = _mm256_permute2x128_si256(s16, s16, 0x00);
      sc[r][1] = _mm256_permute2x128_si256(s16, s16, 0x11);
      // the -4 of every code: -4 * sum_g sc_g * bsum_g
      isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                 _mm256_slli_epi32(_mm256_madd_epi16(s16, bsums), 2));
      hm[r] = LoadQ23(b[r]->hmask);
    }
    for (int n = 0; n < 2; ++n) {
      __m256i q[R];
      for (int r = 0; r < R; ++r) q[r] = LoadQ23(b[r]->qs + 32 * n);
      for (int j = 0; j < 4; ++j) {
        const __m256i a = LoadQ23(y[i].qs + 128 * n + 32 * j);
        for (int r = 0; r < R; ++r) {
          // bit (4n + j) of each hmask byte, moved to bit 2: q | hbit << 2
          const __m256i hbit =
              _mm256_and_si256(4 * n + j >= 2 ? _mm256_srli_epi16(hm[r], 4 * n + j - 2)
                                              : _mm256_slli_epi16(hm[r], 2 - (4 * n + j)),
                               four);
          const __m256i w =
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q[r], 2 * j), m3), hbit);
          isum[r] = _mm256_add_epi32(
              isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), Q23ScalePair(sc[r][n], j)));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float d = _cvtsh_ss(b[r]->d.bits);  // F16C: exact
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * y[i].d), _mm256_cvtepi32_ps(isum[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = Hsum(acc[r]);
}
#endif

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#endif  // include guard
