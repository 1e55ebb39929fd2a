// backend/cpu/cpu_matmul.cpp: weight-matrix × activation kernels. Quantized weights are
// dotted against activations quantized once per call (Q8_0 blocks for Q8_0/Q4_0/Q5_0/MXFP4, Q8_K
// super-blocks for Q4_K/Q5_K/Q6_K) with int8 multiply-adds (AVX2 maddubs, AVX-512 VNNI
// vpdpbusd/vpdpwssd); F32/F16/BF16 weights use f32 FMA after hardware conversion (2+ tokens:
// the register-tiled kernel of cpu_matmul_float.cpp, with this file's DotTile bits), except BF16
// on machines with AVX512_BF16, dotted in bf16 pairs (bf16_pairs.h, MatmulBF16Pairs); other
// types dequantize a block of rows once and reuse it for every token. Each weight block is
// unpacked once per tile of several tokens, which is what makes prefill fast. On AVX-512 VNNI
// Q4_K/Q6_K of one token (decode) take 512-bit one-token kernels and of 2+ tokens (batched
// decode) the v2 batched kernels (below), prefill the kernels of cpu_matmul_kq.cpp, all with the
// plain kernels' bits; so does Q8_0/Q4_0/Q5_0 prefill there (cpu_matmul_q8.cpp, with AMX tiles
// where the machine has AMX-INT8). The Q8_0 family's arithmetic is exact block totals
// (DotQ8Family); the K-quants' is per-lane (the lane layouts below). A job marked portable
// (kernels.h) takes the plain kernels only.
#define HWY_WANT_AVX3_DL 1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_matmul.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/check.h"
#include "cpu_matmul_kq.h"
#include "cpu_matmul_q8.h"
#include "backend/cpu/prefetch.h"
#include "float_dot-inl.h"  // per-target guard: expanded once per Highway target, like this file
#include "iq4-inl.h"        // the same
#include "kq23-inl.h"       // the same
#include "kq_avx2-inl.h"    // the same
#include "kernels.h"
#include "quant/blocks.h"
#include "quant/quant.h"

#ifndef KILN_CPU_MATMUL_ONCE
#define KILN_CPU_MATMUL_ONCE
namespace kiln::cpu {
// Rows per cache block: the weight rows one tile of tokens sweeps stay in L2.
inline int64_t rows_per_block(const WeightMatrix& w) {
  const int64_t bytes = std::max<int64_t>(1, static_cast<int64_t>(w.row_bytes));
  return std::clamp<int64_t>((128 << 10) / bytes, 1, 64);
}
inline int64_t dequant_rows_per_block(const WeightMatrix& w) {
  return std::clamp<int64_t>((64 << 10) / std::max<int64_t>(1, w.n_cols), 1, 16);
}
// Calls of this many tokens or more (below kKRowsMinTok / kKRowsMinTokQ6K) take the v2 batched
// kernels.
constexpr int64_t kKQBatchMinTok = 2;
// Bytes of a thread's scratch the batched Q4_K/Q6_K kernels' activation tile uses (8 tokens:
// aligned quants, bsums, scales, alignment slack).
inline size_t kq_tile_bytes(int64_t nb) {
  return static_cast<size_t>(nb) * 8 * (256 + 32 + 4) + 64;
}
}  // namespace kiln::cpu
#endif

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// ---------------------------------------------------------------- f32 dot tiles
// DF, LoadF32/F16/BF16 and DotTile<T>: float_dot-inl.h.

// A lone token's dot (a decode step) prefetches the weights ahead: a row of a 2048-wide F16
// matrix is one 4 KiB page, where the hardware's stream prefetch stops, so without it every row
// starts cold. On Intel cores kFloatPrefetchBytes ahead into L1 (docs/BENCHMARKS.md, session
// 28: F16 / BF16 decode), elsewhere kMatvecPrefetchBytes ahead into L2 (AMD Zen 4, session 32).
constexpr int64_t kFloatPrefetchBytes = 2048;
// F16/BF16 rows on AVX-512 targets off Intel: each line's prefetch kPrefetchRepeat times
// (kernels.h); measured on Zen 4 only, so the other targets keep one prefetch per chunk.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kHalfPrefetchRepeat = kPrefetchRepeat;
#else
constexpr int kHalfPrefetchRepeat = 0;
#endif

// DotTile<1> for a decode step, with the machine class's prefetch (prefetch.h IntelCores).
template <class L>
HWY_INLINE float DotOne(const L& w, const float* x, int64_t n) {
  constexpr int kRepeat = std::is_same_v<L, LoadF32> ? 0 : kHalfPrefetchRepeat;
  float out;
  if (IntelCores())
    DotTile<1, L, kFloatPrefetchBytes, 3>(w, &x, n, &out);
  else
    DotTile<1, L, kMatvecPrefetchBytes, 2, kRepeat>(w, &x, n, &out);
  return out;
}

template <class L>
void DotTokens(const L& w, const MatmulJob& job, int64_t t0, int64_t t1, int64_t r) {
  const int64_t n = job.w->n_cols, ldy = job.w->n_rows;
  const float* xs[4];
  float out[4];
  for (int64_t t = t0; t < t1; t += 4) {
    const int m = static_cast<int>(std::min<int64_t>(4, t1 - t));
    for (int k = 0; k < m; ++k) xs[k] = job.x + (t + k) * n;
    switch (m) {
      case 4:
        DotTile<4>(w, xs, n, out);
        break;
      case 3:
        DotTile<3>(w, xs, n, out);
        break;
      case 2:
        DotTile<2>(w, xs, n, out);
        break;
      default:  // prefetches change no bits
        out[0] = DotOne(w, xs[0], n);
        break;
    }
    for (int k = 0; k < m; ++k) job.y[(t + k) * ldy + r] = out[k];
  }
}

// Direct f32-family weights: row blocks × token tiles.
template <class Elem, class L>
void MatmulFloat(const MatmulJob& job, int64_t r0, int64_t r1) {
  const WeightMatrix& w = *job.w;
  const int64_t rb = rows_per_block(w);
  constexpr int64_t kTokTile = 64;  // tokens whose rows stay in L1/L2 across a row block
  for (int64_t b0 = r0; b0 < r1; b0 += rb) {
    const int64_t b1 = std::min(r1, b0 + rb);
    for (int64_t t0 = 0; t0 < job.n_tok; t0 += kTokTile) {
      const int64_t t1 = std::min(job.n_tok, t0 + kTokTile);
      for (int64_t r = b0; r < b1; ++r)
        DotTokens(L{reinterpret_cast<const Elem*>(w.row(r).data())}, job, t0, t1, r);
    }
  }
}

#if KILN_BF16_ZIP
// One token through BF16 rows [r0, r1) by zipping (float_dot-inl.h DotBF16Zip: DotTile<1>'s bits,
// with DotOne's prefetch): the activations put in zipped order once per call.
void MatvecBF16One(const MatmulJob& job, int64_t r0, int64_t r1) {
  const WeightMatrix& w = *job.w;
  const int64_t n = w.n_cols;
  thread_local std::vector<float> xz;
  xz.resize(static_cast<size_t>(n));
  ZipActivations(job.x, n, xz.data());
  const bool l1 = IntelCores();  // where the stream is prefetched, as DotOne
  for (int64_t r = r0; r < r1; ++r) {
    const auto* row = reinterpret_cast<const bf16*>(w.row(r).data());
    job.y[r] =
        l1 ? DotBF16Zip<kFloatPrefetchBytes, 3>(row, job.x, xz.data(), n)
           : DotBF16Zip<kMatvecPrefetchBytes, 2, kHalfPrefetchRepeat>(row, job.x, xz.data(), n);
  }
}
#endif

#if KILN_BF16_PAIRS
// BF16 rows [r0, r1) by the pair arithmetic (bf16_pairs.h) against the tokens' bf16 rows
// (ActKind::BF16, encoded once per call): the portable path one scalar step at a time
// (dot_bf16_pairs_ref), else DotPairsBlock two rows at a time with DotOne's prefetch (a lone
// token, as a decode step; 2+ tokens take cpu_matmul_float.cpp's tiles unless portable).
KILN_BF16_PAIRS_NOINLINE void MatmulBF16Pairs(const MatmulJob& job, int64_t r0, int64_t r1) {
  KILN_CHECK(job.xq != nullptr, "BF16 pair kernels: the activations are not encoded as bf16");
  const WeightMatrix& w = *job.w;
  const int64_t n = w.n_cols, ldy = w.n_rows;
  const auto row = [&](int64_t r) { return reinterpret_cast<const bf16*>(w.row(r).data()); };
  const bool l1 = IntelCores();  // where the stream is prefetched, as DotOne
  for (int64_t t = 0; t < job.n_tok; ++t) {
    const bf16* x = PairsToken(job, t);
    float* y = job.y + t * ldy;
    if (job.portable) {
      for (int64_t r = r0; r < r1; ++r) y[r] = dot_bf16_pairs_ref(row(r), x, n);
      continue;
    }
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) {
      const bf16* rows[2] = {row(r), row(r + 1)};
      if (l1)
        DotPairsBlock<2, 1, kFloatPrefetchBytes, 3>(rows, &x, n, y + r);
      else
        DotPairsBlock<2, 1, kMatvecPrefetchBytes, 2, kHalfPrefetchRepeat>(rows, &x, n, y + r);
    }
    if (r < r1) {
      const bf16* rows[1] = {row(r)};
      DotPairsBlock<1, 1>(rows, &x, n, y + r);
    }
  }
}
#endif

// Any type quant::dequantize_row reads: a block of rows is decoded into scratch once.
void MatmulDequant(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  const WeightMatrix& w = *job.w;
  const int64_t rb = dequant_rows_per_block(w);
  for (int64_t b0 = r0; b0 < r1; b0 += rb) {
    const int64_t b1 = std::min(r1, b0 + rb);
    for (int64_t r = b0; r < b1; ++r)
      quant::dequantize_row(w.dtype, w.row(r),
                            std::span<float>(scratch + (r - b0) * w.n_cols, w.n_cols));
    for (int64_t r = b0; r < b1; ++r)
      DotTokens(LoadF32{scratch + (r - b0) * w.n_cols}, job, 0, job.n_tok, r);
  }
}

// ---------------------------------------------------------------- int8 kernels (x86)
#undef KILN_INT8
#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
#define KILN_INT8 1
#else
#define KILN_INT8 0
#endif

#if KILN_INT8
using quant::block_q4_0;
using quant::block_q4_K;
using quant::block_q5_0;
using quant::block_q5_K;
using quant::block_q6_K;
using quant::block_q8_0;
using quant::block_q8_K;

HWY_INLINE __m256i Load32(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// acc += sum over groups of 4 of u8 * s8. The VNNI forms are written as inline asm with an
// explicit EVEX prefix: Highway's AVX3_DL target also enables AVX-VNNI, for which GCC would
// pick the VEX encoding, and AMD Zen 4 has AVX512-VNNI but not AVX-VNNI.
HWY_INLINE __m256i DotU8I8(__m256i acc, __m256i u, __m256i s) {
#if HWY_TARGET == HWY_AVX3_DL
  asm("%{evex%} vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
// acc += pairwise i16 * i16.
HWY_INLINE __m256i DotI16(__m256i acc, __m256i a, __m256i b) {
#if HWY_TARGET == HWY_AVX3_DL
  asm("%{evex%} vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
// Hsum (the 8-lane sum every int8 kernel ends with): float_dot-inl.h.

// Signed 32 weights of one block of the Q8_0 family, element order as in the format.
HWY_INLINE __m256i UnpackQ8_0(const std::byte* row, int64_t i, float* d) {
  const auto* b = reinterpret_cast<const block_q8_0*>(row + i * sizeof(block_q8_0));
  *d = _cvtsh_ss(b->d.bits);  // F16C: exact, f16_to_f32's value in one instruction
  return Load32(b->qs);
}
HWY_INLINE __m256i UnpackQ4_0(const std::byte* row, int64_t i, float* d) {
  const auto* b = reinterpret_cast<const block_q4_0*>(row + i * sizeof(block_q4_0));
  *d = _cvtsh_ss(b->d.bits);  // F16C: exact, f16_to_f32's value in one instruction
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
  return _mm256_sub_epi8(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)), _mm256_set1_epi8(8));
}
HWY_INLINE __m256i UnpackQ5_0(const std::byte* row, int64_t i, float* d) {
  const auto* b = reinterpret_cast<const block_q5_0*>(row + i * sizeof(block_q5_0));
  *d = _cvtsh_ss(b->d.bits);  // F16C: exact, f16_to_f32's value in one instruction
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs));
  const __m256i nib =
      _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1),
                       _mm256_set1_epi8(0x0F));
  uint32_t qh;
  std::memcpy(&qh, b->qh, 4);
  // Byte k gets bit k of qh: spread byte k/8 of qh to byte k, then test bit k%8.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i hi = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                                      _mm256_set1_epi8(0x10));
  return _mm256_sub_epi8(_mm256_or_si256(nib, hi), _mm256_set1_epi8(16));
}

// MXFP4 (ggml type 39): the doubled E2M1 values of kMxfp4Values looked up 16 at a time by
// pshufb (all in [-12, 12], so the Q8_0 family's sign trick holds), scale 2^(e - 128).
HWY_INLINE __m256i UnpackMxfp4(const std::byte* row, int64_t i, float* d) {
  const auto* b = reinterpret_cast<const quant::block_mxfp4*>(row + i * sizeof(quant::block_mxfp4));
  *d = quant::mxfp4_scale_half(b->e);
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quant::kMxfp4Values));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b->qs));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, m4));
  const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

// The Q8_0 family's arithmetic, which every kernel of the family keeps (one-token, batched,
// prefill, AVX2, AVX-512, AMX): per 32-weight block the exact int32 total of the 32 products
// w * y (|total| <= 32 * 128 * 127 < 2^24, so its float is exact), then one
// acc = fma(dw * yd, float(total), acc) per block in block order, from acc = 0. Integer totals
// do not depend on how a kernel groups the products (lanes, tiles, AMX's dot products), so
// the bits depend only on the block order.
// Here the T tokens' lane sums of a block are reduced together, token t's total landing in
// lane t (integer adds: exact), and one 8-wide fma per block updates the T accumulators: lane
// t's arithmetic is the definition's for token t.
// Totals8 (eight vectors' lane totals): kq_avx2-inl.h.
template <int T, __m256i (*Unpack)(const std::byte*, int64_t, float*)>
HWY_INLINE void DotQ8Family(const std::byte* row, int64_t nb, const ActQ8_0* const* ys,
                            float* out) {
  static_assert(T >= 1 && T <= 8);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    float dw;
    const __m256i w = Unpack(row, i, &dw);
    const __m256i aw = _mm256_sign_epi8(w, w);  // |w| as u8 (128 for -128 is fine unsigned)
    __m256i dot[8];
    alignas(32) float dy[8] = {};
    for (int t = 0; t < 8; ++t) {
      if (t >= T) {
        dot[t] = _mm256_setzero_si256();
        continue;
      }
      const ActQ8_0& y = ys[t][i];
      const __m256i a = _mm256_sign_epi8(Load32(y.qs), w);  // moves w's sign onto a
      dot[t] = DotU8I8(_mm256_setzero_si256(), aw, a);
      dy[t] = dw * y.d;
    }
    acc = _mm256_fmadd_ps(_mm256_load_ps(dy), _mm256_cvtepi32_ps(Totals8(dot)), acc);
  }
  alignas(32) float o[8];
  _mm256_store_ps(o, acc);
  for (int t = 0; t < T; ++t) out[t] = o[t];
}

