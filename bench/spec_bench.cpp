// bench/spec_bench.cpp: speculative decoding vs plain decoding, measured in the same process
// and interleaved (the CPU is shared with other work, so only ratios are meaningful).
// Usage: spec_bench TARGET.gguf DRAFT.gguf [n_tokens=200] [k=4] [repeats=3]
// Prints, per prompt: plain greedy t/s, draft-model speculative t/s and n-gram speculative
// t/s, with tokens per verify step (acceptance length) and draft/verify time split.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/speculative.h"
#include "sampling/spec_verify.h"
#include "tokenizer/tokenizer.h"

using namespace kiln;
using Clock = std::chrono::steady_clock;

namespace {

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
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct SpecRun {
  double seconds = 0;
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
  // Prefill everything but the last prompt token outside the timed region, like plain.
  (void)(*dec)->start(prompt);
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
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  ids.resize(size_t(n));
  r.same = ids == want;
  r.stats = (*dec)->stats();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    fmt::print(stderr, "usage: spec_bench TARGET.gguf DRAFT.gguf [n_tokens] [k] [repeats]\n");
    return 2;
  }
  const int32_t n = argc > 3 ? std::atoi(argv[3]) : 200;
  const int32_t k = argc > 4 ? std::atoi(argv[4]) : 4;
  const int repeats = argc > 5 ? std::atoi(argv[5]) : 3;
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
  auto be = make_cpu_backend(1);
  const int32_t n_ctx = 1024;
  Session plain(*tm, *be, n_ctx, k + 1);
  Session target(*tm, *be, n_ctx, k + 1);
  auto md = ModelDrafter::create(*dm, *be, n_ctx, (*tm)->n_vocab());
  if (!md) {
    fmt::print(stderr, "spec_bench: {}\n", md.error());
    return 1;
  }
  NgramDrafter ng(1, 3);
  const std::vector<std::pair<std::string, std::string>> prompts = {
      {"story", "Once upon a time, there was a little girl named Lily."},
      {"repetitive",
       "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on "
       "the log. The cat sat on the mat. The dog sat on the log. The cat sat on the mat."}};
  fmt::print("target {} draft {} n={} k={} repeats={} (1 thread, best of repeats)\n", argv[1],
             argv[2], n, k, repeats);
  {
    // Cost of one verify step relative to one plain decode step: speculation can only win
    // where a (k+1)-token eval costs much less than k+1 one-token evals (memory-bound decode).
    const auto prompt = tok->encode(prompts[0].second, true, false);
    (void)plain.rollback(0);
    (void)plain.eval(prompt, false);
    const int32_t base = plain.n_pos();
    std::vector<int32_t> batch(size_t(k + 1), prompt.back());
    auto time_eval = [&](size_t m) {
      double best = 1e9;
      for (int r = 0; r < 50; ++r) {
        const auto t0 = Clock::now();
        (void)plain.eval(std::span(batch).first(m), m > 1);
        best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
        (void)plain.rollback(base);
      }
      return best;
    };
    const double t1 = time_eval(1), tk = time_eval(size_t(k + 1));
    fmt::print("eval cost: 1 token {:.3f} ms, {} tokens {:.3f} ms ({:.2f}x one token)\n",
               t1 * 1e3, k + 1, tk * 1e3, tk / t1);
  }
  for (const auto& [name, text] : prompts) {
    const auto prompt = tok->encode(text, true, false);
    double best_plain = 1e9;
    SpecRun best_model, best_ngram;
    best_model.seconds = best_ngram.seconds = 1e9;
    std::vector<int32_t> want;
    for (int r = 0; r < repeats; ++r) {
      best_plain = std::min(best_plain, plain_greedy(plain, prompt, n, want));
      SpecRun m = spec_greedy(target, **md, k, prompt, n, want);
      if (m.seconds < best_model.seconds) best_model = m;
      SpecRun g = spec_greedy(target, ng, k, prompt, n, want);
      if (g.seconds < best_ngram.seconds) best_ngram = g;
    }
    auto line = [&](const char* what, const SpecRun& s) {
      fmt::print(
          "  {:<12} {:8.1f} t/s  x{:.2f}  tokens/step {:.2f}  accepted {}/{}  draft {:.0f}% "
          "verify {:.0f}%  ids {}\n",
          what, n / s.seconds, best_plain / s.seconds, s.stats.tokens_per_step(),
          s.stats.accepted, s.stats.drafted,
          100 * s.stats.draft_s / (s.stats.draft_s + s.stats.verify_s),
          100 * s.stats.verify_s / (s.stats.draft_s + s.stats.verify_s),
          s.same ? "identical" : "DIFFER");
    };
    fmt::print("{} prompt ({} tokens):\n  {:<12} {:8.1f} t/s\n", name, prompt.size(), "plain",
               n / best_plain);
    line("draft-model", best_model);
    line("ngram", best_ngram);
  }
  return 0;
}
