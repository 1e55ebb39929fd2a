// tokenizer/jinja/value.cpp: Python-compatible behaviour of interpreter values: truthiness,
// equality, ordering, str()/repr() (floats printed like Python's shortest repr), json.dumps.
#include "tokenizer/jinja/value.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

namespace kiln::jinja {

namespace {
thread_local MemoryBudget* t_budget = nullptr;
}  // namespace

MemoryBudgetScope::MemoryBudgetScope(MemoryBudget* b) : prev_(t_budget) { t_budget = b; }
MemoryBudgetScope::~MemoryBudgetScope() { t_budget = prev_; }

int64_t Value::footprint() const {
  // A short string lives inside the object (the small-string buffer).
  const size_t heap = s.capacity() > std::string().capacity() ? s.capacity() : 0;
  return int64_t(sizeof(Value) + heap);
}

void Value::charge() {
  charged_ = 0;
  if (!t_budget) return;
  charged_ = footprint();
  t_budget->live += charged_;
  if (t_budget->live > t_budget->cap) {
    const int64_t cap = t_budget->cap;
    release();
    fail("MemoryError",
         fmt::format("template used more than {} MiB of memory (the render's cap)", cap >> 20));
  }
}

void Value::recharge() {
  if (!t_budget) return;
  const int64_t was = charged_;
  t_budget->live -= was;
  charge();
}

void Value::release() noexcept {
  if (t_budget) t_budget->live -= charged_;
  charged_ = 0;
}

Value::Value(const Value& o)
    : type(o.type), b(o.b), i(o.i), f(o.f), s(o.s), list(o.list), dict(o.dict), fn(o.fn) {
  charge();
}

// A move hands the whole charge over with the string (the moved-from object, about to be
// destroyed, goes uncounted meanwhile).
Value::Value(Value&& o) noexcept
    : type(o.type),
      b(o.b),
      i(o.i),
      f(o.f),
      s(std::move(o.s)),
      list(std::move(o.list)),
      dict(std::move(o.dict)),
      fn(std::move(o.fn)),
      charged_(o.charged_) {
  o.charged_ = 0;
}

Value& Value::operator=(const Value& o) {
  if (this == &o) return *this;
  type = o.type, b = o.b, i = o.i, f = o.f;
  s = o.s;
  list = o.list, dict = o.dict, fn = o.fn;
  recharge();
  return *this;
}

Value& Value::operator=(Value&& o) noexcept {
  if (this == &o) return *this;
  type = o.type, b = o.b, i = o.i, f = o.f;
  s = std::move(o.s);
  list = std::move(o.list), dict = std::move(o.dict), fn = std::move(o.fn);
  // The string's charge leaves `o` with it (o keeps its object's); this value is charged
  // afresh for what it holds now.
  const int64_t moved = std::max<int64_t>(0, o.charged_ - int64_t(sizeof(Value)));
  if (t_budget) t_budget->live -= moved;
  o.charged_ -= moved;
  if (t_budget) {
    t_budget->live -= charged_;
    charged_ = footprint();
    t_budget->live += charged_;  // never raises: a move assignment must not throw
  } else {
    charged_ = 0;
  }
  return *this;
}

void fail(std::string_view kind, std::string_view msg) { throw Error(kind, msg); }
void type_error(std::string_view msg) { throw Error("TypeError", msg); }

namespace {
[[noreturn]] void int_overflow() { fail("OverflowError", "integer result too large"); }
}  // namespace
int64_t int_add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) int_overflow();
  return r;
}
int64_t int_sub(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) int_overflow();
  return r;
}
int64_t int_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) int_overflow();
  return r;
}
int64_t int_neg(int64_t a) { return int_sub(0, a); }
size_t format_width(int64_t width, std::string_view what) {
  if (width > kMaxFormatWidth)
    fail("ValueError", fmt::format("{} {} is more than {}", what, width, kMaxFormatWidth));
  return width < 0 ? 0 : static_cast<size_t>(width);
}
int64_t int_from_float(double d) {
  if (std::isnan(d)) fail("ValueError", "cannot convert float NaN to integer");
  if (std::isinf(d)) fail("OverflowError", "cannot convert float infinity to integer");
  const double t = std::trunc(d);
  // [-2^63, 2^63): both bounds exact in a double.
  if (!(t >= -9223372036854775808.0 && t < 9223372036854775808.0)) int_overflow();
  return static_cast<int64_t>(t);
}
int64_t int_floordiv(int64_t a, int64_t b) {
  if (b == -1) return int_neg(a);  // INT64_MIN / -1 is the one quotient past int64
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
int64_t int_mod(int64_t a, int64_t b) {
  if (b == -1) return 0;  // and INT64_MIN % -1 is undefined in C++
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;  // |r| < |b|: no overflow
  return r;
}

Value Value::new_list(std::vector<Value> items, bool tuple) {
  Value v;
  v.type = Type::List;
  v.list = std::make_shared<List>();
  v.list->items = std::move(items);
  v.list->tuple = tuple;
  return v;
}

Value Value::new_dict() {
  Value v;
  v.type = Type::Dict;
  v.dict = std::make_shared<Dict>();
  return v;
}

Value Value::function(std::string name, std::function<Value(Interp&, CallArgs&)> call) {
  Value v;
  v.type = Type::Func;
  v.fn = std::make_shared<Func>(Func{std::move(name), std::move(call)});
  return v;
}

bool Value::truthy() const {
  switch (type) {
    case Type::Undefined:
    case Type::None:
      return false;
    case Type::Bool:
      return b;
    case Type::Int:
      return i != 0;
    case Type::Float:
      return f != 0.0;
    case Type::String:
      return !s.empty();
    case Type::List:
      return !list->items.empty();
    case Type::Dict:
      return !dict->items.empty();
    case Type::Func:
      return true;
  }
  return false;
}

void Value::fail_undefined() const {
  fail(b ? "SecurityError" : "UndefinedError", s.empty() ? std::string("value is undefined") : s);
}

const Value* Dict::find(const Value& key) const {
  for (const auto& kv : items)
    if (py_equal(kv.first, key)) return &kv.second;
  return nullptr;
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& kv : items)
    if (kv.first.type == Value::Type::String && kv.first.s == key) return &kv.second;
  return nullptr;
}

