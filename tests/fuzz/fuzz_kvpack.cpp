// tests/fuzz/fuzz_kvpack.cpp: libFuzzer target for the kvpack parser and installer. The
// input is pushed in pieces whose sizes come from its first byte (the parser must not care
// how bytes arrive) into an installer of a fixed small geometry and identity (the seeds are
// valid packs of it, so mutations reach tiles and the trailer). Property: whatever installs
// re-saves to a pack that installs again with the same positions.
#include <cstddef>
#include <cstdint>
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

}  // namespace

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
