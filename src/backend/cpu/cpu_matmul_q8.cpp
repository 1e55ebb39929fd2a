// backend/cpu/cpu_matmul_q8.cpp: Q8_0 / Q4_0 / Q5_0 matmuls of several tokens (prefill) on
// AVX-512 VNNI, giving each token the plain kernel's (cpu_matmul.cpp DotQ8Family) bits.
//
// The plain kernel spends, per row, token and 32-weight block, two psignb (AVX-512 has no
// 512-bit psignb), a 256-bit vpdpbusd, a scalar multiply for the scale and a 256-bit
// cvt + fma. Here the weights are biased to unsigned once per row block (w + 128, packed with
// every dword twice) and the activations are interleaved in token pairs once per token group
// (dword 2L: token 2p's quants 4L..4L+3, dword 2L+1: token 2p+1's), so one 512-bit vpdpbusd
// gives two tokens' 8 lane sums. The bias adds 128 * (sum of the lane's 4 activations), which
// the accumulator starts at minus (stored with the activations): every int32 lane is then
// exactly the plain kernel's sum of w * y (|lane| < 2^18, no overflow). The float steps are
// the plain kernel's ops on the same values in the same order: lane L of token t accumulates
// fma(dw * yd, float(lane), acc) block by block, and the end sums each token's 8 lanes in
// Hsum's order. So each token's output is the plain kernel's bits whatever the tiling.
// The loop is instruction-bound (~5 per two tokens' block: accumulator copy, vpdpbusd, cvt,
// scale broadcast, fma): the scales of R rows x 8 tokens take one 8-wide multiply per row and
// block, stored a chunk ahead and read back as one 64-bit broadcast load per pair (a multiply
// per pair instead runs into the multiply pipes' limit: 0.70 vs 0.84 pairs per cycle in
// isolation on Zen 5). bench/matvec_bench BM_Q8VnniOnOff, 1 thread, 512 tokens: 2.4-2.6x the
// plain kernel on the 1B model's shapes.
#define HWY_WANT_AVX3_DL 1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_matmul_q8.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_matmul_q8.h"
#include "float_dot-inl.h"  // Hsum; per-target guard: expanded once per Highway target
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

// Token tile (8 tokens): block i, pair p at q + (i * 4 + p) * kQ8ActPairBytes (64 bytes of
// interleaved signed quants, then 16 int32 corrections); token t's scale at yd[i * 8 + t].
struct Q8Tile {
  const int8_t* q;
  const float* yd;
};

// [p[0], p[1]] x 8 as one broadcast load: written as asm because GCC otherwise keeps the
// products in registers and spends a shuffle per pair on the multiply-side pipes.
HWY_INLINE __m512 BroadcastPair(const float* p) {
  __m512 v;
  asm("vbroadcastsd %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const double*>(p)));
  return v;
}

// Rows b0..b1 into the packed form: quants (w + 128 as u8, dword L at dwords 2L and 2L+1) at
// pq[(r - b0) * nb + i], scales at pd[(r - b0) * nb + i].
KILN_Q8_VNNI void PackQ8Rows(const WeightMatrix& w, int64_t b0, int64_t b1, Q8UnpackRow unpack,
                             int8_t* row_q, __m512i* pq, float* pd) {
  const int64_t nb = w.n_cols / 32;
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t r = b0; r < b1; ++r) {
    __m512i* dst = pq + (r - b0) * nb;
    float* d = pd + (r - b0) * nb;
    const int8_t* src = row_q;
    int64_t stride = 32;
    if (w.dtype == DType::Q8_0) {
      // The quants as they lie in the blocks, the f16 scales 16 at a time by vcvtph2ps (exact,
      // as the plain kernel's scalar f16_to_f32 per block, which cost ~4 % of a Q8_0 prefill).
      const auto* blk = reinterpret_cast<const quant::block_q8_0*>(w.row(r).data());
      alignas(32) uint16_t h[16];
      int64_t i = 0;
      for (; i + 16 <= nb; i += 16) {
        for (int k = 0; k < 16; ++k) h[k] = blk[i + k].d.bits;
        _mm512_storeu_ps(d + i,
                         _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h))));
      }
      for (; i < nb; ++i) d[i] = f16_to_f32(blk[i].d);
      src = blk[0].qs;
      stride = sizeof(quant::block_q8_0);
    } else {
      unpack(w.row(r).data(), nb, row_q, d);
    }
    for (int64_t i = 0; i < nb; ++i) {
      const __m512i q = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + stride * i)));
      _mm512_store_si512(dst + i, _mm512_xor_si512(_mm512_permutexvar_epi32(dup, q), bias));
    }
  }
}

