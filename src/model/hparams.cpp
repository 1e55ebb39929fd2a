// model/hparams.cpp: GGUF metadata -> HParams, with every key checked for range so a bad file
// is an error naming the key, never a division by zero or a huge allocation later.
#include "model/hparams.h"

#include <cmath>
#include <optional>
#include <type_traits>
#include <variant>

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

// A metadata key that changes the math, and whether its value is one kiln computes.
struct MathKey {
  std::string_view suffix;  // after "{arch}."
  // The value kiln implements: the key is refused when present with any other value.
  enum class Accept { Absent, Zero, One, True, False } accept;
  std::string_view what;  // what the key would change, for the refusal
  // The ArchInfo flag of rows that read and implement the key (read_hparams); null: none.
  bool ArchInfo::*read_by = nullptr;
};

// Keys llama.cpp reads that change the forward pass, refused unless the row implements them
// (read_by; keys every row implements are read in read_hparams, with their own checks). A row
// that starts implementing one names its flag here, or the key is removed.
constexpr MathKey kUnimplementedMathKeys[] = {
    {"rope.scaling.yarn_log_multiplier", MathKey::Accept::Zero, "DeepSeek's YaRN mscale",
     &ArchInfo::mla},
    {"rope.scaling.yarn_ext_factor", MathKey::Accept::Absent, "a fixed YaRN ramp weight"},
    {"rope.scaling.yarn_attn_factor", MathKey::Accept::Absent, "a fixed YaRN magnitude"},
    {"rope.scaling.alpha", MathKey::Accept::Absent, "NTK-alpha rope scaling"},
    {"rope.dimension_sections", MathKey::Accept::Absent, "multi-section (M-)RoPE"},
    {"attention.scale", MathKey::Accept::Absent, "the attention logit scale"},
    {"attention.causal", MathKey::Accept::True, "non-causal attention"},
    {"attention.clamp_kqv", MathKey::Accept::Absent, "clamped Q/K/V"},
    {"attention.temperature_length", MathKey::Accept::Absent, "attention temperature tuning"},
    {"attention.temperature_scale", MathKey::Accept::Absent, "attention temperature tuning"},
    {"attention.key_length_mla", MathKey::Accept::Absent, "latent attention", &ArchInfo::mla},
    {"attention.value_length_mla", MathKey::Accept::Absent, "latent attention", &ArchInfo::mla},
    {"attention.q_lora_rank", MathKey::Accept::Absent, "latent attention", &ArchInfo::mla},
    {"attention.kv_lora_rank", MathKey::Accept::Absent, "latent attention", &ArchInfo::mla},
    {"attention.shared_kv_layers", MathKey::Accept::Absent, "KV sharing across layers"},
    {"embedding_scale", MathKey::Accept::Absent, "an embedding scale"},
    {"residual_scale", MathKey::Accept::Absent, "a residual scale"},
    {"use_parallel_residual", MathKey::Accept::False, "parallel residual blocks"},
    {"expert_gating_func", MathKey::Accept::One, "the expert gating function (1 = softmax)",
     &ArchInfo::moe_v3},
    {"expert_weights_scale", MathKey::Accept::One, "scaled expert weights", &ArchInfo::moe_v3},
    {"expert_weights_norm", MathKey::Accept::True, "unnormalised expert weights",
     &ArchInfo::moe_v3},
    {"expert_shared_count", MathKey::Accept::Zero, "shared experts", &ArchInfo::moe_v3},
    {"expert_group_count", MathKey::Accept::Absent, "grouped expert routing", &ArchInfo::moe_v3},
    {"expert_group_used_count", MathKey::Accept::Absent, "grouped expert routing",
     &ArchInfo::moe_v3},
    {"expert_shared_feed_forward_length", MathKey::Accept::Absent, "shared experts",
     &ArchInfo::moe_v3},
    {"leading_dense_block_count", MathKey::Accept::Zero, "leading dense layers", &ArchInfo::moe_v3},
    {"nextn_predict_layers", MathKey::Accept::Zero, "NextN (MTP) layers", &ArchInfo::nextn},
    {"router_logit_softcapping", MathKey::Accept::Absent, "a router softcap"},
    {"attention.indexer.head_count", MathKey::Accept::Absent, "DeepSeek sparse attention",
     &ArchInfo::dsa},
    {"attention.indexer.key_length", MathKey::Accept::Absent, "DeepSeek sparse attention",
     &ArchInfo::dsa},
    {"attention.indexer.top_k", MathKey::Accept::Absent, "DeepSeek sparse attention",
     &ArchInfo::dsa},
    {"attention.indexer.types", MathKey::Accept::Absent, "DeepSeek sparse attention",
     &ArchInfo::dsa},
};

