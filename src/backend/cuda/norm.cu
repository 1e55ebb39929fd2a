// backend/cuda/norm.cu: row-wise RMSNorm and softmax, one block per row.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ weight,
                               int64_t n, float eps, float* __restrict__ y) {
  __shared__ float shm[32];
  pdl_enter();
  const float* xr = x + int64_t(blockIdx.x) * n;
  float* yr = y + int64_t(blockIdx.x) * n;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  ss = block_reduce_sum(ss, shm);
  const float inv = rsqrtf(ss / float(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    yr[i] = weight ? xr[i] * inv * weight[i] : xr[i] * inv;
}

// Rows of n = 4 * kVecThreads * V floats or fewer, 16-byte aligned: each thread loads its V
// float4s of x (and of the weight) once, all before the first use, so the row costs one memory
// round trip instead of one per loop trip of the kernel above (a 4096-wide decode row spent
// ~13 us there, latency-bound on 16 dependent trips per thread).
// kAdd: the residual add in front (add_rmsnorm): x += a is written back and normalised from
// the registers, so x's bits are launch_binary(Add)'s (x + a, one IEEE add) and y's are this
// kernel's on them: one body for both, the same bits by construction.
constexpr int kVecThreads = 512;
template <int V, bool kAdd>
__global__ void __launch_bounds__(kVecThreads)
    rmsnorm_vec_kernel(float4* __restrict__ x, const float4* __restrict__ a,
                       const float4* __restrict__ weight, int64_t n4, float eps,
                       float4* __restrict__ y) {
  __shared__ float shm[32];
  pdl_enter();
  float4* xr = x + int64_t(blockIdx.x) * n4;
  float4* yr = y + int64_t(blockIdx.x) * n4;
  float4 v[V], w[V];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t i = threadIdx.x + int64_t(k) * kVecThreads;
    v[k] = i < n4 ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // The weight in the same round trip as x (after the block's reduction it would be a second).
    w[k] = weight && i < n4 ? weight[i] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    if constexpr (kAdd) {
      if (i < n4) {
        const float4 q = a[int64_t(blockIdx.x) * n4 + i];
        v[k] = make_float4(__fadd_rn(v[k].x, q.x), __fadd_rn(v[k].y, q.y), __fadd_rn(v[k].z, q.z),
                           __fadd_rn(v[k].w, q.w));
        xr[i] = v[k];
      }
    }
  }
#pragma unroll
  for (int k = 0; k < V; ++k)
    ss = fmaf(v[k].w, v[k].w, fmaf(v[k].z, v[k].z, fmaf(v[k].y, v[k].y, fmaf(v[k].x, v[k].x, ss))));
  ss = block_reduce_sum(ss, shm);
  const float inv = rsqrtf(ss / float(4 * n4) + eps);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t i = threadIdx.x + int64_t(k) * kVecThreads;
    if (i >= n4) break;
    float4 o = make_float4(v[k].x * inv, v[k].y * inv, v[k].z * inv, v[k].w * inv);
    if (weight) o.x *= w[k].x, o.y *= w[k].y, o.z *= w[k].z, o.w *= w[k].w;
    yr[i] = o;
  }
}

// The float4 path when the row fits it (launch_rmsnorm and launch_add_rmsnorm must take the
// same path for the same row, or their bits would differ); false: not taken.
template <bool kAdd>
bool launch_vec(float* x, const float* a, const float* weight, int64_t n_rows, int64_t n, float eps,
                float* y, cudaStream_t s, cudaError_t* err) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!(n % 4 == 0 && n <= 4 * kVecThreads * 4 && aligned(x) && aligned(y) &&
        (weight == nullptr || aligned(weight)) && (!kAdd || aligned(a))))
    return false;
  auto* x4 = reinterpret_cast<float4*>(x);
  const auto* a4 = reinterpret_cast<const float4*>(a);
  const auto* w4 = reinterpret_cast<const float4*>(weight);
  auto* y4 = reinterpret_cast<float4*>(y);
  const int64_t n4 = n / 4;
  // Threads: enough for the row (a multiple of 32), so a short row (a QK-norm head) does
  // not leave most of a 512-thread block idle.
  const int threads = int(std::min<int64_t>(kVecThreads, (n4 + 31) / 32 * 32));
  cudaError_t e;
  if (n4 <= kVecThreads)
    e = launch(rmsnorm_vec_kernel<1, kAdd>, unsigned(n_rows), threads, 0, s, x4, a4, w4, n4, eps,
               y4);
  else if (n4 <= 2 * kVecThreads)
    e = launch(rmsnorm_vec_kernel<2, kAdd>, unsigned(n_rows), kVecThreads, 0, s, x4, a4, w4, n4,
               eps, y4);
  else
    e = launch(rmsnorm_vec_kernel<4, kAdd>, unsigned(n_rows), kVecThreads, 0, s, x4, a4, w4, n4,
               eps, y4);
  *err = e;
  return true;
}

__global__ void softmax_kernel(float* __restrict__ x, int64_t n) {
  __shared__ float shm[32];
  float* xr = x + int64_t(blockIdx.x) * n;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, xr[i]);
  mx = block_reduce_max(mx, shm);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) sum += expf(xr[i] - mx);
  sum = block_reduce_sum(sum, shm);
  const float inv = 1.0f / sum;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) xr[i] = expf(xr[i] - mx) * inv;
}

}  // namespace

cudaError_t launch_rmsnorm(const float* x, const float* weight, int64_t n_rows, int64_t n,
                           float eps, float* y, cudaStream_t s) {
  if (n_rows == 0) return cudaSuccess;
  // kAdd = false never writes x.
  cudaError_t e = cudaSuccess;
  if (launch_vec<false>(const_cast<float*>(x), nullptr, weight, n_rows, n, eps, y, s, &e)) return e;
  return launch(rmsnorm_kernel, unsigned(n_rows), kThreads, 0, s, x, weight, n, eps, y);
}

cudaError_t launch_add_rmsnorm(float* x, const float* a, const float* weight, int64_t n_rows,
                               int64_t n, float eps, float* y, cudaStream_t s) {
  if (n_rows == 0) return cudaSuccess;
  cudaError_t e = cudaSuccess;
  if (launch_vec<true>(x, a, weight, n_rows, n, eps, y, s, &e)) return e;
  if (cudaError_t e = launch_binary(x, a, x, n_rows * n, Binary::Add, s); e != cudaSuccess)
    return e;
  return launch_rmsnorm(x, weight, n_rows, n, eps, y, s);
}

cudaError_t launch_softmax(float* x, int64_t n_rows, int64_t n, cudaStream_t s) {
  if (n_rows == 0) return cudaSuccess;
  softmax_kernel<<<unsigned(n_rows), kThreads, 0, s>>>(x, n);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
