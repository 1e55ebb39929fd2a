// backend/cuda/get_rows.cu: embedding lookup, out[i][:] = dequantized row ids[i] of w.
#include <cuda_runtime.h>

#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda {
namespace {

// grid: n_ids blocks; each thread decodes whole units of its block's row.
template <DType T>
__global__ void get_rows_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_cols,
                                const int32_t* __restrict__ ids, float* __restrict__ out) {
  pdl_enter();
  const int64_t i = blockIdx.x;
  const uint8_t* row = w + int64_t(ids[i]) * row_bytes;
  float* dst = out + i * n_cols;
  const int64_t n_units = units_per_row(n_cols);
  for (int64_t u = threadIdx.x; u < n_units; u += blockDim.x) {
    float v[kUnit];
    dequant_unit<T, 2>(row, u, n_cols, v);
    const int64_t c0 = u * kUnit;
#pragma unroll
    for (int l = 0; l < kUnit; ++l)
      if (c0 + l < n_cols) dst[c0 + l] = v[l];
  }
}

}  // namespace

cudaError_t launch_get_rows(const DeviceWeight& w, const int32_t* ids, int64_t n_ids, float* out,
                            cudaStream_t s) {
  if (!cuda_supports(w.dtype)) return cudaErrorInvalidValue;
  if (n_ids == 0 || w.n_cols == 0) return cudaSuccess;
  cudaError_t e = cudaErrorInvalidValue;
  dispatch_dtype(w.dtype, [&]<DType T>() {
    e = launch(get_rows_kernel<T>, unsigned(n_ids), 128, 0, s,
               reinterpret_cast<const uint8_t*>(w.data), w.row_bytes, w.n_cols, ids, out);
  });
  return e;
}

}  // namespace kiln::cuda
