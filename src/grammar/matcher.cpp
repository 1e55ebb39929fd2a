// grammar/matcher.cpp: the vocabulary trie and the pushdown matcher (see matcher.h).
#include "grammar/matcher.h"

#include <algorithm>
#include <numeric>
#include <unordered_set>

namespace kiln::grammar {

// ---------------------------------------------------------------- TokenTrie

TokenTrie::TokenTrie(std::vector<std::string> pieces, std::span<const int32_t> eog)
    : pieces_(std::move(pieces)), eog_(pieces_.size(), 0) {
  for (int32_t id : eog)
    if (id >= 0 && static_cast<size_t>(id) < pieces_.size() && !eog_[static_cast<size_t>(id)]) {
      eog_[static_cast<size_t>(id)] = 1;
      eog_list_.push_back(id);
    }
  // Insert in byte order: a node's next child is then always its last one or a new one.
  std::vector<int32_t> ids;
  for (size_t i = 0; i < pieces_.size(); ++i)
    if (!eog_[i] && !pieces_[i].empty()) ids.push_back(static_cast<int32_t>(i));
  std::stable_sort(ids.begin(), ids.end(),
                   [&](int32_t a, int32_t b) { return pieces_[size_t(a)] < pieces_[size_t(b)]; });
  struct Build {
    std::vector<Edge> kids;
    std::vector<int32_t> toks;
  };
  std::vector<Build> b(1);
  for (int32_t id : ids) {
    uint32_t node = 0;
    for (char ch : pieces_[static_cast<size_t>(id)]) {
      const auto c = static_cast<uint8_t>(ch);
      auto& kids = b[node].kids;
      if (kids.empty() || kids.back().byte != c) {
        kids.push_back({c, static_cast<uint32_t>(b.size())});
        const uint32_t child = kids.back().child;
        b.emplace_back();  // invalidates `kids`
        node = child;
      } else {
        node = kids.back().child;
      }
    }
    b[node].toks.push_back(id);
    max_piece_ = std::max(max_piece_, pieces_[static_cast<size_t>(id)].size());
  }
  nodes_.resize(b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    nodes_[i].first_edge = static_cast<uint32_t>(edges_.size());
    nodes_[i].n_edges = static_cast<uint32_t>(b[i].kids.size());
    edges_.insert(edges_.end(), b[i].kids.begin(), b[i].kids.end());
    nodes_[i].first_tok = static_cast<uint32_t>(toks_.size());
    nodes_[i].n_tok = static_cast<uint32_t>(b[i].toks.size());
    toks_.insert(toks_.end(), b[i].toks.begin(), b[i].toks.end());
  }
}

// ---------------------------------------------------------------- Matcher

Matcher::Matcher(std::shared_ptr<const Grammar> g) : g_(std::move(g)), el_(g_->elements()) {
  sets_.emplace_back();  // state 0: dead
  trans_.assign(256, static_cast<int32_t>(kDead));
  std::vector<uint32_t> start;
  for (uint32_t a : g_->alternatives(g_->root())) expand(a, kNone, start);
  cur_ = intern_set(start);
}

uint32_t Matcher::intern(uint32_t pos, uint32_t parent) const {
  const uint64_t key = (uint64_t{pos} << 32) | parent;
  auto [it, fresh] = index_.try_emplace(key, static_cast<uint32_t>(nodes_.size()));
  if (fresh) nodes_.push_back({pos, parent});
  return it->second;
}

uint32_t Matcher::intern_set(const std::vector<uint32_t>& stacks) const {
  if (stacks.empty()) return kDead;
  std::vector<uint32_t> v(stacks);
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  std::string key(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(uint32_t));
  auto [it, fresh] = set_index_.try_emplace(std::move(key), static_cast<uint32_t>(sets_.size()));
  if (fresh) {
    sets_.push_back(std::move(v));
    trans_.resize(trans_.size() + 256, -1);
  }
  return it->second;
}

void Matcher::expand(uint32_t pos0, uint32_t parent0, std::vector<uint32_t>& out) const {
  // Iterative (a chain of rules that each start with the next must not exhaust the C++
  // stack). The grammar has no left recursion, so this ends; the same (pos, parent) can still
  // be reached along many nullable paths, so past a few items a visited set cuts repeats.
  thread_local std::vector<std::pair<uint32_t, uint32_t>> work;
  thread_local std::unordered_set<uint64_t> seen;
  work.clear();
  work.push_back({pos0, parent0});
  size_t n_done = 0;
  bool dedup = false;
  while (!work.empty()) {
    auto [pos, parent] = work.back();
    work.pop_back();
    if (++n_done == 64) {
      dedup = true;
      seen.clear();
    }
    if (dedup && !seen.insert((uint64_t{pos} << 32) | parent).second) continue;
    if (n_done > kMaxExpand || out.size() > kMaxStacks) {
      overflow_ = true;
      return;
    }
    for (;;) {
      const Element& e = el_[pos];
      if (e.kind == Element::kEnd) {
        if (parent == kNone) {
          out.push_back(kAccept);
          break;
        }
        pos = nodes_[parent].pos;
        parent = nodes_[parent].parent;
        continue;
      }
      if (e.kind == Element::kBytes) {
        out.push_back(intern(pos, parent));
        break;
      }
      // A rule: its alternatives, each continued by what follows the reference (a tail
      // reference continues with the parent directly, so x* runs in constant depth).
      const uint32_t cont = el_[pos + 1].kind == Element::kEnd ? parent : intern(pos + 1, parent);
      for (uint32_t a : g_->alternatives(e.rule)) work.push_back({a, cont});
      break;
    }
  }
}

uint32_t Matcher::next(uint32_t set, uint8_t byte) const {
  const int32_t known = trans_[size_t(set) * 256 + byte];
  if (known >= 0) return static_cast<uint32_t>(known);
  step_buf_.clear();
  overflow_ = false;
  for (uint32_t s : sets_[set]) {
    if (s == kAccept) continue;
    const StackNode n = nodes_[s];
    const Element& e = el_[n.pos];
    if (byte >= e.lo && byte <= e.hi) expand(n.pos + 1, n.parent, step_buf_);
    if (overflow_) break;
  }
  // Too ambiguous a grammar (nested repetitions of one thing): the state is dead rather than
  // unbounded work per byte; ambiguous_ makes advance() say why.
  if (overflow_) {
    ambiguous_.insert(size_t(set) * 256 + byte);
    step_buf_.clear();
  }
  const uint32_t id = intern_set(step_buf_);  // may grow trans_: index it afresh
  trans_[size_t(set) * 256 + byte] = static_cast<int32_t>(id);
  return id;
}

bool Matcher::accepting() const { return !sets_[cur_].empty() && sets_[cur_].back() == kAccept; }

bool Matcher::can_continue() const {
  return !sets_[cur_].empty() && sets_[cur_].front() != kAccept;
}

bool Matcher::accepts(std::string_view bytes) const {
  uint32_t s = cur_;
  for (char c : bytes) {
    s = next(s, static_cast<uint8_t>(c));
    if (s == kDead) return false;
  }
  return true;
}

bool Matcher::accepts_token(const TokenTrie& vocab, int32_t id) const {
  if (id < 0 || id >= vocab.n_vocab()) return false;
  if (vocab.is_eog(id)) return accepting();
  const std::string& p = vocab.piece(id);
  return !p.empty() && accepts(p);
}

int32_t Matcher::fill_mask(const TokenTrie& vocab, std::vector<uint8_t>& allowed) {
  if (masks_vocab_ != &vocab) {
    masks_.clear();
    masks_vocab_ = &vocab;
  }
  if (auto it = masks_.find(cur_); it != masks_.end()) {
    allowed = it->second.first;
    return it->second.second;
  }
  allowed.assign(static_cast<size_t>(vocab.n_vocab()), 0);
  int32_t n_allowed = 0;
  if (accepting())
    for (int32_t id : vocab.eog_ids()) {
      allowed[static_cast<size_t>(id)] = 1;
      ++n_allowed;
    }
  if (can_continue()) walk(vocab, 0, cur_, allowed, n_allowed);
  if (masks_.size() >= kMaxMasks) masks_.clear();
  masks_[cur_] = {allowed, n_allowed};
  if (nodes_.size() > (1u << 20) || sets_.size() > (1u << 16)) reset_cache();
  return n_allowed;
}

void Matcher::walk(const TokenTrie& vocab, uint32_t node, uint32_t set,
                   std::vector<uint8_t>& allowed, int32_t& n_allowed) {
  const TokenTrie::Node& tn = vocab.nodes_[node];
  for (uint32_t k = 0; k < tn.n_edges; ++k) {
    const TokenTrie::Edge& e = vocab.edges_[tn.first_edge + k];
    const uint32_t ns = next(set, e.byte);
    if (ns == kDead) continue;  // no token below this prefix can be allowed
    const TokenTrie::Node& child = vocab.nodes_[e.child];
    for (uint32_t t = 0; t < child.n_tok; ++t) {
      allowed[static_cast<size_t>(vocab.toks_[child.first_tok + t])] = 1;
      ++n_allowed;
    }
    if (child.n_edges > 0) walk(vocab, e.child, ns, allowed, n_allowed);
  }
}

Status Matcher::advance(std::string_view bytes) {
  uint32_t s = cur_;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const uint32_t from = s;
    s = next(s, static_cast<uint8_t>(bytes[i]));
    if (s == kDead && ambiguous_.count(size_t(from) * 256 + static_cast<uint8_t>(bytes[i])))
      return Status::errorf(
          "grammar: too ambiguous: more than {} parse stacks or {} expansions for one byte",
          kMaxStacks, kMaxExpand);
    if (s == kDead)
      return Status::errorf("grammar: byte {} of {} (0x{:02x}) does not continue the grammar", i,
                            bytes.size(), static_cast<uint8_t>(bytes[i]));
  }
  cur_ = s;
  if (nodes_.size() > (1u << 20) || sets_.size() > (1u << 16)) reset_cache();
  return Status::ok();
}

