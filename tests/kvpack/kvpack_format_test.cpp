// tests/kvpack/kvpack_format_test.cpp: the kvpack format on synthetic caches: round trips
// (full and ring layers, smaller and larger consumer rings), identity refusals naming the
// field, every flipped byte and every truncation detected, byte-at-a-time parsing.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "kv/kvpack.h"

namespace kiln::kvpack {
namespace {

// Full, ring (window 4), NoPE full, ring: the layer kinds a real model mixes; and a K-only
// layer of another width (latent attention's rows, no V plane).
std::vector<LayerKind> kinds() {
  return {{.width = 8, .window = 0, .rope = true},
          {.width = 8, .window = 4, .rope = true},
          {.width = 8, .window = 0, .rope = false},
          {.width = 8, .window = 4, .rope = true},
          {.width = 12, .window = 0, .rope = true, .k_only = true}};
}
Identity ident() {
  return {.engine_abi = 3,
          .kv_dtype = uint32_t(DType::F16),
          .model = 0x1111,
          .tokenizer = 0x2222,
          .chat_template = 0x3333};
}
KvConfig config(int32_t n_ctx, int32_t max_batch) {
  KvConfig c;
  c.n_ctx = n_ctx;
  c.max_batch = max_batch;
  for (const LayerKind& k : kinds())
    c.layers.push_back({.width = k.width, .window = k.window, .k_only = k.k_only});
  return c;
}

// The value stored for (layer, plane, pos, element): distinct everywhere, so a row written to
// the wrong place or from the wrong position shows.
uint16_t value(int layer, int plane, int32_t pos, int64_t e) {
  return uint16_t(0x3C00 ^ (layer * 977 + plane * 31 + pos * 7 + int(e)) % 0x3000);
}

// A cache filled to n_pos in appends of `chunk`, then rolled back by `rollback` positions.
KvCache filled(int32_t n_ctx, int32_t max_batch, int32_t n_pos, int32_t chunk,
               int32_t rollback = 0) {
  auto c = KvCache::create(config(n_ctx, max_batch));
  EXPECT_TRUE(c.has_value()) << c.error();
  for (int32_t done = 0; done < n_pos;) {
    const int32_t n = std::min(chunk, n_pos - done);
    EXPECT_TRUE(c->begin_append(n));
    for (int l = 0; l < c->n_layers(); ++l) {
      auto rows = c->append_rows(l);
      for (int pl = 0; pl < (c->k_only(l) ? 1 : 2); ++pl) {
        std::span<f16> p = pl ? c->v_plane(l) : c->k_plane(l);
        for (int i = 0; i < n; ++i)
          for (int64_t e = 0; e < c->width(l); ++e)
            p[size_t(rows[size_t(i)]) * size_t(c->width(l)) + size_t(e)].bits =
                value(l, pl, done + i, e);
      }
    }
    c->commit();
    done += n;
  }
  if (rollback) {
    EXPECT_TRUE(c->truncate(n_pos - rollback));
  }
  return std::move(*c);
}

// Every retained position of b holds the value the generator wrote, and b's row maps agree
// with a's where both retain.
void expect_same_content(const KvCache& a, const KvCache& b) {
  ASSERT_EQ(a.n_pos(), b.n_pos());
  for (int l = 0; l < a.n_layers(); ++l) {
    const KvRowMap& mb = b.row_map(l);
    EXPECT_GE(mb.lo(), a.row_map(l).lo()) << "layer " << l;
    for (int32_t pos = mb.lo(); pos < b.n_pos(); ++pos)
      for (int pl = 0; pl < (b.k_only(l) ? 1 : 2); ++pl) {
        std::span<const f16> p = pl ? b.v_plane(l) : b.k_plane(l);
        for (int64_t e = 0; e < b.width(l); ++e)
          ASSERT_EQ(p[size_t(mb.row_of(pos)) * size_t(b.width(l)) + size_t(e)].bits,
                    value(l, pl, pos, e))
              << "layer " << l << " plane " << pl << " pos " << pos;
      }
    EXPECT_EQ(std::vector<int32_t>(a.kv_pos(l).begin(), a.kv_pos(l).end()),
              std::vector<int32_t>(b.kv_pos(l).begin(), b.kv_pos(l).end()))
        << "layer " << l;
  }
}

std::vector<uint8_t> pack_of(const KvCache& c, int32_t tile_rows = 5) {
  auto p = save(c, ident(), kinds(), tile_rows);
  EXPECT_TRUE(p.has_value()) << p.error();
  return p.has_value() ? *p : std::vector<uint8_t>{};
}

Expected<KvCache> load_into(std::span<const uint8_t> pack, int32_t n_ctx, int32_t max_batch,
                            Identity id = ident()) {
  auto fresh = KvCache::create(config(n_ctx, max_batch));
  if (!fresh) return fresh.status();
  auto k = kinds();
  return load(pack, id, k, std::move(*fresh));
}

TEST(Kvpack, RoundTripSameGeometry) {
  for (int32_t n_pos : {0, 1, 3, 4, 9, 23, 40}) {
    KvCache src = filled(64, 4, n_pos, 3);
    std::vector<uint8_t> pack = pack_of(src);
    auto dst = load_into(pack, 64, 4);
    ASSERT_TRUE(dst.has_value()) << "n_pos " << n_pos << ": " << dst.error();
    expect_same_content(src, *dst);
    for (int l = 0; l < src.n_layers(); ++l)
      EXPECT_EQ(src.row_map(l).lo(), dst->row_map(l).lo()) << "n_pos " << n_pos;
  }
}

TEST(Kvpack, RoundTripAfterRollbackAndAcrossRingSizes) {
  // Producer ring capacity 4 + 6 = 10; consumers with a ring of 4 + 2 = 6 (keeps fewer rows)
  // and 4 + 16 = 20 (keeps all the producer sent). Both must continue identically: same
  // visible keys for the next query.
  KvCache src = filled(64, 6, 37, 5, /*rollback=*/2);
  std::vector<uint8_t> pack = pack_of(src, 4);
  for (int32_t mb : {2, 6, 16}) {
    auto dst = load_into(pack, 64, mb);
    ASSERT_TRUE(dst.has_value()) << "max_batch " << mb << ": " << dst.error();
    expect_same_content(src, *dst);
    // The consumer continues appending like any cache.
    ASSERT_TRUE(dst->begin_append(2));
    dst->commit();
    EXPECT_EQ(dst->n_pos(), 37);
  }
}

TEST(Kvpack, ByteAtATimeEqualsWhole) {
  KvCache src = filled(32, 4, 13, 4);
  std::vector<uint8_t> pack = pack_of(src, 3);
  int headers = 0, tiles = 0;
  Parser p(
      [&](const Header& h) {
        ++headers;
        EXPECT_EQ(h.n_pos, 13);
        return Status::ok();
      },
      [&](const Tile&) {
        ++tiles;
        return Status::ok();
      });
  for (size_t i = 0; i < pack.size(); ++i) {
    ASSERT_FALSE(p.done());
    ASSERT_TRUE(p.push({&pack[i], 1}));
  }
  ASSERT_TRUE(p.finish()) << p.finish().message();
  EXPECT_EQ(headers, 1);
  // Full layers (3 of them, one K-only): 13 rows in tiles of 3 (5 tiles); rings (capacity 4 +
  // 4) keep rows 5..12 (3).
  EXPECT_EQ(src.row_map(1).lo(), 5);
  EXPECT_EQ(tiles, 3 * 5 + 2 * 3);
  EXPECT_FALSE(p.push(std::span<const uint8_t>(pack.data(), 1)));  // bytes after the end
}

TEST(Kvpack, RefusesAnotherProducerNamingTheField) {
  KvCache src = filled(32, 4, 10, 4);
  const std::vector<uint8_t> pack = pack_of(src);
  struct Case {
    const char* field;
    Identity id;
  };
  std::vector<Case> cases;
  Identity i = ident();
  i.model ^= 1;
  cases.push_back({"model fingerprint", i});
  i = ident();
  i.tokenizer ^= 1;
  cases.push_back({"tokenizer hash", i});
  i = ident();
  i.chat_template ^= 1;
  cases.push_back({"chat template hash", i});
  i = ident();
  i.kv_dtype = uint32_t(DType::BF16);
  cases.push_back({"KV dtype", i});
  i = ident();
  i.engine_abi += 1;
  cases.push_back({"engine ABI version", i});
  for (const Case& c : cases) {
    auto r = load_into(pack, 32, 4, c.id);
    ASSERT_FALSE(r.has_value()) << c.field;
    EXPECT_NE(r.error().find(c.field), std::string::npos) << r.error();
    EXPECT_EQ(r.error().find('\n'), std::string::npos);
  }
  // Layer kinds: a consumer whose layer 2 is RoPE, or whose layer 1 has another window.
  for (int variant = 0; variant < 4; ++variant) {
    std::vector<LayerKind> k = kinds();
    KvConfig cfg = config(32, 4);
    std::string field;
    if (variant == 0) k[2].rope = true, field = "layer 2 kind";
    if (variant == 1) k[1].window = cfg.layers[1].window = 5, field = "layer 1 window";
    if (variant == 2) k[3].width = cfg.layers[3].width = 16, field = "layer 3 KV width";
    if (variant == 3) k[4].k_only = cfg.layers[4].k_only = false, field = "layer 4 planes";
    auto fresh = KvCache::create(cfg);
    ASSERT_TRUE(fresh.has_value());
    auto r = load(pack, ident(), k, std::move(*fresh));
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().find(field), std::string::npos) << r.error();
  }
}

TEST(Kvpack, EveryFlippedByteIsDetected) {
  KvCache src = filled(16, 2, 7, 2);
  const std::vector<uint8_t> pack = pack_of(src, 3);
  ASSERT_TRUE(load_into(pack, 16, 2).has_value());
  for (size_t i = 0; i < pack.size(); ++i) {
    for (uint8_t mask : {uint8_t(0x01), uint8_t(0x80)}) {
      std::vector<uint8_t> bad = pack;
      bad[i] ^= mask;
      auto r = load_into(bad, 16, 2);
      ASSERT_FALSE(r.has_value()) << "flip of byte " << i << " mask " << int(mask) << " of "
                                  << pack.size() << " went unnoticed";
    }
  }
}

TEST(Kvpack, EveryTruncationIsDetected) {
  KvCache src = filled(16, 2, 7, 2);
  const std::vector<uint8_t> pack = pack_of(src, 3);
  for (size_t n = 0; n < pack.size(); ++n) {
    auto r = load_into({pack.data(), n}, 16, 2);
    ASSERT_FALSE(r.has_value()) << "a pack cut to " << n << " of " << pack.size()
                                << " bytes was accepted";
  }
}

TEST(Kvpack, RefusesPackLongerThanTheSlot) {
  KvCache src = filled(64, 4, 40, 4);
  auto r = load_into(pack_of(src), 32, 4);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().find("context"), std::string::npos) << r.error();
}

