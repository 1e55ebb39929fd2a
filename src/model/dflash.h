// model/dflash.h: the DFlash block drafter (architecture `dflash`, llama.cpp's DFlash v1
// decoder). It has no embedding or output head of its own: it borrows the target's. Two
// passes, both built from Backend ops:
//  - inject: the target's features (the inputs of the listed target layers, concatenated per
//    token) -> fc -> RMS norm (enc.output_norm) = g; every drafter layer stores
//    K = rope(k_norm(attn_k . g)) and V = attn_v . g at the tokens' positions. g gets no
//    attn_norm: it is the layer's key/value input as it is.
//  - block: the tokens [last, mask x (n-1)] embedded by the target, then per layer a pre-norm
//    block (attn_norm, Q/K/V with per-head q/k norms, NeoX rope, attention, ffn_norm, SwiGLU)
//    whose attention is NOT causal: every block token sees the injected context and the whole
//    block. Then output_norm and the target's output matrix (no logit scale or softcap: llama.cpp
//    reads DFlash v1 logits without the target's output transforms).
// KV storage belongs to the caller (model::LayerKv, as for forward()).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "format/gguf.h"
#include "model/forward.h"
#include "model/hparams.h"

namespace kiln::model {

struct DflashParams {
  int32_t block_size = 0;              // dflash.block_size: the block's tokens incl. the anchor
  std::vector<int32_t> target_layers;  // dflash.target_layers: inputs of these target layers
  int32_t mask_token_id = 0;           // tokenizer.ggml.mask_token_id
  int32_t n_vocab = 0;                 // dflash.vocab_size: must be the target's
};

struct DflashLayerWeights {
  std::span<const float> attn_norm;       // [n_embd]
  WeightMatrix wq, wk, wv, wo;            // [q_width|k_width|v_width][n_embd], [n_embd][o_width]
  std::span<const float> q_norm, k_norm;  // [head_dim]
  std::span<const float> ffn_norm;        // [n_embd]
  WeightMatrix ffn_gate, ffn_up;          // [n_ff][n_embd]
  WeightMatrix ffn_down;                  // [n_embd][n_ff]
};

struct DflashWeights {
  WeightMatrix fc;                     // [n_embd][n_feat]: concatenated target features -> g
  std::span<const float> enc_norm;     // [n_embd] enc.output_norm (after fc)
  std::span<const float> output_norm;  // [n_embd]
  std::vector<DflashLayerWeights> layers;
  std::vector<std::vector<float>> owned;  // dequantized copies of non-f32 vectors
};

// A loaded drafter: the mapping, its hyper-parameters (HParams for the decoder layers, with
// `arch` the dflash row) and its weights. Immutable once loaded.
struct DflashModel {
  GgufFile gguf;
  HParams hp;
  DflashParams dp;
  DflashWeights w;
  int64_t n_feat() const { return int64_t(dp.target_layers.size()) * hp.n_embd; }
};

// Opens and validates a `dflash` GGUF (fail closed: an unknown key under `dflash.`, a tensor
// nothing binds, a feature kiln does not implement are refused with one line).
Expected<DflashModel> load_dflash(const std::string& path);
Expected<DflashModel> dflash_from_gguf(GgufFile gguf);

// Whether the drafter fits a target of these hyper-parameters (one line naming the mismatch):
// same width, same vocabulary, target layers within [0, n_layer], the mask token a token.
Status check_dflash_target(const DflashModel& d, const HParams& target);

// The target activation holding the input of target layer L (model/capture.h names):
// `inp_embd` for layer 0, else the previous layer's `l_out` (L == n_layer: the last layer's
// output before the final norm, as llama.cpp allows).
std::string dflash_feature_name(int32_t layer);

// Scratch for passes of up to max_rows tokens, in the memory of the backend that runs them.
class DflashState {
 public:
  DflashState(const DflashModel& d, int32_t max_rows);
  int32_t max_rows() const { return max_rows_; }

 private:
  friend class DflashPass;  // dflash.cpp: the passes slice these buffers
  friend void dflash_inject(const DflashModel&, Backend&, DflashState&, std::span<const float>,
                            std::span<const int32_t>, std::span<const LayerKv>);
  friend void dflash_block(const DflashModel&, const WeightMatrix&, const WeightMatrix&, Backend&,
                           DflashState&, std::span<const int32_t>, std::span<const int32_t>,
                           std::span<const LayerKv>, std::span<int32_t>, std::span<float>);
  void bind(Backend& be);
  const DflashModel& d_;
  int32_t max_rows_;
  Backend* bound_ = nullptr;
  BackendBuffer<float> x, h, q, k, v, o, a, ff_gate, ff_up, ff_act, tmp, logits;
  std::vector<int32_t> mask_pos;  // the non-causal mask: every query at the block's last position
  std::vector<float> top_vals;    // the drafts' logits (top_k's values; unused)
  std::vector<Backend::StoreRowsTask> stores;
};

// Injects features [n][n_feat] (backend memory) of tokens at `pos` into every layer's planes
// at kv[l].append_rows (n == pos.size() <= max_rows).
void dflash_inject(const DflashModel& d, Backend& be, DflashState& st,
                   std::span<const float> features, std::span<const int32_t> pos,
                   std::span<const LayerKv> kv);

// The block pass: n tokens [anchor, mask...] at `pos` (consecutive, after every injected
// position), their keys and values stored at kv[l].append_rows, attending non-causally over
// kv[l].kv_rows. The drafts: ids[i] = the argmax (lowest id on ties) of row i + 1's logits
// (n - 1 ids; a device backend ships one id per row, not the rows). `logits` non-empty: those
// rows' logits too ([n - 1][n_vocab], host memory). The anchor's row gets no logits.
// tok_embd / output: the target's.
void dflash_block(const DflashModel& d, const WeightMatrix& tok_embd, const WeightMatrix& output,
                  Backend& be, DflashState& st, std::span<const int32_t> tokens,
                  std::span<const int32_t> pos, std::span<const LayerKv> kv, std::span<int32_t> ids,
                  std::span<float> logits);

}  // namespace kiln::model
