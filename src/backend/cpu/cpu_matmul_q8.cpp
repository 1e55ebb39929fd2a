// backend/cpu/cpu_matmul_q8.cpp: Q8_0 / Q4_0 / Q5_0 / IQ4_NL / MXFP4 matmuls of several tokens
// (prefill, batched decode) on AVX-512 VNNI and AMX, giving each token the plain kernel's
// (cpu_matmul.cpp DotQ8Family) bits.
//
// The plain kernel spends, per row, token and 32-weight block, two psignb (AVX-512 has no
// 512-bit psignb), a 256-bit vpdpbusd, a lane reduction, a scalar multiply for the scale and a
// cvt + fma. Here, once per row block, the weights are biased to unsigned (w + 128) and packed
// 16 rows side by side, 4 quants of each row per dword (the VNNI layout), and once per token
// group each token's block quants, scale and bias correction are copied into a tile. One
// vpdpbusd of a chunk of 16 rows against one token's 4 quants (a broadcast) adds 4 products to
// each row's lane, so 8 of them give 16 rows' exact block totals for that token with no lane
// reduction at all, and the float steps are the plain kernel's: fma(dw * yd, float(total),
// acc) block by block. So each token's output is the plain kernel's bits whatever the tiling.
#define HWY_WANT_AVX3_DL 1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_matmul_q8.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <utility>

#if defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "amx_tiles.h"
#include "cpu_matmul_q8.h"
#include "quant/blocks.h"

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX3_DL

// One row's weights as signed quants (32 per block) and f32 block scales, as the plain
// kernel's Unpack gives them (cpu_matmul.cpp UnpackRowQ8).
using Q8UnpackRow = void (*)(const std::byte* row, int64_t nb, int8_t* q, float* d);

// Highway's AVX3_DL target string names AVX-VNNI but not AVX512-VNNI, which the 512-bit forms
// need (as in cpu_matmul.cpp); no lambdas in these functions: clang would compile them
// without the target.
#define KILN_Q8_VNNI __attribute__((target(HWY_TARGET_STR ",avx512vnni"), noinline))

namespace {

// Packed rows, per group of 16 rows and block i: 8 chunks of 64 bytes, chunk c holding the 16
// rows' quants 4c..4c+3 biased to unsigned (w + 128, as w ^ 0x80) side by side, row k at bytes
// 4k..4k+3 (the layout of an AMX B tile: amx_store_b_columns), at pq + (g * nb + i) * 512; the
// 16 rows' scales at pd + (g * nb + i) * 16.
constexpr size_t kQ8GroupBlockBytes = 512;

// Rows r..r+n (n <= 16; the others zero, their outputs never stored) packed into one group at
// pq (nb * 512 bytes) and pd (nb * 16 floats), each quant XOR `flip` (0x80: biased to unsigned
// for vpdpbusd; 0: signed, an AMX B tile for TDPBSSD); rq / rd hold the unpacked rows. Q8_0 is
// read straight from its blocks (its quants are the operands as they stand, its scale an f16
// that F16C converts exactly, as UnpackQ8_0 does).
KILN_Q8_VNNI void PackQ8Group(const WeightMatrix& w, int64_t r, int n, Q8UnpackRow unpack,
                              int8_t* rq, float* rd, int8_t* pq, float* pd, uint8_t flip) {
  const int64_t nb = w.n_cols / 32;
  alignas(32) static constexpr int8_t kZero[32] = {};
  const int8_t* src[16];
  int64_t stride[16];
  for (int k = 0; k < 16; ++k) {
    float* d = rd + k * nb;
    if (k >= n) {
      src[k] = kZero;
      stride[k] = 0;
      std::fill_n(d, nb, 0.0f);
    } else if (w.dtype == DType::Q8_0) {
      const auto* blk = reinterpret_cast<const quant::block_q8_0*>(w.row(r + k).data());
      for (int64_t i = 0; i < nb; ++i) d[i] = _cvtsh_ss(blk[i].d.bits);
      src[k] = blk[0].qs;
      stride[k] = sizeof(quant::block_q8_0);
    } else {
      unpack(w.row(r + k).data(), nb, rq + k * nb * 32, d);
      src[k] = rq + k * nb * 32;
      stride[k] = 32;
    }
  }
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(flip));
  for (int64_t i = 0; i < nb; ++i) {
    __m256i v[16];
    for (int k = 0; k < 16; ++k)
      v[k] = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[k] + stride[k] * i)), bias);
    amx_store_b_columns(v, pq + i * kQ8GroupBlockBytes);
    for (int k = 0; k < 16; ++k) pd[i * 16 + k] = rd[k * nb + i];
  }
}

