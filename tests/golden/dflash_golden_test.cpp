// tests/golden/dflash_golden_test.cpp: DFlash block drafting on the shipped pair
// (dflash-target-f16 + dflash-drafter-f16) against llama.cpp's run in golden/dflash.json:
// greedy speculative ids equal plain greedy; step by step, wherever our history matches
// llama.cpp's at the same n_past, the drafts equal llama.cpp's where the drafter's top-1 margin
// is clear, and the drafter's logits are within the README's f16 bounds of
// dflash.draft_logits.f32. Runs on the cpu backend and the scalar ref backend; prints how many
// steps and positions were compared.
#include <filesystem>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "common/testdata.h"
#include "engine/dflash_drafter.h"
#include "engine/speculative.h"
#include "golden.h"
#include "sampling/spec_verify.h"
#if KILN_HAVE_CPU_BACKEND
#include "backend/cpu/cpu_backend.h"
#endif
#if KILN_DFLASH_GOLDEN_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace kiln {
namespace {

constexpr int32_t kCtx = 512;  // llama.cpp's n_ctx for the golden run
// A clear top-1 margin for this f16 pair (the README's unquantized near-tie threshold).
constexpr float kClearMargin = 0.05f;

struct GoldenStep {
  int32_t n_past = 0, id_last = 0, n_accepted = 0;
  std::vector<int32_t> draft;
  std::vector<float> margin;  // drafter's top-1 - top-2 logit per drafted position
};

struct GoldenRun {
  std::vector<int32_t> prompt, greedy;
  std::vector<GoldenStep> steps;
  int32_t n_vocab = 0, n_draft = 0;
  std::vector<float> draft_logits;  // [steps][n_draft][n_vocab]
};

GoldenRun load_golden() {
  const auto j = nlohmann::json::parse(
      testing::read_file(testing::shared_path("testdata/golden/dflash.json")));
  GoldenRun g;
  g.prompt = j.at("prompt_tokens").get<std::vector<int32_t>>();
  g.greedy = j.at("greedy").get<std::vector<int32_t>>();
  g.n_vocab = j.at("n_vocab").get<int32_t>();
  g.n_draft = j.at("params").at("n_draft").get<int32_t>();
  for (const auto& s : j.at("steps")) {
    GoldenStep st;
    st.n_past = s.at("n_past").get<int32_t>();
    st.id_last = s.at("id_last").get<int32_t>();
    st.n_accepted = s.at("n_accepted").get<int32_t>();
    st.draft = s.at("draft").get<std::vector<int32_t>>();
    for (const auto& top : s.at("draft_top")) {
      const auto l = top.at("logits").get<std::vector<float>>();
      st.margin.push_back(l.size() >= 2 ? l[0] - l[1] : 0.0f);
    }
    g.steps.push_back(std::move(st));
  }
  const std::string raw =
      testing::read_file(testing::shared_path("testdata/golden/dflash.draft_logits.f32"));
  g.draft_logits.resize(raw.size() / sizeof(float));
  std::memcpy(g.draft_logits.data(), raw.data(), g.draft_logits.size() * sizeof(float));
  EXPECT_EQ(g.draft_logits.size(), g.steps.size() * size_t(g.n_draft) * size_t(g.n_vocab));
  return g;
}

std::unique_ptr<Backend> make_backend(const std::string& which) {
#if KILN_DFLASH_GOLDEN_CUDA
  // Default options: the drafter's weights live in a mapping of their own, outside any
  // weight region given to the backend.
  if (which == "cuda" && cuda_device_count() > 0) {
    auto be = make_cuda_backend();
    EXPECT_TRUE(be) << be.error();
    if (be) return std::move(*be);
  }
#endif
#if KILN_HAVE_CPU_BACKEND
  if (which == "cpu") return make_cpu_backend({.threads = 2});
#endif
  if (which == "ref") return make_ref_backend();
  return nullptr;
}

// What one speculative run on a backend produced against llama.cpp's run.
struct Comparison {
  std::vector<int32_t> ids;
  int steps_compared = 0, steps_same_acceptance = 0;
  int positions_compared = 0, positions_matched = 0, positions_unclear = 0;
  std::vector<std::string> draft_mismatches;  // "step S position P: ours A, llama.cpp B"
  int logit_rows = 0, logits_out_of_bounds = 0;
  double worst_abs = 0, worst_excess = -1e9, mean_kl = 0;
  uint64_t accepted = 0, drafted = 0, steps = 0;
};

// KL(p || q) of two logit rows (p: llama.cpp's).
double kl_divergence(std::span<const float> ref, std::span<const float> ours) {
  double mr = -1e30, mo = -1e30;
  for (size_t t = 0; t < ref.size(); ++t) {
    mr = std::max(mr, double(ref[t]));
    mo = std::max(mo, double(ours[t]));
  }
  double zr = 0, zo = 0;
  for (size_t t = 0; t < ref.size(); ++t) {
    zr += std::exp(double(ref[t]) - mr);
    zo += std::exp(double(ours[t]) - mo);
  }
  double kl = 0;
  for (size_t t = 0; t < ref.size(); ++t) {
    const double lp = double(ref[t]) - mr - std::log(zr);
    const double lq = double(ours[t]) - mo - std::log(zo);
    kl += std::exp(lp) * (lp - lq);
  }
  return kl;
}

// Runs the golden prompt through kiln's DFlash speculative decoding on `backend` and compares
// each step whose context is llama.cpp's (same n_past, same ids before it).
void run_and_compare(const std::string& backend, const GoldenRun& g, Comparison& c) {
  auto target = Model::load(testing::model_path("dflash-target-f16.gguf"));
  ASSERT_TRUE(target.has_value()) << target.error();
  ASSERT_EQ((*target)->n_vocab(), g.n_vocab);
  std::unique_ptr<Backend> be = make_backend(backend);
  if (!be) GTEST_SKIP() << "backend " << backend << " not built or no device";
  Session session(*target, *be, kCtx);
  auto drafter = DflashDrafter::create(testing::model_path("dflash-drafter-f16.gguf"), *target, *be,
                                       kCtx, session.max_batch());
  ASSERT_TRUE(drafter.has_value()) << drafter.error();
  (*drafter)->set_keep_logits(true);
  ASSERT_EQ((*drafter)->max_draft(), g.n_draft);
  SpecParams sp;
  sp.n_draft = g.n_draft;
  sp.sampling.temperature = 0;  // greedy, as llama.cpp's run
  auto dec = SpeculativeDecoder::create(session, **drafter, sp);
  ASSERT_TRUE(dec.has_value()) << dec.error();
  ASSERT_TRUE((*dec)->start(g.prompt));

  const size_t V = static_cast<size_t>(g.n_vocab);
  const golden::Bounds b = golden::bounds_for(false);
  double kl_sum = 0;
  while (c.ids.size() < g.greedy.size()) {
    auto st = (*dec)->step();
    ASSERT_TRUE(st.has_value()) << st.error();
    // The golden step with the same context: same n_past, and the same ids before it (equal
    // ids mean the same features in the drafter's cache).
    const auto it = std::find_if(g.steps.begin(), g.steps.end(),
                                 [&](const GoldenStep& s) { return s.n_past == st->n_past; });
    const size_t n_cmp = std::min(c.ids.size(), g.greedy.size());
    const bool same_history =
        std::equal(c.ids.begin(), c.ids.begin() + ptrdiff_t(n_cmp), g.greedy.begin());
    if (it != g.steps.end() && same_history) {
      ASSERT_EQ(st->draft.size(), it->draft.size());
      ++c.steps_compared;
      c.steps_same_acceptance += st->n_accepted == it->n_accepted;
      const size_t si = static_cast<size_t>(it - g.steps.begin());
      const std::span<const float> ours = (*drafter)->last_logits();
      ASSERT_EQ(ours.size(), it->draft.size() * V);
      for (size_t i = 0; i < it->draft.size(); ++i) {
        if (it->margin[i] >= kClearMargin) {
          ++c.positions_compared;
          if (st->draft[i] == it->draft[i])
            ++c.positions_matched;
          else
            c.draft_mismatches.push_back(fmt::format("step {} position {}: ours {}, llama.cpp {}",
                                                     si, i, st->draft[i], it->draft[i]));
        } else {
          ++c.positions_unclear;
        }
        // Logits: the README's f16 bound over llama.cpp's top-10 of the row, KL over all.
        const std::span<const float> row = ours.subspan(i * V, V);
        const std::span<const float> ref(g.draft_logits.data() + (si * size_t(g.n_draft) + i) * V,
                                         V);
        std::vector<int32_t> order(V);
        for (size_t t = 0; t < V; ++t) order[t] = static_cast<int32_t>(t);
        std::partial_sort(order.begin(), order.begin() + 10, order.end(),
                          [&](int32_t a, int32_t d) { return ref[a] > ref[d]; });
        for (int r = 0; r < 10; ++r) {
          const size_t t = static_cast<size_t>(order[r]);
          const double d = std::fabs(double(row[t]) - double(ref[t]));
          const double bound = b.abs + b.rel * std::fabs(double(ref[t]));
          c.worst_abs = std::max(c.worst_abs, d);
          c.worst_excess = std::max(c.worst_excess, d - bound);
          c.logits_out_of_bounds += d > bound;
        }
        kl_sum += kl_divergence(ref, row);
        ++c.logit_rows;
      }
    }
    c.ids.insert(c.ids.end(), st->tokens.begin(), st->tokens.end());
  }
  c.ids.resize(g.greedy.size());
  c.mean_kl = c.logit_rows ? kl_sum / c.logit_rows : 0;
  c.accepted = (*dec)->stats().accepted;
  c.drafted = (*dec)->stats().drafted;
  c.steps = (*dec)->stats().steps;
  fmt::print(
      "  dflash {:<4} ids {} llama.cpp's; steps compared {}/{} (ours {}), same acceptance {}; "
      "drafts at clear-margin positions matched {}/{} ({} near-ties skipped); drafter logits "
      "worst |\u0394| {:.4f} (excess over bound {:+.4f}, {} of {} top-10 values out of bounds), "
      "mean KL {:.3g} over {} rows; accepted {}/{} drafts\n",
      backend, c.ids == g.greedy ? "equal" : "differ from", c.steps_compared, g.steps.size(),
      c.steps, c.steps_same_acceptance, c.positions_matched, c.positions_compared,
      c.positions_unclear, c.worst_abs, c.worst_excess, c.logits_out_of_bounds, c.logit_rows * 10,
      c.mean_kl, c.logit_rows, c.accepted, c.drafted);
  for (const std::string& m : c.draft_mismatches) fmt::print("    draft mismatch: {}\n", m);
}

class DflashGolden : public ::testing::TestWithParam<std::string> {
 protected:
  // The GPU machine gets the fixtures that fit its transfer limit (scripts/gpu-check
  // --prepare); on the CPU backends a missing file fails loudly (load_golden).
  void SetUp() override {
    if (GetParam() == "cuda" &&
        !std::filesystem::exists(testing::shared_dir() + "/testdata/golden/dflash.json"))
      GTEST_SKIP() << "dflash.json was not carried to this machine";
  }
};

// The output contract and the speculative schedule: kiln's greedy ids are llama.cpp's plain
// greedy ids, every one of llama.cpp's steps happens at the same n_past in kiln's run and
// accepts as many drafts there.
TEST_P(DflashGolden, IdsAndStepsMatchLlamaCpp) {
  const GoldenRun g = load_golden();
  Comparison c;
  run_and_compare(GetParam(), g, c);
  if (::testing::Test::IsSkipped() || ::testing::Test::HasFatalFailure()) return;
  EXPECT_EQ(c.ids, g.greedy) << "speculative greedy ids differ from llama.cpp's plain greedy";
  EXPECT_EQ(c.steps_compared, static_cast<int>(g.steps.size()));
  EXPECT_EQ(c.steps_same_acceptance, static_cast<int>(g.steps.size()));
  uint64_t golden_accepted = 0;
  for (const GoldenStep& st : g.steps) golden_accepted += uint64_t(st.n_accepted);
  EXPECT_EQ(c.accepted, golden_accepted);
}

// The drafter's own numbers against golden/dflash.json: drafts equal llama.cpp's wherever its
// top-1 margin is clear, and logits within the README's f16 bounds. DISABLED, and left so on
// purpose: the golden drafter figures are not what llama.cpp 0.7.0's own DFlash path computes
// for the same tokens. llama-server 0.7.0 (the peer) put in golden step 0's context (the first
// 148 prompt tokens, anchor 366 at position 148) drafts top-3 [331 498 477], [431 306 500],
// [456 306 477], [306 456 336] with the same top-10 probabilities as kiln to within 0.005
// (DrafterMatchesLlamaServer below), where dflash.json has [331 476 495], [306 431 477],
// [477 456 306], [477 306 408]; at step 1 the server's top-3 again equal kiln's and not the
// file's. So the file's generator gave its drafter another context for the prompt than
// llama.cpp's server does, most likely not the target's layer inputs (zeroing kiln's prompt
// features moves it halfway to the file: mean KL 0.060 -> 0.034, 75/76 clear drafts), and its
// later steps carry that context. kiln must not copy that: it would discard the drafter's
// conditioning on the prompt. The ids and the speculative schedule (IdsAndStepsMatchLlamaCpp) still
// hold. Run with
// --gtest_also_run_disabled_tests to see the figures (cpu: 73/76 clear drafts, mean KL 0.060).
TEST_P(DflashGolden, DISABLED_DraftsAndLogitsWithinF16Bounds) {
  const GoldenRun g = load_golden();
  Comparison c;
  run_and_compare(GetParam(), g, c);
  if (::testing::Test::IsSkipped() || ::testing::Test::HasFatalFailure()) return;
  EXPECT_TRUE(c.draft_mismatches.empty());
  EXPECT_EQ(c.logits_out_of_bounds, 0);
  EXPECT_LE(c.mean_kl, 1e-4);
}

// The drafter against llama-server 0.7.0 (the peer): tests/golden/dflash_server_peer.json
// holds, for contexts of the shipped pair, the server's first proposal after a forced anchor:
// per drafted position the top-3 ids and their probabilities under its top-10 draft sampler
// (3 decimals). kiln's drafter must give the same top-3 ids (where the server's gap to the
// next candidate is clear) and the same probabilities within 0.01 (printing rounds to 0.0005,
// the rest is f16 KV and attention rounding: 0.0045 on cpu and ref; the prompt features
// golden/dflash.json's generator gave its drafter move them by up to 0.64).
TEST_P(DflashGolden, DrafterMatchesLlamaServer) {
  const auto j = nlohmann::json::parse(
      testing::read_file(testing::source_path("tests/golden/dflash_server_peer.json")));
  const GoldenRun g = load_golden();
  auto target = Model::load(testing::model_path("dflash-target-f16.gguf"));
  ASSERT_TRUE(target.has_value()) << target.error();
  std::unique_ptr<Backend> be = make_backend(GetParam());
  if (!be) GTEST_SKIP() << "backend " << GetParam() << " not built or no device";
  Session session(*target, *be, kCtx);
  auto drafter = DflashDrafter::create(testing::model_path("dflash-drafter-f16.gguf"), *target, *be,
                                       kCtx, session.max_batch());
  ASSERT_TRUE(drafter.has_value()) << drafter.error();
  (*drafter)->set_keep_logits(true);
  SpecParams sp;
  sp.n_draft = g.n_draft;
  sp.sampling.temperature = 0;
  auto dec = SpeculativeDecoder::create(session, **drafter, sp);
  ASSERT_TRUE(dec.has_value()) << dec.error();

  const size_t V = static_cast<size_t>(g.n_vocab);
  constexpr double kProbTol = 0.01, kClearGap = 0.01;
  double worst = 0;
  int n_ids = 0, n_probs = 0;
  for (const auto& ctx : j.at("contexts")) {
    const int32_t n_past = ctx.at("n_past").get<int32_t>();
    std::vector<int32_t> tokens(g.prompt.begin(), g.prompt.begin() + n_past);
    tokens.push_back(ctx.at("anchor").get<int32_t>());
    // start() evaluates all but the last token; the first step drafts after that anchor.
    ASSERT_TRUE((*dec)->start(tokens));
    auto st = (*dec)->step();
    ASSERT_TRUE(st.has_value()) << st.error();
    ASSERT_EQ(st->n_past, n_past);
    const std::span<const float> logits = (*drafter)->last_logits();
    const auto& top3 = ctx.at("top3");
    ASSERT_EQ(logits.size(), top3.size() * V);
    for (size_t i = 0; i < top3.size(); ++i) {
      const std::span<const float> row = logits.subspan(i * V, V);
      std::vector<int32_t> order(V);
      for (size_t t = 0; t < V; ++t) order[t] = static_cast<int32_t>(t);
      std::partial_sort(order.begin(), order.begin() + 10, order.end(), [&](int32_t a, int32_t b) {
        return row[size_t(a)] > row[size_t(b)] || (row[size_t(a)] == row[size_t(b)] && a < b);
      });
      double z = 0;
      for (int r = 0; r < 10; ++r)
        z += std::exp(double(row[size_t(order[r])] - row[size_t(order[0])]));
      const auto prob = [&](int32_t id) {
        return std::exp(double(row[size_t(id)] - row[size_t(order[0])])) / z;
      };
      for (size_t r = 0; r < top3[i].size(); ++r) {
        const int32_t id = top3[i][r].at(0).get<int32_t>();
        const double p = top3[i][r].at(1).get<double>();
        const double next = r + 1 < top3[i].size() ? top3[i][r + 1].at(1).get<double>() : -1.0;
        const std::string where = fmt::format("n_past {} position {} rank {}", n_past, i, r);
        if (p - next >= kClearGap) {
          EXPECT_EQ(order[r], id) << where;
          ++n_ids;
        }
        const double d = std::fabs(prob(id) - p);
        worst = std::max(worst, d);
        EXPECT_LE(d, kProbTol) << where << ": id " << id << " ours " << prob(id) << ", server "
                               << p;
        ++n_probs;
      }
    }
  }
  fmt::print(
      "  dflash {:<4} vs llama-server 0.7.0: {} contexts, {} clear top-3 ids equal, {} "
      "probabilities, worst |\u0394p| {:.4f}\n",
      GetParam(), j.at("contexts").size(), n_ids, n_probs, worst);
}

// The drafter as a decoder sees it, but asking for host copies of the captures: the features
// then take the host gather and upload instead of staying in the backend's memory.
class HostFeatures final : public Drafter {
 public:
  explicit HostFeatures(DflashDrafter& d) : d_(d) {}
  std::string name() const override { return d_.name(); }
  Status propose(const DraftRequest& req, Draft& out) override { return d_.propose(req, out); }
  Status prepare(std::span<const int32_t> prompt) override { return d_.prepare(prompt); }
  std::vector<std::string> wanted_captures() const override { return d_.wanted_captures(); }
  void observe_target(const model::Capture& c, int32_t n) override { d_.observe_target(c, n); }
  Status rollback(int32_t n_pos) override { return d_.rollback(n_pos); }

