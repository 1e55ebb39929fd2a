// bench/cuda/cuda_matvec_bench.cpp: decode matvec bandwidth of the CUDA kernels per weight type on
// the 8B llama shapes (4096x4096 attention, 4096x14336 ffn; ggml order: k x rows), reported
// against a device-memory streaming-read kernel measured in the same run. Each shape rotates
// over enough weight copies to exceed the L2 several times, so the figures are HBM figures.
// Also 8 tokens (batched decode) and 512 (prefill) on 4096x14336. Every case runs with both
// matmul kernel sets (kernels.h: V1, the first slice's; V2) and the table shows V2's speedup.
// Times are per call from back-to-back launches between two CUDA events (no host copies, no
// per-launch synchronisation); V2's prefill time includes its dequantization to f16.
// Usage: cuda_matvec_bench [--iters N]. Prints one line per (type, shape, tokens), then a table.
// Host code (g++): it reaches the GPU only through kernels.h's launchers. It lives in
// bench/cuda/ so that bench/'s glob of *.cpp (non-CUDA builds) does not pick it up.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/kernels.h"
#include "core/dtype.h"
#include "quant/quant.h"

namespace {

using kiln::DType;

#define BENCH_CHECK(call)                                                                 \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "cuda_matvec_bench: %s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timer {
  cudaEvent_t a, b;
  Timer() {
    BENCH_CHECK(cudaEventCreate(&a));
    BENCH_CHECK(cudaEventCreate(&b));
  }
  ~Timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
};

double stream_read_gbps(int iters, int n_sm) {
  const size_t bytes = size_t(4) << 30;
  void* buf = nullptr;
  float* sink = nullptr;
  BENCH_CHECK(cudaMalloc(&buf, bytes));
  BENCH_CHECK(cudaMalloc(&sink, size_t(n_sm) * 8 * sizeof(float)));
  BENCH_CHECK(cudaMemset(buf, 0x3c, bytes));  // small finite floats, not zeros
  Timer t;
  std::vector<float> ms;
  for (int i = 0; i < iters + 3; ++i) {
    BENCH_CHECK(cudaEventRecord(t.a));
    BENCH_CHECK(kiln::cuda::launch_read_probe(buf, bytes, sink, n_sm * 8, nullptr));
    BENCH_CHECK(cudaEventRecord(t.b));
    BENCH_CHECK(cudaEventSynchronize(t.b));
    float m = 0;
    BENCH_CHECK(cudaEventElapsedTime(&m, t.a, t.b));
    if (i >= 3) ms.push_back(m);
  }
  BENCH_CHECK(cudaGetLastError());
  cudaFree(buf);
  cudaFree(sink);
  return bytes / (median(ms) * 1e-3) / 1e9;
}

struct Result {
  std::string type;
  std::string path;  // v1, v2, v2 f16 cuBLAS
  int64_t k, rows, n_tok;
  double mib, us, gbps, frac, tflops;
  double max_rel_err;
  double err_bound;  // the path's bound on max_rel_err (f16 rounding on the cuBLAS path)
};

