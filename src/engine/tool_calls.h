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

// One piece of a streamed reply (ToolCallStream::push_deltas), as OpenAI's deltas carry it.
struct ToolStreamDelta {
  enum class Kind {
    kContent,    // text of the answer
    kReasoning,  // text of gpt-oss's analysis channel
    kCallStart,  // a new call: `index`, its name in `text`
    kArguments,  // more of call `index`'s arguments (JSON text, as the model writes it)
  };
  Kind kind = Kind::kContent;
  int32_t index = 0;
  std::string text;
  std::string id;  // kCallStart: the id the model wrote (Mistral Nemo), else empty
  // kCallStart of a call parsed whole (formats other than gpt-oss): all its arguments, so a
  // call is one delta; gpt-oss's come in kArguments deltas after the start.
  std::string arguments;
};

// A reply as it streams: push() returns the content safe to send now (text that cannot be the
// start of a call); once a call marker appears the rest is held, and finish() parses it.
class ToolCallStream {
 public:
  explicit ToolCallStream(ToolFormat f) : format_(f) {}
  std::string push(std::string_view text);
  // The held text parsed: its content (released after what push() returned) and the calls.
  ToolReply finish();

  // The same reply as deltas. gpt-oss: each harmony message is streamed as it is written (the
  // analysis channel as reasoning, a `to=functions.NAME` message as a call's start and then
  // its arguments' text, any other as content), holding back only what may be the start of a
  // marker; the arguments are the model's text, not re-serialised (the whole-reply parse
  // gives them compact). Other formats: push()'s content, and at finish_deltas() the rest of
  // the content and every call whole (one kCallStart with its arguments). Use one pair or
  // the other on a stream, not both.
  std::vector<ToolStreamDelta> push_deltas(std::string_view text);
  std::vector<ToolStreamDelta> finish_deltas();

 private:
  void harmony_deltas(std::vector<ToolStreamDelta>& out, bool at_end);
  void harmony_emit(std::vector<ToolStreamDelta>& out, std::string_view text);

  ToolFormat format_;
  std::string released_;  // everything push() returned, for the Llama 3 start-of-reply rule
  std::string held_;
  bool in_call_ = false;
  // gpt-oss deltas: inside a message's body (else reading a header), of which kind (for a
  // call: its index, and whether its arguments began, leading whitespace being layout).
  bool in_body_ = false;
  ToolStreamDelta::Kind body_kind_ = ToolStreamDelta::Kind::kContent;
  int32_t n_calls_ = 0;
  bool args_started_ = false;
};

}  // namespace kiln
