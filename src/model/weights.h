// model/weights.h: every tensor a forward pass reads, bound once at load as a view into the
// GGUF mapping (never copied). Names follow llama.cpp (token_embd, blk.N.attn_q, ...). Small
// 1-D vectors (norms, biases) are float spans: views when stored as f32, otherwise
// dequantized once into buffers the Weights own.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "format/gguf.h"
#include "model/hparams.h"
#include "moe/expert_source.h"

namespace kiln::model {

struct LayerWeights {
  std::span<const float> attn_norm;  // [n_embd]
  WeightMatrix wq, wk, wv;           // [q_width|k_width|v_width rows][n_embd]
  // Latent attention (HParams::mla), else n_rows == 0 / empty. wq above is then the plain
  // query projection [n_head * (nope + rope)][n_embd] of a model without q-LoRA.
  WeightMatrix wq_a;                 // [q_lora][n_embd]
  std::span<const float> q_a_norm;   // [q_lora]
  WeightMatrix wq_b;                 // [n_head * (nope + rope)][q_lora]: per head nope, rope
  WeightMatrix wkv_a;                // [kv_lora + rope][n_embd]: c_kv, then k_pe
  std::span<const float> kv_a_norm;  // [kv_lora]
  WeightMatrix wk_b;                 // [n_head * kv_lora][nope]: head h is rows h * kv_lora..
  WeightMatrix wv_b;                 // [n_head * v][kv_lora]: head h is rows h * v..
  // DeepSeek sparse attention's lightning indexer (ArchInfo::dsa; bound on full indexer layers
  // and wherever the file has them), else n_rows == 0 / empty. Heads are rope-first
  // (model/hparams.h DsaDims).
  WeightMatrix idx_wq_b;                        // [idx n_head * head_dim][q_lora]
  WeightMatrix idx_wk;                          // [idx head_dim][n_embd]
  std::span<const float> idx_k_norm, idx_k_nb;  // [idx head_dim] LayerNorm weight and bias
  WeightMatrix idx_proj;                        // [idx n_head][n_embd]: per-head score weights
  std::span<const float> bq, bk, bv;            // biases (qkv_bias architectures), else empty
  std::span<const float> q_norm, k_norm;        // [head_dim_k] (qk_norm architectures), else empty
  WeightMatrix wgate_attn;                      // [o_width][n_embd] (attn_gate), else n_rows == 0
  WeightMatrix wo;                              // [n_embd][o_width]
  std::span<const float> bo;                    // [n_embd] (attn_out_bias), else empty
  std::span<const float> attn_sinks;            // [n_head] (attn_sinks), else empty
  std::span<const float> post_attn_norm;        // [n_embd] (post_norms), else empty
  std::span<const float> ffn_norm;              // [n_embd]
  WeightMatrix ffn_gate, ffn_up;                // [n_ff][n_embd] (dense layers)
  WeightMatrix ffn_down;                        // [n_embd][n_ff] (dense layers)
  WeightMatrix ffn_gate_inp;             // [n_expert][n_embd] router (MoE layers), else n_rows == 0
  std::span<const float> post_ffn_norm;  // [n_embd] (post_norms), else empty
  // MoE biases (moe_biases), else empty: the router's [n_expert]; per expert e, rows
  // [e * width, (e + 1) * width) of the gate/up ([n_expert][n_ff_expert]) and down
  // ([n_expert][n_embd]) biases.
  std::span<const float> ffn_gate_inp_b, ffn_gate_exps_b, ffn_up_exps_b, ffn_down_exps_b;
  // [n_expert] selection bias added to the router probabilities to choose experts only
  // (exp_probs_b.bias, ArchInfo::moe_v3 rows where present), else empty.
  std::span<const float> exp_probs_b;
  // The shared experts (LayerDesc::n_ff_shexp > 0), else n_rows == 0: always run, never part
  // of the ExpertSource (so always resident under expert streaming).
  WeightMatrix ffn_gate_shexp, ffn_up_shexp;  // [n_ff_shexp][n_embd]
  WeightMatrix ffn_down_shexp;                // [n_embd][n_ff_shexp]
};

// A NextN (MTP) block (HParams::nextn_layers): h' = eh_proj(concat(enorm(embed(token)),
// hnorm(hidden))) through `layer`, then shared_head_norm and the output head.
struct NextnWeights {
  LayerWeights layer;                           // attention + FFN, as a main-pass layer
  WeightMatrix eh_proj;                         // [n_embd][2 * n_embd]
  std::span<const float> enorm, hnorm;          // [n_embd]
  std::span<const float> shared_head_norm;      // [n_embd]
  WeightMatrix embed_tokens, shared_head_head;  // [n_vocab][n_embd], else n_rows == 0: the
                                                // model's token_embd / output
};

struct Weights {
  WeightMatrix token_embd;             // [n_vocab][n_embd]
  std::span<const float> output_norm;  // [n_embd]
  WeightMatrix output;                 // [n_vocab][n_embd]; token_embd when tied
  bool tied_output = false;
  // [n_rot / 2] rope frequency divisors, else empty: Llama 3's rope_freqs (every layer), or
  // LongRoPE's long and short sets (phi3), one chosen by the context (rope_factors_for).
  std::span<const float> rope_freqs, rope_long, rope_short;
  std::vector<LayerWeights> layers;
  // Expert FFN weights of MoE layers, reached only through this interface (null: dense model).
  std::shared_ptr<moe::ExpertSource> experts;
  // NextN blocks (HParams::nextn_layers) and their experts (layer i: NextN block i), or empty.
  std::vector<NextnWeights> nextn;
  std::shared_ptr<moe::ExpertSource> nextn_experts;
  // Dequantized copies of non-f32 small vectors; the spans above may point into these
  // (moving the outer vector keeps each inner buffer in place).
  std::vector<std::vector<float>> owned;
};

// Binds every tensor the architecture needs; a missing tensor, a wrong shape or a dtype the
// quant layer cannot read is an error naming the tensor and both shapes, and so is a tensor of
// the file that nothing binds (fail closed: none is ever silently ignored).
Expected<Weights> bind_weights(const GgufFile& g, const HParams& hp);

// The rope factors a context of n_ctx positions uses: rope_freqs, else LongRoPE's long set
// when n_ctx exceeds rope.scaling.original_context_length and its short set otherwise, else
// none.
std::span<const float> rope_factors_for(const Weights& w, const HParams& hp, int32_t n_ctx);

// Points every layer's RopeParams::freq_factors at the factors of the model's training context
// (llama.cpp's choice when no context size is given). `w` must outlive `hp`'s use.
void attach_rope_factors(const Weights& w, HParams& hp);

// n values of tensor `name` as floats: a view of aligned F32 data, else a copy (converted or
// dequantized) appended to `owned`, which must outlive the span. Error when n values do not
// fill whole blocks of its type.
Expected<std::span<const float>> tensor_floats(const std::string& name, const TensorView& v,
                                               int64_t n, std::vector<std::vector<float>>& owned);

// A tensor as a WeightMatrix (any number of dims, rows flattened over ne[1..3]).
WeightMatrix as_matrix(const TensorView& t);

}  // namespace kiln::model
