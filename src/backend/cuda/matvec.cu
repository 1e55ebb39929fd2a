// backend/cuda/matvec.cu: y = W x with the weight's dequantization fused into the product,
// for every weight type of dequant.cuh. Few tokens (decode) run a matvec that reads each
// weight byte once per 8 tokens; many tokens (prefill) run a tiled kernel that dequantizes a
// 64-row tile into shared memory once and reuses it for 64 tokens. Both accumulate in f32.
#include <cuda_runtime.h>

#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {

// gemm.cu: V2's many-token path (dequantize to f16, cuBLAS on tensor cores).
cudaError_t launch_gemm_f16(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                            cudaStream_t s, const GemmWorkspace& gemm);

namespace {

constexpr int kWarp = 32;
constexpr int kMatvecWarps = 4;      // one row per warp
constexpr int kMaxMatvecTokens = 8;  // tokens per matvec launch column

template <DType T>
constexpr int traits_block_elems() {
  switch (T) {
    case DType::Q2_K:
    case DType::Q3_K:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
    case DType::IQ4_XS:
      return 256;
    default:
      return 32;
  }
}
template <DType T>
constexpr int traits_block_bytes() {
  using namespace kiln::quant;
  switch (T) {
    case DType::Q8_0:
      return sizeof(block_q8_0);
    case DType::Q4_0:
      return sizeof(block_q4_0);
    case DType::IQ4_NL:
      return sizeof(block_iq4_nl);
    case DType::Q5_0:
      return sizeof(block_q5_0);
    case DType::Q2_K:
      return sizeof(block_q2_K);
    case DType::Q3_K:
      return sizeof(block_q3_K);
    case DType::Q6_K:
      return sizeof(block_q6_K);
    default:
      return 0;
  }
}

constexpr bool is_float_type(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// grid: (ceil(n_rows / kMatvecWarps), ceil(n_tok / NT)); block: kMatvecWarps warps. Lane l
// decodes units l, l + 32, ... of its warp's row (A: dequant_unit's row alignment).
template <DType T, int A, int NT>
__global__ void __launch_bounds__(kMatvecWarps* kWarp)
    matvec_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows, int64_t n_cols,
                  const float* __restrict__ x, int64_t n_tok, float* __restrict__ y) {
  const int lane = threadIdx.x % kWarp;
  const int64_t r = int64_t(blockIdx.x) * kMatvecWarps + threadIdx.x / kWarp;
  const int64_t t0 = int64_t(blockIdx.y) * NT;
  if (r >= n_rows) return;
  const int nt = n_tok - t0 < NT ? int(n_tok - t0) : NT;
  const uint8_t* row = w + r * row_bytes;
  const int64_t n_units = units_per_row(n_cols);
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  for (int64_t u = lane; u < n_units; u += kWarp) {
    float v[kUnit];
    dequant_unit<T, A>(row, u, n_cols, v);
    const int64_t c0 = u * kUnit;
    // Only float rows end in a partial unit; the predicate keeps v[] indexed by constants.
    [[maybe_unused]] const bool whole = !is_float_type(T) || c0 + kUnit <= n_cols;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= nt) break;
      const float* xt = x + (t0 + t) * n_cols + c0;
      float s = 0.0f;
      if constexpr (A == 16) {
        // Aligned rows hold whole units and x is 16-byte aligned (launcher): 16-byte loads.
        const float4* x4 = reinterpret_cast<const float4*>(xt);
#pragma unroll
        for (int q = 0; q < kUnit / 4; ++q) {
          const float4 xv = __ldg(x4 + q);
          s = fmaf(v[4 * q], xv.x, s);
          s = fmaf(v[4 * q + 1], xv.y, s);
          s = fmaf(v[4 * q + 2], xv.z, s);
          s = fmaf(v[4 * q + 3], xv.w, s);
        }
      } else {
#pragma unroll
        for (int l = 0; l < kUnit; ++l) {
          const float xv = (whole || c0 + l < n_cols) ? __ldg(xt + l) : 0.0f;
          s = fmaf(v[l], xv, s);
        }
      }
      acc[t] += s;
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= nt) break;
    const float s = warp_sum(acc[t]);
    if (lane == 0) y[(t0 + t) * n_rows + r] = s;
  }
}

