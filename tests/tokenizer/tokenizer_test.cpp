// tests/tokenizer/tokenizer_test.cpp: tokenizer behaviour beyond the llama.cpp vectors:
// round trips on random text, <unk> for vocabularies without byte fallback, special-token
// parsing, BOS/EOS, long inputs, invalid UTF-8 and malformed vocabulary metadata.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "common/testdata.h"
#include "format/gguf.h"
#include "format/gguf_writer.h"
#include "format/mmap_file.h"
#include "tokenizer/tokenizer.h"

namespace kiln {
namespace {

const Tokenizer& vocab(const std::string& name) {
  static std::map<std::string, Tokenizer> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  const std::string path =
      name.ends_with(".gguf") ? testing::model_path(name)
                              : testing::shared_path("testdata/vocab/ggml-vocab-" + name + ".gguf");
  auto g = GgufFile::open(path);
  if (!g) {
    ADD_FAILURE() << g.error();
    std::abort();
  }
  auto t = Tokenizer::from_gguf(*g);
  if (!t) {
    ADD_FAILURE() << t.error();
    std::abort();
  }
  return cache.emplace(name, std::move(*t)).first->second;
}

void append_utf8(uint32_t c, std::string& s) {
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xC0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    s += static_cast<char>(0xE0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (c >> 18));
    s += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  }
}

// Random valid UTF-8 that stresses pre-tokenizers: words, digits, runs of mixed whitespace,
// punctuation, apostrophes, accents, combining marks, CJK, emoji, and arbitrary code points.
std::string random_text(std::mt19937& rng, size_t n_cpts) {
  static const std::vector<uint32_t> pool = {
      ' ',     ' ',   ' ',    '\n',   '\t',  '\r',   'a',    'e',    't',    'h',    'T',
      'Z',     '0',   '7',    '9',    '\'',  '.',    ',',    '!',    '?',    '-',    '_',
      '(',     ')',   '{',    '"',    '#',   '$',    '~',    '|',    0xE9,   0xFC,   0xDF,
      0x301,   0x3B1, 0x416,  0x5D0,  0x627, 0x915,  0x4E2D, 0x6587, 0xAC00, 0x3042, 0x1F642,
      0x1F999, 0xA0,  0x3000, 0x2003, 0x85,  0xFFFD, 0x200B};
  std::string s;
  for (size_t i = 0; i < n_cpts; ++i) {
    uint32_t c;
    const unsigned r = rng() % 10;
    if (r < 7) {
      c = pool[rng() % pool.size()];
    } else if (r < 9) {
      c = 0x20 + rng() % 0x5F;
    } else {
      // BMP only: some BPE vocabularies (falcon, starcoder) have no token for the lead bytes
      // F1..F4 of the higher planes, so llama.cpp drops those bytes: not representable.
      do c = 0x20 + rng() % (0x10000 - 0x20);  // and no C0 controls (falcon lacks some)
      while ((c >= 0xD800 && c <= 0xDFFF) || c == 0x2581);  // "▁" reads back as a space in SPM
    }
    append_utf8(c, s);
  }
  return s;
}

class RoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(RoundTrip, RandomValidUtf8) {
  const Tokenizer& tok = vocab(GetParam());
  std::mt19937 rng(1234);
  for (int iter = 0; iter < 300; ++iter) {
    const std::string s = random_text(rng, 1 + rng() % 60);
    const auto ids = tok.encode(s, false, false);
    ASSERT_EQ(tok.decode(ids), s) << "iteration " << iter;
    const auto with_bos = tok.encode(s, true, false);
    ASSERT_EQ(tok.decode(with_bos, true), s) << "iteration " << iter;
    if (tok.add_bos()) {
      ASSERT_FALSE(with_bos.empty());
      EXPECT_EQ(with_bos[0], tok.bos());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Vocabs, RoundTrip,
                         ::testing::Values("stories260K.gguf", "qwen3-bpe-f16.gguf", "llama-spm",
                                           "gpt-2", "falcon", "mpt", "starcoder", "deepseek-llm"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           return n;
                         });

TEST(Tokenizer, SpmByteFallbackRoundTripsArbitraryBytes) {
  const Tokenizer& tok = vocab("stories260K.gguf");
  std::mt19937 rng(99);
  for (int iter = 0; iter < 300; ++iter) {
    std::string s(1 + rng() % 40, '\0');
    // No spaces: a space becomes the 3-byte "▁", which a preceding invalid lead byte may
    // swallow into its symbol (as in llama.cpp), and no literal "▁" (it reads back as a space).
    for (char& c : s) c = static_cast<char>(rng() % 256);
    for (char& c : s)
      if (c == ' ') c = 'x';
    if (s.find("\xE2\x96\x81") != std::string::npos) continue;
    ASSERT_EQ(tok.decode(tok.encode(s, false, false)), s) << "iteration " << iter;
  }
}

TEST(Tokenizer, BpeInvalidUtf8BecomesReplacementCharacter) {
  // llama.cpp decodes the text to code points first; an invalid byte becomes U+FFFD.
  const Tokenizer& tok = vocab("gpt-2");
  EXPECT_EQ(tok.encode("a\xFF"
                       "b",
                       false, false),
            tok.encode("a\xEF\xBF\xBD"
                       "b",
                       false, false));
  EXPECT_EQ(tok.encode("\xC3", false, false), tok.encode("\xEF\xBF\xBD", false, false));
  // A truncated sequence: the lead byte and the lone continuation byte each become U+FFFD.
  EXPECT_EQ(tok.decode(tok.encode("x\xE2\x82", false, false)), "x\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(Tokenizer, NoByteFallbackGivesUnk) {
  const Tokenizer& tok = vocab("babyllama-tok105-f32.gguf");
  ASSERT_NE(tok.unk(), kTokenNull);
  EXPECT_EQ(tok.find_token("<0x41>"), kTokenNull);  // really no byte tokens
  const std::string text = "Once upon a time \xE2\x98\x83 Zo\xC3\xAB met a \xF0\x9F\x99\x82!";
  const auto ids = tok.encode(text, false, false);
  size_t n_unk = 0;
  for (int32_t id : ids) {
    ASSERT_GE(id, 0);
    ASSERT_LT(id, tok.n_vocab());
    n_unk += id == tok.unk();
  }
  EXPECT_GE(n_unk, 3u);  // snowman, e-diaeresis, emoji (and any letter missing from 105 tokens)
  // Dropping the unknown tokens gives back the text minus exactly the unknown characters.
  std::string kept;
  for (size_t i = 0; i < text.size();) {
    size_t len = 1;
    const auto b = static_cast<uint8_t>(text[i]);
    if (b >= 0xF0)
      len = 4;
    else if (b >= 0xE0)
      len = 3;
    else if (b >= 0xC0)
      len = 2;
    const std::string ch = text.substr(i, len);
    const std::string as_token = ch == " " ? "\xE2\x96\x81" : ch;
    if (tok.find_token(as_token) != kTokenNull) kept += ch;
    i += len;
  }
  EXPECT_EQ(tok.decode(ids, true), kept);
}

TEST(Tokenizer, UnkNeverCrashesOnRandomInput) {
  const Tokenizer& tok = vocab("babyllama-tok105-f32.gguf");
  std::mt19937 rng(7);
  for (int iter = 0; iter < 200; ++iter) {
    std::string s(rng() % 50, '\0');
    for (char& c : s) c = static_cast<char>(rng() % 256);
    for (int32_t id : tok.encode(s, true, true)) ASSERT_TRUE(id >= 0 && id < tok.n_vocab());
  }
}

TEST(Tokenizer, ParseSpecialSpm) {
  const Tokenizer& tok = vocab("llama-spm");
  const std::string s = std::string("<s>Hello") + "</s>";
  const auto plain = tok.encode(s, false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), tok.bos()), 0);
  std::vector<int32_t> want{tok.bos()};
  for (int32_t id : tok.encode("Hello", false, false)) want.push_back(id);
  want.push_back(tok.eos());
  EXPECT_EQ(tok.encode(s, false, true), want);
  // Rendering: control tokens as text unless removed.
  EXPECT_EQ(tok.decode(want, false), "<s>Hello</s>");
  EXPECT_EQ(tok.decode(want, true), "Hello");
  EXPECT_EQ(tok.token_to_piece(tok.bos(), false), "");
  EXPECT_EQ(tok.token_to_piece(tok.bos(), true), "<s>");
}

TEST(Tokenizer, ParseSpecialBpe) {
  const Tokenizer& tok = vocab("gpt-2");
  const int32_t eot = tok.find_token("<|endoftext|>");
  ASSERT_NE(eot, kTokenNull);
  std::vector<int32_t> want = tok.encode("a cat", false, false);
  want.push_back(eot);
  for (int32_t id : tok.encode(" sat", false, false)) want.push_back(id);
  EXPECT_EQ(tok.encode("a cat<|endoftext|> sat", false, true), want);
  const auto plain = tok.encode("a cat<|endoftext|> sat", false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), eot), 0);
  EXPECT_TRUE(tok.is_eog(eot));
  EXPECT_TRUE(tok.is_eog(tok.eos()));
  EXPECT_FALSE(tok.is_eog(want[0]));
}

