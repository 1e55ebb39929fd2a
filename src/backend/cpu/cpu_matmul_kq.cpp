// backend/cpu/cpu_matmul_kq.cpp: Q4_K and Q6_K matmuls of many tokens (prefill) on AVX-512 VNNI,
// giving each token the plain kernels' (cpu_matmul.cpp DotQ45K, DotQ6K) bits; and the AVX-512
// encoder of their Q8_K activations.
//
// The v2 batched kernel (cpu_matmul.cpp DotQ4KBatch) spends, per token and block, 4 vpdpbusd and
// 2 vpdpwssd on the products, then per token pair a fold of the 16 lanes to 8, two multiplies
// for the scales d * y.d and -dmin * y.d, a madd and two converts, and it decodes each block per
// 8-token tile. On the Zen 5 dev box vpdpbusd, vpdpwssd, vpmaddwd, vpshldd, FMAs and multiplies
// share two pipes (2 per cycle in all; converts, shifts, logic and blends run beside them:
// measured in isolation), and the loops run at ~3.5 vector ops per cycle, so what counts is the
// ops around the products. Here the two tokens of a pair are interleaved by dword (dword 2L: token
// 2p's quants 4L..4L+3 of one sub-block, 2L+1: token 2p+1's) and each sub-block's nibbles are
// duplicated to match, so one vpdpbusd gives both tokens' 8 lane sums of one sub-block with no
// fold, and every lane of a register shares one sub-block scale. The scale products come from one
// 16-wide multiply per row, block and 8 tokens, broadcast per pair from memory; the min term's
// sum is the product of two exact floats (the tile's bsum pairs and the row's mins, |product| <
// 2^24) instead of a madd and a convert; scales are decoded once per row block; K runs in chunks
// whose activation tile stays in L1 (the v2 kernel streams wide rows' tiles from L2).
// bench/matvec_bench BM_KQPrefillOnOff, 512 tokens, 1 thread, then against the v2 kernels (with the
// 4-register Hsum tree below): Q4_K 1.14-1.15x at 2048 columns, 1.36-1.40x at 8192; Q6_K
// 1.18-1.19x / 1.32x. Each int32 lane
// equals the plain kernel's (integer sums are exact in any order) and each float lane sees the
// plain kernel's two FMAs on the same values in the same order, then Hsum of its 8 lanes in
// order: the plain kernel's bits (tests/ops MatmulKQPrefill). Q6_K (DotQ6KPrefill) follows the
// same plan.
#define HWY_WANT_AVX3_DL 1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_matmul_kq.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "core/half.h"
#include "cpu_matmul_kq.h"
#include "float_dot-inl.h"  // Hsum; per-target guard: expanded once per Highway target
#include "quant/blocks.h"

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {

// Q8_K activation rows with AVX-512 (where this target has it), the same bytes as
// quantize_act_row's scalar loop (tests/ops ActQuant.Q8KSameBytesAsReference): that loop is
// compiled for the baseline ISA, and was ~4% of a 1.1B pp512 profile. Every step is the loop's:
// the max of |x| skipping NaN (vmaxps returns its second operand when one is NaN), "some x not
// finite" for the probe, the first x with |x| == amax, then per element the product and the
// rounding add as two separately rounded ops (the _round forms, so no FMA contraction), the
// mantissa bits, min 127; bsums are exact integer sums. False where this target lacks it.
bool QuantizeQ8KRowK(const float* x, int64_t n, std::byte* dst) {
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX3_DL
  constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512i mant = _mm512_set1_epi32(0x007fffff), half = _mm512_set1_epi32(0x00400000);
  const __m512i q127 = _mm512_set1_epi32(127);
  auto* out = reinterpret_cast<quant::block_q8_K*>(dst);
  for (int64_t b = 0; b < n / 256; ++b) {
    const float* xb = x + b * 256;
    __m512 amax16 = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int v = 0; v < 16; ++v) {
      const __m512 xv = _mm512_loadu_ps(xb + 16 * v);
      amax16 = _mm512_max_ps(_mm512_and_ps(xv, abs_mask), amax16);
      bad |= _mm512_fpclass_ps_mask(xv, 0x99);  // NaN or +-inf: x * 0 is NaN
    }
    const float amax = _mm512_reduce_max_ps(amax16);
    quant::block_q8_K& q = out[b];
    if (amax == 0 || bad) {
      q.d = amax == 0 && !bad ? 0.0f : NAN;
      std::memset(q.qs, 0, sizeof(q.qs));
      std::memset(q.bsums, 0, sizeof(q.bsums));
      continue;
    }
    float mx = 0;
    const __m512 amaxv = _mm512_set1_ps(amax);
    for (int v = 0; v < 16; ++v) {
      const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_and_ps(_mm512_loadu_ps(xb + 16 * v), abs_mask),
                                              amaxv, _CMP_EQ_OQ);
      if (eq) {
        mx = xb[16 * v + __builtin_ctz(eq)];
        break;
      }
    }
    const float iscale = -127.0f / mx;
    const __m512 is = _mm512_set1_ps(iscale);
    for (int g = 0; g < 16; ++g) {
      const __m512 prod = _mm512_mul_round_ps(is, _mm512_loadu_ps(xb + 16 * g), kRn);
      const __m512i bits = _mm512_castps_si512(_mm512_add_round_ps(prod, magic, kRn));
      const __m512i qi =
          _mm512_min_epi32(q127, _mm512_sub_epi32(_mm512_and_si512(bits, mant), half));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.qs + 16 * g), _mm512_cvtepi32_epi8(qi));
      q.bsums[g] = static_cast<int16_t>(_mm512_reduce_add_epi32(qi));
    }
    q.d = 1.0f / iscale;
  }
  return true;
