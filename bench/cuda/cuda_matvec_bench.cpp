// bench/cuda/cuda_matvec_bench.cpp: decode matvec bandwidth of the CUDA kernels per weight type on
// the 8B llama shapes (ggml order k x rows: 4096x4096 attention, 4096x14336 ffn up/gate,
// 14336x4096 ffn down, 4096x32000 output) at 1, 4, 16 and 64 tokens (decode and batched
// decode), reported against a device-memory streaming-read kernel measured in the same run.
// Each shape rotates over enough weight copies to exceed the L2 several times, so the figures
// are HBM figures. Every case runs MatmulKernels::V2 and V3 (kernels.h) on the same data,
// interleaved, and the table shows V3's GB/s, its share of the read bandwidth and its speedup over
// V2. V3 times include the activation quantization; V2 above 16 tokens includes its dequantization
// to f16 for cuBLAS. GB/s counts the weight bytes once per call. Times are per call from
// back-to-back launches between two CUDA events (no host copies, no per-launch synchronisation),
// medians of --iters samples. Usage: cuda_matvec_bench [--iters N] [--types q4_K,q8_0,...]
// [--shapes 4096x14336,...]
// [--tokens 1,4,...] [--no-attention]. The graph column is measured twice, the second time
// captured with programmatic dependent launch (kernels.h set_launch_pdl). Prints one line per case,
// then the tables (lines starting with '|'). --float-rows-ab: only the rows-per-warp A/B of
// V3's float kernel (bench_float_rows); --float-mma-ab: only the tensor-core float kernel
// against it; --float-mma-sweep: the tensor-core float kernel's launch shapes.
// Host code (g++): it reaches the GPU only through kernels.h's launchers. It lives in
// bench/cuda/ so that bench/'s glob of *.cpp (non-CUDA builds) does not pick it up.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
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
  std::string kernels;  // v2, v3
  int64_t k, rows, n_tok;
  double mib, us, gbps, frac, tflops;
  double graph_us;      // per call inside a CUDA graph (0: not measured, cuBLAS paths)
  double graph_pdl_us;  // the same graph captured with programmatic dependent launch
  double max_rel_err;
  double err_bound;
};

const char* kernels_name(kiln::cuda::MatmulKernels k) {
  return k == kiln::cuda::MatmulKernels::V2 ? "v2" : "v3";
}

// --mma-min N: launch_matmul_v3's tensor-core threshold (0: the dp4a kernels at every count).
// --mma-stages N: Q4_K/Q6_K's tensor-core kernel with a ring of N (3, 4, 6) shared-memory
// stages, or 0: reading its fragments from global memory (kernels.h set_mma_stages), for A/B.
// --mma-warps N: that kernel with 4 or 8 warps per block (kernels.h set_mma_warps).
int g_mma_min = kiln::cuda::kQ8MmaMinTokens;

struct Scratch {
  kiln::cuda::GemmWorkspace gemm;
  void* act = nullptr;
  size_t act_bytes = 0;
};

cudaError_t run_kernels(kiln::cuda::MatmulKernels kernels, const kiln::cuda::DeviceWeight& w,
                        const float* dx, int64_t n_tok, float* dy, Scratch& sc,
                        cudaStream_t st = nullptr) {
  kiln::cuda::GemmWorkspace* ws = nullptr;
  if (n_tok > kiln::cuda::kMatvecMaxTokens && sc.gemm.fits(w, n_tok)) ws = &sc.gemm;
  if (kernels == kiln::cuda::MatmulKernels::V3)
    return kiln::cuda::launch_matmul_v3(w, dx, n_tok, dy, sc.act, sc.act_bytes, st, ws, g_mma_min);
  return kiln::cuda::launch_matmul(w, dx, n_tok, dy, st, ws);
}

