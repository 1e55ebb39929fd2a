// backend/cuda/block_reduce.cuh: warp and block reductions shared by the row kernels.
#pragma once

#include <cuda_runtime.h>

namespace kiln::cuda {

__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum / max over the whole block (blockDim.x a multiple of 32, <= 1024); every thread gets the
// result. `shm` holds 32 floats; the function synchronises before reusing it.
__device__ __forceinline__ float block_reduce_sum(float v, float* shm) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  v = warp_reduce_sum(v);
  __syncthreads();
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  v = lane < n_warps ? shm[lane] : 0.0f;
  return warp_reduce_sum(v);
}
__device__ __forceinline__ float block_reduce_max(float v, float* shm) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  v = warp_reduce_max(v);
  __syncthreads();
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  v = lane < n_warps ? shm[lane] : -INFINITY;
  return warp_reduce_max(v);
}

}  // namespace kiln::cuda
