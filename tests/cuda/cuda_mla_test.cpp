// tests/cuda/cuda_mla_test.cpp: a deepseek2 model of DeepSeek-V3's attention width (latent
// rows of kv_lora 512 + rope 64 = 576 values, past the 256 of the narrow attention kernels)
// made by `kiln mkmodel`, run end to end on the CUDA backend beside the CPU backend: a long
// prompt (prefill through the wide attention kernel, logits at every position), then greedy
// decode replayed from graphs (one query over a padded key list split over blocks). The
// golden bounds of an f16 model between the two and a relative RMS bound; greedy ids equal
// wherever the CPU's margin is past the golden near-tie. Skips with a message when no GPU is
// present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "common/run_kiln.h"
#include "common/testdata.h"
#include "engine/runtime.h"
#include "engine/session.h"
#include "golden/golden.h"

namespace kiln {
namespace {

int32_t argmax(std::span<const float> l) {
  return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
}

// The gap between the best logit of `l` and the next one.
float margin(std::span<const float> l) {
  const int32_t best = argmax(l);
  float second = -INFINITY;
  for (size_t i = 0; i < l.size(); ++i)
    if (static_cast<int32_t>(i) != best) second = std::max(second, l[i]);
  return l[static_cast<size_t>(best)] - second;
}

TEST(CudaMla, DeepseekV3WidthMatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device, CUDA tests skipped";
  // DeepSeek-V3's attention shape at a small width: 16 heads of 128 + 64 query dims, values of
  // 128, q-LoRA, a 512-wide latent; dense FFNs (a random router's near ties would move the
  // experts, not the attention, under test here).
  const std::string path = testing::temp_dir() + "/deepseek2-576.gguf";
  const testing::KilnProc mk = testing::run_kiln(
      {"mkmodel", "-o",       path,  "--arch",     "deepseek2", "--n-embd", "512",  "--n-layer",
       "2",       "--n-head", "16",  "--head-dim", "192",       "--n-rot",  "64",   "--v-head-dim",
       "128",     "--q-lora", "256", "--kv-lora",  "512",       "--n-ff",   "1024", "--n-vocab",
       "512",     "--type",   "f16", "--seed",     "5",         "-t",       "2"});
  ASSERT_EQ(mk.rc, 0) << mk.err;
  auto loaded = Model::load(path);
  ASSERT_TRUE(loaded.has_value()) << loaded.error();
  const std::shared_ptr<const Model>& m = *loaded;
  const model::HParams& hp = m->hparams();
  ASSERT_TRUE(hp.is_mla());
  ASSERT_EQ(int64_t(hp.mla.kv_lora) + hp.mla.rope, 576);
  ASSERT_EQ(cuda_refusal(hp), "");

  CudaOptions o;
  const GgufFile& f = m->gguf();
  o.weight_region = f.mapping()->bytes().subspan(f.data_offset());
  auto cuda = make_cuda_backend(o);
  ASSERT_TRUE(cuda) << cuda.error();
  auto cpu = make_cpu_backend({});
  Session sc(m, **cuda, 512), sp(m, *cpu, 512);

  const golden::Bounds b = golden::bounds_for(false);
  const auto V = static_cast<size_t>(m->n_vocab());
  double worst = 0, err2 = 0, ref2 = 0;
  int bound_failures = 0;
  auto compare = [&](std::span<const float> got, std::span<const float> want, int step) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      const double d = std::fabs(double(got[i]) - want[i]);
      worst = std::max(worst, d);
      err2 += d * d;
      ref2 += double(want[i]) * want[i];
      if (!(d <= b.abs + b.rel * std::fabs(want[i]))) {
        if (bound_failures++ < 5)
          ADD_FAILURE() << "step " << step << " position " << i / V << " id " << i % V << ": cuda "
                        << got[i] << " cpu " << want[i];
      }
    }
  };

  // The prompt: 300 tokens (every position's logits), past one 256-key slice.
  std::mt19937 rng(11);
  std::vector<int32_t> prompt(300);
  for (int32_t& t : prompt) t = 3 + static_cast<int32_t>(rng() % uint32_t(V - 3));
  auto lc = sc.eval(prompt, true);
  auto lp = sp.eval(prompt, true);
  ASSERT_TRUE(lc.has_value()) << lc.error();
  ASSERT_TRUE(lp.has_value()) << lp.error();
  compare(*lc, *lp, 0);
  std::span<const float> last_c = lc->subspan(lc->size() - V), last_p = lp->subspan(lp->size() - V);

  // Greedy decode, both following the CPU's ids.
  int greedy_checked = 0;
  for (int step = 1; step <= 24; ++step) {
    const int32_t id_c = argmax(last_c), id_p = argmax(last_p);
    if (margin(last_p) >= b.near_tie) {
      EXPECT_EQ(id_c, id_p) << "step " << step << " (cpu margin " << margin(last_p) << ")";
      ++greedy_checked;
    }
    auto sc_step = sc.eval(std::span<const int32_t>(&id_p, 1), false);
    auto sp_step = sp.eval(std::span<const int32_t>(&id_p, 1), false);
    ASSERT_TRUE(sc_step.has_value()) << sc_step.error();
    ASSERT_TRUE(sp_step.has_value()) << sp_step.error();
    compare(*sc_step, *sp_step, step);
    last_c = *sc_step;
    last_p = *sp_step;
  }
  EXPECT_EQ(bound_failures, 0);
  // The random model's logits are small (rms ~0.4), so the golden absolute bound alone is
  // loose: the relative RMS error over every logit compared is held to fast_vs_reference's
  // CPU bound too (the CPU backend against the reference: ~5e-5 here).
  const double rel = std::sqrt(err2 / std::max(ref2, 1e-30));
  EXPECT_LE(rel, 1e-2);
  // Seed 5 and these shapes: 11 of the 24 CPU margins are past the near tie.
  EXPECT_GE(greedy_checked, 8) << "too many near ties to say the ids agree";
  const CudaStats st = (*cuda)->stats();
  EXPECT_GE(st.graph_replays, 10u);
  fmt::print(
      "  deepseek2 576-wide latent rows: worst |dlogit| {:.2e}, relative rms {:.2e}, {} of "
      "24 greedy ids past the near tie, {} graph replays\n",
      worst, rel, greedy_checked, st.graph_replays);
}

}  // namespace
}  // namespace kiln
