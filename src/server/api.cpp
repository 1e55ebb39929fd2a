// server/api.cpp: request parsing and validation for the OpenAI-compatible routes (see
// api.h). Every check happens here, before a request can reach the scheduler.
#include "server/api.h"
#include "core/json_depth.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "grammar/json_schema.h"

namespace kiln::server {

using json = nlohmann::json;

std::string error_body(const ApiError& e) {
  json err = {{"message", e.message}, {"type", e.type}, {"code", e.code}};
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  return json{{"error", err}}.dump();
}

namespace {

ApiError bad(std::string param, std::string msg, std::string code = "invalid_value") {
  ApiError e;
  e.param = std::move(param);
  // Messages may quote client text (a role, a field name): keep them one line, as the fuzz
  // target demands, by escaping control characters.
  for (char c : msg) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      e.message += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    else
      e.message += c;
  }
  if (e.message.empty()) e.message = "invalid request";
  e.code = std::move(code);
  return e;
}

const char* type_name(const json& v) { return v.type_name(); }

// Each getter: absent or null -> keep the default; wrong type or range -> error.
std::optional<ApiError> get_bool(const json& o, const char* key, bool& out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean())
    return bad(key, fmt::format("'{}' must be a boolean, got {}", key, type_name(*it)),
               "invalid_type");
  out = it->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> get_number(const json& o, const char* key, float lo, float hi, float& out) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return std::nullopt;
  if (!it->is_number())
    return bad(key, fmt::format("'{}' must be a number, got {}", key, type_name(*it)),
               "invalid_type");
  const double v = it->get<double>();
  if (!std::isfinite(v) || v < lo || v > hi)
    return bad(key, fmt::format("'{}' = {} is outside [{}, {}]", key, v, lo, hi));
  out = static_cast<float>(v);
  return std::nullopt;
}

std::optional<ApiError> get_int(const json& o, const char* key, int64_t lo, int64_t hi,
                                int64_t& out, bool& present) {
  present = false;
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer()) {
    // 5.0 is a number but not an integer; reject rather than silently truncate.
    return bad(key,
               fmt::format("'{}' must be an integer, got {}", key,
                           it->is_number() ? "a fractional number" : type_name(*it)),
               "invalid_type");
  }
  if (it->is_number_unsigned()) {
    const uint64_t u = it->get<uint64_t>();
    if (u > static_cast<uint64_t>(hi))
      return bad(key, fmt::format("'{}' = {} is outside [{}, {}]", key, u, lo, hi));
    out = static_cast<int64_t>(u);
  } else {
    out = it->get<int64_t>();
  }
  if (out < lo || out > hi)
    return bad(key, fmt::format("'{}' = {} is outside [{}, {}]", key, out, lo, hi));
  present = true;
  return std::nullopt;
}

// "content" of a chat message: a string, or an array of {"type": "text", "text": str} parts.
std::optional<ApiError> get_content(const json& m, size_t index, std::string& out) {
  const std::string where = fmt::format("messages[{}].content", index);
  auto it = m.find("content");
  if (it == m.end() || it->is_null()) return std::nullopt;  // assistant with tool calls
  if (it->is_string()) {
    out = it->get<std::string>();
    return std::nullopt;
  }
  if (!it->is_array())
    return bad(where,
               fmt::format("'{}' must be a string or an array of text parts, got {}", where,
                           type_name(*it)),
               "invalid_type");
  for (size_t k = 0; k < it->size(); ++k) {
    const json& part = (*it)[k];
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      return bad(where, fmt::format("'{}[{}]' must be an object with a string 'type'", where, k),
                 "invalid_type");
    if (part["type"] != "text")
      return bad(where, fmt::format("'{}[{}]': content type '{}' is not supported (text only)",
                                    where, k, part["type"].get<std::string>()));
    if (!part.contains("text") || !part["text"].is_string())
      return bad(where, fmt::format("'{}[{}].text' must be a string", where, k), "invalid_type");
    out += part["text"].get<std::string>();
  }
  return std::nullopt;
}

