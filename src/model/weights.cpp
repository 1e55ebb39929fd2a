// model/weights.cpp: binds and shape-checks the tensors named by the architecture table.
#include "model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_set>

#include "quant/quant.h"

namespace kiln::model {

WeightMatrix as_matrix(const TensorView& t) {
  WeightMatrix m;
  m.dtype = t.dtype();
  m.n_cols = t.row_length();
  m.n_rows = t.n_rows();
  m.row_bytes = static_cast<size_t>(t.row_bytes());
  m.bytes = t.bytes;
  return m;
}

Expected<std::span<const float>> tensor_floats(const std::string& name, const TensorView& v,
                                               int64_t n, std::vector<std::vector<float>>& owned) {
  if (v.dtype() == DType::F32) {
    // Tensor data is aligned to general.alignment (>= 8 by GGUF validation); floats need 4.
    if (reinterpret_cast<uintptr_t>(v.bytes.data()) % alignof(float) == 0)
      return std::span<const float>(reinterpret_cast<const float*>(v.bytes.data()), n);
  }
  std::vector<float>& buf = owned.emplace_back(static_cast<size_t>(n));
  if (v.dtype() == DType::F32) {
    std::memcpy(buf.data(), v.bytes.data(), buf.size() * sizeof(float));
  } else {
    if (row_bytes(v.dtype(), n) != v.bytes.size())
      return Status::errorf("tensor '{}': {} elements do not fill whole {} blocks", name, n,
                            dtype_name(v.dtype()));
    quant::dequantize_row(v.dtype(), v.bytes, buf);
  }
  return std::span<const float>(buf);
}

namespace {

std::string shape_str(const TensorInfo& t) {
  std::string s;
  for (int d = 0; d < t.n_dims; ++d) s += (d ? " x " : "") + std::to_string(t.ne[d]);
  return "[" + s + "]";
}
std::string shape_str(std::initializer_list<int64_t> ne) {
  std::string s;
  int d = 0;
  for (int64_t n : ne) s += (d++ ? " x " : "") + std::to_string(n);
  return "[" + s + "]";
}

class Binder {
 public:
  Binder(const GgufFile& g, Weights& w) : g_(g), w_(w) {}

  // A tensor of exactly shape `ne` (ggml order), or an error naming it.
  Expected<TensorView> get(const std::string& name, std::initializer_list<int64_t> ne) const {
    const TensorInfo* t = g_.find_tensor(name);
    if (!t) return Status::errorf("missing tensor '{}'", name);
    used_.insert(t);
    bool ok = t->n_dims == static_cast<int>(ne.size());
    int d = 0;
    for (int64_t n : ne) ok = ok && t->ne[d++] == n;
    if (!ok)
      return Status::errorf("tensor '{}': shape {}, expected {}", name, shape_str(*t),
                            shape_str(ne));
    if (!quant::can_dequantize(t->dtype))
      return Status::errorf("tensor '{}': dtype {} is not supported", name, dtype_name(t->dtype));
    return g_.view(*t);
  }

  Expected<WeightMatrix> matrix(const std::string& name, int64_t n_cols, int64_t n_rows) const {
    KILN_ASSIGN_OR_RETURN(TensorView v, get(name, {n_cols, n_rows}));
    return as_matrix(v);
  }
  // A stacked 3-D tensor [n_cols, n_rows, n_mat] as n_mat * n_rows rows.
  Expected<WeightMatrix> stacked(const std::string& name, int64_t n_cols, int64_t n_rows,
                                 int64_t n_mat) const {
    KILN_ASSIGN_OR_RETURN(TensorView v, get(name, {n_cols, n_rows, n_mat}));
    return as_matrix(v);
  }

  // A 1-D f32 vector: a view when stored as f32, else dequantized into an owned buffer.
  Expected<std::span<const float>> vec(const std::string& name, int64_t n) {
    KILN_ASSIGN_OR_RETURN(TensorView v, get(name, {n}));
    return floats(name, v, n);
  }
  // A 2-D [n, rows] tensor of small vectors (per-expert biases) as rows * n floats.
  Expected<std::span<const float>> vec2(const std::string& name, int64_t n, int64_t rows) {
    KILN_ASSIGN_OR_RETURN(TensorView v, get(name, {n, rows}));
    return floats(name, v, n * rows);
  }
  Expected<std::span<const float>> floats(const std::string& name, const TensorView& v, int64_t n) {
    return tensor_floats(name, v, n, w_.owned);
  }

