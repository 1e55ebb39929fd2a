// engine/speculative.cpp: drafters (second model, n-gram lookup) and the draft/verify/rollback
// loop.
#include "engine/speculative.h"

#include <algorithm>
#include <chrono>

#include "core/check.h"
#include "sampling/spec_verify.h"

namespace kiln {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

// ---------------------------------------------------------------- ModelDrafter

ModelDrafter::ModelDrafter(std::shared_ptr<const Model> m, Backend& be, int32_t n_ctx,
                           int32_t max_batch)
    : session_(std::move(m), be, n_ctx, max_batch) {}

Status Drafter::rollback(int32_t n_pos) {
  if (n_pos == 0) return prepare({});
  return Status::errorf("the {} drafter cannot resume a history at position {}", name(), n_pos);
}

Expected<std::unique_ptr<ModelDrafter>> ModelDrafter::create(std::shared_ptr<const Model> draft,
                                                             Backend& backend, int32_t n_ctx,
                                                             int32_t target_n_vocab,
                                                             int32_t max_batch) {
  if (!draft) return Status::error("draft model: none given");
  if (draft->n_vocab() != target_n_vocab)
    return Status::errorf(
        "draft model vocabulary has {} tokens but the target's has {}; speculative decoding "
        "needs the same vocabulary",
        draft->n_vocab(), target_n_vocab);
  return std::unique_ptr<ModelDrafter>(
      new ModelDrafter(std::move(draft), backend, n_ctx, max_batch));
}

Status ModelDrafter::sync(std::span<const int32_t> history) {
  const size_t H = history.size();
  KILN_CHECK(H > 0);
  size_t common = 0;
  while (common < evaluated_.size() && common < H && evaluated_[common] == history[common])
    ++common;
  if (common == H && evaluated_.size() == H) return Status::ok();  // logits already current
  // Keep the longest valid prefix, but re-evaluate at least the last history token: its
  // logits are what the first proposal is drawn from.
  size_t keep = std::min(common, H - 1);
  if (keep < evaluated_.size()) {
    if (!session_.rollback(static_cast<int32_t>(keep))) {
      // A sliding-window ring cannot roll back this far: start over.
      keep = 0;
      ++n_reprefills_;
      KILN_TRY(session_.rollback(0));
    }
    evaluated_.resize(keep);
  }
  auto l = session_.eval(history.subspan(keep), false);
  if (!l) {
    evaluated_.clear();
    (void)session_.rollback(0);
    return l.status().context("draft model");
  }
  evaluated_.assign(history.begin(), history.end());
  last_logits_.assign(l->begin(), l->end());
  return Status::ok();
}

Status ModelDrafter::prepare(std::span<const int32_t> prompt) {
  if (prompt.empty()) return Status::ok();
  if (int64_t(prompt.size()) > int64_t(session_.n_ctx()))
    return Status::errorf("draft model: prompt of {} tokens exceeds its context of {}",
                          prompt.size(), session_.n_ctx());
  return sync(prompt);
}

Status ModelDrafter::propose(const DraftRequest& req, Draft& out) {
  out.tokens.clear();
  out.probs.clear();
  KILN_CHECK(req.max_tokens > 0 && !req.history.empty());
  KILN_CHECK(req.sampling == nullptr || req.rng != nullptr);
  // The draft session must hold history plus k-1 drafts.
  const int64_t room = int64_t(session_.n_ctx()) - int64_t(req.history.size());
  const int32_t k = static_cast<int32_t>(std::min<int64_t>(req.max_tokens, room + 1));
  if (k <= 0) return Status::ok();
  KILN_TRY(sync(req.history));
  const size_t V = static_cast<size_t>(session_.n_vocab());
  for (int32_t i = 0; i < k; ++i) {
    int32_t t;
    if (req.sampling) {
      sampling_probs(last_logits_, *req.sampling, scratch_, q_);
      t = sample_probs(q_, *req.rng);
      out.probs.insert(out.probs.end(), q_.begin(), q_.end());
    } else {
      t = argmax_id(last_logits_);
    }
    out.tokens.push_back(t);
    if (i + 1 == k) break;  // the last proposal's logits are never needed
    const int32_t one[1] = {t};
    auto l = session_.eval(one, false);
    if (!l) return l.status().context("draft model");
    evaluated_.push_back(t);
    last_logits_.assign(l->begin(), l->end());
  }
  KILN_CHECK(out.probs.empty() || out.probs.size() == out.tokens.size() * V);
  return Status::ok();
}

// ---------------------------------------------------------------- NgramDrafter

NgramDrafter::NgramDrafter(int32_t min_ngram, int32_t max_ngram)
    : min_n_(std::max(1, min_ngram)), max_n_(std::max(std::max(1, min_ngram), max_ngram)) {}

Status NgramDrafter::propose(const DraftRequest& req, Draft& out) {
  out.tokens.clear();
  out.probs.clear();
  const auto h = req.history;
  const int64_t H = static_cast<int64_t>(h.size());
  // Longer n-grams first: a longer matching context predicts the continuation better.
  for (int64_t n = max_n_; n >= min_n_; --n) {
    if (H < n + 1) continue;
    const auto pattern = h.subspan(static_cast<size_t>(H - n));
    // Most recent earlier occurrence (it must leave at least one token after it).
    for (int64_t j = H - n - 1; j >= 0; --j) {
      if (!std::equal(pattern.begin(), pattern.end(), h.begin() + j)) continue;
      const int64_t from = j + n;
      const int64_t to = std::min<int64_t>(H, from + req.max_tokens);
      out.tokens.assign(h.begin() + from, h.begin() + to);
      return Status::ok();
    }
  }
  return Status::ok();
}

// ---------------------------------------------------------------- SpeculativeDecoder

SpeculativeDecoder::SpeculativeDecoder(Session& t, Drafter& d, const SpecParams& p)
    : target_(t),
      drafter_(d),
      params_(p),
      rng_(p.sampling.seed),
      // A different stream for the drafter, so its draws do not shift the verifier's.
      draft_rng_(p.sampling.seed ^ 0x5eed'd4af'7000'0001ull),
      c_steps_(process_counters().counter("spec.steps")),
      c_drafted_(process_counters().counter("spec.drafted")),
      c_accepted_(process_counters().counter("spec.accepted")),
      t_draft_(process_counters().timer("spec.draft")),
      t_verify_(process_counters().timer("spec.verify")) {
  capture_.only = d.wanted_captures();
  capture_.device = d.capture_device();
}

Expected<std::unique_ptr<SpeculativeDecoder>> SpeculativeDecoder::create(Session& target,
                                                                         Drafter& drafter,
                                                                         const SpecParams& p) {
  if (p.n_draft < 1) return Status::errorf("draft length {} must be >= 1", p.n_draft);
  if (p.n_draft + 1 > target.max_batch())
    return Status::errorf(
        "draft length {} needs a verify batch of {} tokens but the target's batch limit is {} "
        "(rollback needs each verify to be one forward step)",
        p.n_draft, p.n_draft + 1, target.max_batch());
  // Greedy verification also needs this: bias or penalties would change the argmax.
  KILN_TRY(validate_spec_sampling(p.sampling));
  if (p.sampling.temperature > 0) {
    if (p.draft_sampling.temperature > 0) {
      if (Status s = validate_spec_sampling(p.draft_sampling); !s) return s.context("draft");
    }
  }
  return std::unique_ptr<SpeculativeDecoder>(new SpeculativeDecoder(target, drafter, p));
}

Status SpeculativeDecoder::start(std::span<const int32_t> prompt) {
  if (prompt.empty()) return Status::error("speculative decoding: empty prompt");
  if (int64_t(prompt.size()) >= target_.n_ctx())
    return Status::errorf("prompt of {} tokens leaves no room in a context of {}", prompt.size(),
                          target_.n_ctx());
  KILN_TRY(target_.rollback(0));
  history_.assign(prompt.begin(), prompt.end());
  KILN_TRY(drafter_.prepare(prompt).context(drafter_.name() + " drafter"));
  capture_.only = drafter_.wanted_captures();
  capture_.device = drafter_.capture_device();
  const std::span<const int32_t> head = prompt.first(prompt.size() - 1);
  // A drafter conditioned on the target's activations sees the prompt's too, one forward
  // step at a time (a Session's capture holds its last step only).
  const size_t chunk = capture_.only.empty() ? head.size() : size_t(target_.max_batch());
  for (size_t done = 0; done < head.size(); done += chunk) {
    const auto part = head.subspan(done, std::min(chunk, head.size() - done));
    target_.set_capture(capture_.only.empty() ? nullptr : &capture_);
    auto l = target_.eval(part, false);
    target_.set_capture(nullptr);
    if (!l) return l.status();
    if (!capture_.only.empty()) drafter_.observe_target(capture_, int32_t(part.size()));
  }
  rng_ = Rng(params_.sampling.seed);
  draft_rng_ = Rng(params_.sampling.seed ^ 0x5eed'd4af'7000'0001ull);
  stats_ = SpecStats{};
  return Status::ok();
}

Expected<SpecStep> SpeculativeDecoder::step() {
  if (history_.empty()) return Status::error("speculative decoding: start() was not called");
  const int32_t base = target_.n_pos();  // == history_.size() - 1: the last token is pending
  KILN_CHECK(base + 1 == static_cast<int32_t>(history_.size()));
  const int32_t free = target_.n_ctx() - base;
  if (free < 1) return Status::errorf("context full ({} positions)", target_.n_ctx());
  const int32_t k = std::min(params_.n_draft, free - 1);
  const int32_t V = target_.n_vocab();
  const bool sampled = params_.sampling.temperature > 0;

  // Draft.
  auto t0 = std::chrono::steady_clock::now();
  draft_.tokens.clear();
  draft_.probs.clear();
  if (k > 0) {
    DraftRequest req;
    req.history = history_;
    req.max_tokens = k;
    if (sampled && params_.draft_sampling.temperature > 0) {
      req.sampling = &params_.draft_sampling;
      req.rng = &draft_rng_;
    }
    KILN_TRY(drafter_.propose(req, draft_).context(drafter_.name() + " drafter"));
    if (static_cast<int32_t>(draft_.tokens.size()) > k)
      return Status::errorf("{} drafter proposed {} tokens, more than the {} asked",
                            drafter_.name(), draft_.tokens.size(), k);
    for (int32_t t : draft_.tokens)
      if (t < 0 || t >= V)
        return Status::errorf("{} drafter proposed token {} outside the vocabulary",
                              drafter_.name(), t);
    if (!draft_.probs.empty() && draft_.probs.size() != draft_.tokens.size() * size_t(V))
      return Status::errorf("{} drafter returned {} probabilities for {} tokens", drafter_.name(),
                            draft_.probs.size(), draft_.tokens.size());
    // A greedy verify ignores q; a sampled verify with greedy drafting treats q as one-hot.
    if (!sampled || req.sampling == nullptr) draft_.probs.clear();
  }
  const double draft_s = seconds_since(t0);
  t_draft_.record(std::chrono::steady_clock::now() - t0);

  // Verify: the pending token plus the drafts in one forward step.
  t0 = std::chrono::steady_clock::now();
  const int32_t n_draft = static_cast<int32_t>(draft_.tokens.size());
  batch_.assign(1, history_.back());
  batch_.insert(batch_.end(), draft_.tokens.begin(), draft_.tokens.end());
  const bool capture = !drafter_.wanted_captures().empty();
  target_.set_capture(capture ? &capture_ : nullptr);
  // Greedy: each row's argmax where the rows are computed; else the rows themselves.
  const bool by_ids = !sampled && !params_.keep_logits;
  std::span<const float> rows;
  VerifyResult vr;
  if (by_ids) {
    auto top = target_.eval_top_k(batch_, 1, /*all_rows=*/true);
    target_.set_capture(nullptr);
    if (!top) return top.status().context("speculative verify");
    vr = verify_greedy_ids(top->ids, draft_.tokens);
  } else {
    auto logits = target_.eval(batch_, true);
    target_.set_capture(nullptr);
    if (!logits) return logits.status().context("speculative verify");
    rows = *logits;
    if (!sampled) {
      vr = verify_greedy(rows, draft_.tokens, V);
    } else {
      p_.resize(size_t(n_draft + 1) * size_t(V));
      for (int32_t i = 0; i <= n_draft; ++i) {
        sampling_probs(rows.subspan(size_t(i) * size_t(V), size_t(V)), params_.sampling, scratch_,
                       row_);
        std::copy(row_.begin(), row_.end(), p_.begin() + ptrdiff_t(i) * V);
      }
      vr = verify_sampled(p_, draft_.probs, draft_.tokens, V, rng_);
    }
  }
  const int32_t a = vr.n_accepted;
  kept_logits_.assign(rows.begin(),
                      rows.empty() ? rows.begin() : rows.begin() + ptrdiff_t(a + 1) * V);
  // Drop the rejected draft rows (the kept ones are the pending token + accepted drafts).
  if (a < n_draft) KILN_TRY(target_.rollback(base + 1 + a).context("speculative rollback"));
  if (capture) drafter_.observe_target(capture_, a + 1);
  const double verify_s = seconds_since(t0);
  t_verify_.record(std::chrono::steady_clock::now() - t0);

  SpecStep out;
  out.n_past = base;
  out.draft = draft_.tokens;
  out.tokens.assign(draft_.tokens.begin(), draft_.tokens.begin() + a);
  out.tokens.push_back(vr.next);
  out.n_drafted = n_draft;
  out.n_accepted = a;
  out.logits = kept_logits_;
  history_.insert(history_.end(), out.tokens.begin(), out.tokens.end());

  stats_.steps += 1;
  stats_.drafted += uint64_t(n_draft);
  stats_.accepted += uint64_t(a);
  stats_.emitted += out.tokens.size();
  stats_.draft_s += draft_s;
  stats_.verify_s += verify_s;
  c_steps_.add();
  c_drafted_.add(uint64_t(n_draft));
  c_accepted_.add(uint64_t(a));
  return out;
}

}  // namespace kiln
