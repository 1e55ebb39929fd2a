// transfer/identity.cpp: canonical hashing of a GGUF's index and metadata for kvpack identity.
#include "transfer/identity.h"

#include <xxhash.h>

#include <cstring>
#include <string_view>

#include "core/check.h"
#include "core/dtype.h"

namespace kiln::transfer {
namespace {

constexpr std::string_view kTemplateKey = "tokenizer.chat_template";

// Streaming XXH3 over a typed, length-prefixed encoding (so "ab"+"c" != "a"+"bc").
class Hasher {
 public:
  Hasher() : s_(XXH3_createState()) {
    KILN_CHECK(s_ != nullptr);
    XXH3_64bits_reset(s_);
  }
  ~Hasher() { XXH3_freeState(s_); }
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;
  template <typename T>
  void pod(T v) {
    XXH3_64bits_update(s_, &v, sizeof v);
  }
  void str(std::string_view s) {
    pod<uint64_t>(s.size());
    XXH3_64bits_update(s_, s.data(), s.size());
  }
  void value(const GgufValue& v) {
    pod<uint32_t>(uint32_t(v.type));
    switch (v.v.index()) {
      case 0:
        pod(std::get<uint64_t>(v.v));
        break;
      case 1:
        pod(std::get<int64_t>(v.v));
        break;
      case 2:
        pod(std::get<double>(v.v));
        break;
      case 3:
        pod<uint8_t>(std::get<bool>(v.v));
        break;
      case 4:
        str(std::get<std::string>(v.v));
        break;
      case 5: {
        const GgufArray& a = std::get<GgufArray>(v.v);
        pod<uint32_t>(uint32_t(a.elem_type));
        pod<uint64_t>(a.items.size());
        for (const GgufValue& x : a.items) value(x);
        break;
      }
    }
  }
  uint64_t digest() const { return XXH3_64bits_digest(s_); }

 private:
  XXH3_state_t* s_;
};

bool is_tokenizer_key(std::string_view k) { return k.starts_with("tokenizer."); }

}  // namespace

kvpack::Identity identity_of(const Model& model) {
  const GgufFile& g = model.gguf();
  Hasher m, t, c;
  for (const TensorInfo& ti : g.tensors()) {
    m.str(ti.name);
    m.pod<uint32_t>(uint32_t(ti.dtype));
    m.pod<int32_t>(ti.n_dims);
    for (int64_t ne : ti.ne) m.pod(ne);
    m.pod(ti.offset);
  }
  bool has_template = false;
  for (const GgufKV& kv : g.metadata()) {
    if (kv.key == kTemplateKey) {
      c.value(kv.value);
      has_template = true;
    } else if (is_tokenizer_key(kv.key)) {
      t.str(kv.key);
      t.value(kv.value);
    } else {
      m.str(kv.key);
      m.value(kv.value);
    }
  }
  return kvpack::Identity{.engine_abi = kEngineAbiVersion,
                          .kv_dtype = uint32_t(DType::F16),
                          .model = m.digest(),
                          .tokenizer = t.digest(),
                          .chat_template = has_template ? c.digest() : 0};
}

kvpack::Identity identity_of(const Session& session) {
  kvpack::Identity id = identity_of(session.model());
  const model::Weights& w = session.model().weights();
  if (!w.rope_long.empty() && w.rope_freqs.empty()) {
    Hasher h;
    h.pod(id.model);
    h.str(session.rope_factors().data() == w.rope_long.data() ? "longrope long" : "longrope short");
    id.model = h.digest();
  }
  return id;
}

std::vector<kvpack::LayerKind> layer_kinds(const Model& model) {
  const model::HParams& hp = model.hparams();
  std::vector<kvpack::LayerKind> out;
  for (const model::LayerDesc& L : hp.layers)
    out.push_back({.width = hp.kv_k_width(),
                   .window = L.window,
                   .rope = L.use_rope,
                   .k_only = hp.kv_v_width() == 0});
  // Sparse attention: the full indexer layers' key rows (roped), after the attention layers,
  // as engine/session.cpp lays out the cache.
  for (const model::LayerDesc& L : hp.layers)
    if (L.indexer_kv >= 0)
      out.push_back({.width = hp.dsa.head_dim, .window = 0, .rope = true, .k_only = true});
  return out;
}

}  // namespace kiln::transfer