// One weight type and shape at each token count: 1 = decode matvec, 8 = batched decode, 512 =
// prefill (the tiled kernel). GB/s counts the weight bytes once per call.
std::vector<Result> bench_type(DType t, int64_t k, int64_t rows, std::vector<int64_t> n_toks,
                               int iters, size_t l2_bytes, double read_gbps, std::mt19937_64& rng,
                               kiln::cuda::GemmWorkspace& gemm) {
  const size_t rb = *kiln::row_bytes(t, uint64_t(k));
  const size_t mat_bytes = rb * size_t(rows);
  // 256 distinct random rows, tiled: the bytes are real quantized data, the host stays fast.
  constexpr int64_t kDistinct = 256;
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> src(static_cast<size_t>(k));
  std::vector<std::byte> distinct(rb * kDistinct);
  for (int64_t r = 0; r < kDistinct; ++r) {
    for (float& v : src) v = dist(rng);
    kiln::quant::quantize_row(t, src, std::span<std::byte>(distinct).subspan(r * rb, rb));
  }
  std::vector<std::byte> host(mat_bytes);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(host.data() + r * rb, distinct.data() + (r % kDistinct) * rb, rb);
  const int copies = int(std::max<size_t>(2, (4 * l2_bytes + mat_bytes - 1) / mat_bytes));
  std::vector<void*> mats(copies);
  for (void*& m : mats) {
    BENCH_CHECK(cudaMalloc(&m, mat_bytes));
    BENCH_CHECK(cudaMemcpy(m, host.data(), mat_bytes, cudaMemcpyHostToDevice));
  }
  std::vector<Result> out;
  for (int64_t n_tok : n_toks) {
    std::vector<float> x(static_cast<size_t>(k * n_tok));
    std::normal_distribution<float> xd(0.0f, 1.0f);
    for (float& v : x) v = xd(rng);
    float *dx = nullptr, *dy = nullptr;
    BENCH_CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
    BENCH_CHECK(cudaMalloc(&dy, size_t(rows * n_tok) * sizeof(float)));
    BENCH_CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));

    for (kiln::cuda::MatmulKernels kernels :
         {kiln::cuda::MatmulKernels::V1, kiln::cuda::MatmulKernels::V2}) {
      const bool v2 = kernels == kiln::cuda::MatmulKernels::V2;
      kiln::cuda::DeviceWeight w{t, k, rows, rb, static_cast<const std::byte*>(mats[0])};
      kiln::cuda::GemmWorkspace* ws = nullptr;
      if (v2 && n_tok > kiln::cuda::kMatvecMaxTokens && gemm.reserve(w, n_tok)) ws = &gemm;
      // Sanity: a few rows of the first and last token against the host dequantization (a
      // wrong kernel is not timed).
      BENCH_CHECK(cudaMemset(dy, 0xff, size_t(rows * n_tok) * sizeof(float)));  // NaN
      BENCH_CHECK(kiln::cuda::launch_matmul(w, dx, n_tok, dy, nullptr, kernels, ws));
      std::vector<float> y(static_cast<size_t>(rows * n_tok));
      BENCH_CHECK(cudaMemcpy(y.data(), dy, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
      double worst = 0;
      std::vector<float> deq(static_cast<size_t>(k));
      for (int64_t r : {int64_t{0}, int64_t{1}, int64_t{7}, rows / 2 + 3, rows - 1}) {
        kiln::quant::dequantize_row(t, std::span<const std::byte>(host).subspan(r * rb, rb), deq);
        for (int64_t tok : {int64_t{0}, n_tok - 1}) {
          const float* xt = x.data() + tok * k;
          double want = 0, mag = 0;
          for (int64_t c = 0; c < k; ++c)
            want += double(deq[c]) * xt[c], mag += std::fabs(deq[c] * xt[c]);
          const double e = std::fabs(y[tok * rows + r] - want) / (mag + 1e-30);
          worst = std::max(worst, std::isnan(e) ? 1.0 : e);
        }
      }

      // Back-to-back launches between two events, each on the next weight copy (HBM, not
      // L2): launch latency overlaps the previous kernel, as in a CUDA graph.
      Timer tm;
      std::vector<float> ms;
      const int reps = n_tok >= 512 ? 2 : 20;
      const int n_samples = n_tok >= 512 ? std::max(3, iters / 5) : iters;
      int next = 0;
      for (int i = 0; i < n_samples + 2; ++i) {
        BENCH_CHECK(cudaEventRecord(tm.a));
        for (int j = 0; j < reps; ++j) {
          w.data = static_cast<const std::byte*>(mats[next++ % copies]);
          BENCH_CHECK(kiln::cuda::launch_matmul(w, dx, n_tok, dy, nullptr, kernels, ws));
        }
        BENCH_CHECK(cudaEventRecord(tm.b));
        BENCH_CHECK(cudaEventSynchronize(tm.b));
        float m = 0;
        BENCH_CHECK(cudaEventElapsedTime(&m, tm.a, tm.b));
        if (i >= 2) ms.push_back(m / reps);
      }
      const double sec = median(ms) * 1e-3;
      const double gbps = mat_bytes / sec / 1e9;
      const char* path = !v2 ? "v1" : (n_tok > kiln::cuda::kMatvecMaxTokens
                                           ? (ws ? "v2 f16 cuBLAS" : "v2 (tile fallback)")
                                           : "v2");
      out.push_back(Result{std::string(kiln::dtype_name(t)), path, k, rows, n_tok,
                           mat_bytes / 1048576.0, sec * 1e6, gbps, gbps / read_gbps,
                           2.0 * double(k) * double(rows) * double(n_tok) / sec / 1e12, worst,
                           ws ? 2e-3 : 1e-4});
    }
    cudaFree(dx);
    cudaFree(dy);
  }
  for (void* m : mats) cudaFree(m);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 50;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: cuda_matvec_bench [--iters N]\n");
      return 2;
    }
  }
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("cuda_matvec_bench: no CUDA device, nothing measured\n");
    return 0;
  }
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %.0f MiB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize / 1048576.0);
  const double read_gbps = stream_read_gbps(iters, prop.multiProcessorCount);
  std::printf("streaming read (4 GiB, float4 loads): %.0f GB/s\n", read_gbps);
  std::fflush(stdout);

  const DType types[] = {DType::F32,  DType::F16,  DType::BF16, DType::Q8_0, DType::Q4_0,
                         DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q2_K, DType::Q3_K,
                         DType::Q4_K, DType::Q5_K, DType::Q6_K};
  std::mt19937_64 rng(42);
  kiln::cuda::GemmWorkspace gemm;
  std::vector<Result> results;
  for (DType t : types) {
    for (int shape = 0; shape < 2; ++shape) {
      const int64_t k = 4096, rows = shape == 0 ? 4096 : 14336;
      const std::vector<int64_t> n_toks =
          shape == 0 ? std::vector<int64_t>{1} : std::vector<int64_t>{1, 8, 512};
      for (const Result& r : bench_type(t, k, rows, n_toks, iters, size_t(prop.l2CacheSize),
                                        read_gbps, rng, gemm)) {
        results.push_back(r);
        std::printf(
            "%-5s %-18s %5lldx%-5lld tok %3lld %8.1f MiB %9.1f us %7.0f GB/s %5.1f %% %7.2f "
            "TFLOP/s  rel err %.1e\n",
            r.type.c_str(), r.path.c_str(), (long long)r.k, (long long)r.rows, (long long)r.n_tok,
            r.mib, r.us, r.gbps, 100 * r.frac, r.tflops, r.max_rel_err);
        std::fflush(stdout);
      }
    }
  }
  bool ok = true;
  std::printf(
      "\n| type | kernels | k x rows | tokens | MiB | us | GB/s | of read BW (%.0f GB/s) | TFLOP/s "
      "| v2 speedup |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n",
      read_gbps);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    std::string speedup;
    if (r.path != "v1" && i > 0 && results[i - 1].path == "v1")
      speedup = std::to_string(results[i - 1].us / r.us).substr(0, 5) + "x";
    std::printf("| %s | %s | %lldx%lld | %lld | %.1f | %.1f | %.0f | %.1f %% | %.2f | %s |\n",
                r.type.c_str(), r.path.c_str(), (long long)r.k, (long long)r.rows,
                (long long)r.n_tok, r.mib, r.us, r.gbps, 100 * r.frac, r.tflops, speedup.c_str());
    if (!(r.max_rel_err < r.err_bound)) {
      ok = false;
      std::printf("cuda_matvec_bench: %s %s %lld tokens: rel err %.2e over %.0e\n", r.type.c_str(),
                  r.path.c_str(), (long long)r.n_tok, r.max_rel_err, r.err_bound);
    }
  }
  if (!ok) {
    std::printf("cuda_matvec_bench: FAILED: a kernel disagrees with the host dequantization\n");
    return 1;
  }
  return 0;
}
