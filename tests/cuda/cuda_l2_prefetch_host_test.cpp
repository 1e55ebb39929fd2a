// tests/cuda/cuda_l2_prefetch_host_test.cpp: the L2 prefetch planner (backend/cuda/
// l2_prefetch.h), which decides on the host which weight bytes a hint pulls into L2. Runs
// without a GPU: the planner only does address arithmetic. The kernel's effect (none on any
// result) is CudaL2Prefetch.SameBitsAsWithout in the golden suite.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "backend/cuda/l2_prefetch.h"

namespace kiln::cuda {
namespace {

// Fake device addresses: only their arithmetic matters, nothing is dereferenced.
std::span<const std::byte> at(uintptr_t addr, size_t bytes) {
  return {reinterpret_cast<const std::byte*>(addr), bytes};
}
uintptr_t addr(const PrefetchRange& r) { return reinterpret_cast<uintptr_t>(r.p); }

TEST(L2PrefetchPlan, HintsContinueWhereTheLastStoppedUntilTheWeightIsRead) {
  L2PrefetchPlan plan(/*budget=*/1000 * 16, /*cap=*/1 << 20);
  const std::span<const std::byte> wo = at(0x10000, 600 * 16), gate = at(0x40000, 2000 * 16);
  const std::span<const std::byte> first[] = {wo, gate};
  std::vector<PrefetchRange> r = plan.hint(first);
  // All of wo, then gate's first 400 lines of 16 bytes: the budget.
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(addr(r[0]), 0x10000u);
  EXPECT_EQ(r[0].bytes, 600u * 16);
  EXPECT_EQ(addr(r[1]), 0x40000u);
  EXPECT_EQ(r[1].bytes, 400u * 16);
  EXPECT_EQ(plan.held(), 1000u * 16);
  // The next hint names gate again: it goes on after the 400 lines, never repeats them.
  const std::span<const std::byte> second[] = {gate};
  r = plan.hint(second);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(addr(r[0]), 0x40000u + 400 * 16);
  EXPECT_EQ(r[0].bytes, 1000u * 16);
  // wo is read: its bytes leave the held count; a later hint of wo starts from its beginning.
  plan.consumed(wo.data());
  EXPECT_EQ(plan.held(), 1400u * 16);
  const std::span<const std::byte> again[] = {wo};
  r = plan.hint(again);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(addr(r[0]), 0x10000u);
  // gate's last 600 lines of 2000, then nothing more of it.
  plan.consumed(wo.data());
  r = plan.hint(second);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].bytes, 600u * 16);
  r = plan.hint(second);
  EXPECT_TRUE(r.empty());
}

TEST(L2PrefetchPlan, HeldBytesStayWithinTheCap) {
  L2PrefetchPlan plan(/*budget=*/4096, /*cap=*/6144);
  const std::span<const std::byte> a = at(0x1000, 4096), b = at(0x9000, 4096),
                                   c = at(0x20000, 4096);
  const std::span<const std::byte> ab[] = {a, b};
  EXPECT_EQ(plan.hint(ab).at(0).bytes, 4096u);   // the budget: all of a
  std::vector<PrefetchRange> r = plan.hint(ab);  // the cap leaves 2048 for b
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(addr(r[0]), 0x9000u);
  EXPECT_EQ(r[0].bytes, 2048u);
  const std::span<const std::byte> cs[] = {c};
  EXPECT_TRUE(plan.hint(cs).empty()) << "the cap is spent";
  plan.consumed(a.data());
  r = plan.hint(cs);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].bytes, 4096u);
  EXPECT_EQ(plan.held(), 6144u);
  // A new step: nothing is held, every weight starts over.
  plan.reset();
  EXPECT_EQ(plan.held(), 0u);
  EXPECT_EQ(addr(plan.hint(ab).at(0)), 0x1000u);
  // Reading a weight no hint named changes nothing.
  plan.consumed(reinterpret_cast<const std::byte*>(0x777000));
  EXPECT_EQ(plan.held(), 4096u);
}

TEST(L2PrefetchPlan, RangesAreTrimmedInwardToSixteenBytes) {
  L2PrefetchPlan plan(/*budget=*/100, /*cap=*/1000);
  // Starts 8 bytes past a 16-byte bound; the budget ends mid-line.
  const std::span<const std::byte> w = at(0x1008, 500), empty = at(0x5000, 0);
  const std::span<const std::byte> ws[] = {empty, w};
  std::vector<PrefetchRange> r = plan.hint(ws);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(addr(r[0]), 0x1010u);
  EXPECT_EQ(r[0].bytes, 80u);  // [0x1010, 0x1060): inside [0x1008, 0x1008 + 100)
  EXPECT_EQ(addr(r[0]) % 16, 0u);
  EXPECT_EQ(r[0].bytes % 16, 0u);
  // The cursor counts the whole budget: the next hint starts at 0x1008 + 100 = 0x106c,
  // trimmed up to 0x1070.
  r = plan.hint(ws);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(addr(r[0]), 0x1070u);
  // A piece shorter than one aligned line gives no range but still moves the cursor.
  L2PrefetchPlan tiny(/*budget=*/10, /*cap=*/1000);
  const std::span<const std::byte> one[] = {w};
  EXPECT_TRUE(tiny.hint(one).empty());
  EXPECT_EQ(tiny.held(), 10u);
}

}  // namespace
}  // namespace kiln::cuda
