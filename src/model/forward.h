// model/forward.h: the fast forward pass: the reference graph built only from Backend ops.
// A prefill runs all of its tokens through each weight matrix in one matmul (matrix-matrix);
// a decode step is the same code with one row. KV storage belongs to the caller (the engine
// adapts kv/KvCache to LayerKv), so this layer does not depend on kv/.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/half.h"
#include "model/capture.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace kiln::model {

// One layer's KV planes for the step being evaluated.
struct LayerKv {
  std::span<const int32_t> append_rows;  // [n_tok] physical rows the new keys/values go to
  std::span<const int32_t> kv_rows;      // physical row of every key the batch may see
  std::span<const int32_t> kv_pos;       // position of each of those keys
  std::span<f16> k, v;                   // planes [n_phys][k_width | v_width]
};

struct ForwardBatch {
  std::span<const int32_t> tokens;  // [n_tok], ids already validated
  std::span<const int32_t> pos;     // [n_tok]
  std::span<const LayerKv> kv;      // [n_layer]
  bool all_logits = false;          // false: logits of the last token only
  Capture* capture = nullptr;       // optional: records the named activations
};

// Activation scratch for batches of up to max_batch tokens, reused across steps.
class ForwardState {
 public:
  ForwardState(const HParams& hp, int32_t max_batch);
  int32_t max_batch() const { return max_batch_; }

 private:
  friend void forward(const HParams&, const Weights&, Backend&, ForwardState&,
                      const ForwardBatch&, std::span<float>);
  int32_t max_batch_;
  std::vector<float> x, h, q, k, v, o, gate, a, ff_gate, ff_up, ff_act, tmp;
  // Mixture-of-experts scratch: router probabilities [B][n_expert], the chosen experts and
  // their weights [B][n_expert_used], and the rows routed to one expert gathered together.
  std::vector<float> router, sel_w, moe_in, moe_out;
  std::vector<int32_t> sel_e, moe_rows;
};

// Runs one step. `logits` receives [n_out][n_vocab] with n_out = n_tok (all_logits) or 1.
void forward(const HParams& hp, const Weights& w, Backend& be, ForwardState& st,
             const ForwardBatch& batch, std::span<float> logits);

}  // namespace kiln::model
