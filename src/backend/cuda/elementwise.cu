// backend/cuda/elementwise.cu: unary and binary elementwise ops, and the f32 -> f16 KV row
// store. Grid-stride loops; GeGLU uses ggml's tanh form of gelu, as the reference does.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "backend/cuda/act.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return unsigned(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

__global__ void unary_kernel(float* __restrict__ x, int64_t n, Unary op, float p) {
  pdl_enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = x[i];
    switch (op) {
      case Unary::Scale:
        x[i] = v * p;
        break;
      case Unary::Softcap:
        x[i] = p * tanhf(v / p);
        break;
      case Unary::Sigmoid:
        x[i] = 1.0f / (1.0f + expf(-v));
        break;
    }
  }
}

// Not __restrict__: out may alias a or b (each element is read before it is written).
__global__ void binary_kernel(const float* a, const float* b, float* out, int64_t n, Binary op) {
  pdl_enter();
  constexpr float kSqrt2OverPi = 0.79788456080286535588f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = a[i], y = b[i];
    float r = 0.0f;
    switch (op) {
      case Binary::Add:
        r = x + y;
        break;
      case Binary::Mul:
        r = x * y;
        break;
      case Binary::SwiGLU:
        r = swiglu_one(x, y);
        break;
      case Binary::GeGLU:
        r = 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * x * (1.0f + 0.044715f * x * x))) * y;
        break;
      case Binary::SwiGLUOai: {
        const float g = fminf(x, kOaiLimit), u = fminf(fmaxf(y, -kOaiLimit), kOaiLimit);
        r = g / (1.0f + expf(kOaiAlpha * (-g))) * (u + 1.0f);
        break;
      }
    }
    out[i] = r;
  }
}

__global__ void store_rows_f16_kernel(const float* __restrict__ src, int64_t width,
                                      const int32_t* __restrict__ rows, int64_t n_rows,
                                      uint16_t* __restrict__ plane) {
  pdl_enter();
  const int64_t n = n_rows * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    // __float2half_rn rounds to nearest even, as core/half.h's f32_to_f16.
    plane[int64_t(rows[r]) * width + c] = __half_as_ushort(__float2half_rn(src[i]));
  }
}

__global__ void gather_rows_kernel(const float* __restrict__ src, int64_t width,
                                   const int32_t* __restrict__ ids, int64_t n_rows,
                                   float* __restrict__ dst) {
  pdl_enter();
  const int64_t n = n_rows * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    dst[i] = src[int64_t(ids[r]) * width + c];
  }
}

// The ids are distinct, so no two threads write one element of out. __fmul_rn and __fadd_rn
// keep the product rounded before the sum (nvcc would otherwise contract them into an FMA):
// unary_kernel's Scale then binary_kernel's Add.
__global__ void scale_add_rows_kernel(float* __restrict__ src, int64_t width,
                                      const int32_t* __restrict__ ids,
                                      const float* __restrict__ scales, int64_t n_rows,
                                      float* __restrict__ out) {
  pdl_enter();
  const int64_t n = n_rows * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    const float y = __fmul_rn(src[i], scales[r]);
    src[i] = y;
    float* o = out + int64_t(ids[r]) * width + c;
    *o = __fadd_rn(*o, y);
  }
}

// grid: (blocks over the largest item, items).
__global__ void store_rows_f16_batch_kernel(const StoreRowsItem* __restrict__ items) {
  pdl_enter();
  const StoreRowsItem it = items[blockIdx.y];
  const int64_t n = it.n_rows * it.width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / it.width, c = i % it.width;
    it.plane[int64_t(it.rows[r]) * it.width + c] = __half_as_ushort(__float2half_rn(it.src[i]));
  }
}

}  // namespace

cudaError_t launch_store_rows_f16_batch(const StoreRowsItem* items, int n_items, int64_t max_elems,
                                        cudaStream_t s) {
  if (n_items == 0 || max_elems == 0) return cudaSuccess;
  if (n_items > 65535) return cudaErrorInvalidValue;
  return launch(store_rows_f16_batch_kernel, dim3(grid_for(max_elems), unsigned(n_items)), kThreads,
                0, s, items);
}

cudaError_t launch_gather_rows(const float* src, int64_t width, const int32_t* ids, int64_t n,
                               float* dst, cudaStream_t s) {
  if (n == 0 || width == 0) return cudaSuccess;
  return launch(gather_rows_kernel, grid_for(n * width), kThreads, 0, s, src, width, ids, n, dst);
}

cudaError_t launch_scale_add_rows(float* src, int64_t width, const int32_t* ids,
                                  const float* scales, int64_t n, float* out, cudaStream_t s) {
  if (n == 0 || width == 0) return cudaSuccess;
  return launch(scale_add_rows_kernel, grid_for(n * width), kThreads, 0, s, src, width, ids, scales,
                n, out);
}

cudaError_t launch_unary(float* x, int64_t n, Unary op, float param, cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  return launch(unary_kernel, grid_for(n), kThreads, 0, s, x, n, op, param);
}

cudaError_t launch_binary(const float* a, const float* b, float* out, int64_t n, Binary op,
                          cudaStream_t s) {
  if (n == 0) return cudaSuccess;
  return launch(binary_kernel, grid_for(n), kThreads, 0, s, a, b, out, n, op);
}

cudaError_t launch_store_rows_f16(const float* src, int64_t width, const int32_t* rows,
                                  int64_t n_rows, uint16_t* plane, cudaStream_t s) {
  if (n_rows == 0 || width == 0) return cudaSuccess;
  return launch(store_rows_f16_kernel, grid_for(n_rows * width), kThreads, 0, s, src, width, rows,
                n_rows, plane);
}

}  // namespace kiln::cuda
