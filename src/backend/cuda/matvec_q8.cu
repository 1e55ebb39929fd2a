// backend/cuda/matvec_q8.cu: MatmulKernels::V3, the decode matvec (1..64 tokens) aimed at the
// memory bandwidth (figures and the remaining gap: docs/BENCHMARKS.md). V2 dequantized every weight
// to f32 and spent one FMA per weight and token, which bound the quantized types at 20-40 % of the
// H200's read bandwidth. Here the activations are quantized once per call into int8 blocks of 32 (a
// scale d and the block's sum d * sum q, per token), and a weight unit of 32 elements becomes eight
// int8x4 words that meet the activation words in __dp4a: one instruction per four products, one f32
// FMA per unit.
//
// Each lane owns the units lane, lane + 32, ... of a row (Q4_K: the pairs of units that share
// their quant bytes, lane, lane + 32, ..., each summed low unit first), accumulates each token
// in its own register in that order, and the warp reduces with a fixed butterfly: a token's
// output is the same bits whether the call holds 1 or 64 tokens and however many rows a warp
// carries (docs/determinism.md); only explicit _rn intrinsics touch the floats so the compiler
// cannot contract them differently per instantiation.
//
// Weight bytes: K-quant layouts with 16-byte aligned blocks (Q4_K 144 B, Q5_K 176 B) are read
// straight from global memory with 16-byte loads; the 2-byte aligned ones (Q8_0 34 B, Q4_0
// 18 B, Q5_0 22 B, Q6_K 210 B) are staged per warp through shared memory in chunks that are a
// whole number of 16-byte vectors (coalesced loads; per-lane loads at a stride of a block
// would cost many L1 wavefronts per useful byte). Rows that are not 16-byte aligned are read
// from global memory, their 2-byte aligned fields as aligned 4-byte words and funnel shifts.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <span>

#include "backend/cuda/act.cuh"
#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kQ8Warps = 4;  // warps per block of the int8 kernel
constexpr int kBlk = 32;     // activation block = weight unit (elements)
constexpr int kFloatWarps = 8;

constexpr size_t align16(size_t n) { return (n + 15) / 16 * 16; }

__device__ __forceinline__ float warp_sum_rn(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Rows r0..r0+R-1, tokens t0..t0+nt-1 of y: each lane's partial sum reduced over the warp in
// one fixed order (warp_sum_rn), written by lane 0; rows past the matrix dropped.
template <int R, int NT>
__device__ __forceinline__ void store_sums(const float (&acc)[R][NT], int nt, int lane, int64_t t0,
                                           int64_t r0, int64_t n_rows, float* y) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= nt) break;
      const float s = warp_sum_rn(acc[i][t]);
      if (lane == 0 && r0 + i < n_rows) y[(t0 + t) * n_rows + r0 + i] = s;
    }
}

// Before pdl_enter(): the start of the first row this warp takes (the weights, which no
// kernel writes) into L2, by the grid's first token column only (the others read the same
// rows). Under PDL this runs while the kernel ahead drains, so the first wave's first weight
// reads overlap it; without PDL it costs a few instructions and no extra DRAM traffic (the
// lines are read anyway). One row of at most kPrefetchRowBytes per warp: the first wave of
// the f16 gate/up matvec (448 blocks x 8 warps x 4 rows of 8 KB) is the size of the L2, and
// prefetching all of it made that kernel 25 % slower (cuda_matvec_bench, H200, session 8);
// capped, the first wave prefetches ~8-11 MB.
constexpr size_t kPrefetchRowBytes = 2304;  // one 4096-wide Q4_K row
template <int R, int WARPS>
__device__ __forceinline__ void prefetch_first_rows(const uint8_t* w, size_t row_bytes,
                                                    int64_t n_rows, int64_t rb, int lane,
                                                    int warp) {
  if (blockIdx.x != 0) return;
  const int64_t r0 = (rb * WARPS + warp) * R;
  const size_t n = row_bytes < kPrefetchRowBytes ? row_bytes : kPrefetchRowBytes;
  if (r0 < n_rows) prefetch_l2_warp(w + r0 * row_bytes, n, lane);
}

// ---- activations: one warp per 32-element block. SWIGLU: the input is swiglu_one(x, up),
// computed here instead of by a separate elementwise op (the same expression, so the same
// values, act.cuh).
template <bool SWIGLU>
__global__ void quantize_act_q8_kernel(const float* __restrict__ x, const float* __restrict__ up,
                                       int64_t n_blocks, int8_t* __restrict__ q,
                                       float2* __restrict__ ds) {
  pdl_enter();
  const int lane = threadIdx.x % kWarp;
  const int64_t b = int64_t(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (b >= n_blocks) return;
  // Tokens are contiguous rows of n_cols (a multiple of 32): block b is elements 32b..32b+31.
  float v = __ldg(x + b * kBlk + lane);
  if constexpr (SWIGLU) v = swiglu_one(v, __ldg(up + b * kBlk + lane));
  float amax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  // fmaxf drops NaN: a NaN or inf anywhere in the block poisons its scale instead, so the
  // output is NaN as the f32 product would be.
  const bool bad = __any_sync(0xffffffffu, !isfinite(v));
  const float d = __fdiv_rn(amax, 127.0f);
  const float id = d > 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
  const int qi = max(-127, min(127, __float2int_rn(__fmul_rn(v, id))));
  q[b * kBlk + lane] = int8_t(qi);
  int sum = qi;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) ds[b] = bad ? make_float2(NAN, NAN) : make_float2(d, __fmul_rn(d, float(sum)));
}

// ---- weights: one 32-element unit as eight int8x4 words (element order = the activation
// block's) and its scales: d0 for words 0..7 (Q6_K: words 0..3, d1 words 4..7); for Q4_K/Q5_K
// d1 is the unit's min, subtracted as d1 * (d_a * sum q_a).
struct WUnit {
  uint32_t w[8];
  float d0, d1;
};

template <DType T>
constexpr int q8_block_bytes() {
  using namespace kiln::quant;
  switch (T) {
    case DType::Q8_0:
      return sizeof(block_q8_0);
    case DType::Q4_0:
      return sizeof(block_q4_0);
    case DType::Q5_0:
      return sizeof(block_q5_0);
    case DType::Q4_K:
      return sizeof(block_q4_K);
    case DType::Q5_K:
      return sizeof(block_q5_K);
    case DType::Q6_K:
      return sizeof(block_q6_K);
    default:
      return 0;
  }
}
// Units per shared-memory chunk (0: read straight from global memory). A chunk is a whole
// number of blocks and of 16-byte vectors.
template <DType T>
constexpr int q8_chunk_units() {
  switch (T) {
    case DType::Q8_0:
    case DType::Q4_0:
    case DType::Q5_0:
    case DType::Q6_K:
      return 64;
    default:
      return 0;
  }
}
template <DType T>
constexpr int q8_chunk_bytes() {
  constexpr int per_block = T == DType::Q6_K ? 8 : 1;
  return q8_chunk_units<T>() / per_block * q8_block_bytes<T>();
}

// Bit k of `bits` (k < 4) to bit 4 of byte k.
__device__ __forceinline__ uint32_t spread4_bit4(uint32_t bits) {
  return ((bits & 1u) | ((bits & 2u) << 7) | ((bits & 4u) << 14) | ((bits & 8u) << 21)) << 4;
}

// N bytes at a 2-byte aligned p as N/4 words: N/4 (+1) aligned 4-byte loads and a funnel shift
// instead of dequant.cuh's N/2 2-byte loads (the 2-aligned layouts' fields, in shared memory or
// global). Every aligned word read holds at least one byte of the field (the extra word only
// when p is not 4-byte aligned), so nothing outside the buffer's last word is touched.
template <int N>
__device__ __forceinline__ void load_words_a2(const uint8_t* p, uint32_t* w) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  const uint32_t* base = reinterpret_cast<const uint32_t*>(addr & ~uintptr_t(3));
  const uint32_t sh = uint32_t(addr & 2) * 8;
  uint32_t raw[N / 4 + 1];
#pragma unroll
  for (int i = 0; i < N / 4; ++i) raw[i] = base[i];
  raw[N / 4] = sh ? base[N / 4] : 0u;
#pragma unroll
  for (int i = 0; i < N / 4; ++i) w[i] = __funnelshift_r(raw[i], raw[i + 1], sh);
}
// load_words with the a2 form where only 2-byte alignment is known.
template <int N, int ALIGN>
__device__ __forceinline__ void load_field(const uint8_t* p, uint32_t* w) {
  if constexpr (ALIGN == 2) {
    load_words_a2<N>(p, w);
  } else {
    load_words<N, ALIGN>(p, w);
  }
}

// llama.cpp's 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block, from its 12
// scale bytes as words, branch-free (dequant.cuh's form picks bytes by a run-time index; this
// is a third of the instructions): sub-blocks 0..3 keep 6 bits of bytes j and j + 4, 4..7 take
// 4 bits of byte j + 4 and the top 2 of bytes j - 4 / j.
__device__ __forceinline__ void k_scale_min(const uint32_t* sw, int j, int& sc, int& m) {
  const int sh = 8 * (j & 3);
  const uint32_t a0 = sw[0] >> sh, a1 = sw[1] >> sh, a2 = sw[2] >> sh;
  sc = int(j < 4 ? (a0 & 63u) : ((a2 & 0xFu) | ((a0 >> 2) & 0x30u)));
  m = int(j < 4 ? (a1 & 63u) : (((a2 >> 4) & 0xFu) | ((a1 >> 2) & 0x30u)));
}

// Unit u of the rows/chunk at `base` (A: dequant_unit's alignment of base and block size).
template <DType T, int A>
__device__ __forceinline__ void decode_unit(const uint8_t* base, int64_t u, WUnit& o) {
  using namespace kiln::quant;
  constexpr int kBs = q8_block_bytes<T>();
  if constexpr (T == DType::Q8_0) {
    const uint8_t* b = base + u * kBs;
    o.d0 = load_f16(b);
    o.d1 = 0.0f;
    load_field<32, field_align(A, kBs, 2)>(b + 2, o.w);
  } else if constexpr (T == DType::Q4_0) {
    const uint8_t* b = base + u * kBs;
    o.d0 = load_f16(b);
    o.d1 = 0.0f;
    uint32_t q[4];
    load_field<16, field_align(A, kBs, 2)>(b + 2, q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o.w[i] = __vsub4(q[i] & 0x0F0F0F0Fu, 0x08080808u);
      o.w[i + 4] = __vsub4((q[i] >> 4) & 0x0F0F0F0Fu, 0x08080808u);
    }
  } else if constexpr (T == DType::Q5_0) {
    const uint8_t* b = base + u * kBs;
    o.d0 = load_f16(b);
    o.d1 = 0.0f;
    uint32_t qh, q[4];
    load_field<4, field_align(A, kBs, 2)>(b + 2, &qh);
    load_field<16, field_align(A, kBs, 6)>(b + 6, q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o.w[i] = __vsub4((q[i] & 0x0F0F0F0Fu) | spread4_bit4((qh >> (4 * i)) & 0xF), 0x10101010u);
      o.w[i + 4] = __vsub4(((q[i] >> 4) & 0x0F0F0F0Fu) | spread4_bit4((qh >> (16 + 4 * i)) & 0xF),
                           0x10101010u);
    }
  } else if constexpr (T == DType::Q4_K || T == DType::Q5_K) {
    constexpr bool k5 = T == DType::Q5_K;
    constexpr int kQs = k5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs);
    const uint8_t* b = base + (u / 8) * kBs;
    const int j = int(u % 8);
    uint32_t dm;
    load_field<4, field_align(A, kBs, 0)>(b, &dm);
    const float d = h2f_bits(uint16_t(dm)), dmin = h2f_bits(uint16_t(dm >> 16));
    uint32_t sw[3];
    load_field<12, field_align(A, kBs, 4)>(b + 4, sw);
    int sc, m;
    k_scale_min(sw, j, sc, m);
    o.d0 = mul_rn(d, i2f(sc));
    o.d1 = mul_rn(dmin, i2f(m));
    uint32_t q[8];
    load_field<32, field_align(A, kBs, kQs)>(b + kQs + 32 * (j / 2), q);
    const int shift = 4 * (j & 1);
    if constexpr (k5) {
      uint32_t qh[8];
      load_field<32, field_align(A, kBs, offsetof(block_q5_K, qh))>(b + offsetof(block_q5_K, qh),
                                                                    qh);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        o.w[i] = ((q[i] >> shift) & 0x0F0F0F0Fu) | (((qh[i] >> j) & 0x01010101u) << 4);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) o.w[i] = (q[i] >> shift) & 0x0F0F0F0Fu;
    }
  } else if constexpr (T == DType::Q6_K) {
    const uint8_t* b = base + (u / 8) * kBs;
    const int s = int(u % 8), h = s / 4, qq = s % 4;
    const float d = load_f16(b + offsetof(block_q6_K, d));
    uint32_t ql[8], qh[8];
    load_field<32, field_align(A, kBs, offsetof(block_q6_K, ql))>(
        b + offsetof(block_q6_K, ql) + 64 * h + 32 * (qq & 1), ql);
    load_field<32, field_align(A, kBs, offsetof(block_q6_K, qh))>(
        b + offsetof(block_q6_K, qh) + 32 * h, qh);
    const uint32_t sc2 = load_u16(b + offsetof(block_q6_K, scales) + 8 * h + 2 * qq);
    o.d0 = mul_rn(d, i2f(int8_t(sc2 & 0xFF)));
    o.d1 = mul_rn(d, i2f(int8_t(sc2 >> 8)));
    const int lshift = qq >= 2 ? 4 : 0;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      o.w[i] =
          __vsub4(((ql[i] >> lshift) & 0x0F0F0F0Fu) | (((qh[i] >> (2 * qq)) & 0x03030303u) << 4),
                  0x20202020u);
  }
}

