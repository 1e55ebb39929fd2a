// bench/matvec_bench.cpp: matvec GB/s per weight type against the machine's streaming-read
// bandwidth (measured here, 2 threads), and prefill-shaped Q4_K matmul against a plain f32
// Highway GEMM of the same shape.
//   build/<dir>/bench/matvec_bench --benchmark_counters_tabular=true
#define HWY_WANT_AVX3_DL 1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/matvec_bench.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstring>
#include <random>
#include <vector>

#include "core/thread_pool.h"

HWY_BEFORE_NAMESPACE();
namespace kiln::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Sum of a range (so the loads cannot be dropped): the streaming-read kernel.
float SumRange(const float* p, size_t n) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  for (size_t i = 0; i + 4 * N <= n; i += 4 * N) {
    a0 = hn::Add(a0, hn::Load(d, p + i));
    a1 = hn::Add(a1, hn::Load(d, p + i + N));
    a2 = hn::Add(a2, hn::Load(d, p + i + 2 * N));
    a3 = hn::Add(a3, hn::Load(d, p + i + 3 * N));
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
}

// C[t][r] = sum_k W[r][k] * X[t][k] for rows [r0, r1): 4 weight rows × 4 tokens per
// micro-tile, 16 vector accumulators, k innermost. A plain but honest f32 GEMM.
void GemmF32(const float* W, const float* X, float* C, int64_t K, int64_t M, int64_t n_tok,
             int64_t r0, int64_t r1) {
  const hn::ScalableTag<float> d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  for (int64_t r = r0; r + 4 <= r1; r += 4) {
    for (int64_t t = 0; t + 4 <= n_tok; t += 4) {
      hn::Vec<decltype(d)> acc[4][4];
      for (auto& row : acc)
        for (auto& v : row) v = hn::Zero(d);
      for (int64_t k = 0; k < K; k += N) {
        hn::Vec<decltype(d)> w[4], x[4];
        for (int i = 0; i < 4; ++i) w[i] = hn::LoadU(d, W + (r + i) * K + k);
        for (int j = 0; j < 4; ++j) x[j] = hn::LoadU(d, X + (t + j) * K + k);
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) acc[i][j] = hn::MulAdd(w[i], x[j], acc[i][j]);
      }
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j)
          C[(t + j) * M + r + i] = hn::GetLane(hn::SumOfLanes(d, acc[i][j]));
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kiln::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <benchmark/benchmark.h>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/kernels.h"
#include "core/half.h"
#include "quant/blocks.h"

namespace kiln::bench {
HWY_EXPORT(SumRange);
HWY_EXPORT(GemmF32);

namespace {

// Streaming read of a buffer far larger than the last-level cache, 2 threads, best of 5.
double measure_read_gbps() {
  static const double gbps = [] {
    const size_t n = size_t{512} << 20 >> 2;  // 512 MiB of floats
    float* buf = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
    for (size_t i = 0; i < n; ++i) buf[i] = 1.0f;
    ThreadPool pool(2);
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
      std::vector<float> sink(2);
      const auto t0 = std::chrono::steady_clock::now();
      pool.parallel_for(2, [&](int64_t b, int64_t, int t) {
        const size_t half = n / 2;
        sink[t] = HWY_DYNAMIC_DISPATCH(SumRange)(buf + b * half, half);
      });
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      benchmark::DoNotOptimize(sink.data());
      best = std::max(best, n * sizeof(float) / s / 1e9);
    }
    std::free(buf);
    return best;
  }();
  return gbps;
}

// Random weights of `type` built directly as blocks (the quantizer would take seconds for
// the big shapes): random quants, scales set to small finite values.
struct BenchWeights {
  std::vector<std::byte> bytes;
  WeightMatrix m;
};

template <typename Block>
void fix_blocks(std::vector<std::byte>& bytes, void (*fix)(Block&)) {
  for (size_t off = 0; off + sizeof(Block) <= bytes.size(); off += sizeof(Block)) {
    Block b;
    std::memcpy(&b, bytes.data() + off, sizeof(Block));
    fix(b);
    std::memcpy(bytes.data() + off, &b, sizeof(Block));
  }
}

const BenchWeights& weights(DType type, int64_t n_rows, int64_t n_cols) {
  static std::vector<std::unique_ptr<BenchWeights>> cache;
  for (auto& w : cache)
    if (w->m.dtype == type && w->m.n_rows == n_rows && w->m.n_cols == n_cols) return *w;
  auto w = std::make_unique<BenchWeights>();
  const size_t rb = *row_bytes(type, n_cols);
  w->bytes.resize(rb * n_rows);
  std::mt19937_64 rng(42);
  for (size_t i = 0; i + 8 <= w->bytes.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(w->bytes.data() + i, &v, 8);
  }
  const f16 s = f32_to_f16(0.01f);
  using namespace quant;
  switch (type) {
    case DType::F16: {
      auto* h = reinterpret_cast<f16*>(w->bytes.data());
      std::normal_distribution<float> nd(0, 0.05f);
      for (size_t i = 0; i < w->bytes.size() / 2; ++i) h[i] = f32_to_f16(nd(rng));
      break;
    }
    case DType::F32: {
      auto* f = reinterpret_cast<float*>(w->bytes.data());
      std::normal_distribution<float> nd(0, 0.05f);
      for (size_t i = 0; i < w->bytes.size() / 4; ++i) f[i] = nd(rng);
      break;
    }
    case DType::BF16: {
      auto* h = reinterpret_cast<bf16*>(w->bytes.data());
      std::normal_distribution<float> nd(0, 0.05f);
      for (size_t i = 0; i < w->bytes.size() / 2; ++i) h[i] = f32_to_bf16(nd(rng));
      break;
    }
    case DType::Q8_0:
      fix_blocks<block_q8_0>(w->bytes, [](block_q8_0& b) { b.d = f32_to_f16(0.01f); });
      break;
    case DType::Q4_0:
      fix_blocks<block_q4_0>(w->bytes, [](block_q4_0& b) { b.d = f32_to_f16(0.01f); });
      break;
    case DType::IQ4_NL:
      fix_blocks<block_iq4_nl>(w->bytes, [](block_iq4_nl& b) { b.d = f32_to_f16(0.01f); });
      break;
    case DType::MXFP4:
      fix_blocks<block_mxfp4>(w->bytes, [](block_mxfp4& b) { b.e = 120; });
      break;
    case DType::Q2_K:
      fix_blocks<block_q2_K>(w->bytes, [](block_q2_K& b) { b.d = b.dmin = f32_to_f16(0.01f); });
      break;
    case DType::Q3_K:
      fix_blocks<block_q3_K>(w->bytes, [](block_q3_K& b) { b.d = f32_to_f16(0.01f); });
      break;
    case DType::Q4_K:
      fix_blocks<block_q4_K>(w->bytes, [](block_q4_K& b) { b.d = b.dmin = f32_to_f16(0.01f); });
      break;
    case DType::Q5_K:
      fix_blocks<block_q5_K>(w->bytes, [](block_q5_K& b) { b.d = b.dmin = f32_to_f16(0.01f); });
      break;
    case DType::Q6_K:
      fix_blocks<block_q6_K>(w->bytes, [](block_q6_K& b) { b.d = f32_to_f16(0.01f); });
      break;
    default:
      break;
  }
  (void)s;
  w->m = WeightMatrix{
      .dtype = type, .n_cols = n_cols, .n_rows = n_rows, .row_bytes = rb, .bytes = w->bytes};
  cache.push_back(std::move(w));
  return *cache.back();
}

Backend& backend(int threads) {
  static std::unique_ptr<Backend> b1 = make_cpu_backend({.threads = 1}),
                                  b2 = make_cpu_backend({.threads = 2});
  return threads == 1 ? *b1 : *b2;
}
// The same with the portable kernels (CpuOptions::portable_kernels): the *OnOff benchmarks'
// "old" side, the kernels a machine without the fast ones' features runs.
Backend& portable_backend(int threads) {
  static std::unique_ptr<Backend> b1 = make_cpu_backend({.threads = 1, .portable_kernels = true}),
                                  b2 = make_cpu_backend({.threads = 2, .portable_kernels = true});
  return threads == 1 ? *b1 : *b2;
}
// The fast kernels without AMX (CpuOptions::amx off): BM_Q8AmxOnOff's "old" side.
Backend& no_amx_backend() {
  static std::unique_ptr<Backend> b = make_cpu_backend({.threads = 1, .amx = false});
  return *b;
}

void BM_ReadBandwidth(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(measure_read_gbps());
  state.counters["GB/s"] = measure_read_gbps();
}
BENCHMARK(BM_ReadBandwidth)->Iterations(1);

// args: dtype, n_rows, threads (n_cols = 4096)
void BM_Matvec(benchmark::State& state) {
  const auto type = static_cast<DType>(state.range(0));
  const int64_t n_rows = state.range(1), n_cols = 4096;
  const int threads = static_cast<int>(state.range(2));
  const BenchWeights& w = weights(type, n_rows, n_cols);
  std::vector<float> x(n_cols, 0.5f), y(n_rows);
  Backend& be = backend(threads);
  for (auto _ : state) {
    be.matmul(w.m, x, 1, y);
    benchmark::DoNotOptimize(y.data());
  }
  const double bytes = static_cast<double>(w.bytes.size());
  state.SetLabel(std::string(dtype_name(type)) + " " + cpu_simd_target());
  state.counters["GB/s"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["of_read_bw"] = benchmark::Counter(bytes / 1e9 / measure_read_gbps(),
                                                    benchmark::Counter::kIsIterationInvariantRate);
}
void MatvecArgs(benchmark::internal::Benchmark* b) {
  for (DType t : {DType::F16, DType::Q8_0, DType::Q4_0, DType::Q4_K, DType::Q5_K, DType::Q6_K})
    for (int64_t rows : {4096, 14336})
      for (int threads : {1, 2}) b->Args({static_cast<int64_t>(t), rows, threads});
}
BENCHMARK(BM_Matvec)->Apply(MatvecArgs)->UseRealTime()->MinTime(0.5);

constexpr int64_t kGemmTok = 512, kGemmK = 4096, kGemmM = 4096;

// Prefill: 512 token rows through a 4096x4096 Q4_K matrix, 2 threads.
void BM_MatmulQ4K(benchmark::State& state) {
  const BenchWeights& w = weights(DType::Q4_K, kGemmM, kGemmK);
  std::vector<float> x(kGemmTok * kGemmK), y(kGemmTok * kGemmM);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& v : x) v = nd(rng);
  Backend& be = backend(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    be.matmul(w.m, x, kGemmTok, y);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * kGemmTok * kGemmK * kGemmM / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_MatmulQ4K)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_GemmF32(benchmark::State& state) {
  std::vector<float> W(kGemmM * kGemmK), X(kGemmTok * kGemmK), C(kGemmTok * kGemmM);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& v : W) v = nd(rng);
  for (float& v : X) v = nd(rng);
  ThreadPool pool(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    pool.parallel_for(kGemmM / 4, [&](int64_t b, int64_t e, int) {
      HWY_DYNAMIC_DISPATCH(GemmF32)
      (W.data(), X.data(), C.data(), kGemmK, kGemmM, kGemmTok, b * 4, e * 4);
    });
    benchmark::DoNotOptimize(C.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * kGemmTok * kGemmK * kGemmM / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_GemmF32)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);

// The prefill shape through other weight types (the paths Q4_K_M, Q8_0 and F16 models take).
void BM_MatmulPrefill(benchmark::State& state) {
  const auto type = static_cast<DType>(state.range(0));
  const BenchWeights& w = weights(type, kGemmM, kGemmK);
  std::vector<float> x(kGemmTok * kGemmK), y(kGemmTok * kGemmM);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& v : x) v = nd(rng);
  Backend& be = backend(2);
  for (auto _ : state) {
    be.matmul(w.m, x, kGemmTok, y);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetLabel(std::string(dtype_name(type)));
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * kGemmTok * kGemmK * kGemmM / 1e9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_MatmulPrefill)
    ->Arg(static_cast<int64_t>(DType::Q4_K))
    ->Arg(static_cast<int64_t>(DType::Q6_K))
    ->Arg(static_cast<int64_t>(DType::Q8_0))
    ->Arg(static_cast<int64_t>(DType::F16))
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

// The issue-3 ratio measured robustly on a shared machine: Q4_K matmul and the f32 GEMM
// alternate within each iteration (same shape, 2 threads each) and the best time of each over
// the run is kept, so load from other processes hits both alike.
void BM_Q4KOverF32Ratio(benchmark::State& state) {
  const BenchWeights& w = weights(DType::Q4_K, kGemmM, kGemmK);
  std::vector<float> W(kGemmM * kGemmK), X(kGemmTok * kGemmK), C(kGemmTok * kGemmM);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& v : W) v = nd(rng);
  for (float& v : X) v = nd(rng);
  Backend& be = backend(2);
  ThreadPool pool(2);
  double best_q = 1e30, best_f = 1e30;
  using clock = std::chrono::steady_clock;
  for (auto _ : state) {
    auto t0 = clock::now();
    be.matmul(w.m, X, kGemmTok, C);
    benchmark::DoNotOptimize(C.data());
    auto t1 = clock::now();
    pool.parallel_for(kGemmM / 4, [&](int64_t b, int64_t e, int) {
      HWY_DYNAMIC_DISPATCH(GemmF32)
      (W.data(), X.data(), C.data(), kGemmK, kGemmM, kGemmTok, b * 4, e * 4);
    });
    benchmark::DoNotOptimize(C.data());
    auto t2 = clock::now();
    best_q = std::min(best_q, std::chrono::duration<double>(t1 - t0).count());
    best_f = std::min(best_f, std::chrono::duration<double>(t2 - t1).count());
  }
  const double flop = 2.0 * kGemmTok * kGemmK * kGemmM / 1e9;
  state.counters["q4K_GFLOP/s"] = flop / best_q;
  state.counters["f32_GFLOP/s"] = flop / best_f;
  state.counters["ratio"] = best_f / best_q;
}
BENCHMARK(BM_Q4KOverF32Ratio)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(20);

// The same ratio in thread CPU time on one thread (the calling thread runs a 1-thread pool's
// work itself): time slices lost to other processes do not count, so this is the reading to
// trust when the machine is shared.
double thread_cpu_s() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
void BM_Q4KOverF32CpuRatio(benchmark::State& state) {
  const auto type = static_cast<DType>(state.range(0));
  const BenchWeights& w = weights(type, kGemmM, kGemmK);
  std::vector<float> W(kGemmM * kGemmK), X(kGemmTok * kGemmK), C(kGemmTok * kGemmM);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& v : W) v = nd(rng);
  for (float& v : X) v = nd(rng);
  Backend& be = backend(1);
  double best_q = 1e30, best_f = 1e30;
  for (auto _ : state) {
    const double t0 = thread_cpu_s();
    be.matmul(w.m, X, kGemmTok, C);
    benchmark::DoNotOptimize(C.data());
    const double t1 = thread_cpu_s();
    HWY_DYNAMIC_DISPATCH(GemmF32)
    (W.data(), X.data(), C.data(), kGemmK, kGemmM, kGemmTok, 0, kGemmM);
    benchmark::DoNotOptimize(C.data());
    const double t2 = thread_cpu_s();
    best_q = std::min(best_q, t1 - t0);
    best_f = std::min(best_f, t2 - t1);
  }
  const double flop = 2.0 * kGemmTok * kGemmK * kGemmM / 1e9;
  state.SetLabel(std::string(dtype_name(type)) + " vs f32 GEMM, 1 thread, CPU time");
  state.counters["w_GFLOP/s"] = flop / best_q;
  state.counters["f32_GFLOP/s"] = flop / best_f;
  state.counters["ratio"] = best_f / best_q;
}
BENCHMARK(BM_Q4KOverF32CpuRatio)
    ->Arg(static_cast<int64_t>(DType::Q4_K))
    ->Arg(static_cast<int64_t>(DType::Q6_K))
    ->Arg(static_cast<int64_t>(DType::Q8_0))
    ->Arg(static_cast<int64_t>(DType::F16))
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(8);

// The fast kernels against the portable ones on one matmul (1 thread, thread CPU time,
// alternating within each iteration, best of each), the two outputs compared bit for bit; sets
// the new/old counters and returns the best times (new, old) in seconds.
std::pair<double, double> time_on_off(benchmark::State& state, const BenchWeights& w, int64_t n_tok,
                                      const char* what, Backend* off = nullptr) {
  std::vector<float> X(n_tok * w.m.n_cols), C_on(n_tok * w.m.n_rows), C_off(n_tok * w.m.n_rows);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& v : X) v = nd(rng);
  Backend& fast = backend(1);
  Backend& portable = off != nullptr ? *off : portable_backend(1);
  double best_on = 1e30, best_off = 1e30;
  for (auto _ : state) {
    const double t0 = thread_cpu_s();
    fast.matmul(w.m, X, n_tok, C_on);
    benchmark::DoNotOptimize(C_on.data());
    const double t1 = thread_cpu_s();
    portable.matmul(w.m, X, n_tok, C_off);
    benchmark::DoNotOptimize(C_off.data());
    const double t2 = thread_cpu_s();
    best_on = std::min(best_on, t1 - t0);
    best_off = std::min(best_off, t2 - t1);
  }
  const char* old_side = off != nullptr ? "VNNI" : "plain";
  if (std::memcmp(C_on.data(), C_off.data(), C_on.size() * sizeof(float)) != 0)
    state.SkipWithError((std::string(what) + " and " + old_side + " kernels differ").c_str());
  state.SetLabel(std::string(dtype_name(w.m.dtype)) + " " + what + " vs " + old_side + ", " +
                 cpu_simd_target());
  state.counters["new_us"] = best_on * 1e6;
  state.counters["old_us"] = best_off * 1e6;
  state.counters["speedup"] = best_off / best_on;
  return {best_on, best_off};
}