// Layouts whose blocks are only 2-byte aligned (34, 18, 22, 84, 110, 210 bytes) would make each
// lane issue 2-byte loads at a stride of a block across the warp, many L1 wavefronts per
// useful byte. For those, a warp first copies a chunk of its row (a whole number of 16-byte
// vectors: 32 blocks, or 4 / 8 K-quant super-blocks) into shared memory with coalesced
// 16-byte loads, then each lane decodes its units from there. Units per chunk (0: not staged):
template <DType T>
constexpr int staged_chunk_units() {
  switch (T) {
    case DType::Q8_0:
    case DType::Q4_0:
    case DType::Q5_0:
    case DType::Q2_K:
    case DType::IQ4_NL:
      return 32;
    case DType::Q3_K:
    case DType::Q6_K:
      return 64;  // 4 super-blocks are not 16-byte whole
    default:
      return 0;
  }
}
template <DType T>
constexpr int staged_chunk_bytes() {
  constexpr int units = staged_chunk_units<T>();
  constexpr int k_block = traits_block_elems<T>();
  return units * kUnit / k_block * traits_block_bytes<T>();
}

// grid and block as matvec_kernel; rows are 16-byte aligned, a whole number of chunks long.
template <DType T, int NT>
__global__ void __launch_bounds__(kMatvecWarps* kWarp)
    matvec_staged_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                         int64_t n_cols, const float* __restrict__ x, int64_t n_tok,
                         float* __restrict__ y) {
  constexpr int kChunkUnits = staged_chunk_units<T>(), kChunkBytes = staged_chunk_bytes<T>();
  static_assert(kChunkBytes % 16 == 0 && kChunkUnits % kWarp == 0);
  __shared__ uint4 stage[kMatvecWarps][kChunkBytes / 16];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t r = int64_t(blockIdx.x) * kMatvecWarps + warp;
  const int64_t t0 = int64_t(blockIdx.y) * NT;
  if (r >= n_rows) return;  // whole warps only: the __syncwarp()s below stay warp-uniform
  const int nt = n_tok - t0 < NT ? int(n_tok - t0) : NT;
  const uint4* row = reinterpret_cast<const uint4*>(w + r * row_bytes);
  const auto* chunk = reinterpret_cast<const uint8_t*>(stage[warp]);
  const int64_t n_chunks = units_per_row(n_cols) / kChunkUnits;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  for (int64_t c = 0; c < n_chunks; ++c) {
    for (int i = lane; i < kChunkBytes / 16; i += kWarp)
      stage[warp][i] = __ldg(row + c * (kChunkBytes / 16) + i);
    __syncwarp();
#pragma unroll
    for (int k = 0; k < kChunkUnits / kWarp; ++k) {
      const int u = lane + kWarp * k;
      float v[kUnit];
      dequant_unit<T, 16>(chunk, u, n_cols, v);
      const int64_t c0 = (c * kChunkUnits + u) * kUnit;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t >= nt) break;
        const float4* x4 = reinterpret_cast<const float4*>(x + (t0 + t) * n_cols + c0);
        float s = 0.0f;
#pragma unroll
        for (int q = 0; q < kUnit / 4; ++q) {
          const float4 xv = __ldg(x4 + q);
          s = fmaf(v[4 * q], xv.x, s);
          s = fmaf(v[4 * q + 1], xv.y, s);
          s = fmaf(v[4 * q + 2], xv.z, s);
          s = fmaf(v[4 * q + 3], xv.w, s);
        }
        acc[t] += s;
      }
    }
    __syncwarp();  // every lane is done with the chunk before it is overwritten
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= nt) break;
    const float s = warp_sum(acc[t]);
    if (lane == 0) y[(t0 + t) * n_rows + r] = s;
  }
}

constexpr int kTileRows = 64, kTileToks = 64, kTileThreads = 256;

