// tests/ops/tier_policy_test.cpp: the device tier's eviction orders (backend/tier_policy.h)
// against plain reference models of LRU and LFU on random use streams, the refusal of keys
// the caller still needs, aging, and the hit rates the two orders reach on a Zipf(1) stream of
// MoE-like gets (8 of 128 experts per token, a quarter of them cached), which is why the CUDA
// tier defaults to lfu.
#include "backend/tier_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <list>
#include <map>
#include <random>
#include <set>
#include <vector>

namespace kiln {
namespace {

uint64_t fresh_seed() {
  const uint64_t s = std::random_device{}();
  std::printf("  seed %llu\n", static_cast<unsigned long long>(s));
  return s;
}

// Runs a cache of `cap` entries over `gets` (one vector of keys per step), evicting what
// `policy` names among keys not used in the current step; returns the hit rate after `warm`
// steps.
double run_cache(TierPolicy& policy, size_t cap, const std::vector<std::vector<uint64_t>>& gets,
                 size_t warm) {
  std::set<uint64_t> resident;
  uint64_t hits = 0, total = 0;
  for (size_t s = 0; s < gets.size(); ++s) {
    std::set<uint64_t> step;
    for (uint64_t k : gets[s]) {
      step.insert(k);
      const bool hit = resident.contains(k);
      if (s >= warm) hits += hit, ++total;
      if (hit) {
        policy.hit(k);
        continue;
      }
      if (resident.size() >= cap) {
        const auto v = policy.victim([&](uint64_t c) { return !step.contains(c); });
        EXPECT_TRUE(v.has_value());
        if (!v) return 0;
        EXPECT_TRUE(resident.contains(*v));
        EXPECT_FALSE(step.contains(*v)) << "evicted a key the step still uses";
        policy.erase(*v);
        resident.erase(*v);
      }
      policy.insert(k);
      resident.insert(k);
    }
    EXPECT_EQ(policy.size(), resident.size());
  }
  return total ? static_cast<double>(hits) / static_cast<double>(total) : 0;
}

// Steps of k distinct keys out of n, key r drawn with weight (r+1)^-s (s = 0: uniform).
std::vector<std::vector<uint64_t>> zipf_steps(uint64_t seed, int n, int k, double s, int steps) {
  std::mt19937_64 rng(seed);
  std::vector<double> w(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) w[r] = std::pow(r + 1.0, -s);
  std::vector<std::vector<uint64_t>> out;
  for (int t = 0; t < steps; ++t) {
    std::vector<double> left = w;
    std::vector<uint64_t> step;
    for (int j = 0; j < k; ++j) {
      std::discrete_distribution<int> pick(left.begin(), left.end());
      const int e = pick(rng);
      left[e] = 0;
      step.push_back(0x1000 + static_cast<uint64_t>(e));
    }
    out.push_back(step);
  }
  return out;
}

TEST(TierPolicy, LruEvictsTheLeastRecentlyUsedKey) {
  std::mt19937_64 rng(fresh_seed());
  TierPolicy p(TierEviction::Lru);
  std::list<uint64_t> ref;  // most recent first
  for (int i = 0; i < 5000; ++i) {
    const uint64_t k = rng() % 40;
    auto it = std::find(ref.begin(), ref.end(), k);
    if (it != ref.end()) {
      ref.erase(it);
      p.hit(k);
    } else {
      if (ref.size() == 16) {
        const auto v = p.victim([](uint64_t) { return true; });
        ASSERT_TRUE(v.has_value());
        ASSERT_EQ(*v, ref.back());
        p.erase(*v);
        ref.pop_back();
      }
      p.insert(k);
    }
    ref.push_front(k);
  }
}

TEST(TierPolicy, LfuEvictsTheFewestUsedKeyAndRemembersEvictedCounts) {
  std::mt19937_64 rng(fresh_seed());
  TierPolicy p(TierEviction::Lfu, /*aging_period=*/1'000'000);  // no aging in this run
  std::map<uint64_t, uint64_t> count, last;                     // every key ever used
  std::set<uint64_t> resident;
  uint64_t clock = 0;
  for (int i = 0; i < 5000; ++i) {
    const uint64_t k = rng() % 40;
    if (!resident.contains(k) && resident.size() == 16) {
      uint64_t want = 0;
      bool first = true;
      for (uint64_t r : resident)
        if (first || std::pair(count[r], last[r]) < std::pair(count[want], last[want]))
          want = r, first = false;
      const auto v = p.victim([](uint64_t) { return true; });
      ASSERT_TRUE(v.has_value());
      ASSERT_EQ(*v, want);
      p.erase(*v);
      resident.erase(*v);
    }
    if (resident.contains(k))
      p.hit(k);
    else
      p.insert(k), resident.insert(k);
    ++count[k];
    last[k] = ++clock;
    ASSERT_EQ(p.count(k), count[k]);
  }
}

TEST(TierPolicy, VictimSkipsRefusedKeysAndNamesNoneWhenAllAreRefused) {
  for (TierEviction order : {TierEviction::Lru, TierEviction::Lfu}) {
    TierPolicy p(order);
    for (uint64_t k = 1; k <= 5; ++k) p.insert(k);
    for (int i = 0; i < 3; ++i) p.hit(5);
    const auto v = p.victim([](uint64_t k) { return k != 1 && k != 2; });
    ASSERT_TRUE(v.has_value());
    EXPECT_EQ(*v, 3u) << tier_eviction_name(order);
    EXPECT_FALSE(p.victim([](uint64_t) { return false; }).has_value());
  }
}

TEST(TierPolicy, LfuAgingHalvesCountsAndForgetsColdEvictedKeys) {
  TierPolicy p(TierEviction::Lfu, /*aging_period=*/8);
  p.insert(1);
  for (int i = 0; i < 4; ++i) p.hit(1);  // 5 uses
  p.insert(2);
  p.erase(2);  // count 1, not resident
  EXPECT_EQ(p.count(2), 1u);
  p.hit(1);
  p.hit(1);  // 8th use: the counts halve
  EXPECT_EQ(p.count(1), 3u);
  EXPECT_EQ(p.count(2), 0u);  // forgotten
  // The resident order survives the rebuild: 1 is still the only resident key.
  EXPECT_EQ(p.size(), 1u);
  EXPECT_EQ(p.victim([](uint64_t) { return true; }).value(), 1u);
}

TEST(TierPolicy, LfuKeepsMoreZipfGetsThanLru) {
  // 128 experts, 8 per token, 32 cached: the CUDA tier at 25 % under --moe-routing zipf.
  const auto gets = zipf_steps(fresh_seed(), 128, 8, 1.0, 3000);
  TierPolicy lru(TierEviction::Lru), lfu(TierEviction::Lfu);
  const double h_lru = run_cache(lru, 32, gets, 500), h_lfu = run_cache(lfu, 32, gets, 500);
  std::printf("  zipf:1, 32 of 128 cached: lru hit rate %.3f, lfu %.3f\n", h_lru, h_lfu);
  // Expected ~0.56 and ~0.68 (the top quarter's share of Zipf(1) draws without replacement).
  EXPECT_GT(h_lfu, h_lru + 0.06);
  EXPECT_GT(h_lfu, 0.62);
  // Uniform routing: no popularity to learn; LFU must not be much worse than LRU.
  const auto flat = zipf_steps(fresh_seed(), 128, 8, 0.0, 2000);
  TierPolicy lru2(TierEviction::Lru), lfu2(TierEviction::Lfu);
  const double f_lru = run_cache(lru2, 32, flat, 500), f_lfu = run_cache(lfu2, 32, flat, 500);
  std::printf("  uniform, 32 of 128 cached: lru hit rate %.3f, lfu %.3f\n", f_lru, f_lfu);
  EXPECT_GT(f_lfu, f_lru - 0.03);
}

TEST(TierPolicy, ParsesItsNamesAndRejectsOthers) {
  EXPECT_EQ(parse_tier_eviction("lru").value(), TierEviction::Lru);
  EXPECT_EQ(parse_tier_eviction("lfu").value(), TierEviction::Lfu);
  const auto bad = parse_tier_eviction("fifo");
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().find("fifo"), std::string::npos);
}

}  // namespace
}  // namespace kiln
