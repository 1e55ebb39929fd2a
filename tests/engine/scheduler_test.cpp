// tests/engine/scheduler_test.cpp: the scheduler's promises. Chunked evaluation gives
// bit-identical logits to one-shot evaluation (the basis of batch invariance); the same
// requests give identical ids alone and concurrently in any order, slot and chunking; the
// queue bound, cancellation, max_tokens and shutdown behave as documented.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "common/forwarding_backend.h"
#include "common/testdata.h"
#include "engine_test_util.h"
#include "engine/constrained.h"
#include "engine/dflash_drafter.h"
#include "engine/mtp_drafter.h"
#include "engine/scheduler.h"
#include "grammar/json_schema.h"
#include "engine/session.h"
#include "tokenizer/tokenizer.h"

namespace kiln {
namespace {

using namespace std::chrono_literals;

using enginetest::load;
using enginetest::random_prompt;
using testing::StepRecorder;

// All-position logits in pieces of `chunk` tokens, from a 512-position session.
std::vector<float> logits_chunked(const std::shared_ptr<const Model>& m, Backend& be,
                                  std::span<const int32_t> prompt, int32_t chunk) {
  return enginetest::logits_chunked(m, be, prompt, chunk, 512);
}

// Batch invariance starts here: a token's logits must not depend on how many other tokens
// share its forward call (matmul tiles tokens; attention splits queries).
class ChunkInvariance : public ::testing::TestWithParam<std::string> {};

TEST_P(ChunkInvariance, ChunkedLogitsAreBitIdentical) {
  auto m = load(GetParam());
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  const auto prompt = random_prompt(97, m->n_vocab(), 7);
  const auto whole = logits_chunked(m, *be, prompt, 512);
  ASSERT_EQ(whole.size(), prompt.size() * static_cast<size_t>(m->n_vocab()));
  for (int32_t chunk : {1, 3, 8, 13, 64}) {
    const auto part = logits_chunked(m, *be, prompt, chunk);
    ASSERT_EQ(part.size(), whole.size());
    size_t first_diff = whole.size();
    for (size_t i = 0; i < whole.size(); ++i)
      if (std::memcmp(&whole[i], &part[i], sizeof(float)) != 0) {
        first_diff = i;
        break;
      }
    EXPECT_EQ(first_diff, whole.size())
        << GetParam() << ": chunk " << chunk << " differs first at position "
        << first_diff / static_cast<size_t>(m->n_vocab()) << " (" << whole[first_diff] << " vs "
        << part[first_diff] << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ChunkInvariance,
                         ::testing::Values("stories260K.gguf", "stories260K-q8_0.gguf",
                                           "llama-gqa-q4_k_m.gguf", "llama-gqa-f16.gguf"),
                         [](const auto& info) {
                           std::string n = info.param.substr(0, info.param.find('.'));
                           std::replace_if(
                               n.begin(), n.end(), [](char c) { return !isalnum(c); }, '_');
                           return n;
                         });

struct Outcome {
  std::vector<int32_t> ids;
  FinishReason finish = FinishReason::kError;
  int32_t slot = -1, n_reused = 0;
  int32_t n_drafted = 0, n_draft_accepted = 0;
  double prompt_ms = 0;
};

Outcome drain(GenStream& s) {
  Outcome o;
  for (;;) {
    auto e = s.next(30s);
    if (!e) {
      ADD_FAILURE() << "no event within 30 s";
      return o;
    }
    if (e->kind == GenEvent::Kind::kToken) {
      o.ids.push_back(e->id);
      continue;
    }
    o.finish = e->finish;
    o.slot = e->slot;
    o.n_reused = e->n_reused;
    o.n_drafted = e->n_drafted;
    o.n_draft_accepted = e->n_draft_accepted;
    o.prompt_ms = e->prompt_ms;
    return o;
  }
}

// Eight requests: different lengths, some sharing long prefixes (prefix reuse), sampled at
// temperature with per-request seeds, one greedy.
std::vector<GenerationParams> eight_requests(int32_t n_vocab) {
  std::vector<GenerationParams> reqs;
  const auto base = random_prompt(40, n_vocab, 99);
  for (int i = 0; i < 8; ++i) {
    GenerationParams p;
    if (i % 3 == 0) {
      p.prompt = base;  // shared prefix, different tails
      const auto tail = random_prompt(2 + 5 * i, n_vocab, 1000 + i);
      p.prompt.insert(p.prompt.end(), tail.begin() + 1, tail.end());
    } else {
      p.prompt = random_prompt(3 + 11 * i, n_vocab, 200 + i);
    }
    p.sampling.temperature = i == 5 ? 0.0f : 0.9f;
    p.sampling.top_k = 0;
    p.sampling.top_p = 0.95f;
    p.sampling.min_p = 0.0f;
    p.sampling.seed = 12345 + static_cast<uint64_t>(i);
    p.max_tokens = 24 + 3 * i;
    reqs.push_back(p);
  }
  return reqs;
}

TEST(Scheduler, SameIdsAloneAndConcurrentInShuffledOrders) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  const auto reqs = eight_requests(m->n_vocab());

  // Reference: one slot, one request at a time, prompt in one chunk.
  std::vector<Outcome> alone;
  {
    auto sch = Scheduler::create(m, *be, {.n_slots = 1, .n_ctx = 256, .prefill_chunk = 256});
    ASSERT_TRUE(sch.has_value()) << sch.error();
    for (const auto& r : reqs) {
      auto sub = (*sch)->submit(r);
      ASSERT_TRUE(sub.stream) << sub.message;
      alone.push_back(drain(*sub.stream));
      EXPECT_EQ(alone.back().finish, FinishReason::kLength);
    }
  }
  // Concurrent: 4 slots, small odd prefill chunks, shuffled submission, from several threads;
  // round 0 batches decode tokens and prefill chunks of all slots into one forward pass per
  // step, round 1 batches only the decode tokens, round 2 runs one forward call per slot.
  int64_t reused = 0;
  for (uint32_t round = 0; round < 3; ++round) {
    SchedulerConfig cfg{
        .n_slots = 4, .n_ctx = 256, .prefill_chunk = round == 0 ? 5 : 7 + int(round)};
    cfg.batch_prefill = round == 0;
    cfg.batch_decode = round < 2;
    auto sch = Scheduler::create(m, *be, cfg);
    ASSERT_TRUE(sch.has_value()) << sch.error();
    std::vector<size_t> order(reqs.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(round));
    std::vector<Outcome> got(reqs.size());
    std::vector<std::thread> clients;
    for (size_t k = 0; k < order.size(); ++k) {
      clients.emplace_back([&, k] {
        const size_t i = order[k];
        std::this_thread::sleep_for(std::chrono::milliseconds(k % 3));
        auto sub = (*sch)->submit(reqs[i]);
        ASSERT_TRUE(sub.stream) << sub.message;
        got[i] = drain(*sub.stream);
      });
    }
    for (auto& t : clients) t.join();
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(got[i].ids, alone[i].ids) << "request " << i << " round " << round << " slot "
                                          << got[i].slot << " reused " << got[i].n_reused;
      reused += got[i].n_reused;
    }
  }
  std::printf(
      "determinism: 8 requests x 3 concurrent rounds identical to solo runs; %lld "
      "prompt tokens reused from slot caches\n",
      static_cast<long long>(reused));
}

// On a backend that is not batch-invariant (CUDA) a slot evaluates its prompt's last token in
// a step of its own, as `kiln run` does (Session::prefill_head), whatever the prefill chunk;
// an invariant one keeps the prompt whole. The ids are the same (the reference backend is in
// truth invariant).
TEST(Scheduler, NonInvariantBackendGivesThePromptsLastTokenAStepOfItsOwn) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  const auto run = [&](bool invariant, int32_t chunk, size_t n_prompt) {
    StepRecorder be(invariant);
    GenerationParams p;
    p.prompt = random_prompt(n_prompt, m->n_vocab(), 31);
    p.sampling.temperature = 0.0f;
    p.max_tokens = 3;
    Outcome o;
    {
      auto sch = Scheduler::create(m, be, {.n_slots = 1, .n_ctx = 64, .prefill_chunk = chunk});
      EXPECT_TRUE(sch.has_value()) << sch.error();
      if (!sch) return std::make_pair(o, be.steps);
      auto sub = (*sch)->submit(p);
      EXPECT_TRUE(sub.stream) << sub.message;
      if (sub.stream) o = drain(*sub.stream);
    }
    return std::make_pair(o, be.steps);
  };
  const auto [whole, whole_steps] = run(true, 256, 7);
  EXPECT_EQ(whole_steps, (std::vector<size_t>{7, 1, 1}));
  ASSERT_EQ(whole.ids.size(), 3u);
  const auto [split, split_steps] = run(false, 256, 7);
  EXPECT_EQ(split_steps, (std::vector<size_t>{6, 1, 1, 1}));
  EXPECT_EQ(split.ids, whole.ids);
  // Chunks of 4: the prompt's second chunk loses its last token to a step of its own.
  const auto [chunked, chunked_steps] = run(false, 4, 7);
  EXPECT_EQ(chunked_steps, (std::vector<size_t>{4, 2, 1, 1, 1}));
  EXPECT_EQ(chunked.ids, whole.ids);
  // A one-token prompt is already its own step.
  const auto [one, one_steps] = run(false, 256, 1);
  EXPECT_EQ(one_steps, (std::vector<size_t>{1, 1, 1}));
}

