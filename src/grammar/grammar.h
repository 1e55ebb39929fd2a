// grammar/grammar.h: GBNF grammars (llama.cpp's format) compiled to byte-level pushdown rules.
//
// Text form (one rule per line, `name ::= alternatives`; newlines inside parentheses and after
// `::=` or `|` continue the rule; `#` starts a comment):
//   "literal" with escapes \n \r \t \\ \" \[ \] \xHH \uHHHH \UHHHHHHHH,
//   [a-z0-9_] character classes (ranges, escapes, [^...] negation), `.` any character,
//   rule references, ( groups ), and the postfix operators * + ? {m} {m,} {m,n}.
// The rule `root` is where matching starts.
//
// Compilation turns every character class into UTF-8 byte-range sequences (the classic UTF-8
// range split), so the matcher consumes bytes, not code points: a token that ends inside a
// multi-byte character simply leaves the matcher between two byte elements. Repetitions
// become right-recursive helper rules (x* -> R ::= x R | ; x{m,n} -> m copies, then a
// chain of optional ones), which the matcher runs in constant stack depth.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace kiln::grammar {

// One element of a rule alternative. An alternative is a run of elements ending in kEnd.
struct Element {
  enum Kind : uint8_t { kEnd, kBytes, kRule };
  Kind kind = kEnd;
  uint8_t lo = 0, hi = 0;  // kBytes: one byte in [lo, hi]
  uint32_t rule = 0;       // kRule: the rule matched here
};

class Grammar {
 public:
  // Parses and compiles GBNF text. Errors are one line: "grammar: line L col C: <what>" for
  // syntax, "grammar: rule 'x' ..." for undefined, duplicate or left-recursive rules.
  static Expected<std::shared_ptr<const Grammar>> parse(std::string_view text);

  // Limits that bound what a request can make the server build.
  static constexpr size_t kMaxElements = 1u << 20;
  static constexpr int32_t kMaxRepeat = 1000;  // largest m or n in {m,n}

  std::span<const Element> elements() const { return elements_; }
  // Alternatives of `rule`: offsets of their first element in elements().
  std::span<const uint32_t> alternatives(uint32_t rule) const { return rules_[rule]; }
  const std::string& rule_name(uint32_t rule) const { return names_[rule]; }
  size_t n_rules() const { return rules_.size(); }
  uint32_t root() const { return root_; }

 private:
  friend class Compiler;
  std::vector<Element> elements_;
  std::vector<std::vector<uint32_t>> rules_;
  std::vector<std::string> names_;
  uint32_t root_ = 0;
};

// Appends `s` as a GBNF string literal (quotes included), escaping what the parser reads
// specially; bytes >= 0x80 pass through (the parser reads them as UTF-8).
void append_gbnf_literal(std::string& out, std::string_view s);

}  // namespace kiln::grammar