#if HWY_TARGET == HWY_AVX3_DL
// One row through Unpack, for the 512-bit VNNI kernel's packing (cpu_matmul_q8.cpp), which
// then multiplies exactly these quants and scales.
template <__m256i (*Unpack)(const std::byte*, int64_t, float*)>
void UnpackRowQ8(const std::byte* row, int64_t nb, int8_t* q, float* d) {
  for (int64_t i = 0; i < nb; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * i), Unpack(row, i, d + i));
}
// cpu_matmul_q8.cpp; out: each token's DotQ8Family<T, Unpack> bits.
void MatmulQ8Vnni(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch,
                  void (*unpack)(const std::byte*, int64_t, int8_t*, float*));
// cpu_matmul_kq.cpp; Q4_K / Q5_K / Q6_K, out: each token's DotQ45K<T, false / true> or DotQ6K<T>
// bits.
void MatmulKRows16(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch);
// cpu_matmul_kq.cpp, where amx_usable(); out: each token's DotQ45K<T, false> bits.
void MatmulQ4KAmx(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch);
// The same for Q6_K: DotQ6K<T>'s bits.
void MatmulQ6KAmx(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch);
#endif

// ScalesMinsK4 (a Q4_K/Q5_K block's scales and mins as bytes): kq_avx2-inl.h.

// Q4_K (kHigh = false) and Q5_K (kHigh = true) against Q8_K, by exact super-block totals
// (docs/determinism.md): per 256-weight block T1 = sum_j sc_j * sum(q * a) over its 8
// sub-blocks and T2 = sum_j m_j * bsum_j (Q8_K's bsums), both exact int32 (|T1| <= 8 * 63 * 32 *
// 31 * 127 < 2^31), then acc = fma(d * yd, T1, acc) and acc = fma(-dmin * yd, T2, acc) per block
// in block order. T tokens' totals are reduced together (Totals8) into one 8-wide fma each.
template <int T, bool kHigh>
HWY_INLINE void DotQ45K(const std::byte* row, int64_t nb, const block_q8_K* const* ys, float* out) {
  static_assert(T >= 1 && T <= 8);
  using BlockT = std::conditional_t<kHigh, block_q5_K, block_q4_K>;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const auto* b = reinterpret_cast<const BlockT*>(row + i * sizeof(BlockT));
    const float d = f16_to_f32(b->d), dmin = f16_to_f32(b->dmin);
    alignas(16) uint8_t sm[16];
    ScalesMinsK4(b->scales, sm);
    const __m128i mins8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8));
    const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins8, mins8));  // m[k/2]
    __m256i isum[8], msum[8];
    for (int t = 0; t < 8; ++t) isum[t] = msum[t] = _mm256_setzero_si256();
    [[maybe_unused]] __m256i hbits;
    if constexpr (kHigh) hbits = Load32(b->qh);
    for (int j = 0; j < 4; ++j) {
      const __m256i q4 = Load32(b->qs + 32 * j);
      for (int half = 0; half < 2; ++half) {
        __m256i w =
            half == 0 ? _mm256_and_si256(q4, m4) : _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
        if constexpr (kHigh) {
          w = _mm256_or_si256(
              w, _mm256_and_si256(_mm256_slli_epi16(hbits, 4), _mm256_set1_epi8(0x10)));
          hbits = _mm256_srli_epi16(hbits, 1);
        }
        const int sub = 2 * j + half;
        const __m256i sc = _mm256_set1_epi16(sm[sub]);
        for (int t = 0; t < T; ++t) {
          const __m256i a = Load32(ys[t][i].qs + 32 * sub);
          isum[t] = DotI16(isum[t], _mm256_maddubs_epi16(w, a), sc);
        }
      }
    }
    alignas(32) float dy[8] = {}, ny[8] = {};
    for (int t = 0; t < T; ++t) {
      const block_q8_K& y = ys[t][i];
      msum[t] = _mm256_madd_epi16(Load32(y.bsums), mins16);
      dy[t] = d * y.d;
      ny[t] = -dmin * y.d;
    }
    acc = _mm256_fmadd_ps(_mm256_load_ps(dy), _mm256_cvtepi32_ps(Totals8(isum)), acc);
    acc = _mm256_fmadd_ps(_mm256_load_ps(ny), _mm256_cvtepi32_ps(Totals8(msum)), acc);
  }
  alignas(32) float o[8];
  _mm256_store_ps(o, acc);
  for (int t = 0; t < T; ++t) out[t] = o[t];
}

// Q6_K against Q8_K, by exact super-block totals (docs/determinism.md): per 256-weight block
// T = sum_g sc_g * sum((q - 32) * a) over its 16 groups, exact in int32 (|T| <= 16 * 128 * 16 *
// 32 * 128 < 2^31; the -32 through Q8_K's bsums), then acc = fma(d * yd, T, acc) per block in
// block order; T tokens' totals reduced together (Totals8).
template <int T>
HWY_INLINE void DotQ6K(const std::byte* row, int64_t nb, const block_q8_K* const* ys, float* out) {
  static_assert(T >= 1 && T <= 8);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const auto* b = reinterpret_cast<const block_q6_K*>(row + i * sizeof(block_q6_K));
    const float d = f16_to_f32(b->d);
    const __m256i sc_all =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
    __m256i isum[8];
    for (int t = 0; t < 8; ++t)  // the -32 offset: sum_g sc_g * 32 * bsum_g
      isum[t] = t < T ? _mm256_sub_epi32(
                            _mm256_setzero_si256(),
                            _mm256_slli_epi32(_mm256_madd_epi16(sc_all, Load32(ys[t][i].bsums)), 5))
                      : _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = Load32(b->ql + 64 * h), ql1 = Load32(b->ql + 64 * h + 32);
      const __m256i qh = Load32(b->qh + 32 * h);
      __m256i w4[4];
      Q6KGroups(ql0, ql1, qh, w4);
      for (int g = 0; g < 4; ++g) {
        const int sub = 4 * h + g;  // 32 elements, scales[2*sub] then scales[2*sub + 1]
        const __m256i sc = _mm256_set_m128i(_mm_set1_epi16(b->scales[2 * sub + 1]),
                                            _mm_set1_epi16(b->scales[2 * sub]));
        for (int t = 0; t < T; ++t) {
          const __m256i a = Load32(ys[t][i].qs + 32 * sub);
          isum[t] = DotI16(isum[t], _mm256_maddubs_epi16(w4[g], a), sc);
        }
      }
    }
    alignas(32) float dy[8] = {};
    for (int t = 0; t < T; ++t) dy[t] = d * ys[t][i].d;
    acc = _mm256_fmadd_ps(_mm256_load_ps(dy), _mm256_cvtepi32_ps(Totals8(isum)), acc);
  }
  alignas(32) float o[8];
  _mm256_store_ps(o, acc);
  for (int t = 0; t < T; ++t) out[t] = o[t];
}

// Runs Kernel<T> over row blocks × token tiles. AVX-512 targets have 32 vector registers,
// enough for 8 tokens' accumulators, so each unpacked weight block serves 8 tokens there.
#if HWY_TARGET == HWY_AVX2
constexpr int kIntTile = 4;
#else
constexpr int kIntTile = 8;
#endif
template <class Act, template <int> class Kernel>
void MatmulInt(const MatmulJob& job, int64_t r0, int64_t r1, int64_t block_elems) {
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / block_elems, ldy = w.n_rows;
  const int64_t rb = rows_per_block(w);
  const Act* ys[kIntTile];
  float out[kIntTile];
  for (int64_t b0 = r0; b0 < r1; b0 += rb) {
    const int64_t b1 = std::min(r1, b0 + rb);
    for (int64_t t0 = 0; t0 < job.n_tok; t0 += kIntTile) {
      const int m = static_cast<int>(std::min<int64_t>(kIntTile, job.n_tok - t0));
      for (int k = 0; k < m; ++k)
        ys[k] = reinterpret_cast<const Act*>(job.xq + (t0 + k) * job.xq_row_bytes);
      for (int64_t r = b0; r < b1; ++r) {
        const std::byte* wr = w.row(r).data();
        // A partial tile runs as pieces of 4, 2, 1 tokens.
        int k = 0;
        if constexpr (kIntTile == 8) {
          if (m == 8) {
            Kernel<8>::run(wr, nb, ys, out);
            k = 8;
          }
        }
        for (; m - k >= 4; k += 4) Kernel<4>::run(wr, nb, ys + k, out + k);
        for (; m - k >= 2; k += 2) Kernel<2>::run(wr, nb, ys + k, out + k);
        for (; k < m; ++k) Kernel<1>::run(wr, nb, ys + k, out + k);
        for (int j = 0; j < m; ++j) job.y[(t0 + j) * ldy + r] = out[j];
      }
    }
  }
}

