// tests/engine/batch_decode_test.cpp: batched decode across sessions (BatchEval). Several
// sequences evaluated together in one forward pass per step, joining at different steps,
// prefilling in chunks beside the others' decode tokens and finishing at different times,
// must give bit-identical logits (memcmp) to each sequence evaluated alone; bad batches are
// refused with a message and leave every session unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "common/testdata.h"
#include "engine_test_util.h"
#include "engine/session.h"

namespace kiln {
namespace {

using enginetest::load;
using enginetest::random_prompt;

int32_t argmax(std::span<const float> l) {
  return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
}

// One sequence of the scenario: joins the batch at step `join`, feeds its prompt `chunk`
// tokens per step (asking for every prompt position's logits when `all`), then decodes
// `n_decode` greedy tokens.
struct Script {
  int32_t prompt_len, join, chunk, n_decode;
  bool all = false;
};

// Logit rows of a sequence: after the whole prompt (or after each prompt token), then after
// each decoded token.
using Rows = std::vector<std::vector<float>>;

Rows run_alone(const std::shared_ptr<const Model>& m, Backend& be, std::span<const int32_t> prompt,
               const Script& sc) {
  Session s(m, be, 160, 64);
  Rows rows;
  auto l = s.eval(prompt, sc.all);
  EXPECT_TRUE(l.has_value()) << l.error();
  if (!l) return rows;
  const auto V = static_cast<size_t>(m->n_vocab());
  for (size_t r = 0; r < l->size() / V; ++r)
    rows.emplace_back(l->begin() + r * V, l->begin() + (r + 1) * V);
  for (int32_t t = 0; t < sc.n_decode; ++t) {
    const int32_t tok[1] = {argmax(rows.back())};
    l = s.eval(tok, false);
    EXPECT_TRUE(l.has_value()) << l.error();
    if (!l) return rows;
    rows.emplace_back(l->begin(), l->end());
  }
  return rows;
}

// Every sequence in one BatchEval per step; sessions use a smaller batch limit than the solo
// run (different ring capacities on sliding-window layers, different chunking).
std::vector<Rows> run_batched(const std::shared_ptr<const Model>& m, Backend& be,
                              const std::vector<std::vector<int32_t>>& prompts,
                              const std::vector<Script>& sc, int32_t* max_batch_seen) {
  const size_t n = sc.size();
  std::vector<std::unique_ptr<Session>> sess;
  for (size_t i = 0; i < n; ++i) sess.push_back(std::make_unique<Session>(m, be, 160, 16));
  BatchEval batch(m, be, 64);
  std::vector<Rows> rows(n);
  std::vector<size_t> cursor(n, 0);
  std::vector<int32_t> next(n, 0);
  std::vector<int32_t> n_decoded(n, 0);
  *max_batch_seen = 0;
  for (int32_t step = 0;; ++step) {
    std::vector<BatchEval::Item> items;
    std::vector<size_t> who;
    for (size_t i = 0; i < n; ++i) {
      if (step < sc[i].join) continue;
      if (cursor[i] < prompts[i].size()) {
        const size_t c =
            std::min<size_t>(static_cast<size_t>(sc[i].chunk), prompts[i].size() - cursor[i]);
        items.push_back(
            {sess[i].get(), std::span<const int32_t>(prompts[i]).subspan(cursor[i], c), sc[i].all});
      } else if (n_decoded[i] < sc[i].n_decode) {
        items.push_back({sess[i].get(), std::span<const int32_t>(&next[i], 1)});
        ++n_decoded[i];
      } else {
        continue;
      }
      who.push_back(i);
    }
    if (items.empty()) {
      bool all_done = true;
      for (size_t i = 0; i < n; ++i) all_done &= step >= sc[i].join;
      if (all_done) break;
      continue;
    }
    *max_batch_seen = std::max(*max_batch_seen, static_cast<int32_t>(items.size()));
    auto l = batch.eval(items);
    EXPECT_TRUE(l.has_value()) << l.error();
    if (!l) return rows;
    const auto V = static_cast<size_t>(m->n_vocab());
    size_t at = 0;  // row of the output
    for (size_t k = 0; k < items.size(); ++k) {
      const size_t i = who[k];
      const size_t n_rows = items[k].all_logits ? items[k].tokens.size() : 1;
      const bool prefill = cursor[i] < prompts[i].size();
      if (prefill) cursor[i] += items[k].tokens.size();
      // Mid-prompt chunks' last-token logits are not wanted (the solo run has none).
      if (!prefill || items[k].all_logits || cursor[i] == prompts[i].size())
        for (size_t r = 0; r < n_rows; ++r)
          rows[i].emplace_back(l->begin() + (at + r) * V, l->begin() + (at + r + 1) * V);
      at += n_rows;
      if (cursor[i] == prompts[i].size()) next[i] = argmax(rows[i].back());
    }
    EXPECT_EQ(l->size(), at * V);
  }
  return rows;
}

class BatchInvariance : public ::testing::TestWithParam<std::string> {};

TEST_P(BatchInvariance, BatchedDecodeLogitsAreBitIdenticalToAlone) {
  auto m = load(GetParam());
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  // Staggered joins, prompts of different lengths chunked beside other sequences' decode
  // tokens, early finishers: the batch composition changes almost every step. Prompts and
  // decodes run past the sliding windows (8 or 16 positions) so rings wrap.
  const std::vector<Script> sc = {{3, 0, 2, 30},      {21, 0, 5, 12, true}, {40, 1, 16, 28},
                                  {9, 4, 3, 6, true}, {17, 7, 7, 22},       {1, 9, 1, 15}};
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < sc.size(); ++i)
    prompts.push_back(random_prompt(sc[i].prompt_len, m->n_vocab(), 31 + static_cast<uint32_t>(i)));
  int32_t widest = 0;
  const auto batched = run_batched(m, *be, prompts, sc, &widest);
  EXPECT_EQ(widest, static_cast<int32_t>(sc.size()));
  int64_t rows_compared = 0;
  for (size_t i = 0; i < sc.size(); ++i) {
    const Rows alone = run_alone(m, *be, prompts[i], sc[i]);
    ASSERT_EQ(batched[i].size(), alone.size()) << "sequence " << i;
    for (size_t r = 0; r < alone.size(); ++r) {
      ASSERT_EQ(batched[i][r].size(), alone[r].size());
      const bool same =
          std::memcmp(batched[i][r].data(), alone[r].data(), alone[r].size() * sizeof(float)) == 0;
      if (!same) {
        size_t j = 0;
        while (std::memcmp(&batched[i][r][j], &alone[r][j], sizeof(float)) == 0) ++j;
        FAIL() << GetParam() << ": sequence " << i << " row " << r << " differs first at logit "
               << j << " (" << batched[i][r][j] << " batched vs " << alone[r][j] << " alone)";
      }
      ++rows_compared;
    }
  }
  std::printf("%s: %lld logit rows of %zu sequences (up to %d per batch) bit-identical to solo\n",
              GetParam().c_str(), static_cast<long long>(rows_compared), sc.size(), widest);
}

INSTANTIATE_TEST_SUITE_P(Models, BatchInvariance,
                         ::testing::Values("stories260K.gguf", "llama-gqa-q8_0.gguf",
                                           "llama-gqa-q4_k_m.gguf", "gemma2-swa-f16.gguf",
                                           "muse-glimmer-q4_k_m.gguf", "qwen3moe-q4_k_m.gguf",
                                           "mixtral-q4_k_m.gguf", "deepseek2-mla-q8_0.gguf"),
                         [](const auto& info) {
                           std::string n = info.param.substr(0, info.param.find('.'));
                           std::replace_if(
                               n.begin(), n.end(), [](char c) { return !isalnum(c); }, '_');
                           return n;
                         });

// Item::capture (a server slot's model drafter reads its slot's activations): each capturing
// item gets exactly the rows it would record evaluated alone (memcmp), only the names it asks
// for; an item without one records nothing.
TEST(BatchEval, CaptureGivesEachItemItsOwnRows) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  const auto pa = random_prompt(9, m->n_vocab(), 4), pb = random_prompt(6, m->n_vocab(), 5),
             pc = random_prompt(4, m->n_vocab(), 6);
  const std::vector<std::string> wanted_a{"inp_embd", "blk.2.l_out"}, wanted_c{"blk.4.l_out"};
  std::vector<model::Capture> alone(2);
  alone[0].only = wanted_a;
  alone[1].only = wanted_c;
  for (int i = 0; i < 2; ++i) {
    Session s(m, *be, 64, 16);
    s.set_capture(&alone[size_t(i)]);
    ASSERT_TRUE(s.eval(i == 0 ? pa : pc, false).has_value());
  }
  Session a(m, *be, 64, 16), b(m, *be, 64, 16), c(m, *be, 64, 16);
  BatchEval batch(m, *be, 32);
  model::Capture ca, cc;
  ca.only = wanted_a;
  cc.only = wanted_c;
  ASSERT_TRUE(batch
                  .eval(std::vector<BatchEval::Item>{
                      {&a, pa, false, &ca}, {&b, pb, true}, {&c, pc, false, &cc}})
                  .has_value());
  for (auto [got, want] : {std::pair{&ca, &alone[0]}, std::pair{&cc, &alone[1]}}) {
    ASSERT_EQ(got->nodes.size(), want->only.size());
    for (const std::string& name : want->only) {
      ASSERT_TRUE(got->nodes.contains(name)) << name;
      const model::CapturedNode &g = got->nodes.at(name), &w = want->nodes.at(name);
      EXPECT_EQ(g.n_rows, w.n_rows) << name;
      EXPECT_EQ(g.width, w.width) << name;
      ASSERT_EQ(g.data.size(), w.data.size()) << name;
      EXPECT_EQ(std::memcmp(g.data.data(), w.data.data(), g.data.size() * sizeof(float)), 0)
          << name;
    }
  }
}

