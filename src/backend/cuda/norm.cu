// backend/cuda/norm.cu: row-wise RMSNorm and softmax, one block per row.
#include <cuda_runtime.h>

#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ weight,
                               int64_t n, float eps, float* __restrict__ y) {
  __shared__ float shm[32];
  const float* xr = x + int64_t(blockIdx.x) * n;
  float* yr = y + int64_t(blockIdx.x) * n;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
  ss = block_reduce_sum(ss, shm);
  const float inv = rsqrtf(ss / float(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    yr[i] = weight ? xr[i] * inv * weight[i] : xr[i] * inv;
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
  rmsnorm_kernel<<<unsigned(n_rows), kThreads, 0, s>>>(x, weight, n, eps, y);
  return cudaGetLastError();
}

cudaError_t launch_softmax(float* x, int64_t n_rows, int64_t n, cudaStream_t s) {
  if (n_rows == 0) return cudaSuccess;
  softmax_kernel<<<unsigned(n_rows), kThreads, 0, s>>>(x, n);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
