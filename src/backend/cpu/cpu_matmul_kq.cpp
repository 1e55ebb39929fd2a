// backend/cpu/cpu_matmul_kq.cpp: Q4_K, Q5_K and Q6_K matmuls of many tokens (prefill, the decode
// of many streams) on AVX-512 VNNI and AMX, giving each token the plain kernels' (cpu_matmul.cpp
// DotQ45K, DotQ6K) bits; and the AVX-512 encoder of their Q8_K activations.
//
// Both kernels compute the exact super-block totals every kernel of these types computes
// (docs/determinism.md) with the products laid out 16 rows to a register, 4 consecutive codes
// of each row per dword (the VNNI layout): MatmulKRows16 by vpdpbusd of 16 rows against one
// token's broadcast 4 quants (from kKRowsMinTok tokens), the AMX kernels by TDPBSSD tiles of 16
// tokens (from kQ8AmxMinTok tokens where the machine has AMX-INT8). Each row block is decoded
// once per call, so below those token counts the v2 batched kernels of cpu_matmul.cpp, which
// decode each block as they read it, are faster (tests/ops MatmulKRows16 checks the bits at
// token counts on both sides of each threshold).
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

// ---------------------------------------------------------------- K-quants by 16-row totals (VNNI)
// Q4_K, Q5_K and Q6_K by the exact super-block totals every kernel of theirs computes
// (docs/determinism.md), laid out as the Q8_0 family's VNNI kernel is (cpu_matmul_q8.cpp): each
// row block decoded once into unsigned codes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63), 16 rows side
// by side, 4 codes of each row per dword (amx_store_b_columns); one vpdpbusd of a 16-row chunk
// against one token's 4 activation quants (an embedded broadcast, read in place from its Q8_K
// row) adds 4 products to each row's lane. A scale group's chunks (8 for Q4_K / Q5_K's 32-element
// sub-blocks, 4 for Q6_K's 16-element groups) give each row its exact group sum S_s, and one
// vpmulld by the rows' scales adds sc_s * S_s to T1. The second term comes from vpdpwssd of the
// rows' word pairs against the token's Q8_K bsums read as dwords: Q4_K / Q5_K T2 = sum_j m_j *
// (bsums[2j] + bsums[2j+1]) (pairs (m_j, m_j)); Q6_K sum_g sc_g * bsums[g] (pairs (sc_2p,
// sc_2p+1)), T = T1 - 32 * that. All exact int32 (the plain kernels' bounds), so every lane holds
// the plain kernel's totals, and the float steps are its own: fma(d * yd, T1, acc), then
// fma(-dmin * yd, T2, acc) (Q6_K: fma(d * yd, T, acc)), per block in block order.

// One 16-row group's decode for one block, beside its codes (kKRowsCodeBytes).
struct alignas(64) KRowsMeta {
  int32_t sc[16][16];  // [scale group][row]: Q4_K / Q5_K groups 0..7, Q6_K 0..15
  int32_t pw[8][16];   // [pair][row]: the word pairs above
  float d[16], neg_dmin[16];
};
static_assert(sizeof(KRowsMeta) == kKRowsMetaBytes);

// Two int16 values as one dword's words (low, high), a vpdpwssd operand.
inline int32_t Words(int16_t lo, int16_t hi) {
  return static_cast<int32_t>(static_cast<uint16_t>(lo) |
                              (static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16));
}

