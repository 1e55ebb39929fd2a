// tests/model/model_load_test.cpp: hyper-parameters and weight binding from real fixtures, and
// every bad-input path of Model::load / Session::eval (crafted GGUFs from GgufWriter).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "backend/backend.h"
#include "common/testdata.h"
#include "core/check.h"
#include "engine/session.h"
#include "format/gguf_writer.h"
#include "model/reference.h"

namespace kiln {
namespace {

using testing::model_path;

std::shared_ptr<const Model> load_ok(const std::string& file) {
  auto m = Model::load(model_path(file));
  EXPECT_TRUE(m.has_value()) << m.error();
  return m.has_value() ? *m : nullptr;
}

TEST(ModelLoad, HParamsFollowMetadata) {
  auto m = load_ok("stories260K.gguf");
  ASSERT_TRUE(m);
  const GgufFile& g = m->gguf();
  const model::HParams& hp = m->hparams();
  EXPECT_EQ(hp.arch_name, "llama");
  EXPECT_EQ(hp.n_embd, *g.get<int32_t>("llama.embedding_length"));
  EXPECT_EQ(hp.n_layer, *g.get<int32_t>("llama.block_count"));
  EXPECT_EQ(hp.n_head, *g.get<int32_t>("llama.attention.head_count"));
  EXPECT_EQ(hp.n_head_kv, *g.get<int32_t>("llama.attention.head_count_kv"));
  EXPECT_EQ(hp.n_rot, *g.get<int32_t>("llama.rope.dimension_count"));
  EXPECT_EQ(hp.head_dim_k, hp.n_embd / hp.n_head);  // no key_length key: llama.cpp's default
  EXPECT_EQ(hp.n_vocab, g.find_tensor("token_embd.weight")->ne[1]);
  ASSERT_EQ(static_cast<int32_t>(hp.layers.size()), hp.n_layer);
  for (const model::LayerDesc& L : hp.layers) {
    EXPECT_EQ(L.kind, model::AttnKind::Full);
    EXPECT_TRUE(L.use_rope);
    EXPECT_EQ(L.rope.style, RopeStyle::Normal);
    EXPECT_FLOAT_EQ(L.rope.freq_base, 10000.0f);  // llama.cpp's default when the key is absent
  }
  EXPECT_FALSE(m->weights().tied_output);
}

TEST(ModelLoad, Qwen3IsNeoxWithQkNormAndTiedOutput) {
  auto m = load_ok("qwen3-bpe-f16.gguf");
  ASSERT_TRUE(m);
  const model::HParams& hp = m->hparams();
  EXPECT_EQ(hp.head_dim_k, *m->gguf().get<int32_t>("qwen3.attention.key_length"));
  EXPECT_FLOAT_EQ(hp.layers[0].rope.freq_base, *m->gguf().get<float>("qwen3.rope.freq_base"));
  EXPECT_EQ(hp.layers[0].rope.style, RopeStyle::NeoX);
  EXPECT_TRUE(m->weights().tied_output);
  EXPECT_EQ(m->weights().output.bytes.data(), m->weights().token_embd.bytes.data());
  EXPECT_EQ(m->weights().layers[1].q_norm.size(), size_t(hp.head_dim_k));
}

// Per-layer kinds as data: gemma3's 5 local : 1 global pattern, window and local RoPE base.
TEST(ModelLoad, Gemma3LayerKinds) {
  auto m = load_ok("gemma3-swa-f16.gguf");
  ASSERT_TRUE(m);
  const GgufFile& g = m->gguf();
  const int32_t window = *g.get<int32_t>("gemma3.attention.sliding_window");
  const float base = *g.get<float>("gemma3.rope.freq_base");
  const float base_swa = *g.get<float>("gemma3.rope.freq_base_swa");
  const model::HParams& hp = m->hparams();
  int n_sliding = 0;
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    const model::LayerDesc& L = hp.layers[il];
    const bool global = il % 6 == 5;
    EXPECT_EQ(L.kind, global ? model::AttnKind::Full : model::AttnKind::Sliding) << il;
    EXPECT_EQ(L.window, global ? 0 : window) << il;
    EXPECT_FLOAT_EQ(L.rope.freq_base, global ? base : base_swa) << il;
    EXPECT_TRUE(L.use_rope);
    n_sliding += L.kind == model::AttnKind::Sliding;
  }
  EXPECT_EQ(n_sliding, 5);
  EXPECT_FLOAT_EQ(hp.embd_scale, std::sqrt(float(hp.n_embd)));
}

TEST(ModelLoad, Gemma2AlternatesAndSoftcaps) {
  auto m = load_ok("gemma2-swa-f16.gguf");
  ASSERT_TRUE(m);
  const model::HParams& hp = m->hparams();
  for (int32_t il = 0; il < hp.n_layer; ++il)
    EXPECT_EQ(hp.layers[il].kind, il % 2 == 0 ? model::AttnKind::Sliding : model::AttnKind::Full);
  EXPECT_FLOAT_EQ(hp.attn_softcap, *m->gguf().get<float>("gemma2.attn_logit_softcapping"));
  EXPECT_FLOAT_EQ(hp.final_softcap, *m->gguf().get<float>("gemma2.final_logit_softcapping"));
  EXPECT_FALSE(m->weights().layers[0].post_ffn_norm.empty());
}

TEST(ModelLoad, MixtralLayoutBindsExperts) {
  auto m = load_ok("mixtral-q4_k_m.gguf");
  ASSERT_TRUE(m);
  const model::HParams& hp = m->hparams();
  const int32_t n_expert = *m->gguf().get<int32_t>("llama.expert_count");
  for (const model::LayerDesc& L : hp.layers) {
    EXPECT_EQ(L.n_expert, n_expert);
    EXPECT_EQ(L.n_expert_used, *m->gguf().get<int32_t>("llama.expert_used_count"));
    // No expert_feed_forward_length key: llama.cpp uses feed_forward_length.
    EXPECT_EQ(L.n_ff_expert, *m->gguf().get<int32_t>("llama.feed_forward_length"));
    EXPECT_EQ(L.n_ff, 0);
  }
  ASSERT_NE(m->weights().experts, nullptr);
  EXPECT_EQ(m->weights().experts->n_expert(0), n_expert);
}

TEST(ModelLoad, ExpertSlicesAreViewsOfTheStackedTensors) {
  auto m = load_ok("qwen3moe-f16.gguf");
  ASSERT_TRUE(m);
  const model::HParams& hp = m->hparams();
  const model::LayerDesc& L = hp.layers[2];
  EXPECT_EQ(L.n_ff_expert, *m->gguf().get<int32_t>("qwen3moe.expert_feed_forward_length"));
  const TensorInfo* up = m->gguf().find_tensor("blk.2.ffn_up_exps.weight");
  const TensorInfo* down = m->gguf().find_tensor("blk.2.ffn_down_exps.weight");
  ASSERT_TRUE(up && down);
  const auto up_bytes = m->gguf().view(*up).bytes, down_bytes = m->gguf().view(*down).bytes;
  for (int32_t e = 0; e < L.n_expert; ++e) {
    const moe::ExpertWeights ew = m->weights().experts->get(2, e);
    EXPECT_EQ(ew.up.n_rows, L.n_ff_expert);
    EXPECT_EQ(ew.up.n_cols, hp.n_embd);
    EXPECT_EQ(ew.down.n_rows, hp.n_embd);
    EXPECT_EQ(ew.down.n_cols, L.n_ff_expert);
    // Expert e is the e-th contiguous block of the 3-D tensor, not a copy.
    EXPECT_EQ(ew.up.bytes.data(), up_bytes.data() + e * up_bytes.size() / L.n_expert);
    EXPECT_EQ(ew.down.bytes.data(), down_bytes.data() + e * down_bytes.size() / L.n_expert);
    EXPECT_EQ(ew.up.bytes.size(), up_bytes.size() / L.n_expert);
  }
}

TEST(ModelLoad, MuseGlimmerLayerPattern) {
  auto m = load_ok("muse-glimmer-f16.gguf");
  ASSERT_TRUE(m);
  const model::HParams& hp = m->hparams();
  const int32_t window = *m->gguf().get<int32_t>("muse-glimmer.attention.sliding_window");
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    const bool global = il % 4 == 3;  // [SWA+RoPE x3, full+NoPE]
    EXPECT_EQ(hp.layers[il].kind, global ? model::AttnKind::Full : model::AttnKind::Sliding);
    EXPECT_EQ(hp.layers[il].window, global ? 0 : window);
    EXPECT_EQ(hp.layers[il].use_rope, !global);
    EXPECT_EQ(m->weights().layers[il].wgate_attn.n_rows, hp.o_width());
  }
  EXPECT_FLOAT_EQ(hp.post_norm_eps, 1e-8f);
  EXPECT_FLOAT_EQ(hp.logit_scale, *m->gguf().get<float>("muse-glimmer.logit_scale"));
}

