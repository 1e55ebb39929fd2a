// tokenizer/tokenizer.cpp: encode/decode around the per-model algorithms: special-token
// partitioning (llama.cpp's tokenizer_st_partition), BOS/EOS, detokenisation, accessors.
#include "tokenizer/tokenizer.h"

#include <algorithm>

#include "tokenizer/tokenizer_impl.h"

namespace kiln {
namespace {

struct Fragment {
  int32_t token;  // kTokenNull: raw text [off, off + len)
  uint32_t off, len;
};

bool is_c_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

// Splits the text at every occurrence of each special token, longest tokens first, exactly in
// llama.cpp's order (which decides overlaps). Control and unknown tokens only count when
// parse_special is set; user-defined ones always do.
std::vector<Fragment> partition(const Tokenizer::Impl& v, std::string_view text,
                                bool parse_special) {
  std::vector<Fragment> frags{{kTokenNull, 0, static_cast<uint32_t>(text.size())}};
  if (v.special_tokens.empty() || text.empty()) return frags;
  // Which byte pairs occur at all: most special tokens can be skipped without a scan.
  std::vector<uint64_t> pairs(65536 / 64, 0);
  for (size_t i = 0; i + 1 < text.size(); ++i) {
    const unsigned p = (static_cast<uint8_t>(text[i]) << 8) | static_cast<uint8_t>(text[i + 1]);
    pairs[p >> 6] |= uint64_t{1} << (p & 63);
  }
  std::vector<Fragment> next;
  for (const int32_t id : v.special_tokens) {
    const uint32_t attr = v.attrs[id];
    if (!parse_special && (attr & (kAttrControl | kAttrUnknown))) continue;
    const std::string& tok = v.texts[id];
    if (tok.empty() || tok.size() > text.size()) continue;
    if (tok.size() >= 2) {
      const unsigned p = (static_cast<uint8_t>(tok[0]) << 8) | static_cast<uint8_t>(tok[1]);
      if (!(pairs[p >> 6] & (uint64_t{1} << (p & 63)))) continue;
    }
    next.clear();
    for (const Fragment& f : frags) {
      if (f.token != kTokenNull) {
        next.push_back(f);
        continue;
      }
      size_t base = f.off, len = f.len;
      while (true) {
        const size_t m = text.substr(0, base + len).find(tok, base);
        if (m == std::string_view::npos) {
          if (len > 0)
            next.push_back({kTokenNull, static_cast<uint32_t>(base), static_cast<uint32_t>(len)});
          break;
        }
        if (m > base) {
          size_t left = m - base;
          if (attr & kAttrLstrip)
            while (left > 0 && is_c_space(text[base + left - 1])) --left;
          if (left > 0)
            next.push_back({kTokenNull, static_cast<uint32_t>(base), static_cast<uint32_t>(left)});
        }
        next.push_back({id, 0, 0});
        size_t roff = m + tok.size();
        size_t rlen = base + len - roff;
        if (attr & kAttrRstrip)
          while (rlen > 0 && is_c_space(text[roff])) ++roff, --rlen;
        base = roff;
        len = rlen;
      }
    }
    frags.swap(next);
  }
  return frags;
}

}  // namespace

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  const Impl& v = *impl_;
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  const std::vector<Fragment> frags =
      text.empty() ? std::vector<Fragment>{} : partition(v, text, parse_special);
  const auto raw = [&](const Fragment& f) { return text.substr(f.off, f.len); };
  if (add_special && v.add_bos) out.push_back(v.bos);
  switch (v.type) {
    case VocabType::kSpm: {
      bool prev_special = true;  // the first text gets the prefix space too
      for (const Fragment& f : frags) {
        if (f.token == kTokenNull) {
          tok::spm_encode(v, raw(f), v.add_space_prefix && prev_special, out);
          prev_special = false;
        } else {
          out.push_back(f.token);
          prev_special = true;
        }
      }
      break;
    }
    case VocabType::kBpe: {
      tok::BpeSession session(v);
      for (const Fragment& f : frags) {
        if (f.token == kTokenNull)
          session.encode(raw(f), out);
        else
          out.push_back(f.token);
      }
      break;
    }
    case VocabType::kWpm:
      for (const Fragment& f : frags) {
        if (f.token == kTokenNull)
          tok::wpm_encode(v, raw(f), out);
        else
          out.push_back(f.token);
      }
      break;
  }
  if (add_special && v.add_eos) out.push_back(v.eos);
  if (add_special && v.add_sep) out.push_back(v.sep);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool remove_special) const {
  const Impl& v = *impl_;
  std::string out;
  // Encoding put one space before the text that starts the input or follows a special token
  // (add_space_prefix); take exactly that space back off.
  bool after_special = true;
  for (const int32_t id : ids) {
    if (id < 0 || id >= v.n_vocab()) continue;
    const uint32_t a = v.attrs[id];
    if (a & (kAttrControl | kAttrUserDefined)) {
      after_special = true;
      if (!(remove_special && (a & kAttrControl))) out += v.pieces[id];
      continue;
    }
    if (remove_special && (a & kAttrUnknown)) continue;
    std::string_view piece = v.pieces[id];
    if (v.add_space_prefix && after_special && !piece.empty() && piece[0] == ' ')
      piece.remove_prefix(1);
    after_special = false;
    out += piece;
  }
  return out;
}

std::string Tokenizer::token_to_piece(int32_t id, bool special) const {
  const Impl& v = *impl_;
  if (id < 0 || id >= v.n_vocab()) return {};
  if (!special && (v.attrs[id] & (kAttrControl | kAttrUnknown))) return {};
  return v.pieces[id];
}

const std::string& Tokenizer::token_text(int32_t id) const {
  static const std::string empty;
  if (id < 0 || id >= impl_->n_vocab()) return empty;
  return impl_->texts[id];
}

int32_t Tokenizer::find_token(std::string_view text) const { return impl_->find(text); }
int32_t Tokenizer::n_vocab() const { return impl_->n_vocab(); }
VocabType Tokenizer::type() const { return impl_->type; }
const std::string& Tokenizer::pre_type() const { return impl_->pre_name; }
int32_t Tokenizer::bos() const { return impl_->bos; }
int32_t Tokenizer::eos() const { return impl_->eos; }
int32_t Tokenizer::eot() const { return impl_->eot; }
int32_t Tokenizer::unk() const { return impl_->unk; }
int32_t Tokenizer::pad() const { return impl_->pad; }
int32_t Tokenizer::sep() const { return impl_->sep; }
bool Tokenizer::add_bos() const { return impl_->add_bos; }
bool Tokenizer::add_eos() const { return impl_->add_eos; }
bool Tokenizer::add_space_prefix() const { return impl_->add_space_prefix; }

uint32_t Tokenizer::attr(int32_t id) const {
  return id >= 0 && id < impl_->n_vocab() ? impl_->attrs[id] : 0u;
}
float Tokenizer::score(int32_t id) const {
  return id >= 0 && id < impl_->n_vocab() ? impl_->scores[id] : 0.0f;
}
bool Tokenizer::is_control(int32_t id) const { return (attr(id) & kAttrControl) != 0; }
bool Tokenizer::is_eog(int32_t id) const {
  return id != kTokenNull && std::binary_search(impl_->eog.begin(), impl_->eog.end(), id);
}
std::span<const int32_t> Tokenizer::eog_ids() const { return impl_->eog; }

}  // namespace kiln