// response_format / grammar / json_schema -> the request's compiled grammar (see api.h).
std::optional<ApiError> get_grammar(const json& j, std::string_view body, CompletionRequest& r) {
  std::string gbnf, param;
  auto schema_gbnf = [&](const char* where) -> std::optional<ApiError> {
    // The schema again, with its keys in written order (properties are produced in it).
    auto oj = nlohmann::ordered_json::parse(body.begin(), body.end(), nullptr, false);
    const nlohmann::ordered_json* s = &oj;
    for (const char* key : {"response_format", "json_schema", "schema"}) {
      if (std::string_view(where) == "json_schema" && std::string_view(key) != "json_schema")
        continue;  // llama.cpp's top-level json_schema is the schema itself
      // (Both parses see the same keys unless the body repeats one, where they may keep
      // different copies: refuse rather than guess.)
      auto it = s->is_object() ? s->find(key) : s->end();
      if (it == s->end()) return bad(where, fmt::format("'{}' appears twice in the body", key));
      s = &*it;
    }
    auto g = grammar::json_schema_to_gbnf(*s);
    if (!g) return bad(where, g.error());
    gbnf = std::move(*g);
    return std::nullopt;
  };
  if (auto it = j.find("response_format"); it != j.end() && !it->is_null()) {
    if (!it->is_object() || !it->contains("type") || !(*it)["type"].is_string())
      return bad("response_format", "'response_format' must be an object with a string 'type'",
                 "invalid_type");
    const std::string type = (*it)["type"];
    for (auto kv = it->begin(); kv != it->end(); ++kv)
      if (kv.key() != "type" && !(type == "json_schema" && kv.key() == "json_schema"))
        return bad("response_format", fmt::format("'response_format.{}' is not supported with "
                                                  "type '{}'",
                                                  kv.key(), type));
    if (type == "json_object") {
      gbnf = grammar::json_object_gbnf();
    } else if (type == "json_schema") {
      auto js = it->find("json_schema");
      if (js == it->end() || !js->is_object())
        return bad("response_format", "'response_format.json_schema' must be an object",
                   "invalid_type");
      for (auto kv = js->begin(); kv != js->end(); ++kv)
        if (kv.key() != "name" && kv.key() != "schema" && kv.key() != "strict" &&
            kv.key() != "description")
          return bad("response_format",
                     fmt::format("'response_format.json_schema.{}' is not supported", kv.key()));
      if (!js->contains("name") || !(*js)["name"].is_string())
        return bad("response_format", "'response_format.json_schema.name' must be a string",
                   "invalid_type");
      if (auto st = js->find("strict"); st != js->end() && !st->is_null() && !st->is_boolean())
        return bad("response_format", "'response_format.json_schema.strict' must be a boolean",
                   "invalid_type");
      if (!js->contains("schema"))  // OpenAI: no schema means any JSON object
        gbnf = grammar::json_object_gbnf();
      else if (auto e = schema_gbnf("response_format"))
        return e;
    } else if (type != "text") {
      return bad("response_format",
                 fmt::format("'response_format.type' = '{}' is not one of text, json_object, "
                             "json_schema",
                             type));
    }
    if (type != "text") param = "response_format";
  }
  for (const char* key : {"grammar", "json_schema"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!param.empty())
      return bad(key, fmt::format("'{}' and '{}' both constrain the output: give one", param, key));
    param = key;
    if (std::string_view(key) == "grammar") {
      if (!it->is_string()) return bad(key, "'grammar' must be a GBNF string", "invalid_type");
      gbnf = it->get<std::string>();
    } else if (auto e = schema_gbnf("json_schema")) {
      return e;
    }
  }
  if (gbnf.empty() && param.empty()) return std::nullopt;
  auto g = grammar::Grammar::parse(gbnf);
  if (!g) return bad(param, g.error());
  r.grammar = std::move(*g);
  return std::nullopt;
}

// A string field of a message; absent or null -> "".
std::optional<ApiError> get_message_string(const json& m, const std::string& where, const char* key,
                                           std::string& out) {
  auto it = m.find(key);
  if (it == m.end() || it->is_null()) return std::nullopt;
  if (!it->is_string())
    return bad(where + "." + key, fmt::format("'{}.{}' must be a string", where, key),
               "invalid_type");
  out = it->get<std::string>();
  return std::nullopt;
}

