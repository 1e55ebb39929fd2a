// model/forward.cpp: the fast forward pass (see forward.h). Every arithmetic step is a
// Backend op; this file only sequences them and slices the scratch buffers.
#include "model/forward.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <optional>
#include <string>

#include "core/check.h"
#include "core/counters.h"

namespace kiln::model {

ForwardState::ForwardState(const HParams& hp, int32_t max_batch) : max_batch_(max_batch) {
  KILN_CHECK(max_batch > 0);
  int64_t n_ff = 0, n_expert = 0, n_used = 0;
  std::vector<LayerDesc> all = hp.layers;  // NextN blocks run with this state too
  all.insert(all.end(), hp.nextn_layers.begin(), hp.nextn_layers.end());
  for (const LayerDesc& L : all) {
    n_ff = std::max<int64_t>({n_ff, L.n_ff, L.n_ff_expert, L.n_ff_shexp});
    n_expert = std::max<int64_t>(n_expert, L.n_expert);
    n_used = std::max<int64_t>(n_used, L.n_expert_used);
  }
  const size_t B = static_cast<size_t>(max_batch);
  n_x_ = B * hp.n_embd;
  n_q_ = B * hp.q_width();
  n_k_ = B * hp.k_width();
  n_v_ = B * hp.v_width();
  n_o_ = B * hp.o_width();
  if (hp.is_mla()) {
    // The absorbed attention's output has a full latent row per head (see mla_attention).
    const MlaDims& m = hp.mla;
    const size_t H = static_cast<size_t>(hp.n_head);
    n_o_ = B * H * static_cast<size_t>(hp.head_dim_k);
    n_mla_qa_ = B * static_cast<size_t>(m.q_lora);
    n_mla_q_ = B * H * static_cast<size_t>(m.q_head());
    n_mla_kv_ = B * static_cast<size_t>(m.kv_lora + m.rope);
    n_mla_qpe_ = B * H * static_cast<size_t>(m.rope);
    n_mla_kpe_ = B * static_cast<size_t>(m.rope);
    n_mla_c_ = B * static_cast<size_t>(m.kv_lora);
    n_mla_heads_ = H * B * static_cast<size_t>(std::max({m.nope, m.kv_lora, m.v}));
    n_mla_ov_ = B * H * static_cast<size_t>(m.v);
  }
  if (hp.is_dsa()) {
    const DsaDims& d = hp.dsa;
    n_idx_q_ = B * static_cast<size_t>(d.n_head) * static_cast<size_t>(d.head_dim);
    n_idx_k_ = B * static_cast<size_t>(d.head_dim);
    n_idx_w_ = B * static_cast<size_t>(d.n_head);
    sel_rows.resize(B * static_cast<size_t>(d.top_k));
    sel_pos.resize(sel_rows.size());
    sel_n.resize(B);
  }
  n_ff_ = B * n_ff;
  n_tmp_ = B * std::max<int64_t>({hp.n_embd, hp.q_width(), hp.k_width()});
  // Latent attention normalises its q-LoRA and c_kv rows through tmp too.
  n_tmp_ =
      std::max<size_t>(n_tmp_, B * static_cast<size_t>(std::max(hp.mla.q_lora, hp.mla.kv_lora)));
  if (n_expert > 0) {
    n_router_ = B * n_expert;
    n_moe_ = std::max<size_t>(B, n_used) * hp.n_embd;
    // The one-token path keeps its n_used experts' FFN activations side by side.
    n_ff_ = std::max<size_t>(n_ff_, n_used * n_ff);
    sel_w.resize(B * n_used);
    sel_e.resize(B * n_used);
    moe_rows.resize(B * n_used);
    moe_row_w.resize(B * n_used);
  }
}

void ForwardState::bind(Backend& be) {
  if (bound_ == &be) return;
  bound_ = &be;
  x = be.alloc<float>(n_x_);
  h = be.alloc<float>(n_x_);
  a = be.alloc<float>(n_x_);
  q = be.alloc<float>(n_q_);
  k = be.alloc<float>(n_k_);
  v = be.alloc<float>(n_v_);
  o = be.alloc<float>(n_o_);
  gate = be.alloc<float>(n_o_);
  ff_gate = be.alloc<float>(n_ff_);
  ff_up = be.alloc<float>(n_ff_);
  ff_act = be.alloc<float>(n_ff_);
  tmp = be.alloc<float>(n_tmp_);
  router = be.alloc<float>(n_router_);
  moe_in = be.alloc<float>(n_moe_);
  moe_out = be.alloc<float>(n_moe_);
  mla_qa = be.alloc<float>(n_mla_qa_);
  mla_q = be.alloc<float>(n_mla_q_);
  mla_kv = be.alloc<float>(n_mla_kv_);
  mla_qpe = be.alloc<float>(n_mla_qpe_);
  mla_kpe = be.alloc<float>(n_mla_kpe_);
  mla_c = be.alloc<float>(n_mla_c_);
  mla_in = be.alloc<float>(n_mla_heads_);
  mla_out = be.alloc<float>(n_mla_heads_);
  mla_ov = be.alloc<float>(n_mla_ov_);
  idx_q = be.alloc<float>(n_idx_q_);
  idx_k = be.alloc<float>(n_idx_k_);
  idx_w = be.alloc<float>(n_idx_w_);
  idx_dots = {};
  logits = {};
  n_logits_ = 0;
  nextn_cat = {};
}

namespace {

// Steps of up to this many tokens take moe_few_tokens where the backend asks for it
// (Backend::groups_few_token_experts): a DFlash block or MTP draft being verified, a few
// sequences decoding together (the CUDA int8 and float matvec kernels' range, where a step's
// tokens share each weight read).
constexpr int64_t kFewTokenMoe = 8;

// Bytes of expert weights the forward passes computed with: each selected expert's three
// slices once per step (kiln bench divides it by the tokens decoded: bytes per token).
Counter& expert_bytes_used() {
  static Counter& c = process_counters().counter("moe.expert_bytes_used");
  return c;
}

uint64_t expert_bytes(const moe::ExpertWeights& ew) {
  return ew.gate.bytes.size() + ew.up.bytes.size() + ew.down.bytes.size();
}

}  // namespace

// One call of forward(): the batch, the scratch spans sliced for it and the backend. The step
// is a sequence of blocks -- embedding, then per layer the attention block and the FFN block
// its LayerDesc asks for (dense, or mixture of experts), then the output head -- each a member
// below; what differs between architectures is data (HParams, LayerDesc, ArchInfo), read
// here, never a branch on the architecture's name.
class ForwardPass {
 public:
  ForwardPass(const HParams& hp, const Weights& w, Backend& be, ForwardState& st,
              const ForwardBatch& batch, std::span<float> logits);
  // A NextN step (forward_nextn): the input rows come from `hidden` and the tokens through
  // the block's eh_proj, and the last layer's output rows go to hidden_out.
  void set_nextn(const NextnWeights* nw, std::span<const float> hidden,
                 std::span<float> hidden_out) {
    nextn_ = nw;
    nextn_hidden_ = hidden;
    hidden_out_ = hidden_out;
  }
  void run();

 private:
  // The one prefetch hook. Backend::prefetch_weights names the weights the next matmuls read
  // before the latency-bound ops that precede them (a device backend may pull them into its
  // cache while those run); it never changes a result. Each point of the step at which a hint
  // goes out, and what it names, is decided here.
  enum class Hint {
    Start,           // the first layer's Q, K, V (before the embedding lookup)
    AttentionOps,    // after Q/K/V, and again before attention: the output projection and
                     // the FFN's first matmuls (a MoE layer's experts are not known yet)
    AfterAttention,  // after the output projection of a dense layer: its whole FFN
    AfterGateUp,     // the down projection
    LayerEnd,        // the next layer's attention weights, or the output head
  };
  void hint(Hint at, int32_t il);
  void hint_weights(std::initializer_list<const WeightMatrix*> ws, int64_t n_tok);

