// backend/cpu/cpu_attention.cpp: causal attention over f16 KV planes, one (query, head) pair
// per call, blocked over keys with an online softmax (running max and sum rescaled per
// block), so decode (one query) and prefill (many) share one kernel and no n_kv-sized buffer.
// Heads narrower than a vector (tiny models) also take a grouped kernel that runs up to a
// vector of (query, head) pairs of one KV head in its lanes, each lane doing the per-pair
// kernel's arithmetic in the same order, so its bits are the per-pair kernel's.
// Heads a whole number of vectors wide take the multi-pair kernel: up to four (query, head)
// pairs of one KV head share each K and V row's load and f16 conversion, every pair doing the
// per-pair kernel's float ops in its order (attention sinks' finish included), with its
// accumulator held in registers.
#define HWY_WANT_AVX3_DL 1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_attention.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "kernels.h"

#ifndef KILN_CPU_ATTENTION_ONCE
#define KILN_CPU_ATTENTION_ONCE
namespace kiln::cpu {
inline constexpr int64_t kKeyBlock = 64;
// Most lanes (pairs) the grouped kernel's scratch is sized for: 16 floats of AVX-512.
inline constexpr int64_t kGroupMaxLanes = 16;
// Most pairs of one multi-pair task; their scratch is a logit block each (plus padding).
inline constexpr int64_t kMultiMaxPairs = 4;
// Keys per SumOfLanes16 run (the multi-pair kernel's fully visible blocks, 512-bit targets).
inline constexpr int64_t kTreeKeys = 16;
}  // namespace kiln::cpu
#endif

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

// a * b + c as the target's MulAdd computes it on one lane (fused where the target has FMA).
// The scalar tails below use it rather than `s += a * b`: whether the compiler contracts that
// into an FMA depends on the optimisation level (GCC does at -O2, not at the sanitizer
// presets' -O1), and the grouped kernel's lanes must reproduce these bits in every build.
HWY_INLINE float MulAddLane(float a, float b, float c) {
  const hn::CappedTag<float, 1> d1;
  return hn::GetLane(hn::MulAdd(hn::Set(d1, a), hn::Set(d1, b), hn::Set(d1, c)));
}

HWY_INLINE float DotQK(const float* q, const f16* k, int64_t n) {
  const DF d;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto* kh = reinterpret_cast<const hwy::float16_t*>(k);
  auto a0 = hn::Zero(d), a1 = hn::Zero(d);
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    a0 = hn::MulAdd(hn::LoadU(d, q + i), hn::PromoteTo(d, hn::LoadU(dh, kh + i)), a0);
    a1 = hn::MulAdd(hn::LoadU(d, q + i + N), hn::PromoteTo(d, hn::LoadU(dh, kh + i + N)), a1);
  }
  for (; i + N <= n; i += N)
    a0 = hn::MulAdd(hn::LoadU(d, q + i), hn::PromoteTo(d, hn::LoadU(dh, kh + i)), a0);
  float s = hn::GetLane(hn::SumOfLanes(d, hn::Add(a0, a1)));
  for (; i < n; ++i) s = MulAddLane(q[i], f16_to_f32(k[i]), s);
  return s;
}

// acc = acc * c + p * v
HWY_INLINE void ScaleAcc(float* acc, int64_t n, float c) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::Mul(hn::LoadU(d, acc + i), hn::Set(d, c)), d, acc + i);
  for (; i < n; ++i) acc[i] *= c;
}
HWY_INLINE void AxpyF16(float* acc, const f16* v, int64_t n, float p) {
  const DF d;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const auto* vh = reinterpret_cast<const hwy::float16_t*>(v);
  const auto pv = hn::Set(d, p);
  int64_t i = 0;
  for (; i + N <= n; i += N)
    hn::StoreU(hn::MulAdd(pv, hn::PromoteTo(d, hn::LoadU(dh, vh + i)), hn::LoadU(d, acc + i)), d,
               acc + i);
  for (; i < n; ++i) acc[i] = MulAddLane(p, f16_to_f32(v[i]), acc[i]);
}

