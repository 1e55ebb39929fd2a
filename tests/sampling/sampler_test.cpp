// tests/sampling/sampler_test.cpp: sampling stages on hand-computable distributions, and
// fixed-seed frequency checks whose tolerances (about 4 standard deviations) can fail.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "backend/backend.h"
#include "sampling/sampler.h"

namespace kiln {
namespace {

// logits log(1..4): softmax gives exactly 0.1, 0.2, 0.3, 0.4.
std::vector<float> four() { return {std::log(1.f), std::log(2.f), std::log(3.f), std::log(4.f)}; }

std::set<int32_t> ids(const Candidates& c) {
  std::set<int32_t> s;
  for (const Candidate& x : c.items) s.insert(x.id);
  return s;
}

// Draws n samples and checks each id's frequency against `expect` within 4 sigma.
void expect_frequencies(SamplerParams p, const std::vector<float>& logits,
                        const std::map<int32_t, double>& expect, int n = 20000) {
  auto s = Sampler::create(p, int32_t(logits.size()));
  ASSERT_TRUE(s) << s.error();
  std::map<int32_t, int> count;
  for (int i = 0; i < n; ++i) ++count[s->sample(logits)];
  for (auto [id, c] : count) EXPECT_TRUE(expect.count(id)) << "unexpected id " << id;
  for (auto [id, q] : expect) {
    const double f = double(count[id]) / n;
    const double tol = 4 * std::sqrt(q * (1 - q) / n) + 1e-9;
    EXPECT_NEAR(f, q, tol) << "id " << id;
  }
}

SamplerParams plain(float temp = 1.0f) {
  SamplerParams p;
  p.temperature = temp;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.seed = 1234;
  return p;
}

TEST(Rng, FixedAlgorithmAndSeed) {
  Rng a(42), b(42), c(43);
  std::vector<uint64_t> va, vb, vc;
  for (int i = 0; i < 8; ++i) {
    va.push_back(a.next());
    vb.push_back(b.next());
    vc.push_back(c.next());
  }
  EXPECT_EQ(va, vb);
  EXPECT_NE(va, vc);
  // uniform() is in [0,1) and its mean over many draws is near 1/2.
  Rng r(7);
  double sum = 0;
  for (int i = 0; i < 100000; ++i) {
    double u = r.uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
  }
  EXPECT_NEAR(sum / 100000, 0.5, 4 * std::sqrt(1.0 / 12 / 100000));
}

TEST(Stages, SoftmaxOfLogs) {
  Candidates c;
  auto l = four();
  c.reset(l);
  c.softmax();
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(c.items[i].p, 0.1 * (i + 1), 1e-6);
}

TEST(Stages, TopKKeepsLargest) {
  Candidates c;
  auto l = four();
  c.reset(l);
  top_k(c, 2);
  EXPECT_EQ(ids(c), (std::set<int32_t>{2, 3}));
  EXPECT_EQ(c.items[0].id, 3);  // sorted descending
  top_k(c, 0);                  // off
  EXPECT_EQ(c.items.size(), 2u);
}

TEST(Stages, TopPSmallestPrefix) {
  Candidates c;
  auto l = four();
  c.reset(l);
  top_p(c, 0.5f);  // 0.4 < 0.5, 0.4 + 0.3 >= 0.5
  EXPECT_EQ(ids(c), (std::set<int32_t>{2, 3}));
  c.reset(l);
  top_p(c, 0.35f);  // 0.4 alone is enough
  EXPECT_EQ(ids(c), (std::set<int32_t>{3}));
  c.reset(l);
  top_p(c, 0.0f);  // keeps at least one
  EXPECT_EQ(ids(c), (std::set<int32_t>{3}));
}

TEST(Stages, MinPRelativeToMax) {
  Candidates c;
  auto l = four();
  c.reset(l);
  min_p(c, 0.6f);  // threshold 0.24: keeps 0.3 and 0.4
  EXPECT_EQ(ids(c), (std::set<int32_t>{2, 3}));
  c.reset(l);
  min_p(c, 0.2f);  // threshold 0.08: keeps all
  EXPECT_EQ(c.items.size(), 4u);
}

TEST(Stages, PenaltiesFollowLlamaCpp) {
  Candidates c;
  std::vector<float> l = {2.0f, -2.0f, 1.0f, 0.5f};
  c.reset(l);
  std::vector<int32_t> hist = {0, 1, 1, 3};
  apply_penalties(c, hist, /*repeat=*/2.0f, /*frequency=*/0.25f, /*presence=*/0.5f);
  EXPECT_FLOAT_EQ(c.items[0].logit, 2.0f / 2 - 0.25f - 0.5f);
  EXPECT_FLOAT_EQ(c.items[1].logit, -2.0f * 2 - 2 * 0.25f - 0.5f);
  EXPECT_FLOAT_EQ(c.items[2].logit, 1.0f);  // not in the history
  EXPECT_FLOAT_EQ(c.items[3].logit, 0.5f / 2 - 0.25f - 0.5f);
}

TEST(Stages, GreedyTiesPickSmallestId) {
  Candidates c;
  std::vector<float> l = {1.0f, 3.0f, 3.0f, 2.0f};
  c.reset(l);
  EXPECT_EQ(greedy(c), 1);
}

TEST(Stages, LogitBiasBans) {
  Candidates c;
  auto l = four();
  c.reset(l);
  std::vector<std::pair<int32_t, float>> bias = {{3, -std::numeric_limits<float>::infinity()},
                                                 {0, 1.0f}};
  apply_logit_bias(c, bias);
  EXPECT_EQ(greedy(c), 2);
  EXPECT_FLOAT_EQ(c.items[0].logit, std::log(1.f) + 1.0f);
}

TEST(Sampler, DistMatchesSoftmax) {
  expect_frequencies(plain(), four(), {{0, 0.1}, {1, 0.2}, {2, 0.3}, {3, 0.4}});
}

TEST(Sampler, TemperatureSharpens) {
  // t = 0.5 squares the probabilities: 1, 4, 9, 16 over 30.
  expect_frequencies(plain(0.5f), four(),
                     {{0, 1 / 30.0}, {1, 4 / 30.0}, {2, 9 / 30.0}, {3, 16 / 30.0}});
}

TEST(Sampler, TopKThenRenormalise) {
  SamplerParams p = plain();
  p.top_k = 2;
  expect_frequencies(p, four(), {{2, 3 / 7.0}, {3, 4 / 7.0}});
}

TEST(Sampler, TopPThenRenormalise) {
  SamplerParams p = plain();
  p.top_p = 0.65f;  // 0.4 + 0.3 = 0.7 >= 0.65
  expect_frequencies(p, four(), {{2, 3 / 7.0}, {3, 4 / 7.0}});
}

TEST(Sampler, MinPThenTemperature) {
  // min-p sees temperature-1 probabilities (it runs before temperature, as in llama.cpp):
  // threshold 0.45 * 0.4 = 0.18 keeps ids 1..3; then t = 0.5 squares them: 4, 9, 16 over 29.
  SamplerParams p = plain(0.5f);
  p.min_p = 0.45f;
  expect_frequencies(p, four(), {{1, 4 / 29.0}, {2, 9 / 29.0}, {3, 16 / 29.0}});
}

TEST(Sampler, RepeatPenaltyShiftsMass) {
  // Token 3 seen once with repeat 2: logit log4 / 2 = log 2, so weights 1, 2, 3, 2 over 8.
  SamplerParams p = plain();
  p.repeat_penalty = 2.0f;
  auto s = Sampler::create(p, 4);
  ASSERT_TRUE(s);
  s->accept(3);
  std::map<int32_t, int> count;
  const int n = 20000;
  auto l = four();
  for (int i = 0; i < n; ++i) ++count[s->sample(l)];
  const double expect[4] = {1 / 8.0, 2 / 8.0, 3 / 8.0, 2 / 8.0};
  for (int id = 0; id < 4; ++id)
    EXPECT_NEAR(double(count[id]) / n, expect[id],
                4 * std::sqrt(expect[id] * (1 - expect[id]) / n));
}

TEST(Sampler, PenaltyWindowForgetsOldTokens) {
  SamplerParams p = plain(0.0f);
  p.repeat_penalty = 100.0f;
  p.penalty_last_n = 2;
  auto s = Sampler::create(p, 4);
  ASSERT_TRUE(s);
  auto l = four();
  s->accept(3);
  EXPECT_EQ(s->sample(l), 2);  // 3 penalised
  s->accept(0);
  s->accept(1);  // 3 has left the window of 2
  EXPECT_EQ(s->sample(l), 3);
}

TEST(Sampler, GreedyWhenTemperatureZero) {
  auto s = Sampler::create(plain(0.0f), 4);
  ASSERT_TRUE(s);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(s->sample(four()), 3);
}

TEST(Sampler, SameSeedSameIds) {
  std::vector<float> l(100);
  for (int i = 0; i < 100; ++i) l[i] = std::sin(float(i)) * 3;
  auto run = [&](uint64_t seed) {
    SamplerParams p;  // the default chain
    p.seed = seed;
    auto s = Sampler::create(p, 100);
    std::vector<int32_t> out;
    for (int i = 0; i < 200; ++i) {
      out.push_back(s->sample(l));
      s->accept(out.back());
    }
    return out;
  };
  EXPECT_EQ(run(5), run(5));
  EXPECT_NE(run(5), run(6));
  auto s = Sampler::create(SamplerParams{}, 100);
  std::vector<int32_t> a;
  for (int i = 0; i < 50; ++i) a.push_back(s->sample(l));
  s->reset();
  std::vector<int32_t> b;
  for (int i = 0; i < 50; ++i) b.push_back(s->sample(l));
  EXPECT_EQ(a, b);
}

TEST(Sampler, RejectsBadParameters) {
  SamplerParams p;
  p.top_p = 1.5f;
  EXPECT_FALSE(Sampler::create(p, 10));
  p = {};
  p.min_p = -0.1f;
  EXPECT_FALSE(Sampler::create(p, 10));
  p = {};
  p.logit_bias = {{10, 1.0f}};
  EXPECT_FALSE(Sampler::create(p, 10));
  p = {};
  p.temperature = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(Sampler::create(p, 10));
  p = {};
  p.repeat_penalty = 0;
  EXPECT_FALSE(Sampler::create(p, 10));
  EXPECT_FALSE(Sampler::create(SamplerParams{}, 0));
  EXPECT_TRUE(Sampler::create(SamplerParams{}, 10));
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// Sampling from a backend's top-k candidates (Backend::top_k, what a GPU ships instead of the
// whole row) gives the ids sample() of the whole row gives, draw for draw, whenever
// candidates_needed() says it may; and says it may not where a stage before the cut would
// change the logits.
TEST(Sampler, TopCandidatesGiveTheSameIds) {
  auto be = make_ref_backend();
  std::mt19937_64 rng(77);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  const int32_t V = 3001;
  std::vector<SamplerParams> ps;
  for (float temp : {0.0f, 0.3f, 0.8f, 1.5f})
    for (int32_t k : {1, 5, 40})
      for (float top_p : {0.5f, 0.95f, 1.0f})
        for (float min_p : {0.0f, 0.05f}) {
          SamplerParams p;
          p.temperature = temp, p.top_k = k, p.top_p = top_p, p.min_p = min_p;
          p.seed = uint64_t(ps.size());
          ps.push_back(p);
        }
  int checked = 0;
  for (const SamplerParams& p : ps) {
    auto full = Sampler::create(p, V);
    auto top = Sampler::create(p, V);
    ASSERT_TRUE(full && top);
    const int32_t k = top->candidates_needed(256);
    ASSERT_EQ(k, p.temperature <= 0 ? 1 : p.top_k);
    std::vector<float> logits(V);
    std::vector<int32_t> ids(static_cast<size_t>(k));
    std::vector<float> vals(static_cast<size_t>(k));
    for (int step = 0; step < 50; ++step) {
      for (float& l : logits) l = std::round(nd(rng) * 4) / 4;  // coarse: many ties
      be->top_k(logits, V, k, ids, vals);
      const int32_t a = full->sample(logits), b = top->sample_top(ids, vals);
      ASSERT_EQ(a, b) << "temp " << p.temperature << " k " << p.top_k << " step " << step;
      full->accept(a);
      top->accept(b);
      ++checked;
    }
  }
  EXPECT_EQ(checked, int(ps.size()) * 50);

  // The whole row is needed: a bias, penalties, no top-k cut, a cut above the backend's most.
  SamplerParams p;
  p.logit_bias = {{3, 1.0f}};
  EXPECT_EQ(Sampler::create(p, V)->candidates_needed(256), 0);
  p = SamplerParams{};
  p.repeat_penalty = 1.1f;
  EXPECT_EQ(Sampler::create(p, V)->candidates_needed(256), 0);
  p.penalty_last_n = 0;  // penalties that see no history
  EXPECT_EQ(Sampler::create(p, V)->candidates_needed(256), p.top_k);
  p = SamplerParams{};
  p.top_k = 0;
  EXPECT_EQ(Sampler::create(p, V)->candidates_needed(256), 0);
  p.top_k = 300;
  EXPECT_EQ(Sampler::create(p, V)->candidates_needed(256), 0);
  p.temperature = 0;  // greedy ignores top-k
  EXPECT_EQ(Sampler::create(p, V)->candidates_needed(256), 1);
}

// Constrained decoding's mask: a removed id is never picked, greedy or sampled, even when
// every allowed id is banned by a bias (the uniform fallback must stay inside the mask), and
// the allowed ids keep their relative probabilities.
TEST(Sampler, AllowedMaskRemovesIdsBeforeEveryStage) {
  const std::vector<float> logits = four();  // p = 0.1 0.2 0.3 0.4
  const std::vector<uint8_t> allowed = {1, 1, 0, 0};
  SamplerParams greedy;
  greedy.temperature = 0;
  auto g = Sampler::create(greedy, 4);
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->sample(logits), 3);
  EXPECT_EQ(g->sample(logits, allowed), 1);
  SamplerParams banned = greedy;
  banned.logit_bias = {{0, -INFINITY}, {1, -INFINITY}};
  auto b = Sampler::create(banned, 4);
  EXPECT_LT(b->sample(logits, allowed), 2);
  SamplerParams dist;
  dist.temperature = 1;
  dist.top_k = 0;
  dist.top_p = 1;
  dist.min_p = 0;
  dist.seed = 3;
  auto d = Sampler::create(dist, 4);
  int n1 = 0;
  const int n = 6000;
  for (int i = 0; i < n; ++i) {
    const int32_t id = d->sample(logits, allowed);
    ASSERT_LT(id, 2);
    n1 += id == 1;
  }
  // p(1 | {0, 1}) = 2/3; 4 sigma = 4 * sqrt(n * 2/9).
  EXPECT_NEAR(n1, n * 2.0 / 3.0, 4 * std::sqrt(n * 2.0 / 9.0));
  dist.logit_bias = banned.logit_bias;
  auto db = Sampler::create(dist, 4);
  for (int i = 0; i < 200; ++i) ASSERT_LT(db->sample(logits, allowed), 2);
}

}  // namespace
}  // namespace kiln
