// model/reference.h: the reference forward pass, the spec every fast path is tested against.
// f32 throughout, plain loops, weights read through quant::dequantize_row one row at a time
// (the whole model is never materialised in f32), f32 keys/values kept per layer. Slow by
// design; it records the same named activations as the fast pass.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "model/capture.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace kiln::model {

class ReferenceSession {
 public:
  // hp and w must outlive the session (they belong to the loaded model). n_ctx <= 0: the
  // model's training context.
  ReferenceSession(const HParams& hp, const Weights& w, int32_t n_ctx);

  // Same contract as kiln::Session::eval: logits of the last token, or of all tokens.
  Expected<std::span<const float>> eval(std::span<const int32_t> tokens, bool all_logits);
  Status rollback(int32_t n_pos);
  int32_t n_pos() const { return n_pos_; }
  int32_t n_ctx() const { return n_ctx_; }
  void set_capture(Capture* capture) { capture_ = capture; }
  // The next eval's input rows ([n_tok][n_embd], borrowed until that eval returns) in place of
  // the token embeddings: a NextN block's projected input (tests of model::forward_nextn).
  void set_input_rows(std::span<const float> rows) { input_rows_ = rows; }

 private:
  const HParams& hp_;
  const Weights& w_;
  int32_t n_ctx_ = 0;
  int32_t n_pos_ = 0;
  std::vector<std::vector<float>> k_, v_;  // [n_layer][n_pos][k_width|v_width], after RoPE
  std::vector<std::vector<float>> ik_;     // sparse attention: full layers' indexer keys
                                           // [n_pos][dsa.head_dim], after RoPE
  std::vector<float> logits_;
  Capture* capture_ = nullptr;
  std::span<const float> input_rows_;
};

}  // namespace kiln::model
