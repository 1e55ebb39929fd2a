// tests/e2e/spec_trace_test.cpp: `kiln run --spec-trace FILE` for the speculative modes
// (n-gram lookup, a draft model, DFlash): the JSON holds the generated ids (those printed, and
// with greedy those of plain decoding) and one entry per verify step with n_past, the draft
// and n_accepted, consistent with each other; `kiln run --dflash` on the shipped pair
// reproduces llama.cpp's DFlash run step by step; bad uses are one clear error line.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/run_kiln.h"
#include "common/testdata.h"

namespace kiln {
namespace {
using testing::model_path;
using testing::run_kiln;

std::string story() {
  return testing::read_file(testing::shared_path("testdata/prompts/story.txt"));
}

// Runs `kiln run` greedily with `mode_args` and --spec-trace; returns the trace and checks its
// shape: ids as printed, steps that tile the ids (each step emits n_accepted + 1 tokens from
// n_past on), drafts of at most n_draft tokens, n_accepted <= the draft.
nlohmann::json traced_run(const std::string& model, std::vector<std::string> mode_args, int n,
                          std::string* ids_hash = nullptr) {
  const std::string path = testing::temp_dir() + "/trace.json";
  std::vector<std::string> args = {
      "run",    "-m", model_path(model), "-p", story(),        "-n", std::to_string(n),
      "--temp", "0",  "--threads",       "2",  "--spec-trace", path};
  args.insert(args.end(), mode_args.begin(), mode_args.end());
  const testing::KilnProc p = run_kiln(args);
  EXPECT_EQ(p.rc, 0) << p.err;
  if (p.rc != 0) return {};
  if (ids_hash) *ids_hash = p.err.substr(p.err.find("ids xxh64 "), 26);
  const nlohmann::json t = nlohmann::json::parse(testing::read_file(path));
  EXPECT_TRUE(t.at("ids").is_array());
  EXPECT_EQ(t.at("ids").size(), size_t(n));
  const int n_draft = t.at("n_draft").get<int>();
  const int n_prompt = t.at("prompt_tokens").get<int>();
  int emitted = 0;
  for (const auto& s : t.at("steps")) {
    EXPECT_EQ(s.at("n_past").get<int>(), n_prompt - 1 + emitted);
    const auto draft = s.at("draft").get<std::vector<int32_t>>();
    const int a = s.at("n_accepted").get<int>();
    EXPECT_LE(static_cast<int>(draft.size()), n_draft);
    EXPECT_GE(a, 0);
    EXPECT_LE(a, static_cast<int>(draft.size()));
    // The accepted drafts are the ids the step emitted.
    for (int i = 0; i < a && emitted + i < n; ++i)
      EXPECT_EQ(draft[size_t(i)], t.at("ids")[size_t(emitted + i)].get<int32_t>());
    emitted += a + 1;
  }
  EXPECT_GE(emitted, n);
  return t;
}

std::string plain_hash(const std::string& model, int n) {
  const testing::KilnProc p = run_kiln({"run", "-m", model_path(model), "-p", story(), "-n",
                                        std::to_string(n), "--temp", "0", "--threads", "2"});
  EXPECT_EQ(p.rc, 0) << p.err;
  return p.err.substr(p.err.find("ids xxh64 "), 26);
}

TEST(KilnSpecTrace, NgramModeShape) {
  std::string h;
  const auto t = traced_run("stories260K.gguf", {"--spec-ngram"}, 40, &h);
  ASSERT_FALSE(t.is_null());
  EXPECT_EQ(t.at("mode"), "ngram");
  EXPECT_EQ(h, plain_hash("stories260K.gguf", 40));
}

TEST(KilnSpecTrace, DraftModelModeShape) {
  std::string h;
  const auto t =
      traced_run("stories260K.gguf", {"--draft", model_path("stories260K-q8_0.gguf")}, 40, &h);
  ASSERT_FALSE(t.is_null());
  EXPECT_EQ(t.at("mode"), "draft-model");
  EXPECT_EQ(h, plain_hash("stories260K.gguf", 40));
}

// The shipped pair through the CLI: llama.cpp's ids, and its steps where they line up.
TEST(KilnSpecTrace, DflashMatchesLlamaCppRun) {
  const auto g = nlohmann::json::parse(
      testing::read_file(testing::shared_path("testdata/golden/dflash.json")));
  const int n = static_cast<int>(g.at("greedy").size());
  const auto t = traced_run(
      "dflash-target-f16.gguf",
      {"--dflash", model_path("dflash-drafter-f16.gguf"), "--draft-n", "4", "-c", "512"}, n);
  ASSERT_FALSE(t.is_null());
  EXPECT_EQ(t.at("mode"), "dflash");
  EXPECT_EQ(t.at("ids"), g.at("greedy"));
  EXPECT_EQ(t.at("prompt_tokens").get<size_t>(), g.at("prompt_tokens").size());
  int same = 0;
  for (const auto& gs : g.at("steps"))
    for (const auto& s : t.at("steps"))
      if (s.at("n_past") == gs.at("n_past")) {
        same += s.at("draft") == gs.at("draft") && s.at("n_accepted") == gs.at("n_accepted");
        break;
      }
  std::printf("kiln run --dflash: %d of %zu llama.cpp steps reproduced exactly (%zu steps)\n", same,
              g.at("steps").size(), t.at("steps").size());
  EXPECT_GE(same * 4, static_cast<int>(g.at("steps").size()) * 3);
}

TEST(KilnSpecTrace, BadUsesAreOneLine) {
  testing::expect_clean_error(
      run_kiln({"run", "-m", model_path("stories260K.gguf"), "-p", "Hi", "-n", "4", "--spec-trace",
                testing::temp_dir() + "/t.json"}),
      "--spec-trace needs speculative decoding");
  testing::expect_clean_error(run_kiln({"run", "-m", model_path("stories260K.gguf"), "-p", "Hi",
                                        "-n", "4", "--cuda-trace"}),
                              "--cuda-trace in kiln run traces speculative decoding");
  testing::expect_clean_error(
      run_kiln({"run", "-m", model_path("dflash-target-f16.gguf"), "-p", "Hi", "-n", "4",
                "--dflash", model_path("dflash-drafter-f16.gguf"), "--draft-n", "6"}),
      "exceeds the DFlash drafter's block");
  testing::expect_clean_error(
      run_kiln({"run", "-m", model_path("stories260K.gguf"), "-p", "Hi", "-n", "4", "--dflash",
                model_path("dflash-drafter-f16.gguf")}),
      "width 256 differs from the target's 64");
  testing::expect_clean_error(
      run_kiln({"run", "-m", model_path("dflash-drafter-f16.gguf"), "-p", "Hi", "-n", "4"}),
      "is a drafter");
}

}  // namespace
}  // namespace kiln
