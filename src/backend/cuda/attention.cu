// backend/cuda/attention.cu: causal attention over f16 KV planes read through the
// logical->physical row map, split-K flash style: each block walks one slice of the keys for
// one (query, head) with an online softmax, leaving an unnormalised partial (acc, max, sum);
// a second kernel merges the slices. One query with a long context (decode) splits its keys
// over enough blocks to fill the GPU; many queries (prefill) need no split.
// GQA-aware: a block serves up to 8 query heads of one KV head, so each K/V row is read once
// per group, not once per query head. Sliding windows, softcaps; head_dim even, <= 256.
// Wider rows (latent attention's absorbed MQA rows: kv_lora + rope = 576 for DeepSeek-V3)
// take a kernel of their own (attention_wide_body below), decode and prefill alike.
// Prefill (many queries, head_dim 64 or 128) takes a tensor-core tile kernel instead
// (attention_tile_kernel below): the split kernel re-reads every K/V row once per query.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/cp_async.cuh"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/launch.cuh"

namespace kiln::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxHeadDim = 256;  // the split, warp-tile and tile kernels; wider: wide kernel
constexpr int kWideHeadDim = int(kAttentionMaxHeadDim);  // the wide kernel's rows
constexpr int kWideMaxGroup = 4;  // its query heads per block (registers: 18 floats each)
constexpr int64_t kMinKeysPerSplit = 32;
constexpr int kMaxGroup = 8;   // query heads one block serves (registers: 2 P floats each)
constexpr int kTileKeys = 32;  // warp-tile kernel: keys per warp and step
constexpr int64_t kWtMinKeysPerSplit = 256;  // and its shortest slice

// Query heads per block: the largest of 8, 4, 2, 1 dividing the GQA ratio, so that every head
// of a block reads the same KV head and each K/V row is loaded once for all of them (with
// 32/8 heads, a quarter of the K/V traffic of one block per query head).
// Wide heads: at most kWideMaxGroup.
int group_of(const DeviceAttention& a) {
  const int64_t ratio = a.n_head / a.n_head_kv;
  for (int g = a.head_dim > kMaxHeadDim ? kWideMaxGroup : kMaxGroup; g > 1; g /= 2)
    if (ratio % g == 0) return g;
  return 1;
}

struct Split {
  int64_t n_split = 1, keys_per_split = 0;
};

// Enough blocks to fill the GPU four times: few (query, head group) items (decode) split their
// keys over more blocks, each with at least kMinKeysPerSplit keys (warp tiles: at least
// kWtMinKeysPerSplit, whole tiles for every warp). Depends on this item alone, so a sequence
// gets the same plan, and the same bits, alone or in a batch.
Split plan_split(const DeviceAttention& a, int n_sm) {
  Split sp;
  const int64_t items = a.n_q * (a.n_head / group_of(a));
  const int64_t want = (4 * int64_t(n_sm) + items - 1) / items;
  const int64_t min_keys = a.warp_tiles ? kWtMinKeysPerSplit : kMinKeysPerSplit;
  const int64_t most = (a.n_kv + min_keys - 1) / min_keys;
  sp.n_split = std::max<int64_t>(1, std::min(want, most));
  sp.keys_per_split = (a.n_kv + sp.n_split - 1) / sp.n_split;
  if (a.warp_tiles) {
    constexpr int64_t step = int64_t(kWarps) * kTileKeys;
    sp.keys_per_split = std::max<int64_t>(step, (sp.keys_per_split + step - 1) / step * step);
    sp.n_split = std::max<int64_t>(1, (a.n_kv + sp.keys_per_split - 1) / sp.keys_per_split);
  }
  return sp;
}

// Folds head h's attention sink (gpt-oss; sinks null: none) into a finished softmax of max mx
// and sum `sum`: the sink is one more logit without a value row, as llama.cpp's flash-attention
// finish adds it. Returns the factor the unnormalised accumulator takes (1 unless the sink is
// the new max); sum becomes the denominator.
__device__ __forceinline__ float fold_sink(const float* __restrict__ sinks, int64_t h, float mx,
                                           float& sum) {
  if (sinks == nullptr) return 1.0f;
  const float s = sinks[h];
  if (s > mx) {
    const float c = expf(mx - s);
    sum = sum * c + 1.0f;
    return c;
  }
  sum += expf(s - mx);
  return 1.0f;
}

// Value d of head h's combined slice (max mx, weighted value sum s, denominator sum) for query
// qi: with one split the normalised output (zeros when no key was visible; the sink folded in),
// else the slice's partial [values, max, sum] for the merge kernel. The warp-tile and wide
// kernels end with this.
__device__ __forceinline__ void finish_slice(const DeviceAttention& a, float* __restrict__ part,
                                             int64_t qi, int64_t h, int64_t by, int64_t n_split,
                                             int64_t hd, int64_t d, float mx, float s, float sum) {
  if (n_split == 1) {  // the whole key list: normalised here, no merge kernel
    float* o = a.out + (qi * a.n_head + h) * hd + d;
    if (mx == -INFINITY) {
      *o = 0.0f;
    } else if (a.sinks == nullptr) {
      *o = s * (1.0f / sum);
    } else {
      const float c = fold_sink(a.sinks, h, mx, sum);
      *o = s * c * (1.0f / sum);
    }
    return;
  }
  float* out = part + ((qi * a.n_head + h) * n_split + by) * (hd + 2);
  out[d] = s;
  if (d == 0) out[hd] = mx, out[hd + 1] = sum;
}

// The largest of the block's warps' running maxima of head g (-inf when no warp saw a key).
template <int G>
__device__ __forceinline__ float warps_max(const float (&m_s)[kWarps][G], int g) {
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_s[w][g]);
  return mx;
}

// Where a decode block sits, shared by the split and warp-tile kernels: block bx serves query
// qi = bx / (n_head / G) and heads h0 .. h0 + G - 1 (one KV head, kvh), slice by of the keys,
// [j0, j1); visible(kp): whether that query sees the key at position kp.
template <int G>
struct BlockPlace {
  const DeviceAttention& a;
  int64_t qi, h0, hd, kv_w, kvh;
  int32_t qp;
  int64_t j0, j1;
  __device__ __forceinline__ BlockPlace(const DeviceAttention& a_, int64_t keys_per_split,
                                        int64_t bx, int64_t by)
      : a(a_),
        qi(bx / (a_.n_head / G)),
        h0((bx % (a_.n_head / G)) * G),
        hd(a_.head_dim),
        kv_w(a_.n_head_kv * a_.head_dim),
        kvh(h0 / (a_.n_head / a_.n_head_kv)),
        qp(a_.q_pos[qi]),
        j0(by * keys_per_split),
        j1(min(a_.n_kv, j0 + keys_per_split)) {}
  __device__ __forceinline__ bool visible(int32_t kp) const {
    return kp <= qp && !(a.window > 0 && qp - kp >= a.window);
  }
};

