// quant/legacy.cpp: the 32-element formats (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q8_1): decode, llama.cpp's
// reference encoders (quantize_row_*_ref, float op for float op so output is byte-identical),
// and the scalar dot products of ggml's generic CPU path.
#include <algorithm>
#include <cmath>
#include <cfloat>

#include "quant/blocks.h"
#include "quant/detail.h"

namespace kiln::quant::detail {
namespace {

constexpr int kQK = 32;

int64_t n_blocks(size_t n) {
  KILN_CHECK(n % kQK == 0, "row of {} elements is not a multiple of {}", n, kQK);
  return static_cast<int64_t>(n / kQK);
}

// Largest |x| of a block and the signed value that has it (the scale's sign follows it so
// the extreme value lands exactly on the most negative code).
void signed_absmax(const float* x, float& amax, float& max) {
  amax = 0.0f;
  max = 0.0f;
  for (int j = 0; j < kQK; ++j) {
    const float v = x[j];
    if (amax < std::fabs(v)) {
      amax = std::fabs(v);
      max = v;
    }
  }
}

void min_max(const float* x, float& min, float& max) {
  min = FLT_MAX;
  max = -FLT_MAX;
  for (int j = 0; j < kQK; ++j) {
    if (x[j] < min) min = x[j];
    if (x[j] > max) max = x[j];
  }
}

uint32_t load_qh(const uint8_t qh[4]) {
  uint32_t v;
  std::memcpy(&v, qh, 4);
  return v;
}

}  // namespace

void dequantize_q4_0(Bytes src, std::span<float> dst) {
  const int64_t nb = n_blocks(dst.size());
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<block_q4_0>(src, i);
    const float d = h2f(b.d);
    float* y = dst.data() + i * kQK;
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>((b.qs[j] & 0x0F) - 8) * d;
      y[j + kQK / 2] = static_cast<float>((b.qs[j] >> 4) - 8) * d;
    }
  }
}

void dequantize_q4_1(Bytes src, std::span<float> dst) {
  const int64_t nb = n_blocks(dst.size());
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<block_q4_1>(src, i);
    const float d = h2f(b.d), m = h2f(b.m);
    float* y = dst.data() + i * kQK;
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = static_cast<float>(b.qs[j] & 0x0F) * d + m;
      y[j + kQK / 2] = static_cast<float>(b.qs[j] >> 4) * d + m;
    }
  }
}

void dequantize_q5_0(Bytes src, std::span<float> dst) {
  const int64_t nb = n_blocks(dst.size());
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<block_q5_0>(src, i);
    const float d = h2f(b.d);
    const uint32_t qh = load_qh(b.qh);
    float* y = dst.data() + i * kQK;
    for (int j = 0; j < kQK / 2; ++j) {
      const uint32_t xh0 = ((qh >> j) << 4) & 0x10;
      const uint32_t xh1 = (qh >> (j + 12)) & 0x10;
      y[j] = static_cast<float>(static_cast<int>((b.qs[j] & 0x0F) | xh0) - 16) * d;
      y[j + kQK / 2] = static_cast<float>(static_cast<int>((b.qs[j] >> 4) | xh1) - 16) * d;
    }
  }
}

void dequantize_q5_1(Bytes src, std::span<float> dst) {
  const int64_t nb = n_blocks(dst.size());
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<block_q5_1>(src, i);
    const float d = h2f(b.d), m = h2f(b.m);
    const uint32_t qh = load_qh(b.qh);
    float* y = dst.data() + i * kQK;
    for (int j = 0; j < kQK / 2; ++j) {
      const uint32_t xh0 = ((qh >> j) << 4) & 0x10;
      const uint32_t xh1 = (qh >> (j + 12)) & 0x10;
      y[j] = static_cast<float>((b.qs[j] & 0x0F) | xh0) * d + m;
      y[j + kQK / 2] = static_cast<float>((b.qs[j] >> 4) | xh1) * d + m;
    }
  }
}

void dequantize_q8_0(Bytes src, std::span<float> dst) {
  const int64_t nb = n_blocks(dst.size());
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<block_q8_0>(src, i);
    const float d = h2f(b.d);
    for (int j = 0; j < kQK; ++j) dst[i * kQK + j] = static_cast<float>(b.qs[j]) * d;
  }
}

void dequantize_q8_1(Bytes src, std::span<float> dst) {
  const int64_t nb = n_blocks(dst.size());
  for (int64_t i = 0; i < nb; ++i) {
    const auto b = load_block<block_q8_1>(src, i);
    const float d = h2f(b.d);
    for (int j = 0; j < kQK; ++j) dst[i * kQK + j] = static_cast<float>(b.qs[j]) * d;
  }
}

