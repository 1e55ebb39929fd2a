// model/routing.h: benchmark-only overrides of MoE routing (issue 9, `--moe-routing`). The
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
