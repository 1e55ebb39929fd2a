// engine/speculative.h: speculative decoding. A Drafter proposes up to k tokens continuing the
// accepted history; the target Session scores the last accepted token plus the k drafts in one
// batched eval (all logits); verification (sampling/spec_verify.h) keeps the longest acceptable
// prefix plus one token of the target's own, and Session::rollback drops the rejected rows.
//
// Output equivalence: greedy runs emit exactly the ids of plain greedy decoding (batch
// invariance makes each verify row bit-identical to a one-token eval); sampled runs use the
// rejection rule, so ids are distributed as plain sampling from the target (not the same ids
// per seed: the RNG is consumed differently).
//
// KV rollback and sliding-window rings: a ring holds window + max_batch rows, so rolling back
// (part of) the last batch never needs a row the batch overwrote (kv/kv_cache.h). The decoder
// therefore requires k + 1 <= the target's max_batch, so a verify is one forward step.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/counters.h"
#include "core/status.h"
#include "engine/session.h"
#include "model/capture.h"
#include "sampling/sampler.h"

namespace kiln {

struct DraftRequest {
  std::span<const int32_t> history;  // prompt + every accepted token, in order
  int32_t max_tokens = 0;            // propose at most this many (> 0)
  // nullptr: greedy drafting. Otherwise the drafter samples from its own distribution under
  // these settings and must return that distribution (Draft::probs).
  const SamplerParams* sampling = nullptr;
  Rng* rng = nullptr;  // set with `sampling`
};

struct Draft {
  std::vector<int32_t> tokens;  // 0..max_tokens proposals
  // [tokens.size()][n_vocab] distributions q the tokens were drawn from; empty means the
  // drafter is deterministic (q is one-hot on each token).
  std::vector<float> probs;
};

// Something that guesses the target's continuation. Implementations: a second (cheaper) model
// with the same vocabulary, n-gram prompt lookup, and, through wanted_captures() /
// observe_target(), a block drafter conditioned on the target's hidden states.
class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual std::string name() const = 0;
  // Fills `out` (cleared first). Errors abort the generation.
  virtual Status propose(const DraftRequest& req, Draft& out) = 0;
  // Called by SpeculativeDecoder::start() with the whole prompt, before the target's prefill,
  // so a drafter with state (a draft model's KV) does its prompt prefill with the target's,
  // not inside the first decode step (where it would be charged to decode time and the draft
  // timer), and a drafter conditioned on the target resets before the prefill's features come.
  virtual Status prepare(std::span<const int32_t> /*prompt*/) { return Status::ok(); }
  // Named target activations (model/capture.h names, e.g. "blk.11.ffn_out") this drafter
  // conditions on. Non-empty: the decoder captures them during each verify eval and passes
  // them to observe_target().
  virtual std::vector<std::string> wanted_captures() const { return {}; }
  // The backend whose memory observe_target() reads the captures from (model::Capture::device),
  // or null for host copies.
  virtual Backend* capture_device() const { return nullptr; }
  // After each target batch: the prompt prefill's chunks (every row kept), then each verify
  // (rows: the last accepted token, then the drafts; the first n_rows_kept were kept). The
  // rows continue the positions of the previous call.
  virtual void observe_target(const model::Capture& /*capture*/, int32_t /*n_rows_kept*/) {}
  // Forgets everything from position n_pos on, so the drafter continues a history cut there
  // (a server slot resuming a cached prefix). n_pos 0 starts afresh and always works. Errors:
  // the drafter cannot resume at n_pos (the caller starts from an empty history instead).
  // Default: only 0 (prepare with no prompt).
  virtual Status rollback(int32_t n_pos);
};

// Drafting with a second model of the same vocabulary (e.g. a q8_0 copy, or a smaller model of
// the family). Keeps its own Session in step with the accepted history, rolling back its own
// rejected proposals (or re-prefilling when a ring cannot roll back that far).
class ModelDrafter final : public Drafter {
 public:
  // Errors: vocabulary sizes differ. max_batch: the draft session's batch limit (0: the
  // default); rolling back its own proposals needs max_batch >= k on sliding-window models,
  // otherwise the drafter re-prefills (correct, slower).
  static Expected<std::unique_ptr<ModelDrafter>> create(std::shared_ptr<const Model> draft,
                                                        Backend& backend, int32_t n_ctx,
                                                        int32_t target_n_vocab,
                                                        int32_t max_batch = 0);
  uint64_t n_reprefills() const { return n_reprefills_; }   // ring rollbacks that fell back
  size_t n_evaluated() const { return evaluated_.size(); }  // tokens the draft KV holds
  std::string name() const override { return "draft-model"; }
  Status propose(const DraftRequest& req, Draft& out) override;
  Status prepare(std::span<const int32_t> prompt) override;

