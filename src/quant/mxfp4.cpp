// quant/mxfp4.cpp: MXFP4 (ggml type 39): decode, llama.cpp's reference encoder
// (quantize_row_mxfp4_ref, float op for float op) and the scalar dot against Q8_0 blocks of
// ggml's generic CPU path. Layout and the value table: blocks.h.
#include <algorithm>
#include <cmath>

#include "quant/blocks.h"
#include "quant/detail.h"

namespace kiln::quant::detail {
namespace {

constexpr int kQK = kQKMxfp4;

void dequantize_mxfp4(Bytes src, std::span<float> dst) {
  const int64_t nb = n_blocks(dst.size(), kQK);
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<block_mxfp4>(src, i);
    const float d = mxfp4_scale_half(b.e);
    float* y = dst.data() + i * kQK;
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>(kMxfp4Values[b.qs[j] & 0x0F]) * d;
      y[j + kQK / 2] = static_cast<float>(kMxfp4Values[b.qs[j] >> 4]) * d;
    }
  }
}

// The code whose value (times the half scale d) is nearest x; the first one on ties, so +0
// beats -0 and a value halfway between two codes takes the smaller magnitude's.
uint8_t best_code(float x, float d) {
  int best = 0;
  float best_err = std::fabs(static_cast<float>(kMxfp4Values[0]) * d - x);
  for (int i = 1; i < 16; ++i) {
    const float err = std::fabs(static_cast<float>(kMxfp4Values[i]) * d - x);
    if (err < best_err) {
      best = i;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best);
}

// The exponent puts the block's largest |x| in [4, 8) half-scale units, so it lands on one
// of the three largest codes (4, 6, 8: E2M1's 2, 3, 4) or rounds to 12 (6).
void encode_mxfp4(const float* x, block_mxfp4& b) {
  float amax = 0;
  for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
  b.e = amax > 0 ? static_cast<uint8_t>(std::floor(std::log2(amax)) - 2 + 127) : 0;
  const float d = mxfp4_scale_half(b.e);
  for (int j = 0; j < kQK / 2; ++j)
    b.qs[j] = static_cast<uint8_t>(best_code(x[j], d) | (best_code(x[j + kQK / 2], d) << 4));
}

void quantize_mxfp4(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_blocks(src.size(), kQK);
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK;
    block_mxfp4 b{};
    // MXFP4 has no NaN scale under ggml's decoding; a block holding a NaN or Inf gets
    // E8M0's NaN exponent (0xFF) and all codes 0, which kiln's loaders never produce
    // otherwise (log2 of a finite float is below 128).
    if (all_finite(x, kQK))
      encode_mxfp4(x, b);
    else
      b.e = 0xFF;
    store_block(dst, i, b);
  }
}

// ggml_vec_dot_mxfp4_q8_0 (generic): integer sums of each half block, one scale per block.
float dot_mxfp4_q8_0(int64_t n, Bytes w, Bytes a) {
  float sumf = 0;
  const int64_t nb = n_blocks(static_cast<size_t>(n), kQK);
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<block_mxfp4>(w, i);
    const auto y = load_block<block_q8_0>(a, i);
    const float d = h2f(y.d) * mxfp4_scale_half(x.e);
    int sum_lo = 0, sum_hi = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      sum_lo += y.qs[j] * kMxfp4Values[x.qs[j] & 0x0F];
      sum_hi += y.qs[j + kQK / 2] * kMxfp4Values[x.qs[j] >> 4];
    }
    sumf += d * static_cast<float>(sum_lo + sum_hi);
  }
  return sumf;
}

}  // namespace

std::span<const RowCodec> mxfp4_codecs() {
  static constexpr RowCodec kCodecs[] = {
      {DType::MXFP4, DType::Q8_0, dequantize_mxfp4, quantize_mxfp4, dot_mxfp4_q8_0},
  };
  return kCodecs;
}

}  // namespace kiln::quant::detail
