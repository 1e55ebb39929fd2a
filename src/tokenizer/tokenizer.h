// tokenizer/tokenizer.h: the public tokenizer API. Built from a GGUF file's tokenizer.ggml.*
// metadata; encodes text to token ids and decodes ids to text exactly as llama.cpp does
// (SentencePiece-style "llama", byte-level BPE "gpt2" with the pre-tokenizer selected by
// tokenizer.ggml.pre, WordPiece "bert").
//
// A Tokenizer is immutable after from_gguf() and cheap to copy (shared state); every const
// method is safe to call from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace kiln {

class GgufFile;

// tokenizer.ggml.model
enum class VocabType { kSpm, kBpe, kWpm };

// Token attributes, as llama.cpp derives them from tokenizer.ggml.token_type.
enum TokenAttr : uint32_t {
  kAttrUndefined = 0,
  kAttrUnknown = 1u << 0,
  kAttrUnused = 1u << 1,
  kAttrNormal = 1u << 2,
  kAttrControl = 1u << 3,
  kAttrUserDefined = 1u << 4,
  kAttrByte = 1u << 5,
  kAttrNormalized = 1u << 6,
  kAttrLstrip = 1u << 7,
  kAttrRstrip = 1u << 8,
  kAttrSingleWord = 1u << 9,
};

inline constexpr int32_t kTokenNull = -1;

class Tokenizer {
 public:
  // Reads tokenizer.ggml.* metadata (works on vocabulary-only files). Fails with a one-line
  // message for a missing/unsupported model or pre-tokenizer, or inconsistent arrays.
  static Expected<Tokenizer> from_gguf(const GgufFile& gguf);

  // Text -> ids. add_special: BOS/EOS (and SEP for bert) as the vocabulary asks (add_bos()).
  // parse_special: text equal to a control/user-defined token's text becomes that token
  // (user-defined tokens are always matched, as in llama.cpp). Any bytes are accepted,
  // including invalid UTF-8; characters a vocabulary cannot represent become <unk>.
  std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const;

  // Ids -> text. Concatenates the pieces (SPM: "▁" -> space, <0xNN> -> that byte; BPE:
  // byte-level unicode -> bytes) and drops the one space the SPM add_space_prefix rule put in
  // front of the first word. remove_special: control/unknown tokens render as nothing (else as
  // their text). Unlike llama.cpp it does not "clean up" spaces before punctuation, so that
  // decode(encode(s, false, false), false) == s for any text the vocabulary can represent.
  // Ids out of range render as nothing.
  std::string decode(std::span<const int32_t> ids, bool remove_special = false) const;

  // One token's bytes as llama.cpp's llama_token_to_piece(lstrip = 0): may be a partial
  // UTF-8 sequence (byte tokens). special = false renders control/unknown tokens as "".
  // Out-of-range ids give "".
  std::string token_to_piece(int32_t id, bool special = true) const;
  // The token's raw vocabulary text ("▁the", "Ġthe", "<0x0A>"); "" when out of range.
  const std::string& token_text(int32_t id) const;
  // The id of exactly this vocabulary text, or kTokenNull.
  int32_t find_token(std::string_view text) const;

  int32_t n_vocab() const;
  VocabType type() const;
  const std::string& pre_type() const;  // tokenizer.ggml.pre as selected ("default" if absent)

  int32_t bos() const;  // kTokenNull when the vocabulary has none
  int32_t eos() const;
  int32_t eot() const;
  int32_t unk() const;
  int32_t pad() const;
  int32_t sep() const;
  bool add_bos() const;  // tokenizer.ggml.add_bos_token, else llama.cpp's default per model
  bool add_eos() const;
  bool add_space_prefix() const;

  uint32_t attr(int32_t id) const;  // TokenAttr bits; 0 when out of range
  float score(int32_t id) const;
  bool is_control(int32_t id) const;
  // End of generation: EOS, EOT, EOM and the end-of-turn tokens llama.cpp recognises by text.
  bool is_eog(int32_t id) const;
  std::span<const int32_t> eog_ids() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace kiln
