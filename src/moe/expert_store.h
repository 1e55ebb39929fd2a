// moe/expert_store.h: the CPU tier of MoE expert streaming. An ExpertSource that keeps a
// budget of experts per layer resident in fixed-size slabs carved from one allocation,
// evicts the least recently used, and loads misses from the GGUF file with parallel readers
// (moe/file_reader.h). Outputs are bit-identical to the mapped source: a slab holds the very
// bytes of the expert's slices, and the kernels see the same alignment modulo 4 KiB.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/counters.h"
#include "core/status.h"
#include "moe/expert_source.h"
#include "moe/file_reader.h"

namespace kiln::moe {

struct StoreConfig {
  int64_t cache_bytes = 0;      // slab budget over all MoE layers (split evenly); 0: unset
  int64_t cap = 0;              // experts resident per layer; 0: unset. Both set: the smaller wins
  bool prefetch = false;        // while layer l runs, load what layer l+1 used last time
  bool force_pread = false;     // tests: the io_uring-unavailable path
  ReadFault fault_for_testing;  // tests: fails or shortens reads (moe/file_reader.h)
  int32_t n_readers = 4;
  bool enabled() const { return cache_bytes != 0 || cap != 0; }
};

// Where each MoE layer's stacked expert tensors lie in the file.
struct StoreLayer {
  StackedExperts tensors;     // views into the mapping (only their shapes and offsets are used)
  int32_t n_expert_used = 0;  // experts one token needs in this layer
};

// Pin semantics (the ExpertSource contract, strengthened): the views of a get() stay valid
// while any copy of the returned ExpertWeights lives (ExpertWeights::hold). The forward pass
// holds one token's selection (n_expert_used experts) of one layer at once; create()
// guarantees a cap of at least that, and admission per layer (Layer::holders) keeps threads
// that share the store from deadlocking on each other's partial selections. A get() that
// finds every slab of its layer pinned waits for another thread to release one; if the
// calling thread holds them all, that is a programming error and aborts with a message (it
// could never be satisfied).
class ExpertStore final : public ExpertSource {
 public:
  // `path` is the file the views of `mapping_base` came from. Errors (one line): budget
  // below the experts one token needs, non-positive values, unreadable file.
  static Expected<std::shared_ptr<ExpertStore>> create(const std::string& path,
                                                       const std::byte* mapping_base,
                                                       std::vector<StoreLayer> layers,
                                                       const StoreConfig& cfg);
  ~ExpertStore() override;

  // A read error or short read does not abort: the get() returns zero weights and the error
  // is latched for take_error(), which the engine checks after each forward pass (the step
  // fails with the error's line and its KV rows are dropped).
  ExpertWeights get(int32_t layer, int32_t expert) override;
  Status take_error() override;
  int32_t n_layer() const override { return static_cast<int32_t>(layers_.size()); }
  int32_t n_expert(int32_t layer) const override;
  // Starts loading the missing experts of `experts` (up to the free slabs of the layer, never
  // evicting one of `experts`), all at once on the readers; the get()s then wait only for
  // their own slab. Counted as misses here, so the get()s do not count them again.
  void will_need(int32_t layer, std::span<const int32_t> experts) override;

  int32_t cap_per_layer() const { return cap_; }
  uint64_t slab_bytes() const { return slab_bytes_; }
  uint64_t total_slab_bytes() const { return slab_bytes_ * slabs_.size(); }
  bool uses_uring() const { return reader_->uses_uring(); }
  bool uses_direct() const { return reader_->uses_direct(); }
  // Blocks until no load is in flight (tests, benchmarks between phases).
  void drain();
  // Registers the slab memory once through `reg` (Backend::register_host_memory: a device
  // backend copies expert slices out of it) and keeps the handle it returns; the handle is
  // released before the memory is unmapped, in the destructor. Safe to call again (no-op).
  using HostRegistrar = std::function<std::shared_ptr<void>(std::span<std::byte>)>;
  void register_slabs(const HostRegistrar& reg);
  // How skewed the routing was: the share of get()s that went to the most used 25 % / 10 %
  // of each layer's experts, over every MoE layer ("" before the first get).
  std::string popularity_summary();
  bool slabs_registered() const { return host_registration_ != nullptr; }
  // WeightMatrix::content_key of part (0 gate, 1 up, 2 down) of an expert: nonzero, distinct
  // per (store, layer, expert, part), the same whichever slab holds the expert.
  uint64_t content_key(int32_t layer, int32_t expert, int part) const;

