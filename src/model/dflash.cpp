// model/dflash.cpp: the DFlash drafter: loading (keys, tensors, fail closed) and its two
// passes (see dflash.h), each a sequence of Backend ops.
#include "model/dflash.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_set>

#include "core/check.h"
#include "quant/quant.h"

namespace kiln::model {
namespace {

// Every `dflash.` key kiln reads. Any other one (sliding windows, DFlash2 convolutions and
// selector, DSpark heads, causal blocks, hyper-connections, rope sections, ...) would change
// the drafts, so its presence refuses the file. rope.scaling.* are read by read_rope_scaling.
constexpr std::string_view kKnownKeys[] = {
    "context_length",       "embedding_length",
    "block_count",          "feed_forward_length",
    "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length",
    "rope.dimension_count", "attention.layer_norm_rms_epsilon",
    "rope.freq_base",       "vocab_size",
    "block_size",           "target_layers",
};

Status check_keys(const GgufFile& g) {
  for (const GgufKV& kv : g.metadata()) {
    std::string_view k = kv.key;
    if (!k.starts_with("dflash.")) continue;
    k.remove_prefix(7);
    if (k.starts_with("rope.scaling.")) continue;
    if (std::find(std::begin(kKnownKeys), std::end(kKnownKeys), k) == std::end(kKnownKeys))
      return Status::errorf("metadata '{}' is not supported by kiln's DFlash drafter", kv.key);
  }
  return Status::ok();
}

Status check_range(const std::string& key, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    return Status::errorf("metadata '{}' = {} out of range [{}, {}]", key, v, lo, hi);
  return Status::ok();
}

Expected<HParams> read_dflash_hparams(const GgufFile& g, DflashParams& dp) {
  HParams hp;
  KILN_ASSIGN_OR_RETURN(hp.arch_name, g.get<std::string>("general.architecture"));
  if (hp.arch_name != "dflash")
    return Status::errorf("architecture '{}' is not a DFlash drafter (expected 'dflash')",
                          hp.arch_name);
  hp.arch = find_arch("dflash");
  KILN_CHECK(hp.arch != nullptr, "the arch table has a dflash row");
  KILN_TRY(check_keys(g));
  auto req = [&](std::string_view suffix) -> Expected<int32_t> {
    const std::string key = fmt::format("dflash.{}", suffix);
    if (!g.has(key)) return Status::errorf("missing metadata key '{}'", key);
    return g.get<int32_t>(key);
  };
  constexpr int64_t kMaxDim = 1 << 20;
  KILN_ASSIGN_OR_RETURN(hp.n_embd, req("embedding_length"));
  KILN_TRY(check_range("dflash.embedding_length", hp.n_embd, 1, kMaxDim));
  KILN_ASSIGN_OR_RETURN(hp.n_layer, req("block_count"));
  KILN_TRY(check_range("dflash.block_count", hp.n_layer, 1, 4096));
  KILN_ASSIGN_OR_RETURN(hp.n_ctx_train, g.get_or<int32_t>("dflash.context_length", 2048));
  KILN_TRY(check_range("dflash.context_length", hp.n_ctx_train, 1, 1 << 24));
  KILN_ASSIGN_OR_RETURN(hp.n_head, req("attention.head_count"));
  KILN_TRY(check_range("dflash.attention.head_count", hp.n_head, 1, 4096));
  KILN_ASSIGN_OR_RETURN(hp.n_head_kv,
                        g.get_or<int32_t>("dflash.attention.head_count_kv", hp.n_head));
  KILN_TRY(check_range("dflash.attention.head_count_kv", hp.n_head_kv, 1, hp.n_head));
  if (hp.n_head % hp.n_head_kv != 0)
    return Status::errorf("'dflash.attention.head_count_kv' = {} does not divide head_count {}",
                          hp.n_head_kv, hp.n_head);
  KILN_ASSIGN_OR_RETURN(hp.head_dim_k,
                        g.get_or<int32_t>("dflash.attention.key_length", hp.n_embd / hp.n_head));
  KILN_TRY(check_range("dflash.attention.key_length", hp.head_dim_k, 2, 65536));
  KILN_ASSIGN_OR_RETURN(hp.head_dim_v,
                        g.get_or<int32_t>("dflash.attention.value_length", hp.head_dim_k));
  if (hp.head_dim_v != hp.head_dim_k)
    return Status::errorf("'dflash.attention.value_length' = {} differs from key_length {}",
                          hp.head_dim_v, hp.head_dim_k);
  KILN_ASSIGN_OR_RETURN(hp.n_rot, g.get_or<int32_t>("dflash.rope.dimension_count", hp.head_dim_k));
  KILN_TRY(check_range("dflash.rope.dimension_count", hp.n_rot, 2, hp.head_dim_k));
  if (hp.n_rot % 2 != 0)
    return Status::errorf("metadata 'dflash.rope.dimension_count' = {} is odd", hp.n_rot);
  KILN_ASSIGN_OR_RETURN(hp.rms_eps,
                        g.get_or<float>("dflash.attention.layer_norm_rms_epsilon", 1e-6f));
  if (!(hp.rms_eps >= 0 && hp.rms_eps < 1))
    return Status::errorf("metadata 'dflash.attention.layer_norm_rms_epsilon' = {} out of range",
                          hp.rms_eps);
  hp.post_norm_eps = hp.rms_eps;
  hp.attn_scale = 1.0f / std::sqrt(float(hp.head_dim_k));
  KILN_ASSIGN_OR_RETURN(int32_t n_ff, req("feed_forward_length"));
  KILN_TRY(check_range("dflash.feed_forward_length", n_ff, 1, 1 << 22));

  RopeParams rope;
  rope.n_rot = hp.n_rot;
  rope.style = hp.arch->rope_style;
  KILN_ASSIGN_OR_RETURN(rope.freq_base, g.get_or<float>("dflash.rope.freq_base", 10000.0f));
  if (!(rope.freq_base > 0)) return Status::error("metadata 'dflash.rope.freq_base' must be > 0");
  KILN_TRY(read_rope_scaling(g, "dflash", hp.n_ctx_train, rope));
  hp.layers.resize(static_cast<size_t>(hp.n_layer));
  for (LayerDesc& L : hp.layers) {
    L.rope = rope;
    L.n_ff = n_ff;
  }

  KILN_ASSIGN_OR_RETURN(dp.block_size, req("block_size"));
  KILN_TRY(check_range("dflash.block_size", dp.block_size, 2, 256));
  if (!g.has("dflash.target_layers"))
    return Status::error("missing metadata key 'dflash.target_layers'");
  KILN_ASSIGN_OR_RETURN(dp.target_layers, g.get_array<int32_t>("dflash.target_layers"));
  if (dp.target_layers.empty() || dp.target_layers.size() > 64)
    return Status::errorf("metadata 'dflash.target_layers' holds {} layers, expected 1..64",
                          dp.target_layers.size());
  if (!g.has("tokenizer.ggml.mask_token_id"))
    return Status::error(
        "missing metadata key 'tokenizer.ggml.mask_token_id' (the DFlash block's mask token)");
  KILN_ASSIGN_OR_RETURN(dp.mask_token_id, g.get<int32_t>("tokenizer.ggml.mask_token_id"));
  KILN_ASSIGN_OR_RETURN(dp.n_vocab, req("vocab_size"));
  KILN_TRY(check_range("dflash.vocab_size", dp.n_vocab, 1, 1 << 24));
  KILN_TRY(check_range("tokenizer.ggml.mask_token_id", dp.mask_token_id, 0, dp.n_vocab - 1));
  hp.n_vocab = dp.n_vocab;
  return hp;
}

// Binds tensors by name and exact shape; remembers which it handed out so that a tensor
// nothing binds refuses the file.
class DflashBinder {
 public:
  DflashBinder(const GgufFile& g, DflashWeights& w) : g_(g), w_(w) {}

