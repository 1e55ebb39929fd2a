// tests/cuda/cuda_attention_test.cpp: CUDA attention against the reference on ring-shaped KV
// planes (physical rows out of logical order), GQA ratios 1/2/4/8, head sizes 64..256,
// decode (1 query, long contexts that split the keys over many blocks) and prefill (many
// queries), sliding windows, softcaps, and queries that see no key at all.
#include <gtest/gtest.h>

#include <cmath>

#include "core/half.h"
#include "cuda_test_common.h"
#include "ops/ops_common.h"

namespace kiln {
namespace {

using kiln::testing::close;
using kiln::testing::cuda_under_test;
using kiln::testing::ops_seed;
using kiln::testing::random_vec;

struct AttnCase {
  int64_t n_head, n_head_kv, head_dim, n_q, n_kv;
  int32_t window;
  float softcap;
};

void run_case(const AttnCase& c, std::mt19937_64& rng) {
  SCOPED_TRACE(::testing::Message()
               << "heads " << c.n_head << "/" << c.n_head_kv << " hd " << c.head_dim << " n_q "
               << c.n_q << " n_kv " << c.n_kv << " window " << c.window << " softcap " << c.softcap
               << " seed " << ops_seed());
  const int64_t kv_w = c.n_head_kv * c.head_dim, q_w = c.n_head * c.head_dim;
  const int64_t n_phys = c.n_kv + 3;
  // A ring: logical key j lives at physical row (j + origin) % n_phys.
  const int32_t origin = static_cast<int32_t>(rng() % n_phys);
  const int32_t base_pos = static_cast<int32_t>(rng() % 1000);
  std::vector<int32_t> kv_rows(c.n_kv), kv_pos(c.n_kv), q_pos(c.n_q);
  for (int64_t j = 0; j < c.n_kv; ++j) {
    kv_rows[j] = static_cast<int32_t>((j + origin) % n_phys);
    kv_pos[j] = base_pos + static_cast<int32_t>(j);
  }
  // The last n_q positions (prefill of a suffix); with room, the first query sees nothing.
  for (int64_t i = 0; i < c.n_q; ++i)
    q_pos[i] = base_pos + static_cast<int32_t>(c.n_kv - c.n_q + i);
  if (c.n_q > 2) q_pos[0] = base_pos - 1;
  std::vector<f16> k(n_phys * kv_w), v(n_phys * kv_w);
  const std::vector<float> kf = random_vec(rng, k.size(), 1.0f),
                           vf = random_vec(rng, v.size(), 1.0f);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = f32_to_f16(kf[i]);
    v[i] = f32_to_f16(vf[i]);
  }
  const std::vector<float> q = random_vec(rng, c.n_q * q_w, 2.0f);
  std::vector<float> out_ref(q.size(), NAN), out_gpu(q.size(), NAN);
  AttentionArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  a.kv_rows = kv_rows;
  a.kv_pos = kv_pos;
  a.q_pos = q_pos;
  a.n_q = c.n_q;
  a.n_head = c.n_head;
  a.n_head_kv = c.n_head_kv;
  a.head_dim = c.head_dim;
  a.window = c.window;
  a.scale = 1.0f / std::sqrt(float(c.head_dim));
  a.softcap = c.softcap;
  a.out = out_ref;
  cuda_under_test().ref->attention(a);
  a.out = out_gpu;
  cuda_under_test().cuda->attention(a);
  // Outputs are convex combinations of V rows (|v| <= ~5): f32 online softmax (expf, merged
  // splits) vs double.
  for (size_t i = 0; i < q.size(); ++i)
    ASSERT_TRUE(close(out_gpu[i], out_ref[i], 2e-5 * (1 + std::fabs(out_ref[i])))) << "elem " << i;
  if (c.n_q > 2) {  // the query before every key: zeros
    for (int64_t d = 0; d < q_w; ++d) ASSERT_EQ(out_gpu[d], 0.0f);
  }
}

TEST(CudaAttention, Configurations) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  const AttnCase cases[] = {
      {1, 1, 64, 1, 1, 0, 0},          {4, 4, 64, 1, 37, 0, 0},     {8, 2, 64, 1, 129, 0, 0},
      {8, 1, 128, 1, 3000, 0, 0},      {32, 8, 128, 1, 4097, 0, 0}, {8, 2, 80, 7, 50, 0, 0},
      {4, 4, 96, 33, 33, 0, 0},        {16, 4, 128, 70, 300, 0, 0}, {8, 4, 256, 5, 200, 0, 0},
      {4, 2, 64, 9, 200, 16, 0},       {4, 2, 64, 1, 2000, 100, 0}, {8, 2, 128, 6, 300, 0, 30.0f},
      {8, 8, 256, 17, 700, 64, 50.0f}, {2, 1, 48, 3, 10, 0, 0},     {8, 8, 32, 1, 70000, 0, 0},
  };
  for (const AttnCase& c : cases) run_case(c, rng);
}

TEST(CudaAttention, NoKeysGivesZeros) {
  KILN_REQUIRE_CUDA();
  std::vector<float> q(2 * 64, 1.0f), out(q.size(), NAN);
  std::vector<f16> k(64), v(64);
  AttentionArgs a;
  a.q = q;
  a.k = k;
  a.v = v;
  std::vector<int32_t> q_pos = {0, 5};
  a.q_pos = q_pos;
  a.n_q = 2;
  a.n_head = 1;
  a.n_head_kv = 1;
  a.head_dim = 64;
  a.out = out;
  cuda_under_test().cuda->attention(a);  // n_kv = 0
  for (float x : out) ASSERT_EQ(x, 0.0f);
}

}  // namespace
}  // namespace kiln
