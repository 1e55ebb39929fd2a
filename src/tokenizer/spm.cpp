// tokenizer/spm.cpp: SentencePiece-style BPE over scores (tokenizer.ggml.model = "llama"), as
// llama.cpp's llm_tokenizer_spm_session: spaces become "▁", symbols start as UTF-8 characters,
// and the adjacent pair whose concatenation is the highest-scoring token merges first (ties:
// leftmost). Leftovers fall back to <0xNN> byte tokens, or <unk> where the vocabulary has no
// byte tokens.
#include <algorithm>

#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace kiln::tok {
namespace {

struct Sym {
  uint32_t start, n;
  int32_t prev, next;
  int32_t id;  // the token this symbol spells, or kTokenNull
};
struct Bigram {
  float score;
  int32_t left, right;
  uint32_t size;
  int32_t result;
};

void merge_range(const Impl& v, std::string_view tv, std::vector<Sym>& syms,
                 std::vector<Bigram>& heap, int32_t first, int32_t last,
                 std::vector<int32_t>& out) {
  for (int32_t i = first; i < last; ++i) {
    syms[i].prev = i - 1 >= first ? i - 1 : -1;
    syms[i].next = i + 1 < last ? i + 1 : -1;
  }
  heap.clear();
  // Max-heap on score, then the smaller left index first (llama.cpp's comparator).
  const auto lower = [](const Bigram& a, const Bigram& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  const auto add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const Sym& a = syms[l];
    const Sym& b = syms[r];
    int32_t id;
    if (a.id != kTokenNull && b.id != kTokenNull) {
      const auto it =
          v.spm_concat.find((static_cast<uint64_t>(a.id) << 32) | static_cast<uint32_t>(b.id));
      if (it == v.spm_concat.end()) return;
      id = it->second;
    } else {
      id = v.find(tv.substr(a.start, a.n + b.n));  // a character outside the vocabulary
      if (id == kTokenNull) return;
    }
    heap.push_back({v.scores[id], l, r, a.n + b.n, id});
    std::push_heap(heap.begin(), heap.end(), lower);
  };
  for (int32_t i = first + 1; i < last; ++i) add(i - 1, i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), lower);
    const Bigram bg = heap.back();
    heap.pop_back();
    Sym& l = syms[bg.left];
    Sym& r = syms[bg.right];
    if (l.n == 0 || r.n == 0 || l.n + r.n != bg.size) continue;  // stale
    l.n += r.n;
    l.id = bg.result;
    r.n = 0;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = bg.left;
    add(l.prev, bg.left);
    add(bg.left, l.next);
  }

  // Every merge produced a token, so a symbol that is not one is a single character the
  // vocabulary lacks (llama.cpp's rev_merge lookup can never hit here): bytes, else <unk>.
  for (int32_t i = first; i >= 0; i = syms[i].next) {
    const Sym& s = syms[i];
    const std::string_view piece = tv.substr(s.start, s.n);
    const int32_t id = s.id;
    if (id != kTokenNull) {
      out.push_back(id);
      continue;
    }
    const bool all_bytes = std::all_of(piece.begin(), piece.end(), [&](char c) {
      return v.spm_byte_token[static_cast<uint8_t>(c)] != kTokenNull;
    });
    if (all_bytes) {
      for (char c : piece) out.push_back(v.spm_byte_token[static_cast<uint8_t>(c)]);
    } else if (v.unk != kTokenNull) {
      out.push_back(v.unk);
    }
  }
}

}  // namespace

void spm_encode(const Impl& v, std::string_view raw, bool prefix_space, std::vector<int32_t>& out) {
  static constexpr std::string_view kSpace = "\xE2\x96\x81";  // ▁
  std::string text;
  text.reserve(raw.size() + raw.size() / 4 + 4);
  if (prefix_space) text += kSpace;
  for (char c : raw) {
    if (c == ' ')
      text += kSpace;
    else
      text.push_back(c);
  }
  if (text.empty()) return;

  std::vector<Sym> syms;
  syms.reserve(text.size());
  for (size_t off = 0; off < text.size();) {
    const size_t len = std::min(utf8_seq_len(static_cast<uint8_t>(text[off])), text.size() - off);
    const auto b0 = static_cast<uint8_t>(text[off]);
    const int32_t id =
        b0 < 0x80 ? v.spm_ascii_token[b0] : v.find(std::string_view(text).substr(off, len));
    syms.push_back({static_cast<uint32_t>(off), static_cast<uint32_t>(len), -1, -1, id});
    off += len;
  }
  const std::string_view tv = text;
  std::vector<Bigram> heap;
  const auto n_syms = static_cast<int32_t>(syms.size());
  // Merge [first, last) on its own once the pair at `last` is one no token contains. The
  // relative order of its merges (score, then left index) is the same as in one global queue.
  int32_t first = 0;
  for (int32_t last = 1; last <= n_syms; ++last) {
    if (last < n_syms) {
      if (last - first < 32) continue;  // small pieces would cost more lookups than they save
      const Sym& a = syms[last - 1];
      const Sym& b = syms[last];
      if (v.spm_pairs.count(spm_pair_key(tv, a.start, a.n, b.start, b.n))) continue;
    }
    merge_range(v, tv, syms, heap, first, last, out);
    first = last;
  }
}

uint64_t spm_pair_key(std::string_view text, size_t a, size_t na, size_t b, size_t nb) {
  uint64_t k = 0;
  for (size_t i = 0; i < 4; ++i) k = (k << 8) | (i < na ? static_cast<uint8_t>(text[a + i]) : 0);
  for (size_t i = 0; i < 4; ++i) k = (k << 8) | (i < nb ? static_cast<uint8_t>(text[b + i]) : 0);
  return k;
}

void spm_build(Impl& v) {
  for (int c = 0; c < 128; ++c) {
    const char ch = static_cast<char>(c);
    v.spm_ascii_token[c] = v.find(std::string_view(&ch, 1));
  }
  for (int32_t id = 0; id < v.n_vocab(); ++id) {
    const std::string& t = v.texts[id];
    if (v.find(t) != id) continue;  // a repeated text belongs to its last id
    const std::string_view tv = t;
    for (size_t k = utf8_seq_len(static_cast<uint8_t>(t[0])); k < t.size();
         k += utf8_seq_len(static_cast<uint8_t>(t[k]))) {
      const int32_t l = v.find(tv.substr(0, k)), r = v.find(tv.substr(k));
      if (l != kTokenNull && r != kTokenNull)
        v.spm_concat.emplace((static_cast<uint64_t>(l) << 32) | static_cast<uint32_t>(r), id);
    }
  }
  for (const std::string& t : v.texts) {
    size_t prev = 0, prev_n = 0;
    for (size_t off = 0; off < t.size();) {
      const size_t len = std::min(utf8_seq_len(static_cast<uint8_t>(t[off])), t.size() - off);
      if (off > 0) v.spm_pairs.insert(spm_pair_key(t, prev, prev_n, off, len));
      prev = off;
      prev_n = len;
      off += len;
    }
  }
}

}  // namespace kiln::tok