// grid: (ceil(n_rows / 64), ceil(n_tok / 64)); each thread owns a 4x4 block of outputs.
template <DType T>
__global__ void __launch_bounds__(kTileThreads)
    matmul_tiled_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                        int64_t n_cols, const float* __restrict__ x, int64_t n_tok,
                        float* __restrict__ y) {
  __shared__ float ws[kTileRows][kUnit + 1];  // +1: rows land in different banks
  __shared__ float xs[kTileToks][kUnit + 1];
  const int tid = threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.x) * kTileRows, t0 = int64_t(blockIdx.y) * kTileToks;
  const int ty = tid / 16, tx = tid % 16;  // rows ty*4.., tokens tx*4..
  float acc[4][4] = {};
  const int64_t n_units = units_per_row(n_cols);
  for (int64_t u = 0; u < n_units; ++u) {
    const int64_t c0 = u * kUnit;
    if (tid < kTileRows) {
      float v[kUnit];
      if (r0 + tid < n_rows) {
        dequant_unit<T, 2>(w + (r0 + tid) * row_bytes, u, n_cols, v);
      } else {
#pragma unroll
        for (int l = 0; l < kUnit; ++l) v[l] = 0.0f;
      }
#pragma unroll
      for (int l = 0; l < kUnit; ++l) ws[tid][l] = v[l];
    }
    for (int i = tid; i < kTileToks * kUnit; i += kTileThreads) {
      const int t = i / kUnit, l = i % kUnit;
      const bool ok = t0 + t < n_tok && c0 + l < n_cols;
      xs[t][l] = ok ? __ldg(x + (t0 + t) * n_cols + c0 + l) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int l = 0; l < kUnit; ++l) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = ws[ty * 4 + i][l];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = xs[tx * 4 + j][l];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t r = r0 + ty * 4 + i;
    if (r >= n_rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t t = t0 + tx * 4 + j;
      if (t < n_tok) y[t * n_rows + r] = acc[i][j];
    }
  }
}

// ---- V2 (MatmulKernels::V2). The first kernels above (once selectable as V1; now V2's
// fallbacks: activations too wide for shared memory, and the tile kernel above 16 tokens
// without a GEMM workspace) read each lane's 128 contiguous activation bytes straight from
// global memory: every float4 load of a warp touches 32 different cache lines (32 L1
// wavefronts), which capped them near 3 weights per clock per SM whatever the type. V2
// stages the block's activations once in shared memory, each 32-element unit padded to 36
// floats: 8 consecutive lanes (one shared-memory phase) then read 8 different 4-bank groups,
// conflict-free. A block's 8 warps walk rows with a stride of the grid, so the staging is
// paid once per block, and the grid is sized to one resident wave.
constexpr int kV2Warps = 8;
constexpr int kXPad = 36;  // floats per staged unit: 144 bytes, 16-byte aligned
constexpr size_t kV2MaxSmem = size_t(96) << 10;

__device__ __forceinline__ void stage_x(const float* __restrict__ x, int64_t n_cols,
                                        int64_t n_units, int nt, float* xs) {
  const int64_t per_tok = n_units * kXPad;
  for (int t = 0; t < nt; ++t) {
    const float* xt = x + t * n_cols;
    for (int64_t i = threadIdx.x; i < n_units * kUnit; i += blockDim.x)
      xs[t * per_tok + (i / kUnit) * kXPad + i % kUnit] = i < n_cols ? __ldg(xt + i) : 0.0f;
  }
}

template <int NT>
__device__ __forceinline__ void dot_unit_shared(const float* v, const float* xs, int64_t per_tok,
                                                int64_t u, int nt, float* acc) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= nt) break;
    const float4* x4 = reinterpret_cast<const float4*>(xs + t * per_tok + u * kXPad);
    float s = 0.0f;
#pragma unroll
    for (int q = 0; q < kUnit / 4; ++q) {
      const float4 xv = x4[q];
      s = fmaf(v[4 * q], xv.x, s);
      s = fmaf(v[4 * q + 1], xv.y, s);
      s = fmaf(v[4 * q + 2], xv.z, s);
      s = fmaf(v[4 * q + 3], xv.w, s);
    }
    acc[t] += s;
  }
}

template <int NT>
__device__ __forceinline__ void store_row(float* acc, int nt, int lane, int64_t t0, int64_t r,
                                          int64_t n_rows, float* y) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= nt) break;
    const float s = warp_sum(acc[t]);
    if (lane == 0) y[(t0 + t) * n_rows + r] = s;
  }
}

