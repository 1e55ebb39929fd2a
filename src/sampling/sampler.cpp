// sampling/sampler.cpp: RNG, sampling stages and the llama.cpp-ordered chain.
#include "sampling/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "core/check.h"
#include "core/splitmix.h"

namespace kiln {

// ---------------------------------------------------------------- Rng

namespace {
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

bool before(const Candidate& a, const Candidate& b) {
  if (a.logit != b.logit) return a.logit > b.logit;
  return a.id < b.id;
}
}  // namespace

Rng::Rng(uint64_t seed) {
  uint64_t x = seed;
  for (uint64_t& s : s_) s = splitmix64(x);
}

uint64_t Rng::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() { return double(next() >> 11) * 0x1.0p-53; }

// ---------------------------------------------------------------- Candidates

void Candidates::reset(std::span<const float> logits) {
  items.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) items[i] = {static_cast<int32_t>(i), logits[i], 0};
  sorted = false;
}

void Candidates::sort() {
  if (!sorted) std::sort(items.begin(), items.end(), before);
  sorted = true;
}

void Candidates::softmax() {
  if (items.empty()) return;
  float mx = -std::numeric_limits<float>::infinity();
  for (const Candidate& c : items) mx = std::max(mx, c.logit);
  if (std::isinf(mx) && mx < 0) {  // every token banned: uniform rather than NaN
    for (Candidate& c : items) c.p = 1.0f / float(items.size());
    return;
  }
  double sum = 0;
  for (Candidate& c : items) {
    c.p = std::exp(c.logit - mx);
    sum += c.p;
  }
  for (Candidate& c : items) c.p = float(c.p / sum);
}

// ---------------------------------------------------------------- stages

void apply_logit_bias(Candidates& c, std::span<const std::pair<int32_t, float>> bias) {
  if (bias.empty()) return;
  // Candidates come from reset() in id order unless sorted; look ids up either way.
  std::unordered_map<int32_t, float> add;
  for (auto [id, b] : bias) add[id] += b;
  for (Candidate& x : c.items)
    if (auto it = add.find(x.id); it != add.end()) x.logit += it->second;
  c.sorted = false;
}

void apply_penalties(Candidates& c, std::span<const int32_t> history, float repeat, float frequency,
                     float presence) {
  if (history.empty() || (repeat == 1.0f && frequency == 0.0f && presence == 0.0f)) return;
  std::unordered_map<int32_t, int> count;
  for (int32_t id : history) ++count[id];
  for (Candidate& x : c.items) {
    auto it = count.find(x.id);
    if (it == count.end()) continue;
    if (x.logit <= 0)
      x.logit *= repeat;
    else
      x.logit /= repeat;
    x.logit -= float(it->second) * frequency + presence;
  }
  c.sorted = false;
}

void top_k(Candidates& c, int32_t k) {
  if (k <= 0 || size_t(k) >= c.items.size()) return;
  if (!c.sorted) std::partial_sort(c.items.begin(), c.items.begin() + k, c.items.end(), before);
  c.items.resize(size_t(k));
  c.sorted = true;
}

void top_p(Candidates& c, float p) {
  if (p >= 1.0f || c.items.empty()) return;
  c.sort();
  c.softmax();
  double cum = 0;
  size_t keep = c.items.size();
  for (size_t i = 0; i < c.items.size(); ++i) {
    cum += c.items[i].p;
    if (cum >= p) {
      keep = i + 1;
      break;
    }
  }
  c.items.resize(std::max<size_t>(keep, 1));
}

void min_p(Candidates& c, float p) {
  if (p <= 0.0f || c.items.empty()) return;
  float mx = -std::numeric_limits<float>::infinity();
  for (const Candidate& x : c.items) mx = std::max(mx, x.logit);
  // p_i >= p * p_max  <=>  logit_i >= max_logit + log(p): no softmax needed.
  const float threshold = mx + std::log(p);
  std::vector<Candidate> kept;
  kept.reserve(c.items.size());
  for (const Candidate& x : c.items)
    if (x.logit >= threshold) kept.push_back(x);
  if (kept.empty()) kept.push_back(*std::min_element(c.items.begin(), c.items.end(), before));
  c.items = std::move(kept);  // relative order preserved, so `sorted` still holds
}

void temperature(Candidates& c, float t) {
  KILN_CHECK(t > 0, "temperature {} must be > 0 here (greedy handles <= 0)", t);
  if (t == 1.0f) return;
  for (Candidate& x : c.items) x.logit /= t;
}

int32_t greedy(const Candidates& c) {
  KILN_CHECK(!c.items.empty());
  return std::min_element(c.items.begin(), c.items.end(), before)->id;
}

int32_t sample_dist(Candidates& c, Rng& rng) {
  KILN_CHECK(!c.items.empty());
  c.softmax();
  const double u = rng.uniform();
  double cum = 0;
  for (const Candidate& x : c.items) {
    cum += x.p;
    if (u < cum) return x.id;
  }
  // Rounding left cum just below 1: the last token with any mass.
  for (size_t i = c.items.size(); i-- > 0;)
    if (c.items[i].p > 0) return c.items[i].id;
  return c.items.back().id;
}

