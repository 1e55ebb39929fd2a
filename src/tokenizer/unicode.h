// tokenizer/unicode.h: the UTF-8 and Unicode rules the tokenizers share, written to match
// llama.cpp's unicode.cpp (lenient decoding, its whitespace set, the GPT-2 byte<->unicode map).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::tok {

inline constexpr uint32_t kReplacementChar = 0xFFFD;

// Length of the UTF-8 sequence a lead byte announces (1 for continuation/invalid bytes), as
// llama.cpp's unicode_len_utf8: SentencePiece symbols are cut with it.
inline size_t utf8_seq_len(uint8_t lead) {
  static constexpr uint8_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[lead >> 4];
}

// Decodes one code point at `offset` the way llama.cpp does (overlong forms accepted); an
// invalid sequence yields U+FFFD and consumes one byte. Surrogates and values past U+10FFFF
// (which llama.cpp cannot re-encode and throws on) also yield U+FFFD, consuming the sequence.
uint32_t decode_utf8(std::string_view s, size_t& offset);

// Appends the UTF-8 encoding of a valid code point.
void append_utf8(uint32_t cpt, std::string& out);

// The text llama.cpp's BPE path actually sees: every code point decoded leniently and
// re-encoded, so the result is always valid UTF-8. Returns false when `s` was already exactly
// that (then `out` is left untouched and callers use `s` itself).
bool canonicalize_utf8(std::string_view s, std::string& out);

// llama.cpp's whitespace set (Unicode White_Space).
bool is_whitespace(uint32_t cpt);

// Unicode general category flags, as llama.cpp groups them.
struct CptFlags {
  bool undefined = false, number = false, letter = false, separator = false, mark = false,
       punctuation = false, symbol = false, control = false, whitespace = false;
};
CptFlags cpt_flags(uint32_t cpt);
uint32_t to_lower(uint32_t cpt);
// First code point of the canonical decomposition (llama.cpp's unicode_cpts_normalize_nfd).
uint32_t nfd_first(uint32_t cpt);

// GPT-2 byte-level mapping: every byte has one printable code point.
uint32_t byte_to_cpt(uint8_t b);
// The byte a mapped code point stands for, or -1.
int cpt_to_byte(uint32_t cpt);
// UTF-8 of byte_to_cpt(b).
const std::string& byte_to_utf8(uint8_t b);

}  // namespace kiln::tok
