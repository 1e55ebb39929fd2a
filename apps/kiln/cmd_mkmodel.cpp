// apps/kiln/cmd_mkmodel.cpp: `kiln mkmodel`: writes a random-weight GGUF of any size and type
// in the llama, gemma3 (sliding window, QK-norm, sandwich norms, tied output), qwen3moe or gpt-oss
// (experts), phi3 (fused attn_qkv and gate|up ffn_up, optionally partial rotary) or deepseek2
// (latent attention; DeepSeek-V3 MoE with a shared expert and leading dense layers), glm-dsa
// (deepseek2's shape plus a lightning indexer on every layer) or glm4moe (GLM-4.5: q/k/v biases,
// QK-norm, partial rotary, the DeepSeek-V3 MoE, NextN blocks after the main ones) shapes, or
// llama with experts (Mixtral layout), or a DFlash block drafter (`dflash`: no embedding, output
// or vocabulary of its own; it fits a target of the same --n-embd and --n-vocab): benchmarks at
// 1B/8B scale without downloads. Random router
// weights route nearly uniformly over the experts. Tensors are produced and quantized at write
// time, one at a time, so a multi-GB file needs no more RAM than its largest tensor. The
// vocabulary is a minimal valid SentencePiece one (byte fallback plus ASCII pieces) so `kiln run`
// and `kiln bench` can tokenize prompts for it.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "apps/kiln/commands.h"
#include "core/half.h"
#include "core/splitmix.h"
#include "format/gguf.h"
#include "format/gguf_writer.h"
#include "quant/mix.h"
#include "quant/quant.h"

namespace kiln::app {
namespace {

struct MkModelOptions {
  std::string out;
  std::string arch = "llama";
  int32_t n_embd = 2048, n_layer = 16, n_ff = 8192, n_head = 32, n_head_kv = 8;
  int32_t head_dim = 0;  // 0: n_embd / n_head
  int32_t n_rot = 0;     // rope.dimension_count; 0: the whole head
  int32_t n_vocab = 32000, n_ctx = 4096;
  int32_t window = 512, swa_pattern = 6;                  // gemma3 only
  int32_t n_expert = 0, n_expert_used = 0, n_ff_exp = 0;  // 0 experts: dense FFN
  // Router rows scaled by (1 + e)^-skew: expert e's logits spread less the larger e is, so
  // top-k favours the low ids (a popularity decaying with the id). 0: plain. A plain random
  // router is far from uniform already (the hidden states share a large common component;
  // docs/BENCHMARKS.md, issue 9: the most used quarter of the experts takes ~95 % of the gets).
  float router_skew = 0;
  // deepseek2: latent attention (head_dim = nope + rope query dims per head, n_rot = rope
  // dims, default 64), a shared expert and leading dense layers on MoE models.
  int32_t q_lora = 0, kv_lora = 512, v_head = 0;  // v_head 0: the no-RoPE width
  int32_t n_shared = 1, n_dense_lead = 1;
  // glm4moe: NextN (MTP) blocks written after the --n-layer main ones, counted in block_count
  // as GLM-4.5's files count them (loaded, not run by the main pass).
  int32_t n_nextn = 1;
  // glm-dsa: the lightning indexer's heads, head width and keys kept per query (GLM-5's
  // 32 x 128, top 2048); every layer a full indexer layer.
  int32_t idx_heads = 32, idx_head_dim = 128, idx_top_k = 2048;
  // dflash: the block's tokens (anchor included) and the target layers whose inputs it reads.
  int32_t block_size = 16;
  std::vector<int32_t> target_layers;

