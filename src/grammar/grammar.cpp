// grammar/grammar.cpp: the GBNF parser (text -> syntax tree) and compiler (tree -> byte-level
// rules with UTF-8 range splitting, repetition helpers and a left-recursion check).
#include "grammar/grammar.h"

#include <algorithm>
#include <map>
#include <unordered_map>
#include <utility>

namespace kiln::grammar {

namespace {

using Range = std::pair<uint32_t, uint32_t>;  // code points, inclusive
constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr int kMaxNesting = 64;  // parentheses deep; bounds the parser's recursion

struct Node {
  enum Kind { kSeq, kAlt, kClass, kRef, kRepeat } kind = kSeq;
  std::vector<Node> kids;     // kSeq, kAlt; kRepeat: kids[0]
  std::vector<Range> ranges;  // kClass
  bool negated = false;       // kClass
  std::string name;           // kRef
  size_t line = 0, col = 0;   // kRef: where it was written (for "undefined rule")
  int32_t min = 0, max = 0;   // kRepeat; max < 0: unbounded
};

struct RuleDef {
  std::string name;
  Node body;  // kAlt
  size_t line = 0;
};

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_';
}

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  Status parse(std::vector<RuleDef>& rules) {
    skip_space(true);
    while (ok_ && i_ < s_.size()) {
      parse_rule(rules);
      skip_space(true);
    }
    return ok_ ? Status::ok() : err_;
  }

