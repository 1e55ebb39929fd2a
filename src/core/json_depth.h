// core/json_depth.h: how deeply a JSON text nests its arrays and objects, counted on the raw
// bytes before any parse. nlohmann's parser and destructor are iterative, but copying a parsed
// value, converting it (to a template Value, to a grammar) and dumping it recurse once per
// level: a request of a few MB of '[' would run them off the stack. Every JSON text from
// outside (request bodies, tool-call arguments, model output parsed as JSON, files and options
// a user names) is checked against kMaxJsonDepth first and refused with one line.
#pragma once

#include <string_view>

namespace kiln {

// Deeper than any real schema, message or tool call; shallow enough for every recursive walk.
inline constexpr int kMaxJsonDepth = 256;

// The deepest nesting of '[' and '{' in `text` outside strings (escapes honoured); counting
// stops once it passes `limit`, so a hostile text costs one pass at most. Not a validator:
// malformed text is the parser's to refuse.
int json_nesting_depth(std::string_view text, int limit = kMaxJsonDepth);

// The one-line reason for refusing a text nested deeper than kMaxJsonDepth.
inline constexpr std::string_view kJsonTooDeep =
    "JSON nested deeper than 256 levels of arrays and objects";
static_assert(kMaxJsonDepth == 256, "kJsonTooDeep names the limit");

}  // namespace kiln
