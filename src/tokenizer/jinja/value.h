// tokenizer/jinja/value.h: the interpreter's values, modelled on the Python objects Jinja2
// templates see (None, bool, int, float, str, list/tuple, dict, callables, Undefined), with
// Python's str()/repr(), truthiness, equality and ordering so printed output matches.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::jinja {

// Raised inside the interpreter and turned into a Status at the public boundary
// (chat_template.cpp); never escapes the library. `what()` is "Kind: message", the form
// Python prints for the exception Jinja2 raises (e.g. "UndefinedError: 'x' is undefined").
class Error : public std::runtime_error {
 public:
  Error(std::string_view kind, std::string_view msg)
      : std::runtime_error(std::string(kind) + ": " + std::string(msg)) {}
};
[[noreturn]] void fail(std::string_view kind, std::string_view msg);
[[noreturn]] void type_error(std::string_view msg);
// Integer arithmetic as Python's, within int64: Python's ints are unbounded, kiln's are not, so
// a result past int64 fails with OverflowError instead of wrapping (signed overflow is
// undefined behaviour; fuzz_template found `*` and `**` doing it).
int64_t int_add(int64_t a, int64_t b);
int64_t int_sub(int64_t a, int64_t b);
int64_t int_mul(int64_t a, int64_t b);
int64_t int_neg(int64_t a);
int64_t int_floordiv(int64_t a, int64_t b);  // b != 0; rounds toward negative infinity
int64_t int_mod(int64_t a, int64_t b);       // b != 0; the sign of b, as Python's %
// The widest padding, field width or precision a template may ask for (format specs, %
// formatting, center/ljust/rjust/zfill, indent): a wider one is refused with a ValueError
// before anything is allocated (fuzz_template found '{:0000...9#}'.format() asking for 2^49
// bytes; the render's memory cap only sees what was allocated).
constexpr int64_t kMaxFormatWidth = int64_t{1} << 20;
// width clamped below at 0, refused above kMaxFormatWidth; `what` names it in the error.
size_t format_width(int64_t width, std::string_view what);
// int(d): truncated toward zero; NaN is a ValueError, infinities and values past int64 an
// OverflowError (a cast of those is undefined behaviour).
int64_t int_from_float(double d);

struct Value;
struct List;
struct Dict;
struct Func;
class Interp;

// The memory a render may hold: every live Value charges its own size and its string's heap
// bytes to the budget of the render running on its thread (Interp sets one for its life), and
// a charge past the cap raises "MemoryError". Values made outside a render charge nothing; a
// Value is charged when it is made or copied and given back when destroyed (a string grown in
// place is charged at its size when it became a Value: the builders make strings first and
// wrap them). Lists and dicts are charged through their elements.
struct MemoryBudget {
  int64_t live = 0;  // may go below 0 when a render frees what was made before it
  int64_t cap = 0;
};
class MemoryBudgetScope {
 public:
  explicit MemoryBudgetScope(MemoryBudget* b);
  ~MemoryBudgetScope();
  MemoryBudgetScope(const MemoryBudgetScope&) = delete;
  MemoryBudgetScope& operator=(const MemoryBudgetScope&) = delete;

 private:
  MemoryBudget* prev_;
};

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

struct Value {
  enum class Type : uint8_t { Undefined, None, Bool, Int, Float, String, List, Dict, Func };
  Type type = Type::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0.0;
  std::string s;  // String payload; for Undefined, the hint raised when it is misused
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Func> fn;

  Value() { charge(); }
  Value(const Value& o);
  Value(Value&& o) noexcept;
  Value& operator=(const Value& o);
  Value& operator=(Value&& o) noexcept;
  ~Value() { release(); }