// acc + (this unit . one token's activation block), in one fixed order.
template <DType T>
__device__ __forceinline__ float unit_dot(const WUnit& wu, const int* a, float2 ds, float acc) {
  if constexpr (T == DType::Q6_K) {
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) s0 = __dp4a(int(wu.w[i]), a[i], s0);
#pragma unroll
    for (int i = 4; i < 8; ++i) s1 = __dp4a(int(wu.w[i]), a[i], s1);
    acc = __fmaf_rn(__fmul_rn(wu.d0, ds.x), i2f(s0), acc);
    return __fmaf_rn(__fmul_rn(wu.d1, ds.x), i2f(s1), acc);
  } else {
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = __dp4a(int(wu.w[i]), a[i], s);
    acc = __fmaf_rn(__fmul_rn(wu.d0, ds.x), i2f(s), acc);
    if constexpr (T == DType::Q4_K || T == DType::Q5_K) acc = __fmaf_rn(-wu.d1, ds.y, acc);
    return acc;
  }
}

// Token t's activation block u: its 32 int8 quants as 8 words and (d, d * sum q).
__device__ __forceinline__ void load_act_block(const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xd, int64_t n_cols,
                                               int64_t n_units, int t, int64_t u, int (&a)[8],
                                               float2& ds) {
  const int4* a4 = reinterpret_cast<const int4*>(xq + t * n_cols + u * kBlk);
  const int4 a0 = __ldg(a4), a1 = __ldg(a4 + 1);
  ds = __ldg(xd + t * n_units + u);
  a[0] = a0.x, a[1] = a0.y, a[2] = a0.z, a[3] = a0.w;
  a[4] = a1.x, a[5] = a1.y, a[6] = a1.z, a[7] = a1.w;
}

// The R decoded units (one per row) against the NT tokens' activation block ug.
// valid = false: the unit lies past the row's end (ug clamped into it): nothing is added, but
// the loads stay unconditional so that they can be issued early.
template <DType T, int NT, int R>
__device__ __forceinline__ void dot_tokens(const WUnit (&wu)[R], const int8_t* __restrict__ xq,
                                           const float2* __restrict__ xd, int64_t n_cols,
                                           int64_t n_units, int64_t ug, int nt, float (&acc)[R][NT],
                                           bool valid = true) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (NT > 1 && t >= nt) break;  // one token: no branch, so the loads below can move up
    int a[8];
    float2 ds;
    load_act_block(xq, xd, n_cols, n_units, t, ug, a, ds);
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float v = unit_dot<T>(wu[i], a, ds, acc[i][t]);
      acc[i][t] = valid ? v : acc[i][t];
    }
  }
}

// ---- Q4_K by pairs of units. Units 2p and 2p+1 of a block (sub-blocks) share their 32 quant
// bytes (low and high nibbles) and the block header, so a lane that owns the pair reads one
// header and two 16-byte quant vectors per 64 weights where two units cost two of each (one
// token on the H200, 14336x4096: 13.7-14.8 us against 18.1; docs/BENCHMARKS.md, session 8).
// The high nibbles are used in place (q & 0xF0F0F0F0 = 16 h) through the unsigned x signed
// dp4a and the exact sum is shifted back. Per unit the floats are unit_dot's (scale, then min).
__device__ __forceinline__ int dp4a_us(uint32_t a, int b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Pair pc of a row as loaded: the block header (d and dmin as f16, 12 scale bytes) and the
// pair's 32 quant bytes.
struct Q4KPair {
  uint32_t hdr[4];
  uint32_t q[8];
};
// A: 16 (the row and its 144-byte blocks 16-byte aligned, so both fields are) or 2.
template <int A>
__device__ __forceinline__ void load_q4k_pair(const uint8_t* row, int64_t pc, Q4KPair& o) {
  using kiln::quant::block_q4_K;
  constexpr int kBs = sizeof(block_q4_K), kQs = offsetof(block_q4_K, qs);
  static_assert(kBs == 144 && kQs == 16);
  const uint8_t* b = row + (pc / 4) * kBs;
  const uint8_t* qs = b + kQs + 32 * int(pc % 4);
  if constexpr (A == 16) {
    const uint4 h = __ldg(reinterpret_cast<const uint4*>(b));
    const uint4 q0 = __ldg(reinterpret_cast<const uint4*>(qs));
    const uint4 q1 = __ldg(reinterpret_cast<const uint4*>(qs + 16));
    o.hdr[0] = h.x, o.hdr[1] = h.y, o.hdr[2] = h.z, o.hdr[3] = h.w;
    o.q[0] = q0.x, o.q[1] = q0.y, o.q[2] = q0.z, o.q[3] = q0.w;
    o.q[4] = q1.x, o.q[5] = q1.y, o.q[6] = q1.z, o.q[7] = q1.w;
  } else {
    load_field<16, field_align(A, kBs, 0)>(b, o.hdr);
    load_field<32, field_align(A, kBs, kQs)>(qs, o.q);
  }
}

// The R rows' pair pc (pc < n_units / 2) against the NT tokens' activation blocks 2pc and
// 2pc + 1; valid as in dot_tokens. Unit 2pc goes through every token before unit 2pc + 1 (half
// the activation and weight words live at a time); each token's sum still takes unit 2pc
// first, whatever NT and R are.
template <int NT, int R>
__device__ __forceinline__ void dot_tokens_q4k_pair(const Q4KPair (&wp)[R],
                                                    const int8_t* __restrict__ xq,
                                                    const float2* __restrict__ xd, int64_t n_cols,
                                                    int64_t n_units, int64_t pc, int nt,
                                                    float (&acc)[R][NT], bool valid) {
  const int p = int(pc % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t u = 2 * pc + h;
    float d0[R], d1[R];
    uint32_t q[R][8];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      int sc, m;
      k_scale_min(wp[i].hdr + 1, 2 * p + h, sc, m);
      d0[i] = mul_rn(h2f_bits(uint16_t(wp[i].hdr[0])), i2f(sc));
      d1[i] = mul_rn(h2f_bits(uint16_t(wp[i].hdr[0] >> 16)), i2f(m));
#pragma unroll
      for (int k = 0; k < 8; ++k) q[i][k] = wp[i].q[k] & (h == 0 ? 0x0F0F0F0Fu : 0xF0F0F0F0u);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (NT > 1 && t >= nt) break;  // one token: no branch, so the loads below can move up
      int a[8];
      float2 ds;
      load_act_block(xq, xd, n_cols, n_units, t, u, a, ds);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        int s = 0;
        if (h == 0) {
#pragma unroll
          for (int k = 0; k < 8; ++k) s = __dp4a(int(q[i][k]), a[k], s);
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) s = dp4a_us(q[i][k], a[k], s);
          s >>= 4;  // exact: every product was 16 h a
        }
        float v = __fmaf_rn(__fmul_rn(d0[i], ds.x), i2f(s), acc[i][t]);
        v = __fmaf_rn(-d1[i], ds.y, v);
        acc[i][t] = valid ? v : acc[i][t];
      }
    }
  }
}

enum Mode { kStaged = 0, kDirect16 = 1, kDirect2 = 2 };

// Several weights of one type, width and row size in one grid (launch_matvec_*_group): task i
// owns row blocks [rb_end[i-1], rb_end[i]) of the grid's y dimension, which holds no more than
// their sum (<= 65535), so every block takes exactly one row block of one task.
struct GroupArgs {
  const uint8_t* w[kMatvecGroupMax];
  float* y[kMatvecGroupMax];
  int64_t n_rows[kMatvecGroupMax];
  int64_t rb_end[kMatvecGroupMax];
  int n;
};
struct GroupTask {
  const uint8_t* w;
  float* y;
  int64_t n_rows, rb;  // the task's rows, and this block's row block within them
};
__device__ __forceinline__ GroupTask group_task(const GroupArgs& g) {
  const int64_t b = blockIdx.y;
  GroupTask t{g.w[0], g.y[0], g.n_rows[0], b};
#pragma unroll  // constant indices: the arguments stay in the parameter bank
  for (int i = 1; i < kMatvecGroupMax; ++i)
    if (i < g.n && b >= g.rb_end[i - 1])
      t = GroupTask{g.w[i], g.y[i], g.n_rows[i], b - g.rb_end[i - 1]};
  return t;
}