void Dict::set(Value key, Value v) {
  for (auto& kv : items)
    if (py_equal(kv.first, key)) {
      kv.second = std::move(v);
      return;
    }
  items.emplace_back(std::move(key), std::move(v));
}

bool Dict::erase(const Value& key, Value* out) {
  for (auto it = items.begin(); it != items.end(); ++it)
    if (py_equal(it->first, key)) {
      if (out) *out = std::move(it->second);
      items.erase(it);
      return true;
    }
  return false;
}

// Values a template builds may nest as deep as its memory cap lets it (a list wrapped in a list
// in a loop: tens of thousands of levels), so the recursive walks below stop at
// kMaxValueDepth with one line, as Python's recursion limit does, instead of running out of
// stack (printing a 30,000-deep list crashed the renderer before this bound). json_dump_impl
// has its own (512).
constexpr int kMaxValueDepth = 512;

static bool equal_impl(const Value& a, const Value& b, int depth);
bool py_equal(const Value& a, const Value& b) { return equal_impl(a, b, 0); }

static bool equal_impl(const Value& a, const Value& b, int depth) {
  using T = Value::Type;
  if (depth > kMaxValueDepth)
    fail("RecursionError", "maximum recursion depth exceeded in comparison");
  if (a.is_number() && b.is_number()) {
    if (a.type == T::Float || b.type == T::Float) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.type != b.type) return false;
  switch (a.type) {
    case T::Undefined:
    case T::None:
      return true;
    case T::String:
      return a.s == b.s;
    case T::List: {
      if (a.list == b.list) return true;
      const auto& x = a.list->items;
      const auto& y = b.list->items;
      if (x.size() != y.size() || a.list->tuple != b.list->tuple) return false;
      for (size_t k = 0; k < x.size(); ++k)
        if (!equal_impl(x[k], y[k], depth + 1)) return false;
      return true;
    }
    case T::Dict: {
      if (a.dict == b.dict) return true;
      if (a.dict->kind != Dict::Kind::Plain || b.dict->kind != Dict::Kind::Plain) return false;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& kv : a.dict->items) {
        const Value* o = b.dict->find(kv.first);
        if (!o || !equal_impl(kv.second, *o, depth + 1)) return false;
      }
      return true;
    }
    case T::Func:
      return a.fn == b.fn;
    default:
      return false;
  }
}

static int compare_impl(const Value& a, const Value& b, int depth);
int py_compare(const Value& a, const Value& b) { return compare_impl(a, b, 0); }