  void embed();
  void nextn_embed();
  void attention_block(int32_t il);
  void mla_attention(int32_t il);
  void indexer_select(int32_t il, std::span<const float> qa);
  void select_keys(int32_t il, const SeqSlice& sq, std::span<const float> iq);
  // Column block [src_col, src_col + width) of each of `rows` rows of src (rows src_w wide)
  // into columns [dst_col, ..) of dst's rows (dst_w wide): one backend copy per row.
  void dense_ffn_block(int32_t il);
  void moe_ffn_block(int32_t il);
  void moe_experts_batch(int32_t il, int64_t X, int64_t K, int64_t F, std::span<const float> in,
                         std::span<float> out);
  template <typename AfterGateUp>
  void gated_ffn(const WeightMatrix& wg, const WeightMatrix& wu, const WeightMatrix& wd,
                 int64_t width, std::span<const float> in, std::span<float> out,
                 AfterGateUp after_gate_up);
  void moe_few_tokens(int32_t il, int64_t X, int64_t K, int64_t F, std::span<const float> in,
                      std::span<float> out);
  void moe_one_token(int32_t il, int64_t n_expert, int64_t n_sel, int64_t F,
                     std::span<const float> in, std::span<float> out);
  void layer_end(int32_t il);
  void output_head();

  std::span<float> sl(BackendBuffer<float>& buf, int64_t count) {
    return std::span<float>(buf.data(), static_cast<size_t>(count));
  }
  // Scratch spans are backend memory (device memory on a GPU); host code reads them only
  // through host_view, which downloads on device backends and is the span itself elsewhere.
  std::span<const float> host_view(std::span<const float> data, std::vector<float>& mirror);
  // `data`: backend memory (scratch). A capture whose device is this pass's backend keeps
  // the node there (no download, no wait); any other gets a host copy.
  void rec(const std::string& name, std::span<const float> data, int64_t rows) {
    if (!batch_.capture || !batch_.capture->wants(name)) return;
    if (batch_.capture->device == &be_)
      batch_.capture->record_device(name, data, rows);
    else
      batch_.capture->record(name, host_view(data, st_.capture_host), rows);
  }
  std::string prefix(int32_t il) const {
    return batch_.capture ? fmt::format("blk.{}.", il) : std::string();
  }
  void add_bias(std::span<float> y, std::span<const float> b);
  // Backend::rmsnorm does not promise that x and y may alias; go through scratch.
  void norm_in_place(std::span<float> y, std::span<const float> wt, int64_t width, float eps);
  void ffn_act(std::span<const float> g, std::span<const float> u, std::span<float> out) {
    switch (hp_.arch->act) {
      case FfnAct::Silu:
        return be_.swiglu(g, u, out);
      case FfnAct::GeluTanh:
        return be_.geglu(g, u, out);
      case FfnAct::SwigluOai:  // gpt-oss's constants (llama.cpp's build_moe_ffn)
        return be_.swiglu_oai(g, u, out, 1.702f, 7.0f);
    }
  }
  // The rows of this step routed to expert e (n_expert_used = K picks per token): their tokens
  // into st_.moe_rows and router weights into st_.moe_row_w, in token order; returns how many.
  // A token routes to an expert once (route_experts and override_route pick distinct ids).
  int64_t routed_rows(int32_t e, int64_t K) {
    int64_t m = 0;
    for (int64_t j = 0; j < n_ * K; ++j)
      if (st_.sel_e[static_cast<size_t>(j)] == e) {
        st_.moe_rows[static_cast<size_t>(m)] = static_cast<int32_t>(j / K);
        st_.moe_row_w[static_cast<size_t>(m++)] = st_.sel_w[static_cast<size_t>(j)];
      }
    return m;
  }
  // Expert e's slice of a per-expert bias (empty when the model has none), added to each of
  // the `rows` rows of y.
  void add_expert_bias(std::span<float> y, std::span<const float> bias, int32_t e, int64_t width,
                       int64_t rows) {
    if (bias.empty()) return;
    const auto b = bias.subspan(static_cast<size_t>(e * width), static_cast<size_t>(width));
    for (int64_t r = 0; r < rows; ++r) {
      const auto row = y.subspan(static_cast<size_t>(r * width), static_cast<size_t>(width));
      be_.add(row, b, row);
    }
  }

