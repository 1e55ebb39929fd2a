// backend/cpu/float_dot-inl.h: the f32-family dot arithmetic (F32/F16/BF16 weights, f32
// activations) shared by cpu_matmul.cpp's DotTile and cpu_matmul_float.cpp's register-tiled
// kernel, and the int8 kernels' final lane sum (Hsum, x86) and Q6_K unpack (Q6KGroups). Both must
// run exactly these float ops per output (two accumulators over alternating vector chunks, one more
// chunk into the first, SumOfLanes, then a scalar tail), which is what makes a token's output the
// same bits in any tile, call size or kernel (tests/ops MatmulTiling, MatmulFloatTile). Included
// once per Highway target by both files. Also the bf16-pair dot of BF16 weights on AVX512_BF16
// machines (DotPairsBlock, in bf16_pairs.h's order), which both files' BF16 kernels run there.
#if defined(KILN_BACKEND_CPU_FLOAT_DOT_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KILN_BACKEND_CPU_FLOAT_DOT_INL_H_
#undef KILN_BACKEND_CPU_FLOAT_DOT_INL_H_
#else
#define KILN_BACKEND_CPU_FLOAT_DOT_INL_H_
#endif

#include <cstdint>

#include "backend/cpu/bf16_pairs.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/prefetch.h"
#include "core/half.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

struct LoadF32 {
  const float* p;
  HWY_INLINE hn::Vec<DF> operator()(DF d, int64_t i) const { return hn::LoadU(d, p + i); }
  float at(int64_t i) const { return p[i]; }
  const char* bytes(int64_t i) const { return reinterpret_cast<const char*>(p + i); }
};
struct LoadF16 {
  const f16* p;
  HWY_INLINE hn::Vec<DF> operator()(DF d, int64_t i) const {
    const hn::Rebind<hwy::float16_t, DF> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p + i)));
  }
  float at(int64_t i) const { return f16_to_f32(p[i]); }
  const char* bytes(int64_t i) const { return reinterpret_cast<const char*>(p + i); }
};
struct LoadBF16 {
  const bf16* p;
  HWY_INLINE hn::Vec<DF> operator()(DF d, int64_t i) const {
    const hn::Rebind<hwy::bfloat16_t, DF> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::bfloat16_t*>(p + i)));
  }
  float at(int64_t i) const { return bf16_to_f32(p[i]); }
  const char* bytes(int64_t i) const { return reinterpret_cast<const char*>(p + i); }
};

// Chunks i and i + N (N = Lanes(d)) of a row, as w(d, i) and w(d, i + N) give them. F16 on
// AVX-512: one 64-byte load converted by halves instead of two 32-byte loads, each folded into
// its conversion: the same values, and the one-token F16 decode read a larger share of the read
// probe on AMD Zen 4 (docs/BENCHMARKS.md, session 35; not measured on Intel, where it runs too).
template <class L>
HWY_INLINE void LoadPair(const L& w, DF d, int64_t i, int64_t N, hn::Vec<DF>* w0, hn::Vec<DF>* w1) {
  *w0 = w(d, i);
  *w1 = w(d, i + N);
}
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
HWY_INLINE void LoadPair(const LoadF16& w, DF, int64_t i, int64_t, hn::Vec<DF>* w0,
                         hn::Vec<DF>* w1) {
  const __m512i raw = _mm512_loadu_si512(w.p + i);
  *w0 = hn::Vec<DF>{_mm512_cvtph_ps(_mm512_castsi512_si256(raw))};
  *w1 = hn::Vec<DF>{_mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1))};
}
#endif

#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
// The 8 float lanes of an int8 kernel's accumulator summed in one fixed order: every K-quant
// kernel of cpu_matmul.cpp and cpu_matmul_kq.cpp ends with it, which is part of what
// makes them the same bits as each other.
HWY_INLINE float Hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// Half h of a Q6_K block (ql0 = ql[64h..+32), ql1 = ql[64h+32..+32), qh = qh[32h..+32)) as its
// four 32-quant groups, unsigned 0..63 (the -32 offset left to the caller): the plain kernel's
// unpack (cpu_matmul.cpp DotQ6K) and the prefill kernel's row decode (cpu_matmul_kq.cpp) both
// take this one, so their quants agree by construction.
HWY_INLINE void Q6KGroups(__m256i ql0, __m256i ql1, __m256i qh, __m256i (&w4)[4]) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  w4[0] =
      _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
  w4[1] =
      _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
  w4[2] =
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
  w4[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                          _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
}
#endif

