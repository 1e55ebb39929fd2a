// model/reference.cpp: the reference forward pass in plain loops (see reference.h). Sums are
// accumulated in double so the oracle's own rounding stays far below the test bounds.
#include "model/reference.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/check.h"
#include "model/batch.h"
#include "quant/quant.h"

namespace kiln::model {
namespace {

using Vec = std::vector<float>;

// y[t][r] = W[r] . x[t]; each weight row is dequantized once and used for every token.
void matmul(const WeightMatrix& w, const Vec& x, int64_t n_tok, Vec& y) {
  KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * w.n_cols);
  y.assign(static_cast<size_t>(n_tok * w.n_rows), 0.0f);
  Vec row(static_cast<size_t>(w.n_cols));
  for (int64_t r = 0; r < w.n_rows; ++r) {
    quant::dequantize_row(w.dtype, w.row(r), row);
    for (int64_t t = 0; t < n_tok; ++t) {
      const float* xt = x.data() + t * w.n_cols;
      double acc = 0;
      for (int64_t c = 0; c < w.n_cols; ++c) acc += double(row[c]) * double(xt[c]);
      y[t * w.n_rows + r] = static_cast<float>(acc);
    }
  }
}

void add_bias(Vec& y, std::span<const float> b) {
  if (b.empty()) return;
  for (size_t i = 0; i < y.size(); ++i) y[i] += b[i % b.size()];
}

// Per row of n: x / sqrt(mean(x^2) + eps) * weight, in place.
void rmsnorm(Vec& x, int64_t n, float eps, std::span<const float> weight) {
  for (size_t off = 0; off < x.size(); off += static_cast<size_t>(n)) {
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += double(x[off + i]) * double(x[off + i]);
    const double inv = 1.0 / std::sqrt(ss / double(n) + double(eps));
    for (int64_t i = 0; i < n; ++i)
      x[off + i] = static_cast<float>(x[off + i] * inv * (weight.empty() ? 1.0 : weight[i]));
  }
}

// In place on [n_tok][n_head][head_dim]: rotate the first n_rot dims of each head. The angle
// is written the way llama.cpp's rope_yarn reads (extrapolated and interpolated angles, mixed
// by the YaRN ramp), not in the backends' factored form, so the two are checked against
// each other (tests/model/rope_factors_test.cpp).
void rope(Vec& x, int64_t n_tok, int64_t n_head, int64_t head_dim, std::span<const int32_t> pos,
          const RopeParams& p) {
  const int64_t half = p.n_rot / 2;
  const RopeYarnTerms yarn = rope_yarn_terms(p);
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int64_t h = 0; h < n_head; ++h) {
      float* v = x.data() + (t * n_head + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const double factor = p.freq_factors.empty() ? 1.0 : double(p.freq_factors[i]);
        const double theta_extrap =
            double(pos[t]) * std::pow(double(p.freq_base), -2.0 * double(i) / double(p.n_rot)) /
            factor;
        const double theta_interp = double(p.freq_scale) * theta_extrap;
        double theta = theta_interp;
        if (yarn.ext_factor != 0) {
          const double y = (double(i) - yarn.corr_lo) /
                           std::max(0.001, double(yarn.corr_hi) - double(yarn.corr_lo));
          const double mix = (1 - std::clamp(y, 0.0, 1.0)) * double(yarn.ext_factor);
          theta = theta_interp * (1 - mix) + theta_extrap * mix;
        }
        const double c = std::cos(theta) * yarn.mscale, s = std::sin(theta) * yarn.mscale;
        const int64_t a = p.style == RopeStyle::NeoX ? i : 2 * i;
        const int64_t b = p.style == RopeStyle::NeoX ? i + half : 2 * i + 1;
        const double x0 = v[a], x1 = v[b];
        v[a] = static_cast<float>(x0 * c - x1 * s);
        v[b] = static_cast<float>(x0 * s + x1 * c);
      }
    }
  }
}

// Every row of w dequantized: [n_rows][n_cols].
Vec dequantize_all(const WeightMatrix& w) {
  Vec out(static_cast<size_t>(w.n_rows * w.n_cols));
  for (int64_t r = 0; r < w.n_rows; ++r)
    quant::dequantize_row(
        w.dtype, w.row(r),
        std::span<float>(out.data() + r * w.n_cols, static_cast<size_t>(w.n_cols)));
  return out;
}