// grid: (ceil(n_tok / NT) token columns, row blocks); block: kQ8Warps warps, each carrying R
// consecutive rows (the activation words are loaded once for R rows). The token column varies
// fastest, so the columns of one row block run together and share its weight bytes in L2.
// U: units per lane whose loads are issued together (direct modes; Q4_K: U / 2 pairs, at least
// one); it does not change which units a lane sums or in which order, so no output bit.
template <DType T, int NT, int R, int MODE, int U>
__device__ __forceinline__ void matvec_q8_body(const uint8_t* __restrict__ w, size_t row_bytes,
                                               int64_t n_rows, int64_t n_cols,
                                               const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xd, int64_t n_tok,
                                               float* __restrict__ y, int64_t rb_first) {
  constexpr int kCU = MODE == kStaged ? q8_chunk_units<T>() : kWarp;
  constexpr int kCV = MODE == kStaged ? q8_chunk_bytes<T>() / 16 : 1;
  constexpr bool kPairs = T == DType::Q4_K;
  static_assert(MODE != kStaged || (q8_chunk_bytes<T>() % 16 == 0 && kCU % kWarp == 0));
  static_assert(!(kPairs && MODE == kStaged));
  __shared__ uint4 stage[MODE == kStaged ? kQ8Warps : 1][MODE == kStaged ? R : 1][kCV];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t0 = int64_t(blockIdx.x) * NT;
  const int nt = n_tok - t0 < NT ? int(n_tok - t0) : NT;
  const int64_t n_units = n_cols / kBlk;
  const int8_t* xq_t = xq + t0 * n_cols;
  const float2* xd_t = xd + t0 * n_units;
  prefetch_first_rows<R, kQ8Warps>(w, row_bytes, n_rows, rb_first, lane, warp);
  pdl_enter();
  // Whole warps take the same rows: the __syncwarp()s below stay warp-uniform.
  // (A group's block: rb_first + gridDim.y is past its task's rows, one trip.)
  for (int64_t rb = rb_first;; rb += gridDim.y) {
    const int64_t r0 = (rb * kQ8Warps + warp) * R;
    if (r0 >= n_rows) break;
    const uint8_t* rows[R];
#pragma unroll
    for (int i = 0; i < R; ++i)  // rows past the end repeat the last one; never stored
      rows[i] = w + (r0 + i < n_rows ? r0 + i : n_rows - 1) * row_bytes;
    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[i][t] = 0.0f;
    if constexpr (MODE == kStaged) {
      const int64_t n_chunks = n_units / kCU;
      constexpr int kPer = (kCV + kWarp - 1) / kWarp;
      uint4 buf[R][kPer];
      auto load_chunk = [&](int64_t c) {
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
          for (int k = 0; k < kPer; ++k) {
            const int idx = lane + k * kWarp;
            if (idx < kCV)
              buf[i][k] = __ldg(reinterpret_cast<const uint4*>(rows[i]) + c * kCV + idx);
          }
      };
      // One row per warp (decode): the next chunk's loads are in flight while this one is
      // decoded. Several rows (batched, bound by dp4a issue) would spend too many registers.
      if constexpr (R == 1) load_chunk(0);
      for (int64_t c = 0; c < n_chunks; ++c) {
        if constexpr (R > 1) load_chunk(c);
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
          for (int k = 0; k < kPer; ++k) {
            const int idx = lane + k * kWarp;
            if (idx < kCV) stage[warp][i][idx] = buf[i][k];
          }
        __syncwarp();
        if constexpr (R == 1) {
          if (c + 1 < n_chunks) load_chunk(c + 1);
        }
#pragma unroll
        for (int k = 0; k < kCU / kWarp; ++k) {
          const int u = lane + kWarp * k;
          WUnit wu[R];
#pragma unroll
          for (int i = 0; i < R; ++i)
            decode_unit<T, 16>(reinterpret_cast<const uint8_t*>(stage[warp][i]), u, wu[i]);
          dot_tokens<T, NT, R>(wu, xq_t, xd_t, n_cols, n_units, c * kCU + u, nt, acc);
        }
        __syncwarp();  // every lane is done with the chunk before it is overwritten
      }
    } else if constexpr (kPairs) {
      // The direct loop below with pairs for units: UP pairs per lane and row loaded before any
      // product, the pair index clamped and a pair past the end dropped afterwards.
      constexpr int UP = U >= 2 ? U / 2 : 1;
      const int64_t n_pairs = n_units / 2;
      for (int64_t g = lane; g < n_pairs; g += int64_t(kWarp) * UP) {
        Q4KPair wp[UP][R];
#pragma unroll
        for (int k = 0; k < UP; ++k) {
          const int64_t pc = g + int64_t(kWarp) * k;
#pragma unroll
          for (int i = 0; i < R; ++i)
            load_q4k_pair<MODE == kDirect16 ? 16 : 2>(rows[i], pc < n_pairs ? pc : n_pairs - 1,
                                                      wp[k][i]);
        }
#pragma unroll
        for (int k = 0; k < UP; ++k) {
          const int64_t pc = g + int64_t(kWarp) * k;
          dot_tokens_q4k_pair<NT, R>(wp[k], xq_t, xd_t, n_cols, n_units,
                                     pc < n_pairs ? pc : n_pairs - 1, nt, acc, pc < n_pairs);
        }
      }
    } else {
      // U units per lane at a time, every load issued before any product: the unit index is
      // clamped (the loads stay in the row) and a unit past the end is dropped afterwards, so
      // the loads of a group are straight-line code the compiler can hoist together.
      for (int64_t g = lane; g < n_units; g += int64_t(kWarp) * U) {
        WUnit wu[U][R];
#pragma unroll
        for (int k = 0; k < U; ++k) {
          const int64_t u = g + int64_t(kWarp) * k;
          const int64_t uc = u < n_units ? u : n_units - 1;
#pragma unroll
          for (int i = 0; i < R; ++i)
            decode_unit<T, MODE == kDirect16 ? 16 : 2>(rows[i], uc, wu[k][i]);
        }
#pragma unroll
        for (int k = 0; k < U; ++k) {
          const int64_t u = g + int64_t(kWarp) * k;
          dot_tokens<T, NT, R>(wu[k], xq_t, xd_t, n_cols, n_units, u < n_units ? u : n_units - 1,
                               nt, acc, u < n_units);
        }
      }
    }
    store_sums<R, NT>(acc, nt, lane, t0, r0, n_rows, y);
  }
}
template <DType T, int NT, int R, int MODE, int U = (R >= 4 ? 1 : 4 / R)>
__global__ void __launch_bounds__(kQ8Warps* kWarp)
    matvec_q8_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                     int64_t n_cols, const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                     int64_t n_tok, float* __restrict__ y) {
  matvec_q8_body<T, NT, R, MODE, U>(w, row_bytes, n_rows, n_cols, xq, xd, n_tok, y, blockIdx.y);
}
template <DType T, int NT, int R, int MODE>
__global__ void __launch_bounds__(kQ8Warps* kWarp)
    matvec_q8_group_kernel(GroupArgs g, size_t row_bytes, int64_t n_cols,
                           const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                           int64_t n_tok) {
  const GroupTask t = group_task(g);
  matvec_q8_body<T, NT, R, MODE, (R >= 4 ? 1 : 4 / R)>(t.w, row_bytes, t.n_rows, n_cols, xq, xd,
                                                       n_tok, t.y, t.rb);
}

// ---- batched decode on the int8 tensor cores (MatmulKernels::V3 from mma_min_tokens tokens,
// off by default: kernels.h; Q4_K, Q6_K, Q8_0). The dp4a kernels above spend ~12 instructions
// per (row, token, unit) and re-decode each weight unit for every column of 8 tokens: at 16-64
// tokens they run at 2-10 % of the read bandwidth (cuda_matvec_bench, docs/BENCHMARKS.md).
// Here mma.sync m16n8k32
// (s8 x s8 -> s32) gives the exact integer dot of a unit for 16 rows x 8 tokens at once, and
// the floats are what the dp4a kernels compute, in their order, so every output keeps its bits:
// - a unit's integer dot is exact either way (|s| < 2^22), and its float update is unit_dot's
//   (the same _rn operations on the same operands);
// - the dp4a kernels' lane l sums units l, l + 32, ... (Q4_K: pairs l, l + 32, ..., low unit
//   first) from 0.0f, then warp_sum_rn adds the 32 partial sums as a fixed tree: lane 0 ends
//   with ((v0 + v16) + (v8 + v24)) + ... Here one accumulator runs over the same units for one
//   "virtual lane" at a time, the virtual lanes taken in bit-reversed order (0, 16, 8, 24, ...)
//   so that the tree's pairs are adjacent and a three-level stack holds the open subtrees;
//   warp w of the block takes virtual lanes bitrev5(8w .. 8w + 7), whose subtree is c(0),
//   c(2), c(1), c(3) of the butterfly (lanes = 0, 2, 1, 3 mod 4), and the block adds them as
//   the last two butterfly steps do: (W0 + W1) + (W2 + W3).
// IEEE addition is commutative, so only the grouping matters, and it is the butterfly's.
// Tested with memcmp against the dp4a kernels at the same token count, whose outputs run_case
// checks against one-token calls (tests/cuda/cuda_matvec_q8_test.cpp,
// CudaMatvecQ8.MmaHasTheDp4aBits). Speed: each warp still runs one virtual lane's chain at a
// time with two steps of loads in flight; at 64 tokens the kernel is ~15x slower than its
// float-issue bound (4-5 FP ops per row, token and unit), i.e. latency-bound: more independent
// chains per warp is the next step.
constexpr int kMmaRows = 16;  // rows per block (one m16 tile, shared by the block's 4 warps)

__device__ __forceinline__ int bitrev5(int i) { return int(__brev(unsigned(i)) >> 27); }

// d[4] = A (16 x 32, row-major: a0 row g cols 4q.., a1 row g + 8, a2/a3 the same 16 columns
// on) x B (32 x 8, b0 rows 4q.. of column g, b1 16 on): c0/c1 row g columns 2q, 2q + 1, c2/c3
// row g + 8 (g = lane / 4, q = lane % 4). Integer accumulation: exact.
__device__ __forceinline__ void mma_s8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
#else
  d[0] = d[1] = d[2] = d[3] = 0;
  __trap();  // sm_80+ only; the launcher refuses older devices
#endif
}

// The float update of one unit for this thread's 4 x NB outputs, given the unit's integer dots
// (c[nb]: rows g, g, g+8, g+8 x tokens 2q, 2q+1, 2q, 2q+1 of tile nb), the two rows' scales
// and the tokens' (d, d * sum q): unit_dot's operations in unit_dot's order.
template <DType T, int NB>
__device__ __forceinline__ void mma_update(float (&acc)[NB][4], const int (&c)[NB][4],
                                           const int (&c1)[NB][4], float d0g, float d1g, float d0h,
                                           float d1h, const float2 (&ds)[NB][2]) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float d0 = e < 2 ? d0g : d0h, d1 = e < 2 ? d1g : d1h;
      const float2 a = ds[nb][e & 1];
      float v = acc[nb][e];
      if constexpr (T == DType::Q6_K) {
        v = __fmaf_rn(__fmul_rn(d0, a.x), i2f(c[nb][e]), v);
        v = __fmaf_rn(__fmul_rn(d1, a.x), i2f(c1[nb][e]), v);
      } else {
        v = __fmaf_rn(__fmul_rn(d0, a.x), i2f(c[nb][e]), v);
        if constexpr (T == DType::Q4_K) v = __fmaf_rn(-d1, a.y, v);
      }
      acc[nb][e] = v;
    }
}

// One step of a virtual lane (Q4_K: a pair of units, else one unit) as loaded: the two rows'
// A-fragment words and scale fields, and the activation words and (d, d * sum q) of the step's
// units for this thread's tokens. Loading the next step before computing this one keeps two
// steps' loads in flight per warp (one step at a time, each warp waited out a memory round
// trip per unit: cuda_matvec_bench, session 10).
template <DType T, int NB>
struct MmaStep {
  static constexpr int kU = T == DType::Q4_K ? 2 : 1;  // units per step
  uint32_t wa[4];  // Q4_K: words 4q / 16 + 4q of rows g, h; Q6_K/Q8_0: a0..a3
  uint32_t wx[4];  // Q4_K: header words dm/scales of row g (x, y, z, w); Q6_K: qh words
  uint32_t wy[4];  // Q4_K: row h's header; Q6_K: d and scale bits per row
  uint32_t b0[kU][NB], b1[kU][NB];
  float2 ds[kU][NB][2];
};