// The end of one output's dot: acc0 + acc1 summed across lanes, then elements [i, n) (fewer
// than a vector) one at a time, each by the target's MulAdd on one lane (fused where it has FMA),
// as cpu_attention.cpp's MulAddLane. Not `s += w * x`: whether the compiler contracts that into
// an FMA differs between the instantiations that must agree, and BF16 rows shorter than a vector
// came out a rounding apart between the one-token kernels and DotTile on an Intel Xeon, whose
// instantiations (prefetch.h IntelCores) the other machines do not run (session 33).
template <class L>
HWY_INLINE float DotFinish(DF d, hn::Vec<DF> acc0, hn::Vec<DF> acc1, const L& w, const float* x,
                           int64_t i, int64_t n) {
  float s = hn::GetLane(hn::SumOfLanes(d, hn::Add(acc0, acc1)));
  const hn::CappedTag<float, 1> d1;
  for (int64_t j = i; j < n; ++j)
    s = hn::GetLane(hn::MulAdd(hn::Set(d1, w.at(j)), hn::Set(d1, x[j]), hn::Set(d1, s)));
  return s;
}

// out[t] = dot(w, xs[t]) for T token rows, reading w once. Chunk c (N lanes at c * N) goes into
// acc0 when c is even and acc1 when odd; an odd last full chunk into acc0.
// kAhead > 0 (a decode step's one token, rows back to back): each chunk pair also prefetches
// the weight bytes kAhead past it, with __builtin_prefetch's locality kLocality: one prefetch
// per chunk, or with kRepeat > 0 the pair's bytes with each line's prefetch kRepeat times.
template <int T, class L, int64_t kAhead = 0, int kLocality = 2, int kRepeat = 0>
HWY_INLINE void DotTile(const L& w, const float* const* xs, int64_t n, float* out) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<DF> acc0[T], acc1[T];
  for (int t = 0; t < T; ++t) acc0[t] = acc1[t] = hn::Zero(d);
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    if constexpr (kAhead > 0 && kRepeat > 0) {
      PrefetchRepeated<kLocality, kRepeat>(w.bytes(i) + kAhead,
                                           static_cast<size_t>(w.bytes(i + 2 * N) - w.bytes(i)));
    } else if constexpr (kAhead > 0) {
      __builtin_prefetch(w.bytes(i) + kAhead, 0, kLocality);
      __builtin_prefetch(w.bytes(i + N) + kAhead, 0, kLocality);
    }
    hn::Vec<DF> w0, w1;
    LoadPair(w, d, i, N, &w0, &w1);
    for (int t = 0; t < T; ++t) {
      acc0[t] = hn::MulAdd(w0, hn::LoadU(d, xs[t] + i), acc0[t]);
      acc1[t] = hn::MulAdd(w1, hn::LoadU(d, xs[t] + i + N), acc1[t]);
    }
  }
  for (; i + N <= n; i += N) {
    const auto w0 = w(d, i);
    for (int t = 0; t < T; ++t) acc0[t] = hn::MulAdd(w0, hn::LoadU(d, xs[t] + i), acc0[t]);
  }
  for (int t = 0; t < T; ++t) out[t] = DotFinish(d, acc0[t], acc1[t], w, xs[t], i, n);
}

// ---------------------------------------------------------------- BF16 by zipping
// A bf16 is the top half of an f32, so InterleaveLower/Upper of zeros with 2N bf16 weights give
// two f32 vectors in one load and two in-block shuffles (PromoteTo: a widening shuffle and a
// shift per N). Their lanes are in zipped order: lane 4b + o of A holds element 8b + o, of B
// element 8b + 4 + o (b a 128-bit block, o < 4). Each lane of A and B still accumulates exactly
// one of DotTile's 2N per-lane sums (acc0 lane j: elements j mod 2N, acc1 lane j: N + j mod 2N)
// in the same order, so once the activations are in the same order (ZipActivations) and the
// sums moved back to their DotTile lanes (UnzipSums), DotFinish gives DotTile's bits.
// x86 targets with whole 128-bit blocks only (KILN_BF16_ZIP); others run DotTile.
#undef KILN_BF16_ZIP
#if HWY_ARCH_X86 && (HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || \
                     HWY_TARGET == HWY_AVX3_DL)
#define KILN_BF16_ZIP 1

