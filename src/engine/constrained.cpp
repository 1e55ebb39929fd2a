// engine/constrained.cpp: the vocabulary view and the constrained sampling step.
#include "engine/constrained.h"

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

int32_t Constraint::sample(Sampler& sampler, std::span<const float> logits) {
  if (sampler.params().temperature <= 0) {
    const int32_t id = sampler.sample(logits);
    if (matcher.accepts_token(*vocab, id)) return id;
  }
  if (matcher.fill_mask(*vocab, mask) == 0) return -1;
  return sampler.sample(logits, mask);
}

bool Constraint::accept(int32_t id) {
  const Status st = matcher.advance_token(*vocab, id);
  KILN_CHECK(st.is_ok(), "a token the mask allowed: {}", st.message());
  return matcher.accepting() && !matcher.can_continue();
}

}  // namespace kiln
