// grammar/json_schema.cpp: the JSON Schema -> GBNF converter (see json_schema.h).
#include "grammar/json_schema.h"

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include "core/check.h"
#include "grammar/grammar.h"

namespace kiln::grammar {

namespace {

using ojson = nlohmann::ordered_json;

// Building blocks, defined once when first used. Whitespace is bounded so that a model that
// only writes spaces still reaches the end of the JSON in bounded tokens.
const std::map<std::string, std::string>& primitives() {
  static const std::map<std::string, std::string> p = {
      {"ws", R"(| " " | "\n" [ \t]{0,20})"},
      {"char", R"([^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))"},
      {"string", R"("\"" char* "\"")"},
      {"integer", R"("-"? ("0" | [1-9] [0-9]{0,15}))"},
      {"number", R"("-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?)"},
      {"boolean", R"("true" | "false")"},
      {"null", R"("null")"},
      {"value", R"(object | array | string | number | boolean | null)"},
      {"object",
       R"("{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}")"},
      {"array", R"("[" ws ( value ws ( "," ws value ws )* )? "]")"},
  };
  return p;
}
const std::map<std::string, std::vector<std::string>>& primitive_deps() {
  static const std::map<std::string, std::vector<std::string>> d = {
      {"string", {"char"}},
      {"value", {"object", "array", "string", "number", "boolean", "null"}},
      {"object", {"ws", "string", "value"}},
      {"array", {"ws", "value"}},
  };
  return d;
}

const std::set<std::string>& annotations() {
  static const std::set<std::string> a = {"title",    "description", "default",  "examples",
                                          "$schema",  "$id",         "$comment", "deprecated",
                                          "readOnly", "writeOnly",   "$defs",    "definitions"};
  return a;
}

std::string literal(std::string_view s) {
  std::string out;
  append_gbnf_literal(out, s);
  return out;
}

bool matches_type(const ojson& v, const std::string& t) {
  if (t == "string") return v.is_string();
  if (t == "number") return v.is_number();
  if (t == "integer") return v.is_number_integer();
  if (t == "boolean") return v.is_boolean();
  if (t == "null") return v.is_null();
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  return false;
}

}  // namespace

// One schema's conversion, adding its rules to a SchemaGrammar's (names unique over all the
// schemas added there; $ref resolves within this schema).
class SchemaConverter {
 public:
  SchemaConverter(const ojson& root, std::set<std::string>& defined,
                  std::vector<std::pair<std::string, std::string>>& order)
      : root_(root), defined_(defined), order_(order) {}

  Expected<std::string> run(const std::string& hint) {
    const std::string top = visit(root_, "#", hint, 0);
    if (!err_.is_ok()) return err_;
    return top;
  }

  std::string use_primitive(const std::string& name) {
    if (!defined_.insert(name).second) return name;
    if (auto it = primitive_deps().find(name); it != primitive_deps().end())
      for (const std::string& d : it->second) use_primitive(d);
    order_.emplace_back(name, primitives().at(name));
    return name;
  }

 private:
  // Both parts may quote schema text (a key, a property name, a $ref) whose JSON escapes
  // decoded to control characters; those are written as \xNN so the error stays one line.
  static std::string one_line(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
        out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
      else
        out += c;
    }
    return out;
  }
  void fail(const std::string& where, const std::string& what) {
    if (err_.is_ok())
      err_ = Status::errorf("json_schema: at '{}': {}", one_line(where), one_line(what));
  }