  Expected<TensorView> get(const std::string& name, std::initializer_list<int64_t> ne) {
    const TensorInfo* t = g_.find_tensor(name);
    if (!t) return Status::errorf("missing tensor '{}'", name);
    used_.insert(t);
    bool ok = t->n_dims == static_cast<int>(ne.size());
    int d = 0;
    for (int64_t n : ne) ok = ok && t->ne[d++] == n;
    if (!ok) {
      std::string want;
      for (int64_t n : ne) want += (want.empty() ? "" : " x ") + std::to_string(n);
      return Status::errorf("tensor '{}': shape [{} x {}], expected [{}]", name, t->ne[0], t->ne[1],
                            want);
    }
    if (!quant::can_dequantize(t->dtype))
      return Status::errorf("tensor '{}': dtype {} is not supported", name, dtype_name(t->dtype));
    return g_.view(*t);
  }
  Expected<WeightMatrix> matrix(const std::string& name, int64_t n_cols, int64_t n_rows) {
    KILN_ASSIGN_OR_RETURN(TensorView v, get(name, {n_cols, n_rows}));
    return as_matrix(v);
  }
  Expected<std::span<const float>> vec(const std::string& name, int64_t n) {
    KILN_ASSIGN_OR_RETURN(TensorView v, get(name, {n}));
    return tensor_floats(name, v, n, w_.owned);
  }
  Status check_all_used() const {
    for (const TensorInfo& t : g_.tensors()) {
      if (used_.contains(&t)) continue;
      if (t.name == "token_embd.weight" || t.name == "output.weight")
        return Status::errorf(
            "tensor '{}': a DFlash drafter with its own embedding or output head is not "
            "supported (kiln's borrows the target's)",
            t.name);
      return Status::errorf("tensor '{}' is not used by kiln's DFlash drafter", t.name);
    }
    return Status::ok();
  }