void AttentionOneK(const AttentionArgs& a, int64_t qi, int64_t h, float* scratch) {
  const int64_t hd = a.head_dim, q_w = a.n_head * hd, kv_w = a.n_head_kv * hd;
  const int64_t n_kv = static_cast<int64_t>(a.kv_rows.size());
  const int64_t kvh = h / (a.n_head / a.n_head_kv);
  const int64_t n_phys = static_cast<int64_t>(a.k.size()) / kv_w;
  const float* q = a.q.data() + qi * q_w + h * hd;
  float* out = a.out.data() + qi * q_w + h * hd;
  float* acc = scratch;         // [hd]
  float* logit = scratch + hd;  // [kKeyBlock]
  // [kKeyBlock]; the logits get a vector of padding first (the exp loop writes whole vectors)
  int32_t* idx = reinterpret_cast<int32_t*>(logit + kKeyBlock + 64);
  std::fill(acc, acc + hd, 0.0f);
  const int32_t qp = a.q_pos[qi];
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  float m = -INFINITY, l = 0;
  for (int64_t j0 = 0; j0 < n_kv; j0 += kKeyBlock) {
    const int64_t j1 = std::min(n_kv, j0 + kKeyBlock);
    int64_t cnt = 0;
    float bm = -INFINITY;
    for (int64_t j = j0; j < j1; ++j) {
      const int32_t kp = a.kv_pos[j];
      if (kp > qp || (a.window > 0 && qp - kp >= a.window)) continue;
      const int32_t pr = a.kv_rows[j];
      KILN_CHECK(pr >= 0 && pr < n_phys, "kv row {} of {}", pr, n_phys);
      float s = DotQK(q, a.k.data() + pr * kv_w + kvh * hd, hd) * a.scale;
      if (a.softcap > 0) s = a.softcap * std::tanh(s / a.softcap);
      logit[cnt] = s;
      idx[cnt++] = pr;
      bm = std::max(bm, s);
    }
    if (cnt == 0) continue;
    const float m_new = std::max(m, bm);
    if (m != -INFINITY && m_new != m) {
      const float c = std::exp(m - m_new);
      l *= c;
      ScaleAcc(acc, hd, c);
    }
    m = m_new;
    // exp of the block's logits in vectors; entries past cnt are padding and never used.
    const auto vm = hn::Set(d, m);
    for (int64_t j = 0; j < cnt; j += N) {
      const auto x = hn::Max(hn::Sub(hn::LoadU(d, logit + j), vm), hn::Set(d, -87.0f));
      hn::StoreU(hn::Exp(d, x), d, logit + j);
    }
    for (int64_t j = 0; j < cnt; ++j) {
      l += logit[j];
      AxpyF16(acc, a.v.data() + idx[j] * kv_w + kvh * hd, hd, logit[j]);
    }
  }
  if (l == 0) {
    std::fill(out, out + hd, 0.0f);
    return;
  }
  // The sink joins the softmax as one more logit without a value row, as llama.cpp's
  // flash-attention finish does: rescale to the larger max, add its exp to the sum.
  if (!a.sinks.empty()) {
    const float sink = a.sinks[static_cast<size_t>(h)];
    if (sink > m) {
      const float c = std::exp(m - sink);
      ScaleAcc(acc, hd, c);
      l = l * c + 1.0f;
    } else {
      l += std::exp(sink - m);
    }
  }
  const float inv = 1.0f / l;
  for (int64_t i = 0; i < hd; ++i) out[i] = acc[i] * inv;
}