  std::string new_rule(std::string hint) {
    for (char& c : hint)
      if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))) c = '-';
    if (hint.empty()) hint = "r";
    std::string name = hint;
    for (int k = 2; defined_.count(name) || primitives().count(name) || name == "root"; ++k)
      name = fmt::format("{}-{}", hint, k);
    defined_.insert(name);
    return name;
  }
  std::string define(std::string hint, std::string body) {
    std::string name = new_rule(std::move(hint));
    order_.emplace_back(name, std::move(body));
    return name;
  }

  // Checks every keyword of `s` is one this converter applies (or an annotation).
  bool check_keys(const ojson& s, const std::string& where, std::initializer_list<const char*> ok) {
    for (auto it = s.begin(); it != s.end(); ++it) {
      const std::string& k = it.key();
      if (annotations().count(k)) continue;
      if (std::any_of(ok.begin(), ok.end(), [&](const char* a) { return k == a; })) continue;
      fail(where, fmt::format("'{}' is not supported here", k));
      return false;
    }
    return true;
  }

  bool get_count(const ojson& s, const char* key, const std::string& where, int64_t& out) {
    auto it = s.find(key);
    if (it == s.end()) return true;
    if (!it->is_number_integer() || it->get<int64_t>() < 0 ||
        it->get<int64_t>() > Grammar::kMaxRepeat) {
      fail(where, fmt::format("'{}' must be an integer in [0, {}]", key, Grammar::kMaxRepeat));
      return false;
    }
    out = it->get<int64_t>();
    return true;
  }

  std::string visit(const ojson& s, const std::string& where, const std::string& hint, int depth) {
    if (!err_.is_ok()) return "";
    if (depth > 64) return fail(where, "nested deeper than 64 levels"), "";
    if (s.is_boolean()) {
      if (!s.get<bool>()) return fail(where, "the schema 'false' matches nothing"), "";
      return use_primitive("value");
    }
    if (!s.is_object()) return fail(where, "a schema must be an object or a boolean"), "";

    if (auto it = s.find("$ref"); it != s.end()) {
      if (!check_keys(s, where, {"$ref"})) return "";
      return ref(*it, where, depth);
    }
    if (auto it = s.find("const"); it != s.end()) {
      if (!check_keys(s, where, {"const", "type"})) return "";
      return literal(it->dump());
    }
    if (auto it = s.find("enum"); it != s.end()) {
      if (!check_keys(s, where, {"enum", "type"})) return "";
      if (!it->is_array() || it->empty())
        return fail(where, "'enum' must be a non-empty array"), "";
      std::vector<std::string> types;
      if (auto t = s.find("type"); t != s.end()) {
        if (t->is_string()) types.push_back(t->get<std::string>());
        if (t->is_array())
          for (const ojson& x : *t)
            if (x.is_string()) types.push_back(x.get<std::string>());
      }
      std::string body;
      for (const ojson& v : *it) {
        // A value the 'type' excludes could not validate: leave it out.
        if (!types.empty() && std::none_of(types.begin(), types.end(), [&](const std::string& t) {
              return matches_type(v, t);
            }))
          continue;
        if (!body.empty()) body += " | ";
        body += literal(v.dump());
      }
      if (body.empty()) return fail(where, "no 'enum' value has the schema's 'type'"), "";
      return define(hint, body);
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      auto it = s.find(key);
      if (it == s.end()) continue;
      if (!check_keys(s, where, {key})) return "";
      if (!it->is_array() || it->empty())
        return fail(where, fmt::format("'{}' must be a non-empty array", key)), "";
      std::string body;
      for (size_t i = 0; i < it->size(); ++i) {
        const std::string alt = visit((*it)[i], fmt::format("{}/{}/{}", where, key, i),
                                      fmt::format("{}-{}", hint, i), depth + 1);
        if (!body.empty()) body += " | ";
        body += alt;
      }
      return define(hint, body);
    }

    std::string type;
    if (auto it = s.find("type"); it != s.end()) {
      if (it->is_array()) {
        if (it->empty()) return fail(where, "'type' must not be an empty list"), "";
        std::string body;
        for (const ojson& t : *it) {
          if (!t.is_string()) return fail(where, "'type' entries must be strings"), "";
          ojson one = s;
          one["type"] = t;
          if (!body.empty()) body += " | ";
          body += visit(one, where, hint + "-" + t.get<std::string>(), depth + 1);
        }
        return define(hint, body);
      }
      if (!it->is_string()) return fail(where, "'type' must be a string or a list"), "";
      type = it->get<std::string>();
    } else if (s.contains("properties") || s.contains("additionalProperties") ||
               s.contains("required")) {
      type = "object";
    } else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) {
      type = "array";
    } else if (s.contains("minLength") || s.contains("maxLength")) {
      type = "string";
    } else {
      if (!check_keys(s, where, {})) return "";
      return use_primitive("value");
    }

    if (type == "object") return object(s, where, hint, depth);
    if (type == "array") return array(s, where, hint, depth);
    if (type == "string") {
      if (!check_keys(s, where, {"type", "minLength", "maxLength"})) return "";
      int64_t lo = 0, hi = -1;
      if (!get_count(s, "minLength", where, lo) || !get_count(s, "maxLength", where, hi)) return "";
      if (lo == 0 && hi < 0) return use_primitive("string");
      if (hi >= 0 && hi < lo) return fail(where, "'maxLength' is below 'minLength'"), "";
      use_primitive("char");
      return define(hint, hi < 0 ? fmt::format(R"("\"" char{{{},}} "\"")", lo)
                                 : fmt::format(R"("\"" char{{{},{}}} "\"")", lo, hi));
    }
    if (type == "number" || type == "integer" || type == "boolean" || type == "null") {
      if (!check_keys(s, where, {"type"})) return "";
      return use_primitive(type);
    }
    return fail(where, fmt::format("type '{}' is not a JSON Schema type", type)), "";
  }

  std::string ref(const ojson& r, const std::string& where, int depth) {
    if (!r.is_string()) return fail(where, "'$ref' must be a string"), "";
    const std::string target = r.get<std::string>();
    if (auto it = refs_.find(target); it != refs_.end()) return it->second;
    const ojson* node = nullptr;
    std::string name;
    if (target == "#") {
      node = &root_;
      name = "root-ref";
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        const std::string p = prefix;
        if (target.compare(0, p.size(), p) != 0) continue;
        std::string key;  // JSON pointer unescaping of one segment
        for (size_t i = p.size(); i < target.size(); ++i) {
          if (target[i] == '/')
            return fail(where, fmt::format("'$ref' '{}' is not supported", target)), "";
          if (target[i] == '~' && i + 1 < target.size() &&
              (target[i + 1] == '0' || target[i + 1] == '1')) {
            key += target[i + 1] == '0' ? '~' : '/';
            ++i;
          } else {
            key += target[i];
          }
        }
        const std::string section = p.substr(2, p.size() - 3);
        auto sec = root_.find(section);
        if (sec == root_.end() || !sec->is_object() || !sec->contains(key))
          return fail(where, fmt::format("'$ref' '{}' points at nothing", target)), "";
        node = &(*sec)[key];
        name = "def-" + key;
        break;
      }
    }
    if (!node)
      return fail(where, fmt::format("'$ref' '{}' is not supported (only #/$defs/NAME, "
                                     "#/definitions/NAME and #)",
                                     target)),
             "";
    // Named before its body is built, so a recursive schema refers to itself.
    const std::string rule = new_rule(name);
    refs_[target] = rule;
    const size_t slot = order_.size();
    order_.emplace_back(rule, "");
    const std::string body = visit(*node, target, rule + "-value", depth + 1);
    order_[slot].second = body;
    return rule;
  }

  std::string object(const ojson& s, const std::string& where, const std::string& hint, int depth) {
    if (!check_keys(s, where, {"type", "properties", "required", "additionalProperties"}))
      return "";
    use_primitive("ws");
    const ojson empty = ojson::object();
    const ojson* props = &empty;
    if (auto it = s.find("properties"); it != s.end()) {
      if (!it->is_object()) return fail(where, "'properties' must be an object"), "";
      props = &*it;
    }
    std::set<std::string> required;
    if (auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) return fail(where, "'required' must be an array of names"), "";
      for (const ojson& r : *it) {
        if (!r.is_string()) return fail(where, "'required' must be an array of names"), "";
        if (!props->contains(r.get<std::string>()))
          return fail(where, fmt::format("required property '{}' is not in 'properties'",
                                         r.get<std::string>())),
                 "";
        required.insert(r.get<std::string>());
      }
    }
    const ojson* extra = nullptr;  // additionalProperties' schema, null: none allowed
    if (auto it = s.find("additionalProperties"); it != s.end()) {
      if (it->is_boolean()) {
        if (it->get<bool>()) extra = &*it;
      } else if (it->is_object()) {
        extra = &*it;
      } else {
        return fail(where, "'additionalProperties' must be a boolean or a schema"), "";
      }
    }
    // No properties and no additionalProperties: JSON Schema's any object.
    if (props->empty() && !s.contains("additionalProperties")) return use_primitive("object");
    if (extra && !props->empty())
      return fail(where,
                  "'additionalProperties' other than false beside 'properties' is not supported"),
             "";
    if (extra) {  // a map: any keys, values of one schema
      const std::string v =
          visit(*extra, where + "/additionalProperties", hint + "-value", depth + 1);
      use_primitive("string");
      const std::string kv = define(hint + "-kv", fmt::format(R"(string ws ":" ws {} ws)", v));
      return define(hint, fmt::format(R"("{{" ws ( {} ( "," ws {} )* )? "}}")", kv, kv));
    }
    // Properties in order; optional ones may be left out. F_i: the members from i on with
    // none written yet (no comma before the first); after a member, the rest each carry their
    // comma.
    std::vector<std::string> kvs;
    std::vector<bool> req;
    for (auto it = props->begin(); it != props->end(); ++it) {
      const std::string v =
          visit(it.value(), where + "/properties/" + it.key(), hint + "-" + it.key(), depth + 1);
      std::string key_json = ojson(it.key()).dump();
      kvs.push_back(define(hint + "-" + it.key() + "-kv",
                           fmt::format(R"({} ws ":" ws {} ws)", literal(key_json), v)));
      req.push_back(required.count(it.key()) > 0);
    }
    if (!err_.is_ok()) return "";
    const size_t n = kvs.size();
    auto rest = [&](size_t i) {  // members i.. after one was written
      std::string r;
      for (size_t k = i; k < n; ++k)
        r += req[k] ? fmt::format(R"( "," ws {})", kvs[k])
                    : fmt::format(R"( ( "," ws {} )?)", kvs[k]);
      return r;
    };
    std::string first = "";  // F_n: nothing
    for (size_t i = n; i-- > 0;) {
      std::string body = kvs[i] + rest(i + 1);
      // (An empty alternative is written as "( ... )?": a rule line may not end in "|".)
      if (!req[i]) body = first.empty() ? "( " + body + " )?" : body + " | " + first;
      first = define(fmt::format("{}-from{}", hint, i), body);
    }
    return define(hint, first.empty() ? R"("{" ws "}")" : fmt::format(R"("{{" ws {} "}}")", first));
  }

  std::string array(const ojson& s, const std::string& where, const std::string& hint, int depth) {
    if (!check_keys(s, where, {"type", "items", "minItems", "maxItems"})) return "";
    use_primitive("ws");
    int64_t lo = 0, hi = -1;
    if (!get_count(s, "minItems", where, lo) || !get_count(s, "maxItems", where, hi)) return "";
    if (hi >= 0 && hi < lo) return fail(where, "'maxItems' is below 'minItems'"), "";
    std::string item;
    if (auto it = s.find("items"); it != s.end())
      item = visit(*it, where + "/items", hint + "-item", depth + 1);
    else
      item = use_primitive("value");
    if (!err_.is_ok()) return "";
    if (hi == 0) return define(hint, R"("[" ws "]")");
    const std::string more = hi < 0
                                 ? fmt::format("{{{},}}", std::max<int64_t>(lo - 1, 0))
                                 : fmt::format("{{{},{}}}", std::max<int64_t>(lo - 1, 0), hi - 1);
    const std::string items = fmt::format(R"({} ws ( "," ws {} ws ){})", item, item, more);
    return define(hint, lo == 0 ? fmt::format(R"("[" ws ( {} )? "]")", items)
                                : fmt::format(R"("[" ws {} "]")", items));
  }

  const ojson& root_;
  Status err_;
  std::set<std::string>& defined_;
  std::vector<std::pair<std::string, std::string>>& order_;  // rules in definition order
  std::map<std::string, std::string> refs_;                  // $ref target -> rule
};

