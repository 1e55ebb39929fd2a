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

int64_t n_superblocks(size_t n) {
  KILN_CHECK(n % kQK_K == 0, "row of {} elements is not a multiple of {}", n, kQK_K);
  return static_cast<int64_t>(n / kQK_K);
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
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    float diff = scale * L[i] + min - x[i];
    diff = use_mad ? std::fabs(diff) : diff * diff;
    const float w = weights[i];
    best_error += w * diff;
  }
  if (nstep < 1) {
    *the_min = -min;
    return scale;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * (x[i] - min));
      l = std::max(0, std::min(nmax, l));
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
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * Laux[i] + this_min - x[i];
        diff = use_mad ? std::fabs(diff) : diff * diff;
        const float w = weights[i];
        cur_error += w * diff;
      }
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

// Symmetric search for Q3_K: L in [-nmax, nmax-1] stored +nmax; with do_rmse, coordinate
// descent on each code under x^2 weights.
float make_q3_quants(int n, int nmax, const float* x, int8_t* L, bool do_rmse) {
  float max = 0;
  float amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (!amax) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  const float iscale = -nmax / max;
  if (do_rmse) {
    float sumlx = 0;
    float suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * x[i]);
      l = std::max(-nmax, std::min(nmax - 1, l));
      L[i] = static_cast<int8_t>(l);
      const float w = x[i] * x[i];
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; ++itry) {
      int n_changed = 0;
      for (int i = 0; i < n; ++i) {
        const float w = x[i] * x[i];
        float slx = sumlx - w * x[i] * L[i];
        if (slx > 0) {
          float sl2 = suml2 - w * L[i] * L[i];
          int new_l = nearest_int(x[i] * sl2 / slx);
          new_l = std::max(-nmax, std::min(nmax - 1, new_l));
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
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = std::max(-nmax, std::min(nmax - 1, l));
    L[i] = static_cast<int8_t>(l + nmax);
  }
  return 1 / iscale;
}

// Symmetric search for Q6_K (rmse_type 1: x^2 weights, no importance): 19 candidate scales
// around -nmax / max, keeping the best weighted least-squares fit.
float make_qx_quants(int n, int nmax, const float* x, int8_t* L) {
  float max = 0;
  float amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  float iscale = -nmax / max;
  float sumlx = 0;
  float suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = nearest_int(iscale * x[i]);
    l = std::max(-nmax, std::min(nmax - 1, l));
    L[i] = static_cast<int8_t>(l + nmax);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = nearest_int(iscale * x[i]);
      l = std::max(-nmax, std::min(nmax - 1, l));
      const float w = x[i] * x[i];
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) {
        const int l = nearest_int(iscale * x[i]);
        L[i] = static_cast<int8_t>(nmax + std::max(-nmax, std::min(nmax - 1, l)));
      }
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Packs 2-bit codes the way Q2_K/Q3_K store them: byte l of each 32-byte group holds
// elements l, l+32, l+64, l+96 of its 128-element half.
void pack_2bit(const uint8_t* L, uint8_t* qs) {
  for (int j = 0; j < kQK_K; j += 128)
    for (int l = 0; l < 32; ++l)
      qs[j / 4 + l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 2) |
                                           (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

// Q4_K/Q5_K sub-block fits: weights = rms + |x| per element, as the reference uses.
void fit_q45_subblocks(const float* x, int nmax, float rmin, int nstep, uint8_t* L,
                       float* scales, float* mins, float& max_scale, float& max_min) {
  float weights[32];
  uint8_t Laux[32];
  max_scale = 0;
  max_min = 0;
  for (int j = 0; j < kQK_K / 32; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux,
                                 rmin, 0.1f, nstep, false);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
}

// Writes the 6-bit scales/mins into Q4_K/Q5_K's 12 bytes, then re-derives each element's
// code from the rounded scales (what the decoder will actually use).
void pack_q45_scales_and_requantize(const float* x, int nmax, const float* scales,
                                    const float* mins, float max_scale, float max_min,
                                    uint8_t packed[12], f16& d_out, f16& dmin_out, uint8_t* L) {
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
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
  d_out = f2h(max_scale / 63.f);
  dmin_out = f2h(max_min / 63.f);
  for (int j = 0; j < kQK_K / 32; ++j) {
    uint8_t sc, m;
    if (j < 4) {
      sc = packed[j] & 63;
      m = packed[j + 4] & 63;
    } else {
      sc = static_cast<uint8_t>((packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4));
      m = static_cast<uint8_t>((packed[j + 4] >> 4) | ((packed[j] >> 6) << 4));
    }
    const float d = h2f(d_out) * sc;
    if (!d) continue;
    const float dm = h2f(dmin_out) * m;
    for (int ii = 0; ii < 32; ++ii) {
      int l = nearest_int((x[32 * j + ii] + dm) / d);
      L[32 * j + ii] = static_cast<uint8_t>(std::max(0, std::min(nmax, l)));
    }
  }
}

}  // namespace

void quantize_q2_K(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_superblocks(src.size());
  constexpr float q2_scale = 15.f;
  uint8_t L[kQK_K];
  uint8_t Laux[16];
  float weights[16];
  float mins[kQK_K / 16];
  float scales[kQK_K / 16];
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK_K;
    block_q2_K y{};
    if (!all_finite(x, kQK_K)) {
      y.d = y.dmin = nan_f16();
      store_block(dst, i, y);
      continue;
    }
    float max_scale = 0;
    float max_min = 0;
    for (int j = 0; j < kQK_K / 16; ++j) {
      for (int l = 0; l < 16; ++l) weights[l] = std::fabs(x[16 * j + l]);
      scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux, -0.5f,
                                   0.1f, 15, true);
      if (scales[j] > max_scale) max_scale = scales[j];
      if (mins[j] > max_min) max_min = mins[j];
    }
    if (max_scale > 0) {
      const float iscale = q2_scale / max_scale;
      for (int j = 0; j < kQK_K / 16; ++j)
        y.scales[j] = static_cast<uint8_t>(nearest_int(iscale * scales[j]));
      y.d = f2h(max_scale / q2_scale);
    } else {
      for (int j = 0; j < kQK_K / 16; ++j) y.scales[j] = 0;
      y.d = f2h(0.f);
    }
    if (max_min > 0) {
      const float iscale = q2_scale / max_min;
      for (int j = 0; j < kQK_K / 16; ++j)
        y.scales[j] |= static_cast<uint8_t>(nearest_int(iscale * mins[j]) << 4);
      y.dmin = f2h(max_min / q2_scale);
    } else {
      y.dmin = f2h(0.f);
    }
    for (int j = 0; j < kQK_K / 16; ++j) {
      const float d = h2f(y.d) * (y.scales[j] & 0xF);
      if (!d) continue;
      const float dm = h2f(y.dmin) * (y.scales[j] >> 4);
      for (int ii = 0; ii < 16; ++ii) {
        const int l = nearest_int((x[16 * j + ii] + dm) / d);
        L[16 * j + ii] = static_cast<uint8_t>(std::max(0, std::min(3, l)));
      }
    }
    pack_2bit(L, y.qs);
    store_block(dst, i, y);
  }
}

