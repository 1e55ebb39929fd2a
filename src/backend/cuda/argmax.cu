// backend/cuda/argmax.cu: index of the largest value, first on ties, in one block (a vocab
// row is at most a few hundred thousand floats: one block streams it in microseconds).
#include <cuda_runtime.h>

#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 1024;

// (value, index) order: larger value wins, then the smaller index.
__device__ __forceinline__ bool better(float v, int64_t i, float bv, int64_t bi) {
  return v > bv || (v == bv && i < bi);
}

__global__ void argmax_kernel(const float* __restrict__ x, int64_t n, int64_t* out) {
  __shared__ float sv[32];
  __shared__ int64_t si[32];
  pdl_enter();
  float bv = -INFINITY;
  int64_t bi = n;  // n: "none yet" (an all -inf / NaN row ends at index 0 below)
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    if (better(x[i], i, bv, bi)) bv = x[i], bi = i;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (warp == 0) {
    bv = lane < int(blockDim.x / 32) ? sv[lane] : -INFINITY;
    bi = lane < int(blockDim.x / 32) ? si[lane] : n;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    if (lane == 0) *out = bi < n ? bi : 0;
  }
}

}  // namespace

cudaError_t launch_argmax(const float* x, int64_t n, int64_t* out, cudaStream_t s) {
  return launch(argmax_kernel, 1, kThreads, 0, s, x, n, out);
}

}  // namespace kiln::cuda