  const HParams& hp_;
  const Weights& w_;
  Backend& be_;
  ForwardState& st_;
  const ForwardBatch& batch_;
  std::span<float> logits_;
  const int64_t n_, E_;
  SeqSlice whole_;  // one sequence is the multi-sequence case with one slice over the batch
  std::span<const SeqSlice> seqs_;
  int64_t n_out_ = 0;
  bool want_logits_ = false;
  bool on_device_ = false;
  // The residual stream x, the normalised rows h, the block outputs a; Q, K, V and the
  // attention output o: [n][width] slices of the state's scratch.
  std::span<float> x_, h_, a_, q_, k_, v_, o_;
  const NextnWeights* nextn_ = nullptr;
  std::span<const float> nextn_hidden_;
  std::span<float> hidden_out_;
};

ForwardPass::ForwardPass(const HParams& hp, const Weights& w, Backend& be, ForwardState& st,
                         const ForwardBatch& batch, std::span<float> logits)
    : hp_(hp),
      w_(w),
      be_(be),
      st_(st),
      batch_(batch),
      logits_(logits),
      n_(static_cast<int64_t>(batch.tokens.size())),
      E_(hp.n_embd) {
  const int64_t n = n_;
  KILN_CHECK(n > 0 && n <= st.max_batch_, "batch of {} tokens, max {}", n, st.max_batch_);
  KILN_CHECK(static_cast<int64_t>(batch.pos.size()) == n);
  whole_ = SeqSlice{0, static_cast<int32_t>(n), batch.kv};
  seqs_ = batch.seqs.empty() ? std::span<const SeqSlice>(&whole_, 1) : batch.seqs;
  for (size_t i = 0, next = 0; i < seqs_.size(); ++i) {
    KILN_CHECK(seqs_[i].first == static_cast<int32_t>(next) && seqs_[i].n_tok > 0,
               "sequence {} covers tokens [{}, +{}), expected to start at {}", i, seqs_[i].first,
               seqs_[i].n_tok, next);
    KILN_CHECK(static_cast<int32_t>(seqs_[i].kv.size()) == hp.n_layer);
    next += static_cast<size_t>(seqs_[i].n_tok);
    if (i + 1 == seqs_.size()) KILN_CHECK(static_cast<int64_t>(next) == n);
  }
  for (const SeqSlice& sq : seqs_) n_out_ += batch.all_logits || sq.all_logits ? sq.n_tok : 1;
  // No logits: a tensor-parallel rank other than 0, which skips the (replicated) output head.
  want_logits_ = !logits.empty();
  KILN_CHECK(
      want_logits_ ? static_cast<int64_t>(logits.size()) == n_out_ * hp.n_vocab : hp.tp_rank != 0,
      "logits of {} floats for {} rows", logits.size(), n_out_);
  st.bind(be);
  on_device_ = be.device_memory();
  x_ = sl(st.x, n * E_);
  h_ = sl(st.h, n * E_);
  a_ = sl(st.a, n * E_);
  q_ = sl(st.q, n * hp.q_width());
  k_ = sl(st.k, n * hp.k_width());
  v_ = sl(st.v, n * hp.v_width());
  // Latent attention writes a whole latent row per head (n_o_ above), wider than o_width.
  o_ = sl(st.o, n * (hp.is_mla() ? int64_t(hp.n_head) * hp.head_dim_k : hp.o_width()));
}

std::span<const float> ForwardPass::host_view(std::span<const float> data,
                                              std::vector<float>& mirror) {
  if (!on_device_) return data;
  mirror.resize(data.size());
  be_.download(data, std::span<float>(mirror));
  return std::span<const float>(mirror);
}

void ForwardPass::add_bias(std::span<float> y, std::span<const float> b) {
  if (b.empty()) return;
  for (int64_t t = 0; t < n_; ++t) {
    std::span<float> row = y.subspan(static_cast<size_t>(t) * b.size(), b.size());
    be_.add(row, b, row);
  }
}

void ForwardPass::norm_in_place(std::span<float> y, std::span<const float> wt, int64_t width,
                                float eps) {
  const std::span<float> t = sl(st_.tmp, static_cast<int64_t>(y.size()));
  be_.rmsnorm(y, wt, width, eps, t);
  be_.copy(std::span<const float>(t), y);
}

void ForwardPass::hint_weights(std::initializer_list<const WeightMatrix*> ws, int64_t n_tok) {
  be_.prefetch_weights(std::span<const WeightMatrix* const>(ws.begin(), ws.size()), n_tok);
}

void ForwardPass::hint(Hint at, int32_t il) {
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  switch (at) {
    case Hint::Start:
      return hint_weights({&lw.wq, &lw.wk, &lw.wv, &lw.wq_a, &lw.wkv_a}, n_);
    case Hint::AttentionOps:
      if (hp_.layers[static_cast<size_t>(il)].n_expert > 0)
        return hint_weights({&lw.wgate_attn, &lw.wo, &lw.ffn_gate_inp}, n_);
      return hint_weights({&lw.wgate_attn, &lw.wo, &lw.ffn_gate, &lw.ffn_up}, n_);
    case Hint::AfterAttention:
      if (hp_.layers[static_cast<size_t>(il)].n_expert == 0)
        hint_weights({&lw.ffn_gate, &lw.ffn_up, &lw.ffn_down}, n_);
      return;
    case Hint::AfterGateUp:
      return hint_weights({&lw.ffn_down}, n_);
    case Hint::LayerEnd:
      if (il + 1 < hp_.n_layer) {
        const LayerWeights& nw = w_.layers[static_cast<size_t>(il) + 1];
        return hint_weights({&nw.wq, &nw.wk, &nw.wv, &nw.wq_a, &nw.wkv_a, &nw.wo}, n_);
      }
      if (want_logits_) hint_weights({&w_.output}, n_out_);  // the head reads n_out rows
      return;
  }
}

void ForwardPass::run() {
  if (batch_.capture) batch_.capture->clear();
  hint(Hint::Start, 0);
  if (nextn_)
    nextn_embed();
  else
    embed();
  for (int32_t il = 0; il < hp_.n_layer; ++il) {
    if (hp_.is_mla())
      mla_attention(il);
    else
      attention_block(il);
    if (hp_.layers[static_cast<size_t>(il)].n_expert > 0)
      moe_ffn_block(il);
    else
      dense_ffn_block(il);
    layer_end(il);
  }
  if (!hidden_out_.empty()) be_.download(std::span<const float>(x_), hidden_out_);
  if (!want_logits_) {
    be_.synchronize();  // the step's work is done on return, as on the rank that downloads
    return;
  }
  output_head();
}

void ForwardPass::embed() {
  be_.get_rows(w_.token_embd, batch_.tokens, x_);
  if (hp_.embd_scale != 1.0f) be_.scale(x_, hp_.embd_scale);
  if (hp_.arch->embd_rmsnorm) norm_in_place(x_, {}, E_, hp_.rms_eps);
  rec("inp_embd", x_, n_);
}

// The NextN input rows (forward_nextn): enorm(embedding) and hnorm(hidden) side by side per
// row (embedding first, as vLLM's and llama.cpp's eh_proj read them), through eh_proj into x.
void ForwardPass::nextn_embed() {
  const int64_t n = n_, E = E_;
  KILN_CHECK(static_cast<int64_t>(nextn_hidden_.size()) == n * E, "NextN hidden of {} floats",
             nextn_hidden_.size());
  if (st_.nextn_cat.size() < static_cast<size_t>(st_.max_batch_ * 2 * E))
    st_.nextn_cat = be_.alloc<float>(static_cast<size_t>(st_.max_batch_ * 2 * E));
  const std::span<float> cat = sl(st_.nextn_cat, n * 2 * E);
  auto row = [E](std::span<float> s, int64_t t) {
    return s.subspan(static_cast<size_t>(t * E), static_cast<size_t>(E));
  };
  be_.get_rows(w_.token_embd, batch_.tokens, a_);
  for (int64_t t = 0; t < n; ++t)
    if (batch_.pos[t] == 0) be_.zero(row(a_, t));  // vLLM: position 0's embedding is masked
  be_.rmsnorm(a_, nextn_->enorm, E, hp_.rms_eps, h_);
  be_.upload(nextn_hidden_, a_);
  be_.rmsnorm(a_, nextn_->hnorm, E, hp_.rms_eps, x_);
  for (int64_t t = 0; t < n; ++t) {
    const auto dst = cat.subspan(static_cast<size_t>(t * 2 * E), static_cast<size_t>(2 * E));
    be_.copy(std::span<const float>(row(h_, t)), dst.first(static_cast<size_t>(E)));
    be_.copy(std::span<const float>(row(x_, t)), dst.subspan(static_cast<size_t>(E)));
  }
  be_.matmul(nextn_->eh_proj, cat, n, x_);
  rec("inp_embd", x_, n);
}

// attn_norm'd rows h -> the attention block's output added to the residual stream x, and h
// replaced by the FFN norm of the result.
void ForwardPass::attention_block(int32_t il) {
  const LayerDesc& L = hp_.layers[static_cast<size_t>(il)];
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  const std::string p = prefix(il);
  const int64_t n = n_;
  // Layers after the first got their attn_norm from the previous layer's closing add_rmsnorm.
  if (il == 0) be_.rmsnorm(x_, lw.attn_norm, E_, hp_.rms_eps, h_);
  rec(p + "attn_norm", h_, n);
  // Q, K and V read the same normalised rows: one backend op, which a CPU decode step runs as
  // one thread hand-off with one activation encoding; each output is bit-identical to its own
  // matmul (Backend::matmul_batch's contract).
  const Backend::MatmulTask qkv[] = {{&lw.wq, h_, q_}, {&lw.wk, h_, k_}, {&lw.wv, h_, v_}};
  be_.matmul_batch(qkv, n);
  hint(Hint::AttentionOps, il);
  add_bias(q_, lw.bq);
  add_bias(k_, lw.bk);
  add_bias(v_, lw.bv);
  if (!lw.q_norm.empty()) norm_in_place(q_, lw.q_norm, hp_.head_dim_k, hp_.rms_eps);
  if (!lw.k_norm.empty()) norm_in_place(k_, lw.k_norm, hp_.head_dim_k, hp_.rms_eps);
  if (L.use_rope)
    be_.rope_qk(q_, hp_.n_head, k_, hp_.n_head_kv, n, hp_.head_dim_k, batch_.pos, L.rope);
  rec(p + "Qcur", q_, n);
  rec(p + "Kcur", k_, n);
  rec(p + "Vcur", v_, n);
  // Each sequence writes its new keys/values into its own planes and attends only over
  // them; a query row's result never depends on the other sequences in the batch.
  // All sequences' stores go first, then all attentions, each group as one backend op (a
  // batched decode step is many tiny ops otherwise). Reordering is safe because no two
  // sequences of a batch share a plane (BatchEval and Session give each its own KvCache;
  // checked below), so a sequence's store never touches rows another one attends over.
  KILN_CHECK(hp_.head_dim_k == hp_.head_dim_v, "attention op needs key_length == value_length");
  std::vector<Backend::StoreRowsTask>& stores = st_.store_tasks;
  std::vector<AttentionArgs>& attns = st_.attn_args;
  stores.clear();
  attns.clear();
  for (const SeqSlice& sq : seqs_) {
    const LayerKv& kv = sq.kv[il];
    const auto f = static_cast<size_t>(sq.first), c = static_cast<size_t>(sq.n_tok);
    const auto qw = static_cast<size_t>(hp_.q_width()), kw = static_cast<size_t>(hp_.k_width());
    const auto vw = static_cast<size_t>(hp_.v_width()), ow = static_cast<size_t>(hp_.o_width());
    KILN_CHECK(kv.append_rows.size() == c);
    stores.push_back({k_.subspan(f * kw, c * kw), hp_.k_width(), kv.append_rows, kv.k});
    stores.push_back({v_.subspan(f * vw, c * vw), hp_.v_width(), kv.append_rows, kv.v});

    AttentionArgs args;
    args.q = q_.subspan(f * qw, c * qw);
    args.k = kv.k;
    args.v = kv.v;
    args.kv_rows = kv.kv_rows;
    args.kv_pos = kv.kv_pos;
    args.q_pos = batch_.pos.subspan(f, c);
    args.n_q = sq.n_tok;
    args.n_head = hp_.n_head;
    args.n_head_kv = hp_.n_head_kv;
    args.head_dim = hp_.head_dim_k;
    args.window = L.window;
    args.scale = hp_.attn_scale;
    args.softcap = hp_.attn_softcap;
    args.sinks = lw.attn_sinks;
    args.out = o_.subspan(f * ow, c * ow);
    attns.push_back(args);
  }
  if (seqs_.size() > 1) {
    std::vector<const f16*>& planes = st_.plane_check;
    planes.clear();
    for (const Backend::StoreRowsTask& t : stores) planes.push_back(t.plane.data());
    std::sort(planes.begin(), planes.end());
    KILN_CHECK(std::adjacent_find(planes.begin(), planes.end()) == planes.end(),
               "two sequences of one batch share a KV plane (layer {})", il);
  }
  be_.store_rows_f16_batch(stores);
  // Named again before attention, the longest of a decode step's small ops: each hint goes
  // on where the last one stopped.
  hint(Hint::AttentionOps, il);
  be_.attention_batch(attns);
  rec(p + "kqv_out", o_, n);
  if (lw.wgate_attn.n_rows > 0) {
    const std::span<float> g = sl(st_.gate, n * hp_.o_width());
    be_.matmul(lw.wgate_attn, h_, n, g);
    be_.sigmoid(g);
    be_.mul(o_, g, o_);
  }
  be_.matmul(lw.wo, o_, n, a_);
  hint(Hint::AfterAttention, il);
  add_bias(a_, lw.bo);     // on rank 0 only under tensor parallelism (shard_model)
  be_.all_reduce_sum(a_);  // row-parallel: each rank holds its heads' share of the sum
  if (!lw.post_attn_norm.empty()) norm_in_place(a_, lw.post_attn_norm, E_, hp_.post_norm_eps);
  rec(p + "attn_out", a_, n);
  // The residual add and the FFN norm as one op (Backend::add_rmsnorm: the bits of the two).
  be_.add_rmsnorm(x_, a_, lw.ffn_norm, E_, hp_.rms_eps, h_);
  rec(p + "ffn_inp", x_, n);
  rec(p + "ffn_norm", h_, n);
}

// Latent attention (HParams::mla) in the absorbed form, for prefill and decode alike (one
// path, the one llama.cpp runs for these files): per head, q_nope is projected by attn_k_b
// into the latent space, so each head's query is [q_lat | q_pe] against the cached latent
// rows [c_kv | k_pe] -- MQA with one KV head of width kv_lora + rope -- and the attention op
// runs unchanged with V = the K plane itself: each head's output is then the weighted sum of
// whole latent rows, whose first kv_lora columns are the weighted c_kv that attn_v_b
// projects out (the trailing rope columns are computed and ignored: rope / (kv_lora + rope)
// extra work in the value sum, and no second plane and no new kernel). Nothing is ever
// expanded to per-head K/V; the cache holds kv_lora + rope values per token per layer.
void ForwardPass::mla_attention(int32_t il) {
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  const std::string p = prefix(il);
  const MlaDims& m = hp_.mla;
  const int64_t n = n_, H = hp_.n_head, N = m.nope, R = m.rope, C = m.kv_lora, V = m.v;
  const int64_t D = m.q_head(), W = C + R;
  if (il == 0) be_.rmsnorm(x_, lw.attn_norm, E_, hp_.rms_eps, h_);
  rec(p + "attn_norm", h_, n);

  // The queries (through the q-LoRA when the model has one) and the latent projection.
  const std::span<float> qf = sl(st_.mla_q, n * H * D), kv = sl(st_.mla_kv, n * W);
  if (lw.wq_a.n_rows > 0) {
    const std::span<float> qa = sl(st_.mla_qa, n * m.q_lora);
    const Backend::MatmulTask first[] = {{&lw.wq_a, h_, qa}, {&lw.wkv_a, h_, kv}};
    be_.matmul_batch(first, n);
    norm_in_place(qa, lw.q_a_norm, m.q_lora, hp_.rms_eps);
    be_.matmul(lw.wq_b, qa, n, qf);
    if (hp_.layers[static_cast<size_t>(il)].indexer == IndexerKind::Full && !hp_.dsa_dense)
      indexer_select(il, qa);
  } else {
    const Backend::MatmulTask first[] = {{&lw.wq, h_, qf}, {&lw.wkv_a, h_, kv}};
    be_.matmul_batch(first, n);
  }
  hint(Hint::AttentionOps, il);

  // RoPE on the q_pe / k_pe parts, gathered into rows of their own; c_kv normalised.
  const std::span<float> qpe = sl(st_.mla_qpe, n * H * R), kpe = sl(st_.mla_kpe, n * R);
  const std::span<float> c = sl(st_.mla_c, n * C);
  be_.copy_2d<float>(qf, D, N, qpe, R, 0, n * H, R);
  be_.copy_2d<float>(kv, W, C, kpe, R, 0, n, R);
  be_.copy_2d<float>(kv, W, 0, c, C, 0, n, C);
  be_.rope_qk(qpe, H, kpe, 1, n, R, batch_.pos, hp_.layers[static_cast<size_t>(il)].rope);
  norm_in_place(c, lw.kv_a_norm, C, hp_.rms_eps);

  // q_lat = attn_k_b[h] . q_nope[h]: each head's no-RoPE queries gathered into [n][nope] rows,
  // all heads' matmuls as one op.
  const std::span<float> hin = sl(st_.mla_in, H * n * std::max(N, C));
  const std::span<float> hout = sl(st_.mla_out, H * n * std::max(C, V));
  for (int64_t hh = 0; hh < H; ++hh)
    be_.copy_2d<float>(qf, H * D, hh * D, hin.subspan(static_cast<size_t>(hh * n * N)), N, 0, n, N);
  std::vector<Backend::MatmulTask>& tasks = st_.mla_tasks;
  std::vector<WeightMatrix>& heads = st_.mla_heads;  // per-head row views of attn_k_b / _v_b
  heads.resize(static_cast<size_t>(H));
  tasks.clear();
  for (int64_t hh = 0; hh < H; ++hh) {
    heads[static_cast<size_t>(hh)] = lw.wk_b.rows(hh * C, C);
    tasks.push_back({&heads[static_cast<size_t>(hh)],
                     hin.subspan(static_cast<size_t>(hh * n * N), static_cast<size_t>(n * N)),
                     hout.subspan(static_cast<size_t>(hh * n * C), static_cast<size_t>(n * C))});
  }
  be_.matmul_batch(tasks, n);

  // Assemble the absorbed queries [n][H][q_lat | q_pe] and the latent rows [n][c_kv | k_pe].
  const int64_t QW = H * W;
  for (int64_t hh = 0; hh < H; ++hh)
    be_.copy_2d<float>(hout.subspan(static_cast<size_t>(hh * n * C)), C, 0, q_, QW, hh * W, n, C);
  be_.copy_2d<float>(qpe, R, 0, q_, W, C, n * H, R);
  be_.copy_2d<float>(c, C, 0, k_, W, 0, n, C);
  be_.copy_2d<float>(kpe, R, 0, k_, W, C, n, R);
  rec(p + "Kcur", k_, n);

  // Per sequence: store the latent rows (K plane only), then MQA over them.
  std::vector<Backend::StoreRowsTask>& stores = st_.store_tasks;
  std::vector<AttentionArgs>& attns = st_.attn_args;
  stores.clear();
  attns.clear();
  const bool sparse =
      hp_.layers[static_cast<size_t>(il)].indexer != IndexerKind::None && !hp_.dsa_dense;
  for (const SeqSlice& sq : seqs_) {
    const LayerKv& kvl = sq.kv[il];
    const auto f = static_cast<size_t>(sq.first), cnt = static_cast<size_t>(sq.n_tok);
    KILN_CHECK(kvl.append_rows.size() == cnt && kvl.v.empty());
    stores.push_back({k_.subspan(f * W, cnt * W), W, kvl.append_rows, kvl.k});
    const auto first_sel = st_.sel_n.begin() + static_cast<std::ptrdiff_t>(f);
    if (sparse && std::any_of(first_sel, first_sel + static_cast<std::ptrdiff_t>(cnt),
                              [](int32_t k) { return k > 0; })) {
      // Sparse attention: each query over its own kept keys (any key of the list is visible
      // to it), or over every visible key where no more than top_k are.
      const auto K = static_cast<size_t>(hp_.dsa.top_k);
      for (size_t t = f; t < f + cnt; ++t) {
        AttentionArgs args;
        args.q = q_.subspan(t * QW, QW);
        args.k = kvl.k;
        args.v = kvl.k;
        const auto kept = static_cast<size_t>(st_.sel_n[t]);
        args.kv_rows =
            kept ? std::span<const int32_t>(st_.sel_rows).subspan(t * K, kept) : kvl.kv_rows;
        args.kv_pos =
            kept ? std::span<const int32_t>(st_.sel_pos).subspan(t * K, kept) : kvl.kv_pos;
        args.q_pos = batch_.pos.subspan(t, 1);
        args.n_q = 1;
        args.n_head = H;
        args.n_head_kv = 1;
        args.head_dim = W;
        args.scale = hp_.attn_scale;
        args.out = o_.subspan(t * QW, QW);
        attns.push_back(args);
      }
      continue;
    }
    AttentionArgs args;
    args.q = q_.subspan(f * QW, cnt * QW);
    args.k = kvl.k;
    args.v = kvl.k;
    args.kv_rows = kvl.kv_rows;
    args.kv_pos = kvl.kv_pos;
    args.q_pos = batch_.pos.subspan(f, cnt);
    args.n_q = sq.n_tok;
    args.n_head = H;
    args.n_head_kv = 1;
    args.head_dim = W;
    args.window = hp_.layers[static_cast<size_t>(il)].window;
    args.scale = hp_.attn_scale;
    args.out = o_.subspan(f * QW, cnt * QW);
    attns.push_back(args);
  }
  be_.store_rows_f16_batch(stores);
  be_.attention_batch(attns);

  // Out of the latent space: v[h] = attn_v_b[h] . (weighted c_kv of head h), heads side by
  // side as attn_output reads them.
  for (int64_t hh = 0; hh < H; ++hh)
    be_.copy_2d<float>(o_, QW, hh * W, hin.subspan(static_cast<size_t>(hh * n * C)), C, 0, n, C);
  tasks.clear();
  for (int64_t hh = 0; hh < H; ++hh) {
    heads[static_cast<size_t>(hh)] = lw.wv_b.rows(hh * V, V);
    tasks.push_back({&heads[static_cast<size_t>(hh)],
                     hin.subspan(static_cast<size_t>(hh * n * C), static_cast<size_t>(n * C)),
                     hout.subspan(static_cast<size_t>(hh * n * V), static_cast<size_t>(n * V))});
  }
  be_.matmul_batch(tasks, n);
  const std::span<float> ov = sl(st_.mla_ov, n * H * V);
  for (int64_t hh = 0; hh < H; ++hh)
    be_.copy_2d<float>(hout.subspan(static_cast<size_t>(hh * n * V)), V, 0, ov, H * V, hh * V, n,
                       V);
  rec(p + "kqv_out", ov, n);
  be_.matmul(lw.wo, ov, n, a_);
  hint(Hint::AfterAttention, il);
  be_.all_reduce_sum(a_);  // row-parallel: each rank holds its heads' share of the sum
  rec(p + "attn_out", a_, n);
  be_.add_rmsnorm(x_, a_, lw.ffn_norm, E_, hp_.rms_eps, h_);
  rec(p + "ffn_inp", x_, n);
  rec(p + "ffn_norm", h_, n);
}

// The lightning indexer of a full layer (HParams::dsa; the reference's indexer_select is the
// spec): the indexer queries from the q-LoRA rows, the key LayerNorm'd (eps 0, as llama.cpp
// runs it) and stored in the layer's indexer plane, both roped on each head's first n_rot
// dims, then per sequence the kept keys of every query (select_keys). llama.cpp's Hadamard
// rotation of q and k leaves their dot products as they are and is not applied. The key rows
// are read as an f16 weight matrix, which host backends (ref, cpu) take as it is; the CUDA
// runtime refuses sparse attention.
void ForwardPass::indexer_select(int32_t il, std::span<const float> qa) {
  const LayerDesc& L = hp_.layers[static_cast<size_t>(il)];
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  const DsaDims& d = hp_.dsa;
  const int64_t n = n_, Hi = d.n_head, Di = d.head_dim;
  const std::span<float> iq = sl(st_.idx_q, n * Hi * Di), ik = sl(st_.idx_k, n * Di);
  const std::span<float> iw = sl(st_.idx_w, n * Hi);
  be_.matmul(lw.idx_wq_b, qa, n, iq);
  const Backend::MatmulTask kw[] = {{&lw.idx_wk, h_, ik}, {&lw.idx_proj, h_, iw}};
  be_.matmul_batch(kw, n);

  // LayerNorm of the key rows on the host (a few values per token).
  std::vector<float>& kh = st_.idx_k_host;
  const std::span<const float> kv = host_view(ik, kh);
  if (kv.data() != kh.data()) kh.assign(kv.begin(), kv.end());
  for (int64_t t = 0; t < n; ++t) {
    float* row = kh.data() + t * Di;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < Di; ++i) mean += row[i];
    mean /= double(Di);
    for (int64_t i = 0; i < Di; ++i) var += (row[i] - mean) * (row[i] - mean);
    const double inv = 1.0 / std::sqrt(var / double(Di));
    for (int64_t i = 0; i < Di; ++i)
      row[i] = static_cast<float>((row[i] - mean) * inv * lw.idx_k_norm[static_cast<size_t>(i)] +
                                  lw.idx_k_nb[static_cast<size_t>(i)]);
  }
  be_.upload(std::span<const float>(kh), ik);
  be_.rope_qk(iq, Hi, ik, 1, n, Di, batch_.pos, L.rope);

