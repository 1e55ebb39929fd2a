// engine/scheduler.h: the slot scheduler. N slots (one Session each) share one Model and one
// Backend; requests wait in a bounded queue, get a slot (preferring the one whose cached
// tokens share the longest prefix with the prompt), prefill in fixed chunks interleaved with
// the other slots' decode steps, and stream their tokens back through a GenStream. One
// scheduler thread drives the model, so backend calls never overlap.
//
// One step is one forward pass (BatchEval): every decoding slot's next token plus prefill
// chunks of the slots still reading their prompts, so each weight matrix is read once per
// step for all slots (decode matvec -> small matmul) and a long prompt delays the others by at
// most one chunk.
//
// Determinism: every request owns its sampler (seeded from its own parameters) and a token's
// arithmetic in a shared forward pass does not depend on the other tokens in it (token-
// invariant matmul, per-sequence attention; see docs/determinism.md), so the ids a request
// gets do not depend on which slot it runs in or what runs beside it. On a backend that is not
// batch-invariant (CUDA) a prompt's last token gets a step of its own, as in `kiln run`.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "engine/session.h"
#include "engine/speculative.h"
#include "grammar/grammar.h"
#include "grammar/matcher.h"
#include "sampling/sampler.h"

namespace kiln {

struct SchedulerConfig {
  int32_t n_slots = 4;           // concurrent sequences (--parallel)
  int32_t n_ctx = 0;             // positions per slot; <= 0: min(training context, 4096)
  int32_t prefill_chunk = 256;   // most prompt tokens one slot evaluates per step
  int32_t max_queue = 64;        // requests waiting for a slot; beyond it submit() refuses
  std::vector<int32_t> eog_ids;  // ids that end generation (tokenizer's end-of-generation set)
  // All decoding slots share one forward call per step. false: one call per slot (the
  // unbatched path, kept so benchmarks can compare both in one process).
  bool batch_decode = true;
  // Prefill chunks join that call (false: each chunk is a call of its own). Only with
  // batch_decode.
  bool batch_prefill = true;
  // Disaggregated prefill (src/transfer; `kiln serve --role decode`). Called on the scheduler
  // thread, outside its lock, for a slot that starts from an empty cache, with every prompt
  // token but the last (whose logits give the first sampled token). True when the session now
  // holds exactly those positions (remote KV installed); false leaves the session empty and
  // the slot prefills locally as usual. Unset: always local.
  std::function<bool(Session&, std::span<const int32_t>)> remote_prefill;
  // n-gram (prompt lookup) draft tokens per decode step for requests that leave
  // GenerationParams::n_draft unset (issue 10); 0: off (`kiln serve --draft-ngram`).
  int32_t draft_ngram = 0;
  // A model drafter per slot (`kiln serve --dflash` / `--spec-mtp`), made once at create()
  // for a slot of n_ctx positions and max_batch tokens per step; it drafts instead of n-gram
  // lookup, draft_model tokens per step for requests that leave n_draft unset. Every forward
  // call records the slot's rows of the drafter's target activations (Drafter::wanted_captures,
  // BatchEval::Item::capture). A cached prefix is reused only as far as the drafter can resume
  // it (Drafter::rollback).
  std::function<Expected<std::unique_ptr<Drafter>>(int32_t n_ctx, int32_t max_batch)> make_drafter;
  int32_t draft_model = 0;
  // Requests that sample only from a row's best candidates (Sampler::candidates_needed > 0:
  // greedy, or top-k with no bias, penalties or logprobs) get those from Backend::top_k: a
  // forward call whose requests all qualify downloads k values per row, not the vocabulary.
  // Same ids (Sampler.TopCandidatesGiveTheSameIds). false: whole logit rows.
  bool device_sampling = true;
  // The grammar's view of the vocabulary (make_token_trie), needed by requests with a
  // grammar; null: such requests are refused.
  std::shared_ptr<const grammar::TokenTrie> grammar_vocab;
};

struct GenerationParams {
  std::vector<int32_t> prompt;  // token ids, non-empty, each in [0, n_vocab)
  SamplerParams sampling;
  int32_t max_tokens = 16;    // >= 1; prompt + max_tokens may exceed n_ctx (stops at n_ctx)
  int32_t top_logprobs = -1;  // < 0: no logprobs; 0..20: chosen token's + this many top ones
  // Speculative decoding with n-gram (prompt lookup) drafts: up to this many draft tokens
  // per decode step, verified in the slot's share of the step's forward pass (0: off, < 0:
  // SchedulerConfig::draft_ngram; at most kMaxDraft). Greedy requests get exactly the ids of
  // plain decoding; sampled ones the same distribution (rejection rule) but other ids for a
  // seed. Requests with penalties or logit bias decode without drafts (the verifier cannot
  // reproduce them).
  int32_t n_draft = -1;
  static constexpr int32_t kMaxDraft = 8;
  // Constrained decoding: every generated token keeps the output a prefix of this grammar's
  // language, end of generation comes only once it is complete, and the request ends (stop)
  // when the grammar allows nothing more. Whole logit rows, no n-gram drafts: instead, bytes
  // the grammar forces (a JSON key, the text between two fields) are drafted as tokens
  // (Matcher::forced_tokens, up to kMaxDraft) and verified in one step, each row sampled as
  // plain decoding samples it, so the ids are those of plain decoding for any sampling
  // (n_draft 0: no forced drafts). Null: unconstrained.
  std::shared_ptr<const grammar::Grammar> grammar;
  // The vocabulary view the grammar runs over; null: SchedulerConfig::grammar_vocab. A forced
  // tool call needs one where the format's control tokens (<tool_call>, [TOOL_CALLS]) are the
  // text they stand for, not nothing.
  std::shared_ptr<const grammar::TokenTrie> grammar_vocab;
};

enum class FinishReason { kStop, kLength, kCancelled, kError };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "cancelled", "error"

struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
};