// Requests that sample from candidates (greedy; top-k without bias or penalties) give the ids
// they give from whole logit rows: alone, batched together, and batched beside a request
// that needs whole rows (penalties), which turns the step back to rows.
TEST(Scheduler, CandidateSamplingSameIdsAsWholeRows) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  std::vector<GenerationParams> reqs;
  for (int i = 0; i < 5; ++i) {
    GenerationParams p;
    p.prompt = random_prompt(4 + 6 * i, m->n_vocab(), 500 + i);
    p.sampling.temperature = i == 0 ? 0.0f : 0.9f;
    p.sampling.top_k = i == 1 ? 1 : 20 + 10 * i;
    p.sampling.seed = 77 + static_cast<uint64_t>(i);
    if (i == 4) p.sampling.repeat_penalty = 1.2f;  // whole rows
    p.max_tokens = 20;
    reqs.push_back(p);
  }
  std::vector<std::vector<int32_t>> got[2];
  for (int device_sampling = 0; device_sampling < 2; ++device_sampling) {
    for (bool batched : {false, true}) {
      // Without the penalised request too: every step of the batch then uses candidates.
      for (size_t n : {reqs.size() - 1, reqs.size()}) {
        SchedulerConfig cfg{.n_slots = 5, .n_ctx = 128, .prefill_chunk = 7};
        cfg.batch_decode = batched;
        cfg.device_sampling = device_sampling == 1;
        auto sch = Scheduler::create(m, *be, cfg);
        ASSERT_TRUE(sch.has_value()) << sch.error();
        std::vector<std::shared_ptr<GenStream>> streams;
        for (size_t i = 0; i < n; ++i) {
          auto sub = (*sch)->submit(reqs[i]);
          ASSERT_TRUE(sub.stream) << sub.message;
          streams.push_back(sub.stream);
        }
        for (size_t i = 0; i < n; ++i) {
          const Outcome o = drain(*streams[i]);
          EXPECT_EQ(o.finish, FinishReason::kLength);
          got[device_sampling].push_back(o.ids);
        }
        // Which path the steps took: candidates only with the flag, for every step only when
        // no request needs whole rows.
        const SchedulerStats st = (*sch)->stats();
        EXPECT_GT(st.forward_passes, 0u);
        if (device_sampling == 0)
          EXPECT_EQ(st.candidate_passes, 0u);
        else if (n < reqs.size())
          EXPECT_EQ(st.candidate_passes, st.forward_passes);
        else
          EXPECT_LT(st.candidate_passes, st.forward_passes);
      }
    }
  }
  ASSERT_EQ(got[0].size(), got[1].size());
  for (size_t i = 0; i < got[0].size(); ++i) EXPECT_EQ(got[1][i], got[0][i]) << "request run " << i;
}

