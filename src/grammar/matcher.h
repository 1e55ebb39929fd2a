// grammar/matcher.h: running a compiled Grammar over generated tokens. The matcher holds the
// set of pushdown stacks that the output so far leaves open (llama.cpp's model: each stack is
// the grammar elements still to match, the top a byte range), gives the mask of vocabulary
// tokens that keep the output a valid prefix, and advances on the chosen token.
//
// Stacks are hash-consed nodes (element, parent) in an arena, so a set of stacks is a sorted
// list of ids, and each distinct set is numbered as a state of a lazily built automaton whose
// byte transitions are memoised: after warm-up a byte costs one table lookup. The mask walks a
// trie of the vocabulary's byte strings (TokenTrie, built once per vocabulary) through that
// automaton, pruning every subtree whose prefix no stack accepts, and is kept per state (the
// inside of a JSON string comes back every few tokens).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "grammar/grammar.h"

namespace kiln::grammar {

// The vocabulary as the matcher sees it: each token's bytes (as llama_token_to_piece renders
// it; may end inside a UTF-8 character), whether it ends generation, and a trie over them.
// Tokens with no bytes that do not end generation (control tokens) are never allowed.
class TokenTrie {
 public:
  // pieces[id]: the token's bytes; eog: ids that end generation (allowed only when the
  // grammar is complete).
  TokenTrie(std::vector<std::string> pieces, std::span<const int32_t> eog);

  int32_t n_vocab() const { return static_cast<int32_t>(pieces_.size()); }
  const std::string& piece(int32_t id) const { return pieces_[static_cast<size_t>(id)]; }
  bool is_eog(int32_t id) const { return eog_[static_cast<size_t>(id)] != 0; }
  std::span<const int32_t> eog_ids() const { return eog_list_; }
  size_t max_piece_bytes() const { return max_piece_; }

 private:
  friend class Matcher;
  struct Node {
    uint32_t first_edge = 0, n_edges = 0;  // children: edges_[first_edge, +n_edges)
    uint32_t first_tok = 0, n_tok = 0;     // tokens whose bytes end here: toks_[...]
  };
  struct Edge {
    uint8_t byte;
    uint32_t child;
  };
  std::vector<std::string> pieces_;
  std::vector<uint8_t> eog_;
  std::vector<int32_t> eog_list_;
  std::vector<Node> nodes_;  // [0]: the root (empty prefix)
  std::vector<Edge> edges_;
  std::vector<int32_t> toks_;
  size_t max_piece_ = 0;
};

class Matcher {
 public:
  explicit Matcher(std::shared_ptr<const Grammar> g);

  // The output so far is a complete sentence of the grammar (end of generation allowed).
  bool accepting() const;
  // Some non-empty continuation exists. !can_continue() && accepting(): nothing more may be
  // generated; the request is complete.
  bool can_continue() const;

  // Would appending these bytes keep the output a valid prefix? (No visible state change.)
  bool accepts(std::string_view bytes) const;
  bool accepts_token(const TokenTrie& vocab, int32_t id) const;

  // allowed[id] = 1 for every token that keeps the output a valid prefix (and the
  // end-of-generation ids when accepting()), else 0. Returns how many are allowed.
  int32_t fill_mask(const TokenTrie& vocab, std::vector<uint8_t>& allowed);

  // The run of tokens the grammar forces from here: each the only token of the vocabulary
  // allowed after the ones before it (end of generation not allowed either), at most
  // max_tokens: a speculative step's drafts that plain decoding would produce whatever the
  // logits (a masked row with one token left). Empty when the next token is a choice.
  std::vector<int32_t> forced_tokens(const TokenTrie& vocab, size_t max_tokens) const;

  // Appends the token's bytes. Error (state unchanged) if the grammar does not allow them.
  Status advance(std::string_view bytes);
  Status advance_token(const TokenTrie& vocab, int32_t id);

 private:
  static constexpr uint32_t kNone = 0xFFFFFFFFu;    // no parent: the bottom of a stack
  static constexpr uint32_t kAccept = 0xFFFFFFFEu;  // the empty stack: grammar complete
  static constexpr uint32_t kDead = 0;              // the empty stack set: no continuation
  struct StackNode {
    uint32_t pos;     // element index: the next element to match (a kBytes on a top)
    uint32_t parent;  // the rest of the stack, or kNone
  };
  // Everything below is a cache of the grammar's lazily built automaton (hash-consed stack
  // nodes, stack sets numbered as DFA states, their byte transitions, masks per state): const
  // queries may extend it. Sets are numbered in order of discovery, so the automaton stays a
  // pure function of the grammar and the bytes seen.
  uint32_t intern(uint32_t pos, uint32_t parent) const;
  uint32_t intern_set(const std::vector<uint32_t>& stacks) const;
  // Adds the canonical stacks (top = a byte element, or kAccept) reached from "match the
  // element at pos, then the stack `parent`".
  void expand(uint32_t pos, uint32_t parent, std::vector<uint32_t>& out) const;
  // The state after one more byte (kDead when no stack takes it); memoised per (state, byte).
  uint32_t next(uint32_t set, uint8_t byte) const;
  // Allowed tokens under trie `node` from state `set`, stopping once two are found: n_found
  // grows by those found, `only` is the last one.
  void find_allowed(const TokenTrie& vocab, uint32_t node, uint32_t set, int32_t& only,
                    int32_t& n_found) const;
  void walk(const TokenTrie& vocab, uint32_t node, uint32_t set, std::vector<uint8_t>& allowed,
            int32_t& n_allowed);
  // Drops the cache (the mask walk may discover many states) keeping the current stacks.
  void reset_cache();

  std::shared_ptr<const Grammar> g_;
  std::span<const Element> el_;
  mutable std::vector<StackNode> nodes_;
  mutable std::unordered_map<uint64_t, uint32_t> index_;
  mutable std::vector<std::vector<uint32_t>> sets_;  // [state] sorted stack ids
  mutable std::unordered_map<std::string, uint32_t> set_index_;
  mutable std::vector<int32_t> trans_;  // [state * 256 + byte]: next state, -1 not yet known
  mutable std::vector<uint32_t> step_buf_;
  uint32_t cur_ = kDead;  // the current state
  // Masks of states already walked (a JSON string's inside repeats every few tokens).
  std::unordered_map<uint32_t, std::pair<std::vector<uint8_t>, int32_t>> masks_;
  const TokenTrie* masks_vocab_ = nullptr;
  static constexpr size_t kMaxMasks = 32;
  // Bounds on one byte's work: stacks in a state, expansion steps. Past them the state is
  // dead (a grammar that ambiguous is refused at the byte that gets there).
  static constexpr size_t kMaxStacks = 1024, kMaxExpand = 1 << 14;
  mutable bool overflow_ = false;                 // the current next() ran past a bound
  mutable std::unordered_set<size_t> ambiguous_;  // state * 256 + byte: overflowed transitions
};

}  // namespace kiln::grammar