TEST(Tokenizer, DefaultsFromMetadata) {
  const Tokenizer& spm = vocab("stories260K.gguf");
  EXPECT_EQ(spm.type(), VocabType::kSpm);
  EXPECT_TRUE(spm.add_bos());  // SPM default when the key is absent
  EXPECT_FALSE(spm.add_eos());
  EXPECT_EQ(spm.bos(), 1);
  EXPECT_EQ(spm.eos(), 2);
  EXPECT_EQ(spm.sep(), kTokenNull);  // 4294967295 in the file: out of range -> none
  EXPECT_TRUE(spm.is_eog(spm.eos()));
  const Tokenizer& gpt2 = vocab("gpt-2");
  EXPECT_EQ(gpt2.type(), VocabType::kBpe);
  EXPECT_FALSE(gpt2.add_bos());
  EXPECT_EQ(gpt2.encode("hi", true, false), gpt2.encode("hi", false, false));
  const Tokenizer& qwen = vocab("qwen3-bpe-f16.gguf");
  EXPECT_EQ(qwen.pre_type(), "deepseek-coder");
  EXPECT_TRUE(qwen.add_bos());
  const Tokenizer& bert = vocab("bert-bge");
  EXPECT_EQ(bert.type(), VocabType::kWpm);
  const auto ids = bert.encode("hello world", true, false);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), bert.bos());
  EXPECT_EQ(ids.back(), bert.sep());
}