// grid: (n_q * n_head / G, n_split); block: kWarps warps. Block x serves query x / (n_head / G)
// and heads G * (x % (n_head / G)) .. + G - 1, one KV head. Each warp takes runs of KB keys
// (run r of the slice: warp r % kWarps): it loads each key's K and V rows once (4-byte half2
// loads, a warp's loads contiguous), scores them against the G queries, and keeps G online
// softmaxes. Each lane owns P f16 pairs of a row (d = 2 lane + 64 c, c < P): P is the
// head size's, not the largest one's, so a 128-wide head keeps half the registers of a 256-wide
// one (and more blocks fit on an SM); the pairs past the head size were never computed.
// Partial layout per (q, head, split): [head_dim] unnormalised acc, then max, then sum.
// A slice with no visible key (the padding of a graph's key bucket past a short context) writes
// the empty partial (zeros, -inf, 0) at once, the bits the full walk would have left.
// The body is shared by the one-sequence kernel (bx, by = blockIdx) and the batched one (bx, by
// from the block's place in its sequence's range), so a sequence's result has the same bits
// either way.
template <int G, int KB, int P>
__device__ __forceinline__ void attention_split_body(const DeviceAttention& a,
                                                     int64_t keys_per_split,
                                                     float* __restrict__ part, int64_t bx,
                                                     int64_t by, int64_t n_split) {
  constexpr int HD = 64 * P;  // the widest head this instantiation serves
  __shared__ float q_s[G][HD];
  __shared__ float acc_s[kWarps][G][HD];
  __shared__ float m_s[kWarps][G], l_s[kWarps][G];
  const BlockPlace<G> at(a, keys_per_split, bx, by);
  const int64_t qi = at.qi, h0 = at.h0, hd = at.hd, kv_w = at.kv_w, kvh = at.kvh;
  const int64_t j0 = at.j0, j1 = at.j1;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto visible = [&](int32_t kp) { return at.visible(kp); };

  // The queries and the slice's positions load in the same round trip; one barrier both
  // publishes q_s and tells whether any key of the slice is visible.
  for (int64_t i = threadIdx.x; i < G * hd; i += blockDim.x)
    q_s[i / hd][i % hd] = a.q[(qi * a.n_head + h0) * hd + i];
  bool any = false;
  for (int64_t j = j0 + threadIdx.x; j < j1 && !any; j += blockDim.x) any = visible(a.kv_pos[j]);
  if (!__syncthreads_or(any)) {
    for (int64_t i = threadIdx.x; i < int64_t(G) * (hd + 2); i += blockDim.x) {
      const int64_t g = i / (hd + 2), d = i % (hd + 2);
      part[((qi * a.n_head + h0 + g) * n_split + by) * (hd + 2) + d] = d == hd ? -INFINITY : 0.0f;
    }
    return;
  }

  float m[G], l[G], acc[G][P][2];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int c = 0; c < P; ++c) acc[g][c][0] = acc[g][c][1] = 0.0f;
  }
  // KB keys per warp per step, every K/V load of the step issued before any score: a decode
  // block walks its slice as a chain of memory round trips, and KB of them overlap. The keys
  // are then folded into the online softmaxes one at a time, in key order.
  for (int64_t jb = j0 + int64_t(warp) * KB; jb < j1; jb += int64_t(kWarps) * KB) {
    bool vis[KB];
    float2 kf[KB][P], vf[KB][P];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
      const int64_t j = jb + b < j1 ? jb + b : j1 - 1;  // clamped: loaded, never used
      vis[b] = jb + b < j1 && visible(a.kv_pos[j]);
      const int64_t base = int64_t(a.kv_rows[j]) * kv_w + kvh * hd;
#pragma unroll
      for (int c = 0; c < P; ++c) {
        const int64_t d = 2 * lane + 64 * c;
        kf[b][c] = vf[b][c] = make_float2(0.0f, 0.0f);
        // Not predicated on vis: the K/V loads then wait only for kv_rows, not kv_pos too.
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
        for (int c = 0; c < P; ++c) {
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
        for (int c = 0; c < P; ++c) {
          acc[g][c][0] = acc[g][c][0] * corr + p * vf[b][c].x;
          acc[g][c][1] = acc[g][c][1] * corr + p * vf[b][c].y;
        }
        m[g] = m_new;
      }
    }
  }
  // The warps' partials merged in warp order, every head at once.
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) m_s[warp][g] = m[g], l_s[warp][g] = l[g];
#pragma unroll
    for (int c = 0; c < P; ++c) {
      const int64_t d = 2 * lane + 64 * c;
      if (d < hd) acc_s[warp][g][d] = acc[g][c][0], acc_s[warp][g][d + 1] = acc[g][c][1];
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < int64_t(G) * hd; i += blockDim.x) {
    const int g = int(i / hd);
    const int64_t d = i % hd;
    const float mx = warps_max(m_s, g);
    float s = 0.0f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w)
        if (m_s[w][g] != -INFINITY) s += acc_s[w][g][d] * expf(m_s[w][g] - mx);
    }
    part[((qi * a.n_head + h0 + g) * n_split + by) * (hd + 2) + d] = s;
  }
  if (threadIdx.x < G) {
    const int g = int(threadIdx.x);
    const float mx = warps_max(m_s, g);
    float sum = 0.0f;
    if (mx != -INFINITY)
      for (int w = 0; w < kWarps; ++w)
        if (m_s[w][g] != -INFINITY) sum += l_s[w][g] * expf(m_s[w][g] - mx);
    float* out = part + ((qi * a.n_head + h0 + g) * n_split + by) * (hd + 2);
    out[hd] = mx;
    out[hd + 1] = sum;
  }
}

template <int G, int KB, int P>
__global__ void __launch_bounds__(kWarps * 32)
    attention_split_kernel(DeviceAttention a, int64_t keys_per_split, float* __restrict__ part) {
  pdl_enter();
  attention_split_body<G, KB, P>(a, keys_per_split, part, blockIdx.x, blockIdx.y, gridDim.y);
}

