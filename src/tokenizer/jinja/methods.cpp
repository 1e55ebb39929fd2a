// tokenizer/jinja/methods.cpp: Python methods of str, list and dict as templates call them
// (`s.split(',')`, `d.get('k')`, `xs.append(x)`), plus str.format and %-formatting.
#include <fmt/format.h>
#include <utf8proc.h>

#include <algorithm>
#include <cmath>

#include "tokenizer/jinja/interp.h"

namespace kiln::jinja {
namespace {

Value arg_or(const CallArgs& a, size_t idx, std::string_view name, const Value& dflt) {
  if (idx < a.pos.size()) return a.pos[idx];
  for (const auto& [k, v] : a.kw)
    if (k == name) return v;
  return dflt;
}

bool py_space(char32_t c) {
  return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f) || c == 0x85 ||
         c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

std::string need_str(const Value& v, std::string_view what) {
  if (!v.is_string()) type_error(fmt::format("{} must be str, not {}", what, py_type_name(v)));
  return v.s;
}

// strip family: chars None = whitespace, else the set of code points given.
std::string strip_impl(const std::string& s, const Value& chars, bool left, bool right) {
  std::vector<char32_t> cps = utf8_decode(s);
  std::vector<char32_t> set;
  bool ws = chars.is_none() || chars.is_undefined();
  if (!ws) set = utf8_decode(need_str(chars, "strip arg"));
  auto strip_it = [&](char32_t c) {
    return ws ? py_space(c) : std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && strip_it(cps[b])) ++b;
  if (right)
    while (e > b && strip_it(cps[e - 1])) --e;
  return utf8_encode(std::vector<char32_t>(cps.begin() + static_cast<ptrdiff_t>(b),
                                           cps.begin() + static_cast<ptrdiff_t>(e)));
}

std::vector<std::string> split_impl(const std::string& s, const Value& sep_v, int64_t maxsplit,
                                    bool from_right) {
  std::vector<std::string> out;
  if (sep_v.is_none() || sep_v.is_undefined()) {
    std::vector<char32_t> cps = utf8_decode(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t k = 0;
    while (k < cps.size()) {
      while (k < cps.size() && py_space(cps[k])) ++k;
      if (k >= cps.size()) break;
      size_t b = k;
      while (k < cps.size() && !py_space(cps[k])) ++k;
      words.emplace_back(b, k);
    }
    auto piece = [&](size_t b, size_t e) {
      return utf8_encode(std::vector<char32_t>(cps.begin() + static_cast<ptrdiff_t>(b),
                                               cps.begin() + static_cast<ptrdiff_t>(e)));
    };
    if (maxsplit < 0 || static_cast<size_t>(maxsplit) + 1 >= words.size()) {
      for (auto [b, e] : words) out.push_back(piece(b, e));
      return out;
    }
    size_t m = static_cast<size_t>(maxsplit);
    if (!from_right) {
      for (size_t w = 0; w < m; ++w) out.push_back(piece(words[w].first, words[w].second));
      size_t e = cps.size();
      while (e > words[m].first && py_space(cps[e - 1])) --e;
      out.push_back(piece(words[m].first, e));
    } else {
      size_t n = words.size();
      size_t b = 0;
      while (b < words[n - m - 1].second && py_space(cps[b])) ++b;
      out.push_back(piece(b, words[n - m - 1].second));
      for (size_t w = n - m; w < n; ++w) out.push_back(piece(words[w].first, words[w].second));
    }
    return out;
  }
  std::string sep = need_str(sep_v, "separator");
  if (sep.empty()) fail("ValueError", "empty separator");
  if (!from_right) {
    size_t pos = 0;
    int64_t n = 0;
    for (;;) {
      size_t f = (maxsplit >= 0 && n >= maxsplit) ? std::string::npos : s.find(sep, pos);
      if (f == std::string::npos) {
        out.push_back(s.substr(pos));
        break;
      }
      out.push_back(s.substr(pos, f - pos));
      pos = f + sep.size();
      ++n;
    }
    return out;
  }
  size_t end = s.size();
  int64_t n = 0;
  for (;;) {
    size_t f = (maxsplit >= 0 && n >= maxsplit) || end < sep.size()
                   ? std::string::npos
                   : s.rfind(sep, end - sep.size());
    if (f == std::string::npos) {
      out.push_back(s.substr(0, end));
      break;
    }
    out.push_back(s.substr(f + sep.size(), end - f - sep.size()));
    end = f;
    ++n;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

Value str_list(std::vector<std::string> parts) {
  std::vector<Value> items;
  for (auto& p : parts) items.push_back(Value::string(std::move(p)));
  return Value::new_list(std::move(items));
}

std::string map_case(const std::string& s, int mode) {  // 0 lower, 1 upper
  if (is_ascii(s)) {
    std::string out = s;
    for (char& c : out)
      c = static_cast<char>(mode ? std::toupper(static_cast<unsigned char>(c))
                                 : std::tolower(static_cast<unsigned char>(c)));
    return out;
  }
  std::string out;
  for (char32_t cp : utf8_decode(s)) {
    if (mode && cp == 0xDF) {  // Python's full case mapping: 'ß'.upper() == 'SS'
      out += "SS";
      continue;
    }
    utf8_append(out,
                static_cast<char32_t>(mode ? utf8proc_toupper(static_cast<utf8proc_int32_t>(cp))
                                           : utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
  }
  return out;
}

bool is_alpha_cp(char32_t c) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
}
bool is_digit_cp(char32_t c) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_ND;
}

size_t cp_index(const std::string& s, size_t byte_pos) {
  return utf8_length(std::string_view(s).substr(0, byte_pos));
}

// A tuple of prefixes or one prefix.
bool starts_or_ends(const std::string& s, const Value& what, bool ends) {
  auto check = [&](const Value& p) {
    std::string x = need_str(p, ends ? "endswith arg" : "startswith arg");
    if (x.size() > s.size()) return false;
    return ends ? s.compare(s.size() - x.size(), x.size(), x) == 0 : s.compare(0, x.size(), x) == 0;
  };
  if (what.is_list()) {
    for (const auto& p : what.list->items)
      if (check(p)) return true;
    return false;
  }
  return check(what);
}

}  // namespace

std::string py_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (char32_t cp : utf8_decode(s)) {
    bool alpha = is_alpha_cp(cp);
    char32_t m =
        static_cast<char32_t>(prev_cased ? utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))
                                         : utf8proc_toupper(static_cast<utf8proc_int32_t>(cp)));
    utf8_append(out, m);
    prev_cased = alpha;
  }
  return out;
}

std::string py_capitalize(const std::string& s) {
  std::vector<char32_t> cps = utf8_decode(s);
  std::string out;
  for (size_t k = 0; k < cps.size(); ++k)
    utf8_append(out, static_cast<char32_t>(
                         k == 0 ? utf8proc_toupper(static_cast<utf8proc_int32_t>(cps[k]))
                                : utf8proc_tolower(static_cast<utf8proc_int32_t>(cps[k]))));
  return out;
}

std::string py_lower(const std::string& s) { return map_case(s, 0); }
std::string py_upper(const std::string& s) { return map_case(s, 1); }
std::string py_strip(const std::string& s, const Value& chars) {
  return strip_impl(s, chars, true, true);
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl,
                       int64_t count) {
  std::string out;
  if (old.empty()) {
    std::vector<char32_t> cps = utf8_decode(s);
    int64_t n = 0;
    for (size_t k = 0; k <= cps.size(); ++k) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      if (k < cps.size()) utf8_append(out, cps[k]);
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  for (;;) {
    size_t f = (count >= 0 && n >= count) ? std::string::npos : s.find(old, pos);
    if (f == std::string::npos) {
      out.append(s, pos, std::string::npos);
      break;
    }
    out.append(s, pos, f - pos);
    out += repl;
    pos = f + old.size();
    ++n;
  }
  return out;
}

// One replacement field's format spec ([[fill]align][sign][0][width][,][.precision][type]).
std::string format_spec(const Value& v, std::string_view spec) {
  char fill = ' ', align = 0, sign = '-', type = 0;
  size_t k = 0;
  auto is_align = [](char c) { return c == '<' || c == '>' || c == '^' || c == '='; };
  if (spec.size() >= 2 && is_align(spec[1])) {
    fill = spec[0];
    align = spec[1];
    k = 2;
  } else if (!spec.empty() && is_align(spec[0])) {
    align = spec[0];
    k = 1;
  }
  if (k < spec.size() && (spec[k] == '+' || spec[k] == '-' || spec[k] == ' ')) sign = spec[k++];
  if (k < spec.size() && spec[k] == '0') {
    if (!align) {
      fill = '0';
      align = '=';
    }
    ++k;
  }
  // Digits of a width or precision, refused past kMaxFormatWidth as they are read (so no
  // count of any length overflows).
  auto count = [&](std::string_view what) {
    int64_t c = 0;
    while (k < spec.size() && std::isdigit(static_cast<unsigned char>(spec[k]))) {
      c = c * 10 + (spec[k++] - '0');
      if (c > kMaxFormatWidth) format_width(c, what);
    }
    return c;
  };
  const size_t width = static_cast<size_t>(count("format width"));
  if (k < spec.size() && spec[k] == ',') ++k;
  int prec = -1;
  if (k < spec.size() && spec[k] == '.') {
    ++k;
    prec = static_cast<int>(count("format precision"));
  }
  if (k < spec.size()) type = spec[k];
  std::string body;
  if (type == 'd' || (type == 0 && v.is_int_like() && v.type != Value::Type::Bool && prec < 0)) {
    if (!v.is_number())
      fail("ValueError", "Unknown format code 'd' for object of type '" + py_type_name(v) + "'");
    body = std::to_string(v.is_int_like() ? v.as_int() : int_from_float(v.as_double()));
  } else if (type == 'f' || type == 'F' || type == 'e' || type == 'g' || type == '%' ||
             (type == 0 && v.is_number() && prec >= 0)) {
    if (!v.is_number())
      fail("ValueError", "Unknown format code for object of type '" + py_type_name(v) + "'");
    double d = v.as_double();
    int p = prec < 0 ? 6 : prec;
    if (type == 'e')
      body = fmt::format("{:.{}e}", d, p);
    else if (type == 'g' || type == 0)
      body = fmt::format("{:.{}g}", d, p == 0 ? 1 : p);
    else if (type == '%')
      body = fmt::format("{:.{}f}%", d * 100, p);
    else
      body = fmt::format("{:.{}f}", d, p);
  } else if (type == 'x' || type == 'X' || type == 'o' || type == 'b') {
    if (!v.is_int_like()) fail("ValueError", "Unknown format code for non-integer");
    int64_t n = v.as_int();
    body = type == 'x'   ? fmt::format("{:x}", n)
           : type == 'X' ? fmt::format("{:X}", n)
           : type == 'o' ? fmt::format("{:o}", n)
                         : fmt::format("{:b}", n);
  } else {
    body = py_str(v);
    if (prec >= 0) {
      std::vector<char32_t> cps = utf8_decode(body);
      if (cps.size() > static_cast<size_t>(prec)) {
        cps.resize(static_cast<size_t>(prec));
        body = utf8_encode(cps);
      }
    }
  }
  if (v.is_number() && sign != '-' && !body.empty() && body[0] != '-')
    body = std::string(1, sign == '+' ? '+' : ' ') + body;
  size_t len = utf8_length(body);
  if (width > len) {
    size_t pad = width - len;
    if (!align) align = (v.is_number() && v.type != Value::Type::Bool) ? '>' : '<';
    if (align == '<')
      body += std::string(pad, fill);
    else if (align == '>')
      body = std::string(pad, fill) + body;
    else if (align == '^')
      body = std::string(pad / 2, fill) + body + std::string(pad - pad / 2, fill);
    else {  // '=': pad after the sign
      size_t sp = (!body.empty() && (body[0] == '-' || body[0] == '+' || body[0] == ' ')) ? 1 : 0;
      body = body.substr(0, sp) + std::string(pad, fill) + body.substr(sp);
    }
  }
  return body;
}

std::string str_format(Interp& in, const std::string& f, const CallArgs& a) {
  std::string out;
  size_t auto_idx = 0;
  for (size_t k = 0; k < f.size(); ++k) {
    char c = f[k];
    if (c == '}') {
      if (k + 1 < f.size() && f[k + 1] == '}') {
        out += '}';
        ++k;
        continue;
      }
      fail("ValueError", "Single '}' encountered in format string");
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (k + 1 < f.size() && f[k + 1] == '{') {
      out += '{';
      ++k;
      continue;
    }
    size_t close = f.find('}', k);
    if (close == std::string::npos) fail("ValueError", "Single '{' encountered in format string");
    std::string field = f.substr(k + 1, close - k - 1);
    k = close;
    std::string spec, conv;
    if (size_t colon = field.find(':'); colon != std::string::npos) {
      spec = field.substr(colon + 1);
      field.resize(colon);
    }
    if (size_t bang = field.find('!'); bang != std::string::npos) {
      conv = field.substr(bang + 1);
      field.resize(bang);
    }
    size_t name_end = std::min(field.find('.'), field.find('['));
    std::string head = field.substr(0, name_end);
    Value v;
    if (head.empty()) {
      if (auto_idx >= a.pos.size())
        fail("IndexError", "Replacement index " + std::to_string(auto_idx) +
                               " out of range for positional args tuple");
      v = a.pos[auto_idx++];
    } else if (std::all_of(head.begin(), head.end(),
                           [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); })) {
      size_t idx = std::stoul(head);
      if (idx >= a.pos.size())
        fail("IndexError", "Replacement index " + head + " out of range for positional args tuple");
      v = a.pos[idx];
    } else {
      bool found = false;
      for (const auto& [kn, kv] : a.kw)
        if (kn == head) {
          v = kv;
          found = true;
        }
      if (!found) fail("KeyError", "'" + head + "'");
    }
    // .attr and [key] accessors
    size_t p = name_end;
    while (p != std::string::npos && p < field.size()) {
      if (field[p] == '.') {
        size_t e = std::min(field.find('.', p + 1), field.find('[', p + 1));
        v = in.getattr(v,
                       field.substr(p + 1, e == std::string::npos ? std::string::npos : e - p - 1));
        p = e;
      } else {
        size_t e = field.find(']', p);
        if (e == std::string::npos) fail("ValueError", "Missing ']' in format string");
        std::string key = field.substr(p + 1, e - p - 1);
        bool num = !key.empty() && std::all_of(key.begin(), key.end(), [](char ch) {
          return std::isdigit(static_cast<unsigned char>(ch));
        });
        v = in.getitem(v, num ? Value::integer(std::stoll(key)) : Value::string(key));
        p = e + 1;
      }
    }
    if (conv == "r")
      v = Value::string(py_repr(v));
    else if (conv == "s")
      v = Value::string(py_str(v));
    out += format_spec(v, spec);
  }
  return out;
}

std::string percent_format(const std::string& f, const Value& args) {
  std::vector<Value> pos;
  const Value* mapping = nullptr;
  if (args.is_list() && args.list->tuple)
    pos = args.list->items;
  else if (args.is_dict())
    mapping = &args;
  else
    pos.push_back(args);
  size_t next = 0;
  std::string out;
  for (size_t k = 0; k < f.size(); ++k) {
    if (f[k] != '%') {
      out += f[k];
      continue;
    }
    if (++k >= f.size()) fail("ValueError", "incomplete format");
    if (f[k] == '%') {
      out += '%';
      continue;
    }
    Value v;
    bool have = false;
    if (f[k] == '(') {
      size_t e = f.find(')', k);
      if (e == std::string::npos || !mapping) fail("ValueError", "incomplete format key");
      const Value* found = mapping->dict->find(std::string_view(f).substr(k + 1, e - k - 1));
      if (!found) fail("KeyError", "'" + f.substr(k + 1, e - k - 1) + "'");
      v = *found;
      have = true;
      k = e + 1;
    }
    std::string spec;
    while (k < f.size() &&
           std::string_view("-+ 0#.0123456789").find(f[k]) != std::string_view::npos)
      spec += f[k++];
    if (k >= f.size()) fail("ValueError", "incomplete format");
    char conv = f[k];
    if (!have) {
      if (next >= pos.size()) type_error("not enough arguments for format string");
      v = pos[next++];
    }
    std::string pyspec;
    if (!spec.empty() && spec[0] == '-')
      pyspec = "<" + spec.substr(1);
    else
      pyspec = spec;
    if (conv == 's')
      out += format_spec(Value::string(py_str(v)), pyspec);
    else if (conv == 'r' || conv == 'a')
      out += format_spec(Value::string(py_repr(v)), pyspec);
    else if (conv == 'd' || conv == 'i' || conv == 'u') {
      if (!v.is_number())
        type_error(
            fmt::format("%{} format: a real number is required, not {}", conv, py_type_name(v)));
      out +=
          format_spec(Value::integer(v.is_int_like() ? v.as_int() : int_from_float(v.as_double())),
                      pyspec + "d");
    } else if (std::string_view("fFeEgGxXo").find(conv) != std::string_view::npos) {
      out += format_spec(v, pyspec + conv);
    } else if (conv == 'c') {
      out += py_str(v);
    } else {
      fail("ValueError", fmt::format("unsupported format character '{}'", conv));
    }
  }
  if (next < pos.size() && !mapping)
    type_error("not all arguments converted during string formatting");
  return out;
}

bool py_contains(const Value& c, const Value& item) {
  switch (c.type) {
    case Value::Type::Undefined:
      return false;
    case Value::Type::String:
      if (item.is_undefined()) item.fail_undefined();
      if (!item.is_string())
        type_error(fmt::format("'in <string>' requires string as left operand, not {}",
                               py_type_name(item)));
      return c.s.find(item.s) != std::string::npos;
    case Value::Type::List:
      for (const auto& v : c.list->items)
        if (py_equal(v, item)) return true;
      return false;
    case Value::Type::Dict:
      return c.dict->find(item) != nullptr;
    default:
      type_error(fmt::format("argument of type '{}' is not iterable", py_type_name(c)));
  }
}

Value builtin_method(Interp& in, const Value& obj, std::string_view name) {
  using Fn = std::function<Value(Interp&, CallArgs&)>;
  auto bind = [&](Fn f) { return Value::function(std::string(name), std::move(f)); };
  static const Value kNone = Value::none();
  static const Value kUndef;
  if (obj.is_string()) {
    const std::string s = obj.s;
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      bool l = name != "rstrip", r = name != "lstrip";
      return bind([s, l, r](Interp&, CallArgs& a) {
        return Value::string(strip_impl(s, arg_or(a, 0, "chars", kNone), l, r));
      });
    }
    if (name == "split" || name == "rsplit") {
      bool right = name == "rsplit";
      return bind([s, right](Interp&, CallArgs& a) {
        Value mx = arg_or(a, 1, "maxsplit", Value::integer(-1));
        return str_list(split_impl(s, arg_or(a, 0, "sep", kNone), mx.as_int(), right));
      });
    }
    if (name == "splitlines")
      return bind([s](Interp&, CallArgs& a) {
        bool keep = arg_or(a, 0, "keepends", Value::boolean(false)).truthy();
        std::vector<std::string> out;
        size_t b = 0;
        for (size_t k = 0; k < s.size(); ++k) {
          if (s[k] == '\n' || s[k] == '\r') {
            size_t e = k;
            if (s[k] == '\r' && k + 1 < s.size() && s[k + 1] == '\n') ++k;
            out.push_back(s.substr(b, (keep ? k + 1 : e) - b));
            b = k + 1;
          }
        }
        if (b < s.size()) out.push_back(s.substr(b));
        return str_list(out);
      });
    if (name == "startswith" || name == "endswith") {
      bool ends = name == "endswith";
      return bind([s, ends](Interp&, CallArgs& a) {
        if (a.pos.empty()) type_error("startswith() takes at least 1 argument (0 given)");
        return Value::boolean(starts_or_ends(s, a.pos[0], ends));
      });
    }
    if (name == "replace")
      return bind([s](Interp&, CallArgs& a) {
        if (a.pos.size() < 2) type_error("replace() takes at least 2 arguments");
        return Value::string(py_replace(s, need_str(a.pos[0], "replace arg"),
                                        need_str(a.pos[1], "replace arg"),
                                        arg_or(a, 2, "count", Value::integer(-1)).as_int()));
      });
    if (name == "upper")
      return bind([s](Interp&, CallArgs&) { return Value::string(py_upper(s)); });
    if (name == "lower" || name == "casefold")
      return bind([s](Interp&, CallArgs&) { return Value::string(py_lower(s)); });
    if (name == "title")
      return bind([s](Interp&, CallArgs&) { return Value::string(py_title(s)); });
    if (name == "capitalize")
      return bind([s](Interp&, CallArgs&) { return Value::string(py_capitalize(s)); });
    if (name == "swapcase")
      return bind([s](Interp&, CallArgs&) {
        std::string out;
        for (char32_t cp : utf8_decode(s)) {
          auto c = static_cast<utf8proc_int32_t>(cp);
          utf8_append(out, static_cast<char32_t>(utf8proc_toupper(c) != c ? utf8proc_toupper(c)
                                                                          : utf8proc_tolower(c)));
        }
        return Value::string(out);
      });
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
      bool right = name[0] == 'r';
      bool raise = name.find("index") != std::string_view::npos;
      return bind([s, right, raise](Interp&, CallArgs& a) {
        if (a.pos.empty()) type_error("find() takes at least 1 argument (0 given)");
        std::string sub = need_str(a.pos[0], "find arg");
        size_t f = right ? s.rfind(sub) : s.find(sub);
        if (f == std::string::npos) {
          if (raise) fail("ValueError", "substring not found");
          return Value::integer(-1);
        }
        return Value::integer(static_cast<int64_t>(cp_index(s, f)));
      });
    }
    if (name == "count")
      return bind([s](Interp&, CallArgs& a) {
        if (a.pos.empty()) type_error("count() takes at least 1 argument (0 given)");
        std::string sub = need_str(a.pos[0], "count arg");
        if (sub.empty()) return Value::integer(static_cast<int64_t>(utf8_length(s) + 1));
        int64_t n = 0;
        for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
        return Value::integer(n);
      });
    if (name == "format")
      return bind([s](Interp& i, CallArgs& a) { return Value::string(str_format(i, s, a)); });
    if (name == "join")
      return bind([s](Interp& i, CallArgs& a) {
        if (a.pos.empty()) type_error("join() takes exactly one argument (0 given)");
        std::string out;
        bool first = true;
        for (const auto& v : i.iterate(a.pos[0])) {
          if (!v.is_string())
            type_error(
                fmt::format("sequence item: expected str instance, {} found", py_type_name(v)));
          if (!first) out += s;
          first = false;
          out += v.s;
        }
        return Value::string(out);
      });
    if (name == "isdigit" || name == "isnumeric" || name == "isdecimal")
      return bind([s](Interp&, CallArgs&) {
        auto cps = utf8_decode(s);
        return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), is_digit_cp));
      });
    if (name == "isalpha")
      return bind([s](Interp&, CallArgs&) {
        auto cps = utf8_decode(s);
        return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), is_alpha_cp));
      });
    if (name == "isalnum")
      return bind([s](Interp&, CallArgs&) {
        auto cps = utf8_decode(s);
        return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), [](char32_t c) {
          return is_alpha_cp(c) || is_digit_cp(c);
        }));
      });
    if (name == "isspace")
      return bind([s](Interp&, CallArgs&) {
        auto cps = utf8_decode(s);
        return Value::boolean(!cps.empty() && std::all_of(cps.begin(), cps.end(), py_space));
      });
    if (name == "isupper" || name == "islower") {
      bool up = name == "isupper";
      return bind([s, up](Interp&, CallArgs&) {
        bool cased = false;
        for (char32_t cp : utf8_decode(s)) {
          auto c = static_cast<utf8proc_int32_t>(cp);
          bool is_up = utf8proc_tolower(c) != c, is_lo = utf8proc_toupper(c) != c;
          if ((up && is_lo) || (!up && is_up)) return Value::boolean(false);
          cased |= is_up || is_lo;
        }
        return Value::boolean(cased);
      });
    }
    if (name == "istitle")
      return bind(
          [s](Interp&, CallArgs&) { return Value::boolean(!s.empty() && py_title(s) == s); });
    if (name == "removeprefix" || name == "removesuffix") {
      bool suffix = name == "removesuffix";
      return bind([s, suffix](Interp&, CallArgs& a) {
        if (a.pos.empty()) type_error("missing argument");
        std::string x = need_str(a.pos[0], "arg");
        if (!suffix && s.compare(0, x.size(), x) == 0) return Value::string(s.substr(x.size()));
        if (suffix && x.size() <= s.size() && s.compare(s.size() - x.size(), x.size(), x) == 0 &&
            !x.empty())
          return Value::string(s.substr(0, s.size() - x.size()));
        return Value::string(s);
      });
    }
    if (name == "partition" || name == "rpartition") {
      bool right = name[0] == 'r';
      return bind([s, right](Interp&, CallArgs& a) {
        if (a.pos.empty()) type_error("missing argument");
        std::string sep = need_str(a.pos[0], "sep");
        size_t f = right ? s.rfind(sep) : s.find(sep);
        std::vector<Value> parts;
        if (f == std::string::npos) {
          if (right)
            parts = {Value::string(""), Value::string(""), Value::string(s)};
          else
            parts = {Value::string(s), Value::string(""), Value::string("")};
        } else {
          parts = {Value::string(s.substr(0, f)), Value::string(sep),
                   Value::string(s.substr(f + sep.size()))};
        }
        return Value::new_list(std::move(parts), true);
      });
    }
    if (name == "center" || name == "ljust" || name == "rjust" || name == "zfill") {
      std::string n(name);
      return bind([s, n](Interp&, CallArgs& a) {
        if (a.pos.empty() || !a.pos[0].is_int_like()) type_error(n + "() needs an integer width");
        std::string spec =
            n == "zfill"
                ? "0>"
                : std::string(arg_or(a, 1, "fillchar", Value::string(" ")).s.substr(0, 1)) +
                      (n == "center"  ? "^"
                       : n == "ljust" ? "<"
                                      : ">");
        if (n == "zfill") {
          std::string body = s;
          size_t w = format_width(a.pos[0].as_int(), "zfill width");
          size_t len = utf8_length(body);
          if (w <= len) return Value::string(body);
          size_t sp = (!body.empty() && (body[0] == '-' || body[0] == '+')) ? 1 : 0;
          return Value::string(body.substr(0, sp) + std::string(w - len, '0') + body.substr(sp));
        }
        return Value::string(
            format_spec(Value::string(s), spec + std::to_string(a.pos[0].as_int())));
      });
    }
    return kUndef;
  }
  if (obj.is_list()) {
    auto L = obj.list;
    const bool tuple = L->tuple;
    if (name == "index")
      return bind([L](Interp&, CallArgs& a) {
        if (a.pos.empty()) type_error("index() takes at least 1 argument");
        for (size_t k = 0; k < L->items.size(); ++k)
          if (py_equal(L->items[k], a.pos[0])) return Value::integer(static_cast<int64_t>(k));
        fail("ValueError", py_repr(a.pos[0]) + " is not in list");
      });
    if (name == "count")
      return bind([L](Interp&, CallArgs& a) {
        if (a.pos.empty()) type_error("count() takes exactly one argument");
        int64_t n = 0;
        for (const auto& v : L->items) n += py_equal(v, a.pos[0]);
        return Value::integer(n);
      });
    if (tuple) return kUndef;
    // Hugging Face renders in jinja2's ImmutableSandboxedEnvironment: mutating a list or
    // dict is refused when the method is looked up.
    if (name == "append" || name == "extend" || name == "insert" || name == "pop" ||
        name == "remove" || name == "reverse" || name == "sort" || name == "clear")
      return Value::unsafe(
          fmt::format("access to attribute '{}' of 'list' object is unsafe.", name));
    if (name == "copy") return bind([L](Interp&, CallArgs&) { return Value::new_list(L->items); });
    return kUndef;
  }
  if (obj.is_dict() && obj.dict->kind == Dict::Kind::Plain) {
    auto D = obj.dict;
    if (name == "items")
      return bind([D](Interp&, CallArgs&) {
        std::vector<Value> out;
        for (const auto& kv : D->items) out.push_back(Value::new_list({kv.first, kv.second}, true));
        return Value::new_list(std::move(out));
      });
    if (name == "keys" || name == "values") {
      bool keys = name == "keys";
      return bind([D, keys](Interp&, CallArgs&) {
        std::vector<Value> out;
        for (const auto& kv : D->items) out.push_back(keys ? kv.first : kv.second);
        return Value::new_list(std::move(out));
      });
    }
    if (name == "get")
      return bind([D](Interp&, CallArgs& a) {
        if (a.pos.empty()) type_error("get expected at least 1 argument, got 0");
        if (const Value* v = D->find(a.pos[0])) return *v;
        return a.pos.size() > 1 ? a.pos[1] : Value::none();
      });
    if (name == "pop" || name == "popitem" || name == "setdefault" || name == "update" ||
        name == "clear")
      return Value::unsafe(
          fmt::format("access to attribute '{}' of 'dict' object is unsafe.", name));
    if (name == "copy")
      return bind([D](Interp&, CallArgs&) {
        Value v = Value::new_dict();
        v.dict->items = D->items;
        return v;
      });
    return kUndef;
  }
  return kUndef;
}

}  // namespace kiln::jinja
