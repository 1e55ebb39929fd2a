// tests/fuzz/fuzz_kvpack.cpp: libFuzzer target for the kvpack parser and installer. The
// input is pushed in pieces whose sizes come from its first byte (the parser must not care
// how bytes arrive) into an installer of a fixed small geometry and identity (the seeds are
// valid packs of it, so mutations reach tiles and the trailer). Property: whatever installs
// re-saves to a pack that installs again with the same positions.
// Every part of a pack is checksummed, so a random mutation almost always stops at the first
// checksum: the custom mutator below re-seals what a mutation left in place (header checksum,
// each tile's checksum, the trailer's digest over the stream) for seven mutations in eight, so
// the mutated fields reach the checks and the installer behind the checksums; the eighth keeps
// the checksum failures covered.
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "kv/kvpack.h"

namespace {

using namespace kiln;

// Must match the seeds in seeds/fuzz_kvpack/ (written by the same geometry: two full layers,
// one NoPE, two rings of window 4; width 8; n_ctx 64; max_batch 4).
const kvpack::Identity kId{
    .engine_abi = 1, .kv_dtype = 1, .model = 0xABCD, .tokenizer = 0x1234, .chat_template = 0};
std::vector<kvpack::LayerKind> kinds() {
  return {{8, 0, true}, {8, 4, true}, {8, 0, false}, {8, 4, true}};
}
KvCache fresh() {
  KvConfig c;
  c.n_ctx = 64;
  c.max_batch = 4;
  for (const auto& k : kinds()) c.layers.push_back({k.width, k.window});
  auto kv = KvCache::create(c);
  if (!kv) __builtin_trap();
  return std::move(*kv);
}

// docs/kvpack.md's layout, read only as far as the bytes hold together: a header of 56 bytes,
// a layer table of 24 per layer, its checksum; tiles (TILE, layer, first, n_rows, reserved,
// K and V rows of width f16 values, checksum); the trailer (KEND, n_tiles, digest).
template <class T>
T get_at(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
void put_hash(uint8_t* at, uint64_t h) { std::memcpy(at, &h, sizeof h); }

void reseal(uint8_t* pack, size_t size) {
  constexpr size_t kFixed = 56, kLayer = 24, kTileHead = 20;
  if (size < kFixed || std::memcmp(pack, "KVPK", 4) != 0) return;
  const uint32_t n_layer = get_at<uint32_t>(pack + 8);
  if (n_layer == 0 || n_layer > 64) return;
  const size_t head = kFixed + kLayer * n_layer;
  if (size < head + 8) return;
  put_hash(pack + head, XXH3_64bits(pack, head));
  XXH3_state_t* stream = XXH3_createState();
  XXH3_64bits_reset(stream);
  XXH3_64bits_update(stream, pack, head + 8);
  size_t at = head + 8;
  while (at + 4 <= size) {
    const uint8_t* b = pack + at;
    if (std::memcmp(b, "TILE", 4) == 0 && at + kTileHead <= size) {
      const uint32_t layer = get_at<uint32_t>(b + 4);
      const int32_t n_rows = get_at<int32_t>(b + 12);
      if (layer >= n_layer || n_rows <= 0 || n_rows > 64) break;
      const uint8_t* e = pack + kFixed + kLayer * layer;
      const int64_t width = get_at<int64_t>(e);
      const size_t planes = (get_at<uint32_t>(e + 12) & 2) != 0 ? 1 : 2;
      if (width <= 0 || width > 64) break;
      const size_t body = kTileHead + planes * size_t(width) * 2 * size_t(n_rows);
      if (at + body + 8 > size) break;
      put_hash(pack + at + body, XXH3_64bits(b, body));
      XXH3_64bits_update(stream, b, body + 8);
      at += body + 8;
    } else if (std::memcmp(b, "KEND", 4) == 0 && at + 16 <= size) {
      XXH3_64bits_update(stream, b, 8);
      put_hash(pack + at + 8, XXH3_64bits_digest(stream));
      break;
    } else {
      break;
    }
  }
  XXH3_freeState(stream);
}

}  // namespace

extern "C" size_t LLVMFuzzerMutate(uint8_t* data, size_t size, size_t max_size);

extern "C" size_t LLVMFuzzerCustomMutator(uint8_t* data, size_t size, size_t max_size,
                                          unsigned int seed) {
  size = LLVMFuzzerMutate(data, size, max_size);
  if (size > 1 && seed % 8 != 0) reseal(data + 1, size - 1);  // data[0]: the piece size
  return size;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t piece = 1 + data[0] % 61;
  std::span<const uint8_t> bytes(data + 1, size - 1);
  const auto k = kinds();
  std::optional<kvpack::Installer> in;
  kvpack::Parser p(
      [&](const kvpack::Header& h) -> Status {
        auto i = kvpack::Installer::begin(h, kId, k, fresh());
        if (!i) return i.status();
        in.emplace(std::move(*i));
        return Status::ok();
      },
      [&](const kvpack::Tile& t) { return in->tile(t); });
  while (!bytes.empty()) {
    const size_t n = std::min(piece, bytes.size());
    if (!p.push(bytes.first(n))) return 0;
    bytes = bytes.subspan(n);
  }
  if (!p.finish()) return 0;
  auto kv = in->finish();
  if (!kv) return 0;
  auto again = kvpack::save(*kv, kId, k, 3);
  if (!again) __builtin_trap();
  auto back = kvpack::load(*again, kId, k, fresh());
  if (!back || back->n_pos() != kv->n_pos()) __builtin_trap();
  return 0;
}
