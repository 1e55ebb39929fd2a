// tokenizer/jinja/lexer.h: splits template source into data and tag tokens the way Jinja2's
// lexer does with trim_blocks / lstrip_blocks on (whitespace control, raw blocks, comments).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kiln::jinja {

struct Token {
  enum class Type {
    Data,
    VarBegin,
    VarEnd,
    BlockBegin,
    BlockEnd,
    Name,
    String,
    Int,
    Float,
    Op,
    Eof
  };
  Type type = Type::Eof;
  std::string text;  // Data text, name, decoded string literal, number text or operator
  int line = 1;
};

struct LexOptions {
  bool trim_blocks = true;
  bool lstrip_blocks = true;
  bool keep_trailing_newline = false;
};

// Throws jinja::Error("TemplateSyntaxError", ...) on malformed source.
std::vector<Token> lex(std::string_view source, const LexOptions& opt = {});

}  // namespace kiln::jinja
