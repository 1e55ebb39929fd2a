// tokenizer/jinja/parser.cpp: recursive-descent parser following jinja2/parser.py, so
// precedence quirks match (`-x|f` filters the negation, `a ~ b + c` binds + first, tests
// take one bare argument: `x is divisibleby 3`).
#include "tokenizer/jinja/parser.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <initializer_list>

#include "tokenizer/jinja/lexer.h"

namespace kiln::jinja {
namespace {

constexpr int kMaxNesting = 200;  // bounds recursion on hostile input
constexpr int kMaxExprDepth = 400;

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : toks_(std::move(toks)) {}

  Template run() {
    Template t;
    t.body = subparse({});
    if (cur().type != Token::Type::Eof) fail_here("unexpected tokens after template end");
    return t;
  }

 private:
  using T = Token::Type;

  const Token& cur() const { return toks_[pos_]; }
  const Token& peek(size_t n = 1) const { return toks_[std::min(pos_ + n, toks_.size() - 1)]; }
  void next() {
    if (pos_ + 1 < toks_.size()) ++pos_;
  }
  bool is_op(std::string_view op) const { return cur().type == T::Op && cur().text == op; }
  bool is_name(std::string_view n) const { return cur().type == T::Name && cur().text == n; }
  bool skip_op(std::string_view op) {
    if (is_op(op)) {
      next();
      return true;
    }
    return false;
  }
  bool skip_name(std::string_view n) {
    if (is_name(n)) {
      next();
      return true;
    }
    return false;
  }

  [[noreturn]] void fail_here(std::string_view msg) const {
    fail("TemplateSyntaxError", fmt::format("{} (line {})", msg, cur().line));
  }
  std::string describe() const {
    switch (cur().type) {
      case T::Eof:
        return "end of template";
      case T::BlockEnd:
        return "end of statement block";
      case T::VarEnd:
        return "end of print statement";
      case T::Data:
        return "template data";
      default:
        return "'" + cur().text + "'";
    }
  }
  void expect_op(std::string_view op) {
    if (!skip_op(op)) fail_here(fmt::format("expected '{}', got {}", op, describe()));
  }
  std::string expect_name() {
    if (cur().type != T::Name) fail_here(fmt::format("expected a name, got {}", describe()));
    std::string n = cur().text;
    next();
    return n;
  }
  void expect_block_end() {
    if (cur().type != T::BlockEnd)
      fail_here(fmt::format("expected end of statement block, got {}", describe()));
    next();
  }

