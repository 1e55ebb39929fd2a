// tokenizer/wpm.cpp: WordPiece (tokenizer.ggml.model = "bert") as llama.cpp's
// llm_tokenizer_wpm_session: lower-case, strip accents (first code point of NFD, combining marks
// dropped), split on whitespace and punctuation, then greedy longest-match of "▁word" against the
// vocabulary; a word with any unmatched part becomes <unk>.
#include <algorithm>

#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace kiln::tok {
namespace {

bool is_chinese_char(uint32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

std::vector<std::string> wpm_words(std::string_view text) {
  std::vector<std::string> words(1);
  for (size_t i = 0; i < text.size();) {
    const uint32_t cpt = nfd_first(decode_utf8(text, i));
    const CptFlags f = cpt_flags(cpt);
    if (f.whitespace) {
      if (!words.back().empty()) words.emplace_back();
      continue;
    }
    // Accent stripping: combining marks (category M) go, whether they came from decomposing a
    // precomposed letter or were written apart (e + U+0301), and so do the vowel signs and
    // viramas of Indic scripts (Devanagari "नमस्ते" is matched as न म स त, as llama.cpp 0.7.0).
    if (cpt == 0 || cpt == kReplacementChar || f.control || f.mark) continue;
    std::string s;
    append_utf8(to_lower(cpt), s);
    if (f.punctuation || (cpt < 0x7F && f.symbol) || is_chinese_char(cpt)) {
      if (!words.back().empty()) words.emplace_back();
      words.back() = std::move(s);
      words.emplace_back();
    } else {
      words.back() += s;
    }
  }
  if (words.back().empty()) words.pop_back();
  return words;
}

}  // namespace

void wpm_encode(const Impl& v, std::string_view text, std::vector<int32_t>& out) {
  for (const std::string& w : wpm_words(text)) {
    if (w.empty()) continue;
    const std::string word = "\xE2\x96\x81" + w;
    const size_t n = word.size();
    const size_t before = out.size();
    for (size_t i = 0; i < n; ++i) {
      bool match = false;
      for (size_t j = std::min(n, i + v.max_token_len + 1); j > i; --j) {
        const int32_t id = v.find(std::string_view(word).substr(i, j - i));
        if (id != kTokenNull) {
          out.push_back(id);
          match = true;
          i = j - 1;
          break;
        }
      }
      if (!match) {
        out.resize(before);
        break;
      }
    }
    if (out.size() == before && v.unk != kTokenNull) out.push_back(v.unk);
  }
}

}  // namespace kiln::tok
