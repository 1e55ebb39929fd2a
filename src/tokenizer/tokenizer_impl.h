// tokenizer/tokenizer_impl.h: the tokenizer's internal state (shared, immutable after load)
// and the per-algorithm entry points. Not part of the public API.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tokenizer/pretokenize.h"
#include "tokenizer/tokenizer.h"

namespace kiln::tok {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TextMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Byte-level BPE works on raw bytes: the vocabulary's byte-to-unicode text is mapped back to
// bytes once at load, so a word never needs re-encoding. Every string a merge can involve (its
// two parts and its result) gets a small "intern" id, so a merge lookup is one integer key.
struct BpeTables {
  TextMap intern;                  // raw bytes -> intern id
  std::vector<int32_t> iid_token;  // intern id -> token id, or kTokenNull
  // (left iid << 32 | right iid) -> (rank << 32 | result iid)
  std::unordered_map<uint64_t, uint64_t> merges;
  std::array<int32_t, 256> byte_iid{};
  // llama.cpp's last resort for a piece that is not a token: the tokens whose text is one
  // byte of the piece's byte-level text (usually none).
  std::array<std::array<int32_t, 2>, 256> byte_fallback{};
};

}  // namespace kiln::tok

namespace kiln {

struct Tokenizer::Impl {
  VocabType type = VocabType::kSpm;
  std::string pre_name = "default";
  std::vector<std::string> texts;   // [n_vocab] vocabulary text
  std::vector<float> scores;        // [n_vocab]
  std::vector<uint32_t> attrs;      // [n_vocab] TokenAttr bits
  std::vector<std::string> pieces;  // [n_vocab] token_to_piece(id, special = true)
  tok::TextMap text_to_id;

  int32_t bos = kTokenNull, eos = kTokenNull, eot = kTokenNull, eom = kTokenNull, unk = kTokenNull,
          sep = kTokenNull, pad = kTokenNull, mask = kTokenNull;
  bool add_bos = false, add_eos = false, add_sep = false;
  bool add_space_prefix = false, clean_spaces = true, ignore_merges = false;
  std::vector<int32_t> eog;             // sorted
  std::vector<int32_t> special_tokens;  // control/user-defined/unknown, longest text first

  // SPM: the token for each byte (<0xNN>, else the one-byte text), or kTokenNull.
  std::array<int32_t, 256> spm_byte_token{};
  // SPM: every pair of adjacent characters found inside some token (each character's UTF-8
  // bytes packed into 32 bits). Where a text's adjacent pair is not here, no merge can ever
  // cross, so the text is merged in independent pieces (small heaps instead of one of 1M).
  std::unordered_set<uint64_t> spm_pairs;
  // SPM: (left id << 32 | right id) -> id of the token spelled left + right, for every way a
  // token splits into two tokens; the merge loop then looks up integers, not strings.
  std::unordered_map<uint64_t, int32_t> spm_concat;
  std::array<int32_t, 128> spm_ascii_token{};  // token of each one-byte ASCII text
  // BPE
  tok::BpeTables bpe;
  std::optional<tok::PreTokenizer> pre;
  // WPM
  size_t max_token_len = 0;

  int32_t find(std::string_view text) const {
    auto it = text_to_id.find(text);
    return it == text_to_id.end() ? kTokenNull : it->second;
  }
  int32_t n_vocab() const { return static_cast<int32_t>(texts.size()); }
};

}  // namespace kiln

namespace kiln::tok {

using Impl = Tokenizer::Impl;

// Raw text (no special tokens) -> ids, appended to `out`.
void spm_encode(const Impl& v, std::string_view text, bool prefix_space, std::vector<int32_t>& out);
// Packs the UTF-8 characters text[a, a+na) and text[b, b+nb) (each at most 4 bytes) into one key.
uint64_t spm_pair_key(std::string_view text, size_t a, size_t na, size_t b, size_t nb);
void spm_build(Impl& v);
// The per-call state of BPE (word cache); one per encode() call, never shared.
class BpeSession {
 public:
  explicit BpeSession(const Impl& v) : v_(v) {}
  void encode(std::string_view text, std::vector<int32_t>& out);

 private:
  void encode_word(std::string_view word, std::vector<int32_t>& out);
  const Impl& v_;
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>>
      cache_;  // word -> (offset, count) in pool_
  std::vector<int32_t> pool_;
  std::string canon_;
  std::vector<uint32_t> ends_;
  struct Sym {
    uint32_t start, n;
    int32_t prev, next, iid;
  };
  struct Bigram {
    uint32_t rank;
    int32_t left, right;
    uint32_t size;
    int32_t result;
  };
  std::vector<Sym> syms_;
  std::vector<Bigram> heap_;
};
void wpm_encode(const Impl& v, std::string_view text, std::vector<int32_t>& out);
// Builds the BPE tables from the vocabulary text and merges.
Status bpe_build(Impl& v, const std::vector<std::string_view>& merges);

}  // namespace kiln::tok