  std::vector<Backend::StoreRowsTask>& stores = st_.idx_stores;
  stores.clear();
  for (const SeqSlice& sq : seqs_) {
    const LayerKv& kvl = sq.kv[il];
    KILN_CHECK(!kvl.idx_k.empty(), "layer {}: no indexer key plane", il);
    const auto f = static_cast<size_t>(sq.first), c = static_cast<size_t>(sq.n_tok);
    stores.push_back({ik.subspan(f * static_cast<size_t>(Di), c * static_cast<size_t>(Di)), Di,
                      kvl.append_rows, kvl.idx_k});
  }
  be_.store_rows_f16_batch(stores);
  const std::span<const float> wv = host_view(iw, st_.idx_w_host);
  if (wv.data() != st_.idx_w_host.data()) st_.idx_w_host.assign(wv.begin(), wv.end());
  for (const SeqSlice& sq : seqs_) select_keys(il, sq, iq);
}

// The kept keys of each query of one sequence: a query with more than top_k visible keys
// keeps the top_k of sum_h w_h ReLU(q_h . k) (w pre-scaled by 1 / sqrt(head_dim * n_head), as
// llama.cpp does), in key order; one with fewer keeps them all (sel_n 0). The dot products
// come from one matmul per chunk of queries, the key plane's rows as the weight rows.
void ForwardPass::select_keys(int32_t il, const SeqSlice& sq, std::span<const float> iq) {
  const DsaDims& d = hp_.dsa;
  const LayerKv& kvl = sq.kv[il];
  const int64_t Hi = d.n_head, Di = d.head_dim, K = d.top_k;
  int64_t n_rows = 0;
  for (int32_t r : kvl.kv_rows) n_rows = std::max<int64_t>(n_rows, r + 1);
  WeightMatrix keys;
  keys.dtype = DType::F16;
  keys.n_cols = Di;
  keys.n_rows = n_rows;
  keys.row_bytes = static_cast<size_t>(Di) * sizeof(f16);
  keys.bytes = std::as_bytes(kvl.idx_k.first(static_cast<size_t>(n_rows * Di)));
  // Queries per matmul: their dot products stay within 2^24 floats (64 MiB).
  const int64_t chunk =
      std::max<int64_t>(1, (int64_t{1} << 24) / std::max<int64_t>(1, Hi * n_rows));
  const float w_scale = 1.0f / std::sqrt(float(Di * Hi));
  for (int64_t t0 = sq.first; t0 < sq.first + sq.n_tok; t0 += chunk) {
    const int64_t t1 = std::min<int64_t>(t0 + chunk, sq.first + sq.n_tok);
    bool any = false;
    auto visible = [&](int64_t t) {
      const int32_t p = batch_.pos[static_cast<size_t>(t)];
      return static_cast<int64_t>(std::upper_bound(kvl.kv_pos.begin(), kvl.kv_pos.end(), p) -
                                  kvl.kv_pos.begin());
    };
    for (int64_t t = t0; t < t1; ++t) {
      st_.sel_n[static_cast<size_t>(t)] = 0;
      any = any || visible(t) > K;
    }
    if (!any) continue;
    const size_t n_dots = static_cast<size_t>((t1 - t0) * Hi * n_rows);
    // Grown to a power of two: a decode step needs one key row more than the last one.
    if (st_.idx_dots.size() < n_dots) st_.idx_dots = be_.alloc<float>(std::bit_ceil(n_dots));
    const std::span<float> dots = sl(st_.idx_dots, static_cast<int64_t>(n_dots));
    be_.matmul(
        keys,
        iq.subspan(static_cast<size_t>(t0 * Hi * Di), static_cast<size_t>((t1 - t0) * Hi * Di)),
        (t1 - t0) * Hi, dots);
    const std::span<const float> dh = host_view(dots, st_.idx_dots_host);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t vis = visible(t);
      if (vis <= K) continue;
      const float* w = st_.idx_w_host.data() + t * Hi;
      std::vector<std::pair<float, int32_t>>& scored = st_.sel_scored;
      // Head by head over the keys: each head's dot products are one contiguous row.
      std::vector<float>& sum = st_.sel_sum;
      sum.assign(static_cast<size_t>(vis), 0.0f);
      for (int64_t hh = 0; hh < Hi; ++hh) {
        const float wh = w[hh] * w_scale;
        const float* row = dh.data() + ((t - t0) * Hi + hh) * n_rows;
        for (int64_t j = 0; j < vis; ++j)
          sum[static_cast<size_t>(j)] +=
              wh * std::max(0.0f, row[kvl.kv_rows[static_cast<size_t>(j)]]);
      }
      scored.resize(static_cast<size_t>(vis));
      for (int64_t j = 0; j < vis; ++j)
        scored[static_cast<size_t>(j)] = {sum[static_cast<size_t>(j)], static_cast<int32_t>(j)};
      // Best first; equal scores (keys whose heads all gave 0 after the ReLU) to the earlier
      // key, as the reference breaks them.
      std::nth_element(scored.begin(), scored.begin() + K - 1, scored.end(),
                       [](const auto& a, const auto& b) {
                         return a.first > b.first || (a.first == b.first && a.second < b.second);
                       });
      std::sort(scored.begin(), scored.begin() + K,
                [](const auto& a, const auto& b) { return a.second < b.second; });
      for (int64_t i = 0; i < K; ++i) {
        const auto j = static_cast<size_t>(scored[static_cast<size_t>(i)].second);
        st_.sel_rows[static_cast<size_t>(t * K + i)] = kvl.kv_rows[j];
        st_.sel_pos[static_cast<size_t>(t * K + i)] = kvl.kv_pos[j];
      }
      st_.sel_n[static_cast<size_t>(t)] = static_cast<int32_t>(K);
    }
  }
}