// n halves to floats (exact either way: vcvtph2ps in groups of up to 8, f16_to_f32 after).
HWY_INLINE void HalfRowToF32(const f16* src, float* dst, int64_t n) {
  const hn::CappedTag<float, 8> d8;
  const hn::Rebind<hwy::float16_t, decltype(d8)> dh8;
  const int64_t N8 = static_cast<int64_t>(hn::Lanes(d8));
  const auto* h = reinterpret_cast<const hwy::float16_t*>(src);
  int64_t i = 0;
  for (; i + N8 <= n; i += N8) hn::StoreU(hn::PromoteTo(d8, hn::LoadU(dh8, h + i)), d8, dst + i);
  for (; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

// Tokens per grouped task (pairs = tokens x the n_head / n_head_kv heads sharing a KV head),
// or 0 where the grouped kernel cannot give the per-pair kernel's bits: it needs head_dim
// below the vector width, where DotQK and AxpyF16 are their scalar loops (one MulAddLane per
// element in order, the grouped kernel's MulAdd on one lane; tests/ops pins the bits).
int64_t AttentionGroupTokensK(int64_t head_dim, int64_t group) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  if (N > kGroupMaxLanes || head_dim >= N || group < 1 || group > N) return 0;
  return N / group;
}

// The queries [q0, q1) of every head of KV head kvh, one (query, head) pair per lane (lane
// p = (token - q0) * group + head offset). Per lane, the steps of AttentionOneK: the same key
// blocks, the dot as s = fma(q[i], k[i], s) from 0 over i, the same block max, rescale by
// std::exp when the max grows, vector Exp, sum and V accumulation in key order over the
// lane's visible keys; lanes that do not see a key keep their state (IfThenElse), so no lane
// depends on another. What the lanes share is each key's load and f16 conversion and the loop.
void AttentionGroupK(const AttentionArgs& a, int64_t kvh, int64_t q0, int64_t q1, float* scratch) {
  const DF d;
  const hn::RebindToSigned<DF> di;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t hd = a.head_dim, group = a.n_head / a.n_head_kv;
  const int64_t q_w = a.n_head * hd, kv_w = a.n_head_kv * hd;
  const int64_t n_kv = static_cast<int64_t>(a.kv_rows.size());
  const int64_t n_phys = static_cast<int64_t>(a.k.size()) / kv_w;
  const int64_t P = (q1 - q0) * group;
  KILN_CHECK(P >= 1 && P <= N && hd < N, "grouped attention: {} pairs, head_dim {}, {} lanes", P,
             hd, N);
  float* qt = scratch;                // [hd][N]: lane p's query, transposed
  float* acc = qt + hd * N;           // [hd][N]: lane p's output accumulator, transposed
  float* logit = acc + hd * N;        // [kKeyBlock][N]
  float* kf = logit + kKeyBlock * N;  // [hd]: the current key row in f32
  float* vf = kf + hd;                // [kKeyBlock][hd]: the block's V rows in f32
  auto* qpos = reinterpret_cast<int32_t*>(vf + kKeyBlock * hd);  // [N]
  for (int64_t p = 0; p < N; ++p) {
    const int64_t qi = q0 + p / group, h = kvh * group + p % group;
    qpos[p] = p < P ? a.q_pos[qi] : 0;
    for (int64_t i = 0; i < hd; ++i) {
      qt[i * N + p] = p < P ? a.q[qi * q_w + h * hd + i] : 0.0f;
      acc[i * N + p] = 0.0f;
    }
  }
  const auto valid = hn::RebindMask(d, hn::FirstN(di, static_cast<size_t>(P)));
  const auto vqp = hn::LoadU(di, qpos);
  const auto vwin = hn::Set(di, a.window);
  // Lanes that see the key at position kp.
  auto visible = [&](int32_t kp) {
    auto m = hn::RebindMask(d, hn::Not(hn::Set(di, kp) > vqp));  // kp <= q_pos
    if (a.window > 0) m = hn::And(m, hn::RebindMask(d, vwin > hn::Sub(vqp, hn::Set(di, kp))));
    return hn::And(m, valid);
  };
  const auto neg_inf = hn::Set(d, -INFINITY), vscale = hn::Set(d, a.scale);
  auto m = neg_inf, l = hn::Zero(d);
  alignas(64) float lane[kGroupMaxLanes], lane2[kGroupMaxLanes];
  for (int64_t j0 = 0; j0 < n_kv; j0 += kKeyBlock) {
    const int64_t j1 = std::min(n_kv, j0 + kKeyBlock);
    auto bm = neg_inf;
    auto seen = hn::RebindMask(d, hn::FirstN(di, 0));  // lanes with a visible key here
    for (int64_t j = j0; j < j1; ++j) {
      const auto vis = visible(a.kv_pos[j]);
      if (hn::AllFalse(d, vis)) continue;
      const int32_t pr = a.kv_rows[j];
      KILN_CHECK(pr >= 0 && pr < n_phys, "kv row {} of {}", pr, n_phys);
      const f16* kr = a.k.data() + pr * kv_w + kvh * hd;
      const f16* vr = a.v.data() + pr * kv_w + kvh * hd;
      float* vj = vf + (j - j0) * hd;
      HalfRowToF32(kr, kf, hd);
      HalfRowToF32(vr, vj, hd);
      auto s = hn::Zero(d);
      for (int64_t i = 0; i < hd; ++i)
        s = hn::MulAdd(hn::LoadU(d, qt + i * N), hn::Set(d, kf[i]), s);
      s = hn::Mul(s, vscale);
      if (a.softcap > 0) {
        hn::Store(s, d, lane);
        for (int64_t p = 0; p < P; ++p) lane[p] = a.softcap * std::tanh(lane[p] / a.softcap);
        s = hn::Load(d, lane);
      }
      hn::StoreU(s, d, logit + (j - j0) * N);
      bm = hn::IfThenElse(vis, hn::Max(bm, s), bm);
      seen = hn::Or(seen, vis);
    }
    if (hn::AllFalse(d, seen)) continue;
    const auto m_new = hn::IfThenElse(seen, hn::Max(m, bm), m);
    // Rescale where a lane's max grew from a finite one (per lane, std::exp as AttentionOneK).
    const auto grew = hn::AndNot(hn::Eq(m, neg_inf), hn::And(seen, hn::Ne(m_new, m)));
    if (!hn::AllFalse(d, grew)) {
      hn::Store(m, d, lane);
      hn::Store(m_new, d, lane2);
      for (int64_t p = 0; p < N; ++p)
        lane[p] = p < P && lane[p] != -INFINITY && lane2[p] != lane[p]
                      ? std::exp(lane[p] - lane2[p])
                      : 1.0f;
      const auto c = hn::Load(d, lane);
      l = hn::IfThenElse(grew, hn::Mul(l, c), l);
      for (int64_t i = 0; i < hd; ++i)
        hn::StoreU(
            hn::IfThenElse(grew, hn::Mul(hn::LoadU(d, acc + i * N), c), hn::LoadU(d, acc + i * N)),
            d, acc + i * N);
    }
    m = m_new;
    const auto floor = hn::Set(d, -87.0f);
    for (int64_t j = j0; j < j1; ++j) {
      const auto vis = visible(a.kv_pos[j]);
      if (hn::AllFalse(d, vis)) continue;
      const auto e = hn::Exp(d, hn::Max(hn::Sub(hn::LoadU(d, logit + (j - j0) * N), m), floor));
      l = hn::IfThenElse(vis, hn::Add(l, e), l);
      const float* vj = vf + (j - j0) * hd;
      for (int64_t i = 0; i < hd; ++i) {
        const auto ai = hn::LoadU(d, acc + i * N);
        hn::StoreU(hn::IfThenElse(vis, hn::MulAdd(e, hn::Set(d, vj[i]), ai), ai), d, acc + i * N);
      }
    }
  }
  // A lane with no visible key has l == 0 and writes zeros, as AttentionOneK.
  const auto none = hn::Eq(l, hn::Zero(d));
  const auto inv = hn::Div(hn::Set(d, 1.0f), hn::IfThenElse(none, hn::Set(d, 1.0f), l));
  for (int64_t i = 0; i < hd; ++i) {
    hn::Store(hn::IfThenZeroElse(none, hn::Mul(hn::LoadU(d, acc + i * N), inv)), d, lane);
    for (int64_t p = 0; p < P; ++p)
      a.out[(q0 + p / group) * q_w + (kvh * group + p % group) * hd + i] = lane[p];
  }
}

#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3 && HWY_COMPILER_GCC_ACTUAL
// Lane t: the sum of s[t]'s 16 lanes, added in the tree of GCC's _mm512_reduce_add_ps (what
// SumOfLanes is on these targets): halves 8 apart, then 4, then 2, then neighbours. Each level
// pairs two keys' halves in one vector, so 16 keys take 15 adds instead of 16 x 4. Other
// compilers' reduce trees are not this one, hence the GCC guard.
HWY_INLINE hn::Vec<DF> SumOfLanes16(const hn::Vec<DF>* s) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 lo = _mm512_shuffle_f32x4(s[2 * i].raw, s[2 * i + 1].raw, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 hi = _mm512_shuffle_f32x4(s[2 * i].raw, s[2 * i + 1].raw, _MM_SHUFFLE(3, 2, 3, 2));
    t[i] = _mm512_add_ps(hi, lo);  // blocks: y(2i) lanes 0-3, 4-7, then y(2i+1)'s
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 lo = _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 hi = _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1));
    u[i] = _mm512_add_ps(hi, lo);  // block b: z (4 lanes) of key 4i + b
  }
  for (int i = 0; i < 2; ++i) {
    const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
    const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    w[i] = _mm512_add_ps(lo, hi);  // block b: z0+z2, z1+z3 of key 8i + b, then of 8i + 4 + b
  }
  const __m512 even = _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 odd = _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1));
  const __m512 r = _mm512_add_ps(even, odd);  // lane 4b + c: key 4c + b
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return hn::Vec<DF>{_mm512_permutexvar_ps(idx, r)};
}
#endif