 private:
  ModelDrafter(std::shared_ptr<const Model> m, Backend& be, int32_t n_ctx, int32_t max_batch);
  Status sync(std::span<const int32_t> history);
  Session session_;
  std::vector<int32_t> evaluated_;  // tokens whose KV rows the draft session holds
  std::vector<float> last_logits_;  // logits after evaluated_.back()
  Candidates scratch_;
  std::vector<float> q_;
  uint64_t n_reprefills_ = 0;
};

// Prompt lookup: finds the most recent earlier occurrence of the history's last n tokens
// (n from max_ngram down to min_ngram) and proposes what followed it. No model, no state.
class NgramDrafter final : public Drafter {
 public:
  NgramDrafter(int32_t min_ngram = 2, int32_t max_ngram = 4);
  std::string name() const override { return "ngram"; }
  Status propose(const DraftRequest& req, Draft& out) override;
  Status rollback(int32_t /*n_pos*/) override { return Status::ok(); }  // no state

 private:
  int32_t min_n_, max_n_;
};

struct SpecParams {
  int32_t n_draft = 4;     // k: draft tokens per verify step (>= 1)
  SamplerParams sampling;  // target; temperature <= 0: greedy verification
  // Draft sampling when sampling (ignored for greedy). Any q is correct (the rejection rule
  // corrects it); closer to the target's p means longer acceptance.
  SamplerParams draft_sampling;
  // Greedy verification ranks the verify rows where they are computed (Session::eval_top_k:
  // on a GPU one id per row crosses, not the rows) and SpecStep::logits stays empty; true
  // ships the rows (sampled verification always does).
  bool keep_logits = false;
};

struct SpecStats {
  uint64_t steps = 0;     // verify evals
  uint64_t drafted = 0;   // draft tokens proposed
  uint64_t accepted = 0;  // draft tokens accepted
  uint64_t emitted = 0;   // tokens produced (accepted + one per step)
  double draft_s = 0, verify_s = 0;
  double mean_accept() const { return steps ? double(accepted) / double(steps) : 0.0; }
  // Tokens per target eval ("acceptance length" in llama.cpp's sense: accepted + 1).
  double tokens_per_step() const { return steps ? double(emitted) / double(steps) : 0.0; }
};

struct SpecStep {
  int32_t n_past = 0;           // target positions before the verify (the pending token's)
  std::vector<int32_t> draft;   // the drafter's proposals this step
  std::vector<int32_t> tokens;  // emitted this step (>= 1): accepted drafts + target's own
  int32_t n_drafted = 0;
  int32_t n_accepted = 0;
  // Target logits of the kept verify rows ([n_accepted + 1][n_vocab]): row i scored the
  // position that tokens[i] was chosen for. Valid until the next step(). Empty for greedy
  // verification unless SpecParams::keep_logits.
  std::span<const float> logits;
};

class SpeculativeDecoder {
 public:
  // Errors: n_draft < 1, n_draft + 1 > the target's batch limit, unsupported sampler settings.
  static Expected<std::unique_ptr<SpeculativeDecoder>> create(Session& target, Drafter& drafter,
                                                              const SpecParams& params);

  // Resets the target session and evaluates all but the last prompt token (the last one is
  // scored by the first verify). Errors: empty prompt, prompt too long for the context.
  Status start(std::span<const int32_t> prompt);
  // One draft + verify round. Errors: context full (fewer than 1 free position), eval or
  // drafter failures.
  Expected<SpecStep> step();

  std::span<const int32_t> history() const { return history_; }
  const SpecStats& stats() const { return stats_; }

 private:
  SpeculativeDecoder(Session& t, Drafter& d, const SpecParams& p);

  Session& target_;
  Drafter& drafter_;
  SpecParams params_;
  Rng rng_, draft_rng_;
  std::vector<int32_t> history_;
  std::vector<int32_t> batch_;
  std::vector<float> p_;  // [k + 1][n_vocab] target probabilities (sampling)
  std::vector<float> row_;
  std::vector<float> kept_logits_;
  Candidates scratch_;
  model::Capture capture_;
  Draft draft_;
  SpecStats stats_;
  // process-wide (--stats, /metrics)
  Counter& c_steps_;
  Counter& c_drafted_;
  Counter& c_accepted_;
  Timer& t_draft_;
  Timer& t_verify_;
};

}  // namespace kiln