// Fast vs portable with args (type, tokens, rows, columns), per-token time added.
void kq_switch_on_off(benchmark::State& state, const char* what) {
  const auto type = static_cast<DType>(state.range(0));
  const int64_t n_tok = state.range(1), n_rows = state.range(2), n_cols = state.range(3);
  const double best_on = time_on_off(state, weights(type, n_rows, n_cols), n_tok, what).first;
  state.counters["new_us/tok"] = best_on * 1e6 / static_cast<double>(n_tok);
}

// The v2 batched Q4_K / Q6_K kernels against the plain ones at decode-of-several-streams token
// counts on the 1B model's FFN shapes and a k/v projection: 1 thread, thread CPU time,
// alternating within each iteration, best of each, the bits compared.
void BM_KQBatchOnOff(benchmark::State& state) { kq_switch_on_off(state, "batched v2"); }
void KQBatchArgs(benchmark::internal::Benchmark* b) {
  for (DType type : {DType::Q4_K, DType::Q6_K})
    for (auto [rows, cols] : {std::pair<int64_t, int64_t>{5632, 2048}, {2048, 5632}, {512, 2048}})
      for (int64_t tok : {2, 3, 4, 5, 8}) b->Args({static_cast<int64_t>(type), tok, rows, cols});
}
BENCHMARK(BM_KQBatchOnOff)
    ->Apply(KQBatchArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);