// NP (query, head) pairs of KV head kvh: entries e0 .. e0 + n - 1 of the KV head's pairs in
// (query, head) order, the last repeated where n < NP (computed, not stored). Per pair, the
// steps of AttentionOneK in its order: the same key blocks, DotQK's two accumulators (chunk
// pairs into a0 and a1, an odd last chunk into a0) and SumOfLanes, the block max, std::exp
// rescale when the max grows, vector Exp over the pair's visible logits, then sum and V
// accumulation in key order. Only the K / V loads and conversions are shared; the output
// accumulators are element-wise, so keeping them in registers across keys changes no bit.
template <size_t C, size_t NP>
HWY_INLINE void AttentionMultiT(const AttentionArgs& a, int64_t kvh, int64_t e0, int64_t n,
                                float* scratch) {
  using V = hn::Vec<DF>;
  const DF d;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  const int64_t hd = a.head_dim, g = a.n_head / a.n_head_kv;
  const int64_t q_w = a.n_head * hd, kv_w = a.n_head_kv * hd;
  const int64_t n_kv = static_cast<int64_t>(a.kv_rows.size());
  const int64_t n_phys = static_cast<int64_t>(a.k.size()) / kv_w;
  KILN_CHECK(hd == static_cast<int64_t>(C) * N && n >= 1 && n <= static_cast<int64_t>(NP));
  V q[NP][C], acc[NP][C];
  float* out[NP];
  float* logit[NP];
  int64_t head[NP];
  int32_t pos[NP];
  float m[NP], l[NP];
  for (size_t p = 0; p < NP; ++p) {
    const int64_t e = e0 + std::min<int64_t>(static_cast<int64_t>(p), n - 1);
    const int64_t qi = e / g, h = kvh * g + e % g;
    for (size_t c = 0; c < C; ++c) {
      q[p][c] = hn::LoadU(d, a.q.data() + qi * q_w + h * hd + c * N);
      acc[p][c] = hn::Zero(d);
    }
    out[p] = a.out.data() + qi * q_w + h * hd;
    head[p] = h;
    logit[p] = scratch + p * (kKeyBlock + 64);
    pos[p] = a.q_pos[qi];
    m[p] = -INFINITY;
    l[p] = 0;
  }
  // Locals, not a.*: the logit stores could alias them, so the compiler would reload them.
  const float scale = a.scale, softcap = a.softcap;
  const int32_t window = a.window;
  const uint32_t all = (1u << NP) - 1;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3 && HWY_COMPILER_GCC_ACTUAL
  float* kf = scratch + NP * (kKeyBlock + 64);  // [kTreeKeys][hd]: a run of key rows in f32
#endif
  const hn::RebindToSigned<DF> di;
  int32_t vis[kKeyBlock];  // bit p: pair p sees the block's key
  for (int64_t j0 = 0; j0 < n_kv; j0 += kKeyBlock) {
    const int64_t j1 = std::min(n_kv, j0 + kKeyBlock);
    int64_t cnt[NP];
    float bm[NP];
    for (size_t p = 0; p < NP; ++p) cnt[p] = 0, bm[p] = -INFINITY;
    // Visibility a vector of keys at a time: under the causal mask about half of a prefill's
    // blocks are seen by no pair and cost only this.
    auto v_or = hn::Zero(di), v_and = hn::Set(di, static_cast<int32_t>(all));
    int64_t jv = j0;
    for (; jv + N <= j1; jv += N) {
      const auto kp = hn::LoadU(di, a.kv_pos.data() + jv);
      auto m = hn::Zero(di);
      for (size_t p = 0; p < NP; ++p) {
        const auto vp = hn::Set(di, pos[p]);
        auto seen = hn::Not(kp > vp);
        if (window > 0) seen = hn::And(seen, hn::Set(di, window) > hn::Sub(vp, kp));
        m = hn::Or(m, hn::IfThenElseZero(seen, hn::Set(di, static_cast<int32_t>(1u << p))));
      }
      hn::StoreU(m, di, vis + (jv - j0));
      v_or = hn::Or(v_or, m);
      v_and = hn::And(v_and, m);
    }
    uint32_t any = hn::AllTrue(di, hn::Eq(v_or, hn::Zero(di))) ? 0 : 1;
    uint32_t every =
        hn::AllTrue(di, hn::Eq(v_and, hn::Set(di, static_cast<int32_t>(all)))) ? all : 0;
    for (; jv < j1; ++jv) {
      const int32_t kp = a.kv_pos[jv];
      uint32_t mask = 0;
      for (size_t p = 0; p < NP; ++p)
        if (!(kp > pos[p] || (window > 0 && pos[p] - kp >= window))) mask |= 1u << p;
      vis[jv - j0] = static_cast<int32_t>(mask);
      any |= mask;
      every &= mask;
    }
    if (any == 0) continue;
    int64_t j = j0;
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3 && HWY_COMPILER_GCC_ACTUAL
    // Every pair sees the whole block (causal prefill below the diagonal): runs of 16 keys
    // converted once, each pair's 16 dots reduced together by SumOfLanes16 (SumOfLanes's tree).
    if (every == all) {
      for (; j + kTreeKeys <= j1; j += kTreeKeys) {
        for (int64_t t = 0; t < kTreeKeys; ++t) {
          const int32_t pr = a.kv_rows[j + t];
          KILN_CHECK(pr >= 0 && pr < n_phys, "kv row {} of {}", pr, n_phys);
          const auto* kh =
              reinterpret_cast<const hwy::float16_t*>(a.k.data() + pr * kv_w + kvh * hd);
          for (size_t c = 0; c < C; ++c)
            hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, kh + c * N)), d, kf + t * hd + c * N);
        }
        for (size_t p = 0; p < NP; ++p) {
          V sum[kTreeKeys];
          for (int64_t t = 0; t < kTreeKeys; ++t) {
            const float* kt = kf + t * hd;
            V a0 = hn::Zero(d), a1 = hn::Zero(d);
            size_t c = 0;
            for (; c + 2 <= C; c += 2) {
              a0 = hn::MulAdd(q[p][c], hn::LoadU(d, kt + c * N), a0);
              a1 = hn::MulAdd(q[p][c + 1], hn::LoadU(d, kt + (c + 1) * N), a1);
            }
            if (c < C) a0 = hn::MulAdd(q[p][c], hn::LoadU(d, kt + c * N), a0);
            sum[t] = hn::Add(a0, a1);
          }
          float* lg = logit[p] + cnt[p];
          hn::StoreU(hn::Mul(SumOfLanes16(sum), hn::Set(d, scale)), d, lg);
          if (softcap > 0)
            for (int64_t t = 0; t < kTreeKeys; ++t) lg[t] = softcap * std::tanh(lg[t] / softcap);
          for (int64_t t = 0; t < kTreeKeys; ++t) bm[p] = std::max(bm[p], lg[t]);
          cnt[p] += kTreeKeys;
        }
      }
    }
