// engine/chat.cpp: chat_prompt (engine/chat.h).
#include "engine/chat.h"

#include <fmt/format.h>

namespace kiln {

std::string fallback_chat_prompt(std::span<const ChatMessage> messages) {
  std::string out;
  for (const ChatMessage& m : messages) out += fmt::format("{}: {}\n", m.role, m.content);
  out += "assistant:";
  return out;
}

Expected<std::vector<int32_t>> chat_prompt(const Tokenizer& tok, const ChatTemplate* tmpl,
                                           std::span<const ChatMessage> messages) {
  std::string text;
  if (tmpl != nullptr) {
    nlohmann::ordered_json ctx;
    ctx["messages"] = nlohmann::ordered_json::array();
    for (const ChatMessage& m : messages)
      ctx["messages"].push_back({{"role", m.role}, {"content", m.content}});
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