template <int T>
struct KQ8_0 {
  static void run(const std::byte* w, int64_t nb, const ActQ8_0* const* y, float* o) {
    DotQ8Family<T, UnpackQ8_0>(w, nb, y, o);
  }
};
template <int T>
struct KQ4_0 {
  static void run(const std::byte* w, int64_t nb, const ActQ8_0* const* y, float* o) {
    DotQ8Family<T, UnpackQ4_0>(w, nb, y, o);
  }
};
template <int T>
struct KQ5_0 {
  static void run(const std::byte* w, int64_t nb, const ActQ8_0* const* y, float* o) {
    DotQ8Family<T, UnpackQ5_0>(w, nb, y, o);
  }
};
template <int T>
struct KMxfp4 {
  static void run(const std::byte* w, int64_t nb, const ActQ8_0* const* y, float* o) {
    DotQ8Family<T, UnpackMxfp4>(w, nb, y, o);
  }
};
template <int T>
struct KQ4_K {
  static void run(const std::byte* w, int64_t nb, const block_q8_K* const* y, float* o) {
    DotQ45K<T, false>(w, nb, y, o);
  }
};
template <int T>
struct KQ5_K {
  static void run(const std::byte* w, int64_t nb, const block_q8_K* const* y, float* o) {
    DotQ45K<T, true>(w, nb, y, o);
  }
};
template <int T>
struct KQ6_K {
  static void run(const std::byte* w, int64_t nb, const block_q8_K* const* y, float* o) {
    DotQ6K<T>(w, nb, y, o);
  }
};
template <int T>
struct KQ2_K {
  static void run(const std::byte* w, int64_t nb, const block_q8_K* const* y, float* o) {
    DotQ2K<T>(w, nb, y, o);
  }
};
template <int T>
struct KQ3_K {
  static void run(const std::byte* w, int64_t nb, const block_q8_K* const* y, float* o) {
    DotQ3K<T>(w, nb, y, o);
  }
};
template <int T>
struct KIQ4_NL {
  static void run(const std::byte* w, int64_t nb, const ActQ8_0* const* y, float* o) {
    DotQ8Family<T, UnpackIQ4_NL>(w, nb, y, o);
  }
};
template <int T>
struct KIQ4_XS {
  static void run(const std::byte* w, int64_t nb, const block_q8_K* const* y, float* o) {
    DotIQ4XS<T>(w, nb, y, o);
  }
};
// The software prefetch span of a one-token kernel call over `rows` rows from row r (see
// MatvecKOne): kMatvecPrefetchBytes ahead of the group, or none where the matrix is strided (a
// column slice: its rows are not back to back, so the span would fetch the gaps) or the span
// would pass the matrix's end.
inline const std::byte* GroupPrefetch(const WeightMatrix& w, int64_t r, int64_t rows) {
  if (w.strided()) return nullptr;
  const std::byte* p = w.row(r).data() + kMatvecPrefetchBytes;
  return p + rows * w.stride() <= w.bytes.data() + w.bytes.size() ? p : nullptr;
}
// Rows [r0, r1) of a one-token Q2_K (kQ2) or Q3_K job: kq23-inl.h's row kernels, two rows per
// call with the prefetch span of the other one-token kernels (rows back to back only), a last
// row alone.
template <bool kQ2>
void MatvecQ23(const MatmulJob& job, int64_t r0, int64_t r1) {
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 256;
  const auto* y = reinterpret_cast<const block_q8_K*>(job.xq);
  const size_t stride = w.stride();
  const auto dot = [&](auto rows, int64_t r, const std::byte* pf) {
    constexpr int R = decltype(rows)::value;
    if constexpr (kQ2)
      DotQ2KRows<R>(w.row(r).data(), stride, nb, y, job.y + r, pf);
    else
      DotQ3KRows<R>(w.row(r).data(), stride, nb, y, job.y + r, pf);
  };
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2) {
    const std::byte* pf = GroupPrefetch(w, r, 2);
    dot(std::integral_constant<int, 2>{}, r, pf);
  }
  if (r < r1) dot(std::integral_constant<int, 1>{}, r, nullptr);
}
#if HWY_TARGET == HWY_AVX2
template <int T>
struct KQ4_KAvx2 {
  static void run(const std::byte* w, int64_t nb, const block_q8_K* const* y, float* o) {
    DotQ4KAvx2<T>(w, nb, y, o, kMatvecPrefetchBytes);
  }
};
template <int T>
struct KQ6_KAvx2 {
  static void run(const std::byte* w, int64_t nb, const block_q8_K* const* y, float* o) {
    DotQ6KAvx2<T>(w, nb, y, o, kMatvecPrefetchBytes);
  }
};
// One token on AVX2: rows in pairs (a single row left over) through a row-pair kernel of
// kq_avx2-inl.h, dot(R, rows, nb, y, out, pf) with R = 2 or 1 as std::integral_constant; each
// row gets the plain one-token kernel's bits. Rows are prefetched kMatvecPrefetchBytes ahead,
// as the AVX-512 one-token kernels' are.
template <class Act, class Dot>
void MatvecPairsAvx2(const MatmulJob& job, int64_t r0, int64_t r1, int64_t block_elems, Dot dot) {
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / block_elems, pf = kMatvecPrefetchBytes;
  const auto* y = reinterpret_cast<const Act*>(job.xq);
  int64_t r = r0;
  for (; r + 2 <= r1; r += 2) {
    const std::byte* rows[2] = {w.row(r).data(), w.row(r + 1).data()};
    dot(std::integral_constant<int, 2>{}, rows, nb, y, job.y + r, pf);
  }
  if (r < r1) {
    const std::byte* row = w.row(r).data();
    dot(std::integral_constant<int, 1>{}, &row, nb, y, job.y + r, pf);
  }
}
template <bool kQ4>
void MatvecKAvx2(const MatmulJob& job, int64_t r0, int64_t r1) {
  MatvecPairsAvx2<block_q8_K>(job, r0, r1, 256, [](auto R, auto... a) {
    if constexpr (kQ4)
      DotQ4KAvx2Rows<decltype(R)::value>(a...);
    else
      DotQ6KAvx2Rows<decltype(R)::value>(a...);
  });
}
// The Q8_0 family against one token on AVX2, R = 1 or 2 rows at a time: each row DotQ8Family<1,
// Unpack>'s block totals and FMAs in block order, so its bits (tests/ops MatmulQ8One); the
// token's block is loaded once for the rows, the two rows' lane sums are reduced together
// (horizontal adds, then the two halves: [r0 r1 r0 r1]) into one 4-wide fma, and the prefetch
// span walks kMatvecPrefetchBytes ahead as in the other one-token kernels.
template <int R, __m256i (*Unpack)(const std::byte*, int64_t, float*), size_t kBlockBytes>
HWY_INLINE void DotQ8FamAvx2Rows(const std::byte* const* rows, int64_t nb, const ActQ8_0* y,
                                 float* out, int64_t pf) {
  static_assert(R == 1 || R == 2);
  __m128 acc = _mm_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    if (pf) PrefetchSpanL2<R * kBlockBytes>(rows[0] + pf + R * i * int64_t{kBlockBytes});
    const __m256i a = Load32(y[i].qs);
    const float yd = y[i].d;
    __m256i dot[2];
    float dy[2];
    for (int k = 0; k < R; ++k) {
      float dw;
      const __m256i w = Unpack(rows[k], i, &dw);
      dot[k] = DotU8I8(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
      dy[k] = dw * yd;
    }
    if constexpr (R == 1) {
      dot[1] = dot[0];
      dy[1] = dy[0];
    }
    const __m256i h = _mm256_hadd_epi32(dot[0], dot[1]);
    const __m256i h2 = _mm256_hadd_epi32(h, h);
    const __m128i totals =
        _mm_add_epi32(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
    acc = _mm_fmadd_ps(_mm_setr_ps(dy[0], dy[1], dy[0], dy[1]), _mm_cvtepi32_ps(totals), acc);
  }
  alignas(16) float o[4];
  _mm_store_ps(o, acc);
  for (int k = 0; k < R; ++k) out[k] = o[k];
}
template <__m256i (*Unpack)(const std::byte*, int64_t, float*), size_t kBlockBytes>
void MatvecQ8Avx2(const MatmulJob& job, int64_t r0, int64_t r1) {
  MatvecPairsAvx2<ActQ8_0>(job, r0, r1, 32, [](auto R, auto... a) {
    DotQ8FamAvx2Rows<decltype(R)::value, Unpack, kBlockBytes>(a...);
  });
}
#endif

#if HWY_TARGET == HWY_AVX3_DL
// ---------------------------------------------------------------- K-quant lane sums (VNNI)
// The plain Q4_K/Q6_K kernels are bound by the two multiply pipes (maddubs + vpdpwssd per 32
// products, plus the per-token tail), not by memory. In the one-token and batched kernels below
// 512-bit vpdpbusd multiplies the unsigned quants (Q4_K nibbles 0..15, Q6_K 0..63) of two
// sub-blocks straight against the signed activations: each lane holds the sum of 4 products,
// the same 4 as a plain-kernel lane, and |sum| <= 4 * 63 * 127 < 2^15. Two such results are
// paired as words (no carry between them) and one vpdpwssd applies the scales of 4 sub-blocks:
// 12 multiply-pipe slots per block and token instead of 16. Integer sums are exact in any
// order, so after folding the two 256-bit halves (Fold512) every int32 lane equals the plain
// kernel's; the float steps are the plain kernel's ops in the same order, so each output is the
// plain kernel's bits.
//
// Lane layout. Q4_K: one 64-byte load of qs yields [sub 4p | sub 4p+2] (low nibbles) and
// [sub 4p+1 | sub 4p+3] (high nibbles) for p = 0, 1, and the activations are ordered to match;
// dword j of the scale words is sc[2j] | sc[2j+1] << 16, pair p's lanes 0..7 take dword 2p and
// lanes 8..15 dword 2p+1. Q6_K (quants in their own order, the activations' too): each half h
// holds sub-blocks 4h..4h+3; (4h, 4h+1) and (4h+2, 4h+3) fill one register each, so lanes 0..7
// carry sub-blocks 4h | 4h+2 << 16 and lanes 8..15 4h+1 | 4h+3 << 16. Lanes 0..3 of a
// sub-block take its first 16-element scale, lanes 4..7 the second, as in the plain kernel:
// dword lane L takes scale words 8h + L/4 and 8h + L/4 + 4.

// Word 2L: the low word of lane L of `even`; word 2L+1: that of `odd` (both fit int16).
HWY_INLINE __m512i PairWords(__m512i even, __m512i odd) {
  return _mm512_mask_blend_epi16(0xAAAAAAAAu, even, _mm512_slli_epi32(odd, 16));
}
HWY_INLINE __m256i Fold512(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}
HWY_INLINE __m512i Load64(const void* p) { return _mm512_loadu_si512(p); }
// Hsum of the two 8-lane halves.
HWY_INLINE void HsumPair(__m512 v, float* lo, float* hi) {
  *lo = Hsum(_mm512_castps512_ps256(v));
  *hi = Hsum(_mm512_extractf32x8_ps(v, 1));
}

// Highway's AVX3_DL target string names AVX-VNNI but not AVX512-VNNI, which the 512-bit forms
// need; the kernels are called once per row, so they need not inline into their callers.
#define KILN_VNNI512 __attribute__((target(HWY_TARGET_STR ",avx512vnni"), noinline))
// Helpers inlined into those kernels (same target, so clang may inline them).
#define KILN_VNNI512_INLINE \
  __attribute__((target(HWY_TARGET_STR ",avx512vnni"), always_inline)) inline
// PrefetchSpanL2 / PrefetchSpanL1 (prefetch.h): what the one-token and v2 batched kernels
// issue per block step (see MatvecKOne). PrefetchSpanL1 is the one-token form for the 4-bit
// blocks of the Q8_0 family on Intel cores (IntelCores): into L1 they decode faster on
// the Intel Xeon dev box, while Q8_0 and the K-quant kernels decode slower with it
// (docs/BENCHMARKS.md, session 28).
// A Q4_K or Q5_K block's 8 six-bit scales and 8 mins (its `scales` bytes) as bytes [sc0..7 | m0..7]
// (ScalesMinsK4 in two 64-bit words: lo = [sc0..3 | m0..3], hi = [sc4..7 | m4..7], then one
// shuffle). sc_even (if given): sc0 + sc2 + sc4 + sc6, from the same words (bytes of at most 63
// each, so lo + hi has no carry between bytes).
KILN_VNNI512_INLINE __m128i ScalesMins8(const uint8_t* scales, int32_t* sc_even = nullptr) {
  uint64_t a;
  uint32_t c;
  std::memcpy(&a, scales, 8);
  std::memcpy(&c, scales + 8, 4);
  const uint64_t lo = a & 0x3f3f3f3f3f3f3f3fULL;
  const uint64_t c2 = uint64_t{c} | (uint64_t{c} << 28);  // c | (c >> 4) << 32, nibble-masked below
  const uint64_t hi = (c2 & 0x0f0f0f0f0f0f0f0fULL) | (((a >> 6) & 0x0303030303030303ULL) << 4);
  if (sc_even != nullptr) {
    const uint64_t t = lo + hi;  // byte 0: sc0 + sc4, byte 2: sc2 + sc6
    *sc_even = static_cast<int32_t>((t & 0xFF) + ((t >> 16) & 0xFF));
  }
  return _mm_shuffle_epi32(_mm_set_epi64x(static_cast<int64_t>(hi), static_cast<int64_t>(lo)),
                           _MM_SHUFFLE(3, 1, 2, 0));
}

// ---------------------------------------------------------------- single-token K-quants (VNNI)
// A decode step's matvec (one token) through the lane sums above, reading the token's Q8_K row
// in place (no tile: a tile fill would be paid per call, and decode calls are many and small,
// e.g. the 256x1024 expert slices of a MoE layer). The plain one-token kernels are bound by
// their instructions rather than by memory, so a Q4_K_M decode was compute-bound with them;
// these take a half to a third of their time per block (bench/matvec_bench BM_KQOneOnOff;
// figures in docs/BENCHMARKS.md). The lane sums and float steps above, hence the plain kernels'
// bits (tests/ops MatmulKQOne).
//
// Q4_K: a 64-byte load of qs yields [sub 4p | sub 4p+2] (low nibbles) and [sub 4p+1 | sub 4p+3]
// (high nibbles); `aq` is the token's quants in that order (ReorderQ4KOne, once per call, 64-byte
// aligned), ys its Q8_K row for the scales and bsums. The block heads (scales, mins, d, dmin) of
// the 4 rows a call takes are decoded together (DecodeHeads; exact, the values of ScalesMinsK4
// and f16_to_f32), and per block the rows' exact totals (the plain kernels' T1 and T2,
// docs/determinism.md) are reduced together, one 4-wide FMA per term, in block order: the plain
// kernel's arithmetic per row. Q6_K: R rows of a call the same way (Totals8), where R changes no
// bits (tests/ops MatmulKQOne: R = 4 and R = 1 rows of a call against the plain kernel).

// Q4_K's low words carry this offset: 0 <= kLowBias + da < 2^15 for any Q4_K lane sum da
// (|da| <= 4 * 15 * 128 = 7680); Q5_K's codes reach 31, so |da| <= 4 * 31 * 128 = 15872 and its
// low words carry kLowBias5.
constexpr int32_t kLowBias = 8192;
constexpr int32_t kLowBias5 = 16384;

// Q5_K: the fifth bit of sub-block j's element l is bit j of qh[l]. A 64-byte load of qs covers
// elements l = 0..31 of two sub-blocks per nibble (see below), so [qh | qh] rotated right by
// (j - 4) mod 32 in each dword puts bit j of every byte at bit 4 of that byte (a dword rotation
// moves no other bit of any byte to a bit 4: those would need j - 4 = b - 4 + 8c for a byte bit
// b != j), and 0x10 masks it. The counts per 256-bit half, for the sub-blocks of load p:
// low nibbles [4p | 4p + 2], high nibbles [4p + 1 | 4p + 3].
KILN_VNNI512_INLINE __m512i Q5HighRot(int j_lo_half, int j_hi_half) {
  return _mm512_inserti64x4(_mm512_set1_epi32((j_lo_half - 4) & 31),
                            _mm256_set1_epi32((j_hi_half - 4) & 31), 1);
}

// One row's block against the token's quants: the 16 int32 lane sums, whose total is the plain
// kernel's T1 plus 8 * kBias * (sc0 + sc2 + sc4 + sc6): each low word adds kBias times its scale,
// sub-block 4p's in lanes 0..7 and 4p + 2's in lanes 8..15 (the lanes themselves differ from the
// plain kernel's; the caller takes the bias back out of the total). sc: the block's scales as
// DotQ45KOne lays them out. The sub-block pairs go into words as in DotQ4KBatch (vpshldd of db and
// the low bias, then vpdpbusd adds da: one op where PairWords takes a shift and a blend). kHigh:
// Q5_K (the codes' fifth bits OR-ed in: unsigned codes 0..31, so the same vpdpbusd).
template <bool kHigh>
KILN_VNNI512_INLINE __m512i
Q45KOneLaneSums(const std::conditional_t<kHigh, block_q5_K, block_q4_K>* b,
                const __m512i (&a_lo)[2], const __m512i (&a_hi)[2], const __m512i (&sc)[2]) {
  constexpr int32_t kBias = kHigh ? kLowBias5 : kLowBias;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i bias_hi = _mm512_set1_epi32(kBias << 16);  // the bias as a high word
  __m512i isum = _mm512_setzero_si512();
  [[maybe_unused]] __m512i qh;
  if constexpr (kHigh) qh = _mm512_broadcast_i64x4(Load32(b->qh));
  for (int p = 0; p < 2; ++p) {
    const __m512i q = Load64(b->qs + 64 * p);
    __m512i wl = _mm512_and_si512(q, m4), wh = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    if constexpr (kHigh) {  // w | (rotated qh & 0x10): vpternlogd A | (B & C)
      const __m512i m10 = _mm512_set1_epi8(0x10);
      wl = _mm512_ternarylogic_epi32(wl, _mm512_rorv_epi32(qh, Q5HighRot(4 * p, 4 * p + 2)), m10,
                                     0xF8);
      wh = _mm512_ternarylogic_epi32(wh, _mm512_rorv_epi32(qh, Q5HighRot(4 * p + 1, 4 * p + 3)),
                                     m10, 0xF8);
    }
    const __m512i db = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wh, a_hi[p]);
    const __m512i pw = _mm512_dpbusd_epi32(_mm512_shldi_epi32(db, bias_hi, 16), wl, a_lo[p]);
    isum = _mm512_dpwssd_epi32(isum, pw, sc[p]);
  }
  return isum;
}

// The heads of 4 rows' blocks, decoded together. A Q4_K / Q5_K block starts with 16 bytes, d,
// dmin and the 12 scale bytes; unit u of `h` holds row u's, as dwords D0 (d | dmin << 16), D1,
// D2, D3 (scale bytes 0..3, 4..7, 8..11). Per unit the 6-bit scales and mins are, as dwords,
// [D1 & 0x3f, (D3 & 0x0f) | (D1 >> 2 & 0x30), D2 & 0x3f, (D3 >> 4 & 0x0f) | (D2 >> 2 & 0x30)]
// = [sc0..3 | sc4..7 | m0..3 | m4..7] bytes: ScalesMins8's bytes for the 4 rows in 6 ops (the
// 32-bit shifts move no bit a mask keeps across a byte).
struct Q45KHeads {
  __m512i sc;     // row u's sc0..7 as words in dwords 4u..4u+3 (dword 4u + j: sc2j | sc2j+1 << 16)
  __m512i m_sum;  // unit u: row u's 4 dword partial sums of m_j * (bsum 2j + bsum 2j+1)
  __m512i even;   // unit u: dword 0 sc0 + sc2, dword 1 sc4 + sc6 (the bias's scales)
  __m256 dm;      // [d0..d3 | -dmin0..3] as floats
};
KILN_VNNI512_INLINE Q45KHeads DecodeHeads(__m512i h, __m512i bsum_pairs) {
  const __m512i p = _mm512_srlv_epi32(_mm512_shuffle_epi32(h, _MM_PERM_DCDB),
                                      _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0, 0, 4)));
  const __m512i q = _mm512_srli_epi32(_mm512_shuffle_epi32(h, _MM_PERM_CCBB), 2);
  const __m512i lo_mask =
      _mm512_broadcast_i32x4(_mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  const __m512i hi_mask = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  const __m512i sm = _mm512_ternarylogic_epi32(_mm512_and_si512(p, lo_mask), q, hi_mask, 0xF8);
  // Scale bytes of the 4 rows, then min bytes, as 8-byte groups.
  const __m512i g = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), sm);
  Q45KHeads o;
  o.sc = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(g));
  o.m_sum = _mm512_madd_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(g, 1)), bsum_pairs);
  o.even =
      _mm512_dpbusd_epi32(_mm512_setzero_si512(), sm,
                          _mm512_broadcast_i32x4(_mm_setr_epi32(0x00010001, 0x00010001, 0, 0)));
  // Words 0 and 1 of each unit: d, dmin (F16C: exact, f16_to_f32's values); dmin negated first,
  // as -dmin * y.d in the plain kernel.
  const __m128i dd = _mm512_castsi512_si128(_mm512_permutexvar_epi16(
      _mm512_zextsi128_si512(_mm_setr_epi16(0, 8, 16, 24, 1, 9, 17, 25)), h));
  o.dm = _mm256_xor_ps(_mm256_cvtph_ps(dd), _mm256_setr_ps(0, 0, 0, 0, -0.0f, -0.0f, -0.0f, -0.0f));
  return o;
}

