// backend/cuda/dequant.cuh: decoding of one 32-element unit of a weight row, for every weight
// type, written once for the GPU kernels and the host. The host build (plain C++) is what the
// GPU-less CI tests against quant::dequantize_row, so the bit logic the kernels run is checked
// on every machine, not only where a GPU exists.
//
// A "unit" is 32 consecutive elements: one block of the 32-element formats, one eighth of a
// K-quant super-block, or 32 elements of a float row (the float formats may end in a partial
// unit; callers pass n_cols and the tail reads as zero).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "quant/blocks.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define KILN_HD __host__ __device__ __forceinline__
#if defined(__CUDA_ARCH__)
#define KILN_UNROLL _Pragma("unroll")
#else
#define KILN_UNROLL
#endif
#else
#include "core/half.h"
#define KILN_HD inline
#define KILN_UNROLL
#endif

namespace kiln::cuda {

inline constexpr int kUnit = 32;

KILN_HD float h2f(f16 h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h.bits));
#else
  return f16_to_f32(h);
#endif
}
KILN_HD float h2f_bits(uint16_t bits) { return h2f(f16{bits}); }
KILN_HD float bf2f_bits(uint16_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(uint32_t(bits) << 16);
#else
  return bf16_to_f32(bf16{bits});
#endif
}

// Loads that assume no more alignment than the block layouts guarantee: every block size is
// even and GGUF rows start 32-byte aligned, so 16-bit fields are 2-byte aligned; Q5's 32-bit
// qh is not 4-byte aligned and is read as two halves.
KILN_HD uint16_t load_u16(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint16_t*>(p);
#else
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
#endif
}
KILN_HD uint32_t load_u32(const uint8_t* p) {
  return uint32_t(load_u16(p)) | (uint32_t(load_u16(p + 2)) << 16);
}
KILN_HD float load_f32(const uint8_t* p) {  // f32 rows are 4-byte aligned
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const float*>(p);
#else
  float v;
  std::memcpy(&v, p, 4);
  return v;
#endif
}
KILN_HD float load_f16(const uint8_t* p) { return h2f_bits(load_u16(p)); }

// int -> float for the small integers of quantized blocks (|v| < 2^22), exactly. On the GPU
// through the float bit pattern of 2^22 + 2^23 (two full-rate ops; I2F runs at a sixteenth of
// the FMA rate on sm_90 and would bound the matvec below the memory bandwidth).
KILN_HD float i2f(int v) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(0x4B400000 + v) - 12582912.0f;  // 12582912 = 2^23 + 2^22
#else
  return float(v);
#endif
}

// Products and sums that the GPU compiler must not fuse into FMAs: the reference dequantizes
// with separately rounded operations, and matching it bit for bit keeps every path's weights
// identical (get_rows is compared exactly).
KILN_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KILN_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KILN_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

// Static alignment of a field at byte offset `off` of blocks of `bs` bytes in rows aligned to
// A (16: base and row size multiples of 16; 2: only what the layouts guarantee).
constexpr int field_align(int A, int bs, int off) {
  int a = A;
  while (a > 2 && (bs % a != 0 || off % a != 0)) a /= 2;
  return a;
}

