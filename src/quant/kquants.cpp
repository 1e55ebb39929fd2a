// quant/kquants.cpp: the K-quant super-block formats (Q2_K Q3_K Q4_K Q5_K Q6_K, and the Q8_K
// activation blocks): decoding and the scalar dot products of ggml's generic CPU path, whose
// per-lane float accumulation order is kept so results match llama.cpp's reference bit for bit.
#include <array>
#include <cstring>
#include <type_traits>

#include "quant/blocks.h"
#include "quant/detail.h"

namespace kiln::quant::detail {
namespace {

// Q2_K Q4_K Q5_K: x = d * scale * q - dmin * min; Q3_K Q6_K: x = d * scale * q.
template <typename Block>
constexpr bool kHasMin = requires(Block b) {
  b.dmin;
};

// Signed codes of one super-block, in element order.
using Codes = std::array<int8_t, kQK_K>;

// Q2_K/Q3_K's 2-bit codes: byte l of each 32-byte group holds elements l, l+32, l+64, l+96
// of its 128-element half. Q3_K subtracts 4 where its hmask bit is clear.
void codes_2bit(const uint8_t* q, const uint8_t* hmask, Codes& a) {
  uint8_t m = 1;
  int8_t* out = a.data();
  for (int n = 0; n < kQK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int l = 0; l < 32; ++l)
        out[l] = static_cast<int8_t>(((q[l] >> shift) & 3) -
                                     ((hmask == nullptr || (hmask[l] & m)) ? 0 : 4));
      out += 32;
      m = static_cast<uint8_t>(m << 1);
    }
    q += 32;
  }
}

void codes(const block_q2_K& x, Codes& a) { codes_2bit(x.qs, nullptr, a); }
void codes(const block_q3_K& x, Codes& a) { codes_2bit(x.qs, x.hmask, a); }

// Q4_K/Q5_K: 64 elements per 32 bytes of qs, low nibbles first; Q5_K adds 16 where its qh
// bit (two per byte and 64 elements, moving up two bits each time) is set.
template <typename Block>
void codes_q45(const Block& x, Codes& a) {
  const uint8_t* q = x.qs;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < kQK_K; j += 64) {
    for (int l = 0; l < 32; ++l) {
      int lo = q[l] & 0xF, hi = q[l] >> 4;
      if constexpr (requires { x.qh; }) {
        lo += (x.qh[l] & u1) ? 16 : 0;
        hi += (x.qh[l] & u2) ? 16 : 0;
      }
      a[j + l] = static_cast<int8_t>(lo);
      a[j + 32 + l] = static_cast<int8_t>(hi);
    }
    q += 32;
    u1 = static_cast<uint8_t>(u1 << 2);
    u2 = static_cast<uint8_t>(u2 << 2);
  }
}

void codes(const block_q4_K& x, Codes& a) { codes_q45(x, a); }
void codes(const block_q5_K& x, Codes& a) { codes_q45(x, a); }

