// tokenizer/pretokenize.h: byte-level BPE pre-tokenizers. Each tokenizer.ggml.pre name selects
// llama.cpp's list of regexes; they are applied in turn, each splitting the pieces the previous
// one produced (text between matches stays a piece of its own), and run on PCRE2 (UTF, JIT).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace kiln::tok {

// What a pre-tokenizer name implies besides its regexes (llama.cpp sets these per name).
struct PreTokenizerInfo {
  std::string name;                  // canonical name as given
  std::vector<std::string> regexes;  // llama.cpp's expressions, before translation
  bool clean_spaces = true;
  bool ignore_merges = false;  // a whole pre-token that is a vocabulary entry is used as is
  int force_add_bos = -1;      // -1: keep the model default; 0/1: llama.cpp overrides it
  bool no_bos = false;         // the vocabulary has no BOS (chatglm4)
  bool add_sep = false;
};

// Looks up a tokenizer.ggml.pre value ("" = missing -> default, as llama.cpp does).
Expected<PreTokenizerInfo> find_pre_tokenizer(std::string_view pre);

class PreTokenizer {
 public:
  static Expected<PreTokenizer> create(const std::vector<std::string>& llama_regexes);

  // Splits valid UTF-8 `text` into pre-tokens; appends each piece's end byte offset (into
  // `text`) to `ends`. Every byte belongs to exactly one piece; empty pieces are never made.
  void split(std::string_view text, std::vector<uint32_t>& ends) const;

  struct Regex;

 private:
  std::vector<std::shared_ptr<const Regex>> regexes_;
};

}  // namespace kiln::tok
