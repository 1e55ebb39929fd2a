// tests/unit/counters_threads_test.cpp: counters and timers: exact totals under concurrent
// increments (runs under TSan), stable references, snapshots and their text form.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "core/counters.h"

namespace kiln {
namespace {

TEST(Counters, ConcurrentIncrementsAreExact) {
  CounterRegistry reg;
  constexpr int kThreads = 4, kIters = 20000;
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&reg, t] {
      // Lookups race with registration of new names from other threads.
      Counter& shared = reg.counter("shared");
      Counter& mine = reg.counter("thread." + std::to_string(t));
      Timer& timer = reg.timer("work");
      for (int i = 0; i < kIters; ++i) {
        shared.add();
        mine.add(2);
        if (i % 1000 == 0) {
          ScopedTimer st(timer);
          (void)reg.snapshot();  // snapshots while others write
        }
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(reg.counter("shared").value(), uint64_t{kThreads} * kIters);
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(reg.counter("thread." + std::to_string(t)).value(), 2u * kIters);
  EXPECT_EQ(reg.timer("work").count(), uint64_t{kThreads} * (kIters / 1000));
}

TEST(Counters, ReferencesStayValidAsTheRegistryGrows) {
  CounterRegistry reg;
  Counter& first = reg.counter("a.first");
  first.add(5);
  for (int i = 0; i < 1000; ++i) reg.counter("grow." + std::to_string(i)).add(1);
  EXPECT_EQ(&first, &reg.counter("a.first"));
  EXPECT_EQ(first.value(), 5u);
}

TEST(Counters, SnapshotIsSortedAndFormatted) {
  CounterRegistry reg;
  reg.counter("load.bytes_mapped").add(4096);
  reg.counter("expert.hits").add(3);
  Timer& t = reg.timer("kernel.matmul");
  t.record(std::chrono::microseconds(1500));
  t.record(std::chrono::microseconds(500));
  {
    ScopedTimer st(reg.timer("scoped"));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto s = reg.snapshot();
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].name, "expert.hits");
  EXPECT_EQ(s[1].name, "kernel.matmul");
  EXPECT_TRUE(s[1].is_timer);
  EXPECT_EQ(s[1].value, 2'000'000u);
  EXPECT_EQ(s[1].n_events, 2u);
  EXPECT_EQ(s[2].name, "load.bytes_mapped");
  EXPECT_EQ(s[2].value, 4096u);
  EXPECT_GE(s[3].value, 2'000'000u) << "scoped timer measured less than its sleep";
  const std::string text = format_counters(s);
  EXPECT_NE(text.find("load.bytes_mapped"), std::string::npos);
  EXPECT_NE(text.find("4096"), std::string::npos);
  EXPECT_NE(text.find("2.000 ms / 2 = 1000.0 us"), std::string::npos) << text;
}

TEST(CountersDeathTest, ANameIsEitherACounterOrATimer) {
  CounterRegistry reg;
  reg.counter("x");
  EXPECT_DEATH(reg.timer("x"), "already a counter");
}

TEST(Counters, ProcessRegistryIsOne) { EXPECT_EQ(&process_counters(), &process_counters()); }

}  // namespace
}  // namespace kiln