// The value of a numeric or bool metadata entry as a double (strings and arrays: nullopt).
std::optional<double> scalar_value(const GgufValue& v) {
  std::optional<double> out;
  std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, bool>)
          out = x ? 1.0 : 0.0;
        else if constexpr (std::is_arithmetic_v<T>)
          out = static_cast<double>(x);
      },
      v.v);
  return out;
}

std::string value_str(const GgufValue& v) {
  if (const auto* b = std::get_if<bool>(&v.v)) return *b ? "true" : "false";
  if (v.is_float()) return fmt::format("{}", static_cast<float>(std::get<double>(v.v)));
  if (auto d = scalar_value(v)) return fmt::format("{}", *d);
  if (v.is_string()) return fmt::format("'{}'", v.str());
  return "(array)";
}

Status check_math_keys(const GgufFile& g, const std::string& arch_name, const ArchInfo& arch) {
  for (const MathKey& m : kUnimplementedMathKeys) {
    if (m.read_by != nullptr && arch.*m.read_by) continue;
    const std::string key = fmt::format("{}.{}", arch_name, m.suffix);
    const GgufValue* v = g.find(key);
    if (!v) continue;
    const std::optional<double> d = scalar_value(*v);
    bool ok = false;
    switch (m.accept) {
      case MathKey::Accept::Absent:
        ok = false;
        break;
      case MathKey::Accept::Zero:
        ok = d && *d == 0;
        break;
      case MathKey::Accept::One:
        ok = d && *d == 1;
        break;
      case MathKey::Accept::True:
        ok = d && *d == 1;
        break;
      case MathKey::Accept::False:
        ok = d && *d == 0;
        break;
    }
    if (!ok)
      return Status::errorf("metadata '{}' = {} ({}) is not supported", key, value_str(*v), m.what);
  }
  // Window keys on an architecture whose layers all attend fully would be ignored.
  if (arch.swa == SwaRule::None) {
    for (std::string_view suffix :
         {"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa"}) {
      // phi3's window key is read and deliberately not applied (ArchInfo::swa_key_disabled).
      if (arch.swa_key_disabled && suffix == "attention.sliding_window") continue;
      const std::string key = fmt::format("{}.{}", arch_name, suffix);
      if (const GgufValue* v = g.find(key))
        return Status::errorf("metadata '{}' = {}: architecture '{}' has no sliding-window layers",
                              key, value_str(*v), arch_name);
    }
  }
  return Status::ok();
}