void quantize_q3_K(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_superblocks(src.size());
  int8_t L[kQK_K];
  float scales[kQK_K / 16];
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK_K;
    block_q3_K y{};
    if (!all_finite(x, kQK_K)) {
      y.d = nan_f16();
      store_block(dst, i, y);
      continue;
    }
    float max_scale = 0;
    float amax = 0;
    for (int j = 0; j < kQK_K / 16; ++j) {
      scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j, true);
      const float scale = std::fabs(scales[j]);
      if (scale > amax) {
        amax = scale;
        max_scale = scales[j];
      }
    }
    std::memset(y.scales, 0, 12);
    if (max_scale) {
      const float iscale = -32.f / max_scale;
      for (int j = 0; j < kQK_K / 16; ++j) {
        int l = nearest_int(iscale * scales[j]);
        l = std::max(-32, std::min(31, l)) + 32;
        if (j < 8) y.scales[j] = static_cast<uint8_t>(l & 0xF);
        else y.scales[j - 8] |= static_cast<uint8_t>((l & 0xF) << 4);
        l >>= 4;
        y.scales[j % 4 + 8] |= static_cast<uint8_t>(l << (2 * (j / 4)));
      }
      y.d = f2h(1 / iscale);
    } else {
      y.d = f2h(0.f);
    }
    for (int j = 0; j < kQK_K / 16; ++j) {
      int sc = j < 8 ? y.scales[j] & 0xF : y.scales[j - 8] >> 4;
      sc = (sc | (((y.scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
      const float d = h2f(y.d) * sc;
      if (!d) continue;
      for (int ii = 0; ii < 16; ++ii) {
        int l = nearest_int(x[16 * j + ii] / d);
        l = std::max(-4, std::min(3, l));
        L[16 * j + ii] = static_cast<int8_t>(l + 4);
      }
    }
    std::memset(y.hmask, 0, sizeof(y.hmask));
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
    uint8_t Lu[kQK_K];
    for (int j = 0; j < kQK_K; ++j) Lu[j] = static_cast<uint8_t>(L[j]);
    pack_2bit(Lu, y.qs);
    store_block(dst, i, y);
  }
}

void quantize_q4_K(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_superblocks(src.size());
  uint8_t L[kQK_K];
  float mins[kQK_K / 32];
  float scales[kQK_K / 32];
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK_K;
    block_q4_K y{};
    if (!all_finite(x, kQK_K)) {
      y.d = y.dmin = nan_f16();
      store_block(dst, i, y);
      continue;
    }
    float max_scale, max_min;
    fit_q45_subblocks(x, 15, -1.f, 20, L, scales, mins, max_scale, max_min);
    pack_q45_scales_and_requantize(x, 15, scales, mins, max_scale, max_min, y.scales, y.d,
                                   y.dmin, L);
    uint8_t* q = y.qs;
    for (int j = 0; j < kQK_K; j += 64) {
      for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(L[j + l] | (L[j + l + 32] << 4));
      q += 32;
    }
    store_block(dst, i, y);
  }
}

void quantize_q5_K(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_superblocks(src.size());
  uint8_t L[kQK_K];
  float mins[kQK_K / 32];
  float scales[kQK_K / 32];
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK_K;
    block_q5_K y{};
    if (!all_finite(x, kQK_K)) {
      y.d = y.dmin = nan_f16();
      store_block(dst, i, y);
      continue;
    }
    float max_scale, max_min;
    fit_q45_subblocks(x, 31, -0.5f, 15, L, scales, mins, max_scale, max_min);
    pack_q45_scales_and_requantize(x, 31, scales, mins, max_scale, max_min, y.scales, y.d,
                                   y.dmin, L);
    uint8_t* ql = y.qs;
    std::memset(y.qh, 0, sizeof(y.qh));
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < kQK_K; n += 64) {
      for (int j = 0; j < 32; ++j) {
        int l1 = L[n + j];
        if (l1 > 15) {
          l1 -= 16;
          y.qh[j] |= m1;
        }
        int l2 = L[n + j + 32];
        if (l2 > 15) {
          l2 -= 16;
          y.qh[j] |= m2;
        }
        ql[j] = static_cast<uint8_t>(l1 | (l2 << 4));
      }
      m1 = static_cast<uint8_t>(m1 << 2);
      m2 = static_cast<uint8_t>(m2 << 2);
      ql += 32;
    }
    store_block(dst, i, y);
  }
}

