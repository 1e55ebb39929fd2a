// quant/blocks.h: llama.cpp's quantized block layouts, bit-exact (ggml-common.h's structs).
// Each struct is the on-disk byte layout of one block inside a GGUF tensor row; the sizes are
// pinned below and checked against core/dtype.cpp's table by tests/quant. Readers may cast a
// row's bytes to these types (all members are byte-aligned except Q8_K's float/int16 fields,
// whose offsets are naturally aligned within the block; GGUF rows start 32-byte aligned).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

#include "core/half.h"

namespace kiln::quant {

inline constexpr int kQK4_0 = 32;
inline constexpr int kQK4_1 = 32;
inline constexpr int kQK5_0 = 32;
inline constexpr int kQK5_1 = 32;
inline constexpr int kQK8_0 = 32;
inline constexpr int kQK8_1 = 32;
inline constexpr int kQK_K = 256;       // super-block of the K-quants
inline constexpr int kKScaleSize = 12;  // packed 6-bit scales/mins of Q4_K / Q5_K
inline constexpr int kQKMxfp4 = 32;

// x = d * (q - 8), q in [0, 15]; element j in the low nibble of qs[j], j+16 in the high one.
struct block_q4_0 {
  f16 d;
  uint8_t qs[kQK4_0 / 2];
};
// x = d * q + m, q in [0, 15]; same nibble order as q4_0.
struct block_q4_1 {
  f16 d;
  f16 m;
  uint8_t qs[kQK4_1 / 2];
};
// x = d * (q - 16), q in [0, 31]; low 4 bits as q4_0, bit 4 of element j is bit j of qh.
struct block_q5_0 {
  f16 d;
  uint8_t qh[4];
  uint8_t qs[kQK5_0 / 2];
};
// x = d * q + m, q in [0, 31]; bit layout as q5_0.
struct block_q5_1 {
  f16 d;
  f16 m;
  uint8_t qh[4];
  uint8_t qs[kQK5_1 / 2];
};
// x = d * q.
struct block_q8_0 {
  f16 d;
  int8_t qs[kQK8_0];
};
// Activation block for q4_1/q5_1 dots: s = d * sum(qs) (carries the sum for the min term).
struct block_q8_1 {
  f16 d;
  f16 s;
  int8_t qs[kQK8_1];
};

// 16 sub-blocks of 16: x = d * (scales[i] & 15) * q - dmin * (scales[i] >> 4), q in [0, 3].
struct block_q2_K {
  uint8_t scales[kQK_K / 16];
  uint8_t qs[kQK_K / 4];
  f16 d;
  f16 dmin;
};
// 16 sub-blocks of 16 with signed 6-bit scales packed in 12 bytes: x = d * (sc - 32) * (q -
// 4*!hbit), low 2 bits in qs, the high bit in hmask.
struct block_q3_K {
  uint8_t hmask[kQK_K / 8];
  uint8_t qs[kQK_K / 4];
  uint8_t scales[12];
  f16 d;
};
// 8 sub-blocks of 32 with 6-bit scales and mins packed in 12 bytes:
// x = d * sc * q - dmin * m, q in [0, 15].
struct block_q4_K {
  f16 d;
  f16 dmin;
  uint8_t scales[kKScaleSize];
  uint8_t qs[kQK_K / 2];
};
// As q4_K with a fifth bit per element in qh: q in [0, 31].
struct block_q5_K {
  f16 d;
  f16 dmin;
  uint8_t scales[kKScaleSize];
  uint8_t qh[kQK_K / 8];
  uint8_t qs[kQK_K / 2];
};
// 16 sub-blocks of 16 with signed 8-bit scales: x = d * scales[i] * (q - 32), q in [0, 63];
// low 4 bits in ql, high 2 bits in qh.
struct block_q6_K {
  uint8_t ql[kQK_K / 2];
  uint8_t qh[kQK_K / 4];
  int8_t scales[kQK_K / 16];
  f16 d;
};
// Activation block for K-quant dots: x = d * q; bsums[i] = sum of qs over group i of 16.
struct block_q8_K {
  float d;
  int8_t qs[kQK_K];
  int16_t bsums[kQK_K / 16];
};

// The i-quants' non-linear 4-bit grid (ggml's kvalues_iq4nl): code q decodes to d * value[q].
inline constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                            1,    13,   25,  38,  53,  69,  89,  113};
inline constexpr int kQK4_NL = 32;
// x = d * value[q]; element j in the low nibble of qs[j], j+16 in the high one (as q4_0).
struct block_iq4_nl {
  f16 d;
  uint8_t qs[kQK4_NL / 2];
};
// 8 sub-blocks of 32 with signed 6-bit scales: x = d * (ls - 32) * value[q], ls's low 4 bits
// in scales_l (sub-block 2i low nibble, 2i+1 high), its high 2 bits at bit 2*i of scales_h;
// each sub-block's 16 qs bytes as iq4_nl's.
struct block_iq4_xs {
  f16 d;
  uint16_t scales_h;
  uint8_t scales_l[kQK_K / 64];
  uint8_t qs[kQK_K / 2];
};
// MXFP4 (OCP microscaling FP4): x = 2^(e - 127) * fp4(q), with fp4 an E2M1 code. ggml stores
// the E2M1 values doubled as integers (kMxfp4Values) and halves the scale instead
// (mxfp4_scale_half), so codes and activations meet in integer dot products. Element j in the
// low nibble of qs[j], j+16 in the high one, as q4_0.
struct block_mxfp4 {
  uint8_t e;  // E8M0 shared exponent
  uint8_t qs[kQKMxfp4 / 2];
};
// ggml's kvalues_mxfp4: twice the E2M1 value of each 4-bit code (sign in bit 3).
inline constexpr int8_t kMxfp4Values[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                            0, -1, -2, -3, -4, -6, -8, -12};
// ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128), exactly, as the bits of an f32 (e < 2 gives the
// subnormals 2^-128 and 2^-127).
inline float mxfp4_scale_half(uint8_t e) {
  const uint32_t bits = e < 2 ? uint32_t{0x00200000} << e : uint32_t(e - 1) << 23;
  return std::bit_cast<float>(bits);
}

// The byte sizes of ggml's type_traits (core/dtype.cpp holds the same numbers; a test checks
// that the two agree).
static_assert(sizeof(block_q4_0) == 18);
static_assert(sizeof(block_q4_1) == 20);
static_assert(sizeof(block_q5_0) == 22);
static_assert(sizeof(block_q5_1) == 24);
static_assert(sizeof(block_q8_0) == 34);
static_assert(sizeof(block_q8_1) == 36);
static_assert(sizeof(block_q2_K) == 84);
static_assert(sizeof(block_q3_K) == 110);
static_assert(sizeof(block_q4_K) == 144);
static_assert(sizeof(block_q5_K) == 176);
static_assert(sizeof(block_q6_K) == 210);
static_assert(sizeof(block_q8_K) == 292);
static_assert(sizeof(block_iq4_nl) == 18);
static_assert(sizeof(block_iq4_xs) == 136);
static_assert(sizeof(block_mxfp4) == 17);
static_assert(offsetof(block_q2_K, d) == 80);
static_assert(offsetof(block_q3_K, d) == 108);
static_assert(offsetof(block_q6_K, d) == 208);
static_assert(offsetof(block_q8_K, bsums) == 260);

}  // namespace kiln::quant
