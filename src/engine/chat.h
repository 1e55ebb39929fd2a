// engine/chat.h: a conversation turned into prompt ids the same way by every front end (the
// server's /v1/chat/completions, the embedding API, an interactive chat): the model's chat
// template when its file has one, a plain "role: content" transcript when it has none.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "tokenizer/jinja/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln {

// One function call an assistant message made (OpenAI's tool_calls[i]).
struct ChatToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text of an object, as OpenAI sends it
};

struct ChatMessage {
  ChatMessage() = default;
  ChatMessage(std::string r, std::string c) : role(std::move(r)), content(std::move(c)) {}
  std::string role;  // system, developer, user, assistant, tool
  std::string content;
  std::vector<ChatToolCall> tool_calls;  // assistant
  std::string tool_call_id;              // tool: the call this message answers
  std::string name;                      // tool: the function's name (optional)
};

// What a template sees besides the messages.
struct ChatPromptOptions {
  // The request's `tools` (OpenAI's [{type: "function", function: {...}}]); null: none, and
  // the template's `tools` variable stays undefined as it does for a plain chat.
  nlohmann::ordered_json tools;
  // Llama 3.1's template reads tool_calls[i].function.arguments as a mapping (`| items`,
  // `| tojson` of an object); most others print the JSON string. See
  // template_wants_object_arguments.
  bool object_arguments = false;
};

// "role: content" lines and a closing "assistant:": the prompt of a model without a template.
std::string fallback_chat_prompt(std::span<const ChatMessage> messages);

// The `messages` variable a template receives: {role, content} plus, where present,
// tool_calls [{id, type: "function", function: {name, arguments}}] (arguments a JSON string,
// or the parsed object when `object_arguments`; text that is not JSON stays a string),
// tool_call_id and name. Content is always a string: an assistant that only calls tools has
// "" (llama.cpp's choice too; most templates fail on null).
nlohmann::ordered_json chat_messages_json(std::span<const ChatMessage> messages,
                                          bool object_arguments);

// Whether `tmpl` prints a tool call's arguments only when given them as an object (Llama
// 3.x), found as llama.cpp's template probe finds it: render one call both ways and look for
// the argument's key in the output.
bool template_wants_object_arguments(const ChatTemplate& tmpl);

// Renders `messages` with `tmpl` (add_generation_prompt, the vocabulary's bos/eos texts,
// opt.tools) or, when tmpl is null, fallback_chat_prompt; the special tokens the text names
// become those tokens, and BOS leads when the vocabulary adds one. Errors: the template's, as
// "chat template: ...".
Expected<std::vector<int32_t>> chat_prompt(const Tokenizer& tok, const ChatTemplate* tmpl,
                                           std::span<const ChatMessage> messages,
                                           const ChatPromptOptions& opt = {});

}  // namespace kiln
