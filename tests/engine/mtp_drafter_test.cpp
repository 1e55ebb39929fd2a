// tests/engine/mtp_drafter_test.cpp: speculative decoding with the model's own NextN (MTP)
// block (engine/mtp_drafter.h) on glm4moe-f16. Greedy output ids equal plain greedy decoding
// at several draft lengths and with the prompt and the NextN rows split over many forward
// steps; the drafts themselves do not depend on that chunking; acceptance is reported (random
// weights: it is low, and only its bookkeeping is checked); a model without NextN layers is
// refused with one line.
#include <gtest/gtest.h>

#include <cstdio>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/testdata.h"
#include "engine/mtp_drafter.h"
#include "engine/speculative.h"

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

std::vector<int32_t> plain_greedy(Session& s, std::span<const int32_t> prompt, int32_t n) {
  std::vector<int32_t> out;
  EXPECT_TRUE(s.rollback(0));
  auto l = s.eval(prompt, false);
  for (int32_t i = 0; i < n && l; ++i) {
    const auto t = static_cast<int32_t>(std::max_element(l->begin(), l->end()) - l->begin());
    out.push_back(t);
    l = s.eval(std::span<const int32_t>(&t, 1), false);
  }
  EXPECT_TRUE(l.has_value()) << l.error();
  return out;
}

struct SpecRun {
  std::vector<int32_t> ids;
  std::vector<std::vector<int32_t>> drafts;  // what the drafter proposed, step by step
  SpecStats stats;
};

// Records the proposals of the drafter it wraps.
class Recording final : public Drafter {
 public:
  explicit Recording(Drafter& d) : d_(d) {}
  std::string name() const override { return d_.name(); }
  Status prepare(std::span<const int32_t> p) override { return d_.prepare(p); }
  Status propose(const DraftRequest& req, Draft& out) override {
    KILN_TRY(d_.propose(req, out));
    drafts.push_back(out.tokens);
    return Status::ok();
  }
  std::vector<std::string> wanted_captures() const override { return d_.wanted_captures(); }
  void observe_target(const model::Capture& c, int32_t n) override { d_.observe_target(c, n); }
  std::vector<std::vector<int32_t>> drafts;

 private:
  Drafter& d_;
};

SpecRun spec_greedy(Session& target, Drafter& drafter, std::span<const int32_t> prompt, int32_t k,
                    int32_t n) {
  SpecRun r;
  Recording rec(drafter);
  SpecParams sp;
  sp.n_draft = k;
  sp.sampling.temperature = 0;
  auto dec = SpeculativeDecoder::create(target, rec, sp);
  EXPECT_TRUE(dec.has_value()) << dec.error();
  if (!dec) return r;
  EXPECT_TRUE((*dec)->start(prompt));
  while (static_cast<int32_t>(r.ids.size()) < n) {
    auto st = (*dec)->step();
    EXPECT_TRUE(st.has_value()) << st.error();
    if (!st) break;
    r.ids.insert(r.ids.end(), st->tokens.begin(), st->tokens.end());
  }
  r.ids.resize(std::min<size_t>(r.ids.size(), size_t(n)));
  r.drafts = rec.drafts;
  r.stats = (*dec)->stats();
  return r;
}