// The item whose block range [first[i], first[i + 1]) holds block b (items in order).
__device__ __forceinline__ int find_item(const AttentionBatchItem* items, int n, int64_t b,
                                         bool merge) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if ((merge ? items[mid].merge0 : items[mid].block0) <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Several sequences' split kernels in one grid: block b belongs to the item whose range holds
// it and runs exactly the block that item's own launch would run there.
template <int G, int KB, int P>
__global__ void __launch_bounds__(kWarps * 32)
    attention_split_batch_kernel(const AttentionBatchItem* __restrict__ items, int n) {
  pdl_enter();
  const int i = find_item(items, n, blockIdx.x, false);
  const AttentionBatchItem& it = items[i];
  const int64_t local = int64_t(blockIdx.x) - it.block0;
  attention_split_body<G, KB, P>(it.a, it.keys_per_split, it.part, local / it.n_split,
                                 local % it.n_split, it.n_split);
}

// ------------------------------------------------ decode: warp tiles (kernels.h warp_tiles)
// The split kernel above spreads a key's head dimensions over the lanes, so every key costs
// each head a warp reduction and every lane computes the same softmax step: a chain of
// dependent shuffles and exps per key. Here a warp takes 32 keys at a time, one per lane:
// - scores: each lane dots its key's K row (16-byte loads) with the G queries held in shared
//   memory (two accumulators a query: even and odd dimensions);
// - softmax: one warp max per head and tile, one exp per (key, head), a per-lane running sum
//   of the weights (summed over the warp once, at the end);
// - values: the lanes own hd / 32 dimensions each and fold the tile's 32 V rows with the
//   weights broadcast from shared memory. The tile's V rows are copied into shared memory by
//   cp.async before the scores (HD <= 128; no registers held), so one memory round trip
//   serves a tile; the next tile's rows and positions load while this one computes.
// An invisible key of a tile with a visible one reads the first visible key's rows (weight 0):
// its scores are dropped and its V row adds 0 times a row the reference reads too.
// Slices are whole tiles per warp and at least kWtMinKeysPerSplit keys, so a decode step's
// padded 256-key bucket is one slice: the block then writes the normalised output itself and
// no merge kernel runs (a query that sees no key gets zeros, as the reference defines).
// Otherwise the partials have the split kernel's layout and the same merge kernels serve.
template <int G, int HD>
__device__ __forceinline__ void attention_wt_body(const DeviceAttention& a, int64_t keys_per_split,
                                                  float* __restrict__ part, int64_t bx, int64_t by,
                                                  int64_t n_split) {
  constexpr int D = HD / 32;           // value dimensions per lane
  constexpr bool kVAhead = HD <= 128;  // the tile's V rows copied ahead into shared memory
  // Per warp: the tile's V rows (kVAhead), later reused for the warp's accumulators.
  constexpr int kVBytes = kVAhead ? kTileKeys * HD * 2 : 0;
  constexpr int kWarpBytes = kVBytes > G * HD * 4 ? kVBytes : G * HD * 4;
  using VChunk =
      typename std::conditional<D == 2, uint32_t,
                                typename std::conditional<D == 4, uint2, uint4>::type>::type;
  __shared__ __align__(16) float q_s[G][HD];
  __shared__ __align__(16) unsigned char warp_s[kWarps][kWarpBytes];
  __shared__ __align__(16) float p_s[kWarps][kTileKeys][G];
  __shared__ float m_s[kWarps][G], l_s[kWarps][G];
  __shared__ int32_t row_s[kVAhead ? 1 : kWarps][kTileKeys];
  const BlockPlace<G> at(a, keys_per_split, bx, by);
  const int64_t qi = at.qi, h0 = at.h0, hd = at.hd, kv_w = at.kv_w, kvh = at.kvh;
  const int64_t j0 = at.j0, j1 = at.j1;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto visible = [&](int32_t kp) { return at.visible(kp); };
  VChunk* v_s = reinterpret_cast<VChunk*>(warp_s[warp]);  // [key][32 lanes]
  float* acc_s = reinterpret_cast<float*>(warp_s[warp]);  // [G][HD], after the walk

  // Every query load is issued before any is stored: a loop striding by blockDim.x stores
  // each load before issuing the next, one memory round trip per iteration.
  constexpr int kQPerThread = (G * HD + kWarps * 32 - 1) / (kWarps * 32);
  float qv[kQPerThread];
#pragma unroll
  for (int k = 0; k < kQPerThread; ++k) {
    const int i = int(threadIdx.x) + k * kWarps * 32, g = i / HD, d = i % HD;
    qv[k] = i < G * HD && d < hd ? a.q[(qi * a.n_head + h0 + g) * hd + d] : 0.0f;
  }
#pragma unroll
  for (int k = 0; k < kQPerThread; ++k) {
    const int i = int(threadIdx.x) + k * kWarps * 32;
    if (i < G * HD) q_s[i / HD][i % HD] = qv[k];
  }
  // The first tile's rows and positions load beside the queries.
  int64_t jt = j0 + int64_t(warp) * kTileKeys;
  int32_t next_row = 0, next_pos = INT_MAX;
  if (jt + lane < j1) next_row = a.kv_rows[jt + lane], next_pos = a.kv_pos[jt + lane];
  __syncthreads();

  float m[G], l[G], acc[G][D];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;
  }
  const bool v_lane = lane * D < hd;  // hd % 8 == 0: a lane's dimensions are all in or all out
  const uint16_t* v_head = a.v + kvh * hd + lane * D;
  for (; jt < j1; jt += int64_t(kWarps) * kTileKeys) {
    const bool vis = jt + lane < j1 && visible(next_pos);
    int32_t row = next_row;
    const int64_t jn = jt + int64_t(kWarps) * kTileKeys + lane;
    if (jn < j1) next_row = a.kv_rows[jn], next_pos = a.kv_pos[jn];
    const unsigned mask = __ballot_sync(0xffffffffu, vis);
    if (mask == 0) continue;  // warp-uniform
    const int32_t vis_row = __shfl_sync(0xffffffffu, row, __ffs(mask) - 1);
    if (!vis) row = vis_row;

    if constexpr (kVAhead) {
      // Each lane copies its own dimensions of every key's V row, which only it reads back:
      // no barrier, only its own wait.
#pragma unroll
      for (int k = 0; k < kTileKeys; ++k) {
        const int32_t r = __shfl_sync(0xffffffffu, row, k);
        if (v_lane) cp_async<D * 2>(v_s + k * 32 + lane, v_head + int64_t(r) * kv_w);
      }
      cp_async_commit();
    }

    const uint16_t* kr = a.k + int64_t(row) * kv_w + kvh * hd;
    float s0[G], s1[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s0[g] = s1[g] = 0.0f;
#pragma unroll
    for (int c = 0; c < HD / 8; ++c) {
      if (c * 8 < hd) {
        const uint4 u = *reinterpret_cast<const uint4*>(kr + 8 * c);
        const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 f = __half22float2(h[i]);
#pragma unroll
          for (int g = 0; g < G; ++g) {
            s0[g] = fmaf(q_s[g][8 * c + 2 * i], f.x, s0[g]);
            s1[g] = fmaf(q_s[g][8 * c + 2 * i + 1], f.y, s1[g]);
          }
        }
      }
    }
    float corr[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float logit = (s0[g] + s1[g]) * a.scale;
      if (a.softcap > 0) logit = a.softcap * tanhf(logit / a.softcap);
      if (!vis) logit = -INFINITY;
      const float m_new = fmaxf(m[g], warp_reduce_max(logit));  // finite: a key is visible
      corr[g] = expf(m[g] - m_new);                             // m = -inf the first time: 0
      const float p = vis ? expf(logit - m_new) : 0.0f;
      l[g] = l[g] * corr[g] + p;
      m[g] = m_new;
      p_s[warp][lane][g] = p;
    }
    if constexpr (!kVAhead) row_s[warp][lane] = row;
    __syncwarp();
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int d = 0; d < D; ++d) acc[g][d] *= corr[g];
    auto fold = [&](int k, const VChunk& vk) {
      const __half2* h = reinterpret_cast<const __half2*>(&vk);
#pragma unroll
      for (int i = 0; i < D / 2; ++i) {
        const float2 f = __half22float2(h[i]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float p = p_s[warp][k][g];
          acc[g][2 * i] = fmaf(p, f.x, acc[g][2 * i]);
          acc[g][2 * i + 1] = fmaf(p, f.y, acc[g][2 * i + 1]);
        }
      }
    };
    if constexpr (kVAhead) {
      cp_async_wait<0>();
      if (v_lane) {
#pragma unroll
        for (int k = 0; k < kTileKeys; ++k) fold(k, v_s[k * 32 + lane]);
      }
    } else if (v_lane) {
#pragma unroll 8
      for (int k = 0; k < kTileKeys; ++k)
        fold(k, *reinterpret_cast<const VChunk*>(v_head + int64_t(row_s[warp][k]) * kv_w));
    }
    __syncwarp();  // p_s and row_s are rewritten by the next tile
  }
  // The warps' partials merged in warp order, every head at once (as the split kernel). The
  // accumulators take the place of the warp's V rows (each lane is past its last read of them:
  // the __syncwarp ending the walk).
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float lw = warp_reduce_sum(l[g]);
    if (lane == 0) m_s[warp][g] = m[g], l_s[warp][g] = lw;
    if (v_lane) {
#pragma unroll
      for (int d = 0; d < D; ++d) acc_s[g * HD + lane * D + d] = acc[g][d];
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < int64_t(G) * hd; i += blockDim.x) {
    const int g = int(i / hd);
    const int64_t d = i % hd;
    const float mx = warps_max(m_s, g);
    float s = 0.0f, sum = 0.0f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w)
        if (m_s[w][g] != -INFINITY) {
          const float e = expf(m_s[w][g] - mx);
          s += reinterpret_cast<const float*>(warp_s[w])[g * HD + d] * e;
          sum += l_s[w][g] * e;
        }
    }
    finish_slice(a, part, qi, h0 + g, by, n_split, hd, d, mx, s, sum);
  }
}