Expected<std::string> SchemaGrammar::add_schema(const nlohmann::ordered_json& schema,
                                                std::string_view hint) {
  // A failed schema must not leave half its rules behind.
  const auto defined = defined_;
  const size_t n_rules = order_.size();
  SchemaConverter c(schema, defined_, order_);
  auto top = c.run(std::string(hint));
  if (!top) {
    defined_ = defined;
    order_.resize(n_rules);
  }
  return top;
}

std::string SchemaGrammar::add_rule(std::string_view hint, std::string body) {
  std::string name(hint);
  for (int k = 2; defined_.count(name) || primitives().count(name) || name == "root"; ++k)
    name = fmt::format("{}-{}", hint, k);
  defined_.insert(name);
  order_.emplace_back(name, std::move(body));
  return name;
}

std::string SchemaGrammar::gbnf(std::string_view root_body) const {
  std::string out = fmt::format("root ::= {}\n", root_body);
  for (const auto& [name, body] : order_) out += name + " ::= " + body + "\n";
  return out;
}

Expected<std::string> json_schema_to_gbnf(const nlohmann::ordered_json& schema) {
  SchemaGrammar g;
  auto top = g.add_schema(schema, "root-value");
  if (!top) return top.status();
  std::string gbnf = g.gbnf(*top);
  // A $ref that reaches itself before any text ({"$ref": "#"} at the root, or a cycle through
  // $ref/anyOf only) becomes a left-recursive rule, which Grammar refuses. Compiling here names
  // the schema as the cause instead of handing the caller GBNF that does not compile (found by
  // fuzz_grammar).
  if (auto compiled = Grammar::parse(gbnf); !compiled)
    return Status::errorf("json_schema: the schema cannot be a grammar: {}", compiled.error());
  return gbnf;
}

std::string json_object_gbnf() {
  auto g = json_schema_to_gbnf(ojson{{"type", "object"}});
  KILN_CHECK(g.has_value(), "the any-object schema converts: {}", g.error());
  return *g;
}

}  // namespace kiln::grammar
