// bench/spec_bench.cpp: speculative decoding vs plain decoding, measured in the same process
// and interleaved (the CPU is shared with other work, so only ratios are meaningful).
// Usage: spec_bench TARGET.gguf DRAFT.gguf [n_tokens=200] [k=4 | k,k,...] [repeats=3]
//                   [threads=1] [prompts=all|story|repetitive] [device=cpu|cuda|auto]
// The backend is made as `kiln run --device` makes it (engine/runtime.h; KILN_* variables and
// KILN_DEV apply), one backend for target and draft as there.
// Prints the cost of a (k+1)-token verify eval and of one draft-model token relative to one
// target decode step (the two numbers that decide whether speculation can pay), then, per
// prompt: plain greedy t/s, and per k draft-model and n-gram speculative t/s with the ratio to
// plain, tokens per verify step (acceptance length), ms per step in draft and verify, and
// whether the ids equal plain greedy decoding's.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/runtime.h"
#include "core/config.h"
#include "engine/speculative.h"
#include "sampling/spec_verify.h"
#include "tokenizer/tokenizer.h"

using namespace kiln;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double plain_greedy(Session& s, std::span<const int32_t> prompt, int32_t n,
                    std::vector<int32_t>& ids) {
  ids.clear();
  (void)s.rollback(0);
  auto l = s.eval(prompt.first(prompt.size() - 1), false);
  const auto t0 = Clock::now();
  int32_t last = prompt.back();
  while (static_cast<int32_t>(ids.size()) < n) {
    const int32_t one[1] = {last};
    l = s.eval(one, false);
    if (!l) break;
    last = argmax_id(*l);
    ids.push_back(last);
  }
  return since(t0);
}

struct SpecRun {
  double seconds = 1e9;
  SpecStats stats;
  bool same = false;
};

SpecRun spec_greedy(Session& target, Drafter& d, int32_t k, std::span<const int32_t> prompt,
                    int32_t n, const std::vector<int32_t>& want) {
  SpecParams p;
  p.n_draft = k;
  p.sampling.temperature = 0;
  auto dec = SpeculativeDecoder::create(target, d, p);
  if (!dec) {
    fmt::print(stderr, "spec_bench: {}\n", dec.error());
    std::exit(1);
  }
  // Prefill everything but the last prompt token outside the timed region, like plain. The
  // draft model's prefill of the prompt is inside it (its first propose), as in `kiln run`.
  if (Status s = (*dec)->start(prompt); !s) {
    fmt::print(stderr, "spec_bench: {}\n", s.message());
    std::exit(1);
  }
  std::vector<int32_t> ids;
  const auto t0 = Clock::now();
  while (static_cast<int32_t>(ids.size()) < n) {
    auto st = (*dec)->step();
    if (!st) {
      fmt::print(stderr, "spec_bench: {}\n", st.error());
      std::exit(1);
    }
    ids.insert(ids.end(), st->tokens.begin(), st->tokens.end());
  }
  SpecRun r;
  r.seconds = since(t0);
  ids.resize(size_t(n));
  r.same = ids == want;
  r.stats = (*dec)->stats();
  return r;
}

// Proposes the plain run's own ids (known from the same process), the first wrong one at a
// chosen place, so each verify accepts exactly accept_len - 1 drafts and emits accept_len
// tokens. A free drafter of known acceptance: it measures what the speculative loop itself
// (verify batch, rollback, bookkeeping) turns a given acceptance length into, on this model.
// Random-weight models give the real drafters' acceptance only by chance (see the report).
class ReplayDrafter final : public Drafter {
 public:
  ReplayDrafter(size_t prompt_len, const std::vector<int32_t>& ids, int32_t accept_len,
                int32_t n_vocab)
      : prompt_len_(prompt_len), ids_(ids), accept_len_(accept_len), n_vocab_(n_vocab) {}
  std::string name() const override { return "replay"; }
  Status propose(const DraftRequest& req, Draft& out) override {
    out.tokens.clear();
    out.probs.clear();
    const size_t at = req.history.size() - prompt_len_;  // ids emitted so far
    for (int32_t i = 0; i < req.max_tokens && at + size_t(i) < ids_.size(); ++i) {
      const int32_t t = ids_[at + size_t(i)];
      out.tokens.push_back(i == accept_len_ - 1 ? (t + 1) % n_vocab_ : t);
    }
    return Status::ok();
  }