template <int G, int HD>
__global__ void __launch_bounds__(kWarps * 32)
    attention_wt_kernel(DeviceAttention a, int64_t keys_per_split, float* __restrict__ part) {
  pdl_enter();
  attention_wt_body<G, HD>(a, keys_per_split, part, blockIdx.x, blockIdx.y, gridDim.y);
}

template <int G, int HD>
__global__ void __launch_bounds__(kWarps * 32)
    attention_wt_batch_kernel(const AttentionBatchItem* __restrict__ items, int n) {
  pdl_enter();
  const int i = find_item(items, n, blockIdx.x, false);
  const AttentionBatchItem& it = items[i];
  const int64_t local = int64_t(blockIdx.x) - it.block0;
  attention_wt_body<G, HD>(it.a, it.keys_per_split, it.part, local / it.n_split, local % it.n_split,
                           it.n_split);
}

// ------------------------------------------------------- wide heads: latent attention rows
// Heads wider than kMaxHeadDim, up to kWideHeadDim (576: DeepSeek-V3 / Kimi-K2's absorbed MLA
// rows, one KV head, V the K plane itself), decode and prefill alike. The warp-tile scheme:
// - scores: a warp takes 32 keys at a time, one per lane; each lane dots its key's K row
//   (16-byte loads) with the G queries held in shared memory;
// - softmax: one warp max per head and tile, a per-lane running sum of the weights;
// - values: each lane owns the f16 pairs d = 2 lane + 64 c (c < 9) of every V row, so a warp's
//   loads of a row are contiguous (with V = K they are the rows the scores just read, by other
//   lanes); tiles' keys no query sees are skipped.
// A group of at most kWideMaxGroup heads: the accumulators are 18 floats a lane per head (8
// heads would spill), and the block's shared memory (queries and the warps' accumulators)
// stays within the 48 KiB a kernel has without opting in. Slices as the warp-tile kernel's
// (whole 128-key rounds, at least 256 keys; plan_split with warp_tiles set), and the same
// output: one slice writes the normalised row itself, several write partials for the merge
// kernels. Prefill runs here too (the tile kernel's shared memory does not fit 576-wide rows):
// each block walks its query's keys, skipping the tiles its query does not see.
template <int G>
__device__ __forceinline__ void attention_wide_body(const DeviceAttention& a,
                                                    int64_t keys_per_split,
                                                    float* __restrict__ part, int64_t bx,
                                                    int64_t by, int64_t n_split) {
  constexpr int HD = kWideHeadDim;
  constexpr int P = HD / 64;  // f16 pairs of a row per lane
  static_assert(HD % 64 == 0);
  __shared__ __align__(16) float q_s[G][HD];
  __shared__ float acc_s[kWarps][G][HD];
  __shared__ float p_s[kWarps][kTileKeys][G];
  __shared__ float m_s[kWarps][G], l_s[kWarps][G];
  __shared__ int32_t row_s[kWarps][kTileKeys];
  const BlockPlace<G> at(a, keys_per_split, bx, by);
  const int64_t qi = at.qi, h0 = at.h0, hd = at.hd, kv_w = at.kv_w, kvh = at.kvh;
  const int64_t j0 = at.j0, j1 = at.j1;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  auto visible = [&](int32_t kp) { return at.visible(kp); };

  // Every query load issued before any is stored (one memory round trip); past hd: zeros.
  constexpr int kQPerThread = (G * HD + kWarps * 32 - 1) / (kWarps * 32);
  float qv[kQPerThread];
#pragma unroll
  for (int k = 0; k < kQPerThread; ++k) {
    const int i = int(threadIdx.x) + k * kWarps * 32, g = i / HD, d = i % HD;
    qv[k] = i < G * HD && d < hd ? a.q[(qi * a.n_head + h0 + g) * hd + d] : 0.0f;
  }
#pragma unroll
  for (int k = 0; k < kQPerThread; ++k) {
    const int i = int(threadIdx.x) + k * kWarps * 32;
    if (i < G * HD) q_s[i / HD][i % HD] = qv[k];
  }
  int64_t jt = j0 + int64_t(warp) * kTileKeys;
  int32_t next_row = 0, next_pos = INT_MAX;
  if (jt + lane < j1) next_row = a.kv_rows[jt + lane], next_pos = a.kv_pos[jt + lane];
  __syncthreads();

  float m[G], l[G], acc[G][P][2];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
    for (int c = 0; c < P; ++c) acc[g][c][0] = acc[g][c][1] = 0.0f;
  }
  const uint16_t* k_head = a.k + kvh * hd;
  const uint16_t* v_head = a.v + kvh * hd;
  for (; jt < j1; jt += int64_t(kWarps) * kTileKeys) {
    const bool vis = jt + lane < j1 && visible(next_pos);
    int32_t row = next_row;
    const int64_t jn = jt + int64_t(kWarps) * kTileKeys + lane;
    if (jn < j1) next_row = a.kv_rows[jn], next_pos = a.kv_pos[jn];
    const unsigned mask = __ballot_sync(0xffffffffu, vis);
    if (mask == 0) continue;  // warp-uniform
    // An invisible key scores a visible key's row (its score is dropped): padding and keys out
    // of the window may point at rows the reference never reads.
    const int32_t vis_row = __shfl_sync(0xffffffffu, row, __ffs(mask) - 1);
    if (!vis) row = vis_row;

    const uint16_t* kr = k_head + int64_t(row) * kv_w;
    float s0[G], s1[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s0[g] = s1[g] = 0.0f;
#pragma unroll 8
    for (int c = 0; c < HD / 8; ++c) {
      if (c * 8 < hd) {  // hd % 8 == 0 (attention_warp_tiles_fit)
        const uint4 u = *reinterpret_cast<const uint4*>(kr + 8 * c);
        const __half2* h = reinterpret_cast<const __half2*>(&u);
        float2 f[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = __half22float2(h[i]);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          // The query's 8 dimensions in two 16-byte shared loads (broadcast to the warp).
          const float4 qa = *reinterpret_cast<const float4*>(&q_s[g][8 * c]);
          const float4 qb = *reinterpret_cast<const float4*>(&q_s[g][8 * c + 4]);
          s0[g] = fmaf(qa.x, f[0].x, s0[g]), s1[g] = fmaf(qa.y, f[0].y, s1[g]);
          s0[g] = fmaf(qa.z, f[1].x, s0[g]), s1[g] = fmaf(qa.w, f[1].y, s1[g]);
          s0[g] = fmaf(qb.x, f[2].x, s0[g]), s1[g] = fmaf(qb.y, f[2].y, s1[g]);
          s0[g] = fmaf(qb.z, f[3].x, s0[g]), s1[g] = fmaf(qb.w, f[3].y, s1[g]);
        }
      }
    }
    float corr[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float logit = (s0[g] + s1[g]) * a.scale;
      if (a.softcap > 0) logit = a.softcap * tanhf(logit / a.softcap);
      if (!vis) logit = -INFINITY;
      const float m_new = fmaxf(m[g], warp_reduce_max(logit));  // finite: a key is visible
      corr[g] = expf(m[g] - m_new);                             // m = -inf the first time: 0
      const float p = vis ? expf(logit - m_new) : 0.0f;
      l[g] = l[g] * corr[g] + p;
      m[g] = m_new;
      p_s[warp][lane][g] = p;
    }
    row_s[warp][lane] = row;
    __syncwarp();
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int c = 0; c < P; ++c) acc[g][c][0] *= corr[g], acc[g][c][1] *= corr[g];
#pragma unroll 2
    for (int k = 0; k < kTileKeys; ++k) {
      if (!((mask >> k) & 1u)) continue;  // weight 0 for every head; warp-uniform
      const uint16_t* vr = v_head + int64_t(row_s[warp][k]) * kv_w;
      float2 f[P];
#pragma unroll
      for (int c = 0; c < P; ++c) {
        const int64_t d = 2 * lane + 64 * c;
        f[c] = d < hd ? __half22float2(*reinterpret_cast<const __half2*>(vr + d))
                      : make_float2(0.0f, 0.0f);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = p_s[warp][k][g];
#pragma unroll
        for (int c = 0; c < P; ++c) {
          acc[g][c][0] = fmaf(p, f[c].x, acc[g][c][0]);
          acc[g][c][1] = fmaf(p, f[c].y, acc[g][c][1]);
        }
      }
    }
    __syncwarp();  // p_s and row_s are rewritten by the next tile
  }
  // The warps' partials merged in warp order, every head at once (as the warp-tile kernel).
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const float lw = warp_reduce_sum(l[g]);
    if (lane == 0) m_s[warp][g] = m[g], l_s[warp][g] = lw;