// n > 1 choices (submit_n): the prompt is evaluated once (the other choices copy its KV rows
// and its last row), and choice i's ids are those of a request of its own with seeds[i]. On a
// full-attention model, a sliding-window one (ring planes, prompt longer than the window) and
// a latent-attention one (K-only planes); sampled from whole rows and greedy from candidates.
class SharedPrefill : public ::testing::TestWithParam<std::string> {};

TEST_P(SharedPrefill, ChoicesEvaluateThePromptOnceAndMatchSoloRequests) {
  auto m = load(GetParam());
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  const std::vector<int32_t> prompt = random_prompt(45, m->n_vocab(), 4242);
  const auto n_prompt = static_cast<int32_t>(prompt.size());
  for (const bool greedy : {false, true}) {
    GenerationParams p;
    p.prompt = prompt;
    p.sampling.temperature = greedy ? 0.0f : 0.9f;
    p.sampling.top_k = 0;
    p.sampling.top_p = 0.95f;
    p.sampling.min_p = 0.0f;
    p.max_tokens = 12;
    const std::vector<uint64_t> seeds =
        greedy ? std::vector<uint64_t>{5, 6} : std::vector<uint64_t>{31, 32, 33};
    std::vector<Outcome> alone;
    {
      auto sch = Scheduler::create(m, *be, {.n_slots = 1, .n_ctx = 128, .prefill_chunk = 64});
      ASSERT_TRUE(sch.has_value()) << sch.error();
      for (uint64_t seed : seeds) {
        GenerationParams one = p;
        one.sampling.seed = seed;
        auto sub = (*sch)->submit(one);
        ASSERT_TRUE(sub.stream) << sub.message;
        alone.push_back(drain(*sub.stream));
      }
    }
    auto sch = Scheduler::create(m, *be, {.n_slots = 4, .n_ctx = 128, .prefill_chunk = 16});
    ASSERT_TRUE(sch.has_value()) << sch.error();
    auto sub = (*sch)->submit_n(p, seeds);
    ASSERT_EQ(sub.streams.size(), seeds.size()) << sub.message;
    std::vector<Outcome> got;
    for (auto& st : sub.streams) got.push_back(drain(*st));
    for (size_t i = 0; i < seeds.size(); ++i) {
      EXPECT_EQ(got[i].ids, alone[i].ids) << "choice " << i << (greedy ? " greedy" : " sampled");
      EXPECT_EQ(got[i].finish, alone[i].finish) << i;
      // The first choice evaluates the prompt; the others evaluate none of it.
      EXPECT_EQ(got[i].n_reused, i == 0 ? 0 : n_prompt) << i;
    }
    if (greedy) {
      EXPECT_EQ(got[0].ids, got[1].ids);
    }
    const SchedulerStats st = (*sch)->stats();
    EXPECT_EQ(st.prompt_tokens, uint64_t(n_prompt) * seeds.size());
    EXPECT_EQ(st.prompt_tokens_shared, uint64_t(n_prompt) * (seeds.size() - 1));
    EXPECT_EQ(st.prompt_tokens_reused, st.prompt_tokens_shared);
    if (greedy) {
      EXPECT_GT(st.candidate_passes, 0u);  // the shared row was candidates
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, SharedPrefill,
                         ::testing::Values("stories260K.gguf", "gemma2-swa-f16.gguf",
                                           "deepseek2-mla-q8_0.gguf"),
                         [](const auto& info) {
                           std::string n = info.param.substr(0, info.param.find('.'));
                           std::replace_if(
                               n.begin(), n.end(), [](char c) { return !isalnum(c); }, '_');
                           return n;
                         });

// A follower whose first choice is cancelled before its prompt is evaluated prefills the
// prompt itself and still gets its own ids.
TEST(Scheduler, SharedPrefillFallsBackWhenTheFirstChoiceEndsEarly) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  GenerationParams p;
  p.prompt = random_prompt(120, m->n_vocab(), 77);
  p.sampling.temperature = 0.8f;
  p.max_tokens = 6;
  const std::vector<uint64_t> seeds{3, 4};
  Outcome solo;
  {
    auto sch = Scheduler::create(m, *be, {.n_slots = 1, .n_ctx = 256, .prefill_chunk = 256});
    ASSERT_TRUE(sch.has_value());
    GenerationParams one = p;
    one.sampling.seed = 4;
    solo = drain(*(*sch)->submit(one).stream);
  }
  // Chunks of 1: the first choice needs 120 steps for its prompt; it is cancelled long before.
  auto sch = Scheduler::create(m, *be, {.n_slots = 2, .n_ctx = 256, .prefill_chunk = 1});
  ASSERT_TRUE(sch.has_value());
  auto sub = (*sch)->submit_n(p, seeds);
  ASSERT_EQ(sub.streams.size(), 2u);
  sub.streams[0]->cancel();
  EXPECT_EQ(drain(*sub.streams[0]).finish, FinishReason::kCancelled);
  const Outcome o = drain(*sub.streams[1]);
  EXPECT_EQ(o.ids, solo.ids);
  EXPECT_EQ(o.n_reused, 0);
  EXPECT_EQ((*sch)->stats().prompt_tokens_shared, 0u);
}

// A follower's prompt time is its own prompt work (copying the first choice's rows and
// sampling its first token), not its wait for the first choice's prefill: it evaluated no
// prompt token, so it reports next to no prompt time (docs/server.md). A prefill of 100
// steps for the first choice, a copy for the other.
TEST(Scheduler, SharedPrefillFollowerTimesOnlyItsOwnPromptWork) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  GenerationParams p;
  p.prompt = random_prompt(400, m->n_vocab(), 91);
  p.sampling.temperature = 0.8f;
  p.max_tokens = 4;
  const std::vector<uint64_t> seeds{1, 2};
  auto sch = Scheduler::create(m, *be, {.n_slots = 2, .n_ctx = 512, .prefill_chunk = 4});
  ASSERT_TRUE(sch.has_value()) << sch.error();
  auto sub = (*sch)->submit_n(p, seeds);
  ASSERT_EQ(sub.streams.size(), 2u) << sub.message;
  const Outcome leader = drain(*sub.streams[0]), follower = drain(*sub.streams[1]);
  ASSERT_EQ(follower.n_reused, 400);
  std::printf("prompt_ms: first choice %.2f, follower %.2f\n", leader.prompt_ms,
              follower.prompt_ms);
  EXPECT_GT(leader.prompt_ms, 0);
  EXPECT_LT(follower.prompt_ms, leader.prompt_ms / 4);
}