TEST(Tokenizer, EmptyInput) {
  for (const char* name : {"llama-spm", "gpt-2", "bert-bge"}) {
    const Tokenizer& tok = vocab(name);
    EXPECT_TRUE(tok.encode("", false, false).empty()) << name;
    EXPECT_EQ(tok.decode({}), "");
  }
  const Tokenizer& spm = vocab("llama-spm");
  EXPECT_EQ(spm.encode("", true, false), std::vector<int32_t>{spm.bos()});
}

TEST(Tokenizer, OutOfRangeIdsAreHarmless) {
  const Tokenizer& tok = vocab("llama-spm");
  const std::vector<int32_t> ids{-5, tok.n_vocab(), 1 << 30};
  EXPECT_EQ(tok.decode(ids), "");
  EXPECT_EQ(tok.token_to_piece(-1), "");
  EXPECT_EQ(tok.token_text(tok.n_vocab()), "");
  EXPECT_FALSE(tok.is_eog(-1));
}

TEST(Tokenizer, LongInputsAreHandled) {
  // 200 KB of one repeated character and of spaces: a quadratic merge loop would take minutes.
  for (const char* name : {"llama-spm", "gpt-2", "deepseek-coder"}) {
    const Tokenizer& tok = vocab(name);
    for (const std::string& s : {std::string(200000, 'a'), std::string(200000, ' '),
                                 std::string(100000, '\n') + std::string(100000, 'x')}) {
      const auto ids = tok.encode(s, false, false);
      EXPECT_GT(ids.size(), 0u);
      EXPECT_LE(ids.size(), s.size());
      EXPECT_EQ(tok.decode(ids), s) << name;
    }
  }
}

