// engine/dflash_drafter.cpp: the DFlash drafter's KV bookkeeping around model/dflash's passes.
#include "engine/dflash_drafter.h"

#include <algorithm>

#include "core/check.h"

namespace kiln {

Expected<std::unique_ptr<DflashDrafter>> DflashDrafter::create(const std::string& path,
                                                               std::shared_ptr<const Model> target,
                                                               Backend& backend, int32_t n_ctx,
                                                               int32_t max_batch) {
  KILN_ASSIGN_OR_RETURN(model::DflashModel d, model::load_dflash(path));
  auto made = create(std::move(d), std::move(target), backend, n_ctx, max_batch);
  if (!made) return made.status().context(fmt::format("DFlash drafter '{}'", path));
  return made;
}

Expected<std::unique_ptr<DflashDrafter>> DflashDrafter::create(model::DflashModel d,
                                                               std::shared_ptr<const Model> target,
                                                               Backend& backend, int32_t n_ctx,
                                                               int32_t max_batch) {
  if (!target) return Status::error("DFlash drafter: no target model");
  KILN_TRY(model::check_dflash_target(d, target->hparams()));
  if (backend.tp_size() > 1)
    return Status::error("DFlash drafting on a tensor-parallel backend is not supported");
  if (n_ctx <= 0 || max_batch <= 0)
    return Status::errorf("DFlash drafter: context {} / batch {} must be > 0", n_ctx, max_batch);
  KvConfig cfg;
  // The block sits past the last accepted position: room for one block beyond the target's.
  cfg.n_ctx = n_ctx + d.dp.block_size;
  cfg.max_batch = std::max(max_batch, d.dp.block_size);
  cfg.backend = &backend;
  for (int32_t il = 0; il < d.hp.n_layer; ++il)
    cfg.layers.push_back(KvLayerSpec{.width = d.hp.k_width(), .window = 0});
  KILN_ASSIGN_OR_RETURN(KvCache kv, KvCache::create(cfg));
  return std::unique_ptr<DflashDrafter>(
      new DflashDrafter(std::move(d), std::move(target), backend, std::move(kv), cfg.max_batch));
}

DflashDrafter::DflashDrafter(model::DflashModel d, std::shared_ptr<const Model> target, Backend& be,
                             KvCache kv, int32_t max_batch)
    : drafter_(std::move(d)),
      target_(std::move(target)),
      backend_(be),
      kv_(std::move(kv)),
      state_(drafter_, max_batch),
      feat_(be.alloc<float>(static_cast<size_t>(max_batch) *
                            static_cast<size_t>(drafter_.n_feat()))) {
  for (int32_t L : drafter_.dp.target_layers) features_.push_back(model::dflash_feature_name(L));
}

DflashDrafter::~DflashDrafter() = default;

std::vector<std::string> DflashDrafter::wanted_captures() const { return features_; }

void DflashDrafter::bind_layers() {
  layer_kv_.resize(static_cast<size_t>(drafter_.hp.n_layer));
  for (int l = 0; l < drafter_.hp.n_layer; ++l)
    layer_kv_[static_cast<size_t>(l)] = model::LayerKv{.append_rows = kv_.append_rows(l),
                                                       .kv_rows = kv_.kv_rows(l),
                                                       .kv_pos = kv_.kv_pos(l),
                                                       .k = kv_.k_plane(l),
                                                       .v = kv_.v_plane(l),
                                                       .idx_k = {}};
}

Status DflashDrafter::prepare(std::span<const int32_t> /*prompt*/) {
  // Called before the target's prefill, whose features then arrive through observe_target.
  kv_.clear();
  pending_ = Status::ok();
  return Status::ok();
}

Status DflashDrafter::rollback(int32_t n_pos) {
  if (n_pos == 0) return prepare({});
  KILN_TRY(pending_);
  if (n_pos < 0 || n_pos > kv_.n_pos())
    return Status::errorf("DFlash drafter holds {} positions, cannot resume at {}", kv_.n_pos(),
                          n_pos);
  return kv_.truncate(n_pos);
}

void DflashDrafter::observe_target(const model::Capture& capture, int32_t n_rows_kept) {
  if (!pending_) return;  // already failed: the next propose reports it
  pending_ = inject(capture, n_rows_kept);
}

Status DflashDrafter::inject(const model::Capture& capture, int32_t n_rows) {
  const int64_t E = target_->hparams().n_embd, n_feat = drafter_.n_feat();
  const size_t n_layers = features_.size();
  std::vector<const model::CapturedNode*> nodes;
  for (const std::string& name : features_) {
    auto it = capture.nodes.find(name);
    if (it == capture.nodes.end())
      return Status::errorf("DFlash drafter: the target did not capture '{}'", name);
    const model::CapturedNode& c = it->second;
    if (c.width != E || c.n_rows < n_rows)
      return Status::errorf("DFlash drafter: captured '{}' has {} rows of {}, expected {} of {}",
                            name, c.n_rows, c.width, n_rows, E);
    // One pass records every node the same way: in capture.device's memory or on the host.
    if (c.on_device() && capture.device != &backend_)
      return Status::errorf("DFlash drafter: captured '{}' lies in another backend's memory", name);
    nodes.push_back(&c);
  }
  // Rows are interleaved by target layer: token i's features are its rows of each layer in
  // dflash.target_layers order (the fc's column order). Nodes on this backend are gathered
  // there (one 2-D copy per layer); host nodes are gathered on the host and uploaded.
  const bool on_device = nodes.front()->on_device();
  for (int32_t done = 0; done < n_rows;) {
    const int32_t chunk = std::min(n_rows - done, state_.max_rows());
    const std::span<float> feat = feat_.span().first(static_cast<size_t>(chunk * n_feat));
    if (on_device) {
      for (size_t k = 0; k < n_layers; ++k)
        backend_.copy_2d(nodes[k]->device.subspan(static_cast<size_t>(done * E)), E, 0, feat,
                         n_feat, int64_t(k) * E, chunk, E);
    } else {
      feat_host_.resize(feat.size());
      for (size_t k = 0; k < n_layers; ++k) {
        for (int32_t i = 0; i < chunk; ++i) {
          const float* src = nodes[k]->data.data() + static_cast<size_t>(done + i) * E;
          std::copy(src, src + E,
                    feat_host_.begin() + static_cast<ptrdiff_t>(i * n_feat + int64_t(k) * E));
        }
      }
      backend_.upload(std::span<const float>(feat_host_), feat);
    }
    KILN_TRY(kv_.begin_append(chunk).context("DFlash drafter"));
    bind_layers();
    model::dflash_inject(drafter_, backend_, state_, feat, kv_.append_pos(), layer_kv_);
    kv_.commit();
    done += chunk;
  }
  return Status::ok();
}

Status DflashDrafter::propose(const DraftRequest& req, Draft& out) {
  out.tokens.clear();
  out.probs.clear();
  KILN_CHECK(req.max_tokens > 0 && !req.history.empty());
  KILN_TRY(pending_);
  // The anchor (the last history token) sits right after the positions injected so far.
  const int64_t anchor_pos = static_cast<int64_t>(req.history.size()) - 1;
  if (kv_.n_pos() != anchor_pos)
    return Status::errorf(
        "DFlash drafter holds features of {} positions but the history's last token is at {} "
        "(every target batch must pass through observe_target)",
        kv_.n_pos(), anchor_pos);
  const int32_t n = std::min(req.max_tokens, max_draft());
  // llama.cpp feeds a block of n + 1 tokens for n drafts (fewer masks than block_size when
  // fewer drafts are asked for).
  block_.assign(1, req.history.back());
  block_.insert(block_.end(), static_cast<size_t>(n), drafter_.dp.mask_token_id);
  const int32_t B = n + 1;
  const size_t V = static_cast<size_t>(drafter_.dp.n_vocab);
  KILN_TRY(kv_.begin_append(B).context("DFlash drafter"));
  bind_layers();
  draft_logits_.resize(keep_logits_ ? static_cast<size_t>(n) * V : 0);
  out.tokens.resize(static_cast<size_t>(n));
  const model::Weights& tw = target_->weights();
  model::dflash_block(drafter_, tw.token_embd, tw.output, backend_, state_, block_,
                      kv_.append_pos(), layer_kv_, out.tokens, draft_logits_);
  // The block's K/V rows were scratch for this pass: the cache keeps the accepted history.
  KILN_TRY(kv_.truncate(kv_.n_pos()));
  return Status::ok();
}

}  // namespace kiln