#pragma unroll
    for (int c = 0; c < P; ++c) {
      const int d = 2 * lane + 64 * c;
      acc_s[warp][g][d] = acc[g][c][0], acc_s[warp][g][d + 1] = acc[g][c][1];
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < int64_t(G) * hd; i += blockDim.x) {
    const int g = int(i / hd);
    const int64_t d = i % hd;
    const float mx = warps_max(m_s, g);
    float s = 0.0f, sum = 0.0f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w)
        if (m_s[w][g] != -INFINITY) {
          const float e = expf(m_s[w][g] - mx);
          s += acc_s[w][g][d] * e;
          sum += l_s[w][g] * e;
        }
    }
    finish_slice(a, part, qi, h0 + g, by, n_split, hd, d, mx, s, sum);
  }
}

template <int G>
__global__ void __launch_bounds__(kWarps * 32)
    attention_wide_kernel(DeviceAttention a, int64_t keys_per_split, float* __restrict__ part) {
  pdl_enter();
  attention_wide_body<G>(a, keys_per_split, part, blockIdx.x, blockIdx.y, gridDim.y);
}

template <int G>
__global__ void __launch_bounds__(kWarps * 32)
    attention_wide_batch_kernel(const AttentionBatchItem* __restrict__ items, int n) {
  pdl_enter();
  const int i = find_item(items, n, blockIdx.x, false);
  const AttentionBatchItem& it = items[i];
  const int64_t local = int64_t(blockIdx.x) - it.block0;
  attention_wide_body<G>(it.a, it.keys_per_split, it.part, local / it.n_split, local % it.n_split,
                         it.n_split);
}

// One (query, head): merges the splits' partials and normalises (bx = query * n_head + head).
__device__ __forceinline__ void attention_merge_body(const float* __restrict__ part,
                                                     int64_t n_split, int64_t hd,
                                                     float* __restrict__ out, int64_t bx,
                                                     const float* __restrict__ sinks,
                                                     int64_t n_head) {
  const float* p = part + bx * n_split * (hd + 2);
  float mx = -INFINITY;
  for (int64_t s = 0; s < n_split; ++s) mx = fmaxf(mx, p[s * (hd + 2) + hd]);
  float* o = out + bx * hd;
  if (mx == -INFINITY) {  // no visible key: zeros, as the reference defines
    for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) o[d] = 0.0f;
    return;
  }
  float sum = 0.0f;
  for (int64_t s = 0; s < n_split; ++s) {
    const float ms = p[s * (hd + 2) + hd];
    if (ms != -INFINITY) sum += p[s * (hd + 2) + hd + 1] * expf(ms - mx);
  }
  const float c = fold_sink(sinks, bx % n_head, mx, sum);
  const float inv = 1.0f / sum;
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = 0; s < n_split; ++s) {
      const float ms = p[s * (hd + 2) + hd];
      if (ms != -INFINITY) acc += p[s * (hd + 2) + d] * expf(ms - mx);
    }
    o[d] = sinks == nullptr ? acc * inv : acc * c * inv;
  }
}