// The heads of 4 rows' block i (d, dmin, scales; DecodeHeads) against the token's block i.
template <class BlockT>
KILN_VNNI512_INLINE Q45KHeads HeadsAt(const std::byte* const* rows, int64_t i,
                                      const block_q8_K& y) {
  const auto head = [&](int u) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[u] + i * sizeof(BlockT)));
  };
  __m512i h = _mm512_castsi128_si512(head(0));
  h = _mm512_inserti32x4(h, head(1), 1);  // immediates, also unoptimised (the ASan build)
  h = _mm512_inserti32x4(h, head(2), 2);
  h = _mm512_inserti32x4(h, head(3), 3);
  // bsum 2j + bsum 2j+1 as 8 words (|sum| <= 32 * 128: no overflow), in every unit.
  const __m128i* bs = reinterpret_cast<const __m128i*>(y.bsums);
  return DecodeHeads(
      h, _mm512_broadcast_i32x4(_mm_hadd_epi16(_mm_loadu_si128(bs), _mm_loadu_si128(bs + 1))));
}

// A block's step once its 4 rows' lane sums v are in: the rows' exact totals reduced together
// (integer adds, exact in any order) to [T1 of rows 0..3 | T2 of rows 0..3], then acc lane u +=
// d_u * y.d * T1_u, then += -dmin_u * y.d * T2_u: the plain kernel's two FMAs.
template <int kBiasShift>
KILN_VNNI512_INLINE __m128 BlockTotalsFma(const __m512i (&v)[4], const Q45KHeads& hd, float yd,
                                          __m128 acc) {
  // c, unit k: [row 0's unit-k sum, row 1's, row 2's, row 3's]; the units then fold to T1.
  const __m512i c01 =
      _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i c23 =
      _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  __m512i c = _mm512_add_epi32(_mm512_unpacklo_epi64(c01, c23), _mm512_unpackhi_epi64(c01, c23));
  // The bias: sc0 + sc2 of each row into unit 0, sc4 + sc6 into unit 1 (summed by the fold).
  c = _mm512_sub_epi32(
      c,
      _mm512_slli_epi32(
          _mm512_maskz_permutexvar_epi32(
              0x00FF, _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), hd.even),
          kBiasShift));
  // T2 partials, unit k: partial k of rows 0..3.
  const __m512i mt = _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), hd.m_sum);
  const __m256i c2 = Fold512(c), m2 = Fold512(mt);
  const __m256i tot = _mm256_add_epi32(_mm256_permute2x128_si256(c2, m2, 0x20),
                                       _mm256_permute2x128_si256(c2, m2, 0x31));
  const __m256 dmy = _mm256_mul_ps(hd.dm, _mm256_set1_ps(yd));  // [d * y.d | -dmin * y.d]
  const __m256 totf = _mm256_cvtepi32_ps(tot);
  acc = _mm_fmadd_ps(_mm256_castps256_ps128(dmy), _mm256_castps256_ps128(totf), acc);
  return _mm_fmadd_ps(_mm256_extractf128_ps(dmy, 1), _mm256_extractf128_ps(totf, 1), acc);
}

// Q4_K (kHigh = false) or Q5_K (true), 4 rows: the plain kernel's T1/T2 arithmetic
// (docs/determinism.md) per row, in block order. Software-pipelined: block i's lane sums are
// issued between block i + 1's head decoding and block i - 1's totals, so that no step waits
// on the one before it in program order: one block's chain from the loads to its FMAs is long,
// and the blocks overlapped less in order (measured faster this way on Zen 4, session 33). Rows
// past n_out repeat a row (the caller's), their lanes unused.
template <bool kHigh>
KILN_VNNI512 void DotQ45KOne(const std::byte* const* rows, int64_t nb, const int8_t* aq,
                             const block_q8_K* ys, float* out, int n_out, const std::byte* pf) {
  using BlockT = std::conditional_t<kHigh, block_q5_K, block_q4_K>;
  // The bias's total, 8 * kBias * (sc0 + sc2 + sc4 + sc6) (Q45KOneLaneSums), as a shift.
  constexpr int kBiasShift = kHigh ? 17 : 16;
  static_assert(int32_t{1} << kBiasShift == 8 * (kHigh ? kLowBias5 : kLowBias));
  // Sub-block pair p's lanes 0..7 take a row's scale dword 2p, lanes 8..15 dword 2p + 1
  // (Q45KOneLaneSums' layout); row u's dwords are 4u..4u+3 of Q45KHeads::sc.
  const __m512i sc_idx0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);
  const __m512i four = _mm512_set1_epi32(4), two = _mm512_set1_epi32(2);
  __m128 acc = _mm_setzero_ps();  // row u in lane u
  Q45KHeads hd = HeadsAt<BlockT>(rows, 0, ys[0]), hp{};
  __m512i vp[4];
  for (int64_t i = 0; i < nb; ++i) {
    if (pf != nullptr) PrefetchSpanL2<4 * sizeof(BlockT)>(pf + i * 4 * sizeof(BlockT));
    Q45KHeads hn{};
    if (i + 1 < nb) hn = HeadsAt<BlockT>(rows, i + 1, ys[i + 1]);
    const __m512i a_lo[2] = {_mm512_load_si512(aq + i * 256),
                             _mm512_load_si512(aq + i * 256 + 128)};
    const __m512i a_hi[2] = {_mm512_load_si512(aq + i * 256 + 64),
                             _mm512_load_si512(aq + i * 256 + 192)};
    __m512i v[4];
    __m512i idx = sc_idx0;
    for (int u = 0; u < 4; ++u) {
      const __m512i sc[2] = {_mm512_permutexvar_epi32(idx, hd.sc),
                             _mm512_permutexvar_epi32(_mm512_add_epi32(idx, two), hd.sc)};
      v[u] = Q45KOneLaneSums<kHigh>(reinterpret_cast<const BlockT*>(rows[u]) + i, a_lo, a_hi, sc);
      idx = _mm512_add_epi32(idx, four);
    }
    if (i > 0) acc = BlockTotalsFma<kBiasShift>(vp, hp, ys[i - 1].d, acc);
    for (int u = 0; u < 4; ++u) vp[u] = v[u];
    hp = hd;
    hd = hn;
  }
  acc = BlockTotalsFma<kBiasShift>(vp, hp, ys[nb - 1].d, acc);
  alignas(16) float o[4];
  _mm_store_ps(o, acc);
  for (int u = 0; u < n_out; ++u) out[u] = o[u];
}

// The token's nb blocks of quants into DotQ45KOne's order at 64-byte aligned `scratch`.
int8_t* ReorderQ4KOne(const block_q8_K* ys, int64_t nb, float* scratch) {
  auto* q = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t{63});
  for (int64_t i = 0; i < nb; ++i)
    for (int p = 0; p < 2; ++p)
      for (int h = 0; h < 4;
           ++h)  // slot h of the 128-byte pair block holds sub 4p + {0, 2, 1, 3}[h]
        std::memcpy(q + i * 256 + 128 * p + 32 * h,
                    ys[i].qs + 32 * (4 * p + (h >> 1) + 2 * (h & 1)), 32);
  return q;
}

// Q6_K: the quants' own order matches the activation's (see the lane layout), so y.qs is read as
// it is. The -32 offset (sum_g sc_g * 32 * bsum_g) is taken off after the fold (integers: the
// same int32 as adding it first); an even R pairs rows as DotQ45KOne does.
// One row's block: its lane sums without the offset, and the block's 16 scales as words.
KILN_VNNI512_INLINE __m512i Q6KOneLaneSums(const block_q6_K* b, const __m512i (&ya)[2],
                                           const __m512i (&yb)[2], __m256i* sc_all) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  alignas(64) static constexpr int16_t kScIdx[2][32] = {
      {0, 4, 0, 4, 0, 4, 0, 4, 1, 5, 1, 5, 1, 5, 1, 5,
       2, 6, 2, 6, 2, 6, 2, 6, 3, 7, 3, 7, 3, 7, 3, 7},
      {8,  12, 8,  12, 8,  12, 8,  12, 9,  13, 9,  13, 9,  13, 9,  13,
       10, 14, 10, 14, 10, 14, 10, 14, 11, 15, 11, 15, 11, 15, 11, 15}};
  *sc_all = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
  const __m512i sc512 = _mm512_castsi256_si512(*sc_all);
  const __m512i sc[2] = {_mm512_permutexvar_epi16(_mm512_load_si512(kScIdx[0]), sc512),
                         _mm512_permutexvar_epi16(_mm512_load_si512(kScIdx[1]), sc512)};
  __m512i isum = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512i ql = Load64(b->ql + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(Load32(b->qh + 32 * h));
    const __m512i wa = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                       _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30));
    const __m512i wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                       _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30));
    const __m512i da = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, ya[h]);
    const __m512i db = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb, yb[h]);
    isum = _mm512_dpwssd_epi32(isum, PairWords(da, db), sc[h]);
  }
  return isum;
}

// Software-pipelined as DotQ45KOne: block i's totals and FMA are issued after block i + 1's lane
// sums, so the chain from a block's loads to its FMA overlaps the next block's (faster hot in
// L2/L3, bench/matvec_bench BM_KQOneOnOff; docs/BENCHMARKS.md, session 37).
template <int R>
KILN_VNNI512 void DotQ6KOne(const std::byte* row, size_t stride, int64_t nb, const block_q8_K* ys,
                            float* out, const std::byte* pf = nullptr) {
  static_assert(R >= 1 && R <= 8);
  __m256 acc = _mm256_setzero_ps();  // row r in lane r
  __m256i vp[8];
  alignas(32) float dyp[8] = {};
  for (int k = 0; k < 8; ++k) vp[k] = _mm256_setzero_si256();
  for (int64_t i = 0; i < nb; ++i) {
    if (pf != nullptr) PrefetchSpanL2<R * sizeof(block_q6_K)>(pf + i * R * sizeof(block_q6_K));
    const block_q8_K& y = ys[i];
    const __m512i ya[2] = {Load64(y.qs), Load64(y.qs + 128)},
                  yb[2] = {Load64(y.qs + 64), Load64(y.qs + 192)};
    const __m256i bsums = Load32(y.bsums);
    __m256i v[8];
    for (int k = 0; k < 8; ++k) v[k] = _mm256_setzero_si256();
    alignas(32) float dy[8] = {};
    for (int r = 0; r < R; ++r) {
      const auto* b =
          reinterpret_cast<const block_q6_K*>(row + r * stride + i * sizeof(block_q6_K));
      dy[r] = _cvtsh_ss(b->d.bits) * y.d;  // F16C: exact, f16_to_f32's value
      __m256i sc_all;
      const __m512i isum = Q6KOneLaneSums(b, ya, yb, &sc_all);
      const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc_all, bsums), 5);
      v[r] = _mm256_sub_epi32(Fold512(isum), off);
    }
    if (i > 0) acc = _mm256_fmadd_ps(_mm256_load_ps(dyp), _mm256_cvtepi32_ps(Totals8(vp)), acc);
    for (int k = 0; k < 8; ++k) {
      vp[k] = v[k];
      dyp[k] = dy[k];
    }
  }
  acc = _mm256_fmadd_ps(_mm256_load_ps(dyp), _mm256_cvtepi32_ps(Totals8(vp)), acc);
  alignas(32) float o[8];
  _mm256_store_ps(o, acc);
  for (int r = 0; r < R; ++r) out[r] = o[r];
}

// One-token kernels read each weight byte once, straight from DRAM, and the hardware prefetchers
// alone leave the core's read stream short of what it can pull: on the Zen 5 dev box a qwen3moe ~1B
// decode (expert slices of 147 KB, rows of 576 / 840 bytes) ran at 45-52 % of the streaming read
// bandwidth on one thread and 1.5x faster with the lines a few KB ahead prefetched (kiln bench,
// 2026-12-01: 96-108 -> 148-174 t/s at 1 thread; 2 threads 191 -> 260 t/s). Distance:
// kMatvecPrefetchBytes. How: each block step of a kernel call prefetches the next R * block bytes
// of the stream kMatvecPrefetchBytes in front of its row group into L2 (PrefetchSpanL2), so
// prefetches go out at the rate the kernel reads. Prefetching a row group's lines at its start into
// L1 instead (the first way, deleted since) stalls the core once the L1 miss buffers fill: on the
// Zen 4 VM (2026-12-02) decode ran at about half the read bandwidth it reaches this way
// (docs/BENCHMARKS.md). Rows per one-token kernel call: enough independent chains to hide the
// multiply-add latency on a row of a single block (the MoE down slices are 256 wide), few enough
// for the registers.
constexpr int kOneRows = 4;
// Rows [r0, r1) of a one-token job through DotQ45KOne / DotQ6KOne (Block: block_q4_K,
// block_q5_K or block_q6_K); `scratch` holds kq_tile_bytes(nb) (Q4_K's and Q5_K's reordered
// quants use nb * 256 + 64 of them).
template <class Block>
void MatvecKOne(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  constexpr bool kQ6K = std::is_same_v<Block, block_q6_K>;
  constexpr bool kQ5K = std::is_same_v<Block, block_q5_K>;
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 256;
  const auto* y = reinterpret_cast<const block_q8_K*>(job.xq);
  const int8_t* aq = kQ6K ? nullptr : ReorderQ4KOne(y, nb, scratch);
  const size_t rb = w.stride();  // row r + k starts k strides after row r
  if constexpr (kQ6K) {
    int64_t r = r0;
    for (; r + kOneRows <= r1; r += kOneRows)
      DotQ6KOne<kOneRows>(w.row(r).data(), rb, nb, y, job.y + r, GroupPrefetch(w, r, kOneRows));
    for (; r < r1; ++r) DotQ6KOne<1>(w.row(r).data(), rb, nb, y, job.y + r);
  } else {
    static_assert(kOneRows == 4);  // DotQ45KOne's rows
    for (int64_t r = r0; r < r1; r += kOneRows) {
      const int n = static_cast<int>(std::min<int64_t>(kOneRows, r1 - r));
      const std::byte* rows[kOneRows];
      for (int k = 0; k < kOneRows; ++k) rows[k] = w.row(r + std::min(k, n - 1)).data();
      const std::byte* pf = n == kOneRows ? GroupPrefetch(w, r, kOneRows) : nullptr;
      DotQ45KOne<kQ5K>(rows, nb, aq, y, job.y + r, n, pf);
    }
  }
}

