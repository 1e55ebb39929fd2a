// tests/kv/kv_cache_test.cpp: KV bookkeeping (KvRowMap) and planes (KvCache): appends,
// batches across the ring's wrap point, rollback, and a randomised comparison against a
// naive cache that stores every position forever.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "kv/kv_cache.h"

namespace kiln {
namespace {

std::vector<int32_t> iota(int32_t a, int32_t b) {
  std::vector<int32_t> v;
  for (int32_t p = a; p < b; ++p) v.push_back(p);
  return v;
}
std::vector<int32_t> vec(std::span<const int32_t> s) { return {s.begin(), s.end()}; }

TEST(KvRowMap, FullLayerRowsArePositions) {
  KvRowMap m(/*n_ctx=*/64, /*max_batch=*/16, /*window=*/0);
  EXPECT_EQ(m.capacity(), 64);
  ASSERT_TRUE(m.begin_append(5));
  EXPECT_EQ(m.append_rows(), iota(0, 5));
  EXPECT_EQ(m.kv_pos(), iota(0, 5));
  m.commit();
  ASSERT_TRUE(m.begin_append(3));
  EXPECT_EQ(m.append_pos(), iota(5, 8));
  EXPECT_EQ(m.append_rows(), iota(5, 8));
  EXPECT_EQ(m.kv_rows(), iota(0, 8));
  m.commit();
  EXPECT_EQ(m.n_pos(), 8);
  EXPECT_EQ(m.kv_pos(), iota(0, 8));
}

TEST(KvRowMap, AppendLimits) {
  KvRowMap m(10, 4, 0);
  EXPECT_FALSE(m.begin_append(0));
  EXPECT_FALSE(m.begin_append(5));  // > max_batch
  ASSERT_TRUE(m.begin_append(4));
  m.commit();
  ASSERT_TRUE(m.begin_append(4));
  m.commit();
  Status s = m.begin_append(3);  // 8 + 3 > 10
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("context overflow"), std::string::npos) << s.message();
  EXPECT_EQ(m.n_pos(), 8);
  ASSERT_TRUE(m.begin_append(2));
  m.commit();
  EXPECT_EQ(m.n_pos(), 10);
}

TEST(KvRowMap, RingBatchAcrossWrapPoint) {
  // window 8, max_batch 4: capacity 12. Fill to 10, then append 4 (positions 10..13 land
  // in rows 10, 11, 0, 1: across the wrap).
  KvRowMap m(100, 4, 8);
  EXPECT_EQ(m.capacity(), 12);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(m.begin_append(2));
    m.commit();
  }
  ASSERT_TRUE(m.begin_append(4));
  EXPECT_EQ(m.append_rows(), (std::vector<int32_t>{10, 11, 0, 1}));
  // The first new query (pos 10) needs keys 3..10; all keys of the batch: 3..13.
  EXPECT_EQ(m.kv_pos(), iota(3, 14));
  std::vector<int32_t> rows;
  for (int32_t p = 3; p < 14; ++p) rows.push_back(p % 12);
  EXPECT_EQ(m.kv_rows(), rows);
  EXPECT_EQ(m.lo(), 2);  // positions 0, 1 overwritten
  m.commit();
  // Next single-token step at pos 14 sees 7..14.
  ASSERT_TRUE(m.begin_append(1));
  EXPECT_EQ(m.kv_pos(), iota(7, 15));
  EXPECT_EQ(m.append_rows(), (std::vector<int32_t>{2}));
}

// A prefill chunk longer than the window (window 4, max_batch 16: capacity 20): every query
// of the batch still finds its whole window, and the new rows never collide.
TEST(KvRowMap, RingPrefillLongerThanWindow) {
  KvRowMap m(200, 16, 4);
  EXPECT_EQ(m.capacity(), 20);
  for (int round = 0; round < 5; ++round) {
    const int32_t start = m.n_pos();
    ASSERT_TRUE(m.begin_append(13));
    // The first query (pos start) needs start-3..start; the batch adds start..start+12.
    EXPECT_EQ(m.kv_pos(), iota(std::max(0, start - 3), start + 13));
    std::vector<int32_t> rows = m.append_rows();
    std::sort(rows.begin(), rows.end());
    EXPECT_EQ(std::unique(rows.begin(), rows.end()), rows.end()) << "round " << round;
    // No listed key shares a physical row with another listed key.
    std::vector<int32_t> kv = m.kv_rows();
    std::sort(kv.begin(), kv.end());
    EXPECT_EQ(std::unique(kv.begin(), kv.end()), kv.end()) << "round " << round;
    m.commit();
  }
  EXPECT_EQ(m.n_pos(), 65);
  EXPECT_GE(m.lo(), 65 - 20);
}

