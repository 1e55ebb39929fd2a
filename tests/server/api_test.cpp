// tests/server/api_test.cpp: request parsing and validation without a model: each bad input
// gives a 400 naming the field; good input fills the struct; stop matching holds back text.
#include <gtest/gtest.h>

#include "core/json_depth.h"
#include "grammar/matcher.h"
#include "server/api.h"

namespace kiln::server {
namespace {

ApiError err_of(std::string_view body, bool chat) {
  auto r = parse_completion_request(body, chat, Limits{.max_tokens = 100});
  EXPECT_TRUE(std::holds_alternative<ApiError>(r)) << body;
  return std::holds_alternative<ApiError>(r) ? std::get<ApiError>(r) : ApiError{};
}

TEST(Api, RejectsBadRequestsNamingTheField) {
  struct Case {
    const char* body;
    bool chat;
    const char* param;
  } cases[] = {
      {"{", true, ""},
      {"[1,2]", true, ""},
      {R"({"messages": "hi"})", true, "messages"},
      {R"({"messages": []})", true, "messages"},
      {R"({})", true, "messages"},
      {R"({"messages": [{"role": "wizard", "content": "x"}]})", true, "messages[0].role"},
      {R"({"messages": [{"role": 3, "content": "x"}]})", true, "messages[0].role"},
      {R"({"messages": [{"role": "user", "content": 5}]})", true, "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", true,
       "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1})", true, "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", true, "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 101})", true,
       "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e30})", true,
       "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"})", true,
       "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999999999999})",
       true, "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 9})", true, "n"},
      {R"({"messages": [{"role": "user", "content": "x"}], "n": 0})", true, "n"},
      {R"({"messages": [{"role": "user", "content": "x"}], "temperature": 3})", true,
       "temperature"},
      {R"({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"})", true,
       "temperature"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_p": -0.1})", true, "top_p"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stream": 1})", true, "stream"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}})",
       true, "stream_options"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]})", true,
       "stop"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": [""]})", true, "stop"},
      {R"({"messages": [{"role": "user", "content": "x"}], "stop": 7})", true, "stop"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3})", true,
       "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21})",
       true, "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}})", true,
       "logit_bias"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 101}})", true,
       "logit_bias"},
      {R"({"messages": [{"role": "user", "content": "x"}], "seed": 1.5})", true, "seed"},
      {R"({"model": 5, "messages": [{"role": "user", "content": "x"}]})", true, "model"},
      {R"({})", false, "prompt"},
      {R"({"prompt": ""})", false, "prompt"},
      {R"({"prompt": ["a", "b"]})", false, "prompt"},
      {R"({"prompt": [1, -2]})", false, "prompt"},
      {R"({"prompt": {"x": 1}})", false, "prompt"},
      {R"({"prompt": "x", "logprobs": 30})", false, "logprobs"},
      // Fail closed: what the server does not implement is refused by name.
      {R"({"prompt": "x", "tools": []})", false, "tools"},
      {R"({"prompt": "x", "tool_choice": "auto"})", false, "tool_choice"},
      // Tools: shapes checked; forcing a call needs constrained decoding, refused.
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": {}})", true, "tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "code"}]})", true,
       "tools[0].type"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", true,
       "tools[0].function"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": ""}}]})",
       true, "tools[0].function.name"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]})",
       true, "tools[0].function.parameters"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})", true,
       "tool_choice"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": "f"}}})",
       true, "tool_choice"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"})", true,
       "tool_choice"},
      {R"({"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": 1})", true,
       "parallel_tool_calls"},
      {R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})", true,
       "messages[0].tool_calls"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]})", true,
       "messages[0].tool_calls[0].function"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]})",
       true, "messages[0].tool_calls[0].function.arguments"},
      {R"({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]})", true,
       "messages[0].tool_call_id"},
      {R"({"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]})", true,
       "messages[0].tool_call_id"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}})",
       true, "response_format"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "string", "pattern": "a+"}}}})",
       true, "response_format"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}})",
       true, "response_format"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object", "schema": {}}})",
       true, "response_format"},
      {R"({"prompt": "x", "grammar": "root ::= foo"})", false, "grammar"},
      {R"({"prompt": "x", "grammar": 5})", false, "grammar"},
      {R"({"prompt": "x", "grammar": "root ::= \"a\"", "json_schema": {}})", false, "json_schema"},
      {R"({"prompt": "x", "json_schema": {"type": "integer", "minimum": 3}})", false,
       "json_schema"},
      {R"({"messages": [{"role": "user", "content": "x"}], "unknown_field": [1]})", true,
       "unknown_field"},
      {R"({"messages": [{"role": "user", "content": "x"}], "prompt": "y"})", true, "prompt"},
      {R"({"prompt": "x", "echo": true})", false, "echo"},
      {R"({"prompt": "x", "messages": []})", false, "messages"},
      {R"({"prompt": "x", "top_k": -1})", false, "top_k"},
      {R"({"prompt": "x", "min_p": 1.5})", false, "min_p"},
      {R"({"prompt": "x", "repeat_penalty": -1})", false, "repeat_penalty"},
  };
  for (const Case& c : cases) {
    const ApiError e = err_of(c.body, c.chat);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.message;
    EXPECT_FALSE(e.message.empty());
    EXPECT_EQ(e.message.find('\n'), std::string::npos);
    const auto j = nlohmann::json::parse(error_body(e));
    EXPECT_EQ(j["error"]["message"], e.message);
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    EXPECT_TRUE(j["error"]["code"].is_string());
  }
}