// One weight type and shape at each token count, every kernel set, interleaved per token count.
std::vector<Result> bench_type(DType t, int64_t k, int64_t rows, const std::vector<int64_t>& n_toks,
                               const std::vector<kiln::cuda::MatmulKernels>& sets, int iters,
                               size_t l2_bytes, double read_gbps, std::mt19937_64& rng,
                               Scratch& sc) {
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
  std::vector<float> deq(static_cast<size_t>(k));
  for (int64_t n_tok : n_toks) {
    std::vector<float> x(static_cast<size_t>(k * n_tok));
    std::normal_distribution<float> xd(0.0f, 1.0f);
    for (float& v : x) v = xd(rng);
    float *dx = nullptr, *dy = nullptr;
    BENCH_CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
    BENCH_CHECK(cudaMalloc(&dy, size_t(rows * n_tok) * sizeof(float)));
    BENCH_CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
    kiln::cuda::DeviceWeight w{t, k, rows, rb, static_cast<const std::byte*>(mats[0])};
    if (n_tok > kiln::cuda::kMatvecMaxTokens) sc.gemm.reserve(w, n_tok);
    for (kiln::cuda::MatmulKernels kernels : sets) {
      // Sanity: a few rows of the first and last token against the host dequantization (a
      // wrong kernel is not timed).
      w.data = static_cast<const std::byte*>(mats[0]);
      BENCH_CHECK(cudaMemset(dy, 0xff, size_t(rows * n_tok) * sizeof(float)));  // NaN
      BENCH_CHECK(run_kernels(kernels, w, dx, n_tok, dy, sc));
      std::vector<float> y(static_cast<size_t>(rows * n_tok));
      BENCH_CHECK(cudaMemcpy(y.data(), dy, y.size() * sizeof(float), cudaMemcpyDeviceToHost));
      double worst = 0;
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
      const bool v3_int8 = kernels == kiln::cuda::MatmulKernels::V3 &&
                           kiln::cuda::matvec_q8_supports(t) && n_tok <= kiln::cuda::kQ8MaxTokens;
      const bool f16_gemm = n_tok > kiln::cuda::kMatvecMaxTokens &&
                            !(v3_int8 || (kernels == kiln::cuda::MatmulKernels::V3 && n_tok <= 8));
      // int8 activations: |error| ~ 1e-4 of sum |w x| here; the bound only catches a broken
      // kernel (tests/cuda checks the statistical bound).
      const double bound = v3_int8 ? 1e-2 : (f16_gemm ? 2e-3 : 1e-4);

      // Back-to-back launches between two events, each on the next weight copy (HBM, not
      // L2): launch latency overlaps the previous kernel, as in a CUDA graph.
      Timer tm;
      std::vector<float> ms;
      const int reps = 20;
      int next = 0;
      for (int i = 0; i < iters + 2; ++i) {
        BENCH_CHECK(cudaEventRecord(tm.a));
        for (int j = 0; j < reps; ++j) {
          w.data = static_cast<const std::byte*>(mats[next++ % copies]);
          BENCH_CHECK(run_kernels(kernels, w, dx, n_tok, dy, sc));
        }
        BENCH_CHECK(cudaEventRecord(tm.b));
        BENCH_CHECK(cudaEventSynchronize(tm.b));
        float m = 0;
        BENCH_CHECK(cudaEventElapsedTime(&m, tm.a, tm.b));
        if (i >= 2) ms.push_back(m / reps);
      }
      const double sec = median(ms) * 1e-3;
      const double gbps = mat_bytes / sec / 1e9;
      // The same launches captured once into a CUDA graph and replayed, as the device-resident
      // forward pass runs a decode step: launch gaps shrink to what the graph leaves. Not for
      // paths through cuBLAS (its workspace is not captured here).
      double graph_us = 0, graph_pdl_us = 0;
      for (bool pdl : {false, true}) {
        if (f16_gemm) break;
        kiln::cuda::set_launch_pdl(pdl);
        cudaStream_t gs = nullptr;
        BENCH_CHECK(cudaStreamCreateWithFlags(&gs, cudaStreamNonBlocking));
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        BENCH_CHECK(cudaStreamBeginCapture(gs, cudaStreamCaptureModeThreadLocal));
        for (int j = 0; j < reps; ++j) {
          w.data = static_cast<const std::byte*>(mats[j % copies]);
          BENCH_CHECK(run_kernels(kernels, w, dx, n_tok, dy, sc, gs));
        }
        BENCH_CHECK(cudaStreamEndCapture(gs, &graph));
        BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        std::vector<float> gms;
        for (int i = 0; i < iters + 2; ++i) {
          BENCH_CHECK(cudaEventRecord(tm.a, gs));
          BENCH_CHECK(cudaGraphLaunch(exec, gs));
          BENCH_CHECK(cudaEventRecord(tm.b, gs));
          BENCH_CHECK(cudaEventSynchronize(tm.b));
          float m = 0;
          BENCH_CHECK(cudaEventElapsedTime(&m, tm.a, tm.b));
          if (i >= 2) gms.push_back(m / reps);
        }
        (pdl ? graph_pdl_us : graph_us) = median(gms) * 1e3;
        kiln::cuda::set_launch_pdl(false);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(gs);
      }
      out.push_back(Result{std::string(kiln::dtype_name(t)), kernels_name(kernels), k, rows, n_tok,
                           mat_bytes / 1048576.0, sec * 1e6, gbps, gbps / read_gbps,
                           2.0 * double(k) * double(rows) * double(n_tok) / sec / 1e12, graph_us,
                           graph_pdl_us, worst, bound});
    }
    cudaFree(dx);
    cudaFree(dy);
  }
  for (void* m : mats) cudaFree(m);
  return out;
}

