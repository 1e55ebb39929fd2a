// kv/kvpack.cpp: kvpack writer, incremental parser and installer (layout: docs/kvpack.md).
#include "kv/kvpack.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <optional>

#include "core/check.h"
#include "kv/wire.h"
#include "core/dtype.h"

namespace kiln::kvpack {

// The format is little-endian; rows are copied as they sit in the planes.
static_assert(std::endian::native == std::endian::little, "kvpack assumes a little-endian host");

namespace {

constexpr char kMagicHeader[4] = {'K', 'V', 'P', 'K'};
constexpr char kMagicTile[4] = {'T', 'I', 'L', 'E'};
constexpr char kMagicEnd[4] = {'K', 'E', 'N', 'D'};
constexpr size_t kFixedBytes = 56;     // header before the layer table
constexpr size_t kLayerBytes = 24;     // one layer-table entry
constexpr size_t kTileHeadBytes = 20;  // magic, layer, first_pos, n_rows, reserved
constexpr size_t kTrailerBytes = 16;   // magic, n_tiles, digest
constexpr uint32_t kFlagRope = 1;
constexpr uint32_t kFlagKOnly = 2;

using wire::put;
void put_magic(std::vector<uint8_t>& out, const char (&m)[4]) { out.insert(out.end(), m, m + 4); }
using wire::get;
bool is_magic(const uint8_t* p, const char (&m)[4]) { return std::memcmp(p, m, 4) == 0; }

uint64_t hash(std::span<const uint8_t> b) { return XXH3_64bits(b.data(), b.size()); }
size_t row_bytes(int64_t width) { return static_cast<size_t>(width) * sizeof(f16); }
// Planes a layer's tiles carry per row: K and V, or K alone.
size_t n_planes(const LayerKind& k) { return k.k_only ? 1 : 2; }

std::vector<uint8_t> encode_header(const Header& h) {
  std::vector<uint8_t> out;
  out.reserve(kFixedBytes + kLayerBytes * h.layers.size() + 8);
  put_magic(out, kMagicHeader);
  put<uint32_t>(out, kFormatVersion);
  put<uint32_t>(out, static_cast<uint32_t>(h.layers.size()));
  put<uint32_t>(out, h.id.engine_abi);
  put<uint32_t>(out, h.id.kv_dtype);
  put<int32_t>(out, h.n_pos);
  put<uint64_t>(out, h.id.model);
  put<uint64_t>(out, h.id.tokenizer);
  put<uint64_t>(out, h.id.chat_template);
  put<uint64_t>(out, 0);  // reserved
  for (size_t l = 0; l < h.layers.size(); ++l) {
    put<int64_t>(out, h.layers[l].width);
    put<int32_t>(out, h.layers[l].window);
    put<uint32_t>(out, (h.layers[l].rope ? kFlagRope : 0) | (h.layers[l].k_only ? kFlagKOnly : 0));
    put<int32_t>(out, h.lo[l]);
    put<uint32_t>(out, 0);  // reserved
  }
  put<uint64_t>(out, hash(out));
  return out;
}

std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }

}  // namespace

namespace {
// The running digest over every byte of the stream before the trailer's digest field.
struct XxhStream {
  XXH3_state_t* s = XXH3_createState();
  XxhStream() {
    KILN_CHECK(s != nullptr);
    XXH3_64bits_reset(s);
  }
  ~XxhStream() { XXH3_freeState(s); }
  XxhStream(const XxhStream&) = delete;
  XxhStream& operator=(const XxhStream&) = delete;
  void update(std::span<const uint8_t> b) { XXH3_64bits_update(s, b.data(), b.size()); }
  uint64_t digest() const { return XXH3_64bits_digest(s); }
};
}  // namespace
struct Writer::HashState : XxhStream {};
struct Parser::HashState : XxhStream {};

// ---------------------------------------------------------------- identity