// glm4moe: heads x head_dim != n_embd, partial NeoX rope, a leading dense layer, then MoE
// layers with the sigmoid router, selection bias and a shared expert; the NextN block at the
// end of block_count is bound (every tensor used) but is not a main-pass layer.
TEST(ModelLoad, Glm4MoeLayoutAndNextnBlock) {
  auto m = load_ok("glm4moe-f16.gguf");
  ASSERT_TRUE(m);
  const GgufFile& g = m->gguf();
  const model::HParams& hp = m->hparams();
  const int32_t blocks = *g.get<int32_t>("glm4moe.block_count");
  const int32_t nextn = *g.get<int32_t>("glm4moe.nextn_predict_layers");
  ASSERT_EQ(nextn, 1);
  EXPECT_EQ(hp.n_layer, blocks - nextn);
  ASSERT_EQ(hp.layers.size(), size_t(hp.n_layer));
  ASSERT_EQ(hp.nextn_layers.size(), size_t(nextn));
  EXPECT_NE(hp.q_width(), hp.n_embd);
  EXPECT_EQ(hp.n_rot, 32);
  EXPECT_EQ(hp.layers[0].rope.style, RopeStyle::NeoX);
  EXPECT_EQ(hp.router.gating, model::GatingFunc::Sigmoid);
  EXPECT_TRUE(hp.router.norm_weights);
  EXPECT_FLOAT_EQ(hp.router.weights_scale, 2.5f);
  EXPECT_EQ(hp.layers[0].n_expert, 0);  // leading_dense_block_count 1
  EXPECT_EQ(hp.layers[0].n_ff, *g.get<int32_t>("glm4moe.feed_forward_length"));
  for (int32_t il = 1; il < hp.n_layer; ++il) {
    EXPECT_EQ(hp.layers[il].n_expert, 8);
    EXPECT_EQ(hp.layers[il].n_ff_shexp, 128);
    EXPECT_EQ(m->weights().layers[il].exp_probs_b.size(), 8u);
    EXPECT_EQ(m->weights().layers[il].ffn_gate_shexp.n_rows, 128);
  }
  EXPECT_EQ(hp.nextn_layers[0].n_expert, 8);
  ASSERT_EQ(m->weights().nextn.size(), 1u);
  const model::NextnWeights& nw = m->weights().nextn[0];
  EXPECT_EQ(nw.eh_proj.n_cols, 2 * hp.n_embd);
  EXPECT_EQ(nw.embed_tokens.n_rows, hp.n_vocab);
  EXPECT_EQ(nw.shared_head_head.n_rows, hp.n_vocab);
  ASSERT_TRUE(m->weights().nextn_experts);
  EXPECT_EQ(m->weights().experts->n_layer(), hp.n_layer);
}