// A device copy of h (freed by the caller).
template <typename T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  BENCH_CHECK(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  BENCH_CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// The attention tables' check: with every V element 0.125 each output must be 0.125 (a wrong
// kernel is not timed).
void expect_all_eighths(const float* dout, size_t n, const char* what) {
  std::vector<float> out(n);
  BENCH_CHECK(cudaMemcpy(out.data(), dout, n * 4, cudaMemcpyDeviceToHost));
  for (float v : out)
    if (!(std::fabs(v - 0.125f) < 1e-6f)) {
      std::printf("cuda_matvec_bench: %s output %g, want 0.125\n", what, v);
      std::exit(1);
    }
}

// Split-K flash-decode attention (kernels.h launch_attention) on the 8B shape: 32 query heads
// over 8 KV heads of 128, one query (decode) or 4, contexts of 4k and 32k keys stored as a ring
// (physical rows rotated); the split kernel and the warp-tile kernel (DeviceAttention::
// warp_tiles) interleaved per iteration. GB/s counts the K and V bytes once per call.
void bench_attention(int iters, double read_gbps, int n_sm) {
  std::printf(
      "\n| attention (32/8 heads x 128, f16 KV) | keys | queries | KV MiB | split us | warp "
      "tiles us | warp tiles GB/s | of read BW (%.0f GB/s) |\n|---|---|---|---|---|---|---|---|\n",
      read_gbps);
  for (int64_t n_kv : {int64_t{4096}, int64_t{32768}}) {
    for (int64_t n_q : {int64_t{1}, int64_t{4}}) {
      kiln::cuda::DeviceAttention a;
      a.n_q = n_q, a.n_kv = n_kv, a.n_head = 32, a.n_head_kv = 8, a.head_dim = 128;
      a.scale = 1.0f / std::sqrt(128.0f);
      const int64_t kv_w = a.n_head_kv * a.head_dim, q_w = a.n_head * a.head_dim;
      std::vector<int32_t> rows(n_kv), pos(n_kv), q_pos(n_q);
      for (int64_t j = 0; j < n_kv; ++j) rows[j] = int32_t((j + 17) % n_kv), pos[j] = int32_t(j);
      for (int64_t i = 0; i < n_q; ++i) q_pos[i] = int32_t(n_kv - n_q + i);
      const size_t plane = size_t(n_kv * kv_w);
      std::vector<uint16_t> kv(plane, 0x3000);  // 0.125
      std::vector<float> q(size_t(n_q * q_w), 0.01f);
      uint16_t *dk = to_device(kv), *dv = to_device(kv);
      int32_t *drows = to_device(rows), *dpos = to_device(pos), *dqpos = to_device(q_pos);
      float *dq = to_device(q), *dout, *dpart;
      BENCH_CHECK(cudaMalloc(&dout, q.size() * 4));
      a.q = dq, a.k = dk, a.v = dv, a.kv_rows = drows, a.kv_pos = dpos, a.q_pos = dqpos;
      a.out = dout;
      kiln::cuda::DeviceAttention forms[2] = {a, a};
      forms[1].warp_tiles = true;
      size_t part = 0;
      for (const auto& f : forms)
        part = std::max(part, kiln::cuda::attention_scratch_floats(f, n_sm));
      BENCH_CHECK(cudaMalloc(&dpart, part * 4));
      for (const auto& f : forms) {
        BENCH_CHECK(cudaMemset(dout, 0, q.size() * 4));
        BENCH_CHECK(kiln::cuda::launch_attention(f, dpart, n_sm, nullptr));
        expect_all_eighths(dout, q.size(), f.warp_tiles ? "attention (warp tiles)" : "attention");
      }
      Timer tm;
      std::vector<float> ms[2];
      for (int i = 0; i < iters + 2; ++i) {
        for (int w = 0; w < 2; ++w) {
          BENCH_CHECK(cudaEventRecord(tm.a));
          for (int r = 0; r < 20; ++r)
            BENCH_CHECK(kiln::cuda::launch_attention(forms[w], dpart, n_sm, nullptr));
          BENCH_CHECK(cudaEventRecord(tm.b));
          BENCH_CHECK(cudaEventSynchronize(tm.b));
          float m = 0;
          BENCH_CHECK(cudaEventElapsedTime(&m, tm.a, tm.b));
          if (i >= 2) ms[w].push_back(m / 20);
        }
      }
      const double bytes = 2.0 * double(plane) * 2, sec = median(ms[1]) * 1e-3;
      std::printf("| decode | %lld | %lld | %.1f | %.1f | %.1f | %.0f | %.1f %% |\n",
                  (long long)n_kv, (long long)n_q, bytes / 1048576.0, median(ms[0]) * 1e3,
                  sec * 1e6, bytes / sec / 1e9, 100 * bytes / sec / 1e9 / read_gbps);
      std::fflush(stdout);
      for (void* p : {(void*)dk, (void*)dv, (void*)drows, (void*)dpos, (void*)dqpos, (void*)dq,
                      (void*)dout, (void*)dpart})
        cudaFree(p);
    }
  }
}

// Batched decode attention (kernels.h launch_attention_batch): S sequences of one query each
// (32/8 heads x 128, f16 KV, each sequence its own planes), each over `ctx` visible keys padded
// with invisible ones to the CUDA graph bucket (256 keys, as kiln's graph mode stages them), in
// one launch pair. Two forms interleaved per iteration: the split kernel and the warp-tile
// kernel. Checks the outputs (every V
// element 0.125) before timing; GB/s counts the visible keys' K and V bytes once.
void bench_attention_batch(int iters, int n_sm) {
  std::printf(
      "\n| batched decode attention (32/8 heads x 128) | sequences | visible keys | padded "
      "keys | split us | warp tiles us | warp tiles GB/s "
      "|\n|---|---|---|---|---|---|---|\n");
  for (int64_t n_seq : {int64_t{1}, int64_t{16}, int64_t{64}}) {
    for (int64_t ctx : {int64_t{64}, int64_t{128}, int64_t{1024}}) {
      const int64_t n_kv = (ctx + 255) / 256 * 256;
      const int64_t kv_w = 8 * 128, q_w = 32 * 128;
      const size_t plane = size_t(n_kv * kv_w);
      std::vector<uint16_t> kv(plane * size_t(n_seq), 0x3000);  // 0.125
      std::vector<int32_t> rows(n_kv), pos(n_kv);
      for (int64_t j = 0; j < n_kv; ++j) {
        rows[j] = j < ctx ? int32_t((j + 17) % ctx) : 0;
        pos[j] = j < ctx ? int32_t(j) : INT32_MAX;
      }
      const std::vector<int32_t> q_pos = {int32_t(ctx - 1)};
      const std::vector<float> q(size_t(n_seq * q_w), 0.01f);
      uint16_t *dk = to_device(kv), *dv = to_device(kv);
      int32_t *drows = to_device(rows), *dpos = to_device(pos), *dqpos = to_device(q_pos);
      float *dq = to_device(q), *dout;
      BENCH_CHECK(cudaMalloc(&dout, q.size() * 4));
      // Two plans (split kernel, warp tiles), each with its own scratch and device table.
      std::vector<kiln::cuda::AttentionBatchItem> items[2];
      float* dpart[2];
      kiln::cuda::AttentionBatchItem* ditems[2];
      for (int w = 0; w < 2; ++w) {
        items[w].resize(static_cast<size_t>(n_seq));
        size_t part_floats = 0;
        for (int64_t i = 0; i < n_seq; ++i) {
          kiln::cuda::DeviceAttention& a = items[w][size_t(i)].a;
          a.n_q = 1, a.n_kv = n_kv, a.n_head = 32, a.n_head_kv = 8, a.head_dim = 128;
          a.scale = 1.0f / std::sqrt(128.0f);
          a.q = dq + i * q_w, a.out = dout + i * q_w;
          a.k = dk + size_t(i) * plane, a.v = dv + size_t(i) * plane;
          a.kv_rows = drows, a.kv_pos = dpos, a.q_pos = dqpos;
          a.warp_tiles = w == 1;
          part_floats += kiln::cuda::attention_scratch_floats(a, n_sm);
        }
        BENCH_CHECK(cudaMalloc(&dpart[w], part_floats * 4));
        size_t off = 0;
        for (auto& it : items[w]) {
          it.part = dpart[w] + off;
          off += kiln::cuda::attention_scratch_floats(it.a, n_sm);
        }
        kiln::cuda::plan_attention_batch(items[w], n_sm);
        ditems[w] = to_device(items[w]);
        BENCH_CHECK(cudaMemset(dout, 0, q.size() * 4));
        BENCH_CHECK(kiln::cuda::launch_attention_batch(ditems[w], items[w], nullptr));
        expect_all_eighths(dout, q.size(),
                           w ? "batched attention (warp tiles)" : "batched attention");
      }
      // Form 0: the split kernel; 1: warp tiles.
      Timer tm;
      std::vector<float> ms[2];
      for (int i = 0; i < iters + 2; ++i) {
        for (int f = 0; f < 2; ++f) {
          const int w = f;
          BENCH_CHECK(cudaEventRecord(tm.a));
          for (int r = 0; r < 20; ++r)
            BENCH_CHECK(kiln::cuda::launch_attention_batch(ditems[w], items[w], nullptr));
          BENCH_CHECK(cudaEventRecord(tm.b));
          BENCH_CHECK(cudaEventSynchronize(tm.b));
          float m = 0;
          BENCH_CHECK(cudaEventElapsedTime(&m, tm.a, tm.b));
          if (i >= 2) ms[f].push_back(m / 20);
        }
      }
      const double bytes = double(n_seq) * double(ctx) * double(kv_w) * 2 * 2;
      std::printf("| decode | %lld | %lld | %lld | %.1f | %.1f | %.0f |\n", (long long)n_seq,
                  (long long)ctx, (long long)n_kv, median(ms[0]) * 1e3, median(ms[1]) * 1e3,
                  bytes / (median(ms[1]) * 1e-3) / 1e9);
      std::fflush(stdout);
      for (void* p :
           {(void*)dk, (void*)dv, (void*)drows, (void*)dpos, (void*)dqpos, (void*)dq, (void*)dout,
            (void*)dpart[0], (void*)dpart[1], (void*)ditems[0], (void*)ditems[1]})
        cudaFree(p);
    }
  }
}

// --float-rows-ab: V3's float-weight kernel with 1, 2 and 4 rows per warp (kernels.h
// launch_matvec_float_v3), interleaved per case on the same data, 1-8 tokens, the 8B shapes
// plus the 4096x1024 K/V projection; checks that every rows value gives rows = 1's bits and
// prints one table (us per call, back-to-back launches over weight copies > 4x L2).
// Device copies of one random rows x k matrix of type t (64 distinct rows, tiled), enough of
// them to pass 4x the L2, so rotating over them reads HBM. The caller frees them.
std::vector<void*> weight_copies(DType t, int64_t k, int64_t rows, size_t l2_bytes,
                                 std::mt19937_64& rng) {
  const size_t rb = *kiln::row_bytes(t, uint64_t(k));
  const size_t mat_bytes = rb * size_t(rows);
  std::vector<float> src(static_cast<size_t>(k));
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<std::byte> host(mat_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    if (r < 64) {
      for (float& v : src) v = dist(rng);
      kiln::quant::quantize_row(t, src, std::span<std::byte>(host).subspan(r * rb, rb));
    } else {
      std::memcpy(host.data() + r * rb, host.data() + (r % 64) * rb, rb);
    }
  }
  const int copies = int(std::max<size_t>(2, (4 * l2_bytes + mat_bytes - 1) / mat_bytes));
  std::vector<void*> mats(copies);
  for (void*& m : mats) {
    BENCH_CHECK(cudaMalloc(&m, mat_bytes));
    BENCH_CHECK(cudaMemcpy(m, host.data(), mat_bytes, cudaMemcpyHostToDevice));
  }
  return mats;
}

void bench_float_rows(int iters, size_t l2_bytes, double read_gbps, std::mt19937_64& rng) {
  std::printf(
      "\n| float kernel (v3) | k x rows | tokens | MiB | rows 1 us | rows 2 us | rows 4 us | best "
      "GB/s | of read BW (%.0f GB/s) | bits |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n",
      read_gbps);
  const struct {
    int64_t k, rows;
  } shapes[] = {{4096, 1024}, {4096, 4096}, {4096, 14336}, {14336, 4096}};
  for (DType t : {DType::F16, DType::BF16, DType::F32}) {
    for (const auto& sh : shapes) {
      const size_t rb = *kiln::row_bytes(t, uint64_t(sh.k));
      const size_t mat_bytes = rb * size_t(sh.rows);
      const std::vector<void*> mats = weight_copies(t, sh.k, sh.rows, l2_bytes, rng);
      const int copies = int(mats.size());
      for (int64_t n_tok : {1, 2, 4, 5, 8}) {
        std::vector<float> x(static_cast<size_t>(sh.k * n_tok));
        std::normal_distribution<float> xd(0.0f, 1.0f);
        for (float& v : x) v = xd(rng);
        float *dx = nullptr, *dy = nullptr;
        const size_t ny = size_t(sh.rows * n_tok);
        BENCH_CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
        BENCH_CHECK(cudaMalloc(&dy, ny * sizeof(float)));
        BENCH_CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
        kiln::cuda::DeviceWeight w{t, sh.k, sh.rows, rb, static_cast<const std::byte*>(mats[0])};
        std::vector<float> y1(ny), yr(ny);
        bool same = true;
        double us[3] = {0, 0, 0};
        const int row_opts[3] = {1, 2, 4};
        std::vector<float> ms[3];
        for (int i = 0; i < iters + 2; ++i) {
          for (int o = 0; o < 3; ++o) {  // interleaved: the three variants see the same moment
            Timer tm;
            constexpr int kReps = 20;
            BENCH_CHECK(cudaEventRecord(tm.a));
            for (int j = 0; j < kReps; ++j) {
              w.data = static_cast<const std::byte*>(mats[(i * kReps + j) % copies]);
              BENCH_CHECK(
                  kiln::cuda::launch_matvec_float_v3(w, dx, n_tok, dy, row_opts[o], nullptr));
            }
            BENCH_CHECK(cudaEventRecord(tm.b));
            BENCH_CHECK(cudaEventSynchronize(tm.b));
            float m = 0;
            BENCH_CHECK(cudaEventElapsedTime(&m, tm.a, tm.b));
            if (i >= 2) ms[o].push_back(m / kReps);
            if (i == 0) {  // every copy holds the same bytes: compare the last call's output
              BENCH_CHECK(cudaMemcpy(o == 0 ? y1.data() : yr.data(), dy, ny * sizeof(float),
                                     cudaMemcpyDeviceToHost));
              if (o > 0) same = same && std::memcmp(y1.data(), yr.data(), ny * sizeof(float)) == 0;
            }
          }
        }
        double best = 1e30;
        for (int o = 0; o < 3; ++o) best = std::min(best, us[o] = median(ms[o]) * 1e3);
        const double gbps = double(mat_bytes) / (best * 1e-6) / 1e9;
        std::printf("| %s | %lldx%lld | %lld | %.1f | %.1f | %.1f | %.1f | %.0f | %.1f %% | %s |\n",
                    kiln::dtype_name(t).data(), (long long)sh.k, (long long)sh.rows,
                    (long long)n_tok, mat_bytes / 1048576.0, us[0], us[1], us[2], gbps,
                    100 * gbps / read_gbps, same ? "same" : "DIFFER");
        std::fflush(stdout);
        cudaFree(dx);
        cudaFree(dy);
      }
      for (void* m : mats) cudaFree(m);
    }
  }
}

// --float-mma-ab: the tensor-core float kernel (launch_matvec_float_mma) against V3's float kernel
// at the rows per warp launch_matmul_v3 takes, interleaved, on the 8B shapes and the 1B drafter's
// (2048 wide), 1-8 tokens; the largest difference between the two relative to sum |w x|.
void bench_float_mma(int iters, size_t l2_bytes, double read_gbps, std::mt19937_64& rng) {
  std::printf(
      "\n| float kernel | k x rows | tokens | MiB | v3 us | mma us | v3 GB/s | mma GB/s | mma of "
      "read BW (%.0f GB/s) | mma / v3 | max |diff| / sum|wx| |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n",
      read_gbps);
  const struct {
    int64_t k, rows;
  } shapes[] = {{4096, 1024},  {4096, 4096}, {4096, 14336}, {14336, 4096}, {4096, 24576},
                {12288, 4096}, {2048, 2048}, {2048, 16384}, {8192, 2048}};
  for (DType t : {DType::F16, DType::BF16}) {
    for (const auto& sh : shapes) {
      const size_t rb = *kiln::row_bytes(t, uint64_t(sh.k));
      const size_t mat_bytes = rb * size_t(sh.rows);
      const std::vector<void*> mats = weight_copies(t, sh.k, sh.rows, l2_bytes, rng);
      const int copies = int(mats.size());
      std::vector<std::byte> host(mat_bytes);
      BENCH_CHECK(cudaMemcpy(host.data(), mats[0], mat_bytes, cudaMemcpyDeviceToHost));
      std::vector<float> deq(size_t(sh.k));
      for (int64_t n_tok : {1, 2, 4, 5, 8}) {
        std::vector<float> x(static_cast<size_t>(sh.k * n_tok));
        std::normal_distribution<float> xd(0.0f, 1.0f);
        for (float& v : x) v = xd(rng);
        float *dx = nullptr, *dy = nullptr;
        const size_t ny = size_t(sh.rows * n_tok);
        BENCH_CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
        BENCH_CHECK(cudaMalloc(&dy, ny * sizeof(float)));
        BENCH_CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
        kiln::cuda::DeviceWeight w{t, sh.k, sh.rows, rb, static_cast<const std::byte*>(mats[0])};
        const int rows = kiln::cuda::float_v3_rows(t, n_tok, sh.rows, sh.k);
        std::vector<float> y[2] = {std::vector<float>(ny), std::vector<float>(ny)};
        std::vector<float> ms[2];
        for (int i = 0; i < iters + 2; ++i) {
          for (int o = 0; o < 2; ++o) {
            Timer tm;
            constexpr int kReps = 20;
            BENCH_CHECK(cudaEventRecord(tm.a));
            for (int j = 0; j < kReps; ++j) {
              w.data = static_cast<const std::byte*>(mats[(i * kReps + j) % copies]);
              BENCH_CHECK(o == 0
                              ? kiln::cuda::launch_matvec_float_v3(w, dx, n_tok, dy, rows, nullptr)
                              : kiln::cuda::launch_matvec_float_mma(w, dx, n_tok, dy, nullptr));
            }
            BENCH_CHECK(cudaEventRecord(tm.b));
            BENCH_CHECK(cudaEventSynchronize(tm.b));
            float m = 0;
            BENCH_CHECK(cudaEventElapsedTime(&m, tm.a, tm.b));
            if (i >= 2) ms[o].push_back(m / kReps);
            if (i == 0)  // every copy holds the same bytes
              BENCH_CHECK(cudaMemcpy(y[o].data(), dy, ny * sizeof(float), cudaMemcpyDeviceToHost));
          }
        }
        // The two kernels' difference against the size of the products, over a few rows.
        double worst = 0;
        for (int64_t r = 0; r < sh.rows; r += std::max<int64_t>(1, sh.rows / 61)) {
          kiln::quant::dequantize_row(t, std::span<const std::byte>(host).subspan(r * rb, rb), deq);
          for (int64_t tok = 0; tok < n_tok; ++tok) {
            double abs_sum = 1e-30;
            for (int64_t c = 0; c < sh.k; ++c)
              abs_sum += std::fabs(double(deq[size_t(c)]) * x[size_t(tok * sh.k + c)]);
            const size_t i = size_t(tok * sh.rows + r);
            worst = std::max(worst, std::fabs(double(y[0][i]) - y[1][i]) / abs_sum);
          }
        }
        const double us0 = median(ms[0]) * 1e3, us1 = median(ms[1]) * 1e3;
        const double gb0 = double(mat_bytes) / (us0 * 1e-6) / 1e9;
        const double gb1 = double(mat_bytes) / (us1 * 1e-6) / 1e9;
        std::printf(
            "| %s | %lldx%lld | %lld | %.1f | %.1f | %.1f | %.0f | %.0f | %.1f %% | %.2f | %.1e "
            "|\n",
            kiln::dtype_name(t).data(), (long long)sh.k, (long long)sh.rows, (long long)n_tok,
            mat_bytes / 1048576.0, us0, us1, gb0, gb1, 100 * gb1 / read_gbps, us0 / us1, worst);
        std::fflush(stdout);
        cudaFree(dx);
        cudaFree(dy);
      }
      for (void* m : mats) cudaFree(m);
    }
  }
}

// --float-mma-sweep: the float_mma kernel's launch shapes (warps per block 4 / 8 / 16 x
// (unroll, m-tiles) (2,1) (4,1) (1,2) (2,2)) against V3's float kernel, F16, 1 and 5 tokens;
// us per call, interleaved; "policy" is float_mma_shape's choice.
void bench_float_mma_sweep(int iters, size_t l2_bytes, double read_gbps, std::mt19937_64& rng) {
  using kiln::cuda::FloatMmaShape;
  std::vector<FloatMmaShape> shapes_mma;
  for (int w : {4, 8, 16})
    for (const auto [u, m] : {std::pair{2, 1}, std::pair{4, 1}, std::pair{1, 2}, std::pair{2, 2}})
      shapes_mma.push_back({w, u, m});
  std::printf("\n| f16 k x rows | tokens | v3 us | policy | policy us |");
  for (const FloatMmaShape& sh : shapes_mma)
    std::printf(" w%d u%d m%d |", sh.warps, sh.unroll, sh.mtiles);
  std::printf(" best GB/s (of %.0f) |\n|---|---|---|---|---|", read_gbps);
  for (size_t i = 0; i <= shapes_mma.size(); ++i) std::printf("---|");
  std::printf("\n");
  const struct {
    int64_t k, rows;
  } shapes[] = {{4096, 1024}, {4096, 4096}, {4096, 14336}, {14336, 4096}, {4096, 24576},
                {2048, 2048}, {2048, 512},  {2048, 16384}, {8192, 2048},  {2048, 128256}};
  const DType t = DType::F16;
  for (const auto& sh : shapes) {
    const size_t rb = *kiln::row_bytes(t, uint64_t(sh.k));
    const size_t mat_bytes = rb * size_t(sh.rows);
    const std::vector<void*> mats = weight_copies(t, sh.k, sh.rows, l2_bytes, rng);
    const int copies = int(mats.size());
    for (int64_t n_tok : {1, 5}) {
      std::vector<float> x(static_cast<size_t>(sh.k * n_tok));
      std::normal_distribution<float> xd(0.0f, 1.0f);
      for (float& v : x) v = xd(rng);
      float *dx = nullptr, *dy = nullptr;
      BENCH_CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
      BENCH_CHECK(cudaMalloc(&dy, size_t(sh.rows * n_tok) * sizeof(float)));
      BENCH_CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
      kiln::cuda::DeviceWeight w{t, sh.k, sh.rows, rb, static_cast<const std::byte*>(mats[0])};
      const int rows = kiln::cuda::float_v3_rows(t, n_tok, sh.rows, sh.k);
      const size_t nv = shapes_mma.size() + 2;  // v3, policy, the sweep
      std::vector<std::vector<float>> ms(nv);
      for (int i = 0; i < iters + 2; ++i) {
        for (size_t o = 0; o < nv; ++o) {
          kiln::cuda::set_float_mma_shape(o >= 2 ? shapes_mma[o - 2] : FloatMmaShape{});
          Timer tm;
          constexpr int kReps = 20;
          BENCH_CHECK(cudaEventRecord(tm.a));
          for (int j = 0; j < kReps; ++j) {
            w.data = static_cast<const std::byte*>(mats[(i * kReps + j) % copies]);
            BENCH_CHECK(o == 0 ? kiln::cuda::launch_matvec_float_v3(w, dx, n_tok, dy, rows, nullptr)
                               : kiln::cuda::launch_matvec_float_mma(w, dx, n_tok, dy, nullptr));
          }
          BENCH_CHECK(cudaEventRecord(tm.b));
          BENCH_CHECK(cudaEventSynchronize(tm.b));
          float m = 0;
          BENCH_CHECK(cudaEventElapsedTime(&m, tm.a, tm.b));
          if (i >= 2) ms[o].push_back(m / kReps);
        }
      }
      kiln::cuda::set_float_mma_shape({});
      const FloatMmaShape pol = kiln::cuda::float_mma_shape(sh.rows, sh.k);
      std::printf("| %lldx%lld | %lld | %.1f | w%d u%d m%d | %.1f |", (long long)sh.k,
                  (long long)sh.rows, (long long)n_tok, median(ms[0]) * 1e3, pol.warps, pol.unroll,
                  pol.mtiles, median(ms[1]) * 1e3);
      double best = 1e30;
      for (size_t o = 2; o < nv; ++o) {
        const double us = median(ms[o]) * 1e3;
        best = std::min(best, us);
        std::printf(" %.1f |", us);
      }
      std::printf(" %.0f |\n", double(mat_bytes) / (best * 1e-6) / 1e9);
      std::fflush(stdout);
      cudaFree(dx);
      cudaFree(dy);
    }
    for (void* m : mats) cudaFree(m);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20;
  std::string only;
  bool float_rows_ab = false, float_mma_ab = false, float_mma_sweep = false;
  bool attention = true;
  std::string only_shapes;  // ",4096x14336," style
  std::vector<int64_t> n_toks = {1, 4, 16, 64};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--types") == 0 && i + 1 < argc) {
      only = std::string(",").append(argv[++i]).append(",");
    } else if (std::strcmp(argv[i], "--float-rows-ab") == 0) {
      float_rows_ab = true;
    } else if (std::strcmp(argv[i], "--float-mma-ab") == 0) {
      float_mma_ab = true;
    } else if (std::strcmp(argv[i], "--float-mma-sweep") == 0) {
      float_mma_sweep = true;
    } else if (std::strcmp(argv[i], "--mma-min") == 0 && i + 1 < argc) {
      g_mma_min = std::max(0, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--mma-stages") == 0 && i + 1 < argc) {
      kiln::cuda::set_mma_stages(std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--mma-warps") == 0 && i + 1 < argc) {
      kiln::cuda::set_mma_warps(std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--no-attention") == 0) {
      attention = false;
    } else if (std::strcmp(argv[i], "--shapes") == 0 && i + 1 < argc) {
      only_shapes = std::string(",").append(argv[++i]).append(",");
    } else if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) {
      n_toks.clear();
      for (const char* p = argv[++i]; *p;) {
        char* end = nullptr;
        const long v = std::strtol(p, &end, 10);
        if (end == p || v < 1 || v > kiln::cuda::kQ8MaxTokens) {
          std::fprintf(stderr, "cuda_matvec_bench: --tokens: expected 1..64, comma-separated\n");
          return 2;
        }
        n_toks.push_back(v);
        p = *end == ',' ? end + 1 : end;
      }
    } else {
      std::fprintf(
          stderr,
          "usage: cuda_matvec_bench [--iters N] [--types t1,t2,...] "
          "[--shapes KxR,...] [--tokens N,...] [--no-attention] "
          "[--float-rows-ab] [--float-mma-ab] [--float-mma-sweep] [--mma-min N] [--mma-stages N] "
          "[--mma-warps N] [--[no-]mma-pre-scales]\n");
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
  if (float_rows_ab) {
    std::mt19937_64 rng(7);
    bench_float_rows(iters, size_t(prop.l2CacheSize), read_gbps, rng);
    return 0;
  }
  if (float_mma_ab) {
    std::mt19937_64 rng(7);
    bench_float_mma(iters, size_t(prop.l2CacheSize), read_gbps, rng);
    return 0;
  }
  if (float_mma_sweep) {
    std::mt19937_64 rng(7);
    bench_float_mma_sweep(iters, size_t(prop.l2CacheSize), read_gbps, rng);
    return 0;
  }

  const DType types[] = {DType::F32,  DType::F16,  DType::BF16, DType::Q8_0, DType::Q4_0,
                         DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q2_K, DType::Q3_K,
                         DType::Q4_K, DType::Q5_K, DType::Q6_K};
  struct Shape {
    int64_t k, rows;
  };
  const Shape shapes[] = {{4096, 4096}, {4096, 14336}, {14336, 4096}, {4096, 32000}};
  const std::vector<kiln::cuda::MatmulKernels> sets = {kiln::cuda::MatmulKernels::V2,
                                                       kiln::cuda::MatmulKernels::V3};
  if (attention) {
    bench_attention(iters, read_gbps, prop.multiProcessorCount);
    bench_attention_batch(iters, prop.multiProcessorCount);
  }
  std::mt19937_64 rng(42);
  Scratch sc;
  sc.act_bytes = kiln::cuda::act_q8_bytes(14336, kiln::cuda::kQ8MaxTokens);
  BENCH_CHECK(cudaMalloc(&sc.act, sc.act_bytes));
  std::vector<Result> results;
  for (DType t : types) {
    std::string key = ",";
    key += kiln::dtype_name(t);
    key += ",";
    if (!only.empty() && only.find(key) == std::string::npos) continue;
    for (const Shape& sh : shapes) {
      char sk[48];
      std::snprintf(sk, sizeof sk, ",%lldx%lld,", (long long)sh.k, (long long)sh.rows);
      if (!only_shapes.empty() && only_shapes.find(sk) == std::string::npos) continue;
      for (const Result& r : bench_type(t, sh.k, sh.rows, n_toks, sets, iters,
                                        size_t(prop.l2CacheSize), read_gbps, rng, sc)) {
        results.push_back(r);
        std::printf(
            "%-5s %-3s %5lldx%-5lld tok %3lld %8.1f MiB %9.1f us %7.0f GB/s %5.1f %% %7.2f "
            "TFLOP/s  rel err %.1e\n",
            r.type.c_str(), r.kernels.c_str(), (long long)r.k, (long long)r.rows,
            (long long)r.n_tok, r.mib, r.us, r.gbps, 100 * r.frac, r.tflops, r.max_rel_err);
        std::fflush(stdout);
      }
    }
  }
  cudaFree(sc.act);
  bool ok = true;
  for (const Result& r : results) {
    if (!(r.max_rel_err < r.err_bound)) {
      ok = false;
      std::printf("cuda_matvec_bench: %s %s %lldx%lld %lld tokens: rel err %.2e over %.0e\n",
                  r.type.c_str(), r.kernels.c_str(), (long long)r.k, (long long)r.rows,
                  (long long)r.n_tok, r.max_rel_err, r.err_bound);
    }
  }
  // Full table: V3 against V2 (same data, same run) per type, shape and token count.
  auto find = [&](const Result& like, const char* kernels) -> const Result* {
    for (const Result& r : results)
      if (r.type == like.type && r.k == like.k && r.rows == like.rows && r.n_tok == like.n_tok &&
          r.kernels == kernels)
        return &r;
    return nullptr;
  };
  std::printf(
      "\n| type | k x rows | tokens | MiB | v2 us | v3 us | v3 GB/s | v3 of read BW (%.0f GB/s) | "
      "v3 TFLOP/s | v3 speedup | v3 in a graph: us, of read BW | graph with PDL: us, of read BW |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|\n",
      read_gbps);
  for (const Result& r : results) {
    if (r.kernels != "v3") continue;
    const Result* v2 = find(r, "v2");
    char graph[64] = "", graph_pdl[64] = "";
    if (r.graph_us > 0)
      std::snprintf(graph, sizeof graph, "%.1f, %.1f %%", r.graph_us,
                    100 * r.mib * 1048576.0 / (r.graph_us * 1e-6) / 1e9 / read_gbps);
    if (r.graph_pdl_us > 0)
      std::snprintf(graph_pdl, sizeof graph_pdl, "%.1f, %.1f %%", r.graph_pdl_us,
                    100 * r.mib * 1048576.0 / (r.graph_pdl_us * 1e-6) / 1e9 / read_gbps);
    std::printf(
        "| %s | %lldx%lld | %lld | %.1f | %.1f | %.1f | %.0f | %.1f %% | %.2f | %.2fx | %s | %s "
        "|\n",
        r.type.c_str(), (long long)r.k, (long long)r.rows, (long long)r.n_tok, r.mib,
        v2 ? v2->us : 0.0, r.us, r.gbps, 100 * r.frac, r.tflops, v2 ? v2->us / r.us : 0.0, graph,
        graph_pdl);
  }
  // Decode summary: one token, V3's share of the read bandwidth per type and shape.
  std::printf(
      "\n| type (1 token, v3 %% of %.0f GB/s; in a graph) | 4096x4096 | 4096x14336 | "
      "14336x4096 | 4096x32000 |\n|---|---|---|---|---|\n",
      read_gbps);
  for (DType t : types) {
    std::string line = "| " + std::string(kiln::dtype_name(t)) + " |";
    bool any = false;
    for (const Shape& sh : shapes) {
      Result like{
          std::string(kiln::dtype_name(t)), "v3", sh.k, sh.rows, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
      const Result* r = find(like, "v3");
      char cell[64] = " |";
      if (r)
        std::snprintf(cell, sizeof cell, " %.1f %%; %.1f %% |", 100 * r->frac,
                      r->graph_us > 0
                          ? 100 * r->mib * 1048576.0 / (r->graph_us * 1e-6) / 1e9 / read_gbps
                          : 0.0);
      line += cell;
      any = any || r;
    }
    if (any) std::printf("%s\n", line.c_str());
  }
  if (!ok) {
    std::printf("cuda_matvec_bench: FAILED: a kernel disagrees with the host dequantization\n");
    return 1;
  }
  return 0;
}