// ---------------------------------------------------------------- Sampler

Expected<Sampler> Sampler::create(const SamplerParams& p, int32_t n_vocab) {
  if (n_vocab <= 0) return Status::errorf("sampler: vocabulary size {} must be > 0", n_vocab);
  if (!std::isfinite(p.temperature))
    return Status::errorf("sampler: temperature {} is not finite", p.temperature);
  if (!(p.top_p >= 0.0f && p.top_p <= 1.0f))
    return Status::errorf("sampler: top-p {} outside [0, 1]", p.top_p);
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f))
    return Status::errorf("sampler: min-p {} outside [0, 1]", p.min_p);
  if (!(p.repeat_penalty > 0.0f) || !std::isfinite(p.repeat_penalty))
    return Status::errorf("sampler: repeat penalty {} must be > 0", p.repeat_penalty);
  if (!std::isfinite(p.frequency_penalty) || !std::isfinite(p.presence_penalty))
    return Status::error("sampler: frequency/presence penalties must be finite");
  if (p.penalty_last_n < 0)
    return Status::errorf("sampler: penalty window {} must be >= 0", p.penalty_last_n);
  for (auto [id, b] : p.logit_bias) {
    if (id < 0 || id >= n_vocab)
      return Status::errorf("sampler: logit bias for token {} outside the vocabulary (0..{})", id,
                            n_vocab - 1);
    if (std::isnan(b)) return Status::errorf("sampler: logit bias for token {} is NaN", id);
  }
  return Sampler(p, n_vocab);
}

void Sampler::accept(int32_t id) {
  if (params_.penalty_last_n == 0) return;
  history_.push_back(id);
  while (history_.size() > size_t(params_.penalty_last_n)) history_.pop_front();
}

void Sampler::reset() {
  history_.clear();
  rng_ = Rng(params_.seed);
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const uint8_t> allowed) {
  KILN_CHECK(logits.size() == size_t(n_vocab_), "{} logits for a vocabulary of {}", logits.size(),
             n_vocab_);
  cands_.reset(logits);
  if (!allowed.empty()) {
    KILN_CHECK(allowed.size() == logits.size(), "mask of {} for {} logits", allowed.size(),
               logits.size());
    std::erase_if(cands_.items, [&](const Candidate& c) { return !allowed[size_t(c.id)]; });
    KILN_CHECK(!cands_.items.empty(), "a mask that allows no token");
  }
  return sample_candidates();
}

int32_t Sampler::sample_among(std::span<const float> logits, std::span<const int32_t> ids) {
  KILN_CHECK(logits.size() == size_t(n_vocab_), "{} logits for a vocabulary of {}", logits.size(),
             n_vocab_);
  KILN_CHECK(!ids.empty(), "a mask that allows no token");
  // The list sample() keeps after removing the masked ids: ascending ids, logits as given.
  cands_.items.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    KILN_CHECK(ids[i] >= 0 && ids[i] < n_vocab_ && (i == 0 || ids[i] > ids[i - 1]),
               "allowed ids must ascend inside the vocabulary");
    cands_.items[i] = {ids[i], logits[size_t(ids[i])], 0};
  }
  cands_.sorted = false;
  return sample_candidates();
}

int32_t Sampler::sample_candidates() {
  apply_logit_bias(cands_, params_.logit_bias);
  history_buf_.assign(history_.begin(), history_.end());
  apply_penalties(cands_, history_buf_, params_.repeat_penalty, params_.frequency_penalty,
                  params_.presence_penalty);
  if (params_.temperature <= 0.0f) return greedy(cands_);
  top_k(cands_, params_.top_k);
  return sample_after_top_k();
}

int32_t Sampler::sample_after_top_k() {
  top_p(cands_, params_.top_p);
  min_p(cands_, params_.min_p);
  temperature(cands_, params_.temperature);
  return sample_dist(cands_, rng_);
}

int32_t Sampler::candidates_needed(int32_t most) const {
  const SamplerParams& p = params_;
  if (!p.logit_bias.empty()) return 0;
  const bool penalties =
      p.penalty_last_n > 0 &&
      (p.repeat_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f);
  if (penalties) return 0;
  if (p.temperature <= 0.0f) return 1;
  if (p.top_k <= 0 || p.top_k >= n_vocab_ || p.top_k > most) return 0;
  return p.top_k;
}

int32_t Sampler::sample_top(std::span<const int32_t> ids, std::span<const float> logits) {
  const int32_t need = candidates_needed(std::numeric_limits<int32_t>::max());
  KILN_CHECK(need > 0, "sample_top: these sampling parameters need the whole row");
  KILN_CHECK(ids.size() == logits.size() && ids.size() >= size_t(need),
             "sample_top: {} candidates ({} logits) for {} needed", ids.size(), logits.size(),
             need);
  // What sample() holds after its top-k stage: the first `need` of the row, sorted.
  cands_.items.resize(size_t(need));
  for (size_t i = 0; i < size_t(need); ++i) cands_.items[i] = {ids[i], logits[i], 0};
  cands_.sorted = true;
  if (params_.temperature <= 0.0f) return greedy(cands_);
  return sample_after_top_k();
}

}  // namespace kiln