 private:
  DflashDrafter& d_;
};

// The drafts do not depend on where the features and logits live: features kept in the
// backend's memory or copied to the host, drafted ids by the backend's top-1 or logits shipped
// too (each draft then the host argmax of its row), every step's drafts and acceptance the
// same over the golden prompt.
TEST_P(DflashGolden, DraftsTheSameWhereverFeaturesAndLogitsLive) {
  const GoldenRun g = load_golden();
  auto target = Model::load(testing::model_path("dflash-target-f16.gguf"));
  ASSERT_TRUE(target.has_value()) << target.error();
  std::unique_ptr<Backend> be = make_backend(GetParam());
  if (!be) GTEST_SKIP() << "backend " << GetParam() << " not built or no device";
  const size_t V = static_cast<size_t>(g.n_vocab);
  struct Run {
    bool host_features, keep_logits;
    std::vector<std::vector<int32_t>> drafts;
    std::vector<int32_t> accepted;
  };
  Run runs[] = {{false, false, {}, {}}, {false, true, {}, {}}, {true, false, {}, {}}};
  for (Run& r : runs) {
    Session session(*target, *be, kCtx);
    auto drafter = DflashDrafter::create(testing::model_path("dflash-drafter-f16.gguf"), *target,
                                         *be, kCtx, session.max_batch());
    ASSERT_TRUE(drafter.has_value()) << drafter.error();
    (*drafter)->set_keep_logits(r.keep_logits);
    HostFeatures host(**drafter);
    Drafter& d = r.host_features ? static_cast<Drafter&>(host) : **drafter;
    SpecParams sp;
    sp.n_draft = g.n_draft;
    sp.sampling.temperature = 0;
    auto dec = SpeculativeDecoder::create(session, d, sp);
    ASSERT_TRUE(dec.has_value()) << dec.error();
    ASSERT_TRUE((*dec)->start(g.prompt));
    size_t n_ids = 0;
    while (n_ids < g.greedy.size()) {
      auto st = (*dec)->step();
      ASSERT_TRUE(st.has_value()) << st.error();
      const std::span<const float> logits = (*drafter)->last_logits();
      if (r.keep_logits) {
        ASSERT_EQ(logits.size(), st->draft.size() * V);
        for (size_t i = 0; i < st->draft.size(); ++i)
          EXPECT_EQ(st->draft[i], argmax_id(logits.subspan(i * V, V))) << "position " << i;
      } else {
        EXPECT_TRUE(logits.empty());
      }
      r.drafts.push_back(st->draft);
      r.accepted.push_back(st->n_accepted);
      n_ids += st->tokens.size();
    }
  }
  EXPECT_EQ(runs[1].drafts, runs[0].drafts) << "logits shipped";
  EXPECT_EQ(runs[2].drafts, runs[0].drafts) << "host features";
  EXPECT_EQ(runs[1].accepted, runs[0].accepted);
  EXPECT_EQ(runs[2].accepted, runs[0].accepted);
  uint64_t total = 0;
  for (int32_t a : runs[0].accepted) total += uint64_t(a);
  EXPECT_GT(total, 0u) << "no draft accepted: the comparison would not see a wrong feature";
}

#if KILN_DFLASH_GOLDEN_CUDA
// kiln_cuda_golden_tests: skipped without a GPU.
INSTANTIATE_TEST_SUITE_P(Cuda, DflashGolden, ::testing::Values("cuda"),
                         [](const auto& info) { return info.param; });
#else
INSTANTIATE_TEST_SUITE_P(Backends, DflashGolden, ::testing::Values("cpu", "ref"),
                         [](const auto& info) { return info.param; });
#endif

}  // namespace
}  // namespace kiln