// Token tile: up to kQ8VnniTok tokens, per block i at tile + i * kQ8TileBlockBytes: token t's
// 32 quants at 32t, its scale at 32 * kQ8VnniTok + 4t and -128 * (sum of its quants) at
// 36 * kQ8VnniTok + 4t, what the weights' +128 bias adds to each of the block's dot products.
KILN_Q8_VNNI void FillQ8Tile(const ActQ8_0* const* ys, int m, int64_t nb, std::byte* tile) {
  constexpr size_t kD = 32 * kQ8VnniTok, kC = 36 * kQ8VnniTok;
  for (int64_t i = 0; i < nb; ++i) {
    std::byte* b = tile + i * kQ8TileBlockBytes;
    for (int t = 0; t < m; ++t) {
      const ActQ8_0& y = ys[t][i];
      std::memcpy(b + 32 * t, y.qs, 32);
      int32_t sum = 0;
      for (int e = 0; e < 32; ++e) sum += y.qs[e];
      const int32_t corr = -128 * sum;
      std::memcpy(b + kD + 4 * t, &y.d, 4);
      std::memcpy(b + kC + 4 * t, &corr, 4);
    }
  }
}

// Register tile: RG groups of 16 rows (lanes: the group's 16 rows) x T tokens of the tile. Per
// block, 8 vpdpbusd per (group, token) sum the block's 32 products w * y into one int32 lane
// per row: the chunk of 4 quants of the 16 rows against the token's 4 quants broadcast, from
// the token's bias correction; exact (|total| < 2^21), so each lane holds the plain kernel's
// block total. Then the plain kernel's float step, fma(dw * yd, float(total), acc), in block
// order: each (row, token) output has its bits. Rows k < rows of token t to y[t * ldy + k].
template <int RG, int T>
KILN_Q8_VNNI void DotQ8Rows16(const int8_t* pq, const float* pd, int64_t nb, const std::byte* tile,
                              float* y, int64_t ldy, int rows) {
  constexpr size_t kD = 32 * kQ8VnniTok, kC = 36 * kQ8VnniTok;
  const size_t group_bytes = static_cast<size_t>(nb) * kQ8GroupBlockBytes;
  __m512 acc[RG][T];
  for (int g = 0; g < RG; ++g)
    for (int t = 0; t < T; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nb; ++i) {
    const std::byte* tb = tile + i * kQ8TileBlockBytes;
    const int8_t* wb = pq + i * kQ8GroupBlockBytes;
    __m512i s[RG][T];
    for (int t = 0; t < T; ++t) {
      int32_t corr;
      std::memcpy(&corr, tb + kC + 4 * t, 4);
      for (int g = 0; g < RG; ++g) s[g][t] = _mm512_set1_epi32(corr);
    }
    _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c) {
      __m512i wv[RG];
      for (int g = 0; g < RG; ++g) wv[g] = _mm512_load_si512(wb + g * group_bytes + 64 * c);
      for (int t = 0; t < T; ++t) {
        int32_t q;
        std::memcpy(&q, tb + 32 * t + 4 * c, 4);
        const __m512i yv = _mm512_set1_epi32(q);
        for (int g = 0; g < RG; ++g) s[g][t] = _mm512_dpbusd_epi32(s[g][t], wv[g], yv);
      }
    }
    for (int g = 0; g < RG; ++g) {
      const __m512 dw = _mm512_load_ps(pd + (g * nb + i) * 16);
      for (int t = 0; t < T; ++t) {
        float yd;
        std::memcpy(&yd, tb + kD + 4 * t, 4);
        acc[g][t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(yd)),
                                    _mm512_cvtepi32_ps(s[g][t]), acc[g][t]);
      }
    }
  }
  for (int g = 0; g < RG; ++g) {
    const int k = std::min(16, rows - 16 * g);
    const auto mask = static_cast<__mmask16>(k >= 16 ? 0xFFFF : (1u << k) - 1);
    for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + t * ldy + 16 * g, mask, acc[g][t]);
  }
}