// Per row of n: (x - mean) / sqrt(var + eps) * weight + bias, in place (LayerNorm).
void layernorm(Vec& x, int64_t n, float eps, std::span<const float> weight,
               std::span<const float> bias) {
  for (size_t off = 0; off < x.size(); off += static_cast<size_t>(n)) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; ++i) mean += x[off + i];
    mean /= double(n);
    for (int64_t i = 0; i < n; ++i) var += (x[off + i] - mean) * (x[off + i] - mean);
    const double inv = 1.0 / std::sqrt(var / double(n) + double(eps));
    for (int64_t i = 0; i < n; ++i)
      x[off + i] = static_cast<float>((x[off + i] - mean) * inv * weight[i] + bias[i]);
  }
}

// Which keys each query of a batch attends over under sparse attention: [n][n_kv] flags, a
// row left empty meaning every visible key.
using KeepMask = std::vector<std::vector<char>>;

// The lightning indexer of a full layer (HParams::dsa; llama.cpp's glm-dsa graph): per head
// the query q_h = indexer.attn_q_b(qa) and the one key k = LayerNorm(indexer.attn_k(h)) (eps
// 0: llama.cpp's default norm eps, which glm-dsa never sets), both with RoPE on their first
// rope dims; a key's score is sum_h w_h ReLU(q_h . k) with w = indexer.proj(h) / sqrt(head_dim
// * n_head). llama.cpp also multiplies q and k by one Hadamard matrix before the dot product:
// an orthogonal map leaves q . k unchanged, so it is not applied here. Each query keeps its
// top_k best visible keys; with top_k or fewer visible it keeps them all (llama.cpp's top_k
// then also picks masked keys, whose -inf scores the attention mask removes again). The
// new keys are appended to `icache` ([n_kv][head_dim]).
void indexer_select(const HParams& hp, const LayerDesc& L, const LayerWeights& lw, const Vec& h,
                    const Vec& qa, int64_t n, std::span<const int32_t> pos, Vec& icache,
                    KeepMask& keep) {
  const DsaDims& d = hp.dsa;
  const int64_t Hi = d.n_head, Di = d.head_dim;
  Vec iq, ik, iw;
  matmul(lw.idx_wq_b, qa, n, iq);
  matmul(lw.idx_wk, h, n, ik);
  matmul(lw.idx_proj, h, n, iw);
  layernorm(ik, Di, 0.0f, lw.idx_k_norm, lw.idx_k_nb);
  rope(iq, n, Hi, Di, pos, L.rope);  // rope() turns each head's first n_rot dims: rope-first
  rope(ik, n, 1, Di, pos, L.rope);
  icache.insert(icache.end(), ik.begin(), ik.end());
  const int64_t n_kv = static_cast<int64_t>(icache.size()) / Di;
  const double w_scale = 1.0 / std::sqrt(double(Di) * double(Hi));
  keep.assign(static_cast<size_t>(n), {});
  std::vector<std::pair<double, int64_t>> scored;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t visible = std::min<int64_t>(pos[t] + 1, n_kv);
    if (visible <= d.top_k) continue;
    scored.clear();
    for (int64_t j = 0; j < visible; ++j) {
      double s = 0;
      for (int64_t hh = 0; hh < Hi; ++hh) {
        double dot = 0;
        const float* q = iq.data() + (t * Hi + hh) * Di;
        const float* k = icache.data() + j * Di;
        for (int64_t i = 0; i < Di; ++i) dot += double(q[i]) * double(k[i]);
        s += double(iw[t * Hi + hh]) * w_scale * std::max(0.0, dot);
      }
      scored.emplace_back(s, j);
    }
    // Equal scores (every head's dot product cut to 0 by the ReLU) go to the earlier key;
    // llama.cpp orders exact ties as its top-k sort happens to.
    std::partial_sort(scored.begin(), scored.begin() + d.top_k, scored.end(),
                      [](const auto& a, const auto& b) {
                        return a.first > b.first || (a.first == b.first && a.second < b.second);
                      });
    keep[t].assign(static_cast<size_t>(n_kv), 0);
    for (int64_t i = 0; i < d.top_k; ++i) keep[t][static_cast<size_t>(scored[i].second)] = 1;
  }
}

