// tokenizer/jinja/chat_template.h: public API for chat templates: parse a Jinja2 template
// once, render it with a JSON context the way Hugging Face's apply_chat_template does
// (sandboxed, trim_blocks, lstrip_blocks, loop controls, raise_exception, strftime_now).
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "core/status.h"

namespace kiln {

namespace jinja {
struct Template;
}

struct ChatTemplateOptions {
  // The moment strftime_now() formats, "YYYY-MM-DDTHH:MM:SS"; unset = the current local time.
  std::optional<std::string> now;
  // Resource bounds so a hostile template cannot hang or exhaust a server: output size,
  // evaluation steps, wall time, and the memory the values a render makes may hold at once:
  // max_memory_bytes plus 4x the context's size as JSON (a template that builds the prompt in
  // a variable holds about the output, which is about the context).
  size_t max_output_bytes = size_t{64} << 20;
  uint64_t max_steps = 20'000'000;
  std::chrono::milliseconds max_time{500};
  size_t max_memory_bytes = size_t{16} << 20;
};

class ChatTemplate {
 public:
  // Fails with "TemplateSyntaxError: ..." for malformed source.
  static Expected<ChatTemplate> parse(std::string_view source);
  // `context` supplies the template's variables (messages, add_generation_prompt,
  // bos_token, eos_token, tools, ...). Object key order is kept (tojson prints it).
  // A template error is "Kind: message", e.g. "TemplateError: System role not supported".
  Expected<std::string> render(const nlohmann::ordered_json& context,
                               const ChatTemplateOptions& opt = {}) const;
  // The text parse() was given: front ends recognise a model's tool-call format by markers in
  // it (engine/tool_calls.h).
  std::string_view source() const { return source_ ? std::string_view(*source_) : ""; }

 private:
  std::shared_ptr<const jinja::Template> tmpl_;
  std::shared_ptr<const std::string> source_;
};

// Parse + render in one call.
Expected<std::string> render_chat_template(std::string_view source,
                                           const nlohmann::ordered_json& context,
                                           const ChatTemplateOptions& opt = {});

}  // namespace kiln