template <DType T, int NB>
__device__ __forceinline__ void mma_load(MmaStep<T, NB>& st, const uint8_t* rg, const uint8_t* rh,
                                         const int8_t* const (&xb)[NB],
                                         const float2* const (&xdc)[NB][2], int64_t i, int q) {
  using namespace kiln::quant;
  if constexpr (T == DType::Q4_K) {
    constexpr int kBs = sizeof(block_q4_K), kQs = offsetof(block_q4_K, qs);
    const int64_t bo = (i / 4) * kBs;
    const int pp = int(i % 4);
    const uint4 hg = __ldg(reinterpret_cast<const uint4*>(rg + bo));
    const uint4 hh = __ldg(reinterpret_cast<const uint4*>(rh + bo));
    st.wx[0] = hg.x, st.wx[1] = hg.y, st.wx[2] = hg.z, st.wx[3] = hg.w;
    st.wy[0] = hh.x, st.wy[1] = hh.y, st.wy[2] = hh.z, st.wy[3] = hh.w;
    const uint8_t* qg = rg + bo + kQs + 32 * pp + 4 * q;
    const uint8_t* qh = rh + bo + kQs + 32 * pp + 4 * q;
    st.wa[0] = __ldg(reinterpret_cast<const uint32_t*>(qg));
    st.wa[1] = __ldg(reinterpret_cast<const uint32_t*>(qh));
    st.wa[2] = __ldg(reinterpret_cast<const uint32_t*>(qg + 16));
    st.wa[3] = __ldg(reinterpret_cast<const uint32_t*>(qh + 16));
  } else if constexpr (T == DType::Q6_K) {
    constexpr int kBs = sizeof(block_q6_K);
    const int64_t bo = (i / 8) * kBs;
    const int s = int(i % 8), hs = s / 4, qq = s % 4;
    const int lo = offsetof(block_q6_K, ql) + 64 * hs + 32 * (qq & 1) + 4 * q;
    const int ho = offsetof(block_q6_K, qh) + 32 * hs + 4 * q;
    load_words_a2<4>(rg + bo + lo, &st.wa[0]);
    load_words_a2<4>(rh + bo + lo, &st.wa[1]);
    load_words_a2<4>(rg + bo + lo + 16, &st.wa[2]);
    load_words_a2<4>(rh + bo + lo + 16, &st.wa[3]);
    load_words_a2<4>(rg + bo + ho, &st.wx[0]);
    load_words_a2<4>(rh + bo + ho, &st.wx[1]);
    load_words_a2<4>(rg + bo + ho + 16, &st.wx[2]);
    load_words_a2<4>(rh + bo + ho + 16, &st.wx[3]);
    const int so = offsetof(block_q6_K, scales) + 8 * hs + 2 * qq;
    st.wy[0] = load_u16(rg + bo + offsetof(block_q6_K, d));
    st.wy[1] = load_u16(rh + bo + offsetof(block_q6_K, d));
    st.wy[2] = load_u16(rg + bo + so);
    st.wy[3] = load_u16(rh + bo + so);
  } else {
    static_assert(T == DType::Q8_0);
    constexpr int kBs = sizeof(block_q8_0);
    const uint8_t* bg = rg + i * kBs;
    const uint8_t* bh = rh + i * kBs;
    load_words_a2<4>(bg + 2 + 4 * q, &st.wa[0]);
    load_words_a2<4>(bh + 2 + 4 * q, &st.wa[1]);
    load_words_a2<4>(bg + 18 + 4 * q, &st.wa[2]);
    load_words_a2<4>(bh + 18 + 4 * q, &st.wa[3]);
    st.wy[0] = load_u16(bg);
    st.wy[1] = load_u16(bh);
  }
#pragma unroll
  for (int h = 0; h < MmaStep<T, NB>::kU; ++h) {
    const int64_t u = MmaStep<T, NB>::kU * i + h;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const int8_t* p = xb[nb] + u * kBlk + 4 * q;
      st.b0[h][nb] = __ldg(reinterpret_cast<const uint32_t*>(p));
      st.b1[h][nb] = __ldg(reinterpret_cast<const uint32_t*>(p + 16));
      st.ds[h][nb][0] = __ldg(xdc[nb][0] + u);
      st.ds[h][nb][1] = __ldg(xdc[nb][1] + u);
    }
  }
}

template <DType T, int NB>
__device__ __forceinline__ void mma_compute(const MmaStep<T, NB>& st, int64_t i,
                                            float (&acc)[NB][4]) {
  if constexpr (T == DType::Q4_K) {
    const int pp = int(i % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int scg, mg, sch, mh;
      k_scale_min(st.wx + 1, 2 * pp + h, scg, mg);
      k_scale_min(st.wy + 1, 2 * pp + h, sch, mh);
      const float d0g = mul_rn(h2f_bits(uint16_t(st.wx[0])), i2f(scg));
      const float d1g = mul_rn(h2f_bits(uint16_t(st.wx[0] >> 16)), i2f(mg));
      const float d0h = mul_rn(h2f_bits(uint16_t(st.wy[0])), i2f(sch));
      const float d1h = mul_rn(h2f_bits(uint16_t(st.wy[0] >> 16)), i2f(mh));
      const int sft = 4 * h;
      const uint32_t a0 = (st.wa[0] >> sft) & 0x0F0F0F0Fu, a1 = (st.wa[1] >> sft) & 0x0F0F0F0Fu;
      const uint32_t a2 = (st.wa[2] >> sft) & 0x0F0F0F0Fu, a3 = (st.wa[3] >> sft) & 0x0F0F0F0Fu;
      int c[NB][4];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) mma_s8(c[nb], a0, a1, a2, a3, st.b0[h][nb], st.b1[h][nb]);
      mma_update<T, NB>(acc, c, c, d0g, d1g, d0h, d1h, st.ds[h]);
    }
  } else if constexpr (T == DType::Q6_K) {
    const int qq = int(i % 8) % 4;
    const float dg = h2f_bits(uint16_t(st.wy[0])), dh = h2f_bits(uint16_t(st.wy[1]));
    const float d0g = mul_rn(dg, i2f(int8_t(st.wy[2] & 0xFF)));
    const float d1g = mul_rn(dg, i2f(int8_t(st.wy[2] >> 8)));
    const float d0h = mul_rn(dh, i2f(int8_t(st.wy[3] & 0xFF)));
    const float d1h = mul_rn(dh, i2f(int8_t(st.wy[3] >> 8)));
    const int lshift = qq >= 2 ? 4 : 0;
    uint32_t a[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      a[j] = __vsub4(
          ((st.wa[j] >> lshift) & 0x0F0F0F0Fu) | (((st.wx[j] >> (2 * qq)) & 0x03030303u) << 4),
          0x20202020u);
    // The two 16-element halves have their own scales: one product per half, the other
    // half's A words zero.
    int c0[NB][4], c1[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      mma_s8(c0[nb], a[0], a[1], 0u, 0u, st.b0[0][nb], st.b1[0][nb]);
      mma_s8(c1[nb], 0u, 0u, a[2], a[3], st.b0[0][nb], st.b1[0][nb]);
    }
    mma_update<T, NB>(acc, c0, c1, d0g, d1g, d0h, d1h, st.ds[0]);
  } else {
    const float d0g = h2f_bits(uint16_t(st.wy[0])), d0h = h2f_bits(uint16_t(st.wy[1]));
    int c[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
      mma_s8(c[nb], st.wa[0], st.wa[1], st.wa[2], st.wa[3], st.b0[0][nb], st.b1[0][nb]);
    mma_update<T, NB>(acc, c, c, d0g, 0.0f, d0h, 0.0f, st.ds[0]);
  }
}

// Virtual lane ii (0..7, the warp's ii-th in bit-reversed order) is done with its sum acc:
// close the butterfly subtrees it completes (ii's trailing one bits), the three-level stack
// holding the open ones; after ii = 7, fin holds the warp's subtree.
template <int NB>
__device__ __forceinline__ void mma_close_vlane(int ii, const float (&acc)[NB][4],
                                                float (&stk)[3][NB][4], float (&fin)[NB][4]) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = acc[nb][e];
      if (ii & 1) {
        x = __fadd_rn(stk[0][nb][e], x);
        if (ii & 2) {
          x = __fadd_rn(stk[1][nb][e], x);
          if (ii & 4) {
            fin[nb][e] = __fadd_rn(stk[2][nb][e], x);
          } else {
            stk[2][nb][e] = x;
          }
        } else {
          stk[1][nb][e] = x;
        }
      } else {
        stk[0][nb][e] = x;
      }
    }
}
// The block's W warp subtrees added as the butterfly's last steps do: W = 4 (each warp the
// lanes of one residue mod 4, in the order 0, 2, 1, 3): (W0 + W1) + (W2 + W3); W = 8 (residues
// mod 8: 0, 4, 2, 6, 1, 5, 3, 7): ((W0 + W1) + (W2 + W3)) + ((W4 + W5) + (W6 + W7)); then stored
// (rows and tokens past the call dropped). Ends with the block synced.
template <int NB, int W = kQ8Warps>
__device__ __forceinline__ void mma_store_block(float (*part)[kMmaRows][8 * NB],
                                                const float (&fin)[NB][4], int warp, int g, int q,
                                                int64_t r0, int64_t t0, int64_t n_rows,
                                                int64_t n_tok, float* __restrict__ y) {
  static_assert(W == 4 || W == 8);
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) part[warp][g + 8 * (e >> 1)][8 * nb + 2 * q + (e & 1)] = fin[nb][e];
  __syncthreads();
  for (int i = threadIdx.x; i < kMmaRows * 8 * NB; i += W * kWarp) {
    const int r = i / (8 * NB), t = i % (8 * NB);
    float v =
        __fadd_rn(__fadd_rn(part[0][r][t], part[1][r][t]), __fadd_rn(part[2][r][t], part[3][r][t]));
    if constexpr (W == 8)
      v = __fadd_rn(v, __fadd_rn(__fadd_rn(part[4][r][t], part[5][r][t]),
                                 __fadd_rn(part[6][r][t], part[7][r][t])));
    if (r0 + r < n_rows && t0 + t < n_tok) y[(t0 + t) * n_rows + r0 + r] = v;
  }
}

// Rows rb * 16 .. + 15, tokens blockIdx.x * 8 NB .. of y. Q4_K rows 16-byte aligned; Q6_K and
// Q8_0 rows 2-byte aligned (fields read as aligned words and funnel shifts).
template <DType T, int NB>
__device__ __forceinline__ void matvec_q8_mma_body(const uint8_t* __restrict__ w, size_t row_bytes,
                                                   int64_t n_rows, int64_t n_cols,
                                                   const int8_t* __restrict__ xq,
                                                   const float2* __restrict__ xd, int64_t n_tok,
                                                   float* __restrict__ y, int64_t rb) {
  __shared__ float part[kQ8Warps][kMmaRows][8 * NB];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int g = lane >> 2, q = lane & 3;
  const int64_t r0 = rb * kMmaRows, t0 = int64_t(blockIdx.x) * (8 * NB);
  const int64_t n_units = n_cols / kBlk;
  // Steps of a row: Q4_K pairs, else units; virtual lane l takes steps l, l + 32, ...
  const int64_t n_steps = T == DType::Q4_K ? n_units / 2 : n_units;
  // Rows past the matrix and tokens past the call repeat the last one; never stored.
  const uint8_t* rg = w + (r0 + g < n_rows ? r0 + g : n_rows - 1) * row_bytes;
  const uint8_t* rh = w + (r0 + g + 8 < n_rows ? r0 + g + 8 : n_rows - 1) * row_bytes;
  const int8_t* xb[NB];
  const float2* xdc[NB][2];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int64_t tb = t0 + 8 * nb + g, tc = t0 + 8 * nb + 2 * q;
    xb[nb] = xq + (tb < n_tok ? tb : n_tok - 1) * n_cols;
    xdc[nb][0] = xd + (tc < n_tok ? tc : n_tok - 1) * n_units;
    xdc[nb][1] = xd + (tc + 1 < n_tok ? tc + 1 : n_tok - 1) * n_units;
  }
  pdl_enter();
  float stk[3][NB][4];
  float fin[NB][4];
#pragma unroll
  for (int ii = 0; ii < 8; ++ii) {
    const int l = bitrev5(warp * 8 + ii);
    float acc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nb][e] = 0.0f;
    MmaStep<T, NB> cur, nxt;
    if (l < n_steps) mma_load<T, NB>(cur, rg, rh, xb, xdc, l, q);
    for (int64_t i = l; i < n_steps; i += kWarp) {
      if (i + kWarp < n_steps) mma_load<T, NB>(nxt, rg, rh, xb, xdc, i + kWarp, q);
      mma_compute<T, NB>(cur, i, acc);
      cur = nxt;
    }
    mma_close_vlane<NB>(ii, acc, stk, fin);
  }
  mma_store_block<NB>(part, fin, warp, g, q, r0, t0, n_rows, n_tok, y);
}
template <DType T, int NB>
__global__ void __launch_bounds__(kQ8Warps* kWarp)
    matvec_q8_mma_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                         int64_t n_cols, const int8_t* __restrict__ xq,
                         const float2* __restrict__ xd, int64_t n_tok, float* __restrict__ y) {
  matvec_q8_mma_body<T, NB>(w, row_bytes, n_rows, n_cols, xq, xd, n_tok, y, blockIdx.y);
}
template <DType T, int NB>
__global__ void __launch_bounds__(kQ8Warps* kWarp)
    matvec_q8_mma_group_kernel(GroupArgs g, size_t row_bytes, int64_t n_cols,
                               const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                               int64_t n_tok) {
  const GroupTask t = group_task(g);
  matvec_q8_mma_body<T, NB>(t.w, row_bytes, t.n_rows, n_cols, xq, xd, n_tok, t.y, t.rb);
}

