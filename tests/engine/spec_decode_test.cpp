// tests/engine/spec_decode_test.cpp: speculative decoding on real model files. Greedy output
// ids equal plain greedy decoding (draft model and n-gram drafters, several architectures,
// sliding-window rings that wrap); forced rejection at every offset of a wrapped ring keeps
// every kept logit bit-identical to a plain run; sampled output follows the target's
// per-position token distribution (two-sample chi-square over many seeds, with a power check).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "common/testdata.h"
#include "engine/speculative.h"
#include "kv/kv_cache.h"

namespace kiln {
namespace {

std::shared_ptr<const Model> load(const std::string& file) {
  auto m = Model::load(testing::model_path(file));
  EXPECT_TRUE(m.has_value()) << m.error();
  return m ? *m : nullptr;
}

std::vector<int32_t> random_prompt(int32_t n, int32_t n_vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids{1};
  while (static_cast<int32_t>(ids.size()) < n)
    ids.push_back(static_cast<int32_t>(2 + rng() % static_cast<uint32_t>(n_vocab - 2)));
  return ids;
}

struct Plain {
  std::vector<int32_t> ids;
  std::vector<float> logits;  // [ids.size()][n_vocab]: the row each id was chosen from
};

// Plain decoding, one token per eval, with the ordinary Sampler (greedy at temperature 0).
Plain plain_decode(Session& s, Sampler& sampler, std::span<const int32_t> prompt, int32_t n,
                   bool keep_logits = false) {
  Plain out;
  EXPECT_TRUE(s.rollback(0));
  auto l = s.eval(prompt, false);
  EXPECT_TRUE(l.has_value()) << l.error();
  for (int32_t i = 0; i < n && l; ++i) {
    const int32_t t = sampler.sample(*l);
    out.ids.push_back(t);
    if (keep_logits) out.logits.insert(out.logits.end(), l->begin(), l->end());
    const int32_t one[1] = {t};
    l = s.eval(one, false);
    EXPECT_TRUE(l.has_value()) << l.error();
  }
  return out;
}

std::vector<int32_t> spec_decode(SpeculativeDecoder& d, std::span<const int32_t> prompt,
                                 int32_t n) {
  std::vector<int32_t> out;
  EXPECT_TRUE(d.start(prompt));
  while (static_cast<int32_t>(out.size()) < n) {
    auto st = d.step();
    EXPECT_TRUE(st.has_value()) << st.error();
    if (!st) break;
    out.insert(out.end(), st->tokens.begin(), st->tokens.end());
  }
  out.resize(std::min<size_t>(out.size(), size_t(n)));
  return out;
}

struct Pair {
  const char* target;
  const char* draft;
  // A drafter whose session is in step accepts more than drafted / accept_div (one out of
  // step accepts ~none): 4 for a quantized copy of the target, 8 for muse-glimmer, whose
  // q4_k_m and f16 copies agree on ~22-25 % of drafts (its logits are scaled by 0.196 then
  // softcapped at 20, which flattens the top of the distribution).
  int accept_div = 4;
};

class GreedyIdentity : public ::testing::TestWithParam<Pair> {};

TEST_P(GreedyIdentity, SameIdsAsPlainGreedy) {
  auto tm = load(GetParam().target);
  auto dm = load(GetParam().draft);
  ASSERT_TRUE(tm && dm);
  auto be = make_cpu_backend({.threads = 1});
  const int32_t n_gen = 48, k = 4;
  // max_batch k+1: sliding-window rings get capacity window + 5 and wrap many times.
  Session target(tm, *be, 128, k + 1);
  Session ref(tm, *be, 128, k + 1);
  SamplerParams greedy;
  greedy.temperature = 0;
  auto sampler = Sampler::create(greedy, tm->n_vocab());
  ASSERT_TRUE(sampler.has_value());
  // A prompt that repeats itself, so n-gram drafts are sometimes right and sometimes wrong.
  auto prompt = random_prompt(12, tm->n_vocab(), 5);
  const auto again = prompt;
  prompt.insert(prompt.end(), again.begin() + 1, again.end());
  const Plain want = plain_decode(ref, *sampler, prompt, n_gen);

  auto md = ModelDrafter::create(dm, *be, 128, tm->n_vocab());
  ASSERT_TRUE(md.has_value()) << md.error();
  // Draft session with batch limit 1: its rings (capacity window + 1) wrap, rollbacks of up
  // to 2 positions work and longer ones take the re-prefill fallback.
  auto md_small = ModelDrafter::create(dm, *be, 128, tm->n_vocab(), 1);
  ASSERT_TRUE(md_small.has_value()) << md_small.error();
  NgramDrafter ng(1, 3);
  // Each drafter verified by the rows' ids (the default) and by the rows (keep_logits): the
  // same ids and the same acceptance.
  for (Drafter* drafter : {static_cast<Drafter*>(md->get()), static_cast<Drafter*>(md_small->get()),
                           static_cast<Drafter*>(&ng)})
    for (const bool keep : {false, true}) {
      SpecParams sp;
      sp.n_draft = k;
      sp.sampling = greedy;
      sp.keep_logits = keep;
      auto dec = SpeculativeDecoder::create(target, *drafter, sp);
      ASSERT_TRUE(dec.has_value()) << dec.error();
      CounterRegistry& reg = process_counters();
      const uint64_t steps0 = reg.counter("spec.steps").value();
      const uint64_t drafted0 = reg.counter("spec.drafted").value();
      const uint64_t accepted0 = reg.counter("spec.accepted").value();
      const uint64_t verify0 = reg.timer("spec.verify").count();
      const auto got = spec_decode(**dec, prompt, n_gen);
      EXPECT_EQ(got, want.ids) << drafter->name();
      const SpecStats& s = (*dec)->stats();
      // The process-wide counters (--stats, /metrics) saw the same numbers.
      EXPECT_EQ(reg.counter("spec.steps").value() - steps0, s.steps);
      EXPECT_EQ(reg.counter("spec.drafted").value() - drafted0, s.drafted);
      EXPECT_EQ(reg.counter("spec.accepted").value() - accepted0, s.accepted);
      EXPECT_EQ(reg.timer("spec.verify").count() - verify0, s.steps);
      EXPECT_GT(s.drafted, 0u) << drafter->name();
      EXPECT_LE(s.accepted, s.drafted);
      EXPECT_EQ(s.emitted, s.accepted + s.steps);
      // A quantized copy of the target agrees with it most of the time; zero acceptance would
      // mean the drafter's session is out of step with the history.
      if (drafter != &ng) {
        EXPECT_GT(s.accepted, s.drafted / uint64_t(GetParam().accept_div)) << drafter->name();
      }
      static uint64_t accepted_by_ids = 0;
      if (!keep)
        accepted_by_ids = s.accepted;
      else
        EXPECT_EQ(s.accepted, accepted_by_ids) << drafter->name() << ": by rows vs by ids";
      std::printf("[ info ] %s + %s: %llu steps, drafted %llu, accepted %llu, %.2f tokens/step\n",
                  GetParam().target, drafter->name().c_str(), (unsigned long long)s.steps,
                  (unsigned long long)s.drafted, (unsigned long long)s.accepted,
                  s.tokens_per_step());
    }
  bool has_ring = false;
  for (const auto& L : dm->hparams().layers) has_ring |= L.window > 0;
  // (A model drafting for itself is never rejected, so it never needs the fallback.)
  const bool self_draft = std::string(GetParam().target) == GetParam().draft;
  if (has_ring && !self_draft)
    EXPECT_GT((*md_small)->n_reprefills(), 0u) << "fallback path not exercised";
  EXPECT_EQ((*md)->n_reprefills(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Models, GreedyIdentity,
    // Every shared model as the target (issue 10: identity on every one), each drafted by
    // another quantization of itself where the fixtures have one, else by itself.
    ::testing::Values(Pair{"stories260K.gguf", "stories260K-q8_0.gguf"},
                      Pair{"stories260K-q8_0.gguf", "stories260K.gguf"},
                      Pair{"babyllama-tok105-f32.gguf", "babyllama-tok105-f32.gguf"},
                      Pair{"llama-gqa-q8_0.gguf", "llama-gqa-q4_0.gguf"},
                      Pair{"llama-gqa-f16.gguf", "llama-gqa-q8_0.gguf"},
                      Pair{"llama-gqa-bf16.gguf", "llama-gqa-f16.gguf"},
                      Pair{"llama-gqa-q4_0.gguf", "llama-gqa-q8_0.gguf"},
                      Pair{"llama-gqa-q4_k_m.gguf", "llama-gqa-q6_k.gguf"},
                      Pair{"llama-gqa-q5_k_m.gguf", "llama-gqa-q6_k.gguf"},
                      Pair{"llama-gqa-q6_k.gguf", "llama-gqa-q8_0.gguf"},
                      Pair{"gemma2-swa-f16.gguf", "gemma2-swa-q8_0.gguf"},
                      Pair{"gemma2-swa-q8_0.gguf", "gemma2-swa-f16.gguf"},
                      Pair{"gemma3-swa-f16.gguf", "gemma3-swa-f16.gguf"},
                      Pair{"qwen3-bpe-f16.gguf", "qwen3-bpe-q8_0.gguf"},
                      Pair{"qwen3-bpe-q8_0.gguf", "qwen3-bpe-f16.gguf"},
                      Pair{"muse-glimmer-f16.gguf", "muse-glimmer-q4_k_m.gguf", 8},
                      Pair{"muse-glimmer-q4_k_m.gguf", "muse-glimmer-f16.gguf", 8},
                      Pair{"qwen3moe-f16.gguf", "qwen3moe-q4_k_m.gguf"},
                      Pair{"qwen3moe-q4_k_m.gguf", "qwen3moe-f16.gguf"},
                      Pair{"mixtral-q4_k_m.gguf", "mixtral-q4_k_m.gguf"}),
    [](const auto& info) {
      std::string n = info.param.target;
      n = n.substr(0, n.find(".gguf"));
      std::replace_if(
          n.begin(), n.end(), [](char c) { return !isalnum(c); }, '_');
      return n;
    });

// The draft model prefills the prompt in start(), alongside the target, so the first step's
// draft time is its proposals only (not a whole prompt prefill charged to decoding).
TEST(SpecDecode, DraftModelPrefillsPromptInStart) {
  auto tm = load("stories260K.gguf");
  auto dm = load("stories260K-q8_0.gguf");
  ASSERT_TRUE(tm && dm);
  auto be = make_cpu_backend({.threads = 1});
  const int32_t k = 4;
  Session target(tm, *be, 64, k + 1);
  auto md = ModelDrafter::create(dm, *be, 64, tm->n_vocab());
  ASSERT_TRUE(md.has_value()) << md.error();
  SpecParams sp;
  sp.n_draft = k;
  sp.sampling.temperature = 0;
  auto dec = SpeculativeDecoder::create(target, **md, sp);
  ASSERT_TRUE(dec.has_value()) << dec.error();
  const auto prompt = random_prompt(20, tm->n_vocab(), 11);
  ASSERT_TRUE((*dec)->start(prompt));
  EXPECT_EQ((*md)->n_evaluated(), prompt.size());
  auto st = (*dec)->step();
  ASSERT_TRUE(st.has_value()) << st.error();
  ASSERT_EQ(st->n_drafted, k);
  // The last proposal's logits are never needed, so the step evaluated k - 1 tokens.
  EXPECT_EQ((*md)->n_evaluated(), prompt.size() + size_t(k - 1));
  // A prompt the draft's context cannot hold is a one-line error from start().
  Session big(tm, *be, 128, k + 1);
  auto dec2 = SpeculativeDecoder::create(big, **md, sp);
  ASSERT_TRUE(dec2.has_value()) << dec2.error();
  const Status s = (*dec2)->start(random_prompt(100, tm->n_vocab(), 12));
  EXPECT_FALSE(s);
  EXPECT_NE(s.message().find("draft model"), std::string::npos) << s.message();
}

// Proposes the reference continuation but corrupts it at a chosen offset, cycling the offset
// 0, 1, ..., k (k = no corruption), so every verify rejects at a known place.
class OracleDrafter final : public Drafter {
 public:
  OracleDrafter(std::vector<int32_t> truth, size_t prompt_len, int32_t n_vocab, int32_t k)
      : truth_(std::move(truth)), prompt_len_(prompt_len), n_vocab_(n_vocab), k_(k) {}
  std::string name() const override { return "oracle"; }
  Status propose(const DraftRequest& req, Draft& out) override {
    out.tokens.clear();
    out.probs.clear();
    const size_t done = req.history.size() - prompt_len_;
    const int32_t bad_at = step_++ % (k_ + 1);
    for (int32_t i = 0; i < req.max_tokens && done + size_t(i) < truth_.size(); ++i) {
      int32_t t = truth_[done + size_t(i)];
      if (i == bad_at) t = (t + 1) % n_vocab_;
      out.tokens.push_back(t);
    }
    return Status::ok();
  }
  std::map<int32_t, int> accepted_hist;

 private:
  std::vector<int32_t> truth_;
  size_t prompt_len_;
  int32_t n_vocab_, k_, step_ = 0;
};

class SpecRollback : public ::testing::TestWithParam<std::string> {};

TEST_P(SpecRollback, WrappedRingRejectionAtEveryOffsetKeepsLogitsExact) {
  auto m = load(GetParam());
  ASSERT_TRUE(m);
  bool has_ring = false;
  for (const auto& L : m->hparams().layers) has_ring |= L.window > 0;
  ASSERT_TRUE(has_ring) << GetParam() << " should have sliding-window layers";
  auto be = make_cpu_backend({.threads = 1});
  const int32_t k = 4, n_gen = 70;
  Session ref(m, *be, 96, k + 1);
  SamplerParams greedy;
  greedy.temperature = 0;
  auto sampler = Sampler::create(greedy, m->n_vocab());
  ASSERT_TRUE(sampler.has_value());
  const auto prompt = random_prompt(9, m->n_vocab(), 11);
  const Plain want = plain_decode(ref, *sampler, prompt, n_gen, /*keep_logits=*/true);
  const size_t V = size_t(m->n_vocab());

  Session target(m, *be, 96, k + 1);
  OracleDrafter oracle(want.ids, prompt.size(), m->n_vocab(), k);
  SpecParams sp;
  sp.n_draft = k;
  sp.sampling = greedy;
  sp.keep_logits = true;
  auto dec = SpeculativeDecoder::create(target, oracle, sp);
  ASSERT_TRUE(dec.has_value()) << dec.error();
  ASSERT_TRUE((*dec)->start(prompt));
  std::vector<int32_t> got;
  std::vector<int> seen_accept(size_t(k) + 1);
  while (got.size() < size_t(n_gen)) {
    auto st = (*dec)->step();
    ASSERT_TRUE(st.has_value()) << st.error();
    ASSERT_EQ(st->logits.size(), st->tokens.size() * V);
    for (size_t i = 0; i < st->tokens.size() && got.size() < size_t(n_gen); ++i) {
      const size_t at = got.size();
      ASSERT_EQ(st->tokens[i], want.ids[at]) << "token " << at;
      ASSERT_EQ(
          std::memcmp(st->logits.data() + i * V, want.logits.data() + at * V, V * sizeof(float)), 0)
          << "logits of generated token " << at << " differ from the plain run";
      got.push_back(st->tokens[i]);
    }
    if (st->n_drafted == k) ++seen_accept[size_t(st->n_accepted)];
  }
  // Rejection happened at every offset (and full acceptance too).
  for (int32_t a = 0; a <= k; ++a) EXPECT_GT(seen_accept[size_t(a)], 2) << "accepted " << a;
  // The rings really wrapped: far more positions than ring capacity (window + max_batch).
  int32_t min_window = 1 << 30;
  for (const auto& L : m->hparams().layers)
    if (L.window > 0) min_window = std::min(min_window, L.window);
  EXPECT_GT(target.n_pos(), 3 * (min_window + k + 1));
}

INSTANTIATE_TEST_SUITE_P(RingModels, SpecRollback,
                         ::testing::Values("gemma2-swa-f16.gguf", "gemma3-swa-f16.gguf"),
                         [](const auto& info) {
                           std::string n = info.param.substr(0, info.param.find(".gguf"));
                           std::replace_if(
                               n.begin(), n.end(), [](char c) { return !isalnum(c); }, '_');
                           return n;
                         });

// The hook a block drafter (DFlash-style) uses: it names target activations, the decoder
// captures them during verify and reports how many rows were kept.
class CaptureDrafter final : public Drafter {
 public:
  std::string name() const override { return "capture"; }
  Status prepare(std::span<const int32_t> prompt) override {
    prompt_rows = static_cast<int32_t>(prompt.size()) - 1;
    seen_prompt = 0;
    last_drafted = -1;
    return Status::ok();
  }
  Status propose(const DraftRequest& req, Draft& out) override {
    out.tokens.assign(size_t(req.max_tokens), req.history.back());  // a repeat guess
    out.probs.clear();
    last_drafted = req.max_tokens;
    return Status::ok();
  }
  std::vector<std::string> wanted_captures() const override { return {"blk.0.l_out"}; }
  void observe_target(const model::Capture& c, int32_t kept) override {
    auto it = c.nodes.find("blk.0.l_out");
    ok &= it != c.nodes.end() && c.nodes.size() == 1;  // only the node asked for
    if (it == c.nodes.end()) return;
    if (last_drafted < 0) {  // start(): the prompt's rows, every one kept
      ok &= kept == it->second.n_rows;
      seen_prompt += kept;
      return;
    }
    ok &= it->second.n_rows == last_drafted + 1 && kept >= 1 && kept <= last_drafted + 1;
    ++calls;
  }
  int32_t last_drafted = -1, prompt_rows = 0, seen_prompt = 0;
  int calls = 0;
  bool ok = true;
};

TEST(SpecDecoder, BlockDrafterHookSeesTargetHiddenStates) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  Session target(m, *be, 64, 8), ref(m, *be, 64, 8);
  SamplerParams greedy;
  greedy.temperature = 0;
  auto sampler = Sampler::create(greedy, m->n_vocab());
  const auto prompt = random_prompt(6, m->n_vocab(), 21);
  const Plain want = plain_decode(ref, *sampler, prompt, 20);
  CaptureDrafter cd;
  SpecParams sp;
  sp.n_draft = 3;
  sp.sampling = greedy;
  auto dec = SpeculativeDecoder::create(target, cd, sp);
  ASSERT_TRUE(dec.has_value());
  EXPECT_EQ(spec_decode(**dec, prompt, 20), want.ids);
  EXPECT_GT(cd.calls, 0);
  EXPECT_TRUE(cd.ok);
  EXPECT_EQ(cd.seen_prompt, cd.prompt_rows);
  // A prompt longer than the target's batch limit reaches the drafter step by step.
  const auto long_prompt = random_prompt(30, m->n_vocab(), 22);
  const Plain want_long = plain_decode(ref, *sampler, long_prompt, 8);
  EXPECT_EQ(spec_decode(**dec, long_prompt, 8), want_long.ids);
  EXPECT_TRUE(cd.ok);
  EXPECT_EQ(cd.seen_prompt, 29);
}

TEST(SpecDecoder, RejectsBadSetups) {
  auto m = load("stories260K.gguf");
  auto other = load("babyllama-tok105-f32.gguf");
  ASSERT_TRUE(m && other);
  auto be = make_cpu_backend({.threads = 1});
  Session target(m, *be, 64, 4);
  NgramDrafter ng;
  SpecParams sp;
  sp.n_draft = 4;  // verify batch 5 > max_batch 4
  EXPECT_FALSE(SpeculativeDecoder::create(target, ng, sp).has_value());
  sp.n_draft = 0;
  EXPECT_FALSE(SpeculativeDecoder::create(target, ng, sp).has_value());
  sp.n_draft = 3;
  sp.sampling.temperature = 0.8f;
  sp.sampling.repeat_penalty = 1.1f;
  auto bad = SpeculativeDecoder::create(target, ng, sp);
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().find("penalt"), std::string::npos) << bad.error();
  auto md = ModelDrafter::create(other, *be, 64, m->n_vocab());
  ASSERT_FALSE(md.has_value());
  EXPECT_NE(md.error().find("vocabulary"), std::string::npos) << md.error();
  sp.sampling.repeat_penalty = 1.0f;
  auto dec = SpeculativeDecoder::create(target, ng, sp);
  ASSERT_TRUE(dec.has_value());
  EXPECT_FALSE((*dec)->step().has_value());  // no start()
  EXPECT_FALSE((*dec)->start({}));
  // Fill the context: steps stop with an error, never overrun.
  const auto prompt = random_prompt(60, m->n_vocab(), 3);
  ASSERT_TRUE((*dec)->start(prompt));
  Status last = Status::ok();
  for (int i = 0; i < 10 && last; ++i) {
    auto st = (*dec)->step();
    if (!st) last = st.status();
  }
  EXPECT_FALSE(last);
  // Like plain decoding: every position holds a token and one more was chosen from the last
  // position's logits.
  EXPECT_EQ((*dec)->history().size(), size_t(target.n_ctx()) + 1);
}

// Two-sample chi-square homogeneity over tokens with enough mass (the rest pooled).
double two_sample_chi(const std::map<int32_t, int>& a, const std::map<int32_t, int>& b, int* df) {
  std::map<int32_t, std::pair<int, int>> both;
  for (auto [t, c] : a) both[t].first += c;
  for (auto [t, c] : b) both[t].second += c;
  double stat = 0;
  int bins = 0, pool_a = 0, pool_b = 0;
  for (auto [t, c] : both) {
    if (c.first + c.second < 20) {
      pool_a += c.first;
      pool_b += c.second;
      continue;
    }
    stat += double(c.first - c.second) * (c.first - c.second) / (c.first + c.second);
    ++bins;
  }
  if (pool_a + pool_b > 0) {
    stat += double(pool_a - pool_b) * (pool_a - pool_b) / (pool_a + pool_b);
    ++bins;
  }
  *df = bins - 1;
  return stat;
}

double chi_crit_1e4(int df) {
  const double z = 3.719, d = std::max(df, 1);
  const double t = 1 - 2 / (9 * d) + z * std::sqrt(2 / (9 * d));
  return d * t * t * t;
}

TEST(SpecSampling, PerPositionFrequenciesMatchPlainSampling) {
  auto tm = load("stories260K.gguf");
  auto dm = load("stories260K-q8_0.gguf");
  ASSERT_TRUE(tm && dm);
  auto be = make_cpu_backend({.threads = 1});
  const int32_t n_pos = 5, n_seeds = 1200, k = 3;
  // A short real-ish prompt: BOS + a few tokens, so the first tokens are not near-certain.
  const std::vector<int32_t> prompt = {1, 400, 261, 300};
  SamplerParams sp;
  sp.temperature = 1.0f;
  sp.top_k = 0;
  sp.top_p = 1.0f;
  sp.min_p = 0.0f;
  auto per_pos = [&](auto&& gen) {
    std::vector<std::map<int32_t, int>> f(n_pos);
    for (int s = 0; s < n_seeds; ++s) {
      const auto ids = gen(uint64_t(s));
      for (int32_t i = 0; i < n_pos; ++i) ++f[size_t(i)][ids[size_t(i)]];
    }
    return f;
  };
  Session plain_s(tm, *be, 64, k + 1);
  auto plain_at = [&](float temp) {
    return per_pos([&](uint64_t seed) {
      SamplerParams p = sp;
      p.temperature = temp;
      p.seed = seed;
      auto smp = Sampler::create(p, tm->n_vocab());
      return plain_decode(plain_s, *smp, prompt, n_pos).ids;
    });
  };
  const auto plain = plain_at(1.0f);

  Session target(tm, *be, 64, k + 1);
  auto md = ModelDrafter::create(dm, *be, 64, tm->n_vocab());
  ASSERT_TRUE(md.has_value());
  NgramDrafter ng(1, 2);
  struct Variant {
    const char* name;
    Drafter* d;
    float draft_temp;
  };
  // Draft temperature 1.6: q differs from p, so rejections (and the residual draw) are
  // frequent. n-gram drafts: one-hot q (greedy model drafting takes the same path).
  for (const Variant& v : {Variant{"model q@T1.6", md->get(), 1.6f}, Variant{"ngram", &ng, 0.0f}}) {
    SpecStats total;
    const auto spec = per_pos([&](uint64_t seed) {
      SpecParams p;
      p.n_draft = k;
      p.sampling = sp;
      p.sampling.seed = 1000003 + seed;
      p.draft_sampling = sp;
      p.draft_sampling.temperature = v.draft_temp;
      auto dec = SpeculativeDecoder::create(target, *v.d, p);
      auto ids = spec_decode(**dec, prompt, n_pos);
      total.steps += (*dec)->stats().steps;
      total.drafted += (*dec)->stats().drafted;
      total.accepted += (*dec)->stats().accepted;
      return ids;
    });
    EXPECT_GT(total.accepted, 0u) << v.name;
    EXPECT_LT(total.accepted, total.drafted) << v.name << ": no rejections exercised";
    for (int32_t i = 0; i < n_pos; ++i) {
      int df = 0;
      const double chi = two_sample_chi(plain[size_t(i)], spec[size_t(i)], &df);
      EXPECT_LT(chi, chi_crit_1e4(df)) << v.name << " position " << i << " df " << df;
    }
    std::printf("[ info ] %s: drafted %llu accepted %llu\n", v.name,
                (unsigned long long)total.drafted, (unsigned long long)total.accepted);
  }
  // Power check: the same test tells temperature 1.0 from 1.3.
  const auto hotter = plain_at(1.3f);
  int rejected = 0;
  for (int32_t i = 0; i < n_pos; ++i) {
    int df = 0;
    rejected += two_sample_chi(plain[size_t(i)], hotter[size_t(i)], &df) > chi_crit_1e4(df);
  }
  EXPECT_GE(rejected, 3);
}

}  // namespace
}  // namespace kiln