 private:
  const GgufFile& g_;
  DflashWeights& w_;
  std::unordered_set<const TensorInfo*> used_;
};

Expected<DflashWeights> bind_dflash(const GgufFile& g, const HParams& hp, const DflashParams& dp) {
  DflashWeights w;
  DflashBinder b(g, w);
  const int64_t E = hp.n_embd;
  const int64_t n_feat = int64_t(dp.target_layers.size()) * E;
  KILN_ASSIGN_OR_RETURN(w.fc, b.matrix("fc.weight", n_feat, E));
  KILN_ASSIGN_OR_RETURN(w.enc_norm, b.vec("enc.output_norm.weight", E));
  KILN_ASSIGN_OR_RETURN(w.output_norm, b.vec("output_norm.weight", E));
  w.layers.resize(static_cast<size_t>(hp.n_layer));
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    DflashLayerWeights& lw = w.layers[static_cast<size_t>(il)];
    const std::string p = fmt::format("blk.{}.", il);
    const int64_t F = hp.layers[static_cast<size_t>(il)].n_ff;
    KILN_ASSIGN_OR_RETURN(lw.attn_norm, b.vec(p + "attn_norm.weight", E));
    KILN_ASSIGN_OR_RETURN(lw.wq, b.matrix(p + "attn_q.weight", E, hp.q_width()));
    KILN_ASSIGN_OR_RETURN(lw.wk, b.matrix(p + "attn_k.weight", E, hp.k_width()));
    KILN_ASSIGN_OR_RETURN(lw.wv, b.matrix(p + "attn_v.weight", E, hp.v_width()));
    KILN_ASSIGN_OR_RETURN(lw.wo, b.matrix(p + "attn_output.weight", hp.o_width(), E));
    KILN_ASSIGN_OR_RETURN(lw.q_norm, b.vec(p + "attn_q_norm.weight", hp.head_dim_k));
    KILN_ASSIGN_OR_RETURN(lw.k_norm, b.vec(p + "attn_k_norm.weight", hp.head_dim_k));
    KILN_ASSIGN_OR_RETURN(lw.ffn_norm, b.vec(p + "ffn_norm.weight", E));
    KILN_ASSIGN_OR_RETURN(lw.ffn_gate, b.matrix(p + "ffn_gate.weight", E, F));
    KILN_ASSIGN_OR_RETURN(lw.ffn_up, b.matrix(p + "ffn_up.weight", E, F));
    KILN_ASSIGN_OR_RETURN(lw.ffn_down, b.matrix(p + "ffn_down.weight", F, E));
  }
  KILN_TRY(b.check_all_used());
  return w;
}

}  // namespace