TEST(Api, ParsesToolsAndToolMessages) {
  auto r = parse_completion_request(
      R"({"messages": [{"role": "user", "content": "Weather?"},
                       {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                        "type": "function", "function": {"name": "get_weather",
                        "arguments": "{\"city\": \"Paris\"}"}},
                        {"id": "call_2", "function": {"name": "now", "arguments": {"tz": "UTC"}}}]},
                       {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                        "content": "sunny"}],
          "tools": [{"type": "function", "function": {"name": "get_weather",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
          "tool_choice": "auto", "parallel_tool_calls": false})",
      true);
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(r)) << std::get<ApiError>(r).message;
  const CompletionRequest& c = std::get<CompletionRequest>(r);
  ASSERT_EQ(c.messages.size(), 3u);
  EXPECT_EQ(c.messages[1].content, "");
  ASSERT_EQ(c.messages[1].tool_calls.size(), 2u);
  EXPECT_EQ(c.messages[1].tool_calls[0].id, "call_1");
  EXPECT_EQ(c.messages[1].tool_calls[0].name, "get_weather");
  EXPECT_EQ(c.messages[1].tool_calls[0].arguments, R"({"city": "Paris"})");
  EXPECT_EQ(c.messages[1].tool_calls[1].arguments, R"({"tz":"UTC"})");  // an object, as text
  EXPECT_EQ(c.messages[2].tool_call_id, "call_1");
  EXPECT_EQ(c.messages[2].name, "get_weather");
  EXPECT_EQ(c.tool_choice, ToolChoice::kAuto);
  EXPECT_FALSE(c.parallel_tool_calls);
  // The tools keep the client's key order (templates print them with tojson).
  EXPECT_EQ(c.tools.dump(),
            R"([{"type":"function","function":{"name":"get_weather","parameters":{"type":"object",)"
            R"("properties":{"city":{"type":"string"}}}}}])");
  auto none = parse_completion_request(
      R"({"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none"})",
      true);
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(none));
  EXPECT_TRUE(std::get<CompletionRequest>(none).tools.is_null());  // empty: no tools
  EXPECT_EQ(std::get<CompletionRequest>(none).tool_choice, ToolChoice::kNone);
}

// A body nested deeper than kMaxJsonDepth is refused before anything copies or walks it (a
// tool's parameters 200,000 arrays deep ran the copy into `tools` off the stack).
TEST(Api, DeeplyNestedBodiesAreRefusedBeforeAnyWalk) {
  const auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  const auto body = [&](int depth) {
    return R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function",
      "function": {"name": "f", "parameters": {"type": "object", "x": )" +
           nested(depth) + "}}}]}";
  };
  const ApiError e = err_of(body(200000), true);
  EXPECT_EQ(e.code, "invalid_json");
  EXPECT_NE(e.message.find("nested deeper than 256"), std::string::npos) << e.message;
  // At the limit (the body's own 5 levels included) nothing is refused for its depth.
  auto ok = parse_completion_request(body(kMaxJsonDepth - 5), true);
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(ok)) << std::get<ApiError>(ok).message;
}