TEST(BatchEval, RefusesBadBatchesAndLeavesSessionsUnchanged) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto other = load("stories260K-q8_0.gguf");
  ASSERT_TRUE(other);
  auto be = make_cpu_backend({.threads = 1});
  Session a(m, *be, 32, 8), b(m, *be, 32, 8), c(other, *be, 32, 8);
  BatchEval batch(m, *be, 12);
  const auto pa = random_prompt(5, m->n_vocab(), 1), pb = random_prompt(7, m->n_vocab(), 2);
  ASSERT_TRUE(batch.eval(std::vector<BatchEval::Item>{{&a, pa}, {&b, pb}}).has_value());
  ASSERT_EQ(a.n_pos(), 5);
  ASSERT_EQ(b.n_pos(), 7);

  auto expect_error = [&](std::vector<BatchEval::Item> items, const std::string& needle) {
    auto r = batch.eval(items);
    ASSERT_FALSE(r.has_value()) << "accepted: " << needle;
    EXPECT_NE(r.error().find(needle), std::string::npos) << r.error();
    EXPECT_EQ(r.error().find('\n'), std::string::npos) << r.error();
    EXPECT_EQ(a.n_pos(), 5);
    EXPECT_EQ(b.n_pos(), 7);
  };
  const int32_t ok[1] = {3};
  const int32_t bad_id[1] = {m->n_vocab()};
  const std::vector<int32_t> nine(9, 3), twenty(20, 3);
  expect_error({}, "no items");
  expect_error({{&a, ok}, {&a, ok}}, "share one session");
  expect_error({{&a, ok}, {nullptr, ok}}, "item 1: no session");
  expect_error({{&a, ok}, {&c, ok}}, "another model");
  expect_error({{&a, ok}, {&b, {}}}, "empty");
  expect_error({{&a, ok}, {&b, bad_id}}, "outside the vocabulary");
  expect_error({{&a, ok}, {&b, nine}}, "batch limit 8");
  expect_error({{&a, std::span<const int32_t>(nine).first(8)},
                {&b, std::span<const int32_t>(nine).first(5)}},
               "exceeds the limit 12");
  // Context: b holds 7 of 32 positions; 8 + 8 + 8 + 2 would fit, 26 tokens more do not.
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(
        batch.eval(std::vector<BatchEval::Item>{{&b, std::span<const int32_t>(twenty).first(8)}})
            .has_value());
  ASSERT_EQ(b.n_pos(), 31);
  auto r = batch.eval(
      std::vector<BatchEval::Item>{{&a, ok}, {&b, std::span<const int32_t>(twenty).first(2)}});
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().find("context overflow"), std::string::npos) << r.error();
  EXPECT_EQ(a.n_pos(), 5);
  EXPECT_EQ(b.n_pos(), 31);

  // After all the refusals, `a` continues exactly like a session that never saw them.
  auto cont = batch.eval(std::vector<BatchEval::Item>{{&a, ok}});
  ASSERT_TRUE(cont.has_value()) << cont.error();
  Session fresh(m, *be, 32, 8);
  ASSERT_TRUE(fresh.eval(pa, false).has_value());
  auto want = fresh.eval(ok, false);
  ASSERT_TRUE(want.has_value());
  ASSERT_EQ(cont->size(), want->size());
  EXPECT_EQ(std::memcmp(cont->data(), want->data(), want->size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// The top-k forms of Session::eval and BatchEval::eval hand back what Backend::top_k makes of
// the rows the plain forms return, and leave each session where the plain form would.
TEST(TopKEval, SameCandidatesAsTheWholeRows) {
  auto m = enginetest::load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  const int32_t V = m->n_vocab();
  const auto pa = enginetest::random_prompt(9, V, 11), pb = enginetest::random_prompt(4, V, 12);
  for (int32_t k : {1, 40, V}) {
    SCOPED_TRACE(k);
    Session a(m, *be, 64, 8), a2(m, *be, 64, 8), b(m, *be, 64, 8), b2(m, *be, 64, 8);
    // One session, a prompt longer than the batch (chunks): the last token's candidates.
    auto rows = a.eval(pa, false);
    ASSERT_TRUE(rows.has_value()) << rows.error();
    std::vector<int32_t> want_i(static_cast<size_t>(k));
    std::vector<float> want_v(static_cast<size_t>(k));
    be->top_k(*rows, V, k, want_i, want_v);
    auto top = a2.eval_top_k(pa, k);
    ASSERT_TRUE(top.has_value()) << top.error();
    EXPECT_TRUE(std::equal(top->ids.begin(), top->ids.end(), want_i.begin(), want_i.end()));
    EXPECT_EQ(std::memcmp(top->logits.data(), want_v.data(), want_v.size() * 4), 0);
    EXPECT_EQ(a2.n_pos(), a.n_pos());
    // Two sessions in one batch (a second step of `a`, the first of `b`).
    BatchEval batch(m, *be, 16);
    const int32_t next[1] = {7};
    auto whole = batch.eval(std::vector<BatchEval::Item>{{&a, next}, {&b, pb}});
    ASSERT_TRUE(whole.has_value()) << whole.error();
    std::vector<int32_t> wi(2 * static_cast<size_t>(k));
    std::vector<float> wv(wi.size());
    be->top_k(*whole, V, k, wi, wv);
    auto tops = batch.eval_top_k(std::vector<BatchEval::Item>{{&a2, next}, {&b2, pb}}, k);
    ASSERT_TRUE(tops.has_value()) << tops.error();
    EXPECT_TRUE(std::equal(tops->ids.begin(), tops->ids.end(), wi.begin(), wi.end()));
    EXPECT_EQ(std::memcmp(tops->logits.data(), wv.data(), wv.size() * 4), 0);
    EXPECT_EQ(b2.n_pos(), b.n_pos());
    // Every row of one step (speculative verification's form): each row's candidates.
    Session c(m, *be, 64, 8), c2(m, *be, 64, 8);
    const auto pc = enginetest::random_prompt(6, V, 13);
    auto all = c.eval(pc, true);
    ASSERT_TRUE(all.has_value()) << all.error();
    std::vector<int32_t> ai(pc.size() * static_cast<size_t>(k));
    std::vector<float> av(ai.size());
    be->top_k(*all, V, k, ai, av);
    auto every = c2.eval_top_k(pc, k, /*all_rows=*/true);
    ASSERT_TRUE(every.has_value()) << every.error();
    EXPECT_TRUE(std::equal(every->ids.begin(), every->ids.end(), ai.begin(), ai.end()));
    EXPECT_EQ(std::memcmp(every->logits.data(), av.data(), av.size() * 4), 0);
    EXPECT_EQ(c2.n_pos(), c.n_pos());
  }
  Session s(m, *be, 64, 8);
  const int32_t one[1] = {3};
  for (int32_t bad : {0, V + 1}) {
    auto r = s.eval_top_k(one, bad);
    ASSERT_FALSE(r.has_value());
    EXPECT_NE(r.error().find("top-k"), std::string::npos) << r.error();
  }
  EXPECT_EQ(s.n_pos(), 0);
  // Every row's candidates of more tokens than one step takes: refused, nothing evaluated.
  auto long_rows = s.eval_top_k(enginetest::random_prompt(9, V, 14), 1, /*all_rows=*/true);
  ASSERT_FALSE(long_rows.has_value());
  EXPECT_NE(long_rows.error().find("more than one step"), std::string::npos) << long_rows.error();
  EXPECT_EQ(s.n_pos(), 0);
  BatchEval batch(m, *be, 8);
  auto r = batch.eval_top_k(std::vector<BatchEval::Item>{{&s, one, true}}, 4);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().find("last token only"), std::string::npos) << r.error();
  EXPECT_EQ(s.n_pos(), 0);
}

}  // namespace
}  // namespace kiln
