// engine/mtp_drafter.cpp: the NextN (MTP) drafter (see mtp_drafter.h).
#include "engine/mtp_drafter.h"

#include <algorithm>

#include "core/check.h"

namespace kiln {
namespace {

constexpr int32_t kDefaultMaxBatch = 256;  // rows of one NextN step (prompt catch-up chunks)

int32_t argmax(std::span<const float> x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

}  // namespace

Expected<std::unique_ptr<MtpDrafter>> MtpDrafter::create(std::shared_ptr<const Model> model,
                                                         Backend& backend, int32_t n_ctx,
                                                         int32_t max_batch) {
  KILN_CHECK(model != nullptr);
  const model::HParams& hp = model->hparams();
  if (hp.nextn_layers.empty())
    return Status::errorf(
        "MTP drafting needs NextN layers ('{}.nextn_predict_layers' > 0); this '{}' model has "
        "none",
        hp.arch_name, hp.arch_name);
  if (backend.tp_size() > 1)
    return Status::error("MTP drafting with tensor parallelism is not supported");
  // llama.cpp's glm-dsa NextN block runs its own lightning indexer; kiln's NextN pass does not.
  if (hp.is_dsa())
    return Status::errorf(
        "MTP drafting of '{}' (sparse attention in the NextN block) is not supported",
        hp.arch_name);
  if (max_batch <= 0) max_batch = kDefaultMaxBatch;
  if (n_ctx <= 0) n_ctx = hp.n_ctx_train;
  KvConfig cfg;
  // The NextN block's own KV rows (attention only over the NextN rows, never the target's).
  cfg.layers.push_back({hp.k_width(), hp.nextn_layers[0].window});
  cfg.n_ctx = n_ctx;
  cfg.max_batch = max_batch;
  cfg.backend = &backend;
  KILN_ASSIGN_OR_RETURN(KvCache kv, KvCache::create(cfg));
  return std::unique_ptr<MtpDrafter>(
      new MtpDrafter(std::move(model), backend, std::move(kv), max_batch));
}

MtpDrafter::MtpDrafter(std::shared_ptr<const Model> m, Backend& be, KvCache kv, int32_t max_batch)
    : model_(std::move(m)),
      be_(be),
      kv_(std::move(kv)),
      fwd_(model_->hparams(), max_batch),
      hidden_node_(fmt::format("blk.{}.l_out", model_->hparams().n_layer - 1)),
      max_batch_(max_batch) {
  hp_ = model_->hparams();
  const std::span<const float> f = model::rope_factors_for(model_->weights(), hp_, kv_.n_ctx());
  for (model::LayerDesc& L : hp_.nextn_layers) L.rope.freq_factors = f;
}

Status MtpDrafter::prepare(std::span<const int32_t> /*prompt*/) {
  KILN_TRY(kv_.truncate(0));
  n_real_ = 0;
  hidden_.clear();
  last_logits_.clear();
  last_hidden_.clear();
  return Status::ok();
}

Status MtpDrafter::rollback(int32_t n_pos) {
  if (n_pos == 0) return prepare({});
  const int64_t E = model_->hparams().n_embd;
  const auto n_seen = static_cast<int64_t>(hidden_.size()) / E;
  if (n_pos < 0 || n_pos > n_seen)
    return Status::errorf(
        "the mtp drafter holds hidden states of {} positions, cannot resume at {}", n_seen, n_pos);
  // Row n_pos - 1 paired h_{n_pos-1} with the token the cut history replaces: rebuilt later.
  const int32_t keep = std::min(n_real_, n_pos - 1);
  KILN_TRY(kv_.truncate(keep).context("mtp drafter"));
  n_real_ = keep;
  hidden_.resize(static_cast<size_t>(n_pos) * static_cast<size_t>(E));
  last_logits_.clear();
  last_hidden_.clear();
  return Status::ok();
}

void MtpDrafter::observe_target(const model::Capture& capture, int32_t n_rows_kept) {
  const auto it = capture.nodes.find(hidden_node_);
  KILN_CHECK(it != capture.nodes.end(), "the target's step did not capture '{}'", hidden_node_);
  const model::CapturedNode& node = it->second;
  const int64_t E = model_->hparams().n_embd;
  KILN_CHECK(node.width == E && n_rows_kept >= 0 && n_rows_kept <= node.n_rows,
             "'{}': {} rows of {}, {} kept", hidden_node_, node.n_rows, node.width, n_rows_kept);
  hidden_.insert(hidden_.end(), node.data.begin(), node.data.begin() + n_rows_kept * E);
}

Status MtpDrafter::run_rows(std::span<const int32_t> tokens, std::span<const float> hidden) {
  const model::HParams& hp = hp_;
  const auto n = static_cast<int64_t>(tokens.size());
  KILN_TRY(kv_.begin_append(static_cast<int32_t>(n)));
  layer_kv_.assign(1, model::LayerKv{.append_rows = kv_.append_rows(0),
                                     .kv_rows = kv_.kv_rows(0),
                                     .kv_pos = kv_.kv_pos(0),
                                     .k = kv_.k_plane(0),
                                     .v = kv_.v_plane(0),
                                     .idx_k = {}});
  model::ForwardBatch b;
  b.tokens = tokens;
  b.pos = kv_.append_pos();
  b.kv = layer_kv_;
  logits_.resize(static_cast<size_t>(hp.n_vocab));
  out_hidden_.resize(static_cast<size_t>(n * hp.n_embd));
  model::forward_nextn(hp, model_->weights(), 0, be_, fwd_, b, hidden, logits_, out_hidden_);
  kv_.commit();
  last_logits_ = logits_;
  last_hidden_.assign(out_hidden_.end() - hp.n_embd, out_hidden_.end());
  return Status::ok();
}

Status MtpDrafter::propose(const DraftRequest& req, Draft& out) {
  out.tokens.clear();
  out.probs.clear();
  const model::HParams& hp = model_->hparams();
  const int64_t E = hp.n_embd;
  const std::span<const int32_t> hist = req.history;
  // The chained rows of the last proposal were guesses: the target's rows replace them.
  if (kv_.n_pos() > n_real_) KILN_TRY(kv_.truncate(n_real_));
  // Catch up: row p pairs the target's hidden state h_p with the token accepted at p + 1.
  const auto n_pending = static_cast<int64_t>(hidden_.size()) / E - n_real_;
  const int64_t n_new =
      std::min<int64_t>(n_pending, static_cast<int64_t>(hist.size()) - 1 - n_real_);
  for (int64_t done = 0; done < n_new;) {
    const int64_t n = std::min<int64_t>(max_batch_, n_new - done);
    const int64_t p0 = n_real_ + done;
    KILN_TRY(run_rows(hist.subspan(static_cast<size_t>(p0 + 1), static_cast<size_t>(n)),
                      std::span<const float>(hidden_).subspan(static_cast<size_t>(p0 * E),
                                                              static_cast<size_t>(n * E))));
    done += n;
  }
  if (n_new > 0) n_real_ += static_cast<int32_t>(n_new);
  // Draft only from a row of the target's own state at the last position (none yet: a
  // one-token prompt before its first verify).
  if (n_new == 0 || n_real_ + 1 != static_cast<int32_t>(hist.size())) return Status::ok();
  int32_t tok = argmax(last_logits_);
  out.tokens.push_back(tok);
  std::vector<float> h;
  while (static_cast<int32_t>(out.tokens.size()) < req.max_tokens &&
         kv_.n_pos() + 1 <= kv_.n_ctx()) {
    h = last_hidden_;
    const int32_t one[1] = {tok};
    KILN_TRY(run_rows(one, h));
    tok = argmax(last_logits_);
    out.tokens.push_back(tok);
  }
  return Status::ok();
}

}  // namespace kiln
