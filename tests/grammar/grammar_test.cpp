// tests/grammar/grammar_test.cpp: the GBNF parser (valid grammars, one-line errors), the
// matcher (strings accepted and refused, UTF-8 split across tokens), the token mask against a
// per-token oracle, and JSON Schema -> GBNF (valid instances accepted, invalid refused).
#include <gtest/gtest.h>

#include <random>

#include "grammar/grammar.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"

namespace kiln::grammar {
namespace {

std::shared_ptr<const Grammar> compile(std::string_view text) {
  auto g = Grammar::parse(text);
  EXPECT_TRUE(g.has_value()) << g.error();
  return g ? *g : nullptr;
}

// The whole string is a sentence of the grammar.
bool full_match(const std::shared_ptr<const Grammar>& g, std::string_view s) {
  Matcher m(g);
  return m.advance(s).is_ok() && m.accepting();
}
bool prefix_ok(const std::shared_ptr<const Grammar>& g, std::string_view s) {
  Matcher m(g);
  return m.advance(s).is_ok();
}

TEST(Gbnf, LiteralsClassesAndRepetition) {
  auto g = compile(R"(# a comment
root ::= "ab" [0-9]+ tail? ("x" | "y"){2,3}  # trailing comment
tail ::= [^a-z\n] "\x41\u00e9"
)");
  ASSERT_TRUE(g);
  EXPECT_TRUE(full_match(g, "ab1xy"));
  EXPECT_TRUE(full_match(g, "ab123yyx"));
  EXPECT_TRUE(full_match(g, "ab9-A\xC3\xA9xx"));
  EXPECT_FALSE(full_match(g, "ab1x"));     // {2,3}: too few
  EXPECT_FALSE(full_match(g, "ab1xyxy"));  // too many
  EXPECT_FALSE(full_match(g, "abxy"));     // + needs a digit
  EXPECT_FALSE(full_match(g, "ab1qAxx"));  // q is in a-z
  EXPECT_TRUE(prefix_ok(g, "ab12"));
  EXPECT_FALSE(prefix_ok(g, "b"));
}

TEST(Gbnf, NestedGroupsNewlinesAndAnyChar) {
  auto g = compile("root ::= (\n  \"[\" item (\",\" item)*\n  \"]\"\n)\nitem ::= . .?\n");
  ASSERT_TRUE(g);
  EXPECT_TRUE(full_match(g, "[a,bc,\xE2\x82\xAC]"));
  EXPECT_FALSE(full_match(g, "[abc]"));
  EXPECT_FALSE(full_match(g, "[]"));
}

TEST(Gbnf, EmptyAlternativeAndExactCounts) {
  auto g = compile("root ::= \"a\"{3} | \n");
  ASSERT_TRUE(g);
  EXPECT_TRUE(full_match(g, ""));
  EXPECT_TRUE(full_match(g, "aaa"));
  EXPECT_FALSE(full_match(g, "aa"));
  EXPECT_FALSE(full_match(g, "aaaa"));
}

TEST(Gbnf, MultiByteClassesSplitAcrossTokens) {
  // Code points spanning 1-4 byte encodings; negation must keep every other scalar value.
  auto g = compile("root ::= [a\\u00e9-\\u4e00\\U0001F600]+\n");
  ASSERT_TRUE(g);
  EXPECT_TRUE(full_match(g, "a\xC3\xA9\xE4\xB8\x80\xF0\x9F\x98\x80"));
  EXPECT_FALSE(full_match(g, "b"));
  EXPECT_FALSE(full_match(g, "\xE4\xB8\x81"));  // U+4E01, just above the range
  Matcher m(g);
  ASSERT_TRUE(m.advance("\xF0\x9F").is_ok());  // half a character: not complete yet
  EXPECT_FALSE(m.accepting());
  EXPECT_FALSE(m.accepts("\x98\x81"));  // U+1F601
  ASSERT_TRUE(m.advance("\x98\x80").is_ok());
  EXPECT_TRUE(m.accepting());

  auto neg = compile("root ::= [^\"\\\\]*\n");
  ASSERT_TRUE(neg);
  EXPECT_TRUE(full_match(neg, "x\xC3\xA9\xF4\x8F\xBF\xBF\xEE\x80\x80"));  // U+10FFFF, U+E000
  EXPECT_FALSE(full_match(neg, "\xED\xA0\x80"));                          // a surrogate
  EXPECT_FALSE(full_match(neg, "\xC0\x80"));                              // overlong
  EXPECT_FALSE(full_match(neg, "a\"b"));
}

TEST(Gbnf, RecursionRunsAndLeftRecursionIsRefused) {
  auto g = compile("root ::= \"(\" root \")\" | \"x\"\n");
  ASSERT_TRUE(g);
  EXPECT_TRUE(full_match(g, "((((x))))"));
  EXPECT_FALSE(full_match(g, "((x)"));
  // A long right-recursive run stays cheap (tail references do not grow the stack).
  auto star = compile("root ::= \"a\"*\n");
  Matcher m(star);
  ASSERT_TRUE(m.advance(std::string(100000, 'a')).is_ok());
  EXPECT_TRUE(m.accepting());
}

// Nested repetitions of one thing make the parse stacks grow exponentially: the byte that
// would need too many is refused with a message saying so, in bounded time.
TEST(Matcher, TooAmbiguousGrammarIsRefusedNotSlow) {
  auto g = compile(
      "root ::= ((((((((((((((((((((\"a\"+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+ \"b\"\n");
  ASSERT_TRUE(g);
  Matcher m(g);
  Status st;
  for (int i = 0; i < 40 && st.is_ok(); ++i) st = m.advance("a");
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("too ambiguous"), std::string::npos) << st.message();
  Matcher plain(compile("root ::= \"a\"+\n"));
  st = plain.advance("ab");
  EXPECT_NE(st.message().find("does not continue"), std::string::npos) << st.message();
}

TEST(Gbnf, ErrorsAreOneLineAndSayWhere) {
  struct Case {
    const char* text;
    const char* want;
  };
  const Case cases[] = {
      {"", "no rules"},
      {"rot ::= \"a\"\n", "no rule named 'root'"},
      {"root ::= foo\n", "line 1 col 10: rule 'foo' is not defined"},
      {"root ::= \"a\n", "unterminated string literal"},
      {"root ::= [a-", "unterminated character class"},
      {"root ::= [z-a]\n", "is reversed"},
      {"root ::= \"a\"{3,1}\n", "max < min"},
      {"root ::= \"a\"{5000}\n", "above the limit"},
      {"root ::= (\"a\"\n", "expected ')'"},
      {"root ::= \"a\" )\n", "expected the end of rule 'root'"},
      {"root = \"a\"\n", "expected '::=' after the rule name"},
      {"root ::= \"\\q\"\n", "unknown escape"},
      {"root ::= \"\\uD800\"\n", "not a Unicode scalar value"},
      {"root ::= \"\xC3\"\n", "invalid UTF-8"},
      {"root ::= \"a\"\nroot ::= \"b\"\n", "defined twice"},
      {"root ::= root \"a\" | \"b\"\n", "left-recursive"},
      {"root ::= (\"a\"?)*\n", "left-recursive"},
      {"root ::= a\na ::= b \"x\"\nb ::= \"y\"? a\n", "left-recursive"},
      {"root ::= ((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((\"a\"",
       "nested deeper"},
      {"root ::= (\"a\"{1000}){1000}{1000}\n", "more than"},
  };
  for (const Case& c : cases) {
    auto g = Grammar::parse(c.text);
    ASSERT_FALSE(g.has_value()) << c.text;
    EXPECT_NE(g.error().find(c.want), std::string::npos) << c.text << " -> " << g.error();
    EXPECT_EQ(g.error().find('\n'), std::string::npos) << g.error();
    EXPECT_EQ(g.error().rfind("grammar: ", 0), 0u) << g.error();
  }
}

// A small vocabulary with multi-byte and partial-UTF-8 pieces, an end token and a control
// token with no text.
TokenTrie test_vocab() {
  std::vector<std::string> pieces = {
      "",   "{", "}",    "\"",   ":",        " ",     "a",        "ab",   "b", "\"a", "{\"", "\":",
      "12", "1", "\xC3", "\xA9", "\xC3\xA9", "x\xE2", "\x82\xAC", "true", "t", "rue", "}\n"};
  const int32_t eog[] = {0};
  pieces[0] = "";        // id 0: the end-of-generation token (no bytes)
  pieces.push_back("");  // a control token: never allowed
  return TokenTrie(pieces, eog);
}

TEST(Matcher, MaskAgreesWithPerTokenOracle) {
  const TokenTrie vocab = test_vocab();
  auto g = compile(R"(root ::= "{" ws ("\"" [a-z\u00e9\u20ac]* "\"" ws ":" ws val)? ws "}"
val ::= "true" | [0-9]+
ws ::= " "?
)");
  ASSERT_TRUE(g);
  std::mt19937 rng(7);
  for (int run = 0; run < 50; ++run) {
    Matcher m(g);
    for (int step = 0; step < 30; ++step) {
      std::vector<uint8_t> mask;
      const int32_t n = m.fill_mask(vocab, mask);
      int32_t count = 0;
      for (int32_t id = 0; id < vocab.n_vocab(); ++id) {
        EXPECT_EQ(mask[size_t(id)] != 0, m.accepts_token(vocab, id)) << "token " << id;
        count += mask[size_t(id)];
      }
      EXPECT_EQ(n, count);
      EXPECT_EQ(mask[size_t(vocab.n_vocab() - 1)], 0);  // the control token
      EXPECT_EQ(mask[0] != 0, m.accepting());
      std::vector<int32_t> ok;
      for (int32_t id = 1; id < vocab.n_vocab(); ++id)
        if (mask[size_t(id)]) ok.push_back(id);
      if (ok.empty()) break;
      const int32_t pick = ok[rng() % ok.size()];
      ASSERT_TRUE(m.advance_token(vocab, pick).is_ok());
    }
  }
}

TEST(Matcher, EndOfGenerationOnlyWhenComplete) {
  const TokenTrie vocab = test_vocab();
  auto g = compile("root ::= \"{\" \"}\"\n");
  Matcher m(g);
  EXPECT_FALSE(m.accepts_token(vocab, 0));
  EXPECT_FALSE(m.advance_token(vocab, 0).is_ok());
  ASSERT_TRUE(m.advance_token(vocab, 1).is_ok());
  EXPECT_FALSE(m.accepting());
  EXPECT_TRUE(m.can_continue());
  ASSERT_TRUE(m.advance_token(vocab, 2).is_ok());
  EXPECT_TRUE(m.accepting());
  EXPECT_FALSE(m.can_continue());  // nothing more may follow: the request is complete
  std::vector<uint8_t> mask;
  EXPECT_EQ(m.fill_mask(vocab, mask), 1);
  EXPECT_EQ(mask[0], 1);
  EXPECT_FALSE(m.advance_token(vocab, 22).is_ok());  // "}\n": state unchanged
  EXPECT_TRUE(m.accepting());
}

// ---------------------------------------------------------------- JSON Schema

std::shared_ptr<const Grammar> schema_grammar(const char* schema) {
  auto gbnf = json_schema_to_gbnf(nlohmann::ordered_json::parse(schema));
  EXPECT_TRUE(gbnf.has_value()) << gbnf.error();
  if (!gbnf) return nullptr;
  auto g = Grammar::parse(*gbnf);
  EXPECT_TRUE(g.has_value()) << g.error() << "\n" << *gbnf;
  return g ? *g : nullptr;
}

TEST(JsonSchema, ObjectWithRequiredAndOptionalProperties) {
  auto g = schema_grammar(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 5},
      "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 2},
      "ok": {"type": "boolean"},
      "score": {"type": ["number", "null"]}
    },
    "required": ["name", "ok"],
    "additionalProperties": false
  })");
  ASSERT_TRUE(g);
  for (const char* good :
       {R"({"name":"bob","ok":true})", R"({ "name": "", "age": -12, "ok": false })",
        R"({"name":"x","tags":["a",3],"ok":true,"score":null})",
        R"({"name":"x","ok":true,"score":-1.5e+3})",
        "{\n  \"name\": \"\\u00e9\",\n  \"ok\": true\n}"}) {
    EXPECT_TRUE(full_match(g, good)) << good;
    EXPECT_NO_THROW(nlohmann::json::parse(good));
  }
  for (const char* bad : {R"({"ok":true})",                                  // name missing
                          R"({"ok":true,"name":"x"})",                       // order
                          R"({"name":"toolong","ok":true})",                 // maxLength
                          R"({"name":"x","age":1.5,"ok":true})",             // integer
                          R"({"name":"x","tags":[],"ok":true})",             // minItems
                          R"({"name":"x","tags":["a","b","a"],"ok":true})",  // maxItems
                          R"({"name":"x","tags":["c"],"ok":true})",          // enum
                          R"({"name":"x","ok":true,"extra":1})",             // closed
                          R"({"name":"x","ok":true} )",                      // trailing space
                          R"({"name":"x","age":012,"ok":true})"}) {          // leading zero
    EXPECT_FALSE(full_match(g, bad)) << bad;
  }
}

