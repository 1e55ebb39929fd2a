// quant/kquants_quantize.cpp: llama.cpp's reference K-quant encoders (quantize_row_qN_K_ref)
// and the scale searches they are built on (make_qkx2_quants, make_q3_quants,
// make_qx_quants). Written expression for expression after llama.cpp so that, without an
// importance matrix, our files carry the same bits as llama-quantize's.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant/blocks.h"
#include "quant/detail.h"

namespace kiln::quant::detail {
namespace {

constexpr float kGroupMaxEps = 1e-15f;

int nearest_clamped(float v, int lo, int hi) { return std::max(lo, std::min(hi, nearest_int(v))); }

// Weighted error of codes L under x ~ scale * L + min: |diff| with use_mad, else diff^2.
float fit_error(int n, const float* x, const float* weights, const uint8_t* L, float scale,
                float min, bool use_mad) {
  float error = 0;
  for (int i = 0; i < n; ++i) {
    float diff = scale * L[i] + min - x[i];
    diff = use_mad ? std::fabs(diff) : diff * diff;
    const float w = weights[i];
    error += w * diff;
  }
  return error;
}

// Asymmetric search: x ~ scale * L + min, L in [0, nmax], weighted error, then nstep
// rescalings around nmax / (max - min) refit by weighted least squares. Returns the scale;
// *the_min receives -min (>= 0).
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L,
                       float* the_min, uint8_t* Laux, float rmin, float rdelta, int nstep,
                       bool use_mad) {
  float min = x[0];
  float max = x[0];
  float sum_w = weights[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  float iscale = nmax / (max - min);
  float scale = 1 / iscale;
  for (int i = 0; i < n; ++i)
    L[i] = static_cast<uint8_t>(nearest_clamped(iscale * (x[i] - min), 0, nmax));
  float best_error = fit_error(n, x, weights, L, scale, min, use_mad);
  if (nstep < 1) {
    *the_min = -min;
    return scale;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = nearest_clamped(iscale * (x[i] - min), 0, nmax);
      Laux[i] = static_cast<uint8_t>(l);
      const float w = weights[i];
      sum_l += w * l;
      sum_l2 += w * l * l;
      sum_xl += w * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      const float cur_error = fit_error(n, x, weights, Laux, this_scale, this_min, use_mad);
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

// One symmetric rounding at iscale, l in [-nmax, nmax-1], stored as l + offset in L (when
// given); returns the x^2-weighted sums the least-squares scale is built from.
struct SymSums {
  float sumlx = 0;  // sum of w * x * l
  float suml2 = 0;  // sum of w * l * l
};
SymSums round_sym(int n, int nmax, const float* x, float iscale, int8_t* L, int offset) {
  SymSums s;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_clamped(iscale * x[i], -nmax, nmax - 1);
    if (L != nullptr) L[i] = static_cast<int8_t>(l + offset);
    const float w = x[i] * x[i];
    s.sumlx += w * x[i] * l;
    s.suml2 += w * l * l;
  }
  return s;
}

// Symmetric search for Q3_K: L in [-nmax, nmax-1] stored +nmax; with do_rmse, coordinate
// descent on each code under x^2 weights.
float make_q3_quants(int n, int nmax, const float* x, int8_t* L, bool do_rmse) {
  const SignedAbsMax m = signed_absmax(x, n);
  if (!m.amax) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  const float iscale = -nmax / m.max;
  if (!do_rmse) {
    round_sym(n, nmax, x, iscale, L, nmax);
    return 1 / iscale;
  }
  auto [sumlx, suml2] = round_sym(n, nmax, x, iscale, L, 0);
  for (int itry = 0; itry < 5; ++itry) {
    int n_changed = 0;
    for (int i = 0; i < n; ++i) {
      const float w = x[i] * x[i];
      float slx = sumlx - w * x[i] * L[i];
      if (slx > 0) {
        float sl2 = suml2 - w * L[i] * L[i];
        const int new_l = nearest_clamped(x[i] * sl2 / slx, -nmax, nmax - 1);
        if (new_l != L[i]) {
          slx += w * x[i] * new_l;
          sl2 += w * new_l * new_l;
          if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
            L[i] = static_cast<int8_t>(new_l);
            sumlx = slx;
            suml2 = sl2;
            ++n_changed;
          }
        }
      }
    }
    if (!n_changed) break;
  }
  for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(L[i] + nmax);
  return sumlx / suml2;
}

// Symmetric search for Q6_K (rmse_type 1: x^2 weights, no importance): 19 candidate scales
// around -nmax / max, keeping the best weighted least-squares fit.
float make_qx_quants(int n, int nmax, const float* x, int8_t* L) {
  const SignedAbsMax m = signed_absmax(x, n);
  if (m.amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  const SymSums first = round_sym(n, nmax, x, -nmax / m.max, L, nmax);
  float scale = first.suml2 ? first.sumlx / first.suml2 : 0.0f;
  float best = scale * first.sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    const float iscale = -(nmax + 0.1f * is) / m.max;
    const SymSums s = round_sym(n, nmax, x, iscale, nullptr, 0);
    if (s.suml2 > 0 && s.sumlx * s.sumlx > best * s.suml2) {
      round_sym(n, nmax, x, iscale, L, nmax);
      scale = s.sumlx / s.suml2;
      best = scale * s.sumlx;
    }
  }
  return scale;
}

// make_qkx2_quants over each sub-block of `group` elements: Q2_K fits the absolute error
// under |x| weights, Q4_K/Q5_K the squared error under rms + |x| weights.
struct SubblockFit {
  int group;
  int nmax;
  float rmin;
  int nstep;
  bool use_mad;
};
struct Largest {
  float scale = 0;
  float min = 0;
};
Largest fit_subblocks(const float* x, const SubblockFit& f, uint8_t* L, float* scales,
                      float* mins) {
  float weights[32];
  uint8_t Laux[32];
  Largest largest;
  for (int j = 0; j < kQK_K / f.group; ++j) {
    const float* xs = x + f.group * j;
    if (f.use_mad) {
      for (int l = 0; l < f.group; ++l) weights[l] = std::fabs(xs[l]);
    } else {
      float sum_x2 = 0;
      for (int l = 0; l < f.group; ++l) sum_x2 += xs[l] * xs[l];
      const float av_x = std::sqrt(sum_x2 / f.group);
      for (int l = 0; l < f.group; ++l) weights[l] = av_x + std::fabs(xs[l]);
    }
    scales[j] = make_qkx2_quants(f.group, f.nmax, xs, weights, L + f.group * j, &mins[j], Laux,
                                 f.rmin, 0.1f, f.nstep, f.use_mad);
    if (scales[j] > largest.scale) largest.scale = scales[j];
    if (mins[j] > largest.min) largest.min = mins[j];
  }
  return largest;
}

// Codes again from a sub-block's rounded (stored) scale d and min dm, which are what the
// decoder multiplies back; a zero scale keeps the search's codes.
void requantize_asym(const float* x, int n, float d, float dm, int nmax, uint8_t* L) {
  if (!d) return;
  for (int i = 0; i < n; ++i)
    L[i] = static_cast<uint8_t>(nearest_clamped((x[i] + dm) / d, 0, nmax));
}
// The same for x = d * l, l in [-nmax, nmax-1] stored + nmax.
void requantize_sym(const float* x, int n, float d, int nmax, int8_t* L) {
  if (!d) return;
  for (int i = 0; i < n; ++i)
    L[i] = static_cast<int8_t>(nearest_clamped(x[i] / d, -nmax, nmax - 1) + nmax);
}

// Packs 2-bit codes the way Q2_K/Q3_K store them: byte l of each 32-byte group holds
// elements l, l+32, l+64, l+96 of its 128-element half.
template <typename Code>
void pack_2bit(const Code* L, uint8_t* qs) {
  for (int j = 0; j < kQK_K; j += 128)
    for (int l = 0; l < 32; ++l)
      qs[j / 4 + l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                           (L[j + l + 96] << 6));
}

// Q2_K's 4-bit sub-block scales (shift 0) or mins (shift 4): each value's level of
// largest / 15, ORed into `packed`; returns that step (0 when largest is 0).
f16 pack_q2_levels(const float* v, float largest, int shift, uint8_t* packed) {
  constexpr float q2_scale = 15.f;
  if (!(largest > 0)) return f2h(0.f);
  const float iscale = q2_scale / largest;
  for (int j = 0; j < kQK_K / 16; ++j)
    packed[j] |= static_cast<uint8_t>(nearest_int(iscale * v[j]) << shift);
  return f2h(largest / q2_scale);
}

// Writes the 6-bit scales/mins into Q4_K/Q5_K's 12 bytes (scale_min_k4 reads them back).
void pack_q45_scales(const float* scales, const float* mins, Largest largest, uint8_t packed[12],
                     f16& d_out, f16& dmin_out) {
  const float inv_scale = largest.scale > 0 ? 63.f / largest.scale : 0.f;
  const float inv_min = largest.min > 0 ? 63.f / largest.min : 0.f;
  std::memset(packed, 0, 12);
  for (int j = 0; j < kQK_K / 32; ++j) {
    uint8_t ls = static_cast<uint8_t>(std::min(63, nearest_int(inv_scale * scales[j])));
    uint8_t lm = static_cast<uint8_t>(std::min(63, nearest_int(inv_min * mins[j])));
    if (j < 4) {
      packed[j] = ls;
      packed[j + 4] = lm;
    } else {
      packed[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
      packed[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
      packed[j - 0] |= static_cast<uint8_t>((lm >> 4) << 6);
    }
  }
  d_out = f2h(largest.scale / 63.f);
  dmin_out = f2h(largest.min / 63.f);
}

// Each encoder fills a zeroed block (encode_blocks), so the fields a branch leaves alone
// stay 0, as llama.cpp's explicit zeroing leaves them.

void encode_q2_K(const float* x, block_q2_K& y) {
  uint8_t L[kQK_K];
  float mins[kQK_K / 16];
  float scales[kQK_K / 16];
  const Largest largest = fit_subblocks(
      x, {.group = 16, .nmax = 3, .rmin = -0.5f, .nstep = 15, .use_mad = true}, L, scales, mins);
  y.d = pack_q2_levels(scales, largest.scale, 0, y.scales);
  y.dmin = pack_q2_levels(mins, largest.min, 4, y.scales);
  for (int j = 0; j < kQK_K / 16; ++j)
    requantize_asym(x + 16 * j, 16, h2f(y.d) * (y.scales[j] & 0xF),
                    h2f(y.dmin) * (y.scales[j] >> 4), 3, L + 16 * j);
  pack_2bit(L, y.qs);
}

void encode_q3_K(const float* x, block_q3_K& y) {
  int8_t L[kQK_K];
  float scales[kQK_K / 16];
  for (int j = 0; j < kQK_K / 16; ++j)
    scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j, true);
  const float max_scale = signed_absmax(scales, kQK_K / 16).max;
  if (max_scale) {
    const float iscale = -32.f / max_scale;
    for (int j = 0; j < kQK_K / 16; ++j) {
      int l = nearest_clamped(iscale * scales[j], -32, 31) + 32;
      if (j < 8)
        y.scales[j] = static_cast<uint8_t>(l & 0xF);
      else
        y.scales[j - 8] |= static_cast<uint8_t>((l & 0xF) << 4);
      l >>= 4;
      y.scales[j % 4 + 8] |= static_cast<uint8_t>(l << (2 * (j / 4)));
    }
    y.d = f2h(1 / iscale);
  }
  const auto stored = q3_scales(y.scales);
  for (int j = 0; j < kQK_K / 16; ++j)
    requantize_sym(x + 16 * j, 16, h2f(y.d) * (stored[j] - 32), 4, L + 16 * j);
  // The third bit goes to hmask: bit j / 32 of byte j % 32.
  int m = 0;
  uint8_t hm = 1;
  for (int j = 0; j < kQK_K; ++j) {
    if (L[j] > 3) {
      y.hmask[m] |= hm;
      L[j] = static_cast<int8_t>(L[j] - 4);
    }
    if (++m == kQK_K / 8) {
      m = 0;
      hm = static_cast<uint8_t>(hm << 1);
    }
  }
  pack_2bit(L, y.qs);
}

// Q4_K (4-bit codes) and Q5_K (5-bit: the fifth bit in qh) differ only in their code range,
// search parameters and that bit.
template <typename Block>
void encode_q45_K(const float* x, Block& y) {
  constexpr bool kQ5 = requires { y.qh; };
  constexpr int nmax = kQ5 ? 31 : 15;
  constexpr SubblockFit kFit = {.group = 32,
                                .nmax = nmax,
                                .rmin = kQ5 ? -0.5f : -1.f,
                                .nstep = kQ5 ? 15 : 20,
                                .use_mad = false};
  uint8_t L[kQK_K];
  float mins[kQK_K / 32];
  float scales[kQK_K / 32];
  const Largest largest = fit_subblocks(x, kFit, L, scales, mins);
  pack_q45_scales(scales, mins, largest, y.scales, y.d, y.dmin);
  for (int j = 0; j < kQK_K / 32; ++j) {
    uint8_t sc, m;
    scale_min_k4(j, y.scales, sc, m);
    requantize_asym(x + 32 * j, 32, h2f(y.d) * sc, h2f(y.dmin) * m, nmax, L + 32 * j);
  }
  // Low nibbles of 64 elements per 32 bytes: elements j..j+31 low, j+32..j+63 high.
  uint8_t* q = y.qs;
  uint8_t m1 = 1, m2 = 2;
  for (int j = 0; j < kQK_K; j += 64) {
    for (int l = 0; l < 32; ++l) {
      q[l] = static_cast<uint8_t>((L[j + l] & 0xF) | ((L[j + l + 32] & 0xF) << 4));
      if constexpr (kQ5) {
        if (L[j + l] > 15) y.qh[l] |= m1;
        if (L[j + l + 32] > 15) y.qh[l] |= m2;
      }
    }
    q += 32;
    m1 = static_cast<uint8_t>(m1 << 2);
    m2 = static_cast<uint8_t>(m2 << 2);
  }
}

void encode_q6_K(const float* x, block_q6_K& y) {
  int8_t L[kQK_K];
  float scales[kQK_K / 16];
  for (int ib = 0; ib < kQK_K / 16; ++ib)
    scales[ib] = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
  const SignedAbsMax largest = signed_absmax(scales, kQK_K / 16);
  if (largest.amax < kGroupMaxEps) return;  // an all-zero block: every code 0, scale 0
  const float iscale = -128.f / largest.max;
  y.d = f2h(1 / iscale);
  for (int ib = 0; ib < kQK_K / 16; ++ib)
    y.scales[ib] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[ib])));
  for (int j = 0; j < kQK_K / 16; ++j)
    requantize_sym(x + 16 * j, 16, h2f(y.d) * y.scales[j], 32, L + 16 * j);
  uint8_t* ql = y.ql;
  uint8_t* qh = y.qh;
  for (int j = 0; j < kQK_K; j += 128) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t q1 = L[j + l + 0] & 0xF;
      const uint8_t q2 = L[j + l + 32] & 0xF;
      const uint8_t q3 = L[j + l + 64] & 0xF;
      const uint8_t q4 = L[j + l + 96] & 0xF;
      ql[l + 0] = static_cast<uint8_t>(q1 | (q3 << 4));
      ql[l + 32] = static_cast<uint8_t>(q2 | (q4 << 4));
      qh[l] = static_cast<uint8_t>((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                                   ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6));
    }
    ql += 64;
    qh += 32;
  }
}

