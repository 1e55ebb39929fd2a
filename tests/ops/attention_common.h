// tests/ops/attention_common.h: the random attention problem the attention tests (tests/ops
// against the reference and between CPU kernels, tests/cuda against the reference) share: keys
// at consecutive positions in a wrapped ring of f16 rows, queries at the last positions.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/half.h"
#include "ops_common.h"

namespace kiln::testing {

// The arrays and the AttentionArgs viewing them (out unset). Not copyable: args points into
// the vectors (a move keeps their buffers).
struct AttnProblem {
  std::vector<int32_t> kv_rows, kv_pos, q_pos;
  std::vector<f16> k, v;
  std::vector<float> q;
  AttentionArgs args;

  AttnProblem() = default;
  AttnProblem(const AttnProblem&) = delete;
  AttnProblem& operator=(const AttnProblem&) = delete;
  AttnProblem(AttnProblem&&) = default;
};

// n_kv keys at consecutive positions from a random base, logical key j at physical row
// (j + origin) % n_phys (a ring, origin random); the queries at the last n_q positions (the
// prefill of a suffix, or a verify batch), the first moved before every key (a query that sees
// nothing) when n_q >= blind_min_q; K/V normal in f16, Q normal with q_scale.
inline AttnProblem random_attention(std::mt19937_64& rng, int64_t n_head, int64_t n_head_kv,
                                    int64_t head_dim, int64_t n_q, int64_t n_kv, int64_t n_phys,
                                    int32_t window, float softcap, float q_scale,
                                    int64_t blind_min_q) {
  AttnProblem p;
  const int64_t kv_w = n_head_kv * head_dim, q_w = n_head * head_dim;
  const int32_t origin = static_cast<int32_t>(rng() % n_phys);
  const int32_t base_pos = static_cast<int32_t>(rng() % 1000);
  p.kv_rows.resize(n_kv);
  p.kv_pos.resize(n_kv);
  p.q_pos.resize(n_q);
  for (int64_t j = 0; j < n_kv; ++j) {
    p.kv_rows[j] = static_cast<int32_t>((j + origin) % n_phys);
    p.kv_pos[j] = base_pos + static_cast<int32_t>(j);
  }
  for (int64_t i = 0; i < n_q; ++i) p.q_pos[i] = base_pos + static_cast<int32_t>(n_kv - n_q + i);
  if (n_q >= blind_min_q) p.q_pos[0] = base_pos - 1;
  p.k.resize(n_phys * kv_w);
  p.v.resize(n_phys * kv_w);
  const std::vector<float> kf = random_vec(rng, p.k.size(), 1.0f),
                           vf = random_vec(rng, p.v.size(), 1.0f);
  for (size_t i = 0; i < p.k.size(); ++i) {
    p.k[i] = f32_to_f16(kf[i]);
    p.v[i] = f32_to_f16(vf[i]);
  }
  p.q = random_vec(rng, n_q * q_w, q_scale);
  AttentionArgs& a = p.args;
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.kv_rows = p.kv_rows;
  a.kv_pos = p.kv_pos;
  a.q_pos = p.q_pos;
  a.n_q = n_q;
  a.n_head = n_head;
  a.n_head_kv = n_head_kv;
  a.head_dim = head_dim;
  a.window = window;
  a.scale = 1.0f / std::sqrt(float(head_dim));
  a.softcap = softcap;
  return p;
}

}  // namespace kiln::testing