// Latent attention (HParams::mla) in its plain, expanded form: the cache keeps each token's
// latent row [c_kv | k_pe] (c_kv RMS-normalised, k_pe roped), and every step expands all
// cached rows into per-head keys [k_nope = attn_k_b^T c_kv | k_pe] and values attn_v_b c_kv,
// then attends as multi-head attention: the definition the fast pass's absorbed form (which
// never expands) must agree with. h: [n][n_embd] attn_norm'd rows; out: [n][n_head * v].
// Under sparse attention (HParams::dsa) a full layer first runs its indexer (indexer_select
// into `keep`, its keys into `icache`) and a shared layer reads `keep` as the last full layer
// left it; each query then attends only over the keys its row of `keep` flags.
void mla_attention(const HParams& hp, const LayerDesc& L, const LayerWeights& lw, const Vec& h,
                   int64_t n, std::span<const int32_t> pos, Vec& cache, Vec& out, Vec& icache,
                   KeepMask& keep) {
  const MlaDims& m = hp.mla;
  const int64_t H = hp.n_head, N = m.nope, R = m.rope, C = m.kv_lora, V = m.v;
  const int64_t D = m.q_head(), W = C + R;
  Vec q, kv;
  if (lw.wq_a.n_rows > 0) {
    Vec qa;
    matmul(lw.wq_a, h, n, qa);
    rmsnorm(qa, m.q_lora, hp.rms_eps, lw.q_a_norm);
    matmul(lw.wq_b, qa, n, q);
    if (L.indexer == IndexerKind::Full) indexer_select(hp, L, lw, h, qa, n, pos, icache, keep);
  } else {
    matmul(lw.wq, h, n, q);
  }
  matmul(lw.wkv_a, h, n, kv);
  Vec q_pe(static_cast<size_t>(n * H * R)), k_pe(static_cast<size_t>(n * R));
  Vec c(static_cast<size_t>(n * C));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t hh = 0; hh < H; ++hh)
      for (int64_t i = 0; i < R; ++i) q_pe[(t * H + hh) * R + i] = q[(t * H + hh) * D + N + i];
    for (int64_t i = 0; i < R; ++i) k_pe[t * R + i] = kv[t * W + C + i];
    for (int64_t i = 0; i < C; ++i) c[t * C + i] = kv[t * W + i];
  }
  rope(q_pe, n, H, R, pos, L.rope);
  rope(k_pe, n, 1, R, pos, L.rope);
  rmsnorm(c, C, hp.rms_eps, lw.kv_a_norm);
  for (int64_t t = 0; t < n; ++t) {
    cache.insert(cache.end(), c.begin() + t * C, c.begin() + (t + 1) * C);
    cache.insert(cache.end(), k_pe.begin() + t * R, k_pe.begin() + (t + 1) * R);
  }

  // Expand: k_nope[j][hh][i] = sum_r k_b[hh][r][i] c[j][r], v[j][hh][d] = sum_r v_b[hh][d][r]
  // c[j][r].
  const int64_t n_kv = static_cast<int64_t>(cache.size()) / W;
  const Vec kb = dequantize_all(lw.wk_b), vb = dequantize_all(lw.wv_b);
  std::vector<double> k_nope(static_cast<size_t>(n_kv * H * N), 0.0);
  std::vector<double> val(static_cast<size_t>(n_kv * H * V), 0.0);
  for (int64_t j = 0; j < n_kv; ++j) {
    const float* cj = cache.data() + j * W;
    for (int64_t hh = 0; hh < H; ++hh) {
      for (int64_t r = 0; r < C; ++r)
        for (int64_t i = 0; i < N; ++i)
          k_nope[(j * H + hh) * N + i] += double(kb[(hh * C + r) * N + i]) * double(cj[r]);
      for (int64_t d = 0; d < V; ++d) {
        double acc = 0;
        for (int64_t r = 0; r < C; ++r) acc += double(vb[(hh * V + d) * C + r]) * double(cj[r]);
        val[(j * H + hh) * V + d] = acc;
      }
    }
  }

  out.assign(static_cast<size_t>(n * H * V), 0.0f);
  std::vector<double> score(static_cast<size_t>(n_kv));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t hh = 0; hh < H; ++hh) {
      const float* qn = q.data() + (t * H + hh) * D;
      const float* qp = q_pe.data() + (t * H + hh) * R;
      double mx = -INFINITY;
      const std::vector<char>* kt = L.indexer == IndexerKind::None ? nullptr : &keep[t];
      for (int64_t j = 0; j < n_kv; ++j) {
        if (j > pos[t] || (kt && !kt->empty() && !(*kt)[static_cast<size_t>(j)])) {
          score[j] = -INFINITY;
          continue;
        }
        double s = 0;
        for (int64_t i = 0; i < N; ++i) s += double(qn[i]) * k_nope[(j * H + hh) * N + i];
        for (int64_t i = 0; i < R; ++i) s += double(qp[i]) * double(cache[j * W + C + i]);
        score[j] = s * hp.attn_scale;
        mx = std::max(mx, score[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j < n_kv; ++j) {
        score[j] = std::isinf(score[j]) ? 0.0 : std::exp(score[j] - mx);
        sum += score[j];
      }
      for (int64_t d = 0; d < V; ++d) {
        double acc = 0;
        for (int64_t j = 0; j < n_kv; ++j) acc += score[j] * val[(j * H + hh) * V + d];
        out[(t * H + hh) * V + d] = static_cast<float>(acc / sum);
      }
    }
  }
}