void encode_q8_K(const float* x, block_q8_K& y) {
  const SignedAbsMax m = signed_absmax(x, kQK_K);
  if (!m.amax) return;  // zeros: d = 0, codes and sums 0 (llama.cpp leaves bsums unset here)
  const float iscale = -127.f / m.max;
  for (int j = 0; j < kQK_K; ++j)
    y.qs[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * x[j])));
  for (int j = 0; j < kQK_K / 16; ++j) {
    int sum = 0;
    for (int ii = 0; ii < 16; ++ii) sum += y.qs[j * 16 + ii];
    y.bsums[j] = static_cast<int16_t>(sum);
  }
  y.d = 1 / iscale;
}

}  // namespace

void quantize_q2_K(std::span<const float> src, MutBytes dst) {
  encode_blocks<block_q2_K>(src, dst, encode_q2_K);
}
void quantize_q3_K(std::span<const float> src, MutBytes dst) {
  encode_blocks<block_q3_K>(src, dst, encode_q3_K);
}
void quantize_q4_K(std::span<const float> src, MutBytes dst) {
  encode_blocks<block_q4_K>(src, dst, encode_q45_K<block_q4_K>);
}
void quantize_q5_K(std::span<const float> src, MutBytes dst) {
  encode_blocks<block_q5_K>(src, dst, encode_q45_K<block_q5_K>);
}
void quantize_q6_K(std::span<const float> src, MutBytes dst) {
  encode_blocks<block_q6_K>(src, dst, encode_q6_K);
}
void quantize_q8_K(std::span<const float> src, MutBytes dst) {
  encode_blocks<block_q8_K>(src, dst, encode_q8_K);
}

}  // namespace kiln::quant::detail
