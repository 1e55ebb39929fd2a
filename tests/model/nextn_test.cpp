// tests/model/nextn_test.cpp: model::forward_nextn (a NextN/MTP block step) against the
// reference pass. The test computes the block's input on its own, in plain loops, from the
// definition (embedding zeroed at position 0, enorm and hnorm, embedding half first, eh_proj),
// feeds it to a ReferenceSession over the block as a one-layer model with the NextN head, and
// compares every recorded node, node by node, for a 6-row prefill and two decode rows (the
// block's attention over its own KV rows), on the ref and cpu backends.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "common/testdata.h"
#include "engine/session.h"
#include "model/forward.h"
#include "model/reference.h"
#include "quant/quant.h"

#if KILN_HAVE_CPU_BACKEND
#include "backend/cpu/cpu_backend.h"
#endif

namespace kiln {
namespace {

using Vec = std::vector<float>;

Vec dequant_row(const WeightMatrix& m, int64_t r) {
  Vec out(static_cast<size_t>(m.n_cols));
  quant::dequantize_row(m.dtype, m.row(r), out);
  return out;
}

void rmsnorm(Vec& x, std::span<const float> w) {
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  const double inv = 1.0 / std::sqrt(ss / double(x.size()) + 1e-5);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(x[i] * inv * w[i]);
}

// eh_proj(concat(enorm(e), hnorm(h))) for each row, in double.
Vec nextn_input(const model::HParams& hp, const model::Weights& w, std::span<const int32_t> tok,
                std::span<const int32_t> pos, std::span<const float> hidden) {
  const model::NextnWeights& nw = w.nextn[0];
  const int64_t E = hp.n_embd;
  const WeightMatrix& embd = nw.embed_tokens.n_rows > 0 ? nw.embed_tokens : w.token_embd;
  Vec x;
  for (size_t t = 0; t < tok.size(); ++t) {
    Vec e = dequant_row(embd, tok[t]);
    if (pos[t] == 0) std::fill(e.begin(), e.end(), 0.0f);
    rmsnorm(e, nw.enorm);
    Vec h(hidden.begin() + t * E, hidden.begin() + (t + 1) * E);
    rmsnorm(h, nw.hnorm);
    e.insert(e.end(), h.begin(), h.end());
    for (int64_t r = 0; r < E; ++r) {
      const Vec row = dequant_row(nw.eh_proj, r);
      double acc = 0;
      for (int64_t c = 0; c < 2 * E; ++c) acc += double(row[c]) * e[c];
      x.push_back(static_cast<float>(acc));
    }
  }
  return x;
}

double rel_rms(std::span<const float> a, std::span<const float> b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

void check_backend(Backend& be, double tol) {
  auto m = Model::load(testing::model_path("glm4moe-f16.gguf"));
  ASSERT_TRUE(m.has_value()) << m.error();
  const model::HParams& hp = (*m)->hparams();
  const model::Weights& w = (*m)->weights();
  ASSERT_EQ(w.nextn.size(), 1u);
  const int64_t E = hp.n_embd, V = hp.n_vocab, KW = hp.k_width();
  // The reference over the NextN block as a one-layer model with the block's head.
  model::HParams vh = hp;
  vh.n_layer = 1;
  vh.layers.assign(1, hp.nextn_layers[0]);
  vh.nextn_layers.clear();
  model::Weights vw;
  vw.token_embd = w.nextn[0].embed_tokens;
  vw.output_norm = w.nextn[0].shared_head_norm;
  vw.output = w.nextn[0].shared_head_head;
  vw.layers.assign(1, w.nextn[0].layer);
  vw.experts = w.nextn_experts;  // its layer 0 is NextN block 0
  model::ReferenceSession ref(vh, vw, 64);

  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int32_t n_ctx = 16;
  std::vector<f16> kplane(static_cast<size_t>(n_ctx * KW)), vplane(kplane.size());
  model::ForwardState st(hp, 8);
  int32_t n_pos = 0;
  for (int32_t n : {6, 1, 1}) {
    SCOPED_TRACE(n_pos);
    std::vector<int32_t> tok, pos, rows;
    for (int32_t t = 0; t < n; ++t) {
      tok.push_back(static_cast<int32_t>(rng() % uint32_t(V)));
      pos.push_back(n_pos + t);
    }
    Vec hidden(static_cast<size_t>(n * E));
    for (float& f : hidden) f = nd(rng);
    for (int32_t p = 0; p < n_pos + n; ++p) rows.push_back(p);
    const model::LayerKv kv{.append_rows = std::span<const int32_t>(rows).subspan(n_pos),
                            .kv_rows = rows,
                            .kv_pos = rows,
                            .k = kplane,
                            .v = vplane};
    model::ForwardBatch b;
    b.tokens = tok;
    b.pos = pos;
    b.kv = std::span<const model::LayerKv>(&kv, 1);
    b.all_logits = true;
    model::Capture fast_cap;
    b.capture = &fast_cap;
    Vec logits(static_cast<size_t>(n * V)), out_hidden(static_cast<size_t>(n * E));
    model::forward_nextn(hp, w, 0, be, st, b, hidden, logits, out_hidden);

    const Vec x = nextn_input(hp, w, tok, pos, hidden);
    model::Capture ref_cap;
    ref.set_capture(&ref_cap);
    ref.set_input_rows(x);
    auto rl = ref.eval(tok, true);
    ASSERT_TRUE(rl.has_value()) << rl.error();
    ASSERT_EQ(rl->size(), logits.size());
    size_t compared = 0;
    for (const auto& [name, r] : ref_cap.nodes) {
      auto it = fast_cap.nodes.find(name);
      ASSERT_NE(it, fast_cap.nodes.end()) << name;
      ASSERT_EQ(it->second.data.size(), r.data.size()) << name;
      EXPECT_LE(rel_rms(it->second.data, r.data), tol) << name;
      ++compared;
    }
    EXPECT_GE(compared, 10u);
    EXPECT_LE(rel_rms(logits, *rl), tol);
    // The block's output before the head norm: the next draft's hidden state.
    EXPECT_LE(rel_rms(out_hidden, ref_cap.nodes.at("blk.0.l_out").data), tol);
    n_pos += n;
  }
}

TEST(ForwardNextn, MatchesTheReferenceOnTheRefBackend) {
  auto be = make_ref_backend();
  check_backend(*be, 5e-3);
}

#if KILN_HAVE_CPU_BACKEND
TEST(ForwardNextn, MatchesTheReferenceOnTheCpuBackend) {
  auto be = make_cpu_backend({.threads = 2});
  check_backend(*be, 1e-2);
}
#endif

}  // namespace
}  // namespace kiln