// The Q4_K / Q6_K kernels of many tokens (MatmulKRows16, or AMX where the machine has it) against
// the plain ones, same method as BM_KQBatchOnOff: prefill (512 tokens) on the 1.1B model's shapes
// (q/o 2048 x 2048, k/v 512 x 2048, gate/up 8192 x 2048, down 2048 x 8192) and smaller token
// counts (below kKRowsMinTok / kKRowsMinTokQ6K the fast side is the v2 batched kernels).
void BM_KQPrefillOnOff(benchmark::State& state) { kq_switch_on_off(state, "prefill"); }
void KQPrefillArgs(benchmark::internal::Benchmark* b) {
  const auto q4k = static_cast<int64_t>(DType::Q4_K);
  for (auto [rows, cols] :
       {std::pair<int64_t, int64_t>{2048, 2048}, {512, 2048}, {8192, 2048}, {2048, 8192}})
    b->Args({q4k, 512, rows, cols});
  for (int64_t tok : {16, 32, 64, 128}) b->Args({q4k, tok, 2048, 2048});
  const auto q6k = static_cast<int64_t>(DType::Q6_K);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{2048, 8192}, {512, 2048}})
    b->Args({q6k, 512, rows, cols});
  for (int64_t tok : {64, 128}) b->Args({q6k, tok, 2048, 2048});
}
BENCHMARK(BM_KQPrefillOnOff)
    ->Apply(KQPrefillArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);

