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
// 16-wide multiply per row, block and 8 tokens; the min term's
// sum is the product of two exact floats (the tile's bsum pairs and the row's mins, |product| <
// 2^24) instead of a madd and a convert; scales are decoded once per row block; K runs in chunks
// whose activation tile stays in L1 (the v2 kernel streams wide rows' tiles from L2).
// Each token's super-block totals T1 and T2 (docs/determinism.md) are its lanes' integer sums
// (exact in any order; TotalsI, and TotalsF for the min term's exact products) and the float
// steps are the plain kernel's, per block in block order: the plain kernel's bits (tests/ops
// MatmulKQPrefill). Q6_K (DotQ6KPrefill) follows the same plan. Where the machine has AMX-INT8,
// calls of kQ8AmxMinTok+ tokens take the AMX kernels below instead (MatmulQ4KAmx, MatmulQ6KAmx).
#define HWY_WANT_AVX3_DL 1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_matmul_kq.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>

#include "core/half.h"
#include "amx_tiles.h"
#include "backend/cpu/k4_scales.h"
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

// Tokens 8g..8g+7's totals from the token-pair registers v[4g..4g+3] (lane 2l + u: token 2p + u's
// lane l; a missing pair is zero): per pair, the halves added, then lanes l and l + 2 of each
// 128-bit lane, then l and l + 1 (the adds of HsumPairs's tree, formerly on floats), so lane t
// of the result = token 8g + t's sum of its 8 lanes. Ints: exact in any order. Floats (the min
// term): exact too, every partial sum being an integer below 2^24 (docs/determinism.md).
KILN_KQ_INLINE __m256i TotalsI(const __m512i* v, int n) {
  const __m512i z = _mm512_setzero_si512();
  const __m512i pick = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i a = v[0], b = n > 1 ? v[1] : z, c = n > 2 ? v[2] : z, d = n > 3 ? v[3] : z;
  const __m512i s01 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xEE));
  const __m512i s23 =
      _mm512_add_epi32(_mm512_shuffle_i32x4(c, d, 0x44), _mm512_shuffle_i32x4(c, d, 0xEE));
  const __m512i t =
      _mm512_add_epi32(_mm512_shuffle_i32x4(s01, s23, 0x88), _mm512_shuffle_i32x4(s01, s23, 0xDD));
  const __m512i r = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC));
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(pick, r));
}
KILN_KQ_INLINE __m256 TotalsF(const __m512* v, int n) {
  const __m512 z = _mm512_setzero_ps();
  const __m512i pick = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 a = v[0], b = n > 1 ? v[1] : z, c = n > 2 ? v[2] : z, d = n > 3 ? v[3] : z;
  const __m512 s01 =
      _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 s23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  const __m512 t =
      _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
  const __m512 r = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(pick, r));
}

// One row x P token pairs over the chunk's n blocks, by exact super-block totals (the plain
// kernel DotQ45K's arithmetic): per block each token's T1 (its pair register's 8 lanes) and T2
// (the min term's 8 exact products), then per 8 tokens one FMA each. acc: the tokens' float
// accumulators carried between chunks (read unless `first`); with `last`, out[t] for the 2P
// tokens instead.
template <int P>
KILN_KQ_VNNI void DotQ4KPrefill(const block_q4_K* row, const Q4KMeta* meta, int64_t n,
                                const std::byte* tile, const float* scl, float* acc_mem, bool first,
                                bool last, float* out) {
  constexpr int G = (P + 3) / 4;
  const size_t stride = kq_prefill_tile_block_bytes(P);
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i bias_lo = _mm512_set1_epi32(kLowBias);
  __m256 acc[G];  // tokens 8g..8g+7
  for (int g = 0; g < G; ++g)
    acc[g] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc_mem + 8 * g);
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
    __m512i isum[4 * G];
    __m512 msum[4 * G];
    for (int p = 0; p < P; ++p) {
      const std::byte* a = tb + p * 512;
      __m512i s = nk;
      for (int j = 0; j < 4; ++j) {
        const __m512i db = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[2 * j + 1],
                                               _mm512_load_si512(a + (2 * j + 1) * 64));
        // (db << 16) | kLowBias by a shift and an OR beside the multiply pipes rather than a
        // vpshldd on them (no measurable difference either way on the dev box).
        const __m512i hi = _mm512_or_si512(_mm512_slli_epi32(db, 16), bias_lo);
        const __m512i pw = _mm512_dpbusd_epi32(hi, w[2 * j], _mm512_load_si512(a + 2 * j * 64));
        s = _mm512_dpwssd_epi32(s, pw, sc[j]);
      }
      isum[p] = s;
      msum[p] = _mm512_mul_ps(_mm512_load_ps(bf + 16 * p), mf);
    }
    for (int g = 0; g < G; ++g) {
      const int np = std::min(4, P - 4 * g);
      const __m512 sg = _mm512_load_ps(si + 16 * g);  // [d * yd | -dmin * yd] of tokens 8g..
      acc[g] = _mm256_fmadd_ps(_mm512_castps512_ps256(sg),
                               _mm256_cvtepi32_ps(TotalsI(isum + 4 * g, np)), acc[g]);
      acc[g] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(sg, 1), TotalsF(msum + 4 * g, np), acc[g]);
    }
  }
  if (!last) {
    for (int g = 0; g < G; ++g) _mm256_store_ps(acc_mem + 8 * g, acc[g]);
    return;
  }
  for (int g = 0; g < G; ++g) {
    alignas(32) float o[8];
    _mm256_store_ps(o, acc[g]);
    for (int t = 0; t < 8 && 8 * g + t < 2 * P; ++t) out[8 * g + t] = o[t];
  }
}

