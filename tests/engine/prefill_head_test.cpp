// tests/engine/prefill_head_test.cpp: Session::prefill_head, the prompt evaluation of plain
// generation. On a batch-invariant backend it leaves the whole prompt to the caller's one eval;
// on a backend that is not (CUDA), it evaluates all but the last token and leaves that one to a
// step of its own, the step structure of SpeculativeDecoder::start, so plain and speculative
// greedy ids agree there. The steps are watched on the reference backend, wrapped to say
// whether it is invariant and to record each forward step's token count.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/forwarding_backend.h"
#include "engine/session.h"
#include "engine_test_util.h"

namespace kiln {
namespace {

using testing::StepRecorder;

constexpr const char* kModel = "llama-gqa-q4_k_m.gguf";

TEST(PrefillHead, InvariantBackendLeavesTheWholePromptToOneStep) {
  const auto m = enginetest::load(kModel);
  ASSERT_NE(m, nullptr);
  StepRecorder be(true);
  Session s(m, be, 64);
  const std::vector<int32_t> prompt = enginetest::random_prompt(7, m->n_vocab(), 11);
  auto rest = s.prefill_head(prompt);
  ASSERT_TRUE(rest.has_value()) << rest.error();
  EXPECT_EQ(rest->data(), prompt.data());
  EXPECT_EQ(rest->size(), prompt.size());
  EXPECT_EQ(s.n_pos(), 0);
  EXPECT_TRUE(be.steps.empty());
}

TEST(PrefillHead, OtherBackendsGiveTheLastTokenAStepOfItsOwn) {
  const auto m = enginetest::load(kModel);
  ASSERT_NE(m, nullptr);
  const std::vector<int32_t> prompt = enginetest::random_prompt(7, m->n_vocab(), 12);
  std::vector<float> want;  // the whole prompt in one step, on the same (in truth invariant) ops
  {
    StepRecorder be(true);
    Session s(m, be, 64);
    auto l = s.eval(prompt, false);
    ASSERT_TRUE(l.has_value()) << l.error();
    want.assign(l->begin(), l->end());
  }
  StepRecorder be(false);
  Session s(m, be, 64);
  auto rest = s.prefill_head(prompt);
  ASSERT_TRUE(rest.has_value()) << rest.error();
  ASSERT_EQ(rest->size(), 1u);
  EXPECT_EQ(rest->data(), prompt.data() + 6);
  EXPECT_EQ(s.n_pos(), 6);
  auto l = s.eval(*rest, false);
  ASSERT_TRUE(l.has_value()) << l.error();
  EXPECT_EQ(be.steps, (std::vector<size_t>{6, 1}));
  ASSERT_EQ(l->size(), want.size());
  EXPECT_EQ(std::memcmp(l->data(), want.data(), want.size() * sizeof(float)), 0)
      << "splitting the prompt changed the reference backend's logits";

  // A one-token prompt is already its own step.
  StepRecorder one(false);
  Session s1(m, one, 64);
  auto r1 = s1.prefill_head(std::span<const int32_t>(prompt).first(1));
  ASSERT_TRUE(r1.has_value()) << r1.error();
  EXPECT_EQ(r1->size(), 1u);
  EXPECT_TRUE(one.steps.empty());
}

TEST(PrefillHead, ErrorsAreEvals) {
  const auto m = enginetest::load(kModel);
  ASSERT_NE(m, nullptr);
  StepRecorder be(false);
  Session s(m, be, 4);
  const std::vector<int32_t> too_long = enginetest::random_prompt(8, m->n_vocab(), 13);
  auto r = s.prefill_head(too_long);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().find("context"), std::string::npos) << r.error();
  EXPECT_EQ(s.n_pos(), 0);
  const std::vector<int32_t> bad = {1, 2, m->n_vocab() + 5, 3};
  auto rb = s.prefill_head(bad);
  ASSERT_FALSE(rb.has_value());
  EXPECT_EQ(s.n_pos(), 0);
  // A bad last token is refused before any of the prompt is evaluated.
  const std::vector<int32_t> bad_last = {1, 2, 3, m->n_vocab() + 5};
  auto rl = s.prefill_head(bad_last);
  ASSERT_FALSE(rl.has_value());
  EXPECT_EQ(s.n_pos(), 0);
  EXPECT_TRUE(be.steps.empty());
}

}  // namespace
}  // namespace kiln