TEST(MtpDrafter, GreedyIdsEqualPlainGreedy) {
  auto m = load("glm4moe-f16.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  const int32_t n_gen = 40;
  const auto prompt = random_prompt(37, m->n_vocab(), 11);
  Session ref(m, *be, 256);
  const std::vector<int32_t> want = plain_greedy(ref, prompt, n_gen);
  for (int32_t k : {1, 2, 4}) {
    SCOPED_TRACE(k);
    Session target(m, *be, 256);
    auto mtp = MtpDrafter::create(m, *be, 256);
    ASSERT_TRUE(mtp.has_value()) << mtp.error();
    const SpecRun got = spec_greedy(target, **mtp, prompt, k, n_gen);
    EXPECT_EQ(got.ids, want);
    const SpecStats& s = got.stats;
    // The NextN block drafts from the first step on (the prompt's hidden states were seen).
    ASSERT_FALSE(got.drafts.empty());
    EXPECT_EQ(got.drafts[0].size(), size_t(k));
    EXPECT_GT(s.drafted, 0u);
    EXPECT_LE(s.accepted, s.drafted);
    EXPECT_EQ(s.emitted, s.accepted + s.steps);
    std::printf("[ info ] glm4moe-f16 mtp k=%d: %llu steps, drafted %llu, accepted %llu (%.1f%%)\n",
                k, (unsigned long long)s.steps, (unsigned long long)s.drafted,
                (unsigned long long)s.accepted,
                s.drafted ? 100.0 * double(s.accepted) / double(s.drafted) : 0.0);
  }
}

// The prompt's hidden states reach the drafter one target step at a time (target batch limit
// 8) and the NextN catch-up runs in chunks of 5 rows: the drafts are those of one-step runs.
TEST(MtpDrafter, DraftsDoNotDependOnChunking) {
  auto m = load("glm4moe-f16.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  const auto prompt = random_prompt(45, m->n_vocab(), 3);
  Session big(m, *be, 256);
  auto mtp_big = MtpDrafter::create(m, *be, 256);
  ASSERT_TRUE(mtp_big.has_value()) << mtp_big.error();
  const SpecRun a = spec_greedy(big, **mtp_big, prompt, 3, 24);
  Session small(m, *be, 256, 8);
  auto mtp_small = MtpDrafter::create(m, *be, 256, 5);
  ASSERT_TRUE(mtp_small.has_value()) << mtp_small.error();
  const SpecRun b = spec_greedy(small, **mtp_small, prompt, 3, 24);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.drafts, b.drafts);
  // A one-token prompt: no hidden state yet, so the first step drafts nothing, later ones do.
  Session one(m, *be, 256);
  auto mtp_one = MtpDrafter::create(m, *be, 256);
  ASSERT_TRUE(mtp_one.has_value());
  const std::vector<int32_t> bos{1};
  const SpecRun c = spec_greedy(one, **mtp_one, bos, 2, 10);
  ASSERT_GE(c.drafts.size(), 2u);
  EXPECT_TRUE(c.drafts[0].empty());
  EXPECT_EQ(c.drafts[1].size(), 2u);
  Session ref(m, *be, 256);
  EXPECT_EQ(c.ids, plain_greedy(ref, bos, 10));
}

// Resuming a cut history (Drafter::rollback, a server slot reusing a cached prefix): only as
// far as the drafter saw the target's hidden states; 0 always works.
TEST(MtpDrafter, RollbackResumesOnlyObservedPositions) {
  auto m = load("glm4moe-f16.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  auto mtp = MtpDrafter::create(m, *be, 128);
  ASSERT_TRUE(mtp.has_value()) << mtp.error();
  const Status beyond = (*mtp)->rollback(5);
  ASSERT_FALSE(beyond.is_ok());
  EXPECT_NE(beyond.message().find("cannot resume at 5"), std::string::npos) << beyond.message();
  EXPECT_TRUE((*mtp)->rollback(0).is_ok());
}

TEST(MtpDrafter, ModelWithoutNextnLayersIsRefused) {
  auto m = load("qwen3moe-f16.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  auto mtp = MtpDrafter::create(m, *be, 128);
  ASSERT_FALSE(mtp.has_value());
  EXPECT_NE(mtp.error().find("NextN"), std::string::npos) << mtp.error();
  EXPECT_EQ(mtp.error().find('\n'), std::string::npos);
}

// glm-dsa's NextN block runs a lightning indexer in llama.cpp; kiln's NextN pass has none, so
// MTP drafting of glm-dsa is refused by name rather than drafted from a different graph.
TEST(MtpDrafter, SparseAttentionModelIsRefused) {
  auto m = load("glm5-f16.gguf");
  ASSERT_TRUE(m);
  ASSERT_FALSE(m->hparams().nextn_layers.empty());
  auto be = make_cpu_backend({.threads = 1});
  auto mtp = MtpDrafter::create(m, *be, 128);
  ASSERT_FALSE(mtp.has_value());
  EXPECT_NE(mtp.error().find("MTP drafting of 'glm-dsa' (sparse attention in the NextN block)"),
            std::string::npos)
      << mtp.error();
  EXPECT_EQ(mtp.error().find('\n'), std::string::npos);
}

}  // namespace
}  // namespace kiln