// gpt-oss's clamped SwiGLU (llama.cpp's swiglu_oai).
constexpr double kOaiAlpha = 1.702, kOaiLimit = 7.0;
double swiglu_oai(double g, double u) {
  const double x = std::min(g, kOaiLimit);
  const double y = std::clamp(u, -kOaiLimit, kOaiLimit);
  return x / (1.0 + std::exp(-kOaiAlpha * x)) * (y + 1.0);
}

double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

}  // namespace

ReferenceSession::ReferenceSession(const HParams& hp, const Weights& w, int32_t n_ctx)
    : hp_(hp), w_(w), n_ctx_(n_ctx > 0 ? n_ctx : hp.n_ctx_train) {
  k_.resize(hp.n_layer);
  v_.resize(hp.n_layer);
  ik_.resize(hp.n_layer);
}

Status ReferenceSession::rollback(int32_t n_pos) {
  if (n_pos < 0 || n_pos > n_pos_)
    return Status::errorf("rollback to {} outside [0, {}]", n_pos, n_pos_);
  for (int32_t il = 0; il < hp_.n_layer; ++il) {
    k_[il].resize(static_cast<size_t>(n_pos * hp_.k_width()));
    v_[il].resize(static_cast<size_t>(n_pos * hp_.kv_v_width()));
    if (hp_.layers[il].indexer == IndexerKind::Full)
      ik_[il].resize(static_cast<size_t>(n_pos) * static_cast<size_t>(hp_.dsa.head_dim));
  }
  n_pos_ = n_pos;
  return Status::ok();
}