#else
  (void)x;
  (void)n;
  (void)dst;
  return false;
#endif
}

#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX3_DL

// Highway's AVX3_DL target string names AVX-VNNI but not AVX512-VNNI (as in cpu_matmul.cpp);
// no lambdas in these functions: clang would compile them without the target.
#define KILN_KQ_VNNI __attribute__((target(HWY_TARGET_STR ",avx512vnni"), noinline))
#define KILN_KQ_INLINE __attribute__((target(HWY_TARGET_STR ",avx512vnni"), always_inline)) inline

namespace {
using quant::block_q4_K;
using quant::block_q8_K;

// One (row, block) decoded once per row block.
struct alignas(16) Q4KMeta {
  uint32_t sc[4];     // sc[2j] | sc[2j+1] << 16: sub-blocks 2j, 2j+1's scales as vpdpwssd words
  uint8_t mins2[16];  // m[l] at bytes 2l and 2l+1: lane 2l + u of token u's min-term sum
  float d, neg_dmin;  // f16_to_f32 of d, and of dmin negated (exact)
  int32_t neg_k;      // -kLowBias * sum_j sc[2j]: takes the low words' offset back out
  uint32_t pad;
};
static_assert(sizeof(Q4KMeta) == kQ4KMetaBytes);

// The low word of each packed pair carries this offset, as in cpu_matmul.cpp (kLowBias there):
// 0 <= kLowBias + P < 2^15 for any Q4_K lane sum P (|P| <= 4 * 15 * 128).
constexpr int32_t kLowBias = 8192;

// The 6-bit scale and min of sub-block j, as the format defines them (ggml get_scale_min_k4).
inline void ScaleMinK4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void BuildMeta(const block_q4_K& b, Q4KMeta& mt) {
  uint8_t sc[8], m[8];
  for (int j = 0; j < 8; ++j) ScaleMinK4(j, b.scales, sc + j, m + j);
  int32_t even = 0;
  for (int j = 0; j < 4; ++j) {
    mt.sc[j] = sc[2 * j] | (static_cast<uint32_t>(sc[2 * j + 1]) << 16);
    even += sc[2 * j];
  }
  for (int l = 0; l < 8; ++l) mt.mins2[2 * l] = mt.mins2[2 * l + 1] = m[l];
  mt.d = f16_to_f32(b.d);
  mt.neg_dmin = -f16_to_f32(b.dmin);
  mt.neg_k = -kLowBias * even;
  mt.pad = 0;
}

// One (row, block) of Q6_K, decoded once per row block: the 6-bit quants of sub-block s (elements
// 32s..32s+31, the plain kernel's order) with every dword twice, as the tile's token pairs need;
// for sub-blocks 2j (low word) and 2j+1 (high word) the 16-element scales of dwords 0..7
// (elements 0..15 of the sub-block) and 8..15 (16..31); the -32 offset's scales.
struct alignas(64) Q6KMeta {
  uint8_t w[8][64];
  int16_t sc[4][32];
  int16_t sc32[32];   // word 4l + 2u + v: -32 * scales[2l + v], against the tile's bsum words
  float d, neg_dmin;  // f16_to_f32 of d; 0 (Q6_K has no min term)
  uint8_t pad[56];
};
static_assert(sizeof(Q6KMeta) == kQ6KMetaBytes);

KILN_KQ_VNNI void BuildMetaQ6(const quant::block_q6_K& b, Q6KMeta& mt) {
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int h = 0; h < 2; ++h) {  // as the plain kernel (cpu_matmul.cpp DotQ6K) unpacks them
    const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h));
    const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h + 32));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h));
    __m256i w4[4];
    Q6KGroups(ql0, ql1, qh, w4);
    for (int g = 0; g < 4; ++g)
      _mm512_store_si512(mt.w[4 * h + g],
                         _mm512_permutexvar_epi32(dup, _mm512_castsi256_si512(w4[g])));
  }
  for (int j = 0; j < 4; ++j)
    for (int dw = 0; dw < 16; ++dw) {
      const int half = dw / 8;  // scales[2s + half] of sub-block s
      mt.sc[j][2 * dw] = b.scales[2 * (2 * j) + half];
      mt.sc[j][2 * dw + 1] = b.scales[2 * (2 * j + 1) + half];
    }
  for (int l = 0; l < 8; ++l)
    for (int u = 0; u < 2; ++u)
      for (int v = 0; v < 2; ++v)
        mt.sc32[4 * l + 2 * u + v] = static_cast<int16_t>(-32 * b.scales[2 * l + v]);
  mt.d = f16_to_f32(b.d);
  mt.neg_dmin = 0.0f;
}

