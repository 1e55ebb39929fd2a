// engine/scheduler.cpp: the slot scheduler loop (see scheduler.h): admission with prefix
// reuse, steps that batch every decoding slot's token with prefill chunks into one forward
// pass, sampling, logprobs and cancellation.
#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/check.h"
#include "engine/constrained.h"
#include "engine/speculative.h"
#include "format/page_in.h"
#include "sampling/spec_verify.h"

namespace kiln {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kError:
      return "error";
  }
  return "error";
}

std::optional<GenEvent> GenStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  if (!cv_.wait_for(lk, timeout, [&] { return !events_.empty(); })) return std::nullopt;
  GenEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

void GenStream::push(GenEvent e) {
  {
    std::lock_guard lk(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

struct Scheduler::Request {
  GenerationParams params;
  Sampler sampler;
  std::shared_ptr<GenStream> stream;
  int32_t n_draft = 0;         // resolved draft length; 0: plain decoding
  bool forced_drafts = false;  // constrained: draft the tokens the grammar forces
  Rng spec_rng{0};             // the rejection rule's draws (sampled requests with drafts)
  std::optional<Constraint> constraint{};  // requests with a grammar
  // n > 1 choices (submit_n): the group's shared prefill; the first choice is not a follower.
  std::shared_ptr<SharedPrefill> share{};
  bool follower = false;
};

// What the first of n choices leaves for the others: its last prompt row, once evaluated.
// Touched only by the scheduler thread.
struct Scheduler::SharedPrefill {
  bool ready = false;            // row (or the candidates) hold the first choice's last prompt row
  bool leader_gone = false;      // the first choice ended before its prompt was evaluated
  std::vector<float> row;        // [n_vocab], from a whole-row step
  std::vector<int32_t> top_ids;  // or the candidates of a candidates step
  std::vector<float> top_logits;
};

struct Scheduler::Slot {
  int32_t id = 0;
  std::unique_ptr<Session> session;
  std::vector<int32_t> cached;   // tokens whose KV rows the session holds, in position order
  std::unique_ptr<Request> req;  // null: idle
  size_t cursor = 0;             // next prompt token to evaluate
  bool decoding = false;
  int32_t last = 0;  // sampled, not yet evaluated
  int32_t n_generated = 0, n_reused = 0;
  std::chrono::steady_clock::time_point t_start, t_first;  // slot taken, first token
  bool remote_pending = false;  // admitted with an empty cache; cfg_.remote_prefill not yet tried
  bool await_prefill = false;   // an n > 1 follower waiting for its group's prompt rows
  // Speculative decoding scratch: the verify input [last, drafts...], the drafter's view of
  // the sequence, target probabilities [k + 1][n_vocab].
  std::vector<int32_t> spec_in, spec_hist;
  std::vector<float> spec_p, spec_row;
  Candidates spec_scratch;
  int32_t n_drafted = 0, n_accepted = 0;  // this request's
  // A model drafter (SchedulerConfig::make_drafter), in step with `cached`: it has seen the
  // activations of exactly those positions, recorded in `capture` by each of the slot's evals.
  std::unique_ptr<Drafter> drafter;
  model::Capture capture;
};

namespace {

// Bytes one slot's KV planes reach at full context: f16 K and V per layer, n_ctx rows for a
// full-attention layer, window + max_batch rows for a sliding-window ring (kv/kv_cache.h).
uint64_t kv_bytes_at_full_context(const model::HParams& hp, int32_t n_ctx, int32_t max_batch) {
  uint64_t bytes = 0;
  for (const model::LayerDesc& L : hp.layers) {
    const int64_t rows = L.window > 0 ? std::min<int64_t>(n_ctx, L.window + max_batch) : n_ctx;
    bytes += uint64_t(rows) * uint64_t(hp.k_width()) * 2 /* f16 */ * 2 /* K and V */;
  }
  return bytes;
}

}  // namespace

Expected<std::unique_ptr<Scheduler>> Scheduler::create(std::shared_ptr<const Model> model,
                                                       Backend& backend, SchedulerConfig cfg) {
  if (!model) return Status::error("scheduler: no model");
  if (cfg.n_slots < 1 || cfg.n_slots > 256)
    return Status::errorf("scheduler: --parallel {} must be in [1, 256]", cfg.n_slots);
  if (cfg.prefill_chunk < 1)
    return Status::errorf("scheduler: --prefill-chunk {} must be >= 1", cfg.prefill_chunk);
  if (cfg.max_queue < 0)
    return Status::errorf("scheduler: queue size {} must be >= 0", cfg.max_queue);
  if (cfg.n_ctx > model->n_ctx_train())
    return Status::errorf("scheduler: context {} exceeds the model's training context {}",
                          cfg.n_ctx, model->n_ctx_train());
  // The planes grow as positions arrive, so a context that cannot fit would fail only at the
  // first long request: refuse it now, against MemAvailable for host planes and the device's
  // free memory (after the weights' upload) for device planes; a backend that cannot tell its
  // free memory is not checked.
  const int32_t n_ctx = cfg.n_ctx > 0 ? cfg.n_ctx : std::min(model->n_ctx_train(), 4096);
  {
    const uint64_t per_slot =
        kv_bytes_at_full_context(model->hparams(), n_ctx, std::min(cfg.prefill_chunk, n_ctx));
    const uint64_t need = per_slot * uint64_t(cfg.n_slots);
    const bool device = backend.device_memory();
    const uint64_t avail = device ? backend.device_free_bytes() : memory_available();
    if (avail > 0 && need > avail)
      return Status::errorf(
          "scheduler: the KV cache of {} slots x {} positions needs {:.2f} GiB at full context "
          "and {:.2f} GiB of {} memory is available; lower --parallel or --ctx-size",
          cfg.n_slots, n_ctx, double(need) / (1 << 30), double(avail) / (1 << 30),
          device ? "device" : "host");
  }
  std::vector<std::unique_ptr<Drafter>> drafters;
  if (cfg.make_drafter) {
    if (cfg.draft_model < 0 || cfg.draft_model > GenerationParams::kMaxDraft)
      return Status::errorf("scheduler: {} drafts per step must be in [0, {}]", cfg.draft_model,
                            GenerationParams::kMaxDraft);
    for (int32_t i = 0; i < cfg.n_slots; ++i) {
      KILN_ASSIGN_OR_RETURN(auto d, cfg.make_drafter(n_ctx, std::min(cfg.prefill_chunk, n_ctx)));
      if (!d) return Status::error("scheduler: the drafter factory made no drafter");
      drafters.push_back(std::move(d));
    }
  }
  return std::unique_ptr<Scheduler>(
      new Scheduler(std::move(model), backend, std::move(cfg), std::move(drafters)));
}

Scheduler::Scheduler(std::shared_ptr<const Model> model, Backend& backend, SchedulerConfig cfg,
                     std::vector<std::unique_ptr<Drafter>> drafters)
    : model_(std::move(model)), backend_(backend), cfg_(std::move(cfg)) {
  n_ctx_ = cfg_.n_ctx > 0 ? cfg_.n_ctx : std::min(model_->n_ctx_train(), 4096);
  // The session's internal chunking is the scheduler's prefill chunk: one eval == one forward.
  const int32_t max_batch = std::min(cfg_.prefill_chunk, n_ctx_);
  for (int32_t i = 0; i < cfg_.n_slots; ++i) {
    auto s = std::make_unique<Slot>();
    s->id = i;
    s->session = std::make_unique<Session>(model_, backend_, n_ctx_, max_batch);
    if (!drafters.empty()) {
      s->drafter = std::move(drafters[static_cast<size_t>(i)]);
      s->capture.only = s->drafter->wanted_captures();
      s->capture.device = s->drafter->capture_device();
    }
    slots_.push_back(std::move(s));
  }
  if (cfg_.batch_decode) {
    // Room for every slot's decode token and drafts plus one whole prefill chunk, so a step
    // always makes progress on some prompt while everyone else decodes. Drafts never depend
    // on what else is in the step (that would make sampled ids depend on other requests).
    const int32_t per_slot = 1 + std::min(GenerationParams::kMaxDraft, max_batch - 1);
    batch_ = std::make_unique<BatchEval>(model_, backend_, cfg_.n_slots * per_slot + max_batch);
  }
  slot_busy_.assign(slots_.size(), 0);
  slot_pos_.assign(slots_.size(), 0);
  counters_.n_slots = cfg_.n_slots;
  for (const auto& s : slots_) slot_kv_bytes_.push_back(s->session->kv_bytes());
  thread_ = std::thread([this] { run(); });
}

Scheduler::~Scheduler() { shutdown(); }

Scheduler::Submitted Scheduler::submit(GenerationParams p) {
  Submitted out;
  auto req = make_request(std::move(p));
  if (!req) {
    out.error = SubmitError::kInvalid;
    out.message = req.error();
    return out;
  }
  auto stream = (*req)->stream;
  std::vector<std::unique_ptr<Request>> reqs;
  reqs.push_back(std::move(*req));
  out.error = enqueue(reqs, out.message);
  if (out.error == SubmitError::kNone) out.stream = std::move(stream);
  return out;
}

Scheduler::SubmittedN Scheduler::submit_n(GenerationParams p, std::span<const uint64_t> seeds) {
  SubmittedN out;
  if (seeds.empty()) {
    out.error = SubmitError::kInvalid;
    out.message = "no choices";
    return out;
  }
  auto share = seeds.size() > 1 ? std::make_shared<SharedPrefill>() : nullptr;
  std::vector<std::unique_ptr<Request>> reqs;
  std::vector<std::shared_ptr<GenStream>> streams;
  for (size_t i = 0; i < seeds.size(); ++i) {
    GenerationParams pi = p;
    pi.sampling.seed = seeds[i];
    auto req = make_request(std::move(pi));
    if (!req) {
      out.error = SubmitError::kInvalid;
      out.message = req.error();
      return out;
    }
    (*req)->share = share;
    (*req)->follower = i > 0;
    streams.push_back((*req)->stream);
    reqs.push_back(std::move(*req));
  }
  out.error = enqueue(reqs, out.message);
  if (out.error == SubmitError::kNone) out.streams = std::move(streams);
  return out;
}

Expected<std::unique_ptr<Scheduler::Request>> Scheduler::make_request(GenerationParams p) {
  auto invalid = [](std::string msg) { return Status::error(std::move(msg)); };
  if (p.prompt.empty()) return invalid("empty prompt");
  for (size_t i = 0; i < p.prompt.size(); ++i)
    if (p.prompt[i] < 0 || p.prompt[i] >= model_->n_vocab())
      return invalid(fmt::format("token id {} at index {} is outside the vocabulary [0, {})",
                                 p.prompt[i], i, model_->n_vocab()));
  if (static_cast<int64_t>(p.prompt.size()) >= n_ctx_)
    return invalid(fmt::format("prompt of {} tokens leaves no room in the context of {}",
                               p.prompt.size(), n_ctx_));
  if (p.max_tokens < 1) return invalid(fmt::format("max_tokens {} must be >= 1", p.max_tokens));
  if (p.top_logprobs > 20)
    return invalid(fmt::format("top_logprobs {} must be <= 20", p.top_logprobs));
  if (p.n_draft > GenerationParams::kMaxDraft)
    return invalid(fmt::format("n_draft {} must be <= {}", p.n_draft, GenerationParams::kMaxDraft));
  auto sampler = Sampler::create(p.sampling, model_->n_vocab());
  if (!sampler) return invalid(sampler.error());
  const int32_t n_default = cfg_.make_drafter ? cfg_.draft_model : cfg_.draft_ngram;
  int32_t n_draft = p.n_draft < 0 ? std::min(n_default, GenerationParams::kMaxDraft) : p.n_draft;
  if (!validate_spec_sampling(p.sampling).is_ok()) n_draft = 0;  // plain decoding, same result
  if (p.grammar) {
    if (!p.grammar_vocab) p.grammar_vocab = cfg_.grammar_vocab;
    if (!p.grammar_vocab || p.grammar_vocab->n_vocab() != model_->n_vocab())
      return invalid("grammar: this server has no vocabulary view for constrained decoding");
    n_draft = 0;  // n-gram drafts would mostly be masked out; forced tokens are drafted
  }
  const bool forced_drafts = p.grammar && p.n_draft != 0;
  // Penalties see the prompt, as in `kiln run`.
  for (int32_t id : p.prompt) sampler->accept(id);

  auto req = std::unique_ptr<Request>(
      new Request{std::move(p), std::move(*sampler), std::make_shared<GenStream>()});
  req->n_draft = std::max(n_draft, 0);
  req->forced_drafts = forced_drafts;
  req->spec_rng = Rng(req->params.sampling.seed);
  if (req->params.grammar)
    req->constraint.emplace(
        Constraint{req->params.grammar_vocab, grammar::Matcher(req->params.grammar), {}, {}, {}});
  return req;
}

Scheduler::SubmitError Scheduler::enqueue(std::vector<std::unique_ptr<Request>>& reqs,
                                          std::string& message) {
  {
    std::lock_guard lk(mu_);
    if (stop_) {
      message = "the server is shutting down";
      return SubmitError::kShuttingDown;
    }
    // Requests not yet handed to an idle slot do not count against the queue bound.
    const auto idle = static_cast<int32_t>(std::count(slot_busy_.begin(), slot_busy_.end(), 0));
    if (static_cast<int64_t>(queue_.size() + reqs.size()) > int64_t{cfg_.max_queue} + idle) {
      counters_.requests_rejected += reqs.size();
      message =
          fmt::format("all {} slots busy and {} requests queued", cfg_.n_slots, queue_.size());
      return SubmitError::kQueueFull;
    }
    counters_.requests_total += reqs.size();
    for (auto& r : reqs) queue_.push_back(std::move(r));
  }
  cv_.notify_all();
  return SubmitError::kNone;
}

void Scheduler::shutdown() {
  {
    std::lock_guard lk(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard lk(mu_);
  SchedulerStats s = counters_;
  s.queue_depth = static_cast<int32_t>(queue_.size());
  s.slots_busy = static_cast<int32_t>(std::count(slot_busy_.begin(), slot_busy_.end(), 1));
  s.kv_positions_total = static_cast<int64_t>(n_ctx_) * cfg_.n_slots;
  s.kv_positions_used = std::accumulate(slot_pos_.begin(), slot_pos_.end(), int64_t{0});
  s.kv_bytes = std::accumulate(slot_kv_bytes_.begin(), slot_kv_bytes_.end(), uint64_t{0});
  return s;
}

// Hands queued requests to idle slots, oldest request first. Among idle slots the one whose
// cached tokens share the longest prefix with the prompt wins (lowest id on ties); results do
// not depend on the choice (per-token arithmetic is independent of chunking and slot).
void Scheduler::admit_locked() {
  while (!queue_.empty()) {
    const std::vector<int32_t>& prompt = queue_.front()->params.prompt;
    Slot* best = nullptr;
    size_t best_common = 0;
    for (auto& s : slots_) {
      if (s->req) continue;
      const size_t n = std::min(s->cached.size(), prompt.size());
      size_t common = 0;
      while (common < n && s->cached[common] == prompt[common]) ++common;
      if (!best || common > best_common) {
        best = s.get();
        best_common = common;
      }
    }
    if (!best) return;
    // Keep at least one prompt token to evaluate: its logits give the first sampled token.
    best_common = std::min(best_common, prompt.size() - 1);
    if (!best->session->rollback(static_cast<int32_t>(best_common)).is_ok()) {
      // Sliding-window rings keep only the last window + batch positions, so a prefix that
      // ends before those cannot be resumed: start from an empty cache instead.
      best_common = 0;
      const Status st = best->session->rollback(0);
      KILN_CHECK(st.is_ok(), "rollback to an empty cache: {}", st.message());
    }
    // The drafter resumes the same prefix, or (when it cannot) the slot starts afresh.
    if (best->drafter && !best->drafter->rollback(static_cast<int32_t>(best_common)).is_ok()) {
      best_common = 0;
      Status st = best->session->rollback(0);
      if (st) st = best->drafter->rollback(0);
      KILN_CHECK(st.is_ok(), "rollback to an empty cache: {}", st.message());
    }
    best->cached.resize(best_common);
    best->req = std::move(queue_.front());
    queue_.pop_front();
    best->cursor = best_common;
    best->decoding = false;
    best->n_generated = 0;
    best->n_drafted = best->n_accepted = 0;
    best->t_start = best->t_first = std::chrono::steady_clock::now();
    best->n_reused = static_cast<int32_t>(best_common);
    // A follower whose slot lacks the prompt waits for its first choice's rows; a drafter
    // needs the prompt's activations, which neither copied rows nor a remote prefill bring
    // (such a follower prefills the prompt itself).
    best->await_prefill = best->req->follower && !best->drafter && best_common + 1 < prompt.size();
    best->remote_pending = cfg_.remote_prefill && !best->drafter && best_common == 0 &&
                           prompt.size() > 1 && !best->await_prefill;
    counters_.prompt_tokens += prompt.size();
    counters_.prompt_tokens_reused += best_common;
    slot_busy_[best->id] = 1;
  }
}

// Slots are touched only by this thread, so the (blocking, networked) remote prefill runs
// without the lock and submit() stays responsive meanwhile.
void Scheduler::remote_prefill_admitted() {
  for (auto& s : slots_) {
    if (!s->remote_pending) continue;
    s->remote_pending = false;
    const std::vector<int32_t>& prompt = s->req->params.prompt;
    const auto head = std::span<const int32_t>(prompt).first(prompt.size() - 1);
    if (s->session->n_pos() == 0 && cfg_.remote_prefill(*s->session, head)) {
      KILN_CHECK(s->session->n_pos() == static_cast<int32_t>(head.size()),
                 "remote prefill installed {} positions for {} tokens", s->session->n_pos(),
                 head.size());
      s->cursor = head.size();
      s->cached.assign(head.begin(), head.end());
    }
  }
}

void Scheduler::run() {
  for (;;) {
    {
      std::unique_lock lk(mu_);
      if (stop_) break;
      admit_locked();
      const bool any_busy = std::any_of(slots_.begin(), slots_.end(),
                                        [](const auto& s) { return s->req != nullptr; });
      if (!any_busy) {
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        continue;
      }
    }
    remote_prefill_admitted();
    step();
  }
  // Shutting down: everything still queued or running ends as cancelled.
  std::deque<std::unique_ptr<Request>> queued;
  {
    std::lock_guard lk(mu_);
    queued.swap(queue_);
  }
  for (auto& s : slots_)
    if (s->req) finish(*s, FinishReason::kCancelled);
  for (auto& r : queued) {
    GenEvent e;
    e.kind = GenEvent::Kind::kDone;
    e.finish = FinishReason::kCancelled;
    e.n_prompt = static_cast<int32_t>(r->params.prompt.size());
    r->stream->push(std::move(e));
  }
}

struct Scheduler::Work {
  Slot* slot = nullptr;
  std::span<const int32_t> tokens;  // prompt chunk, the last sampled token, or it + drafts
  int32_t n_draft = 0;              // > 0: tokens = [last, drafts...], all logits wanted
};

// One step: every decoding slot advances by one token and prompts by up to one chunk in all
// (batched), or every busy slot by one chunk or token in a call of its own (unbatched).
void Scheduler::step() {
  std::vector<Work> decode, prefill;
  for (auto& sp : slots_) {
    Slot& s = *sp;
    if (!s.req) continue;
    if (s.req->stream->cancelled()) {
      finish(s, FinishReason::kCancelled);
      continue;
    }
    if (s.await_prefill && (!take_shared_prefill(s) || !s.req)) continue;
    if (s.decoding) {
      if (s.session->n_pos() >= n_ctx_) {
        finish(s, FinishReason::kLength);
        continue;
      }
      decode.push_back({&s, std::span<const int32_t>(&s.last, 1)});
    }
  }
  // Drafts depend only on the slot's own sequence; the batch always has room for them.
  int64_t n_decode_tokens = 0;
  for (Work& w : decode) {
    if (w.slot->req->n_draft > 0) {
      if (Status st = draft(*w.slot, w); !st) {
        finish(*w.slot, FinishReason::kError, st.message());
        w.slot = nullptr;
        continue;
      }
    }
    if (w.slot->req->forced_drafts) draft_forced(*w.slot, w);
    n_decode_tokens += static_cast<int64_t>(w.tokens.size());
  }
  std::erase_if(decode, [](const Work& w) { return w.slot == nullptr; });
  // Prompts take turns going first, so with more prompt tokens than room in one step every
  // prompt still advances within a few steps.
  const size_t n = slots_.size();
  int64_t room = batch_ && cfg_.batch_prefill ? batch_->max_tokens() - n_decode_tokens
                                              : std::numeric_limits<int64_t>::max();
  for (size_t k = 0; k < n && room > 0; ++k) {
    Slot& s = *slots_[(prefill_rr_ + k) % n];
    if (!s.req || s.decoding || s.await_prefill) continue;
    const std::vector<int32_t>& prompt = s.req->params.prompt;
    int64_t len = std::min<int64_t>(
        {cfg_.prefill_chunk, room, static_cast<int64_t>(prompt.size() - s.cursor)});
    // On a backend whose results depend on a step's token count (CUDA), the prompt's last
    // token (whose logits give the first sampled token) waits for a later step, where it is
    // its sequence's only token as in a decode step: the step structure of `kiln run`
    // (Session::prefill_head) and of speculative decoding.
    if (!backend_.batch_invariant() && len > 1 &&
        s.cursor + static_cast<size_t>(len) == prompt.size())
      --len;
    prefill.push_back(
        {&s, std::span<const int32_t>(prompt).subspan(s.cursor, static_cast<size_t>(len))});
    room -= len;
  }
  prefill_rr_ = (prefill_rr_ + 1) % n;

  if (!batch_) {
    for (Work& w : decode) run_group(std::span<Work>(&w, 1), false);
    for (Work& w : prefill) run_group(std::span<Work>(&w, 1), false);
  } else if (cfg_.batch_prefill) {
    decode.insert(decode.end(), prefill.begin(), prefill.end());
    if (!decode.empty()) run_group(decode, true);
  } else {
    if (!decode.empty()) run_group(decode, true);
    for (Work& w : prefill) run_group(std::span<Work>(&w, 1), false);
  }
}

void Scheduler::run_group(std::span<Work> work, bool batched) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  std::vector<std::span<const float>> logits(work.size());
  std::vector<Session::TopK> tops(work.size());
  std::vector<std::string> errors(work.size());
  bool done = false;
  const auto V = static_cast<size_t>(model_->n_vocab());
  // Candidates instead of logit rows when every item samples from them (no drafts, no
  // logprobs): as many as the neediest asks for; each takes its own first ones.
  int32_t top_k = 0;
  for (const Work& w : work) {
    const Request& r = *w.slot->req;
    const int32_t need = cfg_.device_sampling && w.n_draft == 0 && r.params.top_logprobs < 0 &&
                                 !r.constraint  // the mask needs the whole row
                             ? r.sampler.candidates_needed(Backend::kTopKMost)
                             : 0;
    if (need == 0) {
      top_k = 0;
      break;
    }
    top_k = std::max(top_k, need);
  }
  if (batched) {
    std::vector<BatchEval::Item> items;
    for (const Work& w : work) {
      Slot& ws = *w.slot;
      items.push_back(
          {ws.session.get(), w.tokens, w.n_draft > 0, ws.drafter ? &ws.capture : nullptr});
    }
    if (top_k > 0) {  // no item has drafts, so none asks for all its rows
      auto out = batch_->eval_top_k(items, top_k);
      if (out) {
        const auto k = static_cast<size_t>(top_k);
        for (size_t i = 0; i < work.size(); ++i)
          tops[i] = {out->ids.subspan(i * k, k), out->logits.subspan(i * k, k)};
        done = true;
      }
    } else if (auto out = batch_->eval(items)) {
      size_t row = 0;
      for (size_t i = 0; i < work.size(); ++i) {
        const size_t rows = work[i].n_draft > 0 ? work[i].tokens.size() : 1;
        logits[i] = out->subspan(row * V, rows * V);
        row += rows;
      }
      done = true;
    }
    // Otherwise nothing changed: evaluate the slots one by one, so an error lands on the
    // request that caused it.
  }
  if (!done) {
    for (size_t i = 0; i < work.size(); ++i) {
      Slot& ws = *work[i].slot;
      ws.session->set_capture(ws.drafter ? &ws.capture : nullptr);
      struct NoCapture {
        Session& s;
        ~NoCapture() { s.set_capture(nullptr); }
      } no_capture{*ws.session};
      if (top_k > 0) {
        auto out = work[i].slot->session->eval_top_k(work[i].tokens, top_k);
        if (out)
          tops[i] = *out;
        else
          errors[i] = out.error();
        continue;
      }
      auto out = work[i].slot->session->eval(work[i].tokens, work[i].n_draft > 0);
      if (out)
        logits[i] = *out;
      else
        errors[i] = out.error();  // each session owns its logits buffer: spans stay valid
    }
  }
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  int64_t n_prefill = 0, n_total = 0;
  for (const Work& w : work) {
    n_total += static_cast<int64_t>(w.tokens.size());
    if (!w.slot->decoding) n_prefill += static_cast<int64_t>(w.tokens.size());
  }
  {
    // A mixed step's time is shared between prefill and decode by token count.
    std::lock_guard lk(mu_);
    const double f = n_total ? double(n_prefill) / double(n_total) : 0;
    counters_.prefill_seconds += dt * f;
    counters_.decode_seconds += dt * (1 - f);
    counters_.forward_passes += batched && done ? 1 : work.size();
    if (top_k > 0) counters_.candidate_passes += batched && done ? 1 : work.size();
    counters_.forward_tokens += static_cast<uint64_t>(n_total);
  }
  for (size_t i = 0; i < work.size(); ++i) {
    Slot& s = *work[i].slot;
    if (!errors[i].empty())
      finish(s, FinishReason::kError, errors[i]);
    else if (work[i].n_draft > 0)
      accept_drafts(s, work[i], logits[i]);
    else {
      if (s.drafter) s.drafter->observe_target(s.capture, int32_t(work[i].tokens.size()));
      advance(s, work[i].tokens, logits[i], top_k > 0 ? &tops[i] : nullptr);
    }
    std::lock_guard lk(mu_);
    slot_pos_[s.id] = s.session->n_pos();
    slot_kv_bytes_[s.id] = s.session->kv_bytes();
    if (!s.req) slot_busy_[s.id] = 0;
  }
}

void Scheduler::advance(Slot& s, std::span<const int32_t> in, std::span<const float> logits,
                        const Session::TopK* top) {
  Request& r = *s.req;
  s.cached.insert(s.cached.end(), in.begin(), in.end());
  if (!s.decoding) {
    s.cursor += in.size();
    if (s.cursor < r.params.prompt.size()) return;
    s.decoding = true;
    if (r.share && !r.follower && !r.share->ready) {
      // The other choices sample their first tokens from this row too.
      SharedPrefill& sh = *r.share;
      sh.ready = true;
      if (top) {
        sh.top_ids.assign(top->ids.begin(), top->ids.end());
        sh.top_logits.assign(top->logits.begin(), top->logits.end());
      } else {
        sh.row.assign(logits.begin(), logits.end());
      }
    }
  }
  sample_and_emit(s, logits, top);
}

bool Scheduler::take_shared_prefill(Slot& s) {
  Request& r = *s.req;
  const SharedPrefill& sh = *r.share;
  if (!sh.ready && !sh.leader_gone) return false;
  // The wait is over. The follower's prompt time is its own prompt work from here (the copy
  // of the first choice's rows, or its own prefill), not the wait: it evaluated none of the
  // first choice's prefill (docs/server.md, timings).
  s.await_prefill = false;
  s.t_start = std::chrono::steady_clock::now();
  if (!sh.ready) return true;  // the first choice ended early: prefill the prompt here
  const std::vector<int32_t>& prompt = r.params.prompt;
  // The first choice's slot holds the prompt's rows (it only appends after them); once it has
  // ended, any slot that kept them will do.
  Slot* src = nullptr;
  for (auto& o : slots_)
    if (o.get() != &s && o->cached.size() >= prompt.size() &&
        std::equal(prompt.begin(), prompt.end(), o->cached.begin())) {
      src = o.get();
      break;
    }
  if (!src) return true;
  const auto n = static_cast<int32_t>(prompt.size());
  if (!s.session->copy_prefix_from(*src->session, n)) {
    // Rows a ring no longer holds: prefill from the start.
    const Status st = s.session->rollback(0);
    KILN_CHECK(st.is_ok(), "rollback to an empty cache: {}", st.message());
    std::lock_guard lk(mu_);
    counters_.prompt_tokens_reused -= static_cast<uint64_t>(s.n_reused);
    s.cursor = 0;
    s.cached.clear();
    s.n_reused = 0;
    return true;
  }
  {
    std::lock_guard lk(mu_);
    const auto gained = static_cast<uint64_t>(n - s.n_reused);
    counters_.prompt_tokens_reused += gained;
    counters_.prompt_tokens_shared += gained;
    slot_pos_[s.id] = s.session->n_pos();
    slot_kv_bytes_[s.id] = s.session->kv_bytes();
  }
  s.cached = prompt;
  s.cursor = prompt.size();
  s.n_reused = n;
  s.decoding = true;
  if (!sh.top_ids.empty()) {
    const Session::TopK top{sh.top_ids, sh.top_logits};
    sample_and_emit(s, {}, &top);
  } else {
    sample_and_emit(s, sh.row, nullptr);
  }
  return true;
}

void Scheduler::sample_and_emit(Slot& s, std::span<const float> logits, const Session::TopK* top) {
  Request& r = *s.req;
  // emit_token reads the logits only for logprobs, which a candidates step never has.
  int32_t id = 0;
  if (r.constraint) {
    id = r.constraint->sample(r.sampler, logits);
    if (id < 0)
      return finish(s, FinishReason::kError,
                    "grammar: no token of the vocabulary continues the output");
  } else {
    id = top ? r.sampler.sample_top(top->ids, top->logits) : r.sampler.sample(logits);
  }
  emit_token(s, id, logits);
}

Status Scheduler::draft(Slot& s, Work& w) {
  const auto t0 = std::chrono::steady_clock::now();
  const Request& r = *s.req;
  // The verify input must fit one KV append (rings roll back only within the last batch),
  // the context, and the tokens the request may still emit (the target adds one of its own).
  const int64_t k =
      std::min<int64_t>({r.n_draft, s.session->max_batch() - 1, n_ctx_ - s.session->n_pos() - 1,
                         r.params.max_tokens - s.n_generated - 1});
  if (k <= 0) return Status::ok();
  s.spec_hist.assign(s.cached.begin(), s.cached.end());
  s.spec_hist.push_back(s.last);
  NgramDrafter ngram;
  Draft d;
  DraftRequest dr;
  dr.history = s.spec_hist;
  dr.max_tokens = static_cast<int32_t>(k);
  const Status st = s.drafter ? s.drafter->propose(dr, d).context(s.drafter->name() + " drafter")
                              : ngram.propose(dr, d);
  {
    std::lock_guard lk(mu_);
    counters_.spec_draft_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (s.drafter) KILN_TRY(st);
  if (!st || d.tokens.empty()) return Status::ok();  // nothing to propose: a plain decode step
  // A drafter may propose fewer, never more (greedy verification trusts the count).
  if (static_cast<int64_t>(d.tokens.size()) > k) d.tokens.resize(static_cast<size_t>(k));
  s.spec_in.assign(1, s.last);
  s.spec_in.insert(s.spec_in.end(), d.tokens.begin(), d.tokens.end());
  w.tokens = s.spec_in;
  w.n_draft = static_cast<int32_t>(d.tokens.size());
  return Status::ok();
}

void Scheduler::draft_forced(Slot& s, Work& w) {
  const Request& r = *s.req;
  const int64_t k =
      std::min<int64_t>({GenerationParams::kMaxDraft, s.session->max_batch() - 1,
                         n_ctx_ - s.session->n_pos() - 1, r.params.max_tokens - s.n_generated - 1});
  if (k <= 0) return;
  const std::vector<int32_t> d = r.constraint->forced(static_cast<size_t>(k));
  if (d.empty()) return;  // the grammar leaves a choice: a plain step
  s.spec_in.assign(1, s.last);
  s.spec_in.insert(s.spec_in.end(), d.begin(), d.end());
  w.tokens = s.spec_in;
  w.n_draft = static_cast<int32_t>(d.size());
}

void Scheduler::accept_forced(Slot& s, const Work& w, std::span<const float> rows) {
  Request& r = *s.req;
  const int32_t base = s.session->n_pos() - (w.n_draft + 1);
  // emit_token advances the sampler and the grammar token by token (and may end the request,
  // freeing both: verify_forced stops touching them then).
  const ForcedVerdict v = verify_forced(*r.constraint, r.sampler, rows, w.tokens.subspan(1),
                                        [&](int32_t id, std::span<const float> row) {
                                          emit_token(s, id, row);
                                          return s.req != nullptr;
                                        });
  // The rows of the tokens sampled so far stay (and reach the slot's drafter) either way.
  keep_verified(s, w, base, v.n_accepted, true);
  if (v.dead_end)
    finish(s, FinishReason::kError, "grammar: no token of the vocabulary continues the output");
}

void Scheduler::keep_verified(Slot& s, const Work& w, int32_t base, int32_t a, bool forced) {
  const int32_t k = w.n_draft;
  // The slot's drafter stays in step with `cached`: it sees the kept rows of every verify,
  // forced drafts included (a gap would shift the positions of everything it sees later).
  if (s.drafter) s.drafter->observe_target(s.capture, 1 + a);
  // Rejected rows belong to the last append, which every plane (rings included) can undo.
  if (a < k) {
    const Status st = s.session->rollback(base + 1 + a);
    KILN_CHECK(st.is_ok(), "rollback of rejected drafts: {}", st.message());
  }
  s.cached.insert(s.cached.end(), w.tokens.begin(), w.tokens.begin() + 1 + a);
  std::lock_guard lk(mu_);
  ++counters_.spec_steps;
  counters_.spec_drafted += static_cast<uint64_t>(k);
  counters_.spec_accepted += static_cast<uint64_t>(a);
  if (forced) {
    ++counters_.forced_steps;
    counters_.forced_drafted += static_cast<uint64_t>(k);
    counters_.forced_accepted += static_cast<uint64_t>(a);
  }
}

void Scheduler::accept_drafts(Slot& s, const Work& w, std::span<const float> rows) {
  Request& r = *s.req;
  if (r.constraint) return accept_forced(s, w, rows);
  const int32_t V = model_->n_vocab();
  const int32_t k = w.n_draft;
  const auto drafts = w.tokens.subspan(1);
  VerifyResult vr;
  if (r.params.sampling.temperature <= 0) {
    vr = verify_greedy(rows, drafts, V);
  } else {
    // The drafts are deterministic (q one-hot): the rejection rule on the target's p.
    s.spec_p.resize(static_cast<size_t>(k + 1) * static_cast<size_t>(V));
    for (int32_t i = 0; i <= k; ++i) {
      sampling_probs(rows.subspan(static_cast<size_t>(i) * V, V), r.params.sampling, s.spec_scratch,
                     s.spec_row);
      std::copy(s.spec_row.begin(), s.spec_row.end(), s.spec_p.begin() + ptrdiff_t(i) * V);
    }
    vr = verify_sampled(s.spec_p, {}, drafts, V, r.spec_rng);
  }
  const int32_t a = vr.n_accepted;
  s.n_drafted += k;
  s.n_accepted += a;
  keep_verified(s, w, s.session->n_pos() - (k + 1), a, false);
  // emit_token may end the request (end of generation, max_tokens): stop there.
  for (int32_t i = 0; i < a && s.req; ++i)
    emit_token(s, drafts[static_cast<size_t>(i)], rows.subspan(static_cast<size_t>(i) * V, V));
  if (s.req) emit_token(s, vr.next, rows.subspan(static_cast<size_t>(a) * V, V));
}

void Scheduler::emit_token(Slot& s, int32_t id, std::span<const float> logits) {
  Request& r = *s.req;
  r.sampler.accept(id);
  if (++s.n_generated == 1) s.t_first = std::chrono::steady_clock::now();
  {
    std::lock_guard lk(mu_);
    ++counters_.generated_tokens;
  }
  if (std::find(cfg_.eog_ids.begin(), cfg_.eog_ids.end(), id) != cfg_.eog_ids.end()) {
    finish(s, FinishReason::kStop);
    return;
  }
  GenEvent e;
  e.kind = GenEvent::Kind::kToken;
  e.id = id;
  if (r.params.top_logprobs >= 0) {
    // log-softmax of the model's logits, before any sampling transform (OpenAI's meaning).
    const float mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (float l : logits) sum += std::exp(double(l) - mx);
    const float lse = mx + static_cast<float>(std::log(sum));
    e.logprob = logits[static_cast<size_t>(id)] - lse;
    const size_t k = std::min<size_t>(static_cast<size_t>(r.params.top_logprobs), logits.size());
    if (k > 0) {
      std::vector<int32_t> idx(logits.size());
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + static_cast<ptrdiff_t>(k), idx.end(),
                        [&](int32_t a, int32_t b) {
                          return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
                        });
      for (size_t i = 0; i < k; ++i)
        e.top.push_back({idx[i], logits[static_cast<size_t>(idx[i])] - lse});
    }
  }
  const bool complete = r.constraint && r.constraint->accept(id);
  r.stream->push(std::move(e));
  if (complete) {  // the grammar allows nothing more: no model call to learn that
    finish(s, FinishReason::kStop);
    return;
  }
  if (s.n_generated >= r.params.max_tokens) {
    finish(s, FinishReason::kLength);
    return;
  }
  s.last = id;
}

void Scheduler::finish(Slot& s, FinishReason why, std::string error) {
  Request& r = *s.req;
  if (r.share && !r.follower && !r.share->ready) r.share->leader_gone = true;
  s.await_prefill = false;
  GenEvent e;
  e.kind = GenEvent::Kind::kDone;
  e.finish = why;
  e.error = std::move(error);
  e.n_prompt = static_cast<int32_t>(r.params.prompt.size());
  e.n_reused = s.n_reused;
  e.n_generated = s.n_generated;
  e.slot = s.id;
  e.n_drafted = s.n_drafted;
  e.n_draft_accepted = s.n_accepted;
  {
    using ms = std::chrono::duration<double, std::milli>;
    const auto now = std::chrono::steady_clock::now();
    const auto first = s.n_generated > 0 ? s.t_first : now;
    e.prompt_ms = ms(first - s.t_start).count();
    e.predicted_ms = ms(now - first).count();
  }
  if (why == FinishReason::kError) {
    // eval leaves the session unchanged on error; resynchronise the cache record with it.
    s.cached.resize(static_cast<size_t>(s.session->n_pos()));
  }
  {
    // Before the event goes out, so a client that saw its request end sees the slot free.
    std::lock_guard lk(mu_);
    if (why == FinishReason::kCancelled) ++counters_.requests_cancelled;
    slot_busy_[s.id] = 0;
    slot_pos_[s.id] = s.session->n_pos();
  }
  r.stream->push(std::move(e));
  s.req.reset();
  s.decoding = false;
}

}  // namespace kiln