// ---------------------------------------------------------------- batched K-quants, v2 (VNNI)
// The lane sums above for 2+ tokens (the decode of several streams, below kKRowsMinTok /
// kKRowsMinTokQ6K tokens) with little work around them: with the sums alone, the decode of a few
// streams was bound by instructions on the Zen 5 dev box and, once cheaper, by DRAM latency,
// which the software prefetch below hides. Around the sums:
// - the per-block decoding is DotQ45KOne's (F16C, 64-bit scale words, no stack round trip);
// - per row and block the T tokens' exact totals are reduced together (Fold512, Totals8) and
//   one 8-wide FMA per term serves them all, against the tokens' scales (one masked load);
// - Q4_K pairs its two sub-block sums into words by an offset instead of a blend (kLowBias);
// - two rows per call (up to kBatchTwoRowsMaxTok tokens) share the activation loads.
// Each total is the plain kernel's (integer sums are exact in any order) and the float steps
// are its steps in its order, hence its bits (tests/ops MatmulKQBatch).

// The batched kernels' activation tile (built per call, or per row block past 8 tokens): the
// tokens' Q8_K quants copied once into 64-byte aligned rows, for Q4_K ordered as its weights
// unpack (see the lane layout above), so every activation load is aligned, and the 8 tokens'
// scales d * y.d come from one vector multiply per block. Tile slot k of block i:
// q[(i*8 + k)*256], bsums[(i*8 + k)*16], yd[i*8 + k].
struct KTile {
  const int8_t* q;
  const int16_t* bsums;
  const float* yd;
};

// Fills the tile with tokens [0, m) (m <= 8) of `ys`, the quants in Q4_K's pair order or (Q6_K)
// as they are; unused slots' scales are zero.
template <bool kQ4KOrder>
void FillKTile(const block_q8_K* const* ys, int m, int64_t nb, std::byte* scratch, KTile* tile) {
  auto* q = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t{63});
  auto* bs = reinterpret_cast<int16_t*>(q + nb * 8 * 256);
  auto* yd = reinterpret_cast<float*>(bs + nb * 8 * 16);
  for (int64_t i = 0; i < nb; ++i) {
    for (int k = 0; k < 8; ++k) yd[i * 8 + k] = k < m ? ys[k][i].d : 0.0f;
    for (int k = 0; k < m; ++k) {
      const block_q8_K& y = ys[k][i];
      int8_t* dst = q + (i * 8 + k) * 256;
      if constexpr (kQ4KOrder) {
        for (int p = 0; p < 2; ++p)
          for (int h = 0; h < 4;
               ++h)  // h: slot in the 128-byte pair block; sub = 4p + {0, 2, 1, 3}[h]
            std::memcpy(dst + 128 * p + 32 * h, y.qs + 32 * (4 * p + (h >> 1) + 2 * (h & 1)), 32);
      } else {
        std::memcpy(dst, y.qs, 256);
      }
      std::memcpy(bs + (i * 8 + k) * 16, y.bsums, sizeof(y.bsums));
    }
  }
  *tile = KTile{q, bs, yd};
}

// kLowBias (Q4_K's low-word offset, see DotQ4KBatch) is defined with the one-token kernels.

// The batched kernels' per-token lane sums, always_inline with the kernels' target (these were
// lambdas, which clang compiles without the enclosing function's target attribute).
KILN_VNNI512_INLINE __m512i Q4KBatchLaneSums(const int8_t* at, const __m512i (&wlo)[2],
                                             const __m512i (&whi)[2], const __m512i (&sc)[2],
                                             __m512i neg_k, __m512i bias_hi) {
  __m512i isum = neg_k;
  for (int p = 0; p < 2; ++p) {
    const __m512i db =
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), whi[p], _mm512_load_si512(at + 128 * p + 64));
    const __m512i pw = _mm512_dpbusd_epi32(_mm512_shldi_epi32(db, bias_hi, 16), wlo[p],
                                           _mm512_load_si512(at + 128 * p));
    isum = _mm512_dpwssd_epi32(isum, pw, sc[p]);
  }
  return isum;
}
KILN_VNNI512_INLINE __m512i Q6KBatchLaneSums(const int8_t* at, const __m512i (&wa)[2],
                                             const __m512i (&wb)[2], const __m512i (&sc)[2]) {
  __m512i isum = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512i da =
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa[h], _mm512_load_si512(at + 128 * h));
    const __m512i db =
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb[h], _mm512_load_si512(at + 128 * h + 64));
    isum = _mm512_dpwssd_epi32(isum, PairWords(da, db), sc[h]);
  }
  return isum;
}

// Tile tokens k0..k0+T-1 x R rows `stride` bytes apart; out[r * 8 + t - k0]. Per row and
// block, the T tokens' exact totals (Fold512 then Totals8) and one 8-wide fma per term for all
// of them: the plain kernel's arithmetic (DotQ45K), hence its bits.
template <int T, int R>
KILN_VNNI512 void DotQ4KBatch(const std::byte* row, size_t stride, int64_t nb, KTile tile, int k0,
                              float* out, const std::byte* pf) {
  static_assert(T >= 1 && T <= 8);
  constexpr __mmask8 kTok = static_cast<__mmask8>((1u << T) - 1);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i sc_idx0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);
  const __m512i sc_idx1 = _mm512_inserti64x4(_mm512_set1_epi32(2), _mm256_set1_epi32(3), 1);
  const __m512i bias_hi = _mm512_set1_epi32(kLowBias << 16);  // kLowBias as a high word
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const int8_t* qi = tile.q + (i * 8 + k0) * 256;
    const int16_t* bi = tile.bsums + (i * 8 + k0) * 16;
    const __m256 y8 = _mm256_maskz_loadu_ps(kTok, tile.yd + i * 8 + k0);  // the tokens' y.d
    if (pf != nullptr) PrefetchSpanL2<R * sizeof(block_q4_K)>(pf + i * R * sizeof(block_q4_K));
    for (int r = 0; r < R; ++r) {
      const auto* b =
          reinterpret_cast<const block_q4_K*>(row + r * stride + i * sizeof(block_q4_K));
      uint32_t dd;
      std::memcpy(&dd, &b->d, 4);  // d, dmin: adjacent f16s
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dd)));
      const float d = _mm_cvtss_f32(dm), dmin = _mm_cvtss_f32(_mm_movehdup_ps(dm));
      int32_t sc_even;
      const __m128i sm8 = ScalesMins8(b->scales, &sc_even);                      // [sc0..7 | m0..7]
      const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm8, sm8));  // m[k/2]
      const __m512i sc16 = _mm512_zextsi128_si512(_mm_cvtepu8_epi16(sm8));
      const __m512i sc[2] = {_mm512_permutexvar_epi32(sc_idx0, sc16),
                             _mm512_permutexvar_epi32(sc_idx1, sc16)};
      __m512i wlo[2], whi[2];
      for (int p = 0; p < 2; ++p) {
        const __m512i qv = Load64(b->qs + 64 * p);
        wlo[p] = _mm512_and_si512(qv, m4);
        whi[p] = _mm512_and_si512(_mm512_srli_epi16(qv, 4), m4);
      }
      // PairWords(da, db) without the blend: (db << 16 | kLowBias) + da has da + kLowBias in
      // its low word (no borrow, see kLowBias) and db in its high word, so vpdpwssd adds the
      // pair's scaled sums plus kLowBias * the low word's scale; summed over a block's four
      // pairs that extra is kLowBias * (sc0 + sc2 + sc4 + sc6), which neg_k takes back out, so
      // each token's lanes total its exact T1 (integer adds, exact in any order).
      const __m512i neg_k = _mm512_maskz_set1_epi32(0x00FF, -kLowBias * sc_even);
      __m256i iv[8], mv[8];
      for (int t = 0; t < 8; ++t) {
        if (t >= T) {
          iv[t] = mv[t] = _mm256_setzero_si256();
          continue;
        }
        iv[t] = Fold512(Q4KBatchLaneSums(qi + t * 256, wlo, whi, sc, neg_k, bias_hi));
        mv[t] = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(bi + 16 * t)),
                                  mins16);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(d), y8),
                               _mm256_cvtepi32_ps(Totals8(iv)), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(-dmin), y8),
                               _mm256_cvtepi32_ps(Totals8(mv)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float o[8];
    _mm256_store_ps(o, acc[r]);
    for (int t = 0; t < T; ++t) out[r * 8 + t] = o[t];
  }
}

// Q6_K: the lane sums above, the -32 offset (sum_g sc_g * 32 * bsum_g) taken off each token's
// folded lanes, then the tokens' exact totals as DotQ6K takes them.
template <int T, int R>
KILN_VNNI512 void DotQ6KBatch(const std::byte* row, size_t stride, int64_t nb, KTile tile, int k0,
                              float* out, const std::byte* pf) {
  static_assert(T >= 1 && T <= 8);
  constexpr __mmask8 kTok = static_cast<__mmask8>((1u << T) - 1);
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i shl = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i shr = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  alignas(64) static constexpr int16_t kScIdx[2][32] = {
      {0, 4, 0, 4, 0, 4, 0, 4, 1, 5, 1, 5, 1, 5, 1, 5,
       2, 6, 2, 6, 2, 6, 2, 6, 3, 7, 3, 7, 3, 7, 3, 7},
      {8,  12, 8,  12, 8,  12, 8,  12, 9,  13, 9,  13, 9,  13, 9,  13,
       10, 14, 10, 14, 10, 14, 10, 14, 11, 15, 11, 15, 11, 15, 11, 15}};
  const __m512i sc_idx0 = _mm512_load_si512(kScIdx[0]), sc_idx1 = _mm512_load_si512(kScIdx[1]);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const int8_t* qi = tile.q + (i * 8 + k0) * 256;
    const int16_t* bi = tile.bsums + (i * 8 + k0) * 16;
    const __m256 y8 = _mm256_maskz_loadu_ps(kTok, tile.yd + i * 8 + k0);  // the tokens' y.d
    if (pf != nullptr) PrefetchSpanL2<R * sizeof(block_q6_K)>(pf + i * R * sizeof(block_q6_K));
    for (int r = 0; r < R; ++r) {
      const auto* b =
          reinterpret_cast<const block_q6_K*>(row + r * stride + i * sizeof(block_q6_K));
      const float d = _cvtsh_ss(b->d.bits);  // F16C: f16_to_f32's value
      const __m256i sc_all =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b->scales)));
      const __m512i sc512 = _mm512_castsi256_si512(sc_all);
      const __m512i sc[2] = {_mm512_permutexvar_epi16(sc_idx0, sc512),
                             _mm512_permutexvar_epi16(sc_idx1, sc512)};
      __m512i wa[2], wb[2];
      for (int h = 0; h < 2; ++h) {
        const __m512i ql = Load64(b->ql + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(Load32(b->qh + 32 * h));
        wa[h] = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                _mm512_and_si512(_mm512_sllv_epi16(qh, shl), m30));
        wb[h] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                _mm512_and_si512(_mm512_srlv_epi16(qh, shr), m30));
      }
      __m256i iv[8];
      for (int t = 0; t < 8; ++t) {
        if (t >= T) {
          iv[t] = _mm256_setzero_si256();
          continue;
        }
        const __m256i off = _mm256_slli_epi32(
            _mm256_madd_epi16(sc_all,
                              _mm256_load_si256(reinterpret_cast<const __m256i*>(bi + 16 * t))),
            5);
        iv[t] = _mm256_sub_epi32(Fold512(Q6KBatchLaneSums(qi + t * 256, wa, wb, sc)), off);
      }
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(d), y8),
                               _mm256_cvtepi32_ps(Totals8(iv)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float o[8];
    _mm256_store_ps(o, acc[r]);
    for (int t = 0; t < T; ++t) out[r * 8 + t] = o[t];
  }
}

// Up to this many tokens two rows share a kernel call. More tokens: where the tile of all of
// them fits in L1 (nb <= kBatchL1MaxBlocks: 8 tokens x 320 bytes per block) one row per call
// (two rows' accumulators leave too few registers: BM_KQBatchOnOff at 8 tokens on 5632 x
// 2048, 1 thread, one row 1.15x the v1 tiled kernels (since deleted), two rows 0.95x); wider
// rows, two rows per call in pieces of 4 tokens, so each piece's tile stays in L1 (2048 x 5632
// at 8 tokens: 1.2x the tiled kernels, one row per call 0.85-1.0x).
constexpr int kBatchTwoRowsMaxTok = 4;
constexpr int64_t kBatchL1MaxBlocks = 12;
// Tokens [0, T) of the tile (T <= 8) against rows r .. r+R-1 (R <= 2); out[rr * 8 + t] for
// row r + rr. pf (rows back to back only; nullptr: none): the R rows' bytes from there are
// prefetched over the calls' block steps, once (the first piece's call).
template <bool kQ4K, int R, int T>
HWY_INLINE void DotKBatchRows(const std::byte* wr, size_t stride, int64_t nb, KTile tile,
                              float* out, const std::byte* pf) {
  const auto dot = [&]<int U, int S>(const std::byte* w, int k0, float* o, const std::byte* p) {
    if constexpr (kQ4K)
      DotQ4KBatch<U, S>(w, stride, nb, tile, k0, o, p);
    else
      DotQ6KBatch<U, S>(w, stride, nb, tile, k0, o, p);
  };
  if constexpr (R == 1 || T <= kBatchTwoRowsMaxTok) {
    dot.template operator()<T, R>(wr, 0, out, pf);
  } else if (nb > kBatchL1MaxBlocks) {
    constexpr int kRest = T - kBatchTwoRowsMaxTok;
    float o[2 * 8];
    dot.template operator()<kBatchTwoRowsMaxTok, R>(wr, 0, out, pf);
    dot.template operator()<kRest, R>(wr, kBatchTwoRowsMaxTok, o, nullptr);
    for (int rr = 0; rr < R; ++rr)
      for (int t = 0; t < kRest; ++t) out[rr * 8 + kBatchTwoRowsMaxTok + t] = o[rr * 8 + t];
  } else {
    // one row per call: row rr's call prefetches the rr-th row's worth (stride == row bytes)
    for (int rr = 0; rr < R; ++rr)
      dot.template operator()<T, 1>(wr + rr * stride, 0, out + rr * 8,
                                    pf != nullptr ? pf + rr * stride : nullptr);
  }
}
template <bool kQ4K, int R>
HWY_INLINE void DotKBatchPieces(const WeightMatrix& w, int64_t r, int64_t nb, KTile tile, int m,
                                float* out, const std::byte* pf) {
  const std::byte* wr = w.row(r).data();
  const size_t stride = w.stride();
  switch (m) {
    case 1:
      return DotKBatchRows<kQ4K, R, 1>(wr, stride, nb, tile, out, pf);
    case 2:
      return DotKBatchRows<kQ4K, R, 2>(wr, stride, nb, tile, out, pf);
    case 3:
      return DotKBatchRows<kQ4K, R, 3>(wr, stride, nb, tile, out, pf);
    case 4:
      return DotKBatchRows<kQ4K, R, 4>(wr, stride, nb, tile, out, pf);
    case 5:
      return DotKBatchRows<kQ4K, R, 5>(wr, stride, nb, tile, out, pf);
    case 6:
      return DotKBatchRows<kQ4K, R, 6>(wr, stride, nb, tile, out, pf);
    case 7:
      return DotKBatchRows<kQ4K, R, 7>(wr, stride, nb, tile, out, pf);
    default:
      return DotKBatchRows<kQ4K, R, 8>(wr, stride, nb, tile, out, pf);
  }
}

