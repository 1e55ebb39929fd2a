// backend/cpu/cpu_ops.cpp: elementwise and row ops (norms, softmax, activations) in Highway,
// compiled once per SIMD target and dispatched at run time.
#define HWY_WANT_AVX3_DL 1
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_ops.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// foreach_target re-includes this file per target; everything below is per target.
#include "hwy/highway.h"
#include "hwy/contrib/math/math-inl.h"

#include <algorithm>
#include <cmath>

#include "kernels.h"

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

// hwy's Exp is specified on [-FLT_MAX, 104]; clamping keeps every input in range and only
// changes results that are 0 or inf in f32 anyway.
template <class V>
HWY_INLINE V SafeExp(DF d, V x) {
  return hn::Exp(d, hn::Min(hn::Max(x, hn::Set(d, -87.0f)), hn::Set(d, 88.0f)));
}

// Partial vectors go through a stack buffer: a masked load may still touch the bytes past
// the end on some targets, which ASan (rightly) reports.
HWY_INLINE hn::Vec<DF> LoadTail(DF d, const float* p, size_t r) {
  HWY_ALIGN float buf[hn::MaxLanes(DF())] = {};
  for (size_t i = 0; i < r; ++i) buf[i] = p[i];
  return hn::Load(d, buf);
}
HWY_INLINE void StoreTail(hn::Vec<DF> v, DF d, float* p, size_t r) {
  HWY_ALIGN float buf[hn::MaxLanes(DF())];
  hn::Store(v, d, buf);
  for (size_t i = 0; i < r; ++i) p[i] = buf[i];
}

template <class Op>
HWY_INLINE void Binary(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, float* out,
                       size_t n, Op op) {
  const DF d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N)
    hn::StoreU(op(d, hn::LoadU(d, a + i), hn::LoadU(d, b + i)), d, out + i);
  if (i < n) {
    const size_t r = n - i;
    StoreTail(op(d, LoadTail(d, a + i, r), LoadTail(d, b + i, r)), d, out + i, r);
  }
}
template <class Op>
HWY_INLINE void Unary(float* x, size_t n, Op op) {
  const DF d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(op(d, hn::LoadU(d, x + i)), d, x + i);
  if (i < n) {
    const size_t r = n - i;
    StoreTail(op(d, LoadTail(d, x + i, r)), d, x + i, r);
  }
}

void AddK(const float* a, const float* b, float* out, size_t n) {
  Binary(a, b, out, n, [](DF, auto x, auto y) { return hn::Add(x, y); });
}
void MulK(const float* a, const float* b, float* out, size_t n) {
  Binary(a, b, out, n, [](DF, auto x, auto y) { return hn::Mul(x, y); });
}
void ScaleK(float* x, size_t n, float s) {
  Unary(x, n, [s](DF d, auto v) { return hn::Mul(v, hn::Set(d, s)); });
}
void SoftcapK(float* x, size_t n, float cap) {
  Unary(x, n, [cap](DF d, auto v) {
    return hn::Mul(hn::Set(d, cap), hn::Tanh(d, hn::Mul(v, hn::Set(d, 1.0f / cap))));
  });
}
void SigmoidK(float* x, size_t n) {
  Unary(x, n, [](DF d, auto v) {
    const auto one = hn::Set(d, 1.0f);
    return hn::Div(one, hn::Add(one, SafeExp(d, hn::Neg(v))));
  });
}
void SwigluK(const float* g, const float* u, float* out, size_t n) {
  Binary(g, u, out, n, [](DF d, auto gv, auto uv) {
    const auto one = hn::Set(d, 1.0f);
    return hn::Mul(hn::Div(gv, hn::Add(one, SafeExp(d, hn::Neg(gv)))), uv);
  });
}
void GegluK(const float* g, const float* u, float* out, size_t n) {
  Binary(g, u, out, n, [](DF d, auto x, auto uv) {
    const auto c = hn::Set(d, 0.79788456080286535588f);  // sqrt(2/pi)
    const auto inner =
        hn::Mul(hn::Mul(c, x), hn::MulAdd(hn::Set(d, 0.044715f), hn::Mul(x, x), hn::Set(d, 1.0f)));
    const auto gelu =
        hn::Mul(hn::Mul(hn::Set(d, 0.5f), x), hn::Add(hn::Set(d, 1.0f), hn::Tanh(d, inner)));
    return hn::Mul(gelu, uv);
  });
}

