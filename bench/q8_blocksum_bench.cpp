// bench/q8_blocksum_bench.cpp: an experiment, not a kernel of kiln. The Q8_0 prefill kernel
// (src/backend/cpu/cpu_matmul_q8.cpp) keeps the plain kernel's float steps: per token, row and
// block, 8 int32 lane sums of 4 products, each converted and fma'd, so each vpdpbusd (two tokens'
// block) also costs a cvt and an fma, and vpdpbusd and fma share the multiply pipes. This times a
// replica of that inner loop ("lanes", DotQ8Vnni<4, 4>) against loops that change the float
// order (so they cannot be merged under the bit-identity rule: decode's plain kernel would have
// to change with them): 8 vpdpbusd build each block's exact 32-product sum, then one cvt, one
// multiply (dw * yd) and one fma per 16 (row, token) blocks. "blocksum": lanes are 4 rows x 4
// tokens (both operands replicated 4x: load-bound, slower); "rows16": lanes are 16 rows of one
// token (weights as they are, the token's dword a broadcast), RG x 16 rows x T tokens per
// register tile. Same sizes as a 512-token prefill on one 128-row block of a 2048-column
// matrix (dot loops only, packing not timed), 1 thread, thread CPU time, alternating inside each
// iteration, best of each; each result checked against a double reference.
//   build/release/bench/q8_blocksum_bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#if defined(__x86_64__)
// GCC 12 reports avx512fintrin.h's own _mm512_undefined_ps() placeholder inside
// _mm512_cvtepi32_ps as uninitialized when the intrinsic is inlined into a target("avx512f")
// function of a baseline-ISA file (a false positive: the value is never read).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