// Q6_K, the same register tile: isum starts at the -32 offset (one vpmaddwd of the tile's bsum
// words against the row's), each pair of sub-blocks' lane sums (|sum| <= 4 * 63 * 127 < 2^15)
// is packed into words by a blend and scaled by one vpdpwssd; per block each token's exact total,
// then one FMA per 8 tokens (DotQ6K's arithmetic).
template <int P>
KILN_KQ_VNNI void DotQ6KPrefill(const std::byte* /*row: decoded into meta*/, const Q6KMeta* meta,
                                int64_t n, const std::byte* tile, const float* scl, float* acc_mem,
                                bool first, bool last, float* out) {
  constexpr int G = (P + 3) / 4;
  const size_t stride = kq_prefill_tile_block_bytes(P);
  __m256 acc[G];
  for (int g = 0; g < G; ++g)
    acc[g] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc_mem + 8 * g);
  for (int64_t ib = 0; ib < n; ++ib) {
    const Q6KMeta& mt = meta[ib];
    const std::byte* tb = tile + ib * stride;
    const auto* bs = reinterpret_cast<const int16_t*>(tb + P * 512);
    const float* si = scl + ib * G * 16;
    const __m512i sc32 = _mm512_load_si512(mt.sc32);
    __m512i isum[4 * G];
    for (int p = 0; p < P; ++p) {
      const std::byte* a = tb + p * 512;
      __m512i s = _mm512_madd_epi16(_mm512_load_si512(bs + 32 * p), sc32);
      for (int j = 0; j < 4; ++j) {
        const __m512i da =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(mt.w[2 * j]),
                                _mm512_load_si512(a + 2 * j * 64));
        const __m512i db =
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_load_si512(mt.w[2 * j + 1]),
                                _mm512_load_si512(a + (2 * j + 1) * 64));
        const __m512i pw = _mm512_mask_blend_epi16(0xAAAAAAAAu, da, _mm512_slli_epi32(db, 16));
        s = _mm512_dpwssd_epi32(s, pw, _mm512_load_si512(mt.sc[j]));
      }
      isum[p] = s;
    }
    for (int g = 0; g < G; ++g)
      acc[g] = _mm256_fmadd_ps(_mm256_load_ps(si + 16 * g),
                               _mm256_cvtepi32_ps(TotalsI(isum + 4 * g, std::min(4, P - 4 * g))),
                               acc[g]);
  }
  if (!last) {
    for (int g = 0; g < G; ++g) _mm256_store_ps(acc_mem + 8 * g, acc[g]);
    return;
  }
  for (int g = 0; g < G; ++g) {
    alignas(32) float o[8];
    _mm256_store_ps(o, acc[g]);
    for (int t = 0; t < 8 && 8 * g + t < 2 * P; ++t) out[8 * g + t] = o[t];
  }
}