struct GenEvent {
  enum class Kind { kToken, kDone } kind = Kind::kToken;
  // kToken
  int32_t id = 0;
  float logprob = 0;              // log-softmax of the raw logits (only with top_logprobs >= 0)
  std::vector<TokenLogprob> top;  // most likely ids, best first
  // kDone
  FinishReason finish = FinishReason::kStop;
  std::string error;     // kError: what went wrong
  int32_t n_prompt = 0;  // prompt tokens
  int32_t n_reused = 0;  // prompt tokens whose KV rows were reused from the slot
  int32_t n_generated = 0;
  int32_t slot = -1;
  // Speculative decoding of this request: draft tokens verified and accepted (llama.cpp's
  // timings draft_n / draft_n_accepted).
  int32_t n_drafted = 0, n_draft_accepted = 0;
  // From taking a slot to the first token (prompt evaluation), and from the first token to
  // the end (generation), in milliseconds.
  double prompt_ms = 0, predicted_ms = 0;
};

// The consumer's end of one request. The scheduler pushes events; the consumer (an HTTP
// handler) pops them and may cancel, which frees the slot at the scheduler's next step.
class GenStream {
 public:
  // The next event, waiting at most `timeout`; nullopt on timeout.
  std::optional<GenEvent> next(std::chrono::milliseconds timeout);
  void cancel() { cancelled_.store(true, std::memory_order_relaxed); }
  bool cancelled() const { return cancelled_.load(std::memory_order_relaxed); }

 private:
  friend class Scheduler;
  void push(GenEvent e);
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenEvent> events_;
  std::atomic<bool> cancelled_{false};
};

struct SchedulerStats {
  uint64_t requests_total = 0, requests_rejected = 0, requests_cancelled = 0;
  uint64_t prompt_tokens = 0, prompt_tokens_reused = 0, generated_tokens = 0;
  // Of prompt_tokens_reused, those an n > 1 choice took from the first choice's prefill.
  uint64_t prompt_tokens_shared = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  int32_t queue_depth = 0, slots_busy = 0, n_slots = 0;
  uint64_t kv_bytes = 0;
  int64_t kv_positions_used = 0, kv_positions_total = 0;
  uint64_t forward_passes = 0, forward_tokens = 0;  // model steps and the tokens they held
  uint64_t candidate_passes = 0;  // of those, the ones that returned top-k candidates, not rows
  // Speculative decoding: verify steps, draft tokens proposed and accepted, drafting time.
  uint64_t spec_steps = 0, spec_drafted = 0, spec_accepted = 0;
  // Of those, the constrained requests' forced-token steps and drafts (kept ones).
  uint64_t forced_steps = 0, forced_drafted = 0, forced_accepted = 0;
  double spec_draft_seconds = 0;
};