// FFN-normalised rows h -> the FFN's output in a.
void ForwardPass::dense_ffn_block(int32_t il) {
  const LayerDesc& L = hp_.layers[static_cast<size_t>(il)];
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  gated_ffn(lw.ffn_gate, lw.ffn_up, lw.ffn_down, L.n_ff, h_, a_,
            [&] { hint(Hint::AfterGateUp, il); });
}

// down(act(gate(in)) * up(in)) for the batch's n rows into out, with the architecture's
// activation; `after_gate_up` runs between the first matmuls and the down projection.
template <typename AfterGateUp>
void ForwardPass::gated_ffn(const WeightMatrix& wg, const WeightMatrix& wu, const WeightMatrix& wd,
                            int64_t width, std::span<const float> in, std::span<float> out,
                            AfterGateUp after_gate_up) {
  const int64_t n = n_;
  const std::span<float> fg = sl(st_.ff_gate, n * width), fu = sl(st_.ff_up, n * width);
  const std::span<float> fa = sl(st_.ff_act, n * width);
  const Backend::MatmulTask gate_up[] = {{&wg, in, fg}, {&wu, in, fu}};
  be_.matmul_batch(gate_up, n);
  after_gate_up();
  if (hp_.arch->act == FfnAct::Silu) {
    be_.swiglu_matmul(wd, fg, fu, n, fa, out);  // fa: scratch, maybe unwritten
  } else {
    ffn_act(fg, fu, fa);
    be_.matmul(wd, fa, n, out);
  }
}

