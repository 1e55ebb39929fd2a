// backend/cuda/weight_arena.cpp: the device weight arena (see weight_arena.h).
#include "backend/cuda/weight_arena.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>

#include "core/log.h"
#include "memory/bytes.h"

namespace kiln::cuda {
namespace {

constexpr size_t kStagingBytes = size_t(32) << 20;
constexpr size_t kAlign = 256;

}  // namespace

WeightArena::WeightArena(cudaStream_t copy_stream, size_t chunk_bytes, bool verify)
    : copy_(copy_stream), chunk_bytes_(chunk_bytes), verify_(verify) {}

WeightArena::~WeightArena() {
  // The copy stream may still be reading staging buffers or writing chunks.
  cudaStreamSynchronize(copy_);
  for (Chunk& c : chunks_) cudaFree(c.base);
  if (registered_) {
    cudaHostUnregister(const_cast<std::byte*>(registered_));
  } else if (region_dev_) {
    cudaFree(region_dev_);
  }
}

Status WeightArena::init() {
  for (int i = 0; i < 2; ++i) {
    if (cudaError_t e = staging_[i].allocate(kStagingBytes); e != cudaSuccess)
      return Status::errorf("cuda: pinned staging buffer of {} MiB: {}", kStagingBytes >> 20,
                            cudaGetErrorString(e));
    if (cudaError_t e = staged_[i].create(); e != cudaSuccess)
      return Status::errorf("cuda: event: {}", cudaGetErrorString(e));
  }
  if (cudaError_t e = ready_.create(); e != cudaSuccess)
    return Status::errorf("cuda: event: {}", cudaGetErrorString(e));
  // Record once so that waiting on ready() before any upload is valid.
  if (cudaError_t e = cudaEventRecord(ready_.get(), copy_); e != cudaSuccess)
    return Status::errorf("cuda: event record: {}", cudaGetErrorString(e));
  return Status::ok();
}

Status WeightArena::allocate(size_t bytes, std::byte** out) {
  bytes = (bytes + kAlign - 1) / kAlign * kAlign;
  if (chunks_.empty() || chunks_.back().capacity - chunks_.back().used < bytes) {
    Chunk c;
    c.capacity = bytes > chunk_bytes_ ? bytes : chunk_bytes_;
    if (cudaError_t e = cudaMalloc(&c.base, c.capacity); e != cudaSuccess)
      return Status::errorf("cuda: weight arena: allocating {} MiB more (holding {} MiB): {}",
                            c.capacity >> 20, stats_.arena_bytes >> 20, cudaGetErrorString(e));
    stats_.arena_bytes += c.capacity;
    chunks_.push_back(c);
  }
  Chunk& c = chunks_.back();
  *out = static_cast<std::byte*>(c.base) + c.used;
  c.used += bytes;
  return Status::ok();
}

Status WeightArena::upload(std::span<const std::byte> src, std::byte* dst, bool progress) {
  return upload_gather(
      src.size(),
      [&](size_t off, size_t n, std::byte* out) { std::memcpy(out, src.data() + off, n); }, dst,
      progress);
}

Status WeightArena::upload_gather(size_t total,
                                  const std::function<void(size_t, size_t, std::byte*)>& fill,
                                  std::byte* dst, bool progress) {
  const auto t0 = std::chrono::steady_clock::now();
  auto last_report = t0;
  size_t done = 0;
  for (int piece = 0; done < total; ++piece) {
    const int i = piece % 2;
    const size_t n = std::min(kStagingBytes, total - done);
    // The copy that last read staging_[i] must be finished before it is overwritten; the
    // other buffer's copy overlaps this memcpy.
    if (cudaError_t e = cudaEventSynchronize(staged_[i].get()); piece >= 2 && e != cudaSuccess)
      return Status::errorf("cuda: weight upload: {}", cudaGetErrorString(e));
    fill(done, n, staging_[i].data());
    if (cudaError_t e =
            cudaMemcpyAsync(dst + done, staging_[i].data(), n, cudaMemcpyHostToDevice, copy_);
        e != cudaSuccess)
      return Status::errorf("cuda: weight upload of {} bytes: {}", n, cudaGetErrorString(e));
    if (cudaError_t e = cudaEventRecord(staged_[i].get(), copy_); e != cudaSuccess)
      return Status::errorf("cuda: event record: {}", cudaGetErrorString(e));
    done += n;
    const auto now = std::chrono::steady_clock::now();
    if (progress && now - last_report > std::chrono::milliseconds(500)) {
      last_report = now;
      const double s = std::chrono::duration<double>(now - t0).count();
      log_info("cuda: uploading weights {:.2f} / {:.2f} GiB ({:.1f} GB/s)", done / 1073741824.0,
               total / 1073741824.0, done / s / 1e9);
    }
  }
  if (cudaError_t e = cudaEventRecord(ready_.get(), copy_); e != cudaSuccess)
    return Status::errorf("cuda: event record: {}", cudaGetErrorString(e));
  stats_.bytes_uploaded += total;
  stats_.uploads += 1;
  stats_.upload_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Status::ok();
}

Status WeightArena::upload_region(std::span<const std::byte> region, bool progress) {
  if (region.empty()) return Status::ok();
  if (region_dev_) return Status::error("cuda: weight region already uploaded");
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, region.size()); e != cudaSuccess)
    return Status::errorf("cuda: weight arena of {:.2f} GiB: {}", region.size() / 1073741824.0,
                          cudaGetErrorString(e));
  region_dev_ = static_cast<std::byte*>(p);
  stats_.arena_bytes += region.size();
  region_ = region;
  KILN_TRY(upload(region, region_dev_, progress));
  if (cudaError_t e = cudaStreamSynchronize(copy_); e != cudaSuccess)
    return Status::errorf("cuda: weight upload: {}", cudaGetErrorString(e));
  if (progress)
    log_info("cuda: uploaded {:.2f} GiB of weights in {:.2f} s ({:.1f} GB/s)",
             region.size() / 1073741824.0, stats_.upload_seconds,
             region.size() / stats_.upload_seconds / 1e9);
  return Status::ok();
}

