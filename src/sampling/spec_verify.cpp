// sampling/spec_verify.cpp: greedy and rejection-sampling verification of draft tokens.
#include "sampling/spec_verify.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"

namespace kiln {

int32_t argmax_id(std::span<const float> logits) {
  KILN_CHECK(!logits.empty());
  size_t best = 0;
  // Strict > keeps the smallest id among equal maxima, as greedy() does.
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<int32_t>(best);
}

Status validate_spec_sampling(const SamplerParams& p) {
  if (p.repeat_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f)
    return Status::error(
        "speculative decoding does not support repetition/frequency/presence penalties");
  if (!p.logit_bias.empty())
    return Status::error("speculative decoding does not support logit bias");
  if (!std::isfinite(p.temperature))
    return Status::errorf("temperature {} is not finite", p.temperature);
  if (!(p.top_p >= 0.0f && p.top_p <= 1.0f))
    return Status::errorf("top-p {} outside [0, 1]", p.top_p);
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f))
    return Status::errorf("min-p {} outside [0, 1]", p.min_p);
  return Status::ok();
}

void sampling_probs(std::span<const float> logits, const SamplerParams& params, Candidates& c,
                    std::vector<float>& out) {
  KILN_CHECK(params.temperature > 0.0f, "sampling_probs needs temperature > 0");
  // Same stage order as Sampler::sample, so p is exactly what plain sampling draws from.
  c.reset(logits);
  top_k(c, params.top_k);
  top_p(c, params.top_p);
  min_p(c, params.min_p);
  temperature(c, params.temperature);
  c.softmax();
  out.assign(logits.size(), 0.0f);
  for (const Candidate& x : c.items) out[static_cast<size_t>(x.id)] = x.p;
}

int32_t sample_probs(std::span<const float> p, Rng& rng) {
  KILN_CHECK(!p.empty());
  double sum = 0;
  for (float v : p) sum += v;
  KILN_CHECK(sum > 0, "sampling from an all-zero distribution");
  const double u = rng.uniform() * sum;
  double cum = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    cum += p[i];
    if (u < cum) return static_cast<int32_t>(i);
  }
  for (size_t i = p.size(); i-- > 0;)
    if (p[i] > 0) return static_cast<int32_t>(i);
  return 0;
}

VerifyResult verify_greedy_ids(std::span<const int32_t> target_ids,
                               std::span<const int32_t> draft) {
  KILN_CHECK(target_ids.size() == draft.size() + 1);
  VerifyResult r;
  while (static_cast<size_t>(r.n_accepted) < draft.size() &&
         target_ids[static_cast<size_t>(r.n_accepted)] == draft[static_cast<size_t>(r.n_accepted)])
    ++r.n_accepted;
  r.next = target_ids[static_cast<size_t>(r.n_accepted)];
  return r;
}

VerifyResult verify_greedy(std::span<const float> target_logits, std::span<const int32_t> draft,
                           int32_t n_vocab) {
  const size_t V = static_cast<size_t>(n_vocab);
  KILN_CHECK(target_logits.size() == (draft.size() + 1) * V);
  std::vector<int32_t> ids(draft.size() + 1);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = argmax_id(target_logits.subspan(i * V, V));
  return verify_greedy_ids(ids, draft);
}

VerifyResult verify_sampled(std::span<const float> target_probs, std::span<const float> draft_probs,
                            std::span<const int32_t> draft, int32_t n_vocab, Rng& rng) {
  const size_t V = static_cast<size_t>(n_vocab);
  KILN_CHECK(target_probs.size() == (draft.size() + 1) * V);
  const bool one_hot = draft_probs.empty();
  KILN_CHECK(one_hot || draft_probs.size() == draft.size() * V);
  VerifyResult r;
  std::vector<float> residual(V);
  for (size_t i = 0; i < draft.size(); ++i) {
    const auto p = target_probs.subspan(i * V, V);
    const size_t x = static_cast<size_t>(draft[i]);
    KILN_CHECK(x < V);
    const float qx = one_hot ? 1.0f : draft_probs[i * V + x];
    // A drafter never proposes a token it gave q = 0; guard anyway (then p/q is +inf).
    const double ratio = qx > 0 ? double(p[x]) / double(qx) : 1.0;
    if (rng.uniform() < ratio) {
      ++r.n_accepted;
      continue;
    }
    // Rejected: the next token comes from norm(max(0, p - q)).
    double mass = 0;
    for (size_t v = 0; v < V; ++v) {
      const float q = one_hot ? (v == x ? 1.0f : 0.0f) : draft_probs[i * V + v];
      residual[v] = std::max(0.0f, p[v] - q);
      mass += residual[v];
    }
    // p == q up to rounding yet rejected (ratio just under 1): the residual is noise; p
    // itself is the right fallback since the rejection had probability ~0.
    r.next = mass > 0 ? sample_probs(residual, rng) : sample_probs(p, rng);
    return r;
  }
  r.next = sample_probs(target_probs.subspan(draft.size() * V, V), rng);
  return r;
}

}  // namespace kiln
