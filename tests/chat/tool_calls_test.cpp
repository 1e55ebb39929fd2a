// tests/chat/tool_calls_test.cpp: the reply parsers of engine/tool_calls.h on model output
// written the way each format's template writes a call: content kept, calls with their
// arguments as JSON text, several calls, malformed calls (plain content, never an error), and
// the streaming path fed byte by byte and in uneven pieces, which must release the same
// content and calls as the whole-reply parse and never release a marker's first bytes.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <random>

#include "engine/tool_calls.h"

namespace kiln {
namespace {

using ojson = nlohmann::ordered_json;

struct Want {
  using Calls = std::vector<std::pair<std::string, std::string>>;  // name, arguments (compact)
  Want(std::string c, Calls k, std::string r = "")
      : content(std::move(c)), calls(std::move(k)), reasoning(std::move(r)) {}
  std::string content;
  Calls calls;
  std::string reasoning;
};

void expect_reply(const ToolReply& r, const Want& w, const std::string& label) {
  EXPECT_EQ(r.content, w.content) << label;
  EXPECT_EQ(r.reasoning, w.reasoning) << label;
  ASSERT_EQ(r.tool_calls.size(), w.calls.size()) << label;
  for (size_t i = 0; i < w.calls.size(); ++i) {
    EXPECT_EQ(r.tool_calls[i].name, w.calls[i].first) << label << " call " << i;
    EXPECT_EQ(r.tool_calls[i].arguments, w.calls[i].second) << label << " call " << i;
    EXPECT_TRUE(ojson::accept(r.tool_calls[i].arguments)) << label;
  }
}

// Streams `text` in pieces of `step` bytes; returns the reply as a client assembles it.
ToolReply stream(ToolFormat f, const std::string& text, size_t step, std::string* released) {
  ToolCallStream s(f);
  std::string content;
  for (size_t at = 0; at < text.size(); at += step) content += s.push(text.substr(at, step));
  *released = content;
  ToolReply tail = s.finish();
  tail.content.insert(0, content);
  return tail;
}

void check(ToolFormat f, const std::string& text, const Want& w) {
  const std::string label = std::string(tool_format_name(f)) + ": " + text;
  expect_reply(parse_tool_reply(f, text), w, label);
  for (size_t step : {size_t{1}, size_t{3}, size_t{7}, text.size()}) {
    std::string released;
    ToolReply r = stream(f, text, step, &released);
    // Whitespace-only content around calls is dropped by the whole parse; streamed text that
    // was released before a call stays released, so compare without it.
    if (!w.calls.empty() && r.content.find_first_not_of(" \n") == std::string::npos)
      r.content.clear();
    expect_reply(r, w, label + " (streamed by " + std::to_string(step) + ")");
    if (f == ToolFormat::kNone) continue;  // nothing is a marker
    for (std::string_view marker : {"<tool_call", "[TOOL_CALLS", "<|python_tag", "<｜tool"})
      EXPECT_EQ(released.find(marker), std::string::npos) << label << ": released a marker";
  }
}

const std::string kArgs = R"({"city":"Paris","unit":"celsius"})";

TEST(ToolCalls, Hermes) {
  check(ToolFormat::kHermes,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": "
        "\"celsius\"}}\n</tool_call>",
        {"", {{"get_weather", kArgs}}});
  check(ToolFormat::kHermes,
        "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"x\\\": 1}\"}\n</tool_call>",
        {"Let me check.\n", {{"a", "{}"}, {"b", R"({"x":1})"}}});
  // Unclosed at the end of the reply (the model stopped on its end token).
  check(ToolFormat::kHermes, "<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": [1, 2]}}",
        {"", {{"a", R"({"k":[1,2]})"}}});
  // Malformed: the reply is plain content.
  for (const char* bad :
       {"<tool_call>{\"name\": \"a\", \"arguments\": {</tool_call>",
        "<tool_call>{\"arguments\": {}}</tool_call>", "<tool_call>not json</tool_call>",
        "<tool_call>", "<tool_call>{\"name\": \"a\", \"arguments\": 5}</tool_call>"})
    check(ToolFormat::kHermes, bad, {bad, {}});
  check(ToolFormat::kHermes, "plain answer with < and <tool",
        {"plain answer with < and <tool", {}});
}

TEST(ToolCalls, Llama3) {
  check(ToolFormat::kLlama3,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
        {"", {{"get_weather", kArgs}}});
  check(ToolFormat::kLlama3,
        "<|python_tag|>{\"type\": \"function\", \"name\": \"f\", \"parameters\": {}}",
        {"", {{"f", "{}"}}});
  check(ToolFormat::kLlama3,
        " {\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", "
        "\"parameters\": {\"n\": 2}}",
        {"", {{"a", "{}"}, {"b", R"({"n":2})"}}});
  check(ToolFormat::kLlama3, "The answer is {not a call}.", {"The answer is {not a call}.", {}});
  for (const char* bad : {"{\"name\": \"a\", \"parameters\": {", "{\"parameters\": {}}",
                          "{not json}", "<|python_tag|>brave_search.call(query=\"x\")"})
    check(ToolFormat::kLlama3, bad, {bad, {}});
}