// The 512-bit VNNI Q8_0-family kernel against the plain one, same method as BM_KQBatchOnOff:
// prefill (512 tokens) on the 1B model's 2048 x 2048 and its FFN down projection's 2048 x 8192 (and
// up's 8192 x 2048), Q4_0 once, and small token counts from kQ8VnniMinTok (a decode step of a
// few streams, a speculative verify).
void BM_Q8VnniOnOff(benchmark::State& state) { kq_switch_on_off(state, "VNNI 512"); }
void Q8VnniArgs(benchmark::internal::Benchmark* b) {
  const auto q8 = static_cast<int64_t>(DType::Q8_0);
  b->Args({q8, 512, 2048, 2048});
  b->Args({q8, 512, 2048, 8192});
  b->Args({q8, 512, 8192, 2048});
  b->Args({static_cast<int64_t>(DType::Q4_0), 512, 2048, 2048});
  for (int64_t tok : {2, 4, 8, 16, 64}) b->Args({q8, tok, 2048, 2048});
}
BENCHMARK(BM_Q8VnniOnOff)
    ->Apply(Q8VnniArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);

// The AMX kernels (Q8_0 family; Q4_K, Q6_K) against the 512-bit VNNI ones (CpuOptions::amx off),
// same method and shapes as BM_Q8VnniOnOff from kQ8AmxMinTok tokens; skipped where the machine has
// no AMX-INT8 (both sides would run the VNNI kernel).
void BM_Q8AmxOnOff(benchmark::State& state) {
  if (!cpu_has_amx()) {
    state.SkipWithError("no AMX-INT8 on this machine");
    return;
  }
  const auto type = static_cast<DType>(state.range(0));
  const int64_t n_tok = state.range(1);
  const double best_on = time_on_off(state, weights(type, state.range(2), state.range(3)), n_tok,
                                     "AMX", &no_amx_backend())
                             .first;
  state.counters["new_us/tok"] = best_on * 1e6 / static_cast<double>(n_tok);
}
void Q8AmxArgs(benchmark::internal::Benchmark* b) {
  const auto q8 = static_cast<int64_t>(DType::Q8_0);
  b->Args({q8, 512, 2048, 2048});
  b->Args({q8, 512, 2048, 8192});
  b->Args({q8, 512, 8192, 2048});
  b->Args({static_cast<int64_t>(DType::Q4_0), 512, 2048, 2048});
  for (int64_t tok : {16, 64}) b->Args({q8, tok, 2048, 2048});
  // Q4_K's and Q6_K's AMX kernels (cpu_matmul_kq.cpp) against their VNNI prefill / batched kernels.
  const auto q4k = static_cast<int64_t>(DType::Q4_K);
  b->Args({q4k, 512, 2048, 2048});
  b->Args({q4k, 512, 2048, 8192});
  b->Args({q4k, 512, 8192, 2048});
  for (int64_t tok : {16, 64}) b->Args({q4k, tok, 2048, 2048});
  const auto q6k = static_cast<int64_t>(DType::Q6_K);
  b->Args({q6k, 512, 2048, 2048});
  b->Args({q6k, 512, 8192, 2048});
  for (int64_t tok : {16, 64}) b->Args({q6k, tok, 2048, 2048});
}
BENCHMARK(BM_Q8AmxOnOff)
    ->Apply(Q8AmxArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);