Status check_compatible(const Header& pack, const Identity& mine,
                        std::span<const LayerKind> layers) {
  auto differs = [](std::string_view field, auto theirs, auto ours) {
    return Status::errorf("kvpack refused: {} differs (pack {}, this engine {})", field, theirs,
                          ours);
  };
  if (pack.id.engine_abi != mine.engine_abi)
    return differs("engine ABI version", pack.id.engine_abi, mine.engine_abi);
  if (pack.id.kv_dtype != mine.kv_dtype)
    return differs("KV dtype", pack.id.kv_dtype, mine.kv_dtype);
  if (pack.id.model != mine.model)
    return differs("model fingerprint", hex(pack.id.model), hex(mine.model));
  if (pack.id.tokenizer != mine.tokenizer)
    return differs("tokenizer hash", hex(pack.id.tokenizer), hex(mine.tokenizer));
  if (pack.id.chat_template != mine.chat_template)
    return differs("chat template hash", hex(pack.id.chat_template), hex(mine.chat_template));
  if (pack.layers.size() != layers.size())
    return differs("layer count", pack.layers.size(), layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerKind &a = pack.layers[l], &b = layers[l];
    if (a.width != b.width) return differs(fmt::format("layer {} KV width", l), a.width, b.width);
    if (a.window != b.window) return differs(fmt::format("layer {} window", l), a.window, b.window);
    if (a.rope != b.rope)
      return differs(fmt::format("layer {} kind", l), a.rope ? "RoPE" : "NoPE",
                     b.rope ? "RoPE" : "NoPE");
    if (a.k_only != b.k_only)
      return differs(fmt::format("layer {} planes", l), a.k_only ? "K" : "K+V",
                     b.k_only ? "K" : "K+V");
  }
  return Status::ok();
}

Expected<Header> header_for(const KvCache& cache, const Identity& id,
                            std::span<const LayerKind> layers) {
  if (static_cast<size_t>(cache.n_layers()) != layers.size())
    return Status::errorf("kvpack: cache has {} layers, the producer describes {}",
                          cache.n_layers(), layers.size());
  Header h;
  h.id = id;
  h.n_pos = cache.n_pos();
  h.layers.assign(layers.begin(), layers.end());
  for (int l = 0; l < cache.n_layers(); ++l) {
    if (cache.width(l) != layers[size_t(l)].width || cache.window(l) != layers[size_t(l)].window ||
        cache.k_only(l) != layers[size_t(l)].k_only)
      return Status::errorf(
          "kvpack: layer {} of the cache (width {}, window {}, k_only {}) does not match "
          "the producer's (width {}, window {}, k_only {})",
          l, cache.width(l), cache.window(l), cache.k_only(l), layers[size_t(l)].width,
          layers[size_t(l)].window, layers[size_t(l)].k_only);
    h.lo.push_back(cache.row_map(l).lo());
  }
  return h;
}

// ---------------------------------------------------------------- Writer

Writer::Writer(Sink sink) : sink_(std::move(sink)), hash_(std::make_shared<HashState>()) {}

Status Writer::emit(std::span<const uint8_t> bytes) {
  hash_->update(bytes);
  bytes_ += bytes.size();
  return sink_(bytes);
}

Status Writer::header(const Header& h) {
  if (started_) return Status::error("kvpack writer: header written twice");
  if (h.layers.empty() || h.layers.size() > kMaxLayers || h.lo.size() != h.layers.size())
    return Status::errorf("kvpack writer: {} layers, {} origins", h.layers.size(), h.lo.size());
  if (h.n_pos < 0 || h.n_pos > kMaxPositions)
    return Status::errorf("kvpack writer: {} positions outside [0, {}]", h.n_pos, kMaxPositions);
  h_ = h;
  next_ = h.lo;
  started_ = true;
  return emit(encode_header(h));
}

