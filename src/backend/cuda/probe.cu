// backend/cuda/probe.cu: a streaming-read kernel, the device-memory bandwidth reference that
// benchmarks measure the matvec kernels against in the same run.
#include <cuda_runtime.h>

#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

// Reads n float4 (16-byte loads, coalesced) and folds them into one value per block, stored
// only on an impossible sum, so the loads stay alive without a write stream.
__global__ void read_probe_kernel(const float4* __restrict__ p, int64_t n, float* sink) {
  float acc = 0.0f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = __ldg(p + i);
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 1234.5f) sink[blockIdx.x] = acc;
}

}  // namespace

cudaError_t launch_read_probe(const void* data, size_t bytes, float* sink, int blocks,
                              cudaStream_t s) {
  read_probe_kernel<<<blocks, 512, 0, s>>>(static_cast<const float4*>(data),
                                           int64_t(bytes / sizeof(float4)), sink);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