TEST(JsonSchema, RefsAnyOfConstAndRecursion) {
  auto g = schema_grammar(R"({
    "$defs": {"node": {"type": "object", "properties": {
        "v": {"anyOf": [{"type": "integer"}, {"const": "leaf"}]},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
      "required": ["v"]}},
    "$ref": "#/$defs/node"
  })");
  ASSERT_TRUE(g);
  EXPECT_TRUE(full_match(g, R"({"v":1,"kids":[{"v":"leaf"},{"v":2,"kids":[]}]})"));
  EXPECT_FALSE(full_match(g, R"({"v":"tree"})"));
  EXPECT_FALSE(full_match(g, R"({"kids":[]})"));
}

TEST(JsonSchema, AnyObjectAndMaps) {
  auto g = Grammar::parse(json_object_gbnf());
  ASSERT_TRUE(g.has_value()) << g.error();
  EXPECT_TRUE(full_match(*g, R"({"a":[1,{"b":null}],"c":"\"x\"","d":-0.5})"));
  EXPECT_TRUE(full_match(*g, "{}"));
  EXPECT_FALSE(full_match(*g, "[1]"));
  EXPECT_FALSE(full_match(*g, R"({"a":tru})"));
  auto map = schema_grammar(R"({"type":"object","additionalProperties":{"type":"integer"}})");
  EXPECT_TRUE(full_match(map, R"({"x":1,"y":2})"));
  EXPECT_FALSE(full_match(map, R"({"x":"1"})"));
}