TEST(ModelLoad, WeightsAreViewsIntoTheMapping) {
  auto m = load_ok("llama-gqa-q4_k_m.gguf");
  ASSERT_TRUE(m);
  const auto bytes = m->gguf().mapping()->bytes();
  auto inside = [&](std::span<const std::byte> s) {
    return s.data() >= bytes.data() && s.data() + s.size() <= bytes.data() + bytes.size();
  };
  for (const model::LayerWeights& lw : m->weights().layers) {
    EXPECT_TRUE(inside(lw.wq.bytes));
    EXPECT_TRUE(inside(lw.ffn_down.bytes));
    EXPECT_TRUE(inside(std::as_bytes(lw.attn_norm)));  // f32 norm: a view, not a copy
  }
  EXPECT_TRUE(m->weights().owned.empty());
}

// phi3's fused attn_qkv and ffn_up are bound as row views of the one tensor (q | k | v and
// gate | up), not copies; its attention.sliding_window (2047) is not applied, as in llama.cpp.
TEST(ModelLoad, Phi3FusedTensorsAreRowViews) {
  auto m = load_ok("phi3-q4_k_m.gguf");
  ASSERT_TRUE(m);
  const model::HParams& hp = m->hparams();
  EXPECT_EQ(hp.layers[0].rope.style, RopeStyle::NeoX);
  EXPECT_EQ(hp.n_rot, *m->gguf().get<int32_t>("phi3.rope.dimension_count"));
  EXPECT_TRUE(m->gguf().has("phi3.attention.sliding_window"));
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    const model::LayerDesc& L = hp.layers[il];
    EXPECT_EQ(L.kind, model::AttnKind::Full);
    EXPECT_EQ(L.window, 0);
    const model::LayerWeights& lw = m->weights().layers[il];
    const TensorInfo* qkv = m->gguf().find_tensor(fmt::format("blk.{}.attn_qkv.weight", il));
    const TensorInfo* up = m->gguf().find_tensor(fmt::format("blk.{}.ffn_up.weight", il));
    ASSERT_TRUE(qkv && up);
    const auto qkv_bytes = m->gguf().view(*qkv).bytes, up_bytes = m->gguf().view(*up).bytes;
    const size_t qkv_row = qkv_bytes.size() / static_cast<size_t>(qkv->ne[1]);
    EXPECT_EQ(lw.wq.n_rows, hp.q_width());
    EXPECT_EQ(lw.wk.n_rows, hp.k_width());
    EXPECT_EQ(lw.wv.n_rows, hp.v_width());
    EXPECT_EQ(lw.wq.bytes.data(), qkv_bytes.data());
    EXPECT_EQ(lw.wk.bytes.data(), qkv_bytes.data() + hp.q_width() * qkv_row);
    EXPECT_EQ(lw.wv.bytes.data(), qkv_bytes.data() + (hp.q_width() + hp.k_width()) * qkv_row);
    EXPECT_EQ(lw.wv.bytes.data() + lw.wv.bytes.size(), qkv_bytes.data() + qkv_bytes.size());
    EXPECT_EQ(lw.ffn_gate.n_rows, L.n_ff);
    EXPECT_EQ(lw.ffn_up.n_rows, L.n_ff);
    EXPECT_EQ(lw.ffn_gate.bytes.data(), up_bytes.data());
    EXPECT_EQ(lw.ffn_up.bytes.data(), up_bytes.data() + up_bytes.size() / 2);
    EXPECT_EQ(lw.ffn_up.bytes.size(), up_bytes.size() / 2);
  }
}