  int32_t hd() const { return head_dim > 0 ? head_dim : n_embd / n_head; }
  bool moe() const { return n_expert > 0; }
  // GLM-4.5 rotates half of each head (partial_rotary_factor 0.5).
  int32_t rot() const { return n_rot > 0 ? n_rot : latent() ? 64 : glm4moe() ? hd() / 2 : hd(); }
  // deepseek2 and glm-dsa: latent attention, DeepSeek-V3 MoE; glm-dsa adds the indexer.
  bool latent() const { return arch == "deepseek2" || dsa(); }
  bool dsa() const { return arch == "glm-dsa"; }
  bool glm4moe() const { return arch == "glm4moe"; }
  bool dflash() const { return arch == "dflash"; }
  // The DeepSeek-V3 MoE: sigmoid router with a selection bias, shared experts, dense lead.
  bool moe_v3() const { return latent() || glm4moe(); }
  int32_t nextn() const { return glm4moe() ? n_nextn : 0; }
  int32_t v_dim() const { return v_head > 0 ? v_head : hd() - rot(); }
  bool dense_layer(int32_t l) const { return !moe() || (moe_v3() && l < n_dense_lead); }
  bool gemma3() const { return arch == "gemma3"; }
  bool phi3() const { return arch == "phi3"; }
  bool gpt_oss() const { return arch == "gpt-oss"; }
  bool swa() const { return gemma3() || gpt_oss(); }
  bool qk_norm() const { return arch == "gemma3" || arch == "qwen3moe" || glm4moe() || dflash(); }
  // The FFN's input norm is named post_attention_norm (gpt-oss, glm4moe).
  bool post_attention_ffn_norm() const { return gpt_oss() || glm4moe(); }
  int32_t ff_exp() const { return n_ff_exp > 0 ? n_ff_exp : n_ff; }
  std::string type = "f16";
  uint64_t seed = 1;
  int threads = 0;
};

uint64_t name_hash(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// A SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, "▁", printable ASCII,
// then "▁x", "xy", "▁xy", ... letter pieces until n_vocab. Every longer piece is the
// concatenation of two shorter ones, so SPM merges can reach it.
struct Vocab {
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;  // llama.cpp token types: 1 normal, 2 unknown, 3 control, 6 byte
};

Vocab make_vocab(int32_t n_vocab) {
  Vocab v;
  auto add = [&](std::string t, int32_t type) {
    if (int32_t(v.tokens.size()) >= n_vocab) return;
    v.scores.push_back(type == 1 ? -float(v.tokens.size()) : 0.0f);
    v.tokens.push_back(std::move(t));
    v.types.push_back(type);
  };
  add("<unk>", 2);
  add("<s>", 3);
  add("</s>", 3);
  for (int b = 0; b < 256; ++b) add(fmt::format("<0x{:02X}>", b), 6);
  const std::string sp = "\xE2\x96\x81";  // U+2581, SentencePiece's space
  add(sp, 1);
  for (char c = 0x21; c < 0x7F; ++c) add(std::string(1, c), 1);
  for (char c = 'a'; c <= 'z'; ++c) add(sp + c, 1);
  // Letter strings of growing length, bare and with the space prefix.
  std::vector<std::string> level;
  for (char c = 'a'; c <= 'z'; ++c) level.emplace_back(1, c);
  while (int32_t(v.tokens.size()) < n_vocab) {
    std::vector<std::string> next;
    for (const std::string& s : level)
      for (char c = 'a'; c <= 'z'; ++c) {
        if (int32_t(v.tokens.size()) >= n_vocab) break;
        next.push_back(s + c);
        add(s + c, 1);
        add(sp + s + c, 1);
      }
    level = std::move(next);
  }
  return v;
}

// One weight tensor's plan: ggml shape and how to fill it.
struct TensorPlan {
  std::string name;
  std::vector<int64_t> ne;
  float scale = 0;      // uniform in [-scale, scale]; 0 means constant 1 (norm weights)
  float row_decay = 0;  // row r further scaled by (1 + r)^-row_decay (--router-skew)
};

std::vector<TensorPlan> plan_tensors(const MkModelOptions& o) {
  const int64_t E = o.n_embd, hd = o.hd();
  const int64_t q = int64_t(o.n_head) * hd, kv = int64_t(o.n_head_kv) * hd;
  // Uniform with standard deviation sigma: scale = sigma * sqrt(3).
  const float w = 0.02f * std::sqrt(3.0f);
  std::vector<TensorPlan> t;
  if (o.dflash()) {  // fc over the concatenated target features, then its norm; no embedding
    t.push_back({"fc.weight", {E * int64_t(o.target_layers.size()), E}, w});
    t.push_back({"enc.output_norm.weight", {E}, 0});
  } else {
    t.push_back({"token_embd.weight", {E, o.n_vocab}, w});
  }
  for (int32_t l = 0; l < o.n_layer + o.nextn(); ++l) {
    const std::string b = fmt::format("blk.{}.", l);
    t.push_back({b + "attn_norm.weight", {E}, 0});
    if (o.latent()) {
      const int64_t H = o.n_head, C = o.kv_lora, R = o.rot(), V = o.v_dim();
      if (o.q_lora > 0) {
        t.push_back({b + "attn_q_a.weight", {E, o.q_lora}, w});
        t.push_back({b + "attn_q_a_norm.weight", {o.q_lora}, 0});
        t.push_back({b + "attn_q_b.weight", {o.q_lora, H * hd}, w});
      } else {
        t.push_back({b + "attn_q.weight", {E, H * hd}, w});
      }
      t.push_back({b + "attn_kv_a_mqa.weight", {E, C + R}, w});
      t.push_back({b + "attn_kv_a_norm.weight", {C}, 0});
      t.push_back({b + "attn_k_b.weight", {hd - R, C, H}, w});
      t.push_back({b + "attn_v_b.weight", {C, V, H}, w});
      t.push_back({b + "attn_output.weight", {H * V, E}, w});
      if (o.dsa()) {
        const int64_t IH = o.idx_heads, ID = o.idx_head_dim;
        t.push_back({b + "indexer.attn_q_b.weight", {o.q_lora, IH * ID}, w});
        t.push_back({b + "indexer.attn_k.weight", {E, ID}, w});
        t.push_back({b + "indexer.k_norm.weight", {ID}, 0});
        t.push_back({b + "indexer.k_norm.bias", {ID}, 0});
        t.push_back({b + "indexer.proj.weight", {E, IH}, w});
      }
    } else if (o.phi3()) {
      t.push_back({b + "attn_qkv.weight", {E, q + 2 * kv}, w});  // rows q | k | v
    } else {
      t.push_back({b + "attn_q.weight", {E, q}, w});
      t.push_back({b + "attn_k.weight", {E, kv}, w});
      t.push_back({b + "attn_v.weight", {E, kv}, w});
    }
    if (o.gpt_oss() || o.glm4moe()) {  // biases on q/k/v (gpt-oss: o too, and sinks)
      t.push_back({b + "attn_q.bias", {q}, w});
      t.push_back({b + "attn_k.bias", {kv}, w});
      t.push_back({b + "attn_v.bias", {kv}, w});
    }
    if (o.gpt_oss()) {  // one sink logit per head
      t.push_back({b + "attn_output.bias", {E}, w});
      t.push_back({b + "attn_sinks.weight", {o.n_head}, w});
    }
    if (o.qk_norm()) {  // gemma3, qwen3moe and glm4moe normalise q and k per head
      t.push_back({b + "attn_q_norm.weight", {hd}, 0});
      t.push_back({b + "attn_k_norm.weight", {hd}, 0});
    }
    if (!o.latent()) t.push_back({b + "attn_output.weight", {q, E}, w});
    if (o.gemma3() || o.post_attention_ffn_norm())
      t.push_back({b + "post_attention_norm.weight", {E}, 0});
    if (!o.post_attention_ffn_norm()) t.push_back({b + "ffn_norm.weight", {E}, 0});
    if (!o.dense_layer(l)) {
      const int64_t F = o.ff_exp(), X = o.n_expert;
      t.push_back({b + "ffn_gate_inp.weight", {E, X}, w, o.router_skew});
      if (o.moe_v3()) {  // selection bias, and the shared experts side by side
        t.push_back({b + "exp_probs_b.bias", {X}, w});
        t.push_back({b + "ffn_gate_shexp.weight", {E, F * o.n_shared}, w});
        t.push_back({b + "ffn_up_shexp.weight", {E, F * o.n_shared}, w});
        t.push_back({b + "ffn_down_shexp.weight", {F * o.n_shared, E}, w});
      }
      t.push_back({b + "ffn_gate_exps.weight", {E, F, X}, w});
      t.push_back({b + "ffn_up_exps.weight", {E, F, X}, w});
      t.push_back({b + "ffn_down_exps.weight", {F, E, X}, w});
      if (o.gpt_oss()) {
        t.push_back({b + "ffn_gate_inp.bias", {X}, w});
        t.push_back({b + "ffn_gate_exps.bias", {F, X}, w});
        t.push_back({b + "ffn_up_exps.bias", {F, X}, w});
        t.push_back({b + "ffn_down_exps.bias", {E, X}, w});
      }
    } else if (o.phi3()) {
      t.push_back({b + "ffn_up.weight", {E, 2 * int64_t(o.n_ff)}, w});  // rows gate | up
      t.push_back({b + "ffn_down.weight", {o.n_ff, E}, w});
    } else {
      t.push_back({b + "ffn_gate.weight", {E, o.n_ff}, w});
      t.push_back({b + "ffn_up.weight", {E, o.n_ff}, w});
      t.push_back({b + "ffn_down.weight", {o.n_ff, E}, w});
    }
    if (o.gemma3()) t.push_back({b + "post_ffw_norm.weight", {E}, 0});
    if (l >= o.n_layer) {  // a NextN block: its input projection, norms and own head
      t.push_back({b + "nextn.eh_proj.weight", {2 * E, E}, w});
      t.push_back({b + "nextn.enorm.weight", {E}, 0});
      t.push_back({b + "nextn.hnorm.weight", {E}, 0});
      t.push_back({b + "nextn.shared_head_norm.weight", {E}, 0});
      t.push_back({b + "nextn.embed_tokens.weight", {E, o.n_vocab}, w});
      t.push_back({b + "nextn.shared_head_head.weight", {E, o.n_vocab}, w});
    }
  }
  t.push_back({"output_norm.weight", {E}, 0});
  // gemma ties it; a DFlash drafter reads the target's
  if (!o.gemma3() && !o.dflash()) t.push_back({"output.weight", {E, o.n_vocab}, w});
  return t;
}

void set_metadata(GgufWriter& w, const MkModelOptions& o, const quant::Preset& preset,
                  const Vocab& v) {
  const std::string a = o.arch;
  w.set_str("general.architecture", a);
  w.set_str("general.name", fmt::format("kiln-mkmodel {}x{} {}", o.n_layer, o.n_embd, preset.name));
  w.set_u32("general.file_type", static_cast<uint32_t>(preset.ftype));
  w.set_u32(a + ".context_length", uint32_t(o.n_ctx));
  w.set_u32(a + ".embedding_length", uint32_t(o.n_embd));
  w.set_u32(a + ".block_count", uint32_t(o.n_layer + o.nextn()));
  if (o.glm4moe()) w.set_u32(a + ".nextn_predict_layers", uint32_t(o.nextn()));
  // Mixtral-layout llama reads its experts' width from feed_forward_length.
  w.set_u32(a + ".feed_forward_length", uint32_t(o.moe() && a == "llama" ? o.ff_exp() : o.n_ff));
  w.set_u32(a + ".attention.head_count", uint32_t(o.n_head));
  if (o.latent()) {  // the latent row is the one KV head: key/value_length are its widths
    w.set_u32(a + ".attention.head_count_kv", 1);
    w.set_u32(a + ".attention.key_length", uint32_t(o.kv_lora + o.rot()));
    w.set_u32(a + ".attention.value_length", uint32_t(o.kv_lora));
    w.set_u32(a + ".attention.key_length_mla", uint32_t(o.hd()));
    w.set_u32(a + ".attention.value_length_mla", uint32_t(o.v_dim()));
    if (o.q_lora > 0) w.set_u32(a + ".attention.q_lora_rank", uint32_t(o.q_lora));
    w.set_u32(a + ".attention.kv_lora_rank", uint32_t(o.kv_lora));
    if (o.dsa()) {
      w.set_u32(a + ".attention.indexer.head_count", uint32_t(o.idx_heads));
      w.set_u32(a + ".attention.indexer.key_length", uint32_t(o.idx_head_dim));
      w.set_u32(a + ".attention.indexer.top_k", uint32_t(o.idx_top_k));
    }
  } else {
    w.set_u32(a + ".attention.head_count_kv", uint32_t(o.n_head_kv));
    w.set_u32(a + ".attention.key_length", uint32_t(o.hd()));
    w.set_u32(a + ".attention.value_length", uint32_t(o.hd()));
  }
  w.set_u32(a + ".rope.dimension_count", uint32_t(o.rot()));
  // The families' own RoPE bases and epsilons (gemma3: 1e6 global, 1e4 on local layers).
  // GLM-4.5: base 1e6, epsilon 1e-5.
  const bool llama_like = a == "llama" || a == "phi3" || o.latent();
  w.set_f32(a + ".rope.freq_base", llama_like ? 10000.0f : 1000000.0f);
  w.set_f32(a + ".attention.layer_norm_rms_epsilon", llama_like || o.glm4moe() ? 1e-5f : 1e-6f);
  if (o.gemma3()) {
    w.set_f32(a + ".rope.freq_base_swa", 10000.0f);
    w.set_u32(a + ".attention.sliding_window", uint32_t(o.window));
    w.set_u32(a + ".attention.sliding_window_pattern", uint32_t(o.swa_pattern));
  }
  // gpt-oss: window on even layers (llama.cpp's fixed period 2); no rope scaling written.
  if (o.gpt_oss()) w.set_u32(a + ".attention.sliding_window", uint32_t(o.window));
  if (o.moe()) {
    w.set_u32(a + ".expert_count", uint32_t(o.n_expert));
    w.set_u32(a + ".expert_used_count", uint32_t(o.n_expert_used));
    if (a != "llama") w.set_u32(a + ".expert_feed_forward_length", uint32_t(o.ff_exp()));
  }
  if (o.dflash()) {  // the target's vocabulary and tokenizer; the mask token is <unk>
    w.set_u32(a + ".block_size", uint32_t(o.block_size));
    w.set_i32_array(a + ".target_layers", o.target_layers);
    w.set_u32(a + ".vocab_size", uint32_t(o.n_vocab));
    w.set_u32("tokenizer.ggml.mask_token_id", 0);
    return;
  }
  if (o.moe_v3() && o.moe()) {  // DeepSeek-V3's (and GLM-4.5's) routing: sigmoid, normalised,
                                // scaled 2.5
    w.set_u32(a + ".expert_shared_count", uint32_t(o.n_shared));
    w.set_u32(a + ".expert_gating_func", 2);
    w.set_bool(a + ".expert_weights_norm", true);
    w.set_f32(a + ".expert_weights_scale", 2.5f);
    w.set_u32(a + ".leading_dense_block_count", uint32_t(o.n_dense_lead));
  }
  w.set_u32(a + ".vocab_size", uint32_t(o.n_vocab));
  w.set_str("tokenizer.ggml.model", "llama");
  w.set_str_array("tokenizer.ggml.tokens", v.tokens);
  w.set_f32_array("tokenizer.ggml.scores", v.scores);
  w.set_i32_array("tokenizer.ggml.token_type", v.types);
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_u32("tokenizer.ggml.unknown_token_id", 0);
  w.set_bool("tokenizer.ggml.add_bos_token", true);
  w.set_bool("tokenizer.ggml.add_eos_token", false);
}

Status validate(const MkModelOptions& o) {
  if (o.out.empty()) return Status::error("-o OUT.gguf is required");
  if (o.arch != "llama" && o.arch != "gemma3" && o.arch != "qwen3moe" && o.arch != "phi3" &&
      o.arch != "gpt-oss" && o.arch != "deepseek2" && o.arch != "glm-dsa" && !o.glm4moe() &&
      !o.dflash())
    return Status::errorf(
        "--arch '{}' is not supported (llama, gemma3, qwen3moe, phi3, gpt-oss, deepseek2, "
        "glm-dsa, glm4moe, dflash)",
        o.arch);
  if (o.dflash()) {
    if (o.target_layers.empty() || o.target_layers.size() > 64)
      return Status::errorf("--arch dflash needs --target-layers (1 to 64 layers, {} given)",
                            o.target_layers.size());
    for (int32_t L : o.target_layers)
      if (L < 0) return Status::errorf("--target-layers: layer {} is negative", L);
    if (o.block_size < 2 || o.block_size > 256)
      return Status::errorf("--block-size {} outside [2, 256]", o.block_size);
    if (o.n_expert != 0) return Status::error("--n-expert: a dflash drafter has no experts");
  } else if (!o.target_layers.empty()) {
    return Status::error("--target-layers is for --arch dflash");
  }
  if (o.glm4moe()) {
    if (o.n_expert < 1) return Status::error("--arch glm4moe needs --n-expert (an MoE model)");
    if (o.n_nextn < 0 || o.n_nextn > 4)
      return Status::errorf("--n-nextn {} outside [0, 4]", o.n_nextn);
    if (o.n_shared < 0 || o.n_dense_lead < 0 || o.n_dense_lead > o.n_layer)
      return Status::errorf(
          "--n-shared {} must not be negative, --n-dense-lead {} in [0, "
          "--n-layer {}]",
          o.n_shared, o.n_dense_lead, o.n_layer);
  }
  if (o.dsa()) {
    if (o.q_lora < 1 || o.n_expert < 1)
      return Status::error("--arch glm-dsa needs --q-lora > 0 and --n-expert (an MoE model)");
    if (o.idx_heads < 1 || o.idx_top_k < 1 || o.idx_head_dim < o.rot())
      return Status::errorf(
          "--idx-heads {} and --idx-top-k {} must be > 0, --idx-head-dim {} at least --n-rot {}",
          o.idx_heads, o.idx_top_k, o.idx_head_dim, o.rot());
  }
  if (o.latent()) {
    if (o.kv_lora < 1 || o.q_lora < 0 || o.v_head < 0 || o.n_shared < 0 || o.n_dense_lead < 0)
      return Status::errorf(
          "--kv-lora {} must be > 0; --q-lora {}, --v-head-dim {}, --n-shared "
          "{}, --n-dense-lead {} must not be negative",
          o.kv_lora, o.q_lora, o.v_head, o.n_shared, o.n_dense_lead);
    if (o.rot() % 2 != 0 || o.rot() >= o.hd())
      return Status::errorf("--n-rot {} must be even and below --head-dim {} (nope + rope)",
                            o.rot(), o.hd());
    if (o.n_dense_lead > o.n_layer)
      return Status::errorf("--n-dense-lead {} exceeds --n-layer {}", o.n_dense_lead, o.n_layer);
  }
  auto positive = [](const char* what, int64_t v) {
    return v > 0 ? Status::ok() : Status::errorf("{} = {} must be > 0", what, v);
  };
  KILN_TRY(positive("--n-embd", o.n_embd));
  KILN_TRY(positive("--n-layer", o.n_layer));
  KILN_TRY(positive("--n-ff", o.n_ff));
  KILN_TRY(positive("--n-head", o.n_head));
  KILN_TRY(positive("--n-head-kv", o.n_head_kv));
  KILN_TRY(positive("--ctx", o.n_ctx));
  if (o.head_dim < 0) return Status::errorf("--head-dim = {} must be > 0", o.head_dim);
  if (!(o.router_skew >= 0 && o.router_skew <= 8))
    return Status::errorf("--router-skew {} outside [0, 8]", o.router_skew);
  if (o.head_dim == 0 && o.n_embd % o.n_head != 0)
    return Status::errorf("--n-embd {} is not a multiple of --n-head {} (or give --head-dim)",
                          o.n_embd, o.n_head);
  if (o.hd() % 2 != 0)
    return Status::errorf("head dimension {} must be even (RoPE rotates pairs)", o.hd());
  if (!o.latent() && o.n_head % o.n_head_kv != 0)  // deepseek2: one latent KV head
    return Status::errorf("--n-head {} is not a multiple of --n-head-kv {}", o.n_head, o.n_head_kv);
  if (!o.latent() && (o.n_rot < 0 || o.rot() % 2 != 0 || o.rot() > o.hd()))
    return Status::errorf("--n-rot {} must be even and in [0, head dimension {}]", o.rot(), o.hd());
  if (o.swa()) KILN_TRY(positive("--window", o.window));
  if (o.gemma3()) KILN_TRY(positive("--swa-pattern", o.swa_pattern));
  if ((o.arch == "gemma3" || o.arch == "phi3") && o.n_expert != 0)
    return Status::errorf("--n-expert: {} has no expert layout (llama or qwen3moe)", o.arch);
  if ((o.arch == "qwen3moe" || o.gpt_oss()) && o.n_expert == 0)
    return Status::errorf("--arch {} needs --n-expert and --n-expert-used", o.arch);
  if (o.n_expert < 0 || o.n_expert > 4096)
    return Status::errorf("--n-expert {} outside [0, 4096]", o.n_expert);
  if (o.moe() && (o.n_expert_used < 1 || o.n_expert_used > o.n_expert))
    return Status::errorf("--n-expert-used {} outside [1, --n-expert {}]", o.n_expert_used,
                          o.n_expert);
  if (!o.moe() && o.n_expert_used != 0) return Status::error("--n-expert-used needs --n-expert");
  if (o.n_ff_exp < 0) return Status::errorf("--n-ff-exp = {} must be > 0", o.n_ff_exp);
  if (o.n_vocab < 260 || o.n_vocab > (1 << 24))
    return Status::errorf(
        "--n-vocab {} outside [260, 16777216] (the vocabulary needs the 259 "
        "special and byte tokens plus pieces)",
        o.n_vocab);
  return Status::ok();
}

// Per-tensor types from the quant layer's llama.cpp mix rules. The rules look only at names
// and row lengths, so they run on a skeleton file whose matrices have a single row.
Expected<std::vector<DType>> plan_types(const MkModelOptions& o, const quant::Preset& preset,
                                        const std::vector<TensorPlan>& plan) {
  GgufWriter skel;
  set_metadata(skel, o, preset, Vocab{});
  for (const TensorPlan& t : plan) {
    std::vector<int64_t> ne = t.ne;
    if (ne.size() > 1) ne[1] = 1;
    skel.add_tensor_zeros(t.name, DType::F32, ne);
  }
  KILN_ASSIGN_OR_RETURN(GgufFile g,
                        GgufFile::parse(MappedFile::from_bytes(skel.write_to_memory())));
  KILN_ASSIGN_OR_RETURN(std::vector<DType> types, quant::plan_tensor_types(preset, g));
  for (size_t i = 0; i < plan.size(); ++i) {
    if (plan[i].ne.size() == 1) types[i] = DType::F32;  // norms stay f32, as llama.cpp keeps them
    if (!quant::can_quantize(types[i]))
      return Status::errorf("tensor '{}': kiln cannot write type {}", plan[i].name,
                            dtype_name(types[i]));
  }
  return types;
}

int run_mkmodel(const MkModelOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  if (Status s = validate(o); !s) {
    fmt::print(stderr, "kiln mkmodel: {}\n", s.message());
    return 1;
  }
  auto preset = quant::preset_from_name(o.type);
  if (!preset) {
    fmt::print(stderr, "kiln mkmodel: unknown --type '{}' (one of {})\n", o.type,
               quant::preset_names());
    return 1;
  }
  const std::vector<TensorPlan> plan = plan_tensors(o);
  auto types = plan_types(o, *preset, plan);
  if (!types) {
    fmt::print(stderr, "kiln mkmodel: {}\n", types.error());
    return 1;
  }
  const int n_threads =
      o.threads > 0 ? o.threads : std::max(1, int(std::thread::hardware_concurrency()));

  GgufWriter w;
  set_metadata(w, o, *preset, make_vocab(o.n_vocab));
  uint64_t n_params = 0, n_bytes = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    const TensorPlan& t = plan[i];
    const DType type = (*types)[i];
    int64_t n_rows = 1;  // rows flattened over ne[1..] (3-D expert tensors stack matrices)
    for (size_t d = 1; d < t.ne.size(); ++d) n_rows *= t.ne[d];
    const int64_t n_cols = t.ne[0];
    const auto rb = row_bytes(type, uint64_t(n_cols));
    if (!rb) {
      fmt::print(stderr,
                 "kiln mkmodel: tensor '{}': row length {} is not a multiple of {}'s "
                 "block size {}\n",
                 t.name, n_cols, dtype_name(type), traits(type).block_size);
      return 1;
    }
    n_params += uint64_t(n_cols * n_rows);
    n_bytes += *rb * uint64_t(n_rows);
    const uint64_t tensor_seed = o.seed ^ name_hash(t.name);
    const size_t row_size = *rb;
    w.add_tensor_produced(t.name, type, t.ne, [=](std::span<std::byte> out) -> Status {
      // Row r's values depend only on (seed, name, r): identical output for any thread count.
      auto fill = [&](int64_t r0, int64_t r1) {
        std::vector<float> row(static_cast<size_t>(n_cols));
        for (int64_t r = r0; r < r1; ++r) {
          uint64_t state = tensor_seed + uint64_t(r) * 0xD1B54A32D192ED03ull;
          const double decay =
              t.row_decay > 0 ? std::pow(1.0 + double(r), -double(t.row_decay)) : 1.0;
          for (float& x : row) {
            if (t.scale == 0) {
              x = 1.0f;
              continue;
            }
            const double u = double(splitmix64(state) >> 11) * 0x1.0p-53;  // [0, 1)
            x = t.row_decay > 0 ? float((2 * u - 1) * t.scale * decay)
                                : float((2 * u - 1) * t.scale);
          }
          quant::quantize_row(type, row, out.subspan(size_t(r) * row_size, row_size));
        }
      };
      const int nt = int(std::min<int64_t>(n_threads, n_rows));
      std::vector<std::thread> pool;
      for (int k = 1; k < nt; ++k) pool.emplace_back(fill, n_rows * k / nt, n_rows * (k + 1) / nt);
      fill(0, n_rows / nt);
      for (std::thread& th : pool) th.join();
      return Status::ok();
    });
  }
  if (Status s = w.write(o.out); !s) {
    fmt::print(stderr, "kiln mkmodel: {}\n", s.message());
    return 1;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print(stderr,
             "kiln mkmodel: wrote {} ({} {}, {:.3f} B parameters, {:.1f} MiB of weights) "
             "in {:.1f} s\n",
             o.out, o.arch, preset->name, double(n_params) * 1e-9, double(n_bytes) / (1 << 20),
             secs);
  return 0;
}

}  // namespace

void add_mkmodel_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("mkmodel", "write a random-weight model of a given shape");
  auto o = std::make_shared<MkModelOptions>();
  cmd->add_option("-o,--output", o->out, "output GGUF path")->required();
  cmd->add_option("--arch", o->arch,
                  "architecture: llama, gemma3, qwen3moe, phi3, gpt-oss, deepseek2, glm-dsa, "
                  "glm4moe, dflash");
  cmd->add_option("--idx-heads", o->idx_heads, "glm-dsa: lightning indexer heads");
  cmd->add_option("--idx-head-dim", o->idx_head_dim, "glm-dsa: indexer head width");
  cmd->add_option("--idx-top-k", o->idx_top_k, "glm-dsa: keys each query keeps");
  cmd->add_option("--block-size", o->block_size,
                  "dflash: tokens of a drafted block, the anchor included");
  cmd->add_option("--target-layers", o->target_layers,
                  "dflash: target layers whose inputs the drafter reads (e.g. 1,9,17)")
      ->delimiter(',');
  cmd->add_option("--q-lora", o->q_lora, "deepseek2: q-LoRA rank (0: a plain attn_q)");
  cmd->add_option("--kv-lora", o->kv_lora, "deepseek2: latent (KV LoRA) rank");
  cmd->add_option("--v-head-dim", o->v_head,
                  "deepseek2: value width per head (default --head-dim - --n-rot)");
  cmd->add_option("--n-shared", o->n_shared, "deepseek2, glm4moe: shared experts of an MoE layer");
  cmd->add_option("--n-dense-lead", o->n_dense_lead,
                  "deepseek2, glm4moe: leading dense layers (MoE)");
  cmd->add_option("--n-nextn", o->n_nextn,
                  "glm4moe: NextN (MTP) blocks after the --n-layer main ones (in block_count)");
  cmd->add_option("--n-embd", o->n_embd, "embedding width");
  cmd->add_option("--n-layer", o->n_layer, "layers (glm4moe: of the main pass)");
  cmd->add_option("--n-ff", o->n_ff, "feed-forward width");
  cmd->add_option("--n-head", o->n_head, "attention heads");
  cmd->add_option("--n-head-kv", o->n_head_kv, "KV heads");
  cmd->add_option("--head-dim", o->head_dim, "head dimension (default n_embd / n_head)");
  cmd->add_option("--n-rot", o->n_rot,
                  "rotary dimensions of each head (rope.dimension_count; default the whole head)");
  cmd->add_option("--window", o->window, "gemma3, gpt-oss: sliding window of the local layers");
  cmd->add_option("--swa-pattern", o->swa_pattern,
                  "gemma3: every N-th layer is global, the others slide");
  cmd->add_option("--n-expert", o->n_expert, "experts per layer (qwen3moe; llama: Mixtral layout)");
  cmd->add_option("--n-expert-used", o->n_expert_used, "experts each token is routed to");
  cmd->add_option("--n-ff-exp", o->n_ff_exp, "feed-forward width of one expert (default --n-ff)");
  cmd->add_option("--router-skew", o->router_skew,
                  "MoE: scale router row e by (1 + e)^-S, a popularity decaying with the expert "
                  "id (default 0: a plain random router)");
  cmd->add_option("--n-vocab", o->n_vocab, "vocabulary size (>= 260)");
  cmd->add_option("--ctx", o->n_ctx, "context_length metadata");
  cmd->add_option("--type", o->type, "weight type preset: f32 f16 bf16 q8_0 q4_0 q4_k_m ...");
  cmd->add_option("--seed", o->seed, "random seed");
  cmd->add_option("-t,--threads", o->threads, "threads for quantizing (default: all cores)");
  cmd->callback([o, &exit_code] { exit_code = run_mkmodel(*o); });
}

}  // namespace kiln::app
