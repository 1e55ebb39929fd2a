// transfer/identity.h: who a kvpack belongs to: the identity and layer kinds of a loaded
// model, as kv/kvpack.h compares them, plus the engine ABI version.
#pragma once

#include <vector>

#include "engine/session.h"
#include "kv/kvpack.h"

namespace kiln::transfer {

// Bumped whenever the meaning of a KV row changes (RoPE convention, K/V layout, scaling folded
// into K, dtype of the planes): packs from another version are refused, never reinterpreted.
// 2: K rows of models with rope frequency factors (Llama 3 rope_freqs) are rotated by them;
// version 1 ignored the factors.
// 3: a layer's rows may be latent rows [c_kv | k_pe] with no V rows (latent attention).
inline constexpr uint32_t kEngineAbiVersion = 3;

// Fingerprints of the model's GGUF: the tensor index (names, dtypes, shapes, offsets) with
// every metadata key outside tokenizer.*; the tokenizer.* keys except the chat template; the
// chat template text. Hashing is over a canonical encoding of the parsed values, so two files
// with the same content hash alike.
kvpack::Identity identity_of(const Model& model);
// identity_of(session.model()), and for a LongRoPE model the factor set the session's context
// chose (its K rows are rotated by it): a pack made with the short set is refused by a session
// that uses the long one, and the other way round.
kvpack::Identity identity_of(const Session& session);
std::vector<kvpack::LayerKind> layer_kinds(const Model& model);

}  // namespace kiln::transfer
