// backend/cuda/gemm.cu: MatmulKernels::V2 above 16 tokens (prefill): the weight is dequantized
// into an f16 scratch matrix and the activations rounded to f16, then cuBLAS multiplies them on
// the tensor cores with f32 accumulation and f32 output. The rounding costs at most 2^-11 of
// each operand (about 1e-3 of sum |w x|: the bound tests/cuda checks for this path), the same
// trade llama.cpp's cuBLAS path makes; activations beyond the f16 range (65504) would
// overflow, which the f32 tile kernel (matvec.cu, the fallback without cuBLAS) does not.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>

#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"

#if defined(KILN_HAVE_CUBLAS)
#include <cublas_v2.h>
#endif

namespace kiln::cuda {
namespace {

constexpr size_t kAlign = 256;
size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
size_t weight_half_bytes(const DeviceWeight& w) {
  return round_up(size_t(w.n_rows) * size_t(w.n_cols) * sizeof(__half));
}
size_t needed_bytes(const DeviceWeight& w, int64_t n_tok) {
  return weight_half_bytes(w) + round_up(size_t(n_tok) * size_t(w.n_cols) * sizeof(__half));
}

// One thread per 32-element unit; consecutive threads take consecutive units of a row.
template <DType T, int A>
__global__ void dequant_f16_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                                   int64_t n_cols, __half* __restrict__ out) {
  const int64_t n_units = units_per_row(n_cols);
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_rows * n_units) return;
  const int64_t r = i / n_units, u = i % n_units;
  float v[kUnit];
  dequant_unit<T, A>(w + r * row_bytes, u, n_cols, v);
  __half* o = out + r * n_cols + u * kUnit;
  if (u * kUnit + kUnit <= n_cols && n_cols % 8 == 0) {
    // 16-byte aligned (the scratch is, and rows hold a multiple of 8 halves): 16-byte stores.
#pragma unroll
    for (int q = 0; q < kUnit / 8; ++q) {
      __align__(16) __half h[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) h[j] = __float2half_rn(v[8 * q + j]);
      reinterpret_cast<uint4*>(o)[q] = *reinterpret_cast<const uint4*>(h);
    }
  } else if (u * kUnit + kUnit <= n_cols) {
#pragma unroll
    for (int l = 0; l < kUnit; ++l) o[l] = __float2half_rn(v[l]);
  } else {
#pragma unroll
    for (int l = 0; l < kUnit; ++l)
      if (u * kUnit + l < n_cols) o[l] = __float2half_rn(v[l]);
  }
}

// Rows of a whole number of units (n_cols % 32 == 0): unit g of the matrix lands at halves
// [32 g, 32 g + 32), so a block's 256 units fill one contiguous 16 KiB stretch. Each thread
// decodes its unit into shared memory, then the block writes the stretch with consecutive
// 16-byte stores (the kernel above writes 64-byte strided pieces per thread: the f16 writes
// are 3.5x the quantized reads, and they ran at about half the bandwidth).
constexpr int kStageUnits = 256;
template <DType T, int A>
__global__ void __launch_bounds__(kStageUnits)
    dequant_f16_staged_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                              int64_t n_cols, __half* __restrict__ out) {
  __shared__ __align__(16) __half buf[kStageUnits * kUnit];
  const int64_t n_units = n_cols / kUnit;
  const int64_t total = n_rows * n_units;
  const int64_t g0 = int64_t(blockIdx.x) * kStageUnits;
  const int64_t g = g0 + threadIdx.x;
  if (g < total) {
    float v[kUnit];
    dequant_unit<T, A>(w + (g / n_units) * row_bytes, g % n_units, n_cols, v);
    __half* b = buf + threadIdx.x * kUnit;
#pragma unroll
    for (int q = 0; q < kUnit / 8; ++q) {
      __align__(16) __half h[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) h[j] = __float2half_rn(v[8 * q + j]);
      reinterpret_cast<uint4*>(b)[q] = *reinterpret_cast<const uint4*>(h);
    }
  }
  __syncthreads();
  const int64_t units = total - g0 < kStageUnits ? total - g0 : kStageUnits;
  const int n_vec = int(units) * (kUnit / 8);
  uint4* o = reinterpret_cast<uint4*>(out + g0 * kUnit);
  for (int i = threadIdx.x; i < n_vec; i += kStageUnits)
    o[i] = reinterpret_cast<const uint4*>(buf)[i];
}

__global__ void f32_to_f16_kernel(const float* __restrict__ x, int64_t n, __half* __restrict__ o) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    o[i] = __float2half_rn(x[i]);
}

}  // namespace

GemmWorkspace::~GemmWorkspace() {
  if (scratch_) cudaFree(scratch_);
  if (cublas_ws_) cudaFree(cublas_ws_);
#if defined(KILN_HAVE_CUBLAS)
  if (handle_) cublasDestroy(static_cast<cublasHandle_t>(handle_));
#endif
}

bool GemmWorkspace::fits(const DeviceWeight& w, int64_t n_tok) const {
  return handle_ != nullptr && scratch_ != nullptr && needed_bytes(w, n_tok) <= bytes_ &&
         w.n_rows <= INT_MAX && w.n_cols <= INT_MAX && n_tok <= INT_MAX;
}

