// quant/detail.h: internal to src/quant: per-format row functions behind quant.h's dispatch,
// and the small numeric helpers llama.cpp's reference quantizers are built from.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#include "core/check.h"
#include "core/dtype.h"
#include "core/half.h"
#include "quant/blocks.h"

namespace kiln::quant::detail {

using Bytes = std::span<const std::byte>;
using MutBytes = std::span<std::byte>;

// One format's reference row functions; quant.cpp dispatches through a table of these.
struct RowCodec {
  DType type;
  DType dot_type;  // the activation encoding `dot` takes; F32: none (vec_dot decodes instead)
  void (*dequantize)(Bytes src, std::span<float> dst);
  void (*quantize)(std::span<const float> src, MutBytes dst);
  float (*dot)(int64_t n, Bytes w, Bytes a);  // null when dot_type is F32
};

std::span<const RowCodec> legacy_codecs();  // Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q8_1 (legacy.cpp)
std::span<const RowCodec> kquant_codecs();  // Q2_K .. Q6_K, Q8_K (kquants.cpp)
std::span<const RowCodec> iquant_codecs();  // IQ4_NL IQ4_XS (iquants.cpp)
std::span<const RowCodec> mxfp4_codecs();   // MXFP4 (mxfp4.cpp)

// K-quant encoders (kquants_quantize.cpp), listed in kquants.cpp's table.
void quantize_q2_K(std::span<const float> src, MutBytes dst);
void quantize_q3_K(std::span<const float> src, MutBytes dst);
void quantize_q4_K(std::span<const float> src, MutBytes dst);
void quantize_q5_K(std::span<const float> src, MutBytes dst);
void quantize_q6_K(std::span<const float> src, MutBytes dst);
void quantize_q8_K(std::span<const float> src, MutBytes dst);

// Elements per block: 32 for the legacy formats and IQ4_NL, a 256-element super-block for the
// K-quants.
template <typename Block>
inline constexpr bool kIsLegacy =
    std::is_same_v<Block, block_q4_0> || std::is_same_v<Block, block_q4_1> ||
    std::is_same_v<Block, block_q5_0> || std::is_same_v<Block, block_q5_1> ||
    std::is_same_v<Block, block_q8_0> || std::is_same_v<Block, block_q8_1>;
static_assert(kQK4_0 == 32 && kQK4_1 == 32 && kQK5_0 == 32 && kQK5_1 == 32 && kQK8_0 == 32 &&
              kQK8_1 == 32);
template <typename Block>
inline constexpr int kBlockElems =
    kIsLegacy<Block> || std::is_same_v<Block, block_iq4_nl> ? 32 : kQK_K;

// Blocks in a row of n elements. quant.cpp checked the row against dtype.cpp's table before
// dispatching, so a partial block here is a broken invariant.
inline int64_t n_blocks(size_t n, int block_elems) {
  KILN_CHECK(n % block_elems == 0, "row of {} elements is not a multiple of {}", n, block_elems);
  return static_cast<int64_t>(n / block_elems);
}

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

// Every scale of the block NaN (d, and the min / sum scale where the format has one); the
// codes stay 0.
template <typename Block>
inline void mark_non_finite(Block& b) {
  if constexpr (std::is_same_v<decltype(b.d), float>)
    b.d = std::nanf("");
  else
    b.d = nan_f16();
  if constexpr (requires { b.m; }) b.m = nan_f16();
  if constexpr (requires { b.dmin; }) b.dmin = nan_f16();
  if constexpr (requires { b.s; }) b.s = nan_f16();
}

// The largest |x[i]| and the signed value that has it (the first on ties). The symmetric
// encoders give their scale that value's sign, so it lands exactly on the most negative code.
struct SignedAbsMax {
  float amax = 0;
  float max = 0;
};
inline SignedAbsMax signed_absmax(const float* x, int n) {
  SignedAbsMax r;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > r.amax) {
      r.amax = ax;
      r.max = x[i];
    }
  }
  return r;
}

// K-quant packed scales. The 6-bit scale and min of sub-block j (of 32) from Q4_K/Q5_K's 12
// bytes: sub-blocks 0..3 keep theirs in the low 6 bits of bytes 0..7; 4..7 split theirs over
// bytes 8..11 (low nibbles) and the top 2 bits of bytes 0..7.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& d, uint8_t& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q3_K's 16 6-bit scales (stored +32) from its 12 packed bytes: the low 4 bits of scales
// 0..7 in the low nibbles of bytes 0..7 and of 8..15 in their high nibbles; the high 2 bits
// of scale j at bit 2 * (j / 4) of byte 8 + j % 4.
inline std::array<int8_t, 16> q3_scales(const uint8_t packed[12]) {
  constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  uint32_t aux[4];
  std::memcpy(aux, packed, 12);
  const uint32_t tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  std::array<int8_t, 16> s;
  std::memcpy(s.data(), aux, 16);
  return s;
}

// The row loops every format shares. decode(block, y) writes the block's kBlockElems floats.
template <typename Block, typename Decode>
inline void decode_blocks(Bytes src, std::span<float> dst, Decode&& decode) {
  constexpr int qk = kBlockElems<Block>;
  const int64_t nb = n_blocks(dst.size(), qk);
  for (int64_t i = 0; i < nb; ++i) decode(load_block<Block>(src, i), dst.data() + i * qk);
}

// encode(x, block) fills a zeroed block from kBlockElems finite floats; a block holding a
// NaN or Inf gets NaN scales instead (mark_non_finite).
template <typename Block, typename Encode>
inline void encode_blocks(std::span<const float> src, MutBytes dst, Encode&& encode) {
  constexpr int qk = kBlockElems<Block>;
  const int64_t nb = n_blocks(src.size(), qk);
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * qk;
    Block b{};
    if (all_finite(x, qk))
      encode(x, b);
    else
      mark_non_finite(b);
    store_block(dst, i, b);
  }
}

// fn(weight block, activation block) for each pair of an n-element dot product, in order.
template <typename WBlock, typename ABlock, typename Fn>
inline void for_each_block_pair(int64_t n, Bytes w, Bytes a, Fn&& fn) {
  const int64_t nb = n_blocks(static_cast<size_t>(n), kBlockElems<WBlock>);
  for (int64_t i = 0; i < nb; ++i) fn(load_block<WBlock>(w, i), load_block<ABlock>(a, i));
}

}  // namespace kiln::quant::detail