void RmsnormRowK(const float* x, const float* w, size_t n, float eps, float* y) {
  const DF d;
  const size_t N = hn::Lanes(d);
  auto s0 = hn::Zero(d), s1 = hn::Zero(d);
  size_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    const auto a = hn::LoadU(d, x + i), b = hn::LoadU(d, x + i + N);
    s0 = hn::MulAdd(a, a, s0);
    s1 = hn::MulAdd(b, b, s1);
  }
  for (; i < n; i += N) {
    const auto a = LoadTail(d, x + i, n - i < N ? n - i : N);
    s0 = hn::MulAdd(a, a, s0);
  }
  const float ss = hn::GetLane(hn::SumOfLanes(d, hn::Add(s0, s1)));
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const auto vi = hn::Set(d, inv);
  for (i = 0; i < n; i += N) {
    const size_t r = n - i < N ? n - i : N;
    auto v = hn::Mul(LoadTail(d, x + i, r), vi);
    if (w) v = hn::Mul(v, LoadTail(d, w + i, r));
    StoreTail(v, d, y + i, r);
  }
}

void SoftmaxRowK(float* x, size_t n) {
  const DF d;
  const size_t N = hn::Lanes(d);
  auto mx = hn::Set(d, -INFINITY);
  for (size_t i = 0; i < n; i += N) {
    const size_t r = n - i < N ? n - i : N;
    mx =
        hn::Max(mx, hn::IfThenElse(hn::FirstN(d, r), LoadTail(d, x + i, r), hn::Set(d, -INFINITY)));
  }
  const auto m = hn::Set(d, hn::GetLane(hn::MaxOfLanes(d, mx)));
  auto sum = hn::Zero(d);
  for (size_t i = 0; i < n; i += N) {
    const size_t r = n - i < N ? n - i : N;
    const auto e =
        hn::IfThenElseZero(hn::FirstN(d, r), SafeExp(d, hn::Sub(LoadTail(d, x + i, r), m)));
    sum = hn::Add(sum, e);
    StoreTail(e, d, x + i, r);
  }
  const float inv = 1.0f / hn::GetLane(hn::SumOfLanes(d, sum));
  ScaleK(x, n, inv);
}

void F32ToF16K(const float* src, f16* dst, size_t n) {
  const DF d;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const size_t N = hn::Lanes(d);
  auto* out = reinterpret_cast<hwy::float16_t*>(dst);
  size_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(hn::DemoteTo(dh, hn::LoadU(d, src + i)), dh, out + i);
  for (; i < n; ++i) dst[i] = ::kiln::f32_to_f16(src[i]);
}

const char* TargetNameK() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kiln::cpu {
HWY_EXPORT(AddK);
HWY_EXPORT(MulK);
HWY_EXPORT(ScaleK);
HWY_EXPORT(SoftcapK);
HWY_EXPORT(SigmoidK);
HWY_EXPORT(SwigluK);
HWY_EXPORT(GegluK);
HWY_EXPORT(RmsnormRowK);
HWY_EXPORT(SoftmaxRowK);
HWY_EXPORT(F32ToF16K);
HWY_EXPORT(TargetNameK);

void add(const float* a, const float* b, float* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(AddK)(a, b, out, n);
}
void mul(const float* a, const float* b, float* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(MulK)(a, b, out, n);
}
void scale(float* x, size_t n, float s) { HWY_DYNAMIC_DISPATCH(ScaleK)(x, n, s); }
void softcap(float* x, size_t n, float cap) { HWY_DYNAMIC_DISPATCH(SoftcapK)(x, n, cap); }
void sigmoid(float* x, size_t n) { HWY_DYNAMIC_DISPATCH(SigmoidK)(x, n); }
void swiglu(const float* g, const float* u, float* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(SwigluK)(g, u, out, n);
}
void geglu(const float* g, const float* u, float* out, size_t n) {
  HWY_DYNAMIC_DISPATCH(GegluK)(g, u, out, n);
}
// Scalar, float for float as llama.cpp's CPU swiglu_oai (a gpt-oss expert's n_ff elements per
// token: small next to the expert matmuls around it).
void swiglu_oai(const float* g, const float* u, float* out, size_t n, float alpha, float limit) {
  for (size_t i = 0; i < n; ++i) {
    const float x = std::min(g[i], limit);
    const float y = std::clamp(u[i], -limit, limit);
    out[i] = x / (1.0f + std::exp(alpha * (-x))) * (y + 1.0f);
  }
}
void rmsnorm_row(const float* x, const float* w, size_t n, float eps, float* y) {
  HWY_DYNAMIC_DISPATCH(RmsnormRowK)(x, w, n, eps, y);
}
void softmax_row(float* x, size_t n) { HWY_DYNAMIC_DISPATCH(SoftmaxRowK)(x, n); }
void f32_to_f16(const float* src, f16* dst, size_t n) {
  HWY_DYNAMIC_DISPATCH(F32ToF16K)(src, dst, n);
}
const char* target_name() { return HWY_DYNAMIC_DISPATCH(TargetNameK)(); }
}  // namespace kiln::cpu
#endif
