// tests/engine/read_probe_test.cpp: kiln bench's bandwidth ceiling (engine/read_probe.h)
// answers a positive reading and names the method that gave it; with one method, that one.
#include "engine/read_probe.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace kiln {
namespace {

TEST(ReadProbe, BestOfTheMethodsAndItsName) {
  ReadProbe probe(2, size_t{8} << 20);
  const ReadProbe::Reading all = probe.measure(1);
  EXPECT_GT(all.gbps, 0);
  EXPECT_NE(std::find(std::begin(cpu::kReadMethods), std::end(cpu::kReadMethods), all.method),
            std::end(cpu::kReadMethods));
  const cpu::ReadMethod one[] = {cpu::ReadMethod::kPrefetchL2Matvec};
  const ReadProbe::Reading r = probe.measure(one, 1);
  EXPECT_GT(r.gbps, 0);
  EXPECT_EQ(r.method, cpu::ReadMethod::kPrefetchL2Matvec);
}

}  // namespace
}  // namespace kiln
