// tests/chat/tool_grammar_test.cpp: the grammar of a forced tool call (engine/tool_calls.h
// tool_call_gbnf) without a model: per format, the canonical call text is a sentence of the
// grammar and parses back into the call; a call of another function, extra text before the
// call, arguments off the schema or a second call where one is allowed are not.
#include <gtest/gtest.h>

#include <string>

#include "engine/tool_calls.h"
#include "grammar/grammar.h"
#include "grammar/matcher.h"

namespace kiln {
namespace {

using ojson = nlohmann::ordered_json;

const ojson kTools = ojson::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
   "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}},
  {"type": "function", "function": {"name": "now"}}])");

// Whether `text` is a whole sentence of the grammar.
bool complete(const std::string& gbnf, const std::string& text) {
  auto g = grammar::Grammar::parse(gbnf);
  EXPECT_TRUE(g.has_value()) << (g ? "" : g.error()) << "\n" << gbnf;
  if (!g) return false;
  grammar::Matcher m(*g);
  return m.advance(text).is_ok() && m.accepting();
}

struct Case {
  ToolFormat format;
  const char* template_source;  // only its markers matter
  std::string weather_call;     // get_weather(city=Oslo) as the grammar writes it
  std::string now_call;         // now()
  std::string two_calls;        // both, as the format separates them ("" : one call only)
};

TEST(ToolCallGrammar, EachFormatsCallIsASentenceThatParsesBack) {
  const std::vector<Case> cases = {
      {ToolFormat::kHermes, "<tool_call>",
       "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
       "\"Oslo\"}}\n</tool_call>",
       "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
       "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": "
       "\"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"},
      {ToolFormat::kLlama3, "<|python_tag|>",
       "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
       "{\"name\": \"now\", \"parameters\": {}}", ""},
      {ToolFormat::kMistral, "[TOOL_CALLS] [ARGS]",
       "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\"}", "[TOOL_CALLS]now[ARGS]{}",
       "[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]now[ARGS]{}"},
      {ToolFormat::kMistral, "[TOOL_CALLS]",
       "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}, \"id\": "
       "\"a1b2c3d4e\"}]",
       "[TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}}]",
       "[TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}}, {\"name\": \"now\", \"arguments\": "
       "{}}]"},
  };
  for (const Case& c : cases) {
    const std::string where = std::string(tool_format_name(c.format)) + " " + c.template_source;
    auto any = tool_call_gbnf(c.format, c.template_source, kTools, "", /*parallel=*/true);
    ASSERT_TRUE(any.has_value()) << where << ": " << any.error();
    auto one = tool_call_gbnf(c.format, c.template_source, kTools, "", /*parallel=*/false);
    ASSERT_TRUE(one.has_value()) << where;
    auto named = tool_call_gbnf(c.format, c.template_source, kTools, "now", true);
    ASSERT_TRUE(named.has_value()) << where;

    EXPECT_TRUE(complete(*any, c.weather_call)) << where << "\n" << *any;
    EXPECT_TRUE(complete(*one, c.now_call)) << where;
    EXPECT_TRUE(complete(*named, c.now_call)) << where;
    EXPECT_FALSE(complete(*named, c.weather_call)) << where << ": not the named function";
    EXPECT_FALSE(complete(*any, "Sure! " + c.weather_call)) << where << ": text before the call";
    std::string off_schema = c.weather_call;
    off_schema.replace(off_schema.find("Oslo"), 4, "Rome");
    EXPECT_FALSE(complete(*any, off_schema)) << where << ": city outside the enum";
    if (!c.two_calls.empty()) {
      EXPECT_TRUE(complete(*any, c.two_calls)) << where;
      EXPECT_FALSE(complete(*one, c.two_calls)) << where << ": one call only";
    }
    // What the grammar produces, the format's parser reads back.
    const ToolReply r = parse_tool_reply(c.format, c.weather_call);
    ASSERT_EQ(r.tool_calls.size(), 1u) << where;
    EXPECT_EQ(r.tool_calls[0].name, "get_weather") << where;
    EXPECT_EQ(r.tool_calls[0].arguments, R"({"city":"Oslo"})") << where;
    EXPECT_EQ(r.content, "") << where;
  }
}

TEST(ToolCallGrammar, RefusalsNameWhatIsWrong) {
  auto glm = tool_call_gbnf(ToolFormat::kGlm, "<tool_call><arg_key>", kTools, "", true);
  ASSERT_FALSE(glm.has_value());
  EXPECT_NE(glm.error().find("'glm'"), std::string::npos) << glm.error();
  auto unknown = tool_call_gbnf(ToolFormat::kHermes, "", kTools, "later", true);
  ASSERT_FALSE(unknown.has_value());
  EXPECT_NE(unknown.error().find("'later'"), std::string::npos) << unknown.error();
  ojson bad = kTools;
  bad[0]["function"]["parameters"]["properties"]["city"] = {{"type", "string"}, {"format", "uri"}};
  auto schema = tool_call_gbnf(ToolFormat::kHermes, "", bad, "", true);
  ASSERT_FALSE(schema.has_value());
  EXPECT_NE(schema.error().find("tools[0].function.parameters"), std::string::npos)
      << schema.error();
  EXPECT_NE(schema.error().find("format"), std::string::npos) << schema.error();
}

}  // namespace
}  // namespace kiln
