// kv/kv_cache.cpp: KV row bookkeeping (KvRowMap) and the f16 planes it indexes (KvCache).
#include "kv/kv_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#include "core/check.h"

namespace kiln {

// ---------------------------------------------------------------- KvRowMap

KvRowMap::KvRowMap(int32_t n_ctx, int32_t max_batch, int32_t window)
    : n_ctx_(n_ctx), max_batch_(max_batch), window_(window) {
  KILN_CHECK(n_ctx > 0 && max_batch > 0 && window >= 0);
  // A ring as large as the context never wraps: it is a full plane that masks by window.
  const int64_t ring = int64_t(window) + max_batch;
  capacity_ = window > 0 ? static_cast<int32_t>(std::min<int64_t>(ring, n_ctx)) : n_ctx;
  rebuild_lists();
}

int32_t KvRowMap::row_of(int32_t pos) const {
  KILN_CHECK(pos >= lo_ && pos < hi_ + n_pending_, "pos {} outside retained [{}, {})", pos, lo_,
             hi_ + n_pending_);
  return pos % capacity_;
}

Status KvRowMap::begin_append(int32_t n) {
  n_pending_ = 0;  // discard an append that never committed
  if (n <= 0) return Status::errorf("kv append of {} tokens (must be > 0)", n);
  if (n > max_batch_)
    return Status::errorf("kv append of {} tokens exceeds the batch limit {}", n, max_batch_);
  if (int64_t(hi_) + n > n_ctx_)
    return Status::errorf("context overflow: {} positions held + {} new > n_ctx {}", hi_, n,
                          n_ctx_);
  n_pending_ = n;
  // The new rows overwrite the oldest ones of a ring; those positions are gone from now on,
  // even if this append is later discarded.
  lo_ = std::max(lo_, hi_ + n - capacity_);
  rebuild_lists();
  return Status::ok();
}

void KvRowMap::commit() {
  hi_ += n_pending_;
  n_pending_ = 0;
  rebuild_lists();
}

int32_t KvRowMap::min_truncate_pos() const {
  if (!is_ring() || lo_ == 0) return 0;
  // The next query at position p needs keys p-window+1 .. p-1 to be retained.
  return lo_ + window_ - 1;
}

Status KvRowMap::truncate(int32_t n_pos) {
  if (n_pos < 0 || n_pos > hi_)
    return Status::errorf("cannot roll back to position {}: the sequence holds {}", n_pos, hi_);
  if (n_pos == 0) {
    lo_ = hi_ = n_pending_ = 0;
    rebuild_lists();
    return Status::ok();
  }
  if (n_pos < min_truncate_pos())
    return Status::errorf(
        "cannot roll back to position {}: the sliding-window ring (window {}) retains "
        "positions from {} only, so the earliest rollback target is {}; truncate to 0 and "
        "re-prefill instead",
        n_pos, window_, lo_, min_truncate_pos());
  hi_ = n_pos;
  n_pending_ = 0;
  rebuild_lists();
  return Status::ok();
}

Status KvRowMap::restore(int32_t lo, int32_t n_pos) {
  if (n_pos < 0 || n_pos > n_ctx_)
    return Status::errorf("kv restore: {} positions outside [0, n_ctx {}]", n_pos, n_ctx_);
  if (lo < 0 || lo > n_pos)
    return Status::errorf("kv restore: oldest position {} outside [0, {}]", lo, n_pos);
  if (!is_ring() && lo != 0)
    return Status::errorf("kv restore: a full-attention layer must retain from 0, not {}", lo);
  if (n_pos - lo > capacity_)
    return Status::errorf("kv restore: {} retained positions exceed the ring capacity {}",
                          n_pos - lo, capacity_);
  // The next query (position n_pos) reads keys n_pos-window+1.. : they must be retained.
  if (is_ring() && lo > std::max(0, n_pos - window_ + 1))
    return Status::errorf(
        "kv restore: ring (window {}) retains from {}, but position {} needs "
        "keys from {}",
        window_, lo, n_pos, std::max(0, n_pos - window_ + 1));
  lo_ = lo;
  hi_ = n_pos;
  n_pending_ = 0;
  rebuild_lists();
  return Status::ok();
}

void KvRowMap::rebuild_lists() {
  const int32_t end = hi_ + n_pending_;
  append_rows_.clear();
  append_pos_.clear();
  for (int32_t p = hi_; p < end; ++p) {
    append_pos_.push_back(p);
    append_rows_.push_back(p % capacity_);
  }
  int32_t first = 0;
  if (is_ring()) first = std::max(lo_, hi_ - window_ + 1);
  first = std::max(first, lo_);
  kv_rows_.clear();
  kv_pos_.clear();
  for (int32_t p = first; p < end; ++p) {
    kv_pos_.push_back(p);
    kv_rows_.push_back(p % capacity_);
  }
}

// ---------------------------------------------------------------- KvCache

namespace {
constexpr int32_t kMinGrowRows = 256;
}  // namespace

KvCache::KvCache(KvCache&&) noexcept = default;
KvCache& KvCache::operator=(KvCache&&) noexcept = default;
KvCache::~KvCache() = default;

Expected<KvCache> KvCache::create(const KvConfig& config) {
  if (config.layers.empty()) return Status::error("kv cache: no layers");
  if (config.n_ctx <= 0) return Status::errorf("kv cache: n_ctx {} must be > 0", config.n_ctx);
  if (config.max_batch <= 0)
    return Status::errorf("kv cache: max_batch {} must be > 0", config.max_batch);
  KvCache c;
  c.config_ = config;
  c.config_.max_batch = std::min(config.max_batch, config.n_ctx);
  std::vector<int32_t> windows;
  for (size_t i = 0; i < config.layers.size(); ++i) {
    const KvLayerSpec& s = config.layers[i];
    if (s.width <= 0) return Status::errorf("kv cache: layer {} width {} must be > 0", i, s.width);
    if (s.window < 0)
      return Status::errorf("kv cache: layer {} window {} must be >= 0", i, s.window);
    Layer l;
    l.width = s.width;
    l.window = s.window;
    l.k_only = s.k_only;
    auto it = std::find(windows.begin(), windows.end(), s.window);
    l.map = static_cast<size_t>(it - windows.begin());
    if (it == windows.end()) {
      windows.push_back(s.window);
      c.maps_.emplace_back(c.config_.n_ctx, c.config_.max_batch, s.window);
    }
    c.layers_.push_back(std::move(l));
  }
  for (Layer& l : c.layers_) {
    const KvRowMap& m = c.maps_[l.map];
    if (m.is_ring()) KILN_TRY(c.ensure_rows(l, m.capacity()));
  }
  return c;
}

Status KvCache::ensure_rows(Layer& l, int32_t rows_needed) {
  if (l.k.rows >= rows_needed) return Status::ok();
  const int32_t cap = maps_[l.map].capacity();
  int64_t rows = std::max<int64_t>({rows_needed, int64_t(l.k.rows) * 2, kMinGrowRows});
  rows = std::min<int64_t>(rows, cap);
  KILN_CHECK(rows >= rows_needed);
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(l.width);
  if (on_device()) {
    // Device planes: zero-filled by the backend; the old rows move with a device copy.
    for (Plane* p : {&l.k, &l.v}) {
      if (p == &l.v && l.k_only) continue;
      BackendBuffer<f16> grown = config_.backend->alloc<f16>(n);
      const size_t old = static_cast<size_t>(p->rows) * static_cast<size_t>(l.width);
      if (old) config_.backend->copy(std::span<const f16>(p->dev.data(), old), grown.span());
      p->dev = std::move(grown);
      p->rows = static_cast<int32_t>(rows);
    }
    return Status::ok();
  }
  for (Plane* p : {&l.k, &l.v}) {
    if (p == &l.v && l.k_only) continue;
    // Rows past the old ones stay uninitialised (poisoned in KILN_POISON builds).
    F16Buffer grown = F16Buffer::uninitialized(n);
    const size_t old = static_cast<size_t>(p->rows) * static_cast<size_t>(l.width);
    if (old) std::memcpy(grown.data(), p->data.data(), old * sizeof(f16));
    p->data = std::move(grown);
    p->rows = static_cast<int32_t>(rows);
  }
  return Status::ok();
}

int64_t KvCache::width(int layer) const { return layers_.at(size_t(layer)).width; }
int32_t KvCache::window(int layer) const { return layers_.at(size_t(layer)).window; }
bool KvCache::k_only(int layer) const { return layers_.at(size_t(layer)).k_only; }
int32_t KvCache::n_pos() const { return maps_.front().n_pos(); }
int32_t KvCache::n_pending() const { return maps_.front().n_pending(); }
int32_t KvCache::rows(int layer) const { return layers_.at(size_t(layer)).k.rows; }
const KvRowMap& KvCache::row_map(int layer) const { return maps_[layers_.at(size_t(layer)).map]; }

Status KvCache::begin_append(int32_t n) {
  // Check the limits on a copy first so a refused append leaves the cache as it was.
  for (const KvRowMap& m : maps_) {
    KvRowMap probe = m;
    KILN_TRY(probe.begin_append(n));
  }
  // Grow full planes before touching the maps so an allocation failure changes nothing
  // but capacity.
  const int32_t end = n_pos() + n;
  for (Layer& l : layers_)
    if (!maps_[l.map].is_ring()) KILN_TRY(ensure_rows(l, end));
  for (KvRowMap& m : maps_) KILN_CHECK(m.begin_append(n).is_ok());
  return Status::ok();
}

std::span<const int32_t> KvCache::append_pos() const { return maps_.front().append_pos(); }
std::span<const int32_t> KvCache::append_rows(int layer) const {
  return row_map(layer).append_rows();
}
std::span<const int32_t> KvCache::kv_rows(int layer) const { return row_map(layer).kv_rows(); }
std::span<const int32_t> KvCache::kv_pos(int layer) const { return row_map(layer).kv_pos(); }

std::span<f16> KvCache::k_plane(int layer) {
  Layer& l = layers_.at(size_t(layer));
  return {l.k.ptr(), size_t(l.k.rows) * size_t(l.width)};
}
std::span<f16> KvCache::v_plane(int layer) {
  Layer& l = layers_.at(size_t(layer));
  return {l.v.ptr(), size_t(l.v.rows) * size_t(l.width)};
}
std::span<const f16> KvCache::k_plane(int layer) const {
  const Layer& l = layers_.at(size_t(layer));
  return {l.k.ptr(), size_t(l.k.rows) * size_t(l.width)};
}
std::span<const f16> KvCache::v_plane(int layer) const {
  const Layer& l = layers_.at(size_t(layer));
  return {l.v.ptr(), size_t(l.v.rows) * size_t(l.width)};
}

void KvCache::commit() {
  for (KvRowMap& m : maps_) m.commit();
}

int32_t KvCache::min_truncate_pos() const {
  int32_t r = 0;
  for (const KvRowMap& m : maps_) r = std::max(r, m.min_truncate_pos());
  return r;
}

Status KvCache::truncate(int32_t n_pos) {
  for (const KvRowMap& m : maps_) {
    KvRowMap probe = m;
    KILN_TRY(probe.truncate(n_pos));
  }
  for (KvRowMap& m : maps_) KILN_CHECK(m.truncate(n_pos).is_ok());
  return Status::ok();
}

void KvCache::clear() { KILN_CHECK(truncate(0).is_ok()); }

Status KvCache::restore(int32_t n_pos, std::span<const int32_t> lo) {
  if (this->n_pos() != 0 || n_pending() != 0)
    return Status::errorf("kv restore: the cache already holds {} positions", this->n_pos());
  if (lo.size() != layers_.size())
    return Status::errorf("kv restore: {} layer origins for {} layers", lo.size(), layers_.size());
  // Probe every map on a copy first so a refused restore leaves the cache as it was.
  std::vector<KvRowMap> probe = maps_;
  std::vector<bool> set(maps_.size(), false);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const size_t m = layers_[i].map;
    if (set[m]) {
      if (probe[m].lo() != lo[i])
        return Status::errorf(
            "kv restore: layer {} retains from {} but another layer of window "
            "{} from {}",
            i, lo[i], layers_[i].window, probe[m].lo());
      continue;
    }
    Status s = probe[m].restore(lo[i], n_pos);
    if (!s) return s.context(fmt::format("layer {}", i));
    set[m] = true;
  }
  for (Layer& l : layers_)
    if (!maps_[l.map].is_ring()) KILN_TRY(ensure_rows(l, n_pos));
  maps_ = std::move(probe);
  return Status::ok();
}

