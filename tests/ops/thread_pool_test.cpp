// tests/ops/thread_pool_test.cpp: ThreadPool covers every item exactly once in contiguous
// per-thread chunks, survives many back-to-back calls (the TSan stress case), nests, and
// serialises concurrent callers.
#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace kiln {
namespace {

TEST(ThreadPool, CoversEveryItemOnceInContiguousChunks) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.n_threads(), threads);
    for (int64_t n : {0, 1, 2, 3, 7, 1000}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      std::vector<std::atomic<int>> calls_per_thread(static_cast<size_t>(threads));
      pool.parallel_for(n, [&](int64_t b, int64_t e, int t) {
        ASSERT_GE(t, 0);
        ASSERT_LT(t, threads);
        ASSERT_LT(b, e);
        calls_per_thread[t]++;
        for (int64_t i = b; i < e; ++i) hits[i]++;
      });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
      for (int t = 0; t < threads; ++t) EXPECT_LE(calls_per_thread[t].load(), 1);
    }
  }
}

TEST(ThreadPool, BalancedSplit) {
  ThreadPool pool(3);
  std::vector<int64_t> sizes(3, -1);
  pool.parallel_for(10, [&](int64_t b, int64_t e, int t) { sizes[t] = e - b; });
  for (int64_t s : sizes) {
    EXPECT_GE(s, 3);
    EXPECT_LE(s, 4);
  }
}

TEST(ThreadPool, StressManySmallCalls) {
  ThreadPool pool(4);
  std::vector<int64_t> data(64, 0);
  int64_t expect = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const int64_t n = 1 + iter % 64;
    pool.parallel_for(n, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) data[i] += 1;  // disjoint: no atomics needed
    });
    expect += n;
  }
  int64_t total = 0;
  for (int64_t v : data) total += v;
  EXPECT_EQ(total, expect);
}

TEST(ThreadPool, NestedCallRunsInline) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(4, [&](int64_t b, int64_t e, int) {
    for (int64_t i = b; i < e; ++i)
      pool.parallel_for(10, [&](int64_t bb, int64_t ee, int) { sum += ee - bb; });
  });
  EXPECT_EQ(sum.load(), 40);
}

TEST(ThreadPool, ConcurrentCallersAreSerialised) {
  ThreadPool pool(3);
  std::atomic<int64_t> total{0};
  auto caller = [&] {
    for (int i = 0; i < 500; ++i)
      pool.parallel_for(9, [&](int64_t b, int64_t e, int) { total += e - b; });
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  EXPECT_EQ(total.load(), 2 * 500 * 9);
}

}  // namespace
}  // namespace kiln
