// grammar/json_schema.h: JSON Schema -> GBNF, for OpenAI's response_format (json_schema and
// json_object). The grammar's sentences are compact-or-indented JSON texts that validate
// against the schema; the root value has no trailing whitespace, so the grammar is complete
// (and generation ends) at its last byte.
//
// Supported: type (one or a list), object (properties in their written order, required,
// additionalProperties false or absent -- only the listed properties are produced -- or a
// schema / true when there are no properties: a map), array (items, minItems, maxItems),
// string (minLength, maxLength), number, integer, boolean, null, enum, const, anyOf, oneOf
// (as anyOf: alternatives are not checked for overlap), $ref to #/$defs/... or
// #/definitions/... (recursion allowed) and #, and the annotations (title, description,
// default, examples, $schema, $id, $comment, deprecated, readOnly, writeOnly). Anything
// else (pattern, format, minimum, allOf, ...) is an error naming the keyword and where it is:
// a schema is never half applied. Numbers have at most 16 integer and 16 fraction digits.
#pragma once

#include <nlohmann/json.hpp>

#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace kiln::grammar {

// Several schemas in one grammar (a tool call: one arguments schema per function, inside the
// format's own syntax). Rule names stay unique over everything added; shared building blocks
// (ws, string, value, ...) are defined once.
class SchemaGrammar {
 public:
  // Adds the rules whose sentences are the JSON texts `schema` describes; returns the name of
  // the rule that matches them. Errors as json_schema_to_gbnf's (nothing is added then).
  Expected<std::string> add_schema(const nlohmann::ordered_json& schema, std::string_view hint);
  // Adds a rule with a GBNF body of the caller's; returns its name (`hint`, made unique; hint
  // must be a valid rule name).
  std::string add_rule(std::string_view hint, std::string body);
  // The GBNF text: `root ::= root_body`, then every rule added.
  std::string gbnf(std::string_view root_body) const;

 private:
  std::set<std::string> defined_;
  std::vector<std::pair<std::string, std::string>> order_;  // rules in definition order
};

// GBNF text whose root matches exactly the JSON texts `schema` describes (within the
// supported subset). Errors: "json_schema: <where>: <what>", one line.
Expected<std::string> json_schema_to_gbnf(const nlohmann::ordered_json& schema);

// Any JSON object ({"type": "json_object"}).
std::string json_object_gbnf();

}  // namespace kiln::grammar
