// tests/engine/constrained_test.cpp: the constrained sampling step (engine/constrained.h)
// against its definition: for random logit rows along a JSON-schema output, Constraint::sample
// gives the id that the sampler gives from the row with the grammar's mask applied
// (Sampler::sample(logits, mask)), with the same RNG draws, for greedy, top-k, whole-row and
// penalised sampling, on a 512-token and a 32k-token vocabulary. Rows are drawn so that the
// row's best tokens are sometimes forbidden (the cheap path must fall back) and sometimes
// allowed (the cheap path answers).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <random>

#include "common/testdata.h"
#include "engine/constrained.h"
#include "format/gguf.h"
#include "grammar/json_schema.h"
#include "sampling/sampler.h"
#include "tokenizer/tokenizer.h"

namespace kiln {
namespace {

TEST(ConstrainedSampling, SameIdsAsTheMaskedRow) {
  auto gbnf = grammar::json_schema_to_gbnf(nlohmann::ordered_json::parse(R"({
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40},
                   "lines": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                   "rating": {"type": "integer"}},
    "required": ["title", "lines"]})"));
  ASSERT_TRUE(gbnf) << gbnf.error();
  auto g = grammar::Grammar::parse(*gbnf);
  ASSERT_TRUE(g) << g.error();
  std::vector<SamplerParams> params(6);
  params[0].temperature = 0;  // greedy: one candidate
  params[1].temperature = 0.8f;
  params[1].top_k = 40;
  params[1].top_p = 0.9f;
  params[1].min_p = 0.05f;
  params[2].temperature = 1.5f;
  params[2].top_k = 3;
  params[3].temperature = 1.0f;  // top-k off: the whole row
  params[3].top_k = 0;
  params[4].temperature = 0;  // greedy after penalties: the row's pick first
  params[4].repeat_penalty = 1.3f;
  params[5].temperature = 0.9f;  // top-k with a bias: the whole row
  params[5].top_k = 40;
  params[5].logit_bias = {{5, 3.0f}, {17, -100.0f}};
  for (const char* file : {"stories260K.gguf", "qwen3-bpe-q8_0.gguf"}) {
    auto gguf = GgufFile::open(testing::model_path(file));
    ASSERT_TRUE(gguf) << gguf.error();
    auto tok = Tokenizer::from_gguf(*gguf);
    ASSERT_TRUE(tok) << tok.error();
    const auto vocab = make_token_trie(*tok);
    const auto V = static_cast<size_t>(tok->n_vocab());
    for (size_t pi = 0; pi < params.size(); ++pi) {
      for (uint64_t seed = 1; seed <= 2; ++seed) {
        const std::string label =
            std::string(file) + " params " + std::to_string(pi) + " seed " + std::to_string(seed);
        SamplerParams sp = params[pi];
        sp.seed = seed;
        auto fast_sampler = Sampler::create(sp, tok->n_vocab());
        auto ref_sampler = Sampler::create(sp, tok->n_vocab());
        ASSERT_TRUE(fast_sampler && ref_sampler);
        Constraint fast{vocab, grammar::Matcher(*g), {}};
        Constraint ref{vocab, grammar::Matcher(*g), {}};
        std::mt19937_64 rng(seed * 1000 + pi);
        std::normal_distribution<float> normal(0.0f, 2.0f);
        // Rows are windows of one pool of draws (a fresh vocabulary of draws per step would
        // cost more than the test's subject).
        std::vector<float> pool(2 * V);
        for (float& x : pool) x = normal(rng);
        std::vector<float> row(V);
        int steps = 0;
        for (; steps < 250; ++steps) {
          const size_t at = rng() % V;
          std::copy(pool.begin() + ptrdiff_t(at), pool.begin() + ptrdiff_t(at + V), row.begin());
          // Now and then a few tokens far ahead of the rest: forbidden ones make the cheap
          // path fall back, allowed ones let it answer; ties at the top too.
          if (rng() % 3 == 0)
            for (int k = 0; k < 1 + int(rng() % 60); ++k) row[rng() % V] = 12.0f + float(rng() % 3);
          const int32_t want = [&] {
            std::vector<uint8_t> mask;
            if (ref.matcher.fill_mask(*vocab, mask) == 0) return -1;
            return ref_sampler->sample(row, mask);
          }();
          const int32_t got = fast.sample(*fast_sampler, row);
          ASSERT_EQ(got, want) << label << " step " << steps;
          if (got < 0) break;
          fast_sampler->accept(got);
          ref_sampler->accept(got);
          const bool done = fast.accept(got);
          EXPECT_EQ(ref.accept(got), done);
          if (done || vocab->is_eog(got)) break;
        }
        EXPECT_GT(steps, 5) << label;
      }
    }
  }
}

}  // namespace
}  // namespace kiln