Expected<std::span<const float>> ReferenceSession::eval(std::span<const int32_t> tokens,
                                                        bool all_logits) {
  KILN_TRY(validate_batch(hp_, tokens, n_pos_, n_ctx_));
  if (capture_) capture_->clear();
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t E = hp_.n_embd;
  auto rec = [&](const std::string& name, const Vec& v) {
    if (capture_ && capture_->wants(name)) capture_->record(name, v, n);
  };
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) pos[t] = n_pos_ + static_cast<int32_t>(t);

  Vec x(static_cast<size_t>(n * E));
  if (!input_rows_.empty()) {
    KILN_CHECK(static_cast<int64_t>(input_rows_.size()) == n * E, "input rows of {} floats",
               input_rows_.size());
    x.assign(input_rows_.begin(), input_rows_.end());
    input_rows_ = {};
  } else {
    for (int64_t t = 0; t < n; ++t) {
      std::span<float> dst(x.data() + t * E, static_cast<size_t>(E));
      quant::dequantize_row(w_.token_embd.dtype, w_.token_embd.row(tokens[t]), dst);
      for (float& f : dst) f *= hp_.embd_scale;
    }
    if (hp_.arch->embd_rmsnorm) rmsnorm(x, E, hp_.rms_eps, {});
  }
  rec("inp_embd", x);

  const int64_t hk = hp_.head_dim_k, hv = hp_.head_dim_v;
  const int64_t group = hp_.n_head / hp_.n_head_kv;
  Vec h, q, k, v, o, gate, a, up, f;
  KeepMask keep;  // sparse attention: the last full layer's choice of keys (indexer_select)
  for (int32_t il = 0; il < hp_.n_layer; ++il) {
    const LayerDesc& L = hp_.layers[il];
    const LayerWeights& lw = w_.layers[il];
    const std::string p = fmt::format("blk.{}.", il);

    h = x;
    rmsnorm(h, E, hp_.rms_eps, lw.attn_norm);
    rec(p + "attn_norm", h);
    if (hp_.is_mla()) {
      mla_attention(hp_, L, lw, h, n, pos, k_[il], o, ik_[il], keep);
      rec(p + "Kcur", Vec(k_[il].end() - n * hp_.k_width(), k_[il].end()));
    } else {
      matmul(lw.wq, h, n, q);
      matmul(lw.wk, h, n, k);
      matmul(lw.wv, h, n, v);
      add_bias(q, lw.bq);
      add_bias(k, lw.bk);
      add_bias(v, lw.bv);
      if (!lw.q_norm.empty()) rmsnorm(q, hk, hp_.rms_eps, lw.q_norm);
      if (!lw.k_norm.empty()) rmsnorm(k, hk, hp_.rms_eps, lw.k_norm);
      if (L.use_rope) {
        rope(q, n, hp_.n_head, hk, pos, L.rope);
        rope(k, n, hp_.n_head_kv, hk, pos, L.rope);
      }
      rec(p + "Qcur", q);
      rec(p + "Kcur", k);
      rec(p + "Vcur", v);
      k_[il].insert(k_[il].end(), k.begin(), k.end());
      v_[il].insert(v_[il].end(), v.begin(), v.end());

      // Causal (and windowed) attention over every retained key.
      const int64_t n_kv = n_pos_ + n;
      o.assign(static_cast<size_t>(n * hp_.o_width()), 0.0f);
      std::vector<double> score(static_cast<size_t>(n_kv));
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t hh = 0; hh < hp_.n_head; ++hh) {
          const int64_t kvh = hh / group;
          const float* qv = q.data() + (t * hp_.n_head + hh) * hk;
          double mx = -INFINITY;
          for (int64_t j = 0; j < n_kv; ++j) {
            const bool visible = j <= pos[t] && (L.window <= 0 || pos[t] - j < L.window);
            if (!visible) {
              score[j] = -INFINITY;
              continue;
            }
            const float* kv = k_[il].data() + (j * hp_.n_head_kv + kvh) * hk;
            double s = 0;
            for (int64_t d = 0; d < hk; ++d) s += double(qv[d]) * double(kv[d]);
            s *= hp_.attn_scale;
            if (hp_.attn_softcap > 0) s = hp_.attn_softcap * std::tanh(s / hp_.attn_softcap);
            score[j] = s;
            mx = std::max(mx, s);
          }
          double sum = 0;
          // An attention sink: one more logit in the softmax, with no value row.
          if (!lw.attn_sinks.empty() && mx != -INFINITY) {
            const double sink = lw.attn_sinks[static_cast<size_t>(hh)];
            mx = std::max(mx, sink);
            sum += std::exp(sink - mx);
          }
          for (int64_t j = 0; j < n_kv; ++j) {
            score[j] = std::isinf(score[j]) ? 0.0 : std::exp(score[j] - mx);
            sum += score[j];
          }
          float* out = o.data() + (t * hp_.n_head + hh) * hv;
          for (int64_t d = 0; d < hv; ++d) {
            double acc = 0;
            for (int64_t j = 0; j < n_kv; ++j)
              if (score[j] != 0.0) acc += score[j] * v_[il][(j * hp_.n_head_kv + kvh) * hv + d];
            out[d] = static_cast<float>(acc / sum);
          }
        }
      }
    }
    rec(p + "kqv_out", o);
    if (lw.wgate_attn.n_rows > 0) {
      matmul(lw.wgate_attn, h, n, gate);
      for (size_t i = 0; i < o.size(); ++i)
        o[i] *= static_cast<float>(1.0 / (1.0 + std::exp(-double(gate[i]))));
    }
    matmul(lw.wo, o, n, a);
    add_bias(a, lw.bo);
    if (!lw.post_attn_norm.empty()) rmsnorm(a, E, hp_.post_norm_eps, lw.post_attn_norm);
    rec(p + "attn_out", a);
    for (size_t i = 0; i < x.size(); ++i) x[i] += a[i];
    rec(p + "ffn_inp", x);

    h = x;
    rmsnorm(h, E, hp_.rms_eps, lw.ffn_norm);
    rec(p + "ffn_norm", h);
    // Biases (gpt-oss's experts) are empty spans elsewhere.
    auto ffn = [&](const WeightMatrix& wg, const WeightMatrix& wu, const WeightMatrix& wd,
                   const Vec& in, int64_t rows, Vec& out, std::span<const float> bg = {},
                   std::span<const float> bu = {}, std::span<const float> bd = {}) {
      matmul(wg, in, rows, gate);
      matmul(wu, in, rows, up);
      add_bias(gate, bg);
      add_bias(up, bu);
      for (size_t i = 0; i < gate.size(); ++i) {
        const double g = gate[i];
        switch (hp_.arch->act) {
          case FfnAct::Silu:
            gate[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[i]);
            break;
          case FfnAct::GeluTanh:
            gate[i] = static_cast<float>(gelu_tanh(g) * up[i]);
            break;
          case FfnAct::SwigluOai:
            gate[i] = static_cast<float>(swiglu_oai(g, up[i]));
            break;
        }
      }
      matmul(wd, gate, rows, out);
      add_bias(out, bd);
    };
    if (L.n_expert > 0) {
      // Per token: the router's probabilities (softmax or sigmoid of its logits), the experts
      // and weights route_experts picks from them (model/routing.h: selection bias, groups,
      // top-k, normalisation, scale), the weighted sum of the chosen experts' FFNs; then the
      // shared experts' FFN added.
      KILN_CHECK(w_.experts != nullptr);
      Vec logit, row, y;
      matmul(lw.ffn_gate_inp, h, n, logit);
      rec(p + "ffn_moe_logits", logit);
      add_bias(logit, lw.ffn_gate_inp_b);
      f.assign(static_cast<size_t>(n * E), 0.0f);
      std::vector<float> prob(static_cast<size_t>(L.n_expert));
      std::vector<int32_t> chosen(static_cast<size_t>(L.n_expert_used));
      std::vector<float> wts(chosen.size());
      for (int64_t t = 0; t < n; ++t) {
        const float* lt = logit.data() + t * L.n_expert;
        if (hp_.router.gating == GatingFunc::Sigmoid) {
          for (int32_t e = 0; e < L.n_expert; ++e)
            prob[e] = static_cast<float>(1.0 / (1.0 + std::exp(-double(lt[e]))));
        } else {
          const double mx = *std::max_element(lt, lt + L.n_expert);
          double sum = 0;
          for (int32_t e = 0; e < L.n_expert; ++e) sum += std::exp(double(lt[e]) - mx);
          for (int32_t e = 0; e < L.n_expert; ++e)
            prob[e] = static_cast<float>(std::exp(double(lt[e]) - mx) / sum);
        }
        route_experts(hp_.router, prob, lw.exp_probs_b, chosen, wts);
        row.assign(h.begin() + t * E, h.begin() + (t + 1) * E);
        for (size_t i = 0; i < chosen.size(); ++i) {
          const int32_t e = chosen[i];
          const moe::ExpertWeights ew = w_.experts->get(il, e);
          auto bias = [e](std::span<const float> b, int64_t width) {
            return b.empty() ? b : b.subspan(static_cast<size_t>(e * width), width);
          };
          const int64_t F = L.n_ff_expert;
          ffn(ew.gate, ew.up, ew.down, row, 1, y, bias(lw.ffn_gate_exps_b, F),
              bias(lw.ffn_up_exps_b, F), bias(lw.ffn_down_exps_b, E));
          for (int64_t j = 0; j < E; ++j) f[t * E + j] += static_cast<float>(double(wts[i]) * y[j]);
        }
      }
      if (L.n_ff_shexp > 0) {
        Vec shared;
        ffn(lw.ffn_gate_shexp, lw.ffn_up_shexp, lw.ffn_down_shexp, h, n, shared);
        for (size_t i = 0; i < f.size(); ++i) f[i] += shared[i];
      }
    } else {
      ffn(lw.ffn_gate, lw.ffn_up, lw.ffn_down, h, n, f);
    }
    if (!lw.post_ffn_norm.empty()) rmsnorm(f, E, hp_.post_norm_eps, lw.post_ffn_norm);
    rec(p + "ffn_out", f);
    for (size_t i = 0; i < x.size(); ++i) x[i] += f[i];
    rec(p + "l_out", x);
  }

  // Only the rows whose logits are wanted go through the output head.
  const int64_t first = all_logits ? 0 : n - 1;
  Vec last(x.begin() + first * E, x.end());
  rmsnorm(last, E, hp_.rms_eps, w_.output_norm);
  if (capture_) capture_->record("result_norm", last, n - first);
  matmul(w_.output, last, n - first, logits_);
  for (float& l : logits_) {
    l *= hp_.logit_scale;
    if (hp_.final_softcap > 0) l = hp_.final_softcap * std::tanh(l / hp_.final_softcap);
  }
  if (capture_) capture_->record("result_output", logits_, n - first);
  n_pos_ += static_cast<int32_t>(n);
  return std::span<const float>(logits_);
}

}  // namespace kiln::model