// --- reference encoders: each mirrors llama.cpp's quantize_row_*_ref expression by
// expression (the casts and the order of float operations decide the last bit).

void quantize_q4_0(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_blocks(src.size());
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK;
    block_q4_0 b{};
    if (!all_finite(x, kQK)) {
      b.d = nan_f16();
      store_block(dst, i, b);
      continue;
    }
    float amax, max;
    signed_absmax(x, amax, max);
    const float d = max / -8;
    const float id = d ? 1.0f / d : 0.0f;
    b.d = f2h(d);
    for (int j = 0; j < kQK / 2; ++j) {
      const float x0 = x[j] * id;
      const float x1 = x[kQK / 2 + j] * id;
      const uint8_t xi0 = std::min<int8_t>(15, static_cast<int8_t>(x0 + 8.5f));
      const uint8_t xi1 = std::min<int8_t>(15, static_cast<int8_t>(x1 + 8.5f));
      b.qs[j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
    store_block(dst, i, b);
  }
}

void quantize_q4_1(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_blocks(src.size());
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK;
    block_q4_1 b{};
    if (!all_finite(x, kQK)) {
      b.d = b.m = nan_f16();
      store_block(dst, i, b);
      continue;
    }
    float min, max;
    min_max(x, min, max);
    const float d = (max - min) / ((1 << 4) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    b.d = f2h(d);
    b.m = f2h(min);
    for (int j = 0; j < kQK / 2; ++j) {
      const float x0 = (x[j] - min) * id;
      const float x1 = (x[kQK / 2 + j] - min) * id;
      const uint8_t xi0 = std::min<int8_t>(15, static_cast<int8_t>(x0 + 0.5f));
      const uint8_t xi1 = std::min<int8_t>(15, static_cast<int8_t>(x1 + 0.5f));
      b.qs[j] = static_cast<uint8_t>(xi0 | (xi1 << 4));
    }
    store_block(dst, i, b);
  }
}

void quantize_q5_0(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_blocks(src.size());
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK;
    block_q5_0 b{};
    if (!all_finite(x, kQK)) {
      b.d = nan_f16();
      store_block(dst, i, b);
      continue;
    }
    float amax, max;
    signed_absmax(x, amax, max);
    const float d = max / -16;
    const float id = d ? 1.0f / d : 0.0f;
    b.d = f2h(d);
    uint32_t qh = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const float x0 = x[j] * id;
      const float x1 = x[kQK / 2 + j] * id;
      const uint8_t xi0 = std::min<int8_t>(31, static_cast<int8_t>(x0 + 16.5f));
      const uint8_t xi1 = std::min<int8_t>(31, static_cast<int8_t>(x1 + 16.5f));
      b.qs[j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
      qh |= ((xi0 & 0x10u) >> 4) << j;
      qh |= ((xi1 & 0x10u) >> 4) << (j + kQK / 2);
    }
    std::memcpy(b.qh, &qh, sizeof(qh));
    store_block(dst, i, b);
  }
}

void quantize_q5_1(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_blocks(src.size());
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK;
    block_q5_1 b{};
    if (!all_finite(x, kQK)) {
      b.d = b.m = nan_f16();
      store_block(dst, i, b);
      continue;
    }
    float min, max;
    min_max(x, min, max);
    const float d = (max - min) / ((1 << 5) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    b.d = f2h(d);
    b.m = f2h(min);
    uint32_t qh = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const float x0 = (x[j] - min) * id;
      const float x1 = (x[kQK / 2 + j] - min) * id;
      const uint8_t xi0 = static_cast<uint8_t>(x0 + 0.5f);
      const uint8_t xi1 = static_cast<uint8_t>(x1 + 0.5f);
      b.qs[j] = static_cast<uint8_t>((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
      qh |= ((xi0 & 0x10u) >> 4) << j;
      qh |= ((xi1 & 0x10u) >> 4) << (j + kQK / 2);
    }
    std::memcpy(b.qh, &qh, sizeof(qh));
    store_block(dst, i, b);
  }
}

void quantize_q8_0(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_blocks(src.size());
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK;
    block_q8_0 b{};
    if (!all_finite(x, kQK)) {
      b.d = nan_f16();
      store_block(dst, i, b);
      continue;
    }
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    b.d = f2h(d);
    for (int j = 0; j < kQK; ++j) b.qs[j] = static_cast<int8_t>(std::round(x[j] * id));
    store_block(dst, i, b);
  }
}

