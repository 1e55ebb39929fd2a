// tokenizer/jinja/parser.h: builds the statement/expression tree from lexer tokens with
// Jinja2's grammar and operator precedence.
#pragma once

#include <string_view>

#include "tokenizer/jinja/ast.h"

namespace kiln::jinja {

// Throws jinja::Error("TemplateSyntaxError", ...) on malformed templates.
Template parse(std::string_view source);

}  // namespace kiln::jinja