Status WeightArena::register_region(std::span<const std::byte> region) {
  if (region.empty()) return Status::ok();
  if (region_dev_) return Status::error("cuda: weight region already placed");
  // The driver pins whole pages; the logical region stays exact (memory/bytes.h).
  const PageRegion pr = page_region(region);
  int device = 0, read_only_ok = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&read_only_ok, cudaDevAttrHostRegisterReadOnlySupported, device);
  // A read-only file mapping can only be registered read-only.
  const unsigned flags = cudaHostRegisterMapped | cudaHostRegisterPortable |
                         (read_only_ok ? cudaHostRegisterReadOnly : 0u);
  void* base = const_cast<std::byte*>(pr.base);
  if (cudaError_t e = cudaHostRegister(base, pr.device_bytes, flags); e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it for the fallback
    return Status::errorf("cudaHostRegister of {:.2f} GiB{}: {}", pr.device_bytes / 1073741824.0,
                          read_only_ok ? " (read-only)" : "", cudaGetErrorString(e));
  }
  void* dev = nullptr;
  if (cudaError_t e = cudaHostGetDevicePointer(&dev, base, 0); e != cudaSuccess) {
    cudaHostUnregister(base);
    cudaGetLastError();
    return Status::errorf("cudaHostGetDevicePointer: {}", cudaGetErrorString(e));
  }
  registered_ = pr.base;
  region_ = region;
  region_dev_ = static_cast<std::byte*>(dev) + pr.offset;
  stats_.zero_copy = true;
  return Status::ok();
}

const std::byte* WeightArena::lookup(std::span<const std::byte> bytes) {
  if (bytes.empty()) return nullptr;  // a matrix of no rows: nothing to read
  const std::byte* p = bytes.data();
  if (!region_.empty() && p >= region_.data() &&
      p + bytes.size() <= region_.data() + region_.size()) {
    ++stats_.cache_hits;
    return region_dev_ + (p - region_.data());
  }
  // The entry starting at or before p, if it holds all of [p, p + size).
  auto it = entries_.upper_bound(p);
  if (it != entries_.begin()) {
    auto prev = std::prev(it);
    const std::byte* start = prev->first;
    Entry& e = prev->second;
    if (p + bytes.size() <= start + e.size) {
      const size_t off = static_cast<size_t>(p - start);
      if (!verify_ || std::memcmp(e.shadow.data() + off, p, bytes.size()) == 0) {
        ++stats_.cache_hits;
        return e.dev + off;
      }
      // verify mode: the host buffer was reused for other bytes; refresh this range in place.
      std::memcpy(e.shadow.data() + off, p, bytes.size());
      const Status s = upload(bytes, e.dev + off, false);
      KILN_CHECK(s.is_ok(), "{}", s.message());
      return e.dev + off;
    }
  }
  // A new entry replaces cached ones it overlaps (freed host buffers whose addresses were
  // reused); their device space stays in the arena until it is destroyed.
  auto o = entries_.upper_bound(p);
  if (o != entries_.begin()) {
    auto prev = std::prev(o);
    if (prev->first + prev->second.size > p) o = prev;
  }
  while (o != entries_.end() && o->first < p + bytes.size()) o = entries_.erase(o);
  Entry e;
  e.size = bytes.size();
  Status s = allocate(bytes.size(), &e.dev);
  KILN_CHECK(s.is_ok(), "{}", s.message());
  if (verify_) e.shadow.assign(bytes.begin(), bytes.end());
  s = upload(bytes, e.dev, false);
  KILN_CHECK(s.is_ok(), "{}", s.message());
  std::byte* dev = e.dev;
  entries_.emplace(p, std::move(e));
  return dev;
}

const std::byte* WeightArena::lookup_rows(const std::byte* base, size_t row_bytes, size_t stride,
                                          int64_t n_rows) {
  if (n_rows <= 0 || row_bytes == 0) return nullptr;
  const auto key = std::make_tuple(base, row_bytes, stride, n_rows);
  if (auto it = gathered_.find(key); it != gathered_.end()) {
    ++stats_.cache_hits;
    return it->second;
  }
  const size_t total = row_bytes * static_cast<size_t>(n_rows);
  std::byte* dev = nullptr;
  Status s = allocate(total, &dev);
  KILN_CHECK(s.is_ok(), "{}", s.message());
  // Compact byte c is byte c % row_bytes of row c / row_bytes; a staging piece may begin and
  // end inside a row.
  s = upload_gather(
      total,
      [&](size_t off, size_t n, std::byte* out) {
        while (n > 0) {
          const size_t r = off / row_bytes, in = off % row_bytes;
          const size_t take = std::min(n, row_bytes - in);
          std::memcpy(out, base + r * stride + in, take);
          out += take;
          off += take;
          n -= take;
        }
      },
      dev, false);
  KILN_CHECK(s.is_ok(), "{}", s.message());
  gathered_.emplace(key, dev);
  return dev;
}

}  // namespace kiln::cuda
