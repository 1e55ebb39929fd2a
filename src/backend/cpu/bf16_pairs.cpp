// backend/cpu/bf16_pairs.cpp: the scalar oracle of the BF16 pair arithmetic (bf16_pairs.h).
#include "bf16_pairs.h"

#include <cmath>
#include <initializer_list>

namespace kiln::cpu {
namespace {

// A denormal read or written as zero of its sign (vdpbf16ps: DAZ in, FTZ out).
float flush(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }

// acc + a * b: the product is exact in f32 (8-bit significands), so one rounding, as std::fma.
float step(float acc, bf16 a, bf16 b) {
  return flush(std::fma(flush(bf16_to_f32(a)), flush(bf16_to_f32(b)), flush(acc)));
}

}  // namespace

void round_bf16_row_ref(const float* x, int64_t n, bf16* xb) {
  int64_t i = 0;
  for (; i < n; ++i) xb[i] = f32_to_bf16(x[i]);
  for (; i < pairs_padded(n); ++i) xb[i] = bf16{0};
}

float dot_bf16_pairs_ref(const bf16* w, const bf16* xb, int64_t n) {
  constexpr int kLanes = static_cast<int>(kPairChunk / 2);
  float acc[2][kLanes] = {};
  for (int64_t c = 0; c * kPairChunk < n; ++c) {
    float* a = acc[c % 2];
    for (int j = 0; j < kLanes; ++j) {
      for (int64_t e : {2 * j + 1, 2 * j}) {
        const int64_t i = c * kPairChunk + e;
        a[j] = step(a[j], i < n ? w[i] : bf16{0}, xb[i]);
      }
    }
  }
  float v[kLanes];
  for (int j = 0; j < kLanes; ++j) v[j] = acc[0][j] + acc[1][j];
  for (int half = kLanes / 2; half >= 1; half /= 2)
    for (int j = 0; j < half; ++j) v[j] = v[j] + v[j + half];
  return v[0];
}

}  // namespace kiln::cpu
