// tokenizer/jinja/interp.h: the tree-walking evaluator. Holds the scopes, enforces the
// resource limits (output size, steps, call depth) so a hostile template cannot hang or
// exhaust the server, and exposes the lookups builtins need (attributes, calls, filters).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "tokenizer/jinja/ast.h"
#include "tokenizer/jinja/value.h"

namespace kiln::jinja {

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;
};
using ScopePtr = std::shared_ptr<Scope>;

struct RenderLimits {
  size_t max_output_bytes = size_t{64} << 20;
  uint64_t max_steps = 20'000'000;  // statements + loop iterations + calls
  int max_call_depth = 200;         // macro / filter recursion
  // Wall time of one render, checked every few steps (a step is well under a microsecond);
  // 0: no limit.
  std::chrono::milliseconds max_time{500};
  // Stack one render may take below render()'s frame. Recursion is bounded by the parser's
  // nesting caps and max_call_depth, but their product is not: each macro level can hold an
  // expression nested hundreds deep (fuzz_template found 200 levels of a macro applying 29
  // unary minus signs to a call: a stack overflow under ASan, whose frames are ~20x larger).
  // Every statement and expression checks it, so any recursion ends in a RecursionError line
  // well before a thread's stack (8 MiB by default on Linux) runs out.
  size_t max_stack_bytes = size_t{4} << 20;
};

class Interp {
 public:
  Interp(ScopePtr globals, RenderLimits limits)
      : globals_(std::move(globals)),
        limits_(limits),
        deadline_(std::chrono::steady_clock::now() + limits.max_time) {}

  std::string render(const Template& t);

  Value eval(const Expr& e, const ScopePtr& scope);
  Value call(const Value& fn, CallArgs& args);
  Value getattr(const Value& obj, std::string_view name);
  Value getitem(const Value& obj, const Value& key);
  Value filter(std::string_view name, Value input, CallArgs& args);
  bool test(std::string_view name, const Value& input, CallArgs& args);
  std::vector<Value> iterate(const Value& v);  // Python iteration (dict -> keys, str -> chars)
  void step();                                 // counts work against max_steps

 private:
  enum class Flow { Normal, Break, Continue };
  Flow exec(const Body& body, const ScopePtr& scope, std::string& out);
  Flow exec_for(const Stmt& s, const ScopePtr& scope, std::string& out);
  void assign(const Expr& target, Value v, const ScopePtr& scope);
  Value make_macro(const Stmt& s, const ScopePtr& scope);
  Value lookup(const std::string& name, const ScopePtr& scope);
  Value eval_call(const Expr& e, const ScopePtr& scope, std::optional<Value> caller);
  CallArgs eval_args(const Expr& e, size_t first_pos, const ScopePtr& scope);
  Value eval_filter_chain(const Expr& e, const ScopePtr& scope, const Value* block_input);
  Value binary(const std::string& op, const Value& a, const Value& b);
  void append(std::string& out, std::string_view s);

  ScopePtr globals_;
  RenderLimits limits_;
  std::chrono::steady_clock::time_point deadline_;
  uint64_t steps_ = 0;
  int call_depth_ = 0;
  uintptr_t stack_base_ = 0;  // render()'s frame address (stacks grow down on every target)
  void check_stack() const;
  friend struct CallDepthGuard;
};

struct CallDepthGuard {
  explicit CallDepthGuard(Interp& in);
  ~CallDepthGuard() { --in_.call_depth_; }
  Interp& in_;
};

// builtins.cpp
Value builtin_filter(Interp& in, std::string_view name, Value input, CallArgs& args);
bool builtin_test(Interp& in, std::string_view name, const Value& input, CallArgs& args);
// A bound method of a str / list / dict ("split", "append", "items"...), or Undefined.
Value builtin_method(Interp& in, const Value& obj, std::string_view name);
// Python's `%` string formatting and `x in y`.
std::string percent_format(const std::string& fmt_str, const Value& args);
bool py_contains(const Value& container, const Value& item);
std::string obj_type_repr(const Value& v);  // "'dict object'" as Jinja2's messages print it
// methods.cpp: Python str operations shared with the filters.
std::string py_title(const std::string& s);
std::string py_capitalize(const std::string& s);
std::string py_lower(const std::string& s);
std::string py_upper(const std::string& s);
std::string py_strip(const std::string& s, const Value& chars);
std::string py_replace(const std::string& s, const std::string& old, const std::string& repl,
                       int64_t count);
std::string format_spec(const Value& v, std::string_view spec);

}  // namespace kiln::jinja