// Latent attention's dimensions (HParams::mla), as llama.cpp reads them: the ranks, the
// per-head query/key width (key_length_mla = nope + rope) and value width (value_length_mla);
// key_length / value_length, where present, must be the latent row's widths (kv_lora + rope
// and kv_lora), head_count_kv 1.
Status read_mla_dims(const KeyReader& r, HParams& hp) {
  MlaDims& m = hp.mla;
  KILN_ASSIGN_OR_RETURN(m.kv_lora, r.req<int32_t>("attention.kv_lora_rank"));
  KILN_TRY(check_range(r.key("attention.kv_lora_rank"), m.kv_lora, 1, 65536));
  KILN_ASSIGN_OR_RETURN(m.q_lora, r.opt<int32_t>("attention.q_lora_rank", 0));
  KILN_TRY(check_range(r.key("attention.q_lora_rank"), m.q_lora, 0, 65536));
  KILN_ASSIGN_OR_RETURN(m.rope, r.req<int32_t>("rope.dimension_count"));
  KILN_TRY(check_range(r.key("rope.dimension_count"), m.rope, 2, 4096));
  if (m.rope % 2 != 0)
    return Status::errorf("metadata '{}' = {} is odd", r.key("rope.dimension_count"), m.rope);
  KILN_ASSIGN_OR_RETURN(int32_t key_mla, r.req<int32_t>("attention.key_length_mla"));
  KILN_TRY(check_range(r.key("attention.key_length_mla"), key_mla, m.rope + 1, 65536));
  m.nope = key_mla - m.rope;
  KILN_ASSIGN_OR_RETURN(m.v, r.req<int32_t>("attention.value_length_mla"));
  KILN_TRY(check_range(r.key("attention.value_length_mla"), m.v, 1, 65536));
  hp.n_head_kv = 1;
  hp.head_dim_k = m.kv_lora + m.rope;
  hp.head_dim_v = m.kv_lora;
  hp.n_rot = m.rope;
  for (auto [suffix, want] : {std::pair{"attention.key_length", hp.head_dim_k},
                              std::pair{"attention.value_length", hp.head_dim_v},
                              std::pair{"attention.head_count_kv", 1}}) {
    KILN_ASSIGN_OR_RETURN(int32_t v, r.opt<int32_t>(suffix, want));
    if (v != want)
      return Status::errorf(
          "metadata '{}' = {}: latent attention needs {} (kv_lora_rank {}, "
          "rope {})",
          r.key(suffix), v, want, m.kv_lora, m.rope);
  }
  return Status::ok();
}

// DeepSeek's YaRN (llama.cpp's deepseek2 graph): the attention scale carries mscale^2 with
// mscale = 1 + yarn_log_multiplier * ln(factor) over the per-head key width (nope + rope),
// and the RoPE's cos/sin keep magnitude 1 -- the attn_factor handed to the rope cancels the
// 1 + 0.1 ln(factor) that YaRN's rope applies. The stored multiplier is 0.1 * mscale_all_dim
// (the converter's form; llama.cpp 0.7.0 divides it by 0.1 and multiplies by 0.1 again).
Status apply_deepseek_yarn(const KeyReader& r, HParams& hp, RopeParams& rope) {
  KILN_ASSIGN_OR_RETURN(float log_mul, r.opt<float>("rope.scaling.yarn_log_multiplier", 0.0f));
  if (!(log_mul >= 0) || !std::isfinite(log_mul))
    return Status::errorf("metadata '{}' = {} out of range",
                          r.key("rope.scaling.yarn_log_multiplier"), log_mul);
  // Other magnitudes are computed differently by llama.cpp versions: refused, not guessed.
  if (rope.attn_factor != 1.0f)
    return Status::errorf("metadata '{}' = {} with latent attention is not supported",
                          r.key("rope.scaling.attn_factor"), rope.attn_factor);
  if (rope.freq_scale != 1.0f && rope.ext_factor == 0)
    return Status::errorf(
        "metadata '{}': rope scaling other than yarn with latent attention is "
        "not supported",
        r.key("rope.scaling.type"));
  const float ln_factor = std::log(1.0f / rope.freq_scale);
  const float mscale = 1.0f + log_mul * ln_factor;
  hp.attn_scale = mscale * mscale / std::sqrt(float(hp.mla.q_head()));
  if (rope.ext_factor != 0) rope.attn_factor = 1.0f / (1.0f + 0.1f * ln_factor);
  return Status::ok();
}

