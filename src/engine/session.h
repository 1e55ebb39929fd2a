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
#include "format/gguf.h"
#include "model/capture.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace kiln {

class Model {
 public:
  // Opens and validates `path`: known architecture, hyper-parameters, every tensor present
  // with the shape the hyper-parameters imply. Errors name the key or tensor at fault.
  static Expected<std::shared_ptr<const Model>> load(const std::string& path);
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
  GgufFile gguf_;  // owns the mapping every weight view points into
  model::HParams hp_;
  model::Weights w_;
};

// One sequence. Not thread-safe; several sessions may share one Model (and, used from one
// thread at a time, one Backend).
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
  // Forgets every position >= n_pos (0 <= n_pos <= n_pos()).
  Status rollback(int32_t n_pos);

  int32_t n_pos() const { return n_pos_; }
  int32_t n_ctx() const { return n_ctx_; }
  int32_t max_batch() const;  // most tokens one forward step takes (longer evals chunk)
  int32_t n_vocab() const { return model_->n_vocab(); }
  const Model& model() const { return *model_; }
  Backend& backend() const { return backend_; }
  // Bytes held by the KV cache of this session.
  uint64_t kv_bytes() const;

  // When set, each eval records its named activations (`blk.N.attn_norm`, ..., see
  // model/capture.h) into *capture (cleared at the start of each eval). nullptr: off.
  void set_capture(model::Capture* capture) { capture_ = capture; }

 private:
  std::shared_ptr<const Model> model_;
  Backend& backend_;
  int32_t n_ctx_ = 0;
  int32_t n_pos_ = 0;
  struct Impl;  // KV cache + forward scratch (session.cpp)
  std::unique_ptr<Impl> impl_;
  std::vector<float> logits_;  // [n_out][n_vocab]
  model::Capture* capture_ = nullptr;
};

}  // namespace kiln
