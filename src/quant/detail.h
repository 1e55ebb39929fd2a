// quant/detail.h: internal to src/quant: per-format row functions behind quant.h's dispatch,
// and the small numeric helpers llama.cpp's reference quantizers are built from.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "core/check.h"
#include "core/half.h"

namespace kiln::quant::detail {

using Bytes = std::span<const std::byte>;
using MutBytes = std::span<std::byte>;

// Blocks are copied out of / into the row rather than cast in place: GGUF only aligns rows,
// and an 18-byte block stride leaves wider fields (Q8_K's float) unaligned.
template <typename Block>
inline Block load_block(Bytes src, int64_t i) {
  Block b;
  std::memcpy(&b, src.data() + static_cast<size_t>(i) * sizeof(Block), sizeof(Block));
  return b;
}
template <typename Block>
inline void store_block(MutBytes dst, int64_t i, const Block& b) {
  std::memcpy(dst.data() + static_cast<size_t>(i) * sizeof(Block), &b, sizeof(Block));
}

inline float h2f(f16 h) { return f16_to_f32(h); }
inline f16 f2h(float f) { return f32_to_f16(f); }

// llama.cpp's nearest_int: round half to even through the float mantissa trick; exact for
// |x| <= 2^22, which every caller guarantees by clamping or by construction.
inline int nearest_int(float fval) {
  float val = fval + 12582912.f;
  int i;
  std::memcpy(&i, &val, sizeof(int));
  return (i & 0x007fffff) - 0x00400000;
}

// True when every element is finite. Quantizers write a NaN scale for a block that holds a
// non-finite value, so such input can never decode to plausible numbers.
inline bool all_finite(const float* x, int n) {
  for (int i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}
inline f16 nan_f16() { return f16{0x7e00}; }

// Legacy 32-element formats (legacy.cpp).
void dequantize_q4_0(Bytes src, std::span<float> dst);
void dequantize_q4_1(Bytes src, std::span<float> dst);
void dequantize_q5_0(Bytes src, std::span<float> dst);
void dequantize_q5_1(Bytes src, std::span<float> dst);
void dequantize_q8_0(Bytes src, std::span<float> dst);
void dequantize_q8_1(Bytes src, std::span<float> dst);
void quantize_q4_0(std::span<const float> src, MutBytes dst);
void quantize_q4_1(std::span<const float> src, MutBytes dst);
void quantize_q5_0(std::span<const float> src, MutBytes dst);
void quantize_q5_1(std::span<const float> src, MutBytes dst);
void quantize_q8_0(std::span<const float> src, MutBytes dst);
void quantize_q8_1(std::span<const float> src, MutBytes dst);
float dot_q4_0_q8_0(int64_t n, Bytes w, Bytes a);
float dot_q4_1_q8_1(int64_t n, Bytes w, Bytes a);
float dot_q5_0_q8_0(int64_t n, Bytes w, Bytes a);
float dot_q5_1_q8_1(int64_t n, Bytes w, Bytes a);
float dot_q8_0_q8_0(int64_t n, Bytes w, Bytes a);

// K-quants, 256-element super-blocks (kquants.cpp: decode and dot; kquants_quantize.cpp).
void dequantize_q2_K(Bytes src, std::span<float> dst);
void dequantize_q3_K(Bytes src, std::span<float> dst);
void dequantize_q4_K(Bytes src, std::span<float> dst);
void dequantize_q5_K(Bytes src, std::span<float> dst);
void dequantize_q6_K(Bytes src, std::span<float> dst);
void dequantize_q8_K(Bytes src, std::span<float> dst);
void quantize_q2_K(std::span<const float> src, MutBytes dst);
void quantize_q3_K(std::span<const float> src, MutBytes dst);
void quantize_q4_K(std::span<const float> src, MutBytes dst);
void quantize_q5_K(std::span<const float> src, MutBytes dst);
void quantize_q6_K(std::span<const float> src, MutBytes dst);
void quantize_q8_K(std::span<const float> src, MutBytes dst);
float dot_q2_K_q8_K(int64_t n, Bytes w, Bytes a);
float dot_q3_K_q8_K(int64_t n, Bytes w, Bytes a);
float dot_q4_K_q8_K(int64_t n, Bytes w, Bytes a);
float dot_q5_K_q8_K(int64_t n, Bytes w, Bytes a);
float dot_q6_K_q8_K(int64_t n, Bytes w, Bytes a);

}  // namespace kiln::quant::detail
