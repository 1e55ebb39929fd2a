// model/hparams.h: hyper-parameters read from GGUF metadata (llama.cpp key names), with a
// per-layer description so architecture quirks (sliding window, NoPE, sandwich norms, gates,
// experts) are data the forward passes read, not branches on the architecture name.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "format/gguf.h"
#include "model/arch.h"
#include "model/routing.h"

namespace kiln::model {

enum class AttnKind { Full, Sliding };

// A layer's part in DeepSeek sparse attention (HParams::dsa): no indexer (every other
// architecture), a full layer whose lightning indexer scores the keys and keeps the best
// top_k for each query, or a shared layer that attends over the keys the most recent full
// layer chose for the same query.
enum class IndexerKind { None, Full, Shared };

struct LayerDesc {
  AttnKind kind = AttnKind::Full;
  int32_t window = 0;    // > 0 for sliding layers: keys with q_pos - k_pos < window
  bool use_rope = true;  // false: NoPE layer
  RopeParams rope;       // per layer: base differs between local and global layers
  int32_t n_ff = 0;      // dense FFN width (0 for an MoE layer)
  int32_t n_expert = 0;  // > 0: MoE layer
  int32_t n_expert_used = 0;
  int32_t n_ff_expert = 0;
  int32_t n_ff_shexp = 0;  // > 0: the MoE layer's shared experts, one FFN this wide (all of
                           // expert_shared_count side by side), added to the routed output
  IndexerKind indexer = IndexerKind::None;
  // Full indexer layers: the KV cache layer (after the n_layer attention layers) whose K-only
  // rows hold this layer's indexer keys; -1 elsewhere.
  int32_t indexer_kv = -1;
};

// Multi-head latent attention (deepseek2; ArchInfo::mla). Each token keeps one latent row per
// layer -- kv_lora normalised c_kv values, then rope roped k_pe values -- which every head
// reads: the attention is MQA over that row (one KV head of width kv_lora + rope, V being its
// first kv_lora columns), with the queries' no-RoPE part projected into the latent space by
// attn_k_b and each head's output projected back out by attn_v_b (the absorbed form).
struct MlaDims {
  int32_t q_lora = 0;   // attention.q_lora_rank; 0: a plain attn_q instead of attn_q_a/_b
  int32_t kv_lora = 0;  // attention.kv_lora_rank: the latent width
  int32_t nope = 0;     // per-head query dims without RoPE (key_length_mla - rope)
  int32_t rope = 0;     // per-head RoPE dims, shared by all heads on the key side (n_rot)
  int32_t v = 0;        // attention.value_length_mla: per-head value width after attn_v_b
  int32_t q_head() const { return nope + rope; }  // one head's rows of attn_q(_b)
};

// DeepSeek sparse attention (glm-dsa; ArchInfo::dsa): the lightning indexer's shape. Each
// indexer head is head_dim wide with its RoPE part first (n_rot dims, adjacent pairs) and the
// rest unroped -- the opposite of the latent attention's query heads, whose RoPE part comes
// last. Keys are one head (indexer.attn_k, then a LayerNorm with weight and bias); a token's
// score for key j is sum_h w_h * ReLU(q_h . k_j), w = indexer.proj of the attn_norm'd row.
struct DsaDims {
  int32_t n_head = 0;    // attention.indexer.head_count
  int32_t head_dim = 0;  // attention.indexer.key_length
  int32_t top_k = 0;     // attention.indexer.top_k: keys kept per query on full layers
};

struct HParams {
  std::string arch_name;
  const ArchInfo* arch = nullptr;
  int32_t n_vocab = 0;
  int32_t n_ctx_train = 0;
  int32_t n_embd = 0;
  int32_t n_layer = 0;
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim_k = 0;  // attention.key_length (default n_embd / n_head)
  int32_t head_dim_v = 0;  // attention.value_length
  int32_t n_rot = 0;       // rope.dimension_count (default head_dim_k)
  float rms_eps = 1e-5f;
  float post_norm_eps = 1e-5f;    // eps of post-attention / post-FFN norms
  float attn_scale = 0;           // query scale (default 1/sqrt(head_dim_k))
  float attn_softcap = 0;         // > 0: tanh softcap of attention logits
  float final_softcap = 0;        // > 0: tanh softcap of output logits
  float logit_scale = 1;          // output logits multiplied by this before the softcap
  float embd_scale = 1;           // token embeddings multiplied by this (gemma: sqrt(n_embd))
  std::vector<LayerDesc> layers;  // [n_layer]: the blocks the main pass runs
  // NextN (MTP) blocks (ArchInfo::nextn): block_count = n_layer + nextn_layers.size(); block
  // n_layer + i is nextn_layers[i]. Not run by the main pass, no KV rows there; the MTP
  // drafter (engine/mtp_drafter.h) runs them.
  std::vector<LayerDesc> nextn_layers;
  // Latent attention (all zero elsewhere). With it, n_head_kv is 1, head_dim_k is the latent
  // row (kv_lora + rope) and head_dim_v its value part (kv_lora), as the GGUF's key_length
  // and value_length say: the shapes the attention op sees.
  MlaDims mla;
  bool is_mla() const { return mla.kv_lora > 0; }
  // Sparse attention (all zero elsewhere); LayerDesc::indexer says which layers select.
  DsaDims dsa;
  bool is_dsa() const { return dsa.top_k > 0; }
  // KV cache layers: the n_layer attention layers, then one K-only layer (dsa.head_dim wide,
  // full attention) per full indexer layer, in layer order (LayerDesc::indexer_kv).
  int32_t n_indexer_kv = 0;

