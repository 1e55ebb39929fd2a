// tests/common/longrope_file.h: a phi3 file with LongRoPE factors, for the tests of the factor
// choice. The shipped phi3 fixture has none, so this copies it and adds two distinct sets
// (long[i] = 1 + 0.5 i, short[i] = 1 + 0.05 i), the original context and attn_factor 1.19.
// tests/golden/perplexity_peer.json's "longrope" figures are the peer's for this very file
// with original context 256.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "format/gguf.h"
#include "format/gguf_writer.h"

namespace kiln::testing {

struct LongRopeFile {
  std::vector<float> long_f, short_f;
  GgufWriter writer;  // refers to long_f, short_f and the source's tensor bytes
};

inline LongRopeFile phi3_with_longrope(const GgufFile& src, uint32_t original_context) {
  LongRopeFile f;
  const int32_t n_rot = *src.get<int32_t>("phi3.rope.dimension_count");
  f.long_f.resize(static_cast<size_t>(n_rot / 2));
  f.short_f.resize(f.long_f.size());
  for (size_t i = 0; i < f.long_f.size(); ++i) {
    f.long_f[i] = 1.0f + 0.5f * float(i);
    f.short_f[i] = 1.0f + 0.05f * float(i);
  }
  GgufWriter& w = f.writer;
  w.copy_metadata(src);
  w.set_u32("phi3.rope.scaling.original_context_length", original_context);
  w.set_f32("phi3.rope.scaling.attn_factor", 1.19f);
  for (const TensorInfo& t : src.tensors())
    w.add_tensor(t.name, t.dtype, std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims),
                 src.view(t).bytes);
  w.add_tensor("rope_factors_long.weight", DType::F32, {n_rot / 2},
               std::as_bytes(std::span<const float>(f.long_f)));
  w.add_tensor("rope_factors_short.weight", DType::F32, {n_rot / 2},
               std::as_bytes(std::span<const float>(f.short_f)));
  return f;
}

}  // namespace kiln::testing