// grid: (row blocks, ceil(n_tok / NT)); dynamic shared memory: min(NT, n_tok) tokens of
// n_units * kXPad floats. Lane l decodes units l, l + 32, ... of each of its warp's rows.
template <DType T, int A, int NT>
__global__ void __launch_bounds__(kV2Warps* kWarp)
    matvec_v2_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                     int64_t n_cols, const float* __restrict__ x, int64_t n_tok,
                     float* __restrict__ y) {
  extern __shared__ float4 v2_smem[];
  float* xs = reinterpret_cast<float*>(v2_smem);
  const int64_t n_units = units_per_row(n_cols), per_tok = n_units * kXPad;
  const int64_t t0 = int64_t(blockIdx.y) * NT;
  const int nt = n_tok - t0 < NT ? int(n_tok - t0) : NT;
  stage_x(x + t0 * n_cols, n_cols, n_units, nt, xs);
  __syncthreads();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int64_t r = int64_t(blockIdx.x) * kV2Warps + warp; r < n_rows;
       r += int64_t(gridDim.x) * kV2Warps) {
    const uint8_t* row = w + r * row_bytes;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
#pragma unroll 2
    for (int64_t u = lane; u < n_units; u += kWarp) {
      float v[kUnit];
      dequant_unit<T, A>(row, u, n_cols, v);
      dot_unit_shared<NT>(v, xs, per_tok, u, nt, acc);
    }
    store_row<NT>(acc, nt, lane, t0, r, n_rows, y);
  }
}

// The 2-byte-aligned layouts (see matvec_staged_kernel) with the activations in shared memory.
template <DType T, int NT>
__global__ void __launch_bounds__(kV2Warps* kWarp)
    matvec_v2_staged_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                            int64_t n_cols, const float* __restrict__ x, int64_t n_tok,
                            float* __restrict__ y) {
  constexpr int kChunkUnits = staged_chunk_units<T>(), kChunkBytes = staged_chunk_bytes<T>();
  static_assert(kChunkBytes % 16 == 0 && kChunkUnits % kWarp == 0);
  static_assert(kV2Warps * kChunkBytes <= (16 << 10), "launch_v2 assumes <= 16 KiB static smem");
  __shared__ uint4 stage[kV2Warps][kChunkBytes / 16];
  extern __shared__ float4 v2_smem[];
  float* xs = reinterpret_cast<float*>(v2_smem);
  const int64_t n_units = units_per_row(n_cols), per_tok = n_units * kXPad;
  const int64_t t0 = int64_t(blockIdx.y) * NT;
  const int nt = n_tok - t0 < NT ? int(n_tok - t0) : NT;
  stage_x(x + t0 * n_cols, n_cols, n_units, nt, xs);
  __syncthreads();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const auto* chunk = reinterpret_cast<const uint8_t*>(stage[warp]);
  const int64_t n_chunks = n_units / kChunkUnits;
  // Whole warps take the same rows: the __syncwarp()s below stay warp-uniform.
  for (int64_t r = int64_t(blockIdx.x) * kV2Warps + warp; r < n_rows;
       r += int64_t(gridDim.x) * kV2Warps) {
    const uint4* row = reinterpret_cast<const uint4*>(w + r * row_bytes);
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
    for (int64_t c = 0; c < n_chunks; ++c) {
      uint4 buf[(kChunkBytes / 16 + kWarp - 1) / kWarp];
#pragma unroll
      for (int k = 0; k < int(sizeof(buf) / sizeof(buf[0])); ++k) {
        const int i = lane + k * kWarp;
        if (i < kChunkBytes / 16) buf[k] = __ldg(row + c * (kChunkBytes / 16) + i);
      }
#pragma unroll
      for (int k = 0; k < int(sizeof(buf) / sizeof(buf[0])); ++k) {
        const int i = lane + k * kWarp;
        if (i < kChunkBytes / 16) stage[warp][i] = buf[k];
      }
      __syncwarp();
#pragma unroll
      for (int k = 0; k < kChunkUnits / kWarp; ++k) {
        const int u = lane + kWarp * k;
        float v[kUnit];
        dequant_unit<T, 16>(chunk, u, n_cols, v);
        dot_unit_shared<NT>(v, xs, per_tok, c * kChunkUnits + u, nt, acc);
      }
      __syncwarp();  // every lane is done with the chunk before it is overwritten
    }
    store_row<NT>(acc, nt, lane, t0, r, n_rows, y);
  }
}