TEST(Scheduler, QueueBoundRejectsBeyondLimit) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  auto sch = Scheduler::create(m, *be, {.n_slots = 1, .n_ctx = 256, .max_queue = 2});
  ASSERT_TRUE(sch.has_value());
  GenerationParams p;
  p.prompt = random_prompt(8, m->n_vocab(), 1);
  p.max_tokens = 200;
  p.sampling.temperature = 0;
  std::vector<std::shared_ptr<GenStream>> streams;
  int rejected = 0;
  for (int i = 0; i < 8; ++i) {
    auto sub = (*sch)->submit(p);
    if (sub.stream)
      streams.push_back(sub.stream);
    else {
      EXPECT_EQ(sub.error, Scheduler::SubmitError::kQueueFull) << sub.message;
      ++rejected;
    }
  }
  // One may already be running; at most 1 running + 2 queued are accepted.
  EXPECT_GE(rejected, 5);
  EXPECT_LE(streams.size(), 3u);
  for (auto& s : streams) s->cancel();
  for (auto& s : streams) {
    Outcome o = drain(*s);
    EXPECT_TRUE(o.finish == FinishReason::kCancelled || o.finish == FinishReason::kLength);
  }
  EXPECT_EQ((*sch)->stats().requests_rejected, static_cast<uint64_t>(rejected));
}

TEST(Scheduler, ZeroQueueStillFillsIdleSlots) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  auto sch = Scheduler::create(m, *be, {.n_slots = 2, .n_ctx = 256, .max_queue = 0});
  ASSERT_TRUE(sch.has_value());
  GenerationParams p;
  p.prompt = random_prompt(8, m->n_vocab(), 2);
  p.max_tokens = 200;
  p.sampling.temperature = 0;
  p.sampling.logit_bias = {{2, -INFINITY}};
  auto a = (*sch)->submit(p), b = (*sch)->submit(p), c = (*sch)->submit(p);
  ASSERT_TRUE(a.stream && b.stream) << a.message << b.message;
  EXPECT_EQ(c.error, Scheduler::SubmitError::kQueueFull);
  a.stream->cancel();
  b.stream->cancel();
  EXPECT_EQ(drain(*a.stream).finish, FinishReason::kCancelled);
  EXPECT_EQ(drain(*b.stream).finish, FinishReason::kCancelled);
}

TEST(Scheduler, CancelFreesSlotForNextRequest) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  auto sch = Scheduler::create(m, *be, {.n_slots = 1, .n_ctx = 256});
  ASSERT_TRUE(sch.has_value());
  GenerationParams p;
  p.prompt = random_prompt(8, m->n_vocab(), 3);
  p.max_tokens = 240;
  p.sampling.temperature = 0;
  auto a = (*sch)->submit(p);
  ASSERT_TRUE(a.stream);
  ASSERT_TRUE(a.stream->next(30s).has_value());  // running
  a.stream->cancel();
  const Outcome oa = drain(*a.stream);
  EXPECT_EQ(oa.finish, FinishReason::kCancelled);
  EXPECT_LT(oa.ids.size(), 200u);
  p.max_tokens = 4;
  auto b = (*sch)->submit(p);
  ASSERT_TRUE(b.stream);
  const Outcome ob = drain(*b.stream);
  EXPECT_EQ(ob.finish, FinishReason::kLength);
  EXPECT_EQ(ob.ids.size(), 4u);
  EXPECT_EQ((*sch)->stats().requests_cancelled, 1u);
  EXPECT_EQ((*sch)->stats().slots_busy, 0);
}

TEST(Scheduler, StopsAtContextEnd) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  auto sch = Scheduler::create(m, *be, {.n_slots = 2, .n_ctx = 32});
  ASSERT_TRUE(sch.has_value());
  GenerationParams p;
  p.prompt = random_prompt(20, m->n_vocab(), 5);
  p.max_tokens = 1000;
  p.sampling.temperature = 0;
  p.sampling.logit_bias = {{2, -INFINITY}};  // no EOS: run into the context end
  auto sub = (*sch)->submit(p);
  ASSERT_TRUE(sub.stream);
  const Outcome o = drain(*sub.stream);
  EXPECT_EQ(o.finish, FinishReason::kLength);
  EXPECT_EQ(o.ids.size(), 32u - 20u + 1u);  // the last sampled token needs no KV row
}

