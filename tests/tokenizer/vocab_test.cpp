// tests/tokenizer/vocab_test.cpp: llama.cpp's tokenizer test vocabularies. Every .inp/.out pair
// in testdata/vocab whose .gguf is present must tokenize exactly as llama.cpp did
// (add_special = false, parse_special = false), and the golden prompts of the model files must
// tokenize to their prompt_tokens (BOS added).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/testdata.h"
#include "format/gguf.h"
#include "tokenizer/tokenizer.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

Tokenizer load(const std::string& path) {
  auto g = GgufFile::open(path);
  EXPECT_TRUE(g.has_value()) << g.error();
  if (!g) std::abort();
  auto t = Tokenizer::from_gguf(*g);
  if (!t) {
    ADD_FAILURE() << t.error();
    std::abort();
  }
  return std::move(*t);
}

// Entries separated by "\n__ggml_vocab_test__\n", split as llama.cpp's test-tokenizer-0 does.
std::vector<std::string> read_inputs(const std::string& path) {
  const std::string raw = testing::read_file(path);
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < raw.size()) {
    const size_t next = raw.find(sep, pos);
    if (next == std::string::npos) {
      out.push_back(raw.substr(pos));
      break;
    }
    out.push_back(raw.substr(pos, next - pos));
    pos = next + sep.size();
  }
  return out;
}

std::vector<std::vector<int32_t>> read_outputs(const std::string& path) {
  std::vector<std::vector<int32_t>> out;
  std::istringstream in(testing::read_file(path));
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::vector<int32_t> ids;
    int32_t id;
    while (ls >> id) ids.push_back(id);
    out.push_back(std::move(ids));
  }
  return out;
}

std::string ids_str(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += fmt::format(" {}", id);
  return s;
}

std::vector<std::string> vocab_names() {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(testing::shared_path("testdata/vocab"))) {
    const std::string f = e.path().filename().string();
    if (f.size() > 9 && f.ends_with(".gguf.inp")) {
      const std::string gguf = e.path().string().substr(0, e.path().string().size() - 4);
      if (fs::exists(gguf)) names.push_back(f.substr(0, f.size() - 9));
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

class VocabFiles : public ::testing::TestWithParam<std::string> {};

TEST_P(VocabFiles, MatchesLlamaCpp) {
  const std::string base = testing::shared_path("testdata/vocab") + "/" + GetParam() + ".gguf";
  const Tokenizer tok = load(base);
  const auto inputs = read_inputs(base + ".inp");
  const auto expected = read_outputs(base + ".out");
  ASSERT_GE(expected.size(), inputs.size());
  ASSERT_GT(inputs.size(), 10u);
  int failures = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto got = tok.encode(inputs[i], false, false);
    if (got != expected[i]) {
      ++failures;
      ADD_FAILURE() << GetParam() << " entry " << i << " '" << inputs[i] << "'\n  want"
                    << ids_str(expected[i]) << "\n  got " << ids_str(got);
    }
  }
  fmt::print("{}: {}/{} entries match\n", GetParam(), inputs.size() - failures, inputs.size());
}

INSTANTIATE_TEST_SUITE_P(Vocab, VocabFiles, ::testing::ValuesIn(vocab_names()),
                         [](const auto& info) {
                           std::string n = info.param.substr(std::string("ggml-vocab-").size());
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

TEST(VocabFiles, AllPresentVocabulariesAreCovered) {
  // bert-bge, deepseek-coder, deepseek-llm, falcon, gpt-2, llama-spm, mpt, phi-3, refact,
  // starcoder: the test must not silently lose any of them.
  EXPECT_GE(vocab_names().size(), 10u);
}

class GoldenPrompts : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenPrompts, PromptTokensMatch) {
  const auto j = nlohmann::json::parse(
      testing::read_file(testing::shared_path("testdata/golden/" + GetParam() + ".json")));
  const Tokenizer tok = load(testing::model_path(GetParam() + ".gguf"));
  const std::string prompt = j.at("prompt").get<std::string>();
  const auto want = j.at("prompt_tokens").get<std::vector<int32_t>>();
  const auto got = tok.encode(prompt, true, false);
  EXPECT_EQ(got, want) << "want" << ids_str(want) << "\ngot " << ids_str(got);
  EXPECT_EQ(tok.decode(got, true), prompt);
}

INSTANTIATE_TEST_SUITE_P(Golden, GoldenPrompts,
                         ::testing::Values("stories260K", "stories260K-q8_0",
                                           "babyllama-tok105-f32", "llama-gqa-f16", "qwen3-bpe-f16",
                                           "qwen3-bpe-q8_0", "gemma2-swa-f16", "gemma3-swa-f16",
                                           "muse-glimmer-f16", "qwen3moe-f16", "mixtral-q4_k_m"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

}  // namespace
}  // namespace kiln
