// tests/engine/dflash_drafter_test.cpp: the DFlash drafter without golden data: bad drafter
// files are refused with one line naming what is wrong (wrong architecture, vocabulary or
// width mismatch with the target, target layers out of range, missing mask token, keys and
// tensors kiln does not implement); a drafter is never loaded as a model of its own; a
// proposal leaves the drafter's cache at the accepted history; greedy DFlash output equals
// plain greedy on the cpu backend with drafts of every length 1..block-1.
#include <gtest/gtest.h>

#include <functional>

#include "backend/cpu/cpu_backend.h"
#include "common/testdata.h"
#include "engine/dflash_drafter.h"
#include "format/gguf_writer.h"

namespace kiln {
namespace {

constexpr int32_t kCtx = 512;

std::shared_ptr<const Model> target() {
  auto m = Model::load(testing::model_path("dflash-target-f16.gguf"));
  EXPECT_TRUE(m.has_value()) << m.error();
  return m ? *m : nullptr;
}

// A copy of the shipped drafter with `edit` applied to its metadata, and tensors filtered or
// added by `tensors`.
std::string edited_drafter(
    const std::string& name, const std::function<void(GgufWriter&)>& edit,
    const std::function<bool(const TensorInfo&)>& keep = [](const TensorInfo&) { return true; },
    bool add_embd = false) {
  auto g = GgufFile::open(testing::model_path("dflash-drafter-f16.gguf"));
  EXPECT_TRUE(g.has_value()) << g.error();
  GgufWriter w;
  w.copy_metadata(*g);
  edit(w);
  std::vector<std::byte> zeros;
  for (const TensorInfo& t : g->tensors()) {
    if (!keep(t)) continue;
    w.add_tensor(t.name, t.dtype, std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims),
                 g->view(t).bytes);
  }
  if (add_embd) {
    zeros.assign(256 * 512 * 2, std::byte{0});
    w.add_tensor("token_embd.weight", DType::F16, {256, 512}, zeros);
  }
  const std::string path = testing::temp_dir() + "/" + name + ".gguf";
  const Status s = w.write(path);
  EXPECT_TRUE(s.is_ok()) << s.message();
  return path;
}

// The drafter at `path` is refused beside the shipped target with one line containing `what`.
void expect_refused(const std::string& path, const std::string& what) {
  auto t = target();
  ASSERT_TRUE(t);
  auto be = make_cpu_backend({.threads = 1});
  auto d = DflashDrafter::create(path, t, *be, kCtx, 512);
  ASSERT_FALSE(d.has_value()) << path << " was accepted";
  EXPECT_NE(d.error().find(what), std::string::npos) << d.error();
  EXPECT_EQ(d.error().find('\n'), std::string::npos) << d.error();
}

TEST(DflashDrafter, RefusesWrongArchitecture) {
  expect_refused(testing::model_path("dflash-target-f16.gguf"),
                 "architecture 'llama' is not a DFlash drafter");
}

TEST(DflashDrafter, RefusesVocabularyMismatch) {
  expect_refused(
      edited_drafter("vocab", [](GgufWriter& w) { w.set_u32("dflash.vocab_size", 600); }),
      "vocabulary has 600 tokens but the target's has 512");
}

TEST(DflashDrafter, RefusesTargetLayersOutOfRange) {
  expect_refused(edited_drafter("layers",
                                [](GgufWriter& w) {
                                  w.set_i32_array("dflash.target_layers", {1, 5});
                                }),
                 "names layer 5, outside the target's [0, 4]");
  expect_refused(edited_drafter("layers_neg",
                                [](GgufWriter& w) {
                                  w.set_i32_array("dflash.target_layers", {-1, 3});
                                }),
                 "names layer -1");
}

TEST(DflashDrafter, RefusesMissingMaskToken) {
  expect_refused(
      edited_drafter("mask", [](GgufWriter& w) { w.remove("tokenizer.ggml.mask_token_id"); }),
      "missing metadata key 'tokenizer.ggml.mask_token_id'");
  expect_refused(
      edited_drafter("mask_range",
                     [](GgufWriter& w) { w.set_u32("tokenizer.ggml.mask_token_id", 512); }),
      "tokenizer.ggml.mask_token_id");
}

TEST(DflashDrafter, RefusesWhatItDoesNotImplement) {
  expect_refused(
      edited_drafter("swa", [](GgufWriter& w) { w.set_u32("dflash.attention.sliding_window", 8); }),
      "metadata 'dflash.attention.sliding_window' is not supported");
  expect_refused(
      edited_drafter("causal", [](GgufWriter& w) { w.set_bool("dflash.attention.causal", true); }),
      "dflash.attention.causal");
  expect_refused(edited_drafter(
                     "own_embd", [](GgufWriter&) {}, [](const TensorInfo&) { return true; }, true),
                 "tensor 'token_embd.weight'");
  expect_refused(
      edited_drafter(
          "no_fc", [](GgufWriter&) {}, [](const TensorInfo& t) { return t.name != "fc.weight"; }),
      "missing tensor 'fc.weight'");
}

TEST(DflashDrafter, IsNotAModelOfItsOwn) {
  auto m = Model::load(testing::model_path("dflash-drafter-f16.gguf"));
  ASSERT_FALSE(m.has_value());
  EXPECT_NE(m.error().find("is a drafter"), std::string::npos) << m.error();
}

std::vector<int32_t> prompt_ids(int32_t n) {
  std::vector<int32_t> ids{1};
  for (int32_t i = 1; i < n; ++i) ids.push_back(3 + (i * 37) % 500);
  return ids;
}

// Greedy DFlash ids equal plain greedy for every draft length, and after every step the
// drafter holds exactly the target's accepted positions (the block rows are gone again).
TEST(DflashDrafter, GreedyEqualsPlainAtEveryDraftLength) {
  auto t = target();
  ASSERT_TRUE(t);
  auto be = make_cpu_backend({.threads = 2});
  const std::vector<int32_t> prompt = prompt_ids(40);
  constexpr int32_t kGen = 40;
  std::vector<int32_t> plain;
  {
    Session s(t, *be, kCtx);
    auto l = s.eval(prompt, false);
    ASSERT_TRUE(l.has_value()) << l.error();
    for (int32_t i = 0; i < kGen; ++i) {
      int32_t best = 0;
      for (int32_t v = 1; v < static_cast<int32_t>(l->size()); ++v)
        if ((*l)[v] > (*l)[best]) best = v;
      plain.push_back(best);
      const int32_t one[1] = {best};
      l = s.eval(one, false);
      ASSERT_TRUE(l.has_value()) << l.error();
    }
  }
  for (int32_t k = 1; k <= 4; ++k) {
    Session s(t, *be, kCtx, /*max_batch=*/16);  // the prefill reaches the drafter in chunks
    auto d = DflashDrafter::create(testing::model_path("dflash-drafter-f16.gguf"), t, *be, kCtx,
                                   s.max_batch());
    ASSERT_TRUE(d.has_value()) << d.error();
    SpecParams sp;
    sp.n_draft = k;
    sp.sampling.temperature = 0;  // greedy verification
    auto dec = SpeculativeDecoder::create(s, **d, sp);
    ASSERT_TRUE(dec.has_value()) << dec.error();
    ASSERT_TRUE((*dec)->start(prompt));
    EXPECT_EQ((*d)->n_pos(), static_cast<int32_t>(prompt.size()) - 1);
    std::vector<int32_t> ids;
    while (static_cast<int32_t>(ids.size()) < kGen) {
      auto st = (*dec)->step();
      ASSERT_TRUE(st.has_value()) << st.error();
      EXPECT_EQ(static_cast<int32_t>(st->draft.size()), k);
      ids.insert(ids.end(), st->tokens.begin(), st->tokens.end());
      EXPECT_EQ((*d)->n_pos(), s.n_pos());
    }
    ids.resize(kGen);
    EXPECT_EQ(ids, plain) << "draft length " << k;
  }
}

// A target batch longer than the drafter's rows (a drafter made for a smaller batch than the
// session's) reaches the drafter's cache in chunks: every step drafts and accepts what the
// drafter fed in one piece does (the features of each chunk are the right tokens' rows).
TEST(DflashDrafter, ChunkedFeaturesDraftTheSame) {
  auto t = target();
  ASSERT_TRUE(t);
  auto be = make_cpu_backend({.threads = 2});
  const std::vector<int32_t> prompt = prompt_ids(40);
  std::vector<std::vector<int32_t>> drafts[2];
  std::vector<int32_t> accepted[2];
  for (int chunked = 0; chunked < 2; ++chunked) {
    Session s(t, *be, kCtx, /*max_batch=*/16);
    // Rows: max(batch, block size 5), so the prompt's 16-token batches arrive as 5 + 5 + 5 + 1.
    auto d = DflashDrafter::create(testing::model_path("dflash-drafter-f16.gguf"), t, *be, kCtx,
                                   chunked ? 1 : s.max_batch());
    ASSERT_TRUE(d.has_value()) << d.error();
    SpecParams sp;
    sp.n_draft = 4;
    sp.sampling.temperature = 0;
    auto dec = SpeculativeDecoder::create(s, **d, sp);
    ASSERT_TRUE(dec.has_value()) << dec.error();
    ASSERT_TRUE((*dec)->start(prompt));
    for (int step = 0; step < 12; ++step) {
      auto st = (*dec)->step();
      ASSERT_TRUE(st.has_value()) << st.error();
      drafts[chunked].push_back(st->draft);
      accepted[chunked].push_back(st->n_accepted);
    }
  }
  EXPECT_EQ(drafts[1], drafts[0]);
  EXPECT_EQ(accepted[1], accepted[0]);
}

}  // namespace
}  // namespace kiln
