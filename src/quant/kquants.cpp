// quant/kquants.cpp: the K-quant super-block formats (Q2_K Q3_K Q4_K Q5_K Q6_K, and the Q8_K
// activation blocks): decoding and the scalar dot products of ggml's generic CPU path, whose
// per-lane float accumulation order is kept so results match llama.cpp's reference bit for bit.
#include <array>
#include <cstring>

#include "quant/blocks.h"
#include "quant/detail.h"

namespace kiln::quant::detail {
namespace {

int64_t n_superblocks(size_t n) {
  KILN_CHECK(n % kQK_K == 0, "row of {} elements is not a multiple of {}", n, kQK_K);
  return static_cast<int64_t>(n / kQK_K);
}

// The 6-bit scale and min of sub-block j from Q4_K/Q5_K's 12 packed bytes: sub-blocks 0..3
// keep theirs in the low 6 bits of bytes 0..7; 4..7 split theirs over bytes 8..11 (low
// nibbles) and the top 2 bits of bytes 0..7.
void scale_min_k4(int j, const uint8_t* q, uint8_t& d, uint8_t& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q3_K's 16 signed 6-bit scales (stored +32) from its 12 packed bytes.
std::array<int8_t, 16> q3_scales(const uint8_t packed[12]) {
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

// Signed codes of one super-block, in element order.
using Codes = std::array<int8_t, kQK_K>;

void codes_q3_K(const block_q3_K& x, Codes& a) {
  const uint8_t* q = x.qs;
  uint8_t m = 1;
  int8_t* out = a.data();
  for (int n = 0; n < kQK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int l = 0; l < 32; ++l)
        out[l] = static_cast<int8_t>(((q[l] >> shift) & 3) - ((x.hmask[l] & m) ? 0 : 4));
      out += 32;
      m = static_cast<uint8_t>(m << 1);
    }
    q += 32;
  }
}

void codes_q4_K(const block_q4_K& x, Codes& a) {
  const uint8_t* q = x.qs;
  for (int j = 0; j < kQK_K; j += 64) {
    for (int l = 0; l < 32; ++l) a[j + l] = static_cast<int8_t>(q[l] & 0xF);
    for (int l = 0; l < 32; ++l) a[j + 32 + l] = static_cast<int8_t>(q[l] >> 4);
    q += 32;
  }
}

void codes_q5_K(const block_q5_K& x, Codes& a) {
  const uint8_t* q = x.qs;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < kQK_K; j += 64) {
    for (int l = 0; l < 32; ++l)
      a[j + l] = static_cast<int8_t>((q[l] & 0xF) + ((x.qh[l] & u1) ? 16 : 0));
    for (int l = 0; l < 32; ++l)
      a[j + 32 + l] = static_cast<int8_t>((q[l] >> 4) + ((x.qh[l] & u2) ? 16 : 0));
    q += 32;
    u1 = static_cast<uint8_t>(u1 << 2);
    u2 = static_cast<uint8_t>(u2 << 2);
  }
}

void codes_q6_K(const block_q6_K& x, Codes& a) {
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

// ggml's generic K-quant dot kernel shape: codes times activations in 8 integer lanes, each
// group of 16 scaled by its integer scale; lanes become floats once per super-block.
void accumulate_lanes(const Codes& a, const int8_t* q8, const int* scale16, int32_t aux32[8]) {
  for (int g = 0; g < kQK_K / 16; ++g) {
    for (int half = 0; half < 2; ++half) {
      const int base = g * 16 + half * 8;
      for (int l = 0; l < 8; ++l) aux32[l] += scale16[g] * (q8[base + l] * a[base + l]);
    }
  }
}

}  // namespace

void dequantize_q2_K(Bytes src, std::span<float> dst) {
  const int64_t nb = n_superblocks(dst.size());
  float* y = dst.data();
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<block_q2_K>(src, i);
    const float d = h2f(x.d), min = h2f(x.dmin);
    const uint8_t* q = x.qs;
    int is = 0;
    for (int n = 0; n < kQK_K; n += 128) {
      for (int shift = 0; shift < 8; shift += 2) {
        for (int half = 0; half < 2; ++half) {
          const uint8_t sc = x.scales[is++];
          const float dl = d * static_cast<float>(sc & 0xF), ml = min * static_cast<float>(sc >> 4);
          for (int l = 0; l < 16; ++l)
            *y++ = dl * static_cast<float>((q[l + 16 * half] >> shift) & 3) - ml;
        }
      }
      q += 32;
    }
  }
}