// Mixture-of-experts FFN: route each row, then per expert gather the rows that chose it and
// run its gate/up/down as matmuls on that expert's slice of the stacked tensors.
void ForwardPass::moe_ffn_block(int32_t il) {
  const LayerDesc& L = hp_.layers[static_cast<size_t>(il)];
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  const int64_t n_tok = n_, E = E_;
  const std::span<const float> in = h_;
  const std::span<float> out = a_;
  KILN_CHECK(w_.experts != nullptr, "layer {} has experts but the model no ExpertSource", il);
  const int64_t X = L.n_expert, K = L.n_expert_used, F = L.n_ff_expert;
  const std::span<float> prob = sl(st_.router, n_tok * X);
  be_.matmul(lw.ffn_gate_inp, in, n_tok, prob);
  if (batch_.capture) rec(fmt::format("blk.{}.ffn_moe_logits", il), prob, n_tok);
  if (!lw.ffn_gate_inp_b.empty())
    for (int64_t t = 0; t < n_tok; ++t) {
      const auto row = prob.subspan(static_cast<size_t>(t * X), static_cast<size_t>(X));
      be_.add(row, lw.ffn_gate_inp_b, row);
    }
  if (hp_.router.gating == GatingFunc::Sigmoid)
    be_.sigmoid(prob);
  else
    be_.softmax(prob, X);
  const std::span<int32_t> sel(st_.sel_e.data(), static_cast<size_t>(n_tok * K));
  const std::span<float> sel_w(st_.sel_w.data(), static_cast<size_t>(n_tok * K));
  // The routing decision is made on the host (one download per MoE layer on a GPU).
  const std::span<const float> prob_h = host_view(prob, st_.router_host);
  for (int64_t t = 0; t < n_tok; ++t) {
    const std::span<int32_t> ids = sel.subspan(t * K, K);
    const std::span<float> wts = sel_w.subspan(t * K, K);
    if (hp_.routing.active()) {
      // The override draws the experts; the model's weight scale still applies.
      override_route(hp_.routing, il, batch_.pos[t], batch_.tokens[t], prob_h.subspan(t * X, X),
                     ids, wts);
      for (float& wt : wts) wt *= hp_.router.weights_scale;
    } else {
      route_experts(hp_.router, prob_h.subspan(t * X, X), lw.exp_probs_b, ids, wts);
    }
  }
  w_.experts->will_need(il, sel);  // a streaming store loads the misses in parallel
  be_.zero(out);
  if (n_tok == 1)
    moe_one_token(il, X, K, F, in, out);
  else if (n_tok <= kFewTokenMoe && be_.groups_few_token_experts())
    moe_few_tokens(il, X, K, F, in, out);
  else
    moe_experts_batch(il, X, K, F, in, out);
  // Shared experts: a dense FFN of the same normalised rows, added to the routed sum (in
  // llama.cpp's order: routed first). Under tensor parallelism its width is split like a dense
  // FFN's and the all-reduce in layer_end adds the ranks' shares.
  if (L.n_ff_shexp > 0) {
    const std::span<float> y = sl(st_.moe_out, n_tok * E);
    gated_ffn(lw.ffn_gate_shexp, lw.ffn_up_shexp, lw.ffn_down_shexp, L.n_ff_shexp, in, y, [] {});
    be_.add(out, y, out);
  }
}