using DotQ8Fn = void (*)(const int8_t*, const float*, int64_t, const std::byte*, float*, int64_t,
                         int);
template <int RG, int... Ts>
constexpr std::array<DotQ8Fn, sizeof...(Ts)> MakeDotQ8(std::integer_sequence<int, Ts...>) {
  return {&DotQ8Rows16<RG, Ts + 1>...};
}
// [row groups - 1][tokens - 1]
constexpr std::array<DotQ8Fn, kQ8VnniTok> kDotQ8[kQ8VnniRowGroups] = {
    MakeDotQ8<1>(std::make_integer_sequence<int, kQ8VnniTok>{}),
    MakeDotQ8<2>(std::make_integer_sequence<int, kQ8VnniTok>{})};

template <class T>
T* Align64(std::byte*& p, size_t count) {
  p = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  T* out = reinterpret_cast<T*>(p);
  p += count * sizeof(T);
  return out;
}

// ---------------------------------------------------------------- AMX (Sapphire Rapids+)
// TDPBSSD multiplies a tile of 16 tokens x 32 signed activation quants (one block, read in
// place from the activation rows) by a B tile of the same block of 16 rows (their 32 signed
// quants, 4 consecutive ones of each row side by side: the VNNI layout, PackQ8Group), giving each
// (token, row) the exact int32 total of the block's 32 products. The epilogue is the plain
// kernel's float step per block, 16 rows wide: fma(dw * yd, float(total), acc), in block order.
// Blocks go in pairs, the next pair's products issued before the current pair's epilogue
// (DotQ8Amx).

#define KILN_Q8_AMX \
  __attribute__((target(HWY_TARGET_STR ",avx512vnni,amx-tile,amx-int8"), noinline))

// Tiles (configure_amx_tiles): C 0..3 hold two blocks' results in flight while two more are
// computed; A 4, 5 one block (32 quants) of m tokens; B 6, 7 one block of 16 rows.

// acc[t] (16 rows) += block i's totals c[t] scaled by dw * yd of token t, for t < m.
template <int kM>
HWY_INLINE void Q8AmxEpilogue(const int32_t (*c)[16], const float* bd, const std::byte* xq,
                              size_t ldx, int64_t i, int m, __m512* acc) {
  const __m512 dw = _mm512_load_ps(bd + i * 16);
  _Pragma("GCC unroll 16") for (int t = 0; t < (kM > 0 ? kM : 16); ++t) {
    if (kM == 0 && t >= m) break;
    const float yd = reinterpret_cast<const ActQ8_0*>(xq + t * ldx)[i].d;
    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(yd)),
                             _mm512_cvtepi32_ps(_mm512_load_si512(c[t])), acc[t]);
  }
}

// m tokens (activation rows ldx bytes apart from xq) x one packed 16-row group: rows k < n of
// token t to y[t * ldy + k]. kM: 16 for a whole tile, 0 for a last partial one of m tokens.
// Blocks i and i + 1 into C tiles c0, c1 (A tiles 4, 5; B tiles 6, 7), and those C tiles to c.
// Macros: GCC's tile intrinsics paste their tile numbers into the asm text, so they must be
// literals (a template parameter's name reached the assembler).
#define KILN_Q8_AMX_ISSUE_PAIR(c0, c1, bt, a, lda, i)       \
  do {                                                      \
    _tile_zero(c0);                                         \
    _tile_zero(c1);                                         \
    _tile_loadd(4, (a) + (i) * sizeof(ActQ8_0), lda);       \
    _tile_loadd(6, (bt) + (i)*512, 64);                     \
    _tile_loadd(5, (a) + ((i) + 1) * sizeof(ActQ8_0), lda); \
    _tile_loadd(7, (bt) + ((i) + 1) * 512, 64);             \
    _tile_dpbssd(c0, 4, 6);                                 \
    _tile_dpbssd(c1, 5, 7);                                 \
  } while (0)
