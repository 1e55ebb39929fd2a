// tests/fuzz/fuzz_http_request.cpp: libFuzzer target for the server's request layer (the
// code every HTTP body passes through before the scheduler). Random bytes go to the chat,
// completion, tokenize and detokenize parsers and through the stop-sequence matcher.
// Checked: no crash; every rejection is a 4xx with a one-line message whose error body is
// valid JSON in OpenAI's shape; every accepted request satisfies the documented ranges.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>

#include "server/api.h"

namespace {

void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_http_request: %s\n", what);
    std::abort();
  }
}

// Bytes JSON escaping touches (quote, backslash, control, non-ASCII): a message holding any is
// checked by parsing its body back; a plain one only needs to appear verbatim in the body.
bool plain(const std::string& s) {
  for (unsigned char c : s)
    if (c < 0x20 || c >= 0x7f || c == '"' || c == '\\') return false;
  return true;
}

void check_error(const kiln::server::ApiError& e) {
  require(e.status >= 400 && e.status < 500, "error status outside 4xx");
  require(!e.message.empty() && e.message.find('\n') == std::string::npos,
          "error message empty or multi-line");
  const std::string body = kiln::server::error_body(e);
  // Checking error bodies was 3/4 of this target's time (most inputs are refused, four times
  // each), half of it parsing every body back. The body's shape depends only on status, type, code
  // and param; it is parsed back the first time each such combination appears and whenever the
  // message or param has bytes the serializer must escape; otherwise the message must appear in it
  // verbatim.
  static std::set<std::string> seen;
  const std::string shape =
      std::to_string(e.status) + '\0' + e.type + '\0' + e.code + '\0' + e.param;
  if (plain(e.message) && plain(e.param) && seen.count(shape)) {
    require(body.find("\"message\":\"" + e.message + '"') != std::string::npos,
            "error body does not hold the message");
    return;
  }
  const auto j = nlohmann::json::parse(body, nullptr, false);
  require(j.is_object() && j["error"]["message"].is_string() && j["error"]["type"].is_string() &&
              j["error"]["code"].is_string(),
          "error body not in OpenAI's shape");
  require(j["error"]["message"].get<std::string>() == e.message, "error body changed the message");
  if (seen.size() < 4096) seen.insert(shape);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  const kiln::server::Limits limits{.max_tokens = 4096};
  for (bool chat : {true, false}) {
    auto r = kiln::server::parse_completion_request(body, chat, limits);
    if (auto* e = std::get_if<kiln::server::ApiError>(&r)) {
      check_error(*e);
      continue;
    }
    const auto& c = std::get<kiln::server::CompletionRequest>(r);
    require(c.max_tokens == -1 || (c.max_tokens >= 1 && c.max_tokens <= limits.max_tokens),
            "max_tokens range");
    require(c.temperature >= 0 && c.temperature <= 2 && c.top_p >= 0 && c.top_p <= 1,
            "sampling range");
    require(c.stop.size() <= 4, "stop count");
    require(c.top_logprobs >= -1 && c.top_logprobs <= 20, "top_logprobs range");
    require(chat ? !c.messages.empty() : (!c.prompt.empty() || !c.prompt_ids.empty()),
            "empty prompt accepted");
    // Feed the generated text through the stop matcher as if streamed byte by byte.
    kiln::server::StopMatcher m(c.stop);
    std::string out;
    for (char ch : body.substr(0, 512)) out += m.push(std::string_view(&ch, 1));
    out += m.flush();
    require(out.size() <= std::min<size_t>(body.size(), 512), "stop matcher invented bytes");
    if (chat) (void)kiln::fallback_chat_prompt(c.messages);
  }
  if (auto t = kiln::server::parse_tokenize_request(body);
      auto* e = std::get_if<kiln::server::ApiError>(&t))
    check_error(*e);
  if (auto d = kiln::server::parse_detokenize_request(body);
      auto* e = std::get_if<kiln::server::ApiError>(&d))
    check_error(*e);
  return 0;
}
