// model/arch.cpp: the rows of the architecture table (flags as llama.cpp's model graphs use them).
#include "model/arch.h"

#include <array>

namespace kiln::model {
namespace {

constexpr std::array kArchs = {
    ArchInfo{.name = "llama",
             .rope_style = RopeStyle::Normal,
             .experts_allowed = true,
             .rope_freqs = true},
    ArchInfo{.name = "qwen2", .rope_style = RopeStyle::NeoX, .qkv_bias = true},
    ArchInfo{.name = "qwen3", .rope_style = RopeStyle::NeoX, .qk_norm = true},
    // MoE rows: softmax router, top-k, weights renormalised over the chosen k (llama.cpp's
    // norm_w for both qwen3moe and Mixtral-layout llama).
    ArchInfo{.name = "qwen3moe",
             .rope_style = RopeStyle::NeoX,
             .qk_norm = true,
             .experts_allowed = true,
             .experts_required = true},
    ArchInfo{.name = "gemma2",
             .rope_style = RopeStyle::NeoX,
             .post_norms = true,
             .embd_scale_sqrt = true,
             .act = FfnAct::GeluTanh,
             .swa = SwaRule::Pattern,
             .default_swa_pattern = 2},
    ArchInfo{.name = "gemma3",
             .rope_style = RopeStyle::NeoX,
             .qk_norm = true,
             .post_norms = true,
             .embd_scale_sqrt = true,
             .swa_rope_unscaled = true,
             .act = FfnAct::GeluTanh,
             .swa = SwaRule::Pattern,
             .default_swa_pattern = 6},
    // muse-glimmer RMS-normalises the token embeddings before layer 0 (no weight tensor):
    // without it position 0 alone is off by mean KL 1e-3 against llama.cpp, with it 3e-14.
    ArchInfo{.name = "muse-glimmer",
             .rope_style = RopeStyle::Normal,
             .qk_norm = true,
             .post_norms = true,
             .attn_gate = true,
             .embd_rmsnorm = true,
             .full_layers_nope = true,
             .post_norm_eps = 1e-8f,
             .swa = SwaRule::Pattern,
             .default_swa_pattern = 4},
    // phi3 (Phi-3 / Phi-3.5 mini): llama's block with fused Q/K/V and gate/up tensors.
    ArchInfo{.name = "phi3",
             .rope_style = RopeStyle::NeoX,
             .longrope = true,
             .fused_qkv = true,
             .fused_gate_up = true,
             .swa_key_disabled = true},
    // gpt-oss (llama.cpp's openai-moe graph): biases on q/k/v/o, attention sinks, sliding
    // window on even layers (swa period 2), post_attention_norm as the FFN norm, MoE with
    // router and expert biases and the clamped SwiGLU. Its gating (llama.cpp's
    // SOFTMAX_WEIGHT: top-k of the logits, then a softmax over those k) is the same function
    // as the other MoE rows' softmax, top-k and renormalisation over the chosen k.
    ArchInfo{.name = "gpt-oss",
             .rope_style = RopeStyle::NeoX,
             .qkv_bias = true,
             .experts_allowed = true,
             .experts_required = true,
             .attn_out_bias = true,
             .attn_sinks = true,
             .moe_biases = true,
             .ffn_norm_is_post_attention_norm = true,
             .act = FfnAct::SwigluOai,
             .swa = SwaRule::Pattern,
             .default_swa_pattern = 2},
    // glm4moe (GLM-4.5/4.6, llama.cpp's glm4-moe graph): q/k/v biases, per-head q/k norms
    // where present, NeoX rope on rope.dimension_count of each head, post_attention_norm as
    // the FFN norm, leading dense layers then MoE layers with the sigmoid router, selection
    // bias and a shared expert; the NextN blocks at the end are loaded, not run.
    ArchInfo{.name = "glm4moe",
             .rope_style = RopeStyle::NeoX,
             .qkv_bias = true,
             .experts_allowed = true,
             .experts_required = true,
             .ffn_norm_is_post_attention_norm = true,
             .moe_v3 = true,
             .default_gating = GatingFunc::Sigmoid,
             .qk_norm_optional = true,
             .nextn = true},
    // deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2): multi-head latent attention with a latent KV
    // cache; adjacent-pair RoPE on the k_pe / q_pe parts (llama.cpp's rope type NORM); the
    // DeepSeek-V3 MoE (absent expert_gating_func: softmax, as V2/V2.5 files mean it).
    ArchInfo{.name = "deepseek2",
             .rope_style = RopeStyle::Normal,
             .experts_allowed = true,
             .mla = true,
             .moe_v3 = true},
    // glm-dsa (GLM-5.x, llama.cpp's glm-dsa graph): deepseek2's latent attention and MoE
    // (sigmoid gating when expert_gating_func is absent) plus DeepSeek sparse attention; the
    // NextN blocks at the end are loaded, not run.
    ArchInfo{.name = "glm-dsa",
             .rope_style = RopeStyle::Normal,
             .experts_allowed = true,
             .experts_required = true,
             .mla = true,
             .dsa = true,
             .moe_v3 = true,
             .default_gating = GatingFunc::Sigmoid,
             .nextn = true},
    // DFlash block drafter (model/dflash.h: its own loader and passes): a qwen3-style decoder
    // (per-head q/k norms, NeoX rope) that borrows its target's embedding and output head.
    ArchInfo{
        .name = "dflash", .rope_style = RopeStyle::NeoX, .qk_norm = true, .drafter_only = true},
};

}  // namespace

const ArchInfo* find_arch(std::string_view name) {
  for (const ArchInfo& a : kArchs)
    if (a.name == name) return &a;
  return nullptr;
}

}  // namespace kiln::model