static int compare_impl(const Value& a, const Value& b, int depth) {
  using T = Value::Type;
  if (depth > kMaxValueDepth)
    fail("RecursionError", "maximum recursion depth exceeded in comparison");
  if (a.is_undefined()) a.fail_undefined();
  if (b.is_undefined()) b.fail_undefined();
  if (a.is_number() && b.is_number()) {
    if (a.type == T::Float || b.type == T::Float) {
      double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : (x > y ? 1 : 0);
    }
    int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.type == T::String && b.type == T::String) {
    int c = a.s.compare(b.s);  // UTF-8 byte order equals code point order
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.type == T::List && b.type == T::List) {
    const auto& x = a.list->items;
    const auto& y = b.list->items;
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      if (equal_impl(x[k], y[k], depth + 1)) continue;
      return compare_impl(x[k], y[k], depth + 1);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  type_error(fmt::format("'<' not supported between instances of '{}' and '{}'", py_type_name(a),
                         py_type_name(b)));
}

std::string py_type_name(const Value& v) {
  switch (v.type) {
    case Value::Type::Undefined:
      return "Undefined";
    case Value::Type::None:
      return "NoneType";
    case Value::Type::Bool:
      return "bool";
    case Value::Type::Int:
      return "int";
    case Value::Type::Float:
      return "float";
    case Value::Type::String:
      return "str";
    case Value::Type::List:
      return v.list->tuple ? "tuple" : "list";
    case Value::Type::Dict:
      return v.dict->kind == Dict::Kind::Namespace ? "Namespace"
             : v.dict->kind == Dict::Kind::Loop    ? "LoopContext"
                                                   : "dict";
    case Value::Type::Func:
      return "function";
  }
  return "object";
}

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's layout: exponent form when exp < -4 or >= 16.
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t epos = sci.find('e');
  std::string mant = sci.substr(0, epos);
  int exp = std::stoi(sci.substr(epos + 1));
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out = neg ? "-" : "";
  if (exp < -4 || exp >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
    return out;
  }
  if (exp < 0) {
    out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  } else if (static_cast<size_t>(exp) + 1 >= digits.size()) {
    out += digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, static_cast<size_t>(exp) + 1) + "." +
           digits.substr(static_cast<size_t>(exp) + 1);
  }
  return out;
}

std::string py_string_repr(std::string_view s) {
  bool has_single = s.find('\'') != std::string_view::npos;
  bool has_double = s.find('"') != std::string_view::npos;
  char q = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == q || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\t')
      out += "\\t";
    else if (c < 0x20 || c == 0x7f)
      out += fmt::format("\\x{:02x}", c);
    else
      out += static_cast<char>(c);
  }
  out += q;
  return out;
}

static std::string repr_impl(const Value& v, bool top, int depth = 0);

std::string py_str(const Value& v) {
  switch (v.type) {
    case Value::Type::Undefined:
      return "";
    case Value::Type::String:
      return v.s;
    default:
      return repr_impl(v, true);
  }
}

std::string py_repr(const Value& v) { return repr_impl(v, false); }

static std::string repr_impl(const Value& v, bool top, int depth) {
  if (depth > kMaxValueDepth)
    fail("RecursionError", "maximum recursion depth exceeded while getting the repr of an object");
  switch (v.type) {
    case Value::Type::Undefined:
      return top ? "" : "Undefined";
    case Value::Type::None:
      return "None";
    case Value::Type::Bool:
      return v.b ? "True" : "False";
    case Value::Type::Int:
      return std::to_string(v.i);
    case Value::Type::Float:
      return py_float_repr(v.f);
    case Value::Type::String:
      return py_string_repr(v.s);
    case Value::Type::List: {
      const auto& items = v.list->items;
      std::string out = v.list->tuple ? "(" : "[";
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += ", ";
        out += repr_impl(items[k], false, depth + 1);
      }
      if (v.list->tuple && items.size() == 1) out += ",";
      out += v.list->tuple ? ")" : "]";
      return out;
    }
    case Value::Type::Dict: {
      std::string out;
      if (v.dict->kind == Dict::Kind::Namespace)
        out = "<Namespace {";
      else if (v.dict->kind == Dict::Kind::Loop)
        return "<LoopContext>";
      else
        out = "{";
      bool first = true;
      for (const auto& kv : v.dict->items) {
        if (!first) out += ", ";
        first = false;
        out +=
            repr_impl(kv.first, false, depth + 1) + ": " + repr_impl(kv.second, false, depth + 1);
      }
      out += v.dict->kind == Dict::Kind::Namespace ? "}>" : "}";
      return out;
    }
    case Value::Type::Func:
      return "<function " + v.fn->name + ">";
  }
  return "";
}

Value from_json(const nlohmann::ordered_json& j) {
  using J = nlohmann::ordered_json::value_t;
  switch (j.type()) {
    case J::null:
      return Value::none();
    case J::boolean:
      return Value::boolean(j.get<bool>());
    case J::number_integer:
      return Value::integer(j.get<int64_t>());
    case J::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value::number(static_cast<double>(u));
      return Value::integer(static_cast<int64_t>(u));
    }
    case J::number_float:
      return Value::number(j.get<double>());
    case J::string:
      return Value::string(j.get<std::string>());
    case J::array: {
      Value v = Value::new_list();
      for (const auto& e : j) v.list->items.push_back(from_json(e));
      return v;
    }
    case J::object: {
      Value v = Value::new_dict();
      for (auto it = j.begin(); it != j.end(); ++it)
        v.dict->items.emplace_back(Value::string(it.key()), from_json(it.value()));
      return v;
    }
    default:
      return Value::none();
  }
}