TEST(ToolCalls, QwenXml) {
  check(ToolFormat::kQwenXml,
        "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
        {"I'll look.\n", {{"get_weather", kArgs}}});
  check(ToolFormat::kQwenXml,
        "<tool_call>\n<function=f>\n<parameter=n>\n5\n</parameter>\n<parameter=o>\n{\"a\": "
        "true}\n</parameter>\n</function>\n</tool_call>",
        {"", {{"f", R"({"n":5,"o":{"a":true}})"}}});
  for (const char* bad : {"<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
                          "<tool_call>\n<function=f>\n<parameter=n>\n5\n</function></tool_call>"})
    check(ToolFormat::kQwenXml, bad, {bad, {}});
}

TEST(ToolCalls, Glm) {
  check(ToolFormat::kGlm,
        "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>",
        {"", {{"get_weather", kArgs}}});
  check(ToolFormat::kGlm, "ok<tool_call>now</tool_call>", {"ok", {{"now", "{}"}}});
  check(ToolFormat::kGlm,
        "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>[1, 2]</arg_value></tool_call>",
        {"", {{"f", R"({"n":[1,2]})"}}});
  for (const char* bad : {"<tool_call>f<arg_key>n</arg_key></tool_call>",
                          "<tool_call><arg_key>n</arg_key><arg_value>1</arg_value></tool_call>"})
    check(ToolFormat::kGlm, bad, {bad, {}});
}

// A model's reply nesting its arguments deeper than kMaxJsonDepth is text, not a call: the
// parse never builds (and so never copies or dumps) a value that deep.
TEST(ToolCalls, ArgumentsNestedTooDeepAreContent) {
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  const std::string text =
      R"(<tool_call>{"name": "f", "arguments": {"a": )" + deep + "}}</tool_call>";
  const ToolReply r = parse_tool_reply(ToolFormat::kHermes, text);
  EXPECT_TRUE(r.tool_calls.empty());
  EXPECT_EQ(r.content, text);
}

TEST(ToolCalls, Mistral) {
  // Nemo: a JSON array, ids chosen by the model.
  const std::string nemo =
      "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": "
      "\"celsius\"}, \"id\": \"abcDEF123\"}]";
  check(ToolFormat::kMistral, nemo, {"", {{"get_weather", kArgs}}});
  EXPECT_EQ(parse_tool_reply(ToolFormat::kMistral, nemo).tool_calls[0].id, "abcDEF123");
  // Small 3.2 / Devstral: NAME[ARGS]{...}, one marker per call.
  check(ToolFormat::kMistral,
        "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\", \"unit\": \"celsius\"}"
        "[TOOL_CALLS]now[ARGS]{}",
        {"Sure.", {{"get_weather", kArgs}, {"now", "{}"}}});
  check(ToolFormat::kMistral, "[TOOL_CALLS]f[CALL_ID]xyz987abc[ARGS]{\"a\": \"}\"}",
        {"", {{"f", R"({"a":"}"})"}}});
  for (const char* bad : {"[TOOL_CALLS]get_weather{\"city\": 1}", "[TOOL_CALLS][{\"name\": 1}]",
                          "[TOOL_CALLS]f[ARGS]{\"a\": ", "[TOOL_CALLS]"})
    check(ToolFormat::kMistral, bad, {bad, {}});
}

TEST(ToolCalls, DeepSeek) {
  // R1: type, name, fenced JSON.
  check(ToolFormat::kDeepSeek,
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        "```json\n{\"city\": \"Paris\", \"unit\": \"celsius\"}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        {"Checking.", {{"get_weather", kArgs}}});
  // V3.1: name, separator, JSON; two calls.
  check(
      ToolFormat::kDeepSeek,
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
      "<｜tool▁call▁begin｜>b<｜tool▁sep｜>{\"x\": [true]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
      {"", {{"a", "{}"}, {"b", R"({"x":[true]})"}}});
  for (const char* bad :
       {"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜>"})
    check(ToolFormat::kDeepSeek, bad, {bad, {}});
}

TEST(ToolCalls, GptOss) {
  check(ToolFormat::kGptOss,
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
        "commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\", "
        "\"unit\": \"celsius\"}",
        {"", {{"get_weather", kArgs}}, "Need weather."});
  // The recipient before the channel, as the template writes past calls; a final answer.
  check(ToolFormat::kGptOss,
        "<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}<|call|>",
        {"", {{"now", "{}"}}});
  check(ToolFormat::kGptOss,
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is sunny.",
        {"It is sunny.", {}, "Easy."});
  check(ToolFormat::kGptOss, "no channels at all", {"no channels at all", {}});
  for (const char* bad : {"<|channel|>commentary to=functions.f<|message|>{\"a\": ",
                          "<|channel|>commentary to=browser.search<|message|>{}",
                          "<|channel|>final<|message|>x<|end|><|start|>assistant<|channel|>final"})
    check(ToolFormat::kGptOss, bad, {bad, {}});
}

TEST(ToolCalls, NoFormatIsPlainContent) {
  check(ToolFormat::kNone, "<tool_call>{\"name\": \"a\"}</tool_call>",
        {"<tool_call>{\"name\": \"a\"}</tool_call>", {}});
}

// Text that only looks like the start of a marker is released once it cannot be one.
TEST(ToolCalls, StreamHoldsOnlyPossibleMarkers) {
  ToolCallStream s(ToolFormat::kHermes);
  EXPECT_EQ(s.push("a <tool"), "a ");
  EXPECT_EQ(s.push("box> b"), "<toolbox> b");
  EXPECT_EQ(s.push("<tool_"), "");
  EXPECT_EQ(s.push("call>{\"name\": \"f\", \"arguments\": {}}"), "");
  ToolReply r = s.finish();
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].name, "f");

  ToolCallStream l(ToolFormat::kLlama3);
  EXPECT_EQ(l.push("  \n"), "");  // a call may still open the reply
  EXPECT_EQ(l.push("Hi {x}"), "  \nHi {x}");
  EXPECT_EQ(l.finish().content, "");
}

