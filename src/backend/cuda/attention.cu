// backend/cuda/attention.cu: causal attention over f16 KV planes read through the
// logical->physical row map, split-K flash style: each block walks one slice of the keys for
// one (query, head) with an online softmax, leaving an unnormalised partial (acc, max, sum);
// a second kernel merges the slices. One query with a long context (decode) splits its keys
// over enough blocks to fill the GPU; many queries (prefill) need no split.
// Supports GQA (head h reads KV head h / (n_head / n_head_kv)), sliding windows, softcaps.
#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / 32;  // head dims each lane owns (registers)
constexpr int64_t kMinKeysPerSplit = 64;

struct Split {
  int64_t n_split = 1, keys_per_split = 0;
};

Split plan_split(const DeviceAttention& a, int n_sm) {
  Split sp;
  const int64_t items = a.n_q * a.n_head;
  const int64_t want = (2 * int64_t(n_sm) + items - 1) / items;
  const int64_t most = (a.n_kv + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
  sp.n_split = std::max<int64_t>(1, std::min(want, most));
  sp.keys_per_split = (a.n_kv + sp.n_split - 1) / sp.n_split;
  return sp;
}

// grid: (n_q * n_head, n_split); block: kWarps warps. Partial layout per (q, head, split):
// [head_dim] unnormalised acc, then max, then sum.
__global__ void __launch_bounds__(kWarps * 32)
    attention_split_kernel(DeviceAttention a, int64_t keys_per_split, float* __restrict__ part) {
  __shared__ float q_s[kMaxHeadDim];
  __shared__ float acc_s[kWarps][kMaxHeadDim];
  __shared__ float m_s[kWarps], l_s[kWarps];
  const int64_t qi = blockIdx.x / a.n_head, h = blockIdx.x % a.n_head;
  const int64_t hd = a.head_dim, kv_w = a.n_head_kv * hd;
  const int64_t kvh = h / (a.n_head / a.n_head_kv);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) q_s[d] = a.q[(qi * a.n_head + h) * hd + d];
  __syncthreads();
  const int32_t qp = a.q_pos[qi];
  const int64_t j0 = int64_t(blockIdx.y) * keys_per_split;
  const int64_t j1 = min(a.n_kv, j0 + keys_per_split);

  float m = -INFINITY, l = 0.0f, acc[kPerLane];
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) acc[c] = 0.0f;
  for (int64_t j = j0 + warp; j < j1; j += kWarps) {
    const int32_t kp = a.kv_pos[j];
    if (kp > qp || (a.window > 0 && qp - kp >= a.window)) continue;  // warp-uniform
    const int64_t base = int64_t(a.kv_rows[j]) * kv_w + kvh * hd;
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int64_t d = lane + 32 * c;
      if (d < hd) dot = fmaf(q_s[d], h2f_bits(a.k[base + d]), dot);
    }
    dot = warp_reduce_sum(dot);
    float logit = dot * a.scale;
    if (a.softcap > 0) logit = a.softcap * tanhf(logit / a.softcap);
    const float m_new = fmaxf(m, logit);
    const float corr = expf(m - m_new);  // m = -inf the first time: corr = 0
    const float p = expf(logit - m_new);
    l = l * corr + p;
#pragma unroll
    for (int c = 0; c < kPerLane; ++c) {
      const int64_t d = lane + 32 * c;
      if (d < hd) acc[c] = acc[c] * corr + p * h2f_bits(a.v[base + d]);
    }
    m = m_new;
  }
#pragma unroll
  for (int c = 0; c < kPerLane; ++c) {
    const int64_t d = lane + 32 * c;
    if (d < hd) acc_s[warp][d] = acc[c];
  }
  if (lane == 0) m_s[warp] = m, l_s[warp] = l;
  __syncthreads();
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_s[w]);
  float* out = part + (int64_t(blockIdx.x) * gridDim.y + blockIdx.y) * (hd + 2);
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float s = 0.0f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w)
        if (m_s[w] != -INFINITY) s += acc_s[w][d] * expf(m_s[w] - mx);
    }
    out[d] = s;
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    if (mx != -INFINITY)
      for (int w = 0; w < kWarps; ++w)
        if (m_s[w] != -INFINITY) sum += l_s[w] * expf(m_s[w] - mx);
    out[hd] = mx;
    out[hd + 1] = sum;
  }
}

// grid: n_q * n_head blocks; merges the splits' partials and normalises.
__global__ void attention_merge_kernel(const float* __restrict__ part, int64_t n_split, int64_t hd,
                                       float* __restrict__ out) {
  const float* p = part + int64_t(blockIdx.x) * n_split * (hd + 2);
  float mx = -INFINITY;
  for (int64_t s = 0; s < n_split; ++s) mx = fmaxf(mx, p[s * (hd + 2) + hd]);
  float* o = out + int64_t(blockIdx.x) * hd;
  if (mx == -INFINITY) {  // no visible key: zeros, as the reference defines
    for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) o[d] = 0.0f;
    return;
  }
  float sum = 0.0f;
  for (int64_t s = 0; s < n_split; ++s) {
    const float ms = p[s * (hd + 2) + hd];
    if (ms != -INFINITY) sum += p[s * (hd + 2) + hd + 1] * expf(ms - mx);
  }
  const float inv = 1.0f / sum;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = 0; s < n_split; ++s) {
      const float ms = p[s * (hd + 2) + hd];
      if (ms != -INFINITY) acc += p[s * (hd + 2) + d] * expf(ms - mx);
    }
    o[d] = acc * inv;
  }
}

}  // namespace

size_t attention_scratch_floats(const DeviceAttention& a, int n_sm) {
  const Split sp = plan_split(a, n_sm);
  return size_t(a.n_q * a.n_head * sp.n_split * (a.head_dim + 2));
}

cudaError_t launch_attention(const DeviceAttention& a, float* scratch, int n_sm, cudaStream_t s) {
  if (a.head_dim <= 0 || a.head_dim > kMaxHeadDim || a.n_head_kv <= 0 ||
      a.n_head % a.n_head_kv != 0)
    return cudaErrorInvalidValue;
  if (a.n_q == 0) return cudaSuccess;
  const Split sp = plan_split(a, n_sm);
  const dim3 grid(unsigned(a.n_q * a.n_head), unsigned(sp.n_split));
  attention_split_kernel<<<grid, kWarps * 32, 0, s>>>(a, sp.keys_per_split, scratch);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  attention_merge_kernel<<<unsigned(a.n_q * a.n_head), 128, 0, s>>>(scratch, sp.n_split, a.head_dim,
                                                                    a.out);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
