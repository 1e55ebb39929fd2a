// engine/session.h: the public inference API. `Model` is the immutable, shareable half (one
// GGUF mapping, hyper-parameters, weights bound as views into the mapping); `Session` is one
// sequence's mutable state (KV cache, position) evaluated on a Backend.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "engine/host_logits.h"
#include "format/gguf.h"
#include "model/capture.h"
#include "model/hparams.h"
#include "model/weights.h"
#include "moe/expert_store.h"

namespace kiln {

class KvCache;

class Model {
 public:
  // What Model::load does beyond opening the file. Converts from a StoreConfig, so
  // `Model::load(path, store_config)` reads as before.
  struct LoadOptions {
    LoadOptions(moe::StoreConfig experts = {}, model::RoutingOverride routing = {})
        : experts(experts), routing(routing) {}
    // MoE experts streamed from the file through an LRU cache of slabs when
    // experts.enabled() (moe/expert_store.h; outputs identical). Dense models ignore it.
    moe::StoreConfig experts;
    // MoE routing overridden for benchmarks (model/routing.h; not the model's outputs unless
    // it is the default).
    model::RoutingOverride routing;
    // Benchmarks only (kiln bench's dense baseline of a sparse-attention model): the fast
    // pass runs no indexer and attends over every key (model::HParams::dsa_dense). Set in
    // code, never from a user option.
    bool dsa_dense = false;
  };
  // Opens and validates `path`: known architecture, hyper-parameters, every tensor present
  // with the shape the hyper-parameters imply. Errors name the file and the key or tensor at
  // fault.
  static Expected<std::shared_ptr<const Model>> load(const std::string& path,
                                                     const LoadOptions& options = {});
  // Same, for a file already opened (tests build GGUFs in memory).
  static Expected<std::shared_ptr<const Model>> from_gguf(GgufFile gguf);

  const GgufFile& gguf() const { return gguf_; }
  const model::HParams& hparams() const { return hp_; }
  const model::Weights& weights() const { return w_; }
  int32_t n_vocab() const { return hp_.n_vocab; }
  int32_t n_ctx_train() const { return hp_.n_ctx_train; }
  const std::string& arch_name() const { return hp_.arch_name; }
  // Bytes of tensor data (what one decoded token must read, dense models).
  uint64_t weight_bytes() const;

  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

 private:
  Model() = default;
  // The model before it is shared (and so still mutable): load() finishes it.
  static Expected<std::shared_ptr<Model>> build(GgufFile gguf);
  GgufFile gguf_;  // owns the mapping every weight view points into
  model::HParams hp_;
  model::Weights w_;
};

// Whether `model` splits over a tensor-parallel group of n ranks (model/tensor_parallel.h):
// an error naming what does not divide. Sessions on a group backend require it (checked).
Status check_tensor_parallel(const Model& model, int n);

// One sequence. Not thread-safe; several sessions may share one Model (and, used from one
// thread at a time, one Backend). On a tensor-parallel group backend (tp_size() > 1) each
// step runs on every rank over its shard and KV heads; the logits are rank 0's.
class Session {
 public:
  // n_ctx <= 0 means the model's training context. The KV cache is sized for n_ctx.
  // max_batch: most tokens one forward step processes (longer evals run in chunks);
  // <= 0 means the default, 512.
  Session(std::shared_ptr<const Model> model, Backend& backend, int32_t n_ctx,
          int32_t max_batch = 0);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Appends `tokens` at positions n_pos().. and runs them as one batch. Returns the logits of
  // the last token ([n_vocab]) or, with all_logits, of every token ([n][n_vocab], row-major).
  // The span stays valid until the next eval/rollback. Errors (state unchanged): empty input,
  // a token id outside [0, n_vocab), n_pos() + n > n_ctx().
  Expected<std::span<const float>> eval(std::span<const int32_t> tokens, bool all_logits);
  // A token row's k best candidates in sampling order (Backend::top_k): what a sampler whose
  // Sampler::candidates_needed() is at most k needs instead of the whole row. ids and logits
  // [rows][k], valid until the next eval.
  struct TopK {
    std::span<const int32_t> ids;
    std::span<const float> logits;
  };
  // eval(tokens, false) that returns the last token's k best candidates instead of its logits
  // (a device backend downloads k values, not the vocabulary). 1 <= k <= n_vocab(); otherwise
  // the same errors as eval(). all_rows: every token's ([n][k], as eval(tokens, true) gives
  // every token's logits); then the tokens must fit one forward step (n <= max_batch()).
  Expected<TopK> eval_top_k(std::span<const int32_t> tokens, int32_t k, bool all_rows = false);
  // The first part of a prompt's evaluation for generation; returns the tokens still to
  // evaluate (with eval or eval_top_k) for the first sampled token's logits. On a
  // batch-invariant backend that is the whole prompt, evaluated here not at all. On another
  // (Backend::batch_invariant) all but the last token are evaluated here and the last is
  // returned, to be a step of its own: speculative decoding evaluates the prompt so
  // (SpeculativeDecoder::start), the last token first in the first verify step, and such a
  // backend gives a token of a short step the bits of a one-token step but not those of a long
  // prompt's step; plain generation then computes what speculative generation does. Errors:
  // those of eval (an empty prompt).
  Expected<std::span<const int32_t>> prefill_head(std::span<const int32_t> prompt);
  // Forgets every position >= n_pos (0 <= n_pos <= n_pos()).
  Status rollback(int32_t n_pos);
  // Replaces this session's positions with the first n_pos of `src` (same model, backend and
  // geometry), copying their KV rows instead of evaluating them again: the next eval gives
  // what it would give after evaluating those tokens here (the scheduler's n > 1 choices
  // share one prompt prefill this way). Errors: another model, backend or context, or more
  // positions than `src` holds (this session unchanged); rows a ring of `src` no longer
  // retains (this session empty, n_pos() == 0).
  Status copy_prefix_from(const Session& src, int32_t n_pos);