 private:
  void fail(std::string msg) {
    if (!ok_) return;
    ok_ = false;
    size_t line = 1, col = 1;
    for (size_t k = 0; k < i_ && k < s_.size(); ++k) {
      if (s_[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    err_ = Status::errorf("grammar: line {} col {}: {}", line, col, msg);
  }
  bool at_end() const { return i_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[i_]; }
  std::pair<size_t, size_t> where() const {
    size_t line = 1, col = 1;
    for (size_t k = 0; k < i_; ++k) {
      if (s_[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    return {line, col};
  }

  void skip_space(bool newline_ok) {
    while (!at_end()) {
      const char c = s_[i_];
      if (c == ' ' || c == '\t') {
        ++i_;
      } else if (c == '#') {
        while (!at_end() && s_[i_] != '\n' && s_[i_] != '\r') ++i_;
      } else if ((c == '\n' || c == '\r') && newline_ok) {
        ++i_;
      } else {
        break;
      }
    }
  }

  std::string parse_name() {
    const size_t start = i_;
    while (!at_end() && is_name_char(s_[i_])) ++i_;
    if (i_ == start) fail(describe_unexpected("a rule name"));
    return std::string(s_.substr(start, i_ - start));
  }

  std::string describe_unexpected(std::string_view wanted) const {
    if (at_end()) return fmt::format("expected {}, got the end of the grammar", wanted);
    const auto c = static_cast<unsigned char>(s_[i_]);
    if (c < 0x20 || c >= 0x7f) return fmt::format("expected {}, got byte 0x{:02x}", wanted, c);
    return fmt::format("expected {}, got '{}'", wanted, static_cast<char>(c));
  }

  void parse_rule(std::vector<RuleDef>& rules) {
    RuleDef def;
    def.line = where().first;
    def.name = parse_name();
    if (!ok_) return;
    skip_space(false);
    if (s_.substr(i_, 3) != "::=") return fail(describe_unexpected("'::=' after the rule name"));
    i_ += 3;
    skip_space(true);
    def.body = parse_alternates(0);
    if (!ok_) return;
    skip_space(false);
    if (!at_end() && peek() != '\n' && peek() != '\r')
      return fail(describe_unexpected(fmt::format("the end of rule '{}'", def.name)));
    rules.push_back(std::move(def));
  }

  Node parse_alternates(int depth) {
    Node alt;
    alt.kind = Node::kAlt;
    alt.kids.push_back(parse_sequence(depth));
    while (ok_ && peek() == '|') {
      ++i_;
      skip_space(true);
      alt.kids.push_back(parse_sequence(depth));
    }
    return alt;
  }

  Node parse_sequence(int depth) {
    Node seq;
    seq.kind = Node::kSeq;
    const bool nested = depth > 0;
    while (ok_ && !at_end()) {
      const char c = peek();
      Node item;
      if (c == '"') {
        ++i_;
        item.kind = Node::kSeq;
        while (ok_ && peek() != '"') {
          if (at_end()) return fail("unterminated string literal"), seq;
          const uint32_t cp = parse_char();
          Node ch;
          ch.kind = Node::kClass;
          ch.ranges.push_back({cp, cp});
          item.kids.push_back(std::move(ch));
        }
        ++i_;
      } else if (c == '[') {
        ++i_;
        item.kind = Node::kClass;
        if (peek() == '^') {
          item.negated = true;
          ++i_;
        }
        while (ok_ && peek() != ']') {
          if (at_end()) return fail("unterminated character class"), seq;
          const uint32_t lo = parse_char();
          uint32_t hi = lo;
          if (ok_ && peek() == '-' && i_ + 1 < s_.size() && s_[i_ + 1] != ']') {
            ++i_;
            if (at_end()) return fail("unterminated character class"), seq;
            hi = parse_char();
            if (ok_ && hi < lo)
              return fail(fmt::format("character range U+{:04X}-U+{:04X} is reversed", lo, hi)),
                     seq;
          }
          item.ranges.push_back({lo, hi});
        }
        ++i_;
      } else if (c == '.') {
        ++i_;
        item.kind = Node::kClass;
        item.negated = true;  // the complement of nothing: any character
      } else if (c == '(') {
        if (depth + 1 > kMaxNesting)
          return fail(fmt::format("groups nested deeper than {}", kMaxNesting)), seq;
        ++i_;
        skip_space(true);
        item = parse_alternates(depth + 1);
        if (!ok_) return seq;
        if (peek() != ')') return fail(describe_unexpected("')'")), seq;
        ++i_;
      } else if (is_name_char(c)) {
        item.kind = Node::kRef;
        std::tie(item.line, item.col) = where();
        item.name = parse_name();
      } else {
        break;  // '|', ')', a newline at top level, or an error the caller names
      }
      if (!ok_) return seq;
      skip_space(nested);
      // Postfix operators, possibly several ("x?*" is legal if useless).
      while (ok_ && (peek() == '*' || peek() == '+' || peek() == '?' || peek() == '{')) {
        Node rep;
        rep.kind = Node::kRepeat;
        const char op = peek();
        ++i_;
        if (op == '*') {
          rep.min = 0, rep.max = -1;
        } else if (op == '+') {
          rep.min = 1, rep.max = -1;
        } else if (op == '?') {
          rep.min = 0, rep.max = 1;
        } else {
          skip_space(nested);
          rep.min = parse_count();
          skip_space(nested);
          rep.max = rep.min;
          if (ok_ && peek() == ',') {
            ++i_;
            skip_space(nested);
            rep.max = peek() == '}' ? -1 : parse_count();
            skip_space(nested);
          }
          if (ok_ && peek() != '}') return fail(describe_unexpected("'}'")), seq;
          ++i_;
          if (ok_ && rep.max >= 0 && rep.max < rep.min)
            return fail(fmt::format("repetition {{{},{}}} has max < min", rep.min, rep.max)), seq;
        }
        rep.kids.push_back(std::move(item));
        item = std::move(rep);
        skip_space(nested);
      }
      seq.kids.push_back(std::move(item));
    }
    return seq;
  }

  int32_t parse_count() {
    if (!(peek() >= '0' && peek() <= '9')) {
      fail(describe_unexpected("a repetition count"));
      return 0;
    }
    int64_t v = 0;
    while (peek() >= '0' && peek() <= '9') {
      v = v * 10 + (peek() - '0');
      ++i_;
      if (v > Grammar::kMaxRepeat) {
        fail(fmt::format("repetition count above the limit of {}", Grammar::kMaxRepeat));
        return 0;
      }
    }
    return static_cast<int32_t>(v);
  }

  uint32_t parse_hex(int n) {
    uint32_t v = 0;
    for (int k = 0; k < n; ++k) {
      const char c = peek();
      int d;
      if (c >= '0' && c <= '9')
        d = c - '0';
      else if (c >= 'a' && c <= 'f')
        d = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        d = c - 'A' + 10;
      else {
        fail(describe_unexpected(fmt::format("{} hex digits", n)));
        return 0;
      }
      v = v * 16 + static_cast<uint32_t>(d);
      ++i_;
    }
    return v;
  }

  // One character of a literal or class: an escape or one UTF-8 encoded code point.
  uint32_t parse_char() {
    const auto c = static_cast<unsigned char>(peek());
    if (c == '\\') {
      ++i_;
      const char e = peek();
      ++i_;
      uint32_t cp = 0;
      switch (e) {
        case 'x':
          cp = parse_hex(2);
          break;
        case 'u':
          cp = parse_hex(4);
          break;
        case 'U':
          cp = parse_hex(8);
          break;
        case 't':
          return '\t';
        case 'r':
          return '\r';
        case 'n':
          return '\n';
        case '\\':
        case '"':
        case '[':
        case ']':
        case '-':
        case '^':
        case '/':
          return static_cast<uint32_t>(e);
        default:
          --i_;
          fail(at_end() ? "escape at the end of the grammar"
                        : fmt::format("unknown escape '\\{}'", e >= 0x20 && e < 0x7f ? e : '?'));
          return 0;
      }
      if (ok_ && (cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF)))
        fail(fmt::format("escape U+{:X} is not a Unicode scalar value", cp));
      return cp;
    }
    // UTF-8 decode, strictly (no overlongs, no surrogates).
    int n = c < 0x80             ? 1
            : (c & 0xE0) == 0xC0 ? 2
            : (c & 0xF0) == 0xE0 ? 3
            : (c & 0xF8) == 0xF0 ? 4
                                 : 0;
    if (n == 0 || i_ + static_cast<size_t>(n) > s_.size()) {
      fail("invalid UTF-8 in the grammar");
      return 0;
    }
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s_[i_ + static_cast<size_t>(k)]);
      if ((b & 0xC0) != 0x80) {
        fail("invalid UTF-8 in the grammar");
        return 0;
      }
      cp = (cp << 6) | (b & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF)) {
      fail("invalid UTF-8 in the grammar");
      return 0;
    }
    i_ += static_cast<size_t>(n);
    return cp;
  }

  std::string_view s_;
  size_t i_ = 0;
  bool ok_ = true;
  Status err_;
};

// ---------------------------------------------------------------- UTF-8 range splitting

using ByteSeq = std::vector<std::pair<uint8_t, uint8_t>>;  // one [lo, hi] per byte

int encode_utf8(uint32_t cp, uint8_t out[4]) {
  if (cp < 0x80) {
    out[0] = static_cast<uint8_t>(cp);
    return 1;
  }
  if (cp < 0x800) {
    out[0] = static_cast<uint8_t>(0xC0 | (cp >> 6));
    out[1] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = static_cast<uint8_t>(0xE0 | (cp >> 12));
    out[1] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
    out[2] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    return 3;
  }
  out[0] = static_cast<uint8_t>(0xF0 | (cp >> 18));
  out[1] = static_cast<uint8_t>(0x80 | ((cp >> 12) & 0x3F));
  out[2] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
  out[3] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  return 4;
}

// Splits [lo, hi] until both ends encode to the same length and every byte position is a
// plain range (the continuation bytes below a differing position span 80-BF fully).
void split_utf8(uint32_t lo, uint32_t hi, std::vector<ByteSeq>& out) {
  if (lo > hi) return;
  for (uint32_t m : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= m && hi > m) {
      split_utf8(lo, m, out);
      split_utf8(m + 1, hi, out);
      return;
    }
  }
  if (hi > 0x7F) {
    for (int k = 1; k < 4; ++k) {
      const uint32_t mask = (1u << (6 * k)) - 1;
      if ((lo & ~mask) != (hi & ~mask)) {
        if ((lo & mask) != 0) {
          split_utf8(lo, lo | mask, out);
          split_utf8((lo | mask) + 1, hi, out);
          return;
        }
        if ((hi & mask) != mask) {
          split_utf8(lo, (hi & ~mask) - 1, out);
          split_utf8(hi & ~mask, hi, out);
          return;
        }
      }
    }
  }
  uint8_t a[4], b[4];
  const int n = encode_utf8(lo, a);
  encode_utf8(hi, b);
  ByteSeq seq;
  for (int k = 0; k < n; ++k) seq.push_back({a[k], b[k]});
  out.push_back(std::move(seq));
}

// The class's code point set as sorted disjoint ranges, complemented if negated, with the
// surrogates (not encodable in UTF-8) removed.
std::vector<Range> normalize(std::vector<Range> r, bool negated) {
  std::sort(r.begin(), r.end());
  std::vector<Range> merged;
  for (const Range& x : r) {
    if (!merged.empty() && x.first <= merged.back().second + 1)
      merged.back().second = std::max(merged.back().second, x.second);
    else
      merged.push_back(x);
  }
  if (negated) {
    std::vector<Range> comp;
    uint32_t next = 0;
    for (const Range& x : merged) {
      if (x.first > next) comp.push_back({next, x.first - 1});
      next = x.second + 1;
    }
    if (next <= kMaxCodePoint) comp.push_back({next, kMaxCodePoint});
    merged = std::move(comp);
  }
  std::vector<Range> out;
  for (const Range& x : merged) {
    if (x.second < 0xD800 || x.first > 0xDFFF) {
      out.push_back(x);
      continue;
    }
    if (x.first < 0xD800) out.push_back({x.first, 0xD7FF});
    if (x.second > 0xDFFF) out.push_back({0xE000, x.second});
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------- compiler

class Compiler {
 public:
  Expected<std::shared_ptr<const Grammar>> compile(std::vector<RuleDef>& defs) {
    auto g = std::make_shared<Grammar>();
    g_ = g.get();
    if (defs.empty()) return Status::error("grammar: no rules");
    for (const RuleDef& d : defs) {
      if (ids_.count(d.name))
        return Status::errorf("grammar: rule '{}' is defined twice (line {})", d.name, d.line);
      ids_[d.name] = static_cast<uint32_t>(g_->rules_.size());
      g_->rules_.emplace_back();
      g_->names_.push_back(d.name);
    }
    auto root = ids_.find("root");
    if (root == ids_.end()) return Status::error("grammar: no rule named 'root'");
    g_->root_ = root->second;
    for (RuleDef& d : defs) {
      current_ = d.name;
      n_anon_ = 0;
      std::vector<std::vector<Element>> alts;
      for (const Node& seq : d.body.kids) {
        alts.emplace_back();
        lower(seq, alts.back());
        if (!error_.is_ok()) return error_;
      }
      commit(ids_[d.name], alts);
      if (!error_.is_ok()) return error_;
    }
    if (auto st = check_left_recursion(); !st.is_ok()) return st;
    return std::shared_ptr<const Grammar>(std::move(g));
  }

 private:
  void grow(size_t n) {
    total_ += n;
    if (total_ > Grammar::kMaxElements && error_.is_ok())
      error_ = Status::errorf("grammar: more than {} elements after expanding repetitions",
                              Grammar::kMaxElements);
  }

  uint32_t new_rule() {
    const auto id = static_cast<uint32_t>(g_->rules_.size());
    g_->rules_.emplace_back();
    g_->names_.push_back(fmt::format("{}_{}", current_, ++n_anon_));
    return id;
  }

  void commit(uint32_t rule, const std::vector<std::vector<Element>>& alts) {
    for (const auto& alt : alts) {
      grow(alt.size() + 1);
      if (!error_.is_ok()) return;
      g_->rules_[rule].push_back(static_cast<uint32_t>(g_->elements_.size()));
      g_->elements_.insert(g_->elements_.end(), alt.begin(), alt.end());
      g_->elements_.push_back(Element{});
    }
  }

  static Element ref(uint32_t r) {
    Element e;
    e.kind = Element::kRule;
    e.rule = r;
    return e;
  }

  void append(std::vector<Element>& out, const std::vector<Element>& xs) {
    grow(xs.size());
    if (!error_.is_ok()) return;
    out.insert(out.end(), xs.begin(), xs.end());
  }

  void lower(const Node& n, std::vector<Element>& out) {
    if (!error_.is_ok()) return;
    switch (n.kind) {
      case Node::kSeq:
        for (const Node& k : n.kids) lower(k, out);
        return;
      case Node::kAlt: {
        if (n.kids.size() == 1) return lower(n.kids[0], out);
        std::vector<std::vector<Element>> alts(n.kids.size());
        for (size_t i = 0; i < n.kids.size(); ++i) lower(n.kids[i], alts[i]);
        const uint32_t r = new_rule();
        commit(r, alts);
        out.push_back(ref(r));
        return;
      }
      case Node::kRef: {
        auto it = ids_.find(n.name);
        if (it == ids_.end()) {
          error_ = Status::errorf("grammar: line {} col {}: rule '{}' is not defined", n.line,
                                  n.col, n.name);
          return;
        }
        out.push_back(ref(it->second));
        return;
      }
      case Node::kClass:
        return lower_class(n, out);
      case Node::kRepeat: {
        std::vector<Element> x;
        lower(n.kids[0], x);
        for (int32_t k = 0; k < n.min && error_.is_ok(); ++k) append(out, x);
        if (n.max < 0) {  // R ::= x R |
          const uint32_t r = new_rule();
          std::vector<std::vector<Element>> alts(2);
          append(alts[0], x);
          alts[0].push_back(ref(r));
          commit(r, alts);
          out.push_back(ref(r));
        } else if (n.max > n.min) {  // R_1 ::= x | ; R_k ::= x R_{k-1} |
          uint32_t prev = 0;
          for (int32_t k = 1; k <= n.max - n.min && error_.is_ok(); ++k) {
            const uint32_t r = new_rule();
            std::vector<std::vector<Element>> alts(2);
            append(alts[0], x);
            if (k > 1) alts[0].push_back(ref(prev));
            commit(r, alts);
            prev = r;
          }
          out.push_back(ref(prev));
        }
        return;
      }
    }
  }

  void lower_class(const Node& n, std::vector<Element>& out) {
    const std::vector<Range> ranges = normalize(n.ranges, n.negated);
    std::string key;
    for (const Range& r : ranges) key += fmt::format("{:x}-{:x},", r.first, r.second);
    std::vector<ByteSeq> seqs;
    for (const Range& r : ranges) split_utf8(r.first, r.second, seqs);
    auto bytes = [](const ByteSeq& s, std::vector<Element>& dst) {
      for (auto [lo, hi] : s) {
        Element e;
        e.kind = Element::kBytes;
        e.lo = lo;
        e.hi = hi;
        dst.push_back(e);
      }
    };
    if (seqs.size() == 1) {
      grow(seqs[0].size());
      return bytes(seqs[0], out);
    }
    // Several byte sequences (or none: an empty class never matches): a rule of its own,
    // shared by every use of the same set.
    if (auto it = classes_.find(key); it != classes_.end()) {
      out.push_back(ref(it->second));
      return;
    }
    std::vector<std::vector<Element>> alts(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) bytes(seqs[i], alts[i]);
    const uint32_t r = new_rule();
    commit(r, alts);
    classes_[key] = r;
    out.push_back(ref(r));
  }

  // A rule that reaches itself before consuming a byte would make the matcher's expansion
  // loop forever: refuse it (the usual cause: left recursion, or a repeated nullable group).
  Status check_left_recursion() {
    const size_t n = g_->rules_.size();
    const auto& el = g_->elements_;
    std::vector<char> nullable(n, 0);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t r = 0; r < n; ++r) {
        if (nullable[r]) continue;
        for (uint32_t a : g_->rules_[r]) {
          bool all = true;
          for (uint32_t p = a; el[p].kind != Element::kEnd; ++p)
            if (el[p].kind == Element::kBytes || !nullable[el[p].rule]) {
              all = false;
              break;
            }
          if (all) {
            nullable[r] = 1;
            changed = true;
            break;
          }
        }
      }
    }
    // Edges r -> s: s can be the first thing r matches.
    std::vector<std::vector<uint32_t>> first(n);
    for (size_t r = 0; r < n; ++r)
      for (uint32_t a : g_->rules_[r])
        for (uint32_t p = a; el[p].kind == Element::kRule; ++p) {
          first[r].push_back(el[p].rule);
          if (!nullable[el[p].rule]) break;
        }
    std::vector<char> state(n, 0);  // 0 new, 1 on the DFS path, 2 done
    for (size_t start = 0; start < n; ++start) {
      if (state[start]) continue;
      std::vector<std::pair<uint32_t, size_t>> dfs{{static_cast<uint32_t>(start), 0}};
      state[start] = 1;
      while (!dfs.empty()) {
        auto& [r, k] = dfs.back();
        if (k == first[r].size()) {
          state[r] = 2;
          dfs.pop_back();
          continue;
        }
        const uint32_t s = first[r][k++];
        if (state[s] == 1)
          return Status::errorf(
              "grammar: rule '{}' is left-recursive (it can reach itself without consuming "
              "input)",
              g_->names_[s]);
        if (state[s] == 0) {
          state[s] = 1;
          dfs.push_back({s, 0});
        }
      }
    }
    return Status::ok();
  }

  Grammar* g_ = nullptr;
  std::unordered_map<std::string, uint32_t> ids_;
  std::unordered_map<std::string, uint32_t> classes_;
  std::string current_;
  int n_anon_ = 0;
  size_t total_ = 0;
  Status error_;
};

Expected<std::shared_ptr<const Grammar>> Grammar::parse(std::string_view text) {
  std::vector<RuleDef> defs;
  Parser p(text);
  if (auto st = p.parse(defs); !st.is_ok()) return st;
  Compiler c;
  return c.compile(defs);
}

void append_gbnf_literal(std::string& out, std::string_view s) {
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02X}", c);
    } else {
      out += ch;
    }
  }
  out += '"';
}

}  // namespace kiln::grammar
