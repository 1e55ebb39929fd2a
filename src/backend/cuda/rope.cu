// backend/cuda/rope.cu: rotary position embedding, in place, normal and NeoX pairings, with
// per-pair frequency factors and YaRN (backend.h RopeParams).
// The angle is computed in double: pos * base^(-2i/n_rot) at positions in the tens of
// thousands loses radians-level accuracy in f32, and the op is far too small to notice.
// A layer's Q and K rotate by the same angles, so one launch serves both (rope_qk): each
// block takes one token, computes its n_rot / 2 (cos, sin) pairs once into shared memory (the
// double pow and sincos were most of the op's time, once per head before), then rotates every
// Q and K head of the token. One kernel for both entry points, so rope(q), rope(k) and
// rope_qk(q, k) give the same bits (CudaOps.RopeQkEqualsTwoRopes). A token's heads are spread
// over kHeadsPerBlock-head blocks (grid.y), each computing the token's angles itself (the same
// double ops, so the same values): with one block per token a decode step's single token left
// 256 threads walking 40 heads in ten dependent load-rotate-store rounds (8.5 µs a layer in the
// 8B profile, docs/BENCHMARKS.md session 12).
#include <cuda_runtime.h>

#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kHeadsPerBlock = 4;

// grid: (n_tok, head groups of kHeadsPerBlock over the Q heads then the K heads). q:
// [n_tok][n_head_q][head_dim], k: [n_tok][n_head_k][head_dim] (k may be null with n_head_k 0).
__global__ void rope_qk_kernel(float* __restrict__ q, float* __restrict__ k, int64_t n_head_q,
                               int64_t n_head_k, int64_t head_dim, const int32_t* __restrict__ pos,
                               RopeAngles a) {
  extern __shared__ double cs_s[];  // [half] cos, then [half] sin
  pdl_enter();
  const int64_t t = blockIdx.x, half = a.n_rot / 2;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    // backend.h's rope_pair_freq, term for term (the host backends' angles).
    double f = pow(double(a.freq_base), -2.0 * double(i) / double(a.n_rot));
    if (a.factors) f /= double(a.factors[i]);
    if (a.ext_factor == 0.0f) {
      f = double(a.freq_scale) * f;
    } else {
      const float ramp_y = (float(i) - a.corr_lo) / fmaxf(0.001f, a.corr_hi - a.corr_lo);
      const double r = double(1.0f - fminf(1.0f, fmaxf(0.0f, ramp_y))) * double(a.ext_factor);
      f = f * (double(a.freq_scale) * (1 - r) + r);
    }
    const double theta = double(pos[t]) * f;
    double sn, cs;
    sincos(theta, &sn, &cs);
    cs_s[i] = cs * double(a.mscale);
    cs_s[half + i] = sn * double(a.mscale);
  }
  __syncthreads();
  const int64_t h_begin = int64_t(blockIdx.y) * kHeadsPerBlock;
  const int64_t h_end = min(n_head_q + n_head_k, h_begin + kHeadsPerBlock);
  const int64_t n = (h_end - h_begin) * half;
  for (int64_t idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const int64_t h = h_begin + idx / half, i = idx % half;
    float* v = h < n_head_q ? q + (t * n_head_q + h) * head_dim
                            : k + (t * n_head_k + (h - n_head_q)) * head_dim;
    const double cs = cs_s[i], sn = cs_s[half + i];
    const int64_t i0 = a.neox ? i : 2 * i, i1 = a.neox ? i + half : 2 * i + 1;
    const double x0 = v[i0], x1 = v[i1];
    v[i0] = float(__dsub_rn(__dmul_rn(x0, cs), __dmul_rn(x1, sn)));
    v[i1] = float(__dadd_rn(__dmul_rn(x0, sn), __dmul_rn(x1, cs)));
  }
}

}  // namespace

cudaError_t launch_rope_qk(float* q, int64_t n_head_q, float* k, int64_t n_head_k, int64_t n_tok,
                           int64_t head_dim, const int32_t* pos, const RopeAngles& a,
                           cudaStream_t s) {
  if (n_tok == 0 || a.n_rot == 0 || n_head_q + n_head_k == 0) return cudaSuccess;
  const int64_t groups = (n_head_q + n_head_k + kHeadsPerBlock - 1) / kHeadsPerBlock;
  if (n_tok > 0x7fffffff || groups > 65535) return cudaErrorInvalidValue;
  return launch(rope_qk_kernel, dim3(unsigned(n_tok), unsigned(groups)), dim3(kThreads),
                size_t(a.n_rot) * sizeof(double), s, q, k, n_head_q, n_head_k, head_dim, pos, a);
}

cudaError_t launch_rope(float* x, int64_t n_tok, int64_t n_head, int64_t head_dim,
                        const int32_t* pos, const RopeAngles& a, cudaStream_t s) {
  return launch_rope_qk(x, n_head, nullptr, 0, n_tok, head_dim, pos, a, s);
}

}  // namespace kiln::cuda