#define KILN_Q8_AMX_STORE_PAIR(c0, c1, c) \
  do {                                    \
    _tile_stored(c0, (c)[0], 64);         \
    _tile_stored(c1, (c)[1], 64);         \
  } while (0)

template <int kM>
KILN_Q8_AMX void DotQ8Amx(const int8_t* bt, const float* bd, int64_t nb, const std::byte* xq,
                          size_t ldx, int m, int n, float* y, int64_t ldy) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  alignas(64) int32_t c[2][16][16];
  const std::byte* a = xq + offsetof(ActQ8_0, qs);
  const auto lda = static_cast<long>(ldx);
  // Pairs of blocks alternate between C tiles 0/1 and 2/3: the next pair's products are issued
  // before the current pair's results are stored and scaled, so the tile unit and the epilogue
  // overlap; the epilogues still run in block order.
  int64_t i = 0;
  if (nb >= 2) KILN_Q8_AMX_ISSUE_PAIR(0, 1, bt, a, lda, 0);
  while (i + 2 <= nb) {
    if (i + 4 <= nb) KILN_Q8_AMX_ISSUE_PAIR(2, 3, bt, a, lda, i + 2);
    KILN_Q8_AMX_STORE_PAIR(0, 1, c);
    Q8AmxEpilogue<kM>(c[0], bd, xq, ldx, i, m, acc);
    Q8AmxEpilogue<kM>(c[1], bd, xq, ldx, i + 1, m, acc);
    i += 2;
    if (i + 2 > nb) break;
    if (i + 4 <= nb) KILN_Q8_AMX_ISSUE_PAIR(0, 1, bt, a, lda, i + 2);
    KILN_Q8_AMX_STORE_PAIR(2, 3, c);
    Q8AmxEpilogue<kM>(c[0], bd, xq, ldx, i, m, acc);
    Q8AmxEpilogue<kM>(c[1], bd, xq, ldx, i + 1, m, acc);
    i += 2;
  }
  if (i < nb) {  // a last odd block (every pair before it is stored)
    _tile_zero(0);
    _tile_loadd(4, a + i * sizeof(ActQ8_0), lda);
    _tile_loadd(6, bt + i * 512, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_stored(0, c[0], 64);
    Q8AmxEpilogue<kM>(c[0], bd, xq, ldx, i, m, acc);
  }
  const auto rows = static_cast<__mmask16>((1u << n) - 1);
  for (int t = 0; t < m; ++t) _mm512_mask_storeu_ps(y + t * ldy, rows, acc[t]);
}

