// tests/ops/ops_common.h: shared helpers of the op tests: a per-run seed (printed with every
// failure), random data, and a closeness check that a NaN can never pass.
#pragma once

#include <gtest/gtest.h>

#include "hwy/targets.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace kiln::testing {

// Fresh inputs every run; the seed is in every failure message, and KILN_OPS_SEED=<that seed>
// replays the failure.
inline uint64_t ops_seed() {
  static const uint64_t seed = [] {
    if (const char* s = std::getenv("KILN_OPS_SEED"); s != nullptr && *s != '\0')
      return static_cast<uint64_t>(std::strtoull(s, nullptr, 10));
    return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  return seed;
}

inline std::vector<float> random_vec(std::mt19937_64& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// |got - want| <= tol, written so that a NaN in either (or in tol) fails.
inline ::testing::AssertionResult close(float got, float want, double tol) {
  const double diff = std::fabs(double(got) - double(want));
  if (diff <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << got << " want " << want << " |diff| " << diff
                                       << " > tol " << tol << " (seed " << ops_seed() << ")";
}

// check() once on every SIMD target this machine can run (Highway's dispatch pinned to each in
// turn, restored afterwards, failed or not); stops at the first fatal failure. For the tests
// that a kernel has the same bits on every target (each has its own vector width).
template <typename F>
void for_each_simd_target(F&& check) {
  struct Unmock {
    ~Unmock() { hwy::SetSupportedTargetsForTest(0); }
  } unmock;
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    check();
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace kiln::testing