  struct DepthGuard {
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxNesting) p_.fail_here("template nesting too deep");
    }
    ~DepthGuard() { --p_.depth_; }
    Parser& p_;
  };

  ExprPtr node(Expr::Kind k, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = k;
    e->line = line;
    return e;
  }

  // ---- statements ----

  // Parses until a block tag whose name is in `end`; leaves the position on that name.
  Body subparse(std::initializer_list<std::string_view> end) {
    Body body;
    for (;;) {
      const Token& t = cur();
      if (t.type == T::Eof) {
        if (end.size())
          fail_here(fmt::format("unexpected end of template, expected '{}'", *end.begin()));
        return body;
      }
      if (t.type == T::Data) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::Data;
        s->text = t.text;
        s->line = t.line;
        body.push_back(std::move(s));
        next();
      } else if (t.type == T::VarBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::Print;
        s->line = t.line;
        s->expr = parse_tuple(true, {});
        if (cur().type != T::VarEnd)
          fail_here(fmt::format("expected end of print statement, got {}", describe()));
        next();
        body.push_back(std::move(s));
      } else if (t.type == T::BlockBegin) {
        next();
        if (cur().type == T::Name &&
            std::find(end.begin(), end.end(), std::string_view(cur().text)) != end.end())
          return body;
        body.push_back(parse_statement());
      } else {
        fail_here(fmt::format("unexpected {}", describe()));
      }
    }
  }

  StmtPtr parse_statement() {
    DepthGuard g(*this);
    if (cur().type != T::Name) fail_here("tag name expected");
    std::string tag = cur().text;
    int line = cur().line;
    next();
    auto s = std::make_unique<Stmt>();
    s->line = line;
    if (tag == "if") {
      parse_if(*s);
    } else if (tag == "for") {
      s->kind = Stmt::Kind::For;
      s->target = parse_assign_target(false);
      if (!skip_name("in")) fail_here(fmt::format("expected 'in', got {}", describe()));
      s->expr = parse_tuple(false, {"recursive"});
      if (skip_name("if")) s->loop_filter = parse_expression(true);
      s->recursive = skip_name("recursive");
      expect_block_end();
      s->body = subparse({"endfor", "else"});
      if (skip_name("else")) {
        expect_block_end();
        s->else_body = subparse({"endfor"});
      }
      next();
      expect_block_end();
    } else if (tag == "set") {
      s->target = parse_assign_target(true);
      if (skip_op("=")) {
        s->kind = Stmt::Kind::Set;
        s->expr = parse_tuple(true, {});
        expect_block_end();
      } else {
        s->kind = Stmt::Kind::SetBlock;
        if (s->target->kind != Expr::Kind::Name && s->target->kind != Expr::Kind::Attr)
          fail_here("block set needs a single target");
        if (is_op("|")) s->expr = parse_filter_chain(nullptr);
        expect_block_end();
        s->body = subparse({"endset"});
        next();
        expect_block_end();
      }
    } else if (tag == "macro") {
      s->kind = Stmt::Kind::Macro;
      s->text = expect_name();
      parse_signature(*s);
      expect_block_end();
      s->body = subparse({"endmacro"});
      next();
      if (cur().type == T::Name) next();  // {% endmacro name %}
      expect_block_end();
    } else if (tag == "call") {
      s->kind = Stmt::Kind::CallBlock;
      if (is_op("(")) parse_signature(*s);
      s->expr = parse_expression(true);
      if (s->expr->kind != Expr::Kind::Call) fail_here("expected call");
      expect_block_end();
      s->body = subparse({"endcall"});
      next();
      expect_block_end();
    } else if (tag == "filter") {
      s->kind = Stmt::Kind::FilterBlock;
      s->expr = parse_filter_chain(nullptr, true);
      expect_block_end();
      s->body = subparse({"endfilter"});
      next();
      expect_block_end();
    } else if (tag == "with") {
      s->kind = Stmt::Kind::With;
      while (cur().type != T::BlockEnd) {
        if (!s->params.empty()) expect_op(",");
        std::string n = expect_name();
        expect_op("=");
        s->params.emplace_back(n, parse_expression(true));
      }
      expect_block_end();
      s->body = subparse({"endwith"});
      next();
      expect_block_end();
    } else if (tag == "generation") {
      // Hugging Face's extension: the body renders unchanged.
      s->kind = Stmt::Kind::If;
      s->expr = node(Expr::Kind::Literal, line);
      s->expr->literal = Value::boolean(true);
      expect_block_end();
      s->body = subparse({"endgeneration"});
      next();
      expect_block_end();
    } else if (tag == "break" || tag == "continue") {
      s->kind = tag == "break" ? Stmt::Kind::Break : Stmt::Kind::Continue;
      expect_block_end();
    } else if (tag == "do") {
      s->kind = Stmt::Kind::Do;
      s->expr = parse_tuple(true, {});
      expect_block_end();
    } else {
      fail("TemplateSyntaxError",
           fmt::format("Encountered unknown tag '{}'. (line {})", tag, line));
    }
    return s;
  }

  void parse_if(Stmt& s) {
    s.kind = Stmt::Kind::If;
    s.expr = parse_tuple(false, {});
    expect_block_end();
    s.body = subparse({"elif", "else", "endif"});
    if (skip_name("elif")) {
      auto e = std::make_unique<Stmt>();
      e->line = cur().line;
      parse_if(*e);  // consumes through endif
      s.else_body.push_back(std::move(e));
      return;
    }
    if (skip_name("else")) {
      expect_block_end();
      s.else_body = subparse({"endif"});
    }
    if (!skip_name("endif")) fail_here("expected 'endif'");
    expect_block_end();
  }

  void parse_signature(Stmt& s) {
    expect_op("(");
    while (!is_op(")")) {
      if (!s.params.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string n = expect_name();
      ExprPtr def;
      if (skip_op("=")) def = parse_expression(true);
      s.params.emplace_back(n, std::move(def));
    }
    expect_op(")");
  }

  ExprPtr parse_assign_target(bool with_namespace) {
    int line = cur().line;
    if (with_namespace && cur().type == T::Name && peek().type == T::Op && peek().text == ".") {
      auto e = node(Expr::Kind::Attr, line);
      auto obj = node(Expr::Kind::Name, line);
      obj->name = expect_name();
      next();
      e->name = expect_name();
      e->args.push_back(std::move(obj));
      return e;
    }
    std::vector<ExprPtr> names;
    bool paren = skip_op("(");
    bool tuple = paren;
    for (;;) {
      auto n = node(Expr::Kind::Name, cur().line);
      n->name = expect_name();
      names.push_back(std::move(n));
      if (!skip_op(",")) break;
      tuple = true;
      if (paren && is_op(")")) break;
      if (!paren && cur().type != T::Name) break;
    }
    if (paren) expect_op(")");
    if (!tuple) return std::move(names[0]);
    auto t = node(Expr::Kind::Tuple, line);
    t->args = std::move(names);
    return t;
  }

  // ---- expressions ----

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard g(*this);
    if (!with_condexpr) return parse_or();
    ExprPtr e = parse_or();
    while (is_name("if")) {
      int line = cur().line;
      next();
      auto c = node(Expr::Kind::Cond, line);
      ExprPtr cond = parse_or();
      ExprPtr other;
      if (skip_name("else")) other = parse_expression(true);
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(other));
      e = track(std::move(c));
    }
    return e;
  }

  // A comma-separated list becomes a tuple; a single expression stays as it is.
  ExprPtr parse_tuple(bool with_condexpr, std::initializer_list<std::string_view> extra_end,
                      bool explicit_paren = false) {
    int line = cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    for (;;) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        is_tuple = true;
      }
      if (tuple_end(extra_end)) break;
      items.push_back(parse_expression(with_condexpr));
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_paren) fail_here(fmt::format("Expected an expression, got {}", describe()));
    }
    auto t = node(Expr::Kind::Tuple, line);
    t->args = std::move(items);
    return t;
  }

  bool tuple_end(std::initializer_list<std::string_view> extra) const {
    if (cur().type == T::VarEnd || cur().type == T::BlockEnd || cur().type == T::Eof) return true;
    if (cur().type == T::Op && (cur().text == ")" || cur().text == "]")) return true;
    if (cur().type == T::Name)
      for (auto n : extra)
        if (cur().text == n) return true;
    return false;
  }

  ExprPtr binary(Expr::Kind k, std::string op, ExprPtr a, ExprPtr b, int line) {
    auto e = node(k, line);
    e->name = std::move(op);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return track(std::move(e));
  }

  // Left-associative chains (a+b+c..., x|f|g..., a.b.c...) deepen the tree without
  // recursing in the parser; cap the depth so evaluation and destruction stay bounded.
  ExprPtr track(ExprPtr e) {
    int d = 0;
    for (const auto& a : e->args)
      if (a) d = std::max(d, a->depth);
    e->depth = d + 1;
    if (e->depth > kMaxExprDepth) fail_here("expression nesting too deep");
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      int line = cur().line;
      next();
      e = binary(Expr::Kind::Or, "or", std::move(e), parse_and(), line);
    }
    return e;
  }
  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      int line = cur().line;
      next();
      e = binary(Expr::Kind::And, "and", std::move(e), parse_not(), line);
    }
    return e;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard g(*this);
      int line = cur().line;
      next();
      auto e = node(Expr::Kind::Unary, line);
      e->name = "not";
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  // Chained comparisons (a < b < c) become And nodes of pairwise comparisons over shared
  // operands; operands are pure expressions in practice, so re-evaluation is harmless.
  ExprPtr parse_compare() {
    int line = cur().line;
    ExprPtr e = parse_math1();
    ExprPtr result;
    Expr* last = e.get();
    std::vector<ExprPtr> keep;
    for (;;) {
      std::string op;
      if (cur().type == T::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                  cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        op = cur().text;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && peek().type == T::Name && peek().text == "in") {
        op = "not in";
        next();
        next();
      } else {
        break;
      }
      ExprPtr rhs = parse_math1();
      Expr* rhs_raw = rhs.get();
      if (!result) {
        result = binary(Expr::Kind::Binary, op, std::move(e), std::move(rhs), line);
      } else {
        auto lhs_copy = clone(*last);
        auto cmp = binary(Expr::Kind::Binary, op, std::move(lhs_copy), std::move(rhs), line);
        result = binary(Expr::Kind::And, "and", std::move(result), std::move(cmp), line);
      }
      last = rhs_raw;
    }
    return result ? std::move(result) : std::move(e);
  }

  ExprPtr clone(const Expr& x) {
    auto e = std::make_unique<Expr>();
    e->kind = x.kind;
    e->line = x.line;
    e->literal = x.literal;
    e->name = x.name;
    e->negated = x.negated;
    for (const auto& a : x.args) e->args.push_back(a ? clone(*a) : nullptr);
    for (const auto& kv : x.kwargs)
      e->kwargs.emplace_back(kv.first, kv.second ? clone(*kv.second) : nullptr);
    if (x.star_args) e->star_args = clone(*x.star_args);
    if (x.star_kwargs) e->star_kwargs = clone(*x.star_kwargs);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().text;
      int line = cur().line;
      next();
      e = binary(Expr::Kind::Binary, op, std::move(e), parse_concat(), line);
    }
    return e;
  }
  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      int line = cur().line;
      next();
      e = binary(Expr::Kind::Binary, "~", std::move(e), parse_math2(), line);
    }
    return e;
  }
  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().text;
      int line = cur().line;
      next();
      e = binary(Expr::Kind::Binary, op, std::move(e), parse_pow(), line);
    }
    return e;
  }
  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      int line = cur().line;
      next();
      e = binary(Expr::Kind::Binary, "**", std::move(e), parse_unary(true), line);
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter) {
    DepthGuard g(*this);
    int line = cur().line;
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      std::string op = cur().text;
      next();
      e = node(Expr::Kind::Unary, line);
      e->name = op;
      e->args.push_back(parse_unary(false));
      e = track(std::move(e));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    DepthGuard g(*this);
    const Token& t = cur();
    int line = t.line;
    if (t.type == T::Name) {
      auto e = node(Expr::Kind::Literal, line);
      if (t.text == "true" || t.text == "True")
        e->literal = Value::boolean(true);
      else if (t.text == "false" || t.text == "False")
        e->literal = Value::boolean(false);
      else if (t.text == "none" || t.text == "None")
        e->literal = Value::none();
      else {
        e->kind = Expr::Kind::Name;
        e->name = t.text;
      }
      next();
      return e;
    }
    if (t.type == T::String) {
      std::string s;
      while (cur().type == T::String) {
        s += cur().text;
        next();
      }
      auto e = node(Expr::Kind::Literal, line);
      e->literal = Value::string(std::move(s));
      return e;
    }
    if (t.type == T::Int) {
      auto e = node(Expr::Kind::Literal, line);
      int64_t v = 0;
      auto r = std::from_chars(t.text.data(), t.text.data() + t.text.size(), v);
      if (r.ec != std::errc())
        e->literal = Value::number(std::stod(t.text));
      else
        e->literal = Value::integer(v);
      next();
      return e;
    }
    if (t.type == T::Float) {
      auto e = node(Expr::Kind::Literal, line);
      e->literal = Value::number(std::strtod(t.text.c_str(), nullptr));
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      ExprPtr e = parse_tuple(true, {}, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto e = node(Expr::Kind::List, line);
      while (!is_op("]")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("]")) break;
        e->args.push_back(parse_expression(true));
      }
      expect_op("]");
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = node(Expr::Kind::Dict, line);
      while (!is_op("}")) {
        if (!e->args.empty()) expect_op(",");
        if (is_op("}")) break;
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->args.push_back(parse_expression(true));
      }
      expect_op("}");
      return e;
    }
    fail_here(fmt::format("unexpected {}", describe()));
  }

  ExprPtr parse_postfix(ExprPtr e) {
    for (;;) {
      int line = cur().line;
      if (is_op(".")) {
        next();
        if (cur().type == T::Name) {
          auto a = node(Expr::Kind::Attr, line);
          a->name = cur().text;
          a->args.push_back(std::move(e));
          next();
          e = track(std::move(a));
        } else if (cur().type == T::Int) {
          auto a = node(Expr::Kind::Item, line);
          a->args.push_back(std::move(e));
          auto k = node(Expr::Kind::Literal, line);
          k->literal = Value::integer(std::stoll(cur().text));
          a->args.push_back(std::move(k));
          next();
          e = track(std::move(a));
        } else {
          fail_here("expected name or number after '.'");
        }
      } else if (is_op("[")) {
        next();
        e = track(parse_subscript(std::move(e), line));
        expect_op("]");
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj, int line) {
    ExprPtr parts[3];
    int n_colons = 0;
    if (!is_op(":")) {
      parts[0] = parse_expression(true);
      if (is_op(",")) {  // obj[a, b]: a tuple key
        auto t = node(Expr::Kind::Tuple, line);
        t->args.push_back(std::move(parts[0]));
        while (skip_op(",")) {
          if (is_op("]")) break;
          t->args.push_back(parse_expression(true));
        }
        auto it = node(Expr::Kind::Item, line);
        it->args.push_back(std::move(obj));
        it->args.push_back(std::move(t));
        return it;
      }
    }
    while (n_colons < 2 && skip_op(":")) {
      ++n_colons;
      if (!is_op(":") && !is_op("]")) parts[n_colons] = parse_expression(true);
    }
    if (n_colons == 0) {
      auto it = node(Expr::Kind::Item, line);
      it->args.push_back(std::move(obj));
      it->args.push_back(std::move(parts[0]));
      return it;
    }
    auto s = node(Expr::Kind::Slice, line);
    s->args.push_back(std::move(obj));
    for (auto& p : parts) s->args.push_back(std::move(p));
    return s;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) {
        expect_op(",");
        if (is_op(")")) break;
      }
      first = false;
      if (skip_op("*")) {
        e.star_args = parse_expression(true);
      } else if (skip_op("**")) {
        e.star_kwargs = parse_expression(true);
      } else if (cur().type == T::Name && peek().type == T::Op && peek().text == "=") {
        std::string n = cur().text;
        next();
        next();
        e.kwargs.emplace_back(n, parse_expression(true));
      } else {
        if (!e.kwargs.empty()) fail_here("positional argument after keyword argument");
        e.args.push_back(parse_expression(true));
      }
    }
    expect_op(")");
  }

  ExprPtr parse_call(ExprPtr callee) {
    DepthGuard g(*this);
    auto c = node(Expr::Kind::Call, cur().line);
    c->args.push_back(std::move(callee));
    parse_call_args(*c);
    return track(std::move(c));
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    for (;;) {
      if (is_op("|"))
        e = parse_filter_chain(std::move(e));
      else if (is_name("is"))
        e = parse_test(std::move(e));
      else if (is_op("("))
        e = parse_call(std::move(e));
      else
        return e;
    }
  }

  // One or more `| name(args)`; `start_inline` is the filter tag, which has no leading pipe.
  ExprPtr parse_filter_chain(ExprPtr input, bool start_inline = false) {
    bool first = true;
    while (is_op("|") || (start_inline && first)) {
      if (!(start_inline && first)) next();
      first = false;
      DepthGuard g(*this);
      auto f = node(Expr::Kind::Filter, cur().line);
      f->name = expect_name();
      while (is_op(".")) {
        next();
        f->name += "." + expect_name();
      }
      f->args.push_back(std::move(input));
      if (is_op("(")) parse_call_args(*f);
      input = track(std::move(f));
    }
    return input;
  }

  ExprPtr parse_test(ExprPtr input) {
    DepthGuard g(*this);
    int line = cur().line;
    next();  // 'is'
    auto t = node(Expr::Kind::Test, line);
    t->negated = skip_name("not");
    t->name = expect_name();
    while (is_op(".")) {
      next();
      t->name += "." + expect_name();
    }
    t->args.push_back(std::move(input));
    if (is_op("(")) {
      parse_call_args(*t);
    } else if ((cur().type == T::Name || cur().type == T::String || cur().type == T::Int ||
                cur().type == T::Float || is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) fail_here("You cannot chain multiple tests with is");
      t->args.push_back(parse_postfix(parse_primary()));
    }
    return track(std::move(t));
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

Template parse(std::string_view source) { return Parser(lex(source)).run(); }

}  // namespace kiln::jinja