// Blocks of up to q8_amx_groups(nb) groups of 16 rows, packed at once (one long read of the
// rows: 16 rows at a time left the hardware prefetcher a short stream per group, and the reads
// ran at a fraction of the memory's speed) x tiles of 16 tokens (a last one of fewer).
KILN_Q8_AMX void MatmulQ8Amx(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch,
                             Q8UnpackRow unpack) {
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 32, ldy = w.n_rows, groups = q8_amx_groups(nb);
  auto* p = reinterpret_cast<std::byte*>(scratch);
  int8_t* rq = Align64<int8_t>(p, static_cast<size_t>(16 * nb * 32));
  float* rd = Align64<float>(p, static_cast<size_t>(16 * nb));
  int8_t* bt = Align64<int8_t>(p, static_cast<size_t>(groups * nb * 512));
  float* bd = Align64<float>(p, static_cast<size_t>(groups * nb * 16));
  int configured = 0;
  for (int64_t b0 = r0; b0 < r1; b0 += 16 * groups) {
    const int64_t b1 = std::min(r1, b0 + 16 * groups);
    for (int64_t r = b0; r < b1; r += 16) {
      const int64_t g = (r - b0) / 16;
      const int n = static_cast<int>(std::min<int64_t>(16, b1 - r));
      PackQ8Group(w, r, n, unpack, rq, rd, bt + g * nb * 512, bd + g * nb * 16, 0);
    }
    for (int64_t t0 = 0; t0 < job.n_tok; t0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, job.n_tok - t0));
      if (m != configured) {
        configure_amx_tiles(m, 32, 8);
        configured = m;
      }
      const std::byte* xq = job.xq + t0 * job.xq_row_bytes;
      for (int64_t r = b0; r < b1; r += 16) {
        const int64_t g = (r - b0) / 16;
        const int n = static_cast<int>(std::min<int64_t>(16, b1 - r));
        float* y = job.y + t0 * ldy + r;
        if (m == 16)
          DotQ8Amx<16>(bt + g * nb * 512, bd + g * nb * 16, nb, xq, job.xq_row_bytes, m, n, y, ldy);
        else
          DotQ8Amx<0>(bt + g * nb * 512, bd + g * nb * 16, nb, xq, job.xq_row_bytes, m, n, y, ldy);
      }
    }
  }
  _tile_release();
}
#undef KILN_Q8_AMX_ISSUE_PAIR
#undef KILN_Q8_AMX_STORE_PAIR
#undef KILN_Q8_AMX

}  // namespace

// Token groups x row blocks x token tiles x register tiles of up to 32 rows x kQ8VnniTok
// tokens: each token's tile is built once per group and each row block packed once per group.
// `scratch` holds q8_vnni_scratch_bytes(n_cols). From kQ8AmxMinTok tokens on a machine with
// AMX-INT8 (and CpuOptions::amx), the AMX kernel above instead.
void MatmulQ8Vnni(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch,
                  Q8UnpackRow unpack) {
  static_assert(kQ8VnniRowGroups == 2);
  if (job.amx && job.n_tok >= kQ8AmxMinTok && amx_usable())
    return MatmulQ8Amx(job, r0, r1, scratch, unpack);
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 32, ldy = w.n_rows;
  const int64_t rb = q8_vnni_rows_per_block(nb), group = q8_vnni_group_tokens(nb);
  auto* p = reinterpret_cast<std::byte*>(scratch);
  int8_t* pq = Align64<int8_t>(p, static_cast<size_t>(rb / 16 * nb) * kQ8GroupBlockBytes);
  float* pd = Align64<float>(p, static_cast<size_t>(rb * nb));
  std::byte* tiles =
      Align64<std::byte>(p, static_cast<size_t>(group / kQ8VnniTok * nb) * kQ8TileBlockBytes);
  int8_t* rq = Align64<int8_t>(p, static_cast<size_t>(16 * nb * 32));
  float* rd = Align64<float>(p, static_cast<size_t>(16 * nb));
  const ActQ8_0* ys[kQ8VnniTok];
  const size_t tile_bytes = static_cast<size_t>(nb) * kQ8TileBlockBytes;
  for (int64_t g0 = 0; g0 < job.n_tok; g0 += group) {
    const int64_t g1 = std::min(job.n_tok, g0 + group);
    for (int64_t t0 = g0; t0 < g1; t0 += kQ8VnniTok) {
      const int m = static_cast<int>(std::min<int64_t>(kQ8VnniTok, g1 - t0));
      for (int k = 0; k < m; ++k)
        ys[k] = reinterpret_cast<const ActQ8_0*>(job.xq + (t0 + k) * job.xq_row_bytes);
      FillQ8Tile(ys, m, nb, tiles + (t0 - g0) / kQ8VnniTok * tile_bytes);
    }
    for (int64_t b0 = r0; b0 < r1; b0 += rb) {
      const int64_t b1 = std::min(r1, b0 + rb);
      for (int64_t r = b0; r < b1; r += 16) {
        const int64_t g = (r - b0) / 16;
        PackQ8Group(w, r, static_cast<int>(std::min<int64_t>(16, b1 - r)), unpack, rq, rd,
                    pq + g * nb * static_cast<int64_t>(kQ8GroupBlockBytes), pd + g * nb * 16, 0x80);
      }
      for (int64_t t0 = g0; t0 < g1; t0 += kQ8VnniTok) {
        const int m = static_cast<int>(std::min<int64_t>(kQ8VnniTok, g1 - t0));
        const std::byte* tile = tiles + (t0 - g0) / kQ8VnniTok * tile_bytes;
        for (int64_t r = b0; r < b1; r += 16 * kQ8VnniRowGroups) {
          const int rows = static_cast<int>(std::min<int64_t>(16 * kQ8VnniRowGroups, b1 - r));
          const int64_t g = (r - b0) / 16;
          kDotQ8[(rows + 15) / 16 - 1][m - 1](
              pq + g * nb * static_cast<int64_t>(kQ8GroupBlockBytes), pd + g * nb * 16, nb, tile,
              job.y + t0 * ldy + r, ldy, rows);
        }
      }
    }
  }
}

