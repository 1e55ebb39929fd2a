// tests/e2e/moe_bench_test.cpp: issue 6's benchmark tooling. `kiln bench`'s weight bytes per
// decoded token (counted from the run's own routing) against an independent count from the
// tensor sizes and expert_used_count; the one-token MoE path (a decode step) bit-identical to
// the general path (the same tokens as one prefill batch); `kiln mkmodel`'s gemma3 and
// qwen3moe shapes load with the hyper-parameters asked for; bad shapes are one-line errors.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/run_kiln.h"
#include "common/testdata.h"
#include "engine/engine_test_util.h"
#include "engine/session.h"
#include "format/gguf.h"

extern char** environ;

namespace kiln {
namespace {

using Proc = testing::KilnProc;
using testing::expect_clean_error;
using testing::run_kiln;

// The weights one decoded token reads, from the file alone: every tensor once, the token
// embedding as one row unless it is also the output matrix (no output.weight), and of each
// layer's stacked experts n_expert_used / n_expert of the bytes (each expert's slice is the
// same size, and one token picks n_expert_used distinct experts per layer).
struct ByteCount {
  double dense = 0, experts = 0;
};
ByteCount count_from_tensors(const std::string& path) {
  auto g = GgufFile::open(path);
  EXPECT_TRUE(g.has_value()) << g.error();
  if (!g) return {};
  const std::string arch = *g->get<std::string>("general.architecture");
  auto n_expert_key = g->get_or<int64_t>(arch + ".expert_count", 0);
  auto n_used_key = g->get_or<int64_t>(arch + ".expert_used_count", 0);
  EXPECT_TRUE(n_expert_key && n_used_key);
  if (!n_expert_key || !n_used_key) return {};
  const double n_expert = double(*n_expert_key), n_used = double(*n_used_key);
  const bool tied = g->find_tensor("output.weight") == nullptr;
  ByteCount c;
  for (const TensorInfo& t : g->tensors()) {
    const std::string& n = t.name;
    if (n.size() > 13 && n.compare(n.size() - 12, 12, "_exps.weight") == 0) {
      EXPECT_EQ(t.ne[2], int64_t(n_expert)) << n;
      c.experts += double(t.n_bytes) / n_expert * n_used;
    } else if (n == "token_embd.weight") {
      c.dense += double(t.n_bytes) / double(t.ne[1]) + (tied ? double(t.n_bytes) : 0.0);
    } else {
      c.dense += double(t.n_bytes);
    }
  }
  return c;
}

// `kiln bench` tg on `path`: its JSON row for the tg test.
nlohmann::json bench_tg(const std::string& path, int n_gen, int reps = 1) {
  const Proc p = run_kiln({"bench", "-m", path, "-p", "0", "-n", std::to_string(n_gen), "-r",
                           std::to_string(reps), "-o", "json", "--threads", "2"});
  EXPECT_EQ(p.rc, 0) << p.err;
  if (p.rc != 0) return {};
  const nlohmann::json j = nlohmann::json::parse(p.out);
  for (const auto& row : j)
    if (row["test"] == "tg" + std::to_string(n_gen)) return row;
  ADD_FAILURE() << "no tg row in " << p.out;
  return {};
}

void expect_bytes_match(const std::string& path) {
  const ByteCount want = count_from_tensors(path);
  ASSERT_GT(want.experts, 0) << path << " has no experts";
  const nlohmann::json r = bench_tg(path, 6);
  ASSERT_FALSE(r.is_null());
  const double dense = r["dense_bytes_per_token"], experts = r["expert_bytes_per_token"];
  const double total = r["bytes_per_token"];
  EXPECT_NEAR(experts, want.experts, want.experts * 1e-9) << path;
  EXPECT_NEAR(dense, want.dense, want.dense * 1e-9) << path;
  EXPECT_NEAR(total, want.dense + want.experts, total * 1e-9) << path;
  // The roofline is the same run's bandwidth over these bytes, and tg a fraction of it.
  const double bw = r["read_gbps"], roof = r["roofline_ts"], frac = r["roofline_fraction"];
  EXPECT_GT(bw, 0);
  EXPECT_NEAR(roof, bw * 1e9 / total, roof * 1e-9);
  EXPECT_NEAR(frac, double(r["avg_ts"]) / roof, frac * 1e-9);
}

TEST(MoeBench, BytesPerTokenEqualsTensorCountQwen3Moe) {
  expect_bytes_match(testing::model_path("qwen3moe-q4_k_m.gguf"));
}

TEST(MoeBench, BytesPerTokenEqualsTensorCountMixtral) {
  expect_bytes_match(testing::model_path("mixtral-q4_k_m.gguf"));
}

TEST(MoeBench, DenseModelReadsNoExpertBytes) {
  const std::string path = testing::model_path("stories260K.gguf");
  const nlohmann::json r = bench_tg(path, 4);
  ASSERT_FALSE(r.is_null());
  EXPECT_EQ(double(r["expert_bytes_per_token"]), 0.0);
  EXPECT_NEAR(double(r["bytes_per_token"]), count_from_tensors(path).dense, 1e-3);
}

// The roofline fraction with several repetitions: each repetition's tokens/s against the
// roofline of its own neighbouring bandwidth probes (read_gbps_samples), the headline figures
// the medians of those, and the range their min and max.
TEST(MoeBench, RooflineFractionIsMedianOfPerRepetitionFractions) {
  const nlohmann::json r = bench_tg(testing::model_path("qwen3moe-q4_k_m.gguf"), 4, 3);
  ASSERT_FALSE(r.is_null());
  const std::vector<double> ts = r["samples_ts"], bw = r["read_gbps_samples"];
  const std::vector<double> fr = r["roofline_fraction_samples"];
  ASSERT_EQ(ts.size(), 3u);
  ASSERT_EQ(bw.size(), 3u);
  ASSERT_EQ(fr.size(), 3u);
  const double bytes = r["bytes_per_token"];
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_GT(bw[i], 0) << i;
    EXPECT_NEAR(fr[i], ts[i] / (bw[i] * 1e9 / bytes), fr[i] * 1e-9) << i;
  }
  auto mid = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[1];
  };
  EXPECT_DOUBLE_EQ(double(r["roofline_fraction"]), mid(fr));
  EXPECT_DOUBLE_EQ(double(r["read_gbps"]), mid(bw));
  EXPECT_NEAR(double(r["roofline_ts"]), mid(bw) * 1e9 / bytes, double(r["roofline_ts"]) * 1e-9);
  EXPECT_DOUBLE_EQ(double(r["roofline_fraction_min"]), *std::min_element(fr.begin(), fr.end()));
  EXPECT_DOUBLE_EQ(double(r["roofline_fraction_max"]), *std::max_element(fr.begin(), fr.end()));
}

