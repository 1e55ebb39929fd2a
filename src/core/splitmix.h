// core/splitmix.h: splitmix64, the one small fixed-algorithm generator kiln's deterministic
// draws start from (the sampler's xoshiro seeding, mkmodel's random weights, the benchmark
// routing overrides). Fixed constants, so every build and machine draws the same numbers.
#pragma once

#include <cstdint>

namespace kiln {

// Advances `state` and returns the next 64 random bits.
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace kiln
