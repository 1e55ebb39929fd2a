// tests/moe/expert_store_test.cpp: the streaming expert store against the mapped source. With
// any budget that holds the experts one token needs, a prefill and a greedy decode must give
// the same ids and bit-identical logits as the fully mapped run; the store's own slices must
// equal the mapped bytes under concurrent gets that force constant eviction; bad budgets are
// one-line errors.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <set>
#include <tuple>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "backend/cpu/cpu_backend.h"
#include "common/testdata.h"
#include "core/counters.h"
#include "engine/session.h"
#include "model/routing.h"
#include "moe/expert_store.h"

namespace kiln {
namespace {

struct RunResult {
  std::vector<int32_t> ids;
  std::vector<float> logits;  // prompt logits (all positions), then each decode step's
};

std::vector<int32_t> prompt_of(const std::string& model_file, size_t n) {
  const std::string stem = model_file.substr(0, model_file.size() - 5);  // drop ".gguf"
  const auto j = nlohmann::json::parse(
      testing::read_file(testing::shared_path("testdata/golden/" + stem + ".json")));
  std::vector<int32_t> p = j.at("prompt_tokens").get<std::vector<int32_t>>();
  if (p.size() > n) p.resize(n);
  return p;
}

// Prefill of `prompt` (all logits), then n_gen greedy single-token steps.
RunResult run(const std::shared_ptr<const Model>& m, Backend& be,
              const std::vector<int32_t>& prompt, int n_gen) {
  RunResult r;
  Session s(m, be, 256);
  auto lg = s.eval(prompt, true);
  EXPECT_TRUE(lg.has_value()) << lg.error();
  if (!lg.has_value()) return r;
  r.logits.assign(lg->begin(), lg->end());
  std::span<const float> last = lg->subspan(lg->size() - static_cast<size_t>(m->n_vocab()));
  for (int i = 0; i < n_gen; ++i) {
    const int32_t id =
        static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
    r.ids.push_back(id);
    auto step = s.eval(std::span<const int32_t>(&id, 1), false);
    EXPECT_TRUE(step.has_value()) << step.error();
    if (!step.has_value()) return r;
    r.logits.insert(r.logits.end(), step->begin(), step->end());
    last = *step;
  }
  return r;
}

std::shared_ptr<const Model> load(const std::string& file, const moe::StoreConfig& c = {}) {
  auto m = Model::load(testing::model_path(file), c);
  EXPECT_TRUE(m.has_value()) << m.error();
  return m.has_value() ? *m : nullptr;
}

uint64_t counter(const char* name) { return process_counters().counter(name).value(); }

struct Case {
  const char* name;
  moe::StoreConfig cfg;
};

class Identity : public ::testing::TestWithParam<const char*> {};

TEST_P(Identity, SameIdsAndBitIdenticalLogitsUnderEveryBudget) {
  const std::string file = GetParam();
  auto be = make_cpu_backend({.threads = 2});
  const std::vector<int32_t> prompt = prompt_of(file, 48);
  const int n_gen = 12;
  const RunResult base = run(load(file), *be, prompt, n_gen);
  ASSERT_EQ(base.ids.size(), size_t(n_gen));

  auto base_model = load(file);
  const auto* mapped =
      dynamic_cast<const moe::MappedExpertSource*>(base_model->weights().experts.get());
  ASSERT_NE(mapped, nullptr);
  // A byte budget worth 3 experts per layer (the slab size comes from a cap-8 store).
  auto probe = load(file, {.cap = 8});
  const auto* ps = dynamic_cast<const moe::ExpertStore*>(probe->weights().experts.get());
  ASSERT_NE(ps, nullptr);
  int n_moe = 0;
  for (const auto& L : base_model->hparams().layers) n_moe += L.n_expert > 0;
  const int64_t three = static_cast<int64_t>(ps->slab_bytes()) * 3 * n_moe + 100;

  const Case cases[] = {
      {"cap2", {.cap = 2}},
      {"cap3", {.cap = 3}},
      {"cap8", {.cap = 8}},
      {"bytes3", {.cache_bytes = three}},
      {"cap2+prefetch", {.cap = 2, .prefetch = true}},
      {"cap3+prefetch+pread", {.cap = 3, .prefetch = true, .force_pread = true}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto m = load(file, c.cfg);
    ASSERT_NE(m, nullptr);
    const auto* st = dynamic_cast<const moe::ExpertStore*>(m->weights().experts.get());
    ASSERT_NE(st, nullptr) << "the store was not selected";
    if (c.cfg.cache_bytes) {
      EXPECT_EQ(st->cap_per_layer(), 3);
    }
    const uint64_t miss0 = counter("moe.expert_misses"), hit0 = counter("moe.expert_hits");
    const uint64_t bytes0 = counter("moe.bytes_read");
    const RunResult r = run(m, *be, prompt, n_gen);
    EXPECT_EQ(r.ids, base.ids);
    ASSERT_EQ(r.logits.size(), base.logits.size());
    EXPECT_EQ(std::memcmp(r.logits.data(), base.logits.data(), r.logits.size() * sizeof(float)), 0)
        << "logits differ from the mapped run";
    const uint64_t misses = counter("moe.expert_misses") - miss0;
    const uint64_t hits = counter("moe.expert_hits") - hit0;
    EXPECT_GT(misses, 0u);
    EXPECT_GT(counter("moe.bytes_read") - bytes0, 0u);
    if (st->cap_per_layer() < mapped->n_expert(0)) {
      EXPECT_GT(misses, uint64_t(n_moe) * 8);
    }
    std::printf("[ %s %-20s ] cap %d: %llu hits, %llu misses, %s%s\n", file.c_str(), c.name,
                st->cap_per_layer(), (unsigned long long)hits, (unsigned long long)misses,
                st->uses_uring() ? "io_uring" : "pread", st->uses_direct() ? "+O_DIRECT" : "");
  }
}

INSTANTIATE_TEST_SUITE_P(Models, Identity,
                         ::testing::Values("qwen3moe-f16.gguf", "qwen3moe-q4_k_m.gguf",
                                           "mixtral-q4_k_m.gguf", "gpt-oss-mxfp4_moe.gguf",
                                           "glm4moe-q4_k_m.gguf", "deepseek2-mla-q8_0.gguf"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

// The benchmark routing overrides (model/routing.h) keep the identity: their draws depend on
// (layer, position, token) alone, so a streaming run routes as the resident one. Uniform
// routing is the caches' worst case: more misses than the model's own skewed routing.
TEST(ExpertStore, RoutingOverridesKeepStreamingIdentical) {
  auto be = make_cpu_backend({.threads = 2});
  for (const char* file : {"qwen3moe-q4_k_m.gguf", "mixtral-q4_k_m.gguf"}) {
    const std::vector<int32_t> prompt = prompt_of(file, 24);
    for (const char* routing : {"uniform", "zipf:1.1"}) {
      SCOPED_TRACE(std::string(file) + " " + routing);
      const model::RoutingOverride ro = *model::parse_routing(routing);
      auto resident = Model::load(testing::model_path(file), {{}, ro});
      ASSERT_TRUE(resident.has_value()) << resident.error();
      const RunResult base = run(*resident, *be, prompt, 8);
      for (int cap : {2, 3}) {
        auto m = Model::load(testing::model_path(file), {moe::StoreConfig{.cap = cap}, ro});
        ASSERT_TRUE(m.has_value()) << m.error();
        const RunResult r = run(*m, *be, prompt, 8);
        EXPECT_EQ(r.ids, base.ids) << "cap " << cap;
        ASSERT_EQ(r.logits.size(), base.logits.size());
        EXPECT_EQ(std::memcmp(r.logits.data(), base.logits.data(), r.logits.size() * sizeof(float)),
                  0)
            << "cap " << cap << ": logits differ from the resident run";
      }
    }
  }
}

// Slices carry WeightMatrix::content_key (a device backend caches by it, since a slab's
// address later holds another expert): nonzero, one per (layer, expert, part), and the same
// whichever slab the expert is loaded into; register_slabs registers the whole slab mapping
// once and releases the handle before the memory is unmapped.
TEST(ExpertStore, ContentKeysNameTheExpertAndRegistrationEndsBeforeTheUnmap) {
  const std::string file = "qwen3moe-q4_k_m.gguf";
  auto m = load(file, {.cap = 2});
  ASSERT_NE(m, nullptr);
  auto* st = dynamic_cast<moe::ExpertStore*>(m->weights().experts.get());
  ASSERT_NE(st, nullptr);
  std::map<std::tuple<int32_t, int32_t, int>, uint64_t> keys;
  std::set<uint64_t> seen;
  std::set<const std::byte*> slab_addrs;
  const int32_t n_layer = st->n_layer(), n_expert = st->n_expert(0);
  for (int round = 0; round < 2; ++round)  // cap 2 of 8: every expert is loaded twice
    for (int32_t l = 0; l < n_layer; ++l)
      for (int32_t e = 0; e < n_expert; ++e) {
        const moe::ExpertWeights w = st->get(l, e);
        const WeightMatrix* parts[3] = {&w.gate, &w.up, &w.down};
        slab_addrs.insert(w.gate.bytes.data());
        for (int p = 0; p < 3; ++p) {
          const uint64_t k = parts[p]->content_key;
          ASSERT_NE(k, 0u);
          EXPECT_EQ(k, st->content_key(l, e, p));
          auto [it, fresh] = keys.emplace(std::make_tuple(l, e, p), k);
          if (fresh) {
            EXPECT_TRUE(seen.insert(k).second) << "two slices share key " << k;
          } else {
            EXPECT_EQ(it->second, k) << "layer " << l << " expert " << e << " part " << p;
          }
        }
      }
  EXPECT_LE(slab_addrs.size(), size_t(2 * n_layer));  // the keys outnumber the slabs' addresses
  EXPECT_EQ(seen.size(), size_t(3 * n_layer * n_expert));
  {  // Sub-views of keyed content get keys of their own; unkeyed ones stay unkeyed.
    const moe::ExpertWeights w = st->get(0, 0);
    EXPECT_NE(w.gate.rows(0, 1).content_key, 0u);
    EXPECT_NE(w.gate.rows(0, 1).content_key, w.gate.content_key);
    EXPECT_NE(w.gate.rows(0, 1).content_key, w.gate.rows(1, 1).content_key);
    WeightMatrix plain = w.gate;
    plain.content_key = 0;
    EXPECT_EQ(plain.rows(0, 1).content_key, 0u);
  }

  // Registration: once, over the whole slab mapping; released while that memory is mapped.
  int calls = 0;
  size_t registered = 0;
  bool released_while_mapped = false;
  std::span<std::byte> region;
  st->register_slabs([&](std::span<std::byte> mem) {
    ++calls;
    registered = mem.size();
    region = mem;
    return std::shared_ptr<void>(mem.data(), [&](void* p) {
      // Reading the first and last byte faults (and ASan reports) if the unmap came first.
      volatile std::byte b0 = static_cast<std::byte*>(p)[0];
      volatile std::byte b1 = region.back();
      (void)b0;
      (void)b1;
      released_while_mapped = true;
    });
  });
  st->register_slabs([&](std::span<std::byte>) {
    ++calls;
    return std::shared_ptr<void>();
  });
  EXPECT_EQ(calls, 1);
  // The slabs and the zero expert after them (what a get() whose read failed hands out; a
  // device tier copies from it too).
  EXPECT_EQ(registered, st->total_slab_bytes() + st->slab_bytes());
  EXPECT_TRUE(st->slabs_registered());
  EXPECT_FALSE(released_while_mapped);
  m.reset();  // the model owns the store
  EXPECT_TRUE(released_while_mapped);
}

TEST(ExpertStore, FlagOffKeepsTheMappedSource) {
  auto m = load("qwen3moe-q4_k_m.gguf", moe::StoreConfig{});
  ASSERT_NE(m, nullptr);
  EXPECT_NE(dynamic_cast<const moe::MappedExpertSource*>(m->weights().experts.get()), nullptr);
  // A dense model ignores the options.
  auto d = load("stories260K.gguf", {.cap = 2});
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->weights().experts, nullptr);
}

TEST(ExpertStore, BudgetsBelowOneTokenAreOneLineErrors) {
  const std::string path = testing::model_path("qwen3moe-q4_k_m.gguf");
  struct Bad {
    moe::StoreConfig cfg;
    const char* needle;
  };
  const Bad bad[] = {{{.cap = 1}, "--expert-cap 1 is below the 2 experts"},
                     {{.cache_bytes = 4096}, "--expert-cache 4096 bytes holds 0 experts"},
                     {{.cap = -3}, "must not be negative"},
                     {{.cache_bytes = -1}, "must not be negative"}};
  for (const Bad& b : bad) {
    auto m = Model::load(path, b.cfg);
    ASSERT_FALSE(m.has_value());
    EXPECT_NE(m.error().find(b.needle), std::string::npos) << m.error();
    EXPECT_EQ(m.error().find('\n'), std::string::npos) << m.error();
  }
}

// Many threads get random experts through a store with two slabs per layer (constant
// eviction, loads racing with pins, prefetch on); every view must hold the mapped bytes.
TEST(ExpertStore, ConcurrentGetsUnderConstantEvictionSeeMappedBytes) {
  auto base = load("qwen3moe-q4_k_m.gguf");
  auto m = load("qwen3moe-q4_k_m.gguf", {.cap = 2, .prefetch = true, .n_readers = 3});
  ASSERT_NE(m, nullptr);
  moe::ExpertSource& src = *m->weights().experts;
  moe::ExpertSource& ref = *base->weights().experts;
  const uint64_t ev0 = counter("moe.evictions");
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      for (int i = 0; i < 300; ++i) {
        const int32_t layer = static_cast<int32_t>(rng() % src.n_layer());
        const int32_t e = static_cast<int32_t>(rng() % src.n_expert(layer));
        const moe::ExpertWeights got = src.get(layer, e);
        const moe::ExpertWeights want = ref.get(layer, e);
        auto same = [](const WeightMatrix& a, const WeightMatrix& b) {
          return a.n_rows == b.n_rows && a.bytes.size() == b.bytes.size() &&
                 std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
        };
        if (!same(got.gate, want.gate) || !same(got.up, want.up) || !same(got.down, want.down))
          mismatches.fetch_add(1);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_GT(counter("moe.evictions") - ev0, 100u);
}

// Sessions on several threads share one streaming model (each with its own backend) while
// the readers load and evict: every thread's ids and logits equal the mapped run's.
TEST(ExpertStore, SessionsOnThreadsShareOneStore) {
  const std::string file = "qwen3moe-f16.gguf";
  const std::vector<int32_t> prompt = prompt_of(file, 24);
  auto be0 = make_cpu_backend({.threads = 1});
  const RunResult base = run(load(file), *be0, prompt, 6);
  auto m = load(file, {.cap = 2, .prefetch = true, .n_readers = 2});
  ASSERT_NE(m, nullptr);
  std::vector<RunResult> results(3);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < results.size(); ++t)
    threads.emplace_back([&, t] {
      auto be = make_cpu_backend({.threads = 1});
      results[t] = run(m, *be, prompt, 6);
    });
  for (std::thread& th : threads) th.join();
  for (const RunResult& r : results) {
    EXPECT_EQ(r.ids, base.ids);
    ASSERT_EQ(r.logits.size(), base.logits.size());
    EXPECT_EQ(std::memcmp(r.logits.data(), base.logits.data(), r.logits.size() * sizeof(float)), 0);
  }
}

// Skewed (Zipf-like) routing driven through the ExpertSource calls the forward pass makes
// (will_need, then get per expert): prefetch loads the popular experts of the next layer
// ahead, some later gets find them, and every view still holds the mapped bytes.
TEST(ExpertStore, PrefetchFollowsSkewedPopularity) {
  auto base = load("qwen3moe-f16.gguf");
  auto m = load("qwen3moe-f16.gguf", {.cap = 4, .prefetch = true});
  ASSERT_NE(m, nullptr);
  moe::ExpertSource& src = *m->weights().experts;
  moe::ExpertSource& ref = *base->weights().experts;
  const uint64_t pf0 = counter("moe.prefetch_hits"), issued0 = counter("moe.prefetch_issued");
  std::mt19937 rng(7);
  std::vector<double> w;
  for (int e = 0; e < src.n_expert(0); ++e) w.push_back(1.0 / (e + 1));  // Zipf, s = 1
  std::discrete_distribution<int32_t> zipf(w.begin(), w.end());
  int bad = 0;
  for (int tok = 0; tok < 60; ++tok) {
    for (int32_t l = 0; l < src.n_layer(); ++l) {
      int32_t sel[2] = {zipf(rng), zipf(rng)};
      while (sel[1] == sel[0]) sel[1] = zipf(rng);
      src.will_need(l, sel);
      std::vector<moe::ExpertWeights> held;
      for (int32_t e : sel) held.push_back(src.get(l, e));
      for (size_t i = 0; i < held.size(); ++i) {
        const moe::ExpertWeights want = ref.get(l, sel[i]);
        bad += std::memcmp(held[i].down.bytes.data(), want.down.bytes.data(),
                           want.down.bytes.size()) != 0;
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_GT(counter("moe.prefetch_issued") - issued0, 0u);
  EXPECT_GT(counter("moe.prefetch_hits") - pf0, 0u);
  std::printf("[ prefetch ] issued %llu, used %llu\n",
              (unsigned long long)(counter("moe.prefetch_issued") - issued0),
              (unsigned long long)(counter("moe.prefetch_hits") - pf0));
}

TEST(ExpertStore, ForcedPreadFallbackReportsIt) {
  auto m = load("mixtral-q4_k_m.gguf", {.cap = 2, .force_pread = true});
  ASSERT_NE(m, nullptr);
  const auto* st = dynamic_cast<const moe::ExpertStore*>(m->weights().experts.get());
  ASSERT_NE(st, nullptr);
  EXPECT_FALSE(st->uses_uring());
  EXPECT_NE(moe::format_store_stats().find("hit rate"), std::string::npos);
}

}  // namespace
}  // namespace kiln