Status KvCache::copy_prefix(const KvCache& src, int32_t n_pos) {
  clear();  // whatever happens next, nothing of the old sequence stays
  bool same = src.n_layers() == n_layers() && src.n_ctx() == n_ctx() &&
              src.max_batch() == max_batch() && src.config_.backend == config_.backend &&
              src.on_device() == on_device();
  for (int l = 0; same && l < n_layers(); ++l)
    same = src.width(l) == width(l) && src.window(l) == window(l) && src.k_only(l) == k_only(l);
  if (!same) return Status::error("kv copy: the source cache's geometry differs");
  if (n_pos < 0 || n_pos > src.n_pos())
    return Status::errorf("kv copy: {} positions of a cache holding {}", n_pos, src.n_pos());
  if (n_pos == 0) return Status::ok();
  std::vector<int32_t> lo(layers_.size());
  for (size_t i = 0; i < layers_.size(); ++i) lo[i] = src.row_map(static_cast<int>(i)).lo();
  KILN_TRY(restore(n_pos, lo));
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& l = layers_[i];
    const Layer& s = src.layers_[i];
    // Full planes: row == position, so the prefix is the first n_pos rows. Rings: row ==
    // position % capacity in both caches, so the whole plane carries every retained row;
    // rows of positions >= n_pos come along but are never listed in kv_rows.
    const bool ring = maps_[l.map].is_ring();
    const size_t n = static_cast<size_t>(ring ? s.k.rows : n_pos) * static_cast<size_t>(l.width);
    if (ring) {
      if (Status st = ensure_rows(l, s.k.rows); !st) {
        clear();
        return st;
      }
    }
    for (const auto& [from, to] : {std::pair{&s.k, &l.k}, std::pair{&s.v, &l.v}}) {
      if (to == &l.v && l.k_only) continue;
      const std::span<const f16> in(from->ptr(), n);
      const std::span<f16> out(to->ptr(), n);
      if (on_device())
        config_.backend->copy(in, out);
      else
        std::copy(in.begin(), in.end(), out.begin());
    }
  }
  return Status::ok();
}

size_t KvCache::bytes_allocated() const {
  size_t b = 0;
  for (const Layer& l : layers_)
    b += (l.k_only ? 1 : 2) * size_t(l.k.rows) * size_t(l.width) * sizeof(f16);
  return b;
}

size_t KvCache::bytes_per_token() const {
  size_t b = 0;
  for (const Layer& l : layers_) b += (l.k_only ? 1 : 2) * size_t(l.width) * sizeof(f16);
  return b;
}

Status KvCache::check_kv_rows_written(int layer) const {
  if (!kPoisonEnabled || on_device()) return Status::ok();  // device planes are zero-filled
  const Layer& l = layers_.at(size_t(layer));
  for (int32_t r : kv_rows(layer)) {
    for (const Plane* p : {&l.k, &l.v}) {
      if (p == &l.v && l.k_only) continue;
      Status s = check_not_poisoned(p->data.row(size_t(r), size_t(l.width)),
                                    p == &l.k ? "K plane" : "V plane");
      if (!s) return s.context(fmt::format("kv layer {} row {}", layer, r));
    }
  }
  return Status::ok();
}

}  // namespace kiln