// The `function` object of a tool or a tool call at `at`, and its non-empty `name`.
std::optional<ApiError> get_function(const json& obj, const std::string& at, const json*& fn,
                                     std::string& name) {
  auto it = obj.find("function");
  if (it == obj.end() || !it->is_object())
    return bad(at + ".function", fmt::format("'{}.function' must be an object", at),
               "invalid_type");
  auto n = it->find("name");
  if (n == it->end() || !n->is_string() || n->get<std::string>().empty())
    return bad(at + ".function.name",
               fmt::format("'{}.function.name' must be a non-empty string", at), "invalid_type");
  fn = &*it;
  name = n->get<std::string>();
  return std::nullopt;
}

// An assistant message's tool_calls [{id, type: "function", function: {name, arguments}}], a
// tool message's tool_call_id, and any message's name.
std::optional<ApiError> get_tool_fields(const json& m, size_t index, ChatMessage& msg) {
  const std::string where = fmt::format("messages[{}]", index);
  if (auto e = get_message_string(m, where, "name", msg.name)) return e;
  if (msg.role == "tool") {
    if (auto e = get_message_string(m, where, "tool_call_id", msg.tool_call_id)) return e;
  } else if (m.contains("tool_call_id")) {
    return bad(where + ".tool_call_id",
               fmt::format("'{}.tool_call_id' belongs to a 'tool' message", where));
  }
  auto it = m.find("tool_calls");
  if (it == m.end() || it->is_null()) return std::nullopt;
  const std::string calls = where + ".tool_calls";
  if (msg.role != "assistant")
    return bad(calls, fmt::format("'{}' belongs to an 'assistant' message", calls));
  if (!it->is_array())
    return bad(calls, fmt::format("'{}' must be an array", calls), "invalid_type");
  for (size_t k = 0; k < it->size(); ++k) {
    const json& c = (*it)[k];
    const std::string at = fmt::format("{}[{}]", calls, k);
    if (!c.is_object()) return bad(at, fmt::format("'{}' must be an object", at), "invalid_type");
    if (auto t = c.find("type"); t != c.end() && !t->is_null() && *t != "function")
      return bad(at + ".type", fmt::format("'{}.type' must be 'function'", at));
    ChatToolCall call;
    if (auto e = get_message_string(c, at, "id", call.id)) return e;
    const json* fn = nullptr;
    if (auto e = get_function(c, at, fn, call.name)) return e;
    // OpenAI sends the arguments as JSON text; an object is taken as what that text says.
    auto args = fn->find("arguments");
    if (args == fn->end() || args->is_null())
      call.arguments = "{}";
    else if (args->is_string())
      call.arguments = args->get<std::string>();
    else if (args->is_object())
      call.arguments = args->dump();
    else
      return bad(at + ".function.arguments",
                 fmt::format("'{}.function.arguments' must be a JSON string", at), "invalid_type");
    msg.tool_calls.push_back(std::move(call));
  }
  return std::nullopt;
}