Status Matcher::advance_token(const TokenTrie& vocab, int32_t id) {
  if (id < 0 || id >= vocab.n_vocab())
    return Status::errorf("grammar: token {} is outside the vocabulary", id);
  if (vocab.is_eog(id)) {
    if (!accepting())
      return Status::errorf("grammar: end of generation (token {}) before the grammar is complete",
                            id);
    cur_ = intern_set({kAccept});
    return Status::ok();
  }
  if (vocab.piece(id).empty())
    return Status::errorf("grammar: token {} has no text (a control token)", id);
  return advance(vocab.piece(id));
}

void Matcher::find_allowed(const TokenTrie& vocab, uint32_t node, uint32_t set, int32_t& only,
                           int32_t& n_found) const {
  const TokenTrie::Node& tn = vocab.nodes_[node];
  for (uint32_t k = 0; k < tn.n_edges && n_found < 2; ++k) {
    const TokenTrie::Edge& e = vocab.edges_[tn.first_edge + k];
    const uint32_t ns = next(set, e.byte);
    if (ns == kDead) continue;
    const TokenTrie::Node& child = vocab.nodes_[e.child];
    if (child.n_tok > 0) {
      only = vocab.toks_[child.first_tok];
      n_found += static_cast<int32_t>(child.n_tok);
    }
    if (child.n_edges > 0 && n_found < 2) find_allowed(vocab, e.child, ns, only, n_found);
  }
}

