// backend/cpu/read_probe.h: the streaming-read passes behind decode's roofline (engine/
// read_probe.h runs them): one buffer summed by one of several read methods, each compiled per
// SIMD target and dispatched on the machine's features. The ceiling is the best of them, so a
// kernel that prefetches does not beat a probe that did not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace kiln::cpu {

enum class ReadMethod : uint8_t {
  kScalar,            // 64-bit loads, four independent sums
  kVector,            // the widest vectors, four independent sums
  kPrefetch1K,        // kVector with a software prefetch to L1 this many bytes ahead
  kPrefetch4K,        //
  kPrefetch16K,       //
  kPrefetchL2Matvec,  // to L2, kMatvecPrefetchBytes ahead (the one-token matvec kernels' form)
  kPrefetchNta4K,     // non-temporal prefetch, 4 KiB ahead
  kPrefetchL2Repeat,  // kPrefetchL2Matvec with each line's prefetch issued kPrefetchRepeat times
};
inline constexpr ReadMethod kReadMethods[] = {
    ReadMethod::kScalar,        ReadMethod::kVector,          ReadMethod::kPrefetch1K,
    ReadMethod::kPrefetch4K,    ReadMethod::kPrefetch16K,     ReadMethod::kPrefetchL2Matvec,
    ReadMethod::kPrefetchNta4K, ReadMethod::kPrefetchL2Repeat};
std::string_view read_method_name(ReadMethod m);

// The wrapping sum of `words` read by `method` (returned so the loads are not optimised out;
// every method gives the same sum). Prefetches may reach past the end: they do not fault.
uint64_t read_pass(std::span<const uint64_t> words, ReadMethod method);

}  // namespace kiln::cpu
