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

struct ChatMessage {
  std::string role;  // system, developer, user, assistant, tool
  std::string content;
};

// "role: content" lines and a closing "assistant:": the prompt of a model without a template.
std::string fallback_chat_prompt(std::span<const ChatMessage> messages);

// Renders `messages` with `tmpl` (add_generation_prompt, the vocabulary's bos/eos texts) or,
// when tmpl is null, fallback_chat_prompt; the special tokens the text names become those
// tokens, and BOS leads when the vocabulary adds one. Errors: the template's, as "chat
// template: ...".
Expected<std::vector<int32_t>> chat_prompt(const Tokenizer& tok, const ChatTemplate* tmpl,
                                           std::span<const ChatMessage> messages);

}  // namespace kiln
