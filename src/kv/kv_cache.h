// kv/kv_cache.h: one sequence's KV cache: per layer an f16 K plane and V plane, growing
// planes for full-attention layers and rings for sliding-window layers, with rollback.
//
// Two parts, kept apart on purpose (llama.cpp's kv-cells idea):
//  - KvRowMap: plain bookkeeping. Which physical row holds which position, which positions
//    are still retained, which keys a batch may see. No storage; unit-tested on its own.
//  - KvCache: the planes (storage) plus one KvRowMap per layer.
//
// Row mapping. Full layers: physical row == position (planes grow on demand up to n_ctx).
// Ring layers (window w > 0): capacity = w + max_batch rows, physical row == pos % capacity.
// That capacity keeps every key a batch needs present while the batch is processed (the
// batch's first query at position P needs keys P-w+1.., its n new keys overwrite at most
// n <= max_batch of the oldest rows), and it leaves enough history to roll back the last
// batch (speculative decoding's rejected draft rows) without saving overwritten rows.
//
// Protocol for one forward step of n tokens (positions n_pos() .. n_pos()+n-1):
//   begin_append(n)   -> checks context/batch limits, grows planes, computes row lists
//   append_rows(l)    -> physical rows to write the n new keys/values of layer l into
//   kv_rows(l)/kv_pos(l) -> every key the batch may attend to (incl. the new ones),
//                        ordered by position; the attention kernel applies causality and
//                        the window rule per query
//   k_plane(l)/v_plane(l) -> the planes ([capacity][width] f16)
//   commit()          -> the n positions become part of the sequence
// Spans returned by the accessors stay valid until the next begin_append/truncate/clear
// (a growing plane may be reallocated by begin_append).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/half.h"
#include "core/status.h"
#include "memory/buffers.h"

namespace kiln {

// Bookkeeping of one plane geometry (full or ring). Positions [lo, hi) are retained and
// committed; an append in flight adds [hi, hi + n_pending).
class KvRowMap {
 public:
  KvRowMap() = default;
  // window 0: full layer, capacity n_ctx. window > 0: ring of capacity window + max_batch
  // (never more than n_ctx, since then the ring would never wrap).
  KvRowMap(int32_t n_ctx, int32_t max_batch, int32_t window);

  int32_t capacity() const { return capacity_; }
  int32_t window() const { return window_; }
  bool is_ring() const { return window_ > 0; }
  int32_t n_pos() const { return hi_; }  // committed positions
  int32_t lo() const { return lo_; }     // oldest retained position
  int32_t n_pending() const { return n_pending_; }

  // Physical row of a retained (or pending) position; KILN_CHECKs the range.
  int32_t row_of(int32_t pos) const;

  // Starts an append of n positions. Errors: n <= 0, n > max_batch, context overflow. An
  // append still pending is discarded first (the previous step failed before commit()).
  Status begin_append(int32_t n);
  void commit();
  // Drops positions >= n_pos (any pending append too). For rings, n_pos must leave the
  // window of the next query intact: n_pos == 0 or n_pos - window + 1 >= lo(); otherwise an
  // error, and the caller must truncate(0) and re-prefill. Rolling back the last committed
  // batch always works.
  Status truncate(int32_t n_pos);
  // Smallest n_pos > 0 that truncate() accepts right now (0 is always accepted).
  int32_t min_truncate_pos() const;
  // kvpack install (kv/kvpack.cpp): the state of a sequence that holds positions [lo, n_pos)
  // with nothing pending. Errors for a state no append/truncate history could produce here
  // (full layers keep lo 0; rings hold at most capacity() rows and the next query's window).
  Status restore(int32_t lo, int32_t n_pos);

  // Rows/positions of the pending append, and of every key the pending (or, with none
  // pending, the next) batch may see: full layers all of [0, hi+n); rings
  // [max(lo, hi-window+1), hi+n).
  const std::vector<int32_t>& append_rows() const { return append_rows_; }
  const std::vector<int32_t>& append_pos() const { return append_pos_; }
  const std::vector<int32_t>& kv_rows() const { return kv_rows_; }
  const std::vector<int32_t>& kv_pos() const { return kv_pos_; }

 private:
  void rebuild_lists();

