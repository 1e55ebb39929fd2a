// tests/engine/engine_test_util.h: helpers shared by the engine tests (scheduler, batched
// decode): loading a shared model and making a reproducible random prompt.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/testdata.h"
#include "engine/session.h"

namespace kiln::enginetest {

inline std::shared_ptr<const Model> load(const std::string& file) {
  auto m = Model::load(testing::model_path(file));
  EXPECT_TRUE(m.has_value()) << m.error();
  return m ? *m : nullptr;
}

// BOS then n - 1 ids drawn from [2, n_vocab) by a seeded generator.
inline std::vector<int32_t> random_prompt(int32_t n, int32_t n_vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids{1};  // BOS
  while (static_cast<int32_t>(ids.size()) < n)
    ids.push_back(static_cast<int32_t>(2 + rng() % static_cast<uint32_t>(n_vocab - 2)));
  return ids;
}

// All-position logits of `prompt` evaluated in pieces of `chunk` tokens by a fresh session of
// n_ctx positions (chunk invariance and decode-vs-prefill identity tests compare these).
inline std::vector<float> logits_chunked(const std::shared_ptr<const Model>& m, Backend& be,
                                         std::span<const int32_t> prompt, int32_t chunk,
                                         int32_t n_ctx) {
  Session s(m, be, n_ctx, chunk);
  std::vector<float> out;
  for (size_t i = 0; i < prompt.size(); i += static_cast<size_t>(chunk)) {
    const size_t n = std::min(prompt.size() - i, static_cast<size_t>(chunk));
    auto l = s.eval(prompt.subspan(i, n), true);
    EXPECT_TRUE(l.has_value()) << l.error();
    if (!l) return {};
    out.insert(out.end(), l->begin(), l->end());
  }
  return out;
}

}  // namespace kiln::enginetest