TEST(JsonSchema, UnsupportedKeywordsAreNamed) {
  struct Case {
    const char* schema;
    const char* want;
  };
  const Case cases[] = {
      {R"({"type":"string","pattern":"^a+$"})", "'pattern' is not supported"},
      {R"({"type":"string","format":"date"})", "'format' is not supported"},
      {R"({"type":"integer","minimum":0})", "'minimum' is not supported"},
      {R"({"allOf":[{"type":"string"}]})", "'allOf' is not supported"},
      {R"({"type":"object","properties":{"a":{"type":"string","pattern":"x"}}})",
       "at '#/properties/a': 'pattern'"},
      {R"({"$ref":"http://example.com/s.json"})", "is not supported"},
      {R"({"$ref":"#/$defs/missing"})", "points at nothing"},
      {R"({"type":"object","properties":{"a":{}},"required":["b"]})", "'b' is not in"},
      {R"({"type":"widget"})", "not a JSON Schema type"},
      {R"({"type":"array","maxItems":1,"minItems":2})", "below 'minItems'"},
      {R"(false)", "matches nothing"},
      // Names whose JSON escapes decode to control characters (found by fuzz_grammar): the
      // error quotes them with \xNN, one line.
      {R"({"type\\\nalProperties":false})", R"('type\\x0aalProperties' is not supported)"},
      {R"({"type":"object","properties":{"a\nb":{"type":"widget"}}})",
       R"(at '#/properties/a\x0ab')"},
      // A $ref reaching itself before any text (found by fuzz_grammar): refused, not GBNF
      // that does not compile.
      {R"({"$ref":"#"})", "left-recursive"},
      {R"({"$defs":{"a":{"anyOf":[{"$ref":"#/$defs/a"},{"type":"null"}]}},"$ref":"#/$defs/a"})",
       "left-recursive"},
  };
  for (const Case& c : cases) {
    auto r = json_schema_to_gbnf(nlohmann::ordered_json::parse(c.schema));
    ASSERT_FALSE(r.has_value()) << c.schema;
    EXPECT_NE(r.error().find(c.want), std::string::npos) << c.schema << " -> " << r.error();
    EXPECT_EQ(r.error().find('\n'), std::string::npos);
  }
}

}  // namespace
}  // namespace kiln::grammar
