// tests/fuzz/fuzz_tool_calls.cpp: the tool-call reply parsers (engine/tool_calls.h) on arbitrary
// model output. The first byte picks the format and the streaming piece size; the rest is the
// reply. Whatever the input: no crash, every call's arguments are a JSON object and its name is
// non-empty, and the streamed path yields the same calls as the whole-reply parse.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "engine/tool_calls.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const auto format = static_cast<kiln::ToolFormat>(data[0] % 8);
  const size_t step = 1 + (data[0] >> 3);
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const kiln::ToolReply whole = kiln::parse_tool_reply(format, text);
  for (const kiln::ToolCall& c : whole.tool_calls) {
    require(!c.name.empty());
    const auto args = nlohmann::json::parse(c.arguments, nullptr, /*allow_exceptions=*/false);
    require(args.is_object());
  }
  if (whole.tool_calls.empty())
    require(whole.content == text || format == kiln::ToolFormat::kGptOss);
  kiln::ToolCallStream stream(format);
  std::string released;
  for (size_t at = 0; at < text.size(); at += step)
    released += stream.push(std::string_view(text).substr(at, step));
  const kiln::ToolReply tail = stream.finish();
  require(tail.tool_calls.size() == whole.tool_calls.size());
  for (size_t i = 0; i < whole.tool_calls.size(); ++i) {
    require(tail.tool_calls[i].name == whole.tool_calls[i].name);
    require(tail.tool_calls[i].arguments == whole.tool_calls[i].arguments);
  }
  return 0;
}