// The AVX-512 Q8_K activation encoder against the scalar loop (quantize_act_row's portable): 512
// rows of 2048 and of 8192 (a prefill's matmul inputs), 1 thread, thread CPU time, alternating,
// best of each; the bytes compared. args: columns.
void BM_Q8KQuantOnOff(benchmark::State& state) {
  const int64_t n = state.range(0), n_tok = 512;
  std::vector<float> X(n_tok * n);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& v : X) v = nd(rng);
  const size_t rb = cpu::act_row_bytes(cpu::ActKind::Q8_K, n);
  std::vector<std::byte> on(rb * n_tok), off(on.size());
  const auto run = [&](std::vector<std::byte>& dst, bool portable) {
    for (int64_t t = 0; t < n_tok; ++t)
      cpu::quantize_act_row(cpu::ActKind::Q8_K, X.data() + t * n, n, dst.data() + t * rb, portable);
    benchmark::DoNotOptimize(dst.data());
  };
  double best_on = 1e30, best_off = 1e30;
  for (auto _ : state) {
    const double t0 = thread_cpu_s();
    run(on, false);
    const double t1 = thread_cpu_s();
    run(off, true);
    const double t2 = thread_cpu_s();
    best_on = std::min(best_on, t1 - t0);
    best_off = std::min(best_off, t2 - t1);
  }
  if (std::memcmp(on.data(), off.data(), on.size()) != 0) state.SkipWithError("encoders differ");
  state.SetLabel(std::string("q8_K encode, ") + cpu_simd_target());
  state.counters["new_us"] = best_on * 1e6;
  state.counters["old_us"] = best_off * 1e6;
  state.counters["speedup"] = best_off / best_on;
}
BENCHMARK(BM_Q8KQuantOnOff)
    ->Arg(2048)
    ->Arg(8192)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);

