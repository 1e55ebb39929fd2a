// tests/moe/cli/expert_flags_test.cpp: the expert-streaming options through the `kiln`
// binary: `kiln run` prints byte-identical text and the same ids hash with streaming on
// (caps, a byte budget, prefetch) as with it off; a budget below one token's experts is a
// one-line error; --stats shows the store's counters.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>

#include "common/run_kiln.h"
#include "common/testdata.h"

extern char** environ;

namespace kiln {
namespace {

using Proc = testing::KilnProc;
using testing::run_kiln;

std::string ids_line(const std::string& err) {
  const size_t at = err.find("ids xxh64 ");
  return at == std::string::npos ? "" : err.substr(at, err.find('\n', at) - at);
}

TEST(ExpertFlags, RunOutputIsIdenticalWithStreamingOnAndOff) {
  for (const char* file : {"qwen3moe-q4_k_m.gguf", "mixtral-q4_k_m.gguf"}) {
    SCOPED_TRACE(file);
    const std::vector<std::string> base = {"run", "-m", testing::model_path(file), "-p",
                                           "Once upon a time", "-n", "12", "--threads", "2"};
    const Proc off = run_kiln(base);
    ASSERT_EQ(off.rc, 0) << off.err;
    ASSERT_FALSE(ids_line(off.err).empty()) << off.err;
    for (std::vector<std::string> flags :
         {std::vector<std::string>{"--expert-cap", "2"}, {"--expert-cap", "3", "--expert-prefetch"},
          {"--expert-cache", "50000000"}}) {
      std::vector<std::string> args = base;
      args.insert(args.end(), flags.begin(), flags.end());
      const Proc on = run_kiln(args);
      ASSERT_EQ(on.rc, 0) << on.err;
      EXPECT_EQ(on.out, off.out) << flags[0] << " " << flags[1];
      EXPECT_EQ(ids_line(on.err), ids_line(off.err));
    }
  }
}

TEST(ExpertFlags, TooSmallBudgetIsOneLineErrorAndStatsShowCounters) {
  const std::string m = testing::model_path("qwen3moe-q4_k_m.gguf");
  const Proc bad = run_kiln({"run", "-m", m, "-p", "x", "-n", "2", "--expert-cap", "1"});
  EXPECT_EQ(bad.rc, 1) << bad.err;
  EXPECT_NE(bad.err.find("--expert-cap 1 is below the 2 experts"), std::string::npos) << bad.err;
  EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << bad.err;
  const Proc st = run_kiln({"run", "-m", m, "-p", "x", "-n", "4", "--expert-cap", "2", "--stats"});
  ASSERT_EQ(st.rc, 0) << st.err;
  EXPECT_NE(st.err.find("moe.expert_misses"), std::string::npos) << st.err;
  EXPECT_NE(st.err.find("load latency p50"), std::string::npos) << st.err;
}

}  // namespace
}  // namespace kiln
