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

  int64_t q_width() const { return int64_t(n_head) * head_dim_k; }
  int64_t k_width() const { return int64_t(n_head_kv) * head_dim_k; }
  int64_t v_width() const { return int64_t(n_head_kv) * head_dim_v; }
  int64_t o_width() const { return int64_t(n_head) * head_dim_v; }
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