TEST(Scheduler, RejectsInvalidRequests) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  auto sch = Scheduler::create(m, *be, {.n_slots = 1, .n_ctx = 16});
  ASSERT_TRUE(sch.has_value());
  GenerationParams p;
  EXPECT_EQ((*sch)->submit(p).error, Scheduler::SubmitError::kInvalid);  // empty
  p.prompt = {1, m->n_vocab()};
  EXPECT_EQ((*sch)->submit(p).error, Scheduler::SubmitError::kInvalid);  // id out of range
  p.prompt = random_prompt(16, m->n_vocab(), 1);
  auto r = (*sch)->submit(p);
  EXPECT_EQ(r.error, Scheduler::SubmitError::kInvalid);  // fills the context
  EXPECT_NE(r.message.find("16"), std::string::npos) << r.message;
  p.prompt = {1, 5};
  p.max_tokens = 0;
  EXPECT_EQ((*sch)->submit(p).error, Scheduler::SubmitError::kInvalid);
  p.max_tokens = 1;
  p.sampling.top_p = 2;
  EXPECT_EQ((*sch)->submit(p).error, Scheduler::SubmitError::kInvalid);
  EXPECT_FALSE(Scheduler::create(m, *be, {.n_slots = 0}).has_value());
  EXPECT_FALSE(Scheduler::create(m, *be, {.prefill_chunk = 0}).has_value());
}

TEST(Scheduler, ShutdownCancelsInFlightAndQueued) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  auto sch = Scheduler::create(m, *be, {.n_slots = 2, .n_ctx = 256});
  ASSERT_TRUE(sch.has_value());
  GenerationParams p;
  p.prompt = random_prompt(8, m->n_vocab(), 9);
  p.max_tokens = 240;
  p.sampling.temperature = 0;
  p.sampling.logit_bias = {{2, -INFINITY}};
  std::vector<std::shared_ptr<GenStream>> streams;
  for (int i = 0; i < 5; ++i) streams.push_back((*sch)->submit(p).stream);
  (*sch)->shutdown();
  for (auto& s : streams) {
    ASSERT_TRUE(s);
    EXPECT_EQ(drain(*s).finish, FinishReason::kCancelled);
  }
  EXPECT_EQ((*sch)->submit(p).error, Scheduler::SubmitError::kShuttingDown);
}

// A prompt that repeats itself, so prompt lookup finds continuations to draft: text the
// stories model continues by copying, random ids for the random-weight models.
std::vector<int32_t> repetitive_prompt(const Model& m, uint32_t seed) {
  std::vector<int32_t> p{1};
  if (m.n_vocab() == 512) {
    auto tok = Tokenizer::from_gguf(m.gguf());
    EXPECT_TRUE(tok.has_value()) << tok.error();
    const std::string line = seed % 2 ? "The cat sat on the mat and looked at the sun. "
                                      : "Tom had a red ball. He liked to play with it. ";
    const auto ids = tok->encode(line + line + line + line.substr(0, 12), false, false);
    p.insert(p.end(), ids.begin(), ids.end());
    return p;
  }
  const auto unit = random_prompt(12, m.n_vocab(), seed);
  for (int r = 0; r < 4; ++r) p.insert(p.end(), unit.begin() + 1, unit.end());
  return p;
}

// n-gram drafting inside the scheduler (issue 10): greedy requests get exactly the ids of
// plain decoding, on a plain model and on one with sliding-window rings (rejected drafts are
// rolled back inside wrapped rings), while plain requests share the same batched steps;
// sampled requests with drafts are reproducible for a seed, alone or concurrent.
TEST(Scheduler, NgramDraftingKeepsGreedyIdsAndIsReproducible) {
  for (const char* file : {"stories260K.gguf", "gemma2-swa-f16.gguf"}) {
    auto m = load(file);
    ASSERT_TRUE(m);
    auto be = make_cpu_backend({.threads = 2});
    std::vector<GenerationParams> reqs;
    for (uint32_t i = 0; i < 4; ++i) {
      GenerationParams p;
      p.prompt = repetitive_prompt(*m, 70 + i);
      p.sampling.temperature = i < 2 ? 0.0f : 0.8f;
      p.sampling.seed = 5 + i;
      p.max_tokens = 40;
      reqs.push_back(p);
    }
    auto run = [&](int32_t n_draft, int32_t n_slots, bool concurrent) {
      auto sch = Scheduler::create(m, *be, {.n_slots = n_slots, .n_ctx = 128, .prefill_chunk = 16});
      EXPECT_TRUE(sch.has_value()) << sch.error();
      std::vector<Outcome> got(reqs.size());
      std::vector<std::shared_ptr<GenStream>> streams;
      for (size_t i = 0; i < reqs.size(); ++i) {
        GenerationParams p = reqs[i];
        p.n_draft = i % 2 == 0 ? n_draft : 0;  // odd requests never draft
        auto sub = (*sch)->submit(p);
        EXPECT_TRUE(sub.stream) << sub.message;
        if (!concurrent)
          got[i] = drain(*sub.stream);
        else
          streams.push_back(sub.stream);
      }
      for (size_t i = 0; i < streams.size(); ++i) got[i] = drain(*streams[i]);
      return std::make_pair(got, (*sch)->stats());
    };
    const auto [plain, plain_stats] = run(0, 1, false);
    const auto [alone, alone_stats] = run(4, 1, false);
    const auto [conc, conc_stats] = run(4, 4, true);
    EXPECT_EQ(plain_stats.spec_steps, 0u);
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(plain[i].ids.size(), 40u) << file << " request " << i;
      if (reqs[i].sampling.temperature <= 0)
        EXPECT_EQ(alone[i].ids, plain[i].ids) << file << ": greedy request " << i << " with drafts";
      EXPECT_EQ(conc[i].ids, alone[i].ids) << file << ": request " << i << " concurrent vs alone";
    }
    EXPECT_GT(alone_stats.spec_steps, 0u) << file;
    EXPECT_EQ(conc_stats.spec_drafted, alone_stats.spec_drafted) << file;
    EXPECT_EQ(conc_stats.spec_accepted, alone_stats.spec_accepted) << file;
    std::printf(
        "%s: drafting: %llu verify steps, %llu drafted, %llu accepted (%.2f tokens per "
        "step); %llu forward passes for %llu tokens when concurrent\n",
        file, (unsigned long long)alone_stats.spec_steps,
        (unsigned long long)alone_stats.spec_drafted, (unsigned long long)alone_stats.spec_accepted,
        alone_stats.spec_steps
            ? 1.0 + double(alone_stats.spec_accepted) / double(alone_stats.spec_steps)
            : 0.0,
        (unsigned long long)conc_stats.forward_passes,
        (unsigned long long)conc_stats.forward_tokens);
  }
}