namespace {

#define KILN_BS_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma"), noinline))

double thread_cpu_s() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

constexpr int kRows = 128, kTok = 512, kNb = 64;  // one row block, 2048 columns

// Today's layout (cpu_matmul_q8.cpp): weights 64 B per row block (dwords twice), token tiles of
// 8 (4 pairs x 128 B per block: quants, then corrections), scales dw * yd per 4 rows x 8 tokens.
// Packed data as plain arrays of 16-lane vectors (loaded inside the target functions only, so
// nothing outside them needs AVX-512).
using Vecs = std::vector<int32_t>;
using FVecs = std::vector<float>;
struct Lanes {
  Vecs wq;                // [row][block] x 16
  std::vector<float> wd;  // [row][block]
  Vecs tq;                // [tile][block][pair][2] x 16
  std::vector<float> yd;  // [tile][block][8]
};
// The experiment's layout: 4-row groups x 4-token groups per 512-bit register (lane 4r + t).
struct BlockSum {
  Vecs wq;   // [row group][block][chunk] x 16: dword chunk of row r in lanes 4r..4r+3
  FVecs wd;  // [row group][block] x 16: dw of row r in lanes 4r..4r+3
  Vecs yq;   // [token group][block][chunk] x 16: dword chunk of token t in lanes 4r+t
  Vecs yc;   // [token group][block] x 16: -128 * sum of token t's block
  FVecs yd;  // [token group][block] x 16
};

struct Problem {
  std::vector<int8_t> w, y;   // [row][col], [token][col]
  std::vector<float> wd, yd;  // [row][block], [token][block]
};

Problem make_problem() {
  Problem p;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> q(-127, 127);
  std::uniform_real_distribution<float> s(0.001f, 0.02f);
  p.w.resize(kRows * kNb * 32);
  p.y.resize(kTok * kNb * 32);
  for (auto& v : p.w) v = static_cast<int8_t>(q(rng));
  for (auto& v : p.y) v = static_cast<int8_t>(q(rng));
  p.wd.resize(kRows * kNb);
  p.yd.resize(kTok * kNb);
  for (auto& v : p.wd) v = s(rng);
  for (auto& v : p.yd) v = s(rng);
  return p;
}

int32_t dword(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

Lanes pack_lanes(const Problem& p) {
  Lanes l;
  l.wq.resize(kRows * kNb * 16);
  l.wd = p.wd;
  for (int r = 0; r < kRows; ++r)
    for (int i = 0; i < kNb; ++i) {
      alignas(64) int32_t d[16];
      for (int k = 0; k < 16; ++k)
        d[k] = dword(&p.w[(r * kNb + i) * 32 + 4 * (k / 2)]) ^ int32_t(0x80808080);
      std::copy(d, d + 16, &l.wq[(r * kNb + i) * 16]);
    }
  l.tq.resize(kTok / 8 * kNb * 8 * 16);
  l.yd.resize(kTok / 8 * kNb * 8);
  for (int tt = 0; tt < kTok / 8; ++tt)
    for (int i = 0; i < kNb; ++i) {
      for (int pr = 0; pr < 4; ++pr) {
        alignas(64) int32_t d[16], c[16];
        for (int k = 0; k < 16; ++k) {
          const int t = tt * 8 + 2 * pr + (k & 1);
          const int8_t* src = &p.y[(t * kNb + i) * 32 + 4 * (k / 2)];
          d[k] = dword(src);
          c[k] = -128 * (src[0] + src[1] + src[2] + src[3]);
        }
        std::copy(d, d + 16, &l.tq[(((tt * kNb + i) * 4 + pr) * 2) * 16]);
        std::copy(c, c + 16, &l.tq[(((tt * kNb + i) * 4 + pr) * 2 + 1) * 16]);
      }
      for (int t = 0; t < 8; ++t) l.yd[(tt * kNb + i) * 8 + t] = p.yd[(tt * 8 + t) * kNb + i];
    }
  return l;
}

BlockSum pack_blocksum(const Problem& p) {
  BlockSum b;
  b.wq.resize(kRows / 4 * kNb * 8 * 16);
  b.wd.resize(kRows / 4 * kNb * 16);
  for (int g = 0; g < kRows / 4; ++g)
    for (int i = 0; i < kNb; ++i) {
      alignas(64) float dv[16];
      for (int k = 0; k < 16; ++k) dv[k] = p.wd[(g * 4 + k / 4) * kNb + i];
      std::copy(dv, dv + 16, &b.wd[(g * kNb + i) * 16]);
      for (int c = 0; c < 8; ++c) {
        alignas(64) int32_t d[16];
        for (int k = 0; k < 16; ++k)
          d[k] = dword(&p.w[((g * 4 + k / 4) * kNb + i) * 32 + 4 * c]) ^ int32_t(0x80808080);
        std::copy(d, d + 16, &b.wq[((g * kNb + i) * 8 + c) * 16]);
      }
    }
  b.yq.resize(kTok / 4 * kNb * 8 * 16);
  b.yc.resize(kTok / 4 * kNb * 16);
  b.yd.resize(kTok / 4 * kNb * 16);
  for (int h = 0; h < kTok / 4; ++h)
    for (int i = 0; i < kNb; ++i) {
      alignas(64) float dv[16];
      alignas(64) int32_t cv[16];
      for (int k = 0; k < 16; ++k) {
        const int t = h * 4 + k % 4;
        dv[k] = p.yd[t * kNb + i];
        int sum = 0;
        for (int e = 0; e < 32; ++e) sum += p.y[(t * kNb + i) * 32 + e];
        cv[k] = -128 * sum;
      }
      std::copy(dv, dv + 16, &b.yd[(h * kNb + i) * 16]);
      std::copy(cv, cv + 16, &b.yc[(h * kNb + i) * 16]);
      for (int c = 0; c < 8; ++c) {
        alignas(64) int32_t d[16];
        for (int k = 0; k < 16; ++k) d[k] = dword(&p.y[((h * 4 + k % 4) * kNb + i) * 32 + 4 * c]);
        std::copy(d, d + 16, &b.yq[((h * kNb + i) * 8 + c) * 16]);
      }
    }
  return b;
}

// Today's register tile, as DotQ8Vnni<4, 4> (scales a multiply per row and block ahead, then a
// 64-bit broadcast per pair): 4 rows x 8 tokens.
KILN_BS_TARGET void dot_lanes(const Lanes& l, float* out) {
  for (int tt = 0; tt < kTok / 8; ++tt) {
    for (int r0 = 0; r0 < kRows; r0 += 4) {
      __m512 acc[4][4];
      for (auto& a : acc)
        for (auto& v : a) v = _mm512_setzero_ps();
      for (int i = 0; i < kNb; ++i) {
        alignas(64) float s[4][8];
        const __m256 yd = _mm256_loadu_ps(&l.yd[(tt * kNb + i) * 8]);
        for (int r = 0; r < 4; ++r)
          _mm256_store_ps(s[r], _mm256_mul_ps(_mm256_set1_ps(l.wd[(r0 + r) * kNb + i]), yd));
        __m512i w[4];
        for (int r = 0; r < 4; ++r) w[r] = _mm512_loadu_si512(&l.wq[((r0 + r) * kNb + i) * 16]);
        const int32_t* ai = &l.tq[(tt * kNb + i) * 8 * 16];
        for (int p = 0; p < 4; ++p) {
          const __m512i y = _mm512_loadu_si512(ai + 2 * p * 16),
                        corr = _mm512_loadu_si512(ai + (2 * p + 1) * 16);
          for (int r = 0; r < 4; ++r) {
            const __m512i lanes = _mm512_dpbusd_epi32(corr, w[r], y);
            double pair;
            std::memcpy(&pair, &s[r][2 * p], 8);
            const __m512 sc = _mm512_castpd_ps(_mm512_set1_pd(pair));
            acc[r][p] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(lanes), acc[r][p]);
          }
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int p = 0; p < 4; ++p) {
          alignas(64) float v[16];  // even lanes token 2p, odd 2p + 1 (stands in for Hsum)
          _mm512_store_ps(v, acc[r][p]);
          float e = 0, o = 0;
          for (int k = 0; k < 16; k += 2) e += v[k], o += v[k + 1];
          out[(tt * 8 + 2 * p) * kRows + r0 + r] = e;
          out[(tt * 8 + 2 * p + 1) * kRows + r0 + r] = o;
        }
    }
  }
}

// The experiment's register tile: 8 rows (2 groups) x 16 tokens (4 groups); per block 64
// vpdpbusd, then 8 multiplies (dw * yd), 8 cvt and 8 fma.
KILN_BS_TARGET void dot_blocksum(const BlockSum& b, float* out) {
  for (int h0 = 0; h0 < kTok / 4; h0 += 4) {
    for (int g0 = 0; g0 < kRows / 4; g0 += 2) {
      __m512 acc[2][4];
      for (auto& a : acc)
        for (auto& v : a) v = _mm512_setzero_ps();
      for (int i = 0; i < kNb; ++i) {
        __m512i s[2][4];
        for (int h = 0; h < 4; ++h)
          s[0][h] = s[1][h] = _mm512_loadu_si512(&b.yc[((h0 + h) * kNb + i) * 16]);
        for (int c = 0; c < 8; ++c) {
          const __m512i w0 = _mm512_loadu_si512(&b.wq[((g0 * kNb + i) * 8 + c) * 16]);
          const __m512i w1 = _mm512_loadu_si512(&b.wq[(((g0 + 1) * kNb + i) * 8 + c) * 16]);
          for (int h = 0; h < 4; ++h) {
            const __m512i y = _mm512_loadu_si512(&b.yq[(((h0 + h) * kNb + i) * 8 + c) * 16]);
            s[0][h] = _mm512_dpbusd_epi32(s[0][h], w0, y);
            s[1][h] = _mm512_dpbusd_epi32(s[1][h], w1, y);
          }
        }
        for (int g = 0; g < 2; ++g) {
          const __m512 wd = _mm512_loadu_ps(&b.wd[((g0 + g) * kNb + i) * 16]);
          for (int h = 0; h < 4; ++h)
            acc[g][h] = _mm512_fmadd_ps(
                _mm512_mul_ps(wd, _mm512_loadu_ps(&b.yd[((h0 + h) * kNb + i) * 16])),
                _mm512_cvtepi32_ps(s[g][h]), acc[g][h]);
        }
      }
      for (int g = 0; g < 2; ++g)
        for (int h = 0; h < 4; ++h) {
          alignas(64) float v[16];
          _mm512_store_ps(v, acc[g][h]);
          for (int k = 0; k < 16; ++k)
            out[((h0 + h) * 4 + k % 4) * kRows + (g0 + g) * 4 + k / 4] = v[k];
        }
    }
  }
}

// The experiment's second layout: lanes are 16 rows of one token (weights as they are, one dword
// chunk of 16 rows per vector; the token's chunk an embedded 4-byte broadcast).
struct Rows16 {
  Vecs wq;   // [row group of 16][block][chunk] x 16
  FVecs wd;  // [row group][block] x 16
  Vecs yq;   // [token][block][chunk]: the quants as dwords
  Vecs yc;   // [token][block]: -128 * sum of the block
  FVecs yd;  // [token][block]
};

Rows16 pack_rows16(const Problem& p) {
  Rows16 b;
  b.wq.resize(kRows / 16 * kNb * 8 * 16);
  b.wd.resize(kRows / 16 * kNb * 16);
  for (int g = 0; g < kRows / 16; ++g)
    for (int i = 0; i < kNb; ++i) {
      for (int k = 0; k < 16; ++k) b.wd[(g * kNb + i) * 16 + k] = p.wd[(g * 16 + k) * kNb + i];
      for (int c = 0; c < 8; ++c)
        for (int k = 0; k < 16; ++k)
          b.wq[((g * kNb + i) * 8 + c) * 16 + k] =
              dword(&p.w[((g * 16 + k) * kNb + i) * 32 + 4 * c]) ^ int32_t(0x80808080);
    }
  b.yq.resize(kTok * kNb * 8);
  b.yc.resize(kTok * kNb);
  b.yd = p.yd;
  for (int t = 0; t < kTok; ++t)
    for (int i = 0; i < kNb; ++i) {
      int sum = 0;
      for (int e = 0; e < 32; ++e) sum += p.y[(t * kNb + i) * 32 + e];
      b.yc[t * kNb + i] = -128 * sum;
      for (int c = 0; c < 8; ++c)
        b.yq[(t * kNb + i) * 8 + c] = dword(&p.y[(t * kNb + i) * 32 + 4 * c]);
    }
  return b;
}

// RG x 16 rows x T tokens; tokens [0, kTok / T * T).
template <int RG, int T>
KILN_BS_TARGET void dot_rows16(const Rows16& b, float* out) {
  for (int t0 = 0; t0 + T <= kTok; t0 += T) {
    for (int g0 = 0; g0 < kRows / 16; g0 += RG) {
      __m512 acc[RG][T];
      for (auto& a : acc)
        for (auto& v : a) v = _mm512_setzero_ps();
      for (int i = 0; i < kNb; ++i) {
        __m512i s[RG][T];
        for (int t = 0; t < T; ++t) {
          const __m512i c = _mm512_set1_epi32(b.yc[(t0 + t) * kNb + i]);
          for (int g = 0; g < RG; ++g) s[g][t] = c;
        }
        for (int c = 0; c < 8; ++c) {
          __m512i w[RG];
          for (int g = 0; g < RG; ++g)
            w[g] = _mm512_loadu_si512(&b.wq[(((g0 + g) * kNb + i) * 8 + c) * 16]);
          for (int t = 0; t < T; ++t) {
            const __m512i y = _mm512_set1_epi32(b.yq[((t0 + t) * kNb + i) * 8 + c]);
            for (int g = 0; g < RG; ++g) s[g][t] = _mm512_dpbusd_epi32(s[g][t], w[g], y);
          }
        }
        for (int g = 0; g < RG; ++g) {
          const __m512 wd = _mm512_loadu_ps(&b.wd[((g0 + g) * kNb + i) * 16]);
          for (int t = 0; t < T; ++t)
            acc[g][t] = _mm512_fmadd_ps(_mm512_mul_ps(wd, _mm512_set1_ps(b.yd[(t0 + t) * kNb + i])),
                                        _mm512_cvtepi32_ps(s[g][t]), acc[g][t]);
        }
      }
      for (int g = 0; g < RG; ++g)
        for (int t = 0; t < T; ++t)
          _mm512_storeu_ps(&out[(t0 + t) * kRows + (g0 + g) * 16], acc[g][t]);
    }
  }
}

template <int RG, int T>
void BM_Q8Rows16VsLanes(benchmark::State& state) {
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) {
    state.SkipWithError("needs AVX-512 VNNI");
    return;
  }
  const Problem p = make_problem();
  const Lanes l = pack_lanes(p);
  const Rows16 b = pack_rows16(p);
  std::vector<float> out_l(kTok * kRows), out_b(kTok * kRows);
  double best_l = 1e30, best_b = 1e30;
  for (auto _ : state) {
    const double t0 = thread_cpu_s();
    dot_rows16<RG, T>(b, out_b.data());
    benchmark::DoNotOptimize(out_b.data());
    const double t1 = thread_cpu_s();
    dot_lanes(l, out_l.data());
    benchmark::DoNotOptimize(out_l.data());
    const double t2 = thread_cpu_s();
    best_b = std::min(best_b, t1 - t0);
    best_l = std::min(best_l, t2 - t1);
  }
  double worst = 0;
  for (int t = 0; t < kTok / T * T; t += 7)
    for (int r = 0; r < kRows; r += 3) {
      double ref = 0;
      for (int i = 0; i < kNb; ++i) {
        long s = 0;
        for (int e = 0; e < 32; ++e)
          s += long(p.w[(r * kNb + i) * 32 + e]) * p.y[(t * kNb + i) * 32 + e];
        ref += double(p.wd[r * kNb + i]) * p.yd[t * kNb + i] * double(s);
      }
      worst = std::max(worst, std::fabs(out_b[t * kRows + r] - ref) / (1 + std::fabs(ref)));
    }
  if (worst > 1e-4) state.SkipWithError("the experiment computes the wrong dot");
  const double macs_b = double(kRows) * (kTok / T * T) * kNb * 32,
               macs_l = double(kRows) * kTok * kNb * 32;
  state.counters["rows16_GMAC/s"] = macs_b / best_b * 1e-9;
  state.counters["lanes_GMAC/s"] = macs_l / best_l * 1e-9;
  state.counters["speedup"] = (macs_b / best_b) / (macs_l / best_l);
  state.counters["max_rel_err"] = worst;
}
BENCHMARK(BM_Q8Rows16VsLanes<1, 8>)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_Q8Rows16VsLanes<2, 4>)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_Q8Rows16VsLanes<2, 6>)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_Q8Rows16VsLanes<1, 12>)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_Q8Rows16VsLanes<4, 2>)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);
BENCHMARK(BM_Q8Rows16VsLanes<4, 3>)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);