void dequantize_q3_K(Bytes src, std::span<float> dst) {
  const int64_t nb = n_superblocks(dst.size());
  Codes a;
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<block_q3_K>(src, i);
    const float d_all = h2f(x.d);
    const auto scales = q3_scales(x.scales);
    codes_q3_K(x, a);
    float* y = dst.data() + i * kQK_K;
    for (int g = 0; g < 16; ++g) {
      const float dl = d_all * static_cast<float>(scales[g] - 32);
      for (int l = 0; l < 16; ++l) y[g * 16 + l] = dl * static_cast<float>(a[g * 16 + l]);
    }
  }
}

void dequantize_q4_K(Bytes src, std::span<float> dst) {
  const int64_t nb = n_superblocks(dst.size());
  float* y = dst.data();
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<block_q4_K>(src, i);
    const float d = h2f(x.d), min = h2f(x.dmin);
    const uint8_t* q = x.qs;
    for (int j = 0, is = 0; j < kQK_K; j += 64, is += 2) {
      uint8_t sc, m;
      scale_min_k4(is, x.scales, sc, m);
      const float d1 = d * sc, m1 = min * m;
      scale_min_k4(is + 1, x.scales, sc, m);
      const float d2 = d * sc, m2 = min * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
      q += 32;
    }
  }
}

void dequantize_q5_K(Bytes src, std::span<float> dst) {
  const int64_t nb = n_superblocks(dst.size());
  Codes a;
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<block_q5_K>(src, i);
    const float d = h2f(x.d), min = h2f(x.dmin);
    codes_q5_K(x, a);
    float* y = dst.data() + i * kQK_K;
    for (int sb = 0; sb < 8; ++sb) {
      uint8_t sc, m;
      scale_min_k4(sb, x.scales, sc, m);
      const float dl = d * sc, ml = min * m;
      for (int l = 0; l < 32; ++l) y[sb * 32 + l] = dl * static_cast<float>(a[sb * 32 + l]) - ml;
    }
  }
}

void dequantize_q6_K(Bytes src, std::span<float> dst) {
  const int64_t nb = n_superblocks(dst.size());
  Codes a;
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<block_q6_K>(src, i);
    const float d = h2f(x.d);
    codes_q6_K(x, a);
    float* y = dst.data() + i * kQK_K;
    // llama.cpp computes d * scale * q left to right; keep that association.
    for (int g = 0; g < 16; ++g)
      for (int l = 0; l < 16; ++l)
        y[g * 16 + l] = d * static_cast<float>(x.scales[g]) * static_cast<float>(a[g * 16 + l]);
  }
}

void dequantize_q8_K(Bytes src, std::span<float> dst) {
  const int64_t nb = n_superblocks(dst.size());
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<block_q8_K>(src, i);
    for (int j = 0; j < kQK_K; ++j) dst[i * kQK_K + j] = x.d * static_cast<float>(x.qs[j]);
  }
}

float dot_q2_K_q8_K(int64_t n, Bytes w, Bytes a) {
  const int64_t nb = n_superblocks(static_cast<size_t>(n));
  float sumf = 0;
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<block_q2_K>(w, i);
    const auto y = load_block<block_q8_K>(a, i);
    int summs = 0;
    for (int j = 0; j < 16; ++j) summs += y.bsums[j] * (x.scales[j] >> 4);
    const float dall = y.d * h2f(x.d);
    const float dmin = y.d * h2f(x.dmin);
    const uint8_t* q2 = x.qs;
    const int8_t* q8 = y.qs;
    int isum = 0, is = 0;
    for (int k = 0; k < kQK_K / 128; ++k) {
      for (int shift = 0; shift < 8; shift += 2) {
        for (int half = 0; half < 2; ++half) {
          const int d = x.scales[is++] & 0xF;
          int isuml = 0;
          for (int l = 16 * half; l < 16 * half + 16; ++l) isuml += q8[l] * ((q2[l] >> shift) & 3);
          isum += d * isuml;
        }
        q8 += 32;
      }
      q2 += 32;
    }
    sumf += dall * static_cast<float>(isum) - dmin * static_cast<float>(summs);
  }
  return sumf;
}

