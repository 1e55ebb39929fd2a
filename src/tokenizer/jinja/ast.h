// tokenizer/jinja/ast.h: the parsed template: expression and statement nodes. Nodes own
// their children; the interpreter walks them directly (no compilation step).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja/value.h"

namespace kiln::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    Literal,
    Name,
    List,
    Tuple,
    Dict,
    Attr,
    Item,
    Slice,
    Call,
    Filter,
    Test,
    Unary,
    Binary,
    And,
    Or,
    Cond,
  };
  Kind kind = Kind::Literal;
  int line = 0;
  Value literal;
  // Name: the variable; Attr: the attribute; Unary/Binary: the operator; Filter/Test: the name.
  std::string name;
  // Attr: [obj]; Item: [obj, key]; Slice: [obj, start, stop, step] (null = omitted);
  // Call: [callee, positional...]; Filter/Test: [input (null inside a filter block), args...];
  // Unary: [operand]; Binary/And/Or: [lhs, rhs]; Cond: [then, cond, else (may be null)];
  // List/Tuple: items; Dict: key0, value0, key1, value1, ...
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;  // Call/Filter/Test keyword arguments
  ExprPtr star_args, star_kwargs;                       // *args, **kwargs in calls
  bool negated = false;                                 // `is not`
  int depth = 1;                                        // longest path to a leaf
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind {
    Data,
    Print,
    If,
    For,
    Set,
    SetBlock,
    Macro,
    CallBlock,
    FilterBlock,
    Break,
    Continue,
    With,
    Do,
  };
  Kind kind = Kind::Data;
  int line = 0;
  std::string text;     // Data: the text; Macro: the name
  ExprPtr expr;         // Print/Do: value; If: condition; For: iterable; Set: value;
                        // CallBlock: the call; FilterBlock/SetBlock: filter chain (may be null)
  ExprPtr target;       // For/Set/SetBlock: assignment target (Name, Tuple of Names, Attr)
  ExprPtr loop_filter;  // For: the `if` clause
  bool recursive = false;
  Body body, else_body;  // If: then / else (elif nests an If in else_body); For: body / else
  // Macro / CallBlock: parameters with optional defaults; With: name = value pairs.
  std::vector<std::pair<std::string, ExprPtr>> params;
};

struct Template {
  Body body;
};

}  // namespace kiln::jinja
