// backend/cpu/cpu_attention.cpp: causal attention over f16 KV planes, one (query, head) pair
// per call, blocked over keys with an online softmax (running max and sum rescaled per
// block), so decode (one query) and prefill (many) share one kernel and no n_kv-sized buffer.
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
}
#endif

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

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
  for (; i < n; ++i) s += q[i] * f16_to_f32(k[i]);
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
    hn::StoreU(hn::MulAdd(pv, hn::PromoteTo(d, hn::LoadU(dh, vh + i)), hn::LoadU(d, acc + i)), d, acc + i);
  for (; i < n; ++i) acc[i] += p * f16_to_f32(v[i]);
}

void AttentionOneK(const AttentionArgs& a, int64_t qi, int64_t h, float* scratch) {
  const int64_t hd = a.head_dim, q_w = a.n_head * hd, kv_w = a.n_head_kv * hd;
  const int64_t n_kv = static_cast<int64_t>(a.kv_rows.size());
  const int64_t kvh = h / (a.n_head / a.n_head_kv);
  const int64_t n_phys = static_cast<int64_t>(a.k.size()) / kv_w;
  const float* q = a.q.data() + qi * q_w + h * hd;
  float* out = a.out.data() + qi * q_w + h * hd;
  float* acc = scratch;                  // [hd]
  float* logit = scratch + hd;           // [kKeyBlock]
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
  const float inv = 1.0f / l;
  for (int64_t i = 0; i < hd; ++i) out[i] = acc[i] * inv;
}

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kiln::cpu {
HWY_EXPORT(AttentionOneK);

void attention_one(const AttentionArgs& a, int64_t i, int64_t h, float* scratch) {
  HWY_DYNAMIC_DISPATCH(AttentionOneK)(a, i, h, scratch);
}
// acc[hd] + logits[kKeyBlock + a vector of padding] + row ids[kKeyBlock + padding].
size_t attention_scratch_floats(int64_t head_dim) {
  return static_cast<size_t>(head_dim + 2 * (kKeyBlock + 64));
}
}  // namespace kiln::cpu
#endif
