// quant/iquants.cpp: the non-linear 4-bit i-quants (IQ4_NL: 32-element blocks; IQ4_XS: 256-element
// super-blocks with 6-bit sub-block scales): decode, llama.cpp's encoder without an importance
// matrix (quantize_row_iq4_nl_impl with 7 trial scales each way, float op for float op so
// `kiln quantize` writes llama-quantize's bytes), and the scalar dots of ggml's generic CPU
// path (IQ4_NL against Q8_0, IQ4_XS against Q8_K).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant/blocks.h"
#include "quant/detail.h"

namespace kiln::quant::detail {
namespace {

constexpr int kSub = 32;   // elements per scale
constexpr int kTries = 7;  // llama.cpp's ntry: scales tried on each side of the first guess
// llama.cpp's GROUP_MAX_EPS: a sub-block whose largest |x| is below it gets scale 0.
constexpr double kGroupMaxEps = 1e-15f;

// The code whose grid value is nearest x (the lower one on a tie), by bisection as llama.cpp's
// best_index_int8 does (the comparisons, in float, are what decide its ties).
int best_index(float x) {
  const int8_t* v = kIQ4NLValues;
  if (x <= v[0]) return 0;
  if (x >= v[15]) return 15;
  int lo = 0, hi = 15;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (x < v[mid])
      hi = mid;
    else
      lo = mid;
  }
  return x - v[hi - 1] < v[hi] - x ? hi - 1 : hi;
}

// Codes for one sub-block under inverse scale id, and the weighted sums the scale search
// compares (weights: x^2, as llama.cpp uses without an importance matrix).
struct Fit {
  float sumqx = 0, sumq2 = 0;
};
Fit fit(const float* x, const float* w, float id, uint8_t* codes) {
  Fit f;
  for (int j = 0; j < kSub; ++j) {
    const int l = best_index(id * x[j]);
    if (codes != nullptr) codes[j] = static_cast<uint8_t>(l);
    const float q = kIQ4NLValues[l];
    f.sumqx += w[j] * q * x[j];
    f.sumq2 += w[j] * q * q;
  }
  return f;
}

// The best float scale for one sub-block of 32 (0 for an all-zero one): the scale that puts
// the signed extreme on the grid's end, its least-squares refinement, then 2 * kTries + 1
// neighbours of it, keeping the one with the largest sumqx^2 / sumq2.
float sub_block_scale(const float* x) {
  float w[kSub];
  for (int j = 0; j < kSub; ++j) w[j] = x[j] * x[j];
  float amax = 0, max = 0;
  for (int j = 0; j < kSub; ++j) {
    const float ax = std::fabs(x[j]);
    if (ax > amax) {
      amax = ax;
      max = x[j];
    }
  }
  if (amax < kGroupMaxEps) return 0;
  const float v0 = kIQ4NLValues[0];
  float d = -max / v0;
  Fit f = fit(x, w, 1 / d, nullptr);
  d = f.sumqx / f.sumq2;
  float best = d * f.sumqx;
  for (int itry = -kTries; itry <= kTries; ++itry) {
    const float id = (static_cast<float>(itry) + v0) / max;
    f = fit(x, w, id, nullptr);
    if (f.sumq2 > 0 && f.sumqx * f.sumqx > best * f.sumq2) {
      d = f.sumqx / f.sumq2;
      best = d * f.sumqx;
    }
  }
  return d;
}

// 32 codes into 16 bytes: element j low nibble, j + 16 high nibble.
void pack_nibbles(const uint8_t* codes, uint8_t* qs) {
  for (int j = 0; j < kSub / 2; ++j)
    qs[j] = static_cast<uint8_t>(codes[j] | (codes[j + kSub / 2] << 4));
}

void codes_for(const float* x, float id, uint8_t* codes) {
  for (int j = 0; j < kSub; ++j) codes[j] = static_cast<uint8_t>(best_index(id * x[j]));
}

void encode_iq4_nl(const float* x, block_iq4_nl& b) {
  const float d = sub_block_scale(x);
  b.d = f2h(d);
  uint8_t codes[kSub];
  codes_for(x, d != 0 ? 1 / d : 0.0f, codes);
  pack_nibbles(codes, b.qs);
}

void encode_iq4_xs(const float* x, block_iq4_xs& b) {
  constexpr int kNSub = kQK_K / kSub;
  float scales[kNSub];
  float max_scale = 0, amax_scale = 0;
  for (int ib = 0; ib < kNSub; ++ib) {
    scales[ib] = sub_block_scale(x + ib * kSub);
    if (std::fabs(scales[ib]) > amax_scale) {
      amax_scale = std::fabs(scales[ib]);
      max_scale = scales[ib];
    }
  }
  // The super-block scale maps the signed extreme sub-block scale to -32 (so the 6-bit
  // integer scales span [-32, 31]); each sub-block's codes are then re-fitted to its rounded
  // scale. An all-zero block keeps d = -0 as llama.cpp writes it.
  const float d = -max_scale / 32;
  b.d = f2h(d);
  const float id = d != 0 ? 1 / d : 0.0f;
  b.scales_h = 0;
  for (int ib = 0; ib < kNSub; ++ib) {
    int l = std::max(-32, std::min(31, nearest_int(id * scales[ib])));
    const float dl = d * static_cast<float>(l);
    uint8_t codes[kSub];
    codes_for(x + ib * kSub, dl != 0 ? 1 / dl : 0.0f, codes);
    pack_nibbles(codes, b.qs + ib * kSub / 2);
    l += 32;
    const auto lo = static_cast<uint8_t>(l & 0xF), hi = static_cast<uint8_t>(l >> 4);
    if (ib % 2 == 0)
      b.scales_l[ib / 2] = lo;
    else
      b.scales_l[ib / 2] |= static_cast<uint8_t>(lo << 4);
    b.scales_h = static_cast<uint16_t>(b.scales_h | (hi << (2 * ib)));
  }
}

// The 6-bit scale of sub-block ib, minus its offset of 32.
int iq4_xs_scale(const block_iq4_xs& b, int ib) {
  const int lo = (b.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF;
  const int hi = (b.scales_h >> (2 * ib)) & 3;
  return (lo | (hi << 4)) - 32;
}

void decode_sub_block(const uint8_t* qs, float d, float* y) {
  for (int j = 0; j < kSub / 2; ++j) {
    y[j] = d * kIQ4NLValues[qs[j] & 0xF];
    y[j + kSub / 2] = d * kIQ4NLValues[qs[j] >> 4];
  }
}

void dequantize_iq4_nl(Bytes src, std::span<float> dst) {
  decode_blocks<block_iq4_nl>(
      src, dst, [](const block_iq4_nl& b, float* y) { decode_sub_block(b.qs, h2f(b.d), y); });
}
void dequantize_iq4_xs(Bytes src, std::span<float> dst) {
  decode_blocks<block_iq4_xs>(src, dst, [](const block_iq4_xs& b, float* y) {
    const float d = h2f(b.d);
    for (int ib = 0; ib < kQK_K / kSub; ++ib)
      decode_sub_block(b.qs + ib * kSub / 2, d * static_cast<float>(iq4_xs_scale(b, ib)),
                       y + ib * kSub);
  });
}

void quantize_iq4_nl(std::span<const float> src, MutBytes dst) {
  encode_blocks<block_iq4_nl>(src, dst, encode_iq4_nl);
}
void quantize_iq4_xs(std::span<const float> src, MutBytes dst) {
  encode_blocks<block_iq4_xs>(src, dst, encode_iq4_xs);
}

// sum over one sub-block of 32 of activation * grid value.
int sub_block_dot(const uint8_t* qs, const int8_t* q8) {
  int lo = 0, hi = 0;
  for (int j = 0; j < kSub / 2; ++j) {
    lo += q8[j] * kIQ4NLValues[qs[j] & 0xF];
    hi += q8[j + kSub / 2] * kIQ4NLValues[qs[j] >> 4];
  }
  return lo + hi;
}

float dot_iq4_nl(int64_t n, Bytes w, Bytes a) {
  float sumf = 0;
  for_each_block_pair<block_iq4_nl, block_q8_0>(
      n, w, a, [&](const block_iq4_nl& x, const block_q8_0& y) {
        const float d = h2f(y.d) * h2f(x.d);
        sumf += d * static_cast<float>(sub_block_dot(x.qs, y.qs));
      });
  return sumf;
}

float dot_iq4_xs(int64_t n, Bytes w, Bytes a) {
  float sumf = 0;
  for_each_block_pair<block_iq4_xs, block_q8_K>(
      n, w, a, [&](const block_iq4_xs& x, const block_q8_K& y) {
        const float d4d8 = h2f(x.d) * y.d;
        for (int ib = 0; ib < kQK_K / kSub; ++ib) {
          const float dl = d4d8 * static_cast<float>(iq4_xs_scale(x, ib));
          sumf += dl * static_cast<float>(sub_block_dot(x.qs + ib * kSub / 2, y.qs + ib * kSub));
        }
      });
  return sumf;
}

}  // namespace

std::span<const RowCodec> iquant_codecs() {
  static constexpr RowCodec kCodecs[] = {
      {DType::IQ4_NL, DType::Q8_0, dequantize_iq4_nl, quantize_iq4_nl, dot_iq4_nl},
      {DType::IQ4_XS, DType::Q8_K, dequantize_iq4_xs, quantize_iq4_xs, dot_iq4_xs},
  };
  return kCodecs;
}

}  // namespace kiln::quant::detail