// ---- Q4_K and Q6_K on the tensor cores through shared memory (what launch_mma_nb runs for them
// at 8 or 16 tokens per block column, rows of whole stages). The kernel above loads each
// fragment word straight from global memory: a warp's 4-byte loads touch 8 rows' (or 8 tokens')
// lines, ~8 L1 wavefronts per 128 useful bytes, and each warp runs one virtual lane's chain of
// loads at a time (at 16 tokens, Q4_K 4096x14336 took 67 us, ~5x the weights' read time). Here
// the block copies its 16 rows and its tokens' activations one stage of 8 steps (Q4_K: pairs,
// 512 columns; Q6_K: units, 256 columns, one block) at a time into shared memory with cp.async
// (16-byte copies, STAGES - 1 stages in flight: the weights of the first ones before the PDL
// wait), and every warp keeps the sums of all its virtual lanes in registers (8 warps of 4 by
// default, or 4 of 8: mma_warps()), so the stages stream while the tensor cores work.
// Same bits: a virtual lane l still adds its steps l, l + 32, ... in that order (stage k holds
// steps 8k .. 8k + 7 of each group of 32, one step of a quarter of the virtual lanes), each
// step's floats are mma_compute's, and the lanes close into the butterfly as above
// (mma_close_vlane, mma_store_block). Q4_K: a lane takes its fragment's bytes 8q .. 8q + 7 of a
// unit as one 8-byte word, for the weights and the activations alike: fragment column 4q + j
// holds byte 8q + j and 16 + 4q + j byte 8q + 4 + j, one permutation of the unit's 32
// products on both operands, so the exact integer dot is unchanged. (Q6_K keeps mma_compute's
// columns: its two 16-element halves have their own scales, one product each.)
//
// Q6_K blocks (210 bytes) are 2-byte aligned: a row's stage is copied as the 16-byte granules
// that cover it (from its address rounded down, 14 granules), and read back at its offset in
// the first one with aligned words and funnel shifts. Every granule copied holds a byte of the
// block, so no copy leaves the 16-byte granules the weight's own bytes lie in: none starts
// before its (256-byte aligned) allocation, and past the end one reads at most the rest of the
// granule holding the last byte, never across a page (load_words_a2 relies on the same).
constexpr int kMsSteps = 8;  // steps per stage
template <DType T>
struct MsType {
  static constexpr bool kQ4 = T == DType::Q4_K;
  static constexpr int kUnits = kQ4 ? 2 * kMsSteps : kMsSteps;  // activation units per stage
  static constexpr int kCols = kUnits * kBlk;                   // columns per stage
  static constexpr int kRowBytes = kQ4 ? 2 * 144 : 210;         // a row's bytes per stage
  // A row's slot: Q4_K 288 bytes (= 32 mod 128: a half warp's 8-byte loads of rows g = 0..3
  // at bytes 8q cover the 32 banks once); Q6_K 224, the granules of a 2-aligned block.
  static constexpr int kWRow = kQ4 ? kRowBytes : 224;
  // A token's int8 (Q4_K: 32 mod 128, as above; Q6_K's 4-byte loads of tokens g = 0..7: 76
  // words apart, every bank once) and its (d, d sum q) float2s (tokens 2q: distinct banks).
  static constexpr int kARow = kQ4 ? kUnits * kBlk + 32 : kUnits * kBlk + 48;
  static constexpr int kDRow = kUnits + 2;
};
template <DType T, int NB>
struct MsLayout {
  using M = MsType<T>;
  static constexpr int kTok = 8 * NB;
  static constexpr int kW = kMmaRows * M::kWRow;
  static constexpr int kA = kTok * M::kARow;
  static constexpr int kD = kTok * M::kDRow * 8;
  static constexpr int kStage = kW + kA + kD;
  static_assert(kW % 16 == 0 && kA % 16 == 0 && kD % 16 == 0);
  static_assert(kStage >= int(8 * kMmaRows * 8 * NB * sizeof(float)));  // reused for part
};

// A Q4_K unit's (scale, min) as floats: sub-block j (0..7) of the block whose 16-byte header
// words are hw (d and dmin as f16, then the 12 scale bytes).
__device__ __forceinline__ float2 q4k_unit_scales(const uint32_t (&hw)[4], int j) {
  int sc, m;
  k_scale_min(hw + 1, j, sc, m);
  return make_float2(mul_rn(h2f_bits(uint16_t(hw[0])), i2f(sc)),
                     mul_rn(h2f_bits(uint16_t(hw[0] >> 16)), i2f(m)));
}
// The stage's (scale, min) of unit u, row r, are at pre[u * kMmaRows + r] (ms_decode_scales,
// once per block) instead of each lane decoding its rows' headers (the four lanes of a row
// repeated that work): 1-11 % less time per call at 8 and 16 tokens (CUDA session 14).
template <int NB>
__device__ __forceinline__ void ms_step_q4k(const uint8_t* sw, const uint8_t* sa, const float2* sd,
                                            const float2* pre, int p, int g, int q,
                                            float (&acc)[NB][4]) {
  using M = MsType<DType::Q4_K>;
  const int pp = p & 3;
  const uint8_t* bg = sw + g * M::kWRow + (p >> 2) * 144;
  const uint8_t* bh = bg + 8 * M::kWRow;
  const uint2 qg = *reinterpret_cast<const uint2*>(bg + 16 + 32 * pp + 8 * q);
  const uint2 qh = *reinterpret_cast<const uint2*>(bh + 16 + 32 * pp + 8 * q);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int u = 2 * p + h;  // the unit within the stage
    const float2 sg = pre[u * kMmaRows + g];
    const float2 sh = pre[u * kMmaRows + g + 8];
    const float d0g = sg.x, d1g = sg.y, d0h = sh.x, d1h = sh.y;
    const int sft = 4 * h;
    const uint32_t a0 = (qg.x >> sft) & 0x0F0F0F0Fu, a1 = (qh.x >> sft) & 0x0F0F0F0Fu;
    const uint32_t a2 = (qg.y >> sft) & 0x0F0F0F0Fu, a3 = (qh.y >> sft) & 0x0F0F0F0Fu;
    int c[NB][4];
    float2 ds[NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint2 bw =
          *reinterpret_cast<const uint2*>(sa + (8 * nb + g) * M::kARow + u * kBlk + 8 * q);
      mma_s8(c[nb], a0, a1, a2, a3, bw.x, bw.y);
      ds[nb][0] = sd[(8 * nb + 2 * q) * M::kDRow + u];
      ds[nb][1] = sd[(8 * nb + 2 * q + 1) * M::kDRow + u];
    }
    mma_update<DType::Q4_K, NB>(acc, c, c, d0g, d1g, d0h, d1h, ds);
  }
}
// Every (unit, row) (scale, min) of a Q4_K stage into pre, by the block's threads together.
template <int THREADS>
__device__ __forceinline__ void ms_decode_scales(const uint8_t* sw, float2* pre, int tid) {
  using M = MsType<DType::Q4_K>;
  for (int i = tid; i < M::kUnits * kMmaRows; i += THREADS) {
    const int u = i / kMmaRows, r = i % kMmaRows, p = u / 2;
    const uint4 hb = *reinterpret_cast<const uint4*>(sw + r * M::kWRow + (p >> 2) * 144);
    const uint32_t hw[4] = {hb.x, hb.y, hb.z, hb.w};
    pre[i] = q4k_unit_scales(hw, 2 * (p & 3) + (u & 1));
  }
}
// bg / bh: rows g and g + 8's block (2-byte aligned in its slot); unit s (0..7) of it.
template <int NB>
__device__ __forceinline__ void ms_step_q6k(const uint8_t* bg, const uint8_t* bh, const uint8_t* sa,
                                            const float2* sd, int s, int g, int q,
                                            float (&acc)[NB][4]) {
  using kiln::quant::block_q6_K;
  using M = MsType<DType::Q6_K>;
  const int hs = s / 4, qq = s % 4;
  const int lo = offsetof(block_q6_K, ql) + 64 * hs + 32 * (qq & 1) + 4 * q;
  const int ho = offsetof(block_q6_K, qh) + 32 * hs + 4 * q;
  uint32_t wa[4], wx[4];
  load_words_a2<4>(bg + lo, &wa[0]);
  load_words_a2<4>(bh + lo, &wa[1]);
  load_words_a2<4>(bg + lo + 16, &wa[2]);
  load_words_a2<4>(bh + lo + 16, &wa[3]);
  load_words_a2<4>(bg + ho, &wx[0]);
  load_words_a2<4>(bh + ho, &wx[1]);
  load_words_a2<4>(bg + ho + 16, &wx[2]);
  load_words_a2<4>(bh + ho + 16, &wx[3]);
  const int so = offsetof(block_q6_K, scales) + 8 * hs + 2 * qq;
  const float dg = h2f_bits(load_u16(bg + offsetof(block_q6_K, d)));
  const float dh = h2f_bits(load_u16(bh + offsetof(block_q6_K, d)));
  const uint32_t sg = load_u16(bg + so), sh = load_u16(bh + so);
  const float d0g = mul_rn(dg, i2f(int8_t(sg & 0xFF))), d1g = mul_rn(dg, i2f(int8_t(sg >> 8)));
  const float d0h = mul_rn(dh, i2f(int8_t(sh & 0xFF))), d1h = mul_rn(dh, i2f(int8_t(sh >> 8)));
  const int lshift = qq >= 2 ? 4 : 0;
  uint32_t a[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    a[j] = __vsub4(((wa[j] >> lshift) & 0x0F0F0F0Fu) | (((wx[j] >> (2 * qq)) & 0x03030303u) << 4),
                   0x20202020u);
  int c0[NB][4], c1[NB][4];
  float2 ds[NB][2];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const uint8_t* ab = sa + (8 * nb + g) * M::kARow + s * kBlk + 4 * q;
    const uint32_t b0 = *reinterpret_cast<const uint32_t*>(ab);
    const uint32_t b1 = *reinterpret_cast<const uint32_t*>(ab + 16);
    mma_s8(c0[nb], a[0], a[1], 0u, 0u, b0, b1);
    mma_s8(c1[nb], 0u, 0u, a[2], a[3], b0, b1);
    ds[nb][0] = sd[(8 * nb + 2 * q) * M::kDRow + s];
    ds[nb][1] = sd[(8 * nb + 2 * q + 1) * M::kDRow + s];
  }
  mma_update<DType::Q6_K, NB>(acc, c0, c1, d0g, d1g, d0h, d1h, ds);
}

// Stage k (= J mod 4) as warp `warp` of W sees it: of its VL = 32 / W virtual lanes
// bitrev5(VL warp + ii), the ones whose step lies there (l / 8 == J) are ii = b and (VL = 8)
// b + 4, b = J's two bits swapped, at step l % 8 of the stage. rg / rh: rows g and g + 8 in
// global memory (Q6_K: the offset of the stage's block in its first granule).
template <DType T, int NB, int J, int W>
__device__ __forceinline__ void ms_compute(const uint8_t* __restrict__ st, int k, int warp, int g,
                                           int q, const uint8_t* rg, const uint8_t* rh,
                                           const float2* pre, float (&acc)[32 / W][NB][4]) {
  constexpr int VL = 32 / W;
  using L = MsLayout<T, NB>;
  using M = MsType<T>;
  constexpr int b = (J >> 1) | ((J & 1) << 1);
  const uint8_t* sa = st + L::kW;
  const float2* sd = reinterpret_cast<const float2*>(st + L::kW + L::kA);
#pragma unroll
  for (int v = 0; v < VL / 4; ++v) {
    const int ii = b + 4 * v;
    const int p = bitrev5(warp * VL + ii) & 7;  // the step within the stage
    if constexpr (M::kQ4) {
      ms_step_q4k<NB>(st, sa, sd, pre, p, g, q, acc[ii]);
    } else {
      const int og = int(reinterpret_cast<uintptr_t>(rg + int64_t(k) * M::kRowBytes) & 15);
      const int oh = int(reinterpret_cast<uintptr_t>(rh + int64_t(k) * M::kRowBytes) & 15);
      ms_step_q6k<NB>(st + g * M::kWRow + og, st + (g + 8) * M::kWRow + oh, sa, sd, p, g, q,
                      acc[ii]);
    }
  }
}

