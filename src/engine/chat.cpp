// engine/chat.cpp: chat_prompt (engine/chat.h).
#include "engine/chat.h"
#include "core/json_depth.h"

#include <fmt/format.h>

namespace kiln {

using ojson = nlohmann::ordered_json;

std::string fallback_chat_prompt(std::span<const ChatMessage> messages) {
  std::string out;
  for (const ChatMessage& m : messages) out += fmt::format("{}: {}\n", m.role, m.content);
  out += "assistant:";
  return out;
}

ojson chat_messages_json(std::span<const ChatMessage> messages, bool object_arguments) {
  ojson out = ojson::array();
  for (const ChatMessage& m : messages) {
    ojson j = {{"role", m.role}, {"content", m.content}};
    if (!m.tool_calls.empty()) {
      ojson calls = ojson::array();
      for (const ChatToolCall& c : m.tool_calls) {
        ojson args = c.arguments;
        if (object_arguments) {
          // Too deep to copy safely: kept as the text it came as.
          if (json_nesting_depth(c.arguments) <= kMaxJsonDepth) {
            ojson parsed = ojson::parse(c.arguments, nullptr, /*allow_exceptions=*/false);
            if (!parsed.is_discarded()) args = std::move(parsed);
          }
        }
        calls.push_back({{"id", c.id},
                         {"type", "function"},
                         {"function", {{"name", c.name}, {"arguments", std::move(args)}}}});
      }
      j["tool_calls"] = std::move(calls);
    }
    if (!m.tool_call_id.empty()) j["tool_call_id"] = m.tool_call_id;
    if (!m.name.empty()) j["name"] = m.name;
    out.push_back(std::move(j));
  }
  return out;
}

bool template_wants_object_arguments(const ChatTemplate& tmpl) {
  // The conversation of llama.cpp's capability probe: a user turn, then an assistant turn
  // that calls one tool with one argument whose key is easy to find in the output.
  auto renders_key = [&](bool as_object) {
    ChatMessage user, call;
    user.role = "user";
    user.content = "Hey";
    call.role = "assistant";
    call.tool_calls.push_back(
        {"call_1___", "ipython", R"json({"argument_needle": "print('Hello, World!')"})json"});
    const ChatMessage msgs[] = {user, call};
    ojson ctx;
    ctx["messages"] = chat_messages_json(msgs, as_object);
    ctx["add_generation_prompt"] = false;
    ctx["bos_token"] = "";
    ctx["eos_token"] = "";
    auto out = tmpl.render(ctx);
    if (!out) return false;
    return out->find("\"argument_needle\":") != std::string::npos ||
           out->find("'argument_needle':") != std::string::npos ||
           out->find("<parameter=argument_needle>") != std::string::npos ||
           out->find("<arg_key>argument_needle</arg_key>") != std::string::npos;
  };
  return !renders_key(false) && renders_key(true);
}

Expected<std::vector<int32_t>> chat_prompt(const Tokenizer& tok, const ChatTemplate* tmpl,
                                           std::span<const ChatMessage> messages,
                                           const ChatPromptOptions& opt) {
  std::string text;
  if (tmpl != nullptr) {
    ojson ctx;
    ctx["messages"] = chat_messages_json(messages, opt.object_arguments);
    if (!opt.tools.is_null()) ctx["tools"] = opt.tools;
    ctx["add_generation_prompt"] = true;
    ctx["bos_token"] = tok.bos() != kTokenNull ? tok.token_text(tok.bos()) : std::string();
    ctx["eos_token"] = tok.eos() != kTokenNull ? tok.token_text(tok.eos()) : std::string();
    auto out = tmpl->render(ctx);
    if (!out) return Status::errorf("chat template: {}", out.error());
    text = std::move(*out);
  } else {
    text = fallback_chat_prompt(messages);
  }
  // Templates write special tokens as text; they must become those tokens.
  std::vector<int32_t> ids = tok.encode(text, /*add_special=*/false, /*parse_special=*/true);
  if (tok.add_bos() && tok.bos() != kTokenNull && (ids.empty() || ids[0] != tok.bos()))
    ids.insert(ids.begin(), tok.bos());
  return ids;
}

}  // namespace kiln