TEST(ModelLoad, MissingFileIsAnError) {
  auto m = Model::load("/nonexistent/model.gguf");
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("/nonexistent/model.gguf"), std::string::npos) << m.error();
}

// Copies a fixture into a writer, letting the caller drop or replace tensors and metadata.
struct Crafted {
  GgufFile src;
  GgufWriter w;
  std::vector<std::vector<std::byte>> keep;
};

Expected<std::shared_ptr<const Model>> load_crafted(
    const std::string& file, const std::function<void(GgufWriter&)>& edit_meta,
    const std::function<bool(const TensorInfo&, GgufWriter&)>& edit_tensor) {
  auto src = GgufFile::open(model_path(file));
  KILN_CHECK(src.has_value());
  GgufWriter w;
  w.copy_metadata(*src);
  edit_meta(w);
  for (const TensorInfo& t : src->tensors()) {
    if (edit_tensor(t, w)) continue;
    w.add_tensor(t.name, t.dtype, std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims),
                 src->view(t).bytes);
  }
  auto bytes = w.write_to_memory();
  auto g = GgufFile::parse(MappedFile::from_bytes(std::move(bytes), "crafted.gguf"));
  KILN_CHECK(g.has_value(), "{}", g.error());
  return Model::from_gguf(std::move(*g));
}