// Random edits of well-formed replies (the fuzz target's invariants, tests/fuzz/
// fuzz_tool_calls.cpp, on a fixed corpus so that every build checks them): every call has a
// name and object arguments, a reply without calls is returned unchanged, and streaming in any
// piece size finds the same calls as the whole parse.
TEST(ToolCalls, RandomEditsKeepTheInvariants) {
  const std::string seeds[] = {
      "Hi.<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, \"}\"]}}</tool_call>",
      " {\"name\": \"f\", \"parameters\": {}}; {\"name\": \"g\", \"parameters\": {}}",
      "x<|python_tag|>{\"name\": \"f\", \"parameters\": {\"q\": 1}}",
      "<tool_call>\n<function=f>\n<parameter=k>\n{\"a\": "
      "1}\n</parameter>\n</function>\n</tool_call>",
      "<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>",
      "[TOOL_CALLS]f[ARGS]{\"x\": 1}[TOOL_CALLS][{\"name\": \"g\", \"arguments\": {}}]",
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
      "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary "
      "to=functions.f <|constrain|>json<|message|>{\"k\": 2}<|call|>"};
  const std::string pieces[] = {"<tool_call>",
                                "</tool_call>",
                                "{",
                                "}",
                                "\"",
                                ":",
                                ",",
                                "[",
                                "]",
                                "<|python_tag|>",
                                "[TOOL_CALLS]",
                                "[ARGS]",
                                "<|message|>",
                                "<|channel|>",
                                "<|end|>",
                                "<｜tool▁sep｜>",
                                "\n",
                                " ",
                                "x",
                                ";"};
  std::mt19937 rng(1234);
  int n_calls = 0, n_cases = 0;
  for (const std::string& seed : seeds) {
    for (int round = 0; round < 300; ++round) {
      std::string text = seed;
      for (int k = 0, n = 1 + rng() % 3; k < n; ++k) {
        const size_t at = text.empty() ? 0 : rng() % text.size();
        switch (rng() % 3) {
          case 0:
            text.erase(at, 1 + rng() % 4);
            break;
          case 1:
            text.insert(at, pieces[rng() % std::size(pieces)]);
            break;
          default:
            text.replace(at, 1, pieces[rng() % std::size(pieces)]);
            break;
        }
      }
      for (int f = 0; f < 8; ++f) {
        const auto format = static_cast<ToolFormat>(f);
        const ToolReply whole = parse_tool_reply(format, text);
        ++n_cases;
        for (const ToolCall& c : whole.tool_calls) {
          EXPECT_FALSE(c.name.empty()) << text;
          EXPECT_TRUE(ojson::parse(c.arguments, nullptr, false).is_object()) << text;
        }
        if (whole.tool_calls.empty() && format != ToolFormat::kGptOss) {
          EXPECT_EQ(whole.content, text) << tool_format_name(format);
        }
        n_calls += static_cast<int>(whole.tool_calls.size());
        std::string released;
        const ToolReply streamed = stream(format, text, 1 + rng() % 9, &released);
        ASSERT_EQ(streamed.tool_calls.size(), whole.tool_calls.size())
            << tool_format_name(format) << ": " << text;
        for (size_t i = 0; i < whole.tool_calls.size(); ++i) {
          EXPECT_EQ(streamed.tool_calls[i].name, whole.tool_calls[i].name) << text;
          EXPECT_EQ(streamed.tool_calls[i].arguments, whole.tool_calls[i].arguments) << text;
        }
      }
    }
  }
  std::printf("random edits: %d parses, %d calls found\n", n_cases, n_calls);
  EXPECT_GT(n_calls, 100);  // the corpus keeps many replies well-formed
}

}  // namespace
}  // namespace kiln
