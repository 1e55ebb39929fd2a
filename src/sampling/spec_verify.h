// sampling/spec_verify.h: the acceptance rules of speculative decoding. Greedy verification
// accepts the longest draft prefix that matches the target's argmax; sampled verification is
// the rejection rule of Leviathan et al. / Chen et al. (accept x with min(1, p(x)/q(x)), else
// draw from norm(max(0, p - q))), which makes the emitted tokens distributed exactly as
// plain sampling from the target.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "sampling/sampler.h"

namespace kiln {

// Argmax with the same tie rule as greedy() (smallest id wins), so speculative greedy output
// is identical to the plain greedy chain.
int32_t argmax_id(std::span<const float> logits);

// Dense probabilities [n_vocab] that Sampler would draw from for these logits: the chain's
// truncation stages (top-k, top-p, min-p) then temperature then softmax. Tokens cut by a
// stage get p = 0. Penalties and logit bias are not applied (they are rejected up front by
// validate_spec_sampling).
void sampling_probs(std::span<const float> logits, const SamplerParams& params, Candidates& scratch,
                    std::vector<float>& out);

// Errors for sampler settings the verifier cannot reproduce exactly (penalties, bias).
Status validate_spec_sampling(const SamplerParams& params);

// Draws an id from dense probabilities (need not be normalised; sum > 0).
int32_t sample_probs(std::span<const float> p, Rng& rng);

struct VerifyResult {
  int32_t n_accepted = 0;  // draft tokens accepted (a prefix of the draft)
  int32_t next = -1;       // the target's own token after the accepted prefix
};

// target_logits: [n_draft + 1][n_vocab]; row i scores the position after draft[i-1] (row 0
// after the last accepted token).
VerifyResult verify_greedy(std::span<const float> target_logits, std::span<const int32_t> draft,
                           int32_t n_vocab);
// The same from each row's argmax (lowest id on ties) alone: target_ids [n_draft + 1].
VerifyResult verify_greedy_ids(std::span<const int32_t> target_ids, std::span<const int32_t> draft);

// target_probs: [n_draft + 1][n_vocab] dense target probabilities (sampling_probs).
// draft_probs: [n_draft][n_vocab] the distributions the drafts were drawn from, or empty for
// a deterministic drafter (q is then one-hot on the drafted token).
VerifyResult verify_sampled(std::span<const float> target_probs, std::span<const float> draft_probs,
                            std::span<const int32_t> draft, int32_t n_vocab, Rng& rng);

}  // namespace kiln