TEST(KvRowMap, RingNeverLargerThanContext) {
  KvRowMap m(10, 8, 8);
  EXPECT_EQ(m.capacity(), 10);
  ASSERT_TRUE(m.begin_append(8));
  m.commit();
  ASSERT_TRUE(m.begin_append(2));
  EXPECT_EQ(m.kv_pos(), iota(1, 10));
}

TEST(KvRowMap, RollbackWithinAndBeyondRing) {
  KvRowMap m(1000, 4, 16);  // capacity 20
  for (int i = 0; i < 50; ++i) {
    ASSERT_TRUE(m.begin_append(3));
    m.commit();
  }
  EXPECT_EQ(m.n_pos(), 150);
  EXPECT_EQ(m.lo(), 130);
  // Rolling back the last batch always works.
  ASSERT_TRUE(m.truncate(147));
  EXPECT_EQ(m.min_truncate_pos(), 145);
  ASSERT_TRUE(m.truncate(145));
  Status s = m.truncate(144);
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("re-prefill"), std::string::npos) << s.message();
  EXPECT_EQ(m.n_pos(), 145);      // unchanged by the refused rollback
  EXPECT_FALSE(m.truncate(146));  // forward is not a rollback
  ASSERT_TRUE(m.begin_append(1));
  EXPECT_EQ(m.kv_pos(), iota(130, 146));
  EXPECT_EQ(m.append_rows(), (std::vector<int32_t>{145 % 20}));
  ASSERT_TRUE(m.truncate(0));
  EXPECT_EQ(m.n_pos(), 0);
  EXPECT_EQ(m.lo(), 0);
}

TEST(KvRowMap, RollbackBeforeWrapIsFree) {
  KvRowMap m(100, 4, 8);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(m.begin_append(3));
    m.commit();
  }
  EXPECT_EQ(m.min_truncate_pos(), 0);  // nothing overwritten yet
  ASSERT_TRUE(m.truncate(2));
  ASSERT_TRUE(m.begin_append(1));
  EXPECT_EQ(m.kv_pos(), iota(0, 3));
}

TEST(KvRowMap, DiscardedAppendKeepsCommittedPositions) {
  KvRowMap m(100, 4, 0);
  ASSERT_TRUE(m.begin_append(4));
  m.commit();
  ASSERT_TRUE(m.begin_append(2));  // never committed (the step failed)
  ASSERT_TRUE(m.begin_append(1));
  EXPECT_EQ(m.append_pos(), iota(4, 5));
  m.commit();
  EXPECT_EQ(m.n_pos(), 5);
}

TEST(KvCache, CreateRejectsBadConfigs) {
  EXPECT_FALSE(KvCache::create({}));
  EXPECT_FALSE(KvCache::create({{{64, 0}}, 0, 4}));
  EXPECT_FALSE(KvCache::create({{{64, 0}}, 16, 0}));
  EXPECT_FALSE(KvCache::create({{{0, 0}}, 16, 4}));
  EXPECT_FALSE(KvCache::create({{{64, -1}}, 16, 4}));
  auto c = KvCache::create({{{64, 0}, {32, 8}}, 16, 4});
  ASSERT_TRUE(c) << c.error();
  EXPECT_EQ(c->n_layers(), 2);
  EXPECT_EQ(c->rows(1), 12);  // rings are allocated up front
}

TEST(KvCache, FullPlanesGrowAndKeepRows) {
  auto c = KvCache::create({{{4, 0}}, 2000, 512});
  ASSERT_TRUE(c);
  f16 marker = f32_to_f16(3.5f);
  for (int step = 0; step < 6; ++step) {
    ASSERT_TRUE(c->begin_append(300));
    for (int32_t r : c->append_rows(0))
      for (int j = 0; j < 4; ++j) c->k_plane(0)[size_t(r) * 4 + j] = f32_to_f16(float(r % 97));
    c->commit();
  }
  (void)marker;
  EXPECT_GE(c->rows(0), 1800);
  EXPECT_LE(c->rows(0), 2000);
  for (int32_t r = 0; r < 1800; ++r)
    ASSERT_EQ(f16_to_f32(c->k_plane(0)[size_t(r) * 4 + 3]), float(r % 97)) << r;
  EXPECT_FALSE(c->begin_append(201));
  ASSERT_TRUE(c->begin_append(200));
  EXPECT_EQ(c->rows(0), 2000);
}