// Tokens ys[0..m) into the tile; a last odd token's partner is all zero (its outputs are not
// read).
KILN_Q8_VNNI void FillQ8Tile(const ActQ8_0* const* ys, int m, int64_t nb, int8_t* q, float* yd) {
  const __m512i inter = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
  const int pairs = (m + 1) / 2;
  for (int64_t i = 0; i < nb; ++i) {
    for (int p = 0; p < pairs; ++p) {
      const auto* qa = reinterpret_cast<const __m256i*>(ys[2 * p][i].qs);
      const __m256i ya = _mm256_loadu_si256(qa);
      const __m256i yb =
          2 * p + 1 < m ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ys[2 * p + 1][i].qs))
                        : _mm256_setzero_si256();
      const __m512i y =
          _mm512_permutexvar_epi32(inter, _mm512_inserti64x4(_mm512_castsi256_si512(ya), yb, 1));
      // -128 * (sum of the lane's 4 quants): what the weights' +128 bias adds.
      const __m512i corr = _mm512_sub_epi32(_mm512_setzero_si512(),
                                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, y));
      int8_t* dst = q + (i * 4 + p) * static_cast<int64_t>(kQ8ActPairBytes);
      _mm512_store_si512(dst, y);
      _mm512_store_si512(dst + 64, corr);
    }
    for (int t = 0; t < kQ8VnniTok; ++t) yd[i * kQ8VnniTok + t] = t < m ? ys[t][i].d : 0.0f;
  }
}

// The scales of blocks i0..i0+n for rows 0..R-1 x the tile's 8 tokens, s[(i - i0) * R + r][t],
// written a chunk ahead of their use: a load of a just-stored vector's part waits for the store.
template <int R>
HWY_INLINE void Q8Scales(const float* wd, int64_t nb, const float* tyd, int64_t i0, int64_t n,
                         float (*s)[8]) {
  for (int64_t j = 0; j < n; ++j) {
    const __m256 yd = _mm256_load_ps(tyd + (i0 + j) * kQ8VnniTok);
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
        _mm256_store_ps(s[j * R + r], _mm256_mul_ps(_mm256_set1_ps(wd[r * nb + i0 + j]), yd));
  }
}

// Blocks per scale chunk.
constexpr int64_t kQ8ScaleChunk = 16;

// Rows 0..R-1 of the packed block (quants wq + r * nb, scales wd + r * nb) x the tile's
// pairs 0..P-1; out[r * 8 + t].
template <int R, int P>
KILN_Q8_VNNI void DotQ8Vnni(const __m512i* wq, const float* wd, int64_t nb, Q8Tile tile,
                            float* out) {
  __m512 acc[R][P];
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
      _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  alignas(64) float s[2][kQ8ScaleChunk * R][8];  // dw * yd: the plain kernel's scalar products
  Q8Scales<R>(wd, nb, tile.yd, 0, std::min(nb, kQ8ScaleChunk), s[0]);
  for (int64_t c0 = 0; c0 < nb; c0 += kQ8ScaleChunk) {
    const int64_t c1 = std::min(nb, c0 + kQ8ScaleChunk);
    float(*sc)[8] = s[(c0 / kQ8ScaleChunk) & 1];
    if (c1 < nb)
      Q8Scales<R>(wd, nb, tile.yd, c1, std::min(nb, c1 + kQ8ScaleChunk) - c1,
                  s[(c0 / kQ8ScaleChunk + 1) & 1]);
    for (int64_t i = c0; i < c1; ++i) {
      __m512i w[R];
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) w[r] = _mm512_load_si512(wq + r * nb + i);
      const int8_t* ai = tile.q + i * 4 * static_cast<int64_t>(kQ8ActPairBytes);
      const float(*si)[8] = sc + (i - c0) * R;
      _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p) {
        const __m512i y = _mm512_load_si512(ai + p * kQ8ActPairBytes);
        const __m512i corr = _mm512_load_si512(ai + p * kQ8ActPairBytes + 64);
        _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
          const __m512i lanes = _mm512_dpbusd_epi32(corr, w[r], y);
          acc[r][p] =
              _mm512_fmadd_ps(BroadcastPair(&si[r][2 * p]), _mm512_cvtepi32_ps(lanes), acc[r][p]);
        }
      }
    }
  }
  const __m512i deint = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
    _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p) {
      const __m512 v = _mm512_permutexvar_ps(deint, acc[r][p]);
      out[r * 8 + 2 * p] = Hsum(_mm512_castps512_ps256(v));
      out[r * 8 + 2 * p + 1] = Hsum(_mm512_extractf32x8_ps(v, 1));
    }
  }
}