  static Value undefined(std::string hint = {}) {
    Value v;
    v.s = std::move(hint);
    v.recharge();
    return v;
  }
  // What the sandbox returns for a blocked attribute: an Undefined that raises SecurityError
  // when used (`b` marks the kind; Undefined has no other use for it).
  static Value unsafe(std::string hint) {
    Value v = undefined(std::move(hint));
    v.b = true;
    return v;
  }
  static Value none() {
    Value v;
    v.type = Type::None;
    return v;
  }
  static Value boolean(bool x) {
    Value v;
    v.type = Type::Bool;
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v;
    v.type = Type::Int;
    v.i = x;
    return v;
  }
  static Value number(double x) {
    Value v;
    v.type = Type::Float;
    v.f = x;
    return v;
  }
  static Value string(std::string x) {
    Value v;
    v.type = Type::String;
    v.s = std::move(x);
    v.recharge();
    return v;
  }
  static Value new_list(std::vector<Value> items = {}, bool tuple = false);
  static Value new_dict();
  static Value function(std::string name, std::function<Value(Interp&, CallArgs&)> call);

  bool is_undefined() const { return type == Type::Undefined; }
  bool is_none() const { return type == Type::None; }
  bool is_string() const { return type == Type::String; }
  bool is_list() const { return type == Type::List; }
  bool is_dict() const { return type == Type::Dict; }
  bool is_func() const { return type == Type::Func; }
  bool is_int_like() const {
    return type == Type::Int || type == Type::Bool;
  }  // bool is an int in Python
  bool is_number() const { return is_int_like() || type == Type::Float; }
  int64_t as_int() const { return type == Type::Bool ? (b ? 1 : 0) : i; }
  double as_double() const { return type == Type::Float ? f : static_cast<double>(as_int()); }

  bool truthy() const;
  // Raises the UndefinedError this Undefined stands for (its hint, or a generic one).
  [[noreturn]] void fail_undefined() const;

 private:
  // What this value holds: its own bytes and its string's heap bytes.
  int64_t footprint() const;
  void charge();    // charges footprint() (raises MemoryError past the cap)
  void recharge();  // charges the change since the last charge
  void release() noexcept;
  int64_t charged_ = 0;  // what this value has charged to the current budget
};

struct List {
  std::vector<Value> items;
  bool tuple = false;  // prints with parentheses
};

// Insertion-ordered like a Python dict. Lookups are linear: template dicts are small.
struct Dict {
  enum class Kind : uint8_t { Plain, Namespace, Loop };
  Kind kind = Kind::Plain;
  std::vector<std::pair<Value, Value>> items;

  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  void set(Value key, Value v);
  void set(std::string_view key, Value v) { set(Value::string(std::string(key)), std::move(v)); }
  bool erase(const Value& key, Value* out);
};

struct Func {
  std::string name;
  std::function<Value(Interp&, CallArgs&)> call;
};

// Python semantics.
bool py_equal(const Value& a, const Value& b);
int py_compare(const Value& a, const Value& b);  // <0, 0, >0; TypeError for unorderable
std::string py_str(const Value& v);
std::string py_repr(const Value& v);
std::string py_float_repr(double d);
std::string py_type_name(const Value& v);  // "str", "dict", "NoneType", ...
std::string py_string_repr(std::string_view s);

// JSON in and out: from the caller's context, and json.dumps for the tojson filter.
Value from_json(const nlohmann::ordered_json& j);
struct JsonDumpOptions {
  int indent = -1;         // -1: None (single line)
  std::string indent_str;  // used when indent is given as a string
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;  // non-ASCII as \uXXXX (surrogate pairs above U+FFFF)
};
std::string json_dumps(const Value& v, const JsonDumpOptions& opt);

// UTF-8 helpers: Python indexes strings by code point.
std::vector<char32_t> utf8_decode(std::string_view s);
std::string utf8_encode(const std::vector<char32_t>& cps);
void utf8_append(std::string& out, char32_t cp);
bool is_ascii(std::string_view s);
size_t utf8_length(std::string_view s);

}  // namespace kiln::jinja