// ---------------------------------------------------------------- AMX Q4_K (Sapphire Rapids+)
// By the exact super-block totals every Q4_K kernel computes (docs/determinism.md): TDPBSSD
// multiplies a tile of 16 tokens x one sub-block's 32 activation quants (read in place from the
// Q8_K rows) by a B tile of the same sub-block of 16 rows (their quants 0..15, 4 consecutive ones
// of each row side by side), giving each (token, row) the sub-block's exact int32 sum; the
// epilogue scales the 8 sums by the rows' 6-bit scales (vpmulld) into T1, takes T2 from the
// tokens' bsums against the rows' mins (vpdpwssd), and runs the plain kernel's two FMAs per block,
// 16 rows wide, in block order.

#define KILN_KQ_AMX \
  __attribute__((target(HWY_TARGET_STR ",avx512vnni,amx-tile,amx-int8"), noinline))

// Tiles (configure_amx_tiles): A one sub-block (32 quants) of m tokens, B its 16 rows (8 x 64).
KILN_KQ_AMX void ConfigureQ4KTiles(int m) { configure_amx_tiles(m, 32, 8); }

// One (16-row group, block) packed: bt[j * 512 + kk * 64 + k * 4 + e] = row k's quant 4kk + e of
// sub-block j; sc[j][k] its scale, mm[l][k] = m_l | m_l << 16 (against a token's bsums words 2l,
// 2l+1), dd[0][k] = d, dd[1][k] = -dmin (exact). Rows k >= n: zero.
struct Q4KAmxBlock {
  int8_t bt[8 * 512];
  int32_t sc[8][16], mm[8][16];
  float dd[2][16];
};
static_assert(sizeof(Q4KAmxBlock) == kQ4KAmxGroupBlockBytes);

KILN_KQ_AMX void PackQ4KAmxRows(const WeightMatrix& w, int64_t r, int n, Q4KAmxBlock* out) {
  const int64_t nb = w.n_cols / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const block_q4_K* rows[16];
  for (int k = 0; k < n; ++k) rows[k] = reinterpret_cast<const block_q4_K*>(w.row(r + k).data());
  for (int64_t i = 0; i < nb; ++i) {
    Q4KAmxBlock& pb = out[i];
    if (n < 16) std::memset(&pb, 0, sizeof pb);
    for (int jj = 0; jj < 4; ++jj) {  // sub-blocks 2jj (low nibbles) and 2jj + 1 (high)
      __m256i lo[16], hi[16];
      for (int k = 0; k < 16; ++k) {
        if (k < n) {
          const __m256i q =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[k][i].qs + 32 * jj));
          lo[k] = _mm256_and_si256(q, m4);
          hi[k] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        } else {
          lo[k] = hi[k] = _mm256_setzero_si256();
        }
      }
      amx_store_b_columns(lo, pb.bt + 2 * jj * 512);
      amx_store_b_columns(hi, pb.bt + (2 * jj + 1) * 512);
    }
    // Row k's eight 6-bit scales and mins as bytes [sc0..7 | m0..7] (ScalesMinsK4), then per j
    // the 16 rows' bytes gathered as dwords: sc[j] and mm[j] whole vectors instead of 256
    // scalar stores. 4 bytes of padding: the last row's last gather reads 3 bytes past its 16.
    alignas(64) uint8_t sm[16 * 16 + 4] = {};
    for (int k = 0; k < n; ++k) {
      const block_q4_K& b = rows[k][i];
      ScalesMinsK4(b.scales, sm + 16 * k);
      pb.dd[0][k] = f16_to_f32(b.d);
      pb.dd[1][k] = -f16_to_f32(b.dmin);
    }
    const __m512i rows16 =
        _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    const __m512i byte = _mm512_set1_epi32(0xFF);
    for (int j = 0; j < 8; ++j) {
      const __m512i sc = _mm512_and_si512(_mm512_i32gather_epi32(rows16, sm + j, 1), byte);
      const __m512i m = _mm512_and_si512(_mm512_i32gather_epi32(rows16, sm + 8 + j, 1), byte);
      _mm512_storeu_si512(pb.sc[j], sc);
      _mm512_storeu_si512(pb.mm[j], _mm512_or_si512(m, _mm512_slli_epi32(m, 16)));
    }
  }
}

// Block i's sub-blocks s0..s0+3 into C tiles 0..3 (A tiles 4/5 and B tiles 6/7 alternating) and
// out to c[s0..s0+3]. Macros: the tile intrinsics need literal tile numbers.
#define KILN_Q4K_AMX_SUB(ct, at, btile, a, lda, bt, s) \
  do {                                                 \
    _tile_loadd(at, (a) + 32 * (s), lda);              \
    _tile_loadd(btile, (bt) + (s)*512, 64);            \
    _tile_dpbssd(ct, at, btile);                       \
  } while (0)
