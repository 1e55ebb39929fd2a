// backend/cuda/l2_prefetcher.cpp: prefetch hints planned and recorded (l2_prefetcher.h).
#include "backend/cuda/l2_prefetcher.h"

#include "backend/cuda/kernels.h"

namespace kiln::cuda {

void L2Prefetcher::hint(std::span<const WeightMatrix* const> ws, int64_t n_tok,
                        WeightArena& arena) {
  // Only one-token steps (kL2PrefetchMaxTokens: one token always takes a matvec kernel, which
  // reads the weight's own bytes in place), the K-quants (l2_prefetch_type), and only region
  // weights: not a streamed expert (its slot may not be filled yet), a gathered column block,
  // nor weights mapped from host memory (zero-copy: over PCIe).
  if (!plan_ || arena.stats().zero_copy || n_tok > kL2PrefetchMaxTokens) return;
  named_.clear();
  for (const WeightMatrix* w : ws) {
    if (w == nullptr || w->n_rows == 0 || w->content_key != 0 || w->strided() ||
        !l2_prefetch_type(w->dtype) || !arena.holds(w->bytes))
      continue;
    named_.emplace_back(arena.lookup(w->bytes), w->bytes.size());  // an offset: holds()
  }
  std::vector<PrefetchRange> ranges = plan_->hint(named_);
  if (ranges.empty()) return;
  seg_.enter();
  ++hints_;
  for (const PrefetchRange& r : ranges) {
    seg_.sig("l2_prefetch", r.p, r.bytes);
    bytes_ += r.bytes;
  }
  seg_.record_branch("l2_prefetch", [ranges = std::move(ranges)](cudaStream_t side) {
    return launch_l2_prefetch(ranges, side);
  });
}

}  // namespace kiln::cuda