std::vector<int32_t> Matcher::forced_tokens(const TokenTrie& vocab, size_t max_tokens) const {
  std::vector<int32_t> out;
  uint32_t s = cur_;
  while (out.size() < max_tokens) {
    // Complete output: end of generation is allowed too, so nothing is forced.
    if (sets_[s].empty() || sets_[s].back() == kAccept) break;
    int32_t only = -1, n_found = 0;
    find_allowed(vocab, 0, s, only, n_found);
    if (n_found != 1) break;
    out.push_back(only);
    for (char c : vocab.piece(only)) s = next(s, static_cast<uint8_t>(c));
  }
  return out;
}

void Matcher::reset_cache() {
  // Each current stack as its chain of positions, top first; then a fresh cache holding them.
  std::vector<std::vector<uint32_t>> chains;
  bool accept = false;
  for (uint32_t s : sets_[cur_]) {
    if (s == kAccept) {
      accept = true;
      continue;
    }
    std::vector<uint32_t> chain;
    for (uint32_t n = s; n != kNone; n = nodes_[n].parent) chain.push_back(nodes_[n].pos);
    chains.push_back(std::move(chain));
  }
  nodes_.clear();
  index_.clear();
  sets_.assign(1, {});
  set_index_.clear();
  trans_.assign(256, static_cast<int32_t>(kDead));
  masks_.clear();
  ambiguous_.clear();
  std::vector<uint32_t> stacks;
  for (const auto& chain : chains) {
    uint32_t parent = kNone;
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) parent = intern(*it, parent);
    stacks.push_back(parent);
  }
  if (accept) stacks.push_back(kAccept);
  cur_ = intern_set(stacks);
}

}  // namespace kiln::grammar