  int32_t n_ctx_ = 0, max_batch_ = 0, window_ = 0, capacity_ = 0;
  int32_t lo_ = 0, hi_ = 0, n_pending_ = 0;
  std::vector<int32_t> append_rows_, append_pos_, kv_rows_, kv_pos_;
};

struct KvLayerSpec {
  int64_t width = 0;   // n_head_kv * head_dim (K and V planes share it)
  int32_t window = 0;  // 0: full attention; > 0: sliding window of this many positions
  // No V plane: latent attention (model/hparams.h MlaDims) keeps one latent row per token in
  // the K plane and reads its values from those rows; v_plane() is then empty.
  bool k_only = false;
};

struct KvConfig {
  std::vector<KvLayerSpec> layers;
  int32_t n_ctx = 0;      // positions one sequence may hold
  int32_t max_batch = 0;  // most tokens one begin_append may add (prefill chunk size)
  // Optional allocator hook: when set and backend->device_memory(), the planes live in that
  // backend's memory (a GPU's) and k_plane()/v_plane() are spans only its ops may touch; the
  // bookkeeping stays host data. Otherwise (and on host backends) the planes are host
  // F16Buffers as before. The backend must outlive the cache.
  Backend* backend = nullptr;
};

class KvCache {
 public:
  // Validates the config (widths > 0, windows >= 0, 0 < max_batch, 0 < n_ctx) and allocates
  // ring planes (full planes grow lazily).
  static Expected<KvCache> create(const KvConfig& config);

  KvCache(KvCache&&) noexcept;
  KvCache& operator=(KvCache&&) noexcept;
  ~KvCache();

  int n_layers() const { return static_cast<int>(layers_.size()); }
  int32_t n_ctx() const { return config_.n_ctx; }
  int32_t max_batch() const { return config_.max_batch; }
  int64_t width(int layer) const;
  int32_t window(int layer) const;
  bool k_only(int layer) const;  // KvLayerSpec::k_only: no V plane
  int32_t n_pos() const;         // committed positions of the sequence

  Status begin_append(int32_t n);
  int32_t n_pending() const;
  std::span<const int32_t> append_pos() const;  // positions of the pending tokens
  std::span<const int32_t> append_rows(int layer) const;
  std::span<const int32_t> kv_rows(int layer) const;
  std::span<const int32_t> kv_pos(int layer) const;
  std::span<f16> k_plane(int layer);  // [rows(layer)][width(layer)]
  std::span<f16> v_plane(int layer);  // empty for a k_only layer
  std::span<const f16> k_plane(int layer) const;
  std::span<const f16> v_plane(int layer) const;
  int32_t rows(int layer) const;  // physical rows currently allocated for the layer
  void commit();

  // Rollback to n_pos positions (see KvRowMap::truncate for the ring rule). On error the
  // cache is unchanged.
  Status truncate(int32_t n_pos);
  int32_t min_truncate_pos() const;  // over all layers
  void clear();                      // truncate(0); keeps the allocation
  // kvpack install on a fresh cache (n_pos() == 0): every layer's map holds [lo[layer], n_pos)
  // and full planes grow to n_pos rows, uninitialized (poisoned in KILN_POISON builds) until
  // the caller writes each retained row. lo has one entry per layer; layers sharing a window
  // must agree. On error the cache is unchanged.
  Status restore(int32_t n_pos, std::span<const int32_t> lo);
  // Makes this cache hold positions [0, n_pos) of `src` (what was here before is dropped):
  // the rows `src` retains of them are copied, so attention over them gives what `src` would
  // (n > 1 choices sharing one prefill). `src` must have this cache's geometry and backend and
  // hold at least n_pos positions; a ring must still retain every key the next query needs.
  // On error this cache is empty.
  Status copy_prefix(const KvCache& src, int32_t n_pos);

  // True when the planes live in a device backend's memory (KvConfig::backend): k_plane() and
  // v_plane() are then spans only that backend may touch (kvpack must download them first).
  bool on_device() const { return config_.backend && config_.backend->device_memory(); }
  Backend* backend() const { return config_.backend; }

  size_t bytes_allocated() const;  // K + V bytes of all planes now
  size_t bytes_per_token() const;  // K + V bytes one position takes over all layers
  // KILN_POISON builds: an error if any row listed in kv_rows(layer) still holds the poison
  // pattern (a key read before it was written). Other builds: always ok.
  Status check_kv_rows_written(int layer) const;
  const KvRowMap& row_map(int layer) const;

 private:
  // F16Buffer::uninitialized by policy (ARCHITECTURE.md §3.3): the row map guarantees every
  // row is written before it is listed in kv_rows. KILN_POISON builds fill fresh rows with
  // kPoisonF16 so a premature read shows up.
  struct Plane {
    F16Buffer data;          // [rows][width]
    BackendBuffer<f16> dev;  // instead of data, when the planes live in device memory
    int32_t rows = 0;
    f16* ptr() const { return dev.empty() ? const_cast<f16*>(data.data()) : dev.data(); }
  };

  struct Layer {
    int64_t width = 0;
    int32_t window = 0;
    bool k_only = false;
    size_t map = 0;  // index into maps_
    Plane k, v;
  };
  KvCache() = default;
  Status ensure_rows(Layer& layer, int32_t rows_needed);

  KvConfig config_;
  std::vector<KvRowMap> maps_;  // one per distinct window (layers of one kind share it)
  std::vector<Layer> layers_;   // [n_layer]
};

}  // namespace kiln
