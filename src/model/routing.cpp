// model/routing.cpp: the router's expert selection and the benchmark routing overrides (see
// routing.h for both).
#include "model/routing.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"
#include "core/splitmix.h"

namespace kiln::model {
namespace {

constexpr int32_t kMaxExperts = 4096;  // read_hparams caps expert_count at 4096

// Layer il's popularity ranking: Fisher-Yates from a per-layer seed, recomputed per token
// (n_expert steps: noise next to the expert matmuls it selects for).
void layer_ranking(int32_t il, int32_t n_expert, std::span<int32_t> perm) {
  std::iota(perm.begin(), perm.begin() + n_expert, 0);
  uint64_t s = 0x5A17F00Dull * (uint64_t(il) + 1);
  for (int32_t i = n_expert - 1; i > 0; --i)
    std::swap(perm[i], perm[splitmix64(s) % uint64_t(i + 1)]);
}

}  // namespace

void route_experts(const RouterParams& rp, std::span<const float> prob,
                   std::span<const float> sel_bias, std::span<int32_t> ids, std::span<float> wts) {
  const auto n = static_cast<int32_t>(prob.size());
  const size_t k = ids.size();
  KILN_CHECK(n <= kMaxExperts && wts.size() == k &&
             (sel_bias.empty() || sel_bias.size() == prob.size()));
  KILN_CHECK(rp.n_group >= 1 && n % rp.n_group == 0 && rp.n_group_used >= 1 &&
             rp.n_group_used <= rp.n_group);
  const int32_t per_group = n / rp.n_group;
  KILN_CHECK(k <= static_cast<size_t>(rp.n_group_used) * static_cast<size_t>(per_group));
  std::array<float, kMaxExperts> score;
  for (int32_t e = 0; e < n; ++e) score[e] = sel_bias.empty() ? prob[e] : prob[e] + sel_bias[e];
  // Eligible experts, by id: all of them, or those of the n_group_used best groups.
  std::array<bool, kMaxExperts> eligible;
  std::fill(eligible.begin(), eligible.begin() + n, rp.n_group == 1);
  if (rp.n_group > 1) {
    KILN_CHECK(per_group >= 2, "{} experts in {} groups: a group needs two", n, rp.n_group);
    std::array<float, kMaxExperts> group_score;
    std::array<int32_t, kMaxExperts> groups;
    for (int32_t g = 0; g < rp.n_group; ++g) {
      const float* s = score.data() + g * per_group;
      // The two best of the group (equal values count twice, as a top-2 does).
      float best = -INFINITY, second = -INFINITY;
      for (int32_t i = 0; i < per_group; ++i) {
        if (s[i] > best) {
          second = best;
          best = s[i];
        } else if (s[i] > second) {
          second = s[i];
        }
      }
      group_score[g] = best + second;
      groups[g] = g;
    }
    std::partial_sort(groups.begin(), groups.begin() + rp.n_group_used, groups.begin() + rp.n_group,
                      [&](int32_t a, int32_t b) {
                        return group_score[a] > group_score[b] ||
                               (group_score[a] == group_score[b] && a < b);
                      });
    for (int32_t i = 0; i < rp.n_group_used; ++i)
      std::fill_n(eligible.begin() + groups[i] * per_group, per_group, true);
  }
  std::array<int32_t, kMaxExperts> order;
  int32_t m = 0;
  for (int32_t e = 0; e < n; ++e)
    if (eligible[e]) order[m++] = e;
  std::partial_sort(order.begin(), order.begin() + k, order.begin() + m, [&](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += prob[order[i]];
  // llama.cpp clamps the sum at the smallest normal f16 so all-zero weights stay finite.
  sum = std::max(sum, 6.103515625e-5);
  for (size_t i = 0; i < k; ++i) {
    ids[i] = order[i];
    const double w = rp.norm_weights ? prob[order[i]] / sum : double(prob[order[i]]);
    wts[i] = static_cast<float>(w);
    if (rp.weights_scale != 1.0f) wts[i] *= rp.weights_scale;
  }
}

Expected<RoutingOverride> parse_routing(std::string_view text) {
  RoutingOverride r;
  if (text == "model") return r;
  if (text == "uniform") {
    r.kind = RoutingOverride::Kind::Uniform;
    return r;
  }
  if (text == "zipf") {
    r.kind = RoutingOverride::Kind::Zipf;
    return r;
  }
  if (text.starts_with("zipf:")) {
    const std::string_view num = text.substr(5);
    double s = 0;
    const auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), s);
    if (ec == std::errc() && end == num.data() + num.size() && s > 0 && s <= 8) {
      r.kind = RoutingOverride::Kind::Zipf;
      r.zipf_s = s;
      return r;
    }
  }
  return Status::errorf(
      "moe_routing '{}': expected model, uniform, zipf or zipf:S with "
      "0 < S <= 8",
      text);
}

std::string routing_name(const RoutingOverride& r) {
  switch (r.kind) {
    case RoutingOverride::Kind::Model:
      return "model";
    case RoutingOverride::Kind::Uniform:
      return "uniform";
    case RoutingOverride::Kind::Zipf:
      return fmt::format("zipf:{}", r.zipf_s);
  }
  return "?";
}

int32_t zipf_rank_expert(int32_t il, int32_t rank, int32_t n_expert) {
  KILN_CHECK(n_expert > 0 && n_expert <= kMaxExperts && rank >= 0 && rank < n_expert);
  std::array<int32_t, kMaxExperts> perm;
  layer_ranking(il, n_expert, perm);
  return perm[rank];
}

void override_route(const RoutingOverride& r, int32_t il, int32_t pos, int32_t token,
                    std::span<const float> prob, std::span<int32_t> ids, std::span<float> wts) {
  KILN_CHECK(r.active());
  const auto n = static_cast<int32_t>(prob.size());
  const size_t k = ids.size();
  KILN_CHECK(n <= kMaxExperts && k <= static_cast<size_t>(n) && wts.size() == k);
  // Weight of each expert (by id); drawn ones are set to zero so the next draw skips them.
  std::array<double, kMaxExperts> w;
  if (r.kind == RoutingOverride::Kind::Uniform) {
    std::fill(w.begin(), w.begin() + n, 1.0);
  } else {
    std::array<int32_t, kMaxExperts> perm;
    layer_ranking(il, n, perm);
    for (int32_t rank = 0; rank < n; ++rank) w[perm[rank]] = std::pow(double(rank + 1), -r.zipf_s);
  }
  uint64_t s = (uint64_t(uint32_t(il)) << 32) ^ uint32_t(pos);
  s = splitmix64(s) ^ uint64_t(uint32_t(token));
  double total = 0;
  for (int32_t e = 0; e < n; ++e) total += w[e];
  double sum = 0;
  for (size_t i = 0; i < k; ++i) {
    const double u = double(splitmix64(s) >> 11) * 0x1.0p-53 * total;
    double acc = 0;
    int32_t pick = -1;
    for (int32_t e = 0; e < n; ++e) {
      if (w[e] == 0) continue;
      pick = e;  // the last live expert, should rounding carry u past the end
      acc += w[e];
      if (u < acc) break;
    }
    KILN_CHECK(pick >= 0);
    total -= w[pick];
    w[pick] = 0;
    ids[i] = pick;
    sum += prob[pick];
  }
  for (size_t i = 0; i < k; ++i)
    wts[i] = sum > 0 ? static_cast<float>(prob[ids[i]] / sum) : 1.0f / static_cast<float>(k);
}

}  // namespace kiln::model