// Rows [r0, r1) of a job of 2+ tokens through the v2 kernels. Up to 8 tokens (decode of several
// streams) fill the tile once per call; more tokens go row block by row block as MatmulInt
// does, so the weights stay in L2 across token tiles, refilling the tile per (row block, token
// tile), which costs about 1/rows_per_block of the arithmetic. Rows two at a time, each pair's
// lines kMatvecPrefetchBytes ahead prefetched as in MatvecKOne (once the arithmetic is cheap
// enough the hardware prefetchers alone leave the cores waiting on DRAM: serve_bench's 4-wide
// decode step 50 ms without, 30 ms with 2-8 KB, 1-token steps ~21 ms). `scratch` holds
// kq_tile_bytes(nb).
template <bool kQ4K>
void MatmulKBatch(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 256, ldy = w.n_rows;
  const int64_t rb = job.n_tok <= 8 ? r1 - r0 : rows_per_block(w);
  const size_t stride = w.stride();
  const block_q8_K* ys[8];
  float out[2 * 8];
  KTile tile;
  for (int64_t b0 = r0; b0 < r1; b0 += rb) {
    const int64_t b1 = std::min(r1, b0 + rb);
    for (int64_t t0 = 0; t0 < job.n_tok; t0 += 8) {
      const int m = static_cast<int>(std::min<int64_t>(8, job.n_tok - t0));
      for (int k = 0; k < m; ++k)
        ys[k] = reinterpret_cast<const block_q8_K*>(job.xq + (t0 + k) * job.xq_row_bytes);
      FillKTile<kQ4K>(ys, m, nb, reinterpret_cast<std::byte*>(scratch), &tile);
      int64_t r = b0;
      for (; r + 2 <= b1; r += 2) {
        const std::byte* pf = GroupPrefetch(w, r, 2);
        DotKBatchPieces<kQ4K, 2>(w, r, nb, tile, m, out, pf);
        for (int rr = 0; rr < 2; ++rr)
          for (int j = 0; j < m; ++j) job.y[(t0 + j) * ldy + r + rr] = out[rr * 8 + j];
      }
      for (; r < b1; ++r) {
        DotKBatchPieces<kQ4K, 1>(w, r, nb, tile, m, out, nullptr);
        for (int j = 0; j < m; ++j) job.y[(t0 + j) * ldy + r] = out[j];
      }
    }
  }
}

// ---------------------------------------------------------------- single-token Q8_0 family (VNNI)
// A decode step's matvec for the 32-weight block types (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4), four
// rows at a time, each row in one 128-bit unit: a block's register `lo` holds elements 0..15 of
// rows A, B, C, D (one unit each), `hi` elements 16..31, and the token's block is broadcast to
// match. The weights unpack biased to unsigned (w + k: k = 128, the 4-bit types' tables shifted
// so the lookup adds it; Q4_0's codes are w + 8 as they stand), and two vpdpbusd (lo, then hi)
// leave each dword lane exactly the sum of its 8 products (w + k) * y, so the 4 lanes of a unit
// plus -k * (the sum of the block's 32 activation quants; Q8QuadActs, once per call) sum to the
// row's block total (integer adds, exact; |lane| < 2^17). Two in-unit shuffle-and-adds and one
// permute give [A B C D], and one 4-wide fma(dw * yd, float(total), acc) per block, in block
// order, gives each row the plain kernel's bits (tests/ops MatmulQ8One). (Reducing four blocks'
// registers at once takes fewer instructions but decoded slower from memory: docs/BENCHMARKS.md,
// session 26.) Rows past the matrix's end of a last group repeat its last row.

// Unpacks of 4 rows' block i: lo/hi as above (w + 128 as u8), d = [dA, dB, dC, dD].
using Q8QuadUnpack = void (*)(const std::byte* const* rows, int64_t i, __m512i* lo, __m512i* hi,
                              __m128* d);
// A 4-bit code's signed value plus 128, as a byte.
constexpr std::array<uint8_t, 16> Biased(const int8_t (&v)[16]) {
  std::array<uint8_t, 16> b{};
  for (int k = 0; k < 16; ++k) b[k] = static_cast<uint8_t>(v[k] + 128);
  return b;
}
alignas(16) constexpr std::array<uint8_t, 16> kIQ4NLBiased = Biased(quant::kIQ4NLValues);
alignas(16) constexpr std::array<uint8_t, 16> kMxfp4Biased = Biased(quant::kMxfp4Values);
template <class Block>
KILN_VNNI512_INLINE const Block* BlockAt(const std::byte* row, int64_t i) {
  return reinterpret_cast<const Block*>(row + i * sizeof(Block));
}
// The 16 code bytes of 4 blocks, one per unit.
template <class Block>
KILN_VNNI512_INLINE __m512i CodesQuad(const Block* const* b) {
  __m512i q = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b[0]->qs)));
  q = _mm512_inserti32x4(q, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[1]->qs)), 1);
  q = _mm512_inserti32x4(q, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[2]->qs)), 2);
  return _mm512_inserti32x4(q, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b[3]->qs)), 3);
}
// Four f16 scales as [dA, dB, dC, dD] (F16C: exact, f16_to_f32's values).
KILN_VNNI512_INLINE __m128 HalfQuad(f16 a, f16 b, f16 c, f16 d) {
  const uint64_t bits =
      uint64_t{a.bits} | uint64_t{b.bits} << 16 | uint64_t{c.bits} << 32 | uint64_t{d.bits} << 48;
  return _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<int64_t>(bits)));
}
// Two f16 scales as [dA, dB, 0, 0] (the IQ4_XS kernel below).
KILN_VNNI512_INLINE __m128 HalfPair(f16 a, f16 b) {
  return _mm_cvtph_ps(_mm_cvtsi32_si128(a.bits | (b.bits << 16)));
}
template <class Block>
KILN_VNNI512_INLINE void BlocksAt(const std::byte* const* rows, int64_t i, const Block** b) {
  for (int k = 0; k < 4; ++k) b[k] = BlockAt<Block>(rows[k], i);
}
KILN_VNNI512_INLINE void QuadQ4_0(const std::byte* const* rows, int64_t i, __m512i* lo, __m512i* hi,
                                  __m128* d) {
  const block_q4_0* b[4];
  BlocksAt(rows, i, b);
  const __m512i q = CodesQuad(b), m = _mm512_set1_epi8(0x0F);
  *lo = _mm512_and_si512(q, m);  // the codes themselves: w + 8 (kQ8QuadBias<QuadQ4_0>)
  *hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m);
  *d = HalfQuad(b[0]->d, b[1]->d, b[2]->d, b[3]->d);
}
KILN_VNNI512_INLINE void QuadIQ4_NL(const std::byte* const* rows, int64_t i, __m512i* lo,
                                    __m512i* hi, __m128* d) {
  const quant::block_iq4_nl* b[4];
  BlocksAt(rows, i, b);
  const __m512i q = CodesQuad(b), m = _mm512_set1_epi8(0x0F);
  const __m512i grid = _mm512_broadcast_i32x4(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NLBiased.data())));
  *lo = _mm512_shuffle_epi8(grid, _mm512_and_si512(q, m));
  *hi = _mm512_shuffle_epi8(grid, _mm512_and_si512(_mm512_srli_epi16(q, 4), m));
  *d = HalfQuad(b[0]->d, b[1]->d, b[2]->d, b[3]->d);
}
KILN_VNNI512_INLINE void QuadMxfp4(const std::byte* const* rows, int64_t i, __m512i* lo,
                                   __m512i* hi, __m128* d) {
  const quant::block_mxfp4* b[4];
  BlocksAt(rows, i, b);
  const __m512i q = CodesQuad(b), m = _mm512_set1_epi8(0x0F);
  const __m512i table = _mm512_broadcast_i32x4(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(kMxfp4Biased.data())));
  *lo = _mm512_shuffle_epi8(table, _mm512_and_si512(q, m));
  *hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(q, 4), m));
  *d = _mm_setr_ps(quant::mxfp4_scale_half(b[0]->e), quant::mxfp4_scale_half(b[1]->e),
                   quant::mxfp4_scale_half(b[2]->e), quant::mxfp4_scale_half(b[3]->e));
}
KILN_VNNI512_INLINE void QuadQ8_0(const std::byte* const* rows, int64_t i, __m512i* lo, __m512i* hi,
                                  __m128* d) {
  const block_q8_0* b[4];
  BlocksAt(rows, i, b);
  const __m512i ab =
      _mm512_inserti64x4(_mm512_castsi256_si512(Load32(b[0]->qs)), Load32(b[1]->qs), 1);
  const __m512i ce =
      _mm512_inserti64x4(_mm512_castsi256_si512(Load32(b[2]->qs)), Load32(b[3]->qs), 1);
  const __m512i k = _mm512_set1_epi8(static_cast<char>(0x80));  // w + 128 as u8
  *lo = _mm512_xor_si512(
      _mm512_permutex2var_epi64(ab, _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), ce), k);
  *hi = _mm512_xor_si512(
      _mm512_permutex2var_epi64(ab, _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15), ce), k);
  *d = HalfQuad(b[0]->d, b[1]->d, b[2]->d, b[3]->d);
}
// Any type through its one-row unpack (Q5_0): [A | B], [C | D] regrouped by halves.
template <__m256i (*Unpack)(const std::byte*, int64_t, float*)>
KILN_VNNI512_INLINE void QuadOf(const std::byte* const* rows, int64_t i, __m512i* lo, __m512i* hi,
                                __m128* d) {
  float da, db, dc, dd;
  const __m256i a = Unpack(rows[0], i, &da), b = Unpack(rows[1], i, &db);
  const __m256i c = Unpack(rows[2], i, &dc), e = Unpack(rows[3], i, &dd);
  const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  const __m512i ce = _mm512_inserti64x4(_mm512_castsi256_si512(c), e, 1);
  const __m512i k = _mm512_set1_epi8(static_cast<char>(0x80));  // w + 128 as u8
  *lo = _mm512_xor_si512(_mm512_shuffle_i64x2(ab, ce, _MM_SHUFFLE(2, 0, 2, 0)), k);
  *hi = _mm512_xor_si512(_mm512_shuffle_i64x2(ab, ce, _MM_SHUFFLE(3, 1, 3, 1)), k);
  *d = _mm_setr_ps(da, db, dc, dd);
}

// The offset k a Quad adds to each weight to make it an unsigned byte: 8 for Q4_0 (its codes
// as they are), 128 for the others.
template <Q8QuadUnpack Quad>
constexpr int kQ8QuadBias = 128;
template <>
constexpr int kQ8QuadBias<QuadQ4_0> = 8;

// Per block of the token, once per call (not once per row group): -k * (the sum of its 32
// quants), what turns the products of the biased weights into those of the weights, added to
// each row's block total after the lane reduction (integer adds: exact in any order); and, for
// the 4-bit types (kQ8QuadActs), quants 0..15 (lo) and 16..31 (hi) broadcast to every unit, which
// the step then loads where broadcasts from memory would take the shuffle units that the 4-bit
// unpacks keep busy. Q8_0, bound by memory rather than by those units, decoded slower with the
// copies (measured; their L1 footprint is the likely cause), so it broadcasts (docs/BENCHMARKS.md,
// session 33).
struct alignas(64) QuadAct {
  int8_t lo[64];
  int8_t hi[64];
};
template <size_t kBlockBytes>
constexpr bool kQ8QuadActs = kBlockBytes <= 18;
// Only the 512-bit vpdpbusd: Highway's AVX3_DL target string also enables AVX-VNNI, so GCC
// encodes a 128/256-bit vpdpbusd there as the VEX form, which AVX-512 CPUs without AVX-VNNI
// (Zen 4) do not have (SIGILL); scripts/check-isa (ctest isa.NoUncheckedInstructionsInKiln)
// fails on any VEX-encoded VNNI instruction in the kiln binary. acts: null, or nb entries.
template <int kBias>
KILN_VNNI512 void Q8QuadActs(const ActQ8_0* ys, int64_t nb, int32_t* bias, QuadAct* acts) {
  const __m512i k = _mm512_set1_epi8(static_cast<char>(kBias));
  for (int64_t i = 0; i < nb; ++i) {
    const __m512i s8 =  // k * the quants, 4 to a lane (exact int32 sums)
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), k, _mm512_zextsi256_si512(Load32(ys[i].qs)));
    bias[i] = -_mm512_reduce_add_epi32(s8);
    if (acts == nullptr) continue;
    const auto* yq = reinterpret_cast<const __m128i*>(ys[i].qs);
    _mm512_store_si512(acts[i].lo, _mm512_broadcast_i32x4(_mm_loadu_si128(yq)));
    _mm512_store_si512(acts[i].hi, _mm512_broadcast_i32x4(_mm_loadu_si128(yq + 1)));
  }
}

// One block: each unit's 4 lanes (the row's lane sums, before the bias) and the rows' dw * yd.
template <Q8QuadUnpack Quad, bool kActs>
KILN_VNNI512_INLINE __m512i Q8QuadBlock(const std::byte* const* rows, int64_t i, const ActQ8_0* ys,
                                        const QuadAct* acts, __m128* dy) {
  __m512i lo, hi;
  __m128 d;
  Quad(rows, i, &lo, &hi, &d);
  *dy = _mm_mul_ps(d, _mm_set1_ps(ys[i].d));
  __m512i ylo, yhi;
  if constexpr (kActs) {
    ylo = _mm512_load_si512(acts[i].lo);
    yhi = _mm512_load_si512(acts[i].hi);
  } else {
    const auto* yq = reinterpret_cast<const __m128i*>(ys[i].qs);
    ylo = _mm512_broadcast_i32x4(_mm_loadu_si128(yq));
    yhi = _mm512_broadcast_i32x4(_mm_loadu_si128(yq + 1));
  }
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, ylo), hi, yhi);
}

// A block's step once its lane sums v are in: the 4 rows' totals (plus the block's bias) and
// acc += dy * float(total).
KILN_VNNI512_INLINE __m128 Q8QuadTotalsFma(__m512i v, __m128 dy, int32_t bias, __m128 acc) {
  // Lane 0 of each unit, after the two in-unit adds: [A B C D].
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12);
  v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
  v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_CDAB));
  const __m128i totals = _mm_add_epi32(_mm512_castsi512_si128(_mm512_permutexvar_epi32(order, v)),
                                       _mm_set1_epi32(bias));
  return _mm_fmadd_ps(dy, _mm_cvtepi32_ps(totals), acc);
}