TEST(Api, ForcedToolChoiceIsParsedAndChecked) {
  const std::string tools =
      R"("tools": [{"type": "function", "function": {"name": "get_weather"}},
                   {"type": "function", "function": {"name": "now"}}])";
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  auto req =
      parse_completion_request("{" + msgs + ", " + tools + R"(, "tool_choice": "required"})", true);
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(req)) << std::get<ApiError>(req).message;
  EXPECT_EQ(std::get<CompletionRequest>(req).tool_choice, ToolChoice::kRequired);
  auto named = parse_completion_request(
      "{" + msgs + ", " + tools +
          R"(, "tool_choice": {"type": "function", "function": {"name": "now"}}})",
      true);
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(named))
      << std::get<ApiError>(named).message;
  EXPECT_EQ(std::get<CompletionRequest>(named).tool_choice, ToolChoice::kFunction);
  EXPECT_EQ(std::get<CompletionRequest>(named).tool_choice_name, "now");
  // Each refusal names tool_choice (or the field inside it) and says why.
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"("tool_choice": {"type": "function", "function": {"name": "later"}})", "not in 'tools'"},
      {R"("tool_choice": {"type": "function"})", "function"},
      {R"("tool_choice": {"type": "tool", "function": {"name": "now"}})", "'function'"},
      {R"("tool_choice": {"type": "function", "function": {"name": "now"}, "x": 1})",
       "'tool_choice.x'"},
      {R"("tool_choice": {"type": "function", "function": {"name": "now", "strict": true}})",
       "'tool_choice.function.strict'"},
      {R"("tool_choice": "required", "response_format": {"type": "json_object"})",
       "'response_format'"},
      {R"("tool_choice": "required", "grammar": "root ::= \"a\"")", "'grammar'"},
  };
  for (const auto& [fields, want] : bad) {
    auto r = parse_completion_request("{" + msgs + ", " + tools + ", " + fields + "}", true);
    ASSERT_TRUE(std::holds_alternative<ApiError>(r)) << fields;
    const ApiError& e = std::get<ApiError>(r);
    EXPECT_EQ(e.param.substr(0, 11), "tool_choice") << fields;
    EXPECT_NE(e.message.find(want), std::string::npos) << fields << ": " << e.message;
  }
  // response_format "text" constrains nothing: allowed beside a forced call.
  auto text = parse_completion_request(
      "{" + msgs + ", " + tools +
          R"(, "tool_choice": "required", "response_format": {"type": "text"}})",
      true);
  EXPECT_TRUE(std::holds_alternative<CompletionRequest>(text));
  auto no_tools = parse_completion_request("{" + msgs + R"(, "tool_choice": "required"})", true);
  ASSERT_TRUE(std::holds_alternative<ApiError>(no_tools));
  EXPECT_NE(std::get<ApiError>(no_tools).message.find("'tools'"), std::string::npos);
}

TEST(Api, ParsesAFullChatRequest) {
  auto r = parse_completion_request(
      R"({"model": "m", "messages": [{"role": "system", "content": "be brief"},
          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
          "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 42, "stop": "END", "stream": true,
          "stream_options": {"include_usage": true}, "n": 1, "logprobs": true, "top_logprobs": 3,
          "logit_bias": {"2": -100, "7": 1.5}, "top_k": 5, "min_p": 0.1, "repeat_penalty": 1.2,
          "user": "someone"})",
      true);
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(r)) << std::get<ApiError>(r).message;
  const auto& c = std::get<CompletionRequest>(r);
  EXPECT_EQ(c.model, "m");
  ASSERT_EQ(c.messages.size(), 2u);
  EXPECT_EQ(c.messages[1].content, "ab");
  EXPECT_EQ(c.max_tokens, 7);
  EXPECT_EQ(c.temperature, 0.0f);
  EXPECT_EQ(c.top_p, 0.5f);
  EXPECT_EQ(c.seed, 42u);
  EXPECT_EQ(c.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(c.stream && c.include_usage);
  EXPECT_EQ(c.top_logprobs, 3);
  ASSERT_EQ(c.logit_bias.size(), 2u);
  EXPECT_TRUE(std::isinf(c.logit_bias[0].second));
  EXPECT_EQ(c.top_k, 5);
  EXPECT_EQ(c.min_p, 0.1f);
  EXPECT_EQ(c.repeat_penalty, 1.2f);

  auto p = parse_completion_request(R"({"prompt": [1, 5, 9]})", false);
  ASSERT_TRUE(std::holds_alternative<CompletionRequest>(p));
  EXPECT_EQ(std::get<CompletionRequest>(p).prompt_ids, (std::vector<int32_t>{1, 5, 9}));
  EXPECT_EQ(std::get<CompletionRequest>(p).max_tokens, -1);
}