// A drafter that refuses to resume any prefix but the empty one, counting how it was asked in
// a counter the test owns (the scheduler destroys its drafters with it).
class NoResumeDrafter final : public Drafter {
 public:
  explicit NoResumeDrafter(int* rollbacks) : rollbacks_(rollbacks) {}
  std::string name() const override { return "no-resume"; }
  Status propose(const DraftRequest& req, Draft& out) override { return ngram_.propose(req, out); }
  Status rollback(int32_t n_pos) override {
    ++*rollbacks_;
    return n_pos == 0 ? Status::ok() : Status::error("cannot resume");
  }

 private:
  int* rollbacks_;
  NgramDrafter ngram_;
};

// Model drafters inside the scheduler (kiln serve --dflash / --spec-mtp): one per slot, fed
// the slot's own activations. DFlash on the shipped pair: greedy ids equal plain decoding's,
// alone and two at a time; a request sharing a cached prefix resumes it (the drafter is cut
// back to it) with the same ids and draft counts as from scratch. A drafter that cannot resume
// makes the slot start afresh (no reuse), same ids.
TEST(Scheduler, ModelDraftersKeepGreedyIdsAndResumePrefixes) {
  auto target = Model::load(testing::model_path("dflash-target-f16.gguf"));
  ASSERT_TRUE(target.has_value()) << target.error();
  std::shared_ptr<const Model> m = std::move(*target);
  auto be = make_cpu_backend({.threads = 2});
  const auto base = random_prompt(60, m->n_vocab(), 3);
  std::vector<GenerationParams> reqs;
  for (size_t n : {size_t(60), size_t(41), size_t(60)}) {
    GenerationParams p;
    p.prompt.assign(base.begin(), base.begin() + ptrdiff_t(n));
    p.sampling.temperature = 0;
    p.max_tokens = 30;
    reqs.push_back(p);
  }
  auto run = [&](SchedulerConfig cfg, bool concurrent) {
    auto sch = Scheduler::create(m, *be, cfg);
    EXPECT_TRUE(sch.has_value()) << sch.error();
    std::vector<Outcome> got;
    std::vector<std::shared_ptr<GenStream>> streams;
    for (size_t i = 0; i < reqs.size(); ++i) {
      auto sub = (*sch)->submit(reqs[i]);
      EXPECT_TRUE(sub.stream) << sub.message;
      if (concurrent && i < 2) {
        streams.push_back(sub.stream);
        if (i == 1)
          for (auto& st : streams) got.push_back(drain(*st));
      } else {
        got.push_back(drain(*sub.stream));
      }
    }
    return got;
  };
  SchedulerConfig plain_cfg{.n_slots = 1, .n_ctx = 256, .prefill_chunk = 16};
  const auto plain = run(plain_cfg, false);
  SchedulerConfig dflash_cfg = plain_cfg;
  dflash_cfg.draft_model = 4;
  dflash_cfg.make_drafter = [&](int32_t n_ctx,
                                int32_t max_batch) -> Expected<std::unique_ptr<Drafter>> {
    KILN_ASSIGN_OR_RETURN(
        auto d, DflashDrafter::create(testing::model_path("dflash-drafter-f16.gguf"), m, *be, n_ctx,
                                      max_batch));
    return std::unique_ptr<Drafter>(std::move(d));
  };
  const auto alone = run(dflash_cfg, false);
  dflash_cfg.n_slots = 2;
  const auto two = run(dflash_cfg, true);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_EQ(plain[i].ids.size(), 30u);
    EXPECT_EQ(alone[i].ids, plain[i].ids) << "request " << i << " with DFlash drafts";
    EXPECT_EQ(two[i].ids, plain[i].ids) << "request " << i << " with DFlash drafts, 2 slots";
    EXPECT_GT(alone[i].n_drafted, 0) << i;
    EXPECT_LE(alone[i].n_draft_accepted, alone[i].n_drafted) << i;
  }
  // The third request resumed the 41 prompt rows it shares with the second (the one slot's
  // last request), and the drafter its features there.
  EXPECT_EQ(alone[2].n_reused, 41);
  EXPECT_EQ(alone[2].n_drafted, alone[0].n_drafted);
  EXPECT_EQ(alone[2].n_draft_accepted, alone[0].n_draft_accepted);
  std::printf("dflash in the scheduler: %d drafted, %d accepted (request 0)\n", alone[0].n_drafted,
              alone[0].n_draft_accepted);

  int made = 0, rollbacks = 0;
  SchedulerConfig no_resume = plain_cfg;
  no_resume.draft_model = 4;
  no_resume.make_drafter = [&](int32_t, int32_t) -> Expected<std::unique_ptr<Drafter>> {
    ++made;
    return std::unique_ptr<Drafter>(std::make_unique<NoResumeDrafter>(&rollbacks));
  };
  const auto fresh = run(no_resume, false);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(fresh[i].ids, plain[i].ids) << "request " << i << " with a non-resuming drafter";
    EXPECT_EQ(fresh[i].n_reused, 0) << i;
  }
  ASSERT_EQ(made, 1);
  EXPECT_GE(rollbacks, 3);
}