 private:
  struct Part {                 // one of gate/up/down of one layer
    WeightMatrix shape;         // rows of one expert; bytes unset
    uint64_t file_offset = 0;   // of expert 0's slice
    uint64_t expert_bytes = 0;  // bytes of one expert's slice
    uint64_t slab_offset = 0;   // where this part's aligned read starts inside a slab
  };
  struct Layer {
    int32_t n_expert = 0, n_used = 0;
    Part parts[3];
    int32_t first_slab = 0;        // slabs [first_slab, first_slab + cap) belong to this layer
    std::vector<int32_t> slab_of;  // [n_expert] slab holding the expert, or -1
    std::vector<float> score;      // [n_expert] decayed use counts (prefetch's popularity)
    std::vector<uint64_t> gets;    // [n_expert] get() calls (the routing's popularity)
    std::vector<uint8_t> failed;   // [n_expert] a demanded load failed; the next get() reports it
    // Threads holding pins in this layer and how many. A thread that holds none enters only
    // while (holders + 1) * n_used <= cap: each holder may then take the n_used experts one
    // token needs without waiting on another holder, so concurrent sessions cannot deadlock
    // holding part of their selection each.
    std::vector<std::pair<std::thread::id, int32_t>> holders;
  };
  enum class SlabState : uint8_t { Empty, Loading, Ready };
  struct Slab {
    int32_t layer = -1, expert = -1;
    SlabState state = SlabState::Empty;
    int32_t pins = 0;
    bool prefetched = false;  // loaded by prefetch and not yet used
    bool hinted = false;      // loaded by will_need (already counted as a miss)
    uint64_t last_use = 0;
    std::chrono::steady_clock::time_point load_start;
    std::byte* mem = nullptr;
  };
  struct Unpin;

  ExpertStore() = default;
  // Picks a slab of `layer` to reuse: an empty one, else the least recently used unpinned
  // ready one whose expert is not in `keep`; -1 if none is free now. Caller holds mu_.
  int32_t victim(const Layer& L, std::span<const int32_t> keep) const;
  static std::pair<std::thread::id, int32_t>* holder(Layer& L, std::thread::id t);
  // Starts loading `expert` into slab `s` (caller holds mu_; the read runs on the readers).
  void start_load(std::unique_lock<std::mutex>& lock, int32_t layer, int32_t expert, int32_t s,
                  bool prefetch);
  void on_loaded(int32_t s, const Status& st);
  void prefetch_next(std::unique_lock<std::mutex>& lock, int32_t layer);
  ExpertWeights views(int32_t s);
  ExpertWeights dud(int32_t layer) const;               // the zero expert (views of dud_), unpinned
  static constexpr int32_t kDudExpert = (1 << 22) - 1;  // its content_key's expert id

  std::unique_ptr<FileReader> reader_;
  std::vector<Layer> layers_;  // [n_layer]; n_expert == 0 for dense layers
  int32_t cap_ = 0;
  uint64_t slab_bytes_ = 0;
  bool prefetch_ = false;
  std::byte* arena_ = nullptr;  // one anonymous mapping of slabs_.size() * slab_bytes_
  uint64_t arena_bytes_ = 0;
  uint64_t store_id_ = 0;                    // distinguishes stores' content keys
  std::shared_ptr<void> host_registration_;  // register_slabs(); released before the unmap

  std::mutex mu_;
  std::condition_variable cv_;  // a load finished or a pin was released
  std::vector<Slab> slabs_;
  uint64_t tick_ = 0;
  int32_t last_layer_ = -1;
  int32_t in_flight_ = 0;
  // A failed read (moe/file_reader.h) leaves its slab Empty and the cache as it was; the
  // get() that wanted the expert returns the zero expert (dud_) and latches the error here for
  // take_error(), and a later get() of that expert reads it again.
  Status last_failure_;       // the most recent failed load's error
  Status pending_error_;      // latched by a get() that returned the zero expert
  std::byte* dud_ = nullptr;  // one zero-filled slab after the others, never loaded

  Counter *hits_, *misses_, *bytes_read_, *prefetch_issued_, *prefetch_hits_, *evictions_;
  Timer *load_timer_, *stall_timer_;
};

// Load-latency percentiles (microseconds) of every store in this process, from a log-scale
// histogram (bucket upper bounds, so within a factor of 2^(1/4)); 0 before the first load.
double load_latency_percentile_us(double q);
// "moe: ..." lines for --stats: cache shape, hit rate, bytes, p50/p99, stall; empty when no
// store ran in this process.
std::string format_store_stats();

}  // namespace kiln::moe