// One token, float rows 16-byte aligned with n_cols % 32 == 0: lane l reads 8 consecutive
// elements at 8 * l + 256 * i, so a warp's weight and activation loads are contiguous; four
// iterations unrolled keep four 16-byte weight loads in flight per lane.
template <DType T>
__global__ void __launch_bounds__(kV2Warps* kWarp)
    matvec_v2_float_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows,
                           int64_t n_cols, const float* __restrict__ x, float* __restrict__ y) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int64_t r = int64_t(blockIdx.x) * kV2Warps + warp; r < n_rows;
       r += int64_t(gridDim.x) * kV2Warps) {
    const uint8_t* row = w + r * row_bytes;
    float acc = 0.0f;
#pragma unroll 4
    for (int64_t c = int64_t(lane) * 8; c < n_cols; c += kWarp * 8) {
      float v[8];
      if constexpr (T == DType::F32) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(row) + c / 4);
        const float4 b = __ldg(reinterpret_cast<const float4*>(row) + c / 4 + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z,
        v[7] = b.w;
      } else {
        const uint4 q = __ldg(reinterpret_cast<const uint4*>(row) + c / 8);
        const uint32_t wd[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int l = 0; l < 8; ++l) {
          const uint16_t h = uint16_t(wd[l >> 1] >> (16 * (l & 1)));
          v[l] = T == DType::F16 ? h2f_bits(h) : bf2f_bits(h);
        }
      }
      const float4 xa = __ldg(x4 + c / 4), xb = __ldg(x4 + c / 4 + 1);
      acc = fmaf(v[0], xa.x, acc);
      acc = fmaf(v[1], xa.y, acc);
      acc = fmaf(v[2], xa.z, acc);
      acc = fmaf(v[3], xa.w, acc);
      acc = fmaf(v[4], xb.x, acc);
      acc = fmaf(v[5], xb.y, acc);
      acc = fmaf(v[6], xb.z, acc);
      acc = fmaf(v[7], xb.w, acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) y[r] = acc;
  }
}

int sm_count() {
  int dev = 0, n = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
    cudaGetLastError();
    return 132;
  }
  return n;
}

// Blocks along the rows: one resident wave (about 4 blocks of 8 warps per SM), at most one
// row per warp.
unsigned v2_row_blocks(int64_t n_rows) {
  const int64_t need = (n_rows + kV2Warps - 1) / kV2Warps;
  const int64_t wave = int64_t(sm_count()) * 4;
  return unsigned(need < wave ? need : wave);
}

template <typename K>
cudaError_t launch_v2(K kernel, dim3 grid, size_t smem, const DeviceWeight& w, const float* x,
                      int64_t n_tok, float* y, cudaStream_t s) {
  // The 48 KiB default limit counts static + dynamic shared memory together, and the staged
  // kernels carry up to ~14 KiB of static staging (8 warps x one chunk), so opt in well below
  // 48 KiB of dynamic memory (the first H200 run failed here with cudaErrorInvalidValue).
  if (smem > (size_t(32) << 10)) {
    if (cudaError_t e =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        e != cudaSuccess)
      return e;
  }
  kernel<<<grid, kV2Warps * kWarp, smem, s>>>(reinterpret_cast<const uint8_t*>(w.data), w.row_bytes,
                                              w.n_rows, w.n_cols, x, n_tok, y);
  return cudaGetLastError();
}

// V2 for up to kMatvecMaxTokens tokens; false when the activations do not fit in shared
// memory (the caller runs launch_matvec, the first kernels).
template <DType T, int A>
bool launch_matvec_v2(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                      cudaStream_t s, cudaError_t* err) {
  const auto* wb = reinterpret_cast<const uint8_t*>(w.data);
  if constexpr (A == 16 && is_float_type(T)) {
    if (n_tok == 1) {
      matvec_v2_float_kernel<T><<<v2_row_blocks(w.n_rows), kV2Warps * kWarp, 0, s>>>(
          wb, w.row_bytes, w.n_rows, w.n_cols, x, y);
      *err = cudaGetLastError();
      return true;
    }
  }
  const size_t per_tok = size_t(units_per_row(w.n_cols)) * kXPad * sizeof(float);
  constexpr int kNT = 4;
  const int nt = n_tok == 1 ? 1 : (kNT * per_tok <= kV2MaxSmem ? kNT : 1);
  if (per_tok > kV2MaxSmem) return false;
  const size_t smem = size_t(n_tok < nt ? n_tok : nt) * per_tok;
  const dim3 grid(v2_row_blocks(w.n_rows), unsigned((n_tok + nt - 1) / nt));
  if constexpr (A == 16 && staged_chunk_units<T>() > 0) {
    if (units_per_row(w.n_cols) % staged_chunk_units<T>() == 0) {
      *err = nt == 1 ? launch_v2(matvec_v2_staged_kernel<T, 1>, grid, smem, w, x, n_tok, y, s)
                     : launch_v2(matvec_v2_staged_kernel<T, kNT>, grid, smem, w, x, n_tok, y, s);
      return true;
    }
  }
  *err = nt == 1 ? launch_v2(matvec_v2_kernel<T, A, 1>, grid, smem, w, x, n_tok, y, s)
                 : launch_v2(matvec_v2_kernel<T, A, kNT>, grid, smem, w, x, n_tok, y, s);
  return true;
}

