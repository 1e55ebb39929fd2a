// model/hparams.cpp: GGUF metadata -> HParams, with every key checked for range so a bad file
// is an error naming the key, never a division by zero or a huge allocation later.
#include "model/hparams.h"

#include <cmath>

namespace kiln::model {
namespace {

// Reads "{arch}.{suffix}" as T; required keys fail with the full key name.
class KeyReader {
 public:
  KeyReader(const GgufFile& g, std::string arch) : g_(g), arch_(std::move(arch)) {}
  std::string key(std::string_view suffix) const { return fmt::format("{}.{}", arch_, suffix); }
  template <typename T>
  Expected<T> req(std::string_view suffix) const {
    const std::string k = key(suffix);
    if (!g_.has(k)) return Status::errorf("missing metadata key '{}'", k);
    return g_.get<T>(k);
  }
  template <typename T>
  Expected<T> opt(std::string_view suffix, T fallback) const {
    return g_.get_or<T>(key(suffix), fallback);
  }

 private:
  const GgufFile& g_;
  std::string arch_;
};

Status check_range(const std::string& key, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    return Status::errorf("metadata '{}' = {} out of range [{}, {}]", key, v, lo, hi);
  return Status::ok();
}

}  // namespace

Expected<HParams> read_hparams(const GgufFile& g) {
  HParams hp;
  KILN_ASSIGN_OR_RETURN(hp.arch_name, g.get<std::string>("general.architecture"));
  hp.arch = find_arch(hp.arch_name);
  if (!hp.arch) return Status::errorf("unknown architecture '{}'", hp.arch_name);
  if (!hp.arch->supported)
    return Status::errorf("architecture '{}' is recognised but not supported yet", hp.arch_name);
  const ArchInfo& arch = *hp.arch;
  KeyReader r(g, hp.arch_name);

  constexpr int64_t kMaxDim = 1 << 20;
  KILN_ASSIGN_OR_RETURN(hp.n_embd, r.req<int32_t>("embedding_length"));
  KILN_TRY(check_range(r.key("embedding_length"), hp.n_embd, 1, kMaxDim));
  KILN_ASSIGN_OR_RETURN(hp.n_layer, r.req<int32_t>("block_count"));
  KILN_TRY(check_range(r.key("block_count"), hp.n_layer, 1, 4096));
  KILN_ASSIGN_OR_RETURN(hp.n_ctx_train, r.opt<int32_t>("context_length", 2048));
  KILN_TRY(check_range(r.key("context_length"), hp.n_ctx_train, 1, 1 << 24));
  KILN_ASSIGN_OR_RETURN(hp.n_head, r.req<int32_t>("attention.head_count"));
  KILN_TRY(check_range(r.key("attention.head_count"), hp.n_head, 1, 4096));
  KILN_ASSIGN_OR_RETURN(hp.n_head_kv, r.opt<int32_t>("attention.head_count_kv", hp.n_head));
  KILN_TRY(check_range(r.key("attention.head_count_kv"), hp.n_head_kv, 1, hp.n_head));
  if (hp.n_head % hp.n_head_kv != 0)
    return Status::errorf("'{}' = {} does not divide head_count {}",
                          r.key("attention.head_count_kv"), hp.n_head_kv, hp.n_head);
  const int32_t default_head_dim = hp.n_embd / hp.n_head;
  KILN_ASSIGN_OR_RETURN(hp.head_dim_k, r.opt<int32_t>("attention.key_length", default_head_dim));
  KILN_TRY(check_range(r.key("attention.key_length"), hp.head_dim_k, 1, 65536));
  KILN_ASSIGN_OR_RETURN(hp.head_dim_v, r.opt<int32_t>("attention.value_length", hp.head_dim_k));
  KILN_TRY(check_range(r.key("attention.value_length"), hp.head_dim_v, 1, 65536));
  // The KV cache keeps K and V planes of one width and the attention op takes one head_dim.
  if (hp.head_dim_v != hp.head_dim_k)
    return Status::errorf("'{}' = {} differs from '{}' = {}: not supported",
                          r.key("attention.value_length"), hp.head_dim_v,
                          r.key("attention.key_length"), hp.head_dim_k);
  KILN_ASSIGN_OR_RETURN(hp.n_rot, r.opt<int32_t>("rope.dimension_count", hp.head_dim_k));
  KILN_TRY(check_range(r.key("rope.dimension_count"), hp.n_rot, 0, hp.head_dim_k));
  if (hp.n_rot % 2 != 0)
    return Status::errorf("metadata '{}' = {} is odd", r.key("rope.dimension_count"), hp.n_rot);

  KILN_ASSIGN_OR_RETURN(hp.rms_eps, r.opt<float>("attention.layer_norm_rms_epsilon", 1e-5f));
  if (!(hp.rms_eps >= 0 && hp.rms_eps < 1))
    return Status::errorf("metadata '{}' = {} out of range",
                          r.key("attention.layer_norm_rms_epsilon"), hp.rms_eps);
  hp.post_norm_eps = arch.post_norm_eps > 0 ? arch.post_norm_eps : hp.rms_eps;
  KILN_ASSIGN_OR_RETURN(hp.attn_softcap, r.opt<float>("attn_logit_softcapping", 0.0f));
  KILN_ASSIGN_OR_RETURN(hp.final_softcap, r.opt<float>("final_logit_softcapping", 0.0f));
  KILN_ASSIGN_OR_RETURN(hp.logit_scale, r.opt<float>("logit_scale", 1.0f));
  if (hp.attn_softcap < 0 || hp.final_softcap < 0)
    return Status::errorf("negative softcap in '{}' metadata", hp.arch_name);
  hp.attn_scale = 1.0f / std::sqrt(float(hp.head_dim_k));
  hp.embd_scale = arch.embd_scale_sqrt ? std::sqrt(float(hp.n_embd)) : 1.0f;

  // RoPE: base, linear scaling (rope.scaling.type "linear" with factor f -> freq_scale 1/f).
  RopeParams rope;
  rope.n_rot = hp.n_rot;
  rope.style = arch.rope_style;
  KILN_ASSIGN_OR_RETURN(rope.freq_base, r.opt<float>("rope.freq_base", 10000.0f));
  if (!(rope.freq_base > 0))
    return Status::errorf("metadata '{}' must be > 0", r.key("rope.freq_base"));
  KILN_ASSIGN_OR_RETURN(std::string scaling_type, r.opt<std::string>("rope.scaling.type", "none"));
  KILN_ASSIGN_OR_RETURN(float scaling_factor, r.opt<float>("rope.scaling.factor", 0.0f));
  if (scaling_type == "linear") {
    if (!(scaling_factor > 0))
      return Status::errorf("metadata '{}' must be > 0 for linear scaling",
                            r.key("rope.scaling.factor"));
    rope.freq_scale = 1.0f / scaling_factor;
  } else if (scaling_type != "none") {
    return Status::errorf("metadata '{}' = '{}' is not supported (none, linear)",
                          r.key("rope.scaling.type"), scaling_type);
  }
  KILN_ASSIGN_OR_RETURN(float freq_base_swa, r.opt<float>("rope.freq_base_swa", rope.freq_base));

  // Sliding-window layout.
  int32_t window = 0, pattern = 0;
  if (arch.swa != SwaRule::None) {
    KILN_ASSIGN_OR_RETURN(window, r.req<int32_t>("attention.sliding_window"));
    KILN_TRY(check_range(r.key("attention.sliding_window"), window, 1, 1 << 24));
    KILN_ASSIGN_OR_RETURN(
        pattern, r.opt<int32_t>("attention.sliding_window_pattern", arch.default_swa_pattern));
    KILN_TRY(check_range(r.key("attention.sliding_window_pattern"), pattern, 1, 4096));
  }
  if (arch.swa_key_disabled) {  // read, checked, deliberately not applied (ArchInfo says why)
    KILN_ASSIGN_OR_RETURN(int32_t ignored, r.opt<int32_t>("attention.sliding_window", 0));
    KILN_TRY(check_range(r.key("attention.sliding_window"), ignored, 0, 1 << 24));
  }

  // Feed-forward: dense, or experts when the architecture allows and expert_count > 0.
  KILN_ASSIGN_OR_RETURN(int32_t n_ff, r.opt<int32_t>("feed_forward_length", 0));
  KILN_ASSIGN_OR_RETURN(int32_t n_expert, r.opt<int32_t>("expert_count", 0));
  KILN_ASSIGN_OR_RETURN(int32_t n_expert_used, r.opt<int32_t>("expert_used_count", 0));
  KILN_ASSIGN_OR_RETURN(int32_t n_ff_exp, r.opt<int32_t>("expert_feed_forward_length", n_ff));
  if (n_expert != 0) {
    if (!arch.experts_allowed)
      return Status::errorf("metadata '{}' = {}: architecture '{}' has no expert layout",
                            r.key("expert_count"), n_expert, hp.arch_name);
    KILN_TRY(check_range(r.key("expert_count"), n_expert, 1, 4096));
    KILN_TRY(check_range(r.key("expert_used_count"), n_expert_used, 1, n_expert));
    KILN_TRY(check_range(r.key("expert_feed_forward_length"), n_ff_exp, 1, 1 << 22));
  } else {
    if (arch.experts_required)
      return Status::errorf("missing metadata key '{}': architecture '{}' is mixture-of-experts",
                            r.key("expert_count"), hp.arch_name);
    KILN_TRY(check_range(r.key("feed_forward_length"), n_ff, 1, 1 << 22));
  }

  hp.layers.resize(hp.n_layer);
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    LayerDesc& L = hp.layers[il];
    const bool sliding = arch.swa == SwaRule::Pattern && (il % pattern) < pattern - 1;
    L.kind = sliding ? AttnKind::Sliding : AttnKind::Full;
    L.window = sliding ? window : 0;
    L.use_rope = hp.n_rot > 0 && !(arch.full_layers_nope && !sliding);
    L.rope = rope;
    if (sliding) {
      L.rope.freq_base = freq_base_swa;
      if (arch.swa_rope_unscaled) L.rope.freq_scale = 1.0f;
    }
    if (n_expert > 0) {
      L.n_expert = n_expert;
      L.n_expert_used = n_expert_used;
      L.n_ff_expert = n_ff_exp;
    } else {
      L.n_ff = n_ff;
    }
  }

  // n_vocab is the embedding table's row count (vocab_size is optional and may disagree).
  const TensorInfo* embd = g.find_tensor("token_embd.weight");
  if (!embd) return Status::error("missing tensor 'token_embd.weight'");
  if (embd->n_dims != 2 || embd->ne[0] != hp.n_embd)
    return Status::errorf("tensor 'token_embd.weight': shape [{} x {}], expected [{} x n_vocab]",
                          embd->ne[0], embd->ne[1], hp.n_embd);
  if (embd->ne[1] < 1 || embd->ne[1] > (1 << 24))
    return Status::errorf("tensor 'token_embd.weight': n_vocab {} out of range", embd->ne[1]);
  hp.n_vocab = static_cast<int32_t>(embd->ne[1]);
  return hp;
}

}  // namespace kiln::model