TEST(Tokenizer, PiecesConcatenateToDecode) {
  const Tokenizer& tok = vocab("gpt-2");
  const std::string s = "Streaming \xC3\xBC\xF0\x9F\x99\x82 pieces, one token at a time.";
  const auto ids = tok.encode(s, false, false);
  std::string joined;
  for (int32_t id : ids) joined += tok.token_to_piece(id);
  EXPECT_EQ(joined, s);
}

// Malformed vocabulary metadata: one clear error, never a crash.
Expected<Tokenizer> from_writer(const GgufWriter& w) {
  auto bytes = w.to_bytes();
  if (!bytes) return bytes.status();
  auto g = GgufFile::parse(MappedFile::from_bytes(std::move(*bytes), "crafted.gguf"));
  if (!g) return g.status();
  return Tokenizer::from_gguf(*g);
}

GgufWriter small_spm() {
  GgufWriter w;
  w.set_str("tokenizer.ggml.model", "llama");
  w.set_str_array("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "\xE2\x96\x81", "a", "b"});
  w.set_f32_array("tokenizer.ggml.scores", {0, 0, 0, -1, -2, -3});
  w.set_i32_array("tokenizer.ggml.token_type", {2, 3, 3, 1, 1, 1});
  return w;
}

TEST(TokenizerErrors, MalformedMetadata) {
  {
    auto t = from_writer(small_spm());
    ASSERT_TRUE(t.has_value()) << t.error();
    EXPECT_EQ(t->n_vocab(), 6);
    EXPECT_EQ(t->decode(t->encode("ab ba", false, false)), "ab ba");
  }
  const auto expect_error = [](GgufWriter w, const std::string& needle) {
    auto t = from_writer(w);
    ASSERT_FALSE(t.has_value());
    EXPECT_NE(t.error().find(needle), std::string::npos) << t.error();
    EXPECT_EQ(t.error().find('\n'), std::string::npos) << t.error();
  };
  GgufWriter w = small_spm();
  w.remove("tokenizer.ggml.model");
  expect_error(w, "tokenizer.ggml.model");
  w = small_spm();
  w.set_str("tokenizer.ggml.model", "t5x");
  expect_error(w, "t5x");
  w = small_spm();
  w.set_f32_array("tokenizer.ggml.scores", {0, 0});
  expect_error(w, "tokenizer.ggml.scores");
  w = small_spm();
  w.set_str_array("tokenizer.ggml.tokens", {});
  expect_error(w, "empty");
  w = small_spm();
  w.remove("tokenizer.ggml.tokens");
  expect_error(w, "tokenizer.ggml.tokens");
  w = small_spm();
  w.set_str("tokenizer.ggml.model", "gpt2");
  w.set_str("tokenizer.ggml.pre", "no-such-pre");
  expect_error(w, "no-such-pre");
  w = small_spm();
  w.set_str("tokenizer.ggml.model", "gpt2");
  expect_error(w, "merges");
  w = small_spm();
  w.set_str("tokenizer.ggml.add_bos_token", "yes");
  expect_error(w, "add_bos_token");
}

TEST(TokenizerErrors, BadSpecialIdsFallBackToDefaults) {
  GgufWriter w = small_spm();
  w.set_u32("tokenizer.ggml.bos_token_id", 4000000000u);
  w.set_u32("tokenizer.ggml.eos_token_id", 5);
  auto t = from_writer(w);
  ASSERT_TRUE(t.has_value()) << t.error();
  EXPECT_EQ(t->bos(), 1);
  EXPECT_EQ(t->eos(), 5);
}

}  // namespace
}  // namespace kiln