// One row's block as 256 unsigned codes (element order) and, for row k of the group, its
// scales, word pairs, d and -dmin in mt, as the plain kernels decode them (DotQ45K, DotQ6K).
template <DType kType>
KILN_KQ_VNNI void DecodeKRow(const std::byte* blk, uint8_t* codes, KRowsMeta& mt, int k) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  if constexpr (kType == DType::Q6_K) {
    const auto& b = *reinterpret_cast<const quant::block_q6_K*>(blk);
    for (int h = 0; h < 2; ++h) {
      __m256i w4[4];
      Q6KGroups(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h)),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.ql + 64 * h + 32)),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh + 32 * h)), w4);
      for (int g = 0; g < 4; ++g)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 128 * h + 32 * g), w4[g]);
    }
    for (int g = 0; g < 16; ++g) mt.sc[g][k] = b.scales[g];
    for (int p = 0; p < 8; ++p) mt.pw[p][k] = Words(b.scales[2 * p], b.scales[2 * p + 1]);
    mt.d[k] = f16_to_f32(b.d);
  } else {
    using Block = std::conditional_t<kType == DType::Q5_K, quant::block_q5_K, block_q4_K>;
    const auto& b = *reinterpret_cast<const Block*>(blk);
    [[maybe_unused]] __m256i hbits;
    if constexpr (kType == DType::Q5_K)
      hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qh));
    for (int j = 0; j < 4; ++j) {
      const __m256i q4 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.qs + 32 * j));
      for (int half = 0; half < 2; ++half) {
        __m256i w =
            half == 0 ? _mm256_and_si256(q4, m4) : _mm256_and_si256(_mm256_srli_epi16(q4, 4), m4);
        if constexpr (kType == DType::Q5_K) {
          w = _mm256_or_si256(
              w, _mm256_and_si256(_mm256_slli_epi16(hbits, 4), _mm256_set1_epi8(0x10)));
          hbits = _mm256_srli_epi16(hbits, 1);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32 * (2 * j + half)), w);
      }
    }
    alignas(16) uint8_t sm[16];
    ScalesMinsK4(b.scales, sm);
    for (int j = 0; j < 8; ++j) {
      mt.sc[j][k] = sm[j];
      mt.pw[j][k] = Words(sm[8 + j], sm[8 + j]);
    }
    mt.d[k] = f16_to_f32(b.d);
    mt.neg_dmin[k] = -f16_to_f32(b.dmin);
  }
}

// Rows r..r+n (n <= 16; the others zero, their outputs never stored) into one group: codes at
// codes + i * kKRowsCodeBytes and the decode at meta[i] for block i; rc holds 16 rows' codes of
// one block.
template <DType kType>
KILN_KQ_VNNI void PackKRowsGroup(const WeightMatrix& w, int64_t r, int n, uint8_t* rc,
                                 uint8_t* codes, KRowsMeta* meta) {
  const int64_t nb = w.n_cols / 256;
  constexpr size_t bb = kType == DType::Q6_K   ? sizeof(quant::block_q6_K)
                        : kType == DType::Q5_K ? sizeof(quant::block_q5_K)
                                               : sizeof(block_q4_K);
  if (n < 16) std::memset(rc + 256 * n, 0, static_cast<size_t>(16 - n) * 256);
  for (int64_t i = 0; i < nb; ++i) {
    KRowsMeta& mt = meta[i];
    mt = KRowsMeta{};  // rows past n, and the groups and pairs a type does not use, stay zero
    for (int k = 0; k < n; ++k)
      DecodeKRow<kType>(w.row(r + k).data() + i * bb, rc + 256 * k, mt, k);
    for (int e = 0; e < 8; ++e) {  // 32 elements (8 chunks) at a time
      __m256i v[16];
      for (int k = 0; k < 16; ++k)
        v[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rc + 256 * k + 32 * e));
      amx_store_b_columns(v, reinterpret_cast<int8_t*>(codes + i * kKRowsCodeBytes + 512 * e));
    }
  }
}

