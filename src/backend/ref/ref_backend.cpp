// backend/ref/ref_backend.cpp: the scalar oracle. Every op in plain loops with double
// accumulators where a sum is involved, weights read through quant::dequantize_row, so the
// only approximations are the ones the op itself defines (f16 KV planes, ggml's gelu form).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/backend.h"
#include "core/check.h"
#include "quant/quant.h"

namespace kiln {
namespace {

void dequant_row(const WeightMatrix& w, int64_t r, std::span<float> dst) {
  quant::dequantize_row(w.dtype, w.row(r), dst);
}

class RefBackend final : public Backend {
 public:
  std::string_view name() const override { return "ref"; }

  void matmul(const WeightMatrix& w, std::span<const float> x, int64_t n_tok,
              std::span<float> y) override {
    KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * w.n_cols, "x {} != {}x{}", x.size(), n_tok,
               w.n_cols);
    KILN_CHECK(static_cast<int64_t>(y.size()) == n_tok * w.n_rows, "y {} != {}x{}", y.size(), n_tok,
               w.n_rows);
    std::vector<float> row(static_cast<size_t>(w.n_cols));
    for (int64_t r = 0; r < w.n_rows; ++r) {
      dequant_row(w, r, row);
      for (int64_t t = 0; t < n_tok; ++t) {
        const float* xt = x.data() + t * w.n_cols;
        double acc = 0;
        for (int64_t c = 0; c < w.n_cols; ++c) acc += double(row[c]) * double(xt[c]);
        y[t * w.n_rows + r] = static_cast<float>(acc);
      }
    }
  }

  void get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                std::span<float> out) override {
    KILN_CHECK(out.size() == ids.size() * static_cast<size_t>(w.n_cols));
    for (size_t i = 0; i < ids.size(); ++i) {
      KILN_CHECK(ids[i] >= 0 && ids[i] < w.n_rows, "row id {} of {}", ids[i], w.n_rows);
      dequant_row(w, ids[i], out.subspan(i * w.n_cols, w.n_cols));
    }
  }

  void rmsnorm(std::span<const float> x, std::span<const float> weight, int64_t n, float eps,
               std::span<float> y) override {
    KILN_CHECK(n > 0 && x.size() % n == 0 && y.size() == x.size());
    KILN_CHECK(weight.empty() || static_cast<int64_t>(weight.size()) == n);
    for (size_t r = 0; r < x.size() / n; ++r) {
      const float* xr = x.data() + r * n;
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
      const double inv = 1.0 / std::sqrt(ss / n + eps);
      for (int64_t i = 0; i < n; ++i)
        y[r * n + i] = static_cast<float>(xr[i] * inv * (weight.empty() ? 1.0 : weight[i]));
    }
  }