// The register-tiled F32/F16/BF16 kernel against DotTile, same method as BM_KQBatchOnOff (1 thread,
// thread CPU time, the bits compared): the 1.1B model's projections (q/o 2048 x 2048, gate/up 8192
// x 2048, down 2048 x 8192) at prefill and small batches; F32 and BF16 on one shape. Below
// kFloatTileMinTok tokens both runs are DotTile.
void BM_FloatTileOnOff(benchmark::State& state) {
  kq_switch_on_off(state, "float tile");
  const double flop = 2.0 * static_cast<double>(state.range(1) * state.range(2) * state.range(3));
  state.counters["new_GFLOP/s"] = flop / state.counters["new_us"] * 1e-3;
  state.counters["old_GFLOP/s"] = flop / state.counters["old_us"] * 1e-3;
}
void FloatTileArgs(benchmark::internal::Benchmark* b) {
  const auto f16 = static_cast<int64_t>(DType::F16);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{2048, 2048}, {2048, 8192}, {8192, 2048}})
    b->Args({f16, 512, rows, cols});
  for (int64_t tok : {1, 2, 3, 4, 8, 16, 64}) b->Args({f16, tok, 2048, 2048});
  for (DType type : {DType::F32, DType::BF16})
    b->Args({static_cast<int64_t>(type), 512, 2048, 2048});
}
// MinTime 2: a 512-token iteration (both kernels) takes up to 0.7 s, and the best of several is
// what the machine's noise leaves comparable.
BENCHMARK(BM_FloatTileOnOff)
    ->Apply(FloatTileArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

// The multi-pair attention kernel against the per-pair one, same method as BM_KQBatchOnOff (1
// thread, thread CPU time, alternating, best of each, the bits compared): the 1.1B model's heads
// (32 query / 8 KV heads of 64) at causal prefill (the queries are the last n_q of n_kv positions)
// and at decode; also without GQA (32 KV heads), where a decode task has one pair. args: n_q, n_kv,
// n_head_kv.
void BM_AttnMultiOnOff(benchmark::State& state) {
  const int64_t n_q = state.range(0), n_kv = state.range(1);
  const int64_t n_head = 32, n_head_kv = state.range(2), hd = 64, q_w = n_head * hd,
                kv_w = n_head_kv * hd;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<f16> k(n_kv * kv_w), v(n_kv * kv_w);
  for (size_t i = 0; i < k.size(); ++i) k[i] = f32_to_f16(nd(rng)), v[i] = f32_to_f16(nd(rng));
  std::vector<float> q(n_q * q_w), out_on(q.size()), out_off(q.size());
  for (float& x : q) x = nd(rng);
  std::vector<int32_t> rows(n_kv), kv_pos(n_kv), q_pos(n_q);
  for (int64_t j = 0; j < n_kv; ++j) rows[j] = kv_pos[j] = static_cast<int32_t>(j);
  for (int64_t i = 0; i < n_q; ++i) q_pos[i] = static_cast<int32_t>(n_kv - n_q + i);
  AttentionArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.kv_rows = rows;
  a.kv_pos = kv_pos;
  a.q_pos = q_pos;
  a.n_q = n_q;
  a.n_head = n_head;
  a.n_head_kv = n_head_kv;
  a.head_dim = hd;
  a.scale = 0.125f;
  Backend& fast = backend(1);
  Backend& portable = portable_backend(1);
  double best_on = 1e30, best_off = 1e30;
  for (auto _ : state) {
    a.out = out_on;
    const double t0 = thread_cpu_s();
    fast.attention(a);
    benchmark::DoNotOptimize(out_on.data());
    const double t1 = thread_cpu_s();
    a.out = out_off;
    portable.attention(a);
    benchmark::DoNotOptimize(out_off.data());
    const double t2 = thread_cpu_s();
    best_on = std::min(best_on, t1 - t0);
    best_off = std::min(best_off, t2 - t1);
  }
  if (std::memcmp(out_on.data(), out_off.data(), out_on.size() * sizeof(float)) != 0)
    state.SkipWithError("multi-pair and per-pair attention differ");
  state.SetLabel(std::string("attention multi-pair vs per-pair, ") + cpu_simd_target());
  state.counters["new_us"] = best_on * 1e6;
  state.counters["old_us"] = best_off * 1e6;
  state.counters["speedup"] = best_off / best_on;
}
BENCHMARK(BM_AttnMultiOnOff)
    ->Args({512, 512, 8})
    ->Args({64, 512, 8})
    ->Args({1, 512, 8})
    ->Args({1, 4096, 8})
    ->Args({512, 512, 32})
    ->Args({1, 4096, 32})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);