// A decode step takes the one-token MoE path (all selected experts in one backend op); a
// prefill batch takes the per-expert gather path. Token by token they must agree bit for bit.
std::vector<float> logits_chunked(const std::shared_ptr<const Model>& m, Backend& be,
                                  std::span<const int32_t> prompt, int32_t chunk) {
  return enginetest::logits_chunked(m, be, prompt, chunk, 256);
}

class MoeDecodePath : public ::testing::TestWithParam<std::string> {};

TEST_P(MoeDecodePath, OneTokenStepsMatchPrefillBitForBit) {
  const auto m = enginetest::load(GetParam());
  ASSERT_NE(m, nullptr);
  auto be = make_cpu_backend({.threads = 2});
  const std::vector<int32_t> prompt = enginetest::random_prompt(40, m->n_vocab(), 11);
  const auto whole = logits_chunked(m, *be, prompt, 64);
  const auto steps = logits_chunked(m, *be, prompt, 1);
  ASSERT_EQ(whole.size(), prompt.size() * size_t(m->n_vocab()));
  ASSERT_EQ(steps.size(), whole.size());
  size_t first_diff = whole.size();
  for (size_t i = 0; i < whole.size() && first_diff == whole.size(); ++i)
    if (std::memcmp(&whole[i], &steps[i], sizeof(float)) != 0) first_diff = i;
  EXPECT_EQ(first_diff, whole.size())
      << GetParam() << ": differs first at token " << first_diff / size_t(m->n_vocab());
}

