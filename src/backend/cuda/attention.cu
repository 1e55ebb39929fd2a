// backend/cuda/attention.cu: causal attention over f16 KV planes read through the
// logical->physical row map, split-K flash style: each block walks one slice of the keys for
// one (query, head) with an online softmax, leaving an unnormalised partial (acc, max, sum);
// a second kernel merges the slices. One query with a long context (decode) splits its keys
// over enough blocks to fill the GPU; many queries (prefill) need no split.
// GQA-aware: a block serves up to 8 query heads of one KV head, so each K/V row is read once
// per group, not once per query head. Sliding windows, softcaps; head_dim even, <= 256.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"

namespace kiln::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxHeadDim = 256;
constexpr int kPairs = kMaxHeadDim / 64;  // f16 pairs (half2) each lane owns: d = 2 lane + 64 c
constexpr int64_t kMinKeysPerSplit = 32;
constexpr int kMaxGroup = 8;  // query heads one block serves (registers: 2 kPairs floats each)

// Query heads per block: the largest of 8, 4, 2, 1 dividing the GQA ratio, so that every head
// of a block reads the same KV head and each K/V row is loaded once for all of them (with
// 32/8 heads, a quarter of the K/V traffic of one block per query head).
int group_of(const DeviceAttention& a) {
  const int64_t ratio = a.n_head / a.n_head_kv;
  for (int g = kMaxGroup; g > 1; g /= 2)
    if (ratio % g == 0) return g;
  return 1;
}

struct Split {
  int64_t n_split = 1, keys_per_split = 0;
};

// Enough blocks to fill the GPU four times: few (query, head group) items (decode) split their
// keys over more blocks, each with at least kMinKeysPerSplit keys.
Split plan_split(const DeviceAttention& a, int n_sm) {
  Split sp;
  const int64_t items = a.n_q * (a.n_head / group_of(a));
  const int64_t want = (4 * int64_t(n_sm) + items - 1) / items;
  const int64_t most = (a.n_kv + kMinKeysPerSplit - 1) / kMinKeysPerSplit;
  sp.n_split = std::max<int64_t>(1, std::min(want, most));
  sp.keys_per_split = (a.n_kv + sp.n_split - 1) / sp.n_split;
  return sp;
}

// grid: (n_q * n_head / G, n_split); block: kWarps warps. Block x serves query x / (n_head / G)
// and heads G * (x % (n_head / G)) .. + G - 1, one KV head. Each warp takes runs of KB keys
// (run r of the slice: warp r % kWarps): it loads each key's K and V rows once (4-byte half2
// loads, a warp's loads contiguous), scores them against the G queries, and keeps G online
// softmaxes. Partial
// layout per (q, head, split): [head_dim] unnormalised acc, then max, then sum.
template <int G, int KB>
__global__ void __launch_bounds__(kWarps * 32)
    attention_split_kernel(DeviceAttention a, int64_t keys_per_split, float* __restrict__ part) {
  __shared__ float q_s[G][kMaxHeadDim];
  __shared__ float acc_s[kWarps][kMaxHeadDim];
  __shared__ float m_s[kWarps][G], l_s[kWarps][G];
  const int64_t groups = a.n_head / G;
  const int64_t qi = blockIdx.x / groups, h0 = (blockIdx.x % groups) * G;
  const int64_t hd = a.head_dim, kv_w = a.n_head_kv * hd;
  const int64_t kvh = h0 / (a.n_head / a.n_head_kv);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t i = threadIdx.x; i < G * hd; i += blockDim.x)
    q_s[i / hd][i % hd] = a.q[(qi * a.n_head + h0) * hd + i];
  __syncthreads();
  const int32_t qp = a.q_pos[qi];
  const int64_t j0 = int64_t(blockIdx.y) * keys_per_split;
  const int64_t j1 = min(a.n_kv, j0 + keys_per_split);

  float m[G], l[G], acc[G][kPairs][2];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int c = 0; c < kPairs; ++c) acc[g][c][0] = acc[g][c][1] = 0.0f;
  }
  // KB keys per warp per step, every K/V load of the step issued before any score: a decode
  // block walks its slice as a chain of memory round trips, and KB of them overlap. The keys
  // are then folded into the online softmaxes one at a time, in key order.
  for (int64_t jb = j0 + int64_t(warp) * KB; jb < j1; jb += int64_t(kWarps) * KB) {
    bool vis[KB];
    float2 kf[KB][kPairs], vf[KB][kPairs];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      const int64_t j = jb + b < j1 ? jb + b : j1 - 1;  // clamped: loaded, never used
      const int32_t kp = a.kv_pos[j];
      vis[b] = jb + b < j1 && kp <= qp && !(a.window > 0 && qp - kp >= a.window);
      const int64_t base = int64_t(a.kv_rows[j]) * kv_w + kvh * hd;
#pragma unroll
      for (int c = 0; c < kPairs; ++c) {
        const int64_t d = 2 * lane + 64 * c;
        kf[b][c] = vf[b][c] = make_float2(0.0f, 0.0f);
        if (d < hd) {  // hd even: a pair never straddles the end; rows are 4-byte aligned
          kf[b][c] = __half22float2(*reinterpret_cast<const __half2*>(a.k + base + d));
          vf[b][c] = __half22float2(*reinterpret_cast<const __half2*>(a.v + base + d));
        }
      }
    }
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      if (!vis[b]) continue;  // warp-uniform
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int c = 0; c < kPairs; ++c) {
          const int64_t d = 2 * lane + 64 * c;
          if (d < hd) {
            dot = fmaf(q_s[g][d], kf[b][c].x, dot);
            dot = fmaf(q_s[g][d + 1], kf[b][c].y, dot);
          }
        }
        dot = warp_reduce_sum(dot);
        float logit = dot * a.scale;
        if (a.softcap > 0) logit = a.softcap * tanhf(logit / a.softcap);
        const float m_new = fmaxf(m[g], logit);
        const float corr = expf(m[g] - m_new);  // m = -inf the first time: corr = 0
        const float p = expf(logit - m_new);
        l[g] = l[g] * corr + p;