// The keys of ArchInfo::moe_v3 (an MoE model's routing, shared experts and leading dense
// layers), each range-checked so the selection's preconditions (routing.h) hold.
Status read_moe_v3(const KeyReader& r, const ArchInfo& arch, int32_t n_expert,
                   int32_t n_expert_used, int32_t n_ff_exp, int32_t n_layer, int32_t n_ff,
                   RouterParams& rp, int32_t& n_dense_lead, int32_t& n_ff_shexp) {
  KILN_ASSIGN_OR_RETURN(
      uint32_t gating,
      r.opt<uint32_t>("expert_gating_func", arch.default_gating == GatingFunc::Sigmoid ? 2u : 1u));
  if (gating == 1) {
    rp.gating = GatingFunc::Softmax;
  } else if (gating == 2) {
    rp.gating = GatingFunc::Sigmoid;
  } else {
    return Status::errorf("metadata '{}' = {} is not supported (1 softmax, 2 sigmoid)",
                          r.key("expert_gating_func"), gating);
  }
  KILN_ASSIGN_OR_RETURN(rp.n_group, r.opt<int32_t>("expert_group_count", 1));
  KILN_TRY(check_range(r.key("expert_group_count"), rp.n_group, 1, n_expert));
  KILN_ASSIGN_OR_RETURN(rp.n_group_used, r.opt<int32_t>("expert_group_used_count", rp.n_group));
  KILN_TRY(check_range(r.key("expert_group_used_count"), rp.n_group_used, 1, rp.n_group));
  if (rp.n_group > 1) {
    // llama.cpp splits the experts into equal groups and scores each by its best two.
    if (n_expert % rp.n_group != 0 || n_expert / rp.n_group < 2)
      return Status::errorf("metadata '{}' = {}: {} experts do not form groups of two or more",
                            r.key("expert_group_count"), rp.n_group, n_expert);
    if (n_expert_used > rp.n_group_used * (n_expert / rp.n_group))
      return Status::errorf("metadata '{}' = {}: more experts than the {} used groups of {} hold",
                            r.key("expert_used_count"), n_expert_used, rp.n_group_used,
                            n_expert / rp.n_group);
  }
  KILN_ASSIGN_OR_RETURN(rp.norm_weights, r.opt<bool>("expert_weights_norm", false));
  KILN_ASSIGN_OR_RETURN(rp.weights_scale, r.req<float>("expert_weights_scale"));
  if (!(rp.weights_scale > 0) || !std::isfinite(rp.weights_scale))
    return Status::errorf("metadata '{}' = {} out of range", r.key("expert_weights_scale"),
                          rp.weights_scale);
  KILN_ASSIGN_OR_RETURN(int32_t n_shared, r.opt<int32_t>("expert_shared_count", 0));
  KILN_TRY(check_range(r.key("expert_shared_count"), n_shared, 0, 64));
  KILN_ASSIGN_OR_RETURN(int32_t shexp_ff,
                        r.opt<int32_t>("expert_shared_feed_forward_length", n_ff_exp));
  KILN_TRY(check_range(r.key("expert_shared_feed_forward_length"), shexp_ff, 1, 1 << 22));
  n_ff_shexp = n_shared * shexp_ff;
  KILN_TRY(check_range(r.key("expert_feed_forward_length"), n_ff_shexp, 0, 1 << 22));
  KILN_ASSIGN_OR_RETURN(n_dense_lead, r.opt<int32_t>("leading_dense_block_count", 0));
  KILN_TRY(check_range(r.key("leading_dense_block_count"), n_dense_lead, 0, n_layer));
  if (n_dense_lead > 0) KILN_TRY(check_range(r.key("feed_forward_length"), n_ff, 1, 1 << 22));
  return Status::ok();
}