class Scheduler {
 public:
  // Creates the slots and starts the scheduler thread. Errors: n_slots < 1, prefill_chunk < 1,
  // max_queue < 0.
  static Expected<std::unique_ptr<Scheduler>> create(std::shared_ptr<const Model> model,
                                                     Backend& backend, SchedulerConfig cfg);
  ~Scheduler();  // shutdown()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  enum class SubmitError { kNone, kQueueFull, kInvalid, kShuttingDown };
  struct Submitted {
    std::shared_ptr<GenStream> stream;  // null on error
    SubmitError error = SubmitError::kNone;
    std::string message;
  };
  // Validates and queues a request. Never blocks on the model.
  Submitted submit(GenerationParams params);
  // n choices of one prompt (OpenAI's `n`): seeds.size() requests of `params`, choice i with
  // sampling.seed = seeds[i], queued together (all or none; each counts against the queue).
  // The prompt is evaluated once: the first choice prefills it, and each other one starts
  // from a copy of those KV rows and samples its first token from the same last prompt row
  // (Session::copy_prefix_from), so it gets the ids it would get as a request of its own.
  // A choice that cannot copy (the first one ended before its prefill, or the rows are gone)
  // prefills the prompt itself.
  struct SubmittedN {
    std::vector<std::shared_ptr<GenStream>> streams;  // empty on error
    SubmitError error = SubmitError::kNone;
    std::string message;
  };
  SubmittedN submit_n(GenerationParams params, std::span<const uint64_t> seeds);

  // Cancels queued and running requests (each gets kDone/kCancelled) and joins the thread.
  // Idempotent.
  void shutdown();

  SchedulerStats stats() const;
  int32_t n_ctx() const { return n_ctx_; }
  const Model& model() const { return *model_; }

 private:
  struct Request;
  struct Slot;
  struct SharedPrefill;
  Scheduler(std::shared_ptr<const Model> model, Backend& backend, SchedulerConfig cfg,
            std::vector<std::unique_ptr<Drafter>> drafters);
  struct Work;
  void run();
  void admit_locked();
  void remote_prefill_admitted();  // cfg_.remote_prefill for newly admitted slots
  Expected<std::unique_ptr<Request>> make_request(GenerationParams p);
  // Queues the requests together, or none of them (queue full, shutting down).
  SubmitError enqueue(std::vector<std::unique_ptr<Request>>& reqs, std::string& message);
  // For a slot waiting on its group's first choice: false while it still waits; true once it
  // copied the prefill (and sampled its first token) or gave up and prefills itself.
  bool take_shared_prefill(Slot& s);
  // Samples the first/next token from a row (or candidates) and emits it.
  void sample_and_emit(Slot& s, std::span<const float> logits, const Session::TopK* top);
  void step();
  // Evaluates `work` (one forward call when batched), then samples and emits for each item.
  void run_group(std::span<Work> work, bool batched);
  // After a slot evaluated `in`: advance the prompt cursor or sample the next token.
  // `top`: the row's best candidates instead (logits then empty; run_group's rule).
  void advance(Slot& s, std::span<const int32_t> in, std::span<const float> logits,
               const Session::TopK* top = nullptr);
  // Drafts for a decoding slot (its model drafter's, else n-gram lookup); the work's tokens
  // become [last, drafts...]. Errors: the model drafter failed.
  Status draft(Slot& s, Work& w);
  // After a verify (last token + drafts, all logits): keep the accepted prefix, roll back the
  // rest, emit the accepted tokens and the target's own next one.
  void accept_drafts(Slot& s, const Work& w, std::span<const float> rows);
  // Constrained requests: the tokens the grammar forces as drafts; and their verification
  // (every row sampled through the grammar in order, drafts kept while the samples agree).
  void draft_forced(Slot& s, Work& w);
  void accept_forced(Slot& s, const Work& w, std::span<const float> rows);
  // The end of a verify step of k = w.n_draft drafts appended after position `base`, a of
  // them accepted: the rejected rows undone, the kept tokens cached and shown to the slot's
  // drafter (Drafter::observe_target), the step counted.
  void keep_verified(Slot& s, const Work& w, int32_t base, int32_t a, bool forced);
  void finish(Slot& s, FinishReason why, std::string error = {});
  void emit_token(Slot& s, int32_t id, std::span<const float> logits);

  std::shared_ptr<const Model> model_;
  Backend& backend_;
  SchedulerConfig cfg_;
  int32_t n_ctx_ = 0;
  std::vector<std::unique_ptr<Slot>> slots_;  // owned and touched only by the scheduler thread
  std::unique_ptr<BatchEval> batch_;          // scheduler thread only; null when unbatched
  size_t prefill_rr_ = 0;                     // slot whose prefill goes first next step

  mutable std::mutex mu_;  // guards queue_, stop_, the stats counters below and slot_busy_
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Request>> queue_;
  bool stop_ = false;
  std::vector<char> slot_busy_;  // mirror of the slots' state for stats()
  std::vector<int32_t> slot_pos_;
  std::vector<uint64_t> slot_kv_bytes_;
  SchedulerStats counters_;
  std::thread thread_;
};

}  // namespace kiln