#define KILN_Q4K_AMX_HALF(a, lda, bt, s0, c)         \
  do {                                               \
    _tile_zero(0);                                   \
    _tile_zero(1);                                   \
    _tile_zero(2);                                   \
    _tile_zero(3);                                   \
    KILN_Q4K_AMX_SUB(0, 4, 6, a, lda, bt, (s0));     \
    KILN_Q4K_AMX_SUB(1, 5, 7, a, lda, bt, (s0) + 1); \
    KILN_Q4K_AMX_SUB(2, 4, 6, a, lda, bt, (s0) + 2); \
    KILN_Q4K_AMX_SUB(3, 5, 7, a, lda, bt, (s0) + 3); \
    _tile_stored(0, (c)[(s0)], 64);                  \
    _tile_stored(1, (c)[(s0) + 1], 64);              \
    _tile_stored(2, (c)[(s0) + 2], 64);              \
    _tile_stored(3, (c)[(s0) + 3], 64);              \
  } while (0)

// m tokens (Q8_K rows ldx bytes apart from xq) x one packed 16-row group: rows k < n of token t
// to y[t * ldy + k].
template <int kM>
KILN_KQ_AMX void DotQ4KAmx(const Q4KAmxBlock* pb, int64_t nb, const std::byte* xq, size_t ldx,
                           int m, int n, float* y, int64_t ldy) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) int32_t c[8][16][16];
  const auto lda = static_cast<long>(ldx);
  for (int64_t i = 0; i < nb; ++i) {
    const Q4KAmxBlock& b = pb[i];
    const std::byte* a = xq + i * sizeof(block_q8_K) + offsetof(block_q8_K, qs);
    KILN_Q4K_AMX_HALF(a, lda, b.bt, 0, c);
    KILN_Q4K_AMX_HALF(a, lda, b.bt, 4, c);
    const __m512 d16 = _mm512_load_ps(b.dd[0]), nm16 = _mm512_load_ps(b.dd[1]);
    _Pragma("GCC unroll 16") for (int t = 0; t < (kM > 0 ? kM : 16); ++t) {
      if (kM == 0 && t >= m) break;
      const auto& yq = reinterpret_cast<const block_q8_K*>(xq + t * ldx)[i];
      __m512i t1 = _mm512_mullo_epi32(_mm512_load_si512(c[0][t]), _mm512_load_si512(b.sc[0]));
      for (int j = 1; j < 8; ++j)
        t1 = _mm512_add_epi32(
            t1, _mm512_mullo_epi32(_mm512_load_si512(c[j][t]), _mm512_load_si512(b.sc[j])));
      __m512i t2 = _mm512_setzero_si512();
      for (int l = 0; l < 8; ++l) {
        int32_t pair;  // bsums[2l] | bsums[2l + 1] << 16
        std::memcpy(&pair, yq.bsums + 2 * l, 4);
        t2 = _mm512_dpwssd_epi32(t2, _mm512_set1_epi32(pair), _mm512_load_si512(b.mm[l]));
      }
      const __m512 yd = _mm512_set1_ps(yq.d);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d16, yd), _mm512_cvtepi32_ps(t1), acc[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(nm16, yd), _mm512_cvtepi32_ps(t2), acc[t]);
    }
  }
  const auto rows = static_cast<__mmask16>((1u << n) - 1);
  for (int t = 0; t < m; ++t) _mm512_mask_storeu_ps(y + t * ldy, rows, acc[t]);
}
#undef KILN_Q4K_AMX_HALF
#undef KILN_Q4K_AMX_SUB

// Q6_K the same way, per group of 16 quants (its scales' unit): TDPBSSD of 16 tokens x 16
// activation quants by a B tile of the group's 16 rows' signed codes q - 32 (so no offset term),
// each (token, row) the group's exact sum; the epilogue's T = sum_g sc_g * sum_g by vpmulld, then
// DotQ6K's FMA per block.
// Tiles 0..3: C; 4, 5: A (m tokens x 16 bytes); 6, 7: B (4 x 64 bytes).
KILN_KQ_AMX void ConfigureQ6KTiles(int m) { configure_amx_tiles(m, 16, 4); }

