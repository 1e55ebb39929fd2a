// tests/golden/logits_cmd_test.cpp: `kiln logits` end to end: the binary tokenizes the golden
// prompt file itself, so its prompt_tokens must equal llama.cpp's and its greedy ids must
// follow llama.cpp's up to the first near-tie. Also its bad-input exits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "common/testdata.h"
#include "golden.h"

namespace kiln {
namespace {

struct RunResult {
  int status = -1;
  std::string out;
};

RunResult run(const std::string& args) {
  const std::string cmd = testing::kiln_binary() + " " + args + " 2>&1";
  RunResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  r.status = ::pclose(p);
  return r;
}

void check_cmd(const std::string& name, const std::string& prompt, bool quantized,
               const std::string& device) {
  const golden::Golden g = golden::load(name);
  const RunResult r =
      run(fmt::format("logits -m {} -f {} -n 8 --device {}", testing::model_path(name + ".gguf"),
                      testing::shared_path("testdata/prompts/" + prompt), device));
  ASSERT_EQ(r.status, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(j.is_discarded()) << r.out.substr(0, 500);
  EXPECT_EQ(j.at("n_vocab").get<int32_t>(), g.n_vocab);
  EXPECT_EQ(j.at("prompt_tokens").get<std::vector<int32_t>>(), g.prompt_tokens);
  ASSERT_EQ(j.at("prompt_top").size(), g.prompt_tokens.size());
  const golden::Bounds b = golden::bounds_for(quantized);
  const auto greedy = j.at("greedy").get<std::vector<int32_t>>();
  ASSERT_EQ(greedy.size(), 8u);
  for (size_t i = 0; i < greedy.size() && g.greedy_margins[i] >= b.near_tie; ++i)
    EXPECT_EQ(greedy[i], g.greedy[i]) << "step " << i;
  // Top-1 of the first position agrees with llama.cpp (margins there are large).
  EXPECT_EQ(j.at("prompt_top")[0].at("ids")[0].get<int32_t>(), g.prompt_top[0].ids[0]);
}

TEST(LogitsCommand, Stories260KCpu) { check_cmd("stories260K", "story.txt", false, "cpu"); }
TEST(LogitsCommand, Qwen3BpeReference) {
  check_cmd("qwen3-bpe-f16", "code.txt", false, "reference");
}

TEST(LogitsCommand, BadInputsAreOneLineErrors) {
  const std::string model = testing::model_path("stories260K.gguf");
  const std::string prompt = testing::shared_path("testdata/prompts/story.txt");
  for (const std::string& args :
       {fmt::format("logits -m /nonexistent.gguf -f {}", prompt),
        fmt::format("logits -m {} -f /nonexistent.txt", model),
        fmt::format("logits -m {} -f {} --device quantum", model, prompt),
        fmt::format("logits -m {} -f {} -c 64", model, prompt),         // prompt > context
        fmt::format("logits -m {} -f {} -n 100000", model, prompt)}) {  // -n > context
    const RunResult r = run(args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.out.find("kiln logits: "), std::string::npos) << args << "\n" << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
  }
}

}  // namespace
}  // namespace kiln
