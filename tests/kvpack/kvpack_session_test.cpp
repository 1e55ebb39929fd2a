// tests/kvpack/kvpack_session_test.cpp: equivalence on the shared models. A session installed
// from a pack (saved after prefill, or streamed by a remote prefill over an in-memory link)
// continues greedy decoding with the same ids, and bit-identical logits, as the session that
// prefilled locally. Models cover GQA, K-quants, sliding-window rings with prompts several
// windows long (gemma2 window 8, muse-glimmer window 16 with NoPE layers), MoE, and latent
// attention (deepseek2: one latent row per token and layer, no V plane; glm5: plus the
// indexer keys of its sparse attention).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "common/testdata.h"
#include "engine/session.h"
#include "transfer/identity.h"
#include "transfer/remote_prefill.h"
#include "transfer/session_pack.h"

namespace kiln::transfer {
namespace {

std::shared_ptr<const Model> load(const std::string& file) {
  auto m = Model::load(testing::model_path(file));
  EXPECT_TRUE(m.has_value()) << m.error();
  return m.has_value() ? *m : nullptr;
}

std::vector<int32_t> prompt_for(const Model& m, int n) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int32_t> d(1, m.n_vocab() - 1);
  std::vector<int32_t> p(static_cast<size_t>(n), 0);
  for (int32_t& t : p) t = d(rng);
  return p;
}

int32_t argmax(std::span<const float> v) {
  return int32_t(std::max_element(v.begin(), v.end()) - v.begin());
}

// Greedy continuation of a session whose last logits are `logits`: ids and every step's logits.
struct GreedyRun {
  std::vector<int32_t> ids;
  std::vector<std::vector<float>> logits;
};
GreedyRun continue_greedy(Session& s, std::span<const float> logits, int n) {
  GreedyRun r;
  int32_t t = argmax(logits);
  for (int i = 0; i < n; ++i) {
    r.ids.push_back(t);
    auto l = s.eval(std::span<const int32_t>(&t, 1), false);
    EXPECT_TRUE(l.has_value()) << l.error();
    if (!l) break;
    r.logits.emplace_back(l->begin(), l->end());
    t = argmax(*l);
  }
  return r;
}

struct Case {
  const char* file;
  int n_prompt;
};
class KvpackModels : public ::testing::TestWithParam<Case> {};

TEST_P(KvpackModels, SaveInstallContinuesIdentically) {
  const Case c = GetParam();
  auto m = load(c.file);
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  const auto prompt = prompt_for(*m, c.n_prompt);
  constexpr int kSteps = 12;

  Session local(m, *be, 256, 16);
  auto pl = local.eval(prompt, false);
  ASSERT_TRUE(pl.has_value()) << pl.error();
  std::vector<float> prompt_logits(pl->begin(), pl->end());
  auto pack = save_session(local, 7);
  ASSERT_TRUE(pack.has_value()) << pack.error();
  const GreedyRun ref = continue_greedy(local, prompt_logits, kSteps);

  // The consumer's batch limit differs (so do its ring capacities): the rows it keeps differ,
  // the keys every query sees do not.
  for (int32_t max_batch : {16, 5, 64}) {
    Session s(m, *be, 256, max_batch);
    Status st = load_session(s, *pack);
    ASSERT_TRUE(st) << st.message();
    ASSERT_EQ(s.n_pos(), c.n_prompt);
    const GreedyRun got = continue_greedy(s, prompt_logits, kSteps);
    EXPECT_EQ(got.ids, ref.ids) << c.file << " max_batch " << max_batch;
    for (size_t i = 0; i < std::min(got.logits.size(), ref.logits.size()); ++i)
      ASSERT_EQ(std::memcmp(got.logits[i].data(), ref.logits[i].data(),
                            ref.logits[i].size() * sizeof(float)),
                0)
          << c.file << " step " << i << " logits differ";
  }
  std::printf("[kvpack] %s: %d prompt tokens, pack %zu bytes, %d greedy ids equal\n", c.file,
              c.n_prompt, pack->size(), kSteps);
}

TEST_P(KvpackModels, RemotePrefillMatchesLocal) {
  const Case c = GetParam();
  auto m = load(c.file);
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  auto be_remote = make_cpu_backend({.threads = 1});
  const auto prompt = prompt_for(*m, c.n_prompt);
  constexpr int kSteps = 12;

  Session local(m, *be, 256, 16);
  auto pl = local.eval(prompt, false);
  ASSERT_TRUE(pl.has_value()) << pl.error();
  std::vector<float> prompt_logits(pl->begin(), pl->end());
  const GreedyRun ref = continue_greedy(local, prompt_logits, kSteps);

  auto [a, b] = memory_pair();
  std::thread producer([&, link = a.get()] {
    Status s = serve_prefill(*link, m, *be_remote, {.max_batch = 9});
    EXPECT_TRUE(s) << s.message();
  });
  PrefillPeer peer{.name = "memory",
                   .connect = [&]() -> Expected<std::unique_ptr<Link>> { return std::move(b); },
                   .timeout = Millis(20000)};
  Session s(m, *be, 256, 16);
  ::testing::internal::CaptureStderr();
  RemoteStats stats;
  auto l = prefill(s, prompt, &peer, &stats);
  const std::string err = ::testing::internal::GetCapturedStderr();
  producer.join();
  ASSERT_TRUE(l.has_value()) << l.error();
  EXPECT_EQ(err, "") << "the remote path fell back";
  EXPECT_GT(stats.bytes, 0u);
  ASSERT_EQ(std::memcmp(l->data(), prompt_logits.data(), prompt_logits.size() * sizeof(float)), 0)
      << "last-token logits after remote prefill differ from the local prefill";
  std::vector<float> first(l->begin(), l->end());
  EXPECT_EQ(continue_greedy(s, first, kSteps).ids, ref.ids) << c.file;
}

INSTANTIATE_TEST_SUITE_P(
    Shared, KvpackModels,
    ::testing::Values(Case{"stories260K.gguf", 40}, Case{"llama-gqa-q4_k_m.gguf", 40},
                      Case{"gemma2-swa-q8_0.gguf", 37}, Case{"gemma3-swa-f16.gguf", 29},
                      Case{"muse-glimmer-q4_k_m.gguf", 53}, Case{"qwen3moe-q4_k_m.gguf", 33},
                      // latent attention: K-only layers of latent rows
                      Case{"deepseek2-mla-q8_0.gguf", 41},
                      // sparse attention: the indexer keys' K-only layers travel too, and
                      // 140 positions are past glm5's top_k of 128
                      Case{"glm5-f16.gguf", 140}),
    [](const auto& info) {
      std::string n = info.param.file;
      n = n.substr(0, n.find('.'));
      std::replace_if(
          n.begin(), n.end(), [](char ch) { return !isalnum(ch); }, '_');
      return n;
    });

TEST(KvpackIdentity, DistinguishesModelsAndIsStable) {
  auto a = load("stories260K.gguf"), a2 = load("stories260K.gguf"),
       q = load("stories260K-q8_0.gguf");
  ASSERT_TRUE(a && a2 && q);
  const kvpack::Identity ia = identity_of(*a), ia2 = identity_of(*a2), iq = identity_of(*q);
  EXPECT_EQ(ia.model, ia2.model);
  EXPECT_EQ(ia.tokenizer, ia2.tokenizer);
  EXPECT_NE(ia.model, iq.model);          // other weights
  EXPECT_EQ(ia.tokenizer, iq.tokenizer);  // same vocabulary
  EXPECT_EQ(ia.engine_abi, kEngineAbiVersion);
  auto g =
      load("qwen3-bpe-f16.gguf");  // another vocabulary (the gemma fixtures reuse the stories one)
  ASSERT_TRUE(g);
  EXPECT_NE(identity_of(*g).tokenizer, ia.tokenizer);
}

TEST(KvpackSession, RefusedPackLeavesTheSessionAsItWas) {
  auto a = load("stories260K.gguf"), q = load("stories260K-q8_0.gguf");
  ASSERT_TRUE(a && q);
  auto be = make_cpu_backend({.threads = 2});
  const auto prompt = prompt_for(*a, 20);
  Session src(q, *be, 128, 16);
  ASSERT_TRUE(src.eval(prompt, false).has_value());
  auto pack = save_session(src);
  ASSERT_TRUE(pack.has_value());

  Session dst(a, *be, 128, 16);
  auto before = dst.eval(std::span<const int32_t>(prompt).first(7), false);
  ASSERT_TRUE(before.has_value());
  Status s = load_session(dst, *pack);
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("model fingerprint"), std::string::npos) << s.message();
  EXPECT_EQ(dst.n_pos(), 7);
  // A corrupt pack of the right model: refused, session intact and still usable.
  Session src2(a, *be, 128, 16);
  ASSERT_TRUE(src2.eval(prompt, false).has_value());
  auto good = save_session(src2);
  ASSERT_TRUE(good.has_value());
  std::vector<uint8_t> bad = *good;
  bad[bad.size() / 2] ^= 0x40;
  EXPECT_FALSE(load_session(dst, bad));
  EXPECT_EQ(dst.n_pos(), 7);
  // ... and the same session accepts the good pack (the install replaces its 7 positions).
  ASSERT_TRUE(load_session(dst, *good));
  EXPECT_EQ(dst.n_pos(), 20);
}

TEST(KvpackSession, FileRoundTrip) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  const auto prompt = prompt_for(*m, 25);
  Session a(m, *be, 128, 16);
  auto la = a.eval(prompt, false);
  ASSERT_TRUE(la.has_value());
  std::vector<float> last(la->begin(), la->end());
  const std::string path = testing::temp_dir() + "/s.kvpack";
  ASSERT_TRUE(save_session_file(a, path));
  Session b(m, *be, 128, 16);
  Status s = load_session_file(b, path);
  ASSERT_TRUE(s) << s.message();
  EXPECT_EQ(continue_greedy(b, last, 8).ids, continue_greedy(a, last, 8).ids);
  Status missing = load_session_file(b, path + ".nope");
  EXPECT_FALSE(missing);
  EXPECT_NE(missing.message().find("cannot open"), std::string::npos);
}

}  // namespace
}  // namespace kiln::transfer
