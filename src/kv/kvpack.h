// kv/kvpack.h: kvpack, the serialised form of one sequence's KV cache: a header binding the
// pack to its producer (model, tokenizer, template, dtype, layer kinds, engine ABI), per-layer
// tiles of rows in position order, each checksummed, and a digest over the whole stream.
//
// The byte layout is specified in docs/kvpack.md. Three parts:
//  - Writer: emits header, tiles (any time after their rows are final: a remote prefill sends
//    them chunk by chunk while it is still computing), trailer, through a byte sink.
//  - Parser: incremental; bytes may arrive in any split. It validates each piece before it
//    hands it on: header checksum and limits, tile placement and checksum, trailer digest.
//  - Installer: writes delivered tiles into a fresh KvCache (planes uninitialized, poisoned
//    in KILN_POISON builds) and, once the trailer has verified, returns it for the caller to
//    publish in one move. Nothing touches the live cache before that, so a refused or broken
//    pack leaves the slot as it was.
// Identity values (model fingerprint etc.) are computed by the engine (transfer/identity.h);
// here they are plain numbers compared field by field.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "kv/kv_cache.h"

namespace kiln::kvpack {

// 2: the layer table's flag bit 1 (K rows only: latent attention has no V plane).
inline constexpr uint32_t kFormatVersion = 2;
// Limits a header must respect (a crafted header cannot make the parser allocate much more
// than the bytes it is actually sent).
inline constexpr uint32_t kMaxLayers = 4096;
inline constexpr int64_t kMaxWidth = int64_t{1} << 20;
inline constexpr int32_t kMaxPositions = int32_t{1} << 24;

// Who produced the pack: a consumer accepts only packs whose identity equals its own.
struct Identity {
  uint32_t engine_abi = 0;     // bumped when the meaning of KV rows changes (transfer/identity.h)
  uint32_t kv_dtype = 0;       // DType code of the plane elements (F16 today)
  uint64_t model = 0;          // xxh64: GGUF tensor index + metadata other than tokenizer.*
  uint64_t tokenizer = 0;      // xxh64: tokenizer.* metadata except the chat template
  uint64_t chat_template = 0;  // xxh64 of tokenizer.chat_template (0 when absent)
};

struct LayerKind {
  int64_t width = 0;    // n_head_kv * head_dim elements per K (and V) row
  int32_t window = 0;   // 0: full attention, > 0: sliding window
  bool rope = true;     // false: NoPE layer, rows are position-free
  bool k_only = false;  // K rows only, no V rows (latent attention: KvLayerSpec::k_only)
};

struct Header {
  Identity id;
  std::vector<LayerKind> layers;  // [n_layer]
  std::vector<int32_t> lo;        // [n_layer] oldest position the producer retained
  int32_t n_pos = 0;              // positions [0, n_pos) of the sequence
};

// Ok when `pack` may be installed by a consumer of identity `mine` with layers `layers`;
// otherwise one line naming the first field that differs and both values.
Status check_compatible(const Header& pack, const Identity& mine,
                        std::span<const LayerKind> layers);

// Header describing `cache` as it is now (n_pos, per-layer lo) for producer `id`/`layers`.
Expected<Header> header_for(const KvCache& cache, const Identity& id,
                            std::span<const LayerKind> layers);

using Sink = std::function<Status(std::span<const uint8_t>)>;

class Writer {
 public:
  explicit Writer(Sink sink);
  Status header(const Header& h);
  // Rows [first_pos, first_pos + n_rows) of `layer`, gathered from the cache's planes. Per
  // layer, tiles must continue where the previous one ended (the first starts at h.lo[layer]),
  // and the rows must be retained by the cache now.
  Status tile(const KvCache& cache, int layer, int32_t first_pos, int32_t n_rows);
  // Every layer must be complete (its tiles reach n_pos).
  Status finish();
  uint64_t bytes_written() const { return bytes_; }

 private:
  Status emit(std::span<const uint8_t> bytes);
  Sink sink_;
  Header h_;
  std::vector<int32_t> next_;  // [n_layer] next position each layer's tiles must start at
  uint32_t n_tiles_ = 0;
  uint64_t bytes_ = 0;
  bool started_ = false, finished_ = false;
  struct HashState;
  std::shared_ptr<HashState> hash_;
};

// A whole pack of `cache` in memory: header, tiles of at most max_tile_rows rows, trailer.
Expected<std::vector<uint8_t>> save(const KvCache& cache, const Identity& id,
                                    std::span<const LayerKind> layers,
                                    int32_t max_tile_rows = 1024);

// One verified tile as the parser delivers it. k and v are [n_rows][width] f16 little-endian
// bytes, borrowed until the callback returns.
struct Tile {
  int layer = 0;
  int32_t first_pos = 0;
  int32_t n_rows = 0;
  std::span<const uint8_t> k, v;  // v empty for a k_only layer
};

class Parser {
 public:
  using HeaderFn = std::function<Status(const Header&)>;
  using TileFn = std::function<Status(const Tile&)>;
  Parser(HeaderFn on_header, TileFn on_tile);

  // Consumes bytes (any split). The first error is sticky: later pushes return it again.
  Status push(std::span<const uint8_t> bytes);
  // True once the trailer's digest has verified. A stream that ends before then is truncated.
  bool done() const { return state_ == State::Done; }
  // Ok when done(); otherwise the "truncated" error naming what was still expected.
  Status finish() const;
  uint64_t bytes_consumed() const { return consumed_; }
  const Header& header() const { return h_; }

 private:
  enum class State { Fixed, Layers, TileMagic, TileHead, TileBody, Trailer, Done, Failed };
  Status step();
  Status fail(Status s);

  HeaderFn on_header_;
  TileFn on_tile_;
  State state_ = State::Fixed;
  Status error_;
  std::vector<uint8_t> buf_;  // bytes of the piece being assembled
  size_t need_ = 0;           // bytes the current piece needs
  uint64_t consumed_ = 0;
  Header h_;
  std::vector<int32_t> next_;
  uint32_t n_tiles_ = 0;
  Tile cur_;
  struct HashState;
  std::shared_ptr<HashState> hash_;
};

// Builds the KV cache a pack describes, in a fresh cache the caller created with its own
// geometry (KvCache::create: n_ctx, max_batch and layers of the consumer). Rows older than
// the consumer's ring keeps are skipped; every row the consumer retains must arrive.
class Installer {
 public:
  // Checks compatibility and restores the fresh cache's positions.
  static Expected<Installer> begin(const Header& h, const Identity& mine,
                                   std::span<const LayerKind> layers, KvCache fresh);
  Status tile(const Tile& t);
  // After the parser is done: verifies every retained row was written (and, in KILN_POISON
  // builds, that none still holds poison) and hands the cache over for publication.
  Expected<KvCache> finish();

 private:
  explicit Installer(KvCache c) : cache_(std::move(c)) {}
  KvCache cache_;
  std::vector<int32_t> written_to_;  // [n_layer] rows written up to this position
  std::vector<int32_t> lo_;          // [n_layer] consumer's oldest retained position
  int32_t n_pos_ = 0;
};

// Parses and installs a whole in-memory pack into `fresh`; the cache to publish, or the
// first error.
Expected<KvCache> load(std::span<const uint8_t> pack, const Identity& mine,
                       std::span<const LayerKind> layers, KvCache fresh);

}  // namespace kiln::kvpack