#else
    (void)every;
#endif
    for (; j < j1; ++j) {
      const uint32_t mask = static_cast<uint32_t>(vis[j - j0]);
      if (mask == 0) continue;
      const int32_t pr = a.kv_rows[j];
      KILN_CHECK(pr >= 0 && pr < n_phys, "kv row {} of {}", pr, n_phys);
      const auto* kh = reinterpret_cast<const hwy::float16_t*>(a.k.data() + pr * kv_w + kvh * hd);
      V k[C];
      for (size_t c = 0; c < C; ++c) k[c] = hn::PromoteTo(d, hn::LoadU(dh, kh + c * N));
      for (size_t p = 0; p < NP; ++p) {
        if (!(mask >> p & 1)) continue;
        V a0 = hn::Zero(d), a1 = hn::Zero(d);
        size_t c = 0;
        for (; c + 2 <= C; c += 2) {
          a0 = hn::MulAdd(q[p][c], k[c], a0);
          a1 = hn::MulAdd(q[p][c + 1], k[c + 1], a1);
        }
        if (c < C) a0 = hn::MulAdd(q[p][c], k[c], a0);
        float s = hn::GetLane(hn::SumOfLanes(d, hn::Add(a0, a1))) * scale;
        if (softcap > 0) s = softcap * std::tanh(s / softcap);
        logit[p][cnt[p]++] = s;
        bm[p] = std::max(bm[p], s);
      }
    }
    for (size_t p = 0; p < NP; ++p) {
      if (cnt[p] == 0) continue;
      const float m_new = std::max(m[p], bm[p]);
      if (m[p] != -INFINITY && m_new != m[p]) {
        const float cf = std::exp(m[p] - m_new);
        l[p] *= cf;
        const V cv = hn::Set(d, cf);
        for (size_t c = 0; c < C; ++c) acc[p][c] = hn::Mul(acc[p][c], cv);
      }
      m[p] = m_new;
      const auto vm = hn::Set(d, m[p]);
      for (int64_t j = 0; j < cnt[p]; j += N) {
        const auto x = hn::Max(hn::Sub(hn::LoadU(d, logit[p] + j), vm), hn::Set(d, -87.0f));
        hn::StoreU(hn::Exp(d, x), d, logit[p] + j);
      }
    }
    if (every == all) {  // no per-pair tests: key j is logit j - j0 of every pair
      for (int64_t j = j0; j < j1; ++j) {
        const auto* vh =
            reinterpret_cast<const hwy::float16_t*>(a.v.data() + a.kv_rows[j] * kv_w + kvh * hd);
        V v[C];
        for (size_t c = 0; c < C; ++c) v[c] = hn::PromoteTo(d, hn::LoadU(dh, vh + c * N));
        for (size_t p = 0; p < NP; ++p) {
          const float w = logit[p][j - j0];
          l[p] += w;
          const V wv = hn::Set(d, w);
          for (size_t c = 0; c < C; ++c) acc[p][c] = hn::MulAdd(wv, v[c], acc[p][c]);
        }
      }
      continue;
    }
    int64_t used[NP];
    for (size_t p = 0; p < NP; ++p) used[p] = 0;
    for (int64_t j = j0; j < j1; ++j) {
      const uint32_t mask = static_cast<uint32_t>(vis[j - j0]);
      if (mask == 0) continue;
      const auto* vh =
          reinterpret_cast<const hwy::float16_t*>(a.v.data() + a.kv_rows[j] * kv_w + kvh * hd);
      V v[C];
      for (size_t c = 0; c < C; ++c) v[c] = hn::PromoteTo(d, hn::LoadU(dh, vh + c * N));
      for (size_t p = 0; p < NP; ++p) {
        if (!(mask >> p & 1)) continue;
        const float w = logit[p][used[p]++];
        l[p] += w;
        const V wv = hn::Set(d, w);
        for (size_t c = 0; c < C; ++c) acc[p][c] = hn::MulAdd(wv, v[c], acc[p][c]);
      }
    }
  }
  for (size_t p = 0; p < NP && static_cast<int64_t>(p) < n; ++p) {
    if (l[p] == 0) {
      std::fill(out[p], out[p] + hd, 0.0f);
      continue;
    }
    // The sink, as AttentionOneK's finish: the same scalar exp, and the rescale of the
    // accumulator is its ScaleAcc's lane-wise multiply.
    if (!a.sinks.empty()) {
      const float sink = a.sinks[static_cast<size_t>(head[p])];
      if (sink > m[p]) {
        const float cf = std::exp(m[p] - sink);
        const V cv = hn::Set(d, cf);
        for (size_t c = 0; c < C; ++c) acc[p][c] = hn::Mul(acc[p][c], cv);
        l[p] = l[p] * cf + 1.0f;
      } else {
        l[p] += std::exp(sink - m[p]);
      }
    }
    const V inv = hn::Set(d, 1.0f / l[p]);
    for (size_t c = 0; c < C; ++c) hn::StoreU(hn::Mul(acc[p][c], inv), d, out[p] + c * N);
  }
}