TEST(KvCache, TruncateRefusalLeavesEveryLayerUnchanged) {
  auto c = KvCache::create({{{8, 0}, {8, 8}}, 200, 4});
  ASSERT_TRUE(c);
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(c->begin_append(4));
    c->commit();
  }
  EXPECT_FALSE(c->truncate(10));
  EXPECT_EQ(c->n_pos(), 80);
  EXPECT_EQ(c->row_map(0).n_pos(), 80);
  EXPECT_EQ(c->row_map(1).n_pos(), 80);
  ASSERT_TRUE(c->truncate(76));
  EXPECT_EQ(c->kv_pos(0).size(), 76u);
  c->clear();
  EXPECT_EQ(c->n_pos(), 0);
}

// Helpers for plane-level ring tests: value v written to every K column and -v to V.
void write_rows(KvCache& c, int layer, int64_t width, std::span<const int32_t> rows,
                std::span<const int32_t> pos, float offset) {
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t j = 0; j < width; ++j) {
      c.k_plane(layer)[size_t(rows[i] * width + j)] = f32_to_f16(float(pos[i]) + offset);
      c.v_plane(layer)[size_t(rows[i] * width + j)] = f32_to_f16(-(float(pos[i]) + offset));
    }
}
float k_at(const KvCache& c, int layer, int64_t width, int32_t row) {
  return f16_to_f32(c.k_plane(layer)[size_t(row * width)]);
}

TEST(KvCache, RingPrefillLongerThanWindowKeepsEveryWindow) {
  constexpr int64_t kW = 4;
  auto c = KvCache::create({{{kW, 6}}, 300, 32});
  ASSERT_TRUE(c);
  for (int round = 0; round < 8; ++round) {
    ASSERT_TRUE(c->begin_append(29));  // much longer than the window of 6
    write_rows(*c, 0, kW, c->append_rows(0), c->append_pos(), 0.0f);
    // After the batch's writes, every listed key still holds its own position's value:
    // the batch did not overwrite a key that one of its own queries needs.
    const auto pos = c->kv_pos(0), rows = c->kv_rows(0);
    ASSERT_EQ(pos.front(), std::max(0, c->n_pos() - 5));
    for (size_t i = 0; i < pos.size(); ++i)
      ASSERT_EQ(k_at(*c, 0, kW, rows[i]), float(pos[i])) << "round " << round << " pos " << pos[i];
    c->commit();
  }
  EXPECT_EQ(c->rows(0), 6 + 32);  // the ring never grows
}

TEST(KvCache, RollbackIntoWrappedRegionThenReappend) {
  constexpr int64_t kW = 2;
  auto c = KvCache::create({{{kW, 8}, {kW, 0}}, 500, 4});  // ring capacity 12
  ASSERT_TRUE(c);
  for (int i = 0; i < 10; ++i) {  // 40 positions: the ring wrapped three times
    ASSERT_TRUE(c->begin_append(4));
    for (int l = 0; l < 2; ++l) write_rows(*c, l, kW, c->append_rows(l), c->append_pos(), 0.0f);
    c->commit();
  }
  // Roll back 3 of the last batch's rows (they sit in rows that already wrapped), then
  // append different values for those positions: the next query must see the new ones
  // and the older part of its window unchanged.
  ASSERT_GE(38, c->min_truncate_pos());
  ASSERT_TRUE(c->truncate(37));
  ASSERT_TRUE(c->begin_append(3));
  EXPECT_EQ(c->append_rows(0)[0], 37 % 12);
  for (int l = 0; l < 2; ++l) write_rows(*c, l, kW, c->append_rows(l), c->append_pos(), 1000.0f);
  c->commit();
  ASSERT_TRUE(c->begin_append(1));
  for (int l = 0; l < 2; ++l) write_rows(*c, l, kW, c->append_rows(l), c->append_pos(), 1000.0f);
  for (int l = 0; l < 2; ++l) {
    const auto pos = c->kv_pos(l), rows = c->kv_rows(l);
    EXPECT_EQ(pos.front(), l == 0 ? 33 : 0);
    for (size_t i = 0; i < pos.size(); ++i) {
      const float want = float(pos[i]) + (pos[i] >= 37 ? 1000.0f : 0.0f);
      ASSERT_EQ(k_at(*c, l, kW, rows[i]), want) << "layer " << l << " pos " << pos[i];
    }
  }
  // Rolling back past the window's reach is refused, leaving the cache usable.
  EXPECT_FALSE(c->truncate(30));
  EXPECT_EQ(c->n_pos(), 40);
}