// The CPU backend's decode-speed kernels (one-token VNNI kernels and their software prefetch)
// change no bits: a decode with the portable kernels (CpuOptions::portable_kernels) gives the
// same logits, memcmp'd, as with the fast ones (the default), on 2 threads.
TEST_P(MoeDecodePath, DecodeSpeedSwitchesChangeNoBits) {
  const auto m = enginetest::load(GetParam());
  ASSERT_NE(m, nullptr);
  auto fast = make_cpu_backend({.threads = 2});
  auto portable = make_cpu_backend({.threads = 2, .portable_kernels = true});
  const std::vector<int32_t> prompt = enginetest::random_prompt(24, m->n_vocab(), 12);
  const auto on = logits_chunked(m, *fast, prompt, 1);
  const auto off = logits_chunked(m, *portable, prompt, 1);
  ASSERT_EQ(on.size(), off.size());
  EXPECT_EQ(0, std::memcmp(on.data(), off.data(), on.size() * sizeof(float))) << GetParam();
}

// The multi-token kernels (v2 batched, prefill) change no bits either: a prefill in 64-token
// chunks (every expert's matmul sees 2+ rows) and 4-token chunks with the portable kernels
// gives the logits of the fast ones, memcmp'd.
TEST_P(MoeDecodePath, BatchKernelSwitchesChangeNoBits) {
  const auto m = enginetest::load(GetParam());
  ASSERT_NE(m, nullptr);
  auto fast = make_cpu_backend({.threads = 2});
  auto portable = make_cpu_backend({.threads = 2, .portable_kernels = true});
  const std::vector<int32_t> prompt = enginetest::random_prompt(40, m->n_vocab(), 13);
  for (int chunk : {64, 4}) {
    const auto on = logits_chunked(m, *fast, prompt, chunk);
    const auto off = logits_chunked(m, *portable, prompt, chunk);
    ASSERT_EQ(on.size(), off.size());
    EXPECT_EQ(0, std::memcmp(on.data(), off.data(), on.size() * sizeof(float)))
        << GetParam() << ", chunks of " << chunk;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, MoeDecodePath,
                         ::testing::Values("qwen3moe-q4_k_m.gguf", "qwen3moe-f16.gguf",
                                           "mixtral-q4_k_m.gguf"),
                         [](const auto& info) {
                           std::string n = info.param.substr(0, info.param.find('.'));
                           std::replace_if(
                               n.begin(), n.end(), [](char c) { return !isalnum(c); }, '_');
                           return n;
                         });

TEST(MkModelShapes, Qwen3MoeLoadsAndBenchCountsItsExperts) {
  const std::string path = testing::temp_dir() + "/moe.gguf";
  const Proc p =
      run_kiln({"mkmodel", "-o",         path,  "--arch",     "qwen3moe", "--n-layer",
                "3",       "--n-embd",   "256", "--n-head",   "4",        "--n-head-kv",
                "2",       "--head-dim", "64",  "--n-expert", "8",        "--n-expert-used",
                "3",       "--n-ff-exp", "256", "--n-vocab",  "600",      "--type",
                "q4_k_m",  "-t",         "2"});
  ASSERT_EQ(p.rc, 0) << p.err;
  auto m = Model::load(path);
  ASSERT_TRUE(m.has_value()) << m.error();
  const model::HParams& hp = (*m)->hparams();
  EXPECT_EQ(hp.n_layer, 3);
  EXPECT_EQ(hp.head_dim_k, 64);
  EXPECT_EQ(hp.q_width(), 256);
  for (const model::LayerDesc& L : hp.layers) {
    EXPECT_EQ(L.n_expert, 8);
    EXPECT_EQ(L.n_expert_used, 3);
    EXPECT_EQ(L.n_ff_expert, 256);
  }
  expect_bytes_match(path);
}

// --router-skew S scales router row e by (1 + e)^-S (a skewed expert popularity for issue 9's
// streaming benchmark); S = 0 leaves the file byte-identical to a run without the option; the
// streaming `--stats` report says how skewed the routing it saw was.
TEST(MkModelShapes, RouterSkewScalesRouterRowsAndStatsReportPopularity) {
  const std::string dir = testing::temp_dir();
  auto make = [&](const std::string& out, const std::vector<std::string>& extra) {
    std::vector<std::string> a = {
        "mkmodel", "-o",         out,   "--arch",     "qwen3moe", "--n-layer",
        "2",       "--n-embd",   "256", "--n-head",   "4",        "--n-head-kv",
        "2",       "--head-dim", "64",  "--n-expert", "16",       "--n-expert-used",
        "2",       "--n-ff-exp", "256", "--n-vocab",  "600",      "--type",
        "f16",     "-t",         "2"};
    a.insert(a.end(), extra.begin(), extra.end());
    const Proc p = run_kiln(a);
    EXPECT_EQ(p.rc, 0) << p.err;
  };
  make(dir + "/plain.gguf", {});
  make(dir + "/zero.gguf", {"--router-skew", "0"});
  make(dir + "/skew.gguf", {"--router-skew", "1.5"});
  EXPECT_EQ(testing::read_file(dir + "/plain.gguf"), testing::read_file(dir + "/zero.gguf"));
  auto plain = GgufFile::open(dir + "/plain.gguf"), skew = GgufFile::open(dir + "/skew.gguf");
  ASSERT_TRUE(plain && skew);
  const auto* tp = plain->find_tensor("blk.0.ffn_gate_inp.weight");
  const auto* ts = skew->find_tensor("blk.0.ffn_gate_inp.weight");
  ASSERT_TRUE(tp && ts);
  ASSERT_EQ(tp->dtype, DType::F32);  // routers stay f32 in every preset
  const auto* rp = reinterpret_cast<const float*>(plain->view(*tp).bytes.data());
  const auto* rs = reinterpret_cast<const float*>(skew->view(*ts).bytes.data());
  for (int64_t e : {0, 1, 7, 15})
    for (int64_t c : {0, 5, 255}) {
      const float want = static_cast<float>(rp[e * 256 + c] * std::pow(1.0 + double(e), -1.5));
      EXPECT_NEAR(rs[e * 256 + c], want, 1e-6f * std::fabs(rp[e * 256 + c]) + 1e-12f)
          << "expert " << e << " col " << c;
    }
  expect_clean_error(run_kiln({"mkmodel", "-o", dir + "/x.gguf", "--router-skew", "-1"}),
                     "router-skew");
  const Proc r = run_kiln({"run", "-m", dir + "/skew.gguf", "-p", "hello world", "-n", "8",
                           "--temp", "0", "--expert-cap", "4", "--stats"});
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.err.find("moe: routing popularity: the most used 25 % of each layer's experts took"),
            std::string::npos)
      << r.err;
  std::filesystem::remove_all(dir);
}