using DotQ8Fn = void (*)(const __m512i*, const float*, int64_t, Q8Tile, float*);
template <int R>
constexpr DotQ8Fn kDotQ8Row[4] = {&DotQ8Vnni<R, 1>, &DotQ8Vnni<R, 2>, &DotQ8Vnni<R, 3>,
                                  &DotQ8Vnni<R, 4>};
// [rows - 1][pairs - 1]
constexpr const DotQ8Fn* kDotQ8[kQ8VnniRows] = {kDotQ8Row<1>, kDotQ8Row<2>, kDotQ8Row<3>,
                                                kDotQ8Row<4>};

template <class T>
T* Align64(std::byte*& p, size_t count) {
  p = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  T* out = reinterpret_cast<T*>(p);
  p += count * sizeof(T);
  return out;
}

}  // namespace

// Token groups x row blocks x token tiles x register tiles of up to 4 rows x 8 tokens: each
// token's tile is built once per group and each row block packed once per group. `scratch`
// holds q8_vnni_scratch_bytes(n_cols).
void MatmulQ8Vnni(const MatmulJob& job, int64_t r0, int64_t r1, float* scratch,
                  Q8UnpackRow unpack) {
  static_assert(kQ8VnniTok == 8 && kQ8VnniRows == 4);
  const WeightMatrix& w = *job.w;
  const int64_t nb = w.n_cols / 32, ldy = w.n_rows;
  const int64_t rb = q8_vnni_rows_per_block(nb), group = q8_vnni_group_tokens(nb);
  auto* p = reinterpret_cast<std::byte*>(scratch);
  __m512i* pq = Align64<__m512i>(p, static_cast<size_t>(rb * nb));
  float* pd = Align64<float>(p, static_cast<size_t>(rb * nb));
  int8_t* tq =
      Align64<int8_t>(p, static_cast<size_t>(group / kQ8VnniTok * nb * 4) * kQ8ActPairBytes);
  float* tyd = Align64<float>(p, static_cast<size_t>(group * nb));
  int8_t* row_q = Align64<int8_t>(p, static_cast<size_t>(nb * 32));
  const ActQ8_0* ys[kQ8VnniTok];
  float out[kQ8VnniRows * 8];
  for (int64_t g0 = 0; g0 < job.n_tok; g0 += group) {
    const int64_t g1 = std::min(job.n_tok, g0 + group);
    for (int64_t t0 = g0; t0 < g1; t0 += kQ8VnniTok) {
      const int m = static_cast<int>(std::min<int64_t>(kQ8VnniTok, g1 - t0));
      for (int k = 0; k < m; ++k)
        ys[k] = reinterpret_cast<const ActQ8_0*>(job.xq + (t0 + k) * job.xq_row_bytes);
      const int64_t tile = (t0 - g0) / kQ8VnniTok;
      FillQ8Tile(ys, m, nb, tq + tile * nb * 4 * static_cast<int64_t>(kQ8ActPairBytes),
                 tyd + tile * nb * kQ8VnniTok);
    }
    for (int64_t b0 = r0; b0 < r1; b0 += rb) {
      const int64_t b1 = std::min(r1, b0 + rb);
      PackQ8Rows(w, b0, b1, unpack, row_q, pq, pd);
      for (int64_t t0 = g0; t0 < g1; t0 += kQ8VnniTok) {
        const int m = static_cast<int>(std::min<int64_t>(kQ8VnniTok, g1 - t0));
        const int64_t k = (t0 - g0) / kQ8VnniTok;
        const Q8Tile tile{tq + k * nb * 4 * static_cast<int64_t>(kQ8ActPairBytes),
                          tyd + k * nb * kQ8VnniTok};
        const int pairs = (m + 1) / 2;
        for (int64_t r = b0; r < b1; r += kQ8VnniRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kQ8VnniRows, b1 - r));
          kDotQ8[rows - 1][pairs - 1](pq + (r - b0) * nb, pd + (r - b0) * nb, nb, tile, out);
          for (int rr = 0; rr < rows; ++rr)
            for (int j = 0; j < m; ++j) job.y[(t0 + j) * ldy + r + rr] = out[rr * 8 + j];
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
HWY_EXPORT(QuantizeQ8_0RowK);
bool quantize_q8_0_simd(const float* x, int64_t n, std::byte* dst) {
  return HWY_DYNAMIC_DISPATCH(QuantizeQ8_0RowK)(x, n, dst);
}
}  // namespace kiln::cpu
#endif