// tools, tool_choice, parallel_tool_calls of a chat request. `tools` is taken from the body
// parsed again with its key order kept: templates print the tools with tojson, and the
// model was trained on schemas in the order their authors wrote them.
std::optional<ApiError> get_tools(const json& j, std::string_view body, CompletionRequest& r) {
  if (auto e = get_bool(j, "parallel_tool_calls", r.parallel_tool_calls)) return e;
  if (auto it = j.find("tool_choice"); it != j.end() && !it->is_null()) {
    if (it->is_string() && *it == "auto") {
      r.tool_choice = ToolChoice::kAuto;
    } else if (it->is_string() && *it == "none") {
      r.tool_choice = ToolChoice::kNone;
    } else if (it->is_string() && *it == "required") {
      r.tool_choice = ToolChoice::kRequired;
    } else if (it->is_object()) {
      for (auto kv = it->begin(); kv != it->end(); ++kv)
        if (kv.key() != "type" && kv.key() != "function")
          return bad(
              "tool_choice",
              fmt::format("'tool_choice.{}' is not supported (give type and function)", kv.key()));
      if (auto t = it->find("type"); t == it->end() || *t != "function")
        return bad("tool_choice", "'tool_choice.type' must be 'function'");
      const json* fn = nullptr;
      if (auto e = get_function(*it, "tool_choice", fn, r.tool_choice_name)) return e;
      for (auto kv = fn->begin(); kv != fn->end(); ++kv)
        if (kv.key() != "name")
          return bad("tool_choice",
                     fmt::format("'tool_choice.function.{}' is not supported", kv.key()));
      r.tool_choice = ToolChoice::kFunction;
    } else {
      return bad("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or an object",
                 "invalid_type");
    }
  }
  const bool forced =
      r.tool_choice == ToolChoice::kRequired || r.tool_choice == ToolChoice::kFunction;
  if (forced) {
    auto t = j.find("tools");
    if (t == j.end() || !t->is_array() || t->empty())
      return bad("tool_choice", "'tool_choice' forces a tool call, but 'tools' is empty or absent");
    if (r.tool_choice == ToolChoice::kFunction &&
        std::none_of(t->begin(), t->end(), [&](const json& tool) {
          return tool.is_object() && tool.contains("function") && tool["function"].is_object() &&
                 tool["function"].value("name", json()) == r.tool_choice_name;
        }))
      return bad("tool_choice", fmt::format("'tool_choice' names the function '{}', which is not "
                                            "in 'tools'",
                                            r.tool_choice_name));
    for (const char* key : {"response_format", "grammar", "json_schema"})
      if (auto g = j.find(key); g != j.end() && !g->is_null() &&
                                !(std::string_view(key) == "response_format" && g->is_object() &&
                                  g->value("type", json()) == "text"))
        return bad("tool_choice",
                   fmt::format("'tool_choice' forces a tool call and '{}' constrains the output "
                               "too: give one",
                               key));
  }
  auto it = j.find("tools");
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_array())
    return bad("tools", "'tools' must be an array of {type: 'function', function: {...}}",
               "invalid_type");
  for (size_t k = 0; k < it->size(); ++k) {
    const json& t = (*it)[k];
    const std::string at = fmt::format("tools[{}]", k);
    if (!t.is_object()) return bad(at, fmt::format("'{}' must be an object", at), "invalid_type");
    auto type = t.find("type");
    if (type == t.end() || *type != "function")
      return bad(at + ".type", fmt::format("'{}.type' must be 'function'", at));
    const json* fn = nullptr;
    std::string name;
    if (auto e = get_function(t, at, fn, name)) return e;
    if (auto d = fn->find("description"); d != fn->end() && !d->is_null() && !d->is_string())
      return bad(at + ".function.description",
                 fmt::format("'{}.function.description' must be a string", at), "invalid_type");
    if (auto p = fn->find("parameters"); p != fn->end() && !p->is_null() && !p->is_object())
      return bad(at + ".function.parameters",
                 fmt::format("'{}.function.parameters' must be a JSON schema object", at),
                 "invalid_type");
  }
  if (it->empty()) return std::nullopt;
  const auto ordered = nlohmann::ordered_json::parse(body.begin(), body.end(), nullptr, false);
  r.tools = ordered.at("tools");
  return std::nullopt;
}

std::optional<json> parse_json_object(std::string_view body, ApiError& err) {
  // Every other parse of a body (get_grammar, get_tools) comes after this one.
  if (json_nesting_depth(body) > kMaxJsonDepth) {
    err = bad("", fmt::format("the request body is {}", kJsonTooDeep), "invalid_json");
    return std::nullopt;
  }
  json j = json::parse(body.begin(), body.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    err = bad("", "the request body is not valid JSON", "invalid_json");
    return std::nullopt;
  }
  if (!j.is_object()) {
    err = bad("", fmt::format("the request body must be a JSON object, got {}", type_name(j)),
              "invalid_type");
    return std::nullopt;
  }
  return j;
}

}  // namespace