// grid: n_q * n_head blocks.
__global__ void attention_merge_kernel(const float* __restrict__ part, int64_t n_split, int64_t hd,
                                       float* __restrict__ out, const float* __restrict__ sinks,
                                       int64_t n_head) {
  pdl_enter();
  attention_merge_body(part, n_split, hd, out, blockIdx.x, sinks, n_head);
}

__global__ void attention_merge_batch_kernel(const AttentionBatchItem* __restrict__ items, int n) {
  pdl_enter();
  const int i = find_item(items, n, blockIdx.x, true);
  const AttentionBatchItem& it = items[i];
  if (it.a.warp_tiles && it.n_split == 1) return;  // the warp-tile block wrote it
  attention_merge_body(it.part, it.n_split, it.a.head_dim, it.a.out,
                       int64_t(blockIdx.x) - it.merge0, it.a.sinks, it.a.n_head);
}

// ---------------------------------------------------------------- prefill: tensor-core tiles
// One block: 4 warps x 16 rows, a row being one (query, head) of a single KV head's group of G
// query heads (64 / G queries per block). The block walks the keys in tiles of kKT: K and V
// rows gathered through kv_rows into shared memory as f16 (the planes' own type), scores
// S = Q K^T on tensor cores (wmma 16x16x16, Q rounded to f16, f32 accumulation), an online
// softmax per row in f32 (scale, softcap, causal/window mask), P rounded to f16, O += P V on
// tensor cores into an f32 accumulator kept in shared memory (rescaled by the softmax
// correction first). Tiles whose keys no query of the block can see are skipped (causal
// prefill: about half). The f16 roundings of Q and P are the error this path adds over the
// split kernel (tests/cuda/cuda_attention_test.cpp bounds it).
constexpr int kKT = 64;        // keys per tile
constexpr int kTileRows = 64;  // (query, head) rows per block: 4 warps x 16
constexpr int64_t kTileMinQueries = 32;

template <int HD>
struct TileSmem {
  static constexpr int kLd = HD + 8;    // f16 rows of Q, K, V (wmma ldm: multiple of 8)
  static constexpr int kLdS = kKT + 4;  // f32 scores
  static constexpr int kLdP = kKT + 8;  // f16 probabilities
  static constexpr int kLdO = HD + 4;   // f32 output accumulator
  static constexpr size_t kK = size_t(kKT) * kLd * 2, kV = kK;
  static constexpr size_t kQ = size_t(kTileRows) * kLd * 2;
  static constexpr size_t kS = size_t(kTileRows) * kLdS * 4;
  static constexpr size_t kP = size_t(kTileRows) * kLdP * 2;
  static constexpr size_t kO = size_t(kTileRows) * kLdO * 4;
  static constexpr size_t kPos = size_t(kKT) * 4;
  static constexpr size_t kBytes = kK + kV + kQ + kS + kP + kO + kPos;
  // Every array starts 32-byte aligned (wmma's requirement), as does every 16-row slice.
  static_assert(kK % 32 == 0 && kQ % 32 == 0 && kS % 32 == 0 && kP % 32 == 0 && kO % 32 == 0);
  static_assert((16 * kLd * 2) % 32 == 0 && (16 * kLdS * 4) % 32 == 0 &&
                (16 * kLdP * 2) % 32 == 0 && (16 * kLdO * 4) % 32 == 0);
};