Expected<DflashModel> dflash_from_gguf(GgufFile gguf) {
  DflashModel d;
  d.gguf = std::move(gguf);
  KILN_ASSIGN_OR_RETURN(d.hp, read_dflash_hparams(d.gguf, d.dp));
  KILN_ASSIGN_OR_RETURN(d.w, bind_dflash(d.gguf, d.hp, d.dp));
  return d;
}

Expected<DflashModel> load_dflash(const std::string& path) {
  auto g = GgufFile::open(path);
  if (!g) return g.status().context(fmt::format("loading DFlash drafter '{}'", path));
  auto d = dflash_from_gguf(std::move(*g));
  if (!d) return d.status().context(fmt::format("loading DFlash drafter '{}'", path));
  return d;
}

Status check_dflash_target(const DflashModel& d, const HParams& t) {
  if (d.dp.n_vocab != t.n_vocab)
    return Status::errorf("DFlash drafter vocabulary has {} tokens but the target's has {}",
                          d.dp.n_vocab, t.n_vocab);
  if (d.hp.n_embd != t.n_embd)
    return Status::errorf(
        "DFlash drafter width {} differs from the target's {} (it runs on the target's "
        "embeddings and output head)",
        d.hp.n_embd, t.n_embd);
  for (int32_t L : d.dp.target_layers)
    if (L < 0 || L > t.n_layer)
      return Status::errorf(
          "DFlash 'dflash.target_layers' names layer {}, outside the target's "
          "[0, {}]",
          L, t.n_layer);
  if (t.embd_scale != 1.0f || t.arch->embd_rmsnorm)
    return Status::errorf(
        "DFlash drafter on target architecture '{}': its scaled or normalised embeddings are "
        "not supported (the drafter reads the raw embedding rows)",
        t.arch_name);
  return Status::ok();
}

std::string dflash_feature_name(int32_t layer) {
  return layer == 0 ? std::string("inp_embd") : fmt::format("blk.{}.l_out", layer - 1);
}

DflashState::DflashState(const DflashModel& d, int32_t max_rows) : d_(d), max_rows_(max_rows) {
  KILN_CHECK(max_rows > 0);
}

void DflashState::bind(Backend& be) {
  if (bound_ == &be) return;
  bound_ = &be;
  const HParams& hp = d_.hp;
  const size_t B = static_cast<size_t>(max_rows_);
  int64_t n_ff = 0;
  for (const LayerDesc& L : hp.layers) n_ff = std::max<int64_t>(n_ff, L.n_ff);
  x = be.alloc<float>(B * hp.n_embd);
  h = be.alloc<float>(B * hp.n_embd);
  a = be.alloc<float>(B * hp.n_embd);
  q = be.alloc<float>(B * hp.q_width());
  k = be.alloc<float>(B * hp.k_width());
  v = be.alloc<float>(B * hp.v_width());
  o = be.alloc<float>(B * hp.o_width());
  ff_gate = be.alloc<float>(B * n_ff);
  ff_up = be.alloc<float>(B * n_ff);
  ff_act = be.alloc<float>(B * n_ff);
  tmp = be.alloc<float>(B * std::max<int64_t>({hp.n_embd, hp.q_width(), hp.k_width()}));
  logits = be.alloc<float>(B * static_cast<size_t>(d_.dp.n_vocab));
}

