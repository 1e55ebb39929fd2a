// model/forward.cpp: the fast forward pass (see forward.h). Every arithmetic step is a
// Backend op; this file only sequences them and slices the scratch buffers.
#include "model/forward.h"

#include <algorithm>
#include <string>

#include "core/check.h"

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
  x.resize(B * hp.n_embd);
  h.resize(B * hp.n_embd);
  a.resize(B * hp.n_embd);
  q.resize(B * hp.q_width());
  k.resize(B * hp.k_width());
  v.resize(B * hp.v_width());
  o.resize(B * hp.o_width());
  gate.resize(B * hp.o_width());
  ff_gate.resize(B * n_ff);
  ff_up.resize(B * n_ff);
  ff_act.resize(B * n_ff);
  tmp.resize(B * std::max<int64_t>({hp.n_embd, hp.q_width(), hp.k_width()}));
  if (n_expert > 0) {
    router.resize(B * n_expert);
    sel_w.resize(B * n_used);
    sel_e.resize(B * n_used);
    moe_rows.resize(B * n_used);
    moe_in.resize(B * hp.n_embd);
    moe_out.resize(B * hp.n_embd);
  }
}

namespace {

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
  KILN_CHECK(static_cast<int32_t>(batch.kv.size()) == hp.n_layer);
  const int64_t E = hp.n_embd;
  const int64_t n_out = batch.all_logits ? n : 1;
  KILN_CHECK(static_cast<int64_t>(logits.size()) == n_out * hp.n_vocab);

  auto sl = [](std::vector<float>& buf, int64_t count) {
    return std::span<float>(buf.data(), static_cast<size_t>(count));
  };
  auto rec = [&](const std::string& name, std::span<const float> data, int64_t rows) {
    if (batch.capture) batch.capture->record(name, data, rows);
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
    std::copy(t.begin(), t.end(), y.begin());
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
    for (int64_t t = 0; t < n_tok; ++t)
      select_experts(prob.subspan(t * X, X), sel.subspan(t * K, K), sel_w.subspan(t * K, K));
    std::fill(out.begin(), out.end(), 0.0f);
    for (int32_t e = 0; e < X; ++e) {
      int64_t m = 0;  // rows routed to e; moe_rows holds their (token * K + slot)
      for (int64_t j = 0; j < n_tok * K; ++j)
        if (sel[j] == e) st.moe_rows[m++] = static_cast<int32_t>(j);
      if (m == 0) continue;
      const std::span<float> xin = sl(st.moe_in, m * E), y = sl(st.moe_out, m * E);
      for (int64_t i = 0; i < m; ++i) {
        const auto src = in.subspan(static_cast<size_t>(st.moe_rows[i] / K * E), E);
        std::copy(src.begin(), src.end(), xin.begin() + i * E);
      }
      const moe::ExpertWeights ew = w.experts->get(il, e);
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

  be.get_rows(w.token_embd, batch.tokens, x);
  if (hp.embd_scale != 1.0f) be.scale(x, hp.embd_scale);
  if (hp.arch->embd_rmsnorm) norm_in_place(x, {}, E, hp.rms_eps);
  rec("inp_embd", x, n);

  for (int32_t il = 0; il < hp.n_layer; ++il) {
    const LayerDesc& L = hp.layers[il];
    const LayerWeights& lw = w.layers[il];
    const LayerKv& kv = batch.kv[il];
    const std::string p = batch.capture ? fmt::format("blk.{}.", il) : std::string();

    be.rmsnorm(x, lw.attn_norm, E, hp.rms_eps, h);
    rec(p + "attn_norm", h, n);
    be.matmul(lw.wq, h, n, q);
    be.matmul(lw.wk, h, n, k);
    be.matmul(lw.wv, h, n, v);
    add_bias(q, lw.bq);
    add_bias(k, lw.bk);
    add_bias(v, lw.bv);
    if (!lw.q_norm.empty()) norm_in_place(q, lw.q_norm, hp.head_dim_k, hp.rms_eps);
    if (!lw.k_norm.empty()) norm_in_place(k, lw.k_norm, hp.head_dim_k, hp.rms_eps);
    if (L.use_rope) {
      be.rope(q, n, hp.n_head, hp.head_dim_k, batch.pos, L.rope);
      be.rope(k, n, hp.n_head_kv, hp.head_dim_k, batch.pos, L.rope);
    }
    rec(p + "Qcur", q, n);
    rec(p + "Kcur", k, n);
    rec(p + "Vcur", v, n);
    be.store_rows_f16(k, hp.k_width(), kv.append_rows, kv.k);
    be.store_rows_f16(v, hp.v_width(), kv.append_rows, kv.v);

    AttentionArgs args;
    args.q = q;
    args.k = kv.k;
    args.v = kv.v;
    args.kv_rows = kv.kv_rows;
    args.kv_pos = kv.kv_pos;
    args.q_pos = batch.pos;
    args.n_q = n;
    args.n_head = hp.n_head;
    args.n_head_kv = hp.n_head_kv;
    args.head_dim = hp.head_dim_k;
    KILN_CHECK(hp.head_dim_k == hp.head_dim_v, "attention op needs key_length == value_length");
    args.window = L.window;
    args.scale = hp.attn_scale;
    args.softcap = hp.attn_softcap;
    args.out = o;
    be.attention(args);
    rec(p + "kqv_out", o, n);
    if (lw.wgate_attn.n_rows > 0) {
      const std::span<float> g = sl(st.gate, n * hp.o_width());
      be.matmul(lw.wgate_attn, h, n, g);
      be.sigmoid(g);
      be.mul(o, g, o);
    }
    be.matmul(lw.wo, o, n, a);
    if (!lw.post_attn_norm.empty()) norm_in_place(a, lw.post_attn_norm, E, hp.post_norm_eps);
    rec(p + "attn_out", a, n);
    be.add(x, a, x);
    rec(p + "ffn_inp", x, n);

    be.rmsnorm(x, lw.ffn_norm, E, hp.rms_eps, h);
    rec(p + "ffn_norm", h, n);
    if (L.n_expert > 0) {
      moe_ffn(il, L, lw, n, h, a);
    } else {
      const std::span<float> fg = sl(st.ff_gate, n * L.n_ff), fu = sl(st.ff_up, n * L.n_ff);
      const std::span<float> fa = sl(st.ff_act, n * L.n_ff);
      be.matmul(lw.ffn_gate, h, n, fg);
      be.matmul(lw.ffn_up, h, n, fu);
      if (hp.arch->act == FfnAct::Silu) be.swiglu(fg, fu, fa);
      else be.geglu(fg, fu, fa);
      be.matmul(lw.ffn_down, fa, n, a);
    }
    if (!lw.post_ffn_norm.empty()) norm_in_place(a, lw.post_ffn_norm, E, hp.post_norm_eps);
    rec(p + "ffn_out", a, n);
    be.add(x, a, x);
    rec(p + "l_out", x, n);
  }

  // Only the rows whose logits are wanted go through the output head.
  const std::span<const float> last = x.subspan(static_cast<size_t>((n - n_out) * E));
  const std::span<float> hn = h.subspan(0, static_cast<size_t>(n_out * E));
  be.rmsnorm(last, w.output_norm, E, hp.rms_eps, hn);
  rec("result_norm", hn, n_out);
  be.matmul(w.output, hn, n_out, logits);
  if (hp.logit_scale != 1.0f) be.scale(logits, hp.logit_scale);
  if (hp.final_softcap > 0) be.softcap(logits, hp.final_softcap);
  rec("result_output", logits, n_out);
}

}  // namespace kiln::model