template <int HD, int G>
__global__ void __launch_bounds__(128) attention_tile_kernel(DeviceAttention a) {
  namespace wmma = nvcuda::wmma;
  using L = TileSmem<HD>;
  extern __shared__ __align__(128) unsigned char smem[];
  __half* k_s = reinterpret_cast<__half*>(smem);
  __half* v_s = reinterpret_cast<__half*>(smem + L::kK);
  __half* q_s = reinterpret_cast<__half*>(smem + L::kK + L::kV);
  float* s_s = reinterpret_cast<float*>(smem + L::kK + L::kV + L::kQ);
  __half* p_s = reinterpret_cast<__half*>(smem + L::kK + L::kV + L::kQ + L::kS);
  float* o_s = reinterpret_cast<float*>(smem + L::kK + L::kV + L::kQ + L::kS + L::kP);
  int32_t* kp_s = reinterpret_cast<int32_t*>(smem + L::kK + L::kV + L::kQ + L::kS + L::kP + L::kO);

  constexpr int kQB = kTileRows / G;  // queries per block
  const int64_t q0 = int64_t(blockIdx.x) * kQB;
  const int64_t h0 = int64_t(blockIdx.y) * G;
  const int64_t kvh = h0 / (a.n_head / a.n_head_kv);
  const int64_t kv_w = a.n_head_kv * HD;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;

  // Q rows as f16, the accumulator zeroed; the block's query position range.
  int32_t qmax = INT_MIN, qmin = INT_MAX;
  for (int i = tid; i < kTileRows * HD; i += 128) {
    const int r = i / HD, d = i % HD;
    const int64_t qi = q0 + r / G;
    float x = 0.0f;
    if (qi < a.n_q) x = a.q[(qi * a.n_head + h0 + r % G) * HD + d];
    q_s[r * L::kLd + d] = __float2half_rn(x);
    o_s[r * L::kLdO + d] = 0.0f;
  }
  if (tid < kQB && q0 + tid < a.n_q) qmax = qmin = a.q_pos[q0 + tid];
  __shared__ int32_t red[2][4];
  for (int o = 16; o > 0; o >>= 1) {
    qmax = max(qmax, __shfl_xor_sync(0xffffffffu, qmax, o));
    qmin = min(qmin, __shfl_xor_sync(0xffffffffu, qmin, o));
  }
  if (lane == 0) red[0][warp] = qmax, red[1][warp] = qmin;
  __syncthreads();
  qmax = max(max(red[0][0], red[0][1]), max(red[0][2], red[0][3]));
  qmin = min(min(red[1][0], red[1][1]), min(red[1][2], red[1][3]));

  // This lane's softmax row (two lanes per row, 32 keys of the tile each).
  const int srow = lane / 2, shalf = lane % 2;
  const int r_blk = warp * 16 + srow;
  const int64_t my_q = q0 + r_blk / G;
  const int32_t my_qp = my_q < a.n_q ? a.q_pos[my_q] : INT_MIN;
  float m = -INFINITY, l = 0.0f;

  __half* q_w = q_s + warp * 16 * L::kLd;
  float* s_w = s_s + warp * 16 * L::kLdS;
  __half* p_w = p_s + warp * 16 * L::kLdP;
  float* o_w = o_s + warp * 16 * L::kLdO;

  for (int64_t j0 = 0; j0 < a.n_kv; j0 += kKT) {
    // Skip a tile none of the block's queries sees (keys after the last query, or all before
    // the first query's window).
    bool maybe = false;
    if (tid < kKT) {
      const int64_t j = j0 + tid;
      int32_t kp = INT_MAX;
      if (j < a.n_kv) kp = a.kv_pos[j];
      kp_s[tid] = kp;
      maybe = j < a.n_kv && kp <= qmax && !(a.window > 0 && int64_t(qmin) - kp >= a.window);
    }
    if (!__syncthreads_or(maybe)) continue;
    // K and V rows of the tile: 16-byte loads (HD halves = HD / 8 vectors per row).
    constexpr int kVec = HD / 8;
    for (int i = tid; i < kKT * kVec; i += 128) {
      const int r = i / kVec, c = i % kVec;
      const int64_t j = min(j0 + r, a.n_kv - 1);  // past the end: loaded, masked
      const int64_t base = int64_t(a.kv_rows[j]) * kv_w + kvh * HD + c * 8;
      *reinterpret_cast<uint4*>(k_s + r * L::kLd + c * 8) =
          *reinterpret_cast<const uint4*>(a.k + base);
      *reinterpret_cast<uint4*>(v_s + r * L::kLd + c * 8) =
          *reinterpret_cast<const uint4*>(a.v + base);
    }
    __syncthreads();

    // S = Q K^T for this warp's 16 rows and the tile's keys.
#pragma unroll
    for (int n = 0; n < kKT / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int k = 0; k < HD / 16; ++k) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, q_w + k * 16, L::kLd);
        wmma::load_matrix_sync(fb, k_s + n * 16 * L::kLd + k * 16, L::kLd);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(s_w + n * 16, acc, L::kLdS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax of the row's 64 new scores (each lane 32 of them, in key order).
    float mt = -INFINITY;
    float* srow_p = s_w + srow * L::kLdS + shalf * 32;
    for (int c = 0; c < 32; ++c) {
      const int32_t kp = kp_s[shalf * 32 + c];
      const bool vis = kp <= my_qp && !(a.window > 0 && int64_t(my_qp) - kp >= a.window);
      float logit = -INFINITY;
      if (vis) {
        logit = srow_p[c] * a.scale;
        if (a.softcap > 0) logit = a.softcap * tanhf(logit / a.softcap);
      }
      srow_p[c] = logit;
      mt = fmaxf(mt, logit);
    }
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
    const float m_new = fmaxf(m, mt);
    const float corr = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    float sum = 0.0f;
    __half* prow = p_w + srow * L::kLdP + shalf * 32;
    for (int c = 0; c < 32; ++c) {
      const float p = m_new == -INFINITY ? 0.0f : expf(srow_p[c] - m_new);
      sum += p;
      prow[c] = __float2half_rn(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * corr + sum;
    m = m_new;
    float* orow = o_w + srow * L::kLdO + shalf * (HD / 2);
    for (int d = 0; d < HD / 2; ++d) orow[d] *= corr;
    __syncwarp();

    // O += P V.
#pragma unroll
    for (int n = 0; n < HD / 16; ++n) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, o_w + n * 16, L::kLdO, wmma::mem_row_major);
#pragma unroll
      for (int k = 0; k < kKT / 16; ++k) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, p_w + k * 16, L::kLdP);
        wmma::load_matrix_sync(fb, v_s + k * 16 * L::kLd + n * 16, L::kLd);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(o_w + n * 16, acc, L::kLdO, wmma::mem_row_major);
    }
    __syncthreads();  // k_s / v_s / kp_s are rewritten by the next tile
  }

  // Normalise; a row with no visible key gives zeros (as the split kernel and the reference).
  __syncwarp();
  if (my_q < a.n_q) {
    const float c = l > 0.0f ? fold_sink(a.sinks, h0 + r_blk % G, m, l) : 1.0f;
    const float inv = l > 0.0f ? c / l : 0.0f;
    const float* orow = o_w + srow * L::kLdO + shalf * (HD / 2);
    float* out = a.out + (my_q * a.n_head + h0 + r_blk % G) * HD + shalf * (HD / 2);
    for (int d = 0; d < HD / 2; ++d) out[d] = l > 0.0f ? orow[d] * inv : 0.0f;
  }
}

bool tile_path(const DeviceAttention& a) {
  const int g = group_of(a);
  return a.n_q >= kTileMinQueries && (a.head_dim == 64 || a.head_dim == 128) && g <= 16 &&
         kTileRows % g == 0 && reinterpret_cast<uintptr_t>(a.k) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.v) % 16 == 0;
}

template <int HD, int G>
cudaError_t launch_tile(const DeviceAttention& a, cudaStream_t s) {
  constexpr size_t bytes = TileSmem<HD>::kBytes;
  // Above 48 KiB of dynamic shared memory a kernel must opt in, once per process.
  static const cudaError_t opt_in = cudaFuncSetAttribute(
      attention_tile_kernel<HD, G>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (opt_in != cudaSuccess) return opt_in;
  constexpr int64_t qb = kTileRows / G;
  const dim3 grid(unsigned((a.n_q + qb - 1) / qb), unsigned(a.n_head / G));
  attention_tile_kernel<HD, G><<<grid, 128, bytes, s>>>(a);
  return cudaGetLastError();
}

template <int HD>
cudaError_t launch_tile_hd(const DeviceAttention& a, cudaStream_t s) {
  switch (group_of(a)) {
    case 8:
      return launch_tile<HD, 8>(a, s);
    case 4:
      return launch_tile<HD, 4>(a, s);
    case 2:
      return launch_tile<HD, 2>(a, s);
    default:
      return launch_tile<HD, 1>(a, s);
  }
}

// f(one-sequence kernel, batched kernel) of the instantiation for group g and this head size:
// KB 2 for 8 heads (registers), P the head's f16 pairs per lane (3 served by 4: the pairs past
// the head are skipped either way).
template <int G, int KB, typename F>
cudaError_t with_split_kernel_p(int64_t hd, F&& f) {
  if (hd <= 64) return f(attention_split_kernel<G, KB, 1>, attention_split_batch_kernel<G, KB, 1>);
  if (hd <= 128) return f(attention_split_kernel<G, KB, 2>, attention_split_batch_kernel<G, KB, 2>);
  return f(attention_split_kernel<G, KB, 4>, attention_split_batch_kernel<G, KB, 4>);
}
template <typename F>
cudaError_t with_split_kernel(int g, int64_t hd, F&& f) {
  switch (g) {
    case 8:
      return with_split_kernel_p<8, 2>(hd, f);
    case 4:
      return with_split_kernel_p<4, 4>(hd, f);
    case 2:
      return with_split_kernel_p<2, 4>(hd, f);
    default:
      return with_split_kernel_p<1, 4>(hd, f);
  }
}

// f(one-sequence kernel, batched kernel) of the warp-tile instantiation for group g and this
// head size (HD the smallest of 64, 128, 256 holding it).
template <int G, typename F>
cudaError_t with_wt_kernel_hd(int64_t hd, F&& f) {
  if (hd <= 64) return f(attention_wt_kernel<G, 64>, attention_wt_batch_kernel<G, 64>);
  if (hd <= 128) return f(attention_wt_kernel<G, 128>, attention_wt_batch_kernel<G, 128>);
  return f(attention_wt_kernel<G, 256>, attention_wt_batch_kernel<G, 256>);
}
// The wide kernel's instantiation for group g (at most kWideMaxGroup: group_of).
template <typename F>
cudaError_t with_wide_kernel(int g, F&& f) {
  switch (g) {
    case 4:
      return f(attention_wide_kernel<4>, attention_wide_batch_kernel<4>);
    case 2:
      return f(attention_wide_kernel<2>, attention_wide_batch_kernel<2>);
    default:
      return f(attention_wide_kernel<1>, attention_wide_batch_kernel<1>);
  }
}
// Heads wider than kMaxHeadDim: the wide kernel, the warp-tile kernel of their width.
template <typename F>
cudaError_t with_wt_kernel(int g, int64_t hd, F&& f) {
  if (hd > kMaxHeadDim) return with_wide_kernel(g, f);
  switch (g) {
    case 8:
      return with_wt_kernel_hd<8>(hd, f);
    case 4:
      return with_wt_kernel_hd<4>(hd, f);
    case 2:
      return with_wt_kernel_hd<2>(hd, f);
    default:
      return with_wt_kernel_hd<1>(hd, f);
  }
}

}  // namespace

