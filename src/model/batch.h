// model/batch.h: checks shared by every way of evaluating tokens (fast session, reference).
#pragma once

#include <cstdint>
#include <span>

#include "core/status.h"
#include "model/hparams.h"

namespace kiln::model {

// Empty batch, token id outside [0, n_vocab), or n_pos + n > n_ctx: an error naming the
// numbers. Nothing is evaluated when this fails.
inline Status validate_batch(const HParams& hp, std::span<const int32_t> tokens, int32_t n_pos,
                             int32_t n_ctx) {
  if (tokens.empty()) return Status::error("empty input: no tokens to evaluate");
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= hp.n_vocab)
      return Status::errorf("token id {} at index {} is outside the vocabulary [0, {})", tokens[i],
                            i, hp.n_vocab);
  if (static_cast<int64_t>(n_pos) + static_cast<int64_t>(tokens.size()) > n_ctx)
    return Status::errorf("context overflow: {} positions used + {} new tokens > n_ctx {}", n_pos,
                          tokens.size(), n_ctx);
  return Status::ok();
}

}  // namespace kiln::model
