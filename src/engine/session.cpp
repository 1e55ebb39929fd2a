// engine/session.cpp: Model loading and the Session step loop: validates a batch, splits it
// into chunks the KV cache accepts, adapts kv/KvCache to model::LayerKv and runs the fast
// forward pass; BatchEval runs the steps of several sessions in one forward pass.
#include "engine/session.h"

#include <algorithm>
#include <optional>

#include "core/check.h"
#include "kv/kv_cache.h"
#include "model/batch.h"
#include "model/forward.h"
#include "model/tensor_parallel.h"

namespace kiln {

Expected<std::shared_ptr<const Model>> Model::load(const std::string& path,
                                                   const LoadOptions& options) {
  auto g = GgufFile::open(path);
  if (!g) return g.status().context(fmt::format("loading model '{}'", path));
  auto built = build(std::move(*g));
  if (!built) return built.status().context(fmt::format("loading model '{}'", path));
  std::shared_ptr<Model> m = std::move(*built);
  m->hp_.routing = options.routing;
  m->hp_.dsa_dense = options.dsa_dense && m->hp_.is_dsa();
  const auto* mapped = dynamic_cast<const moe::MappedExpertSource*>(m->w_.experts.get());
  if (options.experts.enabled() && mapped != nullptr) {
    std::vector<moe::StoreLayer> layers;
    for (size_t il = 0; il < mapped->layers().size(); ++il)
      layers.push_back({mapped->layers()[il], m->hp_.layers[il].n_expert_used});
    auto store = moe::ExpertStore::create(path, m->gguf_.mapping()->data(), std::move(layers),
                                          options.experts);
    if (!store) return store.status().context(fmt::format("loading model '{}'", path));
    m->w_.experts = std::move(*store);
  }
  return std::shared_ptr<const Model>(std::move(m));
}

Expected<std::shared_ptr<Model>> Model::build(GgufFile gguf) {
  std::shared_ptr<Model> m(new Model());
  m->gguf_ = std::move(gguf);
  KILN_ASSIGN_OR_RETURN(m->hp_, model::read_hparams(m->gguf_));
  KILN_ASSIGN_OR_RETURN(m->w_, model::bind_weights(m->gguf_, m->hp_));
  model::attach_rope_factors(m->w_, m->hp_);
  return m;
}

Expected<std::shared_ptr<const Model>> Model::from_gguf(GgufFile gguf) {
  KILN_ASSIGN_OR_RETURN(std::shared_ptr<Model> m, build(std::move(gguf)));
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

namespace {

// One tensor-parallel rank's share of a session: its KV planes (its KV heads) and scratch.
// A plain backend is a group of one, whose rank 0 is the backend itself.
struct RankState {
  KvCache kv;
  // Created on the first eval(): sessions driven only through BatchEval (scheduler slots)
  // never need their own activation scratch.
  std::optional<model::ForwardState> fwd;
  std::vector<model::LayerKv> layer_kv;

  // Fills layer_kv from the pending append of the KV cache (a full indexer layer's indexer
  // keys: the K plane of its cache layer after the attention layers, same rows).
  void bind_layers(const model::HParams& hp) {
    layer_kv.resize(static_cast<size_t>(hp.n_layer));
    for (int l = 0; l < hp.n_layer; ++l) {
      const int32_t ikv = hp.layers[static_cast<size_t>(l)].indexer_kv;
      layer_kv[l] = model::LayerKv{.append_rows = kv.append_rows(l),
                                   .kv_rows = kv.kv_rows(l),
                                   .kv_pos = kv.kv_pos(l),
                                   .k = kv.k_plane(l),
                                   .v = kv.v_plane(l),
                                   .idx_k = ikv >= 0 ? kv.k_plane(ikv) : std::span<f16>()};
    }
  }
};

// The model as each rank of `backend` sees it (one entry, the model itself, on a plain
// backend). A model whose heads or widths do not split is refused at construction.
std::vector<model::Shard> shards_for(const Model& m, Backend& backend) {
  std::vector<model::Shard> out;
  for (int r = 0; r < backend.tp_size(); ++r) {
    auto sh = model::shard_model(m.hparams(), m.weights(), r, backend.tp_size());
    KILN_CHECK(sh.has_value(), "{} (check_tensor_parallel() first)", sh.error());
    out.push_back(std::move(*sh));
  }
  return out;
}

// LongRoPE picks its factor set by the context a sequence gets (llama.cpp's get_rope_factors,
// on n_ctx per sequence), not by the training context the Model's own HParams assume.
void use_rope_factors(std::vector<model::Shard>& shards, std::span<const float> factors) {
  for (model::Shard& sh : shards) {
    for (model::LayerDesc& L : sh.hp.layers) L.rope.freq_factors = factors;
    for (model::LayerDesc& L : sh.hp.nextn_layers) L.rope.freq_factors = factors;
  }
}

// A streaming expert source whose read failed gave this step zero weights
// (moe/expert_source.h): the step is void. Every shard's latch is cleared; the first error
// is returned.
Status take_expert_errors(const std::vector<model::Shard>& shards) {
  Status first;
  for (const model::Shard& sh : shards)
    if (sh.w.experts)
      if (Status e = sh.w.experts->take_error(); !e && first) first = e;
  return first;
}

}  // namespace

struct Session::Impl {
  std::vector<model::Shard> shards;  // [tp_size]
  std::vector<RankState> ranks;      // [tp_size]; ranks[0].kv is "the" cache
  std::vector<float> discard;        // [n_vocab] logits of a non-final chunk
  // The rope factors of this session's context (model::rope_factors_for), set in every
  // shard's layers; a BatchEval may only batch sessions whose factors are the same.
  std::span<const float> rope_factors;

  KvCache& kv() { return ranks[0].kv; }
  // The ranks' caches hold the same positions and rows, so every call succeeds or fails on
  // all of them alike; a failure is still undone everywhere.
  Status begin_append(int32_t n) {
    for (size_t r = 0; r < ranks.size(); ++r) {
      if (Status st = ranks[r].kv.begin_append(n); !st) {
        for (size_t q = 0; q < r; ++q) (void)ranks[q].kv.truncate(ranks[q].kv.n_pos());
        return st;
      }
    }
    return Status::ok();
  }
  void commit() {
    for (RankState& r : ranks) r.kv.commit();
  }
  Status truncate(int32_t n_pos) {
    for (RankState& r : ranks) KILN_TRY(r.kv.truncate(n_pos));
    return Status::ok();
  }
  void bind_layers() {
    for (size_t r = 0; r < ranks.size(); ++r) ranks[r].bind_layers(shards[r].hp);
  }
};

Status check_tensor_parallel(const Model& model, int n) {
  for (int r = 0; r < n; ++r) {
    auto sh = model::shard_model(model.hparams(), model.weights(), r, n);
    if (!sh) return sh.status();
  }
  return Status::ok();
}

Session::Session(std::shared_ptr<const Model> model, Backend& backend, int32_t n_ctx,
                 int32_t max_batch)
    : model_(std::move(model)), backend_(backend) {
  KILN_CHECK(model_ != nullptr);
  const model::HParams& hp = model_->hparams();
  n_ctx_ = n_ctx > 0 ? n_ctx : hp.n_ctx_train;
  impl_.reset(new Impl{shards_for(*model_, backend_), {}, {}, {}});
  impl_->rope_factors = model::rope_factors_for(model_->weights(), hp, n_ctx_);
  use_rope_factors(impl_->shards, impl_->rope_factors);
  for (int r = 0; r < backend_.tp_size(); ++r) {
    const model::HParams& rhp = impl_->shards[static_cast<size_t>(r)].hp;
    KvConfig cfg;
    cfg.n_ctx = n_ctx_;
    cfg.max_batch = std::min(n_ctx_, max_batch > 0 ? max_batch : kMaxBatch);
    cfg.backend = &backend_.tp_rank(r);  // device backends keep the planes in device memory
    for (const model::LayerDesc& L : rhp.layers) {
      // K and V planes share one width in the cache; the attention op needs k == v head dims.
      // Latent attention keeps only its latent rows (no V plane).
      KILN_CHECK(rhp.is_mla() || rhp.k_width() == rhp.v_width());
      cfg.layers.push_back(KvLayerSpec{
          .width = rhp.kv_k_width(), .window = L.window, .k_only = rhp.kv_v_width() == 0});
    }
    // Sparse attention: each full indexer layer's keys, one K-only row per position.
    for (const model::LayerDesc& L : rhp.layers)
      if (L.indexer_kv >= 0)
        cfg.layers.push_back(KvLayerSpec{.width = rhp.dsa.head_dim, .window = 0, .k_only = true});
    auto kv = KvCache::create(cfg);
    KILN_CHECK(kv.has_value(), "KV cache config derived from a validated model: {}", kv.error());
    impl_->ranks.push_back(RankState{std::move(*kv), std::nullopt, {}});
  }
}

Session::~Session() = default;

uint64_t Session::kv_bytes() const {
  uint64_t b = 0;
  for (const RankState& r : impl_->ranks) b += r.kv.bytes_allocated();
  return b;
}

uint64_t Session::kv_bytes_per_token() const {
  uint64_t b = 0;
  for (const RankState& r : impl_->ranks) b += r.kv.bytes_per_token();
  return b;
}

int Session::tp_size() const { return static_cast<int>(impl_->ranks.size()); }

std::span<const float> Session::rope_factors() const { return impl_->rope_factors; }

const KvCache& Session::kv_cache() const { return impl_->ranks[0].kv; }

Status Session::install_kv(KvCache&& kv) {
  if (tp_size() > 1)
    return Status::error(
        "install_kv: a tensor-parallel session's KV is split over its GPUs "
        "(kvpack does not carry it)");
  const KvCache& mine = impl_->kv();
  bool same = kv.n_layers() == mine.n_layers() && kv.n_ctx() == mine.n_ctx() &&
              kv.max_batch() == mine.max_batch() && kv.n_pending() == 0;
  for (int l = 0; same && l < kv.n_layers(); ++l)
    same = kv.width(l) == mine.width(l) && kv.window(l) == mine.window(l) &&
           kv.k_only(l) == mine.k_only(l);
  if (!same) return Status::error("install_kv: the cache's geometry differs from the session's");
  // One move: the old planes are released only after the new ones are in place.
  impl_->kv() = std::move(kv);
  n_pos_ = impl_->kv().n_pos();
  logits_.clear();
  return Status::ok();
}
int32_t Session::max_batch() const { return impl_->ranks[0].kv.max_batch(); }

Status Session::rollback(int32_t n_pos) {
  if (n_pos < 0 || n_pos > n_pos_)
    return Status::errorf("rollback to {} outside [0, {}]", n_pos, n_pos_);
  KILN_TRY(impl_->truncate(n_pos));
  n_pos_ = n_pos;
  return Status::ok();
}

Status Session::copy_prefix_from(const Session& src, int32_t n_pos) {
  if (&src == this) return Status::error("copy_prefix_from: a session copying itself");
  if (src.model_ != model_ || &src.backend_ != &backend_ || src.n_ctx_ != n_ctx_ ||
      src.impl_->ranks.size() != impl_->ranks.size() ||
      src.impl_->rope_factors.data() != impl_->rope_factors.data())
    return Status::error("copy_prefix_from: sessions of another model, backend or context");
  if (n_pos < 0 || n_pos > src.n_pos_)
    return Status::errorf("copy_prefix_from: {} positions of a session holding {}", n_pos,
                          src.n_pos_);
  logits_.clear();
  n_pos_ = 0;
  for (size_t r = 0; r < impl_->ranks.size(); ++r) {
    if (Status st = impl_->ranks[r].kv.copy_prefix(src.impl_->ranks[r].kv, n_pos); !st) {
      for (RankState& rank : impl_->ranks) rank.kv.clear();
      return st;
    }
  }
  n_pos_ = n_pos;
  return Status::ok();
}

Expected<std::span<const float>> Session::eval(std::span<const int32_t> tokens, bool all_logits) {
  KILN_TRY(eval_impl(tokens, all_logits, 0));
  return std::span<const float>(logits_.span());
}

Expected<Session::TopK> Session::eval_top_k(std::span<const int32_t> tokens, int32_t k,
                                            bool all_rows) {
  if (k < 1 || k > n_vocab())
    return Status::errorf("top-k of {} candidates outside 1..{}", k, n_vocab());
  // Only the last chunk's step ranks its rows.
  if (all_rows && static_cast<int64_t>(tokens.size()) > max_batch())
    return Status::errorf("top-k of every row of {} tokens: more than one step's {}", tokens.size(),
                          max_batch());
  KILN_TRY(eval_impl(tokens, all_rows, k));
  return TopK{top_ids_, top_vals_};
}

Expected<std::span<const int32_t>> Session::prefill_head(std::span<const int32_t> prompt) {
  if (prompt.size() < 2 || backend_.batch_invariant()) return prompt;
  // The whole prompt is checked first, so that a bad last token leaves no half-evaluated prompt.
  KILN_TRY(model::validate_batch(model_->hparams(), prompt, n_pos_, n_ctx_));
  KILN_TRY(eval_impl(prompt.first(prompt.size() - 1), false, 0));
  return prompt.last(1);
}

Status Session::eval_impl(std::span<const int32_t> tokens, bool all_logits, int32_t top_k) {
  const model::HParams& hp = model_->hparams();
  KILN_TRY(model::validate_batch(hp, tokens, n_pos_, n_ctx_));
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t V = hp.n_vocab;
  logits_.resize(static_cast<size_t>((all_logits ? n : 1) * V), backend_);
  top_ids_.resize(static_cast<size_t>((all_logits ? n : 1) * top_k));
  top_vals_.resize(top_ids_.size());
  Impl& s = *impl_;
  const int32_t max_batch = s.kv().max_batch();
  for (size_t r = 0; r < s.ranks.size(); ++r)
    if (!s.ranks[r].fwd) s.ranks[r].fwd.emplace(s.shards[r].hp, max_batch);
  for (int64_t done = 0; done < n;) {
    const int32_t chunk = static_cast<int32_t>(std::min<int64_t>(max_batch, n - done));
    const bool last_chunk = done + chunk == n;
    if (Status st = s.begin_append(chunk); !st) {
      // Chunks already committed stay; undo them so a failed eval leaves the state unchanged.
      (void)s.truncate(n_pos_);
      return st;
    }
    s.bind_layers();
    std::span<float> out;
    if (all_logits)
      out = logits_.span().subspan(static_cast<size_t>(done * V), static_cast<size_t>(chunk * V));
    else if (last_chunk)
      out = logits_.span();
    else {
      // Earlier chunks' logits are not wanted, but forward() always produces one row.
      s.discard.resize(static_cast<size_t>(V));
      out = s.discard;
    }
    const std::span<const int32_t> chunk_tokens =
        tokens.subspan(static_cast<size_t>(done), static_cast<size_t>(chunk));
    // Every rank runs the step over its shard at once; rank 0 produces the logits.
    backend_.tp_run([&](int r) {
      RankState& rs = s.ranks[static_cast<size_t>(r)];
      model::ForwardBatch b;
      b.tokens = chunk_tokens;
      b.pos = rs.kv.append_pos();
      b.kv = rs.layer_kv;
      b.all_logits = all_logits;
      if (last_chunk && top_k > 0 && r == 0) {
        b.top_k = top_k;
        b.top_ids = top_ids_;
        b.top_vals = top_vals_;
      }
      // Capture records the last chunk (tests capture single-chunk batches), on rank 0.
      b.capture = last_chunk && r == 0 ? capture_ : nullptr;
      const model::Shard& sh = s.shards[static_cast<size_t>(r)];
      model::forward(sh.hp, sh.w, backend_.tp_rank(r), *rs.fwd, b,
                     r == 0 ? out : std::span<float>());
    });
    if (Status st = take_expert_errors(s.shards); !st) {
      (void)s.truncate(n_pos_);  // this chunk's rows (pending) and earlier chunks' go
      return st;
    }
    s.commit();
    done += chunk;
  }
  n_pos_ += static_cast<int32_t>(n);
  return Status::ok();
}

struct BatchEval::Impl {
  std::vector<model::Shard> shards;  // [tp_size]
  struct Rank {
    model::ForwardState fwd;
    std::vector<model::LayerKv> layer_kv;  // [n_items][n_layer]
    std::vector<model::SeqSlice> seqs;     // [n_items]
  };
  std::vector<Rank> ranks;           // [tp_size]
  std::vector<int32_t> tokens, pos;  // [n_tok] the items' tokens, concatenated
  HostLogits logits;                 // [rows][n_vocab]
  std::vector<int32_t> top_ids;      // eval_top_k: [items][k]
  std::vector<float> top_vals;
  model::Capture capture;  // the items' wanted activations over the whole batch (rank 0)
};

BatchEval::BatchEval(std::shared_ptr<const Model> model, Backend& backend, int32_t max_tokens)
    : model_(std::move(model)), backend_(backend), max_tokens_(max_tokens) {
  KILN_CHECK(model_ != nullptr && max_tokens > 0);
  impl_.reset(new Impl{shards_for(*model_, backend_), {}, {}, {}, {}, {}, {}, {}});
  for (const model::Shard& sh : impl_->shards)
    impl_->ranks.push_back(Impl::Rank{model::ForwardState(sh.hp, max_tokens), {}, {}});
}

BatchEval::~BatchEval() = default;

Expected<std::span<const float>> BatchEval::eval(std::span<const Item> items) {
  KILN_TRY(eval_impl(items, 0));
  return std::span<const float>(impl_->logits.span());
}

Expected<Session::TopK> BatchEval::eval_top_k(std::span<const Item> items, int32_t k) {
  if (k < 1 || k > model_->n_vocab())
    return Status::errorf("batch: top-k of {} candidates outside 1..{}", k, model_->n_vocab());
  for (size_t i = 0; i < items.size(); ++i)
    if (items[i].all_logits)
      return Status::errorf("batch item {}: top-k candidates are of the last token only", i);
  KILN_TRY(eval_impl(items, k));
  return Session::TopK{impl_->top_ids, impl_->top_vals};
}

Status BatchEval::eval_impl(std::span<const Item> items, int32_t top_k) {
  const model::HParams& hp = model_->hparams();
  if (items.empty()) return Status::error("batch: no items to evaluate");
  int64_t total = 0, rows = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    Session* s = items[i].session;
    if (!s) return Status::errorf("batch item {}: no session", i);
    if (&s->model() != model_.get())
      return Status::errorf("batch item {}: session of another model", i);
    for (size_t j = 0; j < i; ++j)
      if (items[j].session == s)
        return Status::errorf("batch items {} and {} share one session", j, i);
    const auto n = static_cast<int64_t>(items[i].tokens.size());
    if (Status st = model::validate_batch(hp, items[i].tokens, s->n_pos(), s->n_ctx()); !st)
      return st.context(fmt::format("batch item {}", i));
    if (n > s->max_batch())
      return Status::errorf("batch item {}: {} tokens exceed the session's batch limit {}", i, n,
                            s->max_batch());
    if (s->impl_->rope_factors.data() != items[0].session->impl_->rope_factors.data())
      return Status::errorf(
          "batch items 0 and {}: contexts {} and {} use different LongRoPE factor sets", i,
          items[0].session->n_ctx(), s->n_ctx());
    total += n;
    rows += items[i].all_logits ? n : 1;
  }
  if (total > max_tokens_)
    return Status::errorf("batch of {} tokens exceeds the limit {}", total, max_tokens_);
  use_rope_factors(impl_->shards, items[0].session->impl_->rope_factors);

  Impl& b = *impl_;
  const size_t L = static_cast<size_t>(hp.n_layer);
  b.tokens.clear();
  b.pos.clear();
  for (Impl::Rank& rk : b.ranks) {
    rk.layer_kv.resize(items.size() * L);
    rk.seqs.resize(items.size());
  }
  for (size_t i = 0; i < items.size(); ++i) {
    Session::Impl& s = *items[i].session->impl_;
    if (s.ranks.size() != b.ranks.size())
      return Status::errorf("batch item {}: session of another backend", i);
    const auto n = static_cast<int32_t>(items[i].tokens.size());
    if (Status st = s.begin_append(n); !st) {
      // Undo the appends already begun so every session stays as it was.
      for (size_t j = 0; j < i; ++j)
        (void)items[j].session->impl_->truncate(items[j].session->n_pos_);
      (void)s.truncate(items[i].session->n_pos_);
      return st.context(fmt::format("batch item {}", i));
    }
    s.bind_layers();
    for (size_t r = 0; r < b.ranks.size(); ++r) {
      Impl::Rank& rk = b.ranks[r];
      std::copy(s.ranks[r].layer_kv.begin(), s.ranks[r].layer_kv.end(),
                rk.layer_kv.begin() + i * L);
      rk.seqs[i] = model::SeqSlice{static_cast<int32_t>(b.tokens.size()), n,
                                   std::span<const model::LayerKv>(rk.layer_kv).subspan(i * L, L),
                                   items[i].all_logits};
    }
    b.tokens.insert(b.tokens.end(), items[i].tokens.begin(), items[i].tokens.end());
    const auto ap = s.kv().append_pos();
    b.pos.insert(b.pos.end(), ap.begin(), ap.end());
  }
  // One capture for the whole batch, of every name an item wants (all when one wants all).
  bool capture = false, capture_all = false;
  b.capture.only.clear();
  b.capture.device = nullptr;
  for (const Item& it : items) {
    if (!it.capture) continue;
    capture = true;
    // An item that reads its rows on this backend has the batch keep them there; each item
    // then takes its rows as it asked (record_rows), on the device or as a host copy.
    if (it.capture->device == &backend_.tp_rank(0)) b.capture.device = it.capture->device;
    capture_all = capture_all || it.capture->only.empty();
    for (const std::string& name : it.capture->only)
      if (std::find(b.capture.only.begin(), b.capture.only.end(), name) == b.capture.only.end())
        b.capture.only.push_back(name);
  }
  if (capture_all) b.capture.only.clear();
  b.logits.resize(static_cast<size_t>(rows) * static_cast<size_t>(hp.n_vocab), backend_);
  b.top_ids.resize(static_cast<size_t>(rows) * static_cast<size_t>(top_k));
  b.top_vals.resize(b.top_ids.size());
  backend_.tp_run([&](int r) {
    Impl::Rank& rk = b.ranks[static_cast<size_t>(r)];
    model::ForwardBatch fb;
    fb.tokens = b.tokens;
    fb.pos = b.pos;
    fb.seqs = rk.seqs;
    fb.capture = capture && r == 0 ? &b.capture : nullptr;
    if (top_k > 0 && r == 0) {
      fb.top_k = top_k;
      fb.top_ids = b.top_ids;
      fb.top_vals = b.top_vals;
    }
    const model::Shard& sh = b.shards[static_cast<size_t>(r)];
    model::forward(sh.hp, sh.w, backend_.tp_rank(r), rk.fwd, fb,
                   r == 0 ? b.logits.span() : std::span<float>());
  });
  if (Status st = take_expert_errors(b.shards); !st) {
    for (const Item& it : items) (void)it.session->impl_->truncate(it.session->n_pos_);
    return st;
  }
  // Each capturing item gets its own rows (the batch holds the items' tokens in order).
  int64_t first = 0;
  for (const Item& it : items) {
    const auto n = static_cast<int64_t>(it.tokens.size());
    if (it.capture) {
      it.capture->clear();
      for (const auto& entry : b.capture.nodes) {
        const auto& name = entry.first;
        const auto& node = entry.second;
        if (node.n_rows != total) continue;
        it.capture->record_rows(name, node, backend_.tp_rank(0), first, n);
      }
    }
    first += n;
  }
  for (const Item& it : items) {
    it.session->impl_->commit();
    it.session->n_pos_ += static_cast<int32_t>(it.tokens.size());
  }
  return Status::ok();
}

}  // namespace kiln