TEST(Kvpack, WriterRefusesRowsTheCacheNoLongerHolds) {
  KvCache src = filled(64, 4, 30, 4);
  auto h = header_for(src, ident(), kinds());
  ASSERT_TRUE(h.has_value());
  h->lo[1] = h->lo[3] = 0;  // claim ring rows that were overwritten long ago
  Writer w([](std::span<const uint8_t>) { return Status::ok(); });
  ASSERT_TRUE(w.header(*h));
  Status s = w.tile(src, 1, 0, 4);
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("not retained"), std::string::npos) << s.message();
  EXPECT_FALSE(w.finish());  // layers incomplete
}

TEST(KvCacheRestore, RefusesImpossibleStates) {
  auto c = KvCache::create(config(64, 4));
  ASSERT_TRUE(c.has_value());
  std::vector<int32_t> lo = {0, 0, 0, 0, 0};
  EXPECT_FALSE(c->restore(20, lo));  // ring of capacity 8 cannot hold 20 rows
  lo = {1, 12, 0, 12, 0};
  EXPECT_FALSE(c->restore(20, lo));  // a full layer retains from 0
  lo = {0, 12, 0, 13, 0};
  EXPECT_FALSE(c->restore(20, lo));  // two layers of one window disagree
  lo = {0, 18, 0, 18, 0};
  EXPECT_FALSE(c->restore(20, lo));  // position 20 needs keys from 17
  EXPECT_EQ(c->n_pos(), 0);
  lo = {0, 12, 0, 12, 0};
  ASSERT_TRUE(c->restore(20, lo));
  EXPECT_EQ(c->n_pos(), 20);
  EXPECT_FALSE(c->restore(20, lo));  // only on a fresh cache
}

}  // namespace
}  // namespace kiln::kvpack