TEST(Api, TokenizeAndDetokenizeBodies) {
  EXPECT_TRUE(std::holds_alternative<ApiError>(parse_tokenize_request(R"({"content": 1})")));
  EXPECT_TRUE(std::holds_alternative<ApiError>(parse_tokenize_request("nope")));
  EXPECT_TRUE(
      std::holds_alternative<ApiError>(parse_detokenize_request(R"({"tokens": [1, "x"]})")));
  EXPECT_TRUE(std::holds_alternative<ApiError>(parse_detokenize_request(R"({"tokens": [-1]})")));
  auto d = parse_detokenize_request(R"({"tokens": [3, 4]})");
  ASSERT_TRUE(std::holds_alternative<DetokenizeRequest>(d));
  EXPECT_EQ(std::get<DetokenizeRequest>(d).tokens, (std::vector<int32_t>{3, 4}));
}

TEST(Api, StopMatcherHoldsBackPartialMatchesAndCutsAtTheStop) {
  StopMatcher m({"END", "xyz"});
  std::string out;
  for (std::string_view piece : {"hello E", "N", "d and x", "y", "!", " then EN", "D tail"}) {
    out += m.push(piece);
    EXPECT_FALSE(out.ends_with("E")) << out;  // a partial "END" is never released early
  }
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(out, "hello ENd and xy! then ");
  EXPECT_EQ(m.flush(), "");

  StopMatcher utf({});
  EXPECT_EQ(utf.push("a\xC3"), "a");  // incomplete 2-byte character held back
  EXPECT_EQ(utf.push("\xA9"), "\xC3\xA9");
  EXPECT_EQ(utf.flush(), "");
}

}  // namespace
}  // namespace kiln::server

namespace kiln::server {
namespace {

TEST(Api, ResponseFormatAndGrammarCompileToAGrammar) {
  auto grammar_of = [](const char* body, bool chat) {
    auto r = parse_completion_request(body, chat);
    EXPECT_TRUE(std::holds_alternative<CompletionRequest>(r))
        << body << " -> " << std::get<ApiError>(r).message;
    return std::holds_alternative<CompletionRequest>(r) ? std::get<CompletionRequest>(r).grammar
                                                        : nullptr;
  };
  auto full = [](const std::shared_ptr<const grammar::Grammar>& g, std::string_view s) {
    grammar::Matcher m(g);
    return m.advance(s).is_ok() && m.accepting();
  };
  EXPECT_EQ(grammar_of(R"({"prompt": "x", "response_format": {"type": "text"}})", false), nullptr);
  auto any = grammar_of(
      R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})",
      true);
  ASSERT_TRUE(any);
  EXPECT_TRUE(full(any, R"({"a": [1]})"));
  EXPECT_FALSE(full(any, "[1]"));
  // Properties come out in the order the client wrote them (not sorted).
  auto schema = grammar_of(
      R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
          "json_schema": {"name": "p", "strict": true, "schema": {"type": "object",
          "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "null"}},
          "required": ["zeta", "alpha"], "additionalProperties": false}}}})",
      true);
  ASSERT_TRUE(schema);
  EXPECT_TRUE(full(schema, R"({"zeta":true,"alpha":null})"));
  EXPECT_FALSE(full(schema, R"({"alpha":null,"zeta":true})"));
  auto gbnf = grammar_of(R"({"prompt": "x", "grammar": "root ::= [ab]{2}"})", false);
  ASSERT_TRUE(gbnf);
  EXPECT_TRUE(full(gbnf, "ba"));
  // A repeated key: the two parses may keep different copies; never a crash, and either the
  // schema that both see or a 400 that says why.
  auto dup = parse_completion_request(
      R"({"prompt": "x", "response_format": {"type": "text"}, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "null"}}}})",
      false);
  if (auto* e = std::get_if<ApiError>(&dup))
    EXPECT_NE(e->message.find("appears twice"), std::string::npos) << e->message;
  auto llama_schema = grammar_of(R"({"prompt": "x", "json_schema": {"enum": [1, "two"]}})", false);
  ASSERT_TRUE(llama_schema);
  EXPECT_TRUE(full(llama_schema, "\"two\""));
}

}  // namespace
}  // namespace kiln::server
