// tests/model/fail_closed_test.cpp: nothing in a GGUF is silently ignored (issue 34, point 1).
// Every shipped fixture that kiln loads is copied with one tensor no architecture binds, and
// separately with a rope scaling value (and other math-changing keys) kiln does not compute:
// each copy must be refused with one line naming the tensor or the key and its value.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "common/testdata.h"
#include "core/check.h"
#include "engine/session.h"
#include "format/gguf_writer.h"

namespace kiln {
namespace {

// The fixture's bytes rewritten: metadata edited by `edit_meta`, then every tensor, then the
// tensors `add` appends.
Expected<std::shared_ptr<const Model>> load_edited(
    const std::string& path, const std::function<void(GgufWriter&, const std::string&)>& edit_meta,
    const std::function<void(GgufWriter&)>& add) {
  auto src = GgufFile::open(path);
  KILN_CHECK(src.has_value(), "{}", src.error());
  const std::string arch = *src->get<std::string>("general.architecture");
  GgufWriter w;
  w.copy_metadata(*src);
  edit_meta(w, arch);
  for (const TensorInfo& t : src->tensors())
    w.add_tensor(t.name, t.dtype, std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims),
                 src->view(t).bytes);
  add(w);
  auto bytes = w.write_to_memory();
  auto g = GgufFile::parse(MappedFile::from_bytes(std::move(bytes), "edited.gguf"));
  KILN_CHECK(g.has_value(), "{}", g.error());
  return Model::from_gguf(std::move(*g));
}

// Every fixture in testdata/models that loads as shipped (the others are refused already:
// unknown architectures or types, which other tests pin).
std::vector<std::string> loadable_fixtures() {
  std::vector<std::string> out;
  const std::filesystem::path dir = testing::shared_dir() + "/testdata/models";
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".gguf" && Model::load(e.path().string()).has_value())
      out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

const std::vector<std::string>& fixtures() {
  static const std::vector<std::string> f = loadable_fixtures();
  return f;
}

auto no_meta = [](GgufWriter&, const std::string&) {};
auto no_add = [](GgufWriter&) {};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(FailClosed, TheFixturesKilnSupportsLoad) {
  // The list must hold the architectures this suite is about, or the tests below prove little.
  std::vector<std::string> names;
  for (const std::string& p : fixtures()) names.push_back(std::filesystem::path(p).stem());
  for (const char* must : {"stories260K", "llama-gqa-q4_k_m", "qwen3-bpe-f16", "gemma2-swa-f16",
                           "gemma3-swa-f16", "muse-glimmer-f16", "qwen3moe-f16", "mixtral-q4_k_m",
                           "llama3-ropefreqs-f16", "llama3-ropefreqs-q4_k_m", "qwen2-yarn-f16",
                           "qwen2-yarn-q8_0", "gpt-oss-f16", "gpt-oss-mxfp4_moe"})
    EXPECT_NE(std::find(names.begin(), names.end(), must), names.end()) << must;
}

TEST(FailClosed, AnUnusedTensorRefusesTheLoad) {
  static const float kZeros[16] = {};
  for (const std::string& path : fixtures()) {
    SCOPED_TRACE(path);
    for (const char* name : {"blk.0.foo.weight", "rope_freqs_extra.weight", "output.bias"}) {
      auto m = load_edited(path, no_meta, [&](GgufWriter& w) {
        w.add_tensor(name, DType::F32, {16}, std::as_bytes(std::span(kZeros)));
      });
      ASSERT_FALSE(m.has_value()) << name;
      EXPECT_TRUE(contains(m.error(), std::string("tensor '") + name + "' is not used by"))
          << m.error();
    }
  }
}

TEST(FailClosed, RopeFreqsOnAnArchitectureWithoutThemIsRefused) {
  static const float kOnes[32] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                  1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  auto m = load_edited(testing::model_path("qwen3-bpe-f16.gguf"), no_meta, [](GgufWriter& w) {
    w.add_tensor("rope_freqs.weight", DType::F32, {32}, std::as_bytes(std::span(kOnes)));
  });
  ASSERT_FALSE(m.has_value());
  EXPECT_TRUE(contains(m.error(), "tensor 'rope_freqs.weight' is not used by architecture 'qwen3'"))
      << m.error();
}

TEST(FailClosed, AnUnknownRopeScalingTypeRefusesTheLoad) {
  for (const std::string& path : fixtures()) {
    SCOPED_TRACE(path);
    auto m = load_edited(
        path,
        [](GgufWriter& w, const std::string& arch) {
          w.set_str(arch + ".rope.scaling.type", "dynamic-ntk");
          w.set_f32(arch + ".rope.scaling.factor", 2.0f);
        },
        no_add);
    ASSERT_FALSE(m.has_value());
    EXPECT_TRUE(contains(m.error(), ".rope.scaling.type' = 'dynamic-ntk' is not supported"))
        << m.error();
  }
}

// Keys whose value changes the math in llama.cpp, set to a value kiln does not compute.
TEST(FailClosed, UnimplementedMathKeysRefuseTheLoad) {
  struct Case {
    const char* suffix;
    std::function<void(GgufWriter&, const std::string&)> set;
    const char* value;
  };
  const Case cases[] = {
      {"rope.scaling.yarn_log_multiplier",
       [](GgufWriter& w, const std::string& k) { w.set_f32(k, 0.1f); }, "0.1"},
      {"attention.scale", [](GgufWriter& w, const std::string& k) { w.set_f32(k, 0.5f); }, "0.5"},
      {"expert_gating_func", [](GgufWriter& w, const std::string& k) { w.set_u32(k, 2); }, "2"},
      {"expert_weights_scale", [](GgufWriter& w, const std::string& k) { w.set_f32(k, 2.5f); },
       "2.5"},
      {"expert_shared_count", [](GgufWriter& w, const std::string& k) { w.set_u32(k, 1); }, "1"},
      {"attention.causal", [](GgufWriter& w, const std::string& k) { w.set_bool(k, false); },
       "false"},
      {"rope.dimension_sections",
       [](GgufWriter& w, const std::string& k) {
         w.set_i32_array(k, {8, 8, 8, 0});
       },
       "(array)"},
  };
  for (const char* file : {"stories260K.gguf", "qwen3moe-q4_k_m.gguf", "gemma2-swa-q8_0.gguf"}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(file) + " " + c.suffix);
      auto m = load_edited(
          testing::model_path(file),
          [&](GgufWriter& w, const std::string& arch) { c.set(w, arch + "." + c.suffix); }, no_add);
      ASSERT_FALSE(m.has_value());
      EXPECT_TRUE(contains(m.error(), std::string(c.suffix) + "' = " + c.value)) << m.error();
    }
  }
  // A sliding window on an architecture whose layers all attend fully would be ignored.
  auto m = load_edited(
      testing::model_path("stories260K.gguf"),
      [](GgufWriter& w, const std::string& arch) {
        w.set_u32(arch + ".attention.sliding_window", 64);
      },
      no_add);
  ASSERT_FALSE(m.has_value());
  EXPECT_TRUE(contains(m.error(), "has no sliding-window layers")) << m.error();
}