// DeepSeek sparse attention (ArchInfo::dsa): the indexer's shape and which main-pass layers
// select (attention.indexer.types, one bool per layer: true = full, false = shared). Without
// the types key llama.cpp makes every layer full for files trained on less than 2^20
// positions (GLM-5 / 5.1) and applies GLM-5.2's built-in layout otherwise; that layout is
// refused here rather than copied.
Status read_dsa(const GgufFile& g, const KeyReader& r, HParams& hp) {
  DsaDims& d = hp.dsa;
  if (!hp.is_mla() || hp.mla.q_lora <= 0)
    return Status::errorf("architecture '{}' needs latent attention with a q-LoRA ('{}' > 0)",
                          hp.arch_name, r.key("attention.q_lora_rank"));
  KILN_ASSIGN_OR_RETURN(d.n_head, r.req<int32_t>("attention.indexer.head_count"));
  KILN_TRY(check_range(r.key("attention.indexer.head_count"), d.n_head, 1, 4096));
  KILN_ASSIGN_OR_RETURN(d.head_dim, r.req<int32_t>("attention.indexer.key_length"));
  KILN_TRY(check_range(r.key("attention.indexer.key_length"), d.head_dim, hp.mla.rope, 65536));
  KILN_ASSIGN_OR_RETURN(d.top_k, r.req<int32_t>("attention.indexer.top_k"));
  KILN_TRY(check_range(r.key("attention.indexer.top_k"), d.top_k, 1, 1 << 24));
  const std::string types_key = r.key("attention.indexer.types");
  std::vector<bool> full(static_cast<size_t>(hp.n_layer), true);
  if (const GgufValue* v = g.find(types_key)) {
    if (!v->is_array() || v->arr().items.size() != full.size())
      return Status::errorf("metadata '{}': expected an array of {} bools (one per layer)",
                            types_key, full.size());
    for (size_t i = 0; i < full.size(); ++i) {
      const std::optional<double> b = scalar_value(v->arr().items[i]);
      if (!b || (*b != 0 && *b != 1))
        return Status::errorf("metadata '{}'[{}]: expected a bool", types_key, i);
      full[i] = *b == 1;
    }
  } else if (hp.n_ctx_train >= (1 << 20)) {
    return Status::errorf(
        "missing metadata key '{}' with '{}' >= 1048576 (GLM-5.2's built-in indexer layout) is "
        "not supported",
        types_key, r.key("context_length"));
  }
  if (!full.empty() && !full[0])
    return Status::errorf(
        "metadata '{}': layer 0 is shared, but a shared layer reuses an "
        "earlier full layer's choice",
        types_key);
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    LayerDesc& L = hp.layers[static_cast<size_t>(il)];
    if (L.window > 0)
      return Status::errorf("layer {}: sparse attention on a sliding-window layer", il);
    L.indexer = full[static_cast<size_t>(il)] ? IndexerKind::Full : IndexerKind::Shared;
    if (L.indexer == IndexerKind::Full) L.indexer_kv = hp.n_layer + hp.n_indexer_kv++;
  }
  return Status::ok();
}

}  // namespace

Status read_rope_scaling(const GgufFile& g, std::string_view arch_name, int32_t n_ctx_train,
                         RopeParams& rope) {
  KeyReader r(g, std::string(arch_name));
  // llama.cpp: the factor is rope.scaling.factor, else the older rope.scale_linear; the type
  // defaults to linear, so a factor without a type scales linearly.
  float factor = 0;
  if (g.has(r.key("rope.scaling.factor"))) {
    KILN_ASSIGN_OR_RETURN(factor, r.req<float>("rope.scaling.factor"));
  } else {
    KILN_ASSIGN_OR_RETURN(factor, r.opt<float>("rope.scale_linear", 0.0f));
  }
  if (!(factor >= 0) || !std::isfinite(factor))
    return Status::errorf("metadata '{}' = {} out of range", r.key("rope.scaling.factor"), factor);
  KILN_ASSIGN_OR_RETURN(std::string type, r.opt<std::string>("rope.scaling.type", "linear"));
  rope.freq_scale = factor == 0 ? 1.0f : 1.0f / factor;
  rope.ext_factor = 0;
  if (type == "none") {
    rope.freq_scale = 1.0f;  // llama.cpp never scales when the type says none
  } else if (type == "yarn") {
    rope.ext_factor = 1.0f;  // llama.cpp's default yarn_ext_factor for a YaRN model
  } else if (type != "linear" && type != "longrope") {
    return Status::errorf("metadata '{}' = '{}' is not supported (none, linear, yarn, longrope)",
                          r.key("rope.scaling.type"), type);
  }
  KILN_ASSIGN_OR_RETURN(rope.n_ctx_orig, r.opt<int32_t>("rope.scaling.original_context_length", 0));
  if (rope.n_ctx_orig == 0) rope.n_ctx_orig = n_ctx_train;
  KILN_TRY(check_range(r.key("rope.scaling.original_context_length"), rope.n_ctx_orig, 1, 1 << 30));
  KILN_ASSIGN_OR_RETURN(rope.attn_factor, r.opt<float>("rope.scaling.attn_factor", 1.0f));
  KILN_ASSIGN_OR_RETURN(rope.beta_fast, r.opt<float>("rope.scaling.yarn_beta_fast", 32.0f));
  KILN_ASSIGN_OR_RETURN(rope.beta_slow, r.opt<float>("rope.scaling.yarn_beta_slow", 1.0f));
  if (!(rope.attn_factor > 0) || !std::isfinite(rope.attn_factor))
    return Status::errorf("metadata '{}' = {} out of range", r.key("rope.scaling.attn_factor"),
                          rope.attn_factor);
  if (!(rope.beta_fast > 0 && rope.beta_slow > 0 && std::isfinite(rope.beta_fast) &&
        std::isfinite(rope.beta_slow)))
    return Status::errorf("metadata '{}' / '{}' = {} / {} out of range",
                          r.key("rope.scaling.yarn_beta_fast"),
                          r.key("rope.scaling.yarn_beta_slow"), rope.beta_fast, rope.beta_slow);
  return Status::ok();
}

