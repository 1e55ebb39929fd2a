// backend/cuda/top_k.cu: each row's k largest values in sampling order (descending value,
// ascending index on ties), so a sampler gets k candidates per row instead of downloading the
// whole vocabulary. Passes of chunk sorts: every block bitonic-sorts a chunk of 1024 (value,
// index) pairs in shared memory and keeps its first k; the chunks' survivors are the next
// pass's input, until one chunk holds them all. A fixed network with a total order (value,
// then index), so the result does not depend on scheduling. k = 1 (greedy decoding, drafts,
// greedy verification) takes a reduction instead of the sorts: the first pair in that total
// order is unique, so it is the pair the sorts would put first.
#include <cuda_runtime.h>

#include <climits>

#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kChunk = 1024;
constexpr int kThreads = kChunk / 2;  // one compare-exchange per thread and step
static_assert(2 * kTopKMax <= kChunk, "a pass must at least halve its input");

// Sampling order: the larger value first, then the smaller index (sampling/sampler.h).
__device__ __forceinline__ bool before(float va, int32_t ia, float vb, int32_t ib) {
  return va > vb || (va == vb && ia < ib);
}

// grid (chunks, rows): block (c, r) sorts in[r][c * kChunk ..] (indices: in_i, or the
// position when in_i is null; past n_in: -inf at index INT_MAX, after every real pair) and
// writes its first k pairs to out[r][c][0..k).
__global__ void __launch_bounds__(kThreads)
    top_k_chunk_kernel(const float* __restrict__ in_v, const int32_t* __restrict__ in_i,
                       int64_t n_in, int32_t k, float* __restrict__ out_v,
                       int32_t* __restrict__ out_i) {
  __shared__ float v[kChunk];
  __shared__ int32_t id[kChunk];
  pdl_enter();
  const int64_t row = blockIdx.y, base = int64_t(blockIdx.x) * kChunk;
  for (int t = threadIdx.x; t < kChunk; t += blockDim.x) {
    const int64_t j = base + t;
    const bool in = j < n_in;
    v[t] = in ? in_v[row * n_in + j] : -INFINITY;
    id[t] = !in ? INT_MAX : in_i ? in_i[row * n_in + j] : int32_t(j);
  }
  __syncthreads();
  for (int size = 2; size <= kChunk; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const int t = threadIdx.x;
      const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
      const bool first_half = (lo & size) == 0;  // this run ends in sampling order
      const float va = v[lo], vb = v[hi];
      const int32_t ia = id[lo], ib = id[hi];
      if (first_half ? before(vb, ib, va, ia) : before(va, ia, vb, ib)) {
        v[lo] = vb, v[hi] = va;
        id[lo] = ib, id[hi] = ia;
      }
      __syncthreads();
    }
  }
  const int64_t o = (row * gridDim.x + blockIdx.x) * k;
  for (int t = threadIdx.x; t < k; t += blockDim.x) out_v[o + t] = v[t], out_i[o + t] = id[t];
}

// k = 1: block (c, r) writes the first pair in sampling order of in[r][c * kChunk1 ..] to
// out[r][c] (indices as above; an empty tail is -inf at INT_MAX, as the sorts pad).
constexpr int kChunk1 = 8192, kThreads1 = 256;
__device__ __forceinline__ void keep_first(float& bv, int32_t& bi, float v, int32_t i) {
  if (before(v, i, bv, bi)) bv = v, bi = i;
}
__global__ void __launch_bounds__(kThreads1)
    top_1_chunk_kernel(const float* __restrict__ in_v, const int32_t* __restrict__ in_i,
                       int64_t n_in, float* __restrict__ out_v, int32_t* __restrict__ out_i) {
  pdl_enter();
  const int64_t row = blockIdx.y, base = int64_t(blockIdx.x) * kChunk1;
  float bv = -INFINITY;
  int32_t bi = INT_MAX;
  for (int t = threadIdx.x; t < kChunk1; t += kThreads1) {
    const int64_t j = base + t;
    if (j < n_in)
      keep_first(bv, bi, in_v[row * n_in + j], in_i ? in_i[row * n_in + j] : int32_t(j));
  }
  for (int o = kWarp / 2; o > 0; o >>= 1)
    keep_first(bv, bi, __shfl_xor_sync(~0u, bv, o), __shfl_xor_sync(~0u, bi, o));
  __shared__ float wv[kThreads1 / kWarp];
  __shared__ int32_t wi[kThreads1 / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) wv[warp] = bv, wi[warp] = bi;
  __syncthreads();
  if (warp != 0) return;
  bv = lane < kThreads1 / kWarp ? wv[lane] : -INFINITY;
  bi = lane < kThreads1 / kWarp ? wi[lane] : INT_MAX;
  for (int o = kWarp / 2; o > 0; o >>= 1)
    keep_first(bv, bi, __shfl_xor_sync(~0u, bv, o), __shfl_xor_sync(~0u, bi, o));
  if (lane == 0) out_v[row * gridDim.x + blockIdx.x] = bv, out_i[row * gridDim.x + blockIdx.x] = bi;
}

int64_t chunks_of(int64_t n) { return (n + kChunk - 1) / kChunk; }

}  // namespace

size_t top_k_scratch(int64_t rows, int64_t n, int32_t k) { return size_t(rows * chunks_of(n) * k); }

cudaError_t launch_top_k(const float* x, int64_t rows, int64_t n, int32_t k, float* scratch_v,
                         int32_t* scratch_i, float* out_v, int32_t* out_i, cudaStream_t s) {
  if (rows <= 0 || rows > 65535 || n <= 0 || k < 1 || k > kTopKMax || k > n)
    return cudaErrorInvalidValue;
  const size_t half = top_k_scratch(rows, n, k);
  const float* in_v = x;
  const int32_t* in_i = nullptr;
  int64_t n_in = n;
  if (k == 1) {  // fewer survivors per pass than the sorts leave: within their scratch
    for (int pass = 0;; ++pass) {
      const int64_t chunks = (n_in + kChunk1 - 1) / kChunk1;
      const bool last = chunks == 1;
      float* ov = last ? out_v : scratch_v + (pass % 2) * half;
      int32_t* oi = last ? out_i : scratch_i + (pass % 2) * half;
      if (cudaError_t e = launch(top_1_chunk_kernel, dim3(unsigned(chunks), unsigned(rows)),
                                 kThreads1, 0, s, in_v, in_i, n_in, ov, oi);
          e != cudaSuccess)
        return e;
      if (last) return cudaSuccess;
      in_v = ov, in_i = oi, n_in = chunks;
    }
  }
  for (int pass = 0;; ++pass) {
    const int64_t chunks = chunks_of(n_in);
    const bool last = chunks == 1;
    float* ov = last ? out_v : scratch_v + (pass % 2) * half;
    int32_t* oi = last ? out_i : scratch_i + (pass % 2) * half;
    if (cudaError_t e = launch(top_k_chunk_kernel, dim3(unsigned(chunks), unsigned(rows)), kThreads,
                               0, s, in_v, in_i, n_in, k, ov, oi);
        e != cudaSuccess)
      return e;
    if (last) return cudaSuccess;
    in_v = ov, in_i = oi, n_in = chunks * k;
  }
}

}  // namespace kiln::cuda
