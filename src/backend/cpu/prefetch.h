// backend/cpu/prefetch.h: software prefetch of a span of weight bytes, as the one-token and
// batched matmul kernels issue it per block step (cpu_matmul.cpp, kq23-inl.h, kq_avx2-inl.h):
// kBytes being the step's rows of one block each, at a distance ahead of the block being read,
// so the prefetched address walks through the rows (back to back) as fast as the kernel reads
// them and keeps more lines in flight than the hardware prefetcher does for one core. A
// prefetch never faults. No target-specific instructions (__builtin_prefetch), so one copy
// serves every Highway target.
#pragma once

#include <cstddef>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace kiln::cpu {

// The lines of the kBytes bytes from p, with __builtin_prefetch's locality kLocality (2:
// prefetcht1, into L2; 3: prefetcht0, into L1).
template <size_t kBytes, int kLocality>
__attribute__((always_inline)) inline void PrefetchSpan(const std::byte* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t j = 0; j < (kBytes + 63) / 64; ++j) __builtin_prefetch(c + 64 * j, 0, kLocality);
}
// The `bytes` bytes from p with each 64-byte line's prefetch issued kRepeat times (at 64 /
// kRepeat byte steps in it): the F16/BF16 one-token rows' form (kernels.h kPrefetchRepeat) and
// the read probe's method of the same name.
template <int kLocality, int kRepeat>
__attribute__((always_inline)) inline void PrefetchRepeated(const void* p, size_t bytes) {
  static_assert(kRepeat >= 1 && 64 % kRepeat == 0);
  const char* c = static_cast<const char*>(p);
  for (size_t b = 0; b < bytes; b += 64 / kRepeat) __builtin_prefetch(c + b, 0, kLocality);
}
template <size_t kBytes>
__attribute__((always_inline)) inline void PrefetchSpanL2(const std::byte* p) {
  PrefetchSpan<kBytes, 2>(p);
}
template <size_t kBytes>
__attribute__((always_inline)) inline void PrefetchSpanL1(const std::byte* p) {
  PrefetchSpan<kBytes, 3>(p);
}

// The machine class that decides where a one-token kernel's stream is prefetched: Intel cores
// read the 4-bit blocks of the Q8_0 family and F16/BF16 rows faster with a short prefetch into
// L1 (the Xeon box, docs/BENCHMARKS.md session 28); AMD cores read both faster with the span
// into L2 that every other one-token kernel uses (Zen 4: sessions 31 and 32).
inline bool IntelCores() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool intel = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &c, &d) == 0) return false;
    return b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;  // "GenuineIntel"
  }();
  return intel;
#else
  return false;
#endif
}

}  // namespace kiln::cpu
