// tests/model/rope_factors_test.cpp: rope frequency factors (Llama 3 rope_freqs, LongRoPE) and
// YaRN, from metadata to angles (issue 34, points 2-4). The angles of the ref and CPU backends
// are checked against a table computed here the way llama.cpp's CPU rope computes it (f32,
// theta advanced by one multiplication per pair), the YaRN constants against hand-computed
// figures, and LongRoPE's choice of factor set against the context size.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <numbers>
#include <random>

#include "backend/backend.h"
#include "common/longrope_file.h"
#include "common/testdata.h"
#include "core/check.h"
#include "engine/session.h"
#include "format/gguf_writer.h"
#include "model/reference.h"
#include "model/weights.h"
#if KILN_HAVE_CPU_BACKEND
#include "backend/cpu/cpu_backend.h"
#endif

namespace kiln {
namespace {

// llama.cpp's rope cache for one position, written from its description: theta starts at pos
// and is multiplied by base^(-2/n_rot) per pair (f32 throughout); pair i's angle is
// theta / factor[i] extrapolated, freq_scale times that interpolated, mixed by YaRN's ramp.
struct Angle {
  float cos, sin;
};
std::vector<Angle> llama_cpp_angles(const RopeParams& p, int32_t pos) {
  float lo = 0, hi = 0;
  auto corr = [&](float beta) {
    return float(p.n_rot) * std::log(float(p.n_ctx_orig) / (beta * 2 * std::numbers::pi_v<float>)) /
           (2 * std::log(p.freq_base));
  };
  if (p.ext_factor != 0) {
    lo = std::max(0.0f, std::floor(corr(p.beta_fast)));
    hi = std::min(float(p.n_rot - 1), std::ceil(corr(p.beta_slow)));
  }
  const float theta_scale = std::pow(p.freq_base, -2.0f / float(p.n_rot));
  std::vector<Angle> out;
  float theta = float(pos);
  for (int64_t i = 0; i < p.n_rot / 2; ++i) {
    const float ff = p.freq_factors.empty() ? 1.0f : p.freq_factors[i];
    const float extrap = theta / ff, interp = p.freq_scale * extrap;
    float angle = interp, mscale = p.attn_factor;
    if (p.ext_factor != 0) {
      const float y = (float(i) - lo) / std::max(0.001f, hi - lo);
      const float mix = (1 - std::min(1.0f, std::max(0.0f, y))) * p.ext_factor;
      angle = interp * (1 - mix) + extrap * mix;
      mscale *= 1.0f + 0.1f * std::log(1.0f / p.freq_scale);
    }
    out.push_back({std::cos(angle) * mscale, std::sin(angle) * mscale});
    theta *= theta_scale;
  }
  return out;
}

// A backend's angles: rotate a head whose every pair is (1, 0).
std::vector<Angle> backend_angles(Backend& be, const RopeParams& p, int32_t pos) {
  const int64_t head_dim = p.n_rot + 2;
  std::vector<float> x(static_cast<size_t>(head_dim), 0.0f);
  const int64_t half = p.n_rot / 2;
  for (int64_t i = 0; i < half; ++i) x[p.style == RopeStyle::NeoX ? i : 2 * i] = 1.0f;
  const int32_t pp[1] = {pos};
  be.rope(x, 1, 1, head_dim, pp, p);
  std::vector<Angle> out;
  for (int64_t i = 0; i < half; ++i) {
    const bool neox = p.style == RopeStyle::NeoX;
    out.push_back({x[neox ? i : 2 * i], x[neox ? i + half : 2 * i + 1]});
  }
  return out;
}

// Llama 3.1's factors as the llama3-ropefreqs fixture holds them (README: factor 8, low 1,
// high 4, original context 256 over a 64-dim head).
const std::vector<float> kLlama3Factors = {1, 1, 1, 1, 1, 1, 1.179f, 1.973f, 3.569f, 7.699f, 8,
                                           8, 8, 8, 8, 8, 8, 8,      8,      8,      8,      8,
                                           8, 8, 8, 8, 8, 8, 8,      8,      8,      8};

std::vector<RopeParams> variants() {
  std::vector<RopeParams> v;
  RopeParams llama3{
      .n_rot = 64, .freq_base = 500000.0f, .freq_scale = 1.0f, .style = RopeStyle::Normal};
  llama3.freq_factors = kLlama3Factors;
  v.push_back(llama3);
  RopeParams yarn{.n_rot = 64,
                  .freq_base = 1e6f,
                  .freq_scale = 0.25f,
                  .style = RopeStyle::NeoX};  // qwen2-yarn: factor 4, original 128
  yarn.ext_factor = 1;
  yarn.n_ctx_orig = 128;
  v.push_back(yarn);
  RopeParams gptoss{.n_rot = 64,
                    .freq_base = 150000.0f,
                    .freq_scale = 1.0f / 32,
                    .style = RopeStyle::NeoX};  // gpt-oss: factor 32
  gptoss.ext_factor = 1;
  gptoss.n_ctx_orig = 4096;
  v.push_back(gptoss);
  RopeParams longrope{.n_rot = 64,
                      .freq_base = 10000.0f,
                      .freq_scale = 1.0f,
                      .style = RopeStyle::NeoX};  // LongRoPE: factors, attn_factor
  static std::vector<float> long_factors;
  long_factors.clear();
  for (int i = 0; i < 32; ++i) long_factors.push_back(1.0f + 0.37f * float(i));
  longrope.freq_factors = long_factors;
  longrope.attn_factor = 1.1902f;
  v.push_back(longrope);
  return v;
}

void expect_angles(Backend& be, const char* what) {
  int n = 0;
  for (const RopeParams& p : variants()) {
    for (int32_t pos : {0, 1, 7, 100, 131, 300}) {
      const std::vector<Angle> want = llama_cpp_angles(p, pos), got = backend_angles(be, p, pos);
      ASSERT_EQ(want.size(), got.size());
      for (size_t i = 0; i < want.size(); ++i) {
        // f32 theta advanced over 32 multiplications: a few ulp of an angle of up to 300 rad.
        const double tol = 2e-4 * (1 + pos / 100.0);
        EXPECT_NEAR(got[i].cos, want[i].cos, tol)
            << what << " variant " << n << " pos " << pos << " pair " << i;
        EXPECT_NEAR(got[i].sin, want[i].sin, tol)
            << what << " variant " << n << " pos " << pos << " pair " << i;
      }
    }
    ++n;
  }
}

TEST(RopeFactors, RefBackendAnglesMatchLlamaCppTable) {
  auto be = make_ref_backend();
  expect_angles(*be, "ref");
}

#if KILN_HAVE_CPU_BACKEND
TEST(RopeFactors, CpuBackendAnglesMatchLlamaCppTable) {
  auto be = make_cpu_backend({.threads = 1});
  expect_angles(*be, "cpu");
}
#endif

// Figures worked by hand from ggml_rope_yarn_corr_dims: corr_dim(beta) =
// n_rot ln(n_ctx_orig / (2 pi beta)) / (2 ln base).
TEST(RopeFactors, YarnTermsByHand) {
  // qwen2-yarn: n_rot 64, base 1e6, original 128. beta 32: 64 ln(0.63662) / 27.631 = -1.046,
  // floor -2, clamped to 0; beta 1: 64 ln(20.372) / 27.631 = 6.98, ceil 7.
  RopeParams p{.n_rot = 64, .freq_base = 1e6f, .freq_scale = 0.25f, .style = RopeStyle::NeoX};
  p.ext_factor = 1;
  p.n_ctx_orig = 128;
  RopeYarnTerms t = rope_yarn_terms(p);
  EXPECT_EQ(t.corr_lo, 0.0f);
  EXPECT_EQ(t.corr_hi, 7.0f);
  EXPECT_NEAR(t.mscale, 1.0 + 0.1 * std::log(4.0), 1e-6);  // 1.13863
  // gpt-oss-like: n_rot 64, base 150000, original 4096, factor 32. beta 32: 64 ln(20.372) /
  // 23.836 = 8.09 -> 8; beta 1: 64 ln(651.9) / 23.836 = 17.40 -> 18.
  RopeParams g{
      .n_rot = 64, .freq_base = 150000.0f, .freq_scale = 1.0f / 32, .style = RopeStyle::NeoX};
  g.ext_factor = 1;
  g.n_ctx_orig = 4096;
  g.attn_factor = 0.5f;
  t = rope_yarn_terms(g);
  EXPECT_EQ(t.corr_lo, 8.0f);
  EXPECT_EQ(t.corr_hi, 18.0f);
  EXPECT_NEAR(t.mscale, 0.5 * (1.0 + 0.1 * std::log(32.0)), 1e-6);
  // No YaRN: the magnitude is attn_factor alone and the ramp is unused.
  RopeParams plain{.n_rot = 64, .freq_base = 1e4f, .freq_scale = 1.0f, .style = RopeStyle::Normal};
  plain.attn_factor = 1.25f;
  t = rope_yarn_terms(plain);
  EXPECT_EQ(t.ext_factor, 0.0f);
  EXPECT_EQ(t.mscale, 1.25f);
}

TEST(RopeFactors, Llama3FixtureBindsRopeFreqsToEveryLayer) {
  auto m = Model::load(testing::model_path("llama3-ropefreqs-f16.gguf"));
  ASSERT_TRUE(m.has_value()) << m.error();
  const model::HParams& hp = (*m)->hparams();
  ASSERT_EQ((*m)->weights().rope_freqs.size(), size_t(hp.n_rot / 2));
  for (const model::LayerDesc& L : hp.layers) {
    ASSERT_EQ(L.rope.freq_factors.size(), kLlama3Factors.size());
    EXPECT_EQ(L.rope.freq_factors.data(), (*m)->weights().rope_freqs.data());
    for (size_t i = 0; i < kLlama3Factors.size(); ++i)
      EXPECT_NEAR(L.rope.freq_factors[i], kLlama3Factors[i], 1e-3) << i;
  }
}

TEST(RopeFactors, Qwen2YarnFixtureReadsTheScalingKeys) {
  auto m = Model::load(testing::model_path("qwen2-yarn-f16.gguf"));
  ASSERT_TRUE(m.has_value()) << m.error();
  const RopeParams& p = (*m)->hparams().layers[0].rope;
  EXPECT_EQ(p.ext_factor, 1.0f);
  EXPECT_EQ(p.freq_scale, 0.25f);  // factor 4
  EXPECT_EQ(p.n_ctx_orig, 128);
  EXPECT_EQ(p.beta_fast, 32.0f);
  EXPECT_EQ(p.beta_slow, 1.0f);
  EXPECT_EQ(p.attn_factor, 1.0f);
  EXPECT_TRUE(p.freq_factors.empty());
}

// LongRoPE's choice (llama.cpp's get_rope_factors): rope_freqs when present, else the long set
// once the context passes rope.scaling.original_context_length, else the short set.
TEST(RopeFactors, LongRopeChoosesBySize) {
  model::HParams hp;
  hp.layers.resize(2);
  for (model::LayerDesc& L : hp.layers) L.rope.n_ctx_orig = 4096;
  const float long_f[2] = {2, 3}, short_f[2] = {1, 1.5f}, freqs[2] = {4, 5};
  model::Weights w;
  w.rope_long = long_f;
  w.rope_short = short_f;
  EXPECT_EQ(model::rope_factors_for(w, hp, 4096).data(), short_f);
  EXPECT_EQ(model::rope_factors_for(w, hp, 4097).data(), long_f);
  EXPECT_EQ(model::rope_factors_for(w, hp, 1).data(), short_f);
  hp.n_ctx_train = 131072;
  model::attach_rope_factors(w, hp);
  for (const model::LayerDesc& L : hp.layers) EXPECT_EQ(L.rope.freq_factors.data(), long_f);
  hp.n_ctx_train = 4096;
  model::attach_rope_factors(w, hp);
  for (const model::LayerDesc& L : hp.layers) EXPECT_EQ(L.rope.freq_factors.data(), short_f);
  w.rope_freqs = freqs;
  EXPECT_EQ(model::rope_factors_for(w, hp, 1 << 20).data(), freqs);
  model::Weights none;
  EXPECT_TRUE(model::rope_factors_for(none, hp, 1 << 20).empty());
}

// A phi3 file with LongRoPE factors: the Model's own set follows the training context against
// the original one (llama.cpp's choice when no context is given), a Session's follows its own
// context, and the fast CPU pass agrees with the reference pass given the same set.
TEST(RopeFactors, Phi3LongRopeFastMatchesReference) {
  auto src = GgufFile::open(testing::model_path("phi3-f16.gguf"));
  ASSERT_TRUE(src.has_value()) << src.error();
  for (bool use_long : {false, true}) {
    const int32_t n_ctx_train = *src->get<int32_t>("phi3.context_length");
    const testing::LongRopeFile file = testing::phi3_with_longrope(
        *src, use_long ? uint32_t(n_ctx_train / 2) : uint32_t(n_ctx_train));
    const std::vector<float>&long_f = file.long_f, &short_f = file.short_f;
    auto g = GgufFile::parse(
        MappedFile::from_bytes(file.writer.write_to_memory(), "phi3-longrope.gguf"));
    ASSERT_TRUE(g.has_value()) << g.error();
    auto m = Model::from_gguf(std::move(*g));
    ASSERT_TRUE(m.has_value()) << m.error();
    const RopeParams& p = (*m)->hparams().layers[0].rope;
    ASSERT_EQ(p.freq_factors.size(), long_f.size());
    EXPECT_EQ(p.freq_factors[1], use_long ? long_f[1] : short_f[1]);
    EXPECT_FLOAT_EQ(p.attn_factor, 1.19f);
#if KILN_HAVE_CPU_BACKEND
    auto be = make_cpu_backend({.threads = 2});
    const int32_t orig = p.n_ctx_orig;
    for (const int32_t n_ctx : {64, orig, orig + 1}) {
      if (n_ctx > n_ctx_train) continue;
      const bool want_long = n_ctx > orig;
      Session fast(*m, *be, n_ctx);
      ASSERT_EQ(fast.rope_factors().data(),
                want_long ? (*m)->weights().rope_long.data() : (*m)->weights().rope_short.data())
          << "n_ctx " << n_ctx;
      model::HParams hp = (*m)->hparams();
      for (model::LayerDesc& L : hp.layers) L.rope.freq_factors = fast.rope_factors();
      model::ReferenceSession ref(hp, (*m)->weights(), n_ctx);
      std::vector<int32_t> toks(40);
      std::mt19937 rng(5);
      for (int32_t& t : toks) t = static_cast<int32_t>(rng() % uint32_t((*m)->n_vocab()));
      auto a = fast.eval(toks, true);
      auto b = ref.eval(toks, true);
      ASSERT_TRUE(a.has_value() && b.has_value());
      double num = 0, den = 0;
      for (size_t i = 0; i < b->size(); ++i) {
        num += ((*a)[i] - (*b)[i]) * double((*a)[i] - (*b)[i]);
        den += double((*b)[i]) * (*b)[i];
      }
      EXPECT_LE(std::sqrt(num / den), 1e-2) << "n_ctx " << n_ctx;
    }
    // A batch may not mix sessions whose contexts chose different sets.
    if (use_long) {
      Session s_short(*m, *be, 64), s_long(*m, *be, orig + 1);
      BatchEval batch(*m, *be, 8);
      const int32_t tok = 1;
      const BatchEval::Item items[2] = {{&s_short, {&tok, 1}}, {&s_long, {&tok, 1}}};
      auto r = batch.eval(items);
      ASSERT_FALSE(r.has_value());
      EXPECT_NE(r.error().find("LongRoPE"), std::string::npos) << r.error();
    }
#endif
  }
}

}  // namespace
}  // namespace kiln
