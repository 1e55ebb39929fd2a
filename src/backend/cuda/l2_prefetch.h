// backend/cuda/l2_prefetch.h: which weight bytes a prefetch hint (Backend::prefetch_weights)
// pulls into the GPU's L2 cache. Plain C++ (the host tests run it without a GPU); the kernel
// that issues the ranges is prefetch.cu's launch_l2_prefetch.
//
// Why: a one-token decode step alternates weight-bound matvecs with latency-bound small ops
// (RoPE, the KV store, attention over a short context, norms, activation quantization) during
// which the device memory sits idle: ~30 % of an 8B Q4_K_M step on the H200
// (docs/BENCHMARKS.md, CUDA session 16). A hint issued before such ops names the weights of
// the matmuls that come next; their leading bytes are read into L2 meanwhile, and the matvec
// later finds them there instead of in device memory.
//
// The planner keeps, per weight, how many of its leading bytes earlier hints already covered
// (the cursor), so consecutive hints continue where the last stopped; a matmul that reads the
// weight drops its cursor (what it read is no longer worth holding). Each hint covers at most
// `budget` new bytes, and the bytes covered and not yet read stay within `cap` (a share of the
// L2, so one hint's lines are not evicted by the next one's before their matvec reads them).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace kiln::cuda {

struct PrefetchRange {
  const std::byte* p = nullptr;  // 16-byte aligned
  size_t bytes = 0;              // a multiple of 16
};

class L2PrefetchPlan {
 public:
  L2PrefetchPlan(size_t budget, size_t cap) : budget_(budget), cap_(cap) {}

  // The ranges to prefetch for a hint naming `weights` (device bytes, in the order the coming
  // matmuls read them): each weight's bytes after its cursor, in order, until the hint's
  // budget or the cap is spent. Ranges are trimmed inward to 16-byte bounds.
  std::vector<PrefetchRange> hint(std::span<const std::span<const std::byte>> weights) {
    std::vector<PrefetchRange> out;
    size_t left = std::min(budget_, cap_ > held_ ? cap_ - held_ : 0);
    for (std::span<const std::byte> w : weights) {
      if (left == 0) break;
      if (w.empty()) continue;
      size_t& done = cursor_[w.data()];
      if (done >= w.size()) continue;
      const size_t take = std::min(left, w.size() - done);
      const auto a = reinterpret_cast<uintptr_t>(w.data() + done);
      const uintptr_t lo = (a + 15) & ~uintptr_t(15), hi = (a + take) & ~uintptr_t(15);
      done += take;
      held_ += take;
      left -= take;
      if (hi > lo)
        out.push_back({w.data() + (lo - reinterpret_cast<uintptr_t>(w.data())), size_t(hi - lo)});
    }
    return out;
  }
  // A matmul read the weight starting at p: its covered bytes no longer count against the cap.
  void consumed(const std::byte* p) {
    if (cursor_.empty()) return;
    if (auto it = cursor_.find(p); it != cursor_.end()) {
      held_ -= std::min(held_, it->second);
      cursor_.erase(it);
    }
  }
  // A new step: every cursor goes (a hinted weight that no matmul read, e.g. the output head of
  // a step without logits, must not hold the cap forever).
  void reset() {
    cursor_.clear();
    held_ = 0;
  }
  size_t held() const { return held_; }

 private:
  size_t budget_, cap_;
  size_t held_ = 0;  // bytes covered by hints and not yet read
  std::unordered_map<const std::byte*, size_t> cursor_;
};

}  // namespace kiln::cuda