// RG groups of 16 rows (group g's codes at codes + g * nb * kKRowsCodeBytes, its decode at
// meta + g * nb) x T tokens (ys[t]); rows k < rows of token t to y[t * ldy + k].
template <DType kType, int RG, int T>
KILN_KQ_VNNI void DotKRows16(const uint8_t* codes, const KRowsMeta* meta, int64_t nb,
                             const block_q8_K* const* ys, float* y, int64_t ldy, int rows) {
  constexpr bool kQ6 = kType == DType::Q6_K;
  constexpr int kGroups = kQ6 ? 16 : 8, kChunks = 64 / kGroups;
  const size_t gstride = static_cast<size_t>(nb) * kKRowsCodeBytes;
  __m512 acc[RG][T];
  for (int g = 0; g < RG; ++g)
    for (int t = 0; t < T; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* cb = codes + i * kKRowsCodeBytes;
    const KRowsMeta* mb[RG];
    for (int g = 0; g < RG; ++g) mb[g] = meta + g * nb + i;
    const int8_t* yq[T];
    for (int t = 0; t < T; ++t) yq[t] = ys[t][i].qs;
    __m512i t1[RG][T];
    for (int s = 0; s < kGroups; ++s) {
      __m512i sv[RG][T];
      for (int g = 0; g < RG; ++g)
        for (int t = 0; t < T; ++t) sv[g][t] = _mm512_setzero_si512();
      _Pragma("GCC unroll 8") for (int c = 0; c < kChunks; ++c) {
        const int chunk = s * kChunks + c;
        __m512i wv[RG];
        for (int g = 0; g < RG; ++g) wv[g] = _mm512_load_si512(cb + g * gstride + 64 * chunk);
        for (int t = 0; t < T; ++t) {
          int32_t q;
          std::memcpy(&q, yq[t] + 4 * chunk, 4);
          const __m512i yv = _mm512_set1_epi32(q);
          for (int g = 0; g < RG; ++g) sv[g][t] = _mm512_dpbusd_epi32(sv[g][t], wv[g], yv);
        }
      }
      for (int g = 0; g < RG; ++g) {
        const __m512i scv = _mm512_load_si512(mb[g]->sc[s]);
        for (int t = 0; t < T; ++t) {
          const __m512i prod = _mm512_mullo_epi32(sv[g][t], scv);
          t1[g][t] = s == 0 ? prod : _mm512_add_epi32(t1[g][t], prod);
        }
      }
    }
    __m512i t2[RG][T];
    for (int g = 0; g < RG; ++g)
      for (int t = 0; t < T; ++t) t2[g][t] = _mm512_setzero_si512();
    for (int p = 0; p < 8; ++p)
      for (int g = 0; g < RG; ++g) {
        const __m512i pwv = _mm512_load_si512(mb[g]->pw[p]);
        for (int t = 0; t < T; ++t) {
          int32_t bs;
          std::memcpy(&bs, ys[t][i].bsums + 2 * p, 4);
          t2[g][t] = _mm512_dpwssd_epi32(t2[g][t], pwv, _mm512_set1_epi32(bs));
        }
      }
    for (int g = 0; g < RG; ++g) {
      const __m512 dv = _mm512_load_ps(mb[g]->d);
      [[maybe_unused]] __m512 nv;
      if constexpr (!kQ6) nv = _mm512_load_ps(mb[g]->neg_dmin);
      for (int t = 0; t < T; ++t) {
        const __m512 yd = _mm512_set1_ps(ys[t][i].d);
        if constexpr (kQ6) {
          const __m512i tot = _mm512_sub_epi32(t1[g][t], _mm512_slli_epi32(t2[g][t], 5));
          acc[g][t] = _mm512_fmadd_ps(_mm512_mul_ps(dv, yd), _mm512_cvtepi32_ps(tot), acc[g][t]);
        } else {
          acc[g][t] =
              _mm512_fmadd_ps(_mm512_mul_ps(dv, yd), _mm512_cvtepi32_ps(t1[g][t]), acc[g][t]);
          acc[g][t] =
              _mm512_fmadd_ps(_mm512_mul_ps(nv, yd), _mm512_cvtepi32_ps(t2[g][t]), acc[g][t]);
        }
      }
    }
  }
  for (int g = 0; g < RG; ++g) {
    const int k = std::min(16, rows - 16 * g);
    const auto mask = static_cast<__mmask16>(k >= 16 ? 0xFFFF : (1u << k) - 1);
    for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + t * ldy + 16 * g, mask, acc[g][t]);
  }
}