// The one-token Q4_K / Q6_K / Q2_K / Q3_K kernels against the plain ones, 1 thread,
// thread CPU time, alternating within each iteration, best of each; also checks that the two
// give the same bits. Shapes: the 1B dense model's FFN and a MoE expert slice (256 x 1024 and
// 1024 x 256, 147 KB: L2-resident here, so this is the kernels' arithmetic). args: type, rows,
// columns.
void BM_KQOneOnOff(benchmark::State& state) {
  const auto type = static_cast<DType>(state.range(0));
  const int64_t n_rows = state.range(1), n_cols = state.range(2);
  const BenchWeights& w = weights(type, n_rows, n_cols);
  const auto [best_on, best_off] = time_on_off(state, w, 1, "one-token");
  const double bytes = static_cast<double>(w.bytes.size());
  state.counters["new_GB/s"] = bytes / best_on * 1e-9;
  state.counters["old_GB/s"] = bytes / best_off * 1e-9;
}
void KQOneArgs(benchmark::internal::Benchmark* b) {
  for (DType type : {DType::Q4_K, DType::Q6_K, DType::Q2_K, DType::Q3_K})
    for (auto [rows, cols] :
         {std::pair<int64_t, int64_t>{5632, 2048}, {2048, 5632}, {256, 1024}, {1024, 256}})
      b->Args({static_cast<int64_t>(type), rows, cols});
}
BENCHMARK(BM_KQOneOnOff)
    ->Apply(KQOneArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);