TEST(MkModelShapes, Gemma3HasItsWindowPatternAndTiedOutput) {
  const std::string path = testing::temp_dir() + "/g3.gguf";
  const Proc p = run_kiln(
      {"mkmodel", "-o",       path,  "--arch",        "gemma3", "--n-layer",   "7",   "--n-embd",
       "384",     "--n-ff",   "512", "--n-head",      "4",      "--n-head-kv", "1",   "--head-dim",
       "128",     "--window", "16",  "--swa-pattern", "3",      "--n-vocab",   "700", "--type",
       "q4_k_m",  "-t",       "2"});
  ASSERT_EQ(p.rc, 0) << p.err;
  auto m = Model::load(path);
  ASSERT_TRUE(m.has_value()) << m.error();
  const model::HParams& hp = (*m)->hparams();
  EXPECT_TRUE((*m)->weights().tied_output);
  EXPECT_EQ(hp.head_dim_k, 128);
  for (int32_t il = 0; il < hp.n_layer; ++il) {
    const bool sliding = il % 3 < 2;
    EXPECT_EQ(hp.layers[il].window, sliding ? 16 : 0) << "layer " << il;
  }
  // Runs: a short bench over more tokens than the window wraps every ring.
  const nlohmann::json r = bench_tg(path, 40);
  ASSERT_FALSE(r.is_null());
  EXPECT_NEAR(double(r["bytes_per_token"]), count_from_tensors(path).dense, 1e-3);
}

TEST(MkModelShapes, BadShapesAreOneLineErrors) {
  const std::string out = testing::temp_dir() + "/bad.gguf";
  expect_clean_error(run_kiln({"mkmodel", "-o", out, "--arch", "qwen3moe"}), "--n-expert");
  expect_clean_error(run_kiln({"mkmodel", "-o", out, "--arch", "llama", "--n-expert", "4",
                               "--n-expert-used", "5"}),
                     "--n-expert-used");
  expect_clean_error(run_kiln({"mkmodel", "-o", out, "--arch", "gemma3", "--window", "0"}),
                     "--window");
  expect_clean_error(run_kiln({"mkmodel", "-o", out, "--arch", "gemma3", "--n-expert", "4",
                               "--n-expert-used", "2"}),
                     "gemma3");
  expect_clean_error(run_kiln({"mkmodel", "-o", out, "--arch", "mamba"}), "mamba");
}

}  // namespace
}  // namespace kiln