bool GemmWorkspace::reserve(const DeviceWeight& w, int64_t n_tok) {
#if defined(KILN_HAVE_CUBLAS)
  if (failed_) return false;
  if (!handle_) {
    cublasHandle_t h = nullptr;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
      failed_ = true;
      return false;
    }
    handle_ = h;
    if (cudaMalloc(&cublas_ws_, kCublasWorkspaceBytes) != cudaSuccess) {
      cudaGetLastError();
      cublas_ws_ = nullptr;  // the caller keeps such segments out of graphs
    }
  }
  const size_t need = needed_bytes(w, n_tok);
  if (need > bytes_) {
    if (scratch_) cudaFree(scratch_);  // synchronises: no launch still reads it
    scratch_ = nullptr;
    bytes_ = 0;
    if (cudaMalloc(&scratch_, need) != cudaSuccess) {
      cudaGetLastError();
      scratch_ = nullptr;
      return false;  // not fatal: the tile kernel runs
    }
    bytes_ = need;
  }
  return fits(w, n_tok);
#else
  (void)w;
  (void)n_tok;
  return false;
#endif
}

cudaError_t launch_dequant_f16(const DeviceWeight& w, void* out, cudaStream_t s) {
  auto* wh = static_cast<__half*>(out);
  const auto* wb = reinterpret_cast<const uint8_t*>(w.data);
  const int64_t n_units = w.n_rows * units_per_row(w.n_cols);
  const unsigned blocks = unsigned((n_units + 255) / 256);
  const bool aligned =
      reinterpret_cast<uintptr_t>(wb) % 16 == 0 && w.row_bytes % 16 == 0 &&
      (!(w.dtype == DType::F32 || w.dtype == DType::F16 || w.dtype == DType::BF16) ||
       w.n_cols % kUnit == 0);
  const bool whole_units = w.n_cols % kUnit == 0;
  const unsigned staged_blocks = unsigned((n_units + kStageUnits - 1) / kStageUnits);
  dispatch_dtype(w.dtype, [&]<DType T>() {
    if (aligned && whole_units) {
      dequant_f16_staged_kernel<T, 16>
          <<<staged_blocks, kStageUnits, 0, s>>>(wb, w.row_bytes, w.n_rows, w.n_cols, wh);
    } else if (whole_units) {
      dequant_f16_staged_kernel<T, 2>
          <<<staged_blocks, kStageUnits, 0, s>>>(wb, w.row_bytes, w.n_rows, w.n_cols, wh);
    } else if (aligned) {
      dequant_f16_kernel<T, 16><<<blocks, 256, 0, s>>>(wb, w.row_bytes, w.n_rows, w.n_cols, wh);
    } else {
      dequant_f16_kernel<T, 2><<<blocks, 256, 0, s>>>(wb, w.row_bytes, w.n_rows, w.n_cols, wh);
    }
  });
  return cudaGetLastError();
}

cudaError_t launch_gemm_f16(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                            cudaStream_t s, const GemmWorkspace& gemm) {
#if defined(KILN_HAVE_CUBLAS)
  auto* wh = static_cast<__half*>(gemm.scratch());
  auto* xh = reinterpret_cast<__half*>(static_cast<char*>(gemm.scratch()) + weight_half_bytes(w));
  const auto* wb = reinterpret_cast<const uint8_t*>(w.data);
  // F16 weights already are what cuBLAS reads: it takes them in place (rows of n_cols halves,
  // 16-byte aligned in the arena) instead of a copy into the scratch. So does a weight's copy
  // in the backend's f16 cache (CudaOptions::f16_cache_bytes), which launch_dequant_f16 wrote
  // once: cuBLAS then reads the same halves it would read from the scratch.
  const bool in_place = w.dtype == DType::F16 && w.row_bytes == size_t(w.n_cols) * 2 &&
                        reinterpret_cast<uintptr_t>(wb) % 16 == 0;
  if (!in_place)
    if (cudaError_t e = launch_dequant_f16(w, wh, s); e != cudaSuccess) return e;
  const int64_t n_x = n_tok * w.n_cols;
  const int64_t xb = (n_x + 255) / 256;
  f32_to_f16_kernel<<<unsigned(xb < 4096 ? xb : 4096), 256, 0, s>>>(x, n_x, xh);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  // Row-major W [rows][k] is column-major k x rows; y^T (rows x n_tok, column-major) =
  // W^T(k x rows)^T * X(k x n_tok).
  auto h = static_cast<cublasHandle_t>(gemm.handle());
  if (cublasSetStream(h, s) != CUBLAS_STATUS_SUCCESS) return cudaErrorNotSupported;
  // cublasSetStream has just put the handle back on cuBLAS's own workspace pool.
  if (gemm.cublas_workspace() &&
      cublasSetWorkspace(h, gemm.cublas_workspace(), GemmWorkspace::kCublasWorkspaceBytes) !=
          CUBLAS_STATUS_SUCCESS)
    return cudaErrorNotSupported;
  const float alpha = 1.0f, beta = 0.0f;
  const int m = int(w.n_rows), n = int(n_tok), k = int(w.n_cols);
  const cublasStatus_t st = cublasGemmEx(
      h, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha,
      in_place ? static_cast<const void*>(wb) : static_cast<const void*>(wh), CUDA_R_16F, k, xh,
      CUDA_R_16F, k, &beta, y, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return st == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorNotSupported;
#else
  (void)w, (void)x, (void)n_tok, (void)y, (void)s, (void)gemm;
  return cudaErrorNotSupported;
#endif
}

}  // namespace kiln::cuda