// [p[0], p[1]] x 8 as one broadcast load (asm: GCC otherwise keeps the values in registers and
// shuffles them on the multiply-side pipes, as in cpu_matmul_q8.cpp).
HWY_INLINE __m512 BroadcastPair(const float* p) {
  __m512 v;
  asm("vbroadcastsd %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const double*>(p)));
  return v;
}

// Tile of `pairs` token pairs for blocks [i0, i0 + n), per block (stride
// kq_prefill_tile_block_bytes(pairs)): [pair p][sub s] 64 bytes of interleaved quants; [pair p]
// 16 floats, lane 2l + u: float(bsums[2l] + bsums[2l+1]) of token 2p + u; [group g] 16 floats:
// the Q8_K scales of tokens 8g..8g+7, twice. A missing partner token is all zero.
// Q6_K (kQ6) keeps the pair's bsums as words instead, dword 2l + u: token 2p + u's (bsums[2l],
// bsums[2l+1]), for a vpmaddwd against the row's scales.
template <bool kQ6>
KILN_KQ_VNNI void FillTile(const block_q8_K* const* ys, int m, int pairs, int64_t i0, int64_t n,
                           std::byte* tile) {
  const __m512i inter = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m256i ones = _mm256_set1_epi16(1);
  const size_t stride = kq_prefill_tile_block_bytes(pairs);
  const int groups = (pairs + 3) / 4;
  for (int64_t ib = 0; ib < n; ++ib) {
    const int64_t i = i0 + ib;
    std::byte* tb = tile + ib * stride;
    auto* bf = reinterpret_cast<float*>(tb + pairs * 512);
    for (int p = 0; p < pairs; ++p) {
      const block_q8_K& a = ys[2 * p][i];
      const block_q8_K* b = 2 * p + 1 < m ? &ys[2 * p + 1][i] : nullptr;
      for (int s = 0; s < 8; ++s) {
        const __m256i ya = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qs + 32 * s));
        const __m256i yb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->qs + 32 * s))
                             : _mm256_setzero_si256();
        _mm512_store_si512(
            tb + p * 512 + s * 64,
            _mm512_permutexvar_epi32(inter, _mm512_inserti64x4(_mm512_castsi256_si512(ya), yb, 1)));
      }
      const __m256i sa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsums));
      const __m256i sb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b->bsums))
                           : _mm256_setzero_si256();
      if constexpr (kQ6) {
        _mm512_store_si512(
            bf + 16 * p,
            _mm512_permutexvar_epi32(inter, _mm512_inserti64x4(_mm512_castsi256_si512(sa), sb, 1)));
      } else {
        const __m256i ba = _mm256_madd_epi16(sa, ones), bb = _mm256_madd_epi16(sb, ones);
        _mm512_store_ps(bf + 16 * p,
                        _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(
                            inter, _mm512_inserti64x4(_mm512_castsi256_si512(ba), bb, 1))));
      }
    }
    float* yd2 = bf + 16 * pairs;
    for (int g = 0; g < groups; ++g)
      for (int t = 0; t < 8; ++t) {
        const int k = 8 * g + t;
        yd2[16 * g + t] = yd2[16 * g + 8 + t] = k < m ? ys[k][i].d : 0.0f;
      }
  }
}