void quantize_q8_1(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_blocks(src.size());
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK;
    block_q8_1 b{};
    if (!all_finite(x, kQK)) {
      b.d = b.s = nan_f16();
      store_block(dst, i, b);
      continue;
    }
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    b.d = f2h(d);
    int sum = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const float v0 = x[j] * id;
      const float v1 = x[kQK / 2 + j] * id;
      b.qs[j] = static_cast<int8_t>(std::round(v0));
      b.qs[kQK / 2 + j] = static_cast<int8_t>(std::round(v1));
      sum += b.qs[j] + b.qs[kQK / 2 + j];
    }
    b.s = f2h(static_cast<float>(sum) * d);
    store_block(dst, i, b);
  }
}

// --- dot products: integer sums per block, one float multiply-add per block.

float dot_q4_0_q8_0(int64_t n, Bytes w, Bytes a) {
  const int64_t nb = n_blocks(static_cast<size_t>(n));
  float sumf = 0;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const auto x = load_block<block_q4_0>(w, ib);
    const auto y = load_block<block_q8_0>(a, ib);
    int sumi0 = 0, sumi1 = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      sumi0 += ((x.qs[j] & 0x0F) - 8) * y.qs[j];
      sumi1 += ((x.qs[j] >> 4) - 8) * y.qs[j + kQK / 2];
    }
    sumf += static_cast<float>(sumi0 + sumi1) * h2f(x.d) * h2f(y.d);
  }
  return sumf;
}

float dot_q4_1_q8_1(int64_t n, Bytes w, Bytes a) {
  const int64_t nb = n_blocks(static_cast<size_t>(n));
  float sumf = 0;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const auto x = load_block<block_q4_1>(w, ib);
    const auto y = load_block<block_q8_1>(a, ib);
    int sumi0 = 0, sumi1 = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      sumi0 += (x.qs[j] & 0x0F) * y.qs[j];
      sumi1 += (x.qs[j] >> 4) * y.qs[j + kQK / 2];
    }
    sumf += (h2f(x.d) * h2f(y.d)) * static_cast<float>(sumi0 + sumi1) + h2f(x.m) * h2f(y.s);
  }
  return sumf;
}

float dot_q5_0_q8_0(int64_t n, Bytes w, Bytes a) {
  const int64_t nb = n_blocks(static_cast<size_t>(n));
  float sumf = 0;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const auto x = load_block<block_q5_0>(w, ib);
    const auto y = load_block<block_q8_0>(a, ib);
    const uint32_t qh = load_qh(x.qh);
    int sumi0 = 0, sumi1 = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const uint32_t xh0 = ((qh & (1u << j)) >> j) << 4;
      const uint32_t xh1 = (qh & (1u << (j + 16))) >> (j + 12);
      const int x0 = static_cast<int>((x.qs[j] & 0x0F) | xh0) - 16;
      const int x1 = static_cast<int>((x.qs[j] >> 4) | xh1) - 16;
      sumi0 += x0 * y.qs[j];
      sumi1 += x1 * y.qs[j + kQK / 2];
    }
    sumf += (h2f(x.d) * h2f(y.d)) * static_cast<float>(sumi0 + sumi1);
  }
  return sumf;
}

float dot_q5_1_q8_1(int64_t n, Bytes w, Bytes a) {
  const int64_t nb = n_blocks(static_cast<size_t>(n));
  float sumf = 0;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const auto x = load_block<block_q5_1>(w, ib);
    const auto y = load_block<block_q8_1>(a, ib);
    const uint32_t qh = load_qh(x.qh);
    int sumi0 = 0, sumi1 = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const uint32_t xh0 = ((qh >> j) << 4) & 0x10;
      const uint32_t xh1 = (qh >> (j + 12)) & 0x10;
      sumi0 += static_cast<int>((x.qs[j] & 0x0F) | xh0) * y.qs[j];
      sumi1 += static_cast<int>((x.qs[j] >> 4) | xh1) * y.qs[j + kQK / 2];
    }
    sumf += (h2f(x.d) * h2f(y.d)) * static_cast<float>(sumi0 + sumi1) + h2f(x.m) * h2f(y.s);
  }
  return sumf;
}

float dot_q8_0_q8_0(int64_t n, Bytes w, Bytes a) {
  const int64_t nb = n_blocks(static_cast<size_t>(n));
  float sumf = 0;
  for (int64_t ib = 0; ib < nb; ++ib) {
    const auto x = load_block<block_q8_0>(w, ib);
    const auto y = load_block<block_q8_0>(a, ib);
    int sumi = 0;
    for (int j = 0; j < kQK; ++j) sumi += x.qs[j] * y.qs[j];
    sumf += static_cast<float>(sumi) * (h2f(x.d) * h2f(y.d));
  }
  return sumf;
}

}  // namespace kiln::quant::detail
