// backend/cpu/read_probe.cpp: the read passes of read_probe.h in Highway, compiled once per
// SIMD target and dispatched at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "read_probe.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// foreach_target re-includes this file per target; everything below is per target.
#include "hwy/highway.h"

#include <iterator>

#include "backend/cpu/prefetch.h"
#include "kernels.h"
#include "read_probe.h"

HWY_BEFORE_NAMESPACE();
namespace kiln::cpu {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Four vectors a step; `kAhead` bytes ahead a prefetch of the same span with locality kLoc
// (__builtin_prefetch's: 3 = all levels, 2 = L2 and out, 0 = non-temporal), each line's
// prefetch issued kRepeat times (at offsets 64 / kRepeat apart in it).
template <size_t kAhead, int kLoc, int kRepeat = 1>
uint64_t VectorPass(const uint64_t* p, size_t n) {
  const hn::ScalableTag<uint64_t> d;
  const size_t N = hn::Lanes(d);
  auto a0 = hn::Zero(d), a1 = a0, a2 = a0, a3 = a0;
  size_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    if constexpr (kAhead > 0) {
      const char* c = reinterpret_cast<const char*>(p + i) + kAhead;
      PrefetchRepeated<kLoc, kRepeat>(c, 4 * N * sizeof(uint64_t));
    }
    a0 = hn::Add(a0, hn::LoadU(d, p + i));
    a1 = hn::Add(a1, hn::LoadU(d, p + i + N));
    a2 = hn::Add(a2, hn::LoadU(d, p + i + 2 * N));
    a3 = hn::Add(a3, hn::LoadU(d, p + i + 3 * N));
  }
  // Lanes summed as unsigned words: the x86 reduce intrinsics add as signed, which overflows
  // (undefined) on words that wrap.
  HWY_ALIGN uint64_t lanes[hn::MaxLanes(d)];
  hn::Store(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)), d, lanes);
  uint64_t s = 0;
  for (size_t k = 0; k < N; ++k) s += lanes[k];
  for (; i < n; ++i) s += p[i];
  return s;
}

uint64_t ReadPassK(const uint64_t* p, size_t n, ReadMethod m) {
  switch (m) {
    case ReadMethod::kScalar: {
      uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;  // independent chains so loads overlap
      size_t i = 0;
      for (; i + 4 <= n; i += 4) {
        a0 += p[i];
        a1 += p[i + 1];
        a2 += p[i + 2];
        a3 += p[i + 3];
      }
      for (; i < n; ++i) a0 += p[i];
      return a0 + a1 + a2 + a3;
    }
    case ReadMethod::kVector:
      return VectorPass<0, 3>(p, n);
    case ReadMethod::kPrefetch1K:
      return VectorPass<1024, 3>(p, n);
    case ReadMethod::kPrefetch4K:
      return VectorPass<4096, 3>(p, n);
    case ReadMethod::kPrefetch16K:
      return VectorPass<16384, 3>(p, n);
    case ReadMethod::kPrefetchL2Matvec:
      return VectorPass<static_cast<size_t>(kMatvecPrefetchBytes), 2>(p, n);
    case ReadMethod::kPrefetchNta4K:
      return VectorPass<4096, 0>(p, n);
    case ReadMethod::kPrefetchL2Repeat:
      return VectorPass<static_cast<size_t>(kMatvecPrefetchBytes), 2, kPrefetchRepeat>(p, n);
  }
  return 0;
}

}  // namespace HWY_NAMESPACE
}  // namespace kiln::cpu
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace kiln::cpu {
HWY_EXPORT(ReadPassK);

uint64_t read_pass(std::span<const uint64_t> words, ReadMethod method) {
  return HWY_DYNAMIC_DISPATCH(ReadPassK)(words.data(), words.size(), method);
}

std::string_view read_method_name(ReadMethod m) {
  // Indexed by the enum's value, in kReadMethods' order.
  static constexpr std::string_view kNames[] = {
      "scalar loads",
      "vector loads",
      "vector loads, prefetch 1 KiB ahead",
      "vector loads, prefetch 4 KiB ahead",
      "vector loads, prefetch 16 KiB ahead",
      "vector loads, prefetch to L2 32 KiB ahead",
      "vector loads, non-temporal prefetch 4 KiB ahead",
      "vector loads, prefetch to L2 32 KiB ahead, 4 per line"};
  static_assert(std::size(kNames) == std::size(kReadMethods));
  static_assert(kMatvecPrefetchBytes == 32768 && kPrefetchRepeat == 4,
                "the L2 methods' names above state the distance and the repeat");
  static_assert([] {
    for (size_t k = 0; k < std::size(kReadMethods); ++k)
      if (static_cast<size_t>(kReadMethods[k]) != k) return false;
    return true;
  }());
  const auto k = static_cast<size_t>(m);
  return k < std::size(kNames) ? kNames[k] : "?";
}
}  // namespace kiln::cpu
#endif  // HWY_ONCE
