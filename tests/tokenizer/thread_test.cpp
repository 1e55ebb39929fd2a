// tests/tokenizer/thread_test.cpp: one Tokenizer shared by several threads gives each thread
// the same ids as a single-threaded run (encode/decode keep all mutable state per call).
#include <gtest/gtest.h>

#include <thread>

#include "common/testdata.h"
#include "format/gguf.h"
#include "tokenizer/tokenizer.h"

namespace kiln {
namespace {

TEST(TokenizerThreads, ConcurrentEncodeMatchesSerial) {
  for (const char* model : {"qwen3-bpe-f16.gguf", "stories260K.gguf"}) {
    auto g = GgufFile::open(testing::model_path(model));
    ASSERT_TRUE(g.has_value()) << g.error();
    auto tok = Tokenizer::from_gguf(*g);
    ASSERT_TRUE(tok.has_value()) << tok.error();
    const std::string text =
        testing::read_file(testing::shared_path("testdata/text/gpl-3-head.txt"));
    const auto want = tok->encode(text, true, false);
    std::vector<std::vector<int32_t>> got(3);
    std::vector<std::string> back(3);
    std::vector<std::thread> threads;
    for (size_t t = 0; t < got.size(); ++t)
      threads.emplace_back([&, t] {
        got[t] = tok->encode(text, true, false);
        back[t] = tok->decode(got[t], true);
      });
    for (auto& th : threads) th.join();
    for (size_t t = 0; t < got.size(); ++t) {
      EXPECT_EQ(got[t], want) << model << " thread " << t;
      EXPECT_EQ(back[t], text) << model << " thread " << t;
    }
  }
}

}  // namespace
}  // namespace kiln
