// backend/cpu/iq4-inl.h: the int8 kernels of the non-linear 4-bit i-quants on x86 (AVX2 and
// AVX-512 targets): IQ4_NL's block unpack (its 4-bit codes looked up in ggml's 16-value grid by
// one byte shuffle, giving signed weights that cpu_matmul.cpp's Q8_0-family dot and its
// 512-bit VNNI prefill kernel take as they take Q4_0's), and IQ4_XS's dot against Q8_K
// activations: per 32-element sub-block a maddubs of |w| and the sign-moved activations
// (pairs of at most 2 * 127 * 127, no saturation) and one multiply-add by the sub-block's
// signed 6-bit scale, exact int32 lanes, then one float FMA per block and token. Included once
// per Highway target by cpu_matmul.cpp; only the x86 int8 targets define anything.
#if defined(KILN_BACKEND_CPU_IQ4_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KILN_BACKEND_CPU_IQ4_INL_H_
#undef KILN_BACKEND_CPU_IQ4_INL_H_
#else
#define KILN_BACKEND_CPU_IQ4_INL_H_
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
// The grid in both 128-bit lanes, for _mm256_shuffle_epi8.
HWY_INLINE __m256i IQ4Grid() {
  const __m128i g = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quant::kIQ4NLValues));
  return _mm256_broadcastsi128_si256(g);
}
// 16 packed bytes -> 32 signed weights in element order: low nibbles (elements 0..15), then
// high nibbles (16..31), each replaced by its grid value.
HWY_INLINE __m256i IQ4Values(const uint8_t* qs, __m256i grid) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
  return _mm256_shuffle_epi8(grid, _mm256_and_si256(both, _mm256_set1_epi8(0x0F)));
}

// IQ4_NL block i of a row as the Q8_0 family's unpack: signed weights and the block scale.
HWY_INLINE __m256i UnpackIQ4_NL(const std::byte* row, int64_t i, float* d) {
  const auto* b =
      reinterpret_cast<const quant::block_iq4_nl*>(row + i * sizeof(quant::block_iq4_nl));
  *d = _cvtsh_ss(b->d.bits);  // F16C: exact, f16_to_f32's value
  return IQ4Values(b->qs, IQ4Grid());
}

// IQ4_XS against Q8_K, T tokens: d * y.d * sum_j (ls_j - 32) * sum(w * a) per block.
template <int T>
HWY_INLINE void DotIQ4XS(const std::byte* row, int64_t nb, const quant::block_q8_K* const* ys,
                         float* out) {
  const __m256i grid = IQ4Grid();
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const auto* b =
        reinterpret_cast<const quant::block_iq4_xs*>(row + i * sizeof(quant::block_iq4_xs));
    __m256i isum[T];
    for (int t = 0; t < T; ++t) isum[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const int ls =
          (((b->scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | (((b->scales_h >> (2 * j)) & 3) << 4)) -
          32;
      const __m256i sc = _mm256_set1_epi16(static_cast<int16_t>(ls));
      const __m256i w = IQ4Values(b->qs + 16 * j, grid);
      const __m256i aw = _mm256_sign_epi8(w, w);  // |w| <= 127 as u8
      for (int t = 0; t < T; ++t) {
        const __m256i a = _mm256_sign_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ys[t][i].qs + 32 * j)), w);
        isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, a), sc));
      }
    }
    const float d = _cvtsh_ss(b->d.bits);  // F16C: exact
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