auto no_meta = [](GgufWriter&) {};
auto no_tensor = [](const TensorInfo&, GgufWriter&) { return false; };

TEST(ModelLoad, CraftedCopyLoads) {
  auto m = load_crafted("stories260K.gguf", no_meta, no_tensor);
  EXPECT_TRUE(m.has_value()) << m.error();
}

TEST(ModelLoad, UnknownArchitecture) {
  auto m = load_crafted(
      "stories260K.gguf", [](GgufWriter& w) { w.set_str("general.architecture", "nonsense"); },
      no_tensor);
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("unknown architecture 'nonsense'"), std::string::npos) << m.error();
}

TEST(ModelLoad, MissingTensorIsNamed) {
  auto m = load_crafted("stories260K.gguf", no_meta, [](const TensorInfo& t, GgufWriter&) {
    return t.name == "blk.3.ffn_up.weight";
  });
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("missing tensor 'blk.3.ffn_up.weight'"), std::string::npos) << m.error();
}

TEST(ModelLoad, ShapeMismatchIsNamed) {
  std::vector<std::byte> zeros;
  auto m = load_crafted("stories260K.gguf", no_meta, [&](const TensorInfo& t, GgufWriter& w) {
    if (t.name != "blk.1.attn_k.weight") return false;
    // One KV head too many: [n_embd x (n_head_kv + 1) * head_dim].
    const int64_t rows = t.ne[1] + t.ne[1] / 4;
    zeros.assign(static_cast<size_t>(t.ne[0] * rows * 4), std::byte{0});
    w.add_tensor(t.name, DType::F32, {t.ne[0], rows}, zeros);
    return true;
  });
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("tensor 'blk.1.attn_k.weight': shape"), std::string::npos) << m.error();
}

TEST(ModelLoad, MissingRequiredKeyIsNamed) {
  auto m = load_crafted(
      "stories260K.gguf", [](GgufWriter& w) { w.remove("llama.block_count"); }, no_tensor);
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("llama.block_count"), std::string::npos) << m.error();
}

TEST(ModelLoad, BadHeadCountIsAnError) {
  auto m = load_crafted(
      "stories260K.gguf", [](GgufWriter& w) { w.set_u32("llama.attention.head_count_kv", 3); },
      no_tensor);
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("head_count_kv"), std::string::npos) << m.error();
}

TEST(ModelLoad, ExpertUsedCountAboveExpertCountIsAnError) {
  auto m = load_crafted(
      "qwen3moe-q4_k_m.gguf", [](GgufWriter& w) { w.set_u32("qwen3moe.expert_used_count", 9); },
      no_tensor);
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("qwen3moe.expert_used_count"), std::string::npos) << m.error();
}

TEST(ModelLoad, Qwen3MoeWithoutExpertCountIsAnError) {
  auto m = load_crafted(
      "qwen3moe-q4_k_m.gguf", [](GgufWriter& w) { w.remove("qwen3moe.expert_count"); }, no_tensor);
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("qwen3moe.expert_count"), std::string::npos) << m.error();
}

