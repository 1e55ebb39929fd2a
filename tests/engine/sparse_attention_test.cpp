// tests/engine/sparse_attention_test.cpp: glm-dsa's sparse attention through Session past its
// top_k (glm5-f16 keeps 128 keys per query): the indexer keys' cache layers roll back with the
// attention layers, a batch of queries chooses as those queries one by one do, and the same
// step evaluated twice gives the same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine_test_util.h"

namespace kiln {
namespace {

using enginetest::load;
using enginetest::random_prompt;

constexpr int32_t kPrompt = 140;  // past glm5-f16's top_k of 128

std::vector<float> eval(Session& s, std::span<const int32_t> t, bool all) {
  auto l = s.eval(t, all);
  EXPECT_TRUE(l.has_value()) << l.error();
  return l.has_value() ? std::vector<float>(l->begin(), l->end()) : std::vector<float>();
}

TEST(SparseAttention, RollbackAndReEvaluationAreExact) {
  auto m = load("glm5-f16.gguf");
  ASSERT_TRUE(m);
  ASSERT_TRUE(m->hparams().is_dsa());
  ASSERT_EQ(m->hparams().dsa.top_k, 128);
  auto be = make_cpu_backend({.threads = 1});
  Session s(m, *be, 256);
  const std::vector<int32_t> prompt = random_prompt(kPrompt, m->n_vocab(), 7);
  eval(s, prompt, false);
  const std::vector<int32_t> next = random_prompt(6, m->n_vocab(), 8);
  const std::vector<float> first = eval(s, next, true);
  // Other tokens overwrite the same rows (latent and indexer keys), then a rollback and the
  // first tokens again: the same bits.
  ASSERT_TRUE(s.rollback(kPrompt));
  eval(s, random_prompt(6, m->n_vocab(), 9), true);
  ASSERT_TRUE(s.rollback(kPrompt));
  const std::vector<float> again = eval(s, next, true);
  ASSERT_EQ(first.size(), again.size());
  EXPECT_EQ(std::memcmp(first.data(), again.data(), first.size() * sizeof(float)), 0);

  // One token at a time: each query chooses over the keys it sees, as in the batch.
  ASSERT_TRUE(s.rollback(kPrompt));
  const size_t V = static_cast<size_t>(m->n_vocab());
  float worst = 0;
  for (size_t i = 0; i < next.size(); ++i) {
    const std::vector<float> one = eval(s, std::span<const int32_t>(&next[i], 1), false);
    for (size_t j = 0; j < V; ++j) worst = std::max(worst, std::abs(one[j] - first[i * V + j]));
  }
  EXPECT_LT(worst, 1e-3f);
}

}  // namespace
}  // namespace kiln