TEST(KvCache, PrematureReadOfRingRowIsCaught) {
  if (!kPoisonEnabled) GTEST_SKIP() << "needs a KILN_POISON build (debug/asan presets)";
  auto c = KvCache::create({{{4, 8}}, 64, 4});
  ASSERT_TRUE(c);
  EXPECT_EQ(c->k_plane(0)[0].bits, kPoisonF16);
  ASSERT_TRUE(c->begin_append(3));
  // Write K and V of the first two new rows only: the third is listed but never written.
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      c->k_plane(0)[size_t(c->append_rows(0)[i]) * 4 + j] = f32_to_f16(1.0f);
      c->v_plane(0)[size_t(c->append_rows(0)[i]) * 4 + j] = f32_to_f16(1.0f);
    }
  Status s = c->check_kv_rows_written(0);
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("row 2"), std::string::npos) << s.message();
  for (int j = 0; j < 4; ++j) {
    c->k_plane(0)[size_t(c->append_rows(0)[2]) * 4 + j] = f32_to_f16(1.0f);
    c->v_plane(0)[size_t(c->append_rows(0)[2]) * 4 + j] = f32_to_f16(1.0f);
  }
  EXPECT_TRUE(c->check_kv_rows_written(0));
}

// The naive model: every position's value kept forever. The cache under test must show,
// for every key it lists, exactly the value the naive model has for that position, and must
// list exactly the positions the window rule needs.
class NaiveCheck {
 public:
  NaiveCheck(int32_t window) : window_(window) {}
  void check(const KvCache& c, int layer, int32_t width, const std::map<int32_t, float>& vals) {
    const int32_t n_pos = c.n_pos(), end = n_pos + c.n_pending();
    std::span<const int32_t> pos = c.kv_pos(layer), rows = c.kv_rows(layer);
    ASSERT_EQ(pos.size(), rows.size());
    const int32_t first = window_ > 0 ? std::max(0, n_pos - window_ + 1) : 0;
    ASSERT_EQ(vec(pos), iota(first, end)) << "layer " << layer << " n_pos " << n_pos;
    for (size_t i = 0; i < pos.size(); ++i) {
      float got = f16_to_f32(c.k_plane(layer)[size_t(rows[i]) * size_t(width)]);
      float got_v = f16_to_f32(c.v_plane(layer)[size_t(rows[i]) * size_t(width) + width - 1]);
      ASSERT_EQ(got, vals.at(pos[i])) << "layer " << layer << " pos " << pos[i];
      ASSERT_EQ(got_v, -vals.at(pos[i]));
    }
  }

 private:
  int32_t window_;
};

void property_run(int32_t window, uint64_t seed) {
  constexpr int32_t kCtx = 600, kBatch = 6, kWidth = 8;
  auto c = KvCache::create({{{kWidth, 0}, {kWidth, window}}, kCtx, kBatch});
  ASSERT_TRUE(c);
  std::mt19937_64 rng(seed);
  std::map<int32_t, float> vals;  // naive: position -> value written for it
  NaiveCheck full(0), ring(window);
  int wraps = 0, rollbacks = 0, refused = 0;
  float next_value = 1;
  for (int step = 0; step < 400; ++step) {
    const uint64_t op = rng() % 10;
    if (op < 7) {
      const int32_t n = 1 + int32_t(rng() % kBatch);
      Status s = c->begin_append(n);
      if (c->n_pos() + n > kCtx) {
        ASSERT_FALSE(s);
        ASSERT_TRUE(c->truncate(0));
        vals.clear();
        continue;
      }
      ASSERT_TRUE(s) << s.message();
      for (int l = 0; l < 2; ++l) {
        std::span<const int32_t> rows = c->append_rows(l), pos = c->append_pos();
        for (size_t i = 0; i < rows.size(); ++i) {
          const float v = next_value + float(i);
          for (int j = 0; j < kWidth; ++j) {
            c->k_plane(l)[size_t(rows[i]) * kWidth + j] = f32_to_f16(v);
            c->v_plane(l)[size_t(rows[i]) * kWidth + j] = f32_to_f16(-v);
          }
          vals[pos[i]] = v;
        }
      }
      next_value = std::fmod(next_value + float(n), 1000.f);
      full.check(*c, 0, kWidth, vals);
      ring.check(*c, 1, kWidth, vals);
      if (rng() % 8 == 0) continue;  // abandon: the step "failed" before commit
      const int32_t before = c->n_pos();
      c->commit();
      if (before / c->row_map(1).capacity() != c->n_pos() / c->row_map(1).capacity()) ++wraps;
    } else {
      const int32_t back = int32_t(rng() % (kBatch + 8));
      const int32_t target = std::max(0, c->n_pos() - back);
      const bool allowed = target == 0 || target >= c->row_map(1).min_truncate_pos();
      Status s = c->truncate(target);
      ASSERT_EQ(bool(s), allowed) << s.message();
      if (s) {
        ++rollbacks;
        for (auto it = vals.lower_bound(target); it != vals.end();) it = vals.erase(it);
      } else {
        ++refused;
      }
    }
    // With nothing pending, the lists describe the next query's keys.
    if (c->n_pending() == 0) {
      full.check(*c, 0, kWidth, vals);
      ring.check(*c, 1, kWidth, vals);
    }
  }
  EXPECT_GT(wraps, 10) << "the ring must wrap many times";
  EXPECT_GT(rollbacks, 20);
  EXPECT_GT(refused, 0);
}

