// bench/packed_decode_bench.cpp: an experiment for issue 32's decode gap, not a kernel kiln runs.
// Would a Q8_0 matrix packed once at load time in the 16-row layout that MatmulQ8Vnni builds per
// call (16 rows side by side, 4 quants of a row per dword, w + 128 as u8; the 16 rows' f16
// scales beside each block) decode faster than the one-token kernel on the file's row-major
// blocks? Here a prototype one-token kernel on such a packing: per block, 8 vpdpbusd of 64-byte
// chunks against the token's broadcast dwords give 16 rows' exact block totals with no
// reduction, then the plain kernel's float steps (dy = dw * yd; fma(dy, float(total), acc) in
// block order), so its output must be kiln's bits: checked first, on every shape. Then both
// are timed on one thread, alternated, best of many: a matrix that stays in L2 (compute) and
// ones larger than L3 (from memory), and the two-thread case by splitting rows. What it found
// and why no packed copy was taken: docs/BENCHMARKS.md, session 32.
//   build/release/bench/packed_decode_bench
// Needs AVX-512 VNNI; prints why and exits 0 elsewhere.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/cpu_matmul_q8.h"
#include "backend/cpu/kernels.h"
#include "core/half.h"
#include "quant/blocks.h"

namespace {
using namespace kiln;
using namespace kiln::cpu;

constexpr int kGroup = 16;                                     // rows per packed group
constexpr size_t kChunk = 64;                                  // one dword of 16 rows
constexpr size_t kGroupBlock = 8 * kChunk;                     // 32 quants x 16 rows
constexpr size_t kGroupBlockBytes = kGroupBlock + 2 * kGroup;  // + 16 f16 scales

// Row-major Q8_0 rows [g * 16, +16) into the packed group: for block i, chunk k holds
// bytes 4k..4k+3 of each row's quants (row r at 4r), XOR 0x80; then the 16 scales.
void pack_group(const std::byte* rows, size_t row_bytes, int64_t nb, std::byte* out) {
  for (int64_t i = 0; i < nb; ++i) {
    std::byte* o = out + i * kGroupBlockBytes;
    for (int r = 0; r < kGroup; ++r) {
      const auto* b = reinterpret_cast<const quant::block_q8_0*>(rows + r * row_bytes) + i;
      for (int k = 0; k < 8; ++k)
        for (int j = 0; j < 4; ++j)
          o[k * kChunk + 4 * r + j] =
              static_cast<std::byte>(static_cast<uint8_t>(b->qs[4 * k + j]) ^ 0x80);
      std::memcpy(o + kGroupBlock + 2 * r, &b->d, 2);
    }
  }
}

// One token through packed groups [g0, g1): y[16 g + r].
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void dot_packed(
    const std::byte* packed, int64_t nb, const ActQ8_0* ys, const int32_t* ybias, int64_t g0,
    int64_t g1, float* y) {
  for (int64_t g = g0; g < g1; ++g) {
    const std::byte* p = packed + g * nb * kGroupBlockBytes;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; ++i, p += kGroupBlockBytes) {
      __builtin_prefetch(p + 4096, 0, 3);
      __builtin_prefetch(p + 4096 + 64 * 4, 0, 3);
      const auto* yq = reinterpret_cast<const int32_t*>(ys[i].qs);
      // Four chains of two: the totals are exact int32 sums, so their grouping changes nothing.
      __m512i t0 =
          _mm512_dpbusd_epi32(_mm512_set1_epi32(ybias[i]), _mm512_loadu_si512(p + 0 * kChunk),
                              _mm512_set1_epi32(yq[0]));
      __m512i t1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(p + 1 * kChunk),
                                       _mm512_set1_epi32(yq[1]));
      __m512i t2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(p + 2 * kChunk),
                                       _mm512_set1_epi32(yq[2]));
      __m512i t3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(p + 3 * kChunk),
                                       _mm512_set1_epi32(yq[3]));
      t0 = _mm512_dpbusd_epi32(t0, _mm512_loadu_si512(p + 4 * kChunk), _mm512_set1_epi32(yq[4]));
      t1 = _mm512_dpbusd_epi32(t1, _mm512_loadu_si512(p + 5 * kChunk), _mm512_set1_epi32(yq[5]));
      t2 = _mm512_dpbusd_epi32(t2, _mm512_loadu_si512(p + 6 * kChunk), _mm512_set1_epi32(yq[6]));
      t3 = _mm512_dpbusd_epi32(t3, _mm512_loadu_si512(p + 7 * kChunk), _mm512_set1_epi32(yq[7]));
      const __m512i tot = _mm512_add_epi32(_mm512_add_epi32(t0, t1), _mm512_add_epi32(t2, t3));
      const __m512 dw =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kGroupBlock)));
      const __m512 dy = _mm512_mul_ps(dw, _mm512_set1_ps(ys[i].d));
      acc = _mm512_fmadd_ps(dy, _mm512_cvtepi32_ps(tot), acc);
    }
    _mm512_storeu_ps(y + g * kGroup, acc);
  }
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best seconds of `reps` calls of f (f splits its rows over threads itself).
template <class F>
double best_of(int reps, F&& f) {
  double best = 1e30;
  for (int k = 0; k < reps; ++k) {
    const double t0 = now_s();
    f();
    best = std::min(best, now_s() - t0);
  }
  return best;
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) {
    std::printf("packed_decode_bench: this machine has no AVX-512 VNNI; nothing to measure\n");
    return 0;
  }
  struct Shape {
    int64_t rows, cols;
    int threads, reps;
  };
  const Shape shapes[] = {{64, 2048, 1, 4000},  {8192, 2048, 1, 60}, {32768, 2048, 1, 20},
                          {32768, 2048, 2, 20}, {5632, 2048, 1, 80}, {2048, 8192, 1, 80}};
  std::mt19937_64 rng(7);
  for (const Shape& s : shapes) {
    const int64_t nb = s.cols / 32;
    const size_t rb = static_cast<size_t>(nb) * sizeof(quant::block_q8_0);
    std::vector<std::byte> bytes(rb * s.rows);
    for (auto& b : bytes) b = static_cast<std::byte>(rng());
    for (int64_t r = 0; r < s.rows; ++r)
      for (int64_t i = 0; i < nb; ++i) {
        auto* b = reinterpret_cast<quant::block_q8_0*>(bytes.data() + r * rb) + i;
        b->d = f32_to_f16(0.001f * static_cast<float>(1 + rng() % 50));
      }
    const WeightMatrix w{
        .dtype = DType::Q8_0, .n_cols = s.cols, .n_rows = s.rows, .row_bytes = rb, .bytes = bytes};
    std::vector<std::byte> packed(static_cast<size_t>(s.rows / kGroup) * nb * kGroupBlockBytes);
    for (int64_t g = 0; g < s.rows / kGroup; ++g)
      pack_group(bytes.data() + g * kGroup * rb, rb, nb, packed.data() + g * nb * kGroupBlockBytes);
    std::vector<float> x(s.cols);
    std::normal_distribution<float> nd;
    for (float& v : x) v = nd(rng);
    std::vector<std::byte> xq(act_row_bytes(ActKind::Q8_0, s.cols));
    quantize_act_row(ActKind::Q8_0, x.data(), s.cols, xq.data(), false);
    const auto* ys = reinterpret_cast<const ActQ8_0*>(xq.data());
    std::vector<int32_t> ybias(nb);
    for (int64_t i = 0; i < nb; ++i) {
      int32_t sum = 0;
      for (int j = 0; j < 32; ++j) sum += ys[i].qs[j];
      ybias[i] = -128 * sum;
    }
    auto be = make_cpu_backend({.threads = s.threads});
    std::vector<float> y_kiln(s.rows), y_packed(s.rows);
    be->matmul(w, x, 1, y_kiln);
    const int64_t groups = s.rows / kGroup;
    const auto run_packed = [&] {
      if (s.threads == 1)
        return dot_packed(packed.data(), nb, ys, ybias.data(), 0, groups, y_packed.data());
      std::thread other([&] {
        dot_packed(packed.data(), nb, ys, ybias.data(), groups / 2, groups, y_packed.data());
      });
      dot_packed(packed.data(), nb, ys, ybias.data(), 0, groups / 2, y_packed.data());
      other.join();
    };
    run_packed();
    const bool same = std::memcmp(y_kiln.data(), y_packed.data(), s.rows * sizeof(float)) == 0;
    double t_kiln = 1e30, t_packed = 1e30;
    for (int round = 0; round < 4; ++round) {  // alternated
      t_kiln = std::min(t_kiln, best_of(s.reps / 4, [&] { be->matmul(w, x, 1, y_kiln); }));
      t_packed = std::min(t_packed, best_of(s.reps / 4, run_packed));
    }
    const double gb = static_cast<double>(bytes.size()) / 1e9;
    std::printf(
        "Q8_0 %6lld x %5lld, %d thread%s: kiln one-token %6.1f GB/s, packed %6.1f GB/s, "
        "packed / kiln %.2fx, bits %s\n",
        static_cast<long long>(s.rows), static_cast<long long>(s.cols), s.threads,
        s.threads > 1 ? "s" : " ", gb / t_kiln, gb / t_packed, t_kiln / t_packed,
        same ? "same" : "DIFFER");
  }
  return 0;
}