  void rope(std::span<float> x, int64_t n_tok, int64_t n_head, int64_t head_dim,
            std::span<const int32_t> pos, const RopeParams& p) override {
    KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * n_head * head_dim);
    KILN_CHECK(static_cast<int64_t>(pos.size()) == n_tok);
    KILN_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= head_dim, "n_rot {}", p.n_rot);
    const int64_t half = p.n_rot / 2;
    KILN_CHECK(p.freq_factors.empty() || static_cast<int64_t>(p.freq_factors.size()) == half,
               "{} rope factors for n_rot {}", p.freq_factors.size(), p.n_rot);
    const RopeYarnTerms yarn = rope_yarn_terms(p);
    for (int64_t t = 0; t < n_tok; ++t) {
      for (int64_t h = 0; h < n_head; ++h) {
        float* v = x.data() + (t * n_head + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const double theta = double(pos[t]) * rope_pair_freq(p, yarn, i);
          const double c = std::cos(theta) * yarn.mscale, s = std::sin(theta) * yarn.mscale;
          const int64_t i0 = p.style == RopeStyle::Normal ? 2 * i : i;
          const int64_t i1 = p.style == RopeStyle::Normal ? 2 * i + 1 : i + half;
          const double a = v[i0], b = v[i1];
          v[i0] = static_cast<float>(a * c - b * s);
          v[i1] = static_cast<float>(a * s + b * c);
        }
      }
    }
  }

  void softmax(std::span<float> x, int64_t n) override {
    KILN_CHECK(n > 0 && x.size() % n == 0);
    for (size_t r = 0; r < x.size() / n; ++r) {
      float* v = x.data() + r * n;
      const float mx = *std::max_element(v, v + n);
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += std::exp(double(v[i]) - mx);
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(std::exp(double(v[i]) - mx) / sum);
    }
  }

  void swiglu(std::span<const float> gate, std::span<const float> up,
              std::span<float> out) override {
    KILN_CHECK(gate.size() == up.size() && out.size() == up.size());
    for (size_t i = 0; i < out.size(); ++i) {
      const double g = gate[i];
      out[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[i]);
    }
  }

  void swiglu_oai(std::span<const float> gate, std::span<const float> up, std::span<float> out,
                  float alpha, float limit) override {
    KILN_CHECK(gate.size() == up.size() && out.size() == up.size());
    for (size_t i = 0; i < out.size(); ++i) {
      const double x = std::min(double(gate[i]), double(limit));
      const double y = std::clamp(double(up[i]), -double(limit), double(limit));
      out[i] = static_cast<float>(x / (1.0 + std::exp(-double(alpha) * x)) * (y + 1.0));
    }
  }

  void geglu(std::span<const float> gate, std::span<const float> up,
             std::span<float> out) override {
    KILN_CHECK(gate.size() == up.size() && out.size() == up.size());
    constexpr double kSqrt2OverPi = 0.79788456080286535587989211986876;
    for (size_t i = 0; i < out.size(); ++i) {
      const double g = gate[i];
      const double gelu = 0.5 * g * (1.0 + std::tanh(kSqrt2OverPi * g * (1.0 + 0.044715 * g * g)));
      out[i] = static_cast<float>(gelu * up[i]);
    }
  }

  void add(std::span<const float> a, std::span<const float> b, std::span<float> out) override {
    KILN_CHECK(a.size() == b.size() && out.size() == a.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = a[i] + b[i];
  }
  void mul(std::span<const float> a, std::span<const float> b, std::span<float> out) override {
    KILN_CHECK(a.size() == b.size() && out.size() == a.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = a[i] * b[i];
  }
  void scale(std::span<float> x, float s) override {
    for (float& v : x) v *= s;
  }
  void softcap(std::span<float> x, float cap) override {
    KILN_CHECK(cap > 0);
    for (float& v : x) v = static_cast<float>(cap * std::tanh(double(v) / cap));
  }
  void sigmoid(std::span<float> x) override {
    for (float& v : x) v = static_cast<float>(1.0 / (1.0 + std::exp(-double(v))));
  }

  void store_rows_f16(std::span<const float> src, int64_t width, std::span<const int32_t> rows,
                      std::span<f16> plane) override {
    KILN_CHECK(width > 0 && src.size() == rows.size() * static_cast<size_t>(width));
    KILN_CHECK(plane.size() % width == 0);
    const int64_t n_phys = static_cast<int64_t>(plane.size()) / width;
    for (size_t i = 0; i < rows.size(); ++i) {
      KILN_CHECK(rows[i] >= 0 && rows[i] < n_phys, "row {} of {}", rows[i], n_phys);
      for (int64_t c = 0; c < width; ++c)
        plane[rows[i] * width + c] = f32_to_f16(src[i * width + c]);
    }
  }

  void attention(const AttentionArgs& a) override {
    KILN_CHECK(a.n_head > 0 && a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0);
    const int64_t hd = a.head_dim, q_w = a.n_head * hd, kv_w = a.n_head_kv * hd;
    const int64_t n_kv = static_cast<int64_t>(a.kv_rows.size());
    KILN_CHECK(static_cast<int64_t>(a.q.size()) == a.n_q * q_w);
    KILN_CHECK(a.out.size() == a.q.size());
    KILN_CHECK(static_cast<int64_t>(a.q_pos.size()) == a.n_q);
    KILN_CHECK(static_cast<int64_t>(a.kv_pos.size()) == n_kv);
    KILN_CHECK(a.k.size() == a.v.size() && a.k.size() % kv_w == 0);
    KILN_CHECK(a.sinks.empty() || static_cast<int64_t>(a.sinks.size()) == a.n_head);
    const int64_t n_phys = static_cast<int64_t>(a.k.size()) / kv_w;
    const int64_t group = a.n_head / a.n_head_kv;
    std::vector<double> logit(static_cast<size_t>(n_kv));
    std::vector<double> acc(static_cast<size_t>(hd));
    for (int64_t i = 0; i < a.n_q; ++i) {
      for (int64_t h = 0; h < a.n_head; ++h) {
        const float* q = a.q.data() + i * q_w + h * hd;
        const int64_t kvh = h / group;
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < n_kv; ++j) {
          const bool visible =
              a.kv_pos[j] <= a.q_pos[i] && (a.window <= 0 || a.q_pos[i] - a.kv_pos[j] < a.window);
          if (!visible) {
            logit[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          const int32_t pr = a.kv_rows[j];
          KILN_CHECK(pr >= 0 && pr < n_phys, "kv row {} of {}", pr, n_phys);
          const f16* k = a.k.data() + pr * kv_w + kvh * hd;
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += double(q[d]) * f16_to_f32(k[d]);
          double l = dot * a.scale;
          if (a.softcap > 0) l = a.softcap * std::tanh(l / a.softcap);
          logit[j] = l;
          mx = std::max(mx, l);
        }
        float* o = a.out.data() + i * q_w + h * hd;
        if (mx == -std::numeric_limits<double>::infinity()) {
          std::fill(o, o + hd, 0.0f);
          continue;
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double sum = 0;
        // A sink is one more logit in the max and the denominator, with no value row.
        if (!a.sinks.empty()) {
          const double sink = a.sinks[static_cast<size_t>(h)];
          mx = std::max(mx, sink);
          sum += std::exp(sink - mx);
        }
        for (int64_t j = 0; j < n_kv; ++j) {
          if (logit[j] == -std::numeric_limits<double>::infinity()) continue;
          const double p = std::exp(logit[j] - mx);
          sum += p;
          const f16* v = a.v.data() + a.kv_rows[j] * kv_w + kvh * hd;
          for (int64_t d = 0; d < hd; ++d) acc[d] += p * f16_to_f32(v[d]);
        }
        for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<float>(acc[d] / sum);
      }
    }
  }

  int64_t argmax(std::span<const float> x) override {
    KILN_CHECK(!x.empty());
    int64_t best = 0;
    for (size_t i = 1; i < x.size(); ++i)
      if (x[i] > x[best]) best = static_cast<int64_t>(i);
    return best;
  }
};

}  // namespace

std::unique_ptr<Backend> make_ref_backend() { return std::make_unique<RefBackend>(); }

}  // namespace kiln
