// backend/cuda/l2_prefetcher.h: Backend::prefetch_weights on the device
// (CudaOptions::l2_prefetch_bytes): a hint names the weights of the coming matmuls, the
// l2_prefetch.h planner picks their next leading bytes, and a prefetch kernel (prefetch.cu)
// pulls them into L2 on the segment's side stream while the latency-bound ops before their
// matvecs run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/l2_prefetch.h"
#include "backend/cuda/segment.h"
#include "backend/cuda/weight_arena.h"

namespace kiln::cuda {

// Safe beside the compute stream's kernels because it only reads region weights, which no
// kernel writes and whose upload landed before the backend was made (make_cuda_backend waits
// for it), and L2 is the device memory's point of coherence: a prefetched line is the line
// every later load would read. Callers hold the backend's mutex.
class L2Prefetcher {
 public:
  explicit L2Prefetcher(Segment& seg) : seg_(seg) {}
  L2Prefetcher(const L2Prefetcher&) = delete;
  L2Prefetcher& operator=(const L2Prefetcher&) = delete;

  // Hints are planned from now on: up to `budget` new bytes each, at most `cap` hinted and not
  // yet read (the segment's branches must be initialised). Before: every hint is ignored.
  void start(uint64_t budget, size_t cap) { plan_.emplace(budget, cap); }
  // Records a prefetch of the leading bytes of ws (the weights of the coming matmuls, in the
  // order they read them) after the ops recorded so far: one-token steps, K-quant region
  // weights only (see l2_prefetch_type), nothing when the region is mapped from host memory.
  void hint(std::span<const WeightMatrix* const> ws, int64_t n_tok, WeightArena& arena);
  // A matmul is about to read the weight at p / a new step (the segment was flushed).
  void consumed(const std::byte* p) {
    if (plan_) plan_->consumed(p);
  }
  void reset() {
    if (plan_) plan_->reset();
  }

  uint64_t hints() const { return hints_; }  // hints that launched a prefetch
  uint64_t bytes() const { return bytes_; }  // and the bytes they named

 private:
  Segment& seg_;
  std::optional<L2PrefetchPlan> plan_;
  uint64_t hints_ = 0, bytes_ = 0;
  std::vector<std::span<const std::byte>> named_;  // hint()'s scratch
};

}  // namespace kiln::cuda
