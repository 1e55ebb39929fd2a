// tests/fuzz/fuzz_template.cpp: libFuzzer target for the Jinja interpreter on hostile chat
// templates (a template comes from the model file, i.e. from anyone). The input is a template
// source, optionally followed by a NUL byte and a JSON conversation; without one (or when it
// is not JSON) a fixed conversation with a system, user, assistant and tool message is used.
// Parse and render run under small limits (steps, time, output, memory) so every input ends
// quickly; checked: no crash, no sanitizer report, and every failure is one "Kind: message".
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "tokenizer/jinja/chat_template.h"

namespace {

const nlohmann::ordered_json& fixed_context() {
  static const nlohmann::ordered_json ctx = nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Hi <|im_start|> {{ 1 }} é"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "f", "arguments": {"x": [1, 2.5, null, true]}}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "42"}
    ],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"
  })");
  return ctx;
}

// Caps far below the renderer's defaults (20 M steps, 500 ms, 64 MiB output, 16 MiB memory)
// and the earlier 200 k steps / 200 ms / 1 MiB / 8 MiB of this target: every one of the 68
// templates in ../shared/testdata/templates renders the fixed conversation within them (the
// longest output is 6.6 KB; none fails on a cap), so real templates still run to their end,
// while a hostile one (nested loops, string doubling) reaches a cap 10x sooner. Each cap's
// refusal path is still reached.
kiln::ChatTemplateOptions fuzz_options() {
  kiln::ChatTemplateOptions opt;
  opt.now = "2026-01-02T03:04:05";
  opt.max_steps = 20000;
  opt.max_time = std::chrono::milliseconds(50);
  opt.max_output_bytes = size_t{64} << 10;
  opt.max_memory_bytes = size_t{1} << 20;
  return opt;
}

void check_one_line(const std::string& msg) {
  if (msg.empty() || msg.find(": ") == std::string::npos) {
    std::fprintf(stderr, "fuzz_template: error without 'Kind: message': '%s'\n", msg.c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const size_t nul = in.find('\0');
  const std::string_view src = in.substr(0, nul);
  nlohmann::ordered_json ctx = fixed_context();
  if (nul != std::string_view::npos) {
    auto j = nlohmann::ordered_json::parse(in.substr(nul + 1), nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) ctx = std::move(j);
  }
  auto t = kiln::ChatTemplate::parse(src);
  if (!t) {
    check_one_line(t.error());
    return 0;
  }
  auto out = t->render(ctx, fuzz_options());
  if (!out) check_one_line(out.error());
  return 0;
}