Status Writer::tile(const KvCache& cache, int layer, int32_t first_pos, int32_t n_rows) {
  if (!started_ || finished_) return Status::error("kvpack writer: tile outside header..finish");
  if (layer < 0 || layer >= static_cast<int>(h_.layers.size()) || layer >= cache.n_layers())
    return Status::errorf("kvpack writer: layer {} out of range", layer);
  const size_t L = size_t(layer);
  if (n_rows <= 0 || first_pos != next_[L] || int64_t(first_pos) + n_rows > h_.n_pos)
    return Status::errorf("kvpack writer: layer {} tile [{}, +{}) must start at {} and end by {}",
                          layer, first_pos, n_rows, next_[L], h_.n_pos);
  const KvRowMap& map = cache.row_map(layer);
  if (first_pos < map.lo() || first_pos + n_rows > map.n_pos())
    return Status::errorf(
        "kvpack writer: layer {} rows [{}, {}) not retained (cache holds [{}, "
        "{}))",
        layer, first_pos, first_pos + n_rows, map.lo(), map.n_pos());
  const int64_t width = h_.layers[L].width;
  if (cache.width(layer) != width)
    return Status::errorf("kvpack writer: layer {} width {} != header {}", layer,
                          cache.width(layer), width);
  const size_t rb = row_bytes(width);
  std::vector<uint8_t> out;
  out.reserve(kTileHeadBytes + n_planes(h_.layers[L]) * rb * size_t(n_rows) + 8);
  put_magic(out, kMagicTile);
  put<uint32_t>(out, uint32_t(layer));
  put<int32_t>(out, first_pos);
  put<int32_t>(out, n_rows);
  put<uint32_t>(out, 0);
  std::vector<std::span<const f16>> planes = {cache.k_plane(layer)};
  if (!h_.layers[L].k_only) planes.push_back(cache.v_plane(layer));
  for (std::span<const f16> plane : planes) {
    if (!cache.on_device()) {
      for (int32_t p = first_pos; p < first_pos + n_rows; ++p) {
        const size_t row = size_t(map.row_of(p));
        const auto* src = reinterpret_cast<const uint8_t*>(plane.data() + row * size_t(width));
        out.insert(out.end(), src, src + rb);
      }
      continue;
    }
    // Device planes (a prefill node on a GPU): host code must not read them, so each run of
    // consecutive physical rows (one for a full layer, at most two where a ring wraps) comes
    // down through the backend, which also waits for the step that wrote them.
    for (int32_t p = first_pos; p < first_pos + n_rows;) {
      const int32_t row0 = map.row_of(p);
      int32_t run = 1;
      while (p + run < first_pos + n_rows && map.row_of(p + run) == row0 + run) ++run;
      const size_t at = out.size();
      out.resize(at + rb * size_t(run));
      const std::span<const f16> src =
          plane.subspan(size_t(row0) * size_t(width), size_t(run) * size_t(width));
      std::span<f16> dst(reinterpret_cast<f16*>(out.data() + at), src.size());
      cache.backend()->download(src, dst);
      p += run;
    }
  }
  put<uint64_t>(out, hash(out));
  next_[L] = first_pos + n_rows;
  ++n_tiles_;
  return emit(out);
}

Status Writer::finish() {
  if (!started_ || finished_) return Status::error("kvpack writer: finish outside header..");
  for (size_t l = 0; l < next_.size(); ++l)
    if (next_[l] != h_.n_pos)
      return Status::errorf("kvpack writer: layer {} has rows up to {} of {}", l, next_[l],
                            h_.n_pos);
  std::vector<uint8_t> out;
  put_magic(out, kMagicEnd);
  put<uint32_t>(out, n_tiles_);
  hash_->update(out);
  put<uint64_t>(out, hash_->digest());
  finished_ = true;
  bytes_ += out.size();
  return sink_(out);
}

Expected<std::vector<uint8_t>> save(const KvCache& cache, const Identity& id,
                                    std::span<const LayerKind> layers, int32_t max_tile_rows) {
  KILN_ASSIGN_OR_RETURN(Header h, header_for(cache, id, layers));
  std::vector<uint8_t> pack;
  Writer w([&](std::span<const uint8_t> b) {
    pack.insert(pack.end(), b.begin(), b.end());
    return Status::ok();
  });
  KILN_TRY(w.header(h));
  const int32_t step = std::max(1, max_tile_rows);
  for (int l = 0; l < cache.n_layers(); ++l)
    for (int32_t p = h.lo[size_t(l)]; p < h.n_pos; p += step)
      KILN_TRY(w.tile(cache, l, p, std::min(step, h.n_pos - p)));
  KILN_TRY(w.finish());
  return pack;
}

// ---------------------------------------------------------------- Parser

Parser::Parser(HeaderFn on_header, TileFn on_tile)
    : on_header_(std::move(on_header)),
      on_tile_(std::move(on_tile)),
      need_(kFixedBytes),
      hash_(std::make_shared<HashState>()) {}

Status Parser::fail(Status s) {
  state_ = State::Failed;
  error_ = s.context(fmt::format("kvpack byte {}", consumed_ - buf_.size()));
  buf_.clear();
  buf_.shrink_to_fit();
  return error_;
}

