// backend/cuda/f16_cache.h: f16 copies of region weights for the cuBLAS path
// (CudaOptions::f16_cache_bytes): written once, at a weight's first GEMM, and read by every
// later one instead of dequantizing the weight into scratch on each call.
#pragma once

#include <cstdint>
#include <unordered_map>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_util.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/profiler.h"
#include "backend/cuda/segment.h"
#include "backend/cuda/weight_arena.h"

namespace kiln::cuda {

// Copies by the weight's device address. The region's bytes never change while the backend
// lives (the GGUF mapping is read-only; verify mode refreshes only weights outside it, see
// CudaBackend::Impl::weight_resident), so a copy written once stays the weight's
// dequantization; copies are freed with the backend only, so no graph ever names a freed one.
// Callers hold the backend's mutex.
class F16Cache {
 public:
  F16Cache(const CudaOptions& opts, Segment& seg, const Profiler& prof)
      : opts_(opts), seg_(seg), prof_(prof) {}
  F16Cache(const F16Cache&) = delete;
  F16Cache& operator=(const F16Cache&) = delete;

  // The weight as the cuBLAS path should read it: its f16 copy (recording the one
  // dequantization into it on first use, ahead of the caller's op in stream order) when the
  // cache takes it, else dw itself. Records an op: call before the caller's staging.
  DeviceWeight cached(const WeightMatrix& w, const DeviceWeight& dw, const WeightArena& arena);

  uint64_t weights() const { return copies_.size(); }
  uint64_t bytes() const { return used_; }
  uint64_t cap() const { return cap_; }

 private:
  const CudaOptions& opts_;
  Segment& seg_;
  const Profiler& prof_;
  std::unordered_map<const std::byte*, DeviceBuffer> copies_;
  uint64_t cap_ = 0, used_ = 0;
  bool capped_ = false;  // cap_ set (at the first copy)
};

}  // namespace kiln::cuda