bool has_vnni() {
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
}

void BM_Q8BlockSumVsLanes(benchmark::State& state) {
  if (!has_vnni()) {
    state.SkipWithError("needs AVX-512 VNNI");
    return;
  }
  const Problem p = make_problem();
  const Lanes l = pack_lanes(p);
  const BlockSum b = pack_blocksum(p);
  std::vector<float> out_l(kTok * kRows), out_b(kTok * kRows);
  double best_l = 1e30, best_b = 1e30;
  for (auto _ : state) {
    const double t0 = thread_cpu_s();
    dot_blocksum(b, out_b.data());
    benchmark::DoNotOptimize(out_b.data());
    const double t1 = thread_cpu_s();
    dot_lanes(l, out_l.data());
    benchmark::DoNotOptimize(out_l.data());
    const double t2 = thread_cpu_s();
    best_b = std::min(best_b, t1 - t0);
    best_l = std::min(best_l, t2 - t1);
  }
  // Both are the same dot (different float order): check the experiment computes it.
  double worst = 0;
  for (int t = 0; t < kTok; t += 8)
    for (int r = 0; r < kRows; ++r) {
      double ref = 0;
      for (int i = 0; i < kNb; ++i) {
        long s = 0;
        for (int e = 0; e < 32; ++e)
          s += long(p.w[(r * kNb + i) * 32 + e]) * p.y[(t * kNb + i) * 32 + e];
        ref += double(p.wd[r * kNb + i]) * p.yd[t * kNb + i] * double(s);
      }
      worst = std::max(worst, std::fabs(out_b[t * kRows + r] - ref) / (1 + std::fabs(ref)));
      worst = std::max(worst, std::fabs(out_l[t * kRows + r] - ref) / (1 + std::fabs(ref)));
    }
  if (worst > 1e-4) state.SkipWithError("a kernel computes the wrong dot");
  const double macs = double(kRows) * kTok * kNb * 32;
  state.counters["blocksum_us"] = best_b * 1e6;
  state.counters["lanes_us"] = best_l * 1e6;
  state.counters["speedup"] = best_l / best_b;
  state.counters["blocksum_GMAC/s"] = macs / best_b * 1e-9;
  state.counters["lanes_GMAC/s"] = macs / best_l * 1e-9;
  state.counters["max_rel_err"] = worst;
}
BENCHMARK(BM_Q8BlockSumVsLanes)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(1.0);

}  // namespace
#endif