// One pass of the drafter over n rows: the shared helpers of inject and block.
class DflashPass {
 public:
  DflashPass(const DflashModel& d, Backend& be, DflashState& st, int64_t n)
      : hp_(d.hp), w_(d.w), be_(be), st_(st), n_(n) {
    KILN_CHECK(n > 0 && n <= st.max_rows(), "DFlash pass of {} rows, max {}", n, st.max_rows());
    st.bind(be);
  }

  std::span<float> sl(BackendBuffer<float>& b, int64_t count) {
    return std::span<float>(b.data(), static_cast<size_t>(count));
  }
  // Per-head RMS norm of q or k (x and y may not alias: through scratch).
  void head_norm(std::span<float> y, std::span<const float> wt) {
    const std::span<float> t = sl(st_.tmp, static_cast<int64_t>(y.size()));
    be_.rmsnorm(y, wt, hp_.head_dim_k, hp_.rms_eps, t);
    be_.copy(std::span<const float>(t), y);
  }
  // The injected K and V of g into layer il's planes: g is used as it is (no attn_norm).
  void store_kv(int32_t il, std::span<const float> g, std::span<const int32_t> pos,
                const LayerKv& kv) {
    const DflashLayerWeights& lw = w_.layers[static_cast<size_t>(il)];
    const std::span<float> k = sl(st_.k, n_ * hp_.k_width()), v = sl(st_.v, n_ * hp_.v_width());
    const Backend::MatmulTask kv_tasks[] = {{&lw.wk, g, k}, {&lw.wv, g, v}};
    be_.matmul_batch(kv_tasks, n_);
    head_norm(k, lw.k_norm);
    be_.rope(k, n_, hp_.n_head_kv, hp_.head_dim_k, pos, hp_.layers[static_cast<size_t>(il)].rope);
    store(k, v, kv);
  }
  void store(std::span<const float> k, std::span<const float> v, const LayerKv& kv) {
    KILN_CHECK(static_cast<int64_t>(kv.append_rows.size()) == n_);
    st_.stores.clear();
    st_.stores.push_back({k, hp_.k_width(), kv.append_rows, kv.k});
    st_.stores.push_back({v, hp_.v_width(), kv.append_rows, kv.v});
    be_.store_rows_f16_batch(st_.stores);
  }

  const HParams& hp_;
  const DflashWeights& w_;
  Backend& be_;
  DflashState& st_;
  const int64_t n_;
};

void dflash_inject(const DflashModel& d, Backend& be, DflashState& st,
                   std::span<const float> features, std::span<const int32_t> pos,
                   std::span<const LayerKv> kv) {
  const int64_t n = static_cast<int64_t>(pos.size());
  DflashPass p(d, be, st, n);
  const HParams& hp = d.hp;
  KILN_CHECK(static_cast<int64_t>(features.size()) == n * d.n_feat());
  KILN_CHECK(static_cast<int32_t>(kv.size()) == hp.n_layer);
  const std::span<float> x = p.sl(st.x, n * hp.n_embd), g = p.sl(st.h, n * hp.n_embd);
  be.matmul(d.w.fc, features, n, x);
  be.rmsnorm(x, d.w.enc_norm, hp.n_embd, hp.rms_eps, g);
  for (int32_t il = 0; il < hp.n_layer; ++il) p.store_kv(il, g, pos, kv[static_cast<size_t>(il)]);
}