void quantize_q6_K(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_superblocks(src.size());
  int8_t L[kQK_K];
  float scales[kQK_K / 16];
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK_K;
    block_q6_K y{};
    if (!all_finite(x, kQK_K)) {
      y.d = nan_f16();
      store_block(dst, i, y);
      continue;
    }
    float max_scale = 0;
    float max_abs_scale = 0;
    for (int ib = 0; ib < kQK_K / 16; ++ib) {
      const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
      scales[ib] = scale;
      const float abs_scale = std::fabs(scale);
      if (abs_scale > max_abs_scale) {
        max_abs_scale = abs_scale;
        max_scale = scale;
      }
    }
    if (max_abs_scale < kGroupMaxEps) {
      y.d = f2h(0.f);  // an all-zero block: every code 0, scale 0
      store_block(dst, i, y);
      continue;
    }
    const float iscale = -128.f / max_scale;
    y.d = f2h(1 / iscale);
    for (int ib = 0; ib < kQK_K / 16; ++ib)
      y.scales[ib] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[ib])));
    for (int j = 0; j < kQK_K / 16; ++j) {
      const float d = h2f(y.d) * y.scales[j];
      if (!d) continue;
      for (int ii = 0; ii < 16; ++ii) {
        int l = nearest_int(x[16 * j + ii] / d);
        l = std::max(-32, std::min(31, l));
        L[16 * j + ii] = static_cast<int8_t>(l + 32);
      }
    }
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
    store_block(dst, i, y);
  }
}

void quantize_q8_K(std::span<const float> src, MutBytes dst) {
  const int64_t nb = n_superblocks(src.size());
  for (int64_t i = 0; i < nb; ++i) {
    const float* x = src.data() + i * kQK_K;
    block_q8_K y{};
    if (!all_finite(x, kQK_K)) {
      y.d = std::nanf("");
      store_block(dst, i, y);
      continue;
    }
    float max = 0;
    float amax = 0;
    for (int j = 0; j < kQK_K; ++j) {
      const float ax = std::fabs(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    if (!amax) {  // zeros: d = 0, codes and sums 0 (llama.cpp leaves bsums unset here)
      store_block(dst, i, y);
      continue;
    }
    const float iscale = -127.f / max;
    for (int j = 0; j < kQK_K; ++j) {
      const int v = nearest_int(iscale * x[j]);
      y.qs[j] = static_cast<int8_t>(std::min(127, v));
    }
    for (int j = 0; j < kQK_K / 16; ++j) {
      int sum = 0;
      for (int ii = 0; ii < 16; ++ii) sum += y.qs[j * 16 + ii];
      y.bsums[j] = static_cast<int16_t>(sum);
    }
    y.d = 1 / iscale;
    store_block(dst, i, y);
  }
}

}  // namespace kiln::quant::detail