#pragma unroll
        for (int c = 0; c < kPairs; ++c) {
          acc[g][c][0] = acc[g][c][0] * corr + p * vf[b][c].x;
          acc[g][c][1] = acc[g][c][1] * corr + p * vf[b][c].y;
        }
        m[g] = m_new;
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) m_s[warp][g] = m[g], l_s[warp][g] = l[g];
  }
  // One head at a time through acc_s: the warps' partials merged in warp order.
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int c = 0; c < kPairs; ++c) {
      const int64_t d = 2 * lane + 64 * c;
      if (d < hd) acc_s[warp][d] = acc[g][c][0], acc_s[warp][d + 1] = acc[g][c][1];
    }
    __syncthreads();
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_s[w][g]);
    float* out = part + ((qi * a.n_head + h0 + g) * gridDim.y + blockIdx.y) * (hd + 2);
    for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
      float s = 0.0f;
      if (mx != -INFINITY) {
#pragma unroll
        for (int w = 0; w < kWarps; ++w)
          if (m_s[w][g] != -INFINITY) s += acc_s[w][d] * expf(m_s[w][g] - mx);
      }
      out[d] = s;
    }
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      if (mx != -INFINITY)
        for (int w = 0; w < kWarps; ++w)
          if (m_s[w][g] != -INFINITY) sum += l_s[w][g] * expf(m_s[w][g] - mx);
      out[hd] = mx;
      out[hd + 1] = sum;
    }
    __syncthreads();  // acc_s is rewritten for the next head
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
  if (a.head_dim % 2 != 0) return cudaErrorInvalidValue;  // half2 loads
  const Split sp = plan_split(a, n_sm);
  const int g = group_of(a);
  const dim3 grid(unsigned(a.n_q * (a.n_head / g)), unsigned(sp.n_split));
  switch (g) {
    case 8:
      attention_split_kernel<8, 2><<<grid, kWarps * 32, 0, s>>>(a, sp.keys_per_split, scratch);
      break;
    case 4:
      attention_split_kernel<4, 4><<<grid, kWarps * 32, 0, s>>>(a, sp.keys_per_split, scratch);
      break;
    case 2:
      attention_split_kernel<2, 4><<<grid, kWarps * 32, 0, s>>>(a, sp.keys_per_split, scratch);
      break;
    default:
      attention_split_kernel<1, 4><<<grid, kWarps * 32, 0, s>>>(a, sp.keys_per_split, scratch);
      break;
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  attention_merge_kernel<<<unsigned(a.n_q * a.n_head), 128, 0, s>>>(scratch, sp.n_split, a.head_dim,
                                                                    a.out);
  return cudaGetLastError();
}

}  // namespace kiln::cuda
