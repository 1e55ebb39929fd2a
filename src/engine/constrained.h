// engine/constrained.h: constrained decoding's engine side: the grammar's view of a
// tokenizer's vocabulary (built once per model) and one request's constrained sampling step.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "grammar/matcher.h"
#include "sampling/sampler.h"
#include "tokenizer/tokenizer.h"

namespace kiln {

// Each token's bytes as generated text renders them (control tokens as nothing, so a grammar
// never allows them) and the end-of-generation ids, with the trie the mask walks.
// `as_text`: control tokens that stand for text the grammar may require (a tool-call format's
// markers), given their text instead.
std::shared_ptr<const grammar::TokenTrie> make_token_trie(const Tokenizer& tok,
                                                          std::span<const int32_t> as_text = {});

// One request's grammar state and scratch.
struct Constraint {
  std::shared_ptr<const grammar::TokenTrie> vocab;
  grammar::Matcher matcher;
  std::vector<uint8_t> mask;  // [n_vocab] scratch
  std::vector<int32_t> ids;   // scratch: candidates, or the ids a sparse mask allows
  std::vector<float> vals;

  // The next id from one row of logits, sampled as `sampler` would from the row with every
  // token the grammar forbids removed (sampler.sample(logits, mask)); -1 when the grammar
  // allows none. The same id and RNG draws by a cheaper road where one exists:
  //  - a sampler that needs only the row's best k (greedy, top-k without bias or penalties;
  //    Sampler::candidates_needed) takes the row's best few; when k of them are allowed they
  //    are the masked row's best k, and one token's check is much cheaper than the mask;
  //  - otherwise the mask (cached per grammar state); when it allows few tokens, the sampler
  //    sees only those (Sampler::sample_among) instead of filtering the whole row.
  int32_t sample(Sampler& sampler, std::span<const float> logits);
  // Records the chosen id. The request is complete when this returns true (the grammar
  // accepts the output and allows nothing after it).
  bool accept(int32_t id);
  // Up to max_tokens tokens spelling the bytes the grammar forces next (a speculative
  // step's drafts; see grammar::Matcher::forced_tokens). Empty when nothing is forced.
  std::vector<int32_t> forced(size_t max_tokens) const {
    return matcher.forced_tokens(*vocab, max_tokens);
  }
};

// One verify step over tokens the grammar forced (Constraint::forced), shared by `kiln run`
// and the scheduler: rows ([k + 1][n_vocab]) are the logits after each token of the step's
// input [last, drafts...]. Row i is sampled through the grammar exactly as a plain step after
// the tokens before it would sample it, then handed to `emit`, which records it as plain
// decoding does (Sampler::accept, Constraint::accept) and returns false when the generation
// ends there. A draft stands while the samples agree with it, so the ids and RNG draws are
// plain decoding's. Once emit returns false, neither `c` nor `sampler` is touched again (the
// caller may have freed them).
struct ForcedVerdict {
  int32_t n_accepted = 0;  // drafts kept: rows [0, 1 + n_accepted) of the step stay
  bool dead_end = false;   // the grammar allowed no token for the next row
};
ForcedVerdict verify_forced(
    Constraint& c, Sampler& sampler, std::span<const float> rows, std::span<const int32_t> drafts,
    const std::function<bool(int32_t id, std::span<const float> row)>& emit);

}  // namespace kiln
