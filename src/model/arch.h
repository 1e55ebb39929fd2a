// model/arch.h: the architecture table. Each supported `general.architecture` is one row of
// data (RoPE style, which optional tensors exist, activation, window pattern, ...); the
// hyper-parameter reader and both forward passes read these flags instead of comparing names.
#pragma once

#include <string_view>

#include "backend/backend.h"
#include "model/routing.h"

namespace kiln::model {

// SwigluOai: gpt-oss's clamped SwiGLU (llama.cpp's swiglu_oai, alpha 1.702, limit 7).
enum class FfnAct { Silu, GeluTanh, SwigluOai };

// How layers alternate between full and sliding-window attention.
enum class SwaRule {
  None,     // every layer full
  Pattern,  // layer il slides iff il % pattern < pattern - 1 (llama.cpp's swa pattern)
};

struct ArchInfo {
  std::string_view name;  // general.architecture
  RopeStyle rope_style = RopeStyle::Normal;
  bool qkv_bias = false;          // attn_{q,k,v}.bias present (qwen2)
  bool qk_norm = false;           // attn_{q,k}_norm: per-head RMS norm before RoPE
  bool post_norms = false;        // post_attention_norm / post_ffw_norm (sandwich)
  bool attn_gate = false;         // attn_gate: sigmoid gate on attention output
  bool embd_scale_sqrt = false;   // embeddings multiplied by sqrt(n_embd)
  bool embd_rmsnorm = false;      // embeddings RMS-normalised (no weight) before layer 0
  bool experts_allowed = false;   // {arch}.expert_count may select an MoE layout
  bool experts_required = false;  // {arch}.expert_count must be present (qwen3moe)
  bool attn_out_bias = false;     // attn_output.bias present (gpt-oss)
  bool attn_sinks = false;        // attn_sinks: one extra logit per head in the softmax
  bool moe_biases = false;        // ffn_gate_inp.bias and ffn_{gate,up,down}_exps.bias
  // The FFN's pre-norm is stored as post_attention_norm.weight (gpt-oss), not ffn_norm.
  bool ffn_norm_is_post_attention_norm = false;
  bool full_layers_nope = false;   // full-attention layers skip RoPE
  bool swa_rope_unscaled = false;  // sliding layers ignore rope.scaling (gemma3)
  bool rope_freqs = false;         // optional rope_freqs.weight: Llama 3 frequency factors
  bool longrope = false;           // optional rope_factors_{long,short}.weight (LongRoPE)
  bool fused_qkv = false;          // attn_qkv: Q, K, V rows in one tensor (q | k | v)
  bool fused_gate_up = false;      // ffn_up holds 2 * n_ff rows: the gate half, then the up half
  // Multi-head latent attention (HParams::mla): attn_q_a/_norm/_b (or attn_q), attn_kv_a_mqa,
  // attn_kv_a_norm, attn_k_b, attn_v_b instead of attn_q/k/v; YaRN with DeepSeek's mscale
  // (rope.scaling.yarn_log_multiplier) in the attention scale.
  bool mla = false;
  // DeepSeek sparse attention on top of latent attention (glm-dsa; HParams::dsa): the
  // attention.indexer.* keys and each layer's indexer.* tensors; a full layer's lightning
  // indexer picks which keys the attention reads, a shared layer reuses that choice.
  bool dsa = false;
  // attention.sliding_window is read and range-checked but every layer attends over all keys:
  // llama.cpp turns phi3's window off (its converters wrote the key without the layer pattern
  // it belongs to, llama.cpp PR 13676), so matching it means not applying it.
  bool swa_key_disabled = false;
  // DeepSeek-V3-style MoE (deepseek2, glm4moe): the keys expert_gating_func (absent:
  // default_gating), expert_group_count / expert_group_used_count, expert_weights_norm
  // (absent: false), expert_weights_scale (required), expert_shared_count (shared experts
  // ffn_{gate,up,down}_shexp, expert_shared_feed_forward_length wide each, default the expert
  // width) and leading_dense_block_count are read, and exp_probs_b.bias (per-expert
  // selection bias) is bound where a layer has it. Other rows refuse those keys.
  bool moe_v3 = false;
  GatingFunc default_gating = GatingFunc::Softmax;
  bool qk_norm_optional = false;  // attn_{q,k}_norm bound where a layer has them (glm4moe)
  // {arch}.nextn_predict_layers N: the last N of block_count blocks are NextN (MTP) blocks,
  // bound (model/weights.h NextnWeights) but not run by the main pass, with no KV rows there.
  bool nextn = false;
  float post_norm_eps = 0;  // > 0: eps of the post norms (else the metadata eps)
  FfnAct act = FfnAct::Silu;
  SwaRule swa = SwaRule::None;
  int default_swa_pattern = 0;  // used when {arch}.attention.sliding_window_pattern is absent
  bool supported = true;        // false: recognised but its forward pass is not built yet
  // A drafter that runs only beside a target (model/dflash.h), never as a model of its own.
  bool drafter_only = false;
};

// The row for `name`, or nullptr for an architecture kiln does not know.
const ArchInfo* find_arch(std::string_view name);

}  // namespace kiln::model