void dflash_block(const DflashModel& d, const WeightMatrix& tok_embd, const WeightMatrix& output,
                  Backend& be, DflashState& st, std::span<const int32_t> tokens,
                  std::span<const int32_t> pos, std::span<const LayerKv> kv, std::span<int32_t> ids,
                  std::span<float> logits) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  DflashPass p(d, be, st, n);
  const HParams& hp = d.hp;
  const int64_t E = hp.n_embd;
  KILN_CHECK(static_cast<int64_t>(pos.size()) == n);
  KILN_CHECK(static_cast<int32_t>(kv.size()) == hp.n_layer);
  KILN_CHECK(tok_embd.n_cols == E && output.n_cols == E && output.n_rows == d.dp.n_vocab);
  const int64_t V = d.dp.n_vocab;
  KILN_CHECK(n >= 2 && static_cast<int64_t>(ids.size()) == n - 1);
  KILN_CHECK(logits.empty() || static_cast<int64_t>(logits.size()) == (n - 1) * V);
  // Non-causal: every query masks as the block's last position, so it sees every context key
  // and every block key (AttentionArgs's mask reads q_pos only; rope has used the true ones).
  st.mask_pos.assign(static_cast<size_t>(n), *std::max_element(pos.begin(), pos.end()));
  const std::span<float> x = p.sl(st.x, n * E), h = p.sl(st.h, n * E), a = p.sl(st.a, n * E);
  const std::span<float> q = p.sl(st.q, n * hp.q_width()), k = p.sl(st.k, n * hp.k_width());
  const std::span<float> v = p.sl(st.v, n * hp.v_width()), o = p.sl(st.o, n * hp.o_width());
  be.get_rows(tok_embd, tokens, x);
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    const DflashLayerWeights& lw = d.w.layers[static_cast<size_t>(il)];
    const LayerDesc& L = hp.layers[static_cast<size_t>(il)];
    const LayerKv& lkv = kv[static_cast<size_t>(il)];
    be.rmsnorm(x, lw.attn_norm, E, hp.rms_eps, h);
    const Backend::MatmulTask qkv[] = {{&lw.wq, h, q}, {&lw.wk, h, k}, {&lw.wv, h, v}};
    be.matmul_batch(qkv, n);
    p.head_norm(q, lw.q_norm);
    p.head_norm(k, lw.k_norm);
    be.rope_qk(q, hp.n_head, k, hp.n_head_kv, n, hp.head_dim_k, pos, L.rope);
    p.store(k, v, lkv);
    AttentionArgs args;
    args.q = q;
    args.k = lkv.k;
    args.v = lkv.v;
    args.kv_rows = lkv.kv_rows;
    args.kv_pos = lkv.kv_pos;
    args.q_pos = st.mask_pos;
    args.n_q = n;
    args.n_head = hp.n_head;
    args.n_head_kv = hp.n_head_kv;
    args.head_dim = hp.head_dim_k;
    args.scale = hp.attn_scale;
    args.out = o;
    be.attention(args);
    be.matmul(lw.wo, o, n, a);
    be.add_rmsnorm(x, a, lw.ffn_norm, E, hp.rms_eps, h);
    const std::span<float> fg = p.sl(st.ff_gate, n * L.n_ff), fu = p.sl(st.ff_up, n * L.n_ff);
    const std::span<float> fa = p.sl(st.ff_act, n * L.n_ff);
    const Backend::MatmulTask gate_up[] = {{&lw.ffn_gate, h, fg}, {&lw.ffn_up, h, fu}};
    be.matmul_batch(gate_up, n);
    be.swiglu_matmul(lw.ffn_down, fg, fu, n, fa, a);
    be.add(x, a, x);
  }
  be.rmsnorm(x, d.w.output_norm, E, hp.rms_eps, h);
  // Rows 1..n-1 only: the anchor's row would predict the token the target has already chosen.
  // (On a backend that is not batch-invariant the row count may move a draft logit's last
  // bits; drafts are verified exactly, so no output id can change.)
  const std::span<float> out = p.sl(st.logits, (n - 1) * V);
  be.matmul(output, std::span<const float>(h).subspan(static_cast<size_t>(E)), n - 1, out);
  st.top_vals.resize(ids.size());
  be.top_k(std::span<const float>(out), V, 1, ids, st.top_vals);
  if (!logits.empty()) be.download(std::span<const float>(out), logits);
}

}  // namespace kiln::model