static void json_string_ascii_body(std::string& out, std::string_view s);

static void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  if (ensure_ascii && !is_ascii(s)) {
    for (char32_t cp : utf8_decode(s)) {
      if (cp < 0x80) {
        std::string one(1, static_cast<char>(cp));
        json_string_ascii_body(out, one);
      } else if (cp < 0x10000) {
        out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
      } else {
        uint32_t v = static_cast<uint32_t>(cp) - 0x10000;
        out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      }
    }
    out += '"';
    return;
  }
  json_string_ascii_body(out, s);
  out += '"';
}

static void json_string_ascii_body(std::string& out, std::string_view s) {
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20)
          out += fmt::format("\\u{:04x}", c);
        else
          out += static_cast<char>(c);
    }
  }
}

static std::string json_key(const Value& k) {
  switch (k.type) {
    case Value::Type::String:
      return k.s;
    case Value::Type::None:
      return "null";
    case Value::Type::Bool:
      return k.b ? "true" : "false";
    case Value::Type::Int:
      return std::to_string(k.i);
    case Value::Type::Float:
      return py_float_repr(k.f);
    default:
      type_error(
          fmt::format("keys must be str, int, float, bool or None, not {}", py_type_name(k)));
  }
}

static void json_dump_impl(std::string& out, const Value& v, const JsonDumpOptions& opt,
                           int depth) {
  if (depth > 512) fail("ValueError", "Circular reference detected");
  auto newline = [&](int d) {
    if (opt.indent < 0 && opt.indent_str.empty()) return;
    out += '\n';
    for (int k = 0; k < d; ++k) out += opt.indent_str;
  };
  switch (v.type) {
    case Value::Type::None:
      out += "null";
      return;
    case Value::Type::Bool:
      out += v.b ? "true" : "false";
      return;
    case Value::Type::Int:
      out += std::to_string(v.i);
      return;
    case Value::Type::Float:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f > 0 ? "Infinity" : "-Infinity";
      else
        out += py_float_repr(v.f);
      return;
    case Value::Type::String:
      json_string(out, v.s, opt.ensure_ascii);
      return;
    case Value::Type::List: {
      const auto& items = v.list->items;
      if (items.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += opt.item_sep;
        newline(depth + 1);
        json_dump_impl(out, items[k], opt, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    }
    case Value::Type::Dict: {
      if (v.dict->kind != Dict::Kind::Plain)
        type_error(fmt::format("Object of type {} is not JSON serializable", py_type_name(v)));
      std::vector<const std::pair<Value, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      if (items.empty()) {
        out += "{}";
        return;
      }
      if (opt.sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return py_compare(a->first, b->first) < 0; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += opt.item_sep;
        newline(depth + 1);
        json_string(out, json_key(items[k]->first), opt.ensure_ascii);
        out += opt.key_sep;
        json_dump_impl(out, items[k]->second, opt, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    }
    default:
      type_error(fmt::format("Object of type {} is not JSON serializable", py_type_name(v)));
  }
}

std::string json_dumps(const Value& v, const JsonDumpOptions& opt) {
  std::string out;
  json_dump_impl(out, v, opt, 0);
  return out;
}

std::vector<char32_t> utf8_decode(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  for (size_t k = 0; k < s.size();) {
    unsigned char c = static_cast<unsigned char>(s[k]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || k + static_cast<size_t>(n) > s.size()) {  // invalid byte: keep it as U+FFFD
      out.push_back(0xFFFD);
      ++k;
      continue;
    }
    char32_t cp = n == 1 ? c : (c & (0x7F >> n));
    bool ok = true;
    for (int m = 1; m < n; ++m) {
      unsigned char cc = static_cast<unsigned char>(s[k + static_cast<size_t>(m)]);
      if ((cc & 0xC0) != 0x80) {
        ok = false;
        break;
      }
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++k;
      continue;
    }
    out.push_back(cp);
    k += static_cast<size_t>(n);
  }
  return out;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80)
    out += static_cast<char>(cp);
  else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string utf8_encode(const std::vector<char32_t>& cps) {
  std::string out;
  out.reserve(cps.size());
  for (char32_t cp : cps) utf8_append(out, cp);
  return out;
}

bool is_ascii(std::string_view s) {
  for (unsigned char c : s)
    if (c >= 0x80) return false;
  return true;
}

size_t utf8_length(std::string_view s) {
  if (is_ascii(s)) return s.size();
  return utf8_decode(s).size();
}

}  // namespace kiln::jinja
