// tokenizer/unicode.cpp: UTF-8 decoding/encoding, whitespace and category flags (utf8proc),
// and the GPT-2 byte-level map.
#include "tokenizer/unicode.h"

#include <utf8proc.h>

#include <array>

namespace kiln::tok {

uint32_t decode_utf8(std::string_view s, size_t& offset) {
  const auto at = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t b0 = at(offset);
  const auto cont = [&](size_t i) {
    return offset + i < s.size() && (at(offset + i) & 0xC0) == 0x80;
  };
  uint32_t cpt;
  size_t n;
  if (!(b0 & 0x80)) {
    offset += 1;
    return b0;
  } else if (!(b0 & 0x40)) {
    n = 0;
  } else if (!(b0 & 0x20)) {
    n = cont(1) ? 2 : 0;
    cpt = ((b0 & 0x1Fu) << 6) | (n ? (at(offset + 1) & 0x3Fu) : 0);
  } else if (!(b0 & 0x10)) {
    n = cont(1) && cont(2) ? 3 : 0;
    if (n) cpt = ((b0 & 0x0Fu) << 12) | ((at(offset + 1) & 0x3Fu) << 6) | (at(offset + 2) & 0x3Fu);
  } else if (!(b0 & 0x08)) {
    n = cont(1) && cont(2) && cont(3) ? 4 : 0;
    if (n)
      cpt = ((b0 & 0x07u) << 18) | ((at(offset + 1) & 0x3Fu) << 12) |
            ((at(offset + 2) & 0x3Fu) << 6) | (at(offset + 3) & 0x3Fu);
  } else {
    n = 0;
  }
  if (n == 0) {
    offset += 1;
    return kReplacementChar;
  }
  offset += n;
  if ((cpt >= 0xD800 && cpt <= 0xDFFF) || cpt > 0x10FFFF) return kReplacementChar;
  return cpt;
}

void append_utf8(uint32_t cpt, std::string& out) {
  if (cpt <= 0x7F) {
    out.push_back(static_cast<char>(cpt));
  } else if (cpt <= 0x7FF) {
    out.push_back(static_cast<char>(0xC0 | (cpt >> 6)));
    out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
  } else if (cpt <= 0xFFFF) {
    out.push_back(static_cast<char>(0xE0 | (cpt >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cpt >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cpt >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cpt >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cpt >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
  }
}

bool canonicalize_utf8(std::string_view s, std::string& out) {
  // Fast scan: ASCII runs and well-formed shortest sequences need no rewrite.
  size_t i = 0;
  while (i < s.size()) {
    const uint8_t b = static_cast<uint8_t>(s[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    size_t j = i;
    const uint32_t cpt = decode_utf8(s, j);
    const size_t len = cpt < 0x80 ? 1 : cpt < 0x800 ? 2 : cpt < 0x10000 ? 3 : 4;
    // Overlong forms decode to a shorter encoding; U+FFFD may stand for an invalid sequence.
    if (len != j - i || (cpt == kReplacementChar && s.compare(i, 3, "\xEF\xBF\xBD") != 0)) break;
    i = j;
  }
  if (i == s.size()) return false;
  out.assign(s.substr(0, i));
  while (i < s.size()) append_utf8(decode_utf8(s, i), out);
  return true;
}

bool is_whitespace(uint32_t c) {
  if (c <= 0x7F) return (c >= 0x09 && c <= 0x0D) || c == 0x20;
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

CptFlags cpt_flags(uint32_t cpt) {
  CptFlags f;
  f.whitespace = is_whitespace(cpt);
  if (cpt > 0x10FFFF) {
    f.undefined = true;
    return f;
  }
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cpt))) {
    case UTF8PROC_CATEGORY_CN:
      f.undefined = true;
      break;
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
      f.letter = true;
      break;
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
      f.mark = true;
      break;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
      f.number = true;
      break;
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO:
      f.punctuation = true;
      break;
    case UTF8PROC_CATEGORY_SM:
    case UTF8PROC_CATEGORY_SC:
    case UTF8PROC_CATEGORY_SK:
    case UTF8PROC_CATEGORY_SO:
      f.symbol = true;
      break;
    case UTF8PROC_CATEGORY_ZS:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
      f.separator = true;
      break;
    default:
      f.control = true;
      break;  // Cc Cf Cs Co
  }
  return f;
}

uint32_t to_lower(uint32_t cpt) {
  if (cpt > 0x10FFFF) return cpt;
  return static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cpt)));
}

uint32_t nfd_first(uint32_t cpt) {
  if (cpt < 0xC0 || cpt > 0x10FFFF) return cpt;
  utf8proc_int32_t buf[8];
  int last = 0;
  const utf8proc_ssize_t n = utf8proc_decompose_char(static_cast<utf8proc_int32_t>(cpt), buf, 8,
                                                     UTF8PROC_DECOMPOSE, &last);
  return n > 0 ? static_cast<uint32_t>(buf[0]) : cpt;
}

namespace {
struct ByteMap {
  std::array<uint32_t, 256> to_cpt{};
  std::array<std::string, 256> to_utf8;
  std::array<int16_t, 512> from_cpt{};  // every mapped code point is < 512
  ByteMap() {
    from_cpt.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_cpt[b] = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      from_cpt[to_cpt[b]] = static_cast<int16_t>(b);
      append_utf8(to_cpt[b], to_utf8[b]);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}
}  // namespace

uint32_t byte_to_cpt(uint8_t b) { return byte_map().to_cpt[b]; }
int cpt_to_byte(uint32_t cpt) { return cpt < 512 ? byte_map().from_cpt[cpt] : -1; }
const std::string& byte_to_utf8(uint8_t b) { return byte_map().to_utf8[b]; }

}  // namespace kiln::tok