struct Q6KAmxBlock {
  int8_t bt[16 * 256];  // group g: bt[g * 256 + kk * 64 + k * 4 + e] = row k's code 16g + 4kk + e
  int32_t sc[16][16];   // group g's scale of row k
  float d[16];
};
static_assert(sizeof(Q6KAmxBlock) == kQ6KAmxGroupBlockBytes);

// Bits shift and shift + 1 of each byte of v, at bits 4..5 (a Q6_K code's high bits).
KILN_KQ_INLINE __m256i Q6KHigh2(__m256i v, int shift, __m256i m3) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, shift), m3), 4);
}

KILN_KQ_AMX void PackQ6KAmxRows(const WeightMatrix& w, int64_t r, int n, Q6KAmxBlock* out) {
  const int64_t nb = w.n_cols / 256;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), c32 = _mm256_set1_epi8(32);
  const quant::block_q6_K* rows[16];
  for (int k = 0; k < n; ++k)
    rows[k] = reinterpret_cast<const quant::block_q6_K*>(w.row(r + k).data());
  for (int64_t i = 0; i < nb; ++i) {
    Q6KAmxBlock& pb = out[i];
    if (n < 16) std::memset(&pb, 0, sizeof pb);
    for (int h = 0; h < 2; ++h) {  // the format's layout: codes 128h + 32x + l from ql, qh
      // c[x][k]: row k's 32 signed codes of groups 8h + 2x and 8h + 2x + 1 (dwords 0..3 of
      // the first group, 4..7 of the second: amx_store_b_columns puts dword d at d * 64, so the
      // second group's tile starts 256 bytes after the first's).
      __m256i c[4][16];
      for (int k = 0; k < 16; ++k) {
        if (k >= n) {
          for (int x = 0; x < 4; ++x) c[x][k] = _mm256_setzero_si256();
          continue;
        }
        const quant::block_q6_K& b = rows[k][i];
        const __m256i la = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h));
        const __m256i lb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h));
        c[0][k] =
            _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(la, m4), Q6KHigh2(qh, 0, m3)), c32);
        c[1][k] =
            _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lb, m4), Q6KHigh2(qh, 2, m3)), c32);
        c[2][k] = _mm256_sub_epi8(
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(la, 4), m4), Q6KHigh2(qh, 4, m3)),
            c32);
        c[3][k] = _mm256_sub_epi8(
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lb, 4), m4), Q6KHigh2(qh, 6, m3)),
            c32);
      }
      for (int x = 0; x < 4; ++x) amx_store_b_columns(c[x], pb.bt + (8 * h + 2 * x) * 256);
    }
    for (int k = 0; k < n; ++k) {
      const quant::block_q6_K& b = rows[k][i];
      for (int g = 0; g < 16; ++g) pb.sc[g][k] = b.scales[g];
      pb.d[k] = f16_to_f32(b.d);
    }
  }
}

#define KILN_Q6K_AMX_GROUP(ct, at, btile, a, lda, bt, g) \
  do {                                                   \
    _tile_loadd(at, (a) + 16 * (g), lda);                \
    _tile_loadd(btile, (bt) + (g)*256, 64);              \
    _tile_dpbssd(ct, at, btile);                         \
  } while (0)
#define KILN_Q6K_AMX_QUARTER(a, lda, bt, g0, c)        \
  do {                                                 \
    _tile_zero(0);                                     \
    _tile_zero(1);                                     \
    _tile_zero(2);                                     \
    _tile_zero(3);                                     \
    KILN_Q6K_AMX_GROUP(0, 4, 6, a, lda, bt, (g0));     \
    KILN_Q6K_AMX_GROUP(1, 5, 7, a, lda, bt, (g0) + 1); \
    KILN_Q6K_AMX_GROUP(2, 4, 6, a, lda, bt, (g0) + 2); \
    KILN_Q6K_AMX_GROUP(3, 5, 7, a, lda, bt, (g0) + 3); \
    _tile_stored(0, (c)[(g0)], 64);                    \
    _tile_stored(1, (c)[(g0) + 1], 64);                \
    _tile_stored(2, (c)[(g0) + 2], 64);                \
    _tile_stored(3, (c)[(g0) + 3], 64);                \
  } while (0)