// --spec-mtp in the scheduler (issue 36): a slot's NextN drafter resumes a cached prefix (it
// keeps the target hidden states it was shown and rebuilds the row the cut replaces), so the
// third request reuses the 41 prompt rows it shares with the second with the same ids, drafts
// and acceptance as from scratch. Before, the drafter refused and the slot re-read the prompt.
TEST(Scheduler, MtpDrafterResumesCachedPrefixes) {
  auto m = load("glm4moe-f16.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 2});
  const auto base = random_prompt(60, m->n_vocab(), 5);
  std::vector<GenerationParams> reqs;
  for (size_t n : {size_t(60), size_t(41), size_t(60)}) {
    GenerationParams p;
    p.prompt.assign(base.begin(), base.begin() + ptrdiff_t(n));
    p.sampling.temperature = 0;
    p.max_tokens = 24;
    reqs.push_back(p);
  }
  auto run = [&](const SchedulerConfig& cfg) {
    auto sch = Scheduler::create(m, *be, cfg);
    EXPECT_TRUE(sch.has_value()) << sch.error();
    std::vector<Outcome> got;
    for (const GenerationParams& p : reqs) {
      auto sub = (*sch)->submit(p);
      EXPECT_TRUE(sub.stream) << sub.message;
      got.push_back(drain(*sub.stream));
    }
    return got;
  };
  SchedulerConfig plain_cfg{.n_slots = 1, .n_ctx = 256, .prefill_chunk = 16};
  const auto plain = run(plain_cfg);
  SchedulerConfig mtp_cfg = plain_cfg;
  mtp_cfg.draft_model = 3;
  mtp_cfg.make_drafter = [&](int32_t n_ctx,
                             int32_t max_batch) -> Expected<std::unique_ptr<Drafter>> {
    KILN_ASSIGN_OR_RETURN(auto d, MtpDrafter::create(m, *be, n_ctx, max_batch));
    return std::unique_ptr<Drafter>(std::move(d));
  };
  const auto mtp = run(mtp_cfg);
  for (size_t i = 0; i < reqs.size(); ++i) {
    ASSERT_EQ(plain[i].ids.size(), 24u);
    EXPECT_EQ(mtp[i].ids, plain[i].ids) << "request " << i << " with NextN drafts";
    EXPECT_GT(mtp[i].n_drafted, 0) << i;
  }
  EXPECT_EQ(mtp[1].n_reused, 40);  // the prompt but its last token, which gives the logits
  EXPECT_EQ(mtp[2].n_reused, 41);
  EXPECT_EQ(mtp[2].n_drafted, mtp[0].n_drafted);
  EXPECT_EQ(mtp[2].n_draft_accepted, mtp[0].n_draft_accepted);
}

TEST(Scheduler, RejectsOverlongDrafts) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto be = make_cpu_backend({.threads = 1});
  auto sch = Scheduler::create(m, *be, {.n_slots = 1, .n_ctx = 64});
  ASSERT_TRUE(sch.has_value());
  GenerationParams p;
  p.prompt = {1, 5};
  p.n_draft = GenerationParams::kMaxDraft + 1;
  const auto r = (*sch)->submit(p);
  EXPECT_EQ(r.error, Scheduler::SubmitError::kInvalid);
  EXPECT_NE(r.message.find("n_draft"), std::string::npos) << r.message;
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// A JSON object whose long property names the grammar forces byte by byte.
Expected<std::shared_ptr<const grammar::Grammar>> long_key_grammar() {
  auto gbnf = grammar::json_schema_to_gbnf(nlohmann::ordered_json::parse(R"({
    "type": "object",
    "properties": {
      "the_name_of_the_main_character_in_this_story": {"type": "string", "maxLength": 12},
      "how_many_friends_did_the_main_character_meet": {"type": "integer"},
      "did_the_story_have_a_happy_ending_for_everyone": {"type": "boolean"}
    },
    "required": ["the_name_of_the_main_character_in_this_story",
                 "how_many_friends_did_the_main_character_meet",
                 "did_the_story_have_a_happy_ending_for_everyone"]})"));
  if (!gbnf) return Status::error(gbnf.error());
  return grammar::Grammar::parse(*gbnf);
}

// Forced-token drafting (issue 35, point 3): a JSON schema whose long property names the
// grammar forces byte by byte. With drafts (the default) the ids are those without
// (n_draft 0), greedy and sampled with penalties, alone and beside a free request, and the
// output takes fewer forward passes: the forced keys are verified in one step each.
TEST(Scheduler, ForcedTokenDraftsKeepIdsAndSaveSteps) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto tok = Tokenizer::from_gguf(m->gguf());
  ASSERT_TRUE(tok.has_value()) << tok.error();
  auto be = make_cpu_backend({.threads = 2});
  const auto vocab = make_token_trie(*tok);
  auto g = long_key_grammar();
  ASSERT_TRUE(g) << g.error();
  const std::vector<int32_t> prompt = tok->encode("Once upon a time, there was", true, false);
  for (int variant = 0; variant < 3; ++variant) {
    GenerationParams p;
    p.prompt = prompt;
    p.grammar = *g;
    p.grammar_vocab = vocab;
    p.max_tokens = 400;
    p.sampling.temperature = variant == 0 ? 0.0f : 0.8f;
    p.sampling.seed = 1234 + static_cast<uint64_t>(variant);
    if (variant == 2) p.sampling.repeat_penalty = 1.1f;  // history-dependent sampling
    GenerationParams free_req;
    free_req.prompt = prompt;
    free_req.max_tokens = 40;
    free_req.sampling.seed = 9;
    std::vector<int32_t> ids[2];
    uint64_t passes[2] = {0, 0}, forced_accepted = 0, forced_drafted = 0;
    for (int drafting = 0; drafting < 2; ++drafting) {
      auto sch = Scheduler::create(m, *be, {.n_slots = 2, .n_ctx = 512, .prefill_chunk = 64});
      ASSERT_TRUE(sch.has_value()) << sch.error();
      GenerationParams q = p;
      q.n_draft = drafting ? -1 : 0;
      auto sub = (*sch)->submit(q);
      ASSERT_TRUE(sub.stream) << sub.message;
      const Outcome o = drain(*sub.stream);
      EXPECT_EQ(o.finish, FinishReason::kStop)
          << "variant " << variant << ": " << tok->decode(o.ids);
      ids[drafting] = o.ids;
      const SchedulerStats st = (*sch)->stats();
      passes[drafting] = st.forward_passes;
      if (drafting) {
        forced_accepted = st.forced_accepted;
        forced_drafted = st.forced_drafted;
        EXPECT_EQ(st.forced_steps, st.spec_steps);
        // Beside a free request: the same ids again.
        auto a = (*sch)->submit(q);
        auto b = (*sch)->submit(free_req);
        ASSERT_TRUE(a.stream && b.stream);
        EXPECT_EQ(drain(*a.stream).ids, o.ids) << "variant " << variant << " beside another";
        drain(*b.stream);
      } else {
        EXPECT_EQ(st.forced_steps, 0u);
      }
    }
    EXPECT_EQ(ids[1], ids[0]) << "variant " << variant;
    const std::string text = tok->decode(ids[0]);
    EXPECT_NE(text.find("how_many_friends_did_the_main_character_meet"), std::string::npos) << text;
    EXPECT_LT(passes[1], passes[0]) << "variant " << variant;
    // Forced drafts are always kept; each is a forward pass saved (but one that ends the
    // request, which needs no pass after it either way).
    EXPECT_EQ(forced_accepted, forced_drafted) << "variant " << variant;
    EXPECT_GE(passes[0] - passes[1] + 1, forced_accepted) << "variant " << variant;
    EXPECT_GT(forced_accepted, 20u) << "variant " << variant;
    std::printf(
        "forced drafts, variant %d: %zu tokens, %llu forward passes without drafts, "
        "%llu with (%llu of %llu drafts kept)\n",
        variant, ids[0].size(), static_cast<unsigned long long>(passes[0]),
        static_cast<unsigned long long>(passes[1]),
        static_cast<unsigned long long>(forced_accepted),
        static_cast<unsigned long long>(forced_drafted));
  }
}

