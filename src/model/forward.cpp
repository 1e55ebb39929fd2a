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


void forward(const HParams& hp, const Weights& w, Backend& be, ForwardState& st,
             const ForwardBatch& batch, std::span<float> logits) {
  const int64_t n = static_cast<int64_t>(batch.tokens.size());
  KILN_CHECK(n > 0 && n <= st.max_batch_, "batch of {} tokens, max {}", n, st.max_batch_);
  KILN_CHECK(static_cast<int64_t>(batch.pos.size()) == n);
  const int64_t E = hp.n_embd;
  // One sequence is the multi-sequence case with a single slice over the whole batch.
  const SeqSlice whole{0, static_cast<int32_t>(n), batch.kv};
  const std::span<const SeqSlice> seqs =
      batch.seqs.empty() ? std::span<const SeqSlice>(&whole, 1) : batch.seqs;
  for (size_t i = 0, next = 0; i < seqs.size(); ++i) {
    KILN_CHECK(seqs[i].first == static_cast<int32_t>(next) && seqs[i].n_tok > 0,
               "sequence {} covers tokens [{}, +{}), expected to start at {}", i,
               seqs[i].first, seqs[i].n_tok, next);
    KILN_CHECK(static_cast<int32_t>(seqs[i].kv.size()) == hp.n_layer);
    next += static_cast<size_t>(seqs[i].n_tok);
    if (i + 1 == seqs.size()) KILN_CHECK(static_cast<int64_t>(next) == n);
  }
  const int64_t n_seq = static_cast<int64_t>(seqs.size());
  int64_t n_out = 0;
  for (const SeqSlice& sq : seqs) n_out += batch.all_logits || sq.all_logits ? sq.n_tok : 1;
  // No logits: a tensor-parallel rank other than 0, which skips the (replicated) output head.
  const bool want_logits = !logits.empty();
  KILN_CHECK(want_logits ? static_cast<int64_t>(logits.size()) == n_out * hp.n_vocab
                         : hp.tp_rank != 0,
             "logits of {} floats for {} rows", logits.size(), n_out);

  st.bind(be);
  // Scratch spans are backend memory (device memory on a GPU); host code reads them only
  // through host_view, which downloads on device backends and is the span itself elsewhere.
  const bool on_device = be.device_memory();
  auto sl = [](auto& buf, int64_t count) {
    return std::span<float>(buf.data(), static_cast<size_t>(count));
  };
  auto host_view = [&](std::span<const float> data, std::vector<float>& mirror) {
    if (!on_device) return data;
    mirror.resize(data.size());
    be.download(data, std::span<float>(mirror));
    return std::span<const float>(mirror);
  };
  auto rec = [&](const std::string& name, std::span<const float> data, int64_t rows) {
    if (batch.capture) batch.capture->record(name, host_view(data, st.capture_host), rows);
  };
  auto add_bias = [&](std::span<float> y, std::span<const float> b) {
    if (b.empty()) return;
    for (int64_t t = 0; t < n; ++t) {
      std::span<float> row = y.subspan(static_cast<size_t>(t) * b.size(), b.size());
      be.add(row, b, row);
    }
  };

  // Backend::rmsnorm does not promise that x and y may alias; go through scratch.
  auto norm_in_place = [&](std::span<float> y, std::span<const float> wt, int64_t width, float eps) {
    const std::span<float> t = sl(st.tmp, static_cast<int64_t>(y.size()));
    be.rmsnorm(y, wt, width, eps, t);
    be.copy(std::span<const float>(t), y);
  };

  // One token's experts (a decode step): all K gate and up matvecs as one backend op, the
  // activation over the K slices at once, all K down matvecs as one op, then the weighted
  // sum. Per expert this is the general path's arithmetic, and the experts are added in
  // ascending id as there, so the result is bit-identical; what it saves is 3K small ops
  // (a thread hand-off each) and the row gather. Holds the K experts' pins together
  // (moe/expert_store.h guarantees a cap of at least the experts one token needs).
  auto moe_one_token = [&](int32_t il, int64_t n_expert, int64_t n_sel, int64_t F,
                           std::span<const float> in, std::span<float> out) {
    std::vector<int32_t>& order = st.moe_order;  // slots by ascending expert id
    order.clear();
    // A tensor-parallel rank computes only the selected experts it owns; the all-reduce
    // after the FFN adds the other ranks' (the routing is the same on every rank: the same
    // router on the same all-reduced input).
    for (int32_t i = 0; i < n_sel; ++i)
      if (hp.owns_expert(st.sel_e[i], static_cast<int32_t>(n_expert))) order.push_back(i);
    const auto K = static_cast<int64_t>(order.size());
    if (K == 0) return;
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return st.sel_e[a] < st.sel_e[b]; });
    st.moe_held.clear();
    for (int32_t slot : order) {
      st.moe_held.push_back(w.experts->get(il, st.sel_e[slot]));
      expert_bytes_used().add(expert_bytes(st.moe_held.back()));
    }
    const std::span<float> fg = sl(st.ff_gate, K * F), fu = sl(st.ff_up, K * F);
    const std::span<float> fa = sl(st.ff_act, K * F), y = sl(st.moe_out, K * E);
    auto part = [](std::span<float> s, int64_t i, int64_t width) {
      return s.subspan(static_cast<size_t>(i * width), static_cast<size_t>(width));
    };
    std::vector<Backend::MatmulTask>& tasks = st.moe_tasks;
    tasks.clear();
    for (int64_t i = 0; i < K; ++i) {
      tasks.push_back({&st.moe_held[i].gate, in, part(fg, i, F)});
      tasks.push_back({&st.moe_held[i].up, in, part(fu, i, F)});
    }
    be.matmul_batch(tasks, 1);
    if (hp.arch->act == FfnAct::Silu) be.swiglu(fg, fu, fa);
    else be.geglu(fg, fu, fa);
    tasks.clear();
    for (int64_t i = 0; i < K; ++i) tasks.push_back({&st.moe_held[i].down, part(fa, i, F), part(y, i, E)});
    be.matmul_batch(tasks, 1);
    for (int64_t i = 0; i < K; ++i) {
      be.scale(part(y, i, E), st.sel_w[order[i]]);
      be.add(out, part(y, i, E), out);
    }
    st.moe_held.clear();  // releases the pins
  };

  // Mixture-of-experts FFN: route each row, then per expert gather the rows that chose it
  // and run its gate/up/down as matmuls on that expert's slice of the stacked tensors.
  auto moe_ffn = [&](int32_t il, const LayerDesc& L, const LayerWeights& lw, int64_t n_tok,
                     std::span<const float> in, std::span<float> out) {
    KILN_CHECK(w.experts != nullptr, "layer {} has experts but the model no ExpertSource", il);
    const int64_t X = L.n_expert, K = L.n_expert_used, F = L.n_ff_expert;
    const std::span<float> prob = sl(st.router, n_tok * X);
    be.matmul(lw.ffn_gate_inp, in, n_tok, prob);
    if (batch.capture) rec(fmt::format("blk.{}.ffn_moe_logits", il), prob, n_tok);
    be.softmax(prob, X);
    const std::span<int32_t> sel(st.sel_e.data(), static_cast<size_t>(n_tok * K));
    const std::span<float> sel_w = sl(st.sel_w, n_tok * K);
    // The routing decision is made on the host (one download per MoE layer on a GPU).
    const std::span<const float> prob_h = host_view(prob, st.router_host);
    for (int64_t t = 0; t < n_tok; ++t) {
      if (hp.routing.active())
        override_route(hp.routing, il, batch.pos[t], batch.tokens[t], prob_h.subspan(t * X, X),
                       sel.subspan(t * K, K), sel_w.subspan(t * K, K));
      else
        select_experts(prob_h.subspan(t * X, X), sel.subspan(t * K, K), sel_w.subspan(t * K, K));
    }
    w.experts->will_need(il, sel);  // a streaming store loads the misses in parallel
    be.zero(out);
    if (n_tok == 1) {
      moe_one_token(il, X, K, F, in, out);
      return;
    }
    for (int32_t e = 0; e < X; ++e) {
      if (!hp.owns_expert(e, static_cast<int32_t>(X))) continue;  // another rank's
      int64_t m = 0;  // rows routed to e; moe_rows holds their (token * K + slot)
      for (int64_t j = 0; j < n_tok * K; ++j)
        if (sel[j] == e) st.moe_rows[m++] = static_cast<int32_t>(j);
      if (m == 0) continue;
      const std::span<float> xin = sl(st.moe_in, m * E), y = sl(st.moe_out, m * E);
      for (int64_t i = 0; i < m; ++i) {
        const auto src = in.subspan(static_cast<size_t>(st.moe_rows[i] / K * E), E);
        be.copy(src, xin.subspan(static_cast<size_t>(i * E), static_cast<size_t>(E)));
      }
      const moe::ExpertWeights ew = w.experts->get(il, e);
      expert_bytes_used().add(expert_bytes(ew));
      const std::span<float> fg = sl(st.ff_gate, m * F), fu = sl(st.ff_up, m * F);
      const std::span<float> fa = sl(st.ff_act, m * F);
      be.matmul(ew.gate, xin, m, fg);
      be.matmul(ew.up, xin, m, fu);
      if (hp.arch->act == FfnAct::Silu) be.swiglu(fg, fu, fa);
      else be.geglu(fg, fu, fa);
      be.matmul(ew.down, fa, m, y);
      for (int64_t i = 0; i < m; ++i) {
        const int32_t j = st.moe_rows[i];
        const std::span<float> yr = y.subspan(static_cast<size_t>(i * E), E);
        be.scale(yr, sel_w[j]);
        const std::span<float> orow = out.subspan(static_cast<size_t>(j / K * E), E);
        be.add(orow, yr, orow);
      }
    }
  };

  const std::span<float> x = sl(st.x, n * E), h = sl(st.h, n * E), a = sl(st.a, n * E);
  const std::span<float> q = sl(st.q, n * hp.q_width()), k = sl(st.k, n * hp.k_width());
  const std::span<float> v = sl(st.v, n * hp.v_width()), o = sl(st.o, n * hp.o_width());
  if (batch.capture) batch.capture->clear();

  // Backend::prefetch_weights: the weights the next matmuls read, named before the
  // latency-bound ops that precede them (a device backend may pull them into its cache while
  // those run). Issued after each matmul for the ones after the next few small ops; never
  // changes a result.
  auto ahead = [&](std::initializer_list<const WeightMatrix*> ws) {
    be.prefetch_weights(std::span<const WeightMatrix* const>(ws.begin(), ws.size()), n);
  };
  // The next layer's attention weights, or the output head after the last layer.
  auto next_attn = [&](int32_t il) {
    if (il + 1 < hp.n_layer) {
      const LayerWeights& nw = w.layers[il + 1];
      ahead({&nw.wq, &nw.wk, &nw.wv, &nw.wo});
    } else if (want_logits) {
      const WeightMatrix* out_w[] = {&w.output};
      be.prefetch_weights(out_w, n_out);  // the head reads n_out rows, not n
    }
  };
  ahead({&w.layers[0].wq, &w.layers[0].wk, &w.layers[0].wv});
  be.get_rows(w.token_embd, batch.tokens, x);
  if (hp.embd_scale != 1.0f) be.scale(x, hp.embd_scale);
  if (hp.arch->embd_rmsnorm) norm_in_place(x, {}, E, hp.rms_eps);
  rec("inp_embd", x, n);

  for (int32_t il = 0; il < hp.n_layer; ++il) {
    const LayerDesc& L = hp.layers[il];
    const LayerWeights& lw = w.layers[il];
    const std::string p = batch.capture ? fmt::format("blk.{}.", il) : std::string();

    // Layers after the first got their attn_norm from the previous layer's closing add_rmsnorm.
    if (il == 0) be.rmsnorm(x, lw.attn_norm, E, hp.rms_eps, h);
    rec(p + "attn_norm", h, n);
    // Q, K and V read the same normalised rows: one backend
    // op, which a CPU decode step runs as one thread hand-off with one activation encoding;
    // each output is bit-identical to its own matmul (Backend::matmul_batch's contract).
    const Backend::MatmulTask qkv[] = {{&lw.wq, h, q}, {&lw.wk, h, k}, {&lw.wv, h, v}};
    be.matmul_batch(qkv, n);
    // Ahead of RoPE, the KV stores and attention: the output projection and the FFN's first
    // matmuls (a MoE layer's experts are not known yet). Named again before attention, the
    // longest of a decode step's small ops: each hint goes on where the last one stopped.
    auto attn_ahead = [&] {
      if (L.n_expert > 0)
        ahead({&lw.wgate_attn, &lw.wo, &lw.ffn_gate_inp});
      else
        ahead({&lw.wgate_attn, &lw.wo, &lw.ffn_gate, &lw.ffn_up});
    };
    attn_ahead();
    add_bias(q, lw.bq);
    add_bias(k, lw.bk);
    add_bias(v, lw.bv);
    if (!lw.q_norm.empty()) norm_in_place(q, lw.q_norm, hp.head_dim_k, hp.rms_eps);
    if (!lw.k_norm.empty()) norm_in_place(k, lw.k_norm, hp.head_dim_k, hp.rms_eps);
    if (L.use_rope) be.rope_qk(q, hp.n_head, k, hp.n_head_kv, n, hp.head_dim_k, batch.pos, L.rope);
    rec(p + "Qcur", q, n);
    rec(p + "Kcur", k, n);
    rec(p + "Vcur", v, n);
    // Each sequence writes its new keys/values into its own planes and attends only over
    // them; a query row's result never depends on the other sequences in the batch.
    // All sequences' stores go first, then all attentions, each group as one backend op (a
    // batched decode step is many tiny ops otherwise). Reordering is safe because no two
    // sequences of a batch share a plane (BatchEval and Session give each its own KvCache;
    // checked below), so a sequence's store never touches rows another one attends over.
    KILN_CHECK(hp.head_dim_k == hp.head_dim_v, "attention op needs key_length == value_length");
    std::vector<Backend::StoreRowsTask>& stores = st.store_tasks;
    std::vector<AttentionArgs>& attns = st.attn_args;
    stores.clear();
    attns.clear();
    for (const SeqSlice& sq : seqs) {
      const LayerKv& kv = sq.kv[il];
      const auto f = static_cast<size_t>(sq.first), c = static_cast<size_t>(sq.n_tok);
      const auto qw = static_cast<size_t>(hp.q_width()), kw = static_cast<size_t>(hp.k_width());
      const auto vw = static_cast<size_t>(hp.v_width()), ow = static_cast<size_t>(hp.o_width());
      KILN_CHECK(kv.append_rows.size() == c);
      stores.push_back({k.subspan(f * kw, c * kw), hp.k_width(), kv.append_rows, kv.k});
      stores.push_back({v.subspan(f * vw, c * vw), hp.v_width(), kv.append_rows, kv.v});

      AttentionArgs args;
      args.q = q.subspan(f * qw, c * qw);
      args.k = kv.k;
      args.v = kv.v;
      args.kv_rows = kv.kv_rows;
      args.kv_pos = kv.kv_pos;
      args.q_pos = batch.pos.subspan(f, c);
      args.n_q = sq.n_tok;
      args.n_head = hp.n_head;
      args.n_head_kv = hp.n_head_kv;
      args.head_dim = hp.head_dim_k;
      args.window = L.window;
      args.scale = hp.attn_scale;
      args.softcap = hp.attn_softcap;
      args.out = o.subspan(f * ow, c * ow);
      attns.push_back(args);
    }
    if (seqs.size() > 1) {
      std::vector<const f16*>& planes = st.plane_check;
      planes.clear();
      for (const Backend::StoreRowsTask& t : stores) planes.push_back(t.plane.data());
      std::sort(planes.begin(), planes.end());
      KILN_CHECK(std::adjacent_find(planes.begin(), planes.end()) == planes.end(),
                 "two sequences of one batch share a KV plane (layer {})", il);
    }
    be.store_rows_f16_batch(stores);
    attn_ahead();
    be.attention_batch(attns);
    rec(p + "kqv_out", o, n);
    if (lw.wgate_attn.n_rows > 0) {
      const std::span<float> g = sl(st.gate, n * hp.o_width());
      be.matmul(lw.wgate_attn, h, n, g);
      be.sigmoid(g);
      be.mul(o, g, o);
    }
    be.matmul(lw.wo, o, n, a);
    if (L.n_expert == 0) ahead({&lw.ffn_gate, &lw.ffn_up, &lw.ffn_down});
    be.all_reduce_sum(a);  // row-parallel: each rank holds its heads' share of the sum
    if (!lw.post_attn_norm.empty()) norm_in_place(a, lw.post_attn_norm, E, hp.post_norm_eps);
    rec(p + "attn_out", a, n);
    // The residual add and the FFN norm as one op (Backend::add_rmsnorm: the bits of the two).
    be.add_rmsnorm(x, a, lw.ffn_norm, E, hp.rms_eps, h);
    rec(p + "ffn_inp", x, n);
    rec(p + "ffn_norm", h, n);
    if (L.n_expert > 0) {
      moe_ffn(il, L, lw, n, h, a);
    } else {
      const std::span<float> fg = sl(st.ff_gate, n * L.n_ff), fu = sl(st.ff_up, n * L.n_ff);
      const std::span<float> fa = sl(st.ff_act, n * L.n_ff);
      const Backend::MatmulTask gate_up[] = {{&lw.ffn_gate, h, fg}, {&lw.ffn_up, h, fu}};
      be.matmul_batch(gate_up, n);
      ahead({&lw.ffn_down});
      if (hp.arch->act == FfnAct::Silu) {
        be.swiglu_matmul(lw.ffn_down, fg, fu, n, fa, a);  // fa: scratch, maybe unwritten
      } else {
        be.geglu(fg, fu, fa);
        be.matmul(lw.ffn_down, fa, n, a);
      }
    }
    next_attn(il);
    be.all_reduce_sum(a);  // row-parallel down / this rank's experts
    if (!lw.post_ffn_norm.empty()) norm_in_place(a, lw.post_ffn_norm, E, hp.post_norm_eps);
    rec(p + "ffn_out", a, n);
    // The FFN's residual add with the next layer's attn_norm (h is free again: the FFN has
    // consumed it); the last layer's output norm runs on a subset of rows below.
    if (il + 1 < hp.n_layer) {
      be.add_rmsnorm(x, a, w.layers[il + 1].attn_norm, E, hp.rms_eps, h);
    } else {
      be.add(x, a, x);
    }
    rec(p + "l_out", x, n);
  }

  if (!want_logits) {
    be.synchronize();  // the step's work is done on return, as on the rank that downloads
    return;
  }
  // Only the rows whose logits are wanted go through the output head: every row, the last
  // one, or with several sequences the rows each asks for, gathered into scratch.
  std::span<const float> last = x.subspan(static_cast<size_t>((n - n_out) * E));
  if (n_out != n && n_seq > 1) {
    int64_t o_row = 0;
    for (const SeqSlice& sq : seqs) {
      const int64_t first = batch.all_logits || sq.all_logits ? sq.first : sq.first + sq.n_tok - 1;
      const auto rows = x.subspan(static_cast<size_t>(first * E),
                                  static_cast<size_t>((sq.first + sq.n_tok - first) * E));
      be.copy(std::span<const float>(rows), a.subspan(static_cast<size_t>(o_row * E)));
      o_row += sq.first + sq.n_tok - first;
    }
    last = a.subspan(0, static_cast<size_t>(n_out * E));
  }
  const std::span<float> hn = h.subspan(0, static_cast<size_t>(n_out * E));
  be.rmsnorm(last, w.output_norm, E, hp.rms_eps, hn);
  rec("result_norm", hn, n_out);
  // Device backends compute the logits in their memory and download them once per step (the
  // step's only synchronisation); host backends write the caller's span directly.
  std::span<float> out = logits;
  if (on_device) {
    if (st.n_logits_ < logits.size()) {
      st.logits = be.alloc<float>(logits.size());
      st.n_logits_ = logits.size();
    }
    out = sl(st.logits, static_cast<int64_t>(logits.size()));
  }
  be.matmul(w.output, hn, n_out, out);
  if (hp.logit_scale != 1.0f) be.scale(out, hp.logit_scale);
  if (hp.final_softcap > 0) be.softcap(out, hp.final_softcap);
  // top_k checks that top_ids/top_vals hold n_out rows of top_k.
  if (batch.top_k > 0)
    be.top_k(std::span<const float>(out), hp.n_vocab, batch.top_k, batch.top_ids, batch.top_vals);
  if (on_device && (batch.top_k == 0 || batch.capture))
    be.download(std::span<const float>(out), logits);
  rec("result_output", logits, n_out);
}

}  // namespace kiln::model
