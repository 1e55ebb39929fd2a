// tokenizer/bpe.cpp: byte-level BPE (tokenizer.ggml.model = "gpt2") as llama.cpp's
// llm_tokenizer_bpe_session: pre-tokenize, then per word repeatedly merge the adjacent pair
// of lowest rank (ties: leftmost), with a heap so long words stay O(n log n).
#include <algorithm>

#include "core/check.h"
#include "tokenizer/tokenizer_impl.h"
#include "tokenizer/unicode.h"

namespace kiln::tok {
namespace {

// Raw bytes of a byte-level text ("Ġthe" -> " the"); false if a code point is not one of the
// 256 byte stand-ins (such a string can never come out of the byte-level mapping).
bool to_raw_bytes(std::string_view text, std::string& out) {
  out.clear();
  for (size_t i = 0; i < text.size();) {
    const uint32_t cpt = decode_utf8(text, i);
    const int b = cpt_to_byte(cpt);
    if (b < 0) return false;
    out.push_back(static_cast<char>(b));
  }
  return true;
}

int32_t intern(BpeTables& t, std::string_view raw) {
  auto it = t.intern.find(raw);
  if (it != t.intern.end()) return it->second;
  const auto id = static_cast<int32_t>(t.iid_token.size());
  t.intern.emplace(std::string(raw), id);
  t.iid_token.push_back(kTokenNull);
  return id;
}

}  // namespace

Status bpe_build(Impl& v, const std::vector<std::string_view>& merges) {
  BpeTables& t = v.bpe;
  std::string raw;
  for (int32_t id = 0; id < v.n_vocab(); ++id) {
    if (!to_raw_bytes(v.texts[id], raw) || raw.empty()) continue;
    const int32_t iid = intern(t, raw);
    // The first token with a given text wins, as in llama.cpp's token_to_id map.
    if (t.iid_token[iid] == kTokenNull && v.find(v.texts[id]) == id) t.iid_token[iid] = id;
  }
  std::string left, right;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string_view m = merges[rank];
    // llama.cpp splits at the first space after the first byte.
    const size_t pos = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
    if (pos == std::string_view::npos) continue;
    if (!to_raw_bytes(m.substr(0, pos), left) || !to_raw_bytes(m.substr(pos + 1), right)) continue;
    if (left.empty() || right.empty()) continue;
    const int32_t l = intern(t, left), r = intern(t, right);
    const int32_t res = intern(t, left + right);
    const uint64_t key = (static_cast<uint64_t>(l) << 32) | static_cast<uint32_t>(r);
    t.merges.emplace(key, (static_cast<uint64_t>(rank) << 32) | static_cast<uint32_t>(res));
  }
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    auto it = t.intern.find(std::string_view(&c, 1));
    t.byte_iid[b] = it == t.intern.end() ? kTokenNull : it->second;
    const std::string& mapped = byte_to_utf8(static_cast<uint8_t>(b));
    t.byte_fallback[b] = {kTokenNull, kTokenNull};
    for (size_t k = 0; k < mapped.size() && k < 2; ++k)
      t.byte_fallback[b][k] = v.find(std::string_view(&mapped[k], 1));
  }
  return Status::ok();
}

void BpeSession::encode(std::string_view text, std::vector<int32_t>& out) {
  // llama.cpp decodes the text to code points (invalid bytes -> U+FFFD) before splitting.
  if (canonicalize_utf8(text, canon_)) text = canon_;
  ends_.clear();
  v_.pre->split(text, ends_);
  uint32_t start = 0;
  for (uint32_t end : ends_) {
    const std::string_view word = text.substr(start, end - start);
    start = end;
    if (word.size() > 256) {  // long words (runs of spaces, base64) rarely repeat
      encode_word(word, out);
      continue;
    }
    auto it = cache_.find(word);
    if (it == cache_.end()) {
      const size_t before = out.size();
      encode_word(word, out);
      const auto off = static_cast<uint32_t>(pool_.size());
      pool_.insert(pool_.end(), out.begin() + static_cast<ptrdiff_t>(before), out.end());
      cache_.emplace(std::string(word),
                     std::make_pair(off, static_cast<uint32_t>(out.size() - before)));
    } else {
      const auto [off, n] = it->second;
      out.insert(out.end(), pool_.begin() + off, pool_.begin() + off + n);
    }
  }
}

void BpeSession::encode_word(std::string_view word, std::vector<int32_t>& out) {
  const BpeTables& t = v_.bpe;
  if (word.empty()) return;
  if (v_.ignore_merges) {
    auto it = t.intern.find(word);
    if (it != t.intern.end() && t.iid_token[it->second] != kTokenNull) {
      out.push_back(t.iid_token[it->second]);
      return;
    }
  }
  syms_.clear();
  heap_.clear();
  const auto n = static_cast<int32_t>(word.size());
  for (int32_t i = 0; i < n; ++i)
    syms_.push_back({static_cast<uint32_t>(i), 1, i - 1, i + 1 < n ? i + 1 : -1,
                     t.byte_iid[static_cast<uint8_t>(word[i])]});
  // Min-heap on (rank, left): the order llama.cpp's priority queue pops in.
  const auto later = [](const Bigram& a, const Bigram& b) {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  };
  const auto add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const Sym& a = syms_[l];
    const Sym& b = syms_[r];
    if (a.iid < 0 || b.iid < 0) return;
    const uint64_t key = (static_cast<uint64_t>(a.iid) << 32) | static_cast<uint32_t>(b.iid);
    auto it = t.merges.find(key);
    if (it == t.merges.end()) return;
    heap_.push_back({static_cast<uint32_t>(it->second >> 32), l, r, a.n + b.n,
                     static_cast<int32_t>(it->second & 0xFFFFFFFFu)});
    std::push_heap(heap_.begin(), heap_.end(), later);
  };
  for (int32_t i = 1; i < n; ++i) add(i - 1, i);
  while (!heap_.empty()) {
    std::pop_heap(heap_.begin(), heap_.end(), later);
    const Bigram bg = heap_.back();
    heap_.pop_back();
    Sym& l = syms_[bg.left];
    Sym& r = syms_[bg.right];
    // Stale entry: a side was merged away or grew since it was queued.
    if (l.n == 0 || r.n == 0 || l.n + r.n != bg.size) continue;
    l.n += r.n;
    l.iid = bg.result;
    r.n = 0;
    l.next = r.next;
    if (r.next >= 0) syms_[r.next].prev = bg.left;
    add(l.prev, bg.left);
    add(bg.left, l.next);
  }
  for (int32_t i = 0; i >= 0; i = syms_[i].next) {
    const Sym& s = syms_[i];
    const int32_t id = s.iid >= 0 ? t.iid_token[s.iid] : kTokenNull;
    if (id != kTokenNull) {
      out.push_back(id);
      continue;
    }
    for (uint32_t k = 0; k < s.n; ++k)
      for (int32_t fb : t.byte_fallback[static_cast<uint8_t>(word[s.start + k])])
        if (fb != kTokenNull) out.push_back(fb);
  }
}

}  // namespace kiln::tok
