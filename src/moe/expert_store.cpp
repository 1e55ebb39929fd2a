// moe/expert_store.cpp: slab cache, LRU eviction, pins and prefetch (see expert_store.h).
#include "moe/expert_store.h"

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/log.h"
#include "format/mmap_file.h"

namespace kiln::moe {

namespace {

uint64_t align_down(uint64_t n) { return n / kDirectAlign * kDirectAlign; }

// Load latency histogram shared by every store: bucket i holds latencies in
// (2^((i-1)/4), 2^(i/4)] microseconds.
constexpr int kBuckets = 128;
std::array<std::atomic<uint64_t>, kBuckets> g_latency{};
std::atomic<bool> g_any_store{false};
// The live stores, for format_store_stats' popularity lines.
std::mutex g_stores_mu;
std::vector<std::weak_ptr<ExpertStore>> g_stores;

void record_latency(std::chrono::nanoseconds d) {
  const double us = std::max(1.0, d.count() / 1e3);
  const int i = std::clamp(static_cast<int>(std::ceil(4 * std::log2(us))), 0, kBuckets - 1);
  g_latency[static_cast<size_t>(i)].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

double load_latency_percentile_us(double q) {
  std::array<uint64_t, kBuckets> c{};
  uint64_t total = 0;
  for (int i = 0; i < kBuckets; ++i) total += c[i] = g_latency[i].load(std::memory_order_relaxed);
  if (total == 0) return 0;
  const double want = std::clamp(q, 0.0, 1.0) * static_cast<double>(total);
  uint64_t acc = 0;
  for (int i = 0; i < kBuckets; ++i) {
    acc += c[i];
    if (static_cast<double>(acc) >= want && acc > 0) return std::exp2(i / 4.0);
  }
  return std::exp2((kBuckets - 1) / 4.0);
}

std::string format_store_stats() {
  if (!g_any_store.load()) return {};
  CounterRegistry& r = process_counters();
  const uint64_t hits = r.counter("moe.expert_hits").value();
  const uint64_t misses = r.counter("moe.expert_misses").value();
  const uint64_t pf = r.counter("moe.prefetch_issued").value();
  const uint64_t pfh = r.counter("moe.prefetch_hits").value();
  const Timer& stall = r.timer("moe.stall");
  const uint64_t dh = r.counter("moe.device_hits").value(),
                 dm = r.counter("moe.device_misses").value();
  const std::string device =
      dh + dm == 0 ? std::string()
                   : fmt::format(
                         "moe: device tier {} hits, {} misses, {:.1f} MiB copied to the "
                         "device, {} evictions\n",
                         dh, dm, r.counter("moe.device_bytes_copied").value() / 1048576.0,
                         r.counter("moe.device_evictions").value());
  std::string popularity;
  {
    std::lock_guard lock(g_stores_mu);
    for (const auto& w : g_stores)
      if (auto s = w.lock()) popularity += s->popularity_summary();
  }
  return popularity + device +
         fmt::format(
             "moe: expert gets {} ({} hits, {} misses, hit rate {:.1f}%), prefetched {} ({} used)\n"
             "moe: read {:.1f} MiB, load latency p50 {:.0f} us, p99 {:.0f} us, forward stalled "
             "{:.1f} ms on loads\n",
             hits + misses, hits, misses,
             hits + misses ? 100.0 * hits / double(hits + misses) : 0.0, pf, pfh,
             r.counter("moe.bytes_read").value() / 1048576.0, load_latency_percentile_us(0.5),
             load_latency_percentile_us(0.99), stall.total_ns() / 1e6);
}

struct ExpertStore::Unpin {
  ExpertStore* store;
  int32_t slab;
  std::thread::id owner;  // the thread that pinned (the last copy may die elsewhere)
  void operator()(const void*) const {
    std::lock_guard lock(store->mu_);
    Slab& S = store->slabs_[static_cast<size_t>(slab)];
    KILN_CHECK(S.pins > 0, "expert slab {} unpinned more often than pinned", slab);
    --S.pins;
    Layer& L = store->layers_[static_cast<size_t>(S.layer)];
    auto* h = holder(L, owner);
    KILN_CHECK(h != nullptr && h->second > 0, "expert pin of layer {} without a holder", S.layer);
    if (--h->second == 0) {
      *h = L.holders.back();
      L.holders.pop_back();
    }
    store->cv_.notify_all();
  }
};

std::pair<std::thread::id, int32_t>* ExpertStore::holder(Layer& L, std::thread::id t) {
  for (auto& h : L.holders)
    if (h.first == t) return &h;
  return nullptr;
}

Expected<std::shared_ptr<ExpertStore>> ExpertStore::create(const std::string& path,
                                                           const std::byte* mapping_base,
                                                           std::vector<StoreLayer> layers,
                                                           const StoreConfig& cfg) {
  if (cfg.cache_bytes < 0 || cfg.cap < 0)
    return Status::errorf("expert cache: --expert-cache {} / --expert-cap {} must not be negative",
                          cfg.cache_bytes, cfg.cap);
  if (!cfg.enabled()) return Status::error("expert cache: neither a byte budget nor a cap given");
  std::shared_ptr<ExpertStore> st(new ExpertStore());
  static std::atomic<uint64_t> next_store_id{1};
  st->store_id_ = next_store_id.fetch_add(1) & 0xFFFF;
  st->prefetch_ = cfg.prefetch;
  int32_t n_moe = 0, max_used = 0, max_expert = 0;
  st->layers_.resize(layers.size());
  for (size_t il = 0; il < layers.size(); ++il) {
    const StackedExperts& t = layers[il].tensors;
    Layer& L = st->layers_[il];
    L.n_expert = t.n_expert;
    L.n_used = layers[il].n_expert_used;
    if (L.n_expert == 0) continue;
    ++n_moe;
    max_used = std::max(max_used, L.n_used);
    max_expert = std::max(max_expert, L.n_expert);
    const WeightMatrix* src[3] = {&t.gate, &t.up, &t.down};
    uint64_t slab_off = 0;
    for (int p = 0; p < 3; ++p) {
      Part& P = L.parts[p];
      const int64_t rows = src[p]->n_rows / L.n_expert;
      P.shape = src[p]->rows(0, rows);
      P.shape.bytes = {};
      P.expert_bytes = static_cast<uint64_t>(rows) * src[p]->row_bytes;
      P.file_offset = static_cast<uint64_t>(src[p]->bytes.data() - mapping_base);
      P.slab_offset = slab_off;
      // The aligned read of any expert's slice fits in its rounded size plus one block.
      slab_off += round_up(P.expert_bytes, kDirectAlign) + kDirectAlign;
    }
    st->slab_bytes_ = std::max(st->slab_bytes_, slab_off);
  }
  if (n_moe == 0) return Status::error("expert cache: the model has no MoE layers");
  int64_t cap = cfg.cap > 0 ? cfg.cap : INT64_MAX;
  if (cfg.cache_bytes > 0) {
    const int64_t by_bytes =
        cfg.cache_bytes / static_cast<int64_t>(st->slab_bytes_) / static_cast<int64_t>(n_moe);
    cap = std::min(cap, by_bytes);
  }
  if (cap < max_used) {
    if (cfg.cache_bytes > 0 && (cfg.cap == 0 || cap < cfg.cap))
      return Status::errorf(
          "expert cache: --expert-cache {} bytes holds {} experts per layer ({} bytes per expert "
          "slab, {} MoE layers) but one token needs {}; give at least {} bytes",
          cfg.cache_bytes, cap, st->slab_bytes_, n_moe, max_used,
          static_cast<uint64_t>(max_used) * st->slab_bytes_ * static_cast<uint64_t>(n_moe));
    return Status::errorf(
        "expert cache: --expert-cap {} is below the {} experts one token needs "
        "per layer",
        cfg.cap, max_used);
  }
  st->cap_ = static_cast<int32_t>(std::min<int64_t>(cap, max_expert));

  int32_t n_slabs = 0;
  for (Layer& L : st->layers_) {
    if (L.n_expert == 0) continue;
    L.first_slab = n_slabs;
    L.slab_of.assign(static_cast<size_t>(L.n_expert), -1);
    L.score.assign(static_cast<size_t>(L.n_expert), 0.0f);
    L.gets.assign(static_cast<size_t>(L.n_expert), 0);
    L.failed.assign(static_cast<size_t>(L.n_expert), 0);
    n_slabs += std::min(st->cap_, L.n_expert);
  }
  // One allocation for every slab: page-aligned (direct I/O), never moved, no per-load malloc.
  // One slab more, left zero: the zero expert a get() whose read failed returns.
  st->arena_bytes_ = st->slab_bytes_ * static_cast<uint64_t>(n_slabs + 1);
  void* p =
      ::mmap(nullptr, st->arena_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return Status::errorf("expert cache: cannot allocate {} slabs of {} bytes: {}", n_slabs,
                          st->slab_bytes_, std::strerror(errno));
  st->arena_ = static_cast<std::byte*>(p);
  st->slabs_.resize(static_cast<size_t>(n_slabs));
  for (int32_t s = 0; s < n_slabs; ++s)
    st->slabs_[s].mem = st->arena_ + static_cast<uint64_t>(s) * st->slab_bytes_;
  st->dud_ = st->arena_ + static_cast<uint64_t>(n_slabs) * st->slab_bytes_;

  FileReaderOptions ro;
  ro.n_threads = std::max(1, cfg.n_readers);
  ro.force_pread = cfg.force_pread;
  ro.fault_for_testing = cfg.fault_for_testing;
  KILN_ASSIGN_OR_RETURN(st->reader_, FileReader::open(path, ro));
  for (const Layer& L : st->layers_)
    for (const Part& P : L.parts)
      if (L.n_expert > 0 && P.file_offset + P.expert_bytes * static_cast<uint64_t>(L.n_expert) >
                                st->reader_->file_size())
        return Status::errorf("expert cache: '{}' is shorter than its tensor index says", path);

  CounterRegistry& r = process_counters();
  st->hits_ = &r.counter("moe.expert_hits");
  st->misses_ = &r.counter("moe.expert_misses");
  st->bytes_read_ = &r.counter("moe.bytes_read");
  st->prefetch_issued_ = &r.counter("moe.prefetch_issued");
  st->prefetch_hits_ = &r.counter("moe.prefetch_hits");
  st->evictions_ = &r.counter("moe.evictions");
  st->load_timer_ = &r.timer("moe.load");
  st->stall_timer_ = &r.timer("moe.stall");
  g_any_store.store(true);
  {
    std::lock_guard lock(g_stores_mu);
    std::erase_if(g_stores, [](const auto& w) { return w.expired(); });
    g_stores.push_back(st);
  }
  log_info(
      "expert cache: {} experts per layer over {} MoE layers, {} slabs of {:.2f} MiB "
      "({:.1f} MiB), {}{}",
      st->cap_, n_moe, n_slabs, st->slab_bytes_ / 1048576.0, st->arena_bytes_ / 1048576.0,
      st->reader_->uses_uring() ? "io_uring" : "pread",
      st->reader_->uses_direct() ? " + O_DIRECT" : "");
  return st;
}

ExpertStore::~ExpertStore() {
  drain();
  {
    std::lock_guard lock(mu_);
    for (const Slab& S : slabs_)
      KILN_CHECK(S.pins == 0, "expert store destroyed while expert {} of layer {} is in use",
                 S.expert, S.layer);
  }
  reader_.reset();
  // Unregistered before the unmap, synchronously: a registration that outlived its memory
  // would leave the driver holding page-locked ranges of whatever is mapped there next.
  host_registration_.reset();
  if (arena_) ::munmap(arena_, arena_bytes_);
}

std::string ExpertStore::popularity_summary() {
  std::lock_guard lock(mu_);
  uint64_t total = 0, top25 = 0, top10 = 0;
  for (const Layer& L : layers_) {
    if (L.n_expert == 0) continue;
    std::vector<uint64_t> g = L.gets;
    std::sort(g.begin(), g.end(), std::greater<>());
    const size_t q25 = std::max<size_t>(1, g.size() / 4), q10 = std::max<size_t>(1, g.size() / 10);
    for (size_t i = 0; i < g.size(); ++i) {
      total += g[i];
      if (i < q25) top25 += g[i];
      if (i < q10) top10 += g[i];
    }
  }
  if (total == 0) return {};
  return fmt::format(
      "moe: routing popularity: the most used 25 % of each layer's experts took "
      "{:.1f} % of the gets, the top 10 % {:.1f} %\n",
      100.0 * double(top25) / double(total), 100.0 * double(top10) / double(total));
}

uint64_t ExpertStore::content_key(int32_t layer, int32_t expert, int part) const {
  return (store_id_ << 48) | (static_cast<uint64_t>(layer) << 24) |
         (static_cast<uint64_t>(expert) << 2) | static_cast<uint64_t>(part + 1);
}

void ExpertStore::register_slabs(const HostRegistrar& reg) {
  std::lock_guard lock(mu_);
  if (host_registration_ || arena_ == nullptr) return;
  // Once, for the whole slab mapping (one call for every slab): loads keep writing into the
  // registered pages, and the device tier copies each expert out synchronously while the
  // forward pass holds its pin (backend/cuda: CudaBackend's expert tier), so no device read
  // of a slab is ever pending when the store reuses it for another expert.
  host_registration_ = reg(std::span<std::byte>(arena_, arena_bytes_));
}

void ExpertStore::drain() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return in_flight_ == 0; });
}

int32_t ExpertStore::n_expert(int32_t layer) const {
  KILN_CHECK(layer >= 0 && layer < n_layer(), "layer {} of {}", layer, n_layer());
  return layers_[static_cast<size_t>(layer)].n_expert;
}

int32_t ExpertStore::victim(const Layer& L, std::span<const int32_t> keep) const {
  int32_t best = -1;
  const int32_t n = std::min(cap_, L.n_expert);
  for (int32_t s = L.first_slab; s < L.first_slab + n; ++s) {
    const Slab& S = slabs_[static_cast<size_t>(s)];
    if (S.state == SlabState::Empty && S.pins == 0) return s;
    if (S.state != SlabState::Ready || S.pins > 0) continue;
    if (std::find(keep.begin(), keep.end(), S.expert) != keep.end()) continue;
    if (best < 0 || S.last_use < slabs_[static_cast<size_t>(best)].last_use) best = s;
  }
  return best;
}

void ExpertStore::start_load(std::unique_lock<std::mutex>& lock, int32_t layer, int32_t expert,
                             int32_t s, bool prefetch) {
  Slab& S = slabs_[static_cast<size_t>(s)];
  if (S.expert >= 0) {
    layers_[static_cast<size_t>(S.layer)].slab_of[static_cast<size_t>(S.expert)] = -1;
    evictions_->add();
  }
  Layer& L = layers_[static_cast<size_t>(layer)];
  S.layer = layer;
  S.expert = expert;
  S.state = SlabState::Loading;
  S.prefetched = prefetch;
  S.hinted = false;
  S.last_use = ++tick_;
  S.load_start = std::chrono::steady_clock::now();
  L.slab_of[static_cast<size_t>(expert)] = s;
  ++in_flight_;
  ReadRequest reqs[3];
  uint64_t total = 0;
  for (int p = 0; p < 3; ++p) {
    const Part& P = L.parts[p];
    const uint64_t off = P.file_offset + static_cast<uint64_t>(expert) * P.expert_bytes;
    const uint64_t lo = align_down(off), hi = round_up(off + P.expert_bytes, kDirectAlign);
    reqs[p] = ReadRequest{lo, std::span<std::byte>(S.mem + P.slab_offset, hi - lo)};
    total += hi - lo;
  }
  bytes_read_->add(total);
  if (prefetch) prefetch_issued_->add();
  // The slab is Loading, so nothing else touches it until on_loaded(); the reader may call
  // back at once, which takes mu_.
  lock.unlock();
  reader_->submit(reqs, [this, s](Status st) { on_loaded(s, st); });
  lock.lock();
}

void ExpertStore::on_loaded(int32_t s, const Status& st) {
  std::lock_guard lock(mu_);
  Slab& S = slabs_[static_cast<size_t>(s)];
  const auto d = std::chrono::steady_clock::now() - S.load_start;
  load_timer_->record(d);
  record_latency(std::chrono::duration_cast<std::chrono::nanoseconds>(d));
  if (st) {
    S.state = SlabState::Ready;
  } else {
    Layer& L = layers_[static_cast<size_t>(S.layer)];
    L.slab_of[static_cast<size_t>(S.expert)] = -1;
    // A prefetch was a guess: nobody waits for it, and a get() will simply load it again.
    if (!S.prefetched) L.failed[static_cast<size_t>(S.expert)] = 1;
    log_warn("expert cache: loading expert {} of layer {} failed: {}", S.expert, S.layer,
             st.message());
    S.layer = S.expert = -1;
    S.state = SlabState::Empty;
    S.prefetched = false;
    last_failure_ = st;
  }
  --in_flight_;
  cv_.notify_all();
}

void ExpertStore::prefetch_next(std::unique_lock<std::mutex>& lock, int32_t layer) {
  // The next MoE layer in execution order (after the last one: the first, for the next token).
  const int32_t n = n_layer();
  int32_t next = -1;
  for (int32_t i = 1; i <= n && next < 0; ++i)
    if (layers_[static_cast<size_t>((layer + i) % n)].n_expert > 0) next = (layer + i) % n;
  if (next < 0 || next == layer) return;
  Layer& L = layers_[static_cast<size_t>(next)];
  // Its routing is not known yet; what it will likely need are its most used experts. Load
  // the popular ones that are missing in place of clearly less popular ones, so the resident
  // set follows a skewed (Zipf-like) popularity; under uniform routing the margin keeps this
  // from churning.
  const int32_t n_slots = std::min(cap_, L.n_expert);
  std::vector<int32_t> top(static_cast<size_t>(L.n_expert));
  for (int32_t e = 0; e < L.n_expert; ++e) top[e] = e;
  std::partial_sort(top.begin(), top.begin() + n_slots, top.end(), [&](int32_t a, int32_t b) {
    return L.score[a] > L.score[b] || (L.score[a] == L.score[b] && a < b);
  });
  top.resize(static_cast<size_t>(n_slots));
  for (int32_t e : std::vector<int32_t>(top)) {  // start_load unlocks; iterate a copy
    if (L.slab_of[static_cast<size_t>(e)] >= 0) continue;
    const int32_t v = victim(L, top);
    if (v < 0) break;
    const Slab& V = slabs_[static_cast<size_t>(v)];
    if (V.expert >= 0 && !(L.score[e] > 2 * L.score[static_cast<size_t>(V.expert)] + 1)) continue;
    start_load(lock, next, e, v, true);
  }
}

void ExpertStore::will_need(int32_t layer, std::span<const int32_t> experts) {
  KILN_CHECK(layer >= 0 && layer < n_layer(), "layer {} of {}", layer, n_layer());
  Layer& L = layers_[static_cast<size_t>(layer)];
  std::vector<int32_t> want;
  for (int32_t e : experts) {
    KILN_CHECK(e >= 0 && e < L.n_expert, "expert {} of {} in layer {}", e, L.n_expert, layer);
    if (std::find(want.begin(), want.end(), e) == want.end()) want.push_back(e);
  }
  std::unique_lock lock(mu_);
  for (int32_t e : want) {
    if (L.slab_of[static_cast<size_t>(e)] >= 0) continue;
    const int32_t v = victim(L, want);
    if (v < 0) break;
    misses_->add();
    start_load(lock, layer, e, v, false);
    slabs_[static_cast<size_t>(v)].hinted = true;
  }
}

ExpertWeights ExpertStore::views(int32_t s) {
  Slab& S = slabs_[static_cast<size_t>(s)];
  const Layer& L = layers_[static_cast<size_t>(S.layer)];
  WeightMatrix m[3];
  for (int p = 0; p < 3; ++p) {
    const Part& P = L.parts[p];
    const uint64_t off = P.file_offset + static_cast<uint64_t>(S.expert) * P.expert_bytes;
    m[p] = P.shape;
    m[p].bytes =
        std::span<const std::byte>(S.mem + P.slab_offset + (off - align_down(off)), P.expert_bytes);
    // The slab holds other experts later: a device backend caches the slice by this name.
    m[p].content_key = content_key(S.layer, S.expert, p);
  }
  const std::thread::id me = std::this_thread::get_id();
  Layer& HL = layers_[static_cast<size_t>(S.layer)];
  auto* h = holder(HL, me);
  KILN_CHECK(h != nullptr, "pin of layer {} without admission", S.layer);
  ++h->second;
  ++S.pins;
  return ExpertWeights{.gate = m[0],
                       .up = m[1],
                       .down = m[2],
                       .hold = std::shared_ptr<const void>(S.mem, Unpin{this, s, me})};
}

Status ExpertStore::take_error() {
  std::lock_guard lock(mu_);
  Status e = pending_error_;
  pending_error_ = Status::ok();
  return e;
}

ExpertWeights ExpertStore::dud(int32_t layer) const {
  const Layer& L = layers_[static_cast<size_t>(layer)];
  WeightMatrix m[3];
  for (int p = 0; p < 3; ++p) {
    m[p] = L.parts[p].shape;
    m[p].bytes = std::span<const std::byte>(dud_, L.parts[p].expert_bytes);
    // Its own key: a device backend must never cache these zeros as a real expert.
    m[p].content_key = content_key(layer, kDudExpert, p);
  }
  return ExpertWeights{.gate = m[0], .up = m[1], .down = m[2], .hold = nullptr};
}

ExpertWeights ExpertStore::get(int32_t layer, int32_t expert) {
  KILN_CHECK(layer >= 0 && layer < n_layer(), "layer {} of {}", layer, n_layer());
  Layer& L = layers_[static_cast<size_t>(layer)];
  KILN_CHECK(expert >= 0 && expert < L.n_expert, "expert {} of {} in layer {}", expert, L.n_expert,
             layer);
  std::unique_lock lock(mu_);
  if (layer != last_layer_) {  // entering a layer: the next one can start loading
    last_layer_ = layer;
    for (float& sc : L.score) sc *= 0.95f;  // popularity over roughly the last 20 tokens
    if (prefetch_) prefetch_next(lock, layer);
  }
  L.score[static_cast<size_t>(expert)] += 1.0f;
  ++L.gets[static_cast<size_t>(expert)];

  bool counted = false;
  std::chrono::steady_clock::time_point wait_start{};
  bool waited = false;
  const std::thread::id me = std::this_thread::get_id();
  if (holder(L, me) == nullptr) {
    // Admission (see Layer::holders); the entry is made now, before any load unlocks mu_,
    // so two threads cannot both be admitted into the last place.
    auto fits = [&] {
      return static_cast<int64_t>(L.holders.size() + 1) * L.n_used <= std::min(cap_, L.n_expert);
    };
    if (!fits()) {
      wait_start = std::chrono::steady_clock::now();
      waited = true;
      cv_.wait(lock, fits);
    }
    L.holders.emplace_back(me, 0);
  }
  for (;;) {
    const int32_t s = L.slab_of[static_cast<size_t>(expert)];
    if (s >= 0) {
      Slab& S = slabs_[static_cast<size_t>(s)];
      if (!counted) {
        if (!S.hinted) hits_->add();
        if (S.prefetched) prefetch_hits_->add();
        counted = true;
      }
      S.prefetched = S.hinted = false;
      if (S.state == SlabState::Ready) {
        if (waited) stall_timer_->record(std::chrono::steady_clock::now() - wait_start);
        S.last_use = ++tick_;
        return views(s);
      }
      if (!waited) wait_start = std::chrono::steady_clock::now(), waited = true;
      cv_.wait(lock, [&] {
        return L.slab_of[static_cast<size_t>(expert)] != s || S.state != SlabState::Loading;
      });
      continue;
    }
    if (L.failed[static_cast<size_t>(expert)]) {
      // Its load failed (this get's or an earlier will_need's): report it once; the next get
      // of this expert reads it again.
      L.failed[static_cast<size_t>(expert)] = 0;
      if (pending_error_)
        pending_error_ = last_failure_.context(
            fmt::format("expert cache: expert {} of layer {}", expert, layer));
      if (auto* h = holder(L, me); h != nullptr && h->second == 0) {
        *h = L.holders.back();
        L.holders.pop_back();
        cv_.notify_all();
      }
      return dud(layer);
    }
    const int32_t v = victim(L, {});
    if (v >= 0) {
      if (!counted) {
        misses_->add();
        counted = true;
      }
      start_load(lock, layer, expert, v, false);
      continue;
    }
    // Every slab of the layer is loading or pinned. Loads finish and other threads release
    // their pins; pins held only by this thread never go away while it waits here.
    bool any_loading = false;
    for (int32_t i = L.first_slab; i < L.first_slab + std::min(cap_, L.n_expert); ++i)
      any_loading |= slabs_[static_cast<size_t>(i)].state == SlabState::Loading;
    const bool all_mine = L.holders.size() == 1 && L.holders[0].first == me;
    KILN_CHECK(any_loading || !all_mine,
               "expert cache: layer {} needs more than {} experts at once (all pinned by this "
               "thread); raise --expert-cap / --expert-cache",
               layer, cap_);
    if (!waited) wait_start = std::chrono::steady_clock::now(), waited = true;
    cv_.wait(lock);
  }
}

}  // namespace kiln::moe
