// sampling/sampler.h: turning logits into a token id. A seeded RNG with a fixed algorithm
// (same seed => same ids on every platform), the individual stages (penalties, logit bias,
// top-k, top-p, min-p, temperature, greedy, dist) as functions on a candidate list, and a
// chain in llama.cpp's default order:
//   logit bias -> penalties -> top-k -> top-p -> min-p -> temperature -> dist
// with greedy (argmax after bias and penalties) when temperature <= 0.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <utility>
#include <vector>

#include "core/status.h"

namespace kiln {

// xoshiro256** seeded through splitmix64: a fixed algorithm, unlike std:: distributions
// whose output is implementation-defined.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0);
  uint64_t next();
  double uniform();  // [0, 1) with 53 random bits

 private:
  uint64_t s_[4];
};

struct Candidate {
  int32_t id = 0;
  float logit = 0;
  float p = 0;  // filled by softmax(); stale after a stage that changes logits
};

// A working set of candidate tokens. Stages keep it sorted by logit (descending, ties by
// ascending id) once any stage sorted it, so the result does not depend on std::sort details.
struct Candidates {
  std::vector<Candidate> items;
  bool sorted = false;

  void reset(std::span<const float> logits);  // all ids, logits as given
  void sort();                                // descending logit, ascending id on ties
  void softmax();                             // p over the current items
};

// The stages (each a no-op at its neutral setting).
void apply_logit_bias(Candidates& c, std::span<const std::pair<int32_t, float>> bias);
// llama.cpp's penalties over `history` (the last N accepted ids): a token seen at least once
// gets logit / repeat if positive, logit * repeat if not, then
// logit -= count * frequency + presence.
void apply_penalties(Candidates& c, std::span<const int32_t> history, float repeat, float frequency,
                     float presence);
void top_k(Candidates& c, int32_t k);      // k <= 0: keep all
void top_p(Candidates& c, float p);        // smallest prefix with cumulative p >= p (>= 1 kept)
void min_p(Candidates& c, float p);        // keep p_i >= p * p_max
void temperature(Candidates& c, float t);  // logits / t (t > 0)
int32_t greedy(const Candidates& c);       // largest logit, smallest id on ties
int32_t sample_dist(Candidates& c, Rng& rng);

struct SamplerParams {
  float temperature = 0.8f;     // <= 0: greedy
  int32_t top_k = 40;           // <= 0: off
  float top_p = 0.95f;          // >= 1: off
  float min_p = 0.05f;          // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  int32_t penalty_last_n = 64;                        // how many accepted ids the penalties look at
  std::vector<std::pair<int32_t, float>> logit_bias;  // (id, added logit); -inf bans
  uint64_t seed = 0;
};

class Sampler {
 public:
  // Validates the parameters against the vocabulary (bias ids in range, top_p/min_p in
  // [0, 1], penalty_last_n >= 0, finite temperature).
  static Expected<Sampler> create(const SamplerParams& params, int32_t n_vocab);

  // Picks the next id from one row of logits (n_vocab values). Does not record it: call
  // accept() with the id actually appended to the sequence (prompt tokens included, if the
  // penalties should see them).
  // `allowed` (constrained decoding: n_vocab flags, non-zero = allowed, at least one set)
  // removes every other id before the first stage, so no stage can pick it; empty: all ids.
  int32_t sample(std::span<const float> logits, std::span<const uint8_t> allowed = {});
  // How many of the row's best candidates (in sampling order: Backend::top_k) decide the next
  // id exactly as sample() of the whole row would: 1 for greedy, top_k when top-k sampling
  // cuts the row first; 0 when the whole row matters (a logit bias or penalties, which
  // change logits before the cut, or no top-k cut, or one above `most`).
  int32_t candidates_needed(int32_t most) const;
  // sample() from those candidates: ids/logits the row's first candidates_needed() (or more)
  // in sampling order. Same id, same RNG draws as sample() of the row.
  int32_t sample_top(std::span<const int32_t> ids, std::span<const float> logits);
  // sample(logits, allowed) for the mask that allows exactly `ids` (ascending, non-empty): the
  // same id and RNG draws, without a pass over the whole vocabulary when few are allowed.
  int32_t sample_among(std::span<const float> logits, std::span<const int32_t> ids);
  void accept(int32_t id);
  void reset();  // clears the history and reseeds

  const SamplerParams& params() const { return params_; }

 private:
  Sampler(const SamplerParams& p, int32_t n_vocab) : params_(p), n_vocab_(n_vocab), rng_(p.seed) {}
  // The chain's stages after the top-k cut, on cands_ (sample() and sample_top() share them).
  int32_t sample_after_top_k();
  // The whole chain on cands_ (sample() and sample_among() share it).
  int32_t sample_candidates();
  SamplerParams params_;
  int32_t n_vocab_;
  Rng rng_;
  std::deque<int32_t> history_;
  std::vector<int32_t> history_buf_;
  Candidates cands_;
};

}  // namespace kiln