// The general MoE path: per expert, the rows routed to it gathered, its gate/up/down as
// matmuls on that expert's slice of the stacked tensors, the weighted rows added back.
void ForwardPass::moe_experts_batch(int32_t il, int64_t X, int64_t K, int64_t F,
                                    std::span<const float> in, std::span<float> out) {
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  const int64_t E = E_;
  for (int32_t e = 0; e < X; ++e) {
    if (!hp_.owns_expert(e, static_cast<int32_t>(X))) continue;  // another rank's
    const int64_t m = routed_rows(e, K);
    if (m == 0) continue;
    const std::span<const int32_t> toks(st_.moe_rows.data(), static_cast<size_t>(m));
    const std::span<float> xin = sl(st_.moe_in, m * E), y = sl(st_.moe_out, m * E);
    be_.gather_rows(in, E, toks, xin);
    const moe::ExpertWeights ew = w_.experts->get(il, e);
    expert_bytes_used().add(expert_bytes(ew));
    const std::span<float> fg = sl(st_.ff_gate, m * F), fu = sl(st_.ff_up, m * F);
    const std::span<float> fa = sl(st_.ff_act, m * F);
    be_.matmul(ew.gate, xin, m, fg);
    be_.matmul(ew.up, xin, m, fu);
    add_expert_bias(fg, lw.ffn_gate_exps_b, e, F, m);
    add_expert_bias(fu, lw.ffn_up_exps_b, e, F, m);
    ffn_act(fg, fu, fa);
    be_.matmul(ew.down, fa, m, y);
    add_expert_bias(y, lw.ffn_down_exps_b, e, E, m);
    // A token routes to an expert once (route_experts and override_route pick distinct ids),
    // so the rows' tokens are distinct, as scale_add_rows requires (and checks).
    be_.scale_add_rows(y, E, toks, std::span<const float>(st_.moe_row_w.data(), size_t(m)), out);
  }
}

// A few tokens where the backend groups them (Backend::groups_few_token_experts; a speculative
// verify step, a few sequences decoding together):
// the general path's arithmetic with fewer, larger ops. The experts any token chose, by
// ascending id, in chunks of at most K (the pins a streaming store guarantees, and the scratch
// of the one-token path): each chunk's gate and up matvecs over all the step's tokens as one
// batch op (one activation quantization, grouped launches; the rows of tokens that did not
// choose an expert are computed and left unused), the activation over the chunk at once, then
// per expert the routed rows of that activation gathered, its down matmul and the weighted add
// back, as the general path does. Same bits as the general path: the device matvecs give each
// token's row the bits of a one-token call (batch-invariant kernels; CudaSpec.
// VerifyBatchHasTheDecodeStepsBits checks a verify step against decode steps), the activation
// is elementwise, and the experts are added in ascending id as there (ResidentAlloc's
// qwen3moe case runs it on the CPU kernels behind an emulated device: its prompt's last chunk is
// 8 tokens, compared bit for bit with host memory's general path). What it saves on a GPU: the
// per-expert gather of the inputs and 2 of every expert's 3 matmul launches, each with its own
// quantization. Host backends keep the general path: on the CPU the unused rows cost more than
// the ops saved (an MTP verify of 5 tokens on the GLM4MOE shape: docs/BENCHMARKS.md, session 36).
void ForwardPass::moe_few_tokens(int32_t il, int64_t X, int64_t K, int64_t F,
                                 std::span<const float> in, std::span<float> out) {
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  const int64_t n_tok = n_, E = E_;
  const std::span<const int32_t> sel(st_.sel_e.data(), static_cast<size_t>(n_tok * K));
  std::vector<int32_t>& ids = st_.moe_order;  // the chosen experts this rank owns, ascending
  ids.clear();
  for (const int32_t e : sel)
    if (hp_.owns_expert(e, static_cast<int32_t>(X))) ids.push_back(e);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  // Chunk: K experts' gate/up/act rows of every token must fit the FFN scratch (sized for the
  // one-token path's K * F and the batch's B * n_ff): fewer experts a chunk where they do not.
  const auto per_expert = static_cast<size_t>(n_tok * F);
  const auto chunk = static_cast<int64_t>(
      std::min<size_t>(static_cast<size_t>(K), st_.ff_gate.size() / per_expert));
  KILN_CHECK(chunk >= 1, "moe_few_tokens: FFN scratch below one expert's {} rows", n_tok);
  auto part = [](std::span<float> s, int64_t i, int64_t width) {
    return s.subspan(static_cast<size_t>(i * width), static_cast<size_t>(width));
  };
  std::vector<Backend::MatmulTask>& tasks = st_.moe_tasks;
  for (size_t c0 = 0; c0 < ids.size(); c0 += static_cast<size_t>(chunk)) {
    const auto n_c = static_cast<int64_t>(std::min(ids.size() - c0, static_cast<size_t>(chunk)));
    st_.moe_held.clear();
    for (int64_t i = 0; i < n_c; ++i) {
      st_.moe_held.push_back(w_.experts->get(il, ids[c0 + static_cast<size_t>(i)]));
      expert_bytes_used().add(expert_bytes(st_.moe_held.back()));
    }
    const int64_t rows = n_c * n_tok;  // expert i's rows: [i * n_tok, (i + 1) * n_tok)
    const std::span<float> fg = sl(st_.ff_gate, rows * F), fu = sl(st_.ff_up, rows * F);
    const std::span<float> fa = sl(st_.ff_act, rows * F);
    tasks.clear();
    for (int64_t i = 0; i < n_c; ++i) {
      tasks.push_back({&st_.moe_held[i].gate, in, part(fg, i, n_tok * F)});
      tasks.push_back({&st_.moe_held[i].up, in, part(fu, i, n_tok * F)});
    }
    be_.matmul_batch(tasks, n_tok);
    for (int64_t i = 0; i < n_c; ++i) {
      const int32_t e = ids[c0 + static_cast<size_t>(i)];
      add_expert_bias(part(fg, i, n_tok * F), lw.ffn_gate_exps_b, e, F, n_tok);
      add_expert_bias(part(fu, i, n_tok * F), lw.ffn_up_exps_b, e, F, n_tok);
    }
    ffn_act(fg, fu, fa);
    for (int64_t i = 0; i < n_c; ++i) {
      const int32_t e = ids[c0 + static_cast<size_t>(i)];
      const int64_t m = routed_rows(e, K);
      const std::span<const int32_t> toks(st_.moe_rows.data(), static_cast<size_t>(m));
      const std::span<float> xin = sl(st_.ff_gate, m * F), y = sl(st_.moe_out, m * E);
      be_.gather_rows(part(fa, i, n_tok * F), F, toks, xin);  // fg is spent: its scratch
      be_.matmul(st_.moe_held[i].down, xin, m, y);
      add_expert_bias(y, lw.ffn_down_exps_b, e, E, m);
      be_.scale_add_rows(y, E, toks, std::span<const float>(st_.moe_row_w.data(), size_t(m)), out);
    }
  }
  st_.moe_held.clear();  // releases the pins
}

