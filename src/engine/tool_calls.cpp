// engine/tool_calls.cpp: tool-call formats: detection from a template's source and the reply
// parsers (engine/tool_calls.h). Each parser returns nullopt for a reply whose call does not
// parse; parse_tool_reply then hands the reply back whole as content.
#include "engine/tool_calls.h"
#include "core/json_depth.h"

#include <nlohmann/json.hpp>

#include <algorithm>

#include "grammar/grammar.h"
#include "grammar/json_schema.h"

namespace kiln {

namespace {

using ojson = nlohmann::ordered_json;
using std::string_view;
constexpr size_t npos = string_view::npos;

bool has(string_view s, string_view needle) { return s.find(needle) != npos; }

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

string_view trim(string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

bool all_space(string_view s) { return std::all_of(s.begin(), s.end(), is_space); }

ToolReply plain(string_view text) {
  ToolReply r;
  r.content = text;
  return r;
}

// The end (one past) of the JSON object or array starting at s[pos], found by bracket depth
// outside strings; npos when it does not close.
size_t json_value_end(string_view s, size_t pos) {
  if (pos >= s.size() || (s[pos] != '{' && s[pos] != '[')) return npos;
  int depth = 0;
  bool in_string = false;
  for (size_t i = pos; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    if (c == '{' || c == '[') ++depth;
    if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return npos;
}

// Compact JSON text; a model's bytes that are not UTF-8 become U+FFFD instead of throwing.
std::string dump(const ojson& j) { return j.dump(-1, ' ', false, ojson::error_handler_t::replace); }

std::optional<ojson> parse_json(string_view s) {
  if (json_nesting_depth(s) > kMaxJsonDepth) return std::nullopt;  // not a call kiln can take
  ojson j = ojson::parse(s.begin(), s.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

// Arguments as OpenAI sends them: the JSON text of an object. A model may write them as an
// object or as a string holding one.
std::optional<std::string> arguments_text(const ojson& v) {
  if (v.is_object()) return dump(v);
  if (v.is_string()) {
    auto inner = parse_json(v.get<std::string>());
    if (inner && inner->is_object()) return dump(*inner);
  }
  return std::nullopt;
}

// {"name": str, "arguments" | "parameters": object} -> a call.
std::optional<ToolCall> call_from_object(const ojson& o) {
  if (!o.is_object()) return std::nullopt;
  auto name = o.find("name");
  if (name == o.end() || !name->is_string() || name->get<std::string>().empty())
    return std::nullopt;
  auto args = o.find("arguments");
  if (args == o.end()) args = o.find("parameters");
  std::optional<std::string> text =
      args == o.end() ? std::optional<std::string>("{}") : arguments_text(*args);
  if (!text) return std::nullopt;
  ToolCall c;
  c.name = name->get<std::string>();
  c.arguments = std::move(*text);
  if (auto id = o.find("id"); id != o.end() && id->is_string()) c.id = id->get<std::string>();
  return c;
}

// A value written as text (GLM's <arg_value>, Qwen3-Coder's <parameter=...>): templates print
// strings raw and everything else as JSON, so JSON that parses is taken as such.
ojson loose_value(string_view text) {
  if (auto j = parse_json(text)) return *j;
  return std::string(text);
}

// Splits `text` on <open>...<close> blocks: what lies outside goes to content, each body to
// `body` (false: malformed). A missing close at the end of the reply ends the last block.
template <class F>
std::optional<ToolReply> blocks(string_view text, string_view open, string_view close, F&& body) {
  ToolReply r;
  size_t pos = 0;
  for (size_t b; (b = text.find(open, pos)) != npos;) {
    // Whitespace between calls is layout, not content.
    if (pos == 0 || !all_space(text.substr(pos, b - pos))) r.content += text.substr(pos, b - pos);
    const size_t start = b + open.size();
    const size_t e = text.find(close, start);
    if (!body(text.substr(start, e == npos ? npos : e - start), r)) return std::nullopt;
    pos = e == npos ? text.size() : e + close.size();
  }
  if (pos == 0 || !all_space(text.substr(pos))) r.content += text.substr(pos);
  return r;
}

std::optional<ToolReply> parse_hermes(string_view text) {
  return blocks(text, "<tool_call>", "</tool_call>", [](string_view body, ToolReply& r) {
    auto j = parse_json(trim(body));
    if (!j) return false;
    // Apriel writes a list of calls in one block.
    const ojson list = j->is_array() ? *j : ojson::array({*j});
    for (const ojson& o : list) {
      auto c = call_from_object(o);
      if (!c) return false;
      r.tool_calls.push_back(std::move(*c));
    }
    return !list.empty();
  });
}

std::optional<ToolReply> parse_glm(string_view text) {
  return blocks(text, "<tool_call>", "</tool_call>", [](string_view body, ToolReply& r) {
    size_t k = body.find("<arg_key>");
    ToolCall c;
    c.name = trim(body.substr(0, k));
    if (c.name.empty() || has(c.name, "<")) return false;
    ojson args = ojson::object();
    while (k != npos) {
      const size_t ke = body.find("</arg_key>", k);
      const size_t v = body.find("<arg_value>", ke == npos ? k : ke);
      const size_t ve = body.find("</arg_value>", v == npos ? k : v);
      if (ke == npos || v == npos || ve == npos) return false;
      const string_view key = trim(body.substr(k + 9, ke - (k + 9)));
      args[std::string(key)] = loose_value(body.substr(v + 11, ve - (v + 11)));
      k = body.find("<arg_key>", ve);
    }
    c.arguments = dump(args);
    r.tool_calls.push_back(std::move(c));
    return true;
  });
}

std::optional<ToolReply> parse_qwen_xml(string_view text) {
  return blocks(text, "<tool_call>", "</tool_call>", [](string_view body, ToolReply& r) {
    body = trim(body);
    constexpr string_view kFn = "<function=";
    if (!body.starts_with(kFn)) return false;
    const size_t ne = body.find('>');
    if (ne == npos) return false;
    ToolCall c;
    c.name = trim(body.substr(kFn.size(), ne - kFn.size()));
    if (c.name.empty()) return false;
    ojson args = ojson::object();
    constexpr string_view kParam = "<parameter=";
    for (size_t p = body.find(kParam, ne); p != npos; p = body.find(kParam, p)) {
      const size_t ke = body.find('>', p);
      const size_t ve = body.find("</parameter>", ke == npos ? p : ke);
      if (ke == npos || ve == npos) return false;
      const string_view key = trim(body.substr(p + kParam.size(), ke - (p + kParam.size())));
      string_view value = body.substr(ke + 1, ve - (ke + 1));
      // The template puts the value on lines of its own.
      if (value.starts_with('\n')) value.remove_prefix(1);
      if (value.ends_with('\n')) value.remove_suffix(1);
      args[std::string(key)] = loose_value(value);
      p = ve;
    }
    c.arguments = dump(args);
    r.tool_calls.push_back(std::move(c));
    return true;
  });
}

std::optional<ToolReply> parse_mistral(string_view text) {
  constexpr string_view kCalls = "[TOOL_CALLS]", kArgs = "[ARGS]", kId = "[CALL_ID]";
  size_t pos = text.find(kCalls);
  if (pos == npos) return plain(text);
  ToolReply r = plain(text.substr(0, pos));
  while (pos != npos && text.substr(pos).starts_with(kCalls)) {
    pos += kCalls.size();
    while (pos < text.size() && is_space(text[pos])) ++pos;
    if (pos < text.size() && text[pos] == '[') {  // Nemo: a JSON array of calls
      const size_t end = json_value_end(text, pos);
      if (end == npos) return std::nullopt;
      auto list = parse_json(text.substr(pos, end - pos));
      if (!list || !list->is_array() || list->empty()) return std::nullopt;
      for (const ojson& o : *list) {
        auto c = call_from_object(o);
        if (!c) return std::nullopt;
        r.tool_calls.push_back(std::move(*c));
      }
      pos = end;
    } else {  // NAME[ARGS]{...} or NAME[CALL_ID]id[ARGS]{...}
      const size_t a = text.find(kArgs, pos);
      if (a == npos) return std::nullopt;
      ToolCall c;
      string_view head = text.substr(pos, a - pos);
      if (const size_t i = head.find(kId); i != npos) {
        c.id = std::string(trim(head.substr(i + kId.size())));
        head = head.substr(0, i);
      }
      c.name = std::string(trim(head));
      const size_t start = a + kArgs.size();
      const size_t end = json_value_end(text, start);
      if (c.name.empty() || end == npos) return std::nullopt;
      auto args = parse_json(text.substr(start, end - start));
      if (!args || !args->is_object()) return std::nullopt;
      c.arguments = dump(*args);
      r.tool_calls.push_back(std::move(c));
      pos = end;
    }
    const size_t next = text.find_first_not_of(" \n\t\r", pos);
    if (next == npos) return r;
    pos = next;
  }
  r.content += text.substr(pos);
  return r;
}

std::optional<ToolReply> parse_deepseek(string_view text) {
  constexpr string_view kBegin = "<｜tool▁calls▁begin｜>", kEnd = "<｜tool▁calls▁end｜>",
                        kCall = "<｜tool▁call▁begin｜>", kCallEnd = "<｜tool▁call▁end｜>",
                        kSep = "<｜tool▁sep｜>";
  size_t b = text.find(kBegin);
  // R1 sometimes opens with a single call's marker.
  const size_t first_call = text.find(kCall);
  if (b == npos || (first_call != npos && first_call < b)) b = first_call;
  if (b == npos) return plain(text);
  ToolReply r = plain(text.substr(0, b));
  const size_t e = text.find(kEnd, b);
  const string_view calls = text.substr(b, e == npos ? npos : e - b);
  if (e != npos) r.content += text.substr(e + kEnd.size());
  for (size_t p = calls.find(kCall); p != npos; p = calls.find(kCall, p)) {
    const size_t start = p + kCall.size();
    const size_t ce = calls.find(kCallEnd, start);
    const string_view body = calls.substr(start, ce == npos ? npos : ce - start);
    const size_t sep = body.find(kSep);
    if (sep == npos) return std::nullopt;
    const string_view before = trim(body.substr(0, sep)), after = body.substr(sep + kSep.size());
    ToolCall c;
    string_view args;
    if (before == "function") {  // R1: function<sep>NAME\n```json\n{...}\n```
      const size_t nl = after.find('\n');
      if (nl == npos) return std::nullopt;
      c.name = std::string(trim(after.substr(0, nl)));
      args = trim(after.substr(nl + 1));
      if (args.starts_with("```json")) args.remove_prefix(7);
      if (args.ends_with("```")) args.remove_suffix(3);
    } else {  // V3.1: NAME<sep>{...}
      c.name = std::string(before);
      args = after;
    }
    auto j = parse_json(trim(args));
    if (c.name.empty() || !j || !j->is_object()) return std::nullopt;
    c.arguments = dump(*j);
    r.tool_calls.push_back(std::move(c));
    if (ce == npos) break;
    p = ce + kCallEnd.size();
  }
  if (r.tool_calls.empty()) return std::nullopt;
  return r;
}

std::optional<ToolReply> parse_llama3(string_view text) {
  constexpr string_view kTag = "<|python_tag|>";
  ToolReply r;
  string_view t;
  if (const size_t tag = text.find(kTag); tag != npos) {  // text before the tag is content
    r.content = text.substr(0, tag);
    t = trim(text.substr(tag + kTag.size()));
    if (!t.starts_with('{')) return std::nullopt;  // a built-in tool's code call: not parsed
  } else {
    t = trim(text);
    if (!t.starts_with('{')) return plain(text);
  }
  size_t pos = 0;
  // One call, or several separated by ';' as Llama 3.1 sometimes writes them.
  while (pos < t.size()) {
    const size_t end = json_value_end(t, pos);
    if (end == npos) return std::nullopt;
    auto j = parse_json(t.substr(pos, end - pos));
    if (!j) return std::nullopt;
    auto c = call_from_object(*j);
    if (!c) return std::nullopt;
    r.tool_calls.push_back(std::move(*c));
    pos = t.find_first_not_of(" \n\t\r;", end);
    if (pos == npos) break;
    if (t[pos] != '{') {
      r.content += t.substr(pos);
      break;
    }
  }
  return r;
}

// A harmony header's value after `key` (a channel name, a recipient), up to a space or a
// token; empty when the key is absent.
string_view harmony_field(string_view header, string_view key) {
  const size_t k = header.find(key);
  if (k == npos) return {};
  const size_t v = k + key.size();
  const size_t ve = std::min(header.find(' ', v), header.find("<|", v));
  return trim(header.substr(v, ve == npos ? npos : ve - v));
}

constexpr string_view kHarmonyStops[] = {"<|end|>", "<|call|>", "<|return|>", "<|start|>"};

// Harmony: messages "[<|start|>assistant]<|channel|>CH[ to=functions.NAME][ <|constrain|>json]
// <|message|>BODY<|end|>|<|call|>|<|return|>"; the recipient may also stand before the channel.
std::optional<ToolReply> parse_gpt_oss(string_view text) {
  if (!has(text, "<|channel|>") && !has(text, "<|message|>")) return plain(text);
  ToolReply r;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t m = text.find("<|message|>", pos);
    if (m == npos) {
      if (!all_space(text.substr(pos))) return std::nullopt;
      break;
    }
    string_view header = text.substr(pos, m - pos);
    if (header.starts_with("<|start|>")) header.remove_prefix(9);
    const size_t start = m + 11;
    size_t end = text.size(), next = text.size();
    for (string_view stop : kHarmonyStops) {
      const size_t s = text.find(stop, start);
      if (s != npos && s < end) {
        end = s;
        next = stop == "<|start|>" ? s : s + stop.size();
      }
    }
    const string_view body = text.substr(start, end - start);
    const string_view channel = harmony_field(header, "<|channel|>"),
                      to = harmony_field(header, "to=");
    if (!to.empty()) {
      if (!to.starts_with("functions.") || to.size() == 10) return std::nullopt;
      auto j = parse_json(trim(body));
      if (!j || !j->is_object()) return std::nullopt;
      ToolCall c;
      c.name = to.substr(10);
      c.arguments = dump(*j);
      r.tool_calls.push_back(std::move(c));
    } else if (channel == "analysis") {
      r.reasoning += body;
    } else {
      r.content += body;
    }
    pos = next;
  }
  return r;
}

std::optional<ToolReply> parse(ToolFormat f, string_view text) {
  switch (f) {
    case ToolFormat::kLlama3:
      return parse_llama3(text);
    case ToolFormat::kHermes:
      return parse_hermes(text);
    case ToolFormat::kQwenXml:
      return parse_qwen_xml(text);
    case ToolFormat::kGlm:
      return parse_glm(text);
    case ToolFormat::kMistral:
      return parse_mistral(text);
    case ToolFormat::kDeepSeek:
      return parse_deepseek(text);
    case ToolFormat::kGptOss:
      return parse_gpt_oss(text);
    case ToolFormat::kNone:
      break;
  }
  return plain(text);
}

// Texts whose appearance starts a call (the reply is held from there on).
std::span<const string_view> start_markers(ToolFormat f) {
  static constexpr string_view kLlama[] = {"<|python_tag|>"};
  static constexpr string_view kTag[] = {"<tool_call>"};
  static constexpr string_view kMistral[] = {"[TOOL_CALLS]"};
  static constexpr string_view kDeepSeek[] = {"<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"};
  switch (f) {
    case ToolFormat::kLlama3:
      return kLlama;
    case ToolFormat::kHermes:
    case ToolFormat::kQwenXml:
    case ToolFormat::kGlm:
      return kTag;
    case ToolFormat::kMistral:
      return kMistral;
    case ToolFormat::kDeepSeek:
      return kDeepSeek;
    case ToolFormat::kGptOss:
    case ToolFormat::kNone:
      break;
  }
  return {};
}

}  // namespace

ToolFormat detect_tool_format(string_view src) {
  if (has(src, "<|channel|>") && has(src, "<|message|>")) return ToolFormat::kGptOss;
  if (has(src, "<｜tool▁calls▁begin｜>")) return ToolFormat::kDeepSeek;
  if (has(src, "[TOOL_CALLS]")) return ToolFormat::kMistral;
  if (has(src, "<invoke name=")) return ToolFormat::kNone;  // MiniMax's XML: not parsed
  if (has(src, "<tool_call>")) {
    if (has(src, "<arg_key>")) return ToolFormat::kGlm;
    if (has(src, "<function=") && has(src, "<parameter=")) return ToolFormat::kQwenXml;
    return ToolFormat::kHermes;
  }
  if (has(src, "<function=")) return ToolFormat::kNone;  // Functionary, Seed-OSS: not parsed
  if (has(src, "<|start_header_id|>") && (has(src, "<|python_tag|>") || has(src, "ipython")))
    return ToolFormat::kLlama3;
  return ToolFormat::kNone;
}

const char* tool_format_name(ToolFormat f) {
  switch (f) {
    case ToolFormat::kNone:
      return "none";
    case ToolFormat::kLlama3:
      return "llama3";
    case ToolFormat::kHermes:
      return "hermes";
    case ToolFormat::kQwenXml:
      return "qwen3-xml";
    case ToolFormat::kGlm:
      return "glm";
    case ToolFormat::kMistral:
      return "mistral";
    case ToolFormat::kDeepSeek:
      return "deepseek";
    case ToolFormat::kGptOss:
      return "gpt-oss";
  }
  return "?";
}

std::span<const string_view> tool_format_special_texts(ToolFormat f) {
  static constexpr string_view kGptOss[] = {"<|start|>",     "<|channel|>", "<|message|>",
                                            "<|constrain|>", "<|end|>",     "<|call|>",
                                            "<|return|>"};
  static constexpr string_view kDeepSeek[] = {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                                              "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                                              "<｜tool▁sep｜>"};
  static constexpr string_view kMistral[] = {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"};
  static constexpr string_view kTag[] = {"<tool_call>", "</tool_call>"};
  static constexpr string_view kGlm[] = {"<tool_call>", "</tool_call>", "<arg_key>",
                                         "</arg_key>",  "<arg_value>",  "</arg_value>"};
  static constexpr string_view kLlama[] = {"<|python_tag|>"};
  switch (f) {
    case ToolFormat::kGptOss:
      return kGptOss;
    case ToolFormat::kDeepSeek:
      return kDeepSeek;
    case ToolFormat::kMistral:
      return kMistral;
    case ToolFormat::kHermes:
    case ToolFormat::kQwenXml:
      return kTag;
    case ToolFormat::kGlm:
      return kGlm;
    case ToolFormat::kLlama3:
      return kLlama;
    case ToolFormat::kNone:
      break;
  }
  return {};
}

bool tool_call_gbnf_supported(ToolFormat f) {
  return f == ToolFormat::kHermes || f == ToolFormat::kLlama3 || f == ToolFormat::kMistral;
}

Expected<std::string> tool_call_gbnf(ToolFormat f, string_view template_source, const ojson& tools,
                                     string_view only, bool parallel) {
  if (!tool_call_gbnf_supported(f))
    return Status::errorf(
        "forcing a tool call is not implemented for the tool-call format '{}' (kiln forces "
        "calls in the hermes, llama3 and mistral formats)",
        tool_format_name(f));
  auto lit = [](string_view s) {
    std::string out;
    grammar::append_gbnf_literal(out, s);
    return out;
  };
  const bool mistral_args = f == ToolFormat::kMistral && has(template_source, "[ARGS]");
  grammar::SchemaGrammar g;
  std::string alternatives;  // one call of any allowed function
  for (size_t k = 0; k < tools.size(); ++k) {
    const ojson& fn = tools[k].at("function");
    const std::string name = fn.at("name").get<std::string>();
    if (!only.empty() && name != only) continue;
    // No parameters: the function takes none ({}).
    const ojson none = {{"type", "object"}, {"properties", ojson::object()}};
    auto p = fn.find("parameters");
    auto args = g.add_schema(p == fn.end() || p->is_null() ? none : *p, "args");
    if (!args)
      return Status::errorf(
          "tools[{}].function.parameters: {} (a forced call's arguments are "
          "constrained by its schema)",
          k, args.status().message());
    const std::string name_json = ojson(name).dump();
    std::string body;
    switch (f) {
      case ToolFormat::kHermes:
        body = lit("{\"name\": " + name_json + ", \"arguments\": ") + " " + *args + " " + lit("}");
        break;
      case ToolFormat::kLlama3:
        body = lit("{\"name\": " + name_json + ", \"parameters\": ") + " " + *args + " " + lit("}");
        break;
      case ToolFormat::kMistral:
        // Small 3.2 / Devstral: NAME[ARGS]{...}; Nemo: {"name", "arguments", "id" of 9}.
        body = mistral_args
                   ? lit(name) + " " + lit("[ARGS]") + " " + *args
                   : lit("{\"name\": " + name_json + ", \"arguments\": ") + " " + *args + " ( " +
                         lit(", \"id\": \"") + " [a-zA-Z0-9]{9} " + lit("\"") + " )? " + lit("}");
        break;
      default:
        break;
    }
    if (!alternatives.empty()) alternatives += " | ";
    alternatives += g.add_rule("call-" + std::to_string(k), std::move(body));
  }
  if (alternatives.empty())
    return Status::errorf("tool_choice names the function '{}', which is not in 'tools'", only);
  const std::string call = g.add_rule("call", alternatives);
  std::string root;
  switch (f) {
    case ToolFormat::kHermes: {
      const std::string block =
          g.add_rule("block", lit("<tool_call>\n") + " " + call + " " + lit("\n</tool_call>"));
      root = parallel ? block + " ( " + lit("\n") + " " + block + " )*" : block;
      break;
    }
    case ToolFormat::kLlama3:
      root = call;
      break;
    case ToolFormat::kMistral:
      if (mistral_args) {
        const std::string one = g.add_rule("block", lit("[TOOL_CALLS]") + " " + call);
        root = parallel ? one + "+" : one;
      } else {
        root = lit("[TOOL_CALLS][") + " " + call +
               (parallel ? " ( " + lit(", ") + " " + call + " )*" : "") + " " + lit("]");
      }
      break;
    default:
      break;
  }
  return g.gbnf(root);
}

ToolReply parse_tool_reply(ToolFormat f, string_view text) {
  std::optional<ToolReply> r = parse(f, text);
  if (!r) return plain(text);
  // Whitespace around calls is layout, not an answer.
  if (!r->tool_calls.empty() && all_space(r->content)) r->content.clear();
  return *r;
}

std::string ToolCallStream::push(string_view text) {
  held_ += text;
  if (in_call_) return {};
  if (format_ == ToolFormat::kGptOss) {  // the whole reply is channels: parsed at the end
    in_call_ = true;
    return {};
  }
  size_t at = npos;
  for (string_view m : start_markers(format_)) at = std::min(at, held_.find(m));
  size_t hold = 0;
  if (format_ == ToolFormat::kLlama3 && all_space(released_)) {
    // Llama 3 writes a call as a bare JSON object that opens the reply.
    const size_t first = held_.find_first_not_of(" \n\t\r");
    if (first == npos)
      hold = held_.size();
    else if (held_[first] == '{')
      at = std::min(at, size_t{0});
  }
  if (at != npos) {
    in_call_ = true;
    std::string out = held_.substr(0, at);
    held_.erase(0, at);
    released_ += out;
    return out;
  }
  // Keep back the longest suffix that may still grow into a marker.
  for (string_view m : start_markers(format_))
    for (size_t k = std::min(m.size() - 1, held_.size()); k > hold; --k)
      if (held_.compare(held_.size() - k, k, m, 0, k) == 0) {
        hold = k;
        break;
      }
  std::string out = held_.substr(0, held_.size() - hold);
  held_.erase(0, held_.size() - hold);
  released_ += out;
  return out;
}

ToolReply ToolCallStream::finish() {
  ToolReply r = in_call_ ? parse_tool_reply(format_, held_) : plain(held_);
  held_.clear();
  return r;
}

std::vector<ToolStreamDelta> ToolCallStream::push_deltas(string_view text) {
  std::vector<ToolStreamDelta> out;
  if (format_ == ToolFormat::kGptOss) {
    held_ += text;
    harmony_deltas(out, false);
    return out;
  }
  std::string content = push(text);
  if (!content.empty())
    out.push_back({ToolStreamDelta::Kind::kContent, 0, std::move(content), {}, {}});
  return out;
}

std::vector<ToolStreamDelta> ToolCallStream::finish_deltas() {
  std::vector<ToolStreamDelta> out;
  if (format_ == ToolFormat::kGptOss) {
    harmony_deltas(out, true);
    return out;
  }
  ToolReply r = finish();
  if (!r.content.empty()) out.push_back({ToolStreamDelta::Kind::kContent, 0, r.content, {}, {}});
  for (size_t i = 0; i < r.tool_calls.size(); ++i) {
    const auto index = static_cast<int32_t>(i);
    out.push_back({ToolStreamDelta::Kind::kCallStart, index, r.tool_calls[i].name,
                   r.tool_calls[i].id, r.tool_calls[i].arguments});
  }
  return out;
}

void ToolCallStream::harmony_emit(std::vector<ToolStreamDelta>& out, string_view text) {
  using Kind = ToolStreamDelta::Kind;
  if (body_kind_ == Kind::kArguments && !args_started_) {
    const size_t first = text.find_first_not_of(" \n\t\r");
    if (first == npos) return;
    text.remove_prefix(first);
    args_started_ = true;
  }
  if (text.empty()) return;
  const int32_t index = body_kind_ == Kind::kArguments ? n_calls_ - 1 : 0;
  // One delta per kind in a row: a push of several tokens' text stays one piece.
  if (!out.empty() && out.back().kind == body_kind_ && out.back().index == index)
    out.back().text += text;
  else
    out.push_back({body_kind_, index, std::string(text), {}, {}});
}

void ToolCallStream::harmony_deltas(std::vector<ToolStreamDelta>& out, bool at_end) {
  using Kind = ToolStreamDelta::Kind;
  for (;;) {
    if (!in_body_) {
      const size_t m = held_.find("<|message|>");
      if (m == npos) break;
      string_view header = string_view(held_).substr(0, m);
      if (header.starts_with("<|start|>")) header.remove_prefix(9);
      const string_view channel = harmony_field(header, "<|channel|>"),
                        to = harmony_field(header, "to=");
      if (to.starts_with("functions.") && to.size() > 10) {
        out.push_back({Kind::kCallStart, n_calls_++, std::string(to.substr(10)), {}, {}});
        body_kind_ = Kind::kArguments;
        args_started_ = false;
      } else {
        body_kind_ = channel == "analysis" ? Kind::kReasoning : Kind::kContent;
      }
      held_.erase(0, m + 11);
      in_body_ = true;
    }
    size_t end = npos, next = npos;
    for (string_view stop : kHarmonyStops) {
      const size_t s = held_.find(stop);
      if (s != npos && s < end) {
        end = s;
        next = stop == "<|start|>" ? s : s + stop.size();
      }
    }
    if (end == npos) {
      // Keep back what may still grow into a stop marker.
      size_t hold = 0;
      if (!at_end)
        for (string_view stop : kHarmonyStops)
          for (size_t k = std::min(stop.size() - 1, held_.size()); k > hold; --k)
            if (held_.compare(held_.size() - k, k, stop, 0, k) == 0) {
              hold = k;
              break;
            }
      harmony_emit(out, string_view(held_).substr(0, held_.size() - hold));
      held_.erase(0, held_.size() - hold);
      return;
    }
    harmony_emit(out, string_view(held_).substr(0, end));
    held_.erase(0, next);
    in_body_ = false;
  }
  // Between messages at the end: a header the model did not finish is text it wrote, not
  // layout; the whole-reply parse returns such a reply as content too.
  if (at_end && !all_space(held_)) {
    body_kind_ = Kind::kContent;
    harmony_emit(out, held_);
  }
  if (at_end) held_.clear();
}

}  // namespace kiln