bool attention_uses_tiles(const DeviceAttention& a) { return tile_path(a); }

// The warp-tile kernel's 16-byte K loads: head size a multiple of 8, planes 16-byte aligned
// (the wide kernel's too, up to its rows).
bool attention_warp_tiles_fit(int64_t head_dim, const void* k, const void* v) {
  return head_dim > 0 && head_dim <= kWideHeadDim && head_dim % 8 == 0 &&
         reinterpret_cast<uintptr_t>(k) % 16 == 0 && reinterpret_cast<uintptr_t>(v) % 16 == 0;
}

int64_t plan_attention_batch(std::span<AttentionBatchItem> items, int n_sm) {
  int64_t blocks = 0, merges = 0;
  for (AttentionBatchItem& it : items) {
    const Split sp = plan_split(it.a, n_sm);  // what launch_attention would choose alone
    it.n_split = sp.n_split;
    it.keys_per_split = sp.keys_per_split;
    it.block0 = blocks;
    it.merge0 = merges;
    blocks += it.a.n_q * (it.a.n_head / group_of(it.a)) * sp.n_split;
    merges += it.a.n_q * it.a.n_head;
  }
  return blocks;
}

cudaError_t launch_attention_batch(const AttentionBatchItem* items,
                                   std::span<const AttentionBatchItem> host_items, cudaStream_t s) {
  if (host_items.empty()) return cudaSuccess;
  const DeviceAttention& a0 = host_items.front().a;
  const int g = group_of(a0);
  int64_t blocks = 0, merges = 0;
  bool merge_needed = false;
  for (const AttentionBatchItem& it : host_items) {
    const DeviceAttention& a = it.a;
    // One kernel instantiation serves every item: same heads, group and head size; each on
    // the split path (launch_attention's choice for it alone).
    if (a.n_head != a0.n_head || a.n_head_kv != a0.n_head_kv || a.head_dim != a0.head_dim ||
        a.head_dim <= 0 || a.head_dim > kWideHeadDim || a.head_dim % 2 != 0 ||
        (a.head_dim > kMaxHeadDim && !a.warp_tiles) || a.n_head % a.n_head_kv != 0 || a.n_q <= 0 ||
        a.n_kv <= 0 || tile_path(a) || a.warp_tiles != a0.warp_tiles ||
        (a.warp_tiles && !attention_warp_tiles_fit(a.head_dim, a.k, a.v)) || it.block0 != blocks ||
        it.merge0 != merges)
      return cudaErrorInvalidValue;
    blocks += a.n_q * (a.n_head / g) * it.n_split;
    merges += a.n_q * a.n_head;
    merge_needed = merge_needed || !a.warp_tiles || it.n_split > 1;
  }
  const int n = int(host_items.size());
  const cudaError_t e =
      a0.warp_tiles
          ? with_wt_kernel(g, a0.head_dim,
                           [&](auto, auto batch) {
                             return launch(batch, unsigned(blocks), kWarps * 32, 0, s, items, n);
                           })
          : with_split_kernel(g, a0.head_dim, [&](auto, auto batch) {
              return launch(batch, unsigned(blocks), kWarps * 32, 0, s, items, n);
            });
  if (e != cudaSuccess || !merge_needed) return e;
  return launch(attention_merge_batch_kernel, unsigned(merges), 128, 0, s, items, n);
}

size_t attention_scratch_floats(const DeviceAttention& a, int n_sm) {
  const Split sp = plan_split(a, n_sm);
  return size_t(a.n_q * a.n_head * sp.n_split * (a.head_dim + 2));
}

cudaError_t launch_attention(const DeviceAttention& a, float* scratch, int n_sm, cudaStream_t s) {
  // Wide heads have only the wide kernel, planned as warp tiles (kernels.h warp_tiles).
  if (a.head_dim <= 0 || a.head_dim > kWideHeadDim || a.n_head_kv <= 0 ||
      a.n_head % a.n_head_kv != 0 || (a.head_dim > kMaxHeadDim && !a.warp_tiles))
    return cudaErrorInvalidValue;
  if (a.n_q == 0) return cudaSuccess;
  if (a.head_dim % 2 != 0) return cudaErrorInvalidValue;  // half2 loads
  if (a.n_kv > 0 && tile_path(a))
    return a.head_dim == 64 ? launch_tile_hd<64>(a, s) : launch_tile_hd<128>(a, s);
  const Split sp = plan_split(a, n_sm);
  const int g = group_of(a);
  const dim3 grid(unsigned(a.n_q * (a.n_head / g)), unsigned(sp.n_split));
  const int64_t kps = sp.keys_per_split;
  if (a.warp_tiles) {
    if (!attention_warp_tiles_fit(a.head_dim, a.k, a.v)) return cudaErrorInvalidValue;
    const cudaError_t e = with_wt_kernel(g, a.head_dim, [&](auto one, auto) {
      return launch(one, grid, kWarps * 32, 0, s, a, kps, scratch);
    });
    if (e != cudaSuccess || sp.n_split == 1) return e;
  } else {
    const cudaError_t e = with_split_kernel(g, a.head_dim, [&](auto one, auto) {
      return launch(one, grid, kWarps * 32, 0, s, a, kps, scratch);
    });
    if (e != cudaSuccess) return e;
  }
  return launch(attention_merge_kernel, unsigned(a.n_q * a.n_head), 128, 0, s,
                static_cast<const float*>(scratch), sp.n_split, a.head_dim, a.out, a.sinks,
                a.n_head);
}

}  // namespace kiln::cuda