// Two blocks' steps (a, then b) with one reduction: unpacking the two blocks' lanes against
// each other pairs them, so the in-unit adds and the permute serve both ([A B C D] of a, then
// of b, in one 256-bit register); the same integer totals, then a's FMA and b's, in block order.
KILN_VNNI512_INLINE __m128 Q8QuadTotalsFma2(__m512i va, __m512i vb, __m128 dya, __m128 dyb,
                                            const int32_t* bias, __m128 acc) {
  // Each block's bias into lane 0 of every unit (an add with a broadcast operand from memory),
  // then per unit [a0 + a2, b0 + b2, a1 + a3, b1 + b3] and [ta, tb, ta, tb].
  va = _mm512_mask_add_epi32(va, 0x1111, va, _mm512_set1_epi32(bias[0]));
  vb = _mm512_mask_add_epi32(vb, 0x1111, vb, _mm512_set1_epi32(bias[1]));
  __m512i v = _mm512_add_epi32(_mm512_unpacklo_epi32(va, vb), _mm512_unpackhi_epi32(va, vb));
  v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 4, 8, 12, 1, 5, 9, 13);
  const __m256 f = _mm256_cvtepi32_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi32(order, v)));
  acc = _mm_fmadd_ps(dya, _mm256_castps256_ps128(f), acc);
  return _mm_fmadd_ps(dyb, _mm256_extractf128_ps(f, 1), acc);
}

// Whether a type's one-token kernel reduces blocks in pairs (Q8QuadTotalsFma2): the 4-bit
// types, bound by their shuffle and shift units, where it saves two of those ops a block. Q8_0,
// bound by memory, decoded slower from memory in pairs (docs/BENCHMARKS.md, session 34); Q5_0
// was not measured in pairs and keeps one block at a time with it.
template <size_t kBlockBytes>
constexpr bool kQ8QuadPairs = kBlockBytes <= 18;

// Software-pipelined as DotQ45KOne: block i's lane sums, then block i - 1's totals; with
// kQ8QuadPairs two blocks at a time (blocks i and i + 1's lane sums, then the two before them's
// totals), an odd last block on its own.
template <Q8QuadUnpack Quad, size_t kBlockBytes, bool kL1>
KILN_VNNI512 void DotQ8FamOne(const std::byte* const* rows, int64_t nb, const ActQ8_0* ys,
                              const int32_t* bias, const QuadAct* acts, float* out, int n_out,
                              const std::byte* pf) {
  constexpr bool kActs = kQ8QuadActs<kBlockBytes>;
  const auto prefetch = [&](int64_t i) {
    if (pf == nullptr) return;
    if constexpr (kL1)
      PrefetchSpanL1<4 * kBlockBytes>(pf + i * 4 * kBlockBytes);
    else
      PrefetchSpanL2<4 * kBlockBytes>(pf + i * 4 * kBlockBytes);
  };
  __m128 acc = _mm_setzero_ps(), dyp0 = acc, dyp1 = acc;
  __m512i vp0 = _mm512_setzero_si512(), vp1 = vp0;
  const int64_t n2 = kQ8QuadPairs<kBlockBytes> ? nb & ~int64_t{1} : 0;
  for (int64_t i = 0; i < n2; i += 2) {
    prefetch(i);
    prefetch(i + 1);
    __m128 dy0, dy1;
    const __m512i v0 = Q8QuadBlock<Quad, kActs>(rows, i, ys, acts, &dy0);
    const __m512i v1 = Q8QuadBlock<Quad, kActs>(rows, i + 1, ys, acts, &dy1);
    if (i > 0) acc = Q8QuadTotalsFma2(vp0, vp1, dyp0, dyp1, bias + i - 2, acc);
    vp0 = v0, vp1 = v1;
    dyp0 = dy0, dyp1 = dy1;
  }
  if (n2 > 0) acc = Q8QuadTotalsFma2(vp0, vp1, dyp0, dyp1, bias + n2 - 2, acc);
  for (int64_t i = n2; i < nb; ++i) {
    prefetch(i);
    __m128 dy;
    const __m512i v = Q8QuadBlock<Quad, kActs>(rows, i, ys, acts, &dy);
    if (i > n2) acc = Q8QuadTotalsFma(vp0, dyp0, bias[i - 1], acc);
    vp0 = v;
    dyp0 = dy;
  }
  if (nb > n2) acc = Q8QuadTotalsFma(vp0, dyp0, bias[nb - 1], acc);
  alignas(16) float o[4];
  _mm_store_ps(o, acc);
  for (int k = 0; k < n_out; ++k) out[k] = o[k];
}

// Rows per DotQ8FamOne call. Decode is bound by memory, and fewer rows read at once stream
// better: 4 rows decode faster than 8 on the Intel Xeon dev box of 2026-12-05
// (docs/BENCHMARKS.md, session 23, has the figures).
constexpr int kQ8OneRows = 4;
// Rows [r0, r1) of a one-token Q8_0-family job: groups of kQ8OneRows through DotQ8FamOne, the
// prefetch as in MatvecKOne; a last group of fewer rows repeats its last row.
template <Q8QuadUnpack Quad, size_t kBlockBytes>
void MatvecQ8One(const MatmulJob& job, int64_t r0, int64_t r1) {
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 32;
  const auto* y = reinterpret_cast<const ActQ8_0*>(job.xq);
  thread_local std::vector<int32_t> bias;
  thread_local std::vector<QuadAct> acts;
  bias.resize(static_cast<size_t>(nb));
  if constexpr (kQ8QuadActs<kBlockBytes>) acts.resize(static_cast<size_t>(nb));
  QuadAct* qa = kQ8QuadActs<kBlockBytes> ? acts.data() : nullptr;
  Q8QuadActs<kQ8QuadBias<Quad>>(y, nb, bias.data(), qa);
  // The 4-bit blocks on Intel cores into L1 (prefetch.h IntelCores; a prefetch changes no result).
  const bool l1 = kBlockBytes <= 18 && IntelCores();
  for (int64_t r = r0; r < r1; r += kQ8OneRows) {
    const int n = static_cast<int>(std::min<int64_t>(kQ8OneRows, r1 - r));
    const std::byte* rows[kQ8OneRows];
    for (int k = 0; k < kQ8OneRows; ++k) rows[k] = w.row(r + std::min(k, n - 1)).data();
    const std::byte* pf = n == kQ8OneRows ? GroupPrefetch(w, r, kQ8OneRows) : nullptr;
    if (l1)
      DotQ8FamOne<Quad, kBlockBytes, true>(rows, nb, y, bias.data(), qa, job.y + r, n, pf);
    else
      DotQ8FamOne<Quad, kBlockBytes, false>(rows, nb, y, bias.data(), qa, job.y + r, n, pf);
  }
}

// ---------------------------------------------------------------- IQ4_XS, one token (VNNI)
// The plain kernel (iq4-inl.h's DotIQ4XS<1>) spends its time on the scalar decoding of each
// sub-block's 6-bit scale and on 256-bit lanes for one row. Here two rows share each 512-bit
// register, [row A's 32 elements of sub-block j | row B's], each half in the plain kernel's
// element order (low nibbles then high nibbles), so dword lane L of a half sums the same 4
// products as the plain kernel's lane L. Per sub-block: |w| and the sign of w come from two
// byte lookups of the 4-bit codes (the grid has no zero and its negative values are the codes
// 0..7), the token's quants take the sign of w (a masked 0 - a: the same bytes as psignb, -128
// included), vpmaddubsw gives the plain kernel's int16 pairs (at most 2 * 127 * 127, no
// saturation) and vpdpwssd adds scale * (pair + pair), the plain kernel's madd + add. The eight
// signed scales of both rows are decoded at once as words. Integer sums are exact in any
// order, so each half holds the plain kernel's int32 lanes; then one FMA by [dA * y.d | dB *
// y.d] per block and HsumPair give each row the plain kernel's bits (tests/ops MatmulKQOne).
alignas(16) constexpr std::array<uint8_t, 16> kIQ4NLAbs = [] {
  std::array<uint8_t, 16> a{};
  for (int k = 0; k < 16; ++k)
    a[k] = static_cast<uint8_t>(quant::kIQ4NLValues[k] < 0 ? -quant::kIQ4NLValues[k]
                                                           : quant::kIQ4NLValues[k]);
  return a;
}();
static_assert(quant::kIQ4NLValues[7] < 0 && quant::kIQ4NLValues[8] > 0,
              "the sign of an IQ4 grid value is bit 3 of its code");

// Both rows' eight scales (ls - 32) as words [A0..A7 | B0..B7].
KILN_VNNI512_INLINE __m256i IQ4XSScalesPair(const quant::block_iq4_xs* a,
                                            const quant::block_iq4_xs* b) {
  uint32_t la, lb;
  std::memcpy(&la, a->scales_l, 4);
  std::memcpy(&lb, b->scales_l, 4);
  const __m128i l = _mm_set_epi32(0, 0, static_cast<int>(lb), static_cast<int>(la));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  // scales_l byte k holds sub-blocks 2k (low nibble) and 2k + 1 (high nibble)
  const __m256i low = _mm256_cvtepu8_epi16(
      _mm_unpacklo_epi8(_mm_and_si128(l, m4), _mm_and_si128(_mm_srli_epi16(l, 4), m4)));
  const __m256i h = _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(b->scales_h)),
                                     _mm_set1_epi16(static_cast<int16_t>(a->scales_h)));
  const __m256i shifts = _mm256_setr_epi16(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i high = _mm256_and_si256(_mm256_srlv_epi16(h, shifts), _mm256_set1_epi16(3));
  return _mm256_sub_epi16(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi16(32));
}

template <int R>
KILN_VNNI512 void DotIQ4XSOne(const std::byte* row, size_t stride, int64_t nb, const block_q8_K* ys,
                              float* out, const std::byte* pf) {
  static_assert(R % 2 == 0);
  constexpr int P = R / 2;
  using quant::block_iq4_xs;
  const __m512i grid_abs =
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NLAbs.data())));
  const __m512i m4 = _mm512_set1_epi8(0x0F), bit3 = _mm512_set1_epi8(8);
  // word index of [A_j x16 | B_j x16] in IQ4XSScalesPair's vector is j + this
  const __m512i sc_base = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(8), 1);
  const __m512i idx_d = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi32(1), 1);
  __m512 acc[P];
  for (int q = 0; q < P; ++q) acc[q] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    if (pf != nullptr) PrefetchSpanL2<R * sizeof(block_iq4_xs)>(pf + i * R * sizeof(block_iq4_xs));
    const block_q8_K& y = ys[i];
    const auto block = [&](int r) {
      return reinterpret_cast<const block_iq4_xs*>(row + r * stride + i * sizeof(block_iq4_xs));
    };
    __m512i scw[P], isum[P];
    for (int q = 0; q < P; ++q) {
      scw[q] = _mm512_castsi256_si512(IQ4XSScalesPair(block(2 * q), block(2 * q + 1)));
      isum[q] = _mm512_setzero_si512();
    }
    for (int j = 0; j < 8; ++j) {
      const __m512i a = _mm512_broadcast_i64x4(Load32(y.qs + 32 * j));
      const __m512i sc_idx = _mm512_add_epi16(sc_base, _mm512_set1_epi16(static_cast<int16_t>(j)));
      for (int q = 0; q < P; ++q) {
        const __m256i qa = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(block(2 * q)->qs + 16 * j)));
        const __m256i qb = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(block(2 * q + 1)->qs + 16 * j)));
        // [qA | qA >> 4 | qB | qB >> 4] (128-bit quarters), masked to the codes
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1);
        const __m512i codes =
            _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFF00FF00u, both, 4), m4);
        const __m512i aw = _mm512_shuffle_epi8(grid_abs, codes);
        const __mmask64 neg = _mm512_testn_epi8_mask(codes, bit3);
        const __m512i as = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
        const __m512i sc = _mm512_permutexvar_epi16(sc_idx, scw[q]);
        isum[q] = _mm512_dpwssd_epi32(isum[q], _mm512_maddubs_epi16(aw, as), sc);
      }
    }
    const __m128 yd = _mm_set1_ps(y.d);
    for (int q = 0; q < P; ++q) {
      const __m128 d = HalfPair(block(2 * q)->d, block(2 * q + 1)->d);
      const __m512 dy = _mm512_permutexvar_ps(idx_d, _mm512_castps128_ps512(_mm_mul_ps(d, yd)));
      acc[q] = _mm512_fmadd_ps(dy, _mm512_cvtepi32_ps(isum[q]), acc[q]);
    }
  }
  for (int q = 0; q < P; ++q) HsumPair(acc[q], out + 2 * q, out + 2 * q + 1);
}

// Rows per DotIQ4XSOne call: two pairs share each sub-block's token load (4 rows, as kQ8OneRows).
constexpr int kIQ4XSOneRows = 4;
// Rows [r0, r1) of a one-token IQ4_XS job: groups of kIQ4XSOneRows (prefetched as in MatvecKOne),
// then pairs, then a last row through the plain kernel (the same bits).
void MatvecIQ4XSOne(const MatmulJob& job, int64_t r0, int64_t r1) {
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 256;
  const auto* y = reinterpret_cast<const block_q8_K*>(job.xq);
  const size_t stride = w.stride();
  int64_t r = r0;
  for (; r + kIQ4XSOneRows <= r1; r += kIQ4XSOneRows) {
    const std::byte* pf = GroupPrefetch(w, r, kIQ4XSOneRows);
    DotIQ4XSOne<kIQ4XSOneRows>(w.row(r).data(), stride, nb, y, job.y + r, pf);
  }
  for (; r + 2 <= r1; r += 2) DotIQ4XSOne<2>(w.row(r).data(), stride, nb, y, job.y + r, nullptr);
  if (r < r1) {
    const block_q8_K* ys[1] = {y};
    DotIQ4XS<1>(w.row(r).data(), nb, ys, job.y + r);
  }
}

#undef KILN_VNNI512
#undef KILN_VNNI512_INLINE
#endif  // HWY_AVX3_DL

#endif  // KILN_INT8

// Whether BF16 weights take the pair arithmetic on this target (act_kind: ActKind::BF16), and
// its activation rounding (quantize_act_row; round_bf16_row_ref's bytes).
bool Bf16PairsK() { return KILN_BF16_PAIRS && HasAvx512Bf16(); }
#if KILN_BF16_PAIRS
KILN_BF16_PAIRS_NOINLINE void RoundBF16RowK(const float* x, int64_t n, bf16* xb) {
  RoundBF16Row(x, n, xb);
}
#else
void RoundBF16RowK(const float* x, int64_t n, bf16* xb) { round_bf16_row_ref(x, n, xb); }
#endif

