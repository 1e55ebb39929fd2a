// transfer/session_pack.h: kvpack for a Session: save its KV cache, install a pack into it
// (fresh planes, verified, published in one move), and the same through a file
// (`kiln kv save/load`, session persistence).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/session.h"
#include "kv/kvpack.h"

namespace kiln::transfer {

Expected<std::vector<uint8_t>> save_session(const Session& session, int32_t max_tile_rows = 1024);

// An empty cache with the session's geometry: what an install builds into.
Expected<KvCache> fresh_cache_for(const Session& session);

// Installs a whole pack. On any error (another producer, corruption, truncation, a pack too
// long for the slot) the session is exactly as it was.
Status load_session(Session& session, std::span<const uint8_t> pack);

// Incremental install for a stream (remote prefill): feed bytes as they arrive, then
// publish() once the parser is done. Destroying it unpublished changes nothing.
class StreamInstall {
 public:
  explicit StreamInstall(Session& session);
  Status push(std::span<const uint8_t> bytes);
  bool done() const { return parser_.done(); }
  Status finish() const { return parser_.finish(); }
  Status publish();  // verifies completeness, then swaps the new cache into the session
  uint64_t bytes() const { return parser_.bytes_consumed(); }

 private:
  Session& session_;
  kvpack::Identity mine_;
  std::vector<kvpack::LayerKind> kinds_;
  std::optional<kvpack::Installer> installer_;
  kvpack::Parser parser_;
};

Status save_session_file(const Session& session, const std::string& path);
Status load_session_file(Session& session, const std::string& path);

}  // namespace kiln::transfer