// One row's scale products for the chunk: scl[(ib * groups + g) * 16 ..] = [d * yd of tokens
// 8g..8g+7 | -dmin * yd of the same], the plain kernel's d * y.d and -dmin * y.d.
template <class Meta>
KILN_KQ_VNNI void RowScales(const Meta* meta, int64_t n, const std::byte* tile, int pairs,
                            float* scl) {
  const size_t stride = kq_prefill_tile_block_bytes(pairs);
  const int groups = (pairs + 3) / 4;
  for (int64_t ib = 0; ib < n; ++ib) {
    const __m512 dm =
        _mm512_insertf32x8(_mm512_set1_ps(meta[ib].d), _mm256_set1_ps(meta[ib].neg_dmin), 1);
    const auto* yd2 = reinterpret_cast<const float*>(tile + ib * stride + pairs * 576);
    for (int g = 0; g < groups; ++g)
      _mm512_store_ps(scl + (ib * groups + g) * 16,
                      _mm512_mul_ps(dm, _mm512_load_ps(yd2 + 16 * g)));
  }
}

// out[2p + u] = Hsum of token u's 8 lanes of acc[p] (lanes 2l + u), for all pairs: with 4 pairs
// as one tree over the 4 registers (Hsum's adds: lane l + lane l+4, then (0, 2) and (1, 3), then
// (0, 1); IEEE adds commute), 13 ops instead of 4 x 13.
template <int P>
KILN_KQ_INLINE void HsumPairs(const __m512 (&acc)[P], float* out) {
  if constexpr (P == 4) {
    // [a.lo256 | b.lo256] + [a.hi256 | b.hi256]: per pair, s_i = v_i + v_{i+4} at lanes 2i + u.
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(acc[0], acc[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(acc[2], acc[3], _MM_SHUFFLE(3, 2, 3, 2)));
    // 128-bit lane k = pair k: [s0 + s2, s1 + s3] for tokens A, B (lanes 2i + u).
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
    // Lanes 0, 1 of each 128-bit lane: (s0 + s2) + (s1 + s3) of tokens A, B.
    const __m512 r = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512i pick = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(pick, r)));
  } else {
    const __m512i deint = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int p = 0; p < P; ++p) {
      const __m512 v = _mm512_permutexvar_ps(deint, acc[p]);
      out[2 * p] = Hsum(_mm512_castps512_ps256(v));
      out[2 * p + 1] = Hsum(_mm512_extractf32x8_ps(v, 1));
    }
  }
}

