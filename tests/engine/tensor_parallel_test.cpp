// tests/engine/tensor_parallel_test.cpp: tensor parallelism on host groups (backend/tp_group.h)
// where no GPU is needed: the shards are views of the right slices, sessions and batched
// steps on 2 and 4 ranks agree with one backend, rollback and chunked prefill stay in step on
// every rank, and what cannot split is refused with an error naming it. Golden agreement on
// groups: tests/golden (CpuTp2/CpuTp4). Labelled threads: the ranks run on threads of their
// own and meet in the shared-memory all-reduce, which TSan checks here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/tp_group.h"
#include "engine_test_util.h"
#include "kv/kv_cache.h"
#include "model/tensor_parallel.h"
#include "quant/quant.h"

namespace kiln {
namespace {

using enginetest::load;
using enginetest::random_prompt;

std::unique_ptr<Backend> cpu_group(int n) {
  std::vector<std::unique_ptr<Backend>> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(make_cpu_backend({.threads = 1}));
  return make_host_tp_group(std::move(ranks));
}

std::vector<float> dequant(const WeightMatrix& w, int64_t row) {
  std::vector<float> out(static_cast<size_t>(w.n_cols));
  quant::dequantize_row(w.dtype, w.row(row), out);
  return out;
}

// Row-parallel shards are strided column blocks of the mapping: rank 0's row i followed by
// rank 1's is the whole row i; column-parallel shards are blocks of whole rows.
TEST(TensorParallel, ShardsAreSlicesOfTheMapping) {
  for (const char* file : {"llama-gqa-q8_0.gguf", "stories260K.gguf"}) {
    auto m = load(file);
    ASSERT_TRUE(m);
    const model::LayerWeights& full = m->weights().layers[0];
    auto s0 = model::shard_model(m->hparams(), m->weights(), 0, 2);
    auto s1 = model::shard_model(m->hparams(), m->weights(), 1, 2);
    ASSERT_TRUE(s0.has_value() && s1.has_value());
    EXPECT_EQ(s0->hp.n_head * 2, m->hparams().n_head);
    EXPECT_EQ(s1->hp.n_head_kv * 2, m->hparams().n_head_kv);
    EXPECT_EQ(s1->hp.tp_rank, 1);
    const WeightMatrix& wo0 = s0->w.layers[0].wo;
    const WeightMatrix& wo1 = s1->w.layers[0].wo;
    EXPECT_TRUE(wo0.strided());
    EXPECT_EQ(wo0.n_cols + wo1.n_cols, full.wo.n_cols);
    for (int64_t r : {int64_t(0), full.wo.n_rows / 2, full.wo.n_rows - 1}) {
      std::vector<float> joined = dequant(wo0, r);
      const std::vector<float> b = dequant(wo1, r);
      joined.insert(joined.end(), b.begin(), b.end());
      EXPECT_EQ(joined, dequant(full.wo, r)) << file << " attn_output row " << r;
    }
    const WeightMatrix& q1 = s1->w.layers[0].wq;
    EXPECT_FALSE(q1.strided());
    EXPECT_EQ(q1.n_rows * 2, full.wq.n_rows);
    EXPECT_EQ(q1.row(0).data(), full.wq.row(full.wq.n_rows / 2).data()) << "a view, not a copy";
    const WeightMatrix& d1 = s1->w.layers[0].ffn_down;
    EXPECT_EQ(d1.n_cols * 2, full.ffn_down.n_cols);
  }
}

TEST(TensorParallel, RefusesWhatDoesNotSplit) {
  auto gqa = load("llama-gqa-q8_0.gguf");  // 4 query heads, 2 KV heads
  ASSERT_TRUE(gqa);
  const Status three = check_tensor_parallel(*gqa, 4);
  EXPECT_FALSE(three.is_ok());
  EXPECT_NE(three.message().find("KV heads do not split"), std::string::npos) << three.message();
  auto kq = load("llama-gqa-q4_k_m.gguf");  // 128-column halves of 256-element blocks
  ASSERT_TRUE(kq);
  const Status blocks = check_tensor_parallel(*kq, 2);
  EXPECT_FALSE(blocks.is_ok());
  EXPECT_NE(blocks.message().find("attn_output"), std::string::npos) << blocks.message();
  EXPECT_NE(blocks.message().find("blocks of 256"), std::string::npos) << blocks.message();
  EXPECT_TRUE(check_tensor_parallel(*gqa, 2).is_ok());
  EXPECT_TRUE(check_tensor_parallel(*kq, 1).is_ok());
}

double max_abs_diff(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    d = std::max(d, std::fabs(double(a[i]) - double(b[i])));
  return d;
}

// A prefill in several chunks (max_batch 16), decode steps, a rollback and a re-decode: the
// group's logits stay within float summation-order noise of one backend's at every step
// (the f16 KV planes round the reordered sums, so a few 1e-3 remain; a wrong shard is off
// by whole logits).
constexpr double kTol = 1e-2;
TEST(TensorParallel, SessionMatchesOneBackend) {
  for (const char* file :
       {"stories260K.gguf", "qwen3moe-f16.gguf", "gemma3-swa-f16.gguf", "deepseek2-mla-f16.gguf"}) {
    auto m = load(file);
    ASSERT_TRUE(m);
    auto one = make_cpu_backend({.threads = 1});
    for (int n : {2, 4}) {
      if (!check_tensor_parallel(*m, n).is_ok()) continue;  // 4 ranks: stories260K only
      auto group = cpu_group(n);
      Session a(m, *one, 256, 16), b(m, *group, 256, 16);
      EXPECT_EQ(b.tp_size(), n);
      const std::vector<int32_t> prompt = random_prompt(40, m->n_vocab(), 3);
      auto la = a.eval(prompt, true);
      ASSERT_TRUE(la.has_value()) << la.error();
      const std::vector<float> first(la->begin(), la->end());
      auto lb = b.eval(prompt, true);
      ASSERT_TRUE(lb.has_value()) << lb.error();
      EXPECT_LT(max_abs_diff(first, *lb), kTol) << file << " prefill, " << n << " ranks";
      std::vector<float> step_a;
      for (int t = 0; t < 5; ++t) {
        const int32_t tok = 2 + t * 7;
        auto sa = a.eval(std::span<const int32_t>(&tok, 1), false);
        auto sb = b.eval(std::span<const int32_t>(&tok, 1), false);
        ASSERT_TRUE(sa.has_value() && sb.has_value());
        EXPECT_LT(max_abs_diff(*sa, *sb), kTol) << file << " decode " << t << ", " << n;
        if (t == 0) step_a.assign(sb->begin(), sb->end());
      }
      // Back to the end of the prompt on every rank: the first decode step repeats exactly
      // (host groups sum in rank order, so the group is deterministic).
      ASSERT_TRUE(b.rollback(40).is_ok());
      const int32_t tok = 2;
      auto again = b.eval(std::span<const int32_t>(&tok, 1), false);
      ASSERT_TRUE(again.has_value());
      EXPECT_EQ(0, std::memcmp(again->data(), step_a.data(), step_a.size() * sizeof(float)))
          << file << ": rollback on " << n << " ranks";
      EXPECT_GT(b.kv_bytes(), 0u);
    }
  }
}

// Batched decode across sessions on a group: each session's row is bit-identical to its own
// step on the same group (cpu kernels are token-invariant; the all-reduce sums per element).
TEST(TensorParallel, BatchEvalMatchesSessionsOnTheGroup) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto group = cpu_group(2);
  Session s1(m, *group, 128), s2(m, *group, 128), r1(m, *group, 128), r2(m, *group, 128);
  const auto p1 = random_prompt(12, m->n_vocab(), 5), p2 = random_prompt(7, m->n_vocab(), 6);
  for (Session* s : {&s1, &r1}) ASSERT_TRUE(s->eval(p1, false).has_value());
  for (Session* s : {&s2, &r2}) ASSERT_TRUE(s->eval(p2, false).has_value());
  BatchEval be(m, *group, 8);
  for (int step = 0; step < 3; ++step) {
    const int32_t t1 = 5 + step, t2 = 9 + step;
    const BatchEval::Item items[] = {{&s1, std::span<const int32_t>(&t1, 1), false},
                                     {&s2, std::span<const int32_t>(&t2, 1), false}};
    auto rows = be.eval(items);
    ASSERT_TRUE(rows.has_value()) << rows.error();
    const size_t V = static_cast<size_t>(m->n_vocab());
    const std::vector<float> both(rows->begin(), rows->end());
    auto a = r1.eval(std::span<const int32_t>(&t1, 1), false);
    ASSERT_TRUE(a.has_value());
    EXPECT_EQ(0, std::memcmp(both.data(), a->data(), V * sizeof(float))) << "step " << step;
    auto b = r2.eval(std::span<const int32_t>(&t2, 1), false);
    ASSERT_TRUE(b.has_value());
    EXPECT_EQ(0, std::memcmp(both.data() + V, b->data(), V * sizeof(float))) << "step " << step;
  }
  // A session of a plain backend cannot join the group's batch.
  auto one = make_cpu_backend({.threads = 1});
  Session plain(m, *one, 64);
  ASSERT_TRUE(plain.eval(p1, false).has_value());
  const int32_t t = 3;
  const BatchEval::Item mixed[] = {{&plain, std::span<const int32_t>(&t, 1), false}};
  auto bad = be.eval(mixed);
  EXPECT_FALSE(bad.has_value());
}

TEST(TensorParallel, KvInstallIsRefusedOnAGroup) {
  auto m = load("stories260K.gguf");
  ASSERT_TRUE(m);
  auto group = cpu_group(2);
  Session s(m, *group, 64);
  KvConfig cfg;
  cfg.n_ctx = 64;
  cfg.max_batch = 64;
  for (int l = 0; l < m->hparams().n_layer; ++l)
    cfg.layers.push_back({.width = m->hparams().k_width(), .window = 0});
  auto kv = KvCache::create(cfg);
  ASSERT_TRUE(kv.has_value());
  const Status st = s.install_kv(std::move(*kv));
  EXPECT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("tensor-parallel"), std::string::npos) << st.message();
}

// The group's all-reduce: every rank ends with the same sum, in rank order, call after call.
TEST(TensorParallel, HostAllReduceSumsEveryRank) {
  for (int n : {1, 2, 3, 4}) {
    std::vector<std::unique_ptr<Backend>> ranks;
    for (int r = 0; r < n; ++r) ranks.push_back(make_ref_backend());
    auto g = make_host_tp_group(std::move(ranks));
    ASSERT_EQ(g->tp_size(), n);
    std::vector<std::vector<float>> bufs(static_cast<size_t>(n), std::vector<float>(1001));
    for (int round = 0; round < 50; ++round) {
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < 1001; ++i) bufs[r][i] = float(r + 1) * float(i) + float(round);
      g->tp_run([&](int r) { g->tp_rank(r).all_reduce_sum(bufs[static_cast<size_t>(r)]); });
      const float tri = float(n * (n + 1) / 2);
      for (int r = 0; r < n; ++r)
        for (size_t i : {size_t(0), size_t(500), size_t(1000)})
          ASSERT_EQ(bufs[r][i], tri * float(i) + float(n * round)) << n << " ranks, rank " << r;
    }
  }
}

}  // namespace
}  // namespace kiln
