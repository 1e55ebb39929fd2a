// backend/cuda/expert_tier.h: the device tier of streamed MoE expert slices (issue 9,
// docs/architecture.md "Device tier"): slices named by WeightMatrix::content_key kept within
// CudaOptions::expert_cache_bytes, evicted in the order of backend/tier_policy.h, copied in
// by the op that looks them up.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_util.h"
#include "backend/cuda/segment.h"
#include "backend/tier_policy.h"
#include "core/counters.h"

namespace kiln::cuda {

// Two hazards decide the shape of it:
// - The host slab a slice comes from is reused by the store for another expert once the
//   forward pass drops its pin, which can happen before this backend launches the ops it
//   recorded. So the copy has landed before the op that looked the slice up returns, while
//   the caller still holds the pin: nothing reads a host slab later (never a deferred copy or
//   a zero-copy read of it). With CudaOptions::expert_async_copies the op's copies are queued
//   on the compute stream back to back and the op waits once for the last (fence(), at the
//   end of matmul, matmul_batch and get_rows, the ops that look weights up), instead of
//   waiting for each copy in turn.
// - A device slot evicted for a new slice may still be read by recorded or running ops of the
//   current segment. An entry used since the last flush (epoch == flushes) is not evicted
//   while another is left; when only such entries are left, the segment is flushed first (one
//   synchronisation). Under lru that is the old rule exactly (the least recent entry is the
//   first one used in the segment, if any is); lfu looks past them for the first other one.
// Callers hold the backend's mutex.
class ExpertTier {
 public:
  ExpertTier(const CudaOptions& opts, Segment& seg, const Stream& compute)
      : opts_(opts), seg_(seg), compute_(compute), policy_(opts.expert_policy) {}
  ExpertTier(const ExpertTier&) = delete;
  ExpertTier& operator=(const ExpertTier&) = delete;

  cudaError_t init() { return copy_ev_.create(); }  // the fence's event
  // Device address of the slice w names (content_key != 0): found, or copied in (evicting
  // others, flushing the segment when every other may still be read).
  const std::byte* slice(const WeightMatrix& w);
  // The end of every op that looks weights up: its expert copies (queued on the compute
  // stream, ahead of every op recorded after them) have read their host slabs.
  void fence();
  // After each flush of the segment: the slices the op being built looked up count as used
  // after it (a flush inside that op, e.g. cuBLAS workspace growth, comes before the op is
  // recorded).
  void after_flush();

  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }
  uint64_t evictions() const { return evictions_; }
  uint64_t bytes_copied() const { return copied_; }
  uint64_t bytes_held() const { return held_; }
  uint64_t cap() const { return cap_; }

 private:
  void note_op_use(uint64_t key);

  const CudaOptions& opts_;
  Segment& seg_;
  const Stream& compute_;
  struct Slot {
    DeviceBuffer buf;
    size_t bytes = 0;    // the slice's
    size_t offset = 0;   // where the slice starts in buf: host address mod 256, so the
                         // kernels see the alignment the mapped (arena) copy would have
    uint64_t epoch = 0;  // flushes when last used
    uint64_t op = 0;     // op_seq when last looked up
  };
  std::unordered_map<uint64_t, Slot> slots_;
  TierPolicy policy_;
  std::multimap<size_t, DeviceBuffer> free_;  // evicted buffers, by size
  uint64_t cap_ = 0;  // bytes; set on first use from CudaOptions::expert_cache_bytes
  uint64_t held_ = 0, hits_ = 0, misses_ = 0, evictions_ = 0, copied_ = 0;
  uint64_t alloc_ = 0;  // device bytes of every slot buffer, live or free
  // Slices the op being built (op_keys_seq_ == the segment's op_seq) looked up.
  std::vector<uint64_t> op_keys_;
  uint64_t op_keys_seq_ = 0;
  bool unfenced_ = false;  // copies queued since the last fence()
  Event copy_ev_;
  // The process counters (`--stats`, /metrics) of the tier, looked up once.
  Counter *c_hits_ = nullptr, *c_misses_ = nullptr, *c_bytes_ = nullptr, *c_evictions_ = nullptr;
};

}  // namespace kiln::cuda