// Pairs per multi-pair task, or 0 where the kernel does not apply: head_dim must be 1, 2, 4
// or 8 whole vectors (no DotQK scalar tail; NP x C accumulators fit the register file).
int64_t AttentionMultiPairsK(int64_t head_dim) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d));
  if (head_dim % N != 0) return 0;
  switch (head_dim / N) {
    case 1:
    case 2:
    case 4:
      return kMultiMaxPairs;
    case 8:
      return 2;
    default:
      return 0;
  }
}

void AttentionMultiK(const AttentionArgs& a, int64_t kvh, int64_t e0, int64_t n, float* scratch) {
  const int64_t N = static_cast<int64_t>(hn::Lanes(DF()));
  // A lone pair (decode without GQA, a run's last) would compute three padding pairs: per pair.
  if (n == 1) {
    const int64_t g = a.n_head / a.n_head_kv;
    return AttentionOneK(a, e0 / g, kvh * g + e0 % g, scratch);
  }
  switch (a.head_dim / N) {
    case 1:
      return AttentionMultiT<1, kMultiMaxPairs>(a, kvh, e0, n, scratch);
    case 2:
      return AttentionMultiT<2, kMultiMaxPairs>(a, kvh, e0, n, scratch);
    case 4:
      return AttentionMultiT<4, kMultiMaxPairs>(a, kvh, e0, n, scratch);
    case 8:
      return AttentionMultiT<8, 2>(a, kvh, e0, n, scratch);
    default:
      KILN_CHECK(false, "multi-pair attention: head_dim {} over {} lanes", a.head_dim, N);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kiln::cpu {
HWY_EXPORT(AttentionOneK);
HWY_EXPORT(AttentionGroupK);
HWY_EXPORT(AttentionGroupTokensK);
HWY_EXPORT(AttentionMultiK);
HWY_EXPORT(AttentionMultiPairsK);

void attention_one(const AttentionArgs& a, int64_t i, int64_t h, float* scratch) {
  HWY_DYNAMIC_DISPATCH(AttentionOneK)(a, i, h, scratch);
}
int64_t attention_group_tokens(int64_t head_dim, int64_t group, bool portable) {
  if (portable) return 0;
  return HWY_DYNAMIC_DISPATCH(AttentionGroupTokensK)(head_dim, group);
}
void attention_group(const AttentionArgs& a, int64_t kvh, int64_t q0, int64_t q1, float* scratch) {
  HWY_DYNAMIC_DISPATCH(AttentionGroupK)(a, kvh, q0, q1, scratch);
}
int64_t attention_multi_pairs(int64_t head_dim, bool portable) {
  if (portable) return 0;
  return HWY_DYNAMIC_DISPATCH(AttentionMultiPairsK)(head_dim);
}
void attention_multi(const AttentionArgs& a, int64_t kvh, int64_t e0, int64_t n, float* scratch) {
  HWY_DYNAMIC_DISPATCH(AttentionMultiK)(a, kvh, e0, n, scratch);
}
// Per pair: acc[hd] + logits[kKeyBlock + a vector of padding] + row ids[kKeyBlock + padding].
// Grouped: qt and acc [hd][lanes], logits [kKeyBlock][lanes], a key row, the block's V rows,
// the lanes' positions. Multi-pair: a padded logit block per pair, a run of key rows.
size_t attention_scratch_floats(int64_t head_dim) {
  const int64_t one = std::max(head_dim + 2 * (kKeyBlock + 64),
                               kMultiMaxPairs * (kKeyBlock + 64) + kTreeKeys * head_dim);
  const int64_t grouped = 2 * head_dim * kGroupMaxLanes + kKeyBlock * kGroupMaxLanes + head_dim +
                          kKeyBlock * head_dim + kGroupMaxLanes;
  return static_cast<size_t>(std::max(one, grouped) + 16);
}
}  // namespace kiln::cpu
#endif
