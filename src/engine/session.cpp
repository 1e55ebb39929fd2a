// engine/session.cpp: Model loading and the Session step loop: validates a batch, splits it
// into chunks the KV cache accepts, adapts kv/KvCache to model::LayerKv and runs the fast
// forward pass.
#include "engine/session.h"

#include <algorithm>

#include "core/check.h"
#include "kv/kv_cache.h"
#include "model/batch.h"
#include "model/forward.h"

namespace kiln {

Expected<std::shared_ptr<const Model>> Model::load(const std::string& path) {
  auto g = GgufFile::open(path);
  if (!g) return g.status().context(fmt::format("loading model '{}'", path));
  auto m = from_gguf(std::move(*g));
  if (!m) return m.status().context(fmt::format("loading model '{}'", path));
  return m;
}

Expected<std::shared_ptr<const Model>> Model::from_gguf(GgufFile gguf) {
  std::shared_ptr<Model> m(new Model());
  m->gguf_ = std::move(gguf);
  KILN_ASSIGN_OR_RETURN(m->hp_, model::read_hparams(m->gguf_));
  KILN_ASSIGN_OR_RETURN(m->w_, model::bind_weights(m->gguf_, m->hp_));
  return std::shared_ptr<const Model>(std::move(m));
}

uint64_t Model::weight_bytes() const {
  uint64_t total = 0;
  for (const TensorInfo& t : gguf_.tensors()) total += t.n_bytes;
  return total;
}

// Default largest number of tokens one forward step processes; longer evals run in chunks. Big
// enough that a prefill reads each weight once per 512 tokens, small enough that scratch
// stays a few MB on large models.
constexpr int32_t kMaxBatch = 512;

struct Session::Impl {
  KvCache kv;
  model::ForwardState fwd;
  std::vector<model::LayerKv> layer_kv;
  std::vector<float> discard;  // [n_vocab] logits of a non-final chunk
};

Session::Session(std::shared_ptr<const Model> model, Backend& backend, int32_t n_ctx,
                 int32_t max_batch)
    : model_(std::move(model)), backend_(backend) {
  KILN_CHECK(model_ != nullptr);
  const model::HParams& hp = model_->hparams();
  n_ctx_ = n_ctx > 0 ? n_ctx : hp.n_ctx_train;
  KvConfig cfg;
  cfg.n_ctx = n_ctx_;
  cfg.max_batch = std::min(n_ctx_, max_batch > 0 ? max_batch : kMaxBatch);
  for (const model::LayerDesc& L : hp.layers) {
    // K and V planes share one width in the cache; the attention op needs k == v head dims.
    KILN_CHECK(hp.k_width() == hp.v_width());
    cfg.layers.push_back(KvLayerSpec{.width = hp.k_width(), .window = L.window});
  }
  auto kv = KvCache::create(cfg);
  KILN_CHECK(kv.has_value(), "KV cache config derived from a validated model: {}", kv.error());
  impl_.reset(new Impl{std::move(*kv), model::ForwardState(hp, cfg.max_batch), {}, {}});
  impl_->layer_kv.resize(hp.n_layer);
}

Session::~Session() = default;

uint64_t Session::kv_bytes() const { return impl_->kv.bytes_allocated(); }
int32_t Session::max_batch() const { return impl_->kv.max_batch(); }

Status Session::rollback(int32_t n_pos) {
  if (n_pos < 0 || n_pos > n_pos_)
    return Status::errorf("rollback to {} outside [0, {}]", n_pos, n_pos_);
  KILN_TRY(impl_->kv.truncate(n_pos));
  n_pos_ = n_pos;
  return Status::ok();
}

Expected<std::span<const float>> Session::eval(std::span<const int32_t> tokens, bool all_logits) {
  const model::HParams& hp = model_->hparams();
  KILN_TRY(model::validate_batch(hp, tokens, n_pos_, n_ctx_));
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t V = hp.n_vocab;
  logits_.resize(static_cast<size_t>((all_logits ? n : 1) * V));
  Impl& s = *impl_;
  const int32_t max_batch = s.kv.max_batch();
  for (int64_t done = 0; done < n;) {
    const int32_t chunk = static_cast<int32_t>(std::min<int64_t>(max_batch, n - done));
    const bool last_chunk = done + chunk == n;
    if (Status st = s.kv.begin_append(chunk); !st) {
      // Chunks already committed stay; undo them so a failed eval leaves the state unchanged.
      (void)s.kv.truncate(n_pos_);
      return st;
    }
    for (int l = 0; l < hp.n_layer; ++l) {
      s.layer_kv[l] = model::LayerKv{.append_rows = s.kv.append_rows(l),
                                     .kv_rows = s.kv.kv_rows(l),
                                     .kv_pos = s.kv.kv_pos(l),
                                     .k = s.kv.k_plane(l),
                                     .v = s.kv.v_plane(l)};
    }
    model::ForwardBatch b;
    b.tokens = tokens.subspan(static_cast<size_t>(done), static_cast<size_t>(chunk));
    b.pos = s.kv.append_pos();
    b.kv = s.layer_kv;
    b.all_logits = all_logits;
    // Capture records the last chunk (tests capture single-chunk batches).
    b.capture = last_chunk ? capture_ : nullptr;
    std::span<float> out;
    if (all_logits) out = std::span<float>(logits_).subspan(static_cast<size_t>(done * V), static_cast<size_t>(chunk * V));
    else if (last_chunk) out = std::span<float>(logits_);
    else {
      // Earlier chunks' logits are not wanted, but forward() always produces one row.
      s.discard.resize(static_cast<size_t>(V));
      out = s.discard;
    }
    model::forward(hp, model_->weights(), backend_, s.fwd, b, out);
    s.kv.commit();
    done += chunk;
  }
  n_pos_ += static_cast<int32_t>(n);
  return std::span<const float>(logits_);
}

}  // namespace kiln
