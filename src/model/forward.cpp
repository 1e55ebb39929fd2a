// model/forward.cpp: the fast forward pass (see forward.h). Every arithmetic step is a
// Backend op; this file only sequences them and slices the scratch buffers.
#include "model/forward.h"

#include <algorithm>
#include <string>

#include "core/check.h"
#include "core/counters.h"

namespace kiln::model {

ForwardState::ForwardState(const HParams& hp, int32_t max_batch) : max_batch_(max_batch) {
  KILN_CHECK(max_batch > 0);
  int64_t n_ff = 0, n_expert = 0, n_used = 0;
  for (const LayerDesc& L : hp.layers) {
    n_ff = std::max<int64_t>({n_ff, L.n_ff, L.n_ff_expert});
    n_expert = std::max<int64_t>(n_expert, L.n_expert);
    n_used = std::max<int64_t>(n_used, L.n_expert_used);
  }
  const size_t B = static_cast<size_t>(max_batch);
  n_x_ = B * hp.n_embd;
  n_q_ = B * hp.q_width();
  n_k_ = B * hp.k_width();
  n_v_ = B * hp.v_width();
  n_o_ = B * hp.o_width();
  n_ff_ = B * n_ff;
  n_tmp_ = B * std::max<int64_t>({hp.n_embd, hp.q_width(), hp.k_width()});
  if (n_expert > 0) {
    n_router_ = B * n_expert;
    n_moe_ = std::max<size_t>(B, n_used) * hp.n_embd;
    // The one-token path keeps its n_used experts' FFN activations side by side.
    n_ff_ = std::max<size_t>(n_ff_, n_used * n_ff);
    sel_w.resize(B * n_used);
    sel_e.resize(B * n_used);
    moe_rows.resize(B * n_used);
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
  logits = {};
  n_logits_ = 0;
}

namespace {

// Bytes of expert weights the forward passes computed with: each selected expert's three
// slices once per step (kiln bench divides it by the tokens decoded: bytes per token).
Counter& expert_bytes_used() {
  static Counter& c = process_counters().counter("moe.expert_bytes_used");
  return c;
}

uint64_t expert_bytes(const moe::ExpertWeights& ew) {
  return ew.gate.bytes.size() + ew.up.bytes.size() + ew.down.bytes.size();
}

// Top-k of one token's router probabilities, weights renormalised over the chosen k
// (llama.cpp's softmax gating with norm_w). Ties go to the lower expert id.
void select_experts(std::span<const float> prob, std::span<int32_t> ids, std::span<float> wts) {
  const int32_t n_expert = static_cast<int32_t>(prob.size());
  const size_t k = ids.size();
  int32_t all[4096];  // read_hparams caps expert_count at 4096
  KILN_CHECK(n_expert <= 4096 && k <= static_cast<size_t>(n_expert));
  for (int32_t e = 0; e < n_expert; ++e) all[e] = e;
  std::partial_sort(all, all + k, all + n_expert, [&](int32_t a, int32_t b) {
    return prob[a] > prob[b] || (prob[a] == prob[b] && a < b);
  });
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += prob[all[i]];
  for (size_t i = 0; i < k; ++i) {
    ids[i] = all[i];
    wts[i] = static_cast<float>(prob[all[i]] / sum);
  }
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
  void attention_block(int32_t il);
  void dense_ffn_block(int32_t il);
  void moe_ffn_block(int32_t il);
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
  void rec(const std::string& name, std::span<const float> data, int64_t rows) {
    if (batch_.capture && batch_.capture->wants(name))
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
  o_ = sl(st.o, n * hp.o_width());
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
      return hint_weights({&lw.wq, &lw.wk, &lw.wv}, n_);
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
        return hint_weights({&nw.wq, &nw.wk, &nw.wv, &nw.wo}, n_);
      }
      if (want_logits_) hint_weights({&w_.output}, n_out_);  // the head reads n_out rows
      return;
  }
}

void ForwardPass::run() {
  if (batch_.capture) batch_.capture->clear();
  hint(Hint::Start, 0);
  embed();
  for (int32_t il = 0; il < hp_.n_layer; ++il) {
    attention_block(il);
    if (hp_.layers[static_cast<size_t>(il)].n_expert > 0)
      moe_ffn_block(il);
    else
      dense_ffn_block(il);
    layer_end(il);
  }
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

// FFN-normalised rows h -> the FFN's output in a.
void ForwardPass::dense_ffn_block(int32_t il) {
  const LayerDesc& L = hp_.layers[static_cast<size_t>(il)];
  const LayerWeights& lw = w_.layers[static_cast<size_t>(il)];
  const int64_t n = n_;
  const std::span<float> fg = sl(st_.ff_gate, n * L.n_ff), fu = sl(st_.ff_up, n * L.n_ff);
  const std::span<float> fa = sl(st_.ff_act, n * L.n_ff);
  const Backend::MatmulTask gate_up[] = {{&lw.ffn_gate, h_, fg}, {&lw.ffn_up, h_, fu}};
  be_.matmul_batch(gate_up, n);
  hint(Hint::AfterGateUp, il);
  if (hp_.arch->act == FfnAct::Silu) {
    be_.swiglu_matmul(lw.ffn_down, fg, fu, n, fa, a_);  // fa: scratch, maybe unwritten
  } else {
    ffn_act(fg, fu, fa);
    be_.matmul(lw.ffn_down, fa, n, a_);
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
  be_.softmax(prob, X);
  const std::span<int32_t> sel(st_.sel_e.data(), static_cast<size_t>(n_tok * K));
  const std::span<float> sel_w(st_.sel_w.data(), static_cast<size_t>(n_tok * K));
  // The routing decision is made on the host (one download per MoE layer on a GPU).
  const std::span<const float> prob_h = host_view(prob, st_.router_host);
  for (int64_t t = 0; t < n_tok; ++t) {
    if (hp_.routing.active())
      override_route(hp_.routing, il, batch_.pos[t], batch_.tokens[t], prob_h.subspan(t * X, X),
                     sel.subspan(t * K, K), sel_w.subspan(t * K, K));
    else
      select_experts(prob_h.subspan(t * X, X), sel.subspan(t * K, K), sel_w.subspan(t * K, K));
  }
  w_.experts->will_need(il, sel);  // a streaming store loads the misses in parallel
  be_.zero(out);
  if (n_tok == 1) {
    moe_one_token(il, X, K, F, in, out);
    return;
  }
  for (int32_t e = 0; e < X; ++e) {
    if (!hp_.owns_expert(e, static_cast<int32_t>(X))) continue;  // another rank's
    int64_t m = 0;  // rows routed to e; moe_rows holds their (token * K + slot)
    for (int64_t j = 0; j < n_tok * K; ++j)
      if (sel[j] == e) st_.moe_rows[m++] = static_cast<int32_t>(j);
    if (m == 0) continue;
    const std::span<float> xin = sl(st_.moe_in, m * E), y = sl(st_.moe_out, m * E);
    for (int64_t i = 0; i < m; ++i) {
      const auto src = in.subspan(static_cast<size_t>(st_.moe_rows[i] / K * E), E);
      be_.copy(src, xin.subspan(static_cast<size_t>(i * E), static_cast<size_t>(E)));
    }
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
    for (int64_t i = 0; i < m; ++i) {
      const int32_t j = st_.moe_rows[i];
      const std::span<float> yr = y.subspan(static_cast<size_t>(i * E), E);
      be_.scale(yr, sel_w[j]);
      const std::span<float> orow = out.subspan(static_cast<size_t>(j / K * E), E);
      be_.add(orow, yr, orow);
    }
  }
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
  if (on_device_ && (batch_.top_k == 0 || batch_.capture))
    be_.download(std::span<const float>(out), logits_);
  rec("result_output", logits_, n_out);
}

void forward(const HParams& hp, const Weights& w, Backend& be, ForwardState& st,
             const ForwardBatch& batch, std::span<float> logits) {
  ForwardPass(hp, w, be, st, batch, logits).run();
}

}  // namespace kiln::model