// Element (within a 2N chunk pair) whose product lane l of [A | B] (l < 2N) accumulates.
HWY_INLINE int64_t ZipElement(int64_t N, int64_t l) {
  const int64_t half = l / N, m = l % N;
  return 8 * (m / 4) + 4 * half + m % 4;
}
// xz = x with each whole 2N chunk pair in zipped order; the rest (fewer than 2N) left out: the
// zipped loop never reads it.
HWY_INLINE void ZipActivations(const float* x, int64_t n, float* xz) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
  for (int64_t i = 0; i + 2 * N <= n; i += 2 * N)
    for (int64_t l = 0; l < 2 * N; ++l) xz[i + l] = x[i + ZipElement(N, l)];
}
// The zipped sums A and B back in DotTile's lanes: acc0 lane j holds element j, acc1 lane j
// element N + j.
HWY_INLINE void UnzipSums(DF d, hn::Vec<DF> a, hn::Vec<DF> b, hn::Vec<DF>* acc0,
                          hn::Vec<DF>* acc1) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  (void)d;
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  *acc0 = hn::Vec<DF>{_mm512_permutex2var_ps(a.raw, i0, b.raw)};
  *acc1 = hn::Vec<DF>{_mm512_permutex2var_ps(a.raw, i1, b.raw)};
#else
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  HWY_ALIGN float ab[2 * hn::MaxLanes(DF())], out[2 * hn::MaxLanes(DF())];
  hn::Store(a, d, ab);
  hn::Store(b, d, ab + N);
  for (int64_t l = 0; l < 2 * N; ++l) out[ZipElement(N, l)] = ab[l];
  *acc0 = hn::Load(d, out);
  *acc1 = hn::Load(d, out + N);
#endif
}
// The f32 vectors A (lanes of elements 8b + o) and B (8b + 4 + o) of the 2N bf16 at w.
HWY_INLINE void ZipBF16(DF d, const bf16* w, hn::Vec<DF>* a, hn::Vec<DF>* b) {
  const hn::Repartition<uint16_t, DF> du16;
  const auto v = hn::LoadU(du16, reinterpret_cast<const uint16_t*>(w));
  *a = hn::BitCast(d, hn::InterleaveLower(du16, hn::Zero(du16), v));
  *b = hn::BitCast(d, hn::InterleaveUpper(du16, hn::Zero(du16), v));
}

// DotTile<1>'s result for BF16 weights by zipping (xz: ZipActivations of x); kAhead, kLocality
// and kRepeat as DotTile's.
template <int64_t kAhead = 0, int kLocality = 2, int kRepeat = 0>
HWY_INLINE float DotBF16Zip(const bf16* w, const float* x, const float* xz, int64_t n) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  hn::Vec<DF> acc_a = hn::Zero(d), acc_b = hn::Zero(d);
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    if constexpr (kAhead > 0 && kRepeat > 0)
      PrefetchRepeated<kLocality, kRepeat>(reinterpret_cast<const char*>(w + i) + kAhead,
                                           static_cast<size_t>(2 * N) * sizeof(bf16));
    else if constexpr (kAhead > 0)
      __builtin_prefetch(reinterpret_cast<const char*>(w + i) + kAhead, 0, kLocality);
    hn::Vec<DF> a, b;
    ZipBF16(d, w + i, &a, &b);
    acc_a = hn::MulAdd(a, hn::LoadU(d, xz + i), acc_a);
    acc_b = hn::MulAdd(b, hn::LoadU(d, xz + i + N), acc_b);
  }
  hn::Vec<DF> acc0, acc1;
  UnzipSums(d, acc_a, acc_b, &acc0, &acc1);
  const LoadBF16 wl{w};
  for (; i + N <= n; i += N) acc0 = hn::MulAdd(wl(d, i), hn::LoadU(d, x + i), acc0);
  return DotFinish(d, acc0, acc1, wl, x, i, n);
}
#else
#define KILN_BF16_ZIP 0
#endif  // zipped BF16 targets

// ---------------------------------------------------------------- BF16 by bf16 pairs
// The arithmetic of bf16_pairs.h (its order is stated there) on the AVX3_DL target where the CPU
// has AVX512_BF16 (HasAvx512Bf16, asked at run time: Highway's target does not imply it).
#undef KILN_BF16_PAIRS
#if HWY_TARGET == HWY_AVX3_DL
#define KILN_BF16_PAIRS 1
#define KILN_BF16_PAIRS_INLINE \
  __attribute__((target(HWY_TARGET_STR ",avx512bf16"), always_inline)) inline
#define KILN_BF16_PAIRS_NOINLINE __attribute__((target(HWY_TARGET_STR ",avx512bf16"), noinline))

