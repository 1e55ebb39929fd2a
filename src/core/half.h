// core/half.h: IEEE binary16 and bfloat16 storage types with exact scalar conversions.
// These are the reference conversions (round-to-nearest-even, as F16C and ggml do);
// SIMD backends convert with hardware instructions and are tested against these.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

namespace kiln {

struct f16 {
  uint16_t bits = 0;
};
struct bf16 {
  uint16_t bits = 0;
};
static_assert(sizeof(f16) == 2 && sizeof(bf16) == 2);

inline float f16_to_f32(f16 h) {
  // Exact: every binary16 value is representable in binary32.
  const uint32_t w = uint32_t(h.bits) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float exp_scale = std::bit_cast<float>(0x7800000u);
  const float normalized = std::bit_cast<float>((two_w >> 4) + exp_offset) * exp_scale;
  const uint32_t magic_mask = 126u << 23;
  const float magic_bias = 0.5f;
  const float denormalized = std::bit_cast<float>((two_w >> 17) | magic_mask) - magic_bias;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? std::bit_cast<uint32_t>(denormalized)
                                          : std::bit_cast<uint32_t>(normalized));
  return std::bit_cast<float>(result);
}

inline f16 f32_to_f16(float f) {
  // Round to nearest even; overflow to inf; NaN stays NaN.
  const float scale_to_inf = std::bit_cast<float>(0x77800000u);
  const float scale_to_zero = std::bit_cast<float>(0x08800000u);
  float base = (__builtin_fabsf(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = std::bit_cast<uint32_t>(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = std::bit_cast<float>((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = std::bit_cast<uint32_t>(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return f16{uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign))};
}

inline float bf16_to_f32(bf16 h) { return std::bit_cast<float>(uint32_t(h.bits) << 16); }

inline bf16 f32_to_bf16(float f) {
  // Round to nearest even, NaN quieted (ggml's convention).
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 64)};
  return bf16{uint16_t((u + (0x7fffu + ((u >> 16) & 1))) >> 16)};
}

}  // namespace kiln