// What a slot's drafter was shown, in a record the test owns (the scheduler destroys its
// drafters with it).
struct SeenLog {
  int64_t seen = 0;  // target rows observed since the last rollback, plus the rollback point
  int64_t gaps = 0;  // rollbacks asked to resume beyond what was observed
};

// A drafter that counts the target rows it is shown and refuses to resume past them: a slot
// that fed it fewer rows than its cache holds left it a gap.
class CountingDrafter final : public Drafter {
 public:
  explicit CountingDrafter(SeenLog* log) : log_(log) {}
  std::string name() const override { return "counting"; }
  std::vector<std::string> wanted_captures() const override { return {"result_norm"}; }
  Status propose(const DraftRequest& req, Draft& out) override { return ngram_.propose(req, out); }
  void observe_target(const model::Capture& /*c*/, int32_t n_rows_kept) override {
    log_->seen += n_rows_kept;
  }
  Status rollback(int32_t n_pos) override {
    if (n_pos > log_->seen) {
      ++log_->gaps;
      return Status::error("cannot resume beyond the observed rows");
    }
    log_->seen = n_pos;
    return Status::ok();
  }

 private:
  SeenLog* log_;
  NgramDrafter ngram_;
};

// Issue 36: forced-token verify steps feed the slot's model drafter like every other step, so
// after a constrained request in a slot with a drafter (--dflash / --spec-mtp) the drafter has
// seen every position the slot's cache holds, and the next request resumes the prefix. The
// ids are those of a slot without a drafter.
TEST(Scheduler, ForcedDraftsFeedTheSlotDrafter) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto tok = Tokenizer::from_gguf(m->gguf());
  ASSERT_TRUE(tok.has_value()) << tok.error();
  auto be = make_cpu_backend({.threads = 2});
  auto g = long_key_grammar();
  ASSERT_TRUE(g) << g.error();
  const std::vector<int32_t> prompt = tok->encode("Once upon a time, there was", true, false);
  for (int variant = 0; variant < 2; ++variant) {
    GenerationParams p;
    p.prompt = prompt;
    p.grammar = *g;
    p.grammar_vocab = make_token_trie(*tok);
    p.max_tokens = 400;
    p.sampling.temperature = variant == 0 ? 0.0f : 0.8f;
    p.sampling.seed = 77 + static_cast<uint64_t>(variant);
    SchedulerConfig cfg{.n_slots = 1, .n_ctx = 512, .prefill_chunk = 64};
    auto plain = Scheduler::create(m, *be, cfg);
    ASSERT_TRUE(plain.has_value()) << plain.error();
    auto sub = (*plain)->submit(p);
    ASSERT_TRUE(sub.stream) << sub.message;
    const Outcome want = drain(*sub.stream);
    ASSERT_EQ(want.finish, FinishReason::kStop) << tok->decode(want.ids);

    SeenLog log;
    cfg.draft_model = 4;
    cfg.make_drafter = [&](int32_t, int32_t) -> Expected<std::unique_ptr<Drafter>> {
      return std::unique_ptr<Drafter>(std::make_unique<CountingDrafter>(&log));
    };
    auto sch = Scheduler::create(m, *be, cfg);
    ASSERT_TRUE(sch.has_value()) << sch.error();
    sub = (*sch)->submit(p);
    ASSERT_TRUE(sub.stream) << sub.message;
    const Outcome got = drain(*sub.stream);
    EXPECT_EQ(got.ids, want.ids) << "variant " << variant;
    EXPECT_GT((*sch)->stats().forced_accepted, 20u) << "variant " << variant;
    // The next request continues the output: it resumes the whole cached prefix, which the
    // drafter must hold too (its rollback is asked for it when the slot is taken).
    GenerationParams next;
    next.prompt = prompt;
    next.prompt.insert(next.prompt.end(), got.ids.begin(), got.ids.end());
    next.max_tokens = 8;
    sub = (*sch)->submit(next);
    ASSERT_TRUE(sub.stream) << sub.message;
    const Outcome cont = drain(*sub.stream);
    EXPECT_EQ(log.gaps, 0) << "variant " << variant;
    EXPECT_EQ(cont.n_reused, int32_t(next.prompt.size()) - 1) << "variant " << variant;
    EXPECT_EQ(log.seen, (*sch)->stats().kv_positions_used) << "variant " << variant;
  }
}

}  // namespace
}  // namespace kiln
