// tests/model/routing_test.cpp: the router's expert selection (route_experts, on hand-computed
// cases) and the benchmark routing overrides (model/routing.h). Draws are
// distinct, deterministic in (layer, position, token), uniform or Zipf as named (chi-square
// against the distribution computed here from its definition), weighted by the router's
// renormalised probabilities; a forward pass with the override keeps the streaming store's
// identity (tests/moe) and the default is the model's own routing, byte for byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <vector>

#include "common/testdata.h"
#include "engine/session.h"
#include "model/routing.h"

#if KILN_HAVE_CPU_BACKEND
#include "backend/cpu/cpu_backend.h"
#endif

namespace kiln::model {
namespace {

TEST(Routing, ParseNamesEveryFormAndRejectsTheRest) {
  EXPECT_FALSE(parse_routing("model")->active());
  EXPECT_EQ(parse_routing("uniform")->kind, RoutingOverride::Kind::Uniform);
  auto z = parse_routing("zipf");
  ASSERT_TRUE(z.has_value());
  EXPECT_EQ(z->kind, RoutingOverride::Kind::Zipf);
  EXPECT_EQ(z->zipf_s, 1.0);
  auto z2 = parse_routing("zipf:1.5");
  ASSERT_TRUE(z2.has_value());
  EXPECT_EQ(z2->zipf_s, 1.5);
  EXPECT_EQ(routing_name(*z2), "zipf:1.5");
  for (const char* bad :
       {"", "Uniform", "zipf:", "zipf:0", "zipf:-1", "zipf:9", "zipf:1x", "top2"}) {
    auto r = parse_routing(bad);
    ASSERT_FALSE(r.has_value()) << bad;
    EXPECT_NE(r.error().find("moe_routing '" + std::string(bad) + "'"), std::string::npos)
        << r.error();
  }
}

// Router probabilities that differ per expert, so the weights' renormalisation is visible.
std::vector<float> probs(int n) {
  std::vector<float> p(static_cast<size_t>(n));
  double sum = 0;
  for (int e = 0; e < n; ++e) sum += p[e] = float(1 + (e * 7) % 13);
  for (float& x : p) x = float(x / sum);
  return p;
}

// Pearson's statistic of observed counts against expected ones.
double chi2(const std::vector<double>& obs, const std::vector<double>& expect) {
  double c = 0;
  for (size_t i = 0; i < obs.size(); ++i)
    c += (obs[i] - expect[i]) * (obs[i] - expect[i]) / expect[i];
  return c;
}

TEST(Routing, UniformDrawsAreDistinctDeterministicAndEven) {
  const int n = 128, k = 8, draws = 20000;
  const RoutingOverride u = *parse_routing("uniform");
  const std::vector<float> p = probs(n);
  std::vector<double> count(n, 0.0);
  std::vector<int32_t> ids(k), again(k);
  std::vector<float> w(k), w2(k);
  int same_as_next_pos = 0;
  for (int t = 0; t < draws; ++t) {
    const int32_t il = t % 5, pos = t / 5, token = (t * 31) % 1000;
    override_route(u, il, pos, token, p, ids, w);
    std::set<int32_t> distinct(ids.begin(), ids.end());
    ASSERT_EQ(distinct.size(), size_t(k));
    ASSERT_GE(*distinct.begin(), 0);
    ASSERT_LT(*distinct.rbegin(), n);
    double psum = 0, wsum = 0;
    for (int i = 0; i < k; ++i) psum += p[ids[i]];
    for (int i = 0; i < k; ++i) {
      EXPECT_NEAR(w[i], p[ids[i]] / psum, 1e-6);
      wsum += w[i];
    }
    EXPECT_NEAR(wsum, 1.0, 1e-5);
    for (int32_t id : ids) count[id] += 1;
    override_route(u, il, pos, token, p, again, w2);
    ASSERT_EQ(again, ids) << "not a function of (layer, position, token)";
    override_route(u, il, pos + 1, token, p, again, w2);
    same_as_next_pos += again == ids;
  }
  EXPECT_LT(same_as_next_pos, 3);
  // 127 degrees of freedom: the 99.99th percentile is about 200.
  const std::vector<double> expect(n, double(draws) * k / n);
  EXPECT_LT(chi2(count, expect), 200.0);
}

TEST(Routing, ZipfFirstDrawFollowsTheLawAndLayersRankDifferently) {
  const int n = 64, k = 4, draws = 40000;
  const RoutingOverride z = *parse_routing("zipf:1.2");
  const std::vector<float> p = probs(n);
  std::vector<double> first_by_rank(n, 0.0), any_by_rank(n, 0.0);
  std::vector<int32_t> rank_of(n);
  for (int r = 0; r < n; ++r) rank_of[zipf_rank_expert(3, r, n)] = r;
  std::vector<int32_t> ids(k);
  std::vector<float> w(k);
  for (int t = 0; t < draws; ++t) {
    override_route(z, 3, t, t % 97, p, ids, w);
    first_by_rank[rank_of[ids[0]]] += 1;
    for (int32_t id : ids) any_by_rank[rank_of[id]] += 1;
  }
  // The first draw is one draw from the Zipf law over the ranks.
  double norm = 0;
  for (int r = 0; r < n; ++r) norm += std::pow(r + 1.0, -1.2);
  std::vector<double> expect(n);
  for (int r = 0; r < n; ++r) expect[r] = draws * std::pow(r + 1.0, -1.2) / norm;
  // 63 degrees of freedom: the 99.99th percentile is about 118.
  EXPECT_LT(chi2(first_by_rank, expect), 118.0);
  // Later draws skip the taken experts, so the popular ranks still lead every draw's share.
  EXPECT_GT(any_by_rank[0], any_by_rank[8]);
  EXPECT_GT(any_by_rank[8], any_by_rank[63]);
  int differ = 0;
  for (int il = 0; il < 8; ++il)
    differ += zipf_rank_expert(il, 0, n) != zipf_rank_expert(il + 1, 0, n);
  EXPECT_GE(differ, 6) << "layers should favour different experts";
}

#if KILN_HAVE_CPU_BACKEND
std::vector<float> prefill_and_steps(const std::shared_ptr<const Model>& m, Backend& be,
                                     int n_gen) {
  const std::vector<int32_t> prompt = {1, 45, 496, 173, 17, 432, 172, 97, 278};
  Session s(m, be, 64);
  auto lg = s.eval(prompt, true);
  EXPECT_TRUE(lg.has_value()) << lg.error();
  if (!lg.has_value()) return {};
  std::vector<float> out(lg->begin(), lg->end());
  int32_t id = 0;
  for (int i = 0; i < n_gen; ++i) {
    const std::span<const float> last(out.end() - m->n_vocab(), out.end());
    id = static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
    auto st = s.eval(std::span<const int32_t>(&id, 1), false);
    EXPECT_TRUE(st.has_value()) << st.error();
    if (!st.has_value()) return {};
    out.insert(out.end(), st->begin(), st->end());
  }
  return out;
}

TEST(Routing, DefaultIsTheModelsRoutingAndOverridesChangeTheExperts) {
  const std::string path = testing::model_path("qwen3moe-q4_k_m.gguf");
  auto be = make_cpu_backend({.threads = 2});
  auto plain = Model::load(path);
  ASSERT_TRUE(plain.has_value()) << plain.error();
  auto model = Model::load(path, {{}, *parse_routing("model")});
  auto uniform = Model::load(path, {{}, *parse_routing("uniform")});
  ASSERT_TRUE(model.has_value() && uniform.has_value());
  const std::vector<float> a = prefill_and_steps(*plain, *be, 6);
  const std::vector<float> b = prefill_and_steps(*model, *be, 6);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
      << "moe_routing model must be the plain run, bit for bit";
  const std::vector<float> c = prefill_and_steps(*uniform, *be, 6);
  ASSERT_EQ(c.size(), a.size());
  EXPECT_NE(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)), 0)
      << "the uniform override routed as the model does";
  // Prefill and decode draw the same experts for the same (position, token): evaluating the
  // prompt token by token gives the batched prefill's last logits (up to the batch's
  // different reduction order in the dense matmuls, hence a tolerance, not bits).
  Session s(*uniform, *be, 64);
  const std::vector<int32_t> prompt = {1, 45, 496, 173, 17, 432, 172, 97, 278};
  std::span<const float> last;
  for (int32_t t : prompt) {
    auto st = s.eval(std::span<const int32_t>(&t, 1), false);
    ASSERT_TRUE(st.has_value()) << st.error();
    last = *st;
  }
  const size_t nv = static_cast<size_t>((*uniform)->n_vocab());
  const size_t off = (prompt.size() - 1) * nv;
  double worst = 0;
  for (size_t i = 0; i < nv; ++i) worst = std::max(worst, double(std::fabs(last[i] - c[off + i])));
  EXPECT_LT(worst, 2e-2) << "token-by-token and batched prefill routed differently";
}
#endif

// route_experts (llama.cpp's build_moe_ffn selection) on hand-computed cases: the plain
// softmax top-k, ties, the selection bias (chooses, does not weigh), normalisation and scale,
// expert groups (best two per group, ties to the lower group) and the clamp of the sum.
struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> wts;
};
Routed route(const RouterParams& rp, std::vector<float> prob, std::vector<float> bias, size_t k) {
  Routed r{std::vector<int32_t>(k), std::vector<float>(k)};
  route_experts(rp, prob, bias, r.ids, r.wts);
  return r;
}

TEST(RouteExperts, TopKRenormalisedLikeTheSoftmaxRows) {
  const Routed r = route({}, {0.1f, 0.4f, 0.2f, 0.3f}, {}, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 3}));
  EXPECT_NEAR(r.wts[0], 0.4 / 0.7, 1e-6);
  EXPECT_NEAR(r.wts[1], 0.3 / 0.7, 1e-6);
}

TEST(RouteExperts, TiesGoToTheLowerId) {
  EXPECT_EQ(route({}, {0.2f, 0.3f, 0.3f, 0.2f}, {}, 2).ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(route({}, {0.2f, 0.3f, 0.3f, 0.2f}, {}, 3).ids, (std::vector<int32_t>{1, 2, 0}));
  EXPECT_EQ(route({}, {0.25f, 0.25f, 0.25f, 0.25f}, {}, 4).ids, (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(RouteExperts, BiasChoosesButTheUnbiasedProbabilitiesWeigh) {
  RouterParams rp;
  rp.gating = GatingFunc::Sigmoid;
  rp.norm_weights = true;
  rp.weights_scale = 2.5f;
  // Scores 0.9-1, 0.5, 0.6, 0.1+1: experts 3 then 2, weighted by 0.1 and 0.6.
  const std::vector<float> prob = {0.9f, 0.5f, 0.6f, 0.1f}, bias = {-1.0f, 0.0f, 0.0f, 1.0f};
  Routed r = route(rp, prob, bias, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 2}));
  EXPECT_NEAR(r.wts[0], 2.5 * 0.1 / 0.7, 1e-6);
  EXPECT_NEAR(r.wts[1], 2.5 * 0.6 / 0.7, 1e-6);
  rp.norm_weights = false;  // the raw probabilities, scaled
  r = route(rp, prob, bias, 2);
  EXPECT_NEAR(r.wts[0], 2.5 * 0.1, 1e-6);
  EXPECT_NEAR(r.wts[1], 2.5 * 0.6, 1e-6);
  // Without the bias the same probabilities choose experts 0 and 2.
  EXPECT_EQ(route(rp, prob, {}, 2).ids, (std::vector<int32_t>{0, 2}));
}

TEST(RouteExperts, GroupsScoreTheirBestTwoAndOnlyTheBestGroupsStay) {
  RouterParams rp;
  rp.n_group = 2;
  rp.n_group_used = 1;
  // Group 0 holds the best expert (0.9) but scores 0.9 + 0.1 = 1.0; group 1 scores 0.6 + 0.5.
  const std::vector<float> prob = {0.9f, 0.1f, 0.1f, 0.1f, 0.6f, 0.5f, 0.2f, 0.2f};
  Routed r = route(rp, prob, {}, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 5}));
  EXPECT_NEAR(r.wts[0], 0.6 / 1.1, 1e-6);
  EXPECT_NEAR(r.wts[1], 0.5 / 1.1, 1e-6);
  // The selection bias counts in the group score: +0.2 on expert 1 makes group 0 score 1.2.
  std::vector<float> bias(8, 0.0f);
  bias[1] = 0.2f;
  r = route(rp, prob, bias, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1}));
  EXPECT_NEAR(r.wts[0], 0.9 / 1.0, 1e-6);  // weights from the unbiased 0.9 and 0.1
  EXPECT_NEAR(r.wts[1], 0.1 / 1.0, 1e-6);
  // Two equal values both count (a top-2, not the two best distinct values): 0.8 > 0.75.
  EXPECT_EQ(route(rp, {0.4f, 0.4f, 0.0f, 0.0f, 0.7f, 0.05f, 0.0f, 0.0f}, {}, 1).ids,
            (std::vector<int32_t>{0}));
  // Equal group scores: the lower group.
  EXPECT_EQ(route(rp, {0.0f, 0.5f, 0.5f, 0.0f, 0.5f, 0.5f, 0.0f, 0.0f}, {}, 2).ids,
            (std::vector<int32_t>{1, 2}));
  // Four groups of two, two used: groups 3 (1.5) and 1 (1.1) stay; the best four of them.
  rp.n_group = 4;
  rp.n_group_used = 2;
  EXPECT_EQ(route(rp, {0.9f, 0.0f, 0.6f, 0.5f, 0.3f, 0.3f, 0.8f, 0.7f}, {}, 4).ids,
            (std::vector<int32_t>{6, 7, 2, 3}));
}

TEST(RouteExperts, TheNormalisingSumIsClampedAtTheSmallestNormalHalf) {
  const Routed r = route({}, {1e-5f, 3e-5f, 0.0f, 0.0f}, {}, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 0}));
  EXPECT_NEAR(r.wts[0], 3e-5 / 6.103515625e-5, 1e-6);
  EXPECT_NEAR(r.wts[1], 1e-5 / 6.103515625e-5, 1e-6);
}

}  // namespace
}  // namespace kiln::model
