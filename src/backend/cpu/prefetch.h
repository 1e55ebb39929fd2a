// backend/cpu/prefetch.h: software prefetch of a span of weight bytes, as the one-token and
// batched matmul kernels issue it per block step (cpu_matmul.cpp, kq23-inl.h, kq_avx2-inl.h):
// kBytes being the step's rows of one block each, at a distance ahead of the block being read,
// so the prefetched address walks through the rows (back to back) as fast as the kernel reads
// them and keeps more lines in flight than the hardware prefetcher does for one core. A
// prefetch never faults. No target-specific instructions (__builtin_prefetch), so one copy
// serves every Highway target.
#pragma once

#include <cstddef>

namespace kiln::cpu {

// The lines of the kBytes bytes from p, with __builtin_prefetch's locality kLocality (2:
// prefetcht1, into L2; 3: prefetcht0, into L1).
template <size_t kBytes, int kLocality>
__attribute__((always_inline)) inline void PrefetchSpan(const std::byte* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t j = 0; j < (kBytes + 63) / 64; ++j) __builtin_prefetch(c + 64 * j, 0, kLocality);
}
template <size_t kBytes>
__attribute__((always_inline)) inline void PrefetchSpanL2(const std::byte* p) {
  PrefetchSpan<kBytes, 2>(p);
}
template <size_t kBytes>
__attribute__((always_inline)) inline void PrefetchSpanL1(const std::byte* p) {
  PrefetchSpan<kBytes, 3>(p);
}

}  // namespace kiln::cpu