// One row x P token pairs over the chunk's n blocks. acc: the pairs' float lanes carried
// between chunks (read unless `first`); with `last`, out[t] for the 2P tokens instead.
template <int P>
KILN_KQ_VNNI void DotQ4KPrefill(const block_q4_K* row, const Q4KMeta* meta, int64_t n,
                                const std::byte* tile, const float* scl, float* acc_mem, bool first,
                                bool last, float* out) {
  constexpr int G = (P + 3) / 4;
  const size_t stride = kq_prefill_tile_block_bytes(P);
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i bias_lo = _mm512_set1_epi32(kLowBias);
  __m512 acc[P];
  for (int p = 0; p < P; ++p)
    acc[p] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc_mem + 16 * p);
  for (int64_t ib = 0; ib < n; ++ib) {
    const block_q4_K& b = row[ib];
    const Q4KMeta& mt = meta[ib];
    __m512i w[8];
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_permutexvar_epi32(
          dup, _mm512_castsi256_si512(
                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * j))));
      w[2 * j] = _mm512_and_si512(v, m4);
      w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    __m512i sc[4];
    for (int j = 0; j < 4; ++j) sc[j] = _mm512_set1_epi32(static_cast<int>(mt.sc[j]));
    const __m512i nk = _mm512_set1_epi32(mt.neg_k);
    const __m512 mf = _mm512_cvtepi32_ps(
        _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(mt.mins2))));
    const std::byte* tb = tile + ib * stride;
    const auto* bf = reinterpret_cast<const float*>(tb + P * 512);
    const float* si = scl + ib * G * 16;
    for (int p = 0; p < P; ++p) {
      const std::byte* a = tb + p * 512;
      __m512i isum = nk;
      for (int j = 0; j < 4; ++j) {
        const __m512i db = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2 * j + 1],
                                               _mm512_load_si512(a + (2 * j + 1) * 64));
        // (db << 16) | kLowBias by a shift and an OR beside the multiply pipes rather than a
        // vpshldd on them (no measurable difference either way on the dev box).
        const __m512i hi = _mm512_or_si512(_mm512_slli_epi32(db, 16), bias_lo);
        const __m512i pw = _mm512_dpbusd_epi32(hi, w[2 * j], _mm512_load_si512(a + 2 * j * 64));
        isum = _mm512_dpwssd_epi32(isum, pw, sc[j]);
      }
      const __m512 msum = _mm512_mul_ps(_mm512_load_ps(bf + 16 * p), mf);
      const float* sp = si + (p / 4) * 16 + 2 * (p % 4);
      acc[p] = _mm512_fmadd_ps(BroadcastPair(sp), _mm512_cvtepi32_ps(isum), acc[p]);
      acc[p] = _mm512_fmadd_ps(BroadcastPair(sp + 8), msum, acc[p]);
    }
  }
  if (!last) {
    for (int p = 0; p < P; ++p) _mm512_store_ps(acc_mem + 16 * p, acc[p]);
    return;
  }
  HsumPairs<P>(acc, out);
}