Status Parser::push(std::span<const uint8_t> bytes) {
  while (!bytes.empty()) {
    if (state_ == State::Failed) return error_;
    if (state_ == State::Done)
      return fail(Status::errorf("{} bytes after the end of the pack", bytes.size()));
    const size_t take = std::min(need_ - buf_.size(), bytes.size());
    buf_.insert(buf_.end(), bytes.begin(), bytes.begin() + static_cast<ptrdiff_t>(take));
    bytes = bytes.subspan(take);
    consumed_ += take;
    if (buf_.size() == need_) {
      if (Status s = step(); !s) return fail(s);
    }
  }
  return state_ == State::Failed ? error_ : Status::ok();
}

Status Parser::step() {
  const uint8_t* b = buf_.data();
  switch (state_) {
    case State::Fixed: {
      if (!is_magic(b, kMagicHeader)) return Status::error("not a kvpack (bad magic)");
      const uint32_t version = get<uint32_t>(b + 4);
      if (version != kFormatVersion)
        return Status::errorf("kvpack format version {}, this build reads version {}", version,
                              kFormatVersion);
      const uint32_t n_layer = get<uint32_t>(b + 8);
      if (n_layer == 0 || n_layer > kMaxLayers)
        return Status::errorf("kvpack header: {} layers outside [1, {}]", n_layer, kMaxLayers);
      h_.id.engine_abi = get<uint32_t>(b + 12);
      h_.id.kv_dtype = get<uint32_t>(b + 16);
      h_.n_pos = get<int32_t>(b + 20);
      if (h_.n_pos < 0 || h_.n_pos > kMaxPositions)
        return Status::errorf("kvpack header: {} positions outside [0, {}]", h_.n_pos,
                              kMaxPositions);
      h_.id.model = get<uint64_t>(b + 24);
      h_.id.tokenizer = get<uint64_t>(b + 32);
      h_.id.chat_template = get<uint64_t>(b + 40);
      if (get<uint64_t>(b + 48) != 0) return Status::error("kvpack header: reserved bytes set");
      h_.layers.resize(n_layer);
      h_.lo.resize(n_layer);
      state_ = State::Layers;
      need_ = kFixedBytes + kLayerBytes * n_layer + 8;
      return Status::ok();
    }
    case State::Layers: {
      const size_t body = need_ - 8;
      if (hash({b, body}) != get<uint64_t>(b + body))
        return Status::error("kvpack header checksum mismatch");
      for (size_t l = 0; l < h_.layers.size(); ++l) {
        const uint8_t* e = b + kFixedBytes + kLayerBytes * l;
        LayerKind& k = h_.layers[l];
        k.width = get<int64_t>(e);
        k.window = get<int32_t>(e + 8);
        const uint32_t flags = get<uint32_t>(e + 12);
        h_.lo[l] = get<int32_t>(e + 16);
        if (k.width <= 0 || k.width > kMaxWidth)
          return Status::errorf("kvpack layer {}: width {} outside [1, {}]", l, k.width, kMaxWidth);
        if (k.window < 0) return Status::errorf("kvpack layer {}: window {} < 0", l, k.window);
        if ((flags & ~(kFlagRope | kFlagKOnly)) != 0 || get<uint32_t>(e + 20) != 0)
          return Status::errorf("kvpack layer {}: unknown flags {:#x}", l, flags);
        k.rope = (flags & kFlagRope) != 0;
        k.k_only = (flags & kFlagKOnly) != 0;
        if (h_.lo[l] < 0 || h_.lo[l] > h_.n_pos || (k.window == 0 && h_.lo[l] != 0))
          return Status::errorf(
              "kvpack layer {}: oldest position {} invalid (window {}, {} "
              "positions)",
              l, h_.lo[l], k.window, h_.n_pos);
        for (size_t j = 0; j < l; ++j)
          if (h_.layers[j].window == k.window && h_.lo[j] != h_.lo[l])
            return Status::errorf(
                "kvpack layer {}: oldest position {} differs from layer {} "
                "({}) of the same window",
                l, h_.lo[l], j, h_.lo[j]);
      }
      hash_->update(buf_);
      next_ = h_.lo;
      if (on_header_) KILN_TRY(on_header_(h_));
      buf_.clear();
      state_ = State::TileMagic;
      need_ = 4;
      return Status::ok();
    }
    case State::TileMagic:
      if (is_magic(b, kMagicTile)) {
        state_ = State::TileHead;
        need_ = kTileHeadBytes;
      } else if (is_magic(b, kMagicEnd)) {
        state_ = State::Trailer;
        need_ = kTrailerBytes;
      } else {
        return Status::error("expected a tile or the trailer (bad magic)");
      }
      return Status::ok();
    case State::TileHead: {
      const uint32_t layer = get<uint32_t>(b + 4);
      const int32_t first = get<int32_t>(b + 8);
      const int32_t n_rows = get<int32_t>(b + 12);
      if (layer >= h_.layers.size())
        return Status::errorf("tile layer {} outside [0, {})", layer, h_.layers.size());
      if (get<uint32_t>(b + 16) != 0) return Status::error("tile reserved bytes set");
      if (n_rows <= 0 || first != next_[layer] || int64_t(first) + n_rows > h_.n_pos)
        return Status::errorf("tile of layer {} holds [{}, +{}), expected rows from {} up to {}",
                              layer, first, n_rows, next_[layer], h_.n_pos);
      cur_.layer = static_cast<int>(layer);
      cur_.first_pos = first;
      cur_.n_rows = n_rows;
      // Bounded: n_rows <= kMaxPositions, width <= kMaxWidth; bytes are buffered as they come.
      need_ = kTileHeadBytes +
              n_planes(h_.layers[layer]) * row_bytes(h_.layers[layer].width) * size_t(n_rows) + 8;
      state_ = State::TileBody;
      return Status::ok();
    }
    case State::TileBody: {
      const size_t body = need_ - 8;
      if (hash({b, body}) != get<uint64_t>(b + body))
        return Status::errorf("tile of layer {} rows [{}, +{}): checksum mismatch", cur_.layer,
                              cur_.first_pos, cur_.n_rows);
      hash_->update(buf_);
      const size_t plane = (body - kTileHeadBytes) / n_planes(h_.layers[size_t(cur_.layer)]);
      cur_.k = {b + kTileHeadBytes, plane};
      cur_.v = h_.layers[size_t(cur_.layer)].k_only
                   ? std::span<const uint8_t>()
                   : std::span<const uint8_t>(b + kTileHeadBytes + plane, plane);
      next_[size_t(cur_.layer)] = cur_.first_pos + cur_.n_rows;
      ++n_tiles_;
      if (on_tile_) KILN_TRY(on_tile_(cur_));
      cur_.k = cur_.v = {};
      buf_.clear();
      state_ = State::TileMagic;
      need_ = 4;
      return Status::ok();
    }
    case State::Trailer: {
      hash_->update({b, 8});
      if (get<uint64_t>(b + 8) != hash_->digest()) return Status::error("kvpack digest mismatch");
      if (get<uint32_t>(b + 4) != n_tiles_)
        return Status::errorf("trailer counts {} tiles, {} arrived", get<uint32_t>(b + 4),
                              n_tiles_);
      for (size_t l = 0; l < next_.size(); ++l)
        if (next_[l] != h_.n_pos)
          return Status::errorf("layer {} ends at position {}, the pack holds {}", l, next_[l],
                                h_.n_pos);
      buf_.clear();
      state_ = State::Done;
      return Status::ok();
    }
    case State::Done:
    case State::Failed:
      break;
  }
  KILN_CHECK(false, "kvpack parser stepped in a final state");
  return Status::ok();
}