ApiResult<CompletionRequest> parse_completion_request(std::string_view body, bool chat,
                                                      const Limits& limits,
                                                      const SamplingDefaults& defaults) {
  ApiError err;
  auto parsed = parse_json_object(body, err);
  if (!parsed) return err;
  const json& j = *parsed;
  CompletionRequest r;
  r.chat = chat;
  r.temperature = defaults.temperature;
  r.top_p = defaults.top_p;
  r.top_k = defaults.top_k;
  r.min_p = defaults.min_p;
  r.repeat_penalty = defaults.repeat_penalty;
  r.presence_penalty = defaults.presence_penalty;
  r.frequency_penalty = defaults.frequency_penalty;
#define KILN_API_TRY(expr) \
  if (auto e_ = (expr)) return *e_

  if (auto it = j.find("model"); it != j.end() && !it->is_null()) {
    if (!it->is_string())
      return bad("model", fmt::format("'model' must be a string, got {}", type_name(*it)),
                 "invalid_type");
    r.model = it->get<std::string>();
  }
  if (chat) {
    auto it = j.find("messages");
    if (it == j.end()) return bad("messages", "'messages' is required", "missing_field");
    if (!it->is_array())
      return bad("messages", fmt::format("'messages' must be an array, got {}", type_name(*it)),
                 "invalid_type");
    if (it->empty()) return bad("messages", "'messages' must not be empty");
    if (it->size() > limits.max_messages)
      return bad("messages", fmt::format("{} messages exceed the limit of {}", it->size(),
                                         limits.max_messages));
    static constexpr std::string_view kRoles[] = {"system", "developer", "user", "assistant",
                                                  "tool"};
    for (size_t i = 0; i < it->size(); ++i) {
      const json& m = (*it)[i];
      if (!m.is_object())
        return bad(fmt::format("messages[{}]", i),
                   fmt::format("'messages[{}]' must be an object, got {}", i, type_name(m)),
                   "invalid_type");
      auto role = m.find("role");
      if (role == m.end() || !role->is_string())
        return bad(fmt::format("messages[{}].role", i),
                   fmt::format("'messages[{}].role' must be a string", i), "invalid_type");
      ChatMessage msg;
      msg.role = role->get<std::string>();
      if (std::find(std::begin(kRoles), std::end(kRoles), msg.role) == std::end(kRoles))
        return bad(fmt::format("messages[{}].role", i),
                   fmt::format("'messages[{}].role' = '{}' is not one of system, developer, "
                               "user, assistant, tool",
                               i, msg.role));
      KILN_API_TRY(get_content(m, i, msg.content));
      KILN_API_TRY(get_tool_fields(m, i, msg));
      r.messages.push_back(std::move(msg));
    }
  } else {
    auto it = j.find("prompt");
    if (it == j.end()) return bad("prompt", "'prompt' is required", "missing_field");
    if (it->is_string()) {
      r.prompt = it->get<std::string>();
    } else if (it->is_array() && it->size() == 1 && (*it)[0].is_string()) {
      r.prompt = (*it)[0].get<std::string>();
    } else if (it->is_array() && !it->empty() &&
               std::all_of(it->begin(), it->end(),
                           [](const json& v) { return v.is_number_integer(); })) {
      for (const json& v : *it) {
        const int64_t id = v.get<int64_t>();
        if (id < 0 || id > INT32_MAX)
          return bad("prompt", fmt::format("token id {} in 'prompt' is out of range", id));
        r.prompt_ids.push_back(static_cast<int32_t>(id));
      }
    } else {
      return bad("prompt",
                 "'prompt' must be a string, a one-string array or an array of token ids "
                 "(batches of prompts are not supported)",
                 "invalid_type");
    }
    if (r.prompt.empty() && r.prompt_ids.empty())
      return bad("prompt", "'prompt' must not be empty");
  }

  // Fail closed: a field this server does not implement is refused by name, never ignored
  // (a client relying on tools or response_format must not get plain text back as if they
  // had been applied). `user` is an end-user id for the caller's records: no effect to apply.
  static constexpr std::string_view kCommon[] = {"model",
                                                 "n",
                                                 "max_tokens",
                                                 "max_completion_tokens",
                                                 "temperature",
                                                 "top_p",
                                                 "top_k",
                                                 "min_p",
                                                 "repeat_penalty",
                                                 "presence_penalty",
                                                 "frequency_penalty",
                                                 "seed",
                                                 "stream",
                                                 "stream_options",
                                                 "stop",
                                                 "logit_bias",
                                                 "logprobs",
                                                 "response_format",
                                                 "grammar",
                                                 "json_schema",
                                                 "user"};
  static constexpr std::string_view kChat[] = {"messages", "top_logprobs", "tools", "tool_choice",
                                               "parallel_tool_calls"};
  static constexpr std::string_view kText[] = {"prompt"};
  for (auto kv = j.begin(); kv != j.end(); ++kv) {
    const std::string_view key = kv.key();
    auto has = [&](std::span<const std::string_view> set) {
      return std::find(set.begin(), set.end(), key) != set.end();
    };
    if (has(kCommon) || has(chat ? std::span<const std::string_view>(kChat)
                                 : std::span<const std::string_view>(kText)))
      continue;
    return bad(std::string(key),
               fmt::format("'{}' is not supported by this server{}", key,
                           has(chat ? std::span<const std::string_view>(kText)
                                    : std::span<const std::string_view>(kChat))
                               ? (chat ? " on /v1/chat/completions" : " on /v1/completions")
                               : ""),
               "unsupported_parameter");
  }

  int64_t v = 0;
  bool present = false;
  KILN_API_TRY(get_int(j, "n", INT64_MIN, INT64_MAX, v, present));
  if (present && (v < 1 || v > limits.max_n))
    return bad(
        "n", fmt::format("'n' = {} is outside [1, {}] (at most the server's slots, --parallel)", v,
                         limits.max_n));
  if (present) r.n = static_cast<int32_t>(v);
  // max_completion_tokens is the newer chat spelling; either is accepted.
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    KILN_API_TRY(get_int(j, key, INT64_MIN, INT64_MAX, v, present));
    if (!present) continue;
    if (v < 1 || v > limits.max_tokens)
      return bad(key, fmt::format("'{}' = {} is outside [1, {}]", key, v, limits.max_tokens));
    r.max_tokens = static_cast<int32_t>(v);
  }
  KILN_API_TRY(get_number(j, "temperature", 0.0f, 2.0f, r.temperature));
  KILN_API_TRY(get_number(j, "top_p", 0.0f, 1.0f, r.top_p));
  KILN_API_TRY(get_number(j, "presence_penalty", -2.0f, 2.0f, r.presence_penalty));
  KILN_API_TRY(get_number(j, "frequency_penalty", -2.0f, 2.0f, r.frequency_penalty));
  KILN_API_TRY(get_number(j, "min_p", 0.0f, 1.0f, r.min_p));
  KILN_API_TRY(get_number(j, "repeat_penalty", 0.0f, 10.0f, r.repeat_penalty));
  KILN_API_TRY(get_int(j, "top_k", 0, INT32_MAX, v, present));
  if (present) r.top_k = static_cast<int32_t>(v);
  KILN_API_TRY(get_int(j, "seed", INT64_MIN, INT64_MAX, v, present));
  if (present) r.seed = static_cast<uint64_t>(v);
  KILN_API_TRY(get_bool(j, "stream", r.stream));

  if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
    if (!it->is_object())
      return bad("stream_options", "'stream_options' must be an object", "invalid_type");
    if (!r.stream)
      return bad("stream_options", "'stream_options' is only allowed with stream: true");
    KILN_API_TRY(get_bool(*it, "include_usage", r.include_usage));
  }
  if (auto it = j.find("stop"); it != j.end() && !it->is_null()) {
    if (it->is_string())
      r.stop.push_back(it->get<std::string>());
    else if (it->is_array()) {
      if (it->size() > 4)
        return bad("stop", fmt::format("'stop' has {} entries; at most 4", it->size()));
      for (const json& s : *it) {
        if (!s.is_string()) return bad("stop", "'stop' entries must be strings", "invalid_type");
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      return bad("stop", "'stop' must be a string or an array of strings", "invalid_type");
    }
    for (const std::string& s : r.stop) {
      if (s.empty()) return bad("stop", "'stop' entries must not be empty");
      if (s.size() > limits.max_stop_bytes)
        return bad("stop", fmt::format("a 'stop' entry of {} bytes exceeds {}", s.size(),
                                       limits.max_stop_bytes));
    }
  }
  if (auto it = j.find("logit_bias"); it != j.end() && !it->is_null()) {
    if (!it->is_object())
      return bad("logit_bias", "'logit_bias' must be an object of \"token id\": bias",
                 "invalid_type");
    for (auto kv = it->begin(); kv != it->end(); ++kv) {
      const std::string& key = kv.key();
      const bool digits =
          !key.empty() && key.size() <= 9 &&
          std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
      if (!digits)
        return bad("logit_bias", fmt::format("'logit_bias' key '{}' is not a token id", key));
      if (!kv.value().is_number())
        return bad("logit_bias", fmt::format("'logit_bias[{}]' must be a number", key),
                   "invalid_type");
      const double b = kv.value().get<double>();
      if (!std::isfinite(b) || b < -100 || b > 100)
        return bad("logit_bias",
                   fmt::format("'logit_bias[{}]' = {} is outside [-100, 100]", key, b));
      // OpenAI's -100 means "never"; make it exact rather than merely unlikely.
      r.logit_bias.emplace_back(std::stoi(key), b <= -100 ? -INFINITY : static_cast<float>(b));
    }
  }
  if (chat) KILN_API_TRY(get_tools(j, body, r));
  if (chat) {
    bool want = false;
    KILN_API_TRY(get_bool(j, "logprobs", want));
    KILN_API_TRY(get_int(j, "top_logprobs", 0, 20, v, present));
    if (present && !want) return bad("top_logprobs", "'top_logprobs' requires 'logprobs': true");
    if (want) r.top_logprobs = present ? static_cast<int32_t>(v) : 0;
  } else {
    KILN_API_TRY(get_int(j, "logprobs", 0, 20, v, present));
    if (present) r.top_logprobs = static_cast<int32_t>(v);
  }
  KILN_API_TRY(get_grammar(j, body, r));
#undef KILN_API_TRY
  return r;
}