 private:
  size_t prompt_len_;
  const std::vector<int32_t>& ids_;
  int32_t accept_len_, n_vocab_;
};

// Best wall time of evaluating m copies of `tok` after `base` positions (rolled back after
// each try). Repeats until both 3 tries and ~0.5 s are spent, at most 50 tries.
double time_eval(Session& s, int32_t base, int32_t tok, size_t m) {
  std::vector<int32_t> batch(m, tok);
  double best = 1e9, spent = 0;
  for (int r = 0; r < 50 && (r < 3 || spent < 0.5); ++r) {
    (void)s.rollback(base);
    const auto t0 = Clock::now();
    (void)s.eval(batch, m > 1);
    const double t = since(t0);
    best = std::min(best, t);
    spent += t;
  }
  (void)s.rollback(base);
  return best;
}

std::vector<int32_t> parse_ks(const char* arg) {
  std::vector<int32_t> ks;
  std::string s(arg);
  size_t at = 0;
  while (at <= s.size()) {
    const size_t comma = std::min(s.find(',', at), s.size());
    const int k = std::atoi(s.substr(at, comma - at).c_str());
    if (k < 1 || k > 32) {
      fmt::print(stderr, "spec_bench: k '{}' outside [1, 32]\n", s.substr(at, comma - at));
      std::exit(2);
    }
    ks.push_back(k);
    at = comma + 1;
  }
  return ks;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fmt::print(stderr,
               "usage: spec_bench TARGET.gguf DRAFT.gguf [n_tokens] [k or k,k,...] [repeats] "
               "[threads] [all|story|repetitive] [cpu|cuda|auto]\n");
    return 2;
  }
  const int32_t n = argc > 3 ? std::atoi(argv[3]) : 200;
  const std::vector<int32_t> ks = argc > 4 ? parse_ks(argv[4]) : std::vector<int32_t>{4};
  const int repeats = argc > 5 ? std::atoi(argv[5]) : 3;
  const int threads = argc > 6 ? std::atoi(argv[6]) : 1;
  const std::string which = argc > 7 ? argv[7] : "all";
  // cpu by default (the figures in docs/BENCHMARKS.md), unlike kiln's auto.
  const std::string device = argc > 8 ? argv[8] : "cpu";
  if (n < 1 || repeats < 1 || threads < 1 ||
      (which != "all" && which != "story" && which != "repetitive")) {
    fmt::print(stderr,
               "spec_bench: bad arguments (n_tokens, repeats, threads >= 1; prompts "
               "all|story|repetitive)\n");
    return 2;
  }
  const int32_t k_max = *std::max_element(ks.begin(), ks.end());
  // The verify cost is printed for every k up to this, whatever ks the loops run.
  const int32_t k_cost = std::max(k_max, 8);
  auto tm = Model::load(argv[1]);
  auto dm = Model::load(argv[2]);
  if (!tm || !dm) {
    fmt::print(stderr, "spec_bench: {}\n", !tm ? tm.error() : dm.error());
    return 1;
  }
  auto tok = Tokenizer::from_gguf((*tm)->gguf());
  if (!tok) {
    fmt::print(stderr, "spec_bench: {}\n", tok.error());
    return 1;
  }
  auto cfg = load_config({{"device", device}, {"threads", std::to_string(threads)}});
  if (!cfg) {
    fmt::print(stderr, "spec_bench: {}\n", cfg.error());
    return 2;
  }
  auto eo = engine_options(*cfg);
  if (!eo) {
    fmt::print(stderr, "spec_bench: {}\n", eo.error());
    return 2;
  }
  auto backend = Runtime::make_backend(**tm, *eo);
  if (!backend) {
    fmt::print(stderr, "spec_bench: {}\n", backend.error());
    return 1;
  }
  Backend* be = backend->get();
  const int32_t n_ctx = 1024;
  Session plain(*tm, *be, n_ctx, k_cost + 1);
  Session target(*tm, *be, n_ctx, k_max + 1);
  // The draft session never evaluates more than k + 1 tokens at once after its prompt
  // prefill; a small batch limit keeps its scratch small (prefill then runs in chunks).
  auto md = ModelDrafter::create(*dm, *be, n_ctx, (*tm)->n_vocab(), std::max(k_max + 1, 64));
  if (!md) {
    fmt::print(stderr, "spec_bench: {}\n", md.error());
    return 1;
  }
  NgramDrafter ng(1, 3);
  std::vector<std::pair<std::string, std::string>> prompts = {
      {"story", "Once upon a time, there was a little girl named Lily."},
      {"repetitive",
       "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on "
       "the log. The cat sat on the mat. The dog sat on the log. The cat sat on the mat."}};
  if (which != "all") std::erase_if(prompts, [&](const auto& p) { return p.first != which; });
  fmt::print(
      "target {} ({:.0f} MiB) draft {} ({:.0f} MiB)\nn={} k={} repeats={} threads={} "
      "backend {} (best of repeats, interleaved)\n",
      argv[1], double((*tm)->weight_bytes()) / 1048576.0, argv[2],
      double((*dm)->weight_bytes()) / 1048576.0, n, fmt::join(ks, ","), repeats, threads,
      be->name());
  // Verify cost: speculation can only win where a (k+1)-token eval costs much less than k+1
  // one-token evals (weight-bandwidth-bound decode), and a draft-model token much less than a
  // target one.
  std::vector<double> verify_ratio(size_t(k_cost + 1), 0.0);
  double draft_ratio = 0;
  {
    const auto prompt = tok->encode(prompts[0].second, true, false);
    (void)plain.rollback(0);
    (void)plain.eval(prompt, false);
    Session dsess(*dm, *be, n_ctx, 8);
    (void)dsess.eval(prompt, false);
    const int32_t base = plain.n_pos();
    const double t1 = time_eval(plain, base, prompt.back(), 1);
    const double d1 = time_eval(dsess, base, prompt.back(), 1);
    draft_ratio = d1 / t1;
    // Attention grows with the context, so the costs are also taken where the decode loops
    // spend their average step: halfway through n generated tokens (the predictions use
    // those). Filler tokens: the cost does not depend on the ids.
    const int32_t mid = std::min(base + n / 2, n_ctx - k_cost - 2);
    std::vector<int32_t> fill(size_t(mid - base), prompt.back());
    (void)plain.eval(fill, false);
    const double t1m = time_eval(plain, mid, prompt.back(), 1);
    fmt::print(
        "eval cost: target 1 token {:.3f} ms at context {} ({:.1f} GB/s of weights), "
        "{:.3f} ms at context {}; draft 1 token {:.3f} ms ({:.2f}x target at {})\n",
        t1 * 1e3, base, double((*tm)->weight_bytes()) / t1 / 1e9, t1m * 1e3, mid, d1 * 1e3,
        draft_ratio, base);
    for (int32_t k = 1; k <= k_cost; ++k) {
      (void)plain.rollback(mid);
      const double tkm = time_eval(plain, mid, prompt.back(), size_t(k + 1));
      (void)plain.rollback(base);
      const double tk = time_eval(plain, base, prompt.back(), size_t(k + 1));
      verify_ratio[size_t(k)] = tkm / t1m;
      fmt::print(
          "  verify k={}: {} tokens at context {}: {:.3f} ms = {:.2f}x one token; at "
          "context {}: {:.3f} ms = {:.2f}x (the break-even acceptance length), {:.2f}x "
          "per token\n",
          k, k + 1, base, tk * 1e3, tk / t1, mid, tkm * 1e3, tkm / t1m, tkm / t1m / double(k + 1));
      (void)plain.eval(fill, false);
    }
    (void)plain.rollback(0);
  }
  for (const auto& [name, text] : prompts) {
    const auto prompt = tok->encode(text, true, false);
    double best_plain = 1e9;
    std::vector<SpecRun> best_model(ks.size()), best_ngram(ks.size());
    // Replay runs per k at acceptance lengths 2, 3, 4 and k + 1 (those <= k + 1).
    std::vector<std::vector<int32_t>> lens(ks.size());
    std::vector<std::vector<SpecRun>> best_replay(ks.size());
    for (size_t i = 0; i < ks.size(); ++i) {
      for (int32_t L : {2, 3, 4, ks[i] + 1})
        if (L <= ks[i] + 1 && std::find(lens[i].begin(), lens[i].end(), L) == lens[i].end())
          lens[i].push_back(L);
      best_replay[i].resize(lens[i].size());
    }
    std::vector<int32_t> want;
    for (int r = 0; r < repeats; ++r) {
      best_plain = std::min(best_plain, plain_greedy(plain, prompt, n, want));
      for (size_t i = 0; i < ks.size(); ++i) {
        SpecRun m = spec_greedy(target, **md, ks[i], prompt, n, want);
        if (m.seconds < best_model[i].seconds) best_model[i] = m;
        SpecRun g = spec_greedy(target, ng, ks[i], prompt, n, want);
        if (g.seconds < best_ngram[i].seconds) best_ngram[i] = g;
        for (size_t j = 0; j < lens[i].size(); ++j) {
          ReplayDrafter rd(prompt.size(), want, lens[i][j], (*tm)->n_vocab());
          SpecRun x = spec_greedy(target, rd, ks[i], prompt, n, want);
          if (x.seconds < best_replay[i][j].seconds) best_replay[i][j] = x;
        }
      }
    }
    fmt::print("{} prompt ({} tokens):\n  {:<18} {:8.2f} t/s  ({:.1f} ms/token)\n", name,
               prompt.size(), "plain", n / best_plain, best_plain / n * 1e3);
    auto line = [&](const std::string& what, int32_t k, const SpecRun& s, bool model) {
      const double steps = double(std::max<uint64_t>(1, s.stats.steps));
      // What the eval costs above predict, as a speed-up over plain decoding: tokens per step
      // over the step's cost in plain decode steps (one verify plus k draft-model tokens;
      // n-gram and replay drafting cost ~0).
      const double cost = verify_ratio[size_t(k)] + (model ? double(k) * draft_ratio : 0.0);
      fmt::print(
          "  {:<18} {:8.2f} t/s  x{:.2f} (predicted x{:.2f})  tokens/step {:.2f}  accepted "
          "{}/{}  per step: draft {:.1f} ms verify {:.1f} ms  ids {}\n",
          what, n / s.seconds, best_plain / s.seconds, s.stats.tokens_per_step() / cost,
          s.stats.tokens_per_step(), s.stats.accepted, s.stats.drafted,
          s.stats.draft_s / steps * 1e3, s.stats.verify_s / steps * 1e3,
          s.same ? "identical" : "DIFFER");
    };
    for (size_t i = 0; i < ks.size(); ++i) {
      line(fmt::format("draft-model k={}", ks[i]), ks[i], best_model[i], true);
      line(fmt::format("ngram k={}", ks[i]), ks[i], best_ngram[i], false);
      for (size_t j = 0; j < lens[i].size(); ++j)
        line(fmt::format("replay k={} L={}", ks[i], lens[i][j]), ks[i], best_replay[i][j], false);
    }
  }
  return 0;
}
