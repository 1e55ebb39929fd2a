// tests/e2e/embed_api_test.cpp: the public API (include/kiln/kiln.h) as a program embedding
// kiln uses it: examples/generate.cpp, built against the public header alone, generates the
// same greedy text as `kiln run`, renders a chat, and fails on bad input with one line.
#include <gtest/gtest.h>

#include <string>

#include "common/run_kiln.h"
#include "common/testdata.h"

namespace kiln {
namespace {

using testing::KilnProc;

std::string example() { return std::string(KILN_BINARY_DIR) + "/kiln_example_generate"; }

TEST(EmbedApi, ExampleGeneratesWhatKilnRunGenerates) {
  const std::string model = testing::model_path("stories260K.gguf");
  const KilnProc ex = testing::run_program(example(), {model, "Once upon a time", "24"});
  ASSERT_EQ(ex.rc, 0) << ex.err;
  const KilnProc run = testing::run_kiln(
      {"run", "-m", model, "--device", "cpu", "-p", "Once upon a time", "-n", "24", "--temp", "0"});
  ASSERT_EQ(run.rc, 0) << run.err;
  EXPECT_FALSE(ex.out.empty());
  EXPECT_EQ(ex.out, run.out);
  EXPECT_NE(ex.err.find("on cpu (llama)"), std::string::npos) << ex.err;
}

TEST(EmbedApi, ChatAndErrors) {
  // A chat (the shipped models carry no template: the plain transcript) generates.
  const std::string chat_model = testing::model_path("qwen3-bpe-q8_0.gguf");
  const KilnProc chat = testing::run_program(example(), {chat_model, "Hello", "4", "--chat"});
  EXPECT_EQ(chat.rc, 0) << chat.err;
  const KilnProc missing = testing::run_program(example(), {"/nonexistent.gguf", "x"});
  EXPECT_EQ(missing.rc, 1);
  EXPECT_NE(missing.err.find("/nonexistent.gguf"), std::string::npos) << missing.err;
  const KilnProc too_long =
      testing::run_program(example(), {testing::model_path("stories260K.gguf"), "x", "100000"});
  EXPECT_EQ(too_long.rc, 1);
  EXPECT_NE(too_long.err.find("exceed the context"), std::string::npos) << too_long.err;
}

}  // namespace
}  // namespace kiln
