// quant/legacy.cpp: the 32-element formats (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q8_1): decode, llama.cpp's
// reference encoders (quantize_row_*_ref, float op for float op so output is byte-identical),
// and the scalar dot products of ggml's generic CPU path.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "quant/blocks.h"
#include "quant/detail.h"

namespace kiln::quant::detail {
namespace {

constexpr int kQK = 32;

// The formats differ in three ways only: how many bits a code has (4, 5 or 8), whether the
// block carries a min (x = d * q + m, the "_1" formats) and, for those without, the offset
// the codes are stored at (x = d * (q - offset)).
template <typename Block>
constexpr bool kHasMin = requires(Block b) {
  b.m;
};
template <typename Block>
constexpr bool kHasHighBits = requires(Block b) {
  b.qh;
};
template <typename Block>
constexpr bool kIsQ8 = sizeof(Block::qs) == kQK;
template <typename Block>
constexpr int kCodeOffset = 0;
template <>
constexpr int kCodeOffset<block_q4_0> = 8;
template <>
constexpr int kCodeOffset<block_q5_0> = 16;
template <typename Block>
constexpr int kCodeMax = kHasHighBits<Block> ? 31 : 15;  // 4- and 5-bit formats

// The codes of a block in element order (unsigned; Q8's signed).
template <typename Block>
void unpack_codes(const Block& b, int q[kQK]) {
  if constexpr (kIsQ8<Block>) {
    for (int j = 0; j < kQK; ++j) q[j] = b.qs[j];
  } else {
    // Element j sits in the low nibble of qs[j], element j+16 in the high one; a 5-bit
    // format keeps bit 4 of element j in bit j of qh.
    uint32_t qh = 0;
    if constexpr (kHasHighBits<Block>) std::memcpy(&qh, b.qh, sizeof(qh));
    for (int j = 0; j < kQK / 2; ++j) {
      q[j] = static_cast<int>((b.qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10));
      q[j + kQK / 2] = static_cast<int>((b.qs[j] >> 4) | ((qh >> (j + 12)) & 0x10));
    }
  }
}

template <typename Block>
void pack_codes(const uint8_t q[kQK], Block& b) {
  if constexpr (kHasHighBits<Block>) {
    uint32_t qh = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      b.qs[j] = static_cast<uint8_t>((q[j] & 0x0F) | ((q[j + kQK / 2] & 0x0F) << 4));
      qh |= ((q[j] & 0x10u) >> 4) << j;
      qh |= ((q[j + kQK / 2] & 0x10u) >> 4) << (j + kQK / 2);
    }
    std::memcpy(b.qh, &qh, sizeof(qh));
  } else {
    for (int j = 0; j < kQK / 2; ++j) b.qs[j] = static_cast<uint8_t>(q[j] | (q[j + kQK / 2] << 4));
  }
}

template <typename Block>
void dequantize(Bytes src, std::span<float> dst) {
  decode_blocks<Block>(src, dst, [](const Block& b, float* y) {
    int q[kQK];
    unpack_codes(b, q);
    const float d = h2f(b.d);
    if constexpr (kHasMin<Block>) {
      const float m = h2f(b.m);
      for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(q[j]) * d + m;
    } else {
      for (int j = 0; j < kQK; ++j) y[j] = static_cast<float>(q[j] - kCodeOffset<Block>) * d;
    }
  });
}

// --- reference encoders: each mirrors llama.cpp's quantize_row_*_ref expression by
// expression (the casts and the order of float operations decide the last bit).

// Q4_0 Q4_1 Q5_0 Q5_1.
template <typename Block>
void encode_q4_q5(const float* x, Block& b) {
  constexpr int nmax = kCodeMax<Block>;
  uint8_t q[kQK];
  if constexpr (kHasMin<Block>) {
    float min = FLT_MAX;
    float max = -FLT_MAX;
    for (int j = 0; j < kQK; ++j) {
      if (x[j] < min) min = x[j];
      if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / nmax;
    const float id = d ? 1.0f / d : 0.0f;
    b.d = f2h(d);
    b.m = f2h(min);
    for (int j = 0; j < kQK; ++j) {
      const float v = (x[j] - min) * id + 0.5f;
      // llama.cpp's q5_1 encoder has no clamp: (max - min) * id rounds to 31 at most.
      if constexpr (std::is_same_v<Block, block_q5_1>)
        q[j] = static_cast<uint8_t>(v);
      else
        q[j] = std::min<int8_t>(nmax, static_cast<int8_t>(v));
    }
  } else {
    // The scale's sign follows the largest |x|, so that value takes code 0.
    const float d = signed_absmax(x, kQK).max / -kCodeOffset<Block>;
    const float id = d ? 1.0f / d : 0.0f;
    b.d = f2h(d);
    constexpr float kRound = kCodeOffset<Block> + 0.5f;
    for (int j = 0; j < kQK; ++j)
      q[j] = std::min<int8_t>(nmax, static_cast<int8_t>(x[j] * id + kRound));
  }
  pack_codes(q, b);
}

// Q8_0 Q8_1 (Q8_1 also stores d times the sum of its codes, for the dots' min term).
template <typename Block>
void encode_q8(const float* x, Block& b) {
  const float d = signed_absmax(x, kQK).amax / ((1 << 7) - 1);
  const float id = d ? 1.0f / d : 0.0f;
  b.d = f2h(d);
  int sum = 0;
  for (int j = 0; j < kQK; ++j) {
    b.qs[j] = static_cast<int8_t>(std::round(x[j] * id));
    sum += b.qs[j];
  }
  if constexpr (requires { b.s; }) b.s = f2h(static_cast<float>(sum) * d);
}

template <typename Block>
void quantize(std::span<const float> src, MutBytes dst) {
  encode_blocks<Block>(src, dst, [](const float* x, Block& b) {
    if constexpr (kIsQ8<Block>)
      encode_q8(x, b);
    else
      encode_q4_q5(x, b);
  });
}

// --- dot products: integer sums per block, one float multiply-add per block.

template <typename WBlock, typename ABlock>
float dot(int64_t n, Bytes w, Bytes a) {
  float sumf = 0;
  for_each_block_pair<WBlock, ABlock>(n, w, a, [&](const WBlock& x, const ABlock& y) {
    int q[kQK];
    unpack_codes(x, q);
    int sumi = 0;
    for (int j = 0; j < kQK; ++j) {
      const int code = q[j] - kCodeOffset<WBlock>;
      sumi += code * y.qs[j];
    }
    // ggml's q4_0 dot scales left to right; the others multiply the two scales first.
    if constexpr (kHasMin<WBlock>)
      sumf += (h2f(x.d) * h2f(y.d)) * static_cast<float>(sumi) + h2f(x.m) * h2f(y.s);
    else if constexpr (std::is_same_v<WBlock, block_q4_0>)
      sumf += static_cast<float>(sumi) * h2f(x.d) * h2f(y.d);
    else
      sumf += (h2f(x.d) * h2f(y.d)) * static_cast<float>(sumi);
  });
  return sumf;
}

template <typename Block>
constexpr RowCodec codec(DType t) {
  return {t, DType::F32, dequantize<Block>, quantize<Block>, nullptr};
}
template <typename Block, typename ABlock>
constexpr RowCodec codec(DType t, DType dot_type) {
  return {t, dot_type, dequantize<Block>, quantize<Block>, dot<Block, ABlock>};
}

}  // namespace

std::span<const RowCodec> legacy_codecs() {
  static constexpr RowCodec kCodecs[] = {
      codec<block_q4_0, block_q8_0>(DType::Q4_0, DType::Q8_0),
      codec<block_q4_1, block_q8_1>(DType::Q4_1, DType::Q8_1),
      codec<block_q5_0, block_q8_0>(DType::Q5_0, DType::Q8_0),
      codec<block_q5_1, block_q8_1>(DType::Q5_1, DType::Q8_1),
      codec<block_q8_0, block_q8_0>(DType::Q8_0, DType::Q8_0),
      codec<block_q8_1>(DType::Q8_1),  // an activation format: no dot of its own
  };
  return kCodecs;
}

}  // namespace kiln::quant::detail