// copy_prefix (n > 1 choices sharing one prefill): the copy holds the source's first n
// positions, and every key its next query may see (full layer and ring) holds that position's
// value; a ring that no longer retains the window of position n refuses, leaving the copy
// empty; so does a cache of another geometry.
TEST(KvCache, CopyPrefixHoldsTheSourcesRows) {
  constexpr int32_t kCtx = 600, kBatch = 6, kWidth = 8, kWindow = 8;
  const KvConfig cfg{{{kWidth, 0}, {kWidth, kWindow}}, kCtx, kBatch};
  auto src = KvCache::create(cfg);
  auto dst = KvCache::create(cfg);
  ASSERT_TRUE(src && dst);
  auto value = [](int32_t pos) { return float(pos % 1000) + 0.5f; };
  std::mt19937_64 rng(5);
  int copied = 0, refused = 0;
  while (src->n_pos() < 150) {
    const int32_t n = 1 + int32_t(rng() % kBatch);
    ASSERT_TRUE(src->begin_append(n));
    for (int l = 0; l < 2; ++l)
      for (size_t i = 0; i < size_t(n); ++i)
        for (int j = 0; j < kWidth; ++j) {
          const size_t at = size_t(src->append_rows(l)[i]) * kWidth + j;
          src->k_plane(l)[at] = f32_to_f16(value(src->append_pos()[i]));
          src->v_plane(l)[at] = f32_to_f16(-value(src->append_pos()[i]));
        }
    src->commit();
    const int32_t back = int32_t(rng() % 14);
    const int32_t want = std::max(0, src->n_pos() - back);
    Status st = dst->copy_prefix(*src, want);
    if (!st) {
      ++refused;
      EXPECT_EQ(dst->n_pos(), 0) << st.message();
      continue;
    }
    ASSERT_EQ(dst->n_pos(), want);
    if (want == 0) continue;
    ++copied;
    // The next query's keys, then one more appended position's.
    for (int l = 0; l < 2; ++l) {
      const auto pos = dst->kv_pos(l), rows = dst->kv_rows(l);
      EXPECT_EQ(pos.back(), want - 1);
      if (l == 0) EXPECT_EQ(pos.size(), size_t(want));
      if (l == 1) EXPECT_EQ(pos.front(), std::max(0, want - kWindow + 1));
      for (size_t i = 0; i < pos.size(); ++i) {
        ASSERT_EQ(k_at(*dst, l, kWidth, rows[i]), value(pos[i])) << "layer " << l;
        ASSERT_EQ(f16_to_f32(dst->v_plane(l)[size_t(rows[i]) * kWidth]), -value(pos[i]));
      }
    }
    ASSERT_TRUE(dst->begin_append(1));
    EXPECT_EQ(dst->append_pos()[0], want);
    dst->commit();
  }
  EXPECT_GT(copied, 5);
  EXPECT_GT(refused, 0);  // a prefix ending before the ring's retained window
  auto other = KvCache::create({{{kWidth, 0}, {kWidth, kWindow + 1}}, kCtx, kBatch});
  ASSERT_TRUE(other);
  EXPECT_FALSE(other->copy_prefix(*src, 3));
  EXPECT_EQ(other->n_pos(), 0);
  EXPECT_FALSE(dst->copy_prefix(*src, src->n_pos() + 1));
}

TEST(KvCache, PropertyVsNaiveWindow8) {
  for (uint64_t seed = 1; seed <= 6; ++seed) property_run(8, seed);
}
TEST(KvCache, PropertyVsNaiveWindow16) {
  for (uint64_t seed = 11; seed <= 16; ++seed) property_run(16, seed);
}

}  // namespace
}  // namespace kiln