bool HasInt8PathK(DType t) {
#if KILN_INT8
  switch (t) {
    case DType::Q8_0:
    case DType::Q4_0:
    case DType::Q5_0:
    case DType::MXFP4:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
    case DType::Q2_K:
    case DType::Q3_K:
    case DType::IQ4_NL:
    case DType::IQ4_XS:
      return true;
    default:
      return false;
  }
#else
  (void)t;
  return false;
#endif
}

void MatmulRowsK(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  switch (job.w->dtype) {
    case DType::F32:
      return MatmulFloat<float, LoadF32>(job, r0, r1);
    case DType::F16:
      return MatmulFloat<f16, LoadF16>(job, r0, r1);
    case DType::BF16:
#if KILN_BF16_PAIRS
      if (HasAvx512Bf16()) return MatmulBF16Pairs(job, r0, r1);
#endif
#if KILN_BF16_ZIP
      if (!job.portable && job.n_tok == 1) return MatvecBF16One(job, r0, r1);
#endif
      return MatmulFloat<bf16, LoadBF16>(job, r0, r1);
#if KILN_INT8
#if HWY_TARGET == HWY_AVX3_DL
    case DType::Q8_0:
      if (!job.portable && job.n_tok >= kQ8VnniMinTok)
        return MatmulQ8Vnni(job, r0, r1, scratch, UnpackRowQ8<UnpackQ8_0>);
      if (!job.portable && job.n_tok == 1)
        return MatvecQ8One<QuadQ8_0, sizeof(block_q8_0)>(job, r0, r1);
      return MatmulInt<ActQ8_0, KQ8_0>(job, r0, r1, 32);
    case DType::Q4_0:
      if (!job.portable && job.n_tok >= kQ8VnniMinTok)
        return MatmulQ8Vnni(job, r0, r1, scratch, UnpackRowQ8<UnpackQ4_0>);
      if (!job.portable && job.n_tok == 1)
        return MatvecQ8One<QuadQ4_0, sizeof(block_q4_0)>(job, r0, r1);
      return MatmulInt<ActQ8_0, KQ4_0>(job, r0, r1, 32);
    case DType::Q5_0:
      if (!job.portable && job.n_tok >= kQ8VnniMinTok)
        return MatmulQ8Vnni(job, r0, r1, scratch, UnpackRowQ8<UnpackQ5_0>);
      if (!job.portable && job.n_tok == 1)
        return MatvecQ8One<QuadOf<UnpackQ5_0>, sizeof(block_q5_0)>(job, r0, r1);
      return MatmulInt<ActQ8_0, KQ5_0>(job, r0, r1, 32);
    case DType::IQ4_NL:
      if (!job.portable && job.n_tok >= kQ8VnniMinTok)
        return MatmulQ8Vnni(job, r0, r1, scratch, UnpackRowQ8<UnpackIQ4_NL>);
      if (!job.portable && job.n_tok == 1)
        return MatvecQ8One<QuadIQ4_NL, sizeof(quant::block_iq4_nl)>(job, r0, r1);
      return MatmulInt<ActQ8_0, KIQ4_NL>(job, r0, r1, 32);
    case DType::MXFP4:
      if (!job.portable && job.n_tok >= kQ8VnniMinTok)
        return MatmulQ8Vnni(job, r0, r1, scratch, UnpackRowQ8<UnpackMxfp4>);
      if (!job.portable && job.n_tok == 1)
        return MatvecQ8One<QuadMxfp4, sizeof(quant::block_mxfp4)>(job, r0, r1);
      return MatmulInt<ActQ8_0, KMxfp4>(job, r0, r1, 32);
#else
    case DType::IQ4_NL:
#if HWY_TARGET == HWY_AVX2
      if (!job.portable && job.n_tok == 1)
        return MatvecQ8Avx2<UnpackIQ4_NL, sizeof(quant::block_iq4_nl)>(job, r0, r1);
#endif
      return MatmulInt<ActQ8_0, KIQ4_NL>(job, r0, r1, 32);
    case DType::Q8_0:
#if HWY_TARGET == HWY_AVX2
      if (!job.portable && job.n_tok == 1)
        return MatvecQ8Avx2<UnpackQ8_0, sizeof(block_q8_0)>(job, r0, r1);
#endif
      return MatmulInt<ActQ8_0, KQ8_0>(job, r0, r1, 32);
    case DType::Q4_0:
#if HWY_TARGET == HWY_AVX2
      if (!job.portable && job.n_tok == 1)
        return MatvecQ8Avx2<UnpackQ4_0, sizeof(block_q4_0)>(job, r0, r1);
#endif
      return MatmulInt<ActQ8_0, KQ4_0>(job, r0, r1, 32);
    case DType::Q5_0:
#if HWY_TARGET == HWY_AVX2
      if (!job.portable && job.n_tok == 1)
        return MatvecQ8Avx2<UnpackQ5_0, sizeof(block_q5_0)>(job, r0, r1);
#endif
      return MatmulInt<ActQ8_0, KQ5_0>(job, r0, r1, 32);
    case DType::MXFP4:
#if HWY_TARGET == HWY_AVX2
      if (!job.portable && job.n_tok == 1)
        return MatvecQ8Avx2<UnpackMxfp4, sizeof(quant::block_mxfp4)>(job, r0, r1);
#endif
      return MatmulInt<ActQ8_0, KMxfp4>(job, r0, r1, 32);
#endif
    case DType::Q4_K:
#if HWY_TARGET == HWY_AVX3_DL
      if (!job.portable) {
        if (job.amx && job.n_tok >= kQ8AmxMinTok && amx_usable())
          return MatmulQ4KAmx(job, r0, r1, scratch);
        if (job.n_tok >= kKRowsMinTok) return MatmulKRows16(job, r0, r1, scratch);
        if (job.n_tok >= kKQBatchMinTok) return MatmulKBatch<true>(job, r0, r1, scratch);
        if (job.n_tok == 1) return MatvecKOne<block_q4_K>(job, r0, r1, scratch);
      }
#endif
#if HWY_TARGET == HWY_AVX2
      if (!job.portable) {
        if (job.n_tok == 1) return MatvecKAvx2<true>(job, r0, r1);
        return MatmulInt<block_q8_K, KQ4_KAvx2>(job, r0, r1, 256);
      }
#endif
      return MatmulInt<block_q8_K, KQ4_K>(job, r0, r1, 256);
    case DType::Q5_K:
#if HWY_TARGET == HWY_AVX3_DL
      if (!job.portable && job.n_tok == 1) return MatvecKOne<block_q5_K>(job, r0, r1, scratch);
      if (!job.portable && job.n_tok >= kKRowsMinTok) return MatmulKRows16(job, r0, r1, scratch);
#endif
      return MatmulInt<block_q8_K, KQ5_K>(job, r0, r1, 256);
    case DType::Q6_K:
#if HWY_TARGET == HWY_AVX3_DL
      if (!job.portable) {
        if (job.amx && job.n_tok >= kQ8AmxMinTok && amx_usable())
          return MatmulQ6KAmx(job, r0, r1, scratch);
        if (job.n_tok >= kKRowsMinTokQ6K) return MatmulKRows16(job, r0, r1, scratch);
        if (job.n_tok >= kKQBatchMinTok) return MatmulKBatch<false>(job, r0, r1, scratch);
        if (job.n_tok == 1) return MatvecKOne<block_q6_K>(job, r0, r1, scratch);
      }
#endif
#if HWY_TARGET == HWY_AVX2
      if (!job.portable) {
        if (job.n_tok == 1) return MatvecKAvx2<false>(job, r0, r1);
        return MatmulInt<block_q8_K, KQ6_KAvx2>(job, r0, r1, 256);
      }
#endif
      return MatmulInt<block_q8_K, KQ6_K>(job, r0, r1, 256);
    case DType::IQ4_XS:
#if HWY_TARGET == HWY_AVX3_DL
      if (!job.portable && job.n_tok == 1) return MatvecIQ4XSOne(job, r0, r1);
#endif
      return MatmulInt<block_q8_K, KIQ4_XS>(job, r0, r1, 256);
    case DType::Q2_K:
      if (!job.portable && job.n_tok == 1) return MatvecQ23<true>(job, r0, r1);
      return MatmulInt<block_q8_K, KQ2_K>(job, r0, r1, 256);
    case DType::Q3_K:
      if (!job.portable && job.n_tok == 1) return MatvecQ23<false>(job, r0, r1);
      return MatmulInt<block_q8_K, KQ3_K>(job, r0, r1, 256);
#endif
    default:
      return MatmulDequant(job, r0, r1, scratch);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kiln::cpu {
HWY_EXPORT(HasInt8PathK);
HWY_EXPORT(MatmulRowsK);
HWY_EXPORT(Bf16PairsK);
HWY_EXPORT(RoundBF16RowK);

bool has_int8_path(DType t) { return HWY_DYNAMIC_DISPATCH(HasInt8PathK)(t); }

ActKind act_kind(DType t) {
  if (t == DType::BF16) return HWY_DYNAMIC_DISPATCH(Bf16PairsK)() ? ActKind::BF16 : ActKind::F32;
  if (!has_int8_path(t)) return ActKind::F32;
  return quant::vec_dot_type(t) == DType::Q8_K ? ActKind::Q8_K : ActKind::Q8_0;
}

size_t act_row_bytes(ActKind k, int64_t n) {
  switch (k) {
    case ActKind::Q8_0:
      return static_cast<size_t>(n / 32) * sizeof(ActQ8_0);
    case ActKind::Q8_K:
      return static_cast<size_t>(n / 256) * sizeof(quant::block_q8_K);
    case ActKind::BF16:
      return static_cast<size_t>(pairs_padded(n)) * sizeof(bf16);
    default:
      return 0;
  }
}

namespace {
// llama.cpp's nearest_int (round half to even via the mantissa), vectorisable.
inline int32_t round_int(float f) {
  float v = f + 12582912.f;
  int32_t i;
  std::memcpy(&i, &v, 4);
  return (i & 0x007fffff) - 0x00400000;
}
}  // namespace

// A non-finite input makes the block scale NaN so the dot product is NaN too, as the f32
// result would be, instead of silently rounding garbage.
void quantize_act_row(ActKind k, const float* x, int64_t n, std::byte* dst, bool portable) {
  if (k == ActKind::BF16) {
    auto* xb = reinterpret_cast<bf16*>(dst);
    if (portable)
      round_bf16_row_ref(x, n, xb);
    else
      HWY_DYNAMIC_DISPATCH(RoundBF16RowK)(x, n, xb);
    return;
  }
  if (k == ActKind::Q8_0) {
    if (!portable && quantize_q8_0_simd(x, n, dst)) return;
    auto* out = reinterpret_cast<ActQ8_0*>(dst);
    for (int64_t b = 0; b < n / 32; ++b) {
      const float* xb = x + b * 32;
      float amax = 0, probe = 0;
      for (int i = 0; i < 32; ++i) {
        amax = std::max(amax, std::fabs(xb[i]));
        probe += xb[i] * 0.0f;
      }
      const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
      out[b].d = std::isnan(probe) ? NAN : d;
      for (int i = 0; i < 32; ++i)
        out[b].qs[i] = static_cast<int8_t>(std::isnan(probe) ? 0 : round_int(xb[i] * id));
    }
  } else if (k == ActKind::Q8_K) {
    if (!portable && quantize_q8k_simd(x, n, dst)) return;
    auto* out = reinterpret_cast<quant::block_q8_K*>(dst);
    for (int64_t b = 0; b < n / 256; ++b) {
      const float* xb = x + b * 256;
      // amax: the largest |x| (NaN skipped); probe: NaN iff some x is not finite (x * 0 is
      // +-0 otherwise); mx: the first x of |x| == amax, the one-pass search's pick where it
      // matters (probe not NaN). Order-free, so kept in 8 independent lanes instead of one
      // serial chain (this function was 5% of a 1.1B pp512 profile; 1.2x with GCC 12, which
      // keeps the lanes scalar). Bytes pinned against the reference: ActQuant.Q8KSameBytes*.
      float amax8[8] = {}, probe8[8] = {};
      for (int i = 0; i < 256; i += 8)
        for (int j = 0; j < 8; ++j) {
          amax8[j] = std::max(amax8[j], std::fabs(xb[i + j]));
          probe8[j] += xb[i + j] * 0.0f;
        }
      float amax = 0, mx = 0, probe = 0;
      for (int j = 0; j < 8; ++j) {
        amax = std::max(amax, amax8[j]);
        probe += probe8[j];
      }
      for (int i = 0; i < 256; ++i)
        if (std::fabs(xb[i]) == amax) {
          mx = xb[i];
          break;
        }
      quant::block_q8_K& q = out[b];
      if (amax == 0 || std::isnan(probe)) {
        q.d = amax == 0 && !std::isnan(probe) ? 0.0f : NAN;
        std::memset(q.qs, 0, sizeof(q.qs));
        std::memset(q.bsums, 0, sizeof(q.bsums));
        continue;
      }
      // Scale by the signed extreme (llama.cpp's choice): it maps to exactly -127, so every
      // quant lies in [-127, 127] and maddubs pairs cannot saturate.
      const float iscale = -127.0f / mx;
      for (int i = 0; i < 256; ++i)
        q.qs[i] = static_cast<int8_t>(std::min(127, round_int(iscale * xb[i])));
      for (int g = 0; g < 16; ++g) {
        int s = 0;
        for (int i = 0; i < 16; ++i) s += q.qs[g * 16 + i];
        q.bsums[g] = static_cast<int16_t>(s);
      }
      q.d = 1.0f / iscale;
    }
  }
}

void matmul_rows(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  const DType t = job.w->dtype;
  if ((t == DType::F32 || t == DType::F16 || t == DType::BF16) && job.n_tok >= kFloatTileMinTok &&
      !job.portable)
    return matmul_float_tiled(job, r0, r1);
  HWY_DYNAMIC_DISPATCH(MatmulRowsK)(job, r0, r1, scratch);
}

size_t matmul_scratch_floats(const WeightMatrix& w) {
  size_t n = static_cast<size_t>(dequant_rows_per_block(w) * w.n_cols);
  if (w.dtype == DType::Q4_K || w.dtype == DType::Q5_K || w.dtype == DType::Q6_K)
    n = std::max(n, (kq_tile_bytes(w.n_cols / 256) + 3) / 4);
  if (w.dtype == DType::Q4_K || w.dtype == DType::Q5_K || w.dtype == DType::Q6_K)
    n = std::max(n, (k_rows_scratch_bytes(w.n_cols / 256) + 3) / 4);
  if (w.dtype == DType::Q4_K) n = std::max(n, (q4k_amx_scratch_bytes(w.n_cols / 256) + 3) / 4);
  if (w.dtype == DType::Q6_K) n = std::max(n, (q6k_amx_scratch_bytes(w.n_cols / 256) + 3) / 4);
  if (w.dtype == DType::Q8_0 || w.dtype == DType::Q4_0 || w.dtype == DType::Q5_0 ||
      w.dtype == DType::IQ4_NL || w.dtype == DType::MXFP4)
    n = std::max(n, (q8_vnni_scratch_bytes(w.n_cols) + 3) / 4);
  return n;
}

}  // namespace kiln::cpu
#endif