Status Parser::finish() const {
  if (state_ == State::Done) return Status::ok();
  if (state_ == State::Failed) return error_;
  const char* what = state_ == State::Fixed || state_ == State::Layers ? "the header"
                     : state_ == State::Trailer                        ? "the trailer"
                                                                       : "a tile";
  return Status::errorf("kvpack truncated after {} bytes (in {})", consumed_, what);
}

// ---------------------------------------------------------------- Installer

Expected<Installer> Installer::begin(const Header& h, const Identity& mine,
                                     std::span<const LayerKind> layers, KvCache fresh) {
  KILN_TRY(check_compatible(h, mine, layers));
  if (static_cast<size_t>(fresh.n_layers()) != h.layers.size())
    return Status::errorf("kvpack install: {} layers in the pack, {} in the cache", h.layers.size(),
                          fresh.n_layers());
  if (h.n_pos > fresh.n_ctx())
    return Status::errorf("kvpack install: the pack holds {} positions, the slot's context is {}",
                          h.n_pos, fresh.n_ctx());
  Installer in(std::move(fresh));
  in.n_pos_ = h.n_pos;
  for (int l = 0; l < in.cache_.n_layers(); ++l) {
    const size_t L = size_t(l);
    if (in.cache_.width(l) != h.layers[L].width || in.cache_.window(l) != h.layers[L].window ||
        in.cache_.k_only(l) != h.layers[L].k_only)
      return Status::errorf("kvpack install: layer {} geometry differs from the cache", l);
    // A ring smaller than the producer's keeps only its newest `capacity` rows.
    const KvRowMap& m = in.cache_.row_map(l);
    in.lo_.push_back(m.is_ring() ? std::max(h.lo[L], h.n_pos - m.capacity()) : 0);
  }
  Status s = in.cache_.restore(h.n_pos, in.lo_);
  if (!s) return s.context("kvpack install");
  in.written_to_ = h.lo;
  return in;
}