// DeepSeek sparse attention's keys: refused by name on an architecture without it, and on
// glm-dsa checked for what the indexer needs (one layer type per layer, a full layer first,
// no GLM-5.2 default layout guessed).
TEST(FailClosed, SparseAttentionKeysAreCheckedByName) {
  auto on_deepseek2 = load_edited(
      testing::model_path("deepseek2-mla-f16.gguf"),
      [](GgufWriter& w, const std::string& arch) {
        w.set_u32(arch + ".attention.indexer.top_k", 128);
      },
      no_add);
  ASSERT_FALSE(on_deepseek2.has_value());
  EXPECT_TRUE(contains(on_deepseek2.error(),
                       "'deepseek2.attention.indexer.top_k' = 128 (DeepSeek sparse attention) is "
                       "not supported"))
      << on_deepseek2.error();
  struct Case {
    std::function<void(GgufWriter&, const std::string&)> edit;
    const char* error;
  };
  const Case cases[] = {
      {[](GgufWriter& w, const std::string& a) {
         w.set_i32_array(a + ".attention.indexer.types", {1, 0});
       },
       "'glm-dsa.attention.indexer.types': expected an array of 3 bools"},
      {[](GgufWriter& w, const std::string& a) {
         w.set_i32_array(a + ".attention.indexer.types", {0, 1, 1});
       },
       "layer 0 is shared"},
      {[](GgufWriter& w, const std::string& a) {
         w.remove(a + ".attention.indexer.types");
         w.set_u32(a + ".context_length", 1u << 20);
       },
       "GLM-5.2's built-in indexer layout) is not supported"},
      {[](GgufWriter& w, const std::string& a) { w.remove(a + ".attention.indexer.top_k"); },
       "missing metadata key 'glm-dsa.attention.indexer.top_k'"},
  };
  for (const Case& c : cases) {
    auto m = load_edited(testing::model_path("glm5-f16.gguf"), c.edit, no_add);
    ASSERT_FALSE(m.has_value()) << c.error;
    EXPECT_TRUE(contains(m.error(), c.error)) << m.error();
  }
  // Without the types key a GLM-5 / 5.1 file (context below 2^20) has every layer full.
  auto all_full = load_edited(
      testing::model_path("glm5-f16.gguf"),
      [](GgufWriter& w, const std::string& a) { w.remove(a + ".attention.indexer.types"); },
      no_add);
  ASSERT_TRUE(all_full.has_value()) << all_full.error();
  for (const model::LayerDesc& L : (*all_full)->hparams().layers)
    EXPECT_EQ(L.indexer, model::IndexerKind::Full);
  EXPECT_EQ((*all_full)->hparams().n_indexer_kv, 3);
}

// The values kiln implements still load: the refusals above are about the value, not the key.
TEST(FailClosed, ImplementedValuesOfMathKeysLoad) {
  auto m = load_edited(
      testing::model_path("qwen3moe-q4_k_m.gguf"),
      [](GgufWriter& w, const std::string& arch) {
        w.set_u32(arch + ".expert_gating_func", 1);
        w.set_bool(arch + ".expert_weights_norm", true);
        w.set_f32(arch + ".rope.scaling.yarn_log_multiplier", 0.0f);
        w.set_bool(arch + ".attention.causal", true);
        w.set_str(arch + ".rope.scaling.type", "none");
      },
      no_add);
  EXPECT_TRUE(m.has_value()) << m.error();
}

}  // namespace
}  // namespace kiln