  bool has(const std::string& name) const { return g_.find_tensor(name) != nullptr; }

  // Fail closed: a tensor no binding above consumed would be silently ignored by the forward
  // pass (a Llama 3 rope_freqs read by nothing answered wrongly), so it refuses the load.
  Status check_all_used(std::string_view arch_name) const {
    for (const TensorInfo& t : g_.tensors())
      if (!used_.contains(&t))
        return Status::errorf("tensor '{}' is not used by architecture '{}'", t.name, arch_name);
    return Status::ok();
  }

 private:
  const GgufFile& g_;
  Weights& w_;
  mutable std::unordered_set<const TensorInfo*> used_;  // every tensor get() handed out
};

// phi3's fused tensors, bound as row views of the one tensor (WeightMatrix::rows) rather than
// multiplied once and split as llama.cpp does: a view copies nothing, both passes then run the
// same graph as for separate tensors, and the fast pass already hands Q/K/V (and gate/up) to
// Backend::matmul_batch as one op with one activation encoding, so a single fused matmul would
// read the same weight bytes and only add a strided split of its output.
Status bind_fused_qkv(const Binder& b, const std::string& name, const HParams& hp,
                      LayerWeights& lw) {
  const int64_t q = hp.q_width(), k = hp.k_width(), v = hp.v_width();
  KILN_ASSIGN_OR_RETURN(WeightMatrix qkv, b.matrix(name, hp.n_embd, q + k + v));
  lw.wq = qkv.rows(0, q);
  lw.wk = qkv.rows(q, k);
  lw.wv = qkv.rows(q + k, v);
  return Status::ok();
}

Status bind_fused_gate_up(const Binder& b, const std::string& name, int64_t n_embd, int64_t n_ff,
                          LayerWeights& lw) {
  KILN_ASSIGN_OR_RETURN(WeightMatrix gate_up, b.matrix(name, n_embd, 2 * n_ff));
  lw.ffn_gate = gate_up.rows(0, n_ff);
  lw.ffn_up = gate_up.rows(n_ff, n_ff);
  return Status::ok();
}

// Latent attention's tensors (ArchInfo::mla). attn_kv_b -- the older single decompression
// tensor -- is refused by name: its key half is the transpose of attn_k_b, which no view can
// give, and current converters write attn_k_b / attn_v_b.
Status bind_mla(Binder& b, const HParams& hp, int32_t il, LayerWeights& lw) {
  const MlaDims& m = hp.mla;
  const int64_t E = hp.n_embd, H = hp.n_head;
  auto n = [il](const char* what) { return fmt::format("blk.{}.{}", il, what); };
  if (b.has(n("attn_kv_b.weight")))
    return Status::errorf(
        "tensor '{}': the combined latent decompression is not supported (needs "
        "attn_k_b and attn_v_b, as current converters write)",
        n("attn_kv_b.weight"));
  if (m.q_lora > 0) {
    KILN_ASSIGN_OR_RETURN(lw.wq_a, b.matrix(n("attn_q_a.weight"), E, m.q_lora));
    KILN_ASSIGN_OR_RETURN(lw.q_a_norm, b.vec(n("attn_q_a_norm.weight"), m.q_lora));
    KILN_ASSIGN_OR_RETURN(lw.wq_b, b.matrix(n("attn_q_b.weight"), m.q_lora, H * m.q_head()));
  } else {
    KILN_ASSIGN_OR_RETURN(lw.wq, b.matrix(n("attn_q.weight"), E, H * m.q_head()));
  }
  KILN_ASSIGN_OR_RETURN(lw.wkv_a, b.matrix(n("attn_kv_a_mqa.weight"), E, m.kv_lora + m.rope));
  KILN_ASSIGN_OR_RETURN(lw.kv_a_norm, b.vec(n("attn_kv_a_norm.weight"), m.kv_lora));
  KILN_ASSIGN_OR_RETURN(lw.wk_b, b.stacked(n("attn_k_b.weight"), m.nope, m.kv_lora, H));
  KILN_ASSIGN_OR_RETURN(lw.wv_b, b.stacked(n("attn_v_b.weight"), m.kv_lora, m.v, H));
  KILN_ASSIGN_OR_RETURN(lw.wo, b.matrix(n("attn_output.weight"), H * m.v, E));
  return Status::ok();
}

// The lightning indexer's tensors (ArchInfo::dsa). Required on full indexer layers; a shared
// layer (or a NextN block) may carry them too, as GLM-5 files do, and then they are bound and
// unused, as llama.cpp loads and leaves them.
Status bind_indexer(Binder& b, const HParams& hp, int32_t il, const LayerDesc& L,
                    LayerWeights& lw) {
  auto n = [il](const char* what) { return fmt::format("blk.{}.indexer.{}", il, what); };
  if (L.indexer != IndexerKind::Full && !b.has(n("attn_k.weight"))) return Status::ok();
  const DsaDims& d = hp.dsa;
  const int64_t E = hp.n_embd;
  KILN_ASSIGN_OR_RETURN(
      lw.idx_wq_b, b.matrix(n("attn_q_b.weight"), hp.mla.q_lora, int64_t(d.n_head) * d.head_dim));
  KILN_ASSIGN_OR_RETURN(lw.idx_wk, b.matrix(n("attn_k.weight"), E, d.head_dim));
  KILN_ASSIGN_OR_RETURN(lw.idx_k_norm, b.vec(n("k_norm.weight"), d.head_dim));
  KILN_ASSIGN_OR_RETURN(lw.idx_k_nb, b.vec(n("k_norm.bias"), d.head_dim));
  KILN_ASSIGN_OR_RETURN(lw.idx_proj, b.matrix(n("proj.weight"), E, d.n_head));
  return Status::ok();
}

}  // namespace

Expected<Weights> bind_weights(const GgufFile& g, const HParams& hp) {
  Weights w;
  Binder b(g, w);
  const ArchInfo& arch = *hp.arch;
  const int64_t E = hp.n_embd;
  KILN_ASSIGN_OR_RETURN(w.token_embd, b.matrix("token_embd.weight", E, hp.n_vocab));
  KILN_ASSIGN_OR_RETURN(w.output_norm, b.vec("output_norm.weight", E));
  if (b.has("output.weight")) {
    KILN_ASSIGN_OR_RETURN(w.output, b.matrix("output.weight", E, hp.n_vocab));
  } else {
    w.output = w.token_embd;  // tied embeddings (llama.cpp does the same when output is absent)
    w.tied_output = true;
  }
  // Per-pair rope frequency divisors: Llama 3's rope_freqs, or LongRoPE's two sets.
  const int64_t n_pairs = hp.n_rot / 2;
  if (arch.rope_freqs && b.has("rope_freqs.weight")) {
    KILN_ASSIGN_OR_RETURN(w.rope_freqs, b.vec("rope_freqs.weight", n_pairs));
  }
  if (arch.longrope && (b.has("rope_factors_long.weight") || b.has("rope_factors_short.weight"))) {
    KILN_ASSIGN_OR_RETURN(w.rope_long, b.vec("rope_factors_long.weight", n_pairs));
    KILN_ASSIGN_OR_RETURN(w.rope_short, b.vec("rope_factors_short.weight", n_pairs));
  }
  // The factors divide frequencies: zero, negative or non-finite ones are a broken file.
  const std::pair<const char*, std::span<const float>> factor_sets[] = {
      {"rope_freqs.weight", w.rope_freqs},
      {"rope_factors_long.weight", w.rope_long},
      {"rope_factors_short.weight", w.rope_short}};
  for (const auto& [name, f] : factor_sets)
    for (size_t i = 0; i < f.size(); ++i)
      if (!(f[i] > 0) || !std::isfinite(f[i]))
        return Status::errorf("tensor '{}': factor {} = {} is not a positive finite number", name,
                              i, f[i]);
  // One block's tensors (block il of the file), its experts into `se`.
  auto bind_layer = [&](int32_t il, const LayerDesc& L, LayerWeights& lw,
                        moe::StackedExperts& se) -> Status {
    auto n = [il](const char* what) { return fmt::format("blk.{}.{}", il, what); };
    KILN_ASSIGN_OR_RETURN(lw.attn_norm, b.vec(n("attn_norm.weight"), E));
    if (arch.mla) {
      KILN_TRY(bind_mla(b, hp, il, lw));
      if (arch.dsa) KILN_TRY(bind_indexer(b, hp, il, L, lw));
    } else if (arch.fused_qkv && b.has(n("attn_qkv.weight"))) {  // phi3 may also store them apart
      KILN_TRY(bind_fused_qkv(b, n("attn_qkv.weight"), hp, lw));
    } else {
      KILN_ASSIGN_OR_RETURN(lw.wq, b.matrix(n("attn_q.weight"), E, hp.q_width()));
      KILN_ASSIGN_OR_RETURN(lw.wk, b.matrix(n("attn_k.weight"), E, hp.k_width()));
      KILN_ASSIGN_OR_RETURN(lw.wv, b.matrix(n("attn_v.weight"), E, hp.v_width()));
    }
    if (!arch.mla) {
      KILN_ASSIGN_OR_RETURN(lw.wo, b.matrix(n("attn_output.weight"), hp.o_width(), E));
    }
    if (arch.qkv_bias) {
      KILN_ASSIGN_OR_RETURN(lw.bq, b.vec(n("attn_q.bias"), hp.q_width()));
      KILN_ASSIGN_OR_RETURN(lw.bk, b.vec(n("attn_k.bias"), hp.k_width()));
      KILN_ASSIGN_OR_RETURN(lw.bv, b.vec(n("attn_v.bias"), hp.v_width()));
    }
    if (arch.attn_out_bias) {
      KILN_ASSIGN_OR_RETURN(lw.bo, b.vec(n("attn_output.bias"), E));
    }
    if (arch.attn_sinks) {
      KILN_ASSIGN_OR_RETURN(lw.attn_sinks, b.vec(n("attn_sinks.weight"), hp.n_head));
    }
    if (arch.qk_norm || (arch.qk_norm_optional && b.has(n("attn_q_norm.weight")))) {
      KILN_ASSIGN_OR_RETURN(lw.q_norm, b.vec(n("attn_q_norm.weight"), hp.head_dim_k));
      KILN_ASSIGN_OR_RETURN(lw.k_norm, b.vec(n("attn_k_norm.weight"), hp.head_dim_k));
    }
    if (arch.attn_gate) {
      KILN_ASSIGN_OR_RETURN(lw.wgate_attn, b.matrix(n("attn_gate.weight"), E, hp.o_width()));
    }
    if (arch.post_norms) {
      KILN_ASSIGN_OR_RETURN(lw.post_attn_norm, b.vec(n("post_attention_norm.weight"), E));
      KILN_ASSIGN_OR_RETURN(lw.post_ffn_norm, b.vec(n("post_ffw_norm.weight"), E));
    }
    KILN_ASSIGN_OR_RETURN(
        lw.ffn_norm, b.vec(n(arch.ffn_norm_is_post_attention_norm ? "post_attention_norm.weight"
                                                                  : "ffn_norm.weight"),
                           E));
    if (L.n_expert > 0) {
      se.n_expert = L.n_expert;
      const int64_t F = L.n_ff_expert, X = L.n_expert;
      KILN_ASSIGN_OR_RETURN(lw.ffn_gate_inp, b.matrix(n("ffn_gate_inp.weight"), E, X));
      KILN_ASSIGN_OR_RETURN(se.gate, b.stacked(n("ffn_gate_exps.weight"), E, F, X));
      KILN_ASSIGN_OR_RETURN(se.up, b.stacked(n("ffn_up_exps.weight"), E, F, X));
      KILN_ASSIGN_OR_RETURN(se.down, b.stacked(n("ffn_down_exps.weight"), F, E, X));
      if (arch.moe_biases) {
        KILN_ASSIGN_OR_RETURN(lw.ffn_gate_inp_b, b.vec(n("ffn_gate_inp.bias"), X));
        KILN_ASSIGN_OR_RETURN(lw.ffn_gate_exps_b, b.vec2(n("ffn_gate_exps.bias"), F, X));
        KILN_ASSIGN_OR_RETURN(lw.ffn_up_exps_b, b.vec2(n("ffn_up_exps.bias"), F, X));
        KILN_ASSIGN_OR_RETURN(lw.ffn_down_exps_b, b.vec2(n("ffn_down_exps.bias"), E, X));
      }
      if (arch.moe_v3 && b.has(n("exp_probs_b.bias"))) {
        KILN_ASSIGN_OR_RETURN(lw.exp_probs_b, b.vec(n("exp_probs_b.bias"), X));
      }
      if (L.n_ff_shexp > 0) {
        const int64_t S = L.n_ff_shexp;
        KILN_ASSIGN_OR_RETURN(lw.ffn_gate_shexp, b.matrix(n("ffn_gate_shexp.weight"), E, S));
        KILN_ASSIGN_OR_RETURN(lw.ffn_up_shexp, b.matrix(n("ffn_up_shexp.weight"), E, S));
        KILN_ASSIGN_OR_RETURN(lw.ffn_down_shexp, b.matrix(n("ffn_down_shexp.weight"), S, E));
      }
      return Status::ok();
    }
    if (arch.fused_gate_up) {
      KILN_TRY(bind_fused_gate_up(b, n("ffn_up.weight"), E, L.n_ff, lw));
    } else {
      KILN_ASSIGN_OR_RETURN(lw.ffn_gate, b.matrix(n("ffn_gate.weight"), E, L.n_ff));
      KILN_ASSIGN_OR_RETURN(lw.ffn_up, b.matrix(n("ffn_up.weight"), E, L.n_ff));
    }
    KILN_ASSIGN_OR_RETURN(lw.ffn_down, b.matrix(n("ffn_down.weight"), L.n_ff, E));
    return Status::ok();
  };
  w.layers.resize(hp.n_layer);
  std::vector<moe::StackedExperts> experts(static_cast<size_t>(hp.n_layer));
  for (int32_t il = 0; il < hp.n_layer; ++il)
    KILN_TRY(bind_layer(il, hp.layers[il], w.layers[il], experts[il]));
  // NextN blocks: the file's blocks after the main pass's, each a whole layer plus its own
  // input projection and head norm (tensor names as llama.cpp's glm4moe loader reads them).
  std::vector<moe::StackedExperts> nextn_experts(hp.nextn_layers.size());
  w.nextn.resize(hp.nextn_layers.size());
  for (size_t i = 0; i < hp.nextn_layers.size(); ++i) {
    const int32_t il = hp.n_layer + static_cast<int32_t>(i);
    NextnWeights& nw = w.nextn[i];
    KILN_TRY(bind_layer(il, hp.nextn_layers[i], nw.layer, nextn_experts[i]));
    auto n = [il](const char* what) { return fmt::format("blk.{}.nextn.{}", il, what); };
    KILN_ASSIGN_OR_RETURN(nw.eh_proj, b.matrix(n("eh_proj.weight"), 2 * E, E));
    KILN_ASSIGN_OR_RETURN(nw.enorm, b.vec(n("enorm.weight"), E));
    KILN_ASSIGN_OR_RETURN(nw.hnorm, b.vec(n("hnorm.weight"), E));
    KILN_ASSIGN_OR_RETURN(nw.shared_head_norm, b.vec(n("shared_head_norm.weight"), E));
    if (b.has(n("embed_tokens.weight"))) {
      KILN_ASSIGN_OR_RETURN(nw.embed_tokens, b.matrix(n("embed_tokens.weight"), E, hp.n_vocab));
    }
    if (b.has(n("shared_head_head.weight"))) {
      KILN_ASSIGN_OR_RETURN(nw.shared_head_head,
                            b.matrix(n("shared_head_head.weight"), E, hp.n_vocab));
    }
  }
  KILN_TRY(b.check_all_used(hp.arch_name));
  auto any = [](const std::vector<moe::StackedExperts>& v) {
    return std::any_of(v.begin(), v.end(), [](const auto& s) { return s.n_expert > 0; });
  };
  if (any(experts)) w.experts = std::make_shared<moe::MappedExpertSource>(std::move(experts));
  if (any(nextn_experts))
    w.nextn_experts = std::make_shared<moe::MappedExpertSource>(std::move(nextn_experts));
  return w;
}

std::span<const float> rope_factors_for(const Weights& w, const HParams& hp, int32_t n_ctx) {
  if (!w.rope_freqs.empty()) return w.rope_freqs;
  if (w.rope_long.empty()) return {};
  // llama.cpp's get_rope_factors: the long set once the context passes the original one.
  const int32_t n_ctx_orig = hp.layers.empty() ? 0 : hp.layers[0].rope.n_ctx_orig;
  return n_ctx > n_ctx_orig ? w.rope_long : w.rope_short;
}

void attach_rope_factors(const Weights& w, HParams& hp) {
  const std::span<const float> f = rope_factors_for(w, hp, hp.n_ctx_train);
  for (LayerDesc& L : hp.layers) L.rope.freq_factors = f;
  for (LayerDesc& L : hp.nextn_layers) L.rope.freq_factors = f;
  for (LayerDesc& L : hp.nextn_layers) L.rope.freq_factors = f;
}

}  // namespace kiln::model