Expected<HParams> read_hparams(const GgufFile& g) {
  HParams hp;
  KILN_ASSIGN_OR_RETURN(hp.arch_name, g.get<std::string>("general.architecture"));
  hp.arch = find_arch(hp.arch_name);
  if (!hp.arch) return Status::errorf("unknown architecture '{}'", hp.arch_name);
  if (hp.arch->drafter_only)
    return Status::errorf(
        "architecture '{}' is a drafter: it runs beside a target model (kiln run --dflash), "
        "not on its own",
        hp.arch_name);
  if (!hp.arch->supported)
    return Status::errorf("architecture '{}' is recognised but not supported yet", hp.arch_name);
  const ArchInfo& arch = *hp.arch;
  KeyReader r(g, hp.arch_name);
  KILN_TRY(check_math_keys(g, hp.arch_name, arch));

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
  if (arch.mla) {
    KILN_TRY(read_mla_dims(r, hp));
  } else {
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
  }

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
  if (hp.is_mla() && hp.attn_softcap > 0)  // neither latent-attention pass applies one
    return Status::errorf("metadata '{}' = {} with latent attention is not supported",
                          r.key("attn_logit_softcapping"), hp.attn_softcap);
  hp.attn_scale = 1.0f / std::sqrt(float(hp.head_dim_k));
  hp.embd_scale = arch.embd_scale_sqrt ? std::sqrt(float(hp.n_embd)) : 1.0f;

  // RoPE: base, then the scaling keys (read_rope_scaling).
  RopeParams rope;
  rope.n_rot = hp.n_rot;
  rope.style = arch.rope_style;
  KILN_ASSIGN_OR_RETURN(rope.freq_base, r.opt<float>("rope.freq_base", 10000.0f));
  if (!(rope.freq_base > 0))
    return Status::errorf("metadata '{}' must be > 0", r.key("rope.freq_base"));
  KILN_TRY(read_rope_scaling(g, hp.arch_name, hp.n_ctx_train, rope));
  if (arch.mla) KILN_TRY(apply_deepseek_yarn(r, hp, rope));
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

  // DeepSeek-V3-style MoE keys (ArchInfo::moe_v3; llama.cpp's defaults where a key is absent).
  int32_t n_dense_lead = 0, n_ff_shexp = 0;
  if (arch.moe_v3 && n_expert != 0)
    KILN_TRY(read_moe_v3(r, arch, n_expert, n_expert_used, n_ff_exp, hp.n_layer, n_ff, hp.router,
                         n_dense_lead, n_ff_shexp));

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
    if (n_expert > 0 && il >= n_dense_lead) {
      L.n_expert = n_expert;
      L.n_expert_used = n_expert_used;
      L.n_ff_expert = n_ff_exp;
      L.n_ff_shexp = n_ff_shexp;
    } else {
      L.n_ff = n_ff;
    }
  }

  // The last nextn_predict_layers blocks are NextN blocks: out of the main pass.
  if (arch.nextn) {
    KILN_ASSIGN_OR_RETURN(int32_t n_nextn, r.opt<int32_t>("nextn_predict_layers", 0));
    KILN_TRY(check_range(r.key("nextn_predict_layers"), n_nextn, 0, hp.n_layer - 1));
    hp.n_layer -= n_nextn;
    hp.nextn_layers.assign(hp.layers.begin() + hp.n_layer, hp.layers.end());
    hp.layers.resize(static_cast<size_t>(hp.n_layer));
  }
  if (arch.dsa) KILN_TRY(read_dsa(g, r, hp));

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