TEST(ModelLoad, MissingExpertTensorIsNamed) {
  auto m = load_crafted("mixtral-q4_k_m.gguf", no_meta, [](const TensorInfo& t, GgufWriter&) {
    return t.name == "blk.1.ffn_down_exps.weight";
  });
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("blk.1.ffn_down_exps.weight"), std::string::npos) << m.error();
}

TEST(ModelLoad, ExpertsOnADenseArchitectureAreAnError) {
  auto m = load_crafted(
      "gemma3-swa-f16.gguf", [](GgufWriter& w) { w.set_u32("gemma3.expert_count", 8); }, no_tensor);
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("gemma3.expert_count"), std::string::npos) << m.error();
}

// LongRoPE: a phi3 file must carry both factor sets; with one alone the load names the other,
// with both it loads (the choice between them: tests/model/rope_factors_test.cpp).
TEST(ModelLoad, Phi3LongRopeNeedsBothFactorSets) {
  static std::vector<float> factors;
  factors.assign(32, 1.5f);  // n_rot / 2 of the fixture
  const char* kSets[] = {"rope_factors_long.weight", "rope_factors_short.weight"};
  for (int present = 0; present < 3; ++present) {  // 0: long only, 1: short only, 2: both
    auto m = load_crafted("phi3-f16.gguf", no_meta, [&](const TensorInfo& t, GgufWriter& w) {
      if (t.name == "output_norm.weight")
        for (int k = 0; k < 2; ++k)
          if (present == 2 || present == k)
            w.add_tensor(kSets[k], DType::F32, {32},
                         std::as_bytes(std::span<const float>(factors)));
      return false;
    });
    if (present == 2) {
      EXPECT_TRUE(m.has_value()) << m.error();
    } else {
      ASSERT_FALSE(m.has_value()) << present;
      EXPECT_NE(m.error().find(kSets[1 - present]), std::string::npos) << m.error();
    }
  }
}

TEST(ModelLoad, Phi3FfnUpNeedsBothHalves) {
  // ffn_up must hold both halves: a phi3 file whose ffn_up has only n_ff rows is refused.
  static std::vector<std::byte> half;
  auto m = load_crafted("phi3-f16.gguf", no_meta, [](const TensorInfo& t, GgufWriter& w) {
    if (t.name != "blk.0.ffn_up.weight") return false;
    half.assign(static_cast<size_t>(t.ne[0] * t.ne[1] / 2 * 2), std::byte{0});
    w.add_tensor(t.name, t.dtype, {t.ne[0], t.ne[1] / 2}, half);
    return true;
  });
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("blk.0.ffn_up.weight"), std::string::npos) << m.error();
}

class SessionInput : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = load_ok("stories260K.gguf");
    ASSERT_TRUE(model_);
    be_ = make_ref_backend();
  }
  std::shared_ptr<const Model> model_;
  std::unique_ptr<Backend> be_;
};

TEST_F(SessionInput, EmptyPromptIsAnError) {
  Session s(model_, *be_, 32);
  auto r = s.eval({}, false);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().find("empty"), std::string::npos);
  EXPECT_EQ(s.n_pos(), 0);
}

TEST_F(SessionInput, TokenOutOfRangeIsAnError) {
  Session s(model_, *be_, 32);
  const std::vector<int32_t> bad = {1, model_->n_vocab()};
  auto r = s.eval(bad, false);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().find("outside the vocabulary"), std::string::npos) << r.error();
  const std::vector<int32_t> neg = {-1};
  EXPECT_FALSE(s.eval(neg, false).has_value());
  EXPECT_EQ(s.n_pos(), 0);
}

TEST_F(SessionInput, PromptLongerThanContextIsAnError) {
  Session s(model_, *be_, 16);
  std::vector<int32_t> toks(17, 1);
  auto r = s.eval(toks, true);
  ASSERT_FALSE(r.has_value());
  EXPECT_NE(r.error().find("context"), std::string::npos) << r.error();
  EXPECT_EQ(s.n_pos(), 0);
  toks.resize(16);
  ASSERT_TRUE(s.eval(toks, false).has_value());
  EXPECT_EQ(s.n_pos(), 16);
  const std::vector<int32_t> one = {1};
  EXPECT_FALSE(s.eval(one, false).has_value());  // full context: the next token overflows
  EXPECT_EQ(s.n_pos(), 16);
}