void codes(const block_q6_K& x, Codes& a) {
  const uint8_t* ql = x.ql;
  const uint8_t* qh = x.qh;
  for (int n = 0; n < kQK_K; n += 128) {
    for (int l = 0; l < 32; ++l) {
      a[n + l + 0] = static_cast<int8_t>(((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
      a[n + l + 32] = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
      a[n + l + 64] = static_cast<int8_t>(((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      a[n + l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
    ql += 64;
    qh += 32;
  }
}

// The integer scale (and min, where the format has one) of each group of 16 codes.
struct GroupScales {
  int scale[kQK_K / 16];
  int min[kQK_K / 16];
};

GroupScales group_scales(const block_q2_K& x) {
  GroupScales s;
  for (int g = 0; g < kQK_K / 16; ++g) {
    s.scale[g] = x.scales[g] & 0xF;
    s.min[g] = x.scales[g] >> 4;
  }
  return s;
}

GroupScales group_scales(const block_q3_K& x) {
  const auto packed = q3_scales(x.scales);
  GroupScales s{};
  for (int g = 0; g < kQK_K / 16; ++g) s.scale[g] = packed[g] - 32;
  return s;
}

// Q4_K/Q5_K scale sub-blocks of 32: both of its groups of 16 take one scale and min.
template <typename Block>
GroupScales group_scales_q45(const Block& x) {
  GroupScales s;
  for (int sb = 0; sb < kQK_K / 32; ++sb) {
    uint8_t sc, m;
    scale_min_k4(sb, x.scales, sc, m);
    s.scale[2 * sb] = s.scale[2 * sb + 1] = sc;
    s.min[2 * sb] = s.min[2 * sb + 1] = m;
  }
  return s;
}
GroupScales group_scales(const block_q4_K& x) { return group_scales_q45(x); }
GroupScales group_scales(const block_q5_K& x) { return group_scales_q45(x); }

GroupScales group_scales(const block_q6_K& x) {
  GroupScales s{};
  for (int g = 0; g < kQK_K / 16; ++g) s.scale[g] = x.scales[g];
  return s;
}

template <typename Block>
void dequantize(Bytes src, std::span<float> dst) {
  Codes a;
  decode_blocks<Block>(src, dst, [&](const Block& x, float* y) {
    codes(x, a);
    const GroupScales s = group_scales(x);
    const float d = h2f(x.d);
    // llama.cpp computes d * scale first, then times the code; keep that association.
    for (int g = 0; g < kQK_K / 16; ++g) {
      const float dl = d * static_cast<float>(s.scale[g]);
      if constexpr (kHasMin<Block>) {
        const float ml = h2f(x.dmin) * static_cast<float>(s.min[g]);
        for (int l = 0; l < 16; ++l) y[g * 16 + l] = dl * static_cast<float>(a[g * 16 + l]) - ml;
      } else {
        for (int l = 0; l < 16; ++l) y[g * 16 + l] = dl * static_cast<float>(a[g * 16 + l]);
      }
    }
  });
}

void dequantize_q8_K(Bytes src, std::span<float> dst) {
  decode_blocks<block_q8_K>(src, dst, [](const block_q8_K& x, float* y) {
    for (int j = 0; j < kQK_K; ++j) y[j] = x.d * static_cast<float>(x.qs[j]);
  });
}

// ggml's generic K-quant dot kernel shape: codes times activations in 8 integer lanes, each
// group of 16 scaled by its integer scale.
void accumulate_lanes(const Codes& a, const int8_t* q8, const int* scale16, int32_t aux32[8]) {
  for (int g = 0; g < kQK_K / 16; ++g) {
    for (int half = 0; half < 2; ++half) {
      const int base = g * 16 + half * 8;
      for (int l = 0; l < 8; ++l) aux32[l] += scale16[g] * (q8[base + l] * a[base + l]);
    }
  }
}

template <typename Block>
float dot(int64_t n, Bytes w, Bytes a) {
  float sums[8] = {};
  float sumf = 0;
  Codes q;
  for_each_block_pair<Block, block_q8_K>(n, w, a, [&](const Block& x, const block_q8_K& y) {
    codes(x, q);
    const GroupScales s = group_scales(x);
    int32_t aux32[8] = {};
    accumulate_lanes(q, y.qs, s.scale, aux32);
    int min_sum = 0;  // the activations' group sums weighted by the mins
    if constexpr (kHasMin<Block>)
      for (int g = 0; g < kQK_K / 16; ++g) min_sum += y.bsums[g] * s.min[g];
    if constexpr (std::is_same_v<Block, block_q2_K>) {
      // ggml's q2_K dot adds its integer sums first and rounds once per super-block.
      int isum = 0;
      for (int l = 0; l < 8; ++l) isum += aux32[l];
      const float dall = y.d * h2f(x.d);
      const float dmin = y.d * h2f(x.dmin);
      sumf += dall * static_cast<float>(isum) - dmin * static_cast<float>(min_sum);
    } else {
      // The others turn each lane into floats once per super-block.
      const float d = h2f(x.d) * y.d;
      for (int l = 0; l < 8; ++l) sums[l] += d * static_cast<float>(aux32[l]);
      if constexpr (kHasMin<Block>) {
        const float dmin = h2f(x.dmin) * y.d;
        sumf -= dmin * static_cast<float>(min_sum);
      }
    }
  });
  if constexpr (!std::is_same_v<Block, block_q2_K>)
    for (int l = 0; l < 8; ++l) sumf += sums[l];
  return sumf;
}

template <typename Block>
constexpr RowCodec codec(DType t, void (*quantize)(std::span<const float>, MutBytes)) {
  return {t, DType::Q8_K, dequantize<Block>, quantize, dot<Block>};
}

}  // namespace

std::span<const RowCodec> kquant_codecs() {
  static constexpr RowCodec kCodecs[] = {
      codec<block_q2_K>(DType::Q2_K, quantize_q2_K),
      codec<block_q3_K>(DType::Q3_K, quantize_q3_K),
      codec<block_q4_K>(DType::Q4_K, quantize_q4_K),
      codec<block_q5_K>(DType::Q5_K, quantize_q5_K),
      codec<block_q6_K>(DType::Q6_K, quantize_q6_K),
      // an activation format: no dot of its own
      {DType::Q8_K, DType::F32, dequantize_q8_K, quantize_q8_K, nullptr},
  };
  return kCodecs;
}

}  // namespace kiln::quant::detail
