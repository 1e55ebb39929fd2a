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

#include <string>

#include "core/status.h"

namespace kiln::grammar {

// GBNF text whose root matches exactly the JSON texts `schema` describes (within the
// supported subset). Errors: "json_schema: <where>: <what>", one line.
Expected<std::string> json_schema_to_gbnf(const nlohmann::ordered_json& schema);

// Any JSON object ({"type": "json_object"}).
std::string json_object_gbnf();

}  // namespace kiln::grammar
