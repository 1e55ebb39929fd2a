// tests/tokenizer/vocab_test.cpp: llama.cpp's tokenizer test vocabularies. Every .inp/.out pair
// in testdata/vocab whose .gguf is present must tokenize exactly as llama.cpp did
// (add_special = false, parse_special = false), and the golden prompts of the model files must
// tokenize to their prompt_tokens (BOS added).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
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

// Strings the shipped .inp files do not hold, with the ids llama.cpp 0.7.0's llama-tokenize
// gave for them (add_special = false; parse_special as marked).
struct PeerCase {
  const char* vocab;
  const char* text;
  bool parse_special;
  std::vector<int32_t> want;
};

const PeerCase kPeerCases[] = {
    // WordPiece strips accents whether precomposed or written apart (e + U+0301), and drops
    // the vowel signs and viramas of Indic scripts (category M), as llama.cpp 0.7.0 does.
    {"bert-bge", "caf\u00e9", false, {7668}},
    {"bert-bge", "cafe\u0301", false, {7668}},
    {"bert-bge", "Cafe\u0301 au lait", false, {7668, 8740, 21110, 2102}},
    {"bert-bge", "na\u00efve r\u00e9sum\u00e9", false, {15743, 13746}},
    {"bert-bge", "re\u0301sume\u0301 na\u0131\u0308ve", false, {13746, 6583, 11722, 3726}},
    {"bert-bge", "\u00c5ngstr\u00f6m", false, {17076, 15687}},
    {"bert-bge", "A\u030angstro\u0308m", false, {17076, 15687}},
    {"bert-bge", "Hello\u0301 world", false, {7592, 2088}},
    {"bert-bge", "\u00f1and\u00fa n\u0303", false, {16660, 8566, 1050}},
    {"bert-bge", "x\u0301y", false, {1060, 2100}},
    {"bert-bge", "a \u0301 b", false, {1037, 1038}},
    {"bert-bge", "\u0301", false, {}},
    {"bert-bge",
     "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
     false,
     {1327, 29867, 29874, 29859, 1325, 29863, 29868}},
    {"bert-bge",
     "\u0939\u093f\u0928\u094d\u0926\u0940 \u092d\u093e\u0937\u093e",
     false,
     {1339, 29863, 29861, 1330, 29873}},
    {"bert-bge", "\u0915\u094d\u0937\u093f", false, {1315, 29873}},
    {"bert-bge",
     "\u0928\u092e\u0938\u094d\u0924\u0947abc",
     false,
     {1327, 29867, 29874, 29859, 7875, 2278}},
    {"bert-bge",
     "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac",
     false,
     {1159, 29727, 29727, 24824, 16177, 18199, 29726, 14608}},
    {"bert-bge",
     "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440",
     false,
     {1194, 16856, 10325, 25529, 15290, 22919, 1191, 10325, 16856}},
    {"bert-bge", "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35", false, {100}},
    {"bert-bge", "\u3053\u3093\u306b\u3061\u306f", false, {1655, 30217, 30194, 30188, 30198}},
    {"bert-bge", "\uc548\ub155\ud558\uc138\uc694", false, {1463, 29992, 30005, 29997, 29999}},
    {"bert-bge", "\u0645\u0631\u062d\u0628\u0627", false, {1295, 17149, 29820, 29816, 25573}},
    // phi-3: "</s>" is user-defined in the file, but llama.cpp adds CONTROL to it (it is on the
    // end-of-generation list), so unparsed it is text; parsed, it is the EOS token.
    {"phi-3", "</s>", false, {1533, 29879, 29958}},
    {"phi-3", "Hello </s> world", false, {15043, 1533, 29879, 29958, 3186}},
    {"phi-3", "<s>text</s>", false, {529, 29879, 29958, 726, 829, 29879, 29958}},
    {"phi-3", "a</s>b", false, {263, 829, 29879, 29958, 29890}},
    {"phi-3", " </s> ", false, {29871, 1533, 29879, 29958, 29871}},
    {"phi-3", "</s></s>", false, {1533, 29879, 2565, 29879, 29958}},
    {"phi-3", "<|endoftext|>", false, {529, 29989, 355, 974, 726, 29989, 29958}},
    {"phi-3", "<|end|>", false, {529, 29989, 355, 29989, 29958}},
    {"phi-3",
     "<|user|>\nhi<|end|>",
     false,
     {529, 29989, 1792, 29989, 29958, 13, 2918, 29966, 29989, 355, 29989, 29958}},
    {"phi-3", "<unk>", false, {529, 2960, 29958}},
    {"phi-3", "</s>", true, {2}},
    {"phi-3", "Hello </s> world", true, {15043, 29871, 2, 3186}},
    {"phi-3", "<|user|>\nhi<|end|>", true, {32010, 7251, 32007}},
};

TEST(VocabFiles, MatchesLlamaCppOnExtraStrings) {
  std::map<std::string, Tokenizer> toks;
  for (const PeerCase& c : kPeerCases) {
    auto it = toks.find(c.vocab);
    if (it == toks.end()) {
      const std::string path =
          testing::shared_path("testdata/vocab") + "/ggml-vocab-" + c.vocab + ".gguf";
      it = toks.emplace(c.vocab, load(path)).first;
    }
    const auto got = it->second.encode(c.text, false, c.parse_special);
    EXPECT_EQ(got, c.want) << c.vocab << " '" << c.text << "' parse_special " << c.parse_special
                           << "\n  want" << ids_str(c.want) << "\n  got " << ids_str(got);
  }
}

TEST(VocabFiles, Phi3EndOfSequenceStaysEndOfGeneration) {
  const Tokenizer tok = load(testing::shared_path("testdata/vocab") + "/ggml-vocab-phi-3.gguf");
  EXPECT_TRUE(tok.is_eog(2));      // </s>
  EXPECT_TRUE(tok.is_eog(32007));  // <|end|>
  EXPECT_TRUE(tok.is_control(2));
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
                                           "muse-glimmer-f16", "qwen3moe-f16", "mixtral-q4_k_m",
                                           "phi3-f16"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

}  // namespace
}  // namespace kiln
