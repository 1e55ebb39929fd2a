// tests/chat/tool_template_test.cpp: every shared chat template rendered with tools offered
// and with a whole tool round trip (an assistant call, the tool's answer, a reply, a new
// question), as kiln's server builds the template's variables (engine/chat.h), against what
// Jinja2 3.1.6 rendered from the same variables (tool_cases.json, make_tool_cases.py); the
// arguments-as-object probe against the same probe run with Jinja2; and the tool-call format
// each template is recognised as.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>

#include "common/testdata.h"
#include "engine/chat.h"
#include "engine/tool_calls.h"

namespace kiln {
namespace {

using ojson = nlohmann::ordered_json;

ojson load_cases() {
  return ojson::parse(testing::read_file(std::string(KILN_CHAT_TEST_DIR) + "/tool_cases.json"));
}

std::string template_source(const std::string& name) {
  return testing::read_file(testing::shared_path("testdata/templates/" + name));
}

// The fixture's messages as a client sends them (arguments as JSON text).
std::vector<ChatMessage> client_messages(const ojson& msgs) {
  std::vector<ChatMessage> out;
  for (const ojson& m : msgs) {
    ChatMessage c;
    c.role = m["role"];
    c.content = m["content"];
    for (const ojson& call : m.value("tool_calls", ojson::array())) {
      const ojson& args = call["function"]["arguments"];
      c.tool_calls.push_back({call["id"], call["function"]["name"],
                              args.is_string() ? args.get<std::string>() : args.dump()});
    }
    c.tool_call_id = m.value("tool_call_id", "");
    c.name = m.value("name", "");
    out.push_back(std::move(c));
  }
  return out;
}

// Where kiln's renderer and Jinja2 part on these conversations, and why. Each entry must still
// differ (an entry that starts to match is taken off this list).
const std::map<std::string, std::string> kKnownDivergences = {
    // `"x"|safe + str` escapes str in Jinja2 (MarkupSafe's Markup.__add__); kiln's strings carry
    // no safe mark. Tools are refused for this template (no parsed format: see below).
    {"meetkai-functionary-medium-v3.1.jinja", "Markup escaping after |safe"},
    // `tools | map(attribute='function') | tojson` fails in Jinja2 (map is a generator that
    // json.dumps cannot print); kiln's map returns a list and the template renders.
    {"llama-cpp-deepseek-r1.jinja", "map() is a list, not a generator"},
};

TEST(ToolTemplates, RenderLikeJinja2WithToolsAndARoundTrip) {
  const ojson doc = load_cases();
  ASSERT_EQ(doc["templates"].size(), 68u);
  ChatTemplateOptions opt;
  opt.now = "2026-11-29T12:00:00";
  int outputs = 0, errors = 0;
  for (const ojson& t : doc["templates"]) {
    const std::string name = t["template"];
    auto tmpl = ChatTemplate::parse(template_source(name));
    ASSERT_TRUE(tmpl) << name << ": " << tmpl.error();
    const bool object_args = t["object_arguments"];
    EXPECT_EQ(template_wants_object_arguments(*tmpl), object_args) << name;
    const bool divergent = kKnownDivergences.contains(name);
    int differing = 0;
    for (const ojson& c : t["cases"]) {
      const std::string label = name + " / " + c["name"].get<std::string>();
      const std::vector<ChatMessage> msgs = client_messages(c["messages"]);
      const ojson vars = chat_messages_json(msgs, object_args);
      EXPECT_EQ(vars, c["messages"]) << label << ": the template's messages differ";
      ojson ctx = {{"messages", vars},
                   {"tools", doc["tools"]},
                   {"add_generation_prompt", true},
                   {"bos_token", doc["bos_token"]},
                   {"eos_token", doc["eos_token"]}};
      auto out = tmpl->render(ctx, opt);
      if (divergent) {
        differing +=
            c.contains("output") ? (!out || *out != c["output"].get<std::string>()) : bool(out);
        continue;
      }
      if (c.contains("output")) {
        ++outputs;
        if (!out)
          ADD_FAILURE() << label << ": render failed: " << out.error();
        else
          EXPECT_EQ(*out, c["output"].get<std::string>()) << label;
      } else {
        ++errors;
        const std::string want = c["error"];
        EXPECT_FALSE(out) << label << ": Jinja2 failed (" << want << "), kiln rendered";
        // The template's own raise_exception message must come through unchanged; Python's
        // internal errors (TypeError, SecurityError, ...) are worded by Python.
        if (!out && want.starts_with("TemplateError: ")) {
          EXPECT_EQ(out.error(), want) << label;
        }
      }
    }
    if (divergent) {
      EXPECT_GT(differing, 0) << name << " now matches Jinja2: take it off kKnownDivergences";
    }
  }
  std::printf("tool template cases: %d renderings, %d errors\n", outputs, errors);
}

// A client's tool-call arguments nested deeper than kMaxJsonDepth (a string inside the body,
// so the body's own depth check does not see them) stay the text they came as, even where the
// template takes arguments as objects: no value that deep is built, copied or rendered.
TEST(ToolTemplates, ArgumentsNestedTooDeepStayText) {
  ChatMessage m("assistant", "");
  m.tool_calls.push_back({"c1", "f", std::string(200000, '[') + std::string(200000, ']')});
  const ojson j = chat_messages_json(std::span<const ChatMessage>(&m, 1), true);
  const ojson& args = j[0]["tool_calls"][0]["function"]["arguments"];
  ASSERT_TRUE(args.is_string());
  EXPECT_EQ(args.get<std::string>(), m.tool_calls[0].arguments);
  m.tool_calls[0].arguments = R"({"a": [1]})";  // a shallow one is parsed as before
  EXPECT_TRUE(chat_messages_json(std::span<const ChatMessage>(&m, 1),
                                 true)[0]["tool_calls"][0]["function"]["arguments"]
                  .is_object());
}

TEST(ToolTemplates, FormatsRecognisedFromTheSource) {
  const std::pair<const char*, ToolFormat> want[] = {
      {"meta-llama-Llama-3.1-8B-Instruct.jinja", ToolFormat::kLlama3},
      {"meta-llama-Llama-3.2-3B-Instruct.jinja", ToolFormat::kLlama3},
      {"meta-llama-Llama-3.3-70B-Instruct.jinja", ToolFormat::kLlama3},
      {"NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", ToolFormat::kHermes},
      {"NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", ToolFormat::kHermes},
      {"Qwen-Qwen2.5-7B-Instruct.jinja", ToolFormat::kHermes},
      {"Qwen-Qwen3-0.6B.jinja", ToolFormat::kHermes},
      {"Qwen-QwQ-32B.jinja", ToolFormat::kHermes},
      {"Qwen3-Coder.jinja", ToolFormat::kQwenXml},
      {"Qwen3.5-4B.jinja", ToolFormat::kQwenXml},
      {"GLM-4.6.jinja", ToolFormat::kGlm},
      {"GLM-4.7-Flash.jinja", ToolFormat::kGlm},
      {"mistralai-Mistral-Nemo-Instruct-2407.jinja", ToolFormat::kMistral},
      {"Mistral-Small-3.2-24B-Instruct-2506.jinja", ToolFormat::kMistral},
      {"unsloth-mistral-Devstral-Small-2507.jinja", ToolFormat::kMistral},
      {"deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", ToolFormat::kDeepSeek},
      {"deepseek-ai-DeepSeek-V3.1.jinja", ToolFormat::kDeepSeek},
      {"openai-gpt-oss-120b.jinja", ToolFormat::kGptOss},
      // Formats kiln does not parse: tools are refused for these (fail closed).
      {"meetkai-functionary-medium-v3.1.jinja", ToolFormat::kNone},
      {"ByteDance-Seed-OSS.jinja", ToolFormat::kNone},
      {"MiniMax-M2.jinja", ToolFormat::kNone},
      {"MiniMax-M3.jinja", ToolFormat::kNone},
      {"moonshotai-Kimi-K2.jinja", ToolFormat::kNone},
      {"google-gemma-2-2b-it.jinja", ToolFormat::kNone},
      {"microsoft-Phi-3.5-mini-instruct.jinja", ToolFormat::kNone},
  };
  for (const auto& [name, format] : want)
    EXPECT_EQ(tool_format_name(detect_tool_format(template_source(name))),
              std::string(tool_format_name(format)))
        << name;
}

// gpt-oss calls stream as deltas: the real template's rendering of an assistant turn (an
// analysis message, then a call; twice, then a final answer) is what the model writes after
// the generation prompt. Fed in pieces of any size, the deltas give the whole-reply parse's
// reasoning, content and calls (each call's start first, then its arguments in more than one
// piece when fed by the byte), and never a harmony marker's text.
TEST(ToolTemplates, GptOssCallsStreamAsDeltas) {
  auto tmpl = ChatTemplate::parse(template_source("openai-gpt-oss-120b.jinja"));
  ASSERT_TRUE(tmpl) << tmpl.error();
  const ojson doc = load_cases();
  const bool object_args = template_wants_object_arguments(*tmpl);
  ChatTemplateOptions opt;
  opt.now = "2026-11-29T12:00:00";
  auto render = [&](const std::vector<ChatMessage>& msgs, bool gen) {
    ojson ctx = {{"messages", chat_messages_json(msgs, object_args)},
                 {"tools", doc["tools"]},
                 {"add_generation_prompt", gen},
                 {"bos_token", doc["bos_token"]},
                 {"eos_token", doc["eos_token"]}};
    auto out = tmpl->render(ctx, opt);
    EXPECT_TRUE(out) << out.error();
    return out ? *out : std::string();
  };
  std::vector<ChatMessage> msgs(2);
  msgs[0].role = "system";
  msgs[0].content = "You are a helpful assistant.";
  msgs[1].role = "user";
  msgs[1].content = "Weather in Paris and Rome?";
  const std::string prompt = render(msgs, true);
  // What the model writes after the prompt: one turn of the template's rendering.
  auto turn = [&](ChatMessage m, bool last) {
    std::vector<ChatMessage> with = msgs;
    with.push_back(std::move(m));
    std::string all = render(with, !last);
    EXPECT_TRUE(all.starts_with(prompt)) << all;
    std::string reply = all.substr(prompt.size());
    // A call's turn restarts with the generation prompt the model was given; a final turn
    // ends on <|return|>, the end-of-generation token (never part of the streamed text).
    if (!last && reply.ends_with("<|start|>assistant")) reply.resize(reply.size() - 18);
    if (last && reply.ends_with("<|return|>")) reply.resize(reply.size() - 10);
    return reply;
  };
  ChatMessage call1;
  call1.role = "assistant";
  call1.tool_calls.push_back({"call1", "get_weather", R"({"city": "Paris", "unit": "celsius"})"});
  ChatMessage call2 = call1;
  call2.tool_calls[0].arguments = R"({"city": "Rome"})";
  ChatMessage final;
  final.role = "assistant";
  final.content = "Sunny in both.";
  // The first call's turn opens with an analysis message (the template writes `content` of a
  // call message there); the generation prompt "<|start|>assistant" is the reply's head.
  call1.content = "Two cities: two calls.";
  // Each turn starts after the generation prompt "<|start|>assistant"; the model writes it
  // between its messages.
  const std::string reply = turn(call1, false) + "<|start|>assistant" + turn(call2, false) +
                            "<|start|>assistant" + turn(final, true);
  ASSERT_NE(reply.find("<|channel|>analysis"), std::string::npos) << reply;
  ASSERT_NE(reply.find("to=functions.get_weather"), std::string::npos) << reply;

  const ToolReply whole = parse_tool_reply(ToolFormat::kGptOss, reply);
  ASSERT_EQ(whole.tool_calls.size(), 2u) << reply;
  EXPECT_EQ(whole.reasoning, "Two cities: two calls.") << reply;
  EXPECT_EQ(whole.content, "Sunny in both.") << reply;
  for (size_t step : {size_t{1}, size_t{2}, size_t{5}, size_t{11}, reply.size()}) {
    const std::string label = "pieces of " + std::to_string(step);
    ToolCallStream s(ToolFormat::kGptOss);
    std::vector<ToolStreamDelta> ds;
    for (size_t at = 0; at < reply.size(); at += step)
      for (ToolStreamDelta& d : s.push_deltas(reply.substr(at, step))) ds.push_back(std::move(d));
    const size_t before_end = ds.size();
    for (ToolStreamDelta& d : s.finish_deltas()) ds.push_back(std::move(d));
    std::string content, reasoning;
    std::vector<std::string> names, args;
    std::vector<int> arg_pieces;
    for (size_t i = 0; i < ds.size(); ++i) {
      const ToolStreamDelta& d = ds[i];
      EXPECT_EQ(d.text.find("<|"), std::string::npos) << label << ": a marker in " << d.text;
      switch (d.kind) {
        case ToolStreamDelta::Kind::kContent:
          content += d.text;
          break;
        case ToolStreamDelta::Kind::kReasoning:
          reasoning += d.text;
          break;
        case ToolStreamDelta::Kind::kCallStart:
          ASSERT_EQ(d.index, static_cast<int32_t>(names.size())) << label;
          names.push_back(d.text);
          args.emplace_back();
          arg_pieces.push_back(0);
          break;
        case ToolStreamDelta::Kind::kArguments:
          ASSERT_EQ(d.index + 1, static_cast<int32_t>(names.size())) << label << ": args first";
          args.back() += d.text;
          ++arg_pieces.back();
          break;
      }
    }
    EXPECT_EQ(content, whole.content) << label;
    EXPECT_EQ(reasoning, whole.reasoning) << label;
    ASSERT_EQ(names.size(), 2u) << label;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(names[i], whole.tool_calls[i].name) << label;
      EXPECT_EQ(ojson::parse(args[i]), ojson::parse(whole.tool_calls[i].arguments)) << label;
      if (step == 1) EXPECT_GT(arg_pieces[i], 1) << label << ": arguments came whole";
    }
    // Everything but the final answer's last held bytes streamed before the end.
    if (step < reply.size()) EXPECT_GT(before_end, ds.size() / 2) << label;
  }
}

}  // namespace
}  // namespace kiln
