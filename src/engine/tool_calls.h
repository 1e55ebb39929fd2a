// engine/tool_calls.h: function calling in the formats the shipped chat templates teach their
// models: which format a template uses (recognised, as llama.cpp's common/chat does, by
// markers in its source), and the model's reply parsed back into content and calls, whole or
// as it streams. A call that does not parse leaves the reply plain content: never an error.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace kiln {

enum class ToolFormat {
  kNone,     // no known tool-call format: tools cannot be offered to this template
  kLlama3,   // Llama 3.x: {"name": ..., "parameters": {...}} (or after <|python_tag|>)
  kHermes,   // Hermes 2/3, Qwen 2.5/3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  kQwenXml,  // Qwen3-Coder, Qwen3.5, Nemotron 3: <tool_call><function=NAME><parameter=K>V...
  kGlm,      // GLM 4.5+: <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...
  kMistral,  // [TOOL_CALLS][{...}] (Nemo) or [TOOL_CALLS]NAME[ARGS]{...} (Small 3.2, Devstral)
  kDeepSeek,  // <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜>... (R1, V3.1)
  kGptOss,  // harmony channels: <|channel|>commentary to=functions.NAME ...<|message|>{...}
};

// The format a chat template's source uses; kNone when none is recognised.
ToolFormat detect_tool_format(std::string_view template_source);
const char* tool_format_name(ToolFormat f);

// Control tokens the format's calls are written with. A front end renders these as text
// while it parses calls (they are dropped from plain output otherwise).
std::span<const std::string_view> tool_format_special_texts(ToolFormat f);

struct ToolCall {
  std::string id;  // as the model wrote it (Mistral Nemo), else empty: the caller names it
  std::string name;
  std::string arguments;  // JSON text of an object
};

struct ToolReply {
  std::string content;    // text outside the calls
  std::string reasoning;  // gpt-oss's analysis channel
  std::vector<ToolCall> tool_calls;
};

// tool_choice "required" or a named function, enforced by constrained decoding: GBNF whose
// sentences are replies made only of calls, in format `f`, to the functions of `tools`
// (OpenAI's [{type, function: {name, parameters}}]) named `only` (empty: any of them), with
// arguments that validate against each function's `parameters` (grammar/json_schema.h's
// subset). `parallel`: one or more calls, else exactly one. Formats: hermes
// (<tool_call>\n{json}\n</tool_call>), llama3 (one bare JSON call: its templates describe one),
// mistral ([TOOL_CALLS]NAME[ARGS]{...} where the template uses [ARGS], else Nemo's JSON list).
// Errors (one line): another format, a name not in `tools`, a schema kiln cannot enforce.
Expected<std::string> tool_call_gbnf(ToolFormat f, std::string_view template_source,
                                     const nlohmann::ordered_json& tools, std::string_view only,
                                     bool parallel);
// Whether tool_call_gbnf supports format `f`.
bool tool_call_gbnf_supported(ToolFormat f);

// Parses a whole reply. A reply with a malformed call is returned whole as content.
ToolReply parse_tool_reply(ToolFormat f, std::string_view text);

// A reply as it streams: push() returns the content safe to send now (text that cannot be the
// start of a call); once a call marker appears the rest is held, and finish() parses it.
class ToolCallStream {
 public:
  explicit ToolCallStream(ToolFormat f) : format_(f) {}
  std::string push(std::string_view text);
  // The held text parsed: its content (released after what push() returned) and the calls.
  ToolReply finish();

 private:
  ToolFormat format_;
  std::string released_;  // everything push() returned, for the Llama 3 start-of-reply rule
  std::string held_;
  bool in_call_ = false;
};

}  // namespace kiln