  // Tensor parallelism (model/tensor_parallel.h): this shard is rank tp_rank of tp_size, its
  // head counts and FFN widths already divided; an MoE layer's experts belong to the rank
  // whose contiguous block of ids holds them. A whole model is rank 0 of 1.
  int32_t tp_rank = 0;
  int32_t tp_size = 1;
  bool owns_expert(int32_t e, int32_t n_expert) const {
    return e >= int64_t(n_expert) * tp_rank / tp_size &&
           e < int64_t(n_expert) * (tp_rank + 1) / tp_size;
  }

  // How MoE layers choose and weight their experts (model/routing.h); softmax, top-k,
  // renormalised unless the architecture reads the DeepSeek-V3 keys (ArchInfo::moe_v3).
  RouterParams router;

  // Benchmark-only MoE routing override (model/routing.h); Model by default (no override).
  RoutingOverride routing;
  // Benchmark-only: sparse attention off in the fast pass (no indexer, every layer attends
  // over every visible key), kiln bench's dense baseline. Never a user option.
  bool dsa_dense = false;

  int64_t q_width() const { return int64_t(n_head) * head_dim_k; }
  int64_t k_width() const { return int64_t(n_head_kv) * head_dim_k; }
  int64_t v_width() const { return int64_t(n_head_kv) * head_dim_v; }
  int64_t o_width() const { return int64_t(n_head) * head_dim_v; }
  // Floats per token of a layer's K and V cache rows: latent attention keeps only the latent
  // row (its V is the first kv_lora columns of it), so no V plane.
  int64_t kv_k_width() const { return k_width(); }
  int64_t kv_v_width() const { return is_mla() ? 0 : v_width(); }
};

// Reads "{arch_name}.rope.scaling.*" into `rope` (whose freq_base and n_rot are set): the
// factor (or the older rope.scale_linear) as freq_scale = 1 / factor; the type (none, linear
// -- llama.cpp's default --, yarn, longrope); for YaRN ext_factor 1, original_context_length
// (default n_ctx_train), yarn_beta_fast / yarn_beta_slow (default 32 / 1); attn_factor (default
// 1) for every type. One function for every architecture that reads these keys.
Status read_rope_scaling(const GgufFile& g, std::string_view arch_name, int32_t n_ctx_train,
                         RopeParams& rope);

// Reads and validates the hyper-parameters of `g` (n_vocab comes from token_embd's shape).
// Unknown architecture, missing or inconsistent keys: an error naming the key.
Expected<HParams> read_hparams(const GgufFile& g);

}  // namespace kiln::model