// The one-token Q8_0-family kernels (AVX-512: every type; AVX2: Q8_0) against the plain one,
// as BM_KQOneOnOff: 1 thread, alternating, best of each, same bits checked. Shapes: the 1B dense
// model's FFN and a MoE expert slice. args: type, rows, columns.
void BM_Q8OneOnOff(benchmark::State& state) {
  const BenchWeights& w =
      weights(static_cast<DType>(state.range(0)), state.range(1), state.range(2));
  const auto [best_on, best_off] = time_on_off(state, w, 1, "one-token");
  const double bytes = static_cast<double>(w.bytes.size());
  state.counters["new_GB/s"] = bytes / best_on * 1e-9;
  state.counters["old_GB/s"] = bytes / best_off * 1e-9;
}
void Q8OneArgs(benchmark::internal::Benchmark* b) {
  for (DType type : {DType::Q8_0, DType::Q4_0, DType::IQ4_NL, DType::MXFP4})
    for (auto [rows, cols] :
         {std::pair<int64_t, int64_t>{5632, 2048}, {2048, 5632}, {256, 1024}, {1024, 256}})
      b->Args({static_cast<int64_t>(type), rows, cols});
}
BENCHMARK(BM_Q8OneOnOff)
    ->Apply(Q8OneArgs)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);

// One decoder layer's matmuls of the 1.1B Q4_K_M model (q, k, v, o, gate, up, down: Q4_K with
// Q6_K v and down, n_embd 2048, n_ff 8192, 4 KV heads of 128) at a decode step of `tokens`
// tokens, 2 threads, wall time, the fast kernels and the portable ones alternating, best of
// each. The step ratio against tokens = 1 is what batched decode of several streams gains.
void layer_step_on_off(benchmark::State& state) {
  const int64_t n_tok = state.range(0);
  struct Mm {
    DType type;
    int64_t rows, cols;
  };
  const Mm mms[] = {{DType::Q4_K, 2048, 2048}, {DType::Q4_K, 512, 2048},  {DType::Q6_K, 512, 2048},
                    {DType::Q4_K, 2048, 2048}, {DType::Q4_K, 8192, 2048}, {DType::Q4_K, 8192, 2048},
                    {DType::Q6_K, 2048, 8192}};
  // gate and up are distinct matrices (a cache-resident copy would flatter the step).
  std::vector<const BenchWeights*> ws;
  for (size_t i = 0; i < std::size(mms); ++i)
    ws.push_back(&weights(mms[i].type, mms[i].rows + (i == 5 ? 1 : 0), mms[i].cols));
  std::vector<float> X(n_tok * 8192), Y(n_tok * 8193);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (float& v : X) v = nd(rng);
  const auto step = [&](Backend& be) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const WeightMatrix& m = ws[i]->m;
      be.matmul(m, std::span<const float>(X.data(), n_tok * m.n_cols), n_tok,
                std::span<float>(Y.data(), n_tok * m.n_rows));
    }
    benchmark::DoNotOptimize(Y.data());
  };
  const auto wall = [] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  double best_on = 1e30, best_off = 1e30;
  for (auto _ : state) {
    const double t0 = wall();
    step(backend(2));
    const double t1 = wall();
    step(portable_backend(2));
    const double t2 = wall();
    best_on = std::min(best_on, t1 - t0);
    best_off = std::min(best_off, t2 - t1);
  }
  state.SetLabel(std::string("1.1B layer step, 2 threads, ") + cpu_simd_target());
  state.counters["new_ms"] = best_on * 1e3;
  state.counters["old_ms"] = best_off * 1e3;
  state.counters["speedup"] = best_off / best_on;
}
// Decode-sized steps: the one-token and v2 batched kernels against the plain ones.
void BM_LayerStepKQBatch(benchmark::State& state) { layer_step_on_off(state); }
BENCHMARK(BM_LayerStepKQBatch)
    ->Arg(1)
    ->Arg(2)
    ->Arg(3)
    ->Arg(4)
    ->Arg(5)
    ->Arg(8)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);
// The same step at prefill sizes: the kernels of many tokens (MatmulKRows16, or AMX) against
// the plain ones.
void BM_LayerStepKQPrefill(benchmark::State& state) { layer_step_on_off(state); }
BENCHMARK(BM_LayerStepKQPrefill)
    ->Arg(64)
    ->Arg(128)
    ->Arg(512)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(3.0);

}  // namespace
}  // namespace kiln::bench

BENCHMARK_MAIN();
#endif
