// backend/cuda/rope.cu: rotary position embedding, in place, normal and NeoX pairings.
// The angle is computed in double: pos * base^(-2i/n_rot) at positions in the tens of
// thousands loses radians-level accuracy in f32, and the op is far too small to notice.
#include <cuda_runtime.h>

#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda {
namespace {

// One thread per (token, head, pair).
__global__ void rope_kernel(float* __restrict__ x, int64_t n_tok, int64_t n_head, int64_t head_dim,
                            const int32_t* __restrict__ pos, int64_t n_rot, float freq_base,
                            float freq_scale, bool neox) {
  pdl_enter();
  const int64_t half = n_rot / 2;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n_tok * n_head * half) return;
  const int64_t i = idx % half, th = idx / half, t = th / n_head;
  float* v = x + th * head_dim;
  const double theta = double(pos[t]) * double(freq_scale) *
                       pow(double(freq_base), -2.0 * double(i) / double(n_rot));
  double sn, cs;
  sincos(theta, &sn, &cs);
  const int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
  const double a = v[i0], b = v[i1];
  v[i0] = float(a * cs - b * sn);
  v[i1] = float(a * sn + b * cs);
}

}  // namespace

cudaError_t launch_rope(float* x, int64_t n_tok, int64_t n_head, int64_t head_dim,
                        const int32_t* pos, int64_t n_rot, float freq_base, float freq_scale,
                        bool neox, cudaStream_t s) {
  const int64_t n = n_tok * n_head * (n_rot / 2);
  if (n == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  return launch(rope_kernel, unsigned((n + kThreads - 1) / kThreads), kThreads, 0, s, x, n_tok,
                n_head, head_dim, pos, n_rot, freq_base, freq_scale, neox);
}

}  // namespace kiln::cuda
