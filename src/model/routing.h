// model/routing.h: MoE routing -- the router's own expert selection (gating, selection bias,
// expert groups, weight normalisation and scale: llama.cpp's build_moe_ffn), shared by both
// forward passes -- and the benchmark-only overrides of it (issue 9, `--moe-routing`). The
// expert-streaming benchmark must show a uniform worst case and a Zipf-like popularity, but
// the random-weight models route by their hidden states, which random routers make far more
// skewed than either (docs/BENCHMARKS.md). An override draws each token's experts from a fixed
// distribution keyed by (layer, position, token id) alone, so the draws are the same in a
// resident and a streaming run, in a prefill and in decode steps; the forward pass still
// computes the router (its cost stays in the figures) and weights the drawn experts by the
// router's renormalised probabilities. Outputs are no longer the model's: never a default.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "core/status.h"

namespace kiln::model {

// expert_gating_func: how router logits become probabilities (llama.cpp's values 1 and 2).
enum class GatingFunc { Softmax, Sigmoid };

// The routing of a model's MoE layers, after the router's logits have gone through `gating`
// (llama.cpp 0.7.0's build_moe_ffn, which DeepSeek-V3 and GLM-4.5 use):
// 1. selection scores = probabilities + the layer's selection bias (exp_probs_b, if any); the
//    bias only chooses experts, the weights come from the unbiased probabilities;
// 2. with n_group > 1: the experts form n_group equal consecutive groups, a group scores the
//    sum of its two best selection scores, and only the n_group_used best groups stay
//    eligible (DeepSeek-V3's group-limited routing);
// 3. the k eligible experts of highest score are chosen, best first;
// 4. their probabilities are the weights, divided by their sum when norm_weights (the sum
//    clamped below at 2^-14, llama.cpp's guard), then multiplied by weights_scale.
// Ties (equal scores, groups or experts) go to the lower id.
struct RouterParams {
  GatingFunc gating = GatingFunc::Softmax;
  int32_t n_group = 1;       // expert_group_count (1: no groups)
  int32_t n_group_used = 1;  // expert_group_used_count
  bool norm_weights = true;  // expert_weights_norm
  float weights_scale = 1;   // expert_weights_scale
};

// One token's selection (steps 1-4 above): `prob` [n_expert] after gating, `sel_bias`
// [n_expert] or empty; ids/wts [k] receive the experts best first and their weights.
// Requires k <= n_group_used * (n_expert / n_group) and n_group dividing n_expert.
void route_experts(const RouterParams& rp, std::span<const float> prob,
                   std::span<const float> sel_bias, std::span<int32_t> ids, std::span<float> wts);

struct RoutingOverride {
  enum class Kind { Model, Uniform, Zipf };
  Kind kind = Kind::Model;  // Model: the router's top-k, no override
  double zipf_s = 1.0;      // Zipf: the expert of popularity rank r has weight (r + 1)^-s
  bool active() const { return kind != Kind::Model; }
};

// "model", "uniform", "zipf" (exponent 1) or "zipf:S" (0 < S <= 8); anything else is an error
// naming the value.
Expected<RoutingOverride> parse_routing(std::string_view text);
std::string routing_name(const RoutingOverride& r);

// The popularity ranking of layer il under a Zipf override: rank r is expert
// zipf_rank_expert(il, r, n) (a permutation per layer, so layers favour different experts, as
// trained models do).
int32_t zipf_rank_expert(int32_t il, int32_t rank, int32_t n_expert);

// Draws ids.size() distinct experts of prob.size() for one token, without replacement, and
// sets wts to their router probabilities renormalised over the drawn ones (1/k each if those
// are all zero). Requires r.active().
void override_route(const RoutingOverride& r, int32_t il, int32_t pos, int32_t token,
                    std::span<const float> prob, std::span<int32_t> ids, std::span<float> wts);

}  // namespace kiln::model