// One token's experts (a decode step): all K gate and up matvecs as one backend op, the
// activation over the K slices at once, all K down matvecs as one op, then the weighted sum.
// Per expert this is the general path's arithmetic, and the experts are added in ascending id
// as there, so the result is bit-identical; what it saves is 3K small ops (a thread hand-off
// each) and the row gather. Holds the K experts' pins together (moe/expert_store.h guarantees
// a cap of at least the experts one token needs).
void ForwardPass::moe_one_token(int32_t il, int64_t n_expert, int64_t n_sel, int64_t F,
                                std::span<const float> in, std::span<float> out) {
  const int64_t E = E_;
  std::vector<int32_t>& order = st_.moe_order;  // slots by ascending expert id
  order.clear();
  // A tensor-parallel rank computes only the selected experts it owns; the all-reduce after
  // the FFN adds the other ranks' (the routing is the same on every rank: the same router on
  // the same all-reduced input).
  for (int32_t i = 0; i < n_sel; ++i)
    if (hp_.owns_expert(st_.sel_e[i], static_cast<int32_t>(n_expert))) order.push_back(i);
  const auto K = static_cast<int64_t>(order.size());
  if (K == 0) return;
  std::sort(order.begin(), order.end(),
            [&](int32_t a, int32_t b) { return st_.sel_e[a] < st_.sel_e[b]; });
  st_.moe_held.clear();
  for (int32_t slot : order) {
    st_.moe_held.push_back(w_.experts->get(il, st_.sel_e[slot]));
    expert_bytes_used().add(expert_bytes(st_.moe_held.back()));
  }
  const std::span<float> fg = sl(st_.ff_gate, K * F), fu = sl(st_.ff_up, K * F);
  const std::span<float> fa = sl(st_.ff_act, K * F), y = sl(st_.moe_out, K * E);
  auto part = [](std::span<float> s, int64_t i, int64_t width) {
    return s.subspan(static_cast<size_t>(i * width), static_cast<size_t>(width));
  };
  std::vector<Backend::MatmulTask>& tasks = st_.moe_tasks;
  tasks.clear();
  for (int64_t i = 0; i < K; ++i) {
    tasks.push_back({&st_.moe_held[i].gate, in, part(fg, i, F)});
    tasks.push_back({&st_.moe_held[i].up, in, part(fu, i, F)});
  }
  be_.matmul_batch(tasks, 1);
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  for (int64_t i = 0; i < K; ++i) {
    const int32_t e = st_.sel_e[order[i]];
    add_expert_bias(part(fg, i, F), lw.ffn_gate_exps_b, e, F, 1);
    add_expert_bias(part(fu, i, F), lw.ffn_up_exps_b, e, F, 1);
  }
  ffn_act(fg, fu, fa);
  tasks.clear();
  for (int64_t i = 0; i < K; ++i)
    tasks.push_back({&st_.moe_held[i].down, part(fa, i, F), part(y, i, E)});
  be_.matmul_batch(tasks, 1);
  for (int64_t i = 0; i < K; ++i) {
    add_expert_bias(part(y, i, E), lw.ffn_down_exps_b, st_.sel_e[order[i]], E, 1);
    be_.scale(part(y, i, E), st_.sel_w[order[i]]);
    be_.add(out, part(y, i, E), out);
  }
  st_.moe_held.clear();  // releases the pins
}

// The FFN output a -> added to the residual stream x, and (but after the last layer) the
// next layer's attn_norm into h.
void ForwardPass::layer_end(int32_t il) {
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  const std::string p = prefix(il);
  hint(Hint::LayerEnd, il);
  be_.all_reduce_sum(a_);  // row-parallel down / this rank's experts
  if (!lw.post_ffn_norm.empty()) norm_in_place(a_, lw.post_ffn_norm, E_, hp_.post_norm_eps);
  rec(p + "ffn_out", a_, n_);
  // The FFN's residual add with the next layer's attn_norm (h is free again: the FFN has
  // consumed it); the last layer's output norm runs on a subset of rows in output_head.
  if (il + 1 < hp_.n_layer) {
    be_.add_rmsnorm(x_, a_, w_.layers[static_cast<size_t>(il) + 1].attn_norm, E_, hp_.rms_eps, h_);
  } else {
    be_.add(x_, a_, x_);
  }
  rec(p + "l_out", x_, n_);
}

void ForwardPass::output_head() {
  const int64_t n = n_, E = E_, n_out = n_out_;
  // Only the rows whose logits are wanted go through the output head: every row, the last
  // one, or with several sequences the rows each asks for, gathered into scratch.
  std::span<const float> last = x_.subspan(static_cast<size_t>((n - n_out) * E));
  if (n_out != n && seqs_.size() > 1) {
    int64_t o_row = 0;
    for (const SeqSlice& sq : seqs_) {
      const int64_t first = batch_.all_logits || sq.all_logits ? sq.first : sq.first + sq.n_tok - 1;
      const auto rows = x_.subspan(static_cast<size_t>(first * E),
                                   static_cast<size_t>((sq.first + sq.n_tok - first) * E));
      be_.copy(std::span<const float>(rows), a_.subspan(static_cast<size_t>(o_row * E)));
      o_row += sq.first + sq.n_tok - first;
    }
    last = a_.subspan(0, static_cast<size_t>(n_out * E));
  }
  const std::span<float> hn = h_.subspan(0, static_cast<size_t>(n_out * E));
  be_.rmsnorm(last, w_.output_norm, E, hp_.rms_eps, hn);
  rec("result_norm", hn, n_out);
  // Device backends compute the logits in their memory and download them once per step (the
  // step's only synchronisation); host backends write the caller's span directly.
  std::span<float> out = logits_;
  if (on_device_) {
    if (st_.n_logits_ < logits_.size()) {
      st_.logits = be_.alloc<float>(logits_.size());
      st_.n_logits_ = logits_.size();
    }
    out = sl(st_.logits, static_cast<int64_t>(logits_.size()));
  }
  be_.matmul(w_.output, hn, n_out, out);
  if (hp_.logit_scale != 1.0f) be_.scale(out, hp_.logit_scale);
  if (hp_.final_softcap > 0) be_.softcap(out, hp_.final_softcap);
  // top_k checks that top_ids/top_vals hold n_out rows of top_k.
  if (batch_.top_k > 0)
    be_.top_k(std::span<const float>(out), hp_.n_vocab, batch_.top_k, batch_.top_ids,
              batch_.top_vals);
  const bool rec_logits = batch_.capture && batch_.capture->wants("result_output");
  if (on_device_ && (batch_.top_k == 0 || rec_logits))
    be_.download(std::span<const float>(out), logits_);
  // logits_ is host memory here (downloaded above on a device): a host copy.
  if (rec_logits) batch_.capture->record("result_output", logits_, n_out);
}

void forward(const HParams& hp, const Weights& w, Backend& be, ForwardState& st,
             const ForwardBatch& batch, std::span<float> logits) {
  ForwardPass(hp, w, be, st, batch, logits).run();
}

namespace {

// NextN block i's experts are layer i of Weights::nextn_experts; its one-layer view runs it
// as layer 0.
class OffsetExperts final : public moe::ExpertSource {
 public:
  OffsetExperts(moe::ExpertSource& src, int32_t offset) : src_(src), offset_(offset) {}
  moe::ExpertWeights get(int32_t layer, int32_t expert) override {
    return src_.get(layer + offset_, expert);
  }
  int32_t n_layer() const override { return 1; }
  int32_t n_expert(int32_t layer) const override { return src_.n_expert(layer + offset_); }
  void will_need(int32_t layer, std::span<const int32_t> experts) override {
    src_.will_need(layer + offset_, experts);
  }

 private:
  moe::ExpertSource& src_;
  int32_t offset_;
};

}  // namespace

void forward_nextn(const HParams& hp, const Weights& w, int32_t nextn, Backend& be,
                   ForwardState& st, const ForwardBatch& batch, std::span<const float> hidden,
                   std::span<float> logits, std::span<float> hidden_out) {
  KILN_CHECK(nextn >= 0 && static_cast<size_t>(nextn) < hp.nextn_layers.size() &&
                 w.nextn.size() == hp.nextn_layers.size(),
             "NextN block {} of {}", nextn, hp.nextn_layers.size());
  const NextnWeights& nw = w.nextn[static_cast<size_t>(nextn)];
  // A one-layer model: the block as layer 0, the NextN embedding and head in place of the
  // model's (views only; nothing is copied but spans).
  HParams vh = hp;
  vh.n_layer = 1;
  vh.layers.assign(1, hp.nextn_layers[static_cast<size_t>(nextn)]);
  vh.nextn_layers.clear();
  Weights vw;
  vw.token_embd = nw.embed_tokens.n_rows > 0 ? nw.embed_tokens : w.token_embd;
  vw.output_norm = nw.shared_head_norm;
  vw.output = nw.shared_head_head.n_rows > 0 ? nw.shared_head_head : w.output;
  vw.rope_freqs = w.rope_freqs;
  vw.rope_long = w.rope_long;
  vw.rope_short = w.rope_short;
  vw.layers.assign(1, nw.layer);
  std::optional<OffsetExperts> experts;
  if (w.nextn_experts) {
    experts.emplace(*w.nextn_experts, nextn);
    vw.experts = std::shared_ptr<moe::ExpertSource>(&*experts, [](moe::ExpertSource*) {});
  }
  ForwardPass pass(vh, vw, be, st, batch, logits);
  pass.set_nextn(&nw, hidden, hidden_out);
  pass.run();
}

}  // namespace kiln::model