// N bytes at p (aligned to ALIGN) as N/4 little-endian words, with the widest loads the
// alignment allows (16-byte loads for the 16-aligned fields of aligned rows).
template <int N, int ALIGN>
KILN_HD void load_words(const uint8_t* p, uint32_t* w) {
  static_assert(N % 4 == 0 && ALIGN >= 2);
#if defined(__CUDA_ARCH__)
  if constexpr (ALIGN >= 16 && N % 16 == 0) {
    KILN_UNROLL
    for (int i = 0; i < N / 16; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (ALIGN >= 8 && N % 8 == 0) {
    KILN_UNROLL
    for (int i = 0; i < N / 8; ++i) {
      const uint2 v = reinterpret_cast<const uint2*>(p)[i];
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  } else if constexpr (ALIGN >= 4) {
    KILN_UNROLL
    for (int i = 0; i < N / 4; ++i) w[i] = reinterpret_cast<const uint32_t*>(p)[i];
  } else {
    KILN_UNROLL
    for (int i = 0; i < N / 4; ++i) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(p) + 2 * i;
      w[i] = uint32_t(h[0]) | (uint32_t(h[1]) << 16);
    }
  }
#else
  std::memcpy(w, p, N);  // little-endian host, as the device
#endif
}

// MXFP4's half scale 2^(e - 128) (quant::mxfp4_scale_half, exactly) and the doubled E2M1
// value of a 4-bit code (quant::kMxfp4Values: magnitudes 0 1 2 3 4 6 8 12 as nibbles of one
// word, bit 3 the sign), without a table in memory.
KILN_HD float mxfp4_scale_half_hd(uint32_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (e - 1) << 23;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}
KILN_HD int mxfp4_value(uint32_t code) {
  const int mag = int((0xC8643210u >> (4 * (code & 7))) & 0xF);
  return code & 8 ? -mag : mag;
}

// Byte i of words w; i must be a compile-time constant after unrolling (register arrays).
KILN_HD uint32_t byte_of(const uint32_t* w, int i) { return (w[i >> 2] >> (8 * (i & 3))) & 0xFFu; }
// Byte i (a run-time index < 12) of three words, without indexing a register array.
KILN_HD uint32_t byte_of3(uint32_t w0, uint32_t w1, uint32_t w2, int i) {
  const uint32_t w = i < 4 ? w0 : (i < 8 ? w1 : w2);
  return (w >> (8 * (i & 3))) & 0xFFu;
}

// ggml's IQ4_NL grid value of code q (0..15), from two words instead of a table (a host
// array is not addressable in device code); the host test checks them against kIQ4NLValues.
KILN_HD int iq4_value(uint32_t q) {
  constexpr uint64_t kLo = 0xF6EADDCFBFAD9881ull, kHi = 0x7159453526190D01ull;
  return int(int8_t(uint8_t(((q < 8 ? kLo : kHi) >> (8 * (q & 7))) & 0xFF)));
}

// Decodes unit `u` of `row` (a row of type T with n_cols elements) into out[0..31].
// A = 16: the row start and row size are multiples of 16 bytes (and float rows hold whole
// units), so 16-byte fields load as 16-byte vectors; A = 2: any row GGUF can hold.
template <DType T, int A = 2>
KILN_HD void dequant_unit(const uint8_t* row, int64_t u, int64_t n_cols, float* out) {
  using namespace kiln::quant;
  static_assert(A == 2 || A == 16);
  if constexpr ((T == DType::F32 || T == DType::F16 || T == DType::BF16) && A == 16) {
    constexpr int kBytes = T == DType::F32 ? 128 : 64;
    uint32_t w[kBytes / 4];
    load_words<kBytes, 16>(row + u * kBytes, w);
    KILN_UNROLL
    for (int l = 0; l < kUnit; ++l) {
      if constexpr (T == DType::F32) {
#if defined(__CUDA_ARCH__)
        out[l] = __uint_as_float(w[l]);
#else
        std::memcpy(&out[l], &w[l], 4);
#endif
      } else {
        const uint16_t h = uint16_t(w[l >> 1] >> (16 * (l & 1)));
        out[l] = T == DType::F16 ? h2f_bits(h) : bf2f_bits(h);
      }
    }
  } else if constexpr (T == DType::F32 || T == DType::F16 || T == DType::BF16) {
    const int64_t base = u * kUnit;
    KILN_UNROLL
    for (int l = 0; l < kUnit; ++l) {
      const int64_t i = base + l;
      float v = 0.0f;
      if (i < n_cols) {
        if constexpr (T == DType::F32) {
          v = load_f32(row + i * 4);
        } else if constexpr (T == DType::F16) {
          v = load_f16(row + i * 2);
        } else {
          v = bf2f_bits(load_u16(row + i * 2));
        }
      }
      out[l] = v;
    }
  } else if constexpr (T == DType::Q8_0) {
    const uint8_t* b = row + u * sizeof(block_q8_0);
    const float d = load_f16(b);
    uint32_t q[8];
    load_words<32, field_align(A, sizeof(block_q8_0), 2)>(b + 2, q);
    KILN_UNROLL
    for (int l = 0; l < 32; ++l) out[l] = mul_rn(d, i2f(int8_t(byte_of(q, l))));
  } else if constexpr (T == DType::Q4_0 || T == DType::Q4_1) {
    constexpr bool kMin = T == DType::Q4_1;
    constexpr int kBs = kMin ? sizeof(block_q4_1) : sizeof(block_q4_0), kQs = kMin ? 4 : 2;
    const uint8_t* b = row + u * kBs;
    const float d = load_f16(b);
    const float m = kMin ? load_f16(b + 2) : 0.0f;
    uint32_t q[4];
    load_words<16, field_align(A, kBs, kQs)>(b + kQs, q);
    KILN_UNROLL
    for (int l = 0; l < 16; ++l) {
      const int lo = int(byte_of(q, l) & 0xF), hi = int(byte_of(q, l) >> 4);
      out[l] = kMin ? add_rn(mul_rn(d, i2f(lo)), m) : mul_rn(d, i2f(lo - 8));
      out[l + 16] = kMin ? add_rn(mul_rn(d, i2f(hi)), m) : mul_rn(d, i2f(hi - 8));
    }
  } else if constexpr (T == DType::Q5_0 || T == DType::Q5_1) {
    constexpr bool kMin = T == DType::Q5_1;
    constexpr int kBs = kMin ? sizeof(block_q5_1) : sizeof(block_q5_0);
    constexpr int kQh = kMin ? 4 : 2, kQs = kMin ? 8 : 6;
    const uint8_t* b = row + u * kBs;
    const float d = load_f16(b);
    const float m = kMin ? load_f16(b + 2) : 0.0f;
    uint32_t qh;
    load_words<4, field_align(A, kBs, kQh)>(b + kQh, &qh);
    uint32_t q[4];
    load_words<16, field_align(A, kBs, kQs)>(b + kQs, q);
    KILN_UNROLL
    for (int l = 0; l < 16; ++l) {
      const int lo = int(byte_of(q, l) & 0xF) | int(((qh >> l) << 4) & 0x10);
      const int hi = int(byte_of(q, l) >> 4) | int((qh >> (l + 12)) & 0x10);
      out[l] = kMin ? add_rn(mul_rn(d, i2f(lo)), m) : mul_rn(d, i2f(lo - 16));
      out[l + 16] = kMin ? add_rn(mul_rn(d, i2f(hi)), m) : mul_rn(d, i2f(hi - 16));
    }
  } else if constexpr (T == DType::MXFP4) {
    // 17-byte blocks: no field has more than byte alignment, so bytes are read one by one.
    const uint8_t* b = row + u * sizeof(block_mxfp4);
    const float d = mxfp4_scale_half_hd(b[0]);
    KILN_UNROLL
    for (int l = 0; l < 16; ++l) {
      const uint32_t q = b[1 + l];
      out[l] = mul_rn(d, i2f(mxfp4_value(q & 0xF)));
      out[l + 16] = mul_rn(d, i2f(mxfp4_value(q >> 4)));
    }
  } else if constexpr (T == DType::Q2_K) {
    constexpr int kBs = sizeof(block_q2_K);
    const uint8_t* b = row + (u / 8) * kBs;
    const int s = int(u % 8), h = s / 4, j = s % 4;
    const float d = load_f16(b + offsetof(block_q2_K, d));
    const float dmin = load_f16(b + offsetof(block_q2_K, dmin));
    const uint32_t sc = load_u16(b + offsetof(block_q2_K, scales) + 8 * h + 2 * j);
    uint32_t q[8];
    load_words<32, field_align(A, kBs, offsetof(block_q2_K, qs))>(
        b + offsetof(block_q2_K, qs) + 32 * h, q);
    KILN_UNROLL
    for (int half = 0; half < 2; ++half) {
      const uint32_t sb = (sc >> (8 * half)) & 0xFF;
      const float dl = mul_rn(d, i2f(int(sb & 0xF))), ml = mul_rn(dmin, i2f(int(sb >> 4)));
      KILN_UNROLL
      for (int l = 0; l < 16; ++l) {
        const int i = 16 * half + l;
        out[i] = sub_rn(mul_rn(dl, i2f(int((byte_of(q, i) >> (2 * j)) & 3))), ml);
      }
    }
  } else if constexpr (T == DType::Q3_K) {
    constexpr int kBs = sizeof(block_q3_K);
    const uint8_t* b = row + (u / 8) * kBs;
    const int s = int(u % 8), h = s / 4, j = s % 4;
    const float d = load_f16(b + offsetof(block_q3_K, d));
    uint32_t q[8], hm[8], sw[3];
    load_words<32, field_align(A, kBs, offsetof(block_q3_K, qs))>(
        b + offsetof(block_q3_K, qs) + 32 * h, q);
    load_words<32, field_align(A, kBs, offsetof(block_q3_K, hmask))>(
        b + offsetof(block_q3_K, hmask), hm);
    load_words<12, field_align(A, kBs, offsetof(block_q3_K, scales))>(
        b + offsetof(block_q3_K, scales), sw);
    const uint32_t mask = 1u << (4 * h + j);
    KILN_UNROLL
    for (int half = 0; half < 2; ++half) {
      // Q3_K's signed 6-bit scale i of 16: low nibble from bytes 0..7, top 2 bits from 8..11.
      const int i = 8 * h + 2 * j + half;
      const int lo = i < 8 ? int(byte_of3(sw[0], sw[1], sw[2], i) & 0xF)
                           : int(byte_of3(sw[0], sw[1], sw[2], i - 8) >> 4);
      const int hi = int(byte_of3(sw[0], sw[1], sw[2], 8 + (i & 3)) >> (2 * (i >> 2))) & 3;
      const float dl = mul_rn(d, i2f((lo | (hi << 4)) - 32));
      KILN_UNROLL
      for (int l = 0; l < 16; ++l) {
        const int e = 16 * half + l;
        const int v = int((byte_of(q, e) >> (2 * j)) & 3) - ((byte_of(hm, e) & mask) ? 0 : 4);
        out[e] = mul_rn(dl, i2f(v));
      }
    }
  } else if constexpr (T == DType::Q4_K || T == DType::Q5_K) {
    constexpr bool k5 = T == DType::Q5_K;
    constexpr int kBs = k5 ? sizeof(block_q5_K) : sizeof(block_q4_K);
    constexpr int kQs = k5 ? offsetof(block_q5_K, qs) : offsetof(block_q4_K, qs);
    const uint8_t* b = row + (u / 8) * kBs;
    const int j = int(u % 8);
    const float d = load_f16(b), dmin = load_f16(b + 2);
    uint32_t sw[3];
    load_words<12, field_align(A, kBs, 4)>(b + 4, sw);
    // llama.cpp's 6-bit scale/min unpacking (sub-block j of 8).
    int sc, m;
    if (j < 4) {
      sc = int(byte_of3(sw[0], sw[1], sw[2], j) & 63);
      m = int(byte_of3(sw[0], sw[1], sw[2], j + 4) & 63);
    } else {
      sc = int(byte_of3(sw[0], sw[1], sw[2], j + 4) & 0xF) |
           int((byte_of3(sw[0], sw[1], sw[2], j - 4) >> 6) << 4);
      m = int(byte_of3(sw[0], sw[1], sw[2], j + 4) >> 4) |
          int((byte_of3(sw[0], sw[1], sw[2], j) >> 6) << 4);
    }
    const float d1 = mul_rn(d, i2f(sc)), m1 = mul_rn(dmin, i2f(m));
    uint32_t q[8];
    load_words<32, field_align(A, kBs, kQs)>(b + kQs + 32 * (j / 2), q);
    [[maybe_unused]] uint32_t qh[8];
    if constexpr (k5) {
      load_words<32, field_align(A, kBs, offsetof(block_q5_K, qh))>(b + offsetof(block_q5_K, qh),
                                                                    qh);
    }
    const int shift = 4 * (j & 1);
    KILN_UNROLL
    for (int l = 0; l < 32; ++l) {
      int v = int((byte_of(q, l) >> shift) & 0xF);
      if constexpr (k5) v |= int((byte_of(qh, l) >> j) & 1) << 4;
      out[l] = sub_rn(mul_rn(d1, i2f(v)), m1);
    }
  } else if constexpr (T == DType::IQ4_NL || T == DType::IQ4_XS) {
    // One IQ4_NL block, or sub-block u % 8 of an IQ4_XS super-block with its signed 6-bit
    // scale (low nibble in scales_l, high 2 bits in scales_h): x = d [* (ls - 32)] * grid[q].
    constexpr bool kXs = T == DType::IQ4_XS;
    constexpr int kBs = kXs ? sizeof(block_iq4_xs) : sizeof(block_iq4_nl);
    constexpr int kQs = kXs ? offsetof(block_iq4_xs, qs) : offsetof(block_iq4_nl, qs);
    const uint8_t* b = row + (kXs ? u / 8 : u) * kBs;
    const int ib = kXs ? int(u % 8) : 0;
    float dl = load_f16(b);
    if constexpr (kXs) {
      const uint32_t sh = load_u16(b + offsetof(block_iq4_xs, scales_h));
      const uint32_t sl = load_u16(b + offsetof(block_iq4_xs, scales_l) + 2 * (ib / 4));
      const int ls = int((sl >> (4 * (ib % 4))) & 0xF) | int(((sh >> (2 * ib)) & 3) << 4);
      dl = mul_rn(dl, i2f(ls - 32));
    }
    uint32_t q[4];
    load_words<16, field_align(A, kBs, kQs + 16 * (kXs ? 1 : 0))>(b + kQs + 16 * ib, q);
    KILN_UNROLL
    for (int l = 0; l < 16; ++l) {
      out[l] = mul_rn(dl, i2f(iq4_value(byte_of(q, l) & 0xF)));
      out[l + 16] = mul_rn(dl, i2f(iq4_value(byte_of(q, l) >> 4)));
    }
  } else if constexpr (T == DType::Q6_K) {
    constexpr int kBs = sizeof(block_q6_K);
    const uint8_t* b = row + (u / 8) * kBs;
    const int s = int(u % 8), h = s / 4, qq = s % 4;
    const float d = load_f16(b + offsetof(block_q6_K, d));
    uint32_t ql[8], qh[8];
    load_words<32, field_align(A, kBs, offsetof(block_q6_K, ql))>(
        b + offsetof(block_q6_K, ql) + 64 * h + 32 * (qq & 1), ql);
    load_words<32, field_align(A, kBs, offsetof(block_q6_K, qh))>(
        b + offsetof(block_q6_K, qh) + 32 * h, qh);
    const uint32_t sc2 = load_u16(b + offsetof(block_q6_K, scales) + 8 * h + 2 * qq);
    const float ds[2] = {mul_rn(d, i2f(int8_t(sc2 & 0xFF))), mul_rn(d, i2f(int8_t(sc2 >> 8)))};
    const int lshift = qq >= 2 ? 4 : 0;
    KILN_UNROLL
    for (int l = 0; l < 32; ++l) {
      const int v =
          int(((byte_of(ql, l) >> lshift) & 0xF) | (((byte_of(qh, l) >> (2 * qq)) & 3) << 4)) - 32;
      out[l] = mul_rn(ds[l / 16], i2f(v));
    }
  }
}

// Units per row of n_cols elements (float rows may end in a partial unit).
KILN_HD int64_t units_per_row(int64_t n_cols) { return (n_cols + kUnit - 1) / kUnit; }

// True for every weight type the CUDA kernels read.
inline bool cuda_supports(DType t) {
  switch (t) {
    case DType::F32:
    case DType::F16:
    case DType::BF16:
    case DType::Q8_0:
    case DType::Q4_0:
    case DType::Q4_1:
    case DType::Q5_0:
    case DType::Q5_1:
    case DType::Q2_K:
    case DType::Q3_K:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
    case DType::IQ4_NL:
    case DType::IQ4_XS:
    case DType::MXFP4:
      return true;
    default:
      return false;
  }
}

// Calls f.template operator()<T>() for the runtime type t (t must be cuda_supports()).
template <typename F>
inline void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32:
      f.template operator()<DType::F32>();
      break;
    case DType::F16:
      f.template operator()<DType::F16>();
      break;
    case DType::BF16:
      f.template operator()<DType::BF16>();
      break;
    case DType::Q8_0:
      f.template operator()<DType::Q8_0>();
      break;
    case DType::Q4_0:
      f.template operator()<DType::Q4_0>();
      break;
    case DType::Q4_1:
      f.template operator()<DType::Q4_1>();
      break;
    case DType::Q5_0:
      f.template operator()<DType::Q5_0>();
      break;
    case DType::Q5_1:
      f.template operator()<DType::Q5_1>();
      break;
    case DType::Q2_K:
      f.template operator()<DType::Q2_K>();
      break;
    case DType::Q3_K:
      f.template operator()<DType::Q3_K>();
      break;
    case DType::Q4_K:
      f.template operator()<DType::Q4_K>();
      break;
    case DType::Q5_K:
      f.template operator()<DType::Q5_K>();
      break;
    case DType::Q6_K:
      f.template operator()<DType::Q6_K>();
      break;
    case DType::IQ4_NL:
      f.template operator()<DType::IQ4_NL>();
      break;
    case DType::IQ4_XS:
      f.template operator()<DType::IQ4_XS>();
      break;
    case DType::MXFP4:
      f.template operator()<DType::MXFP4>();
      break;
    default:
      break;
  }
}

}  // namespace kiln::cuda
