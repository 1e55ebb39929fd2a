// engine/dflash_drafter.h: DFlash block drafting (model/dflash.h) as a Drafter. The drafter
// keeps its own KV cache, in step with the target's accepted history: every target batch the
// speculative decoder evaluates (the prompt prefill, then each verify) hands over the inputs
// of the drafter's target layers (Drafter::wanted_captures / observe_target), and the kept
// rows' features go through fc + norm into the drafter's K/V at the tokens' positions. A
// proposal is one non-causal pass over [last, mask x n] at the next positions; its drafts are
// the argmax (lowest id on ties) of the block's rows 1..n, and the block's own K/V rows are
// dropped again afterwards, so both caches hold exactly the accepted history.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/speculative.h"
#include "kv/kv_cache.h"
#include "model/dflash.h"

namespace kiln {

class DflashDrafter final : public Drafter {
 public:
  // Loads the drafter and checks it against `target` (width, vocabulary, target layers).
  // n_ctx: the target session's context; max_batch: its batch limit (the prefill chunks the
  // drafter receives). Errors: one line naming the file and the mismatch; a tensor-parallel
  // backend (not supported).
  static Expected<std::unique_ptr<DflashDrafter>> create(const std::string& path,
                                                         std::shared_ptr<const Model> target,
                                                         Backend& backend, int32_t n_ctx,
                                                         int32_t max_batch);
  static Expected<std::unique_ptr<DflashDrafter>> create(model::DflashModel drafter,
                                                         std::shared_ptr<const Model> target,
                                                         Backend& backend, int32_t n_ctx,
                                                         int32_t max_batch);
  ~DflashDrafter() override;

  std::string name() const override { return "dflash"; }
  Status prepare(std::span<const int32_t> prompt) override;
  Status propose(const DraftRequest& req, Draft& out) override;
  std::vector<std::string> wanted_captures() const override;
  void observe_target(const model::Capture& capture, int32_t n_rows_kept) override;
  // The features stay in the backend's memory from the target's pass to the fc (on a GPU
  // neither a download nor a wait).
  Backend* capture_device() const override { return &backend_; }
  // Keeps the features of positions < n_pos (n_pos <= n_pos()); a latched observe_target
  // failure refuses anything but 0.
  Status rollback(int32_t n_pos) override;

  // Most drafts one proposal makes: the block size less the anchor.
  int32_t max_draft() const { return drafter_.dp.block_size - 1; }
  const model::DflashModel& drafter() const { return drafter_; }
  // Positions whose features the drafter's cache holds.
  int32_t n_pos() const { return kv_.n_pos(); }
  // Whether each proposal also ships its logits to the host (tests compare them with
  // llama.cpp's); off, only the drafted ids cross (one per row). The drafts are the same.
  void set_keep_logits(bool on) { keep_logits_ = on; }
  // The last proposal's logits, one row per drafted token ([n][n_vocab]), when kept.
  std::span<const float> last_logits() const { return draft_logits_; }

 private:
  DflashDrafter(model::DflashModel d, std::shared_ptr<const Model> target, Backend& be, KvCache kv,
                int32_t max_batch);
  Status inject(const model::Capture& capture, int32_t n_rows);
  void bind_layers();

  model::DflashModel drafter_;
  std::shared_ptr<const Model> target_;
  Backend& backend_;
  KvCache kv_;
  model::DflashState state_;
  std::vector<std::string> features_;  // capture names, in dflash.target_layers order
  std::vector<model::LayerKv> layer_kv_;
  BackendBuffer<float> feat_;        // [max_batch][n_feat] features by token, backend memory
  std::vector<float> feat_host_;     // the same rows gathered from host captures
  std::vector<int32_t> block_;       // [last, mask...]
  std::vector<float> draft_logits_;  // [block - 1][n_vocab] when keep_logits_
  bool keep_logits_ = false;
  Status pending_ = Status::ok();  // an observe_target failure, reported by the next propose
};

}  // namespace kiln