template <DType T, int A>
void launch_matvec(const DeviceWeight& w, const float* x, int64_t n_tok, float* y, cudaStream_t s) {
  const auto* wb = reinterpret_cast<const uint8_t*>(w.data);
  const dim3 grid(unsigned((w.n_rows + kMatvecWarps - 1) / kMatvecWarps),
                  unsigned((n_tok + kMaxMatvecTokens - 1) / kMaxMatvecTokens));
  if constexpr (A == 16 && staged_chunk_units<T>() > 0) {
    if (units_per_row(w.n_cols) % staged_chunk_units<T>() == 0) {
      if (n_tok == 1) {
        matvec_staged_kernel<T, 1><<<grid, kMatvecWarps * kWarp, 0, s>>>(wb, w.row_bytes, w.n_rows,
                                                                         w.n_cols, x, n_tok, y);
      } else {
        matvec_staged_kernel<T, kMaxMatvecTokens><<<grid, kMatvecWarps * kWarp, 0, s>>>(
            wb, w.row_bytes, w.n_rows, w.n_cols, x, n_tok, y);
      }
      return;
    }
  }
  if (n_tok == 1) {
    matvec_kernel<T, A, 1>
        <<<grid, kMatvecWarps * kWarp, 0, s>>>(wb, w.row_bytes, w.n_rows, w.n_cols, x, n_tok, y);
  } else {
    matvec_kernel<T, A, kMaxMatvecTokens>
        <<<grid, kMatvecWarps * kWarp, 0, s>>>(wb, w.row_bytes, w.n_rows, w.n_cols, x, n_tok, y);
  }
}

template <DType T>
cudaError_t matmul_typed(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                         cudaStream_t s, GemmWorkspace* gemm) {
  const auto* wb = reinterpret_cast<const uint8_t*>(w.data);
  // The caller hands a workspace only when it chose the GEMM for this shape (above 16 tokens,
  // or F16 weights above 8 under CudaMatmul::Auto).
  if (gemm != nullptr && gemm->fits(w, n_tok)) return launch_gemm_f16(w, x, n_tok, y, s, *gemm);
  if (n_tok <= kMatvecMaxTokens) {
    // Up to 16 tokens: the weight is read at most twice; the tiled kernel would idle most
    // of its 64-token tile. Rows that start 16-byte aligned (GGUF data in the arena, with
    // row sizes a multiple of 16, as every 4096-wide row is) take 16-byte loads.
    const bool aligned = reinterpret_cast<uintptr_t>(wb) % 16 == 0 && w.row_bytes % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                         (!is_float_type(T) || w.n_cols % kUnit == 0);
    cudaError_t err = cudaSuccess;
    const bool ran = aligned ? launch_matvec_v2<T, 16>(w, x, n_tok, y, s, &err)
                             : launch_matvec_v2<T, 2>(w, x, n_tok, y, s, &err);
    if (ran) return err;
    if (aligned) {
      launch_matvec<T, 16>(w, x, n_tok, y, s);
    } else {
      launch_matvec<T, 2>(w, x, n_tok, y, s);
    }
  } else {
    const dim3 grid(unsigned((w.n_rows + kTileRows - 1) / kTileRows),
                    unsigned((n_tok + kTileToks - 1) / kTileToks));
    matmul_tiled_kernel<T>
        <<<grid, kTileThreads, 0, s>>>(wb, w.row_bytes, w.n_rows, w.n_cols, x, n_tok, y);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_matmul(const DeviceWeight& w, const float* x, int64_t n_tok, float* y,
                          cudaStream_t s, GemmWorkspace* gemm) {
  if (!cuda_supports(w.dtype)) return cudaErrorInvalidValue;
  if (w.n_rows == 0 || n_tok == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  dispatch_dtype(w.dtype, [&]<DType T>() { err = matmul_typed<T>(w, x, n_tok, y, s, gemm); });
  return err;
}

}  // namespace kiln::cuda
