// tokenizer/jinja/lexer.cpp: Jinja2's tokenizer rules (root / tag / comment / raw states).
// The whitespace rules follow jinja2/lexer.py: `-` strips all whitespace on that side, `+`
// disables lstrip/trim for the tag, lstrip_blocks removes the indentation before a block or
// comment tag that starts its line, trim_blocks eats one newline after a block or comment.
#include "tokenizer/jinja/lexer.h"

#include <fmt/format.h>

#include <cctype>

#include "tokenizer/jinja/value.h"

namespace kiln::jinja {
namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

[[noreturn]] void syntax_error(int line, std::string_view msg) {
  fail("TemplateSyntaxError", fmt::format("{} (line {})", msg, line));
}

// Jinja2 normalises \r\n and \r to \n and drops one trailing newline before lexing.
std::string normalize(std::string_view src, bool keep_trailing) {
  std::string out;
  out.reserve(src.size());
  for (size_t k = 0; k < src.size(); ++k) {
    if (src[k] == '\r') {
      out += '\n';
      if (k + 1 < src.size() && src[k + 1] == '\n') ++k;
    } else {
      out += src[k];
    }
  }
  if (!keep_trailing && !out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

// Python's "unicode-escape" decoding of a string literal body.
std::string unescape(std::string_view s, int line) {
  std::string out;
  for (size_t k = 0; k < s.size(); ++k) {
    char c = s[k];
    if (c != '\\' || k + 1 >= s.size()) {
      out += c;
      continue;
    }
    char e = s[++k];
    auto hex = [&](size_t n) -> char32_t {
      char32_t v = 0;
      for (size_t m = 1; m <= n; ++m) {
        if (k + m >= s.size() || !std::isxdigit(static_cast<unsigned char>(s[k + m])))
          syntax_error(line, "truncated escape in string");
        char h = s[k + m];
        v = v * 16 + static_cast<char32_t>(std::isdigit(static_cast<unsigned char>(h))
                                               ? h - '0'
                                               : (std::tolower(h) - 'a' + 10));
      }
      k += n;
      return v;
    };
    switch (e) {
      case '\n':
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
        utf8_append(out, hex(2));
        break;
      case 'u':
        utf8_append(out, hex(4));
        break;
      case 'U': {
        char32_t cp = hex(8);
        if (cp > 0x10FFFF) syntax_error(line, "illegal Unicode character in string");
        utf8_append(out, cp);
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          char32_t v = static_cast<char32_t>(e - '0');
          for (int m = 0; m < 2 && k + 1 < s.size() && s[k + 1] >= '0' && s[k + 1] <= '7'; ++m)
            v = v * 8 + static_cast<char32_t>(s[++k] - '0');
          utf8_append(out, v);
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  Lexer(std::string src, const LexOptions& opt) : src_(std::move(src)), opt_(opt) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      size_t start = src_.find('{', pos_);
      while (start != std::string::npos && start + 1 < src_.size() && src_[start + 1] != '{' &&
             src_[start + 1] != '%' && src_[start + 1] != '#')
        start = src_.find('{', start + 1);
      if (start == std::string::npos || start + 1 >= src_.size()) {
        emit_data(src_.substr(pos_));
        pos_ = src_.size();
        break;
      }
      char kind = src_[start + 1];
      size_t after = start + 2;
      char sign =
          (after < src_.size() && (src_[after] == '-' || src_[after] == '+')) ? src_[after] : 0;
      std::string text = src_.substr(pos_, start - pos_);
      bool raw = kind == '%' && is_raw_begin(after + (sign ? 1 : 0));
      text = strip_before(std::move(text), sign, kind != '{');
      emit_data(text);
      line_ += count_newlines(pos_, start);
      pos_ = after + (sign ? 1 : 0);
      line_starting_ = false;
      if (raw)
        lex_raw();
      else if (kind == '#')
        lex_comment();
      else
        lex_tag(kind);
    }
    toks_.push_back(Token{Token::Type::Eof, "", line_});
    return std::move(toks_);
  }

 private:
  std::string strip_before(std::string text, char sign, bool lstrip_applies) {
    if (sign == '-') {
      size_t e = text.size();
      while (e > 0 && is_space(text[e - 1])) --e;
      text.resize(e);
    } else if (sign != '+' && opt_.lstrip_blocks && lstrip_applies) {
      size_t nl = text.rfind('\n');
      size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting_) && l_pos < text.size()) {
        bool all_ws = true;
        for (size_t k = l_pos; k < text.size(); ++k)
          if (!is_space(text[k])) {
            all_ws = false;
            break;
          }
        if (all_ws) text.resize(l_pos);
      }
    }
    return text;
  }

  int count_newlines(size_t a, size_t b) const {
    int n = 0;
    for (size_t k = a; k < b && k < src_.size(); ++k) n += src_[k] == '\n';
    return n;
  }

  void emit_data(const std::string& text) {
    if (text.empty()) return;
    if (!toks_.empty() && toks_.back().type == Token::Type::Data)
      toks_.back().text += text;
    else
      toks_.push_back(Token{Token::Type::Data, text, line_});
  }

  // After the closing delimiter: `-` eats all following whitespace, plain block/comment
  // ends eat one newline under trim_blocks. Sets line_starting_ like jinja2's lexer.
  void after_end(char sign, bool trim_applies) {
    size_t start = pos_;
    if (sign == '-') {
      while (pos_ < src_.size() && is_space(src_[pos_])) ++pos_;
    } else if (sign != '+' && trim_applies && opt_.trim_blocks && pos_ < src_.size() &&
               src_[pos_] == '\n') {
      ++pos_;
    }
    line_ += count_newlines(start, pos_);
    line_starting_ = pos_ > start && src_[pos_ - 1] == '\n';
  }

  bool is_raw_begin(size_t p) const {
    while (p < src_.size() && is_space(src_[p])) ++p;
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    if (p < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[p])) || src_[p] == '_'))
      return false;
    while (p < src_.size() && is_space(src_[p])) ++p;
    return src_.compare(p, 2, "%}") == 0 || src_.compare(p, 3, "-%}") == 0;
  }

  void lex_raw() {
    // The opening tag: "raw" then "-%}" (eats whitespace) or "%}" (no trim_blocks here).
    while (is_space(src_[pos_])) ++pos_;
    pos_ += 3;
    while (is_space(src_[pos_])) ++pos_;
    if (src_[pos_] == '-') {
      pos_ += 3;
      after_end('-', false);
    } else {
      pos_ += 2;
      line_starting_ = false;
    }
    // Find "{%[-+]? endraw [-+]?%}".
    size_t search = pos_;
    for (;;) {
      size_t b = src_.find("{%", search);
      if (b == std::string::npos) syntax_error(line_, "Missing end of raw directive");
      size_t p = b + 2;
      char sign = (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ? src_[p] : 0;
      if (sign) ++p;
      while (p < src_.size() && is_space(src_[p])) ++p;
      if (src_.compare(p, 6, "endraw") != 0) {
        search = b + 2;
        continue;
      }
      p += 6;
      while (p < src_.size() && is_space(src_[p])) ++p;
      char esign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) esign = src_[p++];
      if (src_.compare(p, 2, "%}") != 0) {
        search = b + 2;
        continue;
      }
      std::string text = strip_before(src_.substr(pos_, b - pos_), sign, true);
      emit_data(text);
      line_ += count_newlines(pos_, p);
      pos_ = p + 2;
      after_end(esign, true);
      return;
    }
  }

  void lex_comment() {
    for (size_t p = pos_;; ++p) {
      p = src_.find("#}", p);
      if (p == std::string::npos) syntax_error(line_, "Missing end of comment tag");
      char sign = (p > pos_ && (src_[p - 1] == '-' || src_[p - 1] == '+')) ? src_[p - 1] : 0;
      line_ += count_newlines(pos_, p);
      pos_ = p + 2;
      after_end(sign, true);
      return;
    }
  }

  void lex_tag(char kind) {
    const bool block = kind == '%';
    toks_.push_back(Token{block ? Token::Type::BlockBegin : Token::Type::VarBegin, "", line_});
    const char close = block ? '%' : '}';
    int depth = 0;  // brackets: a '}' inside {{ {'a': 1} }} is not the end
    for (;;) {
      while (pos_ < src_.size() && is_space(src_[pos_])) {
        if (src_[pos_] == '\n') ++line_;
        ++pos_;
      }
      if (pos_ >= src_.size())
        syntax_error(line_, block ? "unexpected end of template, expected '%}'"
                                  : "unexpected end of template, expected '}}'");
      char c = src_[pos_];
      // End of tag, tried before operators as in jinja2 ("-%}" is not a minus), but only
      // while no bracket is open (jinja2's balancing stack).
      if (depth == 0) {
        char sign = 0;
        size_t e = pos_;
        const std::string end{close, '}'};
        if ((c == '-' || c == '+') && src_.compare(pos_ + 1, 2, end) == 0) {
          sign = c;
          e = pos_ + 1;
        }
        if (src_.compare(e, 2, end) == 0) {
          toks_.push_back(Token{block ? Token::Type::BlockEnd : Token::Type::VarEnd, "", line_});
          pos_ = e + 2;
          after_end(sign, block);
          return;
        }
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t s = pos_;
        while (pos_ < src_.size() &&
               (std::isalnum(static_cast<unsigned char>(src_[pos_])) || src_[pos_] == '_'))
          ++pos_;
        toks_.push_back(Token{Token::Type::Name, src_.substr(s, pos_ - s), line_});
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        lex_number();
      } else if (c == '\'' || c == '"') {
        size_t s = ++pos_;
        while (pos_ < src_.size() && src_[pos_] != c) {
          if (src_[pos_] == '\\') ++pos_;
          ++pos_;
        }
        if (pos_ >= src_.size()) syntax_error(line_, "unexpected end of string");
        std::string body = src_.substr(s, pos_ - s);
        ++pos_;
        toks_.push_back(Token{Token::Type::String, unescape(body, line_), line_});
        line_ += count_newlines(s, pos_);
      } else {
        static const char* const kOps2[] = {"**", "//", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* o : kOps2)
          if (src_.compare(pos_, 2, o) == 0) {
            op = o;
            break;
          }
        if (op.empty()) {
          if (std::string_view("+-/*%~[](){}<>=.:|,;").find(c) == std::string_view::npos)
            syntax_error(line_, fmt::format("unexpected char '{}'", c));
          op = std::string(1, c);
        }
        if (op == "(" || op == "[" || op == "{") ++depth;
        if ((op == ")" || op == "]" || op == "}") && depth > 0) --depth;
        pos_ += op.size();
        toks_.push_back(Token{Token::Type::Op, op, line_});
      }
    }
  }

  void lex_number() {
    size_t s = pos_;
    auto digits = [&] {
      while (pos_ < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[pos_])) ||
                                    (src_[pos_] == '_' && pos_ + 1 < src_.size() &&
                                     std::isdigit(static_cast<unsigned char>(src_[pos_ + 1])))))
        ++pos_;
    };
    digits();
    bool is_float = false;
    if (pos_ + 1 < src_.size() && src_[pos_] == '.' &&
        std::isdigit(static_cast<unsigned char>(src_[pos_ + 1])) &&
        !(s > 0 && src_[s - 1] == '.')) {
      ++pos_;
      digits();
      is_float = true;
    }
    if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      size_t p = pos_ + 1;
      if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
      if (p < src_.size() && std::isdigit(static_cast<unsigned char>(src_[p]))) {
        pos_ = p;
        digits();
        is_float = true;
      }
    }
    std::string text;
    for (size_t k = s; k < pos_; ++k)
      if (src_[k] != '_') text += src_[k];
    toks_.push_back(Token{is_float ? Token::Type::Float : Token::Type::Int, text, line_});
  }

  std::string src_;
  LexOptions opt_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> toks_;
};

}  // namespace

std::vector<Token> lex(std::string_view source, const LexOptions& opt) {
  return Lexer(normalize(source, opt.keep_trailing_newline), opt).run();
}

}  // namespace kiln::jinja
