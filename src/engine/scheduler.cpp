// engine/scheduler.cpp: the slot scheduler loop (see scheduler.h): admission with prefix
// reuse, round-robin steps (one prefill chunk or one decode token per busy slot per step),
// sampling, logprobs and cancellation.
#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"

namespace kiln {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
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
};

struct Scheduler::Slot {
  int32_t id = 0;
  std::unique_ptr<Session> session;
  std::vector<int32_t> cached;  // tokens whose KV rows the session holds, in position order
  std::unique_ptr<Request> req;  // null: idle
  size_t cursor = 0;             // next prompt token to evaluate
  bool decoding = false;
  int32_t last = 0;              // sampled, not yet evaluated
  int32_t n_generated = 0, n_reused = 0;
};

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
  return std::unique_ptr<Scheduler>(new Scheduler(std::move(model), backend, std::move(cfg)));
}

Scheduler::Scheduler(std::shared_ptr<const Model> model, Backend& backend, SchedulerConfig cfg)
    : model_(std::move(model)), backend_(backend), cfg_(std::move(cfg)) {
  n_ctx_ = cfg_.n_ctx > 0 ? cfg_.n_ctx : std::min(model_->n_ctx_train(), 4096);
  // The session's internal chunking is the scheduler's prefill chunk: one eval == one forward.
  const int32_t max_batch = std::min(cfg_.prefill_chunk, n_ctx_);
  for (int32_t i = 0; i < cfg_.n_slots; ++i) {
    auto s = std::make_unique<Slot>();
    s->id = i;
    s->session = std::make_unique<Session>(model_, backend_, n_ctx_, max_batch);
    slots_.push_back(std::move(s));
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
  auto invalid = [&](std::string msg) {
    out.error = SubmitError::kInvalid;
    out.message = std::move(msg);
    return out;
  };
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
  auto sampler = Sampler::create(p.sampling, model_->n_vocab());
  if (!sampler) return invalid(sampler.error());
  // Penalties see the prompt, as in `kiln run`.
  for (int32_t id : p.prompt) sampler->accept(id);

  auto req = std::unique_ptr<Request>(
      new Request{std::move(p), std::move(*sampler), std::make_shared<GenStream>()});
  {
    std::lock_guard lk(mu_);
    if (stop_) {
      out.error = SubmitError::kShuttingDown;
      out.message = "the server is shutting down";
      return out;
    }
    // Requests not yet handed to an idle slot do not count against the queue bound.
    const auto idle = static_cast<int32_t>(std::count(slot_busy_.begin(), slot_busy_.end(), 0));
    if (static_cast<int32_t>(queue_.size()) >= cfg_.max_queue + idle) {
      ++counters_.requests_rejected;
      out.error = SubmitError::kQueueFull;
      out.message = fmt::format("all {} slots busy and {} requests queued", cfg_.n_slots,
                                queue_.size());
      return out;
    }
    ++counters_.requests_total;
    out.stream = req->stream;
    queue_.push_back(std::move(req));
  }
  cv_.notify_all();
  return out;
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
    Status st = best->session->rollback(static_cast<int32_t>(best_common));
    KILN_CHECK(st.is_ok(), "rollback within the cached tokens: {}", st.message());
    best->cached.resize(best_common);
    best->req = std::move(queue_.front());
    queue_.pop_front();
    best->cursor = best_common;
    best->decoding = false;
    best->n_generated = 0;
    best->n_reused = static_cast<int32_t>(best_common);
    counters_.prompt_tokens += prompt.size();
    counters_.prompt_tokens_reused += best_common;
    slot_busy_[best->id] = 1;
  }
}

void Scheduler::run() {
  using Clock = std::chrono::steady_clock;
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
    // One step: every busy slot advances by one prefill chunk or one decode token, so a long
    // prompt delays the others by at most one chunk.
    for (auto& sp : slots_) {
      Slot& s = *sp;
      if (!s.req) continue;
      const bool prefill = !s.decoding;
      const auto t0 = Clock::now();
      const bool still_busy = step_slot(s);
      const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
      std::lock_guard lk(mu_);
      if (prefill) counters_.prefill_seconds += dt;
      else counters_.decode_seconds += dt;
      slot_pos_[s.id] = s.session->n_pos();
      slot_kv_bytes_[s.id] = s.session->kv_bytes();
      if (!still_busy) slot_busy_[s.id] = 0;
    }
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

bool Scheduler::step_slot(Slot& s) {
  Request& r = *s.req;
  if (r.stream->cancelled()) {
    finish(s, FinishReason::kCancelled);
    return false;
  }
  const std::vector<int32_t>& prompt = r.params.prompt;
  std::span<const int32_t> in;
  if (!s.decoding) {
    const size_t n = std::min<size_t>(static_cast<size_t>(cfg_.prefill_chunk), prompt.size() - s.cursor);
    in = std::span<const int32_t>(prompt).subspan(s.cursor, n);
  } else {
    if (s.session->n_pos() >= n_ctx_) {
      finish(s, FinishReason::kLength);
      return false;
    }
    in = std::span<const int32_t>(&s.last, 1);
  }
  auto logits = s.session->eval(in, false);
  if (!logits) {
    finish(s, FinishReason::kError, logits.error());
    return false;
  }
  s.cached.insert(s.cached.end(), in.begin(), in.end());
  if (!s.decoding) {
    s.cursor += in.size();
    if (s.cursor < prompt.size()) return true;
    s.decoding = true;
  }
  emit_token(s, r.sampler.sample(*logits), *logits);
  return s.req != nullptr;
}

void Scheduler::emit_token(Slot& s, int32_t id, std::span<const float> logits) {
  Request& r = *s.req;
  r.sampler.accept(id);
  ++s.n_generated;
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
  r.stream->push(std::move(e));
  if (s.n_generated >= r.params.max_tokens) {
    finish(s, FinishReason::kLength);
    return;
  }
  s.last = id;
}

void Scheduler::finish(Slot& s, FinishReason why, std::string error) {
  Request& r = *s.req;
  GenEvent e;
  e.kind = GenEvent::Kind::kDone;
  e.finish = why;
  e.error = std::move(error);
  e.n_prompt = static_cast<int32_t>(r.params.prompt.size());
  e.n_reused = s.n_reused;
  e.n_generated = s.n_generated;
  e.slot = s.id;
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
