// tests/moe/cli/expert_flags_test.cpp: the expert-streaming options through the `kiln`
// binary: `kiln run` prints byte-identical text and the same ids hash with streaming on
// (caps, a byte budget, prefetch) as with it off; a budget below one token's experts is a
// one-line error; --stats shows the store's counters.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>

#include "common/testdata.h"

extern char** environ;

namespace kiln {
namespace {

struct Proc {
  int rc = -1;
  std::string out, err;
};

Proc run_kiln(std::vector<std::string> args) {
  static const std::string dir = testing::temp_dir();
  const std::string out_path = dir + "/stdout", err_path = dir + "/stderr";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  args.insert(args.begin(), testing::kiln_binary());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  Proc p;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ADD_FAILURE() << "cannot start " << argv[0];
    return p;
  }
  int status = 0;
  waitpid(pid, &status, 0);
  p.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  p.out = testing::read_file(out_path);
  p.err = testing::read_file(err_path);
  return p;
}

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
