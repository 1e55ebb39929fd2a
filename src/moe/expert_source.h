// moe/expert_source.h: the one door through which forward passes reach expert weights. The
// mapped implementation hands out slices of the GGUF's 3-D expert tensors (no copy); the
// streaming issue swaps in a cache behind the same interface without touching model code.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "core/status.h"
#include <vector>

#include "backend/backend.h"

namespace kiln::moe {

// One expert's FFN: gate/up [n_ff_expert rows][n_embd], down [n_embd rows][n_ff_expert].
struct ExpertWeights {
  WeightMatrix gate, up, down;
  // Keeps a cached expert's memory in place while any copy of this value lives (a pin in
  // moe/expert_store.h); null for the mapped source, whose views never move.
  std::shared_ptr<const void> hold;
};

class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  // Expert `expert` of layer `layer`. The views stay valid at least until the next get()
  // call on this source (a cache may recycle the slot after that), so callers finish with
  // one expert before asking for the next. Out-of-range ids are programming errors.
  virtual ExpertWeights get(int32_t layer, int32_t expert) = 0;
  // The first error behind a get() since the last call, cleared: a streaming source whose
  // read failed hands out zero weights rather than abort, and the caller of the forward pass
  // that used them must fail that step. The mapped source never fails.
  virtual Status take_error() { return Status::ok(); }
  virtual int32_t n_layer() const = 0;
  virtual int32_t n_expert(int32_t layer) const = 0;  // 0: dense layer
  // A layer's routing decision before its get()s (ids may repeat): a cache may start
  // loading every missing one in parallel. Only a hint; the mapped source ignores it.
  virtual void will_need(int32_t layer, std::span<const int32_t> experts) {
    (void)layer;
    (void)experts;
  }
};

// The three stacked 3-D tensors of one MoE layer (ggml order): gate/up [n_embd, n_ff, n_expert],
// down [n_ff, n_embd, n_expert], each flattened to n_expert * (rows per expert) rows.
struct StackedExperts {
  int32_t n_expert = 0;
  WeightMatrix gate, up, down;
};

// Zero-copy source over a mapped file: get() is WeightMatrix::rows on the stacked tensors.
// Stateless after construction, so one instance may serve sessions on several threads.
class MappedExpertSource final : public ExpertSource {
 public:
  explicit MappedExpertSource(std::vector<StackedExperts> layers);
  ExpertWeights get(int32_t layer, int32_t expert) override;
  int32_t n_layer() const override { return static_cast<int32_t>(layers_.size()); }
  int32_t n_expert(int32_t layer) const override;
  // The stacked tensors (the expert store reads its file offsets from them).
  const std::vector<StackedExperts>& layers() const { return layers_; }

 private:
  std::vector<StackedExperts> layers_;
};

}  // namespace kiln::moe
