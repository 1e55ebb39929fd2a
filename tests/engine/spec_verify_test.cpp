// tests/engine/spec_verify_test.cpp: the acceptance rules on synthetic distributions, where
// the exact answer is known: greedy keeps the longest argmax-matching prefix; the rejection
// rule's first emitted token is distributed as p whatever q is (Monte Carlo + chi-square).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "sampling/spec_verify.h"

namespace kiln {
namespace {

TEST(SpecVerify, GreedyAcceptsLongestMatchingPrefix) {
  const int32_t V = 4;
  // Row argmaxes: 2, 1, 3, then a tie between ids 0 and 2 in the last row.
  const std::vector<float> logits = {0, 1, 5, 2, 0, 9, 1, 1, 0, 0, 1, 7, 4, 0, 4, 1};
  const std::vector<int32_t> all_ok = {2, 1, 3};
  auto r = verify_greedy(logits, all_ok, V);
  EXPECT_EQ(r.n_accepted, 3);
  EXPECT_EQ(r.next, 0);  // tie between 0 and 2: smallest id, as greedy() picks
  const std::vector<int32_t> miss_second = {2, 0, 3};
  r = verify_greedy(logits, miss_second, V);
  EXPECT_EQ(r.n_accepted, 1);
  EXPECT_EQ(r.next, 1);
  const std::vector<int32_t> miss_first = {1, 1, 3};
  r = verify_greedy(std::span(logits).first(4 * V), miss_first, V);
  EXPECT_EQ(r.n_accepted, 0);
  EXPECT_EQ(r.next, 2);
}

TEST(SpecVerify, SamplingProbsMatchesSamplerChain) {
  // The dense p must be what Sampler draws from: compare frequencies of Sampler::sample with p.
  const std::vector<float> logits = {1.0f, 2.5f, 0.3f, 2.4f, -1.0f, 1.9f};
  SamplerParams sp;
  sp.temperature = 0.7f;
  sp.top_k = 5;
  sp.top_p = 0.9f;
  sp.min_p = 0.05f;
  Candidates scratch;
  std::vector<float> p;
  sampling_probs(logits, sp, scratch, p);
  double sum = 0;
  for (float v : p) sum += v;
  EXPECT_NEAR(sum, 1.0, 1e-6);
  EXPECT_EQ(p[4], 0.0f);  // cut by top-k
  auto s = Sampler::create(sp, 6);
  ASSERT_TRUE(s.has_value());
  const int n = 60000;
  std::vector<int> count(6);
  for (int i = 0; i < n; ++i) ++count[size_t(s->sample(logits))];
  for (size_t v = 0; v < 6; ++v) {
    const double sd = std::sqrt(n * p[v] * (1 - p[v])) + 1e-9;
    EXPECT_LE(std::abs(count[v] - n * p[v]), 5 * sd + 1) << "token " << v;
  }
}

// Pearson chi-square of counts against expected probabilities; returns (stat, df).
std::pair<double, int> chi_square(const std::vector<int>& count, const std::vector<float>& p,
                                  int n) {
  double stat = 0;
  int df = -1;
  for (size_t v = 0; v < p.size(); ++v) {
    if (p[v] == 0) {
      EXPECT_EQ(count[v], 0) << "token " << v << " has p = 0 but was emitted";
      continue;
    }
    const double e = n * double(p[v]);
    stat += (count[v] - e) * (count[v] - e) / e;
    ++df;
  }
  return {stat, df};
}

// Upper critical value of chi-square(df) at p ~ 1e-4 (Wilson-Hilferty).
double chi_crit(int df) {
  const double z = 3.719, d = df;
  const double t = 1 - 2 / (9 * d) + z * std::sqrt(2 / (9 * d));
  return d * t * t * t;
}

TEST(SpecVerify, RejectionRuleEmitsTargetDistribution) {
  const int32_t V = 5;
  const std::vector<float> p0 = {0.50f, 0.05f, 0.20f, 0.25f, 0.00f};
  const std::vector<float> p1 = {0.10f, 0.10f, 0.10f, 0.10f, 0.60f};
  // q deliberately far from p (and giving mass where p has none).
  const std::vector<float> q0 = {0.05f, 0.60f, 0.05f, 0.10f, 0.20f};
  std::vector<float> target = p0;
  target.insert(target.end(), p1.begin(), p1.end());
  Rng draw(1), verify(2);
  const int n = 200000;
  std::vector<int> first(V), first_onehot(V), second_given_accept(V);
  int n_accept = 0;
  for (int i = 0; i < n; ++i) {
    const int32_t x[1] = {sample_probs(q0, draw)};
    auto r = verify_sampled(target, q0, x, V, verify);
    ++first[size_t(r.n_accepted ? x[0] : r.next)];
    if (r.n_accepted) {
      ++n_accept;
      ++second_given_accept[size_t(r.next)];
    }
    // Deterministic drafter (q one-hot on a fixed guess): still distributed as p.
    const int32_t g[1] = {3};
    auto r2 = verify_sampled(target, {}, g, V, verify);
    ++first_onehot[size_t(r2.n_accepted ? g[0] : r2.next)];
  }
  auto [s1, d1] = chi_square(first, p0, n);
  EXPECT_LT(s1, chi_crit(d1)) << "first token, sampled drafts";
  auto [s2, d2] = chi_square(first_onehot, p0, n);
  EXPECT_LT(s2, chi_crit(d2)) << "first token, one-hot drafts";
  auto [s3, d3] = chi_square(second_given_accept, p1, n_accept);
  EXPECT_LT(s3, chi_crit(d3)) << "bonus token after full acceptance";
  // Acceptance probability is sum_x min(p, q): checks the rule is not "always reject".
  double expect_acc = 0;
  for (int v = 0; v < V; ++v) expect_acc += std::min(p0[size_t(v)], q0[size_t(v)]);
  EXPECT_NEAR(double(n_accept) / n, expect_acc, 0.01);
}

TEST(SpecVerify, ChiSquareDetectsWrongRule) {
  // Power check for the test above: emitting the draft token unconditionally (no rejection)
  // must be caught.
  const std::vector<float> p0 = {0.50f, 0.05f, 0.20f, 0.25f, 0.00f};
  const std::vector<float> q0 = {0.05f, 0.60f, 0.05f, 0.10f, 0.20f};
  Rng draw(1);
  const int n = 20000;
  std::vector<int> count(5);
  for (int i = 0; i < n; ++i) {
    const int32_t x = sample_probs(q0, draw);
    if (p0[size_t(x)] > 0) ++count[size_t(x)];  // skip tokens p forbids (chi_square asserts)
  }
  int m = 0;
  for (int c : count) m += c;
  auto [s, d] = chi_square(count, p0, m);
  EXPECT_GT(s, chi_crit(d));
}

}  // namespace
}  // namespace kiln