// Q6_K, the same register tile: isum starts at the -32 offset (one vpmaddwd of the tile's bsum
// words against the row's), each pair of sub-blocks' lane sums (|sum| <= 4 * 63 * 127 < 2^15)
// is packed into words by a blend and scaled by one vpdpwssd; one FMA per pair and block, as
// the plain kernel's one per token and block.
template <int P>
KILN_KQ_VNNI void DotQ6KPrefill(const std::byte* /*row: decoded into meta*/, const Q6KMeta* meta,
                                int64_t n, const std::byte* tile, const float* scl, float* acc_mem,
                                bool first, bool last, float* out) {
  constexpr int G = (P + 3) / 4;
  const size_t stride = kq_prefill_tile_block_bytes(P);
  __m512 acc[P];
  for (int p = 0; p < P; ++p)
    acc[p] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc_mem + 16 * p);
  for (int64_t ib = 0; ib < n; ++ib) {
    const Q6KMeta& mt = meta[ib];
    const std::byte* tb = tile + ib * stride;
    const auto* bs = reinterpret_cast<const int16_t*>(tb + P * 512);
    const float* si = scl + ib * G * 16;
    const __m512i sc32 = _mm512_load_si512(mt.sc32);
    for (int p = 0; p < P; ++p) {
      const std::byte* a = tb + p * 512;
      __m512i isum = _mm512_madd_epi16(_mm512_load_si512(bs + 32 * p), sc32);
      for (int j = 0; j < 4; ++j) {
        const __m512i da =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(mt.w[2 * j]),
                                _mm512_load_si512(a + 2 * j * 64));
        const __m512i db =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(mt.w[2 * j + 1]),
                                _mm512_load_si512(a + (2 * j + 1) * 64));
        const __m512i pw = _mm512_mask_blend_epi16(0xAAAAAAAAu, da, _mm512_slli_epi32(db, 16));
        isum = _mm512_dpwssd_epi32(isum, pw, _mm512_load_si512(mt.sc[j]));
      }
      acc[p] = _mm512_fmadd_ps(BroadcastPair(si + (p / 4) * 16 + 2 * (p % 4)),
                               _mm512_cvtepi32_ps(isum), acc[p]);
    }
  }
  if (!last) {
    for (int p = 0; p < P; ++p) _mm512_store_ps(acc_mem + 16 * p, acc[p]);
    return;
  }
  HsumPairs<P>(acc, out);
}

template <class Block, class Meta>
using DotFn = void (*)(const Block*, const Meta*, int64_t, const std::byte*, const float*, float*,
                       bool, bool, float*);
template <int... Ps>
constexpr auto MakeDots(std::integer_sequence<int, Ps...>) {
  return std::array<DotFn<block_q4_K, Q4KMeta>, sizeof...(Ps)>{&DotQ4KPrefill<Ps + 1>...};
}
template <int... Ps>
constexpr auto MakeDotsQ6(std::integer_sequence<int, Ps...>) {
  return std::array<DotFn<std::byte, Q6KMeta>, sizeof...(Ps)>{&DotQ6KPrefill<Ps + 1>...};
}
// [pairs - 1]
constexpr auto kDots = MakeDots(std::make_integer_sequence<int, kKQPrefillPairs>{});
constexpr auto kDotsQ6 = MakeDotsQ6(std::make_integer_sequence<int, kKQPrefillPairs>{});

template <class T>
T* Align64(std::byte*& p, size_t count) {
  p = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  T* out = reinterpret_cast<T*>(p);
  p += count * sizeof(T);
  return out;
}

}  // namespace