KILN_BF16_PAIRS_INLINE __m512 PairsDot(__m512 acc, __m512i w, __m512i x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}
// Chunk i (kPairChunk bf16) of a row of n, zeros past n.
KILN_BF16_PAIRS_INLINE __m512i PairsChunk(const bf16* w, int64_t i, int64_t n) {
  if (i + kPairChunk <= n) return _mm512_loadu_si512(w + i);
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << (n - i)) - 1), w + i);
}
// acc0 + acc1, then the halves folded: 16 -> 8 -> 4 -> 2 -> 1 (lane l + lane l + half).
KILN_BF16_PAIRS_INLINE float PairsFinish(__m512 acc0, __m512 acc1) {
  const __m512 v = _mm512_add_ps(acc0, acc1);
  const __m256 v8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1));
  const __m128 v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
  return _mm_cvtss_f32(_mm_add_ss(v2, _mm_movehdup_ps(v2)));
}
// f32_to_bf16 (core/half.h: round to nearest even, NaN quieted) of 16 floats, as 16 words: the
// same integer steps (the NaN lanes, whose sum could carry, take the quieted form instead).
KILN_BF16_PAIRS_INLINE __m256i RoundBF16x16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(
      _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(64)));
}
// Token t's bf16 row of a job's activations (ActKind::BF16: the caller encoded them once; act_kind
// and the kernels' dispatch ask the same question, Bf16PairsK, so xq is there).
inline const bf16* PairsToken(const MatmulJob& job, int64_t t) {
  return reinterpret_cast<const bf16*>(job.xq + static_cast<size_t>(t) * job.xq_row_bytes);
}
// round_bf16_row_ref's bytes: x[0, n) as bf16, zeros to pairs_padded(n).
KILN_BF16_PAIRS_INLINE void RoundBF16Row(const float* x, int64_t n, bf16* xb) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb + i), RoundBF16x16(_mm512_loadu_ps(x + i)));
  for (; i < n; ++i) xb[i] = f32_to_bf16(x[i]);
  for (; i < pairs_padded(n); ++i) xb[i] = bf16{0};
}

// out[r * T + t] = the pair dot of row w[r] (n bf16) and token xs[t] (bf16, padded) for R rows x
// T tokens, each weight chunk loaded once for the T tokens and each activation chunk once for
// the R rows. kAhead > 0 (a decode step, rows back to back): each 64-element step prefetches the
// rows' bytes kAhead past it, as DotTile (kLocality, kRepeat).
template <int R, int T, int64_t kAhead = 0, int kLocality = 2, int kRepeat = 0>
KILN_BF16_PAIRS_INLINE void DotPairsBlock(const bf16* const* w, const bf16* const* xs, int64_t n,
                                          float* out) {
  __m512 acc0[R][T], acc1[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc0[r][t] = acc1[r][t] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 * kPairChunk <= n; i += 2 * kPairChunk) {
    if constexpr (kAhead > 0) {
      for (int r = 0; r < R; ++r) {
        const char* p = reinterpret_cast<const char*>(w[r] + i) + kAhead;
        if constexpr (kRepeat > 0)
          PrefetchRepeated<kLocality, kRepeat>(p, 2 * kPairChunk * sizeof(bf16));
        else
          PrefetchSpan<2 * kPairChunk * sizeof(bf16), kLocality>(
              reinterpret_cast<const std::byte*>(p));
      }
    }
    __m512i wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w[r] + i);
    for (int t = 0; t < T; ++t) {
      const __m512i x = _mm512_loadu_si512(xs[t] + i);
      for (int r = 0; r < R; ++r) acc0[r][t] = PairsDot(acc0[r][t], wv[r], x);
    }
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w[r] + i + kPairChunk);
    for (int t = 0; t < T; ++t) {
      const __m512i x = _mm512_loadu_si512(xs[t] + i + kPairChunk);
      for (int r = 0; r < R; ++r) acc1[r][t] = PairsDot(acc1[r][t], wv[r], x);
    }
  }
  // At most two chunks are left: the next is even (acc0), the one after odd (acc1).
  for (int k = 0; k < 2 && i < n; ++k, i += kPairChunk) {
    for (int r = 0; r < R; ++r) {
      const __m512i wc = PairsChunk(w[r], i, n);
      for (int t = 0; t < T; ++t) {
        const __m512i x = _mm512_loadu_si512(xs[t] + i);
        if (k == 0)
          acc0[r][t] = PairsDot(acc0[r][t], wc, x);
        else
          acc1[r][t] = PairsDot(acc1[r][t], wc, x);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) out[r * T + t] = PairsFinish(acc0[r][t], acc1[r][t]);
}
#else
#define KILN_BF16_PAIRS 0
#endif  // BF16 pair targets

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#endif  // KILN_BACKEND_CPU_FLOAT_DOT_INL_H_ toggle