#undef KILN_Q8_VNNI
#endif  // HWY_ARCH_X86 && HWY_AVX3_DL

// Q8_0 activation blocks with AVX-512 (where this target has it), the same bytes as
// quantize_act_row's scalar loop, which is compiled for the baseline ISA (one serial max and one
// serial probe chain per block). Every step is the loop's: the max of |x| skipping NaN
// (vmaxps returns its second operand, the running max, when |x| is NaN; max is order-free),
// "some x not finite" for the probe (x * 0 is NaN exactly then), d = amax / 127 and its inverse
// in scalar, then per element the product and the rounding add as two separately rounded ops
// (the _round forms: no FMA contraction, as the baseline loop has none) and the mantissa bits.
bool QuantizeQ8_0RowK(const float* x, int64_t n, std::byte* dst) {
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX3_DL
  constexpr int kRn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512i mant = _mm512_set1_epi32(0x007fffff), half = _mm512_set1_epi32(0x00400000);
  auto* out = reinterpret_cast<ActQ8_0*>(dst);
  for (int64_t b = 0; b < n / 32; ++b) {
    const float* xb = x + b * 32;
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a = _mm512_max_ps(_mm512_and_ps(x1, abs_mask),
                                   _mm512_max_ps(_mm512_and_ps(x0, abs_mask), _mm512_setzero_ps()));
    const bool bad = (_mm512_fpclass_ps_mask(x0, 0x99) | _mm512_fpclass_ps_mask(x1, 0x99)) != 0;
    const float amax = _mm512_reduce_max_ps(a);
    const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
    ActQ8_0& q = out[b];
    q.d = bad ? NAN : d;
    if (bad) {
      std::memset(q.qs, 0, sizeof(q.qs));
      continue;
    }
    const __m512 iv = _mm512_set1_ps(id);
    for (int h = 0; h < 2; ++h) {
      const __m512 prod = _mm512_mul_round_ps(h ? x1 : x0, iv, kRn);
      const __m512i bits = _mm512_castps_si512(_mm512_add_round_ps(prod, magic, kRn));
      const __m512i qi = _mm512_sub_epi32(_mm512_and_si512(bits, mant), half);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.qs + 16 * h), _mm512_cvtepi32_epi8(qi));
    }
  }
  return true;
#else
  (void)x;
  (void)n;
  (void)dst;
  return false;
#endif
}

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kiln::cpu {
#if defined(__linux__)
// CPUID.(7,0):EDX bits 24 (AMX-TILE) and 25 (AMX-INT8), and Linux's per-process permission for
// the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), asked once.
bool amx_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if ((d & (1u << 24)) == 0 || (d & (1u << 25)) == 0) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}
#else
bool amx_usable() { return false; }
#endif
HWY_EXPORT(QuantizeQ8_0RowK);
bool quantize_q8_0_simd(const float* x, int64_t n, std::byte* dst) {
  return HWY_DYNAMIC_DISPATCH(QuantizeQ8_0RowK)(x, n, dst);
}
}  // namespace kiln::cpu
#endif