// Rows rb * 16 .. + 15, tokens blockIdx.x * 8 NB .. of y; n_cols a multiple of the stage's
// columns, activations 16-byte aligned, Q4_K rows 16-byte aligned (ms_applies).
template <DType T, int NB, int STAGES, int W>
__device__ __forceinline__ void matvec_ms_body(const uint8_t* __restrict__ w, size_t row_bytes,
                                               int64_t n_rows, int64_t n_cols,
                                               const int8_t* __restrict__ xq,
                                               const float2* __restrict__ xd, int64_t n_tok,
                                               float* __restrict__ y, int64_t rb) {
  using L = MsLayout<T, NB>;
  using M = MsType<T>;
  extern __shared__ __align__(16) uint8_t sm[];
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
  const int g = lane >> 2, q = lane & 3;
  const int64_t r0 = rb * kMmaRows, t0 = int64_t(blockIdx.x) * L::kTok;
  const int64_t n_units = n_cols / kBlk;
  const int n_st = int(n_cols / M::kCols);
  constexpr int kThreads = W * kWarp;
  constexpr int VL = 32 / W;  // virtual lanes per warp
  // Rows past the matrix and tokens past the call repeat the last one; never stored.
  const auto row_at = [&](int64_t r) {
    return w + (r0 + r < n_rows ? r0 + r : n_rows - 1) * row_bytes;
  };
  const uint8_t* rg = row_at(g);
  const uint8_t* rh = row_at(g + 8);
  const auto load_w = [&](int k) {
    if (k >= n_st) return;
    uint8_t* dst = sm + (k % STAGES) * L::kStage;
    constexpr int kG = M::kWRow / 16;
    for (int i = tid; i < kMmaRows * kG; i += kThreads) {
      const int r = i / kG, c = i % kG;
      const uint8_t* src = row_at(r) + int64_t(k) * M::kRowBytes;
      if constexpr (!M::kQ4)  // the granule holding the block's first byte
        src = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t(15));
      cp_async16(dst + r * M::kWRow + 16 * c, src + 16 * c);
    }
  };
  const auto load_a = [&](int k) {
    if (k >= n_st) return;
    uint8_t* dst = sm + (k % STAGES) * L::kStage + L::kW;
    constexpr int kGa = M::kCols / 16, kGd = M::kUnits * 8 / 16;
    for (int i = tid; i < L::kTok * kGa; i += kThreads) {
      const int t = i / kGa, c = i % kGa;
      const int64_t tok = t0 + t < n_tok ? t0 + t : n_tok - 1;
      cp_async16(dst + t * M::kARow + 16 * c, xq + tok * n_cols + int64_t(k) * M::kCols + 16 * c);
    }
    for (int i = tid; i < L::kTok * kGd; i += kThreads) {
      const int t = i / kGd, c = i % kGd;
      const int64_t tok = t0 + t < n_tok ? t0 + t : n_tok - 1;
      cp_async16(dst + L::kA + t * (M::kDRow * 8) + 16 * c,
                 xd + tok * n_units + int64_t(k) * M::kUnits + 2 * c);
    }
  };
  // The weights (which no kernel writes) of the first stages before the PDL wait.
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) load_w(k);
  pdl_enter();
#pragma unroll
  for (int k = 0; k < STAGES - 1; ++k) {
    load_a(k);
    cp_async_commit();
  }
  float acc[VL][NB][4];
#pragma unroll
  for (int ii = 0; ii < VL; ++ii)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[ii][nb][e] = 0.0f;
  const auto step = [&]<int J>(int k) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of stage k are done
    __syncthreads();              // everyone's are, and everyone is done with stage k - 1's slot
    load_w(k + STAGES - 1);
    load_a(k + STAGES - 1);
    cp_async_commit();  // possibly empty: one group per stage keeps the count
    float2* pre = reinterpret_cast<float2*>(sm + STAGES * L::kStage);
    if constexpr (MsType<T>::kQ4) {  // only Q4_K has scales to decode ahead
      ms_decode_scales<kThreads>(sm + (k % STAGES) * L::kStage, pre, tid);
      __syncthreads();  // pre is written (the barrier above: everyone is done with the last one)
    }
    ms_compute<T, NB, J, W>(sm + (k % STAGES) * L::kStage, k, warp, g, q, rg, rh, pre, acc);
  };
  for (int k = 0; k < n_st; k += 4) {
    step.template operator()<0>(k);
    if (k + 1 < n_st) step.template operator()<1>(k + 1);
    if (k + 2 < n_st) step.template operator()<2>(k + 2);
    if (k + 3 < n_st) step.template operator()<3>(k + 3);
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is free for the warps' subtrees
  float stk[3][NB][4];
  float fin[NB][4];
#pragma unroll
  for (int ii = 0; ii < VL; ++ii) mma_close_vlane<NB>(ii, acc[ii], stk, fin);
  if constexpr (VL == 4) {  // the warp's subtree closed at ii = 3, into the third level
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) fin[nb][e] = stk[2][nb][e];
  }
  mma_store_block<NB, W>(reinterpret_cast<float(*)[kMmaRows][8 * NB]>(sm), fin, warp, g, q, r0, t0,
                         n_rows, n_tok, y);
}
// Register cap: 4 warps, 3 blocks per SM (Q4_K at 16 tokens: 206 registers uncapped, 2
// blocks), 4 for Q4_K at 8 tokens (Q6_K's step, more words per unit, spills 180-390 bytes under
// that cap); 8 warps (half the sums per thread), 2 blocks.
template <DType T, int NB, int W>
constexpr int kMsMinBlocks = W == 8                        ? 2
                             : NB == 1 && T == DType::Q4_K ? 4
                                                           : 3;
template <DType T, int NB, int STAGES, int W>
__global__ void __launch_bounds__(W* kWarp, kMsMinBlocks<T, NB, W>)
    matvec_ms_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                     int64_t n_cols, const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                     int64_t n_tok, float* __restrict__ y) {
  matvec_ms_body<T, NB, STAGES, W>(w, row_bytes, n_rows, n_cols, xq, xd, n_tok, y, blockIdx.y);
}
template <DType T, int NB, int STAGES, int W>
__global__ void __launch_bounds__(W* kWarp, kMsMinBlocks<T, NB, W>)
    matvec_ms_group_kernel(GroupArgs g, size_t row_bytes, int64_t n_cols,
                           const int8_t* __restrict__ xq, const float2* __restrict__ xd,
                           int64_t n_tok) {
  const GroupTask t = group_task(g);
  matvec_ms_body<T, NB, STAGES, W>(t.w, row_bytes, t.n_rows, n_cols, xq, xd, n_tok, t.y, t.rb);
}
// Dynamic shared memory of a form: the ring, and for Q4_K a stage's decoded scales.
template <DType T, int NB, int S>
constexpr int ms_smem_bytes() {
  return S * MsLayout<T, NB>::kStage +
         (MsType<T>::kQ4 ? MsType<DType::Q4_K>::kUnits * kMmaRows * int(sizeof(float2)) : 0);
}
// The types and tile counts the shared-memory form is built for.
template <DType T, int NB>
constexpr bool kMsForm = (T == DType::Q4_K || T == DType::Q6_K) && NB <= 2;
// Whether launch_mma_nb / the group launch take the shared-memory form (given mma_applies).
template <DType T, int NB>
bool ms_applies(const DeviceWeight& w) {
  return w.n_cols % MsType<T>::kCols == 0 && mma_stages() > 0;
}
// Above 48 KiB a kernel must opt in to its dynamic shared memory: once per device and kernel
// (not while a graph is being captured, so the first call of each kernel sets it).
template <typename K>
cudaError_t ms_smem_opt_in(K kernel, int bytes, std::atomic<uint32_t>& done) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint32_t bit = dev < 32 ? 1u << dev : 0u;  // bit d: set on device d
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  return e;
}
// matvec_ms_kernel (G: its group form, args a GroupArgs first) with the ring of mma_stages()
// (3, 4 or 6) stages in dynamic shared memory and mma_warps() (4 or 8) warps.
template <DType T, int NB, bool G, typename... A>
cudaError_t launch_ms(dim3 grid, cudaStream_t s, A... args) {
  const auto go = [&]<int S, int W>() -> cudaError_t {
    constexpr int kBytes = ms_smem_bytes<T, NB, S>();
    static std::atomic<uint32_t> done{0};  // one per kernel
    const auto kernel = [] {
      if constexpr (G)
        return matvec_ms_group_kernel<T, NB, S, W>;
      else
        return matvec_ms_kernel<T, NB, S, W>;
    }();
    if (cudaError_t e = ms_smem_opt_in(kernel, kBytes, done); e != cudaSuccess) return e;
    return launch(kernel, grid, W * kWarp, size_t(kBytes), s, args...);
  };
  const auto stages = [&]<int S>() {
    return mma_warps() == 8 ? go.template operator()<S, 8>() : go.template operator()<S, 4>();
  };
  switch (mma_stages()) {
    case 4:
      return stages.template operator()<4>();
    case 6:
      return stages.template operator()<6>();
    default:
      return stages.template operator()<3>();
  }
}

template <DType T>
constexpr bool mma_type() {
  return T == DType::Q4_K || T == DType::Q6_K || T == DType::Q8_0;
}
// Whether the tensor-core path takes this weight at n_tok tokens: a supported type, at least
// min_tokens tokens (0: never), Q4_K rows whole blocks and 16-byte aligned, a device that has
// the instruction (sm_80+), row blocks within one grid. Q8_0 only when asked for by
// launch_matvec_q8_mma (any_type): its tensor-core kernel, without the shared-memory form, is
// slower than dp4a (14336x4096 at 8 tokens 99.5 against 65.2 us, docs/BENCHMARKS.md session 10).
bool mma_applies(const DeviceWeight& w, int64_t n_tok, int min_tokens, bool any_type = false) {
  if (min_tokens <= 0 || n_tok < min_tokens || (w.n_rows + kMmaRows - 1) / kMmaRows > 65535)
    return false;
  if (!any_type && w.dtype == DType::Q8_0) return false;
  bool ok = false;
  dispatch_dtype(w.dtype, [&]<DType T>() { ok = mma_type<T>(); });
  if (!ok) return false;
  if (w.dtype == DType::Q4_K &&
      (w.n_cols % 256 != 0 || reinterpret_cast<uintptr_t>(w.data) % 16 != 0 ||
       w.row_bytes % 16 != 0))
    return false;
  static const int major = [] {
    int dev = 0, v = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return v;
  }();
  return major >= 8;
}
// Tiles of 8 tokens per block column: 1 up to 8 tokens, else 2 (4 tiles spill registers with
// two steps in flight).
template <typename F>
cudaError_t with_mma_shape(int64_t n_tok, F&& f) {
  if (n_tok <= 8) return f.template operator()<1>();
  return f.template operator()<2>();
}
template <DType T, int NB>
cudaError_t launch_mma_nb(const DeviceWeight& w, const int8_t* xq, const float2* xd, int64_t n_tok,
                          float* y, cudaStream_t s) {
  const int64_t n_rb = (w.n_rows + kMmaRows - 1) / kMmaRows;
  if (n_rb > 65535) return cudaErrorInvalidValue;
  const dim3 grid(unsigned((n_tok + 8 * NB - 1) / (8 * NB)), unsigned(n_rb));
  if constexpr (kMsForm<T, NB>) {
    if (ms_applies<T, NB>(w))
      return launch_ms<T, NB, false>(grid, s, reinterpret_cast<const uint8_t*>(w.data), w.row_bytes,
                                     w.n_rows, w.n_cols, xq, xd, n_tok, y);
  }
  return launch(matvec_q8_mma_kernel<T, NB>, grid, kQ8Warps * kWarp, 0, s,
                reinterpret_cast<const uint8_t*>(w.data), w.row_bytes, w.n_rows, w.n_cols, xq, xd,
                n_tok, y);
}
template <DType T>
cudaError_t launch_mma_typed(const DeviceWeight& w, const int8_t* xq, const float2* xd,
                             int64_t n_tok, float* y, cudaStream_t s) {
  if constexpr (!mma_type<T>()) {
    return cudaErrorInvalidValue;
  } else {
    return with_mma_shape(n_tok,
                          [&]<int NB>() { return launch_mma_nb<T, NB>(w, xq, xd, n_tok, y, s); });
  }
}

