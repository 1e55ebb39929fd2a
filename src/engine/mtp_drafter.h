// engine/mtp_drafter.h: speculative drafting with the model's own NextN (multi-token
// prediction) block, as GLM-4.5 and DeepSeek-V3 ship it (`kiln run --spec-mtp`).
//
// Wiring (vLLM's deepseek_mtp / glm4_moe_mtp, which this follows): the NextN row at position p
// reads the target's last hidden state h_p (the last layer's output before the final norm,
// which predicts token p + 1) and the token t_{p+1} that was actually accepted there:
// eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p))) -> the block (attention over its own KV
// rows at positions 0..p, then its MoE) -> shared_head_norm -> the head, whose argmax guesses
// t_{p+2}. The embedding is zeroed at position 0 (vLLM masks it there). Further drafts chain
// the block on its own output hidden state and its previous draft at the next position; those
// chained rows are speculative and are dropped from the NextN KV before the next step writes
// the target's real rows over them.
//
// The target's hidden states arrive through Drafter::observe_target (capture of
// `blk.{n_layer-1}.l_out`): the prompt's in start(), then each verify's kept rows. Drafts are
// greedy (Draft::probs empty: a sampled verify treats them as one-hot, which keeps the
// rejection rule exact).
//
// Resuming a cut history (a server slot reusing a cached prefix, Drafter::rollback): NextN row
// p depends on h_p and the token at p + 1, so a cut at n keeps rows p <= n - 2 and rebuilds
// row n - 1 from h_{n-1} and the new token there. The drafter therefore keeps every hidden
// state it was shown ([n_ctx][n_embd] floats at most), not only those its rows have yet to use.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/session.h"
#include "engine/speculative.h"
#include "kv/kv_cache.h"
#include "model/forward.h"

namespace kiln {

class MtpDrafter final : public Drafter {
 public:
  // Errors (one line): the model has no NextN blocks; a tensor-parallel backend.
  static Expected<std::unique_ptr<MtpDrafter>> create(std::shared_ptr<const Model> model,
                                                      Backend& backend, int32_t n_ctx,
                                                      int32_t max_batch = 0);
  std::string name() const override { return "mtp"; }
  Status prepare(std::span<const int32_t> prompt) override;
  Status propose(const DraftRequest& req, Draft& out) override;
  std::vector<std::string> wanted_captures() const override { return {hidden_node_}; }
  void observe_target(const model::Capture& capture, int32_t n_rows_kept) override;
  // Keeps the hidden states of positions < n_pos and the NextN rows built only from them.
  // Errors: n_pos beyond the positions observed; a NextN ring that cannot cut there.
  Status rollback(int32_t n_pos) override;

 private:
  MtpDrafter(std::shared_ptr<const Model> m, Backend& be, KvCache kv, int32_t max_batch);
  // One NextN step over rows at positions kv.n_pos().. with `tokens` and `hidden`; the last
  // row's logits into last_logits_ and its output hidden state into last_hidden_.
  Status run_rows(std::span<const int32_t> tokens, std::span<const float> hidden);

  std::shared_ptr<const Model> model_;
  Backend& be_;
  KvCache kv_;
  // The model's hyper-parameters with the rope factors of this drafter's context (LongRoPE
  // picks its set by the context, as the target's Session does).
  model::HParams hp_;
  model::ForwardState fwd_;
  std::vector<model::LayerKv> layer_kv_;
  std::string hidden_node_;
  int32_t max_batch_;
  int32_t n_real_ = 0;         // NextN KV rows built from the target's own hidden states
  std::vector<float> hidden_;  // [n_seen][n_embd] every target hidden state observed, from 0
  std::vector<float> logits_, last_logits_;
  std::vector<float> out_hidden_, last_hidden_;
  std::vector<int32_t> pos_scratch_;
};

}  // namespace kiln
