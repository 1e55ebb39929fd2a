// engine/constrained.cpp: the vocabulary view and the constrained sampling step.
#include "engine/constrained.h"

#include <limits>

#include "core/check.h"

namespace kiln {

std::shared_ptr<const grammar::TokenTrie> make_token_trie(const Tokenizer& tok,
                                                          std::span<const int32_t> as_text) {
  std::vector<std::string> pieces(static_cast<size_t>(tok.n_vocab()));
  for (int32_t id = 0; id < tok.n_vocab(); ++id)
    pieces[static_cast<size_t>(id)] = tok.token_to_piece(id, /*special=*/false);
  for (int32_t id : as_text)
    if (id >= 0 && id < tok.n_vocab())
      pieces[static_cast<size_t>(id)] = tok.token_to_piece(id, /*special=*/true);
  return std::make_shared<const grammar::TokenTrie>(std::move(pieces), tok.eog_ids());
}

namespace {

// The m best (logit descending, id ascending on ties: the sampler's order) of a row, sorted.
void best_of_row(std::span<const float> logits, size_t m, std::vector<int32_t>& ids,
                 std::vector<float>& vals) {
  ids.clear();
  vals.clear();
  for (size_t i = 0; i < logits.size(); ++i) {
    const float v = logits[i];
    // Ids arrive ascending, so a tie with the last kept one ranks after it.
    if (ids.size() == m && !(v > vals.back())) continue;
    if (ids.size() == m) {
      ids.pop_back();
      vals.pop_back();
    }
    size_t at = vals.size();
    while (at > 0 && v > vals[at - 1]) --at;
    ids.insert(ids.begin() + ptrdiff_t(at), static_cast<int32_t>(i));
    vals.insert(vals.begin() + ptrdiff_t(at), v);
  }
}

// Best candidates looked at per needed one before falling back to the mask; extra room for the
// few a grammar forbids where it allows almost everything (inside a JSON string).
constexpr size_t kSlack = 16;

}  // namespace

int32_t Constraint::sample(Sampler& sampler, std::span<const float> logits) {
  const int32_t need = sampler.candidates_needed(std::numeric_limits<int32_t>::max());
  if (need > 0 && size_t(need) + kSlack < logits.size()) {
    best_of_row(logits, size_t(need) + kSlack, ids, vals);
    size_t n = 0;
    for (size_t i = 0; i < ids.size() && n < size_t(need); ++i)
      if (matcher.accepts_token(*vocab, ids[i])) {
        ids[n] = ids[i];
        vals[n] = vals[i];
        ++n;
      }
    // Every better candidate of the row is forbidden, so these are the masked row's best.
    if (n == size_t(need))
      return sampler.sample_top(std::span(ids).first(n), std::span(vals).first(n));
  } else if (sampler.params().temperature <= 0) {
    // Greedy after bias or penalties: when the grammar allows the pick, it is the masked
    // row's pick too.
    const int32_t id = sampler.sample(logits);
    if (matcher.accepts_token(*vocab, id)) return id;
  }
  const int32_t n_allowed = matcher.fill_mask(*vocab, mask);
  if (n_allowed == 0) return -1;
  if (size_t(n_allowed) * 8 < mask.size()) {
    ids.clear();
    for (size_t i = 0; i < mask.size(); ++i)
      if (mask[i]) ids.push_back(static_cast<int32_t>(i));
    return sampler.sample_among(logits, ids);
  }
  return sampler.sample(logits, mask);
}

bool Constraint::accept(int32_t id) {
  const Status st = matcher.advance_token(*vocab, id);
  KILN_CHECK(st.is_ok(), "a token the mask allowed: {}", st.message());
  return matcher.accepting() && !matcher.can_continue();
}

ForcedVerdict verify_forced(
    Constraint& c, Sampler& sampler, std::span<const float> rows, std::span<const int32_t> drafts,
    const std::function<bool(int32_t id, std::span<const float> row)>& emit) {
  const size_t k = drafts.size();
  KILN_CHECK(rows.size() % (k + 1) == 0, "verify rows {} for {} drafts", rows.size(), k);
  const size_t V = rows.size() / (k + 1);
  ForcedVerdict v;
  for (size_t i = 0; i <= k; ++i) {
    const auto row = rows.subspan(i * V, V);
    const int32_t id = c.sample(sampler, row);
    if (id < 0) {
      v.dead_end = true;
      return v;
    }
    const bool agree = i < k && id == drafts[i];
    if (!emit(id, row)) {
      if (agree) ++v.n_accepted;  // its row was evaluated: it stays
      return v;
    }
    if (!agree) return v;
    ++v.n_accepted;
  }
  return v;
}

}  // namespace kiln