  int32_t n_pos() const { return n_pos_; }
  int32_t n_ctx() const { return n_ctx_; }
  int32_t max_batch() const;  // most tokens one forward step takes (longer evals chunk)
  int32_t n_vocab() const { return model_->n_vocab(); }
  const Model& model() const { return *model_; }
  Backend& backend() const { return backend_; }
  // Bytes held by the KV cache of this session (all ranks of a tensor-parallel backend).
  uint64_t kv_bytes() const;
  // KV bytes one position takes over all layers (and ranks): K + V rows, or a latent row.
  uint64_t kv_bytes_per_token() const;
  // Ranks of the backend this session runs on (backend/tp_group.h); 1 on a plain backend.
  int tp_size() const;
  // The rope frequency factors this session's context uses (model::rope_factors_for: Llama 3's
  // rope_freqs, LongRoPE's long or short set by n_ctx(), or none). K rows are rotated by them.
  std::span<const float> rope_factors() const;

  // When set, each eval records its named activations (`blk.N.attn_norm`, ..., see
  // model/capture.h) into *capture (cleared at the start of each eval). nullptr: off.
  void set_capture(model::Capture* capture) { capture_ = capture; }

  // kvpack (src/transfer): the KV cache as it is, for saving (rank 0's share under tensor
  // parallelism, where kvpack refuses: check tp_size()); and the one way to replace it,
  // with a cache built elsewhere (a fresh cache restored from a pack). `kv` must have this
  // session's geometry (layers, n_ctx, max_batch); n_pos() becomes kv.n_pos(). On error the
  // session is unchanged.
  const KvCache& kv_cache() const;
  Status install_kv(KvCache&& kv);

 private:
  std::shared_ptr<const Model> model_;
  Backend& backend_;
  int32_t n_ctx_ = 0;
  int32_t n_pos_ = 0;
  struct Impl;  // KV cache + forward scratch (session.cpp)
  std::unique_ptr<Impl> impl_;
  Status eval_impl(std::span<const int32_t> tokens, bool all_logits, int32_t top_k);
  HostLogits logits_;             // [n_out][n_vocab]
  std::vector<int32_t> top_ids_;  // eval_top_k: [k]
  std::vector<float> top_vals_;
  model::Capture* capture_ = nullptr;
  friend class BatchEval;
};

// Several sessions' steps in one forward pass (batched decode across slots): each weight
// matrix is read once for every token of the batch (matvec becomes a small matmul) while each
// token attends only over its own session's KV. Token-invariant kernels make every session's
// logits bit-identical to evaluating it alone (docs/determinism.md). Not thread-safe; use it
// from the one thread that drives the sessions.
class BatchEval {
 public:
  // max_tokens: most tokens one eval() may hold over all items (> 0).
  BatchEval(std::shared_ptr<const Model> model, Backend& backend, int32_t max_tokens);
  ~BatchEval();
  BatchEval(const BatchEval&) = delete;
  BatchEval& operator=(const BatchEval&) = delete;

  struct Item {
    Session* session = nullptr;       // distinct sessions of this BatchEval's model
    std::span<const int32_t> tokens;  // appended at session->n_pos().., <= its max_batch()
    bool all_logits = false;          // every token's logits, not only the last one's
    // Set: receives this item's rows of the activations it names (Capture::only; cleared
    // first), as Session::set_capture would for the item evaluated alone. Activations with a
    // row per token only (not result_norm / result_output).
    model::Capture* capture = nullptr;
  };
  // Appends each item's tokens to its session and returns logits row-major [rows][n_vocab]:
  // item by item, one row (its last token) or, with all_logits, one per token; valid until
  // the next eval. Errors (every session unchanged) name the item: no items, a null or
  // repeated session, another model, empty tokens, an id outside the vocabulary, more than
  // the session's max_batch() tokens, context overflow, more than max_tokens() in all.
  Expected<std::span<const float>> eval(std::span<const Item> items);
  // eval(items) that returns each item's last-token k best candidates in sampling order
  // (Session::TopK, [items][k]) instead of its logits. No item may ask for all_logits;
  // 1 <= k <= n_vocab.
  Expected<Session::TopK> eval_top_k(std::span<const Item> items, int32_t k);

  int32_t max_tokens() const { return max_tokens_; }

 private:
  Status eval_impl(std::span<const Item> items, int32_t top_k);
  std::shared_ptr<const Model> model_;
  Backend& backend_;
  int32_t max_tokens_ = 0;
  struct Impl;  // forward scratch and the flattened batch (session.cpp)
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln
