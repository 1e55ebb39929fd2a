// tests/golden/golden.cpp: fixture loading and the README's comparison rules.
#include "golden.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/testdata.h"
#include "core/check.h"

namespace kiln::golden {

Golden load(const std::string& name) {
  Golden g;
  g.name = name;
  const std::string dir = testing::shared_dir() + "/testdata/golden/";
  const auto j = nlohmann::json::parse(testing::read_file(dir + name + ".json"));
  g.n_vocab = j.at("n_vocab").get<int32_t>();
  g.prompt_tokens = j.at("prompt_tokens").get<std::vector<int32_t>>();
  for (const auto& p : j.at("prompt_top"))
    g.prompt_top.push_back(
        {p.at("ids").get<std::vector<int32_t>>(), p.at("logits").get<std::vector<float>>()});
  g.greedy = j.at("greedy").get<std::vector<int32_t>>();
  g.greedy_margins = j.at("greedy_margins").get<std::vector<float>>();
  KILN_CHECK(g.prompt_top.size() == g.prompt_tokens.size());
  KILN_CHECK(g.greedy.size() == g.greedy_margins.size());
  const std::string logits = dir + name + ".logits.f32";
  if (std::filesystem::exists(logits)) {
    const std::string raw = testing::read_file(logits);
    KILN_CHECK(raw.size() == g.prompt_tokens.size() * size_t(g.n_vocab) * 4, "{}: {} bytes", logits,
               raw.size());
    g.full_logits.resize(raw.size() / 4);
    std::memcpy(g.full_logits.data(), raw.data(), raw.size());
  }
  return g;
}

Bounds bounds_for(bool quantized) {
  if (quantized) return {0.30f, 0.03f, 0.5f, 5e-3};
  return {0.03f, 0.01f, 0.05f, 1e-4};
}

bool Report::ok(const Bounds& b) const {
  return bound_failures == 0 && top1_failures == 0 && (mean_kl < 0 || mean_kl <= b.mean_kl) &&
         greedy_matched >= greedy_required;
}

namespace {

// KL(p || q) for logits a (p) and b (q), computed with log-sum-exp in double.
double kl_divergence(std::span<const float> a, std::span<const float> b) {
  auto lse = [](std::span<const float> x) {
    const double mx = *std::max_element(x.begin(), x.end());
    double s = 0;
    for (float v : x) s += std::exp(double(v) - mx);
    return mx + std::log(s);
  };
  const double la = lse(a), lb = lse(b);
  double kl = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double lpa = a[i] - la, lpb = b[i] - lb;
    kl += std::exp(lpa) * (lpa - lpb);
  }
  return kl;
}

int32_t argmax(std::span<const float> x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
}

}  // namespace

Report check(const Golden& g, const Bounds& b, const EvalFn& eval, const ExemptFn& exempt_fn) {
  Report r;
  auto note = [&](std::string msg) {
    if (r.first_failure.empty()) r.first_failure = std::move(msg);
  };
  const size_t V = static_cast<size_t>(g.n_vocab);
  auto prompt = eval(g.prompt_tokens, true);
  if (!prompt.has_value()) {
    r.bound_failures = 1;
    note("prefill failed: " + prompt.error());
    return r;
  }
  if (prompt->size() != g.prompt_tokens.size() * V) {
    r.bound_failures = 1;
    note(fmt::format("prefill returned {} logits, want {} x {}", prompt->size(),
                     g.prompt_tokens.size(), V));
    return r;
  }
  std::vector<bool> exempt(g.prompt_tokens.size(), false);
  if (exempt_fn) {
    exempt = exempt_fn(g.prompt_tokens.size());
    KILN_CHECK(exempt.size() == g.prompt_tokens.size());
  }
  double kl_sum = 0;
  for (size_t p = 0; p < g.prompt_tokens.size(); ++p) {
    if (exempt[p]) {
      ++r.exempt_positions;
      continue;
    }
    const std::span<const float> row = prompt->subspan(p * V, V);
    const TopK& top = g.prompt_top[p];
    for (size_t i = 0; i < top.ids.size(); ++i) {
      const double want = top.logits[i];
      const double d = std::fabs(double(row[top.ids[i]]) - want);
      const double bound = b.abs + b.rel * std::fabs(want);
      r.worst_abs = std::max(r.worst_abs, d);
      r.worst_excess = std::max(r.worst_excess, d - bound);
      if (!(d <= bound)) {
        ++r.bound_failures;
        note(fmt::format("pos {} id {}: logit {} vs llama.cpp {} (|Δ| {:.4f} > {:.4f})", p,
                         top.ids[i], row[top.ids[i]], want, d, bound));
      }
    }
    const float margin = top.logits[0] - top.logits[1];
    const int32_t mine = argmax(row);
    if (margin >= b.near_tie && mine != top.ids[0]) {
      ++r.top1_failures;
      note(
          fmt::format("pos {}: top-1 {} vs llama.cpp {} (margin {})", p, mine, top.ids[0], margin));
    }
    if (!g.full_logits.empty())
      kl_sum += kl_divergence(std::span<const float>(g.full_logits).subspan(p * V, V), row);
  }
  const size_t n_compared = g.prompt_tokens.size() - static_cast<size_t>(r.exempt_positions);
  if (!g.full_logits.empty() && n_compared > 0) r.mean_kl = kl_sum / double(n_compared);

  // Greedy continuation: one single-token decode per step, fed our own choice.
  r.greedy_required = static_cast<int>(g.greedy.size());
  for (size_t i = 0; i < g.greedy_margins.size(); ++i)
    if (g.greedy_margins[i] < b.near_tie) {
      r.greedy_required = static_cast<int>(i);
      break;
    }
  int32_t next = argmax(prompt->subspan((g.prompt_tokens.size() - 1) * V, V));
  bool matching = true;
  for (size_t i = 0; i < g.greedy.size(); ++i) {
    if (matching && next == g.greedy[i])
      ++r.greedy_matched;
    else
      matching = false;
    if (!matching && static_cast<int>(i) < r.greedy_required)
      note(fmt::format("greedy step {}: id {} vs llama.cpp {}", i, next, g.greedy[i]));
    if (!matching || i + 1 == g.greedy.size()) break;
    auto step = eval(std::span<const int32_t>(&next, 1), false);
    if (!step.has_value()) {
      note("decode failed: " + step.error());
      break;
    }
    next = argmax(*step);
  }
  return r;
}

std::vector<bool> routing_near_ties(const model::Capture& cap, const model::HParams& hp,
                                    size_t n_prompt, float margin) {
  std::vector<bool> tie(n_prompt, false);
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    const model::LayerDesc& L = hp.layers[il];
    if (L.n_expert == 0 || L.n_expert_used >= L.n_expert) continue;
    auto it = cap.nodes.find(fmt::format("blk.{}.ffn_moe_logits", il));
    KILN_CHECK(it != cap.nodes.end() && it->second.n_rows == static_cast<int64_t>(n_prompt),
               "no router logits of layer {} for {} prompt positions", il, n_prompt);
    for (size_t p = 0; p < n_prompt; ++p) {
      std::vector<float> l(it->second.data.begin() + p * L.n_expert,
                           it->second.data.begin() + (p + 1) * L.n_expert);
      std::sort(l.begin(), l.end(), std::greater<float>());
      if (l[L.n_expert_used - 1] - l[L.n_expert_used] < margin) tie[p] = true;
    }
  }
  return tie;
}

void expect_within_bounds(const Report& r, const Bounds& b) {
  EXPECT_EQ(r.bound_failures, 0) << r.first_failure;
  EXPECT_EQ(r.top1_failures, 0) << r.first_failure;
  if (r.mean_kl >= 0) {
    EXPECT_LE(r.mean_kl, b.mean_kl);
  }
  EXPECT_GE(r.greedy_matched, r.greedy_required) << r.first_failure;
  EXPECT_TRUE(r.ok(b));
}

}  // namespace kiln::golden
