// tests/ops/read_probe_test.cpp: the read passes behind kiln bench's bandwidth ceiling
// (backend/cpu/read_probe.h) read every word once, on every SIMD target and at odd sizes: a
// pass that skipped or re-read words would report a bandwidth it did not move.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/read_probe.h"
#include "ops_common.h"

namespace kiln {
namespace {

TEST(ReadPass, EveryMethodSumsEveryWordOnce) {
  std::mt19937_64 rng(7);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{33}, size_t{1001}, size_t{4099}}) {
    std::vector<uint64_t> w(n);
    for (uint64_t& v : w) v = rng();
    const uint64_t want = std::accumulate(w.begin(), w.end(), uint64_t{0});
    testing::for_each_simd_target([&] {
      for (cpu::ReadMethod m : cpu::kReadMethods)
        EXPECT_EQ(cpu::read_pass(w, m), want) << cpu::read_method_name(m) << ", " << n << " words";
    });
  }
}

}  // namespace
}  // namespace kiln