// ---- float weights, up to 8 tokens: lane l reads 8 consecutive elements at 8l + 256i (16- or
// 32-byte loads, a warp's loads contiguous), f32 FMAs against f32 activations in a fixed
// order per token. A warp takes R rows at a time so that each activation load (two float4s
// per token and 8 columns, from L1) serves R rows: at R = 1 a multi-token step spent more in
// those loads than in the weight stream (5 tokens cost 2.8x one on the 8B F16 shape). Each
// output's accumulation order (a lane's columns in increasing order, then warp_sum_rn) does
// not depend on R, NT or the token's column of the launch, so every variant has the same
// bits (CudaMatvecQ8.FloatRowsAndColumnsKeepBits).
template <DType T, int NT, int R>
__device__ __forceinline__ void matvec_float_v3_body(const uint8_t* __restrict__ w,
                                                     size_t row_bytes, int64_t n_rows,
                                                     int64_t n_cols, const float* __restrict__ x,
                                                     int64_t n_tok, float* __restrict__ y,
                                                     int64_t rb_first) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t t0 = int64_t(blockIdx.x) * NT;
  const int nt = n_tok - t0 < NT ? int(n_tok - t0) : NT;
  prefetch_first_rows<R, kFloatWarps>(w, row_bytes, n_rows, rb_first, lane, warp);
  pdl_enter();
  for (int64_t r0 = (rb_first * kFloatWarps + warp) * R; r0 < n_rows;
       r0 += int64_t(gridDim.y) * kFloatWarps * R) {
    float acc[R][NT];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[i][t] = 0.0f;
    // G 16-byte pieces per lane and row at a time (G * R = 8 for f16: the loads in flight per
    // lane stay as at R = 1), all issued first; the column clamped into the row and a piece
    // past its end dropped afterwards; a row past the matrix reads the last row, unused.
    constexpr int G0 = T == DType::F32 ? 4 : 8;
    constexpr int G = G0 / R > 0 ? G0 / R : 1;
    constexpr int64_t kStep = kWarp * 8;
    const uint8_t* rows[R];
#pragma unroll
    for (int i = 0; i < R; ++i) rows[i] = w + (r0 + i < n_rows ? r0 + i : n_rows - 1) * row_bytes;
    for (int64_t c0 = int64_t(lane) * 8; c0 < n_cols; c0 += kStep * G) {
      uint4 raw[R][G][T == DType::F32 ? 2 : 1];
#pragma unroll
      for (int i = 0; i < R; ++i)
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const int64_t c = c0 + kStep * g < n_cols ? c0 + kStep * g : n_cols - 8;
          if constexpr (T == DType::F32) {
            raw[i][g][0] = __ldg(reinterpret_cast<const uint4*>(rows[i]) + c / 4);
            raw[i][g][1] = __ldg(reinterpret_cast<const uint4*>(rows[i]) + c / 4 + 1);
          } else {
            raw[i][g][0] = __ldg(reinterpret_cast<const uint4*>(rows[i]) + c / 8);
          }
        }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const bool valid = c0 + kStep * g < n_cols;
        const int64_t c = valid ? c0 + kStep * g : n_cols - 8;
        float v[R][8];
#pragma unroll
        for (int i = 0; i < R; ++i) {
          if constexpr (T == DType::F32) {
            const uint32_t wd[8] = {raw[i][g][0].x, raw[i][g][0].y, raw[i][g][0].z, raw[i][g][0].w,
                                    raw[i][g][1].x, raw[i][g][1].y, raw[i][g][1].z, raw[i][g][1].w};
#pragma unroll
            for (int l = 0; l < 8; ++l) v[i][l] = __uint_as_float(wd[l]);
          } else {
            const uint32_t wd[4] = {raw[i][g][0].x, raw[i][g][0].y, raw[i][g][0].z, raw[i][g][0].w};
#pragma unroll
            for (int l = 0; l < 8; ++l) {
              const uint16_t h = uint16_t(wd[l >> 1] >> (16 * (l & 1)));
              v[i][l] = T == DType::F16 ? h2f_bits(h) : bf2f_bits(h);
            }
          }
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (NT > 1 && t >= nt) break;
          const float4* x4 = reinterpret_cast<const float4*>(x + (t0 + t) * n_cols + c);
          const float4 xa = __ldg(x4), xb = __ldg(x4 + 1);
#pragma unroll
          for (int i = 0; i < R; ++i) {
            float s = acc[i][t];
            s = __fmaf_rn(v[i][0], xa.x, s);
            s = __fmaf_rn(v[i][1], xa.y, s);
            s = __fmaf_rn(v[i][2], xa.z, s);
            s = __fmaf_rn(v[i][3], xa.w, s);
            s = __fmaf_rn(v[i][4], xb.x, s);
            s = __fmaf_rn(v[i][5], xb.y, s);
            s = __fmaf_rn(v[i][6], xb.z, s);
            s = __fmaf_rn(v[i][7], xb.w, s);
            acc[i][t] = valid ? s : acc[i][t];
          }
        }
      }
    }
    store_sums<R, NT>(acc, nt, lane, t0, r0, n_rows, y);
  }
}
template <DType T, int NT, int R>
__global__ void __launch_bounds__(kFloatWarps* kWarp)
    matvec_float_v3_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                           int64_t n_cols, const float* __restrict__ x, int64_t n_tok,
                           float* __restrict__ y) {
  matvec_float_v3_body<T, NT, R>(w, row_bytes, n_rows, n_cols, x, n_tok, y, blockIdx.y);
}
template <DType T, int NT, int R>
__global__ void __launch_bounds__(kFloatWarps* kWarp)
    matvec_float_v3_group_kernel(GroupArgs g, size_t row_bytes, int64_t n_cols,
                                 const float* __restrict__ x, int64_t n_tok) {
  const GroupTask t = group_task(g);
  matvec_float_v3_body<T, NT, R>(t.w, row_bytes, t.n_rows, n_cols, x, n_tok, t.y, t.rb);
}

constexpr bool is_float(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }

// The float kernel's preconditions: float weights, 1-8 tokens, rows and activations 16-byte
// aligned (its loads), whole 8-element pieces per row.
bool float_v3_fits(const DeviceWeight& w, const float* x, int64_t n_tok) {
  return is_float(w.dtype) && n_tok >= 1 && n_tok <= 8 &&
         reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && w.row_bytes % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0 && w.n_cols % 8 == 0 && w.n_cols >= 8;
}

unsigned row_blocks(int64_t n_rows, int64_t rows_per_block) {
  const int64_t n = (n_rows + rows_per_block - 1) / rows_per_block;
  return unsigned(std::min<int64_t>(n, 65535));  // the kernels loop over further row blocks
}

template <DType T, int NT, int R, int MODE>
cudaError_t launch_q8_cfg(const DeviceWeight& w, const int8_t* xq, const float2* xd, int64_t n_tok,
                          float* y, cudaStream_t s) {
  const dim3 grid(unsigned((n_tok + NT - 1) / NT), row_blocks(w.n_rows, int64_t(kQ8Warps) * R));
  return launch(matvec_q8_kernel<T, NT, R, MODE>, grid, kQ8Warps * kWarp, 0, s,
                reinterpret_cast<const uint8_t*>(w.data), w.row_bytes, w.n_rows, w.n_cols, xq, xd,
                n_tok, y);
}

// Tokens per launch column and rows per warp: one token streams one row per warp (the most
// warps in flight); more tokens carry more rows so that each activation load serves several
// dot products (the batched kernels are bound by L1 and dp4a issue, not by HBM). The mode by
// the rows' alignment. f.template operator()<NT, R, MODE>() launches; a group of weights takes
// the same choice as each of them alone (same type, width, row size and alignment).
template <DType T, typename F>
cudaError_t with_q8_shape(const DeviceWeight& w, int64_t n_tok, F&& f) {
  const auto modes = [&]<int MODE>() -> cudaError_t {
    if constexpr (MODE == kDirect2) {  // odd shapes (tests, small models): two instantiations
      if (n_tok == 1) return f.template operator()<1, 1, MODE>();
      return f.template operator()<8, 4, MODE>();
    } else {
      // Q4_K's pairs, one token: two rows per warp (the activation words loaded once for both)
      // measured 7-21 % faster than one on the 8B shape's 4096x14336, 14336x4096 and
      // 4096x32000, within 5 % on 4096x1024 / 4096x4096 (H200, cuda_matvec_bench's one-token
      // launch-shape A/B, since removed, v4 against v0, session 9); R changes no bits.
      if (n_tok == 1) {
        if constexpr (T == DType::Q4_K && MODE == kDirect16)
          return f.template operator()<1, 2, MODE>();
        else
          return f.template operator()<1, 1, MODE>();
      }
      // Two tokens: two rows per warp for Q4_K and Q6_K (one row was short of work per load);
      // three and four tokens: four rows for Q4_K (Q6_K level or slower there). By
      // cuda_matvec_bench's launch-shape A/B on an H100 (docs/BENCHMARKS.md, sessions 35-36).
      if (n_tok == 2) {
        if constexpr (T == DType::Q4_K || T == DType::Q6_K)
          return f.template operator()<2, 2, MODE>();
        else
          return f.template operator()<2, 1, MODE>();
      }
      if (n_tok <= 4) {
        if constexpr (T == DType::Q4_K)
          return f.template operator()<4, 4, MODE>();
        else
          return f.template operator()<4, 2, MODE>();
      }
      return f.template operator()<8, 4, MODE>();
    }
  };
  // Q4_K rows are whole 256-element blocks of four pairs (the pair loop's block index).
  if constexpr (T == DType::Q4_K)
    if (w.n_cols % 256 != 0) return cudaErrorInvalidValue;
  const bool aligned = reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && w.row_bytes % 16 == 0;
  if constexpr (q8_chunk_units<T>() > 0) {
    if (aligned && (w.n_cols / kBlk) % q8_chunk_units<T>() == 0)
      return modes.template operator()<kStaged>();
  } else {
    if (aligned) return modes.template operator()<kDirect16>();
  }
  return modes.template operator()<kDirect2>();
}

template <DType T>
cudaError_t launch_q8_typed(const DeviceWeight& w, const int8_t* xq, const float2* xd,
                            int64_t n_tok, float* y, cudaStream_t s) {
  return with_q8_shape<T>(w, n_tok, [&]<int NT, int R, int MODE>() {
    return launch_q8_cfg<T, NT, R, MODE>(w, xq, xd, n_tok, y, s);
  });
}

// The group's table (rows_per_block rows per block), or false when it is not one launch's
// worth: more than kMatvecGroupMax weights, or more row blocks than a grid's y dimension.
bool make_group(std::span<const DeviceWeight> ws, std::span<float* const> ys,
                int64_t rows_per_block, GroupArgs* g) {
  if (ws.empty() || ws.size() != ys.size() || ws.size() > size_t(kMatvecGroupMax)) return false;
  int64_t end = 0;
  *g = GroupArgs{};
  g->n = int(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    g->w[i] = reinterpret_cast<const uint8_t*>(ws[i].data);
    g->y[i] = ys[i];
    g->n_rows[i] = ws[i].n_rows;
    end += (ws[i].n_rows + rows_per_block - 1) / rows_per_block;
    g->rb_end[i] = end;
  }
  return end > 0 && end <= 65535;
}