TEST_F(SessionInput, ReferenceRejectsTheSameInputs) {
  model::ReferenceSession r(model_->hparams(), model_->weights(), 8);
  EXPECT_FALSE(r.eval({}, false).has_value());
  std::vector<int32_t> toks(9, 1);
  EXPECT_FALSE(r.eval(toks, false).has_value());
  EXPECT_EQ(r.n_pos(), 0);
}

TEST_F(SessionInput, RollbackReproducesLogits) {
  Session s(model_, *be_, 64);
  const std::vector<int32_t> prompt = {1, 403, 407, 261, 300, 310, 320};
  auto first = s.eval(prompt, false);
  ASSERT_TRUE(first.has_value()) << first.error();
  const std::vector<float> want(first->begin(), first->end());
  const std::vector<int32_t> other = {5, 6, 7};
  ASSERT_TRUE(s.eval(other, false).has_value());
  ASSERT_TRUE(s.rollback(3).is_ok());
  EXPECT_EQ(s.n_pos(), 3);
  EXPECT_FALSE(s.rollback(4).is_ok());
  auto again = s.eval(std::span(prompt).subspan(3), false);
  ASSERT_TRUE(again.has_value());
  ASSERT_EQ(again->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ((*again)[i], want[i]) << i;
}

// An eval longer than the session's largest step runs in chunks; the logits must equal
// those of the same tokens fed in separate evals. gemma2 (window 8): the chunks also wrap
// the ring planes of its sliding-window layers.
void check_chunking(const std::string& file, Backend& be) {
  auto m = load_ok(file);
  ASSERT_TRUE(m);
  std::vector<int32_t> toks(45);
  for (size_t i = 0; i < toks.size(); ++i)
    toks[i] = static_cast<int32_t>((i * 37 + 1) % m->n_vocab());
  const size_t V = static_cast<size_t>(m->n_vocab());
  Session whole(m, be, 64, /*max_batch=*/8);
  auto a = whole.eval(toks, true);
  ASSERT_TRUE(a.has_value()) << a.error();
  const std::vector<float> all(a->begin(), a->end());
  ASSERT_EQ(all.size(), toks.size() * V);
  Session parts(m, be, 64, /*max_batch=*/8);
  std::vector<float> got;
  for (size_t start : {size_t(0), size_t(5), size_t(6), size_t(30)}) {
    const size_t end = start == 30 ? toks.size() : (start == 0 ? 5 : (start == 5 ? 6 : 30));
    auto b = parts.eval(std::span(toks).subspan(start, end - start), true);
    ASSERT_TRUE(b.has_value()) << b.error();
    got.insert(got.end(), b->begin(), b->end());
  }
  ASSERT_EQ(got.size(), all.size());
  double worst = 0;
  for (size_t i = 0; i < all.size(); ++i)
    worst = std::max(worst, double(std::fabs(all[i] - got[i])));
  EXPECT_LE(worst, 1e-4) << file;
  // Last-token logits of a chunked eval are the last row of the all-logits eval.
  Session last(m, be, 64, /*max_batch=*/8);
  auto c = last.eval(toks, false);
  ASSERT_TRUE(c.has_value());
  ASSERT_EQ(c->size(), V);
  for (size_t i = 0; i < V; ++i) ASSERT_NEAR((*c)[i], all[all.size() - V + i], 1e-4) << file;
}

TEST_F(SessionInput, ChunkedEvalMatchesSeparateEvals) {
  check_chunking("stories260K.gguf", *be_);
  check_chunking("gemma2-swa-f16.gguf", *be_);
}

}  // namespace
}  // namespace kiln