template <DType kType>
using DotKRowsFn = void (*)(const uint8_t*, const KRowsMeta*, int64_t, const block_q8_K* const*,
                            float*, int64_t, int);
template <DType kType, int RG, int... Ts>
constexpr std::array<DotKRowsFn<kType>, sizeof...(Ts)> MakeDotKRows(
    std::integer_sequence<int, Ts...>) {
  return {&DotKRows16<kType, RG, Ts + 1>...};
}
// [row groups - 1][tokens - 1]
template <DType kType>
constexpr std::array<DotKRowsFn<kType>, kKRowsTok> kDotKRows[kKRowsRowGroups] = {
    MakeDotKRows<kType, 1>(std::make_integer_sequence<int, kKRowsTok>{}),
    MakeDotKRows<kType, 2>(std::make_integer_sequence<int, kKRowsTok>{})};

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

template <class T>
T* Align64(std::byte*& p, size_t count) {
  p = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  T* out = reinterpret_cast<T*>(p);
  p += count * sizeof(T);
  return out;
}

}  // namespace

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
// Row blocks (decoded once each) x token tiles of kKRowsTok x register tiles of up to 32 rows.
// `scratch` holds k_rows_scratch_bytes(nb).
template <DType kType>
void MatmulKRows16T(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  static_assert(kKRowsRowGroups == 2);
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 256, ldy = w.n_rows;
  const int64_t rb = k_rows_rows_per_block(nb);
  auto* p = reinterpret_cast<std::byte*>(scratch);
  auto* codes = Align64<uint8_t>(p, static_cast<size_t>(rb / 16 * nb) * kKRowsCodeBytes);
  KRowsMeta* meta = Align64<KRowsMeta>(p, static_cast<size_t>(rb / 16 * nb));
  auto* rc = Align64<uint8_t>(p, 16 * 256);
  const block_q8_K* ys[kKRowsTok];
  for (int64_t b0 = r0; b0 < r1; b0 += rb) {
    const int64_t b1 = std::min(r1, b0 + rb);
    for (int64_t r = b0; r < b1; r += 16) {
      const int64_t g = (r - b0) / 16;
      PackKRowsGroup<kType>(w, r, static_cast<int>(std::min<int64_t>(16, b1 - r)), rc,
                            codes + g * nb * static_cast<int64_t>(kKRowsCodeBytes), meta + g * nb);
    }
    for (int64_t t0 = 0; t0 < job.n_tok; t0 += kKRowsTok) {
      const int m = static_cast<int>(std::min<int64_t>(kKRowsTok, job.n_tok - t0));
      for (int k = 0; k < m; ++k)
        ys[k] = reinterpret_cast<const block_q8_K*>(job.xq + (t0 + k) * job.xq_row_bytes);
      for (int64_t r = b0; r < b1; r += 16 * kKRowsRowGroups) {
        const int rows = static_cast<int>(std::min<int64_t>(16 * kKRowsRowGroups, b1 - r));
        const int64_t g = (r - b0) / 16;
        kDotKRows<kType>[(rows + 15) / 16 - 1][m - 1](
            codes + g * nb * static_cast<int64_t>(kKRowsCodeBytes), meta + g * nb, nb, ys,
            job.y + t0 * ldy + r, ldy, rows);
      }
    }
  }
}

void MatmulKRows16(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch) {
  switch (job.w->dtype) {
    case DType::Q4_K:
      return MatmulKRows16T<DType::Q4_K>(job, r0, r1, scratch);
    case DType::Q5_K:
      return MatmulKRows16T<DType::Q5_K>(job, r0, r1, scratch);
    default:
      return MatmulKRows16T<DType::Q6_K>(job, r0, r1, scratch);
  }
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
