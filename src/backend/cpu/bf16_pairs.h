// backend/cpu/bf16_pairs.h: the arithmetic of BF16 weights on machines with AVX-512 BF16, and
// its scalar oracle. There BF16 weights are dotted as llama.cpp dots them (its BF16 activation
// type is BF16 on every machine): each activation rounded to bf16 (core/half.h f32_to_bf16), two
// products per f32 lane per vdpbf16ps. Prefill of f32 FMAs from converted weights was at this
// core's FMA peak and half of what two products per lane allow (docs/BENCHMARKS.md, session 37).
//
// The order every kernel of it follows (float_dot-inl.h DotPairsBlock, cpu_matmul_float.cpp's
// tiles) and dot_bf16_pairs_ref computes: the row and the activations zero-padded to whole chunks
// of kPairChunk; chunk c into accumulator c % 2 (16 f32 lanes each); within a chunk lane j adds
// the product of elements 2j + 1, then of 2j, each step one FMA (the product of two bf16 is exact
// in f32) with denormal inputs read as zero and a denormal result flushed to zero, as the
// instruction is defined; then acc0 + acc1 lane by lane and the halves folded 16 -> 8 -> 4 -> 2
// -> 1 (lane l + lane l + half). Machines without it keep the f32 arithmetic of DotTile.
#pragma once

#include <cstdint>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "core/half.h"

namespace kiln::cpu {

inline constexpr int64_t kPairChunk = 32;
inline int64_t pairs_padded(int64_t n) { return (n + kPairChunk - 1) / kPairChunk * kPairChunk; }

// AVX512_BF16: CPUID.(7,1):EAX bit 5. Highway's AVX3_DL target does not require it.
inline bool HasAvx512Bf16() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool bf16 = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) == 0) return false;
    return (a & (1u << 5)) != 0;
  }();
  return bf16;
#else
  return false;
#endif
}

// x[0, n) rounded to bf16 into xb[0, pairs_padded(n)), zeros after n.
void round_bf16_row_ref(const float* x, int64_t n, bf16* xb);
// The dot of n weights w against bf16 activations xb (pairs_padded(n) of them, zeros after n)
// in the order above, one scalar step at a time: the oracle of the vector kernels, and what the
// portable path runs on these machines.
float dot_bf16_pairs_ref(const bf16* w, const bf16* xb, int64_t n);

}  // namespace kiln::cpu