// Same type, width, row bytes and row alignment (so with_q8_shape / launch_float_v3's choice
// is one for all), none empty.
bool same_layout(std::span<const DeviceWeight> ws) {
  const auto al = [](const DeviceWeight& w) {
    return reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && w.row_bytes % 16 == 0;
  };
  for (const DeviceWeight& w : ws)
    if (w.dtype != ws[0].dtype || w.n_cols != ws[0].n_cols || w.row_bytes != ws[0].row_bytes ||
        al(w) != al(ws[0]) || w.n_rows <= 0)
      return false;
  return !ws.empty();
}

template <DType T, int NT, int R>
cudaError_t launch_float_v3_shape(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                                  cudaStream_t s) {
  const auto* wb = reinterpret_cast<const uint8_t*>(w.data);
  const dim3 grid(unsigned((n_tok + NT - 1) / NT), row_blocks(w.n_rows, int64_t(kFloatWarps) * R));
  return launch(matvec_float_v3_kernel<T, NT, R>, grid, kFloatWarps * kWarp, 0, s, wb, w.row_bytes,
                w.n_rows, w.n_cols, x, n_tok, y);
}

// rows 1, 2 or 4 (rows per warp); tokens per launch column: 1, 4 (2-4 tokens) or 8 (5-8), so
// every token of a step of up to 8 reads the weights once. f.template operator()<NT, R>().
template <typename F>
cudaError_t with_float_shape(int64_t n_tok, int rows, F&& f) {
  const auto go = [&]<int R>() {
    if (n_tok == 1) return f.template operator()<1, R>();
    if (n_tok <= 4) return f.template operator()<4, R>();
    return f.template operator()<8, R>();
  };
  if (rows == 4) return go.template operator()<4>();
  if (rows == 2) return go.template operator()<2>();
  return go.template operator()<1>();
}
template <DType T>
cudaError_t launch_float_v3(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                            int rows, cudaStream_t s) {
  return with_float_shape(n_tok, rows, [&]<int NT, int R>() {
    return launch_float_v3_shape<T, NT, R>(w, x, n_tok, y, s);
  });
}

}  // namespace

bool matvec_q8_supports(DType t) {
  switch (t) {
    case DType::Q8_0:
    case DType::Q4_0:
    case DType::Q5_0:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
      return true;
    default:
      return false;
  }
}

size_t act_q8_bytes(int64_t n_cols, int64_t n_tok) {
  if (n_cols <= 0 || n_cols % kBlk != 0 || n_tok <= 0 || n_tok > kQ8MaxTokens) return 0;
  return align16(size_t(n_tok) * size_t(n_cols)) +
         size_t(n_tok) * size_t(n_cols / kBlk) * sizeof(float2);
}

cudaError_t launch_quantize_act_q8(const float* x, int64_t n_cols, int64_t n_tok, void* act,
                                   cudaStream_t s, const float* up) {
  if (act_q8_bytes(n_cols, n_tok) == 0) return cudaErrorInvalidValue;
  auto* q = static_cast<int8_t*>(act);
  auto* ds = reinterpret_cast<float2*>(q + align16(size_t(n_tok) * size_t(n_cols)));
  const int64_t n_blocks = n_tok * (n_cols / kBlk);
  constexpr int kThreads = 256;
  const int64_t per_block = kThreads / kWarp;
  const unsigned grid = unsigned((n_blocks + per_block - 1) / per_block);
  if (up != nullptr)
    return launch(quantize_act_q8_kernel<true>, grid, kThreads, 0, s, x, up, n_blocks, q, ds);
  return launch(quantize_act_q8_kernel<false>, grid, kThreads, 0, s, x, up, n_blocks, q, ds);
}

cudaError_t launch_matvec_q8(const DeviceWeight& w, const void* act, int64_t n_tok, float* y,
                             cudaStream_t s, int mma_min_tokens) {
  if (!matvec_q8_supports(w.dtype) || act_q8_bytes(w.n_cols, n_tok) == 0 ||
      reinterpret_cast<uintptr_t>(act) % 16 != 0)
    return cudaErrorInvalidValue;
  if (w.n_rows == 0) return cudaSuccess;
  const auto* xq = static_cast<const int8_t*>(act);
  const auto* xd = reinterpret_cast<const float2*>(xq + align16(size_t(n_tok) * size_t(w.n_cols)));
  const bool mma = mma_applies(w, n_tok, mma_min_tokens);
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_dtype(w.dtype, [&]<DType T>() {
    if constexpr (q8_block_bytes<T>() > 0)
      err = mma ? launch_mma_typed<T>(w, xq, xd, n_tok, y, s)
                : launch_q8_typed<T>(w, xq, xd, n_tok, y, s);
  });
  return err;
}

cudaError_t launch_matvec_q8_mma(const DeviceWeight& w, const void* act, int64_t n_tok, float* y,
                                 int nb, cudaStream_t s) {
  if (!mma_applies(w, n_tok, 1, true) || act_q8_bytes(w.n_cols, n_tok) == 0 ||
      reinterpret_cast<uintptr_t>(act) % 16 != 0 || !(nb == 1 || nb == 2 || nb == 4))
    return cudaErrorInvalidValue;
  if (w.n_rows == 0) return cudaSuccess;
  const auto* xq = static_cast<const int8_t*>(act);
  const auto* xd = reinterpret_cast<const float2*>(xq + align16(size_t(n_tok) * size_t(w.n_cols)));
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_dtype(w.dtype, [&]<DType T>() {
    if constexpr (mma_type<T>()) {
      err = nb == 1   ? launch_mma_nb<T, 1>(w, xq, xd, n_tok, y, s)
            : nb == 2 ? launch_mma_nb<T, 2>(w, xq, xd, n_tok, y, s)
                      : launch_mma_nb<T, 4>(w, xq, xd, n_tok, y, s);
    }
  });
  return err;
}

cudaError_t launch_matvec_q8_group(std::span<const DeviceWeight> ws, std::span<float* const> ys,
                                   const void* act, int64_t n_tok, cudaStream_t s,
                                   int mma_min_tokens) {
  if (!same_layout(ws) || ws.size() != ys.size() || !matvec_q8_supports(ws[0].dtype) ||
      act_q8_bytes(ws[0].n_cols, n_tok) == 0 || reinterpret_cast<uintptr_t>(act) % 16 != 0)
    return cudaErrorNotSupported;
  const auto* xq = static_cast<const int8_t*>(act);
  const auto* xd =
      reinterpret_cast<const float2*>(xq + align16(size_t(n_tok) * size_t(ws[0].n_cols)));
  cudaError_t err = cudaErrorNotSupported;
  // same_layout: the tensor-core choice of the first weight is every weight's.
  if (mma_applies(ws[0], n_tok, mma_min_tokens)) {
    dispatch_dtype(ws[0].dtype, [&]<DType T>() {
      if constexpr (mma_type<T>()) {
        err = with_mma_shape(n_tok, [&]<int NB>() {
          GroupArgs g;
          if (!make_group(ws, ys, kMmaRows, &g)) return cudaErrorNotSupported;
          const dim3 grid(unsigned((n_tok + 8 * NB - 1) / (8 * NB)), unsigned(g.rb_end[g.n - 1]));
          if constexpr (kMsForm<T, NB>) {
            if (ms_applies<T, NB>(ws[0]))
              return launch_ms<T, NB, true>(grid, s, g, ws[0].row_bytes, ws[0].n_cols, xq, xd,
                                            n_tok);
          }
          return launch(matvec_q8_mma_group_kernel<T, NB>, grid, kQ8Warps * kWarp, 0, s, g,
                        ws[0].row_bytes, ws[0].n_cols, xq, xd, n_tok);
        });
      }
    });
    return err;
  }
  dispatch_dtype(ws[0].dtype, [&]<DType T>() {
    if constexpr (q8_block_bytes<T>() > 0) {
      err = with_q8_shape<T>(ws[0], n_tok, [&]<int NT, int R, int MODE>() {
        GroupArgs g;
        if (!make_group(ws, ys, int64_t(kQ8Warps) * R, &g)) return cudaErrorNotSupported;
        const dim3 grid(unsigned((n_tok + NT - 1) / NT), unsigned(g.rb_end[g.n - 1]));
        return launch(matvec_q8_group_kernel<T, NT, R, MODE>, grid, kQ8Warps * kWarp, 0, s, g,
                      ws[0].row_bytes, ws[0].n_cols, xq, xd, n_tok);
      });
    }
  });
  return err;
}

cudaError_t launch_matvec_float_v3_group(std::span<const DeviceWeight> ws,
                                         std::span<float* const> ys, const float* x, int64_t n_tok,
                                         int rows, cudaStream_t s) {
  if (!same_layout(ws) || ws.size() != ys.size() || !float_v3_fits(ws[0], x, n_tok) ||
      !(rows == 1 || rows == 2 || rows == 4))
    return cudaErrorNotSupported;
  cudaError_t err = cudaErrorNotSupported;
  dispatch_dtype(ws[0].dtype, [&]<DType T>() {
    if constexpr (is_float(T)) {
      err = with_float_shape(n_tok, rows, [&]<int NT, int R>() {
        GroupArgs g;
        if (!make_group(ws, ys, int64_t(kFloatWarps) * R, &g)) return cudaErrorNotSupported;
        const dim3 grid(unsigned((n_tok + NT - 1) / NT), unsigned(g.rb_end[g.n - 1]));
        return launch(matvec_float_v3_group_kernel<T, NT, R>, grid, kFloatWarps * kWarp, 0, s, g,
                      ws[0].row_bytes, ws[0].n_cols, x, n_tok);
      });
    }
  });
  return err;
}

cudaError_t launch_matmul_v3(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                             void* act_scratch, size_t scratch_bytes, cudaStream_t s,
                             GemmWorkspace* gemm, int mma_min_tokens) {
  if (!cuda_supports(w.dtype)) return cudaErrorInvalidValue;
  if (w.n_rows == 0 || n_tok == 0) return cudaSuccess;
  const size_t need = act_q8_bytes(w.n_cols, n_tok);
  if (matvec_q8_supports(w.dtype) && need > 0 && act_scratch != nullptr && scratch_bytes >= need &&
      reinterpret_cast<uintptr_t>(act_scratch) % 16 == 0) {
    if (cudaError_t e = launch_quantize_act_q8(x, w.n_cols, n_tok, act_scratch, s);
        e != cudaSuccess)
      return e;
    return launch_matvec_q8(w, act_scratch, n_tok, y, s, mma_min_tokens);
  }
  if (float_mma_fits(w, x, n_tok)) return launch_matvec_float_mma(w, x, n_tok, y, s);
  if (float_v3_fits(w, x, n_tok))
    return launch_matvec_float_v3(w, x, n_tok, y, float_v3_rows(w.dtype, n_tok, w.n_rows, w.n_cols),
                                  s);
  return launch_matmul(w, x, n_tok, y, s, gemm);
}

cudaError_t launch_matvec_float_v3(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                                   int rows, cudaStream_t s) {
  if (!float_v3_fits(w, x, n_tok) || !(rows == 1 || rows == 2 || rows == 4))
    return cudaErrorInvalidValue;
  if (w.n_rows == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_dtype(w.dtype, [&]<DType T>() {
    if constexpr (is_float(T)) err = launch_float_v3<T>(w, x, n_tok, y, rows, s);
  });
  return err;
}

// From `cuda_matvec_bench --float-rows-ab` on the H200 (docs/BENCHMARKS.md, session 5): more
// rows per warp pay on matrices of many short rows (rows >= 2 x columns: FFN gate/up, the
// output) at every token count, and for f16 on any large matrix at 2-4 tokens; long rows
// (FFN down, 14336 wide) and the small K/V projections are fastest at one row per warp.
bool float_v3_applies(const DeviceWeight& w, const float* x, int64_t n_tok) {
  return cuda_supports(w.dtype) && float_v3_fits(w, x, n_tok);
}

int float_v3_rows(DType t, int64_t n_tok, int64_t n_rows, int64_t n_cols) {
  const bool wide = n_rows >= 2 * n_cols;
  if (t == DType::F32) return wide && n_tok > 1 ? 2 : 1;
  if (wide) return 4;
  return t == DType::F16 && n_tok >= 2 && n_tok <= 4 && n_rows >= 4096 ? 4 : 1;
}

}  // namespace kiln::cuda