ApiResult<TokenizeRequest> parse_tokenize_request(std::string_view body) {
  ApiError err;
  auto j = parse_json_object(body, err);
  if (!j) return err;
  TokenizeRequest r;
  auto it = j->find("content");
  if (it == j->end()) return bad("content", "'content' is required", "missing_field");
  if (!it->is_string()) return bad("content", "'content' must be a string", "invalid_type");
  r.content = it->get<std::string>();
  if (auto e = get_bool(*j, "add_special", r.add_special)) return *e;
  if (auto e = get_bool(*j, "with_pieces", r.with_pieces)) return *e;
  return r;
}

ApiResult<DetokenizeRequest> parse_detokenize_request(std::string_view body) {
  ApiError err;
  auto j = parse_json_object(body, err);
  if (!j) return err;
  auto it = j->find("tokens");
  if (it == j->end()) return bad("tokens", "'tokens' is required", "missing_field");
  if (!it->is_array())
    return bad("tokens", "'tokens' must be an array of integers", "invalid_type");
  DetokenizeRequest r;
  for (size_t i = 0; i < it->size(); ++i) {
    const json& v = (*it)[i];
    if (!v.is_number_integer())
      return bad("tokens", fmt::format("'tokens[{}]' must be an integer", i), "invalid_type");
    const int64_t id = v.get<int64_t>();
    if (id < 0 || id > INT32_MAX)
      return bad("tokens", fmt::format("'tokens[{}]' = {} is out of range", i, id));
    r.tokens.push_back(static_cast<int32_t>(id));
  }
  return r;
}

namespace {
// Length of the longest suffix of `s` that could still grow into a complete UTF-8 character.
size_t incomplete_utf8_tail(std::string_view s) {
  for (size_t back = 1; back <= 4 && back <= s.size(); ++back) {
    const auto b = static_cast<unsigned char>(s[s.size() - back]);
    if ((b & 0xC0) == 0x80) continue;
    const size_t need = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
    return need > back ? back : 0;
  }
  return 0;
}
}  // namespace

std::string StopMatcher::push(std::string_view bytes) {
  if (stopped_) return {};
  pending_.append(bytes);
  size_t cut = std::string::npos;
  for (const std::string& s : stops_) cut = std::min(cut, pending_.find(s));
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, cut);
    pending_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : stops_)
    for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k)
      if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  hold = std::max(hold, incomplete_utf8_tail(pending_));
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  if (!stopped_) out.swap(pending_);
  return out;
}

}  // namespace kiln::server
