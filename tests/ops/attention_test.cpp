// tests/ops/attention_test.cpp: cpu attention against the reference on ring-shaped KV
// planes (physical rows out of logical order), GQA ratios 1/2/4, decode (1 query) and
// prefill (many), sliding window, softcap, and queries that see no key at all; and the
// grouped narrow-head and multi-pair wide-head kernels' bits against the per-pair kernel's.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "attention_common.h"
#include "backend/cpu/kernels.h"
#include "hwy/targets.h"
#include "ops_common.h"

namespace kiln {
namespace {

using kiln::testing::AttnProblem;
using kiln::testing::close;
using kiln::testing::ops_seed;
using kiln::testing::random_attention;
using kiln::testing::random_vec;

struct AttnCase {
  int64_t n_head, n_head_kv, head_dim, n_q, n_kv;
  int32_t window;
  float softcap;
  bool sinks = false;  // gpt-oss's attention sinks, one random logit per head
};

void run_case(const AttnCase& c, Backend& ref, Backend& cpu, std::mt19937_64& rng) {
  SCOPED_TRACE(::testing::Message()
               << "heads " << c.n_head << "/" << c.n_head_kv << " hd " << c.head_dim << " n_q "
               << c.n_q << " n_kv " << c.n_kv << " window " << c.window << " softcap " << c.softcap
               << " seed " << ops_seed());
  const int64_t q_w = c.n_head * c.head_dim;
  // A ring of n_kv + 3 rows; with more than two queries the first sees no key.
  AttnProblem p = random_attention(rng, c.n_head, c.n_head_kv, c.head_dim, c.n_q, c.n_kv,
                                   c.n_kv + 3, c.window, c.softcap, 2.0f, 3);
  const std::vector<float>& q = p.q;
  std::vector<float> out_ref(q.size(), NAN), out_cpu(q.size(), NAN);
  AttentionArgs& a = p.args;
  // Sinks from far below to far above the logits (|logit| is a few units here), so both of
  // the kernel's finishes (the sink below and above the running max) are taken.
  const std::vector<float> sinks = random_vec(rng, c.n_head, 6.0f);
  if (c.sinks) a.sinks = sinks;
  a.out = out_ref;
  ref.attention(a);
  a.out = out_cpu;
  cpu.attention(a);
  // Outputs are convex combinations of V rows (|v| <= ~5): f32 online softmax vs double.
  for (size_t i = 0; i < q.size(); ++i)
    ASSERT_TRUE(close(out_cpu[i], out_ref[i], 2e-5 * (1 + std::fabs(out_ref[i])))) << "elem " << i;
  if (c.n_q > 2) {  // the query before every key: zeros
    for (int64_t d = 0; d < q_w; ++d) ASSERT_EQ(out_cpu[d], 0.0f);
  }
}
// Every step-th query of a batch attended alone has the batch's bits for it (out: the batch's
// output); with more than one query the first, which sees no key of the verify-style batches
// random_attention builds, is all zeros.
void expect_each_query_alone_equal(Backend& be, const AttentionArgs& a, const std::vector<float>& q,
                                   const std::vector<int32_t>& q_pos, int64_t n_q, int64_t q_w,
                                   const std::vector<float>& out, int64_t parts) {
  for (int64_t i = 0; i < n_q; i += std::max<int64_t>(1, n_q / parts)) {
    std::vector<float> alone(static_cast<size_t>(q_w), NAN);
    AttentionArgs b = a;
    b.q = std::span<const float>(q).subspan(static_cast<size_t>(i * q_w), static_cast<size_t>(q_w));
    b.q_pos = std::span<const int32_t>(q_pos).subspan(static_cast<size_t>(i), 1);
    b.n_q = 1;
    b.out = alone;
    be.attention(b);
    ASSERT_EQ(0, std::memcmp(alone.data(), out.data() + i * q_w,
                             static_cast<size_t>(q_w) * sizeof(float)))
        << "query " << i << " alone differs from the batch of " << n_q;
  }
  if (n_q > 1) {
    for (int64_t d = 0; d < q_w; ++d) ASSERT_EQ(out[static_cast<size_t>(d)], 0.0f);
  }
}

TEST(AttentionVsRef, Configurations) {
  std::mt19937_64 rng(ops_seed());
  auto ref = make_ref_backend();
  auto cpu1 = make_cpu_backend({.threads = 1});
  auto cpu3 = make_cpu_backend({.threads = 3});
  for (int64_t ratio : {1, 2, 4}) {
    for (int64_t n_q : {1, 7}) {
      for (int32_t window : {0, 5}) {
        for (float softcap : {0.0f, 30.0f}) {
          const AttnCase c{4, 4 / ratio, 64, n_q, 150, window, softcap};
          run_case(c, *ref, *cpu1, rng);
          run_case(c, *ref, *cpu3, rng);
        }
      }
    }
  }
  // Odd head_dim (scalar tails), a single key, and a long prefill crossing many key blocks.
  run_case({2, 1, 37, 3, 1, 0, 0}, *ref, *cpu3, rng);
  run_case({3, 3, 37, 5, 9, 4, 20}, *ref, *cpu3, rng);
  run_case({8, 2, 128, 33, 300, 0, 0}, *ref, *cpu3, rng);
}

// Attention sinks (gpt-oss): one extra logit per head in the softmax's max and denominator,
// on every head layout and window; each CPU output against the reference's.
TEST(AttentionVsRef, Sinks) {
  std::mt19937_64 rng(ops_seed() ^ 0x51c5);
  auto ref = make_ref_backend();
  auto cpu1 = make_cpu_backend({.threads = 1});
  auto cpu3 = make_cpu_backend({.threads = 3});
  for (int64_t ratio : {1, 2, 4})
    for (int64_t n_q : {1, 7})
      for (int32_t window : {0, 8}) {
        const AttnCase c{4, 4 / ratio, 64, n_q, 150, window, 0.0f, true};
        run_case(c, *ref, *cpu1, rng);
        run_case(c, *ref, *cpu3, rng);
      }
  run_case({3, 1, 37, 5, 9, 4, 0, true}, *ref, *cpu3, rng);
  run_case({2, 1, 8, 3, 1, 0, 0, true}, *ref, *cpu1, rng);
}

// The grouped kernel (heads narrower than a vector: several (query, head) pairs of one KV
// head in the lanes) must give the per-pair kernel's bits, which the portable backend
// (CpuOptions::portable_kernels) runs, so this is also the proof that it changes nothing but
// speed. Fresh random inputs every run; head_dim 1..15 (on a target of
// 16 float lanes all grouped; where vectors are narrower the widths at or above the lane count
// take the per-pair kernel both ways), GQA groups 1..16, 1..37 queries (partial runs of
// queries per task, a speculative verify's 2..9), key counts across key blocks, ring rows,
// sliding window, softcap, 1 and 2 threads. Also each query's output is the same bits whether
// it is evaluated with the others or alone (docs/determinism.md's token invariance).
TEST(AttentionGrouped, SameBitsAsPerPairKernel) {
  std::mt19937_64 rng(ops_seed() ^ 0x51ed270bULL);
  SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target() << " seed " << ops_seed());
  auto cpu1 = make_cpu_backend({.threads = 1}), cpu2 = make_cpu_backend({.threads = 2});
  auto portable1 = make_cpu_backend({.threads = 1, .portable_kernels = true});
  int grouped_cases = 0;
  for (int64_t hd : {1, 3, 4, 7, 8, 12, 15}) {
    for (int64_t group : {1, 2, 3, 4, 8, 16}) {
      for (int64_t n_q : {1, 2, 5, 9, 17, 37}) {
        const int64_t n_head_kv = 1 + static_cast<int64_t>(rng() % 3);
        const int64_t n_head = n_head_kv * group;
        const int64_t n_kv = n_q + static_cast<int64_t>(rng() % 200);
        const int32_t window = rng() % 3 == 0 ? 1 + static_cast<int32_t>(rng() % 40) : 0;
        const float softcap = rng() % 4 == 0 ? 20.0f : 0.0f;
        SCOPED_TRACE(::testing::Message()
                     << "hd " << hd << " heads " << n_head << "/" << n_head_kv << " n_q " << n_q
                     << " n_kv " << n_kv << " window " << window << " softcap " << softcap);
        if (cpu::attention_group_tokens(hd, group, /*portable=*/false) > 0) ++grouped_cases;
        const int64_t q_w = n_head * hd;
        // A verify batch attends over its own rows causally; with more than one query the
        // first sees nothing. Large enough logits that the running max grows inside and across
        // key blocks.
        AttnProblem p = random_attention(rng, n_head, n_head_kv, hd, n_q, n_kv, n_kv + 5, window,
                                         softcap, 3.0f, 2);
        const std::vector<float>& q = p.q;
        const std::vector<int32_t>& q_pos = p.q_pos;
        AttentionArgs& a = p.args;
        std::vector<float> on1(q.size(), NAN), on2(q.size(), NAN), off1(q.size(), NAN);
        a.out = on1;
        cpu1->attention(a);
        a.out = on2;
        cpu2->attention(a);
        a.out = off1;
        portable1->attention(a);
        ASSERT_EQ(0, std::memcmp(on1.data(), off1.data(), on1.size() * sizeof(float)))
            << "grouped vs per-pair kernel differ";
        ASSERT_EQ(0, std::memcmp(on1.data(), on2.data(), on1.size() * sizeof(float)))
            << "grouped kernel: 1 vs 2 threads differ";
        expect_each_query_alone_equal(*cpu1, a, q, q_pos, n_q, q_w, on1, 4);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
  // The grouped path must actually have run here (every x86 target has >= 4 float lanes).
  EXPECT_GT(grouped_cases, 0);
}

// The multi-pair kernel (heads a whole number of vectors wide: up to 4 (query, head) pairs of one
// KV head per task sharing K/V rows) must give the per-pair kernel's bits, which the portable
// backend runs, so this is also the proof that it changes nothing but speed. Head widths 8..128 (on
// AVX-512 1, 2, 3 (no multi: the per-pair kernel both ways), 4 and 8 vectors, 8 the grouped
// kernel's); GQA ratios 1/2/3/4/8 (runs of pairs crossing queries, a short last run, a KV head's
// heads split over two tasks); 1..40 queries and ~300 (many key blocks, the diagonal inside a
// block); sliding window; softcap; 1 and 2 threads; each query alone the same bits as in the batch.
// `light`: every third query count, for the other SIMD targets.
void check_attention_multi(std::mt19937_64& rng, bool light) {
  auto cpu1 = make_cpu_backend({.threads = 1}), cpu2 = make_cpu_backend({.threads = 2});
  auto portable1 = make_cpu_backend({.threads = 1, .portable_kernels = true});
  auto portable2 = make_cpu_backend({.threads = 2, .portable_kernels = true});
  int multi_cases = 0;
  std::vector<int64_t> q_counts;
  for (int64_t n = 1; n <= 40; n += light ? 3 : 1) q_counts.push_back(n);
  q_counts.push_back(297);
  int64_t iter = 0;
  for (int64_t n_q : q_counts) {
    for (int64_t ratio : {1, 2, 3, 4, 8}) {
      ++iter;
      // Cycle the widths and options over the query counts so every count meets each ratio.
      const int64_t widths[] = {16, 32, 48, 64, 128, 8};
      const int64_t hd = widths[(iter + n_q) % 6];
      const int64_t n_head_kv = 1 + static_cast<int64_t>(rng() % 3);
      const int64_t n_head = n_head_kv * ratio;
      const int64_t n_kv = n_q + static_cast<int64_t>(rng() % 150);
      const int32_t window = rng() % 3 == 0 ? 1 + static_cast<int32_t>(rng() % 90) : 0;
      const float softcap = rng() % 4 == 0 ? 20.0f : 0.0f;
      SCOPED_TRACE(::testing::Message()
                   << "hd " << hd << " heads " << n_head << "/" << n_head_kv << " n_q " << n_q
                   << " n_kv " << n_kv << " window " << window << " softcap " << softcap);
      if (cpu::attention_multi_pairs(hd, /*portable=*/false) > 0) ++multi_cases;
      const int64_t q_w = n_head * hd;
      AttnProblem p = random_attention(rng, n_head, n_head_kv, hd, n_q, n_kv, n_kv + 7, window,
                                       softcap, 3.0f, 2);
      const std::vector<float>& q = p.q;
      const std::vector<int32_t>& q_pos = p.q_pos;
      AttentionArgs& a = p.args;
      // gpt-oss's sinks on every other case: around the logits' range, so some heads' sink is
      // above their running max at the finish and some below.
      std::vector<float> sinks;
      if (iter % 2 == 0) {
        std::uniform_real_distribution<float> sd(-4.0f, 8.0f);
        for (int64_t h = 0; h < n_head; ++h) sinks.push_back(sd(rng));
        a.sinks = sinks;
      }
      std::vector<float> on1(q.size(), NAN), on2(q.size(), NAN), off1(q.size(), NAN),
          off2(q.size(), NAN);
      a.out = on1;
      cpu1->attention(a);
      a.out = on2;
      cpu2->attention(a);
      a.out = off1;
      portable1->attention(a);
      a.out = off2;
      portable2->attention(a);
      ASSERT_EQ(0, std::memcmp(on1.data(), off1.data(), on1.size() * sizeof(float)))
          << "multi-pair vs per-pair kernel differ";
      ASSERT_EQ(0, std::memcmp(on2.data(), off2.data(), on1.size() * sizeof(float)))
          << "multi-pair vs per-pair kernel differ, 2 threads";
      ASSERT_EQ(0, std::memcmp(on1.data(), on2.data(), on1.size() * sizeof(float)))
          << "multi-pair kernel: 1 vs 2 threads differ";
      expect_each_query_alone_equal(*cpu2, a, q, q_pos, n_q, q_w, on1, 3);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  // The multi-pair path must actually have run (8 floats are 1, 2 or 8 vectors on every target).
  EXPECT_GT(multi_cases, 0);
}

TEST(AttentionMulti, SameBitsAsPerPairKernel) {
  std::mt19937_64 rng(ops_seed() ^ 0x3a7c11e5ULL);
  SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target() << " seed " << ops_seed());
  check_attention_multi(rng, false);
}

// The same on every other SIMD target this machine can run: each has its own vector width, so
// its own chunks per head and pairs per task (and no SumOfLanes16 below 512 bits).
TEST(AttentionMulti, SameBitsOnEveryTarget) {
  std::mt19937_64 rng(ops_seed() ^ 0x6b5d2c41ULL);
  kiln::testing::for_each_simd_target([&] {
    SCOPED_TRACE(::testing::Message() << "simd " << cpu_simd_target() << " seed " << ops_seed());
    check_attention_multi(rng, true);
  });
}

}  // namespace
}  // namespace kiln