template <int kM>
KILN_KQ_AMX void DotQ6KAmx(const Q6KAmxBlock* pb, int64_t nb, const std::byte* xq, size_t ldx,
                           int m, int n, float* y, int64_t ldy) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) int32_t c[16][16][16];
  const auto lda = static_cast<long>(ldx);
  for (int64_t i = 0; i < nb; ++i) {
    const Q6KAmxBlock& b = pb[i];
    const std::byte* a = xq + i * sizeof(block_q8_K) + offsetof(block_q8_K, qs);
    KILN_Q6K_AMX_QUARTER(a, lda, b.bt, 0, c);
    KILN_Q6K_AMX_QUARTER(a, lda, b.bt, 4, c);
    KILN_Q6K_AMX_QUARTER(a, lda, b.bt, 8, c);
    KILN_Q6K_AMX_QUARTER(a, lda, b.bt, 12, c);
    const __m512 d16 = _mm512_load_ps(b.d);
    _Pragma("GCC unroll 16") for (int t = 0; t < (kM > 0 ? kM : 16); ++t) {
      if (kM == 0 && t >= m) break;
      __m512i tot = _mm512_mullo_epi32(_mm512_load_si512(c[0][t]), _mm512_load_si512(b.sc[0]));
      for (int g = 1; g < 16; ++g)
        tot = _mm512_add_epi32(
            tot, _mm512_mullo_epi32(_mm512_load_si512(c[g][t]), _mm512_load_si512(b.sc[g])));
      const float yd = reinterpret_cast<const block_q8_K*>(xq + t * ldx)[i].d;
      acc[t] =
          _mm512_fmadd_ps(_mm512_mul_ps(d16, _mm512_set1_ps(yd)), _mm512_cvtepi32_ps(tot), acc[t]);
    }
  }
  const auto rows = static_cast<__mmask16>((1u << n) - 1);
  for (int t = 0; t < m; ++t) _mm512_mask_storeu_ps(y + t * ldy, rows, acc[t]);
}
#undef KILN_Q6K_AMX_QUARTER
#undef KILN_Q6K_AMX_GROUP

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

// Row blocks of up to q4k_amx_groups / q6k_amx_groups(nb) groups of 16 rows, packed at once, x
// tiles of 16 tokens (a last one of fewer). `scratch` holds q4k / q6k_amx_scratch_bytes(nb).
template <
    class PackedBlock, int64_t (*Groups)(int64_t), void (*Configure)(int),
    void (*Pack)(const WeightMatrix&, int64_t, int, PackedBlock*),
    void (*Dot16)(const PackedBlock*, int64_t, const std::byte*, size_t, int, int, float*, int64_t),
    void (*DotM)(const PackedBlock*, int64_t, const std::byte*, size_t, int, int, float*, int64_t)>
KILN_KQ_AMX void MatmulKQAmx(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 256, ldy = w.n_rows, groups = Groups(nb);
  auto* p = reinterpret_cast<std::byte*>(scratch);
  auto* packed = Align64<PackedBlock>(p, static_cast<size_t>(groups * nb));
  int configured = 0;
  for (int64_t b0 = r0; b0 < r1; b0 += 16 * groups) {
    const int64_t b1 = std::min(r1, b0 + 16 * groups);
    for (int64_t r = b0; r < b1; r += 16)
      Pack(w, r, static_cast<int>(std::min<int64_t>(16, b1 - r)), packed + (r - b0) / 16 * nb);
    for (int64_t t0 = 0; t0 < job.n_tok; t0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, job.n_tok - t0));
      if (m != configured) {
        Configure(m);
        configured = m;
      }
      const std::byte* xq = job.xq + t0 * job.xq_row_bytes;
      for (int64_t r = b0; r < b1; r += 16) {
        const int n = static_cast<int>(std::min<int64_t>(16, b1 - r));
        const PackedBlock* pb = packed + (r - b0) / 16 * nb;
        float* y = job.y + t0 * ldy + r;
        (m == 16 ? Dot16 : DotM)(pb, nb, xq, job.xq_row_bytes, m, n, y, ldy);
      }
    }
  }
  _tile_release();
}

void MatmulQ4KAmx(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  MatmulKQAmx<Q4KAmxBlock, q4k_amx_groups, ConfigureQ4KTiles, PackQ4KAmxRows, DotQ4KAmx<16>,
              DotQ4KAmx<0>>(job, r0, r1, scratch);
}
void MatmulQ6KAmx(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  MatmulKQAmx<Q6KAmxBlock, q6k_amx_groups, ConfigureQ6KTiles, PackQ6KAmxRows, DotQ6KAmx<16>,
              DotQ6KAmx<0>>(job, r0, r1, scratch);
}
#undef KILN_KQ_AMX
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