float dot_q3_K_q8_K(int64_t n, Bytes w, Bytes a) {
  const int64_t nb = n_superblocks(static_cast<size_t>(n));
  float sums[8] = {};
  Codes codes;
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<block_q3_K>(w, i);
    const auto y = load_block<block_q8_K>(a, i);
    codes_q3_K(x, codes);
    const auto sc = q3_scales(x.scales);
    int scale16[16];
    for (int g = 0; g < 16; ++g) scale16[g] = sc[g] - 32;
    int32_t aux32[8] = {};
    accumulate_lanes(codes, y.qs, scale16, aux32);
    const float d = h2f(x.d) * y.d;
    for (int l = 0; l < 8; ++l) sums[l] += d * static_cast<float>(aux32[l]);
  }
  float sumf = 0;
  for (int l = 0; l < 8; ++l) sumf += sums[l];
  return sumf;
}

namespace {
// Q4_K and Q5_K share everything but the codes: 8 sub-blocks of 32 with a 6-bit scale and min.
template <typename Block, void (*kCodes)(const Block&, Codes&)>
float dot_q45_K(int64_t n, Bytes w, Bytes a) {
  const int64_t nb = n_superblocks(static_cast<size_t>(n));
  float sums[8] = {};
  float sumf = 0;
  Codes codes;
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<Block>(w, i);
    const auto y = load_block<block_q8_K>(a, i);
    kCodes(x, codes);
    int scale16[16];
    int sumi = 0;
    for (int sb = 0; sb < 8; ++sb) {
      uint8_t sc, m;
      scale_min_k4(sb, x.scales, sc, m);
      scale16[2 * sb] = scale16[2 * sb + 1] = sc;
      sumi += (y.bsums[2 * sb] + y.bsums[2 * sb + 1]) * m;
    }
    int32_t aux32[8] = {};
    accumulate_lanes(codes, y.qs, scale16, aux32);
    const float d = h2f(x.d) * y.d;
    for (int l = 0; l < 8; ++l) sums[l] += d * static_cast<float>(aux32[l]);
    const float dmin = h2f(x.dmin) * y.d;
    sumf -= dmin * static_cast<float>(sumi);
  }
  for (int l = 0; l < 8; ++l) sumf += sums[l];
  return sumf;
}
}  // namespace

float dot_q4_K_q8_K(int64_t n, Bytes w, Bytes a) { return dot_q45_K<block_q4_K, codes_q4_K>(n, w, a); }
float dot_q5_K_q8_K(int64_t n, Bytes w, Bytes a) { return dot_q45_K<block_q5_K, codes_q5_K>(n, w, a); }

float dot_q6_K_q8_K(int64_t n, Bytes w, Bytes a) {
  const int64_t nb = n_superblocks(static_cast<size_t>(n));
  float sums[8] = {};
  Codes codes;
  for (int64_t i = 0; i < nb; ++i) {
    const auto x = load_block<block_q6_K>(w, i);
    const auto y = load_block<block_q8_K>(a, i);
    codes_q6_K(x, codes);
    int scale16[16];
    for (int g = 0; g < 16; ++g) scale16[g] = x.scales[g];
    int32_t aux32[8] = {};
    accumulate_lanes(codes, y.qs, scale16, aux32);
    const float d = h2f(x.d) * y.d;
    for (int l = 0; l < 8; ++l) sums[l] += d * static_cast<float>(aux32[l]);
  }
  float sumf = 0;
  for (int l = 0; l < 8; ++l) sumf += sums[l];
  return sumf;
}

}  // namespace kiln::quant::detail
