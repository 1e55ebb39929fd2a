// backend/cuda/weight_arena.h: weights on the device. An optional region (the model's whole
// tensor data) goes into one allocation up front; other weights are uploaded on first use into
// bump-allocated arena chunks and found again by host address. Every upload goes through two
// pinned staging buffers on the copy stream; ready() is recorded after the last one, and the
// compute stream waits on it before reading weights.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <tuple>
#include <span>
#include <vector>

#include "backend/cuda/cuda_util.h"
#include "core/status.h"

namespace kiln::cuda {

struct ArenaStats {
  uint64_t bytes_uploaded = 0, uploads = 0, cache_hits = 0, arena_bytes = 0;
  double upload_seconds = 0;
  bool zero_copy = false;  // the region is registered host memory, not a device copy
};

class WeightArena {
 public:
  WeightArena(cudaStream_t copy_stream, size_t chunk_bytes, bool verify);
  ~WeightArena();
  WeightArena(const WeightArena&) = delete;
  WeightArena& operator=(const WeightArena&) = delete;

  Status init();  // staging buffers and events
  // Uploads `region` into one allocation; later lookups inside it need no upload.
  Status upload_region(std::span<const std::byte> region, bool progress);
  // Maps `region` for the device where it lies (cudaHostRegister of its page-rounded range,
  // read-only, no copy): native on unified-memory GPUs, over PCIe on discrete ones. An error
  // when the driver refuses; callers then fall back to upload_region.
  Status register_region(std::span<const std::byte> region);
  // Device address of `bytes`, uploading them first if no cached copy holds them. Aborts on
  // device errors (out of memory included: the message names the sizes).
  const std::byte* lookup(std::span<const std::byte> bytes);
  // Device address of a compact copy of n_rows rows of row_bytes each, stride bytes apart
  // from `base` (a column block of a wider matrix: a tensor-parallel row-parallel shard),
  // gathered through the staging buffers on first use. Aborts on device errors.
  const std::byte* lookup_rows(const std::byte* base, size_t row_bytes, size_t stride,
                               int64_t n_rows);
  // True when `bytes` lie inside the region (lookup() of them is an offset, never an upload).
  bool holds(std::span<const std::byte> bytes) const {
    return !region_.empty() && !bytes.empty() && bytes.data() >= region_.data() &&
           bytes.data() + bytes.size() <= region_.data() + region_.size();
  }
  // Recorded after the latest upload; wait on it before kernels read what lookup() returned.
  cudaEvent_t ready() const { return ready_.get(); }
  const ArenaStats& stats() const { return stats_; }

 private:
  struct Entry {
    size_t size = 0;
    std::byte* dev = nullptr;
    // Verify mode only: the bytes as uploaded. A lookup compares just the bytes it asks for
    // (the caller owns those; the rest of a stale entry's host range may be unmapped).
    std::vector<std::byte> shadow;
  };
  Status allocate(size_t bytes, std::byte** out);
  Status upload(std::span<const std::byte> src, std::byte* dst, bool progress);
  // Uploads `total` bytes to dst; fill(off, n, staging) writes bytes [off, off + n) of the
  // compact source into the staging buffer.
  Status upload_gather(size_t total, const std::function<void(size_t, size_t, std::byte*)>& fill,
                       std::byte* dst, bool progress);

  cudaStream_t copy_;
  size_t chunk_bytes_;
  bool verify_;
  std::span<const std::byte> region_;
  std::byte* region_dev_ = nullptr;            // device address of region_.data()
  const std::byte* registered_ = nullptr;      // page-aligned base of a registered region
  std::map<const std::byte*, Entry> entries_;  // by host start address
  // lookup_rows copies by (base, row_bytes, stride, n_rows).
  std::map<std::tuple<const std::byte*, size_t, size_t, int64_t>, std::byte*> gathered_;
  struct Chunk {
    void* base = nullptr;
    size_t capacity = 0, used = 0;
  };
  std::vector<Chunk> chunks_;
  PinnedBuffer staging_[2];
  Event staged_[2];  // copy out of staging_[i] finished
  Event ready_;
  ArenaStats stats_;
};

}  // namespace kiln::cuda