// Row blocks (decoded once) x token tiles of 2 * kKQPrefillPairs x K chunks (tile built once
// per row block, token tile and chunk) x rows. `scratch` holds kq_prefill_scratch_bytes.
template <bool kQ6>
void MatmulKQPrefill(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  using Block = std::conditional_t<kQ6, quant::block_q6_K, block_q4_K>;
  using Meta = std::conditional_t<kQ6, Q6KMeta, Q4KMeta>;
  using Row = std::conditional_t<kQ6, std::byte, block_q4_K>;
  constexpr int P = static_cast<int>(kKQPrefillPairs);
  constexpr int G = (P + 3) / 4;
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 256, ldy = w.n_rows;
  const int64_t rb = kq_prefill_rows_per_block(kq_prefill_row_bytes(w.dtype, nb, w.row_bytes));
  const int64_t chunk = std::min(nb, kKQPrefillChunk);
  auto* sp = reinterpret_cast<std::byte*>(scratch);
  Meta* meta = Align64<Meta>(sp, static_cast<size_t>(rb * nb));
  std::byte* tile =
      Align64<std::byte>(sp, static_cast<size_t>(chunk) * kq_prefill_tile_block_bytes(P));
  float* acc = Align64<float>(sp, static_cast<size_t>(rb * P * 16));
  float* scl[2];
  scl[0] = Align64<float>(sp, static_cast<size_t>(chunk * G * 16));
  scl[1] = Align64<float>(sp, static_cast<size_t>(chunk * G * 16));
  const block_q8_K* ys[2 * P];
  float out[2 * P];
  const auto row = [&](int64_t r) { return reinterpret_cast<const Block*>(w.row(r).data()); };
  for (int64_t b0 = r0; b0 < r1; b0 += rb) {
    const int64_t b1 = std::min(r1, b0 + rb);
    for (int64_t r = b0; r < b1; ++r)
      for (int64_t i = 0; i < nb; ++i) {
        if constexpr (kQ6)
          BuildMetaQ6(row(r)[i], meta[(r - b0) * nb + i]);
        else
          BuildMeta(row(r)[i], meta[(r - b0) * nb + i]);
      }
    for (int64_t t0 = 0; t0 < job.n_tok; t0 += 2 * P) {
      const int m = static_cast<int>(std::min<int64_t>(2 * P, job.n_tok - t0));
      const int pairs = (m + 1) / 2;
      for (int k = 0; k < m; ++k)
        ys[k] = reinterpret_cast<const block_q8_K*>(job.xq + (t0 + k) * job.xq_row_bytes);
      const DotFn<Row, Meta> dot =
          kQ6 ? DotFn<Row, Meta>(kDotsQ6[pairs - 1]) : DotFn<Row, Meta>(kDots[pairs - 1]);
      for (int64_t c0 = 0; c0 < nb; c0 += chunk) {
        const int64_t n = std::min(nb, c0 + chunk) - c0;
        const bool first = c0 == 0, last = c0 + n == nb;
        FillTile<kQ6>(ys, m, pairs, c0, n, tile);
        // Each row's scale products are written one row ahead of their use (a load of part of a
        // just-stored vector waits for the store).
        RowScales(meta + c0, n, tile, pairs, scl[0]);
        for (int64_t r = b0; r < b1; ++r) {
          const int64_t k = r - b0;
          if (r + 1 < b1) RowScales(meta + (k + 1) * nb + c0, n, tile, pairs, scl[(k + 1) & 1]);
          const Row* wr = nullptr;
          if constexpr (!kQ6) wr = row(r) + c0;
          dot(wr, meta + k * nb + c0, n, tile, scl[k & 1], acc + k * P * 16, first, last, out);
          if (last)
            for (int t = 0; t < m; ++t) job.y[(t0 + t) * ldy + r] = out[t];
        }
      }
    }
  }
}

void MatmulQ4KPrefill(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  MatmulKQPrefill<false>(job, r0, r1, scratch);
}
void MatmulQ6KPrefill(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  MatmulKQPrefill<true>(job, r0, r1, scratch);
}

#undef KILN_KQ_VNNI
#undef KILN_KQ_INLINE
#endif  // HWY_ARCH_X86 && HWY_AVX3_DL
}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kiln::cpu {
HWY_EXPORT(QuantizeQ8KRowK);
bool quantize_q8k_simd(const float* x, int64_t n, std::byte* dst) {
  return HWY_DYNAMIC_DISPATCH(QuantizeQ8KRowK)(x, n, dst);
}
}  // namespace kiln::cpu
#endif