Status Installer::tile(const Tile& t) {
  if (cache_.on_device())  // cudares: the rows would need an upload
    return Status::error("kvpack install: KV planes in device memory are not supported yet");
  if (t.layer < 0 || t.layer >= cache_.n_layers())
    return Status::errorf("kvpack install: tile layer {} out of range", t.layer);
  const size_t L = size_t(t.layer);
  const int64_t width = cache_.width(t.layer);
  const size_t rb = row_bytes(width);
  if (t.first_pos != written_to_[L] || t.n_rows <= 0 || int64_t(t.first_pos) + t.n_rows > n_pos_ ||
      t.k.size() != rb * size_t(t.n_rows) ||
      t.v.size() != (cache_.k_only(t.layer) ? 0 : t.k.size()))
    return Status::errorf("kvpack install: layer {} tile [{}, +{}) out of order or misshapen",
                          t.layer, t.first_pos, t.n_rows);
  const KvRowMap& map = cache_.row_map(t.layer);
  std::span<f16> k = cache_.k_plane(t.layer), v = cache_.v_plane(t.layer);
  for (int32_t i = 0; i < t.n_rows; ++i) {
    const int32_t pos = t.first_pos + i;
    if (pos < lo_[L]) continue;  // older than this ring keeps
    const size_t row = size_t(map.row_of(pos));
    std::memcpy(k.data() + row * size_t(width), t.k.data() + size_t(i) * rb, rb);
    if (!t.v.empty()) std::memcpy(v.data() + row * size_t(width), t.v.data() + size_t(i) * rb, rb);
  }
  written_to_[L] = t.first_pos + t.n_rows;
  return Status::ok();
}

Expected<KvCache> Installer::finish() {
  for (int l = 0; l < cache_.n_layers(); ++l) {
    const size_t L = size_t(l);
    if (written_to_[L] != n_pos_)
      return Status::errorf("kvpack install: layer {} rows end at {} of {}", l, written_to_[L],
                            n_pos_);
    if (!kPoisonEnabled) continue;
    // Structural today (rows [lo, n_pos) were each written once above); the poison check
    // keeps it so if the installer and the row map ever disagree.
    const int64_t width = cache_.width(l);
    const KvRowMap& map = cache_.row_map(l);
    for (int32_t pos = lo_[L]; pos < n_pos_; ++pos) {
      const size_t row = size_t(map.row_of(pos));
      for (auto plane : {cache_.k_plane(l), cache_.v_plane(l)}) {
        if (plane.empty()) continue;  // a k_only layer's V plane
        Status s = check_not_poisoned(plane.subspan(row * size_t(width), size_t(width)), "plane");
        if (!s) return s.context(fmt::format("kvpack install: layer {} position {}", l, pos));
      }
    }
  }
  return std::move(cache_);
}

Expected<KvCache> load(std::span<const uint8_t> pack, const Identity& mine,
                       std::span<const LayerKind> layers, KvCache fresh) {
  std::optional<Installer> in;
  Parser p(
      [&](const Header& h) -> Status {
        auto i = Installer::begin(h, mine, layers, std::move(fresh));
        if (!i) return i.status();
        in.emplace(std::move(*i));
        return Status::ok();
      },
      [&](const Tile& t) { return in->tile(t); });
  KILN_TRY(p.push(pack));
  KILN_TRY(p.finish());
  return in->finish();
}

}  // namespace kiln::kvpack
